"""Throughput and memory against batch size, on the one decoding stack (RIPE Sec. 3.5 and 5.3).

:func:`throughput_cells` measures tokens/s of B prompts decoded together (fitted by T(B) = B / (a + bB),
Table 8), :func:`memory_cells` the peak memory against B (:mod:`looped_kv.analysis.memory_bench`), and
:func:`fixed_memory_comparison` the full cache at its B_max against the deepest plane at its B_max under
one budget. ``looped-kv batched`` (or ``python -m looped_kv.analysis.throughput``) runs them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.analysis.memory_bench import MemoryCell, MemoryCheck, check_memory_model, peak_bytes
from looped_kv.analysis.perf import FixedMemoryFactors, ThroughputFit, fit_throughput, fixed_memory_factors
from looped_kv.decoding.core import Generation, check_prompts
from looped_kv.decoding.generate import drafter, generate
from looped_kv.decoding.settings import method_config
from looped_kv.protocol.reproducibility import check_device, measurement_mode
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.loading import load, resolve_source
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads import data

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


OPTIONS = ("num_loops", "window", "k", "sinks", "draft_loops", "block", "prefix_reads", "exact")


def _validate(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str, cache: str,
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


def throughput_cells(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str = "ar",
                     cache: str = "full", *, max_new_tokens: int = 16, repeats: int = 1, warmup: bool = True,
                     progress: bool = False, **options) -> list[ThroughputCell]:
    """Tokens/s of batched decoding at each batch size, measured in one run (RIPE Sec. 3.5, Table 8).

    Batch B decodes the first B ``prompts`` (cycling), ``max_new_tokens`` each, with
    :func:`looped_kv.generate` (``options``: ``num_loops``, ``window``, ``k``, ``sinks``, ``draft_loops``,
    ``block``, ``prefix_reads``, ``exact``). A warm-up run at the smallest batch comes first; each cell
    is the fastest of ``repeats`` runs (other load on the machine only slows a run down). Fit the
    cells with :func:`looped_kv.analysis.perf.fit_throughput` for T(B) = B / (a + b B).
    """
    sizes = _validate(model, prompts, batch_sizes, method, cache, max_new_tokens, options)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    run = dict(max_new_tokens=max_new_tokens, method=method, cache=cache, **options)
    if warmup:
        _run(model, prompts, min(sizes), run)
    cells = []
    for size in tqdm(sizes, disable=not progress, desc=f"{method}, {cache}: tokens/s", leave=False):
        runs = [_run(model, prompts, size, run) for _ in range(repeats)]
        out = min(runs, key=lambda run: run.wall_time)
        cells.append(ThroughputCell(size, out.tokens_per_s, out.wall_time, out.num_new, out.tau))
    return cells


def memory_cells(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str = "ar",
                 cache: str = "full", *, max_new_tokens: int = 16, progress: bool = False,
                 **options) -> list[MemoryCell]:
    """Peak memory of batched decoding at each batch size (:func:`looped_kv.analysis.memory_bench.peak_bytes`).

    Use prompts of one length: every batch's cache is then allocated for the same capacity per row, so
    that the cache term of peak(B) = cache B + o0 + o1 B is one number, and activations do not grow with
    the longest prompt of the batch.
    """
    sizes = _validate(model, prompts, batch_sizes, method, cache, max_new_tokens, options)
    if len({len(p.reshape(-1)) for p in prompts}) > 1:
        raise ValueError(f"prompts must have one length, got lengths {sorted({len(p.reshape(-1)) for p in prompts})}")
    run = {"max_new_tokens": max_new_tokens, "method": method, "cache": cache, **options}
    _run(model, prompts, 1, run)  # warm-up: lazily built tables are not counted
    cells = []
    for size in tqdm(sizes, disable=not progress, desc=f"{method}, {cache}: peak memory", leave=False):
        peak, out = peak_bytes(lambda size=size: _run(model, prompts, size, run), model.device)
        cells.append(MemoryCell(size, peak, out.extra["allocated_bytes"]))
    return cells


@dataclass(frozen=True)
class FixedMemoryComparison:
    """Full cache at its B_max against the deepest plane at the same batch and at its own B_max (RIPE Sec. 5.3)."""

    budget: float  # bytes
    memory: dict[str, MemoryCheck]  # by cache: the fitted memory model and its B_max under the budget
    cells: dict[str, ThroughputCell]  # "full@B_full", "deepest@B_full", "deepest@B_deep"
    factors: FixedMemoryFactors


def fixed_memory_comparison(model: LoopedLM, prompts: Sequence[Tensor], budget: float, *, method: str = "self-spec",
                            memory_batch_sizes: Sequence[int] = (1, 2, 3, 4), fit_on: Sequence[int] = (1, 2),
                            max_new_tokens: int = 16, repeats: int = 1, progress: bool = False,
                            **options) -> FixedMemoryComparison:
    """The fixed-memory throughput gain of the deepest plane over the full cache under ``budget`` bytes.

    For each cache, peak memory is measured at ``memory_batch_sizes``, the model is fitted on ``fit_on``
    and B_max found; then throughput is measured for the full cache at B_full, and for the deepest plane
    at B_full and at B_deep (fastest of ``repeats`` runs), and split by
    :func:`looped_kv.analysis.perf.fixed_memory_factors`. ``options`` go to :func:`looped_kv.generate`;
    the deepest plane is block-dependent, so draft-then-verify runs it with ``exact=False``.
    """
    if not budget > 0:
        raise ValueError(f"budget must be > 0 bytes, got {budget}")
    if not set(fit_on) <= set(memory_batch_sizes) or len(set(fit_on)) < 2:
        raise ValueError(f"fit_on must name at least 2 of memory_batch_sizes {list(memory_batch_sizes)}, "
                         f"got {list(fit_on)}")
    full = dict(options)
    deep = {**options, "exact": False} if method == "self-spec" else options
    for cache, kwargs in (("full", full), ("deepest", deep)):
        _validate(model, prompts, memory_batch_sizes, method, cache, max_new_tokens, kwargs)
    common = dict(method=method, max_new_tokens=max_new_tokens, progress=progress)
    length = min(len(p.reshape(-1)) for p in prompts)
    same_length = [p.reshape(-1)[:length] for p in prompts]
    memory = {cache: check_memory_model(memory_cells(model, same_length, memory_batch_sizes, cache=cache, **common,
                                                     **kwargs), fit_on, budget)
              for cache, kwargs in (("full", full), ("deepest", deep))}
    b_full, b_deep = memory["full"].b_max, memory["deepest"].b_max
    if b_full < 1:
        raise ValueError(f"budget {budget:.4g} bytes holds no full-cache sequence (B_max = 0); raise it")
    best_full = throughput_cells(model, prompts, [b_full], cache="full", repeats=repeats, **common, **full)[0]
    same, at_max = throughput_cells(model, prompts, [b_full, b_deep], cache="deepest", repeats=repeats, **common,
                                    **deep)
    cells = {f"full@{b_full}": best_full, f"deepest@{b_full}": same, f"deepest@{b_deep}": at_max}
    return FixedMemoryComparison(budget, memory, cells,
                                 fixed_memory_factors(best_full.tokens_per_s, same.tokens_per_s, at_max.tokens_per_s))


# -- command line ----------------------------------------------------------------------------------


def _fit_line(cells: list[ThroughputCell]) -> str:
    try:
        fit: ThroughputFit = fit_throughput([c.batch for c in cells], [c.tokens_per_s for c in cells])
    except ValueError:  # too few cells, or cells that do not saturate
        return "no fit of T(B) = B/(a + bB) with a >= 0, b > 0 on these cells"
    return (f"T(B) = B/(a + bB): T_inf = {fit.t_inf:.1f} tokens/s, B_1/2 = {fit.b_half:.2f}, "
            f"largest residual {100 * fit.max_relative_residual:.1f}%")


def _check_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The command line's checks that need no model: every count, the budget, --fit-on and --device."""
    for flag, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--num-loops", args.num_loops), ("--draft-loops", args.draft_loops), ("--block", args.block),
                        ("--repeats", args.repeats), ("--threads", args.threads)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    for flag, sizes in (("--batch-sizes", args.batch_sizes), ("--memory-batch-sizes", args.memory_batch_sizes)):
        if any(b < 1 for b in sizes):
            ap.error(f"{flag} must all be >= 1, got {sizes}")
    if not (math.isfinite(args.budget_mb) and args.budget_mb >= 0):
        ap.error(f"--budget-mb must be > 0 (or 0 to skip the fixed-memory comparison), got {args.budget_mb}")
    if args.budget_mb:
        unknown = sorted(set(args.fit_on) - set(args.memory_batch_sizes))
        if unknown or len(set(args.fit_on)) < 2:
            ap.error(f"--fit-on must name at least 2 distinct values of --memory-batch-sizes "
                     f"{args.memory_batch_sizes}, got {args.fit_on}")
    if args.num_loops is not None and args.draft_loops >= args.num_loops:
        ap.error(f"--draft-loops must be in [1, {args.num_loops - 1}] (fewer than --num-loops {args.num_loops}), "
                 f"got {args.draft_loops}")
    try:
        check_device(args.device)
    except ValueError as error:
        ap.error(str(error))


def main(argv: list[str] | None = None, prog: str = "python -m looped_kv.analysis.throughput",
         parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> None:
    """The command line (also ``looped-kv batched``): every argument is checked before the first decoding."""
    ap = parser_class(
        prog=prog,
        description="Batched decoding on CPU (or CUDA): tokens/s against batch size B for greedy decoding (ar) and "
                    "draft-then-verify (self-spec) with the full and the deepest-plane caches, the peak-memory model "
                    "peak(B) = cache B + o0 + o1 B fitted and checked on held-out batches, and the fixed-memory "
                    "throughput ratio (deepest plane at its B_max / full cache at its B_max) under a budget "
                    "(RIPE Sec. 3.5, 5.3).")
    ap.add_argument("--model", default="tiny", help="'tiny' (default), a checkpoint folder or a hub id")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--workload", default="problems", choices=data.WORKLOADS, help="prompt set (default problems)")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts; larger batches cycle them (default 8)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="B values (default 1 2 4 8)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per sequence (default 16)")
    ap.add_argument("--num-loops", type=int, default=None, help="R (default: the model's mean recurrence)")
    ap.add_argument("--draft-loops", type=int, default=4, help="d, loops per draft, in [1, R - 1] (default 4)")
    ap.add_argument("--block", type=int, default=4, help="gamma, drafts per verification (default 4)")
    ap.add_argument("--budget-mb", type=float, default=24.0,
                    help="memory budget of the fixed-memory comparison, MB = 10^6 bytes above the weights "
                         "(default 24); 0 skips the comparison")
    ap.add_argument("--memory-batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4],
                    help="B values of the peak-memory measurement (default 1 2 3 4)")
    ap.add_argument("--fit-on", type=int, nargs="+", default=[1, 2],
                    help="at least 2 of the --memory-batch-sizes, which the memory model is fitted on; the others "
                         "are held out (default 1 2)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per throughput cell, the fastest kept (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    _check_arguments(ap, args)
    try:  # the config first (no weights): R and the context are known before the model is loaded
        folder = resolve_source(args.model)
        config = LoopedConfig.from_file(folder / "config.json")
    except (OSError, ValueError) as error:
        ap.error(f"--model {args.model!r}: {error}")
    R = config.mean_recurrence if args.num_loops is None else args.num_loops
    if not 1 <= args.draft_loops < R:
        ap.error(f"--draft-loops must be in [1, {R - 1}] (fewer than the R = {R} loops of the model), "
                 f"got {args.draft_loops}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    try:
        model = load(folder, device=args.device)
    except (OSError, ValueError) as error:
        ap.error(f"--model {args.model!r}: {error}")
    if model.tokenizer is None:
        ap.error(f"--model {args.model!r} has no tokenizer; the prompts are text")
    prompts = [model.tokenizer(text, return_tensors="pt").input_ids[0].to(model.device)
               for text in data.prompts(args.workload, args.prompts, split="eval")]
    options = dict(num_loops=R, max_new_tokens=args.max_new_tokens, progress=True)
    dtv = dict(draft_loops=args.draft_loops, block=args.block)
    series = [("ar", "full", {}), ("ar", "deepest", {}), ("self-spec", "full", dtv),
              ("self-spec", "deepest", {**dtv, "exact": False})]
    checks = [(args.batch_sizes, method, cache, extra) for method, cache, extra in series]
    if args.budget_mb:  # the fixed-memory comparison's memory runs (its throughput runs are checked above)
        checks += [(args.memory_batch_sizes, "self-spec", cache, extra) for _, cache, extra in series[2:]]
    for sizes, method, cache, extra in checks:  # every series checked before the first decoding
        try:
            _validate(model, prompts, sizes, method, cache, args.max_new_tokens, {"num_loops": R, **extra})
        except ValueError as error:
            ap.error(f"{method}, {cache} cache: {error} (see --max-new-tokens, --num-loops, --draft-loops, --block)")
    with measurement_mode() as mode:  # cuDNN attention off on CUDA (RIPE Sec. 5.5); nothing changes on CPU
        print(f"model {args.model} ({model.dtype}, {args.device}, {torch.get_num_threads()} threads), R = {R}, "
              f"d = {args.draft_loops}, gamma = {args.block}, {args.prompts} {args.workload} prompts "
              f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {args.max_new_tokens} new tokens each; "
              f"cuDNN attention {mode['cudnn_sdp']}")
        print(f"{'method':<10}{'cache':<9}" + "".join(f"{'B=' + str(b):>10}" for b in args.batch_sizes) + "   tokens/s")
        for method, cache, extra in series:
            cells = throughput_cells(model, prompts, args.batch_sizes, method, cache, repeats=args.repeats, **options,
                                     **extra)
            taus = f"  tau {cells[-1].tau:.2f}" if method == "self-spec" else ""
            print(f"{method:<10}{cache:<9}" + "".join(f"{c.tokens_per_s:>10.1f}" for c in cells) + taus)
            print(f"{'':19}{_fit_line(cells)}")
        if not args.budget_mb:
            return
        try:
            comparison = fixed_memory_comparison(model, prompts, args.budget_mb * 1e6, method="self-spec",
                                                 memory_batch_sizes=args.memory_batch_sizes, fit_on=args.fit_on,
                                                 repeats=args.repeats, **options, **dtv)
        except ValueError as error:  # known only once memory is measured: a budget that holds no sequence
            ap.error(f"--budget-mb {args.budget_mb:g}: {error}")
        print(f"\nfixed memory: budget {args.budget_mb:g} MB (peak bytes allocated by PyTorch during decoding, "
              f"{'CUDA reserved' if model.device.type == 'cuda' else 'CPU allocator events'}), draft-then-verify")
        for name, check in comparison.memory.items():
            fit = check.fit
            errors = ", ".join(f"B={b}: {100 * e:+.3f}%" for b, e in zip(check.held_out, check.held_out_errors,
                                                                         strict=True))
            print(f"  {name:<8} cache {fit.cache_per_seq / 1e6:.3f} MB/seq, o0 = {fit.o0 / 1e3:.1f} kB, "
                  f"o1 = {fit.o1 / 1e6:.3f} MB/seq (fit on B = {list(check.fitted)}); held-out error {errors or '-'}; "
                  f"B_max = {check.b_max}")
        for label, cell in comparison.cells.items():
            print(f"  {label:<12} {cell.tokens_per_s:8.1f} tokens/s (tau {cell.tau:.2f})")
        f = comparison.factors
        print(f"  deepest / full at the full cache's B_max: {f.same_batch:.2f}x; batch factor {f.batch:.2f}x; "
              f"fixed-memory total {f.total:.2f}x")


if __name__ == "__main__":
    main()
