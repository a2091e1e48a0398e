"""Where a command writes: the batch runner's rule (:mod:`looped_kv.protocol.archive`) for every other output.

Each path is probed before any work: its folder (or the nearest one that exists) must take a new file. A file or
folder the command did not make is refused unless ``force``: a file output must not exist, and a folder output
must not exist, be empty, or be one the command made (a training run's folder holds its ``checkpoint.pt``, an
exported model's ``config.json`` its training record). Nothing a user made is overwritten without ``force``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path


def probe(path: Path, flag: str, folder: bool = False, remedy: str | None = None) -> None:
    """ValueError naming ``flag`` unless this process can write the file ``path`` (with ``folder``: files in the
    folder ``path``): a file is created and removed in its nearest existing folder. ``remedy`` ends the error
    (default: choose another ``flag``)."""
    remedy = remedy or f"choose another {flag}"
    path = Path(path)
    where = path if folder else path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise ValueError(f"{flag} {path}: {where} is not a folder; {remedy}")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write there ({error.strerror or error}: {where}); {remedy}") from None


def check_file(path: str | Path, flag: str, force: bool = False) -> Path:
    """A file a command writes: not a folder, not an existing file (unless ``force``), in an existing writable
    folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: the folder {path.parent} does not exist or is not writable; create it or "
                         f"choose another {flag}")
    if (path.exists() or path.is_symlink()) and not force:
        raise ValueError(f"{flag} {path} exists and is left untouched; choose another {flag}, or pass --force to "
                         f"overwrite it")
    probe(path, flag)
    return path


def check_folder(path: str | Path, flag: str, ours: Callable[[Path], bool], made_by: str,
                 force: bool = False) -> Path:
    """A folder a command writes into: new, empty, or one it made (``ours(path)``), else refused unless ``force``;
    its place probed. ``made_by`` says what makes a folder the command's, for the error."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a folder")
    if path.is_dir() and any(path.iterdir()) and not ours(path) and not force:
        raise ValueError(f"{flag} {path} holds files this command did not make ({made_by}); it is left untouched: "
                         f"choose another {flag}, or pass --force to write into it")
    probe(path, flag, folder=True)
    return path
