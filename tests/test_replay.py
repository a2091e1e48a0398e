"""Teacher-forced replay, plane substitution arms and the RIPE/DAS measurements against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FAMILY_FIXTURES, FIXTURES

from looped_kv import CausalRouter, Site, load
from looped_kv.analysis.replay import (
    deepest_plane_arm,
    kl_per_position,
    maturity,
    paper_region,
    perturbation_size,
    replay,
    ripening,
    substitute,
)

torch.set_num_threads(1)
N, DECODED = 10, 3


@pytest.fixture(scope="module", params=sorted(FAMILY_FIXTURES))
def setup(request):
    """A float64 fixture model, two texts and their float64 replay recording q, k, v of every loop and the edges."""
    model = load(FIXTURES / FAMILY_FIXTURES[request.param], dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, N), generator=torch.Generator().manual_seed(0))
    R = model.config.mean_recurrence
    ref = replay(model, ids, R, softmax_dtype=torch.float64, record=("q", "k", "v"), edges=True, decoded=DECODED)
    return model, ids, R, ref


class Tap(CausalRouter):
    """The model's own causal attention, keeping every call's (q, k, v) by site."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Site, tuple[torch.Tensor, ...]] = {}

    def attend(self, site, q, k, v):
        self.calls[site] = (q, k, v)
        return super().attend(site, q, k, v)


def test_replay_matches_forward(setup):
    model, ids, R, ref = setup
    tap = Tap()
    logits = model(ids, R, router=tap)
    assert ((ref.logits - logits).abs().max() / logits.abs().max()).item() < 1e-12
    assert ref.first_decoded == N - DECODED and ref.loops == tuple(range(1, R + 1))
    assert len(tap.calls) == model.config.n_prelude + R * model.config.n_core + model.config.n_coda
    for site, qkv in tap.calls.items():
        for kind, x in zip("qkv", qkv, strict=True):
            stored = ref.plane(kind, site.loop)[site.layer] if site.stage == "core" else \
                getattr(ref, site.stage)[kind][site.layer]
            torch.testing.assert_close(stored, x, rtol=1e-12, atol=1e-12)
    cfg = model.config
    assert ref.core["q"].shape == (R, cfg.n_core, 2, cfg.n_heads, N, cfg.head_dim)
    assert ref.core["k"].shape == (R, cfg.n_core, 2, cfg.n_kv_heads, N, cfg.head_dim)


def test_replay_records_only_what_is_asked(setup):
    model, ids, R, ref = setup
    small = replay(model, ids, R, softmax_dtype=torch.float64, record=("v",), loops=(R, 2), decoded=DECODED,
                   device="cpu", dtype=torch.float32)
    assert set(small.core) == {"v"} and small.loops == (2, R) and not small.prelude and not small.coda
    assert small.core["v"].dtype == torch.float32 and small.core["v"].shape[0] == 2
    for r in (2, R):
        torch.testing.assert_close(small.plane("v", r), ref.plane("v", r).float())
    with pytest.raises(ValueError, match="was not recorded"):
        small.plane("k", R)


def test_float32_softmax_agrees_with_forward(setup):
    model, ids, R, _ = setup
    model32 = load(FIXTURES / FAMILY_FIXTURES[model.config.family], dtype=torch.float32)
    logits = model32(ids, R)
    ref32 = replay(model32, ids, R, record=(), decoded=DECODED)
    assert (ref32.logits - logits).abs().max().item() < 1e-4 * logits.abs().max().item()
    assert kl_per_position(logits, ref32.logits).max().item() < 1e-9
    ref64 = replay(model32, ids, R, softmax_dtype=torch.float64, record=(), decoded=DECODED)
    assert not torch.equal(ref64.logits, ref32.logits)  # the softmax dtype reaches the attention


@pytest.mark.parametrize("kinds", [("k", "v"), ("k",), ("v",)])
def test_identity_substitution_changes_nothing(setup, kinds):
    model, _, R, ref = setup
    for r in range(1, R + 1):
        kl = kl_per_position(ref.logits, substitute(model, ref, r, [r], kinds=kinds))
        assert kl.abs().max().item() < 1e-20
        assert perturbation_size(ref, r, [r], kinds=kinds).abs().max().item() == 0


class SequentialArm:
    """Brute force: one token at a time; a substituted loop reads the reference's plane p at j < t, everything
    else reads the arm's own keys/values of the earlier tokens. Explicit float64 softmax."""

    def __init__(self, reference, planes: dict[int, int], kinds) -> None:
        self.reference, self.planes, self.kinds = reference, planes, kinds
        self.own: dict[Site, tuple[list, list]] = {}

    def attend(self, site, q, k, v):
        ks, vs = self.own.setdefault(site, ([], []))
        t = len(ks)
        prefix = [torch.cat(xs, dim=2) if xs else x[:, :, :0] for xs, x in ((ks, k), (vs, v))]
        if site.stage == "core" and site.loop in self.planes:
            p = self.planes[site.loop]
            prefix = [self.reference.plane(kind, p)[site.layer][:, :, :t] if kind in self.kinds else x
                      for kind, x in zip("kv", prefix, strict=True)]
        ks.append(k)
        vs.append(v)
        groups = q.shape[1] // k.shape[1]
        keys, values = (torch.cat([x, own], dim=2).repeat_interleave(groups, dim=1)
                        for x, own in zip(prefix, (k, v), strict=True))
        weights = (q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return weights @ values


def sequential_arm(model, ids, R, reference, planes, kinds):
    router = SequentialArm(reference, planes, kinds)
    return torch.cat([model(ids[:, t:t + 1], R, positions=torch.tensor([t]), router=router) for t in range(N)], 1)


@pytest.mark.parametrize(("plane", "region", "kinds"), [(1, "deep", ("k", "v")), (6, "shallow", ("v",)),
                                                        (2, "deep", ("k",))])
def test_substitution_matches_sequential_brute_force(setup, plane, region, kinds):
    model, ids, R, ref = setup
    loops = paper_region(region, R)
    arm = substitute(model, ref, plane, loops, kinds=kinds)
    brute = sequential_arm(model, ids, R, ref, dict.fromkeys(loops, plane), kinds)
    assert ((arm - brute).abs().max() / brute.abs().max()).item() < 1e-11
    kl = kl_per_position(ref.logits, arm)
    assert kl[:, 0].abs().max().item() < 1e-20  # position 0 has no prefix
    assert kl[:, 1:].min().item() > 1e-12  # and the substitution does something elsewhere


def test_deepest_plane_arm(setup):
    model, ids, R, ref = setup
    arm = deepest_plane_arm(model, ref)
    brute = sequential_arm(model, ids, R, ref, dict.fromkeys(range(1, R), R), ("k", "v"))
    assert ((arm - brute).abs().max() / brute.abs().max()).item() < 1e-11
    torch.testing.assert_close(arm, substitute(model, ref, R, range(1, R)), rtol=0, atol=0)


def test_paper_regions():
    assert paper_region("shallow", 32) == tuple(range(2, 10)) and paper_region("deep", 32) == tuple(range(25, 33))
    assert paper_region("shallow", 6) == (1, 2) and paper_region("deep", 6) == (5, 6)  # 0.375->0 (clip 1), 1.69->2
    assert paper_region("shallow", 1) == (1,) and paper_region("deep", 1) == (1,)
    assert paper_region("deep", 64) == tuple(range(50, 65))


def test_kl_per_position():
    p, q = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    expected = torch.nn.functional.kl_div(q.double().log_softmax(-1), p.double().log_softmax(-1), log_target=True,
                                          reduction="none").sum(-1)
    torch.testing.assert_close(kl_per_position(p, q), expected)
    assert kl_per_position(p, p).abs().max().item() < 1e-15


def test_measurements_against_loops(setup):
    model, _, R, ref = setup
    stop, n_core, B = ref.first_decoded, model.config.n_core, 2

    def rel(kind, a, b, layer, text):  # ||X_a - X_b|| / ||X_b|| of one layer and text over the prefix
        xa, xb = ref.plane(kind, a)[layer, text, :, :stop], ref.plane(kind, b)[layer, text, :, :stop]
        return ((xa - xb).norm() / xb.norm()).item()

    region = paper_region("deep", R)
    size = perturbation_size(ref, 1, region)
    for text in range(B):
        expected = math.sqrt(sum(rel(X, 1, r, layer, text) ** 2 for r in region for layer in range(n_core)
                                 for X in "kv"))
        assert size[text].item() == pytest.approx(expected, rel=1e-12)
    values_only = perturbation_size(ref, 1, region, kinds=("v",))
    assert (values_only < size).all()
    delta = ripening(ref)
    for X in "kv":
        assert delta[X].shape == (R,) and delta[X][-1].item() == 0
        for r in (1, R - 1):
            expected = sum(rel(X, r, R, layer, text) for layer in range(n_core) for text in range(B)) / (n_core * B)
            assert delta[X][r - 1].item() == pytest.approx(expected, rel=1e-12)
    per_text = ripening(ref, per_text=True)
    for X in "kv":
        assert per_text[X].shape == (B, R)
        torch.testing.assert_close(per_text[X].mean(0), delta[X], rtol=1e-12, atol=0)
        expected = sum(rel(X, 1, R, layer, 1) for layer in range(n_core)) / n_core
        assert per_text[X][1, 0].item() == pytest.approx(expected, rel=1e-12)
    mature = maturity(ref)
    mature_per_text = maturity(ref, per_text=True)
    for X in "qkv":
        assert mature_per_text[X].shape == (B, R)
        torch.testing.assert_close(mature_per_text[X].mean(0), mature[X], rtol=1e-12, atol=0)
        a, b = ref.plane(X, 1)[:, 1], ref.plane(X, R)[:, 1]  # text 1
        expected = ((a / a.norm(dim=-1, keepdim=True)) * (b / b.norm(dim=-1, keepdim=True))).sum(-1).mean()
        assert mature_per_text[X][1, 0].item() == pytest.approx(expected.item(), rel=1e-12)
        assert mature[X][-1].item() == pytest.approx(1, abs=1e-12)
        a, b = ref.plane(X, 1), ref.plane(X, R)
        expected = ((a / a.norm(dim=-1, keepdim=True)) * (b / b.norm(dim=-1, keepdim=True))).sum(-1).mean()
        assert mature[X][0].item() == pytest.approx(expected.item(), rel=1e-12)


def test_bad_parameters(setup):
    model, ids, R, ref = setup
    only_v = replay(model, ids, R, record=("v",), loops=(R,), decoded=DECODED)
    bad = [
        (lambda: replay(model, ids, R, record=("k", "x")), "record"),
        (lambda: replay(model, ids, R, record="kv"), "record"),
        (lambda: replay(model, ids, R, loops=(0, 1)), "loops"),
        (lambda: replay(model, ids, R, decoded=N), "decoded"),
        (lambda: replay(model, ids, R, decoded=0), "decoded"),
        (lambda: replay(model, ids, R, softmax_dtype=torch.bfloat16), "softmax_dtype"),
        (lambda: substitute(model, ref, R + 1, [1]), "plane"),
        (lambda: substitute(model, ref, 0, [1]), "plane"),
        (lambda: substitute(model, ref, 1, []), "region"),
        (lambda: substitute(model, ref, 1, [R + 1]), "region"),
        (lambda: substitute(model, ref, 1, [2], kinds=("q",)), "kinds"),
        (lambda: substitute(model, only_v, R, [1], kinds=("k", "v")), "not recorded"),
        (lambda: perturbation_size(only_v, R, [1], kinds=("v",)), "not recorded"),
        (lambda: paper_region("middle", R), "region name"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()
