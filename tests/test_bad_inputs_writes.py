"""Bad inputs of issue 44: nothing overwritten, nothing non-finite passes, one line per error.

Every test here failed on the code before the issue (7878f08). The cases:

Nothing a user made is overwritten; every output probed before any work
  1. ``train --out`` on a folder holding a user's settings.json and tokenizer.json is refused, the files kept;
  2. ``train --export`` to an unwritable place, or into a user's folder, is refused before training;
  3. ``gpu-check --out`` an existing file is refused and the file kept;
  4. ``plan-check --out`` unwritable, or an existing file, is refused before the model is built;
  5. ``scout`` with an unwritable runs folder is refused before the copy and the training;
  6. ``gates`` records only into a model the trainer made.
Non-finite values caught at their source
  7. config.json fields no model can have: norm_eps / rms_norm_eps <= 0 or NaN, rope_theta <= 0, total_ut_steps <= 0,
     Ouro layer_types shorter than the layer count, a negative width, embed_scale <= 0, a negative state std, an
     exit threshold outside [0, 1];
  8. logits that are not finite stop decoding with one line naming the model and the pass;
  9. float options refuse inf and NaN (plan --gpu-memory, train --minutes, scout --minutes).
One line per error
  10. Ctrl-C while the CLI's modules load: one line, exit 130;
  11. an error no check foresaw is one line (the traceback with --debug);
  12. gates on a folder without a tokenizer; 13. a checkpoint with an integer norm tensor.
Verify checks what no honest run writes
  14. a KL below 0, or a file no run writes, listed in the manifest; 15. a zeroed package hash in frozen.json;
  16. a prediction's range rewritten in the archived spec with frozen.json's spec hash updated (frozen.json is not
      the table the run checked);
  17. a table frozen again keeps the first freeze's hash (``earlier``);
  18. the ledger refuses two archives of one frozen spec, with different records or the same.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import random_model
from test_bad_inputs import archive, checkpoint, forged, read_lines, run_cli, sha256, table, tiny_spec, write_lines

from looped_kv import generate, load
from looped_kv.cli import main
from looped_kv.decoding.loop import Observer
from looped_kv.experiments import gpu_check, plan_check
from looped_kv.protocol import batches
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.model import LoopedLM
from looped_kv.tiny import scout, train

torch.set_num_threads(1)
REPO = Path(__file__).parents[1]
__all__ = ["archive", "table"]  # module fixtures shared with test_bad_inputs


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work refuses to start: a check that comes after it fails the test."""
    def work(*args, **kwargs):
        raise AssertionError("the work started before the bad input was refused")

    for module, name in ((train, "run"), (gpu_check, "run"), (plan_check, "run"), (scout, "run"), (scout, "start")):
        monkeypatch.setattr(module, name, work)


def refused(argv: list[str], message: str, capsys) -> None:
    status, err = run_cli(argv, capsys)
    assert status == 2 and err.count("\n") == 1 and message in err, err


# -- nothing overwritten ----------------------------------------------------------------------------------------------


def test_train_refuses_a_users_folder_and_keeps_its_files(tmp_path, no_work, capsys):
    user = tmp_path / "user"
    user.mkdir()
    (user / "settings.json").write_text("mine")
    (user / "tokenizer.json").write_text("mine too")
    refused(["train", "--out", str(user), "--steps", "1"], f"--out {user} holds files this command did not make",
            capsys)
    assert (user / "settings.json").read_text() == "mine" and (user / "tokenizer.json").read_text() == "mine too"


@pytest.mark.parametrize("where", ["under a file", "user folder"])
def test_train_export_is_probed_before_training(tmp_path, no_work, capsys, where):
    (tmp_path / "file.txt").write_text("x")
    export = tmp_path / "file.txt" / "model" if where == "under a file" else tmp_path / "mine"
    if where == "user folder":
        export.mkdir()
        (export / "config.json").write_text("{}")
    message = "is not a folder" if where == "under a file" else "holds files this command did not make"
    refused(["train", "--out", str(tmp_path / "run"), "--export", str(export), "--steps", "1"], message, capsys)
    assert not (tmp_path / "run").exists()


def test_train_resume_in_its_own_folder_and_export_over_a_trained_model_still_run(tmp_path, monkeypatch, capsys):
    run, exported = tmp_path / "run", tmp_path / "model"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"")
    exported.mkdir()
    (exported / "config.json").write_text(json.dumps({"training": {"steps": 1}}))
    calls = []
    monkeypatch.setattr(train, "run", lambda *args, **kwargs: calls.append(args))
    assert main(["train", "--out", str(run), "--resume", "--export", str(exported)]) == 0 and len(calls) == 1


def test_gpu_check_keeps_an_existing_file(tmp_path, no_work, capsys):
    out = tmp_path / "gpu_check.json"
    out.write_text("mine")
    refused(["gpu-check", "--config", "huginn-0125", "--device", "cpu", "--out", str(out)],
            f"--out {out} exists and is left untouched", capsys)
    assert out.read_text() == "mine"


def test_bench_keeps_an_existing_record_and_probes_it_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """--record is checked before anything is loaded or timed: an existing file is left untouched unless --force, and
    a place it cannot be written is refused first."""
    from looped_kv.experiments import bench

    def work(*args, **kwargs):
        raise AssertionError("the bench started before --record was checked")

    monkeypatch.setattr(bench, "report", work)
    monkeypatch.setattr("looped_kv.cli._load", work)
    out = tmp_path / "bench.json"
    out.write_text("mine")
    refused(["bench", "--record", str(out)], f"--record {out} exists and is left untouched", capsys)
    assert out.read_text() == "mine"
    refused(["bench", "--record", str(tmp_path / "no" / "bench.json")], "does not exist or is not writable", capsys)
    with pytest.raises(AssertionError, match="the bench started"):  # --force: the check passes, the work starts
        main(["--debug", "bench", "--record", str(out), "--force"])


@pytest.mark.parametrize("where", ["proc", "file"])
def test_plan_check_out_is_probed_before_the_model_is_built(tmp_path, no_work, capsys, where):
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    out = Path("/proc/looped_kv_qa.json") if where == "proc" else tmp_path / "plan.json"
    if where == "file":
        out.write_text("mine")
    refused(["plan-check", "--model", "huginn-0125", "--device", "cpu", "--out", str(out)],
            "cannot write there" if where == "proc" else "exists and is left untouched", capsys)


def test_scout_probes_its_folder_before_the_copy_and_the_training(tmp_path, no_work, monkeypatch, capsys):
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setattr(scout, "RUNS", tmp_path / "file.txt" / "runs")
    refused(["scout", "multi", "--minutes", "1"], "is not a folder; run scout where", capsys)


def test_gates_record_only_into_a_model_the_trainer_made(tmp_path, capsys):
    folder = checkpoint(tmp_path / "ckpt")
    before = (folder / "config.json").read_text()
    refused(["gates", "--model", str(folder)], "its config.json has no training record", capsys)
    assert (folder / "config.json").read_text() == before


# -- non-finite values ----------------------------------------------------------------------------------------------


def ouro_config(**changes) -> dict:
    raw = random_model("ouro").config.to_hf_dict()
    return {**raw, **changes}


@pytest.mark.parametrize("raw, message", [
    ({"norm_eps": 0.0}, "config 'norm_eps' must be a finite number > 0, got 0.0"),
    ({"norm_eps": -1e-6}, "config 'norm_eps' must be a finite number > 0, got -1e-06"),
    ({"norm_eps": math.nan}, "config 'norm_eps' must be a finite number > 0, got nan"),
    ({"rope_base": -5.0}, "config 'rope_base' must be a finite number > 0, got -5.0"),
    ({"rope_theta": 0}, "config 'rope_theta' must be a finite number > 0, got 0"),
    ({"init_values": {"embed_scale": 0.0, "std": 0.1}}, "config 'embed_scale' must be a finite number > 0"),
    ({"init_values": {"embed_scale": 1.0, "std": -0.1}}, "config 'std' must be a finite number >= 0"),
    ({"mean_recurrence": 0}, "mean_recurrence must be >= 1, got 0"),
], ids=["eps 0", "eps < 0", "eps nan", "rope_base < 0", "rope_theta 0", "embed_scale 0", "std < 0",
        "mean_recurrence 0"])
def test_a_config_no_model_can_have_is_refused_naming_the_field(raw, message):
    config = random_model().config.to_hf_dict() | raw
    with pytest.raises(ValueError) as error:
        LoopedConfig.from_hf_dict(config)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("changes, message", [
    ({"rms_norm_eps": 0.0}, "config 'rms_norm_eps' must be a finite number > 0, got 0.0"),
    ({"rms_norm_eps": math.nan}, "config 'rms_norm_eps' must be a finite number > 0, got nan"),
    ({"total_ut_steps": 0}, "total_ut_steps (the loop count) must be >= 1, got 0"),
    ({"total_ut_steps": -3}, "total_ut_steps (the loop count) must be >= 1, got -3"),
    ({"rope_theta": -1.0}, "config 'rope_theta' must be a finite number > 0, got -1.0"),
    ({"layer_types": ["full_attention"]}, "layer_types must list one type per layer (num_hidden_layers 2)"),
    ({"early_exit_threshold": 1.5}, "config 'early_exit_threshold' must be a finite number in [0, 1], got 1.5"),
    ({"hidden_size": -64}, "hidden_size and num_attention_heads must be >= 1, got -64 and 4"),
], ids=["eps 0", "eps nan", "loops 0", "loops < 0", "rope_theta < 0", "layer_types short", "threshold", "width < 0"])
def test_an_ouro_config_no_model_can_have_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError) as error:
        LoopedConfig.from_hf_dict(ouro_config(**changes))
    assert message in str(error.value)


def test_a_config_with_eps_zero_fails_the_load_in_one_line(tmp_path, capsys):
    folder = checkpoint(tmp_path / "ckpt", edit_config=lambda config: config.update(norm_eps=0.0))
    with pytest.raises(ValueError, match=r"config\.json: config 'norm_eps' must be a finite number > 0, got 0\.0"):
        load(folder)
    refused(["generate", "--model", str(folder), "hi"], "config 'norm_eps' must be a finite number > 0", capsys)


@pytest.mark.parametrize("method", ["ar", "self-spec", "das-wave"])
def test_non_finite_logits_stop_decoding_naming_the_model_and_the_pass(method):
    model = random_model()
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(1e308)  # finite weights whose logits overflow float64
    with pytest.raises(ValueError, match=r"^model 'LoopedLM': the prefill gave NaN or infinite logits; no token"):
        generate(model, torch.tensor([[3, 1, 4]]), max_new_tokens=4, method=method)


class PoisonAfterPrefill(Observer):
    """Sets the final norm's weight to NaN once the prefill is done: every later pass's logits are NaN."""

    def __init__(self, model: LoopedLM) -> None:
        self.model = model

    def prefilled(self, view, logits) -> None:
        with torch.no_grad():
            self.model.transformer.ln_f.weight.fill_(float("nan"))


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("method", ["ar", "self-spec", "das-wave"])
def test_non_finite_logits_at_a_verification_stop_decoding_naming_the_pass(method, compile_, traced):
    """Eager passes check their verification's logits; compiled ones read a flag their graph computes."""
    model = random_model()
    with pytest.raises(ValueError, match=r"^model 'LoopedLM': the verification pass at position 3 gave NaN or "
                                         r"infinite logits; no token"):
        generate(model, torch.tensor([[3, 1, 4]]), max_new_tokens=4, method=method, compile=compile_,
                 observer=PoisonAfterPrefill(model))


@pytest.mark.parametrize("argv, flag", [
    (["plan", "--gpu-memory", "inf"], "--gpu-memory"), (["plan", "--gpu-memory", "nan"], "--gpu-memory"),
    (["train", "--out", "RUN", "--minutes", "inf"], "--minutes"), (["train", "--out", "RUN", "--lr", "1e999"], "--lr"),
    (["scout", "mix", "--minutes", "nan"], "--minutes"),
], ids=["gpu-memory inf", "gpu-memory nan", "train minutes", "train lr", "scout minutes"])
def test_float_options_refuse_inf_and_nan(argv, flag, tmp_path, no_work, capsys):
    argv = [str(tmp_path / "run") if word == "RUN" else word for word in argv]
    refused(argv, f"{flag} must be a finite number", capsys)


# -- one line ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delay_s", [0.5, 1.0, 2.0])
def test_ctrl_c_while_the_modules_load_is_one_line(delay_s):
    """At any point of torch's import: once it landed inside C++ and aborted the process (CI, 6 December)."""
    process = subprocess.Popen([sys.executable, "-m", "looped_kv.cli", "memory"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    time.sleep(delay_s)  # the imports take seconds
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (130, "looped-kv: interrupted\n")


def test_an_unforeseen_error_is_one_line_and_its_traceback_needs_debug(monkeypatch, capsys):
    import looped_kv.cli

    def broken(*args, **kwargs):
        raise TypeError("'NoneType' object is not callable\nsecond line")

    monkeypatch.setattr(looped_kv.cli, "memory_rows", broken)
    status, err = run_cli(["memory", "--model", "tiny"], capsys)
    assert status == 2 and err == ("looped-kv memory: error: TypeError: 'NoneType' object is not callable (run "
                                   "looped-kv --debug memory ... for the traceback)\n")
    with pytest.raises(TypeError):
        main(["--debug", "memory", "--model", "tiny"])


def test_gates_on_a_folder_without_a_tokenizer_is_one_line(tmp_path, capsys):
    folder = checkpoint(tmp_path / "ckpt")
    refused(["gates", "--model", str(folder), "--no-record"], "has no tokenizer", capsys)


def test_an_integer_norm_tensor_is_one_line_naming_it(tmp_path, capsys):
    def integer_norm(state: dict[str, torch.Tensor]) -> None:
        state["transformer.ln_f.weight"] = torch.ones_like(state["transformer.ln_f.weight"], dtype=torch.int64)

    folder = checkpoint(tmp_path / "ckpt", integer_norm)
    with pytest.raises(ValueError, match=r"tensor 'transformer\.ln_f\.weight' has dtype int64 in the checkpoint; "
                                         r"a model's weights are floating-point"):
        load(folder)
    refused(["generate", "--model", str(folder), "hi"], "has dtype int64", capsys)


# -- verify -----------------------------------------------------------------------------------------------------------


def negative_kl(copy: Path) -> None:
    records = read_lines(copy / "records/positions.jsonl")
    records[0]["kl"] = -0.5
    write_lines(copy / "records/positions.jsonl", records)


def zeroed_package_hash(copy: Path) -> None:
    frozen = json.loads((copy / "frozen.json").read_text())
    key = next(k for k in frozen["files"] if k.startswith("package/"))
    frozen["files"][key] = "0" * 64
    (copy / "frozen.json").write_text(json.dumps(frozen, indent=1) + "\n")


def rewritten_prediction(copy: Path) -> None:
    """The archived spec's threshold changed (the rule's range), frozen.json's spec hash updated to match."""
    frozen = json.loads((copy / "frozen.json").read_text())
    spec = copy / "spec" / frozen["spec_file"]
    text = yaml.safe_load(spec.read_text())
    text["decision_rules"][0]["threshold"] = 0.01
    spec.write_text(yaml.safe_dump(text, sort_keys=False))
    frozen["files"][f"spec/{frozen['spec_file']}"] = sha256(spec)
    (copy / "frozen.json").write_text(json.dumps(frozen, indent=1) + "\n")


@pytest.mark.parametrize("edit, problem", [
    (negative_kl, "records/positions.jsonl line 1 kl = -0.5 is not a KL: a finite number >= 0"),
    (lambda copy: (copy / "notes.txt").write_text("x"), "the archive holds files no run writes: notes.txt"),
    (zeroed_package_hash, "frozen.json's package hashes match no file table the run checked"),
    (rewritten_prediction, "the pre-registration changed after the run"),
], ids=["negative KL", "file no run writes", "zeroed package hash", "prediction rewritten"])
def test_verify_fails_what_no_honest_run_writes(archive, tmp_path, edit, problem):
    problems = batches.verify(forged(archive, tmp_path, edit))
    assert any(problem in p for p in problems), problems


def test_a_table_frozen_again_keeps_the_first_freeze(tmp_path):
    path = tiny_spec(tmp_path / "spec")
    first = batches.freeze(path, tmp_path / "t.json")
    digest = sha256(first)
    again = batches.freeze(path, tmp_path / "t.json", force=True)
    assert json.loads(again.read_text())["earlier"] == [digest]


def test_the_ledger_counts_one_frozen_spec_once(archive, tmp_path):
    def flips(copy: Path) -> None:
        write_lines(copy / "records/positions.jsonl",
                    [{**r, "flip": not r["flip"]} for r in read_lines(copy / "records/positions.jsonl")])

    edited = forged(archive, tmp_path, flips)
    with pytest.raises(ValueError, match=r"ran one frozen spec \(batch b\) with different records"):
        batches.ledger([archive, edited])
    replica = tmp_path / "replica"
    shutil.copytree(archive, replica)
    run = json.loads((replica / "run.json").read_text())
    (replica / "run.json").write_text(json.dumps({**run, "pid": run["pid"] + 1}))
    forged(replica, tmp_path / "r", lambda copy: None)
    with pytest.raises(ValueError, match="with the same records"):
        batches.ledger([archive, tmp_path / "r" / "forged"])
