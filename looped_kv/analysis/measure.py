"""Measurements on decoding trajectories: replay through cache policies, block dependence, draft agreement.

* :func:`policy_logits` replays a trajectory (prompt plus generated tokens) through a cache
  policy exactly as sequential decoding would read it, and returns the logits of every
  generated position (RIPE Section 2, "Generation" mode).
* :func:`block_dependence` compares verification targets of one batched pass with sequential
  decoding at identical contexts (RIPE Section 5.2).
* :func:`draft_agreement` follows the full-depth target trajectory and asks how often a
  d-loop draft with given prefix reads predicts the target's token (DAS Table 6, Figure 4);
  :func:`draft_agreement_rows` does the same for every row of a batched generation at once.
* :func:`row_tau` gives each row's tokens per verification (RIPE Eq. 7's tau, DAS Eq. 10's G).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.decoding.core import Generation, block_positions, new_cache, prefill, run_block, step
from looped_kv.decoding.greedy import greedy
from looped_kv.runtime.cache import BlockBuffer, BlockPass
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy, make_prefix_reads


@torch.no_grad()
def policy_logits(model: LoopedLM, tokens: Tensor, prompt_length: int, policy: CachePolicy) -> Tensor:
    """Teacher-forced sequential replay of ``tokens`` (1, n) under a cache policy.

    The prompt is prefilled in one pass, then every later token is decoded one at a time, so
    each reads the prefix exactly as sequential decoding under ``policy`` does. Returns the
    logits predicting tokens ``prompt_length .. n-1`` (shape (n - prompt_length, V)).
    """
    n = tokens.shape[1]
    if not 1 <= prompt_length < n:
        raise ValueError(f"prompt_length must be in [1, {n - 1}], got {prompt_length}")
    cache = new_cache(model, policy, 1, n)
    out = [prefill(model, cache, tokens[:, :prompt_length], policy.num_loops)[0, -1:]]
    for t in range(prompt_length, n - 1):
        out.append(step(model, cache, tokens[:, t:t + 1], policy.num_loops)[0])
    return torch.cat(out).double()


#: Smallest KL that :func:`kl` resolves (float64 logits): a KL below it is indistinguishable from 0.
KL_RESOLUTION = 1e-30


def kl(reference: Tensor, arm: Tensor) -> Tensor:
    """KL(reference || arm) per row of logits, in float64.

    KL = E_p[z_p - z_q] - log sum_v q_v exp(z_p - z_q)_v; when the logits are close, the log-partition
    difference is taken as log1p of a small sum, so that KL far below float64's resolution of the
    probabilities (down to about 1e-30) is still resolved rather than lost in rounding.
    """
    a, b = reference.double(), arm.double()
    delta = a - b
    near = delta.abs().amax(-1, keepdim=True) < 1
    shift = torch.where(near, torch.log1p((b.softmax(-1) * torch.expm1(delta.clamp(max=1))).sum(-1, keepdim=True)),
                        a.logsumexp(-1, keepdim=True) - b.logsumexp(-1, keepdim=True))
    return (a.softmax(-1) * delta).sum(-1) - shift.squeeze(-1)


@torch.no_grad()
def block_dependence(model: LoopedLM, tokens: Tensor, prompt_length: int, policy: CachePolicy,
                     block: int) -> Tensor:
    """KL between batched and sequential verification logits at identical contexts (RIPE Section 5.2).

    The trajectory after the prompt is cut into verification blocks of ``block + 1`` tokens. For
    each block, the cache holds the exact sequential prefix; the block's logits are computed once
    by one batched pass and once token by token. Returns KL(sequential || batched) per position.
    """
    n, R = tokens.shape[1], policy.num_loops
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if not 1 <= prompt_length < n:
        raise ValueError(f"prompt_length must be in [1, {n - 1}], got {prompt_length}")
    cache = new_cache(model, policy, 1, n)
    prefill(model, cache, tokens[:, :prompt_length], R)
    buffer = BlockBuffer(model.config, R, batch=1, capacity=block + 1, dtype=model.dtype, device=model.device)
    divergences = []
    for start in range(prompt_length, n - block, block + 1):
        router = BlockPass(cache, range(start, start + block + 1), buffer=buffer, store="buffer")
        batched, _ = run_block(model, tokens[:, start:start + block + 1], router, R)
        sequential = torch.cat([step(model, cache, tokens[:, t:t + 1], R) for t in range(start, start + block + 1)],
                               dim=1)
        divergences.append(kl(sequential[0], batched[0]))
    return torch.cat(divergences) if divergences else torch.empty(0, dtype=torch.float64)


@torch.no_grad()
def draft_agreement(model: LoopedLM, tokens: Tensor, prompt_length: int, draft_loops: Sequence[int],
                    reads: Iterable[str | tuple[int, int]], policy: CachePolicy | None = None) -> dict:
    """Draft-target token agreement along a target trajectory (DAS Table 6 and Figure 4).

    At every position after the prompt, the cache holds the target's planes of the prefix; a
    d-loop draft of the pending token reads them per ``reads`` and its argmax is compared with
    the full-depth target's. Returns {(d, read): agreement in [0, 1]} and the counts under "n".
    """
    R = model.config.mean_recurrence if policy is None else policy.num_loops
    policy = policy or make_policy("full", R)
    reads = list(reads)
    read_policies = {spec: make_prefix_reads(spec, R) for spec in reads}
    for d in draft_loops:
        if not 1 <= d <= R:
            raise ValueError(f"draft_loops must be in [1, {R}], got {d}")
    n = tokens.shape[1]
    if not 1 <= prompt_length < n - 1:
        raise ValueError(f"prompt_length must be in [1, {n - 2}] (at least one position to draft), got {prompt_length}")
    cache = new_cache(model, policy, 1, n)
    prefill(model, cache, tokens[:, :prompt_length], R)
    hits = {(d, spec): 0 for d in draft_loops for spec in reads}
    for t in range(prompt_length, n - 1):
        token = tokens[:, t:t + 1]
        for d in draft_loops:
            for spec, read in read_policies.items():
                router = BlockPass(cache, range(t, t + 1), reads=read, store=None)
                draft, _ = run_block(model, token, router, d)
                hits[(d, spec)] += int(draft[0, -1].argmax() == tokens[0, t + 1])
        step(model, cache, token, R)
    total = n - 1 - prompt_length
    return {key: value / total for key, value in hits.items()} | {"n": total}


def target_trajectories(model: LoopedLM, prompts: Sequence[Tensor], max_new_tokens: int,
                        policy: CachePolicy | None = None, progress: bool = True) -> list[Tensor]:
    """Greedy full-depth trajectories (prompt + generated tokens) under a cache policy (default full)."""
    policy = policy or make_policy("full", model.config.mean_recurrence)
    return [greedy(model, ids, max_new_tokens, policy=policy).tokens
            for ids in tqdm(prompts, desc="target trajectories", disable=not progress, leave=False)]


def padded_prompts(sequences: Sequence[Tensor], prompt_lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Right-padded prompts (B, longest prompt) and their lengths (B,)."""
    width = max(prompt_lengths)
    ids = torch.stack([torch.nn.functional.pad(s[:p], (0, width - p)) for s, p in zip(sequences, prompt_lengths,
                                                                                         strict=True)])
    return ids, torch.tensor(list(prompt_lengths), device=ids.device)


def tokens_after_prompt(sequences: Sequence[Tensor], prompt_lengths: Sequence[int], offset: int,
                        width: int = 1) -> Tensor:
    """Tokens ``offset .. offset + width - 1`` after each row's prompt (B, width); 0 past a row's end."""
    out = torch.zeros(len(sequences), width, dtype=torch.long, device=sequences[0].device)
    for b, (s, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        part = s[p + offset:p + offset + width]
        out[b, :len(part)] = part
    return out


@torch.no_grad()
def draft_agreement_rows(model: LoopedLM, generation: Generation, draft_loops: Sequence[int],
                         reads: Iterable[str | tuple[int, int]] = ("aligned",),
                         policy: CachePolicy | None = None) -> pd.DataFrame:
    """:func:`draft_agreement` for every row of a batched greedy ``generation`` at once (DAS Table 6).

    All rows are replayed together: the prompts are prefilled, then each row's generated tokens are
    decoded one at a time under ``policy`` (default full) while, before each step, a d-loop draft of the
    pending token reads the cached prefix per ``reads``. Returns one row per generated sequence with the
    agreement in [0, 1] for every (d, read) and the number of drafted positions ``n`` (NaN agreement when a
    row generated fewer than two tokens).
    """
    R = model.config.mean_recurrence if policy is None else policy.num_loops
    policy = policy or make_policy("full", R)
    reads = list(reads)
    read_policies = {spec: make_prefix_reads(spec, R) for spec in reads}
    for d in draft_loops:
        if not 1 <= d <= R:
            raise ValueError(f"draft_loops must be in [1, {R}], got {d}")
    sequences, prompt_lengths = generation.sequences, generation.prompt_lengths
    generated = [len(s) - p for s, p in zip(sequences, prompt_lengths, strict=True)]
    positions = [max(g - 1, 0) for g in generated]  # row b drafts tokens 1 .. g - 1 after its prompt
    cache = new_cache(model, policy, len(sequences), max(prompt_lengths) + max(generated))
    ids, lengths = padded_prompts(sequences, prompt_lengths)
    prefill(model, cache, ids, R, None if len(set(prompt_lengths)) == 1 else lengths)
    hits = {(d, spec): torch.zeros(len(sequences), dtype=torch.long) for d in draft_loops for spec in reads}
    for i in range(max(positions)):
        pair = tokens_after_prompt(sequences, prompt_lengths, i, 2)
        token, target = pair[:, :1], pair[:, 1]
        valid = torch.tensor([i < n for n in positions])
        for d in draft_loops:
            for spec, read in read_policies.items():
                router = BlockPass(cache, block_positions(cache, 1), reads=read, store=None)
                draft, _ = run_block(model, token, router, d)
                hits[(d, spec)] += ((draft[:, -1].argmax(-1) == target).cpu() & valid).long()
        step(model, cache, token, R)
    n = np.array(positions, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        frame = pd.DataFrame({key: np.where(n > 0, value.numpy() / n, np.nan) for key, value in hits.items()})
    frame.columns = pd.MultiIndex.from_tuples(frame.columns, names=["draft loops", "reads"])
    frame["n"] = n.astype(int)
    frame.index.name = "row"
    return frame


def row_tau(generation: Generation) -> np.ndarray:
    """Tokens committed per verification of each row (accepted drafts plus the verifier's kept token; RIPE Eq. 7,
    DAS Eq. 10), NaN for a row that needed no verification."""
    if not any(generation.row_accepted):
        raise ValueError("generation must come from a speculative decoder (it holds no verification)")
    return np.array([(sum(a) + sum(u)) / len(a) if a else np.nan
                     for a, u in zip(generation.row_accepted, generation.row_retained, strict=True)])
