"""What each chapter runs at, per model: prompts and tokens per arm, windows, dtypes, batch sizes.

A chapter holds no sizes of its own: it reads ``profile = profiles.for_model(model)`` and takes
``profile.ch05.acceptance_prompts`` and the like. The ``tiny`` profile is what CI executes on the
shipped model on a CPU in minutes. The real checkpoints' profiles keep the papers' settings where a
single GPU allows it: the papers' workloads (GSM8K eight-shot and MBPP, :mod:`looped_kv.workloads`), the RIPE
windows W = 64 and 256 unscaled, bf16 decoding with fp32 and fp64 replays whose records live in host memory, and
enough generated tokens to reach the positions where the papers saw their effects. ``looped-kv plan`` checks that
every chapter of a profile fits a GPU (:mod:`looped_kv.analysis.plan`).

Each published model has a profile per GPU class (:data:`CARDS`: a 16 GB T4, a 24 GB L4, 40 and 80 GB cards),
named ``<model>-<card>`` (the 40 GB ones keep the model's name): :func:`for_model` picks the one of the model at
hand and of the GPU it finds (its memory, and whether it runs bfloat16 natively; a T4 does not, so its profiles
decode in float16), and ``$LOOPED_KV_PROFILE`` names another. Where a smaller card cannot hold a measurement at the
40 GB profile's precision, its profile runs it one precision lower and says so in its comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace

from looped_kv import papers
from looped_kv.runtime.config import PRESETS, LoopedConfig


@dataclass(frozen=True)
class Ch01:
    """Looped models and planes: held-out loss and chain answers against loops, greedy samples, draft agreement."""

    texts_per_workload: int = 32  # held-out texts per workload, paired across loop counts
    text_chars: int = 400
    loops: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    shallow_loops: int = 4  # the loop count set against R (the tiny model's gate compares R = 4 with R = 32)
    draft_depths: tuple[int, ...] = papers.DAS_TABLE_6_DEPTHS  # d of the draft-agreement table, each below R
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
    gamma: int = 4
    draft_loops: int = 4
    reference_dtype: str = "bfloat16"
    exact_dtype: str = "float64"
    block_dtype: str | None = "float64"  # the Sec. 5.2 replay without bf16's numerics (None: not run) ...
    block_tokens: int = 64  # ... of each trajectory's first generated tokens
    shape_prompts: int = 32  # per workload: the full cache's batched and sequential decoders in bf16 (Sec. 5.5) ...
    shape_tokens: int = 64  # ... each decoding this many tokens
    ripeness_texts_per_workload: int = 12  # Remark 1's test on chapter 2's texts (Ch02.texts_per_workload), so both
    # chapters fit one floor: on 12 texts the floor fit ran off towards zero (fits.FloorFit.resolved)


@dataclass(frozen=True)
class Ch05:
    """Mature-V: draft agreement by read policy, the read-depth grid, acceptance along the drafts, speed-ups."""

    agreement_prompts: int = 32  # per workload, decoded as one batch (DAS Table 6)
    agreement_tokens: int = 24
    draft_depths: tuple[int, ...] = papers.DAS_TABLE_6_DEPTHS  # d of the Table 6 agreement, each below R
    grid_prompts: int = 8  # a separate cohort, as DAS Figure 4's 8 prompts (descriptive)
    grid_tokens: int = 24
    acceptance_prompts: int = 32  # per workload, decoded as one batch
    acceptance_tokens: int = 32
    draft_loops: int = 4  # d of self-spec and Mature-Spec (DAS Sec. 4.3 compares the reads at d = 4)
    gamma: int = 8  # DAS Table 5: Mature-Spec on Huginn
    timing_prompts: int = 4  # per workload, each decoded alone (a speed verdict needs 16, timed in repeats)
    timing_repeats: int = 1  # interleaved timing rounds per prompt (a speed verdict needs 2)
    new_tokens: int = 32  # per timing run
    temperatures: tuple[float, ...] = (0.0, 0.5, 1.0)  # acceptance under speculative sampling (0: greedy)


@dataclass(frozen=True)
class Ch06:
    """DAS-Wave: one wave drawn at the measured schedule, speed-ups, A against the ceiling, the factorial, the
    refinement budget."""

    acceptance_prompts: int = 32  # per workload, decoded as one batch (A against w, the factorial)
    #: per prompt: room for bench.MIN_VERIFICATIONS (3) DAS-Wave verifications of w = 25 tokens and more, so that a
    #: carried cell's G is what carry commits and not the budget (24, below w, let it verify once)
    acceptance_tokens: int = 96
    timing_prompts: int = 3  # per workload, each decoded alone (a speed verdict needs 16, timed in repeats)
    timing_repeats: int = 1  # interleaved timing rounds per prompt (a speed verdict needs 2)
    new_tokens: int = 32  # per timing run
    sweep_prompts: int = 2  # word problems, each decoded alone (DAS Tables 11-12 use GSM8K); intervals from 16
    sweep: dict = field(default_factory=lambda: {"updates": (1, 2, 4, 8), "max_width": (8, 16, 32),
                                                 "initial_width": (1, 2, 4, 8)})


@dataclass(frozen=True)
class Ch07:
    """Memory and throughput: tokens/s and peak memory against the batch size, the fixed-memory comparison."""

    check_rows: int = 4  # prompts decoded alone and as one batch, whose tokens are compared
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    throughput_repeats: int = 3  # runs per throughput cell, the fastest kept: one slowed run would set a cell alone
    memory_batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    new_tokens: int = 16
    prompts: int = 8
    budget_sequences: float = 4.5  # the fixed-memory budget: the fitted peak of this many full-cache sequences
    fixed_memory_sets: int = 16  # disjoint sets of ``prompts`` prompts: the units of the fixed-memory verdict
    draft_loops: int = 4  # d of the batched self-speculation


@dataclass(frozen=True)
class Ch08:
    """Adaptive depth: exit loops, chain answers and text continuations per exit criterion against full depth, what
    exited tokens leave in a share(k) cache under both read policies, and a timing that illustrates."""

    chain_programs: int = 64  # evaluation chain programs: answers at every loop (teacher-forced) and decoded
    chain_tokens: int = 256  # the longest chain program with its query, in tokens (the plan charges every one this)
    prompts_per_workload: int = 8  # problems and code prompts, decoded as one batch per exit rule
    new_tokens: int = 32
    #: thresholds swept per criterion (each list holds the reference code's default), on the chains' answers
    sweep: dict = field(default_factory=lambda: {"kl": (1e-1, 1e-2, 1e-3, 1e-4, 1e-5),
                                                 "latent": (0.3, 0.1, 0.03, 0.01, 0.003)})
    fixed_loops: tuple[int, ...] = (2, 4, 8, 16, 24)  # fixed exits below R: every token at one depth
    share_k: int = 4  # the share(k) cache under which the two read policies of exited tokens differ
    timing_prompts: int = 3  # word problems, each decoded alone (a speed verdict needs 16, timed in repeats)
    timing_repeats: int = 1  # interleaved timing rounds per prompt (a speed verdict needs 2)
    timing_tokens: int = 32


@dataclass(frozen=True)
class Profile:
    """Sizes of every chapter for one model, and the precision decoding runs in."""

    name: str
    dtype: str  # weights dtype for decoding
    workloads: str = "generated"  # "generated" (looped_kv.workloads.data) or "papers" (GSM8K and MBPP)
    prompt_tokens: int = 256  # the longest prompt a chapter decodes from; the plan charges every prompt this length
    rows_per_chunk: int | None = None  # a batch decode runs at most this many rows at once (None: all)
    ch01: Ch01 = field(default_factory=Ch01)
    ch02: Ch02 = field(default_factory=Ch02)
    ch03: Ch03 = field(default_factory=Ch03)
    ch04: Ch04 = field(default_factory=Ch04)
    ch05: Ch05 = field(default_factory=Ch05)
    ch06: Ch06 = field(default_factory=Ch06)
    ch07: Ch07 = field(default_factory=Ch07)
    ch08: Ch08 = field(default_factory=Ch08)

    def chapters(self) -> dict[str, object]:
        return {f"ch0{i}": getattr(self, f"ch0{i}") for i in range(1, 9)}


TINY = Profile("tiny", "float32")
#: A fixture-sized model (a conformance fixture with a character tokenizer; ``tests/test_chapters_on_ouro.py``):
#: the fewest texts, prompts and tokens each chapter runs on, so a chapter runs in seconds. Loop counts up to 8 and
#: drafts at 1-3 loops suit a model of R = 4 (Ouro's) as well as a deeper one; its numbers mean nothing.
SMOKE = Profile(
    "smoke", "float32", prompt_tokens=512,
    ch01=Ch01(texts_per_workload=3, text_chars=160, loops=(1, 2, 4, 8), shallow_loops=2, draft_depths=(1, 2, 3),
              chain_programs=6, prompts_per_workload=2, new_tokens=6),
    ch02=Ch02(texts_per_workload=2, length=96, decoded=16, chunk=6),
    ch03=Ch03(texts_per_workload=2, prefix=64, decoded=8, table3_texts_per_workload=2, table3_length=48,
              table3_chunk=6),
    ch04=Ch04(replay_prompts=2, replay_batch=2, new_tokens=10, drawn=(24, 6), exact_prompts=1, acceptance_prompts=2,
              acceptance_tokens=8, gamma=3, draft_loops=2, shape_prompts=1, shape_tokens=8),
    ch05=Ch05(agreement_prompts=2, agreement_tokens=6, draft_depths=(1, 2, 3), grid_prompts=2, grid_tokens=6,
              acceptance_prompts=2, acceptance_tokens=8, draft_loops=2, gamma=3, timing_prompts=1, new_tokens=6),
    ch06=Ch06(acceptance_prompts=2,
              acceptance_tokens=8, timing_prompts=1, new_tokens=6, sweep_prompts=1,
              sweep={"updates": (1, 2), "max_width": (4,), "initial_width": (1, 2)}),
    ch07=Ch07(check_rows=2, batch_sizes=(1, 2), memory_batch_sizes=(1, 2, 3), new_tokens=6, prompts=3,
              draft_loops=2),
    ch08=Ch08(chain_programs=4, prompts_per_workload=2, new_tokens=6, fixed_loops=(1, 2, 3), share_k=2,
              timing_prompts=1, timing_tokens=6),
)

#: Huginn-0125 on one 40 GB GPU (A100-40GB), on the papers' workloads: bf16 decoding in row chunks of 4 rows from
#: eight-shot GSM8K prompts (held to 1,536 tokens); replays in fp32 with their records on the host; the exactness
#: check of Algorithm 1 in fp32 (fp64 weights and caches do not fit beside bf16 ones); the block dependence of
#: Sec. 5.2 in bf16 only, as the paper measured it (an fp32 replay's caches of 1,536-token prompts would not fit
#: beside the fp32 copy); 16 timed prompts in 2 interleaved rounds, the fewest a speed verdict accepts.
#: ``looped-kv plan --model huginn-0125 --gpu-memory 40`` shows each chapter's peak against the GPU.
HUGINN_0125 = Profile(
    "huginn-0125", "bfloat16", workloads="papers", prompt_tokens=1536, rows_per_chunk=4,
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
    ch08=Ch08(chain_programs=256, prompts_per_workload=32, new_tokens=128, timing_prompts=4, timing_tokens=128),
)
#: The Raven retrofits (Llama-3.2 1B, OLMo-2 1B, TinyLlama 1.1B): smaller, so the same sizes with longer replays.
RAVEN = replace(HUGINN_0125, name="raven", ch02=replace(HUGINN_0125.ch02, length=512))
#: Ouro-1.4B and -2.6B (R = 4 loops of the whole stack): loop counts up to twice R, the shallow side of every
#: comparison and the drafts at 2 of the 4 loops, draft agreement (chapters 1 and 5) at d = 1, 2, 3; otherwise
#: Raven's sizes.
OURO = replace(RAVEN, name="ouro-1.4b",
               ch01=replace(RAVEN.ch01, loops=(1, 2, 3, 4, 6, 8), shallow_loops=2, draft_depths=(1, 2, 3)),
               ch04=replace(RAVEN.ch04, draft_loops=2),
               ch05=replace(RAVEN.ch05, draft_loops=2, draft_depths=(1, 2, 3)),
               ch07=replace(RAVEN.ch07, draft_loops=2),
               ch08=replace(RAVEN.ch08, fixed_loops=(1, 2, 3), share_k=2))

#: Parcae (R = 8 loops of 2-8 core layers; Prairie et al., 2026): Raven's sizes, loop counts up to twice R, the
#: shallow side of every comparison and the drafts at 2 of the 8 loops (a quarter of R, as Ouro's 2 of 4), draft
#: agreement at d = 1, 2, 4.
PARCAE = replace(RAVEN, name="parcae-140m",
                 ch01=replace(RAVEN.ch01, loops=(1, 2, 4, 6, 8, 12, 16), shallow_loops=2, draft_depths=(1, 2, 4)),
                 ch04=replace(RAVEN.ch04, draft_loops=2),
                 ch05=replace(RAVEN.ch05, draft_loops=2, draft_depths=(1, 2, 4)),
                 ch07=replace(RAVEN.ch07, draft_loops=2),
                 ch08=replace(RAVEN.ch08, fixed_loops=(1, 2, 4, 6), share_k=2))


#: A laptop's memory (GB) that every chapter of the CPU profiles of Parcae-140M and -370M fits (``looped-kv plan``).
LAPTOP_GB = 16


def _cpu(profile: Profile) -> Profile:
    """A laptop-CPU version of a model's profile: float32 weights and caches, the shipped tiny model's sizes per
    chapter (the chapters' defaults) with the model's own loop counts and draft depths, and the papers' prompts;
    chapter 4 replays 4 trajectories at a time (36 at once held 34 GB at Parcae-140M's dimensions)."""
    p = profile
    return replace(p, name=f"{p.name}-cpu", dtype="float32", rows_per_chunk=4,
                   ch01=replace(Ch01(), loops=p.ch01.loops, shallow_loops=p.ch01.shallow_loops,
                                draft_depths=p.ch01.draft_depths, chain_tokens=p.ch01.chain_tokens),
                   ch02=Ch02(), ch03=Ch03(),
                   ch04=replace(Ch04(), draft_loops=p.ch04.draft_loops, stop_at_eos=True, replay_batch=4),
                   ch05=replace(Ch05(), draft_loops=p.ch05.draft_loops, draft_depths=p.ch05.draft_depths),
                   ch06=Ch06(), ch07=replace(Ch07(), draft_loops=p.ch07.draft_loops),
                   ch08=replace(Ch08(), fixed_loops=p.ch08.fixed_loops, share_k=p.ch08.share_k))


@dataclass(frozen=True)
class Card:
    """A class of GPU a profile is sized for."""

    name: str
    memory_gb: float  # what ``looped-kv plan --gpu-memory`` is given (10^9 bytes)
    bf16: bool  # native bfloat16 (compute capability 8.0 or later)
    example: str


CARDS = {"t4": Card("t4", 16, False, "NVIDIA T4 (a free Colab GPU)"), "l4": Card("l4", 24, True, "NVIDIA L4"),
         "40gb": Card("40gb", 40, True, "A100-40GB"), "80gb": Card("80gb", 80, True, "A100-80GB, H100")}
#: The card the real checkpoints' profiles are sized for when no GPU is found (a CPU run, ``looped-kv plan``).
DEFAULT_CARD = "40gb"


def _t4(profile: Profile, *, rows: int = 1, chains: int = 32, fp64_fits: bool = False) -> Profile:
    """A T4 version of a 40 GB profile: float16 wherever that one runs bfloat16 (decoding, chapter 2's Eq. (5)
    replay, chapter 4's reference), chapter 4's exactness check in float32, ``rows`` rows per chunk, ``chains``
    chain programs per forward. Unless ``fp64_fits`` (float64 weights beside the float16 model's), the float64
    floors move one precision down: chapter 2 fits its ripening in float16 (the model itself, cast in place to
    float64 for its floor), chapter 3 runs its arms in float16 against a float32 floor."""
    p = profile
    ch02 = replace(p.ch02, replay_dtypes=("float32" if fp64_fits else "float16", "float16"))
    ch03 = p.ch03 if fp64_fits else replace(p.ch03, arm_dtype="float16", exact_dtype="float32")
    return replace(p, name=f"{p.name}-t4", dtype="float16", rows_per_chunk=rows,
                   ch01=replace(p.ch01, chain_programs=chains), ch02=ch02, ch03=ch03,
                   ch04=replace(p.ch04, reference_dtype="float16", exact_dtype="float32"))


def _l4(profile: Profile) -> Profile:
    """A 24 GB version of a 40 GB profile of a model whose float32 copy fills most of the card (Huginn-0125,
    Ouro-2.6B): one row per chunk, chapter 2 fits its ripening in bfloat16 (the model, cast in place to float32 for
    its floor), chapter 3 runs its arms in bfloat16 against a float32 floor, chapter 4 checks Algorithm 1 in bfloat16
    (counted, not asserted), chapter 7 batches of at most 2."""
    p = profile
    return replace(p, name=f"{p.name}-l4", rows_per_chunk=1,
                   ch02=replace(p.ch02, replay_dtypes=("bfloat16", "bfloat16"), exact_dtype="float32"),
                   ch03=replace(p.ch03, arm_dtype="bfloat16", exact_dtype="float32"),
                   ch04=replace(p.ch04, exact_dtype="bfloat16"),
                   ch07=replace(p.ch07, batch_sizes=(1, 2), memory_batch_sizes=(1, 2)))


_BASES = {"huginn-0125": HUGINN_0125, "raven-llama": replace(RAVEN, name="raven-llama"),
          "raven-olmo": replace(RAVEN, name="raven-olmo"), "raven-tinyllama": replace(RAVEN, name="raven-tinyllama"),
          "ouro-1.4b": OURO, "ouro-2.6b": replace(OURO, name="ouro-2.6b"),
          **{name: replace(PARCAE, name=name) for name in ("parcae-140m", "parcae-370m", "parcae-770m", "parcae-1.3b")}}
#: model -> card -> profile. A 40 GB profile that fits a smaller card serves it too (the L4 for every model but
#: Huginn-0125 and Ouro-2.6B); an 80 GB profile is the 40 GB one with 8 rows per chunk. A model with no profile that
#: fits a card (Huginn-0125 and Ouro-2.6B on a T4) is given its smallest, and ``looped-kv plan`` names what does not.
BY_CARD: dict[str, dict[str, Profile]] = {}
for _model, _base in _BASES.items():
    _l4_profile = _l4(_base) if _model in ("huginn-0125", "ouro-2.6b") else _base
    _t4_profile = {"huginn-0125": _l4_profile, "ouro-2.6b": _l4_profile,
                   "raven-tinyllama": _t4(_base, rows=2, chains=64, fp64_fits=True),
                   **{name: _t4(_base, fp64_fits=True) for name in ("parcae-140m", "parcae-370m", "parcae-770m")}
                   }.get(_model) or _t4(_base)
    BY_CARD[_model] = {"t4": _t4_profile, "l4": _l4_profile, "40gb": _base,
                       "80gb": replace(_base, name=f"{_base.name}-80gb", rows_per_chunk=8)}

#: model -> its laptop-CPU profile, chosen where no GPU is found: the models small enough to run every chapter on a
#: CPU (Parcae's). The others run their :data:`DEFAULT_CARD` profile there (``looped-kv plan`` sizes it).
ON_CPU: dict[str, Profile] = {model: _cpu(BY_CARD[model][DEFAULT_CARD]) for model in BY_CARD
                              if model.startswith("parcae-")}
PROFILES = {"tiny": TINY, "smoke": SMOKE, **{p.name: p for cards in BY_CARD.values() for p in cards.values()},
            **{p.name: p for p in ON_CPU.values()}}
MODELS = tuple(BY_CARD)
#: profile name -> the published model it is sized for (every profile of BY_CARD and ON_CPU).
MODEL_OF = {**{p.name: model for model, cards in BY_CARD.items() for p in cards.values()},
            **{p.name: model for model, p in ON_CPU.items()}}
#: The CPU profiles' names (``looped-kv plan`` sizes them against a laptop's memory).
CPU_PROFILES = tuple(p.name for p in ON_CPU.values())


def _shown(value: object) -> str:
    return ", ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def changes(profile: Profile, base: Profile) -> list[str]:
    """Every setting in which ``profile`` differs from ``base``, as 'field: base's value -> profile's' (a chapter's
    fields as ``ch02.replay_dtypes``)."""
    out = []
    for f in fields(Profile):
        old, new = getattr(base, f.name), getattr(profile, f.name)
        if f.name == "name" or old == new:
            continue
        pairs = [(f"{f.name}.{g.name}", getattr(old, g.name), getattr(new, g.name)) for g in fields(old)] \
            if is_dataclass(old) else [(f.name, old, new)]
        out += [f"{name}: {_shown(a)} -> {_shown(b)}" for name, a, b in pairs if a != b]
    return out


def model_name(config: LoopedConfig, source: str = "") -> str:
    """The published model a config is (a preset of :data:`~looped_kv.runtime.config.PRESETS` with the same family,
    widths and layers), or 'tiny' for the shipped model and other small ones, else the closest of its family."""
    if source == "tiny" or config.n_embd <= 512:
        return "tiny"
    shape = lambda c: (c.family, c.n_embd, c.n_heads, c.n_kv_heads, c.n_prelude, c.n_core, c.n_coda)  # noqa: E731
    for name, preset in PRESETS.items():
        if shape(preset()) == shape(config) and name in BY_CARD:
            return name
    if config.family == "ouro":
        return "ouro-1.4b" if config.n_core <= 24 else "ouro-2.6b"
    return {"huginn": "huginn-0125", "raven-olmo": "raven-olmo"}.get(config.family, "raven-llama")


def name_for(config: LoopedConfig, source: str = "", card: str | None = None) -> str:
    """The profile a model runs at on a GPU of class ``card`` (None: no GPU): 'tiny' for the shipped model and other
    small ones, else its model's profile for that card (:data:`BY_CARD`), or without a GPU its CPU profile
    (:data:`ON_CPU`) or else its :data:`DEFAULT_CARD` one."""
    model = model_name(config, source)
    if model == "tiny":
        return "tiny"
    if card is None and model in ON_CPU:
        return ON_CPU[model].name
    card = card or DEFAULT_CARD
    if card not in CARDS:
        raise ValueError(f"card must be one of {tuple(CARDS)}, got {card!r}")
    return BY_CARD[model][card].name


@dataclass(frozen=True)
class Gpu:
    """The GPU a run found: its name, memory (10^9 bytes) and native bfloat16."""

    name: str
    memory_gb: float
    bf16: bool

    @property
    def card(self) -> str:
        return card_for(self.memory_gb, self.bf16)


def card_for(memory_gb: float, bf16: bool = True) -> str:
    """The GPU class of a GPU with ``memory_gb`` (10^9 bytes): one without native bfloat16 is sized as a T4 (its
    profiles run float16), else the largest class whose memory it has, to 90% (a "16 GB" T4 reports 15.8)."""
    sized = [c.name for c in CARDS.values() if memory_gb >= 0.9 * c.memory_gb and (bf16 or not c.bf16)]
    return sized[-1] if sized else "t4"


def detect_gpu() -> Gpu | None:
    """The first CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Gpu(props.name, props.total_memory / 1e9, torch.cuda.get_device_capability(0) >= (8, 0))


def for_config(config: LoopedConfig, source: str = "", gpu: Gpu | None = None) -> Profile:
    """The profile of a model of ``config`` on ``gpu`` (default: the GPU found, if any; without one, its CPU profile
    or else the :data:`DEFAULT_CARD` one: :func:`name_for`); ``$LOOPED_KV_PROFILE`` names another one."""
    import os

    chosen = os.environ.get("LOOPED_KV_PROFILE")
    if not chosen:
        gpu = gpu or detect_gpu()
        chosen = name_for(config, source, gpu.card if gpu else None)
    if chosen not in PROFILES:
        raise ValueError(f"LOOPED_KV_PROFILE must be one of {tuple(PROFILES)}, got {chosen!r}")
    return PROFILES[chosen]


def for_model(model: object, gpu: Gpu | None = None) -> Profile:
    """The profile of a loaded model (:func:`for_config` of its config and source)."""
    return for_config(model.config, getattr(model, "source", ""), gpu)
