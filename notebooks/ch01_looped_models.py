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
# # 1. Looped models from the inside
#
# A looped language model embeds a token with a **prelude** $P$, runs a **core** block $B$ of
# $n_\text{core}$ layers $R$ times on a recurrent state that starts at random, and reads the result out
# with a **coda** $C$ (RIPE Eq. 1-2):
#
# $$ s_t^{(r)} = B\big(s_t^{(r-1)}, P(x_t); \mathcal{C}_{<t}\big), \quad r = 1, \dots, R, \qquad
#    z_t = C\big(s_t^{(R)}\big). $$
#
# Every attention call writes keys and values. In the core, loop $r$ of core layer $l$ writes its own
# keys and values for every token. Loop $r$'s keys and values over all core layers form **plane** $r$.
# A full KV cache therefore holds $R$ planes per core layer. This chapter looks at these pieces on the
# model at hand, counts the planes and the bytes they cost (RIPE Eq. 3), and checks that the model
# actually uses its depth.

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab only: install the package
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "looped-kv[book] @ git+https://github.com/looped-kv/looped-kv"], check=True)

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display

import looped_kv
from looped_kv import book, data, papers
from looped_kv.analysis.measure import draft_agreement
from looped_kv.decoding.core import prefill
from looped_kv.runtime.memory import m_deep, m_full

model = book.chapter_model()  # $LOOPED_KV_MODEL, default "tiny"; CUDA when available
cfg = model.config
R = cfg.mean_recurrence
print(f"model: {model.source}  family: {cfg.family}  device: {model.device}  dtype: {model.dtype}  R = {R}")

# %% [markdown]
# ## Prelude, core and coda
#
# The table compares the model at hand with the two public families, whose shapes the package knows
# from their configs. The tiny model has Huginn's structure: sandwich blocks, an adapter over
# $[s, P(x)]$, a random initial state and $R = 32$ at inference. It is much smaller.


# %%
def shape(config: looped_kv.LoopedConfig, params: int | None = None) -> dict:
    return {"family": config.family, "prelude": config.n_prelude, "core": config.n_core, "coda": config.n_coda,
            "d_model": config.n_embd, "heads": config.n_heads, "KV heads": config.n_kv_heads,
            "head dim": config.head_dim, "vocab": config.vocab_size,
            "parameters (M)": round(params / 1e6, 2) if params else None}


params = sum(p.numel() for p in model.parameters())
architectures = pd.DataFrame({"this model": shape(cfg, params), "Huginn-0125": shape(looped_kv.huginn_0125()),
                              "Raven-Llama": shape(looped_kv.raven_llama())})
architectures

# %% [markdown]
# ## One token's journey, piece by piece
#
# The package exposes the pieces the papers talk about: `embed` (embedding and prelude),
# `initial_state`, `loop` (one loop of the core) and `readout` (coda and head). Chaining them by hand
# gives exactly the model's forward. Each attention call passes through a *router*, and recording the
# calls shows the planes.

# %%
prompt = data.word_problems(1, split="eval")[0].prompt
ids = book.encode(model, prompt)
positions = torch.arange(ids.shape[1], device=model.device)
record: dict = {}
router = looped_kv.CausalRouter(record)
with torch.no_grad():
    embedded = model.embed(ids, positions, router)
    state = model.initial_state(positions, batch=1)
    for r in range(1, R + 1):
        state = model.loop(state, embedded, positions, router, r)
    logits = model.readout(state, positions, router)
    assert torch.allclose(logits, model(ids, num_loops=R), atol=1e-5)

core_sites = sorted((s for s in record if s.stage == "core"), key=lambda s: (s.loop, s.layer))
assert len(record) == cfg.layer_passes(R)  # n_pre + R n_core + n_coda attention calls, each with its own K/V
assert {s.loop for s in core_sites} == set(range(1, R + 1))
k, v = record[core_sites[0]]
Markdown(f"The prompt has {ids.shape[1]} tokens. One forward at R = {R} makes {len(record)} attention calls: "
         f"{cfg.n_prelude} in the prelude, {len(core_sites)} in the core ({R} loops x {cfg.n_core} layers) and "
         f"{cfg.n_coda} in the coda. Each call writes keys and values of shape {tuple(k.shape)} "
         f"(batch, KV heads, positions, head dim). Plane r is the {cfg.n_core} core calls of loop r.")

# %% [markdown]
# ## What a plane costs: RIPE Eq. (3)
#
# With $b = 2 H_\text{kv} d_h \times$ (bytes per element) for one layer's key and value of one token, a
# sequence of $L$ tokens needs
#
# $$ M_\text{full}(L) = b L (n_\text{pre} + n_\text{coda} + R\, n_\text{core}), \qquad
#    M_\text{deep}(L) = b L (n_\text{pre} + n_\text{coda} + n_\text{core}). $$
#
# The package computes both from a config. It also allocates caches that hold exactly that many bytes:
# the full cache keeps every plane and the deepest-plane cache keeps plane $R$ only (Huginn's
# `compress-s4` is exactly this cache, `tests/test_conformance.py`).

# %%
rows = []
for name, config in [("this model", cfg), ("Huginn-0125", looped_kv.huginn_0125()),
                     ("Raven-Llama", looped_kv.raven_llama())]:
    full, deep = m_full(config, 1, R, "bf16") / 1e3, m_deep(config, 1, "bf16") / 1e3
    rows.append({"model": name, "full KB/token": full, "deepest KB/token": deep, "deepest / full": deep / full})
memory = pd.DataFrame(rows).set_index("model")

for policy_name in ("full", "deepest"):  # real allocations equal the equation, byte for byte
    cache = looped_kv.PlaneCache(cfg, looped_kv.make_policy(policy_name, R), batch=1, capacity=ids.shape[1],
                                 dtype=model.dtype, device=model.device)
    with torch.no_grad():
        prefill(model, cache, ids, R)
    L = ids.shape[1]
    equation = m_full(cfg, L, R, model.dtype) if policy_name == "full" else m_deep(cfg, L, model.dtype)
    assert cache.nbytes == cache.allocated_bytes == equation
memory.style.format({"full KB/token": "{:,.1f}", "deepest KB/token": "{:,.1f}", "deepest / full": "{:.1%}"})

# %%
huginn = memory.loc["Huginn-0125"]
raven = memory.loc["Raven-Llama"]
Markdown(f"In bf16, Huginn-0125 stores {huginn['full KB/token']:,.0f} KB per token with the full cache and "
         f"{huginn['deepest KB/token']:,.0f} KB with the deepest plane alone ({huginn['deepest / full']:.1%}); "
         f"Raven-Llama {raven['full KB/token']:,.0f} against {raven['deepest KB/token']:,.1f} KB "
         f"({raven['deepest / full']:.1%}). These are the RIPE paper's figures, computed from the configs.")

# %% [markdown]
# ## Does the model use its depth?
#
# A looped model earns its loops if more of them lower the loss on held-out text. We measure the
# next-token loss on evaluation texts of both workloads for a range of loop counts.

# %%
loops = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
texts = {w: book.encode(model, data.texts(w, 6, split="eval", chars=900)) for w in data.WORKLOADS}


@torch.no_grad()
def loss_at(num_loops: int, encoded: list[torch.Tensor]) -> float:
    losses = [torch.nn.functional.cross_entropy(model(x[:, :-1], num_loops=num_loops)[0].float(), x[0, 1:])
              for x in encoded]
    return float(torch.stack(losses).mean())


curve = pd.DataFrame({w: [loss_at(n, enc) for n in loops] for w, enc in texts.items()}, index=loops)
curve.index.name = "loops"
fig, ax = plt.subplots(figsize=(6, 3.5))
for w in curve:
    ax.plot(curve.index, curve[w], marker="o", label=w)
ax.axvline(R, color="grey", ls=":", lw=1)
ax.set(xscale="log", xlabel="loops R", ylabel="next-token loss (nats)", title="Held-out loss against depth")
ax.set_xticks(loops, [str(n) for n in loops])
ax.legend()
plt.show()
curve.round(3).T

# %%
mean = curve.mean(axis=1)
drop_to_32 = mean[1] - mean[32]
beyond_32 = abs(mean[64] - mean[32])
assert mean[32] < mean[1]  # depth helps
assert beyond_32 < 0.1 * drop_to_32  # and has levelled off by R = 32
settled = next(n for n in loops if mean[n] - mean[32] < 0.01 * drop_to_32)  # within 1% of the gain
Markdown(f"Averaged over both workloads the loss falls from {mean[1]:.3f} nats at one loop to {mean[32]:.3f} at 32. "
         f"From 32 to 64 loops it changes by {beyond_32:.4f} nats, {beyond_32 / drop_to_32:.1%} of the gain from 1 to "
         f"32 loops: the model uses its depth, and R = 32 is past the point where more loops help. It gets "
         f"within 1% of its full-depth loss after only {settled} loops.")

# %% [markdown]
# ## A short greedy generation
#
# Greedy full-depth decoding is the baseline of every later chapter. With the full cache it must give
# exactly the argmax of a cache-free forward over the growing sequence (in bfloat16 on a GPU, up to
# near-ties that the two computations round differently; `book.check_greedy_tokens`). The deepest-plane
# cache is a different model of the prefix, and its text may differ.

# %%
full = looped_kv.generate(model, ids, max_new_tokens=40, method="ar", cache="full")
deepest = looped_kv.generate(model, ids, max_new_tokens=40, method="ar", cache="deepest")
with torch.no_grad():
    no_cache = model(full.tokens[:, :-1], num_loops=R)[:, ids.shape[1] - 1:]
near_ties = book.check_greedy_tokens(no_cache, full.new_tokens)  # exact in float32
same = int((full.new_tokens == deepest.new_tokens).sum())
print(prompt + book.decode(model, full.new_tokens))
Markdown(f"Full cache: {full.tokens_per_s:.1f} tokens/s; deepest plane: {deepest.tokens_per_s:.1f} tokens/s. "
         f"The two caches agree on {same} of the {full.num_new} generated tokens. The deepest-plane cache "
         f"holds {deepest.extra['cache_bytes'] / full.extra['cache_bytes']:.1%} of the full cache's bytes.")

# %% [markdown]
# How much of its depth does a token need? A one-loop draft reads the cached prefix and is compared with the
# full-depth token at every position of the continuation above (the measurement of DAS Table 6).

# %%
PAPER_ONE_LOOP = {m: papers.DAS_TABLE_6[m]["Aligned"][0]  # DAS Table 6: aligned, d = 1
                  for m in (papers.HUGINN, papers.RAVEN_LLAMA)}
one_loop = draft_agreement(model, full.tokens, ids.shape[1], [1], ["aligned"])[(1, "aligned")]
Markdown(f"A one-loop draft agrees with the {R}-loop token at {one_loop:.0%} of the positions; DAS Table 6 "
         f"measures {PAPER_ONE_LOOP['Huginn-0125']:.0%} on Huginn-0125 and {PAPER_ONE_LOOP['Raven-Llama']:.0%} on "
         f"Raven-Llama. "
         + ("Shallow drafts are unusually good on this model, and the next chapters say so where it matters."
            if one_loop > max(PAPER_ONE_LOOP.values()) else
            "Its shallow drafts are within the papers' range." if one_loop >= min(PAPER_ONE_LOOP.values()) else
            "Its shallow drafts are worse than the papers' models'."))

# %% [markdown]
# ## What the tiny model is, and is not
#
# The shipped model was trained on a 2-core CPU with Huginn's recipe (`looped_kv/tiny/train.py`): a
# recurrence count per step drawn from a Poisson-lognormal and truncated backpropagation through the last
# loops. It was trained on generated word problems and the Python
# standard library. The next chapters measure on it the phenomena the papers report (planes that ripen
# with depth, deep loops that matter more, drafts that agree with the target) and say for each whether it
# shows. It is far too small to match the papers' magnitudes: every chapter prints the papers' numbers
# beside the tiny model's and says where they differ.

# %%
training = cfg.extra.get("training", {})
summary = pd.Series({k: training[k] for k in ("parameters", "steps", "batch", "seq", "train_mean_recurrence",
                                               "backprop_loops", "minutes") if k in training}, name="training")
log_file = looped_kv.runtime.loading.TINY_DIR / "training_log.json"
if book.is_tiny(model) and log_file.exists():
    log = pd.read_json(log_file)
    seconds_per_step = (log["time_s"].diff() / log["step"].diff()).dropna()
    fastest = seconds_per_step.min()
    idle_minutes = fastest * training["steps"] / 60
    display(Markdown(f"Training took {training['minutes']} minutes of wall time on 2 cores that other work shared "
                     f"part of the time; its fastest stretch ran at {fastest:.2f} s per step, which is "
                     f"{idle_minutes:.0f} minutes for all {training['steps']} steps on idle cores."))
summary.to_frame()
