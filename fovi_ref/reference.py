"""The float64 oracle: the KNN convolution written straight from its formula.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

Loops over the neighbour slot ``k``, works in float64 whatever the inputs' dtype, and shares no
code with any backend, so it can judge them all. It builds every node's own weight matrix, which
no fast backend may do; slow and memory-hungry is fine here, every line is the formula.

**What the formula means at its edges** (every backend is judged by these readings):

- *Padding.* The sum runs over the terms that exist: one per (channel, *real* neighbour).
  A padding neighbour (``knn[k, n] == n_in``) has no term at all, not a term ``0 * weight``:
  it adds an exact zero even where the weight of its cell is inf or nan, and sends no gradient
  anywhere.
- *Non-finite values* follow IEEE arithmetic on the terms that exist: an inf in ``x`` reaches
  exactly the outputs of the nodes that read it (``inf * 0`` is nan there, since a real
  neighbour times a zero weight *is* a term); nothing else sees it.
- *All-padding nodes* (every neighbour is padding) have an empty sum, so ``y`` there is the bias:
  ``all_padding="bias"``, the default. fovi 2.4.0's ``KNNConvLayer.forward`` instead zeroes those
  outputs (``_mask_invalid_outputs``); ``all_padding="zero"`` follows it: ``y`` is exactly 0
  there whatever the bias, and the bias gradient leaves those nodes out.

Besides the values, :mod:`fovi_ref.check.tolerances` needs to know how large the terms of every sum are
(a rounding error is relative to them, not to the sum, which may cancel). The same formula run on
absolute values gives that: :func:`knn_conv_magnitude`. Run on ones, it counts the terms.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from fovi_ref.meta import KNNMeta

__all__ = [
    "Quantities",
    "knn_conv_magnitude",
    "knn_conv_reference",
    "knn_conv_reference_grads",
    "knn_conv_term_counts",
    "shared_cell_meta",
]

AllPadding = Literal["bias", "zero"]


class Quantities(NamedTuple):
    """The four results of one forward and backward: ``y [B, Cout, Nout]``,
    ``grad_x [B, Cin, Nin]``, ``grad_weight [Cout, Cin*V]``, ``grad_bias [Cout]`` (``None``
    without a bias)."""

    y: torch.Tensor
    grad_x: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor | None


def _check_all_padding(all_padding: str) -> None:
    if all_padding not in ("bias", "zero"):
        raise ValueError(f"all_padding must be 'bias' or 'zero', got {all_padding!r}")


def knn_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    *,
    all_padding: AllPadding = "bias",
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Naive KNN convolution, in float64 unless asked otherwise.

    Args:
        x: ``[B, Cin, Nin]``. weight: ``[Cout, Cin*V]`` (column ``c*V + cell``).
        bias: ``[Cout]`` or ``None``. meta: the graph.
        all_padding: what a node whose neighbours are all padding outputs: ``"bias"`` (the
            formula's empty sum) or ``"zero"`` (fovi 2.4.0's layer). See the module docstring.
        compute_dtype: the arithmetic. float64 is the oracle; float32 makes the same loop an
            ordinary float32 implementation (used to show that the tolerance rule passes every
            correct implementation, this one included).

    Returns:
        ``y [B, Cout, Nout]`` in ``compute_dtype``, on ``x``'s device. Differentiable, so autograd
        through it gives the reference gradients too, with the same readings of padding and
        non-finite values (no term, so no gradient, for a padding neighbour).
    """
    _check_all_padding(all_padding)
    if compute_dtype not in (torch.float64, torch.float32):
        raise ValueError(f"compute_dtype must be float64 or float32, got {compute_dtype}")
    x = x.to(compute_dtype)
    weight = weight.to(compute_dtype)
    batch, c_in, _ = x.shape
    c_out = weight.shape[0]
    w = weight.reshape(c_out, c_in, meta.v)  # [Cout, Cin, V]: w[o, c, cell] = weight[o, c*V + cell]
    y = torch.zeros(batch, c_out, meta.n_out, dtype=compute_dtype, device=x.device)
    # One neighbour slot k at a time, all output nodes n at once: the sum over k in the formula.
    for k in range(meta.k):
        real = meta.knn[k] != meta.n_in  # [Nout] False for padding neighbours
        neighbour = meta.knn[k].clamp(max=meta.n_in - 1)  # [Nout] any valid index; masked below
        # Padding is masked on both sides of the product: the gathered feature (so no gradient
        # reaches the clamped input) and the product (so an inf weight meets no padding).
        x_k = x.index_select(2, neighbour)  # [B, Cin, Nout] x[b, c, knn[k, n]]
        x_k = torch.where(real, x_k, 0.0)
        w_k = w.index_select(2, meta.rf_index[:, k])  # [Cout, Cin, Nout] w[o, c, rf_index[n, k]]
        y_k = torch.einsum("bcn,ocn->bon", x_k, w_k)  # [B, Cout, Nout] sum over c
        y = y + torch.where(real, y_k, 0.0)
    if bias is not None:
        y = y + bias.to(compute_dtype)[None, :, None]
    if all_padding == "zero":
        empty = meta.pad_mask.all(dim=0)  # [Nout] nodes whose neighbours are all padding
        y = torch.where(empty, 0.0, y)  # exactly 0, and no gradient to the bias from there
    return y


def knn_conv_reference_grads(
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
    autograd through :func:`knn_conv_reference` (same arguments). The inputs are used detached;
    every result is in ``compute_dtype``."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (x, weight)]
    if bias is not None:
        leaves.append(bias.detach().to(compute_dtype).requires_grad_())
    with torch.enable_grad():
        y = knn_conv_reference(
            leaves[0],
            leaves[1],
            leaves[2] if bias is not None else None,
            meta,
            all_padding=all_padding,
            compute_dtype=compute_dtype,
        )
        grads = torch.autograd.grad(y, leaves, grad_y.to(compute_dtype))
    return Quantities(y.detach(), grads[0], grads[1], grads[2] if bias is not None else None)


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
    return knn_conv_reference_grads(
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
