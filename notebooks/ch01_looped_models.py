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
# A looped language model embeds a token with a **prelude** $P$, runs a **core** block
# $B$ of $n_\text{core}$ layers $R$ times on a recurrent state that starts at random,
# and reads the result out with a **coda** $C$ (RIPE Eq. 1-2):
#
# $$ s_t^{(r)} = B\big(s_t^{(r-1)}, P(x_t); \mathcal{C}_{<t}\big),
#    \quad r = 1, \dots, R,
#    \qquad z_t = C\big(s_t^{(R)}\big). $$
#
# Every attention call writes keys and values. In the core, loop $r$ of core layer $l$
# writes its own keys and values for every token. Loop $r$'s keys and values over all
# core layers form **plane** $r$. A full KV cache therefore holds $R$ planes per core
# layer. This chapter looks at these pieces on the model at hand, counts the planes and
# the bytes they cost (RIPE Eq. 3), checks whether the model uses its depth, and decodes
# from it.

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab: install, then choose what fits the GPU
    PACKAGE = "looped-kv[book,papers] @ git+https://github.com/looped-kv/looped-kv"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", PACKAGE], check=True)
    from looped_kv import book

    book.colab_setup("ch01")

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display

import looped_kv
from looped_kv import book, papers, profiles, prose, workloads
from looped_kv.analysis import verdicts as V
from looped_kv.analysis.depth import (
    DEPTH_BUCKETS,
    answer_hits,
    answer_loss_by_program,
    depth_stops_paying,
    encode_chains,
    encode_texts,
    loss_by_text,
)
from looped_kv.analysis.measure import draft_agreement_rows
from looped_kv.decoding.passes import prefill
from looped_kv.runtime import exit_gate
from looped_kv.runtime.memory import m_deep, m_full
from looped_kv.tiny import gates
from looped_kv.workloads import data

book.setup()
model = book.chapter_model()  # $LOOPED_KV_MODEL, default "tiny"; CUDA when available
run = profiles.for_model(model)
profile = run.ch01  # every size of this chapter
CHUNK = run.rows_per_chunk  # batches run in row chunks of at most this many rows
cfg = model.config
R = cfg.mean_recurrence
print(book.environment(model))
print(workloads.preflight(model, run))  # every prompt tokenized, held to the bound

# %% [markdown]
# ## How far this model's depth pays
#
# Every later chapter asks what a model's deep loops add, so every ceiling it meets
# follows from how much the model gains from its loops. For the shipped tiny model the
# training gates measured that on held-out chain programs; this chapter measures it
# again below, on text and on chain answers, for whatever model it runs on.

# %% tags=["remove-input"]
gate_record = cfg.raw.get("gates")
book.md(
    gates.depth_story(gate_record) if book.is_tiny(model) and gate_record else
    "This checkpoint has no recorded gates: the measurements below are the first "
    "word on how far its depth pays."
)

# %% [markdown]
# ## Prelude, core and coda
#
# The table compares the model at hand with the public families whose shapes the
# package knows from their configs: Huginn-0125, trained as a looped model from scratch,
# the three Raven retrofits of pretrained models that the DAS paper evaluates,
# Raven-Llama (Llama-3.2 1B), Raven-OLMo (OLMo-2 1B) and Raven-TinyLlama (TinyLlama
# 1.1B), and Ouro-1.4B, which loops its whole stack of layers from the token embedding,
# with no prelude, coda or adapter. The tiny model has Huginn's structure: sandwich
# blocks, an adapter over $[s, P(x)]$, a random initial state and $R = 32$ at
# inference. It is much smaller. The column "DAS Table 3" holds the layer counts and
# recurrence the DAS paper prints for its four checkpoints, (prelude, core, coda, $R$),
# and the cell under the table checks them against the configs.


# %%
def shape(config: looped_kv.LoopedConfig, params: int | None = None) -> dict:
    return {
        "family": config.family,
        "prelude": config.n_prelude,
        "core": config.n_core,
        "coda": config.n_coda,
        "d_model": config.n_embd,
        "heads": config.n_heads,
        "KV heads": config.n_kv_heads,
        "head dim": config.head_dim,
        "vocab": config.vocab_size,
        "R": config.mean_recurrence,
        "parameters (M)": params / 1e6 if params else None,
    }


public = {
    papers.HUGINN: looped_kv.huginn_0125(),
    papers.RAVEN_LLAMA: looped_kv.raven_llama(),
    papers.RAVEN_OLMO: looped_kv.raven_olmo(),
    papers.RAVEN_TINYLLAMA: looped_kv.raven_tinyllama(),
}
params = sum(p.numel() for p in model.parameters())
known = public | {  # DAS Table 6 has no Ouro or Parcae
    "Ouro-1.4B": looped_kv.ouro_1_4b(),
    "Parcae-140M": looped_kv.parcae_140m(),
    "Parcae-370M": looped_kv.parcae_370m(),
    "Parcae-770M": looped_kv.parcae_770m(),
    "Parcae-1.3B": looped_kv.parcae_1_3b(),
}
architectures = pd.DataFrame.from_dict(
    {"this model": shape(cfg, params)} | {name: shape(c) for name, c in known.items()},
    orient="index",
)
printed3 = {name: ", ".join(map(str, row)) for name, row in papers.DAS_TABLE_3.items()}
architectures["DAS Table 3"] = pd.Series(printed3)
book.table(architectures)

# %% tags=["remove-input"]
for name, row in papers.DAS_TABLE_3.items():  # the configs are the printed checkpoints
    c = public[name]
    assert (c.n_prelude, c.n_core, c.n_coda, c.mean_recurrence) == row, name
passes = {m: c.layer_passes(c.mean_recurrence) for m, c in public.items()}
deepest = max(passes, key=passes.get)
book.md(
    f"The configs reproduce all {len(papers.DAS_TABLE_3)} rows of DAS Table 3. At "
    f"$R = {public[deepest].mean_recurrence}$ loops, {deepest}'s "
    f"{public[deepest].n_core} core layers make it the deepest of the four: "
    f"{passes[deepest]} layer passes per token, against "
    + prose.listing(f"{n} for {m}" for m, n in passes.items() if m != deepest)
    + " (RIPE Eq. 8's $c(R)$).")

# %% [markdown]
# ## One token's journey, piece by piece
#
# The package exposes the pieces the papers talk about: `embed` (embedding and prelude),
# `initial_state`, `loop` (one loop of the core) and `readout` (coda and head). Chaining
# them by hand gives exactly the model's forward. Each attention call passes through a
# *router*, and recording the calls shows the planes.

# %%
ids = workloads.prompt_ids(model, run, "problems", 1)[0]
positions = torch.arange(ids.shape[1], device=model.device)
record: dict = {}
router = looped_kv.CausalRouter(record)
with torch.no_grad():
    embedded = model.embed(ids, positions, router)
    state = model.initial_state(positions, batch=1, tokens=ids)
    for r in range(1, R + 1):
        state = model.loop(state, embedded, positions, router, r)
    logits = model.readout(state, positions, router)
    forward = model(ids, num_loops=R)
tolerance = 1e-5 if model.dtype in (torch.float32, torch.float64) else 1e-2
assert torch.allclose(
    logits.float(), forward.float(), atol=tolerance * forward.abs().max()
)

core_sites = sorted(
    (s for s in record if s.stage == "core"), key=lambda s: (s.loop, s.layer)
)
assert len(record) == cfg.layer_passes(
    R
)  # n_pre + R n_core + n_coda calls, each with K/V
assert {s.loop for s in core_sites} == set(range(1, R + 1))
k, v = record[core_sites[0]]

# %% tags=["remove-input"]
book.md(
    f"The prompt has {ids.shape[1]} tokens. One forward at $R$ = {R} makes "
    f"{len(record)} "
    f"attention calls: {cfg.n_prelude} in the prelude, {len(core_sites)} in the core "
    f"({R} "
    f"loops × {cfg.n_core} layers) and {cfg.n_coda} in the coda. Each call writes keys "
    "and "
    f"values of shape {tuple(k.shape)} (batch, KV heads, positions, head dim). Plane "
    "$r$ "
    f"is the {cfg.n_core} core calls of loop $r$."
)

# %% [markdown]
# ## What a plane costs: RIPE Eq. (3)
#
# With $b = 2 H_\text{kv} d_h \times$ (bytes per element) for one layer's key and value
# of one token, a sequence of $L$ tokens needs
#
# $$ \begin{gathered}
#    M_\text{full}(L) = b L (n_\text{pre} + n_\text{coda} + R\, n_\text{core}), \\
#    M_\text{deep}(L) = b L (n_\text{pre} + n_\text{coda} + n_\text{core}).
#    \end{gathered} $$
#
# The package computes both from a config. It also allocates caches that hold exactly
# that many bytes: the full cache keeps every plane and the deepest-plane cache keeps
# plane $R$ only (Huginn's `compress-s4` is exactly this cache,
# `tests/test_conformance.py`). The paper's column gives the per-token figures RIPE
# Section 2 prints.

# %%
rows = {}
for name, config in {"this model": cfg, **public}.items():
    full_kb = m_full(config, 1, config.mean_recurrence, "bf16") / 1e3
    deep_kb = m_deep(config, 1, "bf16") / 1e3
    printed = papers.RIPE_SEC_2_KV_PER_TOKEN.get(name, {})
    rows[name] = {
        "full KB/token": full_kb,
        "deepest KB/token": deep_kb,
        "deepest / full": deep_kb / full_kb,
        "full (paper)": printed.get("full"),
        "deepest (paper)": printed.get("deepest"),
    }
memory = pd.DataFrame.from_dict(rows, orient="index")
for (
    name,
    printed,
) in papers.RIPE_SEC_2_KV_PER_TOKEN.items():  # Eq. (3) gives the paper's
    for cache, value in printed.items():
        decimals = len(str(value).partition(".")[2])
        assert round(memory.loc[name, f"{cache} KB/token"], decimals) == value, name

for policy_name in (
    "full",
    "deepest",
):  # real allocations equal the equation, byte for byte
    cache = looped_kv.PlaneCache(
        cfg,
        looped_kv.make_policy(policy_name, R),
        batch=1,
        capacity=ids.shape[1],
        dtype=model.dtype,
        device=model.device,
    )
    with torch.no_grad():
        prefill(model, cache, ids, R)
    L = ids.shape[1]
    equation = (
        m_full(cfg, L, R, model.dtype)
        if policy_name == "full"
        else m_deep(cfg, L, model.dtype)
    )
    assert cache.nbytes == cache.allocated_bytes == equation
book.table(memory, percent=("deepest / full",))

# %% tags=["remove-input"]
huginn, llama, olmo = (memory.loc[n] for n in list(public)[:3])
book.md(
    f"In bf16, Huginn-0125 stores {huginn['full KB/token']:,.0f} KB per token with the "
    "full "
    f"cache and {huginn['deepest KB/token']:,.0f} KB with the deepest plane alone "
    f"({huginn['deepest / full']:.1%}); Raven-Llama {llama['full KB/token']:,.0f} "
    "against "
    f"{llama['deepest KB/token']:,.1f} KB ({llama['deepest / full']:.1%}), and "
    "Raven-OLMo, "
    f"whose 16 KV heads are twice Raven-Llama's, {olmo['full KB/token']:,.0f} against "
    f"{olmo['deepest KB/token']:,.1f} KB ({olmo['deepest / full']:.1%}). The first two "
    "are "
    "the RIPE paper's figures (asserted above), computed from the configs alone."
)

# %% [markdown]
# ## Does the model use its depth?
#
# A looped model earns its loops if more of them lower the loss on held-out text (the
# premise of Huginn, Geiping et al. 2025, on which both papers build). We measure the
# next-token loss of evaluation texts of the three workloads for a range of loop counts:
# word problems with worked answers, standard-library code, and variable chains, whose
# answers need one lookup per binding and so are where depth should pay
# (`looped_kv.workloads.data`). A real checkpoint's profile puts solved GSM8K problems
# and MBPP tasks in place of the first two (`looped_kv.workloads`). The claim is tested
# per workload on paired per-text losses (on chains, each program's loss on its
# answers alone: its names and digits are random): the loss after $R$ loops is lower
# than after a few, by at least the book's smallest effect in log units, here nats
# (`verdicts.BOOK_MINIMUM`; the papers print no smallest gain, and the training gates of
# `looped_kv.tiny.gates` ask theirs of answer tokens alone). The same gain says where
# depth stops paying: at the smallest loop count from which no deeper count lowers the
# mean loss by that much (`depth_stops_paying`). Every later chapter's wording about the
# model's depth follows from these figures.

# %%
SHALLOW = profile.shallow_loops
loops = sorted({*profile.loops, SHALLOW, R})
texts = {
    w: encode_texts(
        model.tokenizer,
        workloads.texts(
            w, profile.texts_per_workload, "eval", profile.text_chars, run.workloads
        ),
    )
    for w in data.WORKLOADS
    if w != "chains"
}
losses = {
    w: loss_by_text(model, ids_w, loops, real, rows_per_chunk=CHUNK)
    for w, (ids_w, real) in texts.items()
}
# On chains only the answers are scored: names and digits are random.
programs = data.chain_programs(profile.chain_programs, split="eval")
hits = answer_hits(model, encode_chains(model.tokenizer, programs), loops)
losses["chains"] = answer_loss_by_program(hits)
curve = pd.DataFrame({w: table.mean() for w, table in losses.items()})
fig, ax = plt.subplots(figsize=book.COLUMN)
for w in curve:
    ax.plot(curve.index, curve[w], marker="o", label=w)
ax.axvline(R, color="grey", ls=":", lw=1)
ax.set(
    xscale="log",
    xlabel="loops R",
    ylabel="loss (nats); chains: answers",
    title="Held-out loss against depth",
)
ax.set_xticks(loops, [str(n) for n in loops])
ax.minorticks_off()
ax.legend()
plt.show()

LOSS_GAIN = V.BOOK_MINIMUM["log"]  # nats: the smallest loss gain that counts
ACCURACY_GATE = {gate.name: gate for gate in gates.GATES}["answer accuracy gain"]
depth_pays = V.Claim(
    f"more loops lower held-out loss: loss after R = {R} < after {SHALLOW} loops",
    "Geiping et al. (2025); RIPE Eq. (1)",
    "less",
    minimum=LOSS_GAIN,
    minimum_source="the book's smallest effect in log units (nats)",
)
loss_verdicts = {
    f"{w}: loss, R = {R} vs {SHALLOW}": V.verdict(
        depth_pays, table[R], table[SHALLOW], units="texts"
    )
    for w, table in losses.items()
}
book.table(curve.T.rename_axis("workload"), digits=4)

# %% tags=["remove-input"]
deepest_loops = max(loops)


def gain(w: str, a: int, b: int) -> float:
    return curve.loc[a, w] - curve.loc[b, w]


book.md(
    " ".join(
        f"On {w}, the mean loss {book.change(-gain(w, 1, R), 3, 'nats')} from one loop "
        f"to {R} and {book.change(-gain(w, SHALLOW, R), 3)} from {SHALLOW} to {R}; "
        f"from {R} to {deepest_loops} loops it "
        f"{book.change(-gain(w, R, deepest_loops), 3)}."
        for w in curve
    )
    + "\n\n"
    + V.claim_summary({name.split(":")[0]: v for name, v in loss_verdicts.items()})
)

# %% tags=["remove-input"]
stops = {w: depth_stops_paying(curve[w], LOSS_GAIN) for w in curve}


def after(w: str) -> str:
    deeper = curve[w][curve.index > stops[w]]
    if deeper.empty:
        return "it is the deepest count measured"
    best = curve.loc[stops[w], w] - deeper.min()
    if best > 0:
        return f"the best deeper count lowers the mean loss by {best:.2g} nats"
    return f"every deeper count raises the mean loss, by {-best:.2g} nats or more"


book.md(
    f"Where depth stops paying, by the smallest gain of {LOSS_GAIN:g} nats: "
    + "; ".join(f"on {w} at {stops[w]} loop{'s' * (stops[w] > 1)} ({after(w)})"
                for w in curve)
    + ". "
    + (f"On every workload that is before the R = {R} loops the model runs at, "
       "so the later chapters probe a model whose last loops buy less loss than "
       "that."
       if all(r < R for r in stops.values()) else
       f"On {', '.join(w for w in curve if stops[w] >= R)} depth still pays up to "
       f"R = {R}" + (f"; on {', '.join(w for w in curve if stops[w] < R)} it stops "
                     "before." if any(r < R for r in stops.values()) else "."))
)

# %% [markdown]
# ## Answers that need depth: chain programs
#
# A chain program binds a variable to a digit and each next one to the one before plus a
# digit, mod 10 (`a=3;b=a+4;c=b+1;`), then asks for the last one's value (`c?8;`). A
# query $d$ bindings away from its digit takes $d$ serial additions, with no
# intermediate steps written out, and short of all of them the answer is uniform over
# the ten digits: chance is 0.1 at every depth. A looped model should need more loops
# for deeper queries. Teacher-forced, the model
# reads each program and its queries, and we score whether its argmax after `x?` is
# $x$'s value, by loop count and by the depth of the query. The claims, on paired
# per-program accuracies: more loops answer more queries, overall and on the deep
# queries (the depth buckets beyond 8, as on the training page), by at least the
# accuracy gain of the training gate.

# %%
by_depth = hits.pivot_table(
    index="loops", columns="bucket", values="hit", aggfunc="mean"
)
by_depth = by_depth[[b for b in DEPTH_BUCKETS if b in by_depth]]
by_depth.columns = [f"depth {b}" for b in by_depth.columns]
by_depth.insert(0, "all", hits.groupby("loops")["hit"].mean())
queries = hits[hits["loops"] == R]["bucket"].value_counts()

fig, ax = plt.subplots(figsize=book.COLUMN)
for column in by_depth:
    ax.plot(
        by_depth.index,
        by_depth[column],
        marker="o",
        label=column,
        lw=2 if column == "all" else 1,
    )
ax.axvline(R, color="grey", ls=":", lw=1)
ax.set(
    xscale="log",
    xlabel="loops R",
    ylabel="answer accuracy",
    ylim=(-0.02, 1.02),
    title="Chain answers against depth",
)
ax.set_xticks(loops, [str(n) for n in loops])
ax.minorticks_off()
ax.legend()
plt.show()

DEEP_FROM = min(lo for lo, _ in DEPTH_BUCKETS.values() if lo > 8)
deep = hits["depth"] >= DEEP_FROM
chain_verdicts = {}
for name, selected in (("all queries", hits), (f"depth ≥ {DEEP_FROM}", hits[deep])):
    per_program = selected.pivot_table(
        index="program", columns="loops", values="hit", aggfunc="mean"
    )
    claim = V.Claim(
        f"more loops answer more chain queries ({name}): accuracy after "
        f"R = {R} > after {SHALLOW} loops",
        "Geiping et al. (2025)",
        "greater",
        minimum=ACCURACY_GATE.bound,
        minimum_source=f"the training gate '{ACCURACY_GATE.name}'",
    )
    chain_verdicts[f"chains: {name}, R = {R} vs {SHALLOW}"] = V.verdict(
        claim,
        per_program[R],
        per_program[SHALLOW],
        units="programs",
        discrimination=V.discrimination(
            V.varies(per_program.to_numpy(), f"answer accuracy ({name}) by loops"),
            V.below_ceiling(
                per_program[SHALLOW], 1.0, f"accuracy after {SHALLOW} loops"
            ),
        ),
    )
book.table(by_depth, digits=3)

# %% tags=["remove-input"]
book.md(
    f"{len(programs)} programs hold {int(queries.sum())} queries: "
    + ", ".join(f"{int(queries.get(b, 0))} of depth {b}" for b in DEPTH_BUCKETS)
    + f". After {SHALLOW} loops the model answers {by_depth.loc[SHALLOW, 'all']:.0%} "
      "of "
    f"them, after {R} loops {by_depth.loc[R, 'all']:.0%}. "
    + "\n\n"
    + V.claim_summary({name.split(": ")[1]: v for name, v in chain_verdicts.items()})
)

# %% [markdown]
# ## Greedy generations
#
# Greedy full-depth decoding is the baseline of every later chapter. Each workload's
# prompts are decoded as one batch with the full cache; a row stops at end-of-text or
# after its token budget. With the full cache every token must be the argmax of a
# cache-free forward over the growing sequence (in bfloat16 on a GPU, up to near-ties
# that the two computations round differently, which `book.check_greedy_tokens` counts).
# The deepest-plane cache is a different model of the prefix, and its text may differ. A
# few samples show what the model writes (after the `|`).

# %%
prompts = {
    w: workloads.prompt_ids(model, run, w, profile.prompts_per_workload)
    for w in data.WORKLOADS
}
runs = {
    w: looped_kv.generate(
        model, p, max_new_tokens=profile.new_tokens, rows_per_chunk=CHUNK
    )
    for w, p in prompts.items()
}
deepest_runs = {
    w: looped_kv.generate(
        model, p, max_new_tokens=profile.new_tokens, cache="deepest",
        rows_per_chunk=CHUNK,
    )
    for w, p in prompts.items()
}
near_ties = 0
for run in runs.values():
    with torch.no_grad():
        no_cache = model(run.tokens[:, :-1], num_loops=R)
    for row, (seq, p) in enumerate(zip(run.sequences, run.prompt_lengths, strict=True)):
        near_ties += book.check_greedy_tokens(
            no_cache[row, p - 1 : len(seq) - 1], seq[p:]
        )
for w, run in runs.items():
    for row in range(2):  # two samples per workload
        text = book.decode(model, run.sequences[row][: run.prompt_lengths[row]])
        print(f"--- {w} ---\n{text}|{book.decode(model, run.new_rows[row])}\n")

# %% tags=["remove-input"]
same_rows = {
    w: sum(
        torch.equal(a, b)
        for a, b in zip(runs[w].sequences, deepest_runs[w].sequences, strict=True)
    )
    for w in runs
}
stopped = {w: run.stopped.count("eos") for w, run in runs.items()}
ratio = {
    w: deepest_runs[w].cache_bytes / runs[w].cache_bytes
    for w in runs
}
book.md(
    f"Every generated token of the {sum(r.batch for r in runs.values())} rows is the "
    "argmax of the cache-free forward"
    + (f", up to {near_ties} near-tie flips. " if near_ties else ". ")
    + " ".join(
        f"On {w}, {stopped[w]} of {runs[w].batch} rows end with end-of-text, and "
        f"the deepest-plane cache emits the same text as the full cache in "
        f"{same_rows[w]} rows while holding {ratio[w]:.1%} of its bytes."
        for w in runs
    )
)

# %% [markdown]
# ## How much of its depth does a token need?
#
# A $d$-loop draft reads the cached prefix of the full-depth trajectory and predicts the
# next token; along each greedy generation above we count how often it agrees with the
# full-depth token, at the draft depths of DAS Table 6 (aligned prefix reads: loop $r$
# of the draft reads plane $r$). The paper's claim: agreement rises with draft depth, so
# a one-loop draft agrees less often than an eight-loop one (the paper prints no
# smallest gain; the book's for a share is five points). A draft that already agrees
# almost always at one loop cannot show it.

# %%
depths = profile.draft_depths  # DAS Table 6's, each below this model's R
agreement = {w: draft_agreement_rows(model, run, depths) for w, run in runs.items()}
shallow_d, deep_d = min(depths), max(depths)
draft_claim = V.Claim(
    f"a {shallow_d}-loop draft agrees with the full-depth token less often "
    f"than a {deep_d}-loop draft",
    "DAS Table 6",
    "less",
    minimum=V.BOOK_MINIMUM["share"],
    minimum_source="the book's smallest effect for a share",
)
draft_verdicts = {}
for w, table in agreement.items():
    table = table[table["n"] > 0]
    one, eight = table[(shallow_d, "aligned")], table[(deep_d, "aligned")]
    draft_verdicts[f"{w}: agreement, d = {shallow_d} vs {deep_d}"] = V.verdict(
        draft_claim,
        one,
        eight,
        discrimination=V.discrimination(
            V.below_ceiling(one, 1.0, f"{shallow_d}-loop agreement"),
        ),
    )
pooled = {
    w: pd.Series(
        [(t[(d, "aligned")] * t["n"]).sum() / t["n"].sum() for d in depths], depths
    )
    for w, t in agreement.items()
}
paper6 = {
    f"{m} (DAS)": pd.Series(papers.DAS_TABLE_6[m]["Aligned"], papers.DAS_TABLE_6_DEPTHS)
    for m in public
}
ours = {f"this model, {w}": v for w, v in pooled.items()}
agree_table = pd.DataFrame({**ours, **paper6})  # depths of either, a dash where none
agree_table = agree_table.rename(index=lambda d: f"d = {d}").T
book.table(agree_table, percent=tuple(agree_table.columns))

# %% tags=["remove-input"]
book.md(
    "The table gives the share of drafted positions where the draft agrees, pooled "
    "over "
    "each workload's rows, beside DAS Table 6's aligned row for the public models. "
    + "\n\n"
    + V.claim_summary({name.split(":")[0]: v for name, v in draft_verdicts.items()})
)

# %% [markdown]
# ## Where an exit gate would stop (Ouro)
#
# Ouro's checkpoints carry an exit gate. After each loop $u$ a linear map of the loop's
# normed state gives $\lambda_u = \sigma(g_u)$, and the exit distribution over loops is
# $p_u = \lambda_u \prod_{v<u} (1 - \lambda_v)$, the last loop taking the remaining
# mass (`looped_kv.runtime.exit_gate`, formed as the reference forms it). The
# reference's plain forward reads each token out at the first loop whose cumulative
# exit probability reaches the checkpoint's threshold, 1.0. In exact arithmetic that is
# the last loop; in float32, float16 or bfloat16 the sum can round up to 1 earlier, and
# the token is then read out of a shallower loop. The runtime and every decoder in this
# book read the last loop they run. Huginn, the Raven retrofits and the tiny model have
# no gate. On a model with one, the table gives the mean exit probability of each loop
# over the tokens of the held-out texts above, and the share of tokens a threshold of
# 0.5 or 0.9 would read out at each loop.

# %%
gated = exit_gate.has_exit_gate(model)
if gated:
    rows = [
        ids_w[i : i + 1, : int(real[i].sum())].to(model.device)
        for ids_w, real in texts.values()
        for i in range(len(ids_w))
    ]
    exits = exit_gate.exit_distribution(model, rows)  # (tokens, R), float64
    steps = exit_gate.threshold_steps(model, rows)  # at the checkpoint's threshold
    early_share = float((steps < R - 1).double().mean())
    exit_table = exit_gate.exit_summary(exits)
book.table(exit_table, percent=tuple(exit_table.columns)) if gated else None

# %% tags=["remove-input"]
book.md(
    f"Over {len(exits)} tokens the gate puts most exit probability on loop "
    f"{int(exit_table['mean exit probability'].idxmax())} of {R}. At the checkpoint's "
    f"threshold {cfg.exit_threshold:g}, computed in "
    f"{str(model.dtype).removeprefix('torch.')} as the reference computes it, "
    f"{early_share:.1%} of the tokens would be read out before loop {R}: the share "
    "that a plain forward of the reference reads from a shallower loop than this "
    "book's decoders do."
    if gated
    else f"The model at hand ({model.source}, family {cfg.family}) has no exit gate, "
    "so it has no exit distribution."
)

# %% [markdown]
# ## On a shallow recurrence
#
# The loss and answer curves sample loop counts on both sides of $R$, and the chain
# answers set a shallow loop count against $R$. On a shallow recurrence (Parcae's, or
# Ouro's) the grid keeps about as many points, packed into fewer loops, and the shallow
# side is a larger share of $R$. The chapter can still show whether more loops lower the
# loss and raise the answers; it cannot show where, within a long recurrence, depth
# stops paying, and an answer that needs only a few more loops than the shallow side
# needs most of a shallow $R$.
#
# The depth settings of this chapter at the tiny model's $R$, Parcae's and Ouro's
# (`looped_kv.analysis.shallow`): the loops each names, and how many.

# %%
from looped_kv.analysis.shallow import depth_table

book.table(depth_table("ch01"), caption="loops (how many)")

# %% [markdown]
# ## What the tiny model is, and is not
#
# The shipped model was trained on a 2-core CPU with Huginn's recipe
# (`looped_kv/tiny/train.py`): a recurrence count per step drawn from a
# Poisson-lognormal and truncated backpropagation through the last loops, on chain
# programs under a depth curriculum, joined by the word problems and code once the
# curriculum reached deep chains (`looped_kv.workloads.data`; the training page has the
# scouting runs that chose this). The next chapters measure on it the phenomena the
# papers report (planes that ripen with depth, deep loops that matter more, drafts that
# agree with the target) and give for each a verdict against the smallest effect that
# counts for the claim: agrees with the paper, disagrees, no effect of that size,
# identical arms, or inconclusive on this model, with the reason. It is far too small to
# match the papers' magnitudes: every chapter prints the papers' numbers beside the tiny
# model's. This chapter's verdicts:

# %%
chapter_verdicts = loss_verdicts | chain_verdicts | draft_verdicts
who = "the tiny model" if book.is_tiny(model) else model.source
display(book.table(V.interval_table(chapter_verdicts)))
book.md(V.tally(chapter_verdicts, who, "the papers"))

# %%
training = cfg.raw.get("training", {})
recipe = training.get("args", {})
fields = ("batch", "seq", "mean_recurrence", "backprop", "chains", "mix",
          "mix_from_depth")
log_file = looped_kv.runtime.loading.TINY_DIR / "training_log.json"
fastest = steps = None
if book.is_tiny(model) and log_file.exists():
    log = pd.read_json(log_file)
    log = log[log["step"].notna() & log["time_s"].notna()]
    steps = int(log["step"].max())
    seconds_per_step = (log["time_s"].diff() / log["step"].diff()).dropna()
    fastest = seconds_per_step[seconds_per_step > 0].min()
summary = pd.Series(
    {"parameters": training.get("parameters"), "steps": steps,
     **{k: str(recipe[k]) for k in fields if k in recipe},
     "minutes": training.get("minutes")},
    name="training", dtype=object,
).dropna()
book.table(summary.to_frame())

# %% tags=["remove-input"]
book.md(
    ""
    if fastest is None
    else f"Training took {training['minutes']:.0f} minutes of wall time over {steps:,} "
    "steps, on cores that other work shared part of the time; its fastest stretch ran "
    f"at {fastest:.2f} s per step, which is {fastest * steps / 60:.0f} minutes for "
    "all of them on idle cores."
)
