"""How deep tokens go under adaptive depth (early exit, :mod:`looped_kv.decoding.exits`): for a batch of prompts,
the loop at which each emitted token exited and the mean loops per token, from greedy decoding with one exit rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from looped_kv.decoding.generate import generate
from looped_kv.runtime.model import LoopedLM


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
    return ExitProfile([row.tolist() for row in out.new_rows], out.row_loops, out.details["exit"]["num_loops"])
