"""The shipped tiny model's depth gates (issues 24 and 39: loops that it must use, on the decoding workload).

The figures are measured by ``looped-kv gates`` on the decoding workload's evaluation split and recorded in
``looped_kv/tiny/config.json``. One test reads the record; a fast test recomputes the answer-token figures and
RIPE's rho on the same programs and texts.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from looped_kv.analysis.depth import answer_hits, encode_chains
from looped_kv.analysis.planes import ripening_curves, ripening_rates, workload_batch
from looped_kv.profiles import TINY
from looped_kv.runtime.loading import TINY_DIR, load
from looped_kv.tiny.gates import (
    COMMAND,
    DEEPEST,
    GATES,
    LOOPS,
    Gate,
    answer_figures,
    continuation_figures,
    depth_story,
    tau_gain,
    verdicts,
)
from looped_kv.workloads import data


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((TINY_DIR / "config.json").read_text())["gates"]


def test_every_gate_is_recorded_with_its_verdict(record):
    figures = record["figures"]
    assert {f for g in GATES for f in g.figures} <= set(figures)
    assert record["passed"] == {row["gate"]: row["passes"] for row in verdicts(figures)}


def test_gate_rules():
    assert Gate("g", ("x",), "in", (0.75, 0.95)).passes(0.8) and not Gate("g", ("x",), "in", (0.75, 0.95)).passes(0.7)
    assert Gate("g", ("x",), ">=", 0.05).passes(0.05) and not Gate("g", ("x",), "<=", 0.01).passes(0.02)
    both = Gate("g", ("k", "v"), "in", (0.75, 0.95))
    assert both.passed({"k": 0.8, "v": 0.9}) and not both.passed({"k": 0.8, "v": 0.97})
    assert both.measured({"k": 0.8123, "v": 0.9}) == "0.812, 0.9"


def test_the_gates_are_issue_39s():
    """RIPE's rho for keys and values, the draft gates and the decoding gates on the decoding workload; the retired
    "DAS-Wave unsaturated" gate is gone."""
    names = [g.name for g in GATES]
    assert "DAS-Wave unsaturated" not in names and len(names) == len(set(names)) == 10
    slow = {g.name: g for g in GATES}["slow ripening"]
    assert slow.figures == ("RIPE rho, keys", "RIPE rho, values") and slow.bound == (0.75, 0.95)


def test_continuation_figures_count_answers_in_place():
    programs = data.multichain_programs(3, "eval", max_depth=4)
    right = [p.answers + "\n" for p in programs]
    first_wrong = [p.answers[0] + str((int(p.answers[1]) + 1) % 10) + p.answers[2:] + "\n" for p in programs]
    tokens = [len(p.answers) + 2 for p in programs]  # one token a character here, end-of-text included
    f = continuation_figures(programs, {4: first_wrong, 32: right}, tokens)
    answers = sum(len(p.queries) for p in programs)
    assert f["greedy answers right, R=32"] == answers and f["greedy answers right, R=4"] == answers - 3
    assert f["answer share of decoded tokens"] == pytest.approx(answers / sum(tokens))
    assert f["greedy answers right, R=32 / R=4"] == pytest.approx(answers / (answers - 3))


def test_tau_gain_is_the_paired_mean_with_an_interval():
    shallow, deep = np.array([1.0, 2.0, np.nan, 2.0]), np.array([2.5, 3.0, 4.0, 4.0])
    gain, low, high = tau_gain(shallow, deep)
    assert gain == pytest.approx(np.mean([1.5, 1.0, 2.0])) and low <= gain <= high


def test_answer_figures_score_answer_tokens_by_loops():
    hits = pd.DataFrame({"loops": [4, 4, 32, 32, 64, 64], "bucket": [DEEPEST, "1-2"] * 3,
                         "hit": [0.0, 1.0, 1.0, 1.0, 1.0, 0.0], "nll": [2.0, 0.5, 0.1, 0.3, 0.2, 0.3]})
    f = answer_figures(hits)
    assert f["answer loss R=4 - answer loss R=32"] == pytest.approx(1.25 - 0.2)
    assert f["answer loss R=64 - answer loss R=32"] == pytest.approx(0.25 - 0.2)
    assert f["accuracy R=32 - accuracy R=4"] == pytest.approx(0.5)
    assert f[f"accuracy R=32 on depth {DEEPEST} / chance"] == pytest.approx(1 / data.CHAIN_CHANCE)


def test_depth_story_reads_the_record():
    """Chapter 1's opening figures come from the recorded gates, and a failed gate is named."""
    hits = pd.DataFrame({"loops": [R for R in LOOPS for _ in range(2)], "bucket": [DEEPEST, "1-2"] * len(LOOPS),
                         "hit": [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                         "nll": [2.0, 0.5, 1.0, 0.4, 0.1, 0.3, 0.1, 0.3]})
    figures = answer_figures(hits) | {
        "RIPE rho, keys": 0.9, "RIPE rho, values": 0.97, "self-spec tau / ceiling (d=4, gamma=4)": 0.55,
        "tau d=16 - tau d=2 (gamma=4)": 1.5, "answer share of decoded tokens": 0.4,
        "greedy answers right, R=4": 10, "greedy answers right, R=32": 30, "greedy answers right, R=32 / R=4": 3.0,
        "prefill share of compiled greedy": 0.2}
    record = {"command": COMMAND, "figures": figures,
              "passed": {row["gate"]: row["passes"] for row in verdicts(figures)}}
    story = depth_story(record)
    assert "answers 50% after 4, 50% after 16, 100% after 32, 100% after 64 loops" in story
    assert story.startswith("On 2 queries") and "(depth 25-32, 1 of them)" in story
    assert "falls by 1.05 nats" in story and "55% of its ceiling" in story and "+1.50 tokens" in story
    assert "30 answers right against 10" in story
    assert story.count("not: ") == 1 and "slow ripening" in story and "passes 9 of the 10" in story


def test_answer_and_rho_figures_recompute(record):
    """The recorded answer-token figures and RIPE's rho come from the shipped weights (the same evaluation programs,
    chapter 2's texts)."""
    torch.set_num_threads(2)
    model = load("tiny", dtype=torch.float32)
    chains = encode_chains(model.tokenizer, data.multichain_programs(512, "eval"))
    figures = answer_figures(answer_hits(model, chains, LOOPS))
    recorded = record["figures"]
    for name in ("answer loss R=4 - answer loss R=32", "answer loss R=64 - answer loss R=32",
                 "accuracy R=32 - accuracy R=4", f"accuracy R=32 on depth {DEEPEST} / chance"):
        assert figures[name] == pytest.approx(recorded[name], abs=2e-4), name
    ch02 = TINY.ch02
    ids, _ = workload_batch(model, data.WORKLOADS, ch02.texts_per_workload, ch02.length)
    curves = ripening_curves(model, ids, model.config.mean_recurrence, decoded=ch02.decoded, maturity_kinds=())
    for name, fit in zip(("keys", "values"), ripening_rates(curves).values(), strict=True):
        assert fit.rho == pytest.approx(recorded[f"RIPE rho, {name}"], abs=2e-3), name
