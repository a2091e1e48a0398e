"""DAS-Wave: carried parallel refinement with mature prefix reads and an independent verifier, batch-first.

One block (DAS Appendix B.2), from the materialized prefix cache and each row's anchor x_t (the
pending token at position L):

1. Initialize: provisional guesses repeat the anchor; a newly active position starts from the
   checkpoint's initial state at its absolute position.
2. Refine: for rounds j = 0..J-1, the first W_j = min(gamma, W_init + j) positions (Eq. 5)
   receive k recurrent updates in parallel, reading the verified prefix at deep K/V (Eq. 6)
   and each other's current keys/values; the readout of position i updates guess i + 1.
3. Carry: the updated latent states are kept for the next round (unless ``carry=False``);
   provisional keys/values are discarded.
4. Verify: the full-depth target runs on [x_t, y_1..y_{w-1}] under the cache policy.
5. Commit: accept in order until the first mismatch, emit the target's token there, keep only
   verified planes; the last emitted token becomes the next anchor. Rows commit their own counts.

Because the verifier is the unchanged target, the output equals greedy full-depth decoding
(DAS Proposition 1) whatever the proposal settings.
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
from looped_kv.decoding.settings import WAVE
from looped_kv.decoding.speculative import check_reads, check_speculation, verify
from looped_kv.runtime.cache import BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, PrefixReads

DEEP_KV = PrefixReads("deep", "deep")


def check_wave(block: int, rounds: int, initial_width: int, updates: int) -> None:
    if initial_width < 1:
        raise ValueError(f"initial_width (W_init) must be >= 1, got {initial_width}")
    if block < initial_width:
        raise ValueError(f"block (gamma) must be >= initial_width (W_init) = {initial_width}, got {block}")
    if rounds < 1:
        raise ValueError(f"rounds (J) must be >= 1, got {rounds}")
    if updates < 1:
        raise ValueError(f"updates (k, recurrent updates per round) must be >= 1, got {updates}")


def proposal_width(block: int, rounds: int, initial_width: int) -> int:
    """w: proposals a block tests, the width of the last round, min(gamma, W_init + J - 1) (Eq. 5).

    It also bounds the tokens one verification commits: k < w accepted plus a correction, or all w."""
    return min(block, initial_width + rounds - 1)


def refine(model: LoopedLM, cache: PlaneCache, anchor: Tensor, *, block: int, rounds: int, initial_width: int,
           updates: int, carry: bool, reads: PrefixReads, trace: list[Tensor] | None = None) -> Tensor:
    """Carried parallel refinement (DAS Eq. 5-6) of B rows; returns the proposals y_1..y_w (B, w).

    With ``trace``, each round's guesses after its readout (B, W_j) are appended to it.
    """
    guesses = anchor.expand(-1, block + 1).clone()  # guesses[:, i] conditions position L + i
    states: Tensor | None = None
    for j in range(rounds):
        width = min(block, initial_width + j)
        router = BlockPass(cache, block_positions(cache, width), reads=reads, store=None)
        fresh = model.initial_state(router.positions, anchor.shape[0], last=router.last_position,
                                    tokens=guesses[:, :width])
        if carry and states is not None:  # only newly active positions start from the initial state
            fresh[:, :states.shape[1]] = states
        first_loop = 1 + (j * updates if carry else 0)
        logits, states = run_block(model, guesses[:, :width], router, updates, fresh, first_loop=first_loop)
        guesses[:, 1:width + 1] = logits.argmax(-1)  # shifted readout
        if trace is not None:
            trace.append(guesses[:, 1:width + 1].clone())
    return guesses[:, 1:width + 1]


@torch.no_grad()
def das_wave(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int], *,
             policy: CachePolicy, block: int = WAVE["block"], rounds: int = WAVE["rounds"],
             initial_width: int = WAVE["initial_width"], updates: int = WAVE["updates"], carry: bool = WAVE["carry"],
             reads: PrefixReads = DEEP_KV, exact: bool = True, eos: int | None = None,
             progress: bool = False) -> Generation:
    """DAS-Wave decoding of B prompts; defaults are the paper's Huginn configuration (gamma 32, J 24, W_init 2, k 2)."""
    check_wave(block, rounds, initial_width, updates)
    prompts, budgets = check_prompts(model, input_ids, max_new_tokens, margin=block + 1)
    check_speculation(policy, block, exact)
    check_reads(policy, reads)
    R, B = policy.num_loops, len(prompts)
    w = proposal_width(block, rounds, initial_width)
    rows = Rows(prompts, budgets, eos, progress, "das-wave")
    cache = new_cache(model, policy, B, max(len(p) + b for p, b in zip(prompts, budgets, strict=True)) + block + 1)
    buffer = new_buffer(model, R, B, block)
    anchor = prefill_rows(model, cache, prompts, R)
    rows.emit(list(anchor))
    passes = 1
    while True:
        (anchor,) = rows.drop_stopped(cache, anchor, buffer=buffer)
        if not rows.active:
            break
        proposals = refine(model, cache, anchor, block=block, rounds=rounds, initial_width=initial_width,
                           updates=updates, carry=carry, reads=reads)
        targets = verify(model, cache, buffer, torch.cat([anchor, proposals[:, :-1]], dim=1), R)
        k = accept(proposals, targets)
        corrected = k < w  # with m = w proposals tested there is no bonus token when all agree
        cache.commit(buffer, torch.where(corrected, k + 1, w))
        fixes = targets.gather(1, k.clamp(max=w - 1)[:, None])
        anchor = torch.where(corrected[:, None], fixes, proposals[:, -1:])
        ks, fixed = k.tolist(), corrected.tolist()
        rows.record(ks, [w] * len(ks), [int(c) for c in fixed])
        rows.emit([torch.cat([p[:a], f]) if c else p for p, a, f, c in zip(proposals, ks, fixes, fixed, strict=True)])
        passes += rounds + 1
    return rows.result(cache, passes, eos, block=block, rounds=rounds, initial_width=initial_width, updates=updates,
                       carry=carry)
