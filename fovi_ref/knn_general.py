"""The ``general`` backend: any K and V, padding anywhere, several neighbours per cell.

The operator

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

is computed in two steps that never build per-node weights (``Nout*Cout*Cin*K``) nor fovi's dense
one-hot ``local_rf`` product:

1. *Bin* the neighbours into their cells. ``z[b, c, v, n]`` is the sum of the features of node
   ``n``'s real neighbours that fall in cell ``v`` (zero for an empty cell)::

       z[b, c, v, n] = sum_{k : rf_index[n, k] = v, knn[k, n] real} x[b, c, knn[k, n]]

2. One shared GEMM over the ``Cin*V`` axis: ``y[b] = weight @ z[b]`` with ``z[b]`` viewed as
   ``[Cin*V, Nout]`` (the view is free: ``c*V + v`` is exactly the weight's column order).

Both gradients follow from the same two steps run backwards::

    grad_z[b]      = weight^T @ grad_y[b]                     # [Cin*V, Nout]
    grad_x[b, c, i] = sum_{(k, n) : knn[k, n] = i} grad_z[b, c, rf_index[n, k], n]
    grad_weight     = sum_b grad_y[b] @ z[b]^T                # [Cout, Cin*V]

Step 1 and the ``grad_x`` sum are the same kind of operation, a *segment sum* (each output slot
adds up the input slots listed for it), over the same list of (cell slot, neighbour) pairs with the
roles of source and destination swapped: the backward is the transpose of the forward gather.

A segment sum is usually written with ``index_add_``, whose CUDA kernel adds with atomics, so its
float rounding depends on thread timing. Here it runs in *rounds* instead: round ``r`` adds every
destination's ``r``-th contribution, no destination appears twice in a round, and so each round is
a plain gather followed by an ``index_copy_`` with distinct indices. The summation order is then
fixed (increasing ``k``) and both passes are deterministic on every device. There are as many
rounds as the largest number of contributions to one slot (a few for cells, ~K for inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovi_ref.meta import KNNMeta, PerMetaCache

__all__ = ["GeneralOps", "SegmentSumPlan", "build_segment_sum_plan", "segment_sum"]


@dataclass(frozen=True)
class SegmentSumPlan:
    """How to compute ``out[..., d] = sum_{(d, s) in entries} values[..., s]`` in rounds.

    Attributes:
        size: length ``D`` of the output's last axis.
        rounds: ``(dst, src)`` int64 pairs; within one round every ``dst`` entry is distinct.
    """

    size: int
    rounds: tuple[tuple[torch.Tensor, torch.Tensor], ...]


def build_segment_sum_plan(dst: torch.Tensor, src: torch.Tensor, size: int) -> SegmentSumPlan:
    """Split the entries ``(dst[e], src[e])`` into collision-free rounds.

    Entries that share a destination keep their relative order, so contributions are summed in
    the order the entries are listed.
    """
    order = torch.argsort(dst, stable=True)
    dst, src = dst[order], src[order]  # [E] grouped by destination
    count = torch.bincount(dst, minlength=size)  # [D] contributions per destination
    first = torch.cumsum(count, 0) - count  # [D] where each destination's group starts
    rank = torch.arange(dst.numel(), device=dst.device) - first[dst]  # [E] position in its group
    n_rounds = int(rank.max()) + 1 if rank.numel() else 0
    rounds = tuple((dst[rank == r], src[rank == r]) for r in range(n_rounds))
    return SegmentSumPlan(size, rounds)


def segment_sum(values: torch.Tensor, plan: SegmentSumPlan) -> torch.Tensor:
    """``out[..., d] = sum of values[..., s]`` over the plan's entries; ``[..., L] -> [..., D]``.

    float16 and bfloat16 values are summed in float32 and rounded once at the end, as a GEMM
    or ``index_add_`` kernel would; summing in 8 mantissa bits loses accuracy with every round.
    """
    acc_dtype = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else values.dtype
    out = values.new_zeros(*values.shape[:-1], plan.size, dtype=acc_dtype)
    for r, (dst, src) in enumerate(plan.rounds):
        picked = values.index_select(-1, src).to(acc_dtype)  # [..., |round|]
        if r > 0:  # round 0 writes into zeros; later rounds add to what is there
            picked = out.index_select(-1, dst) + picked
        out.index_copy_(-1, dst, picked)  # dst distinct within a round: no write collides
    return out.to(values.dtype)


@dataclass(frozen=True)
class _Plans:
    forward: SegmentSumPlan  # x [.., Nin] -> z [.., V*Nout]
    backward: SegmentSumPlan  # grad_z [.., V*Nout] -> grad_x [.., Nin]


_plans_cache = PerMetaCache(maxsize=64)


def _plans(meta: KNNMeta) -> _Plans:
    """The forward and backward segment-sum plans of ``meta`` (built once per meta)."""

    def build() -> _Plans:
        n = torch.arange(meta.n_out, device=meta.device).expand(meta.k, -1)  # [K, Nout]
        cell_slot = meta.rf_index.t() * meta.n_out + n  # [K, Nout] index of (v, n) in V*Nout
        real = ~meta.pad_mask  # [K, Nout] padding neighbours take no part, either way
        neighbour, slot = meta.knn[real], cell_slot[real]  # [E], k-major: sums run over k
        return _Plans(
            forward=build_segment_sum_plan(slot, neighbour, meta.v * meta.n_out),
            backward=build_segment_sum_plan(neighbour, slot, meta.n_in),
        )

    return _plans_cache.get(meta, None, build)


def _binned(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """Step 1: ``z [B, Cin*V, Nout]`` from ``x [B, Cin, Nin]``."""
    batch, c_in, _ = x.shape
    z = segment_sum(x, _plans(meta).forward)  # [B, Cin, V*Nout]
    return z.view(batch, c_in * meta.v, meta.n_out)  # [B, Cin*V, Nout]


class GeneralOps:
    """Ops-registry backend for every graph: segment-sum binning + one shared GEMM."""

    name = "general"

    @staticmethod
    def forward(
        meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [B, Cin, Nin]``, ``weight [Cout, Cin*V]``, ``bias [Cout]`` -> ``[B, Cout, Nout]``."""
        z = _binned(meta, x)  # [B, Cin*V, Nout]
        y = torch.matmul(weight, z)  # [B, Cout, Nout], weight broadcast over the batch
        if bias is not None:
            y = y + bias[:, None]
        return y

    @staticmethod
    def grad_input(meta: KNNMeta, grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]`` -> ``grad_x [B, Cin, Nin]``; padding gets nothing."""
        batch = grad_y.shape[0]
        grad_z = torch.matmul(weight.t(), grad_y)  # [B, Cin*V, Nout]
        grad_z = grad_z.view(batch, meta.in_channels, meta.v * meta.n_out)  # [B, Cin, V*Nout]
        return segment_sum(grad_z, _plans(meta).backward)  # [B, Cin, Nin]

    @staticmethod
    def grad_weight(meta: KNNMeta, grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, ``x [B, Cin, Nin]`` -> ``grad_weight [Cout, Cin*V]``."""
        z = _binned(meta, x)  # [B, Cin*V, Nout]
        # One GEMM contracting batch and nodes together: [Cout, B*Nout] @ [B*Nout, Cin*V].
        grad_y_2d = grad_y.transpose(0, 1).reshape(grad_y.shape[1], -1)  # [Cout, B*Nout]
        z_2d = z.transpose(0, 1).reshape(z.shape[1], -1)  # [Cin*V, B*Nout]
        return grad_y_2d @ z_2d.t()  # [Cout, Cin*V]
