"""The numeric gates the shipped tiny model must pass for its depth to matter, measured on held-out data.

Every chapter can only tell outcomes apart if the model's depth matters. The gates say it in numbers, on the
evaluation split of the decoding workload (multichain programs, ``looped_kv.workloads.data.multichain_programs``:
several value-changing chains, each queried once, the answers written densely), scored on answer tokens only,
and on its decoding:

* more loops answer better: the answer loss at R = 4 minus the answer loss at R = 32 is at least 0.10 nats, and
  answer accuracy at R = 32 is at least 0.15 above R = 4;
* the deepest queries are learned: accuracy at R = 32 on the deepest depth bucket is at least twice chance;
* more loops never hurt: the answer loss at R = 64 exceeds that at R = 32 by at most 0.01 nats;
* planes ripen slowly, as Huginn-0125's do (RIPE Table 7: rho 0.88 / 0.87): RIPE's rho, the geometric rate at which
  plane r approaches plane R (:func:`looped_kv.analysis.planes.ripening_rates`, on chapter 2's texts), lies in
  [0.75, 0.95] for keys and for values;
* shallow drafts are sometimes wrong: self-speculation with aligned reads, d = 4 and gamma = 4, reaches 40-90% of
  its ceiling tau = gamma + 1;
* depth matters to drafts: tau at d = 16 minus tau at d = 2 (gamma = 4, aligned reads) is at least one token;
* the continuation is dense in answers (at least 1/3 of its tokens) and needs depth: greedy decoding at R = 32
  gets at least twice as many answers right as at R = 4;
* decoding dominates: the prefill is at most 1/3 of compiled greedy decoding's time.

No gate asks for a paper's direction of an effect: whether Mature-V beats aligned reads, or DAS-Wave beats
Mature-Spec, is what the chapters measure.

    looped-kv gates            # measure, print, and record in looped_kv/tiny/config.json
"""

from __future__ import annotations

import json
import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from looped_kv.analysis.depth import DEPTH_BUCKETS, answer_hits, decoded_hits, encode_chains
from looped_kv.analysis.measure import row_tau
from looped_kv.analysis.planes import ripening_curves, ripening_rates, workload_batch
from looped_kv.analysis.verdicts import bca_interval
from looped_kv.decoding.generate import generate
from looped_kv.decoding.settings import Greedy
from looped_kv.experiments.bench import run_paired
from looped_kv.profiles import TINY
from looped_kv.prose import change
from looped_kv.runtime.loading import TINY_DIR, load
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads import data
from looped_kv.workloads.data import ChainProgram

COMMAND = "looped-kv gates"
DEEPEST = list(DEPTH_BUCKETS)[-1]
LOOPS = (4, 16, 32, 64)
#: Draft depths of the "depth matters to drafts" gate, and the drafts per verification of both draft gates.
SHALLOW_DRAFT, DEEP_DRAFT, GAMMA = 2, 16, 4


@dataclass(frozen=True)
class Gate:
    """A rule on one or more measured figures (every one must pass): ``op`` is ">=", "<=" or "in" (a closed band)."""

    name: str
    figures: tuple[str, ...]  # keys of the measured figures
    op: str
    bound: float | tuple[float, float]

    def passes(self, value: float) -> bool:
        if self.op == "in":
            lo, hi = self.bound
            return lo <= value <= hi
        return {">=": operator.ge, "<=": operator.le}[self.op](value, self.bound)

    def passed(self, figures: Mapping[str, float]) -> bool:
        return all(self.passes(figures[f]) for f in self.figures)

    def measured(self, figures: Mapping[str, float]) -> str:
        """The measured figures, three significant digits each."""
        return ", ".join(f"{figures[f]:.3g}" for f in self.figures)

    @property
    def rule(self) -> str:
        names = " and ".join(self.figures)
        if self.op == "in":
            return f"{names} in [{self.bound[0]}, {self.bound[1]}]"
        return f"{names} {self.op} {self.bound:.3g}"


GATES = (
    Gate("answer-token loss gain", ("answer loss R=4 - answer loss R=32",), ">=", 0.10),
    Gate("answer accuracy gain", ("accuracy R=32 - accuracy R=4",), ">=", 0.15),
    Gate("deepest bucket learned", (f"accuracy R=32 on depth {DEEPEST} / chance",), ">=", 2.0),
    Gate("more loops never hurt", ("answer loss R=64 - answer loss R=32",), "<=", 0.01),
    Gate("slow ripening", ("RIPE rho, keys", "RIPE rho, values"), "in", (0.75, 0.95)),
    Gate("drafts sometimes wrong", (f"self-spec tau / ceiling (d=4, gamma={GAMMA})",), "in", (0.40, 0.90)),
    Gate("depth matters to drafts", (f"tau d={DEEP_DRAFT} - tau d={SHALLOW_DRAFT} (gamma={GAMMA})",), ">=", 1.0),
    Gate("continuation dense in answers", ("answer share of decoded tokens",), ">=", 1 / 3),
    Gate("the continuation needs depth", ("greedy answers right, R=32 / R=4",), ">=", 2.0),
    Gate("decoding dominates", ("prefill share of compiled greedy",), "<=", 1 / 3),
)


def answer_figures(hits) -> dict[str, float]:
    """Answer loss and accuracy by R, and accuracy on the deepest bucket, from :func:`answer_hits`'s table."""
    by_r = hits.groupby("loops")
    loss, acc = by_r["nll"].mean(), by_r["hit"].mean()
    deepest = hits[hits["bucket"] == DEEPEST].groupby("loops")["hit"].mean()
    out = {f"answer loss R={R}": loss[R] for R in loss.index} | {f"accuracy R={R}": acc[R] for R in acc.index}
    out |= {"answer loss R=4 - answer loss R=32": loss[4] - loss[32],
            "answer loss R=64 - answer loss R=32": loss[64] - loss[32],
            "accuracy R=32 - accuracy R=4": acc[32] - acc[4],
            f"accuracy R=32 on depth {DEEPEST}": deepest[32],
            f"accuracy R=32 on depth {DEEPEST} / chance": deepest[32] / data.CHAIN_CHANCE,
            f"queries of depth {DEEPEST}": int((hits[hits["loops"] == 32]["bucket"] == DEEPEST).sum()),
            "queries": int((hits["loops"] == 32).sum())}
    return out


def continuation_figures(programs: Sequence[ChainProgram], continuations: Mapping[int, Sequence[str]],
                         new_tokens: Sequence[int]) -> dict[str, float]:
    """From greedy continuations of the programs at R = 4 and R = 32 (``continuations[R][i]``, text), the answers
    each gets right, and the answers' share of the decoded tokens at R = 32 (``new_tokens[i]``: tokens row i
    decoded, end-of-text included; an answer is one token)."""
    right = {R: sum(sum(decoded_hits(p, text)) for p, text in zip(programs, texts, strict=True))
             for R, texts in continuations.items()}
    answers = sum(len(p.queries) for p in programs)
    return {"greedy answers right, R=4": right[4], "greedy answers right, R=32": right[32],
            "greedy answers right, R=32 / R=4": right[32] / max(right[4], 1),
            "answer share of decoded tokens": answers / sum(new_tokens)}


def tau_gain(shallow: np.ndarray, deep: np.ndarray) -> tuple[float, float, float]:
    """Mean per-prompt tau(deep drafts) - tau(shallow drafts) with its BCa interval, prompts that verified in both."""
    diff = (np.asarray(deep, dtype=float) - np.asarray(shallow, dtype=float))
    diff = diff[np.isfinite(diff)]
    return bca_interval(diff[:, None], lambda x: x[..., 0].mean(-1))


def depth_story(record: dict) -> str:
    """How far the shipped model's depth pays, in figures from its recorded gates: chapter 1 says it first, since
    every later ceiling follows from it."""
    f = record["figures"]
    accuracy = ", ".join(f"{f[f'accuracy R={R}']:.0%} after {R}" for R in LOOPS)
    failed = [g.name for g in GATES if not record["passed"][g.name]]
    return (
        f"On {int(f['queries'])} queries of held-out multichain programs (the decoding workload's evaluation split), "
        f"the shipped model answers {accuracy} loops, against a chance of {data.CHAIN_CHANCE:.0%}. Its answer loss "
        f"{change(-f['answer loss R=4 - answer loss R=32'], unit='nats')} from 4 loops to 32 and "
        f"{change(f['answer loss R=64 - answer loss R=32'], digits=3)} from 32 to 64. On the deepest queries "
        f"(depth {DEEPEST}, "
        f"{int(f[f'queries of depth {DEEPEST}'])} of them) it answers {f[f'accuracy R=32 on depth {DEEPEST}']:.0%} "
        f"at R = 32. Decoding, greedy R = 32 gets {int(f['greedy answers right, R=32'])} answers right against "
        f"{int(f['greedy answers right, R=4'])} at R = 4; self-speculation with 4-loop drafts reaches "
        f"{f[f'self-spec tau / ceiling (d=4, gamma={GAMMA})']:.0%} of its ceiling, and {DEEP_DRAFT}-loop drafts commit "
        f"{f[f'tau d={DEEP_DRAFT} - tau d={SHALLOW_DRAFT} (gamma={GAMMA})']:+.2f} tokens per verification over "
        f"{SHALLOW_DRAFT}-loop ones. The model passes {len(GATES) - len(failed)} of the {len(GATES)} training gates"
        + (f" (not: {', '.join(failed)})." if failed else ".")
        + f" Measured by `{record['command']}`; the training page has the rest."
    )


@torch.no_grad()
def measure(model: LoopedLM, programs: int = 512, prompts: int = 32, timed: int = 16,
            progress: bool = True) -> dict[str, float]:
    """Every gate's figure on the evaluation split: ``programs`` multichain programs teacher-forced, ``prompts`` of
    them decoded, ``timed`` of those timed compiled in 2 interleaved rounds; RIPE's rho on chapter 2's texts."""
    if programs < 8 or not 1 <= timed <= prompts:
        raise ValueError(f"programs must be >= 8 and 1 <= timed <= prompts, got {programs}, {timed}, {prompts}")
    bar = tqdm(total=5, desc="gates", disable=not progress, leave=False)
    evaluation = data.multichain_programs(programs, "eval")
    figures = answer_figures(answer_hits(model, encode_chains(model.tokenizer, evaluation), LOOPS))
    bar.update()
    ch02 = TINY.ch02
    ids, _ = workload_batch(model, data.WORKLOADS, ch02.texts_per_workload, ch02.length)
    curves = ripening_curves(model, ids, model.config.mean_recurrence, decoded=ch02.decoded, maturity_kinds=())
    figures |= {f"RIPE rho, {name}": fit.rho for name, fit in zip(("keys", "values"), ripening_rates(curves).values(),
                                                                   strict=True)}
    bar.update()
    decoded = evaluation[:prompts]
    eos = model.tokenizer.eos_token_id
    ids = [model.tokenizer(p.prompt, return_tensors="pt").input_ids[0] for p in decoded]
    budget = max(len(model.tokenizer(p.answers + "\n")["input_ids"]) for p in decoded) + 4
    greedy = {R: generate(model, ids, max_new_tokens=budget, num_loops=R, eos_token_id=eos) for R in (4, 32)}
    texts = {R: [model.tokenizer.decode(row) for row in out.new_rows] for R, out in greedy.items()}
    figures |= continuation_figures(decoded, texts, [len(row) for row in greedy[32].new_rows])
    bar.update()
    tau = {d: row_tau(generate(model, ids, max_new_tokens=budget, method="self-spec", draft_loops=d, gamma=GAMMA,
                               eos_token_id=eos)) for d in (SHALLOW_DRAFT, 4, DEEP_DRAFT)}
    figures[f"self-spec tau / ceiling (d=4, gamma={GAMMA})"] = float(np.nanmean(tau[4])) / (GAMMA + 1)
    gain, low, high = tau_gain(tau[SHALLOW_DRAFT], tau[DEEP_DRAFT])
    figures |= {f"tau d={DEEP_DRAFT} - tau d={SHALLOW_DRAFT} (gamma={GAMMA})": gain,
                f"tau d={DEEP_DRAFT} - tau d={SHALLOW_DRAFT}, 95% low": low,
                f"tau d={DEEP_DRAFT} - tau d={SHALLOW_DRAFT}, 95% high": high}
    bar.update()
    timing = run_paired(model, [i[None] for i in ids[:timed]], {"ar": Greedy()}, budget, progress=False,
                        repeats=2, modes=("compiled",))
    figures["prefill share of compiled greedy"] = timing["greedy_prefill_time_s"].sum() / timing["greedy_time_s"].sum()
    bar.update()
    bar.close()
    return {name: float(value) for name, value in figures.items()}  # plain floats (pandas gives numpy ones)


def verdicts(figures: Mapping[str, float]) -> list[dict[str, object]]:
    """Each gate with its rule, the measured figures and whether it passes."""
    return [{"gate": g.name, "rule": g.rule, "measured": g.measured(figures), "passes": g.passed(figures)}
            for g in GATES]


def run(folder: str | Path = TINY_DIR, record: bool = True) -> None:
    """Measure the gates of the checkpoint in ``folder`` on one thread and print each verdict; with ``record``,
    write them into its config.json."""
    torch.set_num_threads(1)
    model = load(folder, dtype=torch.float32)
    if model.tokenizer is None:
        raise ValueError(f"model {str(folder)!r} has no tokenizer (tokenizer.json or tokenizer_config.json); the "
                         f"gates' prompts are text")
    start = time.perf_counter()
    figures = measure(model)
    rows = verdicts(figures)
    for row in rows:
        print(f"{'pass' if row['passes'] else 'FAIL'}  {row['gate']}: {row['rule']}; measured {row['measured']}")
    if record:
        path = Path(folder) / "config.json"
        config = json.loads(path.read_text())
        config["gates"] = {"command": COMMAND, "seconds": round(time.perf_counter() - start), "figures": figures,
                           "passed": {row["gate"]: row["passes"] for row in rows}}
        path.write_text(json.dumps(config, indent=2) + "\n")
