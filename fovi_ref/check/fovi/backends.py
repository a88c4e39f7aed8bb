"""fovi 2.4.0's backends run through its own code at three depths, its dispatcher, and
fovi_ref's ops protocol around them (:class:`FoviOps`, for :mod:`fovi_ref.check.check_ops`).

See :mod:`fovi_ref.check.fovi` for the depths and the findings."""

from __future__ import annotations

import importlib
import importlib.util
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fovi_ref import DTYPES, KNNMeta, route_layer
from fovi_ref.check.check_ops import check_ops
from fovi_ref.check.fovi.load import (
    BACKEND_ENV,
    INFERENCE_ONLY,
    LAYER_ONLY,
    PATHS,
    REGISTRY_MODULES,
    FoviLayer,
    FoviUnavailable,
    fovi_arch,
    fovi_layer_from_meta,
    fovi_resnet18_layers,
    require_fovi,
)
from fovi_ref.check.operands import QUANTITIES, forward_and_grads

__all__ = [
    "DispatchRecord",
    "FoviOps",
    "backend_accepts",
    "check_fovi_ops",
    "dispatch_table",
    "fovi_backend",
    "fovi_backends",
    "fovi_contenders",
    "fovi_dispatch",
    "fovi_forward_and_grads",
    "fovi_ops",
    "to_fovi_meta",
]


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
    arch = fovi_arch()
    if name not in REGISTRY_MODULES:
        raise ValueError(
            f"{name!r} is not in fovi's ops registry; registry backends: "
            f"{sorted(REGISTRY_MODULES)} ({', '.join(LAYER_ONLY)} run only as a layer)"
        )
    try:
        importlib.import_module(REGISTRY_MODULES[name])
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
    return fovi_arch().autograd.ensure_training_metadata(layer, meta.device)


def fovi_backends(device: str | torch.device = "cpu", *, training: bool = True) -> list[str]:
    """fovi's backends that can run on ``device`` here (training-capable ones, or the
    inference-only ones with ``training=False``); each may still refuse some dtypes or graphs
    (``cuda``: float16/bfloat16; ``warp_*``: float16; ``gather_gemm``: K = V = 1)."""
    opt = fovi_arch().optimization
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


def backend_accepts(name: str, meta: KNNMeta, dtype: torch.dtype) -> bool:
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
    grad_y = None if backend in INFERENCE_ONLY else grad_y
    if path != "layer":
        ops = fovi_ops(backend)
        fovi_meta = fovi_arch().autograd.ensure_training_metadata(layer, x.device)
    if path == "direct":
        y = ops.forward(fovi_meta, x, weight, bias)
        if grad_y is None:
            return y, None, None, None
        grad_x = ops.grad_input(fovi_meta, grad_y, weight)
        grad_weight = ops.grad_weight(fovi_meta, grad_y, x)
        return y, grad_x, grad_weight, None  # the registry has no grad_bias

    def fovi_conv(x, weight, bias):
        if path == "function":
            return fovi_arch().autograd.KNNConvFunction.apply(x, weight, bias, fovi_meta, backend)
        with fovi_backend(None if backend == "auto" else backend):
            return torch.func.functional_call(layer, {"weight": weight, "bias": bias}, (x,))

    # Grad mode on except for inference-only backends: fovi's dispatcher reads it, and a forward
    # alone should take the path training takes.
    with torch.set_grad_enabled(backend not in INFERENCE_ONLY):
        return forward_and_grads(x, weight, bias, None, grad_y, fovi_conv)


class FoviOps:
    """fovi's ``backend`` at depth ``path`` as a fovi_ref ops object (functions of a
    :class:`KNNMeta`), for ``fovi_ref.check.check_ops.check_ops`` or ``fovi_ref.register_ops``.

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
        if path != "layer" and backend not in REGISTRY_MODULES:
            raise ValueError(
                f"fovi backend {backend!r} has no registry object; it runs only with "
                f"path='layer' (registry backends: {sorted(REGISTRY_MODULES)})"
            )
        if backend in INFERENCE_ONLY:
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
            fovi_meta = fovi_arch().autograd.ensure_training_metadata(layer, x.device)
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
    """Judge fovi's ``backend`` at depth ``path`` with ``fovi_ref.check.check_ops.check_ops``.

    Passes :class:`FoviOps` (which takes fovi_ref metas), fovi's
    all-padding semantics for that path (``"zero"`` for the layer, ``"bias"`` below it) and the
    dtypes the backend accepts; ``kwargs`` go to ``check_ops``.
    """
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
        return fovi_arch().optimization.select_backend(layer, x)


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
    dtypes: Sequence[torch.dtype] = tuple(DTYPES.values()),
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
        backends = [b for b in fovi_backends(device) if backend_accepts(b, meta, dtype)]

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
