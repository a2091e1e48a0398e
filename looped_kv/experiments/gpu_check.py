"""Memory and cost of a full-size looped model with random weights: one prepared run for a GPU.

Allocation and timing do not depend on the weights, so a model built from a published config with
random bf16 weights measures the real thing (RIPE Sections 3.4-3.5):

* cache bytes and peak reserved memory of batched greedy decoding at a few batch sizes, against the
  memory model cache(B) + o0 + o1 B fitted on the smallest two (Figure 3);
* the time of one forward of d loops and of R loops at batch 1, against Eq. (8)'s cost assumption
  c(d) = n_pre + d n_core + n_coda.

Every argument is checked before any work (the script is meant to run once, on a rented GPU), the
measurements run inside :func:`looped_kv.runtime.measurement.measurement_mode` (cuDNN attention disabled),
and the JSON records that setting with the torch, CUDA and cuDNN versions.

    looped-kv gpu-check --config huginn-0125 --out gpu_check.json      # on a GPU
    looped-kv gpu-check --config tiny --device cpu --batch-sizes 1 2 3  # anywhere
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import date

import pandas as pd
import torch
from tqdm.auto import tqdm

from looped_kv.analysis import throughput
from looped_kv.analysis.memory_bench import check_memory_model
from looped_kv.analysis.perf import peak_memory
from looped_kv.runtime.config import PRESETS, LoopedConfig
from looped_kv.runtime.loading import TINY_DIR
from looped_kv.runtime.measurement import environment, measurement_mode
from looped_kv.runtime.model import LoopedLM

CONFIGS = {**PRESETS, "tiny": lambda: LoopedConfig.from_file(TINY_DIR / "config.json")}
#: The command that runs :func:`run` (:mod:`looped_kv.cli`'s ``gpu-check``), as a module.


@dataclass(frozen=True)
class Options:
    """One run's settings (``looped-kv gpu-check``'s options, checked there before any work)."""

    config: str  # a key of CONFIGS
    device: str
    batch_sizes: list[int]  # at least 3 distinct; the first 2 fit the memory model
    prompt_tokens: int
    new_tokens: int
    draft_loops: list[int]  # d values to time, each in [1, R - 1]
    repeats: int
    out: str | None  # the JSON file to write, or None


def random_model(config: LoopedConfig, device: str, dtype: torch.dtype) -> LoopedLM:
    with torch.device(device):
        model = LoopedLM(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def time_forward(model: LoopedLM, loops: int, tokens: int, repeats: int) -> float:
    """Median seconds of one forward of ``tokens`` tokens through ``loops`` loops at batch 1."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=model.device)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids, num_loops=loops)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def record_tables(result: dict) -> dict[str, pd.DataFrame]:
    """A recorded run (the JSON this script writes) as tables: peak memory against the memory model per cache and
    batch, and the forward time of d loops against Eq. (8)'s c(d)/c(R)."""
    memory = []
    for cache in ("full", "deepest"):
        entry = result[f"memory {cache}"]
        for cell in entry["cells"]:
            model_peak = peak_memory(cell["batch"], entry["cache_per_seq"], entry["o0"], entry["o1"])
            memory.append({"cache": cache, "B": cell["batch"], "cache GB": cell["cache_bytes"] / 1e9,
                           "peak GB": cell["peak_bytes"] / 1e9, "model GB": model_peak / 1e9,
                           "error": model_peak / cell["peak_bytes"] - 1})
    cost = pd.DataFrame(result["cost check"]).set_index("d")
    cost["ratio measured / Eq. 8"] = cost["measured c(d)/c(R)"] / cost["Eq. 8 c(d)/c(R)"]
    return {"memory": pd.DataFrame(memory).set_index(["cache", "B"]), "cost": cost}


def run(args: Options, config: LoopedConfig) -> None:
    """Measure ``config`` (the config named ``args.config``) with random weights; print the JSON, and write it to
    ``args.out`` if given."""
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(config, args.device, dtype)
    R = config.mean_recurrence
    prompts = [torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device=args.device)
               for _ in range(max(args.batch_sizes))]
    result: dict = {"date": date.today().isoformat(), "config": args.config, "device": args.device,
                    "card": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu",
                    "weights": "random (allocation and timing do not depend on them)", "dtype": str(dtype),
                    "environment": environment()}
    with measurement_mode() as record:
        result["measurement mode"] = record
        for cache in ("full", "deepest"):
            cells = throughput.memory_cells(model, prompts, args.batch_sizes, "ar", cache,
                                         max_new_tokens=args.new_tokens, progress=True)
            check = check_memory_model(cells, fit_on=args.batch_sizes[:2], budget=float(cells[-1].peak_bytes))
            result[f"memory {cache}"] = {"cells": [vars(c) for c in cells], "o0": check.fit.o0,
                                         "o1": check.fit.o1, "cache_per_seq": check.fit.cache_per_seq,
                                         "max_held_out_error": check.max_held_out_error}
        full = time_forward(model, R, 1, args.repeats)
        result["forward seconds"] = {R: full}
        result["cost check"] = []
        for d in tqdm(args.draft_loops, desc="forward time against d", leave=False):
            seconds = time_forward(model, d, 1, args.repeats)
            result["forward seconds"][d] = seconds
            result["cost check"].append({"d": d, "measured c(d)/c(R)": seconds / full,
                                         "Eq. 8 c(d)/c(R)": config.layer_passes(d) / config.layer_passes(R)})
    text = json.dumps(result, indent=1, default=float)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
