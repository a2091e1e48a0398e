"""looped_kv: KV planes, cache policies and self-speculative decoding for looped language models.

The names below load on first use (PEP 562), so that ``import looped_kv`` and the command line start without
importing torch: a Ctrl-C while the command's modules load is then the command's to handle (one line, exit 130).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from looped_kv.decoding.generate import generate
    from looped_kv.decoding.result import Generation
    from looped_kv.decoding.stream import stream
    from looped_kv.runtime.attention import CausalRouter, Site
    from looped_kv.runtime.cache import BlockBuffer, CachePass, PlaneCache
    from looped_kv.runtime.config import (
        LoopedConfig,
        huginn_0125,
        ouro_1_4b,
        ouro_2_6b,
        parcae_1_3b,
        parcae_140m,
        parcae_370m,
        parcae_770m,
        raven_llama,
        raven_olmo,
        raven_tinyllama,
    )
    from looped_kv.runtime.loading import load, save
    from looped_kv.runtime.measurement import measurement_mode
    from looped_kv.runtime.memory import m_deep, m_full, m_ripe, memory_table, policy_bytes
    from looped_kv.runtime.model import LoopedLM
    from looped_kv.runtime.policy import CachePolicy, PrefixReads, make_policy, make_prefix_reads

#: Each public name and the module that defines it.
_SOURCES = {
    "looped_kv.decoding.result": ("Generation",), "looped_kv.decoding.generate": ("generate",),
    "looped_kv.decoding.stream": ("stream",),
    "looped_kv.runtime.attention": ("CausalRouter", "Site"),
    "looped_kv.runtime.cache": ("BlockBuffer", "CachePass", "PlaneCache"),
    "looped_kv.runtime.config": ("LoopedConfig", "huginn_0125", "ouro_1_4b", "ouro_2_6b", "parcae_140m", "parcae_370m",
                                 "parcae_770m", "parcae_1_3b", "raven_llama", "raven_olmo", "raven_tinyllama"),
    "looped_kv.runtime.loading": ("load", "save"), "looped_kv.runtime.measurement": ("measurement_mode",),
    "looped_kv.runtime.memory": ("m_deep", "m_full", "m_ripe", "memory_table", "policy_bytes"),
    "looped_kv.runtime.model": ("LoopedLM",),
    "looped_kv.runtime.policy": ("CachePolicy", "PrefixReads", "make_policy", "make_prefix_reads"),
}
_MODULE = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [
    "BlockBuffer", "CachePass", "CachePolicy", "CausalRouter", "Generation", "LoopedConfig", "LoopedLM",
    "PlaneCache", "PrefixReads", "Site", "generate", "huginn_0125", "load", "m_deep", "m_full", "m_ripe",
    "make_policy", "make_prefix_reads", "measurement_mode", "memory_table", "ouro_1_4b", "ouro_2_6b", "parcae_1_3b",
    "parcae_140m", "parcae_370m", "parcae_770m", "policy_bytes", "raven_llama", "raven_olmo", "raven_tinyllama", "save",
    "stream",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name not in _MODULE:
        raise AttributeError(f"module 'looped_kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
