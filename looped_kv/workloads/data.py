"""Text every machine has: word problems, the Python standard library, and variable chains.

Three workloads, each with disjoint train / development / evaluation splits, so that
configurations are chosen on development prompts and reported on evaluation prompts
(DAS Appendix A.2):

* ``problems``: the stand-in for GSM8K: a question, a worked solution whose steps are
  arithmetic, and a final line ``#### <answer>``;
* ``code``: the source of the interpreter's own standard library;
* ``chains``: the depth workload. A program binds single-letter variables to digits or to
  other variables (``k=4;b=k;x=9;m=b;``), then asks for the value of variables (``m?4;``)
  with no intermediate steps. Answering a variable d bindings away from its digit takes d
  serial lookups, so a looped model needs more loops for deeper variables: this is the
  workload on which depth pays.

Chains are built to leave no shortcut. Each program is a forest of binding trees whose root
digits differ, written in a random interleaving of the trees (a variable is bound before it
is used), so the nearest digit is not the answer. The queries are the leaves of the forest,
in random order: no queried variable lies on another's path, so an answer already given never
shortens a later lookup, and every query needs its full depth. Programs of depth 1 (the first
stage of the training curriculum) are one lookup per query instead: every variable is bound to a
digit and every variable is asked.
"""

from __future__ import annotations

import hashlib
import math
import random
import string
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "dev", "eval")
WORKLOADS = ("problems", "code", "chains")
#: What the decoders can be benched on: the chapters' workloads and ``multichain`` (:func:`multichain_programs`), the
#: workload dense in answers that need depth, which becomes the chapters' decoding workload once a model answers it.
DECODING_WORKLOADS = (*WORKLOADS, "multichain")
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


@dataclass(frozen=True)
class ChainQuery:
    variable: str
    value: str
    depth: int  # serial steps from the variable to its chain's digit (1: bound to a digit)


@dataclass(frozen=True)
class ChainProgram:
    """A program of variable bindings and its queries: ``text`` is what the model reads and writes.

    ``dense``: the query line writes each query as its variable and its digit (``x7y3``: half the continuation's
    tokens are answers) instead of ``x?7;``. ``positional``: it writes the answers alone, in the queries' order
    (``7;3;``), so a query is known by its place on the line, not by a name."""

    program: str
    queries: tuple[ChainQuery, ...]
    dense: bool = False
    positional: bool = False

    def cue(self, query: ChainQuery) -> str:
        """The text before a query's answer: the position that predicts the answer is its last token (with
        ``positional``, the token before: the newline or the previous answer's separator)."""
        if self.positional:
            return ""
        return query.variable if self.dense else f"{query.variable}?"

    def answer(self, query: ChainQuery) -> str:
        """A query's answer digit, with the separator that follows it."""
        return query.value if self.dense and not self.positional else f"{query.value};"

    @property
    def answers(self) -> str:
        return "".join(self.cue(q) + self.answer(q) for q in self.queries)

    @property
    def text(self) -> str:
        return f"{self.program}\n{self.answers}\n"

    @property
    def prompt(self) -> str:
        return f"{self.program}\n"


CHAIN_DEPTH = 32  # deepest query of the evaluation programs (and of training, at the end of the curriculum)
CHAIN_NAMES = string.ascii_lowercase + string.ascii_uppercase  # one token each, in characters and in BPE
CHAIN_BINDINGS = 40  # most variables one program binds
CHAIN_CHANCE = 0.1  # an answer is uniform over the ten digits given everything but its full chain
CHAIN_COUNT = 1  # chains per program in the workload: the shipped model learned one (three stayed at chance)


def _chain_program(rng: random.Random, max_depth: int, max_chains: int, interleave: bool) -> ChainProgram:
    """One program: 1..max_chains value-changing chains, each queried at its last variable, in chain order.

    A chain starts at a digit and every later variable adds a digit to the one before, mod 10
    (``a=3;b=a+4;c=b+1;``). A chain's length (uniform in 1..max_depth) is its query's depth: the
    number of serial steps its value needs. Which variable is asked, and in which order, follows
    from the program, so everything after the program is determined by it and only the answers
    need depth.
    """
    names = iter(rng.sample(CHAIN_NAMES, len(CHAIN_NAMES)))
    budget = CHAIN_BINDINGS
    chains: list[list[tuple[str, str, int]]] = []  # per chain: (variable, its binding, its value)
    for _ in range(rng.randint(1, max_chains)):
        depth = rng.randint(1, max_depth)
        if depth > budget:
            break
        budget -= depth
        value = rng.randrange(10)
        chain = [(next(names), str(value), value)]
        for _ in range(depth - 1):
            step = rng.randint(1, 9)
            value = (value + step) % 10
            chain.append((next(names), f"{chain[-1][0]}+{step}", value))
        chains.append(chain)
    order = [c for c, chain in enumerate(chains) for _ in chain]
    if interleave:  # a random interleaving that keeps each chain's order
        rng.shuffle(order)
        written = [0] * len(chains)
        lines = []
        for c in order:
            variable, binding, _ = chains[c][written[c]]
            written[c] += 1
            lines.append(f"{variable}={binding};")
    else:
        lines = [f"{variable}={binding};" for chain in chains for variable, binding, _ in chain]
    queries = tuple(ChainQuery(chains[c][-1][0], str(chains[c][-1][2]), len(chains[c])) for c in dict.fromkeys(order))
    return ChainProgram("".join(lines), queries)


#: Most variables a multichain program binds: its bindings (6 tokens each), query line and end-of-text fit the
#: training rows of 257 tokens.
MULTICHAIN_BINDINGS = 36


#: Most variables a multichain program binds when every one is asked (:func:`multichain_programs` with ``ask_all``):
#: its bindings, a query line twice as long and end-of-text fit the training rows of 257 tokens.
ASK_ALL_BINDINGS = 28


def _binding(variable: str, expression: str, value_first: bool) -> str:
    """One binding: ``b=a+4;``, or with ``value_first`` ``a+4=b;`` (the name after what it is bound to)."""
    return f"{expression}={variable};" if value_first else f"{variable}={expression};"


def _multichain_program(rng: random.Random, max_depth: int, ask_all: bool = False,
                        value_first: bool = False, positional: bool = False, max_chains: int | None = None,
                        last_first: bool = False) -> ChainProgram:
    """One program of several contiguous value-changing chains, each queried once at its last variable.

    Chain lengths (the queries' depths) are drawn log-uniformly in 1..max_depth, P(d) proportional to
    ln((d + 1) / d), until the next one would exceed :data:`MULTICHAIN_BINDINGS`: the many shallow chains make the
    continuation dense in answers, and every depth up to max_depth still occurs (at max_depth 32, about 4% of the
    queries are 25-32 deep). Chains share no variable and one query per chain asks its last variable, so no answer
    informs another (knowing two variables of one chain would).

    ``ask_all`` (a training layout) asks every variable instead, in a random order, of at most
    :data:`ASK_ALL_BINDINGS` (so chains of at most as many): each binding's value is then an answer, its depth its
    place in its chain. ``value_first`` writes each binding after its expression (``3=a;a+4=b;``), so a name's
    position in the program is where its value can be known. ``positional`` writes each chain's answer alone, in
    the chains' order (``7;3;``): the answer line names no variable. ``max_chains`` ends the program after that
    many chains; ``last_first`` asks the chains from the last to the first (the last chain's query is a one-chain
    program's).
    """
    if ask_all and positional:
        raise ValueError("ask_all and positional cannot both be set: asking every variable needs their names")
    names = iter(rng.sample(CHAIN_NAMES, len(CHAIN_NAMES)))
    budget, lines, queries = ASK_ALL_BINDINGS if ask_all else MULTICHAIN_BINDINGS, [], []
    max_depth = min(max_depth, budget)  # a first chain always fits
    chains = 0
    while max_chains is None or chains < max_chains:
        depth = min(max_depth, int(math.exp(rng.random() * math.log(max_depth + 1))))
        if depth > budget:
            break
        chains += 1
        budget -= depth
        value = rng.randrange(10)
        variable = next(names)
        lines.append(_binding(variable, str(value), value_first))
        chain = [ChainQuery(variable, str(value), 1)]
        for _ in range(depth - 1):
            step = rng.randint(1, 9)
            value = (value + step) % 10
            previous, variable = variable, next(names)
            lines.append(_binding(variable, f"{previous}+{step}", value_first))
            chain.append(ChainQuery(variable, str(value), len(chain) + 1))
        queries += chain if ask_all else chain[-1:]
    if ask_all:
        rng.shuffle(queries)
    if last_first:
        queries.reverse()
    return ChainProgram("".join(lines), tuple(queries), dense=True, positional=positional)


def multichain_programs(n: int, split: str = "train", seed: int = 0, max_depth: int = CHAIN_DEPTH,
                        ask_all: bool = False, value_first: bool = False,
                        positional: bool = False, max_chains: int | None = None,
                        last_first: bool = False) -> list[ChainProgram]:
    """``n`` multichain programs of a split (:func:`_multichain_program`): the decoding workload dense in answers
    that need depth, each answer a digit (chance :data:`CHAIN_CHANCE`) after its variable (``x7y3``); with
    ``ask_all``, the training layout that asks every variable; with ``value_first``, bindings written ``a+4=b;``;
    with ``positional``, the chains' answers alone in the chains' order (``7;3;``); with ``max_chains``, at most
    that many chains; with ``last_first``, the chains asked from the last."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 1 <= max_depth <= CHAIN_DEPTH:
        raise ValueError(f"max_depth must be in [1, {CHAIN_DEPTH}], got {max_depth}")
    if max_chains is not None and max_chains < 1:
        raise ValueError(f"max_chains must be None or >= 1, got {max_chains}")
    return [_multichain_program(random.Random(f"multichain/{split}/{seed}/{i}"), max_depth, ask_all, value_first,
                                positional, max_chains, last_first) for i in range(n)]


def _lookup_program(rng: random.Random, sizes: tuple[int, int], value_first: bool = False) -> ChainProgram:
    """Lookup drills for training: ``sizes`` (least, most) names bound to digits (``a=3;b=7;``), every one asked
    once in a random order on a dense query line. An answer is one lookup by name (depth 1), and the order leaves no
    positional shortcut: the skill several chains need and one chain never taught."""
    names = rng.sample(CHAIN_NAMES, rng.randint(*sizes))
    values = {name: rng.randrange(10) for name in names}
    asked = rng.sample(names, len(names))
    return ChainProgram("".join(_binding(name, str(values[name]), value_first) for name in names),
                        tuple(ChainQuery(name, str(values[name]), 1) for name in asked), dense=True)


#: The names a lookup drill binds unless told: the multichain programs' range of variables.
LOOKUP_SIZES = (8, MULTICHAIN_BINDINGS)


def lookup_programs(n: int, split: str = "train", seed: int = 0, sizes: tuple[int, int] = LOOKUP_SIZES,
                    value_first: bool = False) -> list[ChainProgram]:
    """``n`` lookup drills of a split (:func:`_lookup_program`) binding ``sizes`` (least, most) names each, a
    training layout of the tiny model; ``value_first`` writes ``3=a;``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 1 <= sizes[0] <= sizes[1] <= MULTICHAIN_BINDINGS:
        raise ValueError(f"sizes must satisfy 1 <= least <= most <= {MULTICHAIN_BINDINGS}, got {sizes}")
    return [_lookup_program(random.Random(f"lookup/{split}/{seed}/{i}"), sizes, value_first) for i in range(n)]


def chain_programs(n: int, split: str = "train", seed: int = 0, max_depth: int = CHAIN_DEPTH,
                   max_chains: int = CHAIN_COUNT, interleave: bool = False) -> list[ChainProgram]:
    """``n`` value-changing chain programs of a split, queries up to ``max_depth`` steps deep.

    Each program holds up to ``max_chains`` chains (the others are distractors to each query), each
    chain is queried once, and answers never inform one another: chains share no variable. An answer
    needs its full chain, so chance is :data:`CHAIN_CHANCE` at every depth.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 1 <= max_depth <= CHAIN_DEPTH:
        raise ValueError(f"max_depth must be in [1, {CHAIN_DEPTH}], got {max_depth}")
    if not 1 <= max_chains <= 4:
        raise ValueError(f"max_chains must be in [1, 4], got {max_chains}")
    return [_chain_program(random.Random(f"chains/{split}/{seed}/{i}"), max_depth, max_chains, interleave)
            for i in range(n)]


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
    """Prompts of a workload (:data:`DECODING_WORKLOADS`): word-problem questions, code openings, or chain or
    multichain programs to answer."""
    if workload not in DECODING_WORKLOADS:
        raise ValueError(f"workload must be one of {DECODING_WORKLOADS}, got {workload!r}")
    if workload == "problems":
        return [p.prompt for p in word_problems(n, split)]
    if workload == "chains":
        return [p.prompt for p in chain_programs(n, split)]
    if workload == "multichain":
        return [p.prompt for p in multichain_programs(n, split)]
    return code_prompts(n, split)


def texts(workload: str, n: int, split: str = "eval", chars: int = 1200) -> list[str]:
    """Whole texts for teacher-forced measurements: worked problems or chain programs (several per text, cut
    to ``chars`` characters), or code excerpts."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if workload in ("problems", "chains"):
        items = word_problems(8 * n, split) if workload == "problems" else chain_programs(16 * n, split)
        per = len(items) // n
        return ["".join(p.text for p in items[per * i:per * i + per])[:chars] for i in range(n)]
    out = []
    for path in code_files(split):
        source = path.read_text(encoding="utf-8", errors="replace")
        for start in range(0, max(len(source) - chars, 1), 4 * chars):
            out.append(source[start:start + chars])
            if len(out) == n:
                return out
    return out
