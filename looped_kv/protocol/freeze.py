"""The frozen file table of a batch (RIPE Appendix A: a frozen file table, SHA-256): the checksums of the spec, its
prompt files, the package's own source files and the local model files, written by :func:`freeze` before a run.
:func:`check_table` refuses a run once any of them has changed.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from looped_kv.protocol.spec import BatchSpec, load_spec
from looped_kv.runtime.loading import TINY_DIR

PACKAGE_DIR = Path(__file__).parents[1]
TABLE_FORMAT = "looped-kv file table 1"
MODEL_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")
def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_folder(spec: BatchSpec) -> Path | None:
    """The local folder of the spec's model, or None for a hub id (which must then pin a ``revision``)."""
    if spec.model == "tiny":
        return TINY_DIR
    path = Path(spec.model).expanduser()
    path = path if path.is_absolute() else spec.path.parent / path
    if path.is_dir():
        return path.resolve()
    if spec.revision is None:
        raise ValueError(f"spec.model {spec.model!r} is not a local folder; a hub id needs spec.revision (the "
                         f"commit to download; RIPE Sec. 5 pins the HF revision of each checkpoint)")
    return None


def package_files() -> dict[str, Path]:
    """The package's own source files, keyed "package/looped_kv/..."."""
    return {f"package/{p.relative_to(PACKAGE_DIR.parent).as_posix()}": p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def file_table(spec: BatchSpec) -> dict[str, str]:
    """SHA-256 of the spec, its prompt files, the package's source files and the local model files."""
    folder = spec.path.parent
    files = {f"spec/{spec.path.name}": spec.path, **{f"spec/{s.file}": folder / s.file for s in spec.prompt_sets}}
    files.update(package_files())
    weights = model_folder(spec)
    if weights is not None:
        found = sorted({p for pattern in MODEL_PATTERNS for p in weights.glob(pattern) if p.is_file()})
        if not any(p.name == "config.json" for p in found):
            raise FileNotFoundError(f"model folder {weights} has no config.json (is the model there?)")
        files.update({f"model/{p.name}": p for p in found})
    return {key: sha256(path) for key, path in sorted(files.items())}


def freeze(spec: str | Path, out: str | Path | None = None, *, force: bool = False) -> Path:
    """Validate a spec and write its file table (default ``<spec name>.frozen.json`` in the working directory)."""
    parsed = load_spec(spec)
    target = Path(out) if out is not None else Path(f"{parsed.path.stem}.frozen.json")
    if target.exists() and not force:
        raise ValueError(f"{target} exists; re-freezing changes the pre-registration, pass force to overwrite")
    table = {"format": TABLE_FORMAT, "spec": str(parsed.path), "spec_file": parsed.path.name,
             "batch": parsed.batch, "model": parsed.model, "revision": parsed.revision,
             "frozen_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": file_table(parsed)}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(table, indent=1) + "\n")
    return target


def read_table(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file table {path} (write one with `looped-kv batch freeze SPEC`)")
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError:
        table = None
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path} is not a looped-kv file table (written by `looped-kv batch freeze`)")
    return table


def table_changes(frozen: dict[str, str], current: dict[str, str]) -> list[str]:
    """Differences between two file tables, as "changed: ...", "missing: ...", "added: ..." lines."""
    changed = sorted(k for k in frozen.keys() & current.keys() if frozen[k] != current[k])
    missing, added = sorted(frozen.keys() - current.keys()), sorted(current.keys() - frozen.keys())
    return [f"{what}: {', '.join(keys)}" for what, keys in (("changed", changed), ("missing", missing),
                                                             ("added", added)) if keys]


def check_table(table_path: str | Path) -> tuple[BatchSpec, dict[str, Any]]:
    """The frozen spec and its table, or ValueError listing every file that changed since ``freeze``."""
    table = read_table(table_path)
    spec = load_spec(table["spec"])
    changes = table_changes(table["files"], file_table(spec))
    if changes:
        raise ValueError(f"file table {table_path} no longer matches ({'; '.join(changes)}); the spec, its prompts, "
                         f"the package or the model changed since it was frozen")
    return spec, table


