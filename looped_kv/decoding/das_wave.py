"""DAS-Wave: carried parallel refinement with mature prefix reads and an independent verifier.

One block (DAS Appendix B.2), from the materialized prefix cache and the anchor x_t (the
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
   verified planes; the last emitted token becomes the next anchor.

Because the verifier is the unchanged target, the output equals greedy full-depth decoding
(DAS Proposition 1) whatever the proposal settings.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.decoding.greedy import Generation, check_prompt, new_cache, prefill
from looped_kv.decoding.speculative import accept, check_reads, check_speculation, verify
from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
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
    """Carried parallel refinement (DAS Eq. 5-6); returns the proposals y_1..y_w (1, w).

    With ``trace``, each round's guesses after its readout (1, W_j) are appended to it.
    """
    L = cache.length
    guesses = anchor.expand(1, block + 1).clone()  # guesses[i] conditions position L + i
    states: Tensor | None = None
    for j in range(rounds):
        width = min(block, initial_width + j)
        positions = torch.arange(L, L + width, device=anchor.device)
        fresh = model.initial_state(positions, 1)
        if carry and states is not None:  # only newly active positions start from the initial state
            fresh[:, :states.shape[1]] = states
        router = BlockPass(cache, range(L, L + width), reads=reads, store=None)
        first_loop = 1 + (j * updates if carry else 0)
        logits, states = model(guesses[:, :width], updates, fresh, positions=positions, router=router,
                               first_loop=first_loop, return_state=True)
        guesses[:, 1:width + 1] = logits.argmax(-1)  # shifted readout
        if trace is not None:
            trace.append(guesses[:, 1:width + 1].clone())
    return guesses[:, 1:width + 1]


@torch.no_grad()
def das_wave(model: LoopedLM, input_ids: Tensor, max_new_tokens: int, *, policy: CachePolicy, block: int = 32,
             rounds: int = 24, initial_width: int = 2, updates: int = 2, carry: bool = True,
             reads: PrefixReads = DEEP_KV, exact: bool = True,
             progress: bool = False) -> Generation:
    """DAS-Wave decoding; defaults are the paper's Huginn configuration (gamma 32, J 24, W_init 2, k 2)."""
    check_wave(block, rounds, initial_width, updates)
    prompt = check_prompt(model, input_ids, max_new_tokens, margin=block + 1)
    check_speculation(policy, block, exact, prompt.shape[0])
    check_reads(policy, reads)
    R = policy.num_loops
    start_time = time.perf_counter()
    cache = new_cache(model, policy, 1, prompt.shape[1] + max_new_tokens + block + 1)
    buffer = BlockBuffer(model.config, R, batch=1, capacity=block, dtype=model.dtype, device=model.device)
    anchor = prefill(model, cache, prompt, R)[:, -1:].argmax(-1)
    emitted, accepted, retained = [anchor], [], []
    bar = tqdm(total=max_new_tokens, disable=not progress, desc="das-wave", leave=False)
    while sum(t.shape[1] for t in emitted) < max_new_tokens:
        proposals = refine(model, cache, anchor, block=block, rounds=rounds, initial_width=initial_width,
                           updates=updates, carry=carry, reads=reads)
        w = proposals.shape[1]
        targets = verify(model, cache, buffer, torch.cat([anchor, proposals[:, :-1]], dim=1), R)
        k = accept(proposals, targets)
        corrected = k < w  # with m = w proposals tested there is no bonus token when all agree
        cache.commit(buffer, k + 1 if corrected else w)
        anchor = targets[:, k:k + 1] if corrected else proposals[:, -1:]
        emitted += [proposals[:, :k], targets[:, k:k + 1]] if corrected else [proposals]
        accepted.append(k)
        retained.append(int(corrected))
        bar.update(k + int(corrected))
    bar.close()
    tokens = torch.cat([prompt, *emitted], dim=1)[:, :prompt.shape[1] + max_new_tokens]
    return Generation(tokens, prompt.shape[1], time.perf_counter() - start_time, verifications=len(accepted),
                      accepted=accepted, drafted=[proposal_width(block, rounds, initial_width)] * len(accepted),
                      retained=retained, forward_passes=1 + len(accepted) * (rounds + 1),
                      extra={"cache_bytes": cache.nbytes, "policy": policy.name, "block": block, "rounds": rounds,
                             "initial_width": initial_width, "updates": updates, "carry": carry})
