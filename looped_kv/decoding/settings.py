"""Decoder names, their options and defaults, once: every entry point (generate, the CLI, the benchmarks, the
protocol, the chapters) reads them here.

Method names are one vocabulary everywhere: ``ar`` (greedy full-depth decoding, the baseline of every ratio),
``self-spec`` (sequential self-speculation, RIPE Algorithm 1), ``mature-spec`` (self-speculation with deep K/V
prefix reads, DAS Section 4.1), ``pld`` (prompt lookup decoding) and ``das-wave`` (DAS Section 3.3). Each method
has one frozen dataclass of its options (:class:`Greedy`, :class:`SelfSpec`, :class:`MatureSpec`,
:class:`PromptLookup`, :class:`DasWave`), all sharing the options of :class:`Decoding`; its defaults are the only
defaults. A default that depends on the number of loops R follows the R decoded at, keeping the papers' value at
R = 32: ``draft_loops`` is :func:`default_draft_loops` of R. Greedy decoding alone takes adaptive depth per token
(``exit``, ``exit_threshold``, ``exited_reads``; :mod:`looped_kv.decoding.exits`), which no speculative method takes:
its exactness under speculation is not proven. Options are checked by type when a config is made (an
int is an int, a flag a bool), an option the method does not take is refused (:func:`method_config`), and what needs
the model (``num_loops``, ``sinks`` and ``window`` against the context) is checked by :meth:`Decoding.check` before
any work. The display names are for tables only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

from looped_kv.decoding.exits import CRITERIA, EXITED_READS, EXITS, ExitRule, check_exit, exit_rule
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.policy import (
    CACHE_POLICIES,
    PREFIX_READS,
    CachePolicy,
    PrefixReads,
    make_policy,
    make_prefix_reads,
)

METHODS = ("ar", "self-spec", "mature-spec", "pld", "das-wave")
DISPLAY = {"ar": "greedy", "self-spec": "self-spec", "mature-spec": "Mature-Spec", "pld": "prompt lookup",
           "das-wave": "DAS-Wave"}
#: The papers' draft depth: d = 4 of R = 32 loops (Mature-Spec in DAS Table 5; DAS Sec. 4.3 compares the prefix
#: reads at d = 4).
PAPER_LOOPS, PAPER_DRAFT_LOOPS = 32, 4
#: :func:`default_draft_loops` in words, for help texts.
DRAFT_LOOPS_DEFAULT = "R // 8, at least 1: the papers' 4 at R = 32"
#: DAS-Wave's refinement rounds J at R = 32 (DAS Table 5, Huginn): J k = 48 loops of refinement, 1.5 R.
PAPER_ROUNDS = 24
#: :func:`default_rounds` in words, for help texts.
ROUNDS_DEFAULT = "3R // 4, at least 1: the paper's 24 at R = 32"


def default_draft_loops(num_loops: int) -> int:
    """d when ``draft_loops`` is not given: the papers' share of the R = ``num_loops`` loops, R * 4 / 32 = R // 8
    rounded down, at least 1 (4 at R = 32; 1 at Ouro's R = 4 and Parcae's R = 8)."""
    return max(1, num_loops * PAPER_DRAFT_LOOPS // PAPER_LOOPS)


def default_rounds(num_loops: int) -> int:
    """DAS-Wave's J when ``rounds`` is not given: the paper's share of the R = ``num_loops`` loops, R * 24 / 32 =
    3R // 4, at least 1 (24 at R = 32; 6 at Parcae's R = 8; 3 at Ouro's R = 4), so that its J k refinement loops stay
    1.5 R."""
    return max(1, num_loops * PAPER_ROUNDS // PAPER_LOOPS)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int | None = None, optional: bool = False) -> None:
    """``value`` is an int (or None where ``optional``) of at least ``low``: else a one-line ValueError naming it."""
    if value is None and optional:
        return
    if not _is_int(value):
        kind = "an int" + ("" if low is None else f" >= {low}") + (" or None" if optional else "")
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_real(name: str, value: object, high: float = math.inf, *, above_zero: bool = False,
               optional: bool = False) -> None:
    """``value`` is a finite real number (or None where ``optional``) in [0, ``high``] (``above_zero``: (0, ``high``]):
    else a one-line ValueError naming it and the allowed values."""
    if value is None and optional:
        return
    if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value)
            or not 0 <= value <= high or (above_zero and value == 0)):
        span = f"{'(' if above_zero else '['}0, {high}]" if high < math.inf else ">= 0"
        kind = f"a number {'in ' if high < math.inf else ''}{span}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {kind}, got {value!r}")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True, kw_only=True)
class Decoding:
    """The options every method takes (see :func:`looped_kv.generate`).

    ``max_new_tokens``: an int or one int per prompt. ``cache``, ``num_loops`` (R, default the model's mean
    recurrence), ``window``, ``k`` and ``sinks`` name the verifier's cache policy
    (:func:`~looped_kv.runtime.policy.make_policy`). ``stop_at_eos`` and ``eos_token_id`` (default the
    tokenizer's) stop a row after end-of-text. ``compile`` runs every pass on torch.compile'd steps with static
    shapes (:mod:`looped_kv.decoding.compiled`); ``rows_per_chunk`` decodes a batch in row chunks of at
    most that many rows; ``progress`` shows a progress bar.

    Sampling (:mod:`looped_kv.decoding.sampling`): ``temperature`` (0, the default: greedy decoding; top_k, top_p
    and min_p then change nothing), ``top_k``, ``top_p`` and ``min_p`` (None: off) process every distribution, the
    drafts' and the verifier's, and speculative methods keep the verifier's distribution exactly (speculative
    sampling). ``seed``: an int s (row i draws with seed s + i), one int per prompt, or None (an int drawn from
    torch's global generator); a row emits the same tokens in any batch as alone with its seed.
    """

    method: ClassVar[str]
    max_new_tokens: int | Sequence[int] = 32
    cache: str = "full"
    num_loops: int | None = None
    window: int | None = None
    k: int | None = None
    sinks: int | None = None
    stop_at_eos: bool = True
    eos_token_id: int | None = None
    compile: bool = False
    rows_per_chunk: int | None = None
    progress: bool = False
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | Sequence[int] | None = None

    def __post_init__(self) -> None:
        budget = self.max_new_tokens
        if not _is_int(budget) and not (isinstance(budget, Sequence) and not isinstance(budget, str)
                                        and all(_is_int(b) for b in budget)):
            raise ValueError(f"max_new_tokens must be an int >= 1 or a list of them (one per prompt), got "
                             f"{budget!r} ({type(budget).__name__})")
        for name in self._optional_ints():
            check_int(name, getattr(self, name), optional=True)
        if not isinstance(self.cache, str):
            raise ValueError(f"cache must be a cache policy name, got {self.cache!r} ({type(self.cache).__name__})")
        for name in ("stop_at_eos", "compile", "progress", *self._flags()):
            check_flag(name, getattr(self, name))
        for name in self._ints():
            check_int(name, getattr(self, name))
        check_int("top_k", self.top_k, low=1, optional=True)
        check_real("temperature", self.temperature)
        check_real("top_p", self.top_p, 1, above_zero=True, optional=True)
        check_real("min_p", self.min_p, 1, optional=True)
        seeds = [self.seed] if _is_int(self.seed) else self.seed
        if self.seed is not None and not (isinstance(seeds, Sequence) and not isinstance(seeds, str)
                                          and all(_is_int(s) and 0 <= s < 2**63 for s in seeds)):
            raise ValueError(f"seed must be None, an int in [0, 2**63) or one such int per prompt, got {self.seed!r}")

    @classmethod
    def _ints(cls) -> tuple[str, ...]:
        return ()

    @classmethod
    def _optional_ints(cls) -> tuple[str, ...]:
        return "num_loops", "window", "k", "sinks", "eos_token_id", "rows_per_chunk"

    @classmethod
    def _flags(cls) -> tuple[str, ...]:
        return ()

    def policy(self, num_loops: int) -> CachePolicy:
        return make_policy(self.cache, num_loops, window=self.window, k=self.k, sinks=self.sinks)

    def check(self, block_size: int, mean_recurrence: int) -> CachePolicy:
        """What needs the model: R >= 1, ``sinks`` and ``window`` within its context; returns the cache policy."""
        check_int("num_loops", mean_recurrence if self.num_loops is None else self.num_loops, low=1)
        for name in ("sinks", "window"):
            value = getattr(self, name)
            if value is not None and value > block_size:
                raise ValueError(f"{name} must be at most the model's context (block_size {block_size}), got {value}")
        return self.policy(mean_recurrence if self.num_loops is None else self.num_loops)

    def exit_rule(self, config: LoopedConfig, policy: CachePolicy) -> ExitRule | None:
        """The checked early-exit rule for a model of ``config`` under ``policy`` (None: every token runs R loops)."""
        return None


@dataclass(frozen=True, kw_only=True)
class Greedy(Decoding):
    """``ar``: greedy full-depth autoregressive decoding, the baseline of every ratio; with ``exit``, adaptive depth
    per token (early exit, :mod:`looped_kv.decoding.exits`): ``exit`` one of
    :data:`~looped_kv.decoding.exits.EXITS` (None, the default: every token runs all R loops), ``exit_threshold``
    (None: the criterion's default, the reference's; ``"fixed"`` needs one) and ``exited_reads`` (the plane a later
    token reads past a token's exit: ``"last"``, the default, or ``"nearest-below"``). Early exit runs eager."""

    method: ClassVar[str] = "ar"
    exit: str | None = None
    exit_threshold: float | None = None
    exited_reads: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_exit(self.exit, self.exit_threshold, self.exited_reads)
        if self.exit is not None and self.compile:
            raise ValueError(f"compile=True runs no early exit (exit={self.exit!r} runs eager): use compile=False")

    def exit_rule(self, config: LoopedConfig, policy: CachePolicy) -> ExitRule | None:
        if self.exit is None:
            return None
        return exit_rule(self.exit, self.exit_threshold, self.exited_reads, config, policy)


@dataclass(frozen=True, kw_only=True)
class _Speculative(Decoding):
    """Options of the methods that verify proposals at full depth: ``exact`` (refuse a block-dependent cache, RIPE
    Proposition 1)."""

    exact: bool = True

    @classmethod
    def _flags(cls) -> tuple[str, ...]:
        return ("exact",)


@dataclass(frozen=True, kw_only=True)
class _Drafted(_Speculative):
    """Options of the sequential drafters: ``gamma`` drafts per verification."""

    gamma: int = 4

    @classmethod
    def _ints(cls) -> tuple[str, ...]:
        return ("gamma",)


@dataclass(frozen=True, kw_only=True)
class _LoopDrafted(_Drafted):
    """Options of the drafters whose drafts run the model's first loops: ``draft_loops`` (d, in [1, R - 1]; None,
    the default: :func:`default_draft_loops` of the R decoded at, the papers' d = 4 at R = 32)."""

    draft_loops: int | None = None

    @classmethod
    def _optional_ints(cls) -> tuple[str, ...]:
        return (*super()._optional_ints(), "draft_loops")

    def draft_depth(self, num_loops: int) -> int:
        """d at R = ``num_loops`` loops: ``draft_loops``, or by default :func:`default_draft_loops` of R."""
        return default_draft_loops(num_loops) if self.draft_loops is None else self.draft_loops


@dataclass(frozen=True, kw_only=True)
class SelfSpec(_LoopDrafted):
    """``self-spec``: ``draft_loops`` (d) loops per draft, drafts reading the prefix per ``prefix_reads``
    (``"aligned"``, ``"deep-v"`` = Mature-V, ``"deep-k"``, ``"deep-kv"`` or a (kappa, nu) pair of planes; default
    ``"aligned"``, except with ``cache="ripe"``, where cached positions are read at plane R as in RIPE
    Algorithm 1, line 3)."""

    method: ClassVar[str] = "self-spec"
    prefix_reads: str | tuple[int, int] | None = None

    def reads(self, num_loops: int) -> PrefixReads:
        return make_prefix_reads(self.prefix_reads or ("deep-kv" if self.cache == "ripe" else "aligned"), num_loops)


@dataclass(frozen=True, kw_only=True)
class MatureSpec(_LoopDrafted):
    """``mature-spec``: self-speculation whose ``draft_loops``-loop drafts read the prefix at deep K/V (DAS Section
    4.1)."""

    method: ClassVar[str] = "mature-spec"

    def reads(self, num_loops: int) -> PrefixReads:
        return make_prefix_reads("deep-kv", num_loops)


@dataclass(frozen=True, kw_only=True)
class PromptLookup(_Drafted):
    """``pld``: prompt lookup decoding, up to ``gamma`` drafts copied after the last ``ngram``-gram's latest earlier
    occurrence (Saxena, 2023), verified at full depth."""

    method: ClassVar[str] = "pld"
    ngram: int = 3

    @classmethod
    def _ints(cls) -> tuple[str, ...]:
        return ("gamma", "ngram")


@dataclass(frozen=True, kw_only=True)
class DasWave(_Speculative):
    """``das-wave``: carried parallel refinement (DAS Section 3.3) with ``max_width`` (the verifier capacity gamma,
    DAS Appendix B.2), ``rounds`` (J), ``initial_width`` (W_init), ``updates`` (k), ``carry`` and
    ``prefix_reads``; the defaults are the paper's Huginn configuration (DAS Sec. 4.1, Table 5: gamma 32, J 24,
    W_init 2, k 2, carried states, deep K/V) at R = 32. J follows R (None, the default: :func:`default_rounds`,
    3R // 4), so that J k stays the paper's 1.5 R loops of refinement; the others are widths and counts of tokens
    and loops per round, which do not depend on R. ``fuse_rounds`` (with ``compile``): the J rounds run as one
    compiled step, which saves each round's call (faster waves, a longer compile; the same tokens)."""

    method: ClassVar[str] = "das-wave"
    max_width: int = 32
    rounds: int | None = None
    initial_width: int = 2
    updates: int = 2
    carry: bool = True
    prefix_reads: str | tuple[int, int] = "deep-kv"
    fuse_rounds: bool = False

    @classmethod
    def _ints(cls) -> tuple[str, ...]:
        return ("max_width", "initial_width", "updates")

    @classmethod
    def _optional_ints(cls) -> tuple[str, ...]:
        return (*super()._optional_ints(), "rounds")

    @classmethod
    def _flags(cls) -> tuple[str, ...]:
        return ("exact", "carry", "fuse_rounds")

    def reads(self, num_loops: int) -> PrefixReads:
        return make_prefix_reads(self.prefix_reads, num_loops)

    def wave_rounds(self, num_loops: int) -> int:
        """J at R = ``num_loops`` loops: ``rounds``, or by default :func:`default_rounds` of R."""
        return default_rounds(num_loops) if self.rounds is None else self.rounds

    def schedule(self, num_loops: int) -> dict[str, int | bool]:
        """The proposal schedule at R = ``num_loops``: max_width (gamma), J, W_init, k and carry."""
        return {**{name: getattr(self, name) for name in WAVE_KEYS}, "rounds": self.wave_rounds(num_loops)}


WAVE_KEYS = ("max_width", "rounds", "initial_width", "updates", "carry")
#: Greedy decoding's early-exit options.
EXIT_OPTIONS = ("exit", "exit_threshold", "exited_reads")
CONFIGS: dict[str, type[Decoding]] = {cls.method: cls for cls in (Greedy, SelfSpec, MatureSpec, PromptLookup,
                                                                    DasWave)}


#: What each option is, in a few words: the command line's help texts (:func:`option_help` adds the methods that
#: take it and its default).
MEANING = {
    "max_new_tokens": "tokens to generate",
    "cache": "the verifier's cache policy",
    "num_loops": "R, the loops per token",
    "window": "W, the full-depth recent positions of cache ripe or sinks",
    "k": "the planes cache k-deepest, share or first keeps",
    "sinks": "the full-depth start positions of cache sinks or ripe",
    "stop_at_eos": "stop a row after end-of-text",
    "eos_token_id": "the end-of-text token",
    "compile": "run every pass on torch.compile'd steps",
    "rows_per_chunk": "decode a batch in row chunks of at most this many rows",
    "progress": "show a progress bar",
    "temperature": "sampling temperature; every method samples exactly",
    "top_k": "sample from the k most probable tokens",
    "top_p": "sample from the most probable tokens whose mass reaches p",
    "min_p": "sample from the tokens with at least min-p times the top probability",
    "seed": "sampling seed; row i draws with seed + i",
    "exit": "adaptive depth per token: each token stops at the first loop where this criterion fires",
    "exit_threshold": "the exit criterion's threshold",
    "exited_reads": "the plane later tokens read past a token's exit",
    "exact": "refuse a block-dependent cache, one whose W is below a verification's width (RIPE Proposition 1)",
    "gamma": "drafts per verification",
    "draft_loops": "d, loops per draft",
    "prefix_reads": "the drafts' prefix reads",
    "ngram": "n-gram length of prompt lookup",
    "max_width": "verifier capacity, DAS gamma: most proposals per verification",
    "rounds": "J, refinement rounds",
    "initial_width": "W_init, the first round's width",
    "updates": "k, updates per round",
    "carry": "carry refined states to the next verification",
    "fuse_rounds": "compiled: run the J rounds as one step (faster waves, a longer compile)",
}
#: The allowed values of the options that name one.
CHOICES = {"cache": CACHE_POLICIES, "prefix_reads": PREFIX_READS, "exit": EXITS, "exited_reads": EXITED_READS}
#: Defaults said in words: those that follow R or the model.
DEFAULT_WORDS = {
    "num_loops": "the model's mean recurrence",
    "draft_loops": DRAFT_LOOPS_DEFAULT,
    "rounds": ROUNDS_DEFAULT,
    "eos_token_id": "the tokenizer's",
    "prefix_reads": "aligned for self-spec (deep-kv with cache ripe), deep-kv for das-wave",
    "seed": "one drawn from torch's global generator",
    "exit": "none, all R loops",
    "exit_threshold": ", ".join(f"{name} {c.default:g}" for name, c in CRITERIA.items() if c.default is not None)
                      + "; gate: the checkpoint's; fixed: the loop, needed",
    "exited_reads": "last",
    "temperature": "0, greedy decoding",
}


def takers(name: str) -> tuple[str, ...]:
    """The methods that take option ``name``."""
    return tuple(method for method in METHODS if name in options(method))


def option_help(name: str) -> str:
    """Option ``name``'s help text: what it is (:data:`MEANING`), the methods that take it when not every method
    does, and its default (a method's own field default, or :data:`DEFAULT_WORDS`)."""
    if name not in every_option():
        raise ValueError(f"name must be an option of some method ({', '.join(every_option())}), got {name!r}")
    methods = takers(name)
    where = "" if len(methods) == len(METHODS) else ", ".join(methods)
    if name in DEFAULT_WORDS:
        default = DEFAULT_WORDS[name]
    else:
        values = {next(f.default for f in fields(CONFIGS[m]) if f.name == name) for m in methods}
        default = "none" if values == {None} else ", ".join(sorted(map(str, values)))
    return f"{MEANING[name]} ({where + '; ' if where else ''}default: {default})"


def every_option() -> tuple[str, ...]:
    """Every option of every method, each once, in the order the configs declare them."""
    return tuple(dict.fromkeys(f.name for cls in CONFIGS.values() for f in fields(cls)))


def options(method: str) -> tuple[str, ...]:
    """The options ``method`` takes."""
    return tuple(f.name for f in fields(CONFIGS[check_method(method)]))


def method_config(method: str = "ar", **given: object) -> Decoding:
    """The config of ``method`` with the ``given`` options (None: the default); an option the method does not take
    is refused, naming the methods that take it."""
    cls = CONFIGS[check_method(method)]
    takes = options(method)
    for name, value in given.items():
        if name not in takes and value is not None:
            users = [m for m in METHODS if name in options(m)]
            if not users:
                raise ValueError(f"{name} is not an option of generate; method={method!r} takes {takes}")
            if name in EXIT_OPTIONS:
                raise ValueError(f"{name}={value!r} runs with method='ar' only: early exit under the speculation of "
                                 f"method={method!r} is not proven exact")
            if name == "gamma" and method == "das-wave":
                raise ValueError("method='das-wave' takes max_width (its verifier capacity, DAS Appendix B.2's gamma), "
                                 "not gamma (drafts per verification of self-spec, mature-spec and pld)")
            if name == "prefix_reads" and method == "mature-spec":
                raise ValueError("method='mature-spec' reads the prefix at deep K/V; use method='self-spec' with "
                                 "prefix_reads for other read policies")
            raise ValueError(f"{name}={value!r} is not used by method={method!r}; only method in {tuple(users)} "
                             f"takes {name}")
    return cls(**{name: value for name, value in given.items() if value is not None})
