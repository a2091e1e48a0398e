"""Batched decoding: B sequences of different lengths decoded together, and its throughput and memory.

A :class:`BatchedPlaneCache` stores the planes of B sequences under one cache policy, in the layout of
:class:`~looped_kv.runtime.cache.PlaneCache` (which allocates it), with one length per row. A
:class:`RowsPass` routes one block of n new tokens per row at per-row absolute positions (B, n): every
attention call reads, in one softmax, each row's prefix under the policy (masks (B, 1, n, keys) built
from the row's length and, for RIPE's window t - j <= W (Eq. 9), its absolute positions), the
uncommitted block tokens of a :class:`~looped_kv.runtime.cache.BlockBuffer`, and the block causally.

Decoders: :func:`batched_greedy` (sequential full-depth decoding) and :func:`batched_speculative`
(sequential self-speculation, RIPE Algorithm 1: d-loop drafts, gamma per block, one R-loop
verification, greedy acceptance, ragged per row). A sequence that has emitted its tokens is dropped
from the batch (its cache rows are compacted away), so it stops costing work. Each row emits exactly
the tokens of decoding it alone (``tests/test_batched.py``, float64).

Measurements: :func:`throughput_cells` (tokens/s against B, fitted by T(B) = B / (a + b B), RIPE
Sec. 3.5, Table 8), :func:`memory_cells` (peak memory against B, :mod:`looped_kv.analysis.memory_bench`) and
:func:`fixed_memory_comparison` (full cache at its B_max against the deepest plane at its B_max under
one budget, RIPE Sec. 3.5 / 5.3). ``python -m looped_kv.batched`` (or ``looped-kv batched``) runs them
on the tiny model.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv import data
from looped_kv.analysis.memory_bench import MemoryCell, MemoryCheck, check_memory_model, peak_bytes
from looped_kv.analysis.perf import FixedMemoryFactors, ThroughputFit, fit_throughput, fixed_memory_factors
from looped_kv.decoding.greedy import check_prompt
from looped_kv.decoding.speculative import check_speculation
from looped_kv.protocol.reproducibility import check_device, measurement_mode
from looped_kv.runtime.attention import Site, attend
from looped_kv.runtime.cache import BlockBuffer, PlaneCache
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.loading import load, resolve_source
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import ALIGNED, CachePolicy, PrefixReads, make_policy, make_prefix_reads, read_planes

METHODS = ("greedy", "dtv")
STORES = ("cache", "buffer", None)


@dataclass(frozen=True)
class _Scatter:
    """(row, block column) entries of a block and the slot each one is written to."""

    rows: Tensor
    cols: Tensor
    index: Tensor


@dataclass(frozen=True)
class RowWrites:
    """Where the valid entries of a block go: every stored position, the RIPE ring (position mod W), the sinks."""

    main: _Scatter
    ring: _Scatter
    sink: _Scatter


def _put(dest: Tensor, scatter: _Scatter, src: Tensor) -> None:
    """dest[row, :, index] = src[row, :, col] for every entry (dest (B, H, P, D), src (B, H, n, D))."""
    dest[scatter.rows, :, scatter.index] = src[scatter.rows, :, scatter.cols]


class BatchedPlaneCache:
    """KV planes of B sequences under one cache policy, with one length per row.

    The planes are a :class:`~looped_kv.runtime.cache.PlaneCache` allocated for B rows (``planes``: edge, kept
    core planes, RIPE ring of min(W, capacity) slots, sinks); this class reads and writes them per row.
    Row b holds positions [0, lengths[b]); ring slot s of row b holds the latest of its positions
    congruent to s modulo the ring size.
    """

    def __init__(self, config: LoopedConfig, policy: CachePolicy, *, batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.planes = PlaneCache(config, policy, batch=batch, capacity=capacity, dtype=dtype, device=device)
        self.config, self.policy, self.capacity = config, policy, capacity
        self.ring_size, self.sink_size = self.planes.ring[0].shape[-2], self.planes.sink[0].shape[-2]
        self.allocated_bytes = self.planes.allocated_bytes  # what the rows were allocated, whatever is dropped
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.planes.edge[0].device)
        self.max_length = 0
        self._ring_positions: Tensor | None = None

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    # -- accounting ----------------------------------------------------------------------------
    def row_bytes(self) -> list[int]:
        """Bytes holding each row's stored positions: Eq. (3) / Eq. (10) per sequence at L = its length."""
        p = self.planes

        def per_position(tensors: list[Tensor]) -> int:  # one row (batch dimension -4), one position
            return sum(t.select(-4, 0)[..., :1, :].numel() * t.element_size() for t in tensors)

        every, ring, sink = per_position([*p.edge, *p.core]), per_position(p.ring), per_position(p.sink)
        W, S = self.policy.window, self.policy.sinks
        return [every * L + ring * min(W, L) + sink * min(S, L) for L in self.lengths.tolist()]

    # -- bookkeeping ---------------------------------------------------------------------------
    def advance(self, counts: Tensor) -> None:
        """Rows have stored ``counts`` (B,) more positions."""
        self._set_lengths(self.lengths + counts)

    def _set_lengths(self, lengths: Tensor) -> None:
        self.lengths, self.max_length, self._ring_positions = lengths, int(lengths.max()), None

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (increasing indices), compacted in place to the front: no new allocation."""
        if not rows or list(rows) != sorted(set(rows)) or rows[0] < 0 or rows[-1] >= self.batch:
            raise ValueError(f"rows must be increasing indices in [0, {self.batch}), at least one, got {list(rows)}")
        p = self.planes
        for tensors in (p.edge, p.core, p.ring, p.sink):
            for i, t in enumerate(tensors):  # the batch dimension is -4 in every plane tensor
                for dst, src in enumerate(rows):
                    if dst != src:
                        t.select(-4, dst).copy_(t.select(-4, src))
                tensors[i] = t.narrow(-4, 0, len(rows))
        self._set_lengths(self.lengths[list(rows)])

    def ring_positions(self) -> Tensor:
        """(B, ring size): the position each ring slot of each row holds (negative: none yet)."""
        if self._ring_positions is None:
            slots = torch.arange(self.ring_size, device=self.lengths.device)
            last = self.lengths[:, None] - 1
            self._ring_positions = last - (last - slots) % max(self.ring_size, 1)
        return self._ring_positions

    # -- reading -------------------------------------------------------------------------------
    def view(self, which: int, layer: int, plane: int, kind: str) -> Tensor:
        """Keys (which=0) or values (1) of core ``layer`` at ``plane`` (B, H, keys, D) for a segment ``kind``.

        ``"prefix"``/``"deep"``: positions [0, max length); ``"ring"``: the ring slots' positions;
        ``"sinks"``: positions [0, min(sinks, max length)).
        """
        p = self.planes
        if plane in p.kept_slot:
            t = p.core[which][layer, p.kept_slot[plane]]
            if kind == "ring":
                index = self.ring_positions().clamp(min=0)[:, None, :, None]
                return t.gather(2, index.expand(-1, t.shape[1], -1, t.shape[3]))
            return t[:, :, :min(self.sink_size, self.max_length) if kind == "sinks" else self.max_length]
        if plane not in p.extra_slot:
            raise ValueError(f"plane {plane} is not stored by cache policy {self.policy.name} "
                             f"(kept planes {self.policy.kept})")
        if kind == "ring":
            return p.ring[which][layer, p.extra_slot[plane]]
        if kind == "sinks":
            return p.sink[which][layer, p.extra_slot[plane]][:, :, :min(self.sink_size, self.max_length)]
        raise ValueError(f"plane {plane} is kept by {self.policy.name} only in its window and sinks, "
                         f"not for every position")

    def segments(self, site: Site, reads: PrefixReads = ALIGNED) -> list[tuple[Tensor, Tensor, str]]:
        """What a block reads at this site: (keys, values, mask kind) per segment (cf. ``PlaneCache.segments``)."""
        if self.max_length == 0:
            return []
        if site.stage != "core":
            i = self.planes.edge_index(site)
            L = self.max_length
            return [(self.planes.edge[0][i][:, :, :L], self.planes.edge[1][i][:, :, :L], "prefix")]
        layer = site.layer
        (key_base, value_base), own = read_planes(self.policy, reads, site.loop)
        if own is None:
            return [(self.view(0, layer, key_base, "prefix"), self.view(1, layer, value_base, "prefix"), "prefix")]
        key_own, value_own = own
        out = [(self.view(0, layer, key_base, "deep"), self.view(1, layer, value_base, "deep"), "deep")]
        for kind, size in (("ring", self.ring_size), ("sinks", min(self.sink_size, self.max_length))):
            if size:
                out.append((self.view(0, layer, key_own, kind), self.view(1, layer, value_own, kind), kind))
        return out

    def mask(self, kind: str, query_positions: Tensor) -> Tensor:
        """(B, n, keys) bool: which keys of a segment ``kind`` each query at ``query_positions`` (B, n) reads.

        A row reads its stored positions j < L; a RIPE/sinks policy reads position j at full depth
        (own plane: ring, sinks) iff t - j <= W or j < sinks, and otherwise at plane(r) (``"deep"``).
        """
        t = query_positions[:, :, None]
        lengths = self.lengths[:, None, None]
        if kind == "ring":
            j = self.ring_positions()[:, None, :]
            return (j >= self.policy.sinks) & (t - j <= self.policy.window)
        size = min(self.sink_size, self.max_length) if kind == "sinks" else self.max_length
        j = torch.arange(size, device=t.device)
        stored = (j < lengths).expand(-1, t.shape[1], -1)
        if kind == "deep":
            return stored & ~((t - j <= self.policy.window) | (j < self.policy.sinks))
        return stored

    # -- writing -------------------------------------------------------------------------------
    def plan_writes(self, positions: Tensor, counts: Tensor) -> RowWrites:
        """Entries of a block at ``positions`` (B, n) whose first ``counts`` (B,) columns per row are stored."""
        cols = torch.arange(positions.shape[1], device=positions.device)
        rows, cols = (cols < counts[:, None]).nonzero(as_tuple=True)
        index = positions[rows, cols]
        if index.numel() and int(index.max()) >= self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded (writing up to position {int(index.max())})")
        ring = cols >= counts[rows] - self.ring_size  # only each row's last W stored positions survive in the ring
        sink = index < self.sink_size
        return RowWrites(main=_Scatter(rows, cols, index),
                         ring=_Scatter(rows[ring], cols[ring], index[ring] % max(self.ring_size, 1)),
                         sink=_Scatter(rows[sink], cols[sink], index[sink]))

    def write(self, site: Site, writes: RowWrites, k: Tensor, v: Tensor) -> None:
        """Store a site's keys/values (B, Hkv, n, D) at the entries of ``writes``, under the policy."""
        p = self.planes
        if site.stage != "core":
            i = p.edge_index(site)
            _put(p.edge[0][i], writes.main, k)
            _put(p.edge[1][i], writes.main, v)
            return
        layer, plane = site.layer, site.loop
        if plane in p.kept_slot:
            _put(p.core[0][layer, p.kept_slot[plane]], writes.main, k)
            _put(p.core[1][layer, p.kept_slot[plane]], writes.main, v)
            return
        if plane not in p.extra_slot:
            return  # a plane this policy never reads
        slot = p.extra_slot[plane]
        if self.sink_size:
            _put(p.sink[0][layer, slot], writes.sink, k)
            _put(p.sink[1][layer, slot], writes.sink, v)
        if self.ring_size:
            _put(p.ring[0][layer, slot], writes.ring, k)
            _put(p.ring[1][layer, slot], writes.ring, v)

    def commit(self, buffer: BlockBuffer, counts: Tensor) -> None:
        """Append each row's first ``counts[b]`` block tokens held in ``buffer`` (their planes) to the cache."""
        n = int(counts.max())
        positions = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)
        writes = self.plan_writes(positions, counts)
        for site in buffer.sites():
            k, v = buffer.read(site, 0, n)
            self.write(site, writes, k, v)
        self.advance(counts)


class RowsPass:
    """Router for one block of n new tokens per row at absolute ``positions`` (B, n), consecutive per row.

    Each attention call reads, in one softmax: each row's prefix in the cache under the policy as
    modified by ``reads``; the ``offset`` uncommitted tokens already in ``buffer`` (earlier drafts of the
    block); and the block causally. The block's keys/values are then stored: into the cache
    (``store="cache"``, the first ``counts[b]`` columns of row b, all by default), into the buffer at
    ``offset`` (``store="buffer"``) or nowhere (``None``). Cf. :class:`~looped_kv.runtime.cache.BlockPass`.
    """

    def __init__(self, cache: BatchedPlaneCache | None, positions: Tensor, *, reads: PrefixReads = ALIGNED,
                 buffer: BlockBuffer | None = None, offset: int = 0, store: str | None = "cache",
                 counts: Tensor | None = None, softmax_dtype: torch.dtype | None = None) -> None:
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {store!r}")
        if positions.dim() != 2:
            raise ValueError(f"positions must be (batch, n), got shape {tuple(positions.shape)}")
        if store == "cache" and (cache is None or not torch.equal(positions[:, 0], cache.lengths)):
            raise ValueError("store='cache' needs a cache whose row lengths equal the block's first positions")
        if (store == "buffer" or offset) and buffer is None:
            raise ValueError("store='buffer' and offset > 0 need a buffer")
        self.cache, self.positions, self.reads = cache, positions, reads
        self.buffer, self.offset, self.store, self.softmax_dtype = buffer, offset, store, softmax_dtype
        if store == "cache":
            counts = torch.full_like(positions[:, 0], positions.shape[1]) if counts is None else counts
            self.writes = cache.plan_writes(positions, counts)
        self._masks: dict[tuple[str, ...], Tensor] = {}

    def _mask(self, kinds: tuple[str, ...]) -> Tensor:
        """(B, 1, n, keys): the cache segments' masks, the buffer (all read), the block (causal)."""
        if kinds not in self._masks:
            B, n = self.positions.shape
            like = dict(dtype=torch.bool, device=self.positions.device)
            parts = [self.cache.mask(kind, self.positions) for kind in kinds]
            parts.append(torch.ones(B, n, self.offset, **like))
            parts.append(torch.ones(n, n, **like).tril().expand(B, -1, -1))
            self._masks[kinds] = torch.cat(parts, dim=2)[:, None]
        return self._masks[kinds]

    def attend(self, site: Site, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        segments = self.cache.segments(site, self.reads) if self.cache is not None else []
        keys, values = [s[0] for s in segments], [s[1] for s in segments]
        if self.offset:
            bk, bv = self.buffer.read(site, 0, self.offset)
            keys.append(bk)
            values.append(bv)
        if keys:
            out = attend(q, torch.cat([*keys, k], dim=2), torch.cat([*values, v], dim=2),
                         self._mask(tuple(s[2] for s in segments)), softmax_dtype=self.softmax_dtype)
        else:
            out = attend(q, k, v, causal=True, softmax_dtype=self.softmax_dtype)
        if self.store == "cache":
            self.cache.write(site, self.writes, k, v)
        elif self.store == "buffer":
            self.buffer.write(site, self.offset, k, v)
        return out


@dataclass
class BatchedGeneration:
    """Emitted tokens of B sequences decoded together, and the run's statistics."""

    tokens: list[Tensor]  # per sequence: prompt + new tokens, (length,)
    prompt_lengths: list[int]
    wall_time: float
    accepted: list[list[int]]  # per sequence: draft tokens accepted per verification (empty for greedy)
    batch_per_pass: list[int]  # active rows of every step (greedy) or block (dtv) after the prefill
    cache_bytes: list[int]  # per sequence: bytes its cache rows held when it finished (policy_bytes)
    allocated_bytes: int  # bytes the batch's cache was allocated
    policy: str

    @property
    def new_tokens(self) -> list[Tensor]:
        return [t[n:] for t, n in zip(self.tokens, self.prompt_lengths, strict=True)]

    @property
    def num_new(self) -> int:
        return sum(len(t) for t in self.new_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_new / self.wall_time if self.wall_time > 0 else float("inf")

    @property
    def tau(self) -> float:
        """Tokens per verification (accepted drafts plus the verifier's token), pooled over sequences."""
        counts = [a + 1 for row in self.accepted for a in row]
        return sum(counts) / len(counts) if counts else float("nan")


def check_rows(model: LoopedLM, prompts: Sequence[Tensor] | Tensor, max_new_tokens: int | Sequence[int],
               margin: int = 0) -> tuple[list[Tensor], list[int]]:
    """Validate B prompts (a (B, n) tensor or a list of 1-d / (1, n) tensors) and per-row token budgets."""
    if isinstance(prompts, Tensor) and prompts.dim() != 2:
        raise ValueError(f"prompts must be a (batch, length) tensor or a list of 1-d tensors, "
                         f"got shape {tuple(prompts.shape)}")
    rows = list(prompts)
    if not rows:
        raise ValueError("prompts must hold at least one prompt")
    budgets = [max_new_tokens] * len(rows) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(rows):
        raise ValueError(f"max_new_tokens must be an int or one int per prompt ({len(rows)}), got {len(budgets)}")
    checked = []
    for row, budget in zip(rows, budgets, strict=True):
        ids = check_prompt(model, row, budget, margin)
        if ids.shape[0] != 1:
            raise ValueError(f"each prompt must be one sequence (1-d or (1, n)), got shape {tuple(row.shape)}")
        checked.append(ids[0])
    return checked, budgets


def _forward(model: LoopedLM, tokens: Tensor, router: RowsPass, num_loops: int) -> Tensor:
    return model(tokens, num_loops, None, positions=router.positions, router=router)


def prefill_rows(model: LoopedLM, cache: BatchedPlaneCache, prompts: list[Tensor], num_loops: int) -> Tensor:
    """Process B prompts (right-padded; padding is never stored nor read) into the cache; (B, 1) next tokens."""
    lengths = torch.tensor([len(p) for p in prompts], device=model.device)
    n = int(lengths.max())
    ids = torch.stack([torch.nn.functional.pad(p, (0, n - len(p))) for p in prompts])
    positions = torch.arange(n, device=model.device).expand(len(prompts), -1)
    logits = _forward(model, ids, RowsPass(cache, positions, counts=lengths), num_loops)
    cache.advance(lengths)
    return logits[torch.arange(len(prompts), device=model.device), lengths - 1].argmax(-1, keepdim=True)


class _Rows:
    """Which sequences the active rows are, what each emitted, and dropping those that are done."""

    def __init__(self, budgets: list[int], progress: bool, desc: str) -> None:
        self.budgets, self.active = budgets, list(range(len(budgets)))
        self.emitted: list[list[Tensor]] = [[] for _ in budgets]
        self.count = [0] * len(budgets)
        self.cache_bytes = [0] * len(budgets)
        self.bar = tqdm(total=sum(budgets), disable=not progress, desc=desc, leave=False)

    def emit(self, tokens: list[Tensor]) -> None:
        for seq, new in zip(self.active, tokens, strict=True):
            self.bar.update(min(len(new), self.budgets[seq] - self.count[seq]))
            self.emitted[seq].append(new)
            self.count[seq] += len(new)

    def drop_finished(self, cache: BatchedPlaneCache, pending: Tensor, buffer: BlockBuffer | None = None) -> Tensor:
        """Drop the rows that emitted their budget from the cache (and buffer); returns the others' pending tokens."""
        keep = [i for i, seq in enumerate(self.active) if self.count[seq] < self.budgets[seq]]
        if len(keep) == len(self.active):
            return pending
        for seq, nbytes in zip(self.active, cache.row_bytes(), strict=True):
            self.cache_bytes[seq] = nbytes
        self.active = [self.active[i] for i in keep]
        if keep:
            cache.keep_rows(keep)
            if buffer is not None:  # block-local contents: only the number of rows changes
                buffer.edge = [t.narrow(-4, 0, len(keep)) for t in buffer.edge]
                buffer.core = [t.narrow(-4, 0, len(keep)) for t in buffer.core]
        return pending[keep]

    def result(self, prompts: list[Tensor], start: float, accepted: list[list[int]], passes: list[int],
               cache: BatchedPlaneCache) -> BatchedGeneration:
        self.bar.close()
        tokens = [torch.cat([p, *new])[:len(p) + budget]
                  for p, new, budget in zip(prompts, self.emitted, self.budgets, strict=True)]
        return BatchedGeneration(tokens, [len(p) for p in prompts], time.perf_counter() - start, accepted, passes,
                                 self.cache_bytes, cache.allocated_bytes, cache.policy.name)


def _capacity(prompts: list[Tensor], budgets: list[int], margin: int, capacity: int | None) -> int:
    need = max(len(p) + b for p, b in zip(prompts, budgets, strict=True)) + margin
    if capacity is not None and capacity < need:
        raise ValueError(f"capacity must be >= {need} (longest prompt + max_new_tokens + {margin}), got {capacity}")
    return need if capacity is None else capacity


@torch.no_grad()
def batched_greedy(model: LoopedLM, prompts: Sequence[Tensor] | Tensor, max_new_tokens: int | Sequence[int], *,
                   policy: CachePolicy, capacity: int | None = None, progress: bool = False) -> BatchedGeneration:
    """Greedy full-depth decoding of B sequences together; row b emits what ``decode.greedy`` emits for it alone.

    ``capacity`` preallocates the cache for that many positions per row (default: the longest need).
    """
    rows, budgets = check_rows(model, prompts, max_new_tokens)
    capacity = _capacity(rows, budgets, 0, capacity)
    R = policy.num_loops
    start = time.perf_counter()
    cache = BatchedPlaneCache(model.config, policy, batch=len(rows), capacity=capacity, dtype=model.dtype,
                              device=model.device)
    state = _Rows(budgets, progress, "batched greedy")
    pending = prefill_rows(model, cache, rows, R)
    state.emit(list(pending))
    passes = []
    while (pending := state.drop_finished(cache, pending)).shape[0]:
        positions = cache.lengths[:, None]
        pending = _forward(model, pending, RowsPass(cache, positions), R)[:, -1:].argmax(-1)
        cache.advance(torch.ones_like(cache.lengths))
        state.emit(list(pending))
        passes.append(len(state.active))
    return state.result(rows, start, [[] for _ in rows], passes, cache)


def accept_rows(drafts: Tensor, targets: Tensor) -> Tensor:
    """(B,) longest prefix of each row of ``drafts`` (B, n) equal to the verifier's ``targets`` (B, >= n)."""
    mismatch = drafts != targets[:, :drafts.shape[1]]
    return torch.where(mismatch.any(1), mismatch.int().argmax(1), drafts.shape[1])


@torch.no_grad()
def batched_speculative(model: LoopedLM, prompts: Sequence[Tensor] | Tensor, max_new_tokens: int | Sequence[int], *,
                        policy: CachePolicy, draft_loops: int, block: int, reads: PrefixReads = ALIGNED,
                        exact: bool = True, capacity: int | None = None, progress: bool = False) -> BatchedGeneration:
    """Draft-then-verify of B sequences together (RIPE Algorithm 1), with ragged acceptance per row.

    Every block: gamma = ``block`` drafts of ``draft_loops`` (d) loops each, one R-loop verification of
    [x, y_1..y_gamma], greedy acceptance per row, and each row commits its own k_b + 1 verified tokens.
    Row b emits what ``speculative.self_speculative`` emits for it alone (greedy decoding when the
    policy is block-independent, RIPE Proposition 1).
    """
    rows, budgets = check_rows(model, prompts, max_new_tokens, margin=block + 1)
    check_speculation(policy, block, exact, 1, draft_loops)  # each row is one sequence
    capacity = _capacity(rows, budgets, block + 1, capacity)
    R = policy.num_loops
    start = time.perf_counter()
    cache = BatchedPlaneCache(model.config, policy, batch=len(rows), capacity=capacity, dtype=model.dtype,
                              device=model.device)
    buffer = BlockBuffer(model.config, R, batch=len(rows), capacity=block + 1, dtype=model.dtype, device=model.device)
    state = _Rows(budgets, progress, "batched draft-then-verify")
    pending = prefill_rows(model, cache, rows, R)
    state.emit(list(pending))
    accepted: list[list[int]] = [[] for _ in rows]
    passes = []
    columns = torch.arange(block + 1, device=model.device)
    while (pending := state.drop_finished(cache, pending, buffer)).shape[0]:
        token, drafts = pending, []
        for i in range(block):
            router = RowsPass(cache, cache.lengths[:, None] + i, reads=reads, buffer=buffer, offset=i, store="buffer")
            token = _forward(model, token, router, draft_loops)[:, -1:].argmax(-1)
            drafts.append(token)
        drafts = torch.cat(drafts, dim=1)
        router = RowsPass(cache, cache.lengths[:, None] + columns, buffer=buffer, store="buffer")
        targets = _forward(model, torch.cat([pending, drafts], dim=1), router, R).argmax(-1)
        k = accept_rows(drafts, targets)
        cache.commit(buffer, k + 1)
        pending = targets.gather(1, k[:, None])
        state.emit([torch.cat([d[:a], p]) for d, a, p in zip(drafts, k.tolist(), pending, strict=True)])
        for seq, a in zip(state.active, k.tolist(), strict=True):
            accepted[seq].append(a)
        passes.append(len(state.active))
    return state.result(rows, start, accepted, passes, cache)


def batched_generate(model: LoopedLM, prompts: Sequence[Tensor] | Tensor, *, max_new_tokens: int | Sequence[int] = 32,
                     method: str = "greedy", cache: str = "full", num_loops: int | None = None,
                     window: int | None = None, k: int | None = None, sinks: int | None = None, draft_loops: int = 4,
                     block: int = 4, prefix_reads: str | tuple[int, int] = "aligned", exact: bool = True,
                     capacity: int | None = None, progress: bool = False) -> BatchedGeneration:
    """Decode B prompts together: ``method`` ``"greedy"`` or ``"dtv"`` (draft-then-verify), under any cache policy.

    Parameters as in :func:`looped_kv.generate` (``cache``, ``window``, ``k``, ``sinks``, ``num_loops``,
    ``draft_loops`` d, ``block`` gamma, ``prefix_reads``, ``exact``); ``max_new_tokens`` may differ per prompt.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    R = model.config.mean_recurrence if num_loops is None else num_loops
    policy = make_policy(cache, R, window=window, k=k, sinks=sinks)
    if method == "greedy":
        return batched_greedy(model, prompts, max_new_tokens, policy=policy, capacity=capacity, progress=progress)
    return batched_speculative(model, prompts, max_new_tokens, policy=policy, draft_loops=draft_loops, block=block,
                               reads=make_prefix_reads(prefix_reads, R), exact=exact, capacity=capacity,
                               progress=progress)


# -- measurements ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputCell:
    """Tokens/s of one batch size (new tokens of all sequences over the wall time, prefill included)."""

    batch: int
    tokens_per_s: float
    wall_time: float
    new_tokens: int
    tau: float  # tokens per verification (nan for greedy)


def _batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = list(batch_sizes)
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be a non-empty list of ints >= 1, got {sizes!r}")
    return sizes


def _batch(prompts: Sequence[Tensor], size: int) -> list[Tensor]:
    """The first ``size`` prompts, cycling through them when there are fewer."""
    return [prompts[i % len(prompts)] for i in range(size)]


OPTIONS = ("num_loops", "window", "k", "sinks", "draft_loops", "block", "prefix_reads", "exact", "capacity")


def _validate(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str, cache: str,
              max_new_tokens: int, options: dict) -> list[int]:
    """Check a measurement's parameters before any work; returns the batch sizes."""
    sizes = _batch_sizes(batch_sizes)
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"options must be among {OPTIONS}, got unknown {unknown}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    R = model.config.mean_recurrence if options.get("num_loops") is None else options["num_loops"]
    policy = make_policy(cache, R, window=options.get("window"), k=options.get("k"), sinks=options.get("sinks"))
    block = options.get("block", 4)
    if method == "dtv":
        check_speculation(policy, block, options.get("exact", True), 1, options.get("draft_loops", 4))
        make_prefix_reads(options.get("prefix_reads", "aligned"), R)
    check_rows(model, list(prompts), max_new_tokens, block + 1 if method == "dtv" else 0)
    return sizes


def throughput_cells(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str = "greedy",
                     cache: str = "full", *, max_new_tokens: int = 16, repeats: int = 1, warmup: bool = True,
                     progress: bool = False, **options) -> list[ThroughputCell]:
    """Tokens/s of batched decoding at each batch size, measured in one run (RIPE Sec. 3.5, Table 8).

    Batch B decodes the first B ``prompts`` (cycling), ``max_new_tokens`` each, with
    :func:`batched_generate` (``options``: ``num_loops``, ``window``, ``k``, ``sinks``, ``draft_loops``,
    ``block``, ``prefix_reads``, ``exact``). A warm-up run at the smallest batch comes first; each cell
    is the fastest of ``repeats`` runs (other load on the machine only slows a run down). Fit the
    cells with :func:`looped_kv.analysis.perf.fit_throughput` for T(B) = B / (a + b B).
    """
    sizes = _validate(model, prompts, batch_sizes, method, cache, max_new_tokens, options)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    settings = dict(max_new_tokens=max_new_tokens, method=method, cache=cache, **options)
    if warmup:
        batched_generate(model, _batch(prompts, min(sizes)), **settings)
    cells = []
    for size in tqdm(sizes, disable=not progress, desc=f"{method}, {cache}: tokens/s", leave=False):
        runs = [batched_generate(model, _batch(prompts, size), **settings) for _ in range(repeats)]
        out = min(runs, key=lambda run: run.wall_time)
        cells.append(ThroughputCell(size, out.tokens_per_s, out.wall_time, out.num_new, out.tau))
    return cells


def memory_cells(model: LoopedLM, prompts: Sequence[Tensor], batch_sizes: Sequence[int], method: str = "greedy",
                 cache: str = "full", *, max_new_tokens: int = 16, progress: bool = False,
                 **options) -> list[MemoryCell]:
    """Peak memory of batched decoding at each batch size (:func:`looped_kv.analysis.memory_bench.peak_bytes`).

    Every batch's cache is allocated for the same ``capacity`` per row (an option; default the longest
    prompt + ``max_new_tokens`` + block + 1), so that the cache term of peak(B) = cache B + o0 + o1 B is one
    number. Use prompts of one length: activations grow with the longest prompt of the batch.
    """
    sizes = _validate(model, prompts, batch_sizes, method, cache, max_new_tokens, options)
    need = max(len(p.reshape(-1)) for p in prompts) + max_new_tokens + options.get("block", 4) + 1
    settings = {"max_new_tokens": max_new_tokens, "method": method, "cache": cache, "capacity": need, **options}
    batched_generate(model, _batch(prompts, 1), **settings)  # warm-up: lazily built tables are not counted
    cells = []
    for size in tqdm(sizes, disable=not progress, desc=f"{method}, {cache}: peak memory", leave=False):
        peak, out = peak_bytes(lambda size=size: batched_generate(model, _batch(prompts, size), **settings),
                               model.device)
        cells.append(MemoryCell(size, peak, out.allocated_bytes))
    return cells


@dataclass(frozen=True)
class FixedMemoryComparison:
    """Full cache at its B_max against the deepest plane at the same batch and at its own B_max (RIPE Sec. 5.3)."""

    budget: float  # bytes
    memory: dict[str, MemoryCheck]  # by cache: the fitted memory model and its B_max under the budget
    cells: dict[str, ThroughputCell]  # "full@B_full", "deepest@B_full", "deepest@B_deep"
    factors: FixedMemoryFactors


def fixed_memory_comparison(model: LoopedLM, prompts: Sequence[Tensor], budget: float, *, method: str = "dtv",
                            memory_batch_sizes: Sequence[int] = (1, 2, 3, 4), fit_on: Sequence[int] = (1, 2),
                            max_new_tokens: int = 16, repeats: int = 1, progress: bool = False,
                            **options) -> FixedMemoryComparison:
    """The fixed-memory throughput gain of the deepest plane over the full cache under ``budget`` bytes.

    For each cache, peak memory is measured at ``memory_batch_sizes``, the model is fitted on ``fit_on``
    and B_max found; then throughput is measured for the full cache at B_full, and for the deepest plane
    at B_full and at B_deep (fastest of ``repeats`` runs), and split by
    :func:`looped_kv.analysis.perf.fixed_memory_factors`. ``options`` go
    to :func:`batched_generate`; the deepest plane is block-dependent, so draft-then-verify runs it with
    ``exact=False``.
    """
    if not budget > 0:
        raise ValueError(f"budget must be > 0 bytes, got {budget}")
    if not set(fit_on) <= set(memory_batch_sizes) or len(set(fit_on)) < 2:
        raise ValueError(f"fit_on must name at least 2 of memory_batch_sizes {list(memory_batch_sizes)}, "
                         f"got {list(fit_on)}")
    full = dict(options)
    deep = {**options, "exact": False} if method == "dtv" else options
    for cache, kwargs in (("full", full), ("deepest", deep)):
        _validate(model, prompts, memory_batch_sizes, method, cache, max_new_tokens, kwargs)
    common = dict(method=method, max_new_tokens=max_new_tokens, progress=progress)
    length = min(len(p.reshape(-1)) for p in prompts)
    same_length = [p.reshape(-1)[:length] for p in prompts]
    memory = {cache: check_memory_model(memory_cells(model, same_length, memory_batch_sizes, cache=cache, **common,
                                                     **kwargs), fit_on, budget)
              for cache, kwargs in (("full", full), ("deepest", deep))}
    b_full, b_deep = memory["full"].b_max, memory["deepest"].b_max
    if b_full < 1:
        raise ValueError(f"budget {budget:.4g} bytes holds no full-cache sequence (B_max = 0); raise it")
    best_full = throughput_cells(model, prompts, [b_full], cache="full", repeats=repeats, **common, **full)[0]
    same, at_max = throughput_cells(model, prompts, [b_full, b_deep], cache="deepest", repeats=repeats, **common,
                                    **deep)
    cells = {f"full@{b_full}": best_full, f"deepest@{b_full}": same, f"deepest@{b_deep}": at_max}
    return FixedMemoryComparison(budget, memory, cells,
                                 fixed_memory_factors(best_full.tokens_per_s, same.tokens_per_s, at_max.tokens_per_s))


# -- command line ----------------------------------------------------------------------------------


def _fit_line(cells: list[ThroughputCell]) -> str:
    try:
        fit: ThroughputFit = fit_throughput([c.batch for c in cells], [c.tokens_per_s for c in cells])
    except ValueError:  # too few cells, or cells that do not saturate
        return "no fit of T(B) = B/(a + bB) with a >= 0, b > 0 on these cells"
    return (f"T(B) = B/(a + bB): T_inf = {fit.t_inf:.1f} tokens/s, B_1/2 = {fit.b_half:.2f}, "
            f"largest residual {100 * fit.max_relative_residual:.1f}%")


def _check_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The command line's checks that need no model: every count, the budget, --fit-on and --device."""
    for flag, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--num-loops", args.num_loops), ("--draft-loops", args.draft_loops), ("--block", args.block),
                        ("--repeats", args.repeats), ("--threads", args.threads)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    for flag, sizes in (("--batch-sizes", args.batch_sizes), ("--memory-batch-sizes", args.memory_batch_sizes)):
        if any(b < 1 for b in sizes):
            ap.error(f"{flag} must all be >= 1, got {sizes}")
    if not (math.isfinite(args.budget_mb) and args.budget_mb >= 0):
        ap.error(f"--budget-mb must be > 0 (or 0 to skip the fixed-memory comparison), got {args.budget_mb}")
    if args.budget_mb:
        unknown = sorted(set(args.fit_on) - set(args.memory_batch_sizes))
        if unknown or len(set(args.fit_on)) < 2:
            ap.error(f"--fit-on must name at least 2 distinct values of --memory-batch-sizes "
                     f"{args.memory_batch_sizes}, got {args.fit_on}")
    if args.num_loops is not None and args.draft_loops >= args.num_loops:
        ap.error(f"--draft-loops must be in [1, {args.num_loops - 1}] (fewer than --num-loops {args.num_loops}), "
                 f"got {args.draft_loops}")
    try:
        check_device(args.device)
    except ValueError as error:
        ap.error(str(error))


def main(argv: list[str] | None = None, prog: str = "python -m looped_kv.batched",
         parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> None:
    """The command line (also ``looped-kv batched``): every argument is checked before the first decoding."""
    ap = parser_class(
        prog=prog,
        description="Batched decoding on CPU (or CUDA): tokens/s against batch size B for greedy decoding and "
                    "draft-then-verify (dtv) with the full and the deepest-plane caches, the peak-memory model "
                    "peak(B) = cache B + o0 + o1 B fitted and checked on held-out batches, and the fixed-memory "
                    "throughput ratio (deepest plane at its B_max / full cache at its B_max) under a budget "
                    "(RIPE Sec. 3.5, 5.3).")
    ap.add_argument("--model", default="tiny", help="'tiny' (default), a checkpoint folder or a hub id")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--workload", default="problems", choices=data.WORKLOADS, help="prompt set (default problems)")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts; larger batches cycle them (default 8)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="B values (default 1 2 4 8)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per sequence (default 16)")
    ap.add_argument("--num-loops", type=int, default=None, help="R (default: the model's mean recurrence)")
    ap.add_argument("--draft-loops", type=int, default=4, help="d, loops per draft, in [1, R - 1] (default 4)")
    ap.add_argument("--block", type=int, default=4, help="gamma, drafts per verification (default 4)")
    ap.add_argument("--budget-mb", type=float, default=24.0,
                    help="memory budget of the fixed-memory comparison, MB = 10^6 bytes above the weights "
                         "(default 24); 0 skips the comparison")
    ap.add_argument("--memory-batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4],
                    help="B values of the peak-memory measurement (default 1 2 3 4)")
    ap.add_argument("--fit-on", type=int, nargs="+", default=[1, 2],
                    help="at least 2 of the --memory-batch-sizes, which the memory model is fitted on; the others "
                         "are held out (default 1 2)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per throughput cell, the fastest kept (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    _check_arguments(ap, args)
    try:  # the config first (no weights): R and the context are known before the model is loaded
        folder = resolve_source(args.model)
        config = LoopedConfig.from_file(folder / "config.json")
    except (OSError, ValueError) as error:
        ap.error(f"--model {args.model!r}: {error}")
    R = config.mean_recurrence if args.num_loops is None else args.num_loops
    if not 1 <= args.draft_loops < R:
        ap.error(f"--draft-loops must be in [1, {R - 1}] (fewer than the R = {R} loops of the model), "
                 f"got {args.draft_loops}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    try:
        model = load(folder, device=args.device)
    except (OSError, ValueError) as error:
        ap.error(f"--model {args.model!r}: {error}")
    if model.tokenizer is None:
        ap.error(f"--model {args.model!r} has no tokenizer; the prompts are text")
    prompts = [model.tokenizer(text, return_tensors="pt").input_ids[0].to(model.device)
               for text in data.prompts(args.workload, args.prompts, split="eval")]
    options = dict(num_loops=R, max_new_tokens=args.max_new_tokens, progress=True)
    dtv = dict(draft_loops=args.draft_loops, block=args.block)
    series = [("greedy", "full", {}), ("greedy", "deepest", {}), ("dtv", "full", dtv),
              ("dtv", "deepest", {**dtv, "exact": False})]
    checks = [(args.batch_sizes, method, cache, extra) for method, cache, extra in series]
    if args.budget_mb:  # the fixed-memory comparison's memory runs (its throughput runs are checked above)
        checks += [(args.memory_batch_sizes, "dtv", cache, extra) for _, cache, extra in series[2:]]
    for sizes, method, cache, extra in checks:  # every series checked before the first decoding
        try:
            _validate(model, prompts, sizes, method, cache, args.max_new_tokens, {"num_loops": R, **extra})
        except ValueError as error:
            ap.error(f"{method}, {cache} cache: {error} (see --max-new-tokens, --num-loops, --draft-loops, --block)")
    with measurement_mode() as mode:  # cuDNN attention off on CUDA (RIPE Sec. 5.5); nothing changes on CPU
        print(f"model {args.model} ({model.dtype}, {args.device}, {torch.get_num_threads()} threads), R = {R}, "
              f"d = {args.draft_loops}, gamma = {args.block}, {args.prompts} {args.workload} prompts "
              f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {args.max_new_tokens} new tokens each; "
              f"cuDNN attention {mode['cudnn_sdp']}")
        print(f"{'method':<8}{'cache':<9}" + "".join(f"{'B=' + str(b):>10}" for b in args.batch_sizes) + "   tokens/s")
        for method, cache, extra in series:
            cells = throughput_cells(model, prompts, args.batch_sizes, method, cache, repeats=args.repeats, **options,
                                     **extra)
            taus = f"  tau {cells[-1].tau:.2f}" if method == "dtv" else ""
            print(f"{method:<8}{cache:<9}" + "".join(f"{c.tokens_per_s:>10.1f}" for c in cells) + taus)
            print(f"{'':17}{_fit_line(cells)}")
        if not args.budget_mb:
            return
        try:
            comparison = fixed_memory_comparison(model, prompts, args.budget_mb * 1e6, method="dtv",
                                                 memory_batch_sizes=args.memory_batch_sizes, fit_on=args.fit_on,
                                                 repeats=args.repeats, **options, **dtv)
        except ValueError as error:  # known only once memory is measured: a budget that holds no sequence
            ap.error(f"--budget-mb {args.budget_mb:g}: {error}")
        print(f"\nfixed memory: budget {args.budget_mb:g} MB (peak bytes allocated by PyTorch during decoding, "
              f"{'CUDA reserved' if model.device.type == 'cuda' else 'CPU allocator events'}), draft-then-verify")
        for name, check in comparison.memory.items():
            fit = check.fit
            errors = ", ".join(f"B={b}: {100 * e:+.3f}%" for b, e in zip(check.held_out, check.held_out_errors,
                                                                         strict=True))
            print(f"  {name:<8} cache {fit.cache_per_seq / 1e6:.3f} MB/seq, o0 = {fit.o0 / 1e3:.1f} kB, "
                  f"o1 = {fit.o1 / 1e6:.3f} MB/seq (fit on B = {list(check.fitted)}); held-out error {errors or '-'}; "
                  f"B_max = {check.b_max}")
        for label, cell in comparison.cells.items():
            print(f"  {label:<12} {cell.tokens_per_s:8.1f} tokens/s (tau {cell.tau:.2f})")
        f = comparison.factors
        print(f"  deepest / full at the full cache's B_max: {f.same_batch:.2f}x; batch factor {f.batch:.2f}x; "
              f"fixed-memory total {f.total:.2f}x")


if __name__ == "__main__":
    main()
