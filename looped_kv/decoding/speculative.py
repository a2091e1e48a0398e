"""Sequential self-speculative decoding (RIPE Algorithm 1; DAS Mature-Spec) and prompt lookup decoding.

One step: draft gamma tokens with d loops each, the i-th reading the committed prefix under a
prefix read policy (kappa, nu) and the earlier drafts of the block; verify [x, y_1..y_gamma]
in one R-loop pass under the cache policy; accept the longest prefix on which drafts and
verifier agree (greedy) plus the verifier's next token; commit only the verified tokens'
planes. With a block-independent cache policy (full, or RIPE with W >= gamma; Proposition 1)
the emitted tokens are exactly those of sequential greedy decoding under that policy.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.decoding.greedy import Generation, check_prompt, new_cache, prefill, run_block
from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, PrefixReads


def block_independent(policy: CachePolicy, block: int) -> bool:
    """Proposition 1's premise: batched verification of ``block`` drafts reads what sequential decoding reads."""
    if all(policy.plane(r) == r for r in range(1, policy.num_loops + 1)):
        return True
    return policy.window >= block


def check_speculation(policy: CachePolicy, block: int, exact: bool, batch: int,
                      draft_loops: int | None = None) -> None:
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
    if batch != 1:
        raise ValueError(f"speculative decoders run one sequence at a time (batch 1), got batch {batch}")


def check_reads(policy: CachePolicy, reads: PrefixReads) -> None:
    """Prefix reads must name planes the cache keeps for every position (deep: plane R; fixed: kappa, nu)."""
    R = policy.num_loops
    needed = {reads.pick(which, 0, R) for which in ("key", "value")} - {0}
    missing = sorted(p for p in needed if p not in policy.kept)
    if missing:
        raise ValueError(f"prefix_reads (key {reads.key!r}, value {reads.value!r}) need plane(s) {missing} for every "
                         f"position, but cache {policy.name} keeps only planes {policy.kept}")


def verify(model: LoopedLM, cache: PlaneCache, buffer: BlockBuffer, block: Tensor, num_loops: int) -> Tensor:
    """One R-loop pass over [x, y_1..y_n] under the cache policy; planes go to the buffer. Returns targets."""
    start = cache.length
    router = BlockPass(cache, range(start, start + block.shape[1]), buffer=buffer, store="buffer")
    logits, _ = run_block(model, block, router, num_loops)
    return logits.argmax(-1)


def verify_and_commit(model: LoopedLM, cache: PlaneCache, buffer: BlockBuffer, pending: Tensor, drafts: Tensor,
                      num_loops: int) -> tuple[int, Tensor]:
    """Verify [x, y_1..y_n], commit the planes of x and the accepted drafts; (accepted k, next pending token)."""
    targets = verify(model, cache, buffer, torch.cat([pending, drafts], dim=1), num_loops)
    k = accept(drafts, targets)
    cache.commit(buffer, k + 1)
    return k, targets[:, k:k + 1]


def accept(drafts: Tensor, targets: Tensor) -> int:
    """Longest prefix of ``drafts`` (1, n) equal to the verifier's ``targets`` (1, >= n) (greedy acceptance)."""
    mismatch = (drafts[0] != targets[0, :drafts.shape[1]]).nonzero()
    return int(mismatch[0]) if len(mismatch) else drafts.shape[1]


@torch.no_grad()
def self_speculative(model: LoopedLM, input_ids: Tensor, max_new_tokens: int, *, policy: CachePolicy,
                     draft_loops: int, block: int, reads: PrefixReads, exact: bool = True,
                     progress: bool = False) -> Generation:
    """Greedy self-speculative decoding: d-loop drafts, one R-loop verification per block of gamma."""
    prompt = check_prompt(model, input_ids, max_new_tokens, margin=block + 1)
    check_speculation(policy, block, exact, prompt.shape[0], draft_loops)
    check_reads(policy, reads)
    R = policy.num_loops
    start_time = time.perf_counter()
    cache = new_cache(model, policy, 1, prompt.shape[1] + max_new_tokens + block + 1)
    buffer = BlockBuffer(model.config, R, batch=1, capacity=block + 1, dtype=model.dtype, device=model.device)
    pending = prefill(model, cache, prompt, R)[:, -1:].argmax(-1)
    emitted, accepted, passes = [pending], [], 1
    bar = tqdm(total=max_new_tokens, disable=not progress, desc="self-spec", leave=False)
    while sum(t.shape[1] for t in emitted) < max_new_tokens:
        L, token, drafts = cache.length, pending, []
        for i in range(block):
            router = BlockPass(cache, range(L + i, L + i + 1), reads=reads, buffer=buffer, offset=i, store="buffer")
            logits, _ = run_block(model, token, router, draft_loops)
            token = logits[:, -1:].argmax(-1)
            drafts.append(token)
        drafts = torch.cat(drafts, dim=1)
        k, pending = verify_and_commit(model, cache, buffer, pending, drafts, R)
        emitted += [drafts[:, :k], pending]
        accepted.append(k)
        passes += block + 1
        bar.update(k + 1)
    bar.close()
    tokens = torch.cat([prompt, *emitted], dim=1)[:, :prompt.shape[1] + max_new_tokens]
    return Generation(tokens, prompt.shape[1], time.perf_counter() - start_time, verifications=len(accepted),
                      accepted=accepted, drafted=[block] * len(accepted), retained=[1] * len(accepted),
                      forward_passes=passes,
                      extra={"cache_bytes": cache.nbytes, "policy": policy.name, "draft_loops": draft_loops,
                             "block": block})


def lookup_drafts(context: list[int], block: int, ngram: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last n-gram (n = ngram..1)."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + block]
    return []


@torch.no_grad()
def prompt_lookup(model: LoopedLM, input_ids: Tensor, max_new_tokens: int, *, policy: CachePolicy, block: int,
                  ngram: int = 3, exact: bool = True, progress: bool = False) -> Generation:
    """Prompt lookup decoding (Saxena, 2023): n-gram drafts from the context, verified at full depth."""
    prompt = check_prompt(model, input_ids, max_new_tokens, margin=block + 1)
    check_speculation(policy, block, exact, prompt.shape[0])
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    R = policy.num_loops
    start_time = time.perf_counter()
    cache = new_cache(model, policy, 1, prompt.shape[1] + max_new_tokens + block + 1)
    buffer = BlockBuffer(model.config, R, batch=1, capacity=block + 1, dtype=model.dtype, device=model.device)
    pending = prefill(model, cache, prompt, R)[:, -1:].argmax(-1)
    context = [*prompt[0].tolist(), int(pending)]
    emitted, accepted, drafted = [pending], [], []
    bar = tqdm(total=max_new_tokens, disable=not progress, desc="prompt lookup", leave=False)
    while sum(t.shape[1] for t in emitted) < max_new_tokens:
        drafts = torch.tensor([lookup_drafts(context, block, ngram)], dtype=torch.long, device=prompt.device)
        k, pending = verify_and_commit(model, cache, buffer, pending, drafts, R)
        emitted += [drafts[:, :k], pending]
        context += [*drafts[0, :k].tolist(), int(pending)]
        accepted.append(k)
        drafted.append(drafts.shape[1])
        bar.update(k + 1)
    bar.close()
    tokens = torch.cat([prompt, *emitted], dim=1)[:, :prompt.shape[1] + max_new_tokens]
    return Generation(tokens, prompt.shape[1], time.perf_counter() - start_time, verifications=len(accepted),
                      accepted=accepted, drafted=drafted, retained=[1] * len(accepted),
                      forward_passes=1 + len(accepted),
                      extra={"cache_bytes": cache.nbytes, "policy": policy.name, "block": block, "ngram": ngram})


def acceptance_by_position(accepted: list[int], block: int) -> list[float]:
    """P(draft i accepted | drafts 1..i-1 accepted), i = 1..gamma (RIPE Figure 5a)."""
    rates = []
    for i in range(1, block + 1):
        reached = sum(1 for k in accepted if k >= i - 1)
        rates.append(sum(1 for k in accepted if k >= i) / reached if reached else float("nan"))
    return rates
