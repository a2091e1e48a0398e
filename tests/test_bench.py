"""The paired benchmark: timing and batched acceptance runs, ceilings, summaries and the DAS verdicts."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import random_model

from looped_kv import generate, profiles
from looped_kv.analysis.fits import interaction_effect
from looped_kv.analysis.verdicts import AGREES, DISAGREES, IDENTICAL, INCONCLUSIVE, Claim
from looped_kv.decoding import settings
from looped_kv.experiments import bench
from looped_kv.runtime.config import PRESETS
from looped_kv.runtime.measurement import source_commit

SMALL_WAVE = {"max_width": 4, "rounds": 3, "initial_width": 2, "updates": 1}


def prompts(model, lengths=(5, 3, 7)):
    return [torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            for n in lengths]


def test_method_configs_use_one_vocabulary():
    configs = bench.method_configs(draft_loops=2, gamma=3, wave={"updates": 1})
    assert tuple(configs) == settings.METHODS
    assert all(isinstance(c, settings.CONFIGS[name]) and c.method == name for name, c in configs.items())
    spec, mature = configs["self-spec"], configs["mature-spec"]
    assert (spec.draft_loops, spec.gamma) == (mature.draft_loops, mature.gamma) == (2, 3)
    assert configs["pld"] == settings.PromptLookup(gamma=3) and configs["ar"] == settings.Greedy()
    # J left to the R decoded at (settings.default_rounds); the other fields of the paper's schedule, k changed
    assert configs["das-wave"] == settings.DasWave(max_width=32, initial_width=2, updates=1, carry=True)
    assert configs["das-wave"].rounds is None
    assert bench.method_configs(wave={"rounds": 5})["das-wave"].rounds == 5
    chosen = bench.method_configs(draft_loops=2, gamma=3, methods=("das-wave", "ar"))  # in METHODS' order
    assert list(chosen.items()) == [("ar", configs["ar"]), ("das-wave", bench.method_configs()["das-wave"])]
    for kwargs, message in (({"draft_loops": 0}, "draft_loops must be >= 1"), ({"gamma": 0}, "gamma must be >= 1"),
                            ({"wave": {"width": 2}}, "wave must set only"), ({"wave": {"rounds": 0}}, "rounds"),
                            ({"methods": ["ar", "greedy"]}, r"methods must be among \('ar', .*got \['greedy'\]")):
        with pytest.raises(ValueError, match=message):
            bench.method_configs(**kwargs)


def test_ceilings():
    assert bench.ceiling(settings.Greedy(), 32) is None
    assert bench.ceiling(settings.SelfSpec(gamma=8), 32) == bench.Ceiling("tau", 9, 1)
    assert bench.ceiling(settings.MatureSpec(gamma=2), 32) == bench.Ceiling("tau", 3, 1)
    assert bench.ceiling(settings.PromptLookup(), 32) == bench.Ceiling("tau", settings.PromptLookup.gamma + 1, 1)
    assert bench.ceiling(settings.DasWave(**SMALL_WAVE), 32) == bench.Ceiling("A", 4, 0)  # min(4, 2 + 3 - 1)
    assert bench.ceiling(settings.DasWave(), 32).value == 25  # the paper's gamma 32, J 24, W_init 2
    assert bench.ceiling(settings.DasWave(), 8).value == 7  # J = 6 at Parcae's R = 8: 2 + 6 - 1



def test_tokens_per_verification_is_a_ratio_of_sums_over_the_runs_that_verified():
    """Two prompts of one drafter: 2 verifications committing 3 + 5 tokens and 1 committing 2: 10 / 3, not the mean of
    per-prompt G (3.0); greedy decoding's runs, with no verification, are left out."""
    runs = pd.DataFrame({"method": ["ar", "self-spec", "self-spec", "das-wave"], "verifications": [0, 2, 1, 1],
                         "accepted": [[], [2, 4], [1], [7]], "retained": [[], [1, 1], [1], [0]]})
    tokens = bench.tokens_per_verification(runs)
    assert tokens.to_dict() == {"self-spec": pytest.approx(10 / 3), "das-wave": 7.0}
    with pytest.raises(ValueError, match="no run made a verification"):
        bench.tokens_per_verification(runs[runs["method"] == "ar"])

def test_das_wave_rounds_follow_r_with_the_papers_24_at_32():
    """J k stays the paper's 1.5 R loops of refinement (J = 24, k = 2 at R = 32); a given J is kept."""
    assert [settings.default_rounds(R) for R in (1, 4, 8, 16, 32, 64)] == [1, 3, 6, 12, 24, 48]
    assert settings.DasWave().schedule(8)["rounds"] == 6 and settings.DasWave(rounds=5).schedule(8)["rounds"] == 5
    model = random_model("huginn", seed=0)  # R = 6: J = 4
    out = generate(model, prompts(model)[:1], method="das-wave", max_new_tokens=6)
    assert out.options["rounds"] == 4 and generate(model, prompts(model)[:1], method="das-wave", rounds=2,
                                                   max_new_tokens=6).options["rounds"] == 2
    with pytest.raises(ValueError, match=r"rounds must be an int or None, got 1\.5"):
        settings.DasWave(rounds=1.5)


def test_run_paired_and_summarize():
    model = random_model("huginn", seed=5, mean_recurrence=4)
    methods = {"ar": settings.Greedy(), "self-spec": settings.SelfSpec(draft_loops=2, gamma=3),
               "das-wave": settings.DasWave(**SMALL_WAVE)}
    runs = bench.run_paired(model, prompts(model), methods, max_new_tokens=8, progress=False, repeats=2)
    assert len(runs) == 9 and runs["same_as_greedy"].all() and (runs["repeats"] == 2).all()
    greedy = runs[runs["method"] == "ar"]
    assert np.allclose(greedy["speed-up"], 1.0) and greedy["A"].isna().all()
    summary = bench.summarize(runs, n_boot=200)
    assert list(summary.index) == ["greedy", "self-spec", "DAS-Wave"]  # table labels: settings.DISPLAY
    assert summary.loc["greedy", "speed-up"] == 1.0 and summary.loc["greedy", "same as greedy"] == "3/3"
    spec, wave = summary.loc["self-spec"], summary.loc["DAS-Wave"]
    assert spec["low"] <= spec["speed-up"] <= spec["high"]
    assert 1 <= spec["tau"] <= 4 and 0 <= spec["A"] <= 3 and spec["ceiling"] == "tau <= 4"
    assert spec["of ceiling"] == pytest.approx(runs[runs["method"] == "self-spec"]["tau"].mean() / 4)
    assert wave["ceiling"] == "A <= 4" and 0 <= wave["of ceiling"] <= 1
    wave_rows = runs[runs["method"] == "das-wave"]
    assert np.allclose(wave_rows["share"], wave_rows["A"] / 4)  # A over the most one verification accepts (w)
    with pytest.raises(ValueError, match="repeats must be"):
        bench.run_paired(model, prompts(model), methods, max_new_tokens=8, progress=False, repeats=0)


def test_cache_arms_are_greedy_decoding_timed_against_the_full_caches():
    """--caches: greedy decoding under RIPE, the deepest plane and sinks, each paired with greedy decoding on the full
    cache (the paired greedy run's tokens are the full cache's, so the speed-up is the smaller cache's speed ratio)."""
    model = random_model("huginn", seed=5, mean_recurrence=4)
    arms = {bench.cache_key(c): bench.CACHE_ARMS[c] for c in ("ripe", "deepest", "sinks")}
    assert list(arms) == ["greedy, ripe(8)", "greedy, deepest", "greedy, sinks(4, 8)"]
    runs = bench.run_paired(model, prompts(model), {"ar": settings.Greedy(), **arms}, max_new_tokens=8, progress=False,
                            repeats=2)
    assert list(pd.unique(runs["method"])) == ["ar", *arms] and (runs["verifications"] == 0).all()
    ripe, greedy = (runs[runs["method"] == key] for key in ("greedy, ripe(8)", "ar"))
    assert np.allclose(ripe["greedy_time_s"].to_numpy(), greedy["time_s"].to_numpy())
    assert (ripe["time_s"].to_numpy() != greedy["time_s"].to_numpy()).all()  # timed on its own, not greedy's copy


def test_each_cache_arm_loses_its_own_caches_prefill_in_the_decode_phase(monkeypatch):
    """RIPE's prefill fills RIPE's cache: a cache arm's decode phase is its time less a prefill arm under its own
    cache, greedy decoding's less the full cache's (one shared prefill had put the cache's prefill cost into its
    decode phase). Every run here takes a time set by its cache and budget, so the rows' prefills are known."""
    model = random_model("huginn", seed=5, mean_recurrence=4)
    seconds = {("full", 1): 1.0, ("ripe", 1): 2.0, ("full", 8): 5.0, ("ripe", 8): 4.0}
    real = bench.generate

    def timed(m, ids, config=None, **options):
        return replace(real(m, ids, config, **options), wall_time=seconds[config.cache, config.max_new_tokens])

    monkeypatch.setattr(bench, "generate", lambda m, ids, config=None, **options: (
        real(m, ids, config, **options) if config is None else timed(m, ids, config, **options)))
    ripe = bench.cache_key("ripe")
    configs = {"ar": settings.Greedy(), ripe: bench.CACHE_ARMS["ripe"],
               "self-spec": settings.SelfSpec(draft_loops=2, gamma=3)}
    assert list(bench.prefill_arms(configs.values())) == [bench.PREFILL, bench.prefill_key(configs[ripe])]
    assert bench.prefill_key(configs["self-spec"]) == bench.PREFILL  # the full cache's prefill: greedy decoding's
    runs = bench.run_paired(model, prompts(model), {key: configs[key] for key in ("ar", ripe)}, max_new_tokens=8,
                            progress=False, repeats=2, modes=("eager",))
    rows = runs[runs["method"] == ripe]
    assert (rows["prefill_time_s"] == 2.0).all() and (rows["greedy_prefill_time_s"] == 1.0).all()
    # the decode phase: (5 - 1) / (4 - 2) = 2x per prompt, where the full cache's prefill would give 4 / 3
    assert bench.decode_phase_speedup(rows, n_boot=100).estimate == pytest.approx(2.0)
    assert bench.prefill_bound(runs, "eager")[0] == pytest.approx(5.0)  # greedy decoding over its own prefill


def test_sampling_overhead_pairs_each_method_with_itself_on_greedys_tokens():
    """Issue 41's sampling budget is measured, not asserted: each method greedily and with the sampler's whole path
    at top-k 1, interleaved per prompt, so both emit the same tokens and the ratio is the sampler's cost."""
    model = random_model("huginn", seed=5, mean_recurrence=4)
    methods = {"ar": settings.Greedy(), "self-spec": settings.SelfSpec(draft_loops=2, gamma=3),
               "pld": settings.PromptLookup(gamma=3, ngram=2), "das-wave": settings.DasWave(**SMALL_WAVE)}
    table = bench.sampling_overhead(model, prompts(model), methods, max_new_tokens=6, repeats=2, progress=False,
                                    n_boot=200)
    assert list(table.index) == [("greedy", "eager"), ("self-spec", "eager"), ("prompt lookup", "eager"),
                                 ("DAS-Wave", "eager")]
    assert (table["same tokens"] == "3/3").all() and (table["prompts"] == 3).all()
    assert ((table["low"] <= table["sampled / greedy time"]) & (table["sampled / greedy time"] <= table["high"])).all()
    with pytest.raises(ValueError, match="modes must name"):
        bench.sampling_overhead(model, prompts(model), methods, 6, modes=("jit",), progress=False)


def test_batched_runs_pair_each_cache_with_the_full_cache_on_sets_of_prompts_per_mode(monkeypatch):
    """Issue 43's RIPE at B_max, eager and compiled: B prompts decoded together under each cache and the full cache,
    interleaved per set of B and mode, every row to its budget; the ratio is the mean over sets of t_full / t_cache
    (as many tokens). Compiled runs are asked for with compile=True (here run eager: the plumbing, not Inductor)."""
    model = random_model("huginn", seed=5, mean_recurrence=4)
    calls = []
    real = bench.generate

    def logged(m, ids, config=None, **options):
        calls.append((len(ids), None if config is None else config.cache, bool(options.pop("compile", False))))
        return real(m, ids, config, **options)

    monkeypatch.setattr(bench, "generate", logged)
    runs = bench.batched_runs(model, prompts(model, (5, 3, 7, 4, 6)), 2, ["ripe", "sinks"], max_new_tokens=5,
                              repeats=2, modes=("eager", "compiled"), progress=False)
    assert len(runs) == 2 * 2 * 3 and (runs["new_tokens"] == 2 * 5).all()  # every row to its budget
    eager = calls[1:10]  # after the warm-up: set 0, eager: each arm once untimed, then 2 rounds x 3 arms, each call a
    assert eager == [  # batch of 2, the order reversed every other round
        (2, key, False) for key in ("full", "ripe", "sinks", "full", "ripe", "sinks", "sinks", "ripe", "full")]
    compiled = calls[10:19]  # set 0, compiled: each arm once untimed (traced), then the 2 timed rounds
    assert all(flag for _, _, flag in compiled) and [c for _, c, _ in compiled[:3]] == ["full", "ripe", "sinks"]
    table = bench.batched_summary(runs, n_boot=200)
    assert list(table.index) == [(key, mode) for mode in ("eager", "compiled")
                                 for key in ("greedy, ripe(8)", "greedy, sinks(4, 8)")]
    assert (table["sets"] == 2).all() and (table["batch"] == 2).all() and (table["repeats"] == 2).all()
    assert ((table["low"] <= table["tokens/s ratio"]) & (table["tokens/s ratio"] <= table["high"])).all()
    # the ratio is t_full / t_cache per set, averaged over sets
    ripe = runs[(runs["cache"] == "greedy, ripe(8)") & (runs["mode"] == "eager")]["time_s"].to_numpy()
    full = runs[(runs["cache"] == "full") & (runs["mode"] == "eager")]["time_s"].to_numpy()
    assert table.loc[("greedy, ripe(8)", "eager"), "tokens/s ratio"] == pytest.approx((full / ripe).mean())
    for batch, message in ((3, "--batch must be in \\[1, 2\\]"), (0, "--batch must be in")):
        with pytest.raises(ValueError, match=message):
            bench.batched_runs(model, prompts(model, (5, 3, 7, 4, 6)), batch, ["ripe"], 5, progress=False)
    with pytest.raises(ValueError, match="--caches must name some of"):
        bench.batched_runs(model, prompts(model), 1, ["ring"], 5, progress=False)
    with pytest.raises(ValueError, match="modes must name"):
        bench.batched_runs(model, prompts(model), 1, ["ripe"], 5, modes=("jit",), progress=False)


def test_no_timed_compiled_run_compiles():
    """The recorded bench had put 8-46 s of compiling into one prompt's compiled runs (problems prompt 6, chains
    prompt 3): its warm-up traced one prompt per capacity bucket with every method, and a prompt whose greedy run
    opened a bucket needed another for its speculative runs. Every compiled arm now decodes each prompt once,
    untimed, before its timed rounds, and no later run of it traces a graph. The prompts (7, 2 and 4 tokens) are
    such a case: the third's self-spec needs the bucket the first opened with greedy decoding."""
    from torch._dynamo.utils import counters

    model = random_model("huginn", seed=5, mean_recurrence=4)
    runs_of: dict[tuple[int, int], list[int]] = {}  # (config, prompt): graphs traced by each compiled run
    real = bench.generate

    def counted(m, ids, config=None, **options):
        before = counters["stats"]["unique_graphs"]
        out = real(m, ids, config, **options)
        if options.get("compile"):
            runs_of.setdefault((id(config), ids.shape[-1]), []).append(counters["stats"]["unique_graphs"] - before)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "generate", counted)
        runs = bench.run_paired(model, prompts(model, (7, 2, 4)), {"self-spec": settings.SelfSpec(draft_loops=2,
                                                                                                 gamma=3)},
                                max_new_tokens=6, progress=False, repeats=2, modes=("compiled",))
    assert len(runs_of) == 3 * 3  # prompts x (greedy, self-spec, prefill)
    assert all(len(traced) == 1 + 2 and not any(traced[1:]) for traced in runs_of.values())  # untimed, then 2 timed
    assert (runs["mode"] == "compiled").all() and runs["same_as_greedy"].all()


def test_batched_acceptance_equals_decoding_each_prompt_alone():
    model = random_model("raven", seed=6, mean_recurrence=4)
    methods = {"mature-spec": settings.MatureSpec(draft_loops=1, gamma=3),
               "das-wave": settings.DasWave(**SMALL_WAVE)}
    batched = bench.acceptance_runs(model, prompts(model), methods, max_new_tokens=7)
    alone = bench.run_paired(model, prompts(model), methods, max_new_tokens=7, progress=False)
    columns = ["prompt", "method", "new_tokens", "verifications", "A", "G", "of ceiling"]
    def ordered(runs):
        return runs[columns].sort_values(["method", "prompt"]).reset_index(drop=True)

    pd.testing.assert_frame_equal(ordered(batched), ordered(alone))
    summary = bench.summarize(alone, batched, n_boot=200)
    assert summary.loc["Mature-Spec", "A"] == pytest.approx(batched[batched["method"] == "mature-spec"]["A"].mean())


def frame(method, values, statistic, ceiling, **extra):
    """Runs of one method: per-prompt A (and tau = G = A + 1 for a sequential drafter)."""
    values = np.asarray(values, dtype=float)
    tau = values + 1 if statistic == "tau" else values
    extra = {"share": values / (ceiling - 1 if statistic == "tau" else ceiling), **extra}
    return pd.DataFrame({"prompt": range(len(values)), "method": [method] * len(values), "A": values, "G": tau,
                         "tau": tau, "verifications": 4, "statistic": statistic, "ceiling": ceiling,
                         "floor": 1 if statistic == "tau" else 0, **extra})


def test_mature_spec_verdicts_check_units_and_ceilings():
    rng = np.random.default_rng(0)
    spec = rng.uniform(1, 3, 40)
    runs = pd.concat([frame("self-spec", spec, "tau", 9), frame("mature-spec", spec + 2, "tau", 9)])
    runs["speed-up"] = np.where(runs["method"] == "mature-spec", 1.5, 1.2) * rng.uniform(0.95, 1.05, 80)
    runs["repeats"] = 2
    verdicts = bench.mature_spec_verdicts(runs)
    assert verdicts["acceptance"].label == AGREES and verdicts["acceptance"].n == 40
    assert verdicts["speed"].label == AGREES and verdicts["speed"].estimate == pytest.approx(1.25, rel=0.05)
    slower = runs.assign(**{"speed-up": np.where(runs["method"] == "mature-spec", 0.8, 1.2)})
    assert bench.mature_spec_verdicts(slower)["speed"].label == DISAGREES
    near = rng.uniform(7.8, 8.0, 40)  # both arms near tau = 9: no difference, but no room for one either
    saturated = pd.concat([frame("self-spec", near, "tau", 9), frame("mature-spec", near + rng.normal(0, 0.01, 40),
                                                                     "tau", 9)]).assign(**{"speed-up": 1.0})
    v = bench.mature_spec_verdicts(saturated)["acceptance"]
    assert v.label == INCONCLUSIVE and "within 5% of its ceiling 9" in v.reason
    assert bench.mature_spec_verdicts(saturated.assign(repeats=2))["speed"].label == IDENTICAL
    few = runs[runs["prompt"] < 8]
    assert "too few units (8 prompts" in bench.mature_spec_verdicts(few)["acceptance"].reason
    with pytest.raises(ValueError, match="same gamma"):
        bench.mature_spec_verdicts(pd.concat([frame("self-spec", spec, "tau", 9), frame("mature-spec", spec, "tau",
                                                                                        5)]))


def test_a_speed_verdict_needs_16_prompts_timed_in_interleaved_repeats():
    """Chapter 5 printed "agrees" on 4 timed prompts, each timed once (bench.speed_verdict ran no unit check)."""
    rng = np.random.default_rng(3)
    spec = rng.uniform(1, 3, 16)
    runs = pd.concat([frame("self-spec", spec, "tau", 9), frame("mature-spec", spec + 2, "tau", 9)])
    runs["speed-up"] = np.where(runs["method"] == "mature-spec", 1.5, 1.2) * rng.uniform(0.95, 1.05, 32)
    assert bench.speed_verdict(bench.MATURE_SPEC_FASTER, runs.assign(repeats=2), "mature-spec",
                               "self-spec").label == AGREES
    once = bench.speed_verdict(bench.MATURE_SPEC_FASTER, runs.assign(repeats=1), "mature-spec", "self-spec")
    assert once.label == INCONCLUSIVE and "timed once each" in once.reason
    four = runs[runs["prompt"] < 4].assign(repeats=2)
    v = bench.speed_verdict(bench.MATURE_SPEC_FASTER, four, "mature-spec", "self-spec")
    assert v.label == INCONCLUSIVE and v.reason.startswith("too few units (4 timed prompts")


def test_arms_with_different_ceilings_are_not_compared_by_raw_a():
    """DAS-Wave's A <= 25 against Mature-Spec's A <= 8 "agreed" by construction."""
    rng = np.random.default_rng(1)
    mature = frame("mature-spec", rng.uniform(1, 4, 40), "tau", 9)
    wave = frame("das-wave", rng.uniform(10, 15, 40), "A", 25)
    runs = pd.concat([mature, wave])
    claim = bench.MATURE_SPEC_ACCEPTS_MORE
    with pytest.raises(ValueError, match=r"different ceilings.*statistic=.share."):
        bench.acceptance_verdict(claim, runs, "das-wave", "mature-spec")
    shares = Claim("DAS-Wave fills more of its ceiling", "test", minimum=0.05, minimum_source="test")
    share = bench.acceptance_verdict(shares, runs, "das-wave", "mature-spec", statistic="share")
    assert share.n == 40 and share.estimate == pytest.approx((wave["A"] / 25 - mature["A"] / 8).mean())
    with pytest.raises(ValueError, match="statistic must be"):
        bench.acceptance_verdict(claim, runs, "das-wave", "mature-spec", statistic="tau")


def test_factorial_cells_and_interaction_verdict():
    cells = bench.factorial_configs(SMALL_WAVE)
    assert len(cells) == 8 and cells[(1, 1, 1)].carry and cells[(0, 1, 0)].prefix_reads == "deep-k"
    rng = np.random.default_rng(2)
    n, w = 40, 25
    base = {cell: 2 + 2 * sum(cell) + rng.normal(0, 0.3, n) for cell in cells}
    base[(1, 1, 1)] = base[(1, 1, 1)] + 8  # carry with both mature channels: far more than the sum
    runs = pd.concat([frame(cell, g, "A", w) for cell, g in base.items()])
    e = bench.interaction_by_prompt(runs)
    assert e[0] == pytest.approx(interaction_effect({cell: g[0] for cell, g in base.items()}))
    assert bench.interaction_verdict(runs).label == AGREES
    saturated = pd.concat([frame(cell, np.full(n, w - 0.5 if cell[0] else 3.0) + rng.normal(0, 0.1, n), "A", w)
                           for cell in cells])
    v = bench.interaction_verdict(saturated)
    assert v.label == INCONCLUSIVE and "G of the carried cells" in v.reason


def test_interaction_verdict_refuses_carried_cells_capped_by_the_token_budget():
    """Chapter 6 decoded 24 tokens against w = 25: a carried cell verified about once, so its G was the budget and
    E_cKV read "no effect" for want of room; the verdict must say the budget, not carry, set G."""
    cells = bench.factorial_configs(SMALL_WAVE)
    rng = np.random.default_rng(3)
    n, w, budget = 40, 25, 24
    capped = pd.concat([frame(cell, (np.full(n, budget - 0.5) if cell[0] else 3.0 + sum(cell)) + rng.normal(0, 0.2, n),
                              "A", w, verifications=1 if cell[0] else 6) for cell in cells])
    v = bench.interaction_verdict(capped)
    assert v.label == INCONCLUSIVE and "token budget" in v.reason
    roomy = capped.assign(verifications=bench.MIN_VERIFICATIONS)
    assert "token budget" not in bench.interaction_verdict(roomy).reason


def test_acceptance_falls_with_temperature_and_temperature_zero_is_greedy():
    """Chapter 5's temperature section: tau of each method at each temperature, greedy at 0, seeded rows."""
    model = random_model("huginn", seed=2)
    methods = bench.method_configs(draft_loops=2, gamma=3)
    methods = {key: methods[key] for key in ("self-spec", "mature-spec")}
    runs = bench.acceptance_by_temperature(model, prompts(model), methods, 8, temperatures=(0, 1.0))
    assert sorted(runs["temperature"].unique()) == [0.0, 1.0] and len(runs) == 2 * 2 * 3
    greedy = bench.acceptance_runs(model, prompts(model), methods, 8)
    zero = runs[runs["temperature"] == 0].drop(columns="temperature").reset_index(drop=True)
    pd.testing.assert_frame_equal(zero, greedy)
    again = bench.acceptance_by_temperature(model, prompts(model), methods, 8, temperatures=(1.0,))
    assert again["tau"].tolist() == runs[runs["temperature"] == 1.0]["tau"].tolist()  # seeded
    with pytest.raises(ValueError, match="temperatures must be numbers >= 0"):
        bench.acceptance_by_temperature(model, prompts(model), methods, 8, temperatures=(-1,))


def test_every_profile_gives_the_carried_cells_room_to_verify():
    """Chapter 6's tiny profile decoded 24 tokens per prompt against w = 25, so the E_cKV verdict was undecidable by
    design: every profile a reader runs must leave room for MIN_VERIFICATIONS verifications at the ceiling w."""
    for name, profile in profiles.PROFILES.items():
        if name == "smoke":  # the fixture-sized profile: its numbers mean nothing
            continue
        wave = bench.method_configs(profile.ch05.draft_loops, profile.ch05.gamma)["das-wave"]
        model = "huginn-0125" if name == "tiny" else next(m for m in profiles.MODELS if name.startswith(m))
        w = bench.ceiling(wave, PRESETS[model]().mean_recurrence).value
        assert profile.ch06.acceptance_tokens >= bench.MIN_VERIFICATIONS * w, name


def test_check_options_name_the_option_and_the_value():
    good = dict(prompts=32, max_new_tokens=128, draft_loops=4, gamma=4, methods=list(settings.METHODS),
                workloads=["problems"])
    bench.check_options(**good)
    for change, message in (({"prompts": 1}, "--prompts must be >= 2"), ({"gamma": 0}, "--gamma must be >= 1, got 0"),
                            ({"methods": ["greedy"]}, "--methods must name some of"),
                            ({"workloads": []}, "--workloads must name some of"),
                            ({"caches": ["full"]},
                             r"--caches must name some of \('ripe', 'deepest', 'sinks'\), got \['full'\]")):
        with pytest.raises(ValueError, match=message):
            bench.check_options(**{**good, **change})
    with pytest.raises(ValueError, match=r"--draft-loops must be in \[1, 31\]"):
        bench.check_model(32, 32)


def test_the_decode_phase_speed_up_leaves_the_shared_prefill_out():
    """A decoder twice as fast after a prefill that takes half of greedy decoding's time: 1.33x end to end, 2x in
    the decode phase (as LoopSpec and the papers report)."""
    runs = pd.DataFrame({"greedy_time_s": [2.0] * 4, "prefill_time_s": [1.0] * 4, "greedy_prefill_time_s": [1.0] * 4,
                         "time_s": [1.5] * 4, "greedy_tokens": [11] * 4, "new_tokens": [11] * 4})
    assert bench.decode_phase_speedup(runs, n_boot=100).estimate == pytest.approx(2.0)
    assert bench.mean_speedup(runs["greedy_time_s"], runs["time_s"], n_boot=100).estimate == pytest.approx(4 / 3)
    one_token = runs.assign(new_tokens=1)
    with pytest.raises(ValueError, match="no prompt has a decode phase"):
        bench.decode_phase_speedup(one_token, n_boot=100)


def test_a_recorded_bench_names_its_weights_and_is_refused_for_others(tmp_path):
    runs = pd.DataFrame({"prompt": [0, 1], "method": ["ar", ("carry", 1)], "time_s": [1.0, np.nan]})
    measured = {"commit": "abc1234", "environment": {"cpu": "test CPU", "threads": 1, "torch": "2"},
                "runs": {"problems": runs}}
    path = tmp_path / "bench.json"
    bench.write_record(path, measured, "tiny", "looped-kv bench --record bench.json")
    header, read = bench.read_record(path, "tiny")
    assert header["command"] == "looped-kv bench --record bench.json" and header["environment"]["cpu"] == "test CPU"
    assert header["weights_sha256"] == bench.weights_sha256("tiny") and header["commit"] == "abc1234" and header["date"]
    assert read["problems"]["time_s"].isna().tolist() == [False, True]
    assert read["problems"]["method"].tolist() == ["ar", bench.label(("carry", 1))]  # names kept: verdicts read them
    sentence = bench.provenance({**header, "environment": {"cpu": "test CPU", "threads": 1, "torch": "2"}})
    assert sentence.startswith(f"measured on {header['date'][:10]} (test CPU, 1 thread, torch 2) at commit ")
    assert sentence.endswith("by `looped-kv bench --record bench.json`")
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"not the shipped weights")
    with pytest.raises(ValueError, match="measured on other weights"):
        bench.read_record(path, other)
    timed = {**measured, "runs": {"problems": pd.DataFrame({"prompt": [0], "method": ["ar"], "prefill_time_s": [1.0]})}}
    bench.write_record(path, timed, "tiny", "looped-kv bench --record bench.json")  # a record made before 2e2777b
    with pytest.raises(ValueError, match=r"predates each cache's own prefill arm \(its problems runs have no "
                                         r"greedy_prefill_time_s.*re-run `looped-kv bench --record bench.json`"):
        bench.read_record(path, "tiny")


def test_a_records_commit_is_dirty_only_where_the_package_changed(tmp_path):
    """A chain of recorded runs writes book/data as it goes: a record's commit says what code ran, so the records the
    chain wrote before it leave it clean, and only the package's own files make it "-dirty"."""
    repo, package = tmp_path / "repo", tmp_path / "repo" / "package"
    package.mkdir(parents=True)
    (package / "module.py").write_text("x = 1\n")
    (repo / "record.json").write_text("{}\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    assert source_commit(package) == head
    (repo / "record.json").write_text('{"runs": 1}\n')  # a record written by an earlier run of the chain
    assert source_commit(package) == head
    (package / "module.py").write_text("x = 2\n")
    assert source_commit(package) == f"{head}-dirty"
    (tmp_path / "outside").mkdir()
    assert source_commit(tmp_path / "outside") == "unknown"


def _timed(mode: str, faster: float, prompts: int = 16) -> pd.DataFrame:
    """Timing rows of greedy decoding and two methods, the second ``faster`` times the first's speed."""
    rng = np.random.default_rng(len(mode))
    rows = []
    for i in range(prompts):
        greedy, prefill = 2.0 + rng.normal(0, 0.05), 0.5
        for method, time_s in (("ar", greedy), ("self-spec", greedy / 1.2), ("mature-spec", greedy / 1.2 / faster)):
            rows.append({"prompt": i, "method": method, "mode": mode, "time_s": time_s, "greedy_time_s": greedy,
                         "prefill_time_s": prefill, "greedy_prefill_time_s": prefill, "new_tokens": 32,
                         "greedy_tokens": 32, "repeats": 2, "speed-up": greedy / time_s})
    return pd.DataFrame(rows)


def test_speed_verdicts_read_the_recorded_bench_in_both_modes(tmp_path):
    """Chapters 5 and 6 timed 3-4 prompts once each, so every speed verdict was "too few units": on the shipped
    model they read the recorded bench (16 prompts, 2 rounds, eager and compiled) and say where it was measured."""
    runs = pd.concat([_timed("eager", 1.5), _timed("compiled", 1.0)], ignore_index=True)
    path = tmp_path / "bench.json"
    bench.write_record(path, {"commit": "abc1234", "environment": {"cpu": "test CPU", "threads": 1, "torch": "2"},
                              "runs": {"problems": runs}}, "tiny", "looped-kv bench --record bench.json")
    timing, source = bench.speed_timing({"problems": runs[runs["mode"] == "eager"].head(6)}, path)
    assert set(timing) == {"eager", "compiled"} and source.startswith("measured on ")
    verdicts = bench.speed_verdicts(bench.MATURE_SPEC_FASTER, timing, "mature-spec", "self-spec")
    assert list(verdicts) == ["problems, eager", "problems, compiled"]
    assert verdicts["problems, eager"].label == AGREES and verdicts["problems, eager"].n == 16
    assert verdicts["problems, compiled"].label != AGREES
    table = bench.speed_table(timing, n_boot=200)
    assert list(table.columns) == ["eager, end to end", "eager, decode phase", "compiled, end to end",
                                   "compiled, decode phase"]
    eager = runs[(runs["mode"] == "eager") & (runs["method"] == "mature-spec")]
    decode = ((eager["greedy_time_s"] - 0.5) / (eager["time_s"] - 0.5)).mean()  # the shared 0.5 s prefill left out
    assert table.loc[("problems", "Mature-Spec"), "eager, decode phase"].startswith(f"{decode:.2f} [")
    assert decode > eager["speed-up"].mean() + 0.5  # the prefill hides most of the decode phase's gain
    live, said = bench.speed_timing({"problems": runs}, None)
    assert said == "the runs timed live in this chapter" and list(live) == ["eager"]
    assert list(bench.speed_verdicts(bench.MATURE_SPEC_FASTER, {"eager": {"problems": runs[runs["mode"] == "eager"]}},
                                     "mature-spec", "self-spec")) == ["problems"]


def test_the_recorded_bench_is_the_shipped_models():
    """The chapters' speed verdicts read book/data's bench: it must have been measured on the shipped weights, by the
    committed command, on at least 16 prompts per workload in at least 2 interleaved rounds, eager and compiled."""
    header, runs = bench.read_record()
    assert header["weights_sha256"] == bench.weights_sha256("tiny")
    command = header["command"]
    assert command.startswith("looped-kv bench ") and "--record book/data/bench-tiny.json" in command
    assert {"cpu", "threads", "torch"} <= set(header["environment"]) and header["date"] and header["commit"]
    assert set(runs) == {"problems", "code", "chains"}
    for workload, r in runs.items():
        assert set(r["mode"]) == {"eager", "compiled"}, workload
        assert r["prompt"].nunique() >= 16 and (r["repeats"] >= 2).all(), workload
        assert {"mature-spec", bench.DEEP_V_SPEC} <= set(r["method"]), workload  # DAS Table 7's speed verdict



def test_the_recorded_batched_cache_bench_is_the_shipped_models():
    """Chapter 7 reads book/data's batched cache bench at its B_max: the shipped weights, the committed command,
    RIPE and the sinks cache each timed beside the full cache on at least 8 sets of 4 prompts per workload, eager
    and compiled, every arm emitting as many tokens as the full cache."""
    header, runs = bench.read_record(bench.BATCHED_CACHES_RECORD)
    assert header["weights_sha256"] == bench.weights_sha256("tiny")
    assert header["command"].startswith("looped-kv bench --batch 4 --caches ripe sinks ")
    for workload, r in runs.items():
        assert set(r["cache"]) == {"full", *(bench.cache_key(c) for c in ("ripe", "sinks"))}, workload
        assert set(r["mode"]) == {"eager", "compiled"} and r["set"].nunique() >= 8, workload
        assert (r["batch"] == 4).all() and (r["repeats"] >= 2).all(), workload
        assert r.groupby(["set", "mode"])["new_tokens"].nunique().eq(1).all(), workload


def test_the_recorded_cache_bench_is_the_shipped_models():
    """Chapter 7 reads book/data's cache bench: the shipped weights, the committed command, greedy decoding under
    RIPE, the deepest plane and sinks each timed beside the full cache's on 16 prompts per workload, eager and
    compiled."""
    header, runs = bench.read_record(bench.CACHES_RECORD)
    assert header["weights_sha256"] == bench.weights_sha256("tiny")
    assert header["command"].startswith("looped-kv bench --methods ar --caches ripe deepest sinks ")
    for workload, r in runs.items():
        assert set(r["method"]) == {"ar", *map(bench.cache_key, bench.CACHE_ARMS)}, workload
        assert set(r["mode"]) == {"eager", "compiled"} and r["prompt"].nunique() >= 16, workload
        arms = r[r["method"] != "ar"]
        assert (r["repeats"] >= 2).all() and (arms["time_s"] != arms["greedy_time_s"]).all()
        assert (arms["prefill_time_s"] != arms["greedy_prefill_time_s"]).all(), workload  # each cache's own prefill
