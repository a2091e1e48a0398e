"""How deep tokens go under adaptive depth (early exit, :mod:`looped_kv.decoding.exits`), and what it costs.

* :func:`exit_profile`: for a batch of prompts, the loop at which each emitted token exited and the mean loops per
  token, from greedy decoding with one exit rule.
* :func:`teacher_forced_exits`: many exit rules at once on chosen positions of teacher-forced texts, from one
  cache-free pass of R loops with a readout after every loop: each rule's exit loop per position, the token its exit
  readout picks and its loss, against full depth; optionally how far each position's keys and values at its exit
  loop are from plane R (RIPE's Delta_r, Sec. 3.2). A prompt exits as one block with its last position
  (:mod:`~looped_kv.decoding.exits`), so at a prompt's last position this is exactly what greedy decoding with early
  exit picks for the first new token; at the other positions the prefix has run all R loops, so it is the cost of a
  token's own exit without what exits leave in the cache.
* :func:`exit_summary`: per rule (and group of positions), mean loops, accuracy, loss and agreement with full depth.
* :func:`decode_chains` and :func:`chain_continuations`: chain programs decoded from their prompts, each answer
  scored with the loop that chose it and the loop at which the prompt (and so its planes) stopped.
* :func:`continuation_agreement`: how far an early-exit continuation follows the full-depth greedy one.
* :func:`time_exits`: tokens/s of each prompt decoded alone, with and without early exit, in interleaved rounds.
* :func:`loop_shares`: the share of tokens that exited at each loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from looped_kv.analysis.depth import decoded_hits, depth_bucket
from looped_kv.decoding.exits import ExitRule, exit_rule
from looped_kv.decoding.generate import generate
from looped_kv.decoding.prompts import row_chunks
from looped_kv.decoding.result import Generation
from looped_kv.runtime.attention import CausalRouter, Site
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import make_policy
from looped_kv.workloads.data import ChainProgram


@dataclass(frozen=True)
class ExitProfile:
    """Per prompt, each emitted token and the loop whose readout chose it (1..R)."""

    tokens: list[list[int]]
    loops: list[list[int]]
    num_loops: int  # R, the loops a token runs when its criterion never fires

    @property
    def mean_loops(self) -> float:
        """Mean loops per emitted token over every prompt's tokens."""
        every = [loop for row in self.loops for loop in row]
        return sum(every) / len(every)


def exit_profile(model: LoopedLM, prompts: Tensor | Sequence[Tensor], exit: str, exit_threshold: float | None = None,
                 *, max_new_tokens: int = 16, **options: object) -> ExitProfile:
    """Decode ``prompts`` greedily with early exit by ``exit`` and ``exit_threshold`` (and any other option of
    :func:`~looped_kv.decoding.generate.generate`'s greedy decoding: ``num_loops``, ``cache``, ``exited_reads``...),
    and return each emitted token's exit loop."""
    out = generate(model, prompts, method="ar", exit=exit, exit_threshold=exit_threshold,
                   max_new_tokens=max_new_tokens, **options)
    return ExitProfile([row.tolist() for row in out.new_rows], out.row_loops, out.exit["num_loops"])


class _PlaneRecorder(CausalRouter):
    """Causal attention without a cache that keeps, per core loop and layer, the keys and values of chosen positions
    ((N, H_kv, D) each)."""

    def __init__(self, rows: Tensor, columns: Tensor) -> None:
        super().__init__()
        self.rows, self.columns = rows, columns
        self.planes: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        if site.stage == "core":
            self.planes[(site.loop, site.layer)] = (keys[self.rows, :, self.columns].float(),
                                                    values[self.rows, :, self.columns].float())
        return super().attend(site, queries, keys, values)


@dataclass(frozen=True)
class ExitReads:
    """What :func:`teacher_forced_exits` measured: ``table`` has one row per (rule, position) with the rule's name,
    criterion and threshold, the position's index ``item`` (0..N-1) and ``group``, its exit ``loop``, the ``top`` token
    of its exit readout, ``hit`` (top is the target), ``nll`` (the target's loss at the exit, nats), ``agree`` (top is
    the full-depth top) and, with planes recorded, ``delta k`` / ``delta v`` (Delta at the exit loop). ``delta`` holds
    per kind the (R, N) array of Delta_r = ||X(r) - X(R)|| / ||X(R)|| at each position, averaged over core layers."""

    table: pd.DataFrame
    num_loops: int
    rules: dict[str, ExitRule]
    delta: dict[str, np.ndarray] = field(default_factory=dict)


def _exit_pass(model: LoopedLM, ids: Tensor, rows: Tensor, columns: Tensor, targets: Tensor,
               rules: Mapping[str, ExitRule], R: int, planes: bool) -> dict[str, Tensor]:
    """One cache-free pass of ``ids`` for :func:`teacher_forced_exits`: per rule its exit loop, top token and target
    loss at each position, the full-depth top token, and with ``planes`` Delta_r (R, N) of keys and values."""
    device, n, N = model.device, ids.shape[1], len(rows)
    positions = torch.arange(n, device=device)
    router = _PlaneRecorder(rows, columns) if planes else CausalRouter()
    criteria = {name: rule.new() for name, rule in rules.items()}
    out: dict[str, Tensor] = {}
    for name in rules:
        out[f"{name}/loop"] = torch.zeros(N, dtype=torch.long, device=device)
        out[f"{name}/top"] = torch.zeros(N, dtype=torch.long, device=device)
        out[f"{name}/nll"] = torch.zeros(N, dtype=torch.float64, device=device)

    def each_loop(r: int, state: Tensor) -> None:
        if r == 0:
            for criterion in criteria.values():
                criterion.start(state[rows, columns])
            return
        logits = model.readout(state, positions, CausalRouter(), tokens=ids)[rows, columns].float()
        loss = F.cross_entropy(logits, targets, reduction="none").double()
        for name, criterion in criteria.items():
            kind = criterion.reads
            read = (logits if kind == "logits" else state[rows, columns] if kind == "state" else
                    model.transformer.exit_gate(state[rows, columns]).squeeze(-1) if kind == "gate" else None)
            new = (criterion.step(r, read) | (r == R)) & (out[f"{name}/loop"] == 0)
            out[f"{name}/loop"] = torch.where(new, r, out[f"{name}/loop"])
            out[f"{name}/top"] = torch.where(new, logits.argmax(-1), out[f"{name}/top"])
            out[f"{name}/nll"] = torch.where(new, loss, out[f"{name}/nll"])

    logits = model(ids, R, router=router, check=False, max_position=n - 1, each_loop=each_loop)[rows, columns]
    out["full/top"] = logits.argmax(-1)
    if planes:
        for i, kind in enumerate(("k", "v")):
            stacked = torch.stack([torch.stack([router.planes[(r, layer)][i] for layer in range(model.config.n_core)])
                                   for r in range(1, R + 1)]).flatten(3)  # (R, n_core, N, H D)
            last = stacked[-1]
            out[f"delta/{kind}"] = ((stacked - last).norm(dim=-1) / last.norm(dim=-1)).mean(1)  # (R, N)
    return out


@torch.no_grad()
def teacher_forced_exits(model: LoopedLM, ids: Tensor, rows: Tensor, columns: Tensor,
                         rules: Mapping[str, tuple[str, float | None]], *, targets: Tensor | None = None,
                         groups: Sequence[object] | None = None, num_loops: int | None = None,
                         planes: bool = False, rows_per_chunk: int | None = None) -> ExitReads:
    """Every exit rule of ``rules`` (name -> (criterion, threshold or None for its default)) at the positions
    (``rows``, ``columns``) of teacher-forced ``ids`` (B, n), from one cache-free pass of R = ``num_loops`` (default
    the model's mean recurrence) loops with a readout after each loop. ``targets`` (N,) are the tokens scored at each
    position (default the next token of ``ids``); ``groups`` (N,) labels positions (a depth bucket, a workload);
    ``planes`` records the positions' core keys and values per loop to give Delta at each exit (:class:`ExitReads`);
    ``rows_per_chunk`` runs at most that many rows of ``ids`` per pass.
    """
    R = model.config.mean_recurrence if num_loops is None else num_loops
    if not rules:
        raise ValueError("rules must name at least one exit rule")
    if ids.dim() != 2:
        raise ValueError(f"ids must be (batch, length), got shape {tuple(ids.shape)}")
    policy = make_policy("full", R)
    checked = {name: exit_rule(exit, threshold, None, model.config, policy)
               for name, (exit, threshold) in rules.items()}
    rows, columns = torch.as_tensor(rows).long().cpu(), torch.as_tensor(columns).long().cpu()
    N = len(rows)
    if targets is None:
        if N and int(columns.max()) + 1 >= ids.shape[1]:
            raise ValueError("a position without a next token needs its target in targets")
        targets = ids.cpu()[rows, columns + 1]
    targets = torch.as_tensor(targets).long().cpu()
    if N == 0 or len(columns) != N or len(targets) != N or (groups is not None and len(groups) != N):
        raise ValueError(f"rows, columns, targets and groups must hold one entry per position (got {N} rows)")
    parts: dict[str, list[Tensor]] = {}
    items: list[Tensor] = []
    for chunk in row_chunks(ids.shape[0], rows_per_chunk):
        chunk_rows = torch.arange(ids.shape[0])[chunk]
        mine = torch.isin(rows, chunk_rows).nonzero().flatten()
        if not len(mine):
            continue
        local = torch.searchsorted(chunk_rows, rows[mine])
        out = _exit_pass(model, ids[chunk].to(model.device), local.to(model.device), columns[mine].to(model.device),
                         targets[mine].to(model.device), checked, R, planes)
        items.append(mine)
        for key, value in out.items():
            parts.setdefault(key, []).append(value.cpu())
    order = torch.cat(items).argsort()
    got = {key: torch.cat(value, dim=-1)[..., order] for key, value in parts.items()}
    delta = {kind: got[f"delta/{kind}"].numpy() for kind in ("k", "v") if f"delta/{kind}" in got}
    frames = []
    for name, rule in checked.items():
        exit_loop = got[f"{name}/loop"].numpy()
        frame = pd.DataFrame({"rule": name, "exit": rule.criterion.name, "threshold": rule.threshold,
                              "item": np.arange(N), "group": list(groups) if groups is not None else "all",
                              "loop": exit_loop, "top": got[f"{name}/top"].numpy(),
                              "hit": (got[f"{name}/top"] == targets).numpy(), "nll": got[f"{name}/nll"].numpy(),
                              "agree": (got[f"{name}/top"] == got["full/top"]).numpy()})
        for kind, d in delta.items():
            frame[f"delta {kind}"] = d[exit_loop - 1, np.arange(N)]
        frames.append(frame)
    return ExitReads(pd.concat(frames, ignore_index=True), R, checked, delta)


def exit_summary(table: pd.DataFrame, by: Sequence[str] = ("rule",)) -> pd.DataFrame:
    """Per rule (and whatever else ``by`` names, e.g. ``"group"``) of :func:`teacher_forced_exits`' table: positions,
    mean loops, accuracy (``hit``), mean loss (``nll``), agreement with full depth and, if recorded, mean Delta of keys
    and values at the exit; in the rules' order."""
    missing = {*by, "loop", "hit", "nll", "agree"} - set(table.columns)
    if missing:
        raise ValueError(f"table must be teacher_forced_exits' table; it lacks {sorted(missing)}")
    columns = {"positions": ("loop", "size"), "mean loops": ("loop", "mean"), "accuracy": ("hit", "mean"),
               "loss": ("nll", "mean"), "agreement": ("agree", "mean")}
    columns |= {f"delta {k} at exit": (f"delta {k}", "mean") for k in ("k", "v") if f"delta {k}" in table}
    return table.groupby(list(by), sort=False).agg(**columns)


def continuation_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> pd.DataFrame:
    """Per row, how far ``other``'s new tokens follow ``reference``'s (full-depth greedy): ``matched`` tokens before
    the first difference, ``compared`` (the shorter row's length), ``prefix`` (matched / compared: 1 when one row
    continues the other) and ``same`` (the share of compared positions holding the same token, which counts
    positions after a divergence too)."""
    if len(reference) != len(other):
        raise ValueError(f"reference and other must hold the same rows, got {len(reference)} and {len(other)}")
    out = []
    for a, b in zip(reference, other, strict=True):
        a, b = list(a), list(b)
        compared = min(len(a), len(b))
        pairs = [x == y for x, y in zip(a[:compared], b[:compared], strict=True)]
        matched = pairs.index(False) if False in pairs else compared
        out.append({"matched": matched, "compared": compared,
                    "prefix": matched / compared if compared else float("nan"),
                    "same": sum(pairs) / compared if compared else float("nan")})
    return pd.DataFrame(out)


def loop_shares(loops: Sequence[int], num_loops: int) -> np.ndarray:
    """The share of ``loops`` (exit loops, 1..R) at each loop 1..R: an array of R shares summing to 1."""
    counts = np.bincount(np.asarray(loops, dtype=int), minlength=num_loops + 1)
    if len(counts) > num_loops + 1 or counts[0] or not len(loops):
        raise ValueError(f"loops must be a non-empty list of exit loops in 1..{num_loops}")
    return counts[1:] / counts.sum()


def chain_continuations(tokenizer, programs: Sequence[ChainProgram], generation: Generation,
                        num_loops: int) -> pd.DataFrame:
    """Score greedy continuations of chain programs decoded from their prompts (the program and its newline; row i of
    ``generation`` continues ``programs[i]``): one row per query with its program, depth and depth bucket, ``hit``
    (:func:`~looped_kv.analysis.depth.decoded_hits`), the loop that chose the prompt's first new token (``prompt
    loop``: the prompt's planes stop there) and the loop that chose the query's answer token (``answer loop``; NaN
    unless the continuation wrote the text before it as the program's query line does). Without early exit every
    loop is R = ``num_loops``."""
    if len(programs) != generation.batch:
        raise ValueError(f"programs and generation rows must match, got {len(programs)} and {generation.batch}")
    out = []
    for i, (program, row) in enumerate(zip(programs, generation.new_rows, strict=True)):
        tokens = row.tolist()
        loops = generation.row_loops[i] if generation.row_loops else [num_loops] * len(tokens)
        hits = decoded_hits(program, tokenizer.decode(tokens))
        before = ""
        for query, hit in zip(program.queries, hits, strict=True):
            before += program.cue(query)
            expected = tokenizer(before)["input_ids"]
            at = len(expected)
            written = tokens[:at] == expected and at < len(tokens)
            out.append({"program": i, "depth": query.depth, "bucket": depth_bucket(query.depth), "hit": hit,
                        "prompt loop": loops[0] if loops else np.nan,
                        "answer loop": loops[at] if written else np.nan})
            before += program.answer(query)
    return pd.DataFrame(out)


def decode_chains(model: LoopedLM, programs: Sequence[ChainProgram], max_new_tokens: int | None = None,
                  **options: object) -> tuple[Generation, pd.DataFrame]:
    """Greedy continuations of ``programs`` from their prompts (as one batch; ``options`` go to
    :func:`~looped_kv.decoding.generate.generate`: ``exit``, ``cache``, ``rows_per_chunk``...) and their scores
    (:func:`chain_continuations`). The budget defaults to the longest query line and one token more."""
    tok = model.tokenizer
    ids = [tok(p.prompt, return_tensors="pt").input_ids[0].to(model.device) for p in programs]
    budget = max_new_tokens or max(len(tok(p.answers + "\n")["input_ids"]) for p in programs) + 1
    out = generate(model, ids, method="ar", max_new_tokens=budget, **options)
    return out, chain_continuations(tok, programs, out, options.get("num_loops") or model.config.mean_recurrence)


def time_exits(model: LoopedLM, prompts: Sequence[Tensor], rules: Mapping[str, dict], max_new_tokens: int,
               repeats: int = 1) -> pd.DataFrame:
    """Wall time of each prompt decoded alone by greedy full-depth decoding and by each rule (name -> options of
    :func:`~looped_kv.decoding.generate.generate`, e.g. ``{"exit": "kl"}``), in ``repeats`` interleaved rounds (the
    order reversed every other round), after one warm-up run: one row per (prompt, rule) with the median time, new
    tokens, tokens/s, mean loops per token, the speed-up over the paired greedy run (tokens/s over tokens/s) and the
    share of its tokens that match greedy's before the first difference (:func:`continuation_agreement`)."""
    if repeats < 1 or not prompts or not rules or "greedy" in rules:
        raise ValueError("time_exits needs prompts, rules (none named 'greedy') and repeats >= 1")
    configs, R = {"greedy": {}, **rules}, model.config.mean_recurrence
    generate(model, prompts[0], max_new_tokens=2, **next(iter(rules.values())))  # warm-up
    rows = []
    for i, ids in enumerate(prompts):
        times: dict[str, list[float]] = {key: [] for key in configs}
        outs: dict[str, Generation] = {}
        for r in range(repeats):
            for key in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                out = generate(model, ids, max_new_tokens=max_new_tokens, stop_at_eos=False, **configs[key])
                times[key].append(out.wall_time)
                outs.setdefault(key, out)
        base = outs["greedy"].num_new / float(np.median(times["greedy"]))
        for key, out in outs.items():
            seconds = float(np.median(times[key]))
            match = continuation_agreement([outs["greedy"].new_rows[0].tolist()], [out.new_rows[0].tolist()])
            rows.append({"prompt": i, "rule": key, "time_s": seconds, "tokens": out.num_new,
                         "tokens_per_s": out.num_new / seconds,
                         "mean loops": out.mean_loops if out.row_loops else float(R),
                         "speed-up": out.num_new / seconds / base, "prefix": float(match["prefix"].iloc[0]),
                         "repeats": repeats})
    return pd.DataFrame(rows)

