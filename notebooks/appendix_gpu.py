# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Appendix: the chapters and the batches on a GPU
#
# Every chapter and both example batches run on the tiny model on a CPU. This appendix
# says how to run them on Huginn-0125 and the Raven retrofits on a Colab GPU or a
# workstation, how much memory that takes (computed below from the package's memory
# model, RIPE Eq. 3 and 10, not typed by hand), how to measure the run times, what
# changes from the tiny model, and how to spread a batch over several GPUs.

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab only: install the package
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "looped-kv[book,papers] @ git+https://github.com/looped-kv/looped-kv",
        ],
        check=True,
    )

# %% [markdown]
# ## Running the chapters
#
# Each chapter reads its model from `LOOPED_KV_MODEL` (default `tiny`) and runs on CUDA
# when it is available, in bfloat16 unless `LOOPED_KV_DTYPE` says otherwise
# (`looped_kv.book.chapter_model`). On a workstation:
#
# ```bash
# pip install -e ".[book]"          # keeps your CUDA build of PyTorch
# export LOOPED_KV_MODEL=tomg-group-umd/huginn-0125   # a hub id, or a local folder
# for nb in notebooks/ch*.ipynb; do
#   jupyter nbconvert --to notebook --execute --inplace "$nb"
# done
# jupyter-book build .              # or build the whole book, executing every chapter
# ```
#
# For a Raven retrofit, set `LOOPED_KV_MODEL` to the retrofit's hub id or to a local
# folder with its `config.json`, safetensors and tokenizer (McLeish et al., 2025); the
# loader recognises the family from the config. On Colab, open a chapter with the launch
# button, choose a GPU runtime, and set the model in a cell before the chapter's set-up
# cell: `import os; os.environ["LOOPED_KV_MODEL"] = "tomg-group-umd/huginn-0125"`.
#
# Measurements on a GPU should run with cuDNN's attention backend disabled, which RIPE
# Section 5.5 found to make bf16 reruns differ: wrap a cell in
# `with looped_kv.measurement_mode():`. Batches do this by default and record it in
# their archives.

# %% [markdown]
# ## Memory
#
# The weights take (parameters) x (bytes per parameter). A cache of $L$ tokens takes
# RIPE Eq. (3) for the full cache and the deepest plane, and Eq. (10) for RIPE($W$). A
# teacher-forced replay that records the keys and values of every loop (the replay
# chapters, the `regions` batch) holds the core's share of the full cache for each text
# it keeps. Activations and the allocator's overhead come on top.

# %%
import pandas as pd
import torch
from IPython.display import Markdown

import looped_kv
from looped_kv.analysis.plan import parameter_count
from looped_kv.book import DTYPES
from looped_kv.protocol import batches
from looped_kv.runtime.loading import TINY_DIR
from looped_kv.runtime.memory import (
    element_bytes,
    layer_token_bytes,
    m_deep,
    m_full,
    m_ripe,
)

configs = {
    "tiny": looped_kv.LoopedConfig.from_file(TINY_DIR / "config.json"),
    "Huginn-0125": looped_kv.huginn_0125(),
    "Raven-Llama": looped_kv.raven_llama(),
}
R, W, GB = 32, 64, 1e9
rows = []
for name, config in configs.items():
    params = parameter_count(config)
    row = {
        "model": name,
        "parameters (B)": params / 1e9,
        "weights bf16": params * element_bytes("bf16") / GB,
        "weights fp32": params * element_bytes("fp32") / GB,
    }
    for L in (1024, 4096):
        row[f"full cache, L={L}"] = m_full(config, L, R) / GB
        row[f"deepest plane, L={L}"] = m_deep(config, L) / GB
        row[f"RIPE W={W}, L={L}"] = m_ripe(config, L, W, R) / GB
    row["replay planes, L=1024"] = (
        layer_token_bytes(config, "bf16") * 1024 * R * config.n_core / GB
    )
    rows.append(row)
memory = pd.DataFrame(rows).set_index("model")
memory.T.style.format("{:.3f}").set_caption(
    "GB (10^9 bytes) per sequence, bf16 unless stated, R = 32"
)

# %% [markdown]
# The example batches load the model once per precision their arms use (the `windows`
# batch compares bf16 with an fp32 full cache, as RIPE Section 5.1 does), so their
# weights cost more than one copy:

# %%
per_batch = []
for name in batches.example_names():
    spec = batches.load_spec(name)
    row = {"batch": f"{spec.batch} ({name})", "precisions": ", ".join(spec.precisions)}
    for model_name, config in configs.items():
        params = parameter_count(config)
        row[f"{model_name} weights GB"] = (
            sum(params * element_bytes(DTYPES[p]) for p in spec.precisions) / GB
        )
    per_batch.append(row)
per_batch = pd.DataFrame(per_batch).set_index("batch")
per_batch.style.format(precision=2)

# %%
huginn, raven = memory.loc["Huginn-0125"], memory.loc["Raven-Llama"]
windows = per_batch.filter(like="windows", axis=0).iloc[0]
fits = ""
if torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory / GB
    need = huginn["weights bf16"] + huginn["full cache, L=4096"]
    fits = (
        f" This machine's GPU has {total:.1f} GB: Huginn-0125 in bf16 with a full "
        "4096-token cache "
        f"({need:.1f} GB before activations) "
        f"{'fits' if need < total else 'does not fit'}."
    )
Markdown(
    f"Huginn-0125 has {huginn['parameters (B)']:.2f}B parameters: "
    f"{huginn['weights bf16']:.1f} GB of bf16 "
    f"weights, and a full cache of {huginn['full cache, L=1024']:.2f} GB per "
    "1024-token sequence against "
    f"{huginn['RIPE W=64, L=1024']:.2f} GB for RIPE with W = {W} "
    f"({huginn['RIPE W=64, L=1024'] / huginn['full cache, L=1024']:.1%}). Raven-Llama "
    "needs "
    f"{raven['weights bf16']:.1f} GB of weights and {raven['full cache, L=1024']:.2f} "
    "GB of full cache per "
    f"1024 tokens. Recording every plane of a 1024-token text for a replay costs "
    f"{huginn['replay planes, L=1024']:.2f} GB on Huginn-0125, so chapters that keep "
    "several texts' planes "
    f"need several times that. The windows batch on Huginn-0125 holds "
    f"{windows['Huginn-0125 weights GB']:.1f} GB of weights.{fits}"
)

# %% [markdown]
# The same table for any checkpoint, context and batch size comes from the command line,
# e.g. `looped-kv memory --model huginn-0125 --context 1024 4096 --batch-size 8` (or a
# folder, a `config.json` or a hub id as `--model`).
#
# ## Run times
#
# This book does not print run times for the real checkpoints: none were measured on the
# machines it was built on. Measure them on yours:
#
# * decoders: `looped-kv bench --model tomg-group-umd/huginn-0125 --prompts 4
#   --max-new-tokens 64` prints tokens/s and the speed-up over paired greedy decoding
#   per method (chapters 5-6);
# * batched decoding: `looped-kv batched --model tomg-group-umd/huginn-0125` prints
#   tokens/s against batch size and the fixed-memory throughput ratio (chapter 7);
# * a batch: its archive records when it started and finished (`run.json`) and every
#   decoder run's wall time (`timings.jsonl`); run it on two prompts first and scale by
#   the number of prompts;
# * a chapter: `time jupyter nbconvert --to notebook --execute
#   notebooks/<chapter>.ipynb`.
#
# ## What changes from the tiny model
#
# Each chapter reads what it runs at from the model's run profile
# (`looped_kv.profiles`), so sizes, dtypes and where replay records live change with the
# model; the page "Running on real checkpoints" lists what each chapter then needs.
# Numerics change too. The real checkpoints run in bfloat16 on a GPU, where rounding,
# not only the cache, separates two decoders (RIPE Section 5.5: bf16 trajectories of
# equal-in-exact-arithmetic decoders agree on 20 of 32 prompts), so exactness checks
# compare against a stated reference. Effect sizes
# differ (each chapter prints the papers' numbers beside the tiny model's), and batches
# grow: the papers' batches use 40 to 72 texts or prompts per model (RIPE Sections 3.1
# and
# 5.1), where the example batches use 6 to 8 short ones.
#
# The DAS paper's decoding workloads are four tasks, each with its own prompt convention
# and cap on generated tokens (DAS Table 4, Appendix A.1). The package formats two of
# them in those conventions for the real checkpoints (`looped_kv.workloads.formats`:
# GSM8K from its hub rows with eight worked shots, MBPP as code completion); the tiny
# model decodes generated workloads instead. The table sets the paper's caps beside the
# tokens the real checkpoints' profile decodes per timed prompt in chapters 5 and 6.

# %%
from IPython.display import display

from looped_kv import book, papers, profiles
from looped_kv.workloads import formats

HUGINN_PROFILE = profiles.HUGINN_0125
timed = {"ch05": HUGINN_PROFILE.ch05.new_tokens, "ch06": HUGINN_PROFILE.ch06.new_tokens}
table4 = pd.DataFrame.from_dict(
    {task: {"cap (new tokens)": cap, "prompt convention": convention,
            "formatted here": task.lower().replace("-", "") in formats.DATASETS,
            **{f"{HUGINN_PROFILE.name} {ch} tokens": n for ch, n in timed.items()}}
     for task, (cap, convention) in papers.DAS_TABLE_4.items()}, orient="index")
display(book.table(table4, caption="DAS Table 4 (the paper) and the package"))
longest = max(timed.values())
shares = [longest / cap for cap, _ in papers.DAS_TABLE_4.values()]
Markdown(
    f"A timed prompt of the {HUGINN_PROFILE.name} profile decodes at most {longest} "
    f"tokens, {min(shares):.0%} to {max(shares):.0%} of the paper's caps: enough to "
    "measure a speed-up, far less than the paper lets a generation run before its "
    "end-of-text or stop condition.")

# %% [markdown]
# A batch on a real checkpoint is a new pre-registration: copy an example spec
# (`looped_kv/batch_specs/regions.yaml` or `windows.yaml`) and its prompt file into a
# folder, set `model: tomg-group-umd/huginn-0125` with `revision:` the commit to
# download (required for hub ids), and raise `tokens`, `decoded`, `max_new_tokens` and
# the number of prompts; then freeze it before running:
#
# ```bash
# # SHA-256 of the spec, the prompts and the package:
# looped-kv batch freeze my_batch/regions.yaml -o regions.frozen.json
# looped-kv batch run regions.frozen.json --out runs/regions   # self-tests, arms
# looped-kv batch verify runs/regions     # here, and again wherever it is copied
# looped-kv batch ledger runs/regions runs/windows   # RIPE Appendix B layout
# ```
#
# The archive's `MANIFEST.sha256` also checks with `sha256sum -c MANIFEST.sha256` on a
# machine without the package.
#
# ## Several GPUs and nodes
#
# `batch run` shards the prompts across processes when it is launched by `torchrun`:
# prompt $i$ goes to rank $i \bmod N$, each process uses its own GPU (NCCL; gloo on
# CPUs), checks its own file table and runs the self-tests, and rank 0 merges the
# records into one archive, which is byte for byte the archive of a single-process run
# except for `run.json` (machines, clock) and `timings.jsonl` (the CI test
# `tests/test_distributed.py` checks this with two CPU processes).
#
# ```bash
# torchrun --nproc-per-node 4 -m looped_kv.cli batch run windows.frozen.json \
#     --out runs/windows
# # two nodes with 8 GPUs each: the same command on both, HOST being one of them
# torchrun --nnodes 2 --nproc-per-node 8 --rdzv-id windows --rdzv-backend c10d \
#     --rdzv-endpoint HOST:29500 \
#     -m looped_kv.cli batch run windows.frozen.json --out runs/windows
# ```
#
# Every node needs the same spec, prompt files, package and model files, or its table
# check fails; only rank 0 writes the archive.
