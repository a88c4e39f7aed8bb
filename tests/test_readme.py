"""The README's facts that code can check: its commands, its example, its tables."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from fovi_ref.check.bench import targets

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.DOTALL)


def test_quick_start_gives_two_commands_main_job_then_tests():
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", quick, flags=re.DOTALL).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert commands[0].endswith("python -m fovi_ref")
    assert commands[1].endswith("pytest --nbval")
    assert all("torch==2.13.0" in c for c in commands)


def test_quick_start_command_2_installs_what_ci_installs():
    """The tests need fovi 2.4.0 (tests/test_fovi_upstream.py, notebook 05): command 2 installs
    it as .ci/run does, without dependency resolution, after fovi_ref with its dev tools and its
    onnx extra (tests/test_onnx.py)."""
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    command = [line for line in quick.splitlines() if line.endswith("pytest --nbval")][0]
    ci = (ROOT / ".ci" / "run").read_text()
    install = '-e ".[dev,onnx]"'
    for step in (install, "--no-deps -r scripts/fovi-requirements.txt", "pytest --nbval"):
        assert step in command and step in ci
    assert command.index(install) < command.index("fovi-requirements.txt")


def test_notebook_section_counts_and_commands_hold():
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    section = README.split("## Working with the notebooks", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\d\d_\w+\.ipynb)` \|", section, flags=re.MULTILINE)
    assert listed == notebooks
    words = {4: "four", 5: "five", 6: "six"}
    assert f"all {words[len(notebooks)]} in place" in section
    nbconvert = next(b for b in code_blocks("bash") if "nbconvert" in b)
    makefile = (ROOT / "Makefile").read_text()
    assert "--ExecutePreprocessor.record_timing=False" in nbconvert
    assert "--ExecutePreprocessor.record_timing=False" in makefile
    times = re.findall(r"^\| `\d\d_\w+\.ipynb` \|.*\| ([^|]+) \|$", section, flags=re.MULTILINE)
    assert len(times) == len(notebooks) and all(re.fullmatch(r"\d+ s", t) for t in times)


def test_targets_table_matches_the_code():
    rows = re.findall(r"^\| `([^`|]+)` \| <= ([0-9.]+) \|$", README, flags=re.MULTILINE)
    assert [(name, float(v)) for name, v in rows] == [(t.name, t.at_most) for t in targets.ALL]


def test_every_module_in_the_table_exists():
    table = README.split("## Where each idea lives", 1)[1].split("```", 1)[0]
    paths = re.findall(r"`(fovi_ref/[\w/.]+)`", table)
    assert len(paths) > 10
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing


def test_the_python_example_prints_what_its_comment_says():
    example = next(b for b in code_blocks("python") if "get_layer" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(example, {})  # the README's own example, as a reader would paste it
    comment = re.search(r"print\([^\n]*\) +# ([^\n]*)", example).group(1)
    assert out.getvalue().strip() == comment


def test_the_check_my_own_fovi_model_example_runs_as_written():
    pytest.importorskip("fovi", reason="the example builds a fovi model")
    example = next(b for b in code_blocks("python") if "verify_fovi_model" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(example, {})  # the README's own example, as a reader would paste it
    comment = re.search(r"print\([^\n]*\) +# ([^\n]*)", example).group(1)
    assert out.getvalue().splitlines()[0] == comment
    assert "cells passed" in out.getvalue()
