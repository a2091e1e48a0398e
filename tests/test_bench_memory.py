"""Peak-memory measurement and the memory model cache(B) + o0 + o1 B (RIPE Sec. 3.5) on real allocations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_model

from looped_kv.analysis.memory_bench import MemoryCell, check_memory_model, peak_bytes, tensor_peak_bytes
from looped_kv.analysis.throughput import fixed_memory_comparison, memory_cells
from looped_kv.runtime.memory import policy_bytes
from looped_kv.runtime.policy import make_policy

R = 4


def test_peak_bytes_counts_live_tensors_exactly():
    existing = torch.empty(4000, dtype=torch.float64)

    def run() -> int:
        nonlocal existing
        a = torch.empty(1000, dtype=torch.float64)  # 8000 bytes
        b = torch.empty(500, dtype=torch.float64)  # + 4000 = 12000 live
        del a  # 4000 live
        existing = None  # freeing a tensor from before the run does not lower the baseline
        c = torch.empty(4000, dtype=torch.float32)  # + 16000 = 20000 live: the peak
        return b.numel() + c.numel()

    peak, result = peak_bytes(run)
    assert (peak, result) == (20000, 4500)


def test_peak_bytes_refuses_other_devices():
    with pytest.raises(ValueError, match="device must be a CPU or CUDA device"):
        peak_bytes(lambda: None, "meta")


def test_check_memory_model_recovers_a_linear_peak():
    per_seq, o0, o1 = 1000.0, 300.0, 50.0
    cells = [MemoryCell(b, int(o0 + (per_seq + o1) * b), int(per_seq * b)) for b in (1, 2, 3, 5)]
    check = check_memory_model(cells, [1, 2], budget=6000)
    assert check.fit.o0 == pytest.approx(o0) and check.fit.o1 == pytest.approx(o1)
    assert check.held_out == (3, 5) and check.max_held_out_error == pytest.approx(0, abs=1e-12)
    assert check.b_max == 5  # 300 + 1050 B <= 6000
    with pytest.raises(ValueError, match="fit_on must name measured batch sizes"):
        check_memory_model(cells, [1, 4], budget=6000)
    with pytest.raises(ValueError, match="one cache size per sequence"):
        check_memory_model([*cells, MemoryCell(4, 9000, 3000)], [1, 2], budget=6000)
    with pytest.raises(ValueError, match="budget must be > 0"):
        check_memory_model(cells, [1, 2], budget=0)


@pytest.mark.parametrize("method, cache, options", [("ar", "full", {}),
                                                    ("self-spec", "ripe", {"window": 3, "gamma": 3, "draft_loops": 2})])
def test_memory_model_predicts_held_out_batches(method, cache, options):
    """Real decoding: the cache term is Eq. (3)/(10) per sequence; o0 + o1 B fitted on B = 1, 2 predicts B = 3, 5."""
    model = random_model("huginn", seed=1)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (5,), generator=generator) for _ in range(3)]
    cells = memory_cells(model, prompts, [1, 2, 3, 5], method, cache, max_new_tokens=3, num_loops=R, **options)
    capacity = 5 + 3 + (options["gamma"] + 1 if method == "self-spec" else 0)  # prompt, new tokens, one block
    policy = make_policy(cache, R, window=options.get("window"))
    assert [c.cache_bytes for c in cells] == [b * policy_bytes(model.config, policy, capacity, model.dtype)
                                              for b in (1, 2, 3, 5)]
    assert all(c.peak_bytes > c.cache_bytes for c in cells)
    # 1% above B = 5's measured peak: the fit's prediction for B = 5 is within 1% of it (held-out error), B = 6's
    # is one sequence (cache + o1, ~20%) above it
    check = check_memory_model(cells, [1, 2], budget=cells[-1].peak_bytes * 1.01)
    assert check.max_held_out_error < 0.01
    assert check.fit.o1 > 0 and check.b_max == 5


def test_fixed_memory_comparison_under_a_budget():
    model = random_model("huginn", seed=1)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (4,), generator=generator) for _ in range(2)]
    options = dict(max_new_tokens=3, num_loops=R, draft_loops=2, gamma=2, memory_batch_sizes=(1, 2), fit_on=(1, 2))
    full = memory_cells(model, prompts, [1, 2], "self-spec", "full", max_new_tokens=3, num_loops=R, draft_loops=2,
                        gamma=2)
    budget = full[1].peak_bytes * 1.01  # two full-cache sequences fit
    comparison = fixed_memory_comparison(model, prompts, budget, **options)
    b_full, b_deep = comparison.memory["full"].b_max, comparison.memory["deepest"].b_max
    assert b_full == 2 and b_deep > b_full
    assert list(comparison.cells) == ["full@2", "deepest@2", f"deepest@{b_deep}"]
    f = comparison.factors
    assert np.isclose(f.total, f.same_batch * f.batch)
    with pytest.raises(ValueError, match="fit_on must name at least 2"):
        fixed_memory_comparison(model, prompts, budget, **{**options, "fit_on": (1,)})
    with pytest.raises(ValueError, match=r"sets must be an integer in \[1, len\(prompts\) = 2\]"):
        fixed_memory_comparison(model, prompts, budget, sets=3, **options)


def test_fixed_memory_sets_are_disjoint_units(monkeypatch):
    """Chapter 7's fixed-memory gain was one comparison (n = 1): each prompt set is a unit, its cells timed on its
    own prompts, interleaved with the other cells of its set in every round."""
    import looped_kv.analysis.throughput as throughput

    model = random_model("huginn", seed=1)
    prompts = [torch.randint(0, model.config.vocab_size, (4,), generator=torch.Generator().manual_seed(i))
               for i in range(4)]
    options = dict(max_new_tokens=3, num_loops=R, draft_loops=2, gamma=2, memory_batch_sizes=(1, 2), fit_on=(1, 2))
    full = memory_cells(model, prompts, [1, 2], "self-spec", "full", max_new_tokens=3, num_loops=R, draft_loops=2,
                        gamma=2)
    calls, run = [], throughput._run
    monkeypatch.setattr(throughput, "_run", lambda m, p, size, s: calls.append((s["cache"], size, tuple(
        int(x[0]) for x in p))) or run(m, p, size, s))
    comparison = fixed_memory_comparison(model, prompts, full[1].peak_bytes * 1.01, repeats=2, sets=2, **options)
    b_deep = comparison.memory["deepest"].b_max
    firsts = [(int(prompts[0][0]), int(prompts[1][0])), (int(prompts[2][0]), int(prompts[3][0]))]
    timed = calls[-12:]  # two rounds of two sets of three cells
    assert [c[:2] for c in timed] == [("full", 2), ("deepest", 2), ("deepest", b_deep)] * 4
    assert [c[2] for c in timed] == [firsts[0]] * 3 + [firsts[1]] * 3 + [firsts[0]] * 3 + [firsts[1]] * 3
    assert len(comparison.by_set) == 2
    full_cells = [cells["full@2"] for cells in comparison.by_set]
    assert comparison.cells["full@2"].new_tokens == sum(c.new_tokens for c in full_cells)
    assert comparison.cells["full@2"].tokens_per_s == pytest.approx(
        sum(c.new_tokens for c in full_cells) / sum(c.wall_time for c in full_cells))


def test_fixed_memory_cells_are_timed_interleaved(monkeypatch):
    """Chapter 7 divided deepest@4 by a full@4 timed in a separate call: a factor's cells share each round."""
    import looped_kv.analysis.throughput as throughput

    model = random_model("huginn", seed=1)
    prompts = [torch.randint(0, model.config.vocab_size, (4,)) for _ in range(2)]
    options = dict(max_new_tokens=3, num_loops=R, draft_loops=2, gamma=2, memory_batch_sizes=(1, 2), fit_on=(1, 2))
    full = memory_cells(model, prompts, [1, 2], "self-spec", "full", max_new_tokens=3, num_loops=R, draft_loops=2,
                        gamma=2)
    calls, run = [], throughput._run
    monkeypatch.setattr(throughput, "_run",
                        lambda m, p, size, s: calls.append((s["cache"], size)) or run(m, p, size, s))
    comparison = fixed_memory_comparison(model, prompts, full[1].peak_bytes * 1.01, repeats=2, **options)
    b_deep = comparison.memory["deepest"].b_max
    round_ = [("full", 2), ("deepest", 2), ("deepest", b_deep)]
    assert calls[-9:] == round_ * 3  # after the memory cells: a warm-up round, then two timed rounds
    with pytest.raises(ValueError, match="holds no full-cache sequence"):
        fixed_memory_comparison(model, prompts, 10.0, **options)


def test_tensor_peak_bytes_follows_storages_not_tensors():
    existing = torch.empty(4000, dtype=torch.float64)

    def run() -> torch.nn.Parameter:
        nonlocal existing
        a = torch.empty(1000, dtype=torch.float64)  # 8000 bytes
        view = existing[:10]  # a view of a storage held before the run: nothing new
        b = torch.nn.Parameter(torch.ones(500, dtype=torch.float64))  # + 4000; the storage outlives the ones()
        existing = None
        del a, view  # 4000 live
        c = torch.empty(4000, dtype=torch.float32)  # + 16000 = 20000 live: the peak
        c.mul_(2)  # in place: nothing new
        del c
        return b

    peak, result = tensor_peak_bytes(run)
    assert peak == 20000 and result.numel() == 500
