"""The float64 oracle: the KNN convolution written straight from its formula.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

with padding neighbours (``knn[k, n] == n_in``) skipped. Loops over ``n`` and ``k``, works in
float64 whatever the inputs' dtype, and shares no code with any backend, so it can judge them all.
It loops over the neighbour slot ``k`` and builds every node's own weight matrix, which no fast
backend may do; slow and memory-hungry is fine here, every line is the formula.
"""

from __future__ import annotations

import torch

from fovi_ref.meta import KNNMeta

__all__ = ["knn_conv_reference"]


def knn_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, meta: KNNMeta
) -> torch.Tensor:
    """Naive KNN convolution in float64.

    Args:
        x: ``[B, Cin, Nin]``. weight: ``[Cout, Cin*V]`` (column ``c*V + cell``).
        bias: ``[Cout]`` or ``None``. meta: the graph.

    Returns:
        ``y [B, Cout, Nout]`` in float64, on ``x``'s device. Differentiable, so autograd through
        it gives the reference gradients too.
    """
    x = x.double()
    weight = weight.double()
    batch, c_in, _ = x.shape
    c_out = weight.shape[0]
    w = weight.reshape(c_out, c_in, meta.v)  # [Cout, Cin, V]: w[o, c, cell] = weight[o, c*V + cell]
    y = torch.zeros(batch, c_out, meta.n_out, dtype=torch.float64, device=x.device)
    # One neighbour slot k at a time, all output nodes n at once: the sum over k in the formula.
    for k in range(meta.k):
        real = meta.knn[k] != meta.n_in  # [Nout] False for padding neighbours
        neighbour = meta.knn[k].clamp(max=meta.n_in - 1)  # [Nout] padding rows are zeroed below
        x_k = torch.where(real, x[:, :, neighbour], 0.0)  # [B, Cin, Nout] x[b, c, knn[k, n]]
        w_k = w[:, :, meta.rf_index[:, k]]  # [Cout, Cin, Nout] weight[o, c*V + rf_index[n, k]]
        y += torch.einsum("bcn,ocn->bon", x_k, w_k)  # sum over c
    if bias is not None:
        y = y + bias.double()[None, :, None]
    return y
