"""``python -m fovi_ref check``: a validator's front door, and its exit status."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from conftest import DEVICES, ROOT

from fovi_ref.check.cli import main

QUICK = ["--graphs", "nout_65", "--dtypes", "float64", "--checks", "oracle", "doors"]

WRONG_PAST_64 = '''
from fovi_ref import get_ops


class WrongPast64:
    """general, with y 1% off where Nout > 64 (right on every graph of the old battery)."""

    name = "wrong_past_64"

    @staticmethod
    def forward(meta, x, weight, bias):
        y = get_ops("general").forward(meta, x, weight, bias)
        return y * 1.01 if meta.n_out > 64 else y

    @staticmethod
    def grad_input(meta, grad_y, weight):
        return get_ops("general").grad_input(meta, grad_y, weight)

    @staticmethod
    def grad_weight(meta, grad_y, x):
        return get_ops("general").grad_weight(meta, grad_y, x)


class NoGradients:
    name = "no_gradients"

    forward = WrongPast64.forward
'''


@pytest.fixture
def backend_file(tmp_path):
    path = tmp_path / "my_backend.py"
    path.write_text(textwrap.dedent(WRONG_PAST_64))
    return path


def test_a_registered_backend_and_a_module_object_pass_with_exit_0(capsys, tmp_path):
    out = tmp_path / "report.json"
    assert main(["check", "general", *QUICK, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("check 'general': protocol PASS; graphs nout_65")
    assert "oracle 3/3, doors 5/5" in text and ": PASS in " in text
    assert json.loads(out.read_text())["ok"] is True
    assert main(["check", "fovi_ref.knn_general:GeneralTextbookOps", *QUICK]) == 0


def test_a_wrong_backend_from_a_file_fails_with_exit_1_naming_the_element(capsys, backend_file):
    assert main(["check", f"{backend_file}:WrongPast64", *QUICK]) == 1
    text = capsys.readouterr().out
    assert "nout_65" in text and "FAIL" in text and "at y[" in text and "(node " in text
    assert "replay: check_ops(ops, graphs=['nout_65'], dtypes=[torch.float64]" in text
    assert re.search(r"\d+ failed \(1 graphs\): FAIL in \d+ s$", text.rstrip())


def test_the_protocol_is_checked_first_and_a_bad_object_exits_2(capsys, backend_file):
    assert main(["check", f"{backend_file}:NoGradients", *QUICK]) == 1
    assert capsys.readouterr().out.startswith("protocol: FAIL: ops 'no_gradients': grad_input")
    assert main(["check", f"{backend_file}:Missing"]) == 2
    assert "has no 'Missing'" in capsys.readouterr().out
    assert main(["check", "no_such_backend"]) == 2
    assert "expected FILE.py:NAME or MODULE:NAME" in capsys.readouterr().out


# ------------------------------------------------------------------------------- --device
@pytest.mark.parametrize("device", DEVICES)
def test_device_runs_the_battery_there_and_the_report_names_its_arithmetic(
    device, capsys, tmp_path
):
    """``--device`` puts the battery on that device; the header and the JSON name it, and the
    verdicts were reached without TF32 or 16-bit split-K reductions (arithmetic.py)."""
    out = tmp_path / "report.json"
    args = ["check", "general", *QUICK, "--device", device, "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith(
        f"check 'general': protocol PASS; graphs nout_65, dtypes float64 on {device}"
    )
    assert f"arithmetic: {device} (" in text
    arithmetic = json.loads(out.read_text())["arithmetic"]
    assert arithmetic["device"] == device and arithmetic["matmul_precision"] == "highest"
    assert arithmetic["bf16_reduced_precision_reduction"] in (False, None)
    assert main(["--device", device, "check", "general", *QUICK]) == 0  # the top-level spelling
    assert f"dtypes float64 on {device}" in capsys.readouterr().out


def test_device_refuses_a_device_this_machine_lacks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "general", "--device", "mps"])
    assert exit_info.value.code == 2
    assert "choose cpu or cuda" in capsys.readouterr().err


def test_the_announced_battery_times_are_the_last_measured_ones():
    """``check --help`` and the README state the times scripts/time_battery.py last measured
    (``make battery-times``), rounded: the default battery to 5 s, ``--full`` to the minute."""
    from fovi_ref.check.check_command import DEFAULT_SECONDS, FULL_SECONDS

    record = json.loads((ROOT / "fovi_ref/check/battery_times.json").read_text())
    assert 5 * round(record["default_seconds"] / 5) == DEFAULT_SECONDS
    assert 60 * round(record["full_seconds"] / 60) == FULL_SECONDS
    readme = (ROOT / "README.md").read_text()
    assert f"about {DEFAULT_SECONDS} s" in readme and f"about {FULL_SECONDS // 60} min" in readme
