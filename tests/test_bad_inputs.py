"""Bad and hostile inputs of issue 28: each gets a one-line error before any work, or the safe behaviour.

Every test here failed on the code before the issue (ff195e7). The cases:

No data loss (``batch run``)
  1. a folder ``<out>.partial`` without the run's marker (a user's notes) is refused and kept, not deleted;
  2. a marked ``<out>.partial`` holding a file no run wrote is refused and kept;
  3. an unwritable ``--out`` (under a regular file; ``/proc/...``) fails before the self-tests;
  4. SIGINT leaves a marked ``<out>.partial`` and prints one line saying so; the next run replaces it;
  5. SIGINT in any other command prints one line (exit 130), not a traceback.
Verify checks meaning (each archive's MANIFEST rewritten to match, as a forger would)
  6. records with one frozen prompt removed, summary and decisions recomputed;
  7. a run.json whose self-test says ``passed: false``; 8. an archive without run.json;
  9. record fields that the spec's arms do not write (an added field, a flip that is not a bool);
  10. a decoder record whose A does not follow from its accepted drafts;
  11. MANIFEST naming a file outside the archive (``../``); 12. a symbolic link in the archive;
  13. record values outside the summary edited (flips): caught with a signed manifest (``--key-file``);
  14. ``batch ledger`` given one archive twice (under other spellings of its path, or as a copy).
Freeze refuses what cannot run, naming the spec field
  15. texts shorter than ``tokens``; 16. ``tokens`` beyond the model's block_size; 17. ``max_new_tokens`` that
      cannot fit; 18. a decoder's block that cannot fit; 19. sinks beyond block_size; 20. negative or zero sizes
      (tokens, seed, tail_kl, ngram, floor).
Finite numbers
  21. a NaN or an infinity in a checkpoint's weights: ``load`` fails naming the tensor and the file;
  22. ``model(ids, initial_state=<NaN>)``; 23. ``num_loops`` 2.5 or True.
Load errors are one line naming the file and the key (exit 2 in the CLI)
  24. a truncated safetensors file; 25. an empty one; 26. config.json that is not JSON; 27. a config without
      vocab_size; 28. without mean_recurrence; 29. without block_size (no silent 32 and 4096); 30. a corrupt
      model.safetensors.index.json; 31. a corrupt tokenizer.json.
CLI
  32. ``memory --context`` beyond the model's block_size warns.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import random_model
from safetensors.torch import save_file

from looped_kv import load
from looped_kv.cli import main
from looped_kv.protocol import batches, selftest
from looped_kv.runtime.config import LoopedConfig

torch.set_num_threads(1)
TEXTS = json.loads((batches.EXAMPLES_DIR / "windows_prompts.json").read_text())["texts"][:2]


def tiny_spec(folder: Path, **overrides) -> Path:
    """The smallest generation batch: 2 prompts, 4 new tokens, R = 4, a replay arm and a self-speculative decoder;
    an override of None removes the key."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.json").write_text(json.dumps(TEXTS))
    spec = {"batch": "b", "name": "bad", "question": "q?", "model": "tiny", "num_loops": 4, "mode": "generation",
            "prompts": [{"name": "p", "file": "prompts.json"}], "max_new_tokens": 4,
            "arms": [{"name": "deepest", "cache": "deepest"},
                     {"name": "spec", "decoder": "self-spec", "cache": "full", "gamma": 2, "draft_loops": 2}],
            "metrics": ["kl_mean", "same_as_greedy"],
            "decision_rules": [{"name": "exact", "statistic": "mean", "metric": "same_as_greedy", "arm": "spec",
                                "threshold": 0.5, "n_boot": 100, "labels": {"above": "a", "between": "b",
                                                                            "below": "c"}}],
            "predictions": [{"text": "exact", "rule": "exact", "label": "a"}]} | overrides
    path = folder / "bad.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec.items() if v is not None}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    return batches.freeze(tiny_spec(root / "spec"), root / "bad.frozen.json")


@pytest.fixture(scope="module")
def archive(table, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("archive") / "a"
    batches.run_batch(table, out, progress=False)
    return out


def selftests_must_not_run(monkeypatch) -> None:
    def fail():
        raise AssertionError("the self-tests ran: the error came after work had started")

    monkeypatch.setattr(selftest, "run_selftests", fail)


# -- no data loss -----------------------------------------------------------------------------------------------------


def test_a_partial_folder_without_the_marker_is_refused_and_kept(table, tmp_path, monkeypatch):
    notes = tmp_path / "outP.partial" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    selftests_must_not_run(monkeypatch)
    with pytest.raises(ValueError, match=r"outP\.partial exists and is not a looped-kv partial archive"):
        batches.run_batch(table, tmp_path / "outP", progress=False)
    assert notes.read_text() == "mine" and not (tmp_path / "outP").exists()


def test_a_marked_partial_folder_with_a_foreign_file_is_refused_and_kept(table, tmp_path, monkeypatch):
    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(selftest, "run_selftests", interrupt)
    with pytest.raises(KeyboardInterrupt):
        batches.run_batch(table, tmp_path / "out", progress=False)
    notes = tmp_path / "out.partial" / "records" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    selftests_must_not_run(monkeypatch)
    with pytest.raises(ValueError, match=r"holds files no run wrote \(records/notes\.txt\)"):
        batches.run_batch(table, tmp_path / "out", progress=False)
    assert notes.read_text() == "mine"


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_unwritable_out_fails_before_the_selftests(table, tmp_path, monkeypatch, where):
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "file.txt" / "out" if where == "file" else Path("/proc/looped_kv_qa_out")
    selftests_must_not_run(monkeypatch)
    with pytest.raises(ValueError, match=f"out {out}: cannot write there"):
        batches.run_batch(table, out, progress=False)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """main(argv) and its stderr; a KeyboardInterrupt escaping main fails the test instead of stopping pytest."""
    try:
        status = main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the CLI (a traceback for the user)")
    return status, capsys.readouterr().err


def test_sigint_leaves_a_marked_partial_and_says_so_in_one_line(table, tmp_path, monkeypatch, capsys):
    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(selftest, "run_selftests", interrupt)
    out = tmp_path / "run"
    status, err = run_cli(["batch", "run", str(table), "--out", str(out), "--quiet"], capsys)
    assert status == 130 and err.count("\n") == 1
    assert err.startswith(f"looped-kv batch: interrupted; the unfinished archive is left at {out}.partial (marked")
    from looped_kv.protocol import archive

    marker = json.loads((tmp_path / "run.partial" / archive.PARTIAL_MARKER).read_text())
    assert marker["format"] == archive.PARTIAL_FORMAT and "records/positions.jsonl" in marker["files"]
    monkeypatch.undo()
    assert main(["batch", "run", str(table), "--out", str(out), "--quiet"]) == 0  # the marked leftover is replaced
    assert not (tmp_path / "run.partial").exists() and batches.verify(out) == []


def test_sigint_in_any_command_is_one_line(monkeypatch, capsys):
    import looped_kv.cli

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(looped_kv.cli, "_load", interrupt)
    status, err = run_cli(["generate", "--model", "tiny", "--max-new-tokens", "2", "hi"], capsys)
    assert (status, err) == (130, "looped-kv generate: interrupted\n")


# -- verify checks meaning ---------------------------------------------------------------------------------------------


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rewrite_manifest(root: Path) -> None:
    """A manifest of every file, as ``sha256sum`` over the folder would write it (links followed)."""
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.name not in ("MANIFEST.sha256", "MANIFEST.hmac-sha256"))
    (root / "MANIFEST.sha256").write_text("".join(f"{sha256(root / n)}  {n}\n" for n in names))


def forged(archive: Path, tmp_path: Path, edit) -> Path:
    """A copy of the archive edited by ``edit(copy)``, its summary and decisions recomputed from its records and its
    manifest rewritten: what a forger without a key can do."""
    copy = tmp_path / "forged"
    shutil.copytree(archive, copy)
    edit(copy)
    spec = batches.load_spec(copy / "spec" / json.loads((copy / "frozen.json").read_text())["spec_file"])
    if (copy / "records/prompts.jsonl").exists():
        positions, prompts = read_lines(copy / "records/positions.jsonl"), read_lines(copy / "records/prompts.jsonl")
        summary = json.loads((copy / "summary.json").read_text())
        recomputed = {**batches.summarize(spec, positions, prompts), "measurement": summary["measurement"]}
        (copy / "summary.json").write_text(json.dumps(recomputed, indent=1) + "\n")
        (copy / "decisions.json").write_text(json.dumps(batches.decide(spec, positions, prompts), indent=1) + "\n")
    rewrite_manifest(copy)
    return copy


def without_prompt(copy: Path) -> None:
    for name in ("records/positions.jsonl", "records/prompts.jsonl", "timings.jsonl"):
        write_lines(copy / name, [r for r in read_lines(copy / name) if r["prompt"] != 1])


def failed_selftest(copy: Path) -> None:
    run = json.loads((copy / "run.json").read_text())
    run["nodes"][0]["selftests"][0]["passed"] = False
    (copy / "run.json").write_text(json.dumps(run))


def added_field(copy: Path) -> None:
    records = read_lines(copy / "records/positions.jsonl")
    records[3]["note"] = "edited"
    write_lines(copy / "records/positions.jsonl", records)


def flip_not_a_bool(copy: Path) -> None:
    records = read_lines(copy / "records/positions.jsonl")
    records[0]["flip"] = 1
    write_lines(copy / "records/positions.jsonl", records)


def inconsistent_a(copy: Path) -> None:
    records = read_lines(copy / "records/prompts.jsonl")
    spec_row = next(r for r in records if r["arm"] == "spec")
    spec_row["A"] = spec_row["A"] + 0.5
    write_lines(copy / "records/prompts.jsonl", records)


@pytest.mark.parametrize("edit, problem", [
    (without_prompt, "records/positions.jsonl: no record of prompt 1, arm deepest, position 0"),
    (failed_selftest, "run.json node 0 records failed self-tests: "),
    (lambda copy: (copy / "run.json").unlink(), "missing file run.json"),
    (added_field, "records/positions.jsonl line 4 has fields ['arm', 'flip', 'kl', 'note', 'position', 'prompt']"),
    (flip_not_a_bool, "records/positions.jsonl line 1 flip = 1 is not true or false"),
    (inconsistent_a, "records/prompts.jsonl line 3 A = "),
], ids=["prompt removed", "failed self-test", "no run.json", "added field", "flip not a bool", "A"])
def test_verify_fails_an_archive_that_does_not_mean_what_it_says(archive, tmp_path, edit, problem):
    problems = batches.verify(forged(archive, tmp_path, edit))
    assert problems and problems[0].startswith(problem), problems


def test_verify_reads_nothing_outside_the_archive(archive, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    copy = forged(archive, tmp_path, lambda copy: None)
    manifest = copy / "MANIFEST.sha256"
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join([*lines, f"{sha256(secret)}  ../secret.txt"]) + "\n")
    assert batches.verify(copy) == [f"MANIFEST.sha256 line {len(lines) + 1} names '../secret.txt', not a plain "
                                    f"relative path inside the archive"]


def test_verify_fails_a_symbolic_link(archive, tmp_path):
    outside = tmp_path / "prompts.jsonl"

    def link(copy: Path) -> None:
        shutil.move(copy / "records/prompts.jsonl", outside)
        (copy / "records/prompts.jsonl").symlink_to(outside)

    problems = batches.verify(forged(archive, tmp_path, link))
    assert problems == ["MANIFEST.sha256 names records/prompts.jsonl, a symbolic link (an archive holds only regular "
                        "files)"]


def test_a_signed_manifest_catches_edits_that_nothing_else_depends_on(table, tmp_path, capsys):
    key, out = tmp_path / "key", tmp_path / "signed"
    key.write_bytes(bytes(range(32)))
    assert main(["batch", "run", str(table), "--out", str(out), "--quiet", "--key-file", str(key)]) == 0
    assert main(["batch", "verify", str(out), "--key-file", str(key)]) == 0
    assert capsys.readouterr().out.endswith(f"{out}: ok, signed with {key}\n")

    def flips(copy: Path) -> None:  # no metric of this spec counts flips
        records = read_lines(copy / "records/positions.jsonl")
        write_lines(copy / "records/positions.jsonl", [{**r, "flip": not r["flip"]} for r in records])

    copy = forged(out, tmp_path, flips)
    assert batches.verify(copy) == []  # what an unkeyed manifest cannot show (the module docstring says so)
    assert batches.verify(copy, batches.read_key(key)) == [
        "MANIFEST.hmac-sha256 does not match: the manifest was not signed with this key, or has changed since"]
    (tmp_path / "short").write_bytes(b"abc")
    assert main(["batch", "verify", str(copy), "--key-file", str(tmp_path / "short")]) == 2
    assert capsys.readouterr().err.endswith("holds 3 bytes; a key needs at least 16\n")


def test_the_ledger_refuses_an_archive_given_twice(archive, tmp_path):
    spellings = [str(archive), f"{archive}/", f"{archive.parent}/../{archive.parent.name}/./{archive.name}"]
    with pytest.raises(ValueError, match="twice"):
        batches.ledger(spellings)
    copy = tmp_path / "copy"
    shutil.copytree(archive, copy)
    with pytest.raises(ValueError, match=r"is a copy of .* \(the same MANIFEST\.sha256\)"):
        batches.ledger([archive, copy])


# -- freeze refuses what cannot run ---------------------------------------------------------------------------------


SUBSTITUTION = {"mode": "substitution", "tokens": 64, "decoded": 4, "max_new_tokens": None, "metrics": ["kl_mean"],
                "arms": [{"name": "s", "region": "deep", "plane": 1}],
                "decision_rules": [{"name": "exact", "statistic": "mean", "metric": "kl_mean", "arm": "s",
                                    "threshold": 0.5, "labels": {"above": "a", "between": "b", "below": "c"}}]}


@pytest.mark.parametrize("overrides, texts, message", [
    (SUBSTITUTION, ["a 2-token text", "x" * 80], "prompts[0] (p) file 'prompts.json', text 0 has "),
    (SUBSTITUTION | {"tokens": 5000}, None, "spec.tokens 5000 is beyond the model's context (block_size 1024)"),
    ({"max_new_tokens": 100000}, None, "spec.max_new_tokens 100000: prompts[0] (p) file 'prompts.json', text 0 has"),
    ({"arms": [{"name": "deepest", "cache": "deepest"},
               {"name": "spec", "decoder": "self-spec", "cache": "full", "gamma": 1000, "draft_loops": 2}]}, None,
     "arms[1] (spec).gamma: prompts[0] (p) file 'prompts.json', text 0 has"),
    ({"arms": [{"name": "deepest", "cache": "sinks", "sinks": 5000},
               {"name": "spec", "decoder": "self-spec", "cache": "full", "gamma": 2, "draft_loops": 2}]}, None,
     "arms[0] (deepest).sinks 5000 is beyond the model's context (block_size 1024)"),
], ids=["text shorter than tokens", "tokens beyond the context", "max_new_tokens", "gamma", "sinks"])
def test_freeze_refuses_what_cannot_run(tmp_path, overrides, texts, message):
    path = tiny_spec(tmp_path, **overrides)
    if texts is not None:
        (tmp_path / "prompts.json").write_text(json.dumps(texts))
    with pytest.raises(ValueError) as error:
        batches.freeze(path, tmp_path / "t.json")
    assert str(error.value).startswith(message) and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("change, message", [
    ({"seed": -1}, "spec.seed must be >= 0"),
    ({"tail_kl": -0.5}, "spec.tail_kl must be a KL >= 0"),
    ({"arms": [{"name": "deepest", "cache": "deepest"},
               {"name": "spec", "decoder": "self-spec", "gamma": 2, "draft_loops": 2},
               {"name": "pld", "decoder": "pld", "ngram": 0}]}, "arms[2] (pld): ngram must be >= 1, got 0"),
    (SUBSTITUTION | {"tokens": -5}, "spec.tokens must be >= 2"),
])
def test_negative_or_zero_sizes_are_refused_naming_the_field(tmp_path, change, message):
    path = tiny_spec(tmp_path, **change)
    with pytest.raises(ValueError) as error:
        batches.load_spec(path)
    assert message in str(error.value)


def test_a_zero_regression_floor_is_refused(tmp_path):
    rule = {"name": "r", "statistic": "region_coefficient", "threshold": 1, "floor": 0,
            "labels": {"above": "a", "between": "b", "below": "c"}}
    path = tiny_spec(tmp_path, **SUBSTITUTION | {
        "arms": [{"name": "s", "region": "shallow", "plane": 1}, {"name": "d", "region": "deep", "plane": 1}],
        "decision_rules": [rule], "predictions": [{"text": "t", "rule": "r", "label": "a"}]})
    with pytest.raises(ValueError, match=r"decision_rules\[0\] \(r\)\.floor must be a KL > 0"):
        batches.load_spec(path)


# -- finite numbers ---------------------------------------------------------------------------------------------------


def checkpoint(folder: Path, edit_state=None, edit_config=None) -> Path:
    """A small random checkpoint folder in the public format, its state and config.json edited."""
    model = random_model()
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous().float() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    config = model.config.to_hf_dict()
    if edit_state is not None:
        edit_state(state)
    if edit_config is not None:
        edit_config(config)
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_weight_fails_the_load_naming_tensor_and_file(tmp_path, value):
    def poison(state: dict[str, torch.Tensor]) -> None:
        state["transformer.wte.weight"][3, 7] = value

    folder = checkpoint(tmp_path / "ckpt", poison)
    with pytest.raises(ValueError) as error:
        load(folder)
    assert str(error.value) == (f"{folder / 'model.safetensors'}: tensor 'transformer.wte.weight' holds NaN or "
                                f"infinite values; a checkpoint's weights must be finite")


def test_a_non_finite_initial_state_is_refused():
    model = random_model()
    ids = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    state = torch.zeros(1, 5, 32, dtype=torch.float64)
    state[0, 2, 3] = math.nan
    with pytest.raises(ValueError, match="initial_state holds NaN or infinite values"):
        model(ids, num_loops=4, initial_state=state)


@pytest.mark.parametrize("num_loops", [2.5, True, "4"])
def test_num_loops_must_be_an_integer(num_loops):
    model = random_model()
    with pytest.raises(ValueError, match=f"num_loops must be an integer >= 1, got {num_loops!r}"):
        model(torch.zeros(1, 3, dtype=torch.long), num_loops=num_loops)


# -- load errors -------------------------------------------------------------------------------------------------------


def truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:2000])


def drop(key: str):
    return lambda config: config.pop(key)


@pytest.mark.parametrize("damage, message", [
    (truncate, "model.safetensors is not a readable safetensors file (Error while deserializing header"),
    (lambda folder: (folder / "model.safetensors").write_bytes(b""), "model.safetensors is not a readable "
                                                                     "safetensors file"),
    (lambda folder: (folder / "config.json").write_text("{vocab"), "config.json is not valid JSON"),
    (lambda folder: (folder / "model.safetensors.index.json").write_text("[1]"), "model.safetensors.index.json is "
                                                                                "not a JSON object"),
    (lambda folder: (folder / "tokenizer.json").write_text("{"), "the tokenizer in"),
], ids=["truncated", "empty", "config not JSON", "index not an object", "tokenizer"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, damage, message, capsys):
    folder = checkpoint(tmp_path / "ckpt")
    damage(folder)
    with pytest.raises(ValueError, match=re.escape(message)):
        load(folder)
    assert main(["generate", "--model", str(folder), "--max-new-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(folder) in err and message in err


@pytest.mark.parametrize("missing, keys", [("padded_vocab_size", "'padded_vocab_size' or 'vocab_size'"),
                                           ("mean_recurrence", "'mean_recurrence'"),
                                           ("block_size", "'block_size' or 'max_position_embeddings'")])
def test_a_config_missing_a_key_names_the_file_and_the_key(tmp_path, missing, keys):
    def edit(config: dict) -> None:
        config.pop(missing)
        config.pop("vocab_size" if missing == "padded_vocab_size" else missing, None)

    folder = checkpoint(tmp_path / "ckpt", edit_config=edit)
    with pytest.raises(ValueError) as error:
        LoopedConfig.from_file(folder / "config.json")
    assert str(error.value) == f"{folder / 'config.json'}: config has no {keys}"
    with pytest.raises(ValueError, match="config has no"):
        load(folder)


# -- the CLI ----------------------------------------------------------------------------------------------------------


def test_memory_beyond_the_models_context_warns(capsys):
    assert main(["memory", "--model", "tiny", "--context", "512", "5000"]) == 0
    err = capsys.readouterr().err
    assert err == ("looped-kv: warning: --context 5000 is beyond the model's context (block_size 1024); the rows "
                   "below extrapolate the memory equations\n")
