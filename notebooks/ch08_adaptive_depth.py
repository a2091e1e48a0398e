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
# # 8. Adaptive depth: early exits and what they leave in the cache
#
# Every chapter so far ran every token through all $R$ loops. A looped model can also
# stop early, token by token: after loop $r$ a criterion compares what the loop changed
# and, when the change is small enough, the token's readout of its state $s(r)$ chooses
# the next token. Huginn's reference code ships such criteria for "zero-shot adaptive
# compute" (the distance between successive next-token distributions, their entropies,
# successive states, or a stable argmax), and Ouro trains an exit gate.
#
# An exit also decides what the token leaves in the cache. Its planes past its exit loop
# $e$ are never computed, yet a later token at loop $r > e$ reads a plane there. The
# package fills them in one of two ways (`exited_reads`): *last* (freeze-replicate, the
# reference's choice) copies plane $e$ into every deeper slot, and *nearest-below* reads
# the deepest plane at or below $e$ that the cache keeps anyway. Either way a deep query
# of a later token reads keys and values that stopped at loop $e$: the mirror image of
# DAS's Mature-V, where shallow queries read deep values (DAS Sec. 4).
#
# Neither paper measures early exit. RIPE's claim that prefix keys and values matter
# late (Sec. 3.1) and its ripening model (Sec. 3.2) speak to what an exited token's
# frozen planes cost; DAS's maturity ordering (Sec. 3.1: keys mature before values)
# speaks to which of them is less mature at the exit. This chapter therefore gives no
# verdicts: it describes, per exit criterion at the reference code's default threshold
# (and a small sweep for two of them), the loops tokens run, what that costs in answers
# and agreement against full depth, what the exits leave in the cache, and how fast
# decoding gets. Where the tiny model shows what a paper's claim implies, or the
# opposite, the text says so.

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab: install, then choose what fits the GPU
    PACKAGE = "looped-kv[book,papers] @ git+https://github.com/looped-kv/looped-kv"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", PACKAGE], check=True)
    from looped_kv import book

    book.colab_setup("ch08")

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import looped_kv
from looped_kv import book, papers, profiles, workloads
from looped_kv.analysis import adaptive_depth as ad
from looped_kv.analysis.depth import DEPTH_BUCKETS, depth_bucket, encode_chains
from looped_kv.analysis.fits import fit_geometric
from looped_kv.analysis.verdicts import MIN_UNITS
from looped_kv.decoding.exits import CRITERIA
from looped_kv.prose import times
from looped_kv.workloads import data

book.setup()
model = book.chapter_model()
profile = profiles.for_model(model)
P = profile.ch08
cfg, R = model.config, model.config.mean_recurrence
print(book.environment(model))
print(workloads.preflight(model, profile))  # every prompt tokenized, held to the bound

# %% [markdown]
# ## The exit criteria
#
# With $z(r)$ the logits of loop $r$'s readout, $p(r) = \operatorname{softmax} z(r)$
# and $s(r)$ the recurrent state after loop $r$, a token exits after the first loop at
# which its criterion fires, or after loop $R$. The thresholds below are the reference
# code's defaults; the gate runs only on a model that has one (Ouro).

# %%
NAMES = [name for name in CRITERIA
         if name != "fixed" and (name != "gate" or cfg.exit_gate)]
DEFAULTS = {name: CRITERIA[name].default if name != "gate" else cfg.exit_threshold
            for name in NAMES}
criteria = pd.DataFrame({"rule": [CRITERIA[n].meaning for n in NAMES],
                         "reads": [CRITERIA[n].reads for n in NAMES],
                         "default threshold": [DEFAULTS[n] for n in NAMES]},
                        index=pd.Index(NAMES, name="criterion"))
book.table(criteria)

# %% [markdown]
# ## Chain answers at the exit
#
# A chain program binds variables in a chain and asks for the last one: answering a
# query of depth $d$ takes $d$ serial lookups, and the chapters measure depth on them. A
# prompt exits as one block with its last position, so for a prompt that ends with the
# query's cue (`v?`) the answer is the readout at the loop where the criterion fires on
# the cue's position, with the whole program run to that loop. One teacher-forced pass
# of $R$ loops with a readout after every loop gives that loop and that answer for every
# rule at once (`adaptive_depth.teacher_forced_exits`; the tests check it against
# `generate` with early exit). Besides the defaults, the pass scores a sweep of
# thresholds for two criteria and fixed exits, where every token stops at the same loop.

# %%
programs = data.chain_programs(P.chain_programs, split="eval")
chains = encode_chains(model.tokenizer, programs)
buckets = [depth_bucket(int(d)) for d in chains.depths]
rules = {name: (name, None) for name in NAMES}
rules |= {f"{name} {t:g}": (name, t) for name, ts in P.sweep.items() for t in ts
          if t != DEFAULTS[name]}
rules |= {f"fixed {e}": ("fixed", e) for e in P.fixed_loops if e < R}
rules["full depth"] = ("fixed", R)
reads = ad.teacher_forced_exits(model, chains.ids, chains.rows, chains.positions, rules,
                                targets=chains.answers, groups=buckets, planes=True,
                                rows_per_chunk=profile.rows_per_chunk)
summary = ad.exit_summary(reads.table)
by_bucket = ad.exit_summary(reads.table, ("rule", "group"))
present = [b for b in DEPTH_BUCKETS if b in set(buckets)]
accuracy = by_bucket["accuracy"].unstack()[present]
shown = [*NAMES, "full depth"]
columns = ["mean loops", "accuracy", "loss", "agreement"]
chain_table = pd.concat([summary.loc[shown, columns],
                         accuracy.loc[shown].add_prefix("depth ")], axis=1)
book.table(chain_table,
           caption=f"{len(programs)} chain programs: answers at each rule's exit "
                   f"(accuracy, loss in nats, agreement with R = {R})")

# %%
loops_by_bucket = by_bucket["mean loops"].unstack()[present].loc[NAMES]
counts = pd.Series(buckets).value_counts()[present]
queries = pd.DataFrame([counts.to_numpy()], columns=present, index=["queries"])
book.table(pd.concat([loops_by_bucket, queries]),
           caption="Mean exit loop by the query's depth bucket, and the queries in "
                   "each")

# %% tags=["remove-input"]
full = summary.loc["full depth"]
means, hits = summary.loc[NAMES, "mean loops"], summary.loc[NAMES, "accuracy"]
cheapest = means.idxmin()
deepest = present[-1]
spread = {n: loops_by_bucket.loc[n, present[-1]] - loops_by_bucket.loc[n, present[0]]
          for n in NAMES}
book.md(
    f"At full depth the model answers {full['accuracy']:.0%} of the {len(programs)} "
    f"queries (answer loss {full['loss']:.2f} nats). At their default thresholds the "
    f"criteria stop after {means.min():.1f} to {means.max():.1f} loops on average and "
    f"answer {hits.min():.0%} to {hits.max():.0%}; the cheapest, {cheapest}, spends "
    f"{means[cheapest] / R:.0%} of the loops and agrees with full depth on "
    f"{summary.loc[cheapest, 'agreement']:.0%} of the answers. On the shallowest "
    f"queries (depth {present[0]}) every exit answers at least "
    f"{accuracy.loc[NAMES, present[0]].min():.0%}. On the deepest (depth "
    f"{deepest}, {counts[deepest]} queries) the criteria answer "
    f"{accuracy.loc[NAMES, deepest].min():.0%} to "
    f"{accuracy.loc[NAMES, deepest].max():.0%}, against "
    f"{accuracy.loc['full depth', deepest]:.0%} at full depth. "
    + ("Deeper queries run more loops under every criterion"
       if min(spread.values()) > 0 else "Deeper queries do not always run more loops")
    + ": from the shallowest bucket to the deepest the mean exit loop changes by "
    + book.listing(f"{spread[n]:+.1f} ({n})" for n in NAMES)
    + f", with {counts.min()} to {counts.max()} queries per bucket: a description, "
    "not a test.")

# %% [markdown]
# The figure sets each rule's accuracy against the loops it spends. The fixed exits
# trace what a depth shared by every token buys; a criterion above that line spends its
# loops where they pay. The sweeps move one criterion's threshold across two orders of
# magnitude either side of its default (filled marker).

# %%
fig, ax = plt.subplots(figsize=(6.5, 4))
fixed = summary.loc[[f"fixed {e}" for e in P.fixed_loops if e < R] + ["full depth"]]
ax.plot(fixed["mean loops"], fixed["accuracy"], color="grey", marker="s", ms=4, lw=1,
        label="fixed exit (every token)")
for i, (name, thresholds) in enumerate(P.sweep.items()):
    keys = [name if t == DEFAULTS[name] else f"{name} {t:g}" for t in thresholds]
    points = summary.loc[keys]
    ax.plot(points["mean loops"], points["accuracy"], ls="--", lw=1, marker="o", ms=4,
            mfc="white", color=f"C{i}",
            label=f"{name}, thresholds {min(thresholds):g} to {max(thresholds):g}")
for i, name in enumerate(NAMES):
    color = f"C{list(P.sweep).index(name) if name in P.sweep else i + 2}"
    ax.plot(summary.loc[name, "mean loops"], summary.loc[name, "accuracy"], marker="o",
            ms=7, ls="none", color=color, label=f"{name} (default)")
ax.set(xlabel="mean loops per answer", ylabel="answer accuracy",
       title=f"Chain answers against loops spent ({len(programs)} programs, R = {R})",
       xlim=(0, R + 1))
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7.5)
plt.show()

# %% tags=["remove-input"]
frontier = np.interp(means, fixed["mean loops"], fixed["accuracy"])
above = (hits - frontier) * 100
swept = {name: [name if t == DEFAULTS[name] else f"{name} {t:g}" for t in ts]
         for name, ts in P.sweep.items()}
book.md(
    "Against the fixed-exit line at the same mean loops, the defaults answer "
    + book.listing(f"{above[n]:+.1f} points ({n})" for n in NAMES)
    + ": a criterion that gives the queries that need them more loops sits above the "
    "line. Between the sweeps' extremes, "
    + book.listing(
        f"{name} goes from {summary.loc[k[0], 'mean loops']:.1f} loops and "
        f"{summary.loc[k[0], 'accuracy']:.0%} to "
        f"{summary.loc[k[-1], 'mean loops']:.1f} loops and "
        f"{summary.loc[k[-1], 'accuracy']:.0%}" for name, k in swept.items())
    + ".")

# %% [markdown]
# ## What an exit leaves in the cache: chains decoded from the program
#
# Above, the prompt ended at the query's cue, so the position that decided the prompt's
# exit was the answer's own. Decoded from the program alone, the prompt's last position
# predicts the query's variable name, an easy token, and the whole program exits when
# *that* converges. Its planes past that loop are copies of its last one, and every
# later token reads them, the answer included, at whatever depth the answer itself runs.
# This is what RIPE's sensitivity measurement implies should hurt: prefix keys and
# values matter late (RIPE Sec. 3.1), and truncating finished tokens to shallow planes,
# the paper's own starting plan, "is backwards".

# %%
chunks = dict(rows_per_chunk=profile.rows_per_chunk)
decoded = {"greedy": ad.decode_chains(model, programs, **chunks)}
decoded |= {name: ad.decode_chains(model, programs, exit=name, **chunks)
            for name in NAMES}
cache_rows = {}
for name, (out, scored) in decoded.items():
    teacher = summary.loc[name if name != "greedy" else "full depth"]
    cache_rows[name] = {"prompt exit loop": scored["prompt loop"].mean(),
                        "answer exit loop": scored["answer loop"].mean(),
                        "accuracy, decoded": scored["hit"].mean(),
                        "accuracy, cue in the prompt": teacher["accuracy"],
                        "mean loops per token": out.mean_loops if out.row_loops else R}
cache_table = pd.DataFrame(cache_rows).T
book.table(cache_table,
           caption="Chains decoded from the program: the loop at which the prompt "
                   "stopped, the answer's own exit, and its accuracy")

# %% tags=["remove-input"]
c = cache_table.loc[NAMES]
drop = (c["accuracy, cue in the prompt"] - c["accuracy, decoded"]) * 100
book.md(
    "Decoded from the program, the prompt stops after "
    f"{c['prompt exit loop'].min():.1f} to {c['prompt exit loop'].max():.1f} loops on "
    f"average, and the answers fall to {c['accuracy, decoded'].min():.0%} to "
    f"{c['accuracy, decoded'].max():.0%} (greedy at full depth: "
    f"{cache_table.loc['greedy', 'accuracy, decoded']:.0%}): "
    + book.listing(f"{drop[n]:.0f} points ({n})" for n in NAMES)
    + " below the same criterion with the cue in the prompt. The answer's own exit "
    f"comes after {c['answer exit loop'].min():.1f} to "
    f"{c['answer exit loop'].max():.1f} loops. "
    + ("On this model what an exit leaves in the cache costs more than the exit "
       "itself. " if drop.min() > 0 else "")
    + "Shallow prefix planes are what RIPE's claim that prefix keys and values matter "
    "late implies should cost, and no criterion asks whether later tokens will need "
    "the "
    "exiting token's deep planes: each reads only that token's own convergence.")

# %% [markdown]
# ## Text: word problems and code
#
# On the other workloads there is no answer to score, so each criterion's greedy
# continuation of each prompt is compared with full-depth greedy decoding's: the share
# of
# the new tokens before the first difference ("prefix") and the share of positions that
# hold the same token ("same", which counts positions after a divergence too). The
# prompts of a workload decode as one batch; each row exits by its own criterion.

# %%
text_rows, text_loops = {}, {}
for w in ("problems", "code"):
    ids = [t[0] for t in workloads.prompt_ids(model, profile, w,
                                              P.prompts_per_workload)]
    run = dict(max_new_tokens=P.new_tokens, stop_at_eos=False, **chunks)
    greedy = looped_kv.generate(model, ids, **run)
    reference = [r.tolist() for r in greedy.new_rows]
    for name in NAMES:
        out = looped_kv.generate(model, ids, exit=name, **run)
        match = ad.continuation_agreement(reference, [r.tolist() for r in out.new_rows])
        distinct = out.distinct_cache_bytes / out.cache_bytes
        text_rows[(w, name)] = {"mean loops": out.mean_loops,
                                "prefix": match["prefix"].mean(),
                                "same": match["same"].mean(),
                                "distinct cache / full": distinct}
        text_loops.setdefault(name, []).extend(x for row in out.row_loops for x in row)
text_table = pd.DataFrame(text_rows).T.rename_axis(["workload", "criterion"])
book.table(text_table, percent=("prefix", "same", "distinct cache / full"),
           caption=f"{P.prompts_per_workload} prompts per workload, {P.new_tokens} new "
                   "tokens: agreement with full-depth greedy decoding and the distinct "
                   "planes the cache holds")

# %% tags=["remove-input"]
answer_loops = reads.table[reads.table["rule"].isin(NAMES)]
per_criterion = text_table["mean loops"].groupby(level="criterion", sort=False).mean()
t = text_table
book.md(
    "Text tokens exit far earlier than chain answers: on average after "
    + book.listing(f"{per_criterion[n]:.1f} loops ({n})" for n in NAMES)
    + f", against {answer_loops['loop'].mean():.1f} for the chain answers. The "
    f"continuations follow full depth for {t['prefix'].min():.0%} to "
    f"{t['prefix'].max():.0%} of their tokens before the first difference. Since an "
    "exited token's planes past its exit are copies of its last one, the cache holds "
    f"{t['distinct cache / full'].min():.0%} to {t['distinct cache / full'].max():.0%} "
    "of "
    "the full cache's bytes in distinct planes: what an exit could save if the copies "
    "were not stored.")

# %% [markdown]
# The figure shows where tokens exit: the share of tokens per exit loop for each
# criterion, chain answers (teacher-forced, cue in the prompt) on the left, the decoded
# text tokens of both workloads on the right.

# %%
fig, axes = plt.subplots(1, 2, figsize=(6.5, 4), sharey=True)
edges = np.arange(1, R + 1)
for i, name in enumerate(NAMES):
    chain = answer_loops[answer_loops["rule"] == name]["loop"]
    for ax, loops in zip(axes, (chain, text_loops[name]), strict=True):
        share = np.cumsum(ad.loop_shares(list(loops), R))
        ax.step(np.append(edges, R + 1), np.append(share, 1.0), where="post",
                color=f"C{i}", label=name)
for ax, title in zip(axes, ("chain answers", "text tokens, decoded"), strict=True):
    ax.set(xlabel="exit loop", title=title, xlim=(1, R + 1), ylim=(0, 1.02))
    ax.grid(alpha=0.3)
axes[0].set_ylabel("share of tokens exited by this loop")
axes[1].legend(loc="lower right", fontsize=7.5)
plt.show()

# %% [markdown]
# ## Ripeness at the exit (RIPE Sec. 3.2, DAS Sec. 3.1)
#
# RIPE calls a plane ripe when it is close to plane $R$: $\Delta_r = \lVert K^{(r)} -
# K^{(R)} \rVert / \lVert K^{(R)} \rVert$ falls geometrically, $\Delta_r \approx c
# \rho^r$ (Sec. 3.2, Table 7), and likewise for values. A token that exits at loop $e$
# leaves plane $e$ where later deep queries expect plane $R$, so $\Delta_e$ is the
# perturbation its exit puts in the cache, in RIPE's own units. A criterion that fires
# when the token's state has converged is betting that its planes are ripe too. DAS
# Sec. 3.1 finds keys closer to their final depth than values at the first loop; if
# that ordering holds at the exit, the exit leaves the less mature values. The same
# teacher-forced pass recorded every loop's keys and values at the chain answers'
# positions.

# %%
mean_delta = {kind: d.mean(1) for kind, d in reads.delta.items()}
rho = {kind: fit_geometric(np.arange(1, R + 1), delta, R)
       for kind, delta in mean_delta.items()}
ripe_table = summary.loc[[*NAMES, *(f"fixed {e}" for e in P.fixed_loops if e < R)],
                         ["mean loops", "delta k at exit", "delta v at exit"]]
book.table(ripe_table, caption="Mean Δ of the chain answers' keys and values at their "
                               "exit loop (plane e against plane R)")

# %% tags=["remove-input"]
huginn = papers.RIPE_TABLE_7[papers.HUGINN]["rho"]
at_exit = ripe_table.loc[NAMES]
values_later = (ripe_table["delta v at exit"] > ripe_table["delta k at exit"]).mean()
book.md(
    f"On these positions the planes ripen at $\\rho$ = {rho['k'].rho:.2f} per loop for "
    f"keys and {rho['v'].rho:.2f} for values (fitted over loops "
    f"{rho['k'].loop_range[0]} to {rho['k'].loop_range[1]}; half-lives "
    f"{rho['k'].half_life:.1f} and {rho['v'].half_life:.1f} loops), against RIPE's "
    f"{huginn[0]} and {huginn[1]} on Huginn (Table 7). At the default exits the "
    "answers "
    f"leave keys {at_exit['delta k at exit'].min():.2f} to "
    f"{at_exit['delta k at exit'].max():.2f} and values "
    f"{at_exit['delta v at exit'].min():.2f} to {at_exit['delta v at exit'].max():.2f} "
    "away from plane R: a converged next-token distribution or state is not a ripe "
    "plane. Values are further from plane R than keys for "
    f"{values_later:.0%} of the rules in the table, the ordering DAS Sec. 3.1 reports "
    "at "
    "the first loop: an exit freezes values that are less mature than its keys, and "
    "values are the channel DAS found a shallow draft gains most from reading mature "
    "(DAS Table 6).")

# %% [markdown]
# ## Two ways to read an exited token's missing planes
#
# Under the full cache both read policies give plane $e$. They differ under a cache that
# keeps only some planes, such as share($k$), which keeps one plane per group of $k$
# loops ($k, 2k, \dots, R$). *Last* stores a copy of plane $e$ in every kept slot past
# $e$; *nearest-below* reads the kept plane $k \lfloor e / k \rfloor$ and stores nothing
# new. The argmax criterion cannot exit before loop 6 at its default, so every token has
# a kept plane below its exit when $k \le 6$. Word problems and chain programs decode
# with both, against greedy full-depth decoding under the same cache.

# %%
share = dict(cache="share", k=P.share_k, rows_per_chunk=profile.rows_per_chunk)
problem_ids = [t[0] for t in workloads.prompt_ids(model, profile, "problems",
                                                  P.prompts_per_workload)]
run = dict(max_new_tokens=P.new_tokens, stop_at_eos=False, **share)
reference = looped_kv.generate(model, problem_ids, **run)
greedy_chains = ad.decode_chains(model, programs, **share)[1]
policy_rows = {"greedy, no exit": {
    "mean loops": R, "prefix": 1.0, "chain accuracy": greedy_chains["hit"].mean(),
    "cache bytes": reference.cache_bytes,
    "distinct bytes": reference.cache_bytes}}
for reads_policy in ("last", "nearest-below"):
    exits = dict(exit="argmax", exited_reads=reads_policy)
    out = looped_kv.generate(model, problem_ids, **exits, **run)
    scored = ad.decode_chains(model, programs, **exits, **share)[1]
    match = ad.continuation_agreement([r.tolist() for r in reference.new_rows],
                                      [r.tolist() for r in out.new_rows])
    policy_rows[f"argmax, {reads_policy}"] = {
        "mean loops": out.mean_loops, "prefix": match["prefix"].mean(),
        "chain accuracy": scored["hit"].mean(),
        "cache bytes": out.cache_bytes,
        "distinct bytes": out.distinct_cache_bytes}
policy_table = pd.DataFrame(policy_rows).T
book.table(policy_table, percent=("prefix", "chain accuracy"),
           caption=f"share({P.share_k}): word problems (prefix agreement with greedy "
                   "under the same cache, bytes) and chains decoded from the program")

# %% tags=["remove-input"]
last, nearest = (policy_table.loc[f"argmax, {p}"] for p in ("last", "nearest-below"))
greedy_share = policy_table.loc["greedy, no exit"]
book.md(
    f"Under share({P.share_k}) both policies allocate the same slots "
    f"({last['cache bytes'] / 1e6:.2f} MB for the word problems). *Last* fills the "
    "slots "
    "past an exit with copies of plane $e$, a plane the cache would otherwise not "
    "hold; "
    "*nearest-below* fills them with copies of a kept plane. The distinct planes come "
    "to "
    f"{last['distinct bytes'] / last['cache bytes']:.0%} and "
    f"{nearest['distinct bytes'] / nearest['cache bytes']:.0%} of the slots' bytes. "
    "*Last* "
    f"follows greedy decoding for {last['prefix']:.0%} of the word problems' tokens "
    "before "
    f"the first difference, *nearest-below* for {nearest['prefix']:.0%}; on the chains "
    f"they answer {last['chain accuracy']:.0%} and {nearest['chain accuracy']:.0%} "
    f"(greedy under the same cache: {greedy_share['chain accuracy']:.0%}). "
    "Nearest-below reads a plane up to $k - 1$ loops shallower than the token reached, "
    "a larger perturbation by RIPE's ripening; on "
    f"{P.prompts_per_workload} prompts and {len(programs)} programs the difference is "
    "a "
    "description.")

# %% [markdown]
# ## Speed, as an illustration
#
# A few word problems decode alone, greedily at full depth and with each criterion, one
# after the other in the same process. The tiny model on a CPU is dominated by per-loop
# overheads rather than arithmetic, and a criterion that reads logits runs the readout
# after every loop; these numbers illustrate, they do not decide. A speed verdict in
# this book needs 16 prompts timed in interleaved rounds.

# %%
timed = [t[0] for t in workloads.prompt_ids(model, profile, "problems",
                                            P.timing_prompts)]
timing = ad.time_exits(model, timed, {name: {"exit": name} for name in NAMES},
                       P.timing_tokens, repeats=P.timing_repeats)
speed = timing.groupby("rule", sort=False)[["mean loops", "tokens_per_s", "speed-up",
                                            "prefix"]].mean()
book.table(speed, percent=("prefix",),
           caption=f"{P.timing_prompts} word problems decoded alone, {P.timing_tokens} "
                   f"tokens each ({times(P.timing_repeats)})")

# %% tags=["remove-input"]
ratios = speed.drop("greedy")["speed-up"]
fastest = ratios.idxmax()
book.md(
    f"Greedy decoding runs {speed.loc['greedy', 'tokens_per_s']:.0f} tokens/s here; "
    "the "
    f"criteria run at {ratios.min():.2f}x to {ratios.max():.2f}x of that ({fastest} "
    f"fastest, at {speed.loc[fastest, 'mean loops']:.1f} loops per token, "
    f"{speed.loc[fastest, 'mean loops'] / R:.0%} of R). With {P.timing_prompts} "
    "prompts "
    f"timed {times(P.timing_repeats)} this is an illustration; a verdict needs "
    f"{MIN_UNITS['timing']} prompts in interleaved rounds.")

# %% [markdown]
# ## On a shallow recurrence
#
# An exit saves at most $R - 1$ loops of a token, and the fixed exits below $R$ are
# fewer on a shallow recurrence. The chapter can show whether a criterion stops a token
# early and what its exited planes do to the tokens that read them; with few loops, a
# criterion that needs several loops of history (argmax stability, a KL between
# successive loops) has little room left before $R$, so the saving it can show is small.
#
# The depth settings of this chapter at the tiny model's $R$, Parcae's and Ouro's
# (`looped_kv.analysis.shallow`): the loops each names, and how many.

# %%
from looped_kv.analysis.shallow import depth_table

book.table(depth_table("ch08"), caption="loops (how many)")

# %% [markdown]
# ## Summary
#
# Neither the RIPE paper nor the DAS paper measures early exit, so this chapter gives no
# verdict; it describes what the model at hand does.

# %% tags=["remove-input"]
book.md(
    "* At the reference code's default thresholds the criteria spend "
    f"{means.min():.1f} "
    f"to {means.max():.1f} of R = {R} loops on chain answers and answer "
    f"{hits.min():.0%} "
    f"to {hits.max():.0%} of them, against {full['accuracy']:.0%} at full depth.\n"
    f"* Text tokens exit after {t['mean loops'].min():.1f} to "
    f"{t['mean loops'].max():.1f} loops on average, and the continuations follow "
    f"full-depth greedy decoding for {t['prefix'].min():.0%} to "
    f"{t['prefix'].max():.0%} "
    "of their tokens before the first difference.\n"
    "* Decoded from the program, chain prompts stop early and freeze their planes "
    f"there: the answers fall to {c['accuracy, decoded'].min():.0%} to "
    f"{c['accuracy, decoded'].max():.0%}, as RIPE's claim that prefix keys and values "
    "matter late implies.\n"
    f"* At the exit, values are further from plane R than keys for {values_later:.0%} "
    "of the rules, the ordering of DAS Sec. 3.1.\n"
    f"* Decoding alone, the criteria run at {ratios.min():.2f}x to {ratios.max():.2f}x "
    f"of greedy's tokens/s on {P.timing_prompts} prompts: an illustration, not a "
    "verdict.")
