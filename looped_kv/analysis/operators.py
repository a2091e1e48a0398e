"""The operators a one-token decode step dispatches: what a step costs where every call is small.

At a small width on a CPU, an eager step's time is its number of operator calls, not the bytes they move. Under
every cache a one-token step reads L + 1 positions per loop (RIPE: the ring's W newest at plane r and the older ones
at plane R), so what sets RIPE's and the sinks cache's eager speed against the full cache's is the operators they
add and save: the copies that line their ring and sinks up in front of the kept plane for one fused read
(:meth:`~looped_kv.runtime.cache.CachePass.attend_gapped`), and the slices of that read, made once per layer and
pass where the full cache slices each loop's plane. :func:`step_operators` counts them at the dispatcher.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pandas as pd
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from looped_kv.decoding.generate import generate
from looped_kv.decoding.settings import Greedy
from looped_kv.runtime.model import LoopedLM

#: The operator of every cache write and scratch copy: what RIPE and the sinks cache add to a step.
COPY = "aten.copy_.default"
#: The operator that cuts a read out of its plane: what RIPE and the sinks cache make once per layer and pass, and the
#: full cache at every loop.
SLICE = "aten.slice.Tensor"


class _Count(TorchDispatchMode):
    """Every ATen operator call under the mode, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def step_operators(model: LoopedLM, input_ids: Tensor, config: Greedy, steps: int = 4) -> pd.Series:
    """The ATen operators one step of ``config``'s greedy decoding dispatches, by name (mean per step): counted over
    a generation of 2 + ``steps`` tokens less one of 2 tokens, so the prefill and the first step cancel; every row
    emits its budget (end-of-text does not stop it). Eager only: a compiled step's operators are its kernels."""
    if not isinstance(config, Greedy):
        raise ValueError(f"config must be a Greedy decoding (one token per step), got {type(config).__name__}")
    if config.compile:
        raise ValueError("config: compile must be False (a compiled step's operators are fused kernels)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    counts = []
    with torch.no_grad():
        generate(model, input_ids, replace(config, max_new_tokens=2, stop_at_eos=False))  # warm-up: lazy views
        for budget in (2, 2 + steps):
            with _Count() as count:
                generate(model, input_ids, replace(config, max_new_tokens=budget, stop_at_eos=False))
            counts.append(count.calls)
    short, long = counts
    return pd.Series({name: (long[name] - short[name]) / steps for name in sorted(long | short)}, name="per step")
