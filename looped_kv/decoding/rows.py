"""Which prompt each row of a decoding batch is, what each emitted, and when each stops (:class:`Rows`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.decoding.result import Generation
from looped_kv.runtime.cache import PlaneCache


class Rows:
    """Which prompt each row of the batch is, what each emitted, and when each stops (budget or end-of-text).

    ``batch`` lists the prompt of every row the decoder still computes; :meth:`retire` marks the rows that stopped,
    which the decode loop then drops from the batch (the eager decoders: they stop costing work) or keeps as padding
    whose results are ignored (the compiled decoders: the batch keeps its shape, so no step is traced again).
    """

    def __init__(self, prompts: list[Tensor], budgets: list[int], eos: int | None, progress: bool, desc: str) -> None:
        self.prompts, self.budgets, self.eos = prompts, budgets, eos
        self.batch = list(range(len(prompts)))
        self.emitted: list[list[Tensor]] = [[] for _ in prompts]
        self.count = [0] * len(prompts)
        self.stopped = [""] * len(prompts)
        self.accepted: list[list[int]] = [[] for _ in prompts]
        self.drafted: list[list[int]] = [[] for _ in prompts]
        self.retained: list[list[int]] = [[] for _ in prompts]
        self.cache_bytes: list[int | None] = [None] * len(prompts)
        self.batch_per_pass: list[int] = []
        self.bar = tqdm(total=sum(budgets), disable=not progress, desc=desc, leave=False)
        self.start = time.perf_counter()

    @property
    def live(self) -> list[bool]:
        """Per row of the batch: whether it still decodes."""
        return [not self.stopped[seq] for seq in self.batch]

    def emit(self, tokens: Sequence[Tensor]) -> dict[int, Tensor]:
        """Each live row emits its tokens (1-d), cut at its budget and after an end-of-text token; returns what each
        row (by its index among the prompts) emitted."""
        out: dict[int, Tensor] = {}
        for seq, new in zip(self.batch, tokens, strict=True):
            if self.stopped[seq]:
                continue
            new = new[:self.budgets[seq] - self.count[seq]]
            if self.eos is not None:
                hits = (new == self.eos).nonzero()
                if len(hits):
                    new = new[:int(hits[0]) + 1]
                    self.stopped[seq] = "eos"
            self.emitted[seq].append(new)
            out[seq] = new
            self.count[seq] += len(new)
            self.bar.update(len(new))
            if not self.stopped[seq] and self.count[seq] >= self.budgets[seq]:
                self.stopped[seq] = "length"
        return out

    def record(self, accepted: Sequence[int], drafted: Sequence[int], retained: Sequence[int]) -> None:
        """One verification's acceptance for every live row."""
        for seq, a, d, u in zip(self.batch, accepted, drafted, retained, strict=True):
            if not self.stopped[seq]:
                self.accepted[seq].append(a)
                self.drafted[seq].append(d)
                self.retained[seq].append(u)

    def retire(self, cache: PlaneCache) -> list[int]:
        """Note the cache bytes of the rows that stopped since the last call; returns the live rows' indices."""
        newly = [i for i, seq in enumerate(self.batch) if self.stopped[seq] and self.cache_bytes[seq] is None]
        if newly:
            nbytes = cache.row_bytes()
            for i in newly:
                self.cache_bytes[self.batch[i]] = nbytes[i]
        keep = [i for i, alive in enumerate(self.live) if alive]
        if keep:
            self.batch_per_pass.append(len(keep))
        return keep

    def result(self, cache: PlaneCache, forward_passes: int, pad_id: int | None, **options: object) -> Generation:
        self.bar.close()
        wall = time.perf_counter() - self.start
        sequences = [torch.cat([p, *new]) for p, new in zip(self.prompts, self.emitted, strict=True)]
        cache_bytes = [0 if b is None else b for b in self.cache_bytes]
        return Generation(sequences, [len(p) for p in self.prompts], wall, self.accepted, self.drafted,
                          self.retained, forward_passes, self.stopped, 0 if pad_id is None else pad_id,
                          policy=cache.policy.name, row_cache_bytes=cache_bytes,
                          allocated_bytes=cache.allocated_bytes, batch_per_pass=self.batch_per_pass, options=options)
