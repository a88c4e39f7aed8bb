"""scripts/run_notebook.py, the notebook runner of scripts/gpu_check.sh (whose dry run CI runs
whole: .ci/run): a notebook's outputs as nbconvert would store them, and a failing cell."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_notebook.py"


def notebook(*cells: str) -> dict:
    code = [
        {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {},
            "outputs": [],
            "source": source,
        }
        for source in cells
    ]
    return {
        "cells": [{"cell_type": "markdown", "metadata": {}, "source": "# a title"}, *code],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def run(tmp_path: Path, nb: dict) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "in.ipynb").write_text(json.dumps(nb))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "in.ipynb", "out.ipynb"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, json.loads((tmp_path / "out.ipynb").read_text())


def test_outputs_are_stored_per_cell_in_the_notebooks_folder(tmp_path):
    done, out = run(
        tmp_path,
        notebook(
            "%matplotlib inline\nfrom pathlib import Path\nx = 6 * 7\nprint('x', x)",
            "from IPython.display import display\n"
            "display({'application/json': {'kind': 'a record', 'x': x}}, raw=True)\n"
            "_ = Path('written.txt').write_text('here')",
        ),
    )
    assert done.returncode == 0, done.stderr
    first, second = (c for c in out["cells"] if c["cell_type"] == "code")
    assert first["outputs"] == [{"output_type": "stream", "name": "stdout", "text": "x 42\n"}]
    assert first["execution_count"] == 1 and second["execution_count"] == 2
    data = second["outputs"][0]["data"]["application/json"]
    assert data == {"kind": "a record", "x": 42}
    assert (tmp_path / "written.txt").read_text() == "here"  # cells run beside the notebook


def test_a_failing_cell_stops_the_run_with_exit_1(tmp_path):
    done, out = run(tmp_path, notebook("print('ran')", "1 / 0", "print('never')"))
    assert done.returncode == 1 and "code cell 2 failed" in done.stderr
    code = [c for c in out["cells"] if c["cell_type"] == "code"]
    assert code[0]["outputs"][0]["text"] == "ran\n" and code[2]["outputs"] == []
