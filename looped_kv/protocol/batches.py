"""Pre-registered batches: spec, frozen file table, run, archive, verification and the prediction ledger.

The RIPE paper's evidence comes from nine pre-registered batches (Section 5, "Protocol";
Appendix A, Table 5): decision rules and predictions frozen before each run, a frozen file table
(SHA-256), self-tests on the node, and an archive verified at both ends, with every failed
prediction reported (Appendix B, Table 6). This module is that workflow:

1. A batch is a YAML spec (see ``looped_kv/batch_specs/*.yaml``): question, model, prompt sets, arms,
   metrics, decision rules and predictions. :func:`load_spec` validates all of it before any work.
2. :func:`freeze` writes a file table: the SHA-256 of the spec, its prompt files, the package's
   own source files and the local model files. :func:`run_batch` refuses to run when any of them
   has changed since.
3. :func:`run_batch` checks the table, runs the self-tests (:mod:`looped_kv.protocol.selftest`), runs every
   arm with progress bars in the spec's CPU thread count (sharded across processes under ``torchrun``,
   :mod:`looped_kv.protocol.distributed`), writes per-position and per-prompt records as JSON lines, a summary,
   the decision rules' labels and the predictions' outcomes, and a checksum manifest
   (``MANIFEST.sha256``, the format of ``sha256sum -c``).
4. :func:`verify` re-checks an archive: every checksum, the frozen table against the archived spec,
   and the summary and labels recomputed from the records. :func:`compare` says whether two archives
   of one frozen spec agree byte for byte, and by how much each metric differs where they do not.
   :func:`ledger` prints the predictions of several archives in the layout of Appendix B (batch,
   prediction, outcome: held or failed).

Two measurement modes exist. ``substitution``: teacher-forced replay of texts whose arms substitute
a reference plane into a region of loops (RIPE Sec. 3.1, batches 2 and 9). ``generation``: a greedy
reference trajectory per prompt, replayed token by token through each arm's cache policy and
precision (Sec. 5.1, batches 3, 7 and 8), and real decoders (Sec. 5.2).

Spec keys (unknown keys are errors)::

    batch, name, question             id shown in the ledger, short name, the question asked
    model, revision                   'tiny', a folder (relative to the spec) or a hub id with its revision
    dtype, num_loops, seed            weights dtype, R, bootstrap seed; cudnn_sdp: false (default) disables
                                      cuDNN attention (RIPE Sec. 5.5)
    threads                           torch CPU threads of every process (default 1): frozen with the spec, so
                                      that alone or under torchrun a run writes the same bytes
    mode                              substitution | generation
    prompts                           [{name, file}]: JSON lists of texts (or {"texts": [...]}) beside the spec
    substitution: tokens, decoded, softmax    texts cut to `tokens`; the last `decoded` are decoded positions
    generation: max_new_tokens, reference, tail_kl   reference = {cache, window, k, sinks, precision}
    arms       substitution: {name, region: shallow|deep|"lo-hi"|[loops], plane, kv: k|v|kv}
               generation: {name, decoder: replay|ar|self-spec|mature-spec|pld|das-wave, cache, window, k,
                            sinks, precision, and the decoder's options (draft_loops, block, prefix_reads, ...)}
    metrics                           prompt-level metrics summarised per arm (METRICS)
    decision_rules   {name, statistic, threshold, labels: {above, between, below}, n_boot, level, and
                      ratio: metric, numerator, denominator | mean: metric, arm |
                      fidelity: arm, precision_arm, bins | region_coefficient: arms, floor (KL at or below
                      the measurement floor is raised to it and kept in the fit, as RIPE Sec. 3.1 keeps floor rows)}
    predictions      {text, rule, label: a label of the rule (or a list)} or {text, rule, range: [low, high]}

A rule's outcome is "above" when its bootstrap interval lies above the threshold, "below" when it lies
below, and "between" otherwise; it is "undefined" when the data leave the statistic undefined (e.g. a
ratio whose denominator arm has no tail position). A prediction holds when the rule's label is one it
names, or its estimate lies in its range.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
import socket
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import yaml
from tqdm.auto import tqdm

import looped_kv
from looped_kv.analysis import fits
from looped_kv.analysis.measure import kl, policy_logits
from looped_kv.analysis.replay import paper_region, perturbation_size, replay, substitute
from looped_kv.book import DTYPES
from looped_kv.decoding.das_wave import check_wave
from looped_kv.decoding.generate import generate
from looped_kv.decoding.greedy import greedy
from looped_kv.decoding.loop import LogitsRecorder
from looped_kv.decoding.settings import METHODS
from looped_kv.decoding.speculative import check_speculation
from looped_kv.protocol import distributed
from looped_kv.protocol.reproducibility import bitwise_rerun
from looped_kv.protocol.selftest import require_selftests
from looped_kv.runtime.loading import TINY_DIR, load
from looped_kv.runtime.measurement import measurement_mode
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy, make_prefix_reads

EXAMPLES_DIR = Path(__file__).parents[1] / "batch_specs"
PACKAGE_DIR = Path(__file__).parents[1]
TABLE_FORMAT = "looped-kv file table 1"
MODEL_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")
MANIFEST = "MANIFEST.sha256"
REFERENCE = "reference"
#: Archive files that differ between runs of one frozen spec by design (the machine, the command, the clock),
#: and the fields that name a record rather than measure it.
RUN_FILES = ("run.json", "timings.jsonl")
RECORD_KEYS = ("prompt", "arm", "position")

MODES = ("substitution", "generation")
STATISTICS = ("ratio", "mean", "fidelity", "region_coefficient")
OUTCOMES = ("above", "between", "below")
DECODERS = ("replay", *METHODS)
KINDS = {"k": ("k",), "v": ("v",), "kv": ("k", "v")}
#: Prompt-level metrics and the arms that have them. Position-level records hold ``kl`` (KL(reference || arm)
#: in float64) and ``flip`` (top-1 token differs from the reference's) for substitution and replay arms.
METRICS = {
    "kl_first": "KL at the first decoded (substitution) or generated (replay) position",
    "kl_mean": "mean KL over the decoded or generated positions",
    "max_kl": "largest KL over those positions",
    "tail": "positions with KL above the spec's tail_kl (RIPE Sec. 5.1: 0.1)",
    "flips": "positions whose top-1 token differs from the reference's",
    "agree_first": "1 if the top-1 token at the first position equals the reference's (RIPE Table 3)",
    "size": "perturbation size ||delta|| of a substitution arm (RIPE Sec. 3.1)",
    "same_as_greedy": "1 if a decoder emits exactly greedy decoding's tokens under the same cache and precision",
    "tau": "tokens per verification",
    "A": "draft tokens accepted per verification",
    "verifications": "verification passes",
}
ARM_METRICS = {
    "substitution": ("kl_first", "kl_mean", "max_kl", "tail", "flips", "agree_first", "size"),
    "replay": ("kl_first", "kl_mean", "max_kl", "tail", "flips", "agree_first"),
    "decoder": ("same_as_greedy", "tau", "A", "verifications"),
}
METHOD_OPTIONS = {
    "ar": (),
    "self-spec": ("draft_loops", "block", "prefix_reads", "exact"),
    "mature-spec": ("draft_loops", "block", "exact"),
    "pld": ("block", "ngram", "exact"),
    "das-wave": ("block", "rounds", "initial_width", "updates", "carry", "prefix_reads", "exact"),
}
SPEC_KEYS = {"batch", "name", "question", "model", "revision", "dtype", "num_loops", "mode", "seed", "cudnn_sdp",
             "threads", "prompts", "tokens", "decoded", "softmax", "max_new_tokens", "reference", "tail_kl", "arms",
             "metrics", "decision_rules", "predictions"}


# -- the spec -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptSet:
    name: str
    file: str  # relative to the spec's folder
    texts: tuple[str, ...]


@dataclass(frozen=True)
class Arm:
    """One arm. ``kind`` is "substitution" (region, plane, kinds), "replay" (cache, precision) or "decoder"."""

    name: str
    kind: str
    precision: str = "float32"
    region_name: str = ""
    region: tuple[int, ...] = ()
    plane: int = 0
    kinds: tuple[str, ...] = ()
    cache: dict[str, Any] = field(default_factory=dict)  # make_policy / generate keywords: cache, window, k, sinks
    decoder: str = "replay"
    options: dict[str, Any] = field(default_factory=dict)  # generate keywords of the decoder


@dataclass(frozen=True)
class Rule:
    """A decision rule: a statistic with a bootstrap interval, a threshold and the label each outcome gets."""

    name: str
    statistic: str
    threshold: float
    labels: dict[str, str]  # outcome ("above", "between", "below") -> label
    n_boot: int = 2000
    level: float = 0.95
    metric: str = ""
    numerator: tuple[str, ...] = ()
    denominator: tuple[str, ...] = ()
    arm: str = ""
    precision_arm: str = ""
    bins: tuple[int, ...] = ()
    arms: tuple[str, ...] = ()
    floor: float | None = None


@dataclass(frozen=True)
class Prediction:
    """A pre-registered prediction: a rule's label (one of ``labels``) or its estimate inside ``range``."""

    text: str
    rule: str
    labels: tuple[str, ...] = ()
    range: tuple[float, float] | None = None


@dataclass(frozen=True)
class BatchSpec:
    path: Path
    batch: str
    name: str
    question: str
    model: str
    revision: str | None
    dtype: str
    num_loops: int
    mode: str
    seed: int
    cudnn_sdp: bool
    prompt_sets: tuple[PromptSet, ...]
    arms: tuple[Arm, ...]
    metrics: tuple[str, ...]
    rules: tuple[Rule, ...]
    predictions: tuple[Prediction, ...]
    tokens: int = 0  # substitution: texts are cut to this many tokens
    decoded: int = 0  # substitution: the last ``decoded`` positions are decoded tokens
    softmax: str = "float32"  # substitution: softmax dtype of the replay
    max_new_tokens: int = 0  # generation
    reference: dict[str, Any] = field(default_factory=dict)  # generation: cache keywords and "precision"
    tail_kl: float = 0.1
    threads: int = 1  # torch CPU threads of every process (RIPE Sec. 5.5: reruns must be bitwise identical)

    @property
    def precisions(self) -> tuple[str, ...]:
        """Model precisions the batch loads, the spec's dtype first."""
        wanted = [self.dtype, self.reference.get("precision", self.dtype), *(a.precision for a in self.arms)]
        return tuple(dict.fromkeys(wanted))

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)


_MISSING = object()


def _get(raw: dict, key: str, where: str, types: type | tuple[type, ...], default: Any = _MISSING,
         allowed: Sequence | None = None) -> Any:
    """raw[key] checked against ``types`` and ``allowed``; ValueError naming ``where.key`` otherwise."""
    if key not in raw or raw[key] is None:
        if default is _MISSING:
            raise ValueError(f"{where}.{key} is required")
        return default
    value = raw[key]
    if types in (int, float) or types == (int, float):
        value = _number(value, f"{where}.{key}", integer=types is int)
    elif not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise ValueError(f"{where}.{key} must be a {names}, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{where}.{key} must be one of {tuple(allowed)}, got {value!r}")
    return value


def _number(value: Any, name: str, integer: bool = False) -> int | float:
    """An int or float; strings such as "1e-6" are accepted because YAML 1.1 reads them as strings."""
    if isinstance(value, str) and not integer:
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    return value


def _names(value: Any, name: str) -> tuple[str, ...]:
    """An arm name or a list of them."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise ValueError(f"{name} must be an arm name or a non-empty list of arm names, got {value!r}")
    return tuple(items)


def _unknown(raw: dict, allowed: Iterable[str], where: str) -> None:
    extra = sorted(set(raw) - set(allowed))
    if extra:
        raise ValueError(f"{where} has unknown keys {extra}; allowed: {sorted(allowed)}")


def resolve_spec(spec: str | Path) -> Path:
    """A spec file, or the name of a shipped example (``regions``, ``windows``)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.resolve()
    example = EXAMPLES_DIR / f"{spec}.yaml"
    if example.is_file():
        return example
    raise FileNotFoundError(f"no spec file {str(spec)!r}; shipped examples: {example_names()}")


def example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml"))


def _region(value: Any, num_loops: int, where: str) -> tuple[str, tuple[int, ...]]:
    """"shallow" / "deep" (RIPE Sec. 3.1, scaled to R), "lo-hi", or a list of loops."""
    if value in ("shallow", "deep"):
        return value, paper_region(value, num_loops)
    if isinstance(value, str) and value.count("-") == 1 and all(p.strip().isdigit() for p in value.split("-")):
        lo, hi = (int(p) for p in value.split("-"))
        loops = tuple(range(lo, hi + 1))
    elif isinstance(value, list) and value and all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        loops = tuple(sorted(set(value)))
    else:
        raise ValueError(f"{where}.region must be 'shallow', 'deep', 'lo-hi' or a list of loops, got {value!r}")
    if not loops or any(not 1 <= r <= num_loops for r in loops):
        raise ValueError(f"{where}.region must name loops in 1..{num_loops}, got {value!r}")
    return str(value), loops


def _cache_keywords(raw: dict, where: str, num_loops: int) -> dict[str, Any]:
    keywords = {"cache": _get(raw, "cache", where, str, "full")}
    for key in ("window", "k", "sinks"):
        if raw.get(key) is not None:
            keywords[key] = _get(raw, key, where, int)
    try:
        make_policy(keywords["cache"], num_loops, **{k: v for k, v in keywords.items() if k != "cache"})
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return keywords


def _arm(raw: Any, i: int, mode: str, num_loops: int, dtype: str) -> Arm:
    where = f"arms[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    name = _get(raw, "name", where, str)
    if name == REFERENCE:
        raise ValueError(f"{where}.name must not be {REFERENCE!r} (reserved for the reference records)")
    where = f"arms[{i}] ({name})"
    if mode == "substitution":
        _unknown(raw, ("name", "region", "plane", "kv"), where)
        region_name, region = _region(raw.get("region"), num_loops, where)
        plane = _get(raw, "plane", where, int)
        if not 1 <= plane <= num_loops:
            raise ValueError(f"{where}.plane must be in 1..{num_loops}, got {plane}")
        kv = _get(raw, "kv", where, str, "kv", allowed=tuple(KINDS))
        return Arm(name, "substitution", dtype, region_name, region, plane, KINDS[kv])
    decoder = _get(raw, "decoder", where, str, "replay", allowed=DECODERS)
    options = METHOD_OPTIONS.get(decoder, ())
    _unknown(raw, ("name", "decoder", "cache", "window", "k", "sinks", "precision", *options), where)
    precision = _get(raw, "precision", where, str, dtype, allowed=tuple(DTYPES))
    cache = _cache_keywords(raw, where, num_loops)
    if decoder == "replay":
        return Arm(name, "replay", precision, cache=cache)
    chosen = {key: raw[key] for key in options if raw.get(key) is not None}
    for key in ("draft_loops", "block", "ngram", "rounds", "initial_width", "updates"):
        if key in chosen:
            _get(chosen, key, where, int)
    for key in ("exact", "carry"):
        if key in chosen:
            _get(chosen, key, where, bool)
    policy = make_policy(cache["cache"], num_loops, **{k: v for k, v in cache.items() if k != "cache"})
    try:
        if "prefix_reads" in chosen:
            reads = chosen["prefix_reads"]
            chosen["prefix_reads"] = tuple(reads) if isinstance(reads, list) else reads
            make_prefix_reads(chosen["prefix_reads"], num_loops)
        if decoder != "ar":
            block = chosen.get("block", 32 if decoder == "das-wave" else 4)
            draft = chosen.get("draft_loops", 4) if decoder in ("self-spec", "mature-spec") else None
            check_speculation(policy, block, chosen.get("exact", True), draft)
        if decoder == "das-wave":
            check_wave(chosen.get("block", 32), chosen.get("rounds", 24), chosen.get("initial_width", 2),
                       chosen.get("updates", 2))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return Arm(name, "decoder", precision, cache=cache, decoder=decoder, options=chosen)


def _rule(raw: Any, i: int, spec_arms: dict[str, Arm], mode: str, max_new_tokens: int) -> Rule:
    where = f"decision_rules[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    name = _get(raw, "name", where, str)
    where = f"decision_rules[{i}] ({name})"
    statistic = _get(raw, "statistic", where, str, allowed=STATISTICS)
    specific = {"ratio": ("metric", "numerator", "denominator"), "mean": ("metric", "arm"),
                "fidelity": ("arm", "precision_arm", "bins"), "region_coefficient": ("arms", "floor")}[statistic]
    _unknown(raw, ("name", "statistic", "threshold", "labels", "n_boot", "level", *specific), where)
    labels = _get(raw, "labels", where, dict)
    if set(labels) != set(OUTCOMES) or not all(isinstance(v, str) and v for v in labels.values()):
        raise ValueError(f"{where}.labels must map each of {OUTCOMES} to a label, got {labels!r}")
    threshold = float(_get(raw, "threshold", where, (int, float)))
    n_boot = _get(raw, "n_boot", where, int, 2000)
    level = float(_get(raw, "level", where, (int, float), 0.95))
    if n_boot < 100 or not 0 < level < 1:
        raise ValueError(f"{where}: n_boot must be >= 100 and level in (0, 1), got {n_boot} and {level}")

    def arms_of(names: tuple[str, ...], kinds: tuple[str, ...], key: str) -> tuple[str, ...]:
        for arm in names:
            if arm not in spec_arms:
                raise ValueError(f"{where}.{key} names unknown arm {arm!r}; arms: {list(spec_arms)}")
            if spec_arms[arm].kind not in kinds:
                raise ValueError(f"{where}.{key}: arm {arm!r} is a {spec_arms[arm].kind} arm; need {kinds}")
        return names

    def metric_for(names: tuple[str, ...]) -> str:
        metric = _get(raw, "metric", where, str, allowed=tuple(METRICS))
        for arm in names:
            if metric not in ARM_METRICS[spec_arms[arm].kind]:
                raise ValueError(f"{where}.metric {metric!r} is not measured for arm {arm!r}; its metrics: "
                                 f"{ARM_METRICS[spec_arms[arm].kind]}")
        return metric

    rule = Rule(name, statistic, threshold, dict(labels), n_boot, level)
    if statistic == "ratio":
        numerator = arms_of(_names(raw.get("numerator"), f"{where}.numerator"), tuple(ARM_METRICS), "numerator")
        denominator = arms_of(_names(raw.get("denominator"), f"{where}.denominator"), tuple(ARM_METRICS),
                              "denominator")
        return replace(rule, metric=metric_for(numerator + denominator), numerator=numerator,
                       denominator=denominator)
    if statistic == "mean":
        arm = arms_of((_get(raw, "arm", where, str),), tuple(ARM_METRICS), "arm")
        return replace(rule, metric=metric_for(arm), arm=arm[0])
    if statistic == "fidelity":
        if mode != "generation":
            raise ValueError(f"{where}: statistic 'fidelity' needs mode 'generation' (RIPE Sec. 5.1)")
        arm = arms_of((_get(raw, "arm", where, str),), ("replay",), "arm")[0]
        precision_arm = arms_of((_get(raw, "precision_arm", where, str),), ("replay",), "precision_arm")[0]
        bins = _get(raw, "bins", where, list)
        if (len(bins) < 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in bins)
                or bins[0] != 0 or bins[-1] != max_new_tokens or any(b >= c for b, c in itertools.pairwise(bins))):
            raise ValueError(f"{where}.bins must be increasing integers from 0 to max_new_tokens = {max_new_tokens}, "
                             f"got {bins!r}")
        return replace(rule, arm=arm, precision_arm=precision_arm, bins=tuple(bins))
    if mode != "substitution":
        raise ValueError(f"{where}: statistic 'region_coefficient' needs mode 'substitution' (RIPE Sec. 3.1)")
    regional = tuple(a.name for a in spec_arms.values() if a.region_name in ("shallow", "deep"))
    arms = arms_of(_names(raw["arms"], f"{where}.arms"), ("substitution",), "arms") if "arms" in raw else regional
    regions = {spec_arms[a].region_name for a in arms}
    if regions != {"shallow", "deep"}:
        raise ValueError(f"{where}.arms must include arms of region 'shallow' and of region 'deep' and no other "
                         f"region, got regions {sorted(regions)}")
    floor = raw.get("floor")
    return replace(rule, arms=arms, floor=None if floor is None else float(_number(floor, f"{where}.floor")))


def _prediction(raw: Any, i: int, rules: dict[str, Rule]) -> Prediction:
    where = f"predictions[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    _unknown(raw, ("text", "rule", "label", "range"), where)
    text = _get(raw, "text", where, str)
    rule = _get(raw, "rule", where, str, allowed=tuple(rules))
    if ("label" in raw) == ("range" in raw):
        raise ValueError(f"{where} ({text}) needs exactly one of 'label' (the rule's expected label) or 'range'")
    if "label" in raw:
        labels = _names(raw["label"], f"{where}.label")
        for label in labels:
            if label not in rules[rule].labels.values():
                raise ValueError(f"{where}.label {label!r} is not a label of rule {rule!r}; its labels: "
                                 f"{sorted(set(rules[rule].labels.values()))}")
        return Prediction(text, rule, labels=labels)
    bounds = raw["range"]
    if not isinstance(bounds, list) or len(bounds) != 2:
        raise ValueError(f"{where}.range must be [low, high], got {bounds!r}")
    low, high = (float(_number(b, f"{where}.range")) for b in bounds)
    if not low <= high:
        raise ValueError(f"{where}.range must have low <= high, got {bounds!r}")
    return Prediction(text, rule, range=(low, high))


def _prompt_set(raw: Any, i: int, folder: Path) -> PromptSet:
    where = f"prompts[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping with 'name' and 'file', got {raw!r}")
    _unknown(raw, ("name", "file"), where)
    name, file = _get(raw, "name", where, str), _get(raw, "file", where, str)
    path = (folder / file).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise ValueError(f"{where}.file must lie in the spec's folder (so that archives are self-contained), "
                         f"got {file!r}")
    if not path.is_file():
        raise FileNotFoundError(f"{where}.file {file!r} not found in {folder}")
    content = json.loads(path.read_text(encoding="utf-8"))
    texts = content.get("texts") if isinstance(content, dict) else content
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{where}.file {file!r} must hold a non-empty JSON list of strings, or an object whose "
                         f"'texts' is one")
    return PromptSet(name, path.relative_to(folder.resolve()).as_posix(), tuple(texts))


def load_spec(spec: str | Path) -> BatchSpec:
    """Read and validate a batch spec (a path or a shipped example's name); ValueError on any bad field."""
    path = resolve_spec(spec)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"spec {path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"spec {path} must be a YAML mapping")
    _unknown(raw, SPEC_KEYS, "spec")
    where = "spec"
    mode = _get(raw, "mode", where, str, allowed=MODES)
    num_loops = _get(raw, "num_loops", where, int)
    if num_loops < 2:
        raise ValueError(f"spec.num_loops must be >= 2, got {num_loops}")
    dtype = _get(raw, "dtype", where, str, "float32", allowed=tuple(DTYPES))
    threads = _get(raw, "threads", where, int, 1)
    if threads < 1:
        raise ValueError(f"spec.threads must be >= 1, got {threads}")
    common = dict(
        path=path, batch=str(_get(raw, "batch", where, (int, str))), name=_get(raw, "name", where, str),
        question=_get(raw, "question", where, str), model=_get(raw, "model", where, str),
        revision=_get(raw, "revision", where, str, None), dtype=dtype, num_loops=num_loops, mode=mode,
        seed=_get(raw, "seed", where, int, 0), cudnn_sdp=_get(raw, "cudnn_sdp", where, bool, False),
        tail_kl=float(_get(raw, "tail_kl", where, (int, float), 0.1)), threads=threads)
    prompt_sets = _get(raw, "prompts", where, list)
    sets = tuple(_prompt_set(p, i, path.parent) for i, p in enumerate(prompt_sets))
    if len({s.name for s in sets}) != len(sets) or not sets:
        raise ValueError("spec.prompts must name one or more prompt sets with distinct names")
    if mode == "substitution":
        extra = dict(tokens=_get(raw, "tokens", where, int), decoded=_get(raw, "decoded", where, int),
                     softmax=_get(raw, "softmax", where, str, "float32", allowed=("float32", "float64")))
        if not 1 <= extra["decoded"] < extra["tokens"]:
            raise ValueError(f"spec.decoded must be in 1..tokens - 1 = {extra['tokens'] - 1}, got {extra['decoded']}")
        for key in ("max_new_tokens", "reference"):
            if key in raw:
                raise ValueError(f"spec.{key} is a generation-mode key; mode is 'substitution'")
    else:
        reference = _get(raw, "reference", where, dict, {})
        _unknown(reference, ("cache", "window", "k", "sinks", "precision"), "spec.reference")
        extra = dict(max_new_tokens=_get(raw, "max_new_tokens", where, int),
                     reference={**_cache_keywords(reference, "spec.reference", num_loops),
                                "precision": _get(reference, "precision", "spec.reference", str, dtype,
                                                  allowed=tuple(DTYPES))})
        if extra["max_new_tokens"] < 2:
            raise ValueError(f"spec.max_new_tokens must be >= 2, got {extra['max_new_tokens']}")
        for key in ("tokens", "decoded", "softmax"):
            if key in raw:
                raise ValueError(f"spec.{key} is a substitution-mode key; mode is 'generation'")
    arms = tuple(_arm(a, i, mode, num_loops, dtype) for i, a in enumerate(_get(raw, "arms", where, list)))
    if not arms or len({a.name for a in arms}) != len(arms):
        raise ValueError("spec.arms must hold one or more arms with distinct names")
    by_name = {a.name: a for a in arms}
    metrics = tuple(_get(raw, "metrics", where, list))
    available = {m for a in arms for m in ARM_METRICS[a.kind]}
    for metric in metrics:
        if metric not in available:
            raise ValueError(f"spec.metrics: {metric!r} is not measured by any arm of this batch; "
                             f"available: {sorted(available)}")
    raw_rules = _get(raw, "decision_rules", where, list)
    rules = tuple(_rule(r, i, by_name, mode, extra.get("max_new_tokens", 0)) for i, r in enumerate(raw_rules))
    if not rules or len({r.name for r in rules}) != len(rules):
        raise ValueError("spec.decision_rules must hold one or more rules with distinct names")
    rules_by_name = {r.name: r for r in rules}
    predictions = tuple(_prediction(p, i, rules_by_name) for i, p in enumerate(_get(raw, "predictions", where, list)))
    if not predictions:
        raise ValueError("spec.predictions must hold at least one prediction")
    return BatchSpec(**common, prompt_sets=sets, arms=arms, metrics=metrics, rules=rules, predictions=predictions,
                     **extra)


# -- the frozen file table ------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_folder(spec: BatchSpec) -> Path | None:
    """The local folder of the spec's model, or None for a hub id (which must then pin a ``revision``)."""
    if spec.model == "tiny":
        return TINY_DIR
    path = Path(spec.model).expanduser()
    path = path if path.is_absolute() else spec.path.parent / path
    if path.is_dir():
        return path.resolve()
    if spec.revision is None:
        raise ValueError(f"spec.model {spec.model!r} is not a local folder; a hub id needs spec.revision (the "
                         f"commit to download; RIPE Sec. 5 pins the HF revision of each checkpoint)")
    return None


def _package_files() -> dict[str, Path]:
    """The package's own source files, keyed "package/looped_kv/..."."""
    return {f"package/{p.relative_to(PACKAGE_DIR.parent).as_posix()}": p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def file_table(spec: BatchSpec) -> dict[str, str]:
    """SHA-256 of the spec, its prompt files, the package's source files and the local model files."""
    folder = spec.path.parent
    files = {f"spec/{spec.path.name}": spec.path, **{f"spec/{s.file}": folder / s.file for s in spec.prompt_sets}}
    files.update(_package_files())
    weights = model_folder(spec)
    if weights is not None:
        found = sorted({p for pattern in MODEL_PATTERNS for p in weights.glob(pattern) if p.is_file()})
        if not any(p.name == "config.json" for p in found):
            raise FileNotFoundError(f"model folder {weights} has no config.json (is the model there?)")
        files.update({f"model/{p.name}": p for p in found})
    return {key: sha256(path) for key, path in sorted(files.items())}


def freeze(spec: str | Path, out: str | Path | None = None, *, force: bool = False) -> Path:
    """Validate a spec and write its file table (default ``<spec name>.frozen.json`` in the working directory)."""
    parsed = load_spec(spec)
    target = Path(out) if out is not None else Path(f"{parsed.path.stem}.frozen.json")
    if target.exists() and not force:
        raise ValueError(f"{target} exists; re-freezing changes the pre-registration, pass force to overwrite")
    table = {"format": TABLE_FORMAT, "spec": str(parsed.path), "spec_file": parsed.path.name,
             "batch": parsed.batch, "model": parsed.model, "revision": parsed.revision,
             "frozen_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": file_table(parsed)}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(table, indent=1) + "\n")
    return target


def read_table(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file table {path} (write one with `looped-kv batch freeze SPEC`)")
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError:
        table = None
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path} is not a looped-kv file table (written by `looped-kv batch freeze`)")
    return table


def table_changes(frozen: dict[str, str], current: dict[str, str]) -> list[str]:
    """Differences between two file tables, as "changed: ...", "missing: ...", "added: ..." lines."""
    changed = sorted(k for k in frozen.keys() & current.keys() if frozen[k] != current[k])
    missing, added = sorted(frozen.keys() - current.keys()), sorted(current.keys() - frozen.keys())
    return [f"{what}: {', '.join(keys)}" for what, keys in (("changed", changed), ("missing", missing),
                                                             ("added", added)) if keys]


def check_table(table_path: str | Path) -> tuple[BatchSpec, dict[str, Any]]:
    """The frozen spec and its table, or ValueError listing every file that changed since ``freeze``."""
    table = read_table(table_path)
    spec = load_spec(table["spec"])
    changes = table_changes(table["files"], file_table(spec))
    if changes:
        raise ValueError(f"file table {table_path} no longer matches ({'; '.join(changes)}); the spec, its prompts, "
                         f"the package or the model changed since it was frozen")
    return spec, table


# -- running the arms -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One prompt (or text) of the batch: its global index, its set and its text."""

    index: int
    set: str
    text: str


def units(spec: BatchSpec) -> list[Unit]:
    out = []
    for prompt_set in spec.prompt_sets:
        out += [Unit(len(out) + i, prompt_set.name, text) for i, text in enumerate(prompt_set.texts)]
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _encode(model: LoopedLM, text: str) -> torch.Tensor:
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(f"model {getattr(model, 'source', '')!r} has no tokenizer; batches need one for their texts")
    return model.tokenizer(text, return_tensors="pt").input_ids.to(model.device)


def _kl_records(unit: Unit, arm: str, reference: torch.Tensor, logits: torch.Tensor) -> list[dict]:
    divergence = kl(reference, logits).tolist()
    flips = (reference.argmax(-1) != logits.argmax(-1)).tolist()
    return [{"prompt": unit.index, "arm": arm, "position": t, "kl": d, "flip": f}
            for t, (d, f) in enumerate(zip(divergence, flips, strict=True))]


@torch.no_grad()
def _substitution_unit(spec: BatchSpec, model: LoopedLM, unit: Unit, progress: bool) -> tuple[list, list, list]:
    """Reference replay of one text and every substitution arm (RIPE Sec. 3.1)."""
    ids = _encode(model, unit.text)[:, :spec.tokens]
    if ids.shape[1] <= spec.decoded:
        raise ValueError(f"text {unit.index} ({unit.set}) has {ids.shape[1]} tokens; decoded = {spec.decoded} needs "
                         f"more")
    loops = sorted({r for arm in spec.arms for r in (*arm.region, arm.plane)})
    ref = replay(model, ids, spec.num_loops, softmax_dtype=DTYPES[spec.softmax], loops=loops, decoded=spec.decoded)
    first = ref.first_decoded
    positions, prompts = [], [{"prompt": unit.index, "set": unit.set, "arm": REFERENCE, "tokens": ids.shape[1]}]
    for arm in tqdm(spec.arms, desc="arms", leave=False, disable=not progress):
        logits = substitute(model, ref, arm.plane, arm.region, kinds=arm.kinds)
        positions += _kl_records(unit, arm.name, ref.logits[0, first:], logits[0, first:])
        size = float(perturbation_size(ref, arm.plane, arm.region, kinds=arm.kinds)[0])
        prompts.append({"prompt": unit.index, "set": unit.set, "arm": arm.name, "size": size})
    return positions, prompts, []


def _greedy_logits(model: LoopedLM, ids: torch.Tensor, max_new_tokens: int,
                   policy: CachePolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding under ``policy``, keeping the logits of every generated position: the trajectory and the
    reference logits that :func:`~looped_kv.analysis.measure.policy_logits` would recompute from it, in one pass."""
    recorder = LogitsRecorder()
    out = greedy(model, ids, max_new_tokens, policy=policy, observer=recorder)
    return out.tokens, recorder.logits(0).double()


@torch.no_grad()
def _generation_unit(spec: BatchSpec, models: dict[str, LoopedLM], unit: Unit,
                     progress: bool) -> tuple[list, list, list]:
    """A greedy reference trajectory, its sequential replay through every arm, and every decoder (RIPE Sec. 5)."""
    reference = dict(spec.reference)
    ref_model = models[reference.pop("precision")]
    ref_policy = make_policy(reference.pop("cache"), spec.num_loops, **reference)
    ids = _encode(ref_model, unit.text)
    trajectory, ref_logits = _greedy_logits(ref_model, ids, spec.max_new_tokens, ref_policy)
    n = ids.shape[1]
    positions, timings = [], []
    prompts = [{"prompt": unit.index, "set": unit.set, "arm": REFERENCE, "tokens": n,
                "new_tokens": trajectory[0, n:].tolist()}]
    for arm in tqdm(spec.arms, desc="arms", leave=False, disable=not progress):
        model, cache = models[arm.precision], dict(arm.cache)
        if arm.kind == "replay":
            policy = make_policy(cache.pop("cache"), spec.num_loops, **cache)
            positions += _kl_records(unit, arm.name, ref_logits, policy_logits(model, trajectory, n, policy))
            prompts.append({"prompt": unit.index, "set": unit.set, "arm": arm.name})
            continue
        kwargs = dict(max_new_tokens=spec.max_new_tokens, num_loops=spec.num_loops, **cache)
        out = generate(model, ids, method=arm.decoder, **kwargs, **arm.options)
        base = generate(model, ids, method="ar", **kwargs)
        prompts.append({"prompt": unit.index, "set": unit.set, "arm": arm.name,
                        "same_as_greedy": bool(torch.equal(out.tokens, base.tokens)), "tau": _finite(out.tau),
                        "A": _finite(out.mean_accepted), "verifications": out.verifications,
                        "accepted": list(out.accepted), "new_tokens": out.new_tokens[0].tolist()})
        timings.append({"prompt": unit.index, "arm": arm.name, "time_s": out.wall_time,
                        "greedy_time_s": base.wall_time, "new_tokens": out.num_new})
    return positions, prompts, timings


def run_arms(spec: BatchSpec, models: dict[str, LoopedLM], shard: Sequence[Unit],
             progress: bool = True) -> tuple[list, list, list]:
    """Position records, prompt records and timings of every arm on the given prompts."""
    records: tuple[list, list, list] = ([], [], [])
    for unit in tqdm(shard, desc=f"batch {spec.batch} ({spec.name}): prompts", disable=not progress):
        if spec.mode == "substitution":
            part = _substitution_unit(spec, models[spec.dtype], unit, progress)
        else:
            part = _generation_unit(spec, models, unit, progress)
        for kept, new in zip(records, part, strict=True):
            kept.extend(new)
    return records


def _order(spec: BatchSpec, records: Iterable[dict]) -> list[dict]:
    """Records sorted by prompt, then arm in spec order (reference first), then position: independent of sharding."""
    rank = {REFERENCE: -1, **{a.name: i for i, a in enumerate(spec.arms)}}
    return sorted(records, key=lambda r: (r["prompt"], rank[r["arm"]], r.get("position", 0)))


# -- summary, decision rules and labels -----------------------------------------------------------------------------


def prompt_table(spec: BatchSpec, positions: list[dict], prompts: list[dict]) -> pd.DataFrame:
    """One row per (prompt, arm) with every prompt-level metric the arm has (NaN elsewhere)."""
    rows = pd.DataFrame([r for r in prompts if r["arm"] != REFERENCE]).set_index(["prompt", "arm"])
    table = pd.DataFrame(index=rows.index, columns=list(METRICS), dtype=float)
    for column in ("size", "same_as_greedy", "tau", "A", "verifications"):
        if column in rows:
            table[column] = rows[column].astype(float)
    if positions:
        pos = pd.DataFrame(positions)
        groups = pos.groupby(["prompt", "arm"])
        first = pos[pos["position"] == 0].set_index(["prompt", "arm"])
        derived = pd.DataFrame({"kl_first": first["kl"], "kl_mean": groups["kl"].mean(), "max_kl": groups["kl"].max(),
                                "tail": groups["kl"].agg(lambda k: float((k > spec.tail_kl).sum())),
                                "flips": groups["flip"].sum().astype(float),
                                "agree_first": 1.0 - first["flip"].astype(float)})
        table.update(derived)
    return table.sort_index()


def _float(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def summarize(spec: BatchSpec, positions: list[dict], prompts: list[dict]) -> dict[str, Any]:
    """Per arm: prompts, positions and the mean over prompts of each of the spec's metrics the arm has."""
    table = prompt_table(spec, positions, prompts)
    counts = pd.Series([r["arm"] for r in positions], dtype=object).value_counts()
    arms = {}
    for arm in spec.arms:
        values = table.xs(arm.name, level="arm")
        arms[arm.name] = {"prompts": len(values), "positions": int(counts.get(arm.name, 0)),
                          **{m: _float(values[m].mean()) for m in spec.metrics if m in ARM_METRICS[arm.kind]}}
    return {"batch": spec.batch, "name": spec.name, "question": spec.question, "model": spec.model,
            "prompts": int(table.index.get_level_values("prompt").nunique()), "arms": arms}


def outcome(low: float, high: float, threshold: float) -> str:
    """"above" when the interval lies above the threshold, "below" when below, else "between"."""
    return "above" if low > threshold else "below" if high < threshold else "between"


def _per_prompt(table: pd.DataFrame, arms: Sequence[str], metric: str) -> pd.Series:
    """Per prompt, the metric averaged over ``arms``."""
    chosen = table[table.index.get_level_values("arm").isin(arms)]
    return chosen[metric].groupby(level="prompt").mean()


def _bootstrap_mean(x: np.ndarray, n_boot: int, seed: int, level: float) -> tuple[float, float, float]:
    if x.size < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 prompts, got {x.size}")
    means = x[np.random.default_rng(seed).integers(0, x.size, (n_boot, x.size))].mean(axis=1)
    low, high = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(x.mean()), float(low), float(high)


def _statistic(rule: Rule, spec: BatchSpec, table: pd.DataFrame, positions: pd.DataFrame) -> tuple[float, float,
                                                                                                      float, str]:
    """(estimate, low, high, detail) of a rule; ValueError when the data leave it undefined."""
    if rule.statistic == "ratio":
        pair = pd.concat([_per_prompt(table, rule.denominator, rule.metric),
                          _per_prompt(table, rule.numerator, rule.metric)], axis=1).dropna()
        if not pair.iloc[:, 0].any():
            raise ValueError(f"{rule.metric} of {'+'.join(rule.denominator)} (the denominator) is 0 on every prompt")
        ci = fits.paired_bootstrap_ratio(pair.iloc[:, 0], pair.iloc[:, 1], n_boot=rule.n_boot, seed=spec.seed,
                                         level=rule.level)
        return ci.estimate, ci.low, ci.high, f"mean {rule.metric} {'+'.join(rule.numerator)} / " \
                                             f"{'+'.join(rule.denominator)} over {len(pair)} prompts"
    if rule.statistic == "mean":
        x = _per_prompt(table, (rule.arm,), rule.metric).dropna().to_numpy()
        estimate, low, high = _bootstrap_mean(x, rule.n_boot, spec.seed, rule.level)
        return estimate, low, high, f"mean {rule.metric} of {rule.arm} over {x.size} prompts"
    if rule.statistic == "fidelity":
        edges = np.asarray(rule.bins, dtype=float)
        matrices = []
        for arm in (rule.arm, rule.precision_arm):
            rows = positions[positions["arm"] == arm]
            matrices.append(fits.per_prompt_bin_means(rows["kl"], rows["prompt"], rows["position"], edges)[1])
        result = fits.fidelity_label(matrices[0], matrices[1], threshold=rule.threshold, n_boot=rule.n_boot,
                                     seed=spec.seed, level=rule.level)
        worst = int(np.argmax(result.low))
        return (float(result.ratio[worst]), float(result.low[worst]), float(result.high[worst]),
                f"KL({REFERENCE} || {rule.arm}) / KL({REFERENCE} || {rule.precision_arm}) in positions "
                f"{rule.bins[worst]}-{rule.bins[worst + 1] - 1}, the bin with the highest lower bound; bin ratios "
                + ", ".join(f"{r:.3g}" for r in result.ratio))
    floor = -math.inf if rule.floor is None else rule.floor  # KL at the resolution is raised to it and kept
    rows = [{"kl": max(kl_first, floor), "size": size, "deep": spec.arm(arm).region_name == "deep", "text": prompt}
            for (prompt, arm), kl_first, size in zip(table.index, table["kl_first"], table["size"], strict=True)
            if arm in rule.arms]
    fit = fits.sensitivity_regression(rows, floor=rule.floor, n_boot=rule.n_boot, seed=spec.seed, level=rule.level)
    return (fit.exp_b, *fit.ci_exp_b, f"e^b of log KL = a + b [deep] + g log ||delta||: b = {fit.b:.3g}, "
                                      f"g = {fit.g:.3g}, {fit.n_rows} rows, {fit.n_at_floor} at the floor")


def decide(spec: BatchSpec, positions: list[dict], prompts: list[dict]) -> dict[str, Any]:
    """Apply every decision rule and score every prediction (RIPE Appendix B: held or failed)."""
    table = prompt_table(spec, positions, prompts)
    frame = pd.DataFrame(positions, columns=["prompt", "arm", "position", "kl", "flip"])
    rules = {}
    for rule in spec.rules:
        try:
            estimate, low, high, detail = _statistic(rule, spec, table, frame)
            result = outcome(low, high, rule.threshold)
            rules[rule.name] = {"statistic": rule.statistic, "estimate": estimate, "low": low, "high": high,
                                "level": rule.level, "threshold": rule.threshold, "outcome": result,
                                "label": rule.labels[result], "detail": detail}
        except ValueError as error:  # the data leave the statistic undefined (e.g. no tail positions at all)
            rules[rule.name] = {"statistic": rule.statistic, "estimate": None, "low": None, "high": None,
                                "level": rule.level, "threshold": rule.threshold, "outcome": "undefined",
                                "label": "undefined", "detail": str(error)}
    predictions = []
    for p in spec.predictions:
        r = rules[p.rule]
        defined = r["outcome"] != "undefined"
        held = defined and (r["label"] in p.labels if p.labels else p.range[0] <= r["estimate"] <= p.range[1])
        observed = f"{r['label']}, {r['estimate']:.3g} [{r['low']:.3g}, {r['high']:.3g}]" if defined else \
            f"undefined: {r['detail']}"
        expected = " or ".join(p.labels) if p.labels else f"estimate in [{p.range[0]:g}, {p.range[1]:g}]"
        predictions.append({"prediction": p.text, "rule": p.rule, "expected": expected,
                            "outcome": "held" if held else "failed", "observed": observed})
    return {"batch": spec.batch, "name": spec.name, "question": spec.question, "rules": rules,
            "predictions": predictions}


# -- archives -------------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, records: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record, allow_nan=False) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")


def _archive_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    """``MANIFEST.sha256``: one "<sha256>  <path>" line per file (``sha256sum -c MANIFEST.sha256`` checks it)."""
    lines = [f"{sha256(root / name)}  {name}" for name in _archive_files(root)]
    (root / MANIFEST).write_text("\n".join(lines) + "\n")


def _analyse(spec: BatchSpec, root: Path) -> tuple[dict, dict]:
    """Summary and decisions computed from an archive's records, as read back from its files."""
    positions, prompts = _read_jsonl(root / "records/positions.jsonl"), _read_jsonl(root / "records/prompts.jsonl")
    return summarize(spec, positions, prompts), decide(spec, positions, prompts)


def write_archive(out: Path, spec: BatchSpec, table_path: Path, records: tuple[list, list, list],
                  run: dict[str, Any]) -> dict[str, Any]:
    """Write the archive folder; returns its decisions."""
    out.mkdir(parents=True, exist_ok=True)
    table = read_table(table_path)
    for key in table["files"]:
        if key.startswith("spec/"):
            target = out / key
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(spec.path.parent / key.removeprefix("spec/"), target)
    shutil.copyfile(table_path, out / "frozen.json")
    positions, prompts, timings = records
    _write_jsonl(out / "records/positions.jsonl", _order(spec, positions))
    _write_jsonl(out / "records/prompts.jsonl", _order(spec, prompts))
    _write_jsonl(out / "timings.jsonl", _order(spec, timings))
    summary, decisions = _analyse(spec, out)
    _write_json(out / "summary.json", {**summary, "measurement": run["measurement"]})
    _write_json(out / "decisions.json", decisions)
    _write_json(out / "run.json", run)
    write_manifest(out)
    return decisions


def _model_source(spec: BatchSpec) -> str:
    folder = model_folder(spec)
    if spec.model == "tiny":
        return "tiny"
    if folder is not None:
        return str(folder)
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id=spec.model, revision=spec.revision,
                             allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])


def run_batch(table_path: str | Path, out: str | Path, *, progress: bool = True, threads: int | None = None,
              device: str | None = None) -> dict[str, Any] | None:
    """Check the frozen table, run the self-tests, run every arm and write the archive ``out``.

    Every process computes with the spec's ``threads`` CPU threads, whatever ``OMP_NUM_THREADS`` or the
    launcher chose; ``threads``, when given, must equal that frozen count. Under ``torchrun`` every
    process checks its own files, runs the self-tests and its shard of the prompts; rank 0 gathers the
    records and writes the archive, which equals a single-process run's byte for byte apart from
    ``run.json`` and ``timings.jsonl`` (see :func:`compare`). Returns the decisions on rank 0, None elsewhere.
    """
    out, table_path = Path(out), Path(table_path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out {out} exists and is not an empty folder; archives are never overwritten")
    spec, _ = check_table(table_path)
    if threads is not None and threads != spec.threads:
        raise ValueError(f"--threads {threads} contradicts the frozen spec's threads: {spec.threads} (the count "
                         f"changes the records' bytes); allowed: {spec.threads}, or leave --threads out")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ctx = distributed.init(device)
    try:
        with measurement_mode(spec.cudnn_sdp, spec.threads) as mode:
            selftests = require_selftests()
            source = _model_source(spec)
            models = {p: load(source, dtype=DTYPES[p], device=ctx.device) for p in spec.precisions}
            shard = distributed.shard(units(spec), ctx)
            rerun = _rerun_check(spec, models[spec.dtype], shard)
            records = run_arms(spec, models, shard, progress=progress and ctx.rank == 0)
        node = {"rank": ctx.rank, "host": socket.gethostname(), "device": str(ctx.device), "prompts": len(shard),
                "selftests": [t.__dict__ for t in selftests], "rerun": rerun}
        gathered = distributed.gather((records, node), ctx)
        if gathered is None:
            return None
        merged = tuple([r for part, _ in gathered for r in part[i]] for i in range(3))
        run = {"package": looped_kv.__version__, "command": sys.argv, "started": started,
               "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), "world_size": ctx.world_size,
               "backend": ctx.backend, "threads": mode["threads"], "measurement": mode,
               "nodes": [n for _, n in gathered], "pid": os.getpid()}
        partial = out.with_name(out.name + ".partial")  # a failed write never leaves a half archive at ``out``
        shutil.rmtree(partial, ignore_errors=True)
        decisions = write_archive(partial, spec, table_path, merged, run)
        partial.rename(out)
        return decisions
    finally:
        distributed.finish(ctx)


@torch.no_grad()
def _rerun_check(spec: BatchSpec, model: LoopedLM, shard: Sequence[Unit]) -> dict[str, Any] | None:
    """RIPE Sec. 5.5 on the run's own device: two forwards (fused attention) of the first prompt, compared bitwise."""
    if not shard:
        return None
    ids = _encode(model, shard[0].text)
    report = bitwise_rerun(model, ids[:, :spec.tokens] if spec.mode == "substitution" else ids, spec.num_loops)
    return {"identical": report.identical, "equal_fraction": report.equal_fraction,
            "max_abs_diff": report.max_abs_diff}


# -- verification and the ledger ------------------------------------------------------------------------------------


def verify(archive: str | Path) -> list[str]:
    """Problems found in an archive (empty when it verifies).

    Checks every line of the manifest, that no file is unlisted, that the archived spec and prompts are
    the frozen ones, and that the summary and the labels follow from the records.
    """
    root = Path(archive)
    if not (root / MANIFEST).is_file():
        raise FileNotFoundError(f"{root} is not a batch archive (no {MANIFEST})")
    problems, listed = [], {}
    for line in (root / MANIFEST).read_text().splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
        if not (root / name).is_file():
            problems.append(f"missing file {name}")
        elif sha256(root / name) != digest:
            problems.append(f"checksum mismatch: {name}")
    problems += [f"unlisted file {name}" for name in _archive_files(root) if name not in listed]
    if problems:
        return problems
    table = read_table(root / "frozen.json")
    frozen = {k: v for k, v in table["files"].items() if k.startswith("spec/")}
    archived = {k: sha256(root / k) for k in frozen if (root / k).is_file()}
    problems += [f"frozen table vs archived spec: {c}" for c in table_changes(frozen, archived)]
    if problems:
        return problems
    spec = load_spec(root / "spec" / table["spec_file"])
    summary, decisions = _analyse(spec, root)
    stored_summary = json.loads((root / "summary.json").read_text())
    if {k: v for k, v in stored_summary.items() if k != "measurement"} != summary:
        problems.append("summary.json does not follow from the records")
    if json.loads((root / "decisions.json").read_text()) != decisions:
        problems.append("decisions.json (labels, predictions) does not follow from the records")
    package = {k: v for k, v in table["files"].items() if k.startswith("package/")}
    changes = table_changes(package, {key: sha256(path) for key, path in _package_files().items()})
    if problems and changes:  # recomputed with other code than the run's: say so
        problems.append(f"the installed package differs from the archive's ({'; '.join(changes)})")
    return problems


_ABSENT = object()  # a value one archive has and the other lacks


def _show(value: Any) -> str:
    """A value as JSON (floats to their last digit), cut to 60 characters."""
    text = "absent" if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Difference:
    """How one metric (a field of the records, of summary.json or of decisions.json) differs between two archives."""

    file: str
    metric: str
    differing: int  # values that differ
    compared: int  # values of the metric in either archive
    largest: float | None  # the largest |a - b| over values that are numbers in both (None: no such pair differs)
    where: str  # the record or key of that difference, else of the first differing value
    values: tuple[Any, Any] | None = None  # the two values there

    def __str__(self) -> str:
        size = f"largest difference {self.largest:.3g} at" if self.largest is not None else "first at"
        shown = f" ({_show(self.values[0])} vs {_show(self.values[1])})" if self.values is not None else ""
        return f"{self.file} {self.metric}: {self.differing} of {self.compared} differ, {size} {self.where}{shown}"


@dataclass(frozen=True)
class Comparison:
    """Two archives of one frozen spec compared byte for byte (:func:`compare`)."""

    first: Path
    second: Path
    files: tuple[str, ...]  # the files compared
    differing_files: tuple[str, ...]
    differences: tuple[Difference, ...]  # per file and metric
    table_changes: tuple[str, ...]  # package or model files frozen with other checksums

    @property
    def identical(self) -> bool:
        return not self.differing_files

    def report(self) -> str:
        """One line for the verdict, one per differing metric and one per package or model change."""
        head = f"{self.first} vs {self.second}: {len(self.files)} files of one frozen spec compared"
        if self.identical:
            lines = [f"{head}, identical byte for byte ({', '.join(RUN_FILES)} and frozen.json left out)"]
        else:
            lines = [f"{head}, {len(self.differing_files)} differ: {', '.join(self.differing_files)}"]
            lines += [f"  {d}" for d in self.differences]
        lines += [f"  frozen with other package or model files: {c}" for c in self.table_changes]
        return "\n".join(lines)


def _leaves(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, value) of every leaf of a JSON document; a list of numbers or strings is one leaf."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        for i, value in enumerate(obj):
            yield from _leaves(value, (*path, str(i)))
    else:
        yield path, obj


def _values(path: Path) -> dict[tuple[str, str], Any]:
    """(metric, where) -> value: a JSON-lines record's fields where its prompt, arm and position say, a JSON
    document's leaves (metric: the last key) where their path says."""
    if path.suffix == ".jsonl":
        values = {}
        for record in _read_jsonl(path):
            where = ", ".join(f"{key} {record[key]}" for key in RECORD_KEYS if key in record)
            values |= {(key, where): value for key, value in record.items() if key not in RECORD_KEYS}
        return values
    return {(keys[-1] if keys else "document", ".".join(keys[:-1]) or "the top level"): value
            for keys, value in _leaves(json.loads(path.read_text()))}


def _numeric(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _file_differences(name: str, a: Path, b: Path) -> list[Difference]:
    """Per metric, how file ``name`` differs between two archives (``a`` and ``b``, one of which may be absent)."""
    if not (a.is_file() and b.is_file()):
        return [Difference(name, "file", 1, 1, None, f"absent from the {'first' if not a.is_file() else 'second'} "
                                                     f"archive")]
    try:
        first, second = _values(a), _values(b)
    except (json.JSONDecodeError, UnicodeDecodeError):  # not JSON (the spec's YAML, a damaged file)
        return [Difference(name, "bytes", 1, 1, None, "the whole file")]
    groups: dict[str, list[tuple[str, Any, Any]]] = {}
    for key in [*first, *(k for k in second if k not in first)]:
        groups.setdefault(key[0], []).append((key[1], first.get(key, _ABSENT), second.get(key, _ABSENT)))
    found = []
    for metric, rows in groups.items():
        differing = [(where, x, y) for where, x, y in rows if x != y or type(x) is not type(y)]
        if not differing:
            continue
        numeric = [(abs(x - y), where, x, y) for where, x, y in differing if _numeric(x) and _numeric(y)]
        largest, where, x, y = max(numeric, key=lambda row: row[0]) if numeric else (None, *differing[0])
        found.append(Difference(name, metric, len(differing), len(rows), largest, where, (x, y)))
    return found or [Difference(name, "bytes", 1, 1, None, "the layout (every value is the same)")]


def compare(first: str | Path, second: str | Path) -> Comparison:
    """Whether two archives of one frozen spec agree byte for byte; where a file does not, per metric, how many
    values differ and the largest numeric difference.

    Every file is compared except ``run.json`` and ``timings.jsonl`` (the machine, the command, the clock)
    and ``frozen.json`` (when the spec was frozen), whose file table is compared instead: the spec's files
    must be the same (ValueError otherwise), and package or model files frozen with other checksums are
    listed. A pinned thread count (the spec's ``threads``) makes a run alone and one under ``torchrun``
    identical. Integrity is :func:`verify`'s job.
    """
    roots = Path(first), Path(second)
    for root in roots:
        if not (root / MANIFEST).is_file():
            raise FileNotFoundError(f"{root} is not a batch archive (no {MANIFEST})")
    tables = [read_table(root / "frozen.json")["files"] for root in roots]
    spec_changes = table_changes(*({k: v for k, v in t.items() if k.startswith("spec/")} for t in tables))
    if spec_changes:
        raise ValueError(f"{first} and {second} are archives of different frozen specs ({'; '.join(spec_changes)}); "
                         f"compare only archives of one frozen spec")
    others = table_changes(*({k: v for k, v in t.items() if not k.startswith("spec/")} for t in tables))
    names = sorted((set(_archive_files(roots[0])) | set(_archive_files(roots[1]))) - {*RUN_FILES, "frozen.json"})
    differing, differences = [], []
    for name in names:
        a, b = roots[0] / name, roots[1] / name
        if a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes():
            continue
        differing.append(name)
        differences += _file_differences(name, a, b)
    return Comparison(roots[0], roots[1], tuple(names), tuple(differing), tuple(differences), tuple(others))


def ledger_rows(archives: Sequence[str | Path]) -> list[dict[str, str]]:
    """Every prediction of the (verified) archives: batch, prediction, outcome (RIPE Appendix B, Table 6)."""
    rows = []
    for archive in archives:
        problems = verify(archive)
        if problems:
            raise ValueError(f"archive {archive} does not verify ({'; '.join(problems)})")
        decisions = json.loads((Path(archive) / "decisions.json").read_text())
        rows += [{"Batch": decisions["batch"], "Prediction": p["prediction"],
                  "Outcome": f"{p['outcome']} ({p['observed']})"} for p in decisions["predictions"]]
    return rows


def ledger(archives: Sequence[str | Path]) -> str:
    """The prediction ledger of several archives as a text table, with a count of held and failed predictions."""
    if not archives:
        raise ValueError("archives must name at least one batch archive")
    rows = ledger_rows(archives)
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in ("Batch", "Prediction")}
    lines = [f"{'Batch':<{widths['Batch']}}  {'Prediction':<{widths['Prediction']}}  Outcome"]
    lines += [f"{r['Batch']:<{widths['Batch']}}  {r['Prediction']:<{widths['Prediction']}}  {r['Outcome']}"
              for r in rows]
    held = sum(r["Outcome"].startswith("held") for r in rows)
    lines.append(f"{len(rows)} predictions: {held} held, {len(rows) - held} failed")
    return "\n".join(lines)
