"""The papers' own statistics as verdicts (:mod:`looped_kv.analysis.verdicts`), with the smallest effect of each claim.

* RIPE Sec. 5.1 (:func:`fidelity_verdict`): KL(L0 || deepest) / KL(L0 || fp32) as a ratio of mean KLs per bin of
  generated position, with a prompt-paired interval; the claim follows Remark 1 from the model's measured ripeness
  (:func:`measured_ripeness`, :func:`remark1_claim`): on a model ripe to bf16 the deepest plane should cost "no
  more than a precision change", otherwise it should exceed one. :func:`tail_verdict`: a window removes most tail
  positions (ratio of mean tail counts, as the paper's 0.11 [0.00, 0.20]).
* RIPE Sec. 5.2 (:func:`block_dependence_verdict`): the ratio of mean block-dependence KLs, deepest plane over the
  full cache, against the pre-registered threshold 2.
* RIPE Sec. 3.1 (:func:`identify_sensitivity`): e^b fitted only on rows above the float floor at perturbation
  sizes both regions reach; where they do not overlap, e^b is not identified on the model. Each text's own b on
  those rows (:func:`text_b_verdict`).
* RIPE Sec. 3.1 in bf16 (:data:`DEEP_B_BF16`): the same per-text b on arms run in bf16, against Table 6's bf16
  threshold.
* RIPE Sec. 5.4 (:func:`filtering_verdicts`): per-head position filtering against deepest-plane storage and top-k,
  whether the two costs add, and selection at a later loop.
* RIPE Eq. (6) (:func:`eq6_verdict`): each text's predicted deepest-plane KL against its measured one, within the
  factor of two the paper found.
* DAS Table 6 (:data:`MATURE_V_OVER_ALIGNED`): Mature-V against aligned reads at d = 1.
* RIPE Sec. 3.3 and Table 1 (:func:`acceptance_prediction_verdict`): Eq. (7) at one measurement's alpha_d
  predicts a decoder's tau within 6%, every cell.
* RIPE Sec. 3.5 and 5.3 (:func:`memory_model_verdict`, :func:`throughput_verdict`, :func:`fixed_memory_verdict`):
  chapter 7's model checks, each with its n.

Where a paper prints a smallest effect it comes from :mod:`looped_kv.papers`; elsewhere from
:data:`~looped_kv.analysis.verdicts.BOOK_MINIMUM`. Each claim's ``minimum_source`` says which.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from looped_kv.analysis.fits import (
    Ripeness,
    SensitivityFit,
    per_prompt_bin_means,
    sensitivity_regression,
    text_region_coefficients,
)
from looped_kv.analysis.measure import KL_RESOLUTION
from looped_kv.analysis.memory_bench import MemoryCell, MemoryCheck
from looped_kv.analysis.perf import ThroughputFit
from looped_kv.analysis.planes import Eq6Check, RipeningCurves, ripening_curves, ripening_summary
from looped_kv.analysis.ripe import tail_counts_by_prompt
from looped_kv.analysis.throughput import FixedMemoryComparison, ThroughputCell
from looped_kv.analysis.verdicts import (
    BOOK_MINIMUM,
    INCONCLUSIVE,
    MIN_ABOVE_FLOOR,
    Check,
    Claim,
    Verdict,
    above_floor,
    combined,
    discrimination,
    model_check,
    nonzero_in_resamples,
    same_direction,
    varies,
    verdict,
)
from looped_kv.papers import (
    DAS_TABLE_6,
    HUGINN,
    RIPE_SEC_3_2_EQ_6_FACTOR,
    RIPE_SEC_3_5_MEMORY,
    RIPE_SEC_5_2,
    RIPE_TABLE_1,
    RIPE_TABLE_6_THRESHOLDS,
    RIPE_TABLE_8,
    ripe_table_6,
)
from looped_kv.runtime.model import LoopedLM

THRESHOLD: float = RIPE_SEC_5_2["block dependence threshold"]  # RIPE Sec. 5.2: 2, pre-registered
THRESHOLD_SOURCE = "RIPE Sec. 5.2's pre-registered threshold"
#: Generated positions per bin of RIPE Sec. 5.1's per-bin ratio (the paper does not print its bins).
FIDELITY_BIN = 32


# -- RIPE Sec. 5.1 and Remark 1 -------------------------------------------------------------------------------


@torch.no_grad()
def ripeness_replays(fit_model: LoopedLM, floor_model: LoopedLM, ids: Tensor, *, decoded: int, chunk: int = 8,
                     record_device: torch.device | str | None = None) -> tuple[RipeningCurves, RipeningCurves]:
    """The two replays of Remark 1's ripeness test (RIPE Sec. 3.2, as chapter 2 runs them): the ripening curves of
    ``ids`` through ``fit_model`` (float32) and through ``floor_model`` (the same weights in bfloat16)."""
    R = fit_model.config.mean_recurrence
    if floor_model.config.mean_recurrence != R:
        raise ValueError(f"fit_model and floor_model must share R, got {R} and {floor_model.config.mean_recurrence}")
    fit, floor = (ripening_curves(m, ids, R, decoded=decoded, maturity_kinds=(), chunk=chunk,
                                  record_device=record_device) for m in (fit_model, floor_model))
    return fit, floor


def measured_ripeness(fit_model: LoopedLM, floor_model: LoopedLM, ids: Tensor, *, decoded: int, chunk: int = 8,
                      record_device: torch.device | str | None = None) -> dict[str, Ripeness]:
    """Remark 1's ripeness test of keys and values (RIPE Sec. 3.2, as chapter 2 runs it): the float32 replay
    (:func:`ripeness_replays`) fits c rho^r, the bfloat16 one the floor of Eq. (5), and the deep-loop bf16
    distance is set against the floor (:func:`looped_kv.analysis.fits.ripeness`)."""
    curves = ripeness_replays(fit_model, floor_model, ids, decoded=decoded, chunk=chunk, record_device=record_device)
    return {X: fit.ripeness for X, fit in ripening_summary(*curves).items()}


def ripe_to_bf16(ripeness: Mapping[str, Ripeness]) -> bool:
    """The deep loops are ripe to bf16 when both their keys and their values are (Remark 1)."""
    return all(r.ripe for r in ripeness.values())


def remark1_claim(ripe: bool) -> Claim:
    """RIPE Sec. 5.1's claim on a model, as Remark 1 predicts it from the model's ripeness: "indistinguishable from a
    precision change" where the deep loops are ripe to bf16 (Raven), "exceeds a precision change" where not
    (Huginn). The statistic is the per-bin ratio of mean KL, the band Sec. 5.2's threshold 2."""
    ratio = "per-bin ratio of mean KL(L0 ‖ deepest) to KL(L0 ‖ fp32)"
    if ripe:
        return Claim(f"on a model ripe to bf16 the deepest plane costs no more than a precision change: {ratio}",
                     "RIPE Remark 1, Sec. 5.1 (Raven)", expects="none", scale="ratio of means", minimum=THRESHOLD,
                     minimum_source=THRESHOLD_SOURCE)
    return Claim(f"on a model not ripe to bf16 the deepest plane exceeds a precision change: {ratio}",
                 "RIPE Remark 1, Sec. 5.1 (Huginn)", expects="greater", scale="ratio of means", minimum=THRESHOLD,
                 minimum_source=THRESHOLD_SOURCE)


def _paired_records(records: pd.DataFrame, arm: str, reference: str) -> pd.DataFrame:
    missing = {"prompt", "position", "arm", "kl"} - set(records.columns)
    if missing:
        raise ValueError(f"records need columns prompt, position, arm and kl; missing {sorted(missing)}")
    frames = {name: records[records["arm"] == name][["prompt", "position", "kl"]] for name in (arm, reference)}
    for name, frame in frames.items():
        if frame.empty:
            raise ValueError(f"no records for arm {name!r}; the records hold {list(records['arm'].unique())}")
    return frames[arm].merge(frames[reference], on=["prompt", "position"], suffixes=("_arm", "_ref"))


def fidelity_verdict(claim: Claim, records: pd.DataFrame, arm: str, reference: str,
                     bin_width: int = FIDELITY_BIN) -> Verdict:
    """RIPE Sec. 5.1's statistic: per bin of ``bin_width`` generated positions, the ratio of mean KL (over prompts,
    each prompt's mean in the bin) of ``arm`` to ``reference`` (the fp32 replay), with a prompt-paired BCa interval;
    the bins combine by the paper's rule (:func:`looped_kv.analysis.verdicts.combined`: an effect holds through a
    single bin, no effect only in every bin). A bin needs most of its reference KLs above the KL resolution."""
    if not isinstance(bin_width, int) or bin_width < 1:
        raise ValueError(f"bin_width must be an integer >= 1, got {bin_width!r}")
    pairs = _paired_records(records, arm, reference)
    edges = np.arange(0, int(pairs["position"].max()) + bin_width + 1, bin_width)
    _, kl_arm = per_prompt_bin_means(pairs["kl_arm"], pairs["prompt"], pairs["position"], edges)
    _, kl_ref = per_prompt_bin_means(pairs["kl_ref"], pairs["prompt"], pairs["position"], edges)
    parts = {}
    for j in range(len(edges) - 1):
        keep = ~np.isnan(kl_arm[:, j])
        if keep.any():
            name = f"positions {edges[j]}-{edges[j + 1] - 1}"
            checks = discrimination(above_floor(kl_ref[keep, j], KL_RESOLUTION, f"the {reference} KLs at {name}"))
            parts[name] = verdict(claim, kl_arm[keep, j], kl_ref[keep, j], discrimination=checks)
    return combined(claim, parts)


def tail_claim(window: int, threshold: float) -> Claim:
    """RIPE Sec. 5.1 and Table 6: a window of ``window`` positions removes most tail positions (KL > threshold)."""
    return Claim(f"a W = {window} window removes most tail positions (KL > {threshold:g}): ratio of mean tail "
                 "positions per prompt, window over the deepest plane", "RIPE Sec. 5.1, Table 4", expects="less",
                 scale="ratio of means", minimum=2,
                 minimum_source="RIPE Table 6, 'window 64 removes most tail positions' (most: more than half)")


def tail_verdict(claim: Claim, records: pd.DataFrame, window: str, deepest: str, prompts: Sequence[object],
                 threshold: float) -> Verdict:
    """The paper's tail ratio (0.11 [0.00, 0.20] on Huginn): tail positions per prompt of ``window`` over those of
    ``deepest``, as a ratio of means with a prompt-paired interval. The deepest plane must have a tail to remove."""
    a = tail_counts_by_prompt(records, window, prompts, threshold)
    b = tail_counts_by_prompt(records, deepest, prompts, threshold)
    name = f"the {deepest} tail positions per prompt"
    return verdict(claim, a, b, discrimination=discrimination(varies(b, name), nonzero_in_resamples(b, name)))


# -- RIPE Sec. 5.2 ------------------------------------------------------------------------------------------------

#: RIPE Sec. 4 and 5.2: batched deepest-plane verification depends on where blocks start (more than numerics).
BLOCK_DEPENDENCE = Claim("batched deepest-plane verification depends on where blocks start: ratio of mean "
                         "KL(sequential ‖ batched), deepest plane over the full cache", "RIPE Sec. 4, 5.2",
                         expects="greater", scale="ratio of means", minimum=THRESHOLD, minimum_source=THRESHOLD_SOURCE)


def block_dependence_verdict(deepest: Sequence[float], full: Sequence[float]) -> Verdict:
    """:data:`BLOCK_DEPENDENCE` on per-prompt mean block KLs (NaN: a prompt too short for a block, left out). The full
    cache's KLs measure numerics; most of them must lie above the KL resolution for the ratio to mean anything."""
    a, b = np.asarray(deepest, dtype=float), np.asarray(full, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"deepest and full must be paired per prompt, got {a.size} and {b.size} values")
    keep = np.isfinite(a) & np.isfinite(b)
    checks = discrimination(above_floor(b[keep], KL_RESOLUTION, "the full cache's block KLs"))
    return verdict(BLOCK_DEPENDENCE, a[keep], b[keep], discrimination=checks)


# -- RIPE Sec. 3.1 and Eq. (6) ------------------------------------------------------------------------------------

#: RIPE Sec. 3.1 and Table 6 (batch 9): at equal perturbation size the deep region costs more KL, b >= 3.
DEEP_B = Claim("at equal perturbation size the deep region costs more KL: each text's own b, on rows above the "
               "float floor at sizes both regions reach", "RIPE Sec. 3.1", minimum=RIPE_TABLE_6_THRESHOLDS[
                   "deep coefficient b"], minimum_source="RIPE Table 6 (batch 9): 'deep coefficient ≥ 3'")
#: RIPE Sec. 3.1 in bf16 and Table 6 (batch 9, whose threshold is a bf16 one): the same claim on arms run in bf16.
DEEP_B_BF16 = Claim("in bf16, at equal perturbation size the deep region costs more KL: each text's own b, on rows "
                    "above the bf16 KL floor at sizes both regions reach", "RIPE Sec. 3.1 (bf16)",
                    minimum=RIPE_TABLE_6_THRESHOLDS["deep coefficient b"],
                    minimum_source="RIPE Table 6 (batch 9): 'deep coefficient ≥ 3 (bf16)'")
#: RIPE Eq. (6): the region model predicts the deepest-plane KL "to within a factor of two".
EQ6 = Claim("Eq. (6) predicts the deepest-plane cache's KL at the first decoded position: measured over predicted, "
            "per text", "RIPE Sec. 3.2, Eq. (6)", expects="none", scale="log-ratio",
            minimum=RIPE_SEC_3_2_EQ_6_FACTOR, minimum_source="RIPE Sec. 3.2, 'to within a factor of two'")


@dataclass(frozen=True)
class Identification:
    """Whether RIPE Sec. 3.1's e^b is identified on a model: the regression on the rows above the float floor at
    perturbation sizes both regions reach, or the reason it cannot be fitted."""

    rows: pd.DataFrame  # the identifying rows (above the floor, inside the overlap)
    sizes: dict[str, tuple[float, float]]  # per region: the sizes of its rows above the floor, (smallest, largest)
    overlap: tuple[float, float] | None
    fit: SensitivityFit | None
    reason: str  # why e^b is not identified ("" when it is)

    @property
    def identified(self) -> bool:
        return self.fit is not None


def identify_sensitivity(rows: pd.DataFrame, floor: float, *, n_boot: int = 2000, seed: int = 0) -> Identification:
    """e^b of RIPE Sec. 3.1 where the data identify it. Rows at or below ``floor`` carry no size information (their
    KL is rounding), and a contrast of regions at sizes only one region reaches extrapolates a line into the other:
    so the regression (text bootstrap) uses the rows above the floor whose size lies in both regions' range. Not
    identified: a region with no row above the floor, ranges that do not overlap, or fewer than 2 planes of a
    region (or 2 texts) inside the overlap."""
    missing = {"text", "region", "plane", "kl", "size", "deep"} - set(rows.columns)
    if missing:
        raise ValueError(f"rows need columns text, region, plane, kl, size and deep; missing {sorted(missing)}")
    above = rows[rows["kl"] > floor]
    sizes = {name: (float(g["size"].min()), float(g["size"].max())) for name, g in above.groupby("region")}
    empty = pd.DataFrame(columns=rows.columns)

    def not_identified(reason: str, overlap: tuple[float, float] | None = None) -> Identification:
        return Identification(empty, sizes, overlap, None, reason)

    for name in ("shallow", "deep"):
        if name not in sizes:
            return not_identified(f"every {name} row sits at or below the float floor {floor:.2g}")
    low, high = max(s[0] for s in sizes.values()), min(s[1] for s in sizes.values())
    if low >= high:
        return not_identified("the perturbation sizes of the rows above the float floor do not overlap (shallow "
                              f"{sizes['shallow'][0]:.2g}-{sizes['shallow'][1]:.2g}, deep {sizes['deep'][0]:.2g}-"
                              f"{sizes['deep'][1]:.2g})")
    kept = above[(above["size"] >= low) & (above["size"] <= high)]
    for name, group in kept.groupby("region"):
        if group["plane"].nunique() < 2:
            return not_identified(f"only {group['plane'].nunique()} plane of the {name} region lies inside the "
                                  f"overlap of sizes {low:.2g}-{high:.2g}", (low, high))
    both = kept.groupby("text")["region"].nunique()
    if kept["region"].nunique() < 2 or (both == 2).sum() < 2:
        return not_identified(f"fewer than 2 texts have rows of both regions inside the overlap {low:.2g}-{high:.2g}",
                              (low, high))
    try:
        fit = sensitivity_regression(kept, n_boot=n_boot, seed=seed)
    except ValueError as error:
        return not_identified(f"the overlap {low:.2g}-{high:.2g} is too thin for a fit ({error})", (low, high))
    return Identification(kept, sizes, (low, high), fit, "")


def text_b_verdict(identification: Identification, claim: Claim = DEEP_B) -> Verdict:
    """``claim`` (:data:`DEEP_B`, or :data:`DEEP_B_BF16` for arms run in bf16) on each text's own b, fitted on its
    identifying rows (texts with 2 or more of them in each region); with e^b not identified, the verdict is
    inconclusive and says why."""
    if not identification.identified:
        return Verdict(claim, float("nan"), float("nan"), float("nan"), 0, INCONCLUSIVE,
                       f"cannot discriminate on this model: e^b is not identified ({identification.reason})",
                       units="texts")
    rows = identification.rows
    counts = rows.groupby(["text", "region"])["plane"].nunique().unstack(fill_value=0)
    usable = counts[(counts >= 2).all(axis=1)].index
    if usable.empty:
        return Verdict(claim, float("nan"), float("nan"), float("nan"), 0, INCONCLUSIVE,
                       "cannot discriminate on this model: no text has identifying rows of 2 or more planes in "
                       "each region, so no text has its own b", units="texts")
    b = text_region_coefficients(rows[rows["text"].isin(usable)])
    return verdict(claim, b.to_numpy(), null=0.0, units="texts")


def eq6_verdict(check: Eq6Check, intercept: float, slope: float, floor: float,
                fitted_sizes: tuple[float, float]) -> Verdict:
    """:data:`EQ6` per text: the measured deepest-plane KL against e^intercept S^slope at the text's measured
    perturbation size S over the deep loops, where (intercept, slope) is the deep region's fitted line (a + b and g
    of the regression, or the deep rows' own line) and ``fitted_sizes`` the least and most perturbation size of the
    rows it was fitted on. The measured KLs must lie above the float floor (else Eq. (6) cannot be checked against
    them, as for Raven in the paper; a KL at the floor enters at it), and at least half the texts' S must lie
    within the fitted sizes: a line fitted at sizes near 1 says nothing of sizes near 1e-3 (Eq. (4) is a
    small-perturbation law, and a regression holds where it was fitted)."""
    if not all(math.isfinite(v) for v in (intercept, slope)):
        raise ValueError(f"intercept and slope must be finite, got {(intercept, slope)}")
    low, high = fitted_sizes
    if not 0 < low <= high < math.inf:
        raise ValueError(f"fitted_sizes must be (least, most) sizes with 0 < least <= most, got {fitted_sizes}")
    sizes = np.asarray(check.S_measured, dtype=float)
    predicted = np.exp(intercept) * sizes**slope
    measured = np.asarray(check.measured, dtype=float)
    inside = float(((sizes >= low) & (sizes <= high)).mean())
    checks = discrimination(
        above_floor(measured, floor, "the deepest-plane arm's KLs"),
        Check("the texts' sizes lie where the line was fitted", inside >= MIN_ABOVE_FLOOR,
              f"only {inside:.0%} of the texts' deep-loop sizes S ({sizes.min():.2g} to {sizes.max():.2g}) lie within "
              f"the sizes the line was fitted on ({low:.2g} to {high:.2g}): Eq. (6) would extrapolate it"))
    return verdict(EQ6, np.maximum(measured, floor), predicted, discrimination=checks, units="texts")


# -- DAS Table 6 ------------------------------------------------------------------------------------------------

_HUGINN6 = DAS_TABLE_6[HUGINN]
#: DAS Sec. 3.1 and Table 6: at d = 1, Mature-V reads raise Huginn's draft-target agreement over aligned reads.
MATURE_V_OVER_ALIGNED = Claim(
    "at d = 1, drafts reading full-depth prefix values (Mature-V) agree with the target more often than aligned "
    "drafts", f"DAS Sec. 3.1, Table 6 (Huginn {_HUGINN6['Aligned'][0]:.0%} to {_HUGINN6['Deep V'][0]:.0%})",
    minimum=BOOK_MINIMUM["share"], minimum_source="the book's smallest effect for a share")



# -- RIPE Sec. 3.3 and Table 1: the acceptance model out of sample ------------------------------------------------

_HELD_OUT = RIPE_TABLE_1["acceptance, held-out error"]
#: RIPE Sec. 3.3 and Table 1 ("Acceptance", held out): Eq. (7) at the acceptance one experiment measures predicts the
#: tokens per verification another, real decoder measures within 6%.
ACCEPTANCE_PREDICTION = Claim(
    "Eq. (7) at the acceptance alpha_d of one measurement predicts the tokens per verification a decoder measures",
    "RIPE Sec. 3.3, Table 1", expects="none", scale="log-ratio", minimum=1 + _HELD_OUT,
    minimum_source=f"RIPE Table 1's held-out error (within {_HELD_OUT:.0%})")


def acceptance_prediction_verdict(predicted: Sequence[float], measured: Sequence[float],
                                  units: str = "decoder cells") -> Verdict:
    """:data:`ACCEPTANCE_PREDICTION` as a model check: each cell's predicted tau against its measured one, every cell
    within RIPE's 6% (:func:`~looped_kv.analysis.verdicts.model_check`)."""
    return model_check(ACCEPTANCE_PREDICTION, predicted, measured, units=units)

# -- RIPE Sec. 3.5 and 5.3: chapter 7's model checks ---------------------------------------------------------------

#: RIPE Sec. 3.5 and Figure 3: the memory model predicts held-out batches within 0.15%.
MEMORY_MODEL = Claim("the memory model cache B + o0 + o1 B, fitted on two batches, predicts the peak memory of every "
                     "held-out batch", "RIPE Sec. 3.5, Figure 3", expects="none", scale="log-ratio",
                     minimum=1 + RIPE_SEC_3_5_MEMORY["held-out error"],
                     minimum_source="RIPE Sec. 3.5's largest held-out error")
_BATCH6_RESIDUAL = max(row.residual for row in RIPE_TABLE_8 if row.batch == 6)
#: RIPE Sec. 3.5 and Table 8: T(B) = B / (a + bB) describes throughput against the batch size.
THROUGHPUT_MODEL = Claim("T(B) = B / (a + bB), fitted on the measured batches, predicts throughput at a batch beyond "
                         "them", "RIPE Sec. 3.5, Table 8", expects="none", scale="log-ratio",
                         minimum=1 + _BATCH6_RESIDUAL, minimum_source="RIPE Table 8's largest residual (batch 6)")
#: RIPE Sec. 3.5 and 5.3: one shared plane raises throughput at a fixed memory budget (2.24x on Huginn).
FIXED_MEMORY_GAIN = Claim("at a fixed memory budget the deepest plane decodes faster than the full cache, each at its "
                          "own B_max: tokens/s ratio", "RIPE Sec. 3.5, 5.3", scale="log-ratio",
                          minimum=RIPE_TABLE_6_THRESHOLDS["fixed-memory gain of one shared slot"],
                          minimum_source="RIPE Table 6 (batch 6): 'shared ≥ 1.5×'")


def memory_model_verdict(checks: Mapping[str, tuple[Sequence[MemoryCell], MemoryCheck]]) -> Verdict:
    """:data:`MEMORY_MODEL` on every held-out (cache, batch) cell of ``checks`` (by cache: the measured cells and the
    fitted check of :func:`looped_kv.analysis.memory_bench.check_memory_model`)."""
    predicted, measured = [], []
    for cells, check in checks.values():
        for cell in cells:
            if cell.batch in check.held_out:
                predicted.append(float(check.fit.predict(cell.batch)))
                measured.append(float(cell.peak_bytes))
    return model_check(MEMORY_MODEL, predicted, measured)


def throughput_verdict(fits: Mapping[str, ThroughputFit | None], cells: Mapping[str, Sequence[ThroughputCell]],
                       fitted_up_to: int, repeats: int) -> Verdict:
    """:data:`THROUGHPUT_MODEL` out of sample: each series' T(B) fit (by name; None where it did not saturate)
    against its measured cells at batches above ``fitted_up_to`` (a timing check: speeds measured ``repeats``
    times)."""
    predicted, measured = [], []
    for name, fit in fits.items():
        for cell in cells.get(name, ()):
            if fit is not None and cell.batch > fitted_up_to:
                predicted.append(float(fit.predict(cell.batch)))
                measured.append(cell.tokens_per_s)
    if not predicted:
        raise ValueError(f"no fitted series has a measured cell above B = {fitted_up_to}")
    return model_check(THROUGHPUT_MODEL, predicted, measured, units="held-out batches", kind="timing", repeats=repeats)


def fixed_memory_verdict(comparison: FixedMemoryComparison, repeats: int) -> Verdict:
    """:data:`FIXED_MEMORY_GAIN` on a fixed-memory comparison (:func:`looped_kv.analysis.throughput
    .fixed_memory_comparison`, ``repeats`` runs per cell): a timing verdict whose units are its prompt sets, the
    deepest plane at its B_max against the full cache at its own, paired within each set."""
    b_full, b_deep = comparison.memory["full"].b_max, comparison.memory["deepest"].b_max
    return verdict(FIXED_MEMORY_GAIN, [cells[f"deepest@{b_deep}"].tokens_per_s for cells in comparison.by_set],
                   [cells[f"full@{b_full}"].tokens_per_s for cells in comparison.by_set], kind="timing",
                   units="prompt sets", repeats=repeats)


# -- RIPE Sec. 5.4: per-head position filtering ----------------------------------------------------------------------

_KL_RATIO = dict(minimum=BOOK_MINIMUM["KL ratio"], minimum_source="the book's smallest ratio of KLs (RIPE Sec. 5.2's "
                                                                  "pre-registered threshold)")
#: RIPE Sec. 5.4 and Table 6 (batch 8, "filtering costs > 3× sharing"): filtering costs more than deepest-plane storage.
FILTERING_OVER_DEEPEST = Claim("per-head position filtering costs more KL than deepest-plane storage: filtered / "
                               "deepest plane", "RIPE Sec. 5.4", "greater", "log-ratio",
                               minimum=ripe_table_6("8", "filtering costs").bounds[0],
                               minimum_source="RIPE Table 6 (batch 8): 'filtering costs > 3× sharing'")
#: RIPE Sec. 5.4: "the two costs add" (ratio 0.88): a claim of no effect on the ratio to the sum.
COSTS_ADD = Claim("the costs of filtering and of deepest-plane storage add: both / (filtered + deepest plane)",
                  "RIPE Sec. 5.4", "none", "log-ratio", **_KL_RATIO)
#: RIPE Sec. 5.4: the frozen per-head policy is worse than each text's own top-k (Table 6, batch 8: "per-head ≈ all
#: top-k" failed).
PER_HEAD_OVER_TOP_K = Claim("the frozen per-head policy costs more KL than each text's own top-k at the same budget: "
                            "per-head / top-k", "RIPE Sec. 5.4", "greater", "log-ratio", **_KL_RATIO)
#: RIPE Sec. 5.4: selecting at the later loop cuts the cost ("consistent with ripening").
LATER_SELECTION = Claim("selecting the per-head positions at the later loop costs less KL: later / earlier loop",
                        "RIPE Sec. 5.4", "less", "log-ratio", **_KL_RATIO)


def filtering_verdicts(kl: Mapping[str, np.ndarray], floor: float) -> dict[str, Verdict]:
    """The four claims of RIPE Sec. 5.4 on per-text first-position KLs. ``kl`` names the arms "deepest plane",
    "per-head", "top-k", "per-head and deepest plane" and "per-head, later loop"; a KL at or below ``floor`` enters
    at the floor, and an arm whose KLs sit mostly at it cannot be compared (:func:`above_floor`)."""
    need = {"deepest plane", "per-head", "top-k", "per-head and deepest plane", "per-head, later loop"}
    if set(kl) != need:
        raise ValueError(f"kl must name the arms {sorted(need)}, got {sorted(kl)}")
    if not (math.isfinite(floor) and floor > 0):
        raise ValueError(f"floor must be > 0, got {floor}")
    x = {name: np.maximum(np.asarray(v, dtype=float), floor) for name, v in kl.items()}
    resolved = {name: above_floor(np.asarray(v, dtype=float), floor, f"the {name} arm's KLs")
                for name, v in kl.items()}

    def checked(a: np.ndarray, b: np.ndarray, what: str, *names: str):
        return discrimination(*(resolved[n] for n in names), same_direction(a, b, what))

    both, added = x["per-head and deepest plane"], x["per-head"] + x["deepest plane"]
    return {
        "filtering over deepest plane": verdict(
            FILTERING_OVER_DEEPEST, x["per-head"], x["deepest plane"], units="texts",
            discrimination=checked(x["per-head"], x["deepest plane"], "filtering over the deepest plane", "per-head",
                                   "deepest plane")),
        "costs add": verdict(COSTS_ADD, both, added, units="texts",
                             discrimination=checked(both, added, "both over their sum", "per-head", "deepest plane",
                                                    "per-head and deepest plane")),
        "per-head over top-k": verdict(PER_HEAD_OVER_TOP_K, x["per-head"], x["top-k"], units="texts",
                                       discrimination=checked(x["per-head"], x["top-k"], "per-head over top-k",
                                                              "per-head", "top-k")),
        "later selection": verdict(LATER_SELECTION, x["per-head, later loop"], x["per-head"], units="texts",
                                   discrimination=checked(x["per-head, later loop"], x["per-head"],
                                                          "later over earlier selection", "per-head",
                                                          "per-head, later loop")),
    }
