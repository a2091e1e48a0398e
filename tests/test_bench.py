"""The paired benchmark: one row per (prompt, method), speed-ups with intervals, configuration selection."""

from __future__ import annotations

import torch
from conftest import random_model

from looped_kv import bench


def test_run_paired_and_summarize():
    model = random_model("huginn", seed=5, mean_recurrence=4)
    prompts = [torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    methods = {"greedy": {"method": "ar"}, "spec": {"method": "self-spec", "draft_loops": 2, "block": 3},
               "wave": {"method": "das-wave", "block": 4, "rounds": 3, "updates": 1}}
    runs = bench.run_paired(model, prompts, methods, max_new_tokens=8, progress=False)
    assert len(runs) == 9 and runs["same_as_greedy"].all()
    summary = bench.summarize(runs, n_boot=200)
    assert list(summary.index) == ["greedy", "spec", "wave"]
    greedy = summary.loc["greedy"]
    assert greedy["speed-up"] == 1.0 and greedy["same as greedy"] == "3/3"
    spec = summary.loc["spec"]
    assert spec["low"] <= spec["speed-up"] <= spec["high"]
    assert 1 <= spec["tau"] <= 4 and 0 <= spec["A"] <= 3


def test_select_configs_picks_from_the_grid():
    model = random_model("raven", seed=6, mean_recurrence=4)
    prompts = [torch.randint(0, model.config.vocab_size, (1, 4))]
    configs = [{"method": "self-spec", **c} for c in bench.grid(draft_loops=[1, 2], block=[2])]
    chosen, table = bench.select_configs(model, prompts, {"spec": configs}, max_new_tokens=6, progress=False)
    assert chosen["spec"] in configs and len(table) == 2


def test_grid():
    assert bench.grid(a=[1, 2], b=["x"]) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
