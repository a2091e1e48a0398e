"""A batch's archive: the folder a run writes (the frozen table and spec, per-position and per-prompt records as JSON
lines, timings, the summary, the decisions and ``run.json``) and its checksum manifest, ``MANIFEST.sha256``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from looped_kv.protocol.decide import decide, summarize
from looped_kv.protocol.freeze import read_table, sha256
from looped_kv.protocol.spec import REFERENCE, BatchSpec

MANIFEST = "MANIFEST.sha256"
#: Archive files that differ between runs of one frozen spec by design (the machine, the command, the clock),
#: and the fields that name a record rather than measure it.
RUN_FILES = ("run.json", "timings.jsonl")
RECORD_KEYS = ("prompt", "arm", "position")


def order_records(spec: BatchSpec, records: Iterable[dict]) -> list[dict]:
    """Records sorted by prompt, then arm in spec order (reference first), then position: independent of sharding."""
    rank = {REFERENCE: -1, **{a.name: i for i, a in enumerate(spec.arms)}}
    return sorted(records, key=lambda r: (r["prompt"], rank[r["arm"]], r.get("position", 0)))


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record, allow_nan=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")


def archive_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    """``MANIFEST.sha256``: one "<sha256>  <path>" line per file (``sha256sum -c MANIFEST.sha256`` checks it)."""
    lines = [f"{sha256(root / name)}  {name}" for name in archive_files(root)]
    (root / MANIFEST).write_text("\n".join(lines) + "\n")


def analyse(spec: BatchSpec, root: Path) -> tuple[dict, dict]:
    """Summary and decisions computed from an archive's records, as read back from its files."""
    positions, prompts = read_jsonl(root / "records/positions.jsonl"), read_jsonl(root / "records/prompts.jsonl")
    return summarize(spec, positions, prompts), decide(spec, positions, prompts)


def write_archive(out: Path, spec: BatchSpec, table_path: Path, records: tuple[list, list, list],
                  run: dict[str, Any]) -> dict[str, Any]:
    """Write the archive folder; returns its decisions."""
    out.mkdir(parents=True, exist_ok=True)
    table = read_table(table_path)
    for key in table["files"]:
        if key.startswith("spec/"):
            target = out / key
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(spec.path.parent / key.removeprefix("spec/"), target)
    shutil.copyfile(table_path, out / "frozen.json")
    positions, prompts, timings = records
    write_jsonl(out / "records/positions.jsonl", order_records(spec, positions))
    write_jsonl(out / "records/prompts.jsonl", order_records(spec, prompts))
    write_jsonl(out / "timings.jsonl", order_records(spec, timings))
    summary, decisions = analyse(spec, out)
    write_json(out / "summary.json", {**summary, "measurement": run["measurement"]})
    write_json(out / "decisions.json", decisions)
    write_json(out / "run.json", run)
    write_manifest(out)
    return decisions


