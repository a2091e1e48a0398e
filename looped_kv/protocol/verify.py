"""Verifying a batch's archive and printing the prediction ledger of verified archives (RIPE Appendix B)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from looped_kv.protocol.archive import MANIFEST, analyse, archive_files
from looped_kv.protocol.freeze import package_files, read_table, sha256, table_changes
from looped_kv.protocol.spec import load_spec


def verify(archive: str | Path) -> list[str]:
    """Problems found in an archive (empty when it verifies).

    Checks every line of the manifest, that no file is unlisted, that the archived spec and prompts are
    the frozen ones, and that the summary and the labels follow from the records.
    """
    root = Path(archive)
    if not (root / MANIFEST).is_file():
        raise FileNotFoundError(f"{root} is not a batch archive (no {MANIFEST})")
    problems, listed = [], {}
    for line in (root / MANIFEST).read_text().splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
        if not (root / name).is_file():
            problems.append(f"missing file {name}")
        elif sha256(root / name) != digest:
            problems.append(f"checksum mismatch: {name}")
    problems += [f"unlisted file {name}" for name in archive_files(root) if name not in listed]
    if problems:
        return problems
    table = read_table(root / "frozen.json")
    frozen = {k: v for k, v in table["files"].items() if k.startswith("spec/")}
    archived = {k: sha256(root / k) for k in frozen if (root / k).is_file()}
    problems += [f"frozen table vs archived spec: {c}" for c in table_changes(frozen, archived)]
    if problems:
        return problems
    spec = load_spec(root / "spec" / table["spec_file"])
    summary, decisions = analyse(spec, root)
    stored_summary = json.loads((root / "summary.json").read_text())
    if {k: v for k, v in stored_summary.items() if k != "measurement"} != summary:
        problems.append("summary.json does not follow from the records")
    if json.loads((root / "decisions.json").read_text()) != decisions:
        problems.append("decisions.json (labels, predictions) does not follow from the records")
    package = {k: v for k, v in table["files"].items() if k.startswith("package/")}
    changes = table_changes(package, {key: sha256(path) for key, path in package_files().items()})
    if problems and changes:  # recomputed with other code than the run's: say so
        problems.append(f"the installed package differs from the archive's ({'; '.join(changes)})")
    return problems


def ledger_rows(archives: Sequence[str | Path]) -> list[dict[str, str]]:
    """Every prediction of the (verified) archives: batch, prediction, outcome (RIPE Appendix B, Table 6)."""
    rows = []
    for archive in archives:
        problems = verify(archive)
        if problems:
            raise ValueError(f"archive {archive} does not verify ({'; '.join(problems)})")
        decisions = json.loads((Path(archive) / "decisions.json").read_text())
        rows += [{"Batch": decisions["batch"], "Prediction": p["prediction"],
                  "Outcome": f"{p['outcome']} ({p['observed']})"} for p in decisions["predictions"]]
    return rows


def ledger(archives: Sequence[str | Path]) -> str:
    """The prediction ledger of several archives as a text table, with a count of held and failed predictions."""
    if not archives:
        raise ValueError("archives must name at least one batch archive")
    rows = ledger_rows(archives)
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in ("Batch", "Prediction")}
    lines = [f"{'Batch':<{widths['Batch']}}  {'Prediction':<{widths['Prediction']}}  Outcome"]
    lines += [f"{r['Batch']:<{widths['Batch']}}  {r['Prediction']:<{widths['Prediction']}}  {r['Outcome']}"
              for r in rows]
    held = sum(r["Outcome"].startswith("held") for r in rows)
    lines.append(f"{len(rows)} predictions: {held} held, {len(rows) - held} failed")
    return "\n".join(lines)
