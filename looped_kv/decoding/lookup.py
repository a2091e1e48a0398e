"""Prompt lookup decoding (Saxena, 2023), batch-first: the n-gram drafter, drafts from each row's context verified
at full depth."""

from __future__ import annotations

import torch
from torch import Tensor

from looped_kv.decoding.loop import Drafter, Outcome, Proposal, prefix_outcome
from looped_kv.decoding.passes import Passes
from looped_kv.decoding.sampling import Sampler
from looped_kv.decoding.speculative import check_speculation
from looped_kv.runtime.policy import CachePolicy


class NgramIndex:
    """A row's context and, for each n <= ngram, the latest start of every n-gram some token follows: the drafts of
    :meth:`drafts` are a few dictionary reads, not a scan of the context, and appending k tokens costs k ngram
    entries."""

    def __init__(self, context: list[int], ngram: int) -> None:
        self.tokens: list[int] = []
        self.ngram = ngram
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]  # by n; [0] unused
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens``: the n-grams that now end before the last token enter the index."""
        first = max(len(self.tokens) - 1, 0)
        self.tokens += tokens
        for end in range(first, len(self.tokens) - 1):  # later starts overwrite earlier ones: the latest is kept
            for n in range(1, min(self.ngram, end + 1) + 1):
                self.latest[n][tuple(self.tokens[end - n + 1:end + 1])] = end - n + 1

    def drafts(self, gamma: int) -> list[int]:
        """The up to ``gamma`` tokens that followed the latest earlier occurrence of the context's last n-gram
        (n = ngram..1, the longest that occurred)."""
        for n in range(min(self.ngram, len(self.tokens) - 1), 0, -1):
            start = self.latest[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start + n:start + n + gamma]
        return []


class NgramDrafts(Drafter):
    """Up to gamma drafts per row copied from its own context; rows whose drafts are shorter verify only what they
    drafted; under sampling the drafts are point masses (q one-hot). The drafts run at the passes'
    :meth:`~looped_kv.decoding.passes.Passes.padded_width` (compiled: gamma, or none when no row found a draft, so
    that the verification keeps one of two shapes)."""

    name = "prompt lookup"

    def __init__(self, *, gamma: int, ngram: int = 3, exact: bool = True) -> None:
        self.gamma, self.ngram, self.exact = gamma, ngram, exact
        self.lookahead = self.width = gamma + 1
        self.contexts: list[NgramIndex] = []
        self.found: list[list[int]] = []  # each row's drafts of the current cycle

    def check(self, policy: CachePolicy) -> None:
        check_speculation(policy, self.gamma, self.exact)
        if self.ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {self.ngram}")

    def start(self, prompts: list[Tensor], pending: Tensor) -> None:
        self.contexts = [NgramIndex([*p.tolist(), int(x)], self.ngram) for p, x in zip(prompts, pending, strict=True)]

    def keep(self, rows: list[int]) -> None:
        self.contexts = [self.contexts[i] for i in rows]

    def propose(self, passes: Passes, pending: Tensor, sampler: Sampler) -> Proposal:
        self.found = [c.drafts(self.gamma) for c in self.contexts]
        width = passes.padded_width(max(len(f) for f in self.found), self.gamma)
        drafts = torch.tensor([f + [0] * (width - len(f)) for f in self.found], dtype=torch.long,
                              device=pending.device)
        return Proposal(drafts, torch.tensor([len(f) for f in self.found], device=pending.device))

    def accept(self, pending: Tensor, proposal: Proposal, targets: Tensor) -> Outcome:
        outcome = prefix_outcome(self.found, targets, [len(f) for f in self.found])
        for context, tokens in zip(self.contexts, outcome.emitted, strict=True):
            context.extend(tokens.tolist())
        return outcome

    @property
    def options(self) -> dict:
        return {"gamma": self.gamma, "ngram": self.ngram}
