"""The looped-kv command: generate, bench, batched, memory, plan, pre-registered batches, the experiments' scripts
and the tiny model's training.

    looped-kv generate --method mature-spec --cache ripe --window 16 "Question: ... Answer:"
    looped-kv bench --workloads problems --prompts 32 --methods ar self-spec mature-spec
    looped-kv batched --batch-sizes 1 2 4 8 --budget-mb 24
    looped-kv memory --model huginn-0125 --context 1024 4096
    looped-kv plan --model huginn-0125 --gpu-memory 40    # does every chapter fit one GPU?
    looped-kv batch freeze regions                     # the shipped example, or a spec file
    looped-kv batch run regions.frozen.json --out runs/regions
    looped-kv batch verify runs/regions
    looped-kv batch compare runs/regions runs/regions-torchrun   # byte for byte, else the largest differences
    looped-kv batch ledger runs/regions runs/windows
    looped-kv speed --reference ../recurrent-pretraining
    looped-kv pass-cost --out book/data/pass-cost-tiny.json
    looped-kv gpu-check --config huginn-0125 --out gpu_check.json
    looped-kv plan-check --model huginn-0125 --out plan_check.json
    looped-kv train --out runs/tiny
    looped-kv gates
    looped-kv scout --list

Errors are one line on stderr (looped-kv <command>: error: ...) and exit status 2 (3 when a self-test fails);
looped-kv --debug COMMAND ... shows an error's traceback. Ctrl-C at any moment, while the modules load too, prints
one line and exits 130. python -m looped_kv.cli is the same command.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupted_while_loading(signum: int, frame: object) -> None:
    """Ctrl-C while the command's modules load (seconds): one line and exit 130, not a traceback.

    The process ends here (os._exit) rather than by raising SystemExit: the signal can land while torch's import is
    inside C++, where a raised exception aborts the process (pybind11), or inside an import that catches it. Nothing
    has been written yet, so there is nothing to flush but the line itself.
    """
    sys.stderr.write("looped-kv: interrupted\n")
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


# Installed before the imports below (torch, pandas), restored after them (only the main thread handles signals).
_LOADING = threading.current_thread() is threading.main_thread()
_PREVIOUS_SIGINT = signal.signal(signal.SIGINT, _interrupted_while_loading) if _LOADING else None

import argparse
import dataclasses
import json
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import NoReturn, TypeVar

import pandas as pd
import torch

from looped_kv import outputs, profiles, workloads
from looped_kv.analysis import pass_cost as analysis_pass_cost
from looped_kv.analysis import plan
from looped_kv.analysis.pass_cost import MODES, STATISTICS
from looped_kv.analysis.verdicts import MIN_UNITS
from looped_kv.book import DTYPES
from looped_kv.decoding import settings
from looped_kv.decoding.generate import generate
from looped_kv.decoding.loop import Observer
from looped_kv.decoding.settings import (
    DRAFT_LOOPS_DEFAULT,
    METHODS,
    Greedy,
    SelfSpec,
    default_draft_loops,
    every_option,
)
from looped_kv.experiments import bench, gpu_check, pass_cost, plan_check, plan_time, speed, throughput
from looped_kv.protocol import batches
from looped_kv.protocol.run import finite_or_none
from looped_kv.protocol.selftest import SelfTestFailure
from looped_kv.runtime.config import PRESETS, LoopedConfig
from looped_kv.runtime.loading import TINY_DIR, load, model_config, resolve_source
from looped_kv.runtime.measurement import check_device, measurement_mode, source_commit
from looped_kv.runtime.memory import BYTES, element_bytes, layer_token_bytes, m_deep, m_full, policy_bytes
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CACHE_POLICIES, make_policy
from looped_kv.tiny import gates, scout, train
from looped_kv.workloads import data

if _LOADING:
    signal.signal(signal.SIGINT, signal.default_int_handler if _PREVIOUS_SIGINT is None else _PREVIOUS_SIGINT)

PROG = "looped-kv"
Settings = TypeVar("Settings")


def plain(doc: str | None) -> str:
    """A docstring as plain help text: reST roles and double backticks removed."""
    text = re.sub(r":(?:func|class|mod|data|meth|attr):`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors; the top-level parser's ``commands`` are its subcommands' parsers."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _device(name: str | None) -> str:
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _load(args: argparse.Namespace) -> LoopedLM:
    device = _device(args.device)
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return load(args.model, dtype=DTYPES[dtype], device=device)


def _options(cls: type[Settings], args: argparse.Namespace, **changes: object) -> Settings:
    """The dataclass ``cls`` of a module's settings from the parsed options of the same names (and ``changes``)."""
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in vars(args).items() if k in names}, **changes})


def _check_finite(args: argparse.Namespace) -> None:
    """ValueError naming the first float option that is not finite (argparse's float takes inf, nan and 1e999)."""
    for dest, value in vars(args).items():
        bad = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, float) and
               not math.isfinite(v)]
        if bad:
            raise ValueError(f"--{dest.replace('_', '-')} must be a finite number, got {bad[0]}")


def _check_layers(layers: list[int]) -> None:
    """--layers PRELUDE CORE CODA (train's model, speed's checkpoint): ValueError unless PRELUDE, CODA >= 0 and
    CORE >= 1."""
    if min(layers) < 0 or layers[1] < 1:
        raise ValueError(f"--layers needs PRELUDE >= 0, CORE >= 1, CODA >= 0, got {layers}")


def _all_at_least_one(**flags: list[int]) -> None:
    """ValueError naming the first flag (given as its dest) with a value below 1."""
    for dest, values in flags.items():
        if any(v < 1 for v in values):
            raise ValueError(f"--{dest.replace('_', '-')} must all be >= 1, got {values}")


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' (shipped), a checkpoint folder or a hub id such as "
                                                  "tomg-group-umd/huginn-0125 (default: tiny)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="weights dtype (default: bfloat16 on CUDA, else float32)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def _model_config(args: argparse.Namespace) -> LoopedConfig:
    """The config of ``--model`` alone (no weights), so that options that depend on R or the context are checked
    before the model is loaded."""
    try:
        return LoopedConfig.from_file(resolve_source(args.model) / "config.json")
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {args.model!r}: {error}") from None


# -- generate -------------------------------------------------------------------------------------------------------


def _number(text: str) -> int | float:
    """A number as written: an int (argmax's and fixed exit's thresholds are ints), else a float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _at_least_one(**flags: int | None) -> None:
    """ValueError naming the first flag (given as its dest, e.g. num_loops) whose value is below 1."""
    for dest, value in flags.items():
        if value is not None and value < 1:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= 1, got {value}")


class TextPrinter(Observer):
    """Prints one prompt's completion as the decode loop commits it (``looped-kv generate``): a commit's text is
    printed once it decodes to whole characters, so a byte-level token split inside a character waits for the rest."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def emitted(self, tokens: dict[int, torch.Tensor]) -> None:
        if 0 not in tokens:
            return
        self.ids += tokens[0].tolist()
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text


def cmd_generate(args: argparse.Namespace) -> int:
    _at_least_one(num_loops=args.num_loops, max_new_tokens=args.max_new_tokens)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text:
        raise ValueError("prompt must be non-empty text (or '-' to read it from stdin)")
    flags = {"exact": False if args.inexact else None, "carry": False if args.no_carry else None,
             "stop_at_eos": not args.no_stop_at_eos, "compile": args.compile}
    # every option checked (one line each) before the model loads
    config = settings.method_config(args.method, cache=args.cache, max_new_tokens=args.max_new_tokens,
                                    progress=args.progress, **generate_options(args), **flags)
    model = _load(args)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; generate needs one for text in and out")
    ids = model.tokenizer(text, return_tensors="pt").input_ids.to(model.device)
    printer = None if args.json else TextPrinter(model.tokenizer)
    out = generate(model, ids, config, observer=printer)
    completion = model.tokenizer.decode(out.new_tokens[0].tolist())
    stats = {"method": args.method, "cache": out.policy, **out.stats()}
    if args.json:  # standard JSON has no NaN: a statistic the method does not have (greedy decoding's tau) is null
        stats = {key: finite_or_none(val) if isinstance(val, float) else val for key, val in stats.items()}
        print(json.dumps({"prompt": text, "completion": completion, "stats": stats}, allow_nan=False))
    else:
        print(completion[len(printer.shown):])  # the rest (text held back mid-character) and the line's end
        print("  ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}" for key, val in stats.items()),
              file=sys.stderr)
    return 0


#: generate()'s options that ``looped-kv generate`` sets itself (the cache, the budget, the progress bar), from flags
#: of another form (``--inexact``, ``--no-carry``, ``--no-stop-at-eos``, ``--compile``), or leaves at their defaults
#: (the end-of-text id, the row chunks of a batch: the command decodes one prompt).
GENERATE_SET_APART = ("max_new_tokens", "cache", "progress", "exact", "carry", "stop_at_eos", "eos_token_id",
                      "compile", "rows_per_chunk")


def _option_type(name: str) -> Callable[[str], object]:
    """How a method option's flag reads its text, from the settings field's annotation: a real number as written
    (an int where it is one: argmax's and fixed exit's thresholds), an int, or a name."""
    annotation = str(next(f.type for cls in settings.CONFIGS.values() for f in fields(cls) if f.name == name))
    if annotation.startswith("float"):
        return _number
    return int if annotation.startswith("int") else str


def generate_options(args: argparse.Namespace) -> dict[str, object]:
    """generate()'s options from the flags of the same names: every option of every method
    (:func:`~looped_kv.decoding.settings.every_option`) but :data:`GENERATE_SET_APART`."""
    return {name: getattr(args, name) for name in every_option() if name not in GENERATE_SET_APART}


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with any decoder and cache; prints the completion and "
                                        "statistics", description=plain(generate.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="prompt text, or '-' to read it from stdin")
    _model_options(p)
    p.add_argument("--method", default="ar", choices=METHODS, help="decoder (default: ar, greedy decoding)")
    p.add_argument("--cache", default="full", choices=CACHE_POLICIES, help=settings.option_help("cache"))
    p.add_argument("--max-new-tokens", type=int, default=Greedy.max_new_tokens,
                   help=settings.option_help("max_new_tokens"))
    for name in every_option():  # every method's options, each with its help text from the settings
        if name not in GENERATE_SET_APART:
            p.add_argument(f"--{name.replace('_', '-')}", type=_option_type(name), choices=settings.CHOICES.get(name),
                           help=settings.option_help(name))
    for flag, name in (("--inexact", "exact"), ("--no-carry", "carry")):
        p.add_argument(flag, action="store_true",
                       help=f"do not {settings.MEANING[name]} ({', '.join(settings.takers(name))})")
    p.add_argument("--no-stop-at-eos", action="store_true",
                   help=f"do not {settings.MEANING['stop_at_eos']}: emit --max-new-tokens tokens")
    p.add_argument("--compile", action="store_true",
                   help=f"{settings.MEANING['compile']} (the first call of each capacity bucket traces: a minute or "
                        f"more on a CPU; then from Inductor's cache on disk)")
    p.add_argument("--json", action="store_true", help="print one JSON object (prompt, completion, stats)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=cmd_generate)


# -- bench ----------------------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    bench.check_options(args.prompts, args.max_new_tokens, args.draft_loops, args.gamma, args.methods, args.workloads,
                        args.repeats, args.caches)
    if args.sampling_overhead and (args.caches or args.deep_v):
        raise ValueError("--caches and --deep-v add arms to the speed bench, not to --sampling-overhead; drop them")
    if args.batch is not None and (not args.caches or args.sampling_overhead or args.deep_v):
        raise ValueError("--batch times --caches against the full cache: give it --caches, without "
                         "--sampling-overhead or --deep-v")
    if args.batch is not None:
        bench.check_batch(args.batch, args.prompts)
    config = _model_config(args)
    bench.check_model(config.mean_recurrence, args.draft_loops)
    if args.record is not None:  # before the measurement: a long run never ends on a file it may not write
        outputs.check_file(args.record, "--record", args.force)
    model = _load(args)
    if model.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer; the benchmark's prompts are text")
    if args.batch is not None:
        _bench_batched(args, model)
        return 0
    if args.sampling_overhead:
        methods = bench.method_configs(args.draft_loops, args.gamma, methods=["ar", *args.methods])
        for workload in args.workloads:
            prompts = bench.workload_prompts(model, workload, args.prompts, args.max_new_tokens, methods)
            table = bench.sampling_overhead(model, prompts, methods, args.max_new_tokens, args.repeats, args.modes,
                                            progress=not args.quiet)
            print(f"{workload}: sampling (temperature 1, top-k 1: greedy's tokens) over greedy decoding, time ratio "
                  f"per method, {args.prompts} prompts x {args.repeats} interleaved rounds\n{table.to_string()}")
        return 0
    measured = bench.report(model, args.workloads, args.prompts, args.max_new_tokens, args.methods, args.draft_loops,
                            args.gamma, progress=not args.quiet, repeats=args.repeats, modes=args.modes,
                            caches=args.caches, deep_v=args.deep_v)
    if args.record is not None:
        bench.write_record(args.record, measured, args.model, " ".join(["looped-kv", "bench", *args.words]))
        print(f"recorded in {args.record}")
    return 0


def _bench_batched(args: argparse.Namespace, model: LoopedLM) -> None:
    """--batch: greedy decoding of --batch prompts together under each of --caches against the full cache, per
    workload and mode (:func:`~looped_kv.experiments.bench.batched_runs`), printed and, with --record, recorded."""
    measured: dict[str, object] = {"commit": source_commit(), "runs": {}}
    with measurement_mode() as environment:
        measured["environment"] = dict(environment)
        for workload in args.workloads:
            prompts = bench.workload_prompts(model, workload, args.prompts, args.max_new_tokens,
                                             {c: bench.CACHE_ARMS[c] for c in args.caches})
            runs = bench.batched_runs(model, prompts, args.batch, args.caches, args.max_new_tokens, args.repeats,
                                      args.modes, progress=not args.quiet)
            measured["runs"][workload] = runs
            print(f"{workload}: greedy decoding of {args.batch} prompts together under each cache against the full "
                  f"cache, {runs['set'].nunique()} sets x {args.repeats} interleaved rounds per mode, "
                  f"{args.max_new_tokens} new tokens per row; mean tokens/s ratio over sets, 95% paired bootstrap "
                  f"interval\n{bench.batched_summary(runs).to_string(float_format=lambda x: f'{x:.3f}')}")
    if args.record is not None:
        bench.write_record(args.record, measured, args.model, " ".join(["looped-kv", "bench", *args.words]))
        print(f"recorded in {args.record}")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed-ups of every decoder over paired greedy decoding, one sequence at a "
                                     "time, and the verdict on Mature-Spec against self-speculation (chapters 5-6; "
                                     "batched throughput and memory: looped-kv batched)",
                       description="Each evaluation prompt is decoded alone, greedily and by every method, in the same"
                                   " process, stopping at end-of-text, in interleaved rounds. The speed-up is DAS Eq. "
                                   "(8), the mean over prompts of the tokens/s ratio to the paired greedy run, with a "
                                   "95% paired bootstrap interval; beside it, tau (sequential drafters) or A (das-"
                                   "wave) as a fraction of its ceiling (gamma + 1, or w = min(max_width, W_init + J -"
                                   " 1)),"
                                   " A and G (DAS Eq. 9-10). Per workload it prints the verdicts on 'Mature-Spec beats"
                                   " self-speculation' (acceptance, DAS Table 2; speed, DAS Table 1).")
    _model_options(p)
    p.add_argument("--workloads", nargs="+", default=list(data.WORKLOADS), choices=data.DECODING_WORKLOADS,
                   help="prompt workloads (default: the chapters' three; multichain: the workload dense in answers)")
    p.add_argument("--prompts", type=int, default=MIN_UNITS["paired"],
                   help=f"evaluation prompts per workload, >= 2 (default: {MIN_UNITS['paired']}, the fewest an "
                        f"acceptance verdict accepts; a speed verdict needs {MIN_UNITS['timing']})")
    p.add_argument("--repeats", type=int, default=2,
                   help="interleaved timing rounds per prompt, >= 1 (default: 2; a speed verdict needs 2)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per prompt (default: 128)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="decoders (default: all); greedy decoding (ar) always runs as the reference")
    p.add_argument("--draft-loops", type=int,
                   help=f"d of self-spec and mature-spec, in [1, R - 1] (default: {DRAFT_LOOPS_DEFAULT})")
    p.add_argument("--gamma", type=int, default=SelfSpec.gamma,
                   help=f"gamma of self-spec, mature-spec and pld (default: {SelfSpec.gamma}); das-wave runs "
                        f"looped_kv.decoding.settings.DasWave")
    p.add_argument("--caches", nargs="+", default=[], choices=list(bench.CACHE_ARMS),
                   help="also greedy decoding under these caches (ripe: W = 8; sinks: 4 sinks and W = 8), timed "
                        "against the full cache's (default: none)")
    p.add_argument("--deep-v", action="store_true",
                   help="also self-speculation with Deep V (Mature-V) prefix reads at self-spec's d and gamma, the "
                        "arm DAS Table 7 sets against Mature-Spec's deep K/V reads")
    p.add_argument("--modes", nargs="+", default=list(bench.MODES), choices=bench.MODES,
                   help="eager passes, compiled steps (compile=True), or both side by side (default: both)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--sampling-overhead", action="store_true",
                   help="instead: what sampling costs over greedy decoding of each method (the sampler's whole path "
                        "at top-k 1, so both emit the same tokens), in interleaved rounds; issue 41's budget is 5%%")
    p.add_argument("--batch", type=int,
                   help="instead: greedy decoding of this many prompts together under each of --caches against the "
                        "full cache, per --modes, in interleaved rounds over sets of --batch prompts, every row to "
                        "--max-new-tokens (chapter 7's fixed-memory budget holds 4 full-cache sequences: B_max); "
                        "--record saves its runs (the shipped model's: "
                        f"{bench.BATCHED_CACHES_RECORD.relative_to(bench.RECORD.parents[2])})")
    p.add_argument("--record", type=Path, help="also save the runs with the command, commit, machine, date and the "
                                               f"weights' digest, which the chapters read (the shipped model's: "
                                               f"{bench.RECORD.relative_to(bench.RECORD.parents[2])}; a new file)")
    p.add_argument("--force", action="store_true", help="overwrite --record if it exists")
    p.set_defaults(func=cmd_bench)


def bench_arms_of(command: str, num_loops: int) -> dict[str, settings.Decoding]:
    """The arms a ``looped-kv bench`` command line times (:func:`looped_kv.experiments.bench.bench_arms`), such as a
    recorded bench's (its header's ``command``), d defaulting as there for R = ``num_loops``."""
    words = shlex.split(command)
    if words[:2] != ["looped-kv", "bench"]:
        raise ValueError(f"command must be a looped-kv bench line, got {command!r}")
    args = parser().parse_args(words[1:])
    draft_loops = args.draft_loops or default_draft_loops(num_loops)
    return bench.bench_arms(args.methods, draft_loops, args.gamma, args.caches, args.deep_v)


# -- memory ---------------------------------------------------------------------------------------------------------


def memory_rows(config: LoopedConfig, contexts: list[int], num_loops: int, dtype: str, windows: list[int],
                batch_size: int) -> pd.DataFrame:
    """Weights and KV cache (RIPE Eq. 3 and 10) in GB (10^9 bytes) for ``batch_size`` sequences per context."""
    policies = [("full cache", make_policy("full", num_loops)), ("deepest plane", make_policy("deepest", num_loops)),
                *((f"RIPE, W = {w}", make_policy("ripe", num_loops, window=w)) for w in windows)]
    weights = plan.parameter_count(config) * element_bytes(dtype) / 1e9
    rows = []
    for name, policy in policies:
        row = {"cache": name}
        for L in contexts:
            cache = batch_size * policy_bytes(config, policy, L, dtype) / 1e9
            row[f"KV GB, L = {L}"] = cache
            row[f"total GB, L = {L}"] = weights + cache
        rows.append(row)
    return pd.DataFrame(rows).set_index("cache")


def cmd_memory(args: argparse.Namespace) -> int:
    for flag, values, low in (("--context", args.context, 1), ("--batch-size", [args.batch_size], 1),
                              ("--windows", args.windows, 0)):
        bad = [v for v in values if v < low]
        if bad:
            raise ValueError(f"{flag} must be >= {low}, got {bad[0]}")
    _at_least_one(num_loops=args.num_loops)
    config = model_config(args.model, "--model")
    beyond = [length for length in args.context if length > config.block_size]
    if beyond:
        print(f"{PROG}: warning: --context {beyond[0]} is beyond the model's context (block_size "
              f"{config.block_size}); the rows below extrapolate the memory equations", file=sys.stderr)
    R = config.mean_recurrence if args.num_loops is None else args.num_loops
    params = plan.parameter_count(config)
    table = memory_rows(config, args.context, R, args.dtype, args.windows, args.batch_size)
    print(f"{args.model}: {params / 1e9:.3f}B parameters, weights {params * element_bytes(args.dtype) / 1e9:.2f} GB "
          f"in {args.dtype}; R = {R}, {config.n_prelude}/{config.n_core}/{config.n_coda} layers, "
          f"{config.n_kv_heads} KV heads of width {config.head_dim}; {args.batch_size} sequence(s)")
    b = layer_token_bytes(config, args.dtype)
    print(f"KV bytes per token: {b:,} per layer (b = 2 H_kv d_h x {element_bytes(args.dtype)}), one plane "
          f"{config.n_core * b:,} ({config.n_core} core layers), full cache {m_full(config, 1, R, args.dtype):,}, "
          f"deepest plane {m_deep(config, 1, args.dtype):,} (RIPE Eq. 3)")
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    print("Activations and the allocator's overhead come on top (RIPE Sec. 3.5 measures o0 + o1 B on a GH200).")
    return 0


def _add_memory(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="weights and KV-cache memory of a checkpoint or config at a context length",
                       description="Memory from the package's model (RIPE Eq. 3 and Eq. 10): the "
                                   "weights, and the KV cache of the full cache, the deepest plane and RIPE windows, "
                                   "for each context length.")
    p.add_argument("--model", default="huginn-0125", help=f"one of {tuple(PRESETS)}, 'tiny', a checkpoint "
                                                          f"folder, a config.json or a hub id (default: huginn-0125)")
    p.add_argument("--context", type=int, nargs="+", default=[1024], help="context lengths L (default: 1024)")
    p.add_argument("--dtype", default="bf16", choices=tuple(BYTES), help="storage dtype (default: bf16)")
    p.add_argument("--num-loops", type=int, help="R (default: the config's mean recurrence)")
    p.add_argument("--windows", type=int, nargs="*", default=[16, 64, 256], help="RIPE windows W "
                                                                                 "(default: 16 64 256)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences held at once (default: 1)")
    p.set_defaults(func=cmd_memory)


# -- plan -----------------------------------------------------------------------------------------------------------


def _profile_words(profile: profiles.Profile) -> str:
    return (f"{profile.dtype}; {workloads.SOURCES[profile.workloads]}, prompts up to {profile.prompt_tokens} "
            f"tokens, {profile.rows_per_chunk or 'all'} rows per chunk")


def _print_plan(heading: str, table: pd.DataFrame, too_large: list[str], beyond: str, as_markdown: bool) -> int:
    """Print a plan's table (as Markdown, or with each chapter's sizes below it) and each step that does not fit; 1
    if a chapter does not fit."""
    missing = list(table.index[~table["fits"]])
    if as_markdown:
        print(f"{heading}:\n\n{plan.markdown(table)}", end="")
        if too_large:
            print("\nSteps that do not fit:\n\n" + "".join(f"* {line}\n" for line in too_large), end="")
        return 1 if missing else 0
    print(f"{heading}:")
    shown = table.assign(fits=table["fits"].map({True: "yes", False: "NO"}))
    print(shown.drop(columns="sizes").to_string(float_format=lambda x: f"{x:.1f}"))
    for name, sizes in table["sizes"].items():
        print(f"  {name}: {sizes}")
    for line in too_large:
        print(f"  does not fit: {line}")
    if missing:
        print(f"{', '.join(missing)} need more than {beyond}")
        return 1
    return 0


def _plan_on_cpu(args: argparse.Namespace, model: str, config: LoopedConfig) -> int:
    """``looped-kv plan`` for a CPU run: each chapter's peak of all the memory it holds against --host-memory."""
    profile = profiles.PROFILES[args.profile or profiles.name_for(config, model, None)]
    plans = plan.chapter_plans(config, profile)
    return _print_plan(f"{model} at profile {profile.name} ({_profile_words(profile)}) on a CPU with "
                       f"{args.host_memory:g} GB", plan.host_table(plans, args.host_memory * plan.GB),
                       plan.steps_beyond(plans, args.host_memory * plan.GB, where=None),
                       f"{args.host_memory:g} GB of memory", args.markdown)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.card is not None:
        if args.card not in profiles.CARDS:
            raise ValueError(f"--card must be one of {tuple(profiles.CARDS)}, got {args.card!r}")
        card = profiles.CARDS[args.card]
        print(f"Every published model on a {card.memory_gb:g} GB {card.example} (card {card.name}; "
              f"{'' if card.bf16 else 'no '}native bfloat16), {plan.GPU_RESERVE / plan.GB:g} GB kept free; GPU GB "
              f"per chapter:\n\n{plan.card_markdown(plan.card_table(args.card))}", end="")
        return 0
    if not args.gpu_memory > 0:
        raise ValueError(f"--gpu-memory must be > 0 (GB), got {args.gpu_memory}")
    if not args.host_memory > 0:
        raise ValueError(f"--host-memory must be > 0 (GB), got {args.host_memory}")
    if args.profile is not None and args.profile not in profiles.PROFILES:
        raise ValueError(f"--profile must be one of {tuple(profiles.PROFILES)}, got {args.profile!r}")
    on_cpu = args.device == "cpu" or (args.device is None and args.profile in profiles.CPU_PROFILES)
    model = args.model or profiles.MODEL_OF.get(args.profile, "huginn-0125")
    config = model_config(model, "--model")
    if on_cpu:
        return _plan_on_cpu(args, model, config)
    card = profiles.card_for(args.gpu_memory)
    profile = profiles.PROFILES[args.profile or profiles.name_for(config, model, card)]
    plans, gpu_bytes = plan.chapter_plans(config, profile), args.gpu_memory * plan.GB
    return _print_plan(f"{model} at profile {profile.name} ({_profile_words(profile)}) on a "
                       f"{args.gpu_memory:g} GB GPU, {plan.GPU_RESERVE / plan.GB:g} GB kept free",
                       plan.plan_table(plans, gpu_bytes), plan.steps_beyond(plans, gpu_bytes),
                       f"{args.gpu_memory:g} GB; choose a larger GPU or a smaller profile", args.markdown)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="will every chapter fit one GPU? predicted peak GPU and host memory per chapter",
                       description="The package's own accounting of what each chapter allocates at its run profile "
                                   "(looped_kv.profiles): weights in each dtype, replay records, caches and the "
                                   "working set of a forward pass. Prints each chapter's predicted peak GPU and "
                                   "host memory and whether it fits; exits 1 if any chapter does not.")
    p.add_argument("--model", help=f"one of {tuple(PRESETS)}, 'tiny', a checkpoint folder, a config.json or a hub id "
                                   f"(default: the model --profile is sized for, else huginn-0125)")
    p.add_argument("--gpu-memory", type=float, default=40.0, help="GPU memory in GB (default: 40, an A100-40GB)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="where the chapters run (default: cpu for a CPU "
                                                             "profile, else cuda); on cpu every byte is host memory")
    p.add_argument("--host-memory", type=float, default=float(profiles.LAPTOP_GB),
                   help=f"on cpu, the machine's memory in GB (default: {profiles.LAPTOP_GB}, a laptop)")
    p.add_argument("--profile", help=f"run profile, one of {tuple(profiles.PROFILES)} (default: the model's for "
                                     f"a GPU of this memory, looped_kv.profiles.BY_CARD, or on cpu its CPU profile)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (book/data/ keeps one)")
    p.add_argument("--card", help=f"instead: every published model's profile and peaks on a GPU class, one of "
                                  f"{tuple(profiles.CARDS)} (a Markdown table; book/data/ keeps one per card)")
    p.set_defaults(func=cmd_plan)


# -- batched --------------------------------------------------------------------------------------------------------


def _check_batched(args: argparse.Namespace) -> None:
    """The checks that need no model: every count, the batch sizes, the budget and --fit-on."""
    _at_least_one(prompts=args.prompts, max_new_tokens=args.max_new_tokens, num_loops=args.num_loops,
                  draft_loops=args.draft_loops, gamma=args.gamma, repeats=args.repeats, threads=args.threads)
    _all_at_least_one(batch_sizes=args.batch_sizes, memory_batch_sizes=args.memory_batch_sizes)
    if not (math.isfinite(args.budget_mb) and args.budget_mb >= 0):
        raise ValueError(f"--budget-mb must be > 0 (or 0 to skip the fixed-memory comparison), got {args.budget_mb}")
    if args.budget_mb:
        unknown = sorted(set(args.fit_on) - set(args.memory_batch_sizes))
        if unknown or len(set(args.fit_on)) < 2:
            raise ValueError(f"--fit-on must name at least 2 distinct values of --memory-batch-sizes "
                             f"{args.memory_batch_sizes}, got {args.fit_on}")
    if args.num_loops is not None and args.draft_loops is not None and args.draft_loops >= args.num_loops:
        raise ValueError(f"--draft-loops must be in [1, {args.num_loops - 1}] (fewer than --num-loops "
                         f"{args.num_loops}), got {args.draft_loops}")


def cmd_batched(args: argparse.Namespace) -> int:
    _check_batched(args)
    try:  # the config first (no weights): R and the context are known before the model is loaded
        folder = resolve_source(args.model)
        config = LoopedConfig.from_file(folder / "config.json")
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {args.model!r}: {error}") from None
    R = config.mean_recurrence if args.num_loops is None else args.num_loops
    if args.draft_loops is None:  # follows R, as generate()'s default does
        args.draft_loops = default_draft_loops(R)
    if not 1 <= args.draft_loops < R:
        raise ValueError(f"--draft-loops must be in [1, {R - 1}] (fewer than the R = {R} loops of the model), "
                         f"got {args.draft_loops}")
    try:
        model = load(folder, device=args.device)
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {args.model!r}: {error}") from None
    if model.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer; the prompts are text")
    options = _options(throughput.Options, args, num_loops=R)
    prompts = throughput.eval_prompts(model, options)
    throughput.check(model, prompts, options)  # every series, before the first decoding
    throughput.run(model, prompts, options, args.model)
    return 0


def _add_batched(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batched", help="batched decoding: tokens/s against batch size, the peak-memory model and the fixed-memory "
                        "throughput ratio (chapter 7; looped_kv.experiments.throughput)",
        description="Batched decoding on CPU (or CUDA): tokens/s against batch size B for greedy decoding (ar) and "
                    "draft-then-verify (self-spec) with the full and the deepest-plane caches, the peak-memory model "
                    "peak(B) = cache B + o0 + o1 B fitted and checked on held-out batches, and the fixed-memory "
                    "throughput ratio (deepest plane at its B_max / full cache at its B_max) under a budget "
                    "(RIPE Sec. 3.5, 5.3).")
    p.add_argument("--model", default="tiny", help="'tiny' (default), a checkpoint folder or a hub id")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--workload", default="problems", choices=data.WORKLOADS, help="prompt set (default problems)")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts; larger batches cycle them (default 8)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="B values (default 1 2 4 8)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per sequence (default 16)")
    p.add_argument("--num-loops", type=int, default=None, help="R (default: the model's mean recurrence)")
    p.add_argument("--draft-loops", type=int, help=f"d, loops per draft, in [1, R - 1] (default: "
                                                   f"{DRAFT_LOOPS_DEFAULT})")
    p.add_argument("--gamma", type=int, default=4, help="gamma, drafts per verification (default 4)")
    p.add_argument("--budget-mb", type=float, default=24.0,
                   help="memory budget of the fixed-memory comparison, MB = 10^6 bytes above the weights "
                        "(default 24); 0 skips the comparison")
    p.add_argument("--memory-batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="B values of the peak-memory measurement (default 1 2 3 4)")
    p.add_argument("--fit-on", type=int, nargs="+", default=[1, 2],
                   help="at least 2 of the --memory-batch-sizes, which the memory model is fitted on; the others "
                        "are held out (default 1 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs per throughput cell, the fastest kept (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=cmd_batched)


# -- batch ----------------------------------------------------------------------------------------------------------


def cmd_freeze(args: argparse.Namespace) -> int:
    path = batches.freeze(args.spec, args.out, force=args.force)
    table = batches.read_table(path)
    groups = pd.Series([name.split("/")[0] for name in table["files"]]).value_counts()
    counts = ", ".join(f"{n} {group}" for group, n in groups.items())
    print(f"froze batch {table['batch']}: {len(table['files'])} files ({counts}) -> {path}, sha256 "
          f"{batches.sha256(path)} (publish it before the run; runs record it)")
    return 0


def _key(args: argparse.Namespace) -> bytes | None:
    return None if args.key_file is None else batches.read_key(args.key_file)


def cmd_run(args: argparse.Namespace) -> int:
    key = _key(args)
    decisions = batches.run_batch(args.table, args.out, progress=not args.quiet, threads=args.threads,
                                  device=args.device, key=key)
    if decisions is None:  # a torchrun rank other than 0
        return 0
    for name, rule in decisions["rules"].items():
        print(f"rule {name}: {rule['label']} ({rule['detail']})")
    print(batches.ledger([args.out], key))
    print(f"archive: {args.out} (check it with `{PROG} batch verify {args.out}`)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    failed, key = 0, _key(args)
    for archive in args.archives:
        problems = batches.verify(archive, key)
        ok = "ok" if key is None else f"ok, signed with {args.key_file}"
        print(f"{archive}: {ok if not problems else 'FAILED: ' + '; '.join(problems)}")
        failed += bool(problems)
    return 1 if failed else 0


def cmd_compare(args: argparse.Namespace) -> int:
    comparison = batches.compare(args.first, args.second)
    print(comparison.report())
    return 0 if comparison.identical else 1


def cmd_ledger(args: argparse.Namespace) -> int:
    print(batches.ledger(args.archives, _key(args)))
    return 0


def _add_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="pre-registered batches: freeze, run, verify, compare, ledger (RIPE Sec. 5, "
                                     "App. A-B)",
                       description=plain(batches.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = p.add_subparsers(dest="step", required=True, metavar="{freeze,run,verify,compare,ledger}")
    f = steps.add_parser("freeze", help="validate a spec and write its SHA-256 file table",
                         description="Validate a batch spec and write its file table: the SHA-256 of the spec, its "
                                     "prompt files, the package's source files and the local model files. `batch "
                                     "run` refuses to run once any of them changes.")
    f.add_argument("spec", help=f"a spec file, or a shipped example: {', '.join(batches.example_names())}")
    f.add_argument("-o", "--out", help="table to write (default: <spec name>.frozen.json here)")
    f.add_argument("--force", action="store_true", help="overwrite an existing table (changes the pre-registration)")
    f.set_defaults(func=cmd_freeze)
    r = steps.add_parser("run", help="check the table, run the self-tests and every arm, write the archive",
                         description="Check the frozen file table, run the self-tests, run every arm (cuDNN "
                                     "attention disabled, RIPE Sec. 5.5; the spec's CPU thread count, 1 unless it "
                                     "names another, whatever OMP_NUM_THREADS says), write per-position records, a "
                                     "summary, the labels and a checksum manifest into OUT. The run writes into "
                                     "OUT.partial, which it creates with its marker before the self-tests (so an "
                                     "unwritable OUT fails at once) and renames to OUT when complete; it never "
                                     "deletes a folder it did not mark, and Ctrl-C leaves the marked folder for the "
                                     "next run to replace. Under torchrun the "
                                     "prompts are sharded across processes: torchrun --nproc-per-node N -m "
                                     "looped_kv.cli batch run TABLE --out OUT; its records equal a single "
                                     "process's byte for byte (check with `batch compare`).")
    r.add_argument("table", help="file table written by `batch freeze`")
    r.add_argument("--out", required=True, help="archive folder to create (must not exist, or be empty)")
    r.add_argument("--device", help="torch device (default: this process's GPU when CUDA is available, else cpu)")
    r.add_argument("--threads", type=int, help="torch CPU threads per process; must equal the frozen spec's "
                                               "threads (default: that count)")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.add_argument("--key-file", help=f"sign the manifest with this file's bytes as key (HMAC-SHA256 in "
                                      f"{batches.SIGNATURE}; at least 16 bytes, e.g. head -c 32 /dev/urandom)")
    r.set_defaults(func=cmd_run)
    v = steps.add_parser("verify", help="re-check archives: checksums, frozen spec, labels recomputed from records",
                         description="Re-check archives: every checksum of MANIFEST.sha256, no unlisted file, link "
                                     "or name outside the archive, the archived spec and prompts equal to the "
                                     "frozen ones, run.json's self-tests passed, records that cover exactly the "
                                     "frozen prompts and arms with the fields their arms write, and the summary and "
                                     "labels recomputed from the records. An unkeyed manifest shows no accidental "
                                     "change, not who wrote the archive; --key-file also checks its signature. Exit "
                                     "status 1 if any archive fails.")
    v.add_argument("archives", nargs="+", help="archive folders")
    v.add_argument("--key-file", help=f"also require {batches.SIGNATURE}, the manifest's HMAC-SHA256 under this key")
    v.set_defaults(func=cmd_verify)
    c = steps.add_parser("compare", help="do two archives of one frozen spec agree byte for byte? else the largest "
                                         "difference per metric",
                         description="Compare two archives of one frozen spec (say, a run alone and one under "
                                     "torchrun, or a replication) file by file, leaving out run.json, timings.jsonl "
                                     "and frozen.json. Prints whether they are identical byte for byte and, for "
                                     "every metric that differs, how many values differ and the largest numeric "
                                     "difference. Exit status 1 if they differ, 2 if they are not archives of one "
                                     "frozen spec.")
    c.add_argument("first", help="archive folder")
    c.add_argument("second", help="archive folder")
    c.set_defaults(func=cmd_compare)
    led = steps.add_parser("ledger", help="print the prediction ledger of archives (RIPE Appendix B layout)",
                           description="Print every prediction of the given (verified) archives with its outcome, "
                                       "held or failed, in the layout of RIPE Appendix B, Table 6.")
    led.add_argument("archives", nargs="+", help="archive folders (each once)")
    led.add_argument("--key-file", help="verify each archive's signature with this key (see batch verify)")
    led.set_defaults(func=cmd_ledger)


# -- speed ----------------------------------------------------------------------------------------------------------


def cmd_speed(args: argparse.Namespace) -> int:
    _at_least_one(prompt=args.prompt, new_tokens=args.new_tokens, num_loops=args.num_loops, rounds=args.rounds,
                  threads=args.threads)
    _all_at_least_one(batch_sizes=args.batch_sizes, layout_tokens=args.layout_tokens)
    if args.layers is not None:
        _check_layers(args.layers)
    if args.methods and "ar" not in args.methods:
        raise ValueError(f"--methods must include ar (the baseline of every ratio), got {args.methods}")
    if args.reference is not None and not args.reference.is_dir():
        raise ValueError(f"--reference {args.reference} is not a folder (a checkout of seal-rg/recurrent-pretraining)")
    if args.reference is not None:
        speed.check_transformers()
    block_size = LoopedConfig.from_file(TINY_DIR / "config.json").block_size
    if args.prompt + args.new_tokens > block_size:
        raise ValueError(f"--prompt + --new-tokens must be <= {block_size}, got {args.prompt + args.new_tokens}")
    if args.layout_tokens and args.prompt + max(args.layout_tokens) > block_size:
        raise ValueError(f"--prompt + the largest --layout-tokens must be <= {block_size}, got "
                         f"{args.prompt + max(args.layout_tokens)}")
    speed.run(_options(speed.Options, args))
    return 0


def _add_speed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speed", help="decoding speed: greedy decoding against the public Huginn reference code, and "
                                     "every method eager and compiled (looped_kv.experiments.speed)",
                       description=plain(speed.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", type=Path, help="checkout of seal-rg/recurrent-pretraining (omit: looped_kv only)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of the reference comparison (default 256)")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--num-loops", type=int, default=32, help="R of the reference comparison (default 32)")
    p.add_argument("--layers", type=int, nargs=3, metavar=("PRELUDE", "CORE", "CODA"),
                   help="layers of the reference comparison's random checkpoint (default: the tiny model's)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                   help="batch sizes of the tokens/s table (default 1 2 4 8 16; none: skip)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS,
                   help="methods timed eager and compiled on the tiny model (default: all; none: skip)")
    p.add_argument("--workload", default=data.WORKLOADS[0], choices=data.WORKLOADS,
                   help=f"the evaluation prompt's workload for the methods (default {data.WORKLOADS[0]})")
    p.add_argument("--layout-tokens", type=int, nargs="*", default=[1, 9, 25],
                   help="tokens per pass of the weights' layout comparison after --prompt tokens, eager and "
                        "compiled (default 1 9 25; none: skip)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled passes")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.set_defaults(func=cmd_speed)


# -- pass-cost ------------------------------------------------------------------------------------------------------


def cmd_pass_cost(args: argparse.Namespace) -> int:
    config = _model_config(args)
    grid = _options(pass_cost.Grid, args, loops=args.loops or pass_cost.default_loops(config.mean_recurrence))
    pass_cost.check_grid(grid, config)
    out = outputs.check_file(args.out, "--out", args.force)
    pass_cost.run(_load(args), grid, out, args.model, " ".join(["looped-kv", "pass-cost", *args.words]),
                  progress=not args.quiet)
    return 0


def _add_pass_cost(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pass-cost", help="the time of one model pass against its new tokens, loops and context, "
                                         "eager and compiled, fitted and recorded (looped_kv.analysis.pass_cost)",
                       description=plain(pass_cost.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(p)
    p.add_argument("--out", type=Path, required=True, help="the record to write (a new JSON file)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="eager passes, compiled steps, or both (default: both)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="new tokens per pass fitted, g (default: 1 2 4 8 16 32)")
    p.add_argument("--held-out-tokens", type=int, nargs="*", default=[5, 25],
                   help="widths timed but not fitted, strictly inside --tokens: the interpolation's check "
                        "(default: 5 25, self-spec's verification and DAS-Wave's)")
    p.add_argument("--loops", type=int, nargs="+", help="loops per pass, 2 or more in [1, R] (default: 1, the "
                                                        "default draft depth, R / 2 and R)")
    p.add_argument("--verify-tokens", type=int, nargs="+",
                   help="widths of the verifications in place, R loops (default: --tokens and --held-out-tokens)")
    p.add_argument("--draft-chains", type=int, nargs="*", default=[SelfSpec.gamma],
                   help=f"compiled only: chains of gamma one-token drafts in one step, as compiled self-spec and "
                        f"Mature-Spec draft, timed at each --loops below R; gammas between 1 and these are "
                        f"interpolated (default: {SelfSpec.gamma}, generate's gamma; none: no chains)")
    p.add_argument("--waves", type=int, nargs="*", default=[],
                   help="compiled only: DAS-Wave waves of J rounds in one step (fuse_rounds), each J given, with "
                        "DAS-Wave's default max_width, W_init and k (default: none)")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512],
                   help="prefix positions read by eager cells, 2 or more (default: 64 256 512)")
    p.add_argument("--capacities", type=int, nargs="+",
                   help="capacities of the compiled cells, 2 or more capacity buckets (64, 96, 128, 192, 256, ...; "
                        "default: the buckets of --contexts)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[16, 64, 128, 256, 512],
                   help="prompt tokens of the timed prefills, 2 or more (default: 16 64 128 256 512)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds, each timing every cell once (default: 5)")
    p.add_argument("--calls", type=int, default=8,
                   help="consecutive calls per timing of a pass or verification cell, after one untimed call, as a "
                        "decode makes them, >= 1 (default: 8)")
    p.add_argument("--statistic", default="median", choices=tuple(STATISTICS),
                   help="each cell's time over the rounds (default: median)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pass_cost)


def cmd_pass_cost_check(args: argparse.Namespace) -> int:
    bench.check_options(args.prompts, args.max_new_tokens, args.draft_loops, args.gamma, args.methods, args.workloads,
                        args.repeats)
    try:
        cost = analysis_pass_cost.read(args.cost)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"--cost {args.cost}: {error}") from None
    pass_cost.check_mode(cost, args.mode, f"--cost {args.cost}")
    config = _model_config(args)
    bench.check_model(config.mean_recurrence, args.draft_loops)
    methods = bench.method_configs(args.draft_loops, args.gamma, methods=args.methods, fuse_rounds=True)
    pass_cost.check_prices(cost, methods, args.mode, config.mean_recurrence, f"--cost {args.cost}")
    out = outputs.check_file(args.out, "--out", args.force)
    model = _load(args)
    if model.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer; the check's prompts are text")
    pass_cost.check(model, cost, args.workloads, args.prompts, args.max_new_tokens, methods, out, args.model,
                    " ".join(["looped-kv", "pass-cost-check", *args.words]), args.repeats, args.mode,
                    progress=not args.quiet)
    return 0


def _add_pass_cost_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pass-cost-check", help="each decoder's measured time against the pass-cost model's "
                                               "prediction from the passes it ran (issue 43: within 15%%)",
                       description="Every evaluation prompt is decoded alone by greedy decoding and each method, in "
                                   "interleaved rounds, with every model pass logged; the pass-cost model (looped-kv "
                                   "pass-cost) prices the passes and the prefill. After each prompt it re-times a few "
                                   "of the grid's pass, verification and prefill cells and also prices each pass at "
                                   "the speed its kind of cell then ran (at drift). Prints measured / predicted per "
                                   "method and workload and records the runs.")
    _model_options(p)
    p.add_argument("--cost", type=Path, required=True, help="the pass-cost record (looped-kv pass-cost --out)")
    p.add_argument("--out", type=Path, required=True, help="the record to write (a new JSON file)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--mode", default="eager", choices=bench.MODES, help="eager passes or compiled steps "
                                                                         "(default: eager)")
    p.add_argument("--workloads", nargs="+", default=list(data.WORKLOADS), choices=data.DECODING_WORKLOADS,
                   help="prompt workloads (default: the chapters' three)")
    p.add_argument("--prompts", type=int, default=8, help="evaluation prompts per workload, >= 2 (default: 8)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds per prompt, >= 1 (default: 2)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per prompt (default: 64)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="decoders (default: all); greedy decoding (ar) always runs")
    p.add_argument("--draft-loops", type=int, help=f"d of self-spec and mature-spec, in [1, R - 1] (default: "
                                                   f"{DRAFT_LOOPS_DEFAULT})")
    p.add_argument("--gamma", type=int, default=SelfSpec.gamma, help=f"gamma of self-spec, mature-spec and pld "
                                                                     f"(default: {SelfSpec.gamma})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pass_cost_check)


# -- gpu-check ------------------------------------------------------------------------------------------------------


def _check_gpu_check(args: argparse.Namespace) -> LoopedConfig:
    """Every argument checked before any work (the script runs once on a rented GPU: it must not fail late)."""
    sizes = args.batch_sizes
    _all_at_least_one(batch_sizes=sizes)
    if len(sizes) < 3 or len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-sizes needs at least 3 distinct sizes (the first 2 fit the memory model, the "
                         f"others are held out), got {sizes}")
    _at_least_one(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats)
    try:
        config = gpu_check.CONFIGS[args.config]()
    except (OSError, ValueError) as error:
        raise ValueError(f"--config {args.config!r} could not be read: {error}") from None
    R = config.mean_recurrence
    bad = [d for d in args.draft_loops if not 1 <= d < R]
    if bad:
        raise ValueError(f"--draft-loops must each be in [1, {R - 1}] (fewer than the R = {R} loops of --config "
                         f"{args.config}), got {bad}")
    if args.prompt_tokens + args.new_tokens > config.block_size:
        raise ValueError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} exceeds the context "
                         f"of --config {args.config} (block_size {config.block_size})")
    if args.out is not None:
        outputs.check_file(args.out, "--out", args.force)
    return config


def cmd_gpu_check(args: argparse.Namespace) -> int:
    config = _check_gpu_check(args)
    gpu_check.run(_options(gpu_check.Options, args), config)
    return 0


def _add_gpu_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu-check", help="cache memory and loop cost of a full-size model with random weights, for "
                                         "a GPU (looped_kv.experiments.gpu_check)",
                       description=plain(gpu_check.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="huginn-0125", choices=sorted(gpu_check.CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="at least 3 distinct batch sizes; the first 2 fit the memory model (default: 1 2 4 8)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt (default: 256)")
    p.add_argument("--new-tokens", type=int, default=8, help="new tokens per sequence (default: 8)")
    p.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="d values to time, each in [1, R - 1] (default: 1 2 4 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per d, the median kept (default: 5)")
    p.add_argument("--out", default=None, help="write the figures as JSON to this file (a new file)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=cmd_gpu_check)


# -- plan-check -----------------------------------------------------------------------------------------------------


def _random_config(args: argparse.Namespace) -> Callable[[], LoopedConfig]:
    """The config of --model (a published config, a checkpoint folder or a config.json), for a model of random
    weights, after --profile and --chapters are checked; it is read when called."""
    configs = gpu_check.CONFIGS
    path = Path(args.model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if args.model not in configs and not path.is_file():  # every argument checked before the model is built
        raise ValueError(f"--model must be one of {tuple(configs)}, a checkpoint folder or a config.json, got "
                         f"{args.model!r}")
    if args.profile is not None and args.profile not in profiles.PROFILES:
        raise ValueError(f"--profile must be one of {tuple(profiles.PROFILES)}, got {args.profile!r}")
    unknown = [c for c in args.chapters if c not in plan_check.RUNS]
    if unknown:
        raise ValueError(f"--chapters must be among {tuple(plan_check.RUNS)}, got {unknown}")
    return lambda: _recorded_config(args.model)


def cmd_plan_check(args: argparse.Namespace) -> int:
    read_config = _random_config(args)
    if args.resume and (args.out is None or not args.out.is_file()):
        raise ValueError(f"--resume continues the record in --out, which must be an existing file, got {args.out}")
    if args.out is not None:
        outputs.check_file(args.out, "--out", args.force or args.resume)
    plan_check.run(args.model, read_config(), profile=args.profile, device=args.device, chapters=args.chapters,
                   out=args.out, resume=args.resume, command=" ".join(["looped-kv", "plan-check", *args.words]))
    return 0


def _add_plan_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan-check", help="each chapter's measured peak memory against the plan, random weights "
                                          "(looped_kv.experiments.plan_check)",
                       description=plain(plan_check.__doc__).splitlines()[0])
    p.add_argument("--model", default="huginn-0125", help=f"one of {tuple(gpu_check.CONFIGS)}, or a checkpoint "
                                                          f"folder or config.json (its config with random weights)")
    p.add_argument("--profile", default=None, help="a profile of looped_kv.profiles (default: the model's for the "
                                                   "GPU found)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chapters", nargs="+", default=list(plan_check.RUNS), help="chapters to run (default: all)")
    p.add_argument("--out", type=Path, default=None, help="write the record as JSON here (a new file), after every "
                                                           "chapter")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--resume", action="store_true", help="continue the record in --out (the same model and "
                                                         "profile): keep its chapters and add the others")
    p.set_defaults(func=cmd_plan_check)


# -- plan-time ------------------------------------------------------------------------------------------------------


def cmd_plan_time(args: argparse.Namespace) -> int:
    read_config = _random_config(args)
    out = outputs.check_file(args.out, "--out", args.force)
    plan_time.run(args.model, read_config(), args.profile, args.chapters, out,
                  " ".join(["looped-kv", "plan-time", *args.words]), progress=not args.quiet)
    return 0


def _add_plan_time(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan-time", help="each chapter's predicted minutes on this CPU: its calls counted on a narrow "
                                         "stand-in, priced at the model's dimensions (looped_kv.analysis.plan_time)",
                       description=plain(plan_time.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="parcae-140m", help=f"one of {tuple(gpu_check.CONFIGS)}, or a checkpoint "
                                                          f"folder or config.json (default: parcae-140m)")
    p.add_argument("--profile", default=None, help="a profile of looped_kv.profiles (default: the model's CPU "
                                                   "profile)")
    p.add_argument("--chapters", nargs="+", default=list(plan_check.RUNS), help="chapters to count (default: all)")
    p.add_argument("--out", type=Path, required=True, help="the record to write (a new JSON file)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_plan_time)


# -- train ----------------------------------------------------------------------------------------------------------


def _check_train(args: argparse.Namespace) -> None:
    """One-line errors before any work."""
    for name in ("steps", "batch", "seq", "vocab", "n_embd", "heads", "mean_recurrence", "min_recurrence",
                 "backprop", "eval_every", "eval_programs", "checkpoint_every", "threads", "start_depth",
                 "mix_from_depth", "depth_step", "curriculum_loops", "curriculum_every"):
        _at_least_one(**{name: getattr(args, name)})
    if args.vocab < 257:
        raise ValueError(f"--vocab must be >= 257 (the byte alphabet and end-of-text), got {args.vocab}")
    if args.n_embd % args.heads:
        raise ValueError(f"--n-embd ({args.n_embd}) must be divisible by --heads ({args.heads})")
    _check_layers(args.layers)
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.minutes < 0:
        raise ValueError(f"--minutes must be >= 0, got {args.minutes}")
    if not 0 < args.advance_at <= 1:
        raise ValueError(f"--advance-at must be in (0, 1], got {args.advance_at}")
    if min(args.mix) < 0 or abs(sum(args.mix) - 1) > 1e-6:
        raise ValueError(f"--mix must be three fractions >= 0 that sum to 1, got {args.mix}")
    if args.start_depth > data.CHAIN_DEPTH:
        raise ValueError(f"--start-depth must be in [1, {data.CHAIN_DEPTH}], got {args.start_depth}")
    if not 1 <= args.chains <= 4:
        raise ValueError(f"--chains must be in [1, 4], got {args.chains}")
    if not 0 <= args.deep_share <= 1:  # NaN fails too
        raise ValueError(f"--deep-share must be in [0, 1], got {args.deep_share}")
    if not 0 <= args.decay_from < args.steps:
        raise ValueError(f"--decay-from must be in [0, --steps), got {args.decay_from} (--steps {args.steps})")
    if args.resume and not (args.out / "checkpoint.pt").exists():
        raise ValueError(f"--resume needs {args.out / 'checkpoint.pt'}, which does not exist")


def _train_arguments(p: argparse.ArgumentParser) -> None:
    """The training options; their defaults are the shipped model's recipe (``config.json``'s training record)."""
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoint, log, and the model at the end")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt with its arguments")
    p.add_argument("--export", type=Path, help="also write the finished model to this folder")
    p.add_argument("--force", action="store_true", help="write into an --out or --export folder this command did "
                                                        "not make (a new run over an old one's files)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60_000)
    p.add_argument("--minutes", type=float, default=0, help="end this sitting after this much wall time (0: never)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary; 257 is one token per byte")
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, nargs=3, default=[1, 1, 1], metavar=("PRELUDE", "CORE", "CODA"))
    p.add_argument("--mean-recurrence", type=int, default=16, help="mean loops per training step (the most, with "
                                                                   "--recurrence-follows-depth)")
    p.add_argument("--min-recurrence", type=int, default=8, help="the least mean, with --recurrence-follows-depth")
    p.add_argument("--recurrence-follows-depth", action="store_true",
                   help="mean recurrence = curriculum depth + backprop, within [min, mean]")
    p.add_argument("--backprop", type=int, default=4, help="loops with gradient (truncated backpropagation)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--mix", type=float, nargs=3, default=[0.2, 0.2, 0.6], metavar=("PROBLEMS", "CODE", "CHAINS"),
                   help="fraction of each batch's rows (and weight in the loss) of each workload")
    p.add_argument("--mix-from-depth", type=int, default=16, help="chains alone until the curriculum reaches this "
                                                                  "depth, then --mix")
    p.add_argument("--start-depth", type=int, default=4, help="deepest query at the start of the curriculum")
    p.add_argument("--depth-step", type=int, default=2, help="how far the curriculum raises the deepest query")
    p.add_argument("--advance-at", type=float, default=0.6, help="accuracy on the deepest allowed queries that "
                                                                 "raises the curriculum")
    p.add_argument("--curriculum-loops", type=int, default=32, help="loops at which the curriculum is judged")
    p.add_argument("--curriculum-every", type=int, default=100)
    p.add_argument("--chains", type=int, default=1, help="most chains per program (one query each)")
    p.add_argument("--interleave", action="store_true", help="interleave a program's chains")
    p.add_argument("--chain-layout", choices=train.CHAIN_LAYOUTS, default="single",
                   help="single: one chain per program; multi: several contiguous chains, each queried once, with "
                        "a dense query line (the decoding workload); multi-lookup: those alternating with lookup "
                        "drills; lookup: the drills alone, up to 4 names per step of the curriculum's cap; "
                        "multi-all: drills and multichain programs that ask every variable; multi-positional: "
                        "multichain programs whose query line holds each chain's answer alone, in order (7;3;); "
                        "multi-count: those asked from the last chain, at most as many chains as the curriculum's cap; "
                        "multi-count-named: the same, each chain asked by its name (x?3;); "
                        "multi-count-named-drills: those alternating with lookup drills of up to 4 names per chain of "
                        "the cap")
    p.add_argument("--value-first", action="store_true",
                   help="write each binding after its expression (3=a;a+4=b;), in every layout but single")
    p.add_argument("--decay-from", type=int, default=0, help="step at which the cosine learning-rate decay starts; "
                                                             "it ends at --steps")
    p.add_argument("--deep-share", type=float, default=0.0,
                   help=f"share of steps that run {train.DEEP_LOOPS} loops instead of a drawn count")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="autocast dtype of the products")
    p.add_argument("--eager", action="store_true", help="do not compile the loop")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-programs", type=int, default=256)
    p.add_argument("--checkpoint-every", type=int, default=250)


def train_options(words: list[str]) -> train.Options:
    """The settings of a training command line (``looped-kv train``'s options, defaults the shipped recipe), checked:
    a ValueError (argparse's exit for what it rejects itself) on bad input."""
    p = Parser(prog=train.COMMAND)
    _train_arguments(p)
    args = p.parse_args(words)
    _check_finite(args)
    _check_train(args)
    return _options(train.Options, args)


def _train_command(words: list[str]) -> str:
    """The command line a finished run records."""
    return " ".join([train.COMMAND, *words])


def _exported_model(folder: Path) -> bool:
    """Whether ``folder`` holds a model that ``looped-kv train`` exported: config.json with its training record."""
    try:
        return isinstance(json.loads((folder / "config.json").read_text()).get("training"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def _check_train_outputs(args: argparse.Namespace) -> None:
    """--out and --export probed before any work; a folder the command did not make is refused (outputs)."""
    if args.resume:  # the run's own folder, which holds its checkpoint.pt (_check_train)
        outputs.probe(args.out / "checkpoint.pt", "--out")
    else:
        outputs.check_folder(args.out, "--out", lambda folder: False, "a new run starts in a new or empty folder; "
                             "--resume continues a run from its checkpoint.pt", args.force)
    if args.export is not None:
        outputs.check_folder(args.export, "--export", _exported_model, "an export replaces only a model that "
                             "looped-kv train exported: config.json with its training record", args.force)


def cmd_train(args: argparse.Namespace) -> int:
    _check_train(args)
    _check_train_outputs(args)
    words = args.words
    given = [name for name in train.RESUMABLE if f"--{name.replace('_', '-')}" in words]
    train.run(_options(train.Options, args), given=given, command=_train_command(words))
    return 0


#: How ``select`` chooses without ``--step``.
BEST_EVALUATED = "the highest development answer accuracy at R = 32 among the kept evaluations"


def cmd_select(args: argparse.Namespace) -> int:
    if not (args.out / "checkpoint.pt").exists():
        raise ValueError(f"--out {args.out} holds no checkpoint.pt: it must be a looped-kv train run folder")
    step = train.best_evaluated(args.out) if args.step is None else args.step
    outputs.check_folder(args.export, "--export", _exported_model, "an export replaces only a model that "
                         "looped-kv train exported: config.json with its training record", args.force)
    selected_by = BEST_EVALUATED if args.step is None else "--step"
    print(f"step {step} ({selected_by})", flush=True)
    train.export_evaluated(args.out, step, args.export, " ".join(["looped-kv select", *args.words]), selected_by)
    return 0


def _add_select(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("select", help="write the model a training run kept at one of its held-out evaluations",
                       description="Write the model a looped-kv train run kept at one of its held-out evaluations "
                                   "(OUT/evaluated), chosen on the development split: by default "
                                   f"{BEST_EVALUATED}; --step names one. The run's files are only read.")
    p.add_argument("--out", type=Path, required=True, help="the run folder (looped-kv train --out)")
    p.add_argument("--export", type=Path, required=True, help="the folder to write the model to")
    p.add_argument("--step", type=int, help="an evaluated step (default: the best, see above)")
    p.add_argument("--force", action="store_true", help="write into an --export folder this command did not make")
    p.set_defaults(func=cmd_select)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the shipped tiny model on CPU with Huginn's recipe; resumable "
                                     "(looped_kv.tiny.train)",
                       description=plain(train.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    _train_arguments(p)
    p.set_defaults(func=cmd_train)


# -- gates ----------------------------------------------------------------------------------------------------------


def cmd_gates(args: argparse.Namespace) -> int:
    config = Path(args.model) / "config.json"
    if not config.is_file():
        raise ValueError(f"--model {args.model!r}: not a checkpoint folder (it has no config.json)")
    if not args.no_record:
        if not _exported_model(Path(args.model)):
            raise ValueError(f"--model {args.model!r}: its config.json has no training record (looped-kv train did "
                             f"not write it); gates records only into a model the trainer made: pass --no-record")
        outputs.probe(config, "--model")
    gates.run(args.model, record=not args.no_record)
    return 0


def _add_gates(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gates", help="the numeric gates the tiny model must pass, measured on held-out data "
                                     "(looped_kv.tiny.gates)",
                       description=plain(gates.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(TINY_DIR), help="checkpoint folder (default: the shipped tiny model)")
    p.add_argument("--no-record", action="store_true", help="print only; do not write config.json")
    p.set_defaults(func=cmd_gates)


# -- scout ----------------------------------------------------------------------------------------------------------


def cmd_scout(args: argparse.Namespace) -> int:
    if args.list or args.recipe is None:
        scout.show()
        return 0
    out = scout.RUNS / args.recipe
    if out.exists():
        raise ValueError(f"{out} exists: a scouting run is one sitting; move it away to run {args.recipe} again")
    # the run's folder and its record, before the copy and the training
    outputs.probe(out, "the run folder", folder=True, remedy=f"run scout where {scout.RUNS} can be written")
    outputs.probe(scout.RECORDS / f"{args.recipe}.json", "the scouting record", remedy="the package folder must be "
                  "writable (an editable install)")
    if args.recipe in scout.STARTS:
        scout.start(args.recipe)
    words = scout.train_words(args.recipe, args.minutes)
    given = tuple(name for name in train.RESUMABLE if f"--{name.replace('_', '-')}" in words)
    scout.run(args.recipe, train_options(words), command=_train_command(words), given=given)
    return 0


def _add_scout(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scout", help="short, measured trainings of the tiny model that choose the long run's recipe "
                                     "(looped_kv.tiny.scout)",
                       description=plain(scout.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", choices=sorted(scout.RECIPES))
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--list", action="store_true")
    p.set_defaults(func=cmd_scout)


# -- chapter-times --------------------------------------------------------------------------------------------------


def _recorded_config(model: str) -> LoopedConfig:
    """The config a record names as its model: a published config, a checkpoint folder or a config.json."""
    if model in gpu_check.CONFIGS:
        return gpu_check.CONFIGS[model]()
    path = Path(model).expanduser()
    return LoopedConfig.from_file(path / "config.json" if path.is_dir() else path)


def cmd_chapter_times(args: argparse.Namespace) -> int:
    from looped_kv import book

    if args.plan_time is not None and not args.plan_time.is_file():
        raise ValueError(f"--plan-time must be a record of looped-kv plan-time (a JSON file), got {args.plan_time}")
    if args.plan_time is not None and args.cpu_run is None:
        header, cost, work = plan_time.read(args.plan_time)
        planned = plan_time.planned_seconds(header, cost, work)
        config, profile = _recorded_config(header["model"]), profiles.PROFILES[header["profile"]]
        print(book.cpu_plan_table(planned, {chapter: plan_check.host_peak_beyond_weights(config, profile, chapter)
                                            for chapter in planned}, Path(args.notebooks)), end="")
        return 0
    if args.cpu_run is None:
        print(book.chapter_times(Path(args.notebooks)), end="")
        return 0
    if not args.cpu_run.is_file():
        raise ValueError(f"--cpu-run must be a record of looped-kv plan-check (a JSON file), got {args.cpu_run}")
    planned = None
    if args.plan_time is not None:
        planned = plan_time.planned_seconds(*plan_time.read(args.plan_time))
    print(book.cpu_run_table(json.loads(args.cpu_run.read_text()), Path(args.notebooks), planned), end="")
    return 0


def _add_chapter_times(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chapter-times", help="the minutes each executed chapter took, from the timing its executor "
                                             "recorded (a Markdown table; book/data/chapter-times.md keeps it)")
    p.add_argument("--notebooks", default="notebooks", help="the folder of the executed .ipynb files")
    p.add_argument("--cpu-run", type=Path, default=None,
                   help="instead, the minutes and peak host memory of each chapter's run in this record of "
                        "looped-kv plan-check (book/data/cpu-run-parcae-140m.md keeps parcae-140m's)")
    p.add_argument("--plan-time", type=Path, default=None,
                   help="with --cpu-run, add each chapter's predicted minutes from this record of looped-kv "
                        "plan-time; alone, the plan's minutes and peak GB per chapter")
    p.set_defaults(func=cmd_chapter_times)


# -- verdicts -------------------------------------------------------------------------------------------------------


def cmd_verdicts(args: argparse.Namespace) -> int:
    from looped_kv import book

    paths = args.notebooks or [Path("notebooks") / f"{name}.ipynb" for name in book.NOTEBOOKS if name.startswith("ch")]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"NOTEBOOK must be executed .ipynb files, not found: {', '.join(missing)}")
    print(book.verdict_listing(paths), end="")
    return 0


def _add_verdicts(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verdicts", help="every verdict the executed chapters show, as a Markdown table (chapter, "
                                        "claim, verdict, estimate [interval], n), to compare executions")
    p.add_argument("notebooks", nargs="*", type=Path, metavar="NOTEBOOK",
                   help="executed chapters (.ipynb; default: the book's chapters in notebooks/)")
    p.set_defaults(func=cmd_verdicts)


def parser() -> Parser:
    ap = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show an error's traceback (give it before the command)")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser,
                            metavar="{generate,bench,batched,memory,plan,batch,speed,pass-cost,pass-cost-check,gpu-check,"
                                    "plan-check,plan-time,train,select,gates,scout,chapter-times,verdicts}")
    for add in (_add_generate, _add_bench, _add_batched, _add_memory, _add_plan, _add_batch, _add_speed,
                _add_pass_cost, _add_pass_cost_check, _add_gpu_check, _add_plan_check, _add_plan_time, _add_train,
                _add_select, _add_gates, _add_scout, _add_chapter_times, _add_verdicts):
        add(sub)
    ap.commands = sub.choices
    return ap


def _one_line(error: BaseException) -> str:
    """An error's message as one line (its first); the type's name when it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Run a command line (default: sys.argv); errors go by the command's name, e.g. ``looped-kv train``, one line
    each (with a leading ``--debug``: raised, with their traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = argv[:1] == ["--debug"]
    argv = argv[1:] if debug else argv
    name = PROG
    try:
        ap = parser()
        if argv[:1] and argv[0] in ap.commands:
            name = ap.commands[argv[0]].prog
        args = ap.parse_args(argv)
        args.words = argv[1:]  # the command's own words as given (train --resume: which options were given again)
        _check_finite(args)
        if getattr(args, "device", None) is not None:  # before any work: cuda on a CPU-only torch, "foo", ...
            check_device(args.device)
        if getattr(args, "threads", None) is not None and args.command != "batch":
            _at_least_one(threads=args.threads)
            torch.set_num_threads(args.threads)
        return args.func(args)
    except BrokenPipeError:  # the reader stopped reading (`| head`): stop quietly, as a killed pipe writer would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error while Python flushes
        return 128 + signal.SIGPIPE
    except (ValueError, OSError, SelfTestFailure) as error:  # OSError: missing files, unreachable hub, full disk
        if debug:
            raise
        print(f"{name}: error: {_one_line(error)}", file=sys.stderr)
        return 3 if isinstance(error, SelfTestFailure) else 2
    except KeyboardInterrupt as error:  # Ctrl-C: one line (a batch run says where its unfinished archive is)
        if debug:
            raise
        print(f"{name}: {_one_line(error) if str(error) else 'interrupted'}", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as error:  # anything else: a bug or an input no check foresaw; still one line
        if debug:
            raise
        print(f"{name}: error: {type(error).__name__}: {_one_line(error)} (run {PROG} --debug {' '.join(argv[:1])} "
              f"... for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
