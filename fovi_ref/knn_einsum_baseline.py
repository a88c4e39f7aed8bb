"""The ``einsum_baseline`` backend: what fovi's ``KNNConvLayer`` does today, as a comparison point.

fovi computes the operator

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

in four steps: append a zero column to ``x`` for the padding index, gather every neighbour's
features, contract the neighbour axis against the dense one-hot ``local_rf [Nout, K, V]`` with an
einsum (one small matmul per node), and apply one ``F.linear`` over the ``Cin*V`` features. Its
backward is what autograd derives; :meth:`EinsumBaselineOps.grad_input` writes the same adjoint
steps by hand (the linear's, the einsum's, and a ``scatter_add_`` for the gather).

Written from that description (fovi at commit bf792c2, plus 2.4.0's ``.contiguous()`` before the
linear), it agrees bit for bit with fovi 2.4.0's ``KNNConvLayer`` on all 20 fovi-resnet18 layers
in float64, forward and gradients (``tests/test_fovi_upstream.py``), except that fovi 2.4.0's
layer zeroes all-padding nodes, which output the bias here as in the formula (no fovi-resnet18
graph has one). Non-finite inputs behave as in fovi: the one-hot einsum multiplies every gathered
feature by the zeros of the other cells, so with V > 1 an ``inf`` in ``x`` becomes ``nan``
(``inf * 0``) in the node's other cells and in every cell column of the weight gradient. And as
in fovi, a float16 cell is stored in float16 before the linear, so a cell past 65504 is ``inf``
where the output is finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fovi_ref.meta import Derived, KNNMeta

__all__ = ["EinsumBaselineOps", "derive"]

NAME = "einsum_baseline"


def derive(meta: KNNMeta) -> Derived:
    """fovi's dense one-hot ``local_rf [Nout, K, V]`` (float32; cast per call, exactly)."""
    return {"local_rf": meta.local_rf(torch.float32)}


def _cell_features(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """``[B, Nout, Cin*V]`` features per node and cell, fovi's input to ``F.linear``."""
    batch, c_in, _ = x.shape
    x_pad = torch.cat([x, x.new_zeros(batch, c_in, 1)], dim=2)  # [B, Cin, Nin+1]; n_in -> 0
    index = meta.knn.reshape(1, 1, -1).expand(batch, c_in, -1)  # [B, Cin, K*Nout]
    x_nbr = torch.gather(x_pad, 2, index).view(batch, c_in, meta.k, meta.n_out)  # [B, Cin, K, Nout]
    x_nbr = x_nbr.permute(0, 1, 3, 2).reshape(batch * c_in, meta.n_out, meta.k)  # [B*Cin, Nout, K]
    local_rf = meta.derived(NAME, derive)["local_rf"].to(x.dtype)  # [Nout, K, V] dense one-hot
    x_cells = torch.einsum("ank,nkv->anv", x_nbr, local_rf)  # [B*Cin, Nout, V]
    x_cells = x_cells.view(batch, c_in, meta.n_out, meta.v).permute(0, 2, 1, 3)  # [B, Nout, Cin, V]
    return x_cells.reshape(batch, meta.n_out, c_in * meta.v)  # [B, Nout, Cin*V]


class EinsumBaselineOps:
    """Ops-registry backend reproducing fovi's pad + gather + one-hot einsum + linear."""

    name = NAME
    derive = staticmethod(derive)

    @staticmethod
    def forward(
        meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [B, Cin, Nin]`` -> ``y [B, Cout, Nout]`` (a transposed view, as in fovi)."""
        return EinsumBaselineOps.forward_with_operand(meta, x, weight, bias)[0]

    @staticmethod
    def forward_with_operand(
        meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """``(y, features [B, Nout, Cin*V])``: ``F.linear``'s input, kept for the weight gradient
        as fovi's autograd keeps it (no second gather and einsum in the backward)."""
        # .contiguous() as in fovi 2.4.0: the features can come out of the einsum as a strided
        # view, and F.linear then sums in another order (the last bits differ).
        features = _cell_features(meta, x).contiguous()  # [B, Nout, Cin*V]
        # fovi's bias is a contiguous Parameter; F.linear adds a strided one after the GEMM,
        # rounding twice in float16/bfloat16 (check_ops' variant "bias a strided slice").
        bias = None if bias is None else bias.contiguous()
        return F.linear(features, weight, bias).transpose(1, 2), features  # y [B, Cout, Nout]

    @staticmethod
    def grad_input(meta: KNNMeta, grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]`` -> ``grad_x [B, Cin, Nin]``: the forward's steps, adjoint."""
        batch = grad_y.shape[0]
        c_in = weight.shape[1] // meta.v
        g = grad_y.transpose(1, 2) @ weight  # [B, Nout, Cin*V]    adjoint of F.linear
        g = g.view(batch, meta.n_out, c_in, meta.v).permute(0, 2, 1, 3)  # [B, Cin, Nout, V]
        g = g.reshape(batch * c_in, meta.n_out, meta.v)  # [B*Cin, Nout, V]
        local_rf = meta.derived(NAME, derive)["local_rf"].to(g.dtype)  # [Nout, K, V]
        g = torch.einsum("anv,nkv->ank", g, local_rf)  # [B*Cin, Nout, K]
        g = g.view(batch, c_in, meta.n_out, meta.k).permute(0, 1, 3, 2)  # [B, Cin, K, Nout]
        g = g.reshape(batch, c_in, meta.k * meta.n_out)  # [B, Cin, K*Nout]
        index = meta.knn.reshape(1, 1, -1).expand(batch, c_in, -1)  # [B, Cin, K*Nout]
        grad_x_pad = g.new_zeros(batch, c_in, meta.n_in + 1).scatter_add_(2, index, g)
        return grad_x_pad[:, :, : meta.n_in]  # [B, Cin, Nin]: drop the padding column

    @staticmethod
    def grad_weight(meta: KNNMeta, grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, ``x [B, Cin, Nin]`` -> ``grad_weight [Cout, Cin*V]``."""
        return EinsumBaselineOps.grad_weight_of_operand(meta, grad_y, _cell_features(meta, x))

    @staticmethod
    def grad_weight_of_operand(
        meta: KNNMeta, grad_y: torch.Tensor, features: torch.Tensor
    ) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, ``features [B, Nout, Cin*V]`` -> ``[Cout, Cin*V]``."""
        return torch.einsum("bon,bnf->of", grad_y, features)  # [Cout, Cin*V]
