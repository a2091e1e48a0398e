"""Decoders. Each runs blocks of tokens through :class:`~looped_kv.runtime.cache.BlockPass` and differs
only in how it drafts and what it commits. Every decoder returns a :class:`Generation`.

Convention: the cache holds the planes of every processed token; the last emitted token is
*pending* (emitted, not yet processed), as in RIPE Algorithm 1 where x is the last token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from looped_kv.runtime.cache import BlockPass, PlaneCache
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy, make_prefix_reads


@dataclass
class Generation:
    """Emitted tokens and the run's statistics."""

    tokens: Tensor  # (B, prompt + new)
    prompt_length: int
    wall_time: float
    verifications: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification (A)
    drafted: list[int] = field(default_factory=list)  # draft tokens offered per verification
    retained: list[int] = field(default_factory=list)  # u_b: 1 if the verifier's own token is committed (DAS Eq. 10)
    forward_passes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> Tensor:
        return self.tokens[:, self.prompt_length:]

    @property
    def num_new(self) -> int:
        return self.tokens.shape[1] - self.prompt_length

    @property
    def tokens_per_s(self) -> float:
        return self.num_new * self.tokens.shape[0] / self.wall_time if self.wall_time > 0 else float("inf")

    @property
    def tau(self) -> float:
        """Tokens committed per verification: accepted drafts plus the verifier's token where it is kept."""
        committed = [a + u for a, u in zip(self.accepted, self.retained, strict=True)]
        return sum(committed) / len(committed) if committed else float("nan")

    @property
    def mean_accepted(self) -> float:
        """A: mean number of draft tokens accepted per verification (DAS Eq. 9)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")

    def stats(self) -> dict[str, float]:
        return {"new_tokens": self.num_new, "wall_time_s": self.wall_time, "tokens_per_s": self.tokens_per_s,
                "verifications": self.verifications, "tau": self.tau, "A": self.mean_accepted,
                "forward_passes": self.forward_passes}


def check_prompt(model: LoopedLM, input_ids: Tensor, max_new_tokens: int, margin: int = 0) -> Tensor:
    """Validate a prompt before any work is done; returns it as a (B, n) long tensor on the model's device."""
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (batch, length) with length >= 1, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    need = input_ids.shape[1] + max_new_tokens + margin
    if need > model.config.block_size:
        raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} (+{margin}) = {need} "
                         f"exceeds the model's context (block_size {model.config.block_size})")
    return input_ids.to(model.device)


def run_block(model: LoopedLM, tokens: Tensor, router: BlockPass, num_loops: int,
              initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One pass of ``tokens`` at ``router.positions`` through ``num_loops`` loops: (logits, final state)."""
    positions = torch.arange(router.positions.start, router.positions.stop, device=tokens.device)
    return model(tokens, num_loops, initial_state, positions=positions, router=router, return_state=True)


def new_cache(model: LoopedLM, policy: CachePolicy, batch: int, capacity: int) -> PlaneCache:
    return PlaneCache(model.config, policy, batch=batch, capacity=capacity, dtype=model.dtype, device=model.device)


def prefill(model: LoopedLM, cache: PlaneCache, prompt: Tensor, num_loops: int) -> Tensor:
    """Process the prompt into the cache; returns its logits."""
    n = prompt.shape[1]
    logits, _ = run_block(model, prompt, BlockPass(cache, range(0, n)), num_loops)
    cache.length = n
    return logits


def step(model: LoopedLM, cache: PlaneCache, tokens: Tensor, num_loops: int) -> Tensor:
    """Process ``tokens`` after the cache, storing their planes under the policy; returns logits."""
    start = cache.length
    logits, _ = run_block(model, tokens, BlockPass(cache, range(start, start + tokens.shape[1])), num_loops)
    cache.length += tokens.shape[1]
    return logits


@torch.no_grad()
def greedy(model: LoopedLM, input_ids: Tensor, max_new_tokens: int, *, policy: CachePolicy,
           progress: bool = False) -> Generation:
    """Greedy full-depth autoregressive decoding under a cache policy (the baseline of every ratio)."""
    prompt = check_prompt(model, input_ids, max_new_tokens)
    R = policy.num_loops
    start = time.perf_counter()
    cache = new_cache(model, policy, prompt.shape[0], prompt.shape[1] + max_new_tokens)
    token = prefill(model, cache, prompt, R)[:, -1:].argmax(-1)
    out = [token]
    for _ in tqdm(range(max_new_tokens - 1), disable=not progress, desc="greedy", leave=False):
        token = step(model, cache, token, R)[:, -1:].argmax(-1)
        out.append(token)
    tokens = torch.cat([prompt, *out], dim=1)
    return Generation(tokens, prompt.shape[1], time.perf_counter() - start, forward_passes=max_new_tokens,
                      extra={"cache_bytes": cache.nbytes, "policy": policy.name})


METHODS = ("ar", "self-spec", "mature-spec", "pld", "das-wave")


def generate(model: LoopedLM, input_ids: Tensor, *, max_new_tokens: int = 32, method: str = "ar",
             cache: str = "full", num_loops: int | None = None, window: int | None = None, k: int | None = None,
             sinks: int | None = None, draft_loops: int = 4, block: int | None = None,
             prefix_reads: str | tuple[int, int] | None = None, exact: bool = True, ngram: int = 3,
             rounds: int = 24, initial_width: int = 2, updates: int = 2, carry: bool = True,
             progress: bool = False) -> Generation:
    """Generate greedily with a looped model; every method returns a :class:`Generation`.

    ``method``:

    * ``"ar"``: greedy full-depth autoregressive decoding (the baseline of every ratio);
    * ``"self-spec"``: sequential self-speculative decoding, ``draft_loops`` (d) loops per draft,
      ``block`` (gamma, default 4) drafts per verification, drafts reading the prefix per
      ``prefix_reads`` (``"aligned"``, ``"deep-v"`` = Mature-V, ``"deep-k"``, ``"deep-kv"`` or a
      (kappa, nu) pair of planes); the default is ``"aligned"``, except with ``cache="ripe"``, where
      cached positions are read at plane R (``"deep-kv"``) as in RIPE Algorithm 1, line 3;
    * ``"mature-spec"``: self-spec with deep K/V prefix reads (DAS Section 4.1);
    * ``"pld"``: prompt lookup decoding, ``ngram``-gram drafts verified at full depth;
    * ``"das-wave"``: carried parallel refinement (DAS Section 3.3) with ``block`` (gamma, default
      32), ``rounds`` (J), ``initial_width`` (W_init), ``updates`` (k), ``carry`` and
      ``prefix_reads`` (default ``"deep-kv"``); the defaults are the paper's Huginn configuration.

    ``cache`` names the verifier's cache policy (:func:`looped_kv.runtime.policy.make_policy`): ``"full"``,
    ``"deepest"``, ``"ripe"`` with ``window``, ``"k-deepest"``/``"share"``/``"first"`` with ``k``,
    ``"sinks"``. Speculative methods require a block-independent cache (full, or RIPE with
    window >= block; RIPE Proposition 1) unless ``exact=False``. ``num_loops`` defaults to the
    model's mean recurrence (R = 32 for the shipped tiny model and the public checkpoints).
    """
    from looped_kv.decoding.das_wave import das_wave
    from looped_kv.decoding.speculative import prompt_lookup, self_speculative

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    R = model.config.mean_recurrence if num_loops is None else num_loops
    policy = make_policy(cache, R, window=window, k=k, sinks=sinks)
    if method == "ar":
        return greedy(model, input_ids, max_new_tokens, policy=policy, progress=progress)
    if method == "pld":
        return prompt_lookup(model, input_ids, max_new_tokens, policy=policy, block=4 if block is None else block,
                             ngram=ngram, exact=exact, progress=progress)
    deep = method in ("mature-spec", "das-wave") or cache == "ripe"  # RIPE Algorithm 1: drafts read plane R
    reads = make_prefix_reads(prefix_reads or ("deep-kv" if deep else "aligned"), R)
    if method == "das-wave":
        return das_wave(model, input_ids, max_new_tokens, policy=policy, block=32 if block is None else block,
                        rounds=rounds, initial_width=initial_width, updates=updates, carry=carry, reads=reads,
                        exact=exact, progress=progress)
    if method == "mature-spec" and reads != make_prefix_reads("deep-kv", R):
        raise ValueError("method='mature-spec' reads the prefix at deep K/V; use method='self-spec' with "
                         "prefix_reads for other read policies")
    return self_speculative(model, input_ids, max_new_tokens, policy=policy, draft_loops=draft_loops,
                            block=4 if block is None else block, reads=reads, exact=exact, progress=progress)
