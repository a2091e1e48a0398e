"""The shipped tiny model's depth gates (issue: a tiny model whose depth matters).

The figures are measured by ``python -m looped_kv.tiny.gates`` and recorded in ``looped_kv/tiny/config.json``.
One test reads the record; a fast test recomputes its loss and ripening figures on the same programs.
"""

from __future__ import annotations

import json

import pytest
import torch

from looped_kv.analysis.depth import encode_chains, fit_state_rho, loss_by_loops, state_changes
from looped_kv.runtime.loading import TINY_DIR, load
from looped_kv.tiny.gates import GATES, Gate, verdicts
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


def test_loss_and_rho_figures_recompute(record):
    """The recorded loss and rho figures come from the shipped weights (same 96 evaluation programs)."""
    torch.set_num_threads(2)
    model = load("tiny", dtype=torch.float32)
    chains = encode_chains(model.tokenizer, data.chain_programs(96, "eval"))
    loss = loss_by_loops(model, chains.ids, (4, 16, 32), chains.real)
    rho = fit_state_rho(state_changes(model, chains.ids, 16, chains.real)).rho
    figures = record["figures"]
    assert loss[4] - loss[32] == pytest.approx(figures["loss R=4 - loss R=32"], abs=2e-4)
    assert loss[32] - loss[16] == pytest.approx(figures["loss R=32 - loss R=16"], abs=2e-4)
    assert rho == pytest.approx(figures["rho (loops 4-16)"], abs=2e-3)
