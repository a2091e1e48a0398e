"""looped_kv: KV planes, cache policies and self-speculative decoding for looped language models."""

from looped_kv.decoding.core import Generation
from looped_kv.decoding.generate import generate
from looped_kv.runtime.attention import CausalRouter, Site
from looped_kv.runtime.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.runtime.config import (
    LoopedConfig,
    huginn_0125,
    ouro_1_4b,
    ouro_2_6b,
    raven_llama,
    raven_olmo,
    raven_tinyllama,
)
from looped_kv.runtime.loading import load, save
from looped_kv.runtime.measurement import measurement_mode
from looped_kv.runtime.memory import m_deep, m_full, m_ripe, memory_table, policy_bytes
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, PrefixReads, make_policy, make_prefix_reads

__all__ = [
    "BlockBuffer", "BlockPass", "CachePolicy", "CausalRouter", "Generation", "LoopedConfig", "LoopedLM",
    "PlaneCache", "PrefixReads", "Site", "generate", "huginn_0125", "load", "m_deep", "m_full", "m_ripe",
    "make_policy", "make_prefix_reads", "measurement_mode", "memory_table", "ouro_1_4b", "ouro_2_6b", "policy_bytes",
    "raven_llama", "raven_olmo", "raven_tinyllama", "save",
]
__version__ = "0.1.0"
