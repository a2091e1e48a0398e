"""Every method on compiled static-shape passes (looped_kv.decoding.compiled), in float64.

Most tests trace with a backend that counts the graphs and runs them as traced (the static-shape code paths, without
inductor's code generation, which is slow on a CPU): compiled and eager decoding emit the same tokens and the same
acceptance for every method, a new prompt length reuses a trace within its capacity bucket, and stopped rows kept as
padding (what compiled decoding does, forced here on the eager passes) change nothing. Inductor's code for these
passes is tested on greedy decoding (tests/test_decoding.py). One small model (one core layer, R = 2), whose traces the
module's tests share.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import FIXTURES, random_model
from safetensors.torch import load_file

from looped_kv import generate, make_policy
from looped_kv.decoding import compiled
from looped_kv.decoding.das_wave import WaveDrafts
from looped_kv.decoding.lookup import NgramDrafts
from looped_kv.decoding.loop import PassLog, decode
from looped_kv.decoding.passes import Passes, capacity_bucket, capacity_buckets, new_cache
from looped_kv.decoding.settings import Greedy, SelfSpec
from looped_kv.decoding.speculative import LoopDrafts
from looped_kv.experiments import bench, speed
from looped_kv.runtime.loading import load
from looped_kv.runtime.policy import make_prefix_reads

R = 2
METHODS = {"ar": {}, "self-spec": {"draft_loops": 1, "gamma": 3}, "mature-spec": {"draft_loops": 1, "gamma": 2},
           "pld": {"gamma": 3, "ngram": 1}, "das-wave": {"max_width": 4, "rounds": 3, "initial_width": 2, "updates": 1}}


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return graph.forward


@pytest.fixture(scope="module")
def backend():
    torch._dynamo.reset()
    counting, saved = CountingBackend(), compiled.BACKEND
    compiled.BACKEND = counting
    yield counting
    compiled.BACKEND = saved
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=8, block_size=160, n_core=1, mean_recurrence=R)


def prompts(model, lengths=(5, 3), seed=9):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]


def run(model, ids, method="ar", **options):
    return generate(model, ids, max_new_tokens=[6, 5][:len(ids)], method=method, num_loops=R, stop_at_eos=False,
                    **METHODS[method], **options)


@pytest.mark.parametrize("method, cache", [*((m, {"cache": "full"}) for m in METHODS),
                                           ("ar", {"cache": "ripe", "window": 2, "sinks": 1}),
                                           ("self-spec", {"cache": "ripe", "window": 3}),
                                           ("pld", {"cache": "first", "k": 1, "exact": False})])
def test_compiled_passes_emit_the_eager_tokens(backend, model, method, cache):
    ids = prompts(model)
    eager, traced = (run(model, ids, method, compile=c, **cache) for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(eager.sequences, traced.sequences, strict=True)), (method, cache)
    assert traced.row_accepted == eager.row_accepted and traced.stopped == eager.stopped
    assert traced.row_cache_bytes == eager.row_cache_bytes
    if method != "ar" and cache.get("exact", True):
        greedy = run(model, ids, **{k: v for k, v in cache.items() if k != "exact"})
        assert all(torch.equal(a, b) for a, b in zip(greedy.sequences, traced.sequences, strict=True))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compiled_passes_sample_the_eager_tokens(backend, model, method):
    """Sampling (every processing option, one seed per row) on the compiled passes draws the eager run's tokens."""
    ids = prompts(model)
    options = dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, seed=[3, 8])
    eager, traced = (run(model, ids, method, compile=c, **options) for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(eager.sequences, traced.sequences, strict=True)), method
    assert traced.row_accepted == eager.row_accepted
    greedy = run(model, ids, method)
    assert any(not torch.equal(a, b) for a, b in zip(greedy.sequences, traced.sequences, strict=True))


def in_graph_only(fn):
    """``fn``, refusing to run outside a compiled graph (traced, it runs once per graph, at trace time)."""
    def wrapped(*args):
        if not torch.compiler.is_compiling():
            raise AssertionError(f"{fn.__name__} ran outside a compiled graph")
        return fn(*args)
    return wrapped


def test_compiled_passes_draw_inside_their_graphs(backend, model, monkeypatch):
    """The sampler's picks (the drafts' draws, the speculative sampling rule) run inside the compiled passes' graphs,
    at no call of their own per token; the eager passes run them after each pass (so the guard can fail)."""
    from looped_kv.decoding import sampling

    ids, options, methods = prompts(model), dict(temperature=0.9, top_p=0.95, seed=[3, 8]), ("ar", "self-spec", "pld")
    eager = {method: run(model, ids, method, **options) for method in methods}
    monkeypatch.setattr(sampling, "verify", in_graph_only(sampling.verify))
    drafting, draws = sampling.Sampler.drafting, in_graph_only(sampling.pick)
    monkeypatch.setattr(sampling.Sampler, "drafting", lambda self, offset: (draws, drafting(self, offset)[1]))
    for method in methods:
        traced = run(model, ids, method, compile=True, **options)
        assert traced.tokens.tolist() == eager[method].tokens.tolist(), method
    with pytest.raises(AssertionError, match="ran outside a compiled graph"):
        run(model, ids, "self-spec", **options)


@pytest.mark.parametrize("method", ["ar", "das-wave"])
def test_float32_passes_trace_whole_and_emit_the_eager_tokens(backend, model, method):
    """In float32 the eager step calls ops a trace can't hold (the fused norm): the traced step must not."""
    model32 = random_model("huginn", seed=8, block_size=160, n_core=1, mean_recurrence=R).float()
    ids = prompts(model32)
    eager, traced = (run(model32, ids, method, compile=c) for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(eager.sequences, traced.sequences, strict=True)), method


@pytest.mark.parametrize("cache, params", [("full", {}), ("deepest", {}), ("ripe", {"window": 4}),
                                           ("sinks", {"sinks": 3, "window": 4})])
def test_the_compiled_prefill_stores_the_eager_planes_in_one_trace_for_every_length(backend, model, cache, params):
    """Ragged prompts of new lengths into caches of new capacities: the eager prefill's logits and planes at every
    row's own positions (the padding past them is never read), its ring slots and sinks (rows shorter and longer
    than the window and the sinks), one trace for the first and none after it."""
    policy = make_policy(cache, R, **params)
    torch._dynamo.reset()  # earlier tests' compiled runs may have traced this prefill already
    graphs = [backend.graphs]
    for lengths, capacity in (((5, 2), 64), ((17, 30), 96), ((2, 41), 160)):
        ids = prompts(model, lengths)
        eager, static = (new_cache(model, policy, 2, capacity) for _ in range(2))
        expected = Passes(model, eager).prefill(ids)
        logits = compiled.CompiledPasses(model, static).prefill(ids)
        graphs.append(backend.graphs)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
        assert static.host_lengths == eager.host_lengths == list(lengths)
        for mine, theirs in zip((*static.edge, *static.core), (*eager.edge, *eager.core), strict=True):
            for row, length in enumerate(lengths):
                torch.testing.assert_close(mine.select(-4, row)[..., :length, :],
                                           theirs.select(-4, row)[..., :length, :], rtol=0, atol=1e-12)
        held = static.ring_positions() >= 0
        for mine, theirs in zip(static.ring, eager.ring, strict=True):
            for row in range(2):
                torch.testing.assert_close(mine.select(-4, row)[..., held[row], :],
                                           theirs.select(-4, row)[..., held[row], :], rtol=0, atol=1e-12)
        for mine, theirs in zip(static.sink, eager.sink, strict=True):
            for row, length in enumerate(lengths):
                torch.testing.assert_close(mine.select(-4, row)[..., :length, :],
                                           theirs.select(-4, row)[..., :length, :], rtol=0, atol=1e-12)
        if params:
            assert held.sum() and static.ring[0].abs().sum() > 0
    assert graphs[1] == graphs[0] + 1 and graphs[3] == graphs[2] == graphs[1]


def test_the_compiled_prefill_refuses_a_cache_that_holds_tokens(model):
    cache = new_cache(model, make_policy("full", R), 1, 64)
    cache.advance([3])
    with pytest.raises(ValueError, match="prefill needs an empty cache, got rows of lengths"):
        compiled.CompiledPasses(model, cache).prefill(prompts(model, (4,)))


def test_new_prompt_lengths_reuse_the_trace_of_their_capacity_bucket(backend, model):
    """Greedy steps and self-spec's drafts and verification blocks: one trace per pass and capacity bucket."""
    options = dict(max_new_tokens=4, num_loops=R, stop_at_eos=False, compile=True, method="self-spec",
                   draft_loops=1, gamma=3)
    assert capacity_bucket(5 + 4 + 4, 160) == capacity_bucket(40 + 4 + 4, 160) == 64
    generate(model, prompts(model, (5,)), **options)  # the bucket of 64 positions
    before = backend.graphs
    for n in (9, 23, 40):
        generate(model, prompts(model, (n,)), **options)
    assert backend.graphs == before  # same bucket, new lengths: no new trace
    generate(model, prompts(model, (70,)), **options)  # the bucket of 96 positions
    assert backend.graphs - before == 2  # one draft pass, one verification pass
    generate(model, prompts(model, (80,)), **options)
    assert backend.graphs - before == 2


def test_capacity_buckets_are_powers_of_two_and_half_again_up_to_the_context():
    assert capacity_buckets(1024) == [64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert capacity_buckets(160) == [64, 96, 128, 160] and capacity_buckets(50) == [50]
    assert [capacity_bucket(n, 1024) for n in (1, 64, 65, 97, 320, 385, 1024, 2000)] == [
        64, 64, 96, 128, 384, 512, 1024, 1024]


def test_the_speed_benchmark_counts_one_trace_per_capacity_bucket(backend):
    """``looped-kv speed``'s count: new prompt lengths in the timed prompt's bucket trace
    nothing, the bucket below traces once."""
    model = random_model("huginn", seed=3, block_size=160, n_core=1, mean_recurrence=R)
    generate(model, prompts(model, (100,)), max_new_tokens=8, num_loops=R, stop_at_eos=False, compile=True)
    rows = speed.retraces(model, 100, 8, R)
    assert [(bucket, traces) for _, bucket, traces in rows] == [(128, 0)] * 3 + [(96, 1), (96, 0), (96, 0)]


def test_das_wave_rounds_share_one_trace_per_width_bucket(backend, model):
    """J = 5 rounds of widths 1..5 with deep K/V reads: one trace per width bucket (2, 3, 4, 5), one for
    verification, and the eager tokens."""
    widths = (1, 2, 3, 5, 7, 9, 13, 17, 25, 32)
    assert [compiled.refined_width(w, 32) for w in widths] == [2, 2, 3, 6, 8, 12, 16, 24, 32, 32]
    assert [compiled.refined_width(w, 5) for w in range(1, 6)] == [2, 2, 3, 4, 5]
    options = dict(max_new_tokens=5, num_loops=R, stop_at_eos=False, compile=True, method="das-wave", max_width=5,
                   rounds=5, initial_width=1, updates=2)
    before = backend.graphs
    traced = generate(model, prompts(model, (4,)), **options)
    assert backend.graphs - before == 4 + 1
    eager = generate(model, prompts(model, (4,)), **{**options, "compile": False})
    assert torch.equal(traced.tokens, eager.tokens) and traced.accepted == eager.accepted


@pytest.mark.parametrize("carry", [True, False])
def test_a_fused_wave_runs_its_rounds_in_one_step_and_emits_the_eager_tokens(backend, model, carry):
    """``fuse_rounds``: DAS-Wave's J rounds in one compiled step, traced once per schedule and capacity, told as one
    pass of kind "wave" with its rounds' refined widths; greedy and sampled, the eager run's tokens and acceptance."""
    ids = prompts(model)
    options = dict(max_new_tokens=[6, 5], method="das-wave", num_loops=R, stop_at_eos=False, max_width=5, rounds=4,
                   initial_width=1, updates=2, carry=carry)
    for sampled in ({}, dict(temperature=0.9, top_k=20, seed=[3, 8])):
        eager = generate(model, ids, **options, **sampled)
        log = PassLog()
        fused = generate(model, ids, **options, **sampled, compile=True, fuse_rounds=True, observer=log)
        assert all(torch.equal(a, b) for a, b in zip(eager.sequences, fused.sequences, strict=True)), sampled
        assert fused.row_accepted == eager.row_accepted and fused.options["fuse_rounds"]
        cycles = (len(log.passes) - 1) // 2  # the batch's cycles
        assert cycles and [p.kind for p in log.passes] == ["prefill"] + ["wave", "verify"] * cycles
        waves = {(p.tokens, p.loops, p.widths) for p in log.passes if p.kind == "wave"}
        assert waves == {(4, 2, (2, 2, 3, 4))}  # 4 rounds of widths 1, 2, 3, 4, each refining its bucket
        traces = backend.graphs
        generate(model, ids, **options, **sampled, compile=True, fuse_rounds=True)
        assert backend.graphs == traces


@pytest.mark.parametrize("method", sorted(METHODS))
def test_stopped_rows_kept_as_padding_change_nothing(model, method):
    """The padding path of compiled decoding, forced on the eager passes: every row, its statistics and its cache
    bytes are those of the shrinking batch, and the batch keeps its size."""
    policy = make_policy("ripe", R, window=4)
    options = {k: v for k, v in METHODS[method].items()}
    drafter = {"ar": lambda: None,
               "self-spec": lambda: LoopDrafts(**options, reads=make_prefix_reads("deep-kv", R)),
               "mature-spec": lambda: LoopDrafts(**options, reads=make_prefix_reads("deep-kv", R)),
               "pld": lambda: NgramDrafts(**options),
               "das-wave": lambda: WaveDrafts(**options, carry=True, exact=False)}[method]
    ids, budgets = prompts(model, (4, 7, 2)), [2, 7, 4]
    shrunk, padded = (decode(model, ids, budgets, policy=policy, drafter=drafter(), shrink=s) for s in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(shrunk.sequences, padded.sequences, strict=True))
    assert shrunk.row_accepted == padded.row_accepted and shrunk.stopped == padded.stopped
    assert shrunk.row_cache_bytes == padded.row_cache_bytes
    assert shrunk.batch_per_pass == padded.batch_per_pass  # live rows per pass


def test_bench_times_eager_and_compiled_side_by_side(backend, model):
    methods = {"ar": Greedy(), "self-spec": SelfSpec(draft_loops=1, gamma=3)}
    ids = [p[None] for p in prompts(model, (5, 6))]
    runs = bench.run_paired(model, ids, methods, max_new_tokens=5, progress=False, modes=bench.MODES)
    assert len(runs) == 2 * 2 * 2 and runs["same_as_greedy"].all()
    table = bench.side_by_side(runs, n_boot=100)
    assert list(table.index) == ["greedy", "self-spec"]
    for column in ("eager tokens/s", "compiled tokens/s", "eager speed-up", "compiled speed-up",
                   "compiled / eager greedy"):
        assert column in table.columns
    assert (runs["prefill_time_s"] > 0).all()
    name, speed = bench.best_compiled(runs, n_boot=100)
    assert name == "self-spec" and speed.low <= speed.estimate <= speed.high
    with pytest.raises(ValueError, match="modes must name some of"):
        bench.run_paired(model, ids, methods, max_new_tokens=5, progress=False, modes=("jit",))


def test_prefill_bound_is_greedy_time_over_the_prefill_time():
    """Two prompts, greedy decoding 2 s and 3 s, their prefills 1 s and 0.5 s: no decoder passes (2 + 6) / 2 = 4x,
    and the prefill's median share is (1/2 + 1/6) / 2."""
    runs = pd.DataFrame({"mode": "compiled", "prompt": [0, 0, 1, 1], "method": ["a", "b", "a", "b"],
                         "greedy_time_s": [2.0, 2.0, 3.0, 3.0], "greedy_prefill_time_s": [1.0, 1.0, 0.5, 0.5]})
    bound, share = bench.prefill_bound(runs, "compiled")
    assert bound == pytest.approx(4.0) and share == pytest.approx((1 / 2 + 1 / 6) / 2)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compiled_passes_emit_the_eager_tokens_on_parcae(backend, method):
    """Parcae's fixture (value embeddings read the token ids, the injection every loop) on the compiled passes:
    greedy decoding and every speculative method emit the eager tokens, which are greedy decoding's."""
    parcae = load(FIXTURES / "parcae-tiny", dtype=torch.float64)
    ids = list(load_file(FIXTURES / "parcae-tiny" / "reference.safetensors")["input_ids"][:, :6])
    options = {"max_new_tokens": 6, "method": method, "stop_at_eos": False, **METHODS[method]}
    eager, traced = (generate(parcae, ids, compile=c, **options) for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(eager.sequences, traced.sequences, strict=True)), method
    greedy = generate(parcae, ids, max_new_tokens=6, stop_at_eos=False)
    assert all(torch.equal(a, b) for a, b in zip(greedy.sequences, traced.sequences, strict=True)), method
