"""Pre-registered batches: spec validation, the frozen file table, decision rules, archives and their verification,
the shipped examples, the self-tests and the reproducibility helpers."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from looped_kv.protocol import batches, selftest
from looped_kv.protocol.reproducibility import bitwise_rerun
from looped_kv.runtime.loading import TINY_DIR
from looped_kv.runtime.measurement import measurement_mode

torch.set_num_threads(1)  # small models: more threads only add contention
EXAMPLES = batches.EXAMPLES_DIR
TINY = (TINY_DIR / "model.safetensors").exists()


def write_random_checkpoint(folder: Path) -> Path:
    """A small random looped model with a tokenizer, in the public checkpoint format (used when the tiny model is
    not trained yet)."""
    from safetensors.torch import save_file

    from looped_kv.runtime.config import LoopedConfig
    from looped_kv.runtime.model import LoopedLM
    from looped_kv.tiny.train import init_weights, train_tokenizer
    from looped_kv.workloads import data

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer([p.text for p in data.word_problems(100, "train")], 300)
    config = LoopedConfig(family="huginn", vocab_size=len(tokenizer), n_embd=32, n_heads=2, n_kv_heads=2, n_prelude=1,
                          n_core=1, n_coda=1, intermediate_size=64, block_size=512, qk_bias=True, rope_base=50000.0,
                          embed_scale=math.sqrt(32), state_std=math.sqrt(2 / 160), mean_recurrence=32)
    torch.manual_seed(0)
    model = LoopedLM(config)
    init_weights(model, config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_source(tmp_path_factory) -> str:
    """The shipped tiny model when it exists, else a random checkpoint folder."""
    return "tiny" if TINY else str(write_random_checkpoint(tmp_path_factory.mktemp("model")))


def small_spec(folder: Path, model: str, mode: str = "substitution", **overrides) -> Path:
    """A small batch spec (3 prompts) in ``folder``, with its prompt file."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = json.loads((EXAMPLES / "regions_texts.json").read_text())["texts"][:3]
    prompts = json.loads((EXAMPLES / "windows_prompts.json").read_text())["texts"][:3]
    (folder / "texts.json").write_text(json.dumps(texts if mode == "substitution" else prompts))
    spec = {"batch": "t", "name": "small", "question": "does it run?", "model": model, "num_loops": 32, "mode": mode,
            "prompts": [{"name": "set", "file": "texts.json"}]}
    if mode == "substitution":
        spec |= {"tokens": 24, "decoded": 4,
                 "arms": [{"name": "s1", "region": "shallow", "plane": 1}, {"name": "s32", "region": "shallow",
                                                                              "plane": 32},
                          {"name": "d1", "region": "deep", "plane": 1}, {"name": "d16", "region": "deep", "plane": 16}],
                 "metrics": ["kl_first", "size"],
                 "decision_rules": [{"name": "regions", "statistic": "region_coefficient", "threshold": 1,
                                     "n_boot": 200, "labels": {"above": "deep", "between": "same", "below": "shallow"}},
                                    {"name": "p1", "statistic": "ratio", "metric": "kl_first", "numerator": "d1",
                                     "denominator": "s1", "threshold": 1, "n_boot": 200,
                                     "labels": {"above": "deep", "between": "same", "below": "shallow"}}],
                 "predictions": [{"text": "deep KV matters", "rule": "regions", "label": "deep"},
                                 {"text": "plane 1 ratio in [0, 1]", "rule": "p1", "range": [0, 1]}]}
    else:
        spec |= {"max_new_tokens": 8, "dtype": "float32",
                 "arms": [{"name": "same", "cache": "full"}, {"name": "deepest", "cache": "deepest"},
                          {"name": "spec", "decoder": "self-spec", "cache": "ripe", "window": 4, "gamma": 3,
                           "draft_loops": 2}],
                 "metrics": ["kl_mean", "tail", "same_as_greedy", "tau"],
                 "decision_rules": [{"name": "exact", "statistic": "mean", "metric": "same_as_greedy", "arm": "spec",
                                     "threshold": 0.99, "n_boot": 200,
                                     "labels": {"above": "exact", "between": "not exact", "below": "not exact"}}],
                 "predictions": [{"text": "exact", "rule": "exact", "label": "exact"}]}
    spec |= overrides
    path = folder / "small.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def small_archive(tmp_path_factory, model_source) -> Path:
    root = tmp_path_factory.mktemp("small")
    table = batches.freeze(small_spec(root / "spec", model_source), root / "small.frozen.json")
    batches.run_batch(table, root / "archive", progress=False, threads=1)
    return root / "archive"


# -- spec validation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["regions", "windows"])
def test_shipped_examples_validate(name):
    spec = batches.load_spec(name)
    assert spec.model == "tiny" and spec.predictions and spec.rules and spec.threads == 1
    assert batches.resolve_spec(name) == EXAMPLES / f"{name}.yaml"


@pytest.mark.parametrize("change, message", [
    ({"mode": "replay"}, "spec.mode must be one of ('substitution', 'generation')"),
    ({"arms": [{"name": "x", "region": "shallow", "plane": 40}]}, "plane must be in 1..32"),
    ({"arms": [{"name": "x", "region": "middle", "plane": 4}]}, "region must be 'shallow', 'deep'"),
    ({"metrics": ["tau"]}, "'tau' is not measured by any arm"),
    ({"decoded": 30}, "spec.decoded must be in 1..tokens - 1"),
    ({"colour": "red"}, "unknown keys ['colour']"),
    ({"threads": 0}, "spec.threads must be >= 1, got 0"),
    ({"threads": "two"}, "spec.threads must be an integer, got 'two'"),
    ({"predictions": [{"text": "t", "rule": "regions", "label": "maybe"}]}, "is not a label of rule 'regions'"),
    ({"predictions": [{"text": "t", "rule": "nope", "label": "deep"}]}, "predictions[0].rule must be one of"),
])
def test_bad_substitution_spec_names_the_field(tmp_path, change, message):
    with pytest.raises(ValueError) as error:
        batches.load_spec(small_spec(tmp_path, "tiny", **change))
    assert message in str(error.value)


@pytest.mark.parametrize("arm, message", [
    ({"name": "x", "decoder": "self-spec", "cache": "ripe", "window": 2, "gamma": 4}, "RIPE Proposition 1"),
    ({"name": "x", "decoder": "beam"}, "decoder must be one of"),
    ({"name": "x", "cache": "ripe"}, "cache='ripe' needs window"),
    ({"name": "x", "precision": "int8"}, "precision must be one of"),
    ({"name": "x", "decoder": "pld", "draft_loops": 2}, "unknown keys ['draft_loops']"),
    ({"name": "x", "decoder": "das-wave", "gamma": 8}, "unknown keys ['gamma']"),
    ({"name": "x", "decoder": "das-wave", "max_width": "8"}, "max_width must be an int, got '8' (str)"),
    ({"name": "x", "decoder": "das-wave", "carry": "yes"}, "carry must be"),
    ({"name": "x", "decoder": "pld", "ngram": 0}, "ngram must be >= 1, got 0"),
    ({"name": "reference"}, "reserved"),
])
def test_bad_generation_arm_names_the_field(tmp_path, arm, message):
    path = small_spec(tmp_path, "tiny", "generation")
    spec = yaml.safe_load(path.read_text())
    spec["arms"].append(arm)
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match="arms\\[3\\]") as error:
        batches.load_spec(path)
    assert message in str(error.value)


def test_missing_prompt_file(tmp_path):
    path = small_spec(tmp_path, "tiny")
    (tmp_path / "texts.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"texts\.json"):
        batches.load_spec(path)


# -- the frozen file table ------------------------------------------------------------------------------------------


def test_freezing_detects_a_changed_file(tmp_path, model_source):
    spec = small_spec(tmp_path / "spec", model_source)
    table = batches.freeze(spec, tmp_path / "t.json")
    frozen = json.loads(table.read_text())["files"]
    assert {"spec/small.yaml", "spec/texts.json", "package/looped_kv/protocol/batches.py",
            "model/config.json"} <= set(frozen)
    assert batches.check_table(table)[0].name == "small"
    with pytest.raises(ValueError, match="exists"):
        batches.freeze(spec, tmp_path / "t.json")
    prompts = tmp_path / "spec" / "texts.json"
    prompts.write_text(prompts.read_text().replace("[", "[\"one more\", ", 1))
    with pytest.raises(ValueError, match=r"changed: spec/texts\.json"):
        batches.check_table(table)
    with pytest.raises(ValueError, match=r"changed: spec/texts\.json"):
        batches.run_batch(table, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_table_changes_lists_every_kind():
    changes = batches.table_changes({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "9", "d": "4"})
    assert changes == ["changed: b", "missing: c", "added: d"]


# -- decision rules on synthetic outcomes ---------------------------------------------------------------------------


def synthetic_spec(tmp_path: Path) -> batches.BatchSpec:
    rules = [
        {"name": "ratio", "statistic": "ratio", "metric": "kl_mean", "numerator": "window", "denominator": "deepest",
         "threshold": 0.5, "n_boot": 500, "labels": {"above": "keeps", "between": "unclear", "below": "removes"}},
        {"name": "tail", "statistic": "ratio", "metric": "tail", "numerator": "window", "denominator": "deepest",
         "threshold": 0.5, "n_boot": 500, "labels": {"above": "keeps", "between": "unclear", "below": "removes"}},
        {"name": "fidelity", "statistic": "fidelity", "arm": "deepest", "precision_arm": "fp32", "bins": [0, 2, 4],
         "threshold": 2, "n_boot": 500, "labels": {"above": "exceeds", "between": "indist.", "below": "indist."}},
        {"name": "fidelity-window", "statistic": "fidelity", "arm": "window", "precision_arm": "fp32",
         "bins": [0, 2, 4], "threshold": 2, "n_boot": 500,
         "labels": {"above": "exceeds", "between": "indist.", "below": "indist."}},
        {"name": "exact", "statistic": "mean", "metric": "same_as_greedy", "arm": "spec", "threshold": 0.99,
         "n_boot": 500, "labels": {"above": "exact", "between": "not exact", "below": "not exact"}},
        {"name": "tau", "statistic": "mean", "metric": "tau", "arm": "spec", "threshold": 2, "n_boot": 500,
         "labels": {"above": "high", "between": "mid", "below": "low"}},
    ]
    predictions = [{"text": "window removes most KL", "rule": "ratio", "label": "removes"},
                   {"text": "window removes most tail positions", "rule": "tail", "label": "removes"},
                   {"text": "deepest indistinguishable", "rule": "fidelity", "label": "indist."},
                   {"text": "window indistinguishable", "rule": "fidelity-window", "label": "indist."},
                   {"text": "speculation exact", "rule": "exact", "label": "exact"},
                   {"text": "tau in 2-4", "rule": "tau", "range": [2, 4]}]
    path = small_spec(tmp_path, "tiny", "generation", max_new_tokens=4,
                      arms=[{"name": "deepest", "cache": "deepest"}, {"name": "window", "cache": "ripe", "window": 2},
                            {"name": "fp32", "cache": "full"},
                            {"name": "spec", "decoder": "self-spec", "cache": "full", "gamma": 2, "draft_loops": 2}],
                      decision_rules=rules, predictions=predictions)
    return batches.load_spec(path)


def synthetic_records(kl: dict[str, list[list[float]]], spec_rows: list[dict]) -> tuple[list[dict], list[dict]]:
    positions = [{"prompt": p, "arm": arm, "position": t, "kl": value, "flip": False}
                 for arm, rows in kl.items() for p, row in enumerate(rows) for t, value in enumerate(row)]
    prompts = [{"prompt": p, "set": "s", "arm": arm} for arm in kl for p in range(len(kl[arm]))]
    return positions, prompts + spec_rows


def test_decision_rules_label_synthetic_outcomes(tmp_path):
    spec = synthetic_spec(tmp_path)
    fp32 = [[0.01, 0.01, 0.01, 0.01]] * 6
    deepest = [[0.02, 0.5, 0.01, 0.2], [0.01, 0.02, 0.3, 0.01]] * 3  # the deepest plane has a tail
    window = [[0.01, 0.01, 0.011, 0.01]] * 6
    spec_rows = [{"prompt": p, "set": "s", "arm": "spec", "same_as_greedy": True, "tau": 3.0 + 0.1 * p}
                 for p in range(6)]
    positions, prompts = synthetic_records({"deepest": deepest, "window": window, "fp32": fp32}, spec_rows)
    decisions = batches.decide(spec, positions, prompts)
    labels = {name: rule["label"] for name, rule in decisions["rules"].items()}
    assert labels == {"ratio": "removes", "tail": "removes", "fidelity": "exceeds", "fidelity-window": "indist.",
                      "exact": "exact", "tau": "high"}
    assert decisions["rules"]["tail"]["estimate"] == 0.0  # 0 tail positions (KL > 0.1) with the window, 4 without
    outcomes = {p["prediction"]: p["outcome"] for p in decisions["predictions"]}
    assert outcomes == {"window removes most KL": "held", "window removes most tail positions": "held",
                        "deepest indistinguishable": "failed", "window indistinguishable": "held",
                        "speculation exact": "held", "tau in 2-4": "held"}


def test_undefined_and_failed_outcomes(tmp_path):
    spec = synthetic_spec(tmp_path)
    flat = [[0.01, 0.01, 0.01, 0.01]] * 6  # no tail anywhere: the tail ratio is undefined
    spec_rows = [{"prompt": p, "set": "s", "arm": "spec", "same_as_greedy": p != 0, "tau": 1.5} for p in range(6)]
    positions, prompts = synthetic_records({"deepest": flat, "window": flat, "fp32": flat}, spec_rows)
    decisions = batches.decide(spec, positions, prompts)
    rules = decisions["rules"]
    assert rules["tail"]["outcome"] == "undefined"
    assert rules["tail"]["detail"] == "tail of deepest (the denominator) is 0 on every prompt"
    assert rules["ratio"]["label"] == "keeps" and rules["ratio"]["estimate"] == pytest.approx(1.0)
    assert rules["exact"]["label"] == "not exact" and rules["tau"]["label"] == "low"
    outcomes = {p["prediction"]: p["outcome"] for p in decisions["predictions"]}
    assert outcomes["window removes most tail positions"] == "failed"
    assert outcomes["speculation exact"] == "failed" and outcomes["tau in 2-4"] == "failed"


def test_region_coefficient_recovers_a_known_deep_effect(tmp_path):
    spec = batches.load_spec(small_spec(tmp_path, "tiny"))
    rng = torch.Generator().manual_seed(0)
    positions, prompts = [], []
    for p in range(8):
        for arm, size in (("s1", 2.0), ("s32", 0.5), ("d1", 1.5), ("d16", 0.3)):
            deep = arm.startswith("d")
            noise = float(torch.randn(1, generator=rng)) * 0.1
            kl_first = math.exp(-5 + 3.0 * deep + 2 * math.log(size * (1 + 0.1 * p)) + noise)
            positions += [{"prompt": p, "arm": arm, "position": t, "kl": kl_first, "flip": False} for t in range(4)]
            prompts.append({"prompt": p, "set": "s", "arm": arm, "size": size * (1 + 0.1 * p)})
    rule = batches.decide(spec, positions, prompts)["rules"]["regions"]
    assert rule["label"] == "deep" and rule["low"] < math.exp(3.0) < rule["high"]


@pytest.mark.parametrize("low, high, expected", [(1.1, 2, "above"), (0.2, 0.9, "below"), (0.5, 1.5, "between"),
                                                  (1.0, 1.2, "between")])
def test_outcome_against_threshold(low, high, expected):
    assert batches.outcome(low, high, 1.0) == expected


# -- archives ---------------------------------------------------------------------------------------------------------


def test_archive_layout_and_verify(small_archive):
    names = {p.relative_to(small_archive).as_posix() for p in small_archive.rglob("*") if p.is_file()}
    assert names == {"MANIFEST.sha256", "frozen.json", "spec/small.yaml", "spec/texts.json", "records/positions.jsonl",
                     "records/prompts.jsonl", "timings.jsonl", "summary.json", "decisions.json", "run.json"}
    assert batches.verify(small_archive) == []
    run = json.loads((small_archive / "run.json").read_text())
    assert all(t["passed"] for t in run["nodes"][0]["selftests"]) and run["nodes"][0]["rerun"]["identical"]
    measurement = json.loads((small_archive / "summary.json").read_text())["measurement"]
    assert "cudnn_sdp" in measurement and measurement["threads"] == run["threads"] == 1  # the spec's default
    positions = batches.read_jsonl(small_archive / "records/positions.jsonl")
    assert len(positions) == 3 * 4 * 4 and {"prompt", "arm", "position", "kl", "flip"} == set(positions[0])


def recomputation_problems(archive: Path) -> list[str]:
    """verify's problems, less its note that the package changed since the run (other work may edit it meanwhile)."""
    return [p for p in batches.verify(archive) if not p.startswith("the installed package differs")]


def test_a_tampered_archive_fails_verify(small_archive, tmp_path):
    records = tmp_path / "a" / "records/positions.jsonl"
    shutil.copytree(small_archive, tmp_path / "a")
    lines = records.read_text().splitlines()
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "kl": first["kl"] * 1000})
    records.write_text("\n".join(lines) + "\n")
    assert batches.verify(tmp_path / "a") == ["checksum mismatch: records/positions.jsonl"]
    batches.write_manifest(tmp_path / "a")  # a consistent manifest does not hide it: labels are recomputed
    problems = recomputation_problems(tmp_path / "a")
    assert problems and all("does not follow from the records" in p for p in problems), problems

    shutil.copytree(small_archive, tmp_path / "b")
    decisions = tmp_path / "b" / "decisions.json"
    tampered = json.loads(decisions.read_text())
    tampered["rules"]["regions"]["label"] = "shallow" if tampered["rules"]["regions"]["label"] != "shallow" else "deep"
    decisions.write_text(json.dumps(tampered))
    (tmp_path / "b" / "extra.txt").write_text("x")
    assert batches.verify(tmp_path / "b") == ["checksum mismatch: decisions.json", "unlisted file extra.txt"]
    batches.write_manifest(tmp_path / "b")  # a file no run writes fails verify even when the manifest lists it
    assert recomputation_problems(tmp_path / "b") == ["the archive holds files no run writes: extra.txt"]
    (tmp_path / "b" / "extra.txt").unlink()
    batches.write_manifest(tmp_path / "b")
    assert recomputation_problems(tmp_path / "b") == [
        "decisions.json (labels, predictions) does not follow from the records"]
    frozen = tmp_path / "b" / "frozen.json"
    table = json.loads(frozen.read_text())
    table["files"]["package/looped_kv/analysis/fits.py"] = "0" * 64  # as if the run had used other code
    frozen.write_text(json.dumps(table))
    batches.write_manifest(tmp_path / "b")
    note = batches.verify(tmp_path / "b")[-1]
    assert note.startswith("the installed package differs from the archive's (changed: ") and "fits.py" in note

    shutil.copytree(small_archive, tmp_path / "c")
    spec = tmp_path / "c" / "spec" / "small.yaml"
    spec.write_text(spec.read_text().replace("threshold: 1", "threshold: 100"))
    batches.write_manifest(tmp_path / "c")
    assert batches.verify(tmp_path / "c") == ["frozen table vs archived spec: changed: spec/small.yaml"]
    with pytest.raises(ValueError, match="does not verify"):
        batches.ledger([tmp_path / "c"])


def test_ledger_layout(small_archive):
    text = batches.ledger([small_archive])  # an archive given twice is refused (tests/test_bad_inputs.py)
    lines = text.splitlines()
    assert lines[0].split() == ["Batch", "Prediction", "Outcome"]
    assert len(lines) == 1 + 2 + 1 and lines[-1].startswith("2 predictions:")
    assert all(line.startswith("t ") and (" held (" in line or " failed (" in line) for line in lines[1:-1])


def test_run_refuses_a_non_empty_out(small_archive, tmp_path):
    with pytest.raises(ValueError, match="never overwritten"):
        batches.run_batch(small_archive / "frozen.json", small_archive)


def test_run_refuses_threads_that_contradict_the_frozen_spec(small_archive, tmp_path):
    with pytest.raises(ValueError) as error:
        batches.run_batch(small_archive / "frozen.json", tmp_path / "out", threads=2)
    assert str(error.value) == ("--threads 2 contradicts the frozen spec's threads: 1 (the count changes the records' "
                                "bytes); allowed: 1, or leave --threads out")
    assert not (tmp_path / "out").exists()


def test_compare_finds_identity_and_the_largest_difference_per_metric(small_archive, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(small_archive, copy)
    (copy / "run.json").write_text("{}")  # the machine, the command and the clock are not compared
    same = batches.compare(small_archive, copy)
    assert same.identical and same.differences == () and same.table_changes == ()
    assert "records/positions.jsonl" in same.files and "run.json" not in same.files
    assert same.report().endswith("identical byte for byte (run.json, timings.jsonl and frozen.json left out)")

    path = copy / "records/positions.jsonl"
    original = batches.read_jsonl(path)
    changed = [dict(r) for r in original]
    changed[1]["kl"] += 1e-9
    changed[5]["kl"] += 1e-3
    changed[2]["flip"] = not changed[2]["flip"]
    batches.write_jsonl(path, changed)
    other = batches.compare(small_archive, copy)
    assert not other.identical and other.differing_files == ("records/positions.jsonl",)
    kl, flip = other.differences
    where = f"prompt {changed[5]['prompt']}, arm {changed[5]['arm']}, position {changed[5]['position']}"
    assert (kl.metric, kl.differing, kl.compared, kl.where) == ("kl", 2, len(original), where)
    assert kl.largest == abs(original[5]["kl"] - changed[5]["kl"]) and kl.values == (original[5]["kl"],
                                                                                       changed[5]["kl"])
    assert str(kl).startswith(f"records/positions.jsonl kl: 2 of {len(original)} differ, largest difference 0.001 at "
                              f"{where} (")
    assert (flip.metric, flip.differing, flip.largest) == ("flip", 1, None)
    assert other.report().splitlines()[1:] == [f"  {kl}", f"  {flip}"]

    table = json.loads((copy / "frozen.json").read_text())
    table["files"]["model/config.json"] = "0" * 64  # frozen with another model: listed, still compared
    (copy / "frozen.json").write_text(json.dumps(table))
    assert batches.compare(small_archive, copy).table_changes == ("changed: model/config.json",)
    table["files"]["spec/small.yaml"] = "0" * 64
    (copy / "frozen.json").write_text(json.dumps(table))
    with pytest.raises(ValueError, match=r"different frozen specs \(changed: spec/small\.yaml\)"):
        batches.compare(small_archive, copy)
    with pytest.raises(FileNotFoundError, match="not a batch archive"):
        batches.compare(small_archive, tmp_path)


# -- the shipped examples on the tiny model ---------------------------------------------------------------------------


@pytest.mark.skipif(not TINY, reason="the tiny model is not trained yet (looped-kv train)")
@pytest.mark.parametrize("name", ["regions", "windows"])
def test_example_batches_run_and_their_ledgers_print(name, tmp_path, capsys):
    from looped_kv.cli import main

    table = tmp_path / f"{name}.frozen.json"
    assert main(["batch", "freeze", name, "-o", str(table)]) == 0
    assert main(["batch", "run", str(table), "--out", str(tmp_path / name), "--quiet", "--threads", "1"]) == 0
    assert main(["batch", "verify", str(tmp_path / name)]) == 0
    capsys.readouterr()
    assert main(["batch", "ledger", str(tmp_path / name)]) == 0
    lines = capsys.readouterr().out.splitlines()
    spec = batches.load_spec(name)
    assert len(lines) == len(spec.predictions) + 2
    assert all(" held (" in line or " failed (" in line for line in lines[1:-1])


# -- self-tests and reproducibility -----------------------------------------------------------------------------------


def test_selftests_pass_and_a_failure_stops_the_batch(monkeypatch):
    monkeypatch.setitem(selftest.CHECKS, "always fails", lambda model: (False, "on purpose"))
    with pytest.raises(selftest.SelfTestFailure) as error:  # the package's own checks pass; only this one fails
        selftest.require_selftests()
    assert str(error.value) == "self-tests failed on this node: always fails (on purpose)"


def test_bitwise_rerun_of_a_replay():
    from looped_kv.analysis.replay import replay

    model = selftest.random_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    report = bitwise_rerun(replay, model, ids, 6, decoded=4)
    assert report.identical and report.equal_fraction == 1.0 and report.max_abs_diff == 0.0 and report.tensors == 4
    noisy = bitwise_rerun(lambda: {"x": torch.rand(100), "same": torch.ones(100)})
    assert not noisy.identical and 0.45 < noisy.equal_fraction < 0.55 and noisy.max_abs_diff > 0
    with pytest.raises(ValueError, match="fn must return tensors"):
        bitwise_rerun(lambda: 1.0)


def test_measurement_mode_records_the_attention_backend_and_pins_the_threads():
    before = torch.get_num_threads()
    with measurement_mode(threads=before + 1) as record:
        assert torch.get_num_threads() == record["threads"] == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"), measurement_mode(threads=0):
        pass
    with measurement_mode() as record:
        assert record["torch"] == torch.__version__ and record["threads"] == before
        if torch.cuda.is_available():
            assert not torch.backends.cuda.cudnn_sdp_enabled() and record["cudnn_sdp"].startswith("disabled")
        else:
            assert record["cudnn_sdp"] == "not applicable (no CUDA device)"
