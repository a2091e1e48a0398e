"""The plan's time (looped_kv.analysis.plan_time): what it counts, how it prices, and the recorded prediction of every
chapter's CPU run at parcae-140m's dimensions against the measured run."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from looped_kv.analysis import plan_time
from looped_kv.analysis.plan_time import FUSED, Attention, BlockCost, Call, counting, predict, stand_in
from looped_kv.cli import main
from looped_kv.decoding.generate import generate
from looped_kv.experiments import plan_check
from looped_kv.experiments import plan_time as plan_time_run
from looped_kv.experiments.gpu_check import random_model
from looped_kv.runtime.model import Block, LoopedLM
from tests.test_plan import PROFILE, SCALED

ROOT = Path(__file__).parent.parent
WIDE = replace(SCALED, n_embd=128, intermediate_size=432)  # twice the stand-in's width


def test_counting_sees_every_block_and_head_call_of_a_forward_and_then_lets_go():
    model = random_model(SCALED, "cpu", torch.float32)
    ids = torch.randint(1, SCALED.vocab_size, (2, 5))
    run, readout = Block.run, LoopedLM.readout
    with torch.no_grad(), counting() as calls:
        model(ids, 3)
    assert (Block.run, LoopedLM.readout) == (run, readout)
    blocks = SCALED.n_prelude + 3 * SCALED.n_core + SCALED.n_coda
    # 2 sequences of 5 tokens at positions 0-4 (mean 2, so a query reads 3 keys on average), each attending to its own
    assert calls == Counter({Call("block", "float32", 10, 3, "causal", FUSED, 2): blocks,
                             Call("head", "float32", 10): 1})


def test_counting_tells_a_decode_cache_reads_and_their_context():
    model = random_model(SCALED, "cpu", torch.float32)
    R = SCALED.mean_recurrence
    with counting() as calls:
        generate(model, [torch.arange(1, 7)], max_new_tokens=3, stop_at_eos=False)
    per_pass = SCALED.n_prelude + R * SCALED.n_core + SCALED.n_coda
    # the prefill of 6 tokens (positions 0-5: its context is the mean position, rounded to even, plus 1), then steps at
    # positions 6 and 7: each reads the cache
    assert calls == Counter({Call("block", "float32", 6, 3, "cache", FUSED): per_pass,
                             Call("block", "float32", 1, 7, "cache", FUSED): per_pass,
                             Call("block", "float32", 1, 8, "cache", FUSED): per_pass,
                             Call("head", "float32", 6): 1, Call("head", "float32", 1): 2})


def test_the_stand_in_makes_a_chapters_calls_at_the_models_sizes():
    """Chapter 1's calls (losses by loop count and greedy samples: nothing that reads the weights' values) counted
    on a model twice the stand-in's width and on the stand-in are the same calls."""
    narrow = stand_in(WIDE)
    assert narrow.n_embd == 64 and (narrow.vocab_size, narrow.n_core, narrow.mean_recurrence, narrow.n_heads) == (
        WIDE.vocab_size, WIDE.n_core, WIDE.mean_recurrence, WIDE.n_heads)
    counted = []
    for config in (WIDE, narrow):
        with counting() as calls:
            plan_check.ch01(random_model(config, "cpu", torch.float32), PROFILE)
        counted.append(calls)
    assert counted[0] == counted[1] and len(counted[0]) > 3


COST = BlockCost(rows={"float32": (1, 2, 4)}, block={"float32": (1.0, 2.0, 4.0)}, head={"float32": (10.0, 20.0, 40.0)},
                 attention={"float32": {
                     "causal/fused": Attention((1,), (1,), (((0.0, 0.5),),), per_row=True),
                     # (alpha, s) at B = 1 and 3 sequences of g = 1 and 2 tokens
                     "cache/fused": Attention((1, 3), (1, 2),
                                              (((3.0, 0.25), (3.0, 0.25)), ((5.0, 0.75), (7.0, 1.25))))}})


def test_a_call_costs_its_rows_price_plus_its_attention():
    assert COST.seconds(Call("head", "float32", 3)) == 30.0  # interpolated between 2 and 4 rows
    assert COST.seconds(Call("block", "float32", 2, 5, "causal", FUSED, 2)) == 2.0 + 0.5 * 2 * 5
    # 2 sequences of 2 tokens reading 10 keys: (alpha, s) halfway between B = 1 and 3 at g = 2: (5, 0.75)
    assert COST.seconds(Call("block", "float32", 4, 10, "cache", FUSED, 2)) == 4.0 + 5.0 + 0.75 * 10
    # one sequence of 4 tokens, twice the widest priced: twice the attention of 2 tokens
    assert COST.seconds(Call("block", "float32", 4, 10, "cache", FUSED, 1)) == 4.0 + 2 * (3.0 + 0.25 * 10)
    work = Counter({Call("head", "float32", 1): 3, Call("block", "float32", 1, 2, "cache", FUSED): 2})
    assert predict(work, COST) == 3 * 10.0 + 2 * (1.0 + 3.0 + 0.25 * 1 * 2)
    assert plan_time.parts(work, COST) == {"head": 30.0, "cache blocks": 9.0}
    again = BlockCost.from_dict(json.loads(json.dumps(COST.to_dict())))
    assert again == COST
    assert plan_time.rows_to_calls(plan_time.calls_to_rows(work)) == work


@pytest.mark.parametrize(("call", "message"), [
    (Call("head", "float32", 8), "a head call on 8 rows is outside the priced 1..4 (float32)"),
    (Call("head", "bfloat16", 1), "head calls in bfloat16 were not priced; these prices hold ['float32']"),
    (Call("block", "float32", 1, 1, "causal", "float64"), "block calls in float32 with causal/float64 attention were "
                                                         "not priced"),
    (Call("block", "float32", 4, 1, "cache", FUSED, 4), "a float32 block call's (cache/fused) sequences 4 is outside "
                                                       "the priced 1..3"),
    (Call("block", "float32", 2, 1, "cache", FUSED, 4), "a float32 block call's (cache/fused) sequences 4 is outside "
                                                       "the priced 1..3")])
def test_a_call_the_prices_do_not_cover_is_refused(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        COST.seconds(call)


def test_plan_time_counts_prices_and_records_without_overwriting(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(
        json.loads((ROOT / "tests" / "fixtures" / "ouro-tiny" / "config.json").read_text())
        | {"max_position_embeddings": 1024}))
    out = tmp_path / "time.json"
    words = ["plan-time", "--model", str(tmp_path), "--profile", "smoke", "--chapters", "ch07", "ch02", "--out",
             str(out), "--quiet"]
    assert main(words) == 0
    header, cost, work = plan_time_run.read(out)
    assert header["command"] == " ".join(["looped-kv", *words]) and header["profile"] == "smoke"
    assert [row["chapter"] for row in header["chapters"]] == ["ch07", "ch02"]
    planned = plan_time_run.planned_seconds(*plan_time_run.read(out))
    for row in header["chapters"]:
        assert row["predicted seconds"] > row["rest seconds"] > 0
        assert row["predicted seconds"] == pytest.approx(planned[row["chapter"]], rel=1e-12)  # summed in another order
        assert planned[row["chapter"]] == predict(work[row["chapter"]], cost) + row["rest seconds"]
    assert {"float32", "bfloat16", "float64"} == set(cost.rows)  # chapter 2 replays in each
    assert "ch07" in capsys.readouterr().out
    before = out.read_text()
    assert main(words) == 2
    assert "exists and is left untouched" in capsys.readouterr().err and out.read_text() == before
    assert main([*words, "--chapters", "ch09"]) == 2
    assert "--chapters must be among" in capsys.readouterr().err


def test_the_plan_predicts_each_chapters_recorded_cpu_minutes_within_a_quarter():
    """book/data's plan time (this machine's prices at parcae-140m's dimensions, every chapter's calls counted on the
    stand-in) against the recorded CPU run of the same calls: each chapter within 25%, on the same CPU and threads."""
    header, cost, work = plan_time_run.read(ROOT / "book" / "data" / "plan-time-parcae-140m-cpu.json")
    measured = json.loads((ROOT / "book" / "data" / "plan-check-parcae-140m-cpu.json").read_text())
    assert "--model parcae-140m --out book/data/plan-time-parcae-140m-cpu.json" in plan_time_run.__doc__
    assert header["command"] == "looped-kv plan-time --model parcae-140m --out book/data/plan-time-parcae-140m-cpu.json"
    assert (header["model"], header["profile"]) == (measured["model"], measured["profile"])
    same = ("cpu", "threads", "torch")
    assert {k: header["environment"][k] for k in same} == {k: measured["environment"][k] for k in same}
    assert set(work) == {row["chapter"] for row in measured["chapters"]} == set(plan_check.RUNS)
    planned = plan_time_run.planned_seconds(header, cost, work)
    for row in measured["chapters"]:
        predicted = planned[row["chapter"]]
        assert 0.75 <= predicted / row["seconds"] <= 1.25, (row["chapter"], predicted, row["seconds"])


def test_each_sequence_count_is_priced_at_the_contexts_of_the_calls_it_prices():
    """A fit at B sequences prices the calls between its neighbours, so it is timed at their longest context: 96
    sequences of 50 keys are not timed at the 1,600 keys of 4 sequences' calls."""
    calls = [Call("block", "float32", 4, 1600, "cache", FUSED, 4), Call("block", "float32", 96, 50, "cache", FUSED, 96),
             Call("block", "float32", 1, 700, "cache", FUSED, 1)]
    assert plan_time._longest(calls, (1, 4, 12, 96)) == (700, 1600, 4 * plan_time.SHORT_CONTEXT, 50)
