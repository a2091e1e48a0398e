"""Decoding speed, measured side by side in one run: greedy decoding against the public Huginn reference code, and
every method eager and compiled.

1. Greedy decoding against the reference. Both implementations decode the same prompt from the same
   random-weight checkpoint (the shipped tiny model's dimensions, written in the public checkpoint format),
   in float32: looped_kv's eager decoder, its compiled passes (``compile=True``), and the reference's
   ``generate_minimal`` with its own cache.
2. Every method (greedy, self-spec, Mature-Spec, prompt lookup, DAS-Wave; :mod:`looped_kv.decoding.settings`'s
   defaults), eager and compiled, on the shipped tiny model and an evaluation prompt of a workload, where
   drafts are accepted as they are in the book. Each method is compared with greedy decoding of its own mode
   and its compiled run with its eager one.
3. The weights' layout: one pass of g tokens through all R loops (a verification block; g = 1 is greedy decoding's
   step) after a prompt, eager and compiled, on the shipped tiny model with its linear weights stored as looped_kv
   stores them (column-major: :meth:`~looped_kv.runtime.model.LoopedLM.store_weights_transposed`) against the same
   weights row-major, as a checkpoint holds them and ``nn.Linear`` keeps them.

Runs are interleaved (A, B, C, A, B, C, ...) so that drifts in machine speed fall on every arm alike; each
ratio is the median of the per-round ratios of paired runs, with the range over rounds. Compiled steps are
traced before the first round; after the rounds, prompts of new lengths count the traces they make (none in
the timed prompt's capacity bucket, one in a new bucket). Then looped_kv's tokens/s against the batch size.

The reference is not part of this package: point ``--reference`` at a checkout of the public code
(``git clone https://github.com/seal-rg/recurrent-pretraining``); its two modeling files are imported
from there as they are. They were written for transformers 4.x (4.47 lacks a call they make; looped_kv works
with any): run the comparison in an environment with ``pip install "transformers>=4.53,<5"``, or put such a
transformers ahead of the installed one, as this project's measurements did:

    pip install --no-deps --target ../transformers4 "transformers>=4.53,<5" "huggingface_hub>=0.34,<1" \
        "tokenizers>=0.22,<0.23"
    PYTHONPATH=../transformers4 looped-kv speed --reference ../recurrent-pretraining
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.util
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from looped_kv.decoding.compiled import CompiledPasses
from looped_kv.decoding.generate import generate
from looped_kv.decoding.passes import Passes, capacity_bucket, capacity_buckets, new_cache
from looped_kv.decoding.settings import DISPLAY
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.loading import TINY_DIR, load
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import make_policy
from looped_kv.workloads import data

REFERENCE_FILES = ("raven_config_minimal.py", "raven_modeling_minimal.py")
#: The command that runs :func:`run` (:mod:`looped_kv.cli`'s ``speed``), as a module.


@dataclass(frozen=True)
class Options:
    """One run's settings (``looped-kv speed``'s options, checked there)."""

    reference: Path | None  # checkout of seal-rg/recurrent-pretraining, or None: looped_kv only
    prompt: int  # prompt tokens of the reference comparison
    new_tokens: int
    num_loops: int  # R of the reference comparison
    layers: list[int] | None  # prelude, core, coda of the reference comparison's checkpoint (None: the tiny model's)
    rounds: int
    batch_sizes: list[int]  # of the tokens/s table; empty: skip it
    methods: list[str]  # timed eager and compiled on the tiny model; empty: skip them
    layout_tokens: list[int]  # tokens per pass of the layout comparison; empty: skip it
    workload: str
    no_compile: bool
    threads: int


def random_checkpoint(folder: Path, config: LoopedConfig, seed: int = 0) -> Path:
    """A random-weight checkpoint of ``config`` in the public format (config.json + model.safetensors)."""
    torch.manual_seed(seed)
    model = LoopedLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in model.state_dict().items() if key != "lm_head.weight"},
              folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))
    return folder


def import_reference(checkout: Path):
    """The reference's RavenForCausalLM and RavenConfig, imported from a checkout of the public code."""
    source = next((p for p in (checkout, checkout / "recpre") if (p / REFERENCE_FILES[1]).exists()), None)
    if source is None:
        raise FileNotFoundError(f"--reference {checkout} holds no recpre/{REFERENCE_FILES[1]} (a checkout of "
                                "https://github.com/seal-rg/recurrent-pretraining)")
    package = Path(tempfile.mkdtemp()) / "huginn_reference"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in REFERENCE_FILES:
        shutil.copy(source / name, package / name)
    spec = importlib.util.spec_from_file_location("huginn_reference", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["huginn_reference"] = module
    spec.loader.exec_module(module)
    modeling = importlib.import_module("huginn_reference.raven_modeling_minimal")
    return modeling.RavenForCausalLM, modeling.RavenConfig


#: The transformers versions the reference code runs under: its generate_minimal calls
#: ``_get_initial_cache_position``, which transformers 5 removed.
REFERENCE_TRANSFORMERS = "transformers < 5"


def check_transformers(version: str | None = None) -> None:
    """Refuse, in one line and before any work, a transformers the reference code cannot run under."""
    if version is None:
        import transformers

        version = transformers.__version__
    if int(version.split(".")[0]) >= 5:
        raise ValueError(f"--reference: the Huginn reference code runs under {REFERENCE_TRANSFORMERS} (it calls "
                         f"_get_initial_cache_position, removed in transformers 5), found transformers {version}; "
                         f"run this command from an environment with pip install '{REFERENCE_TRANSFORMERS}'")


def reference_model(checkout: Path, folder: Path, config: LoopedConfig, num_loops: int):
    """The reference's model of the same checkpoint, decoding with ``num_loops`` loops (its mean recurrence)."""
    from safetensors.torch import load_file

    model_class, config_class = import_reference(checkout)
    model = model_class(config_class(
        n_embd=config.n_embd, n_heads=config.n_heads, n_layers=config.n_layers, block_size=config.block_size,
        vocab_size=config.vocab_size, padding_multiple=1, intermediate_size=config.intermediate_size,
        n_layers_in_recurrent_block=config.n_core, n_layers_in_prelude=config.n_prelude,
        n_layers_in_coda=config.n_coda, qk_bias=config.qk_bias, rope_base=config.rope_base,
        mean_recurrence=num_loops, norm_eps=config.norm_eps))
    missing, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    if unexpected or any(key not in ("lm_head.weight", "freqs_cis") for key in missing):
        raise ValueError(f"the reference does not take this checkpoint: missing {missing}, unexpected {unexpected}")
    return model.float().eval()


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Timed runs with every object alive before them out of the cyclic garbage collector's reach (``gc.freeze``).

    A full collection walks every object of the process: in ``looped-kv speed``, with transformers and the
    reference loaded, one took 0.26 s, and it lands in whichever arm happens to allocate past the collector's
    threshold. Frozen, a collection walks only what the runs made, so no arm pays for the process it runs in.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def interleaved(arms: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each arm in each of ``rounds`` rounds, the arms run one after another within a round (under
    :func:`frozen_heap`)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    with frozen_heap():
        for _ in range(rounds):
            for name, run in arms.items():
                times[name].append(timed(run))
    return times


def paired(times: dict[str, list[float]], arm: str, base: str, tokens: dict[str, int] | None = None) -> str:
    """The median over rounds of (tokens/s of ``arm``) / (tokens/s of ``base``), with its range over rounds."""
    n = tokens or {}
    ratios = [(n.get(arm, 1) / a) / (n.get(base, 1) / b) for a, b in zip(times[arm], times[base], strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def greedy_against_reference(args: Options, config: LoopedConfig) -> None:
    """Section 1: greedy decoding, eager and compiled, against the reference's generate_minimal."""
    folder = random_checkpoint(Path(tempfile.mkdtemp()) / "checkpoint", config)
    ours = load(folder, dtype=torch.float32)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    R, n = args.num_loops, args.new_tokens
    options = dict(max_new_tokens=n, num_loops=R, stop_at_eos=False)
    arms = {"looped_kv eager": lambda: generate(ours, prompt, **options)}
    if not args.no_compile:
        arms["looped_kv compiled"] = lambda: generate(ours, prompt, compile=True, **options)
    if args.reference is not None:
        from transformers import GenerationConfig

        reference = reference_model(args.reference, folder, config, R)
        greedy = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, use_cache=True)

        def run_reference() -> torch.Tensor:
            with torch.no_grad():  # the reference reads max_new_tokens from its keyword, not from the config
                return reference.generate_minimal(prompt, generation_config=greedy, max_new_tokens=n)

        arms["reference generate_minimal"] = run_reference
    for name, run in arms.items():  # warm-up (the compiled passes are traced here), and every arm decodes n tokens
        out = run()
        emitted = (out.sequences[0].numel() if hasattr(out, "sequences") else out.shape[-1]) - prompt.shape[-1]
        if emitted != n:
            raise RuntimeError(f"{name} emitted {emitted} tokens, not the {n} asked for")
    times = interleaved(arms, args.rounds)
    print(f"greedy decoding, random weights at the tiny model's width (d = {config.n_embd}, "
          f"{config.n_prelude}/{config.n_core}/{config.n_coda} layers), R = {R}, prompt {args.prompt}, {n} new tokens, "
          f"float32, {torch.get_num_threads()} thread(s), {args.rounds} interleaved rounds")
    for name, ts in times.items():
        print(f"  {name:<28} {n / statistics.median(ts):8.1f} tokens/s (median of {len(ts)})")
    base = "reference generate_minimal"
    if base in times:
        for name in (key for key in times if key != base):
            print(f"  {name} / reference: {paired(times, name, base)} (median of the paired rounds, range)")
    if "looped_kv compiled" in times:
        print(f"  compiled / eager: {paired(times, 'looped_kv compiled', 'looped_kv eager')}")
        print("looped_kv compiled, traces made by prompts of new lengths after the timed one:")
        for length, bucket, traces in retraces(ours, args.prompt, n, R):
            print(f"  prompt {length:<4} capacity bucket {bucket:<5} {traces} new trace(s)")
    if args.batch_sizes:
        print("looped_kv eager, tokens/s against the batch size (same prompt in every row):")
        for b in args.batch_sizes:
            seconds = timed(lambda b=b: generate(ours, prompt.expand(b, -1), **options))
            print(f"  B = {b:<3} {b * n / seconds:8.1f} tokens/s")


def retraces(model: LoopedLM, timed_length: int, new_tokens: int, num_loops: int) -> list[tuple[int, int, int]]:
    """(prompt length, capacity bucket, traces it made) of compiled greedy decoding of prompts of new lengths, after
    one of ``timed_length``: the most, the middle and the fewest positions of its capacity bucket (no trace each),
    then of the bucket below (one trace for the first, none after)."""
    bucket = capacity_bucket(timed_length + new_tokens, model.config.block_size)
    below = [0] + [b for b in capacity_buckets(model.config.block_size) if b < bucket]
    spans = [(below[-1], bucket), (below[-2], below[-1])] if len(below) > 1 else [(0, bucket)]
    lengths = []
    for low, high in spans:
        ends = (high - new_tokens, (low + high) // 2 + 1 - new_tokens, low + 1 - new_tokens)
        lengths += [n for n in dict.fromkeys(ends) if n > 0 and n != timed_length]
    generator = torch.Generator().manual_seed(2)
    out = []
    for length in lengths:
        prompt = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        generate(model, prompt, max_new_tokens=new_tokens, num_loops=num_loops, stop_at_eos=False, compile=True)
        traces = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        out.append((length, capacity_bucket(length + new_tokens, model.config.block_size), traces))
    return out


def methods_side_by_side(args: Options) -> None:
    """Section 2: every method eager and compiled on the shipped tiny model, paired with greedy decoding."""
    model = load("tiny", dtype=torch.float32)
    text = data.prompts(args.workload, 1, "eval")[0]
    prompt = model.tokenizer(text, return_tensors="pt").input_ids
    modes = ("eager",) if args.no_compile else ("eager", "compiled")
    arms, outputs = {}, {}
    for method in args.methods:
        for mode in modes:
            options = dict(max_new_tokens=args.new_tokens, method=method, compile=mode == "compiled")
            arms[f"{method} {mode}"] = lambda options=options: outputs.__setitem__(
                (options["method"], options["compile"]), generate(model, prompt, **options))
    for run in arms.values():  # warm-up: the compiled passes are traced here
        run()
    tokens = {f"{m} {'compiled' if c else 'eager'}": out.num_new for (m, c), out in outputs.items()}
    times = interleaved(arms, args.rounds)
    print(f"\nevery method on the shipped tiny model (R = {model.config.mean_recurrence}), one {args.workload} "
          f"evaluation prompt of {prompt.shape[1]} tokens, up to {args.new_tokens} new tokens (stopping at "
          f"end-of-text), float32, {args.rounds} interleaved rounds; ratios: median of the paired rounds (range)")
    header = f"  {'method':<14}" + "".join(f"{mode + ' tokens/s':>20}" for mode in modes)
    columns = [f"{mode} / {mode} greedy" for mode in modes] + (["compiled / eager"] if len(modes) > 1 else [])
    header += "".join(f"{column:>28}" for column in columns)
    print(header)
    for method in args.methods:
        names = {mode: f"{method} {mode}" for mode in modes}
        row = f"  {DISPLAY[method]:<14}" + "".join(
            f"{tokens[names[mode]] / statistics.median(times[names[mode]]):>20.1f}" for mode in modes)
        row += "".join(f"{paired(times, names[mode], f'ar {mode}', tokens):>28}" for mode in modes)
        if len(modes) > 1:
            row += f"{paired(times, names['compiled'], names['eager'], tokens):>28}"
        print(row)


def row_major(model: LoopedLM) -> LoopedLM:
    """A copy of ``model`` with every linear weight stored row-major (contiguous), as ``nn.Linear`` keeps it."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for module in out.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.contiguous()
    return out


def layout_side_by_side(args: Options) -> None:
    """Section 3: one pass of g tokens through all R loops, eager and compiled, weights column-major against
    row-major."""
    model = load("tiny", dtype=torch.float32)
    models = {"column-major": model, "row-major": row_major(model)}
    generator = torch.Generator().manual_seed(3)
    widest, R = max(args.layout_tokens), model.config.mean_recurrence
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt,), generator=generator)
    block = torch.randint(0, model.config.vocab_size, (1, widest), generator=generator)
    modes = ("eager",) if args.no_compile else ("eager", "compiled")
    arms = {}
    for mode, (name, m) in itertools.product(modes, models.items()):
        compiled = mode == "compiled"
        capacity = capacity_bucket(args.prompt + widest, m.config.block_size) if compiled else args.prompt + widest
        passes = (CompiledPasses if compiled else Passes)(m, new_cache(m, make_policy("full", R), 1, capacity), widest)
        passes.prefill([prompt])
        for g in args.layout_tokens:  # a verification written past the prompt, not committed: the same each call
            arms[f"{mode} {name} {g}"] = lambda passes=passes, g=g: passes.verify(block[:, :g], None)
    with torch.no_grad():
        for run in arms.values():  # warm-up (the compiled passes are traced here)
            run()
        times = interleaved(arms, args.rounds)
    print(f"\nthe weights' layout: one pass of g tokens through R = {R} loops after a {args.prompt}-token prompt, "
          f"shipped tiny model, float32, {args.rounds} interleaved rounds; ratio: row-major time / column-major time, "
          f"median of the paired rounds (range)")
    for mode, g in itertools.product(modes, args.layout_tokens):
        column, row = f"{mode} column-major {g}", f"{mode} row-major {g}"
        print(f"  {mode:<8} g = {g:<3} column-major {1e3 * statistics.median(times[column]):7.2f} ms   row-major "
              f"{1e3 * statistics.median(times[row]):7.2f} ms   {paired(times, column, row)}")


def run(options: Options) -> None:
    """The sections asked for, printed: greedy decoding against the reference, every method (unless none), and the
    weights' layout (unless no widths)."""
    torch.set_num_threads(options.threads)
    config = LoopedConfig.from_file(TINY_DIR / "config.json")
    if options.layers is not None:
        n_prelude, n_core, n_coda = options.layers
        config = dataclasses.replace(config, n_prelude=n_prelude, n_core=n_core, n_coda=n_coda)
    greedy_against_reference(options, config)
    if options.methods:
        methods_side_by_side(options)
    if options.layout_tokens:
        layout_side_by_side(options)
