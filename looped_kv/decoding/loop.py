"""The one decode loop: prefill, propose, verify, accept, commit, stop per row, written once for every method.

:func:`decode` runs B prompts of any lengths as one batch (RIPE Algorithm 1's convention: each row's last
emitted token is pending, the cache holds every processed token):

1. prefill every prompt; each row's next token (greedy, or sampled) is pending;
2. the :class:`Drafter` proposes up to m tokens per row after the pending one (none: autoregressive decoding;
   d-loop drafts: self-speculation and Mature-Spec; n-gram lookup; DAS-Wave's carried wave);
3. one verification pass at full depth (all R loops) over the drafter's tokens to verify, under the cache
   policy (a single token for autoregressive decoding); the :class:`~looped_kv.decoding.sampling.Sampler` turns
   its logits into the verifier's tokens: the argmax (greedy), or the speculative sampling rule (Leviathan et al.
   2023), which gives each row its accepted drafts and then the token it draws;
4. the drafter accepts, per row, the longest prefix on which its proposals and the verifier's tokens agree and
   names the next pending token; the row commits the planes of what it verified and emits its tokens;
5. a row stops at its budget or after the end-of-text token; stopped rows leave the batch (eager) or stay
   as padding whose results are ignored (compiled: the batch keeps its shape, so no step is traced again).

The passes themselves come from :class:`~looped_kv.decoding.passes.Passes` (cache passes reading the
committed prefix) or :class:`~looped_kv.decoding.compiled.CompiledPasses` (torch.compile'd steps with static
shapes), which share one interface: they own the cache's writes and a block buffer of the drafter's width, decide
from the tokens they verify where those tokens' keys/values wait for the commit (one per row straight into the
cache, a block in the buffer), and say what width a proposal runs at. The loop and the drafters never ask which
passes they hold, and the loop never asks which drafter it runs. An :class:`Observer` sees every verification (and
every model pass): the measurements that follow a decoder's trajectory (draft agreement per position, a trajectory's
logits, the passes a pass-cost model prices, :class:`PassLog`) use the loop through it instead of copying it.

The shape follows HF transformers' assisted decoding, whose candidate generators propose tokens and are
told how many matched, and gpt-fast's ``generate.py`` (draft, one verification forward over gamma + 1
tokens, accept): here rows are ragged and batched, the draft and the verifier are the same looped model at
different depths reading one cache, and the verifier commits only what it verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from looped_kv.decoding.adaptive import AdaptivePasses
from looped_kv.decoding.compiled import CompiledPasses
from looped_kv.decoding.exits import ExitRule
from looped_kv.decoding.passes import Passes, PassRecord, capacity_bucket, check_logits, new_cache
from looped_kv.decoding.result import Generation
from looped_kv.decoding.rows import Rows
from looped_kv.decoding.sampling import Sampler
from looped_kv.runtime.cache import PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy


@dataclass(frozen=True)
class Proposal:
    """A drafter's tokens after each row's pending one (B, m); ``lengths`` (B,) where rows proposed fewer; ``q``
    (B, m, V) the distributions the tokens were sampled from (None: point masses, as greedy and n-gram drafts are)."""

    tokens: Tensor
    lengths: Tensor | None = None
    q: Tensor | None = None


@dataclass(frozen=True)
class Outcome:
    """What one verification decided per row: drafts accepted (None: nothing was drafted), positions to commit,
    the next pending token (B, 1), the tokens emitted, and for the statistics drafts offered and whether the
    verifier's own token is kept (DAS Eq. 10)."""

    accepted: Tensor | None
    commit: Tensor
    pending: Tensor
    emitted: list[Tensor]
    drafted: list[int] = field(default_factory=list)
    retained: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DecodeView:
    """What an observer sees of the run: the cache holds each row's committed prefix, ``pending`` (B, 1) is each
    row's pending token, ``rows`` the prompt of every batch row and ``live`` whether it still decodes."""

    model: LoopedLM
    cache: PlaneCache
    pending: Tensor
    rows: list[int]
    live: list[bool]


class Observer:
    """Sees every verification (and every model pass) of a decoding run; the default observer does nothing."""

    def ran(self, record: PassRecord) -> None:
        """After each model pass has run: what it ran (the prefill, each draft, DAS-Wave round and verification) and
        its wall time."""

    def prefilled(self, view: DecodeView, logits: Tensor) -> None:
        """After the prefill: ``logits`` (B, V) of each prompt's last position."""

    def proposing(self, view: DecodeView) -> None:
        """Before the drafter proposes: the cache holds exactly each row's committed prefix."""

    def verified(self, view: DecodeView, logits: Tensor, outcome: Outcome) -> None:
        """After the verification (before the commit): its ``logits`` (B, n, V) and what the rows accept."""

    def emitted(self, tokens: dict[int, Tensor]) -> None:
        """After the prefill and after each verification: the tokens each row (by its index among the prompts)
        emitted, cut at its budget and its end-of-text (what streaming hands over)."""


class Observers(Observer):
    """Several observers of one run, told in order."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def ran(self, record: PassRecord) -> None:
        for o in self.observers:
            o.ran(record)

    def prefilled(self, view: DecodeView, logits: Tensor) -> None:
        for o in self.observers:
            o.prefilled(view, logits)

    def proposing(self, view: DecodeView) -> None:
        for o in self.observers:
            o.proposing(view)

    def verified(self, view: DecodeView, logits: Tensor, outcome: Outcome) -> None:
        for o in self.observers:
            o.verified(view, logits, outcome)

    def emitted(self, tokens: dict[int, Tensor]) -> None:
        for o in self.observers:
            o.emitted(tokens)


class LogitsRecorder(Observer):
    """Keeps the logits that choose every emitted token: the prefill's last position, then each verification's
    (greedy decoding: one per step)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[Tensor]] = {}

    def prefilled(self, view: DecodeView, logits: Tensor) -> None:
        for i, seq in enumerate(view.rows):
            self.rows[seq] = [logits[i:i + 1]]

    def verified(self, view: DecodeView, logits: Tensor, outcome: Outcome) -> None:
        for i, (seq, live) in enumerate(zip(view.rows, view.live, strict=True)):
            if live:
                self.rows[seq].append(logits[i])

    def logits(self, row: int) -> Tensor:
        """Row ``row``'s logits, one per processed position from the prompt's last on (positions, V)."""
        return torch.cat(self.rows[row])


class PassLog(Observer):
    """Keeps every model pass of a run in order (:class:`~looped_kv.decoding.passes.PassRecord`): what a pass-cost
    model (:func:`looped_kv.analysis.pass_cost.predict_seconds`) prices a decoder's run from."""

    def __init__(self) -> None:
        self.passes: list[PassRecord] = []

    def ran(self, record: PassRecord) -> None:
        self.passes.append(record)


def accept(drafts: Tensor, targets: Tensor, lengths: Tensor | None = None) -> Tensor:
    """(B,) longest prefix of each row of ``drafts`` (B, n) equal to the verifier's ``targets`` (B, >= n).

    ``lengths`` (B,) caps rows whose drafts are shorter than n (the rest is padding).
    """
    n = drafts.shape[1]
    if n == 0:
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    mismatch = drafts != targets[:, :n]
    if lengths is not None:
        mismatch |= torch.arange(n, device=drafts.device) >= lengths[:, None]
    return torch.where(mismatch.any(1), mismatch.int().argmax(1), n)


def prefix_outcome(drafts: Sequence[Sequence[int]], targets: Tensor, drafted: list[int]) -> Outcome:
    """Each row's ``drafts`` (host lists, ragged) verified against the verifier's ``targets`` (B, >= its drafts + 1),
    read from the device once: the longest prefix equal to the targets is accepted and emitted with the verifier's
    token after it, which becomes the row's pending token; ``drafted``: the drafts each row offered."""
    counts, emitted = [], []
    for row, verified in zip(drafts, targets.tolist(), strict=True):
        a = next((i for i, (d, t) in enumerate(zip(row, verified, strict=False)) if d != t), len(row))
        counts.append(a)
        emitted.append([*row[:a], verified[a]])
    device = targets.device
    accepted = torch.tensor(counts, device=device)
    return Outcome(accepted, accepted + 1, torch.tensor([e[-1:] for e in emitted], device=device),
                   [torch.tensor(e, device=device) for e in emitted], drafted, [1] * len(counts))


class Drafter:
    """What a method adds to the loop: its proposals, the tokens it verifies and what it accepts. This base drafter
    proposes nothing (greedy decoding); a method, or a user's plug-in, subclasses it.

    ``lookahead`` is the number of positions past a row's budget that its last verification may touch, ``width``
    the buffer columns one cycle's drafts and verification block need (0: it verifies one token per row, which the
    passes write straight into the cache), ``passes_per_verification`` the model passes one cycle of drafts and
    verification costs (prefill excluded).
    """

    name = "greedy"
    lookahead = 0
    width = 0
    passes_per_verification = 1

    def check(self, policy: CachePolicy) -> None:
        """Refuse a configuration this drafter cannot run under ``policy``, before any work."""

    def start(self, prompts: list[Tensor], pending: Tensor) -> None:
        """Before the first verification: the prompts and each row's first pending token."""

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` of the batch remain (the others stopped)."""

    def propose(self, passes: Passes, pending: Tensor, sampler: Sampler) -> Proposal:
        """The tokens to test after each row's ``pending`` one, drawn by ``sampler`` (greedy decoding: none)."""
        return Proposal(pending[:, :0])

    def tokens_to_verify(self, pending: Tensor, proposal: Proposal) -> Tensor:
        """The tokens the verifier runs: the pending token, then the proposals."""
        return torch.cat([pending, proposal.tokens], dim=1) if proposal.tokens.shape[1] else pending

    def accept(self, pending: Tensor, proposal: Proposal, targets: Tensor) -> Outcome:
        """Greedy decoding: the verifier's next token is the one emitted."""
        nxt = targets[:, :1]
        return Outcome(None, torch.ones_like(nxt[:, 0]), nxt, list(nxt))

    @property
    def options(self) -> dict:
        """The method's options, kept in the run's result (:attr:`Generation.options`)."""
        return {}


@torch.no_grad()
def decode(model: LoopedLM, prompts: list[Tensor], budgets: list[int], *, policy: CachePolicy,
           drafter: Drafter | None = None, eos: int | None = None, compile: bool = False, shrink: bool | None = None,
           progress: bool = False, observer: Observer | None = None, sampler: Sampler | None = None,
           exits: ExitRule | None = None, prefill: Callable[[PlaneCache], Tensor] | None = None) -> Generation:
    """Decode checked ``prompts`` (1-d each) with their ``budgets`` through one batch-first loop.

    ``drafter`` (default: none, greedy decoding) proposes the tokens each verification tests; ``compile`` runs
    every pass on compiled steps with static shapes, in a cache of bucketed capacity
    (:func:`~looped_kv.decoding.passes.capacity_bucket`); ``shrink`` (default: not ``compile``) drops stopped
    rows from the batch rather than keeping them as padding. ``sampler`` (default: greedy) picks every token: the
    first one, the drafts, and the verifier's by speculative sampling (:mod:`looped_kv.decoding.sampling`).
    ``exits`` (greedy decoding, eager) gives every token its own depth (:mod:`looped_kv.decoding.adaptive`).
    ``prefill(cache)`` (eager) stands in for the prompts' pass: it stores their planes in the run's cache and returns
    each prompt's last logits (B, V) (teacher forcing shares one prefill among cache policies this way:
    :class:`~looped_kv.analysis.teacher_forcing.PromptPlanes`).
    """
    drafter = drafter or Drafter()
    drafter.check(policy)
    if exits is not None and compile:
        raise ValueError("compile=True runs no early exit (exit runs eager): use compile=False")
    if prefill is not None and compile:
        raise ValueError("compile=True prefills in its own buckets: a given prefill needs compile=False")
    sampler = sampler or Sampler()
    observer = observer or Observer()
    shrink = not compile if shrink is None else shrink
    need = max(len(p) + b for p, b in zip(prompts, budgets, strict=True)) + drafter.lookahead
    capacity = capacity_bucket(need, model.config.block_size) if compile else need
    rows = Rows(prompts, budgets, eos, progress, drafter.name)
    cache = new_cache(model, policy, len(prompts), capacity)
    if exits is None:
        passes = (CompiledPasses if compile else Passes)(model, cache, drafter.width, observer.ran)
    else:
        passes = AdaptivePasses(model, cache, exits, observer.ran)
    sampler.start(cache)
    if prefill is None:
        logits = passes.prefill(prompts)  # checked there, as every verification is (check_logits)
    else:
        logits = prefill(cache)
        check_logits(model, logits, "prefill")
    pending = sampler.first(logits)
    observer.prefilled(DecodeView(model, cache, pending, rows.batch, rows.live), logits)
    observer.emitted(rows.emit(list(pending)))
    drafter.start(prompts, pending)
    forward_passes = 1
    while True:
        keep = rows.retire(cache)
        if not keep:
            break
        if shrink and len(keep) < len(rows.batch):
            rows.batch = [rows.batch[i] for i in keep]
            passes.keep_rows(keep)
            drafter.keep(keep)
            sampler.keep(keep)
            pending = pending[keep]
        view = DecodeView(model, cache, pending, rows.batch, rows.live)
        observer.proposing(view)
        proposal = drafter.propose(passes, pending, sampler)
        logits, store, targets = passes.verify(drafter.tokens_to_verify(pending, proposal),
                                               sampler.verifying(proposal.tokens, proposal.q, proposal.lengths))
        outcome = drafter.accept(pending, proposal, targets)
        observer.verified(view, logits, outcome)
        del logits  # not held through the next verification's drafts
        if all(view.live):
            passes.commit(outcome.commit, store)
        else:  # stopped rows kept as padding commit nothing
            passes.commit(torch.where(torch.tensor(view.live, device=pending.device), outcome.commit, 0), store)
        if outcome.accepted is not None:
            rows.record(outcome.accepted.tolist(), outcome.drafted, outcome.retained)
        observer.emitted(rows.emit(outcome.emitted))
        pending = outcome.pending
        forward_passes += drafter.passes_per_verification
    return passes.report(rows.result(cache, forward_passes, eos, **drafter.options))


def decode_rows(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int], *,
                policy: CachePolicy, drafter: Drafter | None = None, **kwargs: object) -> Generation:
    """:func:`decode` of unchecked prompts: checked first (shapes, ids, budgets, the context)."""
    from looped_kv.decoding.prompts import check_prompts

    margin = 0 if drafter is None else drafter.lookahead
    prompts, budgets = check_prompts(model, input_ids, max_new_tokens, margin=margin)
    return decode(model, prompts, budgets, policy=policy, drafter=drafter, **kwargs)
