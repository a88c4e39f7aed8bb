"""Ops registry, dispatcher, argument checks and autograd for the KNN convolution.

``knn_conv(x, weight, bias, meta)`` is the one entry point::

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

It checks its arguments (shapes, dtypes, devices, backend) before anything runs, asks the
dispatcher which backend serves the graph, and calls the custom op ``fovi_ref::knn_conv``.

Backends ("ops") are objects with a ``name`` and three static functions, the whole math of a
backend::

    forward(meta, x, weight, bias)  -> y       [B, Cout, Nout]
    grad_input(meta, grad_y, weight) -> grad_x  [B, Cin, Nin]
    grad_weight(meta, grad_y, x)     -> grad_w  [Cout, Cin*V]

and optionally ``supports(meta) -> bool``. ``grad_bias`` is ``grad_y`` summed over batch and
nodes, the same for every backend, so it lives here.

Why a ``torch.library`` custom op: ``torch.compile`` and ``torch.export`` then see one opaque node
with a known output shape (``register_fake``) and a known backward (``register_autograd``, which
calls two more custom ops wrapping the backend's ``grad_input`` and ``grad_weight``), instead of
tracing into index bookkeeping they cannot follow. The graph travels into the op as its two index
tensors (``knn``, ``rf_index``) plus ints, so a compiled or exported program carries it like any
buffer; inside the op those tensors are mapped back to their :class:`KNNMeta` (see
:func:`_meta_for`), so per-meta caches such as the dense scatter matrix keep working.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from typing import Any

import torch

from fovi_ref.knn_einsum_baseline import EinsumBaselineOps
from fovi_ref.knn_gather_gemm import GatherGemmOps
from fovi_ref.knn_general import GeneralOps
from fovi_ref.meta import KNNMeta

__all__ = [
    "FLOAT_DTYPES",
    "available_ops",
    "get_ops",
    "knn_conv",
    "register_ops",
    "route",
    "route_layer",
    "unregister_ops",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# ------------------------------------------------------------------------------------ registry
_REGISTRY: dict[str, Any] = {}
_OPS_SIGNATURES = {
    "forward": ("meta", "x", "weight", "bias"),
    "grad_input": ("meta", "grad_y", "weight"),
    "grad_weight": ("meta", "grad_y", "x"),
}


def register_ops(ops: Any) -> None:
    """Add a backend to the registry under ``ops.name``.

    Raises:
        TypeError: ``ops`` lacks a non-empty string ``name`` or one of ``forward``,
            ``grad_input``, ``grad_weight``, or one of them does not take its arguments.
        ValueError: a backend with that name is already registered.
    """
    name = getattr(ops, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"ops must have a non-empty str attribute 'name', got {name!r}")
    for method, params in _OPS_SIGNATURES.items():
        fn = getattr(ops, method, None)
        if not callable(fn):
            raise TypeError(f"ops {name!r} has no callable {method}({', '.join(params)})")
        try:
            inspect.signature(fn).bind(*params)
        except TypeError as err:
            raise TypeError(
                f"ops {name!r}: {method} must accept ({', '.join(params)}): {err}"
            ) from None
    if name in _REGISTRY:
        raise ValueError(f"an ops backend named {name!r} is already registered")
    _REGISTRY[name] = ops


def unregister_ops(name: str) -> None:
    """Remove a backend added with :func:`register_ops` (built-ins included)."""
    if name not in _REGISTRY:
        raise ValueError(f"no ops backend named {name!r}; available: {available_ops()}")
    del _REGISTRY[name]


def get_ops(name: str) -> Any:
    """The backend registered as ``name``; ``ValueError`` listing the choices otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__} {name!r}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {available_ops()}")
    return _REGISTRY[name]


def available_ops() -> list[str]:
    """Names of the registered backends, sorted."""
    return sorted(_REGISTRY)


for _builtin in (GeneralOps, GatherGemmOps, EinsumBaselineOps):
    register_ops(_builtin)


# ---------------------------------------------------------------------------------- dispatcher
def route(meta: KNNMeta) -> str:
    """The backend for ``meta``: ``"gather_gemm"`` exactly when K == 1 and V == 1."""
    return "gather_gemm" if meta.k == 1 and meta.v == 1 else "general"


def route_layer(layer: Any) -> str:
    """:func:`route` for a fovi ``KNNConvLayer`` (or :class:`fovi_ref.KNNConv`), read off its
    attributes: ``layer._k == 1 and layer.local_rf.shape[2] == 1``."""
    return "gather_gemm" if layer._k == 1 and layer.local_rf.shape[2] == 1 else "general"


# ------------------------------------------------------------------------------- argument checks
def _check_call(x: Any, weight: Any, bias: Any, meta: Any, backend: str | None) -> tuple[str, Any]:
    """Validate a ``knn_conv`` call from shapes, dtypes and devices alone; return the backend.

    Reads no tensor values, so it also runs unchanged while ``torch.compile`` traces.
    """
    if not isinstance(meta, KNNMeta):
        raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
    if not torch.compiler.is_compiling():  # tensor versions are eager-mode bookkeeping
        meta.check_unmodified()
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != meta.in_channels or x.shape[2] != meta.n_in:
        raise ValueError(
            f"x must be [B, Cin={meta.in_channels}, Nin={meta.n_in}] for this meta, "
            f"got {tuple(x.shape)}"
        )
    cols = meta.in_channels * meta.v
    if weight.dim() != 2 or weight.shape[1] != cols:
        raise ValueError(
            f"weight must be [Cout, Cin*V = {meta.in_channels}*{meta.v} = {cols}], "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [Cout = {weight.shape[0]}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("meta", meta)):
        if t is not None and t.device != x.device:
            raise ValueError(
                f"{name} is on {t.device} but x is on {x.device}; move both to one device"
                + (" (meta.to(device))" if name == "meta" else "")
            )
    name = route(meta) if backend is None else backend
    ops = get_ops(name)
    supports = getattr(ops, "supports", None)
    if supports is not None and not supports(meta):
        raise ValueError(
            f"backend {name!r} does not support this meta (K={meta.k}, V={meta.v}); "
            f"route(meta) suggests {route(meta)!r}"
        )
    return name, ops


# ---------------------------------------------------- from the op's index tensors back to a meta
_KNOWN_METAS: OrderedDict[int, tuple[torch.Tensor, torch.Tensor, Any]] = OrderedDict()
_KNOWN_METAS_MAX = 64


def _remember(meta: KNNMeta, knn: torch.Tensor, rf_index: torch.Tensor, *, own: bool) -> None:
    """Note that ``(knn, rf_index)`` are the index tensors of ``meta`` (bounded LRU).

    The entry holds the (small) index tensors, so their ``id`` cannot be reused while it lives.
    A meta someone else owns (the one passed to :func:`knn_conv`) is held weakly, so the entry
    never keeps it or its caches alive; a meta built here has no other owner and is held
    strongly, or its caches would be rebuilt on every call.
    """
    _KNOWN_METAS[id(knn)] = (knn, rf_index, meta if own else weakref.ref(meta))
    _KNOWN_METAS.move_to_end(id(knn))
    while len(_KNOWN_METAS) > _KNOWN_METAS_MAX:
        _KNOWN_METAS.popitem(last=False)


def _deref(held: Any) -> KNNMeta | None:
    """The meta of a :data:`_KNOWN_METAS` entry (``None`` if a weakly held one has died)."""
    return held() if isinstance(held, weakref.ref) else held


def _meta_for(knn: torch.Tensor, rf_index: torch.Tensor, n_in: int, in_channels: int, v: int):
    """The :class:`KNNMeta` whose graph the op's index tensors describe.

    Eager calls pass the meta's own tensors (an identity hit). A compiled or exported program may
    pass copies; those are matched by content (``K*Nout`` comparisons, small beside the
    convolution) and otherwise a meta is built and validated from them.
    """
    sizes = (n_in, in_channels, v)
    entry = _KNOWN_METAS.get(id(knn))
    if entry is not None and entry[0] is knn and entry[1] is rf_index:
        meta = _deref(entry[2])
        if meta is not None and (meta.n_in, meta.in_channels, meta.v) == sizes:
            return meta
    for known_knn, known_rf, held in reversed(_KNOWN_METAS.values()):
        meta = _deref(held)
        if (
            meta is not None
            and (meta.n_in, meta.in_channels, meta.v) == sizes
            and known_knn.shape == knn.shape
            and known_knn.device == knn.device
            and torch.equal(known_knn, knn)
            and torch.equal(known_rf, rf_index)
        ):
            _remember(meta, knn, rf_index, own=not isinstance(held, weakref.ref))
            return meta
    meta = KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=in_channels, v=v)
    _remember(meta, knn, rf_index, own=True)
    return meta


# ---------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("fovi_ref::knn_conv", mutates_args=())
def _knn_conv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    knn: torch.Tensor,
    rf_index: torch.Tensor,
    n_in: int,
    v: int,
    backend: str,
) -> torch.Tensor:
    meta = _meta_for(knn, rf_index, n_in, x.shape[1], v)
    # Backends may return any strides (fovi's layout is a transposed view); the op promises
    # a contiguous [B, Cout, Nout], which is what the fake implementation below describes.
    return get_ops(backend).forward(meta, x, weight, bias).contiguous()


@_knn_conv_op.register_fake
def _(x, weight, bias, knn, rf_index, n_in, v, backend):
    return x.new_empty(x.shape[0], weight.shape[0], knn.shape[1])  # [B, Cout, Nout]


@torch.library.custom_op("fovi_ref::knn_conv_grad_input", mutates_args=())
def _grad_input_op(
    grad_y: torch.Tensor,
    weight: torch.Tensor,
    knn: torch.Tensor,
    rf_index: torch.Tensor,
    n_in: int,
    v: int,
    backend: str,
) -> torch.Tensor:
    meta = _meta_for(knn, rf_index, n_in, weight.shape[1] // v, v)
    return get_ops(backend).grad_input(meta, grad_y, weight).contiguous()


@_grad_input_op.register_fake
def _(grad_y, weight, knn, rf_index, n_in, v, backend):
    return grad_y.new_empty(grad_y.shape[0], weight.shape[1] // v, n_in)  # [B, Cin, Nin]


@torch.library.custom_op("fovi_ref::knn_conv_grad_weight", mutates_args=())
def _grad_weight_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    knn: torch.Tensor,
    rf_index: torch.Tensor,
    n_in: int,
    v: int,
    backend: str,
) -> torch.Tensor:
    meta = _meta_for(knn, rf_index, n_in, x.shape[1], v)
    return get_ops(backend).grad_weight(meta, grad_y, x).contiguous()


@_grad_weight_op.register_fake
def _(grad_y, x, knn, rf_index, n_in, v, backend):
    return x.new_empty(grad_y.shape[1], x.shape[1] * v)  # [Cout, Cin*V]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, knn, rf_index, n_in, v, backend = inputs
    ctx.save_for_backward(x, weight, knn, rf_index)
    ctx.graph = (n_in, v, backend)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_y: torch.Tensor):
    x, weight, knn, rf_index = ctx.saved_tensors
    n_in, v, backend = ctx.graph
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = _grad_input_op(grad_y, weight, knn, rf_index, n_in, v, backend)
    if ctx.needs_input_grad[1]:
        grad_weight = _grad_weight_op(grad_y, x, knn, rf_index, n_in, v, backend)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_y.sum(dim=(0, 2))  # [Cout]: one reduction
    return grad_x, grad_weight, grad_bias, None, None, None, None, None


_knn_conv_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------- entry point
def knn_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """KNN convolution ``y [B, Cout, Nout]`` of ``x [B, Cin, Nin]`` over the graph ``meta``.

    Args:
        x: ``[B, Cin, Nin]`` float16 / bfloat16 / float32 / float64.
        weight: ``[Cout, Cin*V]``, column ``c*V + cell``; same dtype and device as ``x``.
        bias: ``[Cout]`` or ``None``.
        meta: the graph, on ``x``'s device.
        backend: a registered backend name; ``None`` asks :func:`route`.

    Differentiable in ``x``, ``weight`` and ``bias``. Raises ``TypeError``/``ValueError`` naming
    the offending argument before any kernel runs.
    """
    name, _ = _check_call(x, weight, bias, meta, backend)
    if (
        not torch.compiler.is_compiling()
    ):  # the tracer cannot follow this bookkeeping; see _meta_for
        _remember(meta, meta.knn, meta.rf_index, own=False)
    return _knn_conv_op(x, weight, bias, meta.knn, meta.rf_index, meta.n_in, meta.v, name)
