"""The package's self-tests, run on the node before every pre-registered batch (RIPE Section 5, "Protocol").

Quick CPU checks of the properties the measurements rely on, on a small random float64 model,
where exact-arithmetic claims hold to rounding:

* speculative decoding emits exactly greedy decoding's tokens (full cache, and RIPE with
  W >= gamma: Proposition 1);
* batched verification under RIPE(W >= gamma) equals sequential decoding to float64 rounding
  (KL < 1e-10, Proposition 1), while the deepest-plane cache (W = 0) does not (KL > 1e-6), so the
  check can tell the two apart;
* the bytes a cache allocates equal Eq. (3) and Eq. (10);
* a substitution arm that gives each loop its own plane reproduces the reference (Section 3.1);
* a replay rerun is bitwise identical (Section 5.5).

    python -m looped_kv.protocol.selftest
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from looped_kv.analysis.measure import block_dependence
from looped_kv.analysis.replay import kl, replay, substitute
from looped_kv.decoding.generate import generate
from looped_kv.decoding.passes import new_cache
from looped_kv.protocol.reproducibility import bitwise_rerun
from looped_kv.runtime.config import LoopedConfig
from looped_kv.runtime.memory import m_deep, m_full, m_ripe
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import make_policy

R, GAMMA, WINDOW, NEW_TOKENS = 6, 3, 4, 12


@dataclass(frozen=True)
class SelfTest:
    name: str
    passed: bool
    detail: str


class SelfTestFailure(RuntimeError):
    """Raised when a self-test fails: a batch must not run on this node."""


def random_model(seed: int = 0) -> LoopedLM:
    """A small randomly initialised Huginn-style looped model in float64."""
    config = LoopedConfig(family="huginn", vocab_size=40, n_embd=32, n_heads=4, n_kv_heads=4, n_prelude=1, n_core=2,
                          n_coda=1, intermediate_size=48, block_size=96, qk_bias=True, rope_base=10000.0,
                          embed_scale=5.0, state_std=0.1, mean_recurrence=R)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = LoopedLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator, dtype=p.dtype) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * (0.3 if p.dim() == 2 else 0.1))
    return model


def _prompt(model: LoopedLM, n: int = 6) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))


def _speculative_exact(model: LoopedLM, cache: str) -> tuple[bool, str]:
    window = WINDOW if cache == "ripe" else None
    ids = _prompt(model)
    greedy = generate(model, ids, max_new_tokens=NEW_TOKENS, method="ar", cache=cache, window=window)
    spec = generate(model, ids, max_new_tokens=NEW_TOKENS, method="self-spec", cache=cache, window=window,
                    draft_loops=2, gamma=GAMMA)
    same = bool(torch.equal(greedy.tokens, spec.tokens))
    return same, f"{NEW_TOKENS} tokens, {spec.verifications} verifications, equal to greedy: {same}"


def _proposition_1(model: LoopedLM) -> tuple[bool, str]:
    tokens = generate(model, _prompt(model), max_new_tokens=NEW_TOKENS, method="ar").tokens
    ripe = float(block_dependence(model, tokens, 6, make_policy("ripe", R, window=WINDOW), GAMMA).max())
    deepest = float(block_dependence(model, tokens, 6, make_policy("deepest", R), GAMMA).max())
    detail = f"max KL batched vs sequential: RIPE(W={WINDOW}) {ripe:.1e}, deepest plane {deepest:.1e}"
    return ripe < 1e-10 and deepest > 1e-6, detail


def _cache_bytes(model: LoopedLM) -> tuple[bool, str]:
    config, L = model.config, 20
    expected = {"full": m_full(config, L, R, torch.float64), "deepest": m_deep(config, L, torch.float64),
                "ripe": m_ripe(config, L, WINDOW, R, torch.float64)}
    allocated = {name: new_cache(model, make_policy(name, R, window=WINDOW if name == "ripe" else None), 1,
                                 L).allocated_bytes for name in expected}
    return allocated == expected, f"allocated {allocated}, Eq. 3/10 {expected}"


def _substitution_identity(model: LoopedLM) -> tuple[bool, str]:
    ids = _prompt(model, 10)
    reference = replay(model, ids, R, softmax_dtype=torch.float64, decoded=4)
    worst = max(float(kl(reference.logits, substitute(model, reference, r, [r])).abs().max())
                for r in (1, R // 2, R))
    return worst < 1e-20, f"max KL of own-plane arms vs reference: {worst:.1e}"


def _bitwise_replay(model: LoopedLM) -> tuple[bool, str]:
    report = bitwise_rerun(replay, model, _prompt(model, 10), R, decoded=4)
    return report.identical, f"bitwise identical fraction {report.equal_fraction:.3f} over {report.tensors} tensors"


CHECKS: dict[str, Callable[[LoopedLM], tuple[bool, str]]] = {
    "speculative = greedy (full cache)": lambda m: _speculative_exact(m, "full"),
    "speculative = greedy (RIPE, W >= gamma)": lambda m: _speculative_exact(m, "ripe"),
    "Proposition 1 (block-independent verification)": _proposition_1,
    "cache bytes = Eq. 3 / Eq. 10": _cache_bytes,
    "own-plane substitution = reference": _substitution_identity,
    "replay rerun bitwise identical": _bitwise_replay,
}


@torch.no_grad()
def run_selftests() -> list[SelfTest]:
    """Run every check on CPU, in one thread (a few seconds); returns one :class:`SelfTest` per check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model is tiny: more threads only add contention
    try:
        model = random_model()
        return [SelfTest(name, *check(model)) for name, check in CHECKS.items()]
    finally:
        torch.set_num_threads(threads)


def require_selftests() -> list[SelfTest]:
    """Run the self-tests; raise :class:`SelfTestFailure` naming the failed ones."""
    results = run_selftests()
    failed = [f"{t.name} ({t.detail})" for t in results if not t.passed]
    if failed:
        raise SelfTestFailure(f"self-tests failed on this node: {'; '.join(failed)}")
    return results


if __name__ == "__main__":
    for test in run_selftests():
        print(f"{'ok  ' if test.passed else 'FAIL'} {test.name}: {test.detail}")
