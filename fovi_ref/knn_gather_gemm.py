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
type; the CPU value comes from the sweep of notebooks/03_scatter_matrix_budget.ipynb)
``grad_input`` takes the index path (``index_add_``) instead, with the same result.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fovi_ref.meta import KNNMeta, PerMetaCache

__all__ = ["DENSE_S_BUDGET", "GatherGemmOps", "forced_grad_input_path", "uses_dense_scatter"]

# Largest Nout*Nin for which grad_input multiplies by the dense S rather than scattering with
# index_add_. CPU: in the sweep of notebooks/03_scatter_matrix_budget.ipynb the two paths are
# within a few percent of each other up to ~1e3 elements and the index path wins above (by 2x at
# res18_ds2's 3e4); 128 keeps only the tiniest graphs on S (of the res18 downsamples, ds4 with 32
# elements, where the two measure the same). CUDA: not measured (no GPU was available); the seed
# design note sizes S for the res18 downsamples ("a few 1e4"), so the value keeps S dense up to
# 2**20 elements (4 MiB in float32), which covers all three.
DENSE_S_BUDGET: dict[str, int] = {"cpu": 128, "cuda": 2**20}


def uses_dense_scatter(meta: KNNMeta, device: torch.device) -> bool:
    """True when ``grad_input`` for ``meta`` on ``device`` multiplies by the dense ``S``."""
    return meta.n_out * meta.n_in <= DENSE_S_BUDGET.get(device.type, DENSE_S_BUDGET["cuda"])


@contextmanager
def forced_grad_input_path(path: str, device_type: str = "cpu") -> Iterator[None]:
    """Within the block, ``grad_input`` on ``device_type`` takes ``path`` ("dense" S GEMM or
    "index" scatter) whatever the graph's size; the budget is restored on exit. For measuring
    and testing the two paths against each other."""
    if path not in ("dense", "index"):
        raise ValueError(f"path must be 'dense' or 'index', got {path!r}")
    saved = DENSE_S_BUDGET.get(device_type)
    DENSE_S_BUDGET[device_type] = 2**62 if path == "dense" else -1
    try:
        yield
    finally:
        if saved is None:
            del DENSE_S_BUDGET[device_type]
        else:
            DENSE_S_BUDGET[device_type] = saved


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
        column = meta.input_linear[:, 0].contiguous()  # [Nout] (a strided column otherwise)
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


def _gathered_columns(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """``X [Cin, B*Nout]``: column ``(b, n)`` holds ``x[b, :, idx[n]]`` (0 for padding).

    This is the layout that lets ONE GEMM serve the whole batch: the batch folds into the GEMM's
    long axis next to the nodes. ``torch.gather`` along the contiguous node axis is several times
    faster on CPU than ``index_select`` there; the fold is one copy.
    """
    batch, c_in, _ = x.shape
    index, valid = _node_index(meta)
    x_sel = torch.gather(x, 2, index.expand(batch, c_in, -1))  # [B, Cin, Nout]
    if valid is not None:
        x_sel = x_sel.masked_fill(~valid, 0)  # exact zeros, even if x holds inf or nan
    return x_sel.transpose(0, 1).reshape(c_in, batch * meta.n_out)  # [Cin, B*Nout] (copy)


def _grad_y_batch_major(grad_y: torch.Tensor) -> torch.Tensor:
    """``[B, Cout, Nout] -> [Cout, B*Nout]`` (columns ordered batch, then node), the GEMM layout
    of :func:`_gathered_columns`."""
    return grad_y.transpose(0, 1).reshape(grad_y.shape[1], -1)  # copy unless already laid out so


class GatherGemmOps:
    """Ops-registry backend for the K=1/V=1 class: one gather + one dense GEMM.

    Per call, besides the GEMMs: ``forward`` gathers once and copies twice (fold the gathered
    columns, unfold the output with the bias added in the same pass); ``grad_input`` folds
    ``grad_y`` (a copy unless it arrives folded) and zero-fills plus scatters, or multiplies by
    ``S``; ``grad_weight`` folds ``grad_y`` and gathers again (it is given ``x``, not ``x_sel``).
    """

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
        batch = x.shape[0]
        y_folded = weight @ _gathered_columns(meta, x)  # [Cout, B*Nout]: the one GEMM
        y_view = y_folded.view(weight.shape[0], batch, meta.n_out).transpose(
            0, 1
        )  # [B, Cout, Nout]
        y = y_folded.new_empty(batch, weight.shape[0], meta.n_out)  # [B, Cout, Nout] contiguous
        if bias is None:
            return y.copy_(y_view)
        return torch.add(y_view, bias[:, None], out=y)  # unfold and add the bias in one pass

    @staticmethod
    def grad_input(meta: KNNMeta, grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]`` -> ``grad_x [B, Cin, Nin]`` by ``(W^T grad_y) S``."""
        batch, c_in = grad_y.shape[0], weight.shape[1]
        d_sel = weight.t() @ _grad_y_batch_major(grad_y)  # [Cin, B*Nout]
        if uses_dense_scatter(meta, grad_y.device):
            s = _scatter_matrix(meta, grad_y.dtype)  # [Nout, Nin]
            # Reorder the small d_sel to (b, c) rows first, so the GEMM writes grad_x in its
            # final contiguous layout (copying Nout columns is cheaper than copying Nin).
            d_rows = d_sel.view(c_in, batch, meta.n_out).transpose(0, 1)  # [B, Cin, Nout] view
            grad_x = d_rows.reshape(batch * c_in, meta.n_out) @ s  # [B*Cin, Nin]: one GEMM
            return grad_x.view(batch, c_in, meta.n_in)  # [B, Cin, Nin]
        # Index path: add each output node's gradient onto its input node.
        index, valid = _node_index(meta)
        d_sel = d_sel.view(c_in, batch, meta.n_out)  # [Cin, B, Nout]
        if valid is not None:
            index, d_sel = index[valid], d_sel[:, :, valid]  # padding receives nothing
        grad_x = d_sel.new_zeros(batch, c_in, meta.n_in)  # [B, Cin, Nin]
        grad_x.transpose(0, 1).index_add_(2, index, d_sel)  # through a [Cin, B, Nin] view
        return grad_x

    @staticmethod
    def grad_weight(meta: KNNMeta, grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, ``x [B, Cin, Nin]`` -> ``grad_weight [Cout, Cin]``."""
        # One GEMM contracting batch and nodes together: [Cout, B*Nout] @ [B*Nout, Cin].
        return _grad_y_batch_major(grad_y) @ _gathered_columns(meta, x).t()  # [Cout, Cin]
