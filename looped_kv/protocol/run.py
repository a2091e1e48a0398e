"""Running a frozen batch: check the table, run the self-tests, run every arm on every prompt (sharded under
``torchrun``) and write the archive (RIPE Sec. 5, "Protocol").

Two measurement modes exist. ``substitution``: teacher-forced replay of texts whose arms substitute a reference
plane into a region of loops (RIPE Sec. 3.1). ``generation``: a greedy reference trajectory per prompt, replayed
token by token through each arm's cache policy and precision (Sec. 5.1), and real decoders (Sec. 5.2).
"""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import looped_kv
from looped_kv.analysis.measure import kl, policy_logits
from looped_kv.analysis.replay import perturbation_size, replay, substitute
from looped_kv.book import DTYPES
from looped_kv.decoding.generate import generate
from looped_kv.decoding.greedy import greedy
from looped_kv.decoding.loop import LogitsRecorder
from looped_kv.protocol import distributed
from looped_kv.protocol.archive import (
    archive_names,
    check_out,
    claim_partial,
    discard_partial,
    publish,
    sign_manifest,
    write_archive,
)
from looped_kv.protocol.freeze import check_table, first_freeze, model_folder, package_digest, package_files, sha256
from looped_kv.protocol.reproducibility import bitwise_rerun
from looped_kv.protocol.selftest import require_selftests
from looped_kv.protocol.spec import REFERENCE, BatchSpec, Unit, units
from looped_kv.runtime.loading import load
from looped_kv.runtime.measurement import measurement_mode
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy


def finite_or_none(x: float) -> float | None:
    """``x``, or None (JSON's null) where it is not finite: a decode's tau or A without a verification is NaN, which
    standard JSON does not have (the records are written with ``allow_nan=False``)."""
    return x if math.isfinite(x) else None


def _encode(model: LoopedLM, text: str) -> torch.Tensor:
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(f"model {getattr(model, 'source', '')!r} has no tokenizer; batches need one for their texts")
    return model.tokenizer(text, return_tensors="pt").input_ids.to(model.device)


def _kl_records(unit: Unit, arm: str, reference: torch.Tensor, logits: torch.Tensor) -> list[dict]:
    divergence = kl(reference, logits)
    if not bool(torch.isfinite(divergence).all()):
        raise ValueError(f"prompt {unit.index}, arm {arm}: the KL is NaN or infinite (the model's logits are not "
                         f"finite); no record is written")
    divergence = divergence.tolist()
    flips = (reference.argmax(-1) != logits.argmax(-1)).tolist()
    return [{"prompt": unit.index, "arm": arm, "position": t, "kl": d, "flip": f}
            for t, (d, f) in enumerate(zip(divergence, flips, strict=True))]


@torch.no_grad()
def _substitution_unit(spec: BatchSpec, model: LoopedLM, unit: Unit, progress: bool) -> tuple[list, list, list]:
    """Reference replay of one text and every substitution arm (RIPE Sec. 3.1)."""
    ids = _encode(model, unit.text)[:, :spec.tokens]
    if ids.shape[1] <= spec.decoded:
        raise ValueError(f"text {unit.index} ({unit.set}) has {ids.shape[1]} tokens; decoded = {spec.decoded} needs "
                         f"more")
    loops = sorted({r for arm in spec.arms for r in (*arm.region, arm.plane)})
    ref = replay(model, ids, spec.num_loops, softmax_dtype=DTYPES[spec.softmax], loops=loops, decoded=spec.decoded)
    first = ref.first_decoded
    positions, prompts = [], [{"prompt": unit.index, "set": unit.set, "arm": REFERENCE, "tokens": ids.shape[1]}]
    for arm in tqdm(spec.arms, desc="arms", leave=False, disable=not progress):
        logits = substitute(model, ref, arm.plane, arm.region, kinds=arm.kinds)
        positions += _kl_records(unit, arm.name, ref.logits[0, first:], logits[0, first:])
        size = float(perturbation_size(ref, arm.plane, arm.region, kinds=arm.kinds)[0])
        prompts.append({"prompt": unit.index, "set": unit.set, "arm": arm.name, "size": size})
    return positions, prompts, []


def _greedy_logits(model: LoopedLM, ids: torch.Tensor, max_new_tokens: int,
                   policy: CachePolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding under ``policy``, keeping the logits of every generated position: the trajectory and the
    reference logits that :func:`~looped_kv.analysis.measure.policy_logits` would recompute from it, in one pass."""
    recorder = LogitsRecorder()
    out = greedy(model, ids, max_new_tokens, policy=policy, observer=recorder)
    return out.tokens, recorder.logits(0).double()


@torch.no_grad()
def _generation_unit(spec: BatchSpec, models: dict[str, LoopedLM], unit: Unit,
                     progress: bool) -> tuple[list, list, list]:
    """A greedy reference trajectory, its sequential replay through every arm, and every decoder (RIPE Sec. 5)."""
    reference = dict(spec.reference)
    ref_model = models[reference.pop("precision")]
    ref_policy = make_policy(reference.pop("cache"), spec.num_loops, **reference)
    ids = _encode(ref_model, unit.text)
    trajectory, ref_logits = _greedy_logits(ref_model, ids, spec.max_new_tokens, ref_policy)
    n = ids.shape[1]
    positions, timings = [], []
    prompts = [{"prompt": unit.index, "set": unit.set, "arm": REFERENCE, "tokens": n,
                "new_tokens": trajectory[0, n:].tolist()}]
    for arm in tqdm(spec.arms, desc="arms", leave=False, disable=not progress):
        model, cache = models[arm.precision], dict(arm.cache)
        if arm.kind == "replay":
            policy = make_policy(cache.pop("cache"), spec.num_loops, **cache)
            positions += _kl_records(unit, arm.name, ref_logits, policy_logits(model, trajectory, n, policy))
            prompts.append({"prompt": unit.index, "set": unit.set, "arm": arm.name})
            continue
        kwargs = dict(max_new_tokens=spec.max_new_tokens, num_loops=spec.num_loops, **cache)
        out = generate(model, ids, method=arm.decoder, **kwargs, **arm.options)
        base = generate(model, ids, method="ar", **kwargs)
        prompts.append({"prompt": unit.index, "set": unit.set, "arm": arm.name,
                        "same_as_greedy": bool(torch.equal(out.tokens, base.tokens)), "tau": finite_or_none(out.tau),
                        "A": finite_or_none(out.mean_accepted), "verifications": out.verifications,
                        "accepted": list(out.accepted), "new_tokens": out.new_tokens[0].tolist()})
        timings.append({"prompt": unit.index, "arm": arm.name, "time_s": out.wall_time,
                        "greedy_time_s": base.wall_time, "new_tokens": out.num_new})
    return positions, prompts, timings


def run_arms(spec: BatchSpec, models: dict[str, LoopedLM], shard: Sequence[Unit],
             progress: bool = True) -> tuple[list, list, list]:
    """Position records, prompt records and timings of every arm on the given prompts."""
    records: tuple[list, list, list] = ([], [], [])
    for unit in tqdm(shard, desc=f"batch {spec.batch} ({spec.name}): prompts", disable=not progress):
        if spec.mode == "substitution":
            part = _substitution_unit(spec, models[spec.dtype], unit, progress)
        else:
            part = _generation_unit(spec, models, unit, progress)
        for kept, new in zip(records, part, strict=True):
            kept.extend(new)
    return records


def _model_source(spec: BatchSpec) -> str:
    folder = model_folder(spec)
    if spec.model == "tiny":
        return "tiny"
    if folder is not None:
        return str(folder)
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id=spec.model, revision=spec.revision,
                             allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (Ctrl-C); its message says where the unfinished archive was left."""


def run_batch(table_path: str | Path, out: str | Path, *, progress: bool = True, threads: int | None = None,
              device: str | None = None, key: bytes | None = None) -> dict[str, Any] | None:
    """Check the frozen table, run the self-tests, run every arm and write the archive ``out``.

    Before the self-tests and any compute, rank 0 creates ``<out>.partial`` with its marker (the probe that ``out``
    can be written; :func:`~looped_kv.protocol.archive.claim_partial`); the finished archive is renamed to ``out``.
    A run that fails before writing removes its empty partial folder; one interrupted (SIGINT) leaves it, marked,
    and raises :class:`Interrupted` saying so. ``key`` signs the manifest (HMAC-SHA256, ``MANIFEST.hmac-sha256``).

    Every process computes with the spec's ``threads`` CPU threads, whatever ``OMP_NUM_THREADS`` or the
    launcher chose; ``threads``, when given, must equal that frozen count. Under ``torchrun`` every
    process checks its own files, runs the self-tests and its shard of the prompts; rank 0 gathers the
    records and writes the archive, which equals a single-process run's byte for byte apart from
    ``run.json`` and ``timings.jsonl`` (see :func:`compare`). Returns the decisions on rank 0, None elsewhere.
    """
    out, table_path = Path(out), Path(table_path)
    check_out(out)
    spec, table = check_table(table_path)
    digest = sha256(table_path)  # the table checked, and the code that runs: the run record names both
    frozen = {"sha256": digest, "first": first_freeze(table, digest),
              "package_sha256": package_digest({key: sha256(path) for key, path in package_files().items()})}
    if threads is not None and threads != spec.threads:
        raise ValueError(f"--threads {threads} contradicts the frozen spec's threads: {spec.threads} (the count "
                         f"changes the records' bytes); allowed: {spec.threads}, or leave --threads out")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ctx = distributed.init(device)
    partial = None
    try:
        if ctx.rank == 0:  # the one writer
            partial = claim_partial(out, archive_names(table, signed=key is not None))
        with measurement_mode(spec.cudnn_sdp, spec.threads) as mode:
            selftests = require_selftests()
            source = _model_source(spec)
            models = {p: load(source, dtype=DTYPES[p], device=ctx.device) for p in spec.precisions}
            shard = distributed.shard(units(spec), ctx)
            rerun = _rerun_check(spec, models[spec.dtype], shard)
            records = run_arms(spec, models, shard, progress=progress and ctx.rank == 0)
        node = {"rank": ctx.rank, "host": socket.gethostname(), "device": str(ctx.device), "prompts": len(shard),
                "selftests": [t.__dict__ for t in selftests], "rerun": rerun}
        gathered = distributed.gather((records, node), ctx)
        if gathered is None:
            return None
        merged = tuple([r for part, _ in gathered for r in part[i]] for i in range(3))
        run = {"package": looped_kv.__version__, "command": sys.argv, "started": started,
               "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), "world_size": ctx.world_size,
               "backend": ctx.backend, "threads": mode["threads"], "measurement": mode, "frozen": frozen,
               "nodes": [n for _, n in gathered], "pid": os.getpid()}
        decisions = write_archive(partial, spec, table_path, merged, run)
        if key is not None:
            sign_manifest(partial, key)
        publish(partial, out)
        return decisions
    except KeyboardInterrupt:
        if partial is None:
            raise
        raise Interrupted(f"interrupted; the unfinished archive is left at {partial} (marked: the next batch run "
                          f"with out {out} replaces it)") from None
    except Exception as error:
        if partial is not None and partial.is_dir():
            discard_partial(partial)
            if partial.is_dir():  # files written: say where they are
                raise ValueError(f"{str(error).strip() or type(error).__name__}; the unfinished archive is left at "
                                 f"{partial} (marked: the next batch run with out {out} replaces it)") from error
        raise
    finally:
        distributed.finish(ctx)


@torch.no_grad()
def _rerun_check(spec: BatchSpec, model: LoopedLM, shard: Sequence[Unit]) -> dict[str, Any] | None:
    """RIPE Sec. 5.5 on the run's own device: two forwards (fused attention) of the first prompt, compared bitwise."""
    if not shard:
        return None
    ids = _encode(model, shard[0].text)
    report = bitwise_rerun(model, ids[:, :spec.tokens] if spec.mode == "substitution" else ids, spec.num_loops)
    return {"identical": report.identical, "equal_fraction": report.equal_fraction,
            "max_abs_diff": report.max_abs_diff}


