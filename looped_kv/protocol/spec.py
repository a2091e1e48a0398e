"""The batch spec: a YAML file that pre-registers a batch's question, model, prompts, arms, metrics, decision rules
and predictions (RIPE Sec. 5, "Protocol"). :func:`load_spec` validates every field before any work; the keys are
listed in :mod:`looped_kv.protocol.batches`. Checks that need the model (its context and tokenizer) are
:func:`looped_kv.protocol.freeze.check_runnable`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from looped_kv.analysis.replay import paper_region
from looped_kv.book import DTYPES
from looped_kv.decoding.das_wave import check_wave
from looped_kv.decoding.settings import METHODS, DasWave, SelfSpec, default_draft_loops, method_config, options
from looped_kv.decoding.speculative import check_speculation
from looped_kv.runtime.policy import make_policy, make_prefix_reads

EXAMPLES_DIR = Path(__file__).parents[1] / "batch_specs"
REFERENCE = "reference"
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
#: A decoder arm's options: its method's own (:mod:`looped_kv.decoding.settings`), without those every method shares
#: (the cache, the budget, sampling: a batch spec sets them once) and greedy decoding's early exits.
METHOD_OPTIONS = {method: tuple(name for name in options(method) if name not in options("ar")) for method in METHODS}
SPEC_KEYS = {"batch", "name", "question", "model", "revision", "dtype", "num_loops", "mode", "seed", "cudnn_sdp",
             "threads", "prompts", "tokens", "decoded", "softmax", "max_new_tokens", "reference", "tail_kl", "arms",
             "metrics", "decision_rules", "predictions"}


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

    @property
    def verify_width(self) -> int | None:
        """The most proposals one verification of a drafting decoder arm tests (:func:`verify_width`); None for
        other arms."""
        return verify_width(self.decoder, self.options) if self.kind == "decoder" else None


def verify_width(decoder: str, options: dict[str, Any]) -> int | None:
    """The most proposals one verification of ``decoder`` tests: gamma, or DAS-Wave's ``max_width`` (its verifier
    capacity gamma), from ``options``, else the default of :mod:`looped_kv.decoding.settings`; None for decoders that
    draft nothing (greedy decoding, replay)."""
    if decoder in ("ar", "replay"):
        return None
    if decoder == "das-wave":
        return options.get("max_width", DasWave.max_width)
    return options.get("gamma", SelfSpec.gamma)


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
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {sorted(allowed)}")


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
        make_policy(keywords["cache"], num_loops, **{key: value for key, value in keywords.items() if key != "cache"})
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
    if isinstance(chosen.get("prefix_reads"), list):
        chosen["prefix_reads"] = tuple(chosen["prefix_reads"])
    policy = make_policy(cache["cache"], num_loops, **{key: value for key, value in cache.items() if key != "cache"})
    try:
        method_config(decoder, **chosen)  # every option's type, as generate() checks it
        if chosen.get("ngram", 1) < 1:
            raise ValueError(f"ngram must be >= 1, got {chosen['ngram']}")
        if "prefix_reads" in chosen:
            make_prefix_reads(chosen["prefix_reads"], num_loops)
        if decoder != "ar":
            sequential = decoder in ("self-spec", "mature-spec")
            draft = chosen.get("draft_loops", default_draft_loops(num_loops)) if sequential else None
            check_speculation(policy, verify_width(decoder, chosen), chosen.get("exact", True), draft)
        if decoder == "das-wave":
            wave = DasWave().schedule(num_loops) | chosen
            check_wave(wave["max_width"], wave["rounds"], wave["initial_width"], wave["updates"])
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
    if not math.isfinite(threshold):
        raise ValueError(f"{where}.threshold must be a finite number, got {threshold}")
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
    floor = None if raw.get("floor") is None else float(_number(raw["floor"], f"{where}.floor"))
    if floor is not None and not 0 < floor < math.inf:
        raise ValueError(f"{where}.floor must be a KL > 0 (log KL is regressed), got {floor}")
    return replace(rule, arms=arms, floor=floor)


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
        raise ValueError(f"spec {path} is not valid YAML: {' '.join(str(error).split())}") from None
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
    seed, tail_kl = _get(raw, "seed", where, int, 0), float(_get(raw, "tail_kl", where, (int, float), 0.1))
    if seed < 0:
        raise ValueError(f"spec.seed must be >= 0 (a bootstrap seed), got {seed}")
    if not 0 <= tail_kl < math.inf:
        raise ValueError(f"spec.tail_kl must be a KL >= 0, got {tail_kl}")
    common = dict(
        path=path, batch=str(_get(raw, "batch", where, (int, str))), name=_get(raw, "name", where, str),
        question=_get(raw, "question", where, str), model=_get(raw, "model", where, str),
        revision=_get(raw, "revision", where, str, None), dtype=dtype, num_loops=num_loops, mode=mode,
        seed=seed, cudnn_sdp=_get(raw, "cudnn_sdp", where, bool, False), tail_kl=tail_kl, threads=threads)
    prompt_sets = _get(raw, "prompts", where, list)
    sets = tuple(_prompt_set(p, i, path.parent) for i, p in enumerate(prompt_sets))
    if len({s.name for s in sets}) != len(sets) or not sets:
        raise ValueError("spec.prompts must name one or more prompt sets with distinct names")
    if mode == "substitution":
        by_mode = dict(tokens=_get(raw, "tokens", where, int), decoded=_get(raw, "decoded", where, int),
                     softmax=_get(raw, "softmax", where, str, "float32", allowed=("float32", "float64")))
        if by_mode["tokens"] < 2:
            raise ValueError(f"spec.tokens must be >= 2 (a text and at least one decoded position), got "
                             f"{by_mode['tokens']}")
        if not 1 <= by_mode["decoded"] < by_mode["tokens"]:
            raise ValueError(f"spec.decoded must be in 1..tokens - 1 = {by_mode['tokens'] - 1}, got "
                             f"{by_mode['decoded']}")
        for key in ("max_new_tokens", "reference"):
            if key in raw:
                raise ValueError(f"spec.{key} is a generation-mode key; mode is 'substitution'")
    else:
        reference = _get(raw, "reference", where, dict, {})
        _unknown(reference, ("cache", "window", "k", "sinks", "precision"), "spec.reference")
        by_mode = dict(max_new_tokens=_get(raw, "max_new_tokens", where, int),
                     reference={**_cache_keywords(reference, "spec.reference", num_loops),
                                "precision": _get(reference, "precision", "spec.reference", str, dtype,
                                                  allowed=tuple(DTYPES))})
        if by_mode["max_new_tokens"] < 2:
            raise ValueError(f"spec.max_new_tokens must be >= 2, got {by_mode['max_new_tokens']}")
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
    rules = tuple(_rule(r, i, by_name, mode, by_mode.get("max_new_tokens", 0)) for i, r in enumerate(raw_rules))
    if not rules or len({r.name for r in rules}) != len(rules):
        raise ValueError("spec.decision_rules must hold one or more rules with distinct names")
    rules_by_name = {r.name: r for r in rules}
    predictions = tuple(_prediction(p, i, rules_by_name) for i, p in enumerate(_get(raw, "predictions", where, list)))
    if not predictions:
        raise ValueError("spec.predictions must hold at least one prediction")
    return BatchSpec(**common, prompt_sets=sets, arms=arms, metrics=metrics, rules=rules, predictions=predictions,
                     **by_mode)


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
