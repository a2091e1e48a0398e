"""What a shallow recurrence leaves of the papers' depth-dependent settings.

The papers measure Huginn-0125 at R = 32 loops. Their loop ranges, regions, planes and draft depths are scaled to a
model's R by the functions the chapters call (:func:`~looped_kv.analysis.fits.fit_loop_range` and the others
below), and its run profile (:mod:`looped_kv.profiles`) sets its loop grids and draft depths. :func:`depth_settings`
lists them per chapter for any R, and how many loops each one spans, so that a chapter can say what a model of
Parcae's R = 8 or Ouro's R = 4 can still show: a range of two loops fits no decay, a region of one loop is one plane,
a draft of one loop has no shallower depth to compare with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from looped_kv.analysis.fits import deep_loop_range, fit_loop_range
from looped_kv.analysis.planes import paper_planes
from looped_kv.analysis.replay import paper_region
from looped_kv.decoding.das_wave import proposal_width
from looped_kv.decoding.settings import DasWave, default_rounds
from looped_kv.profiles import PROFILES, Profile
from looped_kv.runtime.loading import model_config

#: The models :func:`depth_table` sets side by side: the shipped tiny model (the papers' R = 32), Parcae and Ouro,
#: each by the name of its architecture and of the run profile the chapters give it on a GPU.
MODELS = {"tiny": "tiny", "Parcae": "parcae-140m", "Ouro": "ouro-1.4b"}


def _loops(loops: Sequence[int]) -> str:
    """Loops as a range where they are consecutive ("8-31"), else listed."""
    loops = sorted(loops)
    if len(loops) > 2 and loops == list(range(loops[0], loops[-1] + 1)):
        return f"{loops[0]}-{loops[-1]}"
    return ", ".join(map(str, loops))


def depth_settings(num_loops: int, profile: Profile) -> pd.DataFrame:
    """One row per depth-dependent setting of the chapters at R = ``num_loops`` under ``profile``: chapter, setting
    (with the paper's source), the loops it names and how many they are (``count``; DAS-Wave's widest proposal
    counts positions)."""
    if num_loops < 3:
        raise ValueError(f"num_loops must be >= 3 (the ripening fit needs two loops below R), got {num_loops}")
    R, wave = num_loops, DasWave()
    rounds, updates, (fit_low, fit_high) = default_rounds(R), wave.updates, fit_loop_range(R)
    settings = [
        ("ch01", "loop counts of the loss and answer curves", profile.ch01.loops),
        ("ch01", "the shallow side of R (chain answers)", (profile.ch01.shallow_loops,)),
        ("ch02", "loops of the ripening fit c rho^r (RIPE Table 7)", range(fit_low, fit_high + 1)),
        ("ch02", "deep loops of Delta_r (RIPE Table 7, Eq. 6)", deep_loop_range(R)),
        ("ch03", "shallow region (RIPE Sec. 3.1: loops 2-9)", paper_region("shallow", R)),
        ("ch03", "deep region (RIPE Sec. 3.1: loops 25-32)", paper_region("deep", R)),
        ("ch03", "substituted planes (RIPE Sec. 3.1)", paper_planes(R)),
        ("ch04", "draft loops d of the acceptance runs", (profile.ch04.draft_loops,)),
        ("ch05", "draft depths d below R (DAS Table 6)", [d for d in profile.ch05.draft_depths if d < R]),
        ("ch05", "draft loops d of Mature-Spec", (profile.ch05.draft_loops,)),
        ("ch08", "fixed exits below R (loops)", [e for e in profile.ch08.fixed_loops if e < R]),
    ]
    rows = [{"chapter": chapter, "setting": setting, "loops": _loops(loops), "count": len(set(loops))}
            for chapter, setting, loops in settings]
    width = proposal_width(wave.max_width, rounds, wave.initial_width)
    rows += [{"chapter": "ch06", "setting": "DAS-Wave's refinement, J rounds x k updates (DAS Eq. 5)",
              "loops": f"{rounds} x {updates}", "count": rounds * updates},
             {"chapter": "ch06", "setting": "DAS-Wave's widest proposal w = W_init + J - 1 (DAS Eq. 5)",
              "loops": f"{width} positions", "count": width},
             {"chapter": "ch07", "setting": "planes per position, full cache over deepest plane (RIPE Eq. 3)",
              "loops": f"1-{R}", "count": R}]
    return pd.DataFrame(rows).sort_values("chapter", kind="stable", ignore_index=True)


def depth_table(chapter: str | None = None, models: Mapping[str, str] = MODELS) -> pd.DataFrame:
    """:func:`depth_settings` of each of ``models`` (name -> architecture and profile name) at its own R, side by
    side, as "loops (count)", for one ``chapter`` (e.g. "ch02") or all; index: chapter and setting."""
    columns = {}
    for name, model in models.items():
        R = model_config(model).mean_recurrence
        frame = depth_settings(R, PROFILES[model]).set_index(["chapter", "setting"])
        columns[f"{name}, R = {R}"] = frame["loops"] + " (" + frame["count"].astype(str) + ")"
    table = pd.DataFrame(columns)
    if chapter is None:
        return table
    if chapter not in table.index.get_level_values("chapter"):
        raise ValueError(f"chapter must be one of {sorted(set(table.index.get_level_values('chapter')))}, "
                         f"got {chapter!r}")
    return table.loc[chapter]
