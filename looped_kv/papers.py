"""Every number of the RIPE and DAS papers that this project uses, once, exactly as printed.

The two papers (their text is in ``papers/`` next to the project's design notes):

* RIPE: Lu, Li and Ni, "Prefix Keys and Values Matter Late: RIPE Caching for Self-Speculative Decoding in
  Looped Language Models" (arXiv:2610.34436).
* DAS: Li et al., "Shallow Queries, Mature Values: Depth-Asynchronous Self-Speculation for Looped
  Transformers" (arXiv:2609.34538).

Naming. A constant is named after the paper and the place where its numbers are printed:
``<PAPER>_TABLE_<n>``, ``<PAPER>_FIGURE_<n>`` or ``<PAPER>_SEC_<x>_<y>`` (running text of Section x.y;
appendix sections keep their letter, ``DAS_SEC_C_4``), with a short suffix where a section prints more
than one group (``RIPE_SEC_3_5_MEMORY``). ``<NAME>_COLUMNS`` names the fields of a table's row tuples.
Every constant's comment repeats where it is printed, so a reader can find it in the paper.

Conventions.

* Values are the printed digits: nothing here is computed, converted to more digits or corrected for
  consistency (``looped_kv.analysis.perf`` and ``looped_kv.analysis.fits`` say which printed outputs
  the printed inputs reproduce, and ``tests/test_perf.py`` and ``tests/test_fits.py`` check them).
* Percentages are fractions with the printed digits (6.1% is 0.061), factors printed as "2.24x" are
  plain numbers, an interval printed as "13.8 [2.28, 21.2]" is the tuple (13.8, 2.28, 21.2), and a
  cell printed as "—" is ``None``.
* Caches are named as in ``looped_kv``: "full" (the full cache), "deepest" (the deepest plane); RIPE's
  memory section says "one slot" for one shared core slot. Models are :data:`HUGINN`,
  :data:`RAVEN_LLAMA`, :data:`RAVEN_OLMO` and :data:`RAVEN_TINYLLAMA` in both papers.
* A number printed in several places is held once, in the table or section that reports it with its
  context (a summary such as RIPE Table 1 or the abstract points there); the other places are noted in
  the comments. Two different quantities may share a printed value (RIPE's 2.24x is both Eq. (8)'s
  full-cache speed-up at eta = 1 and the fixed-memory total); each is held where it belongs.
* Tables of results are held whole; a column that repeats another table is held there (RIPE Table 1's
  results, DAS Table 7's Deep K/V columns, DAS Table 13's points). Of the running text and the figure
  captions, the numbers the package, the tests or the chapters use are held, and the sections issue 40
  asked for (RIPE Secs. 5.4 and 5.5) whole; DAS Tables 2, 11 and 12 are not transcribed. RIPE Table 6's
  cells are held as printed with their numbers as fields (:class:`Prediction`), so each number is typed
  once. Architectures (RIPE Sec. 2, DAS Table 3) and the DAS-Wave schedule (DAS Table 5) are
  configurations, not results: they live in ``looped_kv.runtime.config`` and ``looped_kv.decoding.settings``.
* Tiny model. The comment of a table or section added for issue 40 ends with whether the book's tiny model
  can measure it, and on what machine.

``tests/test_papers.py`` fails if one of the distinctive values below is typed as a literal anywhere
else in the package, the tests or the chapters, and checks constants against the papers' text.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

HUGINN = "Huginn-0125"
RAVEN_LLAMA = "Raven-Llama"  # Raven-Llama-3.2 in DAS
RAVEN_OLMO = "Raven-OLMo"  # Raven-OLMo-2 in DAS
RAVEN_TINYLLAMA = "Raven-TinyLlama"


# == RIPE ================================================================================================

# -- Section 2 and Table 1 ---------------------------------------------------------------------------

#: RIPE Sec. 2 (also the Introduction): KV cache per token in bf16, KB = 10^3 bytes, by model and cache
#: ("2,788 vs. 169 KB per token on Huginn (6.1%) and 410 vs. 28.7 KB on Raven (7.0%)"; the fractions
#: are Table 2's).
RIPE_SEC_2_KV_PER_TOKEN: dict[str, dict[str, float]] = {
    HUGINN: {"full": 2788, "deepest": 169},
    RAVEN_LLAMA: {"full": 410, "deepest": 28.7},
}

#: RIPE Table 1, "Result" column: the entries printed nowhere else (the others repeat the sections it
#: cites and are held there).
RIPE_TABLE_1: dict[str, Any] = {
    "KV memory, largest error (GB)": 0.005,  # "<= 0.005 GB (print precision); exact"
    "ripening, max |log err|, bf16": {HUGINN: 0.27, RAVEN_LLAMA: 0.19},  # "bf16 0.27 / 0.19"
    "acceptance, held-out error": 0.06,  # "within 6%"
}

#: RIPE Table 1, the other columns, by model in the printed order: form, "Fitted on", "Checked against" and "Check"
#: (held out, in sample, partly held out, or theory), as printed. The numbers in these cells name data ("batch-6
#: cells", "loops 8-31"); the Result column's numbers are :data:`RIPE_TABLE_1` and the sections it cites: peak memory
#: :data:`RIPE_SEC_3_5_MEMORY`, sensitivity :data:`RIPE_SEC_3_1_SENSITIVITY`, ripening :data:`RIPE_TABLE_7`,
#: deepest-plane error :data:`RIPE_SEC_3_2_EQ_6`, speed-up :data:`RIPE_SEC_3_4_SPEEDUP`.
#: Tiny model: every row but peak memory can be refitted on it on a CPU (KV memory exactly, from the caches' bytes;
#: sensitivity and ripening in chapters 2-3, Eq. (6) and acceptance in chapter 4, Eq. (8) with CPU timings); a CPU
#: process's peak memory is not comparable with WaveFront's GPU emulator.
RIPE_TABLE_1_COLUMNS = ("form", "fitted on", "checked against", "check")
RIPE_TABLE_1_MODELS: dict[str, tuple[str, str, str, str]] = {
    "KV memory": ("Eq. (3), (10)", "architecture only", "26 WaveFront cells; window extras (b. 8)", "held out"),
    "Peak memory": ("cache + o0 + o1 B", "batch-6 cells", "batch-8 cells, other node, B ≤ 256", "held out"),
    "Sensitivity": ("log KL = a + b[deep] + g log ∥δ∥", "region arms (pre-registered)", "second-order theory, g = 2",
                    "theory"),
    "Ripening": ("∆r = cρr ; bf16 adds ∆∞", "fp32 curve, loops 8–31", "fp32 curve; bf16 curve with one more parameter",
                 "in sample"),
    "Deepest-plane error": ("Eq. (6)", "sensitivity + ripening", "deepest-plane cache arm (fp32), not in the fit",
                            "partly held out"),
    "Acceptance": ("τ = (1 − αγ+1 )/(1 − α)", "batch-3 simulation", "batch-8 real decoder", "held out"),
    "Speed-up": ("Eq. (8)", "one factor η, 24 timings", "the same timings, both caches", "in sample"),
}

# -- Section 3.1: sensitivity, Table 3 ---------------------------------------------------------------

#: RIPE Sec. 3.1: the two regions of substituted loops, (first, last) of R = 32.
RIPE_SEC_3_1_REGIONS: dict[str, tuple[int, int]] = {"shallow": (2, 9), "deep": (25, 32)}

#: RIPE Sec. 3.1: the planes p that substitute a region's prefix K/V, of R = 32.
RIPE_SEC_3_1_PLANES: tuple[int, ...] = (1, 4, 8, 16, 24, 32)

#: RIPE Sec. 3.1 (fp32 unless stated): size exponent g and deep-region coefficient b as (point, low, high),
#: printed "g = 2.70 [2.52, 2.87]" and "e15.0 [e14.2, e15.8]" (b in natural-log units); Huginn's region
#: slopes; texts; and, in bf16, the coefficient b and the fraction of rows at the bf16 KL floor.
RIPE_SEC_3_1_SENSITIVITY: dict[str, dict[str, Any]] = {
    HUGINN: {"g": (2.70, 2.52, 2.87), "b": (15.0, 14.2, 15.8), "shallow slope": 2.06, "deep slope": 2.71,
             "texts": 40, "b, bf16": 6.7, "rows at the bf16 floor": 0.23},
    RAVEN_LLAMA: {"g": (1.82, 1.68, 1.97), "b": (12.8, 12.0, 13.7), "texts": 40, "b, bf16": 3.8,
                  "rows at the bf16 floor": 0.21},
}

#: RIPE Table 3 (batch 2, Huginn, AlpacaEval, bf16): equal-storage caches, core planes kept per position
#: and first-decoded-position top-1 agreement with the full cache. Printed row labels add "(compress-s4)",
#: "(s8)" and "(shallow window)"; Sec. 3.1 repeats 0.990 and 0.845.
RIPE_TABLE_3_COLUMNS = ("planes", "agreement")
RIPE_TABLE_3: dict[str, tuple[int, float]] = {
    "deepest plane": (1, 0.990),
    "two deepest planes": (2, 0.995),
    "share every 8 loops": (4, 0.980),
    "first 4 loops": (4, 0.845),
    "share every 4 loops": (8, 0.970),
    "first 8 loops": (8, 0.935),
}

# -- Section 3.2: ripening, Eq. (6), Table 7 -----------------------------------------------------------

#: RIPE Table 7: ripening fits as (keys, values); rho and c from fp32 over loops 8-31, Delta_inf fitted to
#: bf16 with rho and c fixed; the largest |log residual| is printed once per model. Sec. 3.2 repeats rho,
#: the half-lives, the keys' Delta_inf and deep-loop bf16 distances and the residuals.
RIPE_TABLE_7: dict[str, dict[str, Any]] = {
    HUGINN: {"rho": (0.88, 0.87), "half-life (loops)": (5.2, 5.1), "Delta_inf (bf16)": (0.0072, 0.0115),
             "deep-loop Delta, bf16": (0.0116, 0.0192), "deep-loop Delta, fp32": (0.0097, 0.0162),
             "max |log residual|, fp32": 0.28},
    RAVEN_LLAMA: {"rho": (0.81, 0.81), "half-life (loops)": (3.3, 3.3), "Delta_inf (bf16)": (0.0048, 0.0101),
                  "deep-loop Delta, bf16": (0.0047, 0.0098), "deep-loop Delta, fp32": (1.6e-4, 3.7e-4),
                  "max |log residual|, fp32": 0.51},
}

#: RIPE Sec. 3.2, Eq. (6), fp32, first decoded position: the predicted deepest-plane KL (from the ripening
#: curve and from the measured perturbation size) and the measured one (the deepest-plane arm, which the
#: fit did not use), and Huginn's KL with plane R substituted in the shallow loops alone.
RIPE_SEC_3_2_EQ_6: dict[str, dict[str, float]] = {
    HUGINN: {"from the ripening curve": 3.6e-6, "from the measured size": 1.7e-6,
             "deepest-plane arm, median": 3.2e-6, "plane R in the shallow loops only": 2.4e-9},
    RAVEN_LLAMA: {"from the ripening curve": 1.8e-8, "from the measured size": 4.7e-9,
                  "deepest-plane arm, mean": 2.7e-8},
}

#: RIPE Sec. 3.2: how closely Eq. (6) predicted the deepest-plane arm ("The agreement is to within a factor of two,
#: not better"): the band, as a factor, within which a prediction of Eq. (6) agrees with its measurement.
RIPE_SEC_3_2_EQ_6_FACTOR = 2

# -- Sections 3.3-3.5: acceptance, cost, memory and throughput; Tables 8 and 9 -------------------------

#: RIPE Sec. 3.3 (Huginn, GSM8K): the batch-3 simulation (problems, gamma), the largest spread of the
#: acceptance across draft positions by cache, Eq. (7)'s largest error against the simulated tau, and
#: the tokens per verification that batch 8's decoder measured at d = gamma = 4 on 24 and on 12 more
#: problems (Sec. 5.2 repeats 3.34 and 4.47).
RIPE_SEC_3_3_ACCEPTANCE: dict[str, Any] = {
    "problems": 60,
    "gamma": 4,
    "largest spread": {"full": 0.06, "deepest": 0.04},
    "largest tau error": 0.026,
    "tau measured, 24 problems": {"full": 3.34, "deepest": 4.47},
    "tau measured, 12 problems": {"full": 3.61, "deepest": 4.53},
}

#: RIPE Table 9 (batch-3 simulation, Huginn, gamma = 4), by cache and draft depth d: mean conditional
#: acceptance alpha_d, its spread across the four draft positions, blocks, tau by Eq. (7) and simulated.
RIPE_TABLE_9_COLUMNS = ("alpha", "spread", "blocks", "tau model", "tau sim.")
RIPE_TABLE_9: dict[str, dict[int, tuple[float, float, int, float, float]]] = {
    "full": {2: (0.637, 0.041, 2280, 2.46, 2.44), 4: (0.805, 0.062, 1676, 3.40, 3.31),
             8: (0.932, 0.021, 1281, 4.37, 4.34)},
    "deepest": {2: (0.800, 0.041, 1619, 3.36, 3.41), 4: (0.928, 0.008, 1276, 4.33, 4.33),
                8: (0.984, 0.005, 1139, 4.84, 4.85)},
}

#: RIPE Table 9 caption (and Sec. 3.3): the rejection fit 1 - alpha_d = k rho_a^d, as (k, rho_a) by cache.
RIPE_TABLE_9_REJECTION: dict[str, tuple[float, float]] = {"full": (0.62, 0.76), "deepest": (0.42, 0.66)}


def ripe_table_9(column: str) -> dict[str, dict[int, float]]:
    """One column of :data:`RIPE_TABLE_9` (a name of :data:`RIPE_TABLE_9_COLUMNS`), by cache and d."""
    i = RIPE_TABLE_9_COLUMNS.index(column)
    return {cache: {d: row[i] for d, row in rows.items()} for cache, rows in RIPE_TABLE_9.items()}


#: RIPE Sec. 3.4 (Huginn, batch 8, d = gamma = 4): layer passes of a sequential token c(R), Eq. (8)'s
#: speed-ups with eta = 1 and the measured block counts, the measured speed-ups (12 problems; the abstract
#: and Sec. 5.2 repeat them), the eta fitted to 24 per-problem timings, its speed-ups and largest
#: per-problem error, the ratio of the two caches' sequential speeds, and the Figure 5b statements at
#: d = 4: "the full cache peaks at gamma = 5 (1.98x), while the deepest plane still rises at gamma = 8
#: (2.87x)", as (gamma, speed-up).
RIPE_SEC_3_4_SPEEDUP: dict[str, Any] = {
    "layer passes c(R)": 132,
    "model, eta = 1": {"full": 2.24, "deepest": 2.80},
    "measured": {"full": 2.09, "deepest": 2.58},
    "eta": 1.07,
    "model, fitted eta": {"full": 2.08, "deepest": 2.61},
    "largest per-problem error": 0.054,
    "sequential ratio": 1.00,
    "figure 5b, d = 4": {"full": (5, 1.98), "deepest": (8, 2.87)},
}

#: RIPE Sec. 3.5 (Huginn-0125, WaveFront's batched emulator): sequence length, memory budget (GB = 10^9
#: bytes), the fitted overheads o0 + o1 B (o1 by cache), the batch-8 cells held out from the fit and the
#: largest error on them, the largest batch under the budget, and the full cache's GB per sequence.
RIPE_SEC_3_5_MEMORY: dict[str, Any] = {
    "sequence length": 808,
    "budget (GB)": 95,
    "o0 (GB)": 7.2,
    "o1 (GB)": {"full": 0.18, "one slot": 0.15},
    "held-out cells": 9,
    "held-out error": 0.0015,
    "B_max": {"full": 36, "one slot": 302},
    "full cache per sequence (GB)": 2.25,
}

#: RIPE Sec. 3.5 (batch 6; Sec. 5.3 repeats 218 and 487): tokens/s of the best full-cache configuration
#: (draft-then-verify, B = 32), of one shared slot at that batch and at the batch its memory allows.
RIPE_SEC_3_5_FIXED_MEMORY: dict[str, int] = {"best full, B = 32": 218, "shared, B = 32": 365,
                                             "shared, B = 64": 487}

#: RIPE Sec. 3.5: the fixed-memory gain of one shared slot, split into factors (Sec. 5.3 and the
#: abstract repeat the total). "cache only" compares the same scheduler and acceptance at B = 32.
RIPE_SEC_3_5_FACTORS: dict[str, float] = {"same batch": 1.67, "batch": 1.34, "total": 2.24, "cache only": 1.63}


@dataclass(frozen=True)
class Table8Row:
    """One row of RIPE Table 8: a throughput fit T(B) = B / (a + b B) of WaveFront's batched emulator."""

    batch: int  # pre-registered batch (6, or 8 on another node)
    slots: int  # shared core slots (0: the full cache)
    scheduler: str  # "AR", "DtV" (draft-then-verify) or "WaveFront"
    alpha: float | None  # acceptance rate ("—" for AR)
    b_range: tuple[int, int]  # batch sizes B, (smallest, largest)
    cells: int
    t_inf: int  # saturation throughput 1/b, tokens/s
    b_half: int  # half-saturation batch a/b
    residual: float  # largest relative residual


#: RIPE Table 8 (Sec. 3.5 repeats the rows (6, 0, DtV, 0.878) and (6, 1, WaveFront, 0.965)).
RIPE_TABLE_8: tuple[Table8Row, ...] = (
    Table8Row(6, 0, "AR", None, (1, 32), 5, 394, 69, 0.04),
    Table8Row(6, 0, "DtV", 0.878, (1, 32), 5, 449, 33, 0.02),
    Table8Row(6, 0, "DtV", 0.965, (1, 32), 5, 612, 34, 0.03),
    Table8Row(6, 0, "WaveFront", 0.878, (1, 32), 5, 244, 13, 0.03),
    Table8Row(6, 0, "WaveFront", 0.965, (1, 32), 5, 310, 11, 0.06),
    Table8Row(6, 1, "AR", None, (1, 64), 6, 461, 83, 0.04),
    Table8Row(6, 1, "DtV", 0.878, (1, 64), 6, 494, 38, 0.03),
    Table8Row(6, 1, "DtV", 0.965, (1, 64), 6, 656, 39, 0.06),
    Table8Row(6, 1, "WaveFront", 0.878, (1, 64), 6, 535, 30, 0.04),
    Table8Row(6, 1, "WaveFront", 0.965, (1, 64), 6, 689, 27, 0.06),
    Table8Row(6, 4, "AR", None, (1, 64), 6, 395, 69, 0.06),
    Table8Row(6, 4, "DtV", 0.878, (1, 64), 6, 473, 35, 0.08),
    Table8Row(6, 4, "DtV", 0.965, (1, 64), 6, 539, 29, 0.10),
    Table8Row(6, 4, "WaveFront", 0.878, (1, 64), 6, 521, 29, 0.09),
    Table8Row(6, 4, "WaveFront", 0.965, (1, 64), 6, 644, 24, 0.08),
    Table8Row(8, 0, "AR", None, (32, 38), 4, 372, 56, 0.02),
    Table8Row(8, 0, "DtV", 0.878, (32, 38), 4, 380, 18, 0.02),
    Table8Row(8, 0, "DtV", 0.965, (32, 38), 4, 503, 18, 0.02),
    Table8Row(8, 0, "WaveFront", 0.878, (32, 38), 4, 219, 8, 0.00),
    Table8Row(8, 0, "WaveFront", 0.965, (32, 38), 4, 280, 7, 0.00),
    Table8Row(8, 1, "AR", None, (64, 256), 5, 308, 28, 0.02),
    Table8Row(8, 1, "DtV", 0.878, (64, 256), 5, 443, 24, 0.01),
    Table8Row(8, 1, "DtV", 0.965, (64, 256), 5, 555, 20, 0.02),
    Table8Row(8, 1, "WaveFront", 0.878, (64, 256), 5, 483, 18, 0.02),
    Table8Row(8, 1, "WaveFront", 0.965, (64, 256), 5, 605, 14, 0.02),
)


# -- Sections 4 and 5: Tables 2 and 4, Figure 4 --------------------------------------------------------

#: RIPE Table 2: KV memory per sequence at L = 1024 from Eqs. (3) and (10) (bf16, MB = 10^6 bytes) and its
#: fraction of the full cache, by cache. Sec. 4 repeats the W = 64 row.
RIPE_TABLE_2_COLUMNS = ("Huginn-0125 MB", "Huginn-0125 frac.", "Raven-Llama MB", "Raven-Llama frac.")
RIPE_TABLE_2: dict[str, tuple[int, float, int, float]] = {
    "full": (2855, 1.0, 419, 1.0),
    "deepest plane": (173, 0.061, 29, 0.070),
    "two planes": (260, 0.091, 42, 0.100),
    "RIPE, W = 16": (215, 0.075, 35, 0.085),
    "RIPE, W = 64": (341, 0.119, 54, 0.128),
    "RIPE, W = 256": (843, 0.295, 127, 0.302),
}

#: RIPE Table 4 (Huginn-0125, batch 8, bf16 full-cache reference), by cache: tail positions (KL above
#: the tail threshold), largest KL, top-1 flips, and extra MB over the deepest-plane cache at L = 1024
#: (Eq. (10); "—" for the fp32 full cache). Sec. 5.1 repeats the tail counts 9 and 1 and the largest KLs.
RIPE_TABLE_4_COLUMNS = ("tail", "max KL", "flips", "extra MB")
RIPE_TABLE_4: dict[str, tuple[int, float, int, int | None]] = {
    "deepest plane (W = 0)": (9, 5.05, 35, 0),
    "RIPE, W = 16": (5, 0.97, 37, 42),
    "RIPE, W = 64": (1, 0.13, 31, 168),
    "RIPE, W = 256": (0, 0.04, 10, 670),
    "+ 4 sinks": (9, 5.03, 38, 10),
    "two planes (s8)": (9, 5.24, 42, 87),
    "fp32 full cache": (1, 0.23, 32, None),
}

#: RIPE Table 4 caption and rows: prompts, the tail threshold on KL, the sequence length of "Extra", the
#: windows W of its RIPE rows and the sinks of its sink row.
RIPE_TABLE_4_SETUP: dict[str, Any] = {"prompts": 48, "tail KL": 0.1, "length": 1024, "windows": (16, 64, 256),
                                      "sinks": 4}

#: RIPE Sec. 5.1 (Huginn-0125, 48 confirmatory prompts): the fidelity label, the ratio KL(L0 || deepest) /
#: KL(L0 || fp32) [95% interval] of the one bin that exceeds and the range of the other bins' ratios, the
#: median KL of the deepest plane and of fp32 over all positions, how many times higher the deepest
#: plane's mean is, the share of KL carried by the top 1% of positions (deepest plane, fp32), the prompts
#: that hold the tail and the tail positions in one problem, and the tail ratio W = 64 / W = 0 [95%
#: interval] with the reduction it means.
RIPE_SEC_5_1: dict[str, Any] = {
    "fidelity label": "exceeds a precision change",
    "exceeding bin ratio": (13.8, 2.28, 21.2),
    "other bin ratios": (1.6, 3.3),
    "median KL": (6.4e-5, 8.2e-5),
    "mean KL ratio": 5.7,
    "top 1% share of KL": (0.74, 0.21),
    "tail prompts": 4,
    "tail positions in one problem": 5,
    "tail ratio W = 64": (0.11, 0.00, 0.20),
    "tail reduction W = 64": 0.89,
}

#: RIPE Sec. 5.2 (Huginn-0125, batch 8): the block dependence ratio of batched against sequential
#: deepest-plane decoding over the same for the full cache [95% interval], its pre-registered threshold
#: and label, and the batched trajectories equal to the sequential ones (equal, of); and batch 5's reproduction
#: of WaveFront's Huginn speed-ups with its released code, without sharing and with one shared slot (at Table 8's
#: acceptances 0.878 and 0.965).
RIPE_SEC_5_2: dict[str, Any] = {
    "block dependence ratio": (1.37, 1.20, 1.62),
    "block dependence threshold": 2,
    "block dependence label": "indistinguishable from numerics",
    "batched trajectories equal": (28, 32),
    "WaveFront speed-up, batch 5": {"unshared": 2.64, "one slot": 4.14},
}

#: RIPE Sec. 5.3 (fixed-memory throughput; batch 6 is in :data:`RIPE_SEC_3_5_FIXED_MEMORY`): batch 8's best
#: configurations without and with one shared slot as (B, tokens/s), its sharing gain, and the peak memory
#: (GB) that the full cache needs at B = 38.
RIPE_SEC_5_3: dict[str, Any] = {
    "batch 8, best full": (34, 253),
    "batch 8, shared": (256, 572),
    "batch 8, sharing gain": 2.26,
    "peak at B = 38 (GB)": 99.4,
}

#: RIPE Figure 4a caption: positions per model on the same 72 prompts. Figure 4c (KL along the GSM8K problem that
#: holds 5 of Huginn's 9 tail positions, :data:`RIPE_SEC_5_1`) prints no number of its own: Sec. 5.1 reads its peaks
#: per window off :data:`RIPE_TABLE_4` ("W = 16 already cuts the peak to 0.97 and W = 64 to 0.13").
#: Tiny model: Figure 4c can be measured on it on a CPU (teacher-forced replay of one generated text through W = 0,
#: 16, 64, per-position KL against the full cache; ``looped_kv.analysis.ripe`` records it), on the text that holds
#: most of its tail positions.
RIPE_FIGURE_4: dict[str, Any] = {"positions": {HUGINN: 7130, RAVEN_LLAMA: 7647}, "prompts": 72}

#: RIPE Sec. 5.4, per-head position filtering (batch 8, a per-head policy frozen from batch 1): unseen AlpacaEval
#: texts, the budget (fraction of the prefix kept), filtering's KL over deepest-plane storage's, the ratio that says
#: the two costs add, the per-head policy's cost over top-k's for every head [95% interval], the loops at which
#: positions were selected, and the cost of selecting at the later loop as a fraction of the earlier.
#: Tiny model: measurable on it on a CPU (2 heads, one core layer): freeze each head's positions from a shallow loop's
#: attention on some texts, keep 10% of the prefix on unseen ones, and compare the first-decoded-position KL with
#: the deepest plane's and with top-k; with two heads the per-head comparison has two values, not an interval.
RIPE_SEC_5_4: dict[str, Any] = {
    "texts": 64,
    "budget": 0.10,
    "KL over deepest-plane storage": 72,
    "costs add, ratio": 0.88,
    "per-head over top-k": (1.88, 1.65, 2.20),
    "selection loops": (2, 4),
    "later selection, cost fraction": 0.33,
}

#: RIPE Sec. 5.5, reproducibility on GH200: batch 4's same-process bf16 rerun of the full-cache reference (fraction
#: of positions bitwise equal, mean KL, and that KL as a fraction of the bf16-to-fp32 floor, printed "about two
#: thirds"), the cuDNN version batch 6b traced it to, the fraction bitwise equal with cuDNN attention disabled;
#: WaveFront's decoder against its autoregressive baseline (identical texts, of problems; the same with cuDNN
#: disabled or not), and the full cache's batched against sequential decoders in bf16 (equal trajectories, of).
#: Tiny model: the cuDNN finding cannot be measured on a CPU, which has no cuDNN attention; on a CUDA GPU it can
#: (``torch.backends.cuda.enable_cudnn_sdp`` on and off, bf16 reruns compared bitwise). The computation-shape finding
#: can be measured on a CPU: the tiny model's full-cache batched and sequential decoders in bf16.
RIPE_SEC_5_5: dict[str, Any] = {
    "rerun bitwise equal": 0.30,
    "rerun mean KL": 1.6e-4,
    "rerun KL over the bf16-to-fp32 floor": (2, 3),
    "cuDNN version": "9.24",
    "bitwise equal, cuDNN off": 1.0,
    "WaveFront identical texts": (31, 40),
    "batched vs sequential equal, bf16": (20, 32),
}


# -- Appendices A and B: the batches (Table 5) and the prediction ledger (Table 6) -----------------------


class _Printed(string.Formatter):
    """Fills a printed cell: ``{i}`` prints a value as typed, ``{i:%}`` a fraction as percent digits (0.2 as 20)."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec == "%":
            return f"{100 * value:g}"
        return format(value, format_spec) if format_spec else str(value)


@dataclass(frozen=True)
class Prediction:
    """One row of RIPE Table 6: a batch's pre-registered prediction and its outcome.

    ``prediction`` and ``outcome`` are the printed cells with their numbers as fields, filled from ``bounds`` (the
    pre-registered numbers) and ``measured`` (the outcome's, taken from the section that reports them where one does).
    """

    batch: str
    prediction: str
    bounds: tuple[Any, ...]
    outcome: str
    measured: tuple[Any, ...] = ()

    @property
    def printed(self) -> tuple[str, str]:
        """The prediction and outcome cells as printed."""
        return _Printed().format(self.prediction, *self.bounds), _Printed().format(self.outcome, *self.measured)

    @property
    def held(self) -> bool | None:
        """True if the printed outcome says "held", False if "failed", None where it is mixed."""
        return True if self.outcome.startswith("held") else False if self.outcome.startswith("failed") else None


_TAU_SIM = ripe_table_9("tau sim.")
_ACCEPTANCE_D4 = RIPE_SEC_3_3_ACCEPTANCE["tau measured, 24 problems"]

#: RIPE Table 6, all 35 pre-registered predictions and their outcomes, in the printed order. An outcome's numbers
#: come from the section that reports them, except the ones printed only here (batch 1's 0.91, batch 4's 0.5-5%,
#: batch 6's 8/8 with chance 13% and 32, batch 8's 0.94, batch 9's 0.98).
#: Tiny model: a prediction's band applies to the tiny model's own measurement wherever that quantity exists on it
#: (tau and its gain, the deep coefficient b in fp32 and bf16, first-position agreement, tail positions under a
#: window, per-head filtering); the GPU rows (WaveFront, cuDNN, GH200 memory, batched throughput) cannot be measured
#: on a CPU.
RIPE_TABLE_6: tuple[Prediction, ...] = (
    Prediction("1", "coverage rises with r", (), "held"),
    Prediction("1", "head-median coverage at r = {0} in {1}–{2}", (4, 0.6, 0.85), "GSM8K above ({0}), AlpacaEval held",
               (0.91,)),
    Prediction("1", "shallow top-k above the static set by a margin", (),
               "direction held; magnitude too small (“trivial” on GSM8K)"),
    Prediction("2", "deep KV matters at matched size", (), "held (e{0} bf16, e{1} fp32)",
               (RIPE_SEC_3_1_SENSITIVITY[HUGINN]["b, bf16"], RIPE_SEC_3_1_SENSITIVITY[HUGINN]["b"][0])),
    Prediction("2", "compress-s4 first-position agreement ≥ {0}", (0.95,), "held ({0:.3f})",
               (RIPE_TABLE_3["deepest plane"][1],)),
    Prediction("3", "deepest-plane cache indistinguishable from a precision change", (),
               "failed (“exceeds”, via the tail)"),
    Prediction("3", "deepest-plane cache raises acceptance", (), "held ({0}→{1} at d = {2})",
               (_TAU_SIM["full"][4], _TAU_SIM["deepest"][4], 4)),
    Prediction("4", "reference asymmetry changes the ratio by > {0:%}%", (0.10,), "failed ({0:%}–{1:%}%)",
               (0.005, 0.05)),
    Prediction("4", "confirmatory set “intermediate”", (), "failed (“exceeds”, one prompt)"),
    Prediction("4", "bf16 reruns bitwise identical", (), "failed ({0:%}% of positions)",
               (RIPE_SEC_5_5["rerun bitwise equal"],)),
    Prediction("5", "speed-up {0}–{1}× unshared, {2}–{3}× shared", (2, 3, 3.5, 5), "held ({0}×, {1}×)",
               tuple(RIPE_SEC_5_2["WaveFront speed-up, batch 5"].values())),
    Prediction("5", "WaveFront token-lossless (match ≥ {0})", (0.99,), "failed ({0}/{1} texts identical)",
               RIPE_SEC_5_5["WaveFront identical texts"]),
    Prediction("6", "bf16 rerun noise is real", (), "held"),
    Prediction("6", "deterministic mode removes it", (), "failed"),
    Prediction("6", "WaveFront still not lossless in deterministic mode", (),
               "failed by rule ({0}/{1}; chance ≈{2:%}%)", (8, 8, 0.13)),
    Prediction("6", "speed-up falls with batch size", (), "held"),
    Prediction("6", "shared ≥ {0}× best lossless at {1} GB", (1.5, RIPE_SEC_3_5_MEMORY["budget (GB)"]), "held ({0}×)",
               (RIPE_SEC_3_5_FACTORS["total"],)),
    Prediction("6", "unshared runs out of memory between batch {0} and {1}", (24, 32), "failed ({0} fits)", (32,)),
    Prediction("6b", "source is cuDNN attention", (), "held"),
    Prediction("7", "reruns reproducible with cuDNN off", (), "held"),
    Prediction("7", "ratios rise to {0}–{1} with cuDNN off", (2.5, 4), "failed (unchanged)"),
    Prediction("7", "WaveFront {0}/{1} with cuDNN off", (40, 40), "failed ({0}/{1}, {0}/{1})",
               RIPE_SEC_5_5["WaveFront identical texts"]),
    Prediction("8", "batched deepest-plane verification \u0338= sequential (ratio {0}–{1})", (3, 30),
               "failed ({0}, numerics)", (RIPE_SEC_5_2["block dependence ratio"][0],)),
    Prediction("8", "batched verification closer to the full cache", (), "failed ({0})", (0.94,)),
    Prediction("8", "tokens per verification {0}–{1} (full), + ≥ {2} (shared)", (3.0, 3.6, 0.5), "held ({0}, {1})",
               (_ACCEPTANCE_D4["full"], _ACCEPTANCE_D4["deepest"])),
    Prediction("8", "speed-up {0}–{1}× (full), {2}–{3}× (shared)", (1.5, 2.3, 2.0, 3.0), "held ({0}, {1})",
               tuple(RIPE_SEC_3_4_SPEEDUP["measured"].values())),
    Prediction("8", "window {0} removes most tail positions", (RIPE_TABLE_4_SETUP["windows"][1],), "held ({0:%}%)",
               (RIPE_SEC_5_1["tail reduction W = 64"],)),
    Prediction("8", "two planes remove {0:%}–{1:%}%", (0.2, 0.5), "failed (none)"),
    Prediction("8", "per-head ≈ all top-k", (), "failed ({0}× worse)", (RIPE_SEC_5_4["per-head over top-k"][0],)),
    Prediction("8", "filtering costs > {0}× sharing; costs add", (3,), "held ({0}, {1})",
               (RIPE_SEC_5_4["KL over deepest-plane storage"], RIPE_SEC_5_4["costs add, ratio"])),
    Prediction("8", "unshared OOM at batch {0}", (38,), "failed (fits)"),
    Prediction("8", "shared/lossless ratio {0}–{1}", (2.4, 2.8), "failed ({0})",
               (RIPE_SEC_5_3["batch 8, sharing gain"],)),
    Prediction("9", "Raven: deep KV matters, deep coefficient ≥ {0} (bf16)", (3,), "held ({0})",
               (RIPE_SEC_3_1_SENSITIVITY[RAVEN_LLAMA]["b, bf16"],)),
    Prediction("9", "Raven: deepest-plane first-position agreement ≥ {0}", (0.95,), "held ({0})", (0.98,)),
    Prediction("9", "Raven: deepest plane “exceeds”, more than on Huginn", (), "failed (indistinguishable, no tail)"),
)


def ripe_table_6(batch: str, prediction: str) -> Prediction:
    """The row of :data:`RIPE_TABLE_6` of ``batch`` whose prediction template starts with ``prediction``."""
    rows = [row for row in RIPE_TABLE_6 if row.batch == batch and row.prediction.startswith(prediction)]
    if len(rows) != 1:
        raise ValueError(f"{len(rows)} rows of RIPE Table 6 in batch {batch!r} start with {prediction!r}")
    return rows[0]


#: RIPE Table 6: the pre-registered thresholds that the book takes as the smallest effects of their claims, read off
#: the ledger's rows: batch 8's "+ ≥ 0.5 (shared)", batch 6's "shared ≥ 1.5×", batch 9's "deep coefficient ≥ 3 (bf16)"
#: and batch 4's "> 10%". The block dependence threshold of batch 8 is :data:`RIPE_SEC_5_2`'s.
RIPE_TABLE_6_THRESHOLDS: dict[str, float] = {
    "tau gain of the deepest plane": ripe_table_6("8", "tokens per verification").bounds[2],
    "fixed-memory gain of one shared slot": ripe_table_6("6", "shared ≥").bounds[0],
    "deep coefficient b": ripe_table_6("9", "Raven: deep KV matters").bounds[0],
    "reference asymmetry": ripe_table_6("4", "reference asymmetry").bounds[0],
}

#: RIPE Table 5: the nine pre-registered batches (one GH200 each) by batch, as (question, pre-registered label), as
#: printed. Batch 6's label repeats :data:`RIPE_TABLE_6_THRESHOLDS`' 1.5x.
#: Tiny model: nothing to measure; the table says which batch backs which section, and the chapters run the questions
#: of batches 2-4, 8 and 9 on the tiny model (batches 1, 5-7 need attention statistics at scale, WaveFront or a GPU).
RIPE_TABLE_5: dict[str, tuple[str, str]] = {
    "1": ("cross-depth attention affinity", "GSM8K trivial; AlpacaEval intermediate"),
    "2": ("which loops’ prefix KV matter (Huginn)", "deep KV matters"),
    "3": ("deepest plane in generation; acceptance", "exceeds precision change"),
    "4": ("reference asymmetry; confirmation; tail", "asymmetry negligible; exceeds"),
    "5": ("WaveFront baseline", "speed-ups in band"),
    "6, 6b": ("reproducibility; fixed-memory frontier",
              f"cuDNN is the source; shared ≥ {RIPE_TABLE_6_THRESHOLDS['fixed-memory gain of one shared slot']}×"),
    "7": ("batches 3–5 with cuDNN off", "reproducible; unchanged"),
    "8": ("batched verification; windows; per-head filtering; frontier",
          "as numerics; window removes most; per-head worse"),
    "9": ("Raven-Llama: region test; deepest plane vs. fp32", "deep KV matters; indistinguishable"),
}


# == DAS =================================================================================================

#: DAS Sec. 3.1 and Figure 2 (top): mean cosine similarity of the first recurrence's queries, keys and
#: values to the final recurrence's (R = 32), averaged over core layers ("0.79/0.84/0.57 for Q/K/V on
#: Huginn"). The agreements that Sec. 3.1 quotes in percent are :data:`DAS_TABLE_6`'s d = 1 column.
DAS_SEC_3_1_COSINE: dict[str, dict[str, float]] = {
    HUGINN: {"q": 0.79, "k": 0.84, "v": 0.57},
    RAVEN_LLAMA: {"q": 0.96, "k": 0.97, "v": 0.79},
}

#: DAS Table 3: the evaluated checkpoints' (prelude, shared core, coda) layers and recurrences R.
#: Tiny model: an architecture, not a measurement; the tiny model cannot stand in for a checkpoint. Every row is a
#: preset of ``looped_kv.runtime.config`` (Raven-TinyLlama's is :func:`~looped_kv.runtime.config.raven_tinyllama`,
#: whose KV bytes follow from RIPE Eq. (3)); a GPU run loads the checkpoint itself.
DAS_TABLE_3: dict[str, tuple[int, int, int, int]] = {
    HUGINN: (2, 4, 2, 32), RAVEN_LLAMA: (4, 6, 4, 32), RAVEN_OLMO: (4, 6, 4, 32), RAVEN_TINYLLAMA: (4, 8, 4, 32),
}

#: DAS Table 4 (Appendix A.1): generation cap (new tokens) and prompt convention by task, as printed.
#: Tiny model: the real tasks' conventions (``looped_kv.workloads.formats`` formats GSM8K and MBPP this way for the
#: checkpoints); the tiny model decodes generated workloads with caps of their own, so only their ratio to the
#: answers' length carries over.
DAS_TABLE_4: dict[str, tuple[int, str]] = {
    "GSM8K": (512, "Eight-shot chain of thought"), "MATH-500": (1024, "Four-shot worked solutions"),
    "HumanEval": (512, "Code completion"), "MBPP": (512, "Code completion"),
}

#: DAS Table 1: end-to-end decoding, by model, method and task: (mean throughput speed-up over paired
#: full-depth AR, accepted length A). Secs. 4.2-4.3, the abstract and Table 13 repeat some cells.
DAS_TABLE_1_TASKS = ("GSM8K", "MATH-500", "HumanEval", "MBPP")
DAS_TABLE_1: dict[str, dict[str, dict[str, tuple[float, float]]]] = {
    HUGINN: {
        "Lookahead": {"GSM8K": (1.83, 1.1), "MATH-500": (1.84, 1.0), "HumanEval": (1.50, 0.6), "MBPP": (1.40, 0.5)},
        "PLD": {"GSM8K": (1.54, 0.7), "MATH-500": (1.93, 1.2), "HumanEval": (1.61, 0.8), "MBPP": (1.35, 0.5)},
        "Token Recycling": {"GSM8K": (2.81, 2.1), "MATH-500": (2.81, 2.1),
                            "HumanEval": (2.74, 2.1), "MBPP": (2.56, 1.8)},
        "SAM-Decoding": {"GSM8K": (1.63, 0.9), "MATH-500": (2.50, 1.9), "HumanEval": (2.01, 1.3), "MBPP": (1.49, 0.6)},
        "Self-speculative": {"GSM8K": (1.70, 5.2), "MATH-500": (1.82, 5.7),
                             "HumanEval": (1.64, 4.6), "MBPP": (1.79, 5.0)},
        "Mature-Spec": {"GSM8K": (2.26, 4.9), "MATH-500": (2.41, 5.4), "HumanEval": (2.35, 4.8), "MBPP": (2.31, 4.6)},
        "DAS-Wave": {"GSM8K": (4.12, 15.6), "MATH-500": (4.64, 17.3), "HumanEval": (4.00, 14.9), "MBPP": (4.20, 15.5)},
    },
    RAVEN_LLAMA: {
        "Lookahead": {"GSM8K": (1.69, 1.1), "MATH-500": (1.56, 0.8), "HumanEval": (1.40, 0.6), "MBPP": (1.46, 0.7)},
        "PLD": {"GSM8K": (1.34, 0.5), "MATH-500": (2.14, 1.4), "HumanEval": (1.64, 0.8), "MBPP": (2.10, 1.4)},
        "Token Recycling": {"GSM8K": (2.59, 2.0), "MATH-500": (2.51, 1.9),
                            "HumanEval": (2.42, 1.8), "MBPP": (2.49, 1.9)},
        "SAM-Decoding": {"GSM8K": (1.53, 0.7), "MATH-500": (2.34, 1.7), "HumanEval": (1.73, 0.9), "MBPP": (2.43, 1.7)},
        "Self-speculative": {"GSM8K": (3.12, 11.4), "MATH-500": (3.19, 11.8),
                             "HumanEval": (3.07, 10.8), "MBPP": (3.53, 12.6)},
        "Mature-Spec": {"GSM8K": (3.50, 13.1), "MATH-500": (3.70, 14.0),
                        "HumanEval": (3.44, 13.1), "MBPP": (3.84, 14.7)},
        "DAS-Wave": {"GSM8K": (5.36, 17.0), "MATH-500": (6.01, 18.9), "HumanEval": (5.21, 16.3), "MBPP": (6.28, 19.7)},
    },
    RAVEN_OLMO: {
        "Lookahead": {"GSM8K": (1.87, 1.0), "MATH-500": (1.70, 0.8), "HumanEval": (1.33, 0.4), "MBPP": (1.84, 1.0)},
        "PLD": {"GSM8K": (1.44, 0.6), "MATH-500": (2.19, 1.4), "HumanEval": (1.58, 0.8), "MBPP": (2.09, 1.3)},
        "Token Recycling": {"GSM8K": (2.80, 2.0), "MATH-500": (2.79, 2.0),
                            "HumanEval": (2.40, 1.6), "MBPP": (3.19, 2.5)},
        "SAM-Decoding": {"GSM8K": (1.65, 0.8), "MATH-500": (1.72, 0.9), "HumanEval": (2.12, 1.5), "MBPP": (1.94, 1.3)},
        "Self-speculative": {"GSM8K": (3.31, 12.2), "MATH-500": (3.30, 12.1),
                             "HumanEval": (2.82, 9.6), "MBPP": (3.60, 12.7)},
        "Mature-Spec": {"GSM8K": (3.63, 13.5), "MATH-500": (3.73, 13.8),
                        "HumanEval": (3.26, 12.1), "MBPP": (3.90, 14.8)},
        "DAS-Wave": {"GSM8K": (5.54, 17.3), "MATH-500": (5.96, 18.1), "HumanEval": (4.82, 14.6), "MBPP": (6.34, 19.4)},
    },
    RAVEN_TINYLLAMA: {
        "Lookahead": {"GSM8K": (1.92, 1.2), "MATH-500": (1.47, 0.7), "HumanEval": (1.52, 0.7), "MBPP": (1.62, 0.9)},
        "PLD": {"GSM8K": (1.95, 1.2), "MATH-500": (1.47, 0.6), "HumanEval": (2.64, 2.0), "MBPP": (2.18, 1.4)},
        "Token Recycling": {"GSM8K": (2.78, 2.3), "MATH-500": (2.48, 1.9),
                            "HumanEval": (2.45, 1.9), "MBPP": (2.56, 2.0)},
        "SAM-Decoding": {"GSM8K": (1.88, 1.1), "MATH-500": (1.75, 1.0), "HumanEval": (2.78, 2.2), "MBPP": (2.45, 1.8)},
        "Self-speculative": {"GSM8K": (3.44, 12.1), "MATH-500": (3.42, 12.1),
                             "HumanEval": (3.26, 10.8), "MBPP": (3.72, 12.5)},
        "Mature-Spec": {"GSM8K": (3.78, 13.6), "MATH-500": (3.77, 13.6),
                        "HumanEval": (3.63, 12.9), "MBPP": (4.04, 14.5)},
        "DAS-Wave": {"GSM8K": (6.34, 18.1), "MATH-500": (6.39, 18.0), "HumanEval": (6.02, 17.0), "MBPP": (6.96, 19.6)},
    },
}

#: DAS Table 6 (Appendix C.1): draft-target token agreement under prefix-channel substitution, by model and
#: prefix policy, at draft depths :data:`DAS_TABLE_6_DEPTHS`.
DAS_TABLE_6_DEPTHS = (1, 2, 4, 8)
DAS_TABLE_6: dict[str, dict[str, tuple[float, float, float, float]]] = {
    HUGINN: {
        "Aligned": (0.4722, 0.6362, 0.7937, 0.9127),
        "Deep V": (0.6693, 0.7659, 0.8955, 0.9484),
        "Deep K": (0.4683, 0.6045, 0.8016, 0.8968),
        "Deep K/V": (0.6005, 0.7937, 0.8995, 0.9669),
    },
    RAVEN_LLAMA: {
        "Aligned": (0.8399, 0.9034, 0.9590, 0.9841),
        "Deep V": (0.8796, 0.9471, 0.9841, 0.9947),
        "Deep K": (0.8585, 0.9114, 0.9656, 0.9881),
        "Deep K/V": (0.9021, 0.9524, 0.9881, 0.9947),
    },
    RAVEN_OLMO: {
        "Aligned": (0.8981, 0.9352, 0.9683, 0.9854),
        "Deep V": (0.9325, 0.9577, 0.9815, 0.9907),
        "Deep K": (0.8849, 0.9431, 0.9788, 0.9907),
        "Deep K/V": (0.9312, 0.9656, 0.9868, 0.9947),
    },
    RAVEN_TINYLLAMA: {
        "Aligned": (0.8836, 0.9272, 0.9643, 0.9894),
        "Deep V": (0.9246, 0.9669, 0.9894, 0.9934),
        "Deep K": (0.8862, 0.9312, 0.9616, 0.9947),
        "Deep K/V": (0.9167, 0.9590, 0.9868, 0.9974),
    },
}

#: DAS Table 7 (Appendix C.2): sequential Mature-Spec with Deep V prefix reads on the Raven checkpoints, by model and
#: task: (mean speed-up, 95% low, high, accepted length A). The table's Deep K/V columns repeat the Mature-Spec rows
#: of :data:`DAS_TABLE_1` (A) and :data:`DAS_TABLE_13` (speed-up [95% CI]), held there.
#: Tiny model: measurable on a CPU (sequential self-speculation with Deep V and with Deep K/V reads, paired with AR);
#: CPU timings give speed-ups of their own, the comparison of the two policies is what carries over.
DAS_TABLE_7_COLUMNS = ("speed-up", "low", "high", "A")
DAS_TABLE_7: dict[str, dict[str, tuple[float, float, float, float]]] = {
    RAVEN_LLAMA: {"GSM8K": (3.39, 3.25, 3.51, 12.6), "MATH-500": (3.54, 3.36, 3.70, 13.4),
                  "HumanEval": (3.34, 3.12, 3.53, 12.0), "MBPP": (3.72, 3.62, 3.81, 13.3)},
    RAVEN_OLMO: {"GSM8K": (3.50, 3.36, 3.64, 13.0), "MATH-500": (3.55, 3.40, 3.69, 13.1),
                 "HumanEval": (3.11, 2.87, 3.34, 10.9), "MBPP": (3.77, 3.67, 3.87, 13.4)},
    RAVEN_TINYLLAMA: {"GSM8K": (3.66, 3.51, 3.79, 13.1), "MATH-500": (3.68, 3.55, 3.80, 13.1),
                      "HumanEval": (3.47, 3.24, 3.70, 11.6), "MBPP": (3.94, 3.85, 4.02, 13.3)},
}

#: DAS Table 8 (Appendix C.3): fixed-setting component speed-ups (mean, 95% low, high) by model, (procedure, prefix
#: policy) and task (GSM8K, MATH-500), measured in their own paired timing sessions; the points are Table 2's
#: speed-ups (Sec. 4.3 quotes some). Sequential rows draft at depth 4; parallel + carry with Deep K/V is DAS-Wave.
#: Tiny model: measurable on a CPU (chapter 6's carry/K/V factorial decodes these seven configurations), with CPU
#: timings.
DAS_TABLE_8_TASKS = ("GSM8K", "MATH-500")
DAS_TABLE_8: dict[str, dict[tuple[str, str], tuple[tuple[float, float, float], tuple[float, float, float]]]] = {
    HUGINN: {
        ("Sequential", "Aligned"): ((1.54, 1.46, 1.63), (1.85, 1.69, 2.03)),
        ("Sequential", "Deep K/V"): ((2.26, 2.16, 2.36), (2.42, 2.28, 2.56)),
        ("Parallel, no carry", "Aligned"): ((0.65, 0.62, 0.68), (1.16, 0.93, 1.45)),
        ("Parallel, no carry", "Deep K/V"): ((0.93, 0.89, 0.97), (1.06, 0.98, 1.15)),
        ("Parallel + carry", "Aligned"): ((0.71, 0.68, 0.75), (1.20, 1.00, 1.45)),
        ("Parallel + carry", "Deep V"): ((1.07, 1.02, 1.14), (1.66, 1.43, 1.94)),
        ("Parallel + carry", "Deep K/V"): ((4.11, 3.90, 4.32), (4.63, 4.33, 4.94)),
    },
    RAVEN_LLAMA: {
        ("Sequential", "Aligned"): ((3.12, 2.96, 3.28), (3.18, 3.00, 3.35)),
        ("Sequential", "Deep K/V"): ((3.50, 3.38, 3.63), (3.67, 3.52, 3.81)),
        ("Parallel, no carry", "Aligned"): ((2.13, 1.94, 2.34), (2.97, 2.57, 3.39)),
        ("Parallel, no carry", "Deep K/V"): ((2.64, 2.44, 2.87), (3.34, 2.93, 3.75)),
        ("Parallel + carry", "Aligned"): ((2.66, 2.42, 2.92), (3.16, 2.79, 3.55)),
        ("Parallel + carry", "Deep V"): ((3.52, 3.26, 3.78), (4.52, 4.16, 4.88)),
        ("Parallel + carry", "Deep K/V"): ((5.40, 5.14, 5.66), (5.99, 5.70, 6.29)),
    },
}

#: DAS Table 9 (Appendix C.4): committed generation progress G by model and task, one value per cell of
#: :data:`DAS_TABLE_9_CELLS` (carry, deep K, deep V), in the table's row order. The table's task headers
#: are "GSM" and "MATH".
DAS_TABLE_9_CELLS: tuple[tuple[int, int, int], ...] = ((0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                                       (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1))
DAS_TABLE_9: dict[str, dict[str, tuple[float, ...]]] = {
    HUGINN: {
        "GSM8K": (2.38, 3.14, 2.11, 3.42, 2.61, 3.99, 3.26, 16.60),
        "MATH-500": (4.37, 4.81, 2.69, 3.95, 4.51, 6.25, 4.71, 18.30),
    },
    RAVEN_LLAMA: {
        "GSM8K": (6.78, 7.98, 6.63, 8.50, 8.60, 11.45, 9.60, 17.97),
        "MATH-500": (9.59, 10.46, 9.04, 10.84, 10.28, 14.84, 11.06, 19.88),
    },
    RAVEN_OLMO: {
        "GSM8K": (7.73, 9.57, 8.04, 9.50, 9.52, 13.19, 10.39, 18.26),
        "MATH-500": (8.33, 10.08, 7.94, 10.53, 9.43, 14.66, 9.41, 19.13),
    },
    RAVEN_TINYLLAMA: {
        "GSM8K": (9.07, 10.46, 8.72, 10.31, 10.55, 12.96, 11.35, 19.08),
        "MATH-500": (8.46, 9.31, 8.44, 9.65, 10.46, 14.16, 10.76, 19.03),
    },
}

#: DAS Sec. C.4: the three-way interaction E_cKV (Eq. 11) in tokens, by (model, task).
DAS_SEC_C_4_ECKV: dict[tuple[str, str], float] = {
    (HUGINN, "GSM8K"): 2.85, (RAVEN_LLAMA, "GSM8K"): 1.20, (HUGINN, "MATH-500"): 2.76, (RAVEN_LLAMA, "MATH-500"): 0.83,
}

#: DAS Table 10 (Appendix C.5): carried controls retuned independently on GSM8K, by model and prefix policy: verifier
#: capacity gamma, refinement rounds J, recurrent updates per round k, speed-up and accepted length A.
#: Tiny model: measurable in principle (a grid over gamma, J and k of carried Aligned and Deep V decoding, timed
#: against AR); each cell is a timed decoding run, so a CPU chapter can afford a small grid only.
DAS_TABLE_10_COLUMNS = ("gamma", "J", "k", "speed-up", "A")
DAS_TABLE_10: dict[str, dict[str, tuple[int, int, int, float, float]]] = {
    HUGINN: {"Aligned": (8, 4, 2, 1.49, 1.29), "Deep V": (32, 6, 2, 1.84, 2.28)},
    RAVEN_LLAMA: {"Aligned": (16, 12, 1, 2.94, 5.40), "Deep V": (16, 12, 2, 3.70, 8.64)},
}

#: DAS Table 13 (Appendix E.1): 95% intervals (low, high) of the mean speed-ups of :data:`DAS_TABLE_1`, which holds the
#: points, by model and method, one interval per task of :data:`DAS_TABLE_1_TASKS`. Token Recycling's come from a
#: moving-block bootstrap over its request stream, the others from a paired prompt bootstrap.
#: Tiny model: its own intervals come from ``looped_kv.analysis.fits.mean_speedup`` on CPU timings; the intervals
#: themselves do not carry over.
DAS_TABLE_13: dict[str, dict[str, tuple[tuple[float, float], ...]]] = {
    HUGINN: {
        "Lookahead": ((1.76, 1.90), (1.71, 1.98), (1.35, 1.68), (1.31, 1.51)),
        "PLD": ((1.45, 1.66), (1.66, 2.24), (1.29, 1.99), (1.18, 1.55)),
        "Token Recycling": ((2.72, 2.92), (2.69, 2.88), (2.43, 3.08), (2.39, 2.76)),
        "SAM-Decoding": ((1.51, 1.77), (1.95, 3.20), (1.43, 2.79), (1.30, 1.72)),
        "Self-speculative": ((1.63, 1.76), (1.73, 1.91), (1.53, 1.76), (1.71, 1.88)),
        "Mature-Spec": ((2.16, 2.36), (2.27, 2.55), (2.17, 2.52), (2.18, 2.43)),
        "DAS-Wave": ((3.91, 4.33), (4.33, 4.96), (3.62, 4.40), (3.88, 4.51)),
    },
    RAVEN_LLAMA: {
        "Lookahead": ((1.63, 1.74), (1.46, 1.68), (1.24, 1.58), (1.37, 1.54)),
        "PLD": ((1.29, 1.40), (1.62, 2.73), (1.34, 1.97), (1.75, 2.49)),
        "Token Recycling": ((2.52, 2.67), (2.39, 2.60), (2.20, 2.66), (2.43, 2.57)),
        "SAM-Decoding": ((1.47, 1.58), (1.73, 3.08), (1.41, 2.10), (1.99, 2.96)),
        "Self-speculative": ((2.96, 3.28), (3.01, 3.37), (2.84, 3.29), (3.41, 3.64)),
        "Mature-Spec": ((3.37, 3.62), (3.55, 3.83), (3.22, 3.64), (3.74, 3.92)),
        "DAS-Wave": ((5.09, 5.62), (5.70, 6.31), (4.74, 5.68), (6.07, 6.49)),
    },
    RAVEN_OLMO: {
        "Lookahead": ((1.79, 1.94), (1.58, 1.84), (1.17, 1.52), (1.67, 2.03)),
        "PLD": ((1.36, 1.52), (1.70, 2.79), (1.25, 2.02), (1.77, 2.49)),
        "Token Recycling": ((2.70, 2.92), (2.66, 2.92), (2.11, 2.65), (2.90, 3.42)),
        "SAM-Decoding": ((1.55, 1.75), (1.52, 1.99), (1.41, 3.19), (1.61, 2.32)),
        "Self-speculative": ((3.19, 3.43), (3.13, 3.46), (2.54, 3.10), (3.46, 3.72)),
        "Mature-Spec": ((3.53, 3.73), (3.60, 3.86), (3.02, 3.48), (3.82, 3.97)),
        "DAS-Wave": ((5.34, 5.74), (5.61, 6.31), (4.25, 5.40), (6.03, 6.64)),
    },
    RAVEN_TINYLLAMA: {
        "Lookahead": ((1.86, 1.99), (1.41, 1.55), (1.37, 1.68), (1.53, 1.71)),
        "PLD": ((1.71, 2.27), (1.36, 1.59), (1.97, 3.37), (1.92, 2.46)),
        "Token Recycling": ((2.71, 2.86), (2.36, 2.54), (2.13, 2.66), (2.45, 2.63)),
        "SAM-Decoding": ((1.70, 2.13), (1.49, 2.08), (2.08, 3.60), (2.12, 2.82)),
        "Self-speculative": ((3.30, 3.58), (3.25, 3.58), (2.98, 3.53), (3.58, 3.84)),
        "Mature-Spec": ((3.67, 3.90), (3.64, 3.90), (3.39, 3.86), (3.95, 4.12)),
        "DAS-Wave": ((6.08, 6.60), (6.13, 6.65), (5.49, 6.52), (6.70, 7.20)),
    },
}

#: DAS Table 14 (Appendix E.2, Huginn, GSM8K): sequential proposal cost by method: draft depth d, accepted length A,
#: cumulative CUDA-event draft time per request (ms, prefill and verification excluded) and per token (ms).
#: Tiny model: measurable on a CPU with wall-clock timers instead of CUDA events (draft time of self-speculation at
#: d = 8 and Mature-Spec at d = 4); on a CPU a pass's cost grows with the tokens it carries, unlike RIPE Eq. (8)'s.
DAS_TABLE_14_COLUMNS = ("draft d", "A", "draft ms/request", "ms/token")
DAS_TABLE_14: dict[str, tuple[int, float, int, float]] = {
    "Self-speculative": (8, 5.2, 4070, 50.7),
    "Mature-Spec": (4, 5.1, 2293, 36.1),
}
