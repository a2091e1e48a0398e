"""RIPE Figure 4c and Section 5.5 (looped_kv.analysis.ripe): the prompt of the tail, KL along it, and the two
computation shapes of greedy decoding."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import random_model

from looped_kv.analysis.ripe import decoder_agreement, kl_along, rerun_bitwise, tail_prompt
from looped_kv.runtime.policy import make_policy

torch.set_num_threads(1)


def records() -> pd.DataFrame:
    rows = []
    for prompt, kls in enumerate(([0.01, 0.2, 0.3], [0.5, 0.01, 0.02], [0.05, 0.06, 0.07])):
        for position, kl in enumerate(kls):
            rows += [{"prompt": prompt, "position": position, "arm": "deep", "kl": kl},
                     {"prompt": prompt, "position": position, "arm": "ripe", "kl": kl / 10}]
    return pd.DataFrame(rows)


def test_tail_prompt_holds_most_tail_positions_then_the_largest_kl():
    r = records()
    assert tail_prompt(r, "deep", 0.1) == 0  # two tail positions against one
    assert tail_prompt(r, "ripe", 0.1) == 1  # no tail: the largest KL (0.05)
    with pytest.raises(ValueError):
        tail_prompt(r, "missing")


def test_kl_along_one_prompt():
    frame = kl_along(records(), 0, ["ripe", "deep"])
    assert list(frame.columns) == ["ripe", "deep"] and list(frame.index) == [0, 1, 2]
    assert frame["deep"].tolist() == [0.01, 0.2, 0.3]
    with pytest.raises(ValueError):
        kl_along(records(), 0, ["fp32"])


def test_batched_and_sequential_decoders_agree_in_float64_and_reruns_are_bitwise():
    model = random_model("huginn")
    prompts = [torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (5, 8, 11)]
    shape = decoder_agreement(model, prompts, 10, draft_loops=2, gamma=3)
    assert shape.n_equal == 3 and (shape.first_difference == -1).all()
    tokens = torch.cat([prompts[0], torch.randint(0, model.config.vocab_size, (1, 6))], dim=1)
    assert rerun_bitwise(model, [tokens], [5], make_policy("full", model.config.mean_recurrence)) == 1.0
