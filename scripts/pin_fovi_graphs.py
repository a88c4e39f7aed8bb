"""Pin the KNN graphs of fovi 2.4.0's KNNResNet-18, for tests and notebooks that run without fovi.

Builds fovi's own ``KNNResNet(device="cpu", ...)`` for each setting in
:data:`fovi_ref.geometry.pinned.PINNED_SETTINGS`, reads every ``KNNConvLayer``'s
``knn_indices_pad_token [K, Nout]`` (padding = ``Nin``) and ``local_rf [Nout, K, V]`` (one-hot;
its argmax is ``rf_index [Nout, K]``), and writes the tensors with the machine's description to
``fovi_ref/geometry/data/fovi_2.4.0_graphs.npz`` (read by :mod:`fovi_ref.geometry.pinned`).
fovi's graphs depend on the machine (:mod:`fovi_ref.geometry.certificate`): the tests compare the
determined nodes only. ``tests/data/fovi_2.4.0_graphs.json`` holds the digests an earlier
version of this script wrote on another machine (an AMD EPYC), kept as a second witness.

Regenerate (from the repository root, in an environment with fovi_ref installed)::

    pip install --no-deps -r scripts/fovi-requirements.txt
    python scripts/pin_fovi_graphs.py            # writes the archive, prints the agreement table
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
from fovi_ref.geometry.digest import node_agreement, node_digits
from fovi_ref.geometry.pinned import PINNED_FILE, PINNED_SETTINGS

FOVI_VERSION = "2.4.0"


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


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = parser.parse_args()

    import fovi

    environment = {
        "fovi": fovi.__version__,
        "fovi_call": "fovi.models.knnresnet.KNNResNet(device='cpu', **kwargs)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "threads": str(torch.get_num_threads()),
    }
    arrays = {"environment": np.array(json.dumps(environment))}
    for name, setting in PINNED_SETTINGS.items():
        graphs = fovi_graphs(setting)
        print("\n".join(agreement_rows(name, setting, graphs)), flush=True)
        layers, stored = [], {}  # stored: graph bytes -> the layer that holds them
        for path, (knn, rf_index, layer) in graphs.items():
            key = knn.numpy().tobytes() + rf_index.numpy().tobytes()
            holder = stored.setdefault(key, path)  # layers sharing a graph store it once
            n_in, v = int(layer.knn_pad_token_val), layer.local_rf.shape[2]
            layers.append([path, layer.in_channels, n_in, v, holder])
            if holder == path:
                arrays[f"{name}/{path}/knn"] = knn.numpy().astype(np.int16)
                arrays[f"{name}/{path}/rf_index"] = rf_index.numpy().astype(np.int8)
        arrays[f"{name}/layers"] = np.array(json.dumps(layers))
    if not args.check:
        PINNED_FILE.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(PINNED_FILE, **arrays)
        print(f"wrote {PINNED_FILE}")


if __name__ == "__main__":
    main()
