"""The measurements of RIPE Sections 4 and 5 (Chapter 4): the policy map, Proposition 1, Table 4 and Figure 4.

* :func:`read_map` draws pi(r, t, j) (Eq. 9) for one query as an (R, t) array.
* :func:`batched_vs_sequential` is Proposition 1 on one block: one batched verification pass
  against token-by-token decoding from the same cache, comparing logits and the cached planes.
* :func:`replay_records` replays target trajectories through cache arms (teacher forcing, RIPE
  Section 2 "Generation" mode) and returns KL(reference || arm), top-1 flips and the reference's
  top-2 margin per generated position; :func:`tail_summary` turns them into the rows of Table 4
  and :func:`survival` into the curves of Figure 4a/b. During the same replays it measures the
  block dependence of Section 5.2 per prompt (:func:`replay_batch`); the chapter's verdicts on these
  paired per-prompt measurements come from :func:`looped_kv.analysis.verdicts.verdict`
  (:func:`kl_by_prompt`, :func:`kl_ratio_verdict`).
* :func:`tail_prompt` and :func:`kl_along` give Figure 4c (KL along the prompt that holds the tail);
  :func:`decoder_agreement` and :func:`rerun_bitwise` are the measurements of Section 5.5 that a CPU can make.
* :func:`acceptance_by_cache` runs Algorithm 1 (and self-speculation over other caches) on one batch of
  prompts per cache and returns each prompt's tokens per verification.

The paper's printed values (Tables 2 and 4, Sections 5.1-5.2) are in :mod:`looped_kv.papers`; the default
of the tail threshold comes from there.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from numpy.typing import ArrayLike
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.analysis.measure import policy_logits, row_tau
from looped_kv.analysis.replay import KL_RESOLUTION, kl
from looped_kv.analysis.teacher_forcing import (
    ForcedTokens,
    PromptPlanes,
    block_starts,
    check_trajectories,
    force,
    prompt_planes,
)
from looped_kv.analysis.verdicts import Check, Claim, Verdict, above_floor, discrimination, enough_units, verdict
from looped_kv.decoding.generate import generate
from looped_kv.decoding.loop import DecodeView, LogitsRecorder, Observer, Observers, decode
from looped_kv.decoding.result import Generation
from looped_kv.decoding.speculative import LoopDrafts
from looped_kv.papers import RIPE_TABLE_4_SETUP
from looped_kv.runtime.cache import PlaneCache
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.memory import policy_bytes
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import ALIGNED, CachePolicy, make_policy

TAIL_KL: float = RIPE_TABLE_4_SETUP["tail KL"]  # RIPE Table 4's tail threshold


# -- the policy (Eq. 9) ---------------------------------------------------------------------------


def read_map(policy: CachePolicy, query: int) -> np.ndarray:
    """pi(r, t, j) for one query t = ``query``: an (R, t) integer array, row r - 1, column j < t."""
    if query < 1:
        raise ValueError(f"query must be >= 1 (a query at position t reads positions 0..t-1), got {query}")
    R = policy.num_loops
    return np.array([[policy.read(r, query, j) for j in range(query)] for r in range(1, R + 1)], dtype=int)


def scale_windows(windows: Sequence[int], shortest_length: int) -> tuple[tuple[int, ...], int]:
    """Divide the paper's windows by the smallest power of two that puts the largest below ``shortest_length``.

    A window at least as long as a trajectory reads every position at full depth, which is the full
    cache; scaled so, the largest window still leaves the start of the shortest trajectory outside it.
    Returns (scaled windows, factor).
    """
    windows = tuple(int(w) for w in windows)
    if not windows or min(windows) < 1:
        raise ValueError(f"windows must be a non-empty sequence of integers >= 1, got {windows}")
    if shortest_length < 2:
        raise ValueError(f"shortest_length must be >= 2, got {shortest_length}")
    factor = 1
    while max(windows) // factor >= shortest_length:
        factor *= 2
    return tuple(max(1, w // factor) for w in windows), factor


def extra_over_deepest(config: LoopedConfig, policy: CachePolicy, length: int = 1024, dtype: str = "bf16") -> int:
    """Bytes a policy stores beyond the deepest-plane cache for an L-token sequence (Table 4, "Extra")."""
    deepest = make_policy("deepest", policy.num_loops)
    return policy_bytes(config, policy, length, dtype) - policy_bytes(config, deepest, length, dtype)


# -- Proposition 1 ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockComparison:
    """One verification block, batched against sequential (RIPE Proposition 1)."""

    logits: float  # max |batched - sequential| over the block's logits
    planes: float  # max |batched - sequential| over every cached key and value after committing the block
    targets_equal: bool  # the block's argmax tokens agree


def _cache_tensors(cache: PlaneCache) -> list[Tensor]:
    return [*cache.edge, *cache.core, *cache.ring, *cache.sink]


@torch.no_grad()
def batched_vs_sequential(model: LoopedLM, tokens: Tensor, start: int, policy: CachePolicy) -> BlockComparison:
    """Verify ``tokens[:, start:]`` (gamma + 1 tokens) once in one batched pass and once token by token.

    Both runs are the decode loop forced along ``tokens`` (:class:`ForcedTokens`) after the same prefill of
    ``tokens[:, :start]``: greedy steps, and one speculative verification of the whole block (1-loop drafts), committed
    from its buffer as Algorithm 1 does. Proposition 1: with a
    block-independent policy (full, or RIPE with W >= gamma) both are equal in exact arithmetic.
    """
    n = tokens.shape[1]
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"tokens must be (1, n), got shape {tuple(tokens.shape)}")
    if not 1 <= start < n:
        raise ValueError(f"start must be in [1, {n - 1}] (a prefix and a block of at least one token), got {start}")
    sequence, gamma = tokens[0], n - start - 1
    got = {}
    for name, drafter in (("sequential", None), ("batched", LoopDrafts(draft_loops=1, gamma=gamma, reads=ALIGNED,
                                                                       exact=False) if gamma else None)):
        recorder, last = LogitsRecorder(), _LastCache()
        decode(model, [sequence[:start]], [n - start + 1], policy=policy, drafter=drafter,
               sampler=ForcedTokens([sequence]), observer=Observers(recorder, last))
        got[name] = recorder.logits(0)[1:], _cache_tensors(last.cache)
    (logits_seq, planes_seq), (logits_batch, planes_batch) = got["sequential"], got["batched"]
    planes = max(float((a[..., :n, :] - b[..., :n, :]).abs().max())  # the n positions (capacities differ)
                 for a, b in zip(planes_batch, planes_seq, strict=True) if a.numel())
    return BlockComparison(logits=float((logits_batch - logits_seq).abs().max()), planes=planes,
                           targets_equal=bool(torch.equal(logits_batch.argmax(-1), logits_seq.argmax(-1))))


class _LastCache(Observer):
    """The cache of a run, which after it holds every committed plane."""

    def proposing(self, view: DecodeView) -> None:
        self.cache = view.cache


# -- Table 4 and Figure 4 ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmReplay:
    """One trajectory replayed under one cache policy."""

    logits: Tensor  # (n - prompt_length, V) in the model's dtype: the logits sequential decoding computes
    block_kl: Tensor | None  # KL(sequential || batched) per block position (measure.block_dependence)


@torch.no_grad()
def replay_batch(model: LoopedLM, trajectories: Sequence[Tensor], prompt_lengths: Sequence[int],
                 policy: CachePolicy, gamma: int | None = None, prompts: PromptPlanes | None = None
                 ) -> list[ArmReplay]:
    """Teacher-forced sequential replay of B trajectories at once, and with ``gamma`` the Section 5.2 check.

    Row b is :func:`~looped_kv.analysis.measure.policy_logits` of ``trajectories[b]`` (its prompt prefilled,
    then every generated token decoded one at a time under ``policy``); the rows run together, each at its own
    positions, so rows of different lengths share every forward. ``prompts`` (:func:`prompt_planes` of the
    same model and trajectories) stands in for the prefill, which otherwise runs straight into the arm's cache.
    With ``gamma``, each row's generated
    tokens are cut into verification blocks of gamma + 1 tokens (:func:`block_starts`), as in
    :func:`~looped_kv.analysis.measure.block_dependence`; before a block's sequential steps, one batched pass
    over the block reads the same cache (its planes go to a scratch buffer), and the block's KL(sequential ||
    batched) is recorded. Rows too short for one block get an empty ``block_kl``.
    """
    check_trajectories(trajectories, prompt_lengths)
    if gamma is not None and gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    B = len(trajectories)
    if prompts is not None and prompts.last_logits.shape[0] != B:
        raise ValueError(f"prompts must hold the planes of the {B} trajectories, got {prompts.last_logits.shape[0]}")
    forced = force(model, [t[0] for t in trajectories], prompt_lengths, policy, gamma=gamma, prompts=prompts)
    out = []
    for b, g in enumerate(forced.generated):
        block_kl = None
        if gamma is not None:
            starts = block_starts(g, gamma)
            block_kl = torch.cat([kl(forced.sequential(b, s, gamma + 1), forced.blocks[b][s]) for s in starts]
                                 ) if len(starts) else torch.empty(0, dtype=torch.float64)
        out.append(ArmReplay(forced.row_logits(b), block_kl))
    return out


@dataclass(frozen=True)
class Replays:
    """Per-position records of every arm (:func:`replay_records`) and, with ``gamma``, the block dependence."""

    records: pd.DataFrame
    block_dependence: pd.DataFrame | None  # mean KL(sequential || batched) per prompt (rows) and policy (columns)


def replay_records(trajectories: Sequence[Tensor], prompt_lengths: Sequence[int],
                   reference: tuple[LoopedLM, CachePolicy], arms: Mapping[str, tuple[LoopedLM, CachePolicy]], *,
                   gamma: int | None = None, block_arms: Sequence[str] = (), reference_label: str = "reference",
                   batch_size: int | None = None, progress: bool = False) -> Replays:
    """Teacher-forced replay of the trajectories through the reference and every arm (RIPE Sec. 2, 5.1, 5.2).

    ``reference`` and each arm are a (model, cache policy) pair; the model fixes the arithmetic (a bf16
    model for L0 and the cache arms, an fp32 copy for the precision floor). The trajectories are replayed in
    batches of ``batch_size`` (default: all at once) per arm (:func:`replay_batch`); the arms of one model
    share each batch's prefill (:func:`prompt_planes`). The records have one row per (prompt, generated
    position, arm): ``kl`` = KL(reference || arm) in float64 (rounding below 0 clipped to 0), ``flip`` (the
    arm's top-1 token differs from the reference's), ``margin`` (the reference's top-2 probability margin) and
    ``position`` (0 for the first generated token). With ``gamma``, the reference and the arms named
    in ``block_arms`` also measure their block dependence during the same replay: the mean KL(sequential ||
    batched) per prompt, NaN for a prompt that generated fewer than gamma + 1 tokens.
    """
    check_trajectories(trajectories, prompt_lengths)
    if not arms:
        raise ValueError("arms must name at least one (model, policy) pair")
    unknown = [label for label in block_arms if label not in arms]
    if unknown:
        raise ValueError(f"block_arms must name arms, got {unknown}")
    if gamma is not None and gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be None or >= 1, got {batch_size}")
    size = batch_size or len(trajectories)
    frames, dependence = [], []
    for first in tqdm(range(0, len(trajectories), size), disable=not progress, desc="replay", leave=False):
        rows, lengths = list(trajectories[first:first + size]), list(prompt_lengths[first:first + size])
        frame, means = _replay_rows(rows, lengths, reference, arms, gamma, block_arms, reference_label)
        frame["prompt"] += first
        frames.append(frame)
        dependence.append(means)
    block_frame = None
    if gamma is not None:
        block_frame = pd.concat(dependence, ignore_index=True)
        block_frame.index.name = "prompt"
    return Replays(pd.concat(frames, ignore_index=True), block_frame)


def past_end_of_text(records: pd.DataFrame, sequences: Sequence[Tensor], prompt_lengths: Sequence[int],
                     eos_token_id: int) -> np.ndarray:
    """Per record of :func:`replay_records`: whether its generated position follows the trajectory's first
    end-of-text, text a decoder that stops there never emits (a trajectory decoded with ``stop_at_eos=False``)."""
    first = []
    for sequence, p in zip(sequences, prompt_lengths, strict=True):
        hits = (sequence.reshape(-1)[p:] == eos_token_id).nonzero()
        first.append(int(hits[0]) if len(hits) else np.iinfo(np.int64).max)
    return records["position"].to_numpy() > np.asarray(first)[records["prompt"].to_numpy()]


def _replay_rows(trajectories: list[Tensor], prompt_lengths: list[int], reference: tuple[LoopedLM, CachePolicy],
                 arms: Mapping[str, tuple[LoopedLM, CachePolicy]], gamma: int | None, block_arms: Sequence[str],
                 reference_label: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One batch of :func:`replay_records`: its records and its per-prompt block dependence."""
    shared: dict[int, PromptPlanes] = {}
    uses = Counter(id(model) for model, _ in (reference, *arms.values()))

    def replay(model: LoopedLM, policy: CachePolicy, with_block: bool) -> list[ArmReplay]:
        uses[id(model)] -= 1
        if uses[id(model)] and id(model) not in shared:  # more arms of this model follow: they share a prefill
            shared[id(model)] = prompt_planes(model, trajectories, prompt_lengths, policy.num_loops)
        planes = shared[id(model)] if uses[id(model)] else shared.pop(id(model), None)  # freed after its last arm
        return replay_batch(model, trajectories, prompt_lengths, policy, gamma if with_block else None, planes)

    ref = replay(*reference, True)
    references = [r.logits.double() for r in ref]
    dependence = {reference_label: [_mean_kl(r.block_kl) for r in ref]} if gamma is not None else {}
    frames = []
    for label, (model, policy) in arms.items():
        replays = replay(model, policy, label in block_arms)
        if label in block_arms:
            dependence[label] = [_mean_kl(r.block_kl) for r in replays]
        for i, (reference_logits, arm) in enumerate(zip(references, replays, strict=True)):
            top2 = reference_logits.softmax(-1).topk(2, dim=-1).values
            frames.append(pd.DataFrame({
                "prompt": i, "position": np.arange(reference_logits.shape[0]), "arm": label,
                "kl": kl(reference_logits, arm.logits).clamp_min(0).cpu().numpy(),
                "flip": (arm.logits.argmax(-1) != reference_logits.argmax(-1)).cpu().numpy(),
                "margin": (top2[:, 0] - top2[:, 1]).cpu().numpy()}))
        del replays  # freed before the next arm's replay, which would otherwise hold them beside its own
    return pd.concat(frames, ignore_index=True), pd.DataFrame(dependence)


def _mean_kl(values: Tensor) -> float:
    return float(values.clamp_min(0).mean()) if values.numel() else float("nan")


@dataclass(frozen=True)
class Acceptance:
    """Self-speculative runs of one batch of prompts under several caches (:func:`acceptance_by_cache`)."""

    tau: pd.DataFrame  # tokens per verification, one row per prompt, one column per cache
    runs: dict[str, Generation]


def acceptance_by_cache(model: LoopedLM, prompts: Sequence[Tensor], caches: Mapping[str, Mapping[str, object]],
                        max_new_tokens: int, *, draft_loops: int, gamma: int,
                        rows_per_chunk: int | None = None) -> Acceptance:
    """Greedy self-speculative decoding of ``prompts`` as one batch per cache (in row chunks of at most
    ``rows_per_chunk`` rows): each prompt's tau (RIPE Eq. 7).

    ``caches`` maps a label to the cache arguments of :func:`looped_kv.generate` (``cache``, ``window``,
    ``prefix_reads``, ``exact``, ...). With ``cache="ripe"`` and drafts reading plane R this is RIPE
    Algorithm 1; with ``cache="deepest"`` it is the deepest-plane decoder of RIPE Sec. 3.3 (W = 0, so
    ``exact=False``). Every cache decodes the same prompts with the same d and gamma, so the taus are paired
    by prompt.
    """
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    if not caches:
        raise ValueError("caches must name at least one cache")
    fixed = {"method", "draft_loops", "gamma", "max_new_tokens"} & {name for spec in caches.values() for name in spec}
    if fixed:
        raise ValueError(f"caches must give cache arguments only, got {sorted(fixed)}")
    runs = {label: generate(model, list(prompts), max_new_tokens=max_new_tokens, method="self-spec",
                            draft_loops=draft_loops, gamma=gamma, rows_per_chunk=rows_per_chunk, **spec)
            for label, spec in caches.items()}
    tau = pd.DataFrame({label: row_tau(run) for label, run in runs.items()})
    tau.index.name = "prompt"
    return Acceptance(tau, runs)


def top_share(values: ArrayLike, fraction: float = 0.01) -> float:
    """Share of the total carried by the largest ``fraction`` of values (at least one): "1% of positions carry 74%"."""
    x = np.sort(np.asarray(values, dtype=float))[::-1]
    if x.size == 0 or x.sum() <= 0:
        return float("nan")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
    return float(x[:max(1, math.ceil(fraction * x.size))].sum() / x.sum())


def tail_summary(records: pd.DataFrame, threshold: float = TAIL_KL) -> pd.DataFrame:
    """Table 4's columns per arm (in the records' order): tail count (KL > threshold), largest KL, top-1 flips,
    and the mean, median and top-1% share of the KL, with the prompts that hold a tail position."""
    missing = {"prompt", "arm", "kl", "flip"} - set(records.columns)
    if missing:
        raise ValueError(f"records need columns prompt, arm, kl and flip; missing {sorted(missing)}")
    rows = {}
    for arm in pd.unique(records["arm"]):
        r = records[records["arm"] == arm]
        tail = r["kl"] > threshold
        rows[arm] = {"positions": len(r), "tail": int(tail.sum()), "max KL": float(r["kl"].max()),
                     "flips": int(r["flip"].sum()), "mean KL": float(r["kl"].mean()),
                     "median KL": float(r["kl"].median()), "top 1% share": top_share(r["kl"]),
                     "tail prompts": int(r.loc[tail, "prompt"].nunique())}
    return pd.DataFrame.from_dict(rows, orient="index")


def tail_counts_by_prompt(records: pd.DataFrame, arm: str, prompts: Sequence[int], threshold: float = TAIL_KL
                          ) -> np.ndarray:
    """Number of positions with KL > threshold per prompt (in ``prompts`` order) for one arm."""
    r = records[records["arm"] == arm]
    if r.empty:
        raise ValueError(f"no records for arm {arm!r}")
    counts = r.assign(tail=r["kl"] > threshold).groupby("prompt")["tail"].sum()
    return counts.reindex(list(prompts), fill_value=0).to_numpy(dtype=float)


def kl_by_prompt(records: pd.DataFrame, arm: str) -> pd.Series:
    """Mean KL(reference || arm) of each prompt over its generated positions (the unit of a paired verdict)."""
    r = records[records["arm"] == arm]
    if r.empty:
        raise ValueError(f"no records for arm {arm!r}")
    return r.groupby("prompt", sort=False)["kl"].mean()


def kl_ratio_verdict(claim: Claim, arm: ArrayLike, reference: ArrayLike, names: tuple[str, str],
                     *checks: Check) -> Verdict:
    """The verdict on a claim about the ratio of two arms' paired per-prompt mean KLs (RIPE Sec. 5.1-5.2).

    Before the verdict, the experiment must be able to discriminate: enough prompts, and most prompts of each
    arm (``names``) above :data:`~looped_kv.analysis.measure.KL_RESOLUTION` (else the ratio compares
    rounding); ``checks`` add others. A prompt whose mean is below the resolution enters the log ratio at it.
    Prompts where either arm is NaN (no measurement) are left out of the pairs.
    """
    if claim.scale != "log-ratio":
        raise ValueError(f"claim.scale must be 'log-ratio' for a KL ratio, got {claim.scale!r}")
    a, b = np.asarray(arm, dtype=float), np.asarray(reference, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"arm and reference must be paired per prompt, got {a.size} and {b.size} values")
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    bundle = discrimination(enough_units(a.size), above_floor(a, KL_RESOLUTION, names[0]),
                            above_floor(b, KL_RESOLUTION, names[1]), *checks)
    return verdict(claim, np.maximum(a, KL_RESOLUTION), np.maximum(b, KL_RESOLUTION), discrimination=bundle)


def survival(values: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Empirical survival function (Figure 4a/b): sorted values x and the fraction of values >= x."""
    x = np.sort(np.asarray(values, dtype=float).ravel())
    if x.size == 0:
        raise ValueError("values must not be empty")
    return x, 1.0 - np.arange(x.size) / x.size


# -- Figure 4c and Section 5.5 --------------------------------------------------------------------------------------


def tail_prompt(records: pd.DataFrame, arm: str, threshold: float = TAIL_KL) -> int:
    """The prompt of Figure 4c: the one holding most of ``arm``'s tail positions (KL > threshold), ties and a model
    without a tail broken by the largest KL."""
    r = records[records["arm"] == arm]
    if r.empty:
        raise ValueError(f"no records for arm {arm!r}")
    by_prompt = r.assign(tail=r["kl"] > threshold).groupby("prompt").agg(tail=("tail", "sum"), peak=("kl", "max"))
    return int(by_prompt.sort_values(["tail", "peak"], ascending=False).index[0])


def kl_along(records: pd.DataFrame, prompt: int, arms: Sequence[str]) -> pd.DataFrame:
    """KL(reference || arm) along one prompt's generated positions (Figure 4c): one row per position, one column per
    arm, in ``arms``' order."""
    r = records[(records["prompt"] == prompt) & records["arm"].isin(arms)]
    missing = [a for a in arms if a not in set(r["arm"])]
    if missing:
        raise ValueError(f"no records of prompt {prompt} for arms {missing}")
    frame = r.pivot(index="position", columns="arm", values="kl")[list(arms)]
    frame.columns.name = None
    return frame


@dataclass(frozen=True)
class ShapeComparison:
    """RIPE Sec. 5.5's computation-shape check: one greedy decoding computed two ways (:func:`decoder_agreement`)."""

    equal: np.ndarray  # per prompt: the two trajectories are identical
    first_difference: np.ndarray  # per prompt: index of the first differing generated token, -1 where equal

    @property
    def n_equal(self) -> int:
        return int(self.equal.sum())


@torch.no_grad()
def decoder_agreement(model: LoopedLM, prompts: Sequence[Tensor], max_new_tokens: int, *, draft_loops: int,
                      gamma: int, rows_per_chunk: int | None = None) -> ShapeComparison:
    """The full cache's batched (self-speculative, one verification pass per block of gamma + 1 tokens) and
    sequential (one token per forward) greedy decoders on the same prompts (RIPE Sec. 5.5). Both emit the same tokens
    in exact arithmetic (Proposition 1 with the full cache); in a narrow precision the two computation shapes may
    round a near-tie differently, after which the trajectories part."""
    sequential = generate(model, list(prompts), max_new_tokens=max_new_tokens, rows_per_chunk=rows_per_chunk)
    batched = generate(model, list(prompts), max_new_tokens=max_new_tokens, method="self-spec",
                       draft_loops=draft_loops, gamma=gamma, cache="full", rows_per_chunk=rows_per_chunk)
    equal, first = [], []
    for a, b in zip(sequential.new_rows, batched.new_rows, strict=True):
        a, b = a.reshape(-1), b.reshape(-1)
        n = min(len(a), len(b))
        differs = (a[:n] != b[:n]).nonzero()
        same = len(a) == len(b) and not len(differs)
        equal.append(same)
        first.append(-1 if same else int(differs[0]) if len(differs) else n)
    return ShapeComparison(np.array(equal), np.array(first))


@torch.no_grad()
def rerun_bitwise(model: LoopedLM, trajectories: Sequence[Tensor], prompt_lengths: Sequence[int],
                  policy: CachePolicy) -> float:
    """Share of generated positions whose logits two runs of the same teacher-forced replay compute bit for bit
    (RIPE Sec. 5.5's same-process rerun of the reference)."""
    check_trajectories(trajectories, prompt_lengths)
    equal = total = 0
    for tokens, p in zip(trajectories, prompt_lengths, strict=True):
        first, second = (policy_logits(model, tokens, p, policy) for _ in range(2))
        equal += int((first == second).all(-1).sum())
        total += first.shape[0]
    return equal / total
