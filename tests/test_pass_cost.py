"""The pass-cost model (looped_kv.analysis.pass_cost) and its command (looped-kv pass-cost), with no timing in the
assertions: the fit recovers a known cost function from synthetic timings, predictions sum the passes a real decode
of the shipped tiny model logged, the record round-trips with its metadata, Eq. (8) is the special case of pass costs
that ignore the tokens, and the command refuses bad input in one line before any work and keeps an existing file."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import random_model

from looped_kv import generate, load
from looped_kv.analysis import pass_cost
from looped_kv.analysis.pass_cost import PassCost, Timing, fit_pass_cost
from looped_kv.analysis.perf import speedup
from looped_kv.cli import main, parser
from looped_kv.decoding.compiled import refined_width
from looped_kv.decoding.loop import PassLog
from looped_kv.decoding.passes import PassRecord
from looped_kv.decoding.settings import DasWave, Greedy, PromptLookup, SelfSpec
from looped_kv.experiments import bench
from looped_kv.experiments import pass_cost as experiment

WIDTHS, HELD_OUT, LOOPS, CONTEXTS, PROMPTS = (1, 2, 4, 8, 32), (5, 25), (1, 4, 32), (64, 256, 512), (16, 128, 512)


def coefficients(g: float) -> tuple[float, float, float, float]:
    """A known cost per width, linear in g between the measured widths (so interpolation is exact too)."""
    return 1e-3 + 2e-5 * g, 1e-4 + 3e-6 * g, 2e-7 + 1e-8 * g, 5e-9 + 2e-10 * g


def truth(g: float, r: int, L: int) -> float:
    a, b, c, e = coefficients(g)
    return a + b * r + c * L + e * r * L


def verify_truth(g: float, L: int) -> float:
    """A known verification in place per width, linear in g between the measured widths, cheaper than the pass it
    would be priced as without its own cells."""
    return 4e-3 + 1e-4 * g + (3e-6 + 1e-8 * g) * L


def prefill_truth(n: int) -> float:
    return 2e-3 + 4e-5 * n


CHAINS = (4, 8)  # compiled chains of one-token drafts, at each loop count below 32


def chain_truth(gamma: int, r: int, L: int) -> float:
    """A known compiled chain of gamma drafts: cheaper than gamma drafts alone, the more so the longer."""
    return truth(1, r, L) * (1 + 0.6 * (gamma - 1)) if gamma > 1 else truth(1, r, L)


def priced(p: PassRecord) -> float:
    """What the known costs make of one logged pass other than the prefill."""
    if p.kind == "drafts":
        return chain_truth(p.tokens, p.loops, p.context)
    return verify_truth(p.tokens, p.context) if p.in_place else truth(p.tokens, p.loops, p.context)


def synthetic(statistic: str = "median", modes: tuple[str, ...] = ("eager", "compiled")) -> list[Timing]:
    """Timings whose median (or minimum) over three rounds is the known cost: the other rounds are slower or straddle
    it."""
    spread = (1.0, 1.4, 0.8) if statistic == "median" else (1.0, 1.3, 2.0)
    cells = [Timing(m, "pass", g, r, L, tuple(truth(g, r, L) * s for s in spread))
             for m in modes for g in (*WIDTHS, *HELD_OUT) for r in LOOPS for L in CONTEXTS]
    cells += [Timing(m, "verify", g, 32, L, tuple(verify_truth(g, L) * s for s in spread))
              for m in modes for g in (*WIDTHS, *HELD_OUT) for L in CONTEXTS]
    cells += [Timing("compiled", "drafts", g, r, L, tuple(chain_truth(g, r, L) * s for s in spread))
              for g in CHAINS for r in LOOPS if r < 32 for L in CONTEXTS if "compiled" in modes]
    return cells + [Timing(m, "prefill", n, 32, 0, tuple(prefill_truth(n) * s for s in spread))
                    for m in modes for n in PROMPTS]


@pytest.mark.parametrize("statistic", ["median", "min"])
def test_the_fit_recovers_a_known_cost_function_exactly(statistic):
    cost = fit_pass_cost(synthetic(statistic), statistic, held_out=HELD_OUT)
    for mode in ("eager", "compiled"):
        assert sorted(cost.coefficients[mode]) == list(WIDTHS)
        for g in WIDTHS:  # at each measured context L, a line in the loops: a + c L + (b + e L) r
            a, b, c, e = coefficients(g)
            assert sorted(cost.coefficients[mode][g]) == list(CONTEXTS)
            for L in CONTEXTS:
                np.testing.assert_allclose(cost.coefficients[mode][g][L], (a + c * L, b + e * L), rtol=1e-9,
                                           atol=1e-15)
        for g, r, L in [(3, 7, 100), (25, 2, 300), (1, 32, 999), (17, 4, 64)]:  # between the widths, any r and L
            assert cost.seconds(g, r, L, mode) == pytest.approx(truth(g, r, L), rel=1e-9)
        assert cost.prefill_seconds(300, mode) == pytest.approx(prefill_truth(300), rel=1e-12)
        assert sorted(cost.verifications[mode]) == list(WIDTHS)
        assert cost.verifications[mode][8] == {L: pytest.approx(verify_truth(8, L), rel=1e-12) for L in CONTEXTS}
        for g, L in [(1, 300), (9, 200), (25, 999), (4, 10)]:  # between and past the measured contexts
            assert cost.verify_seconds(g, L, mode) == pytest.approx(verify_truth(g, L), rel=1e-9)
    residuals = cost.residuals()
    assert len(residuals) == 2 * len(WIDTHS + HELD_OUT) * (len(LOOPS) + 1) * len(CONTEXTS)
    assert residuals["relative"].abs().max() < 1e-9
    assert set(residuals.loc[residuals["cells"] == "held out", "tokens"]) == set(HELD_OUT)
    summary = cost.summary()
    assert list(summary.index) == [(m, c) for m in ("compiled", "eager")
                                   for c in ("fitted", "held out", "in place, fitted", "in place, held out")]
    assert (summary["max_abs"] < 1e-9).all()


def test_the_model_refuses_what_it_did_not_measure():
    cost = fit_pass_cost(synthetic(modes=("eager",)), held_out=HELD_OUT)
    with pytest.raises(ValueError, match=r"tokens 64 is outside the measured 1\.\.32; .*--tokens"):
        cost.seconds(64, 4, 100)
    with pytest.raises(ValueError, match=r"prefill of tokens 8 is outside the measured 16\.\.512"):
        cost.prefill_seconds(8)
    with pytest.raises(ValueError, match=r"mode 'compiled' was not measured.*--modes compiled"):
        cost.seconds(1, 4, 100, "compiled")
    one_loop = [t for t in synthetic() if t.kind == "prefill" or t.loops == 4]
    with pytest.raises(ValueError, match="eager passes of 1 tokens at context 64: a fit of \\('1', 'loops'\\) needs "
                                         "cells at 2 or more loops, got \\[4\\]"):
        fit_pass_cost(one_loop)
    with pytest.raises(ValueError, match="statistic must be one of"):
        fit_pass_cost(synthetic(), "mean")
    one_context = fit_pass_cost([t for t in synthetic() if t.kind != "verify" or t.context == 64], held_out=HELD_OUT)
    assert one_context.verify_seconds(8, 500) == one_context.verify_seconds(8, 64) == verify_truth(8, 64)
    in_place = PassRecord("verify", 1, 9, 32, 100, False, True)
    assert cost.record_seconds(in_place) == pytest.approx(verify_truth(9, 100), rel=1e-9)
    assert cost.record_seconds(PassRecord("verify", 1, 9, 32, 100, False)) == pytest.approx(truth(9, 32, 100))
    with pytest.raises(ValueError, match=r"verification of tokens 64 is outside the measured 1\.\.32"):
        cost.verify_seconds(64, 100)
    no_verifications = fit_pass_cost([t for t in synthetic() if t.kind != "verify"], held_out=HELD_OUT)
    with pytest.raises(ValueError, match="mode 'eager' was not measured"):
        no_verifications.record_seconds(in_place)


def test_the_record_round_trips_with_its_metadata(tmp_path):
    meta = {"command": "looped-kv pass-cost --out x.json", "commit": "abc1234", "date": "2026-01-01T00:00+00:00",
            "environment": {"cpu": "a CPU", "threads": 2, "torch": torch.__version__}, "model": "tiny"}
    cost = fit_pass_cost(synthetic(), held_out=HELD_OUT, meta=meta)
    path = tmp_path / "pass-cost.json"
    cost.write(path)
    again = pass_cost.read(path)
    assert again == cost and again.meta == meta
    assert json.loads(path.read_text())["environment"]["threads"] == 2
    assert again.seconds(25, 4, 200, "compiled") == cost.seconds(25, 4, 200, "compiled")
    assert again.verifications == cost.verifications
    assert again.verify_seconds(9, 200, "compiled") == cost.verify_seconds(9, 200, "compiled")
    assert again.drafts == cost.drafts and again.drafts_seconds(6, 4, 200) == cost.drafts_seconds(6, 4, 200)
    unchained = PassCost.from_dict({k: v for k, v in cost.to_dict().items() if k != "drafts"})  # before chains
    assert unchained.drafts == {} and unchained.verifications == cost.verifications
    with pytest.raises(ValueError, match=r"not a pass-cost record of this version: it lacks .*'verifications'"):
        PassCost.from_dict(meta)
    one_token_steps = {k: v for k, v in cost.to_dict().items() if k != "verifications"}
    one_token_steps |= {"step_terms": ["1", "context"], "steps": {"eager": [1e-3, 1e-6]}}  # stop 56's records
    with pytest.raises(ValueError, match="it lacks \\['verifications'\\] \\(re-run looped-kv pass-cost\\)"):
        PassCost.from_dict(one_token_steps)
    one_line = cost.to_dict() | {"terms": ["1", "loops", "context", "loops x context"]}  # stop 59's records
    with pytest.raises(ValueError, match="its terms must be \\('1', 'loops'\\) per width and context"):
        PassCost.from_dict(one_line)


@pytest.fixture(scope="module")
def tiny():
    return load("tiny", dtype=torch.float32)


@pytest.mark.parametrize("method, options", [("ar", {}), ("self-spec", {"gamma": 3}), ("pld", {}),
                                             ("das-wave", {"max_width": 8, "rounds": 4, "updates": 2})])
def test_predictions_sum_the_passes_a_real_decode_ran(tiny, method, options):
    ids = tiny.tokenizer("Question: Ann has 3 pens and buys 4 more. How many pens? Answer:",
                         return_tensors="pt").input_ids
    log = PassLog()
    out = generate(tiny, ids, method=method, max_new_tokens=10, observer=log, **options)
    passes = log.passes
    assert len(passes) == out.forward_passes and passes[0].kind == "prefill" and passes[0].tokens == ids.shape[1]
    if method != "ar":  # greedy decoding counts no verifications, one step per token
        assert sum(p.kind == "verify" for p in passes) == out.verifications
    assert all(p.rows == 1 and not p.compiled and p.context >= ids.shape[1] for p in passes[1:])
    # every verification, of one token or a block, written into the full cache past the prefix and read there
    assert all(p.in_place == (p.kind == "verify") for p in passes)
    # each pass told once it has run, with its wall time: together less than the run's
    assert all(p.seconds > 0 for p in passes) and sum(p.seconds for p in passes) < out.wall_time
    if method == "ar":
        assert all(p.in_place and p.tokens == 1 for p in passes[1:])
    cost = fit_pass_cost(synthetic(), held_out=HELD_OUT)
    expected = prefill_truth(ids.shape[1]) + sum(priced(p) for p in passes[1:])
    assert pass_cost.predict_seconds(cost, passes) == pytest.approx(expected, rel=1e-9)
    by_kind = pass_cost.predict_by_kind(cost, passes, prefill_seconds=0.5)
    assert by_kind["prefill"] == 0.5
    assert sum(by_kind.values()) == pytest.approx(expected - prefill_truth(ids.shape[1]) + 0.5, rel=1e-9)
    kinds = {"ar": {"prefill", "verify"}, "self-spec": {"prefill", "draft", "verify"}, "pld": {"prefill", "verify"},
             "das-wave": {"prefill", "refine", "verify"}}
    assert set(by_kind) == kinds[method]


def test_predictions_refuse_a_batch_and_an_unmeasured_mode():
    eager = fit_pass_cost(synthetic(modes=("eager",)))
    with pytest.raises(ValueError, match="pass 0 \\(verify\\) ran 2 rows; the pass-cost model is timed at batch 1"):
        pass_cost.predict_seconds(eager, [PassRecord("verify", 2, 1, 32, 100, False)])
    with pytest.raises(ValueError, match="mode 'compiled' was not measured"):
        pass_cost.predict_seconds(eager, [PassRecord("verify", 1, 1, 32, 128, True)])


def test_compiled_passes_log_their_capacity_and_width_buckets(traced):
    model = random_model("huginn", seed=3, block_size=160, n_core=1, mean_recurrence=2)
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(0))
    log = PassLog()
    out = generate(model, ids, method="das-wave", max_width=6, rounds=3, initial_width=3, updates=1, max_new_tokens=8,
                   num_loops=2, stop_at_eos=False, compile=True, observer=log)
    assert len(log.passes) == out.forward_passes and all(p.compiled for p in log.passes)
    assert replace(log.passes[0], seconds=None) == PassRecord("prefill", 1, 7, 2, 0, True)
    assert all(p.seconds > 0 for p in log.passes) and sum(p.seconds for p in log.passes) < out.wall_time
    assert {p.context for p in log.passes[1:]} == {64}  # the capacity bucket of 7 + 8 + gamma + 1 positions
    refined = [p.tokens for p in log.passes if p.kind == "refine"][:3]
    assert refined == [refined_width(w, 6) for w in (3, 4, 5)] == [3, 4, 6]


def test_a_chain_of_drafts_is_priced_by_its_own_cells_linearly_in_its_length_from_one_draft():
    cost = fit_pass_cost(synthetic(), held_out=HELD_OUT)
    for r, L in [(4, 256), (1, 64), (4, 400)]:
        for g in CHAINS:
            assert cost.drafts_seconds(g, r, L) == pytest.approx(chain_truth(g, r, L), rel=1e-9)
        one = cost.seconds(1, r, L, "compiled")
        assert cost.drafts_seconds(1, r, L) == pytest.approx(one, rel=1e-12)  # one draft: a pass cell
        assert cost.drafts_seconds(2, r, L) == pytest.approx(one + (chain_truth(4, r, L) - one) / 3, rel=1e-9)
        assert cost.drafts_seconds(6, r, L) == pytest.approx((chain_truth(4, r, L) + chain_truth(8, r, L)) / 2,
                                                             rel=1e-9)
    record = PassRecord("drafts", 1, 8, 4, 256, True, seconds=1e-3)
    assert pass_cost.priced_by(record) == "drafts"
    assert cost.record_seconds(record) == pytest.approx(chain_truth(8, 4, 256), rel=1e-9)
    assert pass_cost.predict_at_drift(cost, [record], {("drafts", 8): 2.0}) == pytest.approx(2 * chain_truth(8, 4, 256))
    with pytest.raises(ValueError, match=r"compiled chain of drafts 9 is outside the measured 1\.\.8; re-run "
                                         r"looped-kv pass-cost with --draft-chains covering it"):
        cost.drafts_seconds(9, 4, 256)
    with pytest.raises(ValueError, match=r"compiled chains of drafts of 2 loops were not measured \(measured: \[1, "
                                         r"4\]\); re-run looped-kv pass-cost with --draft-chains and --loops 2"):
        cost.drafts_seconds(4, 2, 256)
    with pytest.raises(ValueError, match=r"eager chains of drafts of 4 loops were not measured \(measured: none\)"):
        cost.drafts_seconds(4, 4, 256, "eager")


def test_compiled_sequential_drafts_are_one_chain_per_verification(traced):
    """Compiled self-spec drafts each block as one step (:meth:`CompiledPasses.drafts`), told as one pass of kind
    "drafts" of gamma tokens; eager, as gamma passes."""
    model = random_model("huginn", seed=3, block_size=160, n_core=1, mean_recurrence=4)
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(0))
    logs = {compiled: PassLog() for compiled in (False, True)}
    outs = {compiled: generate(model, ids, method="self-spec", gamma=3, draft_loops=1, max_new_tokens=12,
                               stop_at_eos=False, compile=compiled, observer=log) for compiled, log in logs.items()}
    assert outs[True].tokens.tolist() == outs[False].tokens.tolist()
    kinds = {compiled: [p.kind for p in log.passes] for compiled, log in logs.items()}
    verifications = outs[True].verifications
    assert kinds[True] == ["prefill"] + ["drafts", "verify"] * verifications
    assert kinds[False] == ["prefill"] + (["draft"] * 3 + ["verify"]) * verifications
    chains = [p for p in logs[True].passes if p.kind == "drafts"]
    assert {(p.tokens, p.loops, p.context) for p in chains} == {(3, 1, 64)}


def test_a_compiled_capacity_is_looked_up_not_priced_on_a_line():
    """A compiled step is a kernel per capacity: its measured time at every capacity is what the model gives there,
    however unlike a line in the capacity (here a jump from 64 to 96, as measured), and halfway between two measured
    capacities the model gives their mean."""
    steps = {64: 1.00e-3, 96: 1.32e-3, 128: 1.37e-3, 192: 1.45e-3, 256: 1.64e-3, 512: 2.30e-3}
    timings = [Timing("compiled", "verify", g, 32, L, (s * (1 + g / 10),)) for g in (1, 9) for L, s in steps.items()]
    timings += [Timing("compiled", "pass", g, r, L, (s * r / 4 + 1e-4 * g,)) for g in (1, 9) for r in (2, 4)
                for L, s in steps.items()]
    cost = fit_pass_cost(timings)
    for L, s in steps.items():
        assert cost.verify_seconds(1, L, "compiled") == pytest.approx(s * 1.1, rel=1e-12)
        assert cost.verify_seconds(5, L, "compiled") == pytest.approx(s * 1.5, rel=1e-12)  # between widths 1 and 9
        assert cost.seconds(9, 3, L, "compiled") == pytest.approx(s * 3 / 4 + 9e-4, rel=1e-9)
    assert cost.verify_seconds(1, 160, "compiled") == pytest.approx((1.37e-3 + 1.45e-3) / 2 * 1.1, rel=1e-12)


def test_the_grid_times_verifications_at_their_own_widths_and_compiled_cells_at_given_capacities():
    grid = experiment.Grid(modes=["eager", "compiled"], tokens=[1, 4], held_out_tokens=[2], loops=[2, 4],
                           contexts=[10, 70], prompt_lengths=[5, 9], rounds=1, statistic="median", calls=2,
                           verify_tokens=[1, 9], capacities=[96, 192])
    cells = experiment.cells(grid, 1024, 32)
    assert {c for c in cells if c[1] == "verify"} == {(m, "verify", g, 32, L) for m, contexts in
                                                      (("eager", (10, 70)), ("compiled", (96, 192)))
                                                      for g in (1, 9) for L in contexts}
    assert {c for c in cells if c[1] == "pass"} == {(m, "pass", g, r, L) for m, contexts in
                                                    (("eager", (10, 70)), ("compiled", (96, 192)))
                                                    for g in (1, 2, 4) for r in (2, 4) for L in contexts}
    default = replace(grid, verify_tokens=None, capacities=None)
    assert {(c[0], c[2], c[4]) for c in experiment.cells(default, 1024, 32) if c[1] == "verify"} == {
        (m, g, L) for m, contexts in (("eager", (10, 70)), ("compiled", (64, 96))) for g in (1, 2, 4)
        for L in contexts}


def test_the_grid_times_a_compiled_wave_of_das_waves_default_schedule_and_the_check_re_times_it(traced):
    """``--waves 3``: a compiled wave of DAS-Wave's default schedule with J = 3 (max_width 32, W_init 2, k 2) at each
    capacity, recorded with its rounds' widths, priced by its cells, and re-timed by a check for its drift."""
    model = random_model("huginn", seed=3, block_size=160, n_core=1, mean_recurrence=4)
    grid = experiment.Grid(modes=["compiled"], tokens=[1, 4], held_out_tokens=[], loops=[1, 4], contexts=[10, 70],
                           prompt_lengths=[5, 9], rounds=2, statistic="median", calls=1, waves=[3])
    experiment.check_grid(grid, model.config)
    assert experiment.grid_wave(3) == ([(0, 2, 1), (2, 3, 3), (3, 4, 5)], 2, (2, 3, 4))
    timings = experiment.measure(model, grid, progress=False)
    waves = [t for t in timings if t.kind == "wave"]
    assert {(t.tokens, t.loops, t.context, t.widths) for t in waves} == {(3, 2, L, (2, 3, 4)) for L in (64, 96)}
    cost = fit_pass_cost(timings, meta={"calls": 1})
    assert cost.wave_seconds((2, 3, 4), 2, 96, "compiled") > 0
    rooms = []
    cell_arms = experiment.cell_arms

    def spy(model, cells, widest, *args):
        rooms.append(widest)
        return cell_arms(model, cells, widest, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(experiment, "cell_arms", spy)
        probes = experiment.drift_arms(model, cost, "compiled")
    assert rooms == [4]  # room past the prefix for the widest pass and the wave's widest round
    assert {(kind, tokens) for kind, tokens, _, _ in probes if kind == "wave"} == {("wave", 3)}
    assert all(run() > 0 for kind, _, _, run in probes if kind == "wave")
    moved = replace(cost, timings=tuple(replace(t, widths=(2, 3, 6)) if t.kind == "wave" else t for t in timings))
    with pytest.raises(ValueError, match="waves of \\[3, 3\\] rounds refine other widths than DAS-Wave's default"):
        experiment.drift_arms(model, moved, "compiled")


def test_the_grid_times_every_cell_in_every_round(traced):
    model = random_model("huginn", seed=3, block_size=160, n_core=1, mean_recurrence=4)
    grid = experiment.Grid(modes=["eager", "compiled"], tokens=[1, 4], held_out_tokens=[2], loops=[1, 4],
                           contexts=[10, 70], prompt_lengths=[5, 9], rounds=2, statistic="median", calls=2,
                           draft_chains=[3])
    experiment.check_grid(grid, model.config)
    timings = experiment.measure(model, grid, progress=False)
    cells = {(t.mode, t.kind, t.tokens, t.loops, t.context) for t in timings}
    assert len(cells) == len(timings) == 2 * 3 * 2 * 2 + 2 * 3 * 2 + 2 * 2 + 2
    # chains of 3 one-token drafts, compiled only, of the loop counts below R = 4, at each capacity
    assert {c for c in cells if c[1] == "drafts"} == {("compiled", "drafts", 3, 1, L) for L in (64, 96)}
    assert {t.context for t in timings if t.mode == "compiled" and t.kind == "pass"} == {64, 96}
    assert {c for c in cells if c[1] == "verify"} == {(m, "verify", g, 4, L) for m, contexts in
                                                      (("eager", (10, 70)), ("compiled", (64, 96)))
                                                      for g in (1, 2, 4) for L in contexts}
    assert all(len(t.seconds) == 2 and min(t.seconds) > 0 for t in timings)
    assert set(fit_pass_cost(timings, held_out=[2]).coefficients["compiled"]) == {1, 4}


def test_compare_gives_the_ratio_per_method():
    runs = pd.DataFrame({"method": ["ar", "ar", "self-spec"], "predicted_s": [1.0, 3.0, 2.0],
                         "measured_s": [2.0, 2.0, 1.0]})
    table = pass_cost.compare(runs)
    assert table.loc["ar", "ratio"] == 1.0 and table.loc["ar", "median"] == 1.0
    assert (table.loc["ar", "min"], table.loc["ar", "max"], table.loc["ar", "runs"]) == (0.5, 1.5, 2)
    assert table.loc["self-spec", "ratio"] == 2.0
    with pytest.raises(ValueError, match="missing \\['measured_s'\\]"):
        pass_cost.compare(runs.drop(columns="measured_s"))


def test_eq_8_is_the_bound_of_pass_costs_that_ignore_the_tokens():
    n_pre, n_core, n_coda = 2, 4, 2
    layers = [Timing("eager", "pass", g, r, L, (1e-3 * (n_pre + r * n_core + n_coda),))
              for g in (1, 32) for r in (1, 32) for L in (64, 512)]
    layers += [Timing("eager", "verify", g, 32, L, (1e-3 * (n_pre + 32 * n_core + n_coda),))
               for g in (1, 32) for L in (64, 512)]
    cost = fit_pass_cost(layers)
    for tau, d, gamma in [(3.4, 4, 4), (1.0, 2, 8), (5.0, 8, 4)]:
        passes = pass_cost.cycle(SelfSpec(draft_loops=d, gamma=gamma), 32)
        assert pass_cost.speedup_bound(cost, tau, passes, 32, 200) == pytest.approx(
            speedup(tau, d, gamma, (n_pre, n_core, n_coda), num_loops=32), rel=1e-9)
    assert pass_cost.speedup_bound(cost, 1.0, pass_cost.cycle(Greedy(), 32), 32, 100) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="tau must be >= 1"):
        pass_cost.speedup_bound(cost, 0.5, [("verify", 1, 32)], 32, 100)
    with pytest.raises(ValueError, match="passes must end with the verification, through all 32 loops"):
        pass_cost.speedup_bound(cost, 2.0, [("verify", 5, 32), ("pass", 1, 4)], 32, 100)



def test_eq_8_over_a_cycles_layer_passes_is_the_papers_speedup_at_eta_1():
    layers = (2, 4, 2)  # c(r) = 4 + 4 r
    for tau, d, gamma in [(3.4, 4, 4), (1.0, 2, 8), (9.0, 4, 8)]:
        passes = pass_cost.cycle(SelfSpec(draft_loops=d, gamma=gamma), 32)
        assert pass_cost.layer_pass_bound(layers, tau, passes, 32) == pytest.approx(
            speedup(tau, d, gamma, layers, num_loops=32), rel=1e-12)
    # DAS-Wave: J = 24 rounds of k = 2 loops (c = 12 each) and a verification (c(32) = 132), w = 25 tokens
    wave = pass_cost.cycle(DasWave(), 32)
    assert pass_cost.layer_pass_bound(layers, 25, wave, 32) == pytest.approx(25 * 132 / (24 * 12 + 132))
    assert pass_cost.layer_pass_bound(layers, 1.0, pass_cost.cycle(Greedy(), 32), 32) == 1.0
    # a compiled chain of gamma drafts costs gamma drafts' layer passes
    chained = pass_cost.cycle(SelfSpec(draft_loops=4, gamma=8), 32, compiled=True)
    assert pass_cost.layer_pass_bound(layers, 5.0, chained, 32) == pytest.approx(speedup(5.0, 4, 8, layers,
                                                                                          num_loops=32))
    with pytest.raises(ValueError, match="tau must be >= 1"):
        pass_cost.layer_pass_bound(layers, 0.0, [("verify", 1, 32)], 32)
    with pytest.raises(ValueError, match="passes must end with the verification, through all 32 loops"):
        pass_cost.layer_pass_bound(layers, 2.0, [("verify", 5, 32), ("pass", 1, 4)], 32)


def test_bounds_price_each_drafters_cycle_at_its_tokens_per_verification_and_with_all_accepted():
    configs = {"self-spec": SelfSpec(draft_loops=4, gamma=8), "pld": PromptLookup(gamma=6), "das-wave": DasWave()}
    tokens = {"code": {"self-spec": 4.5, "pld": 1.75, "das-wave": 20.0}, "chains": {"self-spec": 9.0, "pld": 7.0,
                                                                                     "das-wave": 1.0}}
    cost = fit_pass_cost(synthetic(), held_out=HELD_OUT)
    for mode in ("eager", "compiled"):
        for L in CONTEXTS:
            table = pass_cost.bounds(cost, configs, tokens, (1, 1, 1), 32, L, mode)
            assert list(table.columns) == ["code", "chains", "all accepted", "Eq. (8), all accepted"]
            # prompt lookup: 7 tokens for one verification of 7 instead of 7 one-token steps
            assert table.loc["pld", "all accepted"] == pytest.approx(7 * verify_truth(1, L) / verify_truth(7, L))
            # 8 one-token 4-loop drafts (compiled: one chain of 8), a verification of 9
            drafts = chain_truth(8, 4, L) if mode == "compiled" else 8 * truth(1, 4, L)
            spent = drafts + verify_truth(9, L)
            assert table.loc["self-spec", "code"] == pytest.approx(4.5 * verify_truth(1, L) / spent)
            assert table.loc["self-spec", "chains"] == table.loc["self-spec", "all accepted"]  # tau = gamma + 1
            assert table.loc["das-wave", "code"] == pytest.approx(0.8 * table.loc["das-wave", "all accepted"])
            assert table.loc["pld", "Eq. (8), all accepted"] == 7.0  # a verification costs one step's layer passes
            assert table.loc["das-wave", "Eq. (8), all accepted"] == pytest.approx(25 * 34 / (24 * 4 + 34))
            assert (table["all accepted"] < table["Eq. (8), all accepted"]).all()  # more tokens cost more here
        ceilings = pass_cost.ceilings(cost, configs, 32, mode)
        assert list(ceilings.columns) == list(CONTEXTS)
        assert ceilings[64].to_numpy() == pytest.approx(
            pass_cost.bounds(cost, configs, {}, (1, 1, 1), 32, 64, mode)["all accepted"].to_numpy())
    with pytest.raises(ValueError, match="tokens\\['code'\\] has no tokens per verification of \\['das-wave'\\]"):
        pass_cost.bounds(cost, configs, {"code": {"self-spec": 2.0, "pld": 1.0}}, (1, 1, 1), 32, 64)
    # passes that cost their layer passes whatever their tokens: every bound with all accepted is Eq. (8)'s
    flat = [Timing("eager", "pass", g, r, L, (1e-3 * (2 + r),)) for g in (1, 32) for r in (1, 32) for L in (64, 512)]
    flat += [Timing("eager", "verify", g, 32, L, (1e-3 * 34,)) for g in (1, 32) for L in (64, 512)]
    table = pass_cost.bounds(fit_pass_cost(flat), configs, {}, (1, 1, 1), 32, 512)
    assert table["all accepted"].to_numpy() == pytest.approx(table["Eq. (8), all accepted"].to_numpy())
    with pytest.raises(ValueError, match="mode 'compiled' was not measured"):
        pass_cost.ceilings(fit_pass_cost(flat), configs, 32, "compiled")

def test_a_cycle_lists_each_methods_passes():
    assert pass_cost.cycle(SelfSpec(), 32) == [("pass", 1, 4)] * 4 + [("verify", 5, 32)]
    assert pass_cost.cycle(SelfSpec(), 32, compiled=True) == [("drafts", 4, 4), ("verify", 5, 32)]  # one chain
    assert pass_cost.cycle(PromptLookup(gamma=6), 32) == [("verify", 7, 32)]
    assert pass_cost.cycle(Greedy(), 32, compiled=True) == [("verify", 1, 32)]
    wave = pass_cost.cycle(DasWave(), 32)  # J = 24 rounds of k = 2 over 2, 3, ..., 25 positions, then w = 25
    assert wave[:3] == [("pass", 2, 2), ("pass", 3, 2), ("pass", 4, 2)] and len(wave) == 25
    assert wave[-2:] == [("pass", 25, 2), ("verify", 25, 32)]
    assert pass_cost.cycle(DasWave(), 32, compiled=True)[-2] == ("pass", 32, 2)
    fused = pass_cost.cycle(DasWave(fuse_rounds=True), 32, compiled=True)  # one step of 24 rounds, then w = 25
    rounds = tuple(p[1] for p in pass_cost.cycle(DasWave(), 32, compiled=True)[:-1])
    assert fused == [("wave", 24, 2, rounds), ("verify", 25, 32)] and rounds[:4] == (2, 3, 4, 6)
    assert pass_cost.cycle(DasWave(fuse_rounds=True), 32) == wave  # eager rounds are passes of their own


WAVE = (2, 3, 4, 6, 6)  # the refined widths of a wave of five rounds


def wave_truth(L: int) -> float:
    """A known compiled wave of :data:`WAVE`'s rounds of 2 loops: cheaper than its rounds as passes."""
    return 0.6 * sum(truth(w, 2, L) for w in WAVE)


def test_a_compiled_wave_is_priced_by_its_own_cells_of_its_rounds_widths(tmp_path):
    waves = [Timing("compiled", "wave", len(WAVE), 2, L, (wave_truth(L), 2 * wave_truth(L), 0.5 * wave_truth(L)),
                    widths=WAVE) for L in (64, 256)]
    cost = fit_pass_cost([*synthetic(), *waves], held_out=HELD_OUT)
    assert cost.waves == {"compiled": {2: {WAVE: {64: wave_truth(64), 256: wave_truth(256)}}}}
    assert cost.wave_seconds(WAVE, 2, 64) == pytest.approx(wave_truth(64), rel=1e-12)
    assert cost.wave_seconds(WAVE, 2, 160) == pytest.approx((wave_truth(64) + wave_truth(256)) / 2, rel=1e-12)
    record = PassRecord("wave", 1, 5, 2, 256, True, seconds=1e-3, widths=WAVE)
    assert pass_cost.priced_by(record) == "wave"
    assert cost.record_seconds(record) == pytest.approx(wave_truth(256), rel=1e-12)
    assert pass_cost.predict_at_drift(cost, [record], {("wave", 5): 1.5}) == pytest.approx(1.5 * wave_truth(256))
    fused = [("wave", 5, 2, WAVE), ("verify", 6, 32)]
    assert pass_cost.speedup_bound(cost, 6.0, fused, 32, 256, "compiled") == pytest.approx(
        6 * verify_truth(1, 256) / (wave_truth(256) + verify_truth(6, 256)), rel=1e-9)
    layers = (2, 4, 2)  # a wave of J rounds costs its J rounds' layer passes
    rounds = [("pass", w, 2) for w in WAVE] + [("verify", 6, 32)]
    assert pass_cost.layer_pass_bound(layers, 6.0, fused, 32) == pass_cost.layer_pass_bound(layers, 6.0, rounds, 32)
    fused_apart = pass_cost.fused_waves(cost)  # the wave against its rounds priced as passes of their own
    assert list(fused_apart["context"]) == [64, 256] and set(fused_apart["rounds"]) == {5}
    assert fused_apart["rounds apart (s)"].tolist() == pytest.approx([sum(truth(w, 2, L) for w in WAVE)
                                                                      for L in (64, 256)], rel=1e-9)
    assert fused_apart["rounds apart / one step"].tolist() == pytest.approx([1 / 0.6] * 2, rel=1e-9)
    assert pass_cost.fused_waves(fit_pass_cost(synthetic(), held_out=HELD_OUT)).empty
    path = tmp_path / "cost.json"
    cost.write(path)
    assert pass_cost.read(path) == cost and pass_cost.read(path).waves == cost.waves
    with pytest.raises(ValueError, match=r"no compiled wave of 3 rounds of 2 loops over \[2, 3, 4\] positions was "
                                         r"measured \(measured: \[\(2, \[2, 3, 4, 6, 6\]\)\]\); re-run looped-kv "
                                         r"pass-cost with --waves 3"):
        cost.wave_seconds((2, 3, 4), 2, 64)
    with pytest.raises(ValueError, match=r"no compiled wave of 5 rounds of 1 loops .* \(measured: none\)"):
        cost.record_seconds(replace(record, loops=1))
    for kind, widths in (("wave", ()), ("wave", (2, 3)), ("pass", (2,))):
        with pytest.raises(ValueError, match="a wave timing \\(only\\) must give its rounds' widths, one per round"):
            fit_pass_cost([*synthetic(), Timing("compiled", kind, 5, 2, 64, (1e-3,), widths=widths)])


# -- the command ----------------------------------------------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Loading the model or timing anything fails the test: every refusal must come first."""
    def work(*args, **kwargs):
        raise AssertionError("the work started before the bad input was refused")

    monkeypatch.setattr(experiment, "run", work)
    monkeypatch.setattr("looped_kv.cli.load", work)


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0", "4"], "--tokens must be 1 or more distinct integers >= 1, got [0, 4]"),
    (["--loops", "4"], "--loops must be 2 or more distinct integers >= 1, got [4]"),
    (["--loops", "1", "64"], "--loops must each be in [1, 32] (the model's R), got [1, 64]"),
    (["--contexts", "256", "256"], "--contexts must be 2 or more distinct integers >= 1"),
    (["--contexts", "64", "1000"], "--contexts must each be <= 992 (the model's context 1024 less the widest pass"),
    (["--contexts", "65", "70", "--modes", "compiled"],
     "--contexts (or --capacities) must give 2 or more compiled capacities above the widest pass (32 tokens); they "
     "give [96]"),
    (["--capacities", "96", "100"], "--capacities must each be one a compiled decode allocates, [64, 96, 128, 192, "
                                    "256, 384, 512, 768, 1024], got [96, 100]"),
    (["--capacities", "96"], "--capacities must be 2 or more distinct integers >= 1, got [96]"),
    (["--verify-tokens", "0", "9"], "--verify-tokens must be 1 or more distinct integers >= 1, got [0, 9]"),
    (["--verify-tokens", "1", "64", "--modes", "compiled"],
     "--contexts (or --capacities) must give 2 or more compiled capacities above the widest pass (64 tokens)"),
    (["--held-out-tokens", "40"], "--held-out-tokens must lie strictly between the smallest and largest --tokens "
                                  "(1 and 32) and not be among them, got [40]"),
    (["--prompt-lengths", "16", "2000"], "--prompt-lengths must each be in [1, 1024]"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--draft-chains", "1", "8"], "--draft-chains must each be >= 2 (one draft is a pass cell), got [1, 8]"),
    (["--waves", "0"], "--waves must each be >= 1, with --modes compiled (a wave is one compiled step), got [0]"),
    (["--waves", "24", "--modes", "eager"], "--waves must each be >= 1, with --modes compiled (a wave is one "
                                            "compiled step), got [24] with --modes ['eager']"),
    (["--waves", "24", "--tokens", "1", "16"], "--tokens must span the widths the --waves' rounds refine, 2 to 32, got "
                                               "[1, 16]"),
    (["--calls", "0"], "--calls must be >= 1, got 0"),
    (["--tokens", *map(str, range(1, 25)), "--held-out-tokens", "--modes", "compiled"],
     "make 288 compiled cells, each a trace of one compiled step, which holds at most 256"),
    (["--statistic", "mean"], "argument --statistic: invalid choice: 'mean' (choose from 'median', 'min')"),
    (["--modes", "fast"], "argument --modes: invalid choice: 'fast' (choose from 'eager', 'compiled')"),
    (["--model", "./no-such-model"], "--model './no-such-model'"),
])
def test_the_command_refuses_bad_input_in_one_line_before_any_work(tmp_path, no_work, capsys, argv, message):
    try:
        status = main(["pass-cost", "--out", str(tmp_path / "cost.json"), *argv])
    except SystemExit as exit_:  # argparse's own refusals (choices)
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "cost.json").exists()


def test_a_pass_or_step_cell_is_timed_as_consecutive_calls_and_a_prefill_alone(monkeypatch):
    """Each timing of a pass or step cell is one untimed call then ``calls`` back to back, and returns their mean
    (a decode makes them back to back; timed alone after another cell's pass, a compiled step finds cold caches); a
    prefill is one call on a new cache."""
    model = random_model("huginn", seed=3, block_size=160, n_core=1, mean_recurrence=4)
    grid = experiment.Grid(modes=["eager"], tokens=[1, 4], held_out_tokens=[], loops=[1, 4], contexts=[10, 70],
                           prompt_lengths=[5, 9], rounds=1, statistic="median", calls=3)
    runs = experiment.arms(model, grid)
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(experiment, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # the grid's clock
    called: list[str] = []
    for name in ("run", "verify", "prefill"):
        real = getattr(experiment.Passes, name)
        monkeypatch.setattr(experiment.Passes, name,
                            lambda self, *a, real=real, name=name: (called.append(name), real(self, *a))[1])
    with torch.no_grad():
        assert runs["eager", "pass", 4, 1, 70]() == pytest.approx(1 / 3)  # one tick of the fake clock over 3 calls
        assert runs["eager", "verify", 4, 4, 10]() == pytest.approx(1 / 3)
        assert runs["eager", "prefill", 9, 4, 0]() == 1
    assert called == ["run"] * 4 + ["verify"] * 4 + ["prefill"]


def test_the_command_keeps_an_existing_file(tmp_path, no_work, capsys):
    out = tmp_path / "cost.json"
    out.write_text("mine")
    assert main(["pass-cost", "--out", str(out)]) == 2
    assert f"--out {out} exists and is left untouched" in capsys.readouterr().err and out.read_text() == "mine"


def test_the_command_records_the_fit_with_the_machine_and_the_command(tmp_path, monkeypatch, capsys):
    timings = synthetic(modes=("eager",))
    monkeypatch.setattr(experiment, "measure", lambda model, grid, progress: timings)
    monkeypatch.setattr("looped_kv.cli.load", lambda *args, **kwargs: random_model("huginn"))
    monkeypatch.setattr(experiment, "weights_sha256", lambda source: "0" * 64)
    out = tmp_path / "cost.json"
    argv = ["pass-cost", "--out", str(out), "--modes", "eager", "--tokens", *map(str, WIDTHS), "--held-out-tokens",
            "5", "25", "--loops", "1", "4", "32", "--threads", "1", "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"recorded in {out}" in printed and "held out" in printed
    cost = pass_cost.read(out)
    assert cost.meta["command"] == "looped-kv " + " ".join(argv)
    assert cost.meta["environment"]["threads"] == 1 and cost.meta["environment"]["cpu"]
    assert cost.meta["commit"] and cost.meta["date"] and cost.meta["model"] == "tiny"
    assert cost.held_out == HELD_OUT and cost.seconds(8, 4, 256) == pytest.approx(truth(8, 4, 256), rel=1e-9)
    assert main(argv) == 2 and "exists and is left untouched" in capsys.readouterr().err


def test_the_check_prices_each_runs_own_passes(tiny):
    """pass-cost-check's rows: every method's runs, measured and predicted from the passes the run itself logged
    (the prediction equals pricing a fresh run's PassLog: decoding is deterministic); every method decodes each
    prompt once, unlogged and untimed, before its rounds."""
    cost = fit_pass_cost(synthetic(modes=("eager",)), held_out=HELD_OUT, meta={"calls": 2})
    ids = [tiny.tokenizer(t, return_tensors="pt").input_ids for t in (
        "Question: Ann has 3 pens and buys 4 more. How many pens? Answer:", "a=3;b=a+2;c=b;d=c+1;e=d;x=e;f=x+4;y=f;")]
    methods = {"self-spec": SelfSpec(gamma=3), "das-wave": DasWave(max_width=8)}
    calls = []

    def counted(model, ids_, config=None, **options):
        calls.append((config.method, next(i for i, p in enumerate(ids) if p is ids_), "observer" in options))
        return generate(model, ids_, config, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "generate", counted)
        runs = experiment.predictions(tiny, cost, ids, methods, max_new_tokens=6, repeats=2, progress=False)
    order = ["ar", "self-spec", "das-wave"]  # per prompt: each unlogged once, then two rounds, the second reversed
    assert calls == [(m, i, logged) for i in range(2)
                     for logged, rounds in ((False, order), (True, order + order[::-1])) for m in rounds]
    assert list(runs["method"]) == ["ar", "self-spec", "das-wave"] * 2 and (runs["measured_s"] > 0).all()
    assert ((runs["in_passes_s"] > 0) & (runs["in_passes_s"] < runs["measured_s"])).all()
    for column in ("drift_pass", "drift_verify"):  # one per prompt
        assert (runs[column] > 0).all() and runs.groupby("prompt")[column].nunique().eq(1).all()
    for _, row in runs.iterrows():
        log = PassLog()
        config = Greedy() if row["method"] == "ar" else methods[row["method"]]
        out = generate(tiny, ids[row["prompt"]], config, max_new_tokens=6, observer=log)
        assert row["passes"] == len(log.passes) and row["new_tokens"] == out.num_new
        assert row["predicted_s"] == pytest.approx(pass_cost.predict_seconds(cost, log.passes), rel=1e-12)
        assert log.passes[0].kind == "prefill"  # then the passes after it (none where the first token ends the run)
        assert (row["first_pass_s"] > 0, row["later_passes_s"] > 0) == (len(log.passes) > 1, len(log.passes) > 2)
        assert row["first_pass_price_s"] == pytest.approx(sum(map(cost.record_seconds, log.passes[1:2])), rel=1e-12)
        assert row["later_passes_price_s"] == pytest.approx(sum(map(cost.record_seconds, log.passes[2:])), rel=1e-12)
    table = pass_cost.compare(runs)
    assert list(table.index) == ["ar", "self-spec", "das-wave"] and (table["runs"] == 2).all()


def drifted(kind: str, tokens: int) -> float:
    """A machine's drift per kind of cell, linear in its tokens (so that interpolating between two widths is exact):
    passes at 2x their recorded time at one token and 4x at 32, verifications 3x and 6x, prefills 5x at 16 tokens
    and 12x at 128."""
    if kind == "prefill":
        return 4 + tokens / 16
    low, high = {"pass": (2.0, 4.0), "verify": (3.0, 6.0)}[kind]
    return low + (high - low) * (tokens - 1) / 31


def test_the_machines_drift_is_read_per_kind_and_width_linearly_between_widths():
    drift = {("pass", 1): 2.0, ("pass", 32): 4.0, ("prefill", 16): 5.0, ("prefill", 128): 12.0}
    assert pass_cost.drift_at(drift, "pass", 1) == 2.0 and pass_cost.drift_at(drift, "pass", 32) == 4.0
    assert pass_cost.drift_at(drift, "pass", 8) == pytest.approx(drifted("pass", 8), rel=1e-12)
    assert pass_cost.drift_at(drift, "prefill", 72) == pytest.approx(drifted("prefill", 72), rel=1e-12)
    assert pass_cost.drift_at(drift, "prefill", 4) == 5.0 and pass_cost.drift_at(drift, "prefill", 400) == 12.0
    with pytest.raises(ValueError, match=r"drift has no 'verify' cells; it has \['pass', 'prefill'\]"):
        pass_cost.drift_at(drift, "verify", 1)
    record = PassRecord("verify", 1, 8, 32, 256, False, in_place=False)  # a pass of 8 tokens, priced by pass cells
    cost = fit_pass_cost(synthetic(), held_out=HELD_OUT)
    assert pass_cost.predict_at_drift(cost, [record], drift) == pytest.approx(
        drifted("pass", 8) * cost.record_seconds(record), rel=1e-12)


def test_the_check_reads_the_machines_drift_per_kind_and_width_of_cell(tiny, monkeypatch):
    """After each prompt the check re-times, at every context, the record's narrowest and widest verifications and
    its narrowest and widest passes at every loop count, as the grid timed them (its calls), and its prefill at every
    recorded prompt length, and keeps per kind and width the median of time now / recorded (a fake clock:
    :func:`drifted`), and per kind the median over all its cells. The prediction at drift prices each pass the run
    logged at the drift of its kind at its width."""
    cost = fit_pass_cost(synthetic(modes=("eager",)), held_out=HELD_OUT, meta={"calls": 5})
    cells = experiment.drift_cells(cost, "eager")
    assert sorted((t.kind, t.tokens, t.loops, t.context) for t in cells) == sorted(
        [("verify", g, 32, L) for g in (1, 32) for L in CONTEXTS] + [("pass", g, r, L) for g in (1, 32) for r in LOOPS
                                                                       for L in CONTEXTS]
        + [("prefill", n, 32, 0) for n in PROMPTS])
    asked, prefills = [], []

    def fake_arms(model, timed_cells, widest, calls, generator):
        asked.append((sorted(timed_cells), widest, calls))
        return {cell: (lambda g=cell[2], r=cell[3], L=cell[4], kind=cell[1]: drifted(kind, g) * (
            truth(g, r, L) if kind == "pass" else verify_truth(g, L))) for cell in timed_cells}

    def fake_prefills(model, timed_cells, generator):
        prefills.append(sorted(timed_cells))
        return {cell: (lambda n=cell[2]: drifted("prefill", n) * prefill_truth(n)) for cell in timed_cells}

    monkeypatch.setattr(experiment, "cell_arms", fake_arms)
    monkeypatch.setattr(experiment, "prefill_arms", fake_prefills)
    ids = [tiny.tokenizer("Question: Ann has 3 pens and buys 4 more. How many pens? Answer:",
                          return_tensors="pt").input_ids] * 2
    config = SelfSpec(gamma=3)
    runs = experiment.predictions(tiny, cost, ids, {"self-spec": config}, max_new_tokens=4, repeats=1,
                                  progress=False)
    assert asked == [(sorted((t.mode, t.kind, t.tokens, t.loops, t.context) for t in cells if t.kind != "prefill"),
                      32, 5)]
    assert prefills == [sorted(("eager", "prefill", n, 32, 0) for n in PROMPTS)]
    for kind, widths in (("pass", (1, 32)), ("verify", (1, 32)), ("prefill", PROMPTS)):
        for g in widths:
            assert runs[f"drift_{kind}_{g}"].tolist() == pytest.approx([drifted(kind, g)] * 4, rel=1e-12)
    assert runs["drift_pass"].tolist() == pytest.approx([3.0] * 4, rel=1e-12)  # half the cells at 2x, half at 4x
    assert runs["drift_prefill"].tolist() == pytest.approx([drifted("prefill", 128)] * 4, rel=1e-12)
    drafts = runs["predicted_draft_s"].fillna(0.0)
    assert (drafts[runs["method"] == "self-spec"] > 0).all() and (runs["predicted_prefill_s"] > 0).all()
    for _, row in runs.iterrows():  # decoding is deterministic: a fresh run logs the same passes
        log = PassLog()
        generate(tiny, ids[row["prompt"]], Greedy() if row["method"] == "ar" else config, max_new_tokens=4,
                 observer=log)
        if row["method"] == "self-spec":  # its verifications are wider than one token
            assert {p.tokens for p in log.passes if pass_cost.priced_by(p) == "verify"} - {1}
        assert row["predicted_at_drift_s"] == pytest.approx(sum(
            cost.record_seconds(p) * drifted(pass_cost.priced_by(p), p.tokens) for p in log.passes), rel=1e-12)
    table = pass_cost.against_greedy(runs)
    sums = runs.groupby("method", sort=False)[["measured_s", "predicted_at_drift_s"]].sum()
    assert table["measured / predicted at drift"].to_numpy() == pytest.approx(
        (sums["measured_s"] / sums["predicted_at_drift_s"]).to_numpy(), rel=1e-12)


def test_a_prefill_cell_is_timed_alone_on_a_new_cache(tiny):
    """The prefill arms (the grid's and the check's drift probes) time a real prefill, keyed as asked: positive
    seconds, and a second call works, on a cache of its own (a prefill into a filled cache is refused)."""
    cells = [("eager", "prefill", 5, 32, 0), ("eager", "prefill", 9, 32, 0)]
    runs = experiment.prefill_arms(tiny, cells, torch.Generator().manual_seed(0))
    assert list(runs) == cells and all(run() > 0 and run() > 0 for run in runs.values())  # twice: a new cache each


@pytest.mark.parametrize("argv, message", [
    (["--mode", "compiled"], "--mode compiled: --cost"),
    (["--prompts", "1"], "--prompts must be >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--draft-loops", "32"], "--draft-loops must be in [1, 31]"),
    (["--methods", "beam"], "argument --methods: invalid choice: 'beam'"),
])
def test_the_check_refuses_bad_input_in_one_line_before_any_work(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("looped_kv.cli.load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("work started")))
    cost_file = tmp_path / "cost.json"
    fit_pass_cost(synthetic(modes=("eager",)), held_out=HELD_OUT).write(cost_file)
    try:
        status = main(["pass-cost-check", "--cost", str(cost_file), "--out", str(tmp_path / "check.json"), *argv])
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "check.json").exists()


def test_the_check_refuses_a_cost_that_cannot_price_a_decoders_passes_before_any_work(tmp_path, monkeypatch, capsys):
    """A compiled check of self-spec with a record timed before chains of drafts: refused in one line, naming the
    record, the decoder and the missing cells, before the model loads."""
    monkeypatch.setattr("looped_kv.cli.load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("work started")))
    unchained = [t for t in synthetic() if t.kind != "drafts"]
    cost_file = tmp_path / "cost.json"
    fit_pass_cost(unchained, held_out=HELD_OUT).write(cost_file)
    status = main(["pass-cost-check", "--cost", str(cost_file), "--out", str(tmp_path / "check.json"), "--mode",
                   "compiled", "--methods", "pld", "self-spec"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert (f"--cost {cost_file} cannot price self-spec: compiled chains of drafts of 4 loops were not measured "
            f"(measured: none); re-run looped-kv pass-cost with --draft-chains and --loops 4") in err
    assert not (tmp_path / "check.json").exists()


def test_the_check_keeps_an_existing_file_and_refuses_a_missing_cost(tmp_path, capsys):
    out = tmp_path / "check.json"
    out.write_text("mine")
    cost_file = tmp_path / "cost.json"
    fit_pass_cost(synthetic(modes=("eager",)), held_out=HELD_OUT).write(cost_file)
    assert main(["pass-cost-check", "--cost", str(cost_file), "--out", str(out)]) == 2
    assert "exists and is left untouched" in capsys.readouterr().err and out.read_text() == "mine"
    assert main(["pass-cost-check", "--cost", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.json")]) == 2
    assert "--cost" in capsys.readouterr().err


def test_the_check_records_its_runs_with_the_machine(tiny, tmp_path, monkeypatch, capsys):
    cost = fit_pass_cost(synthetic(modes=("eager",)), held_out=HELD_OUT, meta={"date": "2026-12-04", "calls": 2})
    out = tmp_path / "check.json"
    runs = experiment.check(tiny, cost, ["chains"], 2, 6, {"pld": PromptLookup()}, out, "tiny",
                            "looped-kv pass-cost-check --out check.json", repeats=1, progress=False)
    header, read = experiment.read_check(out)
    assert header["command"] == "looped-kv pass-cost-check --out check.json" and header["environment"]["cpu"]
    assert header["pass_cost"]["date"] == "2026-12-04" and list(read) == ["chains"]
    pd.testing.assert_frame_equal(read["chains"], runs["chains"], check_dtype=False)
    printed = capsys.readouterr().out
    assert all(c in printed for c in ("measured / predicted", "at drift", "in passes / predicted", "outside passes",
                                      "first pass", "later passes"))
    assert "the pass-cost model of 2026-12-04, measured on a machine its record does not name" in printed
    record = json.loads(out.read_text())
    record["weights_sha256"] = "0" * 64
    out.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="measured on other weights"):
        experiment.read_check(out)


def test_the_check_says_whether_its_pass_cost_model_was_measured_on_this_machine():
    here = {"torch": "2.13.0+cpu", "cuda": None, "cpu": "Intel(R) Xeon(R) Processor", "threads": 1}
    assert experiment.where_measured(dict(here, cudnn=None), here) == "measured on this machine"
    other = experiment.where_measured(dict(here, cpu="Intel(R) Xeon(R) Processor @ 2.80GHz", threads=2), here)
    assert other == ("measured on another machine (cpu 'Intel(R) Xeon(R) Processor @ 2.80GHz' here 'Intel(R) Xeon(R) "
                     "Processor'; threads 2 here 1): its predictions are that machine's, and looped-kv pass-cost fits "
                     "this one's")
    assert experiment.where_measured(None, here) == "measured on a machine its record does not name"


def test_relative_cost_is_each_widths_pass_over_a_one_token_step():
    cost = fit_pass_cost(synthetic(), held_out=HELD_OUT)
    table = pass_cost.relative_cost(cost, [1, 32], 256)
    assert list(table.index) == sorted((*WIDTHS, *HELD_OUT)) and list(table.columns) == [1, 32]
    assert table.loc[1].tolist() == [1.0, 1.0]
    assert table.loc[8, 32] == pytest.approx(truth(8, 32, 256) / truth(1, 32, 256), rel=1e-9)


def test_against_greedy_pairs_each_method_with_greedy_on_its_prompt():
    runs = pd.DataFrame({"prompt": [0, 0, 1, 1], "method": ["ar", "pld", "ar", "pld"], "new_tokens": [8, 8, 4, 4],
                         "measured_s": [2.0, 1.0, 4.0, 1.0], "predicted_s": [1.0, 1.0, 2.0, 0.5]})
    table = pass_cost.against_greedy(runs)
    assert list(table.index) == ["ar", "pld"] and table.loc["ar", "measured speed-up"] == 1
    assert table.loc["pld", "measured / predicted"] == pytest.approx(2 / 1.5)
    assert (table.loc["pld", "lowest"], table.loc["pld", "highest"]) == (1.0, 2.0)
    assert table.loc["pld", "measured speed-up"] == pytest.approx((2 + 4) / 2)
    assert table.loc["pld", "predicted speed-up"] == pytest.approx((1 + 4) / 2)
    assert table.loc["pld", "measured / predicted speed-up"] == pytest.approx(3 / 2.5)
    assert "outside passes" not in table
    inside = pass_cost.against_greedy(runs.assign(in_passes_s=[1.5, 0.5, 3.0, 0.5]))
    assert inside.loc["pld", "in passes / predicted"] == pytest.approx(1 / 1.5)
    assert inside.loc["pld", "outside passes"] == pytest.approx(1 - 1 / 2)
    assert inside.loc["ar", "outside passes"] == pytest.approx(1 - 4.5 / 6)
    assert "measured / predicted at drift" not in table
    at_drift = pass_cost.against_greedy(runs.assign(predicted_at_drift_s=[2.0, 1.0, 3.0, 1.5]))
    assert at_drift.loc["ar", "measured / predicted at drift"] == pytest.approx(6 / 5)
    assert at_drift.loc["pld", "measured / predicted at drift"] == pytest.approx(2 / 2.5)
    assert "first pass / price" not in at_drift
    after = pass_cost.against_greedy(runs.assign(first_pass_s=[0.3, 0.2, 0.5, 0.2], first_pass_price_s=0.2,
                                                 later_passes_s=[1.0, 0.5, 2.0, 0.5],
                                                 later_passes_price_s=[1.0, 0.25, 2.0, 0.25]))
    assert after.loc["ar", "first pass / price"] == pytest.approx(0.8 / 0.4)
    assert after.loc["pld", "first pass / price"] == 1 and after.loc["pld", "later passes / price"] == 2
    with pytest.raises(ValueError, match="greedy decoding's"):
        pass_cost.against_greedy(runs[runs["method"] == "pld"])
    with pytest.raises(ValueError, match="missing \\['predicted_s'\\]"):
        pass_cost.against_greedy(runs.drop(columns="predicted_s"))


def test_the_recorded_pass_cost_and_its_checks_are_the_shipped_models():
    """Chapters 5 and 7 read book/data's pass-cost model and its two checks: all measured on the shipped weights by
    the committed commands, the model in both modes with its step, each check in its mode on every decoder and every
    chapter workload, against this model."""
    cost = experiment.read_cost()
    assert cost.meta["command"].startswith("looped-kv pass-cost --out book/data/pass-cost-tiny.json")
    assert cost.meta["environment"]["threads"] == 1 and cost.meta["calls"] > 1  # timed as a decode runs its passes
    assert set(cost.coefficients) == set(cost.verifications) == {"eager", "compiled"}
    for mode, path in experiment.CHECK_RECORDS.items():
        header, runs = experiment.read_check(path)
        words = shlex.split(header["command"])  # read by the command's own parser: its options in any order
        assert words[:2] == ["looped-kv", "pass-cost-check"], mode
        args = parser().parse_args(words[1:])
        assert args.cost == Path("book/data/pass-cost-tiny.json") and args.out == Path("book/data") / path.name, mode
        assert args.mode == mode
        methods = bench.method_configs(args.draft_loops, args.gamma, methods=args.methods, fuse_rounds=True)
        experiment.check_prices(cost, methods, mode, 32)  # every pass the check's decoders run has its cells
        waves = pd.concat(runs.values()).query("method == 'das-wave'").filter(like="predicted_wave_s")
        assert (waves.iloc[:, 0] > 0).all() if mode == "compiled" else waves.empty, mode  # compiled: rounds fused
        assert header["pass_cost"]["date"] == cost.meta["date"] and set(runs) == {"problems", "code", "chains"}
        assert header["environment"] == cost.meta["environment"]
        for workload, r in runs.items():
            assert set(r["method"]) == {"ar", "self-spec", "mature-spec", "pld", "das-wave"}, workload
            assert (r["mode"] == mode).all() and r["prompt"].nunique() >= 8 and (r["measured_s"] > 0).all(), workload
            assert (r[["drift_pass", "drift_verify", "drift_prefill"]] > 0).all(axis=None), workload  # beside each
            assert ((r["in_passes_s"] > 0) & (r["in_passes_s"] < r["measured_s"])).all(), workload
