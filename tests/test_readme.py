"""The README's facts that code can check: its commands, its examples and their outputs, its
tables, and the places it sends a reader to."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import textwrap
from pathlib import Path

import pytest
import torch

import fovi_ref
from fovi_ref.check import tightness
from fovi_ref.check.check_ops import random_meta

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LINES_AT_MOST = 250


def code_blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def section(title: str) -> str:
    return README.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def commands(block: str) -> list[str]:
    """The shell commands of ``block``: continuation lines joined, comments dropped."""
    joined = re.sub(r" *\\\n *", " ", block)
    return [line for line in joined.splitlines() if line and not line.startswith("#")]


def run_printing(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # the example as a reader would paste it
    return out.getvalue()


def test_the_readme_is_short():
    assert len(README.splitlines()) <= LINES_AT_MOST


def test_quick_start_gives_two_commands_main_job_then_tests():
    (block,) = code_blocks("bash", section("Quick start"))
    main_job, tests = commands(block)
    assert main_job.endswith("python -m fovi_ref")
    assert tests.endswith("pytest --nbval")
    assert all("torch==2.13.0" in c for c in (main_job, tests))
    assert all(len(line) <= 100 for line in block.splitlines())  # wrapped so they read


def test_quick_start_command_2_installs_what_ci_installs():
    """The tests need fovi 2.4.0 (tests/test_fovi_upstream.py, notebook 06): command 2 installs
    it as .ci/run does, without dependency resolution, after fovi_ref with its dev tools and its
    onnx extra (tests/test_onnx.py)."""
    (block,) = code_blocks("bash", section("Quick start"))
    command = commands(block)[1]
    ci = (ROOT / ".ci" / "run").read_text()
    install = '-e ".[dev,onnx]"'
    for step in (install, "--no-deps -r scripts/fovi-requirements.txt", "pytest --nbval"):
        assert step in command and step in ci
    assert command.index(install) < command.index("fovi-requirements.txt")


def run_times() -> dict[str, int]:
    """``{notebook: seconds}`` as the last ``make notebooks`` wrote them."""
    text = (ROOT / "notebooks" / "run_times.txt").read_text()
    return {name: int(s) for name, s in re.findall(r"^(\S+\.ipynb) (\d+)$", text, re.MULTILINE)}


def test_the_notebook_table_lists_every_notebook_with_its_measured_time():
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    row = r"^\| `(\d\d_\w+\.ipynb)` \|.*\| (\d+) s \|$"
    rows = re.findall(row, section("The notebooks"), flags=re.MULTILINE)
    assert [name for name, _ in rows] == notebooks
    assert {name: int(s) for name, s in rows} == run_times()
    assert "all six in place" in section("The notebooks")
    assert "run_times.txt" in (ROOT / "Makefile").read_text()


def test_the_nbconvert_command_matches_make_notebooks():
    guide = (ROOT / "notebooks" / "README.md").read_text()
    (nbconvert,) = (b for b in code_blocks("bash", guide) if "nbconvert" in b)
    for flag in ("--inplace", "--ExecutePreprocessor.record_timing=False"):
        assert flag in nbconvert and flag in (ROOT / "Makefile").read_text()


def test_every_module_in_the_table_exists():
    table = section("Where each idea lives")
    paths = re.findall(r"`(fovi_ref/[\w/.]+)`", table)
    assert len(paths) > 10
    assert not [p for p in paths if not (ROOT / p).exists()]


def test_every_link_and_help_target_exists():
    """Each one-line pointer leads somewhere: relative links to files, ``help(...)`` to a module
    whose docstring holds what the README says moved there."""
    links = re.findall(r"\]\(((?!https?:)[^)#]+)\)", README)
    assert links and not [link for link in links if not (ROOT / link).exists()]
    helped = set(re.findall(r"help\(([\w.]+)\)", README))
    assert {"fovi_ref", "fovi_ref.check.bench", "fovi_ref.check.fovi"} <= helped
    for name in helped:
        assert len(importlib.import_module(name).__doc__.splitlines()) > 10, name


def test_the_python_example_prints_what_its_comment_says():
    example = next(b for b in code_blocks("python") if "KNNConv" in b)
    comment = re.search(r"print\([^\n]*\) +# ([^\n]*)", example).group(1)
    assert run_printing(example).strip() == comment


def test_the_strategy_example_prints_what_the_readme_says():
    example = next(b for b in code_blocks("python") if "strategy_for" in b)
    said = re.search(r"prints (`.*?`)\s*\(on a CPU", README, flags=re.DOTALL).group(1)
    expected = [" ".join(p.split()) for p in re.findall(r"`([^`]*)`", said)]
    assert run_printing(textwrap.dedent(example)).splitlines() == expected


def test_the_verify_example_is_what_its_command_prints(tmp_path, capsys):
    """The table as ``python -m fovi_ref verify --layers res18_ds2 layer2.0.conv1`` prints it:
    every row, route, backend and verdict. Only the ratios' digits may differ, as float32 and
    16-bit rounding errors differ between CPUs and MKL code paths."""
    from fovi_ref.check.cli import main

    part = section("Reading the `verify` table")
    command = re.search(r"`python -m fovi_ref (verify [^`]*)`", part).group(1)
    assert main(["--out", str(tmp_path), *command.split()]) == 0
    printed = capsys.readouterr().out.splitlines()
    table = printed[next(i for i, line in enumerate(printed) if line.startswith("layer ")) :]
    table = table[: table.index("")]
    (shown,) = code_blocks("", part.split("<!-- verify example -->", 1)[1])[:1]

    def digits_out(lines):
        return [re.sub(r"(PASS|FAIL) \d+\.\d\d", r"\1 x.xx", line) for line in lines]

    assert digits_out(table) == digits_out(shown.strip("\n").splitlines())


def my_ops_example() -> str:
    return next(b for b in code_blocks("python") if "class MyOps" in b)


def test_the_validate_your_own_backend_skeleton_runs(monkeypatch):
    """The skeleton as written, with one change: its ``check_ops`` call gets a smaller selection
    (the random graphs, float32) so that this test takes seconds; the README's call runs the
    default battery, which the same code path runs here on fewer graphs and dtypes."""
    example = my_ops_example()
    assert len(example.strip().splitlines()) <= 15
    call = "check_ops(check_protocol(MyOps()))"
    assert example.count(call) == 1
    small = "check_ops(check_protocol(MyOps()), graphs='random', dtypes=(torch.float32,))"
    comment = re.search(r"print\([^\n]*\) +# ([^\n]*)", example).group(1)
    try:
        smaller = "import torch\n" + example.replace(call, small)
        assert run_printing(smaller).strip() == comment
        assert "mine" in fovi_ref.available_ops()
        meta = random_meta(2, 4)
        x, w = torch.randn(2, 3, meta.n_in), torch.randn(5, 3 * 4)
        y = fovi_ref.knn_conv(x, w, None, meta, backend="mine")
        torch.testing.assert_close(y, fovi_ref.knn_conv(x, w, None, meta, backend="general"))
    finally:
        if "mine" in fovi_ref.available_ops():
            fovi_ref.unregister_ops("mine")


def test_the_pytest_form_is_two_lines_that_call_the_battery():
    (form,) = (b for b in code_blocks("python") if b.startswith("def test_"))
    assert len(form.strip().splitlines()) == 2 and "check_ops(MyOps()).ok" in form


def test_the_check_my_own_fovi_model_example_runs_as_written():
    pytest.importorskip("fovi", reason="the example builds a fovi model")
    import fovi_ref.check.fovi as upstream

    block = upstream.__doc__.split("or from Python", 1)[1].split("::\n", 1)[1]
    example = textwrap.dedent(block.split("\n\n:func:", 1)[0])
    comment = re.search(r"print\([^\n]*\) +# ([^\n]*)", example).group(1)
    out = run_printing(example)
    assert out.splitlines()[0] == comment
    assert "cells passed" in out


def test_the_shell_form_checks_the_skeleton_from_its_file(tmp_path, capsys):
    """``python -m fovi_ref check my_backend.py:MyOps`` on the skeleton saved as a file (its
    class and imports; one graph and dtype here, so this takes seconds)."""
    from fovi_ref.check.cli import main

    found = re.findall(r"python -m fovi_ref (check [^\s#-][^\s#]*)", section("Validate your own"))
    (command,) = set(found)
    path = tmp_path / "my_backend.py"
    path.write_text(my_ops_example().split("\nreport = ", 1)[0])
    args = command.replace("my_backend.py", str(path)).split()
    assert main([*args, "--graphs", "base", "--dtypes", "float32"]) == 0
    assert "check 'mine': protocol PASS" in capsys.readouterr().out


def test_the_readme_states_the_tightness_measured():
    """The validator section's worst ratio per dtype is :func:`~fovi_ref.check.tightness.measure`'s
    (the worst rows are a tie, one product and two terms, the same on every machine: the
    tightness module's docstring; tests/test_tolerance_rule.py holds each computation to pass)."""
    measured = tightness.worst_per_dtype(tightness.measure())
    readme = " ".join(README.split())  # lines joined
    stated = re.search(r"legal computations reach (.*?) of the bound", readme)
    assert stated, "the README states no tightness"
    stated_figures = re.findall(r"([\d.]+) \((\w+)\)", stated.group(1))  # [(figure, dtype)]
    assert {dtype for _, dtype in stated_figures} == set(measured)
    for figure, dtype in stated_figures:
        digits = len(figure.partition(".")[2])
        assert round(measured[dtype], digits) == float(figure), (dtype, measured[dtype])
