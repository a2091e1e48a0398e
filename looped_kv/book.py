"""What every chapter needs: the model named by ``LOOPED_KV_MODEL`` on the best device, text I/O, and the
book's formatting (figures at the column's width, tables for reading, prose that renders math)."""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown
from torch import Tensor

from looped_kv.runtime.loading import load
from looped_kv.runtime.model import LoopedLM

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def chapter_model(default: str = "tiny") -> LoopedLM:
    """The chapter's model: ``$LOOPED_KV_MODEL`` (default the shipped tiny model) on CUDA when available.

    bfloat16 on a GPU and float32 on a CPU unless ``$LOOPED_KV_DTYPE`` names another dtype. On a CPU,
    PyTorch runs ``$LOOPED_KV_THREADS`` threads (default 1): the small matrices of decoding gain nothing
    from more, and several threads contending for busy cores make each attention call up to 100x slower,
    which would distort every timing ratio. On a GPU, cuDNN's attention backend is turned off: RIPE Section 5.5
    found it to make bf16 reruns differ, and every chapter measures (:func:`environment` records the setting).
    """
    source = os.environ.get("LOOPED_KV_MODEL", default)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("LOOPED_KV_THREADS", "1")))
    else:
        torch.backends.cuda.enable_cudnn_sdp(False)
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



#: Figure sizes in inches at the book's 100 dpi: the text column is about 7 inches (700 px) wide.
COLUMN = (6.6, 3.6)
WIDE = (6.6, 4.4)
SQUARE = (4.8, 4.0)


def setup() -> None:
    """Matplotlib and pandas settings for the book: figures at the column's size with legible labels."""
    import matplotlib as mpl

    mpl.rcParams.update({"figure.figsize": COLUMN, "figure.dpi": 100, "savefig.dpi": 100, "font.size": 10,
                         "axes.titlesize": 10.5, "axes.labelsize": 10, "legend.fontsize": 8.5,
                         "xtick.labelsize": 9, "ytick.labelsize": 9, "figure.constrained_layout.use": True})
    pd.set_option("display.precision", 3)


def encrypt_kernel_channels() -> None:
    """Kernels started in this process (the book build, nbval) talk over CurveZMQ-encrypted channels.

    jupyter_client provisions the keys when a kernelspec declares curve support (ipykernel's does); its
    ``transport_encryption`` defaults to "disabled", and each kernel then warns that its TCP channels are plain
    text. Kernel managers are created deep inside myst-nb and nbval, so the class default is the one setting
    both read.
    """
    from jupyter_client.manager import KernelManager

    KernelManager.class_traits()["transport_encryption"].default_value = "auto"


def environment(model: LoopedLM) -> str:
    """One line: model, device, dtype, R, torch, threads and the attention backend a measurement runs with."""
    if model.device.type == "cuda":
        backend = "cuDNN SDPA " + ("on" if torch.backends.cuda.cudnn_sdp_enabled() else "off")
    else:
        backend = "PyTorch SDPA (CPU)"
    return (f"model {model.source}, {model.config.family}, R = {model.config.mean_recurrence}; {model.device}, "
            f"{str(model.dtype).removeprefix('torch.')}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s); attention: {backend}")


def md(text: str) -> Markdown:
    """Prose built from computed values; rendered as MyST, so $math$ in it renders (nb_render_markdown_format)."""
    return Markdown(text)


def _column_format(values: pd.Series, digits: int) -> str:
    finite = values[np.isfinite(values.astype(float))].astype(float)
    if finite.empty:
        return "{}"
    if np.allclose(finite, finite.round()) and finite.abs().max() < 1e15:
        return "{:,.0f}"
    largest = finite.abs().max()
    smallest = finite[finite != 0].abs().min() if (finite != 0).any() else largest
    if largest >= 1e5 or smallest < 10 ** -(digits + 1):
        return f"{{:.{digits - 1}e}}"
    decimals = max(0, digits - 1 - math.floor(math.log10(smallest)))
    return f"{{:,.{min(decimals, digits + 2)}f}}"


def table(frame: pd.DataFrame | pd.Series, digits: int = 3, percent: tuple[str, ...] = (),
          caption: str | None = None) -> pd.io.formats.style.Styler:
    """A table for reading: padded cells, ``digits`` significant digits per numeric column, integers as
    integers, ``percent`` columns as percentages, and a dash for a missing value (never NaN)."""
    frame = frame.to_frame() if isinstance(frame, pd.Series) else frame
    formats = {}
    for column in frame.columns:
        values = frame[column]
        if column in percent:
            formats[column] = "{:.1%}"
        elif pd.api.types.is_bool_dtype(values):
            formats[column] = lambda x: "yes" if x else "no"
        elif pd.api.types.is_numeric_dtype(values):
            formats[column] = _column_format(values, digits)
    styler = frame.style.format(formats, na_rep="–").set_table_styles(
        [{"selector": "th, td", "props": "padding: 0.3em 0.8em; text-align: right; white-space: nowrap"},
         {"selector": "th.row_heading", "props": "text-align: left"}])
    return styler.set_caption(caption) if caption else styler
