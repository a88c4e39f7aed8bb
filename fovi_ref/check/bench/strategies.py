"""``python -m fovi_ref bench --strategies``: the measurements behind the routed backend's
constants.

Every tuned constant of :mod:`fovi_ref.strategies` and :mod:`fovi_ref.segment_sum` is a rule "a
path runs where a quantity passes the constant" (the table), except ``BLOCK_ROWS``, a size. For
each rule this job times the path forced *on* and forced *off* on cases whose quantity lies on
both sides of the constant, and the *off* contender a second time in the same rounds: the two
*off* timings run the same code, so their ratio (an A/A ratio) shows how far the machine's noise
alone moves a ratio, as notebook 04 does for ``DENSE_S_BUDGET``
(:mod:`~fovi_ref.check.bench.budget`, whose noise band and verdicts are used here). Per case:

- *verdict*: ``on`` when on / off is below ``1 / (1 + band)``, ``off`` when it is above
  ``1 + band``, else ``tie``; ``band`` is the constant's largest A/A deviation (at least 5%)
  or, if larger, how far the case's own ratio moved between its :data:`PASSES` passes.
- a case *disagrees* when the rule sends it down the path its verdict found slower (an ``on``
  case off, an ``off`` case on); a tie may go either way.
- a constant *agrees* with the record when no other value of it would leave fewer cases
  disagreeing. Usually that is none: the rule sends every case its faster way. But one
  threshold serves several layers, whose cases the quantity need not order as their times do
  (an ``on`` case of one layer above an ``off`` case of another), and no value then sends both
  right; the report says which values reach the fewest. The quantity is computed from the case
  and the code as it is now, so ``CELLS_AT_MOST``'s quantity (the estimate) moves with
  ``PAIR_COST`` and ``WEIGHT_COST``: the three are held together.

=================================  ==========================  ===================  ================
constant                           quantity (unit)             on / off             on where
=================================  ==========================  ===================  ================
``node_rows.FEW_SAMPLES``          batch (samples)             node rows / textbook ``q <= c``
``few_columns.FEW_COLUMNS``        ``Nout*B`` (GEMM columns)   few columns / textb. ``q <= c``
``channel_blocks.WHOLE_BYTES``     ``grad_z`` (bytes, float32) blocks / textbook    ``q > c``
``occupied_cells.CELLS_AT_MOST``   estimate (time ratio)       occupied / textbook  ``q <= c``
``segment_sum.HUB``                a hub row's terms (terms)   tree / rounds        ``q > c``
=================================  ==========================  ===================  ================

``BLOCK_ROWS`` (rows): channel blocks timed at each of :data:`BLOCK_ROWS_CANDIDATES`; it agrees
when no candidate is faster than it beyond the band. Cases run forward + backward in float32
through ``knn_conv`` (``forced_ops``) on fovi 2.4.0's pinned res18 graphs, ``Cout = Cin``, with
torch's default threads; ``HUB`` times its one operation alone on
synthetic rows. Each contender's time is its fastest call of the rounds (noise only adds time:
:func:`~fovi_ref.check.bench.budget.fastest_times`).

The job prints the choice (:func:`fovi_ref.strategies.strategy_for`) for res18's layers, each
constant's cases and verdicts, and whether the constant agrees, and writes
``OUT/bench_strategies.json``. The record the constants are held to is
:data:`RECORD_PATH` (``fovi_ref/check/bench/strategies_record.json``): copy a run's file there to
replace it; ``tests/test_strategies.py`` then fails while a constant disagrees with it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

import fovi_ref.segment_sum as segment_sum
from fovi_ref import KNNMeta
from fovi_ref.check.arithmetic import arithmetic_settings
from fovi_ref.check.bench import budget
from fovi_ref.check.bench.contenders import make_inputs, through
from fovi_ref.check.jobs import progress
from fovi_ref.geometry import pinned_graphs
from fovi_ref.strategies import (
    channel_blocks,
    few_columns,
    forced_ops,
    node_rows,
    occupied_cells,
    strategy_for,
)

__all__ = [
    "BLOCK_ROWS_CANDIDATES",
    "RECORD_PATH",
    "RULES",
    "Point",
    "Rule",
    "agrees",
    "block_rows_disagreements",
    "disagreements",
    "fewest_disagreements",
    "from_record",
    "measure",
    "run",
    "to_record",
    "verdicts",
]

RECORD_PATH = Path(__file__).with_name("strategies_record.json")
"""The stored measurement the constants are held to."""

ROUNDS = 7
"""Timed rounds per case and pass (the fastest call of each contender is kept)."""

PASSES = 5
"""Passes over all the cases, each contender's fastest kept: a case's ratio moves from one
minute to the next by more than its A/A ratio shows within a pass (the memory a path touches,
the machine's other work), and the later passes give each contender another chance at its
uncontended cost."""

BLOCK_ROWS_CANDIDATES = (2**13, 2**14, 2**15, 2**16, 2**17)
"""The block sizes (``grad_z`` rows) timed for ``BLOCK_ROWS``."""

BLOCK_ROWS_CASE = {"layer": "layer1.0.conv1", "batch": 64}
"""Where ``BLOCK_ROWS`` is timed: res18's largest ``grad_z`` among its 3x3 layers."""


@dataclass(frozen=True)
class Point:
    """One case of one constant: ``params`` say what was run (a res18 layer and batch, or the
    synthetic sizes), ``on``/``off`` the fastest seconds with the path forced on and off, and
    ``off_again`` the off contender timed a second time in the same rounds (the A/A control),
    each the fastest over the passes; ``pass_ratios`` the on / off ratio of each pass alone."""

    constant: str
    params: dict
    on: float
    off: float
    off_again: float
    pass_ratios: list[float]

    @property
    def ratio(self) -> float:
        """``t_on / t_off``: below 1 the path is faster."""
        return self.on / self.off

    @property
    def aa_ratio(self) -> float:
        """``t_off_again / t_off``: 1 on a quiet machine."""
        return self.off_again / self.off

    @property
    def spread(self) -> float:
        """How far the passes' ratios lie apart (``max / min - 1``; 0 for one pass)."""
        return max(self.pass_ratios) / min(self.pass_ratios) - 1

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params.items())


@dataclass(frozen=True)
class Rule:
    """A constant (``module.name``) and where its path runs: ``quantity(params)`` compared with
    the constant by ``runs_on`` (``"<="``, ``">"`` or ``">="``), in ``unit``."""

    module: ModuleType
    name: str
    unit: str
    runs_on: str
    quantity: Callable[[dict], float]
    path: str

    @property
    def value(self) -> float:
        """The constant as the code has it now."""
        return getattr(self.module, self.name)

    def on(self, q: float, value: float | None = None) -> bool:
        """True when the rule, with the constant at ``value`` (default: as it is now), sends
        quantity ``q`` down the path."""
        c = self.value if value is None else value
        return {"<=": q <= c, ">": q > c, ">=": q >= c}[self.runs_on]


@contextmanager
def constant_set(module: ModuleType, name: str, value) -> Iterator[None]:
    """Within the block, ``module.name`` is ``value`` (restored on exit). A measuring knob: it
    edits the op's constant, so not for threads."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


# ------------------------------------------------------------------------ the quantities
_GRAPHS: dict[str, KNNMeta] = {}


def graph(layer: str) -> KNNMeta:
    """fovi 2.4.0's pinned graph of a res18 layer (loaded once)."""
    if not _GRAPHS:
        _GRAPHS.update(pinned_graphs())
    return _GRAPHS[layer]


def _columns(params: dict) -> float:
    return graph(params["layer"]).n_out * params["batch"]


def _grad_z_bytes(params: dict) -> float:
    meta = graph(params["layer"])
    return meta.in_channels * meta.v * meta.n_out * params["batch"] * 4


def _estimate(params: dict) -> float:
    meta = graph(params["layer"])
    pairs = occupied_cells.pair_count(occupied_cells.pairs(meta))
    return occupied_cells.estimate(meta, pairs, params["batch"])


RULES = {
    "FEW_SAMPLES": Rule(
        node_rows, "FEW_SAMPLES", "samples", "<=", lambda p: p["batch"], "node_rows"
    ),
    "FEW_COLUMNS": Rule(few_columns, "FEW_COLUMNS", "GEMM columns", "<=", _columns, "few_columns"),
    "WHOLE_BYTES": Rule(
        channel_blocks, "WHOLE_BYTES", "bytes", ">", _grad_z_bytes, "channel_blocks"
    ),
    "CELLS_AT_MOST": Rule(
        occupied_cells, "CELLS_AT_MOST", "estimate", "<=", _estimate, "occupied_cells"
    ),
    "HUB": Rule(segment_sum, "HUB", "terms", ">", lambda p: p["terms"], "tree"),
}
"""Every rule, by constant name (module docstring's table)."""

CASES: dict[str, list[dict]] = {
    "FEW_SAMPLES": [
        {"layer": layer, "batch": b}
        for layer in ("layer2.0.conv1", "layer3.0.conv2", "layer4.0.conv2")
        for b in (1, 2, 4, 6, 8, 16)
    ],
    "FEW_COLUMNS": [
        {"layer": layer, "batch": b}
        for layer in ("layer4.0.conv1", "layer4.0.conv2")
        for b in (4, 6, 8, 12, 16, 32)
    ],
    "WHOLE_BYTES": [{"layer": "layer1.0.conv1", "batch": b} for b in (16, 32, 40, 48, 64)],
    "CELLS_AT_MOST": [
        {"layer": layer, "batch": b}
        for layer, batches in (
            ("layer1.0.conv1", (16,)),
            ("layer2.0.conv2", (16, 64)),
            ("layer3.0.conv1", (16, 64)),
            ("layer3.0.conv2", (8, 16, 64)),
            ("layer4.0.conv1", (16, 64)),
            ("layer4.0.conv2", (16, 64)),
        )
        for b in batches
    ],
    "HUB": [
        {"terms": f, "hubs": 4, "rows": 256, "columns": 64}
        for f in (10, 12, 14, 16, 20, 24, 32, 64)
    ],
}
"""The cases each constant is timed on: both sides of today's value."""


# -------------------------------------------------------------------------- contenders
def _forced_pair(params: dict, path: str) -> tuple[Callable, Callable]:
    """Forward + backward of ``path`` forced, and of the textbook forced, on a res18 layer."""
    meta = graph(params["layer"])
    inputs = make_inputs(meta, meta.in_channels, params["batch"], torch.float32)
    return through(inputs, forced_ops(path)), through(inputs, forced_ops("textbook"))


def _hub_pair(params: dict) -> tuple[Callable, Callable]:
    """``segment_sum`` over ``rows`` rows of 1 to 9 terms (as res18's, round-summed either way)
    and ``hubs`` rows of ``terms`` terms, ``columns`` wide; the plan built with the hubs in a tree
    (``HUB`` below ``terms``) and in rounds (``HUB`` at ``terms``: the rounds grow to
    ``terms``)."""
    gen = torch.Generator().manual_seed(0)
    rows, hubs, terms = params["rows"], params["hubs"], params["terms"]
    counts = torch.cat([1 + torch.arange(rows) % 9, torch.full((hubs,), terms)])  # [D]
    dst = torch.arange(rows + hubs).repeat_interleave(counts)  # [E]
    values = torch.randn(rows, params["columns"], generator=gen)  # [L, P]
    src = torch.randint(0, rows, (dst.numel(),), generator=gen)  # [E]
    with constant_set(segment_sum, "HUB", terms - 1):
        tree = segment_sum.build_segment_sum_plan(dst, src, rows + hubs)
    with constant_set(segment_sum, "HUB", terms):
        rounds = segment_sum.build_segment_sum_plan(dst, src, rows + hubs)
    return (
        lambda: segment_sum.segment_sum(values, tree),
        lambda: segment_sum.segment_sum(values, rounds),
    )


def _pair(constant: str, params: dict) -> tuple[Callable, Callable]:
    """``(on, off)`` contenders of one case."""
    if constant == "HUB":
        return _hub_pair(params)
    return _forced_pair(params, RULES[constant].path)


def _block_rows_contenders() -> dict[int, Callable]:
    """Channel blocks forced at each candidate ``BLOCK_ROWS``, each on a graph of its own (its
    blocks are planned when derived, and cut again on every call)."""
    base = graph(BLOCK_ROWS_CASE["layer"])
    runs = {}
    for rows in BLOCK_ROWS_CANDIDATES:
        meta = KNNMeta.from_knn(
            base.knn.clone(), base.rf_index, n_in=base.n_in, in_channels=base.in_channels, v=base.v
        )
        inputs = make_inputs(meta, meta.in_channels, BLOCK_ROWS_CASE["batch"], torch.float32)
        run = through(inputs, forced_ops("channel_blocks"))

        def at(rows=rows, run=run):
            with constant_set(channel_blocks, "BLOCK_ROWS", rows):
                return run()

        at()  # derive its plans with its own block size
        runs[rows] = at
    return runs


# --------------------------------------------------------------------------- measuring
def _fastest(times: list[dict[str, float]]) -> dict[str, float]:
    """Per contender, the fastest of its times over several passes."""
    return {name: min(t[name] for t in times) for name in times[0]}


def measure(
    cases: dict[str, list[dict]] | None = None,
    rounds: int = ROUNDS,
    block_rows: bool = True,
    passes: int = PASSES,
) -> list[Point]:
    """Time every case of every rule (``cases`` defaults to :data:`CASES`) and, with
    ``block_rows``, the ``BLOCK_ROWS`` candidates (points of constant ``"BLOCK_ROWS"``, ``off``
    being today's value), ``passes`` times over, keeping each contender's fastest. Progress on
    stderr."""
    cases = CASES if cases is None else cases
    todo = [(constant, params) for constant, listed in cases.items() for params in listed]
    steps = (len(todo) + block_rows) * passes
    times: dict[int, list[dict[str, float]]] = {}
    step = 0
    for _ in range(passes):
        for i, (constant, params) in enumerate(todo):
            step += 1
            progress(step, steps, f"{constant} {params}")
            on, off = _pair(constant, params)
            contenders = {"on": on, "off": off, "off_again": off}
            times.setdefault(i, []).append(budget.fastest_times(contenders, rounds=rounds))
        if block_rows:
            step += 1
            progress(step, steps, "BLOCK_ROWS candidates")
            runs = _block_rows_contenders()
            contenders = {**runs, "again": runs[channel_blocks.BLOCK_ROWS]}
            times.setdefault(len(todo), []).append(budget.fastest_times(contenders, rounds=rounds))
    points = []
    for i, (constant, params) in enumerate(todo):
        best = _fastest(times[i])
        ratios = [t["on"] / t["off"] for t in times[i]]
        points.append(Point(constant, params, best["on"], best["off"], best["off_again"], ratios))
    if block_rows:
        best = _fastest(times[len(todo)])
        today = channel_blocks.BLOCK_ROWS
        for rows in BLOCK_ROWS_CANDIDATES:
            params = {**BLOCK_ROWS_CASE, "block_rows": rows}
            ratios = [t[rows] / t[today] for t in times[len(todo)]]
            points.append(
                Point("BLOCK_ROWS", params, best[rows], best[today], best["again"], ratios)
            )
    return points


def noise_band(points: list[Point]) -> float:
    """The constant's band: its largest A/A deviation, at least ``budget.MIN_BAND`` (cases of
    different layers are not neighbours, so no smoothing)."""
    return budget.noise_band(points, smooth=False)  # reads only aa_ratio


def verdicts(points: list[Point], band: float) -> list[str]:
    """Per point: ``"on"`` (the path faster beyond the band), ``"off"`` or ``"tie"``. A case
    whose ratio moved further than ``band`` between passes is judged within that spread (a ratio
    that moves that far from one pass to the next decides nothing)."""
    return [budget.faster_of(p.ratio, max(band, p.spread), ("on", "off")) for p in points]


def disagreements(
    constant: str, points: list[Point], value: float | None = None
) -> list[tuple[Point, str]]:
    """``(point, verdict)`` for every case ``RULES[constant]`` (with the constant at ``value``,
    default as it is now) sends down the path the measurement found slower beyond the band."""
    rule = RULES[constant]
    band = noise_band(points)
    wrong = []
    for p, verdict in zip(points, verdicts(points, band), strict=True):
        sent_on = rule.on(rule.quantity(p.params), value)
        if (verdict == "on" and not sent_on) or (verdict == "off" and sent_on):
            wrong.append((p, verdict))
    return wrong


def fewest_disagreements(constant: str, points: list[Point]) -> tuple[int, list[float]]:
    """The fewest cases any value of the constant leaves disagreeing, and the values that do
    (among the cases' quantities and +-inf: between two neighbouring quantities every value
    routes alike)."""
    rule = RULES[constant]
    candidates = sorted({rule.quantity(p.params) for p in points} | {-math.inf, math.inf})
    counts = {c: len(disagreements(constant, points, c)) for c in candidates}
    fewest = min(counts.values())
    return fewest, [c for c, n in counts.items() if n == fewest]


def agrees(constant: str, points: list[Point]) -> bool:
    """True when no value of the constant leaves fewer of ``points`` disagreeing than today's."""
    return len(disagreements(constant, points)) == fewest_disagreements(constant, points)[0]


def block_rows_disagreements(points: list[Point]) -> list[Point]:
    """The candidates faster than today's ``BLOCK_ROWS`` beyond the band, or beyond their
    ratio's spread between passes if wider (empty: it agrees). Raises ``ValueError`` when
    today's value was not among those timed."""
    times = {p.params["block_rows"]: p.on for p in points}
    today = channel_blocks.BLOCK_ROWS
    if today not in times:
        raise ValueError(f"BLOCK_ROWS = {today} was not timed (candidates {sorted(times)})")
    band = noise_band(points)
    return [
        p
        for p in points
        if budget.faster_of(p.on / times[today], max(band, p.spread), ("on", "off")) == "on"
    ]


# ------------------------------------------------------------------------------- record
def to_record(points: list[Point], **about) -> dict:
    """A JSON-ready record of the points and anything in ``about`` (device, threads, ...)."""
    return {"kind": "fovi_ref strategies sweep", **about, "points": [asdict(p) for p in points]}


def from_record(record: dict) -> dict[str, list[Point]]:
    """The inverse of :func:`to_record`: ``{constant: its points}``."""
    by_constant: dict[str, list[Point]] = {}
    for row in record["points"]:
        by_constant.setdefault(row["constant"], []).append(Point(**row))
    return by_constant


# ------------------------------------------------------------------------------- report
def _choice_table() -> list[str]:
    """``strategy_for`` on res18's distinct K > 1 graphs, batch 1 to 256, on a CPU."""
    batches = (1, 4, 8, 16, 64, 256)
    lines = [f"{'layer':15s}" + "".join(f"{f'B={b}':>16s}" for b in batches)]
    seen = set()
    for name, meta in pinned_graphs().items():
        key = (meta.k, meta.v, meta.n_out, meta.in_channels)
        if meta.k == 1 or key in seen:
            continue
        seen.add(key)
        row = "".join(f"{strategy_for(meta, b).strategy:>16s}" for b in batches)
        lines.append(f"{name:15s}{row}")
    return lines


def _rule_lines(constant: str, points: list[Point]) -> list[str]:
    """A rule's value, band, cases (quantity, ratio, verdict, where the rule sends it) and
    agreement."""
    rule = RULES[constant]
    band = noise_band(points)
    lines = [
        f"\n{constant} = {rule.value} {rule.unit}: {rule.path} where the quantity "
        f"{rule.runs_on} it (noise band {band:.0%})",
        f"  {'case':32s} {'quantity':>12s} {'on/off':>7s}  verdict  sent",
    ]
    for p, v in zip(points, verdicts(points, band), strict=True):
        q = rule.quantity(p.params)
        sent = "on" if rule.on(q) else "off"
        lines.append(f"  {p.label:32s} {q:12.4g} {p.ratio:7.2f}  {v:7s}  {sent}")
    wrong = len(disagreements(constant, points))
    fewest, values = fewest_disagreements(constant, points)
    best = ", ".join(f"{c:.4g}" for c in values)
    if set(verdicts(points, band)) == {"tie"}:
        lines.append("  agrees, undecided: every case ties within its noise")
    elif wrong == 0:
        lines.append("  agrees")
    elif wrong == fewest:
        lines.append(f"  agrees: {wrong} cases disagree at every value (fewest at {best})")
    else:
        lines.append(f"  DISAGREES at {wrong} cases; {fewest} at {best}")
    return lines


def _block_rows_lines(points: list[Point]) -> list[str]:
    """Each candidate's time over today's ``BLOCK_ROWS``, and agreement."""
    today = channel_blocks.BLOCK_ROWS
    times = {p.params["block_rows"]: p.on for p in points}
    lines = [f"\nBLOCK_ROWS = {today} rows (noise band {noise_band(points):.0%})"]
    for rows, seconds in times.items():
        lines.append(f"  block_rows={rows:<6d} time / today's {seconds / times[today]:.2f}")
    faster = block_rows_disagreements(points)
    lines.append("  agrees" if not faster else f"  DISAGREES: {len(faster)} candidates faster")
    return lines


def report(by_constant: dict[str, list[Point]]) -> list[str]:
    """Lines: per constant its value, band, cases and agreement."""
    lines = []
    for constant, points in by_constant.items():
        if constant == "BLOCK_ROWS":
            lines += _block_rows_lines(points)
        else:
            lines += _rule_lines(constant, points)
    return lines


def run(out: str = "results", rounds: int = ROUNDS) -> dict:
    """The job: print the choice table, measure, print the report, write
    ``OUT/bench_strategies.json``; returns the record."""
    print("strategy_for on a CPU, float32 (the routed general backend's choice):")
    print("\n".join(_choice_table()), flush=True)
    points = measure(rounds=rounds)
    about = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "rounds": rounds,
        "arithmetic": arithmetic_settings("cpu"),
    }
    record = to_record(points, **about)
    print("\n".join(report(from_record(record))))
    path = Path(out) / "bench_strategies.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {path}; to hold the constants to it, copy it to {RECORD_PATH}")
    return record
