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
from dataclasses import dataclass

CACHE_POLICIES = ("full", "deepest", "k-deepest", "share", "first", "ripe", "sinks")
# The cache policies that read each optional make_policy parameter; any other policy rejects it.
POLICY_PARAMETERS = {"window": ("ripe", "sinks"), "k": ("k-deepest", "share", "first"), "sinks": ("ripe", "sinks")}
PREFIX_READS = ("aligned", "deep-v", "deep-k", "deep-kv")


@dataclass(frozen=True)
class CachePolicy:
    """What a cache keeps and what each (loop, query, prefix position) reads."""

    name: str
    num_loops: int
    kept: tuple[int, ...]
    window: int = 0
    sinks: int = 0

    def plane(self, r: int) -> int:
        """Plane read at loop r outside the window and the sinks: the last kept plane at or after r's slot."""
        kind = self.name.split("(")[0]
        R = self.num_loops
        if kind == "full":
            return r
        if kind == "k-deepest":
            return R - (R - r) % len(self.kept)
        if kind == "share":
            step = self.kept[0]
            return min(math.ceil(r / step) * step, R)
        if kind == "first":
            return min(r, self.kept[-1])
        return R

    def read(self, r: int, t: int, j: int) -> int:
        """pi(r, t, j) for one query t and prefix position j < t."""
        return r if (t - j <= self.window or j < self.sinks) else self.plane(r)

    @property
    def extra(self) -> tuple[int, ...]:
        """Planes held only for the window and the sinks (the full-depth positions)."""
        if not (self.window or self.sinks):
            return ()
        return tuple(p for p in range(1, self.num_loops + 1) if p not in self.kept)

    @property
    def stores_deepest(self) -> bool:
        return self.num_loops in self.kept


def _check(name: str, value: int, low: int, high: int) -> None:
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
    if name == "full":
        return CachePolicy("full", R, tuple(range(1, R + 1)))
    if name == "deepest":
        return CachePolicy("deepest", R, (R,))
    if name in ("k-deepest", "share", "first"):
        if k is None:
            raise ValueError(f"cache={name!r} needs k (planes kept, 1..{R})")
        _check("k", k, 1, R)
        if name == "k-deepest":
            return CachePolicy(f"k-deepest({k})", R, tuple(range(R - k + 1, R + 1)))
        if name == "share":
            return CachePolicy(f"share({k})", R, tuple(sorted({min(g * k, R) for g in range(1, math.ceil(R / k) + 1)})))
        return CachePolicy(f"first({k})", R, tuple(range(1, k + 1)))
    if name == "ripe":
        if window is None:
            raise ValueError("cache='ripe' needs window (W >= 0)")
        _check("window", window, 0, 10**9)
        if sinks is not None:
            _check("sinks", sinks, 0, 10**9)
        return CachePolicy(f"ripe({window})", R, (R,), window=window, sinks=sinks or 0)
    if sinks is None:
        raise ValueError("cache='sinks' needs sinks (number of full-depth start positions >= 1)")
    _check("sinks", sinks, 1, 10**9)
    if window is not None:
        _check("window", window, 0, 10**9)
    return CachePolicy(f"sinks({sinks})", R, (R,), window=window or 0, sinks=sinks)


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
