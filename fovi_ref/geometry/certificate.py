"""Which nodes of a fovi graph every machine builds alike, and which are ties.

fovi builds its graphs in float32, and two steps round differently on different machines: the
GEMM inside :func:`torch.cdist` (vector width, FMA, MKL code path, thread blocking) and the
vectorised ``cos``/``sin``/``exp`` that place the sample points. A node's neighbour set or a
neighbour's cell is *determined* when its margin exceeds every rounding any machine can make;
otherwise it is a *tie*, and machines may disagree. This module computes both margins from
float64 recomputations of the same quantities and a bound on fovi's float32 error, derived below.
``u = 2^-24`` is the float32 unit roundoff.

**Coordinates.** Let ``p`` be an input (or pad) point and ``q`` an output point in cortical
coordinates (mm), as this machine computed them in float32. Another machine's float32 points
differ by a few ulps; we allow ``|dp| <= C_P u |p|`` with ``C_P = 16`` (the float32 chain of
about eight elementwise functions; the largest difference measured under
``ATEN_CPU_CAPABILITY=default``, ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``SSE4_2`` was 9 u|p|).
Visual coordinates get the same allowance.

**Neighbour margin.** fovi ranks candidates by ``cdist``, which for more than 25 points is the
expansion ``d^2 = |p|^2 + |q|^2 - 2 p.q``: two squared norms (3 products, 2 sums: error at most
``3u`` of each) and a 5-term dot product in any order, FMA or not (error at most
``5u (|p|^2 + |q|^2 + 2|p||q|)``), then ``sqrt`` (correctly rounded: relative ``u`` on ``d``,
``3u d^2`` on ``d^2`` with room). So the computed ``d^2`` is within

    E(d) = 8u (|p| + |q|)^2 + 3u d^2 + 2 d C_P u (|p| + |q|)

of the exact ``d^2`` of this machine's points, the last term covering another machine's points.
Since ``|p| <= |q| + d``, ``E`` is bounded by its value at ``|p| + |q| = 2|q| + d``, which grows
with ``d``. Sort the candidates by exact float64 distance, ``d_1 <= d_2 <= ...``; a machine's
top-K set equals the exact one whenever ``d_{K+1}^2 - E(d_{K+1}) > d_K^2 + E(d_K)`` (``d^2 - E``
increases in ``d`` beyond ``~1e-6 |q|``, so no farther candidate is closer). The **neighbour
margin** is

    m_nb = (d_{K+1}^2 - d_K^2) / (E(d_K) + E(d_{K+1})),   determined when m_nb > 1.

**Cell margin.** Each neighbour's frame position ``f = rho (cos phi, sin phi)`` is normalised
per axis, ``w = 2 (f - lo) / W - 1`` with ``W = hi - lo + 1e-6``, and matched to the nearest
cell ``c_1`` of the grid; the runner-up is ``c_2``. Error budget, per neighbour:

- ``rho`` (cortical distance to the node): for ``K > 25`` ``cdist`` expands again, so
  ``rho^2`` carries ``E(rho)`` and ``d_rho = max(sqrt(rho^2 + E) - rho, rho - sqrt(rho^2 - E))``
  (``rho`` itself where ``E > rho^2``); for ``K <= 25`` it subtracts directly:
  ``d_rho = 4u rho + 2 C_P u (2|q| + rho)``. Plus ``u rho`` for the final rounding.
- ``phi = atan2`` of the visual offset ``o``: ``d_phi = (u|o| + C_P u (|a| + |b|)) / |o| + 4 pi u``
  (offset rounding and the other machine's points, then a few ulps of ``atan2``); ``0`` where
  ``o = 0`` exactly (then ``phi = 0`` everywhere).
- ``f``: per axis, ``d_f = d_rho |cos phi| + rho d_phi |sin phi| + 3u rho`` (and ``cos``/``sin``
  swapped for the second axis).
- normalisation, first order: ``d_w <= 2 (d_f + d_lo) / W + 2 (f - lo)(d_lo + d_hi) / W^2 +
  8u``, where ``d_lo`` (``d_hi``) is the largest ``d_f`` among neighbours within ``2 max d_f``
  of the minimum (maximum): those that could be the extreme on another machine.
- the cell distances ``|w - c|^2`` are expanded too (``Nout > 25``), error at most
  ``8u (|w| + sqrt 2)^2`` each.

``D = |w - c_2|^2 - |w - c_1|^2`` changes by at most ``2 sum_axes |c_1 - c_2| d_w`` when ``w``
moves, so the **cell margin** is

    m_cell = D / (2 sum_axes |c_1 - c_2| d_w + 16u (|w| + sqrt 2)^2),   determined when > 1.

A node is **determined** when its neighbour margin and all its cell margins exceed 1: every
machine within these error bounds builds its (neighbour, cell) pairs as this certificate's
float64 recomputation does, and hence identically. With ``V = 1`` there is no cell choice.
The bound is a worst case over summation orders; typical differences are far smaller, so some
ties never flip in practice, but no determined node may ever flip (the tests check both the
self-consistency here and every flip measured under other arithmetic settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fovi_ref.geometry.graph import LayerGraph
from fovi_ref.geometry.sampling import foveated_sampling

__all__ = ["C_P", "TieCertificate", "tie_certificate"]

U = 2.0**-24
"""float32 unit roundoff."""

C_P = 16.0
"""Allowance for another machine's float32 points: ``|dp| <= C_P u |p|`` (see the docstring)."""

_MM_THRESHOLD = 25  # torch.cdist expands |p|^2 + |q|^2 - 2 p.q above this many points


@dataclass(frozen=True, eq=False)
class TieCertificate:
    """Margins of one graph's choices against fovi's float32 rounding (module docstring).

    Attributes:
        name: the layer's name.
        neighbour_margin: ``[Nout]`` float64, ``m_nb`` per output node.
        cell_margin: ``[Nout, K]`` float64, ``m_cell`` per neighbour (``inf`` where ``V = 1``).
    """

    name: str
    neighbour_margin: torch.Tensor
    cell_margin: torch.Tensor

    @property
    def margin(self) -> torch.Tensor:
        """``[Nout]``: the smallest of a node's margins; the node is determined where > 1."""
        return torch.minimum(self.neighbour_margin, self.cell_margin.min(dim=1).values)

    @property
    def determined(self) -> torch.Tensor:
        """``[Nout]`` bool: nodes every machine builds identically."""
        return self.margin > 1

    @property
    def ties(self) -> torch.Tensor:
        """``[T]`` int64: the nodes some machine may build differently."""
        return (~self.determined).nonzero().flatten()

    @property
    def neighbour_ties(self) -> int:
        """Nodes whose neighbour set is a tie."""
        return int((self.neighbour_margin <= 1).sum())

    @property
    def cell_ties(self) -> int:
        """Nodes with a determined neighbour set but a tied cell choice."""
        return int(((self.neighbour_margin > 1) & (self.cell_margin.min(dim=1).values <= 1)).sum())


def _squared_distance_error(distance: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """``E(d)``: bound on fovi's float32 ``d^2`` error; ``reach`` bounds ``|p| + |q|``."""
    return 8 * U * reach**2 + 3 * U * distance**2 + 2 * distance * C_P * U * reach


def _check_determined(name: str, what: str, field: str, wrong: torch.Tensor) -> None:
    """Raise ``ValueError`` if a node called determined differs from float64 (``wrong [Nout]``)."""
    if bool(wrong.any()):
        nodes = wrong.nonzero().flatten()
        raise ValueError(
            f"graph {name!r}: the determined {what} of {len(nodes)} output node(s) (first: "
            f"{nodes[:5].tolist()}) differs in graph.meta.{field} from the float64 recomputation "
            "of its samplings; the graph was edited or hand-built inconsistently"
        )


def _check_shapes(graph: LayerGraph, n_in: int, n_out: int) -> None:
    """Raise ``ValueError`` unless the graph's parts agree with each other and its samplings."""
    meta, name = graph.meta, graph.name
    problems = []
    if meta.n_in != n_in or meta.n_out != n_out:
        problems.append(
            f"meta has n_in={meta.n_in}, n_out={meta.n_out} but its samplings have {n_in}, {n_out}"
        )
    if tuple(graph.raw_knn.shape) != tuple(meta.knn.shape):
        problems.append(
            f"meta.knn has shape {tuple(meta.knn.shape)} but raw_knn has "
            f"{tuple(graph.raw_knn.shape)}"
        )
    if graph.ref_grid.shape[0] != meta.v:
        problems.append(f"meta.v={meta.v} but ref_grid has {graph.ref_grid.shape[0]} cells")
    if problems:
        raise ValueError(f"graph {name!r} is inconsistent: " + "; ".join(problems))


def tie_certificate(graph: LayerGraph) -> TieCertificate:
    """Neighbour and cell margins of a graph built with fovi's arithmetic.

    Args:
        graph: a :class:`LayerGraph` with ``arithmetic="fovi"`` (the exact construction needs
            no certificate: it refuses ambiguous decisions instead).

    Raises:
        ValueError: for an exact graph; and where the float64 recomputation disagrees with the
            graph on a node it calls determined: the graph is not the one its samplings build
            (edited or hand-built), or this module has a bug. This self-check is a ``raise``, not
            an ``assert``, so ``python -O`` keeps it.
    """
    if graph.arithmetic != "fovi":
        raise ValueError(f"{graph.name}: a tie certificate is for fovi's float32 arithmetic")
    args = (graph.fov, graph.cmf_a, graph.field_geometry, graph.fovi_version)
    inputs, outputs = (
        foveated_sampling(graph.in_res, *args),
        foveated_sampling(graph.out_res, *args),
    )
    _check_shapes(graph, inputs.n, outputs.n)
    candidates = torch.cat([inputs.cortical, inputs.pad_cortical]).double()  # [Nin+P, 3]
    nodes = outputs.cortical.double()  # [Nout, 3]
    k = graph.k
    node_norm = nodes.norm(dim=1)  # [Nout]

    # ---- neighbour margin
    distance = torch.cdist(candidates, nodes, compute_mode="donot_use_mm_for_euclid_dist")
    nearest = distance.topk(k + 1, dim=0, largest=False)  # [K+1, Nout]
    d_k, d_next = nearest.values[k - 1], nearest.values[k]  # [Nout] each
    e_k = _squared_distance_error(d_k, 2 * node_norm + d_k)
    e_next = _squared_distance_error(d_next, 2 * node_norm + d_next)
    neighbour_margin = (d_next**2 - d_k**2) / (e_k + e_next)  # [Nout]
    exact_set = nearest.indices[:k].clamp(max=inputs.n).sort(dim=0).values  # [K, Nout]
    determined_set = neighbour_margin > 1
    graph_set = graph.meta.knn.sort(dim=0).values  # [K, Nout]
    _check_determined(
        graph.name,
        "neighbour set",
        "knn",
        (exact_set != graph_set).any(dim=0) & determined_set,  # [Nout]
    )

    # ---- cell margin, on the neighbours the graph has
    if graph.v == 1:
        cell_margin = torch.full((graph.n_out, k), math.inf, dtype=torch.float64)
        return TieCertificate(graph.name, neighbour_margin, cell_margin)
    raw = graph.raw_knn  # [K, Nout]
    rho = (candidates[raw] - nodes[None]).norm(dim=2)  # [K, Nout]
    visual = torch.cat([inputs.cartesian, inputs.pad_cartesian]).double()  # [Nin+P, 2]
    node_visual = outputs.cartesian.double()  # [Nout, 2]
    offset = visual[raw] - node_visual[None]  # [K, Nout, 2]
    phi = torch.atan2(offset[..., 1], offset[..., 0])  # [K, Nout]
    frame = torch.stack([rho * phi.cos(), rho * phi.sin()], dim=2)  # [K, Nout, 2]
    lo, hi = frame.min(dim=0).values, frame.max(dim=0).values  # [Nout, 2] each
    width = hi - lo + 1e-6  # [Nout, 2]
    unit = 2 * (frame - lo) / width - 1  # [K, Nout, 2]
    grid = graph.ref_grid.double()  # [V, 2]
    squared = ((unit[:, :, None, :] - grid) ** 2).sum(dim=-1)  # [K, Nout, V]
    ranked = squared.sort(dim=-1)  # [K, Nout, V]
    first, second = ranked.indices[..., 0], ranked.indices[..., 1]  # [K, Nout] each

    reach = 2 * node_norm[None] + rho  # [K, Nout], bounds |p| + |q|
    if k > _MM_THRESHOLD:
        e = _squared_distance_error(rho, reach)
        d_rho = torch.maximum((rho**2 + e).sqrt() - rho, rho - (rho**2 - e).clamp_min(0).sqrt())
    else:
        d_rho = 4 * U * rho + 2 * C_P * U * reach
    d_rho = d_rho + U * rho
    length = offset.norm(dim=2)  # [K, Nout]
    visual_reach = visual[raw].norm(dim=2) + node_visual.norm(dim=1)[None]  # [K, Nout]
    d_phi = torch.where(
        length > 0, (U * length + C_P * U * visual_reach) / length.clamp_min(1e-300), 0.0
    ) + (4 * math.pi * U) * (length > 0)  # [K, Nout]
    cos_sin = torch.stack([phi.cos().abs(), phi.sin().abs()], dim=2)  # [K, Nout, 2]
    d_frame = (
        d_rho[..., None] * cos_sin
        + (rho * d_phi)[..., None] * cos_sin.flip(2)
        + 3 * U * rho[..., None]
    )  # [K, Nout, 2]
    worst = d_frame.max(dim=0).values  # [Nout, 2]
    near_lo = frame - lo <= 2 * worst  # [K, Nout, 2]: could be the minimum elsewhere
    near_hi = hi - frame <= 2 * worst
    d_lo = torch.where(near_lo, d_frame, 0.0).max(dim=0).values  # [Nout, 2]
    d_hi = torch.where(near_hi, d_frame, 0.0).max(dim=0).values
    d_unit = 2 * (d_frame + d_lo) / width + 2 * (frame - lo) * (d_lo + d_hi) / width**2 + 8 * U
    step = (grid[first] - grid[second]).abs()  # [K, Nout, 2]
    rounding = 16 * U * (unit.norm(dim=2) + math.sqrt(2)) ** 2  # [K, Nout]
    bound = 2 * (step * d_unit).sum(dim=-1) + rounding  # [K, Nout]
    cell_margin = ((ranked.values[..., 1] - ranked.values[..., 0]) / bound).t()  # [Nout, K]

    decided = determined_set[:, None] & (cell_margin > 1)  # [Nout, K]
    _check_determined(
        graph.name,
        "cell",
        "rf_index",
        ((first.t() != graph.meta.rf_index) & decided).any(dim=1),  # [Nout]
    )
    return TieCertificate(graph.name, neighbour_margin, cell_margin.contiguous())
