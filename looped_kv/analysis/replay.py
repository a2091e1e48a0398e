"""Teacher-forced replay, plane substitution arms and the measurements of RIPE Sections 2 and 3.

*Replay* (RIPE Section 2, "Measurement modes"): one prefill of whole texts with an explicit
softmax (float32 or float64) that records the queries, keys and values the caller asks for,
per (loop r, core layer l) and every position; the last ``decoded`` positions act as decoded
tokens. An *arm* (RIPE Section 3.1) reruns the texts while loops r of a region read, for every
prefix position j < t of query t, the reference's plane p instead of their own plane r; the
query's own position j = t always comes from the arm's current computation, and loops outside
the region are computed normally (so they read the arm's own, possibly perturbed, planes).
The measurements are KL(reference || arm) per position, the perturbation size ||delta|| (Sec. 3.1),
the ripening distances Delta_r (Sec. 3.2) with the rounding in each plane that sets their float floor,
and the Q/K/V maturity of DAS Section 3.1 (Fig. 2 top).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from looped_kv.papers import RIPE_SEC_3_1_REGIONS
from looped_kv.runtime.attention import Site, attend
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.model import LoopedLM

KINDS = ("q", "k", "v")
SOFTMAX_DTYPES = (torch.float32, torch.float64)


def check_kinds(name: str, kinds: Iterable[str], allowed: tuple[str, ...] = KINDS) -> tuple[str, ...]:
    if isinstance(kinds, str) or not set(kinds := tuple(kinds)) <= set(allowed) or len(set(kinds)) != len(kinds):
        raise ValueError(f"{name} must be distinct kinds out of {allowed}, got {kinds!r}")
    return kinds


def check_loops(name: str, loops: Iterable[int], num_loops: int, *, nonempty: bool = False) -> tuple[int, ...]:
    loops = tuple(sorted({int(r) for r in loops}))
    if (nonempty and not loops) or any(not 1 <= r <= num_loops for r in loops):
        need = "a non-empty set" if nonempty else "a set"
        raise ValueError(f"{name} must be {need} of loops in 1..{num_loops}, got {loops!r}")
    return loops


def check_softmax(softmax_dtype: torch.dtype) -> None:
    if softmax_dtype not in SOFTMAX_DTYPES:
        raise ValueError(f"softmax_dtype must be one of {SOFTMAX_DTYPES}, got {softmax_dtype}")


@dataclass
class Replay:
    """Logits and recorded tensors of a teacher-forced prefill (RIPE Section 2).

    ``core[kind]`` has shape (len(loops), n_core, B, H, n, D): entry i holds plane ``loops[i]``
    (H = n_heads for queries, n_kv_heads for keys/values). ``prelude[kind]`` and ``coda[kind]``
    have shape (n_layers, B, H, n, D) when edges were recorded.
    """

    logits: Tensor  # (B, n, vocab)
    input_ids: Tensor  # (B, n)
    num_loops: int
    decoded: int
    softmax_dtype: torch.dtype
    loops: tuple[int, ...]
    core: dict[str, Tensor] = field(default_factory=dict)
    prelude: dict[str, Tensor] = field(default_factory=dict)
    coda: dict[str, Tensor] = field(default_factory=dict)

    @property
    def first_decoded(self) -> int:
        """Index of the first decoded position; positions before it are the prefix."""
        return self.input_ids.shape[1] - self.decoded

    def plane(self, kind: str, r: int) -> Tensor:
        """Recorded plane r of ``kind``: (n_core, B, H, n, D)."""
        if kind not in self.core or r not in self.loops:
            raise ValueError(f"plane {r} of {kind!r} was not recorded (kinds {tuple(self.core)}, loops {self.loops})")
        return self.core[kind][self.loops.index(r)]


class ReplayRouter:
    """Causal attention with an explicit softmax that records the requested q/k/v of each call.

    Core calls of loops in ``loops`` go to ``core``; with ``edges`` prelude and coda calls go to
    ``prelude``/``coda``. Storage is allocated on the first call, on ``device`` in ``dtype``
    (default: where and as computed), and written by index, so nothing is stacked at the end.
    """

    def __init__(self, config: LoopedConfig, loops: Iterable[int], *, record: Iterable[str] = ("k", "v"),
                 edges: bool = False, softmax_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        check_softmax(softmax_dtype)
        self.config, self.record = config, check_kinds("record", record)
        self.loops, self.edges, self.softmax_dtype = tuple(loops), edges, softmax_dtype
        self.device, self.dtype = device, dtype
        self.core: dict[str, Tensor] = {}
        self.prelude: dict[str, Tensor] = {}
        self.coda: dict[str, Tensor] = {}

    def _slot(self, site: Site, kind: str, x: Tensor) -> Tensor | None:
        if site.stage == "core":
            if site.loop not in self.loops:
                return None
            store, lead, index = self.core, (len(self.loops), self.config.n_core), (self.loops.index(site.loop),)
        elif not self.edges:
            return None
        else:
            store = self.prelude if site.stage == "prelude" else self.coda
            lead, index = (self.config.n_prelude if site.stage == "prelude" else self.config.n_coda,), ()
        if kind not in store:
            store[kind] = torch.empty(*lead, *x.shape, dtype=self.dtype or x.dtype, device=self.device or x.device)
        return store[kind][(*index, site.layer)]

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        for kind, x in zip(KINDS, (queries, keys, values), strict=True):
            slot = self._slot(site, kind, x) if kind in self.record else None
            if slot is not None:
                slot.copy_(x)
        return attend(queries, keys, values, causal=True, softmax_dtype=self.softmax_dtype)


@torch.no_grad()
def replay(model: LoopedLM, input_ids: Tensor, num_loops: int, *, softmax_dtype: torch.dtype = torch.float32,
           record: Iterable[str] = ("k", "v"), loops: Iterable[int] | None = None, edges: bool = False,
           decoded: int = 64, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Replay:
    """Teacher-forced prefill of texts ``input_ids`` (B, n) with R = ``num_loops`` (RIPE Section 2).

    Records the kinds in ``record`` (subset of q, k, v) for the core loops in ``loops`` (default
    all 1..R) and, with ``edges``, the prelude and coda; stored on ``device`` in ``dtype`` (e.g.
    ``device="cpu"`` to keep Huginn-0125's planes off the GPU). The last ``decoded`` positions
    are the decoded tokens (``Replay.first_decoded``).
    """
    record = check_kinds("record", record)
    check_softmax(softmax_dtype)
    if num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    loops = check_loops("loops", range(1, num_loops + 1) if loops is None else loops, num_loops)
    n = input_ids.shape[1]
    if not 1 <= decoded < n:
        raise ValueError(f"decoded must be in 1..{n - 1} (sequence length {n}), got {decoded}")
    router = ReplayRouter(model.config, loops, record=record, edges=edges, softmax_dtype=softmax_dtype,
                          device=device, dtype=dtype)
    input_ids = input_ids.to(model.device)
    logits = model(input_ids, num_loops, router=router)
    return Replay(logits, input_ids, num_loops, decoded, softmax_dtype, loops, router.core, router.prelude,
                  router.coda)


class SubstitutionRouter:
    """Attention of an arm (RIPE Sec. 3.1): at loop r with an entry in ``planes``, query t reads
    the reference's plane ``planes[r]`` of the substituted ``kinds`` for prefix positions j < t and
    its own current key/value at j = t, in one softmax; every other call is plain causal attention.
    """

    def __init__(self, reference: Replay, planes: dict[int, int], kinds: tuple[str, ...],
                 softmax_dtype: torch.dtype) -> None:
        self.reference, self.planes, self.kinds, self.softmax_dtype = reference, planes, kinds, softmax_dtype

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        if site.stage != "core" or site.loop not in self.planes:
            return attend(queries, keys, values, causal=True, softmax_dtype=self.softmax_dtype)
        p = self.planes[site.loop]
        prefix_k, prefix_v = (self.reference.plane(kind, p)[site.layer].to(x.device, x.dtype) if kind in self.kinds
                              else x for kind, x in (("k", keys), ("v", values)))
        n = queries.shape[2]
        own = torch.eye(n, dtype=torch.bool, device=queries.device)
        mask = torch.cat([torch.ones_like(own).tril(-1), own], dim=1)  # [prefix j < t | own j = t]
        return attend(queries, torch.cat([prefix_k, keys], dim=2), torch.cat([prefix_v, values], dim=2), mask,
                      softmax_dtype=self.softmax_dtype)


def paper_region(name: str, num_loops: int) -> tuple[int, ...]:
    """RIPE Sec. 3.1 regions scaled to R: shallow = loops 2-9, deep = 25-32 of R = 32.

    Each bound x becomes Python's ``round(x * R / 32)`` (half to even), clipped to 1..R; the
    region keeps at least one loop.
    """
    if name not in RIPE_SEC_3_1_REGIONS:
        raise ValueError(f"region name must be one of {tuple(RIPE_SEC_3_1_REGIONS)}, got {name!r}")
    if num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    lo, hi = (min(max(round(x * num_loops / 32), 1), num_loops) for x in RIPE_SEC_3_1_REGIONS[name])
    return tuple(range(lo, max(hi, lo) + 1))


def _arm_planes(reference: Replay, plane: int, region: Iterable[int],
                kinds: Iterable[str]) -> tuple[dict[int, int], tuple[str, ...]]:
    """Validated {loop: plane} map and kinds of an arm; every plane it reads must have been recorded."""
    R = reference.num_loops
    kinds = check_kinds("kinds", kinds, ("k", "v"))
    if not kinds:
        raise ValueError("kinds must name at least one of ('k', 'v')")
    if not 1 <= plane <= R:
        raise ValueError(f"plane must be in 1..{R}, got {plane}")
    region = check_loops("region", region, R, nonempty=True)
    for kind in kinds:
        reference.plane(kind, plane)
    return {r: plane for r in region}, kinds


@torch.no_grad()
def substitute(model: LoopedLM, reference: Replay, plane: int, region: Iterable[int], *,
               kinds: Iterable[str] = ("k", "v"), softmax_dtype: torch.dtype | None = None) -> Tensor:
    """Logits (B, n, vocab) of the arm in which loops ``region`` read the reference's plane ``plane``
    for the prefix ``kinds`` (keys, values or both) of every query (RIPE Sec. 3.1).

    The reference must have recorded plane ``plane`` of those kinds; the softmax dtype defaults to
    the reference's.
    """
    planes, kinds = _arm_planes(reference, plane, region, kinds)
    softmax_dtype = reference.softmax_dtype if softmax_dtype is None else softmax_dtype
    check_softmax(softmax_dtype)
    router = SubstitutionRouter(reference, planes, kinds, softmax_dtype)
    return model(reference.input_ids.to(model.device), reference.num_loops, router=router)


def deepest_plane_arm(model: LoopedLM, reference: Replay, *, kinds: Iterable[str] = ("k", "v"),
                      softmax_dtype: torch.dtype | None = None) -> Tensor:
    """Logits of the arm in which every loop r < R reads the reference's plane R for the prefix (RIPE Eq. 6)."""
    R = reference.num_loops
    return substitute(model, reference, R, range(1, R), kinds=kinds, softmax_dtype=softmax_dtype)


#: Smallest KL that :func:`kl` resolves (float64 logits): a KL below it is indistinguishable from 0.
KL_RESOLUTION = 1e-30


def kl(reference: Tensor, arm: Tensor) -> Tensor:
    """KL(reference || arm) per row of logits, in float64: shape ``reference.shape[:-1]`` (RIPE Sec. 2).

    KL = E_p[z_p - z_q] - log sum_v q_v exp(z_p - z_q)_v; when the logits are close, the log-partition
    difference is taken as log1p of a small sum, so that KL far below float64's resolution of the
    probabilities (down to about 1e-30) is still resolved rather than lost in rounding. The analysis layer's
    one KL function.
    """
    a, b = reference.double(), arm.double()
    delta = a - b
    near = delta.abs().amax(-1, keepdim=True) < 1
    shift = torch.where(near, torch.log1p((b.softmax(-1) * torch.expm1(delta.clamp(max=1))).sum(-1, keepdim=True)),
                        a.logsumexp(-1, keepdim=True) - b.logsumexp(-1, keepdim=True))
    return (a.softmax(-1) * delta).sum(-1) - shift.squeeze(-1)


kl_per_position = kl  # the name tests/test_replay.py and tests/test_measure_planes.py import


def _relative(x: Tensor, ref: Tensor, stop: int) -> Tensor:
    """||x - ref|| / ||ref|| over heads, positions < ``stop`` and head dims, per leading index: (n_core, B)."""
    x, ref = x[..., :stop, :].double(), ref[..., :stop, :].double()
    return (x - ref).flatten(2).norm(dim=-1) / ref.flatten(2).norm(dim=-1)


def perturbation_size(reference: Replay, plane: int, region: Iterable[int], *,
                      kinds: Iterable[str] = ("k", "v")) -> Tensor:
    """||delta|| of an arm per text, shape (B,) (RIPE Sec. 3.1).

    ||delta||^2 = sum over loops r in ``region``, core layers l and substituted kinds X of
    (||X_p - X_r|| / ||X_r||)^2, each norm over heads, prefix positions (j < first_decoded) and
    head dims of one text. The reference must have recorded planes p and every r in the region.
    """
    planes, kinds = _arm_planes(reference, plane, region, kinds)
    stop = reference.first_decoded
    squares = [_relative(reference.plane(X, p), reference.plane(X, r), stop).pow(2).sum(0)
               for r, p in planes.items() for X in kinds]
    return torch.stack(squares).sum(0).sqrt()


def ripening(reference: Replay, *, kinds: Iterable[str] = ("k", "v"), per_text: bool = False) -> dict[str, Tensor]:
    """Delta_r = ||X^(r) - X^(R)|| / ||X^(R)|| over prefix positions, averaged over core layers and texts
    (RIPE Sec. 3.2), for each recorded loop: kind -> (len(reference.loops),) float64, or with ``per_text``
    kind -> (B, len(reference.loops)), averaged over core layers only (its mean over texts is the average)."""
    kinds = check_kinds("kinds", kinds)
    stop, R = reference.first_decoded, reference.num_loops
    out = {X: torch.stack([_relative(reference.plane(X, r), reference.plane(X, R), stop).mean(0)
                           for r in reference.loops], dim=-1) for X in kinds}
    return out if per_text else {X: d.mean(0) for X, d in out.items()}


def rounding(reference: Replay, exact: Replay, *, kinds: Iterable[str] = ("k", "v")) -> dict[str, Tensor]:
    """What rounding puts into each plane: ||X^(r) - X_exact^(r)|| / ||X_exact^(r)|| over prefix positions,
    averaged over core layers, per text, where ``exact`` replays the same texts in a higher precision:
    kind -> (B, len(reference.loops)) float64. Two planes r and R of one text that agree exactly in ``exact``
    lie at most the sum of their two values apart in ``reference``: the float floor of Delta_r (RIPE Sec. 3.2).
    """
    kinds = check_kinds("kinds", kinds)
    if not torch.equal(exact.input_ids.to(reference.input_ids.device), reference.input_ids):
        raise ValueError("exact must be a replay of the same texts as reference")
    if exact.loops != reference.loops or exact.decoded != reference.decoded:
        raise ValueError(f"exact must record the reference's loops {reference.loops} with decoded = "
                         f"{reference.decoded}, got loops {exact.loops} and decoded = {exact.decoded}")
    stop = reference.first_decoded
    return {X: torch.stack([_relative(reference.plane(X, r), exact.plane(X, r).to(reference.plane(X, r).device),
                                      stop).mean(0) for r in reference.loops], dim=-1) for X in kinds}


def maturity(reference: Replay, *, kinds: Iterable[str] = ("q", "k", "v"), per_text: bool = False) -> dict[str, Tensor]:
    """Mean cosine similarity of each recorded loop's vectors to loop R's, averaged over core layers,
    texts, heads and all positions, decoded ones included (DAS Sec. 3.1, Fig. 2 top):
    kind -> (len(reference.loops),) float64, or with ``per_text`` kind -> (B, len(reference.loops)), averaged
    over everything but the text (its mean over texts is the average)."""
    kinds = check_kinds("kinds", kinds)
    R = reference.num_loops

    def cosine(X: str, r: int) -> Tensor:  # (B,): mean over core layers, heads and positions
        cos = F.cosine_similarity(reference.plane(X, r).double(), reference.plane(X, R).double(), dim=-1)
        return cos.transpose(0, 1).flatten(1).mean(-1)

    out = {X: torch.stack([cosine(X, r) for r in reference.loops], dim=-1) for X in kinds}
    return out if per_text else {X: m.mean(0) for X, m in out.items()}
