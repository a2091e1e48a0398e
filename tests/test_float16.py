"""Float16, the precision of the T4 profiles: close to float64 on every fixture, and an overflow stops the run with one
line naming where and the remedy.

Tolerance: a float16 forward's logits are within 2e-2 of the float64 reference, relative to its largest logit (about
20 float16 rounding steps; measured at most 1.2e-2, on Raven-OLMo), and closer than bfloat16's."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import FIXTURES, random_model
from safetensors.torch import load_file

import looped_kv
from looped_kv import make_policy
from looped_kv.cli import main
from looped_kv.decoding.passes import new_cache, prefill, step
from looped_kv.runtime.loading import load, save
from looped_kv.runtime.model import Float16Overflow

FLOAT16_TOLERANCE = 2e-2
FIXTURE_LOOPS = {"huginn-tiny": 6, "raven-llama-tiny": 6, "raven-olmo-tiny": 6, "ouro-tiny": 4, "ouro-mha-tiny": 3,
                 "ouro-gqa-deep-tiny": 5}


def error(folder: str, dtype: torch.dtype, ref: dict[str, torch.Tensor]) -> float:
    model, loops = load(FIXTURES / folder, dtype=dtype), FIXTURE_LOOPS[folder]
    states = {} if model.config.family == "ouro" else {"initial_state": ref["input_states"]}
    with torch.no_grad():
        logits = model(ref["input_ids"], num_loops=loops, **states).double()
    expected = ref[f"logits_steps{loops}"]
    return float((logits - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("folder", sorted(FIXTURE_LOOPS))
def test_float16_is_close_to_the_float64_reference(folder):
    ref = load_file(FIXTURES / folder / "reference.safetensors")
    half = error(folder, torch.float16, ref)
    assert half < FLOAT16_TOLERANCE and half < error(folder, torch.bfloat16, ref)


def test_float16_decoding_with_a_cache_is_close_to_float64():
    """Ouro's fixture prefilled and decoded one token at a time in float16, under the full cache and the deepest
    plane: the logits are close to the float64 reference's (the full cache) and to float64 decoding under the same
    policy (the deepest plane)."""
    ref = load_file(FIXTURES / "ouro-tiny" / "reference.safetensors")
    ids = ref["input_ids"]
    for policy in ("full", "deepest"):
        runs = {}
        for dtype in (torch.float16, torch.float64):
            model = load(FIXTURES / "ouro-tiny", dtype=dtype)
            cache = new_cache(model, make_policy(policy, 4), batch=2, capacity=12)
            with torch.no_grad():
                runs[dtype] = torch.cat([prefill(model, cache, ids[:, :8], 4)]
                                        + [step(model, cache, ids[:, p:p + 1], 4) for p in range(8, 12)], 1).double()
        expected = runs[torch.float64]
        if policy == "full":
            assert torch.allclose(expected[:, 8:], ref["logits_steps4"][:, 8:], rtol=0, atol=1e-12)
        assert float((runs[torch.float16] - expected).abs().max() / expected.abs().max()) < FLOAT16_TOLERANCE


def overflowing(family: str, where: str) -> looped_kv.LoopedLM:
    """A random model in float16 whose state (Ouro: the final norm that ends every loop) or head (untied) overflows."""
    model = random_model(family, seed=3)
    with torch.no_grad():
        if where == "state":
            model.transformer.ln_f.weight.fill_(6e4)
        else:
            model.lm_head.weight.mul_(1e5)  # still finite in float16 (at most 65,504), its products not
    return model.half()


def test_a_float16_overflow_stops_the_run_naming_the_loop():
    model, ids = overflowing("ouro", "state"), torch.randint(0, 50, (1, 5))
    message = re.escape("float16 overflow: inf or NaN in the state after loop 1 (positions 0-4); run this model in "
                        "float32 (LOOPED_KV_DTYPE=float32, or load(..., dtype='float32'))")
    with pytest.raises(Float16Overflow, match=message):
        model(ids, num_loops=4)
    for method in ("ar", "self-spec", "das-wave"):
        with pytest.raises(Float16Overflow, match="float16 overflow: inf or NaN in the state after loop 1"):
            options = {"draft_loops": 2} if method == "self-spec" else {}  # options a method does not take are refused
            looped_kv.generate(model, ids, max_new_tokens=4, method=method, num_loops=4, **options)
    with pytest.raises(Float16Overflow, match=r"float16 overflow: inf or NaN in the logits \(positions 0-4\)"):
        overflowing("raven", "logits")(ids, num_loops=2)
    model.float()(ids, num_loops=2)  # the remedy: float32 runs


def test_the_command_line_stops_in_one_line(tmp_path, capsys):
    """A float16 generation that overflows ends with one line and status 2, before printing a completion."""
    model = load("tiny")
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(1e4)  # the last norm before the head: only the logits overflow
    folder = save(model, tmp_path / "overflowing")
    assert main(["generate", "--model", str(folder), "--dtype", "float16", "--device", "cpu", "--max-new-tokens",
                 "2", "Question: 2 + 3 = ?"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("looped-kv generate: error: float16 overflow: inf or NaN in the logits "
                                   "(positions 0-")
