"""Strategy *occupied cells*: one GEMM per cell, over the (node, cell) pairs that hold a
neighbour, where most cells are empty.

The textbook's GEMM ``y = bias + weight @ z`` multiplies every cell of every node, including
the zeros of empty cells (27 to 62% of res18's (node, cell) pairs are empty). Over the ``T``
*occupied* pairs, sorted cell-major, the product splits by cell. With ``weight_v [Cout, Cin]``
the columns of cell ``v`` and ``z_pairs [T*B, Cin]`` (row ``t*B + b``, the pairs' binned
features; a segment sum over node rows writes it, each pair a destination)::

    u[block v]            = z_pairs[block v] @ weight_v^T          # [T_v*B, Cout]
    y[b, :, n]            = bias + sum over n's occupied cells of u[pair (n, v), b]
    grad_z_pairs[block v] = grad_y_pairs[block v] @ weight_v       # then summed back to x
    grad_weight_v         = grad_y_pairs[block v]^T @ z_pairs[block v]

That is ``T / (Nout*V)`` of the textbook's products, paid for with copies of the weight
(permuted to ``[V, Cout, Cin]`` in each direction) and per-pair traffic (``u`` added into ``y``,
``grad_y`` gathered per pair) the textbook does not have. :func:`estimate` models the time of
this strategy over the textbook's as::

    occupied * (1 + PAIR_COST / Cin) + WEIGHT_COST / (B * Nout)

(the products kept, plus the pair traffic per product, plus the weight's copies per GEMM row),
and it runs where that is at most :data:`CELLS_AT_MOST`. The three constants are held together
by ``python -m fovi_ref bench --strategies``: its record of this strategy forced on and off on
res18's layers must be routed by the estimate as well as any value of the threshold could.

**16 bits.** Each cell's ``u`` is added into ``y`` after its GEMM, so the forward runs wide
whatever :func:`fovi_ref.precision.gemm_dtype` says (the pair features stay float32): a 16-bit
``u`` would be rounded once per cell, which the tolerance rule does not allow. The input
gradient's GEMMs sum in float32 too, and ``grad_z`` is stored once as the textbook stores it
(:func:`fovi_ref.precision.store_operand`: in ``gemm_dtype``, where every value fits).
:func:`fovi_ref.strategies.choose_strategy` takes this strategy only where the GEMMs run wide.
"""

from __future__ import annotations

import torch

from fovi_ref.knn_general import bin_entries
from fovi_ref.layout import fovi_layout_empty
from fovi_ref.meta import Derived, KNNMeta
from fovi_ref.precision import gemm_dtype, store_operand
from fovi_ref.segment_sum import (
    SegmentSumPlan,
    accumulation_dtype,
    build_segment_sum_plan,
    segment_sum,
)
from fovi_ref.strategies.node_rows import node_rows, to_fovi_input

__all__ = [
    "CELLS_AT_MOST",
    "PAIR_COST",
    "PAIR_BYTES",
    "WEIGHT_COST",
    "applies",
    "derive",
    "estimate",
    "forward_with_operand",
    "grad_input",
    "grad_weight_of_operand",
    "operand",
    "pair_count",
    "pair_features",
    "pairs",
    "pairs_per_cell",
    "reachable",
]

PAIR_COST = 30.0
"""A pair's moves, in units of one multiply-add per input channel (dimensionless); held with
:data:`CELLS_AT_MOST` to the record of ``bench --strategies``."""

WEIGHT_COST = 30.0
"""The weight's permuting copies, in units of one GEMM row ``(b, n)`` (dimensionless); held
with :data:`PAIR_COST`."""

CELLS_AT_MOST = 0.9
"""The :func:`estimate` (time per cell / time of the textbook) at or below which this strategy
runs: below 1, leaving room for the estimate's error near the choice. Set by ``bench
--strategies``."""

PAIR_BYTES = 32 * 2**20
"""Largest pair features ``[T*B, Cin]`` (bytes, float32) this strategy allocates: glibc maps
larger blocks fresh on every call (its mmap threshold grows to at most 32 MiB), a page fault per
page. The same reason as :data:`fovi_ref.strategies.channel_blocks.WHOLE_BYTES`'s, which
``bench --strategies`` times; this one it does not."""


def pair_count(data: Derived) -> int:
    """``T``, the occupied (node, cell) pairs, from the data :func:`pairs` derived."""
    return data["cell_node"].shape[0]


def estimate(meta: KNNMeta, pairs: int, batch: int) -> float:
    """The modelled time of forward + backward per occupied cell over the textbook's, for
    ``pairs`` occupied pairs and ``batch`` samples (module docstring)."""
    occupied = pairs / max(1, meta.n_out * meta.v)
    per_row = WEIGHT_COST / max(1, batch * meta.n_out)
    return occupied * (1 + PAIR_COST / meta.in_channels) + per_row


def applies(meta: KNNMeta, data: Derived, batch: int) -> bool:
    """True when ``batch`` samples run per occupied cell: the estimate pays and the pair
    features fit in :data:`PAIR_BYTES`. Never for an empty batch or a graph of padding only."""
    pairs = pair_count(data)
    if batch == 0 or pairs == 0 or pairs * batch * meta.in_channels * 4 > PAIR_BYTES:
        return False
    return estimate(meta, pairs, batch) <= CELLS_AT_MOST


def reachable(meta: KNNMeta, data: Derived) -> bool:
    """True when some batch runs per occupied cell: the estimate falls as the batch grows, so
    the largest batch whose pair features fit decides."""
    largest = PAIR_BYTES // max(1, pair_count(data) * meta.in_channels * 4)
    return largest >= 1 and applies(meta, data, largest)


def _one_channel(meta: KNNMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cells, inputs, pairs)``: channel 0's entries (cell row ``v*Nout + n``, input ``i``) and
    the occupied cell rows ``[T]``, sorted (cell-major)."""
    z_row, x_row = bin_entries(meta)
    per_channel = z_row.numel() // meta.in_channels
    cells = z_row[:per_channel]  # [E]
    return cells, x_row[:per_channel], torch.unique(cells)


def pairs(meta: KNNMeta) -> Derived:
    """``cell_node [T]``, each occupied pair's node, and ``cell_pairs [V]``, how many pairs each
    cell holds (a node holds a cell once): cheap, and all the choice needs."""
    _, _, occupied = _one_channel(meta)
    return {
        "cell_node": occupied % meta.n_out,
        "cell_pairs": torch.bincount(occupied // meta.n_out, minlength=meta.v),
    }


def derive(meta: KNNMeta) -> Derived:
    """:func:`pairs`, and the plans: ``cell_bin``, node rows of ``x`` -> pair rows;
    ``cell_unbin``, the other way."""
    cells, inputs, occupied = _one_channel(meta)
    pair = torch.searchsorted(occupied, cells)  # [E] each entry's pair, the entries' order kept
    bin_plan = build_segment_sum_plan(pair, inputs, occupied.numel())
    unbin_plan = build_segment_sum_plan(inputs, pair, meta.n_in)
    return {
        **pairs(meta),
        **bin_plan.as_derived("cell_bin"),
        **unbin_plan.as_derived("cell_unbin"),
    }


def pairs_per_cell(data: Derived) -> list[int]:
    """``[T_0, ..., T_{V-1}]``, the occupied pairs of each cell."""
    return data["cell_pairs"].tolist()


def _cell_slices(data: Derived, batch: int) -> list[tuple[int, slice, torch.Tensor]]:
    """``(v, rows, nodes)`` per occupied cell: its block of pair rows ``t*B + b`` and the nodes
    ``[T_v]`` of its pairs."""
    slices = []
    start = 0
    for v, count in enumerate(pairs_per_cell(data)):
        if count:
            rows = slice(start * batch, (start + count) * batch)
            slices.append((v, rows, data["cell_node"][start : start + count]))
        start += count
    return slices


def _cell_weights(weight: torch.Tensor, n_cells: int, dtype: torch.dtype) -> torch.Tensor:
    """``weight [Cout, Cin*V]`` (column ``c*V + v``) -> ``[V, Cout, Cin]`` in one copy: each
    cell's weights one contiguous matrix, as BLAS wants them."""
    c_out = weight.shape[0]
    cells = weight.new_empty(n_cells, c_out, weight.shape[1] // n_cells, dtype=dtype)
    return cells.copy_(weight.view(c_out, -1, n_cells).permute(2, 0, 1))


def pair_features(meta: KNNMeta, data: Derived, x: torch.Tensor) -> torch.Tensor:
    """``x [B, Cin, Nin] -> z_pairs [T*B, Cin]``, row ``t*B + b``: cell ``v``'s rows are one
    contiguous block (the pairs are cell-major)."""
    plan = SegmentSumPlan.from_derived(data, "cell_bin")
    return segment_sum(node_rows(meta, x), plan).view(-1, meta.in_channels)


operand = pair_features  # what the weight gradient reads: z_pairs [T*B, Cin]


def _pair_grad_y(data: Derived, grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y [B, Cout, Nout] -> [Cout, T*B]``, column ``t*B + b`` holding ``grad_y[b, :,
    node(t)]`` (any layout of ``grad_y``)."""
    return grad_y.permute(1, 2, 0).index_select(1, data["cell_node"]).view(grad_y.shape[1], -1)


def forward_with_operand(
    meta: KNNMeta, data: Derived, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, z_pairs)``: ``y`` starts as the bias, and each cell's ``u`` is added to the node
    rows of its pairs. A node holds a cell once, so an ``index_add_`` never adds to one row
    twice (deterministic, atomics or not) and every node adds its cells in increasing ``v``."""
    batch = x.shape[0]
    c_out = weight.shape[0]
    z_pairs = pair_features(meta, data, x)  # [T*B, Cin]
    weights = _cell_weights(weight, meta.v, z_pairs.dtype)  # [V, Cout, Cin]
    y_nodes = z_pairs.new_empty(meta.n_out, batch, c_out)  # [Nout, B, Cout]
    if bias is None:
        y_nodes.zero_()
    else:
        y_nodes.copy_(bias.to(y_nodes.dtype))
    for v, rows, nodes in _cell_slices(data, batch):
        u = z_pairs[rows] @ weights[v].t()  # [T_v*B, Cout]
        y_nodes.view(meta.n_out, -1).index_add_(0, nodes, u.view(nodes.numel(), -1))
    y = fovi_layout_empty(batch, c_out, meta.n_out, x)  # [B, Cout, Nout]
    y.transpose(1, 2).copy_(y_nodes.transpose(0, 1))  # 16 bits: rounded once, here
    return y, z_pairs


def grad_input(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``grad_x [B, Cin, Nin]``: per cell ``grad_z_pairs = grad_y_pairs^T @ weight_v`` (summed in
    float32 for 16-bit calls, then stored once), then the pair sums transposed (pairs ->
    inputs)."""
    batch = grad_y.shape[0]
    # A cell's GEMM writes its block of one buffer, so the blocks sum in float32 (exact 16-bit
    # products) and the whole grad_z is stored once, as the textbook's is.
    acc = accumulation_dtype(gemm_dtype(grad_y.device, grad_y.dtype))
    g_pairs = _pair_grad_y(data, grad_y.to(acc))  # [Cout, T*B]
    weights = _cell_weights(weight, meta.v, acc)  # [V, Cout, Cin]
    grad_z = g_pairs.new_empty(g_pairs.shape[1], meta.in_channels)  # [T*B, Cin]
    for v, rows, _ in _cell_slices(data, batch):
        torch.mm(g_pairs[:, rows].t(), weights[v], out=grad_z[rows])
    grad_z = store_operand(grad_z, grad_y.dtype)
    plan = SegmentSumPlan.from_derived(data, "cell_unbin")
    grad_z_pairs = grad_z.view(pair_count(data), batch * meta.in_channels)  # [T, B*Cin]
    grad_x_nodes = segment_sum(grad_z_pairs, plan)  # [Nin, B*Cin]
    return to_fovi_input(grad_x_nodes, batch, meta.in_channels, grad_y.dtype)


def grad_weight_of_operand(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, z_pairs: torch.Tensor
) -> torch.Tensor:
    """``grad_weight [Cout, Cin*V]``: per cell ``grad_y_pairs @ z_pairs`` (``[Cout, Cin]``, zero
    for a cell nobody occupies), put back in column order ``c*V + v``."""
    batch = grad_y.shape[0]
    g_pairs = _pair_grad_y(data, grad_y.to(z_pairs.dtype))  # [Cout, T*B]
    per_cell = z_pairs.new_zeros(meta.v, g_pairs.shape[0], meta.in_channels)  # [V, Cout, Cin]
    for v, rows, _ in _cell_slices(data, batch):
        torch.mm(g_pairs[:, rows], z_pairs[rows], out=per_cell[v])
    return per_cell.permute(1, 2, 0).reshape(g_pairs.shape[0], -1).to(grad_y.dtype)
