"""Which reference-grid cell each neighbour falls in: fovi's ``local_rf``.

A KNN convolution has one weight per (input channel, *cell* of a square reference grid), not per
neighbour. Each neighbourhood is laid onto the grid as follows.

1. **Local frame.** Neighbour ``k`` of output node ``n`` gets the 2-D position
   ``f[k, n] = rho * (cos phi, sin phi)``, where ``rho`` is its cortical distance to the node and
   ``phi`` the direction from the node to it in the *visual* field. So distances are cortical but
   orientation is visual: "up" in the kernel is "up" in the image everywhere.
   Pad-coordinate neighbours use their own (outside the field of view) positions.
2. **Normalisation.** Per node and per axis, ``f`` is rescaled to ``[-1, 1]`` over the node's
   ``K`` neighbours (pad ones included)::

       u[k, n] = 2 (f[k, n] - min_k f[:, n]) / (max_k f[:, n] - min_k f[:, n] + 1e-6) - 1

3. **Reference grid.** ``S = ceil(sqrt(K))`` and the ``V = S^2`` cells are at
   ``g = linspace(-1, 1, S)``: cell ``v`` is at ``(g[v // S], g[v % S])`` (``meshgrid`` with
   ``ij`` indexing, flattened).
4. **Assignment.** ``rf_index[n, k] = argmin_v |u[k, n] - cell_v|`` (first index on ties).
   fovi's ``local_rf [Nout, K, V]`` is the one-hot form of ``rf_index``.

Nothing forces a one-to-one match: two neighbours can share a cell (their features are summed
before the weight is applied) and cells can stay empty.

Distances use :func:`torch.cdist` shaped as in fovi, so float32 rounding (and thus which cell
wins a near-tie) is the same.
"""

from __future__ import annotations

import math

import torch

from fovi_ref.geometry.sampling import FoveatedSampling

__all__ = ["assign_cells", "grid_side", "local_frame", "normalise_frame", "reference_grid"]

_FRAME_EPS = 1e-6  # keeps the normalisation finite when all neighbours share a coordinate


def grid_side(k: int) -> int:
    """``S = ceil(sqrt(k))``, the side of the square reference grid (``V = S^2`` cells)."""
    side = math.isqrt(k)
    return side if side * side == k else side + 1


def reference_grid(side: int) -> torch.Tensor:
    """``[S^2, 2]`` float32 cell centres: cell ``v`` is ``(g[v // S], g[v % S])``.

    ``g = linspace(-1, 1, S)``; this is ``meshgrid(g, g, indexing="ij")`` flattened.
    """
    g = torch.linspace(-1, 1, side)  # [S]
    rows, cols = torch.meshgrid(g, g, indexing="ij")  # [S, S] each
    return torch.stack([rows, cols], dim=-1).reshape(-1, 2)  # [S*S, 2]


def local_frame(
    inputs: FoveatedSampling, outputs: FoveatedSampling, raw: torch.Tensor
) -> torch.Tensor:
    """Neighbour positions ``f [K, Nout, 2]`` around each output node (step 1 above).

    Args:
        inputs, outputs: the layer's samplings. raw: ``[K, Nout]`` candidate indices from
            :func:`~fovi_ref.geometry.neighbours.nearest_neighbours` (pad coordinates included).
    """
    cortical = torch.cat([inputs.cortical, inputs.pad_cortical], dim=0)  # [Nin+P, 3]
    visual = torch.cat([inputs.cartesian, inputs.pad_cartesian], dim=0)  # [Nin+P, 2]
    nb_cortical = cortical[raw]  # [K, Nout, 3]
    nb_visual = visual[raw]  # [K, Nout, 2]
    out_visual = outputs.cartesian  # [Nout, 2]
    phi = torch.atan2(
        nb_visual[:, :, 1] - out_visual[:, 1], nb_visual[:, :, 0] - out_visual[:, 0]
    )  # [K, Nout]
    # rho[k, n] = |nb_cortical[k, n] - q_n|, one cdist per node as in fovi (same rounding).
    rho = torch.stack(
        [
            torch.cdist(outputs.cortical[n][None], nb_cortical[:, n])[0]  # [K]
            for n in range(outputs.n)
        ],
        dim=1,
    )  # [K, Nout]
    return torch.stack([rho * torch.cos(phi), rho * torch.sin(phi)], dim=2)  # [K, Nout, 2]


def normalise_frame(frame: torch.Tensor) -> torch.Tensor:
    """Step 2: rescale ``frame [K, Nout, 2]`` to ``[-1, 1]`` per node and axis over ``K``."""
    lo = frame.min(dim=0, keepdim=True).values  # [1, Nout, 2]
    hi = frame.max(dim=0, keepdim=True).values  # [1, Nout, 2]
    return 2 * (frame - lo) / (hi - lo + _FRAME_EPS) - 1  # [K, Nout, 2]


def assign_cells(unit_frame: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Step 4: ``rf_index [Nout, K]``, the nearest cell of ``grid [V, 2]`` to each neighbour.

    Args:
        unit_frame: ``[K, Nout, 2]`` normalised neighbour positions (:func:`normalise_frame`).
        grid: ``[V, 2]`` cell centres (:func:`reference_grid`).
    """
    distances = torch.cdist(unit_frame, grid)  # [K, Nout, V]
    return distances.argmin(dim=2).t().contiguous()  # [Nout, K]
