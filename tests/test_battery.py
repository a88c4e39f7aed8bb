"""The battery reaches every scale and every door, and a failing row says where and replays.

Each bug class below was a PASS of the earlier battery (graphs up to 20 outputs, K 9, Cin >= 2,
fan-out 8, batch 3, the eager door only). Each is planted by scripts/mutations/planted_bugs.py and
must fail on a graph of the default battery, while the clean backend passes the same case.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import load_script
from test_testing_check_ops import ZeroesEmptyNodes

from fovi_ref import available_ops, get_ops
from fovi_ref.check.check_ops import (
    CHECKS,
    DEFAULT,
    F16_PAST_MAX_NOTE,
    OpsReport,
    ReportRow,
    check_ops,
)
from fovi_ref.check.graphs import BOUNDARIES, SPANNING, graph_seed, spanning_graph
from fovi_ref.segment_sum import SegmentSumPlan

pytestmark = pytest.mark.usefixtures("one_thread")

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16


PLANTED_BUGS = load_script("scripts/mutations/planted_bugs.py")

# bug class -> (a default-battery graph that triggers it, dtype, check that must catch it)
CAUGHT_BY = {
    "off_past_64_nodes": ("nout_65", F64, "oracle"),
    "wrong_past_batch_4": ("batch_5", F32, "oracle"),
    "hub_grad_x_off": ("hub_40", F64, "oracle"),
    "plain_forward_wrong": ("base", F64, "doors"),
    "dropped_past_k_9": ("k_10", F64, "oracle"),
    "off_at_one_channel": ("cin_1", F64, "oracle"),
    "last_input_grad_x_zeroed": ("nout_31", F64, "oracle"),
    "bf16_grad_x_zeroed": ("hub_150", BF16, "oracle"),
    "bf16_grad_x_flipped": ("hub_150", BF16, "oracle"),
    "off_past_16_cells": ("v_17", F64, "oracle"),
    "grad_weight_off_past_batch_64": ("batch_65", F64, "oracle"),
    "grad_weight_from_x_wrong": ("base", F64, "doors"),
    "cells_summed_in_dtype": ("nout_33", BF16, "rounding"),
}


def test_the_default_battery_is_the_spanning_graphs_and_they_hold_every_boundary():
    assert DEFAULT == ("spanning",)
    graphs = {name: spanning_graph(name) for name in SPANNING}
    sizes = {
        "n_out": {g.meta.n_out for g in graphs.values()},
        "n_in": {g.meta.n_in for g in graphs.values()},
        "cin": {g.meta.in_channels for g in graphs.values()},
        "cout": {g.out_channels for g in graphs.values()},
        "batch": {g.batch for g in graphs.values() if g.batch is not None},
    }
    for axis, seen in sizes.items():
        assert set(BOUNDARIES) <= seen, f"{axis}: {sorted(set(BOUNDARIES) - seen)} missing"
    assert {4, 5} <= sizes["batch"]
    assert max(g.meta.k for g in graphs.values()) >= 40
    assert max(g.meta.v for g in graphs.values()) > 16
    fan_out = {
        name: int(torch.bincount(g.meta.knn[~g.meta.pad_mask], minlength=g.meta.n_in).max())
        for name, g in graphs.items()
    }
    assert max(fan_out.values()) > 1000 and any(32 < f < 100 for f in fan_out.values())
    for name, g in graphs.items():
        if name != "base":  # base keeps unread inputs for the padding check
            read = g.meta.knn[~g.meta.pad_mask]
            assert {0, g.meta.n_in - 1} <= set(read.tolist()), name
        assert g.meta.has_padding, name


# general's strategies, told apart by the segment-sum plans they read (fovi_ref.strategies)
PLAN_PATHS = {
    "node_bin": "node rows",
    "node_unbin": "node rows",
    "bin": "channel rows",
    "unbin": "channel rows",
    "block_unbin": "channel blocks",
    "block_rest_unbin": "a smaller last block",
    "cell_bin": "per-cell GEMMs",
    "cell_unbin": "per-cell GEMMs",
}
PATHS = (
    "node rows",
    "channel rows",
    "channel blocks",
    "a smaller last block",
    "per-cell GEMMs",
    "hub trees",
)


def paths_reached(names, monkeypatch) -> dict[str, set[str]]:
    """Which of :data:`PATHS` general takes on each graph, under the oracle and doors checks."""
    hits: set[str] = set()
    from_derived = SegmentSumPlan.from_derived.__func__

    def plan_spy(cls, data, prefix):  # a plan is read right before its sum runs
        hits.add(PLAN_PATHS[prefix])
        plan = from_derived(cls, data, prefix)
        if plan.tree_dst.numel():
            hits.add("hub trees")
        return plan

    monkeypatch.setattr(SegmentSumPlan, "from_derived", classmethod(plan_spy))
    reached = {}
    for name in names:
        hits.clear()
        check_ops("general", graphs=[name], dtypes=[F32], checks=["oracle", "doors"])
        reached[name] = set(hits)
    return reached


def test_general_reaches_every_internal_path_under_the_default_battery(monkeypatch):
    reached = paths_reached(SPANNING, monkeypatch)
    by_path = {path: [g for g, paths in reached.items() if path in paths] for path in PATHS}
    print("\n".join(f"{path}: {' '.join(graphs)}" for path, graphs in by_path.items()))
    missing = [path for path, graphs in by_path.items() if not graphs]
    assert not missing, f"no graph of the default battery reaches {missing}: {by_path}"
    assert "node rows" in reached["base"] and "channel rows" in reached["batch_5"]
    assert {"channel blocks", "a smaller last block"} <= reached["channel_blocks"]
    assert "per-cell GEMMs" in reached["occupied_cells"]
    assert "hub trees" in reached["hub_1100"]


@pytest.mark.parametrize("kind", sorted(CAUGHT_BY))
def test_each_bug_class_fails_a_default_graph_and_the_clean_backend_passes_it(kind):
    graph, dtype, check = CAUGHT_BY[kind]
    assert graph in SPANNING
    kwargs = dict(graphs=[graph], dtypes=[dtype], checks=[check])
    assert check_ops("general", **kwargs).ok
    mutant = PLANTED_BUGS.Mutant(get_ops("general"), kind, PLANTED_BUGS.MUTATIONS[kind])
    report = check_ops(mutant, **kwargs)
    assert mutant.applied and not report.ok, report


def test_a_float16_cell_past_65504_under_a_finite_y_fails_the_rounding_check():
    """general's channel rows kept in float16 (a mutant of knn_general's bin_neighbours) passed
    every other row: a cell summed or stored in float16 overflows only past 65504."""
    kwargs = dict(graphs=["base"], dtypes=[F16], checks=["rounding"])
    assert check_ops("general", **kwargs).ok
    mutant = PLANTED_BUGS.Mutant(get_ops("general"), "cells_summed_in_dtype", "")
    past_max = [r for r in check_ops(mutant, **kwargs).rows if r.note.endswith(F16_PAST_MAX_NOTE)]
    assert [(r.quantity, r.ok) for r in past_max] == [("y", False), ("grad_weight", False)]
    assert all("non-finite mismatches" in r.note for r in past_max), past_max


def test_a_16_bit_gradient_at_a_hub_is_judged_by_the_float32_accumulation_rule():
    """At 150 readers in bfloat16 the h-store bound reaches |ref|: those elements are judged
    with h = 1, and the row says so; general accumulates in float32 and passes."""
    report = check_ops("general", graphs=["hub_150"], dtypes=[BF16], checks=["oracle"])
    (row,) = [r for r in report.rows if r.quantity == "grad_x"]
    assert row.ok and "judged with h = 1" in row.note, row


def test_a_failing_row_names_its_element_and_its_replay_runs_that_case_again():
    mutant = PLANTED_BUGS.Mutant(get_ops("general"), "off_past_64_nodes", "")
    report = check_ops(mutant, graphs=["base", "nout_65"], dtypes=[F64], checks=["oracle"])
    (row,) = [r for r in report.failures if r.quantity == "y"]
    assert row.graph == "nout_65" and row.index is not None and len(row.index) == 3
    assert row.where.startswith(f"node {row.index[2]}, ")
    assert row.value is not None and row.oracle is not None and row.bound is not None
    assert math.isclose(abs(row.value - row.oracle), row.ratio * row.bound, rel_tol=1e-6)
    again = eval(row.replay, {"check_ops": check_ops, "ops": mutant, "torch": torch})
    (same,) = [r for r in again.failures if r.quantity == "y"]
    assert same == row  # the same case: seeds come from the graph's name
    assert f"at y{list(row.index)}" in report.table(report.failures)


def test_ratios_print_readably_and_an_exact_rule_failure_is_not_0_00():
    row = ReportRow("g", "float32", "oracle", "y", False, ratio=318313729649889280.0)
    text = OpsReport("x", [row]).table()
    assert "3.18e+17" in text and "318313729649889280" not in text
    report = check_ops(ZeroesEmptyNodes, graphs=["base"], dtypes=[F32], checks=["padding"])
    (row,) = report.failures
    assert row.quantity == "y" and row.ratio == math.inf and row.bound == 0.0
    assert row.value == 0.0 and row.oracle != 0.0 and row.where.startswith("node 11, 0 real")
    assert "0.00" not in report.table()


def test_the_seed_of_a_graph_comes_from_its_name():
    alone = check_ops("general", graphs=["nout_33"], dtypes=[F32], checks=["oracle"])
    among = check_ops("general", graphs=["base", "nout_33"], dtypes=[F32], checks=["oracle"])
    assert alone.rows == [r for r in among.rows if r.graph == "nout_33"]
    assert graph_seed("nout_33") != graph_seed("nout_32")


def test_every_check_has_a_row_for_general():
    # base holds every calling convention; nout_33 a cell of three neighbours (rounding)
    report = check_ops("general", graphs=["base", "nout_33"], dtypes=[F64, BF16])
    assert report.ok, report.table(report.failures)
    assert {r.check for r in report.rows} == set(CHECKS)
    doors = {r.note for r in report.rows if r.check == "doors"}
    alone = {f"custom op, {q} alone asked for" for q in ("grad_x", "grad_weight", "grad_bias")}
    assert doors == {"plain forward (no_grad)", "custom op (the compiled door)", *alone}


def test_every_backend_has_default_graphs_it_takes():
    """gather_gemm takes K = V = 1 graphs only: the default battery once judged it on none
    (every row "skipped"), and each of its mutants passed (scripts/mutations)."""
    for name in available_ops():
        supports = getattr(get_ops(name), "supports", None)
        taken = [g for g in SPANNING if supports is None or supports(spanning_graph(g).meta)]
        assert len(taken) >= 2, (name, taken)
