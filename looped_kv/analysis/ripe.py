"""The measurements of RIPE Sections 4 and 5 (Chapter 4): the policy map, Proposition 1, Table 4 and Figure 4.

* :func:`read_map` draws pi(r, t, j) (Eq. 9) for one query as an (R, t) array.
* :func:`batched_vs_sequential` is Proposition 1 on one block: one batched verification pass
  against token-by-token decoding from the same cache, comparing logits and the cached planes.
* :func:`replay_records` replays target trajectories through cache arms (teacher forcing, RIPE
  Section 2 "Generation" mode) and returns KL(reference || arm), top-1 flips and the reference's
  top-2 margin per generated position; :func:`tail_summary` turns them into the rows of Table 4
  and :func:`survival` into the curves of Figure 4a/b. During the same replays it can measure the
  block dependence of Section 5.2 (:func:`replay_arm`), which :func:`block_dependence_ratio` and
  :func:`numerics_label` turn into the paper's ratio and label.

The paper's printed values (Tables 2 and 4, Sections 5.1-5.2) are in :mod:`looped_kv.papers`; the defaults
of the tail threshold and of the block-dependence threshold come from there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from numpy.typing import ArrayLike
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.analysis.fits import BootstrapCI, paired_bootstrap_ratio
from looped_kv.analysis.measure import kl
from looped_kv.analysis.planes import in_dtype
from looped_kv.decoding.core import new_cache, prefill, run_block, step
from looped_kv.papers import RIPE_SEC_5_2, RIPE_TABLE_4_SETUP
from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.memory import policy_bytes
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy

EXCEEDS_NUMERICS = "exceeds numerics"
INDISTINGUISHABLE_NUMERICS = "indistinguishable from numerics"
TAIL_KL: float = RIPE_TABLE_4_SETUP["tail KL"]  # RIPE Table 4's tail threshold
NUMERICS_THRESHOLD = float(RIPE_SEC_5_2["block dependence threshold"])  # RIPE Sec. 5.2, pre-registered


def with_dtype(model: LoopedLM, dtype: torch.dtype) -> LoopedLM:
    """``model`` itself if it is in ``dtype``, else a copy of its weights cast to ``dtype`` (tokenizer and
    source shared). Casting the bf16 model up gives the fp32 arm the same weights, so that it differs from
    the bf16 reference in arithmetic only."""
    return in_dtype(model, dtype)


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

    Both caches hold the same prefill of ``tokens[:, :start]``; the batched block is committed from its
    buffer as Algorithm 1 does, the sequential one is written by each step. Proposition 1: with a
    block-independent policy (full, or RIPE with W >= gamma) both are equal in exact arithmetic.
    """
    n, R = tokens.shape[1], policy.num_loops
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"tokens must be (1, n), got shape {tuple(tokens.shape)}")
    if not 1 <= start < n:
        raise ValueError(f"start must be in [1, {n - 1}] (a prefix and a block of at least one token), got {start}")
    sequential, batched = (new_cache(model, policy, 1, n) for _ in range(2))
    for cache in (sequential, batched):
        prefill(model, cache, tokens[:, :start], R)
    logits_seq = torch.cat([step(model, sequential, tokens[:, t:t + 1], R) for t in range(start, n)], dim=1)
    buffer = BlockBuffer(model.config, R, batch=1, capacity=n - start, dtype=model.dtype, device=model.device)
    router = BlockPass(batched, range(start, n), buffer=buffer, store="buffer")
    logits_batch, _ = run_block(model, tokens[:, start:], router, R)
    batched.commit(buffer, n - start)
    planes = max(float((a - b).abs().max()) for a, b in zip(_cache_tensors(batched), _cache_tensors(sequential),
                                                                 strict=True) if a.numel())
    return BlockComparison(logits=float((logits_batch - logits_seq).abs().max()), planes=planes,
                           targets_equal=bool(torch.equal(logits_batch.argmax(-1), logits_seq.argmax(-1))))


# -- Table 4 and Figure 4 ---------------------------------------------------------------------------


def _check_trajectories(trajectories: Sequence[Tensor], prompt_lengths: Sequence[int]) -> None:
    if len(trajectories) == 0 or len(trajectories) != len(prompt_lengths):
        raise ValueError(f"trajectories and prompt_lengths must be non-empty and of equal length, got "
                         f"{len(trajectories)} and {len(prompt_lengths)}")
    for i, (tokens, p) in enumerate(zip(trajectories, prompt_lengths, strict=True)):
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"trajectories[{i}] must be (1, n), got shape {tuple(tokens.shape)}")
        if not 1 <= p < tokens.shape[1]:
            raise ValueError(f"prompt_lengths[{i}] must be in [1, {tokens.shape[1] - 1}], got {p}")


@dataclass(frozen=True)
class ArmReplay:
    """One trajectory replayed under one cache policy."""

    logits: Tensor  # (n - prompt_length, V) float64: :func:`~looped_kv.analysis.measure.policy_logits`
    block_kl: Tensor | None  # KL(sequential || batched) per block position (measure.block_dependence)


@torch.no_grad()
def replay_arm(model: LoopedLM, tokens: Tensor, prompt_length: int, policy: CachePolicy,
               block: int | None = None) -> ArmReplay:
    """Teacher-forced sequential replay, and with ``block`` the Section 5.2 block check, in one pass.

    The replay is :func:`~looped_kv.analysis.measure.policy_logits`. With ``block`` = gamma, the trajectory after the
    prompt is cut into verification blocks of gamma + 1 tokens as in
    :func:`~looped_kv.analysis.measure.block_dependence`;
    at the start of each block, before the block's sequential steps, one batched pass over the block reads the
    same cache (its planes go to a scratch buffer). The sequential logits serve both measurements, so the block
    check costs one batched pass per block instead of a second replay.
    """
    n, p, R = tokens.shape[1], prompt_length, policy.num_loops
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"tokens must be (1, n), got shape {tuple(tokens.shape)}")
    if not 1 <= p < n:
        raise ValueError(f"prompt_length must be in [1, {n - 1}], got {p}")
    if block is not None and block < 1:
        raise ValueError(f"block (gamma) must be >= 1, got {block}")
    cache = new_cache(model, policy, 1, n)
    replay = [prefill(model, cache, tokens[:, :p], R)[0, -1:]]
    starts = list(range(p, n - block, block + 1)) if block else []
    buffer = (BlockBuffer(model.config, R, batch=1, capacity=block + 1, dtype=model.dtype, device=model.device)
              if starts else None)
    sequential, batched = {}, {}
    for t in range(p, max(n - 1, starts[-1] + block + 1 if starts else 0)):
        if t in starts:
            router = BlockPass(cache, range(t, t + block + 1), buffer=buffer, store="buffer")
            batched[t], _ = run_block(model, tokens[:, t:t + block + 1], router, R)
        logits = step(model, cache, tokens[:, t:t + 1], R)[0]
        sequential[t] = logits
        if t < n - 1:
            replay.append(logits)
    block_kl = None
    if block is not None:
        block_kl = torch.cat([kl(torch.cat([sequential[t] for t in range(s, s + block + 1)]), batched[s][0])
                              for s in starts]) if starts else torch.empty(0, dtype=torch.float64)
    return ArmReplay(torch.cat(replay).double(), block_kl)


@dataclass(frozen=True)
class Replays:
    """Per-position records of every arm (:func:`replay_records`) and, with a block, the block dependence."""

    records: pd.DataFrame
    block_dependence: pd.DataFrame | None  # mean KL(sequential || batched) per prompt (rows) and policy (columns)


def replay_records(trajectories: Sequence[Tensor], prompt_lengths: Sequence[int],
                   reference: tuple[LoopedLM, CachePolicy], arms: Mapping[str, tuple[LoopedLM, CachePolicy]], *,
                   block: int | None = None, block_arms: Sequence[str] = (), reference_label: str = "reference",
                   progress: bool = False) -> Replays:
    """Teacher-forced replay of each trajectory through the reference and every arm (RIPE Sec. 2, 5.1, 5.2).

    ``reference`` and each arm are a (model, cache policy) pair; the model fixes the arithmetic (a bf16
    model for L0 and the cache arms, an fp32 copy for the precision floor). The records have one row per
    (prompt, generated position, arm): ``kl`` = KL(reference || arm) in float64 (rounding below 0 clipped to
    0), ``flip`` (the arm's top-1 token differs from the reference's), ``margin`` (the reference's top-2
    probability margin) and ``position`` (0 for the first generated token). With ``block`` = gamma, the
    reference and the arms named in ``block_arms`` also measure their block dependence during the same replay
    (:func:`replay_arm`); a trajectory too short for one block is then an error.
    """
    _check_trajectories(trajectories, prompt_lengths)
    if not arms:
        raise ValueError("arms must name at least one (model, policy) pair")
    unknown = [label for label in block_arms if label not in arms]
    if unknown:
        raise ValueError(f"block_arms must name arms, got {unknown}")
    if block is not None:
        if block < 1:
            raise ValueError(f"block (gamma) must be >= 1, got {block}")
        short = [i for i, (t, p) in enumerate(zip(trajectories, prompt_lengths, strict=True))
                 if t.shape[1] - p < block + 1]
        if short:
            raise ValueError(f"trajectories {short} hold no verification block of {block + 1} generated tokens")
    ref_model, ref_policy = reference
    frames, dependence = [], []
    for i, (tokens, p) in enumerate(tqdm(list(zip(trajectories, prompt_lengths, strict=True)), disable=not progress,
                                         desc="replay", leave=False)):
        ref = replay_arm(ref_model, tokens, p, ref_policy, block)
        top2 = ref.logits.softmax(-1).topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).cpu().numpy()
        top1 = ref.logits.argmax(-1)
        means = {reference_label: float(ref.block_kl.clamp_min(0).mean())} if block is not None else {}
        for label, (model, policy) in arms.items():
            arm = replay_arm(model, tokens, p, policy, block if label in block_arms else None)
            if arm.block_kl is not None:
                means[label] = float(arm.block_kl.clamp_min(0).mean())
            frames.append(pd.DataFrame({
                "prompt": i, "position": np.arange(ref.logits.shape[0]), "arm": label,
                "kl": kl(ref.logits, arm.logits).clamp_min(0).cpu().numpy(),
                "flip": (arm.logits.argmax(-1) != top1).cpu().numpy(), "margin": margin}))
        dependence.append(means)
    block_frame = None
    if block is not None:
        block_frame = pd.DataFrame(dependence)
        block_frame.index.name = "prompt"
    return Replays(pd.concat(frames, ignore_index=True), block_frame)


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


def survival(values: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Empirical survival function (Figure 4a/b): sorted values x and the fraction of values >= x."""
    x = np.sort(np.asarray(values, dtype=float).ravel())
    if x.size == 0:
        raise ValueError("values must not be empty")
    return x, 1.0 - np.arange(x.size) / x.size


# -- Section 5.2: block dependence ------------------------------------------------------------------


def numerics_label(ratio: BootstrapCI, threshold: float = NUMERICS_THRESHOLD) -> str:
    """RIPE Sec. 5.2's label: "exceeds numerics" when the ratio's lower bound is above the threshold (2).

    The paper prints 1.37 [1.20, 1.62] as "indistinguishable from numerics" against its pre-registered
    threshold of 2; the lower-bound rule is the one :func:`looped_kv.analysis.fits.fidelity_label` uses.
    """
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be > 0, got {threshold}")
    return EXCEEDS_NUMERICS if ratio.low > threshold else INDISTINGUISHABLE_NUMERICS


@dataclass(frozen=True)
class BlockDependence:
    """Section 5.2: mean block dependence of an arm over that of the reference (the full cache)."""

    ratio: BootstrapCI | None  # None when the reference is exactly 0 for every prompt (no ratio exists)
    label: str
    reference_mean: float
    arm_mean: float


def block_dependence_ratio(reference: ArrayLike, arm: ArrayLike, threshold: float = NUMERICS_THRESHOLD,
                           n_boot: int = 10_000, seed: int = 0) -> BlockDependence:
    """Ratio of per-prompt mean block dependences, arm / reference, with a prompt-paired bootstrap, and the label.

    If the reference (batched against sequential full-cache verification) is bitwise zero on every prompt,
    the numerics contribute nothing: the arm "exceeds numerics" if it is above zero anywhere, and there is
    no ratio.
    """
    ref, arm_values = np.asarray(reference, dtype=float), np.asarray(arm, dtype=float)
    means = float(ref.mean()), float(arm_values.mean())
    if ref.size and not ref.any():
        if ref.shape != arm_values.shape or np.any(arm_values < 0):
            raise ValueError("reference and arm must be paired per-prompt values >= 0")
        label = EXCEEDS_NUMERICS if arm_values.any() else INDISTINGUISHABLE_NUMERICS
        return BlockDependence(None, label, *means)
    ratio = paired_bootstrap_ratio(ref, arm_values, n_boot=n_boot, seed=seed)
    return BlockDependence(ratio, numerics_label(ratio, threshold), *means)
