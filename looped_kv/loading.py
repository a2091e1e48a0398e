"""Load a looped model from the shipped tiny model, a local checkpoint folder or a hub id."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from looped_kv.config import LoopedConfig
from looped_kv.model import LoopedLM, Rotary

TINY_DIR = Path(__file__).parent / "tiny"
_IGNORED_KEYS = ("freqs_cis",)


def resolve_source(source: str | Path) -> Path:
    """``"tiny"``, an existing folder, or a hub id (downloaded, then read as a folder)."""
    if str(source) == "tiny":
        return TINY_DIR
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"source must be 'tiny', a checkpoint folder or a hub id; {path} is a file")
    from huggingface_hub import snapshot_download  # only needed for hub ids

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    return Path(snapshot_download(repo_id=str(source), allow_patterns=patterns))


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors files (one file or shards listed by an index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors") if p.name != "reference.safetensors")
    if not files:
        raise FileNotFoundError(f"no model safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    return state


def check_state(model: LoopedLM, state: dict[str, torch.Tensor]) -> None:
    """Every tensor the config implies is present with its shape; nothing unknown is left over."""
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key == "lm_head.weight" and model.config.tie_embeddings and key not in state:
            continue
        if key not in state:
            raise ValueError(f"checkpoint is missing tensor {key!r} (config expects shape {tuple(tensor.shape)})")
        if state[key].shape != tensor.shape:
            raise ValueError(f"tensor {key!r} has shape {tuple(state[key].shape)} in the checkpoint but the "
                             f"config implies {tuple(tensor.shape)}")
    unknown = sorted(k for k in state if k not in expected and k not in _IGNORED_KEYS)
    if unknown:
        raise ValueError(f"checkpoint has tensors the config does not describe: {unknown[:5]}")


def load(source: str | Path = "tiny", *, dtype: torch.dtype | None = None,
         device: str | torch.device | None = None) -> LoopedLM:
    """Load a looped model in the public checkpoint format (config.json + safetensors).

    ``source`` is ``"tiny"`` (the model shipped in the package), a local folder, or a hub id
    such as ``"tomg-group-umd/huginn-0125"``. The returned model is in eval mode and carries
    its tokenizer as ``model.tokenizer`` when the folder has one.
    """
    folder = resolve_source(source)
    config = LoopedConfig.from_file(folder / "config.json")
    state = load_state(folder)
    with torch.device("meta"):  # no second copy of the weights: the checkpoint's tensors are assigned
        model = LoopedLM(config)
    check_state(model, state)
    model.load_state_dict({k: v for k, v in state.items() if k not in _IGNORED_KEYS}, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    model.rotary = Rotary(config)
    model = model.to(device=device, dtype=dtype).eval()
    model.tokenizer = load_tokenizer(folder)
    model.source = str(source)
    return model


def load_tokenizer(folder: Path):
    """The folder's tokenizer through ``transformers``, or None when it has none."""
    if (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    if (folder / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    return None
