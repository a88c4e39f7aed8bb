"""The rules autograd and ``torch.func`` call on ``knn_conv``'s eager Function: what it saves,
its backward (vjp), its jvp and its vmap rule.

The op is linear in ``x`` and, separately, in ``weight``; the bias adds:

    y = A(x, W) + b,  A(x, W)[b, o, n] = sum_{c,k} x[b, c, knn[k, n]] * W[o, c*V + rf_index[n, k]]

so every derivative is the op itself or one of its two adjoints, and no new kernel is needed:

- reverse mode (``backward``, ``grad``, ``vjp``, ``jacrev``): ``grad_x = A_x^T(g; W)`` (the
  backend's ``grad_input``, ``[B, Cin, Nin]``), ``grad_W = A_W^T(g; x)`` (``grad_weight``,
  ``[Cout, Cin*V]``, a sum over the batch) and ``grad_b = sum_{b, n} g``, run by
  :class:`Adjoint`, whose own backward and jvp refuse: a second order raises, naming knn_conv;
- forward mode (``jvp``, ``jacfwd``): ``dy = A(dx, W) + A(x, dW) + db``, two more convolutions;
- ``vmap``: the samples ``b`` are independent, so a vmapped ``x`` alone (weight and bias shared)
  folds into the batch, ``[N, B, Cin, Nin] -> [N*B, Cin, Nin]``, in one call; ``grad_input``
  folds likewise. Anything else (a batch of weights; ``grad_weight``, which sums over ``b``) runs
  one call per slice and stacks the results.

The Function's inputs are ``(x, weight, bias, meta, ops, keep)`` and its outputs ``(y,
operand)``: with ``keep``, the backend's ``forward_with_operand`` gave an operand that the weight
gradient reads instead of ``x``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FIRST_ORDER_ONLY",
    "conv_jvp",
    "conv_vjp",
    "conv_vmap",
    "refuse_second_order",
    "save_for_gradients",
]

FIRST_ORDER_ONLY = "knn_conv is first-order only: its gradients are not differentiable"


def refuse_second_order(ctx, *grads):
    """A backward (or jvp) of a gradient: there is none, so it raises :data:`FIRST_ORDER_ONLY`."""
    raise RuntimeError(FIRST_ORDER_ONLY)


def save_for_gradients(ctx, inputs, output) -> None:
    """The Function's ``setup_context``: save only what the requested gradients read, ``x`` or
    the operand for ``grad_W`` and ``W`` for ``grad_x`` (an inference-mode ``x`` is not saved
    when only the bias trains), and ``x``, ``W`` for the jvp (not copies: references)."""
    (x, weight, bias, meta, ops, _), operand = inputs, output[1]
    ctx.meta, ctx.ops, ctx.has_bias = meta, ops, bias is not None
    ctx.kept_operand, (need_x, need_w) = operand is not None, ctx.needs_input_grad[:2]
    x_or_operand = (x if operand is None else operand) if need_w else None
    ctx.save_for_backward(x_or_operand, weight if need_x else None)
    ctx.save_for_forward(x, weight)
    ctx.set_materialize_grads(False)
    if operand is not None:
        ctx.mark_non_differentiable(operand)


def conv_vjp(ctx, grad_y, _):
    """The Function's backward: ``grad_x [B, Cin, Nin]``, ``grad_W [Cout, Cin*V]``, ``grad_b
    [Cout]``, each only if asked for, and nothing at all if ``y`` took no part (``grad_y`` None)."""
    if grad_y is None:
        return None, None, None, None, None, None
    (x_or_operand, weight), meta, ops = ctx.saved_tensors, ctx.meta, ctx.ops
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    lay_out = getattr(ops, "grad_y_layout", None)
    g = grad_y if lay_out is None else lay_out(grad_y)  # laid out once, read by all three
    # Under create_graph and torch.func, through a Function whose backward refuses to run.
    adjoint = Adjoint.apply if torch.is_grad_enabled() else Adjoint.forward
    sources = (grad_y, *ctx.saved_tensors)  # what the gradients depend on
    of = "grad_weight_of_operand" if ctx.kept_operand else "grad_weight"
    grad_x = adjoint(meta, ops, "grad_input", g, weight, *sources) if need_x else None
    grad_w = adjoint(meta, ops, of, g, x_or_operand, *sources) if need_w else None
    grad_b = g.sum(dim=(0, 2)) if ctx.has_bias and need_b else None  # [Cout]
    return grad_x, grad_w, grad_b, None, None, None


def vmapped(fn: Callable, in_dims, args, n: int, fold: bool) -> torch.Tensor:
    """``fn(*args)`` under ``vmap`` of size ``n``, the result batched along dim 0: a vmapped first
    argument alone folds into its own dim 0 if ``fold``; otherwise one call per slice."""
    if fold and in_dims[0] is not None and all(d is None for d in in_dims[1:]):
        folded = args[0].movedim(in_dims[0], 0).flatten(0, 1)  # [N*B, ...]
        return fn(folded, *args[1:]).unflatten(0, (n, -1))  # [N, B, ...]
    slices = (
        [a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)]
        for i in range(n)
    )
    return torch.stack([fn(*one) for one in slices])  # [N, ...]


def conv_vmap(conv: Callable, info, in_dims, x, weight, bias, meta, ops: Any, keep):
    """The Function's vmap rule: ``y [N, B, Cout, Nout]`` from ``conv`` (``knn_conv``), and no
    operand (the per-slice calls keep their own)."""
    one = functools.partial(conv, meta=meta, backend=ops)  # (x, weight, bias) -> y
    y = vmapped(one, in_dims[:3], (x, weight, bias), info.batch_size, fold=True)
    return (y, None), (0, None)


def conv_jvp(conv: Callable, ctx, dx, dw, db, *_):
    """The Function's jvp rule: ``dy = A(dx, W) + A(x, dW) + db`` (``x``, ``W`` saved for
    forward) through ``conv`` (``knn_conv``); a ``None`` tangent adds nothing."""
    (x, weight), meta, ops = ctx.saved_tensors, ctx.meta, ctx.ops
    pairs = ((dx, dx, weight), (dw, x, dw))
    parts = [conv(a, w, None, meta, backend=ops) for t, a, w in pairs if t is not None]
    if db is not None:
        parts.append(db[:, None].expand(x.shape[0], -1, meta.n_out))  # [B, Cout, Nout]
    return sum(parts[1:], parts[0]) if parts else None, None  # no operand


class Adjoint(torch.autograd.Function):
    """``ops.<adjoint>(meta, g, other)``: ``"grad_input"`` (``other`` = W), ``"grad_weight"``
    (``other`` = x) or ``"grad_weight_of_operand"``, tied to ``sources`` (what the gradient
    depends on) so that a second order reaches this backward, which refuses; vmap batches it."""

    @staticmethod
    def forward(meta, ops, adjoint: str, g, other, *sources):
        return getattr(ops, adjoint)(meta, g, other)

    setup_context = staticmethod(lambda ctx, inputs, output: None)  # nothing to save
    backward = jvp = staticmethod(refuse_second_order)

    @staticmethod
    def vmap(info, in_dims, meta, ops, adjoint, g, other, *sources):
        one = functools.partial(Adjoint.apply, meta, ops, adjoint)  # (g, other) -> gradient
        fold = adjoint == "grad_input"  # a weight gradient sums over the batch: never folded
        return vmapped(one, in_dims[3:5], (g, other), info.batch_size, fold), 0
