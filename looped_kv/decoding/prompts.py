"""Prompts checked before any work, the end-of-text token to stop at, and a batch cut into row chunks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from looped_kv.runtime.model import LoopedLM


def row_chunks(count: int, rows_per_chunk: int | None) -> list[slice]:
    """The rows of a batch of ``count``, in chunks of at most ``rows_per_chunk`` (None: one chunk of all)."""
    if rows_per_chunk is not None and (not isinstance(rows_per_chunk, int) or rows_per_chunk < 1):
        raise ValueError(f"rows_per_chunk must be None or an int >= 1, got {rows_per_chunk!r}")
    step = rows_per_chunk or max(count, 1)
    return [slice(i, i + step) for i in range(0, count, step)]


def check_prompts(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int],
                  margin: int = 0) -> tuple[list[Tensor], list[int]]:
    """Validate prompts before any work: a (B, n) or (n,) integer tensor, or a list of 1-d or (1, n) ones of any
    lengths, and one token budget (an int >= 1) for all or per prompt.

    Returns the prompts as 1-d long tensors on the model's device and one token budget per prompt.
    """
    shapes = "input_ids must be (batch, length), (length,) or a list of prompts, each an integer tensor"
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(f"{shapes}; got shape {tuple(input_ids.shape)}")
        rows = list(input_ids)
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, str | bytes):
        bad = [type(r).__name__ for r in input_ids if not isinstance(r, Tensor)]
        if bad:
            raise ValueError(f"{shapes} (token ids: tokenize text first); got a list of {bad[0]}")
        rows = [r.reshape(-1) if r.dim() == 2 and r.shape[0] == 1 else r for r in input_ids]
        if any(r.dim() != 1 for r in rows):
            raise ValueError("each prompt in a list must be 1-d or (1, length)")
    else:
        raise ValueError(f"{shapes} (token ids: tokenize text first); got {type(input_ids).__name__}")
    if not rows:
        raise ValueError("input_ids must hold at least one prompt")
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
        budgets = [max_new_tokens] * len(rows)
    elif isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, str):
        budgets = list(max_new_tokens)
    else:
        raise ValueError(f"max_new_tokens must be an int >= 1 or one int per prompt ({len(rows)}), got "
                         f"{max_new_tokens!r} ({type(max_new_tokens).__name__})")
    if len(budgets) != len(rows):
        raise ValueError(f"max_new_tokens must be an int or one int per prompt ({len(rows)}), got {len(budgets)}")
    V, context = model.config.vocab_size, model.config.block_size
    for i, (row, budget) in enumerate(zip(rows, budgets, strict=True)):
        if row.numel() < 1:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {row.dtype}")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {budget!r}")
        need = row.numel() + budget + margin
        if need > context:
            raise ValueError(f"prompt length {row.numel()} + max_new_tokens {budget} (+{margin}) = {need} exceeds the "
                             f"model's context (block_size {context})")
    ids = torch.cat(rows)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= V:
        raise ValueError(f"input_ids must be token ids in [0, {V - 1}] (vocab_size {V}), got ids in [{low}, {high}]")
    return [r.long().to(model.device) for r in rows], budgets


def eos_id(model: LoopedLM, eos_token_id: int | None, stop_at_eos: bool) -> int | None:
    """The end-of-text token to stop at: the given id, else the tokenizer's, or None when stopping is off."""
    if not stop_at_eos:
        return None
    if eos_token_id is not None:
        if not 0 <= eos_token_id < model.config.vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {model.config.vocab_size - 1}], got {eos_token_id}")
        return eos_token_id
    tokenizer = getattr(model, "tokenizer", None)
    return getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None


def pad_prompts(prompts: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
    """Right-padded prompts (B, longest) and their lengths (B,), None when every prompt has the same length."""
    lengths = [len(p) for p in prompts]
    n = max(lengths)
    ids = torch.stack([torch.nn.functional.pad(p, (0, n - len(p))) for p in prompts])
    return ids, None if len(set(lengths)) == 1 else torch.tensor(lengths, device=ids.device)
