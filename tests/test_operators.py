"""The operators a one-token step dispatches, per cache (looped_kv.analysis.operators)."""

import pytest
import torch
from conftest import random_model

from looped_kv.analysis.operators import COPY, SLICE, step_operators
from looped_kv.decoding.settings import Greedy, SelfSpec


@pytest.fixture(scope="module")
def model():
    return random_model()


def prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n))


def other_operators(counts, base):
    """Every operator but the copies and the slices, the difference of two counts."""
    names = (set(counts.index) | set(base.index)) - {COPY, SLICE}
    return {name: counts.get(name, 0) - base.get(name, 0) for name in names
            if counts.get(name, 0) != base.get(name, 0)}


def test_ripe_adds_two_copies_per_loop_and_slices_its_reads_once_per_pass(model):
    """RIPE's step is the full cache's plus its ring's keys and values copied in front of the kept plane at every
    loop of every core layer (at the kept loop: the token into the last scratch slot), less the slicing of each
    loop's read: the full cache reads a plane of its own per loop, RIPE the same slots of a layer at every loop r < R
    (keys and values sliced twice per layer and pass: for the loops r < R and for the kept loop)."""
    R, n_core = model.config.mean_recurrence, model.config.n_core
    full = step_operators(model, prompt(40), Greedy())
    ripe = step_operators(model, prompt(40), Greedy(cache="ripe", window=8))
    assert ripe[COPY] - full[COPY] == n_core * 2 * R
    assert ripe[SLICE] - full[SLICE] == -2 * n_core * (R - 2)
    assert other_operators(ripe, full) == {}


def test_sinks_issue_ripes_operators_and_one_slice_of_their_hole_mask_per_pass(model):
    """The sinks cache copies as many times as RIPE: its sinks' slots sit beside its ring's in one store, in the
    scratch slots' order, so one copy of keys and one of values moves both at loops r < R (and the token's at the kept
    loop). Its hole mask (rows of one length) is a slice of a mask the cache made once: one operator per pass, the
    same at any number of loops; nothing else differs from RIPE's step."""
    n_core = model.config.n_core
    for num_loops in (3, 6):
        full = step_operators(model, prompt(40), Greedy(num_loops=num_loops))
        ripe = step_operators(model, prompt(40), Greedy(cache="ripe", window=8, num_loops=num_loops))
        sinks = step_operators(model, prompt(40), Greedy(cache="sinks", sinks=4, window=8, num_loops=num_loops))
        assert sinks[COPY] - full[COPY] == n_core * 2 * num_loops
        assert sinks[SLICE] - ripe[SLICE] == 1
        assert other_operators(sinks, ripe) == {}


def test_a_full_cache_step_issues_as_many_operators_at_any_context(model):
    """A step's operators do not grow with the prefix it reads: one fused read of the plane."""
    short = step_operators(model, prompt(20), Greedy())
    long = step_operators(model, prompt(90), Greedy())
    assert short.to_dict() == long.to_dict()
    assert short.sum() > 0


@pytest.mark.parametrize("config, steps, match", [
    (SelfSpec(), 4, "config must be a Greedy decoding"),
    (Greedy(compile=True), 4, "config: compile must be False"),
    (Greedy(), 0, "steps must be an int >= 1"),
    (Greedy(), 2.0, "steps must be an int >= 1"),
])
def test_bad_inputs_are_refused(model, config, steps, match):
    with pytest.raises(ValueError, match=match):
        step_operators(model, prompt(20), config, steps)
