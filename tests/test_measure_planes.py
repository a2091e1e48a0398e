"""Plane measurements over texts (chapters 2 and 3): chunked ripening, the arm grid, Table 3's equal-storage caches
against independent computations, exact byte formulas per policy and errors for out-of-range policy parameters."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import FAMILY_FIXTURES, FIXTURES, random_model

from looped_kv import load, make_policy, papers, policy_bytes
from looped_kv.analysis import planes as measure_planes
from looped_kv.analysis.fits import NOT_RIPE, RIPE, SensitivityFit, sensitivity_regression
from looped_kv.analysis.memory_bench import tensor_peak_bytes
from looped_kv.analysis.planes import (
    ArmGrid,
    RipeningCurves,
    arm_grid,
    cast_in_place,
    eq6_check,
    exact_replay,
    first_position_agreement,
    free_memory,
    in_dtype,
    paper_planes,
    precision_floor,
    record_device,
    region_contrast,
    regression_rows,
    resolved_slope,
    restrict,
    ripening_curves,
    ripening_summary,
    table3_policies,
    table7_column,
    text_batch,
    text_ripening,
    workload_batch,
)
from looped_kv.analysis.replay import (
    SubstitutionRouter,
    deepest_plane_arm,
    kl_per_position,
    maturity,
    paper_region,
    perturbation_size,
    replay,
    ripening,
    rounding,
    substitute,
)
from looped_kv.decoding.passes import new_cache, prefill, step
from looped_kv.runtime.attention import attend
from looped_kv.workloads import data

torch.set_num_threads(1)
B, N = 3, 12


@pytest.fixture(scope="module", params=sorted(FAMILY_FIXTURES))
def setup(request):
    """A float64 fixture model and B random texts of N tokens."""
    model = load(FIXTURES / FAMILY_FIXTURES[request.param], dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (B, N), generator=torch.Generator().manual_seed(3))
    return model, ids, model.config.mean_recurrence


# -- ripening over texts -------------------------------------------------------------------------


def test_chunked_ripening_equals_one_replay(setup):
    model, ids, R = setup
    ref = replay(model, ids, R, softmax_dtype=torch.float64, record=("q", "k", "v"), decoded=4)
    curves = ripening_curves(model, ids, R, decoded=4, softmax_dtype=torch.float64, chunk=2, record_device="cpu")
    assert curves.texts == B and curves.num_loops == R and list(curves.loops) == list(range(1, R + 1))
    for X, d in ripening(ref).items():
        np.testing.assert_allclose(curves.delta[X], d.numpy(), rtol=1e-12)
        np.testing.assert_allclose(curves.text_delta[X], ripening(ref, per_text=True)[X].numpy(), rtol=1e-12)
        assert curves.delta[X][-1] == 0 and (curves.delta[X][:-1] > 0).all()
    for X, m in maturity(ref).items():
        np.testing.assert_allclose(curves.maturity[X], m.numpy(), rtol=1e-12)
        np.testing.assert_allclose(curves.text_maturity[X], maturity(ref, per_text=True)[X].numpy(), rtol=1e-12)
    keys_only = ripening_curves(model, ids, R, decoded=4, maturity_kinds=(), chunk=5)
    assert keys_only.maturity == {}
    np.testing.assert_array_equal(curves.fitted("k", (2, 3)), curves.text_delta["k"][:, 1:3])
    with pytest.raises(ValueError, match="loop_range"):
        curves.fitted("k", (0, 3))
    with pytest.raises(ValueError, match="kind"):
        curves.fitted("q")


def _synthetic(R: int, rho: float, c: float, floor: float, dtype: torch.dtype) -> RipeningCurves:
    r = np.arange(1, R + 1, dtype=float)
    fp32 = c * rho**r
    delta = fp32 if dtype == torch.float32 else np.hypot(fp32, floor)
    delta[-1] = 0
    return RipeningCurves(R, {"k": delta[None], "v": 2 * delta[None]}, {}, dtype)


def test_ripening_summary_recovers_table7_quantities():
    R = 32
    fp32, bf16 = _synthetic(R, 0.8, 0.5, 0.004, torch.float32), _synthetic(R, 0.8, 0.5, 0.004, torch.bfloat16)
    fits = ripening_summary(fp32, bf16)
    for X, scale in (("k", 1), ("v", 2)):
        f = fits[X]
        assert f.geometric.rho == pytest.approx(0.8) and f.geometric.c == pytest.approx(0.5 * scale)
        assert f.geometric.loop_range == (8, 31) and f.geometric.max_abs_log_residual < 1e-9
        assert f.floor.delta_inf == pytest.approx(0.004 * scale, rel=1e-6)
        assert f.deep_fp32 == pytest.approx(np.mean(scale * 0.5 * 0.8 ** np.arange(25, 32)))
        assert f.ripeness.label == RIPE  # 0.5 * 0.8^25 = 0.0019 < floor: at the floor
    slow = ripening_summary(_synthetic(R, 0.95, 0.5, 0.004, torch.float32),
                            _synthetic(R, 0.95, 0.5, 0.004, torch.bfloat16))
    assert slow["k"].ripeness.label == NOT_RIPE  # 0.5 * 0.95^28 = 0.12 >> floor
    column = table7_column(fits)
    assert column["rho"] == "0.80 (0.80)" and column["ripeness (Remark 1)"] == f"{RIPE} ({RIPE})"
    with pytest.raises(ValueError, match="same R"):
        ripening_summary(fp32, _synthetic(16, 0.8, 0.5, 0.004, torch.bfloat16))


def test_text_ripening_pairs_texts():
    R = 32
    r = np.arange(1, R + 1, dtype=float)
    keys = np.stack([0.5 * 0.8**r, 0.5 * r**-3.0])  # text 0 geometric, text 1 a power of the loop
    keys[:, -1] = 0
    maturity = {X: np.tile(np.linspace(c, 1, R), (2, 1)) for X, c in (("q", 0.9), ("k", 0.8), ("v", 0.5))}
    curves = RipeningCurves(R, {"k": keys, "v": 2 * keys}, maturity, torch.float32)
    table = text_ripening(curves, {"k": 1e-12, "v": 1e-12})
    assert len(table) == 2 and table.index.name == "text"
    assert table.rho_k[0] == pytest.approx(0.8) and table.geometric_rms_k[0] < 1e-9 < table.power_rms_k[0]
    assert table.power_rms_v[1] < 1e-9 < table.geometric_rms_v[1]
    np.testing.assert_allclose(table.deep_v, 2 * table.deep_k)
    assert table.deep_k[0] == pytest.approx(np.mean(0.5 * 0.8 ** np.arange(25, 32)))
    assert [list(table[f"cos1_{X}"]) for X in "qkv"] == [[0.9, 0.9], [0.8, 0.8], [0.5, 0.5]]
    floored = text_ripening(curves, {"k": 1.0, "v": 1.0})  # every distance at the floor: both laws fit it
    assert (floored.geometric_rms_k < 1e-12).all() and np.allclose(floored.rho_k, 1)
    with pytest.raises(ValueError, match="floors"):
        text_ripening(curves, {"k": 1e-12})


@torch.no_grad()
def test_float_floor_from_an_exact_replay(setup):
    model, ids, R = setup
    model32 = in_dtype(model, torch.float32)
    before = {name: t.clone() for name, t in model32.state_dict().items()}
    curves = ripening_curves(model32, ids, R, decoded=4, maturity_kinds=(), exact_dtype=torch.float64, chunk=2)
    assert model32.dtype == torch.float32  # cast back, bit for bit
    assert all(torch.equal(t, before[name]) for name, t in model32.state_dict().items())
    rounded = replay(model32, ids, R, decoded=4)
    exact = replay(in_dtype(model32, torch.float64), ids, R, softmax_dtype=torch.float64, decoded=4)
    for X, e in rounding(rounded, exact).items():
        np.testing.assert_allclose(curves.text_rounding[X], e.numpy(), rtol=1e-9)
        assert e.shape == (B, R) and (e > 0).all() and (e < 1e-5).all()
        eps = e.numpy()
        assert curves.float_floor(X) == pytest.approx((eps + eps[:, -1:]).max(), rel=1e-9)
    with pytest.raises(ValueError, match="exact_dtype"):
        ripening_curves(model32, ids, R, decoded=4, maturity_kinds=()).float_floor("k")
    with pytest.raises(ValueError, match="same texts"):
        rounding(rounded, replay(model, ids.flip(0), R, decoded=4))
    with pytest.raises(ValueError, match="loops"):
        rounding(rounded, replay(model, ids, R, loops=(1, R), decoded=4))


def test_cast_in_place_restores_the_weights():
    model = random_model().to(torch.float32)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with cast_in_place(model, torch.float64) as wide:
        assert wide is model and model.dtype == torch.float64
    assert model.dtype == torch.float32
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    for narrower in (torch.bfloat16, torch.float16, torch.int64):
        with pytest.raises(ValueError, match="at least as wide"), cast_in_place(model, narrower):
            pass
    assert model.dtype == torch.float32


def test_record_device_and_free_memory():
    model = random_model()
    assert record_device(model, "model") == model.device and record_device(model, "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="where must be one of"):
        record_device(model, "gpu")
    free_memory(model.device)  # collects garbage; empties the CUDA cache only on a CUDA device


def test_workload_batch():
    model = random_model()
    model.tokenizer = CharTokenizer()
    ids, labels = workload_batch(model, data.WORKLOADS, 3, 40)
    assert ids.shape == (9, 40) and list(labels) == [w for w in data.WORKLOADS for _ in range(3)]
    expected = text_batch(model, data.texts("code", 3, chars=320), 40)
    assert torch.equal(ids[3:6], expected)
    with pytest.raises(ValueError, match="workloads"):
        workload_batch(model, ("poems",), 3, 40)
    with pytest.raises(ValueError, match="per_workload"):
        workload_batch(model, data.WORKLOADS, 0, 40)


# -- the arm grid ----------------------------------------------------------------------------------


def test_paper_planes():
    assert paper_planes(32) == papers.RIPE_SEC_3_1_PLANES
    assert paper_planes(64) == (2, 8, 16, 32, 48, 64)
    assert paper_planes(6) == (1, 2, 3, 4, 6)  # 0.1875 -> 1 (clip), 0.75 -> 1, 1.5 -> 2, 3, 4.5 -> 4, 6
    with pytest.raises(ValueError, match="num_loops"):
        paper_planes(0)


@torch.no_grad()
def test_arm_grid_rows_are_the_arms(setup):
    model, ids, R = setup
    grid = arm_grid(model, ids, R, softmax_dtype=torch.float64, decoded=2, progress=False)
    planes = paper_planes(R)
    assert len(grid.rows) == 2 * len(planes) * B
    assert grid.reference.first_decoded == N - 2
    t = N - 2
    for region, p in (("deep", 1), ("shallow", planes[-1])):
        loops = paper_region(region, R)
        arm = substitute(model, grid.reference, p, loops)
        rows = grid.rows[(grid.rows.region == region) & (grid.rows.plane == p)].sort_values("text")
        np.testing.assert_allclose(rows.kl, kl_per_position(grid.reference.logits[:, t], arm[:, t]).numpy(),
                                   rtol=1e-9)
        np.testing.assert_allclose(rows["size"], perturbation_size(grid.reference, p, loops).numpy(), rtol=1e-12)
        assert (rows.deep == int(region == "deep")).all()
        at = grid.positions[(grid.positions.region == region) & (grid.positions.plane == p)]
        by_position = at.pivot(index="text", columns="offset", values="kl").to_numpy()
        np.testing.assert_allclose(by_position, kl_per_position(grid.reference.logits[:, t:], arm[:, t:]).numpy(),
                                   rtol=1e-9)
    assert len(grid.positions) == 2 * len(planes) * B * 2
    on_host = arm_grid(model, ids, R, softmax_dtype=torch.float64, decoded=2, record_device="cpu", progress=False)
    assert on_host.reference.core["k"].device == torch.device("cpu")
    np.testing.assert_array_equal(on_host.rows.kl, grid.rows.kl)
    medians = grid.medians()
    assert len(medians) == 2 * len(planes) and list(medians.columns) == ["region", "deep", "plane", "size", "kl"]
    with pytest.raises(ValueError, match="regions"):
        arm_grid(model, ids, R, regions={"deep": (R,)}, progress=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"planes": (1, 99)}, r"planes must be a non-empty set of loops in 1\.\.{R}"),
    ({"planes": ()}, r"planes must be a non-empty set of loops in 1\.\.{R}"),
    ({"kinds": ("q",)}, r"kinds must be distinct kinds out of \('k', 'v'\)"),
    ({"kinds": ()}, r"kinds must name at least one of \('k', 'v'\)"),
    ({"regions": {"shallow": (2,), "deep": (0,)}}, r"regions\['deep'\] must be a non-empty set of loops in 1\.\.{R}"),
])
def test_arm_grid_checks_before_the_replay(setup, monkeypatch, kwargs, message):
    model, ids, R = setup
    monkeypatch.setattr(measure_planes, "replay", _no_replay)
    with pytest.raises(ValueError, match=message.format(R=R)):
        arm_grid(model, ids, R, progress=False, **kwargs)


@pytest.mark.parametrize("maturity_kinds", [("x",), ("k", "k"), "qk"])
def test_ripening_curves_checks_kinds_before_the_replay(setup, monkeypatch, maturity_kinds):
    model, ids, R = setup
    monkeypatch.setattr(measure_planes, "replay", _no_replay)
    with pytest.raises(ValueError, match=r"maturity_kinds must be distinct kinds out of \('q', 'k', 'v'\)"):
        ripening_curves(model, ids, R, decoded=2, maturity_kinds=maturity_kinds)


def _no_replay(*args, **kwargs):
    raise AssertionError("the reference replay ran before the arguments were checked")


def test_regression_rows_floor_and_fit():
    rng = np.random.default_rng(0)
    rows = []
    for text in range(6):
        for deep in (0, 1):
            for size in (0.1, 0.3, 1.0, 3.0):
                kl = math.exp(-10 + 4 * deep + 2 * math.log(size) + 0.1 * rng.normal())
                rows.append({"text": text, "region": "deep" if deep else "shallow", "deep": deep, "plane": 1,
                             "kl": kl, "size": size})
    rows[0]["kl"] = 0.0  # exactly zero: must sit at the floor, not break the log
    import pandas as pd

    grid = ArmGrid(reference=None, rows=pd.DataFrame(rows), positions=pd.DataFrame())
    floor = 1e-9
    fitted = regression_rows(grid, floor)
    assert fitted.at_floor.sum() == 1 and fitted.kl.min() == floor
    fit = sensitivity_regression(fitted, floor=floor)
    assert fit.n_at_floor == 1 and fit.b == pytest.approx(4, abs=0.3) and fit.g == pytest.approx(2, abs=0.3)
    with pytest.raises(ValueError, match="floor"):
        regression_rows(grid, 0.0)
    steep = resolved_slope(fitted, "deep", floor)
    assert steep.slope == pytest.approx(2, abs=0.2) and steep.ci[0] < steep.slope < steep.ci[1]
    assert steep.n == 24 and resolved_slope(fitted, "shallow", floor).n == 23  # the row at the floor is left out
    assert resolved_slope(fitted, "deep", 1.0) is None  # nothing above the floor: no slope
    with pytest.raises(ValueError, match="region"):
        resolved_slope(fitted, "middle", floor)


def test_region_contrast_pairs_regions_at_matched_planes():
    import pandas as pd

    rows = pd.DataFrame([{"text": t, "region": region, "plane": p, "kl": kl}
                         for t in range(2) for region, kls in (("shallow", (1e-9, 1e-12)), ("deep", (1e-4, 1e-6)))
                         for p, kl in zip((1, 8), kls, strict=True)])
    contrast = region_contrast(rows, floor=1e-10)
    assert list(contrast.columns) == ["shallow", "deep"] and list(contrast.index) == [0, 1]
    assert contrast.shallow[0] == pytest.approx(math.sqrt(1e-9 * 1e-10))  # 1e-12 enters at the floor
    assert contrast.deep[1] == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="same planes"):
        region_contrast(rows[(rows.region == "deep") | (rows.plane == 1)], floor=1e-10)
    with pytest.raises(ValueError, match="floor"):
        region_contrast(rows, floor=0.0)


def test_precision_floor(setup):
    model, ids, R = setup
    exact = replay(model, ids, R, softmax_dtype=torch.float64, record=(), decoded=2)
    with pytest.raises(ValueError, match="already in exact_dtype"):
        precision_floor(model, exact)
    model32 = in_dtype(model, torch.float32)
    assert model32 is not model and model32.dtype == torch.float32 and model.dtype == torch.float64
    assert in_dtype(model, torch.float64) is model
    rounded = replay(model32, ids, R, record=(), decoded=2)
    floor = precision_floor(model32, rounded)
    assert floor.shape == (B,) and (floor > 1e-20).all() and floor.max() < 1e-6
    np.testing.assert_allclose(precision_floor(model32, rounded, exact=exact), floor, rtol=1e-6)
    with pytest.raises(ValueError, match="same texts"):
        precision_floor(model32, rounded, exact=replay(model, ids.flip(0), R, record=(), decoded=2))
    exact32 = exact_replay(model32, ids, R, decoded=2, device="cpu")  # a float64 copy of the float32 weights
    assert exact32.logits.dtype == torch.float64 and exact32.core == {}
    np.testing.assert_array_equal(precision_floor(model32, rounded, exact=exact32), floor)


# -- equal-storage caches (Table 3) -------------------------------------------------------------------


def test_table3_policies():
    policies = table3_policies(32)
    assert [len(p.kept) for p in policies.values()] == [1, 2, 4, 4, 8, 8]  # Table 3's "planes" column
    assert [p.name for p in policies.values()] == ["deepest", "k-deepest(2)", "share(8)", "first(4)", "share(4)",
                                                   "first(8)"]
    assert [p.name for p in table3_policies(8).values()] == ["deepest", "k-deepest(2)", "share(2)", "first(1)",
                                                             "share(1)", "first(2)"]


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_restrict_stores_what_a_policy_prefill_stores(family):
    model = random_model(family, seed=4)
    R = 6
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    full = new_cache(model, make_policy("full", R), 2, 10)
    prefill(model, full, ids, R)
    for policy in [*table3_policies(R).values(), make_policy("ripe", R, window=3),
                   make_policy("sinks", R, sinks=2, window=2)]:
        real = new_cache(model, policy, 2, 10)
        prefill(model, real, ids, R)
        copied = restrict(full, policy)
        assert copied.length == real.length and copied.nbytes == real.nbytes
        for a, b in zip(copied._tensors(), real._tensors(), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="full cache"):
        restrict(real, make_policy("full", R))


class PolicyArm(SubstitutionRouter):
    """A replay arm that reads, for every prefix position, the reference's plane pi(r) in the core and the
    reference's keys/values in the coda: what a token stepped after a prefill of the unperturbed prefix reads.
    (The arms of RIPE Sec. 3.1 let the coda read the arm's own prefix, perturbed by the substitution.)"""

    def attend(self, site, q, k, v):
        if site.stage != "coda":
            return super().attend(site, q, k, v)
        prefix_k, prefix_v = self.reference.coda["k"][site.layer], self.reference.coda["v"][site.layer]
        n = q.shape[2]
        own = torch.eye(n, dtype=torch.bool)
        mask = torch.cat([torch.ones_like(own).tril(-1), own], dim=1)
        return attend(q, torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2), mask,
                      softmax_dtype=torch.float64)


@torch.no_grad()
def test_first_position_agreement_is_the_policy_arm(setup):
    """Stepping the first decoded token after a policy-cache prefill equals the replay in which every loop r reads
    the reference's plane pi(r) for the prefix (and the coda the reference's prefix), at the first decoded position."""
    model, ids, R = setup
    policies = {"full": make_policy("full", R), **table3_policies(R)}
    result = first_position_agreement(model, ids, policies)
    slow = first_position_agreement(model, ids, policies, prefill_once=False)
    chunked = first_position_agreement(model, ids, policies, chunk=2)
    for label in policies:
        np.testing.assert_array_equal(result.kl[label], slow.kl[label])
        np.testing.assert_allclose(chunked.kl[label], result.kl[label], rtol=1e-9, atol=1e-30)
        np.testing.assert_array_equal(chunked.matches[label], result.matches[label])
    assert chunked.table[["bytes", "formula bytes"]].equals(result.table[["bytes", "formula bytes"]])
    t = N - 1
    assert result.table.loc["full", "agreement"] == 1 and np.abs(result.kl["full"]).max() < 1e-20
    torch.testing.assert_close(result.full_logits, model(ids, R)[:, t], rtol=0, atol=1e-10)
    ref = replay(model, ids, R, softmax_dtype=torch.float64, record=("k", "v"), edges=True, decoded=1)
    for label, policy in table3_policies(R).items():
        arm = model(ids, R, router=PolicyArm(ref, {r: policy.plane(r) for r in range(1, R + 1)}, ("k", "v"),
                                             torch.float64))[:, t]
        np.testing.assert_allclose(result.kl[label], kl_per_position(ref.logits[:, t], arm).numpy(), rtol=1e-7)
        expected = (arm.argmax(-1) == ref.logits[:, t].argmax(-1)).numpy()
        np.testing.assert_array_equal(result.matches[label], expected)
    # the Sec. 3.1 deepest-plane arm differs through the coda's perturbed prefix
    deepest = kl_per_position(ref.logits[:, t], deepest_plane_arm(model, ref)[:, t]).numpy()
    assert not np.allclose(result.kl["deepest plane"], deepest, rtol=1e-6)
    assert (result.table["bytes"] == result.table["formula bytes"]).all()
    assert result.table.loc["deepest plane", "KL mean"] > 0
    with pytest.raises(ValueError, match="first"):
        first_position_agreement(model, ids, policies, first=N)
    with pytest.raises(ValueError, match="one R"):
        first_position_agreement(model, ids, {"a": make_policy("full", R), "b": make_policy("full", R + 1)})


# -- Eq. (6) ------------------------------------------------------------------------------------------


@torch.no_grad()
def test_eq6_check(setup):
    model, ids, R = setup
    grid = arm_grid(model, ids, R, softmax_dtype=torch.float64, decoded=1, progress=False)
    fit = SensitivityFit(a=-3.0, b=1.5, g=2.0, ci_b=(1, 2), ci_g=(1.5, 2.5), slopes={}, n_rows=1, n_at_floor=0,
                         floor_rows_dropped=False, ci_method="ols")
    check = eq6_check(model, grid.reference, fit, grid)
    deep = range(round(25 * R / 32), R)
    delta = ripening(grid.reference)
    S2 = model.config.n_core * sum(delta["k"][r - 1] ** 2 + delta["v"][r - 1] ** 2 for r in deep)
    assert check.S_curve == pytest.approx(math.sqrt(S2), rel=1e-12)
    assert check.from_curve == pytest.approx(math.exp(-1.5) * S2.item(), rel=1e-10)  # g = 2: e^(a+b) S^2
    assert check.from_size == pytest.approx(math.exp(-1.5) * np.median(check.S_measured**2), rel=1e-10)
    t = N - 1
    arm = deepest_plane_arm(model, grid.reference)[:, t]
    np.testing.assert_allclose(check.measured, kl_per_position(grid.reference.logits[:, t], arm).numpy(), rtol=1e-12)
    assert check.measured_median == pytest.approx(np.median(check.measured))
    shallow = grid.rows[(grid.rows.region == "shallow") & (grid.rows.plane == R)].sort_values("text").kl
    np.testing.assert_array_equal(check.shallow_only, shallow.to_numpy())
    assert check.shallow_only_median == pytest.approx(shallow.median()) and check.factor >= 1
    deep_rows = grid.rows[(grid.rows.region == "deep") & (grid.rows.plane == R)].sort_values("text").kl
    np.testing.assert_array_equal(check.deep_only, deep_rows.to_numpy())
    assert check.deep_only_median == pytest.approx(deep_rows.median())
    assert math.isnan(eq6_check(model, grid.reference, fit).shallow_only_median)


# -- text windows -------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character (enough for text_batch)."""

    def __call__(self, text, return_tensors=None):
        class Out:
            input_ids = torch.tensor([[ord(ch) % 50 for ch in text]])

        return Out()


def test_text_batch():
    model = random_model()
    model.tokenizer = CharTokenizer()
    ids = text_batch(model, ["abcdef", "xy", "ghijklmn"], 5)
    assert ids.shape == (2, 5) and ids[1, 0].item() == ord("g") % 50
    with pytest.raises(ValueError, match="no text has 20 tokens"):
        text_batch(model, ["abc"], 20)
    model.tokenizer = None
    with pytest.raises(ValueError, match="tokenizer"):
        text_batch(model, ["abc"], 2)


# -- exact bytes of every equal-storage policy, and out-of-range parameters ---------------------------


def _formula(cfg, name: str, R: int, L: int, element: int, **p: int) -> int:
    """Bytes of each policy written out independently: planes kept per position and full-depth positions."""
    b = 2 * cfg.n_kv_heads * cfg.head_dim * element
    edges = cfg.n_prelude + cfg.n_coda
    per_position = {"full": R, "deepest": 1, "k-deepest": p.get("k"), "first": p.get("k"),
                    "share": -(-R // p["k"]) if "k" in p else None, "ripe": 1, "sinks": 1}[name]
    total = b * L * (edges + per_position * cfg.n_core)
    if name in ("ripe", "sinks"):
        full_depth = min(p.get("window", 0), L) + min(p.get("sinks", 0), L)
        total += b * cfg.n_core * (R - 1) * full_depth
    return total


POLICIES = [("full", {}), ("deepest", {}), ("k-deepest", {"k": 1}), ("k-deepest", {"k": 2}), ("k-deepest", {"k": 7}),
            ("share", {"k": 1}), ("share", {"k": 3}), ("share", {"k": 4}), ("share", {"k": 7}), ("first", {"k": 1}),
            ("first", {"k": 4}), ("first", {"k": 7}), ("ripe", {"window": 0}), ("ripe", {"window": 5}),
            ("ripe", {"window": 50}), ("sinks", {"sinks": 1}), ("sinks", {"sinks": 40}),
            ("sinks", {"sinks": 4, "window": 3})]


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
@pytest.mark.parametrize(("name", "params"), POLICIES, ids=lambda x: str(x))
def test_every_policy_stores_its_formula(family, name, params):
    model = random_model(family, seed=2).to(torch.float32)
    cfg, R, L = model.config, 7, 19
    policy = make_policy(name, R, **params)
    for length, dtype in ((L, "bf16"), (1, "fp32"), (L, torch.float64)):
        element = {"bf16": 2, "fp32": 4}.get(dtype, 8)
        assert policy_bytes(cfg, policy, length, dtype) == _formula(cfg, name, R, length, element, **params)
    cache = new_cache(model, policy, 1, L + 1)
    assert cache.allocated_bytes == _formula(cfg, name, R, L + 1, 4, **params)
    ids = torch.randint(0, cfg.vocab_size, (1, L + 1))
    prefill(model, cache, ids[:, :L], R)
    assert cache.nbytes == _formula(cfg, name, R, L, 4, **params)
    step(model, cache, ids[:, L:], R)
    assert cache.nbytes == _formula(cfg, name, R, L + 1, 4, **params) == policy_bytes(cfg, policy, L + 1, "fp32")


@pytest.mark.parametrize(("call", "message"), [
    (lambda: make_policy("full", 0), "num_loops must be in"),
    (lambda: make_policy("k-deepest", 8), "needs k"),
    (lambda: make_policy("k-deepest", 8, k=0), "k must be in"),
    (lambda: make_policy("share", 8), "needs k"),
    (lambda: make_policy("share", 8, k=0), "k must be in"),
    (lambda: make_policy("share", 8, k=9), "k must be in"),
    (lambda: make_policy("first", 8, k=0), "k must be in"),
    (lambda: make_policy("first", 8, k=9), "k must be in"),
    (lambda: make_policy("sinks", 8), "needs sinks"),
    (lambda: make_policy("sinks", 8, sinks=0), "sinks must be in"),
])
def test_out_of_range_policy_parameters(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_in_dtype_copies_without_a_second_copy_in_the_original_dtype():
    model = random_model().to(torch.float32)
    peak, twin = tensor_peak_bytes(lambda: in_dtype(model, torch.float64))
    reference = copy.deepcopy(model).to(torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))
    assert twin.lm_head.weight is twin.transformer.wte.weight  # tied weights stay tied
    float64_bytes = sum(t.numel() * 8 for t in [*twin.parameters(), *twin.buffers()])
    assert peak == float64_bytes  # the copy, nothing more


def test_exact_replay_in_chunks_equals_one_replay(setup):
    model, ids, R = setup
    whole = exact_replay(model, ids, R, decoded=4, dtype=torch.float64)
    chunked = exact_replay(model, ids, R, decoded=4, dtype=torch.float64, chunk=2, device="cpu")
    assert torch.equal(whole.logits, chunked.logits) and torch.equal(whole.input_ids, chunked.input_ids)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        exact_replay(model, ids, R, decoded=4, chunk=0)
