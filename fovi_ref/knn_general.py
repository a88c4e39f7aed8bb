"""The ``general`` backend: any K and V, padding anywhere, several neighbours per cell.

The operator

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

is computed in two steps that never build per-node weights (``Nout*Cout*Cin*K``) nor fovi's dense
one-hot ``local_rf`` product:

1. *Bin* the neighbours into their cells. ``z[c, v, n, b]`` is the sum of the features of node
   ``n``'s real neighbours that fall in cell ``v`` (zero for an empty cell)::

       z[c, v, n, b] = sum_{k : rf_index[n, k] = v, knn[k, n] real} x[b, c, knn[k, n]]

2. ONE GEMM with the shared weight over all nodes and the whole batch: ``y = weight @ z`` with
   ``z`` viewed as ``[Cin*V, Nout*B]``; its row ``c*V + v`` is exactly the weight's column order.
   (Or, where few cells are occupied, one GEMM per cell: "Occupied cells" below.)

Both gradients follow from the same two steps run backwards::

    grad_z          = weight^T @ grad_y                               # [Cin*V, Nout*B]
    grad_x[b, c, i] = sum_{(k, n) : knn[k, n] = i} grad_z[c, rf_index[n, k], n, b]
    grad_weight     = grad_y @ z^T                                    # [Cout, Cin*V]

with ``grad_y`` folded to ``[Cout, Nout*B]``. Step 1 and the ``grad_x`` sum are both a *segment
sum* (each output row adds up the input rows listed for it) over one list of (cell row, neighbour
row) pairs, source and destination swapped: the backward is the forward gather transposed.

**Layout.** Features are *rows*, one per (channel, node) holding its ``B`` values: every gather
and scatter moves whole rows (0.15 ms against 10 ms along the last axis of ``[B, Cin, Nin]`` for
a res18 layer1 gather at batch 64 on a CPU), at the cost of one transposing copy in and one out
(the GEMM, bias inside, writes rows (node, batch)) and index lists ``Cin`` times the graph's.

**Determinism.** A segment sum is usually one ``index_add_``, which on CUDA adds with atomics.
:func:`segment_sum_naive` is that version, kept beside the one used: :func:`segment_sum` runs in
*rounds*, round ``r`` adding every destination's ``r``-th contribution (no destination twice in a
round: a row gather and an ``index_copy_``), so every row adds in increasing ``k``, the same on
every device. A *hub* row (more than :data:`HUB` terms: an input many outputs read) adds its terms
pairwise instead, a fixed tree of ``log2`` steps. Plans are sorts, ``O(E log E)`` for ``E``
entries. Tests hold the sums against ``index_add_``, the rounds against a loop over ``k``, bitwise.

**Channel blocks.** Where ``grad_z`` is large on a CPU (more than :data:`WHOLE_BYTES`; res18's
layer1 at batch 64: 52 MB), the input gradient runs in blocks of :func:`block_channels` input
channels: a block's ``grad_z`` is a slice of the weight's columns times ``grad_y``, and its sums
land in that block's rows of ``grad_x`` only (every entry stays in its channel). The allocator
reuses a block's memory and it stays in cache, where the whole ``grad_z`` is mapped fresh (page
faults) on every call: layer1's input gradient at batch 64 takes 0.6 of the time. Entries are
channel-major, so the first ``cb`` channels' entries plan every block (one extra plan, ``Cin /
cb`` times smaller) and every row adds in the whole plan's order: the same sums, bit for bit.

**Few samples.** At batch ``B <= FEW_SAMPLES`` a row of ``B`` values is too short to pay for its
index entry: the sums run over *node rows* instead, one per node holding its ``B*Cin`` values
(``[Nin, B*Cin]``, as fovi's layout stores each sample), with plans of one channel (``Cin`` times
fewer entries, the same rows in the same order: the same sums, bit for bit). The price is one
transposing copy of ``z`` into the GEMM's ``[B*Nout, Cin*V]`` and one of ``grad_z`` out of it;
in exchange the GEMM's rows are the ``(b, n)`` pairs, which *are* ``y``'s storage (no copy of
``y``). Measured side by side on a 2-core CPU: 0.5 to 0.85 of the time of the channel rows at
batch 1 to 4 on res18's layers, 0.95 to 1.1 at batch 8, 1.0 to 1.3 from batch 16.

**Occupied cells.** Most nodes leave some cells empty (27 to 62% of res18's ``(node, cell)``
pairs), and the dense GEMM multiplies their zeros. Over the ``T`` *occupied* pairs instead, sorted
cell-major, the products split by cell: with ``weight_v [Cout, Cin]`` cell ``v``'s columns and
``z_pairs [T*B, Cin]`` (row ``t*B + b``; the node-row sums write it directly, each pair a
destination)::

    u[block v]            = z_pairs[block v] @ weight_v^T           # [T_v*B, Cout]
    y[b, :, n]            = bias + sum over n's occupied cells of u[pair (n, v), b]
    grad_z_pairs[block v] = grad_y_pairs[block v] @ weight_v       # then summed back to x
    grad_weight_v         = grad_y_pairs[block v]^T @ z_pairs[block v]

with ``grad_y_pairs [T*B, Cout]`` gathered per pair. That is ``T / (Nout*V)`` of the products,
paid for with copies of the weight (permuted to ``[V, Cout, Cin]`` in the forward and again in
the backward, and ``grad_weight`` permuted back) and with traffic per pair (``u`` added to ``y``,
``grad_y``'s gather) that the dense path does not have. :func:`cells_estimate` models the time of
the per-cell path over the dense one,

    occupied * (1 + PAIR_COST / Cin) + WEIGHT_COST / (B * Nout),

the products kept, plus the pair traffic per product, plus the weight's copies per product. The
constants were fitted to forward + backward of both paths, timed side by side on res18's K > 1
graphs at batch 8 to 256 on a 2-core CPU. Where the estimate is 0.8 to 1.0, near the choice, it
fell within 0.13 of the measured ratio; far above, it overstates the loss (layer4.0.conv1 at
batch 8: 2.56 against 1.51). The GEMMs run per cell where it is at most :data:`CELLS_AT_MOST`
and the pair features fit in :data:`WHOLE_BYTES` (:func:`over_cells`). The choice is a pure
function of the graph and the batch, and so is the result. Measured there, per cell / dense:

==============  ========================================  ====================================
layer           chosen                                    not chosen
==============  ========================================  ====================================
layer4.0.conv2  0.78 (batch 32), 0.66 (64), 0.48 (256)    0.95 (16), 1.14 (8)
layer3.0.conv2  0.91 (16), 0.78 (64), 0.83 (256)          1.03 (8)
layer3.0.conv1  0.90 (64), 0.95 (256)                     1.00 (16), 1.16 (8)
layer4.0.conv1  0.81 (128), 0.75 (256)                    0.89 (64), 1.29 (16), 1.51 (8)
layer2.0.conv2  0.88 (16), 0.90 (64)                      1.48 (256, past WHOLE_BYTES)
layer2.0.conv1                                            1.04 to 1.21 (8 to 64)
layer1                                                    0.88 to 0.91 (8 to 32: a win the
                                                          estimate, 1.06, misses), 1.26 (64)
conv1                                                     13.5 to 15 (Cin = 3)
==============  ========================================  ====================================

At batch 4 and below it is 1.2 to 2.2: the weight's copies outweigh the products saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovi_ref.layout import fovi_layout_empty, linear_rows, y_from_rows
from fovi_ref.meta import Derived, KNNMeta

__all__ = ["CELLS_AT_MOST", "FEW_SAMPLES", "GeneralOps", "SegmentSumPlan", "block_channels",
           "build_segment_sum_plan", "cell_blocks", "cell_slices", "cells_estimate", "derive",
           "over_cells", "over_nodes", "segment_sum", "segment_sum_entries",
           "segment_sum_naive"]  # fmt: skip

NAME = "general"

HUB = 16  # most contributions a row sums in rounds (res18's rows: 15); more go in a tree

BLOCK_ROWS = 2**14  # most grad_z rows (c, v, n) in a channel block: 4 MiB of float32 at batch 64
# grad_z up to this size is computed whole: glibc maps larger blocks fresh on every call (its
# mmap threshold grows to at most 32 MiB); below it, blocks measured 1.0 to 1.7x slower.
WHOLE_BYTES = 32 * 2**20

FEW_SAMPLES = 4  # largest batch whose sums run over node rows (module docstring, "Few samples")


def over_nodes(batch: int) -> bool:
    """True when a batch of ``batch`` samples sums over node rows ``[N, B*Cin]`` (few samples),
    False when over channel rows ``[Cin*N, B]``."""
    return batch <= FEW_SAMPLES


@dataclass(frozen=True)
class SegmentSumPlan:
    """``out[d] = sum_{(d, s) in entries} values[s]`` (rows), ``size = D`` of them: ``first [D]``,
    every row's first source (dummy 0 if none; round 0 gathers them all), ``empty``, rows zeroed
    after round 0, ``rounds``, ``(dst, src)``, later contributions (``dst`` distinct in a round),
    and ``trees``, ``(dst [H], src [H*W], pad)``: hub rows (``HUB < count <= W = 2^j``), their
    sources padded with zero rows at ``pad``, summed by adding halves (``j`` adds, fixed order)."""

    size: int
    first: torch.Tensor
    empty: torch.Tensor
    rounds: tuple[tuple[torch.Tensor, ...], ...]
    trees: tuple[tuple[torch.Tensor, ...], ...] = ()

    def as_derived(self, prefix: str) -> Derived:
        """The plan as named tensors (``prefix.first``, ``prefix.round0.1``, ...), derived data."""
        data = {f"{prefix}.first": self.first, f"{prefix}.empty": self.empty}
        for kind, steps in (("round", self.rounds), ("tree", self.trees)):
            data |= {f"{prefix}.{kind}{r}.{i}": t for r, step in enumerate(steps)
                     for i, t in enumerate(step)}  # fmt: skip
        return data

    @classmethod
    def from_derived(cls, data: Derived, prefix: str) -> SegmentSumPlan:
        """The inverse of :meth:`as_derived`."""

        def steps(kind: str, width: int) -> tuple:  # looked up, not scanned: it runs per call
            found = []
            while f"{prefix}.{kind}{len(found)}.0" in data:
                step = len(found)
                found.append(tuple(data[f"{prefix}.{kind}{step}.{i}"] for i in range(width)))
            return tuple(found)

        first, empty = data[f"{prefix}.first"], data[f"{prefix}.empty"]
        return cls(first.shape[0], first, empty, steps("round", 2), steps("tree", 3))


def build_segment_sum_plan(dst: torch.Tensor, src: torch.Tensor, size: int) -> SegmentSumPlan:
    """Split the entries ``(dst[e], src[e])`` into collision-free rounds, and trees for the hubs;
    entries sharing a destination keep their order. Sorts only: ``O(E log E)`` for ``E`` entries."""
    order = torch.argsort(dst, stable=True)
    dst, src = dst[order], src[order]  # [E] grouped by destination
    count = torch.bincount(dst, minlength=size)  # [D] contributions per destination
    start = torch.cumsum(count, 0) - count  # [D] where each destination's group starts
    rank = torch.arange(dst.numel(), device=dst.device) - start[dst]  # [E] position in its group
    hub, first = count[dst] > HUB, dst.new_zeros(size)  # [E] entries of hub destinations, [D]
    first[dst[(rank == 0) & ~hub]] = src[(rank == 0) & ~hub]  # [D] round 0
    empty = (count == 0).nonzero().flatten()  # destinations nobody writes
    later = ((rank > 0) & ~hub).nonzero().flatten()  # [E'] entries of rounds 1, 2, ...
    later = later[torch.argsort(rank[later], stable=True)]  # [E'] round-major, one sort
    per_round = torch.bincount(rank[later])[1:].tolist()  # entries per round
    rounds = tuple(zip(dst[later].split(per_round), src[later].split(per_round), strict=True))
    trees, width = [], 2 ** torch.log2(count.clamp(min=1).double()).ceil().long()  # [D] W
    for w in width[dst[hub]].unique().tolist():  # one tree per width W
        of_w = hub & (width[dst] == w)  # [E] its entries
        hubs = dst[of_w & (rank == 0)]  # [H] its destinations, sorted
        slot = dst.new_full((hubs.numel() * w,), -1)  # [H*W] source rows, -1 = padding
        slot[torch.searchsorted(hubs, dst[of_w]) * w + rank[of_w]] = src[of_w]
        trees.append((hubs, slot.clamp(min=0), (slot < 0).nonzero().flatten()))
    return SegmentSumPlan(size, first, empty, rounds, tuple(trees))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:  # as a GEMM kernel's: 16 bits in 32
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def segment_sum(values: torch.Tensor, plan: SegmentSumPlan) -> torch.Tensor:
    """``out[d] = sum of values[s]`` over the plan's entries: ``[L, P] -> [D, P]``, in rounds
    (fixed summation order, deterministic on every device)."""
    acc_dtype = _accumulation_dtype(values.dtype)
    out = values.index_select(0, plan.first).to(acc_dtype)  # [D, P] round 0: whole rows
    if plan.empty.numel():
        out.index_fill_(0, plan.empty, 0)  # no contribution: exactly zero
    # Adds are in place: a third large temporary per round made a round of res18's layer1 at
    # batch 64 take 17 ms instead of 5 (its fresh memory is faulted in on every call).
    for dst, src in plan.rounds:  # later rounds add to what is there
        picked = out.index_select(0, dst).add_(values.index_select(0, src))  # in acc_dtype
        out.index_copy_(0, dst, picked)  # dst distinct within a round: no write collides
    for dst, src, pad in plan.trees:  # hubs: add the halves of W rows until one is left
        rows = values.index_select(0, src).to(acc_dtype).index_fill_(0, pad, 0)  # [H*W, P]
        rows = rows.view(dst.numel(), src.numel() // dst.numel(), values.shape[1])  # [H, W, P]
        while rows.shape[1] > 1:
            half = rows.shape[1] // 2
            rows = rows[:, :half].add_(rows[:, half:])
        out.index_copy_(0, dst, rows[:, 0])  # [H, P]
    return out.to(values.dtype)


def segment_sum_naive(values: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                      size: int) -> torch.Tensor:  # fmt: skip
    """The same sum as :func:`segment_sum`, written the usual way: one ``index_add_`` over the
    entries ``(dst[e], src[e])``. Its summation order is the kernel's (atomics on CUDA)."""
    acc_dtype = _accumulation_dtype(values.dtype)
    out = values.new_zeros(size, values.shape[1], dtype=acc_dtype)  # [D, P]
    return out.index_add_(0, dst, values.index_select(0, src).to(acc_dtype)).to(values.dtype)


def segment_sum_entries(meta: KNNMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z_row, x_row)``: the (cell row, input row) pair of every real neighbour of every node
    in every channel, channel-major then k-major (every row sums over increasing k):
    ``z_row = (c*V + rf_index[n, k])*Nout + n`` indexes ``z [Cin*V*Nout, B]``, ``x_row = c*Nin +
    knn[k, n]`` the rows ``[Cin*Nin, B]`` of ``x``. Padding neighbours take no part."""
    n = torch.arange(meta.n_out, device=meta.device).expand(meta.k, -1)  # [K, Nout]
    real = ~meta.pad_mask  # [K, Nout]
    node, cell, neighbour = n[real], meta.rf_index.t()[real], meta.knn[real]  # [E] k-major
    c = torch.arange(meta.in_channels, device=meta.device)[:, None]  # [Cin, 1]
    z_row = ((c * meta.v + cell) * meta.n_out + node).reshape(-1)  # [Cin*E] row (c, v, n)
    x_row = (c * meta.n_in + neighbour).reshape(-1)  # [Cin*E] row (c, i)
    return z_row, x_row


def block_channels(meta: KNNMeta) -> int:
    """Input channels per block of the input gradient: the largest divisor ``cb`` of ``Cin``
    with ``cb * V * Nout <= BLOCK_ROWS`` (1 if none), so one plan serves every block."""
    fits = max(1, BLOCK_ROWS // (meta.v * meta.n_out))
    return max(d for d in range(1, min(fits, meta.in_channels) + 1) if meta.in_channels % d == 0)


def derive(meta: KNNMeta) -> Derived:
    """The segment-sum plans of ``meta``, a pure function of it: forward, ``x`` rows
    ``[Cin*Nin, B]`` -> ``z`` rows ``[Cin*V*Nout, B]``; backward, the other way; where
    :func:`block_channels` ``cb < Cin``, ``backward_block``: the backward of ``cb`` channels;
    and ``forward_nodes``/``backward_nodes``, the same over node rows (one channel's entries:
    ``x`` row ``i``, ``z`` row ``v*Nout + n``) for few samples."""
    z_row, x_row = segment_sum_entries(meta)
    z_size, x_size = meta.v * meta.in_channels * meta.n_out, meta.in_channels * meta.n_in
    per_channel = z_row.numel() // meta.in_channels  # entries are channel-major: the first
    cells, inputs = z_row[:per_channel], x_row[:per_channel]  # channel 0's rows are node rows
    plans = {
        **build_segment_sum_plan(z_row, x_row, z_size).as_derived("forward"),
        **build_segment_sum_plan(x_row, z_row, x_size).as_derived("backward"),
        **build_segment_sum_plan(cells, inputs, meta.v * meta.n_out).as_derived("forward_nodes"),
        **build_segment_sum_plan(inputs, cells, meta.n_in).as_derived("backward_nodes"),
    }
    plans |= _cell_plans(meta, cells, inputs)
    cb = block_channels(meta)
    if cb < meta.in_channels:  # the first cb channels' entries plan every block
        first = cb * per_channel
        block = build_segment_sum_plan(x_row[:first], z_row[:first], cb * meta.n_in)
        plans |= block.as_derived("backward_block")
    return plans


def _cell_plans(meta: KNNMeta, cells: torch.Tensor, inputs: torch.Tensor) -> Derived:
    """The plans of the GEMMs per occupied cell, from one channel's entries ``(cells, inputs)``
    (cell row ``v*Nout + n``, input ``i``): the ``T`` occupied pairs are the distinct cell rows,
    sorted (cell-major). ``cells_forward``: node rows of ``x`` -> pair rows; ``cells_backward``:
    the other way; ``cells.node [T]``, each pair's node, and ``cells.node{v}``, cell ``v``'s
    (distinct: a node holds a cell once)."""
    pairs = torch.unique(cells)  # [T], sorted
    pair = torch.searchsorted(pairs, cells)  # [E] each entry's pair, the entries' order kept
    cell, node = pairs // meta.n_out, pairs % meta.n_out  # [T], [T]
    return {
        **build_segment_sum_plan(pair, inputs, pairs.numel()).as_derived("cells_forward"),
        **build_segment_sum_plan(inputs, pair, meta.n_in).as_derived("cells_backward"),
        "cells.node": node,
        **{f"cells.node{v}": node[cell == v] for v in range(meta.v)},
    }


def _binned(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """Step 1: ``z [Cin*V, Nout*B]`` from ``x [B, Cin, Nin]``."""
    plan = SegmentSumPlan.from_derived(meta.derived(NAME, derive), "forward")
    acc = _accumulation_dtype(x.dtype)  # widened in the copy below, z cannot overflow float16
    # [Cin*Nin, B], one copy: reshape could return a column-major view, ~30x slower to pick rows.
    x_rows = x.new_empty(meta.in_channels, meta.n_in, x.shape[0], dtype=acc)  # [Cin, Nin, B]
    x_rows.copy_(x.permute(1, 2, 0))
    z_rows = segment_sum(x_rows.view(meta.in_channels * meta.n_in, -1), plan)  # [Cin*V*Nout, B]
    return z_rows.view(meta.in_channels * meta.v, -1)  # [Cin*V, Nout*B]


def _node_rows(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """``x [B, Cin, Nin]`` as node rows ``[Nin, B*Cin]`` (widened to float32 from 16 bits), one
    copy: each sample's runs of ``Cin`` values, as fovi's layout stores them."""
    acc = _accumulation_dtype(x.dtype)
    x_nodes = x.new_empty(meta.n_in, x.shape[0], meta.in_channels, dtype=acc)
    return x_nodes.copy_(x.permute(2, 0, 1)).view(meta.n_in, -1)  # [Nin, B, Cin] -> [Nin, B*Cin]


def _transposed_back(rows: torch.Tensor, batch: int, c_in: int) -> torch.Tensor:
    """Node rows ``[N, B*Cin]`` -> ``[B, Cin, N]``, contiguous, in one copy: the transpose of
    the 2-D ``[N, B*Cin]`` (which ATen blocks) for ``N >= 32`` nodes beyond few samples, else
    the 3-D permute. Measured on a 2-core CPU, 2-D / 3-D: 0.37 to 0.87 at ``N`` 32 to 356 and
    batch 8 to 256; 0.9 to 1.2 at batch 4 and below; 1.8 to 7 at ``N`` 2 and 16 (layer3/4)."""
    if rows.shape[0] >= 32 and not over_nodes(batch):
        return rows.t().contiguous().view(batch, c_in, rows.shape[0])
    return rows.view(rows.shape[0], batch, c_in).permute(1, 2, 0).contiguous()


def _binned_nodes(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """Step 1 over node rows (few samples): ``z_rows [B*Nout, Cin*V]`` from ``x [B, Cin, Nin]``,
    row ``b*Nout + n``, column ``c*V + v``: the GEMM's operand, contiguous."""
    plan = SegmentSumPlan.from_derived(meta.derived(NAME, derive), "forward_nodes")
    batch, c_in, v, n_out = x.shape[0], meta.in_channels, meta.v, meta.n_out
    z_nodes = segment_sum(_node_rows(meta, x), plan)  # [V*Nout, B*Cin]
    z_rows = z_nodes.new_empty(batch, n_out, c_in, v)  # [B, Nout, Cin, V]
    z_rows.copy_(z_nodes.view(v, n_out, batch, c_in).permute(2, 1, 3, 0))
    return z_rows.view(batch * n_out, c_in * v)


def _grad_input_over_nodes(meta: KNNMeta, grad_y_cols: torch.Tensor, weight: torch.Tensor,
                           batch: int) -> torch.Tensor:  # fmt: skip
    """The input gradient over node rows (few samples): ``grad_y_cols [Cout, B*Nout]`` (columns
    ``(b, n)``) -> ``grad_x [B, Cin, Nin]``."""
    plan = SegmentSumPlan.from_derived(meta.derived(NAME, derive), "backward_nodes")
    c_in, v, n_out = meta.in_channels, meta.v, meta.n_out
    grad_z = grad_y_cols.t() @ weight  # [B*Nout, Cin*V]: rows (b, n), columns (c, v)
    grad_z_nodes = grad_z.new_empty(v, n_out, batch, c_in)  # [V, Nout, B, Cin]
    grad_z_nodes.copy_(grad_z.view(batch, n_out, c_in, v).permute(3, 1, 0, 2))
    grad_x_nodes = segment_sum(grad_z_nodes.view(v * n_out, -1), plan)  # [Nin, B*Cin]
    return _transposed_back(grad_x_nodes, batch, meta.in_channels)


def _cell_rows(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """``z_rows [Nout*B, Cin*V]``, the GEMM's operand: rows ``(b, n)`` for few samples, else
    ``(n, b)`` (a transposed view of :func:`_binned`'s ``z``)."""
    return _binned_nodes(meta, x) if over_nodes(x.shape[0]) else _binned(meta, x).t()


def _grad_y_columns(grad_y: torch.Tensor) -> torch.Tensor:
    """``[B, Cout, Nout] -> [Cout, Nout*B]``, its columns in :func:`_cell_rows`' row order: a view
    of what :meth:`GeneralOps.grad_y_layout` leaves."""
    if over_nodes(grad_y.shape[0]):
        return grad_y.transpose(0, 1).reshape(grad_y.shape[1], -1)  # columns (b, n)
    return grad_y.permute(1, 2, 0).reshape(grad_y.shape[1], -1)  # columns (n, b)


FEW_COLUMNS = 16  # largest Nout*B for which the GEMMs are arranged for few columns (see uses)


def _weight_t_times(weight: torch.Tensor, grad_y_cols: torch.Tensor) -> torch.Tensor:
    """``weight^T @ grad_y_cols``: ``[Cin*V, Cout] @ [Cout, M] -> [Cin*V, M]``, contiguous.
    Where ``M = Nout*B`` is at most :data:`FEW_COLUMNS` (layer4 at batch 5 to 8: fewer samples
    go over node rows, whose GEMM has this orientation already), MKL runs it as
    ``(grad_y_cols^T @ weight)^T`` 2 to 10 times faster (0.16 against 1.6 ms for layer4.0.conv2's
    sizes at batch 1 on a 2-core CPU), and the transposing copy is tiny; elsewhere it is not."""
    if grad_y_cols.shape[1] <= FEW_COLUMNS:
        return (grad_y_cols.t() @ weight).t().contiguous()
    return weight.t() @ grad_y_cols


# ------------------------------------------------------------------------- occupied cells
PAIR_COST = 30.0  # fitted (module docstring, "Occupied cells"): a pair's moves, per input channel
WEIGHT_COST = 30.0  # fitted: the weight's permuting copies, per GEMM row (b, n)
CELLS_AT_MOST = 0.9  # the estimate below which the GEMMs run per cell (error near it: <= 0.13)


def _pair_count(meta: KNNMeta) -> int:
    """``T``, the occupied ``(node, cell)`` pairs of ``meta``."""
    return meta.derived(NAME, derive)["cells.node"].shape[0]


def cells_estimate(meta: KNNMeta, batch: int) -> float:
    """The estimated time of forward + backward over occupied cells / dense, for ``batch``
    samples (module docstring, "Occupied cells")::

        occupied * (1 + PAIR_COST / Cin) + WEIGHT_COST / (B * Nout)

    ``occupied = T / (Nout*V)``, the share of ``(node, cell)`` pairs a real neighbour falls in:
    the share of the dense GEMMs' products that the per-cell GEMMs still run."""
    occupied = _pair_count(meta) / max(1, meta.n_out * meta.v)
    return occupied * (1 + PAIR_COST / meta.in_channels) + WEIGHT_COST / max(1, batch * meta.n_out)


def over_cells(meta: KNNMeta, batch: int) -> bool:
    """True when a batch of ``batch`` samples runs its GEMMs per occupied cell: few occupied
    cells and enough rows to pay for the weight's copies (:func:`cells_estimate`), and pair
    features ``[T*B, Cin]`` (float32) of at most :data:`WHOLE_BYTES`, beyond which every call maps
    them fresh (layer2.0.conv2 at batch 256, 69 MB: 1.5 times the dense time). Never for an empty
    batch or a graph without a real neighbour (no pair to run)."""
    pairs = _pair_count(meta)
    if batch == 0 or pairs == 0 or pairs * batch * meta.in_channels * 4 > WHOLE_BYTES:
        return False
    return cells_estimate(meta, batch) <= CELLS_AT_MOST


def cell_blocks(meta: KNNMeta) -> list[int]:
    """How many occupied pairs each cell holds, ``[T_0, ..., T_{V-1}]`` (shapes: no device sync)."""
    derived = meta.derived(NAME, derive)
    return [derived[f"cells.node{v}"].shape[0] for v in range(meta.v)]


def cell_slices(meta: KNNMeta, batch: int) -> list[tuple[int, slice, torch.Tensor]]:
    """``(v, rows, nodes)`` for every occupied cell: its block of pair rows (``t*B + b``) in
    cell-major ``[T*B, ...]`` storage, and the nodes ``[T_v]`` of its pairs."""
    derived, slices, start = meta.derived(NAME, derive), [], 0
    for v, count in enumerate(cell_blocks(meta)):
        if count:
            rows = slice(start * batch, (start + count) * batch)
            slices.append((v, rows, derived[f"cells.node{v}"]))
        start += count
    return slices


def _cell_weights(weight: torch.Tensor, n_cells: int, dtype: torch.dtype) -> torch.Tensor:
    """``weight [Cout, Cin*V]`` (column ``c*V + v``) -> ``[V, Cout, Cin]``, one copy: every cell's
    weights a contiguous matrix, as BLAS needs them."""
    c_out = weight.shape[0]
    cells = weight.new_empty(n_cells, c_out, weight.shape[1] // n_cells, dtype=dtype)
    return cells.copy_(weight.view(c_out, -1, n_cells).permute(2, 0, 1))


def _pair_features(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """Step 1 over occupied pairs: ``z_pairs [T*B, Cin]``, row ``t*B + b``, from ``x [B, Cin,
    Nin]``; the pairs are cell-major, so cell ``v``'s rows are one contiguous block."""
    plan = SegmentSumPlan.from_derived(meta.derived(NAME, derive), "cells_forward")
    return segment_sum(_node_rows(meta, x), plan).view(-1, meta.in_channels)  # [T*B, Cin]


def _pair_grad_y(meta: KNNMeta, grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y [B, Cout, Nout]`` -> ``[Cout, T*B]``, column ``t*B + b`` holding ``grad_y[b, :,
    node(t)]``: one gather of runs of ``B`` values in the ``[Cout, Nout, B]`` storage that
    :meth:`GeneralOps.grad_y_layout` leaves beyond few samples (any layout works)."""
    node = meta.derived(NAME, derive)["cells.node"]  # [T]
    return grad_y.permute(1, 2, 0).index_select(1, node).view(grad_y.shape[1], -1)


def _forward_over_cells(meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``(y, z_pairs)``: ``y`` starts as the bias; then per cell ``v``, ``u = z_pairs[block v] @
    weight_v^T`` (``[T_v*B, Cout]``) is added to the node rows of its pairs. A node holds a cell
    once, so no row is added to twice in one ``index_add_`` (deterministic, atomics or not), and
    every node adds its cells in increasing ``v``. (3 times faster than a segment sum over the
    ``u`` of all cells, which would gather and write back every row once per round.)"""
    batch, c_out = x.shape[0], weight.shape[0]
    z_pairs = _pair_features(meta, x)  # [T*B, Cin]
    weights = _cell_weights(weight, meta.v, z_pairs.dtype)  # [V, Cout, Cin]
    y_nodes = z_pairs.new_empty(meta.n_out, batch, c_out)  # [Nout, B, Cout]
    if bias is None:
        y_nodes.zero_()
    else:
        y_nodes.copy_(bias.to(y_nodes.dtype))
    for v, rows, nodes in cell_slices(meta, batch):
        u = z_pairs[rows] @ weights[v].t()  # [T_v*B, Cout]
        y_nodes.view(meta.n_out, -1).index_add_(0, nodes, u.view(nodes.numel(), -1))
    y = fovi_layout_empty(batch, c_out, meta.n_out, x)  # [B, Cout, Nout], storage [B, Nout, Cout]
    y.transpose(1, 2).copy_(y_nodes.transpose(0, 1))  # 16 bits: rounded once, here
    return y, z_pairs


def _grad_input_over_cells(meta: KNNMeta, grad_y: torch.Tensor,
                           weight: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``grad_x [B, Cin, Nin]``: per cell, ``grad_z_pairs[block v] = grad_y_pairs[block v]^T @
    weight_v``, then the forward's segment sum transposed, pairs -> inputs."""
    batch = grad_y.shape[0]
    g_pairs = _pair_grad_y(meta, grad_y)  # [Cout, T*B]
    weights = _cell_weights(weight, meta.v, weight.dtype)  # [V, Cout, Cin]
    grad_z = g_pairs.new_empty(g_pairs.shape[1], meta.in_channels)  # [T*B, Cin]
    for v, rows, _ in cell_slices(meta, batch):
        torch.mm(g_pairs[:, rows].t(), weights[v], out=grad_z[rows])
    plan = SegmentSumPlan.from_derived(meta.derived(NAME, derive), "cells_backward")
    grad_x_nodes = segment_sum(grad_z.view(-1, batch * meta.in_channels), plan)  # [Nin, B*Cin]
    return _transposed_back(grad_x_nodes, batch, meta.in_channels)


def _grad_weight_over_cells(meta: KNNMeta, grad_y: torch.Tensor,
                            z_pairs: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``grad_weight [Cout, Cin*V]``: per cell, ``grad_y_pairs[block v] @ z_pairs[block v]``
    (``[Cout, Cin]``, zero for a cell nobody occupies), put back in column order ``c*V + v``."""
    batch = grad_y.shape[0]
    g_pairs = _pair_grad_y(meta, grad_y.to(z_pairs.dtype))  # [Cout, T*B]
    per_cell = z_pairs.new_zeros(meta.v, g_pairs.shape[0], meta.in_channels)  # [V, Cout, Cin]
    for v, rows, _ in cell_slices(meta, batch):  # an empty cell's block stays zero
        torch.mm(g_pairs[:, rows], z_pairs[rows], out=per_cell[v])
    return per_cell.permute(1, 2, 0).reshape(g_pairs.shape[0], -1).to(grad_y.dtype)


class GeneralOps:
    """Ops-registry backend for every graph: row segment sums + one GEMM (or one per occupied
    cell, where :func:`over_cells` holds)."""

    name = NAME
    derive = staticmethod(derive)

    @staticmethod
    def grad_y_layout(grad_y: torch.Tensor) -> torch.Tensor:
        """``grad_y`` in ``[Cout, Nout, B]`` storage, or for few samples in fovi's (``[B, Nout,
        Cout]``, kept as it comes if it is): both gradients read its fold as a view."""
        if not over_nodes(grad_y.shape[0]):
            return grad_y.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # [B, Cout, Nout]
        if grad_y.transpose(1, 2).is_contiguous():
            return grad_y
        return grad_y.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Cout, Nout]

    @staticmethod
    def forward(meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """``x [B, Cin, Nin]``, ``weight``, ``bias`` -> ``y [B, Cout, Nout]`` (fovi's layout)."""
        return GeneralOps.forward_with_operand(meta, x, weight, bias)[0]

    @staticmethod
    def forward_with_operand(meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """``(y, z_rows)``: the forward and the binned cells ``z_rows [Nout*B, Cin*V]`` its GEMM
        read, kept for the weight gradient instead of ``x`` (as large as what fovi's ``F.linear``
        keeps), which spares the backward a second binning."""
        batch, c_out = x.shape[0], weight.shape[0]
        if over_cells(meta, batch):  # operand z_pairs [T*B, Cin]
            return _forward_over_cells(meta, x, weight, bias)
        if over_nodes(batch):  # rows (b, n): the GEMM writes y's storage
            z_rows = _binned_nodes(meta, x)  # [B*Nout, Cin*V]
            y_rows = linear_rows(z_rows, weight, bias).to(x.dtype)  # 16 bits: rounded once
            return y_from_rows(y_rows, batch, meta.n_out), z_rows
        z_rows = _binned(meta, x).t()  # [Nout*B, Cin*V], a transposed view
        if z_rows.shape[0] <= FEW_COLUMNS:
            # A few rows: weight-bound GEMMs run twice as fast on contiguous rows; a tiny copy.
            z_rows = z_rows.contiguous()
        y_rows = linear_rows(z_rows, weight, bias)  # [Nout*B, Cout]: the one GEMM (float32 z)
        y = fovi_layout_empty(batch, c_out, meta.n_out, x)  # [B, Cout, Nout], rounded once below
        # Rows come out ordered (node, batch); one copy puts them in (batch, node) order.
        y.transpose(1, 2).copy_(y_rows.view(meta.n_out, batch, c_out).transpose(0, 1))
        return y, z_rows

    @staticmethod
    def grad_input(meta: KNNMeta, grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]`` -> ``grad_x [B, Cin, Nin]``; padding gets nothing."""
        if over_cells(meta, grad_y.shape[0]):
            return _grad_input_over_cells(meta, grad_y, weight)
        batch, grad_y_cols = grad_y.shape[0], _grad_y_columns(grad_y)  # [Cout, Nout*B]
        derived, cb, v, n_in = meta.derived(NAME, derive), block_channels(meta), meta.v, meta.n_in
        if over_nodes(batch):
            return _grad_input_over_nodes(meta, grad_y_cols, weight, batch)
        whole_bytes = grad_y_cols.shape[1] * weight.shape[1] * weight.element_size()
        if cb == meta.in_channels or weight.device.type != "cpu" or whole_bytes <= WHOLE_BYTES:
            plan = SegmentSumPlan.from_derived(derived, "backward")
            grad_z = _weight_t_times(weight, grad_y_cols)  # [Cin*V, Nout*B]
            rows = grad_z.view(meta.in_channels * v * meta.n_out, batch)  # [Cin*V*Nout, B]
            grad_x_rows = segment_sum(rows, plan)  # [Cin*Nin, B]
        else:
            plan = SegmentSumPlan.from_derived(derived, "backward_block")
            grad_x_rows = grad_y.new_empty(meta.in_channels * n_in, batch, dtype=weight.dtype)
            for c in range(0, meta.in_channels, cb):  # the block of channels c .. c + cb - 1
                grad_z = weight[:, c * v : (c + cb) * v].t() @ grad_y_cols  # [cb*V, Nout*B]
                grad_x_rows[c * n_in : (c + cb) * n_in] = segment_sum(
                    grad_z.view(cb * v * meta.n_out, batch), plan
                )
        # A 2-D transpose (blocked in ATen): 3 to 6 times faster than the same 3-D permute copy.
        return grad_x_rows.t().contiguous().view(batch, meta.in_channels, meta.n_in)

    @staticmethod
    def grad_weight(meta: KNNMeta, grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_y [B, Cout, Nout]``, ``x [B, Cin, Nin]`` -> ``grad_weight [Cout, Cin*V]``."""
        operand = _pair_features(meta, x) if over_cells(meta, x.shape[0]) else _cell_rows(meta, x)
        return GeneralOps.grad_weight_of_operand(meta, grad_y, operand)

    @staticmethod
    def grad_weight_of_operand(meta: KNNMeta, grad_y: torch.Tensor,
                               z_rows: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """``grad_y [B, Cout, Nout]``, the binned ``z_rows [Nout*B, Cin*V]`` (float32 for 16-bit
        inputs; rows as :func:`_cell_rows` orders them) -> ``grad_weight [Cout, Cin*V]``: ONE GEMM
        ``[Cout, Nout*B] @ [Nout*B, Cin*V]``; or, over occupied cells, ``z_pairs [T*B, Cin]``
        and one GEMM per cell."""
        if over_cells(meta, grad_y.shape[0]):
            return _grad_weight_over_cells(meta, grad_y, z_rows)
        return (_grad_y_columns(grad_y).to(z_rows.dtype) @ z_rows).to(grad_y.dtype)
