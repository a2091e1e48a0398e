"""Plane caches in preallocated tensors, and the block pass that reads and writes them.

A :class:`PlaneCache` holds what its :class:`~looped_kv.runtime.policy.CachePolicy` can read:

* ``edge``: one plane per prelude and coda layer, every position;
* ``core``: the policy's kept planes, every position (all R for the full cache, plane R
  for the deepest-plane cache, ...);
* ``ring``: the other planes for the W most recent positions, a ring indexed by
  position mod W (RIPE's window; a position leaving it drops its shallow planes);
* ``sink``: the other planes for the first ``sinks`` positions.

Everything is allocated once and written by index. :class:`BlockPass` is the one
primitive every decoder uses: it runs a block of new tokens against the cache under a
read policy, reading earlier uncommitted tokens from a :class:`BlockBuffer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from looped_kv.runtime.attention import Site, attend
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.policy import ALIGNED, CachePolicy, PrefixReads, read_planes


def _empty(*shape: int, like: dict) -> Tensor:
    return torch.zeros(*shape, **like)


@dataclass
class Segment:
    """Prefix keys/values read by a block, and which (query, position) pairs read them."""

    k: Tensor
    v: Tensor
    mask: Tensor | None  # (n_query, n_positions) bool, None = all


class PlaneCache:
    """KV planes of a looped model under one cache policy, preallocated for ``capacity`` positions."""

    def __init__(self, config: LoopedConfig, policy: CachePolicy, *, batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        if capacity > config.block_size:
            raise ValueError(f"capacity ({capacity}) exceeds the model's context (block_size {config.block_size})")
        self.config, self.policy, self.capacity = config, policy, capacity
        self.length = 0
        like = dict(dtype=dtype, device=device)
        H, D, n_core = config.n_kv_heads, config.head_dim, config.n_core
        self.kept_slot = {p: i for i, p in enumerate(policy.kept)}
        self.extra_slot = {p: i for i, p in enumerate(policy.extra)}
        n_edge = config.n_prelude + config.n_coda
        self.edge = [_empty(n_edge, batch, H, capacity, D, like=like) for _ in range(2)]
        self.core = [_empty(n_core, len(policy.kept), batch, H, capacity, D, like=like) for _ in range(2)]
        extra = len(policy.extra)
        ring = min(policy.window, capacity) if extra else 0  # positions p < capacity <= W never wrap
        sinks = min(policy.sinks, capacity) if extra else 0
        self.ring = [_empty(n_core, extra, batch, H, ring, D, like=like) for _ in range(2)]
        self.sink = [_empty(n_core, extra, batch, H, sinks, D, like=like) for _ in range(2)]

    # -- accounting ----------------------------------------------------------------------------
    def _tensors(self) -> list[Tensor]:
        return [*self.edge, *self.core, *self.ring, *self.sink]

    @property
    def allocated_bytes(self) -> int:
        """Bytes actually allocated (equals the memory equations at L = capacity)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def nbytes(self) -> int:
        """Bytes holding the ``length`` stored positions: Eq. (3) / Eq. (10) of the RIPE paper at L = length."""
        def per_position(tensors: list[Tensor]) -> int:
            return sum(t[..., :1, :].numel() * t.element_size() for t in tensors)

        L = self.length
        return (per_position([*self.edge, *self.core]) * L + per_position(self.ring) * min(self.policy.window, L)
                + per_position(self.sink) * min(self.policy.sinks, L))

    # -- reading -------------------------------------------------------------------------------
    def edge_index(self, site: Site) -> int:
        return site.layer if site.stage == "prelude" else self.config.n_prelude + site.layer

    def fetch(self, which: int, layer: int, plane: int, start: int, stop: int) -> Tensor:
        """Keys (which=0) or values (1) of core ``layer`` at ``plane`` for positions [start, stop)."""
        if plane in self.kept_slot:
            return self.core[which][layer, self.kept_slot[plane], :, :, start:stop]
        if plane not in self.extra_slot:
            raise ValueError(f"plane {plane} is not stored by cache policy {self.policy.name} "
                             f"(kept planes {self.policy.kept})")
        slot, W, S = self.extra_slot[plane], self.policy.window, self.policy.sinks
        if stop <= S:
            return self.sink[which][layer, slot, :, :, start:stop]
        if start >= self.length - W:
            index = torch.arange(start, stop, device=self.ring[which].device) % W
            return self.ring[which][layer, slot, :, :, index]
        raise ValueError(f"positions [{start}, {stop}) at plane {plane} left the window of {self.policy.name}")

    def segments(self, site: Site, query_positions: Tensor, reads: PrefixReads = ALIGNED) -> list[Segment]:
        """What a block with the given query positions reads from the cache at this site."""
        L = self.length
        if L == 0:
            return []
        if site.stage != "core":
            i = self.edge_index(site)
            return [Segment(self.edge[0][i, :, :, :L], self.edge[1][i, :, :, :L], None)]
        layer, policy = site.layer, self.policy
        (key_base, value_base), own = read_planes(policy, reads, site.loop)
        if own is None:
            return [Segment(self.fetch(0, layer, key_base, 0, L), self.fetch(1, layer, value_base, 0, L), None)]
        key_own, value_own = own
        t = query_positions.view(-1, 1)
        j = torch.arange(L, device=t.device).view(1, -1)
        full_depth = (t - j <= policy.window) | (j < policy.sinks)
        segments = [Segment(self.fetch(0, layer, key_base, 0, L), self.fetch(1, layer, value_base, 0, L), ~full_depth)]
        start = max(policy.sinks, L - policy.window)
        if start < L:
            segments.append(Segment(self.fetch(0, layer, key_own, start, L), self.fetch(1, layer, value_own, start, L),
                                    full_depth[:, start:]))
        sinks = min(policy.sinks, L)
        if sinks:
            segments.append(Segment(self.fetch(0, layer, key_own, 0, sinks), self.fetch(1, layer, value_own, 0, sinks),
                                    None))
        return segments

    # -- writing -------------------------------------------------------------------------------
    def write(self, site: Site, positions: range, k: Tensor, v: Tensor) -> None:
        """Store a site's keys/values (B, Hkv, n, D) for absolute ``positions`` under the policy."""
        start, stop = positions.start, positions.stop
        if stop > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded (writing up to position {stop})")
        if site.stage != "core":
            i = self.edge_index(site)
            self.edge[0][i, :, :, start:stop], self.edge[1][i, :, :, start:stop] = k, v
            return
        layer, plane = site.layer, site.loop
        if plane in self.kept_slot:
            slot = self.kept_slot[plane]
            self.core[0][layer, slot, :, :, start:stop], self.core[1][layer, slot, :, :, start:stop] = k, v
            return
        if plane not in self.extra_slot:
            return  # a plane this policy never reads
        slot, W, S = self.extra_slot[plane], self.policy.window, self.policy.sinks
        if start < S:
            n = min(stop, S) - start
            self.sink[0][layer, slot, :, :, start:start + n] = k[:, :, :n]
            self.sink[1][layer, slot, :, :, start:start + n] = v[:, :, :n]
        if W:
            keep = min(W, stop - start)  # only the last W positions survive in the ring
            index = torch.arange(stop - keep, stop, device=k.device) % W
            self.ring[0][layer, slot].index_copy_(2, index, k[:, :, -keep:])
            self.ring[1][layer, slot].index_copy_(2, index, v[:, :, -keep:])

    def commit(self, buffer: BlockBuffer, count: int) -> None:
        """Append the first ``count`` block tokens held in ``buffer`` (their planes) to the cache."""
        positions = range(self.length, self.length + count)
        for site in buffer.sites():
            k, v = buffer.read(site, 0, count)
            self.write(site, positions, k, v)
        self.length += count


class BlockBuffer:
    """Keys/values of uncommitted block tokens (drafts, a verification block), every site, every loop."""

    def __init__(self, config: LoopedConfig, num_loops: int, *, batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        like = dict(dtype=dtype, device=device)
        H, D = config.n_kv_heads, config.head_dim
        self.config, self.num_loops, self.capacity = config, num_loops, capacity
        self.edge = [_empty(config.n_prelude + config.n_coda, batch, H, capacity, D, like=like) for _ in range(2)]
        self.core = [_empty(config.n_core, num_loops, batch, H, capacity, D, like=like) for _ in range(2)]

    def _slot(self, which: int, site: Site) -> Tensor:
        if site.stage == "core":
            if not 1 <= site.loop <= self.num_loops:
                raise ValueError(f"loop {site.loop} outside the buffer's 1..{self.num_loops}")
            return self.core[which][site.layer, site.loop - 1]
        index = site.layer if site.stage == "prelude" else self.config.n_prelude + site.layer
        return self.edge[which][index]

    def write(self, site: Site, offset: int, k: Tensor, v: Tensor) -> None:
        n = k.shape[2]
        if offset + n > self.capacity:
            raise ValueError(f"block buffer capacity {self.capacity} exceeded ({offset + n} tokens)")
        self._slot(0, site)[:, :, offset:offset + n] = k
        self._slot(1, site)[:, :, offset:offset + n] = v

    def read(self, site: Site, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return self._slot(0, site)[:, :, start:stop], self._slot(1, site)[:, :, start:stop]

    def sites(self) -> list[Site]:
        cfg = self.config
        return ([Site("prelude", i) for i in range(cfg.n_prelude)] + [Site("coda", i) for i in range(cfg.n_coda)]
                + [Site("core", layer, r) for layer in range(cfg.n_core) for r in range(1, self.num_loops + 1)])


class BlockPass:
    """Router for one block of new tokens at ``positions`` (absolute, consecutive).

    Each attention call reads, in one softmax (DAS Eq. 2-3): the cache's prefix under the
    cache policy as modified by ``reads``; the ``offset`` uncommitted tokens already in
    ``buffer`` at the same site (earlier drafts of this block); and the block itself,
    causally. The block's own keys/values are then stored: into the cache (``store="cache"``,
    prefill and sequential steps), into the buffer at ``offset`` (``store="buffer"``, drafts
    and verification), or nowhere (``store=None``).
    """

    def __init__(self, cache: PlaneCache | None, positions: range, *, reads: PrefixReads = ALIGNED,
                 buffer: BlockBuffer | None = None, offset: int = 0, store: str | None = "cache",
                 softmax_dtype: torch.dtype | None = None, record: dict | None = None) -> None:
        if store not in ("cache", "buffer", None):
            raise ValueError(f"store must be 'cache', 'buffer' or None, got {store!r}")
        if store == "cache" and (cache is None or positions.start != cache.length):
            raise ValueError("store='cache' needs a cache whose length equals the block's first position")
        self.cache, self.positions, self.reads = cache, positions, reads
        self.buffer, self.offset, self.store = buffer, offset, store
        self.softmax_dtype, self.record = softmax_dtype, record
        self.query_positions: Tensor | None = None

    def attend(self, site: Site, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[2]
        if self.query_positions is None:
            self.query_positions = torch.arange(self.positions.start, self.positions.stop, device=q.device)
        segments = self.cache.segments(site, self.query_positions, self.reads) if self.cache is not None else []
        keys, values, masks = [], [], []
        for seg in segments:
            keys.append(seg.k)
            values.append(seg.v)
            masks.append(seg.mask if seg.mask is not None else torch.ones(n, seg.k.shape[2], dtype=torch.bool,
                                                                          device=q.device))
        if self.offset:
            bk, bv = self.buffer.read(site, 0, self.offset)
            keys.append(bk)
            values.append(bv)
            masks.append(torch.ones(n, self.offset, dtype=torch.bool, device=q.device))
        keys.append(k)
        values.append(v)
        masks.append(torch.ones(n, n, dtype=torch.bool, device=q.device).tril())
        if len(keys) == 1:
            out = attend(q, k, v, causal=True, softmax_dtype=self.softmax_dtype)
        else:
            out = attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), torch.cat(masks, dim=1),
                         softmax_dtype=self.softmax_dtype)
        if self.record is not None:
            self.record[site] = (k, v)
        if self.store == "cache":
            self.cache.write(site, self.positions, k, v)
        elif self.store == "buffer":
            self.buffer.write(site, self.offset, k, v)
        return out
