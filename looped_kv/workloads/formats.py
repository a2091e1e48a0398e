"""The papers' workloads for the real checkpoints: GSM8K and MBPP prompts in the DAS paper's conventions.

DAS Table 4: GSM8K is prompted with eight-shot chain of thought, MBPP as code completion. The rows
come from the hub through ``datasets`` (``openai/gsm8k``, config ``main``; ``google-research-datasets/mbpp``,
config ``full``) on a machine with a network; the formatting functions take rows in those datasets'
schemas, so they run (and are tested) offline on generated rows. On the tiny model the chapters keep the
generated workloads of :mod:`looped_kv.workloads.data`.

    rows = load_rows("gsm8k", "test", 32)
    prompts = gsm8k_prompts(rows, load_rows("gsm8k", "train", 8))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

DATASETS = {"gsm8k": ("openai/gsm8k", "main"), "mbpp": ("google-research-datasets/mbpp", "full")}
FIELDS = {"gsm8k": ("question", "answer"), "mbpp": ("task_id", "text", "code", "test_list")}
SHOTS = 8  # DAS Table 4: eight-shot chain of thought on GSM8K
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def check_rows(name: str, rows: Sequence[Mapping]) -> None:
    """Rows must carry the dataset's fields; a one-line error names the first missing one."""
    if name not in FIELDS:
        raise ValueError(f"name must be one of {tuple(FIELDS)}, got {name!r}")
    for i, row in enumerate(rows):
        missing = [f for f in FIELDS[name] if f not in row]
        if missing:
            raise ValueError(f"rows[{i}] of {name} lacks field {missing[0]!r} (a {name} row has {FIELDS[name]})")


def gsm8k_answer(answer: str) -> str:
    """The final number of a GSM8K answer (the text after ``####``), commas removed."""
    match = _FINAL.search(answer.strip())
    if match is None:
        raise ValueError(f"answer must end with '#### <number>', got ...{answer.strip()[-40:]!r}")
    return match.group(1).replace(",", "")


def gsm8k_solution(answer: str) -> str:
    """A GSM8K answer as a chain of thought: the worked steps, then 'The answer is N.'"""
    steps = _FINAL.sub("", answer.strip()).strip()
    steps = re.sub(r"<<[^>]*>>", "", steps)  # the calculator annotations of the dataset
    return f"{steps}\nThe answer is {gsm8k_answer(answer)}."


def gsm8k_worked(row: Mapping) -> str:
    """One solved problem as a shot: the question, then its chain of thought."""
    return f"Question: {row['question']}\nAnswer: {gsm8k_solution(row['answer'])}\n\n"


def gsm8k_prompts(rows: Sequence[Mapping], shots: Sequence[Mapping], n_shots: int = SHOTS) -> list[str]:
    """Eight-shot chain-of-thought prompts: ``n_shots`` solved training rows, then each question."""
    check_rows("gsm8k", rows)
    check_rows("gsm8k", shots)
    if not 0 <= n_shots <= len(shots):
        raise ValueError(f"n_shots must be between 0 and len(shots) = {len(shots)}, got {n_shots}")
    context = "".join(gsm8k_worked(s) for s in shots[:n_shots])
    return [f"{context}Question: {row['question']}\nAnswer:" for row in rows]


def _mbpp_task(row: Mapping) -> str:
    return f'"""\n{row["text"].strip()}\n{row["test_list"][0]}\n"""\n'


def mbpp_prompts(rows: Sequence[Mapping]) -> list[str]:
    """Code-completion prompts: the task and its first test as a docstring, then the function's signature."""
    check_rows("mbpp", rows)
    out = []
    for row in rows:
        signature = next((line for line in row["code"].splitlines() if line.lstrip().startswith("def ")), None)
        if signature is None:
            raise ValueError(f"MBPP task {row['task_id']}: its code has no 'def' line")
        out.append(f"{_mbpp_task(row)}{signature.strip()}\n")
    return out


def mbpp_solved(row: Mapping) -> str:
    """One task with its reference code: the prompt's docstring, then the whole solution."""
    code = "\n".join(line.rstrip() for line in row["code"].splitlines())
    return f"{_mbpp_task(row)}{code}\n\n"


def load_rows(name: str, split: str, n: int, start: int = 0) -> list[dict]:
    """Rows ``start`` to ``start + n`` of a split from the hub (needs ``datasets`` and a network)."""
    if name not in DATASETS:
        raise ValueError(f"name must be one of {tuple(DATASETS)}, got {name!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    try:
        import datasets
    except ImportError as error:
        raise ImportError("loading GSM8K or MBPP needs the 'datasets' package: pip install datasets") from error
    path, config = DATASETS[name]
    rows = [dict(row) for row in datasets.load_dataset(path, config, split=f"{split}[{start}:{start + n}]")]
    check_rows(name, rows)
    return rows
