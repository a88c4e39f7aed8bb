"""Importing fovi 2.4.0 (lazily, with an error naming the install command), its resnet18 and its
KNN conv layers, and fovi layers built on a fovi_ref graph."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from torch import nn

from fovi_ref import KNNMeta
from fovi_ref.interop.fovi import knn_conv_layers

__all__ = [
    "BACKEND_ENV",
    "FINDINGS_DIR",
    "FOVI_VERSION",
    "INFERENCE_ONLY",
    "INSTALL_HINT",
    "LAYER_ONLY",
    "PATHS",
    "REGISTRY_MODULES",
    "FoviLayer",
    "FoviUnavailable",
    "FoviVersionError",
    "build_fovi_resnet18",
    "fovi_arch",
    "fovi_conv_layers",
    "fovi_layer_from_meta",
    "fovi_resnet18_layers",
    "load_knnresnet",
    "require_fovi",
]

FOVI_VERSION = "2.4.0"
"""The fovi release this module reads (its dispatcher policy and semantics are version-specific)."""
BACKEND_ENV = "FOVI_KNN_BACKEND"
"""fovi's override: a backend named here replaces every layer's ``kernel_backend``."""
PATHS = ("layer", "function", "direct")

FINDINGS_DIR = "scripts/fovi_findings"
"""Where each finding about fovi 2.4.0 has its reproducer, relative to the repository root: one
standalone script per defect that imports only torch and fovi, builds the smallest input showing
it, prints expected against actual and exits 1 while the defect is present (its docstring is the
issue text for fovi; ``README.md`` there is the index, ``tests/test_fovi_findings.py`` runs
them)."""

INSTALL_HINT = "pip install --no-deps -r scripts/fovi-requirements.txt"
# Backends living in fovi's ops registry (``KNNConvFunction`` runs them); the module whose import
# registers each one.
REGISTRY_MODULES = {
    "torch_compact": "fovi.arch.knn_autograd",
    "gather_gemm": "fovi.arch.knn_gather_gemm",
    "cuda": "fovi.arch.knn_cuda",
    "warp_train": "fovi.arch.knn_warp",
}
LAYER_ONLY = ("baseline", "torch_scatter")  # no registry object: the layer path only
INFERENCE_ONLY = ("torch_cached", "warp_cached", "warp_memory")  # forward under no_grad only


class FoviUnavailable(ImportError):
    """fovi (or a part of it this module needs) cannot be imported here."""


class FoviVersionError(RuntimeError):
    """An installed fovi is not the release this module was written against."""


# ------------------------------------------------------------------------------ importing fovi
def require_fovi() -> ModuleType:
    """Import fovi's KNN modules and return ``fovi``.

    Raises:
        FoviUnavailable: fovi or one of its pure dependencies is missing (the message names the
            missing module and the install command).
        FoviVersionError: the installed fovi is not :data:`FOVI_VERSION`.
    """
    try:
        import fovi
        import fovi.arch.knn
        import fovi.arch.knn_autograd
        import fovi.arch.knn_optimization
    except ImportError as err:
        raise FoviUnavailable(
            f"fovi {FOVI_VERSION} is needed here but cannot be imported ({err}); "
            f"install it with: {INSTALL_HINT}"
        ) from err
    version = getattr(fovi, "__version__", "unknown")
    if version != FOVI_VERSION:
        raise FoviVersionError(
            f"fovi_ref.check.fovi reads fovi {FOVI_VERSION}, found fovi {version}; "
            f"install the pinned release with: {INSTALL_HINT}"
        )
    return fovi


def fovi_arch() -> SimpleNamespace:
    """fovi's modules used here: ``knn``, ``autograd``, ``optimization``."""
    fovi = require_fovi()
    return SimpleNamespace(
        knn=fovi.arch.knn, autograd=fovi.arch.knn_autograd, optimization=fovi.arch.knn_optimization
    )


@functools.cache
def load_knnresnet() -> ModuleType:
    """fovi's ``fovi/models/knnresnet.py`` (``KNNResNet``, its blocks), fovi's code unchanged.

    ``import fovi.models`` refuses to run without the ``fovi[models]`` extras (``timm`` and
    others, whose ``torchvision`` does not load against a CPU torch), although this one module
    needs only ``fovi.arch`` and ``fovi.sensing``. When the package import refuses, the module is
    executed from its file under its own name (``fovi.models.knnresnet``) without the package
    ``__init__``; it is not added to ``sys.modules``, so pickling a whole model by class
    reference is not possible then (``state_dict`` works).
    """
    fovi = require_fovi()
    try:
        return importlib.import_module("fovi.models.knnresnet")
    except ImportError:
        pass
    path = Path(fovi.__file__).parent / "models" / "knnresnet.py"
    spec = importlib.util.spec_from_file_location("fovi.models.knnresnet", path)
    if spec is None or spec.loader is None:
        raise FoviUnavailable(f"cannot load fovi's knnresnet module from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _quiet_fovi_build() -> Iterator[None]:
    # fovi calls torch.meshgrid without indexing=, which warns once per layer built.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.meshgrid", category=UserWarning)
        yield


# ------------------------------------------------------------------------- fovi's own layers
@dataclass(frozen=True)
class FoviLayer:
    """One of fovi's ``KNNConvLayer`` modules and the :class:`KNNMeta` read from it."""

    name: str
    layer: nn.Module
    meta: KNNMeta

    @property
    def in_channels(self) -> int:
        return int(self.layer.in_channels)

    @property
    def out_channels(self) -> int:
        return int(self.layer.out_channels)


def build_fovi_resnet18(
    *,
    num_classes: int | None = 10,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """fovi's ``KNNResNet`` with its defaults: the fovi-resnet18 network users train.

    Blocks ``[2, 2, 2, 2]``, 64 rings of input sampling (5977 points), ``fov=16``,
    ``cmf_a=0.5``, cortical sampling, BatchNorm, built on ``device`` (fovi's graph tensors are
    plain attributes that ``.to()`` does not move, so a model must be built where it runs).
    ``num_classes`` adds fovi's linear head over the flattened output; the model zoo's
    ``fovi_resnet18`` builds the same backbone with ``num_classes=None`` inside a wrapper.
    Weights are drawn from ``seed`` without touching the global generator.
    """
    knnresnet = load_knnresnet()
    with torch.random.fork_rng(devices=[]), _quiet_fovi_build():
        torch.manual_seed(seed)
        model = knnresnet.KNNResNet(device=str(device), num_classes=num_classes)
    return model.to(dtype)


def fovi_conv_layers(model: nn.Module) -> dict[str, FoviLayer]:
    """Every ``KNNConvLayer`` of ``model`` (subclasses excluded), in module order, with its
    meta (``KNNMeta.from_layer``): the adapter's discovery
    (:func:`fovi_ref.interop.fovi.knn_conv_layers`), fovi's version checked first."""
    require_fovi()
    return {
        name: FoviLayer(name, layer, KNNMeta.from_layer(layer))
        for name, layer in knn_conv_layers(model).items()
    }


@functools.cache
def _resnet18_layers(device: str) -> tuple[tuple[str, FoviLayer], ...]:
    return tuple(fovi_conv_layers(build_fovi_resnet18(device=device)).items())


def fovi_resnet18_layers(device: str | torch.device = "cpu") -> dict[str, FoviLayer]:
    """The 20 KNN convolutions of :func:`build_fovi_resnet18`, built once per device.

    The layers are shared between calls: treat them as read-only (run them with other weights
    through :func:`fovi_forward_and_grads`, which leaves theirs alone).
    """
    return dict(_resnet18_layers(str(torch.device(device))))


class _NodeCount:
    """Stands in for fovi's ``SamplingCoords`` where a layer only asks for the node count."""

    def __init__(self, count: int) -> None:
        self.shape = (count,)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"{self.shape[0]} nodes"


def fovi_layer_from_meta(
    meta: KNNMeta, out_channels: int, *, bias: bool = False, kernel_backend: str = "auto"
) -> nn.Module:
    """A genuine fovi ``KNNConvLayer`` on the graph ``meta`` (any graph, random ones included).

    fovi builds a layer's graph from sampling coordinates (neighbour search, then ``local_rf``);
    this skips that geometry and sets the graph directly: ``knn_indices`` (padding as ``n_in``,
    which fovi treats as a pad coordinate), ``local_rf`` (one-hot float32), the node counts, and
    then runs fovi's own ``_set_knn_padding_metadata`` (pad token, all-padding mask). Everything
    ``forward`` does (dispatcher, every backend, the mask) is fovi's code. The weight is
    kaiming-normal and the bias zero, as in fovi.
    """
    arch = fovi_arch()
    if kernel_backend not in arch.optimization.VALID_BACKENDS:
        raise ValueError(
            f"unknown fovi backend {kernel_backend!r}; "
            f"valid: {sorted(arch.optimization.VALID_BACKENDS)}"
        )
    cls = arch.knn.KNNConvLayer
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.in_channels, layer.out_channels = meta.in_channels, out_channels
    layer.k, layer._k = torch.tensor(meta.k), meta.k
    layer.in_coords, layer.out_coords = _NodeCount(meta.n_in), _NodeCount(meta.n_out)
    layer.device, layer.kernel_backend, layer.sample_cortex = meta.device, kernel_backend, True
    layer.knn_indices = meta.knn.clone()  # [K, Nout]; n_in reads as a pad coordinate
    layer._set_knn_padding_metadata()  # fovi's: knn_indices_pad_token, all-padding output mask
    layer.knn_indices_batch_cache = layer.knn_indices_pad_token
    layer.local_rf = meta.local_rf(torch.float32)  # [Nout, K, V]
    layer.ref_coords = torch.zeros(meta.v, 2, device=meta.device)  # only its length is read
    layer.weight = nn.Parameter(
        torch.empty(out_channels, meta.in_channels * meta.v, device=meta.device)
    )
    layer.register_parameter(
        "bias", nn.Parameter(torch.empty(out_channels, device=meta.device)) if bias else None
    )
    layer._init_conv_like()
    return layer
