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
# # 5. Shallow queries, mature values
#
# A self-speculative draft runs $d \ll R$ loops. At loop $r$ it usually reads the
# verified prefix's keys and values of the *same* loop $r$: its computation depth and
# the depth of what it reads are coupled. The DAS paper decouples them. A draft at loop
# $r$ reads prefix keys at depth $\kappa$ and values at depth $\nu$ (DAS Eq. 2-3):
#
# $$ \begin{gathered} [\Pi_C, \Pi_U] = \operatorname{softmax}\big(Q^{\text{cur}}
#    [K_C^{\kappa}; K_U^{\text{cur}}]^\top / \sqrt{d_h} + M\big), \\
#    O = \Pi_C V_C^{\nu} + \Pi_U V_U^{\text{cur}}. \end{gathered} $$
#
# There are four read policies (Eq. 4): *aligned* $(r, r)$, *deep V* or Mature-V $(r,
# R)$, *deep K* $(R, r)$ and *deep K/V* $(R, R)$. Mature-Spec is sequential
# self-speculation with deep K/V reads. The prefix's full-depth planes already exist
# because verification computed them, so mature reads cost no extra loops.
#
# This chapter tests four claims on the model at hand, each with a paired verdict
# against the smallest effect that counts for it (the DAS paper prints none, so the
# book's own, which each verdict states): mature values raise a one-loop draft's
# agreement over aligned reads, and help it more than mature keys (DAS Sec. 3.1, Table
# 6), and Mature-Spec beats self-speculation both in accepted drafts (DAS Sec. 4.3,
# Table 2) and in speed (DAS Sec. 4.2, Table 1). Along the way it draws the read-depth
# grid (DAS Figure 4), checks that acceptance is flat along the block as Eq. (7) of the
# RIPE paper assumes (RIPE Sec. 3.3), and fits the cost model of Eq. (8) (RIPE Sec.
# 3.4).

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab: install, then choose what fits the GPU
    PACKAGE = "looped-kv[book,papers] @ git+https://github.com/looped-kv/looped-kv"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", PACKAGE], check=True)
    from looped_kv import book

    book.colab_setup("ch05")

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from IPython.display import display

from looped_kv import book, papers, profiles, workloads
from looped_kv.analysis import claims, measure, perf
from looped_kv.analysis.verdicts import (
    CEILING_MARGIN,
    MIN_UNITS,
    claim_summary,
    interval_table,
    tally,
)
from looped_kv.experiments import bench
from looped_kv.workloads import data

book.setup()
model = book.chapter_model()
profile = profiles.for_model(model)
P = profile.ch05
cfg, R = model.config, model.config.mean_recurrence
print(book.environment(model))
print(workloads.preflight(model, profile))  # every prompt tokenized, held to the bound

# %% [markdown]
# ## Which prefix channel helps a shallow draft? (DAS Table 6)
#
# The probe decodes each workload's prompts greedily at full depth, all of them as one
# batch. At every generated position the cache holds the target's planes of the prefix.
# A $d$-loop draft of the next token reads them under each of the four policies, and we
# count how often its argmax is the target's token. Draft-side keys and values always
# come from the draft's own computation. Every prompt gets its own agreement, so the
# policies can be compared prompt by prompt.

# %%
READS = ("aligned", "deep-v", "deep-k", "deep-kv")
LABELS = dict(zip(READS, ("Aligned", "Deep V", "Deep K", "Deep K/V"), strict=True))
DEPTHS = list(P.draft_depths)  # DAS Table 6's d = 1, 2, 4, 8, each below R
eval_prompts = {w: workloads.prompt_ids(model, profile, w, P.agreement_prompts)
                for w in data.WORKLOADS}
agreement = {w: measure.agreement_by_prompt(model, prompts, P.agreement_tokens, DEPTHS,
                                            READS,
                                            rows_per_chunk=profile.rows_per_chunk)
             for w, prompts in eval_prompts.items()}
means = {w: frame.groupby(["read", "d"], sort=False)["agreement"].mean().unstack()
         for w, frame in agreement.items()}
paper = {m: pd.DataFrame(papers.DAS_TABLE_6[m], index=papers.DAS_TABLE_6_DEPTHS)
         [list(LABELS.values())].T for m in (papers.HUGINN, papers.RAVEN_LLAMA)}
table6 = pd.concat({**{w: m.rename(index=LABELS) for w, m in means.items()},
                    **{f"{m} (paper)": t for m, t in paper.items()}})
table6.columns = [f"d = {d}" for d in table6.columns]  # either depths; NaN: none
book.table(table6, caption="Draft-target agreement: mean over prompts (this model) and "
                           "DAS Table 6 (the paper)")

# %% tags=["remove-input"]
mature_v = {w: measure.channel_verdict(frame, a="deep-v", b="aligned",
                                       claim=claims.MATURE_V_OVER_ALIGNED)
            for w, frame in agreement.items()}
channel = {w: measure.channel_verdict(frame) for w, frame in agreement.items()}
over = {w: means[w].loc["deep-v", 1] - means[w].loc["aligned", 1] for w in means}
gain = {w: means[w].loc["deep-v", 1] - means[w].loc["deep-k", 1] for w in means}
huginn = papers.DAS_TABLE_6[papers.HUGINN]
book.md(
    f"On Huginn the paper's one-loop drafts agree {huginn['Aligned'][0]:.1%} of the "
    f"time with aligned reads, {huginn['Deep V'][0]:.1%} with mature values and "
    f"{huginn['Deep K'][0]:.1%} with mature keys. Here, with "
    f"{P.agreement_prompts} prompts per workload, Mature-V minus aligned at $d = 1$ is "
    + ", ".join(f"{over[w]:+.1%} on {w}" for w in data.WORKLOADS)
    + ", and deep V minus deep K "
    + ", ".join(f"{gain[w]:+.1%} on {w}" for w in data.WORKLOADS)
    + ". The verdicts on each workload:\n\n"
    + claim_summary(mature_v) + "\n\n" + claim_summary(channel))

# %% [markdown]
# ## The read-depth grid (DAS Figure 4)
#
# With the draft fixed at two loops, the prefix's key depth $\kappa$ and value depth
# $\nu$ vary independently. The corners $(2, 2)$, $(2, R)$, $(R, 2)$ and $(R, R)$ are
# the four policies above. As in the paper, the grid uses a separate, smaller cohort of
# prompts (development word problems). It is descriptive: the paired verdict on keys
# against values is the one above, on more prompts.

# %%
planes = list(measure.read_depth_grid(R))
grid_prompts = workloads.prompt_ids(model, profile, "problems", P.grid_prompts, "dev")
pairs = [(kappa, nu) for kappa in planes for nu in planes]
grid = measure.agreement_by_prompt(model, grid_prompts, P.grid_tokens, [2], pairs)
drafted = grid[grid["positions"] > 0]
cells = drafted.groupby("read")["agreement"].mean()
read_grid = pd.DataFrame([[cells[(kappa, nu)] for nu in planes] for kappa in planes],
                         index=pd.Index(planes, name="key depth κ"),
                         columns=pd.Index(planes, name="value depth ν"))
fig, ax = plt.subplots(figsize=book.SQUARE)
sns.heatmap(read_grid, annot=True, fmt=".2f", cmap="viridis", ax=ax,
            annot_kws={"size": 8}, cbar_kws={"label": "agreement"})
ax.set_title(f"Draft at r = 2: agreement by prefix read depth\n"
             f"({drafted['prompt'].nunique()} prompts)")
plt.show()

# %% tags=["remove-input"]
v_axis = (read_grid.max(axis=1) - read_grid.min(axis=1)).mean()
k_axis = (read_grid.max(axis=0) - read_grid.min(axis=0)).mean()
book.md(
    f"Along the value axis (one row, $\\nu$ varying) agreement spans {v_axis:.3f} on "
    f"average; along the key axis (one column, $\\kappa$ varying) it spans "
    f"{k_axis:.3f}. "
    "The paper reads the stronger variation along the value axis of its Figure 4 as "
    f"support for the V-centric design. On these {drafted['prompt'].nunique()} prompts "
    "the two spans are a description, not a test.")

# %% [markdown]
# ## Acceptance along the block (RIPE Sec. 3.3, Eq. 7)
#
# Eq. (7) of the RIPE paper assumes that a draft is accepted with the same probability
# $\alpha$ wherever it stands in the block; the tokens per verification are then
# $\tau(\alpha, \gamma) = (1 - \alpha^{\gamma+1}) / (1 - \alpha)$. Self-speculation and
# Mature-Spec decode each workload's prompts as one batch, with the same draft depth $d$
# and block $\gamma$, so that they differ only in their prefix reads. For every draft
# position we record the acceptance given that the earlier drafts were accepted.

# %%
d, gamma = P.draft_loops, P.gamma
methods = {name: c for name, c in bench.method_configs(d, gamma).items()
           if name in ("ar", "self-spec", "mature-spec")}
acceptance = {w: bench.acceptance_runs(model, prompts[:P.acceptance_prompts], methods,
                                       P.acceptance_tokens,
                                       rows_per_chunk=profile.rows_per_chunk)
              for w, prompts in eval_prompts.items()}
along = {(w, bench.label(m)): perf.block_acceptance(
             [a for row in runs[runs["method"] == m]["accepted"] for a in row], gamma)
         for w, runs in acceptance.items() for m in ("self-spec", "mature-spec")}
flatness = pd.DataFrame({key: {**{f"pos {i + 1}": r for i, r in enumerate(b.rates)},
                               "spread": b.spread, "α": b.alpha,
                               "τ (Eq. 7)": b.tau_model, "τ measured": b.tau_measured,
                               "error": b.error, "blocks": b.blocks}
                         for key, b in along.items()}).T
fig, ax = plt.subplots(figsize=book.COLUMN)
for (w, name), b in along.items():
    ax.plot(range(1, gamma + 1), b.rates, marker="o", label=f"{w}, {name}",
            ls="-" if name == "Mature-Spec" else "--",
            color=f"C{data.WORKLOADS.index(w)}")
ax.set(xlabel="draft position in the block", ylabel="P(accept | earlier accepted)",
       xticks=range(1, gamma + 1), ylim=(0, 1.05),
       title=f"Acceptance along the block (d = {d}, γ = {gamma})")
ax.legend(ncol=2)
plt.show()
book.table(flatness, percent=("error",))

# %% tags=["remove-input"]
SEC_3_3 = papers.RIPE_SEC_3_3_ACCEPTANCE  # RIPE Sec. 3.3, the batch-3 simulation
rooms = {(w, bench.label(m)): bench.room(runs, m)
         for w, runs in acceptance.items() for m in ("self-spec", "mature-spec")}
full = [f"{name} on {w}" for (w, name), check in rooms.items() if not check.passed]
saturated = ("every decoder on every workload" if len(full) == len(rooms)
             else "; ".join(full))
book.md(
    "Across workloads and read policies the acceptance varies along the block by at "
    f"most {flatness['spread'].max():.2f} (the paper, on Huginn with $\\gamma$ = "
    f"{SEC_3_3['gamma']}: at most {SEC_3_3['largest spread']['full']} with the full "
    f"cache and {SEC_3_3['largest spread']['deepest']} with the deepest plane). "
    "Eq. (7) "
    "at the mean acceptance predicts the measured $\\tau$ within "
    f"{flatness['error'].abs().max():.1%} (the paper: "
    f"{SEC_3_3['largest tau error']:.1%}). "
    + (f"For {saturated}, $\\tau$ lies within {CEILING_MARGIN:.0%} of its "
       f"ceiling $\\gamma + 1 = {gamma + 1}$: when nearly every draft is accepted, "
       "acceptance is flat and Eq. (7) exact whatever the model, so those rows test "
       "nothing."
       if full else
       f"Every $\\tau$ stays more than {CEILING_MARGIN:.0%} below its ceiling "
       f"$\\gamma + 1 = {gamma + 1}$, so flatness is a property of the model, not of "
       "saturation."))

# %% [markdown]
# ## Mature-Spec against self-speculation (DAS Tables 1 and 2)
#
# Greedy decoding, self-speculation and Mature-Spec decode a few prompts of each
# workload alone (batch 1), in the same process. Each accelerated run is paired with its
# own greedy run, and the speed-up is DAS Eq. (8): the mean over prompts of the
# per-prompt throughput ratio, prefill included, with a paired bootstrap interval. The
# acceptance columns ($A$, the accepted drafts per verification, DAS Eq. 9; $\tau$ and
# its fraction of the ceiling $\gamma + 1$) come from the batched runs above. Both
# claims get a paired verdict: the per-prompt $A$ of the two decoders on the batched
# prompts, and the per-prompt speed-ups on the timed prompts. A speed verdict needs
# more timed prompts, each timed in interleaved repeats, than an acceptance verdict
# needs decoded ones (`verdicts.MIN_UNITS`); a profile that times fewer gets "too few
# units", whatever the ratios.

# %%
timing = {w: bench.run_paired(model, prompts[:P.timing_prompts], methods, P.new_tokens,
                              progress=False, repeats=P.timing_repeats)
          for w, prompts in eval_prompts.items()}
summary = pd.concat({w: bench.summarize(timing[w], acceptance[w])
                     for w in data.WORKLOADS})
book.table(summary.drop(columns=["G"]), digits=3, percent=("of ceiling",))

# %%
if model.dtype == torch.float64:  # exact arithmetic: every run is greedy decoding
    assert all(runs["same_as_greedy"].all() for runs in timing.values())
mature = {w: bench.mature_spec_verdicts(timing[w], acceptance[w])
          for w in data.WORKLOADS}

# %% tags=["remove-input"]
TABLE1 = papers.DAS_TABLE_1[papers.HUGINN]  # DAS Table 1, Huginn rows: (speed-up, A)
book.md(
    "On Huginn/GSM8K the paper measured "
    f"{TABLE1['Self-speculative']['GSM8K'][0]:.2f}x for self-speculation and "
    f"{TABLE1['Mature-Spec']['GSM8K'][0]:.2f}x for Mature-Spec, each at its own "
    f"selected configuration (DAS Table 1). Here both run at $d = {d}$, "
    f"$\\gamma = {gamma}$, on {P.timing_prompts} timed prompts per workload, "
    f"{P.timing_repeats} {'round' if P.timing_repeats == 1 else 'rounds'} each "
    "(a speed verdict needs "
    f"{MIN_UNITS['timing']} prompts in repeated rounds), and the verdicts are:\n\n"
    + claim_summary({w: v["acceptance"] for w, v in mature.items()}) + "\n\n"
    + claim_summary({w: v["speed"] for w, v in mature.items()}))

# %% [markdown]
# ## The cost model (RIPE Eq. 8, Sec. 3.4)
#
# At batch 1 a forward is assumed to cost about as much as the layer passes it runs,
# $c(d) = n_\text{pre} + d\, n_\text{core} + n_\text{coda}$, whatever the number of
# tokens it carries. A block then costs $\gamma c(d) + c(R)$, scaled by one overhead
# factor $\eta$, and the speed-up is
#
# $$ S(d, \gamma) = \frac{\tau(\alpha_d, \gamma)\, c(R)}{\eta\,(\gamma c(d) + c(R))}. $$
#
# We fit $\eta$ to each decoder's per-prompt timings (all workloads), then draw Eq. (8)
# over $\gamma$ with the acceptance $\alpha$ of the batched runs. The markers are the
# measured mean speed-ups.

# %%
gammas = np.arange(1, 17)
fits, pooled = {}, pd.concat(timing.values())
fig, ax = plt.subplots(figsize=book.COLUMN)
for name, marker in (("self-spec", "s"), ("mature-spec", "o")):
    rows = pooled[pooled["method"] == name]
    fits[name] = perf.fit_eta(rows["speed-up"], rows["tau"], d, gamma, cfg, num_loops=R)
    blocks = [a for runs in acceptance.values()
              for row in runs[runs["method"] == name]["accepted"] for a in row]
    alpha = perf.block_acceptance(blocks, gamma).alpha
    curve = perf.speedup(perf.acceptance_tau(alpha, gammas), d, gammas, cfg,
                         eta=fits[name].eta, num_loops=R)
    (line,) = ax.plot(gammas, curve, label=f"{bench.label(name)}: α = {alpha:.2f}, "
                                           f"η = {fits[name].eta:.2f}")
    ax.plot([gamma], [rows["speed-up"].mean()], marker=marker, ms=8, ls="none",
            color=line.get_color())
ax.axhline(1, color="grey", lw=0.8, ls=":")
ax.set(xlabel="draft tokens per block γ", ylabel="speed-up over greedy",
       title=f"Eq. (8) with fitted η (d = {d})")
ax.legend()
plt.show()
eta_table = pd.DataFrame({bench.label(n): {"η": f.eta,
                                           "prompts": len(f.relative_errors),
                                           "largest error": f.max_relative_error}
                          for n, f in fits.items()}).T
book.table(eta_table, percent=("largest error",))

# %% tags=["remove-input"]
SEC_3_4 = papers.RIPE_SEC_3_4_SPEEDUP  # RIPE Sec. 3.4: Eq. (8) fitted on Huginn
book.md(
    "One overhead factor per decoder reproduces its per-prompt speed-ups within "
    + " and ".join(f"{f.max_relative_error:.1%} ({bench.label(n)}, η = {f.eta:.2f})"
                   for n, f in fits.items())
    + f". The paper fitted η = {SEC_3_4['eta']} to 24 per-problem timings on Huginn, "
    f"with errors up to {SEC_3_4['largest per-problem error']:.1%}. The model's "
    "premise, a cost proportional to layer passes whatever the tokens per forward, "
    "describes a GPU at batch 1; an η far from 1 says how far this machine is from it.")

# %% [markdown]
# ## Verdicts
#
# Every claim of the chapter, with its paired estimate (a difference of agreements or
# accepted drafts, or a ratio of speed-ups), its 95% BCa bootstrap interval over
# prompts, its n, the smallest effect that counts, and the reason for its label.

# %%
verdicts = {**{f"{w}: Mature-V vs aligned": v for w, v in mature_v.items()},
            **{f"{w}: deep V vs deep K": v for w, v in channel.items()},
            **{f"{w}: Mature-Spec {claim}": v for w, vs in mature.items()
               for claim, v in vs.items()}}
display(book.table(interval_table(verdicts)))
book.md(tally(verdicts, "the tiny model" if book.is_tiny(model) else model.source,
              "the paper"))
