"""Bitwise reruns (RIPE Section 5.5): :func:`bitwise_rerun` reruns a computation (e.g. a replay) and reports
whether the outputs are bitwise identical, the check RIPE's batches 4 and 6b ran; the settings that make them so
are :func:`looped_kv.runtime.measurement.measurement_mode`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class RerunReport:
    """Two runs of one computation compared tensor by tensor, bit for bit."""

    identical: bool  # every tensor of the output bitwise equal
    equal_fraction: float  # fraction of elements that are bitwise equal
    max_abs_diff: float
    tensors: int  # tensors compared


def _tensors(output: Any) -> list[Tensor]:
    """Every tensor in an output: a tensor, a dataclass (e.g. Replay, Generation), a mapping or a sequence."""
    if isinstance(output, Tensor):
        return [output]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [t for f in dataclasses.fields(output) for t in _tensors(getattr(output, f.name))]
    if isinstance(output, dict):
        return [t for value in output.values() for t in _tensors(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in _tensors(value)]
    return []


def _bitwise_equal(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise bit equality (NaN payloads included), as a bool tensor of ``a``'s number of elements."""
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    width = a.element_size()
    if a.is_floating_point() or a.is_complex():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if width in bits:
            return a.view(bits[width]) == b.view(bits[width])
        return (a.view(torch.uint8).view(-1, width) == b.view(torch.uint8).view(-1, width)).all(-1)
    return a == b


def bitwise_rerun(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> RerunReport:
    """Call ``fn(*args, **kwargs)`` twice and compare every output tensor bitwise (RIPE Section 5.5).

    Typical use: ``bitwise_rerun(replay, model, ids, 32)``. Non-tensor parts of the output (wall
    times, say) are ignored. Raises ValueError when the output holds no tensor.
    """
    first, second = _tensors(fn(*args, **kwargs)), _tensors(fn(*args, **kwargs))
    if not first:
        raise ValueError("fn must return tensors (a tensor, or a dataclass, dict or sequence holding them)")
    if len(first) != len(second) or any(a.shape != b.shape or a.dtype != b.dtype
                                        for a, b in zip(first, second, strict=True)):
        return RerunReport(identical=False, equal_fraction=0.0, max_abs_diff=float("inf"), tensors=len(first))
    equal = total = 0
    max_diff = 0.0
    for a, b in zip(first, second, strict=True):
        same = _bitwise_equal(a, b)
        equal, total = equal + int(same.sum()), total + same.numel()
        if a.numel() and not bool(same.all()):
            max_diff = max(max_diff, float((a.detach().double() - b.detach().double()).abs().nan_to_num(0.0).max()))
    return RerunReport(identical=equal == total, equal_fraction=equal / total if total else 1.0,
                       max_abs_diff=max_diff, tensors=len(first))
