"""A batch's archive: the folder a run writes (the frozen table and spec, per-position and per-prompt records as JSON
lines, timings, the summary, the decisions and ``run.json``) and its checksum manifest, ``MANIFEST.sha256``.

A run writes into ``<out>.partial`` and renames it to ``<out>`` once complete, so that a failed run never leaves a
half archive at ``out``. The partial folder carries a marker (:data:`PARTIAL_MARKER`) that lists the files the run
writes; a later run replaces a marked partial folder, deleting only those files, and refuses any other folder at
that path. An archive may also carry an HMAC-SHA256 of its manifest under a user's key (:data:`SIGNATURE`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from looped_kv.protocol.decide import decide, summarize
from looped_kv.protocol.freeze import read_table, sha256
from looped_kv.protocol.spec import REFERENCE, BatchSpec

MANIFEST = "MANIFEST.sha256"
SIGNATURE = "MANIFEST.hmac-sha256"  # hex HMAC-SHA256 of MANIFEST.sha256's bytes under the user's key
PARTIAL_MARKER = "looped-kv-partial.json"
PARTIAL_FORMAT = "looped-kv partial archive 1"
MIN_KEY_BYTES = 16
#: Archive files that differ between runs of one frozen spec by design (the machine, the command, the clock),
#: and the fields that name a record rather than measure it.
RUN_FILES = ("run.json", "timings.jsonl")
RECORD_KEYS = ("prompt", "arm", "position")
#: Every file of an archive but the spec's (under spec/) and the manifest.
RUN_OUTPUTS = ("frozen.json", "records/positions.jsonl", "records/prompts.jsonl", "timings.jsonl", "summary.json",
               "decisions.json", "run.json")


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


def unsafe_name(name: str) -> str | None:
    """Why ``name`` is not a plain relative path inside a folder ("a/b.json"), or None when it is."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    path = PurePosixPath(name)
    if path.is_absolute() or "\\" in name or any(part in ("..", ".") for part in path.parts) or path.as_posix() != name:
        return "not a plain relative path inside the archive"
    return None


def has_link(root: Path, name: str) -> bool:
    """Whether ``root / name`` or a folder on the way to it is a symbolic link."""
    path = root
    for part in PurePosixPath(name).parts:
        path = path / part
        if path.is_symlink():
            return True
    return False


def _entries(root: Path) -> list[tuple[str, str]]:
    """(relative name, "file" | "folder" | "other") of everything below ``root``; links are "other", not followed."""
    found = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        for name in [*dirs, *names]:
            path = here / name
            kind = "folder" if path.is_dir() else "file" if path.is_file() else "other"
            found.append((path.relative_to(root).as_posix(), "other" if path.is_symlink() else kind))
        dirs[:] = [d for d in dirs if not (here / d).is_symlink()]
    return sorted(found)


def archive_entries(root: Path) -> tuple[list[str], list[str]]:
    """The archive's regular files (but the manifest and its signature) and its other entries (symbolic links,
    devices, ...), as relative names."""
    entries = _entries(root)
    files = [name for name, kind in entries if kind == "file" and name not in (MANIFEST, SIGNATURE)]
    return files, [name for name, kind in entries if kind == "other"]


def archive_files(root: Path) -> list[str]:
    return archive_entries(root)[0]


def write_manifest(root: Path) -> None:
    """``MANIFEST.sha256``: one "<sha256>  <path>" line per file (``sha256sum -c MANIFEST.sha256`` checks it); a
    partial folder's marker is not part of the archive."""
    lines = [f"{sha256(root / name)}  {name}" for name in archive_files(root) if name != PARTIAL_MARKER]
    (root / MANIFEST).write_text("\n".join(lines) + "\n")


def read_key(path: str | Path) -> bytes:
    """A signing key: the bytes of a file (at least :data:`MIN_KEY_BYTES`), e.g. from ``head -c 32 /dev/urandom``."""
    try:
        key = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"--key-file {str(path)!r} cannot be read ({error.strerror or error})") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"--key-file {str(path)!r} holds {len(key)} bytes; a key needs at least {MIN_KEY_BYTES}")
    return key


def manifest_hmac(root: Path, key: bytes) -> str:
    return hmac.new(key, (root / MANIFEST).read_bytes(), hashlib.sha256).hexdigest()


def sign_manifest(root: Path, key: bytes) -> None:
    (root / SIGNATURE).write_text(manifest_hmac(root, key) + "\n")


def analyse(spec: BatchSpec, root: Path) -> tuple[dict, dict]:
    """Summary and decisions computed from an archive's records, as read back from its files."""
    positions, prompts = read_jsonl(root / "records/positions.jsonl"), read_jsonl(root / "records/prompts.jsonl")
    return summarize(spec, positions, prompts), decide(spec, positions, prompts)


def archive_names(table: dict[str, Any], signed: bool) -> list[str]:
    """Every file a run writes into its archive, given its frozen table."""
    spec_files = [key for key in table["files"] if key.startswith("spec/")]
    return [*spec_files, *RUN_OUTPUTS, MANIFEST, *([SIGNATURE] if signed else [])]


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


# -- where a run writes ---------------------------------------------------------------------------------------------


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def check_out(out: Path) -> None:
    """``out`` must not exist, or be an empty folder: archives are never overwritten."""
    if out.is_symlink():
        raise ValueError(f"out {out} is a symbolic link; an archive is written to a folder of its own")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out {out} exists and is not an empty folder; archives are never overwritten")


def _marked_files(partial: Path) -> list[str] | None:
    """The files a marked partial folder's run listed, or None when ``partial`` is not a marked partial folder."""
    marker = partial / PARTIAL_MARKER
    if partial.is_symlink() or not partial.is_dir() or marker.is_symlink() or not marker.is_file():
        return None
    try:
        content = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    files = content.get("files") if isinstance(content, dict) and content.get("format") == PARTIAL_FORMAT else None
    if not isinstance(files, list) or any(unsafe_name(name) for name in files):
        return None
    return files


def remove_partial(partial: Path) -> None:
    """Remove a marked partial folder that an earlier run left: only the files its marker lists, and their folders.
    Anything else, or a folder without the marker, is refused and left untouched."""
    listed = _marked_files(partial)
    if listed is None:
        raise ValueError(f"{partial} exists and is not a looped-kv partial archive (no marker {PARTIAL_MARKER}); it is "
                         f"left untouched: move it away or choose another --out")
    folders = {str(parent) for name in listed for parent in PurePosixPath(name).parents if str(parent) != "."}
    entries = _entries(partial)
    ours = {*((name, "file") for name in (*listed, PARTIAL_MARKER)), *((name, "folder") for name in folders)}
    foreign = [name for name, kind in entries if (name, kind) not in ours]
    if foreign:
        raise ValueError(f"{partial} holds files no run wrote ({', '.join(foreign[:3])}); it is left untouched: move "
                         f"them away or choose another --out")
    for name, kind in reversed(entries):  # files before the folders that hold them
        if kind == "folder":
            (partial / name).rmdir()
        else:
            (partial / name).unlink()
    partial.rmdir()


def claim_partial(out: Path, names: list[str]) -> Path:
    """Create ``<out>.partial`` with its marker, listing ``names``: the probe that ``out``'s folder is writable, made
    before any work. A marked partial folder of an earlier run is replaced (:func:`remove_partial`)."""
    partial = partial_path(out)
    if partial.exists() or partial.is_symlink():
        remove_partial(partial)
    marker = {"format": PARTIAL_FORMAT, "archive": out.name, "files": names}
    made = False
    try:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()
        made = True
        (partial / PARTIAL_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    except OSError as error:
        if made:  # the folder this call made, and the marker it began to write
            (partial / PARTIAL_MARKER).unlink(missing_ok=True)
            partial.rmdir()
        raise ValueError(f"out {out}: cannot write there ({error.strerror or error}: {error.filename or partial}); "
                         f"choose another --out") from None
    return partial


def discard_partial(partial: Path) -> None:
    """Remove this run's partial folder if it holds nothing but its marker (the run failed before writing)."""
    if archive_entries(partial) == ([PARTIAL_MARKER], []):
        (partial / PARTIAL_MARKER).unlink()
        partial.rmdir()


def publish(partial: Path, out: Path) -> None:
    """Rename a finished partial folder to ``out`` (which must not exist, or be an empty folder), less its marker."""
    marker = (partial / PARTIAL_MARKER).read_bytes()
    (partial / PARTIAL_MARKER).unlink()
    try:
        partial.rename(out)
    except OSError as error:
        (partial / PARTIAL_MARKER).write_bytes(marker)
        raise ValueError(f"out {out}: the finished archive could not be moved there ({error.strerror or error}); "
                         f"it is left at {partial}") from None
