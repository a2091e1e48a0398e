"""Does a looped model use its depth (looped_kv.analysis.depth): loss per text, answers per query."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from looped_kv import load
from looped_kv.analysis.depth import (
    DEPTH_BUCKETS,
    answer_accuracy,
    answer_hits,
    answer_loss_by_program,
    depth_bucket,
    depth_stops_paying,
    encode_chains,
    encode_texts,
    loss_by_loops,
    loss_by_text,
    read_by_loops,
)
from looped_kv.workloads import data

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def tiny():
    return load("tiny", dtype=torch.float32)


def test_encode_texts_pads_and_marks_real_tokens(tiny):
    texts = ["a = 1\n", "def f(x):\n    return x\n"]
    ids, real = encode_texts(tiny.tokenizer, texts)
    lengths = [len(tiny.tokenizer(t)["input_ids"]) for t in texts]
    assert ids.shape == (2, max(lengths)) and real.sum(1).tolist() == lengths
    assert ids[0, :lengths[0]].tolist() == tiny.tokenizer(texts[0])["input_ids"]
    with pytest.raises(ValueError, match="at least one text"):
        encode_texts(tiny.tokenizer, [])


def test_loss_by_text_is_each_texts_mean_loss(tiny):
    texts = data.texts("code", 3, split="eval", chars=200)
    ids, real = encode_texts(tiny.tokenizer, texts)
    table = loss_by_text(tiny, ids, [1, 4], real)
    assert table.shape == (3, 2) and list(table.columns) == [1, 4]
    pd.testing.assert_frame_equal(loss_by_text(tiny, ids, [1, 4], real, rows_per_chunk=2), table, rtol=1e-6)
    for i, text in enumerate(texts):  # each text alone, without padding
        alone = torch.tensor([tiny.tokenizer(text)["input_ids"]])
        logits = tiny(alone[:, :-1], num_loops=4)[0].float()
        assert table.loc[i, 4] == pytest.approx(F.cross_entropy(logits, alone[0, 1:]).item(), rel=1e-4)
    same = ids[:, :20]  # texts of equal length: the mean of the per-text means is the token mean
    assert loss_by_text(tiny, same, [2]).mean()[2] == pytest.approx(loss_by_loops(tiny, same, [2])[2], rel=1e-5)
    with pytest.raises(ValueError, match="loops must be"):
        loss_by_text(tiny, ids, [0], real)
    with pytest.raises(ValueError, match="two real tokens"):
        loss_by_text(tiny, ids, [1], torch.zeros_like(real))


@pytest.mark.parametrize("fixture", ["tiny", "huginn-tiny", "ouro-tiny", "parcae-tiny"])
def test_one_deep_forward_reads_out_every_r_as_its_own_forward_bit_for_bit(tiny, fixture: str) -> None:
    """read_by_loops runs the deepest R once and reads out the others on the way: each R's logits are those of an
    R-loop forward, to the last bit, in every family's readout (Huginn's coda, Ouro's head on the normed state,
    Parcae's C and value embeddings)."""
    model = tiny if fixture == "tiny" else load(FIXTURES / fixture, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    read = read_by_loops(model, ids, [3, 1, 5], lambda logits: logits)
    assert list(read) == [3, 1, 5]
    for R, logits in read.items():
        assert torch.equal(logits, model(ids, num_loops=R)), R
    with pytest.raises(ValueError, match="distinct"):
        loss_by_loops(model, ids, [2, 2])


def test_chain_loss_is_taken_on_answers_alone(tiny):
    """Chapter 1 averaged the chain loss over every token of a program, random names and digits included (9-10 nats,
    worse than a uniform guess over 1,024 tokens); what depth buys on chains is the answers' loss."""
    programs = data.chain_programs(5, split="eval")
    hits = answer_hits(tiny, encode_chains(tiny.tokenizer, programs), [1, 4])
    table = answer_loss_by_program(hits)
    assert table.shape == (5, 2) and list(table.columns) == [1, 4]
    for i, program in enumerate(programs):
        alone = encode_chains(tiny.tokenizer, [program])
        logits = tiny(alone.ids, num_loops=4)[alone.rows, alone.positions].float()
        assert table.loc[i, 4] == pytest.approx(F.cross_entropy(logits, alone.answers).item(), rel=1e-4)
    assert table.to_numpy().max() < np.log(tiny.config.vocab_size)  # answers, not the random program
    with pytest.raises(ValueError, match="answer_hits"):
        answer_loss_by_program(hits.drop(columns="nll"))


def test_answer_hits_and_accuracy(tiny):
    batch = encode_chains(tiny.tokenizer, data.chain_programs(6, split="eval"))
    hits = answer_hits(tiny, batch, [1, 4])
    assert len(hits) == 2 * len(batch.answers)
    assert set(hits["bucket"]) <= set(DEPTH_BUCKETS) and hits["hit"].isin([0.0, 1.0]).all()
    logits = tiny(batch.ids, num_loops=4)[batch.rows, batch.positions].float()
    four = hits[hits["loops"] == 4]
    assert np.array_equal(four["hit"].to_numpy(), (logits.argmax(-1) == batch.answers).numpy().astype(float))
    assert np.array_equal(four["program"].to_numpy(), batch.rows.numpy())
    table = answer_accuracy(tiny, batch, [1, 4])
    assert list(table.columns) == ["accuracy", "answer loss", *(f"depth {b}" for b in DEPTH_BUCKETS)]
    assert table.loc[4, "accuracy"] == pytest.approx(four["hit"].mean())
    assert table.loc[4, "answer loss"] == pytest.approx(four["nll"].mean(), rel=1e-6)
    for name in DEPTH_BUCKETS:
        chosen = four[four["bucket"] == name]["hit"]
        expected = chosen.mean() if len(chosen) else np.nan
        assert table.loc[4, f"depth {name}"] == pytest.approx(expected, nan_ok=True)
    assert isinstance(table, pd.DataFrame) and table.index.name == "loops"


def test_depth_bucket():
    depths = (1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 24, 25, 32)
    assert [depth_bucket(d) for d in depths] == [
        "1-2", "1-2", "3-4", "3-4", "5-8", "5-8", "9-12", "9-12", "13-16", "13-16", "17-24", "17-24", "25-32", "25-32"]
    for bad in (0, 33):
        with pytest.raises(ValueError, match=r"depth must be in 1\.\.32"):
            depth_bucket(bad)


def test_depth_stops_paying_where_no_deeper_count_gains_the_gate():
    """Chapter 1 states where depth stops paying: the first count no deeper count improves on by the gate's gain."""
    curve = pd.Series({1: 3.0, 2: 2.5, 4: 2.3, 8: 2.27, 16: 2.26, 32: 2.29})
    assert depth_stops_paying(curve, 0.05) == 4  # from 4 loops the best deeper count gains 2.3 - 2.26 = 0.04
    assert depth_stops_paying(curve, 0.02) == 8 and depth_stops_paying(curve, 0.005) == 16
    assert depth_stops_paying(curve.iloc[::-1], 0.05) == 4  # the order of the index does not matter
    rising = pd.Series({1: 2.0, 4: 2.1, 16: 2.2})  # the loss rises with depth: one loop is as good as it gets
    assert depth_stops_paying(rising, 0.05) == 1
    assert depth_stops_paying(pd.Series({1: 3.0, 4: 2.0, 16: 1.0}), 0.05) == 16  # every count still pays
    with pytest.raises(ValueError, match="gain must be"):
        depth_stops_paying(curve, 0.0)
    with pytest.raises(ValueError, match="curve must hold finite"):
        depth_stops_paying(pd.Series({1: float("nan")}), 0.05)


def test_the_depth_settings_are_the_papers_at_r_32_and_scaled_below():
    """At R = 32 the chapters' depth settings are the papers' printed ones; at Parcae's R = 8 and Ouro's R = 4 each
    is the scaled one the chapters use, and what a range spans is counted."""
    from looped_kv.analysis.shallow import depth_settings, depth_table
    from looped_kv.profiles import PROFILES

    paper = depth_settings(32, PROFILES["tiny"]).set_index("setting")
    assert paper.loc["loops of the ripening fit c rho^r (RIPE Table 7)", "loops"] == "8-31"
    assert paper.loc["deep loops of Delta_r (RIPE Table 7, Eq. 6)", "loops"] == "25-31"
    assert paper.loc["shallow region (RIPE Sec. 3.1: loops 2-9)", "loops"] == "2-9"
    assert paper.loc["deep region (RIPE Sec. 3.1: loops 25-32)", "loops"] == "25-32"
    assert paper.loc["substituted planes (RIPE Sec. 3.1)", "loops"] == "1, 4, 8, 16, 24, 32"
    assert paper.loc["DAS-Wave's refinement, J rounds x k updates (DAS Eq. 5)", "count"] == 48  # 1.5 R
    parcae = depth_settings(8, PROFILES["parcae-140m"]).set_index("setting")
    assert parcae.loc["loops of the ripening fit c rho^r (RIPE Table 7)", ["loops", "count"]].tolist() == ["2-7", 6]
    assert parcae.loc["deep loops of Delta_r (RIPE Table 7, Eq. 6)", "count"] == 2
    assert parcae.loc["DAS-Wave's refinement, J rounds x k updates (DAS Eq. 5)", "count"] == 12
    widest = "DAS-Wave's widest proposal w = W_init + J - 1 (DAS Eq. 5)"
    assert (paper.loc[widest, "count"], parcae.loc[widest, "count"]) == (25, 7)  # W_init 2 + J - 1
    assert parcae.loc["draft loops d of Mature-Spec", "loops"] == "2"
    ouro = depth_table("ch03")["Ouro, R = 4"]
    assert ouro["shallow region (RIPE Sec. 3.1: loops 2-9)"] == "1 (1)"
    assert list(depth_table().columns) == ["tiny, R = 32", "Parcae, R = 8", "Ouro, R = 4"]
    with pytest.raises(ValueError, match="num_loops must be >= 3"):
        depth_settings(2, PROFILES["tiny"])
    with pytest.raises(ValueError, match="chapter must be one of"):
        depth_table("ch09")
