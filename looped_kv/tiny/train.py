"""Train the tiny looped model that ships with looped_kv, on CPU, with Huginn's recipe.

Recipe (Geiping et al., 2025): prelude / core / coda of sandwich blocks, an adapter over
[state, embedding], a random initial state, a recurrence count per step drawn from a
Poisson-lognormal around a mean, and truncated backpropagation through the last loops.

Data (``looped_kv.workloads.data``), mixed per batch by ``--mix``: generated word problems and the
Python standard library (next-token loss on every token), and value-changing variable chains,
the depth workload (loss on the query lines only: the bindings are random). The chains follow
a curriculum: queries start at most ``--start-depth`` steps deep, and the cap rises by
``--depth-step`` whenever development accuracy at ``--curriculum-loops`` loops on the deepest
queries allowed passes ``--advance-at``. With ``--chains`` above 1, distractor chains make
programs of every length from the start.
Every ``--eval-every`` steps the log records held-out answer accuracy by depth bucket at
R = 1, 4, 8, 16, 32, beside chance.

    looped-kv train --out runs/tiny            # the shipped recipe
    looped-kv train --out runs/tiny --resume   # continue after an interruption
    looped-kv train --out runs/tiny --resume --export looped_kv/tiny   # ship it

Training is resumable: every ``--checkpoint-every`` steps the model, optimizer, curriculum,
step and log are written to ``OUT/checkpoint.pt`` (and the log to ``OUT/training_log.json``);
``--resume`` continues from it with the recorded arguments. ``--minutes`` ends a sitting
after that much wall time, with a checkpoint. At the last step the model is written to OUT in
the public format; ``--export DIR`` writes it there as well. ``looped-kv gates``
then measures the gates on the evaluation split.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm

from looped_kv.analysis.depth import DEPTH_BUCKETS, answer_hits, encode_chains, loss_by_loops
from looped_kv.runtime.attention import CausalRouter
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads import data

if TYPE_CHECKING:  # transformers is imported where a tokenizer is made: the looped-kv command starts without it
    from transformers import PreTrainedTokenizerFast

#: The command that runs :func:`run` (:mod:`looped_kv.cli`'s ``train``), as a module; a finished run records it.
COMMAND = "looped-kv train"
EOS = "<|endoftext|>"
#: Options a resumed run may change: the thread count, the sitting's length, the run's length, the data mix with the
#: depth it starts from (a staged mix), the chain layout, the schedule's decay, the deep draws and the curriculum
#: (a ``--start-depth`` other than the recorded one restarts it there). Each change is logged with its step.
RESUMABLE = ("threads", "steps", "minutes", "mix", "mix_from_depth", "chain_layout", "value_first", "decay_from",
             "deep_share", "advance_at", "depth_step", "start_depth", "mean_recurrence", "min_recurrence",
             "recurrence_follows_depth", "lr")
#: What a checkpoint older than an option ran with: before --mix-from-depth the mix applied from the start; before
#: --chain-layout every program was one chain; before --decay-from the cosine ran from step 0; before --deep-share
#: no step was drawn at DEEP_LOOPS.
BEFORE_OPTION = {"mix_from_depth": 1, "chain_layout": "single", "value_first": False, "decay_from": 0,
                 "deep_share": 0.0}
#: The chain programs' layouts (``--chain-layout``): one chain per program (``data.chain_programs``); several
#: contiguous chains with a dense query line (``data.multichain_programs``); or those alternating with lookup drills
#: (``data.lookup_programs``: names bound to digits, asked in a random order); or the drills alone, binding at most
#: :data:`LOOKUP_NAMES_PER_DEPTH` names per step of the curriculum's cap (a curriculum on the lookup's size); or
#: drills alternating with multichain programs that ask every variable (each binding's value an answer). Every layout
#: but ``single`` may write each binding after its expression (``--value-first``: ``3=a;a+4=b;``), so that a name's
#: position is where its value can be known; or multichain programs whose query line holds each chain's answer alone,
#: in the chains' order (``multi-positional``: ``7;3;``, no names); or those asked from the last chain to the first,
#: with at most as many chains as the curriculum's cap (``multi-count``: a curriculum on the number of chains, whose
#: first answer is a one-chain program's); or the same curriculum with each chain asked by its name as a one-chain
#: program is (``multi-count-named``: ``x?3;y?7;``); or those alternating with lookup drills of 2 to 4 names per chain
#: of the cap (``multi-count-named-drills``), whose development check and held-out figures read the chains alone.
CHAIN_LAYOUTS = ("single", "multi", "multi-lookup", "lookup", "multi-all", "multi-positional", "multi-count",
                 "multi-count-named", "multi-count-named-drills")
#: The layouts whose curriculum cap counts something other than a query's depth (names, chains): their development
#: check reads every query.
CAP_NOT_DEPTH = ("lookup", "multi-count", "multi-count-named", "multi-count-named-drills")
#: The layouts whose development check and held-out figures read another layout's programs: the chains without the
#: drills that alternate with them.
MEASURED_AS = {"multi-count-named-drills": "multi-count-named"}
LOOKUP_NAMES_PER_DEPTH = 4
#: The loop count of the steps ``--deep-share`` draws: twice the inference R, so more loops than R are trained.
DEEP_LOOPS = 64
EVAL_LOOPS = (1, 4, 8, 16, 32)
#: The shipped model's default loop count R at inference (Huginn-0125's), whatever the training mean.
INFERENCE_LOOPS = 32


@dataclass(frozen=True)
class Options:
    """A run's settings, one per option of ``looped-kv train`` (``looped_kv.cli.train_options`` makes them from a
    command line, checked, with the shipped recipe as defaults). A checkpoint records them but ``out``, ``resume``
    and ``export``; ``settings.json`` and the finished model's training record all but ``resume``."""

    out: Path
    resume: bool
    export: Path | None
    seed: int
    steps: int
    minutes: float
    batch: int
    seq: int
    vocab: int
    n_embd: int
    heads: int
    layers: list[int]  # prelude, core, coda
    mean_recurrence: int
    min_recurrence: int
    recurrence_follows_depth: bool
    backprop: int
    lr: float
    warmup: int
    mix: list[float]  # problems, code, chains
    mix_from_depth: int
    start_depth: int
    depth_step: int
    advance_at: float
    curriculum_loops: int
    curriculum_every: int
    chains: int
    interleave: bool
    chain_layout: str  # one of CHAIN_LAYOUTS
    value_first: bool  # bindings written 3=a;a+4=b; (every layout but single)
    decay_from: int
    deep_share: float
    precision: str  # bf16 or fp32
    eager: bool
    threads: int
    eval_every: int
    eval_programs: int
    checkpoint_every: int


def corpus(split: str, problems: int) -> tuple[str, str]:
    """(word-problem text, standard-library text) of a split, documents separated by end-of-text."""
    text = "".join(p.text + EOS for p in data.word_problems(problems, split))
    code = "".join(p.read_text(encoding="utf-8", errors="replace") + EOS for p in data.code_files(split))
    return text, code


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE; at ``vocab_size`` 257 it has no merges: one token per byte (characters, for ASCII)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def init_weights(model: LoopedLM, config: LoopedConfig) -> None:
    """Small normal init (std sqrt(2 / 5d)), output projections scaled down by the effective depth."""
    std = math.sqrt(2 / (5 * config.n_embd))
    depth = config.n_prelude + config.n_coda + config.n_core * config.mean_backprop_depth
    for name, p in model.named_parameters():
        if p.dim() == 2:
            scale = 1 / math.sqrt(2 * depth) if name.endswith("proj.weight") else 1.0
            torch.nn.init.normal_(p, std=std * scale)
        elif "qk_bias" in name:
            torch.nn.init.zeros_(p)


def sample_loops(mean: int, backprop: int, generator: torch.Generator, deep_share: float = 0.0) -> tuple[int, int]:
    """Huginn's Poisson-lognormal recurrence count: (loops without grad, loops with grad); with probability
    ``deep_share`` the step runs :data:`DEEP_LOOPS` instead (no draw is made when it is 0, so runs without it
    keep their random stream)."""
    if deep_share > 0 and float(torch.rand(1, generator=generator)) < deep_share:
        return DEEP_LOOPS - backprop, backprop
    t = max(mean - backprop, 0)
    sigma = 0.5
    mu = math.log(t + backprop) - sigma**2 / 2
    rate = torch.empty(1).log_normal_(mu, sigma, generator=generator)
    p = int(torch.poisson(rate, generator=generator).item()) + 1
    return max(p - backprop, 0), min(backprop, p)


def random_state(config: LoopedConfig, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    x = torch.empty(*shape, config.n_embd)
    std = config.state_std
    torch.nn.init.trunc_normal_(x, std=std, a=-3 * std, b=3 * std, generator=generator)
    return x * config.embed_scale


class Loops:
    """The core's loops for one batch shape, compiled once (``torch.compile``: the matrix products run in bfloat16
    under autocast; eager, the elementwise work between them costs more than the products)."""

    def __init__(self, model: LoopedLM, rows: int, length: int, compile: bool) -> None:
        self.model, self.rows, self.positions = model, rows, torch.arange(length)
        self.step = torch.compile(self._loop, dynamic=False) if compile else self._loop

    def _loop(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """One loop (the plain causal model ignores which loop it is, so one graph serves every r)."""
        return self.model.loop(state, embedded, self.positions, CausalRouter(), 1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids, self.positions, CausalRouter())

    def readout(self, state: torch.Tensor) -> torch.Tensor:
        return self.model.readout(state, self.positions, CausalRouter()).float()


def token_losses(loops: Loops, batch: torch.Tensor, no_grad_loops: int, grad_loops: int,
                 state: torch.Tensor) -> torch.Tensor:
    """Next-token loss (B, n) of every position after ``no_grad_loops + grad_loops`` loops, backpropagating
    through the last ``grad_loops`` only (truncated backpropagation)."""
    x, y = batch[:, :-1], batch[:, 1:]
    embedded = loops.embed(x)
    with torch.no_grad():
        for _ in range(no_grad_loops):
            state = loops.step(state, embedded)
    for _ in range(grad_loops):
        state = loops.step(state, embedded)
    return F.cross_entropy(loops.readout(state).transpose(1, 2), y, reduction="none")


@torch.no_grad()
def quick_hits(loops: Loops, chains, counts: tuple[int, ...], autocast) -> dict[int, torch.Tensor]:
    """Teacher-forced answer hits (queries,) after each R in ``counts``, in one pass of max(counts) loops read out
    at every R, in the training batch's shape and precision (for the curriculum and the training log; the model's
    recorded figures come from :func:`looped_kv.analysis.depth.answer_hits` in float32)."""
    rows, width = loops.rows, loops.positions.shape[0]
    if chains.ids.shape[1] > width:
        raise ValueError(f"chain programs of {chains.ids.shape[1]} tokens do not fit --seq {width}")
    ids = torch.zeros((-(-chains.ids.shape[0] // rows) * rows, width), dtype=torch.long)
    ids[:chains.ids.shape[0], :chains.ids.shape[1]] = chains.ids
    hits = {R: [] for R in counts}
    for start in range(0, ids.shape[0], rows):
        x = ids[start:start + rows]
        mine = (chains.rows >= start) & (chains.rows < start + rows)
        r_idx, p_idx = chains.rows[mine] - start, chains.positions[mine]
        with autocast:
            embedded = loops.embed(x)
            state = loops.model.initial_state(loops.positions, rows)
            for r in range(1, max(counts) + 1):
                state = loops.step(state, embedded)
                if r in hits:
                    logits = loops.readout(state)[r_idx, p_idx]
                    hits[r].append(logits.argmax(-1) == chains.answers[mine])
    return {R: torch.cat(h).float() for R, h in hits.items()}


def text_rows(streams: list[torch.Tensor], rows: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """Random windows of ``seq + 1`` tokens, taking the streams in turn."""
    out = []
    for i in range(rows):
        stream = streams[i % len(streams)]
        start = int(torch.randint(0, len(stream) - seq - 1, (1,), generator=generator))
        out.append(stream[start:start + seq + 1])
    return torch.stack(out)


def renamed(program: data.ChainProgram, names: dict[str, str]) -> data.ChainProgram:
    """The same program with its variables renamed (``names``: old to new)."""
    table = str.maketrans(names)
    queries = tuple(data.ChainQuery(q.variable.translate(table), q.value, q.depth) for q in program.queries)
    return data.ChainProgram(program.program.translate(table), queries, program.dense, program.positional)


def chain_rows(tokenizer: PreTrainedTokenizerFast, rows: int, seq: int, step: int, max_depth: int,
               shape: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of whole chain programs (each followed by end-of-text) packed into ``seq + 1`` tokens.

    No variable name appears in two programs of a row (each program is renamed from the row's unused names), so
    a lookup never has to tell a binding from one of an earlier program. Returns (ids, scored, answer):
    ``scored[:, i]`` marks the query-line tokens (names, answers, separators, the end-of-text), ``answer[:, i]``
    the answer digits, both as targets of position i - 1. A program that no longer fits a row starts the next one
    (one that fits no row is skipped), so the programs a layout alternates alternate in the rows too. The programs
    of a step are a function of the step and the curriculum alone, so a resumed run sees the data an uninterrupted
    one would.
    """
    eos = tokenizer.eos_token_id
    programs = programs_of(shape, 8 * rows, "train", seed=step, max_depth=max_depth)
    ids = torch.full((rows, seq + 1), eos)
    scored = torch.zeros(rows, seq + 1, dtype=torch.bool)
    answer = torch.zeros(rows, seq + 1, dtype=torch.bool)
    at = 0  # the next program to place
    for i in range(rows):
        row: list[int] = []
        free = list(data.CHAIN_NAMES)
        random.Random(f"names/{step}/{i}").shuffle(free)
        while at < len(programs):
            names = list(dict.fromkeys(c for c in programs[at].program if c in data.CHAIN_NAMES))
            if len(names) > len(free):
                break
            program = renamed(programs[at], {old: free.pop() for old in names})
            item = encode_chains(tokenizer, [program])
            length = int(item.real.sum()) + 1
            if len(row) + length > seq + 1:
                at += not row  # longer than a whole row: skipped
                break
            at += 1
            start = len(row)
            row += [*item.ids[0, :length - 1].tolist(), eos]
            prompt = len(tokenizer(program.prompt)["input_ids"])
            scored[i, start + prompt:start + length] = True
            answer[i, start + item.positions + 1] = True
        ids[i, :len(row)] = torch.tensor(row)
    return ids, scored, answer


class Curriculum:
    """The deepest query a training step may ask, raised as development accuracy allows."""

    def __init__(self, args: Options, tokenizer: PreTrainedTokenizerFast) -> None:
        self.args, self.tokenizer = args, tokenizer
        self.depth = args.start_depth
        self.raised: list[tuple[int, int]] = []  # (step, new cap)

    def check(self, loops: Loops, step: int, autocast) -> float:
        """Accuracy at ``--curriculum-loops`` on development queries in the top half of the cap (programs drawn
        at the cap; every query where the cap is not a depth, :data:`CAP_NOT_DEPTH`); raise the cap if it reaches
        ``--advance-at``."""
        programs = programs_of(measured(shape(self.args)), 128, "dev", seed=self.depth, max_depth=self.depth)
        dev = encode_chains(self.tokenizer, programs)
        if self.args.chain_layout in CAP_NOT_DEPTH:
            keep = torch.ones_like(dev.depths, dtype=torch.bool)
        else:  # the multi-lookup layout's drills: every query is depth 1
            keep = dev.depths > min(self.depth // 2, int(dev.depths.max()) - 1)
        hits = quick_hits(loops, dev, (self.args.curriculum_loops,), autocast)[self.args.curriculum_loops]
        accuracy = float(hits[keep].mean())
        if accuracy >= self.args.advance_at and self.depth < data.CHAIN_DEPTH:
            self.depth = min(data.CHAIN_DEPTH, self.depth + self.args.depth_step)
            self.raised.append((step, self.depth))
        return accuracy

    def state(self) -> dict:
        return {"depth": self.depth, "raised": self.raised}

    def load(self, state: dict) -> None:
        self.depth, self.raised = state["depth"], [tuple(x) for x in state["raised"]]


def shape(args: Options) -> dict:
    """The chain programs' shape options: the layout, and ``data.chain_programs``'s for the single layout."""
    if args.value_first and args.chain_layout == "single":
        raise ValueError("value_first needs a chain_layout other than 'single' (one of "
                         f"{CHAIN_LAYOUTS[1:]}), got 'single'")
    if args.chain_layout != "single":
        return {"layout": args.chain_layout, "value_first": args.value_first}
    return {"layout": "single", "max_chains": args.chains, "interleave": args.interleave}


def measured(shape: dict) -> dict:
    """The shape whose programs a run's development check and held-out figures read (:data:`MEASURED_AS`)."""
    return {**shape, "layout": MEASURED_AS.get(shape["layout"], shape["layout"])}


def lookup_sizes(max_depth: int) -> tuple[int, int]:
    """The least and most names of the ``lookup`` layout's drills at curriculum cap ``max_depth``."""
    return 2, min(data.MULTICHAIN_BINDINGS, LOOKUP_NAMES_PER_DEPTH * max_depth)  # max_depth >= 1: at least 4


def alternating(drills: list, chains: list) -> list:
    """Two lists of programs of one length in turn: the even places from ``drills``, the odd from ``chains``."""
    return [(drills if i % 2 == 0 else chains)[i] for i in range(len(drills))]


def programs_of(shape: dict, n: int, split: str, seed: int = 0, max_depth: int = data.CHAIN_DEPTH) -> list:
    """``n`` chain programs of a split in the layout ``shape`` names (:func:`shape`)."""
    options = {key: value for key, value in shape.items() if key != "layout"}
    if shape["layout"] in ("multi", "multi-positional"):
        return data.multichain_programs(n, split, seed=seed, max_depth=max_depth,
                                        positional=shape["layout"] == "multi-positional", **options)
    if shape["layout"] in ("multi-lookup", "multi-all"):  # drills and multichain programs in turn
        drills = data.lookup_programs(n, split, seed, **options)
        chains = data.multichain_programs(n, split, seed, max_depth, ask_all=shape["layout"] == "multi-all", **options)
        return alternating(drills, chains)
    if shape["layout"] in ("multi-count", "multi-count-named"):  # at most the cap's chains, the last asked first
        named = shape["layout"] == "multi-count-named"
        programs = data.multichain_programs(n, split, seed=seed, positional=not named, max_chains=max_depth,
                                            last_first=True, **options)
        return [replace(p, dense=False) for p in programs] if named else programs
    if shape["layout"] == "multi-count-named-drills":  # drills of the cap's size and the named chains in turn
        drills = data.lookup_programs(n, split, seed, sizes=lookup_sizes(max_depth), **options)
        chains = programs_of({**shape, "layout": "multi-count-named"}, n, split, seed, max_depth)
        return alternating(drills, chains)
    if shape["layout"] == "lookup":  # drills alone, their size following the curriculum's cap
        return data.lookup_programs(n, split, seed, sizes=lookup_sizes(max_depth), **options)
    return data.chain_programs(n, split, seed=seed, max_depth=max_depth, **options)


def learning_rate(args: Options, step: int) -> float:
    """Linear warm-up, then a cosine from ``--lr`` down to a tenth of it between ``--decay-from`` and ``--steps``:
    a resumed run that sets ``--decay-from`` to its first step decays over its own length."""
    span = max(args.steps - args.decay_from, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(max(step - args.decay_from, 0) / span, 1.0)))
    return args.lr * min(step / args.warmup, 0.1 + 0.9 * cosine)


def batch_mix(args: Options, depth: int) -> tuple[dict[str, float], dict[str, int]]:
    """The step's workload fractions (of rows, and weights in the loss) and row counts: chains alone until the
    curriculum reaches ``--mix-from-depth``, then ``--mix``."""
    fractions = args.mix if depth >= args.mix_from_depth else [0.0, 0.0, 1.0]
    mix = dict(zip(data.WORKLOADS, fractions, strict=True))
    counts = {w: round(f * args.batch) for w, f in mix.items() if w != "chains"}
    counts["chains"] = args.batch - sum(counts.values())
    return mix, counts


def mean_recurrence(args: Options, depth: int) -> int:
    """The step's mean recurrence: fixed, or (``--recurrence-follows-depth``) the curriculum's depth plus a margin,
    kept within [``--min-recurrence``, ``--mean-recurrence``]."""
    if not args.recurrence_follows_depth:
        return args.mean_recurrence
    return max(args.min_recurrence, min(args.mean_recurrence, depth + args.backprop))


def by_bucket(hits: dict[int, torch.Tensor], chains) -> dict:
    """Accuracy overall, by depth bucket and on the ``later queries`` (those after their program's first: on a query
    line asked from the last chain, the ones that need a lookup by name of an earlier chain) for each R, with chance
    and each group's query count."""
    depths = chains.depths
    groups = {b: (depths >= lo) & (depths <= hi) for b, (lo, hi) in DEPTH_BUCKETS.items()}
    groups["later queries"] = later_queries(chains.rows)
    out: dict = {"chance": data.CHAIN_CHANCE, "queries": {b: int(m.sum()) for b, m in groups.items()}}
    for R, h in hits.items():
        out[str(R)] = {"accuracy": float(h.mean()), **{b: float(h[m].mean()) for b, m in groups.items() if m.any()}}
    return out


@torch.no_grad()
def held_out(model: LoopedLM, chains, loops: tuple[int, ...]) -> dict:
    """The recorded figures: float32 answer accuracy by depth bucket and R (``answer_hits``, :func:`by_bucket`), and
    answer loss."""
    hits = answer_hits(model, chains, loops)
    out = by_bucket({R: torch.tensor(rows["hit"].to_numpy()) for R, rows in hits.groupby("loops")}, chains)
    for R, rows in hits.groupby("loops"):
        out[str(R)]["answer_loss"] = float(rows["nll"].mean())
    return out


def later_queries(rows: torch.Tensor) -> torch.Tensor:
    """Which queries (in program order, ``rows`` each one's program) come after their program's first."""
    return torch.cat([torch.zeros(min(len(rows), 1), dtype=torch.bool), rows[1:] == rows[:-1]])


def format_accuracy(record: dict) -> str:
    loops = [key for key in record if key.isdigit()]
    return " | ".join(f"R={R}: " + " ".join(f"{b}:{record[R].get(b, float('nan')):.2f}" for b in DEPTH_BUCKETS)
                      for R in loops) + f" (chance {record['chance']})"


def build(args: Options, vocab_size: int) -> LoopedLM:
    n_pre, n_core, n_coda = args.layers
    config = LoopedConfig(
        family="huginn", vocab_size=vocab_size, n_embd=args.n_embd, n_heads=args.heads, n_kv_heads=args.heads,
        n_prelude=n_pre, n_core=n_core, n_coda=n_coda, intermediate_size=2 * args.n_embd, block_size=1024,
        qk_bias=True, rope_base=50000.0, embed_scale=math.sqrt(args.n_embd),
        state_std=math.sqrt(2 / (5 * args.n_embd)), mean_recurrence=INFERENCE_LOOPS,
        mean_backprop_depth=args.backprop)
    return LoopedLM(config)


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def recorded_settings(args: Options) -> dict:
    """A run's settings as ``settings.json`` and a written model's training record keep them (all but ``resume``)."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
            if key != "resume"}


def development_sets(args: Options, tokenizer: PreTrainedTokenizerFast) -> tuple[dict[str, torch.Tensor], object]:
    """The development split's text windows (problems and code) and chain programs, which every evaluation reads."""
    windows = {name: text_rows([torch.tensor(tokenizer(t)["input_ids"])], 8, 256, torch.Generator().manual_seed(1))
               for name, t in zip(("problems", "code"), corpus("dev", 400), strict=True)}
    return windows, encode_chains(tokenizer, programs_of(measured(shape(args)), args.eval_programs, "dev"))


def final_record(model: LoopedLM, windows: dict[str, torch.Tensor], chains) -> dict:
    """What a written model's training record keeps of the development split: loss by loops on the text windows and
    answer accuracy by depth bucket, at R = 1 .. 64."""
    final_loops = (1, 2, 4, 8, 16, 32, 64)
    record = {f"{name}_loss_by_loops": {str(r): v for r, v in loss_by_loops(model, w, final_loops).items()}
              for name, w in windows.items()}
    record["chains_held_out"] = held_out(model, chains, final_loops)
    print(format_accuracy(record["chains_held_out"]), flush=True)
    return record


def best_evaluated(out: Path) -> int:
    """The held-out evaluation whose weights the run in ``out`` kept with the highest development answer accuracy
    at R = 32 (a tie: the later step). Selection reads the development split only."""
    log = json.loads((out / "training_log.json").read_text())
    scored = [(entry["held_out"]["32"]["accuracy"], entry["step"]) for entry in log
              if "held_out" in entry and evaluated_weights(out, entry["step"]).exists()]
    if not scored:
        raise ValueError(f"{out} kept no weights at a held-out evaluation ({out / 'evaluated'} is empty or missing)")
    return max(scored)[1]


def export_evaluated(out: Path, step: int, export: Path, command: str, selected_by: str) -> None:
    """Write the model the run in ``out`` kept at held-out evaluation ``step`` to ``export`` in the public format,
    with the run's training record up to that step, the development figures the run's end computes, and the
    selection (``selected_step``, ``selected_by``). The run's own files are only read."""
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    kept = evaluated_weights(out, step)
    if not kept.exists():
        raise ValueError(f"--step {step}: the run kept no weights there ({kept} does not exist)")
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    args = Options(**{**BEFORE_OPTION, **checkpoint["args"], "out": out, "resume": True, "export": export})
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    model = build(args, len(tokenizer))
    missing, unexpected = model.load_state_dict(load_file(kept), strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"{kept} does not fit the run's model: missing {missing}, unexpected {unexpected}")
    model.eval()
    log = [entry for entry in checkpoint["log"] if entry["step"] <= step]
    at = next(entry for entry in reversed(log) if "time_s" in entry)
    raised = [list(r) for r in checkpoint["curriculum"]["raised"] if r[0] <= step]
    curriculum = {"depth": raised[-1][1] if raised else args.start_depth, "raised": raised}
    training = {"command": command, "args": recorded_settings(args),
                "parameters": sum(p.numel() for p in model.parameters()), "minutes": round(at["time_s"] / 60, 1),
                "curriculum": curriculum, "selected_step": step, "selected_by": selected_by,
                **final_record(model, *development_sets(args, tokenizer))}
    write_model(export, model, tokenizer, training, log)


def public_state(model: LoopedLM) -> dict[str, torch.Tensor]:
    """The weights as the public format stores them (the head is tied to the embedding)."""
    return {key: value.detach().contiguous() for key, value in model.state_dict().items() if key != "lm_head.weight"}


def evaluated_weights(out: Path, step: int) -> Path:
    """Where a run keeps the weights it had at a held-out evaluation, so that a step can be chosen on the
    development split after the run (:func:`run`)."""
    return out / "evaluated" / f"step-{step:06d}.safetensors"


def write_model(folder: Path, model: LoopedLM, tokenizer: PreTrainedTokenizerFast, training: dict,
                log: list[dict]) -> None:
    """The public format: model.safetensors, config.json (with the training record) and the tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(public_state(model), folder / "model.safetensors")
    tokenizer.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict() | {"training": training}, indent=2) + "\n")
    (folder / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def run(args: Options, given: Collection[str] = (), command: str = COMMAND) -> None:
    """Train (or with ``args.resume``, continue) a run. ``given``: the RESUMABLE options given on the command line,
    which a resumed run takes from ``args`` (the others from its checkpoint); ``command``: the command line, which
    the finished model's training record keeps."""
    from transformers import PreTrainedTokenizerFast

    checkpoint = None
    if args.resume:  # the recorded recipe, except the options given again (recorded in the log as changes)
        again = {name: getattr(args, name) for name in RESUMABLE if name in given}
        checkpoint = torch.load(args.out / "checkpoint.pt", weights_only=False)
        recorded = {**BEFORE_OPTION, **checkpoint["args"]}
        changes = {key: (recorded[key], value) for key, value in again.items() if recorded[key] != value}
        args = Options(**{**recorded, **again, "resume": True, "out": args.out, "export": args.export})
    shape(args)  # a layout and --value-first that do not go together: refused before any work
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    settings = recorded_settings(args)
    (args.out / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    problems_train, code_train = corpus("train", 30_000)
    if checkpoint is None:
        chain_text = "".join(p.text for p in data.chain_programs(2000, "train", seed=10**6))
        tokenizer = train_tokenizer([problems_train, code_train, chain_text], args.vocab)
        tokenizer.save_pretrained(str(args.out))
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.out))
    streams = [torch.tensor(tokenizer(t)["input_ids"]) for t in (problems_train, code_train)]
    dev_windows, dev_chains = development_sets(args, tokenizer)

    model = build(args, len(tokenizer))
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    curriculum = Curriculum(args, tokenizer)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(args.seed)
    log: list[dict] = []
    start_step, elapsed_before = 1, 0.0
    if checkpoint is None:
        init_weights(model, config)
    else:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        generator.set_state(checkpoint["generator"])
        curriculum.load(checkpoint["curriculum"])
        if "start_depth" in changes:  # changed: the curriculum starts over from it (a new layout's first stage)
            curriculum.depth = args.start_depth
            curriculum.raised.append((checkpoint["step"], args.start_depth))
        log, start_step, elapsed_before = checkpoint["log"], checkpoint["step"] + 1, checkpoint["elapsed_s"]
        if changes:
            log.append({"step": checkpoint["step"], "changed": {key: list(value) for key, value in changes.items()}})
    print(f"model: {params / 1e6:.2f}M parameters, {args.layers} layers, d={args.n_embd}, vocab {len(tokenizer)}; "
          f"steps {start_step}..{args.steps}", flush=True)

    def save(step: int, elapsed: float) -> None:
        save_checkpoint(args.out / "checkpoint.pt", {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "generator": generator.get_state(),
            "curriculum": curriculum.state(), "step": step, "log": log, "elapsed_s": elapsed,
            "args": {key: value for key, value in vars(args).items() if key not in ("out", "resume", "export")}})
        (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    loops = Loops(model, args.batch, args.seq, compile=not args.eager)
    model.train()
    bar = tqdm(range(start_step, args.steps + 1), desc="training", initial=start_step - 1, total=args.steps,
               mininterval=1 if sys.stderr.isatty() else 60)
    step, sitting = start_step - 1, time.perf_counter()
    for step in bar:
        lr = learning_rate(args, step)
        for group in opt.param_groups:
            group["lr"] = lr
        mix, counts = batch_mix(args, curriculum.depth)
        parts, weights = [], []
        for w, stream in zip(("problems", "code"), streams, strict=True):
            if counts[w]:
                rows = text_rows([stream], counts[w], args.seq, generator)
                parts.append(rows)
                weights.append(torch.full(rows[:, 1:].shape, mix[w] / rows[:, 1:].numel()))
        answers = None
        if counts["chains"]:
            rows, scored, answers = chain_rows(tokenizer, counts["chains"], args.seq, step, curriculum.depth,
                                               shape(args))
            parts.append(rows)
            weights.append(scored[:, 1:] * (mix["chains"] / max(int(scored[:, 1:].sum()), 1)))
        batch, weight = torch.cat(parts), torch.cat(weights)
        mean = mean_recurrence(args, curriculum.depth)
        no_grad, with_grad = sample_loops(mean, args.backprop, generator, args.deep_share)
        state = random_state(config, (args.batch, args.seq), generator)
        with autocast:
            losses = token_losses(loops, batch, no_grad, with_grad, state)
        loss = (losses * weight).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = elapsed_before + time.perf_counter() - t0
        entry = {"step": step, "loss": loss.item(), "loops": no_grad + with_grad, "mean_recurrence": mean, "lr": lr,
                 "time_s": round(elapsed, 1), "chain_depth": curriculum.depth}
        if answers is not None:
            entry["answer_loss"] = float(losses.detach()[-counts["chains"]:][answers[:, 1:]].mean())
        if step % args.curriculum_every == 0:
            model.eval()
            entry["curriculum_accuracy"] = curriculum.check(loops, step, autocast)
            model.train()
        bar.set_postfix(loss=f"{entry['loss']:.3f}", depth=curriculum.depth, loops=entry["loops"], refresh=False)
        last = step == args.steps
        out_of_time = args.minutes and time.perf_counter() - sitting > 60 * args.minutes
        if step % args.eval_every == 0 or last or out_of_time:
            model.eval()
            entry["held_out"] = by_bucket(quick_hits(loops, dev_chains, EVAL_LOOPS, autocast), dev_chains)
            model.train()
            tqdm.write(f"step {step} (depth cap {curriculum.depth}): {format_accuracy(entry['held_out'])}")
            kept = evaluated_weights(args.out, step)
            kept.parent.mkdir(exist_ok=True)
            save_file(public_state(model), kept)
        if step % 10 == 0 or "held_out" in entry or "curriculum_accuracy" in entry:
            log.append(entry)
        if last:
            break
        if step % args.checkpoint_every == 0 or out_of_time:
            save(step, elapsed)
        if out_of_time:
            print(f"sitting over after {args.minutes} minutes at step {step}; continue with --resume", flush=True)
            return
    bar.close()
    model.eval()
    record = final_record(model, dev_windows, dev_chains)
    training = {
        "command": command,
        "args": settings,
        "parameters": params, "minutes": round((elapsed_before + time.perf_counter() - t0) / 60, 1),
        "curriculum": curriculum.state(), **record}
    save(step, elapsed_before + time.perf_counter() - t0)
    write_model(args.out, model, tokenizer, training, log)
    if args.export is not None:
        write_model(args.export, model, tokenizer, training, log)
