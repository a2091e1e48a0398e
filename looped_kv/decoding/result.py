"""What a decoder returns: :class:`Generation`, the emitted tokens of B rows and the run's statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


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
