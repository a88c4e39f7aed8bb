"""Verification of every backend on one graph against the float64 oracle, per dtype.

For each dtype the operands are drawn in float64 from a fixed seed and rounded to the dtype; the
oracle then runs in float64 on those *rounded* values, so a backend is judged on its own
arithmetic only, element by element, with the rule of :mod:`fovi_ref.check.tolerances`
(:func:`~fovi_ref.check.tolerances.judge_elementwise`). ``einsum_baseline`` in the same dtype is judged
by the same rule and its worst ratio is reported beside every verdict (not judged).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fovi_ref.geometry import get_layer
from fovi_ref.check.jobs import DTYPES, layer_names, progress
from fovi_ref.knn_autograd import available_ops, get_ops, knn_conv, route
from fovi_ref.meta import KNNMeta
from fovi_ref.reference import AllPadding, knn_conv_reference
from fovi_ref.check.tolerances import (
    QUANTITIES,
    BiasRounding,
    Verdict,
    expected_quantities,
    judge_elementwise,
)

__all__ = [
    "BASELINE",
    "QUANTITIES",
    "Check",
    "backends_for",
    "forward_and_grads",
    "run",
    "run_fovi",
    "verify_meta",
]

BASELINE = "einsum_baseline"
ALL_DTYPES = {"float64": torch.float64, **DTYPES}
"""Dtypes by name for ``verify``: float64 too (fovi's backends are judged in it)."""


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
    *,
    all_padding: AllPadding = "bias",
) -> tuple[torch.Tensor | None, ...]:
    """``(y, grad_x, grad_weight, grad_bias)`` of one forward and backward with upstream
    gradient ``grad_y``, through ``knn_conv`` on ``backend``, or the oracle for ``None`` (with
    ``all_padding``; the backends follow the formula). The inputs are used detached (their own
    ``.grad`` is never touched); ``grad_bias`` is ``None`` without a bias."""
    x, w = (t.detach().requires_grad_() for t in (x, w))
    b = None if b is None else b.detach().requires_grad_()
    if backend is None:
        y = knn_conv_reference(x, w, b, meta, all_padding=all_padding)
    else:
        y = knn_conv(x, w, b, meta, backend=backend)
    leaves = (x, w) if b is None else (x, w, b)
    grads = torch.autograd.grad(y, leaves, grad_y.to(y.dtype))
    return (y.detach(), *grads, *([None] if b is None else []))


def sample_operands(
    meta: KNNMeta, out_channels: int, *, batch: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """``(x, weight, bias, grad_y)`` in float64 on the CPU: standard normal features and upstream
    gradient, fovi's kaiming-normal weight scale, a bias of 0.1 standard deviation."""
    g = torch.Generator().manual_seed(seed)
    c_in = meta.in_channels
    x = torch.randn(batch, c_in, meta.n_in, generator=g, dtype=torch.float64)
    w = torch.randn(out_channels, c_in * meta.v, generator=g, dtype=torch.float64)
    w = w * (2 / (c_in * meta.v)) ** 0.5
    b = 0.1 * torch.randn(out_channels, generator=g, dtype=torch.float64)
    grad_y = torch.randn(batch, out_channels, meta.n_out, generator=g, dtype=torch.float64)
    return x, w, b, grad_y


def verify_meta(
    layer: str,
    meta: KNNMeta,
    out_channels: int,
    *,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16),
    batch: int = 4,
    seed: int = 0,
    bias_rounding: BiasRounding = "fused",
) -> list[Check]:
    """Forward and the three gradients of every accepting backend, in every dtype, each judged
    elementwise against the float64 oracle; the baseline's ratio rides along in each verdict.
    ``bias_rounding="fused"`` demands that ``y`` round ``W x + b`` once (see
    :mod:`fovi_ref.check.tolerances`, step 2 (d))."""
    device = meta.device
    operands = sample_operands(meta, out_channels, batch=batch, seed=seed)
    checks = []
    for dtype in dtypes:
        x, w, b, gy = (t.to(device=device, dtype=dtype) for t in operands)
        expected = expected_quantities(x, w, b, meta, gy, bias_rounding=bias_rounding)
        baseline = forward_and_grads(x, w, b, meta, gy, BASELINE)
        for backend in backends_for(meta):
            got = baseline if backend == BASELINE else forward_and_grads(x, w, b, meta, gy, backend)
            for quantity, value, base in zip(QUANTITIES, got, baseline, strict=True):
                verdict = judge_elementwise(value, expected[quantity], dtype=dtype, baseline=base)
                checks.append(Check(layer, backend, route(meta), dtype, quantity, verdict))
    return checks


def run(args) -> bool:
    """``python -m fovi_ref verify``: :func:`verify_meta` on every requested res18 layer, the
    table on stdout, ``verify.json`` in ``args.out``; True when every check passed. ``args``
    carries ``device``, ``dtypes``, ``layers``, ``batch`` and ``out``."""
    device = torch.device(args.device)
    dtypes = tuple(ALL_DTYPES[d] for d in args.dtypes)
    names = layer_names(args.layers)
    rows, failures = [], 0
    for i, name in enumerate(names, 1):
        progress(i, len(names), f"verify {name}")
        layer = get_layer(name)
        checks = verify_meta(
            name, layer.meta.to(device), layer.out_channels, dtypes=dtypes, batch=args.batch
        )
        for backend in dict.fromkeys(c.backend for c in checks):
            row = {"layer": name, "route": route(layer.meta), "backend": backend}
            for dtype in dtypes:
                mine = [c for c in checks if c.backend == backend and c.dtype == dtype]
                worst = max(mine, key=lambda c: c.verdict.error / c.verdict.bound)
                ok = all(c.verdict.ok for c in mine)
                failures += not ok
                row[dtype_name(dtype)] = {
                    "ok": ok,
                    "worst": worst.quantity,
                    "error": worst.verdict.error,
                    "bound": worst.verdict.bound,
                }
            rows.append(row)
    print(f"\nverify on {device}, batch {args.batch}: forward and grad x/weight/bias vs float64")
    print("cell: PASS/FAIL, then the worst quantity's error as a fraction of its bound\n")
    header = f"{'layer':<24}{'route':<13}{'backend':<17}" + "".join(f"{d:<16}" for d in args.dtypes)
    print(header)
    for row in rows:
        cells = ""
        for d in args.dtypes:
            r = row[d]
            cells += f"{'PASS' if r['ok'] else 'FAIL'} {r['error'] / r['bound']:<11.2f}"
        print(f"{row['layer']:<24}{row['route']:<13}{row['backend']:<17}{cells}")
    total = len(rows) * len(dtypes)
    print(f"\n{total - failures} passed, {failures} failed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify.json").write_text(json.dumps(rows, indent=1))
    return failures == 0


def run_fovi(args) -> int:
    """``python -m fovi_ref verify --fovi``: fovi 2.4.0's backends through fovi's own layers,
    judged by the same elementwise rule (:func:`fovi_ref.check.fovi.verify_fovi`); the table on
    stdout, ``verify_fovi.json`` in ``args.out``. Returns the exit status: 0 when every cell
    passed, 1 on a FAIL (a finding about fovi: the table says which side is wrong and why), 2
    when fovi is not installed."""
    from fovi_ref.check import fovi as upstream

    try:
        fovi = upstream.require_fovi()
    except (upstream.FoviUnavailable, upstream.FoviVersionError) as err:
        print(f"verify --fovi: {err}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtypes = tuple(ALL_DTYPES[d] for d in args.dtypes)
    every = upstream.fovi_resnet18_layers(device)
    layers = {name: every[name] for name in layer_names(args.layers)}
    checks = upstream.verify_fovi(
        layers,
        dtypes=dtypes,
        batch=args.batch,
        device=device,
        on_layer=lambda i, n, name: progress(i, n, f"verify fovi {name}"),
    )
    print(f"\nfovi {fovi.__version__} on {device}, batch {args.batch}: fovi's own layers, every")
    print("backend that runs here; y and grad x/weight/bias vs the float64 oracle, judged by")
    print("fovi_ref's elementwise rule (fovi_ref/check/tolerances.py), fovi's all-padding reading.")
    print("cell: PASS/FAIL, then the worst element's error / bound (at most 1 passes)")
    print("auto: fovi's dispatcher choice with gradients on; route: fovi_ref's for the graph")
    print("a FAIL is fovi's result outside the bound; the lines below it say why\n")
    print(upstream.format_fovi_table(checks))
    record = upstream.fovi_record(
        checks, torch=torch.__version__, device=str(device), batch=args.batch
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_fovi.json").write_text(json.dumps(record, indent=1))
    return 0 if record["failed"] == 0 else 1
