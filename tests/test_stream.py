"""Streaming (looped_kv.stream, looped-kv generate): each row's tokens as the decode loop commits them."""

from __future__ import annotations

import pytest
import torch

import looped_kv
from looped_kv.cli import TextPrinter


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return looped_kv.load("tiny", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tiny):
    texts = ["def f(x):\n    return", "Question: Ava has 3 apples. She buys 2 more."]
    return [tiny.tokenizer(t, return_tensors="pt").input_ids[0] for t in texts]


@pytest.mark.parametrize("method, options", [("ar", {}), ("mature-spec", {}), ("das-wave", {}),
                                             ("self-spec", {"temperature": 0.8, "seed": [1, 2]})])
def test_the_chunks_join_to_what_generate_emits(tiny, prompts, method, options):
    chunks = list(looped_kv.stream(tiny, prompts, max_new_tokens=12, method=method, **options))
    out = looped_kv.generate(tiny, prompts, max_new_tokens=12, method=method, **options)
    for row, new in enumerate(out.new_rows):
        assert torch.equal(torch.cat([c[row] for c in chunks if row in c]), new), (method, row)
    longest = max(len(t) for c in chunks for t in c.values())
    assert longest == 1 if method == "ar" else longest > 1  # a verification hands over its accepted drafts at once
    steps = max(len(n) for n in out.new_rows) if method == "ar" else max(len(a) for a in out.row_accepted) + 1
    assert len(chunks) == steps  # the prefill's token, then one commit per step or verification


def test_errors_reach_the_consumer_and_the_observer_is_streams(tiny, prompts):
    with pytest.raises(ValueError, match="method must be one of"):
        list(looped_kv.stream(tiny, prompts, method="greedy"))
    with pytest.raises(ValueError, match="observer is stream's own"):
        next(looped_kv.stream(tiny, prompts, observer=None))


def test_the_cli_prints_whole_characters_as_they_come(tiny, capsys):
    printer = TextPrinter(tiny.tokenizer)
    ids = tiny.tokenizer("Ava has 3 apples. é").input_ids
    printed = []
    for token in ids:
        printer.emitted({0: torch.tensor([token])})
        printed.append(capsys.readouterr().out)
    assert "".join(printed) == printer.shown == tiny.tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in printed) and sum(bool(p) for p in printed) > 1
