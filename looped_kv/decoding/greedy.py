"""Greedy full-depth autoregressive decoding: the baseline of every ratio in the book (the loop with no drafter)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from looped_kv.decoding.loop import Observer, decode_rows
from looped_kv.decoding.result import Generation
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy


@torch.no_grad()
def greedy(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int], *,
           policy: CachePolicy, eos: int | None = None, compile: bool = False, progress: bool = False,
           observer: Observer | None = None) -> Generation:
    """Greedy decoding of B prompts under a cache policy; each row emits what it would emit alone.

    A row stops after ``max_new_tokens`` (one per row, or one for all) or after emitting ``eos``.
    ``compile=True`` runs a torch.compile'd decode step over the whole preallocated cache (static
    shapes, as CUDA graphs need; :mod:`looped_kv.decoding.compiled`). ``observer`` sees every step.
    """
    return decode_rows(model, input_ids, max_new_tokens, policy=policy, eos=eos, compile=compile, progress=progress,
                       observer=observer)
