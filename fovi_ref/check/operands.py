"""The operands every check and bench draws, and the one forward-and-gradients runner.

**One scale.** :func:`sample_operands` draws in float64 from a seeded generator, in this order,

- ``x [B, Cin, Nin]`` and ``grad_y [B, Cout, Nout]``: standard normal;
- ``weight [Cout, Cin*V]``: normal with standard deviation ``sqrt(2 / (Cin*V))``, fovi's
  kaiming-normal initialisation, so ``y`` has the scale of ``x``;
- ``bias [Cout]``: normal with standard deviation 0.1;

and rounds them to the requested dtype. A check that compares a backend with the float64 oracle
runs the oracle on the *rounded* values, so it judges the backend's arithmetic alone.

**One runner.** :func:`forward_and_grads` runs one forward and the backward of ``x``, ``weight``
and ``bias`` for a given upstream gradient, through ``knn_conv`` (a backend's name or any ops
object), the float64 oracle, or any callable ``f(x, weight, bias) -> y`` (fovi's layers, say):
verify, check_ops, the fovi harness, the bench and the notebooks all use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fovi_ref import KNNMeta, knn_conv
from fovi_ref.reference import AllPadding, knn_conv_reference

__all__ = ["QUANTITIES", "forward_and_grads", "sample_operands"]

QUANTITIES = ("y", "grad_x", "grad_weight", "grad_bias")
"""What one forward and backward give, in the order :func:`forward_and_grads` returns them."""


def sample_operands(
    meta: KNNMeta,
    out_channels: int,
    *,
    batch: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(x [B, Cin, Nin], weight [Cout, Cin*V], bias [Cout], grad_y [B, Cout, Nout])`` at the
    scale of the module docstring, drawn in float64 and rounded to ``dtype``, on ``device``
    (default: ``meta``'s). The same ``seed`` gives the same values in every dtype."""
    g = torch.Generator().manual_seed(seed)
    c_in, f64 = meta.in_channels, torch.float64
    x = torch.randn(batch, c_in, meta.n_in, generator=g, dtype=f64)
    w = (
        torch.randn(out_channels, c_in * meta.v, generator=g, dtype=f64)
        * (2 / (c_in * meta.v)) ** 0.5
    )
    b = 0.1 * torch.randn(out_channels, generator=g, dtype=f64)
    grad_y = torch.randn(batch, out_channels, meta.n_out, generator=g, dtype=f64)
    device = meta.device if device is None else device
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w, b, grad_y))


def forward_and_grads(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    meta: KNNMeta | None,
    grad_y: torch.Tensor | None,
    backend: str | Any | Callable | None = None,
    *,
    all_padding: AllPadding = "bias",
) -> tuple[torch.Tensor | None, ...]:
    """``(y, grad_x, grad_weight, grad_bias)`` of one forward and backward with upstream
    gradient ``grad_y [B, Cout, Nout]``.

    ``backend``: ``None`` for the float64 oracle (reading all-padding nodes as ``all_padding``
    says); a registered backend's name or an ops object, run through ``knn_conv`` on ``meta``; or
    a callable ``f(x, w, b) -> y`` (``meta`` unused). The operands are used detached (their own
    ``.grad`` is never touched). ``grad_bias`` is ``None`` without a bias; with ``grad_y=None``
    only the forward runs (no leaf requires grad) and every gradient is ``None``.
    """
    want = grad_y is not None
    x, w = (t.detach().requires_grad_(want) for t in (x, w))
    b = None if b is None else b.detach().requires_grad_(want)
    if backend is None:
        y = knn_conv_reference(x, w, b, meta, all_padding=all_padding)
    elif isinstance(backend, str) or hasattr(backend, "forward"):
        y = knn_conv(x, w, b, meta, backend=backend)
    else:
        y = backend(x, w, b)
    if not want:
        return y.detach(), None, None, None
    leaves = (x, w) if b is None else (x, w, b)
    grads = torch.autograd.grad(y, leaves, grad_y.to(y.dtype))
    return (y.detach(), *grads, *([None] if b is None else []))
