"""The tiny model's training data and schedule (looped_kv.tiny.train) for the multichain continuation (issue 39)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from looped_kv.cli import train_options
from looped_kv.runtime.loading import TINY_DIR
from looped_kv.tiny import train
from looped_kv.workloads import data


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(TINY_DIR))


def _values(program: data.ChainProgram) -> dict[str, int]:
    values: dict[str, int] = {}
    for binding in program.program.rstrip(";").split(";"):
        name, expr = binding.split("=")
        values[name] = int(expr) if expr.isdigit() else (values[expr.split("+")[0]] + int(expr.split("+")[1])) % 10
    return values


def test_multichain_programs_ask_each_chain_once_with_dense_answers():
    programs = data.multichain_programs(200, "dev")
    depths = [q.depth for p in programs for q in p.queries]
    assert min(depths) == 1 and max(depths) == data.CHAIN_DEPTH
    for p in programs:
        values = _values(p)
        names = [b.split("=")[0] for b in p.program.rstrip(";").split(";")]
        assert len(names) == len(set(names)) <= data.MULTICHAIN_BINDINGS and p.dense
        assert sum(q.depth for q in p.queries) == len(names)  # the chains cover the program, one query each
        assert all(values[q.variable] == int(q.value) for q in p.queries)
        assert p.text == f"{p.program}\n" + "".join(q.variable + q.value for q in p.queries) + "\n"
    assert all(q.depth <= 6 for p in data.multichain_programs(50, "train", max_depth=6) for q in p.queries)
    with pytest.raises(ValueError, match="max_depth must be in"):
        data.multichain_programs(1, max_depth=0)


def test_positional_multichain_programs_answer_each_chain_in_order_without_names():
    """The multi-positional layout: the same programs, each chain's answer alone on the query line in chain order
    (7;3;), so a query is found by its place; its answers are located after the newline or the previous separator."""
    from looped_kv.analysis.depth import encode_chains

    named = data.multichain_programs(20, "dev", max_depth=8)
    positional = data.multichain_programs(20, "dev", max_depth=8, positional=True)
    for a, b in zip(named, positional, strict=True):
        assert (a.program, a.queries) == (b.program, b.queries) and b.positional
        assert b.text == f"{b.program}\n" + "".join(f"{q.value};" for q in b.queries) + "\n"
    assert train.programs_of({"layout": "multi-positional", "value_first": False}, 20, "dev", max_depth=8) == positional
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TINY_DIR)
    batch = encode_chains(tokenizer, positional[:3])
    assert [tokenizer.decode([int(t)]) for t in batch.answers] == [q.value for p in positional[:3] for q in p.queries]
    cues = [tokenizer.decode([int(batch.ids[r, i])]) for r, i in zip(batch.rows, batch.positions, strict=True)]
    assert set(cues) == {"\n", ";"}
    with pytest.raises(ValueError, match="ask_all and positional cannot both be set"):
        data.multichain_programs(1, ask_all=True, positional=True)


def test_the_chain_count_curriculum_asks_at_most_its_cap_of_chains_from_the_last():
    """The multi-count layout: positional answers from the last chain to the first, at most the curriculum's cap of
    chains, so that at a cap of 1 a program is one chain asked at its last variable (a one-chain program's query)."""
    whole = data.multichain_programs(30, "dev")
    one = train.programs_of({"layout": "multi-count", "value_first": False}, 30, "dev", max_depth=1)
    three = train.programs_of({"layout": "multi-count", "value_first": False}, 30, "dev", max_depth=3)
    for full, a, b in zip(whole, one, three, strict=True):
        last_bound = a.program.rstrip(";").split(";")[-1].split("=")[0]
        assert len(a.queries) == 1 and a.positional and a.queries[0].variable == last_bound
        assert a.program == full.program[:len(a.program)] and a.queries[0] == full.queries[0]
        assert b.queries == tuple(reversed(full.queries[:len(b.queries)])) and 1 <= len(b.queries) <= 3
        assert b.text == f"{b.program}\n" + "".join(f"{q.value};" for q in b.queries) + "\n"
    assert max(len(p.queries) for p in three) == 3
    held_out = train.programs_of({"layout": "multi-count", "value_first": False}, 30, "dev")  # the cap at its end
    assert [p.queries for p in held_out] == [tuple(reversed(p.queries)) for p in whole]
    named = train.programs_of({"layout": "multi-count-named", "value_first": False}, 30, "dev", max_depth=3)
    for a, b in zip(three, named, strict=True):
        assert (a.program, a.queries) == (b.program, b.queries)
        assert b.text == f"{b.program}\n" + "".join(f"{q.variable}?{q.value};" for q in b.queries) + "\n"
    with pytest.raises(ValueError, match="max_chains must be None or >= 1"):
        data.multichain_programs(1, max_chains=0)


def test_named_chains_with_drills_alternate_and_are_measured_on_the_chains_alone():
    """multi-count-named-drills: lookup drills of 2 to 4 names per chain of the cap in every other program, the
    named chains in the others; its development check and held-out figures read the named chains alone."""
    shape = {"layout": "multi-count-named-drills", "value_first": False}
    mixed = train.programs_of(shape, 20, "dev", max_depth=2)
    named = train.programs_of({**shape, "layout": "multi-count-named"}, 20, "dev", max_depth=2)
    drills = data.lookup_programs(20, "dev", sizes=train.lookup_sizes(2))
    assert mixed[0::2] == drills[0::2] and mixed[1::2] == named[1::2]
    assert all(2 <= len(p.queries) <= 8 and {q.depth for q in p.queries} == {1} for p in mixed[0::2])
    assert train.measured(shape) == {**shape, "layout": "multi-count-named"}
    assert train.measured({"layout": "single"}) == {"layout": "single"}


def test_later_queries_are_those_after_their_programs_first():
    rows = torch.tensor([0, 0, 0, 1, 2, 2])
    assert train.later_queries(rows).tolist() == [False, True, True, False, False, True]
    assert train.later_queries(torch.tensor([], dtype=torch.long)).tolist() == []


def test_lookup_drills_ask_every_name_once_in_a_random_order():
    drills = data.lookup_programs(50, "dev")
    in_order = 0
    for p in drills:
        values = _values(p)
        names = [b.split("=")[0] for b in p.program.rstrip(";").split(";")]
        assert sorted(q.variable for q in p.queries) == sorted(names) and len(set(names)) == len(names)
        assert all(values[q.variable] == int(q.value) and q.depth == 1 for q in p.queries) and p.dense
        in_order += [q.variable for q in p.queries] == names
    assert in_order == 0  # no positional shortcut
    mixed = train.programs_of({"layout": "multi-lookup"}, 4, "dev", max_depth=6)
    assert all(q.depth == 1 for q in mixed[0].queries) and mixed[1] == data.multichain_programs(4, "dev", 0, 6)[1]


def test_ask_all_programs_ask_every_binding_at_its_place_in_its_chain():
    """The multi-all training layout: every variable of at most 28 bindings asked once, in a random order, its depth
    its place in its chain; the programs are the same chains as the workload's, only their queries differ."""
    for p in data.multichain_programs(100, "train", max_depth=12, ask_all=True):
        values, names = _values(p), [b.split("=")[0] for b in p.program.rstrip(";").split(";")]
        assert sorted(q.variable for q in p.queries) == sorted(names) and len(names) <= data.ASK_ALL_BINDINGS
        assert all(values[q.variable] == int(q.value) for q in p.queries)
        starts = [b.split("=")[0] for b in p.program.rstrip(";").split(";") if "+" not in b]
        assert sum(q.depth == 1 for q in p.queries) == len(starts) and max(q.depth for q in p.queries) <= 12
    assert all(p.queries for p in data.multichain_programs(300, "dev", ask_all=True))  # 32 > 28: never empty
    mixed = train.programs_of({"layout": "multi-all"}, 4, "dev", max_depth=6)
    assert all(q.depth == 1 for q in mixed[0].queries) and len(mixed[1].queries) == len(mixed[1].program.split(";")) - 1


def test_value_first_writes_each_name_after_its_expression():
    """--value-first: the same chains and drills as without it, every binding written ``a+4=b;``."""
    def flipped(program: data.ChainProgram) -> data.ChainProgram:
        bindings = [b.split("=") for b in program.program.rstrip(";").split(";")]
        return data.ChainProgram("".join(f"{name}={expr};" for expr, name in bindings), program.queries, program.dense)

    for layout in ("multi-all", "lookup"):
        mixed = train.programs_of({"layout": layout, "value_first": True}, 6, "dev", max_depth=6)
        plain = train.programs_of({"layout": layout, "value_first": False}, 6, "dev", max_depth=6)
        assert [flipped(p) for p in mixed] == plain and mixed != plain
        assert all(b.split("=")[1].isalpha() for p in mixed for b in p.program.rstrip(";").split(";"))
    with pytest.raises(ValueError, match="value_first needs a chain_layout other than 'single'"):
        train.shape(train_options(["--out", "x", "--value-first"]))


def test_lookup_layout_grows_its_drills_with_the_curriculum():
    """The drills-alone layout binds 2 to 4 names per step of the cap, up to the multichain programs' 36."""
    for cap, most in ((1, 4), (3, 12), (9, 36), (32, 36)):
        drills = train.programs_of({"layout": "lookup"}, 200, "train", max_depth=cap)
        sizes = [len(p.queries) for p in drills]
        assert min(sizes) == 2 and max(sizes) == most
        assert all(q.depth == 1 for p in drills for q in p.queries)
    with pytest.raises(ValueError, match="sizes must satisfy"):
        data.lookup_programs(1, sizes=(3, 2))


def test_multichain_training_rows_score_the_dense_query_lines(tokenizer):
    """The scouting run's first attempt trained on "x?7;" query lines (renaming dropped the layout) while its
    evaluation asked "x7": every row must keep the layout it was drawn in."""
    ids, scored, answer = train.chain_rows(tokenizer, 3, 256, 5, 12, {"layout": "multi"})
    for i in range(3):
        lines = tokenizer.decode(ids[i][scored[i]]).split(tokenizer.eos_token)
        assert lines[-1] == "" and all("?" not in line and ";" not in line for line in lines[:-1])
        digits = tokenizer.decode(ids[i][answer[i]])
        assert digits.isdigit() and len(digits) == sum(len(line.strip()) // 2 for line in lines[:-1])


def test_rows_alternate_what_the_layout_alternates(tokenizer):
    """A program that does not fit a row starts the next one: with drills and multichain programs in turn, and one
    per row (each takes most of the 52 names), the rows alternate too instead of repeating the drills."""
    ids, scored, _ = train.chain_rows(tokenizer, 4, 256, 7, 6, {"layout": "multi-lookup"})
    programs = [tokenizer.decode(ids[i][: int(scored[i].nonzero().max())]).split("\n")[0] for i in range(4)]
    drills = ["+" not in p for p in programs]
    assert drills == [True, False, True, False]


def test_the_learning_rate_decays_over_the_runs_real_length():
    args = train_options(["--out", "runs/x", "--steps", "9000", "--decay-from", "7800"])
    assert train.learning_rate(args, 7800) == pytest.approx(args.lr)
    assert train.learning_rate(args, 8400) == pytest.approx(args.lr * (0.1 + 0.9 * 0.5))
    assert train.learning_rate(args, 9000) == pytest.approx(0.1 * args.lr)
    from_start = replace(args, decay_from=0)
    assert train.learning_rate(from_start, 250) == pytest.approx(args.lr * 250 / args.warmup)
    halfway = 0.1 + 0.9 * 0.5 * (1 + math.cos(0.5 * math.pi))
    assert train.learning_rate(from_start, 4500) == pytest.approx(args.lr * halfway)
    with pytest.raises(ValueError, match="--decay-from must be in"):
        train_options(["--out", "runs/x", "--steps", "100", "--decay-from", "100"])


def test_deep_draws_run_64_loops_and_leave_other_runs_random_stream_alone():
    g = torch.Generator().manual_seed(0)
    draws = [train.sample_loops(16, 4, g, deep_share=0.25) for _ in range(2000)]
    share = sum(d == (train.DEEP_LOOPS - 4, 4) for d in draws) / len(draws)
    assert 0.2 < share < 0.3
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert [train.sample_loops(16, 4, a) for _ in range(50)] == [train.sample_loops(16, 4, b, 0.0) for _ in range(50)]
    with pytest.raises(ValueError, match="--deep-share must be"):
        train_options(["--out", "runs/x", "--deep-share", "nan"])


def test_the_long_runs_checkpoint_resumes_with_the_continuation_options():
    """checkpoints/tiny-long predates the options: its recorded arguments with BEFORE_OPTION make whole settings, and
    the continuation options are ones a resumed run may change."""
    checkpoint = Path(__file__).parent.parent / "checkpoints/tiny-long/checkpoint.pt"
    recorded = torch.load(checkpoint, weights_only=False)["args"]
    assert not {"chain_layout", "decay_from", "deep_share"} & set(recorded)
    settings = train.Options(**{**train.BEFORE_OPTION, **recorded, "out": Path("r"), "resume": True, "export": None})
    assert (settings.chain_layout, settings.decay_from, settings.deep_share) == ("single", 0, 0.0)
    assert {"chain_layout", "decay_from", "deep_share", "advance_at", "depth_step"} <= set(train.RESUMABLE)


def test_a_continuing_scouts_minutes_are_its_own_sittings():
    """The multichain scouts resumed the shipped run (2 hours in): the training page shows their 30 minutes."""
    from looped_kv.tiny import scout

    log = [{"step": 7790, "time_s": 7100.0}, {"step": 7800, "time_s": 7168.0}, {"step": 7800, "changed": {"x": [1, 2]}},
           {"step": 7810, "time_s": 7180.0}]
    assert scout.sitting_minutes({"log": log, "final": {"time_s": 7168.0 + 1800}}) == 30
    assert scout.sitting_minutes({"log": log[:2], "final": {"time_s": 600.0}}) == 10  # a run from scratch
    recorded = {r["recipe"]: scout.sitting_minutes(r) for r in scout.records()}
    assert all(minutes <= 60 for minutes in recorded.values()), recorded


def test_a_long_run_needs_depth_on_deep_queries_and_lookups_on_later_ones():
    """The scouting rule: deep buckets at R = 16 beat R = 4 and chance by the margin; where a record has the later
    queries' accuracy (programs of several queries), they must beat chance too (a first query alone is not a dense
    workload)."""
    from looped_kv.tiny import scout

    deep = {"13-16": 0.4, "17-24": 0.4, "25-32": 0.4}
    held = {"chance": 0.1, "4": {"13-16": 0.1, "17-24": 0.1, "25-32": 0.1}, "16": dict(deep)}
    assert scout.earns_long_run({"held_out": held})
    assert not scout.earns_long_run({"held_out": {**held, "16": {**deep, "later queries": 0.12}}})
    assert scout.earns_long_run({"held_out": {**held, "16": {**deep, "later queries": 0.2}}})
    assert not scout.earns_long_run({"held_out": {**held, "4": deep}})  # no gain from depth


def test_a_run_keeps_the_weights_of_every_evaluated_step_and_resumes_with_a_new_recurrence(tmp_path):
    """Every held-out evaluation leaves its weights in OUT/evaluated (a step is chosen on the development split after
    the run), and a resumed run may make its mean recurrence follow the curriculum (the long run's change)."""
    from safetensors.torch import load_file

    from looped_kv.runtime.loading import load

    small = ["--out", str(tmp_path), "--steps", "2", "--eval-every", "1", "--batch", "2", "--seq", "160",
             "--eval-programs", "4", "--eager", "--vocab", "300", "--mean-recurrence", "2", "--backprop", "1",
             "--threads", "1", "--precision", "fp32"]
    train.run(train_options(small), given=())
    assert sorted(p.name for p in (tmp_path / "evaluated").iterdir()) == ["step-000001.safetensors",
                                                                          "step-000002.safetensors"]
    final = load(str(tmp_path), dtype=torch.float32).state_dict()
    kept = load_file(tmp_path / "evaluated/step-000002.safetensors")
    assert kept.keys() <= final.keys() and all(torch.equal(kept[k], final[k]) for k in kept)
    assert not torch.equal(load_file(tmp_path / "evaluated/step-000001.safetensors")["transformer.wte.weight"],
                           kept["transformer.wte.weight"])

    run_files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    from looped_kv.cli import main

    assert main(["select", "--out", str(tmp_path), "--export", str(tmp_path / "chosen"), "--step", "1"]) == 0
    chosen = load(str(tmp_path / "chosen"), dtype=torch.float32).state_dict()
    first = load_file(tmp_path / "evaluated/step-000001.safetensors")
    assert all(torch.equal(first[k], chosen[k]) for k in first)
    record = __import__("json").loads((tmp_path / "chosen/config.json").read_text())["training"]
    assert (record["selected_step"], record["selected_by"]) == (1, "--step") and "chains_held_out" in record
    assert record["curriculum"] == {"depth": 4, "raised": []}  # the start depth: two steps raise nothing
    assert all(p.read_bytes() == data for p, data in run_files.items())  # the run's own files only read
    assert train.best_evaluated(tmp_path) in (1, 2)
    assert main(["select", "--out", str(tmp_path), "--export", str(tmp_path / "x"), "--step", "7"]) == 2

    again = ["--out", str(tmp_path), "--resume", "--steps", "3", "--recurrence-follows-depth", "--min-recurrence", "3"]
    train.run(train_options(again), given=("steps", "recurrence_follows_depth", "min_recurrence"))
    log = __import__("json").loads((tmp_path / "training_log.json").read_text())
    changed = [entry["changed"] for entry in log if "changed" in entry]
    assert changed == [{"steps": [2, 3], "recurrence_follows_depth": [False, True], "min_recurrence": [8, 3]}]
    assert log[-1]["step"] == 3 and log[-1]["mean_recurrence"] == 3  # at least 3, though the mean is 2
