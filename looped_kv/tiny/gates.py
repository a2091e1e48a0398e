"""The numeric gates the shipped tiny model must pass for its depth to matter, measured on held-out data.

Every chapter can only tell outcomes apart if the model's depth matters. The gates say it in
numbers, on the evaluation split of the depth workload (value-changing chains,
``looped_kv.workloads.data.chain_programs``), scored on answer tokens only:

* more loops answer better: the answer loss at R = 4 minus the answer loss at R = 32 is at least
  0.10 nats, and answer accuracy at R = 32 is at least 0.15 above R = 4;
* the deepest queries are learned: accuracy at R = 32 on the deepest depth bucket is at least
  twice chance;
* more loops never hurt: the answer loss at R = 64 exceeds that at R = 32 by at most 0.01 nats;
* the state settles slowly, as Huginn-0125's planes do (RIPE Table 7: rho 0.88): rho fitted to the
  median per-position ||s(r) - s(r-1)|| / ||s(r)|| over loops 4-16 lies in [0.75, 0.95];
* shallow drafts are neither always right nor useless: on the chain prompts, self-speculation with
  d = 4, gamma = 4 accepts between 40% and 90% of drafted tokens, and DAS-Wave's accepted length A
  is at most 80% of its ceiling w.

    looped-kv gates            # measure, print, and record in looped_kv/tiny/config.json
"""

from __future__ import annotations

import json
import operator
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from looped_kv.analysis.depth import DEPTH_BUCKETS, answer_hits, encode_chains, fit_state_rho, state_changes
from looped_kv.decoding.das_wave import proposal_width
from looped_kv.decoding.generate import generate
from looped_kv.decoding.settings import DasWave
from looped_kv.runtime.loading import TINY_DIR, load
from looped_kv.runtime.model import LoopedLM
from looped_kv.workloads import data

COMMAND = "looped-kv gates"
DEEPEST = list(DEPTH_BUCKETS)[-1]
LOOPS = (4, 16, 32, 64)


@dataclass(frozen=True)
class Gate:
    name: str
    figure: str  # key of the measured figure
    op: str  # ">=" or "<=" or "in"
    bound: float | tuple[float, float]

    def passes(self, value: float) -> bool:
        if self.op == "in":
            lo, hi = self.bound
            return lo <= value <= hi
        return {">=": operator.ge, "<=": operator.le}[self.op](value, self.bound)

    @property
    def rule(self) -> str:
        if self.op == "in":
            return f"{self.figure} in [{self.bound[0]}, {self.bound[1]}]"
        return f"{self.figure} {self.op} {self.bound}"


GATES = (
    Gate("answer-token loss gain", "answer loss R=4 - answer loss R=32", ">=", 0.10),
    Gate("answer accuracy gain", "accuracy R=32 - accuracy R=4", ">=", 0.15),
    Gate("deepest bucket learned", f"accuracy R=32 on depth {DEEPEST} / chance", ">=", 2.0),
    Gate("more loops never hurt", "answer loss R=64 - answer loss R=32", "<=", 0.01),
    Gate("slow ripening", "rho (loops 4-16)", "in", (0.75, 0.95)),
    Gate("drafts sometimes wrong", "self-spec acceptance (d=4, gamma=4)", "in", (0.40, 0.90)),
    Gate("DAS-Wave unsaturated", "DAS-Wave A / ceiling", "<=", 0.80),
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


def depth_story(record: dict) -> str:
    """How far the shipped model's depth pays, in figures from its recorded gates: chapter 1 says it first, since
    every later ceiling follows from it."""
    f = record["figures"]
    accuracy = ", ".join(f"{f[f'accuracy R={R}']:.0%} after {R}" for R in LOOPS)
    failed = [g.name for g in GATES if not record["passed"][g.name]]
    return (
        f"On {int(f['queries'])} queries of held-out chain programs (the depth workload's evaluation split), the "
        f"shipped model answers {accuracy} loops, against a chance of {data.CHAIN_CHANCE:.0%}. Its answer loss "
        f"falls by {f['answer loss R=4 - answer loss R=32']:.2f} nats from 4 loops to 32 and changes by "
        f"{f['answer loss R=64 - answer loss R=32']:+.3f} from 32 to 64. On the deepest queries (depth {DEEPEST}, "
        f"{int(f[f'queries of depth {DEEPEST}'])} of them) it answers {f[f'accuracy R=32 on depth {DEEPEST}']:.0%} "
        f"at R = 32. Self-speculation with 4-loop drafts accepts "
        f"{f['self-spec acceptance (d=4, gamma=4)']:.0%} of its drafts on chain prompts, and DAS-Wave's accepted "
        f"length is {f['DAS-Wave A / ceiling']:.0%} of its ceiling. The model passes {len(GATES) - len(failed)} of "
        f"the {len(GATES)} training gates" + (f" (not: {', '.join(failed)})." if failed else ".")
        + f" Measured by `{record['command']}`; the training page has the rest."
    )


@torch.no_grad()
def measure(model: LoopedLM, programs: int = 256, prompts: int = 32, progress: bool = True) -> dict[str, float]:
    """Every gate's figure on the evaluation split (``programs`` chain programs, ``prompts`` decoding prompts)."""
    if programs < 8 or prompts < 1:
        raise ValueError(f"programs must be >= 8 and prompts >= 1, got {programs} and {prompts}")
    bar = tqdm(total=4, desc="gates", disable=not progress, leave=False)
    chains = encode_chains(model.tokenizer, data.chain_programs(programs, "eval"))
    figures = answer_figures(answer_hits(model, chains, LOOPS))
    bar.update()
    figures["rho (loops 4-16)"] = fit_state_rho(state_changes(model, chains.ids, 16, chains.real)).rho
    bar.update()
    eos = model.tokenizer.eos_token_id
    ids = [model.tokenizer(p, return_tensors="pt").input_ids[0] for p in data.prompts("chains", prompts, "eval")]
    spec = generate(model, ids, max_new_tokens=48, method="self-spec", draft_loops=4, gamma=4, eos_token_id=eos)
    figures["self-spec acceptance (d=4, gamma=4)"] = sum(spec.accepted) / sum(spec.drafted)
    bar.update()
    wave = generate(model, ids, max_new_tokens=48, method="das-wave", eos_token_id=eos)
    ceiling = proposal_width(DasWave.gamma, DasWave.rounds, DasWave.initial_width)
    figures["DAS-Wave A / ceiling"] = wave.mean_accepted / ceiling
    bar.update()
    bar.close()
    return {name: float(value) for name, value in figures.items()}  # plain floats (pandas gives numpy ones)


def verdicts(figures: dict[str, float]) -> list[dict[str, object]]:
    """Each gate with its rule, the measured figure and whether it passes."""
    return [{"gate": g.name, "rule": g.rule, "measured": figures[g.figure], "passes": g.passes(figures[g.figure])}
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
        print(f"{'pass' if row['passes'] else 'FAIL'}  {row['gate']}: {row['rule']}; measured {row['measured']:.4f}")
    if record:
        path = Path(folder) / "config.json"
        config = json.loads(path.read_text())
        config["gates"] = {"command": COMMAND, "seconds": round(time.perf_counter() - start), "figures": figures,
                           "passed": {row["gate"]: row["passes"] for row in rows}}
        path.write_text(json.dumps(config, indent=2) + "\n")
