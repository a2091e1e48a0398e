"""Train the tiny looped model that ships with looped_kv, on CPU, with Huginn's recipe.

Recipe (Geiping et al., 2025): prelude / core / coda of sandwich blocks, an adapter over
[state, embedding], a random initial state, a recurrence count per step drawn from a
Poisson-lognormal around a mean (32), and truncated backpropagation through the last loops (8).
Matrix products run in bfloat16 autocast, as Huginn's did (on CPUs with AMX this is several
times faster than float32); weights, norms and the optimizer stay in float32.

Data (``looped_kv.workloads.data``), mixed per batch: generated word problems, the Python standard
library, and variable chains, the workload on which depth pays. Chains follow a curriculum:
one lookup (chains of length 1) for the first ``--hold`` steps, then the longest binding chain
grows to ``data.CHAIN_DEPTH`` over ``--ramp`` steps, so that the model first learns one lookup,
then to repeat it.
Every ``--eval-every`` steps the log records answer accuracy on development chains at
several loop counts, so the training page can show when depth starts to pay.

    python -m looped_kv.tiny.train --out looped_kv/tiny            # the shipped recipe
    python -m looped_kv.tiny.train --out looped_kv/tiny --resume   # continue after an interruption

Training is resumable: every ``--checkpoint-every`` steps the model, optimizer, step and log are
written to ``OUT/checkpoint.pt``; ``--resume`` continues from it with the recorded arguments.
``config.json`` records the recipe, the wall time (summed over resumed segments) and held-out
figures; ``python -m looped_kv.tiny.gates`` then measures the gates on the evaluation split.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from looped_kv.analysis.depth import answer_accuracy, encode_chains, loss_by_loops
from looped_kv.runtime.attention import CausalRouter
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads import data

EOS = "<|endoftext|>"
#: Options a resumed run may change: the thread count, and the length of the run and of its curriculum.
RESUMABLE = ("threads", "steps", "ramp")
EVAL_LOOPS = (1, 2, 4, 8, 16, 32)


def corpus(split: str, problems: int) -> tuple[str, str]:
    """(word-problem text, standard-library text) of a split, documents separated by end-of-text."""
    text = "".join(p.text + EOS for p in data.word_problems(problems, split))
    code = "".join(p.read_text(encoding="utf-8", errors="replace") + EOS for p in data.code_files(split))
    return text, code


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
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


def sample_loops(mean: int, backprop: int, generator: torch.Generator) -> tuple[int, int]:
    """Huginn's Poisson-lognormal recurrence count: (loops without grad, loops with grad)."""
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


def loss_with_loops(model: LoopedLM, batch: torch.Tensor, no_grad_loops: int, grad_loops: int,
                    state: torch.Tensor, ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token loss after ``no_grad_loops + grad_loops`` loops, backpropagating through the last ones.

    ``ignore`` (B, n + 1) marks padding whose prediction is not scored.
    """
    x, y = batch[:, :-1], batch[:, 1:]
    if ignore is not None:
        y = y.masked_fill(ignore[:, 1:], -100)
    positions = torch.arange(x.shape[1])
    router = CausalRouter()
    embedded = model.embed(x, positions, router)
    with torch.no_grad():
        for r in range(1, no_grad_loops + 1):
            state = model.loop(state, embedded, positions, router, r)
    for r in range(no_grad_loops + 1, no_grad_loops + grad_loops + 1):
        state = model.loop(state, embedded, positions, router, r)
    logits = model.readout(state, positions, router)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-100)


def batches(streams: list[torch.Tensor], batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """Random windows of ``seq + 1`` tokens, taking the streams in turn."""
    rows = []
    for i in range(batch):
        stream = streams[i % len(streams)]
        start = int(torch.randint(0, len(stream) - seq - 1, (1,), generator=generator))
        rows.append(stream[start:start + seq + 1])
    return torch.stack(rows)


def chain_rows(tokenizer: PreTrainedTokenizerFast, rows: int, seq: int, step: int,
               max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of whole chain programs (each followed by end-of-text) packed into ``seq + 1`` tokens.

    The programs of a step are a function of the step alone (``data.chain_programs(seed=step)``), so a resumed
    run sees the data an uninterrupted one would. Returns (ids, padding mask).
    """
    eos = tokenizer.eos_token_id
    programs = iter(data.chain_programs(6 * rows, "train", seed=step, max_depth=max_depth))
    ids = torch.full((rows, seq + 1), eos)
    pad = torch.zeros(rows, seq + 1, dtype=torch.bool)
    for i in range(rows):
        row: list[int] = []
        for program in programs:
            item = tokenizer(program.text)["input_ids"] + [eos]
            if len(row) + len(item) > seq + 1:
                break
            row += item
        ids[i, :len(row)] = torch.tensor(row)
        pad[i, len(row):] = True
    return ids, pad


def curriculum_depth(step: int, hold: int, ramp: int) -> int:
    """Longest binding chain at a step: 1 for the first ``hold`` steps, then growing to ``data.CHAIN_DEPTH`` over
    ``ramp`` steps (one lookup first, then chains of them)."""
    if step < hold:
        return 1
    if ramp <= 0:
        return data.CHAIN_DEPTH
    return min(data.CHAIN_DEPTH, 1 + (step - hold) * data.CHAIN_DEPTH // ramp)


def mixed_batch(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast, streams: list[torch.Tensor],
                step: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch: ``args.mix`` fractions of word-problem, code and chain rows."""
    counts = [round(f * args.batch) for f in args.mix[:2]]
    n_chains = args.batch - sum(counts)
    parts = [batches([s], n, args.seq, generator) for s, n in zip(streams, counts, strict=True) if n]
    pads = [torch.zeros(p.shape, dtype=torch.bool) for p in parts]
    if n_chains:
        ids, pad = chain_rows(tokenizer, n_chains, args.seq, step, curriculum_depth(step, args.hold, args.ramp))
        parts.append(ids)
        pads.append(pad)
    return torch.cat(parts), torch.cat(pads)


@torch.no_grad()
def validation(model: LoopedLM, windows: dict[str, torch.Tensor], chains, loops: tuple[int, ...]) -> dict:
    """Held-out loss by loops per workload and chain answer accuracy by loops (deterministic states)."""
    model.eval()
    out = {f"{name}_loss_by_loops": {str(r): v for r, v in loss_by_loops(model, w, loops).items()}
           for name, w in windows.items()}
    chain_loss = loss_by_loops(model, chains.ids, loops, chains.real)
    out["chains_loss_by_loops"] = {str(r): v for r, v in chain_loss.items()}
    acc = answer_accuracy(model, chains, loops)
    out["chain_accuracy_by_loops"] = {str(r): row.to_dict() for r, row in acc.iterrows()}
    model.train()
    return out


def parser() -> argparse.ArgumentParser:
    """The command line; its defaults are the shipped model's recipe (``config.json``'s training record)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt with its arguments")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, nargs=3, default=[2, 2, 2], metavar=("PRELUDE", "CORE", "CODA"))
    ap.add_argument("--mean-recurrence", type=int, default=32, help="mean loops per training step")
    ap.add_argument("--backprop", type=int, default=8, help="loops with gradient (truncated backpropagation)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mix", type=float, nargs=3, default=[0.2, 0.2, 0.6], metavar=("PROBLEMS", "CODE", "CHAINS"),
                    help="fraction of each batch's rows from each workload")
    ap.add_argument("--hold", type=int, default=700, help="steps of one-lookup chains before the depth grows")
    ap.add_argument("--ramp", type=int, default=1300, help="steps over which the chain depth then grows to its max")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="autocast dtype of the products")
    ap.add_argument("--threads", default="auto", help="torch CPU threads, or 'auto' (default): all cores while "
                                                      "they are otherwise idle, one while other work runs; with "
                                                      "--resume, the recorded setting unless given")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    return ap


def check_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors before any work."""
    if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) >= 1):
        ap.error(f"--threads must be 'auto' or an integer >= 1, got {args.threads!r}")
    for name in ("steps", "batch", "seq", "vocab", "n_embd", "heads", "mean_recurrence", "backprop",
                 "eval_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.n_embd % args.heads:
        ap.error(f"--n-embd ({args.n_embd}) must be divisible by --heads ({args.heads})")
    if min(args.layers) < 0 or args.layers[1] < 1:
        ap.error(f"--layers needs PRELUDE >= 0, CORE >= 1, CODA >= 0, got {args.layers}")
    if not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    if min(args.mix) < 0 or abs(sum(args.mix) - 1) > 1e-6:
        ap.error(f"--mix must be three fractions >= 0 that sum to 1, got {args.mix}")
    if args.resume and not (args.out / "checkpoint.pt").exists():
        ap.error(f"--resume needs {args.out / 'checkpoint.pt'}, which does not exist")


def build(args: argparse.Namespace, vocab_size: int) -> LoopedLM:
    n_pre, n_core, n_coda = args.layers
    config = LoopedConfig(
        family="huginn", vocab_size=vocab_size, n_embd=args.n_embd, n_heads=args.heads, n_kv_heads=args.heads,
        n_prelude=n_pre, n_core=n_core, n_coda=n_coda, intermediate_size=2 * args.n_embd, block_size=1024,
        qk_bias=True, rope_base=50000.0, embed_scale=math.sqrt(args.n_embd),
        state_std=math.sqrt(2 / (5 * args.n_embd)), mean_recurrence=32, mean_backprop_depth=args.backprop)
    return LoopedLM(config)


def set_threads(setting: str) -> None:
    """``'auto'``: every core while the machine is otherwise idle, one while other work runs (a CPU's threads
    contending with other processes slow each step several times); else that many threads."""
    if setting != "auto":
        torch.set_num_threads(int(setting))
        return
    cores = os.cpu_count() or 1
    others = os.getloadavg()[0] - torch.get_num_threads()
    torch.set_num_threads(cores if others < 0.5 else 1)


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    check_arguments(ap, args)
    checkpoint = None
    if args.resume:  # the recorded recipe, except the options given again (recorded in the log as changes)
        words = argv if argv is not None else sys.argv
        given = {name: getattr(args, name) for name in RESUMABLE if f"--{name}" in words}
        checkpoint = torch.load(args.out / "checkpoint.pt", weights_only=False)
        changes = {k: (checkpoint["args"][k], v) for k, v in given.items() if checkpoint["args"][k] != v}
        args = argparse.Namespace(**{**checkpoint["args"], **given, "resume": True, "out": args.out})
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    problems_train, code_train = corpus("train", 30_000)
    if checkpoint is None:
        chain_text = "".join(p.text for p in data.chain_programs(2000, "train", seed=10**6))
        tokenizer = train_tokenizer([problems_train, code_train, chain_text], args.vocab)
        tokenizer.save_pretrained(str(args.out))
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.out))
    streams = [torch.tensor(tokenizer(t)["input_ids"]) for t in (problems_train, code_train)]
    dev_windows = {name: batches([torch.tensor(tokenizer(t)["input_ids"])], 8, 256, torch.Generator().manual_seed(1))
                   for name, t in zip(("problems", "code"), corpus("dev", 400), strict=True)}

    model = build(args, len(tokenizer))
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    dev_chains = encode_chains(tokenizer, data.chain_programs(96, "dev"))
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
        log, start_step, elapsed_before = checkpoint["log"], checkpoint["step"] + 1, checkpoint["elapsed_s"]
        if changes:
            log.append({"step": checkpoint["step"], "changed": {k: list(v) for k, v in changes.items()}})
    print(f"model: {params / 1e6:.2f}M parameters, {args.layers} layers, d={args.n_embd}; "
          f"steps {start_step}..{args.steps}", flush=True)

    warmup = max(args.steps // 20, 1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    model.train()
    bar = tqdm(range(start_step, args.steps + 1), desc="training", initial=start_step - 1, total=args.steps)
    for step in bar:
        lr = args.lr * min(step / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        if step % 10 == 0:
            set_threads(args.threads)
        batch, pad = mixed_batch(args, tokenizer, streams, step, generator)
        no_grad, with_grad = sample_loops(args.mean_recurrence, args.backprop, generator)
        state = random_state(config, (args.batch, args.seq), generator)
        with autocast:
            loss = loss_with_loops(model, batch, no_grad, with_grad, state, pad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = elapsed_before + time.perf_counter() - t0
        entry = {"step": step, "loss": loss.item(), "loops": no_grad + with_grad, "lr": lr, "time_s": elapsed,
                 "chain_depth": curriculum_depth(step, args.hold, args.ramp)}
        bar.set_postfix(loss=f"{entry['loss']:.3f}", loops=entry["loops"])
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            acc = answer_accuracy(model, dev_chains, EVAL_LOOPS)
            model.train()
            entry["chain_accuracy"] = {str(r): row.to_dict() for r, row in acc.iterrows()}
            tqdm.write(f"step {step}: chain accuracy by loops " + " ".join(
                f"R={r}: {row['accuracy']:.2f} (depth 1: {row['depth 1']:.2f})" for r, row in acc.iterrows()))
        if step % 10 == 0 or "chain_accuracy" in entry:
            log.append(entry)
        if step % args.checkpoint_every == 0 and step < args.steps:
            save_checkpoint(args.out / "checkpoint.pt", {
                "model": model.state_dict(), "optimizer": opt.state_dict(), "generator": generator.get_state(),
                "step": step, "log": log, "elapsed_s": elapsed,
                "args": {k: v for k, v in vars(args).items() if k not in ("out", "resume")}})
    bar.close()
    minutes = (elapsed_before + time.perf_counter() - t0) / 60
    record = validation(model, dev_windows, dev_chains, (1, 2, 4, 8, 16, 32, 64))
    print(json.dumps(record["chain_accuracy_by_loops"], indent=1), flush=True)

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, args.out / "model.safetensors")
    hf = config.to_hf_dict() | {"training": {
        "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "train_mean_recurrence": args.mean_recurrence, "backprop_loops": args.backprop, "lr": args.lr,
        "mix": dict(zip(data.WORKLOADS, args.mix, strict=True)), "curriculum_hold": args.hold,
        "curriculum_ramp": args.ramp,
        "precision": args.precision, "parameters": params, "minutes": round(minutes, 1), "threads": args.threads,
        **record}}
    (args.out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (args.out / "checkpoint.pt").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
