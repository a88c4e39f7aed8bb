"""fovi 2.4.0's own graphs, as fovi built them on one machine, shipped with the package.

fovi's graphs depend on the machine that builds them (:mod:`.certificate`), so
``resnet18_layers()`` reproduces fovi *on the machine at hand*. Statistics, figures and tests that
must come out the same everywhere read these pinned graphs instead: ``knn [K, Nout]``
(fovi's ``knn_indices_pad_token``) and ``rf_index [Nout, K]`` (``local_rf.argmax(-1)``) of every
``KNNConvLayer`` of fovi 2.4.0's ``KNNResNet(device="cpu", **kwargs)`` for each setting of
:data:`PINNED_SETTINGS`, written by ``scripts/pin_fovi_graphs.py`` into
``data/fovi_2.4.0_graphs.npz`` (``int16``/``int8``, compressed). :func:`pinned_environment` says
where they were built.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from fovi_ref.meta import KNNMeta

__all__ = ["PINNED_FILE", "PINNED_SETTINGS", "pinned_environment", "pinned_graphs"]

PINNED_FILE = Path(__file__).parent / "data" / "fovi_2.4.0_graphs.npz"

PINNED_SETTINGS = {
    "default": {"in_res": 64, "fov": 16, "cmf_a": 0.5, "field_geometry": "planar"},
    "legacy": {"in_res": 64, "fov": 16, "cmf_a": 0.5, "field_geometry": "legacy"},
    "res80_fov20_a1": {"in_res": 80, "fov": 20, "cmf_a": 1.0, "field_geometry": "planar"},
    "res72_fov12_a0.3_legacy": {"in_res": 72, "fov": 12, "cmf_a": 0.3, "field_geometry": "legacy"},
}
"""Keyword arguments shared by fovi's ``KNNResNet`` and :func:`~.resnet18.resnet18_layers`."""


@functools.cache
def _archive() -> dict[str, np.ndarray]:
    with np.load(PINNED_FILE) as data:
        return {key: data[key] for key in data.files}


def pinned_environment() -> dict[str, str]:
    """Versions and CPU of the machine the pinned graphs were built on."""
    return json.loads(str(_archive()["environment"]))


def pinned_graphs(setting: str = "default") -> dict[str, KNNMeta]:
    """``{module path: KNNMeta}`` of fovi 2.4.0's KNNResNet-18 for one pinned setting.

    Raises ``KeyError`` naming the settings there are.
    """
    if setting not in PINNED_SETTINGS:
        raise KeyError(f"no pinned setting {setting!r}; pinned: {', '.join(PINNED_SETTINGS)}")
    archive = _archive()
    # [[name, in_channels, n_in, v, holder]]: layers with the same graph share one stored copy
    layers = json.loads(str(archive[f"{setting}/layers"]))
    return {
        name: KNNMeta.from_knn(
            torch.from_numpy(archive[f"{setting}/{holder}/knn"].astype(np.int64)),
            torch.from_numpy(archive[f"{setting}/{holder}/rf_index"].astype(np.int64)),
            n_in=n_in,
            in_channels=in_channels,
            v=v,
        )
        for name, in_channels, n_in, v, holder in layers
    }
