"""Strategy *node rows*: the textbook's sums over rows of one node, for few samples.

The textbook (:mod:`fovi_ref.knn_general`) moves *channel rows* of ``B`` values. At a small batch
such a row is too short to pay for its index entry. Here a row is one node holding all its
``B*Cin`` values, ``x`` as ``[Nin, B*Cin]`` (how fovi's layout stores each sample), so the plans
list one channel's entries: ``Cin`` times fewer, the same rows added in the same order. The sums
are the textbook's bit for bit; only the layout of the GEMM's operand changes::

    z_nodes [V*Nout, B*Cin]  = segment sum of x_nodes [Nin, B*Cin]       (plan "node_bin")
    z_rows  [B*Nout, Cin*V]  = z_nodes permuted: one transposing copy
    y_rows  [B*Nout, Cout]   = bias + z_rows @ weight^T                   the one GEMM

``y_rows`` is the storage of ``y`` in fovi's layout (rows ``(b, n)``), so ``y`` needs no copy;
``grad_z = grad_y_rows @ weight`` comes out node-major and is summed back with ``node_unbin``.
When it pays, in words: few samples; the threshold is :data:`FEW_SAMPLES`, set by ``python -m
fovi_ref bench --strategies`` (:mod:`fovi_ref.check.bench.strategies`).
"""

from __future__ import annotations

import torch

from fovi_ref.knn_general import bin_entries
from fovi_ref.layout import linear_rows, y_from_rows
from fovi_ref.meta import Derived, KNNMeta
from fovi_ref.precision import store_operand, stored_product
from fovi_ref.segment_sum import (
    SegmentSumPlan,
    accumulation_dtype,
    build_segment_sum_plan,
    segment_sum,
)

__all__ = [
    "FEW_SAMPLES",
    "applies",
    "derive",
    "forward_with_operand",
    "grad_input",
    "grad_weight_of_operand",
    "grad_y_layout",
    "node_rows",
    "operand",
    "to_fovi_input",
]

FEW_SAMPLES = 4
"""Largest batch (samples) summed over node rows. Set by ``bench --strategies`` (its record
``fovi_ref/check/bench/strategies_record.json``): the largest batch at which node rows beat the
textbook on res18's layers."""


def applies(batch: int) -> bool:
    """True when a batch of ``batch`` samples takes node rows."""
    return batch <= FEW_SAMPLES


def derive(meta: KNNMeta) -> Derived:
    """``node_bin`` and ``node_unbin``: the textbook's plans restricted to channel 0, whose rows
    ``v*Nout + n`` and ``i`` number the node rows (the entries are channel-major)."""
    z_row, x_row = bin_entries(meta)
    per_channel = z_row.numel() // meta.in_channels
    cells = z_row[:per_channel]  # [E] row v*Nout + n
    inputs = x_row[:per_channel]  # [E] row i
    bin_plan = build_segment_sum_plan(cells, inputs, meta.v * meta.n_out)
    unbin_plan = build_segment_sum_plan(inputs, cells, meta.n_in)
    return {**bin_plan.as_derived("node_bin"), **unbin_plan.as_derived("node_unbin")}


def node_rows(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """``x [B, Cin, Nin] -> [Nin, B*Cin]`` in one copy (widened to float32 from 16 bits)."""
    x_nodes = x.new_empty(
        meta.n_in, x.shape[0], meta.in_channels, dtype=accumulation_dtype(x.dtype)
    )
    x_nodes.copy_(x.permute(2, 0, 1))  # [Nin, B, Cin]
    return x_nodes.view(meta.n_in, -1)


def to_fovi_input(rows: torch.Tensor, batch: int, c_in: int, dtype: torch.dtype) -> torch.Tensor:
    """Node rows ``[N, B*Cin] -> [B, Cin, N]`` in ``dtype``, contiguous, in one copy: a 2-D
    transpose, which ATen copies in cache-sized tiles (rounding float32 sums once)."""
    out = rows.new_empty(batch * c_in, rows.shape[0], dtype=dtype)
    return out.copy_(rows.t()).view(batch, c_in, rows.shape[0])


def grad_y_layout(grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y [B, Cout, Nout]`` in fovi's storage ``[B, Nout, Cout]`` (kept if it is already):
    both gradients then read ``[B*Nout, Cout]`` as a view."""
    if grad_y.transpose(1, 2).is_contiguous():
        return grad_y
    return grad_y.transpose(1, 2).contiguous().transpose(1, 2)


def _grad_y_rows(grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y [B, Cout, Nout] -> [B*Nout, Cout]``, row ``b*Nout + n``."""
    return grad_y.transpose(1, 2).reshape(-1, grad_y.shape[1])


def operand(meta: KNNMeta, data: Derived, x: torch.Tensor) -> torch.Tensor:
    """``z_rows [B*Nout, Cin*V]``, rows ``(b, n)``, contiguous: the binned cells as the GEMM
    reads them."""
    batch = x.shape[0]
    z_nodes = segment_sum(node_rows(meta, x), SegmentSumPlan.from_derived(data, "node_bin"))
    z_rows = z_nodes.new_empty(batch, meta.n_out, meta.in_channels, meta.v)  # [B, Nout, Cin, V]
    z_rows.copy_(z_nodes.view(meta.v, meta.n_out, batch, meta.in_channels).permute(2, 1, 3, 0))
    return store_operand(z_rows.view(batch * meta.n_out, meta.in_channels * meta.v), x.dtype)


def forward_with_operand(
    meta: KNNMeta, data: Derived, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, z_rows)``: ``y [B, Cout, Nout]`` (fovi's layout, a view of the GEMM's result) and
    ``z_rows [B*Nout, Cin*V]``, rows ``(b, n)``, kept for the weight gradient."""
    batch = x.shape[0]
    z_rows = operand(meta, data, x)  # [B*Nout, Cin*V]
    y_rows = linear_rows(z_rows, weight, bias).to(x.dtype)  # [B*Nout, Cout], rounded once
    return y_from_rows(y_rows, batch, meta.n_out), z_rows


def grad_input(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``grad_y [B, Cout, Nout] -> grad_x [B, Cin, Nin]``: ``grad_z = grad_y_rows @ weight`` (rows
    ``(b, n)``, stored as :func:`fovi_ref.precision.stored_product` stores it), permuted to node
    rows ``[V*Nout, B*Cin]``, summed back with ``node_unbin``."""
    batch = grad_y.shape[0]
    grad_z = stored_product(_grad_y_rows(grad_y), weight, grad_y.dtype)  # [B*Nout, Cin*V]
    grad_z_nodes = grad_z.new_empty(meta.v, meta.n_out, batch, meta.in_channels)
    grad_z_nodes.copy_(grad_z.view(batch, meta.n_out, meta.in_channels, meta.v).permute(3, 1, 0, 2))
    plan = SegmentSumPlan.from_derived(data, "node_unbin")
    grad_x_nodes = segment_sum(grad_z_nodes.view(meta.v * meta.n_out, -1), plan)  # [Nin, B*Cin]
    return to_fovi_input(grad_x_nodes, batch, meta.in_channels, grad_y.dtype)


def grad_weight_of_operand(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, z_rows: torch.Tensor
) -> torch.Tensor:
    """``grad_weight [Cout, Cin*V] = grad_y_rows^T @ z_rows``: one GEMM over the ``B*Nout``
    rows."""
    grad_y_rows = _grad_y_rows(grad_y).to(z_rows.dtype)  # [B*Nout, Cout]
    return (grad_y_rows.t() @ z_rows).to(grad_y.dtype)
