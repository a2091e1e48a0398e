"""One looped-model implementation for Huginn-0125, the Raven retrofits (Llama, TinyLlama, OLMo-2), Ouro and Parcae.

The pieces the papers talk about are methods: :meth:`LoopedLM.embed` (embedding and
prelude P), :meth:`LoopedLM.loop` (one loop of the core B, writing plane r),
:meth:`LoopedLM.readout` (coda C and head), and :meth:`LoopedLM.initial_state`. An Ouro
model is the same pieces with an empty prelude and coda: its loop is the whole stack followed
by the final norm, it starts from the token embedding, and its head reads the normed state. A
Parcae model's loop starts with its diagonal injection instead of an adapter, and its readout
maps the state with ``C`` before the coda; its value embeddings read the token ids, which its
loop and readout are therefore given (``tokens``).
Numerics follow the public reference code: RMSNorm and the Huginn rotary step run in
float32 whatever the model dtype, so that float64 runs agree with the reference outputs
to float64 rounding.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from looped_kv.runtime.attention import CausalRouter, Router, Site, Stage
from looped_kv.runtime.config import PARCAE_GATE_CHANNELS, LoopedConfig


class Float16Overflow(ValueError):
    """A float16 run produced inf or NaN (float16 ends at 65,504): one line naming where, and the remedy."""

    def __init__(self, what: str) -> None:
        super().__init__(f"float16 overflow: inf or NaN in {what}; run this model in float32 "
                         f"(LOOPED_KV_DTYPE=float32, or load(..., dtype='float32'))")


def check_finite(tensor: Tensor, what: str) -> None:
    """Float16Overflow naming ``what`` if ``tensor`` holds inf or NaN."""
    if not bool(torch.isfinite(tensor).all()):
        raise Float16Overflow(what)


#: The op that ``F.rms_norm`` dispatches to (PyTorch >= 2.8), called without the Python and dispatcher layers above
#: it, which take a third of a one-token norm's time on a CPU (a decoding step of the tiny model computes 140 norms).
_fused_rms_norm = getattr(torch, "_fused_rms_norm", None)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, the mean computed in float32 as the reference does."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # the same ops in one call, bit for bit
        if _fused_rms_norm is not None and not torch.compiler.is_compiling():  # (a traced step cannot call it)
            return _fused_rms_norm(x, (x.shape[-1],), weight, eps)[0]
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x if x.dtype == torch.float32 else x.float()
    y = x32 * x32.pow(2).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()  # the mean, bit for bit
    return (y if y.dtype == x.dtype else y.type_as(x)) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding: adjacent pairs (Huginn, Parcae), or rotate-half (Raven), with Llama-3 scaling when
    the config has it (Raven-Llama; Raven-OLMo has none).

    Adjacent pairs rotate the queries and keys rounded to float32 with the float32 table cast to the model's dtype
    (as the model casts its buffers): Parcae's reference, whose ``freqs_cis`` buffer is cast with the model, so that
    a float64 run multiplies in float64 and a bfloat16 run uses bfloat16-rounded cos/sin.
    """

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.interleaved = config.family in ("huginn", "parcae")
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if config.rope_scaling and config.rope_scaling.get("rope_type", config.rope_scaling.get("type")) == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, config.rope_scaling)
        angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if self.interleaved:  # pair (a, b) -> (a cos - b sin, b cos + a sin) = x * cos' + swap(x) * sin', per element
            cos, sin = cos.repeat_interleave(2, -1), torch.stack([-sin, sin], dim=-1).flatten(-2)
        else:  # rotate-half: x * cos' + (-x2, x1) * sin'
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._angles: tuple[Tensor, int, Tensor, Tensor] | None = None  # positions, their version, cos, sin
        self._swaps: dict[torch.device, Tensor] = {}  # per device: the index that swaps each adjacent pair

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos' and sin' at ``positions``, (..., 1, D); gathered once for the many calls of one forward pass."""
        if torch.compiler.is_compiling():  # a traced step gathers them itself; no memo inside the graph
            return self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)
        memo = self._angles
        if memo is None or memo[0] is not positions or memo[1] != positions._version:
            cos, sin = self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)
            memo = self._angles = (positions, positions._version, cos, sin)
        return memo[2], memo[3]

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.rotate(x, positions)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x`` (B, n, H, D) at absolute ``positions`` ((n,) or (B, n)) (the blocks call this, not the
        module: no module-call overhead in the decoders' hot path)."""
        cos, sin = self.angles(positions)
        if self.interleaved:  # computed in float32, as the reference does; the same products and sums, bit for bit
            x32 = x if x.dtype == torch.float32 else x.float()
            rotated = x32 * cos + self._swapped(x32) * sin
            return rotated if rotated.dtype == x.dtype else rotated.type_as(x)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def _swapped(self, x: Tensor) -> Tensor:
        """(b, a) for each adjacent pair (a, b) of the last dimension: a gather for a decoding step's few tokens (a
        third faster there), a flip of pairs for a longer block (twice as fast there)."""
        if torch.compiler.is_compiling() or x.numel() > 1024:
            return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        index = self._swaps.get(x.device)
        if index is None:
            index = self._swaps[x.device] = torch.arange(self.cos.shape[-1], device=x.device) ^ 1
        return x[..., index]


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class AttentionWeights(NamedTuple):
    """An attention layer's parameters; the projections transposed (views), multiplied as ``x @ W^T``."""

    qkv: Tensor
    proj: Tensor
    qk_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    ve_gate: Tensor | None = None  # Parcae's value-embedding gate, transposed (a view)


class Attention(nn.Module):
    """Self-attention; ``value_gate`` (Parcae) adds the gated value embedding of the tokens to the values."""

    def __init__(self, config: LoopedConfig, value_gate: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.chunks = [config.n_embd, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim]
        self.Wqkv = nn.Linear(config.n_embd, sum(self.chunks), bias=False)
        self.has_qk_bias, self.has_qk_norm, self.eps = config.qk_bias, config.qk_norm, config.norm_eps
        self.has_head_norm, self.has_value_gate = config.qk_head_norm, value_gate
        if value_gate:
            self.ve_gate = nn.Linear(PARCAE_GATE_CHANNELS, self.n_kv_heads, bias=False)
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.n_heads, self.head_dim))
        if config.qk_norm:  # over all heads at once (n_heads x head_dim wide), not per head
            self.q_norm = RMSNorm(self.chunks[0], config.norm_eps)
            self.k_norm = RMSNorm(self.chunks[1], config.norm_eps)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def weights(self) -> AttentionWeights:
        return AttentionWeights(self.Wqkv.weight.t(), self.proj.weight.t(), self.qk_bias if self.has_qk_bias else None,
                                *((self.q_norm.weight, self.k_norm.weight) if self.has_qk_norm else (None, None)),
                                self.ve_gate.weight.t() if self.has_value_gate else None)

    def run(self, x: Tensor, w: AttentionWeights, rotary: Rotary, positions: Tensor, router: Router,
            site: Site, ve: Tensor | None = None) -> Tensor:
        """The attention sublayer on the B x n tokens ``x`` (B n, d) at ``positions`` (B, n) or (n,), with the block's
        weights ``w``; ``router`` says what it reads.

        ``ve`` (Parcae): the tokens' value embedding (B n, H_kv D), added to the values before the rotary with the
        gate 2 sigmoid(x[:, :32] W_gate^T), one per key-value head. Parcae then normalises every query and key head
        (an RMS norm without weight, eps the machine epsilon) after the rotary."""
        B, n = (x.shape[0] // positions.shape[0], positions.shape[0]) if positions.dim() == 1 else positions.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = torch.mm(x, w.qkv)  # F.linear's own product, without its wrapper
        if self.has_qk_norm:
            queries, keys, values = qkv.split_with_sizes(self.chunks, dim=-1)
            queries = rotary.rotate(rms_norm(queries, w.q_norm, self.eps).view(B, n, H, D), positions)
            keys = rotary.rotate(rms_norm(keys, w.k_norm, self.eps).view(B, n, H_kv, D), positions)
            values = values.view(B, n, H_kv, D)
        else:  # queries and keys rotated together, heads side by side: the same arithmetic in fewer calls
            qk, values = qkv.view(B, n, H + 2 * H_kv, D).split_with_sizes([H + H_kv, H_kv], dim=2)
            if ve is not None:
                gate = 2 * torch.sigmoid(torch.mm(x[:, :PARCAE_GATE_CHANNELS], w.ve_gate))
                values = values + gate.view(B, n, H_kv, 1) * ve.view(B, n, H_kv, D)
            if self.has_qk_bias:
                qk = qk + w.qk_bias.view(H + H_kv, D)
            qk = rotary.rotate(qk, positions)
            if self.has_head_norm:
                qk = F.rms_norm(qk, (D,))
            queries, keys = qk.split_with_sizes([H, H_kv], dim=2)
        y = router.attend(site, queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        return torch.mm(y.transpose(1, 2).reshape(B * n, -1), w.proj)


class GatedMLP(nn.Module):
    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def weights(self) -> tuple[Tensor, Tensor]:
        """fc^T and proj^T (views), multiplied as ``x @ W^T``."""
        return self.fc.weight.t(), self.proj.weight.t()

    @staticmethod
    def run(x: Tensor, w: tuple[Tensor, Tensor]) -> Tensor:
        """The MLP on the tokens ``x`` (tokens, d)."""
        gate, up = torch.mm(x, w[0]).chunk(2, dim=-1)
        return torch.mm(F.silu(gate) * up, w[1])


class ReLU2MLP(nn.Module):
    """Parcae's MLP: proj(relu2(fc(x))) with relu2(z) = 0.5 max(z, 0)^2 (the factor 0.5 is part of it), no gate."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def weights(self) -> tuple[Tensor, Tensor]:
        """fc^T and proj^T (views), multiplied as ``x @ W^T``."""
        return self.fc.weight.t(), self.proj.weight.t()

    @staticmethod
    def run(x: Tensor, w: tuple[Tensor, Tensor]) -> Tensor:
        """The MLP on the tokens ``x`` (tokens, d)."""
        return torch.mm(F.relu(torch.mm(x, w[0])).pow(2).mul(0.5), w[1])


class BlockWeights(NamedTuple):
    """A block's parameters, read once per forward pass: a core block serves all R loops of it with one read."""

    norms: tuple[Tensor, ...]  # norm_1, norm_2 (and norm_3, norm_4)
    attn: AttentionWeights
    mlp: tuple[Tensor, Tensor]  # fc^T, proj^T


class Block(nn.Module):
    """Sandwich block (Huginn), pre-norm block (Raven, Parcae), OLMo-2's reordered block (Raven-OLMo) or a norm before
    and after each sublayer (Ouro): ``config.norm_layout``; the MLP is SiLU-gated, or Parcae's ReLU^2.

    Its sublayers compute with :class:`BlockWeights` on the tokens as rows (``torch.mm`` with the transposed
    weights, which is what ``F.linear`` calls, stored contiguous by :meth:`LoopedLM.store_weights_transposed`, and
    :func:`rms_norm`), not through module calls: the same arithmetic, without the attribute lookups, reshapes and
    module-call overhead that would otherwise be most of a one-token decoding step's time.
    """

    def __init__(self, config: LoopedConfig, stage: Stage, layer: int) -> None:
        super().__init__()
        self.stage, self.layer, self.layout, self.eps = stage, layer, config.norm_layout, config.norm_eps
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config, config.value_gate(stage, layer))
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = GatedMLP(config) if config.gated_mlp else ReLU2MLP(config)
        index = config.value_embed_index(stage, layer)
        #: Parcae: the key of the value-embedding table this block adds (where it has both the table and a gate)
        self.value_embed = str(index) if self.attn.has_value_gate and index in config.value_embeds else None
        if self.layout in ("sandwich", "peri-norm"):
            self.norm_3 = RMSNorm(config.n_embd, config.norm_eps)
            self.norm_4 = RMSNorm(config.n_embd, config.norm_eps)

    def weights(self) -> BlockWeights:
        norms = (self.norm_1, self.norm_2, self.norm_3, self.norm_4) if self.layout in ("sandwich", "peri-norm") \
            else (self.norm_1, self.norm_2)
        return BlockWeights(tuple(norm.weight for norm in norms), self.attn.weights(), self.mlp.weights())

    def forward(self, x: Tensor, rotary: Rotary, positions: Tensor, router: Router, loop: int = 0,
                weights: BlockWeights | None = None, ve: Tensor | None = None) -> Tensor:
        """The block on ``x`` (B, n, d); ``weights`` (default: read now) are :meth:`weights`; ``ve`` as in
        :meth:`run`."""
        w = self.weights() if weights is None else weights
        return self.run(x.flatten(0, 1), w, rotary, positions, router, loop, ve).view(x.shape)

    def run(self, x: Tensor, w: BlockWeights, rotary: Rotary, positions: Tensor, router: Router, loop: int,
            ve: Tensor | None = None) -> Tensor:
        """:meth:`forward` on the B x n tokens as rows, ``x`` (B n, d), with its weights read and without a module
        call: the model's own passes call this (2-d products, as ``F.linear`` computes them, in one call each).
        ``ve`` (Parcae, a block with :attr:`value_embed`): the tokens' rows of its value-embedding table."""
        site, eps, norms, mlp = Site(self.stage, self.layer, loop), self.eps, w.norms, self.mlp.run

        def attention(h: Tensor) -> Tensor:
            return self.attn.run(h, w.attn, rotary, positions, router, site, ve)

        if self.layout == "sandwich":
            x = rms_norm(x + attention(rms_norm(x, norms[0], eps)), norms[1], eps)
            return rms_norm(x + GatedMLP.run(rms_norm(x, norms[2], eps), w.mlp), norms[3], eps)
        if self.layout == "reordered":
            x = x + rms_norm(attention(x), norms[0], eps)
            return x + rms_norm(GatedMLP.run(x, w.mlp), norms[1], eps)
        if self.layout == "peri-norm":
            x = x + rms_norm(attention(rms_norm(x, norms[0], eps)), norms[1], eps)
            return x + rms_norm(GatedMLP.run(rms_norm(x, norms[2], eps), w.mlp), norms[3], eps)
        x = x + attention(rms_norm(x, norms[0], eps))
        return x + mlp(rms_norm(x, norms[1], eps), w.mlp)


class DiagonalInjection(nn.Module):
    """Parcae's input injection, per state channel: s <- s exp(-dt A) + dt (e B^T) with dt = softplus(``dt_bias``),
    A = exp(``A_log``) and ``B`` stored as (state, n_embd), computed in the model's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(dim))
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        self.B = nn.Parameter(torch.eye(dim))

    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """(decay, dt, B^T): the decay exp(-dt A), the step dt and B transposed (a view)."""
        dt = F.softplus(self.dt_bias)
        return torch.exp(-dt * torch.exp(self.A_log)), dt, self.B.t()


class CoreWeights(NamedTuple):
    """The core's parameters for :meth:`LoopedLM.loop`: its blocks', the adapter's (None for Ouro and Parcae), the
    final norm's (Ouro's loop ends with it), Parcae's injection (:meth:`DiagonalInjection.weights`) and its core
    blocks' value-embedding tables (None where a block has none)."""

    blocks: tuple[BlockWeights, ...]
    adapter: Tensor | None  # transposed (a view), multiplied as x @ W^T
    norm: Tensor
    injection: tuple[Tensor, Tensor, Tensor] | None = None
    value_embeds: tuple[Tensor | None, ...] = ()


class LoopedLM(nn.Module):
    """Prelude P, core B run R times on a state s (RIPE Eq. 1), coda C and head (Eq. 2).

    Ouro (``config.looped_stack``): P and C are empty and s(0) = e, the token embedding; loop r is
    s(r) = norm(B(s(r-1))), with no input injection, and the head reads s(R) directly. Its exit gate
    (``transformer.exit_gate``) is read by :mod:`looped_kv.runtime.exit_gate`.

    Parcae (``config.diagonal_injection``): e = ln_prelude(P(x)); loop r is s(r) = B(s(r-1) exp(-dt A) + dt e B^T),
    with no norm; the readout is head(ln_f(C(W_C s(R)))), W_C being ``transformer.C``. The blocks with a gate add a
    value embedding of the tokens (``value_embeds``), in every loop of the core.
    """

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.config = config
        modules = dict(wte=nn.Embedding(config.vocab_size, config.n_embd),
                       prelude=nn.ModuleList(Block(config, "prelude", i) for i in range(config.n_prelude)))
        if config.diagonal_injection:
            modules.update(ln_prelude=RMSNorm(config.n_embd, config.norm_eps), adapter=DiagonalInjection(config.n_embd),
                           C=nn.Linear(config.n_embd, config.n_embd, bias=False))
        elif not config.looped_stack:  # Ouro has no input injection
            modules["adapter"] = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)
        modules.update(core_block=nn.ModuleList(Block(config, "core", i) for i in range(config.n_core)),
                       coda=nn.ModuleList(Block(config, "coda", i) for i in range(config.n_coda)),
                       ln_f=RMSNorm(config.n_embd, config.norm_eps))
        if config.exit_gate:
            modules["exit_gate"] = nn.Linear(config.n_embd, 1)
        self.transformer = nn.ModuleDict(modules)
        if config.value_embeds:
            kv_width = config.n_kv_heads * config.head_dim
            self.value_embeds = nn.ModuleDict({str(e): nn.Embedding(config.vocab_size, kv_width)
                                               for e in config.value_embeds})
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.rotary = Rotary(config)
        self.state_seed = 0
        self._states: Tensor | None = None
        self._states_key: tuple | None = None
        self.store_weights_transposed()

    def store_weights_transposed(self) -> None:
        """Store every linear weight the passes multiply as ``x @ W^T`` (all but the head) column-major: W (out, in)
        keeps its shape and values, and W^T is contiguous, so each product reads both operands row by row.

        On a CPU, MKL's product with a transposed second operand is 3 to 5 times slower at some shapes (the tiny
        model's MLP projection, K = 256, from 11 rows on): a verification block, a wide draft or DAS-Wave round and a
        prefill paid it (``looped-kv speed --layout-tokens``). It replaces the parameters' data, one weight at a time;
        an in-place load keeps the layout, and :func:`load`, which assigns the checkpoint's tensors, calls this
        again. A checkpoint is written contiguous, as read.
        """
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear) and name != "lm_head":
                    module.weight.data = module.weight.data.t().contiguous().t()

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    # -- the pieces ------------------------------------------------------------------------------
    def embed(self, input_ids: Tensor, positions: Tensor, router: Router) -> Tensor:
        """Embedding (times ``embed_scale``) and the prelude: e = P(x) (Parcae: then ``ln_prelude``)."""
        t = self.transformer
        x = t.wte(input_ids)
        if self.config.embed_scale != 1:
            x = x * self.config.embed_scale
        rotary, rows = self.rotary, x.flatten(0, 1)
        for block, ve in zip(t.prelude, self._value_rows(t.prelude, input_ids), strict=True):
            rows = block.run(rows, block.weights(), rotary, positions, router, 0, ve)
        if self.config.diagonal_injection:
            rows = rms_norm(rows, t.ln_prelude.weight, self.config.norm_eps)
        return rows.view(x.shape)

    def _value_rows(self, blocks: nn.ModuleList, tokens: Tensor | None,
                    tables: tuple[Tensor | None, ...] | None = None) -> list[Tensor | None]:
        """Per block, the rows (B n, H_kv D) of its value-embedding table at ``tokens`` (B, n), or None (Parcae; every
        other family has none). ``tables`` are the blocks' tables if already read."""
        tables = self.value_tables(blocks) if tables is None else tables
        if not any(table is not None for table in tables):
            return [None] * len(blocks)
        if tokens is None:
            raise ValueError("this Parcae model's value embeddings read the token ids: pass tokens (B, n)")
        return [None if table is None else F.embedding(tokens.flatten(), table) for table in tables]

    def value_tables(self, blocks: nn.ModuleList) -> tuple[Tensor | None, ...]:
        """The value-embedding table of each of ``blocks`` (Parcae), None where it has none."""
        return tuple(None if block.value_embed is None else self.value_embeds[block.value_embed].weight
                     for block in blocks)

    def loop(self, state: Tensor, embedded: Tensor, positions: Tensor, router: Router, r: int,
             weights: CoreWeights | None = None, *, tokens: Tensor | None = None) -> Tensor:
        """Loop r of the core: s(r) = B(adapter([s(r-1), e])), Ouro's s(r) = ln_f(B(s(r-1))) or Parcae's
        s(r) = B(s(r-1) exp(-dt A) + dt e B^T); its attention calls write plane r. ``weights`` (default: read now)
        are :meth:`core_weights`, read once for many loops; ``tokens`` (B, n), the ids, are read by Parcae's value
        embeddings only."""
        return self.loops(state, embedded, positions, router, range(r, r + 1), weights, tokens=tokens)

    def loops(self, state: Tensor, embedded: Tensor, positions: Tensor, router: Router, loops: range,
              weights: CoreWeights | None = None, finite: list[Tensor] | None = None, *,
              tokens: Tensor | None = None) -> Tensor:
        """:meth:`loop` for r in ``loops``, one after the other; ``finite`` (if given) collects, per loop, whether the
        state stayed finite (0-d bool tensors: no device sync)."""
        blocks, rotary, config = self.transformer.core_block, self.rotary, self.config
        w = self.core_weights() if weights is None else weights
        values = self._value_rows(blocks, tokens, w.value_embeds) if w.value_embeds else [None] * len(blocks)
        triples = tuple(zip(blocks, w.blocks, values, strict=True))
        rows, embedded_rows = state.flatten(0, 1), embedded.flatten(0, 1)  # the B x n tokens as rows
        if w.injection is not None:  # the same injected input dt (e B^T) at every loop
            decay, dt, B_t = w.injection
            injected = dt * torch.mm(embedded_rows, B_t)
        for r in loops:
            if w.injection is not None:
                x = rows * decay + injected
            else:
                x = rows if config.looped_stack else torch.mm(torch.cat([rows, embedded_rows], dim=-1), w.adapter)
            for block, block_weights, ve in triples:
                x = block.run(x, block_weights, rotary, positions, router, r, ve)
            rows = rms_norm(x, w.norm, config.norm_eps) if config.looped_stack else x
            if finite is not None:
                finite.append(torch.isfinite(rows).all())
        return rows.view(state.shape)

    def core_weights(self) -> CoreWeights:
        """The core's parameters (:class:`CoreWeights`), read once per forward pass for all its loops."""
        t, config = self.transformer, self.config
        blocks = tuple(block.weights() for block in t.core_block)
        if config.diagonal_injection:
            return CoreWeights(blocks, None, t.ln_f.weight, t.adapter.weights(), self.value_tables(t.core_block))
        return CoreWeights(blocks, None if config.looped_stack else t.adapter.weight.t(), t.ln_f.weight)

    def readout(self, state: Tensor, positions: Tensor, router: Router, *, tokens: Tensor | None = None) -> Tensor:
        """Coda and head: logits z = C(s(R)) (Ouro: the head on the normed state, z = head(s(R)); Parcae: the coda
        after ``transformer.C``, its value embeddings reading ``tokens`` (B, n))."""
        if self.config.looped_stack:
            return self._logits(self.lm_head(state), positions)
        t, eps, rotary, rows = self.transformer, self.config.norm_eps, self.rotary, state.flatten(0, 1)
        x = rms_norm(rows, t.ln_f.weight, eps) if self.config.norm_after_recurrence else rows
        if self.config.diagonal_injection:
            x = torch.mm(x, t.C.weight.t())
        for block, ve in zip(t.coda, self._value_rows(t.coda, tokens), strict=True):
            x = block.run(x, block.weights(), rotary, positions, router, 0, ve)
        logits = F.linear(rms_norm(x, t.ln_f.weight, eps), self.lm_head.weight)
        return self._logits(logits.view(*state.shape[:2], -1), positions)

    @staticmethod
    def _logits(logits: Tensor, positions: Tensor) -> Tensor:
        """The head's logits as float32 (float64 stay), checked for a float16 overflow (not inside a traced step,
        whose caller checks them). The check reads their min and max, which carry any NaN: no temporary of their size
        beside them (an elementwise isfinite would hold five bytes per logit)."""
        if logits.dtype == torch.float16 and not torch.compiler.is_compiling() \
                and not torch.isfinite(torch.stack(torch.aminmax(logits))).all():
            raise Float16Overflow(f"the logits (positions {int(positions.min())}-{int(positions.max())})")
        return logits if logits.dtype == torch.float64 else logits.float()

    def initial_state(self, positions: Tensor, batch: int = 1, last: int | None = None, *,
                      tokens: Tensor | None = None) -> Tensor:
        """The checkpoint's initial state s(0) of the tokens at ``positions``.

        Huginn, Raven and Parcae: a random draw from ``state_seed`` and each absolute position: a truncated normal
        (std ``state_std``, cut at 3 std, times ``embed_scale``) as in the reference, but deterministic per
        position, so that every decoder computing position t sees the state that sequential decoding sees
        (Parcae's reference, ``state_init`` like-init, draws it afresh from the global RNG on every call).
        One gather from a table of positions (built in chunks as positions grow); ``last`` (the largest
        position, if known on the host) spares a device sync; ``tokens`` is not read.
        Ouro: the embedding of ``tokens`` (B, n), which must be given.
        """
        if self.config.looped_stack:
            if tokens is None:
                raise ValueError("an Ouro model starts from the token embedding: initial_state needs tokens")
            return self.transformer.wte(tokens)
        last = int(positions.max()) if last is None else last
        state = self._state_table(last + 1)[positions]
        return state.expand(batch, -1, -1) if positions.dim() == 1 else state

    def _state_table(self, size: int) -> Tensor:
        """Initial states of positions [0, >= size) on the model's device and dtype."""
        cfg, table = self.config, self._states
        key = (self.state_seed, self.device, self.dtype)
        if table is None or self._states_key != key or table.shape[0] < size:
            chunks = -(-max(size, 1) // _CHUNK)
            chunks = -(-chunks // 16) * 16  # grow by 1024 positions at a time
            table = torch.cat([_state_chunk(self.state_seed, c, cfg.n_embd, cfg.state_std, cfg.embed_scale)
                               for c in range(chunks)]).to(self.device, self.dtype)
            self._states, self._states_key = table, key
        return table

    # -- whole forward ---------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, num_loops: int | None = None, initial_state: Tensor | str | None = None,
                *, positions: Tensor | None = None, router: Router | None = None, first_loop: int = 1,
                return_state: bool = False, max_position: int | None = None, check: bool = True,
                each_loop: Callable[[int, Tensor], None] | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Logits for every position after ``num_loops`` loops (default: the config's mean recurrence).

        ``initial_state`` is a tensor (B, n, n_embd), ``"zeros"``, or None for the checkpoint's own
        (:meth:`initial_state`: the deterministic draw; Ouro's token embedding). With ``return_state`` also
        returns the final recurrent state s(R) (before any norm; Ouro's is the loop's normed output).
        ``first_loop`` numbers the loops (and so the planes they write) from a later start, for a
        state that has already been refined (DAS-Wave's carried states). ``max_position`` (the largest
        position, known to a decoder) and ``check=False`` (ids already validated) spare the device sync
        of the range checks and of a given initial state's finiteness check: the decoders' hot path.
        ``each_loop(r, state)`` sees the initial state (r = ``first_loop`` - 1) and the state s(r) after every loop
        (B, n, n_embd): the one place a measurement reads the loops (a readout per loop, :meth:`readout`).
        """
        num_loops = self.config.mean_recurrence if num_loops is None else num_loops
        if isinstance(num_loops, bool) or not isinstance(num_loops, numbers.Integral) or num_loops < 1:
            raise ValueError(f"num_loops must be an integer >= 1, got {num_loops!r}")
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
                or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor of shape (batch, length), got "
                             f"{input_ids.dtype} of shape {tuple(input_ids.shape)}")
        B, n = input_ids.shape
        if isinstance(initial_state, Tensor) and initial_state.shape != (B, n, self.config.n_embd):
            raise ValueError(f"initial_state must have shape (batch, length, n_embd) = {(B, n, self.config.n_embd)}, "
                             f"got {tuple(initial_state.shape)}")
        if positions is None:
            positions = torch.arange(n, device=input_ids.device)
            max_position = n - 1 if max_position is None else max_position
        if not check:
            last = int(positions.max()) if max_position is None else max_position
        elif input_ids.numel():
            # One reduction over the ids and one device sync for both range checks and a given initial state's
            # finiteness (the decoders call forward every step, with check=False).
            low, high = torch.aminmax(input_ids)
            checked = [low.long(), high.long(), positions.max().to(low.device).long()]
            if isinstance(initial_state, Tensor):
                checked.append(torch.isfinite(initial_state).all().to(low.device).long())
            low, high, last, *finite = torch.stack(checked).tolist()
            if finite != [1] * len(finite):
                raise ValueError("initial_state holds NaN or infinite values; it must be finite")
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"input_ids must be token ids in [0, {self.config.vocab_size - 1}] (vocab_size "
                                 f"{self.config.vocab_size}), got ids in [{low}, {high}]")
        else:
            last = int(positions.max())
        if last >= self.config.block_size:
            raise ValueError(f"positions reach {last}, beyond the model's context "
                             f"(block_size {self.config.block_size})")
        router = CausalRouter() if router is None else router
        embedded = self.embed(input_ids, positions, router)
        state = self.resolve_state(initial_state, positions, B, last, embedded)
        stayed_finite = [] if state.dtype == torch.float16 else None  # float16 only: checked with one device sync
        loops = range(first_loop, first_loop + num_loops)
        if each_loop is None:
            state = self.loops(state, embedded, positions, router, loops, finite=stayed_finite, tokens=input_ids)
        else:
            weights = self.core_weights()
            for r in (first_loop - 1, *loops):
                if r >= first_loop:
                    state = self.loops(state, embedded, positions, router, range(r, r + 1), weights,
                                       finite=stayed_finite, tokens=input_ids)
                each_loop(r, state)
        if stayed_finite:  # before the readout, which checks the logits
            flags = torch.stack(stayed_finite).tolist()
            if not all(flags):
                raise Float16Overflow(f"the state after loop {first_loop + flags.index(False)} (positions "
                                      f"{int(positions.min())}-{int(positions.max())})")
        logits = self.readout(state, positions, router, tokens=input_ids)
        return (logits, state) if return_state else logits

    def resolve_state(self, initial_state: Tensor | str | None, positions: Tensor, batch: int,
                      last: int | None = None, embedded: Tensor | None = None) -> Tensor:
        if initial_state is None:  # Ouro starts from the embedding the forward has already computed
            return embedded if self.config.looped_stack else self.initial_state(positions, batch, last)
        if isinstance(initial_state, str):
            if initial_state != "zeros":
                raise ValueError(f"initial_state must be a tensor, 'zeros' or None, got {initial_state!r}")
            return torch.zeros(batch, positions.shape[-1], self.config.n_embd, device=self.device, dtype=self.dtype)
        return initial_state.to(self.device, self.dtype)


_CHUNK = 64


@lru_cache(maxsize=4096)
def _state_chunk(seed: int, chunk: int, dim: int, std: float, scale: float) -> Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + chunk) % (2**63))
    x = torch.empty(_CHUNK, dim)
    if std > 0:
        nn.init.trunc_normal_(x, std=std, a=-3 * std, b=3 * std, generator=generator)
        return x * scale if scale != 1 else x
    return x.zero_()
