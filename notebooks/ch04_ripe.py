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
# # 4. RIPE: ripe plane for the past, full depth for the present
#
# The deepest-plane cache keeps plane $R$ of every position and nothing else: $n_\text{core}$ core layers
# per token instead of $R\,n_\text{core}$ (Chapter 1). It has two defects. It is not lossless: on
# Huginn-0125 a few generated positions move far from the full cache (the *tail* of RIPE Section 5.1).
# And it breaks batched verification: a block of drafts verified in one pass cannot read plane $R$ of
# its own earlier tokens, which does not exist yet, so its targets depend on where the blocks start.
#
# **RIPE** (Recent-window Intact, deepest Plane Elsewhere) keeps the deepest plane for old positions and
# every plane for the $W$ most recent ones (RIPE Eq. 9-10):
#
# $$ \pi_\text{RIPE}(r, t, j) = \begin{cases} r, & t - j \le W \\ R, & t - j > W \end{cases}, \qquad
#    M_\text{RIPE}(L) = M_\text{deep}(L) + b\, n_\text{core} (R - 1) \min(W, L). $$
#
# This chapter draws the policy, prices it against the paper's Table 2, demonstrates Proposition 1
# (with $W \ge \gamma$ batched verification is exactly sequential decoding) and runs Algorithm 1. It then
# repeats the paper's generation measurements on the model at hand: the windows against the tail (Table 4,
# Figure 4), the fidelity label of Section 5.1 and the block dependence of Section 5.2.

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab only: install the package
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "looped-kv[book] @ git+https://github.com/looped-kv/looped-kv"], check=True)

# %%
import itertools
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

import looped_kv
from looped_kv import book, data, papers
from looped_kv.analysis.fits import EXCEEDS, fidelity_label, paired_bootstrap_ratio, per_prompt_bin_means
from looped_kv.analysis.measure import policy_logits, target_trajectories
from looped_kv.analysis.ripe import (
    EXCEEDS_NUMERICS,
    batched_vs_sequential,
    block_dependence_ratio,
    extra_over_deepest,
    read_map,
    replay_records,
    scale_windows,
    survival,
    tail_counts_by_prompt,
    tail_summary,
    with_dtype,
)
from looped_kv.decoding.core import new_cache, prefill
from looped_kv.runtime.memory import m_ripe, memory_table
from looped_kv.runtime.policy import make_policy

start = time.perf_counter()
model = book.chapter_model()  # $LOOPED_KV_MODEL, default "tiny"; CUDA when available
cfg, R = model.config, model.config.mean_recurrence
# Sizes: a CPU run of a few minutes; the same code serves a real checkpoint on a GPU.
GAMMA, DRAFT_LOOPS = 4, 4  # block length and draft depth (the paper's d = gamma = 4)
N_PROMPTS, NEW_TOKENS, BIN = 8, 24, 8  # replayed prompts, generated tokens per prompt, bin of generated positions
SETUP4 = papers.RIPE_TABLE_4_SETUP  # Table 4's windows, sinks and tail threshold
PAPER_WINDOWS, SINKS, TAIL = SETUP4["windows"], SETUP4["sinks"], SETUP4["tail KL"]
SEC5_1, SEC5_2 = papers.RIPE_SEC_5_1, papers.RIPE_SEC_5_2  # RIPE Sections 5.1 and 5.2
model16 = with_dtype(model, torch.bfloat16)  # the reference L0 and every cache arm run in bf16
model32 = with_dtype(model16, torch.float32)  # the precision floor: the same weights in fp32
model64 = with_dtype(model, torch.float64)  # exact-arithmetic checks
full, deepest = make_policy("full", R), make_policy("deepest", R)
print(f"model: {model.source}  device: {model.device}  R = {R}  gamma = {GAMMA}  d = {DRAFT_LOOPS}")

# %% [markdown]
# ## The policy, drawn
#
# A cache policy $\pi(r, t, j)$ names the plane of prefix position $j$ that token $t$ reads at loop $r$.
# Each panel shows, for one query $t$, the plane every (loop, prefix position) pair reads. The full cache
# reads plane $r$ at loop $r$ everywhere; the deepest-plane cache reads plane $R$ everywhere; RIPE reads
# plane $r$ in the window and plane $R$ elsewhere. Keeping a few full-depth *sinks* at the start
# (Xiao et al., 2023) is the alternative the paper tested against the window.

# %%
T_DRAW, W_DRAW = 40, 8
drawn = {"full cache": full, "deepest plane": deepest, f"RIPE, W = {W_DRAW}": make_policy("ripe", R, window=W_DRAW),
         f"{SINKS} sinks + deepest plane": make_policy("sinks", R, sinks=SINKS)}
fig, axes = plt.subplots(1, len(drawn), figsize=(13, 3.4), sharey=True, layout="constrained")
for ax, (name, policy) in zip(axes, drawn.items(), strict=True):
    image = ax.imshow(read_map(policy, T_DRAW), origin="lower", aspect="auto", cmap="viridis", vmin=1, vmax=R,
                      extent=(-0.5, T_DRAW - 0.5, 0.5, R + 0.5))
    ax.set(title=name, xlabel=f"prefix position j (query t = {T_DRAW})")
axes[0].set_ylabel("loop r")
fig.colorbar(image, ax=axes, label="plane read, π(r, t, j)")
plt.show()

ripe_map = read_map(drawn[f"RIPE, W = {W_DRAW}"], T_DRAW)
assert (ripe_map[:, T_DRAW - W_DRAW:] == np.arange(1, R + 1)[:, None]).all()  # the window: own plane r
assert (ripe_map[:, :T_DRAW - W_DRAW] == R).all()  # older positions: plane R
shallow_reads = int((ripe_map < R).sum())
Markdown(f"For the query at t = {T_DRAW}, RIPE with W = {W_DRAW} reads the loop's own plane at positions "
         f"{T_DRAW - W_DRAW} to {T_DRAW - 1} and plane {R} at the {T_DRAW - W_DRAW} older ones. Only "
         f"{shallow_reads} of the {ripe_map.size} (loop, position) reads ({shallow_reads / ripe_map.size:.1%}) "
         f"need a plane other than {R}, and those planes are needed only while a position is in the window.")

# %% [markdown]
# ## What the window costs: Eq. (10) beside Table 2
#
# The memory of a policy follows from the config alone. The table gives the package's values for the two
# public families at $L = 1024$ in bf16 beside the paper's Table 2, and the same rows for the model at
# hand (in KB). A real cache allocated under RIPE holds exactly Eq. (10)'s bytes.

# %%
configs = {"Huginn-0125": looped_kv.huginn_0125(), "Raven-Llama": looped_kv.raven_llama(), "this model": cfg}
computed = pd.DataFrame(memory_table(configs, length=1024, num_loops=R)).set_index("cache")
paper2 = pd.DataFrame(papers.RIPE_TABLE_2,  # RIPE Table 2 (L = 1024, bf16)
                      index=list(papers.RIPE_TABLE_2_COLUMNS)).T
if R == 32:  # the paper's R: the equations reproduce Table 2 to its printed precision
    for family in ("Huginn-0125", "Raven-Llama"):
        assert (computed[f"{family} MB"].round() == paper2[f"{family} MB"]).all()
        assert ((100 * computed[f"{family} frac."]).round(1) == (100 * paper2[f"{family} frac."]).round(1)).all()
table2 = pd.concat({
    family: pd.DataFrame({"MB": computed[f"{family} MB"], "paper MB": paper2[f"{family} MB"],
                          "frac.": computed[f"{family} frac."], "paper frac.": paper2[f"{family} frac."]})
    for family in ("Huginn-0125", "Raven-Llama")} | {
    "this model": pd.DataFrame({"KB": 1e3 * computed["this model MB"], "frac.": computed["this model frac."]})},
    axis=1)

probe = book.encode(model, data.prompts("problems", 1)[0])
for window in (GAMMA, 16):  # allocated and stored bytes of a real RIPE cache equal Eq. (10)
    cache = new_cache(model, make_policy("ripe", R, window=window), 1, probe.shape[1])
    with torch.no_grad():
        prefill(model, cache, probe, R)
    assert cache.nbytes == cache.allocated_bytes == m_ripe(cfg, probe.shape[1], window, R, model.dtype)
table2.style.format("{:,.0f}", subset=[c for c in table2.columns if "MB" in c[1]]).format(
    "{:.1%}", subset=[c for c in table2.columns if "frac." in c[1]]).format("{:,.1f}", subset=[("this model", "KB")])

# %%
huginn, raven, tiny = (computed[f"{name} MB"] for name in configs)
Markdown(f"At L = 1024, W = 64 costs {huginn['RIPE, W = 64']:,.0f} MB on Huginn-0125 "
         f"({computed.loc['RIPE, W = 64', 'Huginn-0125 frac.']:.1%} of {huginn['full']:,.0f} MB) and "
         f"{raven['RIPE, W = 64']:,.0f} MB on Raven-Llama ({computed.loc['RIPE, W = 64', 'Raven-Llama frac.']:.1%}), "
         f"{huginn['RIPE, W = 64'] - huginn['deepest plane']:,.0f} MB per Huginn sequence over the deepest plane. "
         f"The window's cost is fixed once L exceeds W, so its fraction shrinks as contexts grow. On this model "
         f"W = 64 holds {computed.loc['RIPE, W = 64', 'this model frac.']:.1%} of the full cache against "
         f"{computed.loc['deepest plane', 'this model frac.']:.1%} for the deepest plane.")

# %% [markdown]
# ## Proposition 1: with $W \ge \gamma$, batched verification is sequential decoding
#
# $\pi_\text{RIPE}$ depends only on $r$ and $t - j$. A block token reads earlier block tokens at distance
# at most $\gamma \le W$, hence at plane $r$, which the batched pass computes before it runs loop $r$;
# every cached position it reads at plane $r$ is still in the window; everything else is plane $R$, stored
# for all positions. So one pass over $[x, \hat y_1, \dots, \hat y_\gamma]$ reads exactly what decoding the
# tokens one at a time reads, and writes the same planes. With $W < \gamma$ it does not: it reads plane $r$
# of block tokens that sequential decoding reads at plane $R$.
#
# The check runs in float64, where "equal" means equal up to rounding. A block of $\gamma + 1$ tokens of a
# worked problem is verified at two places, in one pass and token by token, from the same cache; the
# table gives the largest difference in the logits and in every cached key and value after the commit.

# %%
worked = book.encode(model64, data.word_problems(1, split="eval")[0].text)
block_starts = [worked.shape[1] // 2, worked.shape[1] - GAMMA - 1]
prop_policies = {"full cache": full, f"RIPE, W = {2 * GAMMA}": make_policy("ripe", R, window=2 * GAMMA),
                 f"RIPE, W = γ = {GAMMA}": make_policy("ripe", R, window=GAMMA),
                 f"RIPE, W = {GAMMA - 1}": make_policy("ripe", R, window=GAMMA - 1), "deepest plane (W = 0)": deepest}
rows = {}
for name, policy in prop_policies.items():
    checks = [batched_vs_sequential(model64, worked[:, :s + GAMMA + 1], s, policy) for s in block_starts]
    rows[name] = {"W >= γ": policy.window >= GAMMA or policy.name == "full",
                  "max |Δ logits|": max(c.logits for c in checks), "max |Δ planes|": max(c.planes for c in checks),
                  "targets equal": all(c.targets_equal for c in checks)}
proposition = pd.DataFrame.from_dict(rows, orient="index")
exact, broken = proposition[proposition["W >= γ"]], proposition[~proposition["W >= γ"]]
assert (exact[["max |Δ logits|", "max |Δ planes|"]] < 1e-11).all().all()  # float64 rounding only
assert (broken[["max |Δ logits|", "max |Δ planes|"]] > 1e-9).all().all()  # block-dependent
proposition.style.format({"max |Δ logits|": "{:.1e}", "max |Δ planes|": "{:.1e}"})

# %%
flipped = [name for name, row in broken.iterrows() if not row["targets equal"]]
Markdown(f"With W ≥ γ = {GAMMA} the batched pass differs from sequential decoding by at most "
         f"{exact['max |Δ logits|'].max():.1e} in the logits and {exact['max |Δ planes|'].max():.1e} in the cached "
         f"planes: float64 rounding. With W < γ they are {broken['max |Δ logits|'].min():.2g} to "
         f"{broken['max |Δ logits|'].max():.2g} in the logits and up to {broken['max |Δ planes|'].max():.2g} in the "
         f"planes, orders of magnitude above rounding: the block reads different planes. "
         + (f"At these blocks the difference changes an argmax target for {', '.join(flipped)}."
            if flipped else "At these blocks it does not change any argmax target, but nothing guarantees that."))

# %% [markdown]
# ## Algorithm 1: self-speculation over a RIPE cache
#
# Drafts run $d$ loops each and read the cached positions at plane $R$ (`prefix_reads="deep-kv"`), which the
# cache stores for every position; the verification pass runs all $R$ loops under $\pi_\text{RIPE}$; the
# accepted tokens' planes are appended and positions leaving the window drop their planes $1..R-1$. By
# Proposition 1, with $W \ge \gamma$ the emitted tokens must be exactly those of sequential greedy decoding
# under $\pi_\text{RIPE}$. The run is in float64 so that "exactly" is a test; the deepest-plane cache
# ($W = 0 < \gamma$) needs `exact=False`.

# %%
question = book.encode(model64, data.prompts("problems", 2, "eval")[1])
runs, texts = {}, {}
for name, spec in {f"RIPE, W = γ = {GAMMA}": dict(cache="ripe", window=GAMMA),
                   "deepest plane (W = 0)": dict(cache="deepest")}.items():
    sequential = looped_kv.generate(model64, question, max_new_tokens=NEW_TOKENS, method="ar", **spec)
    speculative = looped_kv.generate(model64, question, max_new_tokens=NEW_TOKENS, method="self-spec",
                                     draft_loops=DRAFT_LOOPS, block=GAMMA, prefix_reads="deep-kv",
                                     exact="window" in spec, **spec)
    same = sequential.new_tokens[0] == speculative.new_tokens[0]
    texts[name] = book.decode(model64, speculative.new_tokens)
    runs[name] = {"verifications": speculative.verifications, "τ (tokens / verification)": speculative.tau,
                  "tokens equal to sequential": int(same.sum()),
                  "first difference": int((~same).nonzero()[0]) if not same.all() else None,
                  "cache KB (sequential)": sequential.extra["cache_bytes"] / 1e3}
    if "window" in spec:
        assert torch.equal(speculative.tokens, sequential.tokens)  # Algorithm 1 = sequential RIPE decoding
        L = question.shape[1] + NEW_TOKENS - 1  # tokens processed by sequential decoding (the last is pending)
        assert sequential.extra["cache_bytes"] == m_ripe(cfg, L, GAMMA, R, model64.dtype)
algorithm = pd.DataFrame.from_dict(runs, orient="index")
print(book.decode(model64, question) + "|" + texts[f"RIPE, W = γ = {GAMMA}"])
algorithm.style.format({"τ (tokens / verification)": "{:.2f}", "cache KB (sequential)": "{:,.1f}"}, na_rep="—")

# %%
ripe_run, deep_run = algorithm.iloc[0], algorithm.iloc[1]
deep_text = ("also emits the tokens of sequential deepest-plane decoding here, although nothing guarantees it"
             if deep_run["first difference"] is None else
             f"departs from sequential deepest-plane decoding at generated token {deep_run['first difference']}")
Markdown(f"Algorithm 1 with W = γ = {GAMMA} emits all {NEW_TOKENS} tokens of sequential RIPE decoding in "
         f"{ripe_run['verifications']} verifications, {ripe_run['τ (tokens / verification)']:.2f} tokens per "
         f"verification. The deepest-plane cache, whose batched verification is block-dependent, {deep_text} "
         f"(τ = {deep_run['τ (tokens / verification)']:.2f}).")

# %% [markdown]
# ## Windows against the tail: Table 4 on this model
#
# The paper's protocol (Sections 2 and 5.1): decode greedily with the full cache in bf16 (the reference,
# L0), then replay each trajectory, teacher-forced, through every cache arm and through an fp32 full cache,
# which sets the precision floor, and record KL(L0 ‖ arm) at every generated position. Half of the prompts
# are worked problems followed by a new question (a one-shot stand-in for the paper's 8-shot GSM8K
# prompts), half are openings of standard-library functions. The fp32 arm uses the bf16 model's weights in
# fp32, so it differs from L0 in arithmetic only.

# %%
shots = data.word_problems(N_PROMPTS // 2, split="dev")
questions = data.word_problems(N_PROMPTS // 2, split="eval", seed=1)
prompt_texts = ([shot.text + q.prompt for shot, q in zip(shots, questions, strict=True)]
                + data.prompts("code", N_PROMPTS - N_PROMPTS // 2))
prompts = book.encode(model16, prompt_texts)
trajectories = target_trajectories(model16, prompts, NEW_TOKENS, progress=False)
prompt_lengths = [p.shape[1] for p in prompts]
lengths = [t.shape[1] for t in trajectories]
windows, factor = scale_windows(PAPER_WINDOWS, min(lengths))
# the L0 replay reproduces the greedy trajectory it replays
book.check_greedy_tokens(policy_logits(model16, trajectories[0], prompt_lengths[0], full),
                         trajectories[0][0, prompt_lengths[0]:])

labels = ["deepest plane (W = 0)", *(f"RIPE, W = {w}" for w in windows), f"+ {SINKS} sinks", "two planes",
          "fp32 full cache"]
policies = [deepest, *(make_policy("ripe", R, window=w) for w in windows), make_policy("sinks", R, sinks=SINKS),
            make_policy("k-deepest", R, k=2), full]
arms = {label: (model32 if label.startswith("fp32") else model16, policy)
        for label, policy in zip(labels, policies, strict=True)}
ripe_gamma = f"RIPE, W = {GAMMA}"  # a block-independent arm, when the scaled windows include W = gamma
replays = replay_records(trajectories, prompt_lengths, (model16, full), arms, block=GAMMA, reference_label="full cache",
                         block_arms=[labels[0], *([ripe_gamma] if ripe_gamma in arms else [])])  # Section 5.2
records = replays.records
summary = tail_summary(records, TAIL)
window_note = ("The paper's windows are used as they are." if factor == 1 else
               f"The trajectories are short ({min(lengths)} to {max(lengths)} tokens; the paper's windows were "
               f"priced at L = 1024), so the paper's windows {', '.join(map(str, PAPER_WINDOWS))} are scaled down by "
               f"{factor} to W = {', '.join(map(str, windows))}: unscaled, W = {max(PAPER_WINDOWS)} would cover "
               f"every trajectory and be the full cache.")
Markdown(f"{len(trajectories)} prompts of {min(prompt_lengths)} to {max(prompt_lengths)} tokens, {NEW_TOKENS} "
         f"generated tokens each: {len(records) // len(arms):,} positions per arm. {window_note}")

# %%
paper4 = pd.DataFrame(papers.RIPE_TABLE_4,  # RIPE Table 4
                      index=list(papers.RIPE_TABLE_4_COLUMNS)).T.astype(float)
huginn_cfg = looped_kv.huginn_0125()
paper_policies = [deepest, *(make_policy("ripe", 32, window=w) for w in PAPER_WINDOWS),
                  make_policy("sinks", 32, sinks=SINKS), make_policy("k-deepest", 32, k=2)]
for row, policy in zip(paper4.index[:-1], paper_policies, strict=True):  # Table 4's extra memory, Eq. (10)
    assert round(extra_over_deepest(huginn_cfg, policy, 1024) / 1e6) == paper4.loc[row, "extra MB"], row
extra_kb = [extra_over_deepest(cfg, p, 1024) / 1e3 if not label.startswith("fp32") else np.nan
            for label, p in zip(labels, policies, strict=True)]
table4 = pd.concat({
    "this model": summary[["tail", "max KL", "flips"]].assign(**{"extra KB": extra_kb}),
    "RIPE Table 4 (Huginn-0125)": paper4.set_axis(summary.index)}, axis=1)
table4.index.name = f"cache (tail: KL > {TAIL})"
table4.style.format("{:.3g}", subset=[c for c in table4.columns if c[1] == "max KL"]).format(
    "{:,.0f}", subset=[c for c in table4.columns if c[1] in ("tail", "flips", "extra KB", "extra MB")], na_rep="—")


# %%
tail = {label: int(n) for label, n in summary["tail"].items()}
flips = {label: int(n) for label, n in summary["flips"].items()}
peak = summary["max KL"].to_dict()
deep_label, mid_label, wide_label, sinks_label, two_label, fp_label = labels[0], labels[2], labels[3], *labels[4:]


def compared(a: int, b: int) -> str:
    return "as many as" if a == b else "fewer than" if a < b else "more than"


if tail[deep_label]:
    tail_text = (f"The deepest plane has {tail[deep_label]} positions with KL > {TAIL}, in "
                 f"{int(summary.loc[deep_label, 'tail prompts'])} of {len(trajectories)} prompts, and its largest KL "
                 f"is {peak[deep_label]:.3g}. With W = {windows[1]} the tail holds {tail[mid_label]} positions, "
                 f"{compared(tail[mid_label], tail[deep_label])} the deepest plane's, and the largest KL is "
                 f"{peak[mid_label]:.3g}; W = {windows[2]} leaves {tail[wide_label]}. ")
else:
    tail_text = (f"No position has KL > {TAIL} under the deepest plane (its largest KL is {peak[deep_label]:.3g}): "
                 f"on this model and these prompts there is no tail for a window to remove. With W = {windows[1]} "
                 f"the largest KL is {peak[mid_label]:.3g}, with W = {windows[2]} {peak[wide_label]:.3g}. ")
paper_tail = paper4["tail"].astype(int).to_list()
Markdown(tail_text
         + f"{SINKS} sinks give {tail[sinks_label]} tail positions and largest KL {peak[sinks_label]:.3g}; a second "
         f"plane gives {tail[two_label]} and {peak[two_label]:.3g}. The fp32 replay, a change of arithmetic only, "
         f"has {tail[fp_label]} tail positions and largest KL {peak[fp_label]:.3g}. Top-1 flips against L0: "
         f"{flips[deep_label]} for the deepest plane, {flips[mid_label]} for W = {windows[1]} and {flips[fp_label]} "
         f"for fp32, of {int(summary.loc[deep_label, 'positions'])} positions. On Huginn-0125 the paper counted "
         f"{paper_tail[0]} tail positions for the deepest plane, {paper_tail[2]} at W = 64, {paper_tail[4]} with "
         f"sinks, {paper_tail[5]} with two planes and {paper_tail[6]} for fp32. The tiny model is not Huginn: "
         f"only the direction of each comparison can be set beside the paper's.")


# %% [markdown]
# ## The shape of the error: Figure 4a/b
#
# The survival function gives, for every $x$, the fraction of positions whose KL is at least $x$. A
# precision change shifts the whole curve; a tail shows as a curve that crosses the fp32 one and runs far
# to the right. Positions with KL exactly 0 (identical logits) cannot appear on the logarithmic axis.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True, layout="constrained")
for ax, shown in ((left, [labels[0], "fp32 full cache"]), (right, labels[:-1])):
    for label in shown:
        x, s = survival(records.loc[records["arm"] == label, "kl"])
        ax.step(x, s, where="post", label=label, lw=1.4 if label in (labels[0], "fp32 full cache") else 1)
    ax.axvline(TAIL, color="grey", ls=":", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="KL x (nats)")
    ax.legend(fontsize=8)
left.set(ylabel="fraction of positions with KL ≥ x", title="(a) deepest plane against a precision change")
right.set(title="(b) windows, sinks and a second plane")
plt.show()

# %%
d, fp = summary.loc[deep_label], summary.loc[fp_label]
deep_records = records[records["arm"] == deep_label]
assert (deep_records.loc[deep_records["position"] == 0, "kl"] == 0).all()  # from the prefill, alike in every cache
zeros = int((deep_records["kl"] == 0).sum())
ratio_mean = d["mean KL"] / fp["mean KL"]
median_word = "lower" if d["median KL"] < fp["median KL"] else "higher"
paper_median, paper_mean = SEC5_1["median KL"], SEC5_1["mean KL ratio"]
paper_share = SEC5_1["top 1% share of KL"]
Markdown(f"{zeros} of the deepest plane's {len(deep_records)} positions have KL exactly 0 and are not drawn, among "
         f"them the first generated position of every prompt: it comes from the prompt's prefill, which every bf16 "
         f"cache computes alike. "
         f"Over all positions the median KL of the deepest plane is {median_word} than fp32's "
         f"({d['median KL']:.2g} against {fp['median KL']:.2g}) and its mean is {ratio_mean:.2g} times fp32's. "
         f"The largest 1% of positions carry {d['top 1% share']:.0%} of the deepest plane's KL (fp32: "
         f"{fp['top 1% share']:.0%}). On Huginn-0125 the paper reports medians of {paper_median[0]:.1e} and "
         f"{paper_median[1]:.1e}, a mean {paper_mean} times higher and shares of "
         f"{paper_share[0]:.0%} and {paper_share[1]:.0%}.")

# %% [markdown]
# ## Generation fidelity: the label of Section 5.1
#
# The pre-registered statistic is KL(L0 ‖ deepest) / KL(L0 ‖ fp32) per bin of generated position, with a
# bootstrap over prompts that keeps each prompt's bins together. The deepest plane *exceeds a precision
# change* if the lower bound of some bin's 95% interval is above 2, and is *indistinguishable from a
# precision change* otherwise (`fits.fidelity_label`). The same statistic for the other arms shows what the
# windows do to it.

# %%
edges = np.arange(0, NEW_TOKENS + 1, BIN)


def bin_means(label: str) -> np.ndarray:
    arm = records[records["arm"] == label]
    return per_prompt_bin_means(arm["kl"], arm["prompt"], arm["position"], edges)[1]


floor_bins = bin_means("fp32 full cache")
fidelity = {label: fidelity_label(bin_means(label), floor_bins) for label in labels[:-1]}
deep_fid = fidelity[labels[0]]
bins_table = pd.DataFrame({"positions": [f"{a}-{b - 1}" for a, b in itertools.pairwise(edges)],
                           "ratio": deep_fid.ratio, "95% low": deep_fid.low, "95% high": deep_fid.high,
                           "exceeds": deep_fid.exceeds}).set_index("positions")
labels_table = pd.DataFrame({label: {"largest bin ratio": f.ratio.max(), "bins exceeding": int(f.exceeds.sum()),
                                     "label": f.label} for label, f in fidelity.items()}).T
display(bins_table.style.format({"ratio": "{:.2f}", "95% low": "{:.2f}", "95% high": "{:.2f}"}))
labels_table.style.format({"largest bin ratio": "{:.2f}"})

# %%
paper_bin, other_bins = SEC5_1["exceeding bin ratio"], SEC5_1["other bin ratios"]
exceeding = [f"{bins_table.index[i]} ({r:.2f} [{lo:.2f}, {hi:.2f}])" for i, (r, lo, hi)
             in enumerate(zip(deep_fid.ratio, deep_fid.low, deep_fid.high, strict=True)) if deep_fid.exceeds[i]]
window_labels = {fidelity[label].label for label in labels[1:4]}
if len(window_labels) == 1:
    windows_text = (f"With windows W = {', '.join(map(str, windows))} the label is "
                    f"{'also ' if deep_fid.label in window_labels else ''}“{window_labels.pop()}”. ")
else:
    windows_text = "With windows: " + "; ".join(f"W = {w}, “{fidelity[label].label}”"
                                              for w, label in zip(windows, labels[1:4], strict=True)) + ". "
Markdown(f"On this model the deepest plane is labelled **{deep_fid.label}**: bin ratios run from "
         f"{deep_fid.ratio.min():.2f} to {deep_fid.ratio.max():.2f}"
         + (f", and the bins of generated positions {', '.join(exceeding)} exceed the threshold. "
            if exceeding else f"; no bin's lower bound is above {deep_fid.threshold:g}. ")
         + windows_text + f"The paper labels Huginn-0125's deepest plane "
         f"“{SEC5_1['fidelity label']}” through one bin, {paper_bin[0]:.1f} "
         f"[{paper_bin[1]:.2f}, {paper_bin[2]:.1f}], "
         f"with other bins at {other_bins[0]}–{other_bins[1]}.")

# %%
deep_counts = tail_counts_by_prompt(records, labels[0], range(len(trajectories)), TAIL)
mid_counts = tail_counts_by_prompt(records, labels[2], range(len(trajectories)), TAIL)
paper_tail = SEC5_1["tail ratio W = 64"]
if deep_counts.sum() > 0:
    tail_ratio = paired_bootstrap_ratio(deep_counts, mid_counts)
    tail_ratio_text = (f"The tail ratio of W = {windows[1]} to the deepest plane is {tail_ratio.estimate:.2f} "
                       f"[{tail_ratio.low:.2f}, {tail_ratio.high:.2f}] over prompts")
else:
    tail_ratio_text = f"There is no tail ratio: the deepest plane has no position with KL > {TAIL}"
Markdown(f"{tail_ratio_text}; the paper's is {paper_tail[0]:.2f} [{paper_tail[1]:.2f}, {paper_tail[2]:.2f}] at "
         f"W = {PAPER_WINDOWS[1]}, wide because {SEC5_1['tail prompts']} prompts "
         f"carry all of Huginn's tail positions.")

# %% [markdown]
# ## Block dependence: Section 5.2
#
# With the deepest plane, batched verification reads plane $r$ of the block's earlier tokens where
# sequential decoding reads plane $R$. The paper's test cuts each trajectory into verification blocks of
# $\gamma + 1$ tokens and, at identical contexts, compares the logits of one batched pass with those of
# decoding the block token by token: KL(sequential ‖ batched) per position. For the full cache the two are
# equal in exact arithmetic (Proposition 1), so in bf16 its value measures the numerics alone. The ratio of
# the deepest plane's mean to the full cache's, with a prompt-paired bootstrap, is "indistinguishable from
# numerics" unless its lower bound exceeds 2. The replays above measured it on the same trajectories: at
# the start of each block one batched pass reads the cache that the sequential replay has built. RIPE with
# $W = \gamma$ is measured alongside when it is one of the arms.

# %%
dependence = replays.block_dependence  # mean KL(sequential || batched) per prompt
deep_dep = block_dependence_ratio(dependence["full cache"], dependence[labels[0]])
ripe_dep = block_dependence_ratio(dependence["full cache"], dependence[ripe_gamma]) if ripe_gamma in arms else None
dependence.style.format("{:.2e}")

# %%
paper_dep = SEC5_2["block dependence ratio"]


def ratio_text(result) -> str:
    if result.ratio is None:
        return (f"not a ratio: batched and sequential full-cache verification agree bitwise on this hardware, "
                f"while the mean KL here is {result.arm_mean:.2e}")
    ci = result.ratio
    return f"{ci.estimate:.3g} [{ci.low:.3g}, {ci.high:.3g}]"


if ripe_dep is None:
    ripe_text = ""
elif ripe_dep.label != EXCEEDS_NUMERICS:
    ripe_text = (f"For RIPE with W = γ it is {ratio_text(ripe_dep)}, “{ripe_dep.label}”, as Proposition 1 says it "
                 f"must be: batched and sequential verification read the same planes and differ by rounding. ")
else:
    ripe_text = (f"For RIPE with W = γ it is {ratio_text(ripe_dep)}, “{ripe_dep.label}”, although batched and "
                 f"sequential verification read the same planes: the bf16 rounding of the two policies differs. ")
Markdown(f"In bf16 the deepest plane's block dependence over the full cache's is {ratio_text(deep_dep)}: "
         f"**{deep_dep.label}** (mean KL {deep_dep.arm_mean:.2e} against {deep_dep.reference_mean:.2e}). "
         + ripe_text
         + f"The paper measured {paper_dep[0]:.2f} [{paper_dep[1]:.2f}, {paper_dep[2]:.2f}] on Huginn-0125, "
         f"“{SEC5_2['block dependence label']}” against its threshold of "
         f"{SEC5_2['block dependence threshold']:g}.")

# %% [markdown]
# ## What this chapter shows
#
# RIPE costs the deepest plane plus a fixed window, and the window buys two things: batched verification
# that is exactly sequential decoding once $W \ge \gamma$, by construction rather than by measurement, and
# full-depth reads of the recent positions, which removed most of Huginn-0125's tail in the paper's
# replay. Whether a window is also needed against a tail is a property of the model: the RIPE paper found
# a tail on Huginn-0125 and none on Raven-Llama.

# %%
elapsed = time.perf_counter() - start
verdict = "exceeds" if deep_fid.label == EXCEEDS else "does not exceed"
print(f"chapter computed in {elapsed:.0f} s")
exact_extra = extra_over_deepest(cfg, make_policy("ripe", R, window=GAMMA), 1024)
Markdown(f"On this model the deepest plane {verdict} a precision change by the Section 5.1 rule, and its block "
         f"dependence is “{deep_dep.label}”. RIPE with W = γ = {GAMMA} makes batched verification exact for "
         f"{exact_extra / 1e3:,.1f} KB per 1024-token sequence over the deepest plane, "
         f"{exact_extra / (1e6 * tiny['full']):.2%} of the full cache.")
