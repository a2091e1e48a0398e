"""The eager passes of the decode loop (:mod:`looped_kv.decoding.loop`): block passes over one cache that read
each row's committed prefix in place; :class:`~looped_kv.decoding.compiled.CompiledPasses` is their compiled,
static-shape counterpart, with the same interface. Each pass is told, as a :class:`PassRecord`, to the callback the
loop gives them (its :class:`~looped_kv.decoding.loop.Observer`'s ``ran``): what a pass-cost model
(:mod:`looped_kv.analysis.pass_cost`) predicts a decoder's time from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from looped_kv.decoding.core import Generation, block_positions, new_buffer, prompt_logits, run_block
from looped_kv.runtime.cache import BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import ALIGNED, CachePolicy, PrefixReads


@dataclass(frozen=True)
class PassRecord:
    """One model pass: its ``kind`` (prefill, draft, refine or verify), the batch ``rows``, the new ``tokens`` per row
    (the prefill: the longest prompt), its ``loops`` and the prefix positions its attention reads, ``context``: eager,
    the longest row's committed prefix and the block's earlier drafts; compiled, the cache's whole capacity (a static
    step attends over all of it under masks); 0 for the prefill. ``compiled``: whether it ran on a compiled step."""

    kind: str
    rows: int
    tokens: int
    loops: int
    context: int
    compiled: bool


class Passes:
    """The model passes a drafter and the loop run on one cache (eager here; compiled in
    :class:`~looped_kv.decoding.compiled.CompiledPasses`). The passes own every write: into the cache, and into a
    block buffer of ``width`` columns (the drafter's :attr:`~looped_kv.decoding.loop.Drafter.width`; 0: no buffer)
    that holds a block's uncommitted keys/values.

    ``run`` is any pass of n tokens per row after each row's committed prefix (and ``offset`` uncommitted
    ones): d-loop drafts written to the buffer. ``refine`` is one DAS-Wave round, written nowhere. ``verify`` is the
    R-loop verification; it returns where its keys/values wait, and ``commit`` keeps the planes of each row's first
    ``counts`` verified tokens from there. ``padded_width`` is the width a proposal runs at. Each pass is given to
    ``on_pass`` (if any) as a :class:`PassRecord`. ``report`` adds what the passes measured to the run's result.
    """

    compiled = False

    def __init__(self, model: LoopedLM, cache: PlaneCache, width: int = 0,
                 on_pass: Callable[[PassRecord], None] | None = None) -> None:
        self.model, self.cache, self.on_pass = model, cache, on_pass
        self.policy: CachePolicy = cache.policy
        self.buffer = new_buffer(model, self.policy.num_loops, cache.batch, width) if width else None

    def _tell(self, kind: str, tokens: int, loops: int, context: int, compiled: bool | None = None) -> None:
        """Tell ``on_pass`` of a pass (``compiled``: default whether these passes are)."""
        if self.on_pass is not None:
            self.on_pass(PassRecord(kind, self.cache.batch, tokens, loops, context,
                                    self.compiled if compiled is None else compiled))

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        self._tell("prefill", max(len(p) for p in prompts), self.policy.num_loops, 0, compiled=False)
        return prompt_logits(self.model, self.cache, prompts, self.policy.num_loops)

    def padded_width(self, width: int, most: int) -> int:
        """The columns a proposal of up to ``width`` tokens per row (of at most ``most``) runs at: ``width`` itself,
        as eager passes run any width."""
        return width

    def run(self, tokens: Tensor, num_loops: int, *, reads: PrefixReads = ALIGNED, offset: int = 0,
            store: str | None = None, state: Tensor | None = None, first_loop: int = 1) -> tuple[Tensor, Tensor]:
        self._tell("draft", tokens.shape[1], num_loops, self.cache.max_length + offset)
        return self._run(tokens, num_loops, reads=reads, offset=offset, store=store, state=state, first_loop=first_loop)

    def _run(self, tokens: Tensor, num_loops: int, *, reads: PrefixReads = ALIGNED, offset: int = 0,
             store: str | None = None, state: Tensor | None = None, first_loop: int = 1) -> tuple[Tensor, Tensor]:
        """:meth:`run`, told to no one (the eager refinement and verification are told as what they are)."""
        router = BlockPass(self.cache, block_positions(self.cache, tokens.shape[1], offset), reads=reads,
                           buffer=self.buffer, offset=offset, store=store)
        return run_block(self.model, tokens, router, num_loops, state, first_loop=first_loop)

    def initial_state(self, tokens: Tensor) -> Tensor:
        """The initial states of ``tokens`` (B, n) at the n positions after each row's committed prefix
        (B, n, n_embd), a new tensor (Ouro: their embedding)."""
        n = tokens.shape[1]
        positions = block_positions(self.cache, n)
        if isinstance(positions, range):
            positions = torch.arange(positions.start, positions.stop, device=self.cache.lengths.device)
            positions = positions.expand(self.cache.batch, -1)
        return self.model.initial_state(positions, self.cache.batch, last=self.cache.max_length + n - 1,
                                        tokens=tokens)

    def refine(self, guesses: Tensor, carried: Tensor | None, previous: int, width: int, num_loops: int, *,
               reads: PrefixReads, first_loop: int) -> tuple[Tensor, Tensor, Tensor]:
        """One DAS-Wave round (DAS Eq. 5-6; :func:`~looped_kv.decoding.das_wave.wave`) over the first ``width``
        positions after each row's anchor, whose guesses are ``guesses`` (B, gamma + 1): ``num_loops`` recurrent
        updates from loop ``first_loop`` on, reading the prefix per ``reads`` and each other's current keys/values
        (nothing is stored). Positions < ``previous`` start from the ``carried`` states of the last round (None:
        nothing carried), the others from their initial states.

        Returns the guesses with position i's readout in guess i + 1, the round's states (the first ``width`` are
        the refined positions'; carry them to the next round) and its logits (B, >= width, V)."""
        state = self.initial_state(guesses[:, :width])
        if carried is not None:
            state[:, :previous] = carried[:, :previous]
        self._tell("refine", width, num_loops, self.cache.max_length)
        logits, state = self._run(guesses[:, :width], num_loops, reads=reads, state=state, first_loop=first_loop)
        return torch.cat([guesses[:, :1], logits.argmax(-1), guesses[:, width + 1:]], dim=1), state, logits

    def verification_store(self, n: int) -> str:
        """Where a verification of ``n`` tokens per row writes its keys/values: one token straight into the cache
        (a row always commits the token it verifies first, its pending one), a block into the buffer (a row
        commits only its accepted prefix)."""
        return "cache" if n == 1 else "buffer"

    def verify(self, tokens: Tensor) -> tuple[Tensor, str]:
        """One R-loop pass over ``tokens`` (B, n) under the cache policy: its logits (B, n, V), and where its
        keys/values wait for :meth:`commit` (:meth:`verification_store`)."""
        store = self.verification_store(tokens.shape[1])
        self._tell("verify", tokens.shape[1], self.policy.num_loops, self.cache.max_length)
        logits, _ = self._run(tokens, self.policy.num_loops, store=store)
        return logits, store

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
