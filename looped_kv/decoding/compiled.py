"""Every decoder's passes on torch.compile'd steps with static shapes (gpt-fast style).

:class:`CompiledPasses` gives the decode loop (:mod:`looped_kv.decoding.loop`) the passes of every method,
each a traced function over the whole preallocated cache (:class:`~looped_kv.runtime.cache.StaticCachePass`):
every attention call reads the whole capacity of the planes it reads under masks built from the row
lengths on the device, plus the block's earlier drafts in the buffer and the block itself, in one softmax.
So each tensor has one shape at every call, and a step is traced once per shape:

* the prefill (:class:`~looped_kv.runtime.cache.PrefillPass`) runs the right-padded prompts causally into the
  empty cache, traced with the prompt length and the capacity as dynamic sizes: one trace for every prompt
  length, under every policy (each row's last W + 1 positions go to the ring, its first to the sinks);
* greedy steps and verification blocks (one token, gamma + 1 or DAS-Wave's w, all R loops) write their
  keys and values into the cache at each row's next positions through
  :meth:`~looped_kv.runtime.cache.PlaneCache.write`, past the committed length until the commit
  advances it; with a window or sinks, or planes not written by their own loop (first(k)), a block of
  more than one token is written to the block buffer and committed from it;
* a d-loop draft writes into the buffer at its column, a 0-d tensor, so the gamma drafts of a block share
  one trace; a block's gamma one-token drafts, each of the last one's token, are one traced chain
  (:meth:`CompiledPasses.drafts`), at about half the time of as many calls;
* the tokens a draft or verification picks from its logits (the argmax, or the sampler's draws and the speculative
  sampling rule: :data:`~looped_kv.decoding.sampling.Pick`) are computed in its graph, at no call of their own;
* a DAS-Wave round refines the first :func:`refined_width` positions, a bucket of its active width (the
  inactive ones after the active ones, so no active position reads them), and keeps the active guesses and
  states with masks, so its J rounds take one trace per width bucket whenever they read the same planes
  (always with deep K/V reads); with ``fuse_rounds`` the J rounds are one traced step (:meth:`CompiledPasses.wave`).

The cache's capacity is bucketed (:func:`~looped_kv.decoding.passes.capacity_bucket`), so prompts of new
lengths reuse a trace, and stopped rows stay in the batch as padding. Writing into the planes inside the
graph is done in place (an index_put on a graph input). In float64 the compiled passes emit the eager ones'
tokens for every method (tested). ``BACKEND`` is torch.compile's ``backend``, and ``OPTIONS`` its Inductor options
for each kind of device.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from looped_kv.decoding.passes import (
    Passes,
    PassRecord,
    Round,
    capacity_bucket,
    check_empty,
    check_logits,
    last_logits,
    picked,
)
from looped_kv.decoding.prompts import pad_prompts
from looped_kv.decoding.sampling import Pick
from looped_kv.runtime.cache import BlockBuffer, PlaneCache, PrefillPass, StaticCachePass
from looped_kv.runtime.model import LoopedLM, check_finite
from looped_kv.runtime.policy import ALIGNED, PrefixReads, read_planes

BACKEND: str | object = "inductor"
#: Inductor's options per device type. On a CPU a decode step of one row has matrix products of one row, where a
#: library call costs more than its arithmetic: Inductor's ``decompose_mm_pass`` writes each as a product and a sum,
#: fused with the ops around it into a few C++ kernels, and a C++ wrapper calls them (``looped-kv speed`` prints
#: compiled / reference). Products of more rows (batched steps, verification blocks, DAS-Wave rounds) stay library
#: calls, as do the prefill's products over all prompt positions. On a GPU, torch.compile's defaults.
OPTIONS: dict[str, dict[str, object]] = {"cpu": {"cpp_wrapper": True,
                                                 "post_grad_fusion_options": {"decompose_mm_pass": {}}}}


def _forward(model: LoopedLM, cache: PlaneCache, buffer: BlockBuffer | None, tokens: Tensor, lengths: Tensor,
             offset: Tensor | None, state: Tensor | None, num_loops: int, planes: tuple, store: str | None,
             pick: Pick | None) -> tuple[Tensor, Tensor, object]:
    """One static pass of ``tokens`` (B, n) after each row's ``lengths`` (and ``offset`` drafts): (logits, state,
    the tokens ``pick`` makes of the logits, in the same graph)."""
    positions = lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
    if offset is not None:
        positions = positions + offset
    router = StaticCachePass(cache, positions, lengths, planes, buffer=buffer, offset=offset, store=store)
    out = model(tokens, num_loops, state, positions=positions, router=router, return_state=True,
                max_position=cache.capacity - 1, check=False)
    router.store_block()
    return (*out, picked(out[0], pick))


def _checked(out: tuple[Tensor, Tensor, object]) -> tuple[Tensor, Tensor, object, Tensor]:
    """A verification's outputs and whether its logits are all finite (0-d), computed in its graph: the host reads
    one flag instead of running a check of its own (a few small ops per step, 3-4% of a compiled greedy step)."""
    return (*out, torch.isfinite(out[0]).all())


# One traced function per kind of pass (each its own code object, so each has torch.compile's recompile limit).
def _step(model, cache, buffer, tokens, lengths, offset, state, num_loops, planes, store, pick):
    return _checked(_forward(model, cache, buffer, tokens, lengths, offset, state, num_loops, planes, store, pick))


def _draft(model, cache, buffer, tokens, lengths, offset, state, num_loops, planes, store, pick):
    return _forward(model, cache, buffer, tokens, lengths, offset, state, num_loops, planes, store, pick)


def _drafts(model, cache, buffer, token, lengths, num_loops, planes, picks):
    """:meth:`~looped_kv.decoding.passes.Passes.drafts` in one graph: one one-token draft per pick, each of the last
    one's pick at its own offset (a constant here), written to the buffer; (drafts (B, len(picks)), each q)."""
    drafts, q = [], []
    for i, pick in enumerate(picks):
        offset = torch.tensor(i, device=lengths.device)
        *_, (token, q_i) = _forward(model, cache, buffer, token, lengths, offset, None, num_loops, planes, "buffer",
                                    pick)
        drafts.append(token)
        q.append(q_i)
    return torch.cat(drafts, dim=1), q


def _verify(model, cache, buffer, tokens, lengths, offset, state, num_loops, planes, store, pick):
    return _checked(_forward(model, cache, buffer, tokens, lengths, offset, state, num_loops, planes, store, pick))


def _prefill(model: LoopedLM, cache: PlaneCache, tokens: Tensor, lengths: Tensor, num_loops: int) -> Tensor:
    """The prompts (B, n), right-padded, of ``lengths`` (B,) tokens, through ``num_loops`` loops into an empty cache:
    logits (B, n, V)."""
    n = tokens.shape[1]
    positions = torch.arange(n, device=tokens.device).expand(tokens.shape[0], -1)
    router = PrefillPass(cache, n, lengths)
    logits = model(tokens, num_loops, positions=positions, router=router, max_position=n - 1, check=False)
    router.store_block()
    return logits


def _refine(model: LoopedLM, cache: PlaneCache, guesses: Tensor, carried: Tensor, previous: Tensor, width: Tensor,
            lengths: Tensor, num_loops: int, planes: tuple, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """One DAS-Wave round over the first ``n`` positions after the anchor (``guesses`` (B, max_width + 1), ``carried``
    (B, max_width, n_embd)): positions < ``previous`` start from the ``carried`` states, the others from their initial
    states; guesses and states are kept for positions < ``width``, the rest pass through unchanged. Returns them and
    the round's logits (B, n, V)."""
    columns = torch.arange(n, device=guesses.device)
    positions = lengths[:, None] + columns
    fresh = model.initial_state(positions, guesses.shape[0], last=cache.capacity - 1, tokens=guesses[:, :n])
    state = torch.where((columns < previous)[None, :, None], carried[:, :n], fresh)
    router = StaticCachePass(cache, positions, lengths, planes)
    logits, state = model(guesses[:, :n], num_loops, state, positions=positions, router=router,
                          return_state=True, max_position=cache.capacity - 1, check=False)
    active = columns < width
    head = torch.where(active, logits.argmax(-1), guesses[:, 1:n + 1])
    kept = torch.where(active[None, :, None], state, carried[:, :n])
    return (torch.cat([guesses[:, :1], head, guesses[:, n + 1:]], dim=1), torch.cat([kept, carried[:, n:]], dim=1),
            logits)


def _wave(model: LoopedLM, cache: PlaneCache, guesses: Tensor, lengths: Tensor, num_loops: int,
          plan: tuple[tuple[int, int, int, tuple], ...]) -> tuple[Tensor, Tensor]:
    """:meth:`CompiledPasses.wave` in one graph: each round of ``plan`` (previous, width, the positions it refines,
    the planes its loops read) is :func:`_refine`; (the guesses, the last round's logits)."""
    carried = torch.zeros(*guesses.shape, model.config.n_embd, dtype=model.dtype, device=guesses.device)[:, 1:]
    for previous, width, n, planes in plan:
        guesses, carried, logits = _refine(model, cache, guesses, carried, previous, width, lengths, num_loops, planes,
                                           n)
    return guesses, logits


#: Traces one compiled function may hold: one per capacity bucket, batch size, cache policy, read plan and (DAS-Wave)
#: width bucket met in one process (torch.compile's default of 8 is soon reached by a test session or a benchmark of
#: every method).
RECOMPILE_LIMIT = 256
_OWN_RECOMPILE_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters  # else a config patch
_TRACED: dict[tuple, Callable] = {}


def traced(fn: Callable, device: torch.device, *, dynamic: bool = False) -> Callable:
    """``fn`` compiled with :data:`BACKEND` and the :data:`OPTIONS` of ``device``'s type (one graph), made once per
    setting: with static shapes, or (``dynamic``) with the sizes the caller marks dynamic and every other one static.
    Inference, as the eager passes (:func:`~looped_kv.decoding.passes.run_pass`): traced without autograd."""
    options = OPTIONS.get(device.type) if BACKEND == "inductor" else None
    key = (fn.__module__, fn.__qualname__, BACKEND, device.type, repr(sorted((options or {}).items())), dynamic)
    if key not in _TRACED:
        own_limit = {"recompile_limit": RECOMPILE_LIMIT} if _OWN_RECOMPILE_LIMIT else {}
        compiled = torch.compile(fn, backend=BACKEND, options=options, dynamic=None if dynamic else False,
                                 fullgraph=True, **own_limit)
        settings = {} if own_limit else {"recompile_limit": RECOMPILE_LIMIT}
        if dynamic:  # only the sizes marked dynamic (static ones: dynamic=False turns automatic dynamism off)
            settings["automatic_dynamic_shapes"] = False

        def call(*args: object) -> Any:
            if torch.is_grad_enabled():  # a caller under autograd (the decoders are not): trace and run without it
                with torch.no_grad():
                    return call(*args)
            if not settings:  # a config patch on every call costs about what the call does (~25 us on a CPU)
                return compiled(*args)
            with torch._dynamo.config.patch(**settings):
                return compiled(*args)

        _TRACED[key] = call
    return _TRACED[key]


class CompiledPasses(Passes):
    """The decode loop's passes as compiled steps with static shapes over one cache (see the module docstring)."""

    compiled = True

    def __init__(self, model: LoopedLM, cache: PlaneCache, width: int = 0,
                 on_pass: Callable[[PassRecord], None] | None = None) -> None:
        super().__init__(model, cache, width, on_pass)
        if not model.config.looped_stack:  # the table of initial states, built before tracing (Ouro has none)
            model.initial_state(torch.arange(cache.capacity, device=cache.lengths.device), 1, last=cache.capacity - 1)
        self._planes: dict[tuple, tuple] = {}

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        """The prompts' pass into the empty cache, one trace for every prompt length (:class:`PrefillPass`)."""
        check_empty(self.cache)
        start = time.perf_counter()
        ids, _ = pad_prompts(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=ids.device)
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        for planes in (*self.cache.edge, *self.cache.core):
            torch._dynamo.maybe_mark_dynamic(planes, planes.dim() - 2)  # the capacity
        step = traced(_prefill, ids.device, dynamic=True)
        logits = step(self.model, self.cache, ids, lengths, self.policy.num_loops)
        if self.model.dtype == torch.float16:
            check_finite(logits, "the logits of the compiled prefill")
        self.cache.advance([len(p) for p in prompts])
        logits = last_logits(logits, prompts)
        check_logits(self.model, logits, "prefill")
        self._tell(start, "prefill", ids.shape[1], self.policy.num_loops, 0)
        return logits

    def planes(self, reads: PrefixReads, first_loop: int, num_loops: int) -> tuple:
        """What loops first_loop .. first_loop + num_loops - 1 read (:func:`read_planes`), the pass's loops 1..n."""
        key = (reads, first_loop, num_loops)
        if key not in self._planes:
            self._planes[key] = tuple(read_planes(self.policy, reads, first_loop + i) for i in range(num_loops))
        return self._planes[key]

    def run(self, tokens: Tensor, num_loops: int, *, reads: PrefixReads = ALIGNED, offset: int = 0,
            store: str | None = None, state: Tensor | None = None, first_loop: int = 1,
            pick: Pick | None = None) -> tuple[Tensor, Tensor, object]:
        start = time.perf_counter()
        column = torch.tensor(offset, device=tokens.device)
        step = traced(_draft, tokens.device)
        out = step(self.model, self.cache, self.buffer, tokens, self.cache.lengths, column, state, num_loops,
                   self.planes(reads, first_loop, num_loops), store, pick)
        self._tell(start, "draft", tokens.shape[1], num_loops, self.cache.capacity)
        return out

    def drafts(self, token: Tensor, num_loops: int, *, reads: PrefixReads,
               picks: Sequence[Pick]) -> tuple[Tensor, list[Any]]:
        """The block's drafts in one compiled step (:func:`_drafts`), told as one pass of kind "drafts": a chain of
        one-token drafts costs about half as much in one graph as in as many calls (the graph shares the masks and
        the reads of the prefix, and the calls' own overhead is paid once)."""
        start = time.perf_counter()
        step = traced(_drafts, token.device)
        drafts, q = step(self.model, self.cache, self.buffer, token, self.cache.lengths, num_loops,
                         self.planes(reads, 1, num_loops), tuple(picks))
        self._tell(start, "drafts", len(picks), num_loops, self.cache.capacity)
        return drafts, list(q)

    def padded_width(self, width: int, most: int) -> int:
        """``most`` columns for any proposal (a block keeps one shape, so one trace), none for an empty one."""
        return most if width else 0

    def verify(self, tokens: Tensor, pick: Pick) -> tuple[Tensor, str, object]:
        start = time.perf_counter()
        R, n = self.policy.num_loops, tokens.shape[1]
        store = self.verification_store(n)
        step = traced(_step if n == 1 else _verify, tokens.device)
        logits, _, tokens, finite = step(self.model, self.cache, self.buffer, tokens, self.cache.lengths, None, None,
                                         R, self.planes(ALIGNED, 1, R), store, pick)
        if not bool(finite):  # raise what the eager pass raises
            if self.model.dtype == torch.float16:
                check_finite(logits, f"the logits of the compiled pass at position {self.cache.max_length}")
            check_logits(self.model, logits, f"verification pass at position {self.cache.max_length}")
        self._tell(start, "verify", n, R, self.cache.capacity, in_place=store == "cache")
        return logits, store, tokens

    def refine(self, guesses: Tensor, carried: Tensor | None, previous: int, width: int, num_loops: int, *,
               reads: PrefixReads, first_loop: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`Passes.refine` on the first :func:`refined_width` positions, so that rounds of nearby widths share
        a trace and the positions past the bucket, inactive and read by no active one, cost nothing: (guesses
        (B, max_width + 1), states (B, max_width, n_embd), the logits of the refined positions)."""
        start = time.perf_counter()
        if carried is None:
            B, n = guesses.shape
            carried = torch.zeros(B, n - 1, self.model.config.n_embd, dtype=self.model.dtype, device=guesses.device)
        previous_, width_ = (torch.tensor(v, device=guesses.device) for v in (previous, width))
        n = refined_width(width, guesses.shape[1] - 1)
        step = traced(_refine, guesses.device)
        out = step(self.model, self.cache, guesses, carried, previous_, width_, self.cache.lengths, num_loops,
                   self.planes(reads, first_loop, num_loops), n)
        self._tell(start, "refine", n, num_loops, self.cache.capacity)
        return out

    def wave(self, guesses: Tensor, rounds: Sequence[Round], num_loops: int, *, reads: PrefixReads,
             fused: bool = False, trace: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`Passes.wave`; ``fused`` (without ``trace``): every round in one compiled step (:func:`_wave`, a
        trace per schedule), told as one pass of kind "wave" whose ``widths`` are its rounds' refined widths. One
        step saves each round's call and the buffers it allocates, at a longer compile (``looped-kv pass-cost
        --waves`` times it beside the rounds)."""
        if not fused or trace is not None:
            return super().wave(guesses, rounds, num_loops, reads=reads, trace=trace)
        start = time.perf_counter()
        plan = tuple((previous, width, refined_width(width, guesses.shape[1] - 1),
                      self.planes(reads, first_loop, num_loops)) for previous, width, first_loop in rounds)
        step = traced(_wave, guesses.device)
        guesses, logits = step(self.model, self.cache, guesses, self.cache.lengths, num_loops, plan)
        self._tell(start, "wave", len(plan), num_loops, self.cache.capacity, widths=tuple(n for _, _, n, _ in plan))
        return guesses, logits


def refined_width(width: int, max_width: int) -> int:
    """The positions a compiled DAS-Wave round refines for ``width`` active ones: the first of 2, 3, 4, 6, 8, 12, 16,
    24, 32, ... (:func:`~looped_kv.decoding.passes.capacity_buckets`' ladder) that holds them, at most ``max_width``
    (gamma). The rounds' widths min(gamma, W_init + j) (DAS Eq. 5) then cost at most a third more than their own,
    at a trace per bucket met."""
    return capacity_bucket(width, max_width, smallest=2)
