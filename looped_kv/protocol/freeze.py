"""The frozen file table of a batch (RIPE Appendix A: a frozen file table, SHA-256): the checksums of the spec, its
prompt files, the package's own source files and the local model files, written by :func:`freeze` before a run.
:func:`check_table` refuses a run once any of them has changed.

The table's own SHA-256 is the pre-registration's fingerprint. A table frozen again over an earlier one (``force``)
lists the earlier tables' hashes (``earlier``, the first freeze first), so the first freeze's hash stays in every
later table; a run records both the table's hash and the first freeze's (:func:`first_freeze`).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from looped_kv.protocol.spec import BatchSpec, load_spec
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.loading import TINY_DIR, hub_unreachable, load_tokenizer

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


def model_files(spec: BatchSpec) -> Path:
    """The folder with the spec's model config.json and tokenizer: the local folder, or for a hub id those small files
    of the pinned revision (downloaded; no weights)."""
    folder = model_folder(spec)
    if folder is not None:
        return folder
    reason = hub_unreachable()
    if reason:
        raise ValueError(f"spec.model {spec.model!r}: freeze checks the spec against the model's config.json and "
                         f"tokenizer, and {reason}")
    from huggingface_hub import snapshot_download

    patterns = [p for p in MODEL_PATTERNS if p != "*.safetensors"]
    try:
        return Path(snapshot_download(repo_id=spec.model, revision=spec.revision, allow_patterns=patterns))
    except Exception as error:  # unknown id or revision, no network, ...: one line instead of a traceback
        raise ValueError(f"spec.model {spec.model!r} at spec.revision {spec.revision!r}: its config.json and "
                         f"tokenizer could not be fetched ({type(error).__name__})") from None


def check_runnable(spec: BatchSpec) -> None:
    """Refuse, naming the spec field, what could only fail at run time, after the self-tests: a model without a
    tokenizer, texts shorter than ``tokens`` (they would run at their own length), and sequences or sinks beyond
    the model's context (``block_size``): ``tokens``, or prompt + ``max_new_tokens`` + a decoder's draft block."""
    folder = model_files(spec)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json (is the model there?)")
    context = LoopedConfig.from_file(folder / "config.json").block_size
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"spec.model {spec.model!r} has no tokenizer (tokenizer.json or tokenizer_config.json in "
                         f"{folder}); a batch's prompts are texts")
    beyond = f"beyond the model's context (block_size {context})"
    arms = [(f"arms[{i}] ({a.name})", a) for i, a in enumerate(spec.arms)]
    for where, keywords in [("spec.reference", spec.reference), *((where, arm.cache) for where, arm in arms)]:
        if keywords.get("sinks", 0) > context:
            raise ValueError(f"{where}.sinks {keywords['sinks']} is {beyond}")
    if spec.mode == "substitution" and spec.tokens > context:
        raise ValueError(f"spec.tokens {spec.tokens} is {beyond}")
    # a drafting decoder's cache holds a draft block and its anchor beyond the prompt and the new tokens
    margins = [(f"{where}.{'max_width' if arm.decoder == 'das-wave' else 'gamma'}", arm.verify_width + 1)
               for where, arm in arms if arm.verify_width is not None]
    for i, prompt_set in enumerate(spec.prompt_sets):
        for j, text in enumerate(prompt_set.texts):
            n = len(tokenizer(text).input_ids)
            where = f"prompts[{i}] ({prompt_set.name}) file {prompt_set.file!r}, text {j}"
            if spec.mode == "substitution":
                if n < spec.tokens:
                    raise ValueError(f"{where} has {n} tokens, fewer than spec.tokens = {spec.tokens} (every text is "
                                     f"cut to tokens; a shorter one would run at its own length)")
                continue
            if n < 1:
                raise ValueError(f"{where} has no tokens")
            if n + spec.max_new_tokens > context:
                raise ValueError(f"spec.max_new_tokens {spec.max_new_tokens}: {where} has {n} tokens, and "
                                 f"{n} + {spec.max_new_tokens} = {n + spec.max_new_tokens} positions are {beyond}")
            for field, margin in margins:
                if n + spec.max_new_tokens + margin > context:
                    raise ValueError(f"{field}: {where} has {n} tokens; with spec.max_new_tokens = "
                                     f"{spec.max_new_tokens} and a draft block of {field.rsplit('.', 1)[1]} + 1 = "
                                     f"{margin} the cache holds "
                                     f"{n + spec.max_new_tokens + margin} positions, {beyond}")


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
    """Validate a spec, check it against its model (:func:`check_runnable`) and write its file table (default
    ``<spec name>.frozen.json`` in the working directory)."""
    parsed = load_spec(spec)
    check_runnable(parsed)
    target = Path(out) if out is not None else Path(f"{parsed.path.stem}.frozen.json")
    if target.exists() and not force:
        raise ValueError(f"{target} exists; re-freezing changes the pre-registration, pass force to overwrite")
    earlier = []
    if target.exists():  # frozen again: the chain of earlier tables goes on (a file that is no table starts none)
        try:
            earlier = [*read_table(target).get("earlier", []), sha256(target)]
        except (OSError, ValueError):
            earlier = []
    table = {"format": TABLE_FORMAT, "spec": str(parsed.path), "spec_file": parsed.path.name,
             "batch": parsed.batch, "model": parsed.model, "revision": parsed.revision,
             "frozen_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": file_table(parsed),
             **({"earlier": earlier} if earlier else {})}
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


def first_freeze(table: dict[str, Any], digest: str) -> Any:
    """The hash of a table's first freeze: the first of its ``earlier`` tables, else its own ``digest``."""
    earlier = table.get("earlier")
    return earlier[0] if isinstance(earlier, list) and earlier else digest


def package_digest(files: dict[str, str]) -> str:
    """One SHA-256 over a file table's package entries ("<sha256>  <key>" lines, sorted by key): the code's hash."""
    lines = "".join(f"{digest}  {key}\n" for key, digest in sorted(files.items()) if key.startswith("package/"))
    return hashlib.sha256(lines.encode()).hexdigest()


def table_changes(frozen: dict[str, str], current: dict[str, str]) -> list[str]:
    """Differences between two file tables, as "changed: ...", "missing: ...", "added: ..." lines."""
    changed = sorted(name for name in frozen.keys() & current.keys() if frozen[name] != current[name])
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


