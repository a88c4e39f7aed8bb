"""``python -m fovi_ref bench --fovi``: the rows and the table come out (timings not judged)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "fovi",
    reason="fovi 2.4.0 is not installed: pip install --no-deps -r scripts/fovi-requirements.txt",
)

from fovi_ref.check.bench import fovi  # noqa: E402


def test_bench_fovi_rows_and_table(tmp_path, capsys):
    args = SimpleNamespace(
        layers=["layer4.0.conv2", "layer4.1.conv2", "res18_ds4"],
        batch_general=2,
        repeats=1,
        device="cpu",
        dtype=["float32"],
        out=str(tmp_path),
    )
    assert fovi.run(args) == 0
    rows = json.loads((tmp_path / "bench_fovi.json").read_text())["rows"]
    assert [r["layers"] for r in rows] == [
        ["layer4.0.conv2", "layer4.1.conv2"],  # one graph and width: timed once
        ["layer4.0.downsample.0"],
    ]
    assert [r["route"] for r in rows] == ["general", "gather_gemm"]
    assert {r["dispatch"] for r in rows} == {"baseline"}  # CPU with gradients
    assert "fovi gather_gemm" in rows[1]["ms"] and "fovi gather_gemm" not in rows[0]["ms"]
    for r in rows:
        assert r["fovi_ref / best fovi"] > 0 and r["best fovi"] in r["ms"]
    out = capsys.readouterr().out
    table = out[out.index("layer ") :]
    assert "layer4.0.conv2 +1" in table and "ref/best" in table
    assert max(len(line) for line in out.splitlines()) <= 100
