"""Counts that describe a KNN graph: padding, input coverage, and how neighbours fill cells.

These are the facts a kernel writer cares about: how much padding a backend must mask, whether
inputs are read by several outputs (gradient accumulation collides), and whether the
neighbour-to-cell map is one-to-one (it usually is not: neighbours often share a cell and cells
are often left empty).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovi_ref.meta import KNNMeta

__all__ = ["GraphStats", "graph_stats"]


@dataclass(frozen=True, eq=False)
class GraphStats:
    """Summary of one :class:`~fovi_ref.meta.KNNMeta` (see :func:`graph_stats`).

    Scalars are plain ints; per-node counts are ``[Nout]`` int64 tensors. In the per-node cell
    counts a padding neighbour counts like any other: it was assigned a cell too.

    Attributes:
        n_padding: entries of ``knn`` equal to the padding index ``n_in``.
        n_nodes_with_padding: output nodes with at least one padding neighbour.
        n_unused_inputs: inputs no output node selects.
        n_shared_inputs: inputs selected by two or more output nodes.
        shared_cell_neighbours: ``[Nout]`` neighbours that share their cell with at least one
            other neighbour of the same node.
        crowded_cells: ``[Nout]`` cells holding two or more of the node's neighbours.
        empty_cells: ``[Nout]`` cells holding none of the node's neighbours.
    """

    n_padding: int
    n_nodes_with_padding: int
    n_unused_inputs: int
    n_shared_inputs: int
    shared_cell_neighbours: torch.Tensor
    crowded_cells: torch.Tensor
    empty_cells: torch.Tensor


def graph_stats(meta: KNNMeta) -> GraphStats:
    """Compute :class:`GraphStats` for ``meta``.

    With ``occupancy[n, v] = #{k : rf_index[n, k] == v}`` (``[Nout, V]``):
    ``crowded_cells[n] = #{v : occupancy[n, v] >= 2}``, ``empty_cells[n] = #{v : occupancy = 0}``,
    ``shared_cell_neighbours[n] = sum of occupancy[n, v] over crowded cells``.
    Input coverage counts, per input ``i``, the output nodes having ``i`` among their neighbours
    (a node lists an input at most once).
    """
    knn, rf_index = meta.knn.cpu(), meta.rf_index.cpu()
    pad = knn == meta.n_in  # [K, Nout]

    occupancy = torch.zeros(meta.n_out, meta.v, dtype=torch.int64)  # [Nout, V]
    occupancy.scatter_add_(1, rf_index, torch.ones_like(rf_index))
    crowded = occupancy >= 2  # [Nout, V]

    real = knn[~pad]  # [number of real entries]
    readers = torch.bincount(real, minlength=meta.n_in)  # [Nin]: output nodes reading input i

    return GraphStats(
        n_padding=int(pad.sum()),
        n_nodes_with_padding=int(pad.any(dim=0).sum()),
        n_unused_inputs=int((readers == 0).sum()),
        n_shared_inputs=int((readers >= 2).sum()),
        shared_cell_neighbours=(occupancy * crowded).sum(dim=1),  # [Nout]
        crowded_cells=crowded.sum(dim=1),  # [Nout]
        empty_cells=(occupancy == 0).sum(dim=1),  # [Nout]
    )
