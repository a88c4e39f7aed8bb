"""The 20 KNN convolutions of fovi's KNNResNet-18, with their real graphs.

fovi's ResNet-18 (blocks ``[2, 2, 2, 2]``, cortical sampling) resamples the foveated grid like a
CNN resamples its pixel grid; "stride ``s``" means "``res // s`` rings"::

    input        in_res rings                                   (64 -> 5977 points)
    conv1        K=49, 3 -> 64,   stride 2: in_res -> r1 = in_res // 2      (32 -> 1469)
    maxpool      (not a convolution), stride 2: r1 -> r2 = r1 // 2          (16 -> 356)
    layer1       2 blocks, 64 channels, stride 1 (r2 -> r2)
    layer2       2 blocks, 128 channels, stride 2 (r2 -> r2 // 2)           (8 -> 83)
    layer3       2 blocks, 256 channels, stride 2                            (4 -> 16)
    layer4       2 blocks, 512 channels, stride 2                            (2 -> 2)

Each block ``layerL.B`` has ``conv1`` (K=9, carries the stride), ``conv2`` (K=9, stride 1) and,
in block 0 of a strided stage, ``downsample.0``: a K=1 convolution from the block's input grid to
its output grid (each output reads its single nearest input). Records are listed in fovi's module
order (``named_modules``): ``conv1``, then per block ``conv1``, ``conv2``, ``downsample.0``.

``K`` is capped at the input count: layer4's two-point grids give ``K = 2``, ``V = 4``.

By default the graphs are those of fovi 2.4.0's ``KNNResNet()`` (planar cortical surface, float32
sampling); ``field_geometry="legacy"`` gives 2.4.0's ``KNNResNet(field_geometry="legacy")`` and
``fovi_version="bf792c2"`` the graphs of fovi's GitHub commit bf792c2. The table above (grid
sizes, ``K``, ``V``) is the same in all three; only which neighbours and cells some nodes get
differs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fovi_ref.geometry.graph import LayerGraph, layer_graph
from fovi_ref.geometry.sampling import (
    DEFAULT_FOVI_VERSION,
    check_sampling_params,
    resolve_field_geometry,
    strided_res,
)
from fovi_ref.meta import check_int

__all__ = [
    "RES18_DOWNSAMPLES",
    "ConvSpec",
    "UnknownLayerError",
    "get_layer",
    "resnet18_layers",
    "resnet18_plan",
]

RES18_DOWNSAMPLES = {
    "res18_ds2": "layer2.0.downsample.0",
    "res18_ds3": "layer3.0.downsample.0",
    "res18_ds4": "layer4.0.downsample.0",
}
"""Short aliases for the three K=1 (``gather_gemm``-routed) downsample convolutions."""

_STEM_K = 49
_BLOCK_K = 9
_STEM_STRIDE = 2
_POOL_STRIDE = 2
_STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (channels, stride) of layer1..layer4
_BLOCKS_PER_STAGE = 2


@dataclass(frozen=True)
class ConvSpec:
    """One KNN convolution of the network: its name, channels, requested K and grids."""

    name: str
    in_channels: int
    out_channels: int
    k: int
    in_res: int
    out_res: int


def resnet18_plan(in_res: int = 64) -> list[ConvSpec]:
    """The 20 convolutions of fovi's KNNResNet-18, in module order (see the module docstring).

    Raises ``TypeError`` for a non-int ``in_res``, ``ValueError`` for ``in_res < 32`` (a stride
    would leave no ring).
    """
    check_int("in_res", in_res, low=1)
    r1 = strided_res(in_res, _STEM_STRIDE)
    plan = [ConvSpec("conv1", 3, 64, _STEM_K, in_res, r1)]
    res = strided_res(r1, _POOL_STRIDE)
    channels = 64
    for stage, (planes, stride) in enumerate(_STAGES, start=1):
        for block in range(_BLOCKS_PER_STAGE):
            s = stride if block == 0 else 1
            out = strided_res(res, s)
            prefix = f"layer{stage}.{block}"
            plan.append(ConvSpec(f"{prefix}.conv1", channels, planes, _BLOCK_K, res, out))
            plan.append(ConvSpec(f"{prefix}.conv2", planes, planes, _BLOCK_K, out, out))
            if s != 1:
                plan.append(ConvSpec(f"{prefix}.downsample.0", channels, planes, 1, res, out))
            channels, res = planes, out
    return plan


def _check_resnet18_params(
    in_res: int,
    fov: float,
    cmf_a: float,
    style: str,
    fovi_version: str,
    field_geometry: str | None,
    arithmetic: str,
) -> None:
    check_int("in_res", in_res, low=1)
    check_sampling_params(
        fov,
        cmf_a,
        style,
        fovi_version=fovi_version,
        field_geometry=field_geometry,
        arithmetic=arithmetic,
    )
    smallest = in_res // 2**5  # stem, pool and three strided stages each halve the rings
    if smallest < 2:
        raise ValueError(
            f"in_res={in_res} is too small for resnet18: layer4 would sample {smallest} ring(s); "
            "fovi's KNN layers need >= 2 rings (a pad ring), i.e. in_res >= 64"
        )


@functools.lru_cache(maxsize=16)
def _cached_layers(
    in_res: int, fov: float, cmf_a: float, field_geometry: str, fovi_version: str, arithmetic: str
) -> tuple[tuple[str, LayerGraph], ...]:
    return tuple(
        (
            spec.name,
            layer_graph(
                spec.name,
                in_channels=spec.in_channels,
                out_channels=spec.out_channels,
                k=spec.k,
                in_res=spec.in_res,
                out_res=spec.out_res,
                fov=fov,
                cmf_a=cmf_a,
                field_geometry=field_geometry,
                fovi_version=fovi_version,
                arithmetic=arithmetic,
            ),
        )
        for spec in resnet18_plan(in_res)
    )


def resnet18_layers(
    in_res: int = 64,
    fov: float = 16,
    cmf_a: float = 0.5,
    style: str = "isotropic",
    field_geometry: str | None = None,
    fovi_version: str = DEFAULT_FOVI_VERSION,
    arithmetic: str = "fovi",
) -> dict[str, LayerGraph]:
    """The graphs of all 20 KNN convolutions of fovi's KNNResNet-18, in module order.

    With the defaults these are the graphs of fovi 2.4.0's ``KNNResNet(device="cpu")`` as fovi
    builds them *on this machine*: near-ties of fovi's float32 distances go whichever way this
    machine's arithmetic sends them (:mod:`~fovi_ref.geometry.certificate` lists them).
    ``arithmetic="exact"`` gives graphs that are the same on every machine
    (:mod:`~fovi_ref.geometry.exact`).

    Args:
        in_res: rings of the input sampling (fovi's default 64 gives 5977 input points).
        fov: field-of-view diameter in degrees. cmf_a: ``a`` of ``M(r) = k / (r + a)``.
        style: sampling style; only ``"isotropic"`` is implemented.
        field_geometry: fovi's cortical surface, ``"planar"`` or ``"legacy"``; None (default)
            means the version's default: ``"planar"`` for 2.4.0, ``"legacy"`` for bf792c2 (which
            has no other).
        fovi_version: ``"2.4.0"`` (default, the release on PyPI) or ``"bf792c2"`` (the GitHub
            commit whose float64 sampling angles this package first reproduced).
        arithmetic: ``"fovi"`` (default: fovi's float32 steps) or ``"exact"`` (float64
            distances, ties by index; fovi 2.4.0's formulas only).

    Returns:
        A new dict ``{module path: LayerGraph}`` each call; the records themselves are cached.

    Raises:
        TypeError: naming the argument, for a non-int ``in_res`` or a non-number ``fov`` or
            ``cmf_a``.
        ValueError: naming the argument, for ``in_res < 64`` (too few rings for layer4),
            ``fov`` outside :data:`~fovi_ref.geometry.sampling.FOV_RANGE` (or above 180 on the
            ``"legacy"`` surface), ``cmf_a / (fov/2)`` outside
            :data:`~fovi_ref.geometry.sampling.CMF_A_RATIO_RANGE` (NaN and inf included), too
            many rings for float32 to resolve at that ratio, an unknown ``style``,
            ``fovi_version`` or ``field_geometry``, or a ``field_geometry`` the version does not
            have, or an unknown ``arithmetic``;
            :class:`~fovi_ref.geometry.exact.AmbiguousGraphError` (a ``ValueError``) where the
            exact construction cannot decide a tie for certain.
    """
    _check_resnet18_params(in_res, fov, cmf_a, style, fovi_version, field_geometry, arithmetic)
    geometry = resolve_field_geometry(fovi_version, field_geometry)
    return dict(_cached_layers(in_res, fov, cmf_a, geometry, fovi_version, arithmetic))


class UnknownLayerError(KeyError):
    """A layer name that is neither a module path of the network nor a ``res18_ds*`` alias."""

    def __str__(self) -> str:  # KeyError would print the message as a quoted repr
        return str(self.args[0])


def get_layer(name: str, **kwargs) -> LayerGraph:
    """One layer of :func:`resnet18_layers` (``**kwargs`` go there), by module path or alias.

    ``name`` is a module path (``"layer3.0.conv2"``) or a :data:`RES18_DOWNSAMPLES` alias
    (``"res18_ds3"``). Raises :class:`UnknownLayerError` (a ``KeyError``) listing the valid names.
    """
    layers = resnet18_layers(**kwargs)
    path = RES18_DOWNSAMPLES.get(name, name)
    if path not in layers:
        raise UnknownLayerError(
            f"unknown layer {name!r}; valid names: {', '.join(layers)} "
            f"or aliases {', '.join(RES18_DOWNSAMPLES)}"
        )
    return layers[path]
