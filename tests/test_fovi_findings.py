"""The reproducers in scripts/fovi_findings/: each still shows its defect in fovi 2.4.0.

Every script runs in a fresh interpreter against the installed fovi and must exit 1 (the defect
is present) after printing its expected-against-actual lines, without a traceback (an exception
also exits 1). Where fovi's own override can send a script's layer through fovi's baseline, the
script must exit 0 there: the scripts can pass, so exit 1 is the defect, not the script. Each one
imports only torch and fovi, names code that exists in the installed fovi, is listed in the
index, and is the one ``verify --fovi`` names beside its finding.

Needs fovi==2.4.0 (``pip install --no-deps -r scripts/fovi-requirements.txt``); skips only where
fovi is absent.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fovi_ref.check import fovi as upstream

pytest.importorskip(
    "fovi",
    reason="fovi 2.4.0 is not installed: pip install --no-deps -r scripts/fovi-requirements.txt",
)

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = ROOT / upstream.FINDINGS_DIR
SCRIPTS = sorted(p.name for p in FINDINGS.glob("*.py"))
# Scripts whose layer picks its backend through kernel_backend, which fovi's override
# FOVI_KNN_BACKEND beats: under the override "baseline" they judge fovi's baseline, which has
# none of these defects, and must pass.
PASS_ON_BASELINE = (
    "f64_grads_torch_compact.py",
    "f64_grad_weight_gather_gemm.py",
    "f64_grad_bias.py",
    "half_grad_weight_partial_sums.py",
    "torch_cached_stale_weight.py",
)
LINE = re.compile(r"expected (\S+) actual (\S+) (of \d+ )?.*(error|tolerance)")


def run_script(name: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != upstream.BACKEND_ENV}
    return subprocess.run(
        [sys.executable, str(FINDINGS / name)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_there_is_a_script_per_finding():
    assert len(SCRIPTS) == 8, SCRIPTS


# graphs_depend_on_machine.py builds its graphs under two arithmetic settings of its own.
SHOWS_DEFECT = [
    pytest.param(name, marks=pytest.mark.sets_its_own_arithmetic)
    if name == "graphs_depend_on_machine.py"
    else name
    for name in SCRIPTS
]


@pytest.mark.parametrize("name", SHOWS_DEFECT)
def test_each_script_still_shows_its_defect(name):
    done = run_script(name)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-3000:])
    lines = done.stdout.strip().splitlines()
    assert lines and all(LINE.search(line) for line in lines), done.stdout
    assert all("tolerance" in line for line in lines), done.stdout


@pytest.mark.parametrize("name", PASS_ON_BASELINE)
def test_the_script_passes_on_fovis_baseline(name):
    done = run_script(name, **{upstream.BACKEND_ENV: "baseline"})
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert done.stdout.strip() and "Traceback" not in done.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_is_standalone_short_and_names_fovis_code(name):
    """Imports torch, fovi and the standard library only; at most about 40 lines of code; its
    docstring is an issue: what, where (files of the installed fovi, functions in them),
    expected, measured, a suggested fix."""
    source = (FINDINGS / name).read_text()
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - sys.stdlib_module_names <= {"torch", "fovi"}, imported
    code_lines = [ln for ln in source.splitlines()[tree.body[0].end_lineno :] if ln.strip()]
    assert len(code_lines) <= 40, len(code_lines)
    doc = ast.get_docstring(tree)
    for part in ("What:", "Where:", "Expected:", "Measured:", "Suggested fix:"):
        assert part in doc, part
    fovi_root = Path(upstream.require_fovi().__file__).parent
    files = re.findall(r"fovi/([\w/]+\.py)", doc)
    assert files
    for file in files:
        assert (fovi_root / file).is_file(), file
    text = "".join((fovi_root / file).read_text() for file in files)
    where = doc[doc.index("Where:") : doc.index("Expected:")]
    methods = re.findall(r"\b([A-Z]\w+)\.(\w+)\b", where)  # Class.method
    for cls, method in methods:
        assert f"class {cls}" in text and f"def {method}(" in text, (cls, method)
    functions = [w for w in re.findall(r"\b_?[a-z]+_\w+\b", where) if f"def {w}(" in text]
    assert methods or functions, "the docstring names no function of the fovi files it cites"


def test_the_index_lists_every_script_and_nothing_else():
    index = (FINDINGS / "README.md").read_text()
    listed = set(re.findall(r"\]\((\w+\.py)\)", index))
    assert listed == set(SCRIPTS)
    for name in SCRIPTS:
        row = next(line for line in index.splitlines() if f"]({name})" in line)
        assert re.search(r"wrong result|silent precision loss|portability hazard", row), row


def _finding(backend, dtype, quantities, reason):
    return upstream.FoviFinding(backend, dtype, quantities, 1, 10.0, "fovi", reason)


@pytest.mark.parametrize(
    "finding, expected",
    [
        (
            _finding(
                "torch_compact",
                "float64",
                ("grad_x", "grad_weight", "grad_bias"),
                "float64 gradient accumulated in float32: fails the float64 rule",
            ),
            ["f64_grads_torch_compact.py", "f64_grad_bias.py"],
        ),
        (
            _finding(
                "gather_gemm",
                "float64",
                ("grad_weight", "grad_bias"),
                "float64 gradient accumulated in float32: fails the float64 rule",
            ),
            ["f64_grad_weight_gather_gemm.py", "f64_grad_bias.py"],
        ),
        (
            _finding(
                "torch_compact",
                "bfloat16",
                ("grad_weight",),
                "partial sums rounded to bfloat16 before they are added (the baseline: float32)",
            ),
            ["half_grad_weight_partial_sums.py"],
        ),
        *[
            (
                _finding(
                    backend,
                    "float16",
                    ("y",),
                    "W x rounded to float16 before the bias is added (fovi's baseline rounds once)",
                ),
                ["half_bias_double_rounding.py"],
            )
            for backend in ("torch_compact", "gather_gemm", "torch_cached", "torch_scatter")
        ],
        (_finding("baseline", "float32", ("y",), "neither side shown wrong: read the verdict"), []),
    ],
)
def test_verify_names_the_script_of_each_finding(finding, expected):
    scripts = upstream.finding_scripts(finding)
    assert scripts == expected
    assert all((FINDINGS / s).is_file() for s in scripts)


def test_the_machine_and_overflow_summaries_name_their_scripts():
    run = upstream.MachineRun("as is", {}, torch.zeros(2, 10), [1.0, 1.0, 1.0])
    machine = upstream.MachineFinding((run, run), {"conv1": 1}, {"conv1": [0]}, 0, 0.5)
    overflow = upstream.OverflowFinding(800.0, {"baseline": float("inf")})
    for summary, script in [
        (machine.summary(), "graphs_depend_on_machine.py"),
        (overflow.summary(), "f16_cell_sum_overflow.py"),
    ]:
        assert f"{upstream.FINDINGS_DIR}/{script}" in summary
        assert (FINDINGS / script).is_file()
