"""The depth workload (looped_kv.workloads.data.chain_programs): serial steps of known number, chance 0.1, no
shortcut."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from looped_kv.workloads import data


def evaluate(program: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Run a program's bindings: each variable's value, its depth (steps from its digit) and its chain (root)."""
    value, depth, chain = {}, {}, {}
    for binding in program.rstrip(";").split(";"):
        name, expr = binding.split("=")
        assert name not in value, f"{name} bound twice"
        if expr.isdigit():
            value[name], depth[name], chain[name] = int(expr), 1, name
        else:
            parent, step = re.fullmatch(r"([A-Za-z])\+([1-9])", expr).groups()
            assert parent in value, f"{parent} used before it is bound"
            value[name] = (value[parent] + int(step)) % 10
            depth[name], chain[name] = depth[parent] + 1, chain[parent]
    return value, depth, chain


@pytest.mark.parametrize("interleave", [False, True])
def test_every_answer_is_its_chain_computed_and_its_depth_the_steps(interleave):
    for p in data.chain_programs(300, "dev", max_chains=3, interleave=interleave):
        value, depth, chain = evaluate(p.program)
        assert 1 <= len(p.queries) <= 3 and len(value) <= data.CHAIN_BINDINGS
        roots = [chain[q.variable] for q in p.queries]
        assert len(set(roots)) == len(roots)  # one query per chain: no answer informs another
        assert len(set(chain.values())) == len(p.queries)  # and every chain is queried
        firsts = list(dict.fromkeys(chain[name] for name in value))
        assert roots == firsts  # in the order the chains start
        for q in p.queries:
            assert q.value == str(value[q.variable]) and q.depth == depth[q.variable]
            assert q.depth == max(d for name, d in depth.items() if chain[name] == chain[q.variable])  # its last
        assert p.text == f"{p.program}\n" + "".join(f"{q.variable}?{q.value};" for q in p.queries) + "\n"
        assert p.prompt == f"{p.program}\n" and set(p.program) <= set(data.CHAIN_NAMES + "0123456789=+;")


def test_depths_span_the_range_and_answers_are_uniform_over_ten_digits():
    queries = [q for p in data.chain_programs(2000, "eval", max_chains=3) for q in p.queries]
    depths = Counter(q.depth for q in queries)
    assert set(depths) == set(range(1, data.CHAIN_DEPTH + 1))
    assert min(depths.values()) >= 20  # every depth has items
    digits = Counter(q.value for q in queries)
    assert set(digits) == set("0123456789")
    assert max(abs(n / len(queries) - data.CHAIN_CHANCE) for n in digits.values()) < 0.02


def test_max_depth_caps_the_queries_and_distractors_lengthen_the_programs():
    programs = data.chain_programs(300, "train", max_depth=4, max_chains=3)
    assert max(q.depth for p in programs for q in p.queries) == 4
    lengths = [len(evaluate(p.program)[0]) for p in programs]
    assert max(lengths) > 4 * 2  # distractor chains make programs longer than the depth asked
    assert all(len(p.queries) == 1 for p in data.chain_programs(50, "train"))  # the workload: one chain each


def test_splits_and_seeds_differ_and_repeat():
    assert data.chain_programs(5, "dev") == data.chain_programs(5, "dev")
    texts = {split: {p.text for p in data.chain_programs(200, split)} for split in data.SPLITS}
    assert not texts["train"] & texts["dev"] and not texts["dev"] & texts["eval"]
    assert data.chain_programs(3, "train", seed=1) != data.chain_programs(3, "train", seed=2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"split": "test"}, "split must be one of"),
    ({"max_depth": 0}, r"max_depth must be in \[1, 32\]"),
    ({"max_depth": 33}, r"max_depth must be in \[1, 32\]"),
    ({"max_chains": 0}, r"max_chains must be in \[1, 4\]"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.chain_programs(2, **kwargs)


def test_multichain_prompts_are_the_decoding_workloads_programs():
    """``looped-kv bench --workloads multichain`` decodes the multichain programs' prompts; the chapters' three
    workloads are unchanged until a model answers it."""
    assert (*data.WORKLOADS, "multichain") == data.DECODING_WORKLOADS
    assert data.prompts("multichain", 3, "dev") == [p.prompt for p in data.multichain_programs(3, "dev")]
    with pytest.raises(ValueError, match="workload must be one of"):
        data.prompts("chain", 1)
