"""The plan against a measurement: each chapter's memory-relevant calls at a profile's sizes, peak memory recorded.

Every chapter run below makes the chapter's own package calls with the sizes the chapter reads from its profile
(:mod:`looped_kv.profiles`), on random token ids of the lengths the plan charges (every prompt
``prompt_tokens`` long), so the measurement is the case the plan bounds. Allocation does not depend on the
weights, so a model of a published config with random weights measures the real thing (as
:mod:`looped_kv.experiments.gpu_check` does). Chapter 1's chain answers are left out (they need a tokenizer and
are not a real checkpoint's peak), and chapter 4's test of Remark 1 runs its two replays but not its fit of
c rho^r (random weights need not ripen; the fit is arithmetic on R-long curves).

On a GPU the measured peak is ``torch.cuda.max_memory_allocated`` over the run, the resident weights included,
against the plan's GPU peak; on a CPU, where GPU and host memory are one, it is
:func:`~looped_kv.analysis.memory_bench.tensor_peak_bytes` of the run, against the plan's peak of both less the
resident weights. ``tests/test_plan.py`` holds every prediction to 10% of the CPU measurement on scaled-down
models (Huginn's shape, Ouro's and Raven-TinyLlama's); on a GPU, one command records a full-size check (the
profile defaults to the model's for the GPU found; name a T4 profile to check it on a larger GPU):

    looped-kv plan-check --model huginn-0125 --out book/data/plan-check-huginn-0125.json
    looped-kv plan-check --model ouro-1.4b --profile ouro-1.4b-t4 \
        --out book/data/plan-check-ouro-1.4b-t4.json
    looped-kv plan-check --model raven-tinyllama --profile raven-tinyllama-t4 \
        --out book/data/plan-check-raven-tinyllama-t4.json

``--model`` also takes a checkpoint folder or a config.json (random weights of that config): the same command runs
on a CPU with a fixture-sized model and the ``smoke`` profile. On a CPU, the laptop route of issue 42: every
chapter's run at parcae-140m's dimensions with its CPU profile, its seconds and peak host memory recorded after each
chapter (``--resume`` continues a stopped run):

    looped-kv plan-check --model parcae-140m --device cpu --out book/data/plan-check-parcae-140m-cpu.json
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from looped_kv import profiles
from looped_kv.analysis import measure, plan
from looped_kv.analysis.adaptive_depth import teacher_forced_exits
from looped_kv.analysis.claims import ripeness_replays
from looped_kv.analysis.depth import loss_by_text
from looped_kv.analysis.memory_bench import tensor_peak_bytes
from looped_kv.analysis.planes import (
    arm_grid,
    exact_replay,
    first_position_agreement,
    free_memory,
    in_dtype,
    precision_floor,
    ripening_curves,
    table3_policies,
)
from looped_kv.analysis.ripe import acceptance_by_cache, replay_records
from looped_kv.decoding.generate import generate
from looped_kv.experiments import bench
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.measurement import measurement_mode, source_commit
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import make_policy

SKIPPED = {"ch01": ("chain answers",)}  # plan steps a run does not make
#: The command that runs :func:`run` (:mod:`looped_kv.cli`'s ``plan-check``), as a module.


def token_ids(model: LoopedLM, rows: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Random token ids (rows, tokens) on the model's device (ids 1.. : no padding or end-of-text id 0)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, model.config.vocab_size, (rows, tokens), generator=generator).to(model.device)


def _prompts(model: LoopedLM, profile: profiles.Profile, rows: int) -> list[torch.Tensor]:
    return list(token_ids(model, rows, profile.prompt_tokens, seed=rows))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _records_device(model: LoopedLM, record_device: str) -> torch.device:
    return torch.device("cpu") if record_device == "cpu" else model.device


def ch01(model: LoopedLM, profile: profiles.Profile) -> None:
    p, rows = profile.ch01, profile.rows_per_chunk
    loss_by_text(model, token_ids(model, p.texts_per_workload, p.text_chars), p.loops, rows_per_chunk=rows)
    generate(model, _prompts(model, profile, p.prompts_per_workload), max_new_tokens=p.new_tokens,
             stop_at_eos=False, rows_per_chunk=rows)


def ch02(model: LoopedLM, profile: profiles.Profile) -> None:
    p, R = profile.ch02, model.config.mean_recurrence
    texts, where = token_ids(model, 3 * p.texts_per_workload, p.length), _records_device(model, p.record_device)
    fit_dtype, floor_dtype = (_dtype(name) for name in p.replay_dtypes)
    copy = in_dtype(model, fit_dtype)
    ripening_curves(copy, texts, R, decoded=p.decoded, chunk=p.chunk, exact_dtype=_dtype(p.exact_dtype),
                    record_device=where)
    del copy
    free_memory(model.device)
    copy = in_dtype(model, floor_dtype)
    ripening_curves(copy, texts, R, decoded=p.decoded, maturity_kinds=(), chunk=p.chunk, record_device=where)


def ch03(model: LoopedLM, profile: profiles.Profile) -> None:
    p, R = profile.ch03, model.config.mean_recurrence
    texts = token_ids(model, 3 * p.texts_per_workload, p.prefix + p.decoded)
    where = _records_device(model, p.record_device)
    exact = exact_replay(model, texts, R, decoded=p.decoded, dtype=_dtype(p.exact_dtype), device=where,
                         chunk=p.exact_chunk)
    model32 = in_dtype(model, _dtype(p.arm_dtype))
    grid = arm_grid(model32, texts, R, decoded=p.decoded, record_device=where, planes=(1, R // 2), progress=False)
    precision_floor(model32, grid.reference, exact=exact)
    del exact, model32, grid
    free_memory(model.device)
    first_position_agreement(model, token_ids(model, 3 * p.table3_texts_per_workload, p.table3_length),
                             table3_policies(R), chunk=p.table3_chunk)


def ch04(model: LoopedLM, profile: profiles.Profile) -> None:
    p, R, rows = profile.ch04, model.config.mean_recurrence, profile.rows_per_chunk
    model_exact = in_dtype(model, _dtype(p.exact_dtype))
    spec = dict(max_new_tokens=p.acceptance_tokens, rows_per_chunk=rows, stop_at_eos=False, cache="ripe",
                window=p.gamma)
    exact_prompts = _prompts(model_exact, profile, 3 * p.exact_prompts)
    generate(model_exact, exact_prompts, **spec)
    generate(model_exact, exact_prompts, **spec, method="self-spec", draft_loops=p.draft_loops, gamma=p.gamma)
    del model_exact, exact_prompts
    model16 = in_dtype(model, _dtype(p.reference_dtype))
    targets = generate(model16, _prompts(model, profile, 3 * p.replay_prompts), max_new_tokens=p.new_tokens,
                       stop_at_eos=False, rows_per_chunk=rows)
    trajectories, lengths = [s[None] for s in targets.sequences], targets.prompt_lengths
    model32 = in_dtype(model16, torch.float32)
    full, deepest = make_policy("full", R), make_policy("deepest", R)
    arms = {"deepest": (model16, deepest),
            **{f"W = {w}": (model16, make_policy("ripe", R, window=w)) for w in p.windows},
            "sinks": (model16, make_policy("sinks", R, sinks=4)), "two": (model16, make_policy("k-deepest", R, k=2)),
            "fp32": (model32, full)}
    replay_records(trajectories, lengths, (model16, full), arms, gamma=p.gamma, block_arms=["deepest"],
                   batch_size=p.replay_batch)
    del arms
    c2 = profile.ch02
    # Remark 1's replays, not its fit of c rho^r: random weights need not ripen, and the fit allocates nothing
    ripeness_replays(model32, model16, token_ids(model, 3 * p.ripeness_texts_per_workload, c2.length),
                     decoded=c2.decoded, chunk=c2.chunk, record_device=_records_device(model, c2.record_device))
    if p.block_dtype is not None:
        block_dtype = _dtype(p.block_dtype)
        exact = model32 if model32.dtype == block_dtype else in_dtype(model16, block_dtype)
        first = [t[:, :n + p.block_tokens] for t, n in zip(trajectories, lengths, strict=True)]
        replay_records(first, lengths, (exact, full), {"deepest": (exact, deepest)}, gamma=p.gamma,
                       block_arms=["deepest"], batch_size=p.replay_batch)
        del exact
    del model32
    acceptance_by_cache(model, _prompts(model, profile, p.acceptance_prompts), {"full": {"cache": "full"}},
                        p.acceptance_tokens, draft_loops=p.draft_loops, gamma=p.gamma, rows_per_chunk=rows)


def ch05(model: LoopedLM, profile: profiles.Profile) -> None:
    p, rows = profile.ch05, profile.rows_per_chunk
    measure.agreement_by_prompt(model, _prompts(model, profile, p.agreement_prompts), p.agreement_tokens, [1, 4],
                                ("aligned", "deep-v"), stop_at_eos=False, rows_per_chunk=rows)
    methods = bench.method_configs(p.draft_loops, p.gamma, methods=["mature-spec"])
    bench.acceptance_runs(model, _prompts(model, profile, p.acceptance_prompts), methods, p.acceptance_tokens,
                          rows_per_chunk=rows)


def ch06(model: LoopedLM, profile: profiles.Profile) -> None:
    p = profile.ch06
    methods = bench.method_configs(profile.ch05.draft_loops, profile.ch05.gamma, methods=["das-wave"])
    bench.acceptance_runs(model, _prompts(model, profile, p.acceptance_prompts), methods, p.acceptance_tokens,
                          rows_per_chunk=profile.rows_per_chunk)


def ch07(model: LoopedLM, profile: profiles.Profile) -> None:
    p = profile.ch07
    largest = max(*p.batch_sizes, *p.memory_batch_sizes)
    generate(model, _prompts(model, profile, largest), max_new_tokens=p.new_tokens, stop_at_eos=False,
             method="self-spec", draft_loops=p.draft_loops)


def ch08(model: LoopedLM, profile: profiles.Profile) -> None:
    p, rows = profile.ch08, profile.rows_per_chunk
    chains = token_ids(model, p.chain_programs, p.chain_tokens)
    last = torch.full((p.chain_programs,), p.chain_tokens - 1)
    teacher_forced_exits(model, chains, torch.arange(p.chain_programs), last, {"kl": ("kl", None)},
                         targets=torch.ones(p.chain_programs, dtype=torch.long), planes=True, rows_per_chunk=rows)
    generate(model, list(chains), max_new_tokens=8, stop_at_eos=False, exit="kl", rows_per_chunk=rows)
    generate(model, _prompts(model, profile, p.prompts_per_workload), max_new_tokens=p.new_tokens, stop_at_eos=False,
             exit="kl", rows_per_chunk=rows)


RUNS: dict[str, Callable[[LoopedLM, profiles.Profile], None]] = {
    "ch01": ch01, "ch02": ch02, "ch03": ch03, "ch04": ch04, "ch05": ch05, "ch06": ch06, "ch07": ch07, "ch08": ch08}


def _run_steps(config: LoopedConfig, profile: profiles.Profile, chapter: str) -> list[plan.Step]:
    return [s for s in plan.CHAPTERS[chapter](config, profile).steps
            if not s.name.startswith(SKIPPED.get(chapter, ("-",)))]


def host_peak_beyond_weights(config: LoopedConfig, profile: profiles.Profile, chapter: str) -> int:
    """The plan's peak of a CPU run's steps: every byte less the weights the model already holds (the meter counts
    what the run allocates, and a model cast in place is new storage)."""
    resident = f"{profile.dtype} weights"  # a step without them holds the model cast in place: new storages
    return max(s.bytes(None) - sum(h.nbytes for h in s.held if h.what == resident)
               for s in _run_steps(config, profile, chapter))


def predicted_peak(model: LoopedLM, profile: profiles.Profile, chapter: str) -> int:
    """The plan's peak for the steps a run makes: on a GPU its GPU bytes; on a CPU
    :func:`host_peak_beyond_weights`."""
    if model.device.type == "cuda":
        return max(s.bytes(plan.GPU) for s in _run_steps(model.config, profile, chapter))
    return host_peak_beyond_weights(model.config, profile, chapter)


def measured_peak(model: LoopedLM, profile: profiles.Profile, chapter: str) -> tuple[int, float]:
    """Peak bytes of one chapter run (see the module's docstring for what is counted) and its seconds."""
    start = time.perf_counter()
    if model.device.type == "cuda":
        free_memory(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
        RUNS[chapter](model, profile)
        torch.cuda.synchronize(model.device)
        peak = torch.cuda.max_memory_allocated(model.device)
    else:
        peak, _ = tensor_peak_bytes(lambda: RUNS[chapter](model, profile))
    return peak, time.perf_counter() - start


def check(model: LoopedLM, profile: profiles.Profile, chapters: list[str] | None = None,
          progress: bool = True, each: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """Predicted against measured peak per chapter (bytes, their ratio) and each run's seconds; ``each`` is called
    with the table so far after every chapter (a long run keeps what it measured)."""
    chapters = chapters or list(RUNS)
    unknown = [c for c in chapters if c not in RUNS]
    if unknown:
        raise ValueError(f"chapters must be among {tuple(RUNS)}, got {unknown}")
    rows = []
    for chapter in tqdm(chapters, disable=not progress, desc="chapters"):
        peak, seconds = measured_peak(model, profile, chapter)
        predicted = predicted_peak(model, profile, chapter)
        rows.append({"chapter": chapter, "predicted bytes": predicted, "measured bytes": peak,
                     "predicted / measured": predicted / peak, "seconds": seconds})
        if each is not None:
            each(pd.DataFrame(rows).set_index("chapter"))
    return pd.DataFrame(rows).set_index("chapter")


def recorded(out: Path, model_name: str, profile: str) -> list[dict]:
    """The chapters an earlier run of the same model and profile recorded in ``out`` (``--resume``)."""
    record = json.loads(out.read_text())
    if (record.get("model"), record.get("profile")) != (model_name, profile):
        raise ValueError(f"--resume: {out} records model {record.get('model')!r} at profile "
                         f"{record.get('profile')!r}, not {model_name!r} at {profile!r}; choose another --out")
    return record["chapters"]


def run(model_name: str, config: LoopedConfig, profile: str | None = None, device: str = "cpu",
        chapters: list[str] | None = None, out: Path | None = None, resume: bool = False,
        command: str = "looped-kv plan-check") -> None:
    """Check ``config`` (the model given as ``model_name``) with random weights at ``profile`` (default: the
    model's for the GPU found) and print the table; write the record as JSON to ``out`` if given, after every
    chapter, with the ``command`` and the commit of each chapter's run. With ``resume``, ``out`` holds an earlier run
    of the same model and profile: its chapters are kept and not run again, and the new ones are added."""
    from looped_kv.experiments.gpu_check import random_model

    gpu = profiles.detect_gpu() if device.startswith("cuda") else None
    chosen = profiles.PROFILES[profile or profiles.name_for(config, model_name, gpu.card if gpu else None)]
    earlier = recorded(out, model_name, chosen.name) if resume else []
    commit = source_commit()
    done = {row["chapter"] for row in earlier}
    chapters = [c for c in (chapters or list(RUNS)) if c not in done]

    def write(table: pd.DataFrame) -> None:
        if out is not None:
            rows = earlier + [{**row, "command": command, "commit": commit, "date": date.today().isoformat()}
                              for row in table.reset_index().to_dict("records")]
            record = {"model": model_name, "profile": chosen.name, "environment": settings, "chapters": rows}
            out.write_text(json.dumps(record, indent=1) + "\n")

    with measurement_mode() as settings:
        model = random_model(config, device, _dtype(chosen.dtype))
        table = check(model, chosen, chapters, each=write)
    print(table.to_string(float_format=lambda x: f"{x:.3g}"))
