"""Prompt lookup decoding (Saxena, 2023), batch-first: n-gram drafts from each row's context, verified at full depth."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from looped_kv.decoding.core import Generation, Rows, accept, check_prompts, new_buffer, new_cache, prefill_rows
from looped_kv.decoding.speculative import check_speculation, verify
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy


def lookup_drafts(context: list[int], block: int, ngram: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the last n-gram (n = ngram..1)."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + block]
    return []


@torch.no_grad()
def prompt_lookup(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int], *,
                  policy: CachePolicy, block: int, ngram: int = 3, exact: bool = True, eos: int | None = None,
                  progress: bool = False) -> Generation:
    """Prompt lookup decoding of B prompts; rows whose drafts are shorter verify only what they drafted."""
    prompts, budgets = check_prompts(model, input_ids, max_new_tokens, margin=block + 1)
    check_speculation(policy, block, exact)
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    R, B = policy.num_loops, len(prompts)
    rows = Rows(prompts, budgets, eos, progress, "prompt lookup")
    cache = new_cache(model, policy, B, max(len(p) + b for p, b in zip(prompts, budgets, strict=True)) + block + 1)
    buffer = new_buffer(model, R, B, block + 1)
    pending = prefill_rows(model, cache, prompts, R)
    contexts = [[*p.tolist(), int(x)] for p, x in zip(prompts, pending, strict=True)]
    rows.emit(list(pending))
    passes = 1
    while True:
        keep = [i for i, seq in enumerate(rows.active) if not rows.stopped[seq]]
        contexts = [contexts[i] for i in keep]
        (pending,) = rows.drop_stopped(cache, pending, buffer=buffer)
        if not rows.active:
            break
        found = [lookup_drafts(c, block, ngram) for c in contexts]
        width = max(len(f) for f in found)
        drafts = torch.zeros(len(found), width, dtype=torch.long, device=pending.device)
        for i, f in enumerate(found):
            drafts[i, :len(f)] = torch.tensor(f, dtype=torch.long)
        lengths = torch.tensor([len(f) for f in found], device=pending.device)
        targets = verify(model, cache, buffer, torch.cat([pending, drafts], dim=1), R)
        k = accept(drafts, targets, lengths)
        cache.commit(buffer, k + 1)
        pending = targets.gather(1, k[:, None])
        ks = k.tolist()
        rows.record(ks, [len(f) for f in found], [1] * len(ks))
        new = [torch.cat([d[:a], p]) for d, a, p in zip(drafts, ks, pending, strict=True)]
        rows.emit(new)
        for c, t in zip(contexts, new, strict=True):
            c += t.tolist()
        passes += 1
    return rows.result(cache, passes, eos, block=block, ngram=ngram)
