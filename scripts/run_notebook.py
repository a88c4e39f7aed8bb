"""Execute a notebook in this process with IPython alone, and save it with its outputs.

    python3 scripts/run_notebook.py notebooks/04_scatter_matrix_budget.ipynb OUT.ipynb

What ``jupyter nbconvert --execute`` does, without a Jupyter kernel, ZeroMQ or nbconvert: the
lent GPU machine has none of them and no package registry, and IPython is a few small wheels to
carry (``make gpu-wheels``). The code cells run top to bottom in one IPython shell, in the
notebook's folder (as a kernel would: notebook 05 writes its traces beside itself); each cell's
stdout, stderr and rich outputs (figures, ``display``'s JSON records) are stored as its outputs.
It stops at the first cell that raises, saves what ran, and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output


class Shell(InteractiveShell):
    """A shell without a GUI event loop: ``%matplotlib inline`` needs none (the kernel's own
    ``enable_gui`` does nothing for it either)."""

    def enable_gui(self, gui=None):
        pass


def outputs_of(captured) -> list[dict]:
    """A cell's captured output as notebook outputs (nbformat 4)."""
    outputs = []
    for name in ("stdout", "stderr"):
        text = getattr(captured, name)
        if text:
            outputs.append({"output_type": "stream", "name": name, "text": text})
    for rich in captured.outputs:
        outputs.append({"output_type": "display_data", "data": rich.data, "metadata": {}})
    return outputs


def run(source: Path, target: Path) -> int:
    """Execute ``source`` and write it, with outputs, to ``target``; the exit status."""
    notebook = json.loads(source.read_text())
    shell = Shell.instance(colors="nocolor")
    here = Path.cwd()
    os.chdir(source.parent)
    status, count = 0, 0
    try:
        for cell in notebook["cells"]:
            if cell["cell_type"] != "code":
                continue
            count += 1
            with capture_output() as captured:
                result = shell.run_cell("".join(cell["source"]), store_history=True)
            cell["outputs"], cell["execution_count"] = outputs_of(captured), count
            if not result.success:
                print(f"{source.name}: code cell {count} failed", file=sys.stderr)
                print(captured.stdout[-4000:], captured.stderr[-4000:], file=sys.stderr)
                status = 1
                break
    finally:
        os.chdir(here)
    target.write_text(json.dumps(notebook, indent=1) + "\n")
    print(f"{source.name}: {count} code cells run, {'FAILED' if status else 'ok'}; wrote {target}")
    return status


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(run(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()))
