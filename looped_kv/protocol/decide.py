"""Summary, decision rules and labels of a batch's records (RIPE Appendix B): per-arm means of the spec's metrics,
each rule's statistic with its bootstrap interval and label, and every prediction scored held or failed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from looped_kv.analysis import fits
from looped_kv.protocol.spec import ARM_METRICS, METRICS, REFERENCE, BatchSpec, Rule


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
                                "tail": groups["kl"].agg(lambda kls: float((kls > spec.tail_kl).sum())),
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


