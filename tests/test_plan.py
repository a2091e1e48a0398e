"""The plan's predicted peaks against the measured peak allocations of the chapters' own calls, on a scaled-down
random model of Huginn's shape on the CPU (where GPU and host memory are one), within 10%; and the CLI."""

from __future__ import annotations

import json
import re
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from looped_kv import profiles
from looped_kv.analysis import plan
from looped_kv.book import DTYPES
from looped_kv.cli import main
from looped_kv.experiments import plan_check
from looped_kv.runtime.config import PRESETS, LoopedConfig, huginn_0125
from looped_kv.runtime.model import LoopedLM

ROOT = Path(__file__).parent.parent
# Huginn-0125's proportions (vocabulary 12 widths, MLP 3.4 widths, 2/4/2 layers) at width 64, with R = 16.
SCALED = LoopedConfig(family="huginn", vocab_size=800, n_embd=64, n_heads=4, n_kv_heads=4, n_prelude=2, n_core=4,
                      n_coda=2, intermediate_size=216, block_size=512, qk_bias=True, rope_base=50000.0,
                      embed_scale=8.0, state_std=0.4, tie_embeddings=True, mean_recurrence=16)
H = profiles.HUGINN_0125
# The Huginn profile's structure (bf16 decoding, row chunks, replays' records on the host, fp32 exactness
# check in chapter 4), with fewer and shorter texts.
PROFILE = replace(
    H, name="scaled", prompt_tokens=40, rows_per_chunk=4,
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
    ch08=replace(H.ch08, chain_programs=6, chain_tokens=40, prompts_per_workload=6, new_tokens=8),
)


def t4_scaled(profile: profiles.Profile, R: int, wave_prompts: int) -> profiles.Profile:
    """A T4 profile's structure (float16 decoding and replays, its floors) with fewer and shorter texts."""
    p = profile
    return replace(
        p, name=f"scaled {p.name}", prompt_tokens=48, rows_per_chunk=2,
        ch01=replace(p.ch01, texts_per_workload=4, text_chars=97, loops=(1, 2, R), prompts_per_workload=4,
                     new_tokens=8, chain_programs=8, chain_tokens=64),
        ch02=replace(p.ch02, texts_per_workload=2, length=64, decoded=16, chunk=2),
        ch03=replace(p.ch03, texts_per_workload=2, prefix=40, decoded=8, table3_texts_per_workload=4,
                     table3_length=48, table3_chunk=4, exact_chunk=3),
        ch04=replace(p.ch04, replay_prompts=2, replay_batch=2, new_tokens=6, windows=(4,), exact_prompts=1,
                     acceptance_prompts=2, acceptance_tokens=6),
        ch05=replace(p.ch05, agreement_prompts=2, agreement_tokens=6, acceptance_prompts=2, acceptance_tokens=6),
        ch06=replace(p.ch06, acceptance_prompts=wave_prompts, acceptance_tokens=6),
        ch07=replace(p.ch07, batch_sizes=(1, 4), memory_batch_sizes=(4,), new_tokens=8),
        ch08=replace(p.ch08, chain_programs=4, chain_tokens=48, prompts_per_workload=4, new_tokens=8))


#: Scaled-down random models (config, profile): Huginn-0125 at its 40 GB profile; Ouro-1.4B (MHA, the whole stack
#: looped, R = 4) and Raven-TinyLlama (GQA 8:1, R = 8) at their T4 profiles' structure, in float16: Ouro's floors
#: cast the model itself in place (its float64 weights do not fit beside a copy), TinyLlama's copy it.
MODELS = {
    "huginn-0125": (SCALED, PROFILE),
    "ouro-1.4b-t4": (LoopedConfig(family="ouro", vocab_size=1024, n_embd=64, n_heads=4, n_kv_heads=4, n_prelude=0,
                                  n_core=2, n_coda=0, intermediate_size=176, block_size=256, rope_base=1e6,
                                  state_std=0.0, tie_embeddings=False, mean_recurrence=4, exit_threshold=1.0),
                     t4_scaled(profiles.BY_CARD["ouro-1.4b"]["t4"], 4, wave_prompts=2)),
    "raven-tinyllama-t4": (LoopedConfig(family="raven", vocab_size=1000, n_embd=64, n_heads=8, n_kv_heads=1,
                                        n_prelude=1, n_core=2, n_coda=1, intermediate_size=176, block_size=256,
                                        norm_eps=1e-5, rope_base=1e4, tie_embeddings=False, state_std=0.02,
                                        mean_recurrence=8),
                           t4_scaled(profiles.BY_CARD["raven-tinyllama"]["t4"], 8, wave_prompts=4)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def scaled(request) -> tuple[LoopedLM, profiles.Profile]:
    config, profile = MODELS[request.param]
    torch.manual_seed(0)
    model = LoopedLM(config).to(DTYPES[profile.dtype]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model(torch.zeros(1, profile.prompt_tokens + 64, dtype=torch.long))  # the initial-state table, built once
    return model, profile


@pytest.mark.parametrize("chapter", sorted(plan_check.RUNS))
def test_plan_predicts_the_measured_peak(scaled, chapter):
    """Each chapter's own calls at the scaled profile's sizes (:mod:`looped_kv.experiments.plan_check`), measured by the
    tensor meter; the model's weights are held before the chapter starts and are not counted."""
    model, profile = scaled
    measured, _ = plan_check.measured_peak(model, profile, chapter)
    predicted = plan_check.predicted_peak(model, profile, chapter)
    assert abs(predicted / measured - 1) <= 0.10, (profile.name, chapter, predicted, measured)


def test_plan_check_records_a_run_and_checks_its_options(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["plan-check", "--model", "tiny", "--device", "cpu", "--chapters", "ch07", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["profile"] == "tiny" and "cudnn_sdp" in record["environment"]
    (row,) = record["chapters"]
    assert row["chapter"] == "ch07" and row["measured bytes"] > 0 and 0.5 < row["predicted / measured"] < 2
    for argv, message in ((["--model", "huginn"], "--model must be one of"),
                          (["--chapters", "ch09"], "--chapters must be among"),
                          (["--profile", "t4"], "--profile must be one of"),
                          (["--device", "cuda:7"], "--device")):
        assert main(["plan-check", *argv]) == 2
        assert message in capsys.readouterr().err


def test_plan_check_records_each_chapter_as_it_ends_and_resumes(tmp_path, capsys, monkeypatch):
    """A long run keeps what it measured: the record is written after every chapter, and --resume runs only the
    chapters the record lacks (an existing record of another model or profile is refused, and left as it is)."""
    out = tmp_path / "check.json"
    ran = []
    measured_peak = plan_check.measured_peak

    def counted(model, profile, chapter):
        ran.append(chapter)
        if chapter == "ch05":
            raise KeyboardInterrupt  # stopped in the second chapter
        return measured_peak(model, profile, chapter)

    monkeypatch.setattr(plan_check, "measured_peak", counted)
    words = ["plan-check", "--model", "tiny", "--device", "cpu", "--out", str(out)]
    assert main([*words, "--chapters", "ch07", "ch05"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert [r["chapter"] for r in json.loads(out.read_text())["chapters"]] == ["ch07"]
    assert main([*words, "--chapters", "ch07", "ch05"]) == 2  # an existing record: left untouched
    assert "exists and is left untouched" in capsys.readouterr().err
    monkeypatch.setattr(plan_check, "measured_peak", lambda *a: (ran.append(a[2]), measured_peak(*a))[1])
    ran.clear()
    assert main([*words, "--chapters", "ch07", "ch08", "--resume"]) == 0
    assert ran == ["ch08"]
    rows = json.loads(out.read_text())["chapters"]
    assert [r["chapter"] for r in rows] == ["ch07", "ch08"]
    assert rows[1]["command"] == " ".join(["looped-kv", *words, "--chapters", "ch07", "ch08", "--resume"])
    before = out.read_text()
    assert main([*words, "--resume", "--profile", "smoke"]) == 2
    assert "records model 'tiny' at profile 'tiny', not 'tiny' at 'smoke'" in capsys.readouterr().err
    assert out.read_text() == before
    assert main(["plan-check", "--model", "tiny", "--device", "cpu", "--resume"]) == 2
    assert "--resume continues the record in --out, which must be an existing file" in capsys.readouterr().err


def test_the_recorded_cpu_run_at_parcae_140m_is_within_a_quarter_of_the_plan():
    """book/data's CPU run (random weights at parcae-140m's dimensions, its laptop profile, this repository's 2-core
    machine): every chapter it recorded peaked within 25% of the plan's host memory, and the command is the
    docstring's."""
    record = json.loads((ROOT / "book" / "data" / "plan-check-parcae-140m-cpu.json").read_text())
    assert (record["model"], record["profile"]) == ("parcae-140m", "parcae-140m-cpu")
    assert "--model parcae-140m --device cpu --out book/data/plan-check-parcae-140m-cpu.json" in plan_check.__doc__
    assert record["chapters"] and {"threads", "torch"} <= set(record["environment"])
    for row in record["chapters"]:
        assert row["chapter"] in plan_check.RUNS and row["seconds"] > 0 and row["commit"] and row["date"]
        assert row["command"].startswith("looped-kv plan-check --model parcae-140m --device cpu ")
        assert 0.75 <= row["predicted / measured"] <= 1.25, row


def test_plan_check_runs_an_ouro_config_on_the_cpu_at_a_small_profile(tmp_path, capsys):
    """The GPU check of the T4 profiles (the commands of looped_kv.experiments.plan_check's docstring) runs on a CPU
    with a fixture-sized Ouro config (its context raised for the smoke profile's prompts) and the smoke profile."""
    config = json.loads((ROOT / "tests" / "fixtures" / "ouro-tiny" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    out = tmp_path / "check.json"
    assert main(["plan-check", "--model", str(tmp_path), "--profile", "smoke", "--device", "cpu", "--chapters",
                 "ch07", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    (row,) = record["chapters"]
    assert record["profile"] == "smoke" and 0.5 < row["predicted / measured"] < 2
    assert {"ouro-1.4b-t4", "raven-tinyllama-t4"} <= set(profiles.PROFILES)
    commands = re.findall(r"looped-kv plan-check (--model \S+ --profile \S+)", plan_check.__doc__)
    assert len(commands) == 2
    for command in commands:
        model, profile = command.split()[1::2]
        assert model in profiles.MODELS and profiles.PROFILES[profile].name == profile


def test_huginn_fits_a_40gb_gpu_and_not_a_16gb_one(capsys):
    assert main(["plan", "--model", "huginn-0125", "--gpu-memory", "40"]) == 0
    out = capsys.readouterr().out
    assert out.count(" yes ") == 8 and " NO " not in out
    assert main(["plan", "--model", "huginn-0125", "--gpu-memory", "16"]) == 1  # a Colab T4: refused, by chapter
    assert "ch02, ch03, ch04, ch07 need more than 16 GB" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["ouro-1.4b", "raven-tinyllama"])
def test_ouro_and_raven_tinyllama_fit_a_16gb_t4(model, capsys):
    """A free Colab T4: every chapter fits, at the model's T4 profile (float16)."""
    assert main(["plan", "--model", model, "--gpu-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert f"at profile {model}-t4 (float16;" in out and out.count(" yes ") == 8 and " NO " not in out


def test_huginn_on_a_24gb_l4_names_each_step_that_does_not_fit(capsys):
    """Huginn-0125's reduced L4 profile fits every chapter but chapter 4, whose replays hold a float32 copy of the
    weights beside full caches of 1,536-token prompts; the plan names each step that does not fit."""
    assert main(["plan", "--model", "huginn-0125", "--gpu-memory", "24"]) == 1
    out = capsys.readouterr().out
    assert "at profile huginn-0125-l4" in out and out.count(" yes ") == 7
    assert "  does not fit: ch04, replay through the float32 arm (the precision floor), 1 at a time: " in out
    assert "ch04 need more than 24 GB" in out


def test_a_cpu_profile_is_planned_against_host_memory(capsys):
    """looped-kv plan at a CPU profile sizes the profile's own model on a CPU: one column of every byte a chapter
    holds (weights included), against --host-memory (default a 16 GB laptop), not a GPU's."""
    assert main(["plan", "--profile", "parcae-140m-cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("parcae-140m at profile parcae-140m-cpu (float32;") and "on a CPU with 16 GB:" in out
    assert "GPU GB" not in out and out.count(" yes ") == 8
    config, profile = PRESETS["parcae-140m"](), profiles.ON_CPU["parcae-140m"]
    ch04 = max(s.bytes(None) for s in plan.CHAPTERS["ch04"](config, profile).steps) / 1e9
    assert re.search(rf"^ch04 +{ch04:.1f} +yes", out, re.M)
    assert main(["plan", "--model", "parcae-140m", "--device", "cpu", "--host-memory", "4"]) == 1
    out = capsys.readouterr().out
    assert "at profile parcae-140m-cpu" in out and "  does not fit: ch04, " in out and "need more than 4 GB" in out
    assert main(["plan", "--profile", "parcae-140m-cpu", "--host-memory", "4", "--markdown"]) == 1  # as Markdown
    out = capsys.readouterr().out
    assert "| chapter | GB | fits | peak at | sizes |\n| --- | ---: | --- | --- | --- |\n" in out
    assert re.search(rf"^\| ch04 \| {ch04:.1f} \| no \| ", out, re.M) and "* ch04, " in out
    assert main(["plan", "--host-memory", "-2"]) == 2
    assert "--host-memory must be > 0" in capsys.readouterr().err


def test_plan_reads_a_config_folder_and_checks_its_options(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(huginn_0125().to_hf_dict()))
    assert main(["plan", "--model", str(tmp_path), "--profile", "huginn-0125"]) == 0
    assert main(["plan", "--model", "tiny"]) == 0
    assert "at profile tiny" in capsys.readouterr().out
    assert main(["plan", "--gpu-memory", "-1"]) == 2
    assert "--gpu-memory must be > 0" in capsys.readouterr().err
    assert main(["plan", "--profile", "t4"]) == 2
    assert "--profile must be one of" in capsys.readouterr().err
    assert main(["plan", "--card", "v100"]) == 2
    assert "--card must be one of ('t4', 'l4', '40gb', '80gb')" in capsys.readouterr().err


def test_prompt_bounds_hold():
    """The plan charges every prompt ``prompt_tokens`` tokens. A real checkpoint's profile decodes GSM8K and MBPP,
    whose prompts ``looped_kv.workloads.encode`` holds to that bound when the chapter tokenizes them
    (tests/test_workloads.py), and generated chain programs, bounded here: they are ASCII, a token of a real
    checkpoint's tokenizer covers at least one character, and one more token may open the text. The tiny model's
    generated prompts are checked with its own tokenizer."""
    from looped_kv import load, workloads
    from looped_kv.workloads import data

    longest = max(len(t) for split in ("eval", "dev") for t in data.prompts("chains", 64, split))
    for profile in (p for p in profiles.PROFILES.values() if p.workloads == "papers"):
        assert longest + 1 <= profile.prompt_tokens, profile.name
        chains = data.chain_programs(profile.ch01.chain_programs, split="eval")
        assert max(len(p.text) for p in chains) + 1 <= profile.ch01.chain_tokens, profile.name
    tiny = load("tiny")
    for split in ("eval", "dev"):
        for worked in (False, True):
            for w in data.WORKLOADS:
                workloads.prompt_ids(tiny, profiles.TINY, w, 64, split, worked=worked)  # raises beyond the bound


PLAN_TABLES = ["huginn-0125-40gb", "raven-llama-40gb", "raven-olmo-40gb", "huginn-0125-16gb", "ouro-1.4b-16gb",
               "raven-tinyllama-16gb", "huginn-0125-24gb"]


@pytest.mark.parametrize("name", PLAN_TABLES)
def test_the_gpu_pages_tables_are_the_plans(name, capsys):
    """book/gpu.md includes these tables; each is what ``looped-kv plan --markdown`` prints today."""
    model, memory = name.rsplit("-", 1)
    status = main(["plan", "--model", model, "--gpu-memory", memory.removesuffix("gb"), "--markdown"])
    assert status == (1 if name.startswith("huginn-0125") and memory != "40gb" else 0)
    path = ROOT / "book" / "data" / f"plan-{name}.md"
    assert capsys.readouterr().out == path.read_text(), f"regenerate {path.name} with looped-kv plan ... --markdown"


@pytest.mark.parametrize("card", sorted(profiles.CARDS))
def test_the_gpu_pages_card_tables_are_the_plans(card, capsys):
    """book/gpu.md's table per card (every model's profile there and its peak per chapter) is what ``looped-kv plan
    --card`` prints today; the models a T4 defaults to fit it."""
    assert main(["plan", "--card", card]) == 0
    path = ROOT / "book" / "data" / f"card-{card}.md"
    out = capsys.readouterr().out
    assert out == path.read_text(), f"regenerate {path.name} with looped-kv plan --card {card}"
    table = plan.card_table(card)
    assert table.loc["ouro-1.4b", "fits"] and table.loc["raven-tinyllama", "fits"]
    assert table.loc["ouro-1.4b", "profile"] == profiles.BY_CARD["ouro-1.4b"][card].name


def test_profiles_are_chosen_by_family_and_gpu(monkeypatch):
    """``for_model`` picks the model's profile for the GPU it finds (memory and bfloat16), LOOPED_KV_PROFILE wins."""
    from looped_kv.runtime.config import ouro_1_4b, raven_tinyllama

    monkeypatch.delenv("LOOPED_KV_PROFILE", raising=False)
    t4, l4, a100, h100 = (profiles.Gpu("Tesla T4", 15.83, False), profiles.Gpu("NVIDIA L4", 23.7, True),
                          profiles.Gpu("NVIDIA A100-SXM4-40GB", 42.4, True), profiles.Gpu("NVIDIA H100", 85.0, True))
    assert [g.card for g in (t4, l4, a100, h100)] == ["t4", "l4", "40gb", "80gb"]
    assert profiles.Gpu("Tesla V100-SXM2-32GB", 34.1, False).card == "t4"  # no bfloat16: the float16 profiles
    for config, model in ((ouro_1_4b(), "ouro-1.4b"), (raven_tinyllama(), "raven-tinyllama"),
                          (huginn_0125(), "huginn-0125")):
        chosen = {g.card: profiles.for_model(Namespace(config=config, source="x"), g) for g in (t4, l4, a100, h100)}
        assert chosen == {card: profiles.BY_CARD[model][card] for card in profiles.CARDS}
    assert profiles.for_model(Namespace(config=ouro_1_4b(), source="x"), t4).dtype == "float16"
    assert profiles.for_model(Namespace(config=ouro_1_4b(), source="x"), None) is profiles.BY_CARD["ouro-1.4b"]["40gb"]
    monkeypatch.setenv("LOOPED_KV_PROFILE", "raven-tinyllama-t4")
    assert profiles.for_model(Namespace(config=ouro_1_4b(), source="x"), h100).name == "raven-tinyllama-t4"
    monkeypatch.setenv("LOOPED_KV_PROFILE", "t4")
    with pytest.raises(ValueError, match="LOOPED_KV_PROFILE must be one of"):
        profiles.for_model(Namespace(config=ouro_1_4b(), source="x"), h100)


def test_the_gpu_is_detected(monkeypatch):
    """CUDA simulated: a T4 (compute capability 7.5, 15.8 GB) is found without native bfloat16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: Namespace(name="Tesla T4", total_memory=15_828_320_256))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 5))
    assert profiles.detect_gpu() == profiles.Gpu("Tesla T4", 15.828320256, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profiles.detect_gpu() is None


def test_every_profiles_draft_depths_lie_below_its_models_loops():
    """Draft depths and shallow loop counts below R for every profile of a published model (Ouro's R = 4 has no draft
    at 4 or 8 loops, DAS Table 6's), and for the smoke profile on the Ouro fixture's R = 4."""
    from looped_kv.runtime.config import PRESETS

    runs = [(p, PRESETS[model]().mean_recurrence) for model, cards in profiles.BY_CARD.items() for p in cards.values()]
    runs += [(p, PRESETS[model]().mean_recurrence) for model, p in profiles.ON_CPU.items()]
    for p, R in [*runs, (profiles.SMOKE, 4), (profiles.TINY, 32)]:
        depths = (*p.ch01.draft_depths, *p.ch05.draft_depths, p.ch01.shallow_loops, p.ch04.draft_loops,
                  p.ch05.draft_loops, p.ch07.draft_loops)
        assert all(1 <= d < R for d in depths), (p.name, R, depths)
    assert profiles.BY_CARD["ouro-1.4b"]["t4"].ch05.draft_depths == (1, 2, 3)


def test_parcae_has_a_profile_per_card_and_one_for_a_laptop_cpu(monkeypatch):
    """Issue 42: Parcae's four models get the GPU classes' profiles and a CPU profile, chosen where no GPU is found;
    the models with no CPU route keep their 40 GB profile there."""
    from looped_kv.runtime.config import PRESETS, ouro_1_4b

    monkeypatch.delenv("LOOPED_KV_PROFILE", raising=False)
    for model in ("parcae-140m", "parcae-370m", "parcae-770m", "parcae-1.3b"):
        assert set(profiles.BY_CARD[model]) == set(profiles.CARDS)
        config = PRESETS[model]()
        assert profiles.model_name(config) == model
        on_cpu = profiles.for_model(Namespace(config=config, source="x"), None)
        assert on_cpu is profiles.ON_CPU[model] and on_cpu.dtype == "float32" and on_cpu.name == f"{model}-cpu"
        assert on_cpu.ch01.loops == profiles.BY_CARD[model]["40gb"].ch01.loops  # its own loop counts (R = 8)
        assert max(on_cpu.ch01.loops) == 2 * config.mean_recurrence
    assert set(profiles.ON_CPU) == {m for m in profiles.BY_CARD if m.startswith("parcae-")}
    assert profiles.for_model(Namespace(config=ouro_1_4b(), source="x"), None) is profiles.BY_CARD["ouro-1.4b"]["40gb"]
    assert all(plan.card_table("t4").loc[m, "fits"] for m in profiles.ON_CPU)  # and every chapter fits a T4
    for model in ("parcae-140m", "parcae-370m"):  # and a laptop: every chapter's peak, host and device together
        config, on_cpu = PRESETS[model](), profiles.ON_CPU[model]
        peaks = {ch: max(s.bytes(None) for s in make(config, on_cpu).steps) for ch, make in plan.CHAPTERS.items()}
        assert max(peaks.values()) <= profiles.LAPTOP_GB * 1e9, (model, peaks)
