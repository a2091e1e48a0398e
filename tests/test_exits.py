"""Adaptive depth per token (early exit) in greedy decoding, exactly, in float64 (issue 41, item 2).

* a criterion that never fires is greedy full-depth decoding, token for token;
* every token exiting at loop e (``exit="fixed"``) is greedy decoding at R = e under ``exited_reads="last"``, for
  every policy whose planes do not move with R;
* each row of a batch exits by its own criterion and emits what it emits alone;
* each criterion's exit loop, on hand-made per-loop logits, states and gate logits, and on the model's own
  cache-free passes, is its definition's;
* the cache holds, per position, the distinct planes :func:`~looped_kv.runtime.memory.exit_bytes` counts, with the
  planes past a token's exit what ``exited_reads`` says;
* bad input is one line naming the parameter, before any model pass.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import random_model

import looped_kv
from looped_kv.analysis.adaptive_depth import exit_profile
from looped_kv.decoding.exits import CRITERIA, EXITS, START_ENTROPY
from looped_kv.decoding.loop import Observer, PassLog
from looped_kv.runtime import exit_gate
from looped_kv.runtime.memory import layer_token_bytes, policy_bytes
from looped_kv.runtime.policy import make_policy

CACHES = {"full": {}, "deepest": {}, "ripe": {"window": 3}, "share": {"k": 2}, "first": {"k": 2},
          "sinks": {"sinks": 2, "window": 2}}


@pytest.fixture(scope="module")
def tiny64():
    return looped_kv.load("tiny", dtype=torch.float64)


@pytest.fixture(scope="module")
def huginn():
    return random_model("huginn", seed=3)


def prompts_of(model, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]


def text_prompts(model):
    return [model.tokenizer(text, return_tensors="pt").input_ids[0]
            for text in ("a=3;b=a+4;c=b+1;?c", "def f(x):\n    return", "Tom has 3 apples and")]


def same_rows(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.sequences, b.sequences, strict=True))


# -- 1. never firing is full depth --------------------------------------------------------------------------------


@pytest.mark.parametrize("exit, threshold", [("latent", 0.0), ("entropy", 0.0), ("argmax", 6), ("fixed", 6)])
@pytest.mark.parametrize("cache", ["full", "ripe", "deepest"])
@pytest.mark.parametrize("family", ["huginn", "ouro", "parcae"])
def test_a_criterion_that_never_fires_is_greedy_full_depth(family, cache, exit, threshold):
    """R = 6: a relative change is never below 0, nor 6 loops with an unchanged argmax reached within 6 loops."""
    model = random_model(family, seed=4)
    prompts = prompts_of(model, (3, 7, 5), seed=1)
    run = dict(max_new_tokens=[6, 4, 7], stop_at_eos=False, cache=cache, **CACHES[cache])
    greedy = looped_kv.generate(model, prompts, **run)
    adaptive = looped_kv.generate(model, prompts, exit=exit, exit_threshold=threshold, **run)
    assert same_rows(greedy, adaptive)
    assert adaptive.row_loops == [[6] * len(row) for row in adaptive.new_rows] and adaptive.mean_loops == 6
    assert adaptive.row_distinct_cache_bytes == greedy.row_cache_bytes
    sampled = dict(temperature=1.0, seed=5)
    assert same_rows(looped_kv.generate(model, prompts, **run, **sampled),
                     looped_kv.generate(model, prompts, exit=exit, exit_threshold=threshold, **run, **sampled))


def test_the_tiny_model_never_exiting_is_greedy(tiny64):
    prompts = text_prompts(tiny64)
    run = dict(max_new_tokens=10, stop_at_eos=False, num_loops=16)
    assert same_rows(looped_kv.generate(tiny64, prompts, **run),
                     looped_kv.generate(tiny64, prompts, exit="entropy", exit_threshold=0.0, **run))


# -- 2. exiting at loop e everywhere is R = e ---------------------------------------------------------------------


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("e", [1, 3, 5])
def test_a_fixed_exit_is_greedy_at_that_depth_under_last_reads(huginn, cache, e):
    """Planes past e hold plane e: a policy at R = 6 read at loops <= e is the same policy at R = e (plane(r) becomes
    min(plane(r), e)), the prompt included."""
    if CACHES[cache].get("k", 0) > e:
        pytest.skip(f"{cache}(k) at R = e needs k <= e")
    prompts = prompts_of(huginn, (4, 9, 2), seed=2)
    run = dict(max_new_tokens=[7, 5, 8], stop_at_eos=False, cache=cache, **CACHES[cache])
    at_e = looped_kv.generate(huginn, prompts, num_loops=e, **run)
    exits = looped_kv.generate(huginn, prompts, exit="fixed", exit_threshold=e, exited_reads="last", **run)
    assert same_rows(at_e, exits) and exits.mean_loops == e
    if cache in ("full", "first"):  # it keeps every plane up to e: its nearest plane below is plane e
        nearest = looped_kv.generate(huginn, prompts, exit="fixed", exit_threshold=e, exited_reads="nearest-below",
                                     **run)
        assert same_rows(at_e, nearest)


def test_the_tiny_model_at_a_fixed_exit_is_greedy_at_that_depth(tiny64):
    prompts = text_prompts(tiny64)
    run = dict(max_new_tokens=8, stop_at_eos=False, cache="ripe", window=4)
    assert same_rows(looped_kv.generate(tiny64, prompts, num_loops=5, **run),
                     looped_kv.generate(tiny64, prompts, num_loops=16, exit="fixed", exit_threshold=5, **run))


# -- 3. rows exit independently -----------------------------------------------------------------------------------


def check_rows_alone(model, prompts, budgets, **run) -> list[list[int]]:
    batch = looped_kv.generate(model, prompts, max_new_tokens=budgets, stop_at_eos=False, **run)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        alone = looped_kv.generate(model, prompt, max_new_tokens=budget, stop_at_eos=False, **run)
        assert torch.equal(alone.sequences[0], batch.sequences[i]), (i, run)
        assert alone.row_loops[0] == batch.row_loops[i], (i, run)
        assert alone.row_distinct_cache_bytes[0] == batch.row_distinct_cache_bytes[i]
    loops = {loop for row in batch.row_loops for loop in row}
    assert len(loops) > 2, (run, batch.row_loops)  # the rows exit at many loops
    return batch.row_loops


@pytest.mark.parametrize("exit, threshold", [("kl", 1e-2), ("entropy", 1e-2), ("argmax", 1)])
@pytest.mark.parametrize("cache", ["full", "deepest", "ripe", "share"])
def test_rows_of_a_batch_exit_independently(huginn, exit, threshold, cache):
    prompts = prompts_of(huginn, (3, 6, 4, 8), seed=0)
    check_rows_alone(huginn, prompts, [6, 8, 5, 7], exit=exit, exit_threshold=threshold, cache=cache,
                     **CACHES[cache])


@pytest.mark.parametrize("exit, threshold, cache, reads", [
    ("kl", 1e-3, "full", "last"), ("entropy", 1e-3, "ripe", "last"), ("latent", 0.03, "deepest", "last"),
    ("cosine", 1e-3, "sinks", "last"), ("argmax", 3, "share", "nearest-below"), ("argmax", 3, "share", "last")])
def test_rows_of_the_tiny_model_exit_independently(tiny64, exit, threshold, cache, reads):
    params = {"share": {"k": 4}}.get(cache, CACHES[cache])
    check_rows_alone(tiny64, text_prompts(tiny64), [8, 6, 9], num_loops=16, exit=exit, exit_threshold=threshold,
                     cache=cache, exited_reads=reads, **params)


def sharp_gate_ouro():
    """A random Ouro model whose gate varies more from loop to loop (its states are normed: a random gate barely
    does)."""
    model = random_model("ouro", seed=3)
    with torch.no_grad():
        model.transformer.exit_gate.weight.mul_(4)
        model.transformer.exit_gate.bias.fill_(-2)
    return model


def test_rows_of_an_ouro_batch_exit_by_its_gate_independently():
    model = sharp_gate_ouro()
    check_rows_alone(model, prompts_of(model, (3, 6, 4), seed=0), [6, 5, 7], exit="gate", exit_threshold=0.3)


def test_row_chunks_and_statistics_with_early_exit(huginn):
    prompts = prompts_of(huginn, (4, 7, 5), seed=6)
    run = dict(max_new_tokens=[5, 6, 4], stop_at_eos=False, exit="kl", exit_threshold=1e-2, cache="ripe", window=2)
    whole = looped_kv.generate(huginn, prompts, **run)
    parts = looped_kv.generate(huginn, prompts, rows_per_chunk=1, **run)
    assert same_rows(whole, parts) and whole.row_loops == parts.row_loops
    for key in ("row_cache_bytes", "row_distinct_cache_bytes", "distinct_cache_bytes", "exit"):
        assert getattr(whole, key) == getattr(parts, key), key
    assert [len(r) for r in whole.row_loops] == [5, 6, 4]
    every = [loop for row in whole.row_loops for loop in row]
    assert whole.stats()["loops_per_token"] == whole.mean_loops == sum(every) / len(every) < 6
    assert "loops_per_token" not in looped_kv.generate(huginn, prompts, max_new_tokens=2).stats()


def test_the_analysis_helper_reports_each_tokens_exit_loop(tiny64):
    prompts = text_prompts(tiny64)
    profile = exit_profile(tiny64, prompts, "argmax", 3, max_new_tokens=6, num_loops=16, stop_at_eos=False)
    out = looped_kv.generate(tiny64, prompts, max_new_tokens=6, num_loops=16, stop_at_eos=False, exit="argmax",
                             exit_threshold=3)
    assert profile.loops == out.row_loops and profile.tokens == [r.tolist() for r in out.new_rows]
    assert profile.num_loops == 16 and profile.mean_loops == out.mean_loops < 16


# -- 4. each criterion is its definition --------------------------------------------------------------------------


def softmax(z: list[float]) -> list[float]:
    top = max(z)
    weights = [math.exp(x - top) for x in z]
    return [w / sum(weights) for w in weights]


def norm(x: list[float]) -> float:
    return math.sqrt(sum(v * v for v in x))


def definition(exit: str, threshold: float, state0: list[float], reads: list[list[float]]) -> int | None:
    """The first loop (1-based) at which ``exit`` fires on one token's per-loop reads, straight from the
    definitions (:mod:`looped_kv.decoding.exits`), in Python floats; None if it never does."""
    previous, stable, reached, remaining = state0, 0, 0.0, 1.0
    for r, x in enumerate(reads, 1):
        if exit == "kl":
            p, q = softmax(x), (softmax(previous) if r > 1 else [1 / len(x)] * len(x))
            fires = sum(a * math.log(a / b) for a, b in zip(q, p, strict=True)) < threshold
        elif exit == "entropy":
            h = -sum(a * math.log(a) for a in softmax(x))
            h0 = -sum(a * math.log(a) for a in softmax(previous)) if r > 1 else START_ENTROPY
            fires = abs(h - h0) < threshold
        elif exit == "latent":
            fires = norm([a - b for a, b in zip(x, previous, strict=True)]) / norm(x) < threshold
        elif exit == "cosine":
            fires = 1 - sum(a * b for a, b in zip(x, previous, strict=True)) / norm(x) / norm(previous) < threshold
        elif exit == "argmax":
            stable = stable + 1 if r > 1 and x.index(max(x)) == previous.index(max(previous)) else 0
            fires = stable >= threshold
        elif exit == "gate":
            exit_now = 1 / (1 + math.exp(-x[0]))
            reached, remaining = reached + exit_now * remaining, remaining * (1 - exit_now)
            fires = reached >= threshold
        else:
            fires = r >= threshold
        if fires:
            return r
        previous = x
    return None


def plug_in(exit: str, threshold: float, state0: torch.Tensor, reads: torch.Tensor) -> list[int | None]:
    """Each token's first firing loop under the plug-in, fed (B, ...) reads loop by loop (R, B, ...)."""
    criterion = CRITERIA[exit](threshold)
    criterion.start(state0)
    fired = torch.stack([criterion.step(r, None if exit == "fixed" else x) for r, x in enumerate(reads, 1)])
    return [int(col.nonzero()[0]) + 1 if col.any() else None for col in fired.T]


# per criterion: what it reads, per loop, for 3 tokens over 8 loops, and thresholds to try
HAND_MADE = {"kl": ("logits", (0.3, 0.03, 3e-3)), "entropy": ("logits", (0.2, 0.02, 2e-3)),
             "latent": ("state", (0.4, 0.1, 0.02)), "cosine": ("state", (0.1, 0.01, 1e-3)),
             "argmax": ("argmax", (1, 2, 3)), "gate": ("gate", (0.3, 0.6, 0.95)), "fixed": ("loop", (1, 4, 8))}


def hand_made(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """s(0) (3, d) and per-loop reads (8, 3, ...): converging logits and states (the three tokens at three rates),
    an argmax that settles at different loops, gate logits rising at three speeds."""
    generator = torch.Generator().manual_seed(11)
    base = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    wobble = torch.randn(8, 3, 6, generator=generator, dtype=torch.float64)
    rates = torch.tensor([0.3, 0.5, 0.7], dtype=torch.float64)[:, None]
    r = torch.arange(1, 9, dtype=torch.float64)[:, None, None]
    converging = base * 3 + wobble * rates**r
    if kind == "argmax":  # token 0 settles on 2 at loop 3, token 1 flips back and forth, token 2 settles at loop 6
        tops = [[0, 1, 2, 2, 2, 2, 2, 2], [4, 4, 1, 4, 4, 4, 1, 1], [3, 2, 1, 0, 5, 1, 1, 1]]
        converging = torch.nn.functional.one_hot(torch.tensor(tops).T, 6).double() * 5 + wobble * 0.1
    if kind == "gate":
        converging = (torch.tensor([-3.0, -1.0, 0.5], dtype=torch.float64) + r[..., 0] * rates.T * 0.8)[..., None]
    return base * 3 + torch.randn(3, 6, generator=generator, dtype=torch.float64), converging


@pytest.mark.parametrize("exit", EXITS)
def test_each_criterion_fires_where_its_definition_says(exit):
    kind, thresholds = HAND_MADE[exit]
    state0, reads = hand_made(kind)
    seen = set()
    for threshold in thresholds:
        expected = [definition(exit, threshold, state0[b].tolist(), [x[b].tolist() for x in reads]) for b in range(3)]
        got = plug_in(exit, threshold, state0, reads.squeeze(-1) if exit == "gate" else reads)
        assert got == expected, (threshold, got, expected)
        seen |= set(got)
    assert len(seen - {None}) >= 3, seen  # the sequences exercise the criterion at several loops


def test_the_gate_fires_where_ouros_threshold_readout_exits():
    """The gate's cumulative probability is the exit distribution's cumulative sum, bit for bit."""
    generator = torch.Generator().manual_seed(2)
    gate_logits = torch.randn(5, 40, 6, generator=generator, dtype=torch.float64) * 2
    for threshold in (0.1, 0.5, 0.8, 0.99, 1.0):
        expected = exit_gate.threshold_exit(exit_gate.exit_pdf(gate_logits), threshold) + 1
        criterion = CRITERIA["gate"](threshold)
        criterion.start(gate_logits[..., 0])
        fired = torch.stack([criterion.step(r, gate_logits[..., r - 1]) for r in range(1, 6)] +
                            [torch.ones_like(gate_logits[..., 0], dtype=torch.bool)])  # loop R: the exit of all left
        assert torch.equal(fired.int().argmax(0) + 1, expected), threshold


@pytest.mark.parametrize("exit, threshold", [("kl", 1e-3), ("entropy", 1e-3), ("argmax", 3), ("latent", 0.03),
                                             ("cosine", 1e-3)])
def test_the_prompts_exit_is_the_definition_on_cache_free_passes(tiny64, exit, threshold):
    """A prompt exits as one block with its last position: the definition applied to the logits at R = r of the
    model's own forward (r = 1..16), or to its states, gives the loop of the first token's readout."""
    R = 16
    for ids in text_prompts(tiny64):
        out = looped_kv.generate(tiny64, ids, max_new_tokens=1, num_loops=R, exit=exit, exit_threshold=threshold)
        with torch.no_grad():
            passes = [tiny64(ids[None], num_loops=r, return_state=True) for r in range(1, R + 1)]
            state0 = tiny64.initial_state(torch.arange(len(ids)), 1)[0, -1]
        reads = [(logits if exit in ("kl", "entropy", "argmax") else state)[0, -1].tolist()
                 for logits, state in passes]
        assert out.row_loops[0][0] == (definition(exit, threshold, state0.tolist(), reads) or R)


def test_an_ouro_prompt_exits_where_its_threshold_readout_does():
    model = sharp_gate_ouro()
    for ids in prompts_of(model, (1, 4, 7), seed=3):
        for threshold in (0.3, 0.5, 0.9):
            out = looped_kv.generate(model, ids, max_new_tokens=1, exit="gate", exit_threshold=threshold)
            steps = exit_gate.threshold_exit(exit_gate.loop_outputs(model, ids[None]).pdf, threshold)
            assert out.row_loops == [[int(steps[0, -1]) + 1]]


# -- the cache past an exit, and its bytes --------------------------------------------------------------------------


class CacheKeeper(Observer):
    def proposing(self, view):
        self.cache = view.cache


def distinct_core_planes(cache, row: int, position: int, layer: int) -> int:
    """How many different key/value planes the cache stores for one position at one core layer."""
    policy, L = cache.policy, cache.host_lengths[row]
    slots = [(cache.core[0][layer, i, row, :, position], cache.core[1][layer, i, row, :, position])
             for i in range(len(policy.kept))]
    if policy.extra and position >= L - policy.window:
        slots.append(tuple(cache.ring[w][layer, :, row, :, position % cache.ring_size] for w in (0, 1)))
    if policy.extra and position < policy.sinks:
        slots.append(tuple(cache.sink[w][layer, :, row, :, position] for w in (0, 1)))
    planes = [(k, v) for keys, values in slots for k, v in
              (zip(keys, values, strict=True) if keys.dim() == 3 else [(keys, values)])]
    distinct: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k, v in planes:
        if not any(torch.equal(k, a) and torch.equal(v, b) for a, b in distinct):
            distinct.append((k, v))
    return len(distinct)


@pytest.mark.parametrize("cache, params, reads, exit, threshold", [
    ("full", {}, "last", "kl", 1e-2), ("deepest", {}, "last", "entropy", 1e-2), ("ripe", {"window": 3}, "last", "kl",
                                                                                  1e-2),
    ("sinks", {"sinks": 2}, "last", "kl", 1e-2), ("share", {"k": 2}, "last", "argmax", 1),
    ("share", {"k": 2}, "nearest-below", "argmax", 1), ("first", {"k": 3}, "last", "entropy", 1e-2),
    ("k-deepest", {"k": 3}, "nearest-below", "fixed", 4)])
def test_the_cache_holds_the_distinct_planes_exit_bytes_counts(huginn, cache, params, reads, exit, threshold):
    prompts = prompts_of(huginn, (5, 3), seed=7)
    keeper = CacheKeeper()
    out = looped_kv.generate(huginn, prompts, max_new_tokens=7, stop_at_eos=False, cache=cache, exit=exit,
                             exit_threshold=threshold, exited_reads=reads, observer=keeper, **params)
    kv, config, R = keeper.cache, huginn.config, 6
    b = layer_token_bytes(config, torch.float64)
    for row, (loops, n) in enumerate(zip(out.row_loops, out.prompt_lengths, strict=True)):
        positions = [loops[0]] * (n - 1) + loops  # the prompt exits with its last position
        L = len(positions)
        assert kv.host_lengths[row] == L and out.row_cache_bytes[row] == policy_bytes(
            config, make_policy(cache, R, **params), L, torch.float64)  # the preallocated cache: every slot
        planes = sum(distinct_core_planes(kv, row, j, layer) for j in range(L) for layer in range(config.n_core))
        assert out.row_distinct_cache_bytes[row] == b * (L * (config.n_prelude + config.n_coda) + planes), \
            (row, positions)
    assert out.distinct_cache_bytes <= out.cache_bytes


@pytest.mark.parametrize("reads", ["last", "nearest-below"])
def test_planes_past_an_exit_are_what_exited_reads_says(huginn, reads):
    """Under share(2) (kept planes 2, 4, 6), a token that exited at e has plane q <= e copied into every kept slot
    p > e: q = e under "last" (then plane e itself is stored only there), the deepest kept plane <= e under
    "nearest-below"; under the full cache both leave slot e in every slot p > e."""
    keeper = CacheKeeper()
    out = looped_kv.generate(huginn, prompts_of(huginn, (6,), seed=0), max_new_tokens=9, stop_at_eos=False,
                             cache="share", k=2, exit="argmax", exit_threshold=1, exited_reads=reads, observer=keeper)
    kv, n = keeper.cache, out.prompt_lengths[0]
    positions = [out.row_loops[0][0]] * (n - 1) + out.row_loops[0]
    assert {e % 2 for e in positions if e < 6} == {0, 1}  # exits on kept and on other loops
    for j, e in enumerate(positions):
        kept = [kv.core[0][:, i, 0, :, j] for i in range(3)]  # slots of planes 2, 4, 6
        past = [kept[p // 2 - 1] for p in (2, 4, 6) if p > e]
        if reads == "nearest-below" and e >= 2:
            assert all(torch.equal(slot, kept[e // 2 - 1]) for slot in past), (j, e)
        else:
            assert all(torch.equal(slot, past[0]) for slot in past), (j, e)
        if past and e >= 2:
            assert torch.equal(past[0], kept[e // 2 - 1]) == (reads == "nearest-below" or e % 2 == 0), (j, e)

    full = CacheKeeper()
    out = looped_kv.generate(huginn, prompts_of(huginn, (6,), seed=3), max_new_tokens=9, stop_at_eos=False,
                             exit="kl", exit_threshold=1e-2, exited_reads=reads, observer=full)
    n = out.prompt_lengths[0]
    for j, e in enumerate([out.row_loops[0][0]] * (n - 1) + out.row_loops[0]):
        planes = full.cache.core[0][:, :, 0, :, j]
        assert all(torch.equal(planes[:, p - 1], planes[:, e - 1]) for p in range(e + 1, 7)), (j, e)
        assert len({planes[:, p - 1].sum().item() for p in range(1, e + 1)}) == e


# -- 5. bad input -------------------------------------------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """A model that refuses to run: an input check after any model pass fails the test."""
    model = random_model("huginn", seed=1)

    def refuse(*args, **kwargs):
        raise AssertionError("a model pass ran before the bad input was refused")

    for name in ("forward", "embed", "loop", "loops", "readout"):
        monkeypatch.setattr(model, name, refuse)
    return model


@pytest.mark.parametrize("options, message", [
    ({"exit": "halt"}, r"exit must be one of \('kl', 'entropy', 'latent', 'argmax', 'cosine', 'gate', 'fixed'\) or "
                       r"None, got 'halt'"),
    ({"exit": 3}, r"exit must be one of \(.*\) or None, got 3"),
    ({"exit": "kl", "exit_threshold": -0.1}, r"exit_threshold must be a number >= 0 for exit='kl' \(exit when "
                                             r"KL\(p\(r-1\) \|\| p\(r\)\) < threshold\), got -0.1"),
    ({"exit": "latent", "exit_threshold": math.inf}, r"exit_threshold must be a number >= 0 for exit='latent'"),
    ({"exit": "cosine", "exit_threshold": "small"}, r"exit_threshold must be a number >= 0 for exit='cosine'"),
    ({"exit": "gate", "exit_threshold": 1.5}, r"exit_threshold must be a number in \[0, 1\] for exit='gate'"),
    ({"exit": "argmax", "exit_threshold": 0}, r"exit_threshold must be an int >= 1 for exit='argmax'"),
    ({"exit": "argmax", "exit_threshold": 2.5}, r"exit_threshold must be an int >= 1 for exit='argmax'"),
    ({"exit": "fixed"}, r"exit='fixed' needs exit_threshold \(the loop every token exits at, an int in \[1, 6\]\)"),
    ({"exit": "fixed", "exit_threshold": 7}, r"exit_threshold must be in \[1, 6\] for exit='fixed' \(R = 6 loops\), "
                                             r"got 7"),
    ({"exit": "fixed", "exit_threshold": 4, "num_loops": 3}, r"exit_threshold must be in \[1, 3\] for exit='fixed'"),
    ({"exit": "gate"}, r"exit='gate' needs a model with an exit gate \(Ouro\); this model \(family 'huginn'\) has "
                       r"none: use exit in \('kl', 'entropy', 'latent', 'argmax', 'cosine', 'fixed'\)"),
    ({"exit": "kl", "exited_reads": "nearest"}, r"exited_reads must be one of \('last', 'nearest-below'\), got "
                                                r"'nearest'"),
    ({"exit_threshold": 0.1}, r"exit_threshold=0.1 is used only with exit \(one of \("),
    ({"exited_reads": "last"}, r"exited_reads='last' is used only with exit"),
    ({"exit": "kl", "exited_reads": "nearest-below", "cache": "deepest"},
     r"exited_reads='nearest-below' needs a cache that keeps a plane at or below loop 1, the earliest exit of "
     r"exit='kl'; cache deepest keeps planes \(6,\): use exited_reads='last'"),
    ({"exit": "argmax", "exit_threshold": 2, "exited_reads": "nearest-below", "cache": "share", "k": 4},
     r"exited_reads='nearest-below' needs a cache that keeps a plane at or below loop 3, the earliest exit of "
     r"exit='argmax'; cache share\(4\) keeps planes \(4, 6\)"),
    ({"exit": "kl", "compile": True}, r"compile=True runs no early exit \(exit='kl' runs eager\): use compile=False"),
    ({"exit": "kl", "method": "self-spec"}, r"exit='kl' runs with method='ar' only: early exit under the speculation "
                                            r"of method='self-spec' is not proven exact$"),
    ({"exit": "entropy", "method": "mature-spec"}, r"exit='entropy' runs with method='ar' only"),
    ({"exit_threshold": 0.5, "method": "pld"}, r"exit_threshold=0.5 runs with method='ar' only"),
    ({"exited_reads": "last", "method": "das-wave"}, r"exited_reads='last' runs with method='ar' only"),
])
def test_bad_exit_options_are_refused_before_any_work(no_work, options, message):
    with pytest.raises(ValueError, match="^" + message) as error:
        looped_kv.generate(no_work, torch.tensor([[3, 1, 4]]), max_new_tokens=3, **options)
    assert "\n" not in str(error.value), str(error.value)


def test_an_ouro_checkpoint_without_a_threshold_names_it():
    model = random_model("ouro", seed=3, exit_threshold=None)
    with pytest.raises(ValueError, match=r"^exit='gate' needs exit_threshold \(exit when the gate's cumulative exit "
                                         r"probability reaches threshold\)$"):
        looped_kv.generate(model, torch.tensor([[3, 1]]), max_new_tokens=2, exit="gate")
    out = looped_kv.generate(random_model("ouro", seed=3), torch.tensor([[3, 1]]), max_new_tokens=2, exit="gate")
    assert out.exit["exit_threshold"] == 1.0  # the checkpoint's early_exit_threshold


def test_the_command_line_decodes_with_early_exit(capsys):
    from looped_kv.cli import main

    assert main(["generate", "--model", "tiny", "--max-new-tokens", "4", "--num-loops", "8", "--exit", "argmax",
                 "--exit-threshold", "2", "--exited-reads", "last", "--json", "a=3;?a"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert 3 <= stats["loops_per_token"] <= 8 and stats["new_tokens"] >= 1
    assert main(["generate", "--model", "tiny", "--exit", "argmax", "--exit-threshold", "2.5", "hi"]) == 2
    err = capsys.readouterr().err
    assert err == "looped-kv generate: error: exit_threshold must be an int >= 1 for exit='argmax' (exit after that " \
                  "many successive loops with an unchanged argmax), got 2.5\n"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--exit ", "--exit-threshold", "--exited-reads")), out


def test_each_adaptive_pass_is_logged_with_the_loops_the_batch_ran(huginn):
    log = PassLog()
    prompts = prompts_of(huginn, (4, 6), seed=2)
    out = looped_kv.generate(huginn, prompts, max_new_tokens=5, stop_at_eos=False, exit="kl", exit_threshold=1e-2,
                             observer=log)
    assert [p.kind for p in log.passes] == ["prefill"] + ["verify"] * 4
    deepest = [max(row[i] for row in out.row_loops) for i in range(5)]  # both rows run every pass here
    assert [p.loops for p in log.passes] == deepest and {p.rows for p in log.passes} == {2}
    assert [p.context for p in log.passes] == [0, 6, 7, 8, 9] and not any(p.compiled for p in log.passes)
