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
    def attend(self, site: Site, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention output for the block's queries ``q`` (B, H, n, D) given its keys/values (B, Hkv, n, D)."""
        ...


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, causal: bool = False,
           softmax_dtype: torch.dtype | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d_h) + M) v with grouped-query heads.

    ``mask`` is boolean (n_q, n_k) or broadcastable to (B, H, n_q, n_k), True where a query reads
    a key. ``softmax_dtype`` selects the explicit path (scores and softmax in that dtype, the
    measurement mode of RIPE Section 2); ``None`` uses PyTorch's fused attention.
    """
    groups = q.shape[1] // k.shape[1]
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    if softmax_dtype is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q.to(softmax_dtype) @ k.to(softmax_dtype).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.to(softmax_dtype)).to(q.dtype)


class CausalRouter:
    """No cache: each call attends causally within the block. Optionally records every call's K/V."""

    def __init__(self, record: dict[Site, tuple[Tensor, Tensor]] | None = None,
                 softmax_dtype: torch.dtype | None = None) -> None:
        self.record = record
        self.softmax_dtype = softmax_dtype

    def attend(self, site: Site, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.record is not None:
            self.record[site] = (k, v)
        return attend(q, k, v, causal=True, softmax_dtype=self.softmax_dtype)
