"""The generation entry point and its input checks."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from conftest import FIXTURES, random_model

import looped_kv
from looped_kv.decoding.settings import METHODS, default_draft_loops


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=3, block_size=40)


def test_generate_reports_statistics(model):
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    out = looped_kv.generate(model, ids, max_new_tokens=6, cache="deepest", num_loops=3)
    assert out.num_new == 6 and out.tokens.shape == (1, 11)
    stats = out.stats()
    assert stats["tokens_per_s"] > 0 and stats["wall_time_s"] > 0
    assert torch.equal(out.tokens[:, :5], ids)


def test_generate_full_and_deepest_agree_with_their_policies(model):
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    full = looped_kv.generate(model, ids, max_new_tokens=6, cache="full", num_loops=3)
    reference = model(full.tokens[:, :-1], num_loops=3)[:, 4:].argmax(-1)
    assert torch.equal(reference, full.new_tokens)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "beam"}, "method must be one of"),
    ({"cache": "lru"}, "cache must be one of"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"max_new_tokens": 36}, "exceeds the model's context"),
])
def test_bad_arguments_fail_before_work(model, kwargs, message):
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with pytest.raises(ValueError, match=message):
        looped_kv.generate(model, ids, **{"max_new_tokens": 4, **kwargs})


def test_prompt_longer_than_context(model):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        looped_kv.generate(model, torch.zeros(1, 41, dtype=torch.long), max_new_tokens=1)


def test_check_greedy_tokens_allows_only_near_ties_in_low_precision():
    from looped_kv.book import check_greedy_tokens

    logits = torch.tensor([[10.0, 9.0, 0.0], [4.0, 4.03, 0.0]])
    assert check_greedy_tokens(logits, torch.tensor([0, 1])) == 0
    with pytest.raises(AssertionError, match="not the argmax"):
        check_greedy_tokens(logits, torch.tensor([0, 0]))  # float32: exact
    tie = logits.to(torch.bfloat16)  # 4.0 and 4.03 are one bf16 ulp (0.03125) apart
    assert check_greedy_tokens(tie, torch.tensor([0, 0])) == 1
    with pytest.raises(AssertionError, match="below the argmax"):
        check_greedy_tokens(tie, torch.tensor([1, 0]))  # 10 against 9: no near-tie
    with pytest.raises(ValueError, match="must match tokens"):
        check_greedy_tokens(logits, torch.tensor([0]))


@pytest.mark.parametrize("method, options", [
    ("ar", {}), ("self-spec", {"draft_loops": 1, "gamma": 3}), ("mature-spec", {"draft_loops": 2, "gamma": 2}),
    ("pld", {"ngram": 1}), ("das-wave", {"max_width": 4, "rounds": 3})])
def test_rows_per_chunk_decodes_the_same_rows(model, method, options):
    """A batch decoded in row chunks (float64): the same tokens, statistics and cache bytes per row."""
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in (4, 7, 5, 9, 3)]
    run = dict(max_new_tokens=[5, 6, 4, 7, 6], method=method, num_loops=3, stop_at_eos=False, **options)
    whole = looped_kv.generate(model, prompts, **run)
    parts = looped_kv.generate(model, prompts, rows_per_chunk=2, **run)
    assert all(torch.equal(a, b) for a, b in zip(whole.sequences, parts.sequences, strict=True))
    assert (parts.row_accepted, parts.stopped, parts.prompt_lengths) == (whole.row_accepted, whole.stopped,
                                                                        whole.prompt_lengths)
    assert parts.row_cache_bytes == whole.row_cache_bytes
    assert parts.allocated_bytes < whole.allocated_bytes  # one chunk's cache at a time
    with pytest.raises(ValueError, match="rows_per_chunk must be None or an int >= 1"):
        looped_kv.generate(model, prompts, rows_per_chunk=0, **run)


def test_the_default_draft_depth_follows_r():
    """The papers' d = 4 at R = 32, scaled to R and at least 1."""
    assert [default_draft_loops(R) for R in (1, 2, 4, 6, 8, 16, 32, 64)] == [1, 1, 1, 1, 1, 2, 4, 8]


@pytest.fixture(scope="module", params=["ouro-tiny", "huginn, R = 32"])
def any_model(request):
    if request.param == "ouro-tiny":
        return looped_kv.load(FIXTURES / "ouro-tiny", dtype=torch.float64)
    return random_model("huginn", seed=5, mean_recurrence=32)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_with_its_defaults(any_model, method):
    """generate(model, ids, method=m) with m's defaults on Ouro's fixture (R = 4) and a Huginn-style model (R = 32):
    every method emits greedy decoding's tokens, and the draft depth follows R. ``max_new_tokens`` keeps the
    fixture's 64-position context in reach of DAS-Wave's max_width of 32."""
    ids = torch.tensor([[1, 5, 9, 2]])
    out = looped_kv.generate(any_model, ids, method=method, max_new_tokens=8)
    assert torch.equal(out.tokens, looped_kv.generate(any_model, ids, max_new_tokens=8).tokens), method
    if method in ("self-spec", "mature-spec"):
        assert out.options["draft_loops"] == {4: 1, 32: 4}[any_model.config.mean_recurrence]


def test_chapter_model_measures_without_cudnn_attention_on_a_gpu(monkeypatch):
    """On CUDA a chapter's model comes with cuDNN's SDPA backend off (RIPE Sec. 5.5); on a CPU threads are set."""
    from looped_kv import book

    calls, loads = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Namespace(name="A100", total_memory=42e9))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    monkeypatch.setattr(book, "load", lambda source, dtype, device: loads.append((source, dtype, device)))
    for name in ("LOOPED_KV_DTYPE", "LOOPED_KV_MODEL", "LOOPED_KV_THREADS"):
        monkeypatch.delenv(name, raising=False)
    book.chapter_model()
    assert calls == [False] and loads == [("tiny", torch.bfloat16, "cuda")]
    monkeypatch.setenv("LOOPED_KV_MODEL", "ouro-1.4b")  # a published model's name: its hub id
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 5))  # a T4: no native bfloat16
    book.chapter_model()
    assert loads[-1] == ("ByteDance/Ouro-1.4B", torch.float16, "cuda")
    monkeypatch.delenv("LOOPED_KV_MODEL")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    book.chapter_model()
    assert calls == [False, False] and loads[-1] == ("tiny", torch.float32, "cpu")
