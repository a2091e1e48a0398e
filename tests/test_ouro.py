"""Ouro in the one runtime, against the reference (``modeling_ouro.py``) in float64, on three fixtures in Ouro's own
format: ``ouro-tiny`` (the shared fixture: GQA 4/2 heads, 3 layers, 4 loops) and two held out from the development of
the loader (``ouro-mha-tiny``: MHA, 2 layers, 3 loops, rope_theta 10^4; ``ouro-gqa-deep-tiny``: 6/3 heads, 4 layers,
5 loops, rope_theta 5·10^5; tests/fixtures/README.md says how they were made).

Norms and rotary are computed in float32 as the reference does, so the forward agrees to float64 rounding (1e-13
relative here; most entries are equal bit for bit)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import FIXTURES, random_model
from safetensors.torch import load_file, save_file

import looped_kv
from looped_kv import make_policy
from looped_kv.decoding.passes import new_cache, run_pass
from looped_kv.runtime import exit_gate
from looped_kv.runtime.cache import CachePass
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.loading import load, save

OURO_FIXTURES = ("ouro-tiny", "ouro-mha-tiny", "ouro-gqa-deep-tiny")
TOLERANCE = 1e-13  # relative to the largest reference entry


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.float64
    assert ((actual - expected).abs().max() / expected.abs().max()).item() < TOLERANCE


@pytest.fixture(scope="module", params=OURO_FIXTURES)
def ouro(request) -> tuple[looped_kv.LoopedLM, dict[str, torch.Tensor]]:
    folder = FIXTURES / request.param
    return load(folder, dtype=torch.float64), load_file(folder / "reference.safetensors")


def test_config_is_read_from_the_checkpoints_own_format(ouro):
    model, _ = ouro
    cfg, raw = model.config, model.config.raw
    assert (cfg.family, cfg.n_prelude, cfg.n_coda, cfg.norm_layout) == ("ouro", 0, 0, "peri-norm")
    assert (cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_core, cfg.intermediate_size) == (
        raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"],
        raw["num_hidden_layers"], raw["intermediate_size"])
    assert (cfg.mean_recurrence, cfg.exit_threshold, cfg.rope_base, cfg.norm_eps, cfg.block_size) == (
        raw["total_ut_steps"], raw["early_exit_threshold"], raw["rope_theta"], raw["rms_norm_eps"],
        raw["max_position_embeddings"])
    assert not cfg.tie_embeddings and "adapter" not in model.transformer
    assert cfg.layer_passes(cfg.mean_recurrence) == cfg.mean_recurrence * cfg.n_core


def test_forward_after_every_loop_count(ouro):
    """A model read out after s <= S loops equals the reference's model built with total_ut_steps = s."""
    model, ref = ouro
    S = model.config.mean_recurrence
    for s in range(1, S + 1):
        logits, state = model(ref["input_ids"], num_loops=s, return_state=True)
        close(logits, ref[f"logits_steps{s}"])
        close(state, ref[f"hidden_steps{s}"])  # the loop's output after model.norm, which the head reads
    close(model(ref["input_ids"]), ref[f"logits_steps{S}"])  # the default: total_ut_steps loops


def reference_slot(model, site: looped_kv.Site) -> int:
    """Ouro's UniversalTransformerCache slot of a core site: (u = loop - 1) * num_hidden_layers + layer."""
    return (site.loop - 1) * model.config.n_core + site.layer


def prefill_then_decode(model, ref, policy: str = "full"):
    """Prefill 8 tokens into a cache, then decode tokens 8..11 one at a time, S loops each."""
    ids, S = ref["input_ids"], model.config.mean_recurrence
    cache = new_cache(model, make_policy(policy, S), batch=2, capacity=12)
    logits, _ = run_pass(model, ids[:, :8], CachePass(cache, range(0, 8)), S)
    cache.advance(8)
    steps = []
    for p in range(8, 12):
        step_logits, _ = run_pass(model, ids[:, p:p + 1], CachePass(cache, range(p, p + 1)), S)
        cache.advance(1)
        steps.append(step_logits)
    return cache, logits, steps


def test_prefill_decode_and_every_cache_entry(ouro):
    """Loop r of layer l writes plane r at core layer l: the reference's slot (r - 1) * layers + l."""
    model, ref = ouro
    cfg, S = model.config, model.config.mean_recurrence
    cache, logits, steps = prefill_then_decode(model, ref)
    close(logits, ref["prefill_logits"])
    for p, step_logits in zip(range(8, 12), steps, strict=True):
        close(step_logits, ref[f"decode_logits_pos{p}"])
        close(step_logits, ref[f"logits_steps{S}"][:, p:p + 1])
    slots = set()
    for r in range(1, S + 1):
        for layer in range(cfg.n_core):
            site = looped_kv.Site("core", layer, r)
            u, slot_layer = divmod(reference_slot(model, site), cfg.n_core)
            slots.add((u, slot_layer))
            close(cache.plane_tensor(0, site, r)[:, :, :12], ref[f"keys_ut{u}_layer{slot_layer}"])
            close(cache.plane_tensor(1, site, r)[:, :, :12], ref[f"values_ut{u}_layer{slot_layer}"])
    assert len(slots) == len([k for k in ref if k.startswith("keys_ut")]) == S * cfg.n_core
    assert cache.edge[0].shape[0] == 0  # no prelude or coda planes


def test_exit_gate_and_its_readouts(ouro):
    model, ref = ouro
    out = exit_gate.loop_outputs(model, ref["input_ids"])
    close(out.gate_logits, ref["exit_gate_logits"])
    close(out.pdf, ref["exit_pdf"])
    assert torch.allclose(out.pdf.sum(-1), torch.ones(()).double(), rtol=0, atol=1e-14)
    loop_logits = out.logits(model)
    close(exit_gate.expected_logits(loop_logits, out.pdf), ref["logits_weighted_exit"])
    logits, steps = exit_gate.threshold_logits(loop_logits, out.pdf, 0.5)
    assert torch.equal(steps, ref["exit_step_threshold_0p5"])
    rows = list(ref["input_ids"].split(1))
    assert torch.equal(exit_gate.threshold_steps(model, rows, 0.5), steps.reshape(-1))
    assert (exit_gate.threshold_steps(model, rows) == model.config.mean_recurrence - 1).all()  # 1.0, float64
    close(logits, ref["logits_exit_threshold_0p5"])
    # the checkpoints' threshold 1.0 reads out the last loop in float64: the runtime's forward
    logits, steps = exit_gate.threshold_logits(loop_logits, out.pdf, model.config.exit_threshold)
    assert (steps == model.config.mean_recurrence - 1).all()
    close(logits, ref[f"logits_steps{model.config.mean_recurrence}"])


def test_the_threshold_of_one_can_exit_early_in_float32_but_not_in_float64():
    """The fixture README's hazard: with a stronger gate, float32 rounding lets the cumulative exit probability reach
    1.0 before the last loop for some tokens, which the HF code then reads out early; float64 does not."""
    model = load(FIXTURES / "ouro-tiny", dtype=torch.float64)
    ids = load_file(FIXTURES / "ouro-tiny" / "reference.safetensors")["input_ids"]
    with torch.no_grad():
        model.transformer.exit_gate.bias += 9.0
    last = model.config.mean_recurrence - 1
    early = {}
    for dtype in (torch.float64, torch.float32):
        out = exit_gate.loop_outputs(model.to(dtype), ids)
        early[dtype] = int((exit_gate.threshold_exit(out.pdf, 1.0) < last).sum())
        steps = exit_gate.threshold_steps(model, ids)  # at the config's threshold, 1.0, in the model's dtype
        assert steps.dtype == torch.int64 and torch.equal(steps, exit_gate.threshold_exit(out.pdf, 1.0).reshape(-1))
    assert early[torch.float64] == 0 < early[torch.float32]
    model.config = replace(model.config, exit_threshold=None)
    with pytest.raises(ValueError, match="threshold must be given: this checkpoint's early_exit_threshold is null"):
        exit_gate.threshold_steps(model, ids)


def test_exit_distribution_and_its_summary():
    model = load(FIXTURES / "ouro-tiny", dtype=torch.float64)
    ref = load_file(FIXTURES / "ouro-tiny" / "reference.safetensors")
    prompts = [ref["input_ids"][:1, :7], ref["input_ids"][1:]]
    pdf = exit_gate.exit_distribution(model, prompts)
    assert pdf.shape == (7 + 12, 4)
    close(pdf[7:], ref["exit_pdf"][1])
    summary = exit_gate.exit_summary(pdf, thresholds=(0.5,))
    assert list(summary.index) == [1, 2, 3, 4]
    assert summary["exits at threshold 0.5"].sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="has no exit gate: only Ouro checkpoints"):
        exit_gate.exit_distribution(random_model("huginn"), prompts[0])


def test_save_writes_ouros_format_and_loads_back(tmp_path):
    model = load(FIXTURES / "ouro-tiny")
    folder = save(model, tmp_path / "copy")
    assert set(load_file(folder / "model.safetensors")) == set(load_file(FIXTURES / "ouro-tiny" / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "ouro" and raw["torch_dtype"] == "float32"
    assert LoopedConfig.from_hf_dict(raw) == model.config
    again = load(folder)
    ids = torch.arange(10)[None]
    assert torch.equal(again(ids), model(ids))
    with pytest.raises(FileExistsError, match="overwrites nothing"):
        save(model, folder)


def test_a_checkpoint_that_does_not_fit_its_config_is_refused(tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(FIXTURES / "ouro-tiny", folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.2.self_attn.k_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape("missing tensor 'model.layers.2.self_attn.k_proj.weight'")):
        load(folder)
    raw = json.loads((FIXTURES / "ouro-tiny" / "config.json").read_text())
    for change, message in (({"use_sliding_window": True}, "sliding-window attention is not supported"),
                            ({"head_dim": 8}, "head_dim must be hidden_size / num_attention_heads"),
                            ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling must be null")):
        with pytest.raises(ValueError, match=message):
            LoopedConfig.from_hf_dict(raw | change)
    with pytest.raises(ValueError, match=re.escape("Ouro config.json has no 'hidden_size', 'intermediate_size'") + "$"):
        LoopedConfig.from_hf_dict({k: v for k, v in raw.items() if k not in ("hidden_size", "intermediate_size")})
    assert LoopedConfig.from_hf_dict(raw | {"head_dim": None}).head_dim == raw["head_dim"]  # null: hidden / heads
    with pytest.raises(ValueError, match=re.escape("config 'total_ut_steps' must be an integer, got 2.5")):
        LoopedConfig.from_hf_dict(raw | {"total_ut_steps": 2.5})
    with pytest.raises(ValueError, match="an Ouro model has no prelude or coda"):
        random_model("ouro", n_prelude=1)


def test_initial_state_is_the_embedding():
    model = random_model("ouro")
    ids = torch.randint(0, 50, (2, 5))
    positions = torch.arange(5)
    assert torch.equal(model.initial_state(positions, 2, tokens=ids), model.transformer.wte(ids))
    assert torch.equal(model(ids, num_loops=3), model(ids, num_loops=3, initial_state=model.transformer.wte(ids)))
    with pytest.raises(ValueError, match="initial_state needs tokens"):
        model.initial_state(positions, 2)


DECODERS = {"self-spec": {"draft_loops": 2, "gamma": 3}, "mature-spec": {"draft_loops": 1, "gamma": 3},
            "pld": {"gamma": 3, "ngram": 2},
            "das-wave": {"max_width": 3, "rounds": 3, "initial_width": 2, "updates": 1}}
POLICIES = [("full", {}, True), ("ripe", {"window": 3}, True), ("sinks", {"sinks": 1, "window": 3}, True),
            ("deepest", {}, False), ("k-deepest", {"k": 2}, False), ("share", {"k": 2}, False),
            ("first", {"k": 2}, False), ("ripe", {"window": 1}, False)]


@pytest.mark.parametrize("fixture", ["ouro-tiny", "parcae-tiny"])
@pytest.mark.parametrize("cache, params, exact", POLICIES)
def test_every_decoder_and_cache_on_the_fixture(fixture, cache, params, exact):
    """Ouro's and Parcae's fixtures in float64: under a block-independent cache every decoder emits greedy decoding's
    tokens (greedy target preservation); under the others each runs, and every greedy run equals the no-cache
    forward's argmax where the cache is full."""
    model = load(FIXTURES / fixture, dtype=torch.float64)
    R = model.config.mean_recurrence
    prompts = list(load_file(FIXTURES / fixture / "reference.safetensors")["input_ids"][:, :8])
    greedy = looped_kv.generate(model, prompts, max_new_tokens=16, cache=cache, stop_at_eos=False, **params)
    if cache == "full":
        logits = model(greedy.tokens[:, :-1])
        assert torch.equal(logits[:, 7:].argmax(-1), greedy.new_tokens)
    for method, options in DECODERS.items():
        if method in ("mature-spec", "das-wave") and R not in make_policy(cache, R, **params).kept:
            continue  # deep K/V reads need plane R for every position
        out = looped_kv.generate(model, prompts, max_new_tokens=16, method=method, cache=cache, exact=exact,
                                 stop_at_eos=False, **params, **options)
        if exact:
            assert torch.equal(out.tokens, greedy.tokens), (method, cache)
        assert out.verifications >= 1


def test_chapters_2_and_3_measure_at_ouros_four_loops():
    """Ripening fits over loops 1..3 (Table 7's 8..31 scaled to R = 4), and substitution arms whose planes all
    perturb their region (the shallow region is loop 1 alone, so plane 1 is no arm there): every size > 0, and the
    sensitivity regression, region contrast and Eq. (6) check run, as chapters 2 and 3 call them."""
    from looped_kv.analysis.fits import sensitivity_regression
    from looped_kv.analysis.planes import (
        arm_grid,
        eq6_check,
        exact_replay,
        in_dtype,
        precision_floor,
        region_contrast,
        regression_rows,
        ripening_curves,
        ripening_summary,
        text_ripening,
    )

    model = load(FIXTURES / "ouro-tiny")
    R = model.config.mean_recurrence
    ids = torch.randint(0, model.config.vocab_size, (4, 20), generator=torch.Generator().manual_seed(0))
    fp32 = ripening_curves(model, ids, R, decoded=4, chunk=2, exact_dtype=torch.float64)
    bf16 = ripening_curves(in_dtype(model, torch.bfloat16), ids, R, decoded=4, maturity_kinds=(), chunk=2)
    fits = ripening_summary(fp32, bf16)
    assert all(f.geometric.loop_range == (1, 3) for f in fits.values()) and fp32.fitted("k").shape == (4, 3)
    assert len(text_ripening(fp32, {X: fp32.float_floor(X) for X in ("k", "v")})) == 4
    grid = arm_grid(model, ids, R, decoded=4, progress=False)
    assert sorted(grid.rows.plane.unique()) == [2, 3, 4] and (grid.rows["size"] > 0).all()
    floor = float(precision_floor(model, grid.reference, exact=exact_replay(model, ids, R, decoded=4)).max())
    fit = sensitivity_regression(regression_rows(grid, floor), floor=floor)
    assert region_contrast(grid.rows, floor).shape == (4, 2)
    assert eq6_check(model, grid.reference, fit, grid).measured.shape == (4,)
