"""Loading checkpoints in the public format: folders, shards, any config of any family, clear errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import FIXTURES, random_model
from safetensors.torch import load_file, save_file

import looped_kv.runtime.loading
from looped_kv import LoopedConfig, load, make_policy
from looped_kv.decoding.greedy import greedy
from looped_kv.experiments import speed
from looped_kv.runtime.loading import TINY_DIR


def save_checkpoint(model, folder, shards: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_embeddings)}
    keys = sorted(state)
    if shards == 1:
        save_file(state, folder / "model.safetensors")
        return
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, folder / name)
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("family, overrides", [
    ("huginn", {}),
    ("huginn", {"n_heads": 8, "n_kv_heads": 8, "n_prelude": 2, "n_core": 3, "n_coda": 2, "rope_base": 50000.0}),
    ("raven", {}),
    ("raven", {"n_heads": 8, "n_kv_heads": 2, "n_prelude": 3, "n_core": 1, "n_coda": 3, "tie_embeddings": True}),
    ("raven", {"n_heads": 4, "n_kv_heads": 4, "rope_scaling": None}),
    ("raven-olmo", {}),
    ("raven-olmo", {"n_heads": 8, "n_kv_heads": 4, "n_prelude": 0, "n_coda": 2, "tie_embeddings": True}),
])
@pytest.mark.parametrize("shards", [1, 3])
def test_round_trip_any_config(tmp_path, family, overrides, shards):
    model = random_model(family, **overrides)
    save_checkpoint(model, tmp_path / "ckpt", shards)
    loaded = load(tmp_path / "ckpt", dtype=torch.float64)
    assert loaded.config == model.config
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert torch.allclose(loaded(ids, num_loops=3), model(ids, num_loops=3), rtol=0, atol=1e-12)
    out = greedy(loaded, ids, 5, policy=make_policy("full", 3))
    assert torch.equal(model(out.tokens[:, :-1], num_loops=3)[:, 8:].argmax(-1), out.new_tokens)


def test_linear_weights_are_stored_transposed_and_written_as_read(tmp_path):
    """Every linear weight but the head is stored column-major (W^T contiguous, so x @ W^T is a plain product), when
    built and when loaded; a written checkpoint holds the same values, contiguous; float64 logits are the row-major
    model's."""
    def linears(model):
        return {f"{name}.weight": module.weight for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and name != "lm_head"}

    model = random_model("huginn")
    assert len(linears(model)) == 17 and all(w.t().is_contiguous() and not w.is_contiguous()
                                            for w in linears(model).values())
    looped_kv.runtime.loading.save(model, tmp_path / "ckpt")
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    loaded = load(tmp_path / "ckpt", dtype=torch.float64)
    for name, weight in linears(loaded).items():
        assert weight.t().is_contiguous() and stored[name].is_contiguous() and torch.equal(weight, stored[name])
    row_major = speed.row_major(loaded)
    assert all(w.is_contiguous() for w in linears(row_major).values())
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert torch.allclose(loaded(ids, num_loops=3), row_major(ids, num_loops=3), rtol=0, atol=1e-12)


def test_config_family_detection():
    for name, family in (("huginn-tiny", "huginn"), ("raven-llama-tiny", "raven"), ("raven-olmo-tiny", "raven-olmo")):
        assert LoopedConfig.from_file(FIXTURES / name / "config.json").family == family


def olmo_copy(tmp_path, model_file: str, extra: dict[str, torch.Tensor] | None = None):
    """The Raven-OLMo fixture with ``auto_map`` naming ``model_file`` and ``extra`` tensors added."""
    folder = tmp_path / "olmo"
    shutil.copytree(FIXTURES / "raven-olmo-tiny", folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = model_file
    (folder / "config.json").write_text(json.dumps(config))
    if extra:
        save_file({**load_file(folder / "model.safetensors"), **extra}, folder / "model.safetensors")
    return folder


def test_raven_olmo_recognised_by_its_tensors(tmp_path):
    """A config that names no OLMo modeling file (the Huginn file name) is Raven-OLMo by its q_norm/k_norm tensors."""
    folder = olmo_copy(tmp_path, "raven_modeling_minimal.RavenForCausalLM")
    assert LoopedConfig.from_file(folder / "config.json").family == "raven"  # the config alone: rope_theta
    model = load(folder, dtype=torch.float64)
    assert model.config.family == "raven-olmo" and model.config.norm_layout == "reordered" and model.config.qk_norm
    ref = load_file(folder / "reference.safetensors")
    logits = model(ref["input_ids"], num_loops=3, initial_state=ref["input_states"])
    assert torch.allclose(logits, ref["logits_steps3"], rtol=0, atol=1e-12)


def test_raven_olmo_tensors_under_a_llama_config_are_refused(tmp_path):
    folder = olmo_copy(tmp_path, "raven_modeling_minimal_llama.RavenForCausalLM")
    message = (r"checkpoint has tensors the 'raven' config does not describe: "
               r"\['transformer.coda.0.attn.k_norm.weight', 'transformer.coda.0.attn.q_norm.weight'")
    with pytest.raises(ValueError, match=message):
        load(folder)


def test_checkpoint_of_no_family_is_refused(tmp_path):
    """Sandwich norms beside q_norm/k_norm (Huginn with OLMo's qk-norm) match no family: a one-line error."""
    folder = olmo_copy(tmp_path, "raven_modeling_minimal_olmo.RavenForCausalLM",
                       {f"transformer.prelude.0.norm_{i}.weight": torch.ones(64) for i in (3, 4)})
    with pytest.raises(ValueError, match=r"tensors the 'raven-olmo' config does not describe: "
                                         r"\['transformer.prelude.0.norm_3.weight', 'transformer.prelude.0.norm_4"
                                         r".weight'\] \(families: \('huginn', 'raven', 'raven-olmo', 'ouro', "
                                         r"'parcae'\)\)"):
        load(folder)


def test_mismatched_tensor_names_both_shapes(tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(FIXTURES / "huginn-tiny", folder)
    state = load_file(folder / "model.safetensors")
    state["transformer.core_block.1.attn.proj.weight"] = torch.zeros(64, 32)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"transformer.core_block.1.attn.proj.weight.*\(64, 32\).*\(64, 64\)"):
        load(folder)


def test_config_layer_count_mismatch(tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(FIXTURES / "raven-llama-tiny", folder)
    config = json.loads((folder / "config.json").read_text())
    config["n_layers_in_recurrent_block"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing tensor 'transformer.core_block.6"):
        load(folder)


def test_unknown_source(tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ValueError, match="source must be"):
        load(tmp_path / "weights.bin")


def test_tiny_model_loads_offline():
    model = load("tiny")
    cfg = model.config
    assert cfg.family == "huginn" and cfg.mean_recurrence == 32
    assert model.tokenizer is not None
    ids = model.tokenizer("Question: Ava has 3 apples.", return_tensors="pt").input_ids
    assert model(ids, num_loops=2).shape == (1, ids.shape[1], cfg.vocab_size)


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("fp32", torch.float32),
                                         ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("float16", torch.float16), ("fp16", torch.float16),
                                         ("float64", torch.float64)])
def test_dtype_names(name, dtype):
    assert looped_kv.runtime.loading.resolve_dtype(name) == dtype


def test_dtype_name_loads():
    model = load(FIXTURES / "huginn-tiny", dtype="float32")
    assert model.dtype == torch.float32


@pytest.mark.parametrize("dtype", ["float8", "int8", "double", torch.int64, 32])
def test_bad_dtype_is_rejected_before_reading(monkeypatch, dtype):
    def no_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the dtype was checked")

    monkeypatch.setattr(looped_kv.runtime.loading, "load_state", no_read)
    monkeypatch.setattr(looped_kv.runtime.loading, "resolve_source", no_read)
    with pytest.raises(ValueError, match=r"dtype must be a floating-point torch dtype or one of \('float32', 'fp32'"):
        load("tiny", dtype=dtype)


@pytest.mark.parametrize("source", ["./missing", "../missing/model", "/no/such/folder", "~/no-such-looped-kv-ckpt",
                                    "a/b/c"])
def test_missing_local_folder_is_not_a_hub_id(monkeypatch, source):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was contacted for a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    message = rf"source '{re.escape(source)}' looks like a local path but folder .* does not exist"
    with pytest.raises(FileNotFoundError, match=message):
        load(source)


@pytest.mark.parametrize("env, reason", [({"HF_HUB_OFFLINE": "1"}, "hub access is off"),
                                         ({"HF_ENDPOINT": "https://no-such-host.invalid"}, "does not resolve")])
def test_an_unreachable_hub_id_is_one_line_without_retries(monkeypatch, env, reason):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("the hub was contacted")))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(FileNotFoundError, match=rf"source 'does/not-exist' is neither 'tiny' nor an existing folder "
                                                rf"\(here: .*\), and .*{reason}"):
        load("does/not-exist")


def test_a_folder_without_config_says_what_a_checkpoint_folder_holds(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a checkpoint folder: it has no config.json \(a checkpoint "
                                                r"folder holds config.json, model.safetensors"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"it has no model\.safetensors"):
        load(tmp_path)


def test_missing_path_object_is_local(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"looks like a local path but folder .*nothing does not exist"):
        load(tmp_path / "nothing")


def test_training_defaults_are_the_shipped_recipe():
    """`looped-kv train --out DIR` retrains the shipped model's first stage (``checkpoints/tiny-long``): every
    argument it recorded is the default, except where a sitting ran (threads, minutes, its length) and where the run
    was written; options newer than the record default to what it ran with (``train.BEFORE_OPTION``). The shipped
    model continues that stage, and its recorded arguments are the stage's, changed as the training log's later
    sittings say and in no other way."""
    from looped_kv.cli import train_options
    from looped_kv.tiny.train import BEFORE_OPTION

    first = {**BEFORE_OPTION, **json.loads((TINY_DIR.parents[1] / "checkpoints/tiny-long/settings.json").read_text())}
    record = {**BEFORE_OPTION, **json.loads((TINY_DIR / "config.json").read_text())["training"]["args"]}
    defaults = vars(train_options(["--out", "runs/tiny"]))
    sitting = {"out", "export", "resume", "threads", "minutes", "steps"}
    assert set(first) - sitting == set(defaults) - sitting == set(record) - sitting
    assert {k: first[k] for k in set(first) - sitting} == {k: defaults[k] for k in set(first) - sitting}
    continued = dict(first)
    for entry in json.loads((TINY_DIR / "training_log.json").read_text()):
        if "changed" in entry and entry["step"] >= first["steps"]:
            for name, (before, after) in entry["changed"].items():
                assert name in sitting or continued[name] == before, (entry["step"], name)
                continued[name] = after
    assert {k: continued[k] for k in set(record) - sitting} == {k: record[k] for k in set(record) - sitting}
