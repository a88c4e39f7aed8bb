"""A machine-independent graph: float64 distances, stated tie-break, every decision certain.

fovi's graphs depend on the machine (:mod:`.certificate`): its float32 distances are rounded
differently by different GEMM kernels, and a near-tie goes either way. This module is the
construction we would propose to fovi instead, used by ``resnet18_layers(arithmetic="exact")``.
It follows fovi 2.4.0's formulas step for step and changes only the arithmetic:

1. **Points** in float64 (:func:`~.sampling.foveated_sampling` with ``arithmetic="exact"``).
2. **Distances** in float64, each computed directly as ``|p - q|`` (no ``|p|^2 + |q|^2 - 2 p.q``
   expansion, whose cancellation is what makes fovi's float32 distances fragile).
3. **A tie rule.** Two float64 numbers that should be equal (two points of a symmetric ring at
   the same distance) come out a few ulps apart, in a machine-dependent direction. So values
   closer than a *tie tolerance* count as equal, and equal values are ordered by index:

   - neighbours: candidates sorted by distance; consecutive ones whose distances differ by at
     most ``TIE_TOLERANCE * scale`` (``scale`` = the largest cortical coordinate magnitude of
     the layer) form one group, and within a group the lower candidate index comes first. Inputs
     precede pad coordinates in the candidate numbering, so on a tie a real input wins.
   - cells: a neighbour goes to the nearest cell; cells whose squared distances differ by at
     most ``TIE_TOLERANCE`` (the normalised frame has unit scale) tie, and the lowest cell index
     wins.

4. **Certainty.** The rule is only machine-independent if no decision sits near the tolerance
   itself: float64 differences between machines are ~1e-16 relative, the tolerance is 1e-9, so
   a gap that is neither below ``TIE_TOLERANCE / 16`` nor above ``16 * TIE_TOLERANCE`` could be
   read either way. Every gap that decides something (neighbour order up to the end of the group
   that holds the K-th neighbour; each neighbour's best against its second-best cell) is checked,
   and an ambiguous one raises :class:`AmbiguousGraphError` rather than build a graph another
   machine would build differently. With the sampling's certain counts, a graph that builds is
   the same on every machine, bit for bit.

The frame (step 1 of :mod:`.cells`) is fovi's: cortical distance, visual direction, normalised
to ``[-1, 1]`` per axis with fovi's ``1e-6``, in float64.
"""

from __future__ import annotations

import torch

from fovi_ref.geometry.cells import normalise_frame
from fovi_ref.geometry.neighbours import capped_k
from fovi_ref.geometry.sampling import FoveatedSampling

__all__ = [
    "TIE_TOLERANCE",
    "AmbiguousGraphError",
    "certain_order",
    "exact_cells",
    "exact_frame",
    "exact_neighbours",
]

TIE_TOLERANCE = 1e-9
"""Relative size below which two float64 distances count as one (see the module docstring)."""

_AMBIGUITY = 16  # gaps in (TIE_TOLERANCE / 16, 16 * TIE_TOLERANCE] are refused


class AmbiguousGraphError(ValueError):
    """A decision of the exact construction is too close to the tie tolerance to be certain."""


def certain_order(values: torch.Tensor, tolerance: float, keep: int, what: str) -> torch.Tensor:
    """The first ranks of ``values [C, N]`` along dim 0 under the tie rule, checked.

    Values linked by consecutive gaps ``<= tolerance`` form a group, ordered by index. The gaps
    that decide the first ``keep`` ranks (every gap up to the end of the group holding rank
    ``keep - 1``) must each be ``<= tolerance / 16`` or ``> 16 * tolerance``; otherwise
    :class:`AmbiguousGraphError` is raised, naming ``what``.

    Returns:
        ``order [W, N]`` with ``keep <= W <= C``: indices into dim 0 of the ``W`` smallest
        values, ascending, ties by index; ranks ``< keep`` are final.
    """
    count = values.shape[0]
    window = min(count, 2 * keep + 16)  # enough unless a tie group runs past it (checked)
    while True:
        ranked, order = values.topk(window, dim=0, largest=False)  # [W, N] each, ascending
        if window == 1:
            return order  # one value: nothing to decide
        gaps = ranked.diff(dim=0)  # [W-1, N]
        opens = gaps > tolerance  # [W-1, N]: the gap starts a new group
        ranks = torch.arange(window - 1)[:, None]  # [W-1, 1]
        # The group holding rank keep-1 ends at the first opening gap at or after rank keep-1;
        # that gap and every one before it decide the first `keep` ranks, later ones nothing.
        closes = opens & (ranks >= keep - 1)  # [W-1, N]
        if window == count or bool(closes.any(dim=0).all()):
            break
        window = min(count, 2 * window)  # a tie group reaches the window's edge: widen it
    closing = torch.where(closes.any(dim=0), closes.int().argmax(dim=0), window - 2)  # [N]
    deciding = torch.where(ranks <= closing[None, :], gaps, 0.0)  # [W-1, N]
    ambiguous = (deciding > tolerance / _AMBIGUITY) & (deciding <= tolerance * _AMBIGUITY)
    if bool(ambiguous.any()):
        where = tuple(int(i) for i in ambiguous.nonzero()[0])
        raise AmbiguousGraphError(
            f"exact construction: {what} {list(where)} is decided by a gap of "
            f"{float(deciding[where]):.3g}, within a factor {_AMBIGUITY} of the tie tolerance "
            f"{tolerance:.3g}; another machine could decide it differently"
        )
    group = torch.cat([torch.zeros_like(order[:1]), opens.cumsum(dim=0)])  # [W, N]
    key = group * count + order  # [W, N]: group first, then index
    return key.sort(dim=0).values % count


def exact_neighbours(
    inputs: FoveatedSampling, outputs: FoveatedSampling, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``K = min(k, Nin)`` nearest candidates of every output node, exactly.

    Args:
        inputs, outputs: float64 samplings (``arithmetic="exact"``).
        k: requested neighbour count.

    Returns:
        ``(raw, knn)``, both ``[K, Nout]`` int64, as :func:`~.neighbours.nearest_neighbours`
        returns them (nearest first, ties by candidate index).
    """
    n_in = inputs.n
    k = capped_k(k, n_in)
    candidates = torch.cat([inputs.cortical, inputs.pad_cortical], dim=0)  # [Nin+P, 3] float64
    scale = float(torch.cat([candidates, outputs.cortical]).norm(dim=1).max())
    tolerance = TIE_TOLERANCE * scale
    distances = torch.cdist(
        candidates, outputs.cortical, compute_mode="donot_use_mm_for_euclid_dist"
    )  # [Nin+P, Nout] float64, each |p - q| computed directly
    order = certain_order(distances, tolerance, k, "the neighbour gap [rank, node]")
    raw = order[:k]  # [K, Nout]
    return raw, raw.clamp(max=n_in)


def exact_frame(
    inputs: FoveatedSampling, outputs: FoveatedSampling, raw: torch.Tensor
) -> torch.Tensor:
    """Normalised neighbour positions ``[K, Nout, 2]`` float64 (steps 1-2 of :mod:`.cells`)."""
    cortical = torch.cat([inputs.cortical, inputs.pad_cortical], dim=0)  # [Nin+P, 3]
    visual = torch.cat([inputs.cartesian, inputs.pad_cartesian], dim=0)  # [Nin+P, 2]
    rho = (cortical[raw] - outputs.cortical[None]).norm(dim=2)  # [K, Nout], direct
    offset = visual[raw] - outputs.cartesian[None]  # [K, Nout, 2]
    phi = torch.atan2(offset[..., 1], offset[..., 0])  # [K, Nout]
    frame = torch.stack([rho * torch.cos(phi), rho * torch.sin(phi)], dim=2)  # [K, Nout, 2]
    return normalise_frame(frame)


def exact_cells(unit_frame: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``rf_index [Nout, K]``: each neighbour's nearest cell, ties to the lowest cell index.

    Args:
        unit_frame: ``[K, Nout, 2]`` float64 (:func:`exact_frame`). grid: ``[V, 2]`` cells.
    """
    squared = ((unit_frame[:, :, None, :] - grid.double()) ** 2).sum(dim=-1)  # [K, Nout, V]
    k, n_out, v = squared.shape
    flat = squared.reshape(k * n_out, v).t()  # [V, K*Nout]
    order = certain_order(flat, TIE_TOLERANCE, 1, "the cell gap [rank, k * Nout + node]")
    return order[0].reshape(k, n_out).t().contiguous()  # [Nout, K]
