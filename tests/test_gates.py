"""The shipped tiny model's depth gates (issue 24: loops that it must use).

The figures are measured by ``looped-kv gates`` on the depth workload's evaluation split and
recorded in ``looped_kv/tiny/config.json``. One test reads the record; a fast test recomputes the answer-token
figures and rho on the same programs.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from looped_kv.analysis.depth import answer_hits, encode_chains, fit_state_rho, state_changes
from looped_kv.runtime.loading import TINY_DIR, load
from looped_kv.tiny.gates import COMMAND, DEEPEST, GATES, LOOPS, Gate, answer_figures, depth_story, verdicts
from looped_kv.workloads import data


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((TINY_DIR / "config.json").read_text())["gates"]


def test_every_gate_is_recorded_with_its_verdict(record):
    figures = record["figures"]
    assert {g.figure for g in GATES} <= set(figures)
    assert record["passed"] == {row["gate"]: row["passes"] for row in verdicts(figures)}


def test_gate_rules():
    assert Gate("g", "x", "in", (0.75, 0.95)).passes(0.8) and not Gate("g", "x", "in", (0.75, 0.95)).passes(0.7)
    assert Gate("g", "x", ">=", 0.05).passes(0.05) and not Gate("g", "x", "<=", 0.01).passes(0.02)


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
    figures = answer_figures(hits) | {"rho (loops 4-16)": 0.9, "self-spec acceptance (d=4, gamma=4)": 0.55,
                                      "DAS-Wave A / ceiling": 0.95}
    record = {"command": COMMAND, "figures": figures,
              "passed": {row["gate"]: row["passes"] for row in verdicts(figures)}}
    story = depth_story(record)
    assert "answers 50% after 4, 50% after 16, 100% after 32, 100% after 64 loops" in story
    assert story.startswith("On 2 queries") and "(depth 25-32, 1 of them)" in story
    assert "falls by 1.05 nats" in story and "55% of its drafts" in story and "95% of its ceiling" in story
    assert story.count("not: ") == 1 and "DAS-Wave unsaturated" in story and "passes 6 of the 7" in story


def test_answer_and_rho_figures_recompute(record):
    """The recorded answer-token and rho figures come from the shipped weights (the same evaluation programs)."""
    torch.set_num_threads(2)
    model = load("tiny", dtype=torch.float32)
    chains = encode_chains(model.tokenizer, data.chain_programs(256, "eval"))
    figures = answer_figures(answer_hits(model, chains, LOOPS))
    recorded = record["figures"]
    for name in ("answer loss R=4 - answer loss R=32", "answer loss R=64 - answer loss R=32",
                 "accuracy R=32 - accuracy R=4", f"accuracy R=32 on depth {DEEPEST} / chance"):
        assert figures[name] == pytest.approx(recorded[name], abs=2e-4), name
    rho = fit_state_rho(state_changes(model, chains.ids, 16, chains.real)).rho
    assert rho == pytest.approx(recorded["rho (loops 4-16)"], abs=2e-3)
