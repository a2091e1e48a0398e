"""Load a looped model from the shipped tiny model, a local checkpoint folder or a hub id, and save one.

Huginn-0125 and the Raven retrofits store the runtime's own tensor names (``transformer.prelude.0.attn.Wqkv``,
...). Ouro stores Hugging Face Llama-style names (``model.layers.0.self_attn.q_proj``, ...): :func:`ouro_layout`
maps each runtime tensor to the Ouro tensors it is made of, for loading (:func:`from_ouro_tensors`) and saving
(:func:`to_ouro_tensors`). Parcae stores the runtime's names but for separate query, key, value and output
projections (``attn.c_q``, ``attn.c_k``, ``attn.c_v``, ``attn.c_proj``: :func:`parcae_layout`), in a
``pytorch_model.bin`` (``torch.save`` of the state dict) that is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from looped_kv.runtime.config import FAMILIES, PRESETS, LoopedConfig
from looped_kv.runtime.model import LoopedLM, Rotary

TINY_DIR = Path(__file__).parents[1] / "tiny"
_IGNORED_KEYS = ("freqs_cis",)
#: Parcae's weight files, in the order its loader (``parcae_lm.from_pretrained``) tries them; read only when a folder
#: has no safetensors.
PARCAE_WEIGHTS = ("pytorch_model.bin", "model.pt")
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
        folder = Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns))
        if not any(folder.glob("*.safetensors")) and "_class_name" in _read_json(folder / "config.json"):  # Parcae
            folder = Path(snapshot_download(repo_id=repo_id, allow_patterns=[*patterns, PARCAE_WEIGHTS[0]]))
        return folder
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{where}, and the hub has no repository {repo_id!r} (or it is private)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        raise FileNotFoundError(f"{where}, and the hub could not be reached ({type(error).__name__})") from None


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; an empty one when it is absent or not an object (the loader then says why)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


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
        files = [name for name in PARCAE_WEIGHTS if (folder / name).is_file()][:1]
    if not files:
        raise FileNotFoundError(f"{folder} is not a checkpoint folder: it has no model.safetensors (nor shards listed "
                                f"by model.safetensors.index.json, nor Parcae's {' or '.join(PARCAE_WEIGHTS)})")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        tensors = _read_parcae_weights(folder / name) if name in PARCAE_WEIGHTS else None
        try:
            tensors = load_file(folder / name) if tensors is None else tensors
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{folder / name} is not a readable safetensors file ({error})") from None
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{folder / name}: tensor {key!r} holds NaN or infinite values; a checkpoint's "
                                 f"weights must be finite")
        state.update(tensors)
    return state


def _read_parcae_weights(path: Path) -> dict[str, torch.Tensor]:
    """A Parcae ``pytorch_model.bin`` (a ``torch.save``d state dict) through ``torch.load(weights_only=True)``, which
    unpickles tensors and containers only, never arbitrary objects; a file it refuses is a one-line ValueError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling errors come in many types: one line naming the file
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{path} is not a readable state dict for torch.load(weights_only=True) ({message})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} must hold a state dict of tensors, got {type(state).__name__}")
    return state


def parcae_layout(config: LoopedConfig) -> dict[str, list[tuple[str, int]]]:
    """Each runtime attention projection of a Parcae model and the Parcae tensors it is made of (name, rows): c_q,
    c_k and c_v stacked into ``Wqkv``, c_proj as ``proj``. Every other tensor has the runtime's name."""
    H, H_kv, D = config.n_heads, config.n_kv_heads, config.head_dim
    layout = {}
    for stage, count in (("prelude", config.n_prelude), ("core_block", config.n_core), ("coda", config.n_coda)):
        for i in range(count):
            attn = f"transformer.{stage}.{i}.attn"
            layout[f"{attn}.Wqkv.weight"] = [(f"{attn}.c_q.weight", H * D), (f"{attn}.c_k.weight", H_kv * D),
                                             (f"{attn}.c_v.weight", H_kv * D)]
            layout[f"{attn}.proj.weight"] = [(f"{attn}.c_proj.weight", config.n_embd)]
    return layout


def from_parcae_tensors(config: LoopedConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Parcae checkpoint's tensors (checked by :func:`check_state`) under the runtime's names."""
    layout = parcae_layout(config)
    parts = {name for pieces in layout.values() for name, _ in pieces}
    out = {key: value for key, value in state.items() if key not in parts}
    out.update({ours: torch.cat([state[name] for name, _ in pieces]) for ours, pieces in layout.items()})
    return out


#: Ouro's four norms per layer and the runtime's names for them (:class:`~looped_kv.runtime.model.Block`, peri-norm).
OURO_NORMS = {"input_layernorm": "norm_1", "input_layernorm_2": "norm_2", "post_attention_layernorm": "norm_3",
              "post_attention_layernorm_2": "norm_4"}


def ouro_layout(config: LoopedConfig) -> dict[str, list[tuple[str, int]]]:
    """Each runtime tensor of an Ouro model and the Ouro checkpoint tensors it is made of: (name, rows), stacked
    along the first axis (q, k, v into ``Wqkv``; gate and up into the MLP's ``fc``), in that order."""
    H, H_kv, D, d, inner = config.n_heads, config.n_kv_heads, config.head_dim, config.n_embd, config.intermediate_size
    layout = {"transformer.wte.weight": [("model.embed_tokens.weight", config.vocab_size)],
              "transformer.ln_f.weight": [("model.norm.weight", d)],
              "transformer.exit_gate.weight": [("model.early_exit_gate.weight", 1)],
              "transformer.exit_gate.bias": [("model.early_exit_gate.bias", 1)]}
    if not config.tie_embeddings:
        layout["lm_head.weight"] = [("lm_head.weight", config.vocab_size)]
    for i in range(config.n_core):
        ouro, ours = f"model.layers.{i}", f"transformer.core_block.{i}"
        attn, mlp = f"{ouro}.self_attn", f"{ouro}.mlp"
        layout[f"{ours}.attn.Wqkv.weight"] = [(f"{attn}.q_proj.weight", H * D), (f"{attn}.k_proj.weight", H_kv * D),
                                              (f"{attn}.v_proj.weight", H_kv * D)]
        layout[f"{ours}.attn.proj.weight"] = [(f"{attn}.o_proj.weight", d)]
        layout[f"{ours}.mlp.fc.weight"] = [(f"{mlp}.gate_proj.weight", inner), (f"{mlp}.up_proj.weight", inner)]
        layout[f"{ours}.mlp.proj.weight"] = [(f"{mlp}.down_proj.weight", d)]
        for norm, name in OURO_NORMS.items():
            layout[f"{ours}.{name}.weight"] = [(f"{ouro}.{norm}.weight", d)]
    return layout


def from_ouro_tensors(config: LoopedConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An Ouro checkpoint's tensors (checked by :func:`check_state`) under the runtime's names."""
    return {ours: torch.cat([state[name] for name, _ in parts]) if len(parts) > 1 else state[parts[0][0]]
            for ours, parts in ouro_layout(config).items()}


def to_ouro_tensors(config: LoopedConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The runtime's tensors of an Ouro model under the checkpoint's names (inverse of :func:`from_ouro_tensors`)."""
    out = {}
    for ours, parts in ouro_layout(config).items():
        for (name, _), piece in zip(parts, state[ours].split([rows for _, rows in parts]), strict=True):
            out[name] = piece.contiguous()
    return out


def _expected_shapes(model: LoopedLM) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes the config implies (for Ouro, its own names)."""
    ours = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    if model.config.family == "parcae":
        layout = parcae_layout(model.config)
        return {key: shape for key, shape in ours.items() if key not in layout} | {
            name: (rows, *ours[key][1:]) for key, parts in layout.items() for name, rows in parts}
    if model.config.family != "ouro":
        return ours
    return {name: (rows, *ours[key][1:]) for key, parts in ouro_layout(model.config).items() for name, rows in parts}


def check_state(model: LoopedLM, state: dict[str, torch.Tensor]) -> None:
    """Every tensor the config implies is present with its shape and a float dtype; nothing unknown is left over."""
    expected = _expected_shapes(model)
    tied_head = "lm_head.weight" if model.config.tie_embeddings else None
    for key, shape in expected.items():
        if key == tied_head and key not in state:
            continue
        if key not in state:
            raise ValueError(f"checkpoint is missing tensor {key!r} (the {model.config.family!r} config expects "
                             f"shape {shape})")
        if tuple(state[key].shape) != shape:
            raise ValueError(f"tensor {key!r} has shape {tuple(state[key].shape)} in the checkpoint but the "
                             f"config implies {shape}")
        if not state[key].is_floating_point():
            raise ValueError(f"tensor {key!r} has dtype {str(state[key].dtype).removeprefix('torch.')} in the "
                             f"checkpoint; a model's weights are floating-point")
    unknown = sorted(key for key in state if key not in expected and key not in _IGNORED_KEYS and key != tied_head)
    if unknown:
        raise ValueError(f"checkpoint has tensors the {model.config.family!r} config does not describe: {unknown[:5]} "
                         f"(families: {FAMILIES})")


def model_config(model: str, name: str = "model") -> LoopedConfig:
    """A named architecture (:data:`~looped_kv.runtime.config.PRESETS`), 'tiny', a folder or config.json, or a hub
    id's config.json (the weights are not downloaded). ``name`` is what an error calls the parameter."""
    if model in PRESETS:
        return PRESETS[model]()
    path = TINY_DIR if model == "tiny" else Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return LoopedConfig.from_file(path)
    if model == "tiny":
        raise FileNotFoundError(f"no config.json at {path} (the tiny model is not trained yet)")
    what = f"{name} {model!r} is not one of {tuple(PRESETS)}, 'tiny', a folder or a config.json"
    reason = hub_unreachable()
    if reason:
        raise ValueError(f"{what}, and {reason}")
    from huggingface_hub import hf_hub_download

    try:
        return LoopedConfig.from_file(hf_hub_download(repo_id=model, filename="config.json"))
    except Exception as error:  # unknown id, no network, ...: one clear line instead of a traceback
        raise ValueError(f"{what}, and its hub config.json could not be fetched ({type(error).__name__})") from None


def load(source: str | Path = "tiny", *, dtype: torch.dtype | str | None = None,
         device: str | torch.device | None = None) -> LoopedLM:
    """Load a looped model in the public checkpoint format (config.json + safetensors; Parcae: + pytorch_model.bin).

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
    if config.family == "ouro":
        state = from_ouro_tensors(config, state)
    elif config.family == "parcae":
        state = from_parcae_tensors(config, state)
    model.load_state_dict({key: value for key, value in state.items() if key not in _IGNORED_KEYS}, strict=False,
                          assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    model.store_weights_transposed()
    model.rotary = Rotary(config)
    model = model.to(device=device, dtype=dtype).eval()
    model.tokenizer = load_tokenizer(folder, parcae=config.family == "parcae")
    model.source = str(source)
    return model


def save(model: LoopedLM, folder: str | Path) -> Path:
    """Write ``model`` as a checkpoint folder in its family's public format, which :func:`load` reads back.

    ``config.json`` (:meth:`LoopedConfig.to_hf_dict`, with the weights' dtype), ``model.safetensors`` (Ouro
    under its own tensor names; a tied head stored once) and the tokenizer, if the model carries one. A folder
    that already holds a config.json or model.safetensors is refused: nothing is overwritten.
    """
    if model.config.family == "parcae":
        raise ValueError("save writes the Huginn, Raven and Ouro formats; a Parcae model is loaded from its own "
                         "checkpoint (config.json with _class_name ParcaeConfig, pytorch_model.bin) and not written")
    folder = Path(folder).expanduser()
    taken = [name for name in ("config.json", "model.safetensors") if (folder / name).exists()]
    if taken:
        raise FileExistsError(f"{folder} already holds {', '.join(taken)}; save writes a checkpoint into a new or "
                              f"empty folder and overwrites nothing")
    config = model.config
    state = {key: value.detach().cpu().contiguous() for key, value in model.state_dict().items()}
    if config.tie_embeddings:
        state.pop("lm_head.weight")
    if config.family == "ouro":
        state = to_ouro_tensors(config, state)
    dtype = str(model.dtype).removeprefix("torch.")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict() | {"torch_dtype": dtype}, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"))
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


#: The special tokens of Parcae's tokenizer (``scripts/tok_train.py`` of ``sandyresearch/parcae`` trains them into
#: the vocabulary) and the role each plays in its code (``parcae_lm/tokenizer.py``: bos_id, eos_id, pad_id).
PARCAE_SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def load_tokenizer(folder: Path, *, parcae: bool = False):
    """The folder's tokenizer through ``transformers``, or None when it has none; a ValueError naming the folder
    when its tokenizer files cannot be read.

    Parcae's hub repositories ship a ``tokenizer.json`` that its code reads with ``add_bos_token=False`` and
    ``add_eos_token=False`` (so does this one: the file's own post-processor decides); a ``tokenizer.json`` alone
    names no special-token roles, so with ``parcae`` each role the files leave unset is given the token that Parcae's
    tokenizer training names for it (:data:`PARCAE_SPECIAL_TOKENS`), when that token is in the vocabulary.
    """
    try:
        if (folder / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
        elif (folder / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        else:
            return None
    except Exception as error:  # tokenizers and transformers raise many kinds: one line naming the folder instead
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"the tokenizer in {folder} cannot be read ({message})") from None
    if parcae:
        vocabulary = tokenizer.get_vocab()
        tokenizer.add_special_tokens({role: token for role, token in PARCAE_SPECIAL_TOKENS.items()
                                      if getattr(tokenizer, role) is None and token in vocabulary})
    return tokenizer
