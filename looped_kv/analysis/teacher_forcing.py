"""Teacher forcing through a cache policy: the one engine of the analysis layer's cached replays.

B trajectories (prompt plus generated tokens, any lengths) are replayed together exactly as sequential
decoding under a cache policy reads them (RIPE Section 2, "Generation" mode): the prompts are prefilled
(or their planes, recorded once by :func:`prompt_planes`, are stored), then generated token i of every
row is decoded at step i, each row at its own positions. On the way, at chosen steps:

* a *block check* (RIPE Sec. 5.2, Proposition 1): one batched verification pass over gamma + 1 tokens
  reads the same cache as the sequential steps that follow, its planes going to a scratch buffer
  (:meth:`TeacherForcing.check_block`; :meth:`TeacherForcing.commit_block` commits them as
  Algorithm 1 does);
* *draft read-outs* (DAS Table 6): before step i, d-loop drafts of the pending token read the cached
  prefix under prefix read policies (:func:`draft_readouts`).

:func:`force` runs that schedule; :mod:`looped_kv.analysis.measure` and :mod:`looped_kv.analysis.ripe`
build their measurements on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from looped_kv.decoding.core import (
    block_positions,
    new_buffer,
    new_cache,
    prompt_logits,
    run_block,
    step,
)
from looped_kv.runtime.cache import BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, PrefixReads, make_policy


def check_trajectories(trajectories: Sequence[Tensor], prompt_lengths: Sequence[int]) -> None:
    """Trajectories (1, n) with a prompt of at least one token and at least one generated token each."""
    if len(trajectories) == 0 or len(trajectories) != len(prompt_lengths):
        raise ValueError(f"trajectories and prompt_lengths must be non-empty and of equal length, got "
                         f"{len(trajectories)} and {len(prompt_lengths)}")
    for i, (tokens, p) in enumerate(zip(trajectories, prompt_lengths, strict=True)):
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"trajectories[{i}] must be (1, n), got shape {tuple(tokens.shape)}")
        if not 1 <= p < tokens.shape[1]:
            raise ValueError(f"prompt_lengths[{i}] must be in [1, {tokens.shape[1] - 1}], got {p}")


def check_depths(draft_loops: Sequence[int], num_loops: int) -> list[int]:
    """Draft depths d in [1, R], sorted and distinct."""
    depths = sorted(set(draft_loops))
    if not depths:
        raise ValueError("draft_loops must name at least one draft depth")
    for d in depths:
        if not isinstance(d, int | np.integer) or not 1 <= d <= num_loops:
            raise ValueError(f"draft_loops must be in [1, {num_loops}], got {d}")
    return depths


def block_starts(generated: int, gamma: int) -> range:
    """Offsets after the prompt of the verification blocks of ``gamma`` + 1 tokens that fit in ``generated`` tokens
    (RIPE Sec. 5.2: the trajectory cut into consecutive blocks)."""
    return range(0, generated - gamma, gamma + 1)


def tokens_after_prompt(sequences: Sequence[Tensor], prompt_lengths: Sequence[int], offset: int,
                        width: int = 1) -> Tensor:
    """Tokens ``offset .. offset + width - 1`` after each row's prompt (B, width); 0 past a row's end."""
    out = torch.zeros(len(sequences), width, dtype=torch.long, device=sequences[0].device)
    for b, (s, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        part = s[p + offset:p + offset + width]
        out[b, :len(part)] = part
    return out


def draft_readouts(model: LoopedLM, cache: PlaneCache, pending: Tensor, depths: Sequence[int],
                   reads: Mapping[object, PrefixReads]) -> dict[tuple[int, object], Tensor]:
    """Greedy d-loop drafts (B,) of the token after ``pending`` (B, 1), for every depth and prefix read.

    One forward per read runs the deepest depth and reads out the shallower ones on the way (``each_loop``): a
    d-loop draft is the first d loops of a deeper one, as a draft pass of d loops computes it. Nothing is stored.
    """
    out = {}
    for spec, read in reads.items():
        router = BlockPass(cache, block_positions(cache, 1), reads=read, store=None)

        def read_out(r: int, state: Tensor, spec: object = spec, router: BlockPass = router) -> None:
            if r in depths and r < max(depths):
                out[(r, spec)] = model.readout(state, router.positions, router, tokens=pending)[:, -1].argmax(-1)

        deepest = model(pending, max(depths), positions=router.positions, router=router, check=False,
                        max_position=router.last_position, each_loop=read_out)
        out[(max(depths), spec)] = deepest[:, -1].argmax(-1)
    return out


@dataclass(frozen=True)
class PromptPlanes:
    """The prompts of B trajectories processed once (:func:`prompt_planes`): every site's keys and values, which
    any cache policy can store, and the logits of each prompt's last position."""

    keys_values: dict  # Site -> (keys, values) of shape (B, Hkv, longest prompt, D)
    last_logits: Tensor  # (B, V)
    lengths: Tensor  # (B,) prompt lengths


class TeacherForcing:
    """B trajectories (1-d ``sequences`` and their ``prompt_lengths``) forced through one cache under ``policy``.

    ``capacity`` defaults to the longest prompt plus the most generated tokens; ``gamma`` (>= 0) allocates the
    scratch buffer of the block checks (gamma + 1 tokens).
    """

    def __init__(self, model: LoopedLM, policy: CachePolicy, sequences: Sequence[Tensor],
                 prompt_lengths: Sequence[int], *, gamma: int | None = None, capacity: int | None = None) -> None:
        self.model, self.policy = model, policy
        self.sequences, self.prompt_lengths = list(sequences), list(prompt_lengths)
        self.generated = [len(s) - p for s, p in zip(self.sequences, self.prompt_lengths, strict=True)]
        B = len(self.sequences)
        capacity = capacity or max(self.prompt_lengths) + max(self.generated)
        self.cache = new_cache(model, policy, B, capacity)
        self.buffer = new_buffer(model, policy.num_loops, B, gamma + 1) if gamma is not None else None

    def prefill(self, prompts: PromptPlanes | None = None, record: dict | None = None) -> Tensor:
        """Process the prompts (or store ``prompts``' planes); the logits of each prompt's last position (B, V)."""
        if prompts is None:
            return prompt_logits(self.model, self.cache, [s[:p] for s, p in zip(self.sequences, self.prompt_lengths,
                                                                               strict=True)],
                                 self.policy.num_loops, record)
        B, width = len(self.sequences), max(self.prompt_lengths)
        cache = self.cache
        writes = cache.plan_writes(torch.arange(width, device=cache.lengths.device).expand(B, -1), prompts.lengths)
        cache.write(writes, prompts.keys_values)
        cache.advance(prompts.lengths)
        return prompts.last_logits

    def tokens(self, offset: int, width: int = 1) -> Tensor:
        return tokens_after_prompt(self.sequences, self.prompt_lengths, offset, width)

    def step(self, offset: int) -> Tensor:
        """Decode generated token ``offset`` of every row (0 past a row's end), committing it; logits (B, 1, V)."""
        return step(self.model, self.cache, self.tokens(offset), self.policy.num_loops)

    def check_block(self, offset: int) -> Tensor:
        """One batched verification pass over generated tokens offset .. offset + gamma of every row, reading the
        cache as the next steps will; its planes go to the buffer. Logits (B, gamma + 1, V)."""
        n = self.buffer.capacity
        router = BlockPass(self.cache, block_positions(self.cache, n), buffer=self.buffer, store="buffer")
        logits, _ = run_block(self.model, self.tokens(offset, n), router, self.policy.num_loops)
        return logits

    def commit_block(self, counts: Tensor | int) -> None:
        """Commit each row's first ``counts`` tokens of the checked block from the buffer (RIPE Algorithm 1)."""
        self.cache.commit(self.buffer, counts)

    def readouts(self, offset: int, depths: Sequence[int], reads: Mapping[object, PrefixReads]) -> dict:
        """:func:`draft_readouts` of generated token ``offset`` of every row, from the cache as it is."""
        return draft_readouts(self.model, self.cache, self.tokens(offset), depths, reads)


@dataclass
class Forced:
    """What :func:`force` measured: the sequential logits of every row, the block checks' logits by offset, and the
    draft read-outs' hits (a draft equal to the next trajectory token) and drafted positions per row."""

    logits: Tensor  # (B, steps + 1, V): column i + 1 comes from decoding generated token i, column 0 from the prefill
    generated: list[int]
    blocks: dict[int, Tensor] = field(default_factory=dict)  # offset -> (B, gamma + 1, V)
    hits: dict[tuple[int, object], Tensor] = field(default_factory=dict)  # (d, read) -> (B,) on the host
    drafted: Tensor | None = None  # (B,) positions with a read-out

    def row_logits(self, b: int) -> Tensor:
        """Row b's logits predicting its generated tokens (generated, V)."""
        return self.logits[b, :self.generated[b]]


@torch.no_grad()
def force(model: LoopedLM, sequences: Sequence[Tensor], prompt_lengths: Sequence[int], policy: CachePolicy, *,
          gamma: int | None = None, depths: Sequence[int] = (), reads: Mapping[object, PrefixReads] | None = None,
          prompts: PromptPlanes | None = None) -> Forced:
    """Teacher-forced sequential replay of B trajectories (1-d ``sequences``) under ``policy``, rows together.

    With ``gamma``, each row's generated tokens are cut into verification blocks of gamma + 1 tokens
    (:func:`block_starts`) and a block check runs before each block's first step. With ``depths`` and ``reads``,
    before each step i that has a next token, d-loop drafts of generated token i read the cached prefix under each
    read and count as hits where they equal generated token i + 1 (``depths`` in the order given). ``prompts``
    (:func:`prompt_planes` of the same model and trajectories) stands in for the prefill.
    """
    engine = TeacherForcing(model, policy, sequences, prompt_lengths, gamma=gamma)
    generated = engine.generated
    starts = [block_starts(g, gamma) if gamma else range(0) for g in generated]
    last = max([g - 2 for g in generated] + [s[-1] + gamma for s in starts if len(s)])  # the last step's offset
    out = Forced(torch.empty(0), generated)
    steps = [engine.prefill(prompts)[:, None]]
    if reads:
        read_at = sorted(set(depths))
        out.hits = {(d, spec): torch.zeros(len(generated), dtype=torch.long) for d in depths for spec in reads}
        drafted = torch.tensor([max(g - 1, 0) for g in generated])
        out.drafted = drafted
    for i in range(last + 1):
        if gamma and any(i in s for s in starts):
            out.blocks[i] = engine.check_block(i)
        if reads:
            target = engine.tokens(i + 1)[:, 0].cpu()
            valid = i < drafted
            for key, draft in engine.readouts(i, read_at, reads).items():
                out.hits[key] += ((draft.cpu() == target) & valid).long()
        steps.append(engine.step(i))
    out.logits = torch.cat(steps, dim=1)
    return out


@torch.no_grad()
def prompt_planes(model: LoopedLM, trajectories: Sequence[Tensor], prompt_lengths: Sequence[int],
                  num_loops: int) -> PromptPlanes:
    """Process the prompts of ``trajectories`` (1, n) once and keep every site's keys and values.

    A prefill reads only the prompt itself, each loop at its own plane, so its keys, values and logits are
    the same under every cache policy; the policies differ only in what they keep. Replays of several arms
    of the same model share one prefill this way.
    """
    check_trajectories(trajectories, prompt_lengths)
    sequences = [t[0] for t in trajectories]
    engine = TeacherForcing(model, make_policy("full", num_loops), sequences, prompt_lengths,
                            capacity=max(prompt_lengths))
    record: dict = {}
    last = engine.prefill(record=record)
    return PromptPlanes(record, last, torch.tensor(list(prompt_lengths), device=engine.cache.lengths.device))
