"""The eager passes of the decode loop (:mod:`looped_kv.decoding.loop`): block passes over one cache that read
each row's committed prefix in place; :class:`~looped_kv.decoding.compiled.CompiledPasses` is their compiled,
static-shape counterpart, with the same interface."""

from __future__ import annotations

import torch
from torch import Tensor

from looped_kv.decoding.core import block_positions, new_buffer, prompt_logits, run_block
from looped_kv.runtime.cache import BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import ALIGNED, CachePolicy, PrefixReads


class Passes:
    """The model passes a drafter and the loop run on one cache (eager here; compiled in
    :class:`~looped_kv.decoding.compiled.CompiledPasses`). The passes own every write: into the cache, and into a
    block buffer of ``width`` columns (the drafter's :attr:`~looped_kv.decoding.loop.Drafter.width`; 0: no buffer)
    that holds a block's uncommitted keys/values.

    ``run`` is any pass of n tokens per row after each row's committed prefix (and ``offset`` uncommitted
    ones): d-loop drafts written to the buffer. ``refine`` is one DAS-Wave round, written nowhere. ``verify`` is the
    R-loop verification; it returns where its keys/values wait, and ``commit`` keeps the planes of each row's first
    ``counts`` verified tokens from there. ``padded_width`` is the width a proposal runs at.
    """

    def __init__(self, model: LoopedLM, cache: PlaneCache, width: int = 0) -> None:
        self.model, self.cache = model, cache
        self.policy: CachePolicy = cache.policy
        self.buffer = new_buffer(model, self.policy.num_loops, cache.batch, width) if width else None

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        return prompt_logits(self.model, self.cache, prompts, self.policy.num_loops)

    def padded_width(self, width: int, most: int) -> int:
        """The columns a proposal of up to ``width`` tokens per row (of at most ``most``) runs at: ``width`` itself,
        as eager passes run any width."""
        return width

    def run(self, tokens: Tensor, num_loops: int, *, reads: PrefixReads = ALIGNED, offset: int = 0,
            store: str | None = None, state: Tensor | None = None, first_loop: int = 1) -> tuple[Tensor, Tensor]:
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
        logits, state = self.run(guesses[:, :width], num_loops, reads=reads, state=state, first_loop=first_loop)
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
        logits, _ = self.run(tokens, self.policy.num_loops, store=store)
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
