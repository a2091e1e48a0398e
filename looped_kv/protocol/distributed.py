"""Sharding a batch's prompts across processes, GPUs and nodes with ``torchrun`` (torch.distributed).

Launch the ordinary command under ``torchrun``; nothing else changes::

    torchrun --nproc-per-node 8 -m looped_kv.cli batch run windows.frozen.json --out runs/windows

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; :func:`init` then joins the process
group (NCCL on GPUs, one GPU per process; gloo on CPUs). Prompt i goes to rank i mod world size;
every rank checks its own file table and runs the self-tests (RIPE Section 5, "Protocol": self-tests
on every node), and rank 0 gathers the records, which the archive writer orders by prompt, arm and
position, so that the archive equals a single-process run's (:mod:`looped_kv.protocol.batches`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Context:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None for a single process


def init(device: str | None = None) -> Context:
    """Join the ``torchrun`` process group when ``WORLD_SIZE`` > 1; a single-process context otherwise.

    ``device`` defaults to this process's GPU (``cuda:LOCAL_RANK``) when CUDA is available, else the CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    if device is None:
        device = f"cuda:{local_rank}" if cuda else "cpu"
    elif device == "cuda":
        device = f"cuda:{local_rank}"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    if world_size == 1:
        return Context(0, 1, 0, torch.device(device), None)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Context(rank, world_size, local_rank, torch.device(device), backend)


def shard(items: Sequence[T], ctx: Context) -> list[T]:
    """This rank's items: every ``world_size``-th, starting at ``rank``."""
    return list(items[ctx.rank::ctx.world_size])


def gather(obj: Any, ctx: Context) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0 (None on the other ranks)."""
    if ctx.world_size == 1:
        return [obj]
    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def finish(ctx: Context) -> None:
    """Leave the process group (after a barrier, so that no rank exits while rank 0 still writes)."""
    if ctx.world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
