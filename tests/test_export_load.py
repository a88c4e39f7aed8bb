"""TorchScript refuses KNNConv with a message naming the way out; an exported program loads in a
fresh process only after ``import fovi_ref`` (which registers ``fovi_ref::knn_conv``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import random_meta

from fovi_ref import KNNConv


def test_torchscript_is_refused_naming_torch_export():
    model = torch.nn.Sequential(KNNConv(3, 4, random_meta(9, 9)), torch.nn.ReLU())
    with pytest.raises(RuntimeError, match="TorchScript cannot compile KNNConv.*torch.export"):
        torch.jit.script(model)


LOAD = """
import sys, torch
{imports}
program = torch.export.load(sys.argv[1])
x, y = torch.load(sys.argv[2])
assert torch.equal(program.module()(x), y)
print("loaded and equal")
"""


# torch.export.save warns about weight groups when it saves this model: torch's, not ours.
@pytest.mark.filterwarnings("ignore:No complete tensor found in the group:UserWarning")
@pytest.mark.parametrize("with_import", [True, False], ids=["import_fovi_ref", "no_import"])
def test_exported_program_loads_in_a_fresh_process(tmp_path, with_import):
    model = KNNConv(3, 4, random_meta(9, 9)).eval()
    x = torch.randn(2, 3, 30)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "knn.pt2")
    torch.save((x, model(x).detach()), tmp_path / "xy.pt")
    script = LOAD.format(imports="import fovi_ref" if with_import else "")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "knn.pt2"), str(tmp_path / "xy.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if with_import:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "loaded and equal"
    else:
        assert done.returncode != 0
        assert "fovi_ref" in done.stderr and "import the custom op" in done.stderr.replace(
            "\n", " "
        ), done.stderr[-2000:]
