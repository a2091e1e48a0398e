"""Each chapter's py:percent source and its committed .ipynb are in sync and fully executed."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("*.py"))


def test_there_are_chapters():
    assert SOURCES


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_pair_in_sync_and_executed(source):
    executed = source.with_suffix(".ipynb")
    assert executed.exists(), f"{executed.name} is missing: run jupytext --sync --execute {source}"
    text = jupytext.read(source)
    notebook = nbformat.read(executed, as_version=4)
    cells = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells if c.source.strip()]  # noqa: E731
    assert cells(text) == cells(notebook), f"{source.name} and {executed.name} differ: re-sync the pair"
    code = [c for c in notebook.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count is not None for c in code), f"{executed.name} has unexecuted cells"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs), f"{executed.name} has errors"
