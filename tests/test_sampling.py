"""Sampling for every method (issue 41, item 1): the speculative sampling rule keeps the target's distribution exactly
(enumerated in float64), every method's first three tokens follow plain sampling's distribution (chi-square over
20,000 seeded rows), a row emits in a batch what it emits alone with its seed, and temperature 0 is greedy decoding."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import random_model
from scipy import stats

from looped_kv import generate
from looped_kv.decoding import sampling
from looped_kv.decoding.sampling import Sampler, acceptance, draw, residual, speculate, uniforms

DRAWS = 20_000
SAMPLING = dict(temperature=0.05, top_k=6, top_p=0.95, min_p=0.02)  # the small model's logits are flat: T scales them
PROMPT = [18, 4, 18, 4]  # repeats: prompt lookup drafts from it
METHODS = {"ar": {}, "self-spec": {"draft_loops": 1, "gamma": 3}, "mature-spec": {"draft_loops": 2, "gamma": 2},
           "pld": {"gamma": 3, "ngram": 1},
           "das-wave": {"max_width": 4, "rounds": 2, "initial_width": 2, "updates": 2}}


def distributions(count: int, V: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Random distributions in float64, some with zeros, and point masses."""
    out = []
    for i in range(count):
        x = torch.rand(V, generator=generator, dtype=torch.float64) ** 3
        if i % 2:
            x[torch.rand(V, generator=generator) < 0.4] = 0
            x[i % V] += 0.1
        out.append(x / x.sum())
    return out + [torch.nn.functional.one_hot(torch.tensor(j), V).double() for j in (0, V // 2, V - 1)]


def test_the_acceptance_rule_keeps_p_exactly():
    """sum_x q(x) [min(1, p(x)/q(x)) 1{y = x} + (1 - min(1, p(x)/q(x))) r(y)] = p(y), r = max(0, p - q) normalised,
    for random p and q (q with zeros, p on one token, q a point mass, q = p), to 1e-12 in float64."""
    generator = torch.Generator().manual_seed(0)
    ps, qs = distributions(40, 9, generator), distributions(40, 9, generator)
    pairs = [*zip(ps, qs, strict=True), *((p, q) for p in ps[-3:] for q in qs), *((p, p) for p in ps[:3])]
    for p, q in pairs:
        kept = acceptance(p, q)  # per draft x
        out = q * kept + (q * (1 - kept)).sum() * residual(p, q)
        assert (out - p).abs().max() < 1e-12


def test_the_rule_accepts_below_the_ratio_and_draws_the_residual_then_the_bonus():
    """Drafts accepted while u < min(1, p/q); at the first rejection the token is drawn from max(0, p - q) by
    inverse CDF; with every draft accepted (or every one a row offered) the bonus is drawn from p."""
    p = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]], dtype=torch.float64)[None]
    q = torch.tensor([[0.2, 0.6, 0.2], [0.1, 0.7, 0.2]], dtype=torch.float64)[None]
    drafts = torch.tensor([[1, 1]])  # p/q = 1 at the first, 2/7 at the second
    ratio = 0.2 / 0.7
    u_draw = torch.tensor([[0.0, 0.5, 0.99]], dtype=torch.float64)
    rejected = speculate(p, drafts, q, None, torch.tensor([[0.999, ratio + 1e-9]], dtype=torch.float64), u_draw)
    # max(0, p - q) at the second position: [0.4, 0, 0.1] / 0.5; u = 0.5 falls in token 0
    assert rejected[0, :2].tolist() == [1, 0]
    accepted = speculate(p, drafts, q, None, torch.tensor([[0.5, ratio - 1e-9]], dtype=torch.float64), u_draw)
    assert accepted[0].tolist() == [1, 1, 2]  # the bonus: p's inverse CDF at 0.99
    offered = speculate(p, drafts, None, torch.tensor([1]), torch.tensor([[0.5, 0.0]], dtype=torch.float64), u_draw)
    assert offered[0, :2].tolist() == [1, 1]  # p(1) = 0.6 > 0.5 accepts; the bonus at the second: p's token 1
    point = residual(p[0, 1], torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(point, torch.tensor([0.625, 0.0, 0.375], dtype=torch.float64), rtol=0, atol=1e-15)


def test_draws_never_pick_a_token_of_weight_zero():
    weights = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0], dtype=torch.float64).expand(3, -1)
    u = torch.tensor([0.0, 0.25, 1 - 2.0**-52], dtype=torch.float64)
    assert draw(weights, u).tolist() == [1, 3, 3]


def test_a_draw_is_the_right_sided_search_of_its_uniform_in_the_cdf():
    """draw counts the cumulative weights at or below u times the total: torch.searchsorted(right=True), also where
    u lands exactly on a cumulative weight, in float64 and float32 weights."""
    generator = torch.Generator().manual_seed(2)
    for dtype in (torch.float64, torch.float32):
        weights = torch.rand(64, 50, generator=generator, dtype=dtype) ** 4 * (torch.rand(64, 50) > 0.3)
        weights[:, 0] += 1e-3  # a positive total in every row
        cdf = weights.double().cumsum(-1)
        u = torch.rand(64, generator=generator, dtype=torch.float64) * (1 - 2.0**-52)
        u[:16] = cdf[:16, 20] / cdf[:16, -1]  # on a step of the CDF
        searched = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        assert torch.equal(draw(weights, u), searched)


def test_uniforms_are_splitmix64_of_seed_position_and_stream():
    """The int64 arithmetic wraps as SplitMix64's unsigned arithmetic does (checked against Python integers)."""
    mask = 2**64 - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds, positions = [0, 7, 2**63 - 1], [[0, 5], [3, 1000], [2**20, 1]]
    keys = sampling.mix64(torch.tensor(seeds))
    for stream in (sampling.DRAFT, sampling.TARGET):
        got = uniforms(keys, torch.tensor(positions), stream)
        for i, seed in enumerate(seeds):
            for j, t in enumerate(positions[i]):
                z = mix((mix(seed) + (3 * t + stream + 1) * 0x9E3779B97F4A7C15) & mask)
                assert got[i, j].item() == (z >> 12) * 2.0**-52


def test_logits_processing_follows_temperature_top_k_top_p_min_p():
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64).log()

    def probs(**options: object) -> list[float]:
        return [round(x, 12) for x in Sampler(**{"temperature": 1.0, **options}).probabilities(logits).tolist()]

    assert probs() == [0.5, 0.25, 0.15, 0.1]
    assert probs(top_k=2) == [round(2 / 3, 12), round(1 / 3, 12), 0, 0]
    assert probs(top_p=0.7) == probs(top_k=2)  # 0.5 < 0.7 <= 0.75: the first two reach it
    assert probs(top_p=0.8) == probs(top_k=3) == probs(min_p=0.25)  # 0.15 >= 0.25 * 0.5 > 0.1
    assert probs(top_k=3, top_p=0.8) == probs(top_k=2)  # top-p of the renormalised top 3: 0.75 / 0.9 >= 0.8
    assert probs(temperature=0.5) == [round(x / 0.345, 12) for x in [0.25, 0.0625, 0.0225, 0.01]]  # p^2 renormalised
    tied = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64).log()
    assert (Sampler(1.0, top_k=2).probabilities(tied) > 0).all()  # ties at a cut are kept together


@pytest.mark.parametrize("option, value, message", [
    ("temperature", -0.5, "temperature must be a number >= 0"), ("temperature", True, "temperature must be"),
    ("temperature", float("inf"), "temperature must be"), ("top_k", 0, "top_k must be >= 1"),
    ("top_p", 0.0, r"top_p must be a number in \(0, 1\] or None"), ("top_p", 1.5, "top_p must be"),
    ("min_p", -0.1, r"min_p must be a number in \[0, 1\] or None"), ("seed", -1, "seed must be None, an int in"),
    ("seed", 1.5, "seed must be"), ("seed", [1, 2], r"seed must be an int or one int per prompt \(1\), got 2")])
def test_bad_sampling_options_are_refused_in_one_line(option, value, message):
    model = random_model()
    with pytest.raises(ValueError, match=message) as error:
        generate(model, torch.tensor([1, 2]), **{"temperature": 0.5, option: value})
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def small():
    """Vocabulary 32, R = 3: 20,000 rows decode in seconds."""
    return random_model("huginn", seed=1, vocab_size=32, n_embd=16, n_heads=2, n_kv_heads=2, intermediate_size=32,
                        mean_recurrence=3).float()


@pytest.fixture(scope="module")
def reference(small) -> dict[tuple[int, ...], float]:
    """The distribution of plain sampling's first three tokens after PROMPT, by teacher forcing every prefix."""
    process, R = Sampler(**SAMPLING).probabilities, small.config.mean_recurrence
    table = {(): 1.0}
    with torch.no_grad():
        for _ in range(3):
            prefixes = list(table)
            ids = torch.tensor([[*PROMPT, *prefix] for prefix in prefixes])
            probs = process(small(ids, R)[:, -1]).double()
            table = {(*prefix, int(t)): table[prefix] * float(probs[i, t])
                     for i, prefix in enumerate(prefixes) for t in probs[i].nonzero()[:, 0]}
    return table


def chi_square(draws: torch.Tensor, reference: dict[tuple[int, ...], float]) -> tuple[float, float, int]:
    """Pearson's chi-square of the drawn triples against ``reference``, outcomes expected fewer than 5 times pooled:
    (statistic, p-value, buckets). Outcomes of probability 0 must not occur."""
    counts = Counter(map(tuple, draws.tolist()))
    impossible = set(counts) - set(reference)
    assert not impossible, f"drew outcomes of probability 0: {sorted(impossible)[:5]}"
    n = len(draws)
    common = [o for o, p in reference.items() if p * n >= 5]
    observed = [counts[o] for o in common]
    expected = [reference[o] * n for o in common]
    rest = n - sum(expected)
    if rest >= 5:
        observed.append(n - sum(observed))
        expected.append(rest)
    else:
        observed[-1] += n - sum(observed)
        expected[-1] += rest
    result = stats.chisquare(observed, expected)
    return float(result.statistic), float(result.pvalue), len(observed)


def sample(model, method: str, **options: object):
    return generate(model, torch.tensor(PROMPT).expand(DRAWS, -1), method=method, max_new_tokens=3, stop_at_eos=False,
                    seed=0, **SAMPLING, **METHODS[method], **options)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_samples_the_first_three_tokens_of_plain_sampling(small, reference, method):
    """20,000 rows, seeds 0..19,999: the first three tokens pass a chi-square test against plain sampling's exact
    distribution (p > 0.001; the draws are fixed by the seeds). Accepted drafts are counted as under greedy decoding."""
    out = sample(small, method)
    statistic, pvalue, buckets = chi_square(out.new_tokens, reference)
    print(f"{method}: chi2 = {statistic:.1f}, {buckets - 1} dof, p = {pvalue:.3f}, A = {out.mean_accepted:.3f}, "
          f"tau = {out.tau:.3f}")
    assert pvalue > 1e-3, (method, statistic, buckets)
    if method != "ar":
        assert 0 < out.mean_accepted < max(out.drafted)
        for accepted, retained in zip(out.row_accepted, out.row_retained, strict=True):  # 2 after the prefill's
            assert sum(accepted[:-1]) + sum(retained[:-1]) < 2 <= sum(accepted) + sum(retained)


def test_the_chi_square_test_catches_a_rule_that_resamples_from_p_where_it_exceeds_q(small, reference, monkeypatch):
    """Resampling from p where p > q after a rejection (not from max(0, p - q)) draws only what p allows, but not as
    often as p: the test must see it."""
    monkeypatch.setattr(sampling, "residual", lambda p, q: p * (p > q) / (p * (p > q)).sum(-1, keepdim=True))
    statistic, pvalue, buckets = chi_square(sample(small, "self-spec").new_tokens, reference)
    print(f"resampling from p where p > q: chi2 = {statistic:.1f}, {buckets - 1} dof, p = {pvalue:.2g}")
    assert pvalue < 1e-6


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("cache", [{"cache": "full"}, {"cache": "ripe", "window": 4, "sinks": 1}])
def test_a_row_samples_in_a_batch_what_it_samples_alone_with_its_seed(method, cache):
    model = random_model("huginn", seed=3)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 50, (n,), generator=generator) for n in (5, 9, 3)]
    options = dict(method=method, max_new_tokens=[7, 4, 9], stop_at_eos=False, temperature=0.8, top_p=0.9,
                   **METHODS[method], **cache)
    batch = generate(model, prompts, seed=[11, 5, 2**40], **options)
    assert batch.tokens.tolist() == generate(model, prompts, seed=[11, 5, 2**40], rows_per_chunk=2,
                                             **options).tokens.tolist()
    for i, (prompt, seed) in enumerate(zip(prompts, [11, 5, 2**40], strict=True)):
        alone = generate(model, [prompt], seed=seed, **{**options, "max_new_tokens": options["max_new_tokens"][i]})
        assert torch.equal(alone.sequences[0], batch.sequences[i]), (method, i)
        assert alone.row_accepted[0] == batch.row_accepted[i]
    assert generate(model, prompts, seed=3, **options).tokens.tolist() == \
        generate(model, prompts, seed=[3, 4, 5], **options).tokens.tolist()  # an int s: row i draws with s + i
    greedy = generate(model, prompts, **{**options, "temperature": 0.0})
    assert batch.tokens.tolist() != greedy.tokens.tolist()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_temperature_zero_is_greedy_decoding_whatever_the_other_options(method):
    model = random_model("huginn", seed=3)
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6])]
    options = dict(method=method, max_new_tokens=6, stop_at_eos=False, **METHODS[method])
    greedy = generate(model, prompts, **options)
    zero = generate(model, prompts, temperature=0, top_k=2, top_p=0.5, min_p=0.9, seed=[1, 2], **options)
    assert zero.tokens.tolist() == greedy.tokens.tolist() and zero.row_accepted == greedy.row_accepted
