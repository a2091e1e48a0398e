"""Where an attention call reads its keys and values.

Every attention call of the model is identified by a :class:`Site` (stage, layer and,
for the core, the loop r = 1..R that writes plane r). The model computes the block's
own queries, keys and values and hands them to a *router*, which decides what else the
call reads (cached prefix planes, uncommitted block tokens) and records what it must.
The plain causal router below is the model without any cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

Stage = Literal["prelude", "core", "coda"]


@dataclass(frozen=True)
class Site:
    """One attention call: ``stage`` and ``layer`` index; ``loop`` is r = 1..R in the core, 0 elsewhere."""

    stage: Stage
    layer: int
    loop: int = 0


class Router(Protocol):
    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """Attention output for the block's ``queries`` (B, H, n, D) given its ``keys`` and ``values``
        (B, Hkv, n, D)."""
        ...


def attend(queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None, *, causal: bool = False,
           softmax_dtype: torch.dtype | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d_h) + M) v with grouped-query heads (q, k, v: ``queries``, ``keys``, ``values``).

    ``mask`` is boolean (n_q, n_k) or broadcastable to (B, H, n_q, n_k), True where a query reads
    a key; on the fused path it may also be :func:`additive_mask`'s form of one. ``softmax_dtype``
    selects the explicit path (scores and softmax in that dtype, the measurement mode of RIPE
    Section 2); ``None`` uses PyTorch's fused attention.
    """
    groups = queries.shape[1] // keys.shape[1]
    if causal:
        n_q, n_k = queries.shape[2], keys.shape[2]
        if n_q == n_k and softmax_dtype is None:  # the fused kernel skips the masked half (the same result, on a CPU
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True,  # bit for bit)
                                                  enable_gqa=groups > 1)
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=queries.device).tril(n_k - n_q)
    if softmax_dtype is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=groups > 1)
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = queries.to(softmax_dtype) @ keys.to(softmax_dtype).transpose(-1, -2) / math.sqrt(queries.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ values.to(softmax_dtype)).to(queries.dtype)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask as the additive one the fused kernel turns it into on every call (0 where a query reads a key,
    -inf elsewhere, in the queries' ``dtype``): made once for a mask that many calls share (the same result)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend_segments(queries: Tensor, segments: list[tuple[Tensor, Tensor, Tensor | None]],
                    softmax_dtype: torch.dtype | None = None) -> Tensor:
    """One softmax over several key/value segments, each read in place: no concatenation.

    ``segments`` holds (keys, values, mask) with keys and values (B, Hkv, n_k, D) and mask broadcastable to
    (B, H, n_q, n_k) (None: all read). Scores are computed per segment and joined for one softmax (the scores, a
    few per query, are copied; the keys and values never are), and the values are summed per segment: the same
    result as attending to the concatenation. Grouped-query heads
    broadcast instead of being repeated. Computed in ``softmax_dtype`` (default: float32, or the input's dtype
    when wider).
    """
    if len(segments) == 1:
        keys, values, mask = segments[0]
        return attend(queries, keys, values, mask, softmax_dtype=softmax_dtype)
    B, H, n, D = queries.shape
    groups = H // segments[0][0].shape[1]
    dtype = softmax_dtype or torch.promote_types(queries.dtype, torch.float32)
    qg = queries.to(dtype).view(B, H // groups, groups, n, D) / math.sqrt(D)
    scores = []
    for keys, _, mask in segments:  # (B, Hkv, groups, n, n_k) per segment; the keys are never copied
        s = qg @ keys.to(dtype).unsqueeze(2).transpose(-1, -2)
        scores.append(s if mask is None else s.masked_fill(~_grouped(mask, groups), float("-inf")))
    weights = torch.cat(scores, dim=-1).softmax(dim=-1).split([s.shape[-1] for s in scores], dim=-1)
    out = weights[0] @ segments[0][1].to(dtype).unsqueeze(2)
    for w, (_, values, _) in zip(weights[1:], segments[1:], strict=True):
        out = out + w @ values.to(dtype).unsqueeze(2)
    return out.reshape(B, H, n, D).to(queries.dtype)


def _grouped(mask: Tensor, groups: int) -> Tensor:
    """A mask broadcastable to (B, H, n_q, n_k) as one broadcastable to (B, H / groups, groups, n_q, n_k)."""
    if mask.dim() < 4 or mask.shape[1] == 1:
        return mask.unsqueeze(-3) if mask.dim() >= 3 else mask
    return mask.unflatten(1, (-1, groups))


class CausalRouter:
    """No cache: each call attends causally within the block. Optionally records every call's K/V."""

    def __init__(self, record: dict[Site, tuple[Tensor, Tensor]] | None = None,
                 softmax_dtype: torch.dtype | None = None) -> None:
        self.record = record
        self.softmax_dtype = softmax_dtype

    def attend(self, site: Site, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        if self.record is not None:
            self.record[site] = (keys, values)
        return attend(queries, keys, values, causal=True, softmax_dtype=self.softmax_dtype)
