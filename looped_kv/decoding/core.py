"""The pieces every decoder shares: prompts checked and prefilled, block passes, acceptance, rows and results.

Convention (RIPE Algorithm 1): the cache holds the planes of every processed token; each row's
last emitted token is *pending* (emitted, not yet processed). A decoder prefills B prompts of
any lengths (right-padded; padding is never stored nor read), then runs blocks of (B, n) tokens
through :class:`~looped_kv.runtime.cache.BlockPass`; rows accept and commit their own counts, and
a row stops at its token budget or after emitting the end-of-text token (:class:`Rows`). The one
decode loop that does this for every method is :func:`looped_kv.decoding.loop.decode`; every decoder
returns a :class:`Generation`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy


@dataclass
class Generation:
    """Emitted tokens of B rows and the run's statistics (pooled over rows, per row where it says so)."""

    sequences: list[Tensor]  # per row: prompt + new tokens, 1-d
    prompt_lengths: list[int]
    wall_time: float
    row_accepted: list[list[int]] = field(default_factory=list)  # per row: drafts accepted per verification (A)
    row_drafted: list[list[int]] = field(default_factory=list)  # per row: drafts offered per verification
    row_retained: list[list[int]] = field(default_factory=list)  # per row: 1 if the verifier's token is kept (Eq. 10)
    forward_passes: int = 0
    stopped: list[str] = field(default_factory=list)  # per row: "eos" or "length"
    pad_id: int = 0
    policy: str = ""  # the cache policy's name
    row_cache_bytes: list[int] = field(default_factory=list)  # per row: the bytes its cache held when it stopped
    allocated_bytes: int = 0  # the bytes the cache allocated (decoded in chunks: the largest chunk's)
    batch_per_pass: list[int] = field(default_factory=list)  # live rows per verification
    options: dict[str, object] = field(default_factory=dict)  # the method's options (Drafter.options)
    row_loops: list[list[int]] = field(default_factory=list)  # with early exit, per row: loops that chose each token
    exit: dict[str, object] | None = None  # with early exit: the rule (ExitRule.options)
    row_distinct_cache_bytes: list[int] = field(default_factory=list)  # early exit, per row: distinct planes' bytes

    @property
    def batch(self) -> int:
        return len(self.sequences)

    @property
    def cache_bytes(self) -> int:
        """The bytes every row's cache held when it stopped (:mod:`looped_kv.runtime.memory`'s equations)."""
        return sum(self.row_cache_bytes)

    @property
    def distinct_cache_bytes(self) -> int:
        """With early exit, the bytes of the distinct planes the rows stored (an exited token's copies counted once)."""
        return sum(self.row_distinct_cache_bytes)

    @property
    def prompt_length(self) -> int:
        """The prompt length, when every row's prompt has the same one."""
        if len(set(self.prompt_lengths)) != 1:
            raise ValueError(f"rows have prompts of different lengths {self.prompt_lengths}")
        return self.prompt_lengths[0]

    def _padded(self, rows: list[Tensor]) -> Tensor:
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=rows[0].device)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out

    @property
    def tokens(self) -> Tensor:
        """(B, longest) prompt + new tokens, right-padded with ``pad_id``."""
        return self._padded(self.sequences)

    @property
    def new_rows(self) -> list[Tensor]:
        return [s[n:] for s, n in zip(self.sequences, self.prompt_lengths, strict=True)]

    @property
    def new_tokens(self) -> Tensor:
        """(B, longest) new tokens, right-padded with ``pad_id``."""
        return self._padded(self.new_rows)

    @property
    def num_new(self) -> int:
        """New tokens over all rows."""
        return sum(len(r) for r in self.new_rows)

    @property
    def accepted(self) -> list[int]:
        """Drafts accepted per verification, pooled over rows (row by row)."""
        return [a for row in self.row_accepted for a in row]

    @property
    def drafted(self) -> list[int]:
        return [d for row in self.row_drafted for d in row]

    @property
    def retained(self) -> list[int]:
        return [u for row in self.row_retained for u in row]

    @property
    def verifications(self) -> int:
        return len(self.accepted)

    @property
    def tokens_per_s(self) -> float:
        return self.num_new / self.wall_time if self.wall_time > 0 else float("inf")

    @property
    def tau(self) -> float:
        """Tokens committed per verification: accepted drafts plus the verifier's token where it is kept."""
        committed = [a + u for a, u in zip(self.accepted, self.retained, strict=True)]
        return sum(committed) / len(committed) if committed else float("nan")

    @property
    def mean_loops(self) -> float:
        """Mean loops per emitted token with early exit (:mod:`looped_kv.decoding.exits`): the loop whose readout
        chose each token, averaged over every row's tokens (NaN without early exit)."""
        loops = [r for row in self.row_loops for r in row]
        return sum(loops) / len(loops) if loops else float("nan")

    @property
    def mean_accepted(self) -> float:
        """A: mean number of draft tokens accepted per verification (DAS Eq. 9)."""
        accepted = self.accepted
        return sum(accepted) / len(accepted) if accepted else float("nan")

    @classmethod
    def concat(cls, parts: Sequence[Generation]) -> Generation:
        """The rows of several runs, in order, as one run (a batch decoded in row chunks): per-row lists are
        joined, counts and times added, and the cache's allocation is the largest one chunk held."""
        if len({p.pad_id for p in parts}) != 1 or len({p.policy for p in parts}) != 1:
            raise ValueError("parts must share one pad id and one cache policy")
        joined = {name: [x for p in parts for x in getattr(p, name)]
                  for name in ("sequences", "prompt_lengths", "row_accepted", "row_drafted", "row_retained", "stopped",
                               "row_cache_bytes", "batch_per_pass", "row_loops", "row_distinct_cache_bytes")}
        first = parts[0]
        return cls(**joined, wall_time=sum(p.wall_time for p in parts),
                   forward_passes=sum(p.forward_passes for p in parts), pad_id=first.pad_id, policy=first.policy,
                   allocated_bytes=max(p.allocated_bytes for p in parts), options=first.options, exit=first.exit)

    def stats(self) -> dict[str, float]:
        """The run's statistics; ``loops_per_token`` (:attr:`mean_loops`) with early exit."""
        stats = {"new_tokens": self.num_new, "wall_time_s": self.wall_time, "tokens_per_s": self.tokens_per_s,
                 "verifications": self.verifications, "tau": self.tau, "A": self.mean_accepted,
                 "forward_passes": self.forward_passes}
        return {**stats, "loops_per_token": self.mean_loops} if self.row_loops else stats


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


def new_cache(model: LoopedLM, policy: CachePolicy, batch: int, capacity: int) -> PlaneCache:
    return PlaneCache(model.config, policy, batch=batch, capacity=capacity, dtype=model.dtype, device=model.device)


def new_buffer(model: LoopedLM, num_loops: int, batch: int, capacity: int) -> BlockBuffer:
    return BlockBuffer(model.config, num_loops, batch=batch, capacity=capacity, dtype=model.dtype, device=model.device)


def capacity_buckets(block_size: int, smallest: int = 64) -> list[int]:
    """The capacities a compiled run may allocate: powers of two from ``smallest`` and 1.5 times each (64, 96, 128,
    192, 256, ...), then the model's context. A run pads its cache to the next one, and a compiled step attends
    over the whole capacity: the 1.5 steps keep that padding under a third of it at a trace per step."""
    buckets = [smallest]
    while buckets[-1] < block_size:
        b = buckets[-1]
        buckets.append(b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3)
    return [b for b in buckets if b < block_size] + [block_size]


def capacity_bucket(need: int, block_size: int, smallest: int = 64) -> int:
    """The capacity a compiled run allocates for ``need`` positions: the first of :func:`capacity_buckets` that holds
    them, so that runs of nearby lengths share one traced step."""
    return next((b for b in capacity_buckets(block_size, smallest) if b >= need), block_size)


def block_positions(cache: PlaneCache, n: int, offset: int = 0) -> range | Tensor:
    """Positions of a block of n tokens after each row's committed prefix (and ``offset`` uncommitted ones)."""
    if len(set(cache.host_lengths)) == 1:
        start = cache.host_lengths[0] + offset
        return range(start, start + n)
    return cache.lengths[:, None] + offset + torch.arange(n, device=cache.lengths.device)


def run_block(model: LoopedLM, tokens: Tensor, router: BlockPass, num_loops: int,
              initial_state: Tensor | None = None, *, first_loop: int = 1) -> tuple[Tensor, Tensor]:
    """One pass of ``tokens`` (B, n) at ``router.positions`` through ``num_loops`` loops: (logits, final state)."""
    return model(tokens, num_loops, initial_state, positions=router.positions, router=router, first_loop=first_loop,
                 return_state=True, max_position=router.last_position, check=False)


def check_empty(cache: PlaneCache) -> None:
    """A prefill's cache must hold no tokens yet: a one-line ValueError otherwise."""
    if cache.max_length:
        raise ValueError(f"prefill needs an empty cache, got rows of lengths {cache.host_lengths}")


def prefill(model: LoopedLM, cache: PlaneCache, prompt: Tensor, num_loops: int,
            lengths: Tensor | None = None, record: dict | None = None) -> Tensor:
    """Process prompts (B, n) into an empty cache; returns their logits (B, n, V).

    With ``lengths`` (B,), row b's prompt is its first lengths[b] tokens (right padding is never stored); with
    ``record``, every attention call's keys/values are kept in it too.
    """
    check_empty(cache)
    n = prompt.shape[1]
    router = BlockPass(cache, range(0, n), counts=lengths, record=record)
    logits, _ = run_block(model, prompt, router, num_loops)
    cache.advance(n if lengths is None else lengths)
    return logits


def pad_prompts(prompts: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
    """Right-padded prompts (B, longest) and their lengths (B,), None when every prompt has the same length."""
    lengths = [len(p) for p in prompts]
    n = max(lengths)
    ids = torch.stack([torch.nn.functional.pad(p, (0, n - len(p))) for p in prompts])
    return ids, None if len(set(lengths)) == 1 else torch.tensor(lengths, device=ids.device)


def prompt_logits(model: LoopedLM, cache: PlaneCache, prompts: Sequence[Tensor], num_loops: int,
                  record: dict | None = None) -> Tensor:
    """Prefill B prompts of any lengths; returns the logits of each prompt's last position (B, V)."""
    ids, counts = pad_prompts(prompts)
    return last_logits(prefill(model, cache, ids, num_loops, counts, record), prompts)


def last_logits(logits: Tensor, prompts: Sequence[Tensor]) -> Tensor:
    """Each prompt's logits at its own last position (B, V), of the right-padded prompts' logits (B, n, V)."""
    last = torch.tensor([len(p) for p in prompts], device=logits.device) - 1
    return logits[torch.arange(len(prompts), device=logits.device), last]


def step(model: LoopedLM, cache: PlaneCache, tokens: Tensor, num_loops: int) -> Tensor:
    """Process ``tokens`` (B, n) after each row's prefix, committing their planes; returns logits (B, n, V)."""
    router = BlockPass(cache, block_positions(cache, tokens.shape[1]))
    logits, _ = run_block(model, tokens, router, num_loops)
    cache.advance(tokens.shape[1])
    return logits


def accept(drafts: Tensor, targets: Tensor, lengths: Tensor | None = None) -> Tensor:
    """(B,) longest prefix of each row of ``drafts`` (B, n) equal to the verifier's ``targets`` (B, >= n).

    ``lengths`` (B,) caps rows whose drafts are shorter than n (the rest is padding).
    """
    n = drafts.shape[1]
    if n == 0:
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    mismatch = drafts != targets[:, :n]
    if lengths is not None:
        mismatch |= torch.arange(n, device=drafts.device) >= lengths[:, None]
    return torch.where(mismatch.any(1), mismatch.int().argmax(1), n)


class Rows:
    """Which prompt each row of the batch is, what each emitted, and when each stops (budget or end-of-text).

    ``batch`` lists the prompt of every row the decoder still computes; a stopped row either leaves it
    (:meth:`drop_stopped`, the eager decoders: it stops costing work) or stays as padding whose results are
    ignored (:meth:`retire`, the compiled decoders: the batch keeps its shape, so no step is traced again).
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

    def drop_stopped(self, cache: PlaneCache, *tensors: Tensor, buffer: BlockBuffer | None = None) -> list[Tensor]:
        """Drop the rows that stopped from the cache (and buffer); returns ``tensors`` for the remaining rows."""
        keep = self.retire(cache)
        if len(keep) < len(self.batch):
            self.batch = [self.batch[i] for i in keep]
            if keep:
                cache.keep_rows(keep)
                if buffer is not None:
                    buffer.keep_rows(len(keep))
            tensors = tuple(t[keep] for t in tensors)
        return list(tensors)

    def result(self, cache: PlaneCache, forward_passes: int, pad_id: int | None, **options: object) -> Generation:
        self.bar.close()
        wall = time.perf_counter() - self.start
        sequences = [torch.cat([p, *new]) for p, new in zip(self.prompts, self.emitted, strict=True)]
        cache_bytes = [0 if b is None else b for b in self.cache_bytes]
        return Generation(sequences, [len(p) for p in self.prompts], wall, self.accepted, self.drafted,
                          self.retained, forward_passes, self.stopped, 0 if pad_id is None else pad_id,
                          policy=cache.policy.name, row_cache_bytes=cache_bytes,
                          allocated_bytes=cache.allocated_bytes, batch_per_pass=self.batch_per_pass, options=options)
