"""Strategy *few columns*: the textbook with its GEMMs arranged for few columns ``Nout*B``.

Beyond few samples, layer4's graphs (``Nout`` of 2) still give GEMMs of only ``Nout*B`` columns
(16 at batch 8) against a weight of ``Cout x Cin*V`` (512 x 2304). Such a GEMM is bound by
reading the weight, and BLAS reads it faster in one orientation than the other:

- forward: ``z_rows [Nout*B, Cin*V]`` is the textbook's transposed view; here it is copied to
  contiguous rows first (a copy of a few rows);
- input gradient: ``grad_z = weight^T @ grad_y`` is computed as ``(grad_y^T @ weight)^T`` and
  made contiguous (again a copy of a few columns).

Same sums in the same order as the textbook; the GEMMs' products are the same, their rounding
may differ. When it pays, in words: more samples than node rows take, and at most
:data:`FEW_COLUMNS` GEMM columns; ``python -m fovi_ref bench --strategies`` measures it.
"""

from __future__ import annotations

import torch

from fovi_ref.knn_general import (
    grad_weight_of_operand,
    grad_y_columns,
    grad_y_layout,
    linear_to_fovi,
    unbin,
)
from fovi_ref.knn_general import operand as textbook_operand
from fovi_ref.meta import Derived, KNNMeta
from fovi_ref.precision import stored_product

__all__ = [
    "FEW_COLUMNS",
    "applies",
    "derive",
    "forward_with_operand",
    "grad_input",
    "grad_weight_of_operand",
    "grad_y_layout",
    "operand",
]

FEW_COLUMNS = 12
"""Largest GEMM column count ``Nout*B`` (columns) run in this arrangement. Set by ``bench
--strategies``."""


def applies(n_out: int, batch: int) -> bool:
    """True when ``batch`` samples over ``n_out`` outputs make at most :data:`FEW_COLUMNS`
    columns (the chooser asks node rows first, for few samples)."""
    return n_out * batch <= FEW_COLUMNS


def derive(meta: KNNMeta) -> Derived:
    """Nothing of its own: the textbook's plans serve."""
    return {}


def operand(meta: KNNMeta, data: Derived, x: torch.Tensor) -> torch.Tensor:
    """``z_rows [Nout*B, Cin*V]``, rows ``(n, b)``, contiguous."""
    return textbook_operand(meta, data, x).contiguous()


def forward_with_operand(
    meta: KNNMeta, data: Derived, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook's forward on contiguous rows: ``(y [B, Cout, Nout], z_rows)``."""
    z_rows = operand(meta, data, x)
    return linear_to_fovi(meta, z_rows, weight, bias, x), z_rows


def grad_input(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``grad_x [B, Cin, Nin]``: ``grad_z = (grad_y^T @ weight)^T``, contiguous, then the
    textbook's unbinning."""
    grad_z = stored_product(grad_y_columns(grad_y).t(), weight, grad_y.dtype)  # [Nout*B, Cin*V]
    return unbin(meta, data, grad_z.t().contiguous(), grad_y.shape[0], grad_y.dtype)
