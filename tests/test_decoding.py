"""The one batch-first decoding stack: each row of a batch emits what it emits alone (float64), every method under
every cache policy, ragged rows, per-row stopping at the budget and at end-of-text, and the compiled step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from looped_kv import cli
from looped_kv.analysis import throughput
from looped_kv.analysis.memory_bench import peak_bytes
from looped_kv.analysis.throughput import throughput_cells
from looped_kv.decoding import compiled as compiled_step
from looped_kv.decoding.generate import generate
from looped_kv.decoding.loop import Drafter, Outcome, Proposal, accept, decode, prefix_outcome
from looped_kv.decoding.passes import Passes, new_cache, prefill, prompt_logits, run_pass
from looped_kv.runtime.cache import CachePass, PlaneCache
from looped_kv.runtime.memory import policy_bytes
from looped_kv.runtime.policy import make_policy

R = 5
#: The options of the policies the in-place and prefill tests build, beside full and deepest (which take none).
POLICY_OPTIONS = {"first": {"k": 2}, "ripe": {"window": 2}, "sinks": {"window": 2, "sinks": 1}}
POLICIES = [("full", {}), ("deepest", {}), ("ripe", {"window": 4}), ("ripe", {"window": 2, "sinks": 1}),
            ("k-deepest", {"k": 2}), ("share", {"k": 2}), ("first", {"k": 3}), ("sinks", {"sinks": 2}),
            ("sinks", {"sinks": 1, "window": 3})]
LENGTHS, BUDGETS = (3, 7, 1, 5), [7, 4, 8, 6]
# (cache, params, exact): block-independent policies (RIPE Proposition 1) and block-dependent ones (exact=False).
SPECULATIVE = [("full", {}, True), ("ripe", {"window": 4}, True), ("ripe", {"window": 5, "sinks": 1}, True),
               ("sinks", {"sinks": 2, "window": 4}, True), ("deepest", {}, False), ("ripe", {"window": 2}, False),
               ("share", {"k": 2}, False), ("k-deepest", {"k": 2}, False), ("first", {"k": 3}, False)]
METHODS = {"self-spec": {"draft_loops": 2, "gamma": 3}, "mature-spec": {"draft_loops": 2, "gamma": 3},
           "pld": {"gamma": 3, "ngram": 2}, "das-wave": {"max_width": 4, "rounds": 3, "initial_width": 2, "updates": 1}}


@pytest.fixture(scope="module", params=["huginn", "raven", "raven-olmo", "ouro"])
def model(request):
    return random_model(request.param, seed=3)


def ragged_prompts(model, lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]


def run(model, prompts, budgets, method="ar", **kwargs):
    return generate(model, prompts, max_new_tokens=budgets, method=method, num_loops=R, stop_at_eos=False, **kwargs)


@pytest.mark.parametrize("cache, params", POLICIES)
def test_greedy_rows_are_greedy_alone(model, cache, params):
    prompts = ragged_prompts(model)
    out = run(model, prompts, BUDGETS, cache=cache, **params)
    policy = make_policy(cache, R, **params)
    for i, (prompt, budget) in enumerate(zip(prompts, BUDGETS, strict=True)):
        alone = run(model, prompt, budget, cache=cache, **params)
        assert torch.equal(out.sequences[i], alone.sequences[0])
        assert len(out.new_rows[i]) == budget
        expected = policy_bytes(model.config, policy, len(prompt) + budget - 1, model.dtype)
        assert out.row_cache_bytes[i] == expected
    assert out.num_new == sum(BUDGETS) and out.stopped == ["length"] * 4


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("cache, params, exact", SPECULATIVE)
def test_speculative_rows_are_the_row_alone_and_exact_ones_are_greedy(model, method, cache, params, exact):
    if model.config.family not in ("huginn", "ouro") and cache not in ("full", "ripe"):
        pytest.skip("every policy runs on Huginn and Ouro; the Raven families run the block-independent ones")
    if method == "das-wave" and cache in ("ripe", "sinks") and params.get("window", 0) < METHODS[method]["max_width"]:
        exact = False
    prompts = ragged_prompts(model, seed=1)
    options = {**METHODS[method], "cache": cache, "exact": exact, **params}
    if method in ("mature-spec", "das-wave") and R not in make_policy(cache, R, **params).kept:
        pytest.skip("deep K/V reads need plane R for every position")
    out = run(model, prompts, BUDGETS, method, **options)
    for i, (prompt, budget) in enumerate(zip(prompts, BUDGETS, strict=True)):
        alone = run(model, prompt, budget, method, **options)
        assert torch.equal(out.sequences[i], alone.sequences[0]), (method, cache, i)
        assert out.row_accepted[i] == alone.accepted
        if exact:
            greedy = run(model, prompt, budget, cache=cache, **params)
            assert torch.equal(out.sequences[i], greedy.sequences[0]), (method, cache, i)


@pytest.mark.parametrize("cache, params, reads", [("full", {}, "deep-v"), ("full", {}, (2, 4)),
                                                  ("ripe", {"window": 4}, "deep-kv"),
                                                  ("ripe", {"window": 4}, "deep-k")])
def test_prefix_reads_rows_match_alone(model, cache, params, reads):
    prompts = ragged_prompts(model, (2, 6, 4), seed=2)
    options = {"cache": cache, "draft_loops": 3, "gamma": 3, "prefix_reads": reads, **params}
    out = run(model, prompts, 6, "self-spec", **options)
    for i, prompt in enumerate(prompts):
        assert torch.equal(out.sequences[i], run(model, prompt, 6, "self-spec", **options).sequences[0])


@pytest.mark.parametrize("cache, params", [("full", {}), ("deepest", {}), ("ripe", {"window": 3, "sinks": 1}),
                                           ("first", {"k": 2})])
def test_one_block_pass_matches_per_row_logits_and_bytes(cache, params):
    """Ragged prefill, then one 4-token block per row: logits equal those of each row alone (1e-12)."""
    model = random_model("raven", seed=5)
    policy = make_policy(cache, R, **params)
    prompts = ragged_prompts(model, (2, 9, 5), seed=3)
    batch = new_cache(model, policy, 3, 16)
    prompt_logits(model, batch, prompts, R)
    block = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(4))
    positions = batch.lengths[:, None] + torch.arange(4)
    logits, _ = run_pass(model, block, CachePass(batch, positions), R)
    batch.advance(4)
    for i, prompt in enumerate(prompts):
        alone = new_cache(model, policy, 1, 16)
        prefill(model, alone, prompt[None], R)
        expected, _ = run_pass(model, block[i:i + 1], CachePass(alone, range(len(prompt), len(prompt) + 4)), R)
        assert torch.allclose(logits[i], expected[0], rtol=0, atol=1e-12)
        assert batch.row_bytes()[i] == policy_bytes(model.config, policy, len(prompt) + 4, model.dtype)
    assert batch.allocated_bytes == 3 * policy_bytes(model.config, policy, 16, model.dtype)


@pytest.mark.parametrize("cache, fused", [("full", True), ("deepest", True), ("first", False), ("ripe", False),
                                          ("sinks", False)])
def test_blocks_read_in_place_with_one_fused_attention_where_the_policy_allows(cache, fused):
    """Core calls read in place where the policy keeps each loop's plane its own; prelude and coda calls under every
    policy (their planes hold every position); nothing reads in place when the block goes to the buffer."""
    model = random_model("huginn")
    options = POLICY_OPTIONS.get(cache, {})
    cache_ = new_cache(model, make_policy(cache, R, **options), 1, 8)
    block = CachePass(cache_, range(0, 3))
    assert (block.core_in_plane, block.edge_in_plane) == (fused, True)
    drafts = CachePass(cache_, range(0, 3), store="buffer", buffer=_buffer(model))
    assert not (drafts.core_in_plane or drafts.edge_in_plane)


@pytest.mark.parametrize("passes_class", [Passes, compiled_step.CompiledPasses])
@pytest.mark.parametrize("cache, block_store", [("full", "cache"), ("deepest", "cache"), ("first", "buffer"),
                                                ("ripe", "buffer"), ("sinks", "buffer")])
def test_a_verification_is_written_in_place_where_the_policy_lets_a_block_read_itself_there(passes_class, cache,
                                                                                            block_store):
    """Eager and compiled alike: one token per row always goes into the cache; a block where every plane is last
    written by its own loop too (its rejected tokens lie past each row's length), else into the block buffer; the
    logged pass says which."""
    model = random_model("huginn")
    options = POLICY_OPTIONS.get(cache, {})
    log = []
    passes = passes_class(model, new_cache(model, make_policy(cache, R, **options), 1, 64), 4, log.append)
    assert passes.verification_store(1) == "cache" and passes.verification_store(3) == block_store
    if passes_class is Passes:
        passes.prefill([torch.arange(5)])
        _, store, _ = passes.verify(torch.arange(3)[None], None)
        assert store == block_store and log[-1].in_place == (block_store == "cache")


@pytest.mark.parametrize("cache", ["full", "ripe", "sinks"])
def test_a_prompt_into_an_empty_cache_is_read_by_the_causal_kernel_under_every_policy(cache, monkeypatch):
    """A prefill has no prefix to read: every call of it, core calls under RIPE and sinks included, attends
    causally within the block through SDPA's causal kernel (no explicit mask over the whole block), with the full
    cache's logits."""
    model = random_model("huginn")
    options = POLICY_OPTIONS.get(cache, {})
    calls, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.shape[2], attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    cache_ = new_cache(model, make_policy(cache, R, **options), 1, 12)
    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", recorded)
        logits = prefill(model, cache_, ids, R)
    sites = model.config.n_prelude + model.config.n_coda + R * model.config.n_core
    assert calls == [(6, True, True)] * sites
    assert torch.equal(logits, prefill(model, new_cache(model, make_policy("full", R), 1, 12), ids, R))


def _buffer(model):
    from looped_kv.decoding.passes import new_buffer

    return new_buffer(model, R, 1, 4)


def test_ring_writes_keep_each_rows_last_window():
    """A block longer than the ring writes only each row's last W + 1 stored positions (the window and the slot past
    it): one write per slot, slot = position mod (W + 1)."""
    model = random_model("huginn")
    cache = PlaneCache(model.config, make_policy("ripe", R, window=3), batch=3, capacity=12, dtype=model.dtype)
    writes = cache.plan_writes(torch.arange(9).expand(3, -1), torch.tensor([2, 9, 5]))
    assert writes.ring.rows.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert writes.ring.cols.tolist() == [0, 1, 5, 6, 7, 8, 1, 2, 3, 4]
    assert writes.ring.index.tolist() == [0, 1, 1, 2, 3, 0, 1, 2, 3, 0]
    assert writes.main.rows.tolist() == [0] * 2 + [1] * 9 + [2] * 5


def test_stopped_rows_leave_the_batch_without_allocating():
    model = random_model("huginn", seed=2)
    out = run(model, ragged_prompts(model, (4, 2, 3)), [1, 3, 5])
    assert out.batch_per_pass == [2, 2, 1, 1]  # row 0 never steps; row 1 leaves after two steps
    assert [len(t) for t in out.new_rows] == [1, 3, 5]
    cache = PlaneCache(model.config, make_policy("ripe", R, window=3), batch=4, capacity=12, dtype=model.dtype)
    prompt_logits(model, cache, ragged_prompts(model, (4, 2, 3, 5)), R)
    before = [t.clone() for t in (*cache.core, *cache.ring)]
    peak, _ = peak_bytes(lambda: cache.keep_rows([1, 3]))
    assert peak < 1000 < cache.allocated_bytes  # compacted in place, only the small length vector is new
    assert cache.lengths.tolist() == [2, 5] and cache.batch == 2
    for old, new in zip(before, (*cache.core, *cache.ring), strict=True):
        assert torch.equal(new, old[:, :, [1, 3]])


@pytest.mark.parametrize("method", ["ar", *sorted(METHODS)])
def test_rows_stop_after_end_of_text(method):
    """Pick as end-of-text a token that greedy decoding emits mid-way in one row: that row stops right after it,
    the others run on, and every method emits the same tokens."""
    model = random_model("huginn", seed=6)
    prompts = ragged_prompts(model, (4, 6, 3), seed=7)
    free = run(model, prompts, 10)
    eos = int(free.new_rows[1][3])
    options = {**METHODS.get(method, {}), "eos_token_id": eos}
    out = generate(model, prompts, max_new_tokens=10, method=method, num_loops=R, **options)
    for i, row in enumerate(free.new_rows):
        hits = (row == eos).nonzero()
        expected = row[:int(hits[0]) + 1] if len(hits) else row
        assert torch.equal(out.new_rows[i], expected), (method, i)
        assert out.stopped[i] == ("eos" if len(hits) else "length")
    assert out.stopped[1] == "eos" and len(out.new_rows[1]) <= 4


def test_end_of_text_comes_from_the_tokenizer_by_default():
    from looped_kv import load

    model = load("tiny")
    ids = model.tokenizer("Question: Ava has 3 apples. How many apples does Ava have?\nAnswer:", return_tensors="pt")
    out = generate(model, ids.input_ids, max_new_tokens=200, num_loops=4)
    free = generate(model, ids.input_ids, max_new_tokens=200, num_loops=4, stop_at_eos=False)
    eos = model.tokenizer.eos_token_id
    assert out.stopped == ["eos"] and int(out.new_rows[0][-1]) == eos
    assert eos not in out.new_rows[0][:-1].tolist()
    assert torch.equal(out.new_rows[0], free.new_rows[0][:len(out.new_rows[0])])


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_compiled_and_eager_greedy_give_the_same_tokens(family, monkeypatch):
    """On Ouro (no edge layers; the embedding is the initial state) the compiled step's code runs untraced: tracing
    itself is tested on Huginn, and tracing a second model would cost CI about half a minute."""
    if family == "ouro":
        monkeypatch.setattr(compiled_step, "_TRACED", {})
        monkeypatch.setattr(compiled_step.torch, "compile", lambda step, **_: step)
    model = random_model(family, seed=8)
    prompts = ragged_prompts(model, (5, 3), seed=9)
    for cache in ("full", "deepest"):
        eager = generate(model, prompts, max_new_tokens=6, num_loops=3, cache=cache, stop_at_eos=False)
        compiled = generate(model, prompts, max_new_tokens=6, num_loops=3, cache=cache, stop_at_eos=False,
                            compile=True)
        assert all(torch.equal(a, b) for a, b in zip(eager.sequences, compiled.sequences, strict=True)), cache


def test_the_loop_and_the_drafters_never_ask_which_passes_or_drafter_they_run():
    """The plug-in boundary: the passes own their buffer and cache writes and share one interface (DAS-Wave's
    refinement included), and decide where a verification's keys/values wait from what they verify; the loop treats
    every drafter alike."""
    folder = Path(compiled_step.__file__).parent
    for name in ("loop.py", "das_wave.py", "lookup.py", "speculative.py"):
        source = (folder / name).read_text()
        for leak in (r"\.static\b", r"type\(drafter\)", r"isinstance\((passes|drafter)\b", r"\binto_cache\b"):
            assert not re.search(leak, source), (name, leak)
    for name in ("passes.py", "compiled.py"):
        assert not re.search(r"\.static\b|\binto_cache\b", (folder / name).read_text()), name
    assert "refine" in vars(Passes) and not hasattr(Passes, "static")


class ScriptedDrafts(Drafter):
    """A user's plug-in: each row proposes the next ``gamma`` tokens of its script, fixed in advance, and accepts
    like self-speculation; ``gamma`` = 0 proposes nothing (a subclass of greedy decoding's drafter)."""

    name = "scripted"

    def __init__(self, scripts: list[torch.Tensor], gamma: int) -> None:
        self.scripts, self.gamma = scripts, gamma
        self.lookahead = self.width = gamma + 1 if gamma else 0
        self.emitted: list[int] = []

    def start(self, prompts, pending):
        self.emitted = [1] * len(prompts)  # the pending token is the script's first

    def keep(self, rows):
        self.scripts, self.emitted = [self.scripts[i] for i in rows], [self.emitted[i] for i in rows]

    def propose(self, passes, pending, sampler):
        tokens = torch.zeros(len(self.scripts), self.gamma, dtype=torch.long)
        for i, (script, n) in enumerate(zip(self.scripts, self.emitted, strict=True)):
            part = script[n:n + self.gamma]
            tokens[i, :len(part)] = part
        return Proposal(tokens)

    def accept(self, pending, proposal, targets):
        accepted = accept(proposal.tokens, targets)
        nxt = targets.gather(1, accepted[:, None])
        emitted = [torch.cat([d[:a], p]) for d, a, p in zip(proposal.tokens, accepted.tolist(), nxt, strict=True)]
        self.emitted = [n + len(e) for n, e in zip(self.emitted, emitted, strict=True)]
        rows = len(emitted)
        return Outcome(accepted, accepted + 1, nxt, emitted, [self.gamma] * rows, [1] * rows)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("cache, params", [("full", {}), ("ripe", {"window": 4})])
@pytest.mark.parametrize("gamma", [0, 3])
def test_a_plug_in_drafter_runs_through_decode_eager_and_compiled(gamma, cache, params, compile, monkeypatch):
    """A drafter the loop has never heard of, proposing scripted tokens (greedy's continuation with one token
    changed), or nothing: decode runs it eager and compiled (its code untraced here), exactly (float64), with full
    blocks accepted and a block cut short at the changed token; rows stop at their own budgets."""
    if compile:
        monkeypatch.setattr(compiled_step, "_TRACED", {})
        monkeypatch.setattr(compiled_step.torch, "compile", lambda step, **_: step)
    model = random_model("huginn", seed=8)
    prompts, budgets = ragged_prompts(model, (5, 3), seed=9), [9, 6]
    greedy = generate(model, prompts, max_new_tokens=budgets, num_loops=R, cache=cache, stop_at_eos=False, **params)
    scripts = [row.clone() for row in greedy.new_rows]
    scripts[0][2] = (scripts[0][2] + 1) % model.config.vocab_size
    out = decode(model, prompts, budgets, policy=make_policy(cache, R, **params),
                 drafter=ScriptedDrafts(scripts, gamma), compile=compile)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, greedy.sequences, strict=True))
    assert out.stopped == ["length"] * 2
    if gamma:
        assert max(out.accepted) == gamma and min(out.row_accepted[0]) < gamma
    else:
        assert out.verifications == sum(budgets) - 2 and set(out.accepted) == {0}


def test_accept_is_ragged():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 2, 3]])
    targets = torch.tensor([[1, 2, 3, 9], [1, 5, 3, 9], [1, 2, 3, 9]])
    assert accept(drafts, targets).tolist() == [3, 1, 0]
    assert accept(drafts, targets, torch.tensor([2, 3, 1])).tolist() == [2, 1, 0]
    assert accept(drafts[:, :0], targets).tolist() == [0, 0, 0]


def test_prefix_outcome_accepts_on_the_host_what_accept_accepts_on_the_device():
    """Prompt lookup's and self-speculation's acceptance, read from the host once: on random ragged drafts, the same
    counts as :func:`accept`, the verifier's token after them as the next pending one, committed with them."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows, width = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(0, 6, (1,), generator=g))
        targets = torch.randint(0, 3, (rows, width + 1), generator=g)
        lengths = torch.randint(0, width + 1, (rows,), generator=g)
        drafts = torch.randint(0, 3, (rows, width), generator=g)
        ragged = [d[:n].tolist() for d, n in zip(drafts, lengths.tolist(), strict=True)]
        outcome = prefix_outcome(ragged, targets, lengths.tolist())
        counts = accept(drafts, targets, lengths)
        assert torch.equal(outcome.accepted, counts) and torch.equal(outcome.commit, counts + 1)
        assert torch.equal(outcome.pending, targets.gather(1, counts[:, None]))
        assert all(e.tolist() == [*r[:a], int(p)] for e, r, a, p in
                   zip(outcome.emitted, ragged, counts.tolist(), outcome.pending[:, 0], strict=True))
        assert outcome.drafted == lengths.tolist() and outcome.retained == [1] * rows


def test_a_tensor_of_prompts_a_list_and_one_prompt_agree():
    model = random_model("huginn", seed=4)
    ids = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(0))
    batch = run(model, ids, 5, "self-spec", cache="ripe", window=4, draft_loops=2, gamma=3)
    listed = run(model, list(ids), 5, "self-spec", cache="ripe", window=4, draft_loops=2, gamma=3)
    assert torch.equal(batch.tokens, listed.tokens) and batch.tokens.shape == (3, 9)
    # Algorithm 1 with W >= gamma emits what sequential decoding under the same RIPE cache emits
    assert torch.equal(run(model, ids[1], 5, "ar", cache="ripe", window=4).tokens[0], batch.tokens[1])
    assert batch.tau >= 1 and batch.tokens_per_s > 0


def test_throughput_cells():
    model = random_model("huginn", seed=4)
    prompts = ragged_prompts(model, (3, 5))
    cells = throughput_cells(model, prompts, [1, 3], "self-spec", "full", max_new_tokens=4, num_loops=R,
                             draft_loops=2, gamma=2, warmup=False)
    assert [c.batch for c in cells] == [1, 3]
    assert [c.new_tokens for c in cells] == [4, 12]
    assert all(c.tokens_per_s > 0 and c.tau >= 1 for c in cells)


@pytest.mark.parametrize("call, message", [
    (lambda m, p: generate(m, p, method="beam"), "method must be one of"),
    (lambda m, p: generate(m, p, cache="half"), "cache must be one of"),
    (lambda m, p: generate(m, p, max_new_tokens=[3]), "one int per prompt"),
    (lambda m, p: generate(m, p, max_new_tokens=0), "max_new_tokens must be >= 1"),
    (lambda m, p: generate(m, p, max_new_tokens=200), "exceeds the model's context"),
    (lambda m, p: generate(m, [], max_new_tokens=2), "at least one prompt"),
    (lambda m, p: generate(m, torch.zeros(2, 2, 2, dtype=torch.long)), "input_ids must be .batch, length."),
    (lambda m, p: generate(m, [torch.tensor([1, 99])]), r"token ids in \[0, 49\]"),
    (lambda m, p: generate(m, [torch.tensor([], dtype=torch.long)]), "prompt 0 is empty"),
    (lambda m, p: generate(m, p, eos_token_id=70), r"eos_token_id must be in \[0, 49\]"),
    (lambda m, p: generate(m, p, method="pld", compile="yes"), "compile must be True or False"),
    (lambda m, p: generate(m, p, compile=True, cache="ripe", window=2, gamma=2), "gamma=2 is not used by method='ar'"),
    (lambda m, p: generate(m, p, method="self-spec", cache="deepest", num_loops=R), "W = 0 < gamma"),
    (lambda m, p: generate(m, p, method="self-spec", draft_loops=R, num_loops=R), r"draft_loops must be in"),
    (lambda m, p: generate(m, p, method="self-spec", gamma=0, num_loops=R), r"gamma must be >= 1"),
    (lambda m, p: generate(m, p, method="self-spec", prefix_reads="shallow", num_loops=R), "prefix_reads must"),
    (lambda m, p: throughput_cells(m, p, [0]), "batch_sizes must be"),
    (lambda m, p: throughput_cells(m, p, [1], beam=2), "options must be among"),
    (lambda m, p: throughput_cells(m, p, [1], "self-spec", "ripe", window=1, gamma=2), "W = 1 < gamma = 2"),
    (lambda m, p: CachePass(None, torch.zeros(1, 1, dtype=torch.long), store="disk"), "store must be one of"),
])
def test_bad_parameters(call, message):
    model = random_model("huginn")
    with pytest.raises(ValueError, match=message):
        call(model, ragged_prompts(model, (3, 2)))


def test_keep_rows_rejects_bad_rows():
    model = random_model("huginn")
    cache = PlaneCache(model.config, make_policy("full", R), batch=3, capacity=8, dtype=model.dtype)
    for rows in ([], [2, 1], [0, 3]):
        with pytest.raises(ValueError, match="rows must be increasing indices"):
            cache.keep_rows(rows)


def test_command_line_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["batched", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--batch-sizes", "--max-new-tokens", "--draft-loops", "--gamma", "--budget-mb", "--fit-on"):
        assert flag in text


def test_command_line_on_the_tiny_model(capsys):
    assert cli.main(["batched", "--prompts", "2", "--batch-sizes", "1", "2", "--max-new-tokens", "3", "--num-loops",
                     "4", "--draft-loops", "2", "--gamma", "2", "--budget-mb", "1", "--memory-batch-sizes", "1", "2",
                     "3", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    for series in ("ar        full", "ar        deepest", "self-spec full", "self-spec deepest"):
        assert series in text
    assert "held-out error B=3" in text and "fixed-memory total" in text


def _no_decoding(*args, **kwargs):
    raise AssertionError("decoding started before every argument was checked")


@pytest.mark.parametrize("argv, message", [
    (["--fit-on", "1", "9"], r"--fit-on must name at least 2 distinct values of --memory-batch-sizes \[1, 2, 3, 4\]"),
    (["--fit-on", "2", "2"], "--fit-on must name at least 2 distinct values"),
    (["--draft-loops", "99"], r"--draft-loops must be in \[1, 31\] \(fewer than the R = 32 loops"),
    (["--num-loops", "4", "--draft-loops", "4"], r"--draft-loops must be in \[1, 3\] \(fewer than --num-loops 4\)"),
    (["--draft-loops", "0"], "--draft-loops must be >= 1, got 0"),
    (["--budget-mb", "-1"], "--budget-mb must be > 0"),
    (["--budget-mb", "inf"], "--budget-mb must be a finite number, got inf"),
    (["--batch-sizes", "0", "2"], "--batch-sizes must all be >= 1"),
    (["--memory-batch-sizes", "0", "1", "2"], "--memory-batch-sizes must all be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--gamma", "0"], "--gamma must be >= 1"),
    (["--num-loops", "0"], "--num-loops must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--device", "foo"], "--device 'foo' is not a torch device name; available here: cpu"),
    (["--model", "./no/such/folder"], "--model './no/such/folder'"),
    (["--max-new-tokens", "2000"], "exceeds the model's context"),
])
def test_command_line_checks_every_argument_before_decoding(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(throughput, "generate", _no_decoding)
    assert cli.main(["batched", "--prompts", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.startswith("looped-kv batched: error: ") and len(err.splitlines()) == 1
