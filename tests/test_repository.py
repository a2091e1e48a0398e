"""The repository URL is one setting: _config.yml, pyproject.toml and the chapters' Colab install cells agree."""

from __future__ import annotations

import glob
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).parent.parent


def test_one_repository_url():
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Source"]
    assert project == url
    for chapter in sorted((ROOT / "notebooks").glob("*.py")):
        installs = re.findall(r"git\+(https://github\.com/[\w.-]+/[\w.-]+)", chapter.read_text())
        assert installs and all(i == url for i in installs), (chapter.name, installs)


def test_the_workflow_runs_the_readme_test_command_and_publishes():
    workflow = (ROOT / ".github" / "workflows" / "book.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest" in workflow and "python -m pytest" in readme
    assert "actions/deploy-pages" in workflow and "cache: pip" in workflow


def test_code_is_ruff_clean():
    """The package and tests at the project's settings; chapter sources at 88 columns (notebooks/ruff.toml)."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed in this environment")
    for args in (["looped_kv", "tests"], ["--config", "notebooks/ruff.toml", *sorted(glob.glob("notebooks/*.py"))]):
        result = subprocess.run([str(ruff), "check", "--no-cache", *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:]


def test_the_package_has_no_import_cycle():
    """Imports between looped_kv modules form no cycle, counting the lazy ones inside functions and ``__main__``
    blocks: a lazy import only hides a circle (the subcommands run through looped_kv.cli alone)."""
    import ast

    package = ROOT / "looped_kv"
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges

    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
