"""fovi 2.4.0 judged by fovi_ref's elementwise rule: every backend on every layer in every
dtype, each failure diagnosed, the table and the JSON record (``python -m fovi_ref verify
--fovi``)."""

from __future__ import annotations

import functools
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fovi_ref import DTYPES, KNNMeta, dtype_name, knn_conv, route
from fovi_ref.check.arithmetic import arithmetic_settings, describe, verdict_arithmetic
from fovi_ref.check.fovi.backends import (
    backend_accepts,
    fovi_backends,
    fovi_dispatch,
    fovi_forward_and_grads,
)
from fovi_ref.check.fovi.load import (
    FINDINGS_DIR,
    FOVI_VERSION,
    INFERENCE_ONLY,
    REGISTRY_MODULES,
    FoviLayer,
    FoviUnavailable,
    FoviVersionError,
    fovi_conv_layers,
    fovi_resnet18_layers,
    require_fovi,
)
from fovi_ref.check.fovi.machines import finding_record, machine_finding
from fovi_ref.check.jobs import layer_names, progress
from fovi_ref.check.operands import QUANTITIES, sample_operands
from fovi_ref.check.tolerances import (
    Verdict,
    expected_quantities,
    judge_elementwise,
)

__all__ = [
    "OverflowFinding",
    "FoviCheck",
    "FoviFinding",
    "format_fovi_table",
    "MODEL_DTYPES",
    "load_model_factory",
    "finding_scripts",
    "exit_status",
    "gate_summary",
    "model_layers",
    "new_failures",
    "fovi_findings",
    "fovi_record",
    "fovi_rows",
    "overflow_finding",
    "run_fovi",
    "verify_fovi",
    "verify_fovi_model",
]


# ---------------------------------------------------------------------------- verification
@dataclass(frozen=True)
class FoviCheck:
    """One fovi backend's result for one quantity in one dtype on one layer, judged by fovi_ref's
    elementwise rule (:func:`fovi_ref.check.tolerances.judge_elementwise`), fovi's ``baseline``
    in the same dtype reported beside it.

    ``side`` and ``reason`` say, for a failed check, which side is wrong and why, as far as
    :func:`verify_fovi` could show it (empty for a pass): ``"fovi"`` where the evidence is in
    the numbers (a float64 result that passes the float32 rule was computed in float32; a
    failure fovi's own baseline shares), ``"undiagnosed"`` otherwise.
    """

    layer: str
    backend: str
    dtype: torch.dtype
    quantity: str
    verdict: Verdict
    dispatch: str  # fovi's auto choice for this layer, device and dtype with gradients on
    route: str  # fovi_ref's route for the graph
    side: str = ""
    reason: str = ""


def _diagnose(value, expected, dtype, backend, baseline_verdict, separate) -> tuple[str, str]:
    """``(side, reason)`` for a failed check, from what the numbers show: which relaxation of
    the rule the value passes. ``separate()`` gives the expected quantities with
    ``bias_rounding="separate"`` (computed only when asked)."""
    name = dtype_name(dtype)
    what = "output" if expected.name == "y" else "gradient"
    f32 = dict(dtype=torch.float32, any_dtype=True)  # the float32 rule for a float64 value
    if dtype == torch.float64 and judge_elementwise(value, expected, **f32).ok:
        return "fovi", f"float64 {what} accumulated in float32: fails the float64 rule"
    if expected.name == "y" and judge_elementwise(value, separate()["y"], dtype=dtype).ok:
        return "fovi", (
            f"W x rounded to {name} before the bias is added (fovi's baseline rounds once)"
        )
    one_more = replace(expected, stored=expected.magnitude, stores=expected.stores + 1)
    if judge_elementwise(value, one_more, dtype=dtype).ok:
        return "fovi", (
            f"partial sums rounded to {name} before they are added (the baseline: float32)"
        )
    if backend != "baseline" and baseline_verdict is not None and not baseline_verdict.ok:
        return "fovi", "fovi's own baseline fails the same check"
    return "undiagnosed", "neither side shown wrong: read the verdict"


def verify_fovi(
    layers: dict[str, FoviLayer] | None = None,
    *,
    backends: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = tuple(DTYPES.values()),
    batch: int = 2,
    seed: int = 0,
    device: str | torch.device = "cpu",
    on_layer: Callable[[int, int, str], None] | None = None,
) -> list[FoviCheck]:
    """Every fovi backend that runs here on every layer in every dtype, through fovi's own
    layers (the ``"layer"`` path: what users run), judged by fovi_ref's elementwise rule.

    Operands (:func:`fovi_ref.check.operands.sample_operands`) are drawn in float64 and rounded to
    each dtype; the oracle and the bounds (:func:`~fovi_ref.check.tolerances.expected_quantities`,
    with fovi's layer's reading of all-padding nodes, ``all_padding="zero"``) are computed in
    float64 from the rounded values, so only fovi's arithmetic is judged, by the rule fovi_ref's own
    backends meet (``python -m fovi_ref verify``). Each training-capable backend gives ``y`` and the
    gradients of ``x``, ``weight`` and ``bias`` (a bias is supplied although fovi's layers have none
    by default); inference-only ones (``torch_cached`` on CPU) give ``y``, under ``no_grad``.
    ``layers`` defaults to fovi-resnet18's 20 on ``device``; ``on_layer(i, n, name)`` is called
    before each layer (a progress line).
    """
    layers = fovi_resnet18_layers(device) if layers is None else layers
    if backends is None:
        backends = fovi_backends(device) + fovi_backends(device, training=False)
    checks = []
    for i, (name, rec) in enumerate(layers.items(), 1):
        if on_layer is not None:
            on_layer(i, len(layers), name)
        meta, c_out = rec.meta, rec.out_channels
        for dtype in dtypes:
            operands = sample_operands(meta, c_out, batch=batch, seed=seed, dtype=dtype)
            x, w, b, gy = (t.to(device) for t in operands)
            expected = expected_quantities(x, w, b, meta, gy, all_padding="zero")
            separate = functools.cache(
                functools.partial(
                    expected_quantities,
                    x,
                    w,
                    b,
                    meta,
                    gy,
                    all_padding="zero",
                    bias_rounding="separate",
                )
            )
            dispatch = fovi_dispatch(rec.layer, batch=batch, dtype=dtype, device=device)
            run = functools.partial(fovi_forward_and_grads, layer=rec.layer)
            baseline = dict(zip(QUANTITIES, run("baseline", x, w, b, gy), strict=True))
            base_verdicts = {
                q: judge_elementwise(v, expected[q], dtype=dtype) for q, v in baseline.items()
            }
            for backend in backends:
                if not backend_accepts(backend, meta, dtype):
                    continue
                if backend == "baseline":
                    got = list(baseline.values())
                else:
                    grad_y = None if backend in INFERENCE_ONLY else gy
                    got = run(backend, x, w, b, grad_y)
                for quantity, value in zip(QUANTITIES, got, strict=True):
                    if value is None:
                        continue
                    base = None if backend == "baseline" else baseline[quantity]
                    verdict = judge_elementwise(
                        value, expected[quantity], dtype=dtype, baseline=base
                    )
                    side = reason = ""
                    if not verdict.ok:
                        side, reason = _diagnose(
                            value,
                            expected[quantity],
                            dtype,
                            backend,
                            base_verdicts[quantity],
                            separate,
                        )
                    checks.append(
                        FoviCheck(
                            name,
                            backend,
                            dtype,
                            quantity,
                            verdict,
                            dispatch,
                            route(meta),
                            side,
                            reason,
                        )
                    )
    return checks


OVERFLOW_NEIGHBOUR, OVERFLOW_WEIGHT = 40000.0, 0.01
"""The float16 overflow finding's inputs: each of two neighbours in one cell, and the weight."""


@dataclass(frozen=True)
class OverflowFinding:
    """float16 ``y`` where the cell sum overflows but the answer does not: two neighbours of
    ``neighbour`` in one cell, weight ``weight`` (exact ``y`` about 800, the cell sum past
    float16's largest finite value). ``results``: fovi backend (and fovi_ref's ``general``) ->
    ``y``."""

    exact: float
    results: dict[str, float]
    neighbour: float = OVERFLOW_NEIGHBOUR
    weight: float = OVERFLOW_WEIGHT

    @property
    def cell_sum(self) -> float:
        return 2 * self.neighbour

    @property
    def overflowing(self) -> list[str]:
        """The backends whose ``y`` is not finite."""
        return [name for name, y in self.results.items() if y != y or abs(y) == float("inf")]

    def summary(self) -> str:
        got = ", ".join(f"{name} {y:g}" for name, y in self.results.items())
        lines = [
            f"float16 overflow: two neighbours of {self.neighbour:g} in one cell, weight "
            f"{self.weight:g}, exact y = {self.exact:g}",
            f"  y: {got}",
        ]
        if self.overflowing:
            lines.append(
                f"  fovi: {', '.join(self.overflowing)} store the cell sum "
                f"({self.cell_sum:g}) in float16 before the GEMM:\n  inf where the "
                "answer is finite"
            )
            lines.append(f"  reproducer: {FINDINGS_DIR}/f16_cell_sum_overflow.py")
        return "\n".join(lines)


def overflow_finding(device: str | torch.device = "cpu") -> OverflowFinding:
    """Run fovi's training and inference backends that take float16 here on the graph of
    :class:`OverflowFinding`, beside fovi_ref's ``general`` (float32 accumulation)."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0], [1]]), torch.tensor([[0, 0]]), n_in=2, in_channels=1, v=1
    ).to(device)
    x = torch.full((1, 1, 2), OVERFLOW_NEIGHBOUR, dtype=torch.float16, device=device)  # [B,Cin,Nin]
    w = torch.full((1, 1), OVERFLOW_WEIGHT, dtype=torch.float16, device=device)  # [Cout, Cin*V]
    exact = 2 * OVERFLOW_NEIGHBOUR * float(w.double())  # the two neighbours' y, in float64
    results = {}
    for name in fovi_backends(device) + fovi_backends(device, training=False):
        if backend_accepts(name, meta, torch.float16):
            results[name] = float(fovi_forward_and_grads(name, x, w, None, None, meta=meta)[0])
    results["fovi_ref general"] = float(knn_conv(x, w, None, meta, backend="general"))
    return OverflowFinding(exact, results)


MODEL_DTYPES = (torch.float32, torch.float64)
"""The dtypes :func:`verify_fovi_model` checks in unless told, in its table's column order;
``verify --fovi-model`` uses the same, so the command prints the table the call prints."""


def model_layers(model: torch.nn.Module, layers: Sequence[str] | None = None) -> dict:
    """``{module path: FoviLayer}`` for every ``KNNConvLayer`` of ``model``, or for those named
    in ``layers``. ``ValueError`` if it has none or a name in ``layers`` is not one of them."""
    found = fovi_conv_layers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no fovi KNNConvLayer to check")
    unknown = [name for name in layers or () if name not in found]
    if unknown:
        raise ValueError(
            f"not a KNNConvLayer of this model: {', '.join(unknown)}; its layers: "
            f"{', '.join(found)}"
        )
    return {name: found[name] for name in layers} if layers else found


def verify_fovi_model(
    model: torch.nn.Module,
    *,
    layers: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = MODEL_DTYPES,
    batch: int = 2,
    seed: int = 0,
    device: str | torch.device = "cpu",
    on_layer: Callable[[int, int, str], None] | None = None,
) -> list[FoviCheck]:
    """Check your own fovi model: :func:`verify_fovi` on every ``KNNConvLayer`` of ``model``
    (any fovi network: a ``KNNResNet`` with another ``in_res`` or ``fov``, your own module), or
    on those named in ``layers`` (module paths). Give the result to :func:`format_fovi_table` for
    the table and the findings, or to :func:`fovi_findings`. ``model`` must have been built on
    ``device`` (fovi's graphs do not move with ``.to()``). ``ValueError`` if it has no
    ``KNNConvLayer`` or a name in ``layers`` is not one of them."""
    return verify_fovi(
        model_layers(model, layers),
        dtypes=dtypes,
        batch=batch,
        seed=seed,
        device=device,
        on_layer=on_layer,
    )


def load_model_factory(spec: str) -> torch.nn.Module:
    """``"package.module:factory"`` -> ``factory()``, the model ``verify --fovi-model`` checks
    (the module is imported as ``python -m`` would, from the current directory too)."""
    module_name, sep, factory = spec.partition(":")
    if not sep or not module_name or not factory:
        raise ValueError(
            f"--fovi-model takes MODULE:FACTORY (e.g. mymodels:small_net), got {spec!r}"
        )
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise  # the module was found and failed to import one of its own: show where
        raise ValueError(
            f"--fovi-model {spec}: no module {err.name!r} importable from {Path.cwd()}"
        ) from None
    if not callable(make := getattr(module, factory, None)):
        raise ValueError(f"--fovi-model {spec}: {module_name} has no callable {factory!r}")
    model = make()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _ratio_text(ratio: float) -> str:
    if ratio < 10:
        return f"{ratio:.2f}"
    if ratio < 1000:
        return f"{ratio:.0f}"
    return f"{ratio:.0e}".replace("e+0", "e").replace("e+", "e")  # 3e7, 2e10


@dataclass(frozen=True)
class FoviFinding:
    """Failed checks sharing a backend, dtype, side and reason: which quantities, on how many
    layers, the worst ratio."""

    backend: str
    dtype: str
    quantities: tuple[str, ...]
    layers: int
    worst_ratio: float
    side: str
    reason: str


def fovi_findings(checks: Sequence[FoviCheck]) -> list[FoviFinding]:
    """The failures of :func:`verify_fovi`, grouped by backend, dtype, side and reason."""
    groups: dict[tuple, list[FoviCheck]] = {}
    for c in checks:
        if not c.verdict.ok:
            groups.setdefault((c.backend, c.dtype, c.side, c.reason), []).append(c)
    return [
        FoviFinding(
            backend,
            dtype_name(dtype),
            tuple(dict.fromkeys(c.quantity for c in group)),
            len({c.layer for c in group}),
            max(c.verdict.ratio for c in group),
            side,
            reason,
        )
        for (backend, dtype, side, reason), group in groups.items()
    ]


# fovi's backends that round W x to the working dtype and then add the bias
_BIAS_ROUNDED_TWICE = ("torch_compact", "gather_gemm", "torch_cached", "torch_scatter")


def finding_scripts(finding: FoviFinding) -> list[str]:
    """The reproducers (file names in :data:`FINDINGS_DIR`) of one group of failures, by the
    code in fovi each one names: empty where no script reproduces that group yet."""
    backend, quantities, reason = finding.backend, set(finding.quantities), finding.reason
    scripts = []
    if "accumulated in float32" in reason:
        if backend == "torch_compact" and quantities & {"grad_x", "grad_weight"}:
            scripts.append("f64_grads_torch_compact.py")  # CompactTorchOps.grad_*
        if backend == "gather_gemm" and "grad_weight" in quantities:
            scripts.append("f64_grad_weight_gather_gemm.py")  # GatherGemmOps.grad_weight
        if backend in REGISTRY_MODULES and "grad_bias" in quantities:
            scripts.append("f64_grad_bias.py")  # KNNConvFunction.backward
    elif "partial sums rounded" in reason and backend == "torch_compact":
        scripts.append("half_grad_weight_partial_sums.py")  # CompactTorchOps.grad_weight
    elif "before the bias is added" in reason and backend in _BIAS_ROUNDED_TWICE:
        scripts.append("half_bias_double_rounding.py")
    return scripts


def _reproduced(check: FoviCheck) -> list[str]:
    """The reproducers of one failed check, diagnosed on fovi's side (empty if none)."""
    if check.side != "fovi":
        return []
    alone = FoviFinding(
        check.backend,
        dtype_name(check.dtype),
        (check.quantity,),
        1,
        check.verdict.ratio,
        check.side,
        check.reason,
    )
    return finding_scripts(alone)


def new_failures(checks: Sequence[FoviCheck]) -> list[FoviCheck]:
    """The failed checks that are not a known finding about fovi. A known finding is diagnosed
    on fovi's side (:func:`_diagnose` showed it from the numbers) and is one of the defects a
    script in :data:`FINDINGS_DIR` reproduces (:func:`finding_scripts`, judged per check, so a
    group cannot carry an unexplained quantity along with an explained one). Anything else, an
    undiagnosed failure or a diagnosis no script reproduces, is new."""
    return [c for c in checks if not c.verdict.ok and not _reproduced(c)]


def exit_status(checks: Sequence[FoviCheck], *, strict: bool = False) -> int:
    """The exit status of ``verify --fovi`` and ``--fovi-model``, one a CI job can gate on:
    0 when every failure is a known finding about fovi (:func:`new_failures`), 1 on a new
    failure; with ``strict``, 1 on any failure."""
    failed = [c for c in checks if not c.verdict.ok]
    return int(bool(failed if strict else new_failures(checks)))


def gate_summary(checks: Sequence[FoviCheck], *, strict: bool = False) -> str:
    """What :func:`exit_status` decided and why, for under the table: the new failures by
    name (layer, backend, dtype, quantity, diagnosis), at most 10 of them."""
    failed = [c for c in checks if not c.verdict.ok]
    new = new_failures(checks)
    status = exit_status(checks, strict=strict)
    if not failed:
        return "exit 0: every check passed"
    if not new:
        rule = "--strict: any failure exits 1" if strict else "--strict would exit 1"
        return (
            f"exit {status}: each of the {len(failed)} failed checks is a known finding about "
            f"fovi\n(diagnosed on fovi's side, reproduced by a script); {rule}"
        )
    lines = [
        f"exit {status}: {len(new)} of the {len(failed)} failed checks are new (no "
        "reproducer in scripts/fovi_findings/ explains them):"
    ]
    for c in new[:10]:
        lines.append(
            f"  {c.layer} {c.backend} {dtype_name(c.dtype)} {c.quantity}: {c.side}: {c.reason}"
        )
    if len(new) > 10:
        lines.append(f"  ... and {len(new) - 10} more (in the json's new_failures)")
    return "\n".join(lines)


def fovi_rows(checks: Sequence[FoviCheck]) -> list[dict]:
    """One row per layer x fovi backend: per dtype the verdict over its quantities, the worst
    quantity, its ratio (error / bound of the worst element) and fovi baseline's ratio; fovi's
    dispatcher choice per dtype and fovi_ref's route. JSON-ready."""
    rows: dict[tuple[str, str], dict] = {}
    for c in checks:
        row = rows.setdefault(
            (c.layer, c.backend),
            {"layer": c.layer, "backend": c.backend, "route": c.route, "dispatch": {}},
        )
        dtype = dtype_name(c.dtype)
        row["dispatch"][dtype] = c.dispatch
        cell = row.setdefault(dtype, {"ok": True, "worst": None, "ratio": -1.0})
        cell["ok"] = cell["ok"] and c.verdict.ok
        if c.verdict.ratio > cell["ratio"]:
            cell.update(worst=c.quantity, ratio=c.verdict.ratio)
            cell["baseline_ratio"] = c.verdict.baseline_ratio
    return list(rows.values())


def format_fovi_table(checks: Sequence[FoviCheck]) -> str:
    """The table of :func:`verify_fovi` (lines within 100 characters): one row per layer and
    fovi backend; per dtype ``PASS 0.35`` / ``FAIL 3e7``, the verdict over ``y`` and the three
    gradients and the worst element's error / bound; then fovi's dispatcher choice (``auto``,
    gradients on) beside fovi_ref's ``route``. Below: the count, then each diagnosis once (the
    side that is wrong and why) with the groups of failures it explains."""
    rows = fovi_rows(checks)
    dtypes = list(dict.fromkeys(dtype_name(c.dtype) for c in checks))
    header = f"{'layer':<22}{'fovi backend':<14}" + "".join(f"{d:<10}" for d in dtypes)
    header += f"{'auto':<13}route"
    lines = [header]
    cells = failed = 0
    for row in rows:
        text = f"{row['layer']:<22}{row['backend']:<14}"
        for d in dtypes:
            cell = row.get(d)
            if cell is None:
                text += f"{'-':<10}"
                continue
            cells += 1
            failed += not cell["ok"]
            text += f"{'PASS' if cell['ok'] else 'FAIL'} {_ratio_text(cell['ratio']):<5}"
        auto = "/".join(dict.fromkeys(row["dispatch"].values()))
        lines.append(f"{text}{auto:<13}{row['route']}")
    lines.append(f"\n{cells - failed} cells passed, {failed} failed")
    by_reason: dict[tuple[str, str], list[FoviFinding]] = {}
    for f in fovi_findings(checks):  # each diagnosis once; the groups name the dtype
        low = f.dtype in ("float16", "bfloat16")
        generic = f.reason.replace(f.dtype, "16 bits") if low else f.reason
        by_reason.setdefault((f.side, generic), []).append(f)
    if by_reason:
        lines.append("failures, by diagnosis (the side that is wrong: why), then the groups:")
    for (side, reason), group in by_reason.items():
        lines.append(f"  {side}: {reason}")
        for f in group:
            lines.append(
                f"    {f.backend} {f.dtype} {' '.join(f.quantities)} "
                f"({f.layers} layer{'s' * (f.layers != 1)}, worst {_ratio_text(f.worst_ratio)})"
            )
        scripts = dict.fromkeys(s for f in group for s in finding_scripts(f))
        if any(not finding_scripts(f) for f in group):
            lines.append("    reproducer: none yet for some of these groups")
        lines.extend(f"    reproducer: {FINDINGS_DIR}/{script}" for script in scripts)
    return "\n".join(lines)


def fovi_record(checks: Sequence[FoviCheck], **about: Any) -> dict:
    """What ``python -m fovi_ref verify --fovi`` writes to ``verify_fovi.json``: ``about``
    (versions, device, batch, arithmetic), the rule, the rows of :func:`fovi_rows`, the findings."""
    rows = fovi_rows(checks)
    cells = [row[d] for row in rows for d in DTYPES if d in row]
    return {
        "fovi": FOVI_VERSION,
        **about,
        "rule": "fovi_ref.check.tolerances.judge_elementwise, all_padding='zero' (fovi's layer)",
        "passed": sum(c["ok"] for c in cells),
        "failed": sum(not c["ok"] for c in cells),
        "rows": rows,
        "findings": [vars(f) for f in fovi_findings(checks)],
    }


def run_fovi(args) -> int:
    """``python -m fovi_ref verify --fovi`` (or ``--fovi-model``): fovi 2.4.0's backends through
    fovi's own layers (or every ``KNNConvLayer`` of the model ``args.fovi_model`` names), judged
    by the same elementwise rule (:func:`verify_fovi`); for fovi's own model, then, how its graphs
    depend on the machine (:func:`~fovi_ref.check.fovi.machines.machine_finding`) and the float16
    overflow. The table and findings on stdout, ``verify_fovi.json`` (``verify_fovi_model.json``)
    in ``args.out``. Returns the exit status: :func:`exit_status` (0 when every failure is a known
    finding about fovi, 1 on a new one or, with ``args.strict``, on any), 2 when fovi is not
    installed or ``--fovi-model`` names no model factory or no layer of its model."""

    try:
        fovi = require_fovi()
    except (FoviUnavailable, FoviVersionError) as err:
        print(f"verify --fovi: {err}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtypes = tuple(DTYPES[d] for d in args.dtypes)
    strict = bool(getattr(args, "strict", False))

    def on_layer(i, n, name):
        progress(i, n, f"verify fovi {name}")

    spec = getattr(args, "fovi_model", None)
    if spec:  # a user's own model: every KNNConvLayer in it (or those --layers names)
        try:
            layers = model_layers(load_model_factory(spec), args.layers)
        except (ValueError, TypeError) as err:  # the spec or a name, not the user's code, is wrong
            print(f"verify: {err}", file=sys.stderr)
            return 2
        what = f"{spec}'s"
    else:
        every = fovi_resnet18_layers(device)
        layers = {name: every[name] for name in layer_names(args.layers)}
        what = "fovi's own"
    with verdict_arithmetic():  # judged as fovi_ref's own backends are (arithmetic.py)
        arithmetic = arithmetic_settings(device)
        checks = verify_fovi(
            layers, dtypes=dtypes, batch=args.batch, device=device, on_layer=on_layer
        )
    print(f"\nfovi {fovi.__version__} on {device}, batch {args.batch}: {what} layers, every")
    print(describe(arithmetic))
    print("backend that runs here; y and grad x/weight/bias vs the float64 oracle, judged by")
    print("fovi_ref's elementwise rule (fovi_ref/check/tolerances.py), fovi's all-padding reading.")
    print("cell: PASS/FAIL, then the worst element's error / bound (at most 1 passes)")
    print("auto: fovi's dispatcher choice with gradients on; route: fovi_ref's for the graph")
    print("a FAIL is fovi's result outside the bound; the lines below it say why\n")
    print(format_fovi_table(checks))
    record = fovi_record(
        checks, torch=torch.__version__, device=str(device), batch=args.batch, arithmetic=arithmetic
    )
    name = "verify_fovi.json"
    if spec:  # the machine and overflow findings below are about fovi's default model only
        record["model"], name = spec, "verify_fovi_model.json"
        print(f"\n{MODEL_GRAPHS_NOTE}")
    else:  # Graphs are built on the CPU whatever the device, so this finding is the CPU's.
        if getattr(args, "machine_finding", True) is False:  # --no-machine-finding
            print("\nfovi's graphs under two CPU arithmetic settings: not compared (asked not to)")
            record["machine_finding"] = None
        else:
            finding = machine_finding()
            print(f"\n{finding.summary()}")
            record["machine_finding"] = finding_record(finding)
        overflow = overflow_finding(device)
        print(f"\n{overflow.summary()}")
        record["overflow_finding"] = {**vars(overflow), "overflowing": overflow.overflowing}
    status = exit_status(checks, strict=strict)
    print(f"\n{gate_summary(checks, strict=strict)}")
    record["new_failures"] = [
        {
            "layer": c.layer,
            "backend": c.backend,
            "dtype": dtype_name(c.dtype),
            "quantity": c.quantity,
            "side": c.side,
            "reason": c.reason,
        }
        for c in new_failures(checks)
    ]
    record["strict"], record["exit"] = strict, status
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(record, indent=1))
    return status


MODEL_GRAPHS_NOTE = """\
Ties and machine flips of this model's graphs: not computed. Ties need the geometry the graphs
were built from, which fovi_ref rebuilds for fovi-resnet18's defaults only; flips need the model
built again in fresh interpreters under other arithmetic settings. verify --fovi does both for
fovi-resnet18 (fovi.machines.machine_finding)."""
"""What ``verify --fovi-model`` prints in place of ``verify --fovi``'s machine finding."""
