"""One verdict for every comparison in the book: a paper's claim against paired measurements.

A claim says which way a paired statistic points: method A commits more tokens per verification
than method B, deep-loop substitutions cost more KL than shallow ones, this model's acceptance lies
below its ceiling. :func:`verdict` takes the per-prompt (per-text) measurements of the two arms,
estimates the mean paired difference (or the mean log ratio), draws a paired bootstrap interval over
prompts, and labels the claim:

* ``agrees``: the interval lies wholly on the side the claim predicts;
* ``disagrees``: it lies wholly on the other side;
* ``inconclusive``: it contains no difference, or the experiment cannot discriminate.

The label never comes from a point estimate, and no chapter sets its own threshold: the null is
"no difference" (0 on the difference scale, a ratio of 1 on the log-ratio scale), and the checks
of :func:`discrimination` use the package-wide constants below. An experiment that cannot tell
outcomes apart (a saturated acceptance, a constant table, measurements at the float floor, too
few prompts) gives ``inconclusive`` with the reason, whatever its interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

AGREES, DISAGREES, INCONCLUSIVE = "agrees", "disagrees", "inconclusive"
LABELS = (AGREES, DISAGREES, INCONCLUSIVE)
#: Fewest paired prompts (or texts) behind an acceptance comparison (issue: at least 32 per arm).
MIN_PROMPTS = 32
#: A bounded statistic (tau <= gamma + 1, agreement <= 1) must stay this fraction of its range below its ceiling.
CEILING_MARGIN = 0.05
#: Fewest measurements that must lie above the float floor for a comparison of them to mean anything.
MIN_ABOVE_FLOOR = 0.5


@dataclass(frozen=True)
class Claim:
    """A paper's claim about a paired statistic: which sign it predicts, and where it is printed.

    ``scale="difference"`` compares mean(a - b); ``"log-ratio"`` compares mean(log(a / b)) (speed-ups,
    KL ratios) and reports the ratio exp(.). With one arm (b omitted) the statistic is a - ``null``
    (or log(a / null)).
    """

    statement: str
    source: str
    expects: Literal["greater", "less"] = "greater"
    scale: Literal["difference", "log-ratio"] = "difference"

    def __post_init__(self) -> None:
        if self.expects not in ("greater", "less"):
            raise ValueError(f"expects must be 'greater' or 'less', got {self.expects!r}")
        if self.scale not in ("difference", "log-ratio"):
            raise ValueError(f"scale must be 'difference' or 'log-ratio', got {self.scale!r}")


@dataclass(frozen=True)
class Check:
    """One discrimination check: its name, whether it passed, and what was measured."""

    name: str
    passed: bool
    detail: str


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

    def __add__(self, other: Discrimination) -> Discrimination:
        return Discrimination(self.checks + other.checks)


@dataclass(frozen=True)
class Verdict:
    """A claim, the paired estimate with its bootstrap interval, and the three-way label."""

    claim: Claim
    estimate: float
    low: float
    high: float
    n: int
    label: str
    reason: str
    level: float = 0.95
    discrimination: Discrimination = field(default_factory=Discrimination)

    @property
    def null(self) -> float:
        return 1.0 if self.claim.scale == "log-ratio" else 0.0

    def interval(self, digits: int = 3) -> str:
        fmt = f"{{:.{digits}g}}"
        return f"{fmt.format(self.estimate)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"

    @property
    def measure(self) -> str:
        """What the estimate is: a ratio (log-ratio claims) or a difference."""
        return "ratio" if self.claim.scale == "log-ratio" else "difference"

    def __str__(self) -> str:
        return (f"{self.label} ({self.claim.source}: {self.claim.statement}): {self.measure} {self.interval()}, "
                f"{self.level:.0%} paired bootstrap over {self.n}; {self.reason}")

    def sentence(self, digits: int = 3) -> str:
        """The verdict as a sentence for the chapter's prose (MyST markdown)."""
        what = "ratio" if self.claim.scale == "log-ratio" else "difference"
        return (f"**{self.label}** ({self.claim.source}: {self.claim.statement}): {what} {self.interval(digits)} "
                f"({self.level:.0%} paired bootstrap interval over {self.n}); {self.reason}.")

    def row(self) -> dict[str, object]:
        """A table row: the claim, its source, the estimate and interval, the label and why."""
        return {"claim": self.claim.statement, "source": self.claim.source, "estimate": self.estimate,
                "low": self.low, "high": self.high, "n": self.n, "verdict": self.label, "why": self.reason}


def _vector(name: str, values: ArrayLike) -> np.ndarray:
    x = np.asarray(values, dtype=float).reshape(-1)
    if x.size < 2:
        raise ValueError(f"{name} must hold at least 2 paired measurements, got {x.size}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite, got {int((~np.isfinite(x)).sum())} non-finite values")
    return x


def paired_statistic(claim: Claim, a: ArrayLike, b: ArrayLike | None = None, null: float | None = None) -> np.ndarray:
    """Per-unit statistic of a claim: a - b (or a - null), or log(a / b) (or log(a / null))."""
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
    if claim.scale == "log-ratio":
        if (x <= 0).any() or (y <= 0).any():
            raise ValueError("a log-ratio claim needs positive measurements in a and b (or null)")
        return np.log(x) - np.log(y)
    return x - y


def verdict(claim: Claim, a: ArrayLike, b: ArrayLike | None = None, *, null: float | None = None,
            discrimination: Discrimination | None = None, n_boot: int = 10_000, seed: int = 0,
            level: float = 0.95) -> Verdict:
    """The verdict on ``claim`` from paired per-prompt measurements ``a`` (arm) and ``b`` (reference).

    Estimate: the mean per-prompt statistic (:func:`paired_statistic`); interval: percentile bootstrap
    over prompts (resampling pairs, so the pairing is kept). ``discrimination`` (from
    :func:`discrimination`) turns any label into ``inconclusive`` when the experiment cannot
    tell outcomes apart.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if not isinstance(n_boot, int) or n_boot < 100:
        raise ValueError(f"n_boot must be an integer >= 100, got {n_boot!r}")
    stat = paired_statistic(claim, a, b, null)
    rng = np.random.default_rng(seed)
    means = np.concatenate([stat[rng.integers(0, stat.size, (size, stat.size))].mean(axis=1)
                            for size in np.diff(np.r_[0:n_boot:1000, n_boot])])
    low, high = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    estimate = float(stat.mean())
    discrimination = discrimination or Discrimination()
    if not discrimination.ok:
        label, reason = INCONCLUSIVE, f"cannot discriminate on this model: {discrimination.reason}"
    elif low > 0 or high < 0:
        predicted = (low > 0) == (claim.expects == "greater")
        label = AGREES if predicted else DISAGREES
        reason = ("the interval lies on the side the paper predicts" if predicted
                  else "the interval lies on the other side of no difference")
    else:
        label, reason = INCONCLUSIVE, "the interval contains no difference"
    if claim.scale == "log-ratio":
        estimate, low, high = float(np.exp(estimate)), float(np.exp(low)), float(np.exp(high))
    return Verdict(claim, estimate, float(low), float(high), stat.size, label, reason, level, discrimination)


# -- discrimination checks ------------------------------------------------------------------------------------


def enough_units(n: int, minimum: int = MIN_PROMPTS, what: str = "prompts") -> Check:
    """At least ``minimum`` paired prompts (texts) behind the comparison."""
    return Check(f"at least {minimum} {what}", n >= minimum, f"{n} {what}, fewer than {minimum}")


def below_ceiling(values: ArrayLike, ceiling: float, name: str, floor: float = 0.0) -> Check:
    """The mean of a bounded statistic stays ``CEILING_MARGIN`` of its range [floor, ceiling] below the ceiling.

    A statistic at its ceiling (every draft accepted: tau = gamma + 1) is the same for every arm, so
    arms cannot differ in it.
    """
    mean = float(np.mean(np.asarray(values, dtype=float)))
    limit = ceiling - CEILING_MARGIN * (ceiling - floor)
    return Check(f"{name} below its ceiling", mean <= limit,
                 f"{name} is {mean:.3g}, within {CEILING_MARGIN:.0%} of its ceiling {ceiling:.3g}")


def varies(values: ArrayLike, name: str, rtol: float = 1e-9) -> Check:
    """A table that is not constant: its values differ by more than rounding."""
    x = np.asarray(values, dtype=float).reshape(-1)
    x = x[np.isfinite(x)]
    spread = float(x.max() - x.min()) if x.size else 0.0
    scale = float(np.abs(x).max()) if x.size else 0.0
    return Check(f"{name} varies", spread > rtol * max(scale, 1e-300),
                 f"every value of {name} is {x[0] if x.size else float('nan'):.4g}")


def above_floor(values: ArrayLike, floor: float, name: str, minimum: float = MIN_ABOVE_FLOOR) -> Check:
    """At least ``minimum`` of the measurements lie above the float floor (else they measure rounding)."""
    x = np.asarray(values, dtype=float).reshape(-1)
    frac = float((x > floor).mean()) if x.size else 0.0
    return Check(f"{name} above the float floor", frac >= minimum,
                 f"only {frac:.0%} of {name} lie above the float floor {floor:.3g} (need {minimum:.0%})")


def discrimination(*checks: Check) -> Discrimination:
    """Bundle checks; a verdict given a failing bundle is ``inconclusive`` with the failures as the reason."""
    return Discrimination(tuple(checks))


def verdict_table(verdicts: dict[str, Verdict] | list[Verdict]) -> pd.DataFrame:
    """Verdicts as a table, one row each (index: the given names, or the claims)."""
    items = verdicts.items() if isinstance(verdicts, dict) else ((v.claim.statement, v) for v in verdicts)
    rows = {name: v.row() for name, v in items}
    return pd.DataFrame.from_dict(rows, orient="index")


def interval_table(verdicts: dict[str, Verdict]) -> pd.DataFrame:
    """A chapter's verdicts for reading: source, the estimate with its 95% interval, n, the label and why."""
    table = verdict_table(verdicts)[["source", "n", "verdict", "why"]]
    table.insert(1, "estimate [95% interval]", [f"{v.measure} {v.interval()}" for v in verdicts.values()])
    return table


def _count(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def tally(verdicts: dict[str, Verdict], model: str, against: str) -> str:
    """One sentence: how many of a chapter's claims on ``model`` agree with ``against``, disagree, are
    inconclusive, and which of the inconclusive ones could not discriminate."""
    counts = pd.Series({name: v.label for name, v in verdicts.items()}).value_counts()
    counts = counts.reindex(LABELS, fill_value=0)
    blocked = [name for name, v in verdicts.items() if not v.discrimination.ok]
    return (f"Of {len(verdicts)} claims on {model}, {_count(counts[AGREES], 'agrees', 'agree')} with {against}, "
            f"{_count(counts[DISAGREES], 'disagrees', 'disagree')} and "
            f"{_count(counts[INCONCLUSIVE], 'is inconclusive', 'are inconclusive')}"
            + (f"; {len(blocked)} of these because the measurement cannot discriminate on this model "
               f"({'; '.join(blocked)})." if blocked else "."))
