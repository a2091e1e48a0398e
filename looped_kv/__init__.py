"""looped_kv: KV planes, cache policies and self-speculative decoding for looped language models."""

from looped_kv import reproducibility  # looped_kv.reproducibility.measurement_mode() after a bare `import looped_kv`
from looped_kv.attention import CausalRouter, Site
from looped_kv.cache import BlockBuffer, BlockPass, PlaneCache
from looped_kv.config import LoopedConfig, huginn_0125, raven_llama, raven_olmo
from looped_kv.decode import Generation, generate
from looped_kv.loading import load
from looped_kv.memory import m_deep, m_full, m_ripe, memory_table, policy_bytes
from looped_kv.model import LoopedLM
from looped_kv.policy import CachePolicy, PrefixReads, make_policy, make_prefix_reads

__all__ = [
    "BlockBuffer", "BlockPass", "CachePolicy", "CausalRouter", "Generation", "LoopedConfig", "LoopedLM",
    "PlaneCache", "PrefixReads", "Site", "generate", "huginn_0125", "load", "m_deep", "m_full", "m_ripe",
    "make_policy", "make_prefix_reads", "memory_table", "policy_bytes", "raven_llama", "raven_olmo", "reproducibility",
]
__version__ = "0.1.0"
