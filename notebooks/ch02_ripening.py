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
# # 2. Planes ripen
#
# Chapter 1 counted the planes. This chapter asks how different they are. Loop $r$ of
# the core writes keys $K^{(r)}$ and values $V^{(r)}$ for every token. As the recurrent
# state settles, successive planes should approach the last one. The RIPE paper (Section
# 3.2) measures this with the relative distance of plane $r$ to plane $R$ over the
# prefix positions, averaged over core layers and texts:
#
# $$ \Delta_r = \frac{\lVert K^{(r)} - K^{(R)} \rVert}{\lVert K^{(R)} \rVert}
#    \quad\text{(likewise for values)}. $$
#
# In float32 it finds $\Delta_r \approx c\rho^r$ from loop 8 on: the planes **ripen
# geometrically**, at about the same rate for keys and values, while the values stay
# farther from plane $R$ than the keys (Table 7). In bfloat16 the curve levels off at a
# rounding floor $\Delta_\infty$, and one extra parameter describes it (RIPE Eq. 5):
#
# $$ \Delta_r^\text{bf16} \approx \sqrt{(c\rho^r)^2 + \Delta_\infty^2}. $$
#
# Remark 1 turns this into a test. The deep loops are **ripe to bf16** when their bf16
# distance is at the floor, that is, when the deep planes differ from plane $R$ by no
# more than rounding does. The DAS paper looks at the same convergence from another
# side. It takes the cosine similarity of each loop's queries, keys and values to the
# final loop's, and finds that values mature later than queries and keys (DAS Section
# 3.1, Figure 2 top).
#
# This chapter measures all of it on the model at hand, text by text, and gives each
# claim a verdict (`looped_kv.analysis.verdicts`) against the smallest effect that
# counts for it (the papers print none for these claims, so the book's own,
# `verdicts.BOOK_MINIMUM`, which each verdict states). *Agrees* when a paired interval
# over texts lies beyond that effect in the paper's direction, *disagrees* when it lies
# beyond that effect against it, *no effect of that size* when it lies inside the
# band of effects smaller than that, and *inconclusive* otherwise, or when the
# measurement cannot tell outcomes apart on this model (too few texts, distances at the
# float floor, cosines at their ceiling).

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab: install, then choose what fits the GPU
    PACKAGE = "looped-kv[book,papers] @ git+https://github.com/looped-kv/looped-kv"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", PACKAGE], check=True)
    from looped_kv import book

    book.colab_setup("ch02")

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from looped_kv import book, papers, profiles
from looped_kv.analysis import verdicts as vd
from looped_kv.analysis.fits import (
    deep_loop_range,
    fit_loop_range,
    floor_model,
    ripeness,
)
from looped_kv.analysis.planes import (
    free_memory,
    in_dtype,
    paper_planes,
    record_device,
    ripening_curves,
    ripening_summary,
    table7_column,
    text_ripening,
    workload_batch,
)
from looped_kv.workloads import data

book.setup()
start = time.perf_counter()
model = book.chapter_model()  # $LOOPED_KV_MODEL, default "tiny"; CUDA when available
run = profiles.for_model(model)
profile = run.ch02  # every size of this chapter
R = model.config.mean_recurrence
who = "the tiny model" if book.is_tiny(model) else model.source
print(book.environment(model))

# %% [markdown]
# ## The texts
#
# Every measurement replays whole texts, teacher-forced, with an explicit softmax (RIPE
# Section 2). The texts are evaluation texts of the three workloads: worked word
# problems, excerpts of the Python standard library, and variable chains, the workload
# built so that depth should pay (chapter 1 measures where it stops paying on this
# model; on a real checkpoint, solved GSM8K problems and MBPP tasks take the place of
# the first two). Each text is cut to the same number of tokens. The last
# positions play the decoded tokens, and $\Delta_r$ is measured over the prefix before
# them. Each text is one unit of the verdicts below, with its own curves and its own
# fits.

# %%
ids, workload = workload_batch(model, data.WORKLOADS, profile.texts_per_workload,
                               profile.length, source=run.workloads)
counts = pd.Series(workload).value_counts().reindex(data.WORKLOADS)

# %% tags=["remove-input"]
book.md(f"{ids.shape[0]} texts ("
        + ", ".join(f"{n} {w}" for w, n in counts.items())
        + f") of {profile.length} tokens; $\\Delta_r$ over the first "
        f"{profile.length - profile.decoded} positions of each.")

# %% [markdown]
# ## Replay in float32 and in bfloat16
#
# The float32 replay runs a float32 copy of the model. The bf16 replay runs a copy cast
# to bfloat16, so its keys and values are rounded to bf16 as a bf16 cache stores them.
# In both the softmax runs in float32, as in the paper. Each replay records the queries,
# keys and values of every loop and core layer, a few texts at a time, and keeps only
# each text's curves. A copy is freed as soon as its replay is done.
#
# Float32 has a floor too. Each chunk of texts is replayed a second time by the float32
# copy cast in place to float64 (and cast back, bit for bit), which measures how far
# rounding moves each float32 plane. Two planes that agree exactly in float64 can lie up
# to the sum of their two roundings apart in float32. The largest such sum over texts
# and loops is the **float32 floor** of $\Delta_r$: a distance at or below it measures
# rounding, not ripening.

# %%
fit_dtype, floor_dtype = (book.DTYPES[name] for name in profile.replay_dtypes)
where = record_device(model, profile.record_device)
copy = in_dtype(model, fit_dtype)
fp32 = ripening_curves(copy, ids, R, decoded=profile.decoded, chunk=profile.chunk,
                       exact_dtype=book.DTYPES[profile.exact_dtype],
                       record_device=where)
del copy
free_memory(model.device)
copy = in_dtype(model, floor_dtype)
bf16 = ripening_curves(copy, ids, R, decoded=profile.decoded, maturity_kinds=(),
                       chunk=profile.chunk, record_device=where)
del copy
free_memory(model.device)
fits = ripening_summary(fp32, bf16)  # c rho^r on fit_loop_range(R), then Eq. (5)
floors = {X: fp32.float_floor(X) for X in ("k", "v")}
for X in ("k", "v"):
    assert fp32.delta[X][-1] == 0 and bf16.delta[X][-1] == 0  # plane R against itself
loops = fp32.loops
curves = pd.DataFrame({"keys fp32": fp32.delta["k"], "keys bf16": bf16.delta["k"],
                       "values fp32": fp32.delta["v"], "values bf16": bf16.delta["v"]},
                      index=pd.Index(loops, name="loop r"))
book.table(curves.loc[list(paper_planes(R))],
           caption="Delta_r at the planes of RIPE Sec. 3.1 (scaled to R), "
                   "mean over texts")

# %% [markdown]
# ## Table 7 beside the paper's
#
# The paper fits $\rho$ and $c$ to float32 over loops 8 to 31. It then fits
# $\Delta_\infty$ to bf16 with $\rho$ and $c$ fixed, and averages $\Delta$ over the deep
# loops 25 to 31. The model's column comes from the curves above (means over texts, as
# the paper's). The papers' columns are RIPE Table 7 as printed, keys first and values
# in parentheses. Their ripeness labels are not typed in: the same `ripeness` test of
# Remark 1 computes them from the printed deep-loop bf16 distance and floor.

# %%
PAPER_TABLE7 = papers.RIPE_TABLE_7  # (keys, values); max |log residual| once per model


def paper_column(printed: dict) -> dict[str, str]:
    column = {name: (f"{x[0]:g} ({x[1]:g})" if isinstance(x, tuple) else f"{x:g}")
              for name, x in printed.items()}
    labels = [ripeness(deep, floor).label for deep, floor in
              zip(printed["deep-loop Delta, bf16"], printed["Delta_inf (bf16)"],
                  strict=True)]
    column["ripeness (Remark 1)"] = f"{labels[0]} ({labels[1]})"
    return column


table7 = pd.DataFrame({f"{model.source} (this run)": table7_column(fits),
                       **{f"{name} (RIPE Table 7)": paper_column(p)
                          for name, p in PAPER_TABLE7.items()}})
table7.index.name = "keys (values)"
book.table(table7)

# %% [markdown]
# ## The analogue of Figure 2c and Figure 6
#
# Filled markers are float32 and open markers bf16, means over texts; thin grey lines
# are single texts in float32. The solid line is $c\rho^r$ fitted to float32, the dotted
# line the same fit with the one bf16 floor of Eq. (5), and the dashed line the float32
# floor. The shaded band marks the deep loops.

# %%
deep = deep_loop_range(R)
shown = loops[:-1]  # Delta_R = 0 has no place on a log axis
fig, axes = plt.subplots(1, 2, figsize=book.WIDE, sharey=True)
for ax, X, name in zip(axes, ("k", "v"), ("keys (Fig. 2c)", "values (Fig. 6)"),
                       strict=True):
    f = fits[X]
    fitted = np.arange(f.geometric.loop_range[0], f.geometric.loop_range[1] + 1)
    ax.axvspan(deep.start - 0.5, deep.stop - 0.5, color="0.92", zorder=0)
    ax.plot(shown, fp32.text_delta[X][:, :-1].T, "-", color="0.75", lw=0.5, zorder=1)
    ax.plot(shown, fp32.delta[X][:-1], "o", color="C0", ms=4, label="fp32")
    ax.plot(shown, bf16.delta[X][:-1], "o", mfc="none", color="C1", ms=5, label="bf16")
    ax.plot(fitted, f.geometric.predict(fitted), "-", color="C0",
            label=f"$c\\rho^r$, $\\rho$ = {f.geometric.rho:.3f}")
    ax.plot(fitted, floor_model(fitted, f.geometric.rho, f.geometric.c,
                                f.floor.delta_inf), ":", color="C1",
            label=f"bf16 floor $\\Delta_\\infty$ = {f.floor.delta_inf:.2g}")
    ax.axhline(floors[X], color="C0", ls="--", lw=0.8,
               label=f"fp32 floor {floors[X]:.2g}")
    ax.set(yscale="log", xlabel="loop r", title=f"Prefix {name}")
    ax.legend(loc="upper right", fontsize=7.5)
axes[0].set_ylabel(f"$\\Delta_r$ (distance to plane R = {R})")
plt.show()

# %% [markdown]
# ## Geometric ripening, text by text
#
# The paper's claim has two parts. The planes converge: $\rho < 1$. And $c\rho^r$
# describes the curve: Table 7 fits it to the loops 8 to $R-1$ of the mean curve and
# prints its largest $|\log|$ residual for each model. The first part gets a verdict
# over texts; the second is the same fit on this model's mean curve, a number beside
# the paper's. Each text's curve is also fitted as a power of
# the loop, $s\,r^{-k}$, a decay that slows down with depth; which law leaves the
# smaller residual is shown as a count, not as a verdict, because the paper makes no
# claim against a power law. Distances at or below the float32 floor enter the fits at
# the floor, and a verdict needs the share of the fitted distances above the floor that
# the package's `above_floor` check asks for.

# %%
NAMES = {"q": "queries", "k": "keys", "v": "values"}
NAME = {"q": "query", "k": "key", "v": "value"}
per_text = text_ripening(fp32, floors).assign(workload=workload)
FIT_LOW, FIT_HIGH = fit_loop_range(R)  # 8..31 at R = 32
resolved = {X: vd.above_floor(fp32.fitted(X), floors[X],
                              f"the float32 {NAME[X]} distances of loops "
                              f"{FIT_LOW}-{FIT_HIGH}")
            for X in ("k", "v")}
BOOK = "the book's smallest effect"
verdicts = {}
for X in ("k", "v"):
    checks = vd.discrimination(resolved[X])
    converge = vd.Claim(f"{NAMES[X]} converge to plane R: rho < 1", "RIPE Sec. 3.2",
                        expects="less", minimum=vd.BOOK_MINIMUM["share"],
                        minimum_source=f"{BOOK} for a rate")
    verdicts[f"{NAMES[X]} converge"] = vd.verdict(
        converge, per_text[f"rho_{X}"], null=1.0, discrimination=checks,
        units="texts")
geometric_wins = {X: int((per_text[f"geometric_rms_{X}"] < per_text[f"power_rms_{X}"])
                         .sum()) for X in ("k", "v")}

# %% tags=["remove-input"]
fk, fv = fits["k"], fits["v"]
above = {X: float((fp32.fitted(X) > floors[X]).mean()) for X in ("k", "v")}
hug, rav = PAPER_TABLE7["Huginn-0125"], PAPER_TABLE7["Raven-Llama"]
paper_rho = (hug["rho"][0], rav["rho"][0])


def against_papers(value: float, printed: tuple, low: str, high: str) -> str:
    """Where ``value`` lies against the papers' two figures, in words."""
    return (low if value < min(printed) else high if value > max(printed)
            else "between the papers' models")


# rho is the share of the remaining distance kept per loop; how ripe the planes end
# is Table 7's absolute rows (the deep-loop distances), which can disagree with it
rate = against_papers(fk.geometric.rho, paper_rho,
                      "a smaller share kept per loop than both papers' models",
                      "a larger share kept per loop than both papers' models")
DEEP_ROWS = {"bf16": "deep-loop Delta, bf16", "fp32": "deep-loop Delta, fp32"}
closeness = {dtype: against_papers(
    getattr(fk, f"deep_{dtype}"), (hug[row][0], rav[row][0]),
    "closer to plane R than on both papers' models",
    "farther from plane R than on both papers' models")
    for dtype, row in DEEP_ROWS.items()}
book.md(
    f"Over all texts (Table 7's column) the keys of {who} approach plane {R} at "
    f"$\\rho$ = {fk.geometric.rho:.3f} per loop, a half-life of "
    f"{fk.geometric.half_life:.1f} loops, and its values at $\\rho$ = "
    f"{fv.geometric.rho:.3f} ({fv.geometric.half_life:.1f} loops): {rate} (keys: "
    f"Huginn {paper_rho[0]}, Raven {paper_rho[1]}). The rate is the shape of the "
    "approach, not how ripe the planes end: over the deep loops its keys are "
    + " and ".join(f"{closeness[dtype]} in {dtype} ({getattr(fk, f'deep_{dtype}'):.2g}"
                   f" against {hug[row][0]:g} and {rav[row][0]:g})"
                   for dtype, row in DEEP_ROWS.items())
    + ". The float32 floors are "
    f"{floors['k']:.2g} (keys) and {floors['v']:.2g} (values), and "
    f"{above['k']:.0%} of the fitted key distances and {above['v']:.0%} of the fitted "
    "value distances lie above them"
    + ("; these rates are fitted to distances of which most measure rounding.\n\n"
       if not all(check.passed for check in resolved.values()) else ".\n\n")
    + f"On the mean curve $c\\rho^r$ leaves a largest $|\\log|$ residual of "
    f"{fk.geometric.max_abs_log_residual:.2f} for the keys and "
    f"{fv.geometric.max_abs_log_residual:.2f} for the values (Table 7: "
    f"{hug['max |log residual|, fp32']} on Huginn, {rav['max |log residual|, fp32']} "
    f"on Raven-Llama). Text by text, the geometric law leaves a smaller residual "
    f"than a power law for {geometric_wins['k']} of {len(per_text)} key curves and "
    f"{geometric_wins['v']} of {len(per_text)} value curves.\n\n"
    + vd.claim_summary(verdicts)
)

# %% [markdown]
# ## Values ripen later than keys
#
# In Table 7 the values stay farther from plane $R$ than the keys over the deep loops,
# in float32 and in bf16. Each text gives one ratio: its values' mean deep-loop distance
# over its keys'. Both must lie above the float32 floor for the ratio to compare
# ripening rather than rounding.

# %%
later = vd.Claim("values stay farther from plane R than keys over the deep loops: "
                 "fp32 Delta, values / keys", "RIPE Sec. 3.2, Table 7",
                 expects="greater", scale="log-ratio", minimum=vd.BOOK_MINIMUM["ratio"],
                 minimum_source=f"{BOOK} for a ratio")
deep_checks = vd.discrimination(
    *(vd.above_floor(per_text[f"deep_{X}"], floors[X],
                     f"the deep-loop {NAME[X]} distances") for X in ("k", "v")))
verdicts["values later than keys"] = vd.verdict(
    later, per_text.deep_v, per_text.deep_k, discrimination=deep_checks, units="texts")
by_workload = per_text.groupby("workload", sort=False).agg(
    texts=("rho_k", "size"), rho_keys=("rho_k", "median"),
    rho_values=("rho_v", "median"), deep_keys=("deep_k", "median"),
    deep_values=("deep_v", "median"))
log_ratio = np.log(per_text.deep_v / per_text.deep_k)
by_workload["values / keys"] = np.exp(log_ratio.groupby(per_text.workload).mean())
book.table(by_workload, caption="Per workload (float32): medians over texts; values / "
           "keys is the geometric mean of the texts' deep-loop ratios")

# %% tags=["remove-input"]
paper_ratio = {name: p["deep-loop Delta, fp32"][1] / p["deep-loop Delta, fp32"][0]
               for name, p in PAPER_TABLE7.items()}
rho_gap = (per_text.rho_v - per_text.rho_k).median()
book.md(
    vd.claim_summary({"all texts": verdicts["values later than keys"]}) + "\n\n"
    f"In Table 7 the ratio is {paper_ratio['Huginn-0125']:.2f} on Huginn and "
    f"{paper_ratio['Raven-Llama']:.2f} on Raven, at almost equal rates; here the "
    f"median per-text difference of the rates, $\\rho_V - \\rho_K$, is "
    f"{rho_gap:.3g}. The table shows the same quantities per workload ("
    + (f"{counts.min()} texts each" if counts.min() == counts.max() else
       f"{counts.min()} to {counts.max()} texts each")
    + "); it describes, and the verdicts pool all texts."
)

# %% [markdown]
# ## Remark 1: are the deep loops ripe to bf16?
#
# Remark 1 is a test of a model, not a claim with a sign. The deep loops are ripe to
# bf16 when their bf16 distance is within the floor model's bound of $\Delta_\infty$:
# $\sqrt 2\,\Delta_\infty$, where the geometric part equals the floor. Chapter 4 checks
# its consequence, that a deepest-plane cache then costs no more than a precision
# change.

# %% tags=["remove-input"]
printed = {name: (p["deep-loop Delta, bf16"][0], p["Delta_inf (bf16)"][0])
           for name, p in PAPER_TABLE7.items()}
paper_labels = {name: ripeness(*pair).label for name, pair in printed.items()}
like = [name for name, label in paper_labels.items() if label == fk.ripeness.label]
book.md(
    f"On {who} the deep keys are {fk.ripeness.label} and the deep values "
    f"{fv.ripeness.label}: their bf16 distances are {fk.ripeness.ratio_text} and "
    f"{fv.ripeness.ratio_text} times the floor (the bound is "
    f"{fk.ripeness.tolerance:.2f}). The paper's keys are "
    + " and ".join(f"{deep / floor:.2f} times the floor on {name} "
                   f"({paper_labels[name]})" for name, (deep, floor) in printed.items())
    + (f"; in its keys {who} is like {' and '.join(like)}." if like else ".")
    + f" In float32 its mean deep-loop key distance is "
    f"{fk.deep_fp32 / hug['deep-loop Delta, fp32'][0]:.2g} times Huginn's."
)

# %% [markdown]
# ## Shallow queries, mature values
#
# The DAS paper's Figure 2 (top) plots the mean cosine similarity of each loop's
# queries, keys and values to the final loop's, averaged over core layers. Here it comes
# from the same float32 replay, over all positions; the lines are means over texts, and
# the markers at loop 1 are the DAS paper's values for Huginn and Raven. The claim is
# about loop 1: the values are the least mature. Each text gives its own loop-1 cosines.
# A cosine at its ceiling of 1 leaves no room to be less mature, so the verdicts need
# the loop-1 cosines to stay below it.

# %%
PAPER_DAS = papers.DAS_SEC_3_1_COSINE  # loop 1's cosine similarity to loop R = 32
KIND = {"q": "Q", "k": "K", "v": "V"}
fig, ax = plt.subplots(figsize=book.COLUMN)
for i, X in enumerate("qkv"):
    ax.plot(loops, fp32.maturity[X], "-", color=f"C{i}", label=f"{KIND[X]}, this model")
    for marker, name in (("s", "Huginn-0125"), ("^", "Raven-Llama")):
        ax.plot(1, PAPER_DAS[name][X], marker, color=f"C{i}", mfc="none", ms=8)
ax.plot([], [], "s", color="0.4", mfc="none", label="Huginn-0125, loop 1 (DAS)")
ax.plot([], [], "^", color="0.4", mfc="none", label="Raven-Llama, loop 1 (DAS)")
ticks = [r for r in (1, 2, 4, 8, 16, 32, 64) if r <= R]
ax.set(xscale="log", xlabel="loop r", ylabel="cosine to loop R",
       title="Q/K/V maturity (DAS Fig. 2, top)")
ax.set_xticks(ticks, [str(r) for r in ticks])
ax.legend(ncol=2, loc="lower right")
plt.show()

for X in "qk":
    claim = vd.Claim(f"values are less mature than {NAMES[X]} at loop 1: cosine to "
                     f"loop R, V minus {KIND[X]}", "DAS Sec. 3.1, Fig. 2 top",
                     expects="less", minimum=vd.BOOK_MINIMUM["share"],
                     minimum_source=f"{BOOK} for a cosine")
    checks = vd.discrimination(vd.below_ceiling(
        per_text.cos1_v, 1.0, "the loop-1 cosine of the values"))
    verdicts[f"V less mature than {KIND[X]}"] = vd.verdict(
        claim, per_text.cos1_v, per_text[f"cos1_{X}"], discrimination=checks,
        units="texts")
first_loop = pd.DataFrame(
    {f"{model.source} (this run)": {KIND[X]: fp32.maturity[X][0] for X in "qkv"},
     **{f"{n} (DAS)": {KIND[X]: p[X] for X in "qkv"} for n, p in PAPER_DAS.items()}})
first_loop.index.name = "loop 1"
book.table(first_loop)

# %% tags=["remove-input"]
mature = fp32.maturity
reach = {X: int(np.argmax(mature[X] >= 0.99)) + 1 if np.any(mature[X] >= 0.99) else None
         for X in "qkv"}
gap = min(mature["q"][0], mature["k"][0]) - mature["v"][0]
paper_gap = {name: min(p["q"], p["k"]) - p["v"] for name, p in PAPER_DAS.items()}
book.md(
    vd.claim_summary({f"against {KIND[X]}": verdicts[f"V less mature than {KIND[X]}"]
                      for X in "qk"})
    + f"\n\nAt loop 1 the mean cosines of {who} are {mature['q'][0]:.3f} (Q), "
    f"{mature['k'][0]:.3f} (K) and {mature['v'][0]:.3f} (V): V lies "
    + (f"{gap:.3g} below" if gap > 0 else f"{-gap:.3g} above")
    + f" the smaller of Q and K, against {paper_gap['Huginn-0125']:.2f} below on "
    f"Huginn and {paper_gap['Raven-Llama']:.2f} below on Raven. Cosine 0.99 is first "
    "reached at loop "
    + ", ".join(f"{reach[X]} ({KIND[X]})" if reach[X] else f"never ({KIND[X]})"
                for X in "qkv")
    + "."
)

# %% [markdown]
# ## On a shallow recurrence
#
# The geometric fit $c\rho^r$ and the deep-loop mean of $\Delta_r$ read loops below $R$,
# scaled from the paper's. On a shallow recurrence the fit has a handful of loops and
# the deep-loop mean one or two planes. The chapter can still show whether planes ripen
# ($\Delta_r$ falling with $r$) and whether values trail keys; it cannot tell a
# geometric decay from another falling curve over so few loops, and Eq. (5)'s prediction
# from the fitted $\rho$ rests on a rate fitted over those few loops.
#
# The depth settings of this chapter at the tiny model's $R$, Parcae's and Ouro's
# (`looped_kv.analysis.shallow`): the loops each names, and how many.

# %%
from looped_kv.analysis.shallow import depth_table

book.table(depth_table("ch02"), caption="loops (how many)")

# %% [markdown]
# ## Verdicts
#
# Every claim of this chapter: the paired estimate over texts (a mean difference, or a
# ratio of geometric means) with its 95% BCa bootstrap interval, its n, the smallest
# effect that counts, and the verdict. An *inconclusive* row says why: an interval that
# crosses no difference or an edge of the no-effect band, or a check that failed
# (distances at the float floor, cosines at their ceiling, too few texts).

# %%
book.table(vd.interval_table(verdicts))

# %% tags=["remove-input"]
book.md(vd.tally(verdicts, who, "the papers"))

# %%
print(f"chapter computed in {time.perf_counter() - start:.0f} s")
