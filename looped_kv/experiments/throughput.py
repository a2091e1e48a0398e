"""The batched-decoding experiment (``looped-kv batched``): tokens/s against B for greedy decoding and
draft-then-verify with the full and the deepest-plane caches, the peak-memory model and the fixed-memory
comparison (RIPE Sec. 3.5, 5.3), printed from :mod:`looped_kv.analysis.throughput`'s measurements."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from looped_kv.analysis.perf import ThroughputFit, fit_throughput
from looped_kv.analysis.throughput import ThroughputCell, check_cells, fixed_memory_comparison, throughput_cells
from looped_kv.runtime.measurement import measurement_mode
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads import data

#: The command that runs :func:`run` (:mod:`looped_kv.cli`'s ``batched``), as a module.


@dataclass(frozen=True)
class Options:
    """One experiment's settings (``looped-kv batched``'s options, checked there); ``num_loops`` is R itself."""

    workload: str
    prompts: int
    batch_sizes: list[int]
    max_new_tokens: int
    num_loops: int
    draft_loops: int
    gamma: int
    budget_mb: float
    memory_batch_sizes: list[int]
    fit_on: list[int]
    repeats: int


def _fit_line(cells: list[ThroughputCell]) -> str:
    try:
        fit: ThroughputFit = fit_throughput([c.batch for c in cells], [c.tokens_per_s for c in cells])
    except ValueError:  # too few cells, or cells that do not saturate
        return "no fit of T(B) = B/(a + bB) with a >= 0, b > 0 on these cells"
    return (f"T(B) = B/(a + bB): T_inf = {fit.t_inf:.1f} tokens/s, B_1/2 = {fit.b_half:.2f}, "
            f"largest residual {100 * fit.max_relative_residual:.1f}%")


def _series(options: Options) -> list[tuple[str, str, dict]]:
    dtv = dict(draft_loops=options.draft_loops, gamma=options.gamma)
    return [("ar", "full", {}), ("ar", "deepest", {}), ("self-spec", "full", dtv),
            ("self-spec", "deepest", {**dtv, "exact": False})]


def eval_prompts(model: LoopedLM, options: Options) -> list[Tensor]:
    """The evaluation prompts of ``options.workload`` as token ids on the model's device."""
    return [model.tokenizer(text, return_tensors="pt").input_ids[0].to(model.device)
            for text in data.prompts(options.workload, options.prompts, split="eval")]


def check(model: LoopedLM, prompts: list[Tensor], options: Options) -> None:
    """Every series checked before the first decoding: a ValueError naming the options that do not fit."""
    series = _series(options)
    checks = [(options.batch_sizes, method, cache, extra) for method, cache, extra in series]
    if options.budget_mb:  # the fixed-memory comparison's memory runs (its throughput runs are checked above)
        checks += [(options.memory_batch_sizes, "self-spec", cache, extra) for _, cache, extra in series[2:]]
    for sizes, method, cache, extra in checks:
        try:
            check_cells(model, prompts, sizes, method, cache, options.max_new_tokens,
                        {"num_loops": options.num_loops, **extra})
        except ValueError as error:
            raise ValueError(f"{method}, {cache} cache: {error} (see --max-new-tokens, --num-loops, --draft-loops, "
                             f"--gamma)") from None


def run(model: LoopedLM, prompts: list[Tensor], options: Options, name: str) -> None:
    """Measure and print the table, the fits and the fixed-memory comparison (``name``: the model, as given)."""
    R = options.num_loops
    run_options = dict(num_loops=R, max_new_tokens=options.max_new_tokens, progress=True)
    dtv = dict(draft_loops=options.draft_loops, gamma=options.gamma)
    with measurement_mode() as mode:  # cuDNN attention off on CUDA (RIPE Sec. 5.5); nothing changes on CPU
        print(f"model {name} ({model.dtype}, {model.device}, {torch.get_num_threads()} threads), R = {R}, "
              f"d = {options.draft_loops}, gamma = {options.gamma}, {options.prompts} {options.workload} prompts "
              f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {options.max_new_tokens} new tokens "
              f"each; cuDNN attention {mode['cudnn_sdp']}")
        print(f"{'method':<10}{'cache':<9}" + "".join(f"{'B=' + str(b):>10}" for b in options.batch_sizes)
              + "   tokens/s")
        for method, cache, extra in _series(options):
            cells = throughput_cells(model, prompts, options.batch_sizes, method, cache, repeats=options.repeats,
                                     **run_options, **extra)
            taus = f"  tau {cells[-1].tau:.2f}" if method == "self-spec" else ""
            print(f"{method:<10}{cache:<9}" + "".join(f"{c.tokens_per_s:>10.1f}" for c in cells) + taus)
            print(f"{'':19}{_fit_line(cells)}")
        if not options.budget_mb:
            return
        try:
            comparison = fixed_memory_comparison(model, prompts, options.budget_mb * 1e6, method="self-spec",
                                                 memory_batch_sizes=options.memory_batch_sizes, fit_on=options.fit_on,
                                                 repeats=options.repeats, **run_options, **dtv)
        except ValueError as error:  # known only once memory is measured: a budget that holds no sequence
            raise ValueError(f"--budget-mb {options.budget_mb:g}: {error}") from None
        print(f"\nfixed memory: budget {options.budget_mb:g} MB (peak bytes allocated by PyTorch during decoding, "
              f"{'CUDA reserved' if model.device.type == 'cuda' else 'CPU allocator events'}), draft-then-verify")
        for label, check_ in comparison.memory.items():
            fit = check_.fit
            errors = ", ".join(f"B={b}: {100 * e:+.3f}%" for b, e in zip(check_.held_out, check_.held_out_errors,
                                                                         strict=True))
            print(f"  {label:<8} cache {fit.cache_per_seq / 1e6:.3f} MB/seq, o0 = {fit.o0 / 1e3:.1f} kB, "
                  f"o1 = {fit.o1 / 1e6:.3f} MB/seq (fit on B = {list(check_.fitted)}); held-out error "
                  f"{errors or '-'}; B_max = {check_.b_max}")
        for label, cell in comparison.cells.items():
            print(f"  {label:<12} {cell.tokens_per_s:8.1f} tokens/s (tau {cell.tau:.2f})")
        f = comparison.factors
        print(f"  deepest / full at the full cache's B_max: {f.same_batch:.2f}x; batch factor {f.batch:.2f}x; "
              f"fixed-memory total {f.total:.2f}x")
