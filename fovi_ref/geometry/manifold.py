"""The cortical sensor manifold: where a visual-field point lands on a model of cortex.

fovi measures neighbourhoods on a 3-D surface rather than in the visual field. A point at
eccentricity ``r`` (degrees) and polar angle ``theta`` maps to cylindrical coordinates
``(rho(r), z(r), phi = theta)`` and from there to cartesian ``(rho cos phi, rho sin phi, z)``.
With the cortical magnification ``M(r) = k / (r + a)`` (mm per degree; ``a = cmf_a``, ``k = 10``),
``rho`` is chosen so that a ring of eccentricity ``r`` has cortical circumference ``2 pi rho(r)``
and ``z`` so that a radial step ``dr`` has cortical length ``M(r) dr``:
``z(r) = integral_0^r sqrt(M(s)^2 - rho'(s)^2) ds``. Two of fovi's surfaces (its
``field_geometry``) are implemented:

- ``"planar"`` (fovi 2.4.0's default): the visual field is a plane, ``rho(r) = M(r) r``. Then
  ``rho' = k a / (r + a)^2`` and, with ``u = r / a + 1`` and ``t = sqrt(u^2 - 1)``, the integral
  has the closed form ``z(r) = k (asinh t - t / sqrt(1 + t^2))``: no table.
- ``"legacy"`` (the only surface of fovi commit bf792c2): rings are sized as on a sphere (the
  ring at ``r`` degrees has circumference ``2 pi sin(r deg)``),
  ``rho(r) = M(r) sin(r deg) 180/pi``. ``z`` has no closed form; it is tabulated once with the
  trapezoid rule on a ``1e-4``-degree mesh over ``[0, 2 fov)`` and read by linear interpolation.

The surface is locally isotropic, so Euclidean distance in these 3-D coordinates is (for the
small neighbourhoods of a KNN convolution) the distance along cortex.

Precision mirrors fovi, which maps one point at a time with NumPy scalars. A point is mapped in
the dtype it arrives in (float32 for fovi 2.4.0's samplings; float64 sampling points and float32
pad points for bf792c2); only the tabulated legacy ``z`` is float64 (interpolation of a float64
table). The result is rounded to float32. One scalar detail matters: fovi squares each coordinate
with NumPy's scalar power, which calls the C library's ``pow``; for float32 that is not always
the correctly rounded ``x * x`` that array squaring gives, and a one-ulp change of ``r`` can flip
a distance tie. :func:`_scalar_squares` reproduces it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = [
    "FIELD_GEOMETRIES",
    "MAGNIFICATION_SCALE",
    "check_field_geometry",
    "cortical_coords",
    "z_table",
]

MAGNIFICATION_SCALE = 10
"""``k`` in ``M(r) = k / (r + a)``: millimetres of cortex per degree near the fovea, times ``a``.

It scales all cortical coordinates alike, so it changes no neighbourhood; it is kept at fovi's
value so the float32 roundings, and hence near-ties, are the same as fovi's."""

FIELD_GEOMETRIES = ("planar", "legacy")
"""The cortical surfaces implemented here, by fovi's ``field_geometry`` names (fovi 2.4.0 also
has ``"spherical"``)."""

_MESH_STEP = 0.0001  # degrees between samples of the tabulated legacy z(r)
_DEG_PER_RAD = 180 / np.pi


def _magnification(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """``M(r) = k / (a + r)`` in mm/degree, in ``r``'s dtype."""
    return MAGNIFICATION_SCALE / (cmf_a + r)


# ---------------------------------------------------------------------------------- planar
def _rho_planar(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """Planar field: ``rho(r) = M(r) r`` in mm, in ``r``'s dtype."""
    return _magnification(r, cmf_a) * r


def _z_planar(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """Planar field: ``z(r) = k (asinh t - t / sqrt(1 + t^2))``, ``t = sqrt((r/a + 1)^2 - 1)``.

    Exact (no table), in ``r``'s dtype; ``max(., 0)`` guards rounding at ``r = 0``.
    """
    u = r / cmf_a + 1  # [N]
    t = np.sqrt(np.maximum(u * u - 1, 0))  # [N]
    return MAGNIFICATION_SCALE * (np.arcsinh(t) - t / np.sqrt(1 + t * t))


# ---------------------------------------------------------------------------------- legacy
def _rho_legacy(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """Legacy field: ``rho(r) = M(r) sin(r deg) 180/pi`` in mm, in ``r``'s dtype."""
    return _magnification(r, cmf_a) * np.sin(np.deg2rad(r)) * _DEG_PER_RAD


def _z_legacy_slope(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """Legacy field: ``sqrt(M(r)^2 - rho'(r)^2)``, the slope ``dz/dr`` (mm/degree)."""
    m = _magnification(r, cmf_a)
    dm_dr = -MAGNIFICATION_SCALE * ((cmf_a + r) ** -2)
    drho_dr = dm_dr * np.sin(np.deg2rad(r)) * _DEG_PER_RAD + m * np.cos(np.deg2rad(r))
    with np.errstate(invalid="ignore"):  # NaN where not real; cortical_coords refuses those
        return (m**2 - drho_dr**2) ** 0.5


@functools.lru_cache(maxsize=8)
def z_table(fov: float, cmf_a: float) -> tuple[np.ndarray, np.ndarray]:
    """Legacy field's tabulated ``z(r)``: ``(mesh [M], z [M])``, float64, over ``[0, 2 fov)``.

    ``z[i]`` is the cumulative trapezoid integral of :func:`_z_legacy_slope` from 0 to
    ``mesh[i]``. The mesh reaches well past the field-of-view edge ``fov / 2`` so that pad
    coordinates, which lie outside it, can be mapped too. Cached; do not modify the arrays.
    """
    mesh = np.arange(0, 2 * fov, _MESH_STEP)  # [M]
    slope = _z_legacy_slope(mesh, cmf_a)  # [M]
    steps = np.diff(mesh) * (slope[1:] + slope[:-1]) / 2.0  # [M-1]: trapezoid areas
    z = np.concatenate([np.zeros(1), np.cumsum(steps)])  # [M]
    return mesh, z


def _z_legacy(r: np.ndarray, fov: float, cmf_a: float) -> np.ndarray:
    """Legacy field: ``z(r)`` read off :func:`z_table` by linear interpolation, float64."""
    mesh, z_of_mesh = z_table(fov, cmf_a)
    if r.size and float(r.max()) > mesh[-1]:
        raise ValueError(
            f"a point at eccentricity {float(r.max()):.4g} deg lies beyond the tabulated "
            f"cortical surface (max {mesh[-1]:.4g} deg) for fov={fov}"
        )
    return np.interp(r, mesh, z_of_mesh)  # [N] float64


# ------------------------------------------------------------------------------- mapping
def _scalar_squares(values: np.ndarray) -> np.ndarray:
    """``v ** 2`` of every entry taken as a NumPy scalar, as fovi's per-point loop does.

    NumPy's scalar power calls the C library's ``pow``, which for float32 can differ by one ulp
    from the correctly rounded square that ``values ** 2`` on the array computes.
    """
    return np.array([v**2 for v in values], dtype=values.dtype)  # [N]


def check_field_geometry(field_geometry: str) -> None:
    """Raise ``ValueError`` unless ``field_geometry`` is one of :data:`FIELD_GEOMETRIES`."""
    if field_geometry not in FIELD_GEOMETRIES:
        raise ValueError(
            f"field_geometry={field_geometry!r} is not supported; supported: {FIELD_GEOMETRIES}"
        )


def cortical_coords(
    xy: np.ndarray,
    fov: float,
    cmf_a: float,
    field_geometry: str = "planar",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Map visual-field points to the cortical surface.

    Args:
        xy: ``[N, 2]`` visual cartesian coordinates normalised so the field-of-view edge is at
            radius 1 (a point ``(x, y)`` sits ``fov/2 * (x, y)`` degrees from fixation). Its dtype
            (float32 or float64) is the precision of the mapping.
        fov: field-of-view diameter in degrees. cmf_a: ``a`` of the magnification function.
        field_geometry: ``"planar"`` or ``"legacy"`` (see the module docstring).
        dtype: of the result; float32 as fovi stores it, float64 for the exact construction.

    Returns:
        ``[N, 3]`` cortical cartesian coordinates ``(rho cos theta, rho sin theta, z)`` in mm.

    Raises:
        ValueError: for an unknown ``field_geometry``, a point beyond the tabulated legacy
            ``z(r)``, or a point mapping to a non-finite value.
    """
    check_field_geometry(field_geometry)
    deg = xy * (fov / 2)  # [N, 2] degrees, xy's dtype
    r = np.sqrt(_scalar_squares(deg[:, 0]) + _scalar_squares(deg[:, 1]))  # [N] eccentricity
    theta = np.arctan2(deg[:, 1], deg[:, 0])  # [N] polar angle
    if field_geometry == "planar":
        rho, z = _rho_planar(r, cmf_a), _z_planar(r, cmf_a)  # [N] each, xy's dtype
    else:
        rho, z = _rho_legacy(r, cmf_a), _z_legacy(r, fov, cmf_a)  # [N] xy's dtype, [N] float64
    xyz = np.stack(
        [
            (rho * np.cos(theta)).astype(np.float64),
            (rho * np.sin(theta)).astype(np.float64),
            z.astype(np.float64),
        ],
        axis=1,
    )  # [N, 3]
    if not np.isfinite(xyz).all():
        raise ValueError(
            f"the {field_geometry!r} cortical surface is undefined for fov={fov}, cmf_a={cmf_a}: "
            f"points up to {float(r.max()):.4g} deg from fixation (pads included) map to "
            "non-finite coordinates; use a smaller fov"
        )
    return torch.from_numpy(xyz).to(dtype)
