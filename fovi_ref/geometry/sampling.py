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

The dtypes reproduce fovi's: radii are computed in float32, point coordinates in float64 (ring
radius times the cosine/sine of a float64 angle) and stored as float32; pad coordinates are
float32 throughout. This matters because ties between neighbour distances are decided in float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from fovi_ref.geometry.manifold import cortical_coords

__all__ = [
    "STYLES",
    "FoveatedSampling",
    "check_sampling_params",
    "foveated_sampling",
    "ring_radii",
    "strided_res",
]

STYLES = ("isotropic",)
"""Sampling styles implemented here (fovi has more: log-polar, uniform, fixed-n, ...)."""

_PAD_DEPTH = 0.5  # how far (in field-of-view radii) the pad rings reach past the edge


def check_sampling_params(
    fov: float, cmf_a: float, style: str = "isotropic", res: int | None = None
) -> None:
    """Raise ``ValueError`` naming the first bad argument among ``style, res, fov, cmf_a``.

    ``res`` (rings) is checked only when given; a sampling needs ``res >= 2`` (one ring and the
    fixation point, which also fixes the pad ring's spacing).
    """
    if style not in STYLES:
        raise ValueError(f"style={style!r} is not supported; supported styles: {STYLES}")
    if res is not None and (isinstance(res, bool) or not isinstance(res, int) or res < 2):
        raise ValueError(f"res (number of rings) must be an int >= 2, got {res!r}")
    for arg, value, what in (("fov", fov, "field of view, degrees"), ("cmf_a", cmf_a, "a of M(r)")):
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (is_number and value > 0 and math.isfinite(value)):
            raise ValueError(f"{arg} ({what}) must be a finite number > 0, got {value!r}")


def strided_res(res: int, stride: int) -> int:
    """Rings of the output sampling of a layer with ``stride``: ``res // stride`` (>= 1)."""
    out = res // stride
    if out < 1:
        raise ValueError(f"stride {stride} leaves fewer than 1 ring from res={res}")
    return out


def ring_radii(res: int, fov: float, cmf_a: float) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Ring radii and points per ring (see the module docstring).

    Returns:
        ``radii [res]`` float32, normalised so the last ring is at 1, and ``counts`` (``res``
        ints, ``counts[0] == 1``).
    """
    w_lo = np.log(cmf_a)
    w_hi = np.log(fov / 2 + cmf_a)
    dw = (w_hi - w_lo) / (res - 1)
    w = torch.linspace(w_lo, w_hi + dw, steps=res + 1)  # [res+1] float32
    r = torch.exp(w) - cmf_a  # [res+1] degrees
    counts = [1]
    for i in range(1, res):
        spacing = ((r[i] - r[i - 1]) + (r[i + 1] - r[i])) / 2  # float32
        circumference = 2 * math.pi * r[i]  # float32
        counts.append(math.ceil(float(circumference) / float(spacing)))
    radii = r[:res] / (fov / 2)  # [res]
    return radii, tuple(counts)


def _ring_points(radii: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """``[N, 2]`` float64 cartesian points, ring by ring (``N = sum(counts)``)."""
    angles = torch.from_numpy(
        np.concatenate([np.linspace(0, 2 * np.pi, n, endpoint=False) for n in counts])
    )  # [N] float64
    radius = torch.repeat_interleave(radii.double(), torch.tensor(counts))  # [N] float64
    return torch.stack([radius * torch.cos(angles), radius * torch.sin(angles)], dim=1)


def _pad_points(radii: torch.Tensor) -> torch.Tensor:
    """``[P, 2]`` float32 pad coordinates outside the unit disk (see the module docstring)."""
    last, second_last = radii[-1].double(), radii[-2].double()
    step = last - second_last  # float64
    start = last + step
    pad_radii = torch.arange(start, start + _PAD_DEPTH, step)  # [R] float32
    angles = torch.arange(0, 2 * np.pi, step).numpy()  # [A] float32
    cos = torch.from_numpy(np.cos(angles))  # [A] float32, NumPy's float32 cosine as in fovi
    sin = torch.from_numpy(np.sin(angles))
    x = pad_radii[:, None] * cos[None, :]  # [R, A]
    y = pad_radii[:, None] * sin[None, :]
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # [R*A, 2], ring by ring


@dataclass(frozen=True, eq=False)
class FoveatedSampling:
    """One foveated sampling and its pad ring; treat the tensors as read-only (it is cached).

    Attributes:
        res, fov, cmf_a: the parameters it was built from.
        radii: ``[res]`` float32 ring radii (field-of-view edge at 1).
        ring_sizes: points per ring.
        cartesian: ``[N, 2]`` float32 visual coordinates (unit disk = field of view).
        cortical: ``[N, 3]`` float32 cortical coordinates (mm), see ``manifold``.
        pad_cartesian: ``[P, 2]`` float32 pad coordinates (outside the unit disk).
        pad_cortical: ``[P, 3]`` float32 their cortical coordinates.
    """

    res: int
    fov: float
    cmf_a: float
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


@functools.lru_cache(maxsize=32)
def foveated_sampling(res: int, fov: float, cmf_a: float) -> FoveatedSampling:
    """Build (once per argument triple) the isotropic sampling with ``res`` rings."""
    check_sampling_params(fov, cmf_a, res=res)
    radii, counts = ring_radii(res, fov, cmf_a)
    points = _ring_points(radii, counts)  # [N, 2] float64
    pads = _pad_points(radii)  # [P, 2] float32
    return FoveatedSampling(
        res=res,
        fov=fov,
        cmf_a=cmf_a,
        radii=radii,
        ring_sizes=counts,
        cartesian=points.to(torch.float32),
        cortical=cortical_coords(points.numpy(), fov, cmf_a),
        pad_cartesian=pads,
        pad_cortical=cortical_coords(pads.numpy(), fov, cmf_a),
    )
