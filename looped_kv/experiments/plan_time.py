"""Record the plan's time of every chapter on this CPU (``looped-kv plan-time``; :mod:`looped_kv.analysis.plan_time`).

Each chapter's calls (the plan check's, :data:`looped_kv.experiments.plan_check.RUNS`, at the profile's sizes) are
counted on the model's narrow stand-in (:func:`~looped_kv.analysis.plan_time.stand_in`), then every counted kind of
call is priced at the model's dimensions, with random weights, on this machine. The record holds the counts, the
prices, each chapter's predicted seconds, the machine (CPU, threads, torch), the command, the commit and the date:

    looped-kv plan-time --model parcae-140m --out book/data/plan-time-parcae-140m-cpu.json

``tests/test_plan_time.py`` reads it beside the plan check's record of the same machine
(``book/data/plan-check-parcae-140m-cpu.json``) and holds each chapter's prediction to 25% of its measured seconds.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import date
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from looped_kv import profiles
from looped_kv.analysis.plan_time import (
    BlockCost,
    Call,
    calls_to_rows,
    counting,
    parts,
    predict,
    rows_to_calls,
    stand_in,
    time_blocks,
)
from looped_kv.experiments.gpu_check import random_model
from looped_kv.experiments.plan_check import RUNS
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.measurement import measurement_mode, source_commit
from looped_kv.runtime.model import LoopedLM


def _cpu_model(config: LoopedConfig, dtype: torch.dtype) -> LoopedLM:
    return random_model(config, "cpu", dtype)


def count(config: LoopedConfig, profile: profiles.Profile, chapters: list[str],
          progress: bool = True) -> tuple[dict[str, Counter[Call]], dict[str, float]]:
    """Each chapter's calls at ``profile``, counted on ``config``'s stand-in (random weights, in the profile's dtype),
    and the seconds the stand-in spent outside them (the rest)."""
    model = random_model(stand_in(config), "cpu", getattr(torch, profile.dtype))
    work, rest = {}, {}
    for chapter in tqdm(chapters, desc="counting each chapter's calls (stand-in)", disable=not progress):
        start = time.perf_counter()
        with counting() as calls:
            RUNS[chapter](model, profile)
        work[chapter], rest[chapter] = Counter(calls), time.perf_counter() - start - calls.inside
    return work, rest


def table(work: dict[str, Counter[Call]], rest: dict[str, float], cost: BlockCost) -> pd.DataFrame:
    """Per chapter: its calls, its predicted minutes, and the minutes of causal blocks, cache blocks, the head and
    the rest."""
    rows = [{"chapter": chapter, "calls": sum(calls.values()), "minutes": (predict(calls, cost) + rest[chapter]) / 60,
             **{f"{part} min": s / 60 for part, s in parts(calls, cost).items()}, "rest min": rest[chapter] / 60}
            for chapter, calls in work.items()]
    return pd.DataFrame(rows).set_index("chapter").fillna(0.0)


def run(model_name: str, config: LoopedConfig, profile: str | None, chapters: list[str], out: Path,
        command: str, progress: bool = True) -> dict:
    """Count, price and record (see the module docstring); ``out`` is checked by the caller."""
    chosen = profiles.PROFILES[profile or profiles.name_for(config, model_name, None)]
    commit = source_commit()
    with measurement_mode() as environment:
        work, rest = count(config, chosen, chapters, progress)
        calls = set().union(*work.values())
        cost = time_blocks(config, calls, _cpu_model, progress)
    record = {"model": model_name, "profile": chosen.name, "environment": environment, "command": command,
              "commit": commit, "date": date.today().isoformat(), "stand-in width": stand_in(config).n_embd,
              "prices": cost.to_dict(),
              "chapters": [{"chapter": chapter, "predicted seconds": predict(calls, cost) + rest[chapter],
                            "rest seconds": rest[chapter], "calls": calls_to_rows(calls)}
                           for chapter, calls in work.items()]}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{model_name} at profile {chosen.name}, {environment['threads']} thread(s), {environment['cpu']}:")
    print(table(work, rest, cost).to_string(float_format=lambda x: f"{x:.2f}"))
    print(f"recorded in {out}")
    return record


def read(path: str | Path) -> tuple[dict, BlockCost, dict[str, Counter[Call]]]:
    """A record of :func:`run`: its header, its prices and each chapter's counted calls."""
    record = json.loads(Path(path).read_text())
    missing = [k for k in ("prices", "chapters", "environment") if k not in record]
    if missing:
        raise ValueError(f"{path} is not a record of looped-kv plan-time: it lacks {missing}")
    work = {row["chapter"]: rows_to_calls(row["calls"]) for row in record["chapters"]}
    return record, BlockCost.from_dict(record["prices"]), work


def planned_seconds(record: dict, cost: BlockCost, work: dict[str, Counter[Call]]) -> dict[str, float]:
    """Each chapter's predicted seconds in a record of :func:`run` (what :func:`read` returns), computed from its
    counts, prices and rest."""
    return {row["chapter"]: predict(work[row["chapter"]], cost) + row["rest seconds"] for row in record["chapters"]}
