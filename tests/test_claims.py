"""The papers' own statistics as verdicts: RIPE Sec. 5.1's per-bin ratio of mean KL with Remark 1's prediction, the
tail and block-dependence ratios, an e^b that is fitted only where the data identify it, Eq. (6) per text, DAS
Table 6's Mature-V against aligned reads, and chapter 7's model checks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import random_model

from looped_kv import papers
from looped_kv.analysis import claims
from looped_kv.analysis.fits import Ripeness
from looped_kv.analysis.memory_bench import MemoryCell, check_memory_model
from looped_kv.analysis.perf import ThroughputFit, fixed_memory_factors
from looped_kv.analysis.planes import Eq6Check, in_dtype
from looped_kv.analysis.throughput import FixedMemoryComparison, ThroughputCell
from looped_kv.analysis.verdicts import AGREES, DISAGREES, IDENTICAL, INCONCLUSIVE, NO_EFFECT


def records(prompts: int = 40, positions: int = 96, tail_at: tuple[int, int] | None = None, seed: int = 0,
            arm_scale: float = 1.0) -> pd.DataFrame:
    """Per-position KLs of a deepest-plane arm and an fp32 arm; ``tail_at`` = (first, last) positions where the
    deepest plane's KL is 20 times larger."""
    rng = np.random.default_rng(seed)
    prompt, position = np.repeat(np.arange(prompts), positions), np.tile(np.arange(positions), prompts)
    fp32 = rng.lognormal(np.log(1e-4), 0.5, prompt.size)
    deep = fp32 * arm_scale * rng.lognormal(0, 0.3, prompt.size)
    if tail_at is not None:
        deep = np.where((position >= tail_at[0]) & (position <= tail_at[1]), 20 * deep, deep)
    frame = lambda arm, kl: pd.DataFrame({"prompt": prompt, "position": position, "arm": arm, "kl": kl})  # noqa: E731
    return pd.concat([frame("deepest", deep), frame("fp32", fp32)], ignore_index=True)


def test_remark1_predicts_the_claim_from_the_models_ripeness():
    ripe, not_ripe = claims.remark1_claim(True), claims.remark1_claim(False)
    assert ripe.expects == "none" and not_ripe.expects == "greater"
    assert ripe.scale == not_ripe.scale == "ratio of means" and ripe.minimum == papers.RIPE_SEC_5_2[
        "block dependence threshold"]
    assert "no more than a precision change" in ripe.statement and "(Raven)" in ripe.source
    yes, no = Ripeness(1.0, 2 ** 0.5, "ripe to bf16"), Ripeness(1.6, 2 ** 0.5, "not ripe")
    assert claims.ripe_to_bf16({"k": yes, "v": yes}) and not claims.ripe_to_bf16({"k": yes, "v": no})


def test_measured_ripeness_labels_keys_and_values():
    """On a random model whose recurrence contracts (its core's matrices scaled down, so that Delta_r falls with r and
    c rho^r has a fit), keys and values each get one of Remark 1's two labels."""
    model = random_model("huginn", seed=1, mean_recurrence=16)
    with torch.no_grad():
        for p in model.transformer.core_block.parameters():
            if p.dim() == 2:
                p.mul_(0.2)
    ids = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(0))
    found = claims.measured_ripeness(in_dtype(model, torch.float32), in_dtype(model, torch.bfloat16), ids, decoded=4,
                                     chunk=3)
    assert set(found) == {"k", "v"} and all(r.label in ("ripe to bf16", "not ripe") for r in found.values())


def test_fidelity_is_the_per_bin_ratio_of_mean_kl():
    """A tail held by one bin makes the deepest plane exceed a precision change; a flat ratio does not."""
    exceeds = claims.remark1_claim(False)
    tail = claims.fidelity_verdict(exceeds, records(tail_at=(40, 60)), "deepest", "fp32")
    assert tail.label == AGREES and len(tail.parts) == 3 and "positions 32-63" in tail.reason
    flat = claims.fidelity_verdict(exceeds, records(), "deepest", "fp32")
    assert flat.label == NO_EFFECT
    ripe = claims.remark1_claim(True)
    assert claims.fidelity_verdict(ripe, records(), "deepest", "fp32").label == AGREES
    assert claims.fidelity_verdict(ripe, records(tail_at=(40, 60)), "deepest", "fp32").label == DISAGREES
    # the mean is what counts: a tail of a few prompts is diluted by a geometric mean of per-prompt ratios
    one = records(arm_scale=0.8)
    heavy = (one["arm"] == "deepest") & (one["prompt"] < 3) & (one["position"] < 32)
    one.loc[heavy, "kl"] *= 400
    assert claims.fidelity_verdict(exceeds, one, "deepest", "fp32").label == AGREES
    with pytest.raises(ValueError, match="no records for arm"):
        claims.fidelity_verdict(exceeds, one, "deepest", "bf16")
    with pytest.raises(ValueError, match="bin_width"):
        claims.fidelity_verdict(exceeds, one, "deepest", "fp32", bin_width=0)


def test_tail_verdict_needs_a_tail_to_remove():
    kl = np.zeros(80)
    kl[[0, 1, 5, 40]] = 0.5  # deepest plane: 4 tail positions in 3 prompts (2 positions each)
    frame = pd.DataFrame({"prompt": np.repeat(np.arange(40), 2), "position": np.tile([0, 1], 40), "arm": "deepest",
                          "kl": kl, "flip": False})
    window = frame.assign(arm="RIPE", kl=np.where(np.arange(80) == 0, 0.5, 0.0))
    both = pd.concat([frame, window])
    claim = claims.tail_claim(32, 0.1)
    assert claims.tail_verdict(claim, both, "RIPE", "deepest", range(40), 0.1).estimate == pytest.approx(0.25)
    none = pd.concat([frame.assign(kl=0.0), window.assign(kl=0.0)])
    v = claims.tail_verdict(claim, none, "RIPE", "deepest", range(40), 0.1)
    assert v.label == INCONCLUSIVE and "cannot discriminate" in v.reason
    # chapter 4 read "agrees" (0x [0, 0]) off one tail position: a resample without its prompt has no ratio
    one = frame.assign(kl=np.where(np.arange(80) == 0, 0.5, 0.0))
    v = claims.tail_verdict(claim, pd.concat([one, window.assign(kl=0.0)]), "RIPE", "deepest", range(40), 0.1)
    assert v.label == INCONCLUSIVE and "nonzero in 1 of 40 units" in v.reason
    four = frame.assign(kl=np.where(np.isin(np.arange(80), [0, 10, 20, 30]), 0.5, 0.0))  # 4 of 40: 1.5% missed
    v = claims.tail_verdict(claim, pd.concat([four, window.assign(kl=0.0)]), "RIPE", "deepest", range(40), 0.1)
    assert "nonzero in" not in v.reason


def test_block_dependence_against_the_pre_registered_threshold():
    """RIPE Sec. 5.2: a ratio like the paper's (1.37 [1.20, 1.62]) is no effect of the pre-registered size 2."""
    rng = np.random.default_rng(2)
    full = rng.lognormal(np.log(1e-4), 0.3, 40)
    paper_ratio = papers.RIPE_SEC_5_2["block dependence ratio"][0]
    assert claims.block_dependence_verdict(full * paper_ratio, full).label == NO_EFFECT
    assert claims.block_dependence_verdict(full * 10, full).label == AGREES
    with_nan = claims.block_dependence_verdict(np.r_[full * 10, np.nan], np.r_[full, 1.0])
    assert with_nan.n == 40
    exact = claims.block_dependence_verdict(full, np.zeros(40))  # float64: the full cache has no numerics to compare
    assert exact.label == INCONCLUSIVE and "block KLs" in exact.reason


def grid_rows(shallow_floor: bool = False, overlap: bool = True, b: float = 6.0, g: float = 2.0,
              floor: float = 1e-12, texts: int = 36, seed: int = 0) -> pd.DataFrame:
    """Arm rows of a region regression with known b and g: log KL = -4 + b [deep] + g log size."""
    rng = np.random.default_rng(seed)
    rows = []
    for text in range(texts):
        for region, deep in (("shallow", 0), ("deep", 1)):
            for plane, size in zip((1, 4, 8, 16, 24, 32), np.geomspace(3, 0.1, 6), strict=True):
                size = size * (1 if overlap or deep else 100) * np.exp(rng.normal(0, 0.05))
                kl = np.exp(-4 + b * deep + g * np.log(size) + rng.normal(0, 0.1))
                if shallow_floor and not deep:
                    kl = floor / 2
                rows.append({"text": text, "region": region, "plane": plane, "deep": deep, "size": size, "kl": kl})
    return pd.DataFrame(rows)


def test_e_b_is_fitted_only_where_the_regions_overlap_above_the_floor():
    found = claims.identify_sensitivity(grid_rows(), 1e-12, n_boot=200)
    assert found.identified and found.fit.b == pytest.approx(6.0, abs=0.2) and found.overlap is not None
    v = claims.text_b_verdict(found)
    assert v.label == AGREES and v.n == 36 and v.claim.minimum == papers.RIPE_TABLE_6_THRESHOLDS["deep coefficient b"]
    floored = claims.identify_sensitivity(grid_rows(shallow_floor=True), 1e-12)
    assert not floored.identified and "every shallow row sits at or below the float floor" in floored.reason
    apart = claims.identify_sensitivity(grid_rows(overlap=False), 1e-12)
    assert not apart.identified and "do not overlap" in apart.reason
    v = claims.text_b_verdict(apart)
    assert v.label == INCONCLUSIVE and v.blocked and "e^b is not identified" in v.reason
    with pytest.raises(ValueError, match="missing"):
        claims.identify_sensitivity(grid_rows().drop(columns="plane"), 1e-12)
    # e^b identified across texts, but no text with 2 planes in each region (bf16: most rows at the floor)
    thin = replace(found, rows=found.rows.groupby(["text", "region"]).head(1))
    v = claims.text_b_verdict(thin)
    assert v.label == INCONCLUSIVE and v.n == 0 and "no text has identifying rows of 2 or more planes" in v.reason


def test_eq6_per_text_within_a_factor_of_two():
    rng = np.random.default_rng(3)
    sizes = rng.uniform(0.01, 0.05, 36)
    predicted = np.exp(-3.0) * sizes ** 2.5

    def check(measured: np.ndarray) -> Eq6Check:
        return Eq6Check(from_curve=1.0, from_size=1.0, S_curve=0.02, S_measured=sizes, measured=measured,
                        shallow_only=None)

    fitted = (0.005, 0.1)  # the sizes the line was fitted on: the texts' sizes lie within them
    assert claims.eq6_verdict(check(predicted * rng.uniform(1.1, 1.4, 36)), -3.0, 2.5, 1e-12, fitted).label == AGREES
    assert claims.eq6_verdict(check(predicted * 120), -3.0, 2.5, 1e-12, fitted).label == DISAGREES
    floored = claims.eq6_verdict(check(np.full(36, 1e-13)), -3.0, 2.5, 1e-12, fitted)
    assert floored.label == INCONCLUSIVE and "float floor" in floored.reason
    assert claims.EQ6.minimum == papers.RIPE_SEC_3_2_EQ_6_FACTOR
    with pytest.raises(ValueError, match="finite"):
        claims.eq6_verdict(check(predicted), float("nan"), 2.5, 1e-12, fitted)
    with pytest.raises(ValueError, match="fitted_sizes"):
        claims.eq6_verdict(check(predicted), -3.0, 2.5, 1e-12, (0.1, 0.01))


def test_eq6_does_not_extrapolate_the_line_beyond_its_sizes():
    """Chapter 3's "disagrees, 238x" applied a line fitted at sizes 0.38-2.8 (planes 1 and 4) to texts at sizes
    near 1e-3: the verdict must refuse to extrapolate."""
    sizes = np.random.default_rng(4).uniform(5e-4, 2e-3, 36)
    far = Eq6Check(from_curve=1.0, from_size=1.0, S_curve=1e-3, S_measured=sizes,
                   measured=np.exp(-3.0) * sizes**2.5 * 238, shallow_only=None)
    v = claims.eq6_verdict(far, -3.0, 2.5, 1e-12, (0.38, 2.8))
    assert v.label == INCONCLUSIVE and "extrapolate" in v.reason


def test_mature_v_over_aligned_is_das_table_6s_comparison():
    claim = claims.MATURE_V_OVER_ALIGNED
    assert claim.expects == "greater" and "Table 6" in claim.source and "47% to 67%" in claim.source


def test_chapter_7s_model_checks_state_their_n():
    # peaks that are the cache alone: the fitted o0 and o1 are exactly 0 whatever the BLAS's rounding, so the
    # model is exact (a least-squares fit of other lines is exact only up to the BLAS's last bits)
    cache_only = [MemoryCell(b, 200 * b, 200 * b) for b in (1, 2, 3, 4, 5, 6)]
    memory = {"full": (cache_only, check_memory_model(cache_only, fit_on=[1, 2], budget=5000.0)),
              "deepest": (cache_only, check_memory_model(cache_only, fit_on=[1, 2], budget=5000.0))}
    exact = claims.memory_model_verdict(memory)
    assert exact.label == IDENTICAL and exact.n == 8
    cells = [MemoryCell(b, 1000 + 300 * b, 200 * b) for b in (1, 2, 3, 4, 5, 6)]
    fit = ThroughputFit(a=0.1, b=0.01, max_relative_residual=0.0)
    measured = [ThroughputCell(b, float(fit.predict(b)) * 1.47, 1.0, 10, 1.0) for b in (12,)]
    miss = claims.throughput_verdict({"deepest": fit}, {"deepest": measured}, fitted_up_to=8, repeats=2)
    assert miss.label == INCONCLUSIVE and miss.n == 1 and "too few units (1 held-out batches" in miss.reason
    assert miss.estimate == pytest.approx(1.47)
    with pytest.raises(ValueError, match="no fitted series"):
        claims.throughput_verdict({"deepest": None}, {"deepest": measured}, fitted_up_to=8, repeats=2)
    check = check_memory_model(cells, fit_on=[1, 2], budget=5000.0)
    cells = {f"full@{check.b_max}": ThroughputCell(check.b_max, 10.0, 1.0, 10, 2.0),
             f"deepest@{check.b_max}": ThroughputCell(check.b_max, 24.0, 1.0, 10, 2.0)}
    comparison = FixedMemoryComparison(5000.0, {"full": check, "deepest": check}, cells,
                                       fixed_memory_factors(10.0, 24.0, 24.0), (cells,))
    gain = claims.fixed_memory_verdict(comparison, repeats=2)
    assert gain.label == INCONCLUSIVE and gain.estimate == pytest.approx(2.4) and gain.n == 1
    # chapter 7 compared one set of prompts (n = 1): each of 16 sets is a unit, and the gain can be decided
    rng = np.random.default_rng(0)
    sets = tuple({f"full@{check.b_max}": ThroughputCell(check.b_max, float(10 + rng.normal()), 1.0, 10, 2.0),
                  f"deepest@{check.b_max}": ThroughputCell(check.b_max, float(24 + rng.normal()), 1.0, 10, 2.0)}
                 for _ in range(16))
    gain = claims.fixed_memory_verdict(replace(comparison, by_set=sets), repeats=2)
    assert gain.n == 16 and gain.label == AGREES
    assert gain.claim.minimum == papers.RIPE_TABLE_6_THRESHOLDS["fixed-memory gain of one shared slot"]
