"""Greedy target preservation and RIPE Proposition 1, in float64.

Every speculative decoder must emit exactly the tokens of greedy full-depth decoding under the same
cache policy. The trained tiny model (in float64) accepts long runs of drafts, so these tests exercise
the accept/commit paths; random-weight models exercise the rejection paths and every family.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

import looped_kv
from looped_kv.decoding.das_wave import DEEP_KV, proposal_width, refine
from looped_kv.decoding.lookup import NgramIndex
from looped_kv.decoding.passes import new_cache, prefill, run_pass, step
from looped_kv.runtime.cache import BlockBuffer, CachePass
from looped_kv.runtime.policy import make_policy
from looped_kv.workloads import data


@pytest.fixture(scope="module")
def tiny64():
    return looped_kv.load("tiny", dtype=torch.float64)


def tiny_prompts(model, n: int, workload: str) -> list[torch.Tensor]:
    return [model.tokenizer(p, return_tensors="pt").input_ids for p in data.prompts(workload, n, split="dev")]


CONFIGS = [
    dict(method="self-spec", draft_loops=2, gamma=4),
    dict(method="self-spec", draft_loops=4, gamma=3, prefix_reads="deep-v"),
    dict(method="self-spec", draft_loops=1, gamma=5, prefix_reads=(1, 3)),
    dict(method="mature-spec", draft_loops=4, gamma=6),
    dict(method="pld", gamma=5),
    dict(method="das-wave", max_width=8, rounds=6, initial_width=2, updates=2),
    dict(method="das-wave", max_width=6, rounds=4, initial_width=1, updates=1, carry=False, prefix_reads="aligned"),
]


@pytest.mark.parametrize("workload", ["problems", "code"])
@pytest.mark.parametrize("cache", [{"cache": "full"}, {"cache": "ripe", "window": 8}])
def test_tiny_model_speculation_is_greedy(tiny64, workload, cache):
    for ids in tiny_prompts(tiny64, 2, workload):
        reference = looped_kv.generate(tiny64, ids, max_new_tokens=24, method="ar", num_loops=16, **cache)
        for config in CONFIGS:
            if cache["cache"] == "ripe" and isinstance(config.get("prefix_reads"), tuple):
                with pytest.raises(ValueError, match=r"need plane\(s\) \[1, 3\] for every position"):
                    looped_kv.generate(tiny64, ids, max_new_tokens=24, num_loops=16, **cache, **config)
                continue
            out = looped_kv.generate(tiny64, ids, max_new_tokens=24, num_loops=16, **cache, **config)
            assert torch.equal(out.tokens, reference.tokens), (config, cache)
            assert out.verifications >= 1


@pytest.mark.parametrize("family", ["huginn", "raven", "raven-olmo", "ouro"])
def test_random_models_speculation_is_greedy(family):
    model = random_model(family, seed=7)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=generator)
        reference = looped_kv.generate(model, ids, max_new_tokens=15, method="ar", num_loops=5)
        for config in CONFIGS:
            out = looped_kv.generate(model, ids, max_new_tokens=15, num_loops=5, **config)
            assert torch.equal(out.tokens, reference.tokens), config


def cache_state(cache):
    return [t.clone() for t in (*cache.edge, *cache.core, *cache.ring)]


@pytest.mark.parametrize("family", ["huginn", "raven", "raven-olmo", "ouro"])
@pytest.mark.parametrize("window, gamma", [(4, 4), (6, 3), (0, 3)])
def test_proposition_1(family, window, gamma):
    """RIPE Proposition 1: with W >= gamma, one batched pass over gamma + 1 tokens gives the logits and the
    cached planes of decoding them one at a time; with W = 0 (deepest plane) they differ."""
    model = random_model(family, seed=11)
    R, generator = 5, torch.Generator().manual_seed(2)
    policy = make_policy("ripe", R, window=window)
    for start in (3, 7, 12):
        ids = torch.randint(0, model.config.vocab_size, (1, start + gamma + 1), generator=generator)
        sequential, batched = (new_cache(model, policy, 1, ids.shape[1]) for _ in range(2))
        for cache in (sequential, batched):
            prefill(model, cache, ids[:, :start], R)
        logits_seq = torch.cat([step(model, sequential, ids[:, t:t + 1], R) for t in range(start, ids.shape[1])], 1)
        buffer = BlockBuffer(model.config, R, batch=1, capacity=gamma + 1, dtype=model.dtype)
        router = CachePass(batched, range(start, start + gamma + 1), buffer=buffer, store="buffer")
        logits_batch, _ = run_pass(model, ids[:, start:], router, R)
        batched.commit(buffer, gamma + 1)
        same_logits = torch.allclose(logits_batch, logits_seq, rtol=0, atol=1e-12)
        same_planes = all(torch.allclose(a, b, rtol=0, atol=1e-12)
                          for a, b in zip(cache_state(batched), cache_state(sequential), strict=True))
        if window >= gamma:
            assert same_logits and same_planes
        else:
            assert not same_logits and not same_planes


def test_exactness_needs_a_window_covering_the_block():
    model = random_model("huginn")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="W = 2 < gamma = 4"):
        looped_kv.generate(model, ids, max_new_tokens=4, method="self-spec", cache="ripe", window=2, gamma=4,
                           num_loops=5)
    with pytest.raises(ValueError, match="W = 0 < gamma"):
        looped_kv.generate(model, ids, max_new_tokens=4, method="mature-spec", cache="deepest", num_loops=5)
    out = looped_kv.generate(model, ids, max_new_tokens=4, method="mature-spec", cache="deepest", num_loops=5,
                             exact=False)
    assert out.num_new == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "self-spec", "draft_loops": 5}, r"draft_loops must be in \[1, 4\]"),
    ({"method": "self-spec", "draft_loops": 0}, r"draft_loops must be in \[1, 4\]"),
    ({"method": "self-spec", "gamma": 0}, "gamma must be >= 1"),
    ({"method": "self-spec", "prefix_reads": "shallow"}, "prefix_reads must be one of"),
    ({"method": "self-spec", "prefix_reads": (2, 6)}, "nu must be in"),
    ({"method": "das-wave", "max_width": 1, "initial_width": 2},
     r"max_width \(verifier capacity gamma\) must be >= initial_width"),
    ({"method": "das-wave", "gamma": 8}, "method='das-wave' takes max_width"),
    ({"method": "das-wave", "rounds": 0}, r"rounds \(J\) must be >= 1"),
    ({"method": "das-wave", "updates": 0}, r"updates \(k, recurrent updates per round\) must be >= 1"),
    ({"method": "pld", "ngram": 0}, "ngram must be >= 1"),
    ({"method": "mature-spec", "cache": "first", "k": 2, "exact": False}, r"need plane\(s\) \[5\]"),
])
def test_bad_speculation_parameters(kwargs, message):
    model = random_model("huginn")
    with pytest.raises(ValueError, match=message):
        looped_kv.generate(model, torch.zeros(1, 4, dtype=torch.long), max_new_tokens=4, num_loops=5, **kwargs)


def test_lookup_drafts_continue_the_last_ngram_match():
    assert NgramIndex([5, 6, 7, 8, 5, 6], ngram=2).drafts(gamma=3) == [7, 8, 5]
    assert NgramIndex([1, 2, 3], ngram=2).drafts(gamma=3) == []


def _scanned_drafts(context: list[int], gamma: int, ngram: int) -> list[int]:
    """The definition, by a backward scan: the tokens after the latest earlier occurrence of the last n-gram."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == context[-n:]:
                return context[start + n:start + n + gamma]
    return []


@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_an_ngram_index_grown_in_pieces_drafts_what_a_scan_of_its_context_finds(ngram):
    """The drafter's index, extended by pieces as a decode accepts tokens, gives at every length the drafts a scan of
    the whole context gives (small vocabularies: many repeats, and misses)."""
    g = torch.Generator().manual_seed(ngram)
    for vocab in (3, 7, 40):
        tokens = torch.randint(0, vocab, (120,), generator=g).tolist()
        index, length = NgramIndex(tokens[:5], ngram), 5
        while length < len(tokens):
            for gamma in (1, 4):
                assert index.drafts(gamma) == _scanned_drafts(tokens[:length], gamma, ngram), (vocab, length)
            step = int(torch.randint(1, 6, (1,), generator=g))
            index.extend(tokens[length:length + step])
            length = min(length + step, len(tokens))


# -- DAS-Wave's proposal engine (DAS Appendix B.2) -------------------------------------------------


def wave_setup(seed: int = 3, prompt: int = 6, R: int = 5):
    """A float64 random Huginn model with a prefilled full cache; (model, cache, anchor, R)."""
    model = random_model("huginn", seed=seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
    policy = make_policy("full", R)
    cache = new_cache(model, policy, 1, prompt + 32)
    anchor = prefill(model, cache, ids, R)[:, -1:].argmax(-1)
    return model, cache, anchor, R


def test_refinement_widths_follow_the_schedule():
    model, cache, anchor, _ = wave_setup()
    for max_width, rounds, initial_width in ((8, 4, 2), (4, 6, 1), (3, 2, 3)):
        trace: list[torch.Tensor] = []
        proposals = refine(model, cache, anchor, max_width=max_width, rounds=rounds, initial_width=initial_width,
                           updates=1, carry=True, reads=DEEP_KV, trace=trace)
        assert [t.shape[1] for t in trace] == [min(max_width, initial_width + j) for j in range(rounds)]
        assert proposals.shape[1] == proposal_width(max_width, rounds, initial_width)


def test_carry_continues_the_recurrence_of_the_first_position():
    """Position L is active from round 0 and reads nothing later: with carry, its readout after J rounds of k
    updates is that of one (J k)-loop pass; without carry, that of one k-loop pass."""
    model, cache, anchor, _ = wave_setup(seed=4)
    L, rounds, updates = cache.length, 3, 2

    def first_guess(num_loops: int) -> int:
        router = CachePass(cache, range(L, L + 1), reads=DEEP_KV, store=None)
        state = model.initial_state(torch.arange(L, L + 1), 1)
        logits = model(anchor, num_loops, state, positions=torch.arange(L, L + 1), router=router)
        return int(logits[0, -1].argmax())

    assert first_guess(rounds * updates) != first_guess(updates)  # else the test could not tell them apart
    for carry, loops in ((True, rounds * updates), (False, updates)):
        trace: list[torch.Tensor] = []
        refine(model, cache, anchor, max_width=4, rounds=rounds, initial_width=1, updates=updates, carry=carry,
               reads=DEEP_KV, trace=trace)
        assert int(trace[-1][0, 0]) == first_guess(loops), carry


def test_das_wave_commits_no_bonus_token_when_every_proposal_is_accepted(tiny64):
    max_width, rounds, initial_width = 4, 4, 2
    w = proposal_width(max_width, rounds, initial_width)
    kinds = set()
    for ids in tiny_prompts(tiny64, 3, "problems"):
        out = looped_kv.generate(tiny64, ids, max_new_tokens=40, method="das-wave", num_loops=16, max_width=max_width,
                                 rounds=rounds, initial_width=initial_width, updates=1)
        kinds |= {a == w for a in out.accepted}
        assert out.retained == [int(a < w) for a in out.accepted]
        committed = [a + u for a, u in zip(out.accepted, out.retained, strict=True)]
        assert 1 + sum(committed) >= out.num_new > sum(committed[:-1])  # the prefill's token, then each block's
        assert out.tau == pytest.approx(sum(committed) / len(committed)) and out.tau <= w
    assert kinds == {True, False}  # both kinds of verification occur


def test_ripe_drafts_read_plane_R_by_default():
    """RIPE Algorithm 1, line 3: with cache="ripe", self-spec drafts read plane R for cached positions."""
    model = random_model("huginn", seed=4)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    settings = dict(max_new_tokens=12, method="self-spec", cache="ripe", window=4, gamma=3, draft_loops=2,
                    num_loops=5)
    default = looped_kv.generate(model, ids, **settings)
    deep = looped_kv.generate(model, ids, prefix_reads="deep-kv", **settings)
    aligned = looped_kv.generate(model, ids, prefix_reads="aligned", **settings)
    assert default.accepted == deep.accepted
    assert aligned.accepted != deep.accepted  # else the test could not tell the two reads apart
