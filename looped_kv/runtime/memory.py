"""KV memory of looped models: RIPE Eq. (3) and Eq. (10), and any cache policy's bytes.

With b = 2 H_kv d_h x (bytes per element) bytes per layer per token (keys and values),
an L-token sequence needs

    M_full(L) = b L (n_pre + n_coda + R n_core)                        (Eq. 3)
    M_deep(L) = b L (n_pre + n_coda + n_core)                          (Eq. 3)
    M_RIPE(L) = M_deep(L) + b n_core (R - 1) min(W, L)                 (Eq. 10)

and in general b L (n_pre + n_coda + |kept| n_core) + b n_core |extra| (min(W, L) + min(sinks, L)).

With early exit (:mod:`looped_kv.decoding.exits`) the preallocated cache stores what it stores without it, some of its
slots holding copies: :func:`exit_bytes` counts the distinct planes, what a cache holding each plane once would need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.policy import CachePolicy, make_policy

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


def element_bytes(dtype: str | torch.dtype | int) -> int:
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if dtype not in BYTES:
        raise ValueError(f"dtype must be one of {tuple(BYTES)} or a torch dtype, got {dtype!r}")
    return BYTES[dtype]


def layer_token_bytes(config: LoopedConfig, dtype: str | torch.dtype | int = "bf16") -> int:
    """b: bytes of one layer's key and value for one token."""
    return 2 * config.n_kv_heads * config.head_dim * element_bytes(dtype)


def m_full(config: LoopedConfig, length: int, num_loops: int | None = None,
           dtype: str | torch.dtype | int = "bf16") -> int:
    """Eq. (3), full cache (R: ``num_loops``, default the config's mean recurrence)."""
    num_loops = config.mean_recurrence if num_loops is None else num_loops
    return layer_token_bytes(config, dtype) * length * (config.n_prelude + config.n_coda + num_loops * config.n_core)


def m_deep(config: LoopedConfig, length: int, dtype: str | torch.dtype | int = "bf16") -> int:
    """Eq. (3), deepest-plane cache."""
    return layer_token_bytes(config, dtype) * length * (config.n_prelude + config.n_coda + config.n_core)


def m_ripe(config: LoopedConfig, length: int, window: int, num_loops: int | None = None,
           dtype: str | torch.dtype | int = "bf16") -> int:
    """Eq. (10), RIPE(W) (R: ``num_loops``, default the config's mean recurrence)."""
    num_loops = config.mean_recurrence if num_loops is None else num_loops
    b = layer_token_bytes(config, dtype)
    return m_deep(config, length, dtype) + b * config.n_core * (num_loops - 1) * min(window, length)


def policy_bytes(config: LoopedConfig, policy: CachePolicy, length: int,
                 dtype: str | torch.dtype | int = "bf16") -> int:
    """Bytes any cache policy stores for an L-token sequence."""
    b = layer_token_bytes(config, dtype)
    per_token = config.n_prelude + config.n_coda + len(policy.kept) * config.n_core
    full_depth = min(policy.window, length) + min(policy.sinks, length) if policy.extra else 0
    return b * (length * per_token + config.n_core * len(policy.extra) * full_depth)


def memory_table(configs: dict[str, LoopedConfig], length: int = 1024, num_loops: int | None = None,
                 dtype: str = "bf16") -> list[dict]:
    """RIPE Table 2: MB (10^6 bytes) per sequence and fraction of the full cache, from the configs alone
    (R: ``num_loops``, default each config's mean recurrence)."""
    rows = [("full", {}), ("deepest plane", {"cache": "deepest"}), ("two planes", {"cache": "k-deepest", "k": 2}),
            ("RIPE, W = 16", {"cache": "ripe", "window": 16}), ("RIPE, W = 64", {"cache": "ripe", "window": 64}),
            ("RIPE, W = 256", {"cache": "ripe", "window": 256})]
    table = []
    for label, spec in rows:
        row: dict = {"cache": label}
        params = {key: value for key, value in spec.items() if key != "cache"}
        for model, config in configs.items():
            loops = config.mean_recurrence if num_loops is None else num_loops
            mb = policy_bytes(config, make_policy(spec.get("cache", "full"), loops, **params), length, dtype) / 1e6
            row[f"{model} MB"] = mb
            row[f"{model} frac."] = mb / (m_full(config, length, num_loops, dtype) / 1e6)
        table.append(row)
    return table


def exited_planes(policy: CachePolicy, exit_loop: int, exited_reads: str = "last", full_depth: bool = False) -> int:
    """Distinct core planes, per core layer, that a cache under ``policy`` holds for one position whose token exited
    after loop ``exit_loop`` (:mod:`looped_kv.decoding.exits`): the kept planes at or below it, and under
    ``"last"`` one copy of plane ``exit_loop`` where the policy does not keep it but keeps a deeper plane. A
    ``full_depth`` position (in the window or among the sinks of a policy that has them) holds planes 1..R: its
    distinct planes are 1..``exit_loop``."""
    if full_depth:
        return exit_loop
    below = sum(p <= exit_loop for p in policy.kept)
    copy = exited_reads == "last" and exit_loop not in policy.kept and max(policy.kept) > exit_loop
    return below + copy


def exit_bytes(config: LoopedConfig, policy: CachePolicy, exit_loops: Sequence[int], exited_reads: str = "last",
               dtype: str | torch.dtype | int = "bf16") -> int:
    """Bytes of the distinct planes a cache under ``policy`` holds for one row whose L stored positions' tokens exited
    after ``exit_loops`` (one per position, in order; R: no early exit): every prelude and coda plane, and
    :func:`exited_planes` per core layer, the last min(W, L) and the first min(sinks, L) positions at full depth where
    the policy has a window or sinks. With no early exit it is :func:`policy_bytes` when the window and the sinks do
    not overlap (that count holds an overlapping position twice, as the cache does)."""
    L, W, S = len(exit_loops), policy.window, policy.sinks
    planes = sum(exited_planes(policy, e, exited_reads, bool(policy.extra) and (j >= L - W or j < S))
                 for j, e in enumerate(exit_loops))
    return layer_token_bytes(config, dtype) * (L * (config.n_prelude + config.n_coda) + config.n_core * planes)
