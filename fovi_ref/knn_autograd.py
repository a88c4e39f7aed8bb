"""Ops registry, dispatcher, argument checks and autograd for the KNN convolution.

``knn_conv(x, weight, bias, meta)`` is the one entry point::

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

It checks its arguments (shapes, dtypes, devices, backend) before anything runs, applies the
autocast policy, asks the dispatcher which backend serves the graph, and runs it with autograd.

**Backends** ("ops") are objects with a ``name`` and three static functions, the whole math of a
backend::

    forward(meta, x, weight, bias)  -> y       [B, Cout, Nout]
    grad_input(meta, grad_y, weight) -> grad_x  [B, Cin, Nin]
    grad_weight(meta, grad_y, x)     -> grad_w  [Cout, Cin*V]

and optionally ``supports(meta) -> bool``; ``derive(meta) -> {name: tensor}``, a pure function
of the graph computing what the backend precomputes (kept on the meta: see
:meth:`fovi_ref.KNNMeta.derived`); and ``grad_y_layout(grad_y) -> grad_y``, the same values in
the memory layout its two gradient functions read without copying: the backward calls it once
and hands the result to both (and to the bias), so ``grad_y`` is rearranged once, not twice.
Optionally too, as a pair::

    forward_with_operand(meta, x, weight, bias) -> (y, operand)
    grad_weight_of_operand(meta, grad_y, operand) -> grad_w

for a backend whose forward GEMM reads an ``operand`` computed from ``x`` (gathered rows, say)
that the weight gradient's GEMM reads again: the eager door then keeps that operand for the
backward instead of ``x``, and the weight gradient does not compute it a second time. (The
compiled door does not: a custom op's outputs must be described by a fake implementation, which
cannot know a backend's operand.) ``grad_bias`` is ``grad_y`` summed over batch and nodes, the
same for every backend, so it lives here.

**Two doors to one computation.** In eager mode ``knn_conv`` calls the backend through a
``torch.autograd.Function`` handed the meta itself: nothing is looked up, and the fixed cost per
call is a few Python checks. While ``torch.compile`` or ``torch.export`` trace, it calls the custom
op ``fovi_ref::knn_conv`` instead, which ``register_fake`` (output shape *and* strides) and
``register_autograd`` (a backward through two more custom ops) make opaque and traceable. A custom
op takes tensors and plain values only, so the graph travels into it as the index tensors, the
backend's derived tensors (plus their names, one string) and ints; the op rebuilds a trusted meta
from them, which costs no validation and no derivation. Why not the custom op in eager mode too:
``torch.library.custom_op`` dispatch costs tens of microseconds per call, which on a small layer
is as much as the arithmetic (measured by ``python -m fovi_ref bench --boundary``).

**Output layout.** ``y`` comes back in fovi's layout (:mod:`fovi_ref.layout`), a transposed
view of ``[B, Nout, Cout]``; the fake implementation describes the same strides. A registered
backend that returns another layout is brought to it here; one that returns the wrong shape or
dtype is refused with an error naming it.

**Autocast.** Inside ``torch.autocast(device, dtype)``, ``knn_conv`` behaves like ``F.linear``:
``x``, ``weight`` and ``bias`` are cast to the autocast dtype and the backend runs in it, so ``y``
has that dtype, in eager and compiled code alike; the backward needs no autocast (it may run
outside the block).

**Gradients** are first order: the backward is not itself differentiable, and asking for a
gradient of a gradient raises an error saying so.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from fovi_ref.knn_einsum_baseline import EinsumBaselineOps
from fovi_ref.knn_gather_gemm import GatherGemmOps, gather_gemm_applies
from fovi_ref.knn_general import GeneralOps
from fovi_ref.layout import fovi_layout_empty
from fovi_ref.meta import Derived, KNNMeta

__all__ = [
    "FLOAT_DTYPES",
    "available_ops",
    "derive_for",
    "get_ops",
    "knn_conv",
    "prepare",
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
_OPTIONAL_SIGNATURES = {
    "supports": ("meta",),
    "derive": ("meta",),
    "grad_y_layout": ("grad_y",),
    "forward_with_operand": ("meta", "x", "weight", "bias"),
    "grad_weight_of_operand": ("meta", "grad_y", "operand"),
}
_OPTIONAL_PAIR = ("forward_with_operand", "grad_weight_of_operand")


def _check_signature(name: str, method: str, fn: Any, params: tuple[str, ...]) -> None:
    if not callable(fn):
        raise TypeError(f"ops {name!r}: {method} must be callable ({', '.join(params)})")
    try:
        inspect.signature(fn).bind(*params)
    except TypeError as err:
        raise TypeError(
            f"ops {name!r}: {method} must accept ({', '.join(params)}): {err}"
        ) from None


def register_ops(ops: Any) -> None:
    """Add a backend to the registry under ``ops.name``.

    Raises:
        TypeError: ``ops`` lacks a non-empty string ``name`` or one of ``forward``,
            ``grad_input``, ``grad_weight``; or one of them, or an optional ``supports``,
            ``derive``, ``grad_y_layout``, ``forward_with_operand`` or
            ``grad_weight_of_operand``, is not a function taking its arguments; or it has
            only one of the last two.
        ValueError: a backend with that name is already registered.
    """
    name = getattr(ops, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"ops must have a non-empty str attribute 'name', got {name!r}")
    for method, params in _OPS_SIGNATURES.items():
        _check_signature(name, method, getattr(ops, method, None), params)
    for method, params in _OPTIONAL_SIGNATURES.items():
        if hasattr(ops, method):
            _check_signature(name, method, getattr(ops, method), params)
    if hasattr(ops, _OPTIONAL_PAIR[0]) != hasattr(ops, _OPTIONAL_PAIR[1]):
        raise TypeError(f"ops {name!r}: {' and '.join(_OPTIONAL_PAIR)} come as a pair")
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
def _route_kv(k: int, v: int) -> str:
    return GatherGemmOps.name if gather_gemm_applies(k, v) else GeneralOps.name


def route(meta: KNNMeta) -> str:
    """The backend for ``meta``: ``"gather_gemm"`` exactly when K == 1 and V == 1
    (:func:`fovi_ref.knn_gather_gemm.gather_gemm_applies`), ``"general"`` otherwise."""
    if not isinstance(meta, KNNMeta):
        raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
    return _route_kv(meta.k, meta.v)


def route_layer(layer: Any) -> str:
    """:func:`route` for a fovi ``KNNConvLayer`` (or :class:`fovi_ref.KNNConv`), read off its
    attributes ``layer._k`` and ``layer.local_rf.shape[2]``."""
    k, local_rf = getattr(layer, "_k", None), getattr(layer, "local_rf", None)
    if not isinstance(k, int) or not isinstance(local_rf, torch.Tensor) or local_rf.dim() != 3:
        raise TypeError(
            f"route_layer needs a KNN conv layer with an int _k and a [Nout, K, V] local_rf "
            f"tensor; {type(layer).__name__} has neither"
        )
    return _route_kv(k, local_rf.shape[2])


def derive_for(meta: KNNMeta, backend: str | None = None) -> Derived:
    """``backend``'s derived data for ``meta`` (the routed backend by default), derived now if
    it is not yet; ``{}`` for a backend that derives nothing."""
    ops = get_ops(route(meta) if backend is None else backend)
    derive = getattr(ops, "derive", None)
    return {} if derive is None else meta.derived(ops.name, derive)


def prepare(meta: KNNMeta, backend: str | None = None) -> KNNMeta:
    """Derive ``backend``'s data for ``meta`` now, so that compiled code can use the meta;
    returns ``meta``."""
    derive_for(meta, backend)
    return meta


# ------------------------------------------------------------------------------- argument checks
def _check_call(
    x: Any, weight: Any, bias: Any, meta: Any, backend: str | None, autocast: bool
) -> Any:
    """Validate a ``knn_conv`` call from shapes, dtypes and devices alone; return the backend.
    Under ``autocast`` the float dtypes may differ (they are all cast to the autocast dtype).

    Reads no tensor values, so it runs unchanged while ``torch.compile`` traces.
    """
    if not isinstance(meta, KNNMeta):
        raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            what = "a torch.Tensor or None" if name == "bias" else "a torch.Tensor"
            raise TypeError(f"{name} must be {what}, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != meta.in_channels or x.shape[2] != meta.n_in:
        raise ValueError(
            f"x must be [B, Cin={meta.in_channels}, Nin={meta.n_in}] for this meta, "
            f"got {tuple(x.shape)}"
        )
    cols = meta.in_channels * meta.v
    if weight.dim() != 2 or weight.shape[1] != cols or weight.shape[0] < 1:
        raise ValueError(
            f"weight must be [Cout >= 1, Cin*V = {meta.in_channels}*{meta.v} = {cols}], "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [Cout = {weight.shape[0]}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype and not (autocast and t.dtype in FLOAT_DTYPES):
            raise TypeError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
    for name, device in (
        ("weight", weight.device),
        ("bias", None if bias is None else bias.device),
        ("meta", meta.device),
    ):
        if device is not None and device != x.device:
            raise ValueError(
                f"{name} is on {device} but x is on {x.device}; move both to one device"
                + (" (meta.to(device))" if name == "meta" else "")
            )
    ops = get_ops(_route_kv(meta.k, meta.v) if backend is None else backend)
    supports = getattr(ops, "supports", None)
    if supports is not None and not supports(meta):
        raise ValueError(
            f"backend {ops.name!r} does not support this meta (K={meta.k}, V={meta.v}); "
            f"route(meta) suggests {route(meta)!r}"
        )
    return ops


def _checked_output(y: Any, ops: Any, x: torch.Tensor, weight: torch.Tensor, n_out: int):
    """``y`` in fovi's layout, or an error naming the backend if its shape or dtype is wrong."""
    expected = (x.shape[0], weight.shape[0], n_out)
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != expected or y.dtype != x.dtype:
        got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise RuntimeError(
            f"backend {ops.name!r} returned {got} from forward; expected {expected} {x.dtype}"
        )
    if not y.transpose(1, 2).is_contiguous():  # another layout: bring it to fovi's
        y = fovi_layout_empty(*expected, y).copy_(y)
    return y


def _checked_grad(g: Any, ops: Any, what: str, like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A gradient as a contiguous tensor of ``shape`` and ``like``'s dtype, or an error."""
    if not isinstance(g, torch.Tensor) or tuple(g.shape) != shape or g.dtype != like.dtype:
        got = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
        raise RuntimeError(
            f"backend {ops.name!r} returned {got} from {what}; expected {shape} {like.dtype}"
        )
    return g.contiguous()


def _grad_y_laid_out(ops: Any, grad_y: torch.Tensor) -> torch.Tensor:
    """``grad_y`` in the layout ``ops`` reads best (its optional ``grad_y_layout``), once per
    backward; anything else than the same values in ``grad_y``'s shape and dtype is refused."""
    lay_out = getattr(ops, "grad_y_layout", None)
    if lay_out is None:
        return grad_y
    laid_out = lay_out(grad_y)
    if not isinstance(laid_out, torch.Tensor) or (laid_out.shape, laid_out.dtype) != (
        grad_y.shape,
        grad_y.dtype,
    ):
        raise RuntimeError(
            f"backend {ops.name!r}: grad_y_layout must return grad_y's shape "
            f"{tuple(grad_y.shape)} and dtype {grad_y.dtype}"
        )
    return laid_out


def _grad_bias(grad_y: torch.Tensor) -> torch.Tensor:
    """``[Cout]``: ``grad_y`` summed over batch and nodes, reading it in whatever layout it has
    (no copy). In fovi's layout that is rows ``[B*Nout, Cout]`` summed down, the order of
    ``F.linear``'s backward in fovi."""
    return grad_y.sum(dim=(0, 2))


def _grad_input(ops, meta, grad_y, weight):
    shape = (grad_y.shape[0], meta.in_channels, meta.n_in)
    return _checked_grad(ops.grad_input(meta, grad_y, weight), ops, "grad_input", grad_y, shape)


def _grad_weight(ops, meta, grad_y, x):
    shape = (grad_y.shape[1], meta.in_channels * meta.v)
    return _checked_grad(ops.grad_weight(meta, grad_y, x), ops, "grad_weight", x, shape)


def _grad_weight_of_operand(ops, meta, grad_y, operand):
    shape = (grad_y.shape[1], meta.in_channels * meta.v)
    g = ops.grad_weight_of_operand(meta, grad_y, operand)
    return _checked_grad(g, ops, "grad_weight_of_operand", grad_y, shape)


def _forward_keeping_operand(ops, meta, x, weight, bias):
    """``(y, operand)`` from the backend's ``forward_with_operand``, or an error naming it."""
    result = ops.forward_with_operand(meta, x, weight, bias)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RuntimeError(
            f"backend {ops.name!r}: forward_with_operand must return a tuple (y, operand), "
            f"got {type(result).__name__}"
        )
    return result


# ------------------------------------------------------------------------------- eager: Function
class _KNNConvFunction(torch.autograd.Function):
    """The eager door: the backend's three functions, handed the meta itself. The weight
    gradient reads ``x``, or the operand the forward kept (``forward_with_operand``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, meta, ops):
        ctx.graph = (meta, ops, bias is not None)
        ctx.kept_operand = hasattr(ops, "forward_with_operand") and ctx.needs_input_grad[1]
        if ctx.kept_operand:
            y, operand = _forward_keeping_operand(ops, meta, x, weight, bias)
            ctx.save_for_backward(operand, weight)
        else:
            y = ops.forward(meta, x, weight, bias)
            ctx.save_for_backward(x, weight)
        return _checked_output(y, ops, x, weight, meta.n_out)

    @staticmethod
    def backward(ctx, grad_y):
        if torch.is_grad_enabled():  # backward(create_graph=True): a second order is coming
            with torch.no_grad():
                grads = _backend_grads(ctx, grad_y)
            # A gradient of these gradients must fail loudly, not silently come out zero.
            sources = (grad_y, *ctx.saved_tensors)  # what the gradients depend on
            grads = tuple(None if g is None else _FirstOrderOnly.apply(g, *sources) for g in grads)
        else:
            grads = _backend_grads(ctx, grad_y)
        return *grads, None, None


def _backend_grads(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``(grad_x, grad_weight, grad_bias)`` of the eager door, each only where needed."""
    x_or_operand, weight = ctx.saved_tensors
    meta, ops, has_bias = ctx.graph
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_y = _grad_y_laid_out(ops, grad_y)
    grad_x = _grad_input(ops, meta, grad_y, weight) if need_x else None
    grad_weight = _grad_weight_of_operand if ctx.kept_operand else _grad_weight
    grad_w = grad_weight(ops, meta, grad_y, x_or_operand) if need_w else None
    grad_b = _grad_bias(grad_y) if has_bias and need_b else None
    return grad_x, grad_w, grad_b


class _FirstOrderOnly(torch.autograd.Function):
    """``g``, connected to the tensors it was computed from by a backward that refuses: a
    gradient of knn_conv's gradients then raises instead of silently coming out zero."""

    @staticmethod
    def forward(ctx, g, *sources):
        return g.view_as(g)

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(_FIRST_ORDER_ONLY)


_FIRST_ORDER_ONLY = (
    "knn_conv is first-order only: its gradients are not differentiable (no double backward)"
)


# ------------------------------------------------------------------- compiled: the custom ops
def _op_meta(knn, rf_index, derived, names, n_in, in_channels, v, backend) -> KNNMeta:
    """The trusted meta a custom op rebuilds from its arguments (no validation, no derivation:
    the tensors come from a meta that was validated and derived before tracing)."""
    data = dict(zip(names.split(",") if names else [], derived, strict=True))
    return KNNMeta.trusted(knn, rf_index, n_in, in_channels, v, {backend: data})


@torch.library.custom_op("fovi_ref::knn_conv", mutates_args=())
def _knn_conv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    knn: torch.Tensor,
    rf_index: torch.Tensor,
    derived: list[torch.Tensor],
    names: str,
    n_in: int,
    v: int,
    backend: str,
) -> torch.Tensor:
    meta = _op_meta(knn, rf_index, derived, names, n_in, x.shape[1], v, backend)
    ops = get_ops(backend)
    return _checked_output(ops.forward(meta, x, weight, bias), ops, x, weight, meta.n_out)


@_knn_conv_op.register_fake
def _(x, weight, bias, knn, rf_index, derived, names, n_in, v, backend):
    return fovi_layout_empty(x.shape[0], weight.shape[0], knn.shape[1], x)  # [B, Cout, Nout]


@torch.library.custom_op("fovi_ref::knn_conv_grad_input", mutates_args=())
def _grad_input_op(
    grad_y: torch.Tensor,
    weight: torch.Tensor,
    knn: torch.Tensor,
    rf_index: torch.Tensor,
    derived: list[torch.Tensor],
    names: str,
    n_in: int,
    v: int,
    backend: str,
) -> torch.Tensor:
    meta = _op_meta(knn, rf_index, derived, names, n_in, weight.shape[1] // v, v, backend)
    return _grad_input(get_ops(backend), meta, grad_y, weight)


@_grad_input_op.register_fake
def _(grad_y, weight, knn, rf_index, derived, names, n_in, v, backend):
    return grad_y.new_empty(grad_y.shape[0], weight.shape[1] // v, n_in)  # [B, Cin, Nin]


@torch.library.custom_op("fovi_ref::knn_conv_grad_weight", mutates_args=())
def _grad_weight_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    knn: torch.Tensor,
    rf_index: torch.Tensor,
    derived: list[torch.Tensor],
    names: str,
    n_in: int,
    v: int,
    backend: str,
) -> torch.Tensor:
    meta = _op_meta(knn, rf_index, derived, names, n_in, x.shape[1], v, backend)
    return _grad_weight(get_ops(backend), meta, grad_y, x)


@_grad_weight_op.register_fake
def _(grad_y, x, knn, rf_index, derived, names, n_in, v, backend):
    return x.new_empty(grad_y.shape[1], x.shape[1] * v)  # [Cout, Cin*V]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, knn, rf_index, derived, names, n_in, v, backend = inputs
    ctx.save_for_backward(x, weight, knn, rf_index, *derived)
    ctx.graph = (names, n_in, v, backend)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_y: torch.Tensor):
    x, weight, knn, rf_index, *derived = ctx.saved_tensors
    graph = (knn, rf_index, derived, *ctx.graph)
    grad_y = _grad_y_laid_out(get_ops(ctx.graph[3]), grad_y)
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = _grad_input_op(grad_y, weight, *graph)
    if ctx.needs_input_grad[1]:
        grad_weight = _grad_weight_op(grad_y, x, *graph)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = _grad_bias(grad_y)
    no_grads = [None] * len(derived)  # the list of derived tensors gets a list back
    return grad_x, grad_weight, grad_bias, None, None, no_grads, None, None, None, None


def _refuse_second_order(ctx, *grads):
    raise RuntimeError(_FIRST_ORDER_ONLY)


_knn_conv_op.register_autograd(_backward, setup_context=_setup_context)
for _grad_op in (_grad_input_op, _grad_weight_op):
    _grad_op.register_autograd(_refuse_second_order)


# --------------------------------------------------------------------------------- entry point
def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` asks for on ``x``'s device, or ``None`` outside it."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


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

    Returns ``y`` in fovi's layout (a transposed view of ``[B, Nout, Cout]`` storage).
    Differentiable (first order) in ``x``, ``weight`` and ``bias``. Raises
    ``TypeError``/``ValueError`` naming the offending argument before any kernel runs.
    """
    autocast_dtype = _autocast_dtype(x) if isinstance(x, torch.Tensor) else None
    ops = _check_call(x, weight, bias, meta, backend, autocast_dtype is not None)
    if autocast_dtype is not None:  # as F.linear: compute in the autocast dtype
        x, weight = x.to(autocast_dtype), weight.to(autocast_dtype)
        bias = None if bias is None else bias.to(autocast_dtype)
    if not torch.compiler.is_compiling():
        if autocast_dtype is None:
            return _KNNConvFunction.apply(x, weight, bias, meta, ops)
        with torch.autocast(x.device.type, enabled=False):  # the backend runs in that dtype
            return _KNNConvFunction.apply(x, weight, bias, meta, ops)
    derived = derive_for(meta, ops.name)  # must exist already; see KNNMeta.derived
    return _knn_conv_op(
        x,
        weight,
        bias,
        meta.knn,
        meta.rf_index,
        list(derived.values()),
        ",".join(derived),
        meta.n_in,
        meta.v,
        ops.name,
    )
