"""Teacher forcing: given trajectories replayed through the one decode loop, as sequential decoding reads them.

B trajectories (prompt plus generated tokens, any lengths) are decoded by :func:`~looped_kv.decoding.loop.decode`
under a cache policy with :class:`ForcedTokens` as its sampler: every token it picks is the trajectory's own, so
generated token i of every row is processed at step i, each row at its own positions, reading the cache exactly as
decoding under that policy does (RIPE Section 2, "Generation" mode). Observers measure on the way:

* a *block check* (RIPE Sec. 5.2, Proposition 1), :class:`BlockChecks`: before the steps of a verification block,
  one batched pass over its gamma + 1 tokens reads the same cache as those steps, its planes going to a scratch
  buffer;
* *draft read-outs* (DAS Table 6), :class:`DraftHits`: before each step, d-loop drafts of the pending token read
  the cached prefix under prefix read policies (:func:`draft_readouts`) and are compared with the next token.

:func:`force` runs that schedule; :mod:`looped_kv.analysis.measure` and :mod:`looped_kv.analysis.ripe` build
their measurements on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from looped_kv.decoding.loop import DecodeView, LogitsRecorder, Observer, Observers, Outcome, decode
from looped_kv.decoding.passes import new_buffer, new_cache, pass_positions, prompt_logits, run_pass
from looped_kv.decoding.sampling import Pick, Sampler
from looped_kv.runtime.cache import CachePass, PlaneCache
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


def draft_readouts(model: LoopedLM, cache: PlaneCache, pending: Tensor, depths: Sequence[int],
                   reads: Mapping[object, PrefixReads]) -> dict[tuple[int, object], Tensor]:
    """Greedy d-loop drafts (B,) of the token after ``pending`` (B, 1), for every depth and prefix read.

    One forward per read runs the deepest depth and reads out the shallower ones on the way (``each_loop``): a
    d-loop draft is the first d loops of a deeper one, as a draft pass of d loops computes it. Nothing is stored.
    """
    out = {}
    for spec, read in reads.items():
        router = CachePass(cache, pass_positions(cache, 1), reads=read, store=None)

        def read_out(r: int, state: Tensor, spec: object = spec, router: CachePass = router) -> None:
            if r in depths and r < max(depths):
                out[(r, spec)] = model.readout(state, router.positions, router, tokens=pending)[:, -1].argmax(-1)

        deepest = model(pending, max(depths), positions=router.positions, router=router, check=False,
                        max_position=router.last_position, each_loop=read_out)
        out[(max(depths), spec)] = deepest[:, -1].argmax(-1)
    return out


class ForcedTokens(Sampler):
    """Teacher forcing as the decode loop's sampler: the token it picks at a row's position t is the row's
    trajectory token t (0 past its end), whatever the logits, so greedy decoding replays the trajectories."""

    def __init__(self, sequences: Sequence[Tensor]) -> None:
        super().__init__()
        self.sequences = list(sequences)
        self.forced: Tensor | None = None  # (B, positions) of the rows still in the batch

    def start(self, cache: PlaneCache) -> None:
        super().start(cache)
        self.forced = torch.zeros(cache.batch, 2 * cache.capacity + 2, dtype=torch.long, device=cache.lengths.device)
        for b, s in enumerate(self.sequences):
            self.forced[b, :len(s)] = s

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        self.forced = self.forced[rows]

    def first(self, logits: Tensor) -> Tensor:
        return forced(logits[:, None], self.forced, self.cache.lengths, 0)

    def drafting(self, offset: int) -> Pick:
        return forced_drafts, (self.forced, self.cache.lengths, offset)

    def verifying(self, drafts: Tensor, q: Tensor | None, lengths: Tensor | None) -> Pick:
        return forced, (self.forced, self.cache.lengths, 1)


def forced(logits: Tensor, tokens: Tensor, lengths: Tensor, offset: int) -> Tensor:
    """The trajectories' ``tokens`` (B, positions) at the n positions from ``offset`` past each row's ``lengths``,
    whatever the ``logits`` (B, n, V)."""
    return tokens.gather(1, lengths[:, None] + offset + torch.arange(logits.shape[1], device=lengths.device))


def forced_drafts(logits: Tensor, tokens: Tensor, lengths: Tensor, offset: int) -> tuple[Tensor, None]:
    """:func:`forced` as drafts, with no distribution."""
    return forced(logits, tokens, lengths, offset), None


class BlockChecks(Observer):
    """RIPE Sec. 5.2's block check before the steps at each of ``starts`` (per row, offsets after its prompt): one
    batched verification pass over the row's next gamma + 1 trajectory tokens reads the cache the steps will read,
    its planes going to a scratch buffer. ``blocks[row][offset]`` is its logits (gamma + 1, V)."""

    def __init__(self, sequences: Sequence[Tensor], prompt_lengths: Sequence[int], gamma: int,
                 starts: Sequence[range]) -> None:
        self.sequences, self.prompt_lengths, self.gamma, self.starts = sequences, prompt_lengths, gamma, starts
        self.blocks: list[dict[int, Tensor]] = [{} for _ in sequences]
        self.offset = 0

    def proposing(self, view: DecodeView) -> None:
        offset, n = self.offset, self.gamma + 1
        self.offset += 1
        if not any(offset in self.starts[row] for row in view.rows):
            return
        tokens = torch.zeros(len(view.rows), n, dtype=torch.long, device=view.pending.device)
        for i, row in enumerate(view.rows):
            part = self.sequences[row][self.prompt_lengths[row] + offset:][:n]
            tokens[i, :len(part)] = part
        R = view.cache.policy.num_loops
        router = CachePass(view.cache, pass_positions(view.cache, n),
                           buffer=new_buffer(view.model, R, len(view.rows), n), store="buffer")
        logits, _ = run_pass(view.model, tokens, router, R)
        for i, row in enumerate(view.rows):
            if offset in self.starts[row]:
                self.blocks[row][offset] = logits[i]


class DraftHits(Observer):
    """Counts, per row, the positions where a d-loop draft of the pending token (reading the cached prefix per each
    read, :func:`draft_readouts`) predicts the token the row emits next (DAS Table 6)."""

    def __init__(self, depths: list[int], reads: Mapping[object, PrefixReads], rows: int) -> None:
        self.depths, self.reads = depths, reads
        self.hits = {(d, spec): np.zeros(rows, dtype=np.int64) for d in depths for spec in reads}
        self.positions = np.zeros(rows, dtype=np.int64)
        self.drafts: dict = {}

    def proposing(self, view: DecodeView) -> None:
        self.drafts = draft_readouts(view.model, view.cache, view.pending, self.depths, self.reads)

    def verified(self, view: DecodeView, logits: Tensor, outcome: Outcome) -> None:
        rows = np.asarray(view.rows)[np.asarray(view.live)]
        live = torch.tensor(view.live, device=outcome.pending.device)
        for key, draft in self.drafts.items():
            self.hits[key][rows] += (draft == outcome.pending[:, 0])[live].cpu().numpy()
        self.positions[rows] += 1


@dataclass(frozen=True)
class PromptPlanes:
    """The prompts of B trajectories processed once (:func:`prompt_planes`): every site's keys and values, which
    any cache policy can store, and the logits of each prompt's last position."""

    keys_values: dict  # Site -> (keys, values) of shape (B, Hkv, longest prompt, D)
    last_logits: Tensor  # (B, V)
    lengths: Tensor  # (B,) prompt lengths

    def store(self, cache: PlaneCache) -> Tensor:
        """Store the planes as ``cache``'s policy keeps them (the decode loop's prefill); the last logits (B, V)."""
        B, width = cache.batch, int(self.lengths.max())
        writes = cache.plan_writes(torch.arange(width, device=cache.lengths.device).expand(B, -1), self.lengths)
        cache.write(writes, self.keys_values)
        cache.advance(self.lengths)
        return self.last_logits


@dataclass
class Forced:
    """What :func:`force` measured: each row's sequential logits (from its prompt's last position on), the block
    checks' logits per row and offset, and the draft read-outs' hits (a draft equal to the next trajectory token) and
    drafted positions per row."""

    rows: list[Tensor]  # row b: (steps + 1, V); entry i + 1 comes from decoding generated token i, entry 0 the prefill
    generated: list[int]
    blocks: list[dict[int, Tensor]] = field(default_factory=list)  # row -> offset -> (gamma + 1, V)
    hits: dict[tuple[int, object], Tensor] = field(default_factory=dict)  # (d, read) -> (B,) on the host
    drafted: Tensor | None = None  # (B,) positions with a read-out

    def row_logits(self, b: int) -> Tensor:
        """Row b's logits predicting its generated tokens (generated, V)."""
        return self.rows[b][:self.generated[b]]

    def sequential(self, b: int, offset: int, n: int) -> Tensor:
        """Row b's sequential logits of generated tokens ``offset`` .. ``offset`` + n - 1 (n, V): what its block
        check at ``offset`` computes in one pass."""
        return self.rows[b][offset + 1:offset + 1 + n]


@torch.no_grad()
def force(model: LoopedLM, sequences: Sequence[Tensor], prompt_lengths: Sequence[int], policy: CachePolicy, *,
          gamma: int | None = None, depths: Sequence[int] = (), reads: Mapping[object, PrefixReads] | None = None,
          prompts: PromptPlanes | None = None) -> Forced:
    """Teacher-forced sequential replay of B trajectories (1-d ``sequences``) under ``policy``, rows together: the
    decode loop with :class:`ForcedTokens`.

    With ``gamma``, each row's generated tokens are cut into verification blocks of gamma + 1 tokens
    (:func:`block_starts`) and a block check runs before each block's first step (:class:`BlockChecks`). Or with
    ``depths`` and ``reads``, before each step i that has a next token, d-loop drafts of generated token i read the
    cached prefix under each read and count as hits where they equal generated token i + 1 (:class:`DraftHits`).
    ``prompts`` (:func:`prompt_planes` of the same model and trajectories) stands in for the prefill.
    """
    if gamma and reads:
        raise ValueError("force checks blocks (gamma) or reads drafts out (depths and reads), not both in one run")
    generated = [len(s) - p for s, p in zip(sequences, prompt_lengths, strict=True)]
    starts = [block_starts(g, gamma) if gamma else range(0) for g in generated]
    # a row's budget: its generated tokens, or more where a block check needs the step of its last token
    budgets = [max(g, s[-1] + gamma + 2) if len(s) else g for g, s in zip(generated, starts, strict=True)]
    recorder, observers = LogitsRecorder(), []
    if gamma:
        observers.append(BlockChecks(sequences, prompt_lengths, gamma, starts))
    if reads:
        observers.append(DraftHits(sorted(set(depths)), reads, len(sequences)))
    decode(model, [s[:p] for s, p in zip(sequences, prompt_lengths, strict=True)], budgets, policy=policy,
           sampler=ForcedTokens(sequences), observer=Observers(recorder, *observers),
           prefill=None if prompts is None else prompts.store)
    out = Forced([recorder.logits(b) for b in range(len(sequences))], generated)
    if gamma:
        out.blocks = observers[0].blocks
    if reads:
        drafts = observers[0]
        out.hits = {(d, spec): torch.from_numpy(drafts.hits[(d, spec)]) for d in depths for spec in reads}
        out.drafted = torch.tensor([max(g - 1, 0) for g in generated])
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
    cache = new_cache(model, make_policy("full", num_loops), len(trajectories), max(prompt_lengths))
    record: dict = {}
    last = prompt_logits(model, cache, [t[0, :p] for t, p in zip(trajectories, prompt_lengths, strict=True)],
                         num_loops, record)
    return PromptPlanes(record, last, torch.tensor(list(prompt_lengths), device=cache.lengths.device))
