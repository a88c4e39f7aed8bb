"""Contenders: zero-argument callables that run one forward and one backward (gradients of
``x``, ``weight`` and ``bias``), built for the backends, for fovi's own autograd path, and for
the two floors:

- the **Conv2d floor**: ``F.conv2d`` 1x1 stride 2 with the same channels on the smallest square
  grid with at least ``Nout`` outputs (what a dense CNN pays for a downsample);
- the **GEMM floor**: the three GEMMs that every implementation which applies the shared weight
  to per-cell features runs (forward ``[B*Nout, Cin*V] @ [Cin*V, Cout]``, the input-gradient and
  the weight-gradient GEMMs of the same sizes, each in its fastest orientation) plus
  zero-filling the input gradient, nothing else. For K = V = 1 that is all a downsample needs;
  for K > 1 it bounds from below what any such implementation, fovi's einsum included, can
  reach.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fovi_ref import KNNMeta, get_ops
from fovi_ref.check.bench.timing import time_contenders
from fovi_ref.check.operands import forward_and_grads, sample_operands
from fovi_ref.grid import square_grid_for
from fovi_ref.knn_einsum_baseline import EinsumBaselineOps
from fovi_ref.precision import gemm_dtype
from fovi_ref.strategies import GeneralOps, occupied_cells

__all__ = [
    "Contender",
    "Inputs",
    "conv2d_floor",
    "fovi_einsum",
    "gemm_floor",
    "knn_backend",
    "knn_backend_direct",
    "make_inputs",
    "through",
]

Contender = Callable[[], object]


# --------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Inputs:
    """One layer's operands: ``x [B, Cin, Nin]``, ``weight [Cout, Cin*V]``, ``bias [Cout]``
    (all requiring grad) and a fixed upstream gradient ``grad_y [B, Cout, Nout]``."""

    meta: KNNMeta
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    grad_y: torch.Tensor


def make_inputs(
    meta: KNNMeta, out_channels: int, batch: int, dtype: torch.dtype, seed: int = 0
) -> Inputs:
    """:func:`~fovi_ref.check.operands.sample_operands` on ``meta``'s device, ``x``, ``weight``
    and ``bias`` requiring grad."""
    x, w, b, grad_y = sample_operands(meta, out_channels, batch=batch, seed=seed, dtype=dtype)
    return Inputs(meta, x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), grad_y)


# ------------------------------------------------------------------------------ contenders
def through(inputs: Inputs, conv) -> Contender:
    """Forward + backward of ``conv`` on ``inputs`` by the one runner
    (:func:`~fovi_ref.check.operands.forward_and_grads`): ``conv`` is a backend's name, an ops
    object, or a callable ``f(x, weight, bias) -> y``."""
    operands = (inputs.x, inputs.weight, inputs.bias, inputs.meta, inputs.grad_y)

    def run():
        return forward_and_grads(*operands, conv)

    return run


def knn_backend(inputs: Inputs, backend: str) -> Contender:
    """Forward + backward through :func:`fovi_ref.knn_conv` on ``backend``."""
    return through(inputs, backend)


def knn_backend_direct(inputs: Inputs, backend: str) -> Contender:
    """The same arithmetic calling the backend's three functions directly: no custom op, no
    autograd. ``knn_backend / knn_backend_direct`` is the cost of the custom-op boundary."""
    ops, meta = get_ops(backend), inputs.meta
    x, w, b, grad_y = (t.detach() for t in (inputs.x, inputs.weight, inputs.bias, inputs.grad_y))

    def run():
        y = ops.forward(meta, x, w, b)  # kept alive through the backward, as autograd keeps it
        grads = (
            ops.grad_input(meta, grad_y, w),
            ops.grad_weight(meta, grad_y, x),
            grad_y.sum((0, 2)),
        )
        return y, grads

    return run


def fovi_einsum(inputs: Inputs) -> Contender:
    """fovi today: plain autograd through the einsum baseline's forward (no custom op), so its
    backward is what autograd derives, as in fovi's ``KNNConvLayer`` (see
    :mod:`fovi_ref.knn_einsum_baseline` for how closely it matches)."""
    meta = inputs.meta
    return through(inputs, lambda x, w, b: EinsumBaselineOps.forward(meta, x, w, b))


def _per_cell_products(inputs: Inputs) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """The three products of ``general`` over occupied cells, each a loop of one GEMM per cell
    on operands laid out beforehand: pair features ``[T*B, Cin]``, pair gradients ``[T*B,
    Cout]`` (row ``t*B + b``, cell-major blocks) and per-cell weights ``[V, Cout, Cin]``."""
    meta, like = inputs.meta, inputs.x
    batch, c_out = inputs.grad_y.shape[:2]
    data = meta.derived(GeneralOps.name, GeneralOps.derive)
    blocks = []  # (v, rows of cell v's block)
    start = 0
    for v, count in enumerate(occupied_cells.pairs_per_cell(data)):
        if count:
            blocks.append((v, slice(start * batch, (start + count) * batch)))
        start += count
    rows = batch * start  # T*B
    acc = gemm_dtype(like.device, like.dtype)
    z = torch.randn(rows, meta.in_channels, device=like.device).to(acc)  # [T*B, Cin]
    g = torch.randn(rows, c_out, device=like.device).to(acc)  # [T*B, Cout]
    w = torch.randn(meta.v, c_out, meta.in_channels, device=like.device).to(acc)
    return {
        "forward": lambda: [z[r] @ w[v].t() for v, r in blocks],
        "input gradient": lambda: [g[r] @ w[v] for v, r in blocks],
        "weight gradient": lambda: [g[r].t() @ z[r] for v, r in blocks],
    }


def conv2d_floor(inputs: Inputs) -> Contender:
    """``F.conv2d`` 1x1 stride 2 on the smallest square grid with >= ``Nout`` outputs (K = 1)."""
    meta = inputs.meta
    side_in, side_out = square_grid_for(meta.n_out)
    like = inputs.x
    batch, c_out = inputs.grad_y.shape[:2]
    image = torch.randn(batch, meta.in_channels, side_in, side_in, device=like.device)
    image = image.to(like.dtype).requires_grad_()
    weight = inputs.weight.detach()[:, : meta.in_channels].reshape(c_out, meta.in_channels, 1, 1)
    weight = weight.clone().requires_grad_()
    bias = inputs.bias.detach().clone().requires_grad_()
    grad_y = torch.randn(batch, c_out, side_out, side_out, device=like.device).to(like.dtype)

    def run():
        y = F.conv2d(image, weight, bias, stride=2)
        return torch.autograd.grad(y, (image, weight, bias), grad_y)

    return run


def gemm_floor(inputs: Inputs, trials: int = 5, *, cells: bool = False) -> Contender:
    """The three GEMMs of this layer's sizes plus zero-filling ``grad_x``, nothing else.

    A GEMM's speed depends on the orientation of its operands (on a 2-core CPU, MKL runs
    ``[Cin, B*Nout] = W^T G`` up to 1.7x slower than the same product written as
    ``[B*Nout, Cin] = G^T W``), and an implementation may pick any. So for each of the three
    products this times every orientation ``trials`` times when the contender is built and keeps
    the fastest: the floor is the best any implementation running these GEMMs can do. With
    ``cells`` (K > 1 graphs) the candidates include each product run per occupied cell, one GEMM
    per cell over only the ``(node, cell)`` pairs a real neighbour falls in (as ``general`` runs
    them where :func:`fovi_ref.strategies.choose_strategy` picks occupied cells), operands laid
    out beforehand: the
    dense GEMMs multiply the empty cells' zeros too, so a cell-skipping implementation could
    otherwise run below the floor. For 16-bit inputs the GEMMs run in
    :func:`fovi_ref.precision.gemm_dtype`, the faster of a 16-bit and a float32 GEMM on this
    device as ``bench --gemm-dtypes`` measured it (both accumulate in float32): an emulated
    16-bit GEMM would put the floor above what a float32 one reaches.
    """
    meta, like = inputs.meta, inputs.x
    batch, c_out = inputs.grad_y.shape[:2]
    features, rows = meta.in_channels * meta.v, batch * meta.n_out
    acc = gemm_dtype(like.device, like.dtype)  # 16-bit inputs: the faster GEMM here

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=like.device).to(acc)

    w = inputs.weight.detach().to(acc)  # [Cout, F]
    x_rows, g_rows = randn(rows, features), randn(rows, c_out)  # [B*Nout, F], [B*Nout, Cout]
    x_cols, g_cols = x_rows.t().contiguous(), g_rows.t().contiguous()  # [F, ...], [Cout, ...]
    orientations = {
        "forward": [lambda: x_rows @ w.t(), lambda: w @ x_cols],
        "input gradient": [lambda: g_rows @ w, lambda: g_cols.t() @ w, lambda: w.t() @ g_cols],
        "weight gradient": [
            lambda: g_rows.t() @ x_rows,
            lambda: g_cols @ x_rows,
            lambda: g_cols @ x_cols.t(),
        ],
    }
    if cells:
        for product, per_cell in _per_cell_products(inputs).items():
            orientations[product].append(per_cell)
    fastest = []
    for candidates in orientations.values():
        times = time_contenders(dict(enumerate(candidates)), repeats=trials, warmup=1)
        fastest.append(candidates[min(times, key=times.get)])

    def run():
        grad_x = torch.zeros(
            batch, meta.in_channels, meta.n_in, device=like.device, dtype=like.dtype
        )
        return *(gemm() for gemm in fastest), grad_x

    return run
