"""One KNN-convolution layer's graph, built from its input and output samplings.

:func:`layer_graph` chains the steps of the package: the two samplings
(:mod:`~fovi_ref.geometry.sampling`), the cortical nearest neighbours
(:mod:`~fovi_ref.geometry.neighbours`) and the reference-grid cells
(:mod:`~fovi_ref.geometry.cells`), and wraps the result in a :class:`~fovi_ref.meta.KNNMeta`
plus what is needed to look at it (:class:`LayerGraph`).

``fovi_version`` and ``field_geometry`` choose whose arithmetic and which cortical surface build
the samplings (:mod:`~fovi_ref.geometry.sampling`, :mod:`~fovi_ref.geometry.manifold`); the
neighbour and cell steps are the same in every version. ``arithmetic="exact"`` replaces fovi's
float32 steps by the machine-independent ones of :mod:`~fovi_ref.geometry.exact`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fovi_ref.geometry.cells import (
    assign_cells,
    grid_side,
    local_frame,
    normalise_frame,
    reference_grid,
)
from fovi_ref.geometry.exact import exact_cells, exact_frame, exact_neighbours
from fovi_ref.geometry.neighbours import nearest_neighbours
from fovi_ref.geometry.sampling import (
    DEFAULT_FOVI_VERSION,
    check_sampling_params,
    foveated_sampling,
    resolve_field_geometry,
)
from fovi_ref.meta import KNNMeta, check_int

__all__ = ["LayerGraph", "layer_graph"]


@dataclass(frozen=True, eq=False)
class LayerGraph:
    """A KNN-convolution layer's graph and the geometry behind it.

    Records are cached and shared: treat the tensors as read-only.

    Attributes:
        name: the layer's module path in fovi (``"layer2.0.conv1"``), or any label.
        meta: the graph (``knn [K, Nout]``, ``rf_index [Nout, K]``, ``n_in``, ``v``, ...).
        in_channels, out_channels: ``Cin``, ``Cout``.
        in_res, out_res: rings of the input and output samplings (``out_res = in_res // stride``).
        fov, cmf_a: the samplings' field of view (degrees) and ``a`` of ``M(r) = k / (r + a)``.
        fovi_version: whose sampling formulas built it (``"2.4.0"`` or ``"bf792c2"``).
        field_geometry: the cortical surface distances were measured on (``"planar"`` or
            ``"legacy"``).
        arithmetic: ``"fovi"`` (fovi's float32 steps) or ``"exact"`` (:mod:`.exact`).
        in_coords: ``[Nin, 2]`` visual coordinates of the inputs (unit disk = field of view).
        out_coords: ``[Nout, 2]`` same, for the outputs.
        in_pad_coords: ``[P, 2]`` the input sampling's pad coordinates (outside the unit disk).
        raw_knn: ``[K, Nout]`` int64 neighbours before padding is collapsed: index into
            ``cat(in_coords, in_pad_coords)``, so ``raw_knn - Nin`` says *which* pad coordinate.
        frame: ``[K, Nout, 2]`` neighbour positions in each node's normalised frame, the
            positions that were matched to the grid.
        ref_grid: ``[V, 2]`` float32 reference-grid cell centres.

    Coordinates and ``frame`` are float32 with ``arithmetic="fovi"``, float64 with ``"exact"``.
    """

    name: str
    meta: KNNMeta
    in_channels: int
    out_channels: int
    in_res: int
    out_res: int
    fov: float
    cmf_a: float
    fovi_version: str
    field_geometry: str
    arithmetic: str
    in_coords: torch.Tensor
    out_coords: torch.Tensor
    in_pad_coords: torch.Tensor
    raw_knn: torch.Tensor
    frame: torch.Tensor
    ref_grid: torch.Tensor

    @property
    def k(self) -> int:
        return self.meta.k

    @property
    def v(self) -> int:
        return self.meta.v

    @property
    def n_in(self) -> int:
        return self.meta.n_in

    @property
    def n_out(self) -> int:
        return self.meta.n_out

    def __repr__(self) -> str:
        return (
            f"LayerGraph({self.name!r}, {self.in_channels}->{self.out_channels}, k={self.k}, "
            f"v={self.v}, n_in={self.n_in}, n_out={self.n_out})"
        )


@functools.lru_cache(maxsize=128)
def _graph_tensors(
    in_res: int,
    out_res: int,
    k: int,
    fov: float,
    cmf_a: float,
    field_geometry: str,
    fovi_version: str,
    arithmetic: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(raw_knn, knn, rf_index, frame, ref_grid)`` for one (samplings, k); shared by layers."""
    inputs = foveated_sampling(in_res, fov, cmf_a, field_geometry, fovi_version, arithmetic)
    outputs = foveated_sampling(out_res, fov, cmf_a, field_geometry, fovi_version, arithmetic)
    if arithmetic == "exact":
        raw, knn = exact_neighbours(inputs, outputs, k)  # [K, Nout] each
        grid = reference_grid(grid_side(raw.shape[0]))  # [V, 2]
        frame = exact_frame(inputs, outputs, raw)  # [K, Nout, 2] float64
        return raw, knn, exact_cells(frame, grid), frame, grid
    raw, knn = nearest_neighbours(inputs, outputs, k)  # [K, Nout] each
    grid = reference_grid(grid_side(raw.shape[0]))  # [V, 2]
    frame = normalise_frame(local_frame(inputs, outputs, raw))  # [K, Nout, 2]
    rf_index = assign_cells(frame, grid)  # [Nout, K]
    return raw, knn, rf_index, frame, grid


def layer_graph(
    name: str,
    *,
    in_channels: int,
    out_channels: int,
    k: int,
    in_res: int,
    out_res: int,
    fov: float,
    cmf_a: float,
    field_geometry: str | None = None,
    fovi_version: str = DEFAULT_FOVI_VERSION,
    arithmetic: str = "fovi",
) -> LayerGraph:
    """Build the graph of a KNN convolution from ``in_res`` rings to ``out_res`` rings.

    ``k`` is the requested neighbour count; the graph has ``K = min(k, Nin)`` and
    ``V = ceil(sqrt(K))^2``. ``fovi_version`` (``"2.4.0"`` or ``"bf792c2"``) selects the
    sampling formulas and ``field_geometry`` the cortical surface (None: the version's
    default, ``"planar"`` for 2.4.0); ``arithmetic`` is ``"fovi"`` (fovi's float32 steps, whose
    near-ties depend on the machine) or ``"exact"`` (the same on every machine, see
    :mod:`~fovi_ref.geometry.exact`). The geometric part is cached per argument tuple.

    Raises:
        TypeError: naming the argument, for a non-str ``name`` or a non-int ``in_channels``,
            ``out_channels``, ``k``, ``in_res`` or ``out_res`` (``bool`` and ``2.0`` included).
        ValueError: naming the argument, for ``in_channels``, ``out_channels`` or ``k`` below 1,
            ``in_res`` or ``out_res`` below 2, or a bad sampling parameter
            (:func:`~fovi_ref.geometry.sampling.check_sampling_params`).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    for arg, value, low in (
        ("in_channels", in_channels, 1),
        ("out_channels", out_channels, 1),
        ("k (requested neighbours)", k, 1),
        ("in_res (input rings)", in_res, 2),
        ("out_res (output rings)", out_res, 2),
    ):
        check_int(arg, value, low=low)
    check_sampling_params(
        fov, cmf_a, fovi_version=fovi_version, field_geometry=field_geometry, arithmetic=arithmetic
    )
    geometry = resolve_field_geometry(fovi_version, field_geometry)
    raw, knn, rf_index, frame, grid = _graph_tensors(
        in_res, out_res, k, fov, cmf_a, geometry, fovi_version, arithmetic
    )
    inputs = foveated_sampling(in_res, fov, cmf_a, geometry, fovi_version, arithmetic)
    outputs = foveated_sampling(out_res, fov, cmf_a, geometry, fovi_version, arithmetic)
    meta = KNNMeta.from_knn(
        knn, rf_index, n_in=inputs.n, in_channels=in_channels, v=int(grid.shape[0])
    )
    return LayerGraph(
        name=name,
        meta=meta,
        in_channels=in_channels,
        out_channels=out_channels,
        in_res=in_res,
        out_res=out_res,
        fov=fov,
        cmf_a=cmf_a,
        fovi_version=fovi_version,
        field_geometry=geometry,
        arithmetic=arithmetic,
        in_coords=inputs.cartesian,
        out_coords=outputs.cartesian,
        in_pad_coords=inputs.pad_cartesian,
        raw_knn=raw,
        frame=frame,
        ref_grid=grid,
    )
