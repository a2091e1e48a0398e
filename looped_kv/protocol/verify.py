"""Verifying a batch's archive, and the prediction ledger of verified archives (RIPE Appendix B).

What :func:`verify` can prove. ``MANIFEST.sha256`` is an unkeyed checksum list: it shows that no file changed by
accident since the run (a truncated copy, a flipped bit, a file edited without rewriting the manifest), not who
wrote the archive: anyone can edit a file and write a matching manifest. So verify also checks what the archive
means, from the frozen spec and the archive itself:

* every file is listed and matches its checksum, and is a regular file inside the archive (no symbolic links, no
  ``../`` names); every file a run writes is there, and no other;
* the archived spec and prompts are the frozen ones, and the spec validates;
* ``frozen.json`` is the table the run checked: its SHA-256 and its first freeze's (the chain of tables frozen
  again, :mod:`~looped_kv.protocol.freeze`) are the ones ``run.json`` records, and its package hashes give the
  package digest of the code that ran;
* ``run.json`` records the package's self-tests as passed on every node, and shards that cover the frozen prompts;
* the records cover exactly the frozen prompts and arms (one record per prompt and arm, each replayed arm's
  positions once), with exactly the fields and types the spec's arms write, in the archive's order;
* what follows from the records does: ``summary.json``, ``decisions.json`` (labels and predictions), and each
  decoder record's verifications and A from its accepted drafts; no record holds what no run writes (a KL below 0).

What it cannot prove: that a measured value (a KL, a flip, a perturbation size, a decoder's tokens) is what the
model gives, or that the run record is the run's. An archive rewritten consistently (other measurements, or a spec
rewritten with its table and run.json's hashes to match) verifies. Running the frozen spec again and
:func:`~looped_kv.protocol.compare.compare` finds the first; comparing ``run.json``'s first-freeze hash with the
one published at freeze time finds the second; a signed manifest (``key``: an HMAC-SHA256 of the manifest under a
key of the user's, written by ``batch run --key-file``) shows that whoever wrote the archive held the key.
"""

from __future__ import annotations

import hmac
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from looped_kv.protocol.archive import (
    MANIFEST,
    RUN_OUTPUTS,
    SIGNATURE,
    analyse,
    archive_entries,
    archive_names,
    has_link,
    manifest_hmac,
    order_records,
    read_jsonl,
    unsafe_name,
)
from looped_kv.protocol.freeze import first_freeze, package_digest, package_files, read_table, sha256, table_changes
from looped_kv.protocol.selftest import CHECKS
from looped_kv.protocol.spec import REFERENCE, BatchSpec, load_spec, units

SHOWN = 5  # problems listed per file, then a count of the rest
RECORD_FILES = ("records/positions.jsonl", "records/prompts.jsonl")
PROG_COMPARE = "looped-kv batch compare"

Check = tuple[Callable[[Any], bool], str]
COUNT: Check = (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0, "an integer >= 0")
NUMBER: Check = (lambda x: isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x),
                 "a finite number")
OPTIONAL_NUMBER: Check = (lambda x: x is None or NUMBER[0](x), "a finite number or null")
FLAG: Check = (lambda x: isinstance(x, bool), "true or false")
TEXT: Check = (lambda x: isinstance(x, str), "a string")
KL_ROUNDING = 1e-12  # how far below 0 float64 rounding takes a KL of two nearly equal distributions (replay.kl)
KL: Check = (lambda x: NUMBER[0](x) and x >= -KL_ROUNDING, f"a KL: a finite number >= 0 (-{KL_ROUNDING:g} for "
                                                          f"rounding)")
COUNTS: Check = (lambda x: isinstance(x, list) and all(COUNT[0](v) for v in x), "a list of integers >= 0")
#: The fields each kind of record holds, as the run writes them.
POSITION_FIELDS = {"prompt": COUNT, "arm": TEXT, "position": COUNT, "kl": KL, "flip": FLAG}
PROMPT_FIELDS = {
    "substitution": {"size": NUMBER},
    "replay": {},
    "decoder": {"same_as_greedy": FLAG, "tau": OPTIONAL_NUMBER, "A": OPTIONAL_NUMBER, "verifications": COUNT,
                "accepted": COUNTS, "new_tokens": COUNTS},
}
REFERENCE_FIELDS = {"substitution": {"tokens": COUNT}, "generation": {"tokens": COUNT, "new_tokens": COUNTS}}
TIMING_FIELDS = {"prompt": COUNT, "arm": TEXT, "time_s": NUMBER, "greedy_time_s": NUMBER, "new_tokens": COUNT}


def _capped(file: str, problems: list[str]) -> list[str]:
    shown = problems[:SHOWN]
    return shown + ([f"{file}: {len(problems) - SHOWN} more problems"] if len(problems) > SHOWN else [])


def _fields_problem(record: Any, fields: dict[str, Check]) -> str | None:
    if not isinstance(record, dict):
        return "is not a JSON object"
    if set(record) != set(fields):
        return f"has fields {sorted(record)}; its arm writes {sorted(fields)}"
    for key, (ok, what) in fields.items():
        if not ok(record[key]):
            return f"{key} = {json.dumps(record[key])[:40]} is not {what}"
    return None


def manifest_problems(root: Path) -> list[str]:
    """Every manifest line a plain relative path of a regular file with its checksum, and no file left unlisted."""
    problems, listed = [], set()
    if (root / MANIFEST).is_symlink():
        return [f"{MANIFEST} is a symbolic link (an archive holds only regular files)"]
    try:
        lines = (root / MANIFEST).read_text().splitlines()
    except UnicodeDecodeError:
        return [f"{MANIFEST} is not text"]
    for number, line in enumerate(lines, 1):
        digest, separator, name = line.partition("  ")
        unsafe = unsafe_name(name)
        if not separator or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            problems.append(f"{MANIFEST} line {number} is not '<sha256>  <path>'")
        elif unsafe:
            problems.append(f"{MANIFEST} line {number} names {name!r}, {unsafe}")
        elif name in listed:
            problems.append(f"{MANIFEST} lists {name} twice")
        elif has_link(root, name):
            problems.append(f"{MANIFEST} names {name}, a symbolic link (an archive holds only regular files)")
            listed.add(name)
        else:
            listed.add(name)
            if not (root / name).is_file():
                problems.append(f"missing file {name}")
            elif sha256(root / name) != digest:
                problems.append(f"checksum mismatch: {name}")
    files, others = archive_entries(root)
    problems += [f"unlisted file {name}" for name in files if name not in listed]
    problems += [f"{name} is a symbolic link or special file (an archive holds only regular files)"
                 for name in others if name not in listed]
    return problems


def signature_problems(root: Path, key: bytes) -> list[str]:
    path = root / SIGNATURE
    if path.is_symlink() or not path.is_file():
        return [f"no {SIGNATURE}: the archive is not signed (batch run --key-file signs it)"]
    if not hmac.compare_digest(path.read_bytes().strip(), manifest_hmac(root, key).encode()):
        return [f"{SIGNATURE} does not match: the manifest was not signed with this key, or has changed since"]
    return []


def run_problems(spec: BatchSpec, run: Any) -> list[str]:
    """run.json: one node per process, each with the package's self-tests passed, shards covering the prompts."""
    nodes = run.get("nodes") if isinstance(run, dict) else None
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, dict) for n in nodes) \
            or run.get("world_size") != len(nodes):
        return ["run.json does not record one node per process (nodes, world_size)"]
    problems = []
    for i, node in enumerate(nodes):
        tests = node.get("selftests") if isinstance(node.get("selftests"), list) else []
        names = sorted(str(t.get("name")) for t in tests if isinstance(t, dict))
        if names != sorted(CHECKS):
            problems.append(f"run.json node {i} records the self-tests {names}, not the package's {sorted(CHECKS)}")
        failed = [str(t.get("name")) for t in tests if isinstance(t, dict) and t.get("passed") is not True]
        if failed:
            problems.append(f"run.json node {i} records failed self-tests: {', '.join(failed)}")
    shards, count = [n.get("prompts") for n in nodes], len(units(spec))
    if not all(COUNT[0](s) for s in shards) or sum(shards) != count:
        problems.append(f"run.json's nodes ran {shards} prompts; the frozen spec has {count}")
    if run.get("threads") != spec.threads:
        problems.append(f"run.json records threads {run.get('threads')!r}; the frozen spec's threads: {spec.threads}")
    return problems


def frozen_problems(root: Path, table: dict[str, Any], run: Any) -> list[str]:
    """frozen.json is the table the run checked: its hash and first freeze as run.json records them, and its
    package hashes the digest of the code that ran."""
    record = run.get("frozen") if isinstance(run, dict) else None
    if not isinstance(record, dict):
        return ["run.json does not record the frozen table it ran (frozen: sha256, first, package_sha256)"]
    digest, problems = sha256(root / "frozen.json"), []
    if record.get("sha256") != digest:
        problems.append(f"frozen.json has sha256 {digest}; run.json records the run's table as "
                        f"{str(record.get('sha256'))[:64]}: the pre-registration changed after the run")
    if record.get("first") != first_freeze(table, digest):
        problems.append(f"frozen.json's first freeze is {first_freeze(table, digest)}; run.json records "
                        f"{str(record.get('first'))[:64]}")
    if record.get("package_sha256") != package_digest(table["files"]):
        problems.append("frozen.json's package hashes match no file table the run checked (their digest is not "
                        "run.json's package_sha256, the code that ran)")
    return problems


def _decoder_problem(spec: BatchSpec, record: dict) -> str | None:
    """A decoder record's counts against its accepted drafts (tau: accepted drafts plus at most one token)."""
    accepted, width = record["accepted"], spec.arm(record["arm"]).verify_width
    mean = sum(accepted) / len(accepted) if accepted else None
    if record["verifications"] != len(accepted):
        return f"verifications {record['verifications']} but {len(accepted)} accepted counts"
    if record["A"] != mean:
        return f"A = {record['A']} but its accepted drafts give {mean}"
    if (record["tau"] is None) != (mean is None) or (mean is not None and not mean <= record["tau"] <= mean + 1):
        return f"tau = {record['tau']} does not lie in [A, A + 1]"
    if any(a > (width or 0) for a in accepted) or not 1 <= len(record["new_tokens"]) <= spec.max_new_tokens:
        return (f"accepted drafts beyond the verification width {width}, or new tokens beyond max_new_tokens "
                f"{spec.max_new_tokens}")
    return None


def _record_fields(spec: BatchSpec, file: str, kind: str) -> dict[str, Check]:
    if file == "records/positions.jsonl":
        return POSITION_FIELDS
    if file == "timings.jsonl":
        return TIMING_FIELDS
    return {"prompt": COUNT, "set": TEXT, "arm": TEXT,
            **(REFERENCE_FIELDS[spec.mode] if kind == "reference" else PROMPT_FIELDS[kind])}


def record_problems(spec: BatchSpec, records: dict[str, list]) -> list[str]:
    """The records cover exactly the frozen prompts and arms, with the fields the spec's arms write, in order."""
    prompts = {u.index: u for u in units(spec)}
    kinds = {REFERENCE: "reference", **{a.name: a.kind for a in spec.arms}}
    decoders = [a.name for a in spec.arms if a.kind == "decoder"]
    arms = {"records/positions.jsonl": [a.name for a in spec.arms if a.kind != "decoder"],
            "records/prompts.jsonl": list(kinds), "timings.jsonl": decoders}
    for file, rows in records.items():
        problems, found, seen = [], [], Counter()
        for i, record in enumerate(rows):
            arm = record.get("arm") if isinstance(record, dict) else None
            if not isinstance(record, dict):
                problem = "is not a JSON object"
            elif not isinstance(arm, str) or arm not in arms[file]:
                problem = f"names arm {arm!r}; the records of this file are the arms {arms[file]}"
            else:
                problem = _fields_problem(record, _record_fields(spec, file, kinds[arm]))
            if problem is None and record["prompt"] not in prompts:
                problem = f"names prompt {record['prompt']}; the frozen spec has prompts 0..{len(prompts) - 1}"
            if problem is None and file == "records/prompts.jsonl":
                problem = _prompt_problem(spec, record, prompts[record["prompt"]].set)
            if problem is not None:
                problems.append(f"{file} line {i + 1} {problem}")
                continue
            found.append(record)
            seen[record["prompt"], arm, record.get("position", 0)] += 1
        positions = range(spec.decoded if spec.mode == "substitution" else spec.max_new_tokens) \
            if file == "records/positions.jsonl" else range(1)
        expected = Counter({(p, arm, t): 1 for p in prompts for arm in arms[file] for t in positions})
        at = (lambda t: f", position {t}") if len(positions) > 1 else (lambda t: "")
        problems += [f"{file}: no record of prompt {p}, arm {arm}{at(t)}" for p, arm, t in sorted(expected - seen)]
        problems += [f"{file}: {n} records of prompt {p}, arm {arm}{at(t)} that the frozen spec does not ask for"
                     for (p, arm, t), n in sorted((seen - expected).items())]
        if not problems and found != order_records(spec, found):
            problems.append(f"{file} is not in the archive's order (prompt, arm in spec order, position)")
        if problems:
            return _capped(file, problems)
    counts = {(r["prompt"], r["arm"]): len(r["new_tokens"]) for r in records["records/prompts.jsonl"]
              if r["arm"] in decoders}
    return _capped("timings.jsonl", [
        f"timings.jsonl: prompt {r['prompt']}, arm {r['arm']} has new_tokens {r['new_tokens']}; its prompt record "
        f"has {counts[r['prompt'], r['arm']]}" for r in records["timings.jsonl"]
        if r["new_tokens"] != counts[r["prompt"], r["arm"]]])


def _prompt_problem(spec: BatchSpec, record: dict, prompt_set: str) -> str | None:
    if record["set"] != prompt_set:
        return f"puts prompt {record['prompt']} in set {record['set']!r}; the frozen spec has it in {prompt_set!r}"
    if record["arm"] == REFERENCE:
        if spec.mode == "substitution" and record["tokens"] != spec.tokens:
            return f"has tokens {record['tokens']}; the frozen spec cuts every text to tokens = {spec.tokens}"
        if spec.mode == "generation" and len(record["new_tokens"]) != spec.max_new_tokens:
            return f"has {len(record['new_tokens'])} new tokens; the frozen max_new_tokens is {spec.max_new_tokens}"
        return None
    return _decoder_problem(spec, record) if spec.arm(record["arm"]).kind == "decoder" else None


def _json(root: Path, name: str) -> Any:
    """A JSON file of the archive; ValueError naming it when it is not JSON."""
    try:
        return read_jsonl(root / name) if name.endswith(".jsonl") else json.loads((root / name).read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{name} is not valid JSON ({error})") from None


def verify(archive: str | Path, key: bytes | None = None) -> list[str]:
    """Problems found in an archive (empty when it verifies): see the module's docstring for what is checked.
    With ``key``, the manifest must also carry its HMAC-SHA256 under that key."""
    root = Path(archive)
    if not (root / MANIFEST).is_file():
        raise FileNotFoundError(f"{root} is not a batch archive (no {MANIFEST})")
    problems = manifest_problems(root) + (signature_problems(root, key) if key is not None else [])
    if problems:
        return problems
    try:
        table = read_table(root / "frozen.json")
    except (OSError, ValueError) as error:
        return [f"frozen.json: {error}"]
    files, spec_file = table.get("files"), table.get("spec_file")
    if not isinstance(files, dict) or not isinstance(spec_file, str) or f"spec/{spec_file}" not in files \
            or unsafe_name(spec_file) or "/" in spec_file:
        return ["frozen.json does not name its spec file among its files"]
    frozen = {key: value for key, value in files.items() if key.startswith("spec/")}
    archived = {name: sha256(root / name) for name in archive_entries(root)[0] if name.startswith("spec/")}
    problems += [f"frozen table vs archived spec: {c}" for c in table_changes(frozen, archived)]
    if problems:
        return problems
    problems = [f"missing file {name}" for name in RUN_OUTPUTS if not (root / name).is_file()]
    extra = sorted(set(archive_entries(root)[0]) - set(archive_names(table, signed=True)))
    if extra:
        problems.append(f"the archive holds files no run writes: {', '.join(extra[:SHOWN])}")
    if problems:
        return problems
    try:
        spec = load_spec(root / "spec" / spec_file)
        documents = {name: _json(root, name) for name in ("run.json", "summary.json", "decisions.json")}
        records = {name: _json(root, name) for name in ("records/positions.jsonl", "records/prompts.jsonl",
                                                          "timings.jsonl")}
    except (OSError, ValueError) as error:
        return [f"the archive does not read back: {error}"]
    run = documents["run.json"]
    problems = frozen_problems(root, table, run) or run_problems(spec, run) or record_problems(spec, records)
    if not problems:
        summary, decisions = analyse(spec, root)
        stored = documents["summary.json"]
        if not isinstance(stored, dict) \
                or {key: value for key, value in stored.items() if key != "measurement"} != summary:
            problems.append("summary.json does not follow from the records")
        elif stored.get("measurement") != documents["run.json"].get("measurement"):
            problems.append("summary.json's measurement is not run.json's")
        if documents["decisions.json"] != decisions:
            problems.append("decisions.json (labels, predictions) does not follow from the records")
    package = {key: value for key, value in files.items() if key.startswith("package/")}
    changes = table_changes(package, {key: sha256(path) for key, path in package_files().items()})
    if problems and changes:  # recomputed with other code than the run's: say so
        problems.append(f"the installed package differs from the archive's ({'; '.join(changes)})")
    return problems


def ledger_rows(archives: Sequence[str | Path], key: bytes | None = None) -> list[dict[str, str]]:
    """Every prediction of the (verified) archives: batch, prediction, outcome (RIPE Appendix B, Table 6). An archive
    given twice (under any spelling of its path, or as a copy: the same manifest) is refused: it would count twice;
    so are two archives of one frozen spec (the same spec files, or the same first freeze), whose records differ (an
    edited copy, or a run again after seeing the first) or not (a replication: a pre-registered batch counts once)."""
    folders: dict[Path, str | Path] = {}
    manifests: dict[str, str | Path] = {}
    for archive in archives:
        folder, manifest = Path(archive).resolve(), Path(archive) / MANIFEST
        if folder in folders:
            raise ValueError(f"archives name {folders[folder]} twice (also as {archive}); the ledger counts each "
                             f"archive once")
        folders[folder] = archive
        digest = sha256(manifest) if manifest.is_file() else None
        if digest in manifests:
            raise ValueError(f"archive {archive} is a copy of {manifests[digest]} (the same {MANIFEST}); the ledger "
                             f"counts each archive once")
        if digest is not None:
            manifests[digest] = archive
    rows, specs = [], {}
    for archive in archives:
        problems = verify(archive, key)
        if problems:
            raise ValueError(f"archive {archive} does not verify ({'; '.join(problems)})")
        _count_once(archive, specs)
        decisions = json.loads((Path(archive) / "decisions.json").read_text())
        rows += [{"Batch": decisions["batch"], "Prediction": p["prediction"],
                  "Outcome": f"{p['outcome']} ({p['observed']})"} for p in decisions["predictions"]]
    return rows


def _count_once(archive: str | Path, seen: dict[Any, str | Path]) -> None:
    """Refuse a (verified) archive of a frozen spec that an archive in ``seen`` already ran; then add it."""
    root = Path(archive)
    table = read_table(root / "frozen.json")
    spec_files = tuple(sorted((k, v) for k, v in table["files"].items() if k.startswith("spec/")))
    keys = (("spec", spec_files), ("first", json.loads((root / "run.json").read_text())["frozen"]["first"]))
    other = next((seen[k] for k in keys if k in seen), None)
    if other is not None:
        same = all(sha256(root / name) == sha256(Path(other) / name) for name in RECORD_FILES)
        raise ValueError(f"archives {other} and {archive} ran one frozen spec (batch {table.get('batch')}) with "
                         f"{'the same' if same else 'different'} records; the ledger counts a pre-registered batch "
                         f"once: give one of them ({PROG_COMPARE} tells how they differ)")
    seen.update(dict.fromkeys(keys, archive))


def ledger(archives: Sequence[str | Path], key: bytes | None = None) -> str:
    """The prediction ledger of several archives as a text table, with a count of held and failed predictions."""
    if not archives:
        raise ValueError("archives must name at least one batch archive")
    rows = ledger_rows(archives, key)
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in ("Batch", "Prediction")}
    lines = [f"{'Batch':<{widths['Batch']}}  {'Prediction':<{widths['Prediction']}}  Outcome"]
    lines += [f"{r['Batch']:<{widths['Batch']}}  {r['Prediction']:<{widths['Prediction']}}  {r['Outcome']}"
              for r in rows]
    held = sum(r["Outcome"].startswith("held") for r in rows)
    lines.append(f"{len(rows)} predictions: {held} held, {len(rows) - held} failed")
    return "\n".join(lines)
