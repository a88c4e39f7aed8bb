"""Pin the KNN graphs of fovi 2.4.0's KNNResNet-18 for tests that run without fovi.

Builds fovi's own ``KNNResNet(device="cpu", ...)`` for each setting in :data:`SETTINGS`, reads every
``KNNConvLayer``'s ``knn_indices_pad_token [K, Nout]`` (padding = ``Nin``) and ``local_rf [Nout,
K, V]`` (one-hot; its argmax is ``rf_index [Nout, K]``), and writes their fingerprints
(:mod:`fovi_ref.geometry.digest`: sha256 of each tensor, one hex digit per node) with the shapes
to ``tests/data/fovi_2.4.0_graphs.json``. ``tests/test_geometry.py`` rebuilds the same graphs with
:func:`fovi_ref.geometry.resnet18_layers` and compares.

Regenerate (from the repository root, in an environment with fovi_ref installed)::

    pip install --no-deps fovi==2.4.0
    pip install einops scipy scikit-image lazy_loader trimesh   # what fovi.arch/.sensing import
    python scripts/pin_fovi_graphs.py            # writes the JSON, prints the agreement table
    python scripts/pin_fovi_graphs.py --check    # only compares fovi with fovi_ref, writes nothing

fovi's ``fovi.models`` package refuses to import without its model-zoo extras (timm, hydra, ...),
but ``fovi/models/knnresnet.py`` only needs ``fovi.arch``, ``fovi.sensing`` and ``fovi.utils``; the
script registers a bare ``fovi.models`` package so that file can be imported on its own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import scipy
import torch

from fovi_ref.geometry import resnet18_layers
from fovi_ref.geometry.digest import node_agreement, node_digits, tensor_sha256

FOVI_VERSION = "2.4.0"
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / f"fovi_{FOVI_VERSION}_graphs.json"

SETTINGS = {
    "default": {"in_res": 64, "fov": 16, "cmf_a": 0.5, "field_geometry": "planar"},
    "legacy": {"in_res": 64, "fov": 16, "cmf_a": 0.5, "field_geometry": "legacy"},
    "res80_fov20_a1": {"in_res": 80, "fov": 20, "cmf_a": 1.0, "field_geometry": "planar"},
    "res72_fov12_a0.3_legacy": {"in_res": 72, "fov": 12, "cmf_a": 0.3, "field_geometry": "legacy"},
}
"""Keyword arguments shared by ``fovi.models.knnresnet.KNNResNet`` and ``resnet18_layers``."""


def knnresnet_module() -> types.ModuleType:
    """``fovi.models.knnresnet`` imported without running ``fovi/models/__init__.py``."""
    import fovi

    if fovi.__version__ != FOVI_VERSION:
        sys.exit(f"fovi {FOVI_VERSION} is needed, found {fovi.__version__}")
    if "fovi.models" not in sys.modules:
        bare = types.ModuleType("fovi.models")
        bare.__path__ = [str(Path(fovi.__file__).parent / "models")]
        sys.modules["fovi.models"] = bare
    return importlib.import_module("fovi.models.knnresnet")


def fovi_graphs(setting: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor, object]]:
    """``{module path: (knn [K, Nout], rf_index [Nout, K], layer)}`` of fovi's KNNResNet()."""
    from fovi.arch.knn import KNNConvLayer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fovi's torch.meshgrid call warns about `indexing`
        net = knnresnet_module().KNNResNet(device="cpu", **setting)
    graphs = {}
    for name, layer in net.named_modules():
        if isinstance(layer, KNNConvLayer):
            local_rf = layer.local_rf  # [Nout, K, V], one-hot over V
            assert torch.equal(local_rf.sum(dim=2), torch.ones_like(local_rf[..., 0])), name
            graphs[name] = (layer.knn_indices_pad_token, local_rf.argmax(dim=2), layer)
    return graphs


def layer_record(knn: torch.Tensor, rf_index: torch.Tensor, layer) -> dict:
    return {
        "in_channels": layer.in_channels,
        "out_channels": layer.out_channels,
        "k": int(knn.shape[0]),
        "v": int(layer.local_rf.shape[2]),
        "n_in": int(layer.knn_pad_token_val),
        "n_out": int(knn.shape[1]),
        "knn_sha256": tensor_sha256(knn),
        "rf_index_sha256": tensor_sha256(rf_index),
        "node_digits": node_digits(knn, rf_index),
    }


def agreement_rows(name: str, setting: dict, graphs: dict) -> list[str]:
    """One line per layer: nodes with the same (neighbour, cell) set, equal knn/rf_index entries."""
    ours = resnet18_layers(**setting)
    rows = []
    for path, (knn, rf_index, _) in graphs.items():
        meta = ours[path].meta
        if meta.knn.shape != knn.shape:
            rows.append(f"{name:24s} {path:22s} shape {tuple(meta.knn.shape)} != {knn.shape}")
            continue
        nodes = sum(
            sorted(zip(meta.knn[:, n].tolist(), meta.rf_index[n].tolist(), strict=True))
            == sorted(zip(knn[:, n].tolist(), rf_index[n].tolist(), strict=True))
            for n in range(knn.shape[1])
        )
        knn_eq = int((meta.knn == knn).sum())
        rf_eq = int((meta.rf_index == rf_index).sum())
        rows.append(
            f"{name:24s} {path:22s} nodes {nodes:5d}/{knn.shape[1]:<5d} "
            f"knn {knn_eq:6d}/{knn.numel():<6d} rf_index {rf_eq:6d}/{rf_index.numel()}"
        )
        digits = node_digits(meta.knn, meta.rf_index)
        assert node_agreement(digits, node_digits(knn, rf_index)) >= nodes
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = parser.parse_args()

    import fovi

    pinned = {
        "fovi_version": fovi.__version__,
        "generated_by": "scripts/pin_fovi_graphs.py",
        "fovi_call": "fovi.models.knnresnet.KNNResNet(device='cpu', **kwargs)",
        "tensors": (
            "knn = layer.knn_indices_pad_token [K, Nout] (padding = n_in); "
            "rf_index = layer.local_rf.argmax(-1) [Nout, K]; "
            "digests as in fovi_ref.geometry.digest"
        ),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "machine": platform.machine(),
            "system": platform.system(),
        },
        "settings": {},
    }
    for name, setting in SETTINGS.items():
        graphs = fovi_graphs(setting)
        print("\n".join(agreement_rows(name, setting, graphs)), flush=True)
        pinned["settings"][name] = {
            "kwargs": setting,
            "layers": {path: layer_record(*entry) for path, entry in graphs.items()},
        }
    if not args.check:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(pinned, indent=1) + "\n")
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
