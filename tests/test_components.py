"""DAS's component diagnostics (looped_kv.experiments.components) and the acceptance-prediction claim."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import looped_kv
from looped_kv import papers
from looped_kv.analysis import claims
from looped_kv.analysis.verdicts import AGREES, DISAGREES, INCONCLUSIVE
from looped_kv.decoding.settings import Greedy
from looped_kv.experiments import bench, components
from looped_kv.workloads import data


@pytest.fixture(scope="module")
def tiny():
    return looped_kv.load("tiny", dtype=torch.float32)


def prompts(model, n: int) -> list[torch.Tensor]:
    return [model.tokenizer(p, return_tensors="pt").input_ids for p in data.prompts("problems", n, split="dev")]


def test_component_configs_are_table_8s_rows():
    configs = components.component_configs(4, 8)
    assert list(configs) == [components.component_name(row) for row in papers.DAS_TABLE_8[papers.HUGINN]]
    sequential = bench.method_configs(4, 8)
    assert configs["Sequential (Aligned)"] == sequential["self-spec"]
    assert configs["Sequential (Deep K/V)"] == sequential["mature-spec"]
    assert configs["Parallel + carry (Deep K/V)"] == replace(sequential["das-wave"], prefix_reads="deep-kv")
    no_carry = configs["Parallel, no carry (Aligned)"]
    assert no_carry.carry is False and no_carry.prefix_reads == "aligned"
    assert configs["Parallel + carry (Deep V)"].prefix_reads == "deep-v"


def test_retuned_configs_are_table_10s_schedules():
    configs = components.retuned_configs()
    for (policy, row), (name, config) in zip(papers.DAS_TABLE_10[papers.HUGINN].items(), configs.items(), strict=True):
        gamma, rounds, updates = row[:3]
        assert policy in name and config.carry is True
        assert (config.max_width, config.rounds, config.updates) == (gamma, rounds, updates)
    assert configs["Parallel + carry (Deep V, retuned)"].prefix_reads == "deep-v"
    with pytest.raises(ValueError, match="retunes"):
        components.retuned_configs(papers.RAVEN_OLMO)


def test_table_14_configs_scale_the_depths():
    at_32 = components.table_14_configs(32, 8)
    rows = papers.DAS_TABLE_14
    assert [c.draft_loops for c in at_32.values()] == [row[0] for row in rows.values()]
    assert at_32["Mature-Spec"].method == "mature-spec" and at_32["Self-speculative"].method == "self-spec"
    assert [c.draft_loops for c in components.table_14_configs(4, 3).values()] == [1, 1]


def test_draft_times_time_the_proposals_alone(tiny):
    methods = components.table_14_configs(tiny.config.mean_recurrence, 4)
    times = components.draft_times(tiny, prompts(tiny, 2), methods, 12)
    assert len(times) == 4 and set(times["method"]) == set(methods)
    assert (times["draft ms"] > 0).all() and (times["draft ms"] < times["total ms"]).all()
    assert (times["d"].tolist()) == [8, 8, 4, 4]
    assert times["draft ms/token"].tolist() == pytest.approx((times["draft ms"] / times["new_tokens"]).tolist())
    with pytest.raises(ValueError, match="drafts nothing"):
        components.draft_times(tiny, prompts(tiny, 1), {"ar": Greedy()}, 4)


def test_deep_kv_over_deep_v_verdicts(tiny):
    methods = {"mature-spec": bench.method_configs(4, 4)["mature-spec"],
               bench.DEEP_V_SPEC: bench.deep_v_config(4, 4)}
    ids = prompts(tiny, 2)
    acceptance = bench.acceptance_runs(tiny, ids, methods, 12)
    timing = bench.run_paired(tiny, ids[:1], methods, 8, progress=False)
    accepts = components.deep_kv_acceptance_verdict(acceptance)
    (speed,) = bench.speed_verdicts(components.DEEP_KV_FASTER, {"eager": {"problems": timing}}, "mature-spec",
                                    bench.DEEP_V_SPEC).values()
    assert accepts.claim == components.DEEP_KV_ACCEPTS_MORE and accepts.n == 2
    assert speed.claim == components.DEEP_KV_FASTER
    assert all(v.label == INCONCLUSIVE for v in (accepts, speed))  # too few prompts


def test_acceptance_prediction_verdict():
    within = papers.RIPE_TABLE_1["acceptance, held-out error"]
    measured = [3.0, 4.0, 5.0, 3.5, 4.5]
    close = [m * (1 + within / 2) for m in measured]
    assert claims.acceptance_prediction_verdict(close, measured).label == AGREES
    far = [*close[:-1], measured[-1] * (1 + 2 * within)]
    assert claims.acceptance_prediction_verdict(far, measured).label == DISAGREES
    assert claims.acceptance_prediction_verdict(close[:3], measured[:3]).label == INCONCLUSIVE  # 3 cells of 5
