"""Plane caches: exact byte accounting (RIPE Eq. 3 and 10) and decoding equal to the no-cache forward."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

from looped_kv import (
    huginn_0125,
    m_deep,
    m_full,
    m_ripe,
    make_policy,
    memory_table,
    ouro_1_4b,
    ouro_2_6b,
    papers,
    policy_bytes,
    raven_llama,
    raven_tinyllama,
)
from looped_kv.decoding.greedy import greedy
from looped_kv.decoding.passes import new_cache, prefill, run_pass, step
from looped_kv.runtime.attention import Site
from looped_kv.runtime.cache import CachePass, PlaneCache
from looped_kv.runtime.config import raven_olmo
from looped_kv.runtime.memory import layer_token_bytes
from looped_kv.runtime.policy import make_prefix_reads

FAMILIES = ["huginn", "raven", "raven-olmo", "ouro", "parcae"]


def per_token_kb(config, cache):
    """KV kilobytes (10^3 bytes) per token of a named policy at the config's R (bf16)."""
    return policy_bytes(config, make_policy(cache, config.mean_recurrence), 1) / 1e3


def test_per_token_memory_of_the_papers():
    """Eq. (3): KB per token of both caches on Huginn-0125 and Raven-Llama (bf16), to RIPE Sec. 2's precision."""
    printed = papers.RIPE_SEC_2_KV_PER_TOKEN
    for name, config in ((papers.HUGINN, huginn_0125()), (papers.RAVEN_LLAMA, raven_llama())):
        for cache, kb in printed[name].items():
            digits = 0 if float(kb).is_integer() else 1
            assert round(per_token_kb(config, cache), digits) == kb, (name, cache)


def test_per_token_memory_of_raven_olmo():
    """Eq. (3) on the raven_olmo preset: OLMo-2's 16 full KV heads of width 128 make b = 8,192 B (bf16), four times
    Raven-Llama's, at the same 4/6/4 split: 1,638.4 KB per token for the full cache at R = 32, 114.7 for the deepest."""
    config = raven_olmo()
    assert layer_token_bytes(config) == 8192 == 4 * layer_token_bytes(raven_llama())
    assert round(per_token_kb(config, "full"), 1) == 1638.4
    assert round(per_token_kb(config, "deepest"), 1) == 114.7


def test_presets_are_the_papers_checkpoints():
    """DAS Table 3's layer split and R for every preset of its four checkpoints."""
    presets = {papers.HUGINN: huginn_0125(), papers.RAVEN_LLAMA: raven_llama(), papers.RAVEN_OLMO: raven_olmo(),
               papers.RAVEN_TINYLLAMA: raven_tinyllama()}
    for name, config in presets.items():
        assert (config.n_prelude, config.n_core, config.n_coda, config.mean_recurrence) == papers.DAS_TABLE_3[name]


def test_per_token_memory_of_raven_tinyllama_and_ouro():
    """Eq. (3) on the new presets, in bf16. Raven-TinyLlama: 4 KV heads of width 64 make b = 2 x 4 x 64 x 2 = 1,024 B,
    so the full cache at R = 32 holds (4 + 4 + 32 x 8) b = 270,336 B per token and the deepest plane (4 + 4 + 8) b =
    16,384 B. Ouro-1.4B: 16 KV heads of width 128 make b = 8,192 B; no prelude or coda, so the full cache at its R = 4
    holds 4 x 24 b = 786,432 B and the deepest plane (Ouro's last loop) 24 b = 196,608 B, a quarter; Ouro-2.6B twice
    both. The caches allocate exactly these bytes."""
    tiny_llama, ouro, ouro_big = raven_tinyllama(), ouro_1_4b(), ouro_2_6b()
    assert layer_token_bytes(tiny_llama) == 1024 and layer_token_bytes(ouro) == layer_token_bytes(ouro_big) == 8192
    assert m_full(tiny_llama, 1) == 270_336 and m_deep(tiny_llama, 1) == 16_384
    assert m_full(ouro, 1) == 786_432 == 4 * m_deep(ouro, 1) and m_deep(ouro, 1) == 196_608
    assert m_full(ouro_big, 1) == 2 * m_full(ouro, 1) and m_deep(ouro_big, 1) == 2 * m_deep(ouro, 1)
    assert m_ripe(ouro, 1024, 64) == m_deep(ouro, 1024) + 8192 * 24 * 3 * 64  # Eq. (10): b n_core (R - 1) W
    for config in (tiny_llama, ouro):
        for policy in (make_policy("full", config.mean_recurrence), make_policy("deepest", config.mean_recurrence)):
            cache = PlaneCache(config, policy, batch=1, capacity=3, dtype=torch.bfloat16, device="meta")
            assert cache.allocated_bytes == policy_bytes(config, policy, 3, torch.bfloat16)


def test_table_2_reproduced_from_configs():
    """RIPE Table 2 (L = 1024, MB = 10^6 bytes) to its printed precision (MB, and fractions to 0.1%)."""
    rows = memory_table({"Huginn": huginn_0125(), "Raven": raven_llama()}, length=1024)
    assert [row["cache"] for row in rows] == list(papers.RIPE_TABLE_2)
    for row in rows:
        h_mb, h_frac, r_mb, r_frac = papers.RIPE_TABLE_2[row["cache"]]
        assert round(row["Huginn MB"]) == h_mb and round(row["Huginn frac."], 3) == h_frac
        assert round(row["Raven MB"]) == r_mb and round(row["Raven frac."], 3) == r_frac


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cache_bytes_equal_the_memory_equations(family, dtype):
    model = random_model(family).to(dtype)
    cfg, R, L = model.config, 5, 23
    for name, params, equation in [("full", {}, m_full(cfg, L, R, dtype)), ("deepest", {}, m_deep(cfg, L, dtype)),
                                   ("ripe", {"window": 4}, m_ripe(cfg, L, 4, R, dtype)),
                                   ("ripe", {"window": 40}, m_ripe(cfg, L, 40, R, dtype)),
                                   ("ripe", {"window": 4, "sinks": 2}, None), ("sinks", {"sinks": 3}, None)]:
        policy = make_policy(name, R, **params)
        cache = new_cache(model, policy, batch=1, capacity=L)
        assert cache.allocated_bytes == policy_bytes(cfg, policy, L, dtype)
        # RIPE's and the sinks policy's scratch, keys and values per core layer: S + W + 1 slots of the kept plane,
        # and the ring's slot beyond the window in each of the R - 1 other planes (none where W >= L: no wrap)
        S, W = params.get("sinks", 0), params.get("window", 0)
        gap, spare = (min(S, L) + min(W + 1, L), R - 1 if W < L else 0) if name in ("ripe", "sinks") else (0, 0)
        assert cache.scratch_bytes == (gap + spare) * 2 * cfg.n_core * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize
        prefill(model, cache, torch.randint(0, cfg.vocab_size, (1, L)), R)
        assert cache.nbytes == (policy_bytes(cfg, policy, L, dtype) if equation is None else equation)


class BruteForce:
    """Token-by-token decoding that keeps every plane of every position in Python lists and reads, at core loop r
    of token t, plane pi(r, t, j) = ``policy.read(r, t, j)`` of each earlier position j: the cache semantics
    spelled out slowly, with no ring, no sinks buffer and no preallocation."""

    def __init__(self, policy) -> None:
        self.policy, self.past = policy, {}  # (stage, layer) -> per position: {loop: (k, v)}

    def attend(self, site, q, k, v):
        rows = self.past.setdefault((site.stage, site.layer), [])
        if site.loop <= 1:  # the first call of this site for a new token
            rows.append({})
        t = len(rows) - 1
        rows[t][site.loop] = (k, v)
        planes = [self.policy.read(site.loop, t, j) if site.stage == "core" else 0 for j in range(t)]
        keys = torch.cat([rows[j][p][0] for j, p in enumerate(planes)] + [k], dim=2)
        values = torch.cat([rows[j][p][1] for j, p in enumerate(planes)] + [v], dim=2)
        groups = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1))


POLICIES = [("full", {}), ("deepest", {}), ("ripe", {"window": 3}), ("ripe", {"window": 2, "sinks": 2}),
            ("sinks", {"sinks": 2}), ("k-deepest", {"k": 2}), ("share", {"k": 2}), ("first", {"k": 3})]


def brute_force_logits(model, ids, policy):
    slow = BruteForce(policy)
    return torch.cat([model(ids[:, t:t + 1], policy.num_loops, positions=torch.tensor([t]), router=slow)
                      for t in range(ids.shape[1])], dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache, params", POLICIES)
def test_cached_decoding_equals_brute_force(family, cache, params):
    """Token-by-token decoding with a preallocated cache gives the brute force's logits under pi (float64), for
    every policy; 12 tokens wrap the RIPE ring several times. Greedy decoding emits the brute force's argmax."""
    model = random_model(family, seed=1)
    R, n = 4, 12
    policy = make_policy(cache, R, **params)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    kv = new_cache(model, policy, batch=1, capacity=n)
    logits = torch.cat([prefill(model, kv, ids[:, :1], R)] + [step(model, kv, ids[:, t:t + 1], R)
                                                              for t in range(1, n)], dim=1)
    torch.testing.assert_close(logits, brute_force_logits(model, ids, policy), rtol=0, atol=1e-10)
    if cache != "full":  # the check can tell policies apart
        assert not torch.allclose(logits, brute_force_logits(model, ids, make_policy("full", R)), atol=1e-6)
    out = greedy(model, ids[:, :1], n, policy=policy)
    assert torch.equal(brute_force_logits(model, out.tokens[:, :-1], policy).argmax(-1), out.tokens[:, 1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_full_cache_equals_no_cache_forward(family):
    """With the full cache, each greedy token is the argmax of one no-cache forward over the sequence so far."""
    model = random_model(family, seed=1)
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    out = greedy(model, prompt, 8, policy=make_policy("full", 4))
    logits = model(out.tokens[:, :-1], num_loops=4)
    assert torch.equal(logits[:, 6:].argmax(-1), out.new_tokens)


def test_full_cache_logits_equal_forward_float64():
    model = random_model("raven", seed=2)
    R = 3
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    cache = new_cache(model, make_policy("full", R), batch=1, capacity=12)
    logits = [prefill(model, cache, ids[:, :5], R)]
    for t in range(5, 12):
        logits.append(step(model, cache, ids[:, t:t + 1], R))
    reference = model(ids, num_loops=R)
    assert torch.allclose(torch.cat(logits, dim=1), reference, rtol=0, atol=1e-12)


def test_policy_planes():
    R = 8
    assert [make_policy("full", R).read(r, 10, 0) for r in range(1, R + 1)] == list(range(1, R + 1))
    assert {make_policy("deepest", R).read(r, 10, 0) for r in range(1, R + 1)} == {R}
    two = make_policy("k-deepest", R, k=2)  # compress-s(2 n_core): same parity as R reads R, else R - 1
    assert [two.read(r, 10, 0) for r in range(1, R + 1)] == [7, 8, 7, 8, 7, 8, 7, 8]
    share = make_policy("share", R, k=4)
    assert [share.read(r, 10, 0) for r in range(1, R + 1)] == [4, 4, 4, 4, 8, 8, 8, 8]
    first = make_policy("first", R, k=3)
    assert [first.read(r, 10, 0) for r in range(1, R + 1)] == [1, 2, 3, 3, 3, 3, 3, 3]
    ripe = make_policy("ripe", R, window=2)  # Eq. (9)
    assert ripe.read(3, 10, 8) == 3 and ripe.read(3, 10, 7) == R
    sinks = make_policy("sinks", R, sinks=2)
    assert sinks.read(3, 10, 1) == 3 and sinks.read(3, 10, 2) == R


@pytest.mark.parametrize("call, message", [
    (lambda: make_policy("compress", 8), "cache must be one of"),
    (lambda: make_policy("ripe", 8), "needs window"),
    (lambda: make_policy("ripe", 8, window=-1), "window must be in"),
    (lambda: make_policy("k-deepest", 8, k=9), "k must be in"),
    (lambda: make_policy("ripe", 8, window=2, sinks=-1), "sinks must be in"),
    (lambda: make_policy("sinks", 8, sinks=2, window=-1), "window must be in"),
    (lambda: make_prefix_reads("deep-q", 8), "prefix_reads must be one of"),
    (lambda: make_prefix_reads((0, 8), 8), "kappa must be in"),
])
def test_bad_policy_parameters(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("name, params, message", [
    ("deepest", {"window": 16}, r"window=16 is not used by cache='deepest'; only cache in \('ripe', 'sinks'\)"),
    ("full", {"window": 0}, r"window=0 is not used by cache='full'"),
    ("k-deepest", {"k": 2, "window": 4}, r"window=4 is not used by cache='k-deepest'"),
    ("deepest", {"k": 2}, r"k=2 is not used by cache='deepest'; only cache in \('k-deepest', 'share', 'first'\)"),
    ("ripe", {"window": 4, "k": 2}, r"k=2 is not used by cache='ripe'"),
    ("sinks", {"sinks": 2, "k": 1}, r"k=1 is not used by cache='sinks'"),
    ("share", {"k": 2, "sinks": 1}, r"sinks=1 is not used by cache='share'; only cache in \('ripe', 'sinks'\)"),
    ("first", {"k": 2, "sinks": 0}, r"sinks=0 is not used by cache='first'"),
])
def test_unused_policy_parameters_are_rejected(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_policy(name, 8, **params)


def test_unused_policy_parameters_may_be_none():
    """Passing None for a parameter the policy ignores (as generate() does) stays fine."""
    assert make_policy("deepest", 8, window=None, k=None, sinks=None) == make_policy("deepest", 8)
    assert make_policy("ripe", 8, window=3, k=None) == make_policy("ripe", 8, window=3)
    assert make_policy("share", 8, k=2, window=None, sinks=None) == make_policy("share", 8, k=2)
    assert make_policy("sinks", 8, sinks=2, window=3).window == 3
    assert make_policy("ripe", 8, window=3, sinks=1).sinks == 1


def test_layer_token_bytes():
    assert layer_token_bytes(huginn_0125(), "bf16") == 2 * 55 * 96 * 2


def assert_the_fused_read_is_the_segment_read(model, policy, prompts, steps, monkeypatch, lengths=None):
    """Prefill ``prompts`` (rows of ``lengths`` tokens) and decode ``steps`` one token per pass, once with the fused
    one-token read and once with the segment read: every step after the prefill can take the fused read, and in
    float64 both give the same logits and store the same planes."""
    from looped_kv.runtime import cache as cache_module

    init, R = cache_module.CachePass.__init__, policy.num_loops
    runs = []
    for fused in (True, False):
        fused_here: list[bool] = []

        def chosen(self, *args, fused=fused, fused_here=fused_here, **kwargs):
            init(self, *args, **kwargs)
            fused_here.append(self.gapped)
            self.gapped = self.gapped and fused

        with monkeypatch.context() as patch:  # undone before the next run
            patch.setattr(cache_module.CachePass, "__init__", chosen)
            cache = new_cache(model, policy, prompts.shape[0], 16)
            prefill(model, cache, prompts, R, lengths=lengths)
            logits = [step(model, cache, steps[:, i:i + 1], R) for i in range(steps.shape[1])]
        assert all(fused_here[1:]) and cache.scratch_bytes > 0
        runs.append((logits, cache))
    (fused_logits, a), (segment_logits, b) = runs
    for x, y in zip(fused_logits, segment_logits, strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-12)
    for x, y in zip([*a.core, *a.ring, *a.sink], [*b.core, *b.ring, *b.sink], strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["huginn", "ouro", "parcae"])
@pytest.mark.parametrize("name, params, lengths", [("ripe", {"window": 3}, [7, 4, 9]),
                                                   ("sinks", {"sinks": 2, "window": 3}, [7, 5, 9]),
                                                   ("sinks", {"sinks": 3}, [7, 3, 9]),
                                                   ("ripe", {"window": 2, "sinks": 1}, [7, 3, 9])])
def test_the_fused_one_token_read_is_the_segment_read(family, name, params, lengths, monkeypatch):
    """Eager RIPE and sinks steps take one token per row with the sinks' and the ring's plane and the token copied
    into the kept plane's scratch slots, read in one fused call. In float64 it gives the segment softmax's logits and
    stores the same planes, for one row and for rows of different lengths (the shortest at S + W), over steps that
    wrap the ring."""
    model = random_model(family, seed=3).to(torch.float64)
    policy = make_policy(name, 5, **params)
    lengths = torch.tensor(lengths)
    prompts = torch.randint(0, model.config.vocab_size, (3, 9))
    steps = torch.randint(0, model.config.vocab_size, (3, 5))
    for rows in (slice(0, 1), slice(0, 3)):
        assert_the_fused_read_is_the_segment_read(model, policy, prompts[rows], steps[rows], monkeypatch,
                                                  lengths=lengths[rows])


@pytest.mark.parametrize("name, params", [("ripe", {"window": 3}), ("sinks", {"sinks": 2, "window": 3}),
                                          ("sinks", {"sinks": 3}), ("sinks", {"sinks": 5, "window": 2}),
                                          ("ripe", {"window": 2, "sinks": 1})])
def test_the_fused_read_serves_rows_of_one_length_shorter_than_the_sinks_and_the_window(name, params, monkeypatch):
    """Rows of one length L < S + W read every position at plane r at loops r < R: at L <= W the ring's slots 0..L
    alone, then the scratch less the sinks the ring holds. From a one-token prompt on, every step takes the fused
    read, and in float64 it gives the segment read's logits and planes, for one row and for two."""
    model = random_model("huginn", seed=4).to(torch.float64)
    policy = make_policy(name, 5, **params)
    for batch in (1, 2):
        g = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, model.config.vocab_size, (batch, 1), generator=g)
        steps = torch.randint(0, model.config.vocab_size, (batch, 10), generator=g)
        assert_the_fused_read_is_the_segment_read(model, policy, prompt, steps, monkeypatch)


def test_the_sinks_and_the_ring_are_one_store_in_the_scratch_order_and_passes_record_no_autograd():
    """Each extra plane's sinks and ring slots are views of one tensor, sinks first, as the scratch slots before the
    kept plane are laid out (so that one copy moves both). Cache passes run under a caller's autograd (ragged rows,
    the fused one-token read) record nothing: the cache's in-place writes are never differentiated."""
    model = random_model("huginn", seed=5).to(torch.float64)
    cache = new_cache(model, make_policy("sinks", 5, sinks=2, window=3), 3, 16)
    for kind in (0, 1):
        base = cache.extra_base[kind]
        assert cache.sink[kind].data_ptr() == base.data_ptr()
        assert cache.ring[kind].data_ptr() == base.narrow(-2, cache.sink_size, 1).data_ptr()
        assert base.shape[-2] == cache.gap == cache.sink_size + cache.ring_size
    assert torch.is_grad_enabled()
    prefill(model, cache, torch.randint(0, model.config.vocab_size, (3, 9)), 5, lengths=torch.tensor([7, 5, 9]))
    logits = step(model, cache, torch.randint(0, model.config.vocab_size, (3, 1)), 5)
    assert not logits.requires_grad and not any(t.requires_grad for t in cache._tensors())


@pytest.mark.parametrize("name, params", [("ripe", {"window": 3}), ("ripe", {"window": 2, "sinks": 2}),
                                          ("sinks", {"sinks": 3})])
def test_a_fused_pass_that_stores_nothing_writes_only_the_ring_slot_past_every_window(name, params):
    """A fused one-token pass writes its token into its ring slot (position mod (W + 1)) before reading the ring, also
    when it stores nothing (a replay, a probe): that slot is the next position's, past every window, so rows of
    other lengths and later block reads (masked segments) and steps (fused) return what they return without it."""
    model = random_model("huginn", seed=5).to(torch.float64)
    R, V = 5, model.config.vocab_size
    policy = make_policy(name, R, **params)
    g = torch.Generator().manual_seed(1)
    prompts, probe, block, token = (torch.randint(0, V, (2, n), generator=g) for n in (9, 1, 3, 1))
    lengths = torch.tensor([9, 7])
    probed, plain = (new_cache(model, policy, 2, 16) for _ in range(2))
    for cache in (probed, plain):
        prefill(model, cache, prompts, R, lengths=lengths)
    router = CachePass(probed, probed.lengths[:, None], store=None)
    assert router.gapped
    run_pass(model, probe, router, R)
    assert not torch.equal(probed.ring[0], plain.ring[0])  # the probe's planes lie in each row's next slot
    assert torch.equal(step(model, probed, block, R), step(model, plain, block, R))  # a block: masked segments
    assert torch.equal(step(model, probed, token, R), step(model, plain, token, R))  # one token: the fused read
    for a, b in zip(probed._tensors(), plain._tensors(), strict=True):
        assert torch.equal(a, b)  # the block and the token overwrote the probe's slots


@pytest.mark.parametrize("window, sinks", [(4, 0), (4, 3), (0, 3), (5, 2)])
@pytest.mark.parametrize("start, stop", [(0, 2), (0, 11), (3, 6), (2, 9), (7, 8), (6, 17)])
def test_a_blocks_ring_and_sinks_written_as_slices_are_its_entries_written_one_by_one(window, sinks, start, stop):
    """``span_writes`` stores a block at shared positions [start, stop) as slices (the ring's last W + 1 positions in
    two where its slots wrap, the sinks below S): the same ring and sinks as writing every entry by its index."""
    model = random_model("huginn")
    policy = make_policy("sinks" if sinks else "ripe", model.config.mean_recurrence, window=window,
                         **({"sinks": sinks} if sinks else {}))
    sliced, entries = (new_cache(model, policy, 2, 20) for _ in range(2))
    g = torch.Generator().manual_seed(stop)
    shape = (2, model.config.n_kv_heads, stop - start, model.config.head_dim)
    block = {Site("core", 0, loop): tuple(torch.randn(shape, generator=g, dtype=model.dtype) for _ in range(2))
             for loop in range(1, model.config.mean_recurrence)}
    sliced.write(sliced.span_writes(start, stop), block)
    entries.write(entries.plan_writes(torch.arange(start, stop).expand(2, -1)), block)
    for a, b in zip([*sliced.ring, *sliced.sink], [*entries.ring, *entries.sink], strict=True):
        assert torch.equal(a, b)
    assert all(t.abs().sum() > 0 for t in sliced.ring)  # the block's last W + 1 positions (at W = 0: its last)
    assert any(t.abs().sum() > 0 for t in sliced.sink) == (start < sinks)
