"""The eager passes of the decode loop (:mod:`looped_kv.decoding.loop`): block passes over one cache that read
each row's committed prefix in place; :class:`~looped_kv.decoding.compiled.CompiledPasses` is their compiled,
static-shape counterpart."""

from __future__ import annotations

import torch
from torch import Tensor

from looped_kv.decoding.core import block_positions, prompt_logits, run_block
from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import ALIGNED, CachePolicy, PrefixReads


class Passes:
    """The model passes a drafter and the loop run on one cache (eager here; compiled in
    :class:`~looped_kv.decoding.compiled.CompiledPasses`).

    ``run`` is any pass of n tokens per row after each row's committed prefix (and ``offset`` uncommitted
    ones): d-loop drafts written to the buffer, DAS-Wave's refinement written nowhere. ``verify`` is the
    R-loop verification; ``commit`` keeps the planes of each row's first ``counts`` verified tokens.
    """

    static = False

    def __init__(self, model: LoopedLM, cache: PlaneCache, buffer: BlockBuffer | None, into_cache: bool) -> None:
        self.model, self.cache, self.buffer, self.into_cache = model, cache, buffer, into_cache
        self.policy: CachePolicy = cache.policy

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        return prompt_logits(self.model, self.cache, prompts, self.policy.num_loops)

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

    def verify(self, tokens: Tensor) -> Tensor:
        """One R-loop pass over ``tokens`` (B, n) under the cache policy; logits (B, n, V)."""
        logits, _ = self.run(tokens, self.policy.num_loops, store="cache" if self.into_cache else "buffer")
        return logits

    def commit(self, counts: Tensor) -> None:
        if self.into_cache:
            self.cache.advance(counts)
        else:
            self.cache.commit(self.buffer, counts)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(rows)
        if self.buffer is not None:
            self.buffer.keep_rows(len(rows))
