"""Sampling for every decoder: the logits processing, per-row draws and the speculative sampling rule.

Logits are processed as the Huginn reference code and HF transformers do, in this order: divided by the
``temperature``, then the ``top_k`` most probable tokens kept, then the smallest set of most probable ones whose
mass reaches ``top_p``, then those with at least ``min_p`` times the largest probability; what is left is renormalised.
Ties at a cut are kept together. ``temperature=0`` is greedy decoding: every pick is an argmax.

Randomness is counter-based: the uniform a row draws for the token at position t of its sequence, in stream s
(a draft, an acceptance test, the verifier's token), is SplitMix64 (Steele et al. 2014) of (its seed, t, s), so a
row draws the same numbers in any batch, chunk or compiled run as alone with its seed. A position's numbers are
used by the verification that decides it: a draft past a row's first rejection influenced nothing the row emitted,
so drafting that position again with the same numbers keeps every decision independent of the earlier ones.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2) keeps the target's
distribution p whatever the drafts' distribution q: a draft x is accepted with probability min(1, p(x) / q(x)); at
the first rejection the token is drawn from the normalised max(0, p - q); when every draft is accepted the bonus
token is drawn from p. n-gram drafts are point masses (q one-hot), and p and q are the processed distributions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from looped_kv.runtime.cache import PlaneCache

DRAFT, ACCEPT, TARGET = range(3)  # a position's streams of draws
_STREAMS = 3
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # SplitMix64's increment and multipliers, as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 ``x`` (torch's is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 ``x`` (products wrap modulo 2**64)."""
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def uniforms(keys: Tensor, positions: Tensor, stream: int) -> Tensor:
    """Uniforms in [0, 1 - 2**-52] (float64, 52 bits) of rows with ``keys`` (B,) (:func:`mix64` of their seeds) at
    ``positions`` (B, n) in ``stream``."""
    counters = positions * _STREAMS + (stream + 1)
    return _shift(mix64(keys[:, None] + counters * _GOLDEN), 12).double() * 2.0**-52


def draw(weights: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draws (...,) from non-negative ``weights`` (..., V) (any positive total) with uniforms ``u`` (...,)
    in [0, 1 - 2**-52]: the number of cumulative weights at or below u times the total (the CDF never decreases, so
    this is its right-sided search, as a count that a compiled graph fuses), so a token of weight 0 is never drawn."""
    cdf = weights.double().cumsum(-1)
    return (cdf <= (u * cdf[..., -1])[..., None]).sum(-1)


def acceptance(p_x: Tensor, q_x: Tensor) -> Tensor:
    """The probability min(1, p(x) / q(x)) of accepting a draft x (1 where q(x) = 0: a draft q never makes)."""
    return torch.where(p_x >= q_x, torch.ones_like(p_x), p_x / q_x)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """The distribution a rejection resamples from, max(0, p - q) normalised (p where q covers p)."""
    rest = (p - q).clamp(min=0)
    mass = rest.sum(-1, keepdim=True)
    return torch.where(mass > 0, rest / mass, p)


def speculate(p: Tensor, drafts: Tensor, q: Tensor | None, lengths: Tensor | None, u_accept: Tensor,
              u_draw: Tensor) -> Tensor:
    """The speculative sampling rule of B rows: the verifier's tokens (B, n), the drafts up to each row's first
    rejection, then the token drawn there, so that each row's longest prefix of drafts equal to them is what it accepts.

    ``p`` (B, n, V): the target's distributions at the n verified positions; ``drafts`` (B, m), m = n - 1 (a bonus
    position after them) or n (DAS-Wave, none); ``q`` (B, m, V) their distributions (None: point masses);
    ``lengths`` (B,) rows with fewer drafts (the rest is padding, never accepted); ``u_accept`` (B, m) and
    ``u_draw`` (B, n) the rows' uniforms at those positions.
    """
    B, n, _ = p.shape
    m = drafts.shape[1]
    if m == 0:
        return draw(p, u_draw)
    p_x = p[:, :m].gather(-1, drafts[..., None])[..., 0]
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, drafts[..., None])[..., 0]
    kept = u_accept < acceptance(p_x, q_x)
    offered = torch.full_like(drafts[:, 0], m) if lengths is None else lengths
    kept &= torch.arange(m, device=p.device) < offered[:, None]
    first = torch.where(kept.all(1), m, (~kept).int().argmax(1))  # accepted drafts: the first rejection
    at = first.clamp(max=n - 1)
    rows = torch.arange(B, device=p.device)
    column = at.clamp(max=m - 1)
    q_at = torch.nn.functional.one_hot(drafts[rows, column], p.shape[-1]).to(p.dtype) if q is None else q[rows, column]
    q_at = q_at * (first < offered)[:, None]  # a rejected draft's q; past the drafts (the bonus), none
    token = draw(residual(p[rows, at], q_at), u_draw[rows, at])
    targets = torch.cat([drafts, drafts[:, :n - m]], dim=1)
    targets[rows, at] = torch.where(first < n, token, targets[rows, at])
    return targets


def process(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
            min_p: float | None) -> Tensor:
    """The processed distributions (..., V) of ``logits``: divided by ``temperature``, the ``top_k`` largest kept
    (on the logits, before the softmax), then ``top_p`` and ``min_p`` cut from the probabilities and what is left
    renormalised."""
    logits = logits.float() if logits.dtype.itemsize < 4 else logits
    if temperature != 1:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[..., -1:], -torch.inf)
    probs = torch.softmax(logits, -1)
    cut = False
    if top_p is not None and top_p < 1:
        ranked = probs.sort(-1, descending=True).values
        before = ranked.cumsum(-1) - ranked  # the mass of the more probable tokens
        count = (before < top_p * ranked.sum(-1, keepdim=True)).sum(-1, keepdim=True)
        probs, cut = probs.masked_fill(probs < ranked.gather(-1, count - 1), 0), True
    if min_p:
        probs, cut = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0), True
    return probs / probs.sum(-1, keepdim=True) if cut else probs


def _at(table: Tensor, lengths: Tensor, offset: int | Tensor, n: int) -> Tensor:
    """Rows' uniforms (B, n) in one stream's ``table`` (B, positions) at ``offset`` .. past their ``lengths``."""
    return table.gather(1, lengths[:, None] + offset + torch.arange(n, device=lengths.device))


def pick(logits: Tensor, table: Tensor, lengths: Tensor, offset: int | Tensor, temperature: float, top_k: int | None,
         top_p: float | None, min_p: float | None) -> tuple[Tensor, Tensor]:
    """Draws (B, n) from the processed distributions of ``logits`` (B, n, V), and those distributions, with one
    stream's uniforms at ``offset`` past each row's committed ``lengths``."""
    probs = process(logits, temperature, top_k, top_p, min_p)
    return draw(probs, _at(table, lengths, offset, logits.shape[1])), probs


def verify(logits: Tensor, drafts: Tensor, q: Tensor | None, offered: Tensor | None, table: Tensor,
           lengths: Tensor, temperature: float, top_k: int | None, top_p: float | None,
           min_p: float | None) -> Tensor:
    """:func:`speculate` on the processed distributions of the verifier's ``logits`` (B, n, V), with the uniforms of
    the acceptance tests (none without drafts) and of the verifier's draws (``table`` (streams, B, positions)) one
    past each row's ``lengths``."""
    m, u_draw = drafts.shape[1], _at(table[TARGET], lengths, 1, logits.shape[1])
    u_accept = _at(table[ACCEPT], lengths, 1, m) if m else u_draw  # without drafts, none is read
    return speculate(process(logits, temperature, top_k, top_p, min_p), drafts, q, offered, u_accept, u_draw)


def row_seeds(seed: int | Sequence[int] | None, rows: int) -> list[int]:
    """One seed per row: ``seed`` + i for row i of an int, the given ones, or (None) an int drawn from torch's global
    generator (``torch.manual_seed`` fixes it)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    if isinstance(seed, int):
        return [(seed + i) % 2**63 for i in range(rows)]
    if len(seed) != rows:
        raise ValueError(f"seed must be an int or one int per prompt ({rows}), got {len(seed)} seeds")
    return list(seed)


#: How a pass's logits (B, n, V) become tokens: a function of them and its arguments, ``fn(logits, *args)``, which
#: the passes run after an eager pass and inside a compiled pass's graph (where a draw costs no calls of its own).
Pick = tuple[Callable[..., Any], tuple]


def argmax(logits: Tensor) -> Tensor:
    """Greedy tokens (B, n) of ``logits`` (B, n, V)."""
    return logits.argmax(-1)


def argmax_drafts(logits: Tensor) -> tuple[Tensor, None]:
    """Greedy drafts (B, n) of ``logits`` (B, n, V), and no distribution: greedy drafts verify greedily."""
    return logits.argmax(-1), None


class Sampler:
    """How the decode loop and its drafters pick tokens: greedy (``temperature`` 0) or sampled from the processed
    distributions with each row's ``seeds`` (see the module docstring). Positions are read from the cache of the run
    (:meth:`start`): a row's pending token is at its committed length. :meth:`drafting` and :meth:`verifying` give
    the picks as :data:`Pick` s, which the passes run (inside a compiled pass's graph)."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, seeds: Sequence[int] = ()) -> None:
        self.options = (temperature, top_k, top_p, min_p)  # process()'s, in its order
        self.seeds = list(seeds)
        self.greedy = temperature == 0
        self.cache: PlaneCache | None = None
        self.table: Tensor | None = None  # (streams, B, positions): :func:`uniforms` of every row and position
        self.drafts_table: Tensor | None = None  # its DRAFT stream, a view made once
        self._offsets: dict[int, Tensor] = {}  # drafts' offsets as 0-d tensors: one compiled graph for every offset

    def start(self, cache: PlaneCache) -> None:
        """Bind the run's cache (its rows are the seeds' rows)."""
        if not self.greedy:
            if len(self.seeds) != cache.batch:
                raise ValueError(f"sampling needs one seed per row ({cache.batch}), got {len(self.seeds)}")
            keys = mix64(torch.tensor(self.seeds, dtype=torch.long, device=cache.lengths.device))
            # every row's uniforms, computed once: a run draws at its committed length (at most the capacity)
            # plus a verification block, never past twice the capacity (a position past it fails the lookup, not
            # silently)
            span = torch.arange(2 * cache.capacity + 1, device=cache.lengths.device).expand(cache.batch, -1)
            self.table = torch.stack([uniforms(keys, span, stream) for stream in range(_STREAMS)])
            self.drafts_table = self.table[DRAFT]
        self.cache = cache
        self._offsets = {}

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` of the batch remain."""
        if self.table is not None:
            self.table = self.table[:, rows]
            self.drafts_table = self.table[DRAFT]

    def probabilities(self, logits: Tensor) -> Tensor:
        """The processed distributions (..., V) of ``logits`` (:func:`process`)."""
        return process(logits, *self.options)

    def first(self, logits: Tensor) -> Tensor:
        """Each row's first new token (B, 1) from the prefill's ``logits`` (B, V) of its prompt's last position."""
        if self.greedy:
            return logits.argmax(-1, keepdim=True)
        return pick(logits[:, None], self.table[TARGET], self.cache.lengths, 0, *self.options)[0]

    def drafting(self, offset: int) -> Pick:
        """How a draft pass's logits (B, n, V), of the positions ``offset``.. after each row's pending token, become
        drafts (B, n) and their distributions q (None when greedy)."""
        if self.greedy:
            return argmax_drafts, ()
        return pick, (self.drafts_table, self.cache.lengths, self._offset(offset), *self.options)

    def draft(self, logits: Tensor, offset: int) -> tuple[Tensor, Tensor | None]:
        """:meth:`drafting` run on ``logits``: drafts (B, n) and q."""
        fn, args = self.drafting(offset)
        return fn(logits, *args)

    def verifying(self, drafts: Tensor, q: Tensor | None, lengths: Tensor | None) -> Pick:
        """How the verifier's logits (B, n, V) over the pending token and ``drafts`` become its tokens (B, n):
        greedy, the argmax; sampled, :func:`speculate` (the drafts each row accepts, then its drawn token)."""
        if self.greedy:
            return argmax, ()
        return verify, (drafts, q, lengths, self.table, self.cache.lengths, *self.options)

    def _offset(self, offset: int) -> Tensor:
        if offset not in self._offsets:
            self._offsets[offset] = torch.tensor(offset, device=self.cache.lengths.device)
        return self._offsets[offset]
