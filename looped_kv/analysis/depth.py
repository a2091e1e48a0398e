"""Does a looped model use its depth? Loss and answer accuracy by loop count.

These are the measurements behind the tiny model's gates and the book's training page:

* :func:`loss_by_loops`: mean next-token loss of teacher-forced texts after R loops, and
  :func:`loss_by_text` the same per text (paired measurements for a verdict); :func:`depth_stops_paying`:
  the loop count from which no deeper count lowers the mean loss by a gain that counts;
* :func:`answer_accuracy`: on variable-chain programs (:func:`looped_kv.workloads.data.chain_programs` and
  ``multichain_programs``), how often the argmax after a query's cue (``x?`` or ``x``) is x's value, and its loss,
  by R and by the binding depth; :func:`answer_hits` gives the same per query, :func:`answer_loss_by_program` per
  program, and :func:`decoded_hits` scores a decoded continuation;
* :func:`read_by_loops`: what a function of the logits gives after each R, from one forward of the deepest R (the
  loss and answer tables read theirs this way).

The book's rate of ripening, rho, is RIPE's alone (:func:`looped_kv.analysis.planes.ripening_rates`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from looped_kv.decoding.prompts import row_chunks
from looped_kv.runtime.attention import CausalRouter
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads.data import ChainProgram

#: Depth buckets of chain queries, by the serial steps their answers need.
DEPTH_BUCKETS = {"1-2": (1, 2), "3-4": (3, 4), "5-8": (5, 8), "9-12": (9, 12), "13-16": (13, 16),
                 "17-24": (17, 24), "25-32": (25, 32)}


def _pad(rows: Sequence[Sequence[int]], fill: int) -> tuple[Tensor, Tensor]:
    """Right-padded (n, max length) ids and the mask of real tokens."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), fill, dtype=torch.long)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        real[i, :len(row)] = True
    return ids, real


def encode_texts(tokenizer, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """Tokenize texts into right-padded ids (n, longest) and the mask of real tokens."""
    if not texts:
        raise ValueError("texts must hold at least one text")
    return _pad([tokenizer(t)["input_ids"] for t in texts], tokenizer.eos_token_id or 0)


def _check_loops(loops: Sequence[int]) -> list[int]:
    loops = list(loops)
    if not loops or any(not isinstance(r, int) or r < 1 for r in loops) or len(set(loops)) < len(loops):
        raise ValueError(f"loops must be a non-empty list of distinct integers >= 1, got {loops}")
    return loops


Read = TypeVar("Read")


@torch.no_grad()
def read_by_loops(model: LoopedLM, ids: Tensor, loops: Sequence[int],
                  read: Callable[[Tensor], Read]) -> dict[int, Read]:
    """``read(logits)`` of teacher-forced ``ids`` (B, n) after each R in ``loops``, from one forward of the deepest
    R: its readout after loop R is the R-loop forward's logits (B, n, V), the same operations (``each_loop``), so
    the loops below the deepest are run once, not once per R. Each R's logits are freed once read."""
    loops = _check_loops(loops)
    deepest, wanted, out = max(loops), set(loops), {}
    positions = torch.arange(ids.shape[1], device=ids.device)

    def read_out(r: int, state: Tensor) -> None:
        if r in wanted and r < deepest:
            out[r] = read(model.readout(state, positions, CausalRouter(), tokens=ids))

    out[deepest] = read(model(ids, num_loops=deepest, each_loop=read_out))
    return {R: out[R] for R in loops}


@torch.no_grad()
def loss_by_loops(model: LoopedLM, ids: Tensor, loops: Sequence[int], real: Tensor | None = None) -> pd.Series:
    """Mean next-token loss (nats) of teacher-forced ``ids`` (B, n) after each R in ``loops``.

    ``real`` (B, n) marks real tokens; targets that are padding are left out.
    """
    loops = _check_loops(loops)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (batch, length >= 2), got shape {tuple(ids.shape)}")
    ids = ids.to(model.device)
    targets = ids[:, 1:].clone()
    if real is not None:
        targets[~real[:, 1:].to(model.device)] = -100
    out = read_by_loops(model, ids[:, :-1], loops, lambda logits: F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100).item())
    return pd.Series(out, name="loss").rename_axis("loops")


@torch.no_grad()
def loss_by_text(model: LoopedLM, ids: Tensor, loops: Sequence[int], real: Tensor | None = None,
                 rows_per_chunk: int | None = None) -> pd.DataFrame:
    """Mean next-token loss (nats) of each text (row of ``ids``, (B, n)) after each R: rows texts, columns R.

    ``real`` (B, n) marks real tokens; padding targets are left out of each text's mean. ``rows_per_chunk`` runs
    at most that many texts per forward.
    """
    chunks = row_chunks(ids.shape[0], rows_per_chunk)
    if len(chunks) > 1:
        parts = [loss_by_text(model, ids[rows], loops, None if real is None else real[rows]) for rows in chunks]
        return pd.concat(parts, ignore_index=True).rename_axis(index="text", columns="loops")
    loops = _check_loops(loops)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (batch, length >= 2), got shape {tuple(ids.shape)}")
    ids = ids.to(model.device)
    keep = torch.ones_like(ids[:, 1:], dtype=torch.bool) if real is None else real[:, 1:].to(model.device)
    if not keep.any(1).all():
        raise ValueError("every text must hold at least two real tokens")

    def text_means(logits: Tensor) -> np.ndarray:
        nll = F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        return ((nll * keep).sum(1) / keep.sum(1)).cpu().numpy()

    return pd.DataFrame(read_by_loops(model, ids[:, :-1], loops, text_means)).rename_axis(index="text", columns="loops")


def depth_stops_paying(curve: pd.Series, gain: float) -> int:
    """The loop count from which more loops stop paying: the smallest measured count r whose mean loss no deeper
    count lowers by ``gain`` nats or more (``curve``: mean loss indexed by loop count, as a column of
    :func:`loss_by_text`'s means). ``gain`` is the smallest gain that counts: the training gate's
    (:mod:`looped_kv.tiny.gates`). The deepest count is returned when every count before it still pays."""
    if not (math.isfinite(gain) and gain > 0):
        raise ValueError(f"gain must be a finite number of nats > 0, got {gain}")
    if curve.empty or not np.isfinite(curve.to_numpy(dtype=float)).all():
        raise ValueError(f"curve must hold finite mean losses, got {curve.to_dict()}")
    curve = curve.sort_index()
    loss = curve.to_numpy(dtype=float)
    paying = [loss[i] - loss[i + 1:].min() >= gain for i in range(len(loss) - 1)]
    return int(curve.index[paying.index(False) if False in paying else len(loss) - 1])


@dataclass(frozen=True)
class ChainBatch:
    """Tokenized chain programs with the position and depth of every answer."""

    ids: Tensor  # (n, length), right-padded
    real: Tensor  # (n, length) bool
    rows: Tensor  # (queries,) program of each answer
    positions: Tensor  # (queries,) position whose next token is the answer (the cue's last token)
    answers: Tensor  # (queries,) answer token ids
    depths: Tensor  # (queries,) bindings between the queried variable and its digit


def encode_chains(tokenizer, programs: Sequence[ChainProgram]) -> ChainBatch:
    """Tokenize programs and locate each query's answer (the token after its cue, ``x?`` or ``x``)."""
    tok = tokenizer
    rows, where, depths = [], [], []
    for i, program in enumerate(programs):
        prefix = tok(program.prompt)["input_ids"]
        ids = list(prefix)
        for q in program.queries:
            ids += tok(program.cue(q))["input_ids"]
            where.append((i, len(ids) - 1))
            ids += tok(program.answer(q))["input_ids"]
            depths.append(q.depth)
        rows.append(ids)
    full = [tok(p.text)["input_ids"] for p in programs]
    if any(a != b[:len(a)] for a, b in zip(rows, full, strict=True)):
        raise ValueError("the tokenizer does not split chain programs at query boundaries")
    ids, real = _pad(rows, tok.eos_token_id or 0)
    r, p = (torch.tensor(x) for x in zip(*where, strict=True))
    return ChainBatch(ids, real, r, p, ids[r, p + 1], torch.tensor(depths))


def decoded_hits(program: ChainProgram, continuation: str) -> list[bool]:
    """Which of a program's queries a decoded continuation answers: query i is right when the continuation writes
    its cue and answer (``x7`` or ``x?7;``) where the program's own query line has them."""
    hits, at = [], 0
    for query in program.queries:
        piece = program.cue(query) + program.answer(query)
        hits.append(continuation[at:at + len(piece)] == piece)
        at += len(piece)
    return hits


def depth_bucket(depth: int) -> str:
    """The :data:`DEPTH_BUCKETS` name of a binding depth."""
    for name, (lo, hi) in DEPTH_BUCKETS.items():
        if lo <= depth <= hi:
            return name
    top = max(hi for _, hi in DEPTH_BUCKETS.values())
    raise ValueError(f"depth must be in 1..{top}, got {depth}")


@torch.no_grad()
def answer_hits(model: LoopedLM, batch: ChainBatch, loops: Sequence[int]) -> pd.DataFrame:
    """Every query's teacher-forced answer after each R: one row per (R, query) with its program, binding
    depth and depth bucket, ``hit`` (the argmax is the answer) and ``nll`` (the answer's loss, nats)."""
    answers = read_by_loops(model, batch.ids.to(model.device), loops,
                            lambda logits: logits[batch.rows, batch.positions].float().cpu())
    frames = []
    for R, logits in answers.items():
        frames.append(pd.DataFrame({
            "loops": R, "query": np.arange(len(batch.answers)), "program": batch.rows.numpy(),
            "depth": batch.depths.numpy(), "bucket": [depth_bucket(int(d)) for d in batch.depths],
            "hit": (logits.argmax(-1) == batch.answers).numpy().astype(float),
            "nll": F.cross_entropy(logits, batch.answers, reduction="none").numpy()}))
    return pd.concat(frames, ignore_index=True)


def answer_loss_by_program(hits: pd.DataFrame) -> pd.DataFrame:
    """Mean answer loss (nats) of each chain program after each R (rows programs, columns R) from
    :func:`answer_hits`: for chains, the paired per-text table that :func:`loss_by_text` gives for text. A chain's
    names and digits are random, so their loss stays near ln 10 or more at any depth; training scores the answers
    alone, and what depth buys on chains is measured on them."""
    missing = {"loops", "program", "nll"} - set(hits.columns)
    if missing:
        raise ValueError(f"hits must be answer_hits' table; it lacks {sorted(missing)}")
    table = hits.pivot_table(index="program", columns="loops", values="nll", aggfunc="mean")
    return table.rename_axis(index="text", columns="loops")


@torch.no_grad()
def answer_accuracy(model: LoopedLM, batch: ChainBatch, loops: Sequence[int]) -> pd.DataFrame:
    """Teacher-forced answer accuracy and answer loss after R loops: one row per R, overall and by depth bucket."""
    hits = answer_hits(model, batch, loops)
    table = hits.groupby("loops", sort=False).agg(accuracy=("hit", "mean"), **{"answer loss": ("nll", "mean")})
    by_bucket = hits.pivot_table(index="loops", columns="bucket", values="hit", aggfunc="mean", sort=False)
    for name in DEPTH_BUCKETS:
        table[f"depth {name}"] = by_bucket[name] if name in by_bucket else float("nan")
    return table
