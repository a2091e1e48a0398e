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
  :func:`agreement_by_prompt` does the same for a batch of prompts decoded together, one
  agreement per prompt, and :func:`channel_verdict` compares two read policies on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.analysis.verdicts import (
    BOOK_MINIMUM,
    Claim,
    Verdict,
    below_ceiling,
    discrimination,
    enough_units,
    varies,
    verdict,
)
from looped_kv.decoding.core import (
    Generation,
    Rows,
    block_positions,
    check_prompts,
    eos_id,
    new_cache,
    prefill,
    prefill_rows,
    row_passes,
    run_block,
    step,
)
from looped_kv.decoding.greedy import greedy
from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, PrefixReads, make_policy, make_prefix_reads

#: DAS Sec. 3.1 and Table 6: at draft depth 1, mature prefix values help a shallow draft more than mature keys.
MATURE_V_CLAIM = Claim("at d = 1, drafts reading full-depth prefix values (deep V) agree with the target more "
                       "often than drafts reading full-depth prefix keys (deep K)", "DAS Sec. 3.1, Table 6",
                       minimum=BOOK_MINIMUM["share"], minimum_source="the book's smallest effect for a share")


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


def _check_depths(draft_loops: Sequence[int], num_loops: int) -> list[int]:
    depths = sorted(set(draft_loops))
    if not depths:
        raise ValueError("draft_loops must name at least one draft depth")
    for d in depths:
        if not isinstance(d, (int, np.integer)) or not 1 <= d <= num_loops:
            raise ValueError(f"draft_loops must be in [1, {num_loops}], got {d}")
    return depths


def _draft_tokens(model: LoopedLM, cache: PlaneCache, pending: Tensor, depths: list[int],
                  reads: dict[object, PrefixReads]) -> dict[tuple[int, object], Tensor]:
    """Greedy d-loop drafts (B,) of the token after ``pending`` (B, 1), for every depth and prefix read.

    One pass per read runs the deepest depth and reads out the shallower ones on the way: a d-loop draft
    is the first d loops of a deeper one (the same ops as ``run_block`` with d loops). Nothing is stored.
    """
    out = {}
    for spec, read in reads.items():
        router = BlockPass(cache, block_positions(cache, 1), reads=read, store=None)
        positions = router.positions
        embedded = model.embed(pending, positions, router)
        state = model.initial_state(positions, pending.shape[0], last=router.last_position, tokens=pending)
        for r in range(1, depths[-1] + 1):
            state = model.loop(state, embedded, positions, router, r)
            if r in depths:
                out[(r, spec)] = model.readout(state, positions, router)[:, -1].argmax(-1)
    return out


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
    read_policies = {spec: make_prefix_reads(spec, R) for spec in reads}
    depths = _check_depths(draft_loops, R)
    n = tokens.shape[1]
    if not 1 <= prompt_length < n - 1:
        raise ValueError(f"prompt_length must be in [1, {n - 2}] (at least one position to draft), got {prompt_length}")
    cache = new_cache(model, policy, 1, n)
    prefill(model, cache, tokens[:, :prompt_length], R)
    hits = {(d, spec): 0 for d in depths for spec in read_policies}
    for t in range(prompt_length, n - 1):
        token = tokens[:, t:t + 1]
        for key, draft in _draft_tokens(model, cache, token, depths, read_policies).items():
            hits[key] += int(draft[0] == tokens[0, t + 1])
        step(model, cache, token, R)
    total = n - 1 - prompt_length
    return {key: value / total for key, value in hits.items()} | {"n": total}


@torch.no_grad()
def agreement_by_prompt(model: LoopedLM, prompts: Sequence[Tensor], max_new_tokens: int,
                        draft_loops: Sequence[int], reads: Iterable[str | tuple[int, int]], *,
                        policy: CachePolicy | None = None, stop_at_eos: bool = True,
                        eos_token_id: int | None = None, rows_per_pass: int | None = None) -> pd.DataFrame:
    """Draft-target agreement per prompt, the prompts decoded together as one batch (DAS Table 6, Figure 4).

    The B prompts (any lengths) are decoded greedily at full depth; a row stops after ``max_new_tokens``
    or after emitting the end-of-text token (as :func:`looped_kv.generate` does, with the same
    ``stop_at_eos`` and ``eos_token_id``), and each row is what decoding it alone gives. At every
    generated position the cache holds the target's planes of the prefix, and a d-loop draft of the
    next token reads them per each of ``reads`` (``"aligned"``, ``"deep-v"``, ``"deep-k"``,
    ``"deep-kv"`` or a (kappa, nu) pair of planes). Returns one row per (prompt, d, read):
    ``agreement`` (the fraction of the prompt's drafted positions where the draft's argmax is the
    target's token; NaN for a prompt with none) and ``positions`` (drafted positions). ``rows_per_pass``
    decodes the batch in passes of at most that many rows; each row's figures are the same.
    """
    passes = row_passes(len(prompts), rows_per_pass)
    if len(passes) > 1:
        parts = [agreement_by_prompt(model, prompts[rows], max_new_tokens, draft_loops, reads, policy=policy,
                                     stop_at_eos=stop_at_eos, eos_token_id=eos_token_id)
                 .assign(prompt=lambda f, first=rows.start: f["prompt"] + first) for rows in passes]
        frame = pd.concat(parts, ignore_index=True)
        cell = frame["d"].astype(str) + " " + frame["read"].astype(str)  # the rows of one batch, in its order
        rank = cell.map({c: i for i, c in enumerate(dict.fromkeys(cell))})
        return frame.iloc[np.lexsort((frame["prompt"], rank))].reset_index(drop=True)
    R = model.config.mean_recurrence if policy is None else policy.num_loops
    policy = policy or make_policy("full", R)
    specs = list(reads)
    if not specs:
        raise ValueError("reads must name at least one prefix read policy")
    read_policies = {spec: make_prefix_reads(spec, R) for spec in specs}
    depths = _check_depths(draft_loops, R)
    rows_in, budgets = check_prompts(model, prompts, max_new_tokens)
    B = len(rows_in)
    cache = new_cache(model, policy, B, max(len(p) for p in rows_in) + max_new_tokens)
    rows = Rows(rows_in, budgets, eos_id(model, eos_token_id, stop_at_eos), False, "agreement")
    pending = prefill_rows(model, cache, rows_in, R)
    rows.emit(list(pending))
    hits = {key: np.zeros(B) for key in ((d, spec) for d in depths for spec in specs)}
    positions = np.zeros(B, dtype=int)
    while True:
        (pending,) = rows.drop_stopped(cache, pending)
        if not rows.active:
            break
        drafts = _draft_tokens(model, cache, pending, depths, read_policies)
        target = step(model, cache, pending, R)[:, -1].argmax(-1, keepdim=True)
        active = np.asarray(rows.active)
        for key, draft in drafts.items():
            hits[key][active] += (draft == target[:, 0]).cpu().numpy()
        positions[active] += 1
        rows.emit(list(target))
        pending = target
    with np.errstate(invalid="ignore", divide="ignore"):
        return pd.DataFrame([{"prompt": p, "d": d, "read": spec, "agreement": hits[(d, spec)][p] / positions[p]
                              if positions[p] else float("nan"), "positions": int(positions[p])}
                             for d in depths for spec in specs for p in range(B)])


def paired_agreement(frame: pd.DataFrame, d: int, a: str | tuple[int, int],
                     b: str | tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-prompt agreements of reads ``a`` and ``b`` at depth ``d`` from :func:`agreement_by_prompt`,
    on the prompts with at least one drafted position."""
    at_d = frame[frame["d"] == d]
    if at_d.empty:
        raise ValueError(f"d must be one of the frame's depths {sorted(frame['d'].unique())}, got {d}")
    by_read = {}
    for name, spec in (("a", a), ("b", b)):
        rows = at_d[at_d["read"].map(lambda r, s=spec: r == s)]
        if rows.empty:
            raise ValueError(f"{name} must be one of the frame's reads {list(at_d['read'].unique())}, got {spec!r}")
        by_read[name] = rows.set_index("prompt")
    drafted = by_read["a"]["positions"] > 0
    return (by_read["a"]["agreement"][drafted].to_numpy(),
            by_read["b"]["agreement"].loc[drafted[drafted].index].to_numpy())


def channel_verdict(frame: pd.DataFrame, d: int = 1, a: str = "deep-v", b: str = "deep-k",
                    claim: Claim = MATURE_V_CLAIM) -> Verdict:
    """The verdict on ``claim`` (default: deep-V drafts agree more than deep-K drafts at d = 1, DAS Sec. 3.1).

    Paired per-prompt agreements from :func:`agreement_by_prompt`. Discrimination: enough prompts, the
    agreement of the arm to beat (``b``) below its ceiling of 1 (else ``a`` cannot agree more), and
    agreements that are not all equal.
    """
    x, y = paired_agreement(frame, d, a, b)
    checks = discrimination(enough_units(len(x)), below_ceiling(y, 1.0, f"agreement of {b} drafts at d = {d}"),
                            varies(np.r_[x, y], f"agreement of {a} and {b} drafts at d = {d}"))
    return verdict(claim, x, y, discrimination=checks)


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
