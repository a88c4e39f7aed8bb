"""Two 16-bit defects a GPU user meets, planted, and the battery rows that catch them.

- :class:`GradZUnguarded`: ``grad_z = W^T grad_y`` stored in 16 bits with no overflow guard (the
  narrow path before :func:`fovi_ref.precision.store_operand` guarded it). Under a gradient
  scaler's upstream gradients two readers of one input carry ``grad_z`` of opposite sign past
  65504: ``+inf + -inf`` is nan where the exact ``grad_x`` is small.
- :class:`RoundsPerReader`: ``grad_x`` summed one reader at a time in the working dtype, one
  rounding per added term, as a CUDA kernel with 16-bit atomics does. Random signs cancel those
  roundings; terms of one sign pile them up.

Both fail the default battery (check ``rounding``), each on a row that names its element.
"""

from __future__ import annotations

import pytest
import torch

from fovi_ref.check.bench.gemm_dtypes import forced
from fovi_ref.check.check_ops import (
    GRAD_Z_PAST_MAX_NOTE,
    ONE_SIGN_NOTE,
    check_ops,
    many_terms,
)
from fovi_ref.check.graphs import SPANNING
from fovi_ref.knn_general import GeneralTextbookOps, bin_entries, derive, grad_y_columns, unbin

pytestmark = pytest.mark.usefixtures("one_thread")

F16, BF16 = torch.float16, torch.bfloat16


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
    kwargs = dict(graphs=["base", "nout_33", "downsample"], dtypes=[F16], checks=["rounding"])
    with forced(gemms):
        for backend in ("general", "general_textbook", "gather_gemm"):
            report = check_ops(backend, **kwargs)
            assert report.ok and _rows(report, GRAD_Z_PAST_MAX_NOTE), report
    report = check_ops(GradZUnguarded, **kwargs)
    failed = [r for r in _rows(report, GRAD_Z_PAST_MAX_NOTE) if not r.ok]
    assert {r.graph for r in failed} == {"base", "nout_33", "downsample"}, report
    row = failed[0]
    assert row.quantity == "grad_x" and "non-finite mismatches" in row.note
    assert row.value != row.value and abs(row.oracle) < 2**10  # nan where the answer is small
    assert row.where.startswith(f"input {row.index[2]} of ") and "read by" in row.where
    assert f"at grad_x{list(row.index)}" in report.table(report.failures)


def test_gather_gemms_dense_scatter_keeps_a_float16_grad_z_past_65504_too():
    from fovi_ref.check.bench.budget import forced_grad_input_path

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


def test_the_default_battery_fails_both_planted_defects():
    """The whole default battery in 16 bits, as ``python -m fovi_ref check`` runs it."""
    for ops, note in ((GradZUnguarded, GRAD_Z_PAST_MAX_NOTE), (RoundsPerReader, ONE_SIGN_NOTE)):
        report = check_ops(ops, dtypes=[F16, BF16], checks=["rounding"])
        assert any(not r.ok for r in _rows(report, note)), report.summary()
