"""Configuration of a looped (recurrent-depth) language model.

One dataclass covers the public families (the four checkpoints of the DAS paper):

* Huginn-0125 (``family="huginn"``): sandwich blocks, ``qk_bias``, rotary on
  adjacent pairs computed in float32, embeddings scaled by ``embed_scale``,
  ``ln_f`` after the recurrence and again after the coda, tied embeddings.
* Raven retrofits of Llama and TinyLlama (``family="raven"``): pre-norm blocks,
  grouped-query attention, Llama-3 rotary (rotate-half with ``rope_scaling``), no
  ``ln_f`` between recurrence and coda, an untied head.
* Raven retrofits of OLMo-2 (``family="raven-olmo"``): as Raven, but OLMo-2's
  reordered blocks (norms on the sublayer outputs), RMSNorm over the whole query and
  key projections before rotary, and plain rotate-half rotary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Family = Literal["huginn", "raven", "raven-olmo"]
FAMILIES: tuple[str, ...] = ("huginn", "raven", "raven-olmo")
BlockKind = Literal["sandwich", "pre-norm", "reordered"]


@dataclass(frozen=True)
class LoopedConfig:
    """Architecture of a looped model: prelude, a core run R times, coda (RIPE Eq. 1-2)."""

    family: Family
    vocab_size: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    n_prelude: int
    n_core: int
    n_coda: int
    intermediate_size: int
    block_size: int
    norm_eps: float = 1e-6
    qk_bias: bool = False
    rope_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    embed_scale: float = 1.0
    state_std: float = 0.02
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "n_embd", "n_heads", "n_kv_heads", "n_core", "intermediate_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.n_embd % self.n_heads:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    # -- derived facts -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def block(self) -> BlockKind:
        """The block's norm placement.

        ``"sandwich"`` (Huginn): ``x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x)))``;
        ``"pre-norm"`` (Raven-Llama): ``x = x + attn(n1(x)); x = x + mlp(n2(x))``;
        ``"reordered"`` (Raven-OLMo, OLMo-2's norms on the sublayer outputs): ``x = x + n1(attn(x));
        x = x + n2(mlp(x))``.
        """
        return {"huginn": "sandwich", "raven": "pre-norm", "raven-olmo": "reordered"}[self.family]

    @property
    def qk_norm(self) -> bool:
        """Raven-OLMo: RMSNorm over the whole query and key projections, before the heads split and rotary."""
        return self.family == "raven-olmo"

    @property
    def norm_after_recurrence(self) -> bool:
        """Huginn applies ``ln_f`` to the recurrent state before the coda; Raven does not."""
        return self.family == "huginn"

    @property
    def n_layers(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda

    def layer_passes(self, num_loops: int) -> int:
        """Layer passes of one forward with ``num_loops`` loops: c(r) = n_pre + r n_core + n_coda (RIPE Eq. 8)."""
        return self.n_prelude + num_loops * self.n_core + self.n_coda

    # -- the public checkpoint format ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], tensor_names: Iterable[str] = ()) -> LoopedConfig:
        """Read a ``config.json`` of Huginn-0125 or a Raven retrofit (``model_type: huginn_raven``).

        The family comes from the config (``looped_kv_family``, else the modeling file ``auto_map`` names) and,
        when the config names none, from ``tensor_names``, the checkpoint's tensors (see :func:`detect_family`).
        """
        if raw.get("model_type") not in (None, "huginn_raven"):
            raise ValueError(f"config.json model_type must be 'huginn_raven', got {raw.get('model_type')!r}")
        family = raw.get("looped_kv_family") or detect_family(raw, tensor_names)
        n_heads = _integer(raw, "n_heads", "num_attention_heads")
        init_values = raw.get("init_values", {})
        return cls(
            family=family,
            vocab_size=_integer(raw, "padded_vocab_size", "vocab_size"),
            n_embd=_integer(raw, "n_embd"),
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads", n_heads)),
            n_prelude=_integer(raw, "n_layers_in_prelude"),
            n_core=_integer(raw, "n_layers_in_recurrent_block"),
            n_coda=_integer(raw, "n_layers_in_coda"),
            intermediate_size=_integer(raw, "intermediate_size"),
            block_size=_integer(raw, "block_size", "max_position_embeddings"),
            norm_eps=float(raw.get("norm_eps", 1e-6)),
            qk_bias=bool(raw.get("qk_bias", False)),
            rope_base=float(raw.get("rope_theta", raw.get("rope_base", 10000.0))),
            rope_scaling=raw.get("rope_scaling"),
            embed_scale=float(init_values.get("embed_scale", 1.0)),
            state_std=float(init_values.get("std", 0.02)),
            tie_embeddings=bool(raw.get("tie_embeddings", raw.get("tie_word_embeddings", True))),
            mean_recurrence=_integer(raw, "mean_recurrence"),
            mean_backprop_depth=int(raw.get("mean_backprop_depth", 8)),
            extra=raw,
        )

    @classmethod
    def from_file(cls, path: str | Path, tensor_names: Iterable[str] = ()) -> LoopedConfig:
        """A ``config.json``; one-line ValueError naming the file (and the key) when it is not a valid config."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON ({error})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_hf_dict(raw, tensor_names)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` that ``from_hf_dict`` reads back (used for the shipped tiny model)."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        out = {
            "model_type": "huginn_raven",
            "looped_kv_family": d["family"],
            "vocab_size": d["vocab_size"],
            "padded_vocab_size": d["vocab_size"],
            "n_embd": d["n_embd"],
            "n_heads": d["n_heads"],
            "num_key_value_heads": d["n_kv_heads"],
            "n_layers_in_prelude": d["n_prelude"],
            "n_layers_in_recurrent_block": d["n_core"],
            "n_layers_in_coda": d["n_coda"],
            "intermediate_size": d["intermediate_size"],
            "block_size": d["block_size"],
            "norm_eps": d["norm_eps"],
            "qk_bias": d["qk_bias"],
            "rope_base": d["rope_base"],
            "init_values": {"embed_scale": d["embed_scale"], "std": d["state_std"]},
            "tie_embeddings": d["tie_embeddings"],
            "mean_recurrence": d["mean_recurrence"],
            "mean_backprop_depth": d["mean_backprop_depth"],
        }
        if d["rope_scaling"] is not None:
            out["rope_scaling"] = d["rope_scaling"]
            out["rope_theta"] = d["rope_base"]
        return out


def _integer(raw: dict[str, Any], *keys: str) -> int:
    """The first of ``keys`` the config has, as an int: no default, since the format defines none for these."""
    key = next((k for k in keys if k in raw), None)
    if key is None:
        raise ValueError(f"config has no {' or '.join(repr(k) for k in keys)}")
    value = raw[key]
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"config {key!r} must be an integer, got {value!r}")
    return int(value)


def detect_family(raw: dict[str, Any], tensor_names: Iterable[str] = ()) -> Family:
    """The family of a checkpoint's ``config.json`` and tensor names.

    The modeling file that ``auto_map`` names decides first (``raven_modeling_minimal_olmo``: Raven-OLMo;
    ``..._llama``: Raven); then ``attn.q_norm`` tensors (Raven-OLMo); then a Llama-style ``rope_theta`` or
    ``rope_scaling`` (Raven); else Huginn. A checkpoint whose tensors do not fit the family found is refused
    by :func:`looped_kv.runtime.loading.check_state`.
    """
    model_file = str(raw.get("auto_map", {}).get("AutoModelForCausalLM", "")).lower()
    if "olmo" in model_file:
        return "raven-olmo"
    if "llama" in model_file:
        return "raven"
    if any(name.endswith(".attn.q_norm.weight") for name in tensor_names):
        return "raven-olmo"
    if "rope_theta" in raw or raw.get("rope_scaling"):
        return "raven"
    return "huginn"


def huginn_0125() -> LoopedConfig:
    """Huginn-0125's published architecture (RIPE Section 2): 2/4/2 layers, 55 heads of width 96, R = 32."""
    return LoopedConfig(
        family="huginn", vocab_size=65536, n_embd=5280, n_heads=55, n_kv_heads=55, n_prelude=2, n_core=4,
        n_coda=2, intermediate_size=17920, block_size=4096, qk_bias=True, rope_base=50000.0,
        embed_scale=72.6636084983398, state_std=0.008703882797784892, mean_recurrence=32,
    )


def raven_llama() -> LoopedConfig:
    """Raven-Llama-3.2's architecture (RIPE Section 2): 4/6/4 layers, GQA with 8 KV heads of width 64, R = 32."""
    return LoopedConfig(
        family="raven", vocab_size=128256, n_embd=2048, n_heads=32, n_kv_heads=8, n_prelude=4, n_core=6,
        n_coda=4, intermediate_size=8192, block_size=131072, norm_eps=1e-5, rope_base=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_embeddings=False, mean_recurrence=32,
    )


def raven_olmo() -> LoopedConfig:
    """Raven-OLMo's architecture (DAS paper): OLMo-2-0425-1B retrofitted as 4/6/4 layers, 16 KV heads of width 128.

    The split is the public conversion script's (``convert_pretrained_model/convert_olmo.py`` of the
    retrofitting-recurrence code: prelude = OLMo-2 layers 0-3, core = layers 6-11, coda = layers 12-15); the
    widths, vocabulary, norm eps, rope_theta and context are OLMo-2-0425-1B's, which that script copies. R = 32
    as in the checkpoint ``smcleish/Recurrent-OLMo-2-0425-train-recurrence-32``.
    """
    return LoopedConfig(
        family="raven-olmo", vocab_size=100352, n_embd=2048, n_heads=16, n_kv_heads=16, n_prelude=4, n_core=6,
        n_coda=4, intermediate_size=8192, block_size=4096, norm_eps=1e-6, rope_base=500000.0,
        tie_embeddings=False, mean_recurrence=32,
    )
