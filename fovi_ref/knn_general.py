"""The ``general`` backend in textbook form: any K and V, padding anywhere, several neighbours
per cell. Registered as ``general_textbook``; the routed ``general`` runs this same math, or one
of the fast strategies beside it (:mod:`fovi_ref.strategies`), which are held to it.

The operator

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

is computed in two steps that build neither per-node weights (``Nout*Cout*Cin*K``) nor fovi's
dense one-hot ``local_rf`` product:

1. **Bin** the neighbours into their cells: ``z[c, v, n, b]`` sums the features of node ``n``'s
   real neighbours that fall in cell ``v`` (zero for an empty cell)::

       z[c, v, n, b] = sum_{k : rf_index[n, k] = v, knn[k, n] real} x[b, c, knn[k, n]]

   This is a *segment sum* (:mod:`fovi_ref.segment_sum`): the row ``(c, v, n)`` of ``z`` adds up
   the rows ``(c, knn[k, n])`` of ``x`` listed for it, one entry per real neighbour and channel.
2. **ONE GEMM** with the shared weight, over all nodes and the whole batch: ``z`` viewed as
   ``[Cin*V, Nout*B]`` has its row ``c*V + v`` in the weight's column order, so
   ``y = bias + weight @ z``, one ``addmm``.

Both gradients run the same two steps backwards, with ``grad_y`` folded to ``[Cout, Nout*B]``::

    grad_z          = weight^T @ grad_y                                # [Cin*V, Nout*B]
    grad_x[b, c, i] = sum_{(k, n) : knn[k, n] = i} grad_z[c, rf_index[n, k], n, b]
    grad_weight     = grad_y @ z^T                                     # [Cout, Cin*V]

The ``grad_x`` line is the binning's segment sum with source and destination swapped: the
backward of a gather is its transpose. Padding neighbours have no entry, so they add exact zeros
and receive nothing. The forward keeps ``z`` for ``grad_weight`` (as large as what fovi's
``F.linear`` keeps), so the backward never bins twice.

**Rows.** ``x`` and ``z`` are handled as *channel rows*, one row per (channel, node) holding its
``B`` values, so that every gather and scatter moves whole rows rather than single values; one
transposing copy brings ``x`` in and one takes ``grad_x`` out.

**16 bits.** The binning sums 16-bit values in float32
(:func:`fovi_ref.segment_sum.accumulation_dtype`); the GEMMs run in
:func:`fovi_ref.precision.gemm_dtype`. *Wide* (float32 GEMMs): nothing is stored in 16 bits
before ``y`` and the gradients, which are rounded once. *Narrow* (16-bit GEMMs, accumulating in
float32): ``z`` and ``grad_z`` are each stored once in 16 bits first, where every value fits
(:func:`fovi_ref.precision.store_operand`; a float16 value past 65504 keeps its operand in
float32). The unbinning sums in float32 either way.

Notebook ``02_general_backend.ipynb`` derives these steps and checks them numerically.
"""

from __future__ import annotations

import torch

from fovi_ref.layout import fovi_layout_empty, linear_rows
from fovi_ref.meta import Derived, KNNMeta
from fovi_ref.precision import store_operand, stored_product
from fovi_ref.segment_sum import (
    SegmentSumPlan,
    accumulation_dtype,
    build_segment_sum_plan,
    segment_sum,
)

__all__ = [
    "GeneralTextbookOps",
    "bin_entries",
    "bin_neighbours",
    "derive",
    "forward_with_operand",
    "grad_input",
    "grad_weight_of_operand",
    "grad_y_columns",
    "grad_y_layout",
    "linear_to_fovi",
    "operand",
    "unbin",
]

NAME = "general_textbook"


def bin_entries(meta: KNNMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z_row, x_row)``, one entry per real neighbour per channel: the row ``(c, v, n)`` of
    ``z [Cin*V*Nout, B]`` and the row ``(c, i)`` of ``x [Cin*Nin, B]`` it adds. Channel-major,
    then k-major, so each row of ``z`` adds its terms in increasing ``k``."""
    node = torch.arange(meta.n_out, device=meta.device).expand(meta.k, -1)  # [K, Nout]
    real = ~meta.pad_mask  # [K, Nout]
    node = node[real]  # [E] the entries of every real neighbour, k-major
    cell = meta.rf_index.t()[real]  # [E]
    neighbour = meta.knn[real]  # [E]
    c = torch.arange(meta.in_channels, device=meta.device)[:, None]  # [Cin, 1]
    z_row = (c * meta.v + cell) * meta.n_out + node  # [Cin, E] row (c, v, n) of z
    x_row = c * meta.n_in + neighbour  # [Cin, E] row (c, i) of x
    return z_row.reshape(-1), x_row.reshape(-1)  # [Cin*E] each


def derive(meta: KNNMeta) -> Derived:
    """The two segment-sum plans of ``meta``: ``bin``, rows of ``x`` -> rows of ``z``, and
    ``unbin``, the same entries swapped (rows of ``grad_z`` -> rows of ``grad_x``)."""
    z_row, x_row = bin_entries(meta)
    z_rows = meta.in_channels * meta.v * meta.n_out
    x_rows = meta.in_channels * meta.n_in
    bin_plan = build_segment_sum_plan(z_row, x_row, z_rows)
    unbin_plan = build_segment_sum_plan(x_row, z_row, x_rows)
    return {**bin_plan.as_derived("bin"), **unbin_plan.as_derived("unbin")}


def bin_neighbours(meta: KNNMeta, data: Derived, x: torch.Tensor) -> torch.Tensor:
    """Step 1: ``x [B, Cin, Nin] -> z [Cin*V, Nout*B]`` (summed and returned in float32 for 16-bit
    ``x``)."""
    batch = x.shape[0]
    # One copy to channel rows [Cin, Nin, B]; widened here, so 16-bit sums cannot overflow.
    x_rows = x.new_empty(meta.in_channels, meta.n_in, batch, dtype=accumulation_dtype(x.dtype))
    x_rows.copy_(x.permute(1, 2, 0))
    x_rows = x_rows.view(meta.in_channels * meta.n_in, batch)  # [Cin*Nin, B]
    z_rows = segment_sum(x_rows, SegmentSumPlan.from_derived(data, "bin"))  # [Cin*V*Nout, B]
    return z_rows.view(meta.in_channels * meta.v, meta.n_out * batch)  # [Cin*V, Nout*B]


def operand(meta: KNNMeta, data: Derived, x: torch.Tensor) -> torch.Tensor:
    """``z_rows [Nout*B, Cin*V]``, rows ``(n, b)``: the binned cells as the GEMM reads them (a
    transposed view of :func:`bin_neighbours`, stored in the GEMM's dtype)."""
    return store_operand(bin_neighbours(meta, data, x), x.dtype).t()


def grad_y_columns(grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y [B, Cout, Nout] -> [Cout, Nout*B]``, column ``n*B + b``: ``z``'s column order
    (a view of what :func:`grad_y_layout` leaves)."""
    return grad_y.permute(1, 2, 0).reshape(grad_y.shape[1], -1)


def grad_y_layout(grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y [B, Cout, Nout]`` stored as ``[Cout, Nout, B]``: one copy, which both gradients
    then read as :func:`grad_y_columns` without copying again."""
    return grad_y.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def linear_to_fovi(
    meta: KNNMeta, z_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x
) -> torch.Tensor:
    """Step 2: ``y = bias + z_rows @ weight^T``, ONE GEMM, from ``z_rows [Nout*B, Cin*V]`` (rows
    ``(n, b)``) into ``y [B, Cout, Nout]`` in fovi's layout, ``x``'s dtype and device."""
    batch = x.shape[0]
    c_out = weight.shape[0]
    y_rows = linear_rows(z_rows, weight, bias)  # [Nout*B, Cout]
    y = fovi_layout_empty(batch, c_out, meta.n_out, x)  # [B, Cout, Nout]
    # The rows come ordered (node, batch); one copy puts them in y's (batch, node) order, and
    # rounds 16-bit results once.
    y.transpose(1, 2).copy_(y_rows.view(meta.n_out, batch, c_out).transpose(0, 1))
    return y


def unbin(
    meta: KNNMeta, data: Derived, grad_z: torch.Tensor, batch: int, dtype: torch.dtype
) -> torch.Tensor:
    """The backward of step 1: ``grad_z [Cin*V, Nout*B] -> grad_x [B, Cin, Nin]`` in ``dtype``,
    the binning's sum with source and destination swapped. Padding neighbours receive nothing."""
    grad_z_rows = grad_z.view(meta.in_channels * meta.v * meta.n_out, batch)  # [Cin*V*Nout, B]
    grad_x_rows = segment_sum(grad_z_rows, SegmentSumPlan.from_derived(data, "unbin"))
    # [Cin*Nin, B] -> [B, Cin, Nin]: a 2-D transpose, which ATen copies in cache-sized blocks,
    # rounding a float32 sum of 16-bit values once.
    grad_x = grad_x_rows.new_empty(batch, meta.in_channels * meta.n_in, dtype=dtype)
    return grad_x.copy_(grad_x_rows.t()).view(batch, meta.in_channels, meta.n_in)


def forward_with_operand(
    meta: KNNMeta, data: Derived, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, z_rows)``: ``y [B, Cout, Nout]`` in fovi's layout, and ``z_rows [Nout*B, Cin*V]``,
    the binned cells the GEMM read, kept for :func:`grad_weight_of_operand`."""
    z_rows = operand(meta, data, x)  # step 1: [Nout*B, Cin*V], rows (n, b)
    return linear_to_fovi(meta, z_rows, weight, bias, x), z_rows  # step 2


def grad_input(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``grad_y [B, Cout, Nout] -> grad_x [B, Cin, Nin]``: ``grad_z = weight^T @ grad_y`` (in the
    GEMM's dtype, stored as :func:`fovi_ref.precision.stored_product` stores it), then
    :func:`unbin`."""
    grad_z = stored_product(weight.t(), grad_y_columns(grad_y), grad_y.dtype)  # [Cin*V, Nout*B]
    return unbin(meta, data, grad_z, grad_y.shape[0], grad_y.dtype)


def grad_weight_of_operand(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, z_rows: torch.Tensor
) -> torch.Tensor:
    """``grad_weight [Cout, Cin*V] = grad_y @ z^T``, ONE GEMM over the ``Nout*B`` columns, from
    the ``z_rows [Nout*B, Cin*V]`` the forward kept (in the GEMM's dtype)."""
    grad_y_cols = grad_y_columns(grad_y).to(z_rows.dtype)  # [Cout, Nout*B]
    return (grad_y_cols @ z_rows).to(grad_y.dtype)


class GeneralTextbookOps:
    """This module as a backend (the protocol of :mod:`fovi_ref.knn_autograd`): ``knn_conv(...,
    backend="general_textbook")`` and ``check_ops("general_textbook")`` run and judge it alone."""

    name = NAME
    derive = staticmethod(derive)
    grad_y_layout = staticmethod(grad_y_layout)

    @staticmethod
    def forward_with_operand(meta, x, weight, bias):
        return forward_with_operand(meta, meta.derived(NAME, derive), x, weight, bias)

    @staticmethod
    def forward(meta, x, weight, bias):
        return forward_with_operand(meta, meta.derived(NAME, derive), x, weight, bias)[0]

    @staticmethod
    def grad_input(meta, grad_y, weight):
        return grad_input(meta, meta.derived(NAME, derive), grad_y, weight)

    @staticmethod
    def grad_weight_of_operand(meta, grad_y, z_rows):
        return grad_weight_of_operand(meta, meta.derived(NAME, derive), grad_y, z_rows)

    @staticmethod
    def grad_weight(meta, grad_y, x):
        data = meta.derived(NAME, derive)
        return grad_weight_of_operand(meta, data, grad_y, operand(meta, data, x))
