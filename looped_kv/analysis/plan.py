"""Will a chapter fit one GPU? The package's own accounting of what each chapter allocates.

Every chapter is a few steps (a replay, a batch decode, a copy of the weights in another dtype), and at each
step some tensors are live: weights in each dtype, replay records, KV caches, logits and the working set of
one forward pass. :func:`chapter_plans` lists them per step from a config and a run profile
(:mod:`looped_kv.profiles`), on the model's device ("gpu") or in host memory ("host", where a profile keeps
its replay records), and a chapter's peak is its largest step. The sizes follow the code the chapters run:
:func:`~looped_kv.analysis.planes.ripening_curves`, :func:`~looped_kv.analysis.planes.arm_grid`,
:func:`~looped_kv.analysis.ripe.replay_records`, :func:`looped_kv.generate` and so on; ``tests/test_plan.py``
measures the same calls on a scaled-down random model and holds each prediction to 10% of the measured peak.

Prompt lengths are not known before tokenizing, so a profile states the longest prompt it feeds
(``prompt_tokens``) and the plan charges every prompt that length: an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from looped_kv import profiles
from looped_kv.decoding.settings import DasWave, SelfSpec
from looped_kv.profiles import Profile
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.memory import element_bytes, layer_token_bytes, m_full, policy_bytes
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import CachePolicy, make_policy

GPU, HOST = "gpu", "host"
GB = 1e9
# The CUDA context, cuBLAS workspaces and allocator fragmentation that no tensor accounts for; a plan keeps
# this much of the GPU free.
GPU_RESERVE = 1.5e9


def parameter_count(config: LoopedConfig) -> int:
    """Parameters of a model of ``config`` (tied embeddings counted once), built on the meta device."""
    with torch.device("meta"):
        model = LoopedLM(config)
    return sum(p.numel() for p in model.parameters())


def weights(config: LoopedConfig, dtype: str | torch.dtype) -> int:
    """Bytes of the weights in ``dtype``, with the rotary tables and the table of initial states of the first
    1,024 positions (the first block of :meth:`LoopedLM._state_table`; Ouro starts from the embedding and has none)."""
    tables = 2 * config.block_size * (config.head_dim // 2) * _bytes(dtype)
    if not config.looped_stack:
        tables += 1024 * config.n_embd * _bytes(dtype)
    return parameter_count(config) * _bytes(dtype) + tables


def logits(config: LoopedConfig, rows: int, tokens: int, dtype: str | torch.dtype = "fp32") -> int:
    """The logits a forward returns: float32, or float64 from a float64 model (:meth:`LoopedLM.readout`)."""
    return rows * tokens * config.vocab_size * (8 if _bytes(dtype) == 8 else 4)


def forward_peak(config: LoopedConfig, rows: int, tokens: int, dtype: str | torch.dtype, *,
                 softmax_dtype: str | torch.dtype | None = None, reads: int | None = None) -> int:
    """Peak bytes of one forward pass over rows x tokens, its returned logits included.

    The larger of one core layer and the readout. The layer holds the loop's state, its input e and their
    concatenation, the float32 norm, and either the q/k/v projections with their float32 rotary copies and,
    with an explicit softmax (``softmax_dtype``, the replays' measurement mode), the attention scores and
    their softmax over ``reads`` keys (default ``tokens``; more reads are keys and values gathered beside the
    block's own, as a substituted prefix), or the gated MLP's 2I-wide projection and its product. The
    readout holds the final norm in float32, the head's logits in the model's dtype and the float32 logits
    :meth:`LoopedLM.readout` returns.
    """
    m, d, B, n = _bytes(dtype), config.n_embd, rows, tokens
    kv = config.n_kv_heads * config.head_dim
    carried = 4 * B * n * d * m  # state, e, and [state, e]
    norms = 2 * B * n * d * 4
    qkv = B * n * (d + 2 * kv) * (m + 4)  # projections, and float32 rotary copies of q and k
    scores = 0
    if softmax_dtype is not None:
        scores = 2 * B * config.n_heads * n * (reads or n) * _bytes(softmax_dtype)
    if reads is not None:  # keys and values gathered from elsewhere (a substituted prefix) beside the block's
        scores += 2 * B * reads * kv * m
    mlp = B * n * 4 * config.intermediate_size * m  # fc (2I), silu(gate), the product
    layer = carried + norms + max(qkv + scores, mlp)
    head = B * n * config.vocab_size * m if m not in (4, 8) else 0
    readout = B * n * d * (m + 8) + head + logits(config, B, n, dtype)
    return max(layer, readout)


def kl_work(config: LoopedConfig, rows: int, positions: int) -> int:
    """The float64 arrays of a KL per position over rows x positions (:func:`~looped_kv.analysis.replay.
    kl_per_position`): both log-softmaxes, an exp, a difference and their product."""
    return 5 * rows * positions * config.vocab_size * 8


def kv_cache(config: LoopedConfig, rows: int, tokens: int, num_loops: int, dtype: str | torch.dtype) -> int:
    """A full plane cache (RIPE Eq. 3) for rows x tokens."""
    return rows * m_full(config, tokens, num_loops, _bytes(dtype))


def records(config: LoopedConfig, rows: int, tokens: int, loops: int, kinds: str, dtype: str | torch.dtype) -> int:
    """A replay's per-loop records of ``kinds`` (letters of "qkv") at every core layer."""
    widths = {"q": config.n_heads, "k": config.n_kv_heads, "v": config.n_kv_heads}
    return loops * config.n_core * rows * tokens * config.head_dim * sum(widths[kind] for kind in kinds) * _bytes(dtype)


def _bytes(dtype: str | torch.dtype | int) -> int:
    if isinstance(dtype, str) and dtype in ("float32", "float64", "bfloat16", "float16"):
        dtype = getattr(torch, dtype)
    return element_bytes(dtype)


@dataclass(frozen=True)
class Held:
    """A tensor group live at a step: what it is, its bytes and where it lives."""

    what: str
    nbytes: int
    where: str = GPU


@dataclass(frozen=True)
class Step:
    name: str
    held: tuple[Held, ...]

    def bytes(self, where: str | None = None) -> int:
        """Bytes live at this step on ``where`` (GPU or HOST; None: both, as on a CPU run)."""
        return sum(h.nbytes for h in self.held if where in (None, h.where))


@dataclass(frozen=True)
class ChapterPlan:
    chapter: str
    sizes: str
    steps: tuple[Step, ...]

    def peak(self, where: str | None = GPU) -> int:
        return max(s.bytes(where) for s in self.steps)

    def peak_step(self, where: str | None = GPU) -> Step:
        return max(self.steps, key=lambda s: s.bytes(where))

    def fits(self, gpu_bytes: float) -> bool:
        return self.peak(GPU) + GPU_RESERVE <= gpu_bytes


# -- the chapters ---------------------------------------------------------------------------------------------------


def decode_step(config: LoopedConfig, rows: int, prompt: int, new: int, dtype: str | torch.dtype, *,
                gamma: int = 0, policy: CachePolicy | None = None) -> tuple[Held, ...]:
    """A batch decode (:func:`looped_kv.generate` and the chapters' batch measurements): the cache (default full)
    of every row's prompt, new tokens and one verification block of ``gamma`` + 1 tokens, the drafters' block
    buffer, and the prefill of the prompts."""
    R = config.mean_recurrence
    policy = policy or make_policy("full", R)
    capacity = prompt + new + (gamma + 1 if gamma else 0)
    prefill = forward_peak(config, rows, prompt, dtype)
    held = [Held(f"{policy.name} cache, {rows} x {capacity} tokens",
                 rows * policy_bytes(config, policy, capacity, _bytes(dtype)))]
    if gamma:  # a block's pass reads the cache with an explicit float32 softmax (attend_segments)
        verify = forward_peak(config, rows, gamma + 1, dtype, softmax_dtype="float32", reads=capacity)
        held.append(Held(f"prefill of {rows} x {prompt} tokens, or a pass of {gamma + 1} over the cache",
                         max(prefill, verify)))
    else:
        held.append(Held(f"prefill of {rows} x {prompt} tokens", prefill))
    if gamma:
        held.append(Held(f"block buffer, {rows} x {gamma + 1} tokens", kv_cache(config, rows, gamma + 1, R, dtype)))
    return tuple(held)


def _where(record_device: str) -> str:
    return HOST if record_device == "cpu" else GPU


def _copy(config: LoopedConfig, model_dtype: str, dtype: str) -> tuple[Held, ...]:
    """The weights in ``dtype`` beside the model's own when the dtypes differ (:func:`.planes.in_dtype`)."""
    return () if dtype == model_dtype else (Held(f"{dtype} weights (copy)", weights(config, dtype)),)


def _chunk(profile: Profile, rows: int) -> int:
    """Rows decoded at once: a batch runs in row chunks of at most ``profile.rows_per_chunk`` rows."""
    return min(rows, profile.rows_per_chunk or rows)


def ch01(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m = profile.ch01, profile.dtype
    base = (Held(f"{m} weights", weights(config, m)),)
    texts, n = p.texts_per_workload, p.text_chars - 1  # a token holds at least one character of these texts
    rows = _chunk(profile, texts)
    fp = forward_peak(config, rows, n, m)
    loss = Step(f"held-out loss, {rows} texts x {n} tokens at a time, R up to {max(p.loops)}",
                (*base, Held("forward (and the loss's log-softmax)", max(fp, 2 * logits(config, rows, n)))))
    chains = Step(f"chain answers, {p.chain_programs} programs",
                  (*base, Held("forward", forward_peak(config, p.chain_programs, p.chain_tokens, m))))
    greedy = Step(f"greedy samples, {p.prompts_per_workload} prompts",
                  (*base, *decode_step(config, _chunk(profile, p.prompts_per_workload), profile.prompt_tokens,
                                        p.new_tokens, m)))
    sizes = (f"{texts} texts x {n} tokens per workload, loops {min(p.loops)}-{max(p.loops)}; "
             f"{p.prompts_per_workload} prompts x {p.new_tokens} tokens")
    return ChapterPlan("ch01", sizes, (loss, chains, greedy))


def ch02(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m, R = profile.ch02, profile.dtype, config.mean_recurrence
    base = (Held(f"{m} weights", weights(config, m)),)
    where, rows, n = _where(p.record_device), p.chunk, p.length
    steps = []
    for i, dtype in enumerate(p.replay_dtypes):
        kinds = "qkv"  # k and v for Delta_r, and q, k, v for the maturity
        planes = Held(f"{dtype} records ({kinds}, {R} loops) and logits",
                      records(config, rows, n, R, kinds, dtype) + logits(config, rows, n, dtype), where)
        steps.append(Step(f"{dtype} replay of {rows} texts x {n} tokens",
                          (*base, *_copy(config, m, dtype), planes,
                           Held(f"{dtype} replay", forward_peak(config, rows, n, dtype, softmax_dtype="float32")))))
        if i == 0 and p.exact_dtype:  # the copy (or the model) cast in place to float64, replayed beside its planes
            cast = (Held(f"{p.exact_dtype} weights (the model, cast in place)", weights(config, p.exact_dtype)),) \
                if dtype == m else (*base, Held(f"{p.exact_dtype} weights (the copy, cast in place)",
                                                weights(config, p.exact_dtype)))
            steps.append(Step(f"{p.exact_dtype} replay (the float floor)", (
                *cast,
                planes, Held(f"{p.exact_dtype} records (kv, {R} loops)",
                             records(config, rows, n, R, "kv", p.exact_dtype), where),
                Held(f"{p.exact_dtype} replay, then its logits and the rounding's work (three {p.exact_dtype} prefix "
                     f"planes of one loop)", max(forward_peak(config, rows, n, p.exact_dtype, softmax_dtype="float64"),
                                                 logits(config, rows, n, p.exact_dtype)
                                                 + 3 * records(config, rows, n - p.decoded, 1, "k", p.exact_dtype))))))
    texts = 3 * p.texts_per_workload
    sizes = f"{texts} texts x {n} tokens, {rows} per replay; records on {where}; {', '.join(p.replay_dtypes)}"
    return ChapterPlan("ch02", sizes, tuple(steps))


def ch03(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m, R = profile.ch03, profile.dtype, config.mean_recurrence
    base = (Held(f"{m} weights", weights(config, m)),)
    where, rows, n = _where(p.record_device), 3 * p.texts_per_workload, p.prefix + p.decoded
    exact_logits = Held(f"{p.exact_dtype} logits", logits(config, rows, n, p.exact_dtype), where)
    chunk = p.exact_chunk or rows
    exact = Step(f"{p.exact_dtype} replay of {rows} texts x {n} tokens, {chunk} at a time",
                 (*base, Held(f"{p.exact_dtype} weights (copy)", weights(config, p.exact_dtype)), exact_logits,
                  Held(f"{p.exact_dtype} replay", forward_peak(config, chunk, n, p.exact_dtype,
                                                              softmax_dtype="float64"))))
    arms = Step(f"{p.arm_dtype} reference and substitution arms",
                (*base, *_copy(config, m, p.arm_dtype), exact_logits,
                 Held(f"{p.arm_dtype} records (kv, {R} loops)", records(config, rows, n, R, "kv", p.arm_dtype), where),
                 Held(f"{p.arm_dtype} reference logits", logits(config, rows, n)),
                 Held("arm forward (a substituted query reads the prefix planes and its own: 2n keys), then its "
                      "logits and their KL", max(forward_peak(config, rows, n, p.arm_dtype, softmax_dtype="float32",
                                                              reads=2 * n),
                                                 logits(config, rows, n) + kl_work(config, rows, p.decoded)))))
    t_rows, first = p.table3_chunk, p.table3_length - 1
    full = kv_cache(config, t_rows, first + 1, R, m)
    table3 = Step(f"Table 3: {t_rows} texts x {first} tokens prefilled, then stepped under each cache",
                  (*base, Held("full cache", full),
                   Held("a policy's cache (at most a full cache)", full),
                   Held("step", forward_peak(config, t_rows, 1, m))))
    prefill = Step("Table 3 prefill", (*base, Held("full cache", full),
                                       Held("prefill", forward_peak(config, t_rows, first, m))))
    sizes = (f"{rows} texts x {n} tokens (arms in {p.arm_dtype}, floor in {p.exact_dtype}, records on {where}); "
             f"Table 3: {3 * p.table3_texts_per_workload} texts x {p.table3_length}, {t_rows} at a time")
    return ChapterPlan("ch03", sizes, (exact, arms, prefill, table3))


def ch04(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m, R = profile.ch04, profile.dtype, config.mean_recurrence
    base = (Held(f"{m} weights", weights(config, m)),)
    prompt, prompts = profile.prompt_tokens, 3 * p.replay_prompts  # the workloads' trajectories, replayed together
    exact = Step(f"Algorithm 1 in {p.exact_dtype}, {3 * p.exact_prompts} prompts",
                 (*base, Held(f"{p.exact_dtype} weights (copy)", weights(config, p.exact_dtype)),
                  *decode_step(config, _chunk(profile, 3 * p.exact_prompts), prompt, p.acceptance_tokens,
                               p.exact_dtype, gamma=p.gamma, policy=make_policy("ripe", R, window=p.gamma))))
    ref, floor = p.reference_dtype, "float32"
    copies = (*_copy(config, m, ref), Held(f"{floor} weights (copy, the precision floor)", weights(config, floor)))
    targets = Step(f"{ref} trajectories, {prompts} prompts",
                   (*base, *_copy(config, m, ref),
                    *decode_step(config, _chunk(profile, prompts), prompt, p.new_tokens, ref)))
    rows, g = p.replay_batch, p.new_tokens
    arms = 4 + len(p.windows or (0, 0, 0))  # deepest, the windows, sinks, two planes, fp32

    def replay(name: str, dtype: str, shared: bool, held: tuple[Held, ...] = (), g: int = g) -> Step:
        """Replays of one model's arms (:func:`~looped_kv.analysis.ripe.replay_records`). A model of several arms
        prefills their shared prompt planes once (freed before the next model's); then each arm copies them into
        its cache (at most full) and runs the generated tokens, with the block buffer of the arms that measure it.
        A model of one arm prefills straight into its cache. One arm's logits are held at a time, beside the
        reference's (float32 and float64)."""
        arm_logits = Held("logits of the reference (float32 and float64) and of the arm replayed",
                          logits(config, rows, g + 1, dtype) * 4)
        cache, prefill = kv_cache(config, rows, prompt + g, R, dtype), forward_peak(config, rows, prompt, dtype)
        if shared:
            arm = cache + kv_cache(config, rows, p.gamma + 1, R, dtype) + forward_peak(config, rows, g + 1, dtype)
            work = Held(f"prompt planes ({dtype}) and their prefill, then an arm's cache (at most full), block "
                        f"buffer and forward", kv_cache(config, rows, prompt, R, dtype) + max(prefill, arm))
        else:
            work = Held(f"an arm's cache (at most full, {dtype}) and its prefill", cache + prefill)
        return Step(name, (*base, *copies, *held, arm_logits, work))

    replays = (replay(f"replay through the {arms - 1} {ref} arms, {rows} at a time", ref, True),
               replay(f"replay through the {floor} arm (the precision floor), {rows} at a time", floor, False))
    c2, where2 = profile.ch02, _where(profile.ch02.record_device)
    ripeness = tuple(Step(f"Remark 1's {dtype} replay, {c2.chunk} texts x {c2.length} tokens", (
        *base, *copies, Held(f"{dtype} records (kv, {R} loops)", records(config, c2.chunk, c2.length, R, "kv", dtype),
                             where2),
        Held(f"{dtype} replay", forward_peak(config, c2.chunk, c2.length, dtype, softmax_dtype="float32"))))
        for dtype in (floor, ref))
    bd = p.block_dtype
    dependence = ()
    if bd is not None:
        block_copy = () if bd in (m, ref, floor) else (Held(f"{bd} weights (copy, Sec. 5.2)", weights(config, bd)),)
        dependence = (replay(f"block dependence in {bd} (full cache and deepest plane), {rows} at a time", bd, True,
                             held=block_copy, g=min(g, p.block_tokens)),)
    accept = Step(f"acceptance by cache, {p.acceptance_prompts} prompts",
                  (*base, *decode_step(config, _chunk(profile, p.acceptance_prompts), prompt, p.acceptance_tokens, m,
                                gamma=p.gamma)))
    sizes = (f"{prompts} trajectories of {g} tokens, {rows} replayed at a time; windows {p.windows or 'scaled'}; "
             f"Algorithm 1 on {3 * p.exact_prompts} prompts in {p.exact_dtype}; block dependence in {bd or ref}")
    return ChapterPlan("ch04", sizes, (exact, targets, *replays, *ripeness, *dependence, accept))


def ch05(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m = profile.ch05, profile.dtype
    base = (Held(f"{m} weights", weights(config, m)),)
    prompt = profile.prompt_tokens
    agreement = Step(f"draft agreement, {p.agreement_prompts} prompts",
                     (*base,
                      *decode_step(config, _chunk(profile, p.agreement_prompts), prompt, p.agreement_tokens, m)))
    accept = Step(f"acceptance, {p.acceptance_prompts} prompts",
                  (*base, *decode_step(config, _chunk(profile, p.acceptance_prompts), prompt, p.acceptance_tokens, m,
                                gamma=p.gamma)))
    timing = Step("timing, one prompt at a time",
                  (*base, *decode_step(config, 1, prompt, p.new_tokens, m, gamma=p.gamma)))
    sizes = (f"{p.agreement_prompts} prompts x {p.agreement_tokens} tokens (agreement), {p.acceptance_prompts} x "
             f"{p.acceptance_tokens} (acceptance, gamma {p.gamma}), {p.timing_prompts} timed")
    return ChapterPlan("ch05", sizes, (agreement, accept, timing))


def ch06(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m = profile.ch06, profile.dtype
    base = (Held(f"{m} weights", weights(config, m)),)
    prompt, width = profile.prompt_tokens, max(DasWave.max_width, *p.sweep.get("max_width", ()))
    accept = Step(f"DAS-Wave and the drafters, {p.acceptance_prompts} prompts",
                  (*base, *decode_step(config, _chunk(profile, p.acceptance_prompts), prompt, p.acceptance_tokens, m,
                                gamma=width)))
    timing = Step("timing and the sweep, one prompt at a time",
                  (*base, *decode_step(config, 1, prompt, p.new_tokens, m, gamma=width)))
    sizes = (f"{p.acceptance_prompts} prompts x {p.acceptance_tokens} tokens, max_width up to {width}; "
             f"{p.timing_prompts} timed, {p.sweep_prompts} in the sweep")
    return ChapterPlan("ch06", sizes, (accept, timing))


def ch07(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m = profile.ch07, profile.dtype
    base = (Held(f"{m} weights", weights(config, m)),)
    largest = max(*p.batch_sizes, *p.memory_batch_sizes)
    steps = (Step(f"batched decoding, B = {largest}",
                  (*base, *decode_step(config, largest, profile.prompt_tokens, p.new_tokens, m,
                                       gamma=SelfSpec.gamma))),)
    sizes = f"B in {p.batch_sizes} (throughput), {p.memory_batch_sizes} (memory), {p.new_tokens} new tokens"
    return ChapterPlan("ch07", sizes, steps)


def exit_decode_step(config: LoopedConfig, rows: int, prompt: int, new: int, dtype: str | torch.dtype,
                     policy: CachePolicy | None = None) -> tuple[Held, ...]:
    """A batch decode with early exit (:mod:`looped_kv.decoding.adaptive`): :func:`decode_step`'s cache and prefill,
    and the exited rows' keys and values that the prefill holds per core layer, beside the block's own."""
    held = Held(f"exited rows' keys and values, {rows} x {prompt} tokens",
                rows * prompt * config.n_core * layer_token_bytes(config, _bytes(dtype)))
    return (*decode_step(config, rows, prompt, new, dtype, policy=policy), held)


def ch08(config: LoopedConfig, profile: Profile) -> ChapterPlan:
    p, m, R = profile.ch08, profile.dtype, config.mean_recurrence
    base = (Held(f"{m} weights", weights(config, m)),)
    rows, n = _chunk(profile, p.chain_programs), p.chain_tokens
    answers = Step(f"chain answers after every loop, {rows} programs x {n} tokens at a time", (
        *base, Held("a forward with a readout after every loop, its state and input beside the readout",
                    forward_peak(config, rows, n, m) + 2 * rows * n * config.n_embd * _bytes(m)),
        Held("the answers' keys and values of every loop", records(config, rows, 1, R, "kv", "float32"))))
    chains = Step(f"chain continuations with early exit, {rows} programs",
                  (*base, *exit_decode_step(config, rows, n, 8, m)))
    decode = Step(f"continuations with early exit, {p.prompts_per_workload} prompts", (
        *base, *exit_decode_step(config, _chunk(profile, p.prompts_per_workload), profile.prompt_tokens,
                                 p.new_tokens, m)))
    sizes = (f"{p.chain_programs} chain programs x {n} tokens, {rows} at a time; {p.prompts_per_workload} prompts x "
             f"{p.new_tokens} tokens per workload")
    return ChapterPlan("ch08", sizes, (answers, chains, decode))


CHAPTERS = {"ch01": ch01, "ch02": ch02, "ch03": ch03, "ch04": ch04, "ch05": ch05, "ch06": ch06, "ch07": ch07,
            "ch08": ch08}


def chapter_plans(config: LoopedConfig, profile: Profile) -> dict[str, ChapterPlan]:
    """Every chapter's steps and what each holds, for a model of ``config`` run at ``profile``."""
    return {name: plan(config, profile) for name, plan in CHAPTERS.items()}


def plan_table(plans: dict[str, ChapterPlan], gpu_bytes: float) -> pd.DataFrame:
    """One row per chapter: predicted peak GPU and host memory (GB), the step at the GPU peak, and whether the
    chapter fits a GPU of ``gpu_bytes`` with :data:`GPU_RESERVE` kept free."""
    rows = [{"chapter": name, "GPU GB": p.peak(GPU) / GB, "host GB": p.peak(HOST) / GB,
             "fits": p.fits(gpu_bytes), "GPU peak at": p.peak_step(GPU).name, "sizes": p.sizes}
            for name, p in plans.items()]
    return pd.DataFrame(rows).set_index("chapter")


def steps_beyond(plans: dict[str, ChapterPlan], budget: float, where: str | None = GPU) -> list[str]:
    """One line per step that does not fit ``budget`` bytes, chapter by chapter: what it is and its GB. On a GPU
    (``where`` GPU) its GPU bytes with :data:`GPU_RESERVE` kept free; on a CPU (None) every byte it holds."""
    reserve = GPU_RESERVE if where == GPU else 0
    return [f"{name}, {step.name}: {step.bytes(where) / GB:.1f} GB" for name, p in plans.items() for step in p.steps
            if step.bytes(where) + reserve > budget]


def host_table(plans: dict[str, ChapterPlan], host_bytes: float) -> pd.DataFrame:
    """A CPU run's :func:`plan_table`: one row per chapter with its predicted peak memory (GB; every byte the run
    holds, weights included, since a CPU run keeps device and host tensors in one memory), the step at that peak,
    and whether it fits ``host_bytes``."""
    rows = [{"chapter": name, "GB": p.peak(None) / GB, "fits": p.peak(None) <= host_bytes,
             "peak at": p.peak_step(None).name, "sizes": p.sizes} for name, p in plans.items()]
    return pd.DataFrame(rows).set_index("chapter")


def markdown(table: pd.DataFrame) -> str:
    """A plan's table (:func:`plan_table` for a GPU, :func:`host_table` for a CPU) as Markdown, GB to 0.1 and fits as
    yes or no (the GPU page includes some)."""

    def cell(x: object) -> str:
        if isinstance(x, (bool, np.bool_)):
            return "yes" if x else "no"
        return f"{x:.1f}" if isinstance(x, (float, np.floating)) else str(x)

    numeric = [pd.api.types.is_float_dtype(table[c]) for c in table.columns]
    lines = [f"| {' | '.join([table.index.name, *table.columns])} |",
             f"| --- | {' | '.join('---:' if n else '---' for n in numeric)} |"]
    lines += [f"| {name} | {' | '.join(cell(x) for x in row)} |" for name, row in table.iterrows()]
    return "\n".join(lines) + "\n"


def card_table(card: str) -> pd.DataFrame:
    """One row per published model on a GPU of class ``card`` (:data:`looped_kv.profiles.CARDS`): its profile there
    (:data:`~looped_kv.profiles.BY_CARD`), the predicted peak GPU GB of each chapter, whether every chapter fits the
    card, and what the profile changes from the model's 40 GB run."""
    if card not in profiles.CARDS:
        raise ValueError(f"card must be one of {tuple(profiles.CARDS)}, got {card!r}")
    from looped_kv.runtime.config import PRESETS

    gpu_bytes, rows = profiles.CARDS[card].memory_gb * GB, []
    for model, cards in profiles.BY_CARD.items():
        profile, plans = cards[card], chapter_plans(PRESETS[model](), cards[card])
        changed = profiles.changes(profile, cards[profiles.DEFAULT_CARD])
        rows.append({"model": model, "profile": profile.name, "dtype": profile.dtype,
                     **{name: p.peak(GPU) / GB for name, p in plans.items()},
                     "fits": all(p.fits(gpu_bytes) for p in plans.values()),
                     "changes from the 40 GB run": "; ".join(changed) or "nothing"})
    return pd.DataFrame(rows).set_index("model")


def card_markdown(table: pd.DataFrame) -> str:
    """:func:`card_table` as a Markdown table (GPU GB per chapter; the GPU page includes one per card). The dtype is
    left to the changes column (a profile's dtype differs from the 40 GB run's only where it says so), so that eight
    chapters fit the page's column."""
    chapters = [c for c in table.columns if c in CHAPTERS]
    head = ["model", "profile", *chapters, "fits", "changes from the 40 GB run"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * len(chapters) + ["---"] * 2)
             + " |"]
    lines += [f"| {model} | {row['profile']} | " + " | ".join(f"{row[c]:.1f}" for c in chapters)
              + f" | {'yes' if row['fits'] else 'no'} | {row['changes from the 40 GB run']} |"
              for model, row in table.iterrows()]
    return "\n".join(lines) + "\n"
