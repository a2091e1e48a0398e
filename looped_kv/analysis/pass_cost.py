"""A pass-cost model measured on the machine at hand: the CPU counterpart of RIPE/DAS Eq. (8)'s cost.

Eq. (8) prices a pass by its layer passes, c(r) = n_pre + r n_core + n_coda, whatever its new tokens: true on a GPU at
batch 1, not on a CPU, where an R-loop pass over 16 tokens costs about 1.7 one-token steps (DESIGN, "What speculation
can win on a CPU"). Here the time of one pass of g new tokens through r loops, reading L prefix positions, is fitted
per mode (eager, compiled), per measured width g and per measured context L_k as

    t(g, r, L_k) = a + b r

(the prelude, coda, head and attention over the prefix once; each loop once), linear in L between the measured
contexts (so bilinear in r and L on each segment; the end segments extended past them) and linear in g between the
measured widths (widths outside them are refused). A compiled step is one kernel per capacity, whose cost a line
through all capacities misprices (the attention's tiles change with it): its measured contexts are the capacity
buckets the decodes allocate (:func:`~looped_kv.decoding.passes.capacity_buckets`), looked up, not fitted. These
passes write their keys/values nowhere and attend over the prefix and their own block, as drafts and DAS-Wave rounds
do. A verification under a cache whose planes are each last written by their own loop (the full cache) is written into
the cache past the prefix and read there in place by one fused kernel (:meth:`~looped_kv.decoding.passes.Passes.
verification_store`): it is timed as its own kind at R loops, and its time at each measured width and context is the
cells' statistic, interpolated alike; greedy decoding's step is its one-token case. ``context`` L is what a pass's
attention reads (:class:`~looped_kv.decoding.passes.PassRecord`): eager, the committed prefix; compiled, the cache's
capacity. The prefill's time is interpolated linearly in its prompt tokens. The grid is timed at batch 1 by
``looped-kv pass-cost`` (:mod:`looped_kv.experiments.pass_cost`), which records it with the machine, the command, the
commit and the date.

A decoder's predicted time is the model's time of every pass it ran (its :class:`~looped_kv.decoding.loop.PassLog`)
plus its prefill (:func:`predict_seconds`); :func:`compare` sets predictions against measured times per method, and
:func:`speedup_bound` is Eq. (8) with measured pass times: the decode-phase speed-up over greedy decoding that a
drafter's tokens per verification allow, before any per-verification overhead; :func:`bounds` and :func:`ceilings`
tabulate it per drafter, at measured acceptance and with every proposal accepted, beside Eq. (8)'s own
(:func:`layer_pass_bound`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from looped_kv.analysis.perf import LayerCounts, layer_passes
from looped_kv.decoding.compiled import refined_width
from looped_kv.decoding.das_wave import proposal_width, rounds_of
from looped_kv.decoding.passes import PassRecord
from looped_kv.decoding.settings import DasWave, Decoding, MatureSpec, PromptLookup, SelfSpec

MODES = ("eager", "compiled")
#: The terms of one width's fit at one context, in the order of its coefficients: t = a + b r.
TERMS = ("1", "loops")
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {"median": lambda s: float(np.median(s)),
                                                             "min": lambda s: float(np.min(s))}
#: The batch every cell is timed at.
BATCH = 1
KINDS = ("pass", "verify", "prefill", "drafts", "wave")


@dataclass(frozen=True)
class Timing:
    """One cell of the timed grid in ``mode``: a pass (``kind`` "pass") of ``tokens`` new tokens through ``loops``
    loops reading ``context`` prefix positions, an R-loop verification of ``tokens`` tokens written into the cache and
    read there (``kind`` "verify"), a compiled chain of ``tokens`` one-token drafts of ``loops`` loops each in one
    step (``kind`` "drafts", :meth:`~looped_kv.decoding.passes.Passes.drafts`), a compiled DAS-Wave wave of ``tokens``
    rounds of ``loops`` loops each in one step, its rounds refining ``widths`` positions (``kind`` "wave",
    :meth:`~looped_kv.decoding.passes.Passes.wave`), or a prefill (``kind`` "prefill") of ``tokens`` prompt tokens
    through ``loops`` loops (``context`` 0); ``seconds`` holds one time per round."""

    mode: str
    kind: str
    tokens: int
    loops: int
    context: int
    seconds: tuple[float, ...]
    widths: tuple[int, ...] = ()


def _check_timing(t: Timing) -> None:
    if t.mode not in MODES or t.kind not in KINDS:
        raise ValueError(f"a timing's mode must be one of {MODES} and its kind one of {KINDS}, got {t.mode!r}, "
                         f"{t.kind!r}")
    if not t.seconds or not all(np.isfinite(t.seconds)) or min(t.seconds) <= 0:
        raise ValueError(f"a timing's seconds must be finite and > 0, got {t.seconds} ({t.mode} {t.kind} "
                         f"g={t.tokens} r={t.loops} L={t.context})")
    if (t.kind == "wave") != bool(t.widths) or (t.widths and len(t.widths) != t.tokens):
        raise ValueError(f"a wave timing (only) must give its rounds' widths, one per round, got {t.kind!r} of "
                         f"{t.tokens} rounds with widths {list(t.widths)}")


def _interpolate(nodes: Mapping[int, np.ndarray | float], x: float, what: str, hint: str) -> np.ndarray | float:
    """Linear interpolation between the measured ``nodes`` (x -> value); a ValueError outside them."""
    xs = sorted(nodes)
    if not xs[0] <= x <= xs[-1]:
        raise ValueError(f"{what} {x} is outside the measured {xs[0]}..{xs[-1]}; {hint}")
    return _along(nodes, x)


def _along(nodes: Mapping[int, float], x: float) -> float:
    """Linear interpolation between the ``nodes`` (x -> value), the end segments extended past them; one node is
    constant."""
    xs = sorted(nodes)
    if len(xs) == 1:
        return nodes[xs[0]]
    i = int(np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2))
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return (1 - w) * nodes[xs[i]] + w * nodes[xs[i + 1]]


@dataclass(frozen=True)
class PassCost:
    """A fitted pass-cost model (see the module docstring): per mode, width and measured context, the coefficients
    of :data:`TERMS` (``coefficients[mode][g][L]``) and the time of a verification in place (``verifications[mode][g]
    [L]``), the prefill's time per measured prompt length, the timings it was fitted on (``held_out`` widths timed but
    not fitted), ``meta``: what :mod:`looped_kv.experiments.pass_cost` records (machine, command, commit, threads,
    date, model), the time of a compiled chain of gamma one-token drafts (``drafts[mode][loops][gamma][L]``) and of
    a compiled DAS-Wave wave whose rounds refine ``widths`` positions with k loops each
    (``waves[mode][k][widths][L]``)."""

    statistic: str
    coefficients: dict[str, dict[int, dict[int, tuple[float, float]]]]
    verifications: dict[str, dict[int, dict[int, float]]]
    prefill: dict[str, dict[int, float]]
    timings: tuple[Timing, ...]
    held_out: tuple[int, ...] = ()
    meta: dict = field(default_factory=dict)
    drafts: dict[str, dict[int, dict[int, dict[int, float]]]] = field(default_factory=dict)
    waves: dict[str, dict[int, dict[tuple[int, ...], dict[int, float]]]] = field(default_factory=dict)

    def _mode(self, mode: str, table: dict) -> dict:
        if mode not in table:
            raise ValueError(f"mode {mode!r} was not measured; this pass-cost model holds {sorted(table)} (re-run "
                             f"looped-kv pass-cost with --modes {mode})")
        return table[mode]

    def contexts(self, mode: str = "eager") -> list[int]:
        """The contexts measured in ``mode`` (compiled: the capacities), where predictions are cells, not
        interpolated."""
        return sorted({L for by_context in self._mode(mode, self.verifications).values() for L in by_context})

    def seconds(self, tokens: int, loops: int, context: int, mode: str = "eager") -> float:
        """Predicted seconds of one pass of ``tokens`` new tokens through ``loops`` loops reading ``context`` prefix
        positions (compiled: the cache's capacity), at batch 1."""
        by_width = {g: _along({L: a + b * loops for L, (a, b) in by_context.items()}, context)
                    for g, by_context in self._mode(mode, self.coefficients).items()}
        return float(_interpolate(by_width, tokens, f"{mode} pass of tokens",
                                  "re-run looped-kv pass-cost with --tokens covering it"))

    def verify_seconds(self, tokens: int, context: int, mode: str = "eager") -> float:
        """Predicted seconds of one R-loop verification of ``tokens`` tokens written into the cache and read there in
        place (greedy decoding's step: one token) after ``context`` prefix positions (compiled: the cache's
        capacity), at batch 1."""
        by_width = {g: _along(by_context, context) for g, by_context in self._mode(mode, self.verifications).items()}
        return float(_interpolate(by_width, tokens, f"{mode} verification of tokens",
                                  "re-run looped-kv pass-cost with --verify-tokens covering it"))

    def drafts_seconds(self, gamma: int, loops: int, context: int, mode: str = "compiled") -> float:
        """Predicted seconds of a chain of ``gamma`` one-token drafts of ``loops`` loops in one compiled step
        (:meth:`~looped_kv.decoding.passes.Passes.drafts`) at ``context`` (the capacity): linear in gamma between one
        draft's pass (:meth:`seconds`) and the measured chains."""
        by_loops = self.drafts.get(mode, {})
        if loops not in by_loops:
            raise ValueError(f"{mode} chains of drafts of {loops} loops were not measured (measured: "
                             f"{sorted(by_loops) or 'none'}); re-run looped-kv pass-cost with --draft-chains and "
                             f"--loops {loops}")
        nodes = {1: self.seconds(1, loops, context, mode)}
        nodes |= {g: _along(by_context, context) for g, by_context in by_loops[loops].items()}
        return float(_interpolate(nodes, gamma, f"{mode} chain of drafts",
                                  "re-run looped-kv pass-cost with --draft-chains covering it"))

    def wave_seconds(self, widths: Sequence[int], loops: int, context: int, mode: str = "compiled") -> float:
        """Predicted seconds of a compiled DAS-Wave wave in one step (:meth:`~looped_kv.decoding.passes.Passes.wave`)
        whose rounds refine ``widths`` positions with ``loops`` loops each, at ``context`` (the capacity): the
        measured wave of those rounds, linear in the capacity between the measured ones."""
        measured = self.waves.get(mode, {}).get(loops, {})
        if tuple(widths) not in measured:
            raise ValueError(f"no {mode} wave of {len(widths)} rounds of {loops} loops over {list(widths)} positions "
                             f"was measured (measured: {[(loops, list(w)) for w in measured] or 'none'}); re-run "
                             f"looped-kv pass-cost with --waves {len(widths)}")
        return _along(measured[tuple(widths)], context)

    def price(self, kind: str, tokens: int, loops: int, context: int, mode: str = "eager",
              widths: Sequence[int] = ()) -> float:
        """Predicted seconds of one pass by the kind of cell that prices it (:func:`priced_by`): "pass"
        (:meth:`seconds`), "verify" (:meth:`verify_seconds`), "drafts" (:meth:`drafts_seconds`), "wave"
        (:meth:`wave_seconds` of its rounds' ``widths``) or "prefill" (:meth:`prefill_seconds`)."""
        if kind == "pass":
            return self.seconds(tokens, loops, context, mode)
        if kind == "verify":
            return self.verify_seconds(tokens, context, mode)
        if kind == "drafts":
            return self.drafts_seconds(tokens, loops, context, mode)
        if kind == "wave":
            return self.wave_seconds(widths, loops, context, mode)
        if kind == "prefill":
            return self.prefill_seconds(tokens, mode)
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def record_seconds(self, record: PassRecord) -> float:
        """Predicted seconds of one logged pass: the prefill at its prompt's length, a verification in place
        (:attr:`~looped_kv.decoding.passes.PassRecord.in_place`) at its width's in-place price, a compiled chain of
        drafts and a compiled wave at their own, any other at its width's pass price."""
        return self.price(priced_by(record), record.tokens, record.loops, record.context,
                          "compiled" if record.compiled else "eager", record.widths)

    def prefill_seconds(self, tokens: int, mode: str = "eager") -> float:
        """Predicted seconds of the prefill of a ``tokens``-token prompt (interpolated between measured lengths)."""
        return float(_interpolate(self._mode(mode, self.prefill), tokens, f"{mode} prefill of tokens",
                                  "re-run looped-kv pass-cost with --prompt-lengths covering it, or give the "
                                  "measured prefill"))

    def residuals(self) -> pd.DataFrame:
        """One row per pass and verification cell: its measured time (the statistic over rounds), the model's, model /
        measured - 1, and which cells it is among: "fitted" or "held out" (by width), passes or "in place"
        (verifications)."""
        rows = []
        for t in self.timings:
            if t.kind in ("prefill", "drafts", "wave"):  # looked up, not fitted
                continue
            measured = STATISTICS[self.statistic](t.seconds)
            cells = "held out" if t.tokens in self.held_out else "fitted"
            if t.kind == "verify":
                model, cells = self.verify_seconds(t.tokens, t.context, t.mode), f"in place, {cells}"
            else:
                model = self.seconds(t.tokens, t.loops, t.context, t.mode)
            rows.append({"mode": t.mode, "tokens": t.tokens, "loops": t.loops, "context": t.context,
                         "measured_s": measured, "model_s": model, "relative": model / measured - 1, "cells": cells})
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """Per mode, the residuals of the fitted and the held-out widths' cells, passes and verifications in place:
        cells, largest |model / measured - 1| and its root mean square."""
        return self.residuals().groupby(["mode", "cells"])["relative"].agg(
            cells="size", max_abs=lambda x: float(np.abs(x).max()), rms=lambda x: float(np.sqrt(np.mean(x ** 2))))

    def to_dict(self) -> dict:
        """A JSON-ready dict: ``meta``'s keys, then the model."""
        return {**self.meta, "statistic": self.statistic, "held_out_tokens": list(self.held_out),
                "terms": list(TERMS),
                "coefficients": {m: {str(g): {str(L): list(c) for L, c in by_context.items()}
                                     for g, by_context in by.items()} for m, by in self.coefficients.items()},
                "verifications": {m: {str(g): {str(L): s for L, s in by_context.items()}
                                      for g, by_context in by.items()} for m, by in self.verifications.items()},
                "prefill": {m: {str(n): s for n, s in by.items()} for m, by in self.prefill.items()},
                "drafts": {m: {str(r): {str(g): {str(L): s for L, s in by_context.items()}
                                        for g, by_context in by_gamma.items()} for r, by_gamma in by.items()}
                           for m, by in self.drafts.items()},
                "waves": {m: {str(r): {_key(w): {str(L): s for L, s in by_context.items()}
                                       for w, by_context in by_widths.items()} for r, by_widths in by.items()}
                          for m, by in self.waves.items()},
                "timings": [{"mode": t.mode, "kind": t.kind, "tokens": t.tokens, "loops": t.loops,
                             "context": t.context, "seconds": list(t.seconds), **({"widths": list(t.widths)}
                                                                                  if t.widths else {})}
                            for t in self.timings]}

    @classmethod
    def from_dict(cls, record: Mapping) -> PassCost:
        """The model of :meth:`to_dict`'s dict (the other keys are its ``meta``)."""
        own = ("statistic", "held_out_tokens", "terms", "coefficients", "verifications", "prefill", "timings")
        optional = ("drafts", "waves")  # a record timed before chains of drafts (waves) were one step has none
        missing = [k for k in own if k not in record]
        if missing:
            raise ValueError(f"not a pass-cost record of this version: it lacks {missing} (re-run looped-kv pass-cost)")
        if tuple(record["terms"]) != TERMS:
            raise ValueError(f"not a pass-cost record of this version: its terms must be {TERMS} per width and "
                             f"context, got {record['terms']} (re-run looped-kv pass-cost)")
        return cls(statistic=record["statistic"],
                   coefficients={m: {int(g): {int(L): tuple(c) for L, c in by_context.items()}
                                     for g, by_context in by.items()} for m, by in record["coefficients"].items()},
                   verifications={m: {int(g): {int(L): float(s) for L, s in by_context.items()}
                                      for g, by_context in by.items()} for m, by in record["verifications"].items()},
                   prefill={m: {int(n): float(s) for n, s in by.items()} for m, by in record["prefill"].items()},
                   timings=tuple(Timing(t["mode"], t["kind"], t["tokens"], t["loops"], t["context"],
                                        tuple(t["seconds"]), tuple(t.get("widths", ()))) for t in record["timings"]),
                   held_out=tuple(record["held_out_tokens"]),
                   meta={k: v for k, v in record.items() if k not in own + optional},
                   drafts={m: {int(r): {int(g): {int(L): float(s) for L, s in by_context.items()}
                                        for g, by_context in by_gamma.items()} for r, by_gamma in by.items()}
                           for m, by in record.get("drafts", {}).items()},
                   waves={m: {int(r): {tuple(int(w) for w in key.split(",")): {int(L): float(s) for L, s in
                                                                                 by_context.items()}
                                       for key, by_context in by_widths.items()} for r, by_widths in by.items()}
                          for m, by in record.get("waves", {}).items()})

    def write(self, path: str | Path) -> None:
        """Save as JSON (the caller checks ``path`` first: :func:`looped_kv.outputs.check_file`)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _key(widths: Sequence[int]) -> str:
    """A wave's rounds' widths as a record's key: "2,3,4,6"."""
    return ",".join(str(w) for w in widths)


def read(path: str | Path) -> PassCost:
    """A pass-cost model saved by :meth:`PassCost.write`."""
    return PassCost.from_dict(json.loads(Path(path).read_text()))


def fit_pass_cost(timings: Iterable[Timing], statistic: str = "median", held_out: Iterable[int] = (),
                  meta: Mapping | None = None) -> PassCost:
    """Fit :data:`TERMS` by least squares per mode, width and context on the ``statistic`` ("median" or "min") of each
    pass cell's rounds, widths in ``held_out`` left out (their cells are predicted by interpolation, :meth:`PassCost.
    residuals`); a verification's time per mode, width and context is its cell's statistic, held-out widths left out
    alike; the prefill's time per prompt length is its cells' statistic, and a compiled chain of drafts' time per
    loops, chain length and context its cell's, as is a compiled wave's per loops, rounds' widths and context."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {tuple(STATISTICS)}, got {statistic!r}")
    timings, held_out = tuple(timings), tuple(sorted(set(held_out)))
    for t in timings:
        _check_timing(t)
    stat = STATISTICS[statistic]
    coefficients: dict[str, dict[int, dict[int, tuple[float, float]]]] = {}
    verifications: dict[str, dict[int, dict[int, float]]] = {}
    prefill: dict[str, dict[int, float]] = {}
    drafts: dict[str, dict[int, dict[int, dict[int, float]]]] = {}
    waves: dict[str, dict[int, dict[tuple[int, ...], dict[int, float]]]] = {}
    for mode in MODES:
        cells = [t for t in timings if t.mode == mode and t.kind == "pass" and t.tokens not in held_out]
        for g, L in sorted({(t.tokens, t.context) for t in cells}):
            at = [t for t in cells if (t.tokens, t.context) == (g, L)]
            loops = np.array([t.loops for t in at], dtype=float)
            if len(set(loops)) < len(TERMS):
                raise ValueError(f"{mode} passes of {g} tokens at context {L}: a fit of {TERMS} needs cells at 2 or "
                                 f"more loops, got {sorted({t.loops for t in at})}")
            x = np.column_stack([np.ones_like(loops), loops])
            solution, *_ = np.linalg.lstsq(x, np.array([stat(t.seconds) for t in at]), rcond=None)
            coefficients.setdefault(mode, {}).setdefault(g, {})[L] = (float(solution[0]), float(solution[1]))
        cells = [t for t in timings if t.mode == mode and t.kind == "verify" and t.tokens not in held_out]
        for g, L in sorted({(t.tokens, t.context) for t in cells}):
            seconds = [s for t in cells if (t.tokens, t.context) == (g, L) for s in t.seconds]
            verifications.setdefault(mode, {}).setdefault(g, {})[L] = stat(seconds)
        for t in timings:
            if t.mode == mode and t.kind == "prefill":
                prefill.setdefault(mode, {})[t.tokens] = stat(t.seconds)
            elif t.mode == mode and t.kind == "drafts":
                drafts.setdefault(mode, {}).setdefault(t.loops, {}).setdefault(t.tokens, {})[t.context] = stat(
                    t.seconds)
            elif t.mode == mode and t.kind == "wave":
                waves.setdefault(mode, {}).setdefault(t.loops, {}).setdefault(t.widths, {})[t.context] = stat(
                    t.seconds)
    if not coefficients:
        raise ValueError("timings must hold pass cells of at least one width that is not held out")
    return PassCost(statistic, coefficients, verifications, prefill, timings, held_out, dict(meta or {}), drafts,
                    waves)


# -- predictions from what decoding ran -------------------------------------------------------------------------------


def predict_by_kind(cost: PassCost, passes: Sequence[PassRecord],
                    prefill_seconds: float | None = None) -> dict[str, float]:
    """Predicted seconds of a decoding run's passes (its :class:`~looped_kv.decoding.loop.PassLog`), summed per kind
    (prefill, draft, drafts, refine, verify); ``prefill_seconds`` (e.g. the bench's measured prefill) replaces the
    model's prefill."""
    totals: dict[str, float] = {}
    for i, p in enumerate(passes):
        if p.rows != BATCH:
            raise ValueError(f"pass {i} ({p.kind}) ran {p.rows} rows; the pass-cost model is timed at batch {BATCH}")
        seconds = prefill_seconds if p.kind == "prefill" and prefill_seconds is not None else cost.record_seconds(p)
        totals[p.kind] = totals.get(p.kind, 0.0) + seconds
    return totals


def predict_seconds(cost: PassCost, passes: Sequence[PassRecord], prefill_seconds: float | None = None) -> float:
    """A decoder's predicted time: the pass-cost model's time of every pass it ran plus its prefill
    (:func:`predict_by_kind`)."""
    return sum(predict_by_kind(cost, passes, prefill_seconds).values())


def priced_by(record: PassRecord) -> str:
    """The kind of grid cell whose time prices a logged pass (:meth:`PassCost.record_seconds`): "prefill" for the
    prefill, "verify" for a verification in place, "drafts" for a compiled chain of drafts, "wave" for a compiled
    wave, else "pass"."""
    if record.kind in ("prefill", "drafts", "wave"):
        return record.kind
    return "verify" if record.in_place else "pass"


#: The machine's drift since the grid: (kind of cell, its tokens) -> time now / recorded on the cells of that kind
#: and width re-timed. Kinds: "pass", "verify", "prefill" (tokens: the prompt's) and, compiled, "drafts" and "wave"
#: (tokens: its rounds).
Drift = Mapping[tuple[str, int], float]


def drift_at(drift: Drift, kind: str, tokens: int) -> float:
    """The drift of a ``kind`` cell ``tokens`` wide: linear in tokens between the widths re-timed, the nearest one's
    beyond them. Wide and narrow cells need not drift alike: a one-token step is bound by the operators' dispatch, a
    long prefill by their arithmetic (a check's ``drift_prefill_<tokens>`` columns show how far apart they drift)."""
    widths = sorted(w for k, w in drift if k == kind)
    if not widths:
        raise ValueError(f"drift has no {kind!r} cells; it has {sorted({k for k, _ in drift})}")
    return float(np.interp(tokens, widths, [drift[kind, w] for w in widths]))


def predict_at_drift(cost: PassCost, passes: Sequence[PassRecord], drift: Drift) -> float:
    """:func:`predict_seconds` with each pass priced at the speed the machine runs cells of its kind
    (:func:`priced_by`) and width now (:func:`drift_at`)."""
    return sum(cost.record_seconds(p) * drift_at(drift, priced_by(p), p.tokens) for p in passes)


def compare(runs: pd.DataFrame) -> pd.DataFrame:
    """Predicted against measured seconds per method, from one row per run (``method``, ``predicted_s``,
    ``measured_s``): their sums over the runs, ``ratio`` = predicted / measured of the sums, and the per-run ratios'
    median, min and max."""
    missing = [c for c in ("method", "predicted_s", "measured_s") if c not in runs]
    if missing:
        raise ValueError(f"runs must have columns method, predicted_s and measured_s; missing {missing}")
    if not (runs["measured_s"] > 0).all():
        raise ValueError("measured_s must be > 0 in every run")
    per_run = runs.assign(run_ratio=runs["predicted_s"] / runs["measured_s"])
    table = per_run.groupby("method", sort=False).agg(runs=("run_ratio", "size"), predicted_s=("predicted_s", "sum"),
                                                      measured_s=("measured_s", "sum"),
                                                      median=("run_ratio", "median"), min=("run_ratio", "min"),
                                                      max=("run_ratio", "max"))
    table.insert(3, "ratio", table["predicted_s"] / table["measured_s"])
    return table


# -- the speed-up a drafter's acceptance implies (Eq. 8 with measured pass times) ------------------------------------


#: One pass of a verification cycle: the kind of cell that prices it (:func:`priced_by`), its tokens and its loops
#: (a compiled wave: its rounds and loops per round, then its rounds' widths).
Planned = tuple[str, int, int] | tuple[str, int, int, tuple[int, ...]]


def cycle(config: Decoding, num_loops: int, compiled: bool = False) -> list[Planned]:
    """The passes, as (kind, tokens, loops), of one verification cycle of ``config``'s method at R = ``num_loops``,
    at their widest: greedy decoding one R-loop step ("verify", 1, R); self-spec and Mature-Spec gamma one-token
    d-loop drafts (eager: gamma passes; compiled: one chain, ("drafts", gamma, d)) and a verification of gamma + 1;
    prompt lookup a verification of gamma + 1 (its drafts cost no pass); DAS-Wave J rounds of k loops over
    min(max_width, W_init + j) positions (compiled: their width bucket, :func:`~looped_kv.decoding.compiled.
    refined_width`; with ``fuse_rounds``, one wave ("wave", J, k, those widths)) and a verification of
    w = min(max_width, W_init + J - 1) (DAS Eq. 5)."""
    if isinstance(config, SelfSpec | MatureSpec):
        d, gamma = config.draft_depth(num_loops), config.gamma
        drafts = [("drafts", gamma, d)] if compiled else [("pass", 1, d)] * gamma
        return [*drafts, ("verify", gamma + 1, num_loops)]
    if isinstance(config, PromptLookup):
        return [("verify", config.gamma + 1, num_loops)]
    if isinstance(config, DasWave):
        rounds = config.wave_rounds(num_loops)
        widths = [width for _, width, _ in rounds_of(config.max_width, rounds, config.initial_width, config.updates,
                                                     config.carry)]
        verification = ("verify", proposal_width(config.max_width, rounds, config.initial_width), num_loops)
        if compiled:
            widths = [refined_width(w, config.max_width) for w in widths]
            if config.fuse_rounds:
                return [("wave", rounds, config.updates, tuple(widths)), verification]
        return [*(("pass", w, config.updates) for w in widths), verification]
    return [("verify", 1, num_loops)]


def _check_cycle(tau: float, passes: Sequence[Planned], num_loops: int) -> None:
    if not (np.isfinite(tau) and tau >= 1):
        raise ValueError(f"tau must be >= 1 (tokens committed per verification), got {tau}")
    if not passes or passes[-1][0] != "verify" or passes[-1][2] != num_loops:
        raise ValueError(f"passes must end with the verification, through all {num_loops} loops, got {passes}")


def speedup_bound(cost: PassCost, tau: float, passes: Sequence[Planned], num_loops: int, context: int,
                  mode: str = "eager") -> float:
    """RIPE Eq. (8) with measured pass times: S = tau t_verify(1, L) / (the cycle's drafts' times + its
    verification's t_verify(w, L)) over one verification cycle's ``passes`` (:func:`cycle`: the drafts, then the
    verification of w tokens through ``num_loops`` loops, in place as under the full cache), each priced by its kind
    (:meth:`PassCost.price`), for ``tau`` tokens committed per verification, at ``context`` (compiled: the capacity).
    The decode phase's speed-up over greedy decoding that the pass costs allow, before per-verification overhead and
    the prefill."""
    _check_cycle(tau, passes, num_loops)
    spent = sum(cost.price(kind, g, r, context, mode, *widths) for kind, g, r, *widths in passes)
    return tau * cost.verify_seconds(1, context, mode) / spent


def layer_pass_bound(model: LayerCounts, tau: float, passes: Sequence[Planned], num_loops: int) -> float:
    """RIPE Eq. (8) at eta = 1 over one cycle's ``passes``, each priced by its layer passes c(r) = n_pre + r n_core +
    n_coda whatever its tokens (a chain of gamma drafts: gamma c(d); a wave of J rounds: J c(k); the papers'
    premise, true on a GPU at batch 1): S = tau c(R) / sum of c(r). For self-spec and Mature-Spec it is
    :func:`looped_kv.analysis.perf.speedup` at eta = 1."""
    _check_cycle(tau, passes, num_loops)
    spent = sum((g if kind in ("drafts", "wave") else 1) * float(layer_passes(model, r)) for kind, g, r, *_ in passes)
    return tau * float(layer_passes(model, num_loops)) / spent


def bounds(cost: PassCost, configs: Mapping[str, Decoding], tokens: Mapping[str, Mapping[str, float]],
           model: LayerCounts, num_loops: int, context: int, mode: str = "eager") -> pd.DataFrame:
    """How fast each drafter of ``configs`` could decode at ``context`` (compiled: the capacity): per row (its key), the
    decode-phase speed-up over greedy decoding its passes allow (:func:`speedup_bound` over its :func:`cycle`) at the
    tokens per verification it committed on each workload of ``tokens`` (``tokens[workload][key]``), then with every
    proposal accepted (each verification of g tokens committing all g: gamma + 1, or DAS-Wave's w), and Eq. (8)'s bound
    with every proposal accepted (:func:`layer_pass_bound`: passes priced by their layer passes)."""
    for workload, by_method in tokens.items():
        missing = [key for key in configs if key not in by_method]
        if missing:
            raise ValueError(f"tokens[{workload!r}] has no tokens per verification of {missing}; it has "
                             f"{sorted(by_method)}")
    table = {}
    for key, config in configs.items():
        passes = cycle(config, num_loops, compiled=mode == "compiled")
        most = passes[-1][1]  # a verification of g tokens commits at most g
        row = {workload: speedup_bound(cost, by_method[key], passes, num_loops, context, mode)
               for workload, by_method in tokens.items()}
        row["all accepted"] = speedup_bound(cost, most, passes, num_loops, context, mode)
        row["Eq. (8), all accepted"] = layer_pass_bound(model, most, passes, num_loops)
        table[key] = row
    return pd.DataFrame.from_dict(table, orient="index")


def ceilings(cost: PassCost, configs: Mapping[str, Decoding], num_loops: int, mode: str = "eager") -> pd.DataFrame:
    """:func:`bounds`' "all accepted" column at every context the model measured in ``mode`` (compiled: each
    capacity): rows are ``configs``' keys, columns the contexts."""
    table = {}
    for key, config in configs.items():
        passes = cycle(config, num_loops, compiled=mode == "compiled")
        table[key] = {L: speedup_bound(cost, passes[-1][1], passes, num_loops, L, mode) for L in cost.contexts(mode)}
    return pd.DataFrame.from_dict(table, orient="index").rename_axis(columns="context")


def fused_waves(cost: PassCost, mode: str = "compiled") -> pd.DataFrame:
    """Each measured wave in one step (:meth:`PassCost.wave_seconds`) against its rounds priced as passes of their
    own (:meth:`PassCost.seconds`, as a compiled decode without ``fuse_rounds`` runs them), both from the same grid:
    one row per loops per round, rounds and context, with both times in seconds and their ratio."""
    rows = [{"loops": k, "rounds": len(widths), "context": L, "one step (s)": t,
             "rounds apart (s)": sum(cost.seconds(w, k, L, mode) for w in widths)}
            for k, by_widths in cost.waves.get(mode, {}).items() for widths, by_context in by_widths.items()
            for L, t in by_context.items()]
    table = pd.DataFrame(rows, columns=["loops", "rounds", "context", "one step (s)", "rounds apart (s)"])
    return table.assign(**{"rounds apart / one step": table["rounds apart (s)"] / table["one step (s)"]})


def relative_cost(cost: PassCost, loops: Sequence[int], context: int, mode: str = "eager") -> pd.DataFrame:
    """The cost of one pass against its new tokens: t(g, r, L) / t(1, r, L) at each measured width g (rows) and each
    of ``loops`` (columns), at ``context`` L: how much more a pass of g tokens costs than a one-token pass of the same
    depth (RIPE/DAS Eq. 8 take it to be 1)."""
    widths = sorted(set(cost._mode(mode, cost.coefficients)) | set(cost.held_out))
    return pd.DataFrame({r: [cost.seconds(g, r, context, mode) / cost.seconds(1, r, context, mode) for g in widths]
                         for r in loops}, index=pd.Index(widths, name="tokens per pass"))


def against_greedy(runs: pd.DataFrame) -> pd.DataFrame:
    """Per method of a check's runs (:func:`looped_kv.experiments.pass_cost.predictions`: ``prompt``, ``method``,
    ``new_tokens``, ``measured_s``, ``predicted_s``, greedy decoding as ``ar``): measured / predicted time (of the
    sums over prompts, and the per-run range), the speed-up over paired greedy decoding the pass-cost model predicts
    (its bound: the speed the decoder would have if its time were only its passes and prefill) and the measured one
    (DAS Eq. 8: means over prompts of the per-prompt throughput ratio), and measured / predicted speed-up; with a
    ``predicted_at_drift_s`` column (the passes priced at the speed their cells ran beside the run:
    :func:`predict_at_drift`), measured / predicted at drift too; with ``in_passes_s`` (the time inside each run's
    passes), in passes / predicted (how well the grid prices the passes decoding ran) and the share of the measured
    time outside the passes (the decode loop's own work); with ``first_pass_s`` and ``later_passes_s`` (the first
    pass after the prefill and the passes after it, of each method's first run) and their prices, each measured /
    its price: the first pass meets the caches the prefill left, where the grid times a pass after the same pass."""
    missing = [c for c in ("prompt", "method", "new_tokens", "measured_s", "predicted_s") if c not in runs]
    if missing:
        raise ValueError(f"runs must have columns prompt, method, new_tokens, measured_s and predicted_s; missing "
                         f"{missing}")
    greedy = runs[runs["method"] == "ar"].set_index("prompt")
    if greedy.empty:
        raise ValueError("runs must hold greedy decoding's (method 'ar'), the speed-ups' reference")
    rows = {}
    for method, r in runs.groupby("method", sort=False):
        g = greedy.loc[r["prompt"]]
        per_run = r["measured_s"].to_numpy() / r["predicted_s"].to_numpy()
        tokens = r["new_tokens"].to_numpy() / g["new_tokens"].to_numpy()
        predicted = float(np.mean(tokens * g["predicted_s"].to_numpy() / r["predicted_s"].to_numpy()))
        measured = float(np.mean(tokens * g["measured_s"].to_numpy() / r["measured_s"].to_numpy()))
        rows[method] = {"runs": len(r), "measured / predicted": r["measured_s"].sum() / r["predicted_s"].sum(),
                        "lowest": float(per_run.min()), "highest": float(per_run.max()),
                        "predicted speed-up": predicted, "measured speed-up": measured,
                        "measured / predicted speed-up": measured / predicted}
        if "predicted_at_drift_s" in r:
            rows[method]["measured / predicted at drift"] = r["measured_s"].sum() / r["predicted_at_drift_s"].sum()
        if "in_passes_s" in r:
            rows[method]["in passes / predicted"] = r["in_passes_s"].sum() / r["predicted_s"].sum()
            rows[method]["outside passes"] = 1 - r["in_passes_s"].sum() / r["measured_s"].sum()
        for which in ("first_pass", "later_passes"):
            if f"{which}_s" in r:
                label = which.replace("_", " ")
                rows[method][f"{label} / price"] = r[f"{which}_s"].sum() / r[f"{which}_price_s"].sum()
    return pd.DataFrame(rows).T.astype({"runs": int})
