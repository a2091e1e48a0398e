"""Greedy full-depth autoregressive decoding: the baseline of every ratio in the book."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from looped_kv.decoding.core import Generation, Rows, check_prompts, new_cache, prefill_rows, step
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy


@torch.no_grad()
def greedy(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int], *,
           policy: CachePolicy, eos: int | None = None, capacity: int | None = None, compile: bool = False,
           progress: bool = False) -> Generation:
    """Greedy decoding of B prompts under a cache policy; each row emits what it would emit alone.

    A row stops after ``max_new_tokens`` (one per row, or one for all) or after emitting ``eos``.
    ``capacity`` preallocates the cache for that many positions per row (default: the longest need).
    ``compile=True`` runs a torch.compile'd decode step over the whole preallocated cache (static
    shapes, as CUDA graphs need; :mod:`looped_kv.decoding.compiled`).
    """
    prompts, budgets = check_prompts(model, input_ids, max_new_tokens)
    need = max(len(p) + b for p, b in zip(prompts, budgets, strict=True))
    if capacity is not None and capacity < need:
        raise ValueError(f"capacity must be >= {need} (longest prompt + max_new_tokens), got {capacity}")
    R = policy.num_loops
    rows = Rows(prompts, budgets, eos, progress, "greedy")
    cache = new_cache(model, policy, len(prompts), capacity or need)
    if compile:
        from looped_kv.decoding.compiled import CompiledStep

        decode_step = CompiledStep(model, cache, R)
    else:
        decode_step = None
    pending = prefill_rows(model, cache, prompts, R)
    rows.emit(list(pending))
    passes = 1
    while True:
        (pending,) = rows.drop_stopped(cache, pending)
        if not rows.active:
            break
        logits = decode_step(pending) if decode_step is not None else step(model, cache, pending, R)
        pending = logits[:, -1:].argmax(-1)
        rows.emit(list(pending))
        passes += 1
    return rows.result(cache, passes, eos)
