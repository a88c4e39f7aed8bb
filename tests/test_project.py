"""Project housekeeping that would otherwise rot silently."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def environment_yml_requirements() -> set[str]:
    """Every ``- name<spec>`` item below ``dependencies:`` in environment.yml, except python,
    pip itself and the editable install of this package."""
    text = (ROOT / "environment.yml").read_text().split("dependencies:", 1)[1]
    items = set(re.findall(r"^\s*-\s+(\S+)\s*$", text, flags=re.MULTILINE))
    return {i for i in items if i not in {"pip", "pip:", "-e"} and not i.startswith("python=")}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(project["dependencies"]).union(*project["optional-dependencies"].values())
    assert environment_yml_requirements() == declared


# ----------------------------------------------------------------------------- the import graph
PACKAGE = ROOT / "fovi_ref"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: fovi_ref modules it imports}`` (a package import counts as its ``__init__``;
    ``from package import name`` counts the submodule where ``name`` is one)."""
    import ast

    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def import_levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Level 0 imports no fovi_ref module; level n imports modules of levels below n only.
    Raises if the graph has a cycle (some modules never get a level)."""
    levels: dict[str, int] = {}
    while len(levels) < len(graph):
        ready = {m for m, deps in graph.items() if m not in levels and deps <= set(levels)}
        if not ready:
            raise AssertionError(f"import cycle among {sorted(set(graph) - set(levels))}")
        for m in ready:
            levels[m] = 1 + max((levels[d] for d in graph[m]), default=-1)
    return levels


# Around the op: the harness (fovi_ref.check) and interop (ONNX, DDP, fovi). The op imports neither,
# interop does not import the harness, and both reach the op through its public names.
OUTSIDE = ("fovi_ref.check", "fovi_ref.interop")


def test_the_op_never_imports_the_harness_or_interop_and_nothing_cycles():
    graph = import_graph()
    import_levels(graph)  # raises on a cycle
    op = {m for m in graph if not m.startswith(OUTSIDE) and m != "fovi_ref.__main__"}
    assert not {(m, d) for m in op for d in graph[m] if d.startswith(OUTSIDE)}
    interop = {m for m in graph if m.startswith("fovi_ref.interop")}
    assert not {(m, d) for m in interop for d in graph[m] if d.startswith("fovi_ref.check")}


@pytest.mark.parametrize("outside", OUTSIDE)
def test_the_harness_and_interop_reach_the_op_through_public_names_only(outside):
    import ast

    private = []
    for path in (PACKAGE / outside.split(".")[1]).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("fovi_ref") and not module.startswith(outside):
                private += [(path.name, a.name) for a in node.names if a.name.startswith("_")]
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and (isinstance(node.value, ast.Name) and node.value.id == "fovi_ref")
            ):
                private.append((path.name, node.attr))
    assert not private
