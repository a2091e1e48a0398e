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

from looped_kv.analysis.replay import KL_RESOLUTION as KL_RESOLUTION  # the one KL function and its resolution
from looped_kv.analysis.replay import kl
from looped_kv.analysis.teacher_forcing import DraftHits, check_depths, force
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
from looped_kv.decoding.loop import decode
from looped_kv.decoding.prompts import check_prompts, eos_id, row_chunks
from looped_kv.decoding.result import Generation
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy, make_prefix_reads

#: DAS Sec. 3.1 and Table 6: at draft depth 1, mature prefix values help a shallow draft more than mature keys.
MATURE_V_CLAIM = Claim("at d = 1, drafts reading full-depth prefix values (deep V) agree with the target more "
                       "often than drafts reading full-depth prefix keys (deep K)", "DAS Sec. 3.1, Table 6",
                       minimum=BOOK_MINIMUM["share"], minimum_source="the book's smallest effect for a share")


def _check_prompt_length(prompt_length: int, n: int, least: int = 1) -> None:
    if not 1 <= prompt_length <= n - least:
        raise ValueError(f"prompt_length must be in [1, {n - least}]" +
                         (" (at least one position to draft)" if least > 1 else "") + f", got {prompt_length}")


def policy_logits(model: LoopedLM, tokens: Tensor, prompt_length: int, policy: CachePolicy) -> Tensor:
    """Teacher-forced sequential replay of ``tokens`` (1, n) under a cache policy.

    The prompt is prefilled in one pass, then every later token is decoded one at a time, so
    each reads the prefix exactly as sequential decoding under ``policy`` does
    (:func:`~looped_kv.analysis.teacher_forcing.force`). Returns the logits predicting tokens
    ``prompt_length .. n-1`` (shape (n - prompt_length, V)).
    """
    _check_prompt_length(prompt_length, tokens.shape[1])
    return force(model, [tokens[0]], [prompt_length], policy).row_logits(0).double()


def block_dependence(model: LoopedLM, tokens: Tensor, prompt_length: int, policy: CachePolicy,
                     gamma: int) -> Tensor:
    """KL between batched and sequential verification logits at identical contexts (RIPE Section 5.2).

    The trajectory after the prompt is cut into verification blocks of ``gamma + 1`` tokens. For
    each block, the cache holds the exact sequential prefix; the block's logits are computed once
    by one batched pass and once token by token. Returns KL(sequential || batched) per position.
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    _check_prompt_length(prompt_length, tokens.shape[1])
    forced = force(model, [tokens[0]], [prompt_length], policy, gamma=gamma)
    divergences = [kl(forced.sequential(0, s, gamma + 1), block) for s, block in sorted(forced.blocks[0].items())]
    return torch.cat(divergences) if divergences else torch.empty(0, dtype=torch.float64)


def _reads(reads: Iterable[str | tuple[int, int]], num_loops: int) -> dict:
    return {spec: make_prefix_reads(spec, num_loops) for spec in reads}


def draft_agreement(model: LoopedLM, tokens: Tensor, prompt_length: int, draft_loops: Sequence[int],
                    reads: Iterable[str | tuple[int, int]], policy: CachePolicy | None = None) -> dict:
    """Draft-target token agreement along a target trajectory (DAS Table 6 and Figure 4).

    At every position after the prompt, the cache holds the target's planes of the prefix; a
    d-loop draft of the pending token reads them per ``reads`` and its argmax is compared with
    the full-depth target's. Returns {(d, read): agreement in [0, 1]} and the counts under "n".
    """
    R = model.config.mean_recurrence if policy is None else policy.num_loops
    policy = policy or make_policy("full", R)
    read_policies = _reads(reads, R)
    depths = check_depths(draft_loops, R)
    n = tokens.shape[1]
    _check_prompt_length(prompt_length, n, least=2)
    forced = force(model, [tokens[0]], [prompt_length], policy, depths=depths, reads=read_policies)
    total = n - 1 - prompt_length
    return {key: int(value[0]) / total for key, value in forced.hits.items()} | {"n": total}


@torch.no_grad()
def read_depth_grid(num_loops: int) -> tuple[int, ...]:
    """The prefix read depths of DAS Figure 4's grid for a draft at r = 2: powers of two from 2 to R, and R, so the
    corners (2, 2), (2, R), (R, 2), (R, R) are aligned, Deep V, Deep K and Deep K/V (the paper's grid has no depth
    below the draft's)."""
    if num_loops < 3:
        raise ValueError(f"num_loops must be >= 3 (a draft at 2 loops below R), got {num_loops}")
    return tuple(sorted({2**i for i in range(1, num_loops.bit_length()) if 2**i <= num_loops} | {num_loops}))


def agreement_by_prompt(model: LoopedLM, prompts: Sequence[Tensor], max_new_tokens: int,
                        draft_loops: Sequence[int], reads: Iterable[str | tuple[int, int]], *,
                        policy: CachePolicy | None = None, stop_at_eos: bool = True,
                        eos_token_id: int | None = None, rows_per_chunk: int | None = None) -> pd.DataFrame:
    """Draft-target agreement per prompt, the prompts decoded together as one batch (DAS Table 6, Figure 4).

    The B prompts (any lengths) are decoded greedily at full depth; a row stops after ``max_new_tokens``
    or after emitting the end-of-text token (as :func:`looped_kv.generate` does, with the same
    ``stop_at_eos`` and ``eos_token_id``), and each row is what decoding it alone gives. At every
    generated position the cache holds the target's planes of the prefix, and a d-loop draft of the
    next token reads them per each of ``reads`` (``"aligned"``, ``"deep-v"``, ``"deep-k"``,
    ``"deep-kv"`` or a (kappa, nu) pair of planes): the decode loop's observer
    (:class:`~looped_kv.analysis.teacher_forcing.DraftHits`).
    Returns one row per (prompt, d, read): ``agreement`` (the fraction of the prompt's drafted positions
    where the draft's argmax is the target's token; NaN for a prompt with none) and ``positions`` (drafted
    positions). ``rows_per_chunk`` decodes the batch in row chunks of at most that many rows; each row's figures
    are the same.
    """
    chunks = row_chunks(len(prompts), rows_per_chunk)
    if len(chunks) > 1:
        parts = [agreement_by_prompt(model, prompts[rows], max_new_tokens, draft_loops, reads, policy=policy,
                                     stop_at_eos=stop_at_eos, eos_token_id=eos_token_id)
                 .assign(prompt=lambda f, first=rows.start: f["prompt"] + first) for rows in chunks]
        frame = pd.concat(parts, ignore_index=True)
        cell = frame["d"].astype(str) + " " + frame["read"].astype(str)  # the rows of one batch, in its order
        rank = cell.map({c: i for i, c in enumerate(dict.fromkeys(cell))})
        return frame.iloc[np.lexsort((frame["prompt"], rank))].reset_index(drop=True)
    R = model.config.mean_recurrence if policy is None else policy.num_loops
    policy = policy or make_policy("full", R)
    specs = list(reads)
    if not specs:
        raise ValueError("reads must name at least one prefix read policy")
    read_policies = _reads(specs, R)
    depths = check_depths(draft_loops, R)
    rows_in, budgets = check_prompts(model, prompts, max_new_tokens)
    B = len(rows_in)
    observer = DraftHits(depths, read_policies, B)
    decode(model, rows_in, budgets, policy=policy, eos=eos_id(model, eos_token_id, stop_at_eos), observer=observer)
    hits, positions = observer.hits, observer.positions
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


def draft_agreement_rows(model: LoopedLM, generation: Generation, draft_loops: Sequence[int],
                         reads: Iterable[str | tuple[int, int]] = ("aligned",),
                         policy: CachePolicy | None = None) -> pd.DataFrame:
    """:func:`draft_agreement` for every row of a batched greedy ``generation`` at once (DAS Table 6).

    All rows are replayed together (:func:`~looped_kv.analysis.teacher_forcing.force`): the prompts are
    prefilled, then each row's generated tokens are decoded one at a time under ``policy`` (default full)
    while, before each step, a d-loop draft of the pending token reads the cached prefix per ``reads``.
    Returns one row per generated sequence with the agreement in [0, 1] for every (d, read) and the number
    of drafted positions ``n`` (NaN agreement when a row generated fewer than two tokens).
    """
    R = model.config.mean_recurrence if policy is None else policy.num_loops
    policy = policy or make_policy("full", R)
    read_policies = _reads(list(reads), R)
    for d in draft_loops:
        if not 1 <= d <= R:
            raise ValueError(f"draft_loops must be in [1, {R}], got {d}")
    forced = force(model, generation.sequences, generation.prompt_lengths, policy, depths=list(draft_loops),
                   reads=read_policies)
    n = forced.drafted.numpy().astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        frame = pd.DataFrame({key: np.where(n > 0, value.numpy() / n, np.nan) for key, value in forced.hits.items()})
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
