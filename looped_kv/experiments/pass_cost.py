"""Time the pass-cost grid and record the fitted model (``looped-kv pass-cost``; :mod:`looped_kv.analysis.pass_cost`).

Every cell is one model pass at batch 1 on the decode loop's own passes (:class:`~looped_kv.decoding.passes.Passes`,
:class:`~looped_kv.decoding.compiled.CompiledPasses`): g new tokens after a committed prefix, through r loops, eager
and compiled, writing its keys/values nowhere, as a DAS-Wave round does (a draft's write, a copy of g positions'
keys/values, is left out); at each width and context, the R-loop verification written into the full cache past the
prefix and read there in place (greedy decoding's step at one token; timed without committing it); compiled, chains of
``--draft-chains`` one-token drafts in one step, as compiled self-spec and Mature-Spec draft a block; and the prefill
of prompts of a few lengths. Eager cells read a prefix of L positions; compiled ones attend over their cache's whole
capacity, which is then their context: ``--capacities`` (best, every capacity the decodes priced allocate), else the
bucket of each L (:func:`~looped_kv.decoding.passes.capacity_bucket`). Verifications are timed at ``--verify-tokens``
(the widths decoders verify), else at the passes' widths. Compiled steps are traced before the first timed round (one
trace per kind, width, loop count and capacity: a minute or two each for R loops on a CPU).

A pass or verification cell is timed as a run of ``calls`` consecutive calls after one untimed call, as a decode
makes them (its time per call is the run's mean): a compiled step timed right after another cell's wide pass finds
the CPU's caches cold and costs more than back to back, as greedy decoding runs it, the more so the shorter it is. A
prefill is timed alone, as a decode starts. The rounds visit every cell once each, in a new random order per round, so
a slow stretch of the machine falls on every cell alike; each cell keeps its time per round and the fit reads their
median (or minimum). The record holds the machine (:func:`~looped_kv.runtime.measurement.measurement_mode`'s: CPU,
threads, torch), the command, the commit, the date and the weights' digest.

    looped-kv pass-cost --out book/data/pass-cost-tiny.json
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from looped_kv.analysis.pass_cost import (
    BATCH,
    MODES,
    STATISTICS,
    PassCost,
    Timing,
    against_greedy,
    compare,
    cycle,
    fit_pass_cost,
    fused_waves,
    predict_at_drift,
    predict_by_kind,
    read,
)
from looped_kv.decoding.compiled import RECOMPILE_LIMIT, CompiledPasses, refined_width
from looped_kv.decoding.das_wave import DEEP_KV, rounds_of
from looped_kv.decoding.passes import Passes, Round, capacity_bucket, capacity_buckets, new_cache
from looped_kv.decoding.sampling import Sampler
from looped_kv.decoding.settings import DasWave, Decoding, Greedy, default_draft_loops
from looped_kv.experiments.bench import (
    check_rounds,
    check_weights,
    interleaved_rounds,
    read_record,
    weights_sha256,
    workload_prompts,
    write_record,
)
from looped_kv.experiments.speed import frozen_heap
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.measurement import measurement_mode, source_commit
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import ALIGNED, make_policy

Cell = tuple[str, str, int, int, int]  # mode, kind, tokens, loops, context
GREEDY = Sampler()  # the chains' drafts pick greedily
#: The shipped tiny model's records, which chapters 5 and 7 read (made by the commands in their headers).
COST_RECORD = Path(__file__).resolve().parent.parent.parent / "book" / "data" / "pass-cost-tiny.json"
#: Each mode's recorded check (looped-kv pass-cost-check, and with --mode compiled).
CHECK_RECORDS = {"eager": COST_RECORD.with_name("pass-cost-check-tiny.json"),
                 "compiled": COST_RECORD.with_name("pass-cost-check-compiled-tiny.json")}


@dataclass(frozen=True)
class Grid:
    """The timed grid (``looped-kv pass-cost``'s options, checked by :func:`check_grid`)."""

    modes: list[str]
    tokens: list[int]  # widths fitted
    held_out_tokens: list[int]  # widths timed, predicted by interpolation, not fitted
    loops: list[int]
    contexts: list[int]  # eager: prefix positions read
    prompt_lengths: list[int]  # of the timed prefills
    rounds: int
    statistic: str
    calls: int  # consecutive calls per timing of a pass or verification cell
    verify_tokens: list[int] | None = None  # widths of the verifications in place (None: tokens and held-out tokens)
    capacities: list[int] | None = None  # compiled contexts (None: the contexts' capacity buckets)
    draft_chains: list[int] | None = None  # gammas of the compiled chains of one-token drafts, at each loops < R
    waves: list[int] | None = None  # rounds (J) of the compiled DAS-Wave waves in one step (grid_wave)


def default_loops(num_loops: int) -> list[int]:
    """1, the default draft depth, R / 2 and R (distinct)."""
    return sorted({1, default_draft_loops(num_loops), max(1, num_loops // 2), num_loops})


def pass_widths(grid: Grid) -> list[int]:
    """The widths of the pass cells: fitted and held out."""
    return sorted(set(grid.tokens + grid.held_out_tokens))


def verify_widths(grid: Grid) -> list[int]:
    """The widths of the verification cells: ``verify_tokens``, else the pass cells' widths."""
    return sorted(set(grid.verify_tokens or pass_widths(grid)))


def grid_wave(rounds: int) -> tuple[list[Round], int, tuple[int, ...]]:
    """The wave a ``--waves`` cell of ``rounds`` rounds times: DAS-Wave's default schedule (:class:`~looped_kv.
    decoding.settings.DasWave`: max_width, W_init, k, carried states, deep K/V reads) with J = ``rounds``, as one
    compiled step: its rounds (:func:`~looped_kv.decoding.das_wave.rounds_of`), k, and the widths its rounds
    refine (:func:`~looped_kv.decoding.compiled.refined_width`)."""
    config = DasWave(rounds=rounds)
    schedule = rounds_of(config.max_width, rounds, config.initial_width, config.updates, config.carry)
    return schedule, config.updates, tuple(refined_width(width, config.max_width) for _, width, _ in schedule)


def _room(kind: str, tokens: int) -> int:
    """The positions past the prefix a cell's pass reaches: a wave of J rounds its widest round's (its guesses
    past those are never run), any other its tokens."""
    return max(grid_wave(tokens)[2]) if kind == "wave" else tokens


def _widest(grid: Grid) -> int:
    waves = [_room("wave", J) for J in grid.waves or []]
    return max(pass_widths(grid) + verify_widths(grid) + (grid.draft_chains or []) + waves)


def capacities(grid: Grid, block_size: int) -> list[int]:
    """The compiled cells' contexts: ``capacities``, else each context's capacity bucket."""
    return sorted(set(grid.capacities or {capacity_bucket(c, block_size) for c in grid.contexts}))


def check_grid(grid: Grid, config: LoopedConfig) -> None:
    """Every option before any work: one-line ValueErrors naming the option and its allowed values."""
    R, block = config.mean_recurrence, config.block_size
    if not grid.modes or any(m not in MODES for m in grid.modes):
        raise ValueError(f"--modes must name some of {MODES}, got {grid.modes}")
    if grid.statistic not in STATISTICS:
        raise ValueError(f"--statistic must be one of {tuple(STATISTICS)}, got {grid.statistic!r}")
    if grid.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {grid.rounds}")
    if grid.calls < 1:
        raise ValueError(f"--calls must be >= 1, got {grid.calls}")
    lists = [("--tokens", grid.tokens, 1), ("--loops", grid.loops, 2), ("--contexts", grid.contexts, 2),
             ("--prompt-lengths", grid.prompt_lengths, 2)]
    lists += [(flag, values, least) for flag, values, least in (("--verify-tokens", grid.verify_tokens, 1),
                                                                ("--capacities", grid.capacities, 2)) if values]
    if grid.draft_chains and min(grid.draft_chains) < 2:
        raise ValueError(f"--draft-chains must each be >= 2 (one draft is a pass cell), got {grid.draft_chains}")
    if grid.waves and (min(grid.waves) < 1 or "compiled" not in grid.modes):
        raise ValueError(f"--waves must each be >= 1, with --modes compiled (a wave is one compiled step), got "
                         f"{grid.waves} with --modes {grid.modes}")
    if grid.waves:  # the record prices each wave's rounds as passes beside it
        rounds = sorted({w for J in grid.waves for w in grid_wave(J)[2]})
        if not min(grid.tokens) <= rounds[0] <= rounds[-1] <= max(grid.tokens):
            raise ValueError(f"--tokens must span the widths the --waves' rounds refine, {rounds[0]} to {rounds[-1]}, "
                             f"got {grid.tokens}")
    for flag, values, least in lists:
        if any(v < 1 for v in values) or len(set(values)) < least:
            raise ValueError(f"{flag} must be {least} or more distinct integers >= 1, got {values}")
    low, high = min(grid.tokens), max(grid.tokens)
    bad = [g for g in grid.held_out_tokens if not low < g < high or g in grid.tokens]
    if bad:
        raise ValueError(f"--held-out-tokens must lie strictly between the smallest and largest --tokens ({low} and "
                         f"{high}) and not be among them, got {bad}")
    if max(grid.loops) > R:
        raise ValueError(f"--loops must each be in [1, {R}] (the model's R), got {grid.loops}")
    widest = _widest(grid)
    if "eager" in grid.modes and max(grid.contexts) + widest > block:
        raise ValueError(f"--contexts must each be <= {block - widest} (the model's context {block} less the widest "
                         f"pass, {widest} tokens), got {grid.contexts}")
    if grid.capacities and not set(grid.capacities) <= set(capacity_buckets(block)):
        raise ValueError(f"--capacities must each be one a compiled decode allocates, {capacity_buckets(block)}, got "
                         f"{grid.capacities}")
    if "compiled" in grid.modes:
        caps = capacities(grid, block)
        if len(caps) < 2 or caps[0] <= widest:
            raise ValueError(f"--contexts (or --capacities) must give 2 or more compiled capacities above the widest "
                             f"pass ({widest} tokens); they give {caps} (capacity buckets: 64, 96, 128, 192, 256, ...)")
        traces = sum(mode == "compiled" and kind == "pass" for mode, kind, *_ in cells(grid, block, R))
        if traces > RECOMPILE_LIMIT:
            raise ValueError(f"--tokens, --held-out-tokens, --loops and --contexts make {traces} compiled cells, "
                             f"each a trace of one compiled step, which holds at most {RECOMPILE_LIMIT}: time fewer")
    if max(grid.prompt_lengths) > block:
        raise ValueError(f"--prompt-lengths must each be in [1, {block}] (the model's context), got "
                         f"{grid.prompt_lengths}")


def cells(grid: Grid, block_size: int, num_loops: int) -> list[Cell]:
    """Every cell of the grid but the prefills: pass cells (mode, "pass", g, r, L), verification cells (mode,
    "verify", g, R, L) and, compiled, chains of gamma one-token drafts of each loop count r < R ("compiled", "drafts",
    gamma, r, L; eager drafts are passes of their own) and waves of J rounds of k loops (("compiled", "wave", J, k,
    L), :func:`grid_wave`; eager rounds are passes of their own)."""
    out: list[Cell] = []
    for mode in grid.modes:
        contexts = capacities(grid, block_size) if mode == "compiled" else sorted(set(grid.contexts))
        out += [(mode, "pass", g, r, c) for g in pass_widths(grid) for r in sorted(set(grid.loops)) for c in contexts]
        out += [(mode, "verify", g, num_loops, c) for g in verify_widths(grid) for c in contexts]
        if mode == "compiled":
            out += [(mode, "drafts", g, r, c) for g in sorted(set(grid.draft_chains or [])) for r in
                    sorted(set(grid.loops)) if r < num_loops for c in contexts]
            out += [(mode, "wave", J, grid_wave(J)[1], c) for J in sorted(set(grid.waves or [])) for c in contexts]
    return out


def _sync(model: LoopedLM) -> Callable[[], None]:
    return torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)


def arms(model: LoopedLM, grid: Grid, seed: int = 0) -> dict[Cell, Callable[[], float]]:
    """One callable per cell that times it and returns its seconds per call: pass and verification cells
    (:func:`cell_arms`), then prefill cells (:func:`prefill_arms`)."""
    generator, R = torch.Generator().manual_seed(seed), model.config.mean_recurrence
    out = cell_arms(model, cells(grid, model.config.block_size, R), _widest(grid), grid.calls, generator)
    return out | prefill_arms(model, [(mode, "prefill", n, R, 0) for mode in grid.modes
                                      for n in sorted(set(grid.prompt_lengths))], generator)


def prefill_arms(model: LoopedLM, timed_cells: Sequence[Cell],
                 generator: torch.Generator) -> dict[Cell, Callable[[], float]]:
    """One callable per prefill cell (mode, "prefill", n, R, 0) that times the prefill of an n-token prompt alone, as
    a decode starts: on a new full cache (compiled: of n's capacity bucket) made before the clock starts."""
    policy, sync, out = make_policy("full", model.config.mean_recurrence), _sync(model), {}
    for cell in timed_cells:
        mode, n = cell[0], cell[2]
        passes_class = CompiledPasses if mode == "compiled" else Passes
        capacity = capacity_bucket(n, model.config.block_size) if mode == "compiled" else n
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=generator).to(model.device)

        def prefill(passes_class: type[Passes] = passes_class, capacity: int = capacity,
                    prompt: torch.Tensor = prompt) -> float:
            p = passes_class(model, new_cache(model, policy, BATCH, capacity))
            return _timed(sync, lambda: p.prefill([prompt]))

        out[cell] = prefill
    return out


def _timed(sync: Callable[[], None], run: Callable[[], object], calls: int = 1) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    sync()
    return (time.perf_counter() - start) / calls


def cell_arms(model: LoopedLM, timed_cells: Sequence[Cell], widest: int, calls: int,
              generator: torch.Generator) -> dict[Cell, Callable[[], float]]:
    """One callable per pass, verification, chain-of-drafts or wave cell that times it and returns its seconds per
    call: on a prefilled full cache per (mode, context) with room for ``widest`` tokens, one untimed call then
    ``calls`` timed back to back (a verification writes past the prefix, and a chain's greedy drafts into the block
    buffer, neither committed: every call writes the same positions; a wave writes nothing)."""
    R, sync = model.config.mean_recurrence, _sync(model)
    policy = make_policy("full", R)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (1, n), generator=generator).to(model.device)

    def consecutive(run: Callable[[], object]) -> float:
        run()
        return _timed(sync, run, calls)

    out: dict[Cell, Callable[[], float]] = {}
    passes: dict[tuple[str, int], Passes] = {}
    block = ids(widest)
    guesses = block[:, :1].expand(-1, DasWave.max_width + 1)  # a wave's: its anchor repeated
    for cell in timed_cells:
        mode, kind, g, r, context = cell
        if (mode, context) not in passes:
            compiled = mode == "compiled"
            capacity = context if compiled else context + widest
            passes[mode, context] = (CompiledPasses if compiled else Passes)(
                model, new_cache(model, policy, BATCH, capacity), widest)
            passes[mode, context].prefill([ids(capacity - widest if compiled else context)[0]])
        if kind == "verify":
            out[cell] = lambda p=passes[mode, context], g=g: consecutive(lambda: p.verify(block[:, :g], None))
        elif kind == "drafts":
            out[cell] = lambda p=passes[mode, context], g=g, r=r: consecutive(
                lambda: p.drafts(block[:, :1], r, reads=ALIGNED, picks=[GREEDY.drafting(1 + i) for i in range(g)]))
        elif kind == "wave":
            schedule, k, _ = grid_wave(g)
            out[cell] = lambda p=passes[mode, context], schedule=schedule, k=k: consecutive(
                lambda: p.wave(guesses.clone(), schedule, k, reads=DEEP_KV, fused=True))
        else:
            out[cell] = lambda p=passes[mode, context], g=g, r=r: consecutive(lambda: p.run(block[:, :g], r))
    return out


@torch.no_grad()
def measure(model: LoopedLM, grid: Grid, progress: bool = True, seed: int = 0) -> list[Timing]:
    """Time every cell once per round (:func:`arms`), in a new random order each round, after one untimed call of
    each (the compiled steps are traced there); under :func:`~looped_kv.experiments.speed.frozen_heap`."""
    runs = arms(model, grid, seed)
    for run in tqdm(runs.values(), desc="warm-up (tracing compiled steps)", disable=not progress, leave=False):
        run()
    keys = list(runs)
    seconds: dict[Cell, list[float]] = {key: [] for key in keys}
    order = np.random.default_rng(seed)
    with frozen_heap(), tqdm(total=grid.rounds * len(keys), desc="pass-cost rounds", disable=not progress,
                             leave=False) as bar:
        for _ in range(grid.rounds):
            for i in order.permutation(len(keys)):
                seconds[keys[i]].append(runs[keys[i]]())
                bar.update()
    return [Timing(*key, seconds=tuple(s), widths=grid_wave(key[2])[2] if key[1] == "wave" else ())
            for key, s in seconds.items()]


def run(model: LoopedLM, grid: Grid, out: Path, source: str, command: str, progress: bool = True) -> PassCost:
    """Measure the grid, fit the model, print its residuals and coefficients and write it to ``out`` (checked by the
    caller) with the machine, the command, the commit it started at, the date and the weights' digest."""
    commit = source_commit()  # what ran, read before a long measurement
    with measurement_mode() as environment:
        print(f"model {source} on {model.device} ({str(model.dtype).removeprefix('torch.')}), R = "
              f"{model.config.mean_recurrence}, {environment['threads']} thread(s), {environment['cpu']}; "
              f"{grid.rounds} interleaved rounds of every cell, each pass or verification cell {grid.calls} "
              f"calls; modes {', '.join(grid.modes)}")
        timings = measure(model, grid, progress)
    meta = {"command": command, "commit": commit, "date": datetime.now(timezone.utc).isoformat(
        timespec="minutes"), "environment": environment, "model": source, "weights_sha256": weights_sha256(source),
            "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device), "batch": BATCH,
            "rounds": grid.rounds, "calls": grid.calls, "loops": grid.loops, "contexts": grid.contexts,
            "capacities": capacities(grid, model.config.block_size), "verify_tokens": verify_widths(grid),
            "prompt_lengths": grid.prompt_lengths, "draft_chains": sorted(set(grid.draft_chains or [])),
            "waves": sorted(set(grid.waves or []))}
    cost = fit_pass_cost(timings, grid.statistic, grid.held_out_tokens, meta)
    cost.write(out)
    print(f"t(g, r, L) = a + b r per width g and context L, and the verification in place, fitted on the "
          f"{grid.statistic} of each cell; residuals (model / measured - 1):")
    print(cost.summary().to_string(float_format=lambda x: f"{x:+.1%}" if abs(x) < 10 else f"{x:g}"))
    for mode, by_width in cost.coefficients.items():
        table = pd.DataFrame({(g, L): {"a (ms)": 1e3 * a, "b (ms per loop)": 1e3 * b}
                              for g, by_context in by_width.items() for L, (a, b) in by_context.items()}).T
        print(f"{mode} passes, per width g and context L:\n"
              f"{table.unstack().to_string(float_format=lambda x: f'{x:.3f}')}")
        verified = pd.DataFrame({g: {L: 1e3 * s for L, s in by_context.items()}
                                 for g, by_context in cost.verifications[mode].items()}).T
        print(f"{mode} verifications in place (R loops), ms, per width (rows) and context (columns):\n"
              f"{verified.to_string(float_format=lambda x: f'{x:.3f}')}")
        for r, by_gamma in cost.drafts.get(mode, {}).items():
            chains = pd.DataFrame({g: {L: 1e3 * s / g for L, s in by_context.items()}
                                   for g, by_context in by_gamma.items()}).T
            print(f"{mode} chains of one-token {r}-loop drafts in one step, ms per draft, per chain length (rows) and "
                  f"context (columns), beside one draft alone ({1e3 * cost.seconds(1, r, chains.columns[0], mode):.3f}"
                  f" ms at {chains.columns[0]}):\n{chains.to_string(float_format=lambda x: f'{x:.3f}')}")
        waves = fused_waves(cost, mode)
        if not waves.empty:
            print(f"{mode} DAS-Wave waves in one step against their rounds priced as passes:\n"
                  f"{waves.to_string(index=False, float_format=lambda x: f'{x:.4g}')}")
    print(f"recorded in {out}")
    return cost


# -- the check: each decoder's measured time against the model's prediction (looped-kv pass-cost-check) -------------


@torch.no_grad()
def predictions(model: LoopedLM, cost: PassCost, prompts: Sequence[torch.Tensor], methods: Mapping[str, Decoding],
                max_new_tokens: int, repeats: int = 2, mode: str = "eager", progress: bool = True) -> pd.DataFrame:
    """Each method's measured decoding time against the pass-cost model's prediction: every prompt decoded alone by
    greedy decoding and each of ``methods`` (configs by name) in ``repeats`` interleaved rounds (the
    order reversed every other round), each run's passes logged (:class:`~looped_kv.decoding.loop.PassLog`). After
    each prompt's rounds the machine's drift since the grid is read on a few of its pass, verification and prefill
    cells (:func:`drift_arms`). One row per (prompt, method): the median measured seconds, the median seconds inside the
    run's passes (each pass timed from its call to its result, :attr:`~looped_kv.decoding.passes.PassRecord.seconds`:
    the rest is the decode loop's own work), the predicted seconds
    (:func:`~looped_kv.analysis.pass_cost.predict_seconds`: every pass the run made, and the model's prefill), the
    drift of each kind of cell (``drift_<kind>``: the median of time now / recorded over its cells) and of each kind
    and width (``drift_<kind>_<tokens>``), the prediction at those drifts
    (:func:`~looped_kv.analysis.pass_cost.predict_at_drift`, by kind and width), the prediction per kind of pass, the
    new tokens, and the seconds and price of the first run's first pass after its prefill and of its later passes.
    Every method decodes each prompt once, untimed, before its rounds (:func:`interleaved_rounds`): a decoder's
    first run in a process pays for code paths and allocations met for the first time, which no later run does."""
    check_rounds(repeats, (mode,))
    check_mode(cost, mode)
    compiled = mode == "compiled"
    configs = {"ar": Greedy(), **{k: c for k, c in methods.items() if c.method != "ar"}}
    probes = drift_arms(model, cost, mode)
    for *_, run in probes:  # warm-up (compiled: traced here)
        run()
    keys, rows = list(configs), []
    with frozen_heap():
        for i, ids in enumerate(tqdm(prompts, desc=f"prompts ({mode})", disable=not progress, leave=False)):
            rounds = interleaved_rounds(model, ids, configs, repeats, log_passes=True, max_new_tokens=max_new_tokens,
                                        compile=compiled)
            ratios: dict[tuple[str, int], list[float]] = {}
            for kind, tokens, recorded, run in probes:
                ratios.setdefault((kind, tokens), []).append(run() / recorded)
            drift = {cell: float(np.median(r)) for cell, r in ratios.items()}
            by_cell_kind: dict[str, list[float]] = {}
            for (kind, _), r in ratios.items():
                by_cell_kind.setdefault(kind, []).extend(r)
            kinds = {kind: float(np.median(r)) for kind, r in by_cell_kind.items()}
            for key in keys:
                by_kind = predict_by_kind(cost, rounds.passes[key])
                after = [p for p in rounds.passes[key] if p.kind != "prefill"]
                rows.append({"prompt": i, "method": key, "mode": mode, "new_tokens": rounds.first[key].num_new,
                             "passes": len(rounds.passes[key]), "measured_s": float(np.median(rounds.times[key])),
                             "in_passes_s": float(np.median(rounds.pass_seconds[key])),
                             "predicted_s": sum(by_kind.values()), **{f"drift_{kind}": d for kind, d in kinds.items()},
                             **{f"drift_{kind}_{tokens}": d for (kind, tokens), d in drift.items()},
                             "predicted_at_drift_s": predict_at_drift(cost, rounds.passes[key], drift),
                             **{f"predicted_{kind}_s": s for kind, s in by_kind.items()},
                             "first_pass_s": after[0].seconds if after else 0.0,
                             "first_pass_price_s": cost.record_seconds(after[0]) if after else 0.0,
                             "later_passes_s": sum(p.seconds for p in after[1:]),
                             "later_passes_price_s": sum(cost.record_seconds(p) for p in after[1:])})
    return pd.DataFrame(rows)


def drift_cells(cost: PassCost, mode: str) -> list[Timing]:
    """The recorded cells a check re-times beside its decodes: at every recorded context, ``mode``'s verifications
    in place of its narrowest width (greedy decoding's step) and its widest, and its passes of its narrowest width
    (a draft's shape) and its widest (a DAS-Wave round's) at every recorded loop count; its chains of drafts and
    waves; and its prefill at every recorded prompt length."""
    timings = [t for t in cost.timings if t.mode == mode]
    widths = {kind: {f(t.tokens for t in timings if t.kind == kind) for f in (min, max)} for kind in ("pass", "verify")}
    return [t for t in timings if t.kind in ("prefill", "drafts", "wave") or t.tokens in widths[t.kind]]


def drift_arms(model: LoopedLM, cost: PassCost, mode: str,
               seed: int = 1) -> list[tuple[str, int, float, Callable[[], float]]]:
    """:func:`drift_cells` as the grid timed them (:func:`cell_arms`, the record's ``calls``; :func:`prefill_arms`),
    each with its kind ("pass", "verify", "drafts", "wave" or "prefill"), its tokens and its recorded time (the record's
    statistic over its rounds): per kind and width, the median of time now / recorded over these cells is how much
    slower the machine runs such cells than when the grid was timed (its drift; a few loops, an R-loop verification
    and a prompt's prefill need not drift alike: on 6 December a compiled prefill ran at about 1.2x its recorded time
    while the verifications beside it ran at 0.9x; nor need a one-token and a wide one,
    :func:`~looped_kv.analysis.pass_cost.drift_at`)."""
    timings = drift_cells(cost, mode)
    moved = [t.tokens for t in timings if t.kind == "wave" and t.widths != grid_wave(t.tokens)[2]]
    if moved:
        raise ValueError(f"the pass-cost record's waves of {moved} rounds refine other widths than DAS-Wave's default "
                         f"schedule does now; re-run looped-kv pass-cost with --waves")
    recorded = {(t.mode, t.kind, t.tokens, t.loops, t.context): STATISTICS[cost.statistic](t.seconds) for t in timings}
    generator = torch.Generator().manual_seed(seed)
    steps = [cell for cell in recorded if cell[1] != "prefill"]
    runs = cell_arms(model, steps, max(_room(cell[1], cell[2]) for cell in steps), int(cost.meta["calls"]), generator)
    runs |= prefill_arms(model, [cell for cell in recorded if cell[1] == "prefill"], generator)
    return [(cell[1], cell[2], recorded[cell], run) for cell, run in runs.items()]


#: The columns of :func:`~looped_kv.analysis.pass_cost.against_greedy` a check prints, each under its printed name.
CHECK_COLUMNS = {"measured / predicted": "measured / predicted", "measured / predicted at drift": "at drift",
                 "in passes / predicted": "in passes / predicted", "outside passes": "outside passes",
                 "first pass / price": "first pass", "later passes / price": "later passes"}


#: What must match for a pass-cost model to describe the machine a check runs on.
MACHINE = ("cpu", "cuda", "threads", "torch")


def where_measured(measured: Mapping[str, object] | None, here: Mapping[str, object]) -> str:
    """Where the pass-cost model was measured, as the check's header says it: on this machine, or on another one
    (what differs), whose predictions describe that machine, not this one (the at drift column prices its passes at
    the grid cells' times now, a correction of speed alone)."""
    if measured is None:
        return "measured on a machine its record does not name"
    differ = [f"{key} {measured.get(key)!r} here {here.get(key)!r}" for key in MACHINE
              if measured.get(key) != here.get(key)]
    if not differ:
        return "measured on this machine"
    return (f"measured on another machine ({'; '.join(differ)}): its predictions are that machine's, and "
            f"looped-kv pass-cost fits this one's")


def check(model: LoopedLM, cost: PassCost, workloads: Sequence[str], prompts: int, max_new_tokens: int,
          methods: Mapping[str, Decoding], out: Path, source: str, command: str, repeats: int = 2,
          mode: str = "eager", progress: bool = True) -> dict[str, pd.DataFrame]:
    """Run :func:`predictions` on each workload's first ``prompts`` evaluation prompts, print predicted / measured
    per method (:func:`~looped_kv.analysis.pass_cost.compare`, beside the at drift, in passes and outside passes
    columns of :func:`~looped_kv.analysis.pass_cost.against_greedy`) and record the runs in ``out`` (checked by the
    caller) with the command, the commit, the machine, the date, the weights' digest and the pass-cost record's."""
    check_mode(cost, mode)
    runs: dict[str, pd.DataFrame] = {}
    commit = source_commit()  # what ran, read before a long measurement
    with measurement_mode() as environment:
        print(f"model {source}, {environment['threads']} thread(s), {environment['cpu']}; {mode}, {prompts} prompts "
              f"per workload x {repeats} interleaved rounds; the pass-cost model of {cost.meta.get('date', '?')}, "
              f"{where_measured(cost.meta.get('environment'), environment)}")
        for workload in workloads:
            encoded = workload_prompts(model, workload, prompts, max_new_tokens, methods)
            runs[workload] = predictions(model, cost, encoded, methods, max_new_tokens, repeats, mode, progress)
            r = runs[workload]
            shown = against_greedy(r)[list(CHECK_COLUMNS)].rename(columns=CHECK_COLUMNS)
            table = shown.rename_axis("method").join(compare(r))
            print(f"{workload} (drift: the grid's pass cells took {r['drift_pass'].min():.3f}x to "
                  f"{r['drift_pass'].max():.3f}x their recorded time, its verifications {r['drift_verify'].min():.3f}x "
                  f"to {r['drift_verify'].max():.3f}x, its prefills {r['drift_prefill'].min():.3f}x to "
                  f"{r['drift_prefill'].max():.3f}x; at drift: measured / the passes priced at the drift of "
                  f"cells of their kind and width; "
                  f"in passes: the time inside the runs' passes; outside passes: the decode loop's share of the "
                  f"measured time; first pass, later passes: the first run's first pass after its prefill and its "
                  f"later passes, measured / their price):\n"
                  f"{table.to_string(float_format=lambda x: f'{x:.3f}')}")
    write_record(out, {"commit": commit, "environment": environment, "runs": runs}, source, command,
                 pass_cost={k: cost.meta.get(k) for k in ("command", "commit", "date", "weights_sha256")})
    print(f"recorded in {out}")
    return runs


def check_mode(cost: PassCost, mode: str, where: str = "the pass-cost record") -> None:
    """Refuse to price ``mode``'s passes with a pass-cost model that did not measure it, before any work."""
    if mode not in cost.coefficients:
        raise ValueError(f"--mode {mode}: {where} holds {sorted(cost.coefficients)} only; re-run looped-kv pass-cost "
                         f"with --modes {mode}")


def check_prices(cost: PassCost, methods: Mapping[str, Decoding], mode: str, num_loops: int,
                 where: str = "the pass-cost record") -> None:
    """Refuse, before any work, a pass-cost model that cannot price every pass of each method's verification cycle
    (:func:`~looped_kv.analysis.pass_cost.cycle`) in ``mode``, such as a compiled chain of drafts it did not time."""
    context = cost.contexts(mode)[0]
    for name, config in methods.items():
        for kind, tokens, loops, *widths in cycle(config, num_loops, compiled=mode == "compiled"):
            try:
                cost.price(kind, tokens, loops, context, mode, *widths)
            except ValueError as error:
                raise ValueError(f"{where} cannot price {name}: {error}") from None


def read_cost(path: str | Path = COST_RECORD, source: str | Path = "tiny") -> PassCost:
    """A recorded pass-cost model (:func:`run`), refused when measured on other weights than ``source``'s."""
    cost = read(path)
    check_weights(path, cost.meta.get("weights_sha256"), cost.meta.get("command", "looped-kv pass-cost"), source)
    return cost


def read_check(path: str | Path = CHECK_RECORDS["eager"],
               source: str | Path = "tiny") -> tuple[dict, dict[str, pd.DataFrame]]:
    """A recorded check (:func:`check`, saved as a bench record is): its header and each workload's runs; refused
    when measured on other weights than ``source``'s."""
    return read_record(Path(path), source)
