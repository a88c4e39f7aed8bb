"""The ``gather_gemm`` backend: the K = 1, V = 1 class (fovi-resnet18's downsample convs).

With one neighbour per output node and one reference cell, the general operator

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

has ``k = 0`` and ``rf_index = 0`` only, so it degenerates to a gather followed by ONE GEMM with a
weight shared by every node (``weight`` is ``[Cout, Cin]``)::

    x_rows[b*Nout + n, c] = x[b, c, idx[n]]           (0 where the neighbour is padding)
    y_rows                = bias + x_rows @ weight^T  [B*Nout, Cin] @ [Cin, Cout], one addmm

with ``idx = knn[0]``. ``y_rows`` is ``[B*Nout, Cout]``, the storage of fovi's output layout
(:mod:`fovi_ref.layout`), so the result needs no unfolding. Gradients (derived in
notebooks/03_algebraic_reduction.ipynb), with ``G = grad_y`` folded to ``[Cout, B*Nout]``::

    grad_weight = G @ x_rows                           one GEMM over the folded (b, n) axis
    grad_x[b]   = (weight^T @ grad_y[b]) @ S            S[n, i] = 1 if idx[n] = i (real neighbour)
    grad_bias   = sum_{b, n} grad_y[b, :, n]            one reduction (done by the autograd layer)

``S [Nout, Nin]``, the dense one-hot *scatter matrix*, sums the gradients of outputs that share an
input (collisions) inside the GEMM and leaves padding rows zero, at ``Nout*Nin`` elements and
``B*Cin*Nout*Nin`` multiply-adds against ``B*Cin*Nout`` for an index scatter. Above
:data:`DENSE_S_BUDGET` (per device type) ``grad_input`` takes the index path (``index_add_``)
beside it instead: the same sum, in another order.

**Layouts.** The gather writes ``x_rows`` directly. ``G`` is folded once per backward
(:meth:`GatherGemmOps.grad_y_layout`) by swapping the outer axes of ``grad_y``, which moves whole
runs of ``Nout`` values, and both gradients read that copy; in eager mode the weight gradient
reads the rows the forward gathered (:meth:`GatherGemmOps.forward_with_operand`). **Derived
data** (:func:`derive`, kept on the meta): the gather index, the padding nodes, and ``S`` (float32)
for every graph small enough for any device's budget.

**16 bits.** The GEMMs run in :func:`fovi_ref.precision.gemm_dtype`. Gathering copies values
exactly, so *wide* (float32 GEMMs) rounds ``y`` and every gradient once, at the end, and *narrow*
(16-bit GEMMs, accumulating in float32) stores one intermediate, ``weight^T @ grad_y``, before
the scatter sums it, where every value fits (:func:`fovi_ref.precision.stored_product`).
"""

from __future__ import annotations

import torch

from fovi_ref.layout import linear_rows, padded_rows, y_from_rows
from fovi_ref.meta import Derived, KNNMeta
from fovi_ref.precision import gemm_dtype, stored_product
from fovi_ref.segment_sum import accumulation_dtype

__all__ = [
    "DENSE_S_BUDGET",
    "GatherGemmOps",
    "derive",
    "gather_gemm_applies",
    "uses_dense_scatter",
]

NAME = "gather_gemm"

# Largest Nout*Nin for which grad_input multiplies by the dense S, per device type: the largest
# size at which the dense path is no slower (CPU: at no size, beyond the noise band). Where each
# value comes from is the harness's to say (fovi_ref.check.bench.budget.DENSE_S_BUDGET_SOURCE).
DENSE_S_BUDGET: dict[str, int] = {"cpu": 0, "cuda": 99856}
S_MAX_ELEMENTS = 2**20
"""``S`` is derived (and kept) only for graphs up to this size: the largest size notebook 04
sweeps, so no budget above it could be measured."""


def gather_gemm_applies(k: int, v: int) -> bool:
    """THE routing predicate of this backend: one neighbour and one cell per node."""
    return k == 1 and v == 1


def uses_dense_scatter(meta: KNNMeta, device: torch.device) -> bool:
    """True when ``grad_input`` for ``meta`` on ``device`` multiplies by the dense ``S``."""
    budget = DENSE_S_BUDGET.get(device.type, DENSE_S_BUDGET["cuda"])
    return meta.n_out * meta.n_in <= min(budget, S_MAX_ELEMENTS)


def derive(meta: KNNMeta) -> Derived:
    """The data this backend needs from a K = V = 1 graph (a pure function of ``meta``).

    - ``index [Nout]``: ``knn[0]`` with padding replaced by 0, so it is always safe to gather.
    - ``padding [P]``: output nodes whose neighbour is padding (their values are zeroed).
    - ``scatter [Nout, Nin]`` float32: ``S[n, idx[n]] = 1`` for real neighbours (``[0, Nin]``
      above ``S_MAX_ELEMENTS``).
    """
    if not gather_gemm_applies(meta.k, meta.v):
        raise ValueError(f"gather_gemm needs a graph with K == 1 and V == 1, got {meta!r}")
    neighbour = meta.knn[0]  # [Nout]
    real = neighbour != meta.n_in  # [Nout]
    index = torch.where(real, neighbour, 0)  # [Nout]
    rows = meta.n_out if meta.n_out * meta.n_in <= S_MAX_ELEMENTS else 0
    scatter = torch.zeros(rows, meta.n_in, device=meta.device)  # [Nout, Nin] or [0, Nin]
    if rows:
        scatter[real, index[real]] = 1.0
    return {"index": index, "padding": (~real).nonzero().flatten(), "scatter": scatter}


def _gathered_rows(data: Derived, x: torch.Tensor) -> torch.Tensor:
    """``x_rows [B*Nout, Cin]``: row ``b*Nout + n`` holds ``x[b, :, idx[n]]`` (0 for padding).
    Indexing the node axis of the ``[B, Nin, Cin]`` view writes the rows in one pass, whole runs
    of ``Cin`` values (``index_select`` along the last axis of ``[B, Cin, Nin]`` would pick
    single values); the reshape is a view for a contiguous or fovi-layout ``x``, one copy
    otherwise."""
    index = data["index"]  # [Nout]
    padding = data["padding"]  # [P]
    x_rows = x.transpose(1, 2)[:, index]  # [B, Nout, Cin]
    if padding.numel():
        x_rows.index_fill_(1, padding, 0)  # exact zeros, even if x holds inf or nan
    return x_rows.reshape(-1, x.shape[1])  # [B*Nout, Cin]


def _grad_y_columns(grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y [B, Cout, Nout] -> [Cout, B*Nout]`` (columns ``b``-major): a view in both layouts
    :meth:`GatherGemmOps.grad_y_layout` leaves."""
    return grad_y.transpose(0, 1).reshape(grad_y.shape[1], -1)


class GatherGemmOps:
    """Ops-registry backend for the K=1/V=1 class: one gather + one dense GEMM per function."""

    name = NAME
    derive = staticmethod(derive)

    @staticmethod
    def supports(meta: KNNMeta) -> bool:
        """Only K = 1, V = 1 graphs (:func:`gather_gemm_applies`)."""
        return gather_gemm_applies(meta.k, meta.v)

    @staticmethod
    def grad_y_layout(grad_y: torch.Tensor) -> torch.Tensor:
        """``grad_y`` as is in fovi's layout (its columns are a transposed matrix BLAS reads in
        place), else copied into ``[Cout, B, Nout]`` storage: either way the columns are a view."""
        if grad_y.transpose(1, 2).is_contiguous():
            return grad_y
        return grad_y.transpose(0, 1).contiguous().transpose(0, 1)  # [B, Cout, Nout]

    @staticmethod
    def forward(
        meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [B, Cin, Nin]``, ``weight``, ``bias`` -> ``y [B, Cout, Nout]`` (fovi's layout)."""
        return GatherGemmOps.forward_with_operand(meta, x, weight, bias)[0]

    @staticmethod
    def forward_with_operand(
        meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """``(y, x_rows)``: the forward and the gathered rows ``[B*Nout, Cin]`` its GEMM read,
        kept for the weight gradient instead of ``x`` (smaller, and no second gather)."""
        x_rows = _gathered_rows(meta.derived(NAME, derive), x)  # [B*Nout, Cin]
        acc = gemm_dtype(x.device, x.dtype)
        # One GEMM whose rows are the (b, n) pairs: its result is the storage of fovi's layout
        # (rounded once to x's dtype where the GEMM ran wide).
        y_rows = linear_rows(x_rows.to(acc), weight, bias).to(x.dtype)  # [B*Nout, Cout]
        return y_from_rows(y_rows, x.shape[0], meta.n_out), x_rows

    @staticmethod
    def grad_input(meta: KNNMeta, grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]`` -> ``grad_x [B, Cin, Nin]``: ``(W^T grad_y) S``, a scatter."""
        data = meta.derived(NAME, derive)
        batch = grad_y.shape[0]
        c_in = weight.shape[1]
        # d[b] = W^T @ grad_y[b] as ONE GEMM over the (b, n) rows, whose result rows are whole
        # runs of Cin values (the scatter below moves them as such); stored as grad_z is.
        d_rows = stored_product(_grad_y_columns(grad_y).t(), weight, grad_y.dtype)  # [B*Nout, Cin]
        acc = d_rows.dtype  # the GEMM's, or float32 where a float16 value passed 65504
        d_rows = d_rows.view(batch, meta.n_out, c_in)
        if data["padding"].numel():
            d_rows.index_fill_(1, data["padding"], 0)  # padding receives nothing
        d_sel = d_rows.transpose(1, 2)  # [B, Cin, Nout], a view of d_rows [B, Nout, Cin]
        if uses_dense_scatter(meta, grad_y.device) and data["scatter"].numel():
            s = data["scatter"].to(acc)  # [Nout, Nin]; no copy in float32
            d_cols = padded_rows(d_sel.reshape(batch * c_in, meta.n_out))  # [B*Cin, Nout]
            grad_x = d_cols @ s  # [B*Cin, Nin]
            return grad_x.view(batch, c_in, meta.n_in).to(grad_y.dtype)
        # The scatter reads the view: folding it first would copy every value once more. It adds
        # in float32 (a narrow 16-bit d_sel is widened: index_add_ takes one dtype), so
        # collisions are rounded once, at the end.
        acc_sum = accumulation_dtype(acc)
        grad_x = d_rows.new_zeros(batch, c_in, meta.n_in, dtype=acc_sum)  # [B, Cin, Nin]
        grad_x.index_add_(2, data["index"], d_sel.to(acc_sum))  # collisions add up
        return grad_x.to(grad_y.dtype)

    @staticmethod
    def grad_weight(meta: KNNMeta, grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, ``x [B, Cin, Nin]`` -> ``grad_weight [Cout, Cin]``."""
        x_rows = _gathered_rows(meta.derived(NAME, derive), x)  # [B*Nout, Cin]
        return GatherGemmOps.grad_weight_of_operand(meta, grad_y, x_rows)

    @staticmethod
    def grad_weight_of_operand(
        meta: KNNMeta, grad_y: torch.Tensor, x_rows: torch.Tensor
    ) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, the gathered ``x_rows [B*Nout, Cin]`` -> ``[Cout, Cin]``."""
        # One GEMM over batch and nodes, [Cout, B*Nout] @ [B*Nout, Cin]: in this orientation MKL
        # does not split the sum between threads (tests/test_ordinary_use.py).
        acc = gemm_dtype(grad_y.device, grad_y.dtype)
        grad_weight = _grad_y_columns(grad_y).to(acc) @ x_rows.to(acc)  # [Cout, Cin]
        return grad_weight.to(grad_y.dtype)
