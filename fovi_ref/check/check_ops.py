"""Conformance checks for any implementation of the KNN convolution: :func:`check_ops`.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

An *ops object* is anything that follows the backend protocol of :mod:`fovi_ref.knn_autograd`
(checked first, :func:`fovi_ref.check.protocol.check_protocol`). fovi_ref's own backends are ops
objects (:func:`fovi_ref.get_ops`), and so are fovi's (:class:`fovi_ref.check.fovi.FoviOps`).
Every run goes through ``knn_conv`` (:func:`fovi_ref.check.operands.forward_and_grads`) with the
ops object :func:`~fovi_ref.check.protocol.policed`, so a result of the wrong shape or dtype is a
failed row naming the function that returned it. ``grad_bias`` is the op's, not the backend's,
and is not judged here.

:func:`check_ops` runs the whole battery on real fovi-resnet18 graphs and on small random graphs
with every awkward feature (padding anywhere, all-padding rows, repeated neighbours, shared
cells, unused inputs, collisions), in every dtype, and returns an :class:`OpsReport`:

=============  ========================================================================
check          what it asks
=============  ========================================================================
oracle         ``y`` and the gradients agree with the float64 oracle by the elementwise
               rule of :mod:`fovi_ref.check.tolerances` (``einsum_baseline``'s ratio reported);
               for ops with the operand pair, ``grad_weight`` from ``x`` too
cancellation   the same, with a bias that cancels ``W x`` and upstream gradients that
               cancel in pairs: the rule must hold where the results are tiny
padding        inputs that no real neighbour reads hold inf (and the upstream gradient is
               large at all-padding nodes): the oracle still holds, all-padding outputs
               are exactly the bias (or 0), unread inputs get exactly zero gradient
nonfinite      an inf and a nan in inputs that are read reach exactly the elements the
               oracle says, and nothing else
variants       the oracle check again on what callers hand over besides the default
               operands: ``x`` in fovi's transposed layout, a strided slice and a stride-0
               expansion; ``weight`` transposed in memory; a strided ``bias`` and
               ``bias=None``; one output channel; ``grad_y`` in fovi's layout and stride-0
               expanded; batch sizes 0, 1 and one above ``batch`` (on graphs of at most
               :data:`VARIANTS_MAX_NODES` outputs: they test the calling convention)
gradcheck      ``torch.autograd.gradcheck`` of ``knn_conv`` on the ops (float64, small
               graphs)
determinism    two runs of the oracle check's calls give bitwise equal results
=============  ========================================================================

Collisions are in every random graph (two outputs read one input in one cell, and
``crowded_k2_v4`` puts 20 outputs on 8 inputs): their gradients must add up, which the oracle
and cancellation checks judge.

Every judged result must come back in the inputs' dtype (another dtype is a failed row), and a
battery that would judge nothing (no graph, dtype or check) raises instead of passing.

Usable from pytest: ``assert report.ok, report``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fovi_ref import DTYPES, KNNMeta, dtype_name, get_ops, knn_conv
from fovi_ref.check.operands import forward_and_grads, sample_operands
from fovi_ref.check.protocol import policed
from fovi_ref.check.tolerances import BiasRounding, Verdict, expected_quantities, judge_elementwise
from fovi_ref.reference import AllPadding, knn_conv_reference

__all__ = [
    "CHECKS",
    "RES18_SUBSET",
    "OpsReport",
    "ReportRow",
    "TestGraph",
    "check_ops",
    "random_graphs",
    "random_meta",
    "res18_graphs",
]

JUDGED = ("y", "grad_x", "grad_weight")  # what a backend computes (grad_bias is the op's)
CHECKS = (
    "oracle", "cancellation", "padding", "nonfinite", "variants", "gradcheck", "determinism",
)  # fmt: skip
# The smallest res18 layers of each kind: K=1 downsample, K=2/V=4, K=9/V=9.
RES18_SUBSET = ("layer4.0.downsample.0", "layer4.1.conv1", "layer3.0.conv1")
BASELINE = "einsum_baseline"
VARIANTS_MAX_NODES = 64  # the random graphs; res18's would cost minutes per backend


# ----------------------------------------------------------------------------------- graphs
@dataclass(frozen=True)
class TestGraph:
    """A graph to check on: a name, the meta and the output channel count."""

    __test__ = False  # not a pytest test class, whatever its name

    name: str
    meta: KNNMeta
    out_channels: int


def random_meta(
    k: int,
    v: int,
    *,
    n_in: int = 16,
    n_out: int = 12,
    in_channels: int = 3,
    seed: int = 0,
    padding: float = 0.2,
    device: torch.device | str = "cpu",
) -> KNNMeta:
    """A random graph with every awkward feature real graphs have, each one forced:

    - padding anywhere in a list (``padding`` of the entries, one in the middle of node 2's);
    - an all-padding node (the last one);
    - a collision: nodes 0 and 1 read one input through their first neighbour, in one cell;
    - a repeated neighbour: node 3 lists one input twice (K >= 2);
    - a shared cell: node 0's first two neighbours fall in one cell (K >= 2);
    - unused inputs: the last three inputs are read by nobody.
    """
    if n_in < 5 or n_out < 5:
        raise ValueError("random_meta needs n_in >= 5 and n_out >= 5 for its forced features")
    g = torch.Generator().manual_seed(seed)
    knn = torch.randint(0, n_in - 3, (k, n_out), generator=g)  # [K, Nout]; last 3 inputs unused
    rf_index = torch.randint(0, v, (n_out, k), generator=g)  # [Nout, K]
    pad = torch.rand(k, n_out, generator=g) < padding  # [K, Nout]
    pad[k // 2, 2] = True  # padding in the middle of node 2's list
    pad[:, n_out - 1] = True  # an all-padding node
    pad[0, :2] = False  # the collision below stays real
    knn[0, 1] = knn[0, 0]  # collision: nodes 0 and 1 read one input ...
    rf_index[1, 0] = rf_index[0, 0]  # ... in the same cell, so their gradients can cancel
    if k >= 2:
        rf_index[0, 1] = rf_index[0, 0]  # node 0: two neighbours share a cell
        pad[1, 0] = False
        knn[1, 3] = knn[0, 3]  # node 3: one input listed twice
        pad[:2, 3] = False
    knn[pad] = n_in
    meta = KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=in_channels, v=v)
    return meta.to(device)


def random_graphs(*, seed: int = 0, device: torch.device | str = "cpu") -> list[TestGraph]:
    """The random graphs of the battery: the K=V=1 class, more neighbours than cells (shared
    cells), more cells than neighbours, and a crowded graph (many outputs on few inputs)."""
    shapes = [  # name, K, V, n_in, n_out, Cin, Cout
        ("random_k1_v1", 1, 1, 16, 12, 3, 4),
        ("random_k4_v2", 4, 2, 16, 12, 3, 4),
        ("random_k3_v9", 3, 9, 16, 12, 2, 3),
        ("crowded_k2_v4", 2, 4, 8, 20, 2, 3),
    ]
    return [
        TestGraph(name, random_meta(k, v, n_in=n_in, n_out=n_out, in_channels=c_in,
                                    seed=seed + i, device=device), c_out)
        for i, (name, k, v, n_in, n_out, c_in, c_out) in enumerate(shapes)
    ]  # fmt: skip


def res18_graphs(
    names: Sequence[str] | None = RES18_SUBSET, *, device: torch.device | str = "cpu"
) -> list[TestGraph]:
    """fovi-resnet18 graphs from :func:`fovi_ref.geometry.resnet18_layers` (``None``: all 20)."""
    from fovi_ref.geometry import get_layer, resnet18_layers  # the geometry is slow to import

    layers = list(resnet18_layers().values()) if names is None else map(get_layer, names)
    return [TestGraph(r.name, r.meta.to(device), r.out_channels) for r in layers]


def _resolve_graphs(graphs: Any, seed: int, device: torch.device) -> list[TestGraph]:
    if graphs is None:
        graphs = ("random", "res18_subset")
    if isinstance(graphs, str):  # one name, not its letters
        graphs = (graphs,)
    out: list[TestGraph] = []
    for item in graphs:
        if item == "random":
            out += random_graphs(seed=seed, device=device)
        elif item == "res18_subset":
            out += res18_graphs(device=device)
        elif item == "res18":
            out += res18_graphs(None, device=device)
        elif isinstance(item, str):
            out += res18_graphs([item], device=device)
        else:  # a TestGraph, a geometry LayerGraph, anything with .name, .meta, .out_channels
            out.append(TestGraph(item.name, item.meta.to(device), int(item.out_channels)))
    return out


# ------------------------------------------------------------------------------ running ops
def _run(ops, meta, x, w, b, gy) -> dict[str, torch.Tensor]:
    """``{"y", "grad_x", "grad_weight"}`` of ``ops`` through ``knn_conv``."""
    return dict(zip(JUDGED, forward_and_grads(x, w, b, meta, gy, ops), strict=False))


# ------------------------------------------------------------------------------------ report
@dataclass(frozen=True)
class ReportRow:
    """One line of an :class:`OpsReport`: one check of one quantity, graph and dtype."""

    graph: str
    dtype: str
    check: str
    quantity: str
    ok: bool
    ratio: float | None = None  # worst |err| / bound, where the rule applied
    max_abs_error: float | None = None
    baseline_ratio: float | None = None
    note: str = ""


@dataclass
class OpsReport:
    """What :func:`check_ops` found: ``rows``, ``ok``, ``failures``, a table as ``str()``."""

    ops_name: str
    rows: list[ReportRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[ReportRow]:
        return [r for r in self.rows if not r.ok]

    def table(self, rows: Iterable[ReportRow] | None = None) -> str:
        """A fixed-width table (within 100 characters before the note)."""
        rows = self.rows if rows is None else list(rows)
        head = f"{'graph':<22}{'dtype':<9}{'check':<13}{'quantity':<12}{'':<5}"
        head += f"{'err/bound':>10}{'baseline':>9}  note"
        lines = [head]
        for r in rows:
            ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
            base = "" if r.baseline_ratio is None else f"{r.baseline_ratio:.2f}"
            lines.append(
                f"{r.graph[:21]:<22}{r.dtype:<9}{r.check:<13}{r.quantity:<12}"
                f"{'PASS' if r.ok else 'FAIL':<5}{ratio:>10}{base:>9}  {r.note}".rstrip()
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        n_fail = len(self.failures)
        summary = f"check_ops({self.ops_name}): {len(self.rows) - n_fail} passed, {n_fail} failed"
        return summary + "\n" + self.table()

    def to_json(self) -> str:
        rows = [
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in d.items()
            }
            for d in map(asdict, self.rows)
        ]
        return json.dumps({"ops": self.ops_name, "ok": self.ok, "rows": rows}, indent=1)


def _row(graph: str, dtype: torch.dtype, check: str, verdict: Verdict, note: str = "") -> ReportRow:
    notes = "; ".join([*verdict.notes, *([note] if note else [])])
    if verdict.nonfinite_mismatches:
        notes = "; ".join([f"{verdict.nonfinite_mismatches} non-finite mismatches", notes])
    return ReportRow(
        graph, dtype_name(dtype), check, verdict.quantity, verdict.ok, verdict.ratio,
        verdict.max_abs_error, verdict.baseline_ratio, notes.strip("; "),
    )  # fmt: skip


def _error_row(graph: str, dtype: torch.dtype, check: str, quantity: str, err: Exception):
    text = f"{type(err).__name__}: {err}".splitlines()[0][:160]
    return ReportRow(graph, dtype_name(dtype), check, quantity, False, note=f"raised {text}")


# ----------------------------------------------------------------------------- the battery
@dataclass
class _Case:
    """Everything one (graph, dtype) needs."""

    graph: TestGraph
    dtype: torch.dtype
    device: torch.device
    seed: int
    batch: int
    all_padding: AllPadding
    bias_rounding: BiasRounding


def _operands(case: _Case) -> list[torch.Tensor]:
    """``[x, weight, bias, grad_y]`` of :func:`~fovi_ref.check.operands.sample_operands`."""
    meta = case.graph.meta
    operands = sample_operands(meta, case.graph.out_channels, batch=case.batch, seed=case.seed,
                               dtype=case.dtype, device=case.device)  # fmt: skip
    return list(operands)


def _cancelling(case: _Case, x, w, b, gy) -> list[torch.Tensor]:
    """The operands with a bias that cancels ``W x`` at one node of batch 0 (for every output
    channel), and upstream gradients that nearly cancel between pairs of nodes (so grad_bias
    cancels, and so does grad_x on inputs the pair reads in one cell)."""
    meta = case.graph.meta
    real_nodes = (~meta.pad_mask).any(dim=0).nonzero().flatten()
    if case.batch and real_nodes.numel():
        n0 = int(real_nodes[0])
        wx = knn_conv_reference(x, w, None, meta)[0, :, n0]  # [Cout] float64
        b = (-wx).to(case.dtype)  # y[0, :, n0] = b + W x: what is left is b's rounding
    g = torch.Generator().manual_seed(case.seed + 1)
    wobble = 1 + 2.0**-7 * torch.randn(gy[:, :, 1::2].shape, generator=g, dtype=torch.float64)
    gy = gy.double().clone()
    pairs = gy.shape[2] // 2
    gy[:, :, 1 : 2 * pairs : 2] = -gy[:, :, 0 : 2 * pairs : 2] * wobble[:, :, :pairs].to(gy.device)
    return [x, w, b, gy.to(case.dtype)]


def _judge_all(case, check, got, expected, baseline, note="") -> list[ReportRow]:
    rows = []
    for quantity in JUDGED:
        verdict = judge_elementwise(
            got[quantity], expected[quantity], dtype=case.dtype, baseline=baseline.get(quantity)
        )
        rows.append(_row(case.graph.name, case.dtype, check, verdict, note))
    return rows


def _baseline(case: _Case, operands, exclude: str | None) -> dict[str, torch.Tensor]:
    """``einsum_baseline`` on the same operands, unless it is the ops under test."""
    if exclude == BASELINE:
        return {}
    return _run(BASELINE, case.graph.meta, *operands)


def _check_oracle(ops, case, operands, check, *, name=None):
    """The oracle (or cancellation) check; returns ``(rows, results)``."""
    x, w, b, gy = operands
    try:
        got = _run(ops, case.graph.meta, x, w, b, gy)
    except Exception as err:  # a conformance check reports; it does not crash
        return [_error_row(case.graph.name, case.dtype, check, "all", err)], None
    expected = expected_quantities(
        x, w, b, case.graph.meta, gy,
        all_padding=case.all_padding, bias_rounding=case.bias_rounding,
    )  # fmt: skip
    rows = _judge_all(case, check, got, expected, _baseline(case, operands, name))
    return rows + _grad_weight_from_x(ops, case, operands, check, expected), got


def _grad_weight_from_x(ops, case, operands, check, expected) -> list[ReportRow]:
    """Where the ops keep an operand for the weight gradient (the eager door's path, which
    :func:`_run` takes), ``grad_weight(meta, grad_y, x)`` (the compiled door's) judged too."""
    if not hasattr(ops, "grad_weight_of_operand"):
        return []
    x, _, _, gy = operands
    try:
        lay_out = getattr(ops, "grad_y_layout", None)
        got = ops.grad_weight(case.graph.meta, gy if lay_out is None else lay_out(gy), x)
    except Exception as err:
        return [_error_row(case.graph.name, case.dtype, check, "grad_weight", err)]
    verdict = judge_elementwise(got, expected["grad_weight"], dtype=case.dtype)
    return [_row(case.graph.name, case.dtype, check, verdict, "from x (the compiled door)")]


def _unread_inputs(meta: KNNMeta) -> torch.Tensor:
    """``[Nin]`` bool: inputs that no real neighbour reads."""
    unread = torch.ones(meta.n_in, dtype=torch.bool, device=meta.device)
    unread[meta.knn[~meta.pad_mask]] = False
    return unread


def _check_padding(ops, case, operands) -> list[ReportRow]:
    """Unread inputs hold inf; all-padding nodes get a large upstream gradient."""
    meta, name, dtype = case.graph.meta, case.graph.name, case.dtype
    unread = _unread_inputs(meta)  # [Nin]
    empty = meta.pad_mask.all(dim=0)  # [Nout] all-padding nodes
    if not (bool(unread.any()) or bool(empty.any())):
        return [ReportRow(name, dtype_name(dtype), "padding", "all", True, note="nothing to test")]
    x, w, b, gy = (t.clone() for t in operands)
    x[:, :, unread] = math.inf
    gy[:, :, empty] = 1000.0
    try:
        got = _run(ops, case.graph.meta, x, w, b, gy)
    except Exception as err:
        return [_error_row(name, dtype, "padding", "all", err)]
    expected = expected_quantities(
        x, w, b, meta, gy, all_padding=case.all_padding, bias_rounding=case.bias_rounding
    )
    rows = []
    for quantity in JUDGED:
        verdict = judge_elementwise(got[quantity], expected[quantity], dtype=dtype)
        note, ok = "", True
        if quantity == "y" and bool(empty.any()):
            y_empty = got["y"][:, :, empty]  # [B, Cout, E]
            want = torch.zeros_like(y_empty) if case.all_padding == "zero" else b[:, None]
            ok = torch.equal(y_empty, want.expand_as(y_empty).to(y_empty.dtype))
            note = "" if ok else f"all-padding outputs are not exactly the {case.all_padding}"
        if quantity == "grad_x" and bool(unread.any()):
            g_unread = got["grad_x"][:, :, unread]
            ok = bool((g_unread == 0).all())
            note = "" if ok else "unread inputs get a gradient"
        row = _row(name, dtype, "padding", verdict, note)
        rows.append(ReportRow(**{**asdict(row), "ok": row.ok and ok}))
    return rows


def _check_nonfinite(ops, case, operands) -> list[ReportRow]:
    """An inf and a nan in read inputs of batch 0 reach exactly what the oracle says."""
    meta, name, dtype = case.graph.meta, case.graph.name, case.dtype
    read = (~_unread_inputs(meta)).nonzero().flatten()
    if case.batch == 0 or read.numel() == 0:
        return [
            ReportRow(name, dtype_name(dtype), "nonfinite", "all", True, note="nothing to test")
        ]
    x, w, b, gy = (t.clone() for t in operands)
    x[0, 0, int(read[0])] = math.inf
    x[0, -1, int(read[-1])] = math.nan
    try:
        got = _run(ops, case.graph.meta, x, w, b, gy)
    except Exception as err:
        return [_error_row(name, dtype, "nonfinite", "all", err)]
    expected = expected_quantities(
        x, w, b, meta, gy, all_padding=case.all_padding, bias_rounding=case.bias_rounding
    )
    return _judge_all(case, "nonfinite", got, expected, {})


def _variants(case: _Case, x, w, b, gy) -> list[tuple[str, list]]:
    """``(label, operands)``: the layouts (of ``x``, ``weight``, ``bias``, ``grad_y``),
    ``bias=None`` and batch sizes callers hand over."""
    strided = x.new_zeros(*x.shape[:2], 2 * x.shape[2])[:, :, ::2]  # [B, Cin, Nin], stride 2
    strided.copy_(x)
    fovi = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, gy)]  # node-major
    out = [("x in fovi's layout", [fovi[0], w, b, gy]), ("x a strided slice", [strided, w, b, gy]),
           ("bias None", [x, w, None, gy]), ("grad_y in fovi's layout", [x, w, b, fovi[1]]),
           ("grad_y expanded (stride 0)", [x, w, b, gy[:, :, :1].expand_as(gy)]),
           ("weight transposed in memory", [x, w.t().contiguous().t(), b, gy])]  # fmt: skip
    if b is not None:  # every other element of a buffer twice its length
        b_strided = b.new_zeros(2 * b.shape[0])[::2]
        b_strided.copy_(b)
        out.append(("bias a strided slice", [x, w, b_strided, gy]))
    out.append(("one output channel", [x, w[:1], None if b is None else b[:1], gy[:, :1]]))
    if case.batch:
        out.append(("x expanded (stride 0)", [x[:1].expand_as(x), w, b, gy]))
    for batch in sorted({0, 1, case.batch + 1}):
        other = dataclasses.replace(case, batch=batch)
        out.append((f"batch {batch}", _operands(other)))
    return out


def _check_variants(ops, case, operands) -> list[ReportRow]:
    """The oracle check on each of :func:`_variants`, the label in the note."""
    rows = []
    for label, variant in _variants(case, *operands):
        other = dataclasses.replace(case, batch=variant[0].shape[0])
        found = _check_oracle(ops, other, variant, "variants", name=BASELINE)[0]  # no baseline
        rows += [dataclasses.replace(r, note="; ".join(filter(None, (label, r.note))))
                 for r in found]  # fmt: skip
    return rows


def _check_gradcheck(ops, case) -> list[ReportRow]:
    meta, name = case.graph.meta, case.graph.name
    c_out = case.graph.out_channels
    g = torch.Generator().manual_seed(case.seed)
    shapes = ((2, meta.in_channels, meta.n_in), (c_out, meta.in_channels * meta.v), (c_out,))
    x, w, b = (
        torch.randn(s, generator=g, dtype=torch.float64).to(case.device).requires_grad_()
        for s in shapes
    )

    def fn(x, w, b):
        return knn_conv(x, w, b, meta, backend=ops)

    try:
        ok = torch.autograd.gradcheck(fn, (x, w, b), raise_exception=False)
        note = "" if ok else "analytical and numerical Jacobians differ"
    except Exception as err:
        return [_error_row(name, case.dtype, "gradcheck", "all", err)]
    return [ReportRow(name, "float64", "gradcheck", "all", bool(ok), note=note)]


def _check_determinism(ops, case, operands, first) -> list[ReportRow]:
    name, dtype = case.graph.name, case.dtype
    try:
        again = _run(ops, case.graph.meta, *operands)
    except Exception as err:
        return [_error_row(name, dtype, "determinism", "all", err)]
    differ = [q for q in first if not torch.equal(first[q], again[q])]
    note = "" if not differ else "differs between runs: " + ", ".join(differ)
    return [ReportRow(name, dtype_name(dtype), "determinism", "all", not differ, note=note)]


def check_ops(
    ops: Any,
    *,
    graphs: Iterable[Any] | None = None,
    dtypes: Sequence[torch.dtype] = tuple(DTYPES.values()),
    device: torch.device | str = "cpu",
    all_padding: AllPadding = "bias",
    bias_rounding: BiasRounding = "fused",
    batch: int = 3,
    seed: int = 0,
    checks: Sequence[str] = CHECKS,
    gradcheck_max_inputs: int = 400,
) -> OpsReport:
    """Run the conformance battery on ``ops`` and return an :class:`OpsReport`.

    Args:
        ops: an ops object (see the module docstring), or a registered backend's name.
        graphs: what to check on, one item or a list of them; an item is ``"random"``
            (:func:`random_graphs`), ``"res18_subset"`` (:data:`RES18_SUBSET`), ``"res18"``
            (all 20 layers), a res18 layer name, or an object with ``.name``, ``.meta`` and
            ``.out_channels`` (a :class:`TestGraph`, a geometry ``LayerGraph``). Default:
            random + res18 subset.
        dtypes: the dtypes to run in (gradcheck runs when float64 is among them).
        device: where the graphs and operands live.
        all_padding: the oracle's reading of all-padding nodes: ``"bias"`` (the formula) or
            ``"zero"`` (fovi 2.4.0's layer); see :mod:`fovi_ref.reference`.
        bias_rounding: ``"separate"`` allows ``W x`` to be rounded before the bias is added,
            ``"fused"`` demands one rounding (:mod:`fovi_ref.check.tolerances`, step 2 (d)).
        batch: batch size of the operands. seed: seeds the operands and the random graphs.
        checks: a subset of :data:`CHECKS`.
        gradcheck_max_inputs: gradcheck only graphs whose ``x``, weight and bias hold at most
            this many numbers (it costs two forwards per number).

    A graph whose ``supports(meta)`` is False is listed as skipped. An exception from
    the ops is a failed row, not a crash.
    """
    ops = policed(get_ops(ops) if isinstance(ops, str) else ops)
    if isinstance(checks, str) or isinstance(dtypes, torch.dtype):
        what = "checks" if isinstance(checks, str) else "dtypes"
        raise TypeError(f"{what} must be a sequence, got {checks if what == 'checks' else dtypes!r}"
                        f" alone: wrap it, ({what[:-1]},)")  # fmt: skip
    odd = [d for d in dtypes if d not in DTYPES.values()]
    if odd:
        raise ValueError(f"dtypes must be among {list(DTYPES)}, got {odd}")
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral):
        raise TypeError(f"batch must be an int, got {type(batch).__name__} {batch!r}")
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; choose from {CHECKS}")
    if not checks or not dtypes:
        raise ValueError(f"check_ops needs at least one check and one dtype, got checks="
                         f"{tuple(checks)!r}, dtypes={tuple(dtypes)!r}: an empty battery "
                         "judges nothing")  # fmt: skip
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    device = torch.device(device)
    name = getattr(ops, "name", type(ops).__name__)
    report = OpsReport(name)
    supports = getattr(ops, "supports", None)
    resolved = _resolve_graphs(graphs, seed, device)
    if not resolved:
        raise ValueError(f"graphs={graphs!r} names no graph: an empty battery judges nothing")
    for index, graph in enumerate(resolved):
        if supports is not None and not supports(graph.meta):
            m = graph.meta
            note = f"skipped: not supported (K={m.k}, V={m.v})"
            report.rows.append(ReportRow(graph.name, "-", "supports", "-", True, note=note))
            continue
        for dtype in dtypes:
            case = _Case(
                graph, dtype, device, seed + 1000 * index, batch, all_padding,
                bias_rounding,
            )  # fmt: skip
            operands = _operands(case)
            first = None
            if "oracle" in checks or "determinism" in checks:
                rows, first = _check_oracle(ops, case, operands, "oracle", name=name)
                report.rows += rows if "oracle" in checks else []
            if "cancellation" in checks:
                cancelling = _cancelling(case, *operands)
                report.rows += _check_oracle(ops, case, cancelling, "cancellation", name=name)[0]
            if "padding" in checks:
                report.rows += _check_padding(ops, case, operands)
            if "nonfinite" in checks:
                report.rows += _check_nonfinite(ops, case, operands)
            if "variants" in checks and graph.meta.n_out <= VARIANTS_MAX_NODES:
                report.rows += _check_variants(ops, case, operands)
            if "determinism" in checks and first is not None:
                report.rows += _check_determinism(ops, case, operands, first)
        size = graph.meta.in_channels * (2 * graph.meta.n_in + graph.out_channels * graph.meta.v)
        if "gradcheck" in checks and torch.float64 in dtypes and size <= gradcheck_max_inputs:
            case = _Case(graph, torch.float64, device, seed, 2, all_padding, "fused")
            report.rows += _check_gradcheck(ops, case)
    return report
