"""Check my own fovi model: verify_fovi_model and ``verify --fovi-model MODULE:FACTORY`` give the
table and findings of ``verify --fovi`` for every KNNConvLayer of a user's model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from conftest import random_meta

pytest.importorskip(
    "fovi",
    reason="fovi 2.4.0 is not installed: pip install --no-deps -r scripts/fovi-requirements.txt",
)

from fovi_ref.check.cli import main as cli_main  # noqa: E402
from fovi_ref.check.fovi import (  # noqa: E402
    exit_status,
    format_fovi_table,
    fovi_layer_from_meta,
    load_model_factory,
    new_failures,
    verify_fovi_model,
)
from fovi_ref.check.fovi import verify as fovi_verify  # noqa: E402


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
    with pytest.raises(
        ValueError, match="not a KNNConvLayer of this model: third; its layers: first, second"
    ):
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
    command = [
        sys.executable,
        "-m",
        "fovi_ref",
        "verify",
        "--fovi-model",
        "mymodels:small_net",
        "--layers",
        "layer2.0.downsample.0",
        "--batch",
        "1",
        "--out",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )
    # FAILs (fovi's float64 gradients), each a known finding: exit 0 (--strict would give 1)
    assert done.returncode == 0, done.stderr
    assert "exit 0: each of the" in done.stdout and "known finding about fovi" in done.stdout
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


def _twolayers_argv(tmp_path, *extra: str) -> list[str]:
    """``verify --fovi-model`` on this module's :class:`TwoLayers` (importable by name: pytest
    puts tests/ on the path)."""
    spec = f"{__name__}:TwoLayers"
    return ["verify", "--fovi-model", spec, "--batch", "1", "--out", str(tmp_path), *extra]


def _no_default_model(monkeypatch) -> None:
    """Make any work on fovi's default KNNResNet-18 (its graphs, its machine finding, its
    overflow finding) an error: ``--fovi-model`` must not spend time on a model it was not given."""

    def refuse(*args, **kwargs):
        raise AssertionError("verify --fovi-model did work for fovi's default KNNResNet-18")

    for name in ("fovi_resnet18_layers", "machine_finding", "overflow_finding", "layer_names"):
        monkeypatch.setattr(fovi_verify, name, refuse)
    monkeypatch.setattr("fovi_ref.check.cli.layer_names", refuse)


def test_cli_prints_the_python_table_and_exits_0_on_known_findings(tmp_path, capsys, monkeypatch):
    """The command prints the table ``verify_fovi_model`` gives in Python (same columns in the
    same order, same cells), reports on the model it was given only, takes that model's module
    paths in --layers (res18's names were once required), and exits 0 when every FAIL is a known
    finding about fovi; --strict exits 1."""
    _no_default_model(monkeypatch)
    python_table = format_fovi_table(verify_fovi_model(TwoLayers(), layers=["second"], batch=1))
    assert python_table.splitlines()[0].split()[3:5] == ["float32", "float64"]
    assert "FAIL" in python_table  # torch_compact's float64 gradients: a known finding
    assert cli_main(_twolayers_argv(tmp_path, "--layers", "second")) == 0
    out = capsys.readouterr().out
    assert python_table in out
    assert "KNNResNet-18" not in out and "Ties and machine flips of this model's graphs" in out
    assert "exit 0: each of the" in out
    assert cli_main(_twolayers_argv(tmp_path, "--layers", "second", "--strict")) == 1
    assert "--strict: any failure exits 1" in capsys.readouterr().out


def test_cli_exits_1_on_a_new_failure_and_names_it(tmp_path, capsys, monkeypatch):
    """A failure no diagnosis and no reproducer explains (here: one check's diagnosis taken
    away) is new: exit 1, and the line under the table names its layer, backend, dtype and
    quantity."""
    _no_default_model(monkeypatch)
    real = fovi_verify.verify_fovi

    def one_undiagnosed(*args, **kwargs):
        checks = real(*args, **kwargs)
        i = next(i for i, c in enumerate(checks) if not c.verdict.ok)
        checks[i] = replace(checks[i], side="undiagnosed", reason="neither side shown wrong")
        return checks

    monkeypatch.setattr(fovi_verify, "verify_fovi", one_undiagnosed)
    assert cli_main(_twolayers_argv(tmp_path, "--layers", "second")) == 1
    out = capsys.readouterr().out
    assert "exit 1: 1 of the" in out
    assert "  second torch_compact float64 " in out and "undiagnosed" in out


def test_cli_refuses_a_layer_its_model_does_not_have(tmp_path, capsys):
    assert cli_main(_twolayers_argv(tmp_path, "--layers", "third")) == 2
    assert "not a KNNConvLayer of this model: third" in capsys.readouterr().err


def test_exit_status_counts_only_failures_no_reproducer_explains():
    checks = verify_fovi_model(TwoLayers(), layers=["second"], batch=1)
    failed = [c for c in checks if not c.verdict.ok]
    assert failed and all(c.dtype == torch.float64 for c in failed)
    assert new_failures(checks) == [] and exit_status(checks) == 0
    assert exit_status(checks, strict=True) == 1
    passed = [c for c in checks if c.verdict.ok]
    assert exit_status(passed) == exit_status(passed, strict=True) == 0
    # Diagnosed on fovi's side, but no script reproduces it (a float64 y of torch_compact): new.
    y_fail = replace(failed[0], quantity="y")
    assert new_failures([y_fail]) == [y_fail] and exit_status([y_fail]) == 1
    # The same quantity on fovi's own baseline has no reproducer either: new.
    baseline = replace(failed[0], backend="baseline")
    assert exit_status([baseline]) == 1


def test_no_machine_finding_skips_the_cpu_graph_comparison(tmp_path, capsys):
    """``--no-machine-finding`` (what scripts/gpu_check.sh runs on a GPU) judges fovi's layers as
    before, records that the CPU graph comparison was not made, and only ``--fovi`` takes it."""
    argv = [
        "--out",
        str(tmp_path),
        "verify",
        "--fovi",
        "--no-machine-finding",
        "--layers",
        "res18_ds4",
        "--dtypes",
        "float32",
        "--batch",
        "1",
    ]
    assert cli_main(argv) == 0
    assert "not compared (asked not to)" in capsys.readouterr().out
    record = json.loads((tmp_path / "verify_fovi.json").read_text())
    assert record["machine_finding"] is None and record["arithmetic"]["device"] == "cpu"
    with pytest.raises(SystemExit):
        cli_main(["verify", "--no-machine-finding", "--layers", "res18_ds4"])
    assert "does not use --no-machine-finding" in capsys.readouterr().err
