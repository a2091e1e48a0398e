"""The analysis helpers of chapter 8 (looped_kv.analysis.adaptive_depth), exactly, in float64 on the tiny model:

* the exit rules measured on one teacher-forced pass pick, at a prompt's last position, the loop and the token that
  greedy decoding with early exit picks for its first new token, in any row chunks;
* a fixed exit reads out the model's own forward at that depth, and Delta is the planes' distance to plane R;
* the summaries, agreements, chain scores and loop shares are their definitions on hand-made inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import looped_kv
from looped_kv.analysis.adaptive_depth import (
    chain_continuations,
    continuation_agreement,
    decode_chains,
    exit_summary,
    loop_shares,
    teacher_forced_exits,
    time_exits,
)
from looped_kv.analysis.depth import encode_chains
from looped_kv.decoding.result import Generation
from looped_kv.runtime.attention import CausalRouter
from looped_kv.workloads import data

R = 12
RULES = {"kl": ("kl", None), "entropy": ("entropy", 1e-2), "latent": ("latent", 0.05), "argmax": ("argmax", 2),
         "cosine": ("cosine", 1e-3), "fixed 3": ("fixed", 3)}


@pytest.fixture(scope="module")
def tiny64():
    return looped_kv.load("tiny", dtype=torch.float64)


def prompts(model, texts=("a=3;b=a+4;c=b+1;\nc?", "def f(x):\n    return", "Tom has 3 apples and")):
    return [model.tokenizer(t, return_tensors="pt").input_ids[0] for t in texts]


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids


def test_a_prompts_last_position_exits_where_greedy_decoding_does(tiny64):
    rows = prompts(tiny64)
    ids, last = padded(rows), torch.tensor([len(r) - 1 for r in rows])
    reads = teacher_forced_exits(tiny64, ids, torch.arange(3), last, RULES, targets=torch.zeros(3, dtype=torch.long),
                                 num_loops=R)
    for name, (exit, threshold) in RULES.items():
        out = looped_kv.generate(tiny64, rows, max_new_tokens=1, num_loops=R, exit=exit, exit_threshold=threshold)
        got = reads.table[reads.table["rule"] == name]
        assert got["loop"].tolist() == [loops[0] for loops in out.row_loops], name
        assert got["top"].tolist() == [int(r[0]) for r in out.new_rows], name
    assert set(reads.table["loop"]) - {R} and reads.table["loop"].between(1, R).all()
    chunked = teacher_forced_exits(tiny64, ids, torch.arange(3), last, RULES,
                                   targets=torch.zeros(3, dtype=torch.long), num_loops=R, rows_per_chunk=2)
    pd.testing.assert_frame_equal(reads.table, chunked.table)


def test_a_fixed_exit_is_the_forward_at_that_depth_and_delta_the_distance_to_plane_r(tiny64):
    """Every next-token position of two texts; Delta from a cache-free forward's recorded keys and values."""
    ids = padded(prompts(tiny64)[:2])[:, :8]
    rows, columns = torch.arange(2).repeat_interleave(7), torch.arange(7).repeat(2)
    reads = teacher_forced_exits(tiny64, ids, rows, columns, {"fixed 5": ("fixed", 5), "full": ("fixed", R)},
                                 groups=["a"] * 7 + ["b"] * 7, num_loops=R, planes=True)
    with torch.no_grad():
        logits = tiny64(ids, num_loops=5)[rows, columns]
        full = tiny64(ids, num_loops=R)[rows, columns]
        record = {}
        tiny64(ids, num_loops=R, router=CausalRouter(record))
    five, deep = (reads.table[reads.table["rule"] == name] for name in ("fixed 5", "full"))
    targets = ids[rows, columns + 1]
    assert (five["loop"] == 5).all() and (deep["loop"] == R).all()
    assert five["top"].tolist() == logits.argmax(-1).tolist()
    assert np.allclose(five["nll"], F.cross_entropy(logits, targets, reduction="none").numpy())
    assert five["hit"].tolist() == (logits.argmax(-1) == targets).tolist()
    assert five["agree"].tolist() == (logits.argmax(-1) == full.argmax(-1)).tolist() and deep["agree"].all()
    assert (deep["delta k"] == 0).all() and (deep["delta v"] == 0).all()
    for kind, index in (("k", 0), ("v", 1)):
        site = {s.loop: kv[index] for s, kv in record.items() if s.stage == "core"}
        plane, last = (site[r][rows, :, columns].flatten(1) for r in (5, R))
        expected = ((plane - last).norm(dim=-1) / last.norm(dim=-1)).numpy()
        assert np.allclose(five[f"delta {kind}"], expected) and np.allclose(reads.delta[kind][4], expected)
    summary = exit_summary(reads.table, ("rule", "group"))
    assert summary.loc[("fixed 5", "a"), "mean loops"] == 5 and summary.loc[("full", "b"), "agreement"] == 1
    assert summary.loc[("fixed 5", "a"), "accuracy"] == five["hit"][:7].mean()


def test_exit_rules_are_checked_before_any_pass(tiny64):
    ids = torch.tensor([[3, 1, 4, 1]])
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="rules must name at least one exit rule"):
        teacher_forced_exits(tiny64, ids, one, one, {})
    with pytest.raises(ValueError, match="exit='gate' needs a model with an exit gate"):
        teacher_forced_exits(tiny64, ids, one, one, {"gate": ("gate", None)})
    with pytest.raises(ValueError, match="one entry per position"):
        teacher_forced_exits(tiny64, ids, torch.tensor([0, 0]), one, {"kl": ("kl", None)})
    with pytest.raises(ValueError, match="needs its target"):
        teacher_forced_exits(tiny64, ids, one, torch.tensor([3]), {"kl": ("kl", None)})


def test_exit_summary_is_the_mean_per_rule():
    table = pd.DataFrame({"rule": ["a", "a", "b", "b"], "group": ["x", "y", "x", "y"], "loop": [2, 4, 8, 8],
                          "hit": [True, False, True, True], "nll": [0.5, 1.5, 0.1, 0.3],
                          "agree": [True, False, True, True]})
    summary = exit_summary(table)
    assert summary.index.tolist() == ["a", "b"]
    assert summary.loc["a"].tolist() == [2, 3.0, 0.5, 1.0, 0.5] and summary.loc["b", "loss"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="lacks"):
        exit_summary(table.drop(columns="agree"))


def test_continuation_agreement_counts_the_matched_prefix_and_same_tokens():
    out = continuation_agreement([[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[1, 2, 0, 4], [5, 6, 7], [0, 8, 9]])
    assert out["matched"].tolist() == [2, 2, 0] and out["compared"].tolist() == [4, 2, 3]
    assert out["prefix"].tolist() == [0.5, 1.0, 0.0] and out["same"].tolist() == [0.75, 1.0, 2 / 3]
    assert math.isnan(continuation_agreement([[]], [[1]])["prefix"][0])
    with pytest.raises(ValueError, match="same rows"):
        continuation_agreement([[1]], [])


def test_loop_shares_sum_to_one():
    assert loop_shares([1, 3, 3, 4], 4).tolist() == [0.25, 0.0, 0.5, 0.25]
    for bad in ([], [0, 1], [5]):
        with pytest.raises(ValueError, match=r"exit loops in 1\.\.4"):
            loop_shares(bad, 4)


def test_chain_continuations_score_each_answer_with_its_loops(tiny64):
    tok = tiny64.tokenizer
    programs = data.chain_programs(2, "eval")
    right, wrong = programs[0], programs[1]
    q = right.queries[0]
    good = tok(right.cue(q) + right.answer(q) + "\n")["input_ids"]
    bad_answer = str((int(wrong.queries[0].value) + 1) % 10)
    bad = tok(wrong.cue(wrong.queries[0]) + bad_answer + ";\n")["input_ids"]
    sequences = [torch.tensor([9, 9, *good]), torch.tensor([9, *bad])]
    at = len(tok(right.cue(q))["input_ids"])
    loops = [[7 + i for i in range(len(good))], [3] * len(bad)]
    out = Generation(sequences, [2, 1], 0.0, row_loops=loops)
    table = chain_continuations(tok, programs, out, 12)
    assert table["hit"].tolist() == [True, False] and table["prompt loop"].tolist() == [7, 3]
    assert table["answer loop"].tolist() == [7 + at, 3] and table["depth"].tolist() == [q.depth, wrong.queries[0].depth]
    greedy = chain_continuations(tok, programs, Generation(sequences, [2, 1], 0.0), 12)
    assert greedy["prompt loop"].tolist() == [12, 12] and greedy["answer loop"].tolist() == [12, 12]
    gen, scored = decode_chains(tiny64, programs, num_loops=R, exit="fixed", exit_threshold=R)
    assert len(scored) == 2 and (scored["prompt loop"] == R).all() and gen.mean_loops == R
    teacher = encode_chains(tok, programs)
    reads = teacher_forced_exits(tiny64, teacher.ids, teacher.rows, teacher.positions, {"full": ("fixed", R)},
                                 targets=teacher.answers, num_loops=R)
    cue = [tok(p.prompt + p.cue(p.queries[0]), return_tensors="pt").input_ids[0] for p in programs]
    first = looped_kv.generate(tiny64, cue, max_new_tokens=1, num_loops=R)
    assert reads.table["top"].tolist() == [int(r[0]) for r in first.new_rows]


def test_time_exits_pairs_each_rule_with_greedy(tiny64):
    rows = prompts(tiny64)[:1]
    table = time_exits(tiny64, rows, {"fixed 4": {"exit": "fixed", "exit_threshold": 4, "num_loops": R}}, 3)
    assert table["rule"].tolist() == ["greedy", "fixed 4"] and table["tokens"].tolist() == [3, 3]
    greedy = table.iloc[0]
    assert greedy["speed-up"] == 1 and greedy["prefix"] == 1 and greedy["mean loops"] == tiny64.config.mean_recurrence
    assert table.iloc[1]["mean loops"] == 4 and (table["time_s"] > 0).all()
    with pytest.raises(ValueError, match="time_exits needs"):
        time_exits(tiny64, rows, {"greedy": {}}, 3)
