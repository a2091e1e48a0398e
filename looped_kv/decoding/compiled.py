"""A compiled greedy decode step: static shapes over the preallocated cache (gpt-fast style).

Each step processes one token per row at position L_b. Every attention call reads the whole capacity of
the plane the policy keeps for it with the mask j < L_b, plus the token's own key and value, in one
softmax; so every tensor has the same shape at every step, and torch.compile traces the step once (on a
GPU its ``reduce-overhead`` mode can replay it as a CUDA graph). The traced step writes nothing: it
returns the new keys and values of every site, and the cache stores them afterwards, each kept plane
from the last loop that writes it (:func:`~looped_kv.runtime.cache.writes_in_own_plane`). Writing into
the cache's planes inside the graph would make the compiler copy whole planes at every call. The eager
decoders read [0, L + 1) of the same planes; both give the same tokens (tested in float64).
"""

from __future__ import annotations

import torch
from torch import Tensor

from looped_kv.runtime.attention import Site, attend_segments
from looped_kv.runtime.cache import PlaneCache, writes_in_own_plane
from looped_kv.runtime.model import LoopedLM, check_finite

COMPILABLE = ("full", "deepest", "k-deepest", "share")


class StaticStepRouter:
    """Router of one token per row at ``positions`` (B, 1): reads the whole capacity, records what it would write."""

    def __init__(self, cache: PlaneCache, positions: Tensor) -> None:
        self.cache = cache
        j = torch.arange(cache.capacity, device=positions.device)
        self.prefix = (j < positions[:, :, None])[:, None]  # (B, 1, 1, capacity)
        self.new: dict[Site, tuple[Tensor, Tensor]] = {}

    def attend(self, site: Site, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        plane = self.cache.policy.plane(site.loop) if site.stage == "core" else None
        keys, values = self.cache.plane_tensor(0, site, plane), self.cache.plane_tensor(1, site, plane)
        self.new[site] = (k, v)
        return attend_segments(q, [(keys, values, self.prefix), (k, v, None)])


def _forward(model: LoopedLM, cache: PlaneCache, tokens: Tensor, lengths: Tensor,
             num_loops: int) -> tuple[Tensor, Tensor, Tensor]:
    """One greedy step of B rows over the whole preallocated cache (the function torch.compile traces).

    Returns the logits (B, 1, V), the new keys/values of the edge layers (2, n_edge, B, H_kv, D) and of every
    kept core plane, from the last loop that writes it (2, n_core, n_kept, B, H_kv, D).
    """
    positions = lengths[:, None]
    router = StaticStepRouter(cache, positions)
    embedded = model.embed(tokens, positions, router)
    state = embedded if model.config.looped_stack else model._states[positions]  # Ouro starts from the embedding
    for r in range(1, num_loops + 1):
        state = model.loop(state, embedded, positions, router, r)
    logits = model.readout(state, positions, router)
    cfg, policy = model.config, cache.policy
    edges = [Site("prelude", i) for i in range(cfg.n_prelude)] + [Site("coda", i) for i in range(cfg.n_coda)]
    writer = {policy.plane(r): r for r in range(1, num_loops + 1)}  # the last loop writing each kept plane
    core = [[Site("core", layer, writer[p]) for p in policy.kept] for layer in range(cfg.n_core)]
    B, H_kv, D = tokens.shape[0], cfg.n_kv_heads, cfg.head_dim
    new_edges = torch.stack([torch.stack([router.new[s][which][:, :, 0] for s in edges]) if edges  # Ouro has none
                             else embedded.new_empty(0, B, H_kv, D) for which in (0, 1)])
    new_core = torch.stack([torch.stack([torch.stack([router.new[s][which][:, :, 0] for s in row]) for row in core])
                            for which in (0, 1)])
    return logits, new_edges, new_core


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
        cache = self.cache
        if cache.max_length >= cache.capacity:
            raise ValueError(f"cache capacity {cache.capacity} exceeded")
        logits, new_edges, new_core = self._step(self.model, cache, tokens, cache.lengths, self.num_loops)
        if self.model.dtype == torch.float16:
            check_finite(logits, f"the logits of the compiled step at position {cache.max_length}")
        rows, index = torch.arange(cache.batch, device=tokens.device), cache.lengths
        for which in (0, 1):  # advanced indices (rows, index) first: (B, n_edge, H, D) and (B, n_core, n_kept, H, D)
            cache.edge[which][:, rows, :, index] = new_edges[which].permute(1, 0, 2, 3)
            cache.core[which][:, :, rows, :, index] = new_core[which].permute(2, 0, 1, 3, 4)
        cache.advance(1)
        return logits
