"""The batched-decoding experiment (``looped-kv batched``): tokens/s against B for greedy decoding and
draft-then-verify with the full and the deepest-plane caches, the peak-memory model and the fixed-memory
comparison (RIPE Sec. 3.5, 5.3), printed from :mod:`looped_kv.analysis.throughput`'s measurements."""

from __future__ import annotations

import argparse
import math

import torch

from looped_kv.analysis.perf import ThroughputFit, fit_throughput
from looped_kv.analysis.throughput import ThroughputCell, check_cells, fixed_memory_comparison, throughput_cells
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.loading import load, resolve_source
from looped_kv.runtime.measurement import check_device, measurement_mode
from looped_kv.workloads import data


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
                        ("--num-loops", args.num_loops), ("--draft-loops", args.draft_loops), ("--gamma", args.gamma),
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


def main(argv: list[str] | None = None, prog: str = "python -m looped_kv.experiments.throughput",
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
    ap.add_argument("--gamma", type=int, default=4, help="gamma, drafts per verification (default 4)")
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
    dtv = dict(draft_loops=args.draft_loops, gamma=args.gamma)
    series = [("ar", "full", {}), ("ar", "deepest", {}), ("self-spec", "full", dtv),
              ("self-spec", "deepest", {**dtv, "exact": False})]
    checks = [(args.batch_sizes, method, cache, given) for method, cache, given in series]
    if args.budget_mb:  # the fixed-memory comparison's memory runs (its throughput runs are checked above)
        checks += [(args.memory_batch_sizes, "self-spec", cache, given) for _, cache, given in series[2:]]
    for sizes, method, cache, given in checks:  # every series checked before the first decoding
        try:
            check_cells(model, prompts, sizes, method, cache, args.max_new_tokens, {"num_loops": R, **given})
        except ValueError as error:
            ap.error(f"{method}, {cache} cache: {error} (see --max-new-tokens, --num-loops, --draft-loops, --gamma)")
    with measurement_mode() as mode:  # cuDNN attention off on CUDA (RIPE Sec. 5.5); nothing changes on CPU
        print(f"model {args.model} ({model.dtype}, {args.device}, {torch.get_num_threads()} threads), R = {R}, "
              f"d = {args.draft_loops}, gamma = {args.gamma}, {args.prompts} {args.workload} prompts "
              f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {args.max_new_tokens} new tokens each; "
              f"cuDNN attention {mode['cudnn_sdp']}")
        print(f"{'method':<10}{'cache':<9}" + "".join(f"{'B=' + str(b):>10}" for b in args.batch_sizes) + "   tokens/s")
        for method, cache, given in series:
            cells = throughput_cells(model, prompts, args.batch_sizes, method, cache, repeats=args.repeats, **options,
                                     **given)
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
