"""Bad inputs to decoding get a one-line ValueError naming the parameter, before any model pass (issue 28, item 5).

The cases, each a test below (every one failed on the landed code, ff195e7: a raw TypeError or AttributeError from
deep inside, or no error at all):

* prompts that are not integer tensors: a str, a list of ints;
* integer options that are not ints: max_new_tokens=3.5 (and True), num_loops=2.5, window=2.5, draft_loops=2.5,
  gamma=2.5, ngram=2.5, rounds=2.5, updates=2.5, initial_width=2.5, eos_token_id=3.5;
* flags that are not bools: stop_at_eos="no", compile="yes", exact="no", carry="no";
* options the chosen method does not use: prefix_reads, gamma=-5 and draft_loops=-5 with method "ar", ngram with
  self-spec, rounds with mature-spec;
* sizes beyond the model's context: sinks=5000 and window=5000 with a 128-token context.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

from looped_kv import generate


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=1, block_size=128)


@pytest.fixture
def no_work(model, monkeypatch):
    """The model refuses to run: an input check that comes after any model pass fails the test."""
    def forward(*args, **kwargs):
        raise AssertionError("a model pass ran before the bad input was refused")

    monkeypatch.setattr(model, "forward", forward)
    return model


IDS = torch.tensor([[3, 1, 4, 1]])


def refused(model, message: str, ids=IDS, **options) -> None:
    with pytest.raises(ValueError, match=message) as error:
        generate(model, ids, **{"max_new_tokens": 4, **options})
    assert "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("ids, kind", [("Question: 2 + 2 =", "str"), ([3, 1, 4], "int")])
def test_prompts_must_be_integer_tensors(no_work, ids, kind):
    refused(no_work, rf"input_ids must be \(batch, length\), \(length,\) or a list of prompts.*got.*{kind}", ids)


@pytest.mark.parametrize("name, value, method", [
    ("max_new_tokens", 3.5, "ar"), ("max_new_tokens", True, "ar"), ("num_loops", 2.5, "ar"),
    ("draft_loops", 2.5, "self-spec"), ("gamma", 2.5, "self-spec"), ("ngram", 2.5, "pld"),
    ("rounds", 2.5, "das-wave"), ("updates", 2.5, "das-wave"), ("initial_width", 2.5, "das-wave"),
    ("eos_token_id", 3.5, "ar")])
def test_integer_options_must_be_ints(no_work, name, value, method):
    refused(no_work, rf"^{name} must be an int", method=method, **{name: value})


def test_a_window_must_be_an_int(no_work):
    refused(no_work, r"^window must be an int", cache="ripe", window=2.5)


@pytest.mark.parametrize("name, value, method", [
    ("stop_at_eos", "no", "ar"), ("compile", "yes", "pld"), ("exact", "no", "self-spec"), ("carry", "no", "das-wave")])
def test_flags_must_be_bools(no_work, name, value, method):
    refused(no_work, rf"^{name} must be True or False, got '{value}'", method=method, **{name: value})


@pytest.mark.parametrize("name, value, method, users", [
    ("prefix_reads", "deep-v", "ar", "self-spec"), ("gamma", -5, "ar", "self-spec"),
    ("draft_loops", -5, "ar", "self-spec"), ("ngram", 2, "self-spec", "pld"), ("rounds", 3, "mature-spec", "das-wave")])
def test_options_the_method_does_not_use_are_refused(no_work, name, value, method, users):
    refused(no_work, rf"^{name}={value!r} is not used by method='{method}'; only method in \(.*'{users}'",
            method=method, **{name: value})


@pytest.mark.parametrize("cache, params", [("sinks", {"sinks": 5000}), ("ripe", {"window": 5000})])
def test_sizes_beyond_the_context_are_refused(no_work, cache, params):
    (name, value), = params.items()
    refused(no_work, rf"^{name} must be at most the model's context \(block_size 128\), got {value}", cache=cache,
            **params)
