"""A compiled greedy decode step: static shapes over the preallocated cache (gpt-fast style).

Each step processes one token per row at position L_b. Every attention call writes the token's
keys/values at L_b of the plane it reads (:func:`~looped_kv.runtime.cache.writes_in_own_plane`) and
attends over the whole capacity with the mask j <= L_b, so every tensor has the same shape at every
step: torch.compile traces the step once, and on a GPU its ``reduce-overhead`` mode can replay it
as a CUDA graph. The eager decoders read only [0, L + 1); both give the same tokens (tested).
"""

from __future__ import annotations

import torch
from torch import Tensor

from looped_kv.runtime.attention import Site, attend
from looped_kv.runtime.cache import PlaneCache, writes_in_own_plane
from looped_kv.runtime.model import LoopedLM

COMPILABLE = ("full", "deepest", "k-deepest", "share")


class StaticStepRouter:
    """Router of one token per row at ``positions`` (B, 1): write at L_b in place, read the whole capacity."""

    def __init__(self, cache: PlaneCache, positions: Tensor) -> None:
        self.cache, self.positions = cache, positions
        j = torch.arange(cache.capacity, device=positions.device)
        self.mask = (j <= positions[:, :, None])[:, None]  # (B, 1, 1, capacity)
        self.rows = torch.arange(positions.shape[0], device=positions.device)

    def attend(self, site: Site, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        plane = self.cache.policy.plane(site.loop) if site.stage == "core" else None
        keys, values = self.cache.plane_tensor(0, site, plane), self.cache.plane_tensor(1, site, plane)
        index = self.positions[:, 0]
        keys[self.rows, :, index] = k[:, :, 0]
        values[self.rows, :, index] = v[:, :, 0]
        return attend(q, keys, values, self.mask)


def _forward(model: LoopedLM, cache: PlaneCache, tokens: Tensor, lengths: Tensor, num_loops: int) -> Tensor:
    """One greedy step of B rows over the whole preallocated cache (the function torch.compile traces)."""
    positions = lengths[:, None]
    router = StaticStepRouter(cache, positions)
    embedded = model.embed(tokens, positions, router)
    state = model._states[positions]
    for r in range(1, num_loops + 1):
        state = model.loop(state, embedded, positions, router, r)
    return model.readout(state, positions, router)


#: One compiled step per compile mode. The cache is an argument, so its planes enter the graph as inputs
#: guarded by shape and dtype, not by identity: every generation with the same model, batch, capacity and
#: R reuses the traced step instead of compiling again.
_COMPILED: dict[str | None, object] = {}


class CompiledStep:
    """``step(tokens (B, 1)) -> logits (B, 1, V)``: a torch.compile'd greedy decode step on ``cache``."""

    def __init__(self, model: LoopedLM, cache: PlaneCache, num_loops: int, mode: str | None = None) -> None:
        if not writes_in_own_plane(cache.policy):
            raise ValueError(f"compile=True needs a cache policy whose planes are read where they are written, one of "
                             f"{COMPILABLE}; got {cache.policy.name}")
        self.model, self.cache, self.num_loops = model, cache, num_loops
        model._state_table(cache.capacity)  # built before tracing: the step only gathers from it
        if mode not in _COMPILED:
            _COMPILED[mode] = torch.compile(_forward, dynamic=False, fullgraph=True, mode=mode)
        self._step = _COMPILED[mode]

    def __call__(self, tokens: Tensor) -> Tensor:
        if self.cache.max_length >= self.cache.capacity:
            raise ValueError(f"cache capacity {self.cache.capacity} exceeded")
        logits = self._step(self.model, self.cache, tokens, self.cache.lengths, self.num_loops)
        self.cache.advance(1)
        return logits
