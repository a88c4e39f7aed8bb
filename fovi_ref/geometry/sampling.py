"""Isotropic foveated sampling of the visual field, and the pad ring around it.

A sampling of resolution ``res`` has ``res`` rings. Ring radii are evenly spaced in the
log-polar cortical radius ``w = log(r + a)`` (``a = cmf_a``, ``r`` in degrees)::

    dw  = (log(fov/2 + a) - log a) / (res - 1)
    w_i = linspace(log a, log(fov/2 + a) + dw, res + 1)[i]
    r_i = exp(w_i) - a          # ring 0 is the fixation point, ring res-1 the edge

(the extra ring ``res`` only serves to measure the spacing around ring ``res - 1``). Ring 0 holds
one point; ring ``i >= 1`` holds ``n_i = ceil(2 pi r_i / dr_i)`` points at angles ``2 pi j / n_i``,
where ``dr_i = (r_{i+1} - r_{i-1}) / 2`` is the mean radial spacing there, so that neighbouring
points are about as far apart along the ring as across rings: sampling is locally isotropic, and
dense near fixation. Radii are then divided by ``fov / 2``: the field of view is the unit disk.

Points are numbered ring by ring, outward, and by increasing angle within a ring.

Pad coordinates continue the pattern outside the unit disk, for neighbourhoods that reach past the
edge: rings at ``r_last + d, r_last + 2d, ...`` (below ``r_last + d + 0.5``), with
``d = r_last - r_second_last``, each holding points at angles ``0, d, 2d, ... < 2 pi`` (the
angular step is the radial step, in radians). They are never inputs of a layer; a neighbour that
is a pad coordinate is a padding neighbour.

A strided sampling is simply the sampling with ``res // stride`` rings.

**Arithmetic.** The formulas above are the same in every fovi version; the roundings are not, and
ties between neighbour distances are decided in float32, so the arithmetic is part of the graph.
Radii are float32 in both versions handled here (``torch.linspace``/``torch.exp``). Then:

- fovi 2.4.0 (``fovi_version="2.4.0"``, the default): everything is float32 torch. A ring's
  angles are ``arange(n) * (2 pi / n)`` (float32), its points ``r_i cos``/``r_i sin`` of them
  (``torch.cos``/``torch.sin``). Pad rings: the step ``d``, the first pad radius ``r_last + d`` and
  the pad angles ``arange(0, 2 pi, d)`` are float32 tensors, cosines and sines by torch.
- fovi commit bf792c2 (``fovi_version="bf792c2"``): a ring's angles are NumPy's float64
  ``linspace(0, 2 pi, n, endpoint=False)`` and its points are computed in float64 (float32 radius
  widened), then stored as float32. Pad rings: step and first pad radius in float64, pad radii
  and angles rounded to float32 by ``torch.arange``, cosines and sines by NumPy in float32.

The cortical map that follows (:mod:`.manifold`) receives the float32 points (2.4.0) or the
float64 ones (bf792c2) and the float32 pad points.

**Exact arithmetic** (``arithmetic="exact"``, 2.4.0's formulas only). fovi's float32 points
differ between machines by a few ulps (vectorised ``cos``/``exp`` kernels differ), and fovi's
float32 distances more (:mod:`.certificate`). The exact construction (:mod:`.exact`) therefore
starts from float64 points: radii, angles, points, pad rings and the cortical map all in float64,
every count (points per ring, pad radii, pad angles) from the same formulas in float64. A count
is a ``ceil`` of a ratio; :func:`_certain_ceil` refuses a ratio within ``1e-9`` (relative) of an
integer, where an ulp could change it, so the counts are the same on every machine (and, for
every setting tested, equal fovi's float32 counts).

fovi computes a point at a time (0-d tensors); here each ring is one vectorised call. The results
are the same floats, since these elementwise functions compute every lane alike; for 2.4.0 this
was checked bitwise against fovi's ``SamplingCoords`` (points, pads and both cortical maps) for
144 samplings (``res`` 2 to 128, six ``fov``/``cmf_a`` pairs, both surfaces).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from fovi_ref.geometry.manifold import FIELD_GEOMETRIES, check_field_geometry, cortical_coords
from fovi_ref.meta import check_int

__all__ = [
    "ARITHMETICS",
    "CMF_A_RATIO_RANGE",
    "DEFAULT_FOVI_VERSION",
    "FOV_RANGE",
    "FOVI_VERSIONS",
    "STYLES",
    "LEGACY_MAX_FOV",
    "FoveatedSampling",
    "check_sampling_params",
    "foveated_sampling",
    "resolve_field_geometry",
    "ring_radii",
    "strided_res",
]

STYLES = ("isotropic",)
"""Sampling styles implemented here (fovi has more: log-polar, uniform, fixed-n, ...)."""

FOVI_VERSIONS = ("2.4.0", "bf792c2")
"""fovi versions whose sampling arithmetic is reproduced: the release on PyPI, and the GitHub
commit the first version of this package was checked against."""

DEFAULT_FOVI_VERSION = "2.4.0"

ARITHMETICS = ("fovi", "exact")
"""How a graph is computed: ``"fovi"`` reproduces fovi's float32 arithmetic (and so its
machine-dependent near-ties); ``"exact"`` is the machine-independent construction of
:mod:`.exact`."""

_VERSION_GEOMETRIES = {"2.4.0": FIELD_GEOMETRIES, "bf792c2": ("legacy",)}
"""Cortical surfaces each version has; the first is its default (bf792c2 predates "planar")."""

_PAD_DEPTH = 0.5  # how far (in field-of-view radii) the pad rings reach past the edge

FOV_RANGE = (1e-3, 1e4)
"""Accepted ``fov`` (degrees). Far inside what float32 can map: eccentricities (pads reach
``1.5 fov / 2``) are squared in float32, which overflows for ``fov`` above ``~2e19``; and a tiny
``fov`` with a tiny ``cmf_a`` underflows the squares of the innermost rings."""

CMF_A_RATIO_RANGE = (1e-12, 1e3)
"""Accepted ``cmf_a / (fov / 2)``. The sampling depends (up to rounding) only on this ratio.
Above it, ``log(r + a)`` barely changes across the field and float32 cannot tell the rings apart
(``res = 64`` collapses rings from about ``1e5``: ZeroDivisionError, or NaN counts for
``1e300``); below it, the planar surface's ``(r / a + 1)^2`` overflows float32 (from about
``1e-19``). Both ends keep a wide margin; a finer float32 collapse (many rings at a large ratio)
is caught by :func:`ring_radii`."""

LEGACY_MAX_FOV = 180
"""Largest ``fov`` accepted on the ``"legacy"`` surface, whose rings are sized as on a sphere
(``sin(r deg)``): its slope ``sqrt(M^2 - rho'^2)`` stops being real near 130 degrees of
eccentricity, and its ``z`` table (``1e-4``-degree mesh up to ``2 fov``) would grow without
bound. Below the limit, a sampling whose pads reach that far is refused by
:func:`~fovi_ref.geometry.manifold.cortical_coords`."""


def resolve_field_geometry(fovi_version: str, field_geometry: str | None) -> str:
    """The cortical surface to use: ``field_geometry``, or ``fovi_version``'s default if None.

    The defaults are fovi's: ``"planar"`` for 2.4.0, ``"legacy"`` (its only one) for bf792c2.
    Raises ``ValueError`` for an unknown version, an unknown surface, or one the version lacks.
    """
    if fovi_version not in FOVI_VERSIONS:
        raise ValueError(
            f"fovi_version={fovi_version!r} is not supported; supported: {FOVI_VERSIONS}"
        )
    available = _VERSION_GEOMETRIES[fovi_version]
    if field_geometry is None:
        return available[0]
    check_field_geometry(field_geometry)
    if field_geometry not in available:
        raise ValueError(
            f"field_geometry={field_geometry!r} does not exist in fovi {fovi_version}; "
            f"it has {available}"
        )
    return field_geometry


def check_sampling_params(
    fov: float,
    cmf_a: float,
    style: str = "isotropic",
    res: int | None = None,
    fovi_version: str = DEFAULT_FOVI_VERSION,
    field_geometry: str | None = None,
    arithmetic: str = "fovi",
) -> None:
    """Raise ``ValueError`` (``TypeError`` for a wrong type) naming the first bad argument.

    Checked in order: ``style, res, fov, cmf_a``, then ``fovi_version`` and ``field_geometry``
    (:func:`resolve_field_geometry`), then ``arithmetic`` (``"exact"`` needs fovi 2.4.0), then
    ``fov`` against the surface (:data:`LEGACY_MAX_FOV`). ``res`` (rings) is checked only when
    given; a sampling needs ``res >= 2`` (one ring and the fixation point, which also fixes the
    pad ring's spacing). ``fov`` must lie in :data:`FOV_RANGE` and ``cmf_a / (fov / 2)`` in
    :data:`CMF_A_RATIO_RANGE` (see there for why).
    """
    if style not in STYLES:
        raise ValueError(f"style={style!r} is not supported; supported styles: {STYLES}")
    if res is not None:
        check_int("res (number of rings)", res, low=2)
    for arg, value, what in (("fov", fov, "field of view, degrees"), ("cmf_a", cmf_a, "a of M(r)")):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{arg} ({what}) must be a real number, got {type(value).__name__}")
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{arg} ({what}) must be a finite number > 0, got {value!r}")
    lo, hi = FOV_RANGE
    if not lo <= fov <= hi:
        raise ValueError(f"fov (field of view, degrees) must be in [{lo:g}, {hi:g}], got {fov!r}")
    lo, hi = (bound * fov / 2 for bound in CMF_A_RATIO_RANGE)
    if not lo <= cmf_a <= hi:
        raise ValueError(
            f"cmf_a (a of M(r)) must be in [{lo:.3g}, {hi:.3g}] for fov={fov!r}, i.e. "
            f"cmf_a / (fov/2) in [{CMF_A_RATIO_RANGE[0]:g}, {CMF_A_RATIO_RANGE[1]:g}]; "
            f"got {cmf_a!r}"
        )
    geometry = resolve_field_geometry(fovi_version, field_geometry)
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic={arithmetic!r} is not supported; supported: {ARITHMETICS}")
    if arithmetic == "exact" and fovi_version != "2.4.0":
        raise ValueError(
            f"arithmetic='exact' follows fovi 2.4.0's formulas, not fovi_version={fovi_version!r}"
            " (use field_geometry='legacy' for the bf792c2 surface)"
        )
    if geometry == "legacy" and fov > LEGACY_MAX_FOV:
        raise ValueError(
            f"fov (field of view, degrees) must be <= {LEGACY_MAX_FOV} on the 'legacy' "
            f"(spherical-ring) surface, got {fov!r}"
        )


def strided_res(res: int, stride: int) -> int:
    """Rings of the output sampling of a layer with ``stride``: ``res // stride`` (>= 1)."""
    out = res // stride
    if out < 1:
        raise ValueError(f"stride {stride} leaves fewer than 1 ring from res={res}")
    return out


def _certain_ceil(ratio: float, what: str) -> int:
    """``ceil(ratio)``, refusing a ratio so close to an integer that an ulp could change it."""
    nearest = round(ratio)
    if abs(ratio - nearest) <= 1e-9 * max(1.0, abs(ratio)):
        raise ValueError(
            f"exact arithmetic: the {what} ceil({ratio!r}) lies within 1e-9 of an integer, so "
            "rounding could change it between machines; choose other fov/cmf_a"
        )
    return math.ceil(ratio)


def ring_radii(
    res: int, fov: float, cmf_a: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Ring radii and points per ring (see the module docstring).

    ``dtype=float32`` is fovi's arithmetic (both versions); ``float64`` is the exact
    construction's, whose counts are certain (:func:`_certain_ceil`).

    Returns:
        ``radii [res]`` in ``dtype``, normalised so the last ring is at 1, and ``counts`` (``res``
        ints, ``counts[0] == 1``).
    """
    w_lo = np.log(cmf_a)
    w_hi = np.log(fov / 2 + cmf_a)
    dw = (w_hi - w_lo) / (res - 1)
    w = torch.linspace(w_lo, w_hi + dw, steps=res + 1, dtype=dtype)  # [res+1]
    r = torch.exp(w) - cmf_a  # [res+1] degrees
    steps = r[1:] - r[:-1]  # [res] dtype
    radii = r[:res] / (fov / 2)  # [res]
    if not (bool(torch.isfinite(r).all()) and bool((steps > 0).all())) or not bool(
        (radii[1:] > radii[:-1]).all()
    ):
        raise ValueError(
            f"{dtype} cannot resolve res={res} rings for fov={fov!r}, cmf_a={cmf_a!r}: "
            "consecutive ring radii coincide (cmf_a too large for fov at this many rings); "
            "use a smaller cmf_a / (fov/2) or fewer rings"
        )
    counts = [1]
    for i in range(1, res):
        spacing = ((r[i] - r[i - 1]) + (r[i + 1] - r[i])) / 2  # dtype
        circumference = 2 * math.pi * r[i]  # dtype
        ratio = float(circumference) / float(spacing)
        exact = dtype == torch.float64
        counts.append(_certain_ceil(ratio, f"points on ring {i}") if exact else math.ceil(ratio))
    return radii, tuple(counts)


# ------------------------------------------------------------------- fovi 2.4.0: float32
def _ring_points_2_4_0(radii: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """fovi 2.4.0: ``[N, 2]`` ring points from angles ``j * (2 pi / n)``, in ``radii``'s dtype
    (float32 as fovi computes them; float64 for the exact construction)."""
    angles = torch.cat(
        [torch.arange(n, dtype=radii.dtype) * (2 * math.pi / n) for n in counts]
    )  # [N]
    radius = torch.repeat_interleave(radii, torch.tensor(counts))  # [N]
    return torch.stack([radius * torch.cos(angles), radius * torch.sin(angles)], dim=1)


def _pad_points_2_4_0(radii: torch.Tensor) -> torch.Tensor:
    """fovi 2.4.0: ``[P, 2]`` float32 pad coordinates, every step in float32 torch."""
    step = radii[-1] - radii[-2]  # float32
    start = radii[-1] + step  # float32
    pad_radii = torch.arange(start, start + _PAD_DEPTH, step)  # [R] float32
    angles = torch.arange(0, 2 * math.pi, step)  # [A] float32
    x = pad_radii[:, None] * torch.cos(angles)[None, :]  # [R, A]
    y = pad_radii[:, None] * torch.sin(angles)[None, :]
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # [R*A, 2], ring by ring


# -------------------------------------------------------------- fovi bf792c2: float64 angles
def _ring_points_bf792c2(radii: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """bf792c2: ``[N, 2]`` float64 ring points from NumPy's float64 ``linspace`` angles."""
    angles = torch.from_numpy(
        np.concatenate([np.linspace(0, 2 * np.pi, n, endpoint=False) for n in counts])
    )  # [N] float64
    radius = torch.repeat_interleave(radii.double(), torch.tensor(counts))  # [N] float64
    return torch.stack([radius * torch.cos(angles), radius * torch.sin(angles)], dim=1)


def _pad_points_bf792c2(radii: torch.Tensor) -> torch.Tensor:
    """bf792c2: ``[P, 2]`` float32 pad coordinates; step and start in float64, NumPy cosines."""
    last, second_last = radii[-1].double(), radii[-2].double()
    step = last - second_last  # float64
    start = last + step
    pad_radii = torch.arange(start, start + _PAD_DEPTH, step)  # [R] float32
    angles = torch.arange(0, 2 * np.pi, step).numpy()  # [A] float32
    cos = torch.from_numpy(np.cos(angles))  # [A] float32, NumPy's float32 cosine
    sin = torch.from_numpy(np.sin(angles))
    x = pad_radii[:, None] * cos[None, :]  # [R, A]
    y = pad_radii[:, None] * sin[None, :]
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # [R*A, 2], ring by ring


# ------------------------------------------------------------------ exact: float64 throughout
def _pad_points_exact(radii: torch.Tensor) -> torch.Tensor:
    """Exact arithmetic: ``[P, 2]`` float64 pad coordinates, counts certain."""
    step = float(radii[-1] - radii[-2])
    start = float(radii[-1]) + step
    n_radii = _certain_ceil(_PAD_DEPTH / step, "pad-ring count")
    n_angles = _certain_ceil(2 * math.pi / step, "pad-angle count")
    pad_radii = start + step * torch.arange(n_radii, dtype=torch.float64)  # [R]
    angles = step * torch.arange(n_angles, dtype=torch.float64)  # [A]
    x = pad_radii[:, None] * torch.cos(angles)[None, :]  # [R, A]
    y = pad_radii[:, None] * torch.sin(angles)[None, :]
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # [R*A, 2], ring by ring


@dataclass(frozen=True, eq=False)
class FoveatedSampling:
    """One foveated sampling and its pad ring; treat the tensors as read-only (it is cached).

    Attributes:
        res, fov, cmf_a: the parameters it was built from.
        fovi_version: whose formulas built it (:data:`FOVI_VERSIONS`).
        field_geometry: the cortical surface of ``cortical`` (``"planar"`` or ``"legacy"``).
        arithmetic: ``"fovi"`` (the version's float32 arithmetic) or ``"exact"`` (float64).
        radii: ``[res]`` ring radii (field-of-view edge at 1).
        ring_sizes: points per ring.
        cartesian: ``[N, 2]`` visual coordinates (unit disk = field of view).
        cortical: ``[N, 3]`` cortical coordinates (mm), see ``manifold``.
        pad_cartesian: ``[P, 2]`` pad coordinates (outside the unit disk).
        pad_cortical: ``[P, 3]`` their cortical coordinates.

    Coordinates are float32 with ``arithmetic="fovi"``, float64 with ``"exact"``.
    """

    res: int
    fov: float
    cmf_a: float
    fovi_version: str
    field_geometry: str
    arithmetic: str
    radii: torch.Tensor
    ring_sizes: tuple[int, ...]
    cartesian: torch.Tensor
    cortical: torch.Tensor
    pad_cartesian: torch.Tensor
    pad_cortical: torch.Tensor

    @property
    def n(self) -> int:
        """Number of sampling points ``N``."""
        return int(self.cartesian.shape[0])

    @property
    def n_pad(self) -> int:
        """Number of pad coordinates ``P``."""
        return int(self.pad_cartesian.shape[0])


def foveated_sampling(
    res: int,
    fov: float,
    cmf_a: float,
    field_geometry: str | None = None,
    fovi_version: str = DEFAULT_FOVI_VERSION,
    arithmetic: str = "fovi",
) -> FoveatedSampling:
    """The isotropic sampling with ``res`` rings, built (once) with ``fovi_version``'s formulas.

    ``field_geometry=None`` means the version's default surface (:func:`resolve_field_geometry`):
    ``"planar"`` for fovi 2.4.0, ``"legacy"`` for bf792c2. ``arithmetic`` is ``"fovi"`` (fovi's
    float32 roundings) or ``"exact"`` (float64, see the module docstring).
    """
    check_sampling_params(
        fov,
        cmf_a,
        res=res,
        fovi_version=fovi_version,
        field_geometry=field_geometry,
        arithmetic=arithmetic,
    )
    geometry = resolve_field_geometry(fovi_version, field_geometry)
    return _cached_sampling(res, fov, cmf_a, geometry, fovi_version, arithmetic)


@functools.lru_cache(maxsize=64)
def _cached_sampling(
    res: int, fov: float, cmf_a: float, field_geometry: str, fovi_version: str, arithmetic: str
) -> FoveatedSampling:
    exact = arithmetic == "exact"
    radii, counts = ring_radii(res, fov, cmf_a, torch.float64 if exact else torch.float32)
    if exact:
        points, pads = _ring_points_2_4_0(radii, counts), _pad_points_exact(radii)  # float64
    elif fovi_version == "2.4.0":
        points = _ring_points_2_4_0(radii, counts)  # [N, 2] float32
        pads = _pad_points_2_4_0(radii)  # [P, 2] float32
    else:
        points = _ring_points_bf792c2(radii, counts)  # [N, 2] float64
        pads = _pad_points_bf792c2(radii)  # [P, 2] float32
    # fovi stores float32 points (bf792c2 maps its float64 ones first); exact stays float64.
    stored = torch.float64 if exact else torch.float32
    return FoveatedSampling(
        res=res,
        fov=fov,
        cmf_a=cmf_a,
        fovi_version=fovi_version,
        field_geometry=field_geometry,
        arithmetic=arithmetic,
        radii=radii,
        ring_sizes=counts,
        cartesian=points.to(stored),
        cortical=cortical_coords(points.numpy(), fov, cmf_a, field_geometry, stored),
        pad_cartesian=pads,
        pad_cortical=cortical_coords(pads.numpy(), fov, cmf_a, field_geometry, stored),
    )
