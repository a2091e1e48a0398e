"""A reader on Colab: each chapter's first cell installs the package, finds the GPU, chooses a model and profile that
fit and prints the plan's line before any work (CUDA and the ``google.colab`` module simulated; nothing is
installed or downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from argparse import Namespace
from pathlib import Path

import jupytext
import pytest
import torch

from looped_kv import book, profiles
from looped_kv.runtime.config import ouro_1_4b

CHAPTERS = sorted((Path(__file__).parent.parent / "notebooks").glob("ch0*.py"))
PACKAGE = "looped-kv[book,papers] @ git+https://github.com/looped-kv/looped-kv"
T4 = profiles.Gpu("Tesla T4", 15.828320256, False)


def simulate_gpu(monkeypatch, name: str = "Tesla T4", memory: int = 15_828_320_256, capability=(7, 5)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Namespace(name=name, total_memory=memory))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)


@pytest.fixture
def no_settings(monkeypatch):
    """None of the chapters' settings, and whatever a test sets is undone after it."""
    for name in ("LOOPED_KV_MODEL", "LOOPED_KV_PROFILE", "LOOPED_KV_DTYPE"):
        monkeypatch.setenv(name, "")  # records the original value, restored at teardown
        monkeypatch.delenv(name)


def first_cell(chapter: Path) -> str:
    return next(c.source for c in jupytext.read(chapter).cells if c.cell_type == "code")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapters_first_cell_installs_and_chooses_what_fits_a_t4(chapter, monkeypatch, capsys, no_settings):
    installs = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "run", lambda argv, **kwargs: installs.append((argv, kwargs)))
    simulate_gpu(monkeypatch)
    exec(first_cell(chapter), {})
    assert installs == [([sys.executable, "-m", "pip", "install", "-q", PACKAGE], {"check": True})]
    assert os.environ["LOOPED_KV_MODEL"] == "ByteDance/Ouro-1.4B"
    line = capsys.readouterr().out
    assert line.startswith(f"Tesla T4 (15.8 GB, no native bfloat16): {chapter.stem[:4]} runs ByteDance/Ouro-1.4B at "
                           f"profile ouro-1.4b-t4 in float16; the plan's peak is ")
    assert line.rstrip().endswith("GB kept free it fits") and len(line.strip().splitlines()) == 1
    assert profiles.for_model(Namespace(config=ouro_1_4b(), source="x")).name == "ouro-1.4b-t4"


def test_outside_colab_the_first_cell_does_nothing(monkeypatch, capsys, no_settings):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: pytest.fail("nothing is installed off Colab"))
    exec(first_cell(CHAPTERS[0]), {})
    assert "LOOPED_KV_MODEL" not in os.environ and capsys.readouterr().out == ""


@pytest.mark.parametrize("gpu, model, profile, fits", [
    (T4, "ByteDance/Ouro-1.4B", "ouro-1.4b-t4", True),
    (profiles.Gpu("NVIDIA L4", 23.7, True), "ByteDance/Ouro-1.4B", "ouro-1.4b", True),
    (profiles.Gpu("NVIDIA A100-SXM4-40GB", 42.4, True), "tomg-group-umd/huginn-0125", "huginn-0125", True),
    (profiles.Gpu("NVIDIA H100 80GB HBM3", 85.0, True), "tomg-group-umd/huginn-0125", "huginn-0125-80gb", True),
])
def test_the_default_model_fits_every_card(gpu, model, profile, fits, no_settings):
    for chapter in ("ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07", "ch08"):
        run = book.choose_run(chapter, gpu)
        assert (run.source, run.profile.name, run.fits) == (model, profile, fits), chapter


def test_a_readers_model_is_kept_and_judged(monkeypatch, no_settings):
    monkeypatch.setenv("LOOPED_KV_MODEL", "raven-tinyllama")  # a preset name: its hub id, its T4 profile
    run = book.choose_run("ch04", T4)
    assert (run.source, run.profile.name, run.fits) == ("smcleish/Recurrent-TinyLlama-3T-train-recurrence-32",
                                                         "raven-tinyllama-t4", True)
    monkeypatch.setenv("LOOPED_KV_MODEL", "tomg-group-umd/huginn-0125")
    run = book.choose_run("ch03", T4)
    assert not run.fits and "does NOT fit: set LOOPED_KV_MODEL to one that does (looped-kv plan --card t4)" in run.line
    with pytest.raises(ValueError, match="chapter must be one of"):
        book.choose_run("ch9", T4)


def test_without_a_gpu_the_chapter_runs_the_tiny_model(monkeypatch, no_settings):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = book.choose_run("ch01")
    assert run.gpu is None and run.source == "tiny" and "no GPU found" in run.line
    assert "LOOPED_KV_MODEL" not in os.environ


def test_a_t4_loads_float16(monkeypatch):
    simulate_gpu(monkeypatch)
    assert book.default_dtype("cuda") == "float16" and book.default_dtype("cpu") == "float32"
    simulate_gpu(monkeypatch, "NVIDIA L4", 23_700_000_000, (8, 9))
    assert book.default_dtype("cuda") == "bfloat16"
