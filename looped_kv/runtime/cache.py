"""Plane caches in preallocated tensors, read in place, and the cache pass every decoder runs.

A :class:`PlaneCache` holds, for B rows of one cache policy (:mod:`looped_kv.runtime.policy`):

* ``edge``: one plane per prelude and coda layer, every position;
* ``core``: the policy's kept planes, every position (all R for the full cache, plane R for
  the deepest-plane cache, ...);
* ``ring``: the other planes for each row's W + 1 most recent positions, slot = position mod (W + 1)
  (RIPE's window, Eq. 9: a position leaving it drops its shallow planes; the one slot beyond the window is the
  next position's, where a one-token pass writes it before it is committed, as block passes write past a row's
  length);
* ``sink``: the other planes for the first ``sinks`` positions (with the ring, views of one store per plane,
  :attr:`PlaneCache.extra_base`: the sinks' slots, then the ring's).

Everything is allocated once, with one committed length per row, and written by index through one
method, :meth:`PlaneCache.write`: the cache passes, :meth:`PlaneCache.commit` (from a
:class:`BlockBuffer`), the compiled decoding steps and the analysis replays all store through it.

A cache pass routes n new tokens per row (B, n) through every attention call of the model,
and is two things: what each call *reads* (in one softmax, DAS Eq. 2-3: the row's committed prefix under
the cache policy as modified by the prefix reads, the uncommitted tokens of the block, i.e. earlier
drafts, at the same loop from a :class:`BlockBuffer`, and the block itself causally) and where it
*writes* the block's keys and values (the cache, the buffer, or nowhere). :class:`CachePass` is the eager
pass: its reads are views of the committed prefix (no concatenation), its masks are built once per block
and, where the policy lets it, the block is written into the plane its prefix is read from and the call is
a single fused attention over that plane: for every policy at prelude and coda layers, and in the core
for policies whose planes are each last written by their own loop (full, deepest, k-deepest, share) under
aligned reads. Under RIPE and the sinks policy a one-token pass writes itself into its ring slot, then copies the
sinks' and the ring's plane (one copy of keys, one of values) into S + W + 1 scratch slots in front of the kept plane
(:attr:`PlaneCache.gap`) and reads them with it in one fused attention as well.
:class:`StaticCachePass` is the pass of a compiled step: the same reads over the whole
preallocated tensors with masks computed on the device, so that every tensor has one shape at every call;
:class:`PrefillPass` is a compiled run's prefill, the prompts causally into the empty cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from looped_kv.runtime.attention import Site, additive_mask, attend, attend_segments
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.policy import ALIGNED, CachePolicy, PrefixReads, read_planes

STORES = ("cache", "buffer", None)


@dataclass(frozen=True)
class _Scatter:
    """(row, block column) entries of a block and the slot each one is written to.

    ``runs`` (the fast path, every row alike): (slot, column, length) slices, each storing columns column..column +
    length - 1 at slots slot..slot + length - 1. ``valid`` (compiled steps): entries where it is False write back
    what their (clamped) slot holds.
    """

    rows: Tensor | None  # None with runs
    cols: Tensor | None
    index: Tensor | None
    runs: tuple[tuple[int, int, int], ...] | None = None
    valid: Tensor | None = None


def _slices(*runs: tuple[int, int, int]) -> _Scatter:
    return _Scatter(None, None, None, runs=runs)


@dataclass(frozen=True)
class RowWrites:
    """Where the stored entries of a block go: every position, the ring (position mod (W + 1)), the sinks."""

    main: _Scatter
    ring: _Scatter
    sink: _Scatter


def _shifted(scatter: _Scatter, by: int) -> _Scatter:
    """``scatter`` with every slot ``by`` further on (the ring's entries in the store it shares with the sinks)."""
    if not by:
        return scatter
    if scatter.runs is not None:
        return _slices(*((slot + by, column, length) for slot, column, length in scatter.runs))
    return _Scatter(scatter.rows, scatter.cols, scatter.index + by, valid=scatter.valid)


def _put(dest: Tensor, scatter: _Scatter, src: Tensor) -> None:
    """dest[..., row, :, index, :] = src[..., row, :, col, :] for every entry: dest (..., B, H, P, D) and src
    (..., B, H, n, D) with the same leading dimensions (none for one site, layers and planes for a whole store)."""
    if scatter.runs is not None:
        for slot, column, length in scatter.runs:
            dest.narrow(-2, slot, length).copy_(
                src if column == 0 and src.shape[-2] == length else src.narrow(-2, column, length))
        return
    lead = (slice(None),) * (dest.dim() - 4)
    values = src[(*lead, scatter.rows, slice(None), scatter.cols)]  # (entries, ..., H, D)
    target = (*lead, scatter.rows, slice(None), scatter.index)
    if scatter.valid is not None:
        valid = scatter.valid.reshape(-1, *([1] * (values.dim() - 1)))
        values = torch.where(valid, values, dest[target])
    dest[target] = values


class PlaneCache:
    """KV planes of B rows under one cache policy, preallocated for ``capacity`` positions per row."""

    def __init__(self, config: LoopedConfig, policy: CachePolicy, *, batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if capacity > config.block_size:
            raise ValueError(f"capacity ({capacity}) exceeds the model's context (block_size {config.block_size})")
        self.config, self.policy, self.capacity = config, policy, capacity
        like = dict(dtype=dtype, device=device)
        H, D, n_core = config.n_kv_heads, config.head_dim, config.n_core
        self.kept_slot = {p: i for i, p in enumerate(policy.kept)}
        self.extra_slot = {p: i for i, p in enumerate(policy.extra)}
        n_edge = config.n_prelude + config.n_coda
        n_extra = len(policy.extra)
        # the window's W positions and the next one (positions p < capacity <= W never wrap)
        self.ring_size = min(policy.window + 1, capacity) if n_extra else 0
        self.sink_size = min(policy.sinks, capacity) if n_extra else 0
        # RIPE and sinks (one kept plane, a ring and/or sinks): S + W + 1 scratch slots before position 0 of the kept
        # plane, where a one-token pass copies the sinks' and the ring's plane (itself included) to read them beside
        # the kept plane in one fused call
        full_depth = self.sink_size + self.ring_size
        self.gap = full_depth if full_depth and len(policy.kept) == 1 else 0
        self.edge = [torch.zeros(n_edge, batch, H, capacity, D, **like) for _ in range(2)]
        self.core_base = [torch.zeros(n_core, len(policy.kept), batch, H, self.gap + capacity, D, **like)
                          for _ in range(2)]
        self.core = [t.narrow(-2, self.gap, capacity) for t in self.core_base]  # position p at index p
        # the sinks' S slots, then the ring's W + 1, of each extra plane side by side: the order of the scratch slots,
        # so that a one-token pass copies both in one call
        self.extra_base = [torch.zeros(n_core, n_extra, batch, H, full_depth, D, **like) for _ in range(2)]
        self._views: dict[tuple, Tensor] = {}  # plane_tensor's views, made once per site (the hot path)
        # the storage the memory equations count at capacity (Eq. 3 / 10), and RIPE's scratch beside it: the slots
        # before the kept plane and the ring's slot beyond the window
        def nbytes(tensors: list[Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        spare = self.ring_size - min(policy.window, capacity) if n_extra else 0  # the ring's slot past the window
        spare_bytes = nbytes([t.narrow(-2, 0, spare) for t in self.ring])
        self.allocated_bytes = nbytes(self._tensors()) - spare_bytes
        self.scratch_bytes = nbytes(self.core_base) - nbytes(self.core) + spare_bytes
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.edge[0].device)
        self.host_lengths = [0] * batch  # the same, on the host: read without a device sync

    def extra_slots(self, kind: str) -> tuple[int, int]:
        """Where ``kind`` ("sinks" or "ring") sits in each plane of :attr:`extra_base`: (first slot, slots)."""
        return (0, self.sink_size) if kind == "sinks" else (self.sink_size, self.ring_size)

    @property
    def sink(self) -> list[Tensor]:
        """The sinks' slots of every extra plane, keys and values: views made at each use, so that a compiled step
        takes the store as its one input. Writes go into the store itself (:meth:`write`)."""
        return [t.narrow(-2, *self.extra_slots("sinks")) for t in self.extra_base]

    @property
    def ring(self) -> list[Tensor]:
        """The ring's slots of every extra plane, keys and values: views made at each use (see :attr:`sink`)."""
        return [t.narrow(-2, *self.extra_slots("ring")) for t in self.extra_base]

    # -- shape and accounting ------------------------------------------------------------------
    def _tensors(self) -> list[Tensor]:
        return [*self.edge, *self.core, *self.ring, *self.sink]

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    @property
    def length(self) -> int:
        """The committed length, when every row has the same one."""
        if len(set(self.host_lengths)) > 1:
            raise ValueError(f"rows have different lengths {self.host_lengths}; use lengths or host_lengths")
        return self.host_lengths[0]

    @property
    def max_length(self) -> int:
        return max(self.host_lengths)

    def row_bytes(self) -> list[int]:
        """Bytes holding each row's stored positions: Eq. (3) / Eq. (10) of the RIPE paper at L = its length."""
        def per_position(tensors: list[Tensor]) -> int:  # one row (batch dimension -4), one position
            return sum(t.select(-4, 0)[..., :1, :].numel() * t.element_size() for t in tensors if t.shape[-4])

        every, ring, sink = per_position([*self.edge, *self.core]), per_position(self.ring), per_position(self.sink)
        W, S = self.policy.window, self.policy.sinks
        return [every * L + ring * min(W, L) + sink * min(S, L) for L in self.host_lengths]

    @property
    def nbytes(self) -> int:
        """Bytes holding the stored positions of every row (Eq. 3 / Eq. 10 summed over rows)."""
        return sum(self.row_bytes())

    # -- bookkeeping ---------------------------------------------------------------------------
    def advance(self, counts: Tensor | Sequence[int] | int) -> None:
        """Rows have committed ``counts`` more positions (an int for every row, or one per row)."""
        if isinstance(counts, int):
            counts = [counts] * self.batch
        host = counts.tolist() if isinstance(counts, Tensor) else list(counts)
        self.host_lengths = [L + c for L, c in zip(self.host_lengths, host, strict=True)]
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=self.lengths.device)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (increasing indices), compacted in place to the front: no new allocation."""
        rows = list(rows)
        if not rows or rows != sorted(set(rows)) or rows[0] < 0 or rows[-1] >= self.batch:
            raise ValueError(f"rows must be increasing indices in [0, {self.batch}), at least one, got {rows}")
        for tensors in (self.edge, self.core_base, self.extra_base):
            for i, t in enumerate(tensors):  # the batch dimension is -4 in every plane tensor
                for dst, src in enumerate(rows):
                    if dst != src:
                        t.select(-4, dst).copy_(t.select(-4, src))
                tensors[i] = t.narrow(-4, 0, len(rows))
        self.core = [t.narrow(-2, self.gap, self.capacity) for t in self.core_base]
        self._views.clear()
        self.host_lengths = [self.host_lengths[i] for i in rows]
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=self.lengths.device)

    def ring_positions(self, lengths: Tensor | None = None) -> Tensor:
        """(B, ring size): the position each ring slot of each row holds (negative: none yet)."""
        lengths = self.lengths if lengths is None else lengths
        slots = torch.arange(self.ring_size, device=lengths.device)
        last = lengths[:, None] - 1
        return last - (last - slots) % max(self.ring_size, 1)

    # -- reading -------------------------------------------------------------------------------
    def edge_index(self, site: Site) -> int:
        return site.layer if site.stage == "prelude" else self.config.n_prelude + site.layer

    def plane_tensor(self, which: int, site: Site, plane: int | None = None) -> Tensor:
        """Keys (which=0) or values (1), (B, H, capacity, D), of an edge site, or of a kept core plane."""
        if torch.compiler.is_compiling():  # a traced step indexes the planes it was given
            return self._plane_view(which, site, plane)
        key = (which, site.stage, site.layer, plane if site.stage == "core" else None)
        if key not in self._views:
            self._views[key] = self._plane_view(which, site, plane)
        return self._views[key]

    def _plane_view(self, which: int, site: Site, plane: int | None) -> Tensor:
        if site.stage != "core":
            return self.edge[which][self.edge_index(site)]
        if plane not in self.kept_slot:
            raise ValueError(f"plane {plane} is not stored for every position by cache policy {self.policy.name} "
                             f"(kept planes {self.policy.kept})")
        return self.core[which][site.layer, self.kept_slot[plane]]

    def gapped(self, site: Site) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]], tuple[Tensor, Tensor]]:
        """A core site's kept plane with the scratch slots before it (:attr:`gap`: the sinks' S, then the ring's
        W + 1), keys and values (B, H, gap + capacity, D); the (scratch slots, own plane) pairs a one-token pass copies
        at the site's loop (the sinks' and the ring's keys, then values, of its own plane, stored side by side in that
        order: one copy each; none at a kept loop); and the last scratch slot, keys and values, where a kept loop puts
        the token. Views made once per site."""
        key = ("gap", site.layer, site.loop)
        if key not in self._views:
            keys, values = self.core_base[0][site.layer, 0], self.core_base[1][site.layer, 0]
            slot, last = self.extra_slot.get(site.loop), self.gap - 1
            copies = [] if slot is None else [(base.narrow(2, 0, self.gap), extra[site.layer, slot])
                                              for base, extra in zip((keys, values), self.extra_base, strict=True)]
            self._views[key] = (keys, values, copies, (keys.narrow(2, last, 1), values.narrow(2, last, 1)))
        return self._views[key]

    def hole_mask(self, dtype: torch.dtype) -> Tensor:
        """(1, 1, 1, gap + capacity), additive in ``dtype``: a loop r < R's one-token read of rows of one length
        reads every slot but the kept plane's first S (the sinks at plane R; the scratch holds them at plane r).
        Made once per dtype: a pass takes a slice of it, one operator per pass where building the mask took fourteen."""
        key = ("hole", dtype)
        if key not in self._views:
            slots = torch.arange(self.gap + self.capacity, device=self.lengths.device)
            keep = (slots < self.gap) | (slots >= self.gap + self.sink_size)
            self._views[key] = additive_mask(keep, dtype).view(1, 1, 1, -1)
        return self._views[key]

    def own_planes(self, site: Site) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """The sinks' and the ring's keys and values of a core site's own loop (None where the loop is kept or not
        stored), views made once per site."""
        key = ("own", site.layer, site.loop)
        if key not in self._views:
            slot = self.extra_slot.get(site.loop)
            self._views[key] = None if slot is None else tuple(t[site.layer, slot] for t in (*self.sink, *self.ring))
        return self._views[key]

    def _own(self, which: int, layer: int, plane: int, kind: str, lengths: Tensor) -> Tensor:
        """A plane read only at full-depth positions: the ring or the sinks slot (or a kept plane there)."""
        if plane in self.kept_slot:
            t = self.core[which][layer, self.kept_slot[plane]]
            if kind == "sinks":
                return t[:, :, :self.sink_size]
            index = self.ring_positions(lengths).clamp(min=0)[:, None, :, None]
            return t.gather(2, index.expand(-1, t.shape[1], -1, t.shape[3]))
        if plane not in self.extra_slot:
            raise ValueError(f"plane {plane} is not stored by cache policy {self.policy.name}")
        return self.extra_base[which][layer, self.extra_slot[plane]].narrow(-2, *self.extra_slots(kind))

    def segments(self, site: Site, reads: PrefixReads = ALIGNED, *, planes: tuple | None = None,
                 static: bool = False, lengths: Tensor | None = None) -> list[tuple[Tensor, Tensor, str]]:
        """The prefix a block reads at this site: (keys, values, mask kind) per segment, views of the planes.

        ``planes`` is :func:`~looped_kv.runtime.policy.read_planes` of the site's loop (computed from ``reads``
        when None). A static read (a compiled step) takes the whole capacity, to be masked by ``lengths``;
        an eager one the committed prefix [0, longest row).
        """
        L = self.capacity if static else self.max_length
        lengths = self.lengths if lengths is None else lengths
        if L == 0:
            return []
        if site.stage != "core":
            return [(self.plane_tensor(0, site)[:, :, :L], self.plane_tensor(1, site)[:, :, :L], "prefix")]
        (key_base, value_base), own = read_planes(self.policy, reads, site.loop) if planes is None else planes
        keys, values = self.plane_tensor(0, site, key_base), self.plane_tensor(1, site, value_base)
        if own is None:
            return [(keys[:, :, :L], values[:, :, :L], "prefix")]
        out = [(keys[:, :, :L], values[:, :, :L], "deep")]
        for kind, size in (("ring", self.ring_size if self.policy.window else 0), ("sinks", min(self.sink_size, L))):
            if size:
                out.append((self._own(0, site.layer, own[0], kind, lengths)[:, :, :size],
                            self._own(1, site.layer, own[1], kind, lengths)[:, :, :size], kind))
        return out

    def mask(self, kind: str, query_positions: Tensor, *, static: bool = False,
             lengths: Tensor | None = None) -> Tensor:
        """(B, 1, n, keys) bool: which keys of a segment ``kind`` each query at ``query_positions`` (B, n) reads.

        A row reads its committed positions j < L; a RIPE/sinks policy reads position j at full depth
        (ring, sinks) iff t - j <= W or j < sinks, and otherwise at plane(r) (``"deep"``). A static mask spans
        the segment's whole capacity, with row lengths ``lengths`` (default the cache's).
        """
        lengths = self.lengths if lengths is None else lengths
        t = query_positions[:, :, None]
        if kind == "ring":
            j = self.ring_positions(lengths)[:, None, :]
            keep = (j >= self.policy.sinks) & (t - j <= self.policy.window)
        else:
            longest = self.capacity if static else self.max_length
            size = min(self.sink_size, longest) if kind == "sinks" else longest
            j = torch.arange(size, device=t.device)
            keep = (j < lengths[:, None, None]).expand(-1, t.shape[1], -1)
            if kind == "deep":
                keep = keep & ~((t - j <= self.policy.window) | (j < self.policy.sinks))
        return keep[:, None]

    # -- writing -------------------------------------------------------------------------------
    def plan_writes(self, positions: Tensor, counts: Tensor | None = None) -> RowWrites:
        """Entries of a block at ``positions`` (B, n) whose first ``counts`` (B,) columns per row are stored (all
        by default; then, for one slice of positions shared by every row, the main entries are that slice)."""
        B, n = positions.shape
        cols = torch.arange(n, device=positions.device)
        if counts is None:
            counts = torch.full((B,), n, dtype=torch.long, device=positions.device)
        rows, cols = (cols < counts[:, None]).nonzero(as_tuple=True)
        index = positions[rows, cols]
        ring = cols >= counts[rows] - self.ring_size  # only each row's last W + 1 stored positions survive in the ring
        sink = index < self.sink_size
        return RowWrites(main=_Scatter(rows, cols, index),
                         ring=_Scatter(rows[ring], cols[ring], index[ring] % max(self.ring_size, 1)),
                         sink=_Scatter(rows[sink], cols[sink], index[sink]))

    def span_writes(self, start: int, stop: int) -> RowWrites:
        """Every column of a block at positions [start, stop) of every row, as slices: the main entries one, the ring
        its last W + 1 positions (slot = position mod (W + 1): two slices where the slots wrap), the sinks those
        below S."""
        main = _slices((start, 0, stop - start))
        if not (self.ring_size or self.sink_size):
            return RowWrites(main, main, main)  # ring and sinks hold nothing: never written
        ring: tuple[tuple[int, int, int], ...] = ()
        if self.ring_size:
            first = max(start, stop - self.ring_size)  # only the last W + 1 positions survive in the ring
            slot = first % self.ring_size
            head = min(stop - first, self.ring_size - slot)
            ring = ((slot, first - start, head),) + (
                ((0, first - start + head, stop - first - head),) if stop - first > head else ())
        sinks = ((start, 0, min(stop, self.sink_size) - start),) if start < self.sink_size else ()
        return RowWrites(main, _slices(*ring), _slices(*sinks))

    def prefill_writes(self, n: int, lengths: Tensor) -> RowWrites:
        """Every column of right-padded prompts (B, n) of ``lengths`` real tokens into an empty cache, built without
        a device sync or a data-dependent shape (a compiled prefill): the main entries as one slice of [0, n); ring
        slot s of row b takes the position it holds after the prompt (:meth:`ring_positions`; none yet: kept as it
        is), sink slot j position j (past the prompts: kept)."""
        main = _slices((0, 0, n))
        if not (self.ring_size or self.sink_size):
            return RowWrites(main, main, main)
        B, device = lengths.shape[0], lengths.device
        held = self.ring_positions(lengths).reshape(-1)  # (B * W,): position each slot holds, row by row
        slots = torch.arange(self.ring_size, device=device)
        ring = _Scatter(torch.arange(B, device=device).repeat_interleave(self.ring_size), held.clamp(0, n - 1),
                        slots.repeat(B), valid=held >= 0)
        sinks = torch.arange(self.sink_size, device=device)
        sink = _Scatter(torch.arange(B, device=device).repeat_interleave(self.sink_size),
                        sinks.clamp(max=n - 1).repeat(B), sinks.repeat(B), valid=(sinks < n).repeat(B))
        return RowWrites(main, ring, sink)

    def static_writes(self, positions: Tensor) -> RowWrites:
        """Every column of a block at ``positions`` (B, n), built without a device sync or a data-dependent
        shape (a compiled step). The ring and the sinks take one token per row (n = 1): then no two entries
        share a slot."""
        B, n = positions.shape
        rows = torch.arange(B, device=positions.device).repeat_interleave(n)
        cols = torch.arange(n, device=positions.device).repeat(B)
        index = positions.reshape(-1)
        main = _Scatter(rows, cols, index)
        if not (self.ring_size or self.sink_size):
            return RowWrites(main, main, main)
        if n != 1:
            raise ValueError(f"a static write into the ring or the sinks takes one token per row, got {n}")
        valid = index < self.sink_size
        return RowWrites(main, _Scatter(rows, cols, index % max(self.ring_size, 1)),
                         _Scatter(rows, cols, index.clamp(max=max(self.sink_size - 1, 0)), valid=valid))

    def write(self, writes: RowWrites, keys_values: Mapping[Site, tuple[Tensor, Tensor]], *,
              plane: int | None = None) -> None:
        """The one write into the cache: each site's keys/values (B, Hkv, n, D) at the entries of ``writes``.

        Under the policy, loop r's keys/values go to plane r where it is kept, else to the ring and the sinks
        (the full-depth positions) where the policy holds them, else nowhere. ``plane`` writes core sites into that
        kept plane instead (a cache pass that reads the block's own columns there, see :class:`CachePass`). Sites
        that fill a whole store (every edge layer, every kept plane, every ring and sink plane) are written to it
        as one stacked tensor: one scatter, in a compiled step one in-place index_put.
        """
        if len(keys_values) == 1:  # a cache pass writing one site (the eager hot path)
            ((site, (keys, values)),) = keys_values.items()
            if site.stage != "core" or plane is not None or site.loop in self.kept_slot:
                target = (site.loop if plane is None else plane) if site.stage == "core" else None
                _put(self.plane_tensor(0, site, target), writes.main, keys)
                _put(self.plane_tensor(1, site, target), writes.main, values)
                return
            own = self.own_planes(site)  # None: the policy stores nothing of this loop
            for (own_keys, own_values), scatter in ((own[:2], writes.sink), (own[2:], writes.ring)) if own else ():
                if own_keys.shape[-2] and (scatter.runs if scatter.runs is not None else scatter.rows.numel()):
                    _put(own_keys, scatter, keys)
                    _put(own_values, scatter, values)
            return
        stores: dict[str, dict[tuple[int, ...], tuple[Tensor, Tensor]]] = {"edge": {}, "core": {}, "extra": {}}
        for site, kv in keys_values.items():
            if site.stage != "core":
                stores["edge"][(self.edge_index(site),)] = kv
            elif plane is not None or site.loop in self.kept_slot:
                stores["core"][(site.layer, self.kept_slot[site.loop if plane is None else plane])] = kv
            elif site.loop in self.extra_slot:
                stores["extra"][(site.layer, self.extra_slot[site.loop])] = kv
        for name, entries in stores.items():
            if not entries:
                continue
            # the sinks and the ring into their one store itself, not into views of it: in a compiled step an in-place
            # write into a view of a tensor rewrites the whole tensor
            if name == "extra":
                targets = [(self.extra_base, _shifted(scatter, at), size)
                           for scatter, (at, size) in ((writes.sink, self.extra_slots("sinks")),
                                                       (writes.ring, self.extra_slots("ring")))]
            else:
                store = {"edge": self.edge, "core": self.core}[name]
                targets = [(store, writes.main, store[0].shape[-2])]
            for tensors, scatter, size in targets:
                if not size:
                    continue
                lead = tensors[0].shape[:-4]
                if len(entries) > 1 and len(entries) == math.prod(lead):  # the whole store: one stacked write
                    order = sorted(entries)
                    for which in (0, 1):
                        stacked = torch.stack([entries[i][which] for i in order]).unflatten(0, lead)
                        _put(tensors[which], scatter, stacked)
                    continue
                for index, kv in entries.items():
                    for which in (0, 1):
                        _put(tensors[which][index], scatter, kv[which])

    def commit(self, buffer: BlockBuffer, counts: Tensor | int) -> None:
        """Append each row's first ``counts`` block tokens held in ``buffer`` (their planes) to the cache."""
        counts = torch.full_like(self.lengths, counts) if isinstance(counts, int) else counts
        n = int(counts.max())
        positions = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)
        self.write(self.plan_writes(positions, counts), {site: buffer.read(site, 0, n) for site in buffer.sites()})
        self.advance(counts)


class BlockBuffer:
    """Keys/values of uncommitted block tokens (drafts, a verification block), every site, every loop."""

    def __init__(self, config: LoopedConfig, num_loops: int, *, batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        like = dict(dtype=dtype, device=device)
        H, D = config.n_kv_heads, config.head_dim
        self.config, self.num_loops, self.capacity = config, num_loops, capacity
        self.edge = [torch.zeros(config.n_prelude + config.n_coda, batch, H, capacity, D, **like) for _ in range(2)]
        self.core = [torch.zeros(config.n_core, num_loops, batch, H, capacity, D, **like) for _ in range(2)]

    def _slot(self, which: int, site: Site) -> Tensor:
        if site.stage == "core":
            if not 1 <= site.loop <= self.num_loops:
                raise ValueError(f"loop {site.loop} outside the buffer's 1..{self.num_loops}")
            return self.core[which][site.layer, site.loop - 1]
        index = site.layer if site.stage == "prelude" else self.config.n_prelude + site.layer
        return self.edge[which][index]

    def write(self, site: Site, offset: int | Tensor, keys: Tensor, values: Tensor) -> None:
        """Store a site's keys/values (B, Hkv, n, D) at columns [offset, offset + n); a tensor ``offset`` (a
        compiled step) holds one column, the same for every row."""
        if isinstance(offset, Tensor):
            column = offset.reshape(1)
            self._slot(0, site)[:, :, column] = keys
            self._slot(1, site)[:, :, column] = values
            return
        n = keys.shape[2]
        if offset + n > self.capacity:
            raise ValueError(f"block buffer capacity {self.capacity} exceeded ({offset + n} tokens)")
        self._slot(0, site)[:, :, offset:offset + n] = keys
        self._slot(1, site)[:, :, offset:offset + n] = values

    def read(self, site: Site, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return self._slot(0, site)[:, :, start:stop], self._slot(1, site)[:, :, start:stop]

    def write_all(self, keys_values: Mapping[Site, tuple[Tensor, Tensor]], offset: int | Tensor) -> None:
        """:meth:`write` of every site of a pass: the edge layers and the loops 1..d of every core layer, each as one
        stacked tensor (a compiled step: a few in-place writes)."""
        cfg = self.config
        edges = [Site("prelude", i) for i in range(cfg.n_prelude)] + [Site("coda", i) for i in range(cfg.n_coda)]
        loops = max(site.loop for site in keys_values)
        core = [Site("core", layer, r) for layer in range(cfg.n_core) for r in range(1, loops + 1)]
        if set(keys_values) != {*edges, *core}:
            for site, (keys, values) in keys_values.items():
                self.write(site, offset, keys, values)
            return
        for which in (0, 1):
            edge = torch.stack([keys_values[s][which] for s in edges])
            layers = torch.stack([keys_values[s][which] for s in core]).unflatten(0, (cfg.n_core, loops))
            for dest, src in ((self.edge[which], edge), (self.core[which][:, :loops], layers)):
                if isinstance(offset, Tensor):
                    dest[..., offset.reshape(1), :] = src
                else:
                    dest[..., offset:offset + src.shape[-2], :] = src

    def keep_rows(self, count: int) -> None:
        """Keep the first ``count`` rows (the contents are block-local: only the number of rows changes)."""
        self.edge = [t.narrow(-4, 0, count) for t in self.edge]
        self.core = [t.narrow(-4, 0, count) for t in self.core]

    def sites(self) -> list[Site]:
        cfg = self.config
        return ([Site("prelude", i) for i in range(cfg.n_prelude)] + [Site("coda", i) for i in range(cfg.n_coda)]
                + [Site("core", layer, r) for layer in range(cfg.n_core) for r in range(1, self.num_loops + 1)])


def _causal_tail(n: int, offset: int, device: torch.device) -> Tensor:
    """(n, offset + n): a block's queries read the ``offset`` earlier uncommitted tokens and the block causally."""
    like = dict(dtype=torch.bool, device=device)
    return torch.cat([torch.ones(n, offset, **like), torch.ones(n, n, **like).tril()], dim=1)


class CachePass:
    """The eager cache pass: router for one block of n new tokens per row at absolute ``positions``.

    ``positions`` is a ``range`` (every row at the same positions) or a (B, n) tensor (consecutive per
    row). What it reads, in one softmax per call: each row's committed prefix under the cache policy
    as modified by ``reads``; the ``offset`` uncommitted tokens already in ``buffer`` at the same site
    (earlier drafts of this block); and the block itself, causally. Where it writes the block's
    keys/values: into the cache (``store="cache"``, prefill and greedy steps; the first ``counts[b]``
    columns of row b, all by default), into the buffer at ``offset`` (``store="buffer"``, drafts and
    verification), or nowhere (``store=None``); with ``record``, a copy of every call's keys/values too.
    """

    def __init__(self, cache: PlaneCache | None, positions: range | Tensor, *, reads: PrefixReads = ALIGNED,
                 buffer: BlockBuffer | None = None, offset: int = 0, store: str | None = "cache",
                 counts: Tensor | None = None, softmax_dtype: torch.dtype | None = None,
                 record: dict | None = None) -> None:
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {store!r}")
        if (store == "buffer" or offset) and buffer is None:
            raise ValueError("store='buffer' and offset > 0 need a buffer")
        if store == "cache" and cache is None:
            raise ValueError("store='cache' needs a cache")
        device = cache.lengths.device if cache is not None else None
        span = None
        if isinstance(positions, range):
            if cache is not None and store == "cache" and any(positions.start != L for L in cache.host_lengths):
                raise ValueError(f"store='cache' needs every row's length ({cache.host_lengths}) to equal the "
                                 f"block's first position {positions.start}")
            batch = cache.batch if cache is not None else 1
            self.positions = torch.arange(positions.start, positions.stop, device=device).expand(batch, -1)
            span = (positions.start, positions.stop) if counts is None else None
            self.last_position = positions.stop - 1
        else:
            if positions.dim() != 2:
                raise ValueError(f"positions must be a range or (batch, n), got shape {tuple(positions.shape)}")
            if store == "cache" and not torch.equal(positions[:, 0], cache.lengths):
                raise ValueError("store='cache' needs a cache whose row lengths equal the block's first positions")
            self.positions = positions
            # the decoders' positions follow each row's prefix (and offset): their largest is known on the host
            self.last_position = (cache.max_length + offset + positions.shape[1] - 1 if cache is not None
                                  else int(positions.max()))
        self.cache, self.reads, self.buffer, self.offset, self.store = cache, reads, buffer, offset, store
        self.softmax_dtype, self.record = softmax_dtype, record
        n = self.positions.shape[1]
        if cache is not None and store is not None and cache.max_length + offset + n > cache.capacity:
            raise ValueError(f"cache capacity {cache.capacity} exceeded (a block of {n} tokens after position "
                             f"{cache.max_length + offset})")
        # A single fused attention over the plane the block is written into (see the module docstring): at prelude and
        # coda layers under every policy (their planes hold every position), in the core where the policy lets it
        self.edge_in_plane = store == "cache"
        self.core_in_plane = self.edge_in_plane and reads == ALIGNED and cache.policy.in_own_plane
        if store == "cache":
            self.writes = cache.span_writes(*span) if span is not None else \
                cache.plan_writes(self.positions, None if self.core_in_plane else counts)
            # an in-plane write stores every column (those past a row's count lie past its length, unread)
            self.plane_writes = self.writes if counts is None or self.core_in_plane else \
                cache.plan_writes(self.positions)
        self._masks: dict[tuple[str, ...], list[Tensor | None]] = {}
        # RIPE and sinks, one token per row, rows of one length or all past the sinks and a full window: the token is
        # written into its ring slot, and the sinks' and the ring's plane (the token included) are copied into the
        # scratch slots before the kept plane (PlaneCache.gap) and read with it in one fused call (see attend_gapped)
        lengths = cache.host_lengths if cache is not None else []
        self.gapped = (cache is not None and cache.gap > 0 and n == 1 and offset == 0 and store in ("cache", None)
                       and reads == ALIGNED and softmax_dtype is None
                       and (len(set(lengths)) == 1 or min(lengths) >= cache.sink_size + cache.policy.window))
        self._gap_spans: dict[bool, tuple[int, int, Tensor | None]] = {}
        self._gap_reads: dict[tuple[int, bool], tuple[Tensor, Tensor, Tensor | None]] = {}
        if self.gapped:
            # every row's token into its ring slot (position mod (W + 1): the next position's, past every row's window)
            self.ring_writes = self.plane_writes if store == "cache" else \
                cache.span_writes(*span) if span is not None else cache.plan_writes(self.positions)
        if self.edge_in_plane:  # each call reads [0, stop) of its plane: the prefix, then the block (see attend)
            self.stop = cache.max_length + n
            self.plane_mask = self._plane_mask()
            self.causal = self.plane_mask is None and cache.max_length == 0 and n > 1

    # -- masks, built once per block ---------------------------------------------------------
    def _segment_masks(self, kinds: tuple[str, ...]) -> list[Tensor | None]:
        if kinds not in self._masks:
            n = self.positions.shape[1]  # one token reads all its tail: no mask
            tail = None if n == 1 else _causal_tail(n, self.offset, self.positions.device)
            self._masks[kinds] = [self.cache.mask(kind, self.positions) for kind in kinds] + [tail]
        return self._masks[kinds]

    def _plane_mask(self) -> Tensor | None:
        """Mask of a read over [0, max length + n) of the plane the block was written into: j <= t per row; on the
        fused path additive (:func:`~looped_kv.runtime.attention.additive_mask`, in the cache's dtype, which the
        queries share), made once per pass as every call of the pass reads it."""
        B, n = self.positions.shape
        if self.cache.max_length == 0 or (B == 1 and n == 1):
            return None  # a fresh block reads itself causally; one token reads everything up to itself
        j = torch.arange(self.cache.max_length + n, device=self.positions.device)
        keep = (j <= self.positions[:, :, None])[:, None]
        return keep if self.softmax_dtype is not None else additive_mask(keep, self.cache.core[0].dtype)

    # -- the router --------------------------------------------------------------------------
    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        if self.record is not None:  # the keys and values are views into wider projections: keep copies
            self.record[site] = (keys.contiguous(), values.contiguous())
        core = site.stage == "core"
        if self.core_in_plane if core else self.edge_in_plane:  # write the block where its prefix is read (scratch
            plane = self.cache.policy.plane(site.loop) if core else None  # past each row's length until the last loop
            self.cache.write(self.plane_writes, {site: (keys, values)}, plane=plane)  # writes it)
            plane_keys = self.cache.plane_tensor(0, site, plane).narrow(2, 0, self.stop)
            plane_values = self.cache.plane_tensor(1, site, plane).narrow(2, 0, self.stop)
            return attend(queries, plane_keys, plane_values, self.plane_mask, causal=self.causal,
                          softmax_dtype=self.softmax_dtype)
        if self.gapped and core:
            return self.attend_gapped(site, queries, keys, values)
        reads = self._reads(site, keys, values)
        if len(reads) == 1:  # no prefix (an empty cache): the block reads itself causally (SDPA's causal kernel)
            block_keys, block_values, mask = reads[0]
            out = attend(queries, block_keys, block_values, causal=mask is not None, softmax_dtype=self.softmax_dtype)
        else:
            out = attend_segments(queries, reads, self.softmax_dtype)
        if self.store == "cache":
            self.cache.write(self.writes, {site: (keys, values)})
        return out

    def attend_gapped(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """RIPE's and the sinks policy's read of one new token in one fused call (the same keys as :meth:`_reads`, in
        another order, which attention ignores), and its write. Loop r < R reads the sinks and the window at plane
        r, the token, then the positions between them at plane R: the token is written into its ring slot (the
        slot beyond the window: stored, or past the row's length until a commit), the sinks' S and the ring's
        W + 1 slots are copied into the scratch slots before the kept plane, and the call reads [0, gap + L - W) but
        the kept plane's first S positions (rows shorter than S + W: the scratch alone, :meth:`_gap_span`). Loop R
        reads every position at plane R: the token in the last scratch slot, then the kept plane, [gap - 1, gap + L).
        Rows of other lengths mask the positions past their own. Both reads are the same slots at every loop of a
        layer, sliced once per pass."""
        base_keys, base_values, copies, (token_keys, token_values) = self.cache.gapped(site)
        if copies:  # loop r < R: the sinks and the ring at plane r (aligned reads)
            self.cache.write(self.ring_writes, {site: (keys, values)})
            for scratch, plane in copies:
                scratch.copy_(plane)
        else:
            token_keys.copy_(keys)
            token_values.copy_(values)
        read = (site.layer, not copies)
        if read not in self._gap_reads:  # the same slots at every loop r < R of a layer: sliced once per pass
            start, stop, mask = self._gap_span(not copies, queries.dtype)
            self._gap_reads[read] = (base_keys[:, :, start:stop], base_values[:, :, start:stop], mask)
        out = attend(queries, *self._gap_reads[read])
        if self.store == "cache" and not copies:
            self.cache.write(self.writes, {site: (keys, values)})
        return out

    def _gap_span(self, kept: bool, dtype: torch.dtype) -> tuple[int, int, Tensor | None]:
        """The slots [start, stop) of the scratch and the kept plane that a loop's fused call reads, and which of them
        each row reads (None: all; else additive, :func:`~looped_kv.runtime.attention.additive_mask`, in ``dtype``);
        made once per pass, as every loop's call reads them. Rows of length L, every position read at plane r where
        t - j <= W or j < S (the sinks) and at plane R otherwise:

        * the kept loop: the token in the last scratch slot, then the kept plane, [gap - 1, gap + L);
        * loop r < R, L >= S + W: the scratch (the sinks and the ring at plane r), then the kept plane but its first S
          positions (the sinks at plane R) and the window's W, [0, gap + L - W);
        * L <= W (every position in the window): the ring's slots 0..L, which hold positions 0..L, [S, S + L + 1);
        * W < L < S + W: the scratch, but the sinks' slots [L - W, S) (positions the ring holds, or none yet).

        Rows of other lengths (all at least S + W) mask the positions past their own."""
        if kept in self._gap_spans:
            return self._gap_spans[kept]
        lengths, gap, S, W = self.cache.host_lengths, self.cache.gap, self.cache.sink_size, self.cache.policy.window
        L = max(lengths)
        if kept:
            start, stop, hole = gap - 1, gap + L, (0, 0)
        elif L >= S + W:
            start, stop, hole = 0, gap + L - W, (gap, gap + S)
        elif L <= W:
            start, stop, hole = S, S + L + 1, (0, 0)
        else:
            start, stop, hole = 0, gap, (L - W, S)
        ragged, holed, mask = len(set(lengths)) > 1, hole[0] < hole[1], None
        if holed and not ragged and hole == (gap, gap + S):  # a slice of the cache's hole mask
            mask = self.cache.hole_mask(dtype)[..., :stop]
        elif holed or ragged:
            j = torch.arange(start, stop, device=self.cache.lengths.device)
            keep = (j < hole[0]) | (j >= hole[1]) if holed else None
            if ragged:
                rows = j < gap + self.cache.lengths[:, None] - (0 if kept else W)
                keep = rows if keep is None else keep & rows
            mask = additive_mask(keep.view(-1, 1, 1, len(j)), dtype)
        self._gap_spans[kept] = (start, stop, mask)
        return self._gap_spans[kept]

    def _reads(self, site: Site, keys: Tensor, values: Tensor) -> list[tuple[Tensor, Tensor, Tensor | None]]:
        """What the call reads: the prefix segments, then the uncommitted tokens and the block (one segment)."""
        segments = self.cache.segments(site, self.reads) if self.cache is not None else []
        masks = self._segment_masks(tuple(kind for _, _, kind in segments))
        return [(sk, sv, m) for (sk, sv, _), m in zip(segments, masks[:-1], strict=True)] + [
            (*self._tail(site, keys, values), masks[-1])]

    def _tail(self, site: Site, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The block's earlier uncommitted tokens and its own keys/values (written to the buffer first if stored)."""
        if self.buffer is not None and self.store == "buffer":
            self.buffer.write(site, self.offset, keys, values)
            return self.buffer.read(site, 0, self.offset + keys.shape[2])
        if self.offset:
            bk, bv = self.buffer.read(site, 0, self.offset)
            return torch.cat([bk, keys], dim=2), torch.cat([bv, values], dim=2)
        return keys, values


class StaticCachePass:
    """The cache pass of a compiled step: the reads and writes of :class:`CachePass`, with static shapes.

    Each call reads the whole capacity of every prefix segment under a mask built from ``lengths`` (B,) on the
    device, the whole ``buffer`` under the mask column < ``offset`` (a 0-d tensor: earlier drafts of this
    block), and the block itself causally, in one softmax. The block's keys/values are kept per site, and
    :meth:`store` writes them all at once after the pass: through :meth:`PlaneCache.write` (``store="cache"``,
    every column at ``positions``) or into the buffer at ``offset`` (``store="buffer"``). Nothing is read or
    decided on the host, so a traced step serves every call of the same shapes. ``planes`` gives each loop's
    :func:`~looped_kv.runtime.policy.read_planes` (the loops of the pass numbered 1..n, whatever loops of the
    recurrence they are).
    """

    def __init__(self, cache: PlaneCache, positions: Tensor, lengths: Tensor, planes: tuple, *,
                 buffer: BlockBuffer | None = None, offset: Tensor | None = None, store: str | None = None) -> None:
        self.cache, self.positions, self.lengths, self.planes = cache, positions, lengths, planes
        self.buffer, self.offset, self.store = buffer, offset, store
        n = positions.shape[1]
        self.causal = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril() if n > 1 else None
        if offset is not None:
            self.earlier = (torch.arange(buffer.capacity, device=positions.device) < offset)[None, None, None]
        self.new: dict[Site, tuple[Tensor, Tensor]] = {}
        self._masks: dict[str, Tensor] = {}

    def _mask(self, kind: str) -> Tensor:
        if kind not in self._masks:
            self._masks[kind] = self.cache.mask(kind, self.positions, static=True, lengths=self.lengths)
        return self._masks[kind]

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        planes = self.planes[site.loop - 1] if site.stage == "core" else None
        segments = self.cache.segments(site, planes=planes, static=True, lengths=self.lengths)
        parts = [(sk, sv, self._mask(kind)) for sk, sv, kind in segments]
        if self.offset is not None:
            bk, bv = self.buffer.read(site, 0, self.buffer.capacity)
            parts.append((bk, bv, self.earlier))
        parts.append((keys, values, self.causal))
        if self.store is not None:
            self.new[site] = (keys, values)
        return attend_segments(queries, parts)

    def store_block(self) -> None:
        """Write the pass's keys/values where ``store`` says (call after the model pass)."""
        if self.store == "cache":
            self.cache.write(self.cache.static_writes(self.positions), self.new)
        elif self.store == "buffer":
            self.buffer.write_all(self.new, 0 if self.offset is None else self.offset)


class PrefillPass:
    """The prefill of a compiled run: B right-padded prompts (B, n) of ``lengths`` (B,) real tokens into an empty
    cache.

    Every call attends causally within the prompts (an empty cache has no prefix: SDPA's causal kernel), and
    :meth:`store_block` writes every site's keys/values at positions [0, n) of every row, as one slice per store,
    and each row's last W + 1 positions into the ring and its first into the sinks (:meth:`PlaneCache.prefill_writes`).
    A row's columns past its own prompt hold padding until its later tokens overwrite them, and no read reaches
    them before: every read is masked by the row lengths. Nothing depends on n but tensor sizes, so a trace with
    a dynamic n serves prompts of every length.
    """

    def __init__(self, cache: PlaneCache, n: int, lengths: Tensor) -> None:
        self.cache, self.n, self.lengths = cache, n, lengths
        self.new: dict[Site, tuple[Tensor, Tensor]] = {}

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        self.new[site] = (keys, values)
        return attend(queries, keys, values, causal=True)

    def store_block(self) -> None:
        """Write the prompts' keys/values into the cache (call after the model pass)."""
        self.cache.write(self.cache.prefill_writes(self.n, self.lengths), self.new)
