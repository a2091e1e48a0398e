"""What a chapter measures on, by profile: the generated workloads, or GSM8K and MBPP through a stand-in for
``datasets`` that serves generated rows in the datasets' schemas (offline; no dataset text is copied)."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import replace

import pytest
import torch
from test_formats import gsm8k_row, mbpp_row

from looped_kv import load, profiles, workloads
from looped_kv.analysis.planes import workload_batch
from looped_kv.workloads import data, formats

PAPERS = replace(profiles.TINY, name="papers", workloads="papers")
# The first row of each dataset split the stand-in serves: rows of different splits never coincide.
FIRST = {"test": 0, "train": 10_000, "validation": 20_000}


@pytest.fixture
def hub(monkeypatch) -> list[tuple[str, str, str]]:
    """A stand-in ``datasets`` module; returns the (path, config, split) of every load."""
    calls = []

    def load_dataset(path, config, split):
        calls.append((path, config, split))
        name, start, stop = re.fullmatch(r"(\w+)\[(\d+):(\d+)\]", split).groups()
        make = gsm8k_row if path == "openai/gsm8k" else mbpp_row
        return [make(FIRST[name] + i) for i in range(int(start), int(stop))]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


@pytest.fixture(scope="module")
def tiny():
    return load("tiny")


def test_generated_workloads_are_the_data_modules():
    for w in data.WORKLOADS:
        assert workloads.prompts(w, 5, "dev") == data.prompts(w, 5, "dev")
        assert workloads.texts(w, 3, chars=300) == data.texts(w, 3, chars=300)
    worked = workloads.prompts("problems", 4, worked=True)
    shots, questions = data.word_problems(4, split="dev"), data.word_problems(4, split="eval", seed=1)
    assert worked == [s.text + q.prompt for s, q in zip(shots, questions, strict=True)]
    assert workloads.prompts("code", 3, worked=True) == data.prompts("code", 3)


def test_papers_problems_are_eight_shot_gsm8k(hub):
    shots = [gsm8k_row(FIRST["train"] + i) for i in range(formats.SHOTS)]
    prompts = workloads.prompts("problems", 3, source="papers")
    assert prompts == formats.gsm8k_prompts([gsm8k_row(i) for i in range(3)], shots)
    assert all(p.count("The answer is") == formats.SHOTS for p in prompts)
    assert ("openai/gsm8k", "main", "test[0:3]") in hub and ("openai/gsm8k", "main", "train[0:8]") in hub
    hub.clear()
    dev = workloads.prompts("problems", 2, "dev", source="papers", worked=True)  # worked: the shots are there
    assert ("openai/gsm8k", "main", "train[8:10]") in hub  # dev questions follow the shots
    assert dev[0].endswith(f"Question: {gsm8k_row(FIRST['train'] + 8)['question']}\nAnswer:")


def test_papers_code_is_mbpp_and_chains_stay_generated(hub):
    assert workloads.prompts("code", 2, source="papers") == formats.mbpp_prompts([mbpp_row(0), mbpp_row(1)])
    workloads.prompts("code", 2, "dev", source="papers")
    assert hub == [("google-research-datasets/mbpp", "full", "test[0:2]"),
                   ("google-research-datasets/mbpp", "full", "validation[0:2]")]
    assert workloads.prompts("chains", 4, source="papers") == data.prompts("chains", 4)
    assert workloads.texts("chains", 2, source="papers") == data.texts("chains", 2)


def test_papers_texts_join_solved_rows(hub):
    (problems,) = workloads.texts("problems", 1, chars=10_000, source="papers")
    assert problems == "".join(formats.gsm8k_worked(gsm8k_row(i)) for i in range(workloads.ROWS_PER_TEXT))
    code = workloads.texts("code", 2, chars=150, source="papers")
    assert len(code) == 2 and all(len(t) == 150 for t in code)
    assert code[1].startswith(formats.mbpp_solved(mbpp_row(workloads.ROWS_PER_TEXT))[:150])
    assert "def add_0(x):\n    return x + 0\n" in formats.mbpp_solved(mbpp_row(0))  # no "\r" left


def test_workload_batch_reads_the_papers_texts(hub, tiny):
    ids, labels = workload_batch(tiny, ["problems", "code"], 2, 32, source="papers")
    assert ids.shape == (4, 32) and list(labels) == ["problems"] * 2 + ["code"] * 2
    first = workloads.texts("problems", 2, chars=8 * 32, source="papers")[0]
    assert torch.equal(ids[0].cpu(), tiny.tokenizer(first, return_tensors="pt").input_ids[0, :32])


def test_prompts_are_held_to_the_profiles_bound(hub, tiny):
    ids = workloads.prompt_ids(tiny, PAPERS, "code", 3)
    assert [tuple(t.shape[:1]) for t in ids] == [(1,)] * 3
    assert torch.equal(ids[0], tiny.tokenizer(workloads.prompts("code", 1, source="papers")[0],
                                              return_tensors="pt").input_ids)
    short = replace(PAPERS, prompt_tokens=20)
    with pytest.raises(ValueError, match=r"a prompt of \d+ tokens exceeds prompt_tokens = 20 of profile 'papers'"):
        workloads.prompt_ids(tiny, short, "problems", 2)  # eight shots are far longer than 20 tokens


def test_every_real_checkpoint_profile_measures_on_the_papers_workloads():
    assert profiles.TINY.workloads == "generated"
    small = ("tiny", "smoke")  # the shipped model's CI profile, and fixture-sized models'
    assert {p.workloads for name, p in profiles.PROFILES.items() if name not in small} == {"papers"}


@pytest.mark.parametrize(("call", "message"), [
    (lambda: workloads.prompts("math", 2), "workload must be one of"),
    (lambda: workloads.prompts("code", 2, "train"), r"split must be one of \('eval', 'dev'\)"),
    (lambda: workloads.texts("code", 0), "n must be >= 1"),
    (lambda: workloads.prompts("code", 2, source="hub"), r"source \(Profile.workloads\) must be one of"),
    (lambda: formats.load_rows("gsm8k", "test", 2, start=-1), "start must be >= 0"),
])
def test_bad_input_is_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as error:
        call()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("source", sorted(workloads.SOURCES))
def test_a_workloads_first_prompts_are_the_first_of_any_larger_count(source, hub):
    """What lets :func:`workloads.preflight` check every chapter's prompts by the largest count alone."""
    for split in workloads.SPLITS:
        for w in data.WORKLOADS:
            for worked in (False, True):
                many = workloads.prompts(w, 12, split, source, worked=worked)
                assert workloads.prompts(w, 5, split, source, worked=worked) == many[:5], (w, split, worked)


def test_preflight_holds_every_chapters_prompts_to_the_bound(tiny, hub):
    line = workloads.preflight(tiny, profiles.TINY)
    ids = [t for (split, worked), n in workloads._prompt_counts(profiles.TINY).items() for w in data.WORKLOADS
           for t in workloads.prompt_ids(tiny, profiles.TINY, w, n, split, worked=worked)]
    longest = max(t.shape[-1] for t in ids)
    assert line == (f"workloads: generated workloads; the longest prompt has {longest} tokens of the "
                    f"{profiles.TINY.prompt_tokens} the plan charges")
    with pytest.raises(ValueError, match=f"a prompt of {longest} tokens exceeds prompt_tokens = {longest - 1}"):
        workloads.preflight(tiny, replace(profiles.TINY, prompt_tokens=longest - 1))
    assert "GSM8K and MBPP" in workloads.preflight(tiny, replace(PAPERS, prompt_tokens=4096))
