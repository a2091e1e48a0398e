"""DAS-Wave: carried parallel refinement with mature prefix reads and an independent verifier, batch-first.

One verification cycle (DAS Appendix B.2), from the materialized prefix cache and each row's anchor x_t (the
pending token at position L):

1. Initialize: provisional guesses repeat the anchor; a newly active position starts from the
   checkpoint's initial state at its absolute position.
2. Refine: for rounds j = 0..J-1, the first W_j = min(max_width, W_init + j) positions (Eq. 5;
   ``max_width`` is the verifier capacity gamma)
   receive k recurrent updates in parallel, reading the verified prefix at deep K/V (Eq. 6)
   and each other's current keys/values; the readout of position i updates guess i + 1.
3. Carry: the updated latent states are kept for the next round (unless ``carry=False``);
   provisional keys/values are discarded.
4. Verify: the full-depth target runs on [x_t, y_1..y_{w-1}] under the cache policy.
5. Commit: accept in order until the first mismatch, emit the target's token there, keep only
   verified planes; the last emitted token becomes the next anchor. Rows commit their own counts.

Because the verifier is the unchanged target, the output equals greedy full-depth decoding
(DAS Proposition 1) whatever the proposal settings. Under sampling the proposals are drawn from the last
round's readout, the wave's draft distribution q, and the speculative sampling rule keeps the target's
distribution (:mod:`looped_kv.decoding.sampling`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from looped_kv.decoding.loop import Drafter, Outcome, Proposal, accept
from looped_kv.decoding.passes import Passes, Round
from looped_kv.decoding.sampling import Sampler
from looped_kv.decoding.speculative import check_reads, check_speculation
from looped_kv.runtime.cache import PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, PrefixReads

DEEP_KV = PrefixReads("deep", "deep")
GREEDY = Sampler()


def check_wave(max_width: int, rounds: int, initial_width: int, updates: int) -> None:
    if initial_width < 1:
        raise ValueError(f"initial_width (W_init) must be >= 1, got {initial_width}")
    if max_width < initial_width:
        raise ValueError(f"max_width (verifier capacity gamma) must be >= initial_width (W_init) = {initial_width}, "
                         f"got {max_width}")
    if rounds < 1:
        raise ValueError(f"rounds (J) must be >= 1, got {rounds}")
    if updates < 1:
        raise ValueError(f"updates (k, recurrent updates per round) must be >= 1, got {updates}")


def proposal_width(max_width: int, rounds: int, initial_width: int) -> int:
    """w: proposals one verification tests, the width of the last round, min(gamma, W_init + J - 1) (Eq. 5), gamma
    being the verifier capacity ``max_width``.

    It also bounds the tokens one verification commits: A < w accepted plus a correction, or all w."""
    return min(max_width, initial_width + rounds - 1)


def rounds_of(max_width: int, rounds: int, initial_width: int, updates: int, carry: bool) -> list[Round]:
    """The wave's rounds as (previous, width, first_loop) (:meth:`~looped_kv.decoding.passes.Passes.wave`): round j
    refines W_j = min(max_width, W_init + j) positions (Eq. 5) with k updates; with ``carry`` the positions the last
    round refined start from its states and the loops run on (1 + j k), else every round starts afresh at loop 1."""
    widths = [min(max_width, initial_width + j) for j in range(rounds)]
    if not carry:
        return [(0, width, 1) for width in widths]
    previous = [0, *widths[:-1]]
    return [(p, width, 1 + j * updates) for j, (p, width) in enumerate(zip(previous, widths, strict=True))]


def wave(passes: Passes, anchor: Tensor, *, max_width: int, rounds: int, initial_width: int, updates: int, carry: bool,
         reads: PrefixReads, trace: list[Tensor] | None = None, sampler: Sampler = GREEDY,
         fuse_rounds: bool = False) -> tuple[Tensor, Tensor | None]:
    """Carried parallel refinement (DAS Eq. 5-6) of B rows; returns the proposals y_1..y_w (B, w) and their
    distributions q (B, w, V) (None when greedy).

    Round j refines the first W_j = min(max_width, W_init + j) positions with k updates, reading the prefix per
    ``reads`` and each other's current keys/values (nothing is stored); position i's readout updates guess
    i + 1 (:meth:`~looped_kv.decoding.passes.Passes.wave`, :func:`rounds_of`). With ``carry`` only the newly active
    positions start from their initial states. With ``trace``, each round's guesses after its readout (B, W_j) are
    appended to it. ``fuse_rounds``: compiled passes run the J rounds in one step. The rounds refine greedily; under
    sampling the last round's readout is the draft distribution q, and the proposals are drawn from it.
    """
    guesses = anchor.expand(-1, max_width + 1).clone()  # guesses[:, i] conditions position L + i
    schedule = rounds_of(max_width, rounds, initial_width, updates, carry)
    guesses, logits = passes.wave(guesses, schedule, updates, reads=reads, fused=fuse_rounds, trace=trace)
    width, q = schedule[-1][1], None
    if not sampler.greedy:
        guesses[:, 1:width + 1], q = sampler.draft(logits[:, :width], 1)
    return guesses[:, 1:width + 1], q


def refine(model: LoopedLM, cache: PlaneCache, anchor: Tensor, *, max_width: int, rounds: int, initial_width: int,
           updates: int, carry: bool, reads: PrefixReads, trace: list[Tensor] | None = None) -> Tensor:
    """:func:`wave` with eager cache passes on ``cache`` (each row's anchor x_t pending at position L)."""
    return wave(Passes(model, cache), anchor, max_width=max_width, rounds=rounds, initial_width=initial_width,
                updates=updates, carry=carry, reads=reads, trace=trace)[0]


class WaveDrafts(Drafter):
    """DAS-Wave's carried wave (DAS Appendix B.2): w proposals from J rounds of parallel refinement, verified by the
    unchanged target on [x_t, y_1..y_{w-1}]; with all w accepted there is no bonus token. ``fuse_rounds``: on compiled
    passes the J rounds run as one step (:meth:`~looped_kv.decoding.passes.Passes.wave`)."""

    name = "das-wave"

    def __init__(self, *, max_width: int, rounds: int, initial_width: int, updates: int, carry: bool,
                 reads: PrefixReads = DEEP_KV, exact: bool = True, fuse_rounds: bool = False) -> None:
        check_wave(max_width, rounds, initial_width, updates)
        self.schedule = dict(max_width=max_width, rounds=rounds, initial_width=initial_width, updates=updates,
                             carry=carry)
        self.max_width, self.reads, self.exact, self.fuse_rounds = max_width, reads, exact, fuse_rounds
        self.w = proposal_width(max_width, rounds, initial_width)
        self.lookahead, self.width, self.passes_per_verification = max_width + 1, max_width, rounds + 1

    def check(self, policy: CachePolicy) -> None:
        check_speculation(policy, self.max_width, self.exact)
        check_reads(policy, self.reads)

    def propose(self, passes: Passes, pending: Tensor, sampler: Sampler) -> Proposal:
        tokens, q = wave(passes, pending, **self.schedule, reads=self.reads, sampler=sampler,
                         fuse_rounds=self.fuse_rounds)
        return Proposal(tokens, q=q)

    def tokens_to_verify(self, pending: Tensor, proposal: Proposal) -> Tensor:
        return torch.cat([pending, proposal.tokens[:, :-1]], dim=1)

    def accept(self, pending: Tensor, proposal: Proposal, targets: Tensor) -> Outcome:
        w, proposals = self.w, proposal.tokens
        accepted = accept(proposals, targets)
        corrected = accepted < w  # with m = w proposals tested there is no bonus token when all agree
        fixes = targets.gather(1, accepted.clamp(max=w - 1)[:, None])
        nxt = torch.where(corrected[:, None], fixes, proposals[:, -1:])
        counts, fixed = accepted.tolist(), corrected.tolist()
        emitted = [torch.cat([p[:a], f]) if c else p
                   for p, a, f, c in zip(proposals, counts, fixes, fixed, strict=True)]
        return Outcome(accepted, torch.where(corrected, accepted + 1, w), nxt, emitted, [w] * len(counts),
                       [int(c) for c in fixed])

    @property
    def options(self) -> dict:
        return dict(self.schedule, fuse_rounds=self.fuse_rounds)
