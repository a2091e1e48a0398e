"""Parcae in the one runtime, against the reference (``sandyresearch/parcae`` at commit dee8363) in float64, on the
``parcae-tiny`` fixture in Parcae's own format (config.json with ``_class_name: "ParcaeConfig"``, pytorch_model.bin).

The reference rounds its logits to float32 and computes its norms and rotary products as the runtime does, so the
runtime's float64 logits rounded to float32 equal the reference's bit for bit, and states agree to 4e-15."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import FIXTURES, random_model
from safetensors.torch import load_file

import looped_kv
from looped_kv import make_policy
from looped_kv.decoding.passes import new_cache, run_pass
from looped_kv.runtime.attention import CausalRouter, Site
from looped_kv.runtime.cache import CachePass
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.loading import load, save
from looped_kv.runtime.memory import m_deep, m_full, m_ripe, policy_bytes

FOLDER = FIXTURES / "parcae-tiny"
LOOPS = (1, 3, 6, 8)  # the loop counts of the reference's logits_steps{s}


@pytest.fixture(scope="module")
def parcae() -> tuple[looped_kv.LoopedLM, dict[str, torch.Tensor]]:
    return load(FOLDER, dtype=torch.float64), load_file(FOLDER / "reference.safetensors")


def as_float32(logits: torch.Tensor) -> torch.Tensor:
    """The runtime's float64 logits as the reference returns them: rounded to float32."""
    assert logits.dtype == torch.float64
    return logits.float().double()


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-14) -> None:
    assert actual.dtype == expected.dtype == torch.float64
    assert ((actual - expected).abs().max() / expected.abs().max()).item() < tolerance


def test_config_is_read_from_the_checkpoints_own_format(parcae):
    model, _ = parcae
    cfg, raw = model.config, model.config.raw
    assert "model_type" not in raw and raw["_class_name"] == "ParcaeConfig"
    assert (cfg.family, cfg.norm_layout, cfg.n_prelude, cfg.n_core, cfg.n_coda) == ("parcae", "pre-norm", 2, 2, 2)
    assert (cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate_size, cfg.vocab_size, cfg.block_size) == (
        64, 4, 4, 256, 96, 64)
    assert (cfg.mean_recurrence, cfg.mean_backprop_depth, cfg.rope_base, cfg.norm_eps) == (8, 4, 50000.0, 1e-5)
    assert cfg.tie_embeddings and model.lm_head.weight is model.transformer.wte.weight
    assert cfg.state_std == pytest.approx((2 / (5 * 64)) ** 0.5) and cfg.embed_scale == 1
    # value embeddings where both the table (e = 1, 3, 5) and the gate exist: layer 1 of prelude, core and coda
    assert cfg.value_embeds == (1, 3, 5)
    blocks = [*model.transformer.prelude, *model.transformer.core_block, *model.transformer.coda]
    assert [block.value_embed for block in blocks] == [None, "1", None, "3", None, "5"]
    assert cfg.layer_passes(8) == 2 + 8 * 2 + 2


def test_forward_after_every_loop_count(parcae):
    """Logits (rounded to float32, as the reference returns them) equal the reference's bit for bit at every loop
    count, from the reference's explicit initial state; the state after s loops (the input of C), the prelude's
    output after ln_prelude and the head's input (ln_f's output) agree to float64 rounding."""
    model, ref = parcae
    ids, states = ref["input_ids"], ref["input_states"]
    assert torch.equal(model.embed(ids, torch.arange(12), CausalRouter()), ref["prelude_output"])
    for s in LOOPS:
        logits, state = model(ids, num_loops=s, initial_state=states, return_state=True)
        assert torch.equal(as_float32(logits), ref[f"logits_steps{s}"]), s
        close(state, ref[f"state_steps{s}"])
        close(logits, ref[f"hidden_steps{s}"] @ model.lm_head.weight.T)
    assert torch.equal(as_float32(model(ids, initial_state=states)), ref["logits_steps8"])  # mean_recurrence loops


def reference_slot(model, j: int) -> Site:
    """The reference cache's slot j as a Site: prelude layer j; core n_pre + r n_core + l (r 0-based); then coda."""
    cfg, R = model.config, model.config.mean_recurrence
    if j < cfg.n_prelude:
        return Site("prelude", j)
    if j < cfg.n_prelude + R * cfg.n_core:
        loop, layer = divmod(j - cfg.n_prelude, cfg.n_core)
        return Site("core", layer, loop + 1)
    return Site("coda", j - cfg.n_prelude - R * cfg.n_core)


def prefill_then_decode(model, ref, policy):
    """Tokens 0..7 in one call, then 8..11 one at a time, 8 loops each, each call from its slice of the reference's
    initial states."""
    ids, states, R = ref["input_ids"], ref["input_states"], model.config.mean_recurrence
    cache = new_cache(model, policy, batch=2, capacity=12)
    logits, _ = run_pass(model, ids[:, :8], CachePass(cache, range(0, 8)), R, states[:, :8])
    cache.advance(8)
    steps = []
    for p in range(8, 12):
        step, _ = run_pass(model, ids[:, p:p + 1], CachePass(cache, range(p, p + 1)), R, states[:, p:p + 1])
        cache.advance(1)
        steps.append(step)
    return cache, logits, steps


def test_prefill_decode_and_every_cache_entry(parcae):
    """The full cache: prefill and decode logits equal the reference's bit for bit (and the no-cache forward's), and
    every one of the reference's 20 slots, keys after rotary and QK norm and values after the value embedding, is the
    runtime's plane at that site."""
    model, ref = parcae
    R = model.config.mean_recurrence
    cache, logits, steps = prefill_then_decode(model, ref, make_policy("full", R))
    assert torch.equal(as_float32(logits), ref["prefill_logits"])
    for p, step in zip(range(8, 12), steps, strict=True):
        assert torch.equal(as_float32(step), ref[f"decode_logits_pos{p}"])
        assert torch.equal(as_float32(step), ref["logits_steps8"][:, p:p + 1])
    slots = sorted(int(key.removeprefix("keys_step")) for key in ref if key.startswith("keys_step"))
    assert slots == list(range(model.config.layer_passes(R)))
    for j in slots:
        site = reference_slot(model, j)
        for which, name in enumerate(("keys", "values")):
            if site.stage == "core":
                stored = cache.plane_tensor(which, site, site.loop)[:, :, :12]
            else:
                stored = cache.edge[which][cache.edge_index(site)]
            close(stored, ref[f"{name}_step{j}"])


@pytest.mark.parametrize("N, policy", [(1, ("deepest", {})), (1, ("k-deepest", {"k": 1})),
                                       (2, ("k-deepest", {"k": 2}))])
def test_compress_s_is_the_k_deepest_plane_cache(parcae, N, policy):
    """The reference's compress-sN (core layer l at loop r in slot (r mod N), overwritten) is the package's k-deepest
    cache with k = N (compress-s1: the deepest plane): its prefill equals the full one, its decoding the reference's
    bit for bit, and not the full cache's."""
    model, ref = parcae
    name, params = policy
    _, logits, steps = prefill_then_decode(model, ref, make_policy(name, model.config.mean_recurrence, **params))
    assert torch.equal(as_float32(logits), ref[f"compress_s{N}_prefill_logits"])
    assert torch.equal(ref[f"compress_s{N}_prefill_logits"], ref["prefill_logits"])
    for p, step in zip(range(8, 12), steps, strict=True):
        assert torch.equal(as_float32(step), ref[f"compress_s{N}_decode_logits_pos{p}"])
        assert not torch.allclose(step, ref[f"decode_logits_pos{p}"], atol=1e-3)


@pytest.mark.parametrize("R", [1, 2, 5, 8, 32])
def test_compress_s_reads_what_k_deepest_reads(R):
    """compress-sN's rule, for every loop r (1-based) and N: earlier tokens are read at the last loop r' <= R with
    r' = r (mod N), which is k-deepest(N)'s plane(r); k-deepest(1) is the deepest plane."""
    for N in range(1, R + 1):
        policy = make_policy("k-deepest", R, k=N)
        for r in range(1, R + 1):
            assert policy.plane(r) == max(q for q in range(1, R + 1) if q % N == r % N)
    assert make_policy("k-deepest", R, k=1).kept == make_policy("deepest", R).kept == (R,)


def test_loop_and_readout_need_the_token_ids(parcae):
    model, ref = parcae
    ids, positions, router = ref["input_ids"], torch.arange(12), CausalRouter()
    embedded = model.embed(ids, positions, router)
    state = model.loop(ref["input_states"], embedded, positions, router, 1, tokens=ids)
    logits = model.readout(state, positions, router, tokens=ids)
    assert torch.equal(as_float32(logits), ref["logits_steps1"])
    with pytest.raises(ValueError, match="value embeddings read the token ids: pass tokens"):
        model.loop(ref["input_states"], embedded, positions, router, 1)
    with pytest.raises(ValueError, match="value embeddings read the token ids: pass tokens"):
        model.readout(state, positions, router)


@pytest.mark.parametrize("change, message", [
    ({"_class_name": "GPTConfig"}, "Parcae config.json _class_name must be 'ParcaeConfig', got 'GPTConfig'"),
    ({"injection_type": "linear"}, "Parcae config.json injection_type must be 'diagonal', got 'linear'"),
    ({"block_class_name": "TransformerSandwichBlock"},
     "Parcae config.json block_class_name must be 'TransformerPreNormBlock', got 'TransformerSandwichBlock'"),
    ({"nonlin_name": "GELU"}, "Parcae config.json nonlin_name must be 'ReLU2', got 'GELU'"),
    ({"qk_norm": False}, "Parcae config.json qk_norm must be True, got False"),
    ({"logit_softcap": 30.0}, "Parcae config.json logit_softcap must be None, got 30.0"),
    ({"recurrent_embedding_dimension": 128},
     "Parcae config.json recurrent_embedding_dimension must equal 64 (the model's width), got 128"),
    ({"num_key_value_heads": 2}, "Parcae config.json num_key_value_heads must equal num_attention_heads (4), got 2"),
    ({"rope_settings": {"use_rope": False}}, "Parcae config.json rope_settings must have use_rope true"),
])
def test_a_config_it_cannot_run_is_refused_in_one_line(tmp_path, change, message):
    raw = json.loads((FOLDER / "config.json").read_text())
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        LoopedConfig.from_hf_dict(raw | change)
    assert "\n" not in str(error.value)
    folder = tmp_path / "bad"
    shutil.copytree(FOLDER, folder)
    (folder / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'config.json'}: {message}")):
        load(folder)


def test_the_weights_are_read_without_unpickling_objects(tmp_path):
    """pytorch_model.bin goes through torch.load(weights_only=True): a pickled object is refused, and so is a state
    dict that does not fit the config."""
    folder = tmp_path / "bad"
    shutil.copytree(FOLDER, folder)
    torch.save({"transformer.wte.weight": torch.zeros(2), "evil": print}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"is not a readable state dict for torch\.load\(weights_only=True\)"):
        load(folder)
    state = torch.load(FOLDER / "pytorch_model.bin", weights_only=True)
    del state["transformer.core_block.1.attn.ve_gate.weight"]
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=re.escape("missing tensor 'transformer.core_block.1.attn.ve_gate.weight'")):
        load(folder)
    with pytest.raises(ValueError, match="a Parcae model is loaded from its own checkpoint"):
        save(load(FOLDER), tmp_path / "copy")


def test_special_token_roles_follow_parcaes_tokenizer(tmp_path):
    """A tokenizer.json alone (what Parcae's training script writes) names no roles; the loader gives bos, eos and
    pad the tokens Parcae's code trains for them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"])
    tokenizer.train_from_iterator(["a looped model reads its prefix"] * 4, trainer)
    folder = tmp_path / "with-tokenizer"
    shutil.copytree(FOLDER, folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    loaded = load(folder).tokenizer
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 2)
    assert loaded.encode("a looped model")[0] not in (0, 1, 2)  # nothing is prepended


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_are_the_memory_equations_at_parcaes_layer_counts(dtype):
    """Eq. (3) and (10) with Parcae's 2/2/2 layers and R = 8: M_full = b L (2 + 2 + 8 x 2), M_deep = b L (2 + 2 + 2),
    M_RIPE = M_deep + b 2 7 min(W, L), b = 2 x 4 heads x 16 x bytes; the caches hold exactly these bytes."""
    model = load(FOLDER, dtype=dtype)
    cfg, L, R = model.config, 12, model.config.mean_recurrence
    b = 2 * 4 * 16 * torch.empty((), dtype=dtype).element_size()
    assert m_full(cfg, L, dtype=dtype) == b * L * 20 and m_deep(cfg, L, dtype) == b * L * 6
    assert m_ripe(cfg, L, 3, dtype=dtype) == b * L * 6 + b * 2 * 7 * 3
    ids = load_file(FOLDER / "reference.safetensors")["input_ids"][:1]
    for name, params, equation in [("full", {}, m_full(cfg, L, R, dtype)), ("deepest", {}, m_deep(cfg, L, dtype)),
                                   ("ripe", {"window": 3}, m_ripe(cfg, L, 3, R, dtype)),
                                   ("k-deepest", {"k": 2}, b * L * (2 + 2 + 2 * 2))]:
        policy = make_policy(name, R, **params)
        cache = new_cache(model, policy, batch=1, capacity=L)
        assert cache.allocated_bytes == policy_bytes(cfg, policy, L, dtype) == equation
        logits, _ = run_pass(model, ids, CachePass(cache, range(0, L)), R)
        cache.advance(L)
        assert cache.nbytes == equation and torch.isfinite(logits).all()


def test_a_random_parcae_model_runs_with_grouped_query_heads():
    """The runtime's Parcae blocks take any head layout (the loader refuses what the checkpoints do not have)."""
    model = random_model("parcae")
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    assert model.config.n_kv_heads == 2 and model(ids, num_loops=3).shape == (2, 6, model.config.vocab_size)


def test_teacher_forcing_gives_parcae_its_token_ids(parcae):
    """Teacher forcing's d-loop drafts call the model's loop and readout themselves: on Parcae they pass the token ids
    its value embeddings read, and a full-depth draft is the sequence's own token."""
    from looped_kv.analysis.teacher_forcing import force
    from looped_kv.runtime.policy import ALIGNED

    model, ref = parcae
    R = model.config.mean_recurrence
    greedy = looped_kv.generate(model, list(ref["input_ids"][:, :6]), max_new_tokens=5, stop_at_eos=False)
    forced = force(model, list(greedy.tokens), [6, 6], make_policy("full", R), depths=(2, R), reads={"a": ALIGNED})
    assert (forced.hits[(R, "a")] == 4).all()


@pytest.mark.parametrize("name, layers, width, params", [
    ("parcae-140m", 2, 768, 140e6), ("parcae-370m", 4, 1024, 370e6), ("parcae-770m", 6, 1280, 770e6),
    ("parcae-1.3b", 8, 1536, 1.3e9)])
def test_presets_are_the_published_configs(name, layers, width, params):
    """Each preset is the fixture's format at its published dimensions (the fixture's config with them reads back as
    the preset), has the parameter count its name says (within 15%), and its full cache at R = 8 holds
    b (2 + 8) n_layers bytes per token (Eq. 3)."""
    from looped_kv.analysis.plan import parameter_count
    from looped_kv.runtime.config import PRESETS

    preset = PRESETS[name]()
    raw = json.loads((FOLDER / "config.json").read_text()) | {
        "n_embd": width, "num_attention_heads": width // 128, "num_key_value_heads": width // 128,
        "intermediate_size": 4 * width, "recurrent_embedding_dimension": width,
        "recurrent_intermediation_embedding_dimension": 4 * width, "n_layers_in_prelude": layers,
        "n_layers_in_recurrent_block": layers, "n_layers_in_coda": layers, "vocab_size": 32768,
        "padded_vocab_size": 32768, "block_size": 2048}
    assert LoopedConfig.from_hf_dict(raw) == preset
    assert abs(parameter_count(preset) / params - 1) < 0.15
    assert m_full(preset, 1) == 2 * width * 2 * (2 + 8) * layers
