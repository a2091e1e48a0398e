"""Measurements on trajectories (looped_kv.analysis.measure) and the Chapter 4 helpers (looped_kv.analysis.ripe).

Random float64 models of both families: exact-arithmetic facts (Proposition 1, full-cache replay equal to
the cache-free forward, d = R drafts equal to the target) hold to rounding, and block-dependent caches
are measurably different.
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import random_model

from looped_kv import generate, huginn_0125, make_policy, papers
from looped_kv.analysis import verdicts
from looped_kv.analysis.measure import (
    KL_RESOLUTION,
    agreement_by_prompt,
    block_dependence,
    channel_verdict,
    draft_agreement,
    draft_agreement_rows,
    kl,
    policy_logits,
    read_depth_grid,
    row_tau,
)
from looped_kv.analysis.planes import in_dtype
from looped_kv.analysis.ripe import (
    acceptance_by_cache,
    batched_vs_sequential,
    block_starts,
    extra_over_deepest,
    kl_by_prompt,
    kl_ratio_verdict,
    past_end_of_text,
    prompt_planes,
    read_map,
    replay_batch,
    replay_records,
    scale_windows,
    survival,
    tail_counts_by_prompt,
    tail_summary,
    top_share,
)
from looped_kv.analysis.verdicts import AGREES, DISAGREES, INCONCLUSIVE
from looped_kv.decoding.greedy import greedy

FAMILIES = ["huginn", "raven"]
R = 6  # the random models' mean recurrence


def trajectory(model, prompt_length: int = 9, new: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_length), generator=generator)
    return greedy(model, ids, new, policy=make_policy("full", R)).tokens


@pytest.fixture(scope="module", params=FAMILIES)
def model_and_tokens(request):
    model = random_model(request.param, seed=3)
    return model, trajectory(model)


# -- measure.policy_logits and kl ------------------------------------------------------------------


def test_full_policy_replay_equals_the_cache_free_forward(model_and_tokens):
    model, tokens = model_and_tokens
    p = 9
    replay = policy_logits(model, tokens, p, make_policy("full", R))
    with torch.no_grad():
        forward = model(tokens, num_loops=R)[0, p - 1:-1]
    assert replay.shape == (tokens.shape[1] - p, model.config.vocab_size)
    assert replay.dtype == torch.float64
    torch.testing.assert_close(replay, forward, rtol=0, atol=1e-10)
    # the trajectory is greedy under the full cache: its replay predicts every generated token
    assert torch.equal(replay.argmax(-1), tokens[0, p:])


def test_replay_under_a_lossy_policy_differs(model_and_tokens):
    model, tokens = model_and_tokens
    full = policy_logits(model, tokens, 9, make_policy("full", R))
    deepest = policy_logits(model, tokens, 9, make_policy("deepest", R))
    wide = policy_logits(model, tokens, 9, make_policy("ripe", R, window=tokens.shape[1]))
    assert torch.allclose(full[0], deepest[0], rtol=0, atol=1e-12)  # the first position reads only the prompt
    assert (full[1:] - deepest[1:]).abs().max() > 1e-6  # later positions read the prompt's deepest plane
    torch.testing.assert_close(wide, full, rtol=0, atol=1e-10)  # a window over everything is the full cache


def test_kl_is_zero_for_equal_logits_and_matches_its_definition():
    generator = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(5, 11, generator=generator), torch.randn(5, 11, generator=generator)
    assert torch.all(kl(p_logits, p_logits).abs() < 1e-15)
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    torch.testing.assert_close(kl(p_logits, q_logits), (p * (p / q).log()).sum(-1))
    assert torch.all(kl(p_logits, q_logits) > 0)
    assert kl(p_logits, q_logits).dtype == torch.float64


# -- measure.block_dependence ----------------------------------------------------------------------


# measure.kl computes sum p (log p - log q) from two log-softmaxes: for logits equal up to float64 rounding
# (~1e-14) that has a rounding floor near 1e-16, of either sign, while the true KL is ~1e-28. The floor is
# what the first test allows; the second states the < 1e-20 an accurate kl gives (see the chapter's report).
KL_ROUNDING_FLOOR = 1e-14


def test_block_dependence_vanishes_for_block_independent_caches(model_and_tokens):
    model, tokens = model_and_tokens
    gamma = 3
    for policy in (make_policy("full", R), make_policy("ripe", R, window=gamma),
                   make_policy("ripe", R, window=gamma + 3)):
        divergence = block_dependence(model, tokens, 9, policy, gamma)
        assert divergence.numel() == (tokens.shape[1] - 9) // (gamma + 1) * (gamma + 1)
        assert divergence.abs().max() < KL_ROUNDING_FLOOR, policy.name


def test_block_dependence_is_below_1e_20_for_block_independent_caches(model_and_tokens):
    model, tokens = model_and_tokens
    for policy in (make_policy("full", R), make_policy("ripe", R, window=4)):
        assert block_dependence(model, tokens, 9, policy, 4).abs().max() < 1e-20, policy.name


def test_block_dependence_is_clearly_positive_for_the_deepest_plane(model_and_tokens):
    model, tokens = model_and_tokens
    gamma = 3
    for policy in (make_policy("deepest", R), make_policy("ripe", R, window=gamma - 1)):
        divergence = block_dependence(model, tokens, 9, policy, gamma)
        assert divergence.max() > 1e-8, policy.name
        # the first token of each block reads only the cache: nothing of the block to differ on
        assert divergence.view(-1, gamma + 1)[:, 0].abs().max() < KL_ROUNDING_FLOOR


def test_block_dependence_of_a_trajectory_too_short_for_a_block_is_empty(model_and_tokens):
    model, tokens = model_and_tokens
    assert block_dependence(model, tokens[:, :12], 9, make_policy("deepest", R), 4).numel() == 0


# -- measure.draft_agreement -----------------------------------------------------------------------


def test_full_depth_aligned_drafts_agree_with_the_target_everywhere(model_and_tokens):
    model, tokens = model_and_tokens
    result = draft_agreement(model, tokens, 9, draft_loops=[R, 1], reads=["aligned", "deep-kv"])
    assert result[(R, "aligned")] == 1.0
    assert result["n"] == tokens.shape[1] - 1 - 9
    assert all(0 <= v <= 1 for k, v in result.items() if k != "n")
    assert result[(1, "aligned")] < 1.0  # one loop of a random model is not the target


def test_agreement_by_prompt_is_draft_agreement_of_each_prompt_decoded_alone():
    model = random_model("raven", seed=3)
    prompts = [torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n)) for n in (4, 7, 5)]
    reads = ["aligned", "deep-v", (3, R)]
    frame = agreement_by_prompt(model, prompts, 9, [1, 2, R], reads, stop_at_eos=False)
    assert len(frame) == 3 * 3 * len(reads) and (frame["positions"] == 8).all()
    for i, ids in enumerate(prompts):
        tokens = greedy(model, ids, 9, policy=make_policy("full", R)).tokens
        alone = draft_agreement(model, tokens, prompts[i].shape[1], [1, 2, R], reads)
        for (d, spec), value in ((k, v) for k, v in alone.items() if k != "n"):
            row = frame[(frame["prompt"] == i) & (frame["d"] == d) & frame["read"].map(lambda r, s=spec: r == s)]
            assert row["agreement"].item() == value, (i, d, spec)
    assert (frame[(frame["d"] == R) & (frame["read"] == "aligned")]["agreement"] == 1).all()
    passes = agreement_by_prompt(model, prompts, 9, [1, 2, R], reads, stop_at_eos=False, rows_per_chunk=2)
    assert passes.equals(frame)  # one row chunk at a time: the same rows, in the same order


def test_agreement_by_prompt_stops_rows_at_end_of_text():
    model = random_model("huginn", seed=4)
    prompts = [torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 6)]
    first = greedy(model, prompts[0], 1, policy=make_policy("full", R)).new_tokens[0, 0].item()
    frame = agreement_by_prompt(model, prompts, 6, [1], ["aligned"], eos_token_id=first)
    assert frame.set_index("prompt").loc[0, "positions"] == 0 and np.isnan(frame.loc[0, "agreement"])
    assert frame.set_index("prompt").loc[1, "positions"] >= 1


def test_channel_verdict_pairs_prompts_and_checks_the_ceiling():
    rng = np.random.default_rng(0)
    n = 40
    k = rng.uniform(0.3, 0.6, n)
    frame = pd.DataFrame([{"prompt": p, "d": 1, "read": read, "agreement": value, "positions": 10}
                          for read, values in (("deep-v", k + 0.2), ("deep-k", k)) for p, value in enumerate(values)])
    result = channel_verdict(frame)
    assert result.label == AGREES and result.estimate == pytest.approx(0.2) and result.n == n
    assert channel_verdict(frame, a="deep-k", b="deep-v").label == DISAGREES
    ceiling = frame.assign(agreement=np.where(frame["read"] == "deep-k", 0.99, 0.996))
    saturated = channel_verdict(ceiling)
    assert saturated.label == INCONCLUSIVE and "agreement of deep-k drafts at d = 1" in saturated.reason
    assert "too few units (10 prompts" in channel_verdict(frame[frame["prompt"] < 10]).reason
    with pytest.raises(ValueError, match="d must be one of"):
        channel_verdict(frame, d=2)
    with pytest.raises(ValueError, match="b must be one of"):
        channel_verdict(frame, b="aligned")


# -- bad arguments ---------------------------------------------------------------------------------


def test_bad_measurement_arguments_raise(model_and_tokens):
    model, tokens = model_and_tokens
    full = make_policy("full", R)
    for p in (0, tokens.shape[1]):
        with pytest.raises(ValueError, match="prompt_length must be in"):
            policy_logits(model, tokens, p, full)
    for d in (0, R + 1):
        with pytest.raises(ValueError, match="draft_loops must be in"):
            draft_agreement(model, tokens, 9, draft_loops=[d], reads=["aligned"])
    with pytest.raises(ValueError, match="prefix_reads must be one of"):
        draft_agreement(model, tokens, 9, draft_loops=[2], reads=["shallow"])
    with pytest.raises(ValueError, match="capacity"):  # longer than the model's context
        policy_logits(model, torch.zeros(1, model.config.block_size + 1, dtype=torch.long), 3, full)


def test_block_dependence_and_draft_agreement_validate_their_arguments(model_and_tokens):
    model, tokens = model_and_tokens
    deepest = make_policy("deepest", R)
    for kwargs in ({"prompt_length": 9, "gamma": 0}, {"prompt_length": 0, "gamma": 2},
                   {"prompt_length": tokens.shape[1], "gamma": 2}):
        with pytest.raises(ValueError):
            block_dependence(model, tokens, policy=deepest, **kwargs)
    with pytest.raises(ValueError):
        draft_agreement(model, tokens, tokens.shape[1] - 1, draft_loops=[2], reads=["aligned"])


# -- ripe_measure: the policy map, windows and memory -----------------------------------------------


def test_read_map_is_equation_9():
    t, W = 12, 3
    assert read_map(make_policy("full", R), t).tolist() == [[r] * t for r in range(1, R + 1)]
    assert (read_map(make_policy("deepest", R), t) == R).all()
    ripe = read_map(make_policy("ripe", R, window=W), t)
    assert ripe.shape == (R, t)
    for r in range(1, R + 1):
        assert ripe[r - 1].tolist() == [r if t - j <= W else R for j in range(t)]
    sinks = read_map(make_policy("sinks", R, sinks=2), t)
    assert (sinks[:, :2] == np.arange(1, R + 1)[:, None]).all() and (sinks[:, 2:] == R).all()
    with pytest.raises(ValueError, match="query must be >= 1"):
        read_map(make_policy("full", R), 0)


def test_scale_windows():
    windows = papers.RIPE_TABLE_4_SETUP["windows"]  # 16, 64, 256
    assert scale_windows(windows, 1000) == (windows, 1)
    assert scale_windows(windows, 256) == ((8, 32, 128), 2)
    assert scale_windows(windows, 100) == ((4, 16, 64), 4)
    assert scale_windows(windows, 2) == ((1, 1, 1), 256)
    for bad in ([], [0, 4]):
        with pytest.raises(ValueError, match="windows must be"):
            scale_windows(bad, 100)
    with pytest.raises(ValueError, match="shortest_length"):
        scale_windows((16,), 1)


def test_extra_memory_reproduces_table_4():
    """Table 4's "Extra MB" column (Huginn-0125, L = 1024, bf16) from the memory equations."""
    cfg, setup = huginn_0125(), papers.RIPE_TABLE_4_SETUP
    policies = {"deepest plane (W = 0)": make_policy("deepest", 32),
                **{f"RIPE, W = {w}": make_policy("ripe", 32, window=w) for w in setup["windows"]},
                f"+ {setup['sinks']} sinks": make_policy("sinks", 32, sinks=setup["sinks"]),
                "two planes (s8)": make_policy("k-deepest", 32, k=2)}
    assert set(policies) == set(papers.RIPE_TABLE_4) - {"fp32 full cache"}
    extra = papers.RIPE_TABLE_4_COLUMNS.index("extra MB")
    for label, policy in policies.items():
        assert round(extra_over_deepest(cfg, policy, setup["length"]) / 1e6) == papers.RIPE_TABLE_4[label][extra], label


# -- ripe_measure: Proposition 1 ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_vs_sequential_is_proposition_1(family):
    model = random_model(family, seed=11)
    tokens = torch.randint(0, 50, (1, 15), generator=torch.Generator().manual_seed(4))
    for policy in (make_policy("full", R), make_policy("ripe", R, window=4), make_policy("ripe", R, window=9)):
        same = batched_vs_sequential(model, tokens, 10, policy)  # a block of gamma + 1 = 5 tokens
        assert same.logits < 1e-12 and same.planes < 1e-12 and same.targets_equal, policy.name
    for policy in (make_policy("deepest", R), make_policy("ripe", R, window=3)):
        differ = batched_vs_sequential(model, tokens, 10, policy)
        assert differ.logits > 1e-8 and differ.planes > 1e-8, policy.name
    with pytest.raises(ValueError, match="start must be in"):
        batched_vs_sequential(model, tokens, 15, make_policy("full", R))


# -- ripe_measure: Table 4, Figure 4 and Section 5.2 -------------------------------------------------


def test_replay_records(model_and_tokens):
    model, tokens = model_and_tokens
    other = trajectory(model, prompt_length=6, new=10, seed=1)
    full = make_policy("full", R)
    arms = {"same": (model, full), "deepest": (model, make_policy("deepest", R)),
            "float32": (copy.deepcopy(model).float(), full)}
    records = replay_records([tokens, other], [9, 6], (model, full), arms).records
    assert list(pd.unique(records["arm"])) == ["same", "deepest", "float32"]
    assert len(records) == 3 * ((tokens.shape[1] - 9) + (other.shape[1] - 6))
    same = records[records["arm"] == "same"]
    assert (same["kl"] == 0).all() and not same["flip"].any()
    assert records.loc[records["arm"] == "deepest", "kl"].max() > 1e-6
    low = records.loc[records["arm"] == "float32", "kl"]
    assert 0 < low.max() < 1e-3 * records.loc[records["arm"] == "deepest", "kl"].max()  # a precision change
    assert (records["kl"] >= 0).all() and records["margin"].between(0, 1).all()
    assert records.groupby("arm")["position"].min().eq(0).all()
    with pytest.raises(ValueError, match="equal length"):
        replay_records([tokens], [9, 6], (model, full), arms)
    with pytest.raises(ValueError, match="at least one"):
        replay_records([tokens], [9], (model, full), {})
    with pytest.raises(ValueError, match=r"prompt_lengths\[0\] must be in"):
        replay_records([tokens], [0], (model, full), arms)


def synthetic_records() -> pd.DataFrame:
    return pd.DataFrame({"prompt": [0, 0, 1, 1, 0, 0, 1, 1], "position": [0, 1] * 4,
                         "arm": ["a"] * 4 + ["b"] * 4, "kl": [0.5, 0.01, 0.2, 0.0, 0.0, 0.0, 0.05, 0.11],
                         "flip": [True, False, True, False, False, False, False, True]})


def test_records_past_end_of_text_are_marked():
    """The tiny profile decodes past end-of-text (chapter 4): the records say which positions a decoder that stops
    there never emits; an end-of-text itself is in the text."""
    records = synthetic_records()
    sequences = [torch.tensor([7, 7, 2, 9]), torch.tensor([7, 3, 2, 9])]  # prompts of 2 and 1 tokens, eos = 9
    past = past_end_of_text(records, sequences, [2, 1], eos_token_id=9)
    assert past.tolist() == [False, False, False, False] * 2  # prompt 0: eos at position 1; prompt 1: at 2
    past = past_end_of_text(records, sequences, [2, 1], eos_token_id=2)
    assert past.tolist() == [False, True, False, False] * 2  # eos at 0 (prompt 0) and 1 (prompt 1)


def test_tail_summary_and_counts():
    summary = tail_summary(synthetic_records(), threshold=0.1)
    assert list(summary.index) == ["a", "b"]
    assert summary.loc["a", "tail"] == 2 and summary.loc["b", "tail"] == 1
    assert summary.loc["a", "max KL"] == 0.5 and summary.loc["b", "max KL"] == 0.11
    assert summary.loc["a", "flips"] == 2 and summary.loc["b", "flips"] == 1
    assert summary.loc["a", "tail prompts"] == 2 and summary.loc["b", "positions"] == 4
    assert summary.loc["a", "top 1% share"] == pytest.approx(0.5 / 0.71)
    assert tail_counts_by_prompt(synthetic_records(), "a", [0, 1, 2]).tolist() == [1, 1, 0]
    with pytest.raises(ValueError, match="no records"):
        tail_counts_by_prompt(synthetic_records(), "c", [0])
    with pytest.raises(ValueError, match="missing"):
        tail_summary(synthetic_records().drop(columns="flip"))


def test_survival_and_top_share():
    x, s = survival([0.3, 0.1, 0.2, 0.4])
    assert x.tolist() == [0.1, 0.2, 0.3, 0.4] and s.tolist() == [1.0, 0.75, 0.5, 0.25]
    with pytest.raises(ValueError, match="empty"):
        survival([])
    assert top_share([1.0] + [0.0] * 99) == 1.0
    assert top_share(np.ones(200)) == pytest.approx(0.01)
    assert np.isnan(top_share(np.zeros(5)))
    with pytest.raises(ValueError, match="fraction"):
        top_share([1.0, 2.0], fraction=0)


def test_replay_batch_is_policy_logits_and_block_dependence_of_every_row(model_and_tokens):
    model, tokens = model_and_tokens
    other = trajectory(model, prompt_length=5, new=9, seed=2)  # shorter prompt, fewer generated tokens
    rows, prompts = [tokens, other, tokens[:, :11]], [9, 5, 9]  # the last row holds no block of 4
    policies = (make_policy("full", R), make_policy("deepest", R), make_policy("ripe", R, window=2),
                make_policy("sinks", R, sinks=2), make_policy("k-deepest", R, k=2))
    for policy in policies:  # each policy stores its part of the shared prefill
        for gamma in (3, 4):  # blocks ending at and before a trajectory's last token
            replays = replay_batch(model, rows, prompts, policy, gamma)
            for arm, row, p in zip(replays, rows, prompts, strict=True):
                alone = policy_logits(model, row, p, policy)
                assert arm.logits.shape == alone.shape
                assert (arm.logits.double() - alone).abs().max() < 1e-10, policy.name
                expected = block_dependence(model, row, p, policy, gamma)
                assert arm.block_kl.shape == expected.shape
                assert torch.allclose(arm.block_kl, expected, rtol=1e-6, atol=1e-14), policy.name
    assert all(r.block_kl is None for r in replay_batch(model, rows, prompts, make_policy("full", R)))
    shared = prompt_planes(model, rows, prompts, R)  # one prefill serves every policy, bit for bit
    for policy in policies:  # without it, the prefill runs straight into the policy's cache
        own, reused = (replay_batch(model, rows, prompts, policy, 3, planes) for planes in (None, shared))
        for a, b in zip(own, reused, strict=True):
            assert torch.equal(a.logits, b.logits) and torch.equal(a.block_kl, b.block_kl), policy.name
    with pytest.raises(ValueError, match="prompts must hold the planes of the 2 trajectories"):
        replay_batch(model, rows[:2], prompts[:2], make_policy("full", R), prompts=shared)
    with pytest.raises(ValueError, match=r"prompt_lengths\[0\] must be in"):
        replay_batch(model, [tokens], [0], make_policy("full", R))
    with pytest.raises(ValueError, match=r"gamma must be >= 1"):
        replay_batch(model, [tokens], [9], make_policy("full", R), 0)


def test_block_starts_cut_the_generated_tokens_into_whole_blocks():
    assert list(block_starts(12, 3)) == [0, 4, 8]  # blocks 0-3, 4-7, 8-11
    assert list(block_starts(11, 3)) == [0, 4]
    assert list(block_starts(4, 4)) == []


def test_replay_records_with_block_dependence(model_and_tokens):
    model, tokens = model_and_tokens
    other = trajectory(model, prompt_length=5, new=12, seed=2)
    full, deepest = make_policy("full", R), make_policy("deepest", R)
    arms = {"deepest": (model, deepest), "W = 3": (model, make_policy("ripe", R, window=3))}
    out = replay_records([tokens, other], [9, 5], (model, full), arms, gamma=3, block_arms=["deepest", "W = 3"],
                         reference_label="full")
    frame = out.block_dependence
    assert frame.shape == (2, 3) and list(frame.columns) == ["full", "deepest", "W = 3"]
    assert (frame["full"] < KL_ROUNDING_FLOOR).all() and (frame["W = 3"] < KL_ROUNDING_FLOOR).all()
    assert (frame["deepest"] > 1e-10).all()
    expected = block_dependence(model, other, 5, deepest, 3).clamp_min(0).mean()
    assert frame.loc[1, "deepest"] == pytest.approx(float(expected))
    assert replay_records([tokens], [9], (model, full), arms).block_dependence is None
    short = replay_records([tokens[:, :12]], [9], (model, full), arms, gamma=3, block_arms=["deepest"])
    assert short.block_dependence.isna().all().all()  # 3 generated tokens hold no block of 4
    chunked = replay_records([tokens, other], [9, 5], (model, full), arms, gamma=3, block_arms=["deepest", "W = 3"],
                             reference_label="full", batch_size=1)
    pd.testing.assert_frame_equal(chunked.block_dependence, frame, rtol=1e-6)
    together = out.records.sort_values(["prompt", "arm", "position"], ignore_index=True)
    alone = chunked.records.sort_values(["prompt", "arm", "position"], ignore_index=True)
    assert together[["prompt", "arm", "position", "flip"]].equals(alone[["prompt", "arm", "position", "flip"]])
    assert np.allclose(together["kl"], alone["kl"], rtol=1e-6, atol=1e-14)
    with pytest.raises(ValueError, match="batch_size must be"):
        replay_records([tokens], [9], (model, full), arms, batch_size=0)
    with pytest.raises(ValueError, match=r"gamma must be >= 1"):
        replay_records([tokens], [9], (model, full), arms, gamma=0)
    with pytest.raises(ValueError, match="block_arms must name arms"):
        replay_records([tokens], [9], (model, full), arms, gamma=3, block_arms=["two planes"])


def test_in_dtype_copies_only_when_needed():
    model = random_model("huginn", seed=1)
    model.tokenizer, model.source = "a tokenizer", "random"
    assert in_dtype(model, torch.float64) is model
    low = in_dtype(model, torch.bfloat16)
    assert low is not model and low.dtype == torch.bfloat16 and model.dtype == torch.float64
    assert low.tokenizer == "a tokenizer" and low.source == "random" and model.tokenizer == "a tokenizer"
    up = in_dtype(low, torch.float32)
    assert torch.equal(up.transformer.wte.weight, low.transformer.wte.weight.float())


# -- batched draft agreement and acceptance -----------------------------------------------------------


def test_draft_agreement_rows_equals_draft_agreement_row_by_row(model_and_tokens):
    model, _ = model_and_tokens
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 50, (n,), generator=generator) for n in (9, 5, 7)]
    out = generate(model, prompts, max_new_tokens=[10, 7, 1], stop_at_eos=False)
    frame = draft_agreement_rows(model, out, [1, 2, R], ["aligned", "deep-kv"])
    assert frame["n"].tolist() == [9, 6, 0]
    assert frame.loc[2].drop("n").isna().all()  # one generated token: nothing to draft
    for row in (0, 1):
        alone = draft_agreement(model, out.sequences[row][None], out.prompt_lengths[row], [1, 2, R],
                                ["aligned", "deep-kv"])
        for key, value in alone.items():
            if key != "n":
                assert frame.loc[row, key] == pytest.approx(value), (row, key)
    assert (frame.loc[[0, 1], (R, "aligned")] == 1.0).all()
    with pytest.raises(ValueError, match="draft_loops must be in"):
        draft_agreement_rows(model, out, [R + 1])


def test_acceptance_by_cache_pairs_each_prompts_tau():
    model = random_model("huginn", seed=5)
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 50, (n,), generator=generator) for n in (6, 9, 4)]
    caches = {"full": {"cache": "full"}, "RIPE, W = 4": {"cache": "ripe", "window": 4},
              "deepest": {"cache": "deepest", "exact": False, "prefix_reads": "deep-kv"}}
    out = acceptance_by_cache(model, prompts, caches, 8, draft_loops=2, gamma=4)
    assert list(out.tau.columns) == list(caches) and len(out.tau) == 3
    assert ((out.tau >= 1) & (out.tau <= 5)).all().all()
    for label, run in out.runs.items():
        assert np.allclose(out.tau[label], row_tau(run))
        pooled = sum(sum(a) + sum(u) for a, u in zip(run.row_accepted, run.row_retained, strict=True))
        assert run.tau == pytest.approx(pooled / run.verifications)
        assert out.tau[label].to_numpy() @ np.array([len(a) for a in run.row_accepted]) == pytest.approx(pooled)
    with pytest.raises(ValueError, match="cache arguments only"):
        acceptance_by_cache(model, prompts, {"x": {"gamma": 3}}, 8, draft_loops=2, gamma=4)
    with pytest.raises(ValueError, match="at least one cache"):
        acceptance_by_cache(model, prompts, {}, 8, draft_loops=2, gamma=4)
    with pytest.raises(ValueError, match="speculative decoder"):
        row_tau(generate(model, prompts, max_new_tokens=3))


def test_kl_by_prompt_and_kl_ratio_verdict():
    records = synthetic_records()
    assert kl_by_prompt(records, "a").to_dict() == pytest.approx({0: 0.255, 1: 0.1})
    with pytest.raises(ValueError, match="no records"):
        kl_by_prompt(records, "c")
    claim = verdicts.Claim("a exceeds b", "test", "greater", "log-ratio", minimum=2, minimum_source="test")
    rng = np.random.default_rng(0)
    reference = rng.uniform(1e-6, 2e-6, 40)
    higher = kl_ratio_verdict(claim, 3 * reference, reference, ("a", "b"))
    assert higher.label == verdicts.AGREES and higher.estimate == pytest.approx(3.0)
    assert higher.n == 40
    few = kl_ratio_verdict(claim, 3 * reference[:10], reference[:10], ("a", "b"))
    assert few.label == verdicts.INCONCLUSIVE and "too few units (10 prompts" in few.reason
    at_floor = np.where(np.arange(40) < 30, 0.0, reference)  # most prompts below the resolution
    floored = kl_ratio_verdict(claim, 3 * reference, at_floor, ("a", "b"))
    assert floored.label == verdicts.INCONCLUSIVE and "float floor" in floored.reason
    assert np.isfinite(floored.estimate)  # zeros enter at KL_RESOLUTION
    with_nan = kl_ratio_verdict(claim, np.r_[3 * reference, np.nan], np.r_[reference, 1.0], ("a", "b"))
    assert with_nan.n == 40
    assert KL_RESOLUTION > 0
    with pytest.raises(ValueError, match="log-ratio"):
        kl_ratio_verdict(verdicts.Claim("x", "y", minimum=1, minimum_source="test"), reference, reference, ("a", "b"))
    with pytest.raises(ValueError, match="paired per prompt"):
        kl_ratio_verdict(claim, reference, reference[:3], ("a", "b"))


def test_the_read_depth_grid_is_das_figure_4s():
    """Chapter 5's grid read the prefix at depth 1, below the draft's 2 loops and outside DAS Figure 4's 2..R, and its
    spans came from that row."""
    assert read_depth_grid(32) == (2, 4, 8, 16, 32) and read_depth_grid(4) == (2, 4)
    assert read_depth_grid(12) == (2, 4, 8, 12)
    with pytest.raises(ValueError, match="num_loops must be >= 3"):
        read_depth_grid(2)


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_readouts_are_the_decoders_own_draft_passes(family):
    """The read-outs (one forward per read, read out on the way) pick what a d-loop draft pass of the decode loop
    picks, for every depth and prefix read, in float64."""
    from looped_kv.analysis.teacher_forcing import draft_readouts
    from looped_kv.decoding.passes import Passes, new_cache
    from looped_kv.runtime.policy import make_prefix_reads

    model = random_model(family, seed=5).double()
    tokens = trajectory(model, new=4, seed=1)
    cache = new_cache(model, make_policy("full", R), 2, 32)
    passes = Passes(model, cache, width=1)
    passes.prefill([tokens[0, :9], tokens[0, :11]])
    pending = torch.stack([tokens[0, 9:10], tokens[0, 11:12]])
    reads = {spec: make_prefix_reads(spec, R) for spec in ("aligned", "deep-kv", (2, 3))}
    got = draft_readouts(model, cache, pending, [1, 3, R], reads)
    for (d, spec), draft in got.items():
        logits, _, _ = passes.run(pending, d, reads=reads[spec], store=None)
        assert torch.equal(draft, logits[:, -1].argmax(-1)), (d, spec)
    assert len(got) == 9


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forcing_a_greedy_trajectory_is_its_decoding_bit_for_bit(family):
    """force is the decode loop with ForcedTokens: replaying greedy decoding's own tokens under its policy gives the
    logits that chose them, exactly; a different token forced in changes what follows."""
    from looped_kv.analysis.teacher_forcing import force
    from looped_kv.decoding.loop import LogitsRecorder, decode

    model = random_model(family, seed=7)
    prompt = torch.randint(0, 50, (9,), generator=torch.Generator().manual_seed(2))
    for policy in (make_policy("full", R), make_policy("deepest", R), make_policy("ripe", R, window=2),
                   make_policy("sinks", R, sinks=2)):
        recorder = LogitsRecorder()
        out = decode(model, [prompt], [8], policy=policy, observer=recorder)
        sequence = out.sequences[0]
        forced = force(model, [sequence], [9], policy)
        assert torch.equal(forced.row_logits(0), recorder.logits(0)), policy.name
        changed = sequence.clone()
        changed[11] = (changed[11] + 1) % 50
        other = force(model, [changed], [9], policy).row_logits(0)
        assert torch.equal(other[:3], recorder.logits(0)[:3]) and not torch.equal(other[3], recorder.logits(0)[3])
