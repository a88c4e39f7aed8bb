"""Project housekeeping that would otherwise rot silently."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment_yml_requirements() -> set[str]:
    """Every ``- name<spec>`` item below ``dependencies:`` in environment.yml, except python,
    pip itself and the editable install of this package."""
    text = (ROOT / "environment.yml").read_text().split("dependencies:", 1)[1]
    items = set(re.findall(r"^\s*-\s+(\S+)\s*$", text, flags=re.MULTILINE))
    return {i for i in items if i not in {"pip", "pip:", "-e"} and not i.startswith("python=")}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])
    assert environment_yml_requirements() == declared
