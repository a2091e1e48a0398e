"""Train the tiny looped model that ships with looped_kv, on CPU, with Huginn's recipe.

Recipe (Geiping et al., 2025): prelude / core / coda of sandwich blocks, an adapter over
[state, embedding], a random initial state, a recurrence count per step drawn from a
Poisson-lognormal around a mean, and truncated backpropagation through the last loops.
Data: generated word problems and the Python standard library (``looped_kv.data``).
A BPE tokenizer is trained first and saved in the format ``transformers`` loads.

    python -m looped_kv.tiny.train --out looped_kv/tiny

The defaults are the shipped model's recipe (``config.json`` records it with the measured wall time
and ``training_log.json`` the time per step: 2000 steps at about 1 s each on 2 idle cores). The code
corpus is the standard library of the interpreter that runs this script, so a different Python
version trains on somewhat different text.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from looped_kv import data
from looped_kv.attention import CausalRouter
from looped_kv.config import LoopedConfig
from looped_kv.model import LoopedLM

EOS = "<|endoftext|>"


def corpus(split: str, problems: int) -> tuple[str, str]:
    """(word-problem text, standard-library text) of a split."""
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
                    state: torch.Tensor) -> torch.Tensor:
    """Next-token loss after ``no_grad_loops + grad_loops`` loops, backpropagating through the last ones."""
    x, y = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(x.shape[1])
    router = CausalRouter()
    embedded = model.embed(x, positions, router)
    with torch.no_grad():
        for r in range(1, no_grad_loops + 1):
            state = model.loop(state, embedded, positions, router, r)
    for r in range(no_grad_loops + 1, no_grad_loops + grad_loops + 1):
        state = model.loop(state, embedded, positions, router, r)
    logits = model.readout(state, positions, router)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batches(streams: list[torch.Tensor], batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """Random windows, half from each stream."""
    rows = []
    for i in range(batch):
        stream = streams[i % len(streams)]
        start = int(torch.randint(0, len(stream) - seq - 1, (1,), generator=generator))
        rows.append(stream[start:start + seq + 1])
    return torch.stack(rows)


@torch.no_grad()
def validation_loss(model: LoopedLM, windows: torch.Tensor, loops: list[int]) -> dict[int, float]:
    """Mean next-token loss of fixed held-out windows at each number of loops (deterministic states)."""
    out = {}
    for R in loops:
        logits = model(windows[:, :-1], num_loops=R)
        out[R] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()
    return out


def parser() -> argparse.ArgumentParser:
    """The command line; its defaults are the shipped model's recipe (``config.json``'s training record)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, nargs=3, default=[1, 2, 1], metavar=("PRELUDE", "CORE", "CODA"))
    ap.add_argument("--mean-recurrence", type=int, default=8, help="mean loops per training step")
    ap.add_argument("--backprop", type=int, default=4, help="loops with gradient (truncated backpropagation)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()

    problems_train, code_train = corpus("train", 30_000)
    tokenizer = train_tokenizer([problems_train, code_train], args.vocab)
    streams = [torch.tensor(tokenizer(t)["input_ids"]) for t in (problems_train, code_train)]
    problems_dev, code_dev = corpus("dev", 400)
    dev = [torch.tensor(tokenizer(t)["input_ids"]) for t in (problems_dev, code_dev)]
    dev_windows = batches(dev, 16, 256, torch.Generator().manual_seed(1))
    print(f"tokenizer: {len(tokenizer)} tokens; train tokens {[len(s) for s in streams]} "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    n_pre, n_core, n_coda = args.layers
    config = LoopedConfig(
        family="huginn", vocab_size=len(tokenizer), n_embd=args.n_embd, n_heads=args.heads, n_kv_heads=args.heads,
        n_prelude=n_pre, n_core=n_core, n_coda=n_coda, intermediate_size=2 * args.n_embd, block_size=1024,
        qk_bias=True, rope_base=50000.0, embed_scale=math.sqrt(args.n_embd),
        state_std=math.sqrt(2 / (5 * args.n_embd)), mean_recurrence=32, mean_backprop_depth=args.backprop)
    model = LoopedLM(config)
    init_weights(model, config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, {n_pre}/{n_core}/{n_coda} layers, d={args.n_embd}", flush=True)

    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(args.steps // 20, 1)
    log = []
    model.train()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(step / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = batches(streams, args.batch, args.seq, generator)
        no_grad, with_grad = sample_loops(args.mean_recurrence, args.backprop, generator)
        state = random_state(config, (args.batch, args.seq), generator)
        loss = loss_with_loops(model, batch, no_grad, with_grad, state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == 1:
            elapsed = time.perf_counter() - t0
            log.append({"step": step, "loss": loss.item(), "loops": no_grad + with_grad, "time_s": elapsed})
            print(f"step {step:5d}  loss {loss.item():.3f}  loops {no_grad + with_grad:3d}  lr {lr:.2e}  "
                  f"{elapsed:.0f}s", flush=True)
    model.eval()
    val = validation_loss(model, dev_windows, [1, 2, 4, 8, 16, 32, 64])
    elapsed = time.perf_counter() - t0
    print("validation loss by loops: " + "  ".join(f"R={r}: {v:.3f}" for r, v in val.items()), flush=True)
    print(f"total time {elapsed / 60:.1f} min", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, args.out / "model.safetensors")
    hf = config.to_hf_dict() | {"training": {
        "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "train_mean_recurrence": args.mean_recurrence, "backprop_loops": args.backprop, "lr": args.lr,
        "parameters": params, "minutes": round(elapsed / 60, 1), "threads": args.threads,
        "validation_loss_by_loops": val}}
    (args.out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    tokenizer.save_pretrained(str(args.out))


if __name__ == "__main__":
    main()
