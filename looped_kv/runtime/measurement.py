"""Measurement mode (RIPE Section 5.5): the settings every measurement runs under, and the device checks.

RIPE's batch 4 found that a bf16 full-cache reference on a GH200 was not reproducible: a
same-process rerun matched bitwise at only 30% of positions. Batch 6b traced this to cuDNN's
scaled-dot-product attention backend; with it disabled, reruns were bitwise identical across
processes and nodes. :func:`measurement_mode` therefore disables that backend for measurement
runs (every pre-registered batch, benchmark and experiment runs inside it) and, given a count, pins torch's
intra-op CPU threads: reductions split across threads add in another order, so logits drift in their last
bits with the count torch picks by itself (1 per process under ``torchrun``, one per core alone;
batches pin the count their spec names). It returns a record that says both. :func:`check_device` validates a
device name before any work, and :func:`environment` records the versions a measurement ran under.
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def available_devices() -> list[str]:
    """The torch devices this process can use: cpu, and cuda (cuda:0, ...) and mps when available."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def check_device(name: str, parameter: str = "--device") -> str:
    """Return ``name`` if it is a torch device this process can use; else a ValueError naming ``parameter``.

    Catches what torch would otherwise report late and as a traceback: a malformed name
    (``"foo"``), a backend torch was built without or that has no device here (``"cuda"`` on a
    CPU-only build), a device index past the device count (``"cuda:3"`` on one GPU), and ``"meta"``.
    """
    available = ", ".join(available_devices())
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{parameter} {name!r} is not a torch device name; available here: {available}") from None
    if device.type == "cpu":
        return name
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available) or not is_available():
        raise ValueError(f"{parameter} {name!r}: no {device.type} device is available to this torch "
                         f"({torch.__version__}); available here: {available}")
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise ValueError(f"{parameter} {name!r}: only {count()} {device.type} device(s) here; available here: "
                         f"{available}")
    return name


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo, else what the platform module says)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


#: This package's folder, whose files a recorded measurement's commit describes (:func:`source_commit`).
PACKAGE = Path(__file__).resolve().parent.parent


def source_commit(package: Path = PACKAGE) -> str:
    """What a recorded measurement ran: the commit of ``package`` (default this package's folder; ``git describe
    --always``), with "-dirty" where the package's own files differ from it (not the data, chapters or records
    elsewhere in the checkout, which a chain of recorded runs writes as it goes), or "unknown" outside a checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=package).stdout.strip()

    try:
        described = git("describe", "--always")
        changed = bool(described) and bool(git("status", "--porcelain", "--", "."))
    except OSError:  # no git on this machine
        return "unknown"
    return described + ("-dirty" if changed else "") if described else "unknown"


def environment() -> dict[str, Any]:
    """Versions a measurement ran under: torch, CUDA and cuDNN (None when absent), the CPU and the device names."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    record: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
                              "cpu": cpu_model()}
    if torch.cuda.is_available():
        record["cuda devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return record


@contextmanager
def measurement_mode(cudnn_sdp: bool = False, threads: int | None = None) -> Iterator[dict[str, Any]]:
    """Run the block with cuDNN's SDPA backend disabled (unless ``cudnn_sdp``) and, when ``threads`` is given, that
    many intra-op CPU threads; yields :func:`environment`'s record with both settings added.

    ``threads`` is applied whatever ``OMP_NUM_THREADS`` or the launcher chose (``None`` keeps the
    current count, which the record names). Without CUDA there is no cuDNN attention and that setting
    is left alone; the record says so. Both previous settings are restored on exit.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads or previous_threads)
    record = {**environment(), "threads": torch.get_num_threads()}
    previous_sdp = torch.backends.cuda.cudnn_sdp_enabled() if torch.cuda.is_available() else None
    if previous_sdp is None:
        record["cudnn_sdp"] = "not applicable (no CUDA device)"
    else:
        record["cudnn_sdp"] = "enabled (requested by the spec)" if cudnn_sdp else "disabled (RIPE Section 5.5)"
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    try:
        yield record
    finally:
        torch.set_num_threads(previous_threads)
        if previous_sdp is not None:
            torch.backends.cuda.enable_cudnn_sdp(previous_sdp)
