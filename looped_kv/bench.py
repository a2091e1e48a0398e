"""Speed-up benchmarks: every decoder against paired greedy decoding, measured in one run.

Each prompt is decoded by greedy full-depth decoding and by every method in turn, in the same
process, so each method's speed-up is paired with its own greedy reference. The reported
speed-up is DAS Eq. (8): the mean over prompts of (n/t)_method / (n/t)_greedy, prefill
included, with a paired prompt bootstrap interval; A (Eq. 9), G (Eq. 10) and tau come from
the same runs. Configurations are chosen on development prompts and reported on disjoint
evaluation prompts (DAS Appendix A.2).

    python -m looped_kv.bench --workloads problems code --prompts 8
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv import data
from looped_kv.analysis.fits import accepted_length, mean_speedup
from looped_kv.decoding.core import Generation
from looped_kv.decoding.generate import generate
from looped_kv.protocol.reproducibility import measurement_mode
from looped_kv.runtime.loading import load
from looped_kv.runtime.model import LoopedLM

#: Each method's configuration on the shipped tiny model, chosen on development prompts with
#: ``select_configs``: the sequential drafters by chapter 5 (d = 2, gamma = 8), prompt lookup and
#: DAS-Wave by chapter 6 (the paper's schedule gamma 32, J 24, W_init 2, with k = 1).
DEFAULT_METHODS: dict[str, dict] = {
    "greedy": {"method": "ar"},
    "prompt lookup": {"method": "pld", "block": 8},
    "self-spec": {"method": "self-spec", "draft_loops": 2, "block": 8},
    "Mature-Spec": {"method": "mature-spec", "draft_loops": 2, "block": 8},
    "DAS-Wave": {"method": "das-wave", "block": 32, "rounds": 24, "initial_width": 2, "updates": 1},
}


def encode_prompts(model: LoopedLM, workload: str, n: int, split: str) -> list[Tensor]:
    texts = data.prompts(workload, n, split)
    return [model.tokenizer(p, return_tensors="pt").input_ids.to(model.device) for p in texts]


def progress_of(out: Generation) -> float:
    """G of one run (DAS Eq. 10): committed tokens per verification, which is the run's tau."""
    return out.tau


def run_paired(model: LoopedLM, prompts: Sequence[Tensor], methods: dict[str, dict], max_new_tokens: int,
               progress: bool = True) -> pd.DataFrame:
    """One row per (prompt, method): time, tokens/s, tau, A, G, and whether the tokens equal greedy's."""
    generate(model, prompts[0], max_new_tokens=4)  # warm-up
    rows = []
    for i, ids in enumerate(tqdm(prompts, desc="prompts", disable=not progress, leave=False)):
        reference = generate(model, ids, max_new_tokens=max_new_tokens, method="ar")
        for name, kwargs in methods.items():
            out = reference if kwargs.get("method") == "ar" else generate(model, ids, max_new_tokens=max_new_tokens,
                                                                          **kwargs)
            rows.append({"prompt": i, "method": name, "time_s": out.wall_time, "new_tokens": out.num_new,
                         "tokens_per_s": out.tokens_per_s, "greedy_time_s": reference.wall_time,
                         "tau": out.tau, "A": out.mean_accepted, "G": progress_of(out),
                         "verifications": out.verifications, "accepted": out.accepted,
                         "same_as_greedy": bool(torch.equal(out.tokens, reference.tokens))})
    return pd.DataFrame(rows)


def summarize(runs: pd.DataFrame, n_boot: int = 2000) -> pd.DataFrame:
    """Per method: tokens/s, mean speed-up over paired greedy (DAS Eq. 8) with its 95% interval, A, G, tau."""
    out = []
    for name, group in runs.groupby("method", sort=False):
        speed = mean_speedup(group["greedy_time_s"], group["time_s"], n_boot=n_boot)
        accepted = [a for a in group["accepted"] if len(a)]
        out.append({"method": name, "tokens/s": group["tokens_per_s"].mean(), "speed-up": speed.estimate,
                    "low": speed.low, "high": speed.high,
                    "A": accepted_length(accepted) if accepted else float("nan"),
                    "G": group["G"].mean(), "tau": group["tau"].mean(),
                    "same as greedy": f"{int(group['same_as_greedy'].sum())}/{len(group)}"})
    return pd.DataFrame(out).set_index("method")


def select_configs(model: LoopedLM, dev_prompts: Sequence[Tensor], grids: dict[str, list[dict]],
                   max_new_tokens: int, progress: bool = True) -> tuple[dict[str, dict], pd.DataFrame]:
    """For each method, the grid configuration with the highest mean speed-up on development prompts."""
    chosen, tables = {}, []
    for name, grid in grids.items():
        candidates = {f"{name} {i}": config for i, config in enumerate(grid)}
        table = summarize(run_paired(model, dev_prompts, candidates, max_new_tokens, progress), n_boot=200)
        best = table["speed-up"].idxmax()
        chosen[name] = candidates[best]
        table.insert(0, "config", [str(c) for c in candidates.values()])
        tables.append(table)
    return chosen, pd.concat(tables)


def grid(**axes: list) -> list[dict]:
    """All combinations of the given settings, as generate() keyword arguments."""
    keys = list(axes)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny', a checkpoint folder or a hub id (default: tiny)")
    ap.add_argument("--workloads", nargs="+", default=list(data.WORKLOADS), choices=data.WORKLOADS)
    ap.add_argument("--prompts", type=int, default=8, help="evaluation prompts per workload (default: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(DEFAULT_METHODS))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1, see looped_kv.book)")
    args = ap.parse_args(argv)
    if args.prompts < 1:
        ap.error(f"--prompts must be >= 1, got {args.prompts}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    torch.set_num_threads(args.threads)
    model = load(args.model, device="cuda" if torch.cuda.is_available() else None)
    report(model, args.workloads, args.prompts, args.max_new_tokens, args.methods)


def report(model: LoopedLM, workloads: Sequence[str], prompts: int, max_new_tokens: int, methods: Sequence[str],
           progress: bool = True) -> None:
    """Print, per workload, every method's speed-up over paired greedy decoding on ``prompts`` evaluation prompts,
    measured with cuDNN attention off (:func:`looped_kv.protocol.reproducibility.measurement_mode`)."""
    chosen = {name: DEFAULT_METHODS[name] for name in methods}
    pd.set_option("display.width", 160)
    with measurement_mode() as record:
        print(f"model {model.source} on {model.device}; torch {record['torch']}, cuDNN attention: "
              f"{record['cudnn_sdp']}")
        for workload in workloads:
            encoded = encode_prompts(model, workload, prompts, "eval")
            table = summarize(run_paired(model, encoded, chosen, max_new_tokens, progress=progress))
            print(f"\n{workload}: {len(encoded)} evaluation prompts, {max_new_tokens} new tokens each")
            print(table.to_string(float_format=lambda x: f"{x:.2f}"))


if __name__ == "__main__":
    main()
