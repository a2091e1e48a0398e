"""Sequential self-speculative decoding (RIPE Algorithm 1; DAS Mature-Spec), batch-first.

One block: draft gamma tokens with d loops each, the i-th reading the committed prefix under a
prefix read policy (kappa, nu) and the earlier drafts of the block; verify [x, y_1..y_gamma] in
one R-loop pass under the cache policy; accept the longest prefix on which drafts and verifier
agree (greedy) plus the verifier's next token; commit only the verified tokens' planes. Rows
accept and commit their own counts. With a block-independent cache policy (full, or RIPE with
W >= gamma; Proposition 1) every row emits exactly the tokens of greedy decoding under that policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from looped_kv.decoding.core import (
    Generation,
    Rows,
    accept,
    block_positions,
    check_prompts,
    new_buffer,
    new_cache,
    prefill_rows,
    run_block,
)
from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, PrefixReads


def block_independent(policy: CachePolicy, block: int) -> bool:
    """Proposition 1's premise: batched verification of ``block`` drafts reads what sequential decoding reads."""
    if all(policy.plane(r) == r for r in range(1, policy.num_loops + 1)):
        return True
    return policy.window >= block


def check_speculation(policy: CachePolicy, block: int, exact: bool, draft_loops: int | None = None) -> None:
    """Validate a speculative configuration before any work is done."""
    R = policy.num_loops
    if draft_loops is not None and not 1 <= draft_loops < R:
        raise ValueError(f"draft_loops must be in [1, {R - 1}] (fewer than the R = {R} verification loops), "
                         f"got {draft_loops}")
    if block < 1:
        raise ValueError(f"block (gamma) must be >= 1, got {block}")
    if exact and not block_independent(policy, block):
        raise ValueError(f"cache {policy.name} has window W = {policy.window} < block gamma = {block}: batched "
                         f"verification is then not exact (RIPE Proposition 1). Use window >= block, or pass "
                         f"exact=False to accept block-dependent verification")


def check_reads(policy: CachePolicy, reads: PrefixReads) -> None:
    """Prefix reads must name planes the cache keeps for every position (deep: plane R; fixed: kappa, nu)."""
    R = policy.num_loops
    needed = {reads.pick(which, 0, R) for which in ("key", "value")} - {0}
    missing = sorted(p for p in needed if p not in policy.kept)
    if missing:
        raise ValueError(f"prefix_reads (key {reads.key!r}, value {reads.value!r}) need plane(s) {missing} for every "
                         f"position, but cache {policy.name} keeps only planes {policy.kept}")


def verify(model: LoopedLM, cache: PlaneCache, buffer: BlockBuffer, block: Tensor, num_loops: int) -> Tensor:
    """One R-loop pass over [x, y_1..y_n] (B, n + 1) under the cache policy; planes go to the buffer. Targets."""
    router = BlockPass(cache, block_positions(cache, block.shape[1]), buffer=buffer, store="buffer")
    logits, _ = run_block(model, block, router, num_loops)
    return logits.argmax(-1)


def draft(model: LoopedLM, cache: PlaneCache, buffer: BlockBuffer, pending: Tensor, *, block: int, draft_loops: int,
          reads: PrefixReads) -> Tensor:
    """gamma d-loop drafts (B, gamma), each reading the prefix under ``reads`` and the earlier drafts (same loop)."""
    token, drafts = pending, []
    for i in range(block):
        router = BlockPass(cache, block_positions(cache, 1, offset=i), reads=reads, buffer=buffer, offset=i,
                           store="buffer")
        logits, _ = run_block(model, token, router, draft_loops)
        token = logits[:, -1:].argmax(-1)
        drafts.append(token)
    return torch.cat(drafts, dim=1)


@torch.no_grad()
def self_speculative(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int], *,
                     policy: CachePolicy, draft_loops: int, block: int, reads: PrefixReads, exact: bool = True,
                     eos: int | None = None, progress: bool = False) -> Generation:
    """Greedy self-speculative decoding of B prompts: d-loop drafts, one R-loop verification per block of gamma."""
    prompts, budgets = check_prompts(model, input_ids, max_new_tokens, margin=block + 1)
    check_speculation(policy, block, exact, draft_loops)
    check_reads(policy, reads)
    R, B = policy.num_loops, len(prompts)
    rows = Rows(prompts, budgets, eos, progress, "self-spec")
    cache = new_cache(model, policy, B, max(len(p) + b for p, b in zip(prompts, budgets, strict=True)) + block + 1)
    buffer = new_buffer(model, R, B, block + 1)
    pending = prefill_rows(model, cache, prompts, R)
    rows.emit(list(pending))
    passes = 1
    while True:
        (pending,) = rows.drop_stopped(cache, pending, buffer=buffer)
        if not rows.active:
            break
        drafts = draft(model, cache, buffer, pending, block=block, draft_loops=draft_loops, reads=reads)
        targets = verify(model, cache, buffer, torch.cat([pending, drafts], dim=1), R)
        k = accept(drafts, targets)
        cache.commit(buffer, k + 1)
        pending = targets.gather(1, k[:, None])
        ks = k.tolist()
        rows.record(ks, [block] * len(ks), [1] * len(ks))
        rows.emit([torch.cat([d[:a], p]) for d, a, p in zip(drafts, ks, pending, strict=True)])
        passes += block + 1
    return rows.result(cache, passes, eos, draft_loops=draft_loops, block=block)


def acceptance_by_position(accepted: list[int], block: int) -> list[float]:
    """P(draft i accepted | drafts 1..i-1 accepted), i = 1..gamma (RIPE Figure 5a)."""
    rates = []
    for i in range(1, block + 1):
        reached = sum(1 for k in accepted if k >= i - 1)
        rates.append(sum(1 for k in accepted if k >= i) / reached if reached else float("nan"))
    return rates
