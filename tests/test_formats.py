"""GSM8K and MBPP prompt formatting and loading, offline, on generated rows in the datasets' schemas."""

from __future__ import annotations

import sys
import types

import pytest

from looped_kv.workloads import formats


def gsm8k_row(i: int) -> dict:
    a, b = 3 + i, 4 + 2 * i
    return {"question": f"Tom has {a} pens and buys {b} more. How many pens does he have?",
            "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} pens.\n#### {a + b:,}"}


def mbpp_row(i: int) -> dict:
    return {"task_id": 600 + i, "text": f"Write a function that adds {i} to a number.",
            "code": f"def add_{i}(x):\r\n    return x + {i}", "test_list": [f"assert add_{i}(1) == {1 + i}"],
            "test_setup_code": "", "challenge_test_list": []}


def test_gsm8k_answers_and_solutions():
    assert formats.gsm8k_answer("so 1,234 in all.\n#### 1,234") == "1234"
    solution = formats.gsm8k_solution(gsm8k_row(0)["answer"])
    assert solution == "He has 3 + 4 = 7 pens.\nThe answer is 7."
    with pytest.raises(ValueError, match="answer must end with '#### <number>'"):
        formats.gsm8k_answer("no final line")


def test_gsm8k_prompts_are_eight_shot_chain_of_thought():
    shots, rows = [gsm8k_row(i) for i in range(10)], [gsm8k_row(20), gsm8k_row(21)]
    prompts = formats.gsm8k_prompts(rows, shots)
    assert len(prompts) == 2 and all(p.count("Question: ") == formats.SHOTS + 1 for p in prompts)
    assert prompts[0].count("The answer is") == formats.SHOTS and "<<" not in prompts[0]
    assert prompts[1].endswith(f"Question: {rows[1]['question']}\nAnswer:")
    with pytest.raises(ValueError, match="n_shots must be between 0 and len"):
        formats.gsm8k_prompts(rows, shots[:3])
    with pytest.raises(ValueError, match="lacks field 'answer'"):
        formats.gsm8k_prompts([{"question": "?"}], shots)


def test_mbpp_prompts_are_code_completion():
    (prompt,) = formats.mbpp_prompts([mbpp_row(2)])
    assert prompt == '"""\nWrite a function that adds 2 to a number.\nassert add_2(1) == 3\n"""\ndef add_2(x):\n'
    with pytest.raises(ValueError, match="has no 'def' line"):
        formats.mbpp_prompts([{**mbpp_row(1), "code": "x = 1"}])


def test_load_rows_reads_the_hub_dataset(monkeypatch):
    calls = []

    def load_dataset(path, config, split):
        calls.append((path, config, split))
        return [gsm8k_row(i) for i in range(3)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert formats.load_rows("gsm8k", "test", 3) == [gsm8k_row(i) for i in range(3)]
    assert calls == [("openai/gsm8k", "main", "test[0:3]")]
    with pytest.raises(ValueError, match="name must be one of"):
        formats.load_rows("math", "test", 3)
    with pytest.raises(ValueError, match="n must be >= 1"):
        formats.load_rows("mbpp", "test", 0)
