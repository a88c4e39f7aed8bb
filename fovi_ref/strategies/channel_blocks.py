"""Strategy *channel blocks*: the textbook's input gradient a block of input channels at a time,
where its ``grad_z`` is large on a CPU.

``grad_z = weight^T @ grad_y`` is ``[Cin*V, Nout*B]``; every entry of the unbinning sum stays in
its channel, so a block of ``cb`` channels needs only its slice of the weight's columns::

    grad_z[block]      = weight[:, block]^T @ grad_y        # [cb*V, Nout*B]
    grad_x_rows[block] = segment sum of grad_z[block]       # [cb*Nin, B]

Why it pays: a ``grad_z`` beyond :data:`WHOLE_BYTES` is mapped fresh by glibc on every call (a
page fault per page), while a block of at most :data:`BLOCK_ROWS` rows is reused by the allocator
and stays in cache. Whether that saves time on a given machine is for ``bench --strategies`` to
say; either way a block bounds the memory ``grad_z`` takes to ``BLOCK_ROWS`` rows.

The entries are channel-major, so the first ``cb`` channels' entries plan
every full block (``block_unbin``), and the first ``Cin mod cb`` the last one
(``block_rest_unbin``): every row adds the same terms in the same order as the textbook, bit
for bit. (In a narrow float16 call with a ``grad_z`` value past 65504, the textbook keeps all of
``grad_z`` in float32 and a block only its own, :func:`fovi_ref.precision.stored_product`: there
the other blocks' roundings differ from the textbook's.)
Blocks need not divide ``Cin``, so a prime ``Cin`` keeps full-size blocks. The forward
and the weight gradient are the textbook's. Both constants are set by ``python -m fovi_ref bench
--strategies``.
"""

from __future__ import annotations

import torch

from fovi_ref.knn_general import (
    bin_entries,
    forward_with_operand,
    grad_weight_of_operand,
    grad_y_columns,
    grad_y_layout,
    operand,
)
from fovi_ref.meta import Derived, KNNMeta
from fovi_ref.precision import gemm_dtype, stored_product
from fovi_ref.segment_sum import SegmentSumPlan, build_segment_sum_plan, segment_sum

__all__ = [
    "BLOCK_ROWS",
    "WHOLE_BYTES",
    "applies",
    "block_channels",
    "derive",
    "forward_with_operand",
    "grad_input",
    "grad_weight_of_operand",
    "grad_y_layout",
    "operand",
    "reachable",
]

BLOCK_ROWS = 2**14
"""Most ``grad_z`` rows ``(c, v, n)`` in one block (rows; 4 MiB of float32 at batch 64)."""

WHOLE_BYTES = 32 * 2**20
"""Largest ``grad_z`` (bytes) computed whole: glibc's mmap threshold grows to at most 32 MiB, and
larger blocks are mapped fresh on every call."""


def block_channels(meta: KNNMeta) -> int:
    """Input channels per block: the largest divisor of ``Cin`` that fits in :data:`BLOCK_ROWS`
    rows if it is at least half of what fits (blocks of one size), else as many as fit, the
    last block smaller (a prime ``Cin`` would otherwise get blocks of one channel)."""
    fits = max(1, min(meta.in_channels, BLOCK_ROWS // (meta.v * meta.n_out)))
    divisor = max(d for d in range(1, fits + 1) if meta.in_channels % d == 0)
    return divisor if 2 * divisor >= fits else fits


def reachable(meta: KNNMeta) -> bool:
    """True when the graph has more channels than one block (so a large batch takes blocks)."""
    return block_channels(meta) < meta.in_channels


def applies(meta: KNNMeta, batch: int, device: torch.device, element_size: int) -> bool:
    """True when the input gradient of ``batch`` samples on ``device`` runs in blocks: a CPU,
    more than one block, and a whole ``grad_z`` of more than :data:`WHOLE_BYTES`."""
    whole = meta.in_channels * meta.v * meta.n_out * batch * element_size
    return device.type == "cpu" and reachable(meta) and whole > WHOLE_BYTES


def derive(meta: KNNMeta) -> Derived:
    """``block_unbin``: the unbinning of the first ``cb`` channels, and ``block_rest_unbin``: of
    the first ``Cin mod cb`` channels (if any), rows ``(c, v, n) -> (c, i)`` within a block."""
    z_row, x_row = bin_entries(meta)
    per_channel = z_row.numel() // meta.in_channels
    cb = block_channels(meta)
    data = {}
    for prefix, channels in (("block_unbin", cb), ("block_rest_unbin", meta.in_channels % cb)):
        if channels:
            entries = channels * per_channel
            plan = build_segment_sum_plan(x_row[:entries], z_row[:entries], channels * meta.n_in)
            data |= plan.as_derived(prefix)
    return data


def grad_input(
    meta: KNNMeta, data: Derived, grad_y: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``grad_y [B, Cout, Nout] -> grad_x [B, Cin, Nin]``, one block of channels at a time."""
    batch = grad_y.shape[0]
    v = meta.v
    n_in = meta.n_in
    cb = block_channels(meta)
    acc = gemm_dtype(grad_y.device, grad_y.dtype)
    grad_y_cols = grad_y_columns(grad_y).to(acc)  # [Cout, Nout*B]
    weight = weight.to(acc)
    # The sums of each block are rounded to grad_y's dtype as they are written here, once.
    grad_x_rows = grad_y.new_empty(meta.in_channels * n_in, batch)
    for c in range(0, meta.in_channels, cb):  # the block of channels c .. end - 1
        end = min(c + cb, meta.in_channels)
        prefix = "block_unbin" if end - c == cb else "block_rest_unbin"
        block = weight[:, c * v : end * v].t()  # [(end-c)*V, Cout]
        grad_z = stored_product(block, grad_y_cols, grad_y.dtype)  # [(end-c)*V, Nout*B]
        grad_z_rows = grad_z.view((end - c) * v * meta.n_out, batch)
        plan = SegmentSumPlan.from_derived(data, prefix)
        grad_x_rows[c * n_in : end * n_in] = segment_sum(grad_z_rows, plan)
    return grad_x_rows.t().contiguous().view(batch, meta.in_channels, n_in)
