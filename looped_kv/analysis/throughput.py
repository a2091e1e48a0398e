"""Throughput and memory against batch size, on the one decoding stack (RIPE Sec. 3.5 and 5.3).

:func:`throughput_cells` measures tokens/s of B prompts decoded together (fitted by T(B) = B / (a + bB),
Table 8), :func:`memory_cells` the peak memory against B (:mod:`looped_kv.analysis.memory_bench`), and
:func:`fixed_memory_comparison` the full cache at its B_max against the deepest plane at its B_max under
one budget. ``looped-kv batched`` (:mod:`looped_kv.experiments.throughput`) runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.analysis.memory_bench import MemoryCell, MemoryCheck, check_memory_model, peak_bytes
from looped_kv.analysis.perf import FixedMemoryFactors, fixed_memory_factors
from looped_kv.decoding.generate import drafter, generate
from looped_kv.decoding.prompts import check_prompts
from looped_kv.decoding.result import Generation
from looped_kv.decoding.settings import method_config
from looped_kv.runtime.model import LoopedLM

#: The two decoders whose throughput against B the RIPE paper models: greedy decoding and draft-then-verify.
METHODS = ("ar", "self-spec")


@dataclass(frozen=True)
class ThroughputCell:
    """Tokens/s of one batch size (new tokens of all sequences over the wall time, prefill included)."""

    batch: int
    tokens_per_s: float
    wall_time: float
    new_tokens: int
    tau: float  # tokens per verification (nan for greedy)


def _batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = list(batch_sizes)
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be a non-empty list of ints >= 1, got {sizes!r}")
    return sizes


OPTIONS = ("num_loops", "window", "k", "sinks", "draft_loops", "gamma", "prefix_reads", "exact")


def check_cells(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str, cache: str,
              max_new_tokens: int, options: dict) -> list[int]:
    """Check a measurement's parameters before any work; returns the batch sizes."""
    sizes = _batch_sizes(batch_sizes)
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"options must be among {OPTIONS}, got unknown {unknown}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    config = method_config(method, cache=cache, max_new_tokens=max_new_tokens, **options)
    policy = config.check(model.config.block_size, model.config.mean_recurrence)
    decoder = drafter(config, policy.num_loops)
    if decoder is not None:
        decoder.check(policy)
    check_prompts(model, list(prompts), max_new_tokens, 0 if decoder is None else decoder.lookahead)
    return sizes


def _run(model: LoopedLM, prompts: Sequence[Tensor], size: int, settings_: dict) -> Generation:
    """Decode the first ``size`` prompts (cycling) together, every row to its full budget."""
    return generate(model, [prompts[i % len(prompts)] for i in range(size)], stop_at_eos=False, **settings_)


def _fastest(size: int, runs: Sequence[Generation]) -> ThroughputCell:
    """A cell from its runs: the fastest (other load on the machine only slows a run down)."""
    out = min(runs, key=lambda run: run.wall_time)
    return ThroughputCell(size, out.tokens_per_s, out.wall_time, out.num_new, out.tau)


def _check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def throughput_cells(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str = "ar",
                     cache: str = "full", *, max_new_tokens: int = 16, repeats: int = 1, warmup: bool = True,
                     progress: bool = False, **options) -> list[ThroughputCell]:
    """Tokens/s of batched decoding at each batch size, measured in one run (RIPE Sec. 3.5, Table 8).

    Batch B decodes the first B ``prompts`` (cycling), ``max_new_tokens`` each, with
    :func:`looped_kv.generate` (``options``: ``num_loops``, ``window``, ``k``, ``sinks``, ``draft_loops``,
    ``gamma``, ``prefix_reads``, ``exact``). A warm-up run at the smallest batch comes first; each cell
    is the fastest of ``repeats`` runs (other load on the machine only slows a run down). Fit the
    cells with :func:`looped_kv.analysis.perf.fit_throughput` for T(B) = B / (a + b B).
    """
    sizes = check_cells(model, prompts, batch_sizes, method, cache, max_new_tokens, options)
    _check_repeats(repeats)
    run = dict(max_new_tokens=max_new_tokens, method=method, cache=cache, **options)
    if warmup:
        _run(model, prompts, min(sizes), run)
    cells = []
    for size in tqdm(sizes, disable=not progress, desc=f"{method}, {cache}: tokens/s", leave=False):
        cells.append(_fastest(size, [_run(model, prompts, size, run) for _ in range(repeats)]))
    return cells


def memory_cells(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str = "ar",
                 cache: str = "full", *, max_new_tokens: int = 16, progress: bool = False,
                 **options) -> list[MemoryCell]:
    """Peak memory of batched decoding at each batch size (:func:`looped_kv.analysis.memory_bench.peak_bytes`).

    Use prompts of one length: every batch's cache is then allocated for the same capacity per row, so
    that the cache term of peak(B) = cache B + o0 + o1 B is one number, and activations do not grow with
    the longest prompt of the batch.
    """
    sizes = check_cells(model, prompts, batch_sizes, method, cache, max_new_tokens, options)
    if len({len(p.reshape(-1)) for p in prompts}) > 1:
        raise ValueError(f"prompts must have one length, got lengths {sorted({len(p.reshape(-1)) for p in prompts})}")
    run = {"max_new_tokens": max_new_tokens, "method": method, "cache": cache, **options}
    _run(model, prompts, 1, run)  # warm-up: lazily built tables are not counted
    cells = []
    for size in tqdm(sizes, disable=not progress, desc=f"{method}, {cache}: peak memory", leave=False):
        peak, out = peak_bytes(lambda size=size: _run(model, prompts, size, run), model.device)
        cells.append(MemoryCell(size, peak, out.allocated_bytes))
    return cells


@dataclass(frozen=True)
class FixedMemoryComparison:
    """Full cache at its B_max against the deepest plane at the same batch and at its own B_max (RIPE Sec. 5.3)."""

    budget: float  # bytes
    memory: dict[str, MemoryCheck]  # by cache: the fitted memory model and its B_max under the budget
    cells: dict[str, ThroughputCell]  # "full@B_full", "deepest@B_full", "deepest@B_deep", over every prompt set
    factors: FixedMemoryFactors  # of ``cells``
    by_set: tuple[dict[str, ThroughputCell], ...]  # the same cells for each prompt set: the units of a verdict


def fixed_memory_comparison(model: LoopedLM, prompts: Sequence[Tensor], budget: float, *, method: str = "self-spec",
                            memory_batch_sizes: Sequence[int] = (1, 2, 3, 4), fit_on: Sequence[int] = (1, 2),
                            max_new_tokens: int = 16, repeats: int = 1, sets: int = 1, progress: bool = False,
                            **options) -> FixedMemoryComparison:
    """The fixed-memory throughput gain of the deepest plane over the full cache under ``budget`` bytes.

    For each cache, peak memory is measured at ``memory_batch_sizes``, the model is fitted on ``fit_on``
    and B_max found; then throughput is measured for the full cache at B_full, and for the deepest plane
    at B_full and at B_deep, on each of ``sets`` disjoint prompt sets (``prompts`` split into equal consecutive
    sets; a cell decodes the first B of its set, cycling through it). The three cells of every set are interleaved
    in each of ``repeats`` rounds after one warm-up run each (each cell the fastest of its runs: a factor is a ratio
    of cells timed side by side); the cells over all sets are split by
    :func:`looped_kv.analysis.perf.fixed_memory_factors`. ``options`` go to :func:`looped_kv.generate`; the
    deepest plane is block-dependent, so draft-then-verify runs it with ``exact=False``.
    """
    if not budget > 0:
        raise ValueError(f"budget must be > 0 bytes, got {budget}")
    if not isinstance(sets, int) or not 1 <= sets <= len(prompts):
        raise ValueError(f"sets must be an integer in [1, len(prompts) = {len(prompts)}], got {sets!r}")
    if not set(fit_on) <= set(memory_batch_sizes) or len(set(fit_on)) < 2:
        raise ValueError(f"fit_on must name at least 2 of memory_batch_sizes {list(memory_batch_sizes)}, "
                         f"got {list(fit_on)}")
    full = dict(options)
    deep = {**options, "exact": False} if method == "self-spec" else options
    for cache, kwargs in (("full", full), ("deepest", deep)):
        check_cells(model, prompts, memory_batch_sizes, method, cache, max_new_tokens, kwargs)
    common = dict(method=method, max_new_tokens=max_new_tokens, progress=progress)
    length = min(len(p.reshape(-1)) for p in prompts)
    same_length = [p.reshape(-1)[:length] for p in prompts]
    memory = {cache: check_memory_model(memory_cells(model, same_length, memory_batch_sizes, cache=cache, **common,
                                                     **kwargs), fit_on, budget)
              for cache, kwargs in (("full", full), ("deepest", deep))}
    b_full, b_deep = memory["full"].b_max, memory["deepest"].b_max
    if b_full < 1:
        raise ValueError(f"budget {budget:.4g} bytes holds no full-cache sequence (B_max = 0); raise it")
    _check_repeats(repeats)
    arms = {f"full@{b_full}": (b_full, "full", full), f"deepest@{b_full}": (b_full, "deepest", deep),
            f"deepest@{b_deep}": (b_deep, "deepest", deep)}
    arms = {name: (size, dict(max_new_tokens=max_new_tokens, method=method, cache=cache, **kwargs))
            for name, (size, cache, kwargs) in arms.items()}
    per_set = len(prompts) // sets
    prompt_sets = [prompts[k * per_set:(k + 1) * per_set] for k in range(sets)]
    for size, run in arms.values():  # warm-up
        _run(model, prompt_sets[0], size, run)
    runs: list[dict[str, list[Generation]]] = [{name: [] for name in arms} for _ in prompt_sets]
    for _ in tqdm(range(repeats), disable=not progress, desc="fixed memory: interleaved rounds", leave=False):
        for set_runs, set_prompts in zip(runs, prompt_sets, strict=True):
            for name, (size, run) in arms.items():
                set_runs[name].append(_run(model, set_prompts, size, run))
    by_set = tuple({name: _fastest(size, set_runs[name]) for name, (size, _) in arms.items()} for set_runs in runs)
    cells = {name: _pooled([cells[name] for cells in by_set]) for name in arms}
    best_full, same, at_max = cells.values()
    return FixedMemoryComparison(budget, memory, cells,
                                 fixed_memory_factors(best_full.tokens_per_s, same.tokens_per_s, at_max.tokens_per_s),
                                 by_set)


def _pooled(cells: Sequence[ThroughputCell]) -> ThroughputCell:
    """One batch size's cells of several prompt sets as one: their tokens over their summed time."""
    wall = sum(c.wall_time for c in cells)
    tokens = sum(c.new_tokens for c in cells)
    return ThroughputCell(cells[0].batch, tokens / wall, wall, tokens, sum(c.tau for c in cells) / len(cells))
