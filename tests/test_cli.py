"""The looped-kv command: complete --help on each command, one-line errors, and each command on a small model."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_batches import model_source, small_spec  # noqa: F401  (model_source is a fixture)

import looped_kv.cli
from looped_kv.cli import main
from looped_kv.decoding.settings import Greedy, MatureSpec, PromptLookup
from looped_kv.experiments import bench
from looped_kv.protocol import batches
from looped_kv.runtime.config import huginn_0125
from looped_kv.runtime.memory import m_full, m_ripe

torch.set_num_threads(1)  # small models: more threads only add contention
HELP = {
    (): ["generate", "bench", "batched", "memory", "batch", "speed", "gpu-check", "plan-check", "train", "select",
         "gates", "scout", "verdicts"],
    ("generate",): ["--method", "--cache", "--window", "--draft-loops", "--gamma", "--max-width", "--prefix-reads",
                    "--inexact", "--max-new-tokens", "--json", "--model", "--dtype", "--device", "--threads"],
    ("bench",): ["--workloads", "--prompts", "--max-new-tokens", "--methods", "--draft-loops", "--gamma", "--model",
                 "--repeats", "--quiet", "--deep-v", "Mature-Spec beats self-speculation"],
    ("batched",): ["looped-kv batched", "--batch-sizes", "--max-new-tokens", "--draft-loops", "--gamma", "--budget-mb",
                   "--memory-batch-sizes", "--fit-on", "--device"],
    ("memory",): ["--model", "--context", "--dtype", "--num-loops", "--windows", "--batch-size"],
    ("batch",): ["freeze", "run", "verify", "compare", "ledger"],
    ("batch", "freeze"): ["spec", "--out", "--force", "regions", "windows"],
    ("batch", "run"): ["table", "--out", "--device", "--threads", "--quiet", "torchrun", "OMP_NUM_THREADS",
                       "--key-file"],
    ("batch", "verify"): ["archives", "MANIFEST.sha256", "--key-file", "unkeyed manifest"],
    ("batch", "compare"): ["first", "second", "torchrun", "identical", "largest", "Exit status"],
    ("batch", "ledger"): ["archives", "Appendix B", "--key-file"],
    ("speed",): ["--reference", "--prompt", "--new-tokens", "--num-loops", "--layers", "--rounds", "--batch-sizes",
                 "--methods", "--workload", "--layout-tokens", "--no-compile", "--threads", "generate_minimal",
                 "recurrent-pretraining"],
    ("gpu-check",): ["--config", "--device", "--batch-sizes", "--prompt-tokens", "--new-tokens", "--draft-loops",
                     "--repeats", "--out", "random bf16 weights"],
    ("plan-check",): ["--model", "--profile", "--device", "--chapters", "--out", "peak memory recorded"],
    ("train",): ["--out", "--resume", "--export", "--mix", "--layers", "PRELUDE CORE CODA", "--chains", "--threads",
                 "--checkpoint-every", "Huginn's recipe"],
    ("gates",): ["--model", "--no-record", "more loops answer better"],
    ("scout",): ["recipe", "one-chain", "--minutes", "--list", "earns_long_run"],
}


@pytest.mark.parametrize("command", list(HELP), ids=lambda c: " ".join(c) or "looped-kv")
def test_help_is_complete(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for word in HELP[command]:
        assert word in out, (command, word)


@pytest.mark.parametrize("command", list(HELP), ids=lambda c: " ".join(c) or "looped-kv")
def test_help_is_plain_text(command, capsys):
    """--help shows no reST markup (double backticks, :func: roles)."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and ":mod:" not in out


def test_python_m_looped_kv_cli_is_the_command(monkeypatch, capsys):
    """`python -m looped_kv.cli speed --help` is `looped-kv speed --help`."""
    with pytest.raises(SystemExit):
        main(["speed", "--help"])
    expected = capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["looped_kv.cli", "speed", "--help"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        runpy.run_module("looped_kv.cli", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0 and capsys.readouterr().out == expected


def test_only_the_cli_parses_command_lines():
    """Every option of every script is defined and checked in looped_kv.cli; the modules take plain parameters."""
    package = Path(looped_kv.cli.__file__).parent
    parsing = [str(p.relative_to(package)) for p in package.rglob("*.py")
               if p.name != "cli.py" and re.search(r"^\s*(import|from) argparse", p.read_text(), re.MULTILINE)]
    assert parsing == []


def test_train_and_scout_pass_their_settings_on(tmp_path, monkeypatch):
    """`train --resume` names the resumable options given again and records the module's command line; `scout`
    parses its recipe's training options (no training here: train.run and scout.run are replaced)."""
    from looped_kv.tiny import scout, train

    calls = []
    monkeypatch.setattr(train, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(scout, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    words = ["--out", str(tmp_path), "--resume", "--threads", "2", "--mix", "0", "0", "1"]
    assert main(["train", *words]) == 0
    (options,), kwargs = calls.pop()
    assert isinstance(options, train.Options) and options.out == tmp_path and options.threads == 2
    assert kwargs == {"given": ["threads", "mix"], "command": " ".join(["looped-kv train", *words])}
    monkeypatch.chdir(tmp_path)
    assert main(["scout", "three-chains", "--minutes", "5"]) == 0
    (recipe, options), kwargs = calls.pop()
    assert recipe == "three-chains" and options.chains == 3 and options.minutes == 5 and options.threads == 1
    assert options.out == Path("runs/scout/three-chains") and kwargs["command"].startswith("looped-kv train ")


def test_an_unknown_model_name_fails_at_once_when_the_hub_is_unreachable(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.hf_hub_download",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("the hub was asked")))
    assert looped_kv.cli.main(["memory", "--model", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert "--model 'nonsense' is not one of" in err and "HF_HUB_OFFLINE" in err and len(err.splitlines()) == 1


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "looped-kv"  # the environment's own script, activated or not
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage: looped-kv" in result.stdout


def test_a_closed_pipe_stops_the_cli_quietly():
    """`looped-kv plan | head`: the reader may close the pipe before the CLI writes (`true` reads nothing and exits
    at once, long before the CLI has imported torch); no error is printed."""
    script = Path(sys.executable).parent / "looped-kv"
    shell = f"'{script}' plan --model huginn-0125 | true; echo \"status ${{PIPESTATUS[0]}}\""
    result = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120)
    assert result.stderr == "" and result.stdout.strip() == "status 141"


@pytest.mark.parametrize("argv, message", [
    (["memory", "--context", "0"], "--context must be >= 1, got 0"),
    (["memory", "--context", "1024", "-5"], "--context must be >= 1, got -5"),
    (["memory", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["memory", "--windows", "-1"], "--windows must be >= 0, got -1"),
    (["memory", "--model", "tiny", "--dtype", "int3"], "argument --dtype: invalid choice"),
    (["generate", "--method", "beam", "hi"], "argument --method: invalid choice"),
    (["batch", "freeze", "no-such-spec"], "no spec file 'no-such-spec'; shipped examples: ['regions', 'windows']"),
    (["batch", "run", "missing.frozen.json", "--out", "x"], "no file table missing.frozen.json"),
    (["batch", "verify", "."], "is not a batch archive"),
    (["batch"], "the following arguments are required"),
    (["memory", "--num-loops", "0"], "--num-loops must be >= 1, got 0"),
    (["generate", "--num-loops", "0", "hi"], "--num-loops must be >= 1, got 0"),
    (["generate", "--device", "foo", "hi"], "--device 'foo' is not a torch device name; available here: cpu"),
    (["bench", "--device", "cuda:99"], "--device 'cuda:99'"),
    (["bench", "--prompts", "1"], "--prompts must be >= 2 (paired intervals need two prompts), got 1"),
    (["bench", "--gamma", "0"], "--gamma must be >= 1, got 0"),
    (["bench", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["bench", "--methods", "greedy"], "argument --methods: invalid choice: 'greedy'"),
    (["bench", "--model", "./no-such-folder"], "--model './no-such-folder'"),
    (["bench", "--sampling-overhead", "--deep-v"], "--caches and --deep-v add arms to the speed bench, not to "
                                                   "--sampling-overhead"),
    (["bench", "--batch", "4"], "--batch times --caches against the full cache: give it --caches"),
    (["bench", "--batch", "4", "--caches", "ripe", "--deep-v"], "without --sampling-overhead or --deep-v"),
    (["bench", "--batch", "9", "--caches", "ripe", "--prompts", "16"], "--batch must be in [1, 8] (at least 2 sets "
                                                                      "of --prompts 16 for a paired interval), got 9"),
    pytest.param(["generate", "--device", "cuda", "hi"], "--device 'cuda': no cuda device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
    (["batched", "--fit-on", "1", "9"], "--fit-on must name at least 2 distinct values of --memory-batch-sizes"),
    (["batched", "--draft-loops", "99"], r"--draft-loops must be in [1, 31]"),
    (["batched", "--budget-mb", "-1"], "--budget-mb must be > 0"),
    (["speed", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["speed", "--layers", "1", "0", "1"], "--layers needs PRELUDE >= 0, CORE >= 1, CODA >= 0, got [1, 0, 1]"),
    (["speed", "--batch-sizes", "0"], "--batch-sizes must all be >= 1, got [0]"),
    (["speed", "--layout-tokens", "2", "0"], "--layout-tokens must all be >= 1, got [2, 0]"),
    (["speed", "--prompt", "1000", "--new-tokens", "1", "--layout-tokens", "25"],
     "--prompt + the largest --layout-tokens must be <= 1024, got 1025"),
    (["speed", "--methods", "self-spec"], "--methods must include ar"),
    (["speed", "--reference", "no-such-checkout"], "--reference no-such-checkout is not a folder"),
    (["speed", "--prompt", "1000"], "--prompt + --new-tokens must be <= 1024, got 1064"),
    (["gpu-check", "--config", "tiny", "--device", "cpu", "--batch-sizes", "1", "2"], "at least 3 distinct sizes"),
    (["gpu-check", "--config", "huginn"], "argument --config: invalid choice: 'huginn'"),
    (["plan-check", "--chapters", "ch09"], "--chapters must be among ('ch01', "),
    (["plan-check", "--model", "huginn"], "--model must be one of ("),
    (["train"], "the following arguments are required: --out"),
    (["train", "--out", "run", "--vocab", "100"], "--vocab must be >= 257"),
    (["train", "--out", "run", "--layers", "1", "1", "-1"], "--layers needs PRELUDE >= 0, CORE >= 1, CODA >= 0, got "
                                                             "[1, 1, -1]"),
    (["train", "--out", "run", "--mix", "0.5", "0.5", "0.5"], "--mix must be three fractions >= 0 that sum to 1"),
    (["train", "--out", "run", "--resume"], "--resume needs run/checkpoint.pt, which does not exist"),
    (["gates", "--model", "no-such-folder", "--no-record"], "--model 'no-such-folder': not a checkpoint folder"),
    (["scout", "two-chains"], "argument recipe: invalid choice: 'two-chains' (choose from 'chars', "),
])
def test_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code != 0 and message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("looped-kv")


def test_memory_prints_the_memory_model(capsys):
    assert main(["memory", "--model", "huginn-0125", "--context", "1024", "--windows", "64"]) == 0
    out = capsys.readouterr().out
    config = huginn_0125()
    assert f"{m_full(config, 1024) / 1e9:.3f}" in out and f"{m_ripe(config, 1024, 64) / 1e9:.3f}" in out
    assert "3.565B parameters" in out


def test_memory_prints_the_plane_bytes_of_raven_olmo(capsys):
    assert main(["memory", "--model", "raven-olmo", "--windows", "64"]) == 0
    out = capsys.readouterr().out
    assert "R = 32, 4/6/4 layers, 16 KV heads of width 128" in out
    assert "KV bytes per token: 8,192 per layer (b = 2 H_kv d_h x 2), one plane 49,152 (6 core layers), " \
           "full cache 1,638,400, deepest plane 114,688" in out


@pytest.mark.parametrize("model, line", [
    ("ouro-1.4b", "KV bytes per token: 8,192 per layer (b = 2 H_kv d_h x 2), one plane 196,608 (24 core layers), "
                  "full cache 786,432, deepest plane 196,608"),
    ("ouro-2.6b", "one plane 393,216 (48 core layers), full cache 1,572,864, deepest plane 393,216"),
    ("raven-tinyllama", "KV bytes per token: 1,024 per layer (b = 2 H_kv d_h x 2), one plane 8,192 (8 core layers), "
                        "full cache 270,336, deepest plane 16,384"),
])
def test_memory_of_ouro_and_raven_tinyllama(capsys, model, line):
    """Eq. (3) per token (tests/test_cache.py derives these bytes); Ouro has no prelude or coda, R = 4."""
    assert main(["memory", "--model", model, "--windows", "64"]) == 0
    out = capsys.readouterr().out
    assert line in out
    assert ("R = 4, 0/" if model.startswith("ouro") else "R = 32, 4/8/4") in out


def test_memory_num_loops_is_used(capsys):
    assert main(["memory", "--model", "huginn-0125", "--num-loops", "3", "--windows", "64"]) == 0
    assert "R = 3," in capsys.readouterr().out


def test_batched_forwards_to_the_batched_benchmark(capsys):
    assert main(["batched", "--prompts", "1", "--batch-sizes", "1", "--max-new-tokens", "2", "--num-loops", "2",
                 "--draft-loops", "1", "--gamma", "1", "--budget-mb", "0", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "R = 2, d = 1, gamma = 1" in out
    for series in ("ar        full", "ar        deepest", "self-spec full", "self-spec deepest"):
        assert series in out


def test_generate_text_in_text_out(model_source, capsys):  # noqa: F811
    prompt = "Question: Ava has 3 apples. She buys 2 bags with 4 apples in each bag. How many apples?\nAnswer:"
    assert main(["generate", "--model", model_source, "--method", "self-spec", "--cache", "ripe", "--window", "4",
                 "--gamma", "4", "--max-new-tokens", "8", "--json", prompt]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == prompt and out["stats"]["new_tokens"] == 8 and out["stats"]["cache"] == "ripe(4)"
    assert main(["generate", "--model", model_source, "--max-new-tokens", "4", prompt]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tokens_per_s=" in captured.err
    assert main(["generate", "--model", model_source, "--method", "self-spec", "--cache", "ripe", "--window", "2",
                 "--gamma", "4", prompt]) == 2
    assert "RIPE Proposition 1" in capsys.readouterr().err


def _strict_json(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not standard JSON")

    return json.loads(text, parse_constant=refuse)


def test_generate_compiles_runs_past_end_of_text_and_prints_standard_json(traced, capsys):
    """--compile is generate's compile=True (its tokens are the eager ones in float64), --no-stop-at-eos decodes the
    whole budget past end-of-text, --json prints a statistic the method has not (greedy decoding's tau) as null, and
    an option refused with --compile is refused before the model loads."""
    prompt = "Question: Ava has 3 apples. She buys 2 bags with 4 apples in each bag. How many apples?\nAnswer:"
    words = ["generate", "--model", "tiny", "--dtype", "float64", "--max-new-tokens", "40", "--json"]
    outputs, traced_graphs = [], []
    for extra in ([], ["--no-stop-at-eos"], ["--compile"], ["--compile", "--method", "mature-spec", "--num-loops",
                                                           "8", "--draft-loops", "2"],
                  ["--method", "mature-spec", "--num-loops", "8", "--draft-loops", "2"]):
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert main([*words, *extra, prompt]) == 0
        outputs.append(_strict_json(capsys.readouterr().out))
        traced_graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    stopped, whole, compiled, compiled_spec, eager_spec = outputs
    assert traced_graphs[0] == traced_graphs[1] == traced_graphs[4] == 0 and min(traced_graphs[2:4]) > 0
    assert stopped["completion"].endswith("<|endoftext|>") and stopped["stats"]["new_tokens"] < 40
    assert whole["stats"]["new_tokens"] == 40 and whole["completion"].startswith(stopped["completion"])
    assert len(whole["completion"]) > len(stopped["completion"])
    assert compiled["completion"] == stopped["completion"] and stopped["stats"]["tau"] is None
    assert compiled_spec["completion"] == eager_spec["completion"] and compiled_spec["stats"]["tau"] > 1
    assert main(["generate", "--model", "no-such-folder", "--exit", "kl", "--compile", prompt]) == 2
    assert capsys.readouterr().err == ("looped-kv generate: error: compile=True runs no early exit (exit='kl' runs "
                                       "eager): use compile=False\n")


def test_generate_samples_with_a_seed(model_source, capsys):  # noqa: F811
    """--temperature, --top-k/-p, --min-p and --seed reach every method: one seed, one completion."""
    words = ["generate", "--model", model_source, "--method", "das-wave", "--max-width", "4", "--rounds", "2",
             "--max-new-tokens", "8", "--temperature", "1.5", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01",
             "--json", "Question: Ava has 3 apples."]
    completions = []
    for seed in ("1", "1", "2"):
        assert main([*words, "--seed", seed]) == 0
        completions.append(json.loads(capsys.readouterr().out)["completion"])
    assert completions[0] == completions[1] != completions[2]
    assert main([*words[:-2], "--top-p", "0", words[-1]]) == 2
    assert "top_p must be a number in (0, 1] or None, got 0\n" in capsys.readouterr().err


def test_bench_prints_speedups_ceilings_and_the_mature_spec_verdicts(model_source, capsys):  # noqa: F811
    assert main(["bench", "--model", model_source, "--workloads", "problems", "--prompts", "2", "--max-new-tokens",
                 "4", "--methods", "ar", "self-spec", "mature-spec", "--deep-v", "--quiet", "--modes", "eager"]) == 0
    out = capsys.readouterr().out
    for text in ("speed-up", "of ceiling", "greedy", "self-spec", "Mature-Spec", "self-spec, deep V", "2/2", "tau <= 5",
                 "Mature-Spec beats self-speculation, acceptance: inconclusive", "too few units (2 prompts",
                 "Mature-Spec beats self-speculation, speed: "):
        assert text in out, text


def test_bench_batch_prints_and_records_each_cache_against_the_full_cache(model_source, tmp_path, capsys):  # noqa: F811
    record = tmp_path / "batched.json"
    words = ["bench", "--model", model_source, "--workloads", "problems", "--prompts", "4", "--max-new-tokens", "3",
             "--batch", "2", "--caches", "ripe", "--repeats", "1", "--modes", "eager", "--quiet",
             "--record", str(record)]
    assert main(words) == 0
    out = capsys.readouterr().out
    assert "problems: greedy decoding of 2 prompts together under each cache against the full cache, 2 sets" in out
    assert "greedy, ripe(8) eager" in out and f"recorded in {record}" in out
    header, runs = bench.read_record(record, model_source)
    assert header["command"] == "looped-kv " + " ".join(words)
    assert set(runs["problems"]["cache"]) == {"full", "greedy, ripe(8)"} and len(runs["problems"]) == 4
    assert main(words) == 2  # a record is never overwritten without --force
    assert f"--record {record} exists" in capsys.readouterr().err


def test_batch_commands_end_to_end(model_source, tmp_path, capsys):  # noqa: F811
    spec = small_spec(tmp_path / "spec", model_source)
    table = tmp_path / "small.frozen.json"
    assert main(["batch", "freeze", str(spec), "-o", str(table)]) == 0
    assert "froze batch t" in capsys.readouterr().out
    assert main(["batch", "freeze", str(spec), "-o", str(table)]) == 2  # no silent re-freeze
    capsys.readouterr()
    assert main(["batch", "run", str(table), "--out", str(tmp_path / "a"), "--threads", "2"]) == 2
    assert capsys.readouterr().err == ("looped-kv batch: error: --threads 2 contradicts the frozen spec's threads: 1 "
                                       "(the count changes the records' bytes); allowed: 1, or leave --threads out\n")
    assert main(["batch", "run", str(table), "--out", str(tmp_path / "a"), "--quiet", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "rule regions:" in out and "2 predictions:" in out
    assert main(["batch", "verify", str(tmp_path / "a")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(["batch", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "identical byte for byte" in capsys.readouterr().out
    (tmp_path / "a" / "summary.json").write_text("{}")
    assert main(["batch", "verify", str(tmp_path / "a")]) == 1
    assert "FAILED: checksum mismatch: summary.json" in capsys.readouterr().out
    assert main(["batch", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("1 differ: summary.json") and lines[1].startswith("  summary.json batch: 1 of 1 differ")
    assert main(["batch", "compare", str(tmp_path / "a"), str(tmp_path)]) == 2
    assert main(["batch", "ledger", str(tmp_path / "a")]) == 2
    assert batches.verify(tmp_path / "a")


def test_generate_takes_every_option_of_every_method_from_its_flags():
    """A method option added to the settings dataclasses needs a flag of its name, or a place in GENERATE_SET_APART:
    the command builds generate()'s options from the dataclass fields."""
    from looped_kv.decoding.settings import every_option

    args = looped_kv.cli.parser().parse_args(["generate", "hi", "--rounds", "3", "--top-k", "2"])
    options = looped_kv.cli.generate_options(args)
    assert set(options) == set(every_option()) - set(looped_kv.cli.GENERATE_SET_APART)
    assert (options["rounds"], options["top_k"], options["draft_loops"]) == (3, 2, None)


def test_generate_flags_and_their_help_come_from_the_settings():
    """Each method option's flag reads its type and choices from the settings field and prints settings.option_help:
    what it is, the methods that take it, and the method's own default."""
    from looped_kv.decoding import settings

    generate = next(a for a in looped_kv.cli.parser()._subparsers._group_actions[0].choices.items()
                    if a[0] == "generate")[1]
    flags = {a.dest: a for a in generate._actions}
    for name in set(settings.every_option()) - set(looped_kv.cli.GENERATE_SET_APART):
        assert flags[name].help == settings.option_help(name), name
        assert flags[name].choices == settings.CHOICES.get(name), name
    assert settings.option_help("ngram") == "n-gram length of prompt lookup (pld; default: 3)"
    assert settings.option_help("gamma").endswith(f"(self-spec, mature-spec, pld; default: {settings.SelfSpec.gamma})")
    assert "das-wave; default: 32" in settings.option_help("max_width")
    args = looped_kv.cli.parser().parse_args(["generate", "hi", "--exit", "argmax", "--exit-threshold", "5",
                                              "--temperature", "0.7", "--prefix-reads", "deep-v", "--seed", "3"])
    assert (args.exit_threshold, args.temperature, args.prefix_reads, args.seed) == (5, 0.7, "deep-v", 3)
    assert isinstance(args.exit_threshold, int)  # argmax's threshold is a loop count
    with pytest.raises(ValueError, match="name must be an option of some method"):
        settings.option_help("gama")


def test_the_speed_comparison_builds_its_checkpoint_with_the_layers_asked_for(capsys):
    """``looped-kv speed --layers 1 2 1`` times greedy decoding on a random checkpoint of those layer counts."""
    assert main(["speed", "--layers", "1", "2", "1", "--prompt", "8", "--new-tokens", "2", "--num-loops", "2",
                 "--rounds", "1", "--batch-sizes", "--methods", "--layout-tokens", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "(d = 128, 1/2/1 layers), R = 2, prompt 8, 2 new tokens" in out
    assert "the weights' layout" not in out  # no --layout-tokens: no layout section


def test_the_speed_comparison_times_the_weights_layouts_side_by_side(capsys):
    """``looped-kv speed --layout-tokens 1 3`` prints each width's pass, column-major against row-major, paired."""
    assert main(["speed", "--layers", "1", "1", "1", "--prompt", "8", "--new-tokens", "2", "--num-loops", "2",
                 "--rounds", "1", "--batch-sizes", "--methods", "--layout-tokens", "1", "3", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "after a 8-token prompt" in out and "row-major time / column-major time" in out
    assert re.search(r"g = 1 +column-major +[\d.]+ ms +row-major +[\d.]+ ms +[\d.]+x \(", out)
    assert re.search(r"g = 3 +column-major", out)


def test_the_reference_comparison_refuses_a_transformers_it_cannot_run_under():
    """The Huginn reference code calls a transformers 4 internal: under 5 the comparison stops in one line first."""
    from looped_kv.experiments import speed

    speed.check_transformers("4.57.6")
    with pytest.raises(ValueError, match=r"runs under transformers < 5 .* found transformers 5\.25\.0; run this"):
        speed.check_transformers("5.25.0")


def test_a_recorded_bench_command_gives_the_arms_it_timed():
    header, runs = bench.read_record()
    arms = looped_kv.cli.bench_arms_of(header["command"], 32)
    assert list(arms) == list(runs["code"]["method"].unique())  # every arm the runs hold, in their order
    assert arms["mature-spec"] == MatureSpec(draft_loops=4, gamma=8)  # --gamma 8, d = R // 8
    assert arms[bench.DEEP_V_SPEC].prefix_reads == "deep-v"
    line = "looped-kv bench --methods pld --gamma 3 --draft-loops 2 --caches ripe --record x.json"
    assert looped_kv.cli.bench_arms_of(line, 32) == {"ar": Greedy(), "pld": PromptLookup(gamma=3),
                                                     "greedy, ripe(8)": bench.CACHE_ARMS["ripe"]}
    with pytest.raises(ValueError, match="command must be a looped-kv bench line, got 'looped-kv pass-cost'"):
        looped_kv.cli.bench_arms_of("looped-kv pass-cost", 32)
