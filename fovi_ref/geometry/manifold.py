"""The cortical sensor manifold: where a visual-field point lands on a model of cortex.

fovi measures neighbourhoods on a 3-D surface rather than in the visual field. A point at
eccentricity ``r`` (degrees) and polar angle ``theta`` maps to cylindrical coordinates
``(rho(r), z(r), phi = theta)`` and from there to cartesian ``(rho cos phi, rho sin phi, z)``.
With the cortical magnification ``M(r) = k / (r + a)`` (mm per degree; ``a = cmf_a``, ``k = 10``):

- ``rho(r) = M(r) * sin(r deg) * 180/pi``: a ring of eccentricity ``r`` has cortical
  circumference ``2 pi rho(r)``, matching the magnified visual circumference.
- ``z(r) = integral_0^r sqrt(M(s)^2 - rho'(s)^2) ds``: chosen so that a radial step ``dr`` has
  cortical length ``M(r) dr`` (``rho'^2 + z'^2 = M^2``). The integral is tabulated once with the
  trapezoid rule on a ``1e-4``-degree mesh over ``[0, 2 fov)`` and read by linear interpolation.

The surface is locally isotropic, so Euclidean distance in these 3-D coordinates is (for the
small neighbourhoods of a KNN convolution) the distance along cortex.

Precision mirrors fovi: the table is float64, and a point is mapped in the dtype it arrives in
(float64 for the sampling coordinates, float32 for the pad coordinates), then the result is
rounded to float32. Only ``z`` is always computed in float64 (interpolation of the table).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["MAGNIFICATION_SCALE", "cortical_coords", "z_table"]

MAGNIFICATION_SCALE = 10
"""``k`` in ``M(r) = k / (r + a)``: millimetres of cortex per degree near the fovea, times ``a``.

It scales all cortical coordinates alike, so it changes no neighbourhood; it is kept at fovi's
value so the float32 roundings, and hence near-ties, are the same as fovi's."""

_MESH_STEP = 0.0001  # degrees between samples of the tabulated z(r)
_DEG_PER_RAD = 180 / np.pi


def _magnification(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """``M(r) = k / (a + r)`` in mm/degree, in ``r``'s dtype."""
    return MAGNIFICATION_SCALE / (cmf_a + r)


def _rho(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """Cylindrical radius ``rho(r) = M(r) sin(r deg) 180/pi`` in mm, in ``r``'s dtype."""
    return _magnification(r, cmf_a) * np.sin(np.deg2rad(r)) * _DEG_PER_RAD


def _z_integrand(r: np.ndarray, cmf_a: float) -> np.ndarray:
    """``sqrt(M(r)^2 - rho'(r)^2)``, the slope ``dz/dr`` of the surface (mm/degree)."""
    m = _magnification(r, cmf_a)
    dm_dr = -MAGNIFICATION_SCALE * ((cmf_a + r) ** -2)
    drho_dr = dm_dr * np.sin(np.deg2rad(r)) * _DEG_PER_RAD + m * np.cos(np.deg2rad(r))
    return (m**2 - drho_dr**2) ** 0.5


@functools.lru_cache(maxsize=8)
def z_table(fov: float, cmf_a: float) -> tuple[np.ndarray, np.ndarray]:
    """Tabulated ``z(r)``: ``(mesh [M], z [M])``, float64, ``mesh`` in degrees over ``[0, 2 fov)``.

    ``z[i]`` is the cumulative trapezoid integral of :func:`_z_integrand` from 0 to ``mesh[i]``.
    The mesh reaches well past the field-of-view edge ``fov / 2`` so that pad coordinates, which
    lie outside it, can be mapped too. Cached; do not modify the returned arrays.
    """
    mesh = np.arange(0, 2 * fov, _MESH_STEP)  # [M]
    slope = _z_integrand(mesh, cmf_a)  # [M]
    steps = np.diff(mesh) * (slope[1:] + slope[:-1]) / 2.0  # [M-1]: trapezoid areas
    z = np.concatenate([np.zeros(1), np.cumsum(steps)])  # [M]
    return mesh, z


def cortical_coords(xy: np.ndarray, fov: float, cmf_a: float) -> torch.Tensor:
    """Map visual-field points to the cortical surface.

    Args:
        xy: ``[N, 2]`` visual cartesian coordinates normalised so the field-of-view edge is at
            radius 1 (a point ``(x, y)`` sits ``fov/2 * (x, y)`` degrees from fixation). Its dtype
            (float32 or float64) is the precision of the mapping.
        fov: field-of-view diameter in degrees. cmf_a: ``a`` of the magnification function.

    Returns:
        ``[N, 3]`` float32 cortical cartesian coordinates ``(rho cos theta, rho sin theta, z)``
        in mm.

    Raises:
        ValueError: if a point lies beyond the tabulated ``z(r)`` or maps to a non-finite value.
    """
    deg = xy * (fov / 2)  # [N, 2] degrees, xy's dtype
    r = np.sqrt(deg[:, 0] ** 2 + deg[:, 1] ** 2)  # [N] eccentricity
    theta = np.arctan2(deg[:, 1], deg[:, 0])  # [N] polar angle
    mesh, z_of_mesh = z_table(fov, cmf_a)
    if r.size and float(r.max()) > mesh[-1]:
        raise ValueError(
            f"a point at eccentricity {float(r.max()):.4g} deg lies beyond the tabulated "
            f"cortical surface (max {mesh[-1]:.4g} deg) for fov={fov}"
        )
    rho = _rho(r, cmf_a)  # [N]
    z = np.interp(r, mesh, z_of_mesh)  # [N] float64
    xyz = np.stack(
        [
            (rho * np.cos(theta)).astype(np.float64),
            (rho * np.sin(theta)).astype(np.float64),
            z,
        ],
        axis=1,
    )  # [N, 3]
    if not np.isfinite(xyz).all():
        raise ValueError(
            f"the cortical surface is undefined for fov={fov}, cmf_a={cmf_a} "
            "(non-finite coordinates); use a smaller fov"
        )
    return torch.from_numpy(xyz).to(torch.float32)
