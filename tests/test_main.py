"""The main job (python -m fovi_ref) and the measuring helpers it is built on."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import random_meta

from fovi_ref import KNNMeta
from fovi_ref.check import bench
from fovi_ref.check.bench import contenders, layers, timing
from fovi_ref.check.bench.layers import empty_cell_share
from fovi_ref.check.cli import main
from fovi_ref.check.switches import forced_grad_input_path
from fovi_ref.geometry import get_layer
from fovi_ref.strategies import GeneralOps


def test_verify_writes_results_and_passes(tmp_path, capsys):
    code = main(["--out", str(tmp_path), "verify", "--layers", "res18_ds4", "layer4.1.conv1"])
    assert code == 0
    record = json.loads((tmp_path / "verify.json").read_text())
    assert record["arithmetic"]["device"] == "cpu"
    assert record["arithmetic"]["matmul_precision"] == "highest"  # judged without TF32
    rows = record["rows"]
    backends = {(r["layer"], r["backend"]) for r in rows}
    assert ("layer4.0.downsample.0", "gather_gemm") in backends
    assert ("layer4.1.conv1", "general") in backends
    assert all(r[d]["ok"] for r in rows for d in ("float32", "float16", "bfloat16"))
    text = capsys.readouterr().out
    assert "passed, 0 failed" in text and "arithmetic: cpu (" in text


def test_verify_exit_code_reports_failures(tmp_path, monkeypatch):
    """A backend that is subtly wrong must make verify fail."""

    real_forward = GeneralOps.forward_with_operand

    def off_by_a_little(meta, x, weight, bias):
        y, z = real_forward(meta, x, weight, bias)
        return y * (1 + 1e-3), z

    # GeneralOps.forward returns forward_with_operand's y: both doors see the error
    monkeypatch.setattr(GeneralOps, "forward_with_operand", staticmethod(off_by_a_little))
    code = main(["--out", str(tmp_path), "verify", "--layers", "layer4.1.conv1"])
    assert code == 1


def test_bench_writes_ratios(tmp_path):
    args = ["--out", str(tmp_path), "bench", "--layers", "res18_ds4", "layer4.1.conv1"]
    assert main([*args, "--batch", "2", "--batch-general", "2", "--repeats", "1"]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    k1, general = result["k1"], result["general"]
    ds4 = "layer4.0.downsample.0"
    dtypes = ["float32", "float16", "bfloat16"]  # the default: 16-bit rows beside float32
    assert [(r["layer"], r["dtype"]) for r in k1] == [(ds4, d) for d in dtypes]
    assert [r["dtype"] for r in general] == dtypes
    # float32 rows are held to their targets (here the batch-2 ones), bfloat16 rows to theirs,
    # float16 rows to none
    assert set(k1[0]["verdicts"]) == {
        "gather_gemm / conv2d floor",
        "gather_gemm / gemm floor, batch < 256",
    }
    assert k1[1]["verdicts"] == {} == general[1]["verdicts"]
    assert set(k1[2]["verdicts"]) == {"gather_gemm / einsum (fovi), bfloat16"}
    assert set(general[2]["verdicts"]) == {"general / einsum time, bfloat16"}
    assert "general / einsum peak memory" in general[0]["verdicts"]
    assert result["trunk"] == {}  # two layers of twenty: no sum over the layers
    assert set(k1[0]["ms"]) == {
        "gather_gemm",
        "gather_gemm direct",
        "general",
        "einsum (fovi)",
        "conv2d floor",
        "gemm floor",
    }
    assert general[0]["general / einsum peak memory"] > 0
    assert 0 <= general[0]["empty cells"] < 1
    assert (tmp_path / "bench.png").stat().st_size > 0
    csv_rows = (tmp_path / "bench.csv").read_text().splitlines()
    # header, ds4's two float32 targets and one bfloat16, layer4.1.conv1's two and one
    assert len(csv_rows) == 1 + 3 + 3


def test_time_contenders_runs_each_round_robin():
    calls = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = bench.time_contenders(contenders, repeats=3, warmup=1)
    assert set(times) == {"a", "b", "c"} and all(t >= 0 for t in times.values())
    assert calls[:6] == ["a", "b", "c", "b", "c", "a"]  # rotated order each round
    assert len(calls) == 12


def test_peak_memory_sees_a_temporary():
    def make_and_drop():
        t = torch.ones(1024, 1024)  # 4 MiB, freed before returning
        return float(t.sum())

    peak = bench.peak_memory_bytes(make_and_drop)
    assert 4 * 2**20 <= peak < 5 * 2**20


@pytest.mark.parametrize("path", ["dense", "index"])
def test_op_counts_of_gather_gemm_forward_and_backward(path):
    meta = random_meta(1, 1, n_in=40, n_out=30, in_channels=8, padding=False)
    inputs = bench.make_inputs(meta, out_channels=16, batch=4, dtype=torch.float32)
    with forced_grad_input_path(path):
        prof = bench.profile_contender(bench.knn_backend(inputs, "gather_gemm"))
    counts = bench.op_counts(prof)
    gemms = sum(counts.get(op, 0) for op in ("aten::mm", "aten::addmm", "aten::bmm"))
    # forward: 1 GEMM; backward: W^T grad_y, then S (dense path), and grad_weight.
    assert counts["aten::index"] == 1  # the gather; grad_weight reads the rows it kept
    assert gemms == (4 if path == "dense" else 3)
    assert counts.get("aten::index_add_", 0) == (0 if path == "dense" else 1)
    assert counts["aten::sum"] == 1  # grad_bias
    assert bench.op_sequence(prof)[:2] == ["index", "addmm"]  # the forward: no fold copy


def test_batch_scaling_prints_a_row_per_graph_and_batch(capsys):
    args = ["bench", "--batch-scaling", "--layers", "res18_ds4", "--repeats", "1"]
    assert main([*args, "--dtypes", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.startswith("layer4.0.downsample.0")]
    assert "gather_gemm" in row and len(row.split()) == 2 + 5  # a ratio±spread per batch
    assert row.count("±") == 5
    (verdict,) = [line for line in lines if line.startswith("verdict: ")]
    not_met = row.count("!") + row.count("?")  # MISSED or unsure
    assert verdict.endswith(f"{5 - not_met} of 5 cells meet the target")
    assert all(len(line) <= 100 for line in lines)


@pytest.mark.parametrize(
    "args,message",
    [
        (["verify", "--batch", "0"], "--batch: must be at least 1, got 0"),
        (["verify", "--batch", "-1"], "--batch: must be at least 1, got -1"),
        (["bench", "--batch", "0"], "--batch: must be at least 1, got 0"),
        (["bench", "--batch-general", "0"], "--batch-general: must be at least 1"),
        (["bench", "--repeats", "0"], "--repeats: must be at least 1, got 0"),
        (["--device", "nonsense", "verify"], "not a torch device: 'nonsense'"),
        (["verify", "--device", "meta"], "choose cpu or cuda"),
        (["verify", "--layers", "bogus"], "--layers: unknown layer 'bogus'"),
    ],
)
def test_sizes_below_one_and_bad_options_are_argparse_errors(args, message, capsys):
    """Refused before anything runs (a batch of 0 printed "9 passed" and exited 0)."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cuda_without_a_gpu_and_an_unwritable_out_are_refused_first(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        main(["--out", str(blocker / "sub"), "verify", "--layers", "layer4.1.conv1"])
    assert "cannot write there" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["--device", "cuda", "verify"])
        assert "no CUDA GPU is available here" in capsys.readouterr().err


def test_an_interrupted_bench_keeps_the_old_set_whole(tmp_path):
    """A SIGINT while the new files are written leaves the old bench.json/.csv/.png together."""
    from fovi_ref.check.bench.layers import write_set

    for name in ("bench.png", "bench.csv", "bench.json"):
        (tmp_path / name).write_text(f"old {name}")

    def interrupted(path):
        raise KeyboardInterrupt

    writers = {
        "bench.png": interrupted,
        "bench.csv": lambda p: p.write_text("new"),
        "bench.json": lambda p: p.write_text("new"),
    }
    for order in (writers, dict(reversed(writers.items()))):
        with pytest.raises(KeyboardInterrupt):
            write_set(tmp_path, order)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "bench.csv",
            "bench.json",
            "bench.png",
        ]
        assert all(p.read_text() == f"old {p.name}" for p in tmp_path.iterdir())
    write_set(tmp_path, {n: (lambda p: p.write_text("new")) for n in writers})
    assert all(p.read_text() == "new" for p in tmp_path.iterdir())


def test_empty_cell_share_counts_cells_no_real_neighbour_falls_in():
    """Node 0 puts both neighbours in cell 0; node 1 one in cell 1 and a padding neighbour in cell
    2: two of the six (node, cell) pairs hold a real neighbour."""
    knn = torch.tensor([[0, 2], [1, 3]])  # [K=2, Nout=2]; 3 = n_in marks padding
    rf_index = torch.tensor([[0, 0], [1, 2]])  # [Nout, K]
    meta = KNNMeta.from_knn(knn, rf_index, n_in=3, in_channels=2, v=3)
    assert empty_cell_share(meta) == pytest.approx(4 / 6)


def test_the_floor_per_cell_runs_exactly_the_occupied_products():
    """The K > 1 floor's per-cell candidates (the products general runs over occupied cells):
    the graph above occupies cells 0 and 1 at one node each, so each product is two GEMMs of B
    rows (forward ``[B, Cout]``, input gradient ``[B, Cin]``) or two ``[Cout, Cin]`` blocks."""
    knn = torch.tensor([[0, 2], [1, 3]])
    rf_index = torch.tensor([[0, 0], [1, 2]])
    meta = KNNMeta.from_knn(knn, rf_index, n_in=3, in_channels=2, v=3)
    inputs = contenders.make_inputs(meta, out_channels=5, batch=4, dtype=torch.float32)
    products = contenders._per_cell_products(inputs)
    shapes = {name: [tuple(t.shape) for t in run()] for name, run in products.items()}
    assert shapes == {
        "forward": [(4, 5)] * 2,
        "input gradient": [(4, 2)] * 2,
        "weight gradient": [(5, 2)] * 2,
    }
    assert len(contenders.gemm_floor(inputs, trials=1, cells=True)()) == 4  # 3 products, grad_x


def test_the_bench_guide_states_the_empty_cell_shares_the_bench_computes():
    guide = " ".join(bench.__doc__.split())  # help(fovi_ref.check.bench), line breaks aside
    layer1, layer4 = (
        empty_cell_share(get_layer(name).meta) for name in ("layer1.0.conv1", "layer4.0.conv2")
    )
    assert f"({layer1:.0%} on layer1, {layer4:.0%} on layer4.0.conv2)" in guide


def general_row(invalid: list[str]) -> dict:
    """A K > 1 bench row as bench_general builds it, for two layers sharing a graph."""
    names = list(layers.GENERAL_RATIOS)
    row = {
        "layer": "layer4.0.conv1, layer4.1.conv1",
        "K": 9,
        "dtype": "float32",
        "batch": 64,
        "strategy": "occupied_cells",
        "ms": {"general": 12.34},
        "rounds": 5,
        "empty cells": 0.5,
        "general / einsum peak memory": 0.5,
        "invalid": invalid,
        "stopped": "5 rounds",
    }
    for name, value in zip(names, (0.63, 1.40, 0.45, 0.5), strict=True):
        row[name], row["iqr"] = value, {**row.get("iqr", {}), name: (value, value)}
    row["verdicts"] = layers.verdicts(row)
    return row


def test_an_invalid_row_prints_no_number_and_no_name_is_cut(capsys):
    layers.print_general_table([general_row(["general / gemm floor"])])
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("layer4.0.conv1 (+1)")]
    assert line.split()[-2:] == ["0.50", "invalid"]  # memory is counted, not timed
    assert "invalid" in line and not re.search(r"\d\.\d\d±", line) and "12.34" not in line
    assert "layer4.0.conv1 (+1): layer4.0.conv1, layer4.1.conv1" in out
    layers.print_general_table([general_row([])])
    assert "12.34" in capsys.readouterr().out


def test_the_machine_load_line_warns_when_busy():
    quiet = timing.MachineLoad(load=2.0, cores=2, reference_spread=0.03)
    assert not quiet.busy and "BUSY" not in quiet.line()
    assert timing.MachineLoad(4.5, 2, 0.03).busy and timing.MachineLoad(1.0, 2, 0.5).busy
    assert "BUSY" in timing.MachineLoad(4.5, 2, 0.03).line()
    measured = timing.machine_load()
    assert measured.cores >= 1 and measured.reference_spread >= 0


def test_bench_strategies_runs_the_strategies_job_with_the_rounds_given(monkeypatch, tmp_path):
    from fovi_ref.check.bench import strategies

    calls = []
    monkeypatch.setattr(strategies, "run", lambda **kwargs: calls.append(kwargs))
    assert main(["bench", "--strategies", "--out", str(tmp_path)]) == 0
    assert main(["bench", "--strategies", "--out", str(tmp_path), "--repeats", "2"]) == 0
    assert calls == [
        {"out": str(tmp_path), "rounds": strategies.ROUNDS},
        {"out": str(tmp_path), "rounds": 2},
    ]
