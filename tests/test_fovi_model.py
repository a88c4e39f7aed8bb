"""Check my own fovi model: verify_fovi_model and ``verify --fovi-model MODULE:FACTORY`` give the
table and findings of ``verify --fovi`` for every KNNConvLayer of a user's model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import random_meta

pytest.importorskip(
    "fovi",
    reason="fovi 2.4.0 is not installed: pip install --no-deps -r scripts/fovi-requirements.txt",
)

from fovi_ref.check.cli import main as cli_main  # noqa: E402
from fovi_ref.check.fovi import (  # noqa: E402
    format_fovi_table,
    fovi_layer_from_meta,
    load_model_factory,
    verify_fovi_model,
)


class TwoLayers(torch.nn.Module):
    """A user's own model: two fovi KNNConvLayers (K = 9 with padding, K = V = 1) and a ReLU."""

    def __init__(self):
        super().__init__()
        self.first = fovi_layer_from_meta(random_meta(9, 9, n_in=30, n_out=20), 4)
        self.act = torch.nn.ReLU()
        self.second = fovi_layer_from_meta(random_meta(1, 1, n_in=20, n_out=12, in_channels=4), 5)


def test_every_knn_conv_layer_of_my_model_is_checked():
    checks = verify_fovi_model(TwoLayers(), batch=1)
    assert list(dict.fromkeys(c.layer for c in checks)) == ["first", "second"]
    assert {torch.float32, torch.float64} == {c.dtype for c in checks}
    table = format_fovi_table(checks)
    assert table.splitlines()[0].split()[:5] == ["layer", "fovi", "backend", "float32", "float64"]
    assert all(line.startswith(("first", "second")) for line in table.splitlines()[1:9])
    # float64 gradients accumulated in float32 by torch_compact: the known finding, diagnosed
    assert "fovi: float64 gradient accumulated in float32" in table


def test_layers_narrow_the_check_and_unknown_names_are_refused():
    model = TwoLayers()
    assert {c.layer for c in verify_fovi_model(model, layers=["second"], batch=1)} == {"second"}
    with pytest.raises(ValueError, match="not a KNNConvLayer of this model: third; its layers: "
                       "first, second"):  # fmt: skip
        verify_fovi_model(model, layers=["third"])
    with pytest.raises(ValueError, match="Sequential has no fovi KNNConvLayer"):
        verify_fovi_model(torch.nn.Sequential(torch.nn.ReLU()))


def test_factory_specs_are_checked():
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        load_model_factory("no_colon")
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        load_model_factory("builtins:dict")
    with pytest.raises(ValueError, match="no module 'nosuchmodule' importable from"):
        load_model_factory("nosuchmodule:f")
    with pytest.raises(ValueError, match="os has no callable 'nothing'"):
        load_model_factory("os:nothing")


@pytest.mark.parametrize("spec", ["nosuchmodule:f", "os:getcwd", "os:nothing"])
def test_cli_names_a_bad_factory_spec_without_a_traceback(spec, capsys, tmp_path):
    """Found by the adversarial pass: these printed a traceback."""
    argv = ["verify", "--fovi-model", spec, "--out", str(tmp_path)]
    assert cli_main(argv) == 2
    assert spec in capsys.readouterr().err


def test_cli_checks_my_model_from_module_factory(tmp_path):
    """A KNNResNet with another in_res and fov, through the command line, from the user's
    working directory (the module is found there, as ``python -m`` finds it)."""
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent("""
        from fovi_ref.check.fovi import load_knnresnet

        def small_net():
            return load_knnresnet().KNNResNet(in_res=32, fov=20, layers=[1, 1, 1, 1], device="cpu")
    """)
    )
    command = [sys.executable, "-m", "fovi_ref", "verify", "--fovi-model", "mymodels:small_net",
               "--layers", "layer2.0.downsample.0", "--dtypes", "float32", "float64", "--batch",
               "1", "--out", str(tmp_path / "out")]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr  # a FAIL: fovi's float64 gradients
    assert "mymodels:small_net's layers" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("layer2.0.downsample.0")]
    assert len(rows) == 5 and all(row.split()[-1] == "gather_gemm" for row in rows)
    assert "fovi: float64 gradient accumulated in float32" in done.stdout
    assert (tmp_path / "out" / "verify_fovi_model.json").exists()
    # Nothing about another model: the machine and overflow findings are fovi-resnet18's.
    assert (
        "KNNResNet-18" not in done.stdout
        and "machine_finding" not in (tmp_path / "out" / "verify_fovi_model.json").read_text()
    )
