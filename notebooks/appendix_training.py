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
# # Training the tiny model
#
# Every chapter runs on a model small enough to execute on a CPU in minutes. Its
# measurements only mean something if its depth matters: if four loops already predict
# what thirty-two do, every shallow draft is accepted and every cache is as good as
# every other. This page records how the shipped model was trained, what was tried on
# the way, and whether it passes the numeric gates that say its depth matters.
#
# The recipe is Huginn-0125's (Geiping et al., 2025), scaled down: sandwich blocks, a
# random initial state, a recurrence count per step drawn from a Poisson-lognormal
# around a mean of 32, truncated backpropagation through the last 8 loops and bfloat16
# matrix products. The data mix adds a third workload to the word problems and code:
# **variable chains** (`looped_kv.workloads.data`), programs of bindings such as
# `c=b; a=7; b=a` whose queried answers take one attention read per hop. Distractor
# trees share the program, every tree's root holds a different digit, so no answer can
# be read off in one step. `python -m looped_kv.tiny.train` retrains it; the command
# prints its progress and resumes with `--resume`.

# %% tags=["remove-cell"]
import subprocess
import sys

if "google.colab" in sys.modules:  # on Colab only: install the package
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "looped-kv[book] @ git+https://github.com/looped-kv/looped-kv"],
                   check=True)

# %%
import json

import matplotlib.pyplot as plt
import pandas as pd

from looped_kv import book
from looped_kv.runtime.loading import TINY_DIR
from looped_kv.tiny.gates import COMMAND, GATES

book.setup()
config = json.loads((TINY_DIR / "config.json").read_text())
recipe = config["training"]
log = json.loads((TINY_DIR / "training_log.json").read_text())

# %% tags=["remove-input"]
keys = ["parameters", "steps", "batch", "seq", "lr", "train_mean_recurrence",
        "backprop_loops", "mix", "curriculum_hold", "curriculum_ramp", "precision",
        "threads", "minutes"]
book.table(pd.Series({k: str(recipe[k]) for k in keys}, name="recipe"))

# %% [markdown]
# ## The run
#
# The chains follow a curriculum: one lookup per query for the first steps, then the
# longest chain grows to its maximum depth. Every few hundred steps the log records the
# answer accuracy on development chains at several loop counts.

# %%
steps = pd.DataFrame([e for e in log if "loss" in e]).set_index("step")
evals = pd.DataFrame({e["step"]: {int(r): v["accuracy"] for r, v in
                                  e["chain_accuracy"].items()}
                      for e in log if "chain_accuracy" in e}).T
fig, (left, right) = plt.subplots(1, 2, figsize=book.COLUMN)
left.plot(steps.index, steps["loss"].rolling(20, min_periods=1).mean())
left.set(xlabel="step", ylabel="training loss (20-step mean)")
for r in evals.columns:
    right.plot(evals.index, evals[r], marker="o", ms=3, label=f"R = {r}")
right.set(xlabel="step", ylabel="chain answer accuracy (dev)")
right.legend(fontsize=7)
plt.show()

# %% tags=["remove-input"]
changes = [e for e in log if "changed" in e]


def change(entry: dict) -> str:
    edits = ", ".join(f"`{k}` {a} → {b}" for k, (a, b) in entry["changed"].items())
    return f"At step {entry['step']} it continued with {edits}."


book.md("The run was resumed after interruptions. "
        + (" ".join(map(change, changes)) if changes else "Its recipe never changed.")
        + f" It took {recipe['minutes']:.0f} minutes of wall-clock time in all.")

# %% [markdown]
# ## Held-out loss and accuracy by loops
#
# Loss on the evaluation split of each workload, and answer accuracy on evaluation
# chains, at loop counts from 1 to 64.

# %%
loss = pd.DataFrame({w: recipe[f"{w}_loss_by_loops"]
                     for w in ("problems", "code", "chains")})
loss.index = loss.index.astype(int)
accuracy = pd.DataFrame(recipe["chain_accuracy_by_loops"]).T
accuracy.index = accuracy.index.astype(int)
fig, (left, right) = plt.subplots(1, 2, figsize=book.COLUMN)
(loss - loss.loc[64]).plot(ax=left, marker="o", ms=3, logx=True)
left.set(xlabel="loops R", ylabel="loss(R) - loss(64), nats")
accuracy.drop(columns="n", errors="ignore").plot(ax=right, marker="o", ms=3, logx=True)
right.set(xlabel="loops R", ylabel="answer accuracy")
right.legend(fontsize=6)
plt.show()

# %% [markdown]
# ## The gates
#
# The gates say in numbers that depth matters on the chain workload: more loops predict
# better, more loops never hurt, the state settles slowly (as Huginn-0125's planes do,
# RIPE Table 7), and shallow drafts are neither always right nor useless. They are
# measured on the evaluation split by the command below and recorded in the model's
# `config.json`; `tests/test_gates.py` recomputes the loss and ripening figures.

# %%
gates = config["gates"]
print(COMMAND)
table = pd.DataFrame([{"gate": g.name, "rule": g.rule,
                       "measured": gates["figures"][g.figure],
                       "passes": gates["passed"][g.name]} for g in GATES])
book.table(table.set_index("gate"), digits=3)

# %% tags=["remove-input"]
failed = table.loc[~table["passes"]]
book.md("The shipped model passes every gate." if failed.empty else
        "The shipped model fails " + "; ".join(
            f"*{row.gate}* (measured {row.measured:.3f}, rule {row.rule})"
            for row in failed.itertuples())
        + ". Training on a 2-core CPU did not reach them; each chapter's "
          "discrimination checks say where this keeps a verdict inconclusive.")

# %% [markdown]
# ## What was tried
#
# Before the shipped run, short runs on the chain workload alone (a few hundred steps
# each, answer accuracy at several loop counts every hundred steps) compared:
#
# * **data**: chains with deep trees from the start, a curriculum from one lookup, and
#   dense one-lookup programs (every variable bound to a digit and queried);
# * **learning rate**: a constant rate against the cosine schedule, at two rates;
# * **mean recurrence**: a small mean (4) against Huginn's 32;
# * **width and depth**: one against two prelude and coda layers.
#
# Two observations shaped the recipe. With deep trees from the start, accuracy stayed at
# chance at every loop count: the model never learned a single lookup, so there was
# nothing for more loops to repeat. Dense one-lookup programs were learned first, so the
# shipped run begins with them and only then grows the chains. At the higher learning
# rate accuracy stayed near chance over the same steps; at the lower one it rose. These
# scouting runs used a scratch script whose settings were not recorded with their logs,
# so their figures are not shown here; the shipped run's log above is complete.
#
# What the shipped run did not reach is in the gates above: it learned single lookups
# and part of the deeper chains, but its answers stop improving after a few loops, so
# more loops buy almost nothing on any workload. Two things were not tried within the
# CPU budget and are the next steps: a run several times longer, and chains whose every
# hop is forced through the recurrence (for example, a loss on intermediate hops at
# fixed loop counts).
