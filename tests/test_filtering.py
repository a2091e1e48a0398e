"""RIPE Sec. 5.4's per-head position filtering (looped_kv.analysis.filtering) against independent computations."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

from looped_kv.analysis import filtering as F
from looped_kv.analysis.replay import deepest_plane_arm, kl, replay

torch.set_num_threads(1)
N, DECODED = 24, 4


@pytest.fixture(scope="module", params=["huginn", "raven"])
def setup(request):
    model = random_model(request.param)
    ids = torch.randint(0, model.config.vocab_size, (3, N), generator=torch.Generator().manual_seed(1))
    R = model.config.mean_recurrence
    return model, ids, R, replay(model, ids, R, softmax_dtype=torch.float64, decoded=DECODED)


def test_keeping_everything_is_the_reference_and_the_deepest_plane_arm(setup):
    model, _, _, ref = setup
    t0 = ref.first_decoded
    assert (F.filter_kl(model, ref, None) == 0).all()
    deepest = kl(ref.logits[:, t0], deepest_plane_arm(model, ref)[:, t0]).clamp_min(0).numpy()
    assert (F.filter_kl(model, ref, None, deepest=True) == deepest).all()


def test_attention_of_the_first_decoded_query(setup):
    model, ids, R, _ = setup
    weights = F.first_query_attention(model, ids, R, 1, decoded=DECODED)
    assert weights.shape == (3, model.config.n_core, model.config.n_kv_heads, N - DECODED)
    groups = model.config.n_heads // model.config.n_kv_heads
    total = weights.sum(-1)  # each query head's weights sum to 1 with its own position: below groups
    assert (weights >= 0).all() and (total <= groups + 1e-12).all() and (total > 0).all()


def test_reading_fewer_positions_changes_the_output_and_one_head_less_than_all(setup):
    model, ids, R, ref = setup
    weights = F.first_query_attention(model, ids, R, 1, decoded=DECODED)
    keep = F.top_k(weights, 0.25)
    assert (keep.sum(-1) == F.budget_positions(N - DECODED, 0.25)).all()
    assert (F.filter_kl(model, ref, keep) > 0).all()
    one = F.only_head(keep, 0, 0)
    assert one[:, 0, 0].equal(keep[:, 0, 0]) and one[:, 1:].all() and one[:, 0, 1:].all()


def test_frozen_policy_is_one_set_per_head():
    calibration = torch.rand(5, 2, 3, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    keep = F.frozen(calibration, 0.1, texts=4)
    assert keep.shape == (4, 2, 3, 40) and (keep == keep[:1]).all()
    assert keep[0].equal(F.top_k(calibration.mean(0), 0.1))
    assert (keep.sum(-1) == 4).all()


def test_selection_loop_and_budget():
    assert F.selection_loop(2, 32) == 2 and F.selection_loop(4, 32) == 4 and F.selection_loop(2, 4) == 1
    assert F.budget_positions(95, 0.10) == 10 and F.budget_positions(3, 0.10) == 1
    with pytest.raises(ValueError):
        F.budget_positions(10, 0)
    with pytest.raises(ValueError):
        F.selection_loop(0, 32)


def test_filtering_verdicts_follow_the_paper_on_data_shaped_like_its_findings():
    import numpy as np

    from looped_kv.analysis.claims import filtering_verdicts
    from looped_kv.analysis.verdicts import AGREES, INCONCLUSIVE

    rng = np.random.default_rng(0)
    deepest = 10 ** rng.normal(-5, 0.3, 40)
    top = 10 ** rng.normal(-3, 0.3, 40)
    per_head = top * 10 ** rng.normal(1, 0.1, 40)  # 10x top-k, far above the deepest plane
    kl = {"deepest plane": deepest, "per-head": per_head, "top-k": top,
          "per-head and deepest plane": (per_head + deepest) * 10 ** rng.normal(0, 0.05, 40),
          "per-head, later loop": per_head * 10 ** rng.normal(-1, 0.1, 40)}
    verdicts = filtering_verdicts(kl, floor=1e-9)
    assert all(v.label == AGREES for v in verdicts.values()), {k: v.short for k, v in verdicts.items()}
    at_floor = filtering_verdicts({**kl, "deepest plane": np.full(40, 1e-12)}, floor=1e-9)
    assert at_floor["filtering over deepest plane"].label == INCONCLUSIVE
    # chapter 3: per-text ratios 10,000x, but a few texts' large deepest-plane KLs made the ratio of means 0.25
    swamped = deepest.copy()
    swamped[:3] = 1.0
    mixed = filtering_verdicts({**kl, "deepest plane": swamped}, floor=1e-9)["filtering over deepest plane"]
    assert mixed.label == INCONCLUSIVE and "decides its direction" in mixed.reason
    with pytest.raises(ValueError):
        filtering_verdicts({"per-head": per_head}, floor=1e-9)
