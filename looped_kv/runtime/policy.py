"""Cache policies pi(r, t, j) and prefix read policies (kappa, nu).

A cache policy names the plane of prefix position j that token t reads at loop r
(RIPE Section 2). Every policy of the papers has the same shape:

    pi(r, t, j) = r            if t - j <= W or j < sinks   (full depth: recent window, sinks)
                = plane(r)     otherwise                    (one of the planes kept everywhere)

so a policy is the set of planes it keeps for every position, the map ``plane(r)``, a
window W and a number of sinks. Full cache: plane(r) = r. Deepest plane (Huginn's
compress-s with S = n_core): plane(r) = R. RIPE(W) (Eq. 9): the deepest plane plus a
window. A prefix read policy (DAS Eq. 2-4) lets a draft read keys at depth kappa and
values at depth nu instead.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import cached_property

CACHE_POLICIES = ("full", "deepest", "k-deepest", "share", "first", "ripe", "sinks")
# The cache policies that read each optional make_policy parameter; any other policy rejects it.
POLICY_PARAMETERS = {"window": ("ripe", "sinks"), "k": ("k-deepest", "share", "first"), "sinks": ("ripe", "sinks")}
PREFIX_READS = ("aligned", "deep-v", "deep-k", "deep-kv")


@dataclass(frozen=True)
class CachePolicy:
    """What a cache keeps and what each (loop, query, prefix position) reads.

    ``kind`` is one of :data:`CACHE_POLICIES`; ``k`` is the parameter of k-deepest, share and first; ``window``
    (W) and ``sinks`` the full-depth positions of ripe and sinks. Everything else is derived from them.
    """

    kind: str
    num_loops: int
    k: int = 0
    window: int = 0
    sinks: int = 0

    @property
    def name(self) -> str:
        """The policy as the book writes it: full, deepest, k-deepest(k), share(k), first(k), ripe(W), sinks(S)."""
        parameter = {"k-deepest": self.k, "share": self.k, "first": self.k, "ripe": self.window,
                     "sinks": self.sinks}.get(self.kind)
        return self.kind if parameter is None else f"{self.kind}({parameter})"

    @cached_property  # read at every site and loop
    def kept(self) -> tuple[int, ...]:
        """The planes stored for every position."""
        R, k = self.num_loops, self.k
        if self.kind == "full":
            return tuple(range(1, R + 1))
        if self.kind == "k-deepest":
            return tuple(range(R - k + 1, R + 1))
        if self.kind == "share":
            return tuple(sorted({min(g * k, R) for g in range(1, math.ceil(R / k) + 1)}))
        if self.kind == "first":
            return tuple(range(1, k + 1))
        return (R,)

    def plane(self, r: int) -> int:
        """Plane read at loop r outside the window and the sinks: the last kept plane at or after r's slot."""
        R = self.num_loops
        if self.kind == "full":
            return r
        if self.kind == "k-deepest":
            return R - (R - r) % self.k
        if self.kind == "share":
            return min(math.ceil(r / self.k) * self.k, R)
        if self.kind == "first":
            return min(r, self.k)
        return R

    def read(self, r: int, t: int, j: int) -> int:
        """pi(r, t, j) for one query t and prefix position j < t."""
        return r if (t - j <= self.window or j < self.sinks) else self.plane(r)

    @cached_property  # read at every site and loop
    def extra(self) -> tuple[int, ...]:
        """Planes held only for the window and the sinks (the full-depth positions)."""
        if not (self.window or self.sinks):
            return ()
        return tuple(p for p in range(1, self.num_loops + 1) if p not in self.kept)

    @cached_property  # read by every cache pass
    def in_own_plane(self) -> bool:
        """Whether every kept plane p is last written by loop p among the loops that read it (plane(r) = p).

        Then a block can write loop r's keys/values into plane(r) and read them there: what remains after the
        last loop is what the policy stores. True for full, deepest, k-deepest and share; not for first(k)
        (loops after k read plane k) nor for policies with a window or sinks.
        """
        if self.extra:
            return False
        last = {self.plane(r): r for r in range(1, self.num_loops + 1)}
        return all(last.get(p, p) == p for p in self.kept)


def _check(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def make_policy(name: str, num_loops: int, *, window: int | None = None, k: int | None = None,
                sinks: int | None = None) -> CachePolicy:
    """Build a cache policy by name.

    ``full``; ``deepest``; ``k-deepest`` (the k deepest planes, Huginn's compress-s with
    S = k n_core); ``share`` (one plane per group of k consecutive loops); ``first`` (the
    first k loops, the shallow window of the RIPE paper's starting plan); ``ripe`` (deepest
    plane plus a full-depth window of W positions, Eq. 9); ``sinks`` (deepest plane plus
    ``sinks`` full-depth positions at the start, optionally with a window).

    A parameter the named policy does not use (``window`` other than for ripe/sinks, ``k``
    other than for k-deepest/share/first, ``sinks`` other than for ripe/sinks) is an error
    unless it is None.
    """
    R = num_loops
    _check("num_loops", R, 1, 10**6)
    if name not in CACHE_POLICIES:
        raise ValueError(f"cache must be one of {CACHE_POLICIES}, got {name!r}")
    for param, value in (("window", window), ("k", k), ("sinks", sinks)):
        if value is not None and name not in POLICY_PARAMETERS[param]:
            raise ValueError(f"{param}={value!r} is not used by cache={name!r}; only cache in "
                             f"{POLICY_PARAMETERS[param]} takes {param}")
    if name in ("full", "deepest"):
        return CachePolicy(name, int(R))
    if name in ("k-deepest", "share", "first"):
        if k is None:
            raise ValueError(f"cache={name!r} needs k (planes kept, 1..{R})")
        _check("k", k, 1, R)
        return CachePolicy(name, int(R), k=int(k))
    if name == "ripe":
        if window is None:
            raise ValueError("cache='ripe' needs window (W >= 0)")
        _check("window", window, 0, 10**9)
        if sinks is not None:
            _check("sinks", sinks, 0, 10**9)
        return CachePolicy("ripe", int(R), window=int(window), sinks=int(sinks or 0))
    if sinks is None:
        raise ValueError("cache='sinks' needs sinks (number of full-depth start positions >= 1)")
    _check("sinks", sinks, 1, 10**9)
    if window is not None:
        _check("window", window, 0, 10**9)
    return CachePolicy("sinks", int(R), window=int(window or 0), sinks=int(sinks))


@dataclass(frozen=True)
class PrefixReads:
    """Depths at which a draft reads verified-prefix keys and values (DAS Eq. 2-3).

    Each of ``key`` and ``value`` is ``"cache"`` (what the cache policy gives at this loop,
    i.e. aligned), ``"deep"`` (plane R) or a fixed plane number.
    """

    key: str | int = "cache"
    value: str | int = "cache"

    def pick(self, which: str, plane: int, num_loops: int) -> int:
        choice = self.key if which == "key" else self.value
        if choice == "cache":
            return plane
        if choice == "deep":
            return num_loops
        return int(choice)

    @property
    def fixed(self) -> bool:
        return isinstance(self.key, int) or isinstance(self.value, int)


ALIGNED = PrefixReads()


def read_planes(policy: CachePolicy, reads: PrefixReads, loop: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(key, value) planes loop ``loop`` reads outside the full-depth positions, and those it reads at them.

    The second pair is None when every prefix position is read at the same planes (no window or sinks,
    fixed reads, or full-depth reads that coincide with plane(r)). A draft refined past R loops reads
    like loop R.
    """
    R = policy.num_loops
    r = min(loop, R)
    if reads.fixed:
        return (reads.pick("key", r, R), reads.pick("value", r, R)), None
    base = policy.plane(r)
    outside = (reads.pick("key", base, R), reads.pick("value", base, R))
    own = (reads.pick("key", r, R), reads.pick("value", r, R))
    return outside, None if not policy.extra or own == outside else own


def make_prefix_reads(spec: str | tuple[int, int] | PrefixReads, num_loops: int) -> PrefixReads:
    """``"aligned"`` (kappa, nu) = (r, r); ``"deep-v"`` (Mature-V) (r, R); ``"deep-k"`` (R, r);
    ``"deep-kv"`` (R, R) (DAS Eq. 4); or an explicit (kappa, nu) pair of planes."""
    if isinstance(spec, PrefixReads):
        return spec
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError(f"prefix_reads as a pair must be (kappa, nu), got {spec!r}")
        for name, plane in zip(("kappa", "nu"), spec, strict=True):
            _check(name, int(plane), 1, num_loops)
        return PrefixReads(int(spec[0]), int(spec[1]))
    table = {"aligned": ("cache", "cache"), "deep-v": ("cache", "deep"), "mature-v": ("cache", "deep"),
             "deep-k": ("deep", "cache"), "deep-kv": ("deep", "deep")}
    if spec not in table:
        raise ValueError(f"prefix_reads must be one of {PREFIX_READS} or a (kappa, nu) pair, got {spec!r}")
    return PrefixReads(*table[spec])
