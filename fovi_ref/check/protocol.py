"""Is an object a backend? The protocol of :mod:`fovi_ref.knn_autograd`, checked from outside.

The op trusts its backends; this module is where they are not trusted:

- :func:`check_protocol` validates an object's members (names, arity, the optional pair) before
  anything runs it, with a ``TypeError`` naming what is wrong;
- :func:`policed` wraps an object so that every function it runs checks what it returns (shape,
  dtype, the ``(y, operand)`` pair, ``grad_y_layout``'s result) and raises a ``TypeError``
  naming the backend and the function otherwise. :mod:`fovi_ref.check.check_ops` runs every
  backend it judges through it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["OPTIONAL", "REQUIRED", "check_protocol", "policed"]

REQUIRED = {
    "forward": ("meta", "x", "weight", "bias"),
    "grad_input": ("meta", "grad_y", "weight"),
    "grad_weight": ("meta", "grad_y", "x"),
}
OPTIONAL = {
    "supports": ("meta",),
    "derive": ("meta",),
    "grad_y_layout": ("grad_y",),
    "forward_with_operand": ("meta", "x", "weight", "bias"),
    "grad_weight_of_operand": ("meta", "grad_y", "operand"),
}
PAIR = ("forward_with_operand", "grad_weight_of_operand")


def _check_signature(name: str, method: str, fn: Any, params: tuple[str, ...]) -> None:
    if not callable(fn):
        raise TypeError(f"ops {name!r}: {method} must be callable ({', '.join(params)})")
    try:
        inspect.signature(fn).bind(*params)
    except TypeError as err:
        raise TypeError(
            f"ops {name!r}: {method} must accept ({', '.join(params)}): {err}"
        ) from None


def check_protocol(ops: Any) -> Any:
    """``ops`` if it follows the backend protocol, else a ``TypeError`` saying how it does not:
    no non-empty string ``name``; a required function missing; a function (required or present
    optional) that cannot take its arguments; only one of :data:`PAIR`."""
    name = getattr(ops, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"ops must have a non-empty str attribute 'name', got {name!r}")
    for method, params in REQUIRED.items():
        _check_signature(name, method, getattr(ops, method, None), params)
    for method, params in OPTIONAL.items():
        if hasattr(ops, method):
            _check_signature(name, method, getattr(ops, method), params)
    if hasattr(ops, PAIR[0]) != hasattr(ops, PAIR[1]):
        raise TypeError(f"ops {name!r}: {' and '.join(PAIR)} come as a pair")
    return ops


def _expect(ops: Any, what: str, got: Any, shape: tuple, dtype: torch.dtype) -> None:
    if isinstance(got, torch.Tensor) and tuple(got.shape) == shape and got.dtype == dtype:
        return
    text = (
        f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
    )
    raise TypeError(f"backend {ops.name!r} returned {text} from {what}; expected {shape} {dtype}")


def policed(ops: Any) -> Any:
    """An object with ``ops``' name and members whose functions check their results.

    ``forward``'s ``y`` must be ``[B, Cout, Nout]`` in ``x``'s dtype; ``grad_input``'s
    ``[B, Cin, Nin]`` and the weight gradients ``[Cout, Cin*V]`` in the inputs' dtype;
    ``forward_with_operand`` must return a pair; ``grad_y_layout`` must keep ``grad_y``'s shape
    and dtype. The layout of ``y`` is not policed: the eager door takes any layout (fovi's own
    backends differ in it), and the compiled door copies a ``y`` that is not in fovi's layout
    into it (:func:`fovi_ref.layout.in_fovi_layout`) and a strided gradient into a contiguous
    one, the layouts its fakes promise.
    """
    check_protocol(ops)
    members: dict[str, Any] = {"name": ops.name, "inner": ops}

    def y_shape(meta, x, weight):
        return (x.shape[0], weight.shape[0], meta.n_out)

    def forward(meta, x, weight, bias):
        y = ops.forward(meta, x, weight, bias)
        _expect(ops, "forward", y, y_shape(meta, x, weight), x.dtype)
        return y

    def grad_input(meta, grad_y, weight):
        g = ops.grad_input(meta, grad_y, weight)
        _expect(ops, "grad_input", g, (grad_y.shape[0], meta.in_channels, meta.n_in), grad_y.dtype)
        return g

    def grad_weight(meta, grad_y, x):
        g = ops.grad_weight(meta, grad_y, x)
        _expect(ops, "grad_weight", g, (grad_y.shape[1], meta.in_channels * meta.v), x.dtype)
        return g

    members.update(forward=forward, grad_input=grad_input, grad_weight=grad_weight)
    for method in ("supports", "derive"):
        if hasattr(ops, method):
            members[method] = getattr(ops, method)
    if hasattr(ops, "grad_y_layout"):

        def grad_y_layout(grad_y):
            laid_out = ops.grad_y_layout(grad_y)
            _expect(ops, "grad_y_layout", laid_out, tuple(grad_y.shape), grad_y.dtype)
            return laid_out

        members["grad_y_layout"] = grad_y_layout
    if hasattr(ops, PAIR[0]):

        def forward_with_operand(meta, x, weight, bias):
            result = ops.forward_with_operand(meta, x, weight, bias)
            if not (isinstance(result, tuple) and len(result) == 2) or result[1] is None:
                tuple_of = isinstance(result, tuple)
                got = [type(r).__name__ for r in result] if tuple_of else type(result).__name__
                raise TypeError(
                    f"backend {ops.name!r}: forward_with_operand must return a "
                    f"tuple (y, operand), got {got}"
                )
            _expect(ops, "forward_with_operand", result[0], y_shape(meta, x, weight), x.dtype)
            return result

        def grad_weight_of_operand(meta, grad_y, operand):
            g = ops.grad_weight_of_operand(meta, grad_y, operand)
            shape = (grad_y.shape[1], meta.in_channels * meta.v)
            _expect(ops, "grad_weight_of_operand", g, shape, grad_y.dtype)
            return g

        members.update(
            forward_with_operand=forward_with_operand, grad_weight_of_operand=grad_weight_of_operand
        )
    return type(
        f"Policed_{ops.name}",
        (),
        {k: staticmethod(v) if callable(v) else v for k, v in members.items()},
    )
