"""Verification of every backend on one graph against the float64 oracle, per dtype.

For each dtype the operands are drawn in float64 from a fixed seed and rounded to the dtype; the
oracle then runs in float64 on those *rounded* values, so a backend is judged on its own
arithmetic only, element by element, with the rule of :mod:`fovi_ref.check.tolerances`
(:func:`~fovi_ref.check.tolerances.judge_elementwise`). ``einsum_baseline`` in the same dtype is
judged by the same rule and its worst ratio is reported beside every verdict (not judged).

**The table** (``python -m fovi_ref verify``): one row per layer and backend (every backend that
accepts the layer's graph; ``route`` is the one the dispatcher picks), one cell per dtype. The
rule requires ``|value - ref| <= bound(element)`` for every element, with ``gamma_N(u) * M`` as
the bound: ``M`` the sum of the magnitudes of the element's terms (the oracle run on absolute
values), ``N`` their number; in float16/bfloat16, one rounding of the output relative to
``|ref|``, plus the stored intermediates a two-step implementation needs. It holds under
cancellation, where a rule relative to ``max|ref|`` fails correct code, and it still fails a wrong
cell, a dropped neighbour, leaking padding or a misplaced gradient. A cell reads the verdict, then
the largest ``|value - ref| / bound`` over every element of the four quantities: ``PASS 0.35``
means every element passed and the worst used 35% of its bound; ``FAIL 1.80`` means some element
exceeded its bound, the worst by 1.8 times. The last line counts passing and failing cells.
``verify.json`` stores the arithmetic the verdicts were reached under
(:func:`~fovi_ref.check.arithmetic.arithmetic_settings`, also the table's first line; verdicts
are reached under :func:`~fovi_ref.check.arithmetic.verdict_arithmetic`), and per cell that
ratio, the quantity it came from, the largest absolute error, and the worst element's error and
bound.

**Why 16-bit cells read PASS 0.9-1.0:** there the bound is essentially one rounding of the output,
``u |ref|``, and an implementation that accumulates in float32 and rounds its result once to
nearest makes an error close to that on some element, so its worst ratio nearly reaches 1
(``einsum_baseline``, fovi's own path, reads the same).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from pathlib import Path

import torch

from fovi_ref import DTYPES, KNNMeta, available_ops, dtype_name, get_ops, route
from fovi_ref.check.arithmetic import arithmetic_settings, describe, verdict_arithmetic
from fovi_ref.check.jobs import LOW_AND_SINGLE, layer_names, progress
from fovi_ref.check.operands import QUANTITIES, forward_and_grads, sample_operands
from fovi_ref.check.tolerances import BiasRounding, Verdict, expected_quantities, judge_elementwise
from fovi_ref.geometry import get_layer

__all__ = ["BASELINE", "Check", "backends_for", "run", "verify_meta"]

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


def verify_meta(
    layer: str,
    meta: KNNMeta,
    out_channels: int,
    *,
    dtypes: tuple[torch.dtype, ...] = tuple(DTYPES[d] for d in LOW_AND_SINGLE),
    batch: int = 4,
    seed: int = 0,
    bias_rounding: BiasRounding = "fused",
) -> list[Check]:
    """Forward and the three gradients of every accepting backend, in every dtype, each judged
    elementwise against the float64 oracle; the baseline's ratio rides along in each verdict.
    ``bias_rounding="fused"`` demands that ``y`` round ``W x + b`` once (see
    :mod:`fovi_ref.check.tolerances`, step 2 (d)). A battery that would judge nothing (batch
    0, no dtype) raises ``ValueError``, as :func:`~fovi_ref.check.check_ops.check_ops` does.
    Runs under :func:`~fovi_ref.check.arithmetic.verdict_arithmetic`."""
    if not isinstance(meta, KNNMeta):
        raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
    if isinstance(out_channels, bool) or not isinstance(out_channels, numbers.Integral):
        raise TypeError(f"out_channels must be an int, got {type(out_channels).__name__}")
    if out_channels < 1:
        raise ValueError(f"out_channels must be >= 1, got {out_channels}")
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise (ValueError if isinstance(batch, numbers.Integral) else TypeError)(
            f"batch must be an int >= 1, got {batch!r}: an empty batch judges nothing"
        )
    if not dtypes or any(d not in DTYPES.values() for d in dtypes):
        raise ValueError(f"dtypes must be one or more of {list(DTYPES)}, got {tuple(dtypes)!r}")
    checks = []
    with verdict_arithmetic():
        for dtype in dtypes:
            x, w, b, gy = sample_operands(meta, out_channels, batch=batch, seed=seed, dtype=dtype)
            expected = expected_quantities(x, w, b, meta, gy, bias_rounding=bias_rounding)
            baseline = forward_and_grads(x, w, b, meta, gy, BASELINE)
            for backend in backends_for(meta):
                same = backend == BASELINE
                got = baseline if same else forward_and_grads(x, w, b, meta, gy, backend)
                for quantity, value, base in zip(QUANTITIES, got, baseline, strict=True):
                    verdict = judge_elementwise(
                        value, expected[quantity], dtype=dtype, baseline=base
                    )
                    checks.append(Check(layer, backend, route(meta), dtype, quantity, verdict))
    return checks


def run(args) -> bool:
    """``python -m fovi_ref verify``: :func:`verify_meta` on every requested res18 layer, the
    table on stdout, ``verify.json`` in ``args.out``; True when every check passed. ``args``
    carries ``device``, ``dtypes``, ``layers``, ``batch`` and ``out``."""
    device = torch.device(args.device)
    dtypes = tuple(DTYPES[d] for d in args.dtypes)
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
                worst = max(mine, key=lambda c: c.verdict.ratio)
                ok = all(c.verdict.ok for c in mine)
                failures += not ok
                row[dtype_name(dtype)] = {
                    "ok": ok,
                    "worst": worst.quantity,
                    "ratio": worst.verdict.ratio,
                    "max_abs_error": worst.verdict.max_abs_error,
                    "worst_error": worst.verdict.worst_error,
                    "worst_bound": worst.verdict.worst_bound,
                }
            rows.append(row)
    with verdict_arithmetic():
        arithmetic = arithmetic_settings(device)
    print(f"\nverify on {device}, batch {args.batch}: forward and grad x/weight/bias vs float64")
    print(describe(arithmetic))
    print("cell: PASS/FAIL, then the worst element's |value - ref| / bound over the four (<= 1)\n")
    header = f"{'layer':<24}{'route':<13}{'backend':<17}" + "".join(f"{d:<16}" for d in args.dtypes)
    print(header.rstrip())
    for row in rows:
        cells = ""
        for d in args.dtypes:
            r = row[d]
            cells += f"{'PASS' if r['ok'] else 'FAIL'} {r['ratio']:<11.2f}"
        print(f"{row['layer']:<24}{row['route']:<13}{row['backend']:<17}{cells}".rstrip())
    total = len(rows) * len(dtypes)
    print(f"\n{total - failures} passed, {failures} failed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"arithmetic": arithmetic, "rows": rows}
    (out / "verify.json").write_text(json.dumps(record, indent=1))
    return failures == 0
