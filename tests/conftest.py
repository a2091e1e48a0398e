from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looped_kv import LoopedConfig, LoopedLM, load
from looped_kv.book import encrypt_kernel_channels
from looped_kv.decoding import compiled

FIXTURES = Path(__file__).parent / "fixtures"
FAMILY_FIXTURES = {"huginn": "huginn-tiny", "raven": "raven-llama-tiny", "raven-olmo": "raven-olmo-tiny"}

torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """nbval's chapter kernels run over encrypted channels, as the book build's do."""
    encrypt_kernel_channels()


@pytest.fixture(scope="session", params=sorted(FAMILY_FIXTURES))
def fixture_model(request) -> tuple[LoopedLM, dict[str, torch.Tensor]]:
    """A fixture checkpoint in float64 and its reference outputs."""
    folder = FIXTURES / FAMILY_FIXTURES[request.param]
    return load(folder, dtype=torch.float64), load_file(folder / "reference.safetensors")


class Traced:
    """A torch.compile backend that runs graphs as traced (the static-shape paths without inductor's slow codegen)."""

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        return graph.forward


@pytest.fixture
def traced():
    """The compiled passes traced by :class:`Traced` instead of inductor, for this test."""
    torch._dynamo.reset()
    saved, compiled.BACKEND = compiled.BACKEND, Traced()
    yield
    compiled.BACKEND = saved
    torch._dynamo.reset()


def random_model(family: str = "huginn", seed: int = 0, **overrides) -> LoopedLM:
    """A small randomly initialised looped model in float64 (any architecture of any family; Ouro's whole stack of 2
    layers is its core)."""
    ouro = family == "ouro"
    params = dict(family=family, vocab_size=50, n_embd=32, n_heads=4, n_kv_heads=4 if family == "huginn" else 2,
                  n_prelude=0 if ouro else 1, n_core=2, n_coda=0 if ouro else 1, intermediate_size=48, block_size=128,
                  qk_bias=family == "huginn", rope_base=10000.0 if family == "huginn" else 500000.0,
                  rope_scaling=None if family != "raven" else {
                      "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 64, "rope_type": "llama3"},
                  embed_scale=5.0 if family == "huginn" else 1.0, state_std=0.1,
                  tie_embeddings=family == "huginn", mean_recurrence=6, exit_threshold=1.0 if ouro else None)
    params.update(overrides)
    torch.manual_seed(seed)
    model = LoopedLM(LoopedConfig(**params)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3 if p.dim() == 2 else 0.1)
    return model
