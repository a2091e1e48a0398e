"""RIPE Sections 3.3-3.5: the acceptance, cost, memory and throughput models against the paper's numbers.

Every check computes from the paper's printed inputs and compares with its printed outputs at printed
precision; where the printed inputs are themselves rounded, the check asks that some inputs inside their
rounding intervals reproduce every printed output (see the ``looped_kv.analysis.perf`` docstring).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from looped_kv.analysis.perf import (
    TABLE9_ALPHA,
    TABLE9_REJECTION,
    acceptance_tau,
    b_max,
    figure_5b_alphas,
    fit_eta,
    fit_peak_memory,
    fit_rejection,
    fit_throughput,
    fixed_memory_factors,
    layer_passes,
    peak_memory,
    printed_interval,
    rejection_model,
    rounds_to,
    speedup,
    speedup_curves,
    tau_for_speedup,
    throughput,
)
from looped_kv.runtime.config import huginn_0125
from looped_kv.runtime.memory import m_deep, m_full

HUGINN = huginn_0125()
GB = 1e9


# -- helpers ------------------------------------------------------------------------------------------


def test_rounds_to_and_printed_interval():
    assert printed_interval(2.24, 2) == pytest.approx((2.235, 2.245))
    assert rounds_to(2.2449, 2.24, 2) and rounds_to(2.235, 2.24, 2)
    assert not rounds_to(2.2451, 2.24, 2)
    np.testing.assert_array_equal(rounds_to([1.98, 1.99], 1.98, 2), [True, False])
    with pytest.raises(ValueError, match="decimals"):
        printed_interval(1.0, -1)


# -- acceptance (Eq. 7, Table 9) --------------------------------------------------------------------


def test_acceptance_tau_is_the_geometric_sum():
    alpha = np.array([0.0, 0.3, 0.805, 0.999, 1.0])[:, None]
    gamma = np.arange(0, 9)[None, :]
    expected = sum(np.where(gamma >= i, alpha**i, 0.0) for i in range(9))
    np.testing.assert_allclose(acceptance_tau(alpha, gamma), expected, rtol=1e-12)
    assert acceptance_tau(1.0, 4) == 5.0
    assert acceptance_tau(1 - 1e-12, 4) == pytest.approx(5.0, abs=1e-9)
    assert isinstance(acceptance_tau(0.5, 4), float)


@pytest.mark.parametrize(("alpha", "gamma", "name"), [(1.2, 4, "alpha"), (-0.1, 4, "alpha"), (np.nan, 4, "alpha"),
                                                      (0.5, 1.5, "gamma"), (0.5, -1, "gamma")])
def test_acceptance_tau_rejects_bad_input(alpha, gamma, name):
    with pytest.raises(ValueError, match=name):
        acceptance_tau(alpha, gamma)


# Table 9's printed tau model column, by cache and d; its alpha column is TABLE9_ALPHA.
TABLE9_TAU_MODEL = {("full", 2): 2.46, ("full", 4): 3.40, ("full", 8): 4.37,
                    ("deepest", 2): 3.36, ("deepest", 4): 4.33, ("deepest", 8): 4.84}


def test_table9_tau_model_column():
    """Eq. (7), gamma = 4: exact from the printed alphas for the deepest plane, within rounding for the full cache."""
    exact = set()
    for (cache, d), printed in TABLE9_TAU_MODEL.items():
        alpha = TABLE9_ALPHA[cache][d]
        if rounds_to(acceptance_tau(alpha, 4), printed, 2):
            exact.add((cache, d))
        # tau increases with alpha, so the printed alpha's interval maps onto [tau(low), tau(high)]
        low, high = (acceptance_tau(a, 4) for a in printed_interval(alpha, 3))
        t_low, t_high = printed_interval(printed, 2)
        assert low <= t_high and high >= t_low, (cache, d)
    assert exact == {("deepest", 2), ("deepest", 4), ("deepest", 8)}


def test_acceptance_model_checks_of_section33():
    """Eq. (7) matches Table 9's simulated tau within 2.6% (in sample), batch 8's measured tau within 6% (Table 1)."""
    simulated = {("full", 2): 2.44, ("full", 4): 3.31, ("full", 8): 4.34,
                 ("deepest", 2): 3.41, ("deepest", 4): 4.33, ("deepest", 8): 4.85}
    in_sample = max(abs(acceptance_tau(TABLE9_ALPHA[c][d], 4) / sim - 1) for (c, d), sim in simulated.items())
    assert rounds_to(100 * in_sample, 2.6, 1)
    measured = {"full": (3.34, 3.61), "deepest": (4.47, 4.53)}  # 24 and 12 GSM8K problems, d = gamma = 4
    held_out = max(abs(acceptance_tau(TABLE9_ALPHA[c][4], 4) / m - 1) for c, ms in measured.items() for m in ms)
    assert 0.055 < held_out <= 0.06


def test_rejection_model_and_fit():
    np.testing.assert_allclose(rejection_model(np.array([2, 4]), 0.5, 0.5), [0.875, 0.96875])
    fit = fit_rejection([1, 2, 3, 5], rejection_model(np.array([1, 2, 3, 5]), 0.4, 0.7))
    assert (fit.k, fit.rho_a) == pytest.approx((0.4, 0.7))
    with pytest.raises(ValueError, match="rho_a"):
        rejection_model(2, 0.5, 1.5)
    with pytest.raises(ValueError, match="alpha"):
        fit_rejection([2, 4], [0.5, 1.0])
    with pytest.raises(ValueError, match="same length"):
        fit_rejection([2, 4, 8], [0.5, 0.6])


def test_table9_caption_rejection_fit():
    """k and rho_a of Table 9's caption from its alpha column: exact except the full cache's k (within rounding)."""
    depths = sorted(TABLE9_ALPHA["full"])
    deep = fit_rejection(depths, [TABLE9_ALPHA["deepest"][d] for d in depths])
    assert rounds_to(deep.k, TABLE9_REJECTION["deepest"][0], 2)
    assert rounds_to(deep.rho_a, TABLE9_REJECTION["deepest"][1], 2)
    full_alpha = np.array([TABLE9_ALPHA["full"][d] for d in depths])
    full = fit_rejection(depths, full_alpha)
    assert rounds_to(full.rho_a, TABLE9_REJECTION["full"][1], 2)
    assert not rounds_to(full.k, TABLE9_REJECTION["full"][0], 2)  # 0.61 from the printed alphas
    steps = np.linspace(-0.0005, 0.0005, 11)
    fits = [fit_rejection(depths, full_alpha + np.array(e)) for e in itertools.product(steps, repeat=3)]
    assert any(rounds_to(f.k, TABLE9_REJECTION["full"][0], 2) and rounds_to(f.rho_a, TABLE9_REJECTION["full"][1], 2)
               for f in fits)


# -- cost and speed-up (Eq. 8, Sec. 3.4, Figure 5b) ---------------------------------------------------


def test_layer_passes_of_huginn():
    assert layer_passes(HUGINN, 32) == 132 and layer_passes(HUGINN, 4) == 20
    assert layer_passes((2, 4, 2), 32) == 132
    with pytest.raises(ValueError, match="model"):
        layer_passes((2, 0, 2), 4)
    with pytest.raises(ValueError, match="num_loops"):
        layer_passes(HUGINN, -1)


def test_speedup_formula_and_inverse():
    s = speedup(3.0, 4, 4, HUGINN, eta=1.1)
    assert s == pytest.approx(3.0 * 132 / (1.1 * (4 * 20 + 132)))
    assert tau_for_speedup(s, 4, 4, HUGINN, eta=1.1) == pytest.approx(3.0)
    np.testing.assert_allclose(speedup([1, 2], 4, [1, 2], HUGINN), [132 / 152, 2 * 132 / 172])
    for kwargs, name in (({"eta": 0.0}, "eta"), ({"num_loops": 0}, "num_loops")):
        with pytest.raises(ValueError, match=name):
            speedup(3.0, 4, 4, HUGINN, **kwargs)
    with pytest.raises(ValueError, match="tau"):
        speedup(0.5, 4, 4, HUGINN)
    with pytest.raises(ValueError, match="gamma"):
        speedup(3.0, 4, 0, HUGINN)
    with pytest.raises(ValueError, match=r"^d "):
        speedup(3.0, 2.5, 4, HUGINN)


def test_figure_5b_statements_need_the_measured_alphas():
    """'At d = 4 the full cache peaks at gamma = 5 (1.98x), while the deepest plane still rises at gamma = 8 (2.87x).'

    Exact from Table 9's measured alpha_4; the rejection model's alpha_4 gives 1.93x and 2.79x.
    """
    gammas = np.arange(1, 9)
    measured = {cache: speedup_curves(a, HUGINN, gammas, eta=1.07) for cache, a in figure_5b_alphas("table9").items()}
    full, deep = measured["full"][4], measured["deepest"][4]
    assert gammas[np.argmax(full)] == 5 and rounds_to(full.max(), 1.98, 2)
    assert np.all(np.diff(deep) > 0) and rounds_to(deep[-1], 2.87, 2)
    model = {cache: speedup_curves(a, HUGINN, gammas, eta=1.07) for cache, a in figure_5b_alphas("rejection").items()}
    assert gammas[np.argmax(model["full"][4])] == 5 and np.all(np.diff(model["deepest"][4]) > 0)
    assert not rounds_to(model["full"][4].max(), 1.98, 2) and not rounds_to(model["deepest"][4][-1], 2.87, 2)
    with pytest.raises(ValueError, match="source"):
        figure_5b_alphas("simulated")
    with pytest.raises(ValueError, match="gammas"):
        speedup_curves({4: 0.8}, HUGINN, gammas=[0, 1])


def test_eq8_printed_speedups_need_taus_and_eta_within_rounding():
    """Sec. 3.4: eta = 1 gives 2.24x / 2.80x, eta = 1.07 gives 2.08x / 2.61x (d = gamma = 4)."""
    printed = {"full": (2.24, 2.08), "deepest": (2.80, 2.61)}
    # taus that give the eta = 1 values, from Eq. (8) inverted over the printed rounding interval
    taus = {cache: np.linspace(*tau_for_speedup(np.array(printed_interval(s1, 2)), 4, 4, HUGINN), 401)
            for cache, (s1, _) in printed.items()}
    etas = np.linspace(*printed_interval(1.07, 2), 201)
    consistent = []
    for eta in etas:
        ok = [np.any(rounds_to(speedup(taus[c], 4, 4, HUGINN, eta), s2, 2)) for c, (_, s2) in printed.items()]
        consistent.append(all(ok))
    consistent = np.array(consistent)
    assert consistent.any()  # some eta printed as 1.07 and some taus reproduce all four values
    assert etas[consistent].min() > 1.071 and etas[consistent].max() <= 1.075
    assert not consistent[np.argmin(np.abs(etas - 1.07))]  # eta = 1.07 itself gives 2.09x for the full cache


def test_eq8_printed_taus_do_not_give_the_eta1_values():
    """No printed tokens-per-verification gives 2.24x / 2.80x at eta = 1; see the perf module docstring."""
    for full_tau, deep_tau in ((3.34, 4.47), (3.61, 4.53)):
        assert not rounds_to(speedup(full_tau, 4, 4, HUGINN), 2.24, 2)
        assert not rounds_to(speedup(deep_tau, 4, 4, HUGINN), 2.80, 2)
    assert rounds_to(speedup(3.605, 4, 4, HUGINN), 2.24, 2)  # only at the bottom of 3.61's interval
    assert not rounds_to(speedup(printed_interval(4.53, 2)[0], 4, 4, HUGINN), 2.80, 2)


@pytest.mark.parametrize("relative", [False, True])
def test_fit_eta_recovers_a_known_factor(relative):
    rng = np.random.default_rng(0)
    taus = rng.uniform(3.0, 4.6, 24)
    measured = np.asarray(speedup(taus, 4, 4, HUGINN, eta=1.07))
    fit = fit_eta(measured, taus, 4, 4, HUGINN, relative=relative)
    assert fit.eta == pytest.approx(1.07) and fit.max_relative_error < 1e-12
    noisy = fit_eta(measured * rng.uniform(0.95, 1.05, 24), taus, 4, 4, HUGINN, relative=relative)
    assert abs(noisy.eta - 1.07) < 0.03 and 0 < noisy.max_relative_error < 0.06
    with pytest.raises(ValueError, match="same length"):
        fit_eta(measured[:3], taus, 4, 4, HUGINN)
    with pytest.raises(ValueError, match="speedups"):
        fit_eta(-measured, taus, 4, 4, HUGINN)
    with pytest.raises(ValueError, match="gamma"):
        fit_eta(measured, taus, 4, [4, 4], HUGINN)


# -- peak memory (Sec. 3.5, Sec. 5.3) ---------------------------------------------------------------


def _cache_gb(length: int = 808) -> tuple[float, float]:
    return m_full(HUGINN, length) / GB, m_deep(HUGINN, length) / GB


def test_cache_per_sequence_is_exact():
    full, _ = _cache_gb()
    assert rounds_to(full, 2.25, 2)  # "2.25 GB per sequence"


def test_memory_model_with_the_printed_fit():
    """The printed o0 = 7.2, o1 = 0.18 give B_max = 36 exactly; o1 = 0.15 and B = 38 are off (rounded fits)."""
    full, deep = _cache_gb()
    assert b_max(95, 7.2, 0.18, full) == 36
    assert b_max(95, 7.2, 0.15, deep) == 306  # printed 302
    assert not rounds_to(peak_memory(38, full, 7.2, 0.18), 99.4, 1)  # 99.6 GB


def test_memory_model_reproduces_section35_within_rounding():
    """Some o0, o1 printed as 7.2, 0.18 / 0.15 give B_max = 36 and 302 and 99.4 GB at B = 38 simultaneously."""
    full, deep = _cache_gb()
    o0 = np.linspace(*printed_interval(7.2, 1), 201)
    o1_full = np.linspace(*printed_interval(0.18, 2), 201)
    o1_deep = np.linspace(*printed_interval(0.15, 2), 201)
    ok_full = np.array([[b_max(95, a, b, full) == 36 and rounds_to(peak_memory(38, full, a, b), 99.4, 1)
                         for b in o1_full] for a in o0])
    ok_deep = np.array([[b_max(95, a, b, deep) == 302 for b in o1_deep] for a in o0])
    both = ok_full.any(axis=1) & ok_deep.any(axis=1)  # one o0 shared by both caches
    assert both.any()
    # the region stated in the perf module docstring
    assert o0[both].min() == pytest.approx(7.15) and o0[both].max() <= 7.2025
    assert o1_full[ok_full.any(axis=0)].max() <= 0.1764
    assert o1_deep[ok_deep.any(axis=0)].min() > 0.1530 and o1_deep[ok_deep.any(axis=0)].max() <= 0.1544


def test_fit_peak_memory_recovers_overheads_and_predicts_held_out_cells():
    full, _ = _cache_gb()
    fit_b = np.array([1, 2, 4, 8, 16, 24, 32])
    fit = fit_peak_memory(fit_b, peak_memory(fit_b, full, 7.2, 0.18), full)
    assert (fit.o0, fit.o1) == pytest.approx((7.2, 0.18))
    held_b = np.array([34, 36, 38])
    held = np.asarray(peak_memory(held_b, full, 7.2, 0.18)) * np.array([1.001, 0.999, 1.0])
    assert fit.max_relative_error(held_b, held) == pytest.approx(1 / 0.999 - 1)
    with pytest.raises(ValueError, match="distinct"):
        fit_peak_memory([8, 8], [20.0, 20.1], full)
    with pytest.raises(ValueError, match="same length"):
        fit_peak_memory([1, 2, 3], [10.0, 12.0], full)


def test_b_max_boundaries():
    assert b_max(10.0, 1.0, 0.5, 0.5) == 9  # peak(9) = 10 exactly fits
    assert b_max(10.0, 1.0, 0.5, 0.4999) == 9
    assert b_max(0.5, 1.0, 0.5, 0.5) == 0
    assert b_max(0.6, 0.3, 0.1, 0.2) == 1  # (0.6 - 0.3) / 0.3 floors to 0 in floating point, yet peak(1) = 0.6
    with pytest.raises(ValueError, match="cache_per_seq"):
        b_max(95, 7.2, -1.0, 0.5)


# -- throughput (Sec. 3.5, 5.3, Table 8) ------------------------------------------------------------


def test_fit_throughput_recovers_table8_quantities():
    batch = np.array([1, 2, 4, 8, 16, 32])
    fit = fit_throughput(batch, throughput(batch, 33 / 449, 1 / 449))
    assert (fit.t_inf, fit.b_half) == pytest.approx((449, 33)) and fit.max_relative_residual < 1e-12
    bumped = np.asarray(throughput(batch, 33 / 449, 1 / 449)) * (1 + 0.02 * (-1.0) ** np.arange(6))
    assert 0.015 < fit_throughput(batch, bumped).max_relative_residual < 0.03
    with pytest.raises(ValueError, match="distinct"):
        fit_throughput([4, 4], [100.0, 101.0])
    with pytest.raises(ValueError, match="tokens_per_s"):
        fit_throughput([1, 2], [100.0, -1.0])


@pytest.mark.parametrize(("t_inf", "b_half", "residual", "batch", "measured"), [
    (449, 33, 0.02, 32, 218),  # batch 6, full cache, draft-then-verify (Sec. 3.5)
    (689, 27, 0.06, 32, 365),  # batch 6, one shared slot, WaveFront
    (689, 27, 0.06, 64, 487),
    (380, 18, 0.02, 34, 253),  # batch 8, full cache, draft-then-verify (Sec. 5.3)
    (605, 14, 0.02, 256, 572),  # batch 8, one shared slot, WaveFront
])
def test_table8_curves_match_the_cells_printed_in_the_text(t_inf, b_half, residual, batch, measured):
    model = throughput(batch, b_half / t_inf, 1 / t_inf)
    assert abs(model / measured - 1) <= residual + 0.005  # printed residual, to its rounding


def test_cache_only_factor_from_the_table8_curves():
    """The 1.63x cache-only factor's cells are not printed; Table 8's WaveFront curves at B = 32 give 1.62x."""
    shared = throughput(32, 27 / 689, 1 / 689)  # batch 6, one slot, WaveFront, alpha 0.965
    full = throughput(32, 11 / 310, 1 / 310)  # batch 6, no slot, WaveFront, alpha 0.965
    assert rounds_to(shared / full, 1.62, 2)


def test_fixed_memory_factors_section35():
    """365/218 = 1.67x exactly; 1.34x and 2.24x within the cells' rounding (printed total = 1.67 x 1.34)."""
    f = fixed_memory_factors(218, 365, 487)
    assert rounds_to(f.same_batch, 1.67, 2)
    assert not rounds_to(f.batch, 1.34, 2) and not rounds_to(f.total, 2.24, 2)
    assert f.total == pytest.approx(f.same_batch * f.batch) and f.cache_only is None
    assert rounds_to(1.67 * 1.34, 2.24, 2)
    cells = [np.linspace(*printed_interval(v, 0), 21) for v in (218, 365, 487)]
    assert any(rounds_to(g.same_batch, 1.67, 2) and rounds_to(g.batch, 1.34, 2) and rounds_to(g.total, 2.24, 2)
               for g in (fixed_memory_factors(*c) for c in itertools.product(*cells)))
    assert fixed_memory_factors(218, 365, 487, full_same_scheduler=224).cache_only == pytest.approx(365 / 224)
    with pytest.raises(ValueError, match="best_full"):
        fixed_memory_factors(0, 365, 487)
