"""Verification of every backend on one graph against the float64 oracle, per dtype.

For each dtype the operands are drawn in float64 from a fixed seed and rounded to the dtype; the
oracle (:func:`fovi_ref.reference.knn_conv_reference`) then runs in float64 on those *rounded*
values, so a backend is judged on its own arithmetic only, with the rule and the per-dtype
bounds of :mod:`fovi_ref.tolerances` (``einsum_baseline`` in the same dtype is the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovi_ref.knn_autograd import available_ops, get_ops, knn_conv, route
from fovi_ref.meta import KNNMeta
from fovi_ref.reference import knn_conv_reference
from fovi_ref.tolerances import Verdict, judge

__all__ = ["QUANTITIES", "Check", "backends_for", "forward_and_grads", "verify_meta"]

QUANTITIES = ("y", "grad_x", "grad_weight", "grad_bias")
BASELINE = "einsum_baseline"


@dataclass(frozen=True)
class Check:
    """One backend's result for one quantity in one dtype on one graph."""

    layer: str
    backend: str
    route: str
    dtype: torch.dtype
    quantity: str
    verdict: Verdict


def backends_for(meta: KNNMeta) -> list[str]:
    """Registered backends that accept ``meta`` (those without ``supports`` accept all)."""
    names = []
    for name in available_ops():
        supports = getattr(get_ops(name), "supports", None)
        if supports is None or supports(meta):
            names.append(name)
    return names


def forward_and_grads(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    meta: KNNMeta,
    grad_y: torch.Tensor,
    backend: str | None,
) -> tuple[torch.Tensor | None, ...]:
    """``(y, grad_x, grad_weight, grad_bias)`` of one forward and backward with upstream
    gradient ``grad_y``, through ``knn_conv`` on ``backend``, or the oracle for ``None``.
    The inputs are used detached (their own ``.grad`` is never touched); ``grad_bias`` is
    ``None`` without a bias."""
    x, w = (t.detach().requires_grad_() for t in (x, w))
    b = None if b is None else b.detach().requires_grad_()
    if backend is None:
        y = knn_conv_reference(x, w, b, meta)
    else:
        y = knn_conv(x, w, b, meta, backend=backend)
    leaves = (x, w) if b is None else (x, w, b)
    grads = torch.autograd.grad(y, leaves, grad_y.to(y.dtype))
    return (y.detach(), *grads, *([None] if b is None else []))


def verify_meta(
    layer: str,
    meta: KNNMeta,
    out_channels: int,
    *,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16),
    batch: int = 4,
    seed: int = 0,
) -> list[Check]:
    """Forward and the three gradients of every accepting backend, in every dtype."""
    g = torch.Generator().manual_seed(seed)
    device = meta.device
    c_in = meta.in_channels
    x64 = torch.randn(batch, c_in, meta.n_in, generator=g, dtype=torch.float64)
    w64 = torch.randn(out_channels, c_in * meta.v, generator=g, dtype=torch.float64)
    w64 = w64 * (2 / (c_in * meta.v)) ** 0.5  # fovi's kaiming-normal scale
    b64 = 0.1 * torch.randn(out_channels, generator=g, dtype=torch.float64)
    gy64 = torch.randn(batch, out_channels, meta.n_out, generator=g, dtype=torch.float64)
    checks = []
    for dtype in dtypes:
        x, w, b, gy = (t.to(device=device, dtype=dtype) for t in (x64, w64, b64, gy64))
        expected = forward_and_grads(x.double(), w.double(), b.double(), meta, gy.double(), None)
        baseline = forward_and_grads(x, w, b, meta, gy, BASELINE)
        for backend in backends_for(meta):
            got = baseline if backend == BASELINE else forward_and_grads(x, w, b, meta, gy, backend)
            for quantity, value, ref, base in zip(QUANTITIES, got, expected, baseline, strict=True):
                verdict = judge(value, ref, None if backend == BASELINE else base)
                checks.append(Check(layer, backend, route(meta), dtype, quantity, verdict))
    return checks
