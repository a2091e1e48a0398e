"""DAS's component diagnostics on the model at hand: the configurations of its appendix tables, and draft timing.

* Table 7 (Appendix C.2): sequential self-speculation with Deep V (Mature-V) prefix reads against Deep K/V
  (Mature-Spec): :data:`~looped_kv.experiments.bench.DEEP_V_SPEC` names the Deep V decoder in a chapter's methods
  and the bench's (:func:`~looped_kv.experiments.bench.deep_v_config`; ``looped-kv bench --deep-v``), and
  :func:`deep_kv_acceptance_verdict` and :data:`DEEP_KV_FASTER` give the paper's claim "joint Deep K/V gives the
  larger speedup and accepted length" its two paired verdicts.
* Table 8 (Appendix C.3): the seven fixed-setting components, by (procedure, prefix policy) as the paper names them
  (:func:`component_configs`): sequential drafting at chapter 5's d and gamma, and parallel refinement with and
  without carry at DAS-Wave's schedule.
* Table 10 (Appendix C.5): the carried Aligned and Deep V controls at the schedule the paper retuned them to
  (:func:`retuned_configs`).
* Table 14 (Appendix E.2): the draft time per request, prefill and verification excluded (:func:`draft_times`),
  timed with wall-clock timers around each proposal (CUDA-synchronised on a GPU) instead of CUDA events.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace

import pandas as pd
import torch
from torch import Tensor

from looped_kv.analysis.verdicts import BOOK_MINIMUM, Claim, Verdict
from looped_kv.decoding.generate import drafter
from looped_kv.decoding.loop import decode_rows
from looped_kv.decoding.prompts import eos_id
from looped_kv.decoding.settings import PAPER_LOOPS, DasWave, Decoding
from looped_kv.experiments.bench import (
    DEEP_V_SPEC,
    SPEED,
    TOKENS,
    acceptance_verdict,
    factorial_configs,
    method_configs,
)
from looped_kv.papers import (
    DAS_TABLE_8,
    DAS_TABLE_10,
    DAS_TABLE_10_COLUMNS,
    DAS_TABLE_14,
    DAS_TABLE_14_COLUMNS,
    HUGINN,
)
from looped_kv.runtime.model import LoopedLM

#: DAS Sec. C.2 and Table 7: at the same draft depth, joint Deep K/V reads accept more drafts than Deep V alone.
DEEP_KV_ACCEPTS_MORE = Claim("sequential drafts reading deep K/V (Mature-Spec) accept more per verification than "
                             "drafts reading deep V alone (same d and gamma)", "DAS Sec. C.2, Table 7",
                             minimum=BOOK_MINIMUM["tokens"], minimum_source=TOKENS)
#: DAS Sec. C.2 and Table 7: ... and decode faster.
DEEP_KV_FASTER = Claim("sequential drafts reading deep K/V (Mature-Spec) decode faster than drafts reading deep V "
                       "alone", "DAS Sec. C.2, Table 7", scale="log-ratio", minimum=BOOK_MINIMUM["ratio"],
                       minimum_source=SPEED)


def deep_kv_acceptance_verdict(acceptance: pd.DataFrame) -> Verdict:
    """Table 7's acceptance claim on the paired per-prompt A (``acceptance`` runs) of ``"mature-spec"`` against
    :data:`DEEP_V_SPEC`; its speed claim, :data:`DEEP_KV_FASTER`, is decided on timing runs by
    :func:`~looped_kv.experiments.bench.speed_verdicts` (the recorded bench on the shipped model)."""
    return acceptance_verdict(DEEP_KV_ACCEPTS_MORE, acceptance, "mature-spec", DEEP_V_SPEC)


#: DAS Table 8's (procedure, prefix policy) rows: a sequential method, or a DAS-Wave cell (carry, deep K, deep V).
COMPONENTS: dict[tuple[str, str], str | tuple[int, int, int]] = {
    ("Sequential", "Aligned"): "self-spec",
    ("Sequential", "Deep K/V"): "mature-spec",
    ("Parallel, no carry", "Aligned"): (0, 0, 0),
    ("Parallel, no carry", "Deep K/V"): (0, 1, 1),
    ("Parallel + carry", "Aligned"): (1, 0, 0),
    ("Parallel + carry", "Deep V"): (1, 0, 1),
    ("Parallel + carry", "Deep K/V"): (1, 1, 1),
}
assert tuple(COMPONENTS) == tuple(DAS_TABLE_8[HUGINN])


def component_name(row: tuple[str, str]) -> str:
    """A Table 8 row as one key: "procedure (prefix)"."""
    return f"{row[0]} ({row[1]})"


def component_configs(draft_loops: int | None, gamma: int, wave: dict | None = None) -> dict[str, Decoding]:
    """The configs of DAS Table 8's seven rows, keyed by :func:`component_name`: sequential drafts at
    ``draft_loops`` and ``gamma`` (the paper's sequential rows draft at depth 4), parallel rows at DAS-Wave's
    schedule updated by ``wave``."""
    sequential = method_configs(draft_loops, gamma)
    cells = factorial_configs(wave)
    return {component_name(row): sequential[source] if isinstance(source, str) else cells[source]
            for row, source in COMPONENTS.items()}


def retuned_configs(model: str = HUGINN, wave: dict | None = None) -> dict[str, DasWave]:
    """The carried Aligned and Deep V controls of DAS Table 10 at the (gamma, J, k) the paper retuned them to on
    ``model``, the rest of DAS-Wave's schedule (updated by ``wave``) unchanged; keyed "carry, Aligned (retuned)"."""
    if model not in DAS_TABLE_10:
        raise ValueError(f"DAS Table 10 retunes {list(DAS_TABLE_10)}, not {model!r}")
    reads = {"Aligned": "aligned", "Deep V": "deep-v"}
    configs = {}
    for policy, row in DAS_TABLE_10[model].items():
        cell = dict(zip(DAS_TABLE_10_COLUMNS, row, strict=True))
        schedule = method_configs(wave={**(wave or {}), "max_width": cell["gamma"], "rounds": cell["J"],
                                        "updates": cell["k"], "carry": True})["das-wave"]
        configs[f"Parallel + carry ({policy}, retuned)"] = replace(schedule, prefix_reads=reads[policy])
    return configs


def table_14_configs(num_loops: int, gamma: int) -> dict[str, Decoding]:
    """DAS Table 14's two sequential drafters at R = ``num_loops``, verifying ``gamma`` drafts at a time: depth-8
    self-speculation with aligned reads and depth-4 Mature-Spec, keyed as the table's rows, with the depths scaled
    as the papers' d = 4 of R = 32 is (:func:`~looped_kv.decoding.settings.default_draft_loops`'s share, at least 1;
    unchanged at R = 32)."""
    configs = {}
    for method, key in (("Self-speculative", "self-spec"), ("Mature-Spec", "mature-spec")):
        d = DAS_TABLE_14[method][DAS_TABLE_14_COLUMNS.index("draft d")]
        scaled = min(num_loops - 1, max(1, d * num_loops // PAPER_LOOPS))
        configs[method] = method_configs(scaled, gamma)[key]
    return configs


def _synchronize(model: LoopedLM) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def draft_times(model: LoopedLM, prompts: Sequence[Tensor], methods: Mapping[Hashable, Decoding],
                max_new_tokens: int) -> pd.DataFrame:
    """DAS Table 14's proposal cost: every prompt decoded alone by each drafting method, with the wall-clock time
    spent in the drafter's proposals (prefill and verification excluded; synchronised on a GPU).

    One row per (prompt, method): the draft depth d (None for drafters without one), new tokens, verifications, A,
    the draft time and the whole run's time in ms, and the draft time per new token. One untimed warm-up run per
    method comes first.
    """
    rows = []
    for key, method in methods.items():
        config = replace(method, max_new_tokens=max_new_tokens)
        policy = config.check(model.config.block_size, model.config.mean_recurrence)
        eos = eos_id(model, config.eos_token_id, config.stop_at_eos)
        for i, ids in enumerate([prompts[0], *prompts]):
            plugin = drafter(config, policy.num_loops)
            if plugin is None:
                raise ValueError(f"method {key!r} drafts nothing: a draft time needs a drafting method")
            spent = [0.0]
            propose = plugin.propose

            def timed(*args, propose=propose, spent=spent):
                _synchronize(model)
                start = time.perf_counter()
                out = propose(*args)
                _synchronize(model)
                spent[0] += time.perf_counter() - start
                return out

            plugin.propose = timed
            out = decode_rows(model, ids, max_new_tokens, policy=policy, drafter=plugin, eos=eos)
            if i == 0:  # the warm-up
                continue
            rows.append({"prompt": i - 1, "method": key, "d": getattr(plugin, "draft_loops", None),
                         "new_tokens": out.num_new, "verifications": out.verifications, "A": out.mean_accepted,
                         "draft ms": 1e3 * spent[0], "total ms": 1e3 * out.wall_time,
                         "draft ms/token": 1e3 * spent[0] / out.num_new})
    return pd.DataFrame(rows)
