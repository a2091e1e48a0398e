"""The one verdict function: three labels from paired bootstrap intervals, and the discrimination checks."""

from __future__ import annotations

import numpy as np
import pytest

from looped_kv.analysis.verdicts import (
    AGREES,
    CEILING_MARGIN,
    DISAGREES,
    INCONCLUSIVE,
    Claim,
    above_floor,
    below_ceiling,
    discrimination,
    enough_units,
    interval_table,
    tally,
    varies,
    verdict,
    verdict_table,
)

GREATER = Claim("A beats B", "Paper Table 1")
LESS = Claim("A is below B", "Paper Table 1", expects="less")


def paired(shift: float, n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    b = rng.normal(3.0, 1.0, n)  # prompts differ a lot; the pairing removes that
    return b + shift + rng.normal(0, 0.1, n), b


def test_a_clear_difference_agrees_or_disagrees_by_the_claims_direction():
    a, b = paired(0.3)
    assert verdict(GREATER, a, b).label == AGREES
    assert verdict(LESS, a, b).label == DISAGREES
    v = verdict(GREATER, a, b)
    assert v.low > 0 and v.low < v.estimate < v.high and v.n == 40
    assert v.estimate == pytest.approx(np.mean(a - b))


def test_no_difference_is_inconclusive():
    a, b = paired(0.0)
    v = verdict(GREATER, a, b)
    assert v.label == INCONCLUSIVE and v.low < 0 < v.high
    assert "contains no difference" in v.reason


def test_the_pairing_is_kept():
    """The spread between prompts (sd 1) would swamp a 0.3 shift if the arms were resampled separately."""
    a, b = paired(0.3, n=32)
    v = verdict(GREATER, a, b)
    assert v.high - v.low < 0.2


def test_an_experiment_that_cannot_discriminate_is_inconclusive_whatever_its_interval():
    a, b = paired(0.3)
    checks = discrimination(enough_units(40), below_ceiling([5.0, 4.99], 5.0, "tau"))
    v = verdict(GREATER, a, b, discrimination=checks)
    assert v.label == INCONCLUSIVE
    assert v.reason.startswith("cannot discriminate on this model") and "tau is 5" in v.reason
    assert verdict(GREATER, a, b, discrimination=discrimination(enough_units(40))).label == AGREES


def test_log_ratio_claims_report_the_geometric_mean_ratio():
    rng = np.random.default_rng(1)
    b = rng.uniform(1, 2, 50)
    a = b * 1.5 * np.exp(rng.normal(0, 0.05, 50))
    v = verdict(Claim("faster", "DAS Table 1", scale="log-ratio"), a, b)
    assert v.label == AGREES and v.null == 1.0
    assert v.estimate == pytest.approx(float(np.exp(np.mean(np.log(a / b)))))
    assert v.low < 1.5 < v.high


def test_one_arm_against_a_fixed_value():
    rates = np.full(40, 0.6) + np.random.default_rng(2).normal(0, 0.05, 40)
    assert verdict(LESS, rates, null=1.0).label == AGREES
    assert verdict(GREATER, rates, null=0.6).label == INCONCLUSIVE


def test_the_interval_and_label_are_reproducible_from_the_seed():
    a, b = paired(0.05, n=32)
    assert verdict(GREATER, a, b, seed=3) == verdict(GREATER, a, b, seed=3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"a": [1.0], "b": [1.0]}, "a must hold at least 2"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0, 3.0]}, "must be paired"),
    ({"a": [1.0, np.nan], "b": [1.0, 2.0]}, "a must be finite"),
    ({"a": [1.0, 2.0]}, "needs null"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0], "null": 0.0}, "either b"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0], "level": 1.5}, "level must lie in"),
    ({"a": [1.0, 2.0], "b": [1.0, 2.0], "n_boot": 10}, "n_boot must be"),
])
def test_bad_input_is_refused_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        verdict(GREATER, **kwargs)


def test_log_ratio_needs_positive_values():
    with pytest.raises(ValueError, match="positive"):
        verdict(Claim("x", "y", scale="log-ratio"), [1.0, 0.0], [1.0, 1.0])


def test_claims_check_their_fields():
    with pytest.raises(ValueError, match="expects must be"):
        Claim("x", "y", expects="bigger")
    with pytest.raises(ValueError, match="scale must be"):
        Claim("x", "y", scale="ratio")


def test_discrimination_checks():
    assert enough_units(32).passed and not enough_units(31).passed
    gamma = 4
    assert below_ceiling([3.0, 3.5], gamma + 1, "tau", floor=1).passed
    assert not below_ceiling([5.0, 4.9], gamma + 1, "tau", floor=1).passed
    edge = gamma + 1 - CEILING_MARGIN * gamma
    assert below_ceiling([edge], gamma + 1, "tau", floor=1).passed
    assert varies([1.0, 1.0, 1.1], "table").passed and not varies([1.0, 1.0, 1.0], "table").passed
    assert above_floor([1e-3, 1e-2, 1e-9], 1e-6, "KLs", minimum=0.5).passed
    assert not above_floor([1e-9, 1e-8, 1e-2], 1e-6, "KLs", minimum=0.5).passed
    both = discrimination(enough_units(10)) + discrimination(varies([1, 1], "t"))
    assert not both.ok and "10 prompts" in both.reason and "every value of t" in both.reason


def test_verdict_table_has_one_row_per_verdict():
    a, b = paired(0.3)
    table = verdict_table({"x": verdict(GREATER, a, b), "y": verdict(LESS, a, b)})
    assert list(table.index) == ["x", "y"] and list(table["verdict"]) == [AGREES, DISAGREES]


def test_interval_table_and_tally_summarise_a_chapter():
    a, b = paired(0.5)
    found = {"clear": verdict(GREATER, a, b), "reversed": verdict(LESS, a, b),
             "blocked": verdict(GREATER, a, b, discrimination=discrimination(enough_units(3)))}
    table = interval_table(found)
    assert list(table.columns) == ["source", "estimate [95% interval]", "n", "verdict", "why"]
    assert table.loc["clear", "estimate [95% interval]"] == "difference " + found["clear"].interval()
    assert tally(found, "the model", "the paper") == (
        "Of 3 claims on the model, 1 agrees with the paper, 1 disagrees and 1 is inconclusive; "
        "1 of these because the measurement cannot discriminate on this model (blocked).")
