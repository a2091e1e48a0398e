"""How long each chapter takes on the machine at hand: the plan's time, beside its memory (:mod:`.plan`).

On a CPU a chapter's time is its transformer blocks and its head: every pass of every decoder, replay and loss is a
prelude, loops of the core blocks and a coda, then the head over the vocabulary. The plan counts these calls and
prices each one:

- **The work** (:func:`counting`). Every block call a run makes is a :class:`Call` of its dtype, its rows (tokens
  times sequences), the mean number of keys a query reads (its context) and what it attends to (its own tokens,
  causally, as replays and losses do; or a cache, as decoding does) with which softmax (the fused kernel, or an
  explicit one in float32 or float64, the replays' measurement mode). Every head call is a :class:`Call` of its dtype
  and rows. The chapters' calls (:data:`looped_kv.experiments.plan_check.RUNS`) are counted on a narrow stand-in
  (:func:`stand_in`), which makes the same calls at the same sizes, since no size a chapter runs depends on the width.
  The exception is speculative decoding, whose number of passes follows its acceptance, here the acceptance of random
  weights at the stand-in's width.
- **The prices** (:func:`time_blocks`), measured once per machine with random weights at the model's own dimensions.
  A core block on ``rows`` tokens costs a(rows), the block on ``rows`` one-token sequences (its products, norms and
  rotary, with no attention work), interpolated between measured row counts, plus its attention over the L keys its
  queries read on average. A causal block's attention costs e rows L. A cache read by B sequences of g tokens each
  costs alpha + s L, a line through two timed contexts at each measured (B, g), interpolated between them (a
  wider block, a prefill, scaled by its tokens): a cache's keys and values are read once for all of a sequence's
  queries, and a CPU's caches make that cost anything but proportional to B. A head call costs h(rows),
  interpolated like a(rows).
- **The rest**: everything a chapter does besides its blocks and heads (KL divergences and other arithmetic over the
  logits, which costs the same at any width, the decode loop's bookkeeping, copies of replay records), timed on the
  stand-in while it is counted. Copies of records grow with the width, so this part is low at the model's.

``tests/test_plan_time.py`` holds every chapter's predicted seconds to 25% of the recorded CPU run
(:mod:`looped_kv.experiments.plan_check`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass, field, replace

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.runtime.attention import CausalRouter
from looped_kv.runtime.cache import CachePass
from looped_kv.runtime.config import PARCAE_GATE_CHANNELS, LoopedConfig
from looped_kv.runtime.model import Block, LoopedLM, rms_norm

#: The explicit softmax's dtype of a call, or FUSED for PyTorch's fused attention.
FUSED = "fused"


@dataclass(frozen=True, order=True)
class Call:
    """One kind of call: a block (``kind`` "block") or the head ("head"), in ``dtype`` on ``rows`` tokens; a block's
    tokens are ``sequences`` sequences whose queries read ``context`` keys on average, attending to their own tokens
    causally or to a cache (``attention``), with the fused kernel or an explicit ``softmax`` in that dtype."""

    kind: str
    dtype: str
    rows: int
    context: int = 0
    attention: str = ""
    softmax: str = ""
    sequences: int = 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _attention(router: object) -> str:
    """"cache" for a router that reads a cache (a :class:`~looped_kv.runtime.cache.CachePass`, or a router wrapping
    one), else "causal" (the block attends to its own tokens, with what a replay substitutes)."""
    while router is not None:
        if isinstance(router, CachePass):
            return "cache"
        router = getattr(router, "router", None)
    return "causal"


def _softmax(router: object) -> str:
    while router is not None:
        dtype = getattr(router, "softmax_dtype", None)
        if dtype is not None:
            return _dtype_name(dtype)
        router = getattr(router, "router", None)
    return FUSED


def _block_call(x: Tensor, positions: Tensor, router: object) -> Call:
    """The call's context: its mean position rounded (half to even), plus 1."""
    context = round(float(positions.float().mean())) + 1
    tokens = positions.shape[-1]
    return Call("block", _dtype_name(x.dtype), x.shape[0], context, _attention(router), _softmax(router),
                x.shape[0] // tokens)


class Tally(Counter):
    """Counted calls (:class:`Call` -> count), and :attr:`inside`: the seconds spent in them (the outermost ones: a
    readout's coda blocks are inside it)."""

    inside: float = 0.0


@contextmanager
def counting() -> Iterator[Tally]:
    """Count every block call (:meth:`Block.run <looped_kv.runtime.model.Block.run>`, which every pass of every model
    makes) and every head call (:meth:`LoopedLM.readout <looped_kv.runtime.model.LoopedLM.readout>`, its coda blocks
    counted as blocks) made inside the block, by any model, and time them; yields the tally as it grows."""
    tally, depth = Tally(), [0]
    block_run, readout = Block.run, LoopedLM.readout

    def timed(call: Callable[[], Call], run: Callable[[], Tensor]) -> Tensor:
        if depth[0]:
            tally[call()] += 1
            return run()
        depth[0], start = 1, time.perf_counter()
        try:
            tally[call()] += 1
            return run()
        finally:
            depth[0] = 0
            tally.inside += time.perf_counter() - start

    def counted_run(self: Block, x: Tensor, w: object, rotary: object, positions: Tensor, router: object,
                    loop: int, ve: Tensor | None = None) -> Tensor:
        return timed(lambda: _block_call(x, positions, router),
                     lambda: block_run(self, x, w, rotary, positions, router, loop, ve))

    def counted_readout(self: LoopedLM, state: Tensor, positions: Tensor, router: object, *,
                        tokens: Tensor | None = None) -> Tensor:
        return timed(lambda: Call("head", _dtype_name(state.dtype), state.shape[0] * state.shape[1]),
                     lambda: readout(self, state, positions, router, tokens=tokens))

    Block.run, LoopedLM.readout = counted_run, counted_readout  # type: ignore[method-assign]
    try:
        yield tally
    finally:
        Block.run, LoopedLM.readout = block_run, readout  # type: ignore[method-assign]


def stand_in(config: LoopedConfig) -> LoopedConfig:
    """``config`` made narrow: its vocabulary, layers, loops, heads and context, with 16 dimensions per head (at least
    64 in all, and Parcae's gate channels) and an MLP four times the width. Its calls are the model's at the same
    sizes."""
    head_dim = 16
    while head_dim * config.n_heads < max(64, PARCAE_GATE_CHANNELS):
        head_dim += 2
    width = head_dim * config.n_heads
    return replace(config, n_embd=width, intermediate_size=4 * width)


# -- the prices -----------------------------------------------------------------------------------------------------


def _between(nodes: tuple[int, ...], x: int, what: str) -> tuple[int, int, float]:
    """The nodes around ``x`` (indices i, j and x's weight on j) for linear interpolation; a ValueError outside."""
    if len(nodes) == 1:
        return 0, 0, 0.0
    if not nodes[0] <= x <= nodes[-1]:
        raise ValueError(f"{what} {x} is outside the priced {nodes[0]}..{nodes[-1]}")
    j = min(max(int(np.searchsorted(nodes, x)), 1), len(nodes) - 1)
    return j - 1, j, (x - nodes[j - 1]) / (nodes[j] - nodes[j - 1])


@dataclass(frozen=True)
class Attention:
    """The attention of a block call over L keys: e rows L (``per_row``, causal), or alpha + s L per measured
    (``sequences`` B, ``tokens`` g per sequence), ``lines[i][j]`` = (alpha, s) at B = sequences[i], g = tokens[j],
    interpolated linearly between them."""

    sequences: tuple[int, ...]
    tokens: tuple[int, ...]
    lines: tuple[tuple[tuple[float, float], ...], ...]
    per_row: bool = False

    def seconds(self, call: Call) -> float:
        """Seconds of ``call``'s attention; a block wider than the widest measured (a prefill) costs the widest's
        times its tokens over the widest's, as its queries grow."""
        where = f"a {call.dtype} block call's ({call.attention}/{call.softmax})"
        g, scale = call.rows // call.sequences, 1.0
        if len(self.tokens) > 1 and g > self.tokens[-1]:
            g, scale = self.tokens[-1], g / self.tokens[-1]
        i0, i1, u = _between(self.sequences, call.sequences, f"{where} sequences")
        j0, j1, v = _between(self.tokens, g, f"{where} tokens per sequence")
        alpha, slope = ((1 - u) * ((1 - v) * self.lines[i0][j0][k] + v * self.lines[i0][j1][k])
                        + u * ((1 - v) * self.lines[i1][j0][k] + v * self.lines[i1][j1][k]) for k in (0, 1))
        return scale * (alpha + slope * call.context) * (call.rows if self.per_row else 1)

    @classmethod
    def from_dict(cls, record: Mapping) -> Attention:
        return cls(tuple(record["sequences"]), tuple(record["tokens"]),
                   tuple(tuple((float(a), float(s)) for a, s in row) for row in record["lines"]),
                   bool(record["per_row"]))


@dataclass(frozen=True)
class BlockCost:
    """The machine's prices (see the module docstring): per dtype, the measured ``rows`` and the seconds of a block
    (``block``) and of the head (``head``) on that many tokens; per dtype and "attention/softmax", an
    :class:`Attention`; ``meta``: the machine, the model and the command."""

    rows: dict[str, tuple[int, ...]]
    block: dict[str, tuple[float, ...]]
    head: dict[str, tuple[float, ...]]
    attention: dict[str, dict[str, Attention]]
    meta: dict = field(default_factory=dict)

    def _at(self, table: dict[str, tuple[float, ...]], call: Call) -> float:
        if call.dtype not in self.rows:
            raise ValueError(f"{call.kind} calls in {call.dtype} were not priced; these prices hold "
                             f"{sorted(self.rows)} (time them: looped-kv plan-time)")
        rows = self.rows[call.dtype]
        if not rows[0] <= call.rows <= rows[-1]:
            raise ValueError(f"a {call.kind} call on {call.rows} rows is outside the priced {rows[0]}..{rows[-1]} "
                             f"({call.dtype}); time more rows")
        return float(np.interp(call.rows, rows, table[call.dtype]))

    def seconds(self, call: Call) -> float:
        """Predicted seconds of one ``call``."""
        if call.kind == "head":
            return self._at(self.head, call)
        key = f"{call.attention}/{call.softmax}"
        if key not in self.attention.get(call.dtype, {}):
            raise ValueError(f"block calls in {call.dtype} with {key} attention were not priced; these prices hold "
                             f"{sorted(self.attention.get(call.dtype, {}))}")
        return self._at(self.block, call) + self.attention[call.dtype][key].seconds(call)

    def to_dict(self) -> dict:
        return {**self.meta, "rows": {d: list(r) for d, r in self.rows.items()},
                "block": {d: list(s) for d, s in self.block.items()},
                "head": {d: list(s) for d, s in self.head.items()},
                "attention": {d: {k: asdict(a) for k, a in by.items()} for d, by in self.attention.items()}}

    @classmethod
    def from_dict(cls, record: Mapping) -> BlockCost:
        own = ("rows", "block", "head", "attention")
        missing = [k for k in own if k not in record]
        if missing:
            raise ValueError(f"not a record of block prices: it lacks {missing}")
        return cls(rows={d: tuple(r) for d, r in record["rows"].items()},
                   block={d: tuple(s) for d, s in record["block"].items()},
                   head={d: tuple(s) for d, s in record["head"].items()},
                   attention={d: {k: Attention.from_dict(a) for k, a in by.items()}
                              for d, by in record["attention"].items()},
                   meta={k: v for k, v in record.items() if k not in own})


def predict(work: Mapping[Call, int], cost: BlockCost) -> float:
    """Predicted seconds of a run's counted ``work`` (:func:`counting`) at the machine's prices."""
    return sum(count * cost.seconds(call) for call, count in work.items())


def parts(work: Mapping[Call, int], cost: BlockCost) -> dict[str, float]:
    """:func:`predict` split into causal blocks, cache blocks and the head."""
    out: dict[str, float] = {}
    for call, count in work.items():
        part = "head" if call.kind == "head" else f"{call.attention} blocks"
        out[part] = out.get(part, 0.0) + count * cost.seconds(call)
    return out


def calls_to_rows(work: Mapping[Call, int]) -> list[list]:
    """``work`` as JSON-ready rows: the fields of :class:`Call`, then the count."""
    return [[*astuple(call), count] for call, count in sorted(work.items())]


def rows_to_calls(rows: Iterable[list]) -> Counter[Call]:
    """:func:`calls_to_rows` read back."""
    return Counter({Call(*row[:-1]): int(row[-1]) for row in rows})


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _block_seconds(block: Block, x: Tensor, weights: object, rotary: object, positions: Tensor, router: object,
                   repeats: int) -> float:
    return _median_seconds(lambda: block.run(x, weights, rotary, positions, router, 1), repeats)


def _head_seconds(x: Tensor, norm: Tensor, eps: float, weight: Tensor, repeats: int) -> float:
    return _median_seconds(lambda: torch.mm(rms_norm(x, norm, eps), weight.t()).float(), repeats)


def _row_grid(largest: int) -> tuple[int, ...]:
    """Powers of two from 1 to the first at or above ``largest``."""
    grid = [1]
    while grid[-1] < largest:
        grid.append(2 * grid[-1])
    return tuple(grid)


CAUSAL_TOKENS = (256, 1024)
#: Sequences, tokens per sequence and the shorter context of the cache cells; the longer is that of the calls each
#: count of sequences prices (:func:`_longest`).
CACHE_SEQUENCES, CACHE_TOKENS, SHORT_CONTEXT = (1, 4, 12), (1, 8, 32), 128


def _causal_fit(core: Block, weights: object, rotary: object, model: LoopedLM, softmax: str,
                base: Callable[[int], float]) -> Attention:
    """e of a causal block's attention from blocks of :data:`CAUSAL_TOKENS` tokens (least squares through 0)."""
    router = CausalRouter(softmax_dtype=None if softmax == FUSED else getattr(torch, softmax))
    pairs, extra = [], []
    for n in (t for t in CAUSAL_TOKENS if t <= model.config.block_size):
        x = torch.randn(n, model.config.n_embd, dtype=model.dtype, device=model.device)
        positions = torch.arange(n, device=model.device)
        pairs.append(n * (n + 1) / 2)
        extra.append(_block_seconds(core, x, weights, rotary, positions, router, 3) - base(n))
    return Attention((1,), (1,), (((0.0, float(np.dot(pairs, extra) / np.dot(pairs, pairs))),),), per_row=True)


def _cache_fits(core: Block, weights: object, rotary: object, model: LoopedLM, softmaxes: list[str],
                sequences: tuple[int, ...], longest: tuple[int, ...],
                base: Callable[[int], float]) -> dict[str, Attention]:
    """Per softmax, (alpha, s) at each B of ``sequences`` and g of :data:`CACHE_TOKENS`: the line through blocks read
    at :data:`SHORT_CONTEXT` keys of a prefilled full cache and at B's ``longest`` (the longest context of the calls
    B's lines price)."""
    from looped_kv.decoding.passes import Passes, new_cache
    from looped_kv.runtime.policy import make_policy

    config, widest = model.config, max(CACHE_TOKENS)
    generator = torch.Generator().manual_seed(0)
    lines: dict[str, list[tuple[tuple[float, float], ...]]] = {s: [] for s in softmaxes}
    for batch, most in zip(sequences, longest, strict=True):
        timed: dict[tuple[str, int], list[tuple[float, float]]] = {}
        room = config.block_size - widest
        for context in (min(SHORT_CONTEXT, room // 2), min(max(most, 2 * SHORT_CONTEXT), room)):
            passes = Passes(model, new_cache(model, make_policy("full", config.mean_recurrence), batch,
                                             context + widest), widest)
            passes.prefill([torch.randint(1, config.vocab_size, (context,), generator=generator)
                            for _ in range(batch)])
            for g in CACHE_TOKENS:
                x = torch.randn(batch * g, config.n_embd, dtype=model.dtype, device=model.device)
                keys = context + (g + 1) / 2  # a query's mean keys: the prefix and its block's earlier tokens
                for softmax in softmaxes:
                    router = CachePass(passes.cache, range(context, context + g), store=None,
                                       softmax_dtype=None if softmax == FUSED else getattr(torch, softmax))
                    t = _block_seconds(core, x, weights, rotary, router.positions, router, 7) - base(batch * g)
                    timed.setdefault((softmax, g), []).append((keys, t))
            del passes
        for softmax in softmaxes:
            row = []
            for g in CACHE_TOKENS:
                (k1, t1), (k2, t2) = timed[softmax, g]
                slope = (t2 - t1) / (k2 - k1)
                row.append((t1 - slope * k1, slope))
            lines[softmax].append(tuple(row))
    return {f"cache/{s}": Attention(sequences, CACHE_TOKENS, tuple(lines[s])) for s in softmaxes}


def _longest(calls: list[Call], sequences: tuple[int, ...]) -> tuple[int, ...]:
    """Per B of ``sequences``, the longest context of the ``calls`` its fit prices (those of more sequences than the B
    before it and fewer than the B after it), or 4 :data:`SHORT_CONTEXT` if none: a fit at many sequences is timed
    at the contexts those calls have, not at the longest of all (96 sequences of a short table beside 12 of a long
    prompt would otherwise fill the memory)."""
    bounds = (0, *sequences, sequences[-1] + 1)
    return tuple(max((c.context for c in calls if bounds[i] < c.sequences < bounds[i + 2]), default=4 * SHORT_CONTEXT)
                 for i in range(len(sequences)))


@torch.no_grad()
def time_blocks(config: LoopedConfig, calls: Iterable[Call],
                make_model: Callable[[LoopedConfig, torch.dtype], LoopedLM], progress: bool = True) -> BlockCost:
    """Price ``calls`` on this machine with a model of ``config`` made by ``make_model`` (random weights) in each of
    their dtypes: a(rows) and h(rows) at powers of two covering their rows and the cache cells'; per causal softmax,
    e from blocks of :data:`CAUSAL_TOKENS` tokens; per cache softmax, the lines (alpha, s) at B in
    :data:`CACHE_SEQUENCES` (and the most sequences counted, if more) and g in :data:`CACHE_TOKENS`."""
    calls = list(calls)
    rows, block, head, attention = {}, {}, {}, {}
    for dtype in tqdm(sorted({c.dtype for c in calls}), desc="pricing blocks", disable=not progress):
        model = make_model(config, getattr(torch, dtype))
        core, rotary, eps = model.transformer.core_block[0], model.rotary, config.norm_eps
        weights = core.weights()
        norm, head_weight = model.transformer.ln_f.weight, model.lm_head.weight
        of_dtype = [c for c in calls if c.dtype == dtype]
        cached = [c for c in of_dtype if c.kind == "block" and c.attention == "cache"]
        sequences = tuple(sorted({*CACHE_SEQUENCES, *(c.sequences for c in cached)}))
        sequences = tuple(b for b in sequences if b in CACHE_SEQUENCES or b == sequences[-1])
        grid = _row_grid(max(max(c.rows for c in of_dtype), sequences[-1] * max(CACHE_TOKENS) if cached else 1))
        a, h = [], []
        for n in grid:
            x = torch.randn(n, config.n_embd, dtype=model.dtype, device=model.device)
            one_token = torch.zeros(n, 1, dtype=torch.long, device=model.device)
            repeats = 7 if n <= 256 else 3
            a.append(_block_seconds(core, x, weights, rotary, one_token, CausalRouter(), repeats))
            h.append(_head_seconds(x, norm, eps, head_weight, repeats))
        rows[dtype], block[dtype], head[dtype] = grid, tuple(a), tuple(h)

        def base(n: int, grid: tuple[int, ...] = grid, a: list[float] = a) -> float:
            return float(np.interp(n, grid, a))

        priced = {f"causal/{softmax}": _causal_fit(core, weights, rotary, model, softmax, base)
                  for softmax in sorted({c.softmax for c in of_dtype if c.kind == "block" and c.attention == "causal"})}
        if cached:
            priced |= _cache_fits(core, weights, rotary, model, sorted({c.softmax for c in cached}), sequences,
                                  _longest(cached, sequences), base)
        attention[dtype] = priced
        del model
    return BlockCost(rows, block, head, attention)
