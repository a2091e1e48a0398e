"""Sequential self-speculative decoding (RIPE Algorithm 1; DAS Mature-Spec): the loop-draft drafter.

One verification cycle: draft gamma tokens with d loops each, the i-th reading the committed prefix under a
prefix read policy (kappa, nu) and the earlier drafts of its verification block; verify [x, y_1..y_gamma] in
one R-loop pass under the cache policy; accept the longest prefix on which drafts and verifier
agree (greedy) plus the verifier's next token; commit only the verified tokens' planes. Rows
accept and commit their own counts. With a block-independent cache policy (full, or RIPE with
W >= gamma; Proposition 1) every row emits exactly the tokens of greedy decoding under that policy.
Under sampling each draft is drawn from its d-loop distribution q, which the speculative sampling
rule (:mod:`looped_kv.decoding.sampling`) weighs against the verifier's p.
"""

from __future__ import annotations

import torch
from torch import Tensor

from looped_kv.decoding.loop import Drafter, Outcome, Proposal, prefix_outcome
from looped_kv.decoding.passes import Passes
from looped_kv.decoding.sampling import Sampler
from looped_kv.runtime.policy import CachePolicy, PrefixReads


def block_independent(policy: CachePolicy, gamma: int) -> bool:
    """Proposition 1's premise: batched verification of ``gamma`` drafts reads what sequential decoding reads."""
    if all(policy.plane(r) == r for r in range(1, policy.num_loops + 1)):
        return True
    return policy.window >= gamma


def check_speculation(policy: CachePolicy, gamma: int, exact: bool, draft_loops: int | None = None) -> None:
    """Validate a speculative configuration before any work is done."""
    R = policy.num_loops
    if draft_loops is not None and not 1 <= draft_loops < R:
        raise ValueError(f"draft_loops must be in [1, {R - 1}] (fewer than the R = {R} verification loops), "
                         f"got {draft_loops}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if exact and not block_independent(policy, gamma):
        raise ValueError(f"cache {policy.name} has window W = {policy.window} < gamma = {gamma}: batched "
                         f"verification is then not exact (RIPE Proposition 1). Use window >= gamma, or pass "
                         f"exact=False to accept block-dependent verification")


def check_reads(policy: CachePolicy, reads: PrefixReads) -> None:
    """Prefix reads must name planes the cache keeps for every position (deep: plane R; fixed: kappa, nu)."""
    R = policy.num_loops
    needed = {reads.pick(which, 0, R) for which in ("key", "value")} - {0}
    missing = sorted(p for p in needed if p not in policy.kept)
    if missing:
        raise ValueError(f"prefix_reads (key {reads.key!r}, value {reads.value!r}) need plane(s) {missing} for every "
                         f"position, but cache {policy.name} keeps only planes {policy.kept}")


class LoopDrafts(Drafter):
    """gamma drafts of d loops each, the i-th reading the prefix under ``reads`` and the earlier drafts (same loop),
    verified in one R-loop pass over [x, y_1..y_gamma]."""

    def __init__(self, *, draft_loops: int, gamma: int, reads: PrefixReads, exact: bool = True,
                 name: str = "self-spec") -> None:
        self.draft_loops, self.gamma, self.reads, self.exact, self.name = draft_loops, gamma, reads, exact, name
        self.lookahead = self.width = gamma + 1
        self.passes_per_verification = gamma + 1

    def check(self, policy: CachePolicy) -> None:
        check_speculation(policy, self.gamma, self.exact, self.draft_loops)
        check_reads(policy, self.reads)

    def propose(self, passes: Passes, pending: Tensor, sampler: Sampler) -> Proposal:
        drafts, q = passes.drafts(pending, self.draft_loops, reads=self.reads,
                                  picks=[sampler.drafting(1 + i) for i in range(self.gamma)])
        return Proposal(drafts, q=None if sampler.greedy else torch.cat(q, dim=1))

    def accept(self, pending: Tensor, proposal: Proposal, targets: Tensor) -> Outcome:
        return prefix_outcome(proposal.tokens.tolist(), targets, [self.gamma] * len(proposal.tokens))

    @property
    def options(self) -> dict:
        return {"draft_loops": self.draft_loops, "gamma": self.gamma}
