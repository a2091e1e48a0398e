"""Batched decoding equals decoding each sequence alone (float64), under every cache policy, with ragged rows."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import random_model

from looped_kv import batched
from looped_kv.analysis.memory_bench import peak_bytes
from looped_kv.batched import (
    BatchedPlaneCache,
    RowsPass,
    accept_rows,
    batched_generate,
    batched_greedy,
    batched_speculative,
    main,
    prefill_rows,
    throughput_cells,
)
from looped_kv.decoding.greedy import greedy, new_cache, prefill, run_block
from looped_kv.decoding.speculative import self_speculative
from looped_kv.runtime.cache import BlockPass
from looped_kv.runtime.memory import policy_bytes
from looped_kv.runtime.policy import make_policy, make_prefix_reads

R = 5
POLICIES = [("full", {}), ("deepest", {}), ("ripe", {"window": 4}), ("ripe", {"window": 2, "sinks": 1}),
            ("k-deepest", {"k": 2}), ("share", {"k": 2}), ("first", {"k": 3}), ("sinks", {"sinks": 2}),
            ("sinks", {"sinks": 1, "window": 3})]
LENGTHS, BUDGETS = (3, 7, 1, 5), [7, 4, 8, 6]


@pytest.fixture(scope="module", params=["huginn", "raven"])
def model(request):
    return random_model(request.param, seed=3)


def ragged_prompts(model, lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize("cache, params", POLICIES)
def test_batched_greedy_is_per_sequence_greedy(model, cache, params):
    policy = make_policy(cache, R, **params)
    prompts = ragged_prompts(model)
    out = batched_greedy(model, prompts, BUDGETS, policy=policy)
    for prompt, budget, tokens, nbytes in zip(prompts, BUDGETS, out.tokens, out.cache_bytes, strict=True):
        alone = greedy(model, prompt[None], budget, policy=policy)
        assert torch.equal(tokens, alone.tokens[0])
        assert nbytes == policy_bytes(model.config, policy, len(prompt) + budget - 1, model.dtype)
    assert out.num_new == sum(BUDGETS)


# (cache, params, exact): block-independent policies (RIPE Proposition 1) and block-dependent ones (exact=False:
# k-deepest(k < R) and first(k < R) read plane(r) != r with no window, so exact=True is refused for them, like deepest).
SPECULATIVE = [("full", {}, True), ("ripe", {"window": 4}, True), ("ripe", {"window": 5, "sinks": 1}, True),
               ("sinks", {"sinks": 2, "window": 4}, True), ("deepest", {}, False), ("ripe", {"window": 2}, False),
               ("share", {"k": 2}, False), ("k-deepest", {"k": 2}, False), ("first", {"k": 3}, False)]


@pytest.mark.parametrize("cache, params, exact", SPECULATIVE)
def test_batched_draft_then_verify_is_per_sequence_self_speculation(model, cache, params, exact):
    policy = make_policy(cache, R, **params)
    prompts = ragged_prompts(model, seed=1)
    reads = make_prefix_reads("aligned", R)
    out = batched_speculative(model, prompts, BUDGETS, policy=policy, draft_loops=2, block=4, exact=exact)
    for i, (prompt, budget) in enumerate(zip(prompts, BUDGETS, strict=True)):
        alone = self_speculative(model, prompt[None], budget, policy=policy, draft_loops=2, block=4, reads=reads,
                                 exact=exact)
        assert torch.equal(out.tokens[i], alone.tokens[0])
        assert out.accepted[i] == alone.accepted
        committed = len(prompt) + sum(a + 1 for a in alone.accepted)
        assert out.cache_bytes[i] == policy_bytes(model.config, policy, committed, model.dtype)
        if exact:
            assert torch.equal(out.tokens[i], greedy(model, prompt[None], budget, policy=policy).tokens[0])


@pytest.mark.parametrize("cache, params, reads", [("full", {}, "deep-v"), ("full", {}, (2, 4)),
                                                  ("ripe", {"window": 4}, "deep-kv"),
                                                  ("ripe", {"window": 4}, "deep-k")])
def test_batched_prefix_reads_match_per_sequence(model, cache, params, reads):
    policy = make_policy(cache, R, **params)
    prompts = ragged_prompts(model, (2, 6, 4), seed=2)
    prefix_reads = make_prefix_reads(reads, R)
    out = batched_speculative(model, prompts, 6, policy=policy, draft_loops=3, block=3, reads=prefix_reads)
    for i, prompt in enumerate(prompts):
        alone = self_speculative(model, prompt[None], 6, policy=policy, draft_loops=3, block=3, reads=prefix_reads)
        assert torch.equal(out.tokens[i], alone.tokens[0])


@pytest.mark.parametrize("cache, params", [("full", {}), ("ripe", {"window": 3, "sinks": 1})])
def test_one_block_pass_matches_per_row_logits_and_bytes(cache, params):
    """Ragged prefill, then one 4-token block per row: logits equal those of each row alone (1e-12)."""
    model = random_model("raven", seed=5)
    policy = make_policy(cache, R, **params)
    prompts = ragged_prompts(model, (2, 9, 5), seed=3)
    batch = BatchedPlaneCache(model.config, policy, batch=3, capacity=16, dtype=model.dtype)
    prefill_rows(model, batch, prompts, R)
    block = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(4))
    positions = batch.lengths[:, None] + torch.arange(4)
    logits = model(block, R, positions=positions, router=RowsPass(batch, positions))
    batch.advance(torch.full((3,), 4))
    for i, prompt in enumerate(prompts):
        alone = new_cache(model, policy, 1, 16)
        prefill(model, alone, prompt[None], R)
        expected, _ = run_block(model, block[i:i + 1], BlockPass(alone, range(len(prompt), len(prompt) + 4)), R)
        assert torch.allclose(logits[i], expected[0], rtol=0, atol=1e-12)
        assert batch.row_bytes()[i] == policy_bytes(model.config, policy, len(prompt) + 4, model.dtype)
    assert batch.allocated_bytes == 3 * policy_bytes(model.config, policy, 16, model.dtype)


def test_ring_writes_keep_each_rows_last_window():
    """A block longer than the ring writes only each row's last W stored positions: one write per slot."""
    model = random_model("huginn")
    cache = BatchedPlaneCache(model.config, make_policy("ripe", R, window=3), batch=3, capacity=12, dtype=model.dtype)
    writes = cache.plan_writes(torch.arange(9).expand(3, -1), torch.tensor([2, 9, 5]))
    assert writes.ring.rows.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert writes.ring.cols.tolist() == [0, 1, 6, 7, 8, 2, 3, 4]
    assert writes.ring.index.tolist() == [0, 1, 0, 1, 2, 2, 0, 1]
    assert writes.main.rows.tolist() == [0] * 2 + [1] * 9 + [2] * 5


def test_finished_rows_leave_the_batch_without_allocating():
    model = random_model("huginn", seed=2)
    prompts = ragged_prompts(model, (4, 2, 3))
    out = batched_greedy(model, prompts, [1, 3, 5], policy=make_policy("full", R))
    assert out.batch_per_pass == [2, 2, 1, 1]  # row 0 never steps; row 1 leaves after two steps
    assert [len(t) for t in out.new_tokens] == [1, 3, 5]
    cache = BatchedPlaneCache(model.config, make_policy("ripe", R, window=3), batch=4, capacity=12, dtype=model.dtype)
    prefill_rows(model, cache, ragged_prompts(model, (4, 2, 3, 5)), R)
    before = [t.clone() for t in (*cache.planes.core, *cache.planes.ring)]
    peak, _ = peak_bytes(lambda: cache.keep_rows([1, 3]))
    assert peak < 1000 < cache.allocated_bytes  # compacted in place, only the small length vector is new
    assert cache.lengths.tolist() == [2, 5] and cache.batch == 2
    for old, new in zip(before, (*cache.planes.core, *cache.planes.ring), strict=True):
        assert torch.equal(new, old[:, :, [1, 3]])


def test_accept_rows_is_ragged():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 2, 3]])
    targets = torch.tensor([[1, 2, 3, 9], [1, 5, 3, 9], [1, 2, 3, 9]])
    assert accept_rows(drafts, targets).tolist() == [3, 1, 0]


def test_a_tensor_of_prompts_and_generate_methods():
    model = random_model("huginn", seed=4)
    ids = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(0))
    greedy_out = batched_generate(model, ids, max_new_tokens=5, method="greedy", cache="ripe", window=4, num_loops=R)
    dtv_out = batched_generate(model, ids, max_new_tokens=5, method="dtv", cache="ripe", window=4, num_loops=R,
                               draft_loops=2, block=3)
    assert all(torch.equal(a, b) for a, b in zip(greedy_out.tokens, dtv_out.tokens, strict=True))
    assert dtv_out.tau >= 1 and greedy_out.tokens_per_s > 0


def test_throughput_cells():
    model = random_model("huginn", seed=4)
    prompts = ragged_prompts(model, (3, 5))
    cells = throughput_cells(model, prompts, [1, 3], "dtv", "full", max_new_tokens=4, num_loops=R, draft_loops=2,
                             block=2, warmup=False)
    assert [c.batch for c in cells] == [1, 3]
    assert [c.new_tokens for c in cells] == [4, 12]
    assert all(c.tokens_per_s > 0 and c.tau >= 1 for c in cells)


@pytest.mark.parametrize("call, message", [
    (lambda m, p: batched_generate(m, p, method="beam"), "method must be one of"),
    (lambda m, p: batched_generate(m, p, cache="half"), "cache must be one of"),
    (lambda m, p: batched_generate(m, p, max_new_tokens=[3]), "one int per prompt"),
    (lambda m, p: batched_generate(m, p, max_new_tokens=0), "max_new_tokens must be >= 1"),
    (lambda m, p: batched_generate(m, p, max_new_tokens=200), "exceeds the model's context"),
    (lambda m, p: batched_generate(m, [], max_new_tokens=2), "at least one prompt"),
    (lambda m, p: batched_generate(m, torch.zeros(4, dtype=torch.long)), "prompts must be a .batch, length. tensor"),
    (lambda m, p: batched_generate(m, p, method="dtv", cache="deepest", num_loops=R), "W = 0 < block gamma"),
    (lambda m, p: batched_generate(m, p, method="dtv", draft_loops=R, num_loops=R), r"draft_loops must be in"),
    (lambda m, p: batched_generate(m, p, method="dtv", block=0, num_loops=R), r"block \(gamma\) must be >= 1"),
    (lambda m, p: batched_generate(m, p, method="dtv", prefix_reads="shallow", num_loops=R), "prefix_reads must"),
    (lambda m, p: batched_generate(m, p, capacity=3, num_loops=R), "capacity must be >= "),
    (lambda m, p: throughput_cells(m, p, [0]), "batch_sizes must be"),
    (lambda m, p: throughput_cells(m, p, [1], beam=2), "options must be among"),
    (lambda m, p: throughput_cells(m, p, [1], "dtv", "ripe", window=1, block=2), "W = 1 < block gamma = 2"),
    (lambda m, p: RowsPass(None, torch.zeros(1, 1, dtype=torch.long), store="disk"), "store must be one of"),
])
def test_bad_parameters(call, message):
    model = random_model("huginn")
    with pytest.raises(ValueError, match=message):
        call(model, ragged_prompts(model, (3, 2)))


def test_keep_rows_rejects_bad_rows():
    model = random_model("huginn")
    cache = BatchedPlaneCache(model.config, make_policy("full", R), batch=3, capacity=8, dtype=model.dtype)
    for rows in ([], [2, 1], [0, 3]):
        with pytest.raises(ValueError, match="rows must be increasing indices"):
            cache.keep_rows(rows)


def test_command_line_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--batch-sizes", "--max-new-tokens", "--draft-loops", "--block", "--budget-mb", "--fit-on"):
        assert flag in text


def test_command_line_on_the_tiny_model(capsys):
    main(["--prompts", "2", "--batch-sizes", "1", "2", "--max-new-tokens", "3", "--num-loops", "4", "--draft-loops",
          "2", "--block", "2", "--budget-mb", "1", "--memory-batch-sizes", "1", "2", "3", "--repeats", "1"])
    text = capsys.readouterr().out
    for series in ("greedy  full", "greedy  deepest", "dtv     full", "dtv     deepest"):
        assert series in text
    assert "held-out error B=3" in text and "fixed-memory total" in text


def _no_decoding(*args, **kwargs):
    raise AssertionError("decoding started before every argument was checked")


@pytest.mark.parametrize("argv, message", [
    (["--fit-on", "1", "9"], r"--fit-on must name at least 2 distinct values of --memory-batch-sizes \[1, 2, 3, 4\]"),
    (["--fit-on", "2", "2"], "--fit-on must name at least 2 distinct values"),
    (["--draft-loops", "99"], r"--draft-loops must be in \[1, 31\] \(fewer than the R = 32 loops"),
    (["--num-loops", "4", "--draft-loops", "4"], r"--draft-loops must be in \[1, 3\] \(fewer than --num-loops 4\)"),
    (["--draft-loops", "0"], "--draft-loops must be >= 1, got 0"),
    (["--budget-mb", "-1"], "--budget-mb must be > 0"),
    (["--budget-mb", "inf"], "--budget-mb must be > 0"),
    (["--batch-sizes", "0", "2"], "--batch-sizes must all be >= 1"),
    (["--memory-batch-sizes", "0", "1", "2"], "--memory-batch-sizes must all be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--block", "0"], "--block must be >= 1"),
    (["--num-loops", "0"], "--num-loops must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--device", "foo"], "--device 'foo' is not a torch device name; available here: cpu"),
    (["--model", "./no/such/folder"], "--model './no/such/folder'"),
    (["--max-new-tokens", "2000"], "exceeds the model's context"),
])
def test_command_line_checks_every_argument_before_decoding(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(batched, "batched_generate", _no_decoding)
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompts", "2", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
