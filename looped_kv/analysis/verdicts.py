"""One verdict for every comparison in the book: a paper's claim against paired measurements.

A claim (:class:`Claim`) says which way a paired statistic points (``expects``: "greater", "less", or
"none" for a paper that finds no effect), on which scale (a mean paired difference, a geometric mean
ratio, or a ratio of means), and how large an effect must be to count (``minimum``, taken from the paper
where the paper gives one, else the book's :data:`BOOK_MINIMUM` for that kind of quantity).
:func:`verdict` takes the per-unit (per-prompt, per-text) measurements of the two arms and applies one
rule, in this order, to every comparison of the book, timing included:

1. **Enough units** (:func:`enough_units`): at least :data:`MIN_UNITS` paired units: 32 prompts or texts;
   16 timed prompts, each timed in interleaved repeats; 5 cells of a model check. Fewer give
   ``inconclusive``, "too few units (n)", whatever the data say.
2. **Can discriminate**: the blocking checks (:func:`above_floor`, :func:`varies`) pass, else
   ``inconclusive``, "cannot discriminate on this model".
3. **Identical**: arms equal on every unit are ``identical``.
4. **The interval**: a BCa (bias-corrected and accelerated) bootstrap interval over units, resampling pairs
   (Efron 1987), seeded, so a verdict is the same on every run. Percentile intervals are too narrow at the
   sample sizes of this book; BCa corrects their bias and skew to second order.
5. **The label** (:func:`interval_label`), from the interval of the effect in the paper's direction and the
   smallest effect m:

   * ``agrees``: the whole interval lies beyond m in the paper's direction;
   * ``disagrees``: the whole interval lies beyond m against it (beyond -m; on a ratio scale below 1/m);
   * ``no effect of that size``: the interval lies inside the no-effect band (-m, m);
   * ``inconclusive``: anything else: an interval that contains no difference, or crosses an edge of the band on
     either side. An interval wholly against the paper's direction that reaches into the band is inconclusive, not
     ``disagrees``: with m = 0.05, -0.029 [-0.047, -0.011] is no effect of that size and -0.032 [-0.054, -0.010]
     is inconclusive.

   "Agrees" and "disagrees" are held to the same standard, so more uncertainty never gives a stronger label: an
   interval that contains another has the other's label or ``inconclusive``. For a claim of no effect
   (``expects="none"``), ``agrees`` is an interval inside the band and ``disagrees`` one wholly beyond it on
   either side, the same standard.
6. **Ceilings** (:func:`below_ceiling`): an effect established beyond the band is not voided because an arm
   is near its ceiling; the reason notes the ceiling. An interval inside the band (no effect, or a claim of no
   effect that agrees) next to an arm near its ceiling, or with less room to the ceiling than m, cannot tell
   "no effect" from saturation, and is ``inconclusive``.

On a ratio scale m is a factor > 1: the band is (1/m, m). Every verdict states its n, its smallest effect and
its interval method. :func:`model_check` is the rule for a model's prediction against held-out cells; its
"interval" is the range of the cells, not an uncertainty interval, since the claim is about every cell: one cell
measured beyond the band is a counterexample (it ``disagrees``), whatever the others show.

A verdict reads as one short line (:attr:`Verdict.short`), "agrees: +0.42 [0.27, 0.56], n = 48": the label, the
estimate and its interval, and n. A difference is signed; a ratio is written "1.19x [1.15, 1.23]". The three numbers
share one number of decimals, the precision of the interval (:func:`precision`). :func:`claim_summary` states each
claim, its source and its smallest effect once, then one short line per workload; the tables
(:func:`verdict_table`, :func:`interval_table`) put the verdict in their first column.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy.special import ndtr, ndtri

AGREES, DISAGREES, INCONCLUSIVE = "agrees", "disagrees", "inconclusive"
NO_EFFECT, IDENTICAL = "no effect of that size", "identical"
LABELS = (AGREES, DISAGREES, NO_EFFECT, IDENTICAL, INCONCLUSIVE)
#: Fewest units behind a verdict, by kind: paired prompts or texts; prompts timed alone, each in interleaved repeats
#: (timing noise is larger and its units fewer); cells of a model check (every cell must fit, an exact sign test
#: that passes at 5% from 5 cells on: 0.5^5 = 0.031).
MIN_UNITS: dict[str, int] = {"paired": 32, "timing": 16, "cells": 5}
#: Fewest interleaved repeats of each timed prompt.
MIN_REPEATS = 2
#: A bounded statistic (tau <= gamma + 1, agreement <= 1) near its ceiling: within this fraction of its range.
CEILING_MARGIN = 0.05
#: Fewest measurements that must lie above the float floor for a comparison of them to mean anything.
MIN_ABOVE_FLOOR = 0.5
#: The book's smallest effects where a paper prints none, by the kind of quantity. Rates and shares (agreement,
#: accuracy, cosine): five points. Tokens per verification (tau, A, G, E_cKV): half a token, RIPE Table 6's
#: pre-registered threshold for tau (:data:`looped_kv.papers.RIPE_TABLE_6_THRESHOLDS`). Log units (residuals):
#: 0.05. Ratios of speeds and distances: 10%, the smallest ratio RIPE Table 6 pre-registers. Ratios of KLs: 2,
#: the pre-registered threshold of RIPE Sec. 5.2.
BOOK_MINIMUM: dict[str, float] = {"share": 0.05, "tokens": 0.5, "log": 0.05, "ratio": 1.1, "KL ratio": 2.0}
BCA = "BCa bootstrap"
SCALES = ("difference", "log-ratio", "ratio of means")
EXPECTS = ("greater", "less", "none")


@dataclass(frozen=True)
class Claim:
    """A paper's claim about a paired statistic: its direction, its scale, where it is printed, and the smallest
    effect that counts with where that comes from.

    ``scale="difference"`` compares mean(a - b); ``"log-ratio"`` the geometric mean of a / b (reported as the
    ratio); ``"ratio of means"`` mean(a) / mean(b) (RIPE Sec. 5.1's statistic). With one arm (b omitted) the
    statistic is a against ``null``. ``minimum`` is a difference > 0, or on a ratio scale a factor > 1.
    """

    statement: str
    source: str
    expects: Literal["greater", "less", "none"] = "greater"
    scale: Literal["difference", "log-ratio", "ratio of means"] = "difference"
    minimum: float = field(kw_only=True)
    minimum_source: str = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.expects not in EXPECTS:
            raise ValueError(f"expects must be one of {EXPECTS}, got {self.expects!r}")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")
        low = 1.0 if self.ratio else 0.0
        if not (math.isfinite(self.minimum) and self.minimum > low):
            raise ValueError(f"minimum must be a finite {'factor > 1' if self.ratio else 'difference > 0'} on the "
                             f"{self.scale} scale, got {self.minimum}")
        if not self.minimum_source:
            raise ValueError("minimum_source must say where the smallest effect comes from (a paper's table or "
                             "equation, or the book's convention)")

    @property
    def ratio(self) -> bool:
        return self.scale != "difference"

    @property
    def band(self) -> float:
        """Half-width of the no-effect band on the estimation scale (log units for ratios)."""
        return math.log(self.minimum) if self.ratio else self.minimum

    @property
    def minimum_text(self) -> str:
        if not self.ratio:
            return f"{self.minimum:g}"
        return f"a factor of {self.minimum:g}" + (f" ({100 * (self.minimum - 1):.3g}%)" if self.minimum < 1.5 else "")


@dataclass(frozen=True)
class Check:
    """One discrimination check: its name, whether it passed, and what was measured.

    ``kind``: "units" (enough units), "blocks" (a failure makes any verdict inconclusive) or "ceiling" (a bounded
    arm near its ceiling; ``room`` is how far its mean may still rise, on the statistic's scale).
    """

    name: str
    passed: bool
    detail: str
    kind: Literal["units", "blocks", "ceiling"] = "blocks"
    room: float | None = None


@dataclass(frozen=True)
class Discrimination:
    """Whether an experiment can tell outcomes apart; the failed checks say why not."""

    checks: tuple[Check, ...] = ()

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def reason(self) -> str:
        return "; ".join(c.detail for c in self.checks if not c.passed)

    def failed(self, *kinds: str) -> list[Check]:
        return [c for c in self.checks if not c.passed and c.kind in kinds]

    def __add__(self, other: Discrimination) -> Discrimination:
        return Discrimination(self.checks + other.checks)


@dataclass(frozen=True)
class Verdict:
    """A claim, the paired estimate with its interval, n, the label and why."""

    claim: Claim
    estimate: float
    low: float
    high: float
    n: int
    label: str
    reason: str
    level: float = 0.95
    discrimination: Discrimination = field(default_factory=Discrimination)
    units: str = "prompts"
    method: str = BCA
    parts: tuple[tuple[str, Verdict], ...] = ()  # per-part verdicts of a combined verdict (bins of positions)
    values: tuple[float, ...] = field(default=(), repr=False, compare=False)  # the per-unit data, for repeats

    @property
    def null(self) -> float:
        return 1.0 if self.claim.ratio else 0.0

    @property
    def blocked(self) -> bool:
        """The experiment could not discriminate (too few units, a failed check or a ceiling)."""
        return self.label == INCONCLUSIVE and self.reason.startswith(("too few units", "cannot discriminate"))

    @property
    def estimate_text(self) -> str:
        """The estimate and its interval to their precision (:func:`precision`): a signed difference, "+0.42 [0.27,
        0.56]", or a ratio, "1.19x [1.15, 1.23]"."""
        if math.isnan(self.estimate):
            return "undefined"
        decimals = precision(self.low, self.high)
        estimate, low, high = _numbers((self.estimate, self.low, self.high), decimals)
        if self.claim.ratio:
            return f"{estimate}x [{low}, {high}]"
        sign = "+" if float(estimate.replace(",", "")) > 0 else ""
        return f"{sign}{estimate} [{low}, {high}]"

    @property
    def short(self) -> str:
        """The verdict in one short line: "agrees: +0.42 [0.27, 0.56], n = 48" (the claim is said elsewhere)."""
        return f"{self.label}: {self.estimate_text}, n = {self.n}"

    @property
    def interval_kind(self) -> str:
        """What the interval is, without n: "95% BCa bootstrap intervals over prompts"."""
        if self.method == BCA:
            return f"{self.level:.0%} {BCA} intervals over {self.units}"
        return f"{self.method} over {self.units}"

    def interval(self, digits: int = 3) -> str:
        if math.isnan(self.estimate):
            return "undefined"
        fmt = f"{{:.{digits}g}}"
        return f"{fmt.format(self.estimate)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"

    @property
    def measure(self) -> str:
        """What the estimate is: a ratio (ratio scales) or a difference."""
        return "ratio" if self.claim.ratio else "difference"

    @property
    def how(self) -> str:
        """The interval and its n, in words."""
        if self.method == BCA:
            return f"{self.level:.0%} {BCA} interval over {self.n} {self.units}"
        return f"{self.method} over {self.n} {self.units}"

    def __str__(self) -> str:
        return (f"{self.label} ({self.claim.source}: {self.claim.statement}; smallest effect {self.claim.minimum_text},"
                f" {self.claim.minimum_source}): {self.measure} {self.interval()}, {self.how}; {self.reason}")

    def sentence(self, digits: int = 3) -> str:
        """The verdict as a sentence for the chapter's prose (MyST markdown)."""
        return (f"**{self.label}** ({self.claim.source}: {self.claim.statement}; smallest effect that counts: "
                f"{self.claim.minimum_text}, {self.claim.minimum_source}): {self.measure} {self.interval(digits)} "
                f"({self.how}); {self.reason}.")

    def row(self) -> dict[str, object]:
        """A table row, the verdict first: the label, the estimate and interval, n, the smallest effect, the claim, its
        source and why."""
        return {"verdict": self.label, "estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n,
                "smallest effect": self.claim.minimum_text, "claim": self.claim.statement, "source": self.claim.source,
                "why": self.reason}


#: Most decimals written in fixed point; an interval that needs more is written in significant digits (1.2e-07).
MAX_DECIMALS = 4


def precision(low: float, high: float) -> int | None:
    """Decimals that write an interval [low, high] to its precision: its half-width to two significant digits when
    they begin with 1 or 2, else to one (half-widths 0.145 and 0.04: 2 decimals; 0.018: 3), at least 0. None for an
    interval of no width or an unbounded one."""
    half = (high - low) / 2
    if not (math.isfinite(half) and half > 0):
        return None
    decimals = -math.floor(math.log10(half))
    return max(0, decimals + 1 if half * 10.0 ** decimals < 3 else decimals)


def _numbers(values: tuple[float, ...], decimals: int | None) -> list[str]:
    """``values`` to ``decimals`` decimals with thousands separators; past :data:`MAX_DECIMALS`, to the significant
    digits that keep that precision; with no precision (None), to 3 significant digits. Never "-0"."""
    finite = [abs(x) for x in values if math.isfinite(x) and x != 0]
    if decimals is None:
        spec = ".3g"
    elif decimals <= MAX_DECIMALS:
        spec = f",.{decimals}f"
    else:
        largest = math.floor(math.log10(max(finite))) if finite else 0
        spec = f"#.{max(1, decimals + largest + 1)}g"
    texts = [format(x, spec) if math.isfinite(x) else f"{x}" for x in values]
    return [t.removeprefix("-") if math.isfinite(x) and float(t.replace(",", "")) == 0 else t
            for t, x in zip(texts, values, strict=True)]


# -- inputs and statistics -------------------------------------------------------------------------------------


def _vector(name: str, values: ArrayLike) -> np.ndarray:
    x = np.asarray(values, dtype=float).reshape(-1)
    if x.size < 1:
        raise ValueError(f"{name} must hold at least 1 measurement, got none")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite, got {int((~np.isfinite(x)).sum())} non-finite values")
    return x


def _arms(claim: Claim, a: ArrayLike, b: ArrayLike | None, null: float | None) -> tuple[np.ndarray, np.ndarray]:
    x = _vector("a", a)
    if b is None:
        if null is None:
            raise ValueError("a one-arm verdict needs null (the value the claim compares a against)")
        y = np.full_like(x, float(null))
    else:
        if null is not None:
            raise ValueError("give either b (a paired arm) or null (a fixed value), not both")
        y = _vector("b", b)
        if y.size != x.size:
            raise ValueError(f"a and b must be paired (same length), got {x.size} and {y.size}")
    if claim.scale == "log-ratio" and ((x <= 0).any() or (y <= 0).any()):
        raise ValueError("a log-ratio claim needs positive measurements in a and b (or null)")
    if claim.scale == "ratio of means" and ((x < 0).any() or (y < 0).any()):
        raise ValueError("a ratio-of-means claim needs measurements >= 0 in a and b (or null)")
    return x, y


def _statistic(scale: str) -> Callable[[np.ndarray], np.ndarray]:
    """The statistic on (..., n, 2) paired data (a, b), on the estimation scale (log for ratios)."""
    if scale == "difference":
        return lambda d: (d[..., 0] - d[..., 1]).mean(axis=-1)
    if scale == "log-ratio":
        return lambda d: (np.log(d[..., 0]) - np.log(d[..., 1])).mean(axis=-1)

    def log_ratio_of_means(d: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(d[..., 0].mean(axis=-1)) - np.log(d[..., 1].mean(axis=-1))

    return log_ratio_of_means


def bca_interval(data: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], level: float = 0.95,
                 n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """The statistic of ``data`` (units along axis 0) and its BCa bootstrap interval (Efron 1987).

    ``statistic`` maps (..., n, k) to (...). Resampling draws units with replacement (pairs stay together); the
    bias correction z0 comes from the share of resamples below the estimate, the acceleration from the jackknife.
    Undefined resamples (NaN) are dropped; a jackknife that is not finite gives no acceleration (bias-corrected
    percentile interval). Seeded: the same data give the same interval.
    """
    n = data.shape[0]
    estimate = float(statistic(data))
    if n < 2:  # one unit: no resampling to do (and too few units for any verdict)
        return estimate, estimate, estimate
    rng = np.random.default_rng(seed)
    chunks = np.diff(np.r_[0:n_boot:1000, n_boot])
    boot = np.concatenate([statistic(data[rng.integers(0, n, (size, n))]) for size in chunks])
    boot = boot[~np.isnan(boot)]
    if boot.size == 0 or np.all(boot == boot[0]) or not np.isfinite(estimate):
        return estimate, estimate, estimate
    below = np.clip(np.mean(boot < estimate) + 0.5 * np.mean(boot == estimate), 1 / (boot.size + 1),
                    boot.size / (boot.size + 1))
    z0 = float(ndtri(below))
    jack = statistic(np.stack([np.delete(data, i, axis=0) for i in range(n)]))
    accel = 0.0
    if np.isfinite(jack).all():
        d = jack.mean() - jack
        denominator = 6 * float((d ** 2).sum()) ** 1.5
        accel = float((d ** 3).sum()) / denominator if denominator > 0 else 0.0
    z = ndtri(np.array([(1 - level) / 2, (1 + level) / 2]))
    quantiles = ndtr(z0 + (z0 + z) / (1 - accel * (z0 + z)))
    low, high = np.quantile(boot, np.clip(quantiles, 0, 1), method="inverted_cdf")  # no interpolation: inf-safe
    return estimate, float(low), float(high)


# -- the rule --------------------------------------------------------------------------------------------------


def enough_units(n: int, kind: str = "paired", what: str = "prompts", repeats: int | None = None) -> Check:
    """At least :data:`MIN_UNITS` [kind] units; a timing verdict also needs each prompt timed in
    :data:`MIN_REPEATS` or more interleaved repeats (``repeats``: the fewest any prompt had)."""
    if kind not in MIN_UNITS:
        raise ValueError(f"kind must be one of {tuple(MIN_UNITS)}, got {kind!r}")
    minimum = MIN_UNITS[kind]
    detail = f"too few units ({n} {what}; a {kind} verdict needs at least {minimum})"
    passed = n >= minimum
    if kind == "timing":
        timed = repeats is not None and repeats >= MIN_REPEATS
        passed = passed and timed
        times = "once" if (repeats or 1) == 1 else f"{repeats} times"
        detail = (f"too few units ({n} {what}; a timing verdict needs at least {minimum}, each timed in "
                  f"{MIN_REPEATS} or more interleaved repeats" + ("" if timed else f", and these were timed {times} "
                                                                 "each") + ")")
    return Check(f"at least {minimum} {what}", passed, detail, kind="units")


def below_ceiling(values: ArrayLike, ceiling: float, name: str, floor: float = 0.0) -> Check:
    """The mean of a bounded statistic stays ``CEILING_MARGIN`` of its range [floor, ceiling] below the ceiling.

    A statistic at its ceiling (every draft accepted: tau = gamma + 1) cannot rise, so an arm that must rise to
    show the claimed effect cannot show it. ``room`` is ceiling - mean.
    """
    mean = float(np.mean(np.asarray(values, dtype=float)))
    limit = ceiling - CEILING_MARGIN * (ceiling - floor)
    return Check(f"{name} below its ceiling", mean <= limit,
                 f"{name} is {mean:.3g}, within {CEILING_MARGIN:.0%} of its ceiling {ceiling:.3g}", kind="ceiling",
                 room=ceiling - mean)


def varies(values: ArrayLike, name: str, rtol: float = 1e-9) -> Check:
    """A table that is not constant: its values differ by more than rounding."""
    x = np.asarray(values, dtype=float).reshape(-1)
    x = x[np.isfinite(x)]
    spread = float(x.max() - x.min()) if x.size else 0.0
    scale = float(np.abs(x).max()) if x.size else 0.0
    return Check(f"{name} varies", spread > rtol * max(scale, 1e-300),
                 f"every value of {name} is {x[0] if x.size else float('nan'):.4g}")


def nonzero_in_resamples(values: ArrayLike, name: str, level: float = 0.95) -> Check:
    """A ratio of means over units needs its denominator in the bootstrap's resamples: the units where ``values``
    are nonzero must be enough that a resample misses every one of them, probability (1 - k/n)^n, no more often
    than one tail of the interval, (1 - level) / 2. (Chapter 4 read "agrees" off one tail position in one prompt.)"""
    x = np.asarray(values, dtype=float).reshape(-1)
    x = x[np.isfinite(x)]
    n, k = x.size, int(np.count_nonzero(x))
    missed = (1 - k / n) ** n if n else 1.0
    return Check(f"{name} in enough units for the interval", missed <= (1 - level) / 2,
                 f"{name} is nonzero in {k} of {n} units, so {missed:.0%} of the bootstrap's resamples have none")


def above_floor(values: ArrayLike, floor: float, name: str, minimum: float = MIN_ABOVE_FLOOR) -> Check:
    """At least ``minimum`` of the measurements lie above the float floor (else they measure rounding)."""
    x = np.asarray(values, dtype=float).reshape(-1)
    frac = float((x > floor).mean()) if x.size else 0.0
    return Check(f"{name} above the float floor", frac >= minimum,
                 f"only {frac:.0%} of {name} lie above the float floor {floor:.3g} (need {minimum:.0%})")


def same_direction(a: ArrayLike, b: ArrayLike, name: str) -> Check:
    """A ratio verdict over units (the geometric mean of per-unit ratios a / b) and the ratio of the arms' means point
    the same way: when they do not, a few units decide the mean and many the per-unit ratios, and the comparison's
    direction depends on what it averages over."""
    x, y = np.asarray(a, dtype=float).reshape(-1), np.asarray(b, dtype=float).reshape(-1)
    per_unit = float(np.exp(np.mean(np.log(x / y))))
    of_means = float(x.mean() / y.mean())
    return Check(f"{name}: per-unit ratios and the ratio of means agree in direction",
                 (per_unit - 1) * (of_means - 1) > 0,
                 f"{name}: the per-unit ratios' geometric mean is {per_unit:.3g} and the ratio of the means "
                 f"{of_means:.3g}, so what the comparison averages over decides its direction")


def discrimination(*checks: Check) -> Discrimination:
    """Bundle checks; a verdict given a failing bundle is ``inconclusive`` with the failures as the reason."""
    return Discrimination(tuple(checks))


def _label(claim: Claim, low: float, high: float) -> tuple[str, str]:
    """The label of an interval [low, high] (estimation scale) against the claim's band."""
    m = claim.band
    inside = -m < low and high < m
    if claim.expects == "none":
        if inside:
            return AGREES, "the interval lies inside the no-effect band, as the paper finds"
        if low >= m or high <= -m:
            return DISAGREES, "the interval lies beyond the no-effect band: an effect of at least that size"
        return INCONCLUSIVE, "the interval crosses an edge of the no-effect band"
    low, high = (low, high) if claim.expects == "greater" else (-high, -low)
    if low >= m:
        return AGREES, "the interval lies beyond the smallest effect in the paper's direction"
    if high <= -m:
        return DISAGREES, "the interval lies beyond the smallest effect against the paper's direction"
    if inside:
        return NO_EFFECT, "the interval lies inside the no-effect band"
    if high < 0:
        return INCONCLUSIVE, "the interval lies against the paper's direction but reaches into the no-effect band"
    if low > 0:
        return INCONCLUSIVE, "the interval lies on the paper's side but reaches below the smallest effect"
    return INCONCLUSIVE, "the interval contains no difference"


def interval_label(claim: Claim, low: float, high: float) -> tuple[str, str]:
    """The label, and why, that the rule's step 5 gives an interval [low, high] on the claim's reporting scale (a
    ratio on ratio scales), before the ceiling checks."""
    if claim.ratio:
        with np.errstate(divide="ignore"):
            low, high = float(np.log(low)), float(np.log(high))
    return _label(claim, low, high)


def _with_ceilings(claim: Claim, label: str, reason: str, checks: Discrimination) -> tuple[str, str]:
    """Step 6 of the rule: an established effect notes the ceilings; an interval inside the band next to a
    ceiling cannot tell no effect from saturation."""
    near = checks.failed("ceiling")
    short = [c for c in checks.checks if c.kind == "ceiling" and c.room is not None and not claim.ratio
             and c.room < claim.minimum]
    inside = label == NO_EFFECT or (claim.expects == "none" and label == AGREES)
    if inside and (near or short):
        details = [c.detail for c in near] + [f"{c.name.removesuffix(' below its ceiling')} has room for "
                                              f"{c.room:.3g} below its ceiling, less than the smallest effect "
                                              f"{claim.minimum:g}" for c in short if c not in near]
        return INCONCLUSIVE, "cannot discriminate on this model: " + "; ".join(details)
    if near:
        reason += " (note: " + "; ".join(c.detail for c in near) + ")"
    return label, reason


def verdict(claim: Claim, a: ArrayLike, b: ArrayLike | None = None, *, null: float | None = None,
            discrimination: Discrimination | None = None, kind: str = "paired", units: str = "prompts",
            repeats: int | None = None, n_boot: int = 10_000, seed: int = 0, level: float = 0.95) -> Verdict:
    """The verdict on ``claim`` from paired per-unit measurements ``a`` (arm) and ``b`` (reference), by the rule of
    the module docstring: enough units of ``kind`` (named ``units``; ``repeats`` for timing), the blocking checks of
    ``discrimination``, identical arms, a seeded BCa bootstrap interval over units, the label against the claim's
    smallest effect, and the ceiling checks."""
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if not isinstance(n_boot, int) or n_boot < 100:
        raise ValueError(f"n_boot must be an integer >= 100, got {n_boot!r}")
    x, y = _arms(claim, a, b, null)
    checks = discrimination or Discrimination()
    units_check = enough_units(x.size, kind, units, repeats)
    checks = Discrimination((units_check, *(c for c in checks.checks if c.kind != "units")))
    if claim.scale == "ratio of means" and not checks.failed("blocks"):  # mean(a) / mean(b) needs a b above 0
        checks += Discrimination((Check("reference above 0", bool(y.sum() > 0), "every value of the reference is 0"),))
    data = np.column_stack([x, y])
    estimate, low, high = bca_interval(data, _statistic(claim.scale), level, n_boot, seed)
    if not units_check.passed:
        label, reason = INCONCLUSIVE, units_check.detail
    elif checks.failed("blocks"):
        label = INCONCLUSIVE
        reason = "cannot discriminate on this model: " + "; ".join(c.detail for c in checks.failed("blocks"))
    elif np.array_equal(x, y):
        label, reason = IDENTICAL, f"the arms are equal on every one of the {x.size} {units}"
        near = checks.failed("ceiling")
        reason += f" (note: {'; '.join(c.detail for c in near)})" if near else ""
    else:
        label, reason = _with_ceilings(claim, *_label(claim, low, high), checks)
    if claim.ratio:
        estimate, low, high = (math.exp(v) for v in (estimate, low, high))
    return Verdict(claim, float(estimate), float(low), float(high), int(x.size), label, reason, level, checks,
                   units=units, values=tuple(np.r_[x, y].tolist()))


def combined(claim: Claim, parts: Mapping[str, Verdict], units: str = "prompts") -> Verdict:
    """One verdict from verdicts on parts of the data (RIPE Sec. 5.1: bins of generated positions), by the paper's
    rule for its label: a claimed effect holds through any single part; no effect holds only in every part.

    ``greater``/``less``: agrees if some part agrees; else inconclusive if some part is; else disagrees if some
    part disagrees (the others finding no effect of that size); else no effect (or identical). ``none``: agrees if
    every part agrees (or is identical); disagrees if some part disagrees; else inconclusive. The estimate and
    interval are those of the deciding part (of the parts with the combined label, the one whose interval lies
    farthest from no effect in the claim's direction); n is the largest part's.
    """
    if not parts:
        raise ValueError("parts must hold at least one verdict")
    if any(v.claim != claim for v in parts.values()):
        raise ValueError("every part must be a verdict on the same claim")
    labels = {v.label for v in parts.values()}

    def distance(v: Verdict) -> float:  # how far the interval lies from no effect, in the claim's direction
        lo, hi = (math.log(v.low), math.log(v.high)) if claim.ratio else (v.low, v.high)
        return {"greater": lo, "less": -hi}.get(claim.expects, max(lo, -hi))

    if claim.expects == "none":
        label = AGREES if labels <= {AGREES, IDENTICAL} else DISAGREES if DISAGREES in labels else INCONCLUSIVE
    else:  # the first label present, in this order of precedence
        label = next(lab for lab in (AGREES, INCONCLUSIVE, DISAGREES, NO_EFFECT, IDENTICAL) if lab in labels)
    deciding = [v for v in parts.values() if v.label == label] or list(parts.values())
    pick = max(deciding, key=distance)
    name = next(key for key, value in parts.items() if value is pick)
    counts = pd.Series([v.label for v in parts.values()]).value_counts()
    summary = ", ".join(f"{count} {lab}" for lab, count in counts.items())
    reason = f"over {len(parts)} parts ({summary}), deciding part {name}: {pick.reason}"
    return Verdict(claim, pick.estimate, pick.low, pick.high, max(v.n for v in parts.values()), label, reason,
                   pick.level, pick.discrimination, units=units, method=pick.method,
                   parts=tuple(parts.items()), values=tuple(x for v in parts.values() for x in v.values))


def model_check(claim: Claim, predicted: ArrayLike, measured: ArrayLike, units: str = "held-out cells",
                kind: str = "cells", repeats: int | None = None) -> Verdict:
    """A model's predictions against held-out measurements (RIPE Sec. 3.5: "predicts the 9 batch-8 cells within
    0.15%"): the claim is a ratio within ``claim.minimum`` (``expects="none"``, ``scale="log-ratio"``) on every cell.

    At least :data:`MIN_UNITS` [kind] cells (``kind="timing"`` for measured speeds, with ``repeats``). The estimate
    is the geometric mean of measured / predicted and the interval is the range over the cells: every cell must fit,
    so the range is what decides. Agrees if every cell lies inside the band, disagrees if some cell lies beyond it,
    identical if the model is exact on every cell.
    """
    if claim.expects != "none" or claim.scale != "log-ratio":
        raise ValueError("a model check's claim must expect no effect ('none') on the 'log-ratio' scale, got "
                         f"{claim.expects!r} on {claim.scale!r}")
    y, x = _arms(claim, measured, predicted, None)
    ratio = y / x
    units_check = enough_units(x.size, kind, units, repeats)
    outside = int(((ratio >= claim.minimum) | (ratio <= 1 / claim.minimum)).sum())
    if not units_check.passed:
        label, reason = INCONCLUSIVE, units_check.detail
    elif np.array_equal(x, y):
        label, reason = IDENTICAL, f"the model is exact on every one of the {x.size} {units}"
    elif outside:
        label, reason = DISAGREES, f"{outside} of the {x.size} {units} lie beyond the band"
    else:
        label, reason = AGREES, f"every one of the {x.size} {units} lies inside the band"
    return Verdict(claim, float(np.exp(np.log(ratio).mean())), float(ratio.min()), float(ratio.max()), int(x.size),
                   label, reason, discrimination=Discrimination((units_check,)), units=units,
                   method="range of measured / predicted", values=tuple(np.r_[y, x].tolist()))


# -- tables and summaries ----------------------------------------------------------------------------------------


def distinct(verdicts: Mapping[str, Verdict]) -> tuple[dict[str, Verdict], dict[str, str]]:
    """The verdicts without repeats: a verdict whose per-unit data and label equal an earlier one's (the same numbers
    under another claim) is dropped. Returns (the kept verdicts, each dropped name -> the name it repeats)."""
    kept: dict[str, Verdict] = {}
    repeats: dict[str, str] = {}
    for name, v in verdicts.items():
        same = next((key for key, u in kept.items() if u.values == v.values and (u.estimate, u.low, u.high, u.label)
                     == (v.estimate, v.low, v.high, v.label)), None)
        if same is None:
            kept[name] = v
        else:
            repeats[name] = same
    return kept, repeats


def verdict_table(verdicts: dict[str, Verdict] | list[Verdict]) -> pd.DataFrame:
    """Verdicts as a table, one row each (index: the given names, or the claims), the verdict column first."""
    items = verdicts.items() if isinstance(verdicts, dict) else ((v.claim.statement, v) for v in verdicts)
    rows = {name: v.row() for name, v in items}
    return pd.DataFrame.from_dict(rows, orient="index")


def interval_table(verdicts: dict[str, Verdict]) -> pd.DataFrame:
    """A chapter's verdicts for reading, each once (:func:`distinct`): the label, the estimate with its interval to
    its precision (:attr:`Verdict.estimate_text`), n, the smallest effect, the source and why."""
    verdicts, _ = distinct(verdicts)
    table = verdict_table(verdicts)[["verdict", "n", "smallest effect", "source", "why"]]
    table.insert(1, "estimate [interval]", [v.estimate_text for v in verdicts.values()])
    return table


def claim_summary(verdicts: Mapping[str, Verdict]) -> str:
    """A chapter's verdicts as MyST Markdown, grouped by claim in order of first appearance: each claim once in bold
    with its source, its smallest effect and what its intervals are, then one line per verdict, its name (the
    workload) and :attr:`Verdict.short`, with the reason where the experiment could not discriminate."""
    groups: dict[Claim, list[tuple[str, Verdict]]] = {}
    for name, v in verdicts.items():
        groups.setdefault(v.claim, []).append((name, v))
    blocks = []
    for claim, items in groups.items():
        intervals = "; ".join(dict.fromkeys(v.interval_kind for _, v in items))
        header = (f"**{claim.statement}** ({claim.source}; smallest effect that counts: {claim.minimum_text}, "
                  f"{claim.minimum_source}; {intervals})")
        lines = [f"- {name}: {v.short}" + (f" ({v.reason})" if v.blocked else "") for name, v in items]
        blocks.append("\n".join([header, "", *lines]))
    return "\n\n".join(blocks)


def _count(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def tally(verdicts: dict[str, Verdict], model: str, against: str) -> str:
    """One sentence: how many of a chapter's claims on ``model`` agree with ``against``, disagree, find no effect of
    the size that counts, are identical or inconclusive, and which inconclusive ones could not discriminate. A
    verdict that repeats another's numbers (:func:`distinct`) is counted once, and the sentence says so."""
    verdicts, repeats = distinct(verdicts)
    counts = pd.Series({name: v.label for name, v in verdicts.items()}, dtype=object).value_counts()
    counts = counts.reindex(LABELS, fill_value=0)
    blocked = [name for name, v in verdicts.items() if v.blocked]
    parts = [_count(counts[AGREES], "agrees", "agree") + f" with {against}",
             _count(counts[DISAGREES], "disagrees", "disagree"),
             f"{counts[NO_EFFECT]} find{'s' if counts[NO_EFFECT] == 1 else ''} no effect of the size that counts",
             f"{counts[IDENTICAL]} compare{'s' if counts[IDENTICAL] == 1 else ''} identical arms",
             _count(counts[INCONCLUSIVE], "is inconclusive", "are inconclusive")]
    return (f"Of {len(verdicts)} claims on {model}, " + ", ".join(parts[:-1]) + f" and {parts[-1]}"
            + (f"; {len(blocked)} of these because the measurement cannot discriminate on this model "
               f"({'; '.join(blocked)})." if blocked else ".")
            + "".join(f" “{name}” repeats “{same}” number for number and is counted once." for name, same
                      in repeats.items()))
