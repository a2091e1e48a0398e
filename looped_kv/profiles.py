"""What each chapter runs at, per model: prompts and tokens per arm, windows, dtypes, batch sizes.

A chapter holds no sizes of its own: it reads ``profile = profiles.for_model(model)`` and takes
``profile.ch05.acceptance_prompts`` and the like. The ``tiny`` profile is what CI executes on the
shipped model on a CPU in minutes. The real checkpoints' profiles keep the papers' settings where a
single GPU allows it: the papers' workloads (GSM8K eight-shot and MBPP, :mod:`looped_kv.workloads`), the RIPE
windows W = 64 and 256 unscaled, bf16 decoding with fp32 and fp64 replays whose records live in host memory, and
enough generated tokens to reach the positions where the papers saw their effects. ``looped-kv plan`` checks that
every chapter of a profile fits a GPU (:mod:`looped_kv.analysis.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from looped_kv.runtime.config import LoopedConfig


@dataclass(frozen=True)
class Ch01:
    """Looped models and planes: held-out loss and chain answers against loops, greedy samples, draft agreement."""

    texts_per_workload: int = 32  # held-out texts per workload, paired across loop counts
    text_chars: int = 400
    loops: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    shallow_loops: int = 4  # the loop count set against R (the tiny model's gate compares R = 4 with R = 32)
    chain_programs: int = 48  # evaluation chain programs whose answers are scored by loop count
    chain_tokens: int = 128  # the longest chain program, in tokens (the plan charges every program this length)
    prompts_per_workload: int = 32  # greedy generations per workload (one batch); drafts are scored on them
    new_tokens: int = 40


@dataclass(frozen=True)
class Ch02:
    """Planes ripen: replays of texts recording every loop's queries, keys and values."""

    texts_per_workload: int = 12  # 36 texts over the three workloads: at least verdicts.MIN_UNITS["paired"]
    length: int = 256
    decoded: int = 64
    replay_dtypes: tuple[str, ...] = ("float32", "bfloat16")  # the ripening fits' precision, then Eq. (5)'s
    exact_dtype: str = "float64"  # the replay that measures the rounding in the float32 planes (their floor)
    record_device: str = "model"  # where the replay's per-loop records are kept: "model" or "cpu"
    chunk: int = 12  # texts per replay: memory holds one chunk's planes


@dataclass(frozen=True)
class Ch03:
    """Prefix KV matters late: substitution arms (float32) with their KL floor (a float64 replay), the Eq. (6)
    check, and the Table 3 caches (in the model's own dtype, as the paper's bf16 Table 3)."""

    texts_per_workload: int = 11  # 33 texts over the three workloads: at least verdicts.MIN_UNITS["paired"]
    prefix: int = 95
    decoded: int = 32
    table3_texts_per_workload: int = 32  # 96 texts: a flip of one text's top-1 is about 1% of agreement
    table3_length: int = 96
    table3_chunk: int = 96  # texts per Table 3 prefill: memory holds one chunk's full cache
    arm_dtype: str = "float32"
    exact_dtype: str = "float64"
    exact_chunk: int | None = None  # texts per float64 replay (None: all at once)
    record_device: str = "model"


@dataclass(frozen=True)
class Ch04:
    """RIPE caching: replayed trajectories (bf16 reference, fp32 floor), windows, the Sec. 5.2 block dependence in
    a precision whose numerics do not hide it, Remark 1's ripeness, Algorithm 1's acceptance."""

    replay_prompts: int = 12  # per workload; the verdicts of Sec. 5.1-5.2 pool the workloads (36 prompts)
    replay_batch: int = 36  # trajectories replayed together per cache arm (the cache holds them all)
    new_tokens: int = 128  # generated tokens per replayed trajectory: past Huginn's tail positions (40-70)
    stop_at_eos: bool = False  # replayed trajectories run to new_tokens (a row that emits end-of-text continues)
    windows: tuple[int, ...] = ()  # empty: the paper's windows scaled to the trajectory length
    drawn: tuple[int, int] = (40, 8)  # the query t and window W > gamma of the drawn policy maps
    exact_prompts: int = 2  # per workload: Algorithm 1 against sequential RIPE decoding in exact_dtype (asserted
    # equal in float64; in a narrower dtype rounding can split near-ties, so equality is counted, not asserted)
    acceptance_prompts: int = 32  # per workload, decoded as one batch
    acceptance_tokens: int = 24
    block: int = 4
    draft_loops: int = 4
    reference_dtype: str = "bfloat16"
    exact_dtype: str = "float64"
    block_dtype: str | None = "float64"  # the Sec. 5.2 replay without bf16's numerics (None: not run) ...
    block_tokens: int = 64  # ... of each trajectory's first generated tokens
    ripeness_texts_per_workload: int = 4  # Remark 1's test (chapter 2's replays, at chapter 2's sizes) on 12 texts


@dataclass(frozen=True)
class Ch05:
    """Mature-V: draft agreement by read policy, the read-depth grid, acceptance along the block, speed-ups."""

    agreement_prompts: int = 32  # per workload, decoded as one batch (DAS Table 6)
    agreement_tokens: int = 24
    grid_prompts: int = 8  # a separate cohort, as DAS Figure 4's 8 prompts (descriptive)
    grid_tokens: int = 24
    acceptance_prompts: int = 32  # per workload, decoded as one batch
    acceptance_tokens: int = 32
    draft_loops: int = 4  # d of self-spec and Mature-Spec (DAS Sec. 4.3 compares the reads at d = 4)
    block: int = 8  # gamma (DAS Table 5: Mature-Spec on Huginn)
    timing_prompts: int = 4  # per workload, each decoded alone (a speed verdict needs 16, timed in repeats)
    timing_repeats: int = 1  # interleaved timing rounds per prompt (a speed verdict needs 2)
    new_tokens: int = 32  # per timing run


@dataclass(frozen=True)
class Ch06:
    """DAS-Wave: one block drawn at the measured schedule, speed-ups, A against the ceiling, the factorial, the
    refinement budget."""

    acceptance_prompts: int = 32  # per workload, decoded as one batch (A against w, the factorial)
    acceptance_tokens: int = 24  # one DAS-Wave block commits up to w = 25 of them
    timing_prompts: int = 3  # per workload, each decoded alone (a speed verdict needs 16, timed in repeats)
    timing_repeats: int = 1  # interleaved timing rounds per prompt (a speed verdict needs 2)
    new_tokens: int = 32  # per timing run
    sweep_prompts: int = 2  # word problems, each decoded alone (DAS Tables 11-12 use GSM8K); intervals from 16
    sweep: dict = field(default_factory=lambda: {"updates": (1, 2, 4, 8), "block": (8, 16, 32),
                                                 "initial_width": (1, 2, 4, 8)})


@dataclass(frozen=True)
class Ch07:
    """Memory and throughput: tokens/s and peak memory against the batch size, the fixed-memory comparison."""

    check_rows: int = 4  # prompts decoded alone and as one batch, whose tokens are compared
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    memory_batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    new_tokens: int = 16
    prompts: int = 8
    budget_sequences: float = 4.5  # the fixed-memory budget: the fitted peak of this many full-cache sequences


@dataclass(frozen=True)
class Profile:
    """Sizes of every chapter for one model, and the precision decoding runs in."""

    name: str
    dtype: str  # weights dtype for decoding
    workloads: str = "generated"  # "generated" (looped_kv.data) or "papers" (GSM8K and MBPP; looped_kv.workloads)
    prompt_tokens: int = 256  # the longest prompt a chapter decodes from; the plan charges every prompt this length
    rows_per_pass: int | None = None  # a batch decode runs at most this many rows at once (None: all)
    ch01: Ch01 = field(default_factory=Ch01)
    ch02: Ch02 = field(default_factory=Ch02)
    ch03: Ch03 = field(default_factory=Ch03)
    ch04: Ch04 = field(default_factory=Ch04)
    ch05: Ch05 = field(default_factory=Ch05)
    ch06: Ch06 = field(default_factory=Ch06)
    ch07: Ch07 = field(default_factory=Ch07)

    def chapters(self) -> dict[str, object]:
        return {f"ch0{i}": getattr(self, f"ch0{i}") for i in range(1, 8)}


TINY = Profile("tiny", "float32")

#: Huginn-0125 on one 40 GB GPU (A100-40GB), on the papers' workloads: bf16 decoding in passes of 4 rows from
#: eight-shot GSM8K prompts (held to 1,536 tokens); replays in fp32 with their records on the host; the exactness
#: check of Algorithm 1 in fp32 (fp64 weights and caches do not fit beside bf16 ones); the block dependence of
#: Sec. 5.2 in bf16 only, as the paper measured it (an fp32 replay's caches of 1,536-token prompts would not fit
#: beside the fp32 copy); 16 timed prompts in 2 interleaved rounds, the fewest a speed verdict accepts.
#: ``looped-kv plan --model huginn-0125 --gpu-memory 40`` shows each chapter's peak against the GPU.
HUGINN_0125 = Profile(
    "huginn-0125", "bfloat16", workloads="papers", prompt_tokens=1536, rows_per_pass=4,
    ch01=Ch01(texts_per_workload=32, text_chars=1200, chain_programs=64, chain_tokens=256, new_tokens=64),
    ch02=Ch02(texts_per_workload=11, length=256, decoded=64, record_device="cpu", chunk=2),
    ch03=Ch03(texts_per_workload=11, prefix=95, decoded=32, table3_texts_per_workload=32, table3_length=96,
              table3_chunk=8, exact_chunk=11, record_device="cpu"),
    ch04=Ch04(replay_prompts=32, replay_batch=1, new_tokens=256, stop_at_eos=True, windows=(16, 64, 256),
              exact_prompts=1, exact_dtype="float32", block_dtype=None, acceptance_prompts=32,
              acceptance_tokens=64),
    ch05=Ch05(agreement_prompts=32, agreement_tokens=64, grid_prompts=8, grid_tokens=48, acceptance_prompts=32,
              acceptance_tokens=128, timing_prompts=16, timing_repeats=2, new_tokens=128),
    ch06=Ch06(acceptance_prompts=32, acceptance_tokens=128, timing_prompts=16, timing_repeats=2, new_tokens=128,
              sweep_prompts=16),
    ch07=Ch07(batch_sizes=(1, 2, 3, 4, 5), memory_batch_sizes=(1, 2, 3, 4, 5), new_tokens=64, prompts=32),
)
#: The Raven retrofits (Llama-3.2 1B, OLMo-2 1B): smaller, so the same sizes with longer replays.
RAVEN = replace(HUGINN_0125, name="raven", ch02=replace(HUGINN_0125.ch02, length=512))

PROFILES = {"tiny": TINY, "huginn-0125": HUGINN_0125, "raven-llama": replace(RAVEN, name="raven-llama"),
            "raven-olmo": replace(RAVEN, name="raven-olmo")}


def name_for(config: LoopedConfig, source: str = "") -> str:
    """The profile a model runs at: 'tiny' for the shipped model, else by family and width."""
    if source == "tiny" or config.n_embd <= 512:
        return "tiny"
    if config.family == "huginn":
        return "huginn-0125"
    return "raven-olmo" if config.family == "raven-olmo" else "raven-llama"


def for_model(model: object) -> Profile:
    """The profile of a loaded model (``$LOOPED_KV_PROFILE`` names another one)."""
    import os

    chosen = os.environ.get("LOOPED_KV_PROFILE") or name_for(model.config, getattr(model, "source", ""))
    if chosen not in PROFILES:
        raise ValueError(f"LOOPED_KV_PROFILE must be one of {tuple(PROFILES)}, got {chosen!r}")
    return PROFILES[chosen]
