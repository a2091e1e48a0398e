"""The book's prose and table formatting: numbers to their precision, lists and changes read as sentences."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from looped_kv import book, prose
from looped_kv.cli import main

ROOT = Path(__file__).parent.parent


def test_a_settings_table_formats_each_number_alone():
    """A mixed column (a training record) showed "119.500000" and "657792"."""
    record = pd.Series({"parameters": 657792, "minutes": 119.5, "mix": [0.2, 0.2, 0.6], "lr": 0.00123456},
                       name="training")
    html = book.table(record).to_html()
    assert "657,792" in html and "119.500000" not in html and ">120<" in html
    assert "0.00123" in html and "[0.2, 0.2, 0.6]" in html


def test_a_column_over_several_orders_of_magnitude_keeps_significant_digits():
    """Chapter 4's ratio column printed 73.8931 beside 0.0984: four decimals taken from its smallest value."""
    html = book.table(pd.DataFrame({"ratio": [0.0984, 0.634, 73.8931, 9.2333]})).to_html()
    assert "73.9" in html and "73.8931" not in html and "0.0984" in html and "9.23" in html
    assert book.significant(1234.5) == "1,234" and book.significant(0.012345) == "0.0123"


def test_lists_and_changes_read_as_sentences():
    assert book.listing(["a"]) == "a" and book.listing(["a", "b"]) == "a and b"
    assert book.listing(["a", "b", "c"]) == "a, b and c" and book.listing([]) == ""
    assert book.change(-0.234, unit="nats") == "falls by 0.23 nats"
    assert book.change(0.0449) == "rises by 0.04" and book.change(0.001) == "does not change"


def test_repeat_counts_read_as_words():
    """Chapter 6 printed "the carried cells verify 1 times per prompt"."""
    assert [prose.times(n) for n in (1, 2, 3, 1.5)] == ["once", "twice", "3 times", "1.5 times"]


def test_the_intros_chapter_times_are_the_executed_notebooks(capsys):
    """The intro's table of minutes per page is what ``looped-kv chapter-times`` reads from the committed notebooks:
    re-executing a chapter without regenerating book/data/chapter-times.md fails here."""
    assert main(["chapter-times"]) == 0
    assert capsys.readouterr().out == (ROOT / "book" / "data" / "chapter-times.md").read_text(), \
        "regenerate it: looped-kv chapter-times > book/data/chapter-times.md"
    assert "data/chapter-times.md" in (ROOT / "book" / "intro.md").read_text()


def _kept_table(capsys, words: list[str], kept: str, shown: str) -> str:
    """What ``looped-kv *words`` prints at the repository's root, held equal to book/data/``kept``; the GPU page
    includes that file and shows the command as ``shown``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        assert main(words) == 0
    table = capsys.readouterr().out
    path = ROOT / "book" / "data" / kept
    assert table == path.read_text(), f"regenerate it: looped-kv {' '.join(words)} > {path.relative_to(ROOT)}"
    gpu_page = (ROOT / "book" / "gpu.md").read_text()
    assert f"data/{kept}" in gpu_page and shown in gpu_page
    return table


def test_the_cpu_route_table_is_the_recorded_parcae_run(capsys, tmp_path):
    """book/gpu.md's table of minutes and GB per chapter for parcae-140m on a CPU is what ``looped-kv chapter-times
    --cpu-run`` prints from the committed record; a chapter the record lacks reads "not recorded"."""
    record = ROOT / "book" / "data" / "plan-check-parcae-140m-cpu.json"
    timed = ROOT / "book" / "data" / "plan-time-parcae-140m-cpu.json"
    words = ["chapter-times", "--cpu-run", str(record.relative_to(ROOT)), "--plan-time", str(timed.relative_to(ROOT))]
    shown = f"looped-kv {words[0]} \\\n    {' '.join(words[1:3])} \\\n    {' '.join(words[3:])}"
    table = _kept_table(capsys, words, "cpu-run-parcae-140m.md", shown)
    rows = json.loads(record.read_text())["chapters"]
    first = rows[0]
    assert f"| {first['seconds'] / 60:.1f} | " in table and f"| {first['measured bytes'] / 1e9:.2f} |" in table
    assert table.splitlines()[0] == "| page | minutes | plan minutes | plan / run | peak GB | plan GB | plan / peak |"
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({**json.loads(record.read_text()), "chapters": rows[:1]}))
    assert main(["chapter-times", "--cpu-run", str(partial)]) == 0
    out = capsys.readouterr().out
    assert out.count("not recorded") == 7 and "plan minutes" not in out
    assert main(["chapter-times", "--cpu-run", str(tmp_path / "none.json")]) == 2
    assert "--cpu-run must be a record" in capsys.readouterr().err
    assert main(["chapter-times", "--plan-time", str(tmp_path / "none.json")]) == 2
    assert "--plan-time must be a record of looped-kv plan-time" in capsys.readouterr().err


def test_the_plan_alone_gives_each_chapters_minutes_and_the_gb_the_cpu_run_was_held_to(capsys):
    """``looped-kv chapter-times --plan-time`` without a run: the plan's minutes and peak GB per chapter, its GB the
    plan's peak beyond the weights that the recorded CPU run of parcae-140m was compared with."""
    timed = ROOT / "book" / "data" / "plan-time-parcae-140m-cpu.json"
    assert main(["chapter-times", "--plan-time", str(timed)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| page | plan minutes | plan GB |" and len(lines) == 10
    run = json.loads((ROOT / "book" / "data" / "plan-check-parcae-140m-cpu.json").read_text())["chapters"]
    assert [line.rsplit("|", 2)[-2].strip() for line in lines[2:]] == [
        f"{row['predicted bytes'] / 1e9:.2f}" for row in sorted(run, key=lambda row: row["chapter"])]


def test_the_cpu_route_table_of_parcae_370m_is_its_recorded_plan(capsys):
    """book/gpu.md's table for parcae-370m on a CPU is what ``looped-kv chapter-times --plan-time`` prints from the
    committed plan-time record of parcae-370m, made on the same CPU as parcae-140m's run."""
    timed = ROOT / "book" / "data" / "plan-time-parcae-370m-cpu.json"
    words = ["chapter-times", "--plan-time", str(timed.relative_to(ROOT))]
    table = _kept_table(capsys, words, "cpu-plan-parcae-370m.md", f"looped-kv {words[0]} \\\n    {' '.join(words[1:])}")
    record, run = (json.loads((ROOT / "book" / "data" / f"{name}.json").read_text())
                   for name in ("plan-time-parcae-370m-cpu", "plan-time-parcae-140m-cpu"))
    assert (record["model"], record["profile"]) == ("parcae-370m", "parcae-370m-cpu")
    assert record["environment"] == run["environment"]
    assert table.splitlines()[0] == "| page | plan minutes | plan GB |" and "not planned" not in table
    assert len(table.splitlines()) == 2 + len(record["chapters"]) == 10


def test_a_notebook_without_recorded_timing_is_refused(tmp_path):
    notebook = {"cells": [{"cell_type": "code", "source": ["1 + 1"], "metadata": {}, "outputs": []}]}
    (tmp_path / "x.ipynb").write_text(json.dumps(notebook))
    with pytest.raises(ValueError, match="no recorded execution time"):
        book.execution_seconds(tmp_path / "x.ipynb")
    notebook["cells"][0]["metadata"]["execution"] = {"iopub.execute_input": "2026-12-03T10:00:00.5Z",
                                                      "shell.execute_reply": "2026-12-03T10:00:02.0Z"}
    (tmp_path / "x.ipynb").write_text(json.dumps(notebook))
    assert book.execution_seconds(tmp_path / "x.ipynb") == 1.5


def test_looped_kv_verdicts_lists_what_the_chapters_verdict_tables_show(tmp_path, capsys):
    """The verdicts listing reads back every row of a chapter's verdict table as the page shows it (label, estimate
    with its interval, n), skips the chapter's other tables, and refuses a chapter that never ran."""
    import nbformat
    import numpy as np

    from looped_kv.analysis.verdicts import Claim, interval_table, verdict

    rng = np.random.default_rng(0)
    b = rng.normal(3.0, 1.0, 40)
    claim = Claim("A beats B", "Paper Table 1", minimum=0.1, minimum_source="the test's smallest effect")
    shown = {"problems: A vs B": verdict(claim, b + 0.5 + rng.normal(0, 0.1, 40), b),
             "code: A vs B": verdict(claim, b[:20] - 0.5, b[:20])}
    html = book.table(interval_table(shown)).to_html()
    other = book.table(pd.DataFrame({"tokens/s": [1.0, 2.0]})).to_html()
    cell = nbformat.v4.new_code_cell("display(table)", execution_count=1, outputs=[
        nbformat.v4.new_output("display_data", data={"text/html": h, "text/plain": "<Styler>"}) for h in (other, html)])
    chapter = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 9. A chapter"), cell])
    path = tmp_path / "ch09.ipynb"
    nbformat.write(chapter, path)
    listed = book.verdicts(path)
    assert list(listed.index) == list(shown)
    for name, v in shown.items():
        assert list(listed.loc[name]) == [v.label, v.estimate_text, str(v.n)]
    assert main(["verdicts", str(path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2] == f"| 9 | problems: A vs B | {shown['problems: A vs B'].label} | " \
                      f"{shown['problems: A vs B'].estimate_text} | 40 |" and len(rows) == 4
    cell.execution_count = None
    nbformat.write(chapter, path)
    assert main(["verdicts", str(path)]) == 2
    assert f"{path} has code cells that never ran; execute it first" in capsys.readouterr().err
