"""The ``gather_gemm`` backend: the K = 1, V = 1 class (fovi-resnet18's downsample convs).

With one neighbour per output node and one reference cell, the general operator

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

has ``k = 0`` and ``rf_index = 0`` only, so it degenerates to a gather followed by ONE GEMM with a
weight shared by every node (``weight`` is ``[Cout, Cin]``)::

    x_sel[b, c, n] = x[b, c, idx[n]]                 (0 where the neighbour is padding)
    y[b]           = bias + weight @ x_sel[b]          [Cout, Cin] @ [Cin, Nout]

Gradients (derived in notebooks/02_algebraic_reduction.ipynb)::

    grad_weight = sum_b grad_y[b] @ x_sel[b]^T        one GEMM over the folded (b, n) axis
    grad_x[b]   = (weight^T @ grad_y[b]) @ S          S[n, i] = 1 if idx[n] = i (real neighbour)
    grad_bias   = sum_{b, n} grad_y[b, :, n]          one reduction (done by the autograd layer)

``S [Nout, Nin]`` is the dense one-hot *scatter matrix*. Multiplying by it sums the gradients of
output nodes that share an input (collisions) inside the GEMM's accumulators, and leaves padding
nodes' rows all zero. It is cached per (meta, dtype, device). Dense ``S`` costs ``Nout*Nin``
elements of memory and ``B*Cin*Nout*Nin`` multiply-adds, against ``B*Cin*Nout`` for an index
scatter, so it only pays while ``Nout*Nin`` is small: above :data:`DENSE_S_BUDGET` (per device
type, measured in notebooks/03_scatter_matrix_budget.ipynb) ``grad_input`` takes the index path
(``index_add_``) instead, with the same result.
"""

from __future__ import annotations

import torch

from fovi_ref.meta import KNNMeta, PerMetaCache

__all__ = ["DENSE_S_BUDGET", "GatherGemmOps", "uses_dense_scatter"]

# Largest Nout*Nin for which grad_input multiplies by the dense S rather than scattering with
# index_add_. The CPU value is where the two paths cost the same in the sweep of
# notebooks/03_scatter_matrix_budget.ipynb (that notebook re-derives it and checks this constant).
# CUDA: the seed design note sizes S for the res18 downsamples ("a few 1e4"); no GPU was available
# to sweep, so the value keeps S dense up to 2**20 elements (4 MiB in float32).
DENSE_S_BUDGET: dict[str, int] = {"cpu": 4096, "cuda": 2**20}


def uses_dense_scatter(meta: KNNMeta, device: torch.device) -> bool:
    """True when ``grad_input`` for ``meta`` on ``device`` multiplies by the dense ``S``."""
    return meta.n_out * meta.n_in <= DENSE_S_BUDGET.get(device.type, DENSE_S_BUDGET["cuda"])


def _check_k1_v1(meta: KNNMeta) -> None:
    if not (meta.k == 1 and meta.v == 1):
        raise ValueError(
            f"gather_gemm needs a meta with K == 1 and V == 1, got K={meta.k}, V={meta.v}"
        )


_index_cache = PerMetaCache(maxsize=64)


def _node_index(meta: KNNMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[Nout]`` gather index and validity mask, read from ``meta.input_linear``.

    For K = 1, column ``c = 0`` of ``input_linear`` holds ``0*Nin + idx[n] = idx[n]`` for a real
    neighbour and ``Cin*Nin`` (out of range) for padding. Returns ``(index, valid)``: ``index``
    has padding replaced by 0 so it is always safe to gather with, and ``valid [Nout]`` is the
    real-neighbour mask, or ``None`` when there is no padding (the res18 downsamples).
    Cached per meta.
    """
    _check_k1_v1(meta)

    def build() -> tuple[torch.Tensor, torch.Tensor | None]:
        column = meta.input_linear[:, 0]  # [Nout]
        valid = column < meta.n_in  # [Nout]
        if bool(valid.all()):
            return column, None
        return torch.where(valid, column, 0), valid

    return _index_cache.get(meta, None, build)


_scatter_cache = PerMetaCache(maxsize=32)


def _scatter_matrix(meta: KNNMeta, dtype: torch.dtype) -> torch.Tensor:
    """The cached one-hot ``S [Nout, Nin]`` in ``dtype`` on the meta's device.

    ``S[n, idx[n]] = 1`` for every real neighbour; padding rows are zero.
    """

    def build() -> torch.Tensor:
        index, valid = _node_index(meta)
        s = torch.zeros(meta.n_out, meta.n_in, dtype=dtype, device=meta.device)
        ones = torch.ones(meta.n_out, 1, dtype=dtype, device=meta.device)
        if valid is not None:
            ones = ones * valid[:, None]  # padding rows stay all-zero
        return s.scatter_(1, index[:, None], ones)  # [Nout, Nin]

    return _scatter_cache.get(meta, (dtype, meta.device), build)


def _gather(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """``x_sel [B, Cin, Nout]``: ``x[b, c, idx[n]]``, exactly 0 for padding neighbours."""
    index, valid = _node_index(meta)
    x_sel = x.index_select(2, index)  # [B, Cin, Nout]
    if valid is not None:
        x_sel = x_sel.masked_fill(~valid, 0)  # exact zeros, even if x holds inf or nan
    return x_sel


class GatherGemmOps:
    """Ops-registry backend for the K=1/V=1 class: index_select + one dense GEMM."""

    name = "gather_gemm"

    @staticmethod
    def supports(meta: KNNMeta) -> bool:
        """The routing predicate: only K = 1, V = 1 graphs."""
        return meta.k == 1 and meta.v == 1

    @staticmethod
    def forward(
        meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [B, Cin, Nin]``, ``weight [Cout, Cin]``, ``bias [Cout]`` -> ``[B, Cout, Nout]``."""
        x_sel = _gather(meta, x)  # [B, Cin, Nout]
        y = torch.matmul(weight, x_sel)  # [B, Cout, Nout]: one (batched) GEMM, shared weight
        if bias is not None:
            y = y + bias[:, None]
        return y

    @staticmethod
    def grad_input(meta: KNNMeta, grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]`` -> ``grad_x [B, Cin, Nin]`` by ``(W^T grad_y) S``."""
        batch = grad_y.shape[0]
        d_sel = torch.matmul(weight.t(), grad_y)  # [B, Cin, Nout]
        if uses_dense_scatter(meta, grad_y.device):
            s = _scatter_matrix(meta, grad_y.dtype)  # [Nout, Nin]
            grad_x = d_sel.reshape(-1, meta.n_out) @ s  # [B*Cin, Nin]: one GEMM
            return grad_x.view(batch, -1, meta.n_in)  # [B, Cin, Nin]
        # Index path: scatter each output node's gradient onto its input node.
        index, valid = _node_index(meta)
        if valid is not None:
            index, d_sel = index[valid], d_sel[:, :, valid]  # padding receives nothing
        grad_x = d_sel.new_zeros(batch, d_sel.shape[1], meta.n_in)  # [B, Cin, Nin]
        return grad_x.index_add_(2, index, d_sel)

    @staticmethod
    def grad_weight(meta: KNNMeta, grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, ``x [B, Cin, Nin]`` -> ``grad_weight [Cout, Cin]``."""
        x_sel = _gather(meta, x)  # [B, Cin, Nout]
        # One GEMM contracting batch and nodes together: [Cout, B*Nout] @ [B*Nout, Cin].
        grad_y_2d = grad_y.transpose(0, 1).reshape(grad_y.shape[1], -1)  # [Cout, B*Nout]
        x_sel_2d = x_sel.transpose(0, 1).reshape(x_sel.shape[1], -1)  # [Cin, B*Nout]
        return grad_y_2d @ x_sel_2d.t()  # [Cout, Cin]
