"""Peak memory of batched decoding, measured, against the model cache(B) + o0 + o1 B (RIPE Sec. 3.5, Figure 3).

What is measured. On CUDA, the peak *reserved* memory of PyTorch's caching allocator above what it
reserved when the run started (``torch.cuda.max_memory_reserved``, the paper's Figure 3 quantity). On
CPU there are no allocator statistics, so the run is executed under ``torch.profiler`` with
``profile_memory=True``: PyTorch's CPU allocator then reports every allocation and every free (with
its size) as a ``[memory]`` event. Summing those events in time order gives the bytes held by tensors
allocated during the run at every instant, and the peak is their maximum. This counts what PyTorch
actually allocated (cache planes, block buffers, activations, attention masks, logits), byte-exact and
deterministic; it does not count the process's own heap (interpreter, malloc fragmentation) nor tensors
that existed before the run (the weights). Run a warm-up first: lazily built tables (the initial-state
draws of new positions) are allocated once and would otherwise count in the first run only.

The check: fit o0 and o1 of peak(B) = cache_per_seq B + o0 + o1 B (:func:`looped_kv.analysis.perf.fit_peak_memory`)
on some batch sizes, report the relative error on the others, and the largest batch under a budget
(:func:`looped_kv.analysis.perf.b_max`).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from looped_kv.analysis.perf import PeakMemoryFit, b_max, fit_peak_memory


@contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence what native code writes to file descriptor 2 (the profiler's start/stop trace lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_bytes(run: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[int, Any]:
    """Peak bytes allocated while ``run()`` executes, above what was held at its start; and its result.

    CUDA: peak reserved memory of the caching allocator. CPU: the running sum of the CPU allocator's
    allocation and free events recorded by ``torch.profiler`` (see the module docstring).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_reserved(device)
        result = run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_reserved(device) - start, result
    if device.type != "cpu":
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak, result


class _LiveStorages(TorchDispatchMode):
    """Bytes of the CPU storages that operators create while the mode is active, counted until each is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, int] = {}  # storage address -> bytes
        self.live = self.peak = 0

    def _release(self, address: int) -> None:
        self.live -= self.held.pop(address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if address in self.held or address in inputs or address == 0:  # known, a view, or written in place
                continue
            self.held[address] = storage.nbytes()
            self.live += self.held[address]
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, address)  # PyTorch keeps one Python object per storage
        return out


def tensor_peak_bytes(run: Callable[[], Any]) -> tuple[int, Any]:
    """Peak bytes of the CPU tensors that ``run()`` allocates, above what was held at its start; and its result.

    Every PyTorch operator is intercepted (a ``TorchDispatchMode``): a storage that an operator returns and that
    none of its inputs holds is new, and its bytes count until the storage is freed. Unlike
    :func:`peak_bytes` this keeps no record of the run, so it measures long runs (whole chapters) in constant
    memory; it does not see the scratch buffers inside fused kernels.
    """
    meter = _LiveStorages()
    with meter:
        result = run()
    return meter.peak, result


@dataclass(frozen=True)
class MemoryCell:
    """One measured run: batch size, peak bytes, and the bytes the batch's cache allocated (all rows)."""

    batch: int
    peak_bytes: int
    cache_bytes: int


@dataclass(frozen=True)
class MemoryCheck:
    """The peak-memory model fitted on some cells and checked on the others (RIPE Sec. 3.5, Figure 3)."""

    fit: PeakMemoryFit  # bytes: cache_per_seq, o0, o1
    fitted: tuple[int, ...]  # batch sizes of the fit
    held_out: tuple[int, ...]  # batch sizes checked
    held_out_errors: np.ndarray  # (model - measured) / measured on the held-out cells
    budget: float  # bytes
    b_max: int  # largest batch with a predicted peak within the budget

    @property
    def max_held_out_error(self) -> float:
        return float(np.max(np.abs(self.held_out_errors))) if self.held_out_errors.size else float("nan")


def check_memory_model(cells: Sequence[MemoryCell], fit_on: Sequence[int], budget: float) -> MemoryCheck:
    """Fit o0, o1 on the cells whose batch is in ``fit_on``, predict the others, and find B_max under ``budget``.

    All cells must hold the same cache per sequence (same capacity), which is the model's cache term.
    """
    if not cells:
        raise ValueError("cells must hold at least one measured MemoryCell")
    per_seq = {cell.cache_bytes / cell.batch for cell in cells}
    if len(per_seq) != 1:
        raise ValueError(f"cells must share one cache size per sequence (same capacity), got {sorted(per_seq)}")
    batches = [cell.batch for cell in cells]
    unknown = sorted(set(fit_on) - set(batches))
    if unknown:
        raise ValueError(f"fit_on must name measured batch sizes {sorted(set(batches))}, got unknown {unknown}")
    if not budget > 0:
        raise ValueError(f"budget must be > 0 bytes, got {budget}")
    train = [c for c in cells if c.batch in fit_on]
    test = [c for c in cells if c.batch not in fit_on]
    fit = fit_peak_memory([c.batch for c in train], [c.peak_bytes for c in train], per_seq.pop())
    errors = fit.relative_errors([c.batch for c in test], [c.peak_bytes for c in test]) if test else np.array([])
    return MemoryCheck(fit=fit, fitted=tuple(c.batch for c in train), held_out=tuple(c.batch for c in test),
                       held_out_errors=errors, budget=float(budget),
                       b_max=b_max(budget, fit.o0, fit.o1, fit.cache_per_seq))
