"""The passes of greedy decoding with adaptive depth per token (early exit; the criteria in
:mod:`looped_kv.decoding.exits`).

:func:`adaptive_pass` runs n tokens per row loop by loop through one cache pass
(:class:`~looped_kv.runtime.cache.CachePass`, the decoders' own router over the cache), asking the row's criterion
after each loop at one column (the prompt's last position in the prefill; the one token of a decoding step): a row
whose criterion fires keeps its state and stops computing for itself. The batch runs on while any row does (as the
reference's batched ``generate_with_adaptive_compute`` does), and :class:`HeldReads` holds every exited row's core
keys and values at those of its exit (``exited_reads="last"``) or of its last kept plane (``"nearest-below"``): each
loop past its exit writes them where that loop writes, in the cache and for the pass's own reads, so that the planes
past a token's exit hold what the read policy says. When every row has exited, the loops left are written the same
way without running them; the readout of each row's exit state then writes the coda's planes and gives the logits.

:class:`AdaptivePasses` are the decode loop's passes with this prefill and this verification (one token per row),
eager; they record each position's exit loop, and report per row the loop whose logits chose each emitted token
(:attr:`~looped_kv.decoding.result.Generation.row_loops`) and the bytes of the distinct planes the cache holds
(:func:`~looped_kv.runtime.memory.exit_bytes`). A pass is told to ``on_pass`` once it has run, with the loops the
batch ran (its rows' deepest exit); a criterion that reads logits also runs the readout after every loop, which a
:class:`~looped_kv.decoding.passes.PassRecord` does not count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from looped_kv.decoding.exits import ExitRule
from looped_kv.decoding.passes import Passes, PassRecord, check_empty, check_logits, pass_positions, picked
from looped_kv.decoding.prompts import pad_prompts
from looped_kv.decoding.result import Generation
from looped_kv.decoding.sampling import Pick
from looped_kv.runtime.attention import Site
from looped_kv.runtime.cache import CachePass, PlaneCache
from looped_kv.runtime.memory import exit_bytes
from looped_kv.runtime.model import LoopedLM


class HeldReads:
    """A cache pass's router that holds exited rows' core keys and values: at each core call, rows marked
    :attr:`exited` get the keys/values kept for that layer, and the call's keys/values are kept when its loop is one of
    ``held_loops``. Every call then goes to ``router``, which reads the prefix and writes the pass's tokens."""

    def __init__(self, router: CachePass, held_loops: frozenset[int]) -> None:
        self.router, self.held_loops = router, held_loops
        self.exited: Tensor | None = None  # (B,) bool
        self.held: dict[int, tuple[Tensor, Tensor]] = {}

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        if site.stage == "core":
            if self.exited is not None and site.layer in self.held:
                exited = self.exited[:, None, None, None]
                held_keys, held_values = self.held[site.layer]
                keys, values = torch.where(exited, held_keys, keys), torch.where(exited, held_values, values)
            if site.loop in self.held_loops:
                self.held[site.layer] = (keys, values)
        return self.router.attend(site, queries, keys, values)

    def finish(self, cache: PlaneCache, last_loop: int) -> None:
        """Every row has exited by ``last_loop``: write the held keys/values as the planes of the loops after it."""
        later = range(last_loop + 1, cache.policy.num_loops + 1)
        sites = {Site("core", layer, r): kv for layer, kv in self.held.items() for r in later}
        if sites:
            cache.write(self.router.writes, sites)


def adaptive_pass(model: LoopedLM, tokens: Tensor, router: CachePass, rule: ExitRule,
                  column: Tensor) -> tuple[Tensor, Tensor]:
    """Run ``tokens`` (B, n) through the loops until each row's criterion fires at its ``column`` (B,), writing their
    planes through ``router`` (``store="cache"``). Returns the logits (B, n, V) of each row's exit states and the
    rows' exit loops (B,)."""
    R, B = rule.policy.num_loops, tokens.shape[0]
    reads = HeldReads(router, rule.held_loops)
    positions, rows = router.positions, torch.arange(B, device=tokens.device)
    embedded = model.embed(tokens, positions, reads)
    state = model.resolve_state(None, positions, B, router.last_position, embedded)
    criterion, weights = rule.new(), model.core_weights()
    criterion.start(state[rows, column])
    loops = torch.full((B,), R, device=tokens.device)
    exited = torch.zeros(B, dtype=torch.bool, device=tokens.device)
    final = state
    for loop in range(1, R + 1):
        state = model.loop(state, embedded, positions, reads, loop, weights, tokens=tokens)
        if reads.exited is not None:
            state = torch.where(exited[:, None, None], final, state)
        if criterion.reads == "logits":
            read = model.readout(state, positions, reads, tokens=tokens)[rows, column]
        elif criterion.reads == "gate":
            read = model.transformer.exit_gate(state[rows, column]).squeeze(-1)
        else:
            read = state[rows, column] if criterion.reads == "state" else None
        new = (criterion.step(loop, read) | (loop == R)) & ~exited
        final = torch.where(new[:, None, None], state, final)
        loops = torch.where(new, loop, loops)
        exited = exited | new
        reads.exited = exited
        if bool(exited.all()):
            break
    reads.finish(router.cache, loop)
    return model.readout(final, positions, reads, tokens=tokens), loops


class AdaptivePasses(Passes):
    """The decode loop's passes for greedy decoding with early exit by ``rule`` (eager): an adaptive prefill and an
    adaptive one-token verification; each position's exit loop is recorded per prompt."""

    def __init__(self, model: LoopedLM, cache: PlaneCache, rule: ExitRule,
                 on_pass: Callable[[PassRecord], None] | None = None) -> None:
        super().__init__(model, cache, 0, on_pass)
        self.rule = rule
        self.order = list(range(cache.batch))  # the prompt of each batch row
        self.loops: list[list[int]] = [[] for _ in self.order]  # per prompt: each stored position's exit loop

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        check_empty(self.cache)
        start = time.perf_counter()
        ids, counts = pad_prompts(prompts)
        last = torch.tensor([len(p) - 1 for p in prompts], device=ids.device)
        router = CachePass(self.cache, range(0, ids.shape[1]), counts=counts)
        logits, loops = adaptive_pass(self.model, ids, router, self.rule, last)
        self.cache.advance(ids.shape[1] if counts is None else counts)
        for seq, (prompt, loop) in enumerate(zip(prompts, loops.tolist(), strict=True)):
            self.loops[seq] = [loop] * len(prompt)
        logits = logits[torch.arange(len(prompts), device=ids.device), last]
        check_logits(self.model, logits, "prefill")
        self._tell(start, "prefill", ids.shape[1], int(loops.max()), 0)
        return logits

    def verify(self, tokens: Tensor, pick: Pick) -> tuple[Tensor, str, Any]:
        """One token per row (B, 1) through the loops until each row exits; its keys/values go straight into the
        cache."""
        if tokens.shape[1] != 1:
            raise ValueError(f"early exit verifies one token per row (greedy decoding), got {tokens.shape[1]}")
        start = time.perf_counter()
        router = CachePass(self.cache, pass_positions(self.cache, 1))
        column = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        logits, loops = adaptive_pass(self.model, tokens, router, self.rule, column)
        check_logits(self.model, logits, f"verification pass at position {self.cache.max_length}")
        self._tell(start, "verify", 1, int(loops.max()), self.cache.max_length, in_place=True)
        for seq, loop in zip(self.order, loops.tolist(), strict=True):
            self.loops[seq].append(loop)
        return logits, "cache", picked(logits, pick)

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self.order = [self.order[i] for i in rows]

    def report(self, out: Generation) -> Generation:
        """``out`` with each row's loop per emitted token (its positions' from the prompt's last on), the rule's
        options and the bytes of the distinct planes of each row's stored positions."""
        distinct = [exit_bytes(self.model.config, self.rule.policy, loops, self.rule.exited_reads, self.model.dtype)
                    for loops in self.loops]
        row_loops = [loops[n - 1:] for loops, n in zip(self.loops, out.prompt_lengths, strict=True)]
        return replace(out, row_loops=row_loops, exit=self.rule.options, row_distinct_cache_bytes=distinct)
