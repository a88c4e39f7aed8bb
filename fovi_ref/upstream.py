"""fovi 2.4.0, the release users install, run through its own code and judged by fovi_ref.

fovi computes the same operator as fovi_ref::

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

in a ``KNNConvLayer`` whose ``forward`` asks a dispatcher (``select_backend`` in
``fovi/arch/knn_optimization.py``) for one of nine backends. This module runs fovi's code
unchanged, at three depths:

- ``"layer"``: ``KNNConvLayer.forward``, what a user's model runs: dispatcher, backend and the
  all-padding mask. The backend is forced through fovi's own override, the environment variable
  ``FOVI_KNN_BACKEND`` (:func:`fovi_backend`), which beats every layer's ``kernel_backend``.
  ``baseline`` (gather + one-hot einsum + ``F.linear``, autograd backward) and ``torch_scatter``
  exist only at this depth.
- ``"function"``: fovi's ``KNNConvFunction`` (its ``torch.autograd.Function``) on a registry
  backend (``torch_compact``, ``gather_gemm``, and on CUDA ``cuda``, ``warp_train``), with its
  dtype policy: gradients cast back to the operands' dtypes, ``grad_bias`` summed in float32.
- ``"direct"``: the registry object's ``forward`` / ``grad_input`` / ``grad_weight`` called on
  fovi's ``TrainingMeta`` (:func:`to_fovi_meta`), exactly as ``KNNConvFunction`` calls them.

:class:`FoviOps` wraps any of them in fovi_ref's ops protocol (functions of a :class:`KNNMeta`),
so ``fovi_ref.testing.check_ops`` can judge fovi like any fovi_ref backend
(:func:`check_fovi_ops`). Until that lands, :func:`verify_fovi` judges the layer path on fovi's
own fovi-resnet18 layers with :mod:`fovi_ref.tolerances`, against the float64 oracle.

Where fovi 2.4.0 differs from the formula or from itself (each one tested in
``tests/test_fovi_upstream.py``):

1. **All-padding outputs are zeroed.** ``KNNConvLayer.forward`` sets to 0 every output node whose
   neighbours are all padding, where the formula gives ``bias[o]``; such nodes pass no gradient
   to the bias. Only the layer does it: fovi's ops (direct or through ``KNNConvFunction``) follow
   the formula. No fovi-resnet18 graph has such a node, and fovi's layers have no bias by default.
2. **Float32 gradients under float64.** ``torch_compact`` accumulates ``grad_input`` and
   ``grad_weight`` in float32 buffers; ``gather_gemm``'s ``grad_weight`` returns float32 whatever
   the dtype; ``KNNConvFunction`` sums ``grad_bias`` in float32. In float64 those gradients carry
   float32 rounding (relative errors near 1e-7 instead of 1e-16).
3. **A stale inference cache.** The inference backend ``torch_cached`` (and ``warp_cached`` on a
   GPU) caches the node-expanded weight keyed on each parameter's ``data_ptr`` and ``_version``.
   Writes through ``weight.data`` bump neither, and fovi's own ``load_conv2d_weights`` writes
   that way, so inference keeps using the old weight. On CPU the dispatcher picks
   ``torch_cached`` for fovi-resnet18's stem (``conv1``, Cin = 3) whenever gradients are off.
4. **Backends disagree on the output layout.** ``baseline`` and ``torch_scatter`` return
   ``[B, Cout, Nout]`` as a transposed view of ``[B, Nout, Cout]`` storage; ``torch_compact``,
   ``gather_gemm`` (and ``torch_cached``, a permuted ``[Nout, B, Cout]``) return other strides.
   Values agree, but layers downstream (BatchNorm) may round differently on other strides, so a
   network's bits change with the backend the dispatcher picks.
5. **gather_gemm reads input node 0 for padding.** A padding neighbour gathers node 0 and is
   multiplied by 0, so a non-finite value at node 0 (read by no real neighbour) makes the padded
   outputs NaN (the layer then zeroes them, being all-padding) and the whole weight gradient NaN,
   where the formula gives finite values. No fovi-resnet18 K = 1 graph has padding.
6. **Dispatcher.** On CPU with gradients on, ``auto`` is ``baseline`` for every layer, before
   the K = V = 1 rule that picks ``gather_gemm`` (which applies on CUDA only). An explicitly
   requested inference-only backend falls back to ``baseline`` under autograd. A backend set in
   ``FOVI_KNN_BACKEND`` applies to every layer of every model: ``gather_gemm`` there raises on
   the first layer with K > 1, and ``cuda`` / ``warp_train`` raise on CPU tensors.

fovi is imported lazily: the rest of fovi_ref works without it, and every function here raises
:class:`FoviUnavailable` (an ``ImportError``) naming the install command when it is absent. Install
what this module needs with ``pip install --no-deps -r scripts/fovi-requirements.txt``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fovi_ref.knn_autograd import knn_conv, route, route_layer
from fovi_ref.meta import KNNMeta
from fovi_ref.tolerances import (
    Verdict,
    expected_quantities,
    judge_elementwise,
    relative_error,
)

__all__ = [
    "ALL_DTYPES",
    "BACKEND_ENV",
    "FOVI_VERSION",
    "PATHS",
    "DispatchRecord",
    "FoviCheck",
    "FoviFinding",
    "FoviLayer",
    "FoviOps",
    "FoviUnavailable",
    "FoviVersionError",
    "ModelComparison",
    "QUANTITIES",
    "TrainingComparison",
    "build_fovi_resnet18",
    "check_fovi_ops",
    "compare_model",
    "compare_training",
    "dispatch_table",
    "format_fovi_table",
    "fovi_findings",
    "fovi_record",
    "fovi_rows",
    "fovi_backend",
    "fovi_backends",
    "fovi_contenders",
    "fovi_conv_layers",
    "fovi_dispatch",
    "fovi_forward_and_grads",
    "fovi_layer_from_meta",
    "fovi_ops",
    "fovi_ref_convs",
    "fovi_resnet18_layers",
    "load_knnresnet",
    "random_batches",
    "require_fovi",
    "to_fovi_meta",
    "verify_fovi",
]

FOVI_VERSION = "2.4.0"
"""The fovi release this module reads (its dispatcher policy and semantics are version-specific)."""
BACKEND_ENV = "FOVI_KNN_BACKEND"
"""fovi's override: a backend named here replaces every layer's ``kernel_backend``."""
PATHS = ("layer", "function", "direct")
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
QUANTITIES = ("y", "grad_x", "grad_weight", "grad_bias")

_INSTALL_HINT = "pip install --no-deps -r scripts/fovi-requirements.txt"
# Backends living in fovi's ops registry (``KNNConvFunction`` runs them); the module whose import
# registers each one.
_REGISTRY_MODULES = {
    "torch_compact": "fovi.arch.knn_autograd",
    "gather_gemm": "fovi.arch.knn_gather_gemm",
    "cuda": "fovi.arch.knn_cuda",
    "warp_train": "fovi.arch.knn_warp",
}
_LAYER_ONLY = ("baseline", "torch_scatter")  # no registry object: the layer path only
_INFERENCE_ONLY = ("torch_cached", "warp_cached", "warp_memory")  # forward under no_grad only


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
            f"install it with: {_INSTALL_HINT}"
        ) from err
    version = getattr(fovi, "__version__", "unknown")
    if version != FOVI_VERSION:
        raise FoviVersionError(
            f"fovi_ref.upstream reads fovi {FOVI_VERSION}, found fovi {version}; "
            f"install the pinned release with: {_INSTALL_HINT}"
        )
    return fovi


def _arch() -> SimpleNamespace:
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
    meta (``KNNMeta.from_layer``)."""
    conv_layer = _arch().knn.KNNConvLayer
    return {
        name: FoviLayer(name, module, KNNMeta.from_layer(module))
        for name, module in model.named_modules()
        if type(module) is conv_layer
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
    arch = _arch()
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


# ------------------------------------------------------------------------- fovi's backends
@contextmanager
def fovi_backend(name: str | None) -> Iterator[None]:
    """Set fovi's override ``FOVI_KNN_BACKEND`` to ``name`` for the block (``None``: unset, so
    each layer's ``kernel_backend``, normally ``"auto"``, decides); restored afterwards."""
    old = os.environ.get(BACKEND_ENV)
    if name is None:
        os.environ.pop(BACKEND_ENV, None)
    else:
        os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = old


def fovi_ops(name: str) -> Any:
    """fovi's registry object for ``name`` (importing the module that registers it), the thing
    ``KNNConvFunction`` calls: ``forward(meta, x, weight, bias)``, ``grad_input(meta, grad_y,
    weight)``, ``grad_weight(meta, grad_y, x)`` on a ``TrainingMeta``."""
    arch = _arch()
    if name not in _REGISTRY_MODULES:
        raise ValueError(
            f"{name!r} is not in fovi's ops registry; registry backends: "
            f"{sorted(_REGISTRY_MODULES)} ({', '.join(_LAYER_ONLY)} run only as a layer)"
        )
    try:
        importlib.import_module(_REGISTRY_MODULES[name])
    except ImportError as err:
        raise FoviUnavailable(f"fovi backend {name!r} cannot be loaded here: {err}") from err
    return arch.autograd.OPS_REGISTRY[name]


def to_fovi_meta(meta: KNNMeta, out_channels: int) -> Any:
    """fovi's ``TrainingMeta`` for ``meta`` with ``out_channels`` outputs, built by fovi's own
    ``ensure_training_metadata``.

    It carries the sizes (``cin``, ``cout``, ``nin``, ``nout``, ``k``, ``v``; ``p = Cin*K``
    padded to ``p64``, a multiple of 64; ``q = Cin*V``), ``input_linear [Nout, p64]`` int32
    (fovi_ref's ``meta.input_linear`` plus pad columns equal to ``Cin*Nin``), ``weight_linear``
    (column ``c*V + rf_index[n, k]``, pad columns 0), their flat int64 copies, and a reverse CSR
    from each input node to the ``k*Nout + n`` slots that read it.
    """
    layer = fovi_layer_from_meta(meta, out_channels)
    return _arch().autograd.ensure_training_metadata(layer, meta.device)


def fovi_backends(device: str | torch.device = "cpu", *, training: bool = True) -> list[str]:
    """fovi's backends that can run on ``device`` here (training-capable ones, or the
    inference-only ones with ``training=False``); each may still refuse some dtypes or graphs
    (``cuda``: float16/bfloat16; ``warp_*``: float16; ``gather_gemm``: K = V = 1)."""
    opt = _arch().optimization
    on_cuda = torch.device(device).type == "cuda"
    if not training:
        return ["torch_cached"] + (
            ["warp_cached", "warp_memory"] if on_cuda and opt._WARP_AVAILABLE else []
        )
    names = ["baseline", "torch_scatter", "torch_compact", "gather_gemm"]
    if on_cuda and opt._CUPY_AVAILABLE and opt._native_cuda_supported(torch.device(device)):
        names.append("cuda")
    if on_cuda and opt._WARP_AVAILABLE:
        names.append("warp_train")
    return names


def _backend_accepts(name: str, meta: KNNMeta, dtype: torch.dtype) -> bool:
    """Whether fovi's ``name`` runs this graph in this dtype (else fovi raises)."""
    if name == "gather_gemm":
        return meta.k == 1 and meta.v == 1
    if name == "cuda":
        return dtype in (torch.float16, torch.bfloat16)
    if name.startswith("warp"):
        return dtype == torch.float16
    return True


def fovi_forward_and_grads(
    backend: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grad_y: torch.Tensor | None,
    *,
    layer: nn.Module | None = None,
    meta: KNNMeta | None = None,
    path: str = "layer",
) -> tuple[torch.Tensor | None, ...]:
    """``(y, grad_x, grad_weight, grad_bias)`` of fovi's ``backend`` reached through ``path``.

    Args:
        backend: a fovi backend name, or ``"auto"`` (the dispatcher decides; layer path only).
        x: ``[B, Cin, Nin]``. weight: ``[Cout, Cin*V]``. bias: ``[Cout]`` or ``None``.
        grad_y: ``[B, Cout, Nout]`` upstream gradient, or ``None`` for the forward only (the
            gradients are then ``None``). Inference-only backends (``torch_cached``, ...) run the
            forward only, under ``no_grad``; every other one runs with grad mode on, as in
            training, since fovi's dispatcher reads it.
        layer: the fovi layer to run, built from ``meta`` if omitted. Its own parameters are
            left alone: ``weight`` and ``bias`` replace them for this call. On the ``"function"``
            and ``"direct"`` paths fovi's ``TrainingMeta`` is the one fovi caches on it.
        meta: the graph, when no layer is given.
        path: ``"layer"`` (``KNNConvLayer.forward``), ``"function"`` (``KNNConvFunction``) or
            ``"direct"`` (the registry object's three functions); see the module docstring.

    The operands are used detached; their ``.grad`` is never touched. Results keep the dtype and
    strides fovi gives them (``direct`` ``gather_gemm`` returns a float32 ``grad_weight``;
    ``direct`` gives no ``grad_bias``: fovi's registry has none).
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if layer is None:
        if meta is None:
            raise TypeError("pass the fovi layer or the meta to run")
        layer = fovi_layer_from_meta(meta, weight.shape[0])
    elif int(layer.out_channels) != weight.shape[0]:
        raise ValueError(
            f"weight has {weight.shape[0]} output channels, the layer {layer.out_channels}"
        )
    x, weight = x.detach(), weight.detach()
    bias = None if bias is None else bias.detach()
    grads_wanted = grad_y is not None and backend not in _INFERENCE_ONLY
    if path != "layer":
        ops = fovi_ops(backend)
        fovi_meta = _arch().autograd.ensure_training_metadata(layer, x.device)
    if path == "direct":
        y = ops.forward(fovi_meta, x, weight, bias)
        if not grads_wanted:
            return y, None, None, None
        grad_x = ops.grad_input(fovi_meta, grad_y, weight)
        grad_weight = ops.grad_weight(fovi_meta, grad_y, x)
        return y, grad_x, grad_weight, None  # the registry has no grad_bias
    leaves = [t.requires_grad_(grads_wanted) for t in (x, weight)]
    if bias is not None:
        leaves.append(bias.requires_grad_(grads_wanted))
    # Grad mode on except for inference-only backends: fovi's dispatcher reads it, and a forward
    # alone should take the path training takes.
    with torch.set_grad_enabled(backend not in _INFERENCE_ONLY):
        if path == "function":
            y = _arch().autograd.KNNConvFunction.apply(x, weight, bias, fovi_meta, backend)
        else:
            with fovi_backend(None if backend == "auto" else backend):
                y = torch.func.functional_call(layer, {"weight": weight, "bias": bias}, (x,))
    if not grads_wanted:
        return y.detach(), None, None, None
    grads = torch.autograd.grad(y, leaves, grad_y)
    return (y.detach(), *grads, *([None] if bias is None else []))


class FoviOps:
    """fovi's ``backend`` at depth ``path`` as a fovi_ref ops object (functions of a
    :class:`KNNMeta`), for ``fovi_ref.testing.check_ops`` or ``fovi_ref.register_ops``.

    - ``forward(meta, x, weight, bias) -> y [B, Cout, Nout]``
    - ``grad_input(meta, grad_y, weight) -> grad_x [B, Cin, Nin]``
    - ``grad_weight(meta, grad_y, x) -> grad_weight [Cout, Cin*V]``

    On the ``"layer"`` and ``"function"`` paths the gradients come from autograd through fovi's
    code (the operator is linear, so the other operand is taken as zeros); on ``"direct"`` they
    are the registry object's own functions. fovi layers (:func:`fovi_layer_from_meta`, on which
    fovi caches its own metas) are built once per graph and output width, and dropped with the
    graph.
    """

    def __init__(self, backend: str, path: str = "layer") -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if path != "layer" and backend not in _REGISTRY_MODULES:
            raise ValueError(
                f"fovi backend {backend!r} has no registry object; it runs only with "
                f"path='layer' (registry backends: {sorted(_REGISTRY_MODULES)})"
            )
        if backend in _INFERENCE_ONLY:
            raise ValueError(f"{backend!r} is inference-only in fovi: it has no backward")
        if path != "layer":
            fovi_ops(backend)  # fail now, not at the first call, if it cannot load here
        else:
            require_fovi()
        self.backend, self.path = backend, path
        self.name = f"fovi_{backend}" if path == "layer" else f"fovi_{backend}_{path}"
        self.all_padding = "zero" if path == "layer" else "bias"
        self._built: weakref.WeakKeyDictionary[KNNMeta, dict] = weakref.WeakKeyDictionary()

    def supports(self, meta: KNNMeta) -> bool:
        """Graphs fovi's backend accepts (``gather_gemm``: K = V = 1; CUDA ones: on CUDA)."""
        if self.backend == "gather_gemm":
            return meta.k == 1 and meta.v == 1
        if self.backend in ("cuda", "warp_train"):
            return meta.device.type == "cuda"
        return True

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Dtypes fovi's backend accepts (``cuda``: float16/bfloat16, ``warp_train``: float16)."""
        if self.backend == "cuda":
            return dtype in (torch.float16, torch.bfloat16)
        if self.backend == "warp_train":
            return dtype == torch.float16
        return True

    def _layer(self, meta: KNNMeta, out_channels: int) -> nn.Module:
        """fovi's layer on this graph with this width (it also caches fovi's meta)."""
        built = self._built.setdefault(meta, {})
        if out_channels not in built:
            built[out_channels] = fovi_layer_from_meta(meta, out_channels)
        return built[out_channels]

    def _run(self, meta, x, weight, bias, grad_y, want):
        layer = self._layer(meta, weight.shape[0])
        if self.path == "direct":
            ops = fovi_ops(self.backend)
            fovi_meta = _arch().autograd.ensure_training_metadata(layer, x.device)
            if want == "y":
                return ops.forward(fovi_meta, x, weight, bias)
            if want == "grad_x":
                return ops.grad_input(fovi_meta, grad_y, weight)
            return ops.grad_weight(fovi_meta, grad_y, x)
        grad_y = None if want == "y" else grad_y
        out = fovi_forward_and_grads(
            self.backend, x, weight, bias, grad_y, layer=layer, path=self.path
        )
        return out[QUANTITIES.index(want)]

    def forward(self, meta: KNNMeta, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        return self._run(meta, x, weight, bias, None, "y")

    def grad_input(self, meta: KNNMeta, grad_y: torch.Tensor, weight: torch.Tensor):
        batch = grad_y.shape[0]
        x = grad_y.new_zeros(batch, meta.in_channels, meta.n_in)  # [B, Cin, Nin]
        return self._run(meta, x, weight, None, grad_y, "grad_x")

    def grad_weight(self, meta: KNNMeta, grad_y: torch.Tensor, x: torch.Tensor):
        weight = x.new_zeros(grad_y.shape[1], meta.in_channels * meta.v)  # [Cout, Cin*V]
        return self._run(meta, x, weight, None, grad_y, "grad_weight")

    def __repr__(self) -> str:
        return f"FoviOps({self.backend!r}, path={self.path!r})"


def check_fovi_ops(backend: str, *, path: str = "direct", **kwargs: Any) -> Any:
    """Judge fovi's ``backend`` at depth ``path`` with ``fovi_ref.testing.check_ops``.

    Passes :class:`FoviOps` (which takes fovi_ref metas, so no ``to_meta`` is needed), fovi's
    all-padding semantics for that path (``"zero"`` for the layer, ``"bias"`` below it) and the
    dtypes the backend accepts; ``kwargs`` go to ``check_ops``.
    """
    try:
        from fovi_ref.testing import check_ops
    except ImportError as err:
        raise RuntimeError(
            "fovi_ref.testing.check_ops is not available in this checkout; "
            "use verify_fovi() meanwhile"
        ) from err
    ops = FoviOps(backend, path)
    kwargs.setdefault("all_padding", ops.all_padding)
    if "dtypes" in kwargs:
        kwargs["dtypes"] = tuple(d for d in kwargs["dtypes"] if ops.supports_dtype(d))
    return check_ops(ops, **kwargs)


# ---------------------------------------------------------------------------- the dispatcher
def fovi_dispatch(
    layer: nn.Module,
    *,
    batch: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    grad: bool = True,
    override: str | None = None,
) -> str:
    """The backend fovi's ``select_backend`` picks for ``layer`` on an input of this batch,
    dtype and device, with gradients on or off, and ``FOVI_KNN_BACKEND=override`` (``None``:
    unset, so the layer's own ``kernel_backend`` decides). Reads shapes only; runs nothing.
    Raises what fovi raises for an impossible request (``gather_gemm`` on K > 1, say)."""
    device = torch.device(device)
    x = torch.empty(batch, int(layer.in_channels), int(layer.in_coords.shape[0]), dtype=dtype)
    if device.type != "cpu":
        x = x.to(device)
    with fovi_backend(override), torch.set_grad_enabled(grad):
        return _arch().optimization.select_backend(layer, x)


@dataclass(frozen=True)
class DispatchRecord:
    """fovi's choice for one layer in one situation, beside fovi_ref's :func:`route`."""

    layer: str
    device: str
    dtype: torch.dtype
    batch: int
    grad: bool
    fovi: str
    fovi_ref: str


def dispatch_table(
    layers: dict[str, FoviLayer] | None = None,
    *,
    devices: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = ALL_DTYPES,
    batches: Sequence[int] = (1, 64),
    grads: Sequence[bool] = (True, False),
) -> list[DispatchRecord]:
    """fovi's choice for every layer x device x dtype x batch x grad mode (no override), with
    fovi_ref's ``route``. ``devices`` defaults to CPU, plus CUDA where present."""
    layers = fovi_resnet18_layers() if layers is None else layers
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for name, rec in layers.items():
        ours = route_layer(rec.layer)
        for device in devices:
            for dtype in dtypes:
                for batch in batches:
                    for grad in grads:
                        fovi = fovi_dispatch(
                            rec.layer, batch=batch, dtype=dtype, device=device, grad=grad
                        )
                        rows.append(DispatchRecord(name, device, dtype, batch, grad, fovi, ours))
    return rows


# ------------------------------------------------------------------------ the user's adapter
@contextmanager
def fovi_ref_convs(model: nn.Module, *, backend: str | None = None) -> Iterator[dict[str, KNNMeta]]:
    """Inside the block, every fovi ``KNNConvLayer`` of ``model`` runs ``fovi_ref.knn_conv``.

    Each layer keeps its own ``weight`` and ``bias`` (``None`` by default in fovi): the layer's
    ``forward`` is replaced on the instance by ``knn_conv(x, layer.weight, layer.bias, meta,
    backend=backend)`` with ``meta = KNNMeta.from_layer(layer)``, so parameters, buffers,
    ``state_dict`` and optimizers see no change, and leaving the block (normally or by an
    exception) restores fovi's forward. fovi_ref follows the formula, so a node whose neighbours
    are all padding gives ``bias`` where fovi's layer gives 0 (none in fovi-resnet18).
    Subclasses of ``KNNConvLayer`` (depthwise ones have their own forward) are left to fovi.

    Yields ``{module name: meta}`` of the layers swapped.
    """
    layers = fovi_conv_layers(model)
    for name, rec in layers.items():
        if "forward" in vars(rec.layer):
            raise RuntimeError(f"{name}'s forward is already replaced (nested fovi_ref_convs?)")
    try:
        for rec in layers.values():
            rec.layer.forward = _fovi_ref_forward(rec.layer, rec.meta, backend)
        yield {name: rec.meta for name, rec in layers.items()}
    finally:
        for rec in layers.values():
            vars(rec.layer).pop("forward", None)


def _fovi_ref_forward(layer: nn.Module, meta: KNNMeta, backend: str | None) -> Callable:
    layer_ref = weakref.ref(layer)  # no cycle layer -> forward -> layer

    def forward(x: torch.Tensor) -> torch.Tensor:
        owner = layer_ref()
        return knn_conv(x, owner.weight, owner.bias, meta.to(x.device), backend=backend)

    return forward


# --------------------------------------------------------------------- whole-network checks
@dataclass
class ModelComparison:
    """One forward and backward of a model both ways: fovi's path against fovi_ref's.

    ``*_errors`` are relative errors (``max |a - b| / max |b|``, fovi's value as ``b``);
    ``*_identical`` are bit-for-bit equalities; ``layer_strides`` holds each KNN conv's output
    strides ``(fovi's, fovi_ref's)``.
    """

    layer_errors: dict[str, float]
    layer_identical: dict[str, bool]
    layer_strides: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    logits_error: float
    logits_identical: bool
    grad_errors: dict[str, float]
    grads_identical: dict[str, bool]

    @property
    def identical(self) -> bool:
        """Logits and every parameter gradient equal bit for bit."""
        return self.logits_identical and all(self.grads_identical.values())

    def summary(self) -> str:
        worst_layer = max(self.layer_errors.values(), default=0.0)
        worst_grad = max(self.grad_errors.values(), default=0.0)
        logits = "identical" if self.logits_identical else "differ"
        layers, grads = self.layer_identical.values(), self.grads_identical.values()
        return (
            f"logits {logits} (err {self.logits_error:.1e}); KNN conv outputs identical "
            f"{sum(layers)}/{len(layers)} (worst err {worst_layer:.1e}); parameter grads "
            f"identical {sum(grads)}/{len(grads)} (worst err {worst_grad:.1e})"
        )


def _run_model(model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn: Callable):
    """Logits, parameter gradients and each KNN conv's output of one step (model in train mode)."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, rec in fovi_conv_layers(model).items():

        def save(module, args, out, name=name):
            outputs[name] = out.detach().clone(memory_format=torch.preserve_format)

        hooks.append(rec.layer.register_forward_hook(save))
    try:
        model.train()
        logits = model(x)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss_fn(logits, target), params, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return logits.detach(), dict(zip(names, grads, strict=True)), outputs


def _error_and_identity(ours: torch.Tensor | None, theirs: torch.Tensor | None):
    if ours is None or theirs is None:
        return (0.0, True) if ours is theirs else (float("inf"), False)
    return relative_error(ours, theirs), torch.equal(ours, theirs)


def compare_model(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    backend: str | None = "einsum_baseline",
    fovi_override: str | None = "baseline",
    loss_fn: Callable = F.cross_entropy,
) -> ModelComparison:
    """Run ``model`` (a fovi model) once through fovi (``FOVI_KNN_BACKEND=fovi_override``;
    ``None``: fovi's dispatcher) and once with every KNN conv swapped to fovi_ref's ``backend``
    (:func:`fovi_ref_convs`), each on its own deep copy (``model``, its BatchNorm statistics
    included, is left as it was), in train mode; compare outputs and gradients."""
    fovi_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    with fovi_backend(fovi_override):
        logits_f, grads_f, outs_f = _run_model(fovi_model, x, target, loss_fn)
    with fovi_ref_convs(ref_model, backend=backend):
        logits_r, grads_r, outs_r = _run_model(ref_model, x, target, loss_fn)
    layers = {n: _error_and_identity(outs_r[n], outs_f[n]) for n in outs_f}
    grads = {n: _error_and_identity(grads_r[n], grads_f[n]) for n in grads_f}
    logits_error, logits_identical = _error_and_identity(logits_r, logits_f)
    return ModelComparison(
        layer_errors={n: e for n, (e, _) in layers.items()},
        layer_identical={n: same for n, (_, same) in layers.items()},
        layer_strides={n: (outs_f[n].stride(), outs_r[n].stride()) for n in outs_f},
        logits_error=logits_error,
        logits_identical=logits_identical,
        grad_errors={n: e for n, (e, _) in grads.items()},
        grads_identical={n: same for n, (_, same) in grads.items()},
    )


@dataclass
class TrainingComparison:
    """Losses of the same SGD run through fovi and through fovi_ref."""

    fovi_losses: list[float] = field(default_factory=list)
    fovi_ref_losses: list[float] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.fovi_losses == self.fovi_ref_losses

    @property
    def max_difference(self) -> float:
        pairs = zip(self.fovi_losses, self.fovi_ref_losses, strict=True)
        return max((abs(a - b) for a, b in pairs), default=0.0)


def random_batches(
    model: nn.Module, steps: int, *, batch: int = 2, seed: int = 0, dtype: torch.dtype | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` random ``(x [B, Cin, Nin], labels [B])`` for a fovi classifier: the input size
    is read from its first KNN conv, the class count from its ``fc`` head."""
    first = next(iter(fovi_conv_layers(model).values()))
    dtype = first.layer.weight.dtype if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    shape = (batch, first.in_channels, first.meta.n_in)
    device = first.layer.weight.device
    return [
        (
            torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype),
            torch.randint(0, model.fc.out_features, (batch,), generator=g).to(device),
        )
        for _ in range(steps)
    ]


def compare_training(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 0.01,
    backend: str | None = "einsum_baseline",
    fovi_override: str | None = "baseline",
    loss_fn: Callable = F.cross_entropy,
) -> TrainingComparison:
    """One SGD step per batch on two deep copies of ``model``: one through fovi, one with its
    KNN convs swapped to fovi_ref's ``backend``; the loss of every step, both ways."""
    result = TrainingComparison()
    for losses, use_fovi_ref in ((result.fovi_losses, False), (result.fovi_ref_losses, True)):
        net = copy.deepcopy(model).train()
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        swap = fovi_ref_convs(net, backend=backend) if use_fovi_ref else _nothing()
        with swap, fovi_backend(fovi_override):
            for x, target in batches:
                loss = loss_fn(net(x), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    return result


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# ---------------------------------------------------------------------------------- timing
def fovi_contenders(
    inputs: Any, *, backends: Sequence[str] | None = None
) -> dict[str, Callable[[], object]]:
    """Contenders (``fovi_ref.bench`` style) running fovi on ``inputs`` (a ``bench.Inputs``):
    forward through ``KNNConvLayer.forward`` and the gradients of ``x``, ``weight`` and
    ``bias`` with ``inputs.grad_y``.

    One is fovi's dispatcher (named after its choice, e.g. ``"fovi auto (baseline)"``), then
    one per training-capable backend that accepts the graph and dtype here (or ``backends``).
    Each runs its own fovi layer on ``inputs.meta`` with ``kernel_backend`` set to the backend
    and parameters holding the values of ``inputs.weight`` and ``inputs.bias``; no override is
    set per call, so none may be set at all.
    """
    if os.environ.get(BACKEND_ENV):
        raise RuntimeError(
            f"{BACKEND_ENV}={os.environ[BACKEND_ENV]} would override every contender's backend; "
            "unset it to time fovi's backends"
        )
    meta, x, grad_y = inputs.meta, inputs.x, inputs.grad_y
    dtype, device = x.dtype, x.device
    if backends is None:
        backends = [b for b in fovi_backends(device) if _backend_accepts(b, meta, dtype)]

    def contender(kernel_backend: str) -> tuple[Callable[[], object], nn.Module]:
        layer = fovi_layer_from_meta(
            meta, inputs.weight.shape[0], bias=True, kernel_backend=kernel_backend
        ).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(inputs.weight)
            layer.bias.copy_(inputs.bias)
        leaves = (x, layer.weight, layer.bias)

        def run():
            return torch.autograd.grad(layer(x), leaves, grad_y)

        return run, layer

    auto, auto_layer = contender("auto")
    choice = fovi_dispatch(auto_layer, batch=x.shape[0], dtype=dtype, device=device, grad=True)
    contenders = {f"fovi auto ({choice})": auto}
    for name in backends:
        contenders[f"fovi {name}"] = contender(name)[0]
    return contenders


# ---------------------------------------------------------------------------- verification
@dataclass(frozen=True)
class FoviCheck:
    """One fovi backend's result for one quantity in one dtype on one layer, judged by fovi_ref's
    elementwise rule (:func:`fovi_ref.tolerances.judge_elementwise`), fovi's ``baseline`` in the
    same dtype reported beside it.

    ``side`` and ``reason`` say, for a failed check, which side is wrong and why, as far as
    :func:`verify_fovi` could show it (empty for a pass): ``"fovi"`` where the evidence is in
    the numbers (a float64 result that passes the float32 rule was computed in float32; a
    failure fovi's own baseline shares), ``"undiagnosed"`` otherwise.
    """

    layer: str
    backend: str
    dtype: torch.dtype
    quantity: str
    verdict: Verdict
    dispatch: str  # fovi's auto choice for this layer, device and dtype with gradients on
    route: str  # fovi_ref's route for the graph
    side: str = ""
    reason: str = ""


def _diagnose(value, expected, dtype, backend, baseline_verdict, separate) -> tuple[str, str]:
    """``(side, reason)`` for a failed check, from what the numbers show: which relaxation of
    the rule the value passes. ``separate()`` gives the expected quantities with
    ``bias_rounding="separate"`` (computed only when asked)."""
    name = str(dtype)[6:]
    what = "output" if expected.name == "y" else "gradient"
    if dtype == torch.float64 and judge_elementwise(value, expected, dtype=torch.float32).ok:
        return "fovi", f"float64 {what} accumulated in float32: fails the float64 rule"
    if expected.name == "y" and judge_elementwise(value, separate()["y"], dtype=dtype).ok:
        return "fovi", (
            f"W x rounded to {name} before the bias is added (fovi's baseline rounds once)"
        )
    one_more = replace(expected, stored=expected.magnitude, stores=expected.stores + 1)
    if judge_elementwise(value, one_more, dtype=dtype).ok:
        return "fovi", (
            f"partial sums rounded to {name} before they are added (the baseline: float32)"
        )
    if backend != "baseline" and baseline_verdict is not None and not baseline_verdict.ok:
        return "fovi", "fovi's own baseline fails the same check"
    return "undiagnosed", "neither side shown wrong: read the verdict"


def verify_fovi(
    layers: dict[str, FoviLayer] | None = None,
    *,
    backends: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = ALL_DTYPES,
    batch: int = 2,
    seed: int = 0,
    device: str | torch.device = "cpu",
    on_layer: Callable[[int, int, str], None] | None = None,
) -> list[FoviCheck]:
    """Every fovi backend that runs here on every layer in every dtype, through fovi's own
    layers (the ``"layer"`` path: what users run), judged by fovi_ref's elementwise rule.

    Operands (:func:`fovi_ref.verify.sample_operands`) are drawn in float64 and rounded to each
    dtype; the oracle and the bounds (:func:`~fovi_ref.tolerances.expected_quantities`, with
    fovi's layer's reading of all-padding nodes, ``all_padding="zero"``) are computed in float64
    from the rounded values, so only fovi's arithmetic is judged, by the rule fovi_ref's own
    backends meet (``python -m fovi_ref verify``). Each training-capable backend gives ``y`` and
    the gradients of ``x``, ``weight`` and ``bias`` (a bias is supplied although fovi's layers
    have none by default); inference-only ones (``torch_cached`` on CPU) give ``y``, under
    ``no_grad``. ``layers`` defaults to fovi-resnet18's 20 on ``device``; ``on_layer(i, n,
    name)`` is called before each layer (a progress line).
    """
    from fovi_ref.verify import sample_operands

    layers = fovi_resnet18_layers(device) if layers is None else layers
    if backends is None:
        backends = fovi_backends(device) + fovi_backends(device, training=False)
    checks = []
    for i, (name, rec) in enumerate(layers.items(), 1):
        if on_layer is not None:
            on_layer(i, len(layers), name)
        meta, c_out = rec.meta, rec.out_channels
        operands = sample_operands(meta.to("cpu"), c_out, batch=batch, seed=seed)
        for dtype in dtypes:
            x, w, b, gy = (t.to(device=device, dtype=dtype) for t in operands)
            expected = expected_quantities(x, w, b, meta, gy, all_padding="zero")
            separate = functools.cache(
                functools.partial(
                    expected_quantities,
                    x,
                    w,
                    b,
                    meta,
                    gy,
                    all_padding="zero",
                    bias_rounding="separate",
                )  # fmt: skip
            )
            dispatch = fovi_dispatch(rec.layer, batch=batch, dtype=dtype, device=device)
            run = functools.partial(fovi_forward_and_grads, layer=rec.layer)
            baseline = dict(zip(QUANTITIES, run("baseline", x, w, b, gy), strict=True))
            base_verdicts = {
                q: judge_elementwise(v, expected[q], dtype=dtype) for q, v in baseline.items()
            }
            for backend in backends:
                if not _backend_accepts(backend, meta, dtype):
                    continue
                if backend == "baseline":
                    got = list(baseline.values())
                else:
                    grad_y = None if backend in _INFERENCE_ONLY else gy
                    got = run(backend, x, w, b, grad_y)
                for quantity, value in zip(QUANTITIES, got, strict=True):
                    if value is None:
                        continue
                    base = None if backend == "baseline" else baseline[quantity]
                    verdict = judge_elementwise(
                        value, expected[quantity], dtype=dtype, baseline=base
                    )
                    side = reason = ""
                    if not verdict.ok:
                        side, reason = _diagnose(
                            value, expected[quantity], dtype, backend, base_verdicts[quantity],
                            separate,
                        )  # fmt: skip
                    checks.append(
                        FoviCheck(
                            name,
                            backend,
                            dtype,
                            quantity,
                            verdict,
                            dispatch,
                            route(meta),
                            side,
                            reason,
                        )  # fmt: skip
                    )
    return checks


_DTYPE_NAMES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def _ratio_text(ratio: float) -> str:
    if ratio < 10:
        return f"{ratio:.2f}"
    if ratio < 1000:
        return f"{ratio:.0f}"
    return f"{ratio:.0e}".replace("e+0", "e").replace("e+", "e")  # 3e7, 2e10


@dataclass(frozen=True)
class FoviFinding:
    """Failed checks sharing a backend, dtype, side and reason: which quantities, on how many
    layers, the worst ratio."""

    backend: str
    dtype: str
    quantities: tuple[str, ...]
    layers: int
    worst_ratio: float
    side: str
    reason: str


def fovi_findings(checks: Sequence[FoviCheck]) -> list[FoviFinding]:
    """The failures of :func:`verify_fovi`, grouped by backend, dtype, side and reason."""
    groups: dict[tuple, list[FoviCheck]] = {}
    for c in checks:
        if not c.verdict.ok:
            groups.setdefault((c.backend, c.dtype, c.side, c.reason), []).append(c)
    return [
        FoviFinding(
            backend,
            _DTYPE_NAMES[dtype],
            tuple(dict.fromkeys(c.quantity for c in group)),
            len({c.layer for c in group}),
            max(c.verdict.ratio for c in group),
            side,
            reason,
        )  # fmt: skip
        for (backend, dtype, side, reason), group in groups.items()
    ]


def fovi_rows(checks: Sequence[FoviCheck]) -> list[dict]:
    """One row per layer x fovi backend: per dtype the verdict over its quantities, the worst
    quantity, its ratio (error / bound of the worst element) and fovi baseline's ratio; fovi's
    dispatcher choice per dtype and fovi_ref's route. JSON-ready."""
    rows: dict[tuple[str, str], dict] = {}
    for c in checks:
        row = rows.setdefault(
            (c.layer, c.backend),
            {"layer": c.layer, "backend": c.backend, "route": c.route, "dispatch": {}},
        )
        dtype = _DTYPE_NAMES[c.dtype]
        row["dispatch"][dtype] = c.dispatch
        cell = row.setdefault(dtype, {"ok": True, "worst": None, "ratio": -1.0})
        cell["ok"] = cell["ok"] and c.verdict.ok
        if c.verdict.ratio > cell["ratio"]:
            cell.update(worst=c.quantity, ratio=c.verdict.ratio)
            cell["baseline_ratio"] = c.verdict.baseline_ratio
    return list(rows.values())


def format_fovi_table(checks: Sequence[FoviCheck]) -> str:
    """The table of :func:`verify_fovi` (lines within 100 characters): one row per layer and
    fovi backend; per dtype ``PASS 0.35`` / ``FAIL 3e7``, the verdict over ``y`` and the three
    gradients and the worst element's error / bound; then fovi's dispatcher choice (``auto``,
    gradients on) beside fovi_ref's ``route``. Below: the count, and each group of failures
    with the side that is wrong and why."""
    rows = fovi_rows(checks)
    dtypes = list(dict.fromkeys(_DTYPE_NAMES[c.dtype] for c in checks))
    header = f"{'layer':<22}{'fovi backend':<14}" + "".join(f"{d:<10}" for d in dtypes)
    header += f"{'auto':<13}route"
    lines = [header]
    cells = failed = 0
    for row in rows:
        text = f"{row['layer']:<22}{row['backend']:<14}"
        for d in dtypes:
            cell = row.get(d)
            if cell is None:
                text += f"{'-':<10}"
                continue
            cells += 1
            failed += not cell["ok"]
            text += f"{'PASS' if cell['ok'] else 'FAIL'} {_ratio_text(cell['ratio']):<5}"
        auto = "/".join(dict.fromkeys(row["dispatch"].values()))
        lines.append(f"{text}{auto:<13}{row['route']}")
    lines.append(f"\n{cells - failed} cells passed, {failed} failed")
    findings = fovi_findings(checks)
    if findings:
        lines.append("failures, and the side that is wrong:")
    for f in findings:
        lines.append(
            f"  {f.backend} {f.dtype} {' '.join(f.quantities)} "
            f"({f.layers} layer{'s' * (f.layers != 1)}, worst {_ratio_text(f.worst_ratio)}):"
        )
        lines.append(f"    {f.side}: {f.reason}")
    return "\n".join(lines)


def fovi_record(checks: Sequence[FoviCheck], **about: Any) -> dict:
    """What ``python -m fovi_ref verify --fovi`` writes to ``verify_fovi.json``: ``about``
    (versions, device, batch), the rule, the rows of :func:`fovi_rows`, the findings."""
    rows = fovi_rows(checks)
    cells = [row[d] for row in rows for d in _DTYPE_NAMES.values() if d in row]
    return {
        "fovi": FOVI_VERSION,
        **about,
        "rule": "fovi_ref.tolerances.judge_elementwise, all_padding='zero' (fovi's layer)",
        "passed": sum(c["ok"] for c in cells),
        "failed": sum(not c["ok"] for c in cells),
        "rows": rows,
        "findings": [vars(f) for f in fovi_findings(checks)],
    }
