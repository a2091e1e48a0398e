"""Comparing two archives of one frozen spec: identical byte for byte, or per metric how many values differ and the
largest numeric difference (a run alone against one under ``torchrun``, or a replication)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looped_kv.protocol.archive import MANIFEST, RECORD_KEYS, RUN_FILES, archive_files, read_jsonl
from looped_kv.protocol.freeze import read_table, table_changes

_ABSENT = object()  # a value one archive has and the other lacks


def _show(value: Any) -> str:
    """A value as JSON (floats to their last digit), cut to 60 characters."""
    text = "absent" if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Difference:
    """How one metric (a field of the records, of summary.json or of decisions.json) differs between two archives."""

    file: str
    metric: str
    differing: int  # values that differ
    compared: int  # values of the metric in either archive
    largest: float | None  # the largest |a - b| over values that are numbers in both (None: no such pair differs)
    where: str  # the record or key of that difference, else of the first differing value
    values: tuple[Any, Any] | None = None  # the two values there

    def __str__(self) -> str:
        size = f"largest difference {self.largest:.3g} at" if self.largest is not None else "first at"
        shown = f" ({_show(self.values[0])} vs {_show(self.values[1])})" if self.values is not None else ""
        return f"{self.file} {self.metric}: {self.differing} of {self.compared} differ, {size} {self.where}{shown}"


@dataclass(frozen=True)
class Comparison:
    """Two archives of one frozen spec compared byte for byte (:func:`compare`)."""

    first: Path
    second: Path
    files: tuple[str, ...]  # the files compared
    differing_files: tuple[str, ...]
    differences: tuple[Difference, ...]  # per file and metric
    table_changes: tuple[str, ...]  # package or model files frozen with other checksums

    @property
    def identical(self) -> bool:
        return not self.differing_files

    def report(self) -> str:
        """One line for the verdict, one per differing metric and one per package or model change."""
        head = f"{self.first} vs {self.second}: {len(self.files)} files of one frozen spec compared"
        if self.identical:
            lines = [f"{head}, identical byte for byte ({', '.join(RUN_FILES)} and frozen.json left out)"]
        else:
            lines = [f"{head}, {len(self.differing_files)} differ: {', '.join(self.differing_files)}"]
            lines += [f"  {d}" for d in self.differences]
        lines += [f"  frozen with other package or model files: {c}" for c in self.table_changes]
        return "\n".join(lines)


def _leaves(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, value) of every leaf of a JSON document; a list of numbers or strings is one leaf."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        for i, value in enumerate(obj):
            yield from _leaves(value, (*path, str(i)))
    else:
        yield path, obj


def _values(path: Path) -> dict[tuple[str, str], Any]:
    """(metric, where) -> value: a JSON-lines record's fields where its prompt, arm and position say, a JSON
    document's leaves (metric: the last key) where their path says."""
    if path.suffix == ".jsonl":
        values = {}
        for record in read_jsonl(path):
            where = ", ".join(f"{key} {record[key]}" for key in RECORD_KEYS if key in record)
            values |= {(key, where): value for key, value in record.items() if key not in RECORD_KEYS}
        return values
    return {(keys[-1] if keys else "document", ".".join(keys[:-1]) or "the top level"): value
            for keys, value in _leaves(json.loads(path.read_text()))}


def _numeric(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _file_differences(name: str, a: Path, b: Path) -> list[Difference]:
    """Per metric, how file ``name`` differs between two archives (``a`` and ``b``, one of which may be absent)."""
    if not (a.is_file() and b.is_file()):
        return [Difference(name, "file", 1, 1, None, f"absent from the {'first' if not a.is_file() else 'second'} "
                                                     f"archive")]
    try:
        first, second = _values(a), _values(b)
    except (json.JSONDecodeError, UnicodeDecodeError):  # not JSON (the spec's YAML, a damaged file)
        return [Difference(name, "bytes", 1, 1, None, "the whole file")]
    groups: dict[str, list[tuple[str, Any, Any]]] = {}
    for key in [*first, *(name for name in second if name not in first)]:
        groups.setdefault(key[0], []).append((key[1], first.get(key, _ABSENT), second.get(key, _ABSENT)))
    found = []
    for metric, rows in groups.items():
        differing = [(where, x, y) for where, x, y in rows if x != y or type(x) is not type(y)]
        if not differing:
            continue
        numeric = [(abs(x - y), where, x, y) for where, x, y in differing if _numeric(x) and _numeric(y)]
        largest, where, x, y = max(numeric, key=lambda row: row[0]) if numeric else (None, *differing[0])
        found.append(Difference(name, metric, len(differing), len(rows), largest, where, (x, y)))
    return found or [Difference(name, "bytes", 1, 1, None, "the layout (every value is the same)")]


def compare(first: str | Path, second: str | Path) -> Comparison:
    """Whether two archives of one frozen spec agree byte for byte; where a file does not, per metric, how many
    values differ and the largest numeric difference.

    Every file is compared except ``run.json`` and ``timings.jsonl`` (the machine, the command, the clock)
    and ``frozen.json`` (when the spec was frozen), whose file table is compared instead: the spec's files
    must be the same (ValueError otherwise), and package or model files frozen with other checksums are
    listed. A pinned thread count (the spec's ``threads``) makes a run alone and one under ``torchrun``
    identical. Integrity is :func:`verify`'s job.
    """
    roots = Path(first), Path(second)
    for root in roots:
        if not (root / MANIFEST).is_file():
            raise FileNotFoundError(f"{root} is not a batch archive (no {MANIFEST})")
    tables = [read_table(root / "frozen.json")["files"] for root in roots]
    spec_changes = table_changes(*({key: value for key, value in t.items() if key.startswith("spec/")} for t in tables))
    if spec_changes:
        raise ValueError(f"{first} and {second} are archives of different frozen specs ({'; '.join(spec_changes)}); "
                         f"compare only archives of one frozen spec")
    others = table_changes(*({key: value for key, value in t.items() if not key.startswith("spec/")} for t in tables))
    names = sorted((set(archive_files(roots[0])) | set(archive_files(roots[1]))) - {*RUN_FILES, "frozen.json"})
    differing, differences = [], []
    for name in names:
        a, b = roots[0] / name, roots[1] / name
        if a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes():
            continue
        differing.append(name)
        differences += _file_differences(name, a, b)
    return Comparison(roots[0], roots[1], tuple(names), tuple(differing), tuple(differences), tuple(others))


