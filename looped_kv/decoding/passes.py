"""The model's passes over one cache, for the decode loop (:mod:`looped_kv.decoding.loop`).

Convention (RIPE Algorithm 1): the cache holds the planes of every processed token; each row's last emitted token
is *pending* (emitted, not yet processed). A decoder prefills B prompts of any lengths (right-padded; padding is
never stored nor read, :func:`prompt_logits`), then runs passes of (B, n) tokens after each row's committed prefix
through :class:`~looped_kv.runtime.cache.CachePass` (:func:`run_pass`, :func:`step`), in a cache of a bucketed
capacity when compiled (:func:`capacity_bucket`).

:class:`Passes` are the eager passes, reading each row's committed prefix in place;
:class:`~looped_kv.decoding.compiled.CompiledPasses` is their compiled, static-shape counterpart, with the same
interface. Each pass is told, once it has run, as a :class:`PassRecord` with its wall time, to the callback the loop
gives them (its :class:`~looped_kv.decoding.loop.Observer`'s ``ran``): what a pass-cost model
(:mod:`looped_kv.analysis.pass_cost`) predicts a decoder's time from, and what it is checked against."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from looped_kv.decoding.prompts import pad_prompts
from looped_kv.decoding.result import Generation
from looped_kv.decoding.sampling import Pick
from looped_kv.runtime.cache import BlockBuffer, CachePass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import ALIGNED, CachePolicy, PrefixReads


def new_cache(model: LoopedLM, policy: CachePolicy, batch: int, capacity: int) -> PlaneCache:
    return PlaneCache(model.config, policy, batch=batch, capacity=capacity, dtype=model.dtype, device=model.device)


def new_buffer(model: LoopedLM, num_loops: int, batch: int, capacity: int) -> BlockBuffer:
    return BlockBuffer(model.config, num_loops, batch=batch, capacity=capacity, dtype=model.dtype, device=model.device)


def capacity_buckets(block_size: int, smallest: int = 64) -> list[int]:
    """The capacities a compiled run may allocate: powers of two from ``smallest`` and 1.5 times each (64, 96, 128,
    192, 256, ...), then the model's context. A run pads its cache to the next one, and a compiled step attends
    over the whole capacity: the 1.5 steps keep that padding under a third of it at a trace per step."""
    buckets = [smallest]
    while buckets[-1] < block_size:
        b = buckets[-1]
        buckets.append(b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3)
    return [b for b in buckets if b < block_size] + [block_size]


def capacity_bucket(need: int, block_size: int, smallest: int = 64) -> int:
    """The capacity a compiled run allocates for ``need`` positions: the first of :func:`capacity_buckets` that holds
    them, so that runs of nearby lengths share one traced step."""
    return next((b for b in capacity_buckets(block_size, smallest) if b >= need), block_size)


def pass_positions(cache: PlaneCache, n: int, offset: int = 0) -> range | Tensor:
    """Positions of a pass of n tokens after each row's committed prefix (and ``offset`` uncommitted ones)."""
    if len(set(cache.host_lengths)) == 1:
        start = cache.host_lengths[0] + offset
        return range(start, start + n)
    return cache.lengths[:, None] + offset + torch.arange(n, device=cache.lengths.device)


@torch.no_grad()
def run_pass(model: LoopedLM, tokens: Tensor, router: CachePass, num_loops: int,
              initial_state: Tensor | None = None, *, first_loop: int = 1) -> tuple[Tensor, Tensor]:
    """One pass of ``tokens`` (B, n) at ``router.positions`` through ``num_loops`` loops: (logits, final state).
    Inference: the cache's in-place writes record no autograd graph, whatever the caller's grad mode."""
    return model(tokens, num_loops, initial_state, positions=router.positions, router=router, first_loop=first_loop,
                 return_state=True, max_position=router.last_position, check=False)


def picked(logits: Tensor, pick: Pick | None) -> Any:
    """What ``pick`` makes of a pass's ``logits`` (None without one)."""
    if pick is None:
        return None
    fn, args = pick
    return fn(logits, *args)


def check_empty(cache: PlaneCache) -> None:
    """A prefill's cache must hold no tokens yet: a one-line ValueError otherwise."""
    if cache.max_length:
        raise ValueError(f"prefill needs an empty cache, got rows of lengths {cache.host_lengths}")


def prefill(model: LoopedLM, cache: PlaneCache, prompt: Tensor, num_loops: int,
            lengths: Tensor | None = None, record: dict | None = None) -> Tensor:
    """Process prompts (B, n) into an empty cache; returns their logits (B, n, V).

    With ``lengths`` (B,), row b's prompt is its first lengths[b] tokens (right padding is never stored); with
    ``record``, every attention call's keys/values are kept in it too.
    """
    check_empty(cache)
    n = prompt.shape[1]
    router = CachePass(cache, range(0, n), counts=lengths, record=record)
    logits, _ = run_pass(model, prompt, router, num_loops)
    cache.advance(n if lengths is None else lengths)
    return logits


def prompt_logits(model: LoopedLM, cache: PlaneCache, prompts: Sequence[Tensor], num_loops: int,
                  record: dict | None = None) -> Tensor:
    """Prefill B prompts of any lengths; returns the logits of each prompt's last position (B, V)."""
    ids, counts = pad_prompts(prompts)
    return last_logits(prefill(model, cache, ids, num_loops, counts, record), prompts)


def last_logits(logits: Tensor, prompts: Sequence[Tensor]) -> Tensor:
    """Each prompt's logits at its own last position (B, V), of the right-padded prompts' logits (B, n, V)."""
    last = torch.tensor([len(p) for p in prompts], device=logits.device) - 1
    return logits[torch.arange(len(prompts), device=logits.device), last]


def step(model: LoopedLM, cache: PlaneCache, tokens: Tensor, num_loops: int) -> Tensor:
    """Process ``tokens`` (B, n) after each row's prefix, committing their planes; returns logits (B, n, V)."""
    router = CachePass(cache, pass_positions(cache, tokens.shape[1]))
    logits, _ = run_pass(model, tokens, router, num_loops)
    cache.advance(tokens.shape[1])
    return logits


def check_logits(model: LoopedLM, logits: Tensor, what: str) -> None:
    """ValueError naming the model and the pass when ``logits`` hold NaN or an infinity (a broken checkpoint: no
    token follows from them). One reduction to two numbers, min and max, which carry any NaN."""
    if not bool(torch.isfinite(torch.stack(torch.aminmax(logits))).all()):
        raise ValueError(f"model {getattr(model, 'source', type(model).__name__)!r}: the {what} gave NaN or infinite "
                         f"logits; no token follows from them (check the checkpoint's weights and config)")


#: One DAS-Wave round (:meth:`Passes.wave`): positions < previous start from the last round's states, the first width
#: positions are refined, from loop first_loop on.
Round = tuple[int, int, int]


@dataclass(frozen=True)
class PassRecord:
    """One model pass: its ``kind`` (prefill, draft, refine or verify; "drafts": a compiled chain of ``tokens``
    one-token drafts in one step, :meth:`Passes.drafts`; "wave": a compiled DAS-Wave wave of ``tokens`` rounds of
    ``loops`` loops each in one step, whose rounds refine ``widths`` positions, :meth:`Passes.wave`), the batch
    ``rows``, the new ``tokens`` per row
    (the prefill: the longest prompt), its ``loops`` and the prefix positions its attention reads, ``context``: eager,
    the longest row's committed prefix and the block's earlier drafts; compiled, the cache's whole capacity (a static
    step attends over all of it under masks); 0 for the prefill. ``compiled``: whether it ran on a compiled step.
    ``in_place``: a verification written into the cache past each row's length and read there
    (:meth:`Passes.verification_store`), rather than into the block buffer. ``seconds``: its wall time, from the
    call to its result (the device synchronized first)."""

    kind: str
    rows: int
    tokens: int
    loops: int
    context: int
    compiled: bool
    in_place: bool = False
    seconds: float | None = None
    widths: tuple[int, ...] = ()


class Passes:
    """The model passes a drafter and the loop run on one cache (eager here; compiled in
    :class:`~looped_kv.decoding.compiled.CompiledPasses`). The passes own every write: into the cache, and into a
    block buffer of ``width`` columns (the drafter's :attr:`~looped_kv.decoding.loop.Drafter.width`; 0: no buffer)
    that holds a block's uncommitted keys/values.

    ``run`` is any pass of n tokens per row after each row's committed prefix (and ``offset`` uncommitted
    ones): d-loop drafts written to the buffer; ``drafts`` chains a block's one-token drafts. ``refine`` is one
    DAS-Wave round, written nowhere, and ``wave`` a wave of them. ``verify`` is the R-loop verification; it returns
    where its keys/values wait, and ``commit`` keeps the planes of each row's first ``counts`` verified tokens from
    there. ``run``, ``drafts`` and ``verify`` also return the tokens their ``pick`` makes of their logits
    (:data:`~looped_kv.decoding.sampling.Pick`; compiled passes run it inside their graph). ``padded_width`` is the
    width a proposal runs at. Each pass is given to ``on_pass`` (if any) as a :class:`PassRecord`. ``report`` adds
    what the passes measured to the run's result.
    """

    compiled = False

    def __init__(self, model: LoopedLM, cache: PlaneCache, width: int = 0,
                 on_pass: Callable[[PassRecord], None] | None = None) -> None:
        self.model, self.cache, self.on_pass = model, cache, on_pass
        self.policy: CachePolicy = cache.policy
        self.buffer = new_buffer(model, self.policy.num_loops, cache.batch, width) if width else None

    def _tell(self, start: float, kind: str, tokens: int, loops: int, context: int, compiled: bool | None = None,
              in_place: bool = False, widths: tuple[int, ...] = ()) -> None:
        """Tell ``on_pass`` of a pass that began at ``start`` (:func:`time.perf_counter`) and has just returned
        (``compiled``: default whether these passes are)."""
        if self.on_pass is not None:
            if self.cache.lengths.device.type == "cuda":
                torch.cuda.synchronize()
            self.on_pass(PassRecord(kind, self.cache.batch, tokens, loops, context,
                                    self.compiled if compiled is None else compiled, in_place,
                                    time.perf_counter() - start, widths))

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        start = time.perf_counter()
        logits = prompt_logits(self.model, self.cache, prompts, self.policy.num_loops)
        check_logits(self.model, logits, "prefill")
        self._tell(start, "prefill", max(len(p) for p in prompts), self.policy.num_loops, 0, compiled=False)
        return logits

    def padded_width(self, width: int, most: int) -> int:
        """The columns a proposal of up to ``width`` tokens per row (of at most ``most``) runs at: ``width`` itself,
        as eager passes run any width."""
        return width

    def run(self, tokens: Tensor, num_loops: int, *, reads: PrefixReads = ALIGNED, offset: int = 0,
            store: str | None = None, state: Tensor | None = None, first_loop: int = 1,
            pick: Pick | None = None) -> tuple[Tensor, Tensor, Any]:
        start = time.perf_counter()
        logits, state = self._run(tokens, num_loops, reads=reads, offset=offset, store=store, state=state,
                                  first_loop=first_loop)
        picks = picked(logits, pick)
        self._tell(start, "draft", tokens.shape[1], num_loops, self.cache.max_length + offset)
        return logits, state, picks

    def drafts(self, token: Tensor, num_loops: int, *, reads: PrefixReads,
               picks: Sequence[Pick]) -> tuple[Tensor, list[Any]]:
        """One draft per pick, in sequence (RIPE Algorithm 1, lines 2-4): the i-th a one-token ``num_loops``-loop pass
        of the (i - 1)-th draft (the first: each row's pending ``token`` (B, 1)) at offset i, reading the prefix per
        ``reads`` and the earlier drafts in the buffer, where it writes its own keys/values, its draft the first
        output of ``picks[i]``. Returns the drafts (B, len(picks)) and each pick's second output (its q, or None when
        greedy). Eager, each draft is a pass told on its own; compiled, the chain is one step."""
        drafts, q = [], []
        for i, pick in enumerate(picks):
            _, _, (token, q_i) = self.run(token, num_loops, reads=reads, offset=i, store="buffer", pick=pick)
            drafts.append(token)
            q.append(q_i)
        return torch.cat(drafts, dim=1), q

    def _run(self, tokens: Tensor, num_loops: int, *, reads: PrefixReads = ALIGNED, offset: int = 0,
             store: str | None = None, state: Tensor | None = None, first_loop: int = 1) -> tuple[Tensor, Tensor]:
        """:meth:`run`, told to no one (the eager refinement and verification are told as what they are)."""
        router = CachePass(self.cache, pass_positions(self.cache, tokens.shape[1], offset), reads=reads,
                           buffer=self.buffer, offset=offset, store=store)
        return run_pass(self.model, tokens, router, num_loops, state, first_loop=first_loop)

    def initial_state(self, tokens: Tensor) -> Tensor:
        """The initial states of ``tokens`` (B, n) at the n positions after each row's committed prefix
        (B, n, n_embd), a new tensor (Ouro: their embedding)."""
        n = tokens.shape[1]
        positions = pass_positions(self.cache, n)
        if isinstance(positions, range):
            positions = torch.arange(positions.start, positions.stop, device=self.cache.lengths.device)
            positions = positions.expand(self.cache.batch, -1)
        return self.model.initial_state(positions, self.cache.batch, last=self.cache.max_length + n - 1,
                                        tokens=tokens)

    def refine(self, guesses: Tensor, carried: Tensor | None, previous: int, width: int, num_loops: int, *,
               reads: PrefixReads, first_loop: int) -> tuple[Tensor, Tensor, Tensor]:
        """One DAS-Wave round (DAS Eq. 5-6; :func:`~looped_kv.decoding.das_wave.wave`) over the first ``width``
        positions after each row's anchor, whose guesses are ``guesses`` (B, max_width + 1): ``num_loops`` recurrent
        updates from loop ``first_loop`` on, reading the prefix per ``reads`` and each other's current keys/values
        (nothing is stored). Positions < ``previous`` start from the ``carried`` states of the last round (None:
        nothing carried), the others from their initial states.

        Returns the guesses with position i's readout in guess i + 1, the round's states (the first ``width`` are
        the refined positions'; carry them to the next round) and its logits (B, >= width, V)."""
        start = time.perf_counter()
        state = self.initial_state(guesses[:, :width])
        if carried is not None:
            state[:, :previous] = carried[:, :previous]
        logits, state = self._run(guesses[:, :width], num_loops, reads=reads, state=state, first_loop=first_loop)
        guesses = torch.cat([guesses[:, :1], logits.argmax(-1), guesses[:, width + 1:]], dim=1)
        self._tell(start, "refine", width, num_loops, self.cache.max_length)
        return guesses, state, logits

    def wave(self, guesses: Tensor, rounds: Sequence[Round], num_loops: int, *, reads: PrefixReads,
             fused: bool = False, trace: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """DAS-Wave's rounds (DAS Eq. 5-6) one after the other (:meth:`refine`): round (previous, width, first_loop)
        refines the first width positions with ``num_loops`` loops from loop first_loop on, positions < previous
        starting from the last round's states. Returns the guesses after the last round and its logits (B, >= width,
        V). ``fused``: compiled passes run the rounds in one step (eager ones run them one by one alike). With
        ``trace``, each round's guesses after its readout (B, width) are appended to it."""
        logits = states = None
        for previous, width, first_loop in rounds:
            del logits  # not held through the next round's pass
            guesses, states, logits = self.refine(guesses, states if previous else None, previous, width, num_loops,
                                                  reads=reads, first_loop=first_loop)
            if trace is not None:
                trace.append(guesses[:, 1:width + 1].clone())
        return guesses, logits

    def verification_store(self, n: int) -> str:
        """Where a verification of ``n`` tokens per row writes its keys/values: the cache, past each row's length, for
        one token per row (a row always commits the token it verifies first, its pending one) and for a block where
        every plane is last written by its own loop (:attr:`~looped_kv.runtime.policy.CachePolicy.in_own_plane`:
        the block reads itself there, in one fused call, and the rejected tokens' entries lie past each row's
        length, where nothing reads them); else the block buffer (a row commits only its accepted prefix)."""
        return "cache" if n == 1 or self.policy.in_own_plane else "buffer"

    def verify(self, tokens: Tensor, pick: Pick) -> tuple[Tensor, str, Any]:
        """One R-loop pass over ``tokens`` (B, n) under the cache policy: its logits (B, n, V), where its
        keys/values wait for :meth:`commit` (:meth:`verification_store`), and the tokens ``pick`` makes of them."""
        start = time.perf_counter()
        store = self.verification_store(tokens.shape[1])
        logits, _ = self._run(tokens, self.policy.num_loops, store=store)
        check_logits(self.model, logits, f"verification pass at position {self.cache.max_length}")
        targets = picked(logits, pick)
        self._tell(start, "verify", tokens.shape[1], self.policy.num_loops, self.cache.max_length,
                   in_place=store == "cache")
        return logits, store, targets

    def commit(self, counts: Tensor, store: str) -> None:
        """Keep the planes of each row's first ``counts`` verified tokens, which the verification wrote to
        ``store``: the cache (written past each row's length: advance over them) or the buffer (copied in)."""
        if store == "cache":
            self.cache.advance(counts)
        else:
            self.cache.commit(self.buffer, counts)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(rows)
        if self.buffer is not None:
            self.buffer.keep_rows(len(rows))

    def report(self, out: Generation) -> Generation:
        """The run's result ``out`` with what these passes measured (here: nothing)."""
        return out
