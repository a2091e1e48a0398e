"""The plan's predicted peaks against the measured peak allocations of the chapters' own calls, on a scaled-down
random model of Huginn's shape on the CPU (where GPU and host memory are one), within 10%; and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from looped_kv import plan_check, profiles
from looped_kv.book import DTYPES
from looped_kv.cli import main
from looped_kv.runtime.config import LoopedConfig, huginn_0125
from looped_kv.runtime.model import LoopedLM

ROOT = Path(__file__).parent.parent
# Huginn-0125's proportions (vocabulary 12 widths, MLP 3.4 widths, 2/4/2 layers) at width 64, with R = 16.
SCALED = LoopedConfig(family="huginn", vocab_size=800, n_embd=64, n_heads=4, n_kv_heads=4, n_prelude=2, n_core=4,
                      n_coda=2, intermediate_size=216, block_size=512, qk_bias=True, rope_base=50000.0,
                      embed_scale=8.0, state_std=0.4, tie_embeddings=True, mean_recurrence=16)
H = profiles.HUGINN_0125
# The Huginn profile's structure (bf16 decoding, passes of rows, replays' records on the host, fp32 exactness
# check in chapter 4), with fewer and shorter texts.
PROFILE = replace(
    H, name="scaled", prompt_tokens=40, rows_per_pass=4,
    ch01=replace(H.ch01, texts_per_workload=6, text_chars=97, loops=(1, 4, 16), prompts_per_workload=6,
                 new_tokens=8),
    ch02=replace(H.ch02, texts_per_workload=2, length=64, decoded=16, chunk=2),
    ch03=replace(H.ch03, texts_per_workload=2, prefix=40, decoded=8, table3_texts_per_workload=4,
                 table3_length=48, table3_chunk=4, exact_chunk=3),
    ch04=replace(H.ch04, replay_prompts=2, replay_batch=2, new_tokens=8, windows=(4, 8, 16), exact_prompts=1,
                 acceptance_prompts=6, acceptance_tokens=8, ripeness_texts_per_workload=1),
    ch05=replace(H.ch05, agreement_prompts=6, agreement_tokens=8, acceptance_prompts=6, acceptance_tokens=8),
    ch06=replace(H.ch06, acceptance_prompts=6, acceptance_tokens=8),
    ch07=replace(H.ch07, batch_sizes=(1, 6), memory_batch_sizes=(6,), new_tokens=8),
)


@pytest.fixture(scope="module")
def model() -> LoopedLM:
    torch.manual_seed(0)
    model = LoopedLM(SCALED).to(DTYPES[PROFILE.dtype]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model(torch.zeros(1, PROFILE.prompt_tokens + 64, dtype=torch.long))  # the initial-state table, built once
    return model


@pytest.mark.parametrize("chapter", sorted(plan_check.RUNS))
def test_plan_predicts_the_measured_peak(model, chapter):
    """Each chapter's own calls at the scaled profile's sizes (:mod:`looped_kv.plan_check`), measured by the
    tensor meter; the model's weights are held before the chapter starts and are not counted."""
    measured, _ = plan_check.measured_peak(model, PROFILE, chapter)
    predicted = plan_check.predicted_peak(model, PROFILE, chapter)
    assert abs(predicted / measured - 1) <= 0.10, (chapter, predicted, measured)


def test_plan_check_records_a_run_and_checks_its_options(tmp_path, capsys):
    out = tmp_path / "check.json"
    plan_check.main(["--model", "tiny", "--device", "cpu", "--chapters", "ch07", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["profile"] == "tiny" and "cudnn_sdp" in record["environment"]
    (row,) = record["chapters"]
    assert row["chapter"] == "ch07" and row["measured bytes"] > 0 and 0.5 < row["predicted / measured"] < 2
    for argv, message in ((["--model", "huginn"], "--model must be one of"),
                          (["--chapters", "ch08"], "--chapters must be among"),
                          (["--profile", "t4"], "--profile must be one of"),
                          (["--device", "cuda:7"], "--device")):
        with pytest.raises(SystemExit):
            plan_check.main(argv)
        assert message in capsys.readouterr().err


def test_huginn_fits_a_40gb_gpu_and_not_a_16gb_one(capsys):
    assert main(["plan", "--model", "huginn-0125", "--gpu-memory", "40"]) == 0
    out = capsys.readouterr().out
    assert out.count(" yes ") == 7 and " NO " not in out
    assert main(["plan", "--model", "huginn-0125", "--gpu-memory", "16"]) == 1  # a Colab T4: refused, by chapter
    assert "ch01, ch02, ch03, ch04, ch05, ch06, ch07 need more than 16 GB" in capsys.readouterr().out


def test_plan_reads_a_config_folder_and_checks_its_options(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(huginn_0125().to_hf_dict()))
    assert main(["plan", "--model", str(tmp_path), "--profile", "huginn-0125"]) == 0
    assert main(["plan", "--model", "tiny"]) == 0
    assert "at profile tiny" in capsys.readouterr().out
    assert main(["plan", "--gpu-memory", "-1"]) == 2
    assert "--gpu-memory must be > 0" in capsys.readouterr().err
    assert main(["plan", "--profile", "t4"]) == 2
    assert "--profile must be one of" in capsys.readouterr().err


def test_prompt_bounds_hold():
    """The plan charges every prompt ``prompt_tokens`` tokens. A real checkpoint's profile decodes GSM8K and MBPP,
    whose prompts ``looped_kv.workloads.encode`` holds to that bound when the chapter tokenizes them
    (tests/test_workloads.py), and generated chain programs, bounded here: they are ASCII, a token of a real
    checkpoint's tokenizer covers at least one character, and one more token may open the text. The tiny model's
    generated prompts are checked with its own tokenizer."""
    from looped_kv import data, load, workloads

    longest = max(len(t) for split in ("eval", "dev") for t in data.prompts("chains", 64, split))
    for profile in (p for p in profiles.PROFILES.values() if p is not profiles.TINY):
        assert profile.workloads == "papers"
        assert longest + 1 <= profile.prompt_tokens, profile.name
        chains = data.chain_programs(profile.ch01.chain_programs, split="eval")
        assert max(len(p.text) for p in chains) + 1 <= profile.ch01.chain_tokens, profile.name
    tiny = load("tiny")
    for split in ("eval", "dev"):
        for worked in (False, True):
            for w in data.WORKLOADS:
                workloads.prompt_ids(tiny, profiles.TINY, w, 64, split, worked=worked)  # raises beyond the bound


@pytest.mark.parametrize("name", ["huginn-0125-40gb", "raven-llama-40gb", "raven-olmo-40gb", "huginn-0125-16gb"])
def test_the_gpu_pages_tables_are_the_plans(name, capsys):
    """book/gpu.md includes these tables; each is what ``looped-kv plan --markdown`` prints today."""
    model, memory = name.rsplit("-", 1)
    status = main(["plan", "--model", model, "--gpu-memory", memory.removesuffix("gb"), "--markdown"])
    assert status == (0 if memory == "40gb" else 1)
    path = ROOT / "book" / "data" / f"plan-{name}.md"
    assert capsys.readouterr().out == path.read_text(), f"regenerate {path.name} with looped-kv plan ... --markdown"
