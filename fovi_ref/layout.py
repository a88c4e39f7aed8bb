"""fovi's memory layout for a KNN convolution's output, and the one GEMM that writes it.

fovi's ``KNNConvLayer`` ends with ``F.linear(features [B, Nout, F], weight, bias)`` and returns
the result ``.transpose(1, 2)``: ``y [B, Cout, Nout]`` is a *view* whose storage is node-major,
``[B, Nout, Cout]`` contiguous (strides ``(Nout*Cout, 1, Cout)``). Every fovi_ref backend returns
that layout: a model swapped from fovi to fovi_ref hands the next layer (a BatchNorm) the same
strides, so results stay bit-identical, and a GEMM whose rows are the ``(b, n)`` pairs writes
``[B*Nout, Cout]``, which *is* that storage. The bias goes inside the GEMM (``torch.addmm``), as
in ``F.linear``, so ``bias + features @ W^T`` is rounded once (adding it after would round twice,
which shows in float16 and bfloat16 when the bias cancels the product). Shapes: ``rows
[B*Nout, F]`` (row ``b*Nout + n``), ``weight [Cout, F]``, ``bias [Cout]``.
"""

from __future__ import annotations

import torch

__all__ = ["fovi_layout_empty", "linear_rows", "y_from_rows"]


def linear_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``bias + rows @ weight^T``: ``[M, F] -> [M, Cout]`` in ONE GEMM, bias rounded with it."""
    weight = weight.to(rows.dtype)  # float16 rows come as float32: the GEMM's inputs, widened
    if bias is None:
        return rows @ weight.t()  # [M, Cout]
    return torch.addmm(bias.to(rows.dtype), rows, weight.t())  # [M, Cout]


def y_from_rows(y_rows: torch.Tensor, batch: int, n_out: int) -> torch.Tensor:
    """``[B*Nout, Cout]`` (rows ordered ``b``, then ``n``) -> ``y [B, Cout, Nout]``, a view."""
    return y_rows.view(batch, n_out, y_rows.shape[1]).transpose(1, 2)  # [B, Cout, Nout]


def fovi_layout_empty(batch: int, c_out: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised ``[B, Cout, Nout]`` in fovi's layout, dtype and device of ``like``."""
    return like.new_empty(batch, n_out, c_out).transpose(1, 2)  # [B, Cout, Nout]
