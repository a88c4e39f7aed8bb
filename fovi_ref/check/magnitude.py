"""What the tolerance rule needs besides the oracle's values: how large the terms of every sum
are, and how many there are.

A rounding error is relative to the terms of a sum, not to the sum, which may cancel. The float64
oracle (:func:`fovi_ref.reference.knn_conv_reference`) run on absolute values gives the sum of the
magnitudes of the terms (:func:`knn_conv_magnitude`); run on ones, it counts the terms
(:func:`knn_conv_term_counts`). :func:`oracle_quantities` runs the oracle forward and backward
through the one runner, :func:`fovi_ref.check.operands.forward_and_grads`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fovi_ref import KNNMeta
from fovi_ref.check.operands import forward_and_grads
from fovi_ref.reference import AllPadding, knn_conv_reference

__all__ = [
    "Quantities",
    "binned_cells",
    "knn_conv_magnitude",
    "knn_conv_term_counts",
    "oracle_quantities",
    "shared_cell_meta",
]


class Quantities(NamedTuple):
    """The four results of one forward and backward: ``y [B, Cout, Nout]``,
    ``grad_x [B, Cin, Nin]``, ``grad_weight [Cout, Cin*V]``, ``grad_bias [Cout]`` (``None``
    without a bias)."""

    y: torch.Tensor
    grad_x: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor | None


def oracle_quantities(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    grad_y: torch.Tensor,
    *,
    all_padding: AllPadding = "bias",
    compute_dtype: torch.dtype = torch.float64,
) -> Quantities:
    """``y`` and its three gradients for the upstream gradient ``grad_y [B, Cout, Nout]``, by
    autograd through the oracle, every result in ``compute_dtype`` (the operands are cast to it
    first, so the gradients come back in it too)."""
    x, weight, grad_y = (t.to(compute_dtype) for t in (x, weight, grad_y))
    bias = None if bias is None else bias.to(compute_dtype)

    def oracle(x, w, b):
        return knn_conv_reference(
            x, w, b, meta, all_padding=all_padding, compute_dtype=compute_dtype
        )

    return Quantities(*forward_and_grads(x, weight, bias, meta, grad_y, oracle))


def knn_conv_magnitude(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    grad_y: torch.Tensor,
    *,
    all_padding: AllPadding = "bias",
) -> Quantities:
    """The sum of the *magnitudes of the terms* of every element of ``y`` and its gradients.

    Each quantity is a sum of products; this is the same sum with every factor replaced by its
    absolute value, which the float64 oracle computes when run on ``|x|``, ``|W|``, ``|b|`` and
    back-propagated with ``|grad_y|``::

        |y|~[b, o, n]      = |bias[o]| + sum_{c, k real} |x[b, c, knn[k, n]]| |w[o, c, cell]|
        |grad_x|~[b, c, i] = sum_{(k, n): knn[k, n] = i} sum_o |grad_y[b, o, n]| |w[o, c, cell]|
        |grad_w|~[o, c*V+v] = sum_{b, (n, k): cell = v} |grad_y[b, o, n]| |x[b, c, knn[k, n]]|
        |grad_b|~[o]       = sum_{b, n} |grad_y[b, o, n]|

    (``cell = rf_index[n, k]``). A rounding error of a correct implementation is a small multiple
    of these, whatever the signs do to the sum itself. All results are float64.
    """
    bias_abs = None if bias is None else bias.double().abs()
    return oracle_quantities(
        x.double().abs(),
        weight.double().abs(),
        bias_abs,
        meta,
        grad_y.double().abs(),
        all_padding=all_padding,
    )


def knn_conv_term_counts(
    meta: KNNMeta,
    out_channels: int,
    batch: int,
    *,
    bias: bool = True,
    all_padding: AllPadding = "bias",
) -> Quantities:
    """How many terms each element's sum has: :func:`knn_conv_magnitude` run on ones.

    That is ``Cin * (real neighbours of n) + 1`` for ``y`` (the bias counts as a term),
    ``Cout * (real entries reading input i)`` for ``grad_x``, ``B * (real entries in cell v)`` for
    ``grad_weight`` and ``B * Nout`` for ``grad_bias`` (nodes that output zero under
    ``all_padding="zero"`` have no terms). Float64 tensors of the quantities' shapes.
    """
    ones = dict(dtype=torch.float64, device=meta.device)
    return knn_conv_magnitude(
        torch.ones(batch, meta.in_channels, meta.n_in, **ones),
        torch.ones(out_channels, meta.in_channels * meta.v, **ones),
        torch.ones(out_channels, **ones) if bias else None,
        meta,
        torch.ones(batch, out_channels, meta.n_out, **ones),
        all_padding=all_padding,
    )


def fan_out(meta: KNNMeta) -> torch.Tensor:
    """``F [Nin]``, int64: how many real entries read each input (its readers), the number of
    terms of ``grad_x[b, c, i]`` per output channel."""
    return torch.bincount(meta.knn[~meta.pad_mask], minlength=meta.n_in)


def shared_cell_meta(meta: KNNMeta) -> KNNMeta:
    """The graph restricted to the neighbours that share their cell with another real neighbour
    of the same node; every other neighbour becomes padding.

    These are the neighbours whose features a two-step implementation (sum the neighbours of each
    cell, then multiply by the weight) adds *before* the GEMM and stores in the working dtype;
    a neighbour alone in its cell is copied exactly. :mod:`fovi_ref.check.tolerances` allows one
    rounding for the terms of these neighbours.
    """
    real = ~meta.pad_mask  # [K, Nout]
    cell = meta.rf_index.t()  # [K, Nout] cell of neighbour (k, n)
    same_cell = cell[:, None, :] == cell[None, :, :]  # [K, K, Nout]: k and k' share n's cell
    both_real = real[:, None, :] & real[None, :, :]  # [K, K, Nout]
    others = (same_cell & both_real).sum(dim=1) - 1  # [K, Nout] other real neighbours in the cell
    shared = real & (others > 0)  # [K, Nout]
    knn = meta.knn.masked_fill(~shared, meta.n_in)  # [K, Nout]
    return KNNMeta.from_knn(
        knn, meta.rf_index, n_in=meta.n_in, in_channels=meta.in_channels, v=meta.v
    )


def binned_cells(x: torch.Tensor, meta: KNNMeta) -> torch.Tensor:
    """The binned cell features in float64, straight from their definition::

        z[b, c, v, n] = sum_{k : rf_index[n, k] = v, knn[k, n] real} x[b, c, knn[k, n]]

    ``x [B, Cin, Nin] -> z [B, Cin, V, Nout]`` (padding adds nothing). What a two-step
    implementation stores before its GEMM; :mod:`fovi_ref.check.tolerances` allows one rounding
    of each, relative to ``|z|``."""
    batch, c_in = x.shape[0], meta.in_channels
    x_pad = torch.cat([x.double(), x.new_zeros(batch, c_in, 1, dtype=torch.float64)], dim=2)
    z = x_pad.new_zeros(batch, c_in, meta.v, meta.n_out)  # [B, Cin, V, Nout]
    for k in range(meta.k):
        terms = x_pad[:, :, meta.knn[k]]  # [B, Cin, Nout], zero for padding
        cell = meta.rf_index[:, k].expand(batch, c_in, 1, -1)  # [B, Cin, 1, Nout]
        z.scatter_add_(2, cell, terms[:, :, None, :])
    return z
