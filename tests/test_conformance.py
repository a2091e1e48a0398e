"""The runtime equals the public reference implementations on checkpoints in their exact format.

Every fixture (Huginn-0125, Raven-Llama, Raven-OLMo) was run by its family's reference code in float64.
Huginn's reference casts its logits to float32 (``lm_head(x).float()``), so its logits are compared after
the same cast; everything else agrees to float64 rounding (in fact bitwise).
"""

from __future__ import annotations

import re

import pytest
import torch

from looped_kv import CausalRouter, Site, make_policy
from looped_kv.decoding.passes import new_cache, run_pass
from looped_kv.runtime.cache import CachePass


def as_reference(model, logits: torch.Tensor) -> torch.Tensor:
    return logits.float().double() if model.config.family == "huginn" else logits


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    assert ((actual - expected).abs().max() / scale).item() < 1e-12


@pytest.mark.parametrize("loops", [1, 3, 6])
def test_full_forward_logits(fixture_model, loops):
    model, ref = fixture_model
    logits = model(ref["input_ids"], num_loops=loops, initial_state=ref["input_states"])
    close(as_reference(model, logits), ref[f"logits_steps{loops}"])


@pytest.mark.parametrize("loops", [1, 3, 6])
def test_final_latents(fixture_model, loops):
    model, ref = fixture_model
    if f"latents_steps{loops}" not in ref:
        pytest.skip("the Raven reference does not export latents")
    _, state = model(ref["input_ids"], num_loops=loops, initial_state=ref["input_states"], return_state=True)
    close(model.transformer.ln_f(state), ref[f"latents_steps{loops}"])


@pytest.mark.parametrize("shape", [(2, 12, 7), (1, 12, None), (2, 11, None), (12, None)])
def test_wrong_initial_state_shape_is_rejected(fixture_model, shape):
    model, ref = fixture_model
    ids = ref["input_ids"][:2, :12]
    shape = tuple(model.config.n_embd if d is None else d for d in shape)
    expected = re.escape(f"initial_state must have shape (batch, length, n_embd) = {(2, 12, model.config.n_embd)}, "
                         f"got {shape}")
    with pytest.raises(ValueError, match=expected):
        model(ids, num_loops=1, initial_state=torch.zeros(shape, dtype=model.dtype))


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_token_ids_outside_the_vocabulary_are_rejected(fixture_model, bad):
    model, ref = fixture_model
    V = model.config.vocab_size
    ids = ref["input_ids"].clone()
    ids[0, 3] = V if bad == "vocab" else bad
    with pytest.raises(ValueError, match=rf"input_ids must be token ids in \[0, {V - 1}\] \(vocab_size {V}\)"):
        model(ids, num_loops=1)


@pytest.mark.parametrize("ids", [torch.zeros(5, dtype=torch.long), torch.zeros(1, 5),
                                 torch.zeros(1, 5, dtype=torch.bool)])
def test_input_ids_must_be_a_2d_integer_tensor(fixture_model, ids):
    model, _ = fixture_model
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor of shape \(batch, length\)"):
        model(ids, num_loops=1)


def test_positions_beyond_the_context_still_rejected(fixture_model):
    model, ref = fixture_model
    ids = ref["input_ids"][:, :2]
    positions = torch.tensor([0, model.config.block_size])
    with pytest.raises(ValueError, match=rf"positions reach {model.config.block_size}, beyond the model's context"):
        model(ids, num_loops=1, positions=positions)


def reference_step(model, s: int) -> Site:
    """The reference's attention-call counter s as a Site: prelude 0.., core n_pre + n_core r + l, coda -1, -2, ..."""
    cfg = model.config
    if s < 0:
        return Site("coda", -s - 1)
    if s < cfg.n_prelude:
        return Site("prelude", s)
    loop, layer = divmod(s - cfg.n_prelude, cfg.n_core)
    return Site("core", layer, loop + 1)


def prefill_then_decode(model, ref, cache_name: str):
    """Prefill 8 tokens with a cache, then decode tokens 8..11 one at a time, 6 loops each."""
    ids, states = ref["input_ids"], ref["input_states"]
    cache = new_cache(model, make_policy(cache_name, 6), batch=2, capacity=12)
    logits, _ = run_pass(model, ids[:, :8], CachePass(cache, range(0, 8)), 6, states[:, :8])
    cache.advance(8)
    steps = []
    for p in range(8, 12):
        step_logits, _ = run_pass(model, ids[:, p:p + 1], CachePass(cache, range(p, p + 1)), 6, states[:, p:p + 1])
        cache.advance(1)
        steps.append(step_logits)
    return cache, logits, steps


def test_prefill_and_decode_with_full_cache(fixture_model):
    model, ref = fixture_model
    _, logits, steps = prefill_then_decode(model, ref, "full")
    close(as_reference(model, logits), ref["prefill_logits"])
    for p, step_logits in zip(range(8, 12), steps, strict=True):
        close(as_reference(model, step_logits), ref[f"decode_logits_pos{p}"])
        close(as_reference(model, step_logits), ref["logits_steps6"][:, p:p + 1])


def test_every_cached_plane(fixture_model):
    model, ref = fixture_model
    cfg = model.config
    cache, _, _ = prefill_then_decode(model, ref, "full")
    steps = [s for s in range(-cfg.n_coda, cfg.n_prelude + 6 * cfg.n_core)]
    assert len(steps) == cfg.layer_passes(6)
    for s in steps:
        site = reference_step(model, s)
        for which, name in enumerate(("keys", "values")):
            if site.stage == "core":
                stored = cache.plane_tensor(which, site, site.loop)[:, :, :12]
            else:
                stored = cache.edge[which][cache.edge_index(site)]
            close(stored, ref[f"{name}_step{s}"])


def test_compress_s4_is_the_deepest_plane_cache(fixture_model):
    model, ref = fixture_model
    if "compress_s4_prefill_logits" not in ref:
        pytest.skip("the compress run exists for Huginn only")
    _, logits, steps = prefill_then_decode(model, ref, "deepest")
    close(as_reference(model, logits), ref["compress_s4_prefill_logits"])
    for p, step_logits in zip(range(8, 12), steps, strict=True):
        close(as_reference(model, step_logits), ref[f"compress_s4_decode_logits_pos{p}"])


def test_recorded_keys_match_reference(fixture_model):
    """The plain forward's recorded keys/values are the cache entries of the reference run."""
    model, ref = fixture_model
    record: dict = {}
    model(ref["input_ids"], num_loops=6, initial_state=ref["input_states"], router=CausalRouter(record))
    for s in (0, model.config.n_prelude, model.config.n_prelude + 5 * model.config.n_core + 1, -1):
        k, v = record[reference_step(model, s)]
        close(k, ref[f"keys_step{s}"])
        close(v, ref[f"values_step{s}"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_interleaved_rotary_is_the_pairwise_rotation_bit_for_bit(dtype):
    """Huginn's rotary, laid out per element (x cos' + swap(x) sin'), is (a cos - b sin, b cos + a sin) per pair,
    computed in float32 as the reference does, to the last bit."""
    from looped_kv.runtime.config import LoopedConfig
    from looped_kv.runtime.loading import TINY_DIR
    from looped_kv.runtime.model import Rotary

    config = LoopedConfig.from_file(TINY_DIR / "config.json")
    D = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
    positions = torch.tensor([[0, 17, 200], [3, 5, config.block_size - 1]])
    x = torch.randn(2, 3, 2, D, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos, sin = angles.cos()[positions].unsqueeze(-2), angles.sin()[positions].unsqueeze(-2)
    a, b = x.float()[..., 0::2], x.float()[..., 1::2]
    expected = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).type_as(x)
    assert torch.equal(Rotary(config)(x, positions), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dim", [128, 100, 5120])
def test_rms_norm_is_the_references_formula_bit_for_bit(dtype: torch.dtype, dim: int) -> None:
    """The blocks' norm (one fused call in float32) is the reference's x * rsqrt(mean(x^2) + eps), in float32
    whatever the dtype, times the weight, to the last bit."""
    from looped_kv.runtime.model import rms_norm

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 17, dim, generator=generator) * 3).to(dtype)
    weight = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * weight
    assert torch.equal(rms_norm(x, weight, 1e-6), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 31, 256])
def test_causal_attention_is_the_triangular_mask_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    """A causal block (queries as many as keys) uses the fused kernel's causal mode: on a CPU, the same result as
    the explicit lower-triangular mask, to the last bit."""
    from looped_kv.runtime.attention import attend

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 64, generator=generator).to(dtype) for _ in range(3))
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(attend(q, k, v, causal=True), attend(q, k, v, mask))
