"""Load a looped model from the shipped tiny model, a local checkpoint folder or a hub id."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from looped_kv.runtime.config import FAMILIES, LoopedConfig
from looped_kv.runtime.model import LoopedLM, Rotary

TINY_DIR = Path(__file__).parents[1] / "tiny"
_IGNORED_KEYS = ("freqs_cis",)
# Names accepted for ``load(dtype=...)``: the torch float dtypes and their usual short forms. (book.DTYPES holds the
# long names; it imports this module, so it cannot be imported from here.)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch float dtype from a name in :data:`DTYPES` or a torch float dtype; None stays None."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch dtype or one of {tuple(DTYPES)}, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be a floating-point torch dtype or one of {tuple(DTYPES)}, got {dtype!r}")


def _looks_local(source: str | Path) -> bool:
    """Whether ``source`` names a local path rather than a hub id ("owner/name": one '/', no leading '.', '/', '~')."""
    if isinstance(source, Path):
        return True
    text = str(source)
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return text.startswith((".", "~", *seps)) or ("\\" in text) or text.count("/") > 1


def resolve_source(source: str | Path) -> Path:
    """``"tiny"``, an existing folder, or a hub id (downloaded, then read as a folder).

    A :class:`~pathlib.Path`, or a string that starts with '.', '/' or '~' or has more than one '/', is a local
    path: when no such folder exists this raises FileNotFoundError instead of asking the hub.
    """
    if str(source) == "tiny":
        return TINY_DIR
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"source must be 'tiny', a checkpoint folder or a hub id; {path} is a file")
    if _looks_local(source):
        raise FileNotFoundError(f"source {str(source)!r} looks like a local path but folder {path.absolute()} does "
                                "not exist (source must be 'tiny', an existing checkpoint folder or a hub id "
                                "'owner/name')")
    return _download(str(source))


def hub_unreachable() -> str | None:
    """Why the hub cannot be asked right now (offline mode, or its host does not resolve), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "hub access is off (HF_HUB_OFFLINE is set)"
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return f"the hub's host {host} does not resolve (no network?)"
    return None


def _download(repo_id: str) -> Path:
    """A hub checkpoint's files, downloaded once; one line, and no retries, when the hub cannot be reached."""
    where = f"source {repo_id!r} is neither 'tiny' nor an existing folder (here: {Path.cwd()})"
    reason = hub_unreachable()
    if reason:
        raise FileNotFoundError(f"{where}, and {reason}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{where}, and the hub has no repository {repo_id!r} (or it is private)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        raise FileNotFoundError(f"{where}, and the hub could not be reached ({type(error).__name__})") from None


def _config_path(folder: Path) -> Path:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder: it has no config.json (a checkpoint folder "
                                f"holds config.json, model.safetensors or shards with model.safetensors.index.json, "
                                f"and optionally a tokenizer)")
    return path


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors files (one file or shards listed by an index); a file that cannot be
    read, or a tensor with a NaN or an infinity, is a one-line ValueError naming the file (and the tensor)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
            raise ValueError(f"{index} is not a JSON object ({error})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no 'weight_map' from tensor names to file names")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors") if p.name != "reference.safetensors")
    if not files:
        raise FileNotFoundError(f"{folder} is not a checkpoint folder: it has no model.safetensors (nor shards listed "
                                f"by model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors = load_file(folder / name)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{folder / name} is not a readable safetensors file ({error})") from None
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{folder / name}: tensor {key!r} holds NaN or infinite values; a checkpoint's "
                                 f"weights must be finite")
        state.update(tensors)
    return state


def check_state(model: LoopedLM, state: dict[str, torch.Tensor]) -> None:
    """Every tensor the config implies is present with its shape; nothing unknown is left over."""
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key == "lm_head.weight" and model.config.tie_embeddings and key not in state:
            continue
        if key not in state:
            raise ValueError(f"checkpoint is missing tensor {key!r} (the {model.config.family!r} config expects "
                             f"shape {tuple(tensor.shape)})")
        if state[key].shape != tensor.shape:
            raise ValueError(f"tensor {key!r} has shape {tuple(state[key].shape)} in the checkpoint but the "
                             f"config implies {tuple(tensor.shape)}")
    unknown = sorted(k for k in state if k not in expected and k not in _IGNORED_KEYS)
    if unknown:
        raise ValueError(f"checkpoint has tensors the {model.config.family!r} config does not describe: {unknown[:5]} "
                         f"(families: {FAMILIES})")


def load(source: str | Path = "tiny", *, dtype: torch.dtype | str | None = None,
         device: str | torch.device | None = None) -> LoopedLM:
    """Load a looped model in the public checkpoint format (config.json + safetensors).

    ``source`` is ``"tiny"`` (the model shipped in the package), a local folder, or a hub id
    such as ``"tomg-group-umd/huginn-0125"``. The returned model is in eval mode and carries
    its tokenizer as ``model.tokenizer`` when the folder has one. ``dtype`` is a torch float
    dtype or one of the names in :data:`DTYPES` (``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"``,
    ``"float16"``/``"fp16"``, ``"float64"``/``"fp64"``); None keeps the checkpoint's dtype.
    """
    dtype = resolve_dtype(dtype)
    folder = resolve_source(source)
    config_path = _config_path(folder)
    state = load_state(folder)
    config = LoopedConfig.from_file(config_path, tensor_names=state)
    with torch.device("meta"):  # no second copy of the weights: the checkpoint's tensors are assigned
        model = LoopedLM(config)
    try:
        check_state(model, state)
    except ValueError as error:
        raise ValueError(f"{folder}: {error}") from None
    model.load_state_dict({k: v for k, v in state.items() if k not in _IGNORED_KEYS}, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    model.rotary = Rotary(config)
    model = model.to(device=device, dtype=dtype).eval()
    model.tokenizer = load_tokenizer(folder)
    model.source = str(source)
    return model


def load_tokenizer(folder: Path):
    """The folder's tokenizer through ``transformers``, or None when it has none; a ValueError naming the folder
    when its tokenizer files cannot be read."""
    try:
        if (folder / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        if (folder / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # tokenizers and transformers raise many kinds: one line naming the folder instead
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"the tokenizer in {folder} cannot be read ({message})") from None
    return None
