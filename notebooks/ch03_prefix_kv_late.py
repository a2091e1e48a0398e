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
# # 3. Prefix KV matters late
#
# Chapter 2 showed how planes ripen: a deep loop's keys and values are close to plane
# $R$, a shallow loop's are not. Which loops *care* about the prefix keys and values
# they read? The RIPE paper answers with substitution **arms** (Section 3.1). An arm
# replays a text. In the loops of one region, every query reads plane $p$ of the prefix
# instead of its own plane $r$. The arm measures the KL divergence from the unperturbed
# replay at the first decoded position. The size of the perturbation is the
# root-sum-square of the relative plane distances over the region's loops, core layers,
# keys and values,
#
# $$ \lVert\delta\rVert^2 = \sum_{r,l,X} \big(\lVert X_p - X_r\rVert /
#    \lVert X_r\rVert\big)^2. $$
#
# For small perturbations the KL is quadratic in $\delta$ and weighted by a per-loop
# sensitivity (Eq. 4). The paper fits
#
# $$ \log \mathrm{KL} = a + b\,[\text{deep}] + g \log\lVert\delta\rVert $$
#
# over all arms and texts. Here $e^b$ says how much more sensitive the deep region
# (loops 25-32) is than the shallow one (loops 2-9) at equal perturbation size. This
# chapter runs the arms on the model at hand and fits the regression. It then predicts
# the deepest-plane cache's error from ripening and sensitivity alone (Eq. 6), and last
# checks the consequence for caching: at equal storage, keeping deep planes should beat
# keeping shallow ones (Table 3). Along the way it repeats the regression in bf16, and
# it tests the paper's other way to store less: keep, per head, only the prefix
# positions a shallow loop attends to (Section 5.4).
#
# Each claim gets a verdict from paired measurements over texts
# (`looped_kv.analysis.verdicts`), against the smallest effect that counts for it: the
# paper's own where it prints one (RIPE Table 6 pre-registered a deep coefficient $b$
# of at least 3; Section 3.2 found Eq. (6) right to within a factor of two), the book's
# elsewhere; each verdict states its own. A KL at or below the float floor cannot be
# told from rounding, and an agreement of 1 everywhere cannot rank caches, so every
# verdict first checks that its measurements can discriminate.

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab: install, then choose what fits the GPU
    PACKAGE = "looped-kv[book,papers] @ git+https://github.com/looped-kv/looped-kv"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", PACKAGE], check=True)
    from looped_kv import book

    book.colab_setup("ch03")

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from looped_kv import book, make_policy, papers, profiles
from looped_kv.analysis import claims
from looped_kv.analysis import verdicts as vd
from looped_kv.analysis.filtering import (
    filter_kl,
    first_query_attention,
    frozen,
    only_head,
    selection_loop,
    top_k,
)
from looped_kv.analysis.fits import sensitivity_regression
from looped_kv.analysis.planes import (
    arm_grid,
    eq6_check,
    exact_replay,
    first_position_agreement,
    free_memory,
    in_dtype,
    precision_floor,
    record_device,
    region_contrast,
    regression_rows,
    resolved_slope,
    table3_policies,
    workload_batch,
)
from looped_kv.analysis.replay import paper_region
from looped_kv.runtime.memory import policy_bytes
from looped_kv.workloads import data

book.setup()
start = time.perf_counter()
model = book.chapter_model()  # $LOOPED_KV_MODEL, default "tiny"; CUDA when available
run = profiles.for_model(model)
profile = run.ch03  # every size of this chapter
R = model.config.mean_recurrence
cfg = model.config
who = "the tiny model" if book.is_tiny(model) else model.source
print(book.environment(model))

# %% [markdown]
# ## The arms
#
# The texts are evaluation texts of the three workloads (word problems, standard-library
# code and variable chains; on a real checkpoint, GSM8K and MBPP in place of the first
# two), cut to one length. The last positions act as decoded
# tokens: the regression uses the first of them, whose prefix is every position before
# it, and the KL is also recorded at every later decoded position. The two regions and
# the six planes are the paper's, scaled to $R$. Each (region, plane) pair is one arm,
# run on every text in the profile's arm precision (float32, as in the paper's main
# regression).
#
# Memory is planned for a real checkpoint. A float64 replay of the same texts, which
# sets the KL floor below, runs first by a float64 copy that is freed before the float32
# copy is made. A real checkpoint's profile keeps the reference replay's planes in host
# memory, and each arm copies in the planes it reads.

# %%
ids, workload = workload_batch(model, data.WORKLOADS, profile.texts_per_workload,
                               profile.prefix + profile.decoded, source=run.workloads)
where = record_device(model, profile.record_device)
exact = exact_replay(model, ids, R, decoded=profile.decoded,
                     dtype=book.DTYPES[profile.exact_dtype], device=where,
                     chunk=profile.exact_chunk)
model32 = in_dtype(model, book.DTYPES[profile.arm_dtype])
grid = arm_grid(model32, ids, R, decoded=profile.decoded, record_device=where,
                progress=False)  # one reference replay, then every (region, plane) arm
regions = {name: paper_region(name, R) for name in ("shallow", "deep")}
planes = sorted(grid.rows.plane.unique())
assert len(grid.rows) == 2 * len(planes) * len(ids) and (grid.rows["size"] > 0).all()

# %% tags=["remove-input"]
counts = pd.Series(workload).value_counts().reindex(data.WORKLOADS)
book.md(f"{len(ids)} texts (" + ", ".join(f"{n} {w}" for w, n in counts.items())
        + f") of {ids.shape[1]} tokens, the last {profile.decoded} decoded; shallow "
        f"loops {regions['shallow'][0]}-{regions['shallow'][-1]}, deep loops "
        f"{regions['deep'][0]}-{regions['deep'][-1]}, planes "
        f"{', '.join(map(str, planes))}: {len(grid.rows)} rows in {profile.arm_dtype}, "
        f"with the planes kept on {where}.")

# %% [markdown]
# ## The KL floor
#
# A float32 replay resolves KLs only down to the KL its own rounding causes: its KL to
# the float64 replay of the same texts. The floor is the largest such KL over the texts.
# Rows at or below it are counted, as the paper counts its rows at the bf16 floor, and
# they enter the fit at the floor value.

# %%
FLOOR = float(precision_floor(model32, grid.reference, exact=exact).max())
rows = regression_rows(grid, FLOOR)
fit = sensitivity_regression(rows, floor=FLOOR, n_boot=2000, seed=0)  # bootstrap texts
ols = sensitivity_regression(rows, floor=FLOOR)  # the same fit with OLS t-intervals
assert FLOOR > 0 and fit.n_rows == len(rows) and fit.n_at_floor == rows.at_floor.sum()
at_floor = rows.groupby("region").at_floor.mean()
steep = resolved_slope(rows, "deep", FLOOR)  # the deep slope over rows above the floor
identified = claims.identify_sensitivity(rows, FLOOR, n_boot=2000, seed=0)

# %% tags=["remove-input"]
book.md(f"The {profile.arm_dtype} KL floor is {FLOOR:.2g}. {fit.n_at_floor} of "
        f"{fit.n_rows} rows ({fit.frac_at_floor:.0%}) sit at or below it: "
        f"{at_floor['shallow']:.0%} of the shallow rows and {at_floor['deep']:.0%} of "
        "the deep ones.")

# %% [markdown]
# ## The regression beside the paper's
#
# Intervals are 95% percentile intervals of a bootstrap that resamples texts with all
# their arms. The arms of one text are not independent, so OLS intervals, shown for
# comparison, are too narrow. The paper's values are those of its Section 3.1 in
# float32, each over its own texts.
#
# The pooled fit keeps the rows at the floor, as the paper's does, and there they set
# the shallow region's KL to the floor whatever its perturbation. $b$ compares the two
# regions at equal size, so it is identified only by rows above the floor at sizes both
# regions reach; the last rows of the table fit it on those rows alone
# (`claims.identify_sensitivity`), or say why the model does not identify it.

# %%
# RIPE Section 3.1, fp32: (point, low, high); b in natural-log units (exp(b) = e^b)
PAPER_SENSITIVITY = papers.RIPE_SEC_3_1_SENSITIVITY


def interval(point: float, low: float, high: float, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(point)} [{fmt.format(low)}, {fmt.format(high)}]"


def slope(region: str) -> str:
    if at_floor[region] == 1:
        return "every row at the floor"
    return interval(fit.slopes[region].slope, *fit.slopes[region].ci)


ours = {"g (size exponent)": interval(fit.g, *fit.ci_g),
        "b (deep region)": interval(fit.b, *fit.ci_b),
        "exp(b)": interval(fit.exp_b, *fit.ci_exp_b, fmt="{:.3g}"),
        "shallow slope": slope("shallow"), "deep slope": slope("deep"),
        "deep slope, rows above the floor":
            interval(steep.slope, *steep.ci) if steep else "too few rows",
        "g, OLS interval": interval(ols.g, *ols.ci_g),
        "b, OLS interval": interval(ols.b, *ols.ci_b),
        "rows at the KL floor": f"{fit.n_at_floor} / {fit.n_rows}",
        "texts": str(len(ids)),
        "b, identified (rows above the floor, overlapping sizes)":
            interval(identified.fit.b, *identified.fit.ci_b) if identified.identified
            else "not identified on this model",
        "identifying rows": f"{len(identified.rows)} / {fit.n_rows}"}


def paper_column(p: dict) -> dict[str, str]:
    return {"g (size exponent)": interval(*p["g"]),
            "b (deep region)": interval(*p["b"], fmt="{:.1f}"),
            "exp(b)": f"e^{p['b'][0]:g} [e^{p['b'][1]:g}, e^{p['b'][2]:g}]",
            **{f"{region} slope": f"{p[f'{region} slope']:g}"
               for region in ("shallow", "deep") if f"{region} slope" in p},
            "texts": str(p["texts"])}


regression = pd.DataFrame(
    {f"{model.source} (this run)": ours,
     **{f"{n} (RIPE 3.1)": paper_column(p) for n, p in PAPER_SENSITIVITY.items()}})
book.table(regression)

# %% [markdown]
# ## The analogue of Figure 2a-b
#
# Points are arm medians over texts, labelled by the substituted plane; medians below
# the KL floor are drawn on it. Solid lines are the regression,
# $e^{a + b[\text{deep}]}\lVert\delta\rVert^g$, one per region. The dashed line is the
# deep region's slope over the rows above the floor alone, and the dotted line is the
# float32 KL floor.

# %%
medians = grid.medians()
fig, ax = plt.subplots(figsize=book.WIDE)
for (name, group), color in zip(medians.groupby("region", sort=False), ("C0", "C3"),
                                strict=True):
    deep = int(name == "deep")
    ax.plot(group["size"], group.kl.clip(lower=FLOOR), "o", color=color,
            label=f"{name}: loops {regions[name][0]}-{regions[name][-1]}")
    for _, row in group.iterrows():
        ax.annotate(str(int(row.plane)), (row["size"], max(row.kl, FLOOR)),
                    textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
    span = rows.loc[rows.deep == deep, "size"]
    sizes = np.geomspace(span.min(), span.max(), 50)
    ax.plot(sizes, np.exp(fit.a + fit.b * deep) * sizes**fit.g, "-", color=color, lw=1)
if steep:
    span = rows.loc[(rows.deep == 1) & ~rows.at_floor, "size"]
    sizes = np.geomspace(span.min(), span.max(), 50)
    ax.plot(sizes, np.exp(steep.intercept) * sizes**steep.slope, "--", color="C3", lw=1,
            label=f"deep, above the floor: slope {steep.slope:.2f}")
ax.axhline(FLOOR, color="0.5", ls=":", lw=1, label=f"{profile.arm_dtype} KL floor")
ax.set(xscale="log", yscale="log", xlabel="perturbation size $\\|\\delta\\|$",
       ylabel="KL at the first decoded position",
       title=f"Substituted prefix planes ({model.source}, {profile.arm_dtype})")
ax.legend()
plt.show()

# %% [markdown]
# ## Do the deep loops matter more?
#
# Two paired comparisons over texts test the claim. At **matched planes**, each text
# gives the ratio of its deep arms' KL to its shallow arms' KL, the geometric mean over
# the substituted planes. At **equal perturbation size**, each text gives its own $b$,
# the regression above fitted to that text's arms alone. KLs at or below the floor enter
# both at the floor. A region whose KLs sit at the floor has only an upper bound for its
# sensitivity, so both verdicts need the share of each region's KLs above the floor
# that the package's `above_floor` check asks for.

# %%
contrast = region_contrast(grid.rows, FLOOR)
region_resolved = {name: vd.above_floor(grid.rows.kl[grid.rows.region == name], FLOOR,
                                        f"the {name} arms' first-position KLs")
                   for name in ("shallow", "deep")}
resolved = vd.discrimination(*region_resolved.values())
KL_RATIO = dict(minimum=vd.BOOK_MINIMUM["KL ratio"],
                minimum_source="the book's smallest ratio of KLs (RIPE Sec. 5.2's "
                               "pre-registered threshold)")
verdicts = {
    "deep loops more sensitive, matched planes": vd.verdict(
        vd.Claim("substituting the deep loops' prefix K/V costs more KL than the "
                 "shallow loops' with the same plane: deep / shallow",
                 "RIPE Sec. 3.1, Fig. 2a-b", expects="greater", scale="log-ratio",
                 **KL_RATIO),
        contrast.deep, contrast.shallow, discrimination=resolved, units="texts"),
    "deep loops more sensitive, equal size": claims.text_b_verdict(identified),
}
arms = grid.rows.assign(workload=workload[grid.rows.text.to_numpy()],
                        above=grid.rows.kl > FLOOR)
by_workload = arms.pivot_table(index="workload", columns="region", values="above")
by_workload.columns.name = None
by_workload = by_workload.reindex(data.WORKLOADS)[["shallow", "deep"]].add_prefix(
    "above the floor, ")
log_ratio = np.log(contrast.deep / contrast.shallow).groupby(workload[contrast.index])
by_workload["deep / shallow"] = np.exp(log_ratio.mean())
book.table(by_workload, percent=tuple(by_workload.columns[:2]),
           caption="Per workload: the arms' first-position KLs above the floor, and "
                   "the geometric mean of the texts' deep / shallow ratios")

# %% tags=["remove-input"]
hug, rav = PAPER_SENSITIVITY["Huginn-0125"], PAPER_SENSITIVITY["Raven-Llama"]
quadratic = fit.ci_g[0] <= 2 <= fit.ci_g[1]
plane1 = medians[(medians.region == "deep") & (medians.plane == min(planes))].iloc[0]
plane1_ratio = plane1.kl / (np.exp(fit.a + fit.b) * plane1["size"] ** fit.g)
book.md(
    vd.claim_summary(verdicts)
    + f"\n\nOver all rows, those at the floor included, the pooled regression gives "
    f"$e^b$ = {fit.exp_b:.3g} [{fit.ci_exp_b[0]:.3g}, {fit.ci_exp_b[1]:.3g}] "
    f"($b$ = {fit.b:.1f}); with {at_floor['shallow']:.0%} of the shallow rows at the "
    "KL floor, that $b$ says where the floor lies as much as how sensitive the deep "
    "loops are, and it is not to be read against the paper's "
    f"$b$ = {hug['b'][0]:g} (Huginn) and {rav['b'][0]:g} (Raven). "
    + (f"On the {len(identified.rows)} rows that identify it (above the floor, at "
       f"sizes {identified.overlap[0]:.2g} to {identified.overlap[1]:.2g} that both "
       f"regions reach) $b$ = {identified.fit.b:.1f} [{identified.fit.ci_b[0]:.1f}, "
       f"{identified.fit.ci_b[1]:.1f}]. " if identified.identified else
       f"$e^b$ is not identified on this model: {identified.reason}. ")
    + f"The size exponent is $g$ = {fit.g:.2f} [{fit.ci_g[0]:.2f}, {fit.ci_g[1]:.2f}]"
    + (", and its interval contains 2, the second-order term of Eq. (4)." if quadratic
       else ", and its interval excludes 2, the second-order term of Eq. (4); "
       f"the paper's is {hug['g'][0]:g} on Huginn and {rav['g'][0]:g} on Raven.")
    + (f" Over the {steep.n} deep rows above the floor the slope is {steep.slope:.2f} "
       f"[{steep.ci[0]:.2f}, {steep.ci[1]:.2f}], against {hug['deep slope']:g} in "
       "Huginn's deep loops." if steep else
       " Too few deep rows lie above the floor for a slope of their own.")
    + " The paper places its largest substitutions (plane 1) outside the "
    f"small-perturbation regime of Eq. (4); here the deep plane-{min(planes)} median "
    f"KL (the shallowest plane substituted) is {plane1_ratio:.2g} times the fitted "
    "line's value at its size."
)

# %% [markdown]
# ## In bf16: the floor caps the gap
#
# The paper ran the same regression in bf16 (Section 3.1). There the deep coefficient
# is smaller, and a share of the rows sit at the bf16 KL floor, which caps the gap that
# can be measured. RIPE Table 6's batch 9 pre-registered its threshold, a deep
# coefficient of at least 3, in bf16. The same arms run here on a bf16 copy of the
# model, with the explicit float32 softmax of the paper's replay. The bf16 floor is the
# largest KL of the bf16 replay to the float64 one.

# %%
BF16 = "bfloat16"
if profile.arm_dtype == BF16:  # the arms above already ran in bf16
    grid16, FLOOR16 = grid, FLOOR
else:
    model16 = in_dtype(model, book.DTYPES[BF16])
    grid16 = arm_grid(model16, ids, R, decoded=profile.decoded, record_device=where,
                      progress=False)
    FLOOR16 = float(precision_floor(model16, grid16.reference, exact=exact).max())
    del model16
del exact  # the float64 logits
rows16 = regression_rows(grid16, FLOOR16)
fit16 = sensitivity_regression(rows16, floor=FLOOR16, n_boot=2000, seed=0)
identified16 = claims.identify_sensitivity(rows16, FLOOR16, n_boot=2000, seed=0)
verdicts["deep loops more sensitive, equal size, bf16"] = claims.text_b_verdict(
    identified16, claims.DEEP_B_BF16)
if grid16 is not grid:
    del grid16
free_memory(model.device)
ours16 = {"b (deep region), pooled": interval(fit16.b, *fit16.ci_b),
          "b, identified": interval(identified16.fit.b, *identified16.fit.ci_b)
          if identified16.identified else "not identified on this model",
          "rows at the bf16 KL floor": f"{fit16.frac_at_floor:.0%}",
          "bf16 KL floor": f"{FLOOR16:.2g}",
          "b in float32, pooled (above)": interval(fit.b, *fit.ci_b)}
book.table(pd.DataFrame(
    {f"{model.source} (this run)": ours16,
     **{f"{n} (RIPE 3.1)": {
         "b (deep region), pooled": f"{p['b, bf16']:g}",
         "rows at the bf16 KL floor": f"{p['rows at the bf16 floor']:.0%}",
         "b in float32, pooled (above)": f"{p['b'][0]:g}"}
        for n, p in PAPER_SENSITIVITY.items()}}))

# %% tags=["remove-input"]
book.md(
    f"In bf16 the pooled $b$ is {fit16.b:.1f} against {fit.b:.1f} in float32, with "
    f"{fit16.frac_at_floor:.0%} of the rows at the bf16 floor of {FLOOR16:.2g}; the "
    f"paper's $b$ fell from {hug['b'][0]:g} to {hug['b, bf16']:g} on Huginn and from "
    f"{rav['b'][0]:g} to {rav['b, bf16']:g} on Raven, with "
    f"{hug['rows at the bf16 floor']:.0%} and {rav['rows at the bf16 floor']:.0%} of "
    "the rows at the floor. "
    + (f"With {fit16.frac_at_floor:.0%} of the rows at the bf16 floor, the bf16 $b$ "
       "says more about where the floor lies than about the deep loops: the floor caps "
       "the measurable gap, as the paper says of its own bf16 rows."
       if fit16.frac_at_floor > at_floor.mean() else "")
    + "\n\n" + vd.claim_summary({"all texts": verdicts[
        "deep loops more sensitive, equal size, bf16"]}))

# %% [markdown]
# ## Every decoded position
#
# The substitution changes what every query reads from its prefix, so each arm has a KL
# at every decoded position, not only the first. Lines are medians over texts per arm;
# the dotted line is the float32 floor measured at the first decoded position. These
# curves describe; the verdicts use the first decoded position, as the paper does.

# %%
per_position = grid.positions.groupby(["region", "plane", "offset"],
                                      as_index=False).kl.median()
fig, axes = plt.subplots(1, 2, figsize=book.WIDE, sharey=True)
shades = plt.cm.viridis(np.linspace(0, 0.9, len(planes)))
for ax, name in zip(axes, ("shallow", "deep"), strict=True):
    arms = per_position[per_position.region == name].groupby("plane")
    for (plane, group), color in zip(arms, shades, strict=True):
        ax.plot(group.offset, group.kl.clip(lower=FLOOR), color=color,
                label=f"plane {plane}")
    ax.axhline(FLOOR, color="0.5", ls=":", lw=1)
    ax.set(yscale="log", xlabel="decoded position (0 = first)",
           title=f"{name}: loops {regions[name][0]}-{regions[name][-1]}")
axes[0].set_ylabel("median KL")
axes[1].legend(fontsize=7, ncol=2)
plt.show()

# %% tags=["remove-input"]
positions = grid.positions.assign(above=grid.positions.kl > FLOOR)
above = positions.groupby("region").above.mean()
later = positions[positions.offset > 0].groupby(["region", "plane"]).kl.median()
first = positions[positions.offset == 0].groupby(["region", "plane"]).kl.median()
later_over_first = (later["deep"] / first["deep"]).median()
book.md(f"Over all {profile.decoded} decoded positions, {above['deep']:.0%} of the "
        f"deep arms' KLs and {above['shallow']:.0%} of the shallow arms' lie above the "
        "first position's floor. Across the deep arms, the median KL at later "
        f"positions is {later_over_first:.2g} times the one at the first decoded "
        "position (median over planes).")

# %% [markdown]
# ## Eq. (6): predicting the deepest-plane error
#
# Storing only plane $R$ perturbs every loop $r < R$ by $\delta_r = \Delta_r$. Only the
# deep loops count, and the fitted regression predicts
#
# $$ \mathrm{KL}_\text{deep} \approx e^{a+b} S^g, \qquad
#    S^2 = n_\text{core} \sum_{r=25}^{31} \big(\Delta K_r^2 + \Delta V_r^2\big). $$
#
# The regression is the identified one where the model identifies $e^b$ (above), else
# the pooled one. We evaluate it with $S$ from the ripening curve, the $\Delta_r$ of the
# reference replay averaged over layers and texts, and with each text's measured
# perturbation size over the same loops. We compare both with the KL of the
# deepest-plane arm, in which every loop $r < R$ reads plane $R$. The fit never used
# that arm. The premise, that only the deep loops count, is tested in two parts. Per
# text, plane $R$ read by every loop should cost more than plane $R$ read by the shallow
# loops alone (a paired claim); and plane $R$ read by the deep loops alone, the region's
# arm of the grid above, should carry most of that cost (shown beside it). All of it is
# in float32, as in the paper. Eq. (6) itself gets a verdict per text: its measured KL
# against the prediction from its measured size, within the factor of two that the paper
# found (Section 3.2).

# %%
PAPER_EQ6 = papers.RIPE_SEC_3_2_EQ_6  # RIPE Section 3.2, fp32, first decoded position
eq6_fit = identified.fit if identified.identified else fit  # identified where it is
check = eq6_check(model32, grid.reference, eq6_fit, grid)
measured_resolved = vd.above_floor(check.measured, FLOOR, "the deepest-plane arm's KLs")
verdicts["plane R matters past the shallow loops"] = vd.verdict(
    vd.Claim("plane R read by every loop r < R costs more KL than plane R read by the "
             "shallow loops alone: all / shallow", "RIPE Sec. 3.2, Eq. (6)",
             expects="greater", scale="log-ratio", **KL_RATIO),
    np.maximum(check.measured, FLOOR), np.maximum(check.shallow_only, FLOOR),
    units="texts", discrimination=vd.discrimination(measured_resolved, vd.above_floor(
        check.shallow_only, FLOOR, "the shallow plane-R arm's KLs")))
if identified.identified:  # the deep region's line of the identified regression
    deep_line = (identified.fit.a + identified.fit.b, identified.fit.g)
    line_sizes = identified.overlap  # the sizes it was fitted on
    line_note = "the identified regression's deep line, $e^{a+b} S^g$"
elif steep:  # else the deep rows above the floor alone
    deep_line, line_sizes = (steep.intercept, steep.slope), steep.sizes
    line_note = "the line of the deep rows above the floor ($e^b$ is not identified)"
else:
    deep_line, line_sizes, line_note = None, None, "no resolved line"
if deep_line:
    verdicts["Eq. (6) predicts the deepest plane"] = claims.eq6_verdict(
        check, *deep_line, FLOOR, line_sizes)
eq6 = pd.DataFrame({
    f"{model.source} (this run)": {
        "from the ripening curve": check.from_curve,
        "from the measured size": check.from_size,
        "deepest-plane arm, median": check.measured_median,
        "deepest-plane arm, mean": check.measured_mean,
        "plane R in the shallow loops only": check.shallow_only_median,
        "plane R in the deep loops only": check.deep_only_median},
    **{f"{n} (RIPE 3.2)": p for n, p in PAPER_EQ6.items()}})
book.table(eq6.map(lambda kl: None if pd.isna(kl) else f"{kl:.2g}"))

# %% tags=["remove-input"]
hug6 = PAPER_EQ6["Huginn-0125"]
paper_factor = hug6["from the ripening curve"] / hug6["deepest-plane arm, median"]
paper_factor = max(paper_factor, 1 / paper_factor)
extrapolated = bool(line_sizes) and not line_sizes[0] <= check.S_curve <= line_sizes[1]
book.md(
    f"From the ripening curve Eq. (6) predicts {check.from_curve:.2g} at the first "
    f"decoded position, and from the measured perturbation size {check.from_size:.2g}. "
    f"The deepest-plane arm measures {check.measured_median:.2g} (median over texts, "
    f"mean {check.measured_mean:.2g}). "
    + (f"The curve's prediction is off by a factor of {check.factor:.2g}; on Huginn "
       f"the paper's is off by a factor of {paper_factor:.2g}."
       if measured_resolved.passed else
       f"But {measured_resolved.detail}: the deepest plane's error is not resolved "
       f"in {profile.arm_dtype} on this model, so Eq. (6) cannot be checked against "
       "it, as for Raven in the paper. Its prediction "
       + ("lies at or below the floor as well." if check.from_curve <= FLOOR else
          f"is {check.from_curve / FLOOR:.2g} times the floor."))
    + (f" The curve's $S$ = {check.S_curve:.2g} lies outside the sizes the line was "
       f"fitted on ({line_sizes[0]:.2g} to {line_sizes[1]:.2g}), so this prediction "
       "extrapolates the regression beyond its data." if extrapolated else "")
    + "\n\n" + vd.claim_summary(
        {"all texts": verdicts["plane R matters past the shallow loops"]}) + "\n\n"
    + f"Plane $R$ read by the deep loops {regions['deep'][0]}-{regions['deep'][-1]} "
    f"alone costs {check.deep_only_median:.2g} (median), against "
    f"{check.measured_median:.2g} read by every loop and the float floor "
    f"{FLOOR:.2g}: "
    + ("the deep loops carry most of the cost, as Eq. (6) assumes."
       if check.deep_only_median >= check.measured_median / 2 else
       f"on this model most of the cost comes from the loops between the regions "
       f"({regions['shallow'][-1] + 1}-{regions['deep'][0] - 1}), which Eq. (6) does "
       "not count.") + "\n\n"
    + (f"Per text, from its measured size and {line_note}:\n\n"
       + vd.claim_summary({"all texts": verdicts["Eq. (6) predicts the deepest plane"]})
       if deep_line else
       "Neither the regression nor the deep rows above the floor give a line for "
       "Eq. (6), so it gets no verdict on this model.")
)

# %% [markdown]
# ## Positions instead of planes: per-head filtering (Section 5.4)
#
# The paper's starting plan had a second proposal: keep, per head, only the prefix
# positions that a shallow loop attends to. Batch 1 found this attention mostly static
# (sink plus recent tokens). Batch 8 froze a per-head policy from batch 1 and tested it
# on unseen texts, keeping a fixed share of the prefix. It compared the KL at the first
# decoded position with deepest-plane storage's and with top-k, each text's own
# positions of most attention. The printed findings are in the table below.
#
# Here the selection reads the first decoded position's attention over its prefix at the
# paper's shallow loop, scaled to $R$, summed per key/value head. The **per-head**
# policy keeps, for each core layer and head, the positions of most attention averaged
# over other texts (the development split). **Top-k** keeps each text's own positions of
# most attention. Both keep the paper's share of the prefix and apply at every loop of
# the core; prelude and coda read the whole prefix. Four arms run on the texts of the
# regression in float32: the per-head policy, top-k, the per-head policy on
# deepest-plane storage, and the per-head policy selected at the paper's later loop. The
# deepest-plane arm is Eq. (6)'s. Per head, one head is filtered and the others read
# everything. Each claim gets a verdict over texts.

# %%
S54 = papers.RIPE_SEC_5_4
BUDGET = S54["budget"]
early, late = (selection_loop(loop, R) for loop in S54["selection loops"])
calibration_ids, _ = workload_batch(model, data.WORKLOADS, profile.texts_per_workload,
                                    ids.shape[1], split="dev", source=run.workloads)
attention, per_head = {}, {}
for loop in (early, late):
    attention[loop] = first_query_attention(model32, ids, R, loop,
                                            decoded=profile.decoded)
    per_head[loop] = frozen(first_query_attention(
        model32, calibration_ids, R, loop, decoded=profile.decoded), BUDGET, len(ids))
own_top = top_k(attention[early], BUDGET)
reference = grid.reference
filtered = {
    "deepest plane": filter_kl(model32, reference, None, deepest=True),
    "per-head": filter_kl(model32, reference, per_head[early]),
    "top-k": filter_kl(model32, reference, own_top),
    "per-head and deepest plane": filter_kl(model32, reference, per_head[early],
                                            deepest=True),
    "per-head, later loop": filter_kl(model32, reference, per_head[late])}
heads = [(layer, head) for layer in range(cfg.n_core) for head in range(cfg.n_kv_heads)]
heads = heads if len(heads) <= 8 else heads[::-(-len(heads) // 8)]  # at most 8 heads
head_rows = {}
for layer, head in heads:
    a = filter_kl(model32, reference, only_head(per_head[early], layer, head))
    b = filter_kl(model32, reference, only_head(own_top, layer, head))
    head_rows[f"layer {layer}, head {head}"] = {
        "per-head KL, mean": a.mean(), "top-k KL, mean": b.mean(),
        "per-head / top-k": np.exp(np.mean(np.log(np.maximum(a, FLOOR))
                                           - np.log(np.maximum(b, FLOOR))))}
del model32, grid, reference  # the float32 copy and the reference's planes
free_memory(model.device)
filtering = claims.filtering_verdicts(filtered, FLOOR)
verdicts |= {f"Sec. 5.4: {name}": v for name, v in filtering.items()}
kept = int(own_top[0, 0, 0].sum())
paper54 = {"filtering over deepest plane": f"{S54['KL over deepest-plane storage']}",
           "costs add": f"{S54['costs add, ratio']}",
           "per-head over top-k": "{:.2f} [{:.2f}, {:.2f}]".format(
               *S54["per-head over top-k"]),
           "later selection": f"{S54['later selection, cost fraction']}"}
book.table(pd.DataFrame({name: {
    "this model (geometric mean over texts)": v.estimate_text,
    "RIPE Sec. 5.4 (Huginn)": paper54[name]} for name, v in filtering.items()}).T)

# %%
book.table(pd.DataFrame(head_rows).T,
           caption="Per head: only that head filtered, the others read every position")

# %% tags=["remove-input"]
means = {name: float(np.mean(v)) for name, v in filtered.items()}
book.md(
    f"Each arm keeps {kept} of the {ids.shape[1] - profile.decoded} prefix positions "
    f"per head ({BUDGET:.0%}), selected at loop {early} (and at loop {late} for the "
    f"later selection), on {len(ids)} texts; the paper kept {S54['budget']:.0%} on "
    f"{S54['texts']} texts at loops {S54['selection loops'][0]} and "
    f"{S54['selection loops'][1]} of {papers.RIPE_SEC_3_1_REGIONS['deep'][1]}. Mean "
    "KLs at the first decoded position: "
    + ", ".join(f"{name} {kl:.2g}" for name, kl in means.items())
    + f"; the float32 floor is {FLOOR:.2g}. The verdicts compare texts (geometric "
    "means of per-text ratios); the ratio of the mean KLs, which a few texts with a "
    f"large KL dominate, is {means['per-head'] / means['deepest plane']:.3g} for "
    f"filtering over the deepest plane. With {len(heads)} heads the per-head "
    "comparison has one value per head, not an interval over heads: "
    + ", ".join(f"{name} {row['per-head / top-k']:.3g}×"
                for name, row in head_rows.items())
    + f" (the paper: {S54['per-head over top-k'][0]}× for every head, "
    f"[{S54['per-head over top-k'][1]}, {S54['per-head over top-k'][2]:.2f}]).\n\n"
    + vd.claim_summary(filtering))

# %% [markdown]
# ## Equal storage: deep planes against shallow ones (Table 3)
#
# The caches of Table 3 keep deep or shallow core planes: the deepest one or two, a
# plane shared every 8 or every 4 loops, the first 4 or 8 loops. They are compared in
# pairs in which the deep cache stores no more planes than the shallow one. Each is a
# real `PlaneCache` with exact byte accounting. For each text we prefill the prefix,
# everything before the first decoded position, into a cache under the policy, and then
# *step* the first decoded token. Its attention at loop $r$ reads the cached prefix at
# the plane $\pi(r)$ that the policy keeps, and the policy applies only to this step. A
# single pass over prefix and token would let the token read the in-block prefix at its
# own loop, and no policy would apply. This is also how Huginn's reference `compress`
# caches behave during prefill. The prefill computes the same planes under every policy,
# since it reads nothing from its cache, so the package prefills once and copies each
# policy's planes; a test checks that this stores bit for bit what a prefill under the
# policy stores.
#
# The paper's Table 3 measures one thing: the top-1 agreement with the full cache at the
# first decoded position, in bf16 on Huginn. The verdicts here use that metric alone,
# paired per text, and run in the model's own precision (bf16 on a GPU, float32 on a
# CPU). The KL to the full cache is shown as well, to describe differences that top-1
# agreement does not see; it decides nothing. The storage column is per token in bf16,
# as the paper counts it. The texts are more, and shorter, than the arms'.

# %%
PAPER_TABLE3 = {label: agree for label, (_, agree) in papers.RIPE_TABLE_3.items()}
ids3, _ = workload_batch(model, data.WORKLOADS, profile.table3_texts_per_workload,
                         profile.table3_length, source=run.workloads)
policies = table3_policies(R)
agreement = first_position_agreement(model, ids3, policies, chunk=profile.table3_chunk)
full_bytes = policy_bytes(model.config, make_policy("full", R), 1, "bf16")
kb = [policy_bytes(model.config, p, 1, "bf16") for p in policies.values()]
table3 = agreement.table.assign(**{
    "KB/token (bf16)": np.array(kb) / 1e3, "of full": np.array(kb) / full_bytes,
    "Huginn (RIPE Table 3)": [PAPER_TABLE3[label] for label in policies]})
assert (table3["bytes"] == table3["formula bytes"]).all()  # exactly the formula's bytes
assert list(table3.planes) == [len(p.kept) for p in policies.values()]
book.table(table3[["policy", "planes", "KB/token (bf16)", "of full", "agreement",
                   "Huginn (RIPE Table 3)", "KL mean", "KL median"]],
           percent=("of full",))

# %%
PAIRS = [("deepest plane", "first 4 loops"), ("share every 8 loops", "first 4 loops"),
         ("share every 4 loops", "first 8 loops")]
assert all(table3.planes[d] <= table3.planes[s] for d, s in PAIRS)  # deep stores less
for d, s in PAIRS:
    a, b = (agreement.matches[label].astype(float) for label in (d, s))
    verdicts[f"{d} over {s}"] = vd.verdict(
        vd.Claim(f"{d} agrees with the full cache more often than {s}, at no more "
                 "storage: top-1 agreement at the first decoded position",
                 "RIPE Table 3", expects="greater", minimum=vd.BOOK_MINIMUM["share"],
                 minimum_source="the book's smallest effect for a share"),
        a, b, units="texts", discrimination=vd.discrimination(
            vd.below_ceiling(b, 1.0, f"the top-1 agreement of {s}")))

# %% tags=["remove-input"]
rate = table3.agreement
kl_order = [d for d, s in PAIRS if table3["KL mean"][d] < table3["KL mean"][s]]
book.md(
    f"Over {len(ids3)} texts the deepest plane agrees with the full cache at the first "
    f"decoded position in {rate['deepest plane']:.3f} of texts (paper "
    f"{PAPER_TABLE3['deepest plane']}), the two deepest planes in "
    f"{rate['two deepest planes']:.3f} ({PAPER_TABLE3['two deepest planes']}), and the "
    f"first four loops in {rate['first 4 loops']:.3f} "
    f"({PAPER_TABLE3['first 4 loops']}); one text is {1 / len(ids3):.3f} of "
    "agreement.\n\n"
    + vd.claim_summary({f"{d} over {s}": verdicts[f"{d} over {s}"] for d, s in PAIRS})
    + f"\n\nDescriptively, the deep cache has the smaller mean KL to the full cache in "
    f"{len(kl_order)} of {len(PAIRS)} pairs ("
    + "; ".join(f"{d} {table3['KL mean'][d]:.2g} against {s} {table3['KL mean'][s]:.2g}"
                for d, s in PAIRS)
    + ")."
)

# %% [markdown]
# ## On a shallow recurrence
#
# The shallow and deep regions of RIPE Sec. 3.1 and its substituted planes are scaled to
# $R$. On a shallow recurrence each region is one to three loops and the planes lose
# their spacing. The regression still sets a perturbation in the first loops against one
# in the last, so the chapter can show whether late loops are the more sensitive; it
# cannot show how sensitivity grows across a long recurrence, and a region of one loop
# measures one plane, not a stretch of depth.
#
# The depth settings of this chapter at the tiny model's $R$, Parcae's and Ouro's
# (`looped_kv.analysis.shallow`): the loops each names, and how many.

# %%
from looped_kv.analysis.shallow import depth_table

book.table(depth_table("ch03"), caption="loops (how many)")

# %% [markdown]
# ## Verdicts
#
# Every claim of this chapter: the paired estimate over texts (a mean difference, or a
# ratio of geometric means) with its 95% BCa bootstrap interval, its n, the smallest
# effect that counts, and the verdict. An *inconclusive* row says why: an interval that
# crosses no difference or an edge of the no-effect band, or a check that failed (KLs at
# the float floor, agreement at its ceiling, too few texts, an $e^b$ the data do not
# identify).

# %%
book.table(vd.interval_table(verdicts))

# %% tags=["remove-input"]
book.md(vd.tally(verdicts, who, "the paper"))

# %%
print(f"chapter computed in {time.perf_counter() - start:.0f} s")
