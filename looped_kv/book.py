"""What every chapter needs: the model named by ``LOOPED_KV_MODEL`` on the best device, what fits a Colab GPU,
text I/O, and the book's formatting (figures at the column's width, tables for reading, prose that renders math)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown
from torch import Tensor

from looped_kv import profiles
from looped_kv.prose import change, listing, significant  # noqa: F401  (the chapters' prose helpers)
from looped_kv.runtime.loading import load, model_config
from looped_kv.runtime.model import LoopedLM

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The public checkpoint of each published model (book/gpu.md).
HUB_IDS = {"huginn-0125": "tomg-group-umd/huginn-0125",
           "raven-llama": "smcleish/Recurrent-Llama-3.2-train-recurrence-32",
           "raven-olmo": "smcleish/Recurrent-OLMo-2-0425-train-recurrence-32",
           "raven-tinyllama": "smcleish/Recurrent-TinyLlama-3T-train-recurrence-32",
           "ouro-1.4b": "ByteDance/Ouro-1.4B", "ouro-2.6b": "ByteDance/Ouro-2.6B",
           **{f"parcae-{size}": f"SandyResearch/parcae-{size}" for size in ("140m", "370m", "770m", "1.3b")}}
#: The model a chapter runs on Colab, by GPU class, when ``LOOPED_KV_MODEL`` names none: every chapter fits it there
#: (``looped-kv plan --card``). On a T4, Raven-TinyLlama fits too.
COLAB_MODELS = {"t4": "ouro-1.4b", "l4": "ouro-1.4b", "40gb": "huginn-0125", "80gb": "huginn-0125"}


@dataclass(frozen=True)
class ColabRun:
    """What a chapter's first cell chose on Colab: the GPU found, the model and its profile, the plan's line."""

    gpu: profiles.Gpu | None
    source: str  # what LOOPED_KV_MODEL now names
    profile: profiles.Profile | None
    fits: bool
    line: str


def colab_setup(chapter: str) -> ColabRun | None:
    """A chapter's first cell on Colab (does nothing elsewhere): :func:`choose_run`, its line printed."""
    if "google.colab" not in sys.modules:
        return None
    run = choose_run(chapter)
    print(run.line)
    return run


def choose_run(chapter: str, gpu: profiles.Gpu | None = None) -> ColabRun:
    """The model and profile ``chapter`` runs on the GPU found (or ``gpu``), before any weights are downloaded.

    ``$LOOPED_KV_MODEL`` if set, else :data:`COLAB_MODELS` for the GPU's class (then set, for :func:`chapter_model`);
    the profile the chapter will read there (:func:`profiles.for_config`: by the GPU's class, or
    ``$LOOPED_KV_PROFILE``); and the plan's peak for the chapter against the GPU's memory
    (:mod:`looped_kv.analysis.plan`). Without a GPU the chapter runs the tiny model on the CPU.
    """
    from looped_kv.analysis import plan

    if chapter not in plan.CHAPTERS:
        raise ValueError(f"chapter must be one of {tuple(plan.CHAPTERS)}, got {chapter!r}")
    gpu = gpu or profiles.detect_gpu()
    if gpu is None:
        return ColabRun(None, os.environ.get("LOOPED_KV_MODEL", "tiny"), None, True,
                        f"{chapter}: no GPU found, so it runs the tiny model on the CPU (for a real checkpoint: "
                        f"Runtime > Change runtime type > a GPU, then run this cell again)")
    name = os.environ.get("LOOPED_KV_MODEL") or COLAB_MODELS[gpu.card]
    published = {**{hub: model for model, hub in HUB_IDS.items()}, **{model: model for model in HUB_IDS}}.get(name)
    source = HUB_IDS[published] if published else name
    config = model_config(published or name)  # a published model's preset: nothing is downloaded
    profile = profiles.for_config(config, source, gpu)
    peak = plan.CHAPTERS[chapter](config, profile).peak(plan.GPU)
    fits = peak + plan.GPU_RESERVE <= gpu.memory_gb * plan.GB
    os.environ["LOOPED_KV_MODEL"] = source
    verdict = "fits" if fits else ("does NOT fit: set LOOPED_KV_MODEL to one that does (looped-kv plan --card "
                                   f"{gpu.card}) or choose a larger GPU")
    native = "" if gpu.bf16 else ", no native bfloat16"
    line = (f"{gpu.name} ({gpu.memory_gb:.1f} GB{native}): {chapter} runs {source} at profile {profile.name} in "
            f"{profile.dtype}; the plan's peak is {peak / plan.GB:.1f} GB, with {plan.GPU_RESERVE / plan.GB:g} GB "
            f"kept free it {verdict}")
    return ColabRun(gpu, source, profile, fits, line)


def chapter_model(default: str = "tiny") -> LoopedLM:
    """The chapter's model: ``$LOOPED_KV_MODEL`` (default the shipped tiny model; a published model's name, such as
    ``ouro-1.4b``, is its hub id of :data:`HUB_IDS`) on CUDA when available.

    bfloat16 on a GPU (float16 on one without native bfloat16, such as a T4) and float32 on a CPU unless
    ``$LOOPED_KV_DTYPE`` names another dtype. On a CPU,
    PyTorch runs ``$LOOPED_KV_THREADS`` threads (default 1): the small matrices of decoding gain nothing
    from more, and several threads contending for busy cores make each attention call up to 100x slower,
    which would distort every timing ratio. On a GPU, cuDNN's attention backend is turned off: RIPE Section 5.5
    found it to make bf16 reruns differ, and every chapter measures (:func:`environment` records the setting).
    """
    source = os.environ.get("LOOPED_KV_MODEL", default)
    source = HUB_IDS.get(source, source)  # a published model's name: its checkpoint on the hub
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("LOOPED_KV_THREADS", "1")))
    else:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype_name = os.environ.get("LOOPED_KV_DTYPE", default_dtype(device))
    if dtype_name not in DTYPES:
        raise ValueError(f"LOOPED_KV_DTYPE must be one of {tuple(DTYPES)}, got {dtype_name!r}")
    return load(source, dtype=DTYPES[dtype_name], device=device)


def default_dtype(device: str) -> str:
    """A chapter's dtype unless ``$LOOPED_KV_DTYPE`` names one: float32 on a CPU, bfloat16 on a GPU that runs it
    natively, float16 on one that does not (a T4; its profiles decode in float16)."""
    if device == "cpu":
        return "float32"
    return "bfloat16" if profiles.detect_gpu().bf16 else "float16"


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


def _cell(x: object, digits: int) -> str:
    """A cell of a mixed column: integers with separators, other numbers to ``digits`` significant digits."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        return str(x)
    if float(x).is_integer() and abs(float(x)) < 1e15:
        return f"{int(x):,}"
    return significant(float(x), digits)


def _column_format(values: pd.Series, digits: int) -> str | Callable[[float], str]:
    finite = values[np.isfinite(values.astype(float))].astype(float)
    if finite.empty:
        return "{}"
    if np.allclose(finite, finite.round()) and finite.abs().max() < 1e15:
        return "{:,.0f}"
    largest = finite.abs().max()
    smallest = finite[finite != 0].abs().min() if (finite != 0).any() else largest
    if largest >= 1e5 or smallest < 10 ** -(digits + 1):
        return f"{{:.{digits - 1}e}}"
    if largest / smallest > 100:  # one column over several orders of magnitude: each value to its own precision
        return lambda x: significant(float(x), digits)
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
        elif pd.api.types.is_object_dtype(values):  # mixed cells (a settings table): each number formatted alone
            formats[column] = lambda x, digits=digits: _cell(x, digits)
    styler = frame.style.format(formats, na_rep="–").set_table_styles(
        [{"selector": "th, td", "props": "padding: 0.3em 0.8em; text-align: right; white-space: nowrap"},
         {"selector": "th.row_heading", "props": "text-align: left"}])
    return styler.set_caption(caption) if caption else styler


#: The book's executed pages, in reading order (``_toc.yml``'s notebooks).
NOTEBOOKS = ("ch01_looped_models", "ch02_ripening", "ch03_prefix_kv_late", "ch04_ripe", "ch05_mature_v",
             "ch06_das_wave", "ch07_memory_throughput", "ch08_adaptive_depth", "appendix_training", "appendix_gpu")


def _cells(notebook: Path) -> list[dict]:
    import json

    return json.loads(notebook.read_text())["cells"]


def execution_seconds(notebook: Path, cells: list[dict] | None = None) -> float:
    """Seconds an executed notebook's code cells took, from the timing its executor recorded in each cell's metadata
    (``execution``: from ``iopub.execute_input`` to ``shell.execute_reply``); ``cells``: the notebook's, if read."""
    from datetime import datetime

    total = 0.0
    for cell in _cells(notebook) if cells is None else cells:
        timing = cell.get("metadata", {}).get("execution", {})
        if cell["cell_type"] == "code" and cell["source"] and not timing:
            raise ValueError(f"{notebook.name}: a code cell has no recorded execution time; execute the notebook")
        if timing:
            start, end = (datetime.fromisoformat(timing[key].replace("Z", "+00:00"))
                          for key in ("iopub.execute_input", "shell.execute_reply"))
            total += (end - start).total_seconds()
    return total


def _title(cells: list[dict]) -> str:
    return next(line.removeprefix("# ") for c in cells if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("# "))


def chapter_times(folder: Path) -> str:
    """A Markdown table of each executed page's time (:func:`execution_seconds`) in ``folder``: what the intro shows
    as the time a chapter takes on a CPU with the tiny model, as last executed."""
    lines = ["| page | minutes |", "| --- | ---: |"]
    for name in NOTEBOOKS:
        path = folder / f"{name}.ipynb"
        cells = _cells(path)
        lines.append(f"| {_title(cells)} | {execution_seconds(path, cells) / 60:.1f} |")
    return "\n".join(lines) + "\n"


class _TableRows(HTMLParser):
    """The text of every cell of every HTML table, by table and row."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("th", "td") and self.tables and self.tables[-1]:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("th", "td") and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


#: The columns a chapter's verdict table (:func:`looped_kv.analysis.verdicts.interval_table`) has, in any order.
VERDICT_COLUMNS = ("verdict", "estimate [interval]", "n")


def verdicts(notebook: Path, cells: list[dict] | None = None) -> pd.DataFrame:
    """Every verdict an executed chapter shows in its verdict tables (the tables with :data:`VERDICT_COLUMNS`, as
    :func:`~looped_kv.analysis.verdicts.interval_table` draws them): one row each, indexed by its name, with the
    label, the estimate with its interval, and n; ``cells``: the notebook's, if read."""
    rows = {}
    for cell in _cells(notebook) if cells is None else cells:
        for output in cell.get("outputs", []):
            parser = _TableRows()
            parser.feed("".join(output.get("data", {}).get("text/html", "")))
            for header, *body in (t for t in parser.tables if t):
                if not set(VERDICT_COLUMNS) <= set(header):
                    continue
                at = [header.index(c) for c in VERDICT_COLUMNS]
                rows |= {row[0]: [row[i] for i in at] for row in body}
    return pd.DataFrame.from_dict(rows, orient="index", columns=list(VERDICT_COLUMNS)).rename_axis("claim")


def verdict_listing(notebooks: list[Path]) -> str:
    """A Markdown table of every verdict of the executed ``notebooks`` (:func:`verdicts`): chapter (its number),
    claim, verdict, estimate [interval] and n, in the order given; a chapter that decides nothing adds no row."""
    lines = ["| chapter | claim | verdict | estimate [interval] | n |", "| ---: | --- | --- | --- | ---: |"]
    for path in notebooks:
        cells = _cells(path)
        if any(c["cell_type"] == "code" and c["source"] and c.get("execution_count") is None for c in cells):
            raise ValueError(f"{path} has code cells that never ran; execute it first")
        title = _title(cells)
        title = title.split(". ", 1)[0] if title[0].isdigit() else title
        table = verdicts(path, cells)
        lines += [f"| {title} | {name} | {row['verdict']} | {row['estimate [interval]']} | {row['n']} |"
                  for name, row in table.iterrows()]
    return "\n".join(lines) + "\n"


def cpu_plan_table(planned: dict[str, float], peaks: dict[str, int], folder: Path) -> str:
    """A Markdown table of the plan alone for a CPU run: per chapter, its predicted minutes (``planned``, seconds from
    ``looped-kv plan-time``) and its predicted peak host memory beyond the weights (``peaks``, bytes) in GB; a
    chapter the plan lacks says so. Page titles come from the notebooks in ``folder``."""
    lines = ["| page | plan minutes | plan GB |", "| --- | ---: | ---: |"]
    for name in NOTEBOOKS:
        chapter = name.split("_")[0]
        if not chapter.startswith("ch"):
            continue
        title = _title(_cells(folder / f"{name}.ipynb"))
        lines.append(f"| {title} | not planned | |" if chapter not in planned else
                     f"| {title} | {planned[chapter] / 60:.1f} | {peaks[chapter] / 1e9:.2f} |")
    return "\n".join(lines) + "\n"


def cpu_run_table(record: dict, folder: Path, planned: dict[str, float] | None = None) -> str:
    """A Markdown table of a recorded CPU run of ``looped-kv plan-check`` (its JSON ``record``): per chapter, the
    minutes its memory-relevant calls took, their peak host memory and the plan's, in GB (10^9 bytes); with
    ``planned`` (each chapter's predicted seconds, ``looped-kv plan-time``), the plan's minutes too. A chapter the
    record lacks says so. Page titles come from the notebooks in ``folder``."""
    rows = {row["chapter"]: row for row in record["chapters"]}
    timed = ["plan minutes", "plan / run"] if planned is not None else []
    head = ["page", "minutes", *timed, "peak GB", "plan GB", "plan / peak"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name in NOTEBOOKS:
        chapter = name.split("_")[0]
        if not chapter.startswith("ch"):
            continue
        title = _title(_cells(folder / f"{name}.ipynb"))
        row = rows.get(chapter)
        if row is None:
            lines.append(f"| {title} | not recorded |" + " |" * (len(head) - 2))
            continue
        cells = [f"{row['seconds'] / 60:.1f}"]
        if planned is not None:
            cells += ([f"{planned[chapter] / 60:.1f}", f"{planned[chapter] / row['seconds']:.2f}"]
                      if chapter in planned else ["not planned", ""])
        cells += [f"{row['measured bytes'] / 1e9:.2f}", f"{row['predicted bytes'] / 1e9:.2f}",
                  f"{row['predicted / measured']:.2f}"]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
