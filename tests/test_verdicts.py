"""The one verdict rule: enough units, identical arms, a BCa interval, the label against the claim's smallest
effect (agrees, disagrees, no effect of that size, inconclusive), ceilings, and the tables that summarise a chapter.

Each rule has a test that fails on the verdict function before it (commit ff195e7), which had no unit rule for
timing, no smallest effect, no "identical" and voided every effect near a ceiling.
"""

from __future__ import annotations

import numpy as np
import pytest

from looped_kv import papers
from looped_kv.analysis.verdicts import (
    AGREES,
    BCA,
    DISAGREES,
    IDENTICAL,
    INCONCLUSIVE,
    MIN_UNITS,
    NO_EFFECT,
    Claim,
    Verdict,
    above_floor,
    bca_interval,
    below_ceiling,
    claim_summary,
    combined,
    discrimination,
    distinct,
    enough_units,
    interval_label,
    interval_table,
    model_check,
    precision,
    tally,
    varies,
    verdict,
    verdict_table,
)

GREATER = Claim("A beats B", "Paper Table 1", minimum=0.1, minimum_source="the test's smallest effect")
LESS = Claim("A is below B", "Paper Table 1", expects="less", minimum=0.1, minimum_source="the test's")
NONE = Claim("A equals B", "Paper Table 1", expects="none", minimum=0.1, minimum_source="the test's")


def paired(shift: float, n: int = 40, seed: int = 0, noise: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    b = rng.normal(3.0, 1.0, n)  # prompts differ a lot; the pairing removes that
    return b + shift + rng.normal(0, noise, n), b


def test_an_effect_beyond_the_minimum_agrees_or_disagrees_by_the_claims_direction():
    a, b = paired(0.5)
    v = verdict(GREATER, a, b)
    assert v.label == AGREES and v.low > GREATER.minimum and v.low < v.estimate < v.high and v.n == 40
    assert v.estimate == pytest.approx(np.mean(a - b))
    assert verdict(LESS, a, b).label == DISAGREES


def test_a_tiny_effect_below_the_minimum_is_not_agrees():
    """Chapter 1 "agreed" that loops lower the loss on a gain of 0.008 nats; the gate for the same claim is 0.05."""
    a, b = paired(0.03, noise=0.02)
    v = verdict(GREATER, a, b)
    assert v.low > 0  # significant in the paper's direction ...
    assert v.label == NO_EFFECT and "inside the no-effect band" in v.reason  # ... but smaller than what counts


def test_an_interval_across_an_edge_of_the_band_is_inconclusive():
    a, b = paired(0.1, noise=0.1)
    v = verdict(GREATER, a, b)
    assert v.low < GREATER.minimum < v.high and v.label == INCONCLUSIVE
    a, b = paired(0.0, noise=0.5)
    v = verdict(GREATER, a, b)
    assert v.low < 0 < v.high and v.label == INCONCLUSIVE and "contains no difference" in v.reason


def test_equal_arms_are_identical():
    _, b = paired(0.0)
    v = verdict(GREATER, b, b.copy())
    assert v.label == IDENTICAL and (v.estimate, v.low, v.high) == (0.0, 0.0, 0.0)
    ratio = Claim("x", "y", scale="log-ratio", minimum=2, minimum_source="z")
    assert verdict(ratio, np.exp(b), np.exp(b)).label == IDENTICAL
    assert verdict(GREATER, np.zeros(40), null=0.0).label == IDENTICAL


def test_four_units_give_no_agree_or_disagree():
    """Chapter 5 printed "agrees" on 4 timed prompts: a percentile bootstrap over 4 units has 35 distinct resamples."""
    a, b = paired(2.0, n=4)
    for claim in (GREATER, LESS):
        v = verdict(claim, a, b)
        assert v.label == INCONCLUSIVE and v.n == 4 and v.reason.startswith("too few units (4 prompts")
    assert verdict(GREATER, *paired(2.0, n=MIN_UNITS["paired"])).label == AGREES
    assert verdict(GREATER, *paired(2.0, n=MIN_UNITS["paired"] - 1)).label == INCONCLUSIVE


def test_a_timing_verdict_needs_16_prompts_each_timed_in_interleaved_repeats():
    a, b = paired(2.0, n=16)
    assert verdict(GREATER, a, b, kind="timing", repeats=2).label == AGREES
    once = verdict(GREATER, a, b, kind="timing", repeats=1)
    assert once.label == INCONCLUSIVE and "timed once each" in once.reason
    few = verdict(GREATER, a[:15], b[:15], kind="timing", repeats=3, units="timed prompts")
    assert few.label == INCONCLUSIVE and "too few units (15 timed prompts" in few.reason
    with pytest.raises(ValueError, match="kind must be one of"):
        enough_units(3, kind="speed")


def test_every_verdict_states_its_n_its_interval_method_and_its_smallest_effect():
    v = verdict(GREATER, *paired(0.5), units="texts")
    text = v.sentence()
    assert "over 40 texts" in text and BCA in text and "smallest effect that counts: 0.1" in text
    assert "the test's smallest effect" in text and v.row()["n"] == 40 and v.row()["smallest effect"] == "0.1"
    ratio = Claim("x", "y", scale="log-ratio", minimum=2, minimum_source="z")
    assert "a factor of 2" in verdict(ratio, np.full(40, 3.0), np.full(40, 1.0)).sentence()
    assert Claim("x", "y", scale="log-ratio", minimum=1.1, minimum_source="z").minimum_text == "a factor of 1.1 (10%)"
    assert Claim("x", "y", scale="log-ratio", minimum=1.0015, minimum_source="z").minimum_text.endswith("(0.15%)")


def test_claims_of_no_effect():
    a, b = paired(0.0, noise=0.02)
    assert verdict(NONE, a, b).label == AGREES
    assert verdict(NONE, *paired(0.5)).label == DISAGREES
    assert verdict(NONE, *paired(0.1, noise=0.1)).label == INCONCLUSIVE


def test_a_ceiling_does_not_void_an_effect_in_the_papers_direction():
    """Chapter 4's deepest plane beat the full cache significantly, yet was "inconclusive" for its ceiling."""
    a, b = paired(0.5)
    near = below_ceiling(np.full(40, 4.9), 5.0, "tau of A", floor=1)
    v = verdict(GREATER, a, b, discrimination=discrimination(near))
    assert v.label == AGREES and "note: tau of A is 4.9, within 5% of its ceiling 5" in v.reason


def test_no_effect_next_to_a_ceiling_is_inconclusive():
    a, b = paired(0.0, noise=0.02)
    near = below_ceiling(np.full(40, 4.9), 5.0, "tau of B", floor=1)
    v = verdict(GREATER, a, b, discrimination=discrimination(near))
    assert v.label == INCONCLUSIVE and v.reason.startswith("cannot discriminate") and v.blocked
    # below the margin, but with less room to the ceiling than the smallest effect
    short = below_ceiling(np.full(40, 4.7), 5.0, "tau of B", floor=1)
    claim = Claim("x", "y", minimum=0.5, minimum_source="z")
    v = verdict(claim, a, b, discrimination=discrimination(short))
    assert short.passed and v.label == INCONCLUSIVE and "room for 0.3" in v.reason


def test_a_failed_blocking_check_is_inconclusive_whatever_the_interval():
    a, b = paired(0.5)
    v = verdict(GREATER, a, b, discrimination=discrimination(varies([1.0, 1.0], "the table")))
    assert v.label == INCONCLUSIVE and v.reason.startswith("cannot discriminate on this model")
    assert "every value of the table is 1" in v.reason


def test_log_ratio_claims_report_the_geometric_mean_ratio():
    rng = np.random.default_rng(1)
    b = rng.uniform(1, 2, 50)
    a = b * 1.5 * np.exp(rng.normal(0, 0.05, 50))
    claim = Claim("faster", "DAS Table 1", scale="log-ratio", minimum=1.1, minimum_source="z")
    v = verdict(claim, a, b)
    assert v.label == AGREES and v.null == 1.0
    assert v.estimate == pytest.approx(float(np.exp(np.mean(np.log(a / b)))))
    assert v.low < 1.5 < v.high
    assert verdict(claim, b * 1.05, b).label == NO_EFFECT  # 5% faster, below the 10% that counts


def test_ratio_of_means_reproduces_the_papers_tail_ratio():
    """RIPE Sec. 5.1: W = 64 keeps 1 of the deepest plane's 9 tail positions, ratio 0.11 [0.00, 0.20]."""
    section, table4 = papers.RIPE_SEC_5_1, papers.RIPE_TABLE_4
    total, kept = table4["deepest plane (W = 0)"][0], table4["RIPE, W = 64"][0]
    in_one = section["tail positions in one problem"]
    deepest = np.zeros(papers.RIPE_TABLE_4_SETUP["prompts"])
    deepest[:section["tail prompts"]] = [in_one, total - in_one - 2, 1, 1]
    window = np.zeros_like(deepest)
    window[0] = kept
    claim = Claim("most removed", "RIPE Sec. 5.1", expects="less", scale="ratio of means", minimum=2,
                  minimum_source="z")
    v = verdict(claim, window, deepest)
    estimate, low, high = section["tail ratio W = 64"]
    assert (round(v.estimate, 2), round(v.low, 2), round(v.high, 2)) == (estimate, low, high)
    assert v.label == AGREES
    blocked = verdict(claim, window, np.zeros_like(deepest))
    assert blocked.label == INCONCLUSIVE and "every value of the reference is 0" in blocked.reason


def test_the_interval_holds_at_the_books_sample_sizes():
    """BCa coverage of a skewed mean at n = 32 stays near 95% (seeded: the test is deterministic)."""
    rng = np.random.default_rng(7)
    truth = np.exp(0.5)  # mean of a lognormal(0, 1)
    covered = 0
    for seed in range(150):
        x = rng.lognormal(0.0, 1.0, 32)
        _, low, high = bca_interval(np.column_stack([x, np.zeros(32)]), lambda d: (d[..., 0] - d[..., 1]).mean(-1),
                                    n_boot=2000, seed=seed)
        covered += low <= truth <= high
    assert covered / 150 >= 0.88


def test_one_arm_against_a_fixed_value():
    rates = np.full(40, 0.6) + np.random.default_rng(2).normal(0, 0.05, 40)
    assert verdict(LESS, rates, null=1.0).label == AGREES
    assert verdict(GREATER, rates, null=0.6).label == NO_EFFECT


def test_the_interval_and_label_are_reproducible_from_the_seed():
    a, b = paired(0.05, n=32)
    assert verdict(GREATER, a, b, seed=3) == verdict(GREATER, a, b, seed=3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"a": [], "b": []}, "a must hold at least 1"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0, 3.0]}, "must be paired"),
    ({"a": [1.0, np.nan], "b": [1.0, 2.0]}, "a must be finite"),
    ({"a": [1.0, 2.0]}, "needs null"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0], "null": 0.0}, "either b"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0], "level": 1.5}, "level must lie in"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0], "n_boot": 10}, "n_boot must be"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0], "kind": "quick"}, "kind must be one of"),
])
def test_bad_input_is_refused_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        verdict(GREATER, **kwargs)


def test_ratio_claims_need_their_measurements():
    with pytest.raises(ValueError, match="positive"):
        verdict(Claim("x", "y", scale="log-ratio", minimum=2, minimum_source="z"), [1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=">= 0"):
        verdict(Claim("x", "y", scale="ratio of means", minimum=2, minimum_source="z"), [1.0, -1.0], [1.0, 1.0])


def test_claims_check_their_fields():
    with pytest.raises(ValueError, match="expects must be"):
        Claim("x", "y", expects="bigger", minimum=0.1, minimum_source="z")
    with pytest.raises(ValueError, match="scale must be"):
        Claim("x", "y", scale="ratio", minimum=0.1, minimum_source="z")
    with pytest.raises(ValueError, match="factor > 1"):
        Claim("x", "y", scale="log-ratio", minimum=0.5, minimum_source="z")
    with pytest.raises(ValueError, match="difference > 0"):
        Claim("x", "y", minimum=0.0, minimum_source="z")
    with pytest.raises(ValueError, match="minimum_source"):
        Claim("x", "y", minimum=0.1, minimum_source="")
    with pytest.raises(TypeError):
        Claim("x", "y")  # every claim carries its smallest effect


def test_discrimination_checks():
    assert enough_units(32).passed and not enough_units(31).passed
    gamma = 4
    assert below_ceiling([3.0, 3.5], gamma + 1, "tau", floor=1).passed
    low = below_ceiling([5.0, 4.9], gamma + 1, "tau", floor=1)
    assert not low.passed and low.kind == "ceiling" and low.room == pytest.approx(0.05)
    assert varies([1.0, 1.0, 1.1], "table").passed and not varies([1.0, 1.0, 1.0], "table").passed
    assert above_floor([1e-3, 1e-2, 1e-9], 1e-6, "KLs", minimum=0.5).passed
    assert not above_floor([1e-9, 1e-8, 1e-2], 1e-6, "KLs", minimum=0.5).passed
    both = discrimination(enough_units(10)) + discrimination(varies([1, 1], "t"))
    assert not both.ok and "too few units (10 prompts" in both.reason and "every value of t" in both.reason


def test_combined_parts_follow_the_papers_rule():
    """RIPE Sec. 5.1: "exceeds a precision change" through a single bin; "indistinguishable" needs every bin."""
    ratio = Claim("exceeds", "RIPE Sec. 5.1", scale="ratio of means", minimum=2, minimum_source="z")
    rng = np.random.default_rng(4)
    ref = rng.uniform(1, 2, 40)
    flat = verdict(ratio, ref * rng.uniform(0.95, 1.05, 40), ref)
    tail = verdict(ratio, ref * 10, ref)
    assert (flat.label, tail.label) == (NO_EFFECT, AGREES)
    one = combined(ratio, {"bin 0": flat, "bin 1": tail, "bin 2": flat})
    assert one.label == AGREES and one.estimate == tail.estimate and len(one.parts) == 3
    assert "deciding part bin 1" in one.reason
    assert combined(ratio, {"bin 0": flat, "bin 1": flat}).label == NO_EFFECT
    none = Claim("indistinguishable", "RIPE Sec. 5.1", expects="none", scale="ratio of means", minimum=2,
                 minimum_source="z")
    parts = {"bin 0": verdict(none, ref, ref * 1.01), "bin 1": verdict(none, ref * 10, ref)}
    assert combined(none, parts).label == DISAGREES
    assert combined(none, {"bin 0": parts["bin 0"]}).label == AGREES
    with pytest.raises(ValueError, match="same claim"):
        combined(none, {"bin 0": flat})


def test_model_check_needs_every_cell_inside_the_band():
    claim = Claim("predicts", "RIPE Sec. 3.5", expects="none", scale="log-ratio", minimum=1.0015, minimum_source="z")
    predicted = np.array([10.0, 20.0, 30.0, 40.0, 50.0])
    assert model_check(claim, predicted, predicted).label == IDENTICAL
    assert model_check(claim, predicted, predicted * 1.001).label == AGREES
    off = predicted.copy()
    off[2] *= 1.01
    v = model_check(claim, predicted, off)
    assert v.label == DISAGREES and "1 of the 5 held-out cells" in v.reason
    few = model_check(claim, predicted[:4], predicted[:4])
    assert few.label == INCONCLUSIVE and "too few units (4 held-out cells" in few.reason
    with pytest.raises(ValueError, match="expect no effect"):
        model_check(GREATER, predicted, predicted)


def test_repeats_are_dropped():
    """Chapter 4's "RIPE beats full" repeated "deepest beats full" number for number."""
    a, b = paired(0.5)
    first = verdict(GREATER, a, b)
    again = verdict(Claim("C beats B", "Paper Table 2", minimum=0.1, minimum_source="z"), a.copy(), b.copy())
    other = verdict(GREATER, *paired(0.5, seed=1))
    kept, repeats = distinct({"A vs B": first, "C vs B": again, "D vs B": other})
    assert list(kept) == ["A vs B", "D vs B"] and repeats == {"C vs B": "A vs B"}


def test_tables_and_tally_summarise_a_chapter():
    a, b = paired(0.5)
    found = {"clear": verdict(GREATER, a, b), "reversed": verdict(LESS, a, b),
             "small": verdict(GREATER, *paired(0.01, noise=0.01)), "same": verdict(GREATER, b, b),
             "blocked": verdict(GREATER, a[:3], b[:3])}
    table = interval_table(found)
    assert list(table.columns) == ["verdict", "estimate [interval]", "n", "smallest effect", "source", "why"]
    assert table.loc["clear", "estimate [interval]"] == found["clear"].estimate_text
    assert list(verdict_table(found)["verdict"]) == [AGREES, DISAGREES, NO_EFFECT, IDENTICAL, INCONCLUSIVE]
    assert tally(found, "the model", "the paper") == (
        "Of 5 claims on the model, 1 agrees with the paper, 1 disagrees, 1 finds no effect of the size that counts, "
        "1 compares identical arms and 1 is inconclusive; 1 of these because the measurement cannot discriminate on "
        "this model (blocked).")


def test_a_chapters_table_and_tally_count_a_repeated_verdict_once():
    """Chapter 3 counted "share every 8 loops over first 4 loops" beside "deepest plane over first 4 loops", the
    same texts and numbers under two names."""
    a, b = paired(0.5)
    found = {"deepest over first 4": verdict(GREATER, a, b), "share-8 over first 4": verdict(GREATER, a.copy(), b),
             "other": verdict(GREATER, *paired(0.5, seed=1))}
    assert list(interval_table(found).index) == ["deepest over first 4", "other"]
    assert tally(found, "the model", "the paper").startswith("Of 2 claims on the model, 2 agree with the paper")
    assert tally(found, "the model", "the paper").endswith(
        " “share-8 over first 4” repeats “deepest over first 4” number for number and is counted once.")


# -- more uncertainty never gives a stronger label (issue 40, item 7) ----------------------------------------------

BAND = Claim("A beats B", "Paper Table 1", minimum=0.05, minimum_source="the issue's smallest effect")


def test_disagrees_needs_the_whole_interval_beyond_the_smallest_effect():
    """Issue 40's pair: the narrower interval read "no effect of that size", the wider one "disagrees"."""
    assert interval_label(BAND, -0.047, -0.011)[0] == NO_EFFECT
    label, reason = interval_label(BAND, -0.056, -0.010)  # the issue's -0.054 moved off a printed value
    assert label == INCONCLUSIVE and "reaches into the no-effect band" in reason
    assert interval_label(BAND, -0.08, -0.05)[0] == DISAGREES
    ratio = Claim("faster", "DAS Table 1", scale="log-ratio", minimum=1.1, minimum_source="z")
    assert interval_label(ratio, 0.85, 0.95)[0] == INCONCLUSIVE  # below 1, but not wholly below 1 / 1.1
    assert interval_label(ratio, 0.80, 0.90)[0] == DISAGREES


def test_an_interval_against_the_claim_that_reaches_into_the_band_is_inconclusive():
    a, b = paired(-0.1, noise=0.1)
    v = verdict(GREATER, a, b)
    assert v.high < 0 and v.low < -GREATER.minimum < v.high
    assert v.label == INCONCLUSIVE and "against the paper's direction" in v.reason
    assert verdict(LESS, b, a).label == INCONCLUSIVE
    assert verdict(GREATER, *paired(-0.5)).label == DISAGREES


@pytest.mark.parametrize("claim", [GREATER, LESS, NONE,
                                   Claim("x", "y", scale="log-ratio", minimum=1.1, minimum_source="z"),
                                   Claim("x", "y", expects="less", scale="ratio of means", minimum=2,
                                         minimum_source="z")], ids=lambda c: f"{c.expects}-{c.scale}")
def test_a_wider_interval_never_gets_a_stronger_label(claim):
    """Widening an interval about its centre keeps its label or makes it inconclusive: label strength is monotone
    non-increasing in width (an interval that contains another is never more decisive)."""
    rng = np.random.default_rng(40)
    m = claim.band
    centre = rng.uniform(-3 * m, 3 * m, 4000)
    half = rng.uniform(0, 2 * m, 4000)
    wider = half * rng.uniform(1, 4, 4000)
    to_scale = np.exp if claim.ratio else (lambda x: x)
    seen = set()
    for c, h, w in zip(centre, half, wider, strict=True):
        narrow = interval_label(claim, to_scale(c - h), to_scale(c + h))[0]
        wide = interval_label(claim, to_scale(c - w), to_scale(c + w))[0]
        assert wide in (narrow, INCONCLUSIVE), (c - h, c + h, narrow, c - w, c + w, wide)
        seen.add(narrow)
    assert seen >= {AGREES, DISAGREES, INCONCLUSIVE}  # the draws reach every label the claim can give


# -- verdicts a reader can see (issue 40, item 4) ------------------------------------------------------------------


def test_precision_follows_the_interval():
    assert precision(0.27, 0.56) == 2  # half-width 0.145: two significant digits
    assert precision(-0.047, -0.011) == 3  # 0.018
    assert precision(1.15, 1.23) == 2  # 0.04: one significant digit
    assert precision(250.0, 320.0) == 0  # 35: never below 0 decimals
    assert precision(0.9998, 1.0010) == 4
    assert precision(1.0, 1.0) is None and precision(0.0, np.inf) is None


@pytest.mark.parametrize(("estimate", "low", "high", "scale", "text"), [
    (0.4613, 0.2712, 0.5623, "difference", "+0.46 [0.27, 0.56]"),
    (-0.0321, -0.056, -0.0103, "difference", "-0.032 [-0.056, -0.010]"),
    (1234.5, 1100.0, 1390.0, "difference", "+1,234 [1,100, 1,390]"),
    (1.2e-7, 5e-8, 2e-7, "difference", "+1.2e-07 [5.0e-08, 2.0e-07]"),  # past MAX_DECIMALS: significant digits
    (1.1912, 1.1534, 1.2302, "log-ratio", "1.19x [1.15, 1.23]"),
    (1.00005, 1.000012, 1.000092, "log-ratio", "1.00005x [1.00001, 1.00009]"),  # near 1, precision kept
    (0.11, 0.0, 0.2, "ratio of means", "0.11x [0.00, 0.20]"),
    (-0.0004, -0.05, 0.04, "difference", "0.00 [-0.05, 0.04]"),  # no "-0.00", no "+0.00"
])
def test_numbers_are_written_to_their_precision(estimate, low, high, scale, text):
    claim = Claim("x", "y", scale=scale, minimum=1.1 if scale != "difference" else 0.1, minimum_source="z")
    v = Verdict(claim, estimate, low, high, 40, AGREES, "")
    assert v.estimate_text == text and v.short == f"agrees: {text}, n = 40"


def test_a_verdict_reads_as_one_short_line():
    v = verdict(GREATER, *paired(0.43, n=48, noise=0.5))
    decimals = precision(v.low, v.high)
    assert v.short == f"agrees: +{v.estimate:.{decimals}f} [{v.low:.{decimals}f}, {v.high:.{decimals}f}], n = 48"
    reversed_ = verdict(LESS, *paired(0.43, n=48, noise=0.5))
    assert reversed_.short.startswith("disagrees: +")
    below = verdict(GREATER, *paired(-0.5))
    assert below.short.startswith("disagrees: -") and ", n = 40" in below.short
    rng = np.random.default_rng(1)
    b = rng.uniform(1, 2, 50)
    ratio = verdict(Claim("faster", "DAS Table 1", scale="log-ratio", minimum=1.1, minimum_source="z"),
                    b * 1.19 * np.exp(rng.normal(0, 0.05, 50)), b)
    d = precision(ratio.low, ratio.high)
    assert ratio.short == f"agrees: {ratio.estimate:.{d}f}x [{ratio.low:.{d}f}, {ratio.high:.{d}f}], n = 50"
    same = verdict(GREATER, np.zeros(40), null=0.0)
    assert same.short == "identical: 0 [0, 0], n = 40"  # no "+0", no "-0"


def test_a_claim_is_said_once_with_one_line_per_workload():
    found = {"problems": verdict(GREATER, *paired(0.5)), "code": verdict(GREATER, *paired(0.5, seed=1)),
             "chains": verdict(GREATER, *paired(0.5, n=4)), "other claim": verdict(LESS, *paired(0.5))}
    text = claim_summary(found)
    assert text.count(GREATER.statement) == 1 and text.count(GREATER.minimum_source) == 1
    assert text.count("Paper Table 1") == 2  # once per claim, not per workload
    assert f"- problems: {found['problems'].short}\n" in text
    assert f"- chains: {found['chains'].short} (too few units (4 prompts" in text
    assert "- code: " in text and f"- other claim: {found['other claim'].short}" in text
    assert text.startswith("**A beats B** (Paper Table 1; smallest effect that counts: 0.1, the test's smallest "
                           "effect; 95% BCa bootstrap intervals over prompts)\n\n- problems: ")


def test_verdict_tables_put_the_verdict_first():
    found = {"clear": verdict(GREATER, *paired(0.5))}
    assert verdict_table(found).columns[0] == "verdict"
    assert interval_table(found).columns[0] == "verdict"
