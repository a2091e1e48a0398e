"""Adaptive depth per token (early exit): the exit criteria as plug-ins, and the rule greedy decoding runs them by.

A token runs loops r = 1, 2, ... of the core until its criterion fires after loop r, or until loop R; its next-token
logits are then the readout of its state s(r). The criteria are those of the Huginn reference code
(``generate_with_adaptive_compute`` and its exit evaluators in ``recpre/raven_modeling_minimal.py`` of
seal-rg/recurrent-pretraining; Geiping et al. 2025, arXiv 2502.05171, zero-shot adaptive compute) and Ouro's exit gate
(:mod:`looped_kv.runtime.exit_gate`). With z(r) the logits of loop r's readout, p(r) = softmax z(r) and s(r) the
recurrent state after loop r (the loop's output, before any norm of the readout; s(0) the initial state):

* ``"kl"``: KL(p(r-1) || p(r)) < threshold, p(0) uniform over the vocabulary (reference default 1e-3);
* ``"entropy"``: |H(p(r)) - H(p(r-1))| < threshold, H(p(0)) = 100 nats as in the reference (default 1e-3; H is
  Shannon's entropy, where the reference adds 1e-10 inside its logarithm);
* ``"latent"``: ||s(r) - s(r-1)|| / ||s(r)|| < threshold (default 0.03);
* ``"cosine"``: 1 - cos(s(r), s(r-1)) < threshold (default 1e-3);
* ``"argmax"``: the argmax of z has not changed for ``threshold`` = k successive loops, argmax z(r) = ... =
  argmax z(r - k) (an int k >= 1, default 5; the first exit possible is loop k + 1);
* ``"gate"`` (Ouro): the cumulative exit probability 1 - (1 - lambda(1)) ... (1 - lambda(r)), lambda(u) =
  sigmoid(gate(s(u))), reaches ``threshold`` (in [0, 1]; default the checkpoint's ``early_exit_threshold``),
  summed loop by loop as :func:`~looped_kv.runtime.exit_gate.threshold_exit` sums the exit distribution;
* ``"fixed"``: r = ``threshold`` (an int in [1, R], no default).

Every token exits by its own criterion, row by row of a batch: a row emits the same tokens in a batch as alone. The
prompt is prefilled as one pass per row and exits with its last position, whose logits choose the first new token
(the reference's prefill exits as one pass too; it averages the latent and cosine distances over the prompt's
positions where this reads the last one). Each later token is a pass of one token.

``exited_reads`` says which plane a later token reads, at a loop r past a token's exit loop e, for that token's
position (at every core layer); both are plane e (a plane the token computed) under the full cache:

* ``"last"`` (freeze-replicate, the default): plane e, the exited token's last computed plane, for every plane p > e
  that a read asks for. The cache holds it where the policy keeps plane p: every kept slot of a plane p > e (and at
  the full-depth positions of a window or sinks, every slot p > e) holds a copy of plane e. When every token exits
  at one loop e, this is greedy decoding at R = e under the same kind of policy (full, deepest, share, first, ripe,
  sinks; not k-deepest, whose kept planes move with R).
* ``"nearest-below"``: the plane the cache keeps for that position nearest below the requested one, the deepest
  kept plane q <= e (slots of kept planes p > e hold a copy of plane q): nothing is stored that the policy does not
  keep. Under share(k) a token exiting at e is read at plane k floor(e / k) past its exit. A policy that keeps no
  plane at or below the earliest loop a token can exit at (deepest, ripe and sinks keep plane R alone) is refused.

:func:`looped_kv.runtime.memory.exit_bytes` counts the bytes of the distinct planes this leaves per position.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.policy import CachePolicy

EXITED_READS = ("last", "nearest-below")
#: The entropy the reference compares loop 1's with (nats).
START_ENTROPY = 100.0


class ExitCriterion(ABC):
    """One criterion over the loops of one pass: :meth:`start` with the tokens' initial states, then :meth:`step`
    after each loop with what :attr:`reads` names; True where a token exits. A user's criterion subclasses it.

    ``reads`` is ``"logits"`` (the readout's logits, (B, V)), ``"state"`` (s(r), (B, n_embd)), ``"gate"`` (Ouro's
    gate logit, (B,)) or ``"loop"`` (nothing: None). ``default`` is the threshold when none is given (None: one must
    be); ``integer`` thresholds are ints >= 1, the others numbers in [0, ``high``].
    """

    name: ClassVar[str]
    reads: ClassVar[str]
    default: ClassVar[float | int | None] = None
    integer: ClassVar[bool] = False
    high: ClassVar[float] = math.inf
    meaning: ClassVar[str]

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def start(self, state: Tensor) -> None:  # noqa: B027 (a hook a plug-in without state need not override)
        """A new pass: the tokens' initial states s(0) (B, n_embd)."""

    @abstractmethod
    def step(self, loop: int, read: Tensor | None) -> Tensor:
        """(B,) bool after loop ``loop``: whether each token exits now."""

    @classmethod
    def earliest(cls, threshold: float) -> int:
        """The first loop the criterion can fire at."""
        return 1

    @classmethod
    def check_threshold(cls, threshold: object) -> None:
        """A one-line ValueError unless ``threshold`` is one this criterion takes."""
        if cls.integer:
            if not isinstance(threshold, numbers.Integral) or isinstance(threshold, bool) or threshold < 1:
                raise ValueError(f"exit_threshold must be an int >= 1 for exit={cls.name!r} ({cls.meaning}), got "
                                 f"{threshold!r}")
            return
        if (not isinstance(threshold, numbers.Real) or isinstance(threshold, bool) or not math.isfinite(threshold)
                or not 0 <= threshold <= cls.high):
            span = ">= 0" if cls.high == math.inf else f"in [0, {cls.high:g}]"
            raise ValueError(f"exit_threshold must be a number {span} for exit={cls.name!r} ({cls.meaning}), got "
                             f"{threshold!r}")


class _Distance(ExitCriterion):
    """Exits at the first loop whose distance to the previous loop falls below the threshold."""

    def step(self, loop: int, read: Tensor | None) -> Tensor:
        return self.distance(read) < self.threshold

    @abstractmethod
    def distance(self, read: Tensor) -> Tensor:
        """(B,) the distance between this loop's ``read`` and the previous loop's."""


class KLExit(_Distance):
    """KL(p(r-1) || p(r)) of successive loops' next-token distributions, p(0) uniform."""

    name, reads, default, meaning = "kl", "logits", 1e-3, "exit when KL(p(r-1) || p(r)) < threshold"

    def start(self, state: Tensor) -> None:
        self.previous: Tensor | None = None

    def distance(self, read: Tensor) -> Tensor:
        log_p = read.log_softmax(-1)
        previous = torch.full_like(log_p, -math.log(log_p.shape[-1])) if self.previous is None else self.previous
        self.previous = log_p
        return (previous.exp() * (previous - log_p)).sum(-1)


class EntropyExit(_Distance):
    """|H(p(r)) - H(p(r-1))|, H(p(0)) = :data:`START_ENTROPY`."""

    name, reads, default, meaning = "entropy", "logits", 1e-3, "exit when |H(p(r)) - H(p(r-1))| < threshold"

    def start(self, state: Tensor) -> None:
        self.previous: Tensor | float = START_ENTROPY

    def distance(self, read: Tensor) -> Tensor:
        entropy = torch.special.entr(read.softmax(-1)).sum(-1)
        change = (entropy - self.previous).abs()
        self.previous = entropy
        return change


class LatentExit(_Distance):
    """||s(r) - s(r-1)|| / ||s(r)||."""

    name, reads, default, meaning = "latent", "state", 0.03, "exit when ||s(r) - s(r-1)|| / ||s(r)|| < threshold"

    def start(self, state: Tensor) -> None:
        self.previous = state

    def distance(self, read: Tensor) -> Tensor:
        change = (read - self.previous).norm(dim=-1) / read.norm(dim=-1)
        self.previous = read
        return change


class CosineExit(_Distance):
    """1 - cos(s(r), s(r-1))."""

    name, reads, default, meaning = "cosine", "state", 1e-3, "exit when 1 - cos(s(r), s(r-1)) < threshold"

    def start(self, state: Tensor) -> None:
        self.previous = state

    def distance(self, read: Tensor) -> Tensor:
        cosine = (read * self.previous).sum(-1) / read.norm(dim=-1) / self.previous.norm(dim=-1)
        self.previous = read
        return 1 - cosine


class ArgmaxExit(ExitCriterion):
    """The argmax of the logits unchanged for ``threshold`` successive loops."""

    name, reads, default, integer = "argmax", "logits", 5, True
    meaning = "exit after that many successive loops with an unchanged argmax"

    def start(self, state: Tensor) -> None:
        self.previous: Tensor | None = None
        self.stable = torch.zeros(state.shape[0], dtype=torch.long, device=state.device)

    def step(self, loop: int, read: Tensor | None) -> Tensor:
        top = read.argmax(-1)
        if self.previous is not None:
            self.stable = torch.where(top == self.previous, self.stable + 1, 0)
        self.previous = top
        return self.stable >= self.threshold

    @classmethod
    def earliest(cls, threshold: float) -> int:
        return int(threshold) + 1


class GateExit(ExitCriterion):
    """Ouro's gate: the cumulative exit probability reaches the threshold."""

    name, reads, high = "gate", "gate", 1.0
    meaning = "exit when the gate's cumulative exit probability reaches threshold"

    def start(self, state: Tensor) -> None:
        self.remaining: Tensor | float = 1.0
        self.reached: Tensor | float = 0.0

    def step(self, loop: int, read: Tensor | None) -> Tensor:
        exit_now = torch.sigmoid(read)
        self.reached = self.reached + exit_now * self.remaining
        self.remaining = self.remaining * (1.0 - exit_now)
        return self.reached >= self.threshold


class FixedExit(ExitCriterion):
    """Every token exits after loop ``threshold``."""

    name, reads, integer, meaning = "fixed", "loop", True, "the loop every token exits at"

    def start(self, state: Tensor) -> None:
        self.rows, self.device = state.shape[0], state.device

    def step(self, loop: int, read: Tensor | None) -> Tensor:
        return torch.full((self.rows,), loop >= self.threshold, device=self.device)

    @classmethod
    def earliest(cls, threshold: float) -> int:
        return int(threshold)


#: The criteria by name, in the order the book lists them.
CRITERIA: dict[str, type[ExitCriterion]] = {c.name: c for c in (KLExit, EntropyExit, LatentExit, ArgmaxExit,
                                                                 CosineExit, GateExit, FixedExit)}
EXITS = tuple(CRITERIA)


def check_exit(exit: str | None, threshold: object, exited_reads: object) -> None:
    """What needs no model: ``exit`` one of :data:`EXITS` (or None, with no ``threshold`` nor ``exited_reads``), a
    threshold the criterion takes, ``exited_reads`` one of :data:`EXITED_READS` or None; else a one-line ValueError
    naming the parameter."""
    if exit is None:
        for name, value in (("exit_threshold", threshold), ("exited_reads", exited_reads)):
            if value is not None:
                raise ValueError(f"{name}={value!r} is used only with exit (one of {EXITS})")
        return
    if not isinstance(exit, str) or exit not in CRITERIA:
        raise ValueError(f"exit must be one of {EXITS} or None, got {exit!r}")
    if threshold is not None:
        CRITERIA[exit].check_threshold(threshold)
    if exited_reads is not None and (not isinstance(exited_reads, str) or exited_reads not in EXITED_READS):
        raise ValueError(f"exited_reads must be one of {EXITED_READS}, got {exited_reads!r}")


@dataclass(frozen=True)
class ExitRule:
    """A checked early-exit setting: the criterion, its threshold and the exited tokens' reads (:data:`EXITED_READS`)
    under the cache ``policy``."""

    criterion: type[ExitCriterion]
    threshold: float
    exited_reads: str
    policy: CachePolicy

    def new(self) -> ExitCriterion:
        """A fresh criterion for one pass."""
        return self.criterion(self.threshold)

    @property
    def held_loops(self) -> frozenset[int]:
        """The loops whose keys/values an exited token's deeper planes copy: its last loop (``"last"``), or its last
        kept plane's (``"nearest-below"``)."""
        loops = range(1, self.policy.num_loops + 1)
        return frozenset(loops if self.exited_reads == "last" else self.policy.kept)

    @property
    def options(self) -> dict[str, object]:
        """The rule as the run's result keeps it (:attr:`~looped_kv.decoding.result.Generation.exit`), with R, the loops
        of a token whose criterion never fires."""
        return {"exit": self.criterion.name, "exit_threshold": self.threshold, "exited_reads": self.exited_reads,
                "num_loops": self.policy.num_loops}


def exit_rule(exit: str, threshold: float | None, exited_reads: str | None, config: LoopedConfig,
              policy: CachePolicy) -> ExitRule:
    """The checked :class:`ExitRule` of ``exit`` for a model of ``config`` under ``policy`` (R = its loops): a gate
    only on a model that has one, a fixed exit within R, ``"nearest-below"`` only under a policy that keeps a plane
    at or below the earliest exit; one-line ValueErrors, before any work."""
    check_exit(exit, threshold, exited_reads)
    criterion, R, exited_reads = CRITERIA[exit], policy.num_loops, exited_reads or "last"
    if criterion is GateExit and not config.exit_gate:
        raise ValueError(f"exit='gate' needs a model with an exit gate (Ouro); this model (family {config.family!r}) "
                         f"has none: use exit in {tuple(e for e in EXITS if e != 'gate')}")
    if threshold is None:
        threshold = config.exit_threshold if criterion is GateExit else criterion.default
        if threshold is None:
            raise ValueError(f"exit={exit!r} needs exit_threshold ({criterion.meaning}"
                             f"{f', an int in [1, {R}]' if criterion is FixedExit else ''})")
    if criterion is FixedExit and threshold > R:
        raise ValueError(f"exit_threshold must be in [1, {R}] for exit='fixed' (R = {R} loops), got {threshold}")
    earliest = min(criterion.earliest(threshold), R)
    if exited_reads == "nearest-below" and min(policy.kept) > earliest:
        raise ValueError(f"exited_reads='nearest-below' needs a cache that keeps a plane at or below loop {earliest}, "
                         f"the earliest exit of exit={exit!r}; cache {policy.name} keeps planes {policy.kept}: use "
                         f"exited_reads='last'")
    return ExitRule(criterion, threshold, exited_reads, policy)
