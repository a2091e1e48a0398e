"""A batch sharded across two CPU processes by torchrun (gloo) writes the archive a single process writes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch
from test_batches import model_source, small_spec  # noqa: F401  (model_source is a fixture)

from looped_kv import batches, distributed

torch.set_num_threads(1)  # small models: more threads only add contention
VARYING = {"run.json", "timings.jsonl", "MANIFEST.sha256"}  # the machine, the clock and their checksums


def test_single_process_context_and_sharding(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = distributed.init("cpu")
    assert (ctx.rank, ctx.world_size, ctx.backend, str(ctx.device)) == (0, 1, None, "cpu")
    assert distributed.shard(list(range(5)), ctx) == [0, 1, 2, 3, 4] and distributed.gather("x", ctx) == ["x"]
    two = [distributed.Context(r, 2, r, ctx.device, "gloo") for r in range(2)]
    assert [distributed.shard(list(range(5)), c) for c in two] == [[0, 2, 4], [1, 3]]


def test_records_are_ordered_independently_of_the_shards(tmp_path):
    spec = batches.load_spec(small_spec(tmp_path, "tiny", "generation"))
    records = [{"prompt": p, "arm": a, "position": t} for p in range(3) for a in ("reference", "same", "spec")
               for t in range(2)]
    shuffled = random.Random(0).sample(records, len(records))
    assert batches._order(spec, shuffled) == records


def test_two_processes_write_the_single_process_archive(tmp_path, model_source):  # noqa: F811
    table = batches.freeze(small_spec(tmp_path / "spec", model_source, "generation"), tmp_path / "t.json")
    batches.run_batch(table, tmp_path / "one", progress=False, threads=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "looped_kv.cli", "batch", "run", str(table), "--out", str(tmp_path / "two"),
                             "--quiet", "--threads", "1"], capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = tmp_path / "one", tmp_path / "two"
    names = sorted(p.relative_to(one).as_posix() for p in one.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(two).as_posix() for p in two.rglob("*") if p.is_file())
    for name in set(names) - VARYING:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert batches.verify(two) == []
    run = json.loads((two / "run.json").read_text())
    assert run["world_size"] == 2 and run["backend"] == "gloo"
    assert [node["prompts"] for node in run["nodes"]] == [2, 1]
    assert all(t["passed"] for node in run["nodes"] for t in node["selftests"])
    assert Path(two / "records/prompts.jsonl").read_text().count('"arm": "spec"') == 3
