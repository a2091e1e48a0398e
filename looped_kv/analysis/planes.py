"""Plane measurements over a set of texts: what chapters 2 ("Planes ripen") and 3 ("Prefix KV matters late") run.

The single-replay measurements live in :mod:`~looped_kv.analysis.replay` and the fits in
:mod:`~looped_kv.analysis.fits`; this module runs them over many texts and collects the results the chapters tabulate:

* :func:`workload_batch`: token windows of one length from every workload, with each text's workload.
* :func:`ripening_curves`: Delta_r of keys and values (RIPE Sec. 3.2) and the Q/K/V maturity of DAS Sec. 3.1 per
  text, replayed in chunks of texts, with the float floor of the distances from a float64 replay of the same texts;
  :func:`ripening_summary` adds the Table 7 fits (Eq. 5 and Remark 1) and :func:`text_ripening` the per-text
  quantities the chapter's verdicts pair.
* :func:`arm_grid`: the plane substitution arms of RIPE Sec. 3.1 (regions x planes), one row per (arm, text)
  with the KL at the first decoded position and ||delta||, ready for ``fits.sensitivity_regression``;
  :func:`exact_replay` and :func:`precision_floor` give the KL resolution of the replay's dtype,
  :func:`regression_rows` sets rows at that floor the paper's way, :func:`resolved_slope` fits one region over the
  rows above it and :func:`region_contrast` pairs the two regions' KLs per text at matched planes.
* :func:`first_position_agreement`: RIPE Table 3, the first-decoded-position top-1 agreement of equal-storage
  cache policies with the full cache, through real :class:`~looped_kv.runtime.cache.PlaneCache` objects.
* :func:`eq6_check`: the deepest-plane prediction of Eq. (6) against the deepest-plane arm's measured KL.

Texts are token windows of one common length (``text_batch``), so that a batch is one tensor and every text
has the same first decoded position. Replays keep their per-loop records where :func:`record_device` says
(host memory for a real checkpoint), :func:`cast_in_place` lends one model copy a wider dtype for an exact
replay, and :func:`free_memory` returns a freed copy's memory to the device.
"""

from __future__ import annotations

import copy
import gc
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import statsmodels.api as sm
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from looped_kv.analysis.fits import (
    DecayLaws,
    FloorFit,
    GeometricFit,
    RegionSlope,
    Ripeness,
    SensitivityFit,
    decay_laws,
    deep_loop_delta,
    deep_loop_range,
    deep_perturbation_size,
    fit_floor,
    fit_geometric,
    fit_loop_range,
    ripeness,
)
from looped_kv.analysis.replay import (
    Replay,
    check_kinds,
    check_loops,
    deepest_plane_arm,
    kl,
    maturity,
    paper_region,
    perturbation_size,
    replay,
    ripening,
    rounding,
    substitute,
)
from looped_kv.decoding.passes import new_cache, prefill, step
from looped_kv.papers import RIPE_SEC_3_1_PLANES
from looped_kv.runtime.attention import Site
from looped_kv.runtime.cache import PlaneCache
from looped_kv.runtime.memory import policy_bytes
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy
from looped_kv.workloads import data
from looped_kv.workloads import texts as workload_texts

# RIPE Table 3's rows (labels of looped_kv.papers.RIPE_TABLE_3): (row label, policy name, k of R = 32);
# k of share/first scales with R
TABLE3_POLICIES = (("deepest plane", "deepest", None), ("two deepest planes", "k-deepest", 2),
                   ("share every 8 loops", "share", 8), ("first 4 loops", "first", 4),
                   ("share every 4 loops", "share", 4), ("first 8 loops", "first", 8))


def _check_ids(ids: Tensor) -> None:
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (texts, length) with length >= 2, got shape {tuple(ids.shape)}")


RECORD_DEVICES = ("model", "cpu")


def record_device(model: LoopedLM, where: str) -> torch.device:
    """Where a replay keeps its per-loop records: on the model's device (``"model"``) or in host memory
    (``"cpu"``, what a real checkpoint's profile asks for: Huginn-0125's planes of one text fill gigabytes)."""
    if where not in RECORD_DEVICES:
        raise ValueError(f"where must be one of {RECORD_DEVICES}, got {where!r}")
    return model.device if where == "model" else torch.device("cpu")


def free_memory(device: torch.device | str) -> None:
    """Return the memory of deleted tensors: collect garbage, and empty PyTorch's cache on a CUDA device."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def cast_in_place(model: LoopedLM, dtype: torch.dtype) -> Iterator[LoopedLM]:
    """The model itself, cast to the wider ``dtype`` for the block and cast back after it.

    Widening a float (float32 to float64) and narrowing it back restore every weight bit for bit, so one copy
    of a real checkpoint serves a float32 and a float64 replay without a second copy's memory.
    """
    original = model.dtype
    wider = isinstance(dtype, torch.dtype) and dtype.is_floating_point
    if wider:  # every value of the model's dtype is a value of ``dtype``: finer steps and a larger range
        wide, narrow = torch.finfo(dtype), torch.finfo(original)
        wider = wide.eps <= narrow.eps and wide.max >= narrow.max
    if not wider:
        raise ValueError(f"dtype must be a floating-point dtype at least as wide as the model's {original}, "
                         f"got {dtype!r}")
    model.to(dtype)
    try:
        yield model
    finally:
        model.to(original)


def text_batch(model: LoopedLM, texts: Sequence[str], length: int) -> Tensor:
    """Token windows (B, ``length``): each text's first ``length`` tokens; texts shorter than that are skipped."""
    if length < 2:
        raise ValueError(f"length must be >= 2, got {length}")
    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer (model.tokenizer is None)")
    rows = [model.tokenizer(t, return_tensors="pt").input_ids[0] for t in texts]
    kept = [r[:length] for r in rows if r.numel() >= length]
    if not kept:
        longest = max((r.numel() for r in rows), default=0)
        raise ValueError(f"no text has {length} tokens (longest {longest}); use shorter windows or longer texts")
    return torch.stack(kept).to(model.device)


def workload_batch(model: LoopedLM, workloads: Sequence[str], per_workload: int, length: int,
                   split: str = "eval", source: str = "generated") -> tuple[Tensor, np.ndarray]:
    """Token windows (B, ``length``) of ``per_workload`` texts of each workload (:func:`looped_kv.workloads.texts`
    of ``source``, cut to ``8 * length`` characters), and each row's workload. Texts shorter than ``length``
    tokens are skipped, so a workload may bring fewer rows (the labels say how many)."""
    if per_workload < 1:
        raise ValueError(f"per_workload must be >= 1, got {per_workload}")
    unknown = [w for w in workloads if w not in data.WORKLOADS]
    if not workloads or unknown:
        raise ValueError(f"workloads must be a non-empty subset of {data.WORKLOADS}, got {tuple(workloads)!r}")
    parts = [text_batch(model, workload_texts(w, per_workload, split, 8 * length, source), length)
             for w in workloads]
    labels = np.concatenate([np.full(part.shape[0], w, dtype=object) for w, part in zip(workloads, parts,
                                                                                         strict=True)])
    return torch.cat(parts), labels


def _chunks(ids: Tensor, chunk: int) -> list[Tensor]:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return list(ids.split(chunk, dim=0))


# -- ripening and maturity (RIPE Sec. 3.2, DAS Sec. 3.1) ------------------------------------------


@dataclass(frozen=True)
class RipeningCurves:
    """Per-text curves of one replay precision, loops 1..R: ``text_delta[kind][i, r - 1]`` is Delta_r of text i
    (averaged over core layers), ``text_maturity[kind][i, r - 1]`` its mean cosine to loop R. ``delta`` and
    ``maturity`` are their means over texts: the averages over layers and texts of RIPE Sec. 3.2 and of DAS
    Fig. 2 (top). ``text_rounding[kind][i, r - 1]``, when measured, is the rounding in plane r of text i
    (:func:`~looped_kv.analysis.replay.rounding`), from which :meth:`float_floor` follows."""

    num_loops: int
    text_delta: dict[str, np.ndarray]
    text_maturity: dict[str, np.ndarray]
    dtype: torch.dtype
    text_rounding: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def loops(self) -> np.ndarray:
        return np.arange(1, self.num_loops + 1)

    @property
    def texts(self) -> int:
        return next(iter(self.text_delta.values())).shape[0]

    @property
    def delta(self) -> dict[str, np.ndarray]:
        return {X: d.mean(0) for X, d in self.text_delta.items()}

    @property
    def maturity(self) -> dict[str, np.ndarray]:
        return {X: m.mean(0) for X, m in self.text_maturity.items()}

    def _check_kind(self, kind: str, measured: Mapping[str, np.ndarray]) -> None:
        if kind not in measured:
            raise ValueError(f"kind must be one of {tuple(measured)}, got {kind!r}")

    def fitted(self, kind: str, loop_range: tuple[int, int] | None = None) -> np.ndarray:
        """Every text's Delta_r of ``kind`` over the loops a ripening fit uses (default :func:`fit_loop_range`, as
        Table 7): (texts, loops)."""
        self._check_kind(kind, self.text_delta)
        low, high = loop_range if loop_range is not None else fit_loop_range(self.num_loops)
        if not 1 <= low <= high <= self.num_loops:
            raise ValueError(f"loop_range must be (low, high) with 1 <= low <= high <= {self.num_loops}, "
                             f"got {loop_range}")
        return self.text_delta[kind][:, low - 1:high]

    def float_floor(self, kind: str) -> float:
        """The float floor of Delta_r: the largest distance rounding alone can put between two planes r and R of
        one text, the rounding of plane r plus plane R's, over texts and loops. Distances at or below it measure
        rounding, not ripening."""
        if not self.text_rounding:
            raise ValueError("the float floor needs the rounding of the planes: replay with exact_dtype")
        self._check_kind(kind, self.text_rounding)
        eps = self.text_rounding[kind]
        return float((eps + eps[:, -1:]).max())


@torch.no_grad()
def ripening_curves(model: LoopedLM, ids: Tensor, num_loops: int, *, decoded: int,
                    softmax_dtype: torch.dtype = torch.float32, maturity_kinds: Iterable[str] = ("q", "k", "v"),
                    exact_dtype: torch.dtype | None = None, chunk: int = 8,
                    record_device: torch.device | str | None = None, progress: bool = False) -> RipeningCurves:
    """Delta_r (RIPE Sec. 3.2) of keys and values and the maturity (DAS Fig. 2 top) of every text of ``ids`` (B, n).

    The texts are replayed ``chunk`` at a time in the model's dtype (softmax in ``softmax_dtype``), with their
    records on ``record_device`` (default the model's), so memory holds one chunk's planes. Per text the results
    are :func:`~looped_kv.analysis.replay.ripening` and :func:`~looped_kv.analysis.replay.maturity` with
    ``per_text``; their means over texts are the averages over layers and texts. With ``exact_dtype`` (e.g.
    float64) each chunk is replayed a second time by the model cast to it in place (:func:`cast_in_place`, float64
    softmax), which measures the rounding in every plane (``text_rounding``) and so the float floor.
    """
    _check_ids(ids)
    maturity_kinds = check_kinds("maturity_kinds", maturity_kinds)  # before any replay
    if exact_dtype is not None and not (isinstance(exact_dtype, torch.dtype) and exact_dtype.is_floating_point):
        raise ValueError(f"exact_dtype must be None or a floating-point torch dtype, got {exact_dtype!r}")
    record = tuple(X for X in ("q", "k", "v") if X in ("k", "v") or X in maturity_kinds)
    parts: dict[tuple[str, str], list[np.ndarray]] = {(name, X): [] for name in ("delta", "rounding")
                                                       for X in ("k", "v")}
    parts |= {("maturity", X): [] for X in maturity_kinds}
    for part in tqdm(_chunks(ids, chunk), desc=f"replay {model.dtype}".replace("torch.", ""), disable=not progress,
                     leave=False):
        ref = replay(model, part, num_loops, softmax_dtype=softmax_dtype, record=record, decoded=decoded,
                     device=record_device)
        for X, d in ripening(ref, per_text=True).items():
            parts["delta", X].append(d.cpu().numpy())
        if maturity_kinds:
            for X, m in maturity(ref, kinds=maturity_kinds, per_text=True).items():
                parts["maturity", X].append(m.cpu().numpy())
        if exact_dtype is not None:
            with cast_in_place(model, exact_dtype):
                exact = replay(model, part, num_loops, softmax_dtype=torch.float64, decoded=decoded,
                               device=record_device)
            for X, e in rounding(ref, exact).items():
                parts["rounding", X].append(e.cpu().numpy())
            del exact
        del ref
    measured = ("k", "v") if exact_dtype is not None else ()
    return RipeningCurves(num_loops=num_loops, text_delta={X: np.concatenate(parts["delta", X]) for X in ("k", "v")},
                          text_maturity={X: np.concatenate(parts["maturity", X]) for X in maturity_kinds},
                          dtype=model.dtype, text_rounding={X: np.concatenate(parts["rounding", X]) for X in measured})


def text_ripening(curves: RipeningCurves, floors: Mapping[str, float],
                  loop_range: tuple[int, int] | None = None) -> pd.DataFrame:
    """One row per text of the quantities the ripening claims pair over texts (RIPE Sec. 3.2, DAS Sec. 3.1).

    Per kind X in k, v: ``rho_X``, ``geometric_rms_X`` and ``power_rms_X`` (:func:`fits.decay_laws` over
    ``loop_range``, default :func:`fit_loop_range`, distances at or below ``floors[X]`` set to it), and ``deep_X``,
    the mean Delta_r over the deep loops of Table 7 (25..31 of R = 32, scaled). Per recorded maturity kind:
    ``cos1_X``, the cosine of loop 1 to loop R.
    """
    missing = [X for X in ("k", "v") if X not in floors]
    if missing:
        raise ValueError(f"floors must give a floor for keys and values ('k', 'v'), missing {missing}")
    R, loops = curves.num_loops, curves.loops
    deep = deep_loop_range(R)
    rows = []
    for i in range(curves.texts):
        row = {}
        for X in ("k", "v"):
            laws: DecayLaws = decay_laws(loops, curves.text_delta[X][i], R, loop_range, floor=floors[X])
            row |= {f"rho_{X}": laws.rho, f"geometric_rms_{X}": laws.geometric_rms,
                    f"power_rms_{X}": laws.power_rms,
                    f"deep_{X}": float(curves.text_delta[X][i, deep.start - 1:deep.stop - 1].mean())}
        row |= {f"cos1_{X}": float(m[i, 0]) for X, m in curves.text_maturity.items()}
        rows.append(row)
    return pd.DataFrame(rows).rename_axis("text")


@dataclass(frozen=True)
class RipeningFit:
    """One column entry of RIPE Table 7 for one kind (keys or values)."""

    kind: str
    geometric: GeometricFit  # c rho^r on fp32, loops 8..R-1 (scaled)
    floor: FloorFit  # Delta_inf of Eq. (5) on bf16, rho and c fixed
    deep_bf16: float  # mean Delta over the deep loops 25..31 (scaled), bf16
    deep_fp32: float
    ripeness: Ripeness  # Remark 1: deep-loop bf16 Delta against the floor


def ripening_rates(fp32: RipeningCurves, loop_range: tuple[int, int] | None = None) -> dict[str, GeometricFit]:
    """RIPE's rho for keys and values: c rho^r fitted to the fp32 distances of plane r to plane R (Sec. 3.2, Table 7;
    default :func:`fit_loop_range`). The one definition of the book's rho: chapter 2's Table 7 column and the tiny
    model's "slow ripening" gate both take it from here."""
    return {X: fit_geometric(fp32.loops, fp32.delta[X], fp32.num_loops, loop_range) for X in ("k", "v")}


def ripening_summary(fp32: RipeningCurves, bf16: RipeningCurves,
                     loop_range: tuple[int, int] | None = None) -> dict[str, RipeningFit]:
    """Table 7 fits for keys and values: geometric fit to fp32 (default :func:`fit_loop_range`), the bf16 floor of
    Eq. (5) with rho and c fixed, deep-loop Delta in both precisions and the ripeness label of Remark 1."""
    R = fp32.num_loops
    if bf16.num_loops != R:
        raise ValueError(f"fp32 and bf16 curves must have the same R, got {R} and {bf16.num_loops}")
    loops = fp32.loops
    out = {}
    for X, geo in ripening_rates(fp32, loop_range).items():
        floor = fit_floor(loops, bf16.delta[X], geo.rho, geo.c, R, loop_range)
        deep_bf16 = deep_loop_delta(loops, bf16.delta[X], R)
        out[X] = RipeningFit(kind=X, geometric=geo, floor=floor, deep_bf16=deep_bf16,
                             deep_fp32=deep_loop_delta(loops, fp32.delta[X], R),
                             ripeness=ripeness(deep_bf16, max(floor.delta_inf, floor.bound), resolved=floor.resolved))
    return out


def table7_column(fits: Mapping[str, RipeningFit]) -> dict[str, str]:
    """The rows of RIPE Table 7 for one model, formatted "keys (values)" as the paper prints them."""

    def pair(fmt: str, get) -> str:
        return f"{fmt.format(get(fits['k']))} ({fmt.format(get(fits['v']))})"

    return {"rho": pair("{:.2f}", lambda f: f.geometric.rho),
            "half-life (loops)": pair("{:.1f}", lambda f: f.geometric.half_life),
            "Delta_inf (bf16)": pair("{:.2g}", lambda f: f.floor.delta_inf),
            "deep-loop Delta, bf16": pair("{:.2g}", lambda f: f.deep_bf16),
            "deep-loop Delta, fp32": pair("{:.2g}", lambda f: f.deep_fp32),
            "max |log residual|, fp32": pair("{:.2f}", lambda f: f.geometric.max_abs_log_residual),
            "ripeness (Remark 1)": pair("{}", lambda f: f.ripeness.label)}


# -- plane substitution arms (RIPE Sec. 3.1) ------------------------------------------------------


def paper_planes(num_loops: int) -> tuple[int, ...]:
    """The substituted planes {1, 4, 8, 16, 24, 32} of RIPE Sec. 3.1 scaled to R: round(p R / 32) in 1..R."""
    if num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    return tuple(sorted({min(max(round(p * num_loops / 32), 1), num_loops) for p in RIPE_SEC_3_1_PLANES}))


@dataclass
class ArmGrid:
    """Arms of RIPE Sec. 3.1 over texts: ``rows`` has one row per (arm, text) with columns text, region, deep,
    plane, kl (KL(reference || arm) at the first decoded position, float64) and size (||delta||);
    ``positions`` has one row per (arm, text, decoded position) with columns text, region, deep, plane,
    offset (0 = the first decoded position) and kl."""

    reference: Replay
    rows: pd.DataFrame
    positions: pd.DataFrame

    def medians(self) -> pd.DataFrame:
        """Arm medians over texts of size and KL (the points of RIPE Fig. 2a-b)."""
        return (self.rows.groupby(["region", "deep", "plane"], as_index=False)[["size", "kl"]].median()
                .sort_values(["deep", "plane"]).reset_index(drop=True))


@torch.no_grad()
def arm_grid(model: LoopedLM, ids: Tensor, num_loops: int, *, planes: Iterable[int] | None = None,
             regions: Mapping[str, Iterable[int]] | None = None, decoded: int = 1,
             softmax_dtype: torch.dtype = torch.float32, kinds: Iterable[str] = ("k", "v"),
             record_device: torch.device | str | None = None, progress: bool = True) -> ArmGrid:
    """Replay texts ``ids`` (B, n) once and run every (region, plane) arm (RIPE Sec. 3.1, Fig. 2a-b).

    ``regions`` defaults to the paper's shallow (loops 2-9) and deep (25-32) regions scaled to R, ``planes``
    to :func:`paper_planes` but any plane that is a region's only loop (an arm that would substitute nothing).
    An arm's KL is taken at the first decoded position ``n - decoded`` (``rows``) and at every decoded position
    (``positions``). The reference's planes stay on ``record_device`` (default the
    model's; ``"cpu"`` keeps a real checkpoint's planes in host memory, and each arm copies in the planes it
    reads, one layer at a time).
    """
    _check_ids(ids)
    if num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    regions = ({name: paper_region(name, num_loops) for name in ("shallow", "deep")} if regions is None
               else {name: tuple(loops) for name, loops in regions.items()})
    if set(regions) != {"shallow", "deep"}:
        raise ValueError(f"regions must name 'shallow' and 'deep', got {sorted(regions)}")
    for name, loops in regions.items():  # every check before the reference replay, the expensive part
        check_loops(f"regions[{name!r}]", loops, num_loops, nonempty=True)
    if planes is None:  # a plane that is a region's one loop substitutes nothing there (R = 4: loop 1, plane 1)
        planes = tuple(p for p in paper_planes(num_loops) if all(loops != (p,) for loops in regions.values()))
    planes = tuple(planes)
    check_loops("planes", planes, num_loops, nonempty=True)
    kinds = check_kinds("kinds", kinds, ("k", "v"))
    if not kinds:
        raise ValueError("kinds must name at least one of ('k', 'v')")
    ref = replay(model, ids, num_loops, softmax_dtype=softmax_dtype, record=kinds, decoded=decoded,
                 device=record_device)
    t = ref.first_decoded
    records, per_position = [], []
    arms = [(name, p) for name in ("shallow", "deep") for p in planes]
    for name, p in tqdm(arms, desc="arms", disable=not progress, leave=False):
        logits = substitute(model, ref, p, regions[name], kinds=kinds)
        divergence = kl(ref.logits[:, t:], logits[:, t:]).cpu().numpy()  # (B, decoded)
        size = perturbation_size(ref, p, regions[name], kinds=kinds).cpu().numpy()
        arm = {"region": name, "deep": int(name == "deep"), "plane": p}
        records += [{"text": i, **arm, "kl": float(divergence[i, 0]), "size": float(size[i])}
                    for i in range(ids.shape[0])]
        per_position += [{"text": i, **arm, "offset": o, "kl": float(divergence[i, o])}
                         for i in range(ids.shape[0]) for o in range(decoded)]
        del logits  # freed before the next arm's forward, which would otherwise hold it beside its own
    return ArmGrid(ref, pd.DataFrame.from_records(records), pd.DataFrame.from_records(per_position))


@torch.no_grad()
def exact_replay(model: LoopedLM, ids: Tensor, num_loops: int, *, decoded: int,
                 dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
                 chunk: int | None = None) -> Replay:
    """A replay of ``ids`` that records nothing, by a copy of the model in ``dtype`` with a float64 softmax.

    The copy is freed before returning (:func:`free_memory`), and the logits are moved to ``device`` (default the
    model's), so a chapter holds the float64 weights only while this runs, never next to a float32 copy. Texts
    run ``chunk`` at a time (default all at once), so one chunk's forward is in memory.
    """
    parts = _chunks(ids, ids.shape[0] if chunk is None else chunk)  # checks chunk before the copy
    twin = in_dtype(model, dtype)
    logits = []
    for part in parts:
        exact = replay(twin, part, num_loops, softmax_dtype=torch.float64, record=(), decoded=decoded)
        logits.append(exact.logits.to(device or exact.logits.device))
    exact.logits, exact.input_ids = torch.cat(logits), ids.to(exact.input_ids.device)
    del logits
    if twin is not model:
        del twin
        free_memory(model.device)
    return exact


@torch.no_grad()
def precision_floor(model: LoopedLM, reference: Replay, *, exact: Replay | None = None,
                    exact_dtype: torch.dtype = torch.float64) -> np.ndarray:
    """Per-text KL(exact || reference) at the first decoded position: the KL the reference's own rounding causes.

    ``exact`` is a replay of the same texts in a higher precision (:func:`exact_replay`); without it the texts are
    replayed by a copy of the model in ``exact_dtype``. A KL below this resolution cannot be told from rounding:
    such rows sit "at the floor" of the sensitivity regression (RIPE Sec. 3.1 counts its rows at the bf16 floor).
    """
    ids, t = reference.input_ids, reference.first_decoded
    if exact is not None:
        if not torch.equal(exact.input_ids.to(ids.device), ids):
            raise ValueError("exact must be a replay of the same texts as reference")
    else:
        if model.dtype == exact_dtype:
            raise ValueError(f"the model is already in exact_dtype {exact_dtype}: pass a more precise replay as exact")
        exact = exact_replay(model, ids, reference.num_loops, decoded=reference.decoded, dtype=exact_dtype)
    logits = exact.logits[:, t].to(reference.logits.device)
    return kl(logits, reference.logits[:, t]).cpu().numpy()


def _copy_in(model: LoopedLM, dtype: torch.dtype) -> LoopedLM:
    """A deep copy of the weights in ``dtype``; the tokenizer is shared, not copied.

    Each floating-point tensor is cast as it is copied, so memory holds the original and the copy in ``dtype``,
    never a second copy in the original dtype (for Huginn-0125 in bf16, 7.1 GB less at the peak).
    """
    tokenizer = getattr(model, "tokenizer", None)
    memo: dict[int, object] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point() and id(tensor) not in memo:
            cast = tensor.detach().to(dtype, copy=True)
            memo[id(tensor)] = nn.Parameter(cast, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else cast
    memo[id(model._states)] = None  # the table of initial states is rebuilt on first use, in ``dtype``
    model.tokenizer = None
    try:
        twin = copy.deepcopy(model, memo)
    finally:
        model.tokenizer = tokenizer
    twin.tokenizer, twin.source = tokenizer, getattr(model, "source", None)
    return twin


def in_dtype(model: LoopedLM, dtype: torch.dtype) -> LoopedLM:
    """``model`` itself if it is in ``dtype``, else a copy of its weights cast to ``dtype``, tokenizer kept (e.g. the
    bf16 model of the bf16 replay). Casting the bf16 model up gives an fp32 arm the same weights, so that it
    differs from the bf16 reference in arithmetic only."""
    return model if model.dtype == dtype else _copy_in(model, dtype)


def regression_rows(grid: ArmGrid, floor: float) -> pd.DataFrame:
    """Rows for ``fits.sensitivity_regression``: KLs at or below ``floor`` are set to the floor (they stay in the fit,
    as the paper's rows at the KL floor do) and flagged in column ``at_floor``."""
    if not (math.isfinite(floor) and floor > 0):
        raise ValueError(f"floor must be > 0 (log KL is fitted), got {floor}")
    rows = grid.rows.copy()
    rows["at_floor"] = rows["kl"] <= floor
    rows["kl"] = rows["kl"].clip(lower=floor)
    return rows


def region_contrast(rows: pd.DataFrame, floor: float) -> pd.DataFrame:
    """Per text, the shallow and the deep region's KL at matched planes (RIPE Sec. 3.1, Fig. 2a-b).

    ``rows`` are :class:`ArmGrid` rows (text, region, plane, kl); KLs at or below ``floor`` are set to it. Each
    column is the geometric mean over the substituted planes of one region's KL, so the ratio deep / shallow of
    a text is the geometric mean of its per-plane ratios. Index: text; columns: shallow, deep.
    """
    if not (math.isfinite(floor) and floor > 0):
        raise ValueError(f"floor must be > 0 (logs of KLs are averaged), got {floor}")
    missing = [c for c in ("text", "region", "plane", "kl") if c not in rows.columns]
    if missing:
        raise ValueError(f"rows must have columns text, region, plane and kl, missing {missing}")
    logs = rows.assign(log_kl=np.log(rows["kl"].clip(lower=floor)))
    table = logs.pivot_table(index=["text", "plane"], columns="region", values="log_kl", aggfunc="first")
    if list(table.columns) != ["deep", "shallow"] or table.isna().any().any():
        raise ValueError("rows must hold, for every text, the same planes in the 'shallow' and 'deep' regions")
    return np.exp(table.groupby(level="text").mean())[["shallow", "deep"]]


def resolved_slope(rows: pd.DataFrame, region: str, floor: float, level: float = 0.95) -> RegionSlope | None:
    """log KL = intercept + slope log ||delta|| over one region's rows *above* the KL floor (RIPE Sec. 3.1).

    The paper keeps rows at the floor in its regression, where they flatten the slope; this is the slope of what
    was resolved, or None when fewer than 3 distinct sizes of at least 2 texts lie above the floor. The interval
    is a t-interval with standard errors clustered by text (the arms of one text are not independent).
    """
    _check_level_open(level)
    if region not in ("shallow", "deep"):
        raise ValueError(f"region must be 'shallow' or 'deep', got {region!r}")
    chosen = rows[(rows["deep"] == int(region == "deep")) & (rows["kl"] > floor)]
    if chosen["size"].nunique() < 3 or chosen["text"].nunique() < 2:
        return None
    x = sm.add_constant(np.log(chosen["size"].to_numpy(dtype=float)))
    fit = sm.OLS(np.log(chosen["kl"].to_numpy(dtype=float)), x).fit(
        cov_type="cluster", cov_kwds={"groups": pd.factorize(chosen["text"])[0]})
    low, high = fit.conf_int(alpha=1 - level)[1]
    return RegionSlope(intercept=float(fit.params[0]), slope=float(fit.params[1]), ci=(float(low), float(high)),
                       n=len(chosen), sizes=(float(chosen["size"].min()), float(chosen["size"].max())))


def _check_level_open(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")


# -- equal-storage caches (RIPE Table 3) ----------------------------------------------------------


def table3_policies(num_loops: int) -> dict[str, CachePolicy]:
    """RIPE Table 3's equal-storage caches for R loops (the k of share/first scaled as round(k R / 32), >= 1)."""
    out = {}
    for label, name, k in TABLE3_POLICIES:
        if k is not None and name != "k-deepest":
            k = min(max(round(k * num_loops / 32), 1), num_loops)
        elif k is not None:
            k = min(k, num_loops)
        out[label] = make_policy(name, num_loops, k=k)
    return out


def restrict(full: PlaneCache, policy: CachePolicy) -> PlaneCache:
    """A cache under ``policy`` holding what a prefill under that policy would have stored, copied from a prefilled
    full cache (a prefill reads nothing from its cache, so every policy's prefill computes the same planes)."""
    if full.policy.kept != tuple(range(1, full.policy.num_loops + 1)):
        raise ValueError(f"restrict needs a full cache, got policy {full.policy.name}")
    if policy.num_loops != full.policy.num_loops:
        raise ValueError(f"policy has R = {policy.num_loops}, the cache R = {full.policy.num_loops}")
    like = full.core[0]
    cfg, L = full.config, full.length
    cache = PlaneCache(cfg, policy, batch=full.batch, capacity=full.capacity, dtype=like.dtype, device=like.device)
    sites = [Site(stage, layer) for stage, n_layers in (("prelude", cfg.n_prelude), ("coda", cfg.n_coda))
             for layer in range(n_layers)]
    sites += [Site("core", layer, p) for layer in range(cfg.n_core) for p in range(1, policy.num_loops + 1)]
    writes = cache.span_writes(0, L)
    planes = {site: tuple(full.plane_tensor(which, site, site.loop if site.stage == "core" else None)[:, :, :L]
                          for which in (0, 1)) for site in sites}
    cache.write(writes, planes)
    cache.advance(L)
    return cache


@dataclass
class Agreement:
    """First-decoded-position comparison of cache policies with the full cache (RIPE Table 3)."""

    table: pd.DataFrame  # one row per policy: planes, bytes, formula bytes, agreement, KL mean/median
    matches: dict[str, np.ndarray]  # per policy, per text: top-1 equal to the full cache's
    kl: dict[str, np.ndarray]  # per policy, per text: KL(full || policy) at the first decoded position
    full_logits: Tensor  # (B, vocab) logits of the full cache at the first decoded position


@torch.no_grad()
def first_position_agreement(model: LoopedLM, ids: Tensor, policies: Mapping[str, CachePolicy], *,
                             first: int | None = None, prefill_once: bool = True, chunk: int | None = None,
                             progress: bool = False) -> Agreement:
    """Top-1 agreement with the full cache at the first decoded position ``first`` (default the last) (Table 3).

    For each policy the prefix ``ids[:, :first]`` is prefilled into a :class:`PlaneCache` under the policy and
    the token at ``first`` is then *stepped*: its reads of the cached prefix follow the policy. (In one pass
    over prefix and token the token would read the in-block prefix at its own loop and the policy would not
    apply.) With ``prefill_once`` the prefix is prefilled once into a full cache and :func:`restrict`-ed to each
    policy, which stores bit for bit what a prefill under the policy stores; otherwise each policy prefills.
    Texts run ``chunk`` at a time (default all at once), so memory holds one chunk's full cache. The table
    reports the caches' bytes after the step (summed over chunks: all B texts) and the formula's (B x
    ``memory.policy_bytes`` at first + 1 positions).

    The step reads the prefix's coda keys/values as the prefill stored them; the replay arms of RIPE Sec. 3.1
    (:func:`~looped_kv.analysis.replay.substitute`) let the coda read the arm's own prefix, perturbed by the
    substitution, so the two agree in the core's reads but not exactly in their logits.
    """
    _check_ids(ids)
    B, n = ids.shape
    first = n - 1 if first is None else first
    if not 1 <= first < n:
        raise ValueError(f"first must be in 1..{n - 1}, got {first}")
    R = {p.num_loops for p in policies.values()}
    if len(R) != 1:
        raise ValueError(f"all policies must share one R, got {sorted(R)}")
    R = R.pop()
    parts = _chunks(ids, B if chunk is None else chunk)
    matches = {label: [] for label in policies}
    kls = {label: [] for label in policies}
    nbytes = dict.fromkeys(policies, 0)
    bases = []
    for part in tqdm(parts, desc="chunks", disable=not progress or len(parts) == 1, leave=False):
        prefix, token = part[:, :first], part[:, first:first + 1]
        full = new_cache(model, make_policy("full", R), part.shape[0], first + 1)
        prefill(model, full, prefix, R)
        stepped = {}
        for label, policy in tqdm(policies.items(), desc="policies", disable=not progress, leave=False):
            if prefill_once:
                cache = restrict(full, policy)
            else:
                cache = new_cache(model, policy, part.shape[0], first + 1)
                prefill(model, cache, prefix, R)
            stepped[label] = step(model, cache, token, R)[:, -1]
            nbytes[label] += cache.nbytes
            del cache
        base = step(model, full, token, R)[:, -1]  # last: the step writes the token into the full cache
        del full
        for label, logits in stepped.items():
            matches[label].append((logits.argmax(-1) == base.argmax(-1)).cpu().numpy())
            kls[label].append(kl(base, logits).cpu().numpy())
        bases.append(base)
    matches = {label: np.concatenate(m) for label, m in matches.items()}
    kls = {label: np.concatenate(parts) for label, parts in kls.items()}
    rows = [{"cache": label, "policy": policy.name, "planes": len(policy.kept), "bytes": nbytes[label],
             "formula bytes": B * policy_bytes(model.config, policy, first + 1, model.dtype),
             "agreement": float(matches[label].mean()), "KL mean": float(kls[label].mean()),
             "KL median": float(np.median(kls[label]))} for label, policy in policies.items()]
    return Agreement(pd.DataFrame(rows).set_index("cache"), matches, kls, torch.cat(bases))


# -- Eq. (6) ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Eq6Check:
    """RIPE Eq. (6): KL_deep ~ e^(a+b) S^g against the deepest-plane arm's measured KL (first decoded position)."""

    from_curve: float  # S from the ripening curve Delta_r (keys and values), deep loops
    from_size: float  # median over texts of e^(a+b) ||delta||^g, ||delta|| measured over the deep loops
    S_curve: float
    S_measured: np.ndarray  # per text
    measured: np.ndarray  # per text: the deepest-plane arm (every loop r < R reads plane R)
    shallow_only: np.ndarray | None  # per text: plane R substituted in the shallow region alone (from a grid)
    deep_only: np.ndarray | None = None  # per text: plane R substituted in the deep region alone (from a grid)

    @property
    def measured_median(self) -> float:
        return float(np.median(self.measured))

    @property
    def measured_mean(self) -> float:
        return float(self.measured.mean())

    @property
    def shallow_only_median(self) -> float:
        return float("nan") if self.shallow_only is None else float(np.median(self.shallow_only))

    @property
    def deep_only_median(self) -> float:
        return float("nan") if self.deep_only is None else float(np.median(self.deep_only))

    @property
    def factor(self) -> float:
        """How far the curve's prediction is from the measured median, as a factor >= 1."""
        ratio = self.from_curve / self.measured_median
        return max(ratio, 1 / ratio)


@torch.no_grad()
def eq6_check(model: LoopedLM, reference: Replay, fit: SensitivityFit, grid: ArmGrid | None = None) -> Eq6Check:
    """Predict the deepest-plane cache's KL at the first decoded position with Eq. (6) and measure it.

    The curve's S uses Delta_r of this reference (``replay.ripening``) over the deep loops 25..31 (scaled);
    the measured S is each text's ||delta|| of plane R over the same loops. The measurement is the arm of
    :func:`looped_kv.analysis.replay.deepest_plane_arm`, which the fit did not use. With ``grid``, the shallow
    region's plane-R arm gives each text's cost of substituting plane R in the shallow loops alone, and the deep
    region's in the deep loops alone: what every loop costs beyond both is the middle loops' share.
    """
    R, t = reference.num_loops, reference.first_decoded
    deep = list(deep_loop_range(R))
    delta = ripening(reference)
    n_core = reference.plane("k", R).shape[0]
    S_curve = deep_perturbation_size(n_core, delta["k"].cpu().numpy(), delta["v"].cpu().numpy(), deep)
    S_measured = perturbation_size(reference, R, deep).cpu().numpy()
    scale = math.exp(fit.a + fit.b)
    arm = deepest_plane_arm(model, reference)[:, t]
    measured = kl(reference.logits[:, t], arm).cpu().numpy()
    regions = {}
    for region in ("shallow", "deep") if grid is not None else ():
        rows = grid.rows[(grid.rows.region == region) & (grid.rows.plane == R)].sort_values("text")
        if len(rows) != len(measured):
            raise ValueError(f"grid must hold the {region} region's plane-{R} arm for every text of the reference")
        regions[region] = rows.kl.to_numpy()
    return Eq6Check(from_curve=scale * S_curve**fit.g, from_size=float(np.median(scale * S_measured**fit.g)),
                    S_curve=S_curve, S_measured=S_measured, measured=measured, shallow_only=regions.get("shallow"),
                    deep_only=regions.get("deep"))
