"""The op: ``knn_conv``, the dispatcher, the eager autograd Function and the custom ops.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

**The backend protocol**, written down here and nowhere else. A backend is an object with::

    name: str
    forward(meta, x, weight, bias)   -> y       [B, Cout, Nout], fovi's layout or any (below)
    grad_input(meta, grad_y, weight) -> grad_x  [B, Cin, Nin]
    grad_weight(meta, grad_y, x)     -> grad_w  [Cout, Cin*V]
    supports(meta) -> bool           optional: the graphs it accepts (default: all)
    derive(meta) -> {name: tensor}   optional: what it precomputes, kept on the meta
    grad_y_layout(grad_y) -> grad_y  optional: the layout both gradients read best
    forward_with_operand(meta, x, weight, bias) -> (y, operand)    optional pair: the eager
    grad_weight_of_operand(meta, grad_y, operand) -> grad_w        backward keeps operand, not x

results in the inputs' dtype; ``grad_bias`` (``grad_y`` summed over batch and nodes) lives here.
The op trusts a backend; :mod:`fovi_ref.check.check_ops` validates one and polices its results.

**Two doors.** Eager ``knn_conv`` runs :class:`_KNNConvFunction`, handed the meta: a few Python
checks per call (``bench --boundary``: at most 1.5 times plain torch); ``y`` comes in the
backend's layout. While compiling it calls the custom op ``fovi_ref::knn_conv`` with the graph
as tensors and ints. Its fake gives ``y``'s strides, fovi's layout (:mod:`fovi_ref.layout`), and
compiled code reads ``y`` by them, so the op copies a backend's ``y`` laid out otherwise into
it; the backward is two more ops, whose results are contiguous, as their fakes say. Autocast
casts as for ``F.linear``. First order only.
"""

from __future__ import annotations

from typing import Any

import torch

import fovi_ref.knn_transforms as transforms
from fovi_ref.knn_gather_gemm import GatherGemmOps, gather_gemm_applies
from fovi_ref.layout import fovi_layout_empty, in_fovi_layout
from fovi_ref.meta import DTYPES, Derived, KNNMeta, check_dense
from fovi_ref.registry import get_ops
from fovi_ref.strategies import GeneralOps

__all__ = ["derive_for", "knn_conv", "prepare", "route", "route_layer"]


# Not mutated (the mutation job mutates the doors' rules only): pyproject.toml, [tool.mutmut].
# pragma: no mutate start
# ---------------------------------------------------------------------------------- dispatcher
def route(meta: KNNMeta) -> str:
    """The backend for ``meta``: ``"gather_gemm"`` exactly when K == V == 1, else ``"general"``."""
    if not isinstance(meta, KNNMeta):
        raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
    return GatherGemmOps.name if gather_gemm_applies(meta.k, meta.v) else GeneralOps.name


def route_layer(layer: Any) -> str:
    """:func:`route` for a fovi ``KNNConvLayer`` or a ``KNNConv``: its ``_k`` and ``local_rf``."""
    k = getattr(layer, "_k", None)
    local_rf = getattr(layer, "local_rf", None)
    if not isinstance(k, int) or not isinstance(local_rf, torch.Tensor) or local_rf.dim() != 3:
        raise TypeError(
            f"route_layer needs a KNN conv layer with an int _k and a [Nout, K, V] "
            f"local_rf tensor; {type(layer).__name__} has neither"
        )
    return GatherGemmOps.name if gather_gemm_applies(k, local_rf.shape[2]) else GeneralOps.name


def derive_for(meta: KNNMeta, backend: str | None = None) -> Derived:
    """``backend``'s (default: the routed one's) derived data for ``meta``, derived if new."""
    ops = get_ops(route(meta) if backend is None else backend)
    derive = getattr(ops, "derive", None)
    return {} if derive is None else meta.derived(ops.name, derive)


def prepare(meta: KNNMeta, backend: str | None = None) -> KNNMeta:
    """Derive ``backend``'s data for ``meta`` now, so that compiled code can use it."""
    derive_for(meta, backend)
    return meta


# ------------------------------------------------------------------------------ argument checks
def _check_call(x, weight, bias, meta, backend) -> Any:
    """Validate a call from shapes, dtypes and devices (no values: it runs while compiling);
    return the backend."""
    if not isinstance(meta, KNNMeta):
        raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) and not (name == "bias" and t is None):
            what = "a torch.Tensor or None" if name == "bias" else "a torch.Tensor"
            raise TypeError(f"{name} must be {what}, got {type(t).__name__}")
        if t is not None:
            check_dense(name, t)
    if x.is_meta:  # knn_conv did not ask autocast about its device (a RuntimeError)
        raise ValueError("x is on the 'meta' device: knn_conv computes values, and it has none")
    if x.dtype not in DTYPES.values():
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != meta.in_channels or x.shape[2] != meta.n_in:
        raise ValueError(
            f"x must be [B, Cin={meta.in_channels}, Nin={meta.n_in}] for this "
            f"meta, got {tuple(x.shape)}"
        )
    cols = meta.in_channels * meta.v
    if weight.dim() != 2 or weight.shape[1] != cols or weight.shape[0] < 1:
        raise ValueError(
            f"weight must be [Cout >= 1, Cin*V = {meta.in_channels}*{meta.v} = "
            f"{cols}], got {tuple(weight.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [Cout = {weight.shape[0]}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("meta", meta)):
        if name != "meta" and t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
        if t is not None and t.device != x.device:
            hint = " (meta.to(device))" if name == "meta" else ""
            raise ValueError(
                f"{name} is on {t.device} but x is on {x.device}; move both to one device{hint}"
            )
    ops = backend if hasattr(backend, "forward") else get_ops(backend or route(meta))
    supports = getattr(ops, "supports", None)
    if supports is not None and not supports(meta):
        raise ValueError(
            f"backend {ops.name!r} does not support this meta (K={meta.k}, "
            f"V={meta.v}); route(meta) suggests {route(meta)!r}"
        )
    return ops


# pragma: no mutate end


# ------------------------------------------------------------------------------- eager door
def _forward(x, weight, bias, meta, ops, keep):
    """``(y [B, Cout, Nout], operand)``: the backend's forward, or with ``keep`` its
    ``forward_with_operand`` (the weight gradient's GEMM re-reads what the forward GEMM read)."""
    # y detached: fovi's layout is a view, and autograd refuses in-place ops (y += r) on a view
    # made inside a Function; detached, it takes them as fovi's output does, and nothing is copied.
    if not keep:
        return ops.forward(meta, x, weight, bias).detach(), None
    pair = ops.forward_with_operand(meta, x, weight, bias)
    if not isinstance(pair, tuple) or len(pair) != 2 or pair[1] is None:
        raise TypeError(
            f"backend {ops.name!r}: forward_with_operand must return a pair (y, "
            "operand), the operand a tensor"
        )
    return pair[0].detach(), pair[1]


class _KNNConvFunction(torch.autograd.Function):
    """The backend's functions, handed the meta; the rules are :mod:`fovi_ref.knn_transforms`'."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        transforms.save_for_gradients(ctx, inputs, output)
        return output

    backward = staticmethod(transforms.conv_vjp)

    @staticmethod
    def vmap(info, in_dims, *args):
        # torch.func's rules are held by unit tests, not mutated: pyproject.toml, [tool.mutmut].
        return transforms.conv_vmap(knn_conv, info, in_dims, *args)  # pragma: no mutate

    @staticmethod
    def jvp(ctx, *tangents):
        # As vmap: not mutated (pyproject.toml, [tool.mutmut]).
        return transforms.conv_jvp(knn_conv, ctx, *tangents)  # pragma: no mutate


class _UnderTorchFunc(_KNNConvFunction):
    """The same in the ``setup_context`` style torch.func requires, whose ``apply`` binds the
    signature on every call, a fixed cost per call: the eager door takes it under a transform
    only."""

    forward = staticmethod(_forward)
    setup_context = staticmethod(transforms.save_for_gradients)


_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts; float64 stays


# ---------------------------------------------------------------------- compiled door: custom ops
def _op_meta(knn, rf_index, derived, names, n_in, in_channels, v, backend) -> KNNMeta:
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
    return in_fovi_layout(get_ops(backend).forward(meta, x, weight, bias))  # as the fake says


@_knn_conv_op.register_fake
def _(x, weight, bias, knn, *graph):
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
    return get_ops(backend).grad_input(meta, grad_y, weight).contiguous()  # as the fake says


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
    return get_ops(backend).grad_weight(meta, grad_y, x).contiguous()  # as the fake says


@_grad_weight_op.register_fake
def _(grad_y, x, knn, rf_index, derived, names, n_in, v, backend):
    return x.new_empty(grad_y.shape[1], x.shape[1] * v)  # [Cout, Cin*V]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, knn, rf_index, derived, names, n_in, v, backend = inputs
    ctx.save_for_backward(x, weight, knn, rf_index, *derived)
    ctx.graph, ctx.has_bias = (names, n_in, v, backend), bias is not None


def _backward(ctx, grad_y: torch.Tensor):
    x, weight, knn, rf_index, *derived = ctx.saved_tensors
    graph = (knn, rf_index, derived, *ctx.graph)
    lay_out = getattr(get_ops(ctx.graph[3]), "grad_y_layout", None)
    grad_y = grad_y if lay_out is None else lay_out(grad_y)
    grad_x = _grad_input_op(grad_y, weight, *graph) if ctx.needs_input_grad[0] else None
    grad_w = _grad_weight_op(grad_y, x, *graph) if ctx.needs_input_grad[1] else None
    grad_b = grad_y.sum(dim=(0, 2)) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b, None, None, [None] * len(derived), None, None, None, None


_knn_conv_op.register_autograd(_backward, setup_context=_setup_context)
_grad_input_op.register_autograd(transforms.refuse_second_order)
_grad_weight_op.register_autograd(transforms.refuse_second_order)


# Not mutated (the mutation job mutates the doors' rules only): pyproject.toml, [tool.mutmut].
# pragma: no mutate start
# --------------------------------------------------------------------------------- entry point
def knn_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    *,
    backend: str | Any | None = None,
) -> torch.Tensor:
    """KNN convolution ``y [B, Cout, Nout]`` (fovi's layout) of ``x [B, Cin, Nin]`` over the
    graph ``meta`` (on ``x``'s device), with ``weight [Cout, Cin*V]`` (column ``c*V + cell``) and
    ``bias [Cout]`` or ``None``, all float16/bfloat16/float32/float64 of one dtype. ``backend``:
    a registered name, or (eager) any object following the protocol; ``None`` asks :func:`route`.
    Differentiable (first order); ``TypeError``/``ValueError`` name a bad argument up front."""
    cast = not getattr(x, "is_meta", True) and torch.is_autocast_enabled(x.device.type)
    if cast:  # autocast's rule, as for F.linear: floating tensors but float64 to its dtype
        to = torch.get_autocast_dtype(x.device.type)
        x, weight, bias = (
            t.to(to) if getattr(t, "dtype", 0) in _CASTS else t for t in (x, weight, bias)
        )
    ops = _check_call(x, weight, bias, meta, backend)
    if not torch.compiler.is_compiling():
        keep = hasattr(ops, "forward_with_operand") and weight.requires_grad
        args = (x, weight, bias, meta, ops, keep and torch.is_grad_enabled())
        func = _UnderTorchFunc if torch._C._are_functorch_transforms_active() else _KNNConvFunction
        if not cast:
            return func.apply(*args)[0]
        with torch.autocast(x.device.type, enabled=False):  # the backend runs in that dtype
            return func.apply(*args)[0]
    derived = derive_for(meta, ops.name)  # must exist already: see fovi_ref.prepare
    graph = (meta.knn, meta.rf_index, list(derived.values()), ",".join(derived))
    return _knn_conv_op(x, weight, bias, *graph, meta.n_in, meta.v, ops.name)


# pragma: no mutate end
