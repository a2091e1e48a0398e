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
* Ouro (``family="ouro"``, ByteDance's Ouro-1.4B and -2.6B, ``model_type: ouro``): no prelude,
  coda nor input injection: the whole stack is the core, run ``total_ut_steps`` times from the
  token embedding; every loop ends with the final norm, whose output is the next loop's input and
  what the head reads; blocks with a norm before and after each sublayer (four per block);
  rotate-half rotary; an exit gate per loop (:mod:`looped_kv.runtime.exit_gate`).
* Parcae (``family="parcae"``, SandyResearch's parcae-140m ... -1.3b; config.json with ``_class_name:
  "ParcaeConfig"`` and no ``model_type``): plain pre-norm blocks with a ReLU^2 MLP, ``ln_prelude`` after the
  prelude, the diagonal injection s <- s exp(-dt A) + dt (e B^T) at every loop with no norm inside the loop, ``C``
  after the last loop, adjacent-pair rotary followed by a parameter-free QK norm per head, and gated value
  embeddings in every second layer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Family = Literal["huginn", "raven", "raven-olmo", "ouro", "parcae"]
FAMILIES: tuple[str, ...] = ("huginn", "raven", "raven-olmo", "ouro", "parcae")
NormLayout = Literal["sandwich", "pre-norm", "reordered", "peri-norm"]
#: The ``auto_map`` an Ouro checkpoint's config.json carries (its remote-code files on the hub).
OURO_AUTO_MAP = {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModel": "modeling_ouro.OuroModel",
                 "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"}
#: The allowed values of each float field (a finite number, and this test), checked when a config is made.
FLOAT_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "norm_eps": (lambda x: x > 0, "> 0"), "rope_base": (lambda x: x > 0, "> 0"),
    "embed_scale": (lambda x: x > 0, "> 0"), "state_std": (lambda x: x >= 0, ">= 0"),
    "exit_threshold": (lambda x: 0 <= x <= 1, "in [0, 1]")}
#: What this runtime runs of a Parcae config.json: each field and its allowed values (the first is assumed when the
#: field is absent). Every public Parcae checkpoint has these (fixtures/README.md, section parcae-tiny); anything else
#: changes the forward (another block, injection, MLP or norm; an embedding or logit scale other than 1; a soft cap).
PARCAE_FORMAT: dict[str, tuple[Any, ...]] = {
    "_class_name": ("ParcaeConfig",), "model_class_name": ("Parcae",), "injection_type": ("diagonal",),
    "block_class_name": ("TransformerPreNormBlock",), "norm_class_name": ("RMSNorm",), "mlp_class_name": ("BaseMLP",),
    "nonlin_name": ("ReLU2",), "qk_norm": (True,), "qk_bias": (False,), "bias": (False,), "clip_qkv": (None,),
    "logit_softcap": (None,), "prelude_norm": (True,), "state_init": ("like-init",),
    "init_strategy": ("scaled-zero",), "mup_model_scaling_factor": (1,), "recurrent_num_attention_heads": (None,),
}
#: The width of the channels of a block's normed input that Parcae's value-embedding gate reads.
PARCAE_GATE_CHANNELS = 32


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
    exit_threshold: float | None = None  # Ouro's early_exit_threshold (the HF readout's default); None elsewhere
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the config.json it was read from

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "n_embd", "n_heads", "n_kv_heads", "n_core", "intermediate_size", "block_size",
                     "mean_recurrence"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name, (ok, allowed) in FLOAT_RANGES.items():
            value = getattr(self, name)
            if value is None and name == "exit_threshold":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value)
                                                                                     and ok(value)):
                raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be null or an object, got {self.rope_scaling!r}")
        if self.n_embd % self.n_heads:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.family == "parcae" and self.n_embd < PARCAE_GATE_CHANNELS:
            raise ValueError(f"a Parcae model's value-embedding gate reads {PARCAE_GATE_CHANNELS} channels: n_embd "
                             f"must be >= {PARCAE_GATE_CHANNELS}, got {self.n_embd}")
        if self.family == "ouro" and (self.n_prelude or self.n_coda):
            raise ValueError(f"an Ouro model has no prelude or coda (the whole stack is the core): n_prelude and "
                             f"n_coda must be 0, got {self.n_prelude} and {self.n_coda}")

    # -- derived facts -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def norm_layout(self) -> NormLayout:
        """Where each layer (:class:`~looped_kv.runtime.model.Block`) places its norms.

        ``"sandwich"`` (Huginn): ``x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x)))``;
        ``"pre-norm"`` (Raven-Llama): ``x = x + attn(n1(x)); x = x + mlp(n2(x))``;
        ``"reordered"`` (Raven-OLMo, OLMo-2's norms on the sublayer outputs): ``x = x + n1(attn(x));
        x = x + n2(mlp(x))``; ``"peri-norm"`` (Ouro, a norm before and after each sublayer):
        ``x = x + n2(attn(n1(x))); x = x + n4(mlp(n3(x)))``. Parcae's blocks are pre-norm.
        """
        return {"huginn": "sandwich", "raven": "pre-norm", "raven-olmo": "reordered", "ouro": "peri-norm",
                "parcae": "pre-norm"}[self.family]

    @property
    def qk_norm(self) -> bool:
        """Raven-OLMo: RMSNorm over the whole query and key projections, before the heads split and rotary."""
        return self.family == "raven-olmo"

    @property
    def qk_head_norm(self) -> bool:
        """Parcae: a parameter-free RMS norm over head_dim of every query and key head, after the rotary."""
        return self.family == "parcae"

    @property
    def diagonal_injection(self) -> bool:
        """Parcae: each loop starts with s <- s exp(-dt A) + dt (e B^T) (no adapter), ``C`` maps s(R) to the coda, and
        the prelude ends with ``ln_prelude``."""
        return self.family == "parcae"

    @property
    def gated_mlp(self) -> bool:
        """A SiLU-gated MLP (every family but Parcae, whose MLP is proj(0.5 relu(fc(x))^2))."""
        return self.family != "parcae"

    @property
    def value_embeds(self) -> tuple[int, ...]:
        """Parcae's value-embedding tables: layers e = 0..n_layers-1 (prelude, core, coda, each layer once) with
        e = n_layers - 1 (mod 2), the last layer and every second one before it."""
        if self.family != "parcae":
            return ()
        return tuple(e for e in range(self.n_layers) if e % 2 == (self.n_layers - 1) % 2)

    def value_gate(self, stage: str, layer: int) -> bool:
        """Whether a Parcae block has a value-embedding gate: its layer id (prelude i: i; core l: n_prelude + l;
        coda i: n_prelude + n_core R + i, R the mean recurrence) is n_core mean_backprop_depth - 1 (mod 2)."""
        if self.family != "parcae":
            return False
        first = {"prelude": 0, "core": self.n_prelude, "coda": self.n_prelude + self.n_core * self.mean_recurrence}
        return (first[stage] + layer) % 2 == (self.n_core * self.mean_backprop_depth - 1) % 2

    def value_embed_index(self, stage: str, layer: int) -> int:
        """The layer's index e among prelude, core and coda counted once (its value-embedding table's key)."""
        return {"prelude": 0, "core": self.n_prelude, "coda": self.n_prelude + self.n_core}[stage] + layer

    @property
    def norm_after_recurrence(self) -> bool:
        """Huginn applies ``ln_f`` to the recurrent state before the coda; Raven does not (Ouro: every loop does)."""
        return self.family == "huginn"

    @property
    def looped_stack(self) -> bool:
        """Ouro: the whole stack is the loop; each loop starts from the last one's output (the token embedding at
        first), with no adapter or input injection, and ends with the final norm; the head reads that normed state."""
        return self.family == "ouro"

    @property
    def exit_gate(self) -> bool:
        """Whether the model has an exit gate per loop (Ouro's ``early_exit_gate``)."""
        return self.family == "ouro"

    @property
    def n_layers(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda

    def layer_passes(self, num_loops: int) -> int:
        """Layer passes of one forward with ``num_loops`` loops: c(r) = n_pre + r n_core + n_coda (RIPE Eq. 8)."""
        return self.n_prelude + num_loops * self.n_core + self.n_coda

    # -- the public checkpoint format ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], tensor_names: Iterable[str] = ()) -> LoopedConfig:
        """Read a ``config.json`` of Huginn-0125 or a Raven retrofit (``model_type: huginn_raven``), or of Ouro
        (``model_type: ouro``, :meth:`from_ouro_dict`).

        The family comes from the config (``looped_kv_family``, else the modeling file ``auto_map`` names) and,
        when the config names none, from ``tensor_names``, the checkpoint's tensors (see :func:`detect_family`).
        """
        if raw.get("model_type") == "ouro":
            return cls.from_ouro_dict(raw)
        if "_class_name" in raw and "model_type" not in raw:
            return cls.from_parcae_dict(raw)
        if raw.get("model_type") not in (None, "huginn_raven"):
            raise ValueError(f"config.json model_type must be 'huginn_raven' or 'ouro', got {raw.get('model_type')!r}")
        family = raw.get("looped_kv_family") or detect_family(raw, tensor_names)
        n_heads = _integer(raw, "n_heads", "num_attention_heads")
        init_values = raw.get("init_values", {})
        if not isinstance(init_values, dict):
            raise ValueError(f"config 'init_values' must be an object, got {init_values!r}")
        return cls(
            family=family,
            vocab_size=_integer(raw, "padded_vocab_size", "vocab_size"),
            n_embd=_integer(raw, "n_embd"),
            n_heads=n_heads,
            n_kv_heads=_integer(raw, "num_key_value_heads") if "num_key_value_heads" in raw else n_heads,
            n_prelude=_integer(raw, "n_layers_in_prelude"),
            n_core=_integer(raw, "n_layers_in_recurrent_block"),
            n_coda=_integer(raw, "n_layers_in_coda"),
            intermediate_size=_integer(raw, "intermediate_size"),
            block_size=_integer(raw, "block_size", "max_position_embeddings"),
            norm_eps=_number(raw, "norm_eps", 1e-6, "norm_eps"),
            qk_bias=bool(raw.get("qk_bias", False)),
            rope_base=_number(raw, "rope_theta" if "rope_theta" in raw else "rope_base", 10000.0, "rope_base"),
            rope_scaling=raw.get("rope_scaling"),
            embed_scale=_number(init_values, "embed_scale", 1.0, "embed_scale"),
            state_std=_number(init_values, "std", 0.02, "state_std"),
            tie_embeddings=bool(raw.get("tie_embeddings", raw.get("tie_word_embeddings", True))),
            mean_recurrence=_integer(raw, "mean_recurrence"),
            mean_backprop_depth=_integer(raw, "mean_backprop_depth") if "mean_backprop_depth" in raw else 8,
            raw=raw,
        )

    @classmethod
    def from_ouro_dict(cls, raw: dict[str, Any]) -> LoopedConfig:
        """Read an Ouro checkpoint's ``config.json`` (``model_type: ouro``; ``configuration_ouro.OuroConfig``).

        ``num_hidden_layers`` layers form the core, run ``total_ut_steps`` times (the default loop count);
        ``early_exit_threshold`` is the threshold readout's default. What this runtime does not implement is
        refused: sliding-window layers, rotary scaling, another activation or a ``head_dim`` other than
        ``hidden_size / num_attention_heads``.
        """
        missing = [name for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                                     "intermediate_size", "max_position_embeddings") if name not in raw]
        if missing:
            raise ValueError(f"Ouro config.json has no {', '.join(map(repr, missing))}")
        n_embd, n_heads = _integer(raw, "hidden_size"), _integer(raw, "num_attention_heads")
        if n_embd < 1 or n_heads < 1:
            raise ValueError(f"Ouro config.json hidden_size and num_attention_heads must be >= 1, got {n_embd} and "
                             f"{n_heads}")
        head_dim = _integer(raw, "head_dim") if raw.get("head_dim") is not None else n_embd // n_heads
        if head_dim * n_heads != n_embd:
            raise ValueError(f"Ouro config.json head_dim must be hidden_size / num_attention_heads = "
                             f"{n_embd} / {n_heads}, got {head_dim}")
        layer_types = raw.get("layer_types") or []
        if not isinstance(layer_types, list) or (layer_types and len(layer_types) != raw["num_hidden_layers"]):
            raise ValueError(f"Ouro config.json layer_types must list one type per layer (num_hidden_layers "
                             f"{raw['num_hidden_layers']}), got {layer_types!r}")
        sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
        if raw.get("use_sliding_window") or sliding:
            raise ValueError(f"Ouro config.json: sliding-window attention is not supported (use_sliding_window "
                             f"{raw.get('use_sliding_window')}, layers {sliding} not 'full_attention')")
        if raw.get("rope_scaling") is not None:
            raise ValueError(f"Ouro config.json rope_scaling must be null, got {raw['rope_scaling']!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Ouro config.json hidden_act must be 'silu', got {raw['hidden_act']!r}")
        threshold = raw.get("early_exit_threshold", 1.0)  # OuroConfig's defaults: 1.0 and 4 loops
        loops = _integer(raw, "total_ut_steps") if "total_ut_steps" in raw else 4
        if loops < 1:
            raise ValueError(f"Ouro config.json total_ut_steps (the loop count) must be >= 1, got {loops}")
        if threshold is not None:
            threshold = _number(raw, "early_exit_threshold", 1.0, "exit_threshold")
        return cls(
            family="ouro", vocab_size=_integer(raw, "vocab_size"), n_embd=n_embd, n_heads=n_heads,
            n_kv_heads=_integer(raw, "num_key_value_heads") if raw.get("num_key_value_heads") else n_heads,
            n_prelude=0, n_core=_integer(raw, "num_hidden_layers"), n_coda=0,
            intermediate_size=_integer(raw, "intermediate_size"), block_size=_integer(raw, "max_position_embeddings"),
            norm_eps=_number(raw, "rms_norm_eps", 1e-6, "norm_eps"),
            rope_base=_number(raw, "rope_theta", 10000.0, "rope_base"),
            state_std=0.0, tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            mean_recurrence=loops, mean_backprop_depth=loops,
            exit_threshold=threshold, raw=raw,
        )

    @classmethod
    def from_parcae_dict(cls, raw: dict[str, Any]) -> LoopedConfig:
        """Read a Parcae checkpoint's ``config.json`` (``_class_name: "ParcaeConfig"``, no ``model_type``).

        Anything outside :data:`PARCAE_FORMAT` is refused in one line naming the field and its allowed values (a
        ``GPTConfig`` is a plain transformer), and so is a core of another width than the model's
        (``recurrent_embedding_dimension``, ``recurrent_intermediation_embedding_dimension``), grouped-query heads,
        and rotary other than ``rope_settings`` {use_rope true, rope_condense_ratio 1}. The initial state is
        ``like-init``'s: a normal truncated at 3 std, std sqrt(2 / (5 n_embd)), the embedding scale being 1.
        """
        for key, allowed in PARCAE_FORMAT.items():
            value = raw.get(key, allowed[0])
            if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
                raise ValueError(f"Parcae config.json {key} must be {' or '.join(map(repr, allowed))}, got {value!r}")
        n_embd, inner = _integer(raw, "n_embd"), _integer(raw, "intermediate_size")
        for key, value in (("recurrent_embedding_dimension", n_embd), ("recurrent_intermediation_embedding_dimension",
                                                                       inner)):
            if raw.get(key, value) != value:
                raise ValueError(f"Parcae config.json {key} must equal {value} (the model's width), got {raw[key]!r}")
        n_heads = _integer(raw, "num_attention_heads")
        if raw.get("num_key_value_heads", n_heads) != n_heads:
            raise ValueError(f"Parcae config.json num_key_value_heads must equal num_attention_heads ({n_heads}), "
                             f"got {raw['num_key_value_heads']!r}")
        rope = raw.get("rope_settings") or {}
        if rope.get("use_rope", True) is not True or rope.get("rope_condense_ratio", 1) != 1:
            raise ValueError(f"Parcae config.json rope_settings must have use_rope true and rope_condense_ratio 1, "
                             f"got {rope!r}")
        return cls(
            family="parcae", vocab_size=_integer(raw, "padded_vocab_size"), n_embd=n_embd, n_heads=n_heads,
            n_kv_heads=n_heads, n_prelude=_integer(raw, "n_layers_in_prelude"),
            n_core=_integer(raw, "n_layers_in_recurrent_block"), n_coda=_integer(raw, "n_layers_in_coda"),
            intermediate_size=inner, block_size=_integer(raw, "block_size"), norm_eps=float(raw.get("norm_eps", 1e-5)),
            rope_base=float(rope.get("rope_base", 50000)), state_std=math.sqrt(2 / (5 * n_embd)),
            tie_embeddings=bool(raw.get("tie_embeddings", True)), mean_recurrence=_integer(raw, "mean_recurrence"),
            mean_backprop_depth=_integer(raw, "mean_backprop_depth"), raw=raw,
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
        """The ``config.json`` that ``from_hf_dict`` reads back (used for the shipped tiny model); an Ouro model's
        in Ouro's own format."""
        d = {key: value for key, value in asdict(self).items() if key != "raw"}
        if self.family == "ouro":
            return {
                "architectures": ["OuroForCausalLM"], "auto_map": dict(OURO_AUTO_MAP), "model_type": "ouro",
                "vocab_size": d["vocab_size"], "hidden_size": d["n_embd"], "num_attention_heads": d["n_heads"],
                "num_key_value_heads": d["n_kv_heads"], "head_dim": self.head_dim,
                "num_hidden_layers": d["n_core"], "intermediate_size": d["intermediate_size"], "hidden_act": "silu",
                "max_position_embeddings": d["block_size"], "rms_norm_eps": d["norm_eps"],
                "rope_theta": d["rope_base"], "rope_scaling": None, "use_sliding_window": False,
                "sliding_window": None, "layer_types": ["full_attention"] * d["n_core"],
                "tie_word_embeddings": d["tie_embeddings"], "total_ut_steps": d["mean_recurrence"],
                "early_exit_threshold": d["exit_threshold"],
            }
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
    key = next((key for key in keys if key in raw), None)
    if key is None:
        raise ValueError(f"config has no {' or '.join(repr(key) for key in keys)}")
    value = raw[key]
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"config {key!r} must be an integer, got {value!r}")
    return int(value)


def _number(raw: dict[str, Any], key: str, default: float, field: str) -> float:
    """``raw[key]`` (else ``default``) as a float within the allowed values of ``field`` (:data:`FLOAT_RANGES`);
    a ValueError naming the key otherwise."""
    value = raw.get(key, default)
    ok, allowed = FLOAT_RANGES[field]
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and ok(value)):
        raise ValueError(f"config {key!r} must be a finite number {allowed}, got {value!r}")
    return float(value)


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


def raven_tinyllama() -> LoopedConfig:
    """Raven-TinyLlama's architecture (DAS paper, Table 3: 4/8/4 layers, R = 32), TinyLlama-1.1B retrofitted.

    The split is the public conversion script's (``convert_pretrained_model/convert_llama.py`` of the
    retrofitting-recurrence code, ``LoopedLMs/retrofitting-recurrence`` at commit 1b2dfe0: from
    ``TinyLlama-1.1B-intermediate-step-1431k-3T``, prelude = layers 0-3, core = layers 10-17, coda = layers
    18-21). The widths, vocabulary, rope_theta (no scaling) and context are TinyLlama-1.1B's public config
    (hidden 2048, 32 heads of width 64, 4 KV heads, intermediate 5632, vocabulary 32000, rope_theta 10000, 2048
    positions), which that script copies; norm eps 1e-5 is the script's. R = 32 as in the checkpoint
    ``smcleish/Recurrent-TinyLlama-3T-train-recurrence-32``.
    """
    return LoopedConfig(
        family="raven", vocab_size=32000, n_embd=2048, n_heads=32, n_kv_heads=4, n_prelude=4, n_core=8, n_coda=4,
        intermediate_size=5632, block_size=2048, norm_eps=1e-5, rope_base=10000.0, tie_embeddings=False,
        mean_recurrence=32,
    )


def _ouro(layers: int) -> LoopedConfig:
    return LoopedConfig(
        family="ouro", vocab_size=49152, n_embd=2048, n_heads=16, n_kv_heads=16, n_prelude=0, n_core=layers, n_coda=0,
        intermediate_size=5632, block_size=65536, norm_eps=1e-6, rope_base=1000000.0, state_std=0.0,
        tie_embeddings=False, mean_recurrence=4, mean_backprop_depth=4, exit_threshold=1.0,
    )


def ouro_1_4b() -> LoopedConfig:
    """ByteDance's Ouro-1.4B (and -1.4B-Thinking): 24 layers looped 4 times (``total_ut_steps``), 16 heads of width
    128 with 16 KV heads, hidden 2048, intermediate 5632, vocabulary 49152, 65536 positions, rope_theta 10^6, norm
    eps 1e-6, an untied head and ``early_exit_threshold`` 1.0: the checkpoint's config.json as the Ouro
    fixture's README records it (``fixtures/README.md``, section ouro-tiny); :func:`LoopedConfig.from_ouro_dict`
    reads the real file.
    """
    return _ouro(24)


def ouro_2_6b() -> LoopedConfig:
    """ByteDance's Ouro-2.6B (and -2.6B-Thinking): as :func:`ouro_1_4b` with 48 layers (the fixture's README)."""
    return _ouro(48)


def _parcae(width: int, layers: int) -> LoopedConfig:
    return LoopedConfig(
        family="parcae", vocab_size=32768, n_embd=width, n_heads=width // 128, n_kv_heads=width // 128,
        n_prelude=layers, n_core=layers, n_coda=layers, intermediate_size=4 * width, block_size=2048, norm_eps=1e-5,
        rope_base=50000.0, state_std=math.sqrt(2 / (5 * width)), mean_recurrence=8, mean_backprop_depth=4,
    )


def parcae_140m() -> LoopedConfig:
    """SandyResearch's parcae-140m (Prairie et al., arXiv 2604.12946): 2/2/2 layers of width 768, 6 heads of 128
    (as many KV heads), MLP 3072, vocabulary 32768, 2048 positions, norm eps 1e-5, rope base 50000, mean recurrence 8,
    backprop depth 4, tied embeddings: ``parcae_lm/configs/parcae/parcae-small-140m.py`` of ``sandyresearch/parcae``
    (commit dee8363), which the hub config.json repeats (fixtures/README.md, section parcae-tiny)."""
    return _parcae(768, 2)


def parcae_370m() -> LoopedConfig:
    """parcae-370m: 4/4/4 layers of width 1024, 8 heads of 128, MLP 4096 (``parcae-medium-370m.py``; else as
    :func:`parcae_140m`)."""
    return _parcae(1024, 4)


def parcae_770m() -> LoopedConfig:
    """parcae-770m: 6/6/6 layers of width 1280, 10 heads of 128, MLP 5120 (``parcae-large-770m.py``; else as
    :func:`parcae_140m`)."""
    return _parcae(1280, 6)


def parcae_1_3b() -> LoopedConfig:
    """parcae-1.3b: 8/8/8 layers of width 1536, 12 heads of 128, MLP 6144 (``parcae-xlarge-1_3b.py``; else as
    :func:`parcae_140m`)."""
    return _parcae(1536, 8)


#: The published architectures by name (``looped-kv memory --model``, ``plan``, the GPU checks).
PRESETS = {"huginn-0125": huginn_0125, "raven-llama": raven_llama, "raven-olmo": raven_olmo,
           "raven-tinyllama": raven_tinyllama, "ouro-1.4b": ouro_1_4b, "ouro-2.6b": ouro_2_6b,
           "parcae-140m": parcae_140m, "parcae-370m": parcae_370m, "parcae-770m": parcae_770m,
           "parcae-1.3b": parcae_1_3b}
