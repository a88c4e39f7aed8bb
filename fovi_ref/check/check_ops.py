"""Conformance checks for any implementation of the KNN convolution: :func:`check_ops`.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

An *ops object* is anything that follows the backend protocol of :mod:`fovi_ref.knn_autograd`
(checked first, :func:`fovi_ref.check.protocol.check_protocol`). fovi_ref's own backends are ops
objects (:func:`fovi_ref.get_ops`), and so are fovi's (:class:`fovi_ref.check.fovi.FoviOps`).
The ops object runs :func:`~fovi_ref.check.protocol.policed`, so a result of the wrong shape or
dtype is a failed row naming the function that returned it. ``grad_bias`` is the op's, not the
backend's, and is not judged here.

**The graphs** (:mod:`fovi_ref.check.graphs`). The default battery, ``"spanning"``, spans the
axes where kernels go wrong, one axis large at a time: ``Nout``, ``Nin``, ``Cin``, ``Cout`` and
batch at 1 and at 31/32/33, 63/64/65 and 127/128/129 (batch also at 4 and 5); ``K`` at 1, 9,
10, 17 and 40; ``V`` at 1, 16, 17 and 33; one input read by 40, 150 and 1,100 outputs (past
twice fovi_ref's ``HUB`` and past 1,000); a ``grad_z`` over 32 MiB (channel blocks); the first
and the last input read; padding anywhere; ``Cin = 1`` and ``Cout = 1``; ``K = V = 1``, the
downsample convs' class (``gather_gemm`` takes no other), four ways. The full battery
(:data:`FULL`) adds the random graphs of earlier rounds and a fovi-resnet18 layer of each kind.

**The doors.** A backend is reached three ways, and each is judged:

- the eager door with gradients: ``knn_conv`` runs ``forward_with_operand`` (where the ops have
  the pair), ``grad_input`` and ``grad_weight_of_operand`` (check ``oracle``);
- the plain ``forward``, which runs under ``torch.no_grad`` and inside compiled or exported
  programs (check ``doors``);
- the custom op ``torch.ops.fovi_ref.knn_conv`` that compiled code calls, with its backward's
  ``grad_input`` and ``grad_weight`` from ``x`` (check ``doors``; called eagerly, with the ops
  registered for the run under a name of their own).

=============  ========================================================================
check          what it asks
=============  ========================================================================
oracle         ``y`` and the gradients agree with the float64 oracle by the elementwise
               rule of :mod:`fovi_ref.check.tolerances` (``einsum_baseline``'s ratio
               reported on the graphs that test calling conventions)
doors          the same for the plain forward and for the custom op and its backward
               (on ``base``, each gradient also asked for alone, the other inputs frozen)
cancellation   the same, with a bias that cancels ``W x`` and upstream gradients that
               cancel in pairs: the rule must hold where the results are tiny
rounding       (float16 and bfloat16) cells whose partial sums dwarf their sum: in each
               channel one cell of three or more neighbours adds ``+A``, small values,
               then ``-A`` (``A = 2/u``), and a one-hot weight hands that cell alone to
               an output: summing a cell in the working dtype loses the small values,
               which the rule's one store of ``z`` (relative to ``|z|``) does not allow;
               (float16) a cell of two or more inputs of 40,000 read with a weight of
               2^-10, ``grad_y`` scaled by a power of two that keeps the exact
               ``grad_weight`` within 2^14: ``y`` (78.125 for two) and ``grad_weight``
               are finite, and a cell stored in float16 makes them inf or nan; (float16)
               upstream gradients of a gradient scaler's size, +40,000 at node 0 and
               -39,936 at node 1, which share an input (on a hub graph, the hub), weights
               2: each ``grad_z`` is past 65504 and the shared input's ``grad_x`` is
               small, and a ``grad_z`` stored in float16 makes it nan; (float16, ``K = 1``
               graphs and hubs) ``grad_y`` +40,000 everywhere, one sign, and weights
               ``2^-e`` that keep every exact ``grad_x`` within 2^14: ``grad_y`` summed
               over an input's readers before the GEMM, ``W^T (S grad_y)``, is past 65504
               from two readers on, and inf in float16; (both) on graphs where many terms
               meet (:func:`many_terms`), every operand of one sign: a sum rounded once per
               term (16-bit atomics, one reader at a time) piles its roundings up
padding        inputs that no real neighbour reads hold inf (and the upstream gradient is
               large at all-padding nodes): the oracle still holds, all-padding outputs
               are exactly the bias (or 0), unread inputs get exactly zero gradient
nonfinite      an inf and a nan in inputs that are read, and in the weights of the last
               output channel (from two on), reach exactly the elements the oracle says,
               and nothing else; a non-finite weight may make its whole output channel of
               ``y`` non-finite (:mod:`fovi_ref.check.tolerances`, "Non-finite values")
variants       the oracle check again on what callers hand over besides the default
               operands: ``x`` in fovi's transposed layout, a strided slice and a stride-0
               expansion; ``weight`` transposed in memory; a strided ``bias`` and
               ``bias=None``; one output channel; ``grad_y`` in fovi's layout and stride-0
               expanded; batch sizes 0, 1 and one above ``batch`` (on the graphs that
               test calling conventions: ``base``, the random graphs, res18's of at most
               :data:`VARIANTS_MAX_NODES` outputs)
gradcheck      ``torch.autograd.gradcheck`` of ``knn_conv`` on the ops (float64, small
               graphs)
determinism    two runs of the oracle check's calls give bitwise equal results
=============  ========================================================================

**A failing row says where.** It gives the worst element's index (``[b, o, n]`` of ``y``,
``[b, c, i]`` of ``grad_x``, ``[o, column]`` of ``grad_weight``) and what the graph makes of it
(the node and its neighbours, the input and its readers, the channel and cell of a column), the
value, the oracle's value and the bound, and a ``replay``: the ``check_ops`` call that runs
that one case again (seeds come from graph names, so it is the same case).

Every judged result must come back in the inputs' dtype (another dtype is a failed row), and a
battery that would judge nothing (no graph, dtype or check) raises instead of passing.

Usable from pytest: ``assert report.ok, report``; from a shell: ``python -m fovi_ref check``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fovi_ref import (
    DTYPES,
    KNNMeta,
    derive_for,
    dtype_name,
    get_ops,
    knn_conv,
    register_ops,
    unregister_ops,
)
from fovi_ref.check.arithmetic import arithmetic_settings, verdict_arithmetic
from fovi_ref.check.graphs import (
    RES18_SUBSET,
    SPANNING,
    TestGraph,
    graph_seed,
    random_graphs,
    random_meta,
    res18_graphs,
    spanning_graph,
    spanning_graphs,
)
from fovi_ref.check.magnitude import fan_out, knn_conv_magnitude
from fovi_ref.check.operands import forward_and_grads, sample_operands
from fovi_ref.check.protocol import policed
from fovi_ref.check.tolerances import (
    UNIT_ROUNDOFF,
    BiasRounding,
    Expected,
    Verdict,
    expected_quantities,
    judge_elementwise,
)
from fovi_ref.reference import AllPadding, knn_conv_reference

__all__ = [
    "CHECKS",
    "DEFAULT",
    "FULL",
    "RES18_SUBSET",
    "OpsReport",
    "ReportRow",
    "TestGraph",
    "check_ops",
    "random_graphs",
    "random_meta",
    "res18_graphs",
    "resolve_graphs",
]

JUDGED = ("y", "grad_x", "grad_weight")  # what a backend computes (grad_bias is the op's)
CHECKS = (
    "oracle",
    "doors",
    "cancellation",
    "rounding",
    "padding",
    "nonfinite",
    "variants",
    "gradcheck",
    "determinism",
)
DEFAULT = ("spanning",)
"""The default battery's graphs: :data:`fovi_ref.check.graphs.SPANNING`."""
FULL = ("spanning", "random", "res18_subset")
"""The full battery's: the spanning graphs, the random graphs and the res18 layers of each kind
(:data:`RES18_SUBSET`; all 20 are ``graphs="res18"``, and ``verify`` runs them for fovi_ref's
backends)."""
BASELINE = "einsum_baseline"
VARIANTS_MAX_NODES = 64  # res18's larger graphs would cost minutes per backend
# The axis graphs test sizes; the calling conventions (variants, the baseline's ratio) are
# tested on the graphs below, which hold every awkward feature at once.
_SIZES_ONLY = frozenset(SPANNING) - {"base"}


# ----------------------------------------------------------------------------------- graphs
def _graph_item(item: Any, seed: int, device: torch.device) -> list[TestGraph]:
    """One item of ``graphs`` as a list of :class:`TestGraph`."""
    if isinstance(item, str):
        if item == "spanning":
            return spanning_graphs(seed=seed, device=device)
        if item == "random":
            return random_graphs(seed=seed, device=device)
        if item == "res18_subset":
            return res18_graphs(device=device)
        if item == "res18":
            return res18_graphs(None, device=device)
        if item in SPANNING:
            return [spanning_graph(item, seed=seed, device=device)]
        randoms = {g.name: g for g in random_graphs(seed=seed, device=device)}
        if item in randoms:
            return [randoms[item]]
        try:
            return res18_graphs([item], device=device)
        except KeyError:  # the geometry's UnknownLayerError
            raise ValueError(
                f"graphs: unknown graph {item!r}; an item is 'spanning', 'random', "
                f"'res18_subset', 'res18', a spanning graph ({', '.join(SPANNING[:3])}, ...), a "
                "random graph (random_k1_v1, ...) or a res18 layer (layer4.1.conv1, ...)"
            ) from None
    if isinstance(item, KNNMeta):
        raise TypeError(
            "graphs: a bare KNNMeta has no name or output channel count; pass "
            "TestGraph(name, meta, out_channels) instead"
        )
    missing = [a for a in ("name", "meta", "out_channels") if not hasattr(item, a)]
    if missing:
        raise TypeError(
            f"graphs: each item is a name or has .name, .meta and .out_channels; "
            f"{type(item).__name__} lacks {', '.join(missing)}"
        )
    if not isinstance(item.meta, KNNMeta):
        raise TypeError(
            f"graphs: {item.name!r}.meta must be a KNNMeta, got {type(item.meta).__name__}"
        )
    c_out = item.out_channels
    if isinstance(c_out, bool) or not isinstance(c_out, numbers.Integral) or c_out < 1:
        raise ValueError(f"graphs: {item.name!r}.out_channels must be an int >= 1, got {c_out!r}")
    narrowed = (getattr(item, a, None) for a in ("batch", "dtypes", "checks"))
    return [TestGraph(str(item.name), item.meta.to(device), int(c_out), *narrowed)]


def resolve_graphs(
    graphs: Any, seed: int = 0, device: torch.device | str = "cpu"
) -> list[TestGraph]:
    """The :class:`TestGraph` list that ``check_ops(graphs=...)`` runs on."""
    if graphs is None:
        graphs = DEFAULT
    if isinstance(graphs, str) or not isinstance(graphs, Iterable):  # one item, not its letters
        graphs = (graphs,)
    return [g for item in graphs for g in _graph_item(item, seed, device)]


# ------------------------------------------------------------------------------ running ops
def _run(ops, meta, x, w, b, gy) -> dict[str, torch.Tensor]:
    """``{"y", "grad_x", "grad_weight"}`` of ``ops`` through ``knn_conv`` (the eager door)."""
    return dict(zip(JUDGED, forward_and_grads(x, w, b, meta, gy, ops), strict=False))


@contextlib.contextmanager
def _registered(ops: Any) -> Iterator[str]:
    """``ops`` registered for the custom op (which finds backends by name) under a name of its
    own for the run, then removed."""
    name = f"check_ops[{ops.name}]@{id(ops):x}"
    register_ops(type(name, (ops,), {"name": name}))
    try:
        yield name
    finally:
        unregister_ops(name)


def _run_custom_op(name: str, meta, x, w, b, gy, asked: str | None = None) -> dict:
    """The compiled door, called eagerly: ``torch.ops.fovi_ref.knn_conv`` and its backward,
    ``grad_bias`` too where there is a bias (the door's own sum of ``grad_y``, not the
    backend's). ``asked``: the one gradient asked for (``"grad_x"``, ``"grad_weight"`` or
    ``"grad_bias"``), the other inputs frozen, as when a caller freezes a weight; ``None``:
    every gradient."""
    derived = derive_for(meta, name)
    leaves = {"grad_x": x, "grad_weight": w} | ({} if b is None else {"grad_bias": b})
    leaves = {q: t.detach().requires_grad_(asked in (None, q)) for q, t in leaves.items()}
    graph = (meta.knn, meta.rf_index, list(derived.values()), ",".join(derived))
    x, w, b = leaves["grad_x"], leaves["grad_weight"], leaves.get("grad_bias")
    y = torch.ops.fovi_ref.knn_conv(x, w, b, *graph, meta.n_in, meta.v, name)
    wanted = {q: t for q, t in leaves.items() if t.requires_grad}
    grads = torch.autograd.grad(y, list(wanted.values()), gy.to(y.dtype))
    return {"y": y.detach(), **dict(zip(wanted, grads, strict=True))}


# ------------------------------------------------------------------------------------ report
@dataclass(frozen=True)
class ReportRow:
    """One line of an :class:`OpsReport`: one check of one quantity, graph and dtype.

    ``ratio`` is the worst ``|err| / bound`` where the rule applied; ``index`` the element it
    was found at and ``where`` what the graph makes of that index; ``value``, ``oracle`` and
    ``bound`` that element's figures; ``replay`` the call that runs this case again."""

    graph: str
    dtype: str
    check: str
    quantity: str
    ok: bool
    ratio: float | None = None
    max_abs_error: float | None = None
    baseline_ratio: float | None = None
    note: str = ""
    index: tuple[int, ...] | None = None
    where: str = ""
    value: float | None = None
    oracle: float | None = None
    bound: float | None = None
    replay: str = ""

    def detail(self) -> str:
        """Where this row's worst element is and how to run the case again (one line each)."""
        lines = []
        if self.index is not None:
            at = f"{self.quantity}{list(self.index)}"
            figures = [
                f"{label} {_figure(value)}"
                for label, value in (
                    ("got", self.value),
                    ("oracle", self.oracle),
                    ("bound", self.bound),
                )
                if value is not None
            ]
            lines.append(f"  at {at} ({self.where}): {', '.join(figures)}")
        if self.replay:
            lines.append(f"  replay: {self.replay}")
        return "\n".join(lines)


def _figure(value: float | None) -> str:
    """A number as a reader takes it in: ``0.92``, ``2.3e+17``, ``inf``."""
    if value is None:
        return ""
    return f"{value:.3g}" if math.isfinite(value) else str(value)


@dataclass
class OpsReport:
    """What :func:`check_ops` found: ``rows``, ``ok``, ``failures``, a table as ``str()``, and
    the ``arithmetic`` they were judged under (:func:`~fovi_ref.check.arithmetic.
    arithmetic_settings`: the device, its name and the math settings)."""

    ops_name: str
    rows: list[ReportRow] = field(default_factory=list)
    arithmetic: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[ReportRow]:
        return [r for r in self.rows if not r.ok]

    def table(self, rows: Iterable[ReportRow] | None = None, *, details: bool = True) -> str:
        """A fixed-width table (within 100 characters before the note); under a failing row,
        where its worst element is and its replay (``details``)."""
        rows = self.rows if rows is None else list(rows)
        head = f"{'graph':<22}{'dtype':<9}{'check':<13}{'quantity':<12}{'':<5}"
        head += f"{'err/bound':>10}{'baseline':>9}  note"
        lines = [head]
        for r in rows:
            lines.append(
                f"{r.graph[:21]:<22}{r.dtype:<9}{r.check:<13}{r.quantity:<12}"
                f"{'PASS' if r.ok else 'FAIL':<5}{_figure(r.ratio):>10}"
                f"{_figure(r.baseline_ratio):>9}  {r.note}".rstrip()
            )
            if details and not r.ok and r.detail():
                lines.append(r.detail())
        return "\n".join(lines)

    def summary(self) -> str:
        n_fail = len(self.failures)
        graphs = len({r.graph for r in self.rows})
        return (
            f"check_ops({self.ops_name}): {len(self.rows) - n_fail} passed, {n_fail} failed "
            f"({graphs} graphs)"
        )

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table()

    def to_json(self) -> str:
        rows = [
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in d.items()
            }
            for d in map(asdict, self.rows)
        ]
        record = {"ops": self.ops_name, "ok": self.ok, "arithmetic": self.arithmetic}
        return json.dumps(record | {"rows": rows}, indent=1)


def _where(meta: KNNMeta, quantity: str, index: tuple[int, ...] | None) -> str:
    """What the graph makes of an element's index: the node and its neighbours (``y``), the
    input and the entries that read it (``grad_x``), the channel and cell (``grad_weight``)."""
    if index is None or len(index) < 2:
        return ""
    if quantity == "y":
        n = index[2]
        real = (~meta.pad_mask[:, n]).nonzero().flatten().tolist()
        text = f"node {n}, {len(real)} real neighbours"
        pairs = [f"k={k} input {int(meta.knn[k, n])} cell {int(meta.rf_index[n, k])}" for k in real]
        if pairs:
            text += f" ({'; '.join(pairs[:4])}{', ...' if len(pairs) > 4 else ''})"
        return text
    if quantity == "grad_x":
        i = index[2]
        slots, nodes = ((meta.knn == i) & ~meta.pad_mask).nonzero(as_tuple=True)  # [F], [F]
        text = f"input {i} of {meta.n_in}, read by {slots.numel()} entries"
        if slots.numel():
            k, n = int(slots[0]), int(nodes[0])
            text += f" (first: node {n} k={k} cell {int(meta.rf_index[n, k])})"
        return text
    if quantity == "grad_weight":
        column = index[1]
        return f"channel {column // meta.v}, cell {column % meta.v}"
    return ""


def _replay(graph: str, dtype: torch.dtype, check: str, options: dict[str, Any]) -> str:
    extra = "".join(f", {k}={v!r}" for k, v in options.items())
    return (
        f"check_ops(ops, graphs=[{graph!r}], dtypes=[torch.{dtype_name(dtype)}], "
        f"checks=[{check!r}]{extra})"
    )


# ----------------------------------------------------------------------------- the battery
@dataclass
class _Case:
    """Everything one (graph, dtype) needs."""

    graph: TestGraph
    dtype: torch.dtype
    device: torch.device
    seed: int  # the operands' (from the graph's name)
    batch: int
    all_padding: AllPadding
    bias_rounding: BiasRounding
    options: dict[str, Any]  # check_ops' arguments that a replay must repeat

    def row(self, check: str, verdict: Verdict, note: str = "") -> ReportRow:
        """The row of ``verdict``, with where its worst element is and the replay."""
        notes = "; ".join([*verdict.notes, *([note] if note else [])])
        if verdict.nonfinite_mismatches:
            notes = "; ".join([f"{verdict.nonfinite_mismatches} non-finite mismatches", notes])
        index = verdict.worst_index
        return ReportRow(
            self.graph.name,
            dtype_name(self.dtype),
            check,
            verdict.quantity,
            verdict.ok,
            verdict.ratio,
            verdict.max_abs_error,
            verdict.baseline_ratio,
            notes.strip("; "),
            index=index,
            where=_where(self.graph.meta, verdict.quantity, index),
            value=verdict.worst_value if index is not None else None,
            oracle=verdict.worst_ref if index is not None else None,
            bound=verdict.worst_bound if index is not None else None,
            replay=self.replay(check),
        )

    def error_row(self, check: str, quantity: str, err: Exception, door: str = "") -> ReportRow:
        """A failed row for a call that raised ``err`` (``door``: which call, where a check
        makes several)."""
        text = f"{type(err).__name__}: {err}".splitlines()[0][:160]
        note = f"raised {text}" + (f" ({door})" if door else "")
        return ReportRow(
            self.graph.name,
            dtype_name(self.dtype),
            check,
            quantity,
            False,
            note=note,
            replay=self.replay(check),
        )

    def plain_row(self, check: str, ok: bool, note: str = "", **figures: Any) -> ReportRow:
        replay = "" if ok else self.replay(check)
        return ReportRow(
            self.graph.name,
            dtype_name(self.dtype),
            check,
            "all",
            ok,
            note=note,
            replay=replay,
            **figures,
        )

    def replay(self, check: str) -> str:
        return _replay(self.graph.name, self.dtype, check, self.options)


def _operands(case: _Case) -> list[torch.Tensor]:
    """``[x, weight, bias, grad_y]`` of :func:`~fovi_ref.check.operands.sample_operands`."""
    meta = case.graph.meta
    operands = sample_operands(
        meta,
        case.graph.out_channels,
        batch=case.batch,
        seed=case.seed,
        dtype=case.dtype,
        device=case.device,
    )
    return list(operands)


def _expected(case: _Case, x, w, b, gy) -> dict[str, Expected]:
    return expected_quantities(
        x,
        w,
        b,
        case.graph.meta,
        gy,
        all_padding=case.all_padding,
        bias_rounding=case.bias_rounding,
    )


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


def _cells_of_distinct_inputs(meta: KNNMeta, at_least: int) -> list[tuple[int, int, list]]:
    """``(v, n, inputs in k order)`` of the first ``Cin`` cells (node-major) with ``at_least``
    real neighbours, all of them distinct inputs: a target cell per channel at most, so the
    loop stops early on a res18 layer's thousands of nodes."""
    cells = []
    for n in range(meta.n_out):
        real = ~meta.pad_mask[:, n]  # [K]
        for v in meta.rf_index[n][real].unique().tolist():
            inputs = meta.knn[:, n][real & (meta.rf_index[n] == v)].tolist()  # in k order
            if len(inputs) >= at_least and len(set(inputs)) == len(inputs):
                cells.append((v, n, inputs))
                if len(cells) == meta.in_channels:
                    return cells
    return cells


def _target_cell_operands(case: _Case, x, w, b, gy, targets, values, scale: float, seed: int):
    """``[x, w, b, gy]`` of a ``rounding`` case: ``x`` holds a random value in ``[1/2, 1)``
    everywhere (seeded by ``seed``) but at channel ``c``'s target cell ``targets[c mod T]``,
    whose inputs hold ``values(inputs)`` (``{input: value}``); output ``o`` reads channel
    ``c = o mod Cin``'s target cell alone, times ``scale`` (a one-hot weight row); no bias."""
    meta = case.graph.meta
    g = torch.Generator().manual_seed(seed)
    x = 0.5 + 0.5 * torch.rand(x.shape, generator=g, dtype=torch.float64)  # [B, Cin, Nin]
    w = torch.zeros(w.shape, dtype=torch.float64)  # [Cout, Cin*V]
    for c in range(meta.in_channels):
        v, _, inputs = targets[c % len(targets)]
        for i, value in values(inputs).items():
            x[:, c, i] = value
        w[c :: meta.in_channels, c * meta.v + v] = scale
    b = None if b is None else torch.zeros_like(b)
    return [t.to(case.device, case.dtype) for t in (x, w)] + [b, gy]


def _big_partial_sums(case: _Case, x, w, b, gy) -> list[torch.Tensor] | None:
    """Operands under which a cell summed in the working dtype shows (check ``rounding``), or
    ``None`` for a dtype that accumulates in itself or a graph without a cell of three or more
    distinct inputs. Channel ``c`` takes the target cell ``c mod T``: its first input holds
    ``+A``, its last ``-A`` and every other input a small value ``s`` in ``[1/2, 1)``, with
    ``A = 2/u``, so that ``A + s`` rounds ``s`` away in the working dtype while float32 keeps it.
    Output ``o`` reads channel ``o mod Cin``'s target cell alone (a one-hot weight row), no
    bias."""
    if case.dtype not in (torch.float16, torch.bfloat16):
        return None
    meta = case.graph.meta
    targets = _cells_of_distinct_inputs(meta, at_least=3)
    if not targets:
        return None
    big = 2 / UNIT_ROUNDOFF[case.dtype]

    def plus_and_minus_big(inputs: list[int]) -> dict[int, float]:
        return {inputs[0]: big, inputs[-1]: -big}

    return _target_cell_operands(
        case, x, w, b, gy, targets, plus_and_minus_big, scale=1.0, seed=case.seed + 2
    )


F16_PAST_MAX = 40000.0
"""A float16 value (exact) two of which sum past float16's largest finite value, 65504: the
inputs of a cell, and upstream gradients of a gradient scaler's size (it starts at ``2^16``)."""
F16_PAST_MAX_NOTE = "a float16 cell past 65504, y and grad_weight finite"
FITS = 2.0**14
"""The largest exact result the past-65504 cases build, at most: a quarter of 65504, so that a
correct result is finite with room to spare, and an inf or nan there is no rounding."""


def _scale_to_fit(largest: float) -> float:
    """``2^-e``, the largest power of two that brings ``largest`` (> 0) to :data:`FITS` or below:
    ``FITS / 2 < 2^-e largest <= FITS``."""
    return 2.0 ** math.floor(math.log2(FITS / largest))


def _cells_past_float16_max(case: _Case, x, w, b, gy) -> list[torch.Tensor] | None:
    """Operands whose exact ``y`` and ``grad_weight`` are finite in float16 while a cell is not
    (check ``rounding``), or ``None`` for another dtype, no batch or a graph without a cell of
    two distinct inputs. Channel ``c``'s target cell (``c mod T``) reads inputs of
    :data:`F16_PAST_MAX` each (every other input holds a value in ``[1/2, 1)``), and output
    ``o`` reads channel ``o mod Cin``'s target cell alone with a weight of ``2^-10``: ``y`` is
    about ``K * 39`` at most, but a cell stored in float16 is inf (fovi's path;
    scripts/fovi_findings/f16_cell_sum_overflow.py). ``grad_weight = grad_y z^T`` reads the same
    cells: ``grad_y`` (as drawn) is scaled by :func:`_scale_to_fit` of the largest
    ``sum_{b, n} |grad_y[b, o, n]| |z[b, c, v, n]|``, the magnitude of ``grad_weight``'s terms,
    which bounds it: every exact ``|grad_weight|`` is at most :data:`FITS` (on ``base``, scale
    ``2^-5`` and the largest about 9,300), while a cell recomputed for it and stored in float16
    unguarded makes its columns inf or nan. ``y`` and ``grad_weight`` are judged."""
    if case.dtype != torch.float16 or case.batch == 0:
        return None
    meta = case.graph.meta
    targets = _cells_of_distinct_inputs(meta, at_least=2)
    if not targets:
        return None

    def all_past_max(inputs: list[int]) -> dict[int, float]:
        return dict.fromkeys(inputs, F16_PAST_MAX)

    x, w, b, gy = _target_cell_operands(
        case, x, w, b, gy, targets, all_past_max, scale=2.0**-10, seed=case.seed + 3
    )
    terms = knn_conv_magnitude(x, w, None, meta, gy).grad_weight  # [Cout, Cin*V] float64
    return [x, w, b, (gy.double() * _scale_to_fit(float(terms.max()))).to(case.dtype)]


GRAD_Z_PAST_MAX = (40000.0, -39936.0)
"""Upstream gradients at nodes 0 and 1 (float16, exact): with weights 2 each ``grad_z`` is past
65504, and their sum over ``Cout`` output channels is ``128 Cout``."""
GRAD_Z_PAST_MAX_NOTE = "a float16 grad_z past 65504, grad_x finite"


def _grad_z_past_float16_max(case: _Case, x, w, b, gy) -> list[torch.Tensor] | None:
    """Operands whose exact ``grad_x`` is finite in float16 while ``grad_z = W^T grad_y`` is not
    (check ``rounding``), or ``None`` for another dtype or a graph whose nodes 0 and 1 share no
    input. ``grad_y`` is :data:`GRAD_Z_PAST_MAX` at nodes 0 and 1 (a gradient scaler's size) and
    as drawn elsewhere, every weight is 2: node 0's ``grad_z`` is ``80,000 Cout``
    and node 1's ``-79,872 Cout``, so an input both read once in one cell gets about
    ``128 Cout``, and nan from a ``grad_z`` stored in float16. ``grad_x`` alone is judged: the
    exact weight gradient need not be finite in float16."""
    meta = case.graph.meta
    if case.dtype != torch.float16 or meta.n_out < 2 or case.batch == 0:
        return None
    real = ~meta.pad_mask  # [K, Nout]
    shared = set(meta.knn[real[:, 0], 0].tolist()) & set(meta.knn[real[:, 1], 1].tolist())
    if not shared:
        return None
    gy = gy.clone()
    gy[:, :, 0], gy[:, :, 1] = GRAD_Z_PAST_MAX
    return [x, torch.full_like(w, 2.0), b, gy]


GRAD_Y_SUMMED_PAST_MAX_NOTE = "float16 grad_y of one sign summed past 65504, grad_x finite"
HUB_READERS = 40
"""Readers from which an input is a hub here: the battery's smallest hub, past twice fovi_ref's
``HUB`` (:mod:`fovi_ref.check.graphs`)."""


def _grad_y_summed_past_float16_max(case: _Case, x, w, b, gy) -> list[torch.Tensor] | None:
    """Operands whose exact ``grad_x`` is finite in float16 while the upstream gradients summed
    over an input's readers are not (check ``rounding``), or ``None`` for another dtype, a graph
    where no input has two readers, or one that is neither of ``K = 1`` nor holds a hub
    (:data:`HUB_READERS`). A ``K = 1`` kernel may scatter before its GEMM,
    ``grad_x = W^T (S grad_y)``, summing ``grad_y`` into a ``[B, Cout, Nin]`` buffer (atomics
    into the inputs' rows), and a hub kernel may sum its readers' ``grad_y`` first in the same
    way. ``grad_y`` is :data:`F16_PAST_MAX` everywhere, one sign (a gradient scaler's size), and
    every weight is ``2^-e``, with ``2^-e`` :func:`_scale_to_fit` of ``40,000 Cout F`` for the
    largest fan-out ``F``: an input read by ``F(i)`` entries gets exactly
    ``grad_x = 40,000 Cout F(i) 2^-e <= 2^14`` and each ``grad_z = W^T grad_y`` is
    ``40,000 Cout 2^-e`` (it fits), while ``S grad_y`` there holds ``40,000 F(i)``, past 65504
    from ``F(i) = 2`` on: a buffer in float16 makes ``grad_x`` inf. On ``downsample`` (Cout 4,
    ``F`` 3) ``2^-5``: ``grad_x`` 10,000 at two readers and 15,000 at three; on ``hub_40``
    (Cout 2, ``F`` 42) ``2^-8``, ``grad_z`` 312.5 and 13,125 at the hub; on ``hub_1100``
    (``F`` 1,151) ``2^-13``. ``grad_x`` alone is judged: ``grad_weight``, 40,000 times the cells,
    need not be finite in float16. Not in bfloat16: it has float32's range, so no such sum
    overflows, and the one rounding per collision a bfloat16 buffer adds is a store the rule
    allows (``h = F``); where such roundings pile up, :func:`_one_sign` builds the case."""
    meta = case.graph.meta
    if case.dtype != torch.float16 or case.batch == 0:
        return None
    most = int(fan_out(meta).max())
    if most < 2 or (meta.k != 1 and most < HUB_READERS):
        return None
    weight = _scale_to_fit(F16_PAST_MAX * case.graph.out_channels * most)
    return [x, torch.full_like(w, weight), b, torch.full_like(gy, F16_PAST_MAX)]


ONE_SIGN_NOTE = "operands of one sign: roundings pile up"
MANY_TERMS = 128
"""Terms (one input's readers, or a cell's entries over the batch) from which one rounding per
term, all of one sign, can reach the sum itself in bfloat16 (``gamma_F(u) >= 1`` from
``F u >= 1/2``; :mod:`fovi_ref.check.tolerances`, step 2 (c))."""


def many_terms(meta: KNNMeta, batch: int) -> bool:
    """True where some sum a backend may add term by term has :data:`MANY_TERMS` terms or more:
    the readers of one input (``grad_x``) or a cell's entries over the batch and the nodes
    (``grad_weight``)."""
    real = ~meta.pad_mask  # [K, Nout]
    entries = torch.bincount(meta.rf_index.t()[real], minlength=meta.v)  # [V] per cell
    most = max(int(fan_out(meta).max()), batch * int(entries.max())) if real.any() else 0
    return most >= MANY_TERMS


def _one_sign(case: _Case, x, w, b, gy) -> list[torch.Tensor] | None:
    """The operands' magnitudes (check ``rounding``), where many terms meet in a 16-bit dtype
    (:func:`many_terms`); else ``None``. Every term of every sum then has one sign, as under a
    mean loss with positive weights: a sum rounded once per added term loses ever more of the
    later terms, which random signs would have cancelled."""
    if case.dtype not in (torch.float16, torch.bfloat16):
        return None
    if not many_terms(case.graph.meta, case.batch):
        return None
    return [x.abs(), w.abs(), None if b is None else b.abs(), gy.abs()]


_ROUNDING_CASES = (
    (_big_partial_sums, JUDGED, ""),
    (_cells_past_float16_max, ("y", "grad_weight"), F16_PAST_MAX_NOTE),
    (_grad_z_past_float16_max, ("grad_x",), GRAD_Z_PAST_MAX_NOTE),
    (_grad_y_summed_past_float16_max, ("grad_x",), GRAD_Y_SUMMED_PAST_MAX_NOTE),
    (_one_sign, JUDGED, ONE_SIGN_NOTE),
)
"""Check ``rounding``'s cases: ``(operands of a case or None where it does not apply, the
quantities it judges, the note on its rows)``."""


def _judge(case, check, got, expected, baseline=None, note="", quantities=JUDGED):
    rows = []
    for quantity in quantities:
        verdict = judge_elementwise(
            got[quantity],
            expected[quantity],
            dtype=case.dtype,
            baseline=(baseline or {}).get(quantity),
        )
        rows.append(case.row(check, verdict, note))
    return rows


def _baseline(case: _Case, operands, exclude: str | None) -> dict[str, torch.Tensor]:
    """``einsum_baseline`` on the same operands, on the graphs that test calling conventions,
    unless it is the ops under test."""
    if exclude == BASELINE or case.graph.name in _SIZES_ONLY:
        return {}
    return _run(BASELINE, case.graph.meta, *operands)


def _check_oracle(
    ops, case, operands, check, *, name=None, expected=None, quantities=JUDGED, note=""
):
    """The oracle (or cancellation, rounding) check through the eager door, on
    ``quantities``; ``(rows, results)``."""
    try:
        got = _run(ops, case.graph.meta, *operands)
    except Exception as err:  # a conformance check reports; it does not crash
        return [case.error_row(check, "all", err, door=note)], None
    expected = _expected(case, *operands) if expected is None else expected
    baseline = _baseline(case, operands, name)
    return _judge(case, check, got, expected, baseline, note, quantities), got


def _check_rounding(ops, case, operands) -> list[ReportRow]:
    """The oracle check on each of :data:`_ROUNDING_CASES` that applies to the graph and dtype."""
    rows = []
    for build, quantities, note in _ROUNDING_CASES:
        built = build(case, *operands)
        if built is not None:
            rows += _check_oracle(
                ops, case, built, "rounding", name=ops.name, quantities=quantities, note=note
            )[0]
    return rows


def _check_doors(ops, door: str, case, operands, expected) -> list[ReportRow]:
    """The plain forward under ``no_grad``, and the custom op compiled code calls (with its
    backward), judged like the eager door."""
    x, w, b, gy = operands
    rows = []
    try:
        with torch.no_grad():
            y = knn_conv(x, w, b, case.graph.meta, backend=ops)
        verdict = judge_elementwise(y, expected["y"], dtype=case.dtype)
        rows.append(case.row("doors", verdict, "plain forward (no_grad)"))
    except Exception as err:  # a call that raised is reported, not compared: not mutated
        # pragma: no mutate start
        rows.append(case.error_row("doors", "y", err, door="plain forward (no_grad)"))
        # pragma: no mutate end
    note = "custom op (the compiled door)"
    try:
        got = _run_custom_op(door, case.graph.meta, x, w, b, gy)
    except Exception as err:
        return rows + [case.error_row("doors", "all", err, door=note)]  # pragma: no mutate
    quantities = [*JUDGED, "grad_bias"]  # the battery's operands always hold a bias
    rows += _judge(case, "doors", got, expected, note=note, quantities=quantities)
    if case.graph.name in _SIZES_ONLY:
        return rows
    # A calling convention: one gradient asked for, the other inputs frozen. grad_x and
    # grad_weight are asked without a bias (a bias-free layer), grad_bias with one.
    for asked in quantities[1:]:
        bias = b if asked == "grad_bias" else None
        note = f"custom op, {asked} alone asked for"
        try:
            alone = _run_custom_op(door, case.graph.meta, x, w, bias, gy, asked=asked)
        except Exception as err:
            rows.append(case.error_row("doors", asked, err, door=note))  # pragma: no mutate
            continue
        rows += _judge(case, "doors", alone, expected, note=note, quantities=[asked])
    return rows


def _unread_inputs(meta: KNNMeta) -> torch.Tensor:
    """``[Nin]`` bool: inputs that no real neighbour reads."""
    unread = torch.ones(meta.n_in, dtype=torch.bool, device=meta.device)
    unread[meta.knn[~meta.pad_mask]] = False
    return unread


def _first_offender(bad: torch.Tensor, index_of: torch.Tensor) -> tuple[int, ...]:
    """The full index of the first True of ``bad``, where ``index_of`` maps its last axis."""
    at = bad.nonzero()[0].tolist()
    return (*at[:-1], int(index_of[at[-1]]))


def _check_padding(ops, case, operands) -> list[ReportRow]:
    """Unread inputs hold inf; all-padding nodes get a large upstream gradient."""
    meta = case.graph.meta
    unread = _unread_inputs(meta)  # [Nin]
    empty = meta.pad_mask.all(dim=0)  # [Nout] all-padding nodes
    if not (bool(unread.any()) or bool(empty.any())):
        return [case.plain_row("padding", True, "nothing to test")]
    x, w, b, gy = (t.clone() for t in operands)
    x[:, :, unread] = math.inf
    gy[:, :, empty] = 1000.0
    try:
        got = _run(ops, meta, x, w, b, gy)
    except Exception as err:
        return [case.error_row("padding", "all", err)]
    expected = _expected(case, x, w, b, gy)
    rows = []
    for quantity in JUDGED:
        row = case.row(
            "padding", judge_elementwise(got[quantity], expected[quantity], dtype=case.dtype)
        )
        bad = None
        if quantity == "y" and bool(empty.any()):
            y_empty = got["y"][:, :, empty]  # [B, Cout, E]
            want = torch.zeros_like(y_empty) if case.all_padding == "zero" else b[:, None]
            bad = y_empty != want.expand_as(y_empty).to(y_empty.dtype)  # [B, Cout, E]
            what = f"all-padding outputs are not exactly the {case.all_padding}"
            nodes = empty.nonzero().flatten()
        if quantity == "grad_x" and bool(unread.any()):
            bad = got["grad_x"][:, :, unread] != 0  # [B, Cin, U]
            what = "unread inputs get a gradient"
            nodes = unread.nonzero().flatten()
        if bad is not None and bool(bad.any()):  # the exact rule: no ratio, the element itself
            index = _first_offender(bad, nodes)
            row = dataclasses.replace(
                row,
                ok=False,
                ratio=math.inf,
                note="; ".join(filter(None, (what, row.note))),
                index=index,
                where=_where(meta, quantity, index),
                value=float(got[quantity][index]),
                oracle=float(expected[quantity].value[index]),
                bound=0.0,
            )
        rows.append(row)
    return rows


def _check_nonfinite(ops, case, operands) -> list[ReportRow]:
    """An inf and a nan in read inputs of batch 0, and (from two output channels on, so that the
    other channels still show where the inputs' inf and nan reach in ``y``) an inf in the first
    weight column of the last output channel and a nan in its last: each reaches exactly what
    the oracle says (a non-finite weight may make its channel of ``y`` non-finite)."""
    meta = case.graph.meta
    read = (~_unread_inputs(meta)).nonzero().flatten()
    if case.batch == 0 or read.numel() == 0:
        return [case.plain_row("nonfinite", True, "nothing to test")]
    x, w, b, gy = (t.clone() for t in operands)
    x[0, 0, int(read[0])] = math.inf
    x[0, -1, int(read[-1])] = math.nan
    if w.shape[0] >= 2:
        w[-1, 0] = math.inf
        w[-1, -1] = math.nan
    try:
        got = _run(ops, meta, x, w, b, gy)
    except Exception as err:
        return [case.error_row("nonfinite", "all", err)]
    return _judge(case, "nonfinite", got, _expected(case, x, w, b, gy))


def _variants(case: _Case, x, w, b, gy) -> list[tuple[str, list]]:
    """``(label, operands)``: the layouts (of ``x``, ``weight``, ``bias``, ``grad_y``),
    ``bias=None`` and batch sizes callers hand over."""
    strided = x.new_zeros(*x.shape[:2], 2 * x.shape[2])[:, :, ::2]  # [B, Cin, Nin], stride 2
    strided.copy_(x)
    fovi = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, gy)]  # node-major
    out = [
        ("x in fovi's layout", [fovi[0], w, b, gy]),
        ("x a strided slice", [strided, w, b, gy]),
        ("bias None", [x, w, None, gy]),
        ("grad_y in fovi's layout", [x, w, b, fovi[1]]),
        ("grad_y expanded (stride 0)", [x, w, b, gy[:, :, :1].expand_as(gy)]),
        ("weight transposed in memory", [x, w.t().contiguous().t(), b, gy]),
    ]
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
        for r in found:
            rows.append(dataclasses.replace(r, note="; ".join(filter(None, (label, r.note)))))
    return rows


def _check_gradcheck(ops, case) -> list[ReportRow]:
    meta = case.graph.meta
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
    except Exception as err:
        return [case.error_row("gradcheck", "all", err)]
    return [
        case.plain_row(
            "gradcheck", bool(ok), "" if ok else "analytical and numerical Jacobians differ"
        )
    ]


def _check_determinism(ops, case, operands, first) -> list[ReportRow]:
    try:
        again = _run(ops, case.graph.meta, *operands)
    except Exception as err:
        return [case.error_row("determinism", "all", err)]
    differ = [q for q in first if not torch.equal(first[q], again[q])]
    note = "" if not differ else "differs between runs: " + ", ".join(differ)
    return [case.plain_row("determinism", not differ, note)]


def _check_arguments(
    checks, dtypes, batch, seed, gradcheck_max_numbers, all_padding, bias_rounding
) -> None:
    """``TypeError``/``ValueError`` naming the argument, before anything runs."""
    for what, value in (("checks", checks), ("dtypes", dtypes)):
        if isinstance(value, (str, torch.dtype)):
            raise TypeError(
                f"{what} must be a sequence, got {value!r} alone: wrap it, ({value!r},)"
            )
    odd = [d for d in dtypes if d not in DTYPES.values()]
    if odd:
        raise ValueError(f"dtypes must be among {list(DTYPES)}, got {odd}")
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; choose from {CHECKS}")
    if not checks or not dtypes:
        raise ValueError(
            f"check_ops needs at least one check and one dtype, got checks="
            f"{tuple(checks)!r}, dtypes={tuple(dtypes)!r}: an empty battery "
            "judges nothing"
        )
    for what, value, high in (
        ("batch", batch, None),
        ("seed", seed, 2**62),
        ("gradcheck_max_numbers", gradcheck_max_numbers, None),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
        if value < 0 or (high is not None and value > high):
            limit = f"in [0, {high}]" if high is not None else ">= 0"
            raise ValueError(f"{what} must be {limit}, got {value}")
    if all_padding not in ("bias", "zero"):
        raise ValueError(f"all_padding must be 'bias' or 'zero', got {all_padding!r}")
    if bias_rounding not in ("separate", "fused"):
        raise ValueError(f"bias_rounding must be 'separate' or 'fused', got {bias_rounding!r}")


def check_ops(
    ops: Any,
    *,
    graphs: Iterable[Any] | str | None = None,
    dtypes: Sequence[torch.dtype] = tuple(DTYPES.values()),
    device: torch.device | str = "cpu",
    all_padding: AllPadding = "bias",
    bias_rounding: BiasRounding = "fused",
    batch: int = 3,
    seed: int = 0,
    checks: Sequence[str] = CHECKS,
    gradcheck_max_numbers: int = 700,
    stop_at_first_fail: bool = False,
) -> OpsReport:
    """Run the conformance battery on ``ops`` and return an :class:`OpsReport`.

    Args:
        ops: an ops object (see the module docstring), or a registered backend's name.
        graphs: what to check on, one item or a list of them. An item is ``"spanning"`` (the
            default, :mod:`fovi_ref.check.graphs`), ``"random"`` (the random graphs),
            ``"res18_subset"`` (:data:`RES18_SUBSET`), ``"res18"`` (all 20 layers), the name
            of one such graph or res18 layer, or an object with ``.name``, ``.meta`` and
            ``.out_channels`` (a :class:`TestGraph`, a geometry ``LayerGraph``).
            :data:`FULL` is the full battery.
        dtypes: the dtypes to run in (gradcheck runs when float64 is among them).
        device: where the graphs, the operands and the float64 oracle live. The battery runs
            under :func:`~fovi_ref.check.arithmetic.verdict_arithmetic` (no TF32, no 16-bit
            split-K reductions; restored after), and the report records those settings.
        all_padding: the oracle's reading of all-padding nodes: ``"bias"`` (the formula) or
            ``"zero"`` (fovi 2.4.0's layer); see :mod:`fovi_ref.reference`.
        bias_rounding: ``"separate"`` allows ``W x`` to be rounded before the bias is added,
            ``"fused"`` demands one rounding (:mod:`fovi_ref.check.tolerances`, step 2 (d)).
        batch: batch size of the operands, except on graphs that set their own (the batch
            axis). seed: seeds the operands and the graphs, per graph name.
        checks: a subset of :data:`CHECKS`.
        gradcheck_max_numbers: gradcheck only graphs where ``x`` and the weight (at batch 2)
            and ``y`` hold at most this many numbers together: gradcheck costs two forwards per
            input number and one backward per output number. Above it (``hub_1100`` and the
            ``nout_127`` to ``nout_129`` graphs, by default) the float64 oracle alone judges
            the gradients, entry by entry.
        stop_at_first_fail: return as soon as one (graph, dtype) has a failed row, so that a
            wrong backend costs seconds (the mutation job's judge, ``scripts/mutations``).

    A graph whose ``supports(meta)`` is False is listed as skipped; where that is every graph,
    a failed row says that nothing was judged. An exception from
    the ops is a failed row, not a crash.
    """
    _check_arguments(checks, dtypes, batch, seed, gradcheck_max_numbers, all_padding, bias_rounding)
    ops = policed(get_ops(ops) if isinstance(ops, str) else ops)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: {err}") from None
    name = ops.name
    report = OpsReport(name)
    supports = getattr(ops, "supports", None)
    resolved = resolve_graphs(graphs, seed, device)
    if not resolved:
        raise ValueError(f"graphs={graphs!r} names no graph: an empty battery judges nothing")
    options: dict[str, Any] = {"seed": seed}
    if device.type != "cpu":
        options["device"] = str(device)
    if batch != 3:
        options["batch"] = batch
    if all_padding != "bias":
        options["all_padding"] = all_padding
    if bias_rounding != "fused":
        options["bias_rounding"] = bias_rounding
    with _registered(ops) as door, verdict_arithmetic():
        report.arithmetic = arithmetic_settings(device)
        for graph in resolved:
            if supports is not None and not supports(graph.meta):
                m = graph.meta
                note = f"skipped: not supported (K={m.k}, V={m.v})"
                report.rows.append(ReportRow(graph.name, "-", "supports", "-", True, note=note))
                continue
            graph_checks = (
                checks if graph.checks is None else [c for c in checks if c in graph.checks]
            )
            for dtype in (
                dtypes if graph.dtypes is None else [d for d in dtypes if d in graph.dtypes]
            ):
                case = _Case(
                    graph,
                    dtype,
                    device,
                    graph_seed(graph.name, seed),
                    batch if graph.batch is None else graph.batch,
                    all_padding,
                    bias_rounding,
                    options,
                )
                report.rows += _run_checks(ops, door, case, graph_checks)
                if stop_at_first_fail and not report.ok:
                    return report
            numbers = (
                graph.meta.in_channels * (2 * graph.meta.n_in + graph.out_channels * graph.meta.v)
                + 2 * graph.out_channels * graph.meta.n_out
            )
            if (
                "gradcheck" in graph_checks
                and torch.float64 in dtypes
                and numbers <= gradcheck_max_numbers
            ):
                case = _Case(
                    graph,
                    torch.float64,
                    device,
                    graph_seed(graph.name, seed),
                    2,
                    all_padding,
                    "fused",
                    options,
                )
                report.rows += _check_gradcheck(ops, case)
                if stop_at_first_fail and not report.ok:
                    return report
        if all(row.check == "supports" for row in report.rows):
            # ops whose supports() takes no graph of the battery would pass having run nothing
            note = "nothing judged: supports() takes none of these graphs"
            report.rows.append(ReportRow("-", "-", "supports", "-", False, note=note))
    return report


def _run_checks(ops, door: str, case: _Case, checks: Sequence[str]) -> list[ReportRow]:
    """Every check but gradcheck on one (graph, dtype)."""
    operands = _operands(case)
    rows: list[ReportRow] = []
    expected = _expected(case, *operands)
    first = None
    if "oracle" in checks or "determinism" in checks:
        found, first = _check_oracle(
            ops, case, operands, "oracle", name=ops.name, expected=expected
        )
        rows += found if "oracle" in checks else []
    if "doors" in checks:
        rows += _check_doors(ops, door, case, operands, expected)
    if "cancellation" in checks:
        cancelling = _cancelling(case, *operands)
        rows += _check_oracle(ops, case, cancelling, "cancellation", name=ops.name)[0]
    if "rounding" in checks:
        rows += _check_rounding(ops, case, operands)
    if "padding" in checks:
        rows += _check_padding(ops, case, operands)
    if "nonfinite" in checks:
        rows += _check_nonfinite(ops, case, operands)
    in_variants = case.graph.name not in _SIZES_ONLY
    if "variants" in checks and in_variants and case.graph.meta.n_out <= VARIANTS_MAX_NODES:
        rows += _check_variants(ops, case, operands)
    if "determinism" in checks and first is not None:
        rows += _check_determinism(ops, case, operands, first)
    return rows
