"""Text every machine has: generated grade-school word problems and the Python standard library.

The word problems are the project's stand-in for GSM8K: a question, a worked solution
whose steps are arithmetic, and a final line ``#### <answer>``. The code workload is the
source of the interpreter's own standard library. Both are deterministic functions of a
seed (problems) or a file list (code), and both come with disjoint train / development /
evaluation splits, so that configurations are chosen on development prompts and reported
on evaluation prompts (DAS Appendix A.2).
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "dev", "eval")
WORKLOADS = ("problems", "code")
_SPLIT_SEED = {"train": 0, "dev": 1_000_000, "eval": 2_000_000}

_NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kira", "Leo",
          "Maya", "Noah", "Olive", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wren", "Zoe"]
_ITEMS = [("apple", "apples"), ("book", "books"), ("marble", "marbles"), ("pencil", "pencils"),
          ("cookie", "cookies"), ("sticker", "stickers"), ("shell", "shells"), ("card", "cards"),
          ("egg", "eggs"), ("flower", "flowers"), ("coin", "coins"), ("toy car", "toy cars")]
_CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"), ("crate", "crates"),
               ("pack", "packs")]


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str
    answer: int

    @property
    def text(self) -> str:
        return f"Question: {self.question}\nAnswer: {self.solution}\n#### {self.answer}\n"

    @property
    def prompt(self) -> str:
        return f"Question: {self.question}\nAnswer:"


def _problem(rng: random.Random) -> Problem:
    name, other = rng.sample(_NAMES, 2)
    item, items = rng.choice(_ITEMS)
    box, boxes = rng.choice(_CONTAINERS)
    kind = rng.randrange(6)
    a, b, c = rng.randint(2, 20), rng.randint(2, 9), rng.randint(2, 12)
    if kind == 0:
        total = a + b * c
        return Problem(f"{name} has {a} {items}. {name} buys {b} {boxes} of {items} with {c} {items} in each "
                       f"{box}. How many {items} does {name} have now?",
                       f"{name} buys {b} * {c} = {b * c} {items}. {name} now has {a} + {b * c} = {total} {items}.",
                       total)
    if kind == 1:
        start = a + b + c
        left = start - b - c
        return Problem(f"{name} had {start} {items}. {name} gave {b} {items} to {other} and lost {c} {items}. "
                       f"How many {items} does {name} have left?",
                       f"{name} gave away and lost {b} + {c} = {b + c} {items}. {name} has {start} - {b + c} = "
                       f"{left} {items} left.", left)
    if kind == 2:
        price, count = rng.randint(2, 15), rng.randint(2, 12)
        cost = price * count
        paid = cost + rng.randint(0, 20)
        return Problem(f"One {item} costs ${price}. {name} buys {count} {items} and pays with ${paid}. How much "
                       f"change does {name} get?",
                       f"{count} {items} cost {count} * {price} = ${cost}. The change is {paid} - {cost} = "
                       f"${paid - cost}.", paid - cost)
    if kind == 3:
        per_day, days = rng.randint(2, 12), rng.randint(2, 9)
        first = per_day * days
        total = first + a
        return Problem(f"{name} reads {per_day} pages every day for {days} days, then reads {a} more pages. "
                       f"How many pages does {name} read in total?",
                       f"In {days} days {name} reads {per_day} * {days} = {first} pages. In total {name} reads "
                       f"{first} + {a} = {total} pages.", total)
    if kind == 4:
        groups = rng.randint(2, 9)
        total = groups * c
        return Problem(f"{name} shares {total} {items} equally among {groups} friends. How many {items} does "
                       f"each friend get?",
                       f"Each friend gets {total} / {groups} = {c} {items}.", c)
    mine, theirs = a, a + b
    together = mine + theirs
    return Problem(f"{name} has {mine} {items}. {other} has {b} more {items} than {name}. How many {items} do "
                   f"they have together?",
                   f"{other} has {mine} + {b} = {theirs} {items}. Together they have {mine} + {theirs} = "
                   f"{together} {items}.", together)


def word_problems(n: int, split: str = "train", seed: int = 0) -> list[Problem]:
    """``n`` word problems of a split; the splits draw from disjoint seed ranges."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [_problem(random.Random(_SPLIT_SEED[split] + seed * 100_003 + i)) for i in range(n)]


def stdlib_files() -> list[Path]:
    """Top-level ``.py`` files of the running interpreter's standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def code_split(path: Path) -> str:
    """Split of a standard-library file, from a hash of its name (about 80/10/10)."""
    bucket = int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % 10
    return "dev" if bucket == 0 else "eval" if bucket == 1 else "train"


def code_files(split: str = "train") -> list[Path]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [p for p in stdlib_files() if code_split(p) == split]


def code_prompts(n: int, split: str = "eval", lines: int = 6) -> list[str]:
    """The first ``lines`` lines of ``n`` function definitions from a split's files (the model continues them)."""
    prompts: list[str] = []
    for path in code_files(split):
        source = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(source):
            if line.startswith("def ") and i + lines < len(source):
                prompts.append("\n".join(source[i:i + lines]) + "\n")
                if len(prompts) == n:
                    return prompts
    return prompts


def prompts(workload: str, n: int, split: str = "eval") -> list[str]:
    """Prompts of a workload: word-problem questions (``"problems"``) or code openings (``"code"``)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if workload == "problems":
        return [p.prompt for p in word_problems(n, split)]
    return code_prompts(n, split)


def texts(workload: str, n: int, split: str = "eval", chars: int = 1200) -> list[str]:
    """Whole texts for teacher-forced measurements: worked problems (several per text) or code excerpts."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if workload == "problems":
        problems = word_problems(8 * n, split)
        return ["".join(p.text for p in problems[8 * i:8 * i + 8])[:chars] for i in range(n)]
    out = []
    for path in code_files(split):
        source = path.read_text(encoding="utf-8", errors="replace")
        for start in range(0, max(len(source) - chars, 1), 4 * chars):
            out.append(source[start:start + chars])
            if len(out) == n:
                return out
    return out
