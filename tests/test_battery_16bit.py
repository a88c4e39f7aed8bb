"""16-bit defects a GPU kernel can have, planted, and the battery rows that catch them.

- :class:`GradZUnguarded`: ``grad_z = W^T grad_y`` stored in 16 bits with no overflow guard (the
  narrow path before :func:`fovi_ref.precision.store_operand` guarded it). Under a gradient
  scaler's upstream gradients two readers of one input carry ``grad_z`` of opposite sign past
  65504: ``+inf + -inf`` is nan where the exact ``grad_x`` is small.
- :class:`RoundsPerReader`: ``grad_x`` summed one reader at a time in the working dtype, one
  rounding per added term, as a CUDA kernel with 16-bit atomics does. Random signs cancel those
  roundings; terms of one sign pile them up.
- :class:`ScatterBeforeGemm`: ``K = 1``'s ``grad_x = W^T (S grad_y)`` with ``S grad_y`` summed
  first in 16 bits (atomics into the inputs' rows, then one GEMM): upstream gradients of one
  sign and a scaler's size at two readers of one input sum past 65504, inf where ``grad_x`` fits.
- :class:`CellsUnguarded`: ``grad_weight`` bins the cells again and stores them in 16 bits
  unguarded: a float16 cell past 65504 is inf where ``grad_weight`` fits.
- :class:`InfinitiesAsMinusInf`: every inf or nan returned as ``-inf``, its sign lost (a ReLU
  after it turns an overflow into 0).

Each passes where its defect cannot show (the random operands of the oracle check), and the
default battery fails each on a row that names its element (checks ``rounding`` and
``nonfinite``).
"""

from __future__ import annotations

import math

import pytest
import torch

from fovi_ref import KNNMeta, get_ops
from fovi_ref.check.check_ops import (
    CHECKS,
    F16_PAST_MAX_NOTE,
    FITS,
    GRAD_Y_SUMMED_PAST_MAX_NOTE,
    GRAD_Z_PAST_MAX_NOTE,
    ONE_SIGN_NOTE,
    check_ops,
    many_terms,
)
from fovi_ref.check.graphs import SPANNING
from fovi_ref.check.operands import forward_and_grads
from fovi_ref.check.switches import forced
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise
from fovi_ref.knn_gather_gemm import GatherGemmOps
from fovi_ref.knn_general import (
    GeneralTextbookOps,
    bin_entries,
    bin_neighbours,
    derive,
    grad_y_columns,
    unbin,
)
from fovi_ref.segment_sum import accumulation_dtype

pytestmark = pytest.mark.usefixtures("one_thread")

F16, BF16 = torch.float16, torch.bfloat16
GENERAL = get_ops("general")
OURS = ("general", "general_textbook", "gather_gemm")
K1 = ["downsample", "downsample_wide", "downsample_nin_1", "downsample_hub_150"]
HUBS = ["hub_40", "hub_150", "hub_1100"]


class GradZUnguarded(GeneralTextbookOps):
    """The textbook with ``grad_z`` computed in float32 and stored in ``grad_y``'s dtype, fit or
    not (float16 past 65504 becomes inf)."""

    name = "grad_z_unguarded"

    @staticmethod
    def grad_input(meta, grad_y, weight):
        data = meta.derived(GeneralTextbookOps.name, derive)
        grad_z = weight.t().float() @ grad_y_columns(grad_y).float()  # [Cin*V, Nout*B]
        return unbin(meta, data, grad_z.to(grad_y.dtype), grad_y.shape[0], grad_y.dtype)


class RoundsPerReader(GeneralTextbookOps):
    """The textbook with ``grad_x`` summed in ``grad_y``'s dtype: ``grad_z`` (float32) added to
    ``grad_x`` one reader of each input at a time, each add rounded (as 16-bit atomics do)."""

    name = "rounds_per_reader"

    @staticmethod
    def grad_input(meta, grad_y, weight):
        batch = grad_y.shape[0]
        grad_z = weight.t().float() @ grad_y_columns(grad_y).float()  # [Cin*V, Nout*B]
        grad_z_rows = grad_z.view(meta.in_channels * meta.v * meta.n_out, batch)  # rows (c, v, n)
        z_row, x_row = bin_entries(meta)  # [Cin*E] each: which grad_z row reaches which x row
        order = torch.argsort(x_row, stable=True)
        z_row, x_row = z_row[order], x_row[order]  # grouped by input row (c, i)
        readers = torch.bincount(x_row, minlength=meta.in_channels * meta.n_in)  # [Cin*Nin]
        rank = torch.arange(x_row.numel()) - (readers.cumsum(0) - readers)[x_row]  # [Cin*E]
        grad_x = grad_y.new_zeros(meta.in_channels * meta.n_in, batch)  # [Cin*Nin, B]
        for r in range(int(readers.max()) if readers.numel() else 0):
            at = rank == r  # each input's r-th reader (at most one per row)
            grad_x[x_row[at]] = (grad_x[x_row[at]] + grad_z_rows[z_row[at]]).to(
                grad_x.dtype
            )  # rounded
        return grad_x.t().reshape(batch, meta.in_channels, meta.n_in)


class ScatterBeforeGemm(GatherGemmOps):
    """gather_gemm with ``grad_x = W^T (S grad_y)``: ``S grad_y`` summed first into a
    ``[B, Cout, Nin]`` buffer in ``grad_y``'s dtype (``index_add_``, as atomics into the inputs'
    rows), then one GEMM (in float32 for 16 bits)."""

    name = "scatter_before_gemm"

    @staticmethod
    def grad_input(meta, grad_y, weight):
        data = meta.derived(GatherGemmOps.name, GatherGemmOps.derive)
        sent = grad_y.index_fill(2, data["padding"], 0)  # [B, Cout, Nout]: padding sends nothing
        summed = grad_y.new_zeros(*grad_y.shape[:2], meta.n_in)  # [B, Cout, Nin], grad_y's dtype
        summed.index_add_(2, data["index"], sent)  # S grad_y, stored in grad_y's dtype
        acc = accumulation_dtype(grad_y.dtype)
        return (weight.t().to(acc) @ summed.to(acc)).to(grad_y.dtype)  # [B, Cin, Nin]


class CellsUnguarded(GeneralTextbookOps):
    """The textbook whose weight gradient keeps ``x``, bins the cells again (summed in float32)
    and stores them in ``x``'s dtype, fit or not (float16 past 65504 is inf), before its GEMM;
    ``y`` and ``grad_x`` are the textbook's."""

    name = "cells_unguarded"

    @staticmethod
    def forward_with_operand(meta, x, weight, bias):
        return GeneralTextbookOps.forward(meta, x, weight, bias), x

    @staticmethod
    def grad_weight(meta, grad_y, x):
        data = meta.derived(GeneralTextbookOps.name, derive)
        z = bin_neighbours(meta, data, x)  # [Cin*V, Nout*B], summed in float32 for 16 bits
        stored = z.to(x.dtype).to(z.dtype)  # the unguarded store
        return (grad_y_columns(grad_y).to(z.dtype) @ stored.t()).to(grad_y.dtype)  # [Cout, Cin*V]

    grad_weight_of_operand = grad_weight


def _as_minus_inf(result: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(result), result, -math.inf)


class InfinitiesAsMinusInf:
    """general with every inf or nan of its results returned as ``-inf``."""

    name = "infinities_as_minus_inf"

    @staticmethod
    def forward(meta, x, weight, bias):
        return _as_minus_inf(GENERAL.forward(meta, x, weight, bias))

    @staticmethod
    def grad_input(meta, grad_y, weight):
        return _as_minus_inf(GENERAL.grad_input(meta, grad_y, weight))

    @staticmethod
    def grad_weight(meta, grad_y, x):
        return _as_minus_inf(GENERAL.grad_weight(meta, grad_y, x))


def _all_but(check: str) -> list[str]:
    """Every check of the battery but ``check`` (the one where a planted defect shows)."""
    return [c for c in CHECKS if c != check]


def _rows(report, note):
    return [r for r in report.rows if r.note.endswith(note)]


def test_many_terms_takes_the_hubs_and_the_long_sums_of_batch_and_nodes():
    from fovi_ref.check.graphs import spanning_graph

    taken = {
        g for g in SPANNING if many_terms(spanning_graph(g).meta, spanning_graph(g).batch or 3)
    }
    assert {"hub_150", "hub_1100", "downsample_hub_150", "batch_129", "nout_129"} <= taken
    assert not {"base", "hub_40", "cin_129", "cout_129"} & taken


@pytest.mark.parametrize("gemms", ["wide", "narrow"])
def test_an_unguarded_float16_grad_z_fails_the_rounding_check_and_names_its_element(gemms):
    """Both general's paths keep the exact, small grad_x of an input two nodes read under
    upstream gradients of 40,000 and -39,936; grad_z stored in float16 makes it nan."""
    graphs = ["base", "nout_33", "downsample", "hub_40", "hub_150"]
    kwargs = dict(graphs=graphs, dtypes=[F16], checks=["rounding"])
    with forced(gemms):
        for backend in OURS:
            report = check_ops(backend, **kwargs)
            assert report.ok and _rows(report, GRAD_Z_PAST_MAX_NOTE), report
        report = check_ops(GradZUnguarded, **kwargs)
    failed = {r.graph: r for r in _rows(report, GRAD_Z_PAST_MAX_NOTE) if not r.ok}
    assert set(failed) == set(graphs), report
    for row in failed.values():
        assert row.quantity == "grad_x" and "non-finite mismatches" in row.note
        assert row.value != row.value and abs(row.oracle) < 2**12  # nan where the answer is small
        assert row.where.startswith(f"input {row.index[2]} of ") and "read by" in row.where
        assert f"at grad_x{list(row.index)}" in report.table(report.failures)
    assert failed["hub_40"].where.startswith("input 0 of 8, read by 42 entries")  # the hub
    assert failed["hub_150"].where.startswith("input 0 of 8, read by 159 entries")


@pytest.mark.parametrize(
    ("readers", "weight", "pair"),
    [
        (2, 1024.0, (40000.0, -39968.0)),
        (40, 2.0, (40000.0, -39936.0)),
        (512, 2.0, (40000.0, -39936.0)),
    ],
)
def test_an_unguarded_grad_z_fails_however_many_readers_share_the_input(readers, weight, pair):
    """One input read by every node, upstream gradients of a gradient scaler's size alternating
    in sign (float16, exact): each ``grad_z`` is past 65504 and the exact ``grad_x`` fits in
    float16, ``weight * (pair sum) * readers / 2``: 32768 for two readers and a weight of 1024
    (no hub needed), 2560 for 40 and 32768 for 512 with weights 2. A nan there fails, however
    large the allowance for stored intermediates has grown: in all three ``grad_x`` plus
    ``gamma_F(u) M`` (about 80,000, 64,000 and 14 million) reaches float16's overflow."""
    meta = KNNMeta.from_knn(
        torch.zeros(1, readers, dtype=torch.long),
        torch.zeros(readers, 1, dtype=torch.long),
        n_in=1,
        in_channels=1,
        v=1,
    )
    x = torch.ones(1, 1, 1, dtype=F16)  # [B, Cin, Nin]
    w = torch.full((1, 1), weight, dtype=F16)  # [Cout, Cin*V]
    gy = torch.tensor(pair, dtype=F16).repeat(readers // 2).view(1, 1, readers)  # [B, Cout, Nout]
    expected = expected_quantities(x, w, None, meta, gy)["grad_x"]
    assert expected.value.item() == weight * sum(pair) * readers / 2 <= 2**15
    for gemms in ("wide", "narrow"):
        with forced(gemms):
            for backend in OURS:
                got = forward_and_grads(x, w, None, meta, gy, backend)[1]
                assert judge_elementwise(got, expected, dtype=F16).ok
            got = forward_and_grads(x, w, None, meta, gy, GradZUnguarded)[1]
        verdict = judge_elementwise(got, expected, dtype=F16)
        assert got.isnan().all() and not verdict.ok and verdict.nonfinite_mismatches == 1, verdict


def test_grad_y_summed_in_float16_before_the_gemm_fails_on_the_k1_graphs():
    """Random upstream gradients (every other check) fit in the buffer. Gradients of 40,000 and
    one sign at every node make ``S grad_y`` inf at every input two nodes read, where the exact
    ``grad_x`` is at most 2^14; fovi_ref's backends sum ``W^T grad_y`` instead, on both paths,
    and the case runs on the hubs too. bfloat16 (float32's range) has no such case."""
    kwargs = dict(dtypes=[F16, BF16], checks=["rounding"])
    others = _all_but("rounding")
    assert check_ops(ScatterBeforeGemm, graphs=K1, dtypes=[F16, BF16], checks=others).ok
    for gemms in ("wide", "narrow"):
        with forced(gemms):
            for backend in OURS:
                report = check_ops(backend, graphs=[*K1, "k_1", *HUBS], **kwargs)
                summed = _rows(report, GRAD_Y_SUMMED_PAST_MAX_NOTE)
                assert report.ok and {r.dtype for r in summed} == {"float16"}, report
                assert {r.graph for r in summed} >= set(K1), report
            report = check_ops(ScatterBeforeGemm, graphs=K1, **kwargs)
        failed = report.failures
        assert {r.graph for r in failed} == set(K1), report
        assert all(r.note.endswith(GRAD_Y_SUMMED_PAST_MAX_NOTE) for r in failed), report
        for row in failed:
            assert row.quantity == "grad_x" and "non-finite mismatches" in row.note
            assert row.value == math.inf and 0 < row.oracle <= FITS  # inf where float16 holds it
            assert row.where.startswith(f"input {row.index[2]} of ") and "read by" in row.where
            assert int(row.where.split("read by ")[1].split()[0]) >= 2  # a collision
            assert f"at grad_x{list(row.index)}" in report.table(report.failures)


def test_cells_stored_unguarded_for_grad_weight_fail_the_rounding_check():
    """The cell-past-65504 operands with ``grad_y`` scaled so that the exact weight gradient
    fits: a cell recomputed and stored in float16 makes its columns inf or nan. ``y`` and
    ``grad_x`` are right, and every other check, whose cells fit, passes."""
    kwargs = dict(graphs=["base", "nout_33", "v_33", "hub_40"], dtypes=[F16, BF16])
    assert check_ops(CellsUnguarded, checks=_all_but("rounding"), **kwargs).ok
    for gemms in ("wide", "narrow"):
        with forced(gemms):
            for backend in ("general", "general_textbook"):
                report = check_ops(backend, checks=["rounding"], **kwargs)
                past_max = _rows(report, F16_PAST_MAX_NOTE)
                assert report.ok and {r.quantity for r in past_max} == {"y", "grad_weight"}
            report = check_ops(CellsUnguarded, checks=["rounding"], **kwargs)
        failed = report.failures
        assert {r.graph for r in failed} == {"base", "nout_33", "v_33", "hub_40"}, report
        assert all(r.note.endswith(F16_PAST_MAX_NOTE) for r in failed), report
        for row in failed:
            assert row.quantity == "grad_weight" and row.dtype == "float16"
            assert not math.isfinite(row.value) and abs(row.oracle) <= FITS
            assert row.where.startswith("channel ") and ", cell " in row.where
            assert f"at grad_weight{list(row.index)}" in report.table(report.failures)


def test_an_infinity_of_the_wrong_sign_fails_the_nonfinite_check():
    """An inf in ``x`` reaches ``y`` as +inf or -inf by its weights' signs, and nan where the
    two meet; a backend that returns every one of them as -inf fails where the oracle says +inf
    or nan, in every dtype (general wide, so that only the planted defect differs). Where every
    result is finite it is general; check ``rounding``'s float16 overflows fail it too."""
    kwargs = dict(graphs=["base", "downsample"], checks=["nonfinite"])
    with forced("wide"):
        assert check_ops("general", **kwargs).ok
        assert check_ops(InfinitiesAsMinusInf, graphs=["base"], checks=["oracle", "doors"]).ok
        report = check_ops(InfinitiesAsMinusInf, **kwargs)
    failed = report.failures
    assert {r.dtype for r in failed} == {"float64", "float32", "float16", "bfloat16"}, report
    for row in failed:
        assert "non-finite mismatches" in row.note and row.value == -math.inf
        assert row.oracle != row.value and not math.isfinite(row.oracle)
        assert f"at {row.quantity}{list(row.index)}" in report.table(report.failures)


def test_gather_gemms_dense_scatter_keeps_a_float16_grad_z_past_65504_too():
    from fovi_ref.check.switches import forced_grad_input_path

    kwargs = dict(graphs=["downsample", "downsample_hub_150"], dtypes=[F16], checks=["rounding"])
    with forced("narrow"), forced_grad_input_path("dense"):
        report = check_ops("gather_gemm", **kwargs)
    assert report.ok and _rows(report, GRAD_Z_PAST_MAX_NOTE), report


def test_a_grad_x_rounded_once_per_reader_fails_on_operands_of_one_sign_at_the_hubs():
    """Random signs hide it (the oracle check passes); one sign piles its roundings up: many
    times the bound in bfloat16 at 1,100 readers, and past it in float16."""
    kwargs = dict(graphs=["hub_150", "hub_1100"], dtypes=[F16, BF16])
    assert check_ops(RoundsPerReader, checks=["oracle"], **kwargs).ok
    for gemms in ("wide", "narrow"):
        with forced(gemms):
            assert check_ops("general", checks=["rounding"], **kwargs).ok
    report = check_ops(RoundsPerReader, checks=["rounding"], **kwargs)
    failed = {(r.graph, r.dtype): r for r in _rows(report, ONE_SIGN_NOTE) if not r.ok}
    assert {r.quantity for r in failed.values()} == {"grad_x"}
    assert failed[("hub_1100", "bfloat16")].ratio > 10 and failed[("hub_1100", "float16")].ratio > 2
    assert ("hub_150", "bfloat16") in failed  # past 128 readers: judged with h = 1
    row = failed[("hub_1100", "bfloat16")]
    assert row.index == (row.index[0], 0, 0) and row.where.startswith("input 0 of 16, read by ")
    assert row.value < row.oracle  # the later readers' terms are lost


def test_the_default_battery_fails_every_planted_defect():
    """The whole default battery, as ``python -m fovi_ref check`` runs it (in the dtypes and
    the checks where each defect shows)."""
    for ops, note in (
        (GradZUnguarded, GRAD_Z_PAST_MAX_NOTE),
        (RoundsPerReader, ONE_SIGN_NOTE),
        (ScatterBeforeGemm, GRAD_Y_SUMMED_PAST_MAX_NOTE),
        (CellsUnguarded, F16_PAST_MAX_NOTE),
    ):
        report = check_ops(ops, dtypes=[F16, BF16], checks=["rounding"])
        assert any(not r.ok for r in _rows(report, note)), report.summary()
    with forced("wide"):
        report = check_ops(InfinitiesAsMinusInf, dtypes=[F16, BF16], checks=["nonfinite"])
    assert not report.ok, report.summary()
