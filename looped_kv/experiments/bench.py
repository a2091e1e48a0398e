"""Speed-ups and acceptance of every decoder against paired greedy decoding (DAS Table 1, Eq. 8-10), eager and
compiled side by side.

Two kinds of runs, one row per (prompt, method, mode) each:

* timing (:func:`run_paired`): each prompt is decoded alone (batch 1) by greedy full-depth
  decoding and by every method, eager and compiled (``compile=True``: every pass on a traced
  step with static shapes), in the same process, in ``repeats`` interleaved rounds per mode (greedy
  and every method once per round, the order reversed every other round), so each method's speed-up
  is paired with the greedy run of its own mode on the same prompt and a slow stretch of the machine
  falls on every arm alike. The speed-up is DAS Eq. (8): the mean over prompts of
  (n/t)_method / (n/t)_greedy, prefill included, each time the median over the rounds, with a paired
  prompt bootstrap interval (:func:`looped_kv.analysis.fits.mean_speedup`); every compiled run is
  also paired with eager greedy decoding (what compilation gains). The prefill alone (one new token) is
  timed in the same rounds, under each cache the arms decode under (:func:`prefill_arms`): no decoder under the full
  cache can pass greedy decoding's time over it (:func:`prefill_bound`), since all run that prefill, and the decode
  phase (:func:`decode_phase_speedup`) is each run's time less its own cache's prefill;
* acceptance (:func:`acceptance_runs`): each method decodes all prompts as one batch. Every row is
  what decoding that prompt alone gives, so the per-prompt accepted length A (Eq. 9), committed
  progress G (Eq. 10) and tokens per verification tau cost a fraction of the timing runs.

Methods are named by :data:`looped_kv.decoding.settings.METHODS` (``ar``, ``self-spec``,
``mature-spec``, ``pld``, ``das-wave``) and configured by their dataclasses there;
:data:`~looped_kv.decoding.settings.DISPLAY` labels tables only. Each drafter's acceptance has a
ceiling: tau <= gamma + 1 for the sequential drafters (self-spec, mature-spec, pld) and A <= w for
DAS-Wave, w = min(max_width, W_init + J - 1) (DAS Eq. 5; max_width is its verifier capacity gamma). Every
verdict here goes through :func:`looped_kv.analysis.verdicts.verdict`: a timing verdict needs 16 prompts timed
in interleaved repeats; arms with different ceilings are compared as shares of their ceilings (``share``: A over
the most drafts one verification can accept) or by speed, never by raw A (:func:`acceptance_verdict` refuses
it).

    looped-kv bench --workloads problems --prompts 32 --max-new-tokens 128
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv import prose
from looped_kv.analysis.fits import accepted_length, committed_progress, interaction_effect, mean_speedup
from looped_kv.analysis.verdicts import (
    BOOK_MINIMUM,
    Check,
    Claim,
    Verdict,
    below_ceiling,
    discrimination,
    varies,
    verdict,
)
from looped_kv.decoding import settings
from looped_kv.decoding.das_wave import check_wave, proposal_width
from looped_kv.decoding.generate import generate
from looped_kv.decoding.loop import PassLog
from looped_kv.decoding.passes import PassRecord
from looped_kv.decoding.prompts import check_prompts
from looped_kv.decoding.result import Generation
from looped_kv.decoding.settings import (
    METHODS,
    PAPER_LOOPS,
    WAVE_KEYS,
    DasWave,
    Decoding,
    Greedy,
    PromptLookup,
    SelfSpec,
    method_config,
)
from looped_kv.experiments.speed import frozen_heap
from looped_kv.protocol.freeze import sha256
from looped_kv.runtime.loading import resolve_source
from looped_kv.runtime.measurement import measurement_mode, source_commit
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads import data

TOKENS = "the book's smallest effect for tokens per verification (RIPE Table 6's +0.5 for tau)"
SPEED = "the book's smallest speed ratio (10%, the smallest ratio RIPE Table 6 pre-registers)"
#: DAS Sec. 4.3 and Table 2: with the same draft depth and gamma, deep K/V prefix reads accept more drafts.
MATURE_SPEC_ACCEPTS_MORE = Claim("Mature-Spec accepts more drafts per verification than self-speculation "
                                 "(same d and gamma)", "DAS Sec. 4.3, Table 2", minimum=BOOK_MINIMUM["tokens"],
                                 minimum_source=TOKENS)
#: DAS Sec. 4.2 and Table 1: Mature-Spec improves over sequential self-speculation in all sixteen settings.
MATURE_SPEC_FASTER = Claim("Mature-Spec decodes faster than self-speculation", "DAS Sec. 4.2, Table 1",
                           scale="log-ratio", minimum=BOOK_MINIMUM["ratio"], minimum_source=SPEED)
#: DAS Sec. 4.2 and Table 1: DAS-Wave obtains the largest measured speed-up in every setting.
WAVE_FASTER = Claim("DAS-Wave decodes faster than Mature-Spec", "DAS Sec. 4.2, Table 1", scale="log-ratio",
                    minimum=BOOK_MINIMUM["ratio"], minimum_source=SPEED)
#: DAS Sec. C.4, Eq. (11) and Table 9: the three-way interaction of carry, deep K and deep V is positive.
INTERACTION = Claim("carry strengthens the complementarity of mature keys and values: E_cKV > 0",
                    "DAS Sec. C.4, Eq. 11, Table 9", minimum=BOOK_MINIMUM["tokens"], minimum_source=TOKENS)

#: The DAS-Wave prefix reads of the carry x K x V factorial, by (deep K, deep V) (DAS Eq. 4).
FACTORIAL_READS = {(0, 0): "aligned", (0, 1): "deep-v", (1, 0): "deep-k", (1, 1): "deep-kv"}
#: The timing modes: eager passes, and every pass on a compiled step (``compile=True``).
MODES = ("eager", "compiled")
#: The timing arm of the prefill alone in :func:`run_paired`'s rounds (the full cache's: greedy decoding's).
PREFILL = "prefill"
#: The options that name a decoder's cache policy (:func:`~looped_kv.runtime.policy.make_policy`), which its
#: prefill fills.
CACHE_OPTIONS = ("cache", "num_loops", "window", "k", "sinks")


def cache_options(config: Decoding) -> dict[str, object]:
    """``config``'s cache policy: its :data:`CACHE_OPTIONS` by name."""
    return {name: getattr(config, name) for name in CACHE_OPTIONS}


def prefill_key(config: Decoding) -> Hashable:
    """The key of ``config``'s prefill arm in :func:`run_paired`'s rounds: :data:`PREFILL` under the full cache (every
    decoder there shares greedy decoding's prefill), else (:data:`PREFILL`, its cache options), since the prefill
    fills the decoder's own cache."""
    options = cache_options(config)
    return PREFILL if options == cache_options(Greedy()) else (PREFILL, tuple(options.values()))


def prefill_arms(configs: Iterable[Decoding]) -> dict[Hashable, Greedy]:
    """One prefill arm per cache policy ``configs`` decode under (:func:`prefill_key`), the full cache's first:
    greedy decoding of one token under that policy (the prompt's pass and the first token)."""
    arms: dict[Hashable, Greedy] = {PREFILL: Greedy(max_new_tokens=1)}
    for config in configs:
        arms.setdefault(prefill_key(config), Greedy(max_new_tokens=1, **cache_options(config)))
    return arms


def method_configs(draft_loops: int | None = None, gamma: int = SelfSpec.gamma,
                   wave: dict | None = None, methods: Iterable[str] = METHODS,
                   fuse_rounds: bool = False) -> dict[str, Decoding]:
    """The config (:mod:`~looped_kv.decoding.settings`) of each of ``methods`` (default every method of
    :data:`~looped_kv.decoding.settings.METHODS`), keyed by method, in that tuple's order.

    Self-spec and Mature-Spec draft ``draft_loops`` (d; None: generate's default for the R decoded at,
    :func:`~looped_kv.decoding.settings.default_draft_loops`) loops and verify ``gamma`` drafts at a time, so that
    they differ only in their prefix reads (DAS Sec. 4.3 compares reads at one draft depth); prompt lookup drafts up to
    ``gamma`` tokens; DAS-Wave runs :class:`~looped_kv.decoding.settings.DasWave`'s schedule (the paper's Huginn
    schedule) updated by ``wave``, its rounds fused into one compiled step with ``fuse_rounds``.
    """
    if draft_loops is not None and draft_loops < 1:
        raise ValueError(f"draft_loops must be >= 1, got {draft_loops}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    unknown = sorted(set(wave or {}) - set(WAVE_KEYS))
    if unknown:
        raise ValueError(f"wave must set only {WAVE_KEYS}, got {unknown}")
    methods = set(methods)
    if not methods <= set(METHODS):
        raise ValueError(f"methods must be among {METHODS}, got {sorted(methods - set(METHODS))}")
    # J None (not given): the R decoded at sets it (settings.default_rounds)
    schedule = DasWave(**(wave or {}), fuse_rounds=fuse_rounds)
    check_wave(schedule.max_width, schedule.wave_rounds(PAPER_LOOPS), schedule.initial_width, schedule.updates)
    configs = {"ar": Greedy(), "self-spec": method_config("self-spec", draft_loops=draft_loops, gamma=gamma),
               "mature-spec": method_config("mature-spec", draft_loops=draft_loops, gamma=gamma),
               "pld": PromptLookup(gamma=gamma), "das-wave": schedule}
    return {method: config for method, config in configs.items() if method in methods}


#: The key (and table label) of sequential self-speculation with Deep V prefix reads (``--deep-v``; DAS Table 7).
DEEP_V_SPEC = "self-spec, deep V"


def deep_v_config(draft_loops: int | None, gamma: int) -> SelfSpec:
    """Self-speculation with Deep V (Mature-V) prefix reads at Mature-Spec's ``draft_loops`` and ``gamma``."""
    return replace(method_configs(draft_loops, gamma)["self-spec"], prefix_reads="deep-v")


#: Greedy decoding under the smaller caches, timed against greedy decoding with the full cache (``--caches``): RIPE
#: at chapter 7's window, the deepest plane alone (RIPE Sec. 3), and the deepest plane with StreamingLLM's 4
#: attention sinks at full depth beside the same window (the sinks policy, RIPE Sec. 5.1's "+ sinks" arm).
CACHE_ARMS = {"ripe": Greedy(cache="ripe", window=8), "deepest": Greedy(cache="deepest"),
              "sinks": Greedy(cache="sinks", sinks=4, window=8)}


def cache_key(cache: str) -> str:
    """A cache arm's key in the runs: greedy decoding under ``cache`` (:data:`CACHE_ARMS`) with its sinks and window,
    e.g. "greedy, ripe(8)" or "greedy, sinks(4, 8)"."""
    arm = CACHE_ARMS[cache]
    sizes = [str(size) for size in (arm.sinks, arm.window) if size is not None]
    return f"greedy, {cache}" + (f"({', '.join(sizes)})" if sizes else "")


def label(key: Hashable) -> str:
    """A method's table label (:data:`~looped_kv.decoding.settings.DISPLAY`), or the key itself."""
    return settings.DISPLAY.get(key, str(key)) if isinstance(key, str) else str(key)


@dataclass(frozen=True)
class Ceiling:
    """The statistic that bounds a drafter's acceptance and its range [floor, value]."""

    statistic: str  # "tau" (sequential drafters) or "A" (DAS-Wave)
    value: int
    floor: int

    def __str__(self) -> str:
        return f"{self.statistic} <= {self.value}"


def ceiling(config: Decoding, num_loops: int) -> Ceiling | None:
    """tau <= gamma + 1 for a sequential drafter, A <= w for DAS-Wave (DAS Eq. 5; J at R = ``num_loops``), None for
    greedy decoding."""
    if isinstance(config, DasWave):
        return Ceiling("A", proposal_width(config.max_width, config.wave_rounds(num_loops), config.initial_width), 0)
    gamma = getattr(config, "gamma", None)
    return None if gamma is None else Ceiling("tau", gamma + 1, 1)


def _rows(out: Generation, key: Hashable, config: Decoding, num_loops: int) -> list[dict]:
    """One row per prompt of a run: its tokens, verifications, A, G (= tau), the fraction of its ceiling reached by
    its statistic (tau or A), and ``share``: A over the most drafts one verification can accept (gamma, or w)."""
    bound = ceiling(config, num_loops)
    most = (bound.value - 1 if bound.statistic == "tau" else bound.value) if bound else float("nan")
    rows = []
    for i, (accepted, retained, new, stopped) in enumerate(
            zip(out.row_accepted, out.row_retained, out.new_rows, out.stopped, strict=True)):
        a = float(np.mean(accepted)) if accepted else float("nan")
        g = float(np.mean(np.add(accepted, retained))) if accepted else float("nan")
        stat = {"tau": g, "A": a}[bound.statistic] if bound else float("nan")
        rows.append({"prompt": i, "method": key, "new_tokens": len(new), "verifications": len(accepted), "A": a,
                     "G": g, "tau": g, "accepted": list(accepted), "retained": list(retained), "stopped": stopped,
                     "statistic": bound.statistic if bound else "", "ceiling": bound.value if bound else np.nan,
                     "floor": bound.floor if bound else np.nan,
                     "of ceiling": stat / bound.value if bound else float("nan"), "share": a / most})
    return rows


def tokens_per_verification(runs: pd.DataFrame) -> pd.Series:
    """Per method that verified (keyed as ``runs``' ``method``): the tokens its verifications committed over their
    number, summed over prompts (the tau of Eq. (8) that prices a whole run: a ratio of sums, not a mean of
    per-prompt G)."""
    drafted = runs[runs["verifications"] > 0]
    if drafted.empty:
        raise ValueError("no run made a verification")
    committed = drafted["accepted"].map(sum) + drafted["retained"].map(sum)
    by_method = drafted.assign(committed=committed).groupby("method", sort=False)
    return by_method["committed"].sum() / by_method["verifications"].sum()


def acceptance_runs(model: LoopedLM, prompts: Sequence[Tensor], methods: Mapping[Hashable, Decoding],
                    max_new_tokens: int,
                    progress: bool = False, rows_per_chunk: int | None = None) -> pd.DataFrame:
    """Each drafting method decodes all ``prompts`` as one batch (in row chunks of at most ``rows_per_chunk`` rows); one
    row per (prompt, method) (see :func:`_rows`)."""
    rows = []
    for key, config in tqdm(methods.items(), desc="acceptance", disable=not progress, leave=False):
        if config.method != "ar":
            out = generate(model, list(prompts), config, max_new_tokens=max_new_tokens, rows_per_chunk=rows_per_chunk)
            rows += _rows(out, key, config, model.config.mean_recurrence)
    return pd.DataFrame(rows)


def acceptance_by_temperature(model: LoopedLM, prompts: Sequence[Tensor], methods: Mapping[Hashable, Decoding],
                              max_new_tokens: int, temperatures: Sequence[float], seed: int = 0,
                              rows_per_chunk: int | None = None) -> pd.DataFrame:
    """:func:`acceptance_runs` of every method at each of ``temperatures`` (0: greedy decoding), sampling with
    ``seed`` (row i draws with seed + i): speculative sampling keeps the verifier's distribution, so a draft is
    accepted with probability min(1, p / q) and tau falls as the distributions spread. One row per (temperature,
    prompt, method)."""
    if not temperatures or any(not (isinstance(t, int | float) and 0 <= t < float("inf")) for t in temperatures):
        raise ValueError(f"temperatures must be numbers >= 0, got {list(temperatures)}")
    runs = [acceptance_runs(model, prompts, {key: replace(config, temperature=float(t), seed=seed)
                                             for key, config in methods.items()},
                            max_new_tokens, rows_per_chunk=rows_per_chunk).assign(temperature=float(t))
            for t in temperatures]
    return pd.concat(runs, ignore_index=True)


def check_rounds(repeats: int, modes: Sequence[str]) -> None:
    """The interleaved rounds of a timing run: an integer count >= 1, and modes of :data:`MODES`."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must name some of {MODES}, got {list(modes)}")


@dataclass(frozen=True)
class Rounds:
    """One prompt's interleaved rounds (:func:`interleaved_rounds`): each arm's times, its first run and, observed,
    the passes of its first run and each run's time inside its passes (the sum of their wall times)."""

    times: dict[Hashable, list[float]]
    first: dict[Hashable, Generation]
    passes: dict[Hashable, list[PassRecord]]
    pass_seconds: dict[Hashable, list[float]]


def interleaved_rounds(model: LoopedLM, ids: Tensor, arms: Mapping[Hashable, Decoding], repeats: int,
                       log_passes: bool = False, **options: object) -> Rounds:
    """Each of ``arms`` (configs by key, changed by ``options`` in every run) decodes ``ids`` once per round,
    in ``repeats`` rounds: the arms in order in even rounds and reversed in odd ones, so that they are timed side by
    side under the same conditions. ``log_passes`` keeps every pass of each arm's first run
    (:class:`~looped_kv.decoding.loop.PassLog`) and each run's time inside its passes. Every arm decodes ``ids`` once,
    untimed, before the rounds: compiled, it then meets every step shape of this prompt's decoding traced (a trace
    made inside a timed run had put seconds of compiling into one prompt's time); eager, its first run after another
    mode's is not timed (eager and compiled modes alternating prompt by prompt, without it, had put eager RIPE at 0.98
    and eager sinks at 0.97 of the full cache on 16 problems prompts, against 1.01 and 0.98 eager alone)."""
    for config in arms.values():
        generate(model, ids, config, **options)
    times: dict[Hashable, list[float]] = {key: [] for key in arms}
    first: dict[Hashable, Generation] = {}
    passes: dict[Hashable, list[PassRecord]] = {}
    pass_seconds: dict[Hashable, list[float]] = {}
    for r in range(repeats):
        for key in arms if r % 2 == 0 else list(arms)[::-1]:
            log = PassLog() if log_passes else None
            out = generate(model, ids, arms[key], observer=log, **options)
            times[key].append(out.wall_time)
            first.setdefault(key, out)
            if log is not None:
                passes.setdefault(key, log.passes)
                pass_seconds.setdefault(key, []).append(sum(p.seconds for p in log.passes))
    return Rounds(times, first, passes, pass_seconds)


def run_paired(model: LoopedLM, prompts: Sequence[Tensor], methods: Mapping[Hashable, Decoding], max_new_tokens: int,
               progress: bool = True, repeats: int = 1, modes: Sequence[str] = ("eager",)) -> pd.DataFrame:
    """Timing runs: every prompt alone, for each of ``modes`` (:data:`MODES`) in ``repeats`` interleaved rounds of
    greedy decoding and each method (the order reversed every other round), modes one after the other prompt by
    prompt; one row per (prompt, method, mode) with its median time over the rounds, tokens/s, per-prompt speed-up
    over the paired greedy run of its mode (DAS Eq. 8) and over eager greedy decoding, A, G, tau, whether it equals
    greedy and ``repeats``. Every arm decodes each prompt once untimed before its rounds, compiled steps traced then
    (:func:`interleaved_rounds`); the runs are timed under :func:`~looped_kv.experiments.speed.frozen_heap`."""
    check_rounds(repeats, modes)
    generate(model, prompts[0], max_new_tokens=4)  # warm-up
    keys = ["ar", *(key for key in methods if key != "ar")]
    configs = {"ar": Greedy(), **methods}
    rows = []
    with frozen_heap():
        for i, ids in enumerate(tqdm(prompts, desc="prompts", disable=not progress, leave=False)):
            eager: tuple[Generation, float] | None = None  # eager greedy decoding's run and median time
            for mode in modes:
                compiled = mode == "compiled"
                arms = {**{key: replace(configs[key], max_new_tokens=max_new_tokens) for key in keys},
                        **prefill_arms(configs.values())}
                rounds = interleaved_rounds(model, ids, arms, repeats, compile=compiled)
                median = {key: float(np.median(times)) for key, times in rounds.times.items()}
                outs, reference, greedy_time = rounds.first, rounds.first["ar"], median["ar"]
                if not compiled and eager is None:
                    eager = (reference, greedy_time)
                for key, config in methods.items():
                    out, time_s = outs[key], median[key]
                    (row,) = _rows(out, key, config, model.config.mean_recurrence)
                    rows.append({**row, "prompt": i, "mode": mode, "time_s": time_s,
                                 "tokens_per_s": out.num_new / time_s, "greedy_time_s": greedy_time,
                                 "greedy_tokens": reference.num_new,
                                 "prefill_time_s": median[prefill_key(config)],
                                 "greedy_prefill_time_s": median[PREFILL],
                                 "speed-up": (out.num_new / time_s) / (reference.num_new / greedy_time),
                                 "eager_greedy_time_s": np.nan if eager is None else eager[1],
                                 "eager_greedy_tokens": np.nan if eager is None else eager[0].num_new,
                                 "same_as_greedy": bool(torch.equal(out.tokens, reference.tokens)), "repeats": repeats})
    return pd.DataFrame(rows)


#: The sampler of :func:`sampling_overhead`: its whole path (processing, per-row draws, the speculative sampling rule)
#: with the top 1 token kept, so a sampled run emits greedy decoding's tokens and verifies the same drafts.
ARGMAX_SAMPLING = {"temperature": 1.0, "top_k": 1, "seed": 0}  # Decoding's sampling options
#: Issue 41's budget for the sampler: at most 5% over greedy decoding of the same method.
SAMPLING_BUDGET = 1.05


def sampling_overhead(model: LoopedLM, prompts: Sequence[Tensor], methods: Mapping[Hashable, Decoding],
                      max_new_tokens: int,
                      repeats: int = 2, modes: Sequence[str] = ("eager",), progress: bool = True,
                      n_boot: int = 2000) -> pd.DataFrame:
    """What sampling costs over greedy decoding, per method and mode: each prompt decoded alone by the method
    greedily and with :data:`ARGMAX_SAMPLING`, the two interleaved in ``repeats`` rounds (the order reversed every
    other round); the ratio of their median times per prompt, its mean over prompts with a paired 95% bootstrap
    interval, and whether every sampled run emitted the greedy tokens (so the ratio is the sampler's cost alone).
    Each arm decodes each prompt once untimed before its rounds (:func:`interleaved_rounds`)."""
    check_rounds(repeats, modes)
    rows = []
    with frozen_heap():
        for key, config in tqdm(methods.items(), desc="sampling overhead", disable=not progress, leave=False):
            for mode in modes:
                arms = {"greedy": config, "sampled": replace(config, **ARGMAX_SAMPLING)}
                options = dict(max_new_tokens=max_new_tokens, compile=mode == "compiled")
                for i, ids in enumerate(prompts):
                    rounds = interleaved_rounds(model, ids, arms, repeats, **options)
                    rows.append({"method": key, "mode": mode, "prompt": i,
                                 "greedy_time_s": float(np.median(rounds.times["greedy"])),
                                 "sampled_time_s": float(np.median(rounds.times["sampled"])),
                                 "same_tokens": bool(torch.equal(rounds.first["greedy"].tokens,
                                                                 rounds.first["sampled"].tokens))})
    runs = pd.DataFrame(rows)
    out = []
    for (key, mode), group in runs.groupby(["method", "mode"], sort=False):
        ratio = mean_speedup(group["sampled_time_s"], group["greedy_time_s"], n_boot=n_boot)  # t_sampled / t_greedy
        out.append({"method": label(key), "mode": mode, "sampled / greedy time": ratio.estimate, "low": ratio.low,
                    "high": ratio.high, "prompts": len(group), "repeats": repeats,
                    "within 5%": ratio.high <= SAMPLING_BUDGET,
                    "same tokens": f"{int(group['same_tokens'].sum())}/{len(group)}"})
    return pd.DataFrame(out).set_index(["method", "mode"])


def batched_runs(model: LoopedLM, prompts: Sequence[Tensor], batch: int, caches: Sequence[str], max_new_tokens: int,
                 repeats: int = 2, modes: Sequence[str] = ("eager",), progress: bool = True) -> pd.DataFrame:
    """Greedy decoding of ``batch`` prompts together under each of ``caches`` (:data:`CACHE_ARMS`) beside the full
    cache (RIPE Sec. 5.3 sets caches side by side at a batch, B_max): the prompts in consecutive sets of ``batch`` (a
    last incomplete set left out), each set decoded by every arm in ``repeats`` interleaved rounds (the order reversed
    every other round) per mode of ``modes`` (compiled steps traced before the rounds), every row to its full budget,
    so that every arm emits as many tokens. One row per (set, mode, arm): its median time and the rows' new tokens;
    :func:`batched_summary` reads them."""
    check_rounds(repeats, modes)
    check_caches(caches, required=True)
    check_batch(batch, len(prompts))
    arms = {"full": Greedy(), **{cache_key(c): CACHE_ARMS[c] for c in caches}}
    units = [[p.reshape(-1) for p in prompts[k * batch:(k + 1) * batch]] for k in range(len(prompts) // batch)]
    generate(model, units[0], max_new_tokens=4)  # warm-up
    rows = []
    with frozen_heap():
        for k, unit in enumerate(tqdm(units, desc=f"prompt sets of {batch}", disable=not progress, leave=False)):
            for mode in modes:
                rounds = interleaved_rounds(model, unit, arms, repeats, max_new_tokens=max_new_tokens,
                                            stop_at_eos=False, compile=mode == "compiled")
                for key in arms:
                    rows.append({"method": "ar", "cache": key, "mode": mode, "set": k, "batch": batch,
                                 "time_s": float(np.median(rounds.times[key])),
                                 "new_tokens": rounds.first[key].num_new, "repeats": repeats})
    return pd.DataFrame(rows)


def batched_summary(runs: pd.DataFrame, n_boot: int = 10_000) -> pd.DataFrame:
    """Per cache and mode of :func:`batched_runs`'s ``runs``: the mean over sets of the tokens/s ratio to the full
    cache (DAS Eq. 8 with sets as units; as many tokens: t_full / t_cache), its 95% paired bootstrap interval, the
    sets, the rows per set and the rounds."""
    rows = {}
    for (key, mode), group in runs[runs["cache"] != "full"].groupby(["cache", "mode"], sort=False):
        full = runs[(runs["cache"] == "full") & (runs["mode"] == mode)].set_index("set").loc[group["set"]]
        ratio = mean_speedup(full["time_s"].to_numpy(), group["time_s"].to_numpy(), full["new_tokens"].to_numpy(),
                             group["new_tokens"].to_numpy(), n_boot=n_boot)
        rows[(key, mode)] = {"tokens/s ratio": ratio.estimate, "low": ratio.low, "high": ratio.high,
                             "sets": len(group), "batch": int(group["batch"].iloc[0]),
                             "repeats": int(group["repeats"].iloc[0])}
    table = pd.DataFrame(rows).T.astype({"sets": int, "batch": int, "repeats": int})
    table.index = table.index.set_names(["cache", "mode"])
    return table


def summarize(runs: pd.DataFrame, acceptance: pd.DataFrame | None = None, n_boot: int = 2000) -> pd.DataFrame:
    """Per method (and mode, where the runs hold more than eager ones): tokens/s, the mean speed-up over paired
    greedy decoding of the same mode (DAS Eq. 8) with its 95% interval, the speed-up over eager greedy decoding, A
    (Eq. 9), G (Eq. 10), tau, the ceiling and the fraction of it reached, and the runs equal to greedy's.

    ``runs`` are timing runs (:func:`run_paired`); A, G, tau and the ceiling come from ``acceptance``
    (:func:`acceptance_runs`) where given, else from the timing runs. Index: the methods' table labels, with
    " (compiled)" for compiled runs.
    """
    modes = list(pd.unique(runs["mode"])) if "mode" in runs else ["eager"]
    out = []
    for (key, mode), group in runs.assign(mode=runs.get("mode", "eager")).groupby(["method", "mode"], sort=False):
        speed = mean_speedup(group["greedy_time_s"], group["time_s"], group["greedy_tokens"], group["new_tokens"],
                             n_boot=n_boot)
        source = group if acceptance is None else acceptance[acceptance["method"] == key]
        drafted = source[source["verifications"] > 0]
        name = label(key) + (" (compiled)" if mode == "compiled" and modes != ["compiled"] else "")
        row = {"method": name, "tokens/s": group["tokens_per_s"].mean(), "speed-up": speed.estimate,
               "low": speed.low, "high": speed.high, "A": np.nan, "G": np.nan, "tau": np.nan, "ceiling": "–",
               "of ceiling": np.nan, "same as greedy": f"{int(group['same_as_greedy'].sum())}/{len(group)}"}
        if "eager" in modes and len(modes) > 1:
            over_eager = mean_speedup(group["eager_greedy_time_s"], group["time_s"], group["eager_greedy_tokens"],
                                      group["new_tokens"], n_boot=n_boot)
            row |= {"vs eager greedy": over_eager.estimate}
        if len(drafted):
            row |= {"A": accepted_length(drafted["accepted"].tolist()),
                    "G": committed_progress(drafted["accepted"].tolist(), drafted["retained"].tolist()),
                    "tau": drafted["tau"].mean(), "of ceiling": drafted["of ceiling"].mean(),
                    "ceiling": f"{drafted['statistic'].iloc[0]} <= {int(drafted['ceiling'].iloc[0])}"}
        out.append(row)
    return pd.DataFrame(out).set_index("method")


def decode_phase_speedup(runs: pd.DataFrame, n_boot: int = 2000):
    """DAS Eq. (8) on the decode phase alone, as LoopSpec and the papers report speed-ups: each run's time less the
    paired prefill's (the prompt's pass and the first token, under its own cache) and its tokens less that
    first one, over paired greedy decoding's; with its 95% paired bootstrap interval, over the prompts that have a
    decode phase (both runs emitted more than one token and outlasted their prefill). Each run loses its own prefill:
    a decoder under another cache than the full one fills that cache (``prefill_time_s``), greedy decoding the full
    one (``greedy_prefill_time_s``)."""
    decode = runs["time_s"] - runs["prefill_time_s"]
    greedy = runs["greedy_time_s"] - runs["greedy_prefill_time_s"]
    kept = (decode > 0) & (greedy > 0) & (runs["new_tokens"] > 1) & (runs["greedy_tokens"] > 1)
    if not kept.any():
        raise ValueError("no prompt has a decode phase: every run emitted one token or ended within its prefill")
    return mean_speedup(greedy[kept], decode[kept], runs["greedy_tokens"][kept] - 1, runs["new_tokens"][kept] - 1,
                        n_boot=n_boot)


def side_by_side(runs: pd.DataFrame, n_boot: int = 2000) -> pd.DataFrame:
    """One row per method: tokens/s, the speed-up over paired greedy decoding end to end and in the decode phase
    (:func:`decode_phase_speedup`; 95% intervals) eager and compiled, the compiled run over eager greedy decoding,
    and tau or A (from the eager runs)."""
    rows = []
    for key, group in runs.groupby("method", sort=False):
        row: dict = {"method": label(key)}
        for mode, part in group.groupby("mode", sort=False):
            speed = mean_speedup(part["greedy_time_s"], part["time_s"], part["greedy_tokens"], part["new_tokens"],
                                 n_boot=n_boot)
            decode = decode_phase_speedup(part, n_boot)
            row |= {f"{mode} tokens/s": part["tokens_per_s"].mean(),
                    f"{mode} speed-up": f"{speed.estimate:.2f} [{speed.low:.2f}, {speed.high:.2f}]",
                    f"{mode} decode phase": f"{decode.estimate:.2f} [{decode.low:.2f}, {decode.high:.2f}]"}
            if mode == "compiled" and part["eager_greedy_time_s"].notna().all():
                over = mean_speedup(part["eager_greedy_time_s"], part["time_s"], part["eager_greedy_tokens"],
                                    part["new_tokens"], n_boot=n_boot)
                row["compiled / eager greedy"] = f"{over.estimate:.2f} [{over.low:.2f}, {over.high:.2f}]"
        drafted = group[group["verifications"] > 0]
        if len(drafted):
            row["tau or A"] = f"{drafted[drafted['statistic'].iloc[0]].mean():.2f} ({drafted['statistic'].iloc[0]})"
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")


def best_compiled(runs: pd.DataFrame, n_boot: int = 2000) -> tuple[str, object] | None:
    """The compiled speculative method with the largest mean speed-up over compiled greedy decoding (DAS Eq. 8) and
    that speed-up with its paired 95% interval; None without compiled speculative runs."""
    compiled = runs[(runs["mode"] == "compiled") & (runs["verifications"] > 0)] if "mode" in runs else runs[:0]
    best = None
    for key, part in compiled.groupby("method", sort=False):
        speed = mean_speedup(part["greedy_time_s"], part["time_s"], part["greedy_tokens"], part["new_tokens"],
                             n_boot=n_boot)
        if best is None or speed.estimate > best[1].estimate:
            best = (label(key), speed)
    return best


def prefill_bound(runs: pd.DataFrame, mode: str) -> tuple[float, float]:
    """The largest mean speed-up over greedy decoding (DAS Eq. 8) any exact decoder can reach in ``mode`` on these
    prompts, the mean over prompts of greedy decoding's time over the prefill's (a decoder that cost nothing after
    its prefill), and the prefill's median share of greedy decoding's time."""
    per_prompt = runs[runs["mode"] == mode].groupby("prompt").first()
    ratio = per_prompt["greedy_time_s"] / per_prompt["greedy_prefill_time_s"]
    return float(ratio.mean()), float((1 / ratio).median())


# -- verdicts -------------------------------------------------------------------------------------------------


def _arm(runs: pd.DataFrame, key: Hashable) -> pd.DataFrame:
    arm = runs[runs["method"].map(lambda m: m == key)]
    if arm.empty:
        raise ValueError(f"the runs hold no method {key!r}; they hold {list(runs['method'].unique())}")
    return arm.set_index("prompt")


def room(runs: pd.DataFrame, key: Hashable) -> Check:
    """The check that method ``key``'s acceptance (tau or A, per :func:`ceiling`) stays below its ceiling."""
    arm = _arm(runs, key)
    arm = arm[arm["verifications"] > 0]
    if arm.empty:
        raise ValueError(f"method {key!r} made no verification in these runs")
    first = arm.iloc[0]
    return below_ceiling(arm[first["statistic"]], first["ceiling"], f"{first['statistic']} of {label(key)}",
                         floor=first["floor"])


def _most_accepted(runs: pd.DataFrame, key: Hashable) -> float:
    """The most drafts one verification of ``key`` can accept: gamma (tau <= gamma + 1) or w (A <= w)."""
    first = _arm(runs, key).iloc[0]
    return first["ceiling"] - 1 if first["statistic"] == "tau" else first["ceiling"]


def _rooms(runs: pd.DataFrame, method: Hashable, baseline: Hashable) -> list[Check]:
    """A baseline at its ceiling cannot be beaten by a method that accepts no more per verification (same
    gamma); DAS-Wave's A must stay below w before any verdict on it."""
    checks = [room(runs, baseline)] if _most_accepted(runs, method) <= _most_accepted(runs, baseline) else []
    return checks + [room(runs, key) for key in (method, baseline) if key == "das-wave"]


def acceptance_verdict(claim: Claim, runs: pd.DataFrame, method: Hashable, baseline: Hashable,
                       statistic: str = "A") -> Verdict:
    """``claim`` on the paired per-prompt accepted length A (DAS Eq. 9) of ``method`` against ``baseline``, or with
    ``statistic="share"`` on A as a share of the most each verification can accept (gamma, or w).

    Raw A compares arms only at the same ceiling: DAS-Wave's A <= w = 25 against Mature-Spec's A <= gamma = 8 would
    agree by construction, so that comparison is refused (compare ``share`` or speed). Discrimination: the verdict's
    unit rule, the baseline below its ceiling where the method can accept no more per verification than the
    baseline, DAS-Wave below w, and values that are not all equal.
    """
    if statistic not in ("A", "share"):
        raise ValueError(f"statistic must be 'A' or 'share', got {statistic!r}")
    most = {key: _most_accepted(runs, key) for key in (method, baseline)}
    if statistic == "A" and most[method] != most[baseline]:
        raise ValueError(f"{label(method)} accepts at most {most[method]:g} drafts per verification and "
                         f"{label(baseline)} {most[baseline]:g}: raw A of arms with different ceilings agrees by "
                         "construction; compare statistic='share' (A over its ceiling) or their speed")
    a, b = _arm(runs, method)[statistic], _arm(runs, baseline)[statistic]
    both = a.notna() & b.reindex(a.index).notna()
    a, b = a[both].to_numpy(), b.reindex(a.index)[both].to_numpy()
    checks = discrimination(*_rooms(runs, method, baseline),
                            varies(np.r_[a, b], f"{statistic} of {label(method)} and {label(baseline)}"))
    return verdict(claim, a, b, discrimination=checks)


def speed_verdict(claim: Claim, timing: pd.DataFrame, method: Hashable, baseline: Hashable) -> Verdict:
    """``claim`` on the paired per-prompt speed-ups (DAS Eq. 8) of ``method`` and ``baseline``, as a ratio.

    A timing verdict: at least 16 prompts, each timed in interleaved repeats (:func:`run_paired`), else
    inconclusive. Acceptance ceilings do not bound a speed ratio, so none is checked.
    """
    a, b = _arm(timing, method)["speed-up"], _arm(timing, baseline)["speed-up"]
    repeats = int(timing["repeats"].min()) if "repeats" in timing else 1
    return verdict(claim, a.to_numpy(), b.reindex(a.index).to_numpy(), kind="timing", units="timed prompts",
                   repeats=repeats)


def mature_spec_verdicts(timing: pd.DataFrame, acceptance: pd.DataFrame | None = None) -> dict[str, Verdict]:
    """The two verdicts on "Mature-Spec beats self-speculation": acceptance (:data:`MATURE_SPEC_ACCEPTS_MORE`, on
    ``acceptance`` runs where given, else the timing runs) and speed (:data:`MATURE_SPEC_FASTER`)."""
    runs = timing if acceptance is None else acceptance
    if set(_arm(runs, "self-spec")["ceiling"]) != set(_arm(runs, "mature-spec")["ceiling"]):
        raise ValueError("self-spec and mature-spec must verify blocks of the same gamma to compare acceptance")
    return {"acceptance": acceptance_verdict(MATURE_SPEC_ACCEPTS_MORE, runs, "mature-spec", "self-spec"),
            "speed": speed_verdict(MATURE_SPEC_FASTER, timing, "mature-spec", "self-spec")}


# -- the carry x K x V factorial (DAS Table 9, Eq. 11) ----------------------------------------------------------


def factorial_configs(wave: dict | None = None) -> dict[tuple[int, int, int], DasWave]:
    """DAS-Wave configs of the eight cells (carry, deep K, deep V) at one schedule (default DasWave's)."""
    schedule = method_configs(wave=wave)["das-wave"]
    return {(carry, deep_k, deep_v): replace(schedule, carry=bool(carry),
                                             prefix_reads=FACTORIAL_READS[(deep_k, deep_v)])
            for carry in (0, 1) for deep_k in (0, 1) for deep_v in (0, 1)}


#: Fewest verifications per prompt (median) of the carried cells behind an E_cKV verdict.
MIN_VERIFICATIONS = 3


def interaction_by_prompt(runs: pd.DataFrame) -> np.ndarray:
    """Per-prompt E_cKV (DAS Eq. 11) from the G of the eight cells of :func:`factorial_configs`' acceptance runs,
    on the prompts with a verification in every cell."""
    g = runs.pivot(index="prompt", columns="method", values="G")
    cells = list(factorial_configs())
    missing = [c for c in cells if c not in g.columns]
    if missing:
        raise ValueError(f"runs must hold the eight cells (carry, K, V); missing {missing}")
    g = g[cells].dropna()
    return np.array([interaction_effect(dict(zip(cells, row, strict=True))) for row in g.to_numpy()])


def interaction_verdict(runs: pd.DataFrame) -> Verdict:
    """:data:`INTERACTION` on the per-prompt E_cKV, against no interaction.

    Discrimination: the verdict's unit rule; the carried cells' G below the ceiling w (when every carried cell
    commits all w proposals, carry's K/V interaction is zero by saturation, whatever the reads do); G that is not
    the same in every cell; and carried cells that verify at least :data:`MIN_VERIFICATIONS` times per prompt (a
    continuation that ends within about w tokens, at end-of-text or at the token budget, lets a carried cell verify
    once, and its G is then what is left of the continuation, not what carry commits).
    """
    e = interaction_by_prompt(runs)
    carried = runs[runs["method"].map(lambda cell: cell[0] == 1)]
    w = int(carried["ceiling"].iloc[0])
    per_prompt = carried.groupby("prompt")["G"].mean().dropna()
    verifications = float(carried["verifications"].median())
    checks = discrimination(below_ceiling(per_prompt, w, "G of the carried cells"),
                            varies(runs["G"].dropna(), "G of the eight cells"),
                            Check("carried cells verify more than the budget allows once",
                                  verifications >= MIN_VERIFICATIONS,
                                  f"the carried cells verify {prose.times(verifications)} per prompt (median; need "
                                  f"{MIN_VERIFICATIONS}): the continuation's length (end-of-text or the token "
                                  "budget), not carry, caps their G"))
    return verdict(INTERACTION, e, null=0.0, discrimination=checks)


# -- the command line (looped-kv bench) -------------------------------------------------------------------------


def check_options(prompts: int, max_new_tokens: int, draft_loops: int | None, gamma: int, methods: Sequence[str],
                  workloads: Sequence[str], repeats: int = 2, caches: Sequence[str] = ()) -> None:
    """The bench's arguments, before any model is loaded: one-line ValueErrors naming the option and the value
    (``draft_loops`` None: the default for the model's R)."""
    if prompts < 2:
        raise ValueError(f"--prompts must be >= 2 (paired intervals need two prompts), got {prompts}")
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--draft-loops", draft_loops), ("--gamma", gamma),
                        ("--repeats", repeats)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, names, allowed in (("--methods", methods, settings.METHODS),
                                 ("--workloads", workloads, data.DECODING_WORKLOADS)):
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise ValueError(f"{flag} must name some of {allowed}, got {list(names)}")
    check_caches(caches)


def check_caches(caches: Sequence[str], required: bool = False) -> None:
    """--caches: names of :data:`CACHE_ARMS` (``required``: at least one)."""
    if any(c not in CACHE_ARMS for c in caches) or (required and not caches):
        raise ValueError(f"--caches must name some of {tuple(CACHE_ARMS)}, got {list(caches)}")


def check_batch(batch: int, prompts: int) -> None:
    """--batch of :func:`batched_runs`: at least 2 whole sets of B among the ``prompts`` (a paired interval)."""
    if not 1 <= batch <= prompts // 2:
        raise ValueError(f"--batch must be in [1, {prompts // 2}] (at least 2 sets of --prompts {prompts} for a paired "
                         f"interval), got {batch}")


def check_model(model_loops: int, draft_loops: int | None) -> None:
    """The arguments that need the model's config: d < R (None: the default for R, below it for any R > 1)."""
    if draft_loops is not None and not draft_loops < model_loops:
        raise ValueError(f"--draft-loops must be in [1, {model_loops - 1}] (fewer than the model's R = "
                         f"{model_loops} loops), got {draft_loops}")


def workload_prompts(model: LoopedLM, workload: str, prompts: int, max_new_tokens: int,
                     configs: Mapping[Hashable, Decoding]) -> list[Tensor]:
    """A workload's first ``prompts`` evaluation prompts, tokenized, each checked to leave room in the context for
    ``max_new_tokens`` and the largest verification block of ``configs``; at least 2 (paired intervals)."""
    margin = max(getattr(config, "gamma", 0) + 1 for config in configs.values())
    encoded = [model.tokenizer(p, return_tensors="pt").input_ids.to(model.device)
               for p in data.prompts(workload, prompts, "eval")]
    if len(encoded) < 2:
        raise ValueError(f"--workloads {workload}: only {len(encoded)} evaluation prompt(s) exist")
    try:
        check_prompts(model, encoded, max_new_tokens, margin=margin)
    except ValueError as error:
        raise ValueError(f"--max-new-tokens {max_new_tokens} on {workload}: {error}") from None
    return encoded


def bench_arms(methods: Sequence[str], draft_loops: int, gamma: int, caches: Sequence[str] = (),
               deep_v: bool = False) -> dict[str, Decoding]:
    """Every arm :func:`report` times, keyed as its runs' ``method``: greedy decoding (the reference, always),
    ``methods``' configs (:func:`method_configs` at ``draft_loops`` and ``gamma``; compiled DAS-Wave at its fastest,
    its J rounds fused into one step), greedy decoding under each of
    ``caches`` (:func:`cache_key`) and, with ``deep_v``, self-spec with Deep V reads (:data:`DEEP_V_SPEC`)."""
    configs = method_configs(draft_loops, gamma, methods=["ar", *methods], fuse_rounds=True)
    configs |= {cache_key(cache): CACHE_ARMS[cache] for cache in caches}
    if deep_v:
        configs[DEEP_V_SPEC] = deep_v_config(draft_loops, gamma)
    return configs


def report(model: LoopedLM, workloads: Sequence[str], prompts: int, max_new_tokens: int, methods: Sequence[str],
           draft_loops: int | None = None, gamma: int = SelfSpec.gamma, progress: bool = True,
           n_boot: int = 10_000, repeats: int = 2, modes: Sequence[str] = MODES,
           caches: Sequence[str] = (), deep_v: bool = False) -> dict[str, object]:
    """Print, per workload, every method's speed-up over paired greedy decoding on ``prompts`` evaluation prompts
    (each decoded alone, stopping at end-of-text, in ``repeats`` interleaved rounds), eager and compiled side by side
    (``modes``), tau or A as a fraction of its ceiling, the best compiled speculative method against compiled greedy
    decoding, and the verdicts on "Mature-Spec beats self-speculation", measured with cuDNN attention off
    (:func:`looped_kv.runtime.measurement.measurement_mode`). Every prompt is checked before decoding. Returns what
    :func:`write_record` keeps: the commit, the measurement's environment and each workload's timing runs."""
    check_options(prompts, max_new_tokens, draft_loops, gamma, methods, workloads, repeats, caches)
    check_model(model.config.mean_recurrence, draft_loops)
    commit = source_commit()  # what ran, read before a long measurement
    if draft_loops is None:
        draft_loops = settings.default_draft_loops(model.config.mean_recurrence)
    configs = bench_arms(methods, draft_loops, gamma, caches, deep_v)
    encoded = {workload: workload_prompts(model, workload, prompts, max_new_tokens, configs) for workload in workloads}
    pd.set_option("display.width", 250)
    wave = DasWave().schedule(model.config.mean_recurrence)
    with measurement_mode() as record:
        print(f"model {model.source} on {model.device} ({str(model.dtype).removeprefix('torch.')}), R = "
              f"{model.config.mean_recurrence}; torch {record['torch']}, cuDNN attention: {record['cudnn_sdp']}; "
              f"self-spec and mature-spec: d = {draft_loops}, gamma = {gamma}; pld: up to {gamma} drafts of "
              f"{PromptLookup.ngram}-grams; das-wave: {', '.join(f'{name} {wave[name]}' for name in WAVE_KEYS)}, "
              f"compiled: its rounds in one step; modes: {', '.join(modes)}")
        measured: dict[str, object] = {"commit": commit, "environment": dict(record), "runs": {}}
        for workload, ids in encoded.items():
            runs = run_paired(model, ids, configs, max_new_tokens, progress=progress, repeats=repeats,
                              modes=modes)
            measured["runs"][workload] = runs
            print(f"\n{workload}: {len(ids)} evaluation prompts, each decoded alone, up to {max_new_tokens} new "
                  f"tokens (stopping at end-of-text), {repeats} interleaved rounds per mode; speed-up: DAS Eq. (8) "
                  f"over paired greedy decoding of the same mode, 95% paired bootstrap interval")
            print(side_by_side(runs, n_boot=n_boot).to_string(float_format=lambda x: f"{x:.1f}", na_rep="–"))
            best = best_compiled(runs, n_boot=n_boot)
            if best is not None:
                name, speed = best
                print(f"  best compiled speculative method: {name}, {speed.estimate:.2f}x compiled greedy decoding "
                      f"[{speed.low:.2f}, {speed.high:.2f}]" + ("" if speed.low > 1 else " (interval not above 1)"))
            for mode in modes:
                bound, share = prefill_bound(runs, mode)
                print(f"  {mode}: the prefill is {share:.0%} of greedy decoding's time (median over prompts), so no "
                      f"decoder's speed-up can pass {bound:.2f}x here")
            first = runs[runs["mode"] == modes[0]]
            table = summarize(first, n_boot=n_boot)
            print(f"  {modes[0]} runs in detail:")
            print(table.to_string(float_format=lambda x: f"{x:.2f}", na_rep="–",
                                  formatters={"of ceiling": lambda x: "–" if np.isnan(x) else f"{x:.0%}"}))
            if {"self-spec", "mature-spec"} <= set(methods):
                for name, v in mature_spec_verdicts(first).items():
                    print(f"  Mature-Spec beats self-speculation, {name}: {v}")
            else:
                print("  Mature-Spec beats self-speculation: needs --methods self-spec mature-spec")
    return measured


# -- the recorded bench (book/data): what the chapters' speed verdicts read ------------------------------------------

#: The shipped tiny model's recorded bench, read by chapters 5 and 6 (``looped-kv bench --record``).
RECORD = Path(__file__).resolve().parent.parent.parent / "book" / "data" / "bench-tiny.json"
#: The shipped model's greedy decoding under the smaller caches against the full cache's (chapter 7):
#: ``looped-kv bench --methods ar --caches ripe deepest sinks ... --record`` (its command is in the file).
CACHES_RECORD = RECORD.with_name("bench-caches-tiny.json")
#: The same at chapter 7's B_max, prompts decoded together (``looped-kv bench --batch 4 --caches ... --record``).
BATCHED_CACHES_RECORD = RECORD.with_name("bench-caches-batched-tiny.json")


def weights_sha256(source: str | Path) -> str:
    """One digest of a checkpoint's weights: SHA-256 over each weight file's name and SHA-256, in name order."""
    folder = resolve_source(source)
    files = sorted(f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))
    if not files:
        raise ValueError(f"source {str(source)!r}: {folder} holds no weight file (.safetensors, .bin, .pt)")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name} {sha256(f)}\n".encode())
    return digest.hexdigest()


def write_record(path: Path, measured: Mapping[str, object], source: str | Path, command: str,
                 **header: object) -> None:
    """Save a bench (:func:`report`'s return) with what makes it a record: the command that printed it, the commit it
    started at (``measured["commit"]``: later commits during a long run do not rename it), the machine (CPU model,
    threads, torch), the date, the weights' digest (:func:`weights_sha256`) and any other ``header`` fields."""
    runs = {w: json.loads(r.assign(method=r["method"].map(lambda m: m if isinstance(m, str) else label(m)))
                          .to_json(orient="records"))
            for w, r in measured["runs"].items()}
    path.write_text(json.dumps({
        "command": command, "commit": measured["commit"], "environment": measured["environment"],
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "weights_sha256": weights_sha256(source),
        **header, "runs": runs}, indent=1) + "\n")


def check_weights(path: str | Path, digest: str | None, command: str, source: str | Path) -> None:
    """Refuse a record at ``path`` whose weights' ``digest`` is not ``source``'s: what it measured says nothing of
    this model (re-run its ``command``)."""
    ours = weights_sha256(source)
    if digest != ours:
        raise ValueError(f"{path} was measured on other weights than {str(source)!r}'s (weights_sha256 "
                         f"{str(digest)[:12]}..., the model's {ours[:12]}...): re-run `{command}`")


def read_record(path: Path = RECORD, source: str | Path = "tiny") -> tuple[dict, dict[str, pd.DataFrame]]:
    """A recorded bench (:func:`write_record`): its header and each workload's runs. A record measured on other
    weights than ``source``'s is refused: its speed-ups say nothing of this model; so is one made before
    :func:`run_paired` timed each cache's own prefill."""
    record = json.loads(Path(path).read_text())
    check_weights(path, record["weights_sha256"], record["command"], source)
    runs = {w: pd.DataFrame(r) for w, r in record["runs"].items()}
    for w, r in runs.items():
        if "prefill_time_s" in r and "greedy_prefill_time_s" not in r:
            raise ValueError(f"{path} predates each cache's own prefill arm (its {w} runs have no "
                             f"greedy_prefill_time_s, which the decode phase needs): re-run `{record['command']}`")
    return {k: v for k, v in record.items() if k != "runs"}, runs


def provenance(header: Mapping[str, object]) -> str:
    """When, where and how a recorded bench (:func:`read_record`'s header) was measured, as one sentence."""
    env = header["environment"]
    threads = env.get("threads")
    on = f"{env['cpu']}" + ("" if threads is None else f", {threads} thread{'s' if threads != 1 else ''}")
    return (f"measured on {header['date'][:10]} ({on}, torch {env['torch']}) at commit {header['commit']} by "
            f"`{header['command']}`")


def speed_timing(live: Mapping[str, pd.DataFrame], record: Path | None
                 ) -> tuple[dict[str, dict[str, pd.DataFrame]], str]:
    """The timing runs a chapter's speed verdicts read, by mode and workload, and where they come from: the recorded
    bench at ``record`` (its eager and compiled runs; :func:`read_record` refuses one measured on other weights than
    the shipped model's) with :func:`provenance`'s sentence, or with ``record=None`` the chapter's own live runs
    (eager)."""
    if record is None:
        return {"eager": dict(live)}, "the runs timed live in this chapter"
    header, runs = read_record(record)
    by_mode = {mode: {w: r[r["mode"] == mode].reset_index(drop=True) for w, r in runs.items()}
               for mode in MODES if any((r["mode"] == mode).any() for r in runs.values())}
    return by_mode, provenance(header)


def speed_verdicts(claim: Claim, timing: Mapping[str, Mapping[str, pd.DataFrame]], method: Hashable,
                   baseline: Hashable) -> dict[str, Verdict]:
    """:func:`speed_verdict` of every workload in every mode of ``timing`` (:func:`speed_timing`), named
    "workload" when there is one mode and "workload, mode" when there are several."""
    several = len(timing) > 1
    return {(f"{w}, {mode}" if several else w): speed_verdict(claim, runs, method, baseline)
            for mode, by_workload in timing.items() for w, runs in by_workload.items()}


def speed_table(timing: Mapping[str, Mapping[str, pd.DataFrame]], n_boot: int = 2000) -> pd.DataFrame:
    """Every method's mean speed-up over paired greedy decoding (DAS Eq. 8) end to end and in the decode phase
    (:func:`decode_phase_speedup`, prefill excluded, as LoopSpec and the papers report), per mode, as
    "estimate [low, high]"; one row per (workload, method)."""
    rows = {}
    for mode, by_workload in timing.items():
        for w, runs in by_workload.items():
            for key, part in runs.groupby("method", sort=False):
                whole = mean_speedup(part["greedy_time_s"], part["time_s"], part["greedy_tokens"],
                                     part["new_tokens"], n_boot=n_boot)
                decode = decode_phase_speedup(part, n_boot)
                row = rows.setdefault((w, label(key)), {})
                row[f"{mode}, end to end"] = f"{whole.estimate:.2f} [{whole.low:.2f}, {whole.high:.2f}]"
                row[f"{mode}, decode phase"] = f"{decode.estimate:.2f} [{decode.low:.2f}, {decode.high:.2f}]"
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(["workload", "method"])

