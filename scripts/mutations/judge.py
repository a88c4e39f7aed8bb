"""The mutation job's judge: the default battery on every backend a mutated file can reach.

``mutmut`` (the backends' job, ``scripts/mutations/run.py``) runs these tests on each mutant, those
whose backend calls the mutated function (its coverage stats, ``mutmut-stats.json``, say which).
One of them judges: the mutated file's own backend (:data:`HOME`), or the first in :data:`JUDGED`
that calls the function; the others skip. It runs :func:`~fovi_ref.check.check_ops.check_ops` with
the default graphs and ``stop_at_first_fail``, so that a killed mutant costs seconds and a
surviving one a single battery, not one per backend that calls it. A strategy is judged with it
forced (:func:`~fovi_ref.strategies.forced_ops`): the routed ``general`` may never choose it on the
battery's graphs. Paths this CPU never takes are judged too, forced, after the one it takes
(:func:`_paths`): 16-bit GEMMs run narrow, and ``gather_gemm``'s dense ``S``.

A mutant of the doors' forward and backward rules (``fovi_ref.knn_autograd``) that its judge's
battery passes is also run through every other backend's ``doors`` check: those rules serve
every backend, and not every backend takes the same branch of them.

``einsum_baseline`` is fovi's arithmetic and has documented departures
(:mod:`fovi_ref.check.tolerances`, "Non-finite values"): an inf in ``x`` turns the other cells
of its channel into nan in ``grad_weight`` where ``V > 1``, a float16 cell or ``grad_z`` past
65504 is stored as inf, and on a CPU with native bfloat16 GEMMs an inf in ``x`` reaches ``y``
of another node as nan in bfloat16 (its ``F.linear`` reads past each row). Its ``nonfinite`` and
``rounding``
checks run to the end, and a mutant of it is killed by any failed row but those.

With ``MUTATION_BATTERY=full`` in the environment the judge runs the ``--full`` battery's
other graphs instead (the random graphs and res18's layers of each kind): the job's second
stage asks it for the mutants the default battery passes.

The test that kills a mutant writes which graph, dtype, check and quantity failed first to
``judge_verdicts/<mutant>.json`` (under ``mutants/``, where mutmut runs), for the record.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from fovi_ref import DTYPES as NAMED_DTYPES
from fovi_ref.check.check_ops import (
    CHECKS,
    DEFAULT,
    F16_PAST_MAX_NOTE,
    FULL,
    GRAD_Z_PAST_MAX_NOTE,
    ReportRow,
    check_ops,
    resolve_graphs,
)
from fovi_ref.check.switches import forced, forced_grad_input_path
from fovi_ref.precision import SIXTEEN_BIT, platform
from fovi_ref.strategies import STRATEGIES, forced_ops

# Every registered built-in backend: general_textbook is the textbook module's own door
# (GeneralTextbookOps), which general[textbook] (the routed op, textbook forced) never calls.
BACKENDS = ["general", "gather_gemm", "einsum_baseline", "general_textbook"]
JUDGED = BACKENDS + [f"general[{strategy}]" for strategy in STRATEGIES]
VERDICTS = Path("judge_verdicts")
# The backend that judges a mutant of each module, where it calls the mutated function.
HOME = {
    "fovi_ref.knn_general": "general[textbook]",
    "fovi_ref.segment_sum": "general[textbook]",
    "fovi_ref.layout": "general[textbook]",
    "fovi_ref.precision": "general[textbook]",
    "fovi_ref.knn_gather_gemm": "gather_gemm",
    "fovi_ref.knn_einsum_baseline": "einsum_baseline",
    "fovi_ref.knn_autograd": "general",
    "fovi_ref.strategies": "general",
    **{f"fovi_ref.strategies.{s}": f"general[{s}]" for s in STRATEGIES if s != "textbook"},
}
DTYPES = tuple(NAMED_DTYPES.values())
GRAPHS = {"default": DEFAULT, "full": tuple(g for g in FULL if g not in DEFAULT)}


def ops_of(judged: str):
    """The registered backend, or ``general`` with the strategy in brackets forced."""
    if judged in BACKENDS:
        return judged
    return forced_ops(judged.removeprefix("general[").removesuffix("]"))


def judge_of(mutant: str) -> str | None:
    """The judged backend that judges ``mutant`` (``None``: no judged backend calls it)."""
    function = mutant.rpartition("__mutmut_")[0]
    stats = json.loads(Path("mutmut-stats.json").read_text())
    calling = {
        test.partition("[")[2].removesuffix("]")
        for test in stats["tests_by_mangled_function_name"].get(function, [])
    }
    module = function.rpartition(".")[0]
    order = [HOME[module], *JUDGED] if module in HOME else JUDGED
    return next((judged for judged in order if judged in calling), None)


def _record(judged: str, row) -> None:
    """The first failed row, stored under the mutant's name (nothing outside a mutant run)."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" not in mutant:
        return
    verdict = {
        "backend": judged,
        "graph": row.graph,
        "dtype": row.dtype,
        "check": row.check,
        "quantity": row.quantity,
        "note": row.note[:200],
    }
    VERDICTS.mkdir(exist_ok=True)
    (VERDICTS / f"{mutant}.json").write_text(json.dumps(verdict))


def _baseline_failures(report, graphs) -> list:
    """The failed rows of ``einsum_baseline``'s report but its documented departures."""
    cells = {graph.name: graph.meta.v for graph in resolve_graphs(graphs)}

    over_reads = platform("cpu") == "cpu_bf16"  # its bfloat16 GEMM reads past each row

    def departs(row) -> bool:
        if row.check == "nonfinite":
            if row.quantity == "y":
                return over_reads and row.dtype == "bfloat16"
            return row.quantity == "grad_weight" and cells[row.graph] > 1
        past_max = (F16_PAST_MAX_NOTE, GRAD_Z_PAST_MAX_NOTE)
        return row.check == "rounding" and row.note.endswith(past_max)

    return [row for row in report.failures if not departs(row)]


def _failures(judged: str, ops, graphs, dtypes=DTYPES) -> tuple[object, list]:
    """``(report, the failed rows that kill)`` of the battery on ``graphs`` in ``dtypes``."""
    if judged != "einsum_baseline":
        report = check_ops(ops, graphs=graphs, dtypes=dtypes, stop_at_first_fail=True)
        return report, report.failures
    departing = ["rounding", "nonfinite"]  # run to the end: their departures fail rows
    others = [check for check in CHECKS if check not in departing]
    report = check_ops(ops, graphs=graphs, dtypes=dtypes, checks=others, stop_at_first_fail=True)
    if report.ok:
        report = check_ops(ops, graphs=graphs, dtypes=dtypes, checks=departing)
    return report, _baseline_failures(report, graphs)


PATHS = ("[narrow]", "[dense S]")
"""The suffixes of the paths :func:`_paths` forces, as a verdict's ``backend`` names them."""


def _paths(judged: str) -> list[tuple[str, object, tuple]]:
    """``(name, knob, dtypes)`` of each path the judge runs: the one this CPU takes, then the
    ones it never takes, forced: 16-bit GEMMs run narrow (CUDA's and an AVX512-BF16 CPU's,
    :mod:`fovi_ref.precision`), and for ``gather_gemm`` the dense ``S`` of ``grad_input`` (the
    CUDA path: ``DENSE_S_BUDGET["cpu"]`` is 0)."""
    paths = [(judged, contextlib.nullcontext(), DTYPES)]
    if judged != "einsum_baseline":  # fovi's arithmetic: no GEMM dtype of its own to choose
        paths.append((judged + PATHS[0], forced("narrow"), SIXTEEN_BIT))
    if judged == "gather_gemm":
        paths.append((judged + PATHS[1], forced_grad_input_path("dense"), DTYPES))
    return paths


DOORS = "[doors]"
"""The suffix of a verdict's ``backend`` where another backend's doors check killed it."""
DOORS_MODULE = "fovi_ref.knn_autograd."
"""The doors' module: its forward and backward rules serve every backend, and some backends
take branches of them that others do not (einsum_baseline has no ``grad_y_layout``)."""


@pytest.mark.parametrize("judged", JUDGED)
def test_default_battery(judged):
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" in mutant:  # MUTATION_JUDGE: the record's judge, where no stats exist (CI)
        judge = os.environ.get("MUTATION_JUDGE") or judge_of(mutant)
        if judge != judged:
            pytest.skip(f"{mutant} is judged by {judge}")
    torch.set_num_threads(1)  # two mutants run at once on 2 cores
    graphs = GRAPHS[os.environ.get("MUTATION_BATTERY", "default")]
    for path, knob, dtypes in _paths(judged):
        try:
            ops = ops_of(judged)  # in the try: a mutant of forced_ops may raise here
            with knob:
                report, failures = _failures(judged, ops, graphs, dtypes)
        except Exception as err:  # raised outside the ops' calls (forced_ops, derive): a kill
            row = ReportRow("-", "-", "battery", "-", False, note=f"raised {err!r}")
            _record(path, row)
            raise
        if failures:
            _record(path, failures[0])
        assert not failures, report.table(failures[:1])
    if mutant.startswith(DOORS_MODULE):
        _judge_doors(judged, graphs)


def _judge_doors(judged: str, graphs) -> None:
    """The ``doors`` check of every other backend, after ``judged``'s whole battery passed a
    mutant of the doors' module."""
    for other in BACKENDS:
        if other == judged:
            continue
        report = check_ops(other, graphs=graphs, checks=["doors"], stop_at_first_fail=True)
        if report.failures:
            _record(other + DOORS, report.failures[0])
        assert not report.failures, report.table(report.failures[:1])
