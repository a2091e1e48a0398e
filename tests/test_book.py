"""The book builds with warnings as errors from the committed, executed notebooks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parent.parent


def test_book_builds(tmp_path):
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"  # nbval executes each chapter once; build from its outputs
    (tmp_path / "_config.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter-book"), "build", str(ROOT), "-W", "-n", "--keep-going",
         "--config", str(tmp_path / "_config.yml"), "--path-output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "out" / "_build" / "html" / "notebooks" / "ch01_looped_models.html").exists()
