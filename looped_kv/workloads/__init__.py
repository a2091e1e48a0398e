"""The prompts and texts a chapter measures on, chosen by its run profile (``Profile.workloads``).

* ``"generated"`` (the tiny model, CI): the three workloads of :mod:`looped_kv.workloads.data`.
* ``"papers"`` (the real checkpoints): ``problems`` are GSM8K questions in the eight-shot chain-of-thought
  format of DAS Table 4 and RIPE Sec. 5 (:func:`~looped_kv.workloads.formats.gsm8k_prompts`), ``code`` are MBPP
  tasks as code completion (:func:`~looped_kv.workloads.formats.mbpp_prompts`), and ``chains`` stay generated: no
  public dataset asks for lookups of a set depth. A chapter's ``eval`` split is each dataset's test split;
  its ``dev`` split is GSM8K's training rows after the shots and MBPP's validation split.

Every prompt a chapter decodes goes through :func:`prompt_ids`, which holds it to the profile's
``prompt_tokens``, the length ``looped-kv plan`` charges (:mod:`looped_kv.analysis.plan`): a prompt longer than
the plan assumed stops the chapter with a one-line error before it decodes, instead of running out of memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from looped_kv.workloads import data, formats

if TYPE_CHECKING:
    from looped_kv.profiles import Profile
    from looped_kv.runtime.model import LoopedLM

SOURCES = {"generated": "generated workloads", "papers": "GSM8K and MBPP, chains generated"}
SPLITS = ("eval", "dev")
#: Where a chapter's split lies in each dataset: (the dataset's split, the first row).
DATASET_SPLITS = {"gsm8k": {"eval": ("test", 0), "dev": ("train", formats.SHOTS)},
                  "mbpp": {"eval": ("test", 0), "dev": ("validation", 0)}}
ROWS_PER_TEXT = 8  # dataset rows joined into one text for teacher-forced measurements, as data.texts does


def _check(workload: str, n: int, split: str, source: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"source (Profile.workloads) must be one of {tuple(SOURCES)}, got {source!r}")
    if workload not in data.WORKLOADS:
        raise ValueError(f"workload must be one of {data.WORKLOADS}, got {workload!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")


def _rows(name: str, split: str, n: int) -> list[dict]:
    dataset_split, start = DATASET_SPLITS[name][split]
    return formats.load_rows(name, dataset_split, n, start)


def prompts(workload: str, n: int, split: str = "eval", source: str = "generated", *,
            worked: bool = False) -> list[str]:
    """``n`` prompts of a workload. With ``worked``, each generated word problem opens with one worked problem
    of the dev split (a one-shot stand-in for GSM8K's eight shots, which the papers' prompts always carry)."""
    _check(workload, n, split, source)
    if source == "generated" or workload == "chains":
        if worked and workload == "problems":
            shots, questions = data.word_problems(n, split="dev"), data.word_problems(n, split=split, seed=1)
            return [s.text + q.prompt for s, q in zip(shots, questions, strict=True)]
        return data.prompts(workload, n, split)
    if workload == "problems":
        shots = formats.load_rows("gsm8k", "train", formats.SHOTS)
        return formats.gsm8k_prompts(_rows("gsm8k", split, n), shots)
    return formats.mbpp_prompts(_rows("mbpp", split, n))


def texts(workload: str, n: int, split: str = "eval", chars: int = 1200, source: str = "generated") -> list[str]:
    """``n`` whole texts for teacher-forced measurements, each cut to ``chars`` characters: under "papers",
    :data:`ROWS_PER_TEXT` solved GSM8K problems or MBPP tasks with their code, joined."""
    _check(workload, n, split, source)
    if source == "generated" or workload == "chains":
        return data.texts(workload, n, split, chars)
    name, solved = ("gsm8k", formats.gsm8k_worked) if workload == "problems" else ("mbpp", formats.mbpp_solved)
    rows = _rows(name, split, ROWS_PER_TEXT * n)
    groups = [rows[i:i + ROWS_PER_TEXT] for i in range(0, len(rows), ROWS_PER_TEXT)]
    return ["".join(solved(row) for row in group)[:chars] for group in groups]


def check_prompt_tokens(ids: list[Tensor], profile: Profile) -> None:
    """Each prompt (1, n) must fit the ``prompt_tokens`` the plan charges for ``profile``."""
    longest = max(t.shape[-1] for t in ids)
    if longest > profile.prompt_tokens:
        raise ValueError(f"a prompt of {longest} tokens exceeds prompt_tokens = {profile.prompt_tokens} of profile "
                         f"{profile.name!r}: raise it in looped_kv.profiles and check `looped-kv plan` again")


def encode(model: LoopedLM, profile: Profile, texts: list[str]) -> list[Tensor]:
    """Prompts as token ids, each (1, n_i) on the model's device, held to ``profile.prompt_tokens``."""
    ids = [model.tokenizer(text, return_tensors="pt").input_ids.to(model.device) for text in texts]
    check_prompt_tokens(ids, profile)
    return ids


def prompt_ids(model: LoopedLM, profile: Profile, workload: str, n: int, split: str = "eval", *,
               worked: bool = False) -> list[Tensor]:
    """The profile's prompts of a workload (:func:`prompts`) as token ids (:func:`encode`)."""
    return encode(model, profile, prompts(workload, n, split, profile.workloads, worked=worked))


def _prompt_counts(profile: Profile) -> dict[tuple[str, bool], int]:
    """The most prompts any chapter of ``profile`` decodes per (split, worked). A workload's first n prompts are
    the first n of any larger count, so these cover every chapter's prompts."""
    eval_counts = (profile.ch01.prompts_per_workload, profile.ch04.exact_prompts, profile.ch04.acceptance_prompts,
                   profile.ch05.agreement_prompts, profile.ch05.acceptance_prompts, profile.ch06.acceptance_prompts,
                   profile.ch07.prompts, profile.ch08.prompts_per_workload, profile.ch08.timing_prompts)
    return {("eval", False): max(eval_counts), ("eval", True): profile.ch04.replay_prompts,
            ("dev", False): profile.ch05.grid_prompts}


def preflight(model: LoopedLM, profile: Profile) -> str:
    """Tokenize every prompt the chapters of ``profile`` decode and hold each to ``profile.prompt_tokens``
    (:func:`check_prompt_tokens`), before a chapter starts its work; returns a one-line summary."""
    longest = 0
    for (split, worked), n in _prompt_counts(profile).items():
        for workload in data.WORKLOADS:
            ids = prompt_ids(model, profile, workload, n, split, worked=worked)
            longest = max(longest, *(t.shape[-1] for t in ids))
    return (f"workloads: {SOURCES[profile.workloads]}; the longest prompt has {longest} tokens of the "
            f"{profile.prompt_tokens} the plan charges")

