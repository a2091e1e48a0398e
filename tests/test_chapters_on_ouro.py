"""Chapters 1 and 4 run end to end on an Ouro-format checkpoint folder: the shared Ouro fixture, with a character
tokenizer of its 96 token ids, at the ``smoke`` profile. A smoke test: the chapters' numbers mean nothing on
random weights and are not asserted; it shows the chapters are not tied to the tiny model's family."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
END = "<|endoftext|>"


def character_tokenizer() -> PreTrainedTokenizerFast:
    """96 ids: end-of-text (also every character outside the vocabulary), newline, and the printable ASCII characters
    from space to '}'; each character is one token."""
    vocab = {END: 0, "\n": 1, **{chr(c): i + 2 for i, c in enumerate(range(32, 126))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=END))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END, unk_token=END, bos_token=END)


def ouro_checkpoint(folder: Path) -> Path:
    """The ouro-tiny fixture's weights and config.json, its context raised to 1,024 positions (rotary positions are
    not learned), and a character tokenizer of its vocabulary."""
    folder.mkdir(parents=True)
    shutil.copy(FIXTURES / "ouro-tiny" / "model.safetensors", folder)
    config = json.loads((FIXTURES / "ouro-tiny" / "config.json").read_text())
    tokenizer = character_tokenizer()
    assert len(tokenizer) == config["vocab_size"]
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}, indent=2))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("chapter", ["ch01_looped_models", "ch04_ripe"])
def test_chapter_runs_on_an_ouro_checkpoint(chapter, tmp_path):
    folder = ouro_checkpoint(tmp_path / "ouro")
    env = {**os.environ, "LOOPED_KV_MODEL": str(folder), "LOOPED_KV_PROFILE": "smoke", "MPLBACKEND": "Agg",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(NOTEBOOKS / f"{chapter}.py")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"model {folder}, ouro, R = 4" in result.stdout
