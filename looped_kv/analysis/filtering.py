"""RIPE Sec. 5.4: per-head position filtering, measured by teacher-forced replay (Chapter 3).

The starting plan of the RIPE paper proposed keeping, per head, only the prefix positions that a shallow loop
attends to. Here a *filter* is a boolean ``keep`` (B, n_core, H_kv, t0) over the prefix positions j < t0 of each
text, core layer and key/value head (the unit a cache stores); under it the first decoded position t0 reads, at every
loop, only the kept prefix positions of each head (and its own position). Prelude and coda read the whole prefix.

* :func:`first_query_attention` is the attention of the first decoded position's query over its prefix at one
  (shallow) loop, summed over the query heads of each key/value head: what a selection reads.
* :func:`top_k` keeps, per text and head, the ``budget`` share of the prefix with the most attention (the paper's
  "top-k"); :func:`frozen` keeps, per head, the positions with the most attention averaged over other texts (the
  paper's per-head policy, frozen from batch 1 and tested on unseen texts), the same for every text.
* :func:`filter_kl` replays texts under a filter, optionally with deepest-plane storage (every loop r < R reads plane
  R of the prefix, as :func:`~looped_kv.analysis.replay.deepest_plane_arm`), and returns KL(reference || arm) at the
  first decoded position per text. Keeping everything reproduces the reference (or the deepest-plane arm) bit for bit.
* :func:`only_head` filters one head and keeps every position of the others, for the per-head comparison.

Texts of one length share absolute positions, so a frozen filter is a set of prefix positions per head.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from looped_kv.analysis.replay import Replay, check_softmax, kl, replay
from looped_kv.runtime.attention import Site, attend
from looped_kv.runtime.model import LoopedLM


def selection_loop(loop: int, num_loops: int, paper_loops: int = 32) -> int:
    """A loop of the paper's R = 32 scaled to R: ``round(loop * R / 32)``, clipped to 1..R (as the paper's regions)."""
    if num_loops < 1 or not 1 <= loop <= paper_loops:
        raise ValueError(f"need 1 <= loop <= {paper_loops} and num_loops >= 1, got loop {loop}, R = {num_loops}")
    return min(max(round(loop * num_loops / paper_loops), 1), num_loops)


def budget_positions(prefix: int, budget: float) -> int:
    """Positions kept per head out of ``prefix``: round(budget * prefix), at least 1."""
    if prefix < 1 or not 0 < budget <= 1:
        raise ValueError(f"need prefix >= 1 and budget in (0, 1], got {prefix} and {budget}")
    return max(1, round(budget * prefix))


@torch.no_grad()
def first_query_attention(model: LoopedLM, ids: Tensor, num_loops: int, loop: int, *, decoded: int) -> Tensor:
    """Attention weights (B, n_core, H_kv, t0), float64, of the first decoded position t0 = n - ``decoded`` over its
    prefix at loop ``loop`` (explicit float32 softmax replay), summed over the query heads of each key/value head. The
    weight the query puts on itself is left out, so a row sums to at most 1."""
    rep = replay(model, ids, num_loops, record=("q", "k"), loops=(loop,), decoded=decoded)
    q, k = rep.plane("q", loop).double(), rep.plane("k", loop).double()  # (n_core, B, H, n, D), (n_core, B, Hkv, n, D)
    t0, groups = rep.first_decoded, q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    scores = (q[..., t0:t0 + 1, :] @ k[..., :t0 + 1, :].transpose(-1, -2)).squeeze(-2) / math.sqrt(q.shape[-1])
    weights = scores.softmax(-1)[..., :t0]  # (n_core, B, H, t0)
    return weights.unflatten(2, (-1, groups)).sum(3).transpose(0, 1).contiguous()


def top_k(weights: Tensor, budget: float) -> Tensor:
    """Keep (same shape, bool) the :func:`budget_positions` positions of most weight along the last axis."""
    k = budget_positions(weights.shape[-1], budget)
    keep = torch.zeros_like(weights, dtype=torch.bool)
    return keep.scatter_(-1, weights.topk(k, dim=-1).indices, True)


def frozen(calibration: Tensor, budget: float, texts: int) -> Tensor:
    """The per-head policy: per (core layer, head) the positions of most mean weight over the ``calibration`` texts
    (B_cal, n_core, H_kv, t0), the same for each of ``texts`` texts: (texts, n_core, H_kv, t0)."""
    return top_k(calibration.mean(0, keepdim=True), budget).expand(texts, -1, -1, -1).contiguous()


def only_head(keep: Tensor, layer: int, head: int) -> Tensor:
    """``keep`` for one (core layer, head) and every position for the others."""
    out = torch.ones_like(keep)
    out[:, layer, head] = keep[:, layer, head]
    return out


class FilterRouter:
    """Attention under a position filter: in the core, query rows t >= t0 read only the kept prefix positions of each
    head (positions from t0 on stay readable); with ``deepest``, loops r < R read plane R of the reference for the
    prefix and their own key/value at j = t, in one softmax (the layout of the deepest-plane arm)."""

    def __init__(self, reference: Replay, keep: Tensor, deepest: bool, softmax_dtype: torch.dtype) -> None:
        self.reference, self.keep, self.deepest, self.softmax_dtype = reference, keep, deepest, softmax_dtype

    def _readable(self, site: Site, n: int, heads: int, device: torch.device) -> Tensor:
        """(B, H, n, n) bool: column j readable by row t, before causality."""
        t0, keep = self.reference.first_decoded, self.keep[:, site.layer].to(device)  # (B, Hkv, t0)
        columns = torch.ones(keep.shape[0], keep.shape[1], n, dtype=torch.bool, device=device)
        columns[..., :t0] = keep
        columns = columns.repeat_interleave(heads // keep.shape[1], dim=1)[:, :, None, :]  # (B, H, 1, n)
        unfiltered = (torch.arange(n, device=device) < t0)[:, None]  # rows of the prefix read everything
        return unfiltered | columns

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        if site.stage != "core":
            return attend(queries, keys, values, causal=True, softmax_dtype=self.softmax_dtype)
        n, device = queries.shape[2], queries.device
        readable = self._readable(site, n, queries.shape[1], device)
        R = self.reference.num_loops
        if not self.deepest or site.loop == R:
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            return attend(queries, keys, values, causal & readable, softmax_dtype=self.softmax_dtype)
        prefix_k, prefix_v = (self.reference.plane(kind, R)[site.layer].to(x.device, x.dtype)
                              for kind, x in (("k", keys), ("v", values)))
        own = torch.eye(n, dtype=torch.bool, device=device)
        prefix = torch.ones_like(own).tril(-1) & readable
        mask = torch.cat([prefix, own.expand_as(prefix)], dim=-1)
        return attend(queries, torch.cat([prefix_k, keys], dim=2), torch.cat([prefix_v, values], dim=2), mask,
                      softmax_dtype=self.softmax_dtype)


@torch.no_grad()
def filter_kl(model: LoopedLM, reference: Replay, keep: Tensor | None, *, deepest: bool = False) -> np.ndarray:
    """KL(reference || arm) at the first decoded position per text (B,), the arm reading the prefix through ``keep``
    (None: every position) and, with ``deepest``, plane R of the prefix at every loop r < R (the reference must have
    recorded keys and values of plane R)."""
    B, t0 = reference.input_ids.shape[0], reference.first_decoded
    check_softmax(reference.softmax_dtype)
    if keep is None:
        keep = torch.ones(B, model.config.n_core, model.config.n_kv_heads, t0, dtype=torch.bool)
    if keep.shape[0] != B or keep.shape[1] != model.config.n_core or keep.shape[-1] != t0:
        raise ValueError(f"keep must be (B = {B}, n_core = {model.config.n_core}, H_kv, t0 = {t0}), got "
                         f"{tuple(keep.shape)}")
    router = FilterRouter(reference, keep, deepest, reference.softmax_dtype)
    logits = model(reference.input_ids.to(model.device), reference.num_loops, router=router)
    return kl(reference.logits[:, t0], logits[:, t0]).clamp_min(0).cpu().numpy()
