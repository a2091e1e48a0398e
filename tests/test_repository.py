"""The repository URL is one setting: _config.yml, pyproject.toml and the chapters' Colab install cells agree."""

from __future__ import annotations

import re
from pathlib import Path

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
