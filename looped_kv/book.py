"""What every chapter needs: the model named by ``LOOPED_KV_MODEL`` on the best device, and text I/O."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from looped_kv.runtime.loading import load
from looped_kv.runtime.model import LoopedLM

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def chapter_model(default: str = "tiny") -> LoopedLM:
    """The chapter's model: ``$LOOPED_KV_MODEL`` (default the shipped tiny model) on CUDA when available.

    bfloat16 on a GPU and float32 on a CPU unless ``$LOOPED_KV_DTYPE`` names another dtype. On a CPU,
    PyTorch runs ``$LOOPED_KV_THREADS`` threads (default 1): the small matrices of decoding gain nothing
    from more, and several threads contending for busy cores make each attention call up to 100x slower,
    which would distort every timing ratio.
    """
    source = os.environ.get("LOOPED_KV_MODEL", default)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("LOOPED_KV_THREADS", "1")))
    dtype_name = os.environ.get("LOOPED_KV_DTYPE", "bfloat16" if device == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"LOOPED_KV_DTYPE must be one of {tuple(DTYPES)}, got {dtype_name!r}")
    return load(source, dtype=DTYPES[dtype_name], device=device)


def is_tiny(model: LoopedLM) -> bool:
    return getattr(model, "source", "") == "tiny"


def encode(model: LoopedLM, text: str | list[str]) -> Tensor:
    """Token ids (1, n) of one text, or a list of (1, n) tensors for a list of texts."""
    if isinstance(text, list):
        return [encode(model, t) for t in text]
    return model.tokenizer(text, return_tensors="pt").input_ids.to(model.device)


def decode(model: LoopedLM, ids: Tensor) -> str:
    return model.tokenizer.decode(ids.reshape(-1).tolist())


def check_greedy_tokens(logits: Tensor, tokens: Tensor, ulps: int = 2) -> int:
    """Check that ``tokens`` are the argmax of ``logits`` (..., vocab); returns the number of near-tie flips.

    In float32 and float64 every token must be the argmax. In bfloat16 and float16, two computations of the
    same logits in another order (a cache against a full forward, a GPU kernel against another) may round a
    near-tie either way: a token may differ from the argmax only where its logit is within ``ulps`` units in the
    last place of the top logit. Raises AssertionError naming the first position that breaks this.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits (..., vocab) must match tokens {tuple(tokens.shape)}, got {tuple(logits.shape)}")
    top = logits.argmax(-1)
    flips = (top != tokens).nonzero()
    if logits.dtype in (torch.float32, torch.float64):
        assert not len(flips), f"token {tuple(flips[0].tolist())} is not the argmax in {logits.dtype}"
        return 0
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[logits.dtype]
    for index in map(tuple, flips.tolist()):
        best, chosen = logits[index].max().float(), logits[index][tokens[index]].float()
        ulp = 2.0 ** (torch.floor(torch.log2(best.abs().clamp_min(1e-30))) - mantissa)
        assert best - chosen <= ulps * ulp, (f"token at {index} is {float(best - chosen):.3g} below the argmax, "
                                             f"more than {ulps} ulps ({float(ulps * ulp):.3g}) in {logits.dtype}")
    return len(flips)

