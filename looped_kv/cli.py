"""The looped-kv command: generate, bench, batched, memory, plan and pre-registered batches.

    looped-kv generate --method mature-spec --cache ripe --window 16 "Question: ... Answer:"
    looped-kv bench --workloads problems --prompts 32 --methods ar self-spec mature-spec
    looped-kv batched --batch-sizes 1 2 4 8 --budget-mb 24   # python -m looped_kv.experiments.throughput
    looped-kv memory --model huginn-0125 --context 1024 4096
    looped-kv plan --model huginn-0125 --gpu-memory 40    # does every chapter fit one GPU?
    looped-kv batch freeze regions                     # the shipped example, or a spec file
    looped-kv batch run regions.frozen.json --out runs/regions
    looped-kv batch verify runs/regions
    looped-kv batch compare runs/regions runs/regions-torchrun   # byte for byte, else the largest differences
    looped-kv batch ledger runs/regions runs/windows

Errors are one line on stderr (looped-kv: error: ...) and exit status 2 (3 when a self-test fails).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from typing import NoReturn

import pandas as pd
import torch

from looped_kv import profiles, workloads
from looped_kv.analysis import plan
from looped_kv.analysis.verdicts import MIN_UNITS
from looped_kv.book import DTYPES
from looped_kv.decoding.generate import generate
from looped_kv.decoding.settings import METHODS, DasWave, Greedy, PromptLookup, SelfSpec
from looped_kv.experiments import bench, throughput
from looped_kv.protocol import batches
from looped_kv.protocol.selftest import SelfTestFailure
from looped_kv.runtime.config import PRESETS, LoopedConfig
from looped_kv.runtime.loading import load, model_config, resolve_source
from looped_kv.runtime.measurement import check_device
from looped_kv.runtime.memory import BYTES, element_bytes, layer_token_bytes, m_deep, m_full, policy_bytes
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CACHE_POLICIES, PREFIX_READS, make_policy
from looped_kv.workloads import data

PROG = "looped-kv"


def plain(doc: str | None) -> str:
    """A docstring as plain help text: reST roles and double backticks removed."""
    text = re.sub(r":(?:func|class|mod|data|meth|attr):`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _device(name: str | None) -> str:
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _load(args: argparse.Namespace) -> LoopedLM:
    device = _device(args.device)
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return load(args.model, dtype=DTYPES[dtype], device=device)


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' (shipped), a checkpoint folder or a hub id such as "
                                                  "tomg-group-umd/huginn-0125 (default: tiny)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="weights dtype (default: bfloat16 on CUDA, else float32)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


# -- generate -------------------------------------------------------------------------------------------------------


def _at_least_one(**flags: int | None) -> None:
    """ValueError naming the first flag (given as its dest, e.g. num_loops) whose value is below 1."""
    for dest, value in flags.items():
        if value is not None and value < 1:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= 1, got {value}")


def cmd_generate(args: argparse.Namespace) -> int:
    _at_least_one(num_loops=args.num_loops, max_new_tokens=args.max_new_tokens)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text:
        raise ValueError("prompt must be non-empty text (or '-' to read it from stdin)")
    model = _load(args)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; generate needs one for text in and out")
    ids = model.tokenizer(text, return_tensors="pt").input_ids.to(model.device)
    flags = {"exact": False if args.inexact else None, "carry": False if args.no_carry else None}
    options = {key: getattr(args, key) for key in ("num_loops", "window", "k", "sinks", "draft_loops", "gamma",
                                                   "prefix_reads", "ngram", "rounds", "initial_width", "updates")}
    out = generate(model, ids, method=args.method, cache=args.cache, max_new_tokens=args.max_new_tokens,
                   progress=args.progress, **options, **flags)
    completion = model.tokenizer.decode(out.new_tokens[0].tolist())
    stats = {"method": args.method, "cache": out.details.get("policy", args.cache), **out.stats()}
    if args.json:
        print(json.dumps({"prompt": text, "completion": completion, "stats": stats}))
    else:
        print(completion)
        print("  ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}" for key, val in stats.items()),
              file=sys.stderr)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with any decoder and cache; prints the completion and "
                                        "statistics", description=plain(generate.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="prompt text, or '-' to read it from stdin")
    _model_options(p)
    p.add_argument("--method", default="ar", choices=METHODS, help="decoder (default: ar, greedy decoding)")
    p.add_argument("--cache", default="full", choices=CACHE_POLICIES, help="verifier's cache policy (default: full)")
    p.add_argument("--window", type=int, help="RIPE window W (cache ripe or sinks)")
    p.add_argument("--k", type=int, help="planes for k-deepest / share / first")
    p.add_argument("--sinks", type=int, help="full-depth start positions (cache sinks, or ripe)")
    p.add_argument("--num-loops", type=int, help="R (default: the model's mean recurrence)")
    p.add_argument("--max-new-tokens", type=int, default=Greedy.max_new_tokens,
                   help=f"tokens to generate (default: {Greedy.max_new_tokens})")
    p.add_argument("--draft-loops", type=int, help=f"d, loops per draft (self-spec, mature-spec; default: "
                                                   f"{SelfSpec.draft_loops})")
    p.add_argument("--gamma", type=int, help=f"gamma, drafts per verification (self-spec, mature-spec, pld; default: "
                                             f"{SelfSpec.gamma}; das-wave {DasWave.gamma})")
    p.add_argument("--prefix-reads", choices=PREFIX_READS, help=f"drafts' prefix reads (self-spec default aligned, "
                                                                f"deep-kv with cache ripe; das-wave default "
                                                                f"{DasWave.prefix_reads})")
    p.add_argument("--inexact", action="store_true", help="allow block-dependent verification (cache with W < "
                                                          "gamma; RIPE Proposition 1)")
    p.add_argument("--ngram", type=int, help=f"n-gram length of prompt lookup (pld; default: {PromptLookup.ngram})")
    p.add_argument("--rounds", type=int, help=f"J, refinement rounds (das-wave; default: {DasWave.rounds})")
    p.add_argument("--initial-width", type=int, help=f"W_init (das-wave; default: {DasWave.initial_width})")
    p.add_argument("--updates", type=int, help=f"updates per round, DAS k (das-wave; default: {DasWave.updates})")
    p.add_argument("--no-carry", action="store_true", help="do not carry refined states (das-wave)")
    p.add_argument("--json", action="store_true", help="print one JSON object (prompt, completion, stats)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=cmd_generate)


# -- bench ----------------------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    bench.check_options(args.prompts, args.max_new_tokens, args.draft_loops, args.gamma, args.methods, args.workloads,
                        args.repeats)
    try:  # the config first (no weights): R is known before the model is loaded
        config = LoopedConfig.from_file(resolve_source(args.model) / "config.json")
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {args.model!r}: {error}") from None
    bench.check_model(config.mean_recurrence, args.draft_loops)
    model = _load(args)
    if model.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer; the benchmark's prompts are text")
    bench.report(model, args.workloads, args.prompts, args.max_new_tokens, args.methods, args.draft_loops, args.gamma,
                 progress=not args.quiet, repeats=args.repeats, modes=args.modes)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed-ups of every decoder over paired greedy decoding, one sequence at a "
                                     "time, and the verdict on Mature-Spec against self-speculation (chapters 5-6; "
                                     "batched throughput and memory: looped-kv batched)",
                       description="Each evaluation prompt is decoded alone, greedily and by every method, in the same"
                                   " process, stopping at end-of-text, in interleaved rounds. The speed-up is DAS Eq. "
                                   "(8), the mean over prompts of the tokens/s ratio to the paired greedy run, with a "
                                   "95% paired bootstrap interval; beside it, tau (sequential drafters) or A (das-"
                                   "wave) as a fraction of its ceiling (gamma + 1, or w = min(gamma, W_init + J - 1)),"
                                   " A and G (DAS Eq. 9-10). Per workload it prints the verdicts on 'Mature-Spec beats"
                                   " self-speculation' (acceptance, DAS Table 2; speed, DAS Table 1).")
    _model_options(p)
    p.add_argument("--workloads", nargs="+", default=list(data.WORKLOADS), choices=data.WORKLOADS,
                   help="prompt workloads (default: all)")
    p.add_argument("--prompts", type=int, default=MIN_UNITS["paired"],
                   help=f"evaluation prompts per workload, >= 2 (default: {MIN_UNITS['paired']}, the fewest an "
                        f"acceptance verdict accepts; a speed verdict needs {MIN_UNITS['timing']})")
    p.add_argument("--repeats", type=int, default=2,
                   help="interleaved timing rounds per prompt, >= 1 (default: 2; a speed verdict needs 2)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per prompt (default: 128)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="decoders (default: all); greedy decoding (ar) always runs as the reference")
    p.add_argument("--draft-loops", type=int, default=SelfSpec.draft_loops,
                   help=f"d of self-spec and mature-spec, in [1, R - 1] (default: {SelfSpec.draft_loops})")
    p.add_argument("--gamma", type=int, default=SelfSpec.gamma,
                   help=f"gamma of self-spec, mature-spec and pld (default: {SelfSpec.gamma}); das-wave runs "
                        f"looped_kv.decoding.settings.DasWave")
    p.add_argument("--modes", nargs="+", default=list(bench.MODES), choices=bench.MODES,
                   help="eager passes, compiled steps (compile=True), or both side by side (default: both)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_bench)


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
    if args.profile is not None and args.profile not in profiles.PROFILES:
        raise ValueError(f"--profile must be one of {tuple(profiles.PROFILES)}, got {args.profile!r}")
    config = model_config(args.model, "--model")
    card = profiles.card_for(args.gpu_memory)
    profile = profiles.PROFILES[args.profile or profiles.name_for(config, args.model, card)]
    plans = plan.chapter_plans(config, profile)
    table = plan.plan_table(plans, args.gpu_memory * plan.GB)
    heading = (f"{args.model} at profile {profile.name} ({profile.dtype}; {workloads.SOURCES[profile.workloads]}, "
               f"prompts up to {profile.prompt_tokens} tokens, {profile.rows_per_chunk or 'all'} rows per chunk) on a "
               f"{args.gpu_memory:g} GB GPU, {plan.GPU_RESERVE / plan.GB:g} GB kept free")
    too_large = plan.steps_beyond(plans, args.gpu_memory * plan.GB)
    if args.markdown:
        print(f"{heading}:\n\n{plan.markdown(table)}", end="")
        if too_large:
            print("\nSteps that do not fit:\n\n" + "".join(f"* {line}\n" for line in too_large), end="")
        return 0 if table["fits"].all() else 1
    print(f"{heading}:")
    shown = table.assign(fits=table["fits"].map({True: "yes", False: "NO"}))
    print(shown.drop(columns="sizes").to_string(float_format=lambda x: f"{x:.1f}"))
    for name, sizes in table["sizes"].items():
        print(f"  {name}: {sizes}")
    missing = list(table.index[~table["fits"]])
    if missing:
        for line in too_large:
            print(f"  does not fit: {line}")
        print(f"{', '.join(missing)} need more than {args.gpu_memory:g} GB; choose a larger GPU or a smaller profile")
        return 1
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="will every chapter fit one GPU? predicted peak GPU and host memory per chapter",
                       description="The package's own accounting of what each chapter allocates at its run profile "
                                   "(looped_kv.profiles): weights in each dtype, replay records, caches and the "
                                   "working set of a forward pass. Prints each chapter's predicted peak GPU and "
                                   "host memory and whether it fits; exits 1 if any chapter does not.")
    p.add_argument("--model", default="huginn-0125", help=f"one of {tuple(PRESETS)}, 'tiny', a checkpoint "
                                                          f"folder, a config.json or a hub id (default: huginn-0125)")
    p.add_argument("--gpu-memory", type=float, default=40.0, help="GPU memory in GB (default: 40, an A100-40GB)")
    p.add_argument("--profile", help=f"run profile, one of {tuple(profiles.PROFILES)} (default: the model's for "
                                     f"a GPU of this memory: looped_kv.profiles.BY_CARD)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (book/data/ keeps one)")
    p.add_argument("--card", help=f"instead: every published model's profile and peaks on a GPU class, one of "
                                  f"{tuple(profiles.CARDS)} (a Markdown table; book/data/ keeps one per card)")
    p.set_defaults(func=cmd_plan)


# -- batched --------------------------------------------------------------------------------------------------------


def cmd_batched(args: argparse.Namespace) -> int:
    throughput.main(args.args, prog=f"{PROG} batched", parser_class=Parser)
    return 0


def _add_batched(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batched", add_help=False,
                       help="batched decoding: tokens/s against batch size, the peak-memory model and the "
                            "fixed-memory throughput ratio (chapter 7; see looped-kv batched --help)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of python -m looped_kv.experiments.throughput")
    p.set_defaults(func=cmd_batched)


# -- batch ----------------------------------------------------------------------------------------------------------


def cmd_freeze(args: argparse.Namespace) -> int:
    path = batches.freeze(args.spec, args.out, force=args.force)
    table = batches.read_table(path)
    groups = pd.Series([name.split("/")[0] for name in table["files"]]).value_counts()
    counts = ", ".join(f"{n} {group}" for group, n in groups.items())
    print(f"froze batch {table['batch']}: {len(table['files'])} files ({counts}) -> {path}")
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


def parser() -> Parser:
    ap = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{generate,bench,batched,memory,plan,batch}",
                            parser_class=Parser)
    _add_generate(sub)
    _add_bench(sub)
    _add_batched(sub)
    _add_memory(sub)
    _add_plan(sub)
    _add_batch(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["batched"]:  # its options go to the throughput parser (argparse cannot pass them on)
            return cmd_batched(argparse.Namespace(args=argv[1:]))
        args = parser().parse_args(argv)
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
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 3 if isinstance(error, SelfTestFailure) else 2
    except KeyboardInterrupt as error:  # Ctrl-C: one line (a batch run says where its unfinished archive is)
        print(f"{PROG}: {str(error) or 'interrupted'}", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
