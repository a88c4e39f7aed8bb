"""Plant known bugs in a backend and show that the checks catch every one of them.

    python scripts/mutations/planted_bugs.py [--backend general|gather_gemm|einsum_baseline|all]
                                     [--no-properties] [--graphs spanning random ...]

Each mutation wraps a registered backend at the ops level (its ``forward``, ``grad_input`` and
``grad_weight`` are called with a doctored graph, or their results are doctored), so it works
whatever the backend's internals are. Each mutant then runs through

- :func:`fovi_ref.check.check_ops.check_ops`, the default battery (the spanning graphs of
  :mod:`fovi_ref.check.graphs`) unless ``--graphs`` says otherwise, in four dtypes; a check
  *catches* the mutation when it fails for the mutant and passes for the clean backend on the same
  graph, dtype and quantity (so a failure the clean backend already has does not count);
- the property tests of tests/test_properties.py, with the mutant registered as a backend.

The table says, for every mutation, whether it was caught and by which checks. The script exits
non-zero if a mutation that applies to the backend went uncaught.

**Beside the mutation tool** (``make mutations``, scripts/mutations/run.py). mutmut changes one
token or argument at a time, so it cannot write most of these classes, which stay here as named
cases: a bug only at a scale (``off_past_64_nodes``, ``wrong_past_batch_3``/``_4``,
``dropped_past_k_9``, ``off_past_16_cells``, ``hub_grad_x_off``, ``last_input_grad_x_zeroed``,
``bf16_grad_x_zeroed``/``_flipped``, ``grad_weight_off_past_batch_64``, ``off_at_one_channel``),
in one door only (``plain_forward_wrong``, ``grad_weight_from_x_wrong``), in a calling convention
(``noncontiguous_x``/``_weight``/``_bias``, ``bias_none``, ``float32_output``) and in precision
(``accumulate_in_dtype``, ``cells_summed_in_dtype``). ``wrong_cell`` stays too: every mutant of
``general``'s cell arithmetic makes a row that is negative or out of range, so it raises, and
none reads a valid but wrong cell.

The quiet graph-level classes the record does hold are retired from this list: :data:`RETIRED`
names, for each, a mutant of the record that makes the same kind of wrong value (no exception)
and that the oracle kills (tests/test_mutations.py holds the record to that).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import fovi_ref.knn_general as textbook
from fovi_ref import KNNMeta, get_ops, register_ops, unregister_ops
from fovi_ref.check.check_ops import CHECKS, DEFAULT, check_ops

ROOT = Path(__file__).resolve().parents[2]
CHECK_ORDER = list(CHECKS)


# ------------------------------------------------------------------------ doctored graphs
def _rebuild(meta: KNNMeta, knn: torch.Tensor, rf_index: torch.Tensor) -> KNNMeta:
    return KNNMeta.from_knn(knn, rf_index, n_in=meta.n_in, in_channels=meta.in_channels, v=meta.v)


def _busiest_entry(meta: KNNMeta) -> tuple[int, int]:
    """``(k, n)`` of the first real neighbour of the node with the most real neighbours."""
    real = ~meta.pad_mask  # [K, Nout]
    node = int(real.sum(dim=0).argmax())
    return int(real[:, node].nonzero()[0]), node


def wrong_cell(meta: KNNMeta) -> KNNMeta | None:
    """One node's neighbour is read through the next cell."""
    if meta.v == 1 or not bool((~meta.pad_mask).any()):
        return None
    k, n = _busiest_entry(meta)
    rf_index = meta.rf_index.clone()
    rf_index[n, k] = (rf_index[n, k] + 1) % meta.v
    return _rebuild(meta, meta.knn, rf_index)


def only_slot(meta: KNNMeta, k: int) -> KNNMeta:
    """The graph with every neighbour slot but ``k`` turned into padding."""
    keep = torch.zeros_like(meta.pad_mask)
    keep[k] = True
    return _rebuild(meta, meta.knn.masked_fill(~keep, meta.n_in), meta.rf_index)


# ------------------------------------------------------------------------------- mutants
def past_slot_9(meta: KNNMeta) -> KNNMeta | None:
    """Neighbours ``k >= 9`` dropped (a kernel that unrolls nine slots)."""
    if meta.k <= 9:
        return None
    knn = meta.knn.clone()
    knn[9:] = meta.n_in
    return _rebuild(meta, knn, meta.rf_index)


def fan_out(meta: KNNMeta) -> torch.Tensor:
    """``[Nin]`` how many real neighbour entries read each input."""
    return torch.bincount(meta.knn[~meta.pad_mask], minlength=meta.n_in)


HUB_READERS = 16  # fovi_ref's HUB: inputs read more often are hubs
MANY_READERS = 150  # where the 16-bit bound went vacuous before


LOW = (torch.float16, torch.bfloat16)


def cells_summed_in_dtype(meta: KNNMeta, x: torch.Tensor) -> torch.Tensor:
    """The textbook's binned cells ``z_rows [Nout*B, Cin*V]``, but each cell adds its neighbours
    one at a time in ``x``'s dtype, one rounding per added neighbour (slot ``k`` alone puts at
    most one neighbour in a cell, so its binning is an exact copy)."""
    z = None
    for k in range(meta.k):
        slot = only_slot(meta, k)
        data = slot.derived(textbook.NAME, textbook.derive)
        z_k = textbook.bin_neighbours(slot, data, x).to(x.dtype)  # [Cin*V, Nout*B], exact
        z = z_k if z is None else z + z_k  # rounded in x's dtype
    return z.t()


def forward_with_cells_summed_in_dtype(meta, x, weight, bias):
    """``(y, z_rows)`` of the textbook's forward on :func:`cells_summed_in_dtype` (its GEMM in
    float32, so that the cell sums are the one bug)."""
    z_rows = cells_summed_in_dtype(meta, x).float()
    return textbook.linear_to_fovi(meta, z_rows, weight, bias, x), z_rows


class Mutant:
    """A backend with one planted bug; ``applied`` says whether any call was changed by it."""

    def __init__(self, inner, kind: str, description: str):
        self.inner, self.kind, self.description = inner, kind, description
        self.name = f"mutant_{kind}"
        self.applied = False
        self._metas: dict[tuple[int, str], tuple[KNNMeta, KNNMeta | None]] = {}
        if hasattr(inner, "supports"):
            self.supports = inner.supports
        if kind in ("plain_forward_wrong", "grad_weight_from_x_wrong"):  # the pair right
            self.forward_with_operand = inner.forward_with_operand
            self.grad_weight_of_operand = inner.grad_weight_of_operand
        if kind == "cells_summed_in_dtype":  # the pair wrong too, with the cells it kept
            self.forward_with_operand = self._forward_with_operand
            self.grad_weight_of_operand = self._grad_weight_of_operand

    def _forward_with_operand(self, meta, x, weight, bias):
        if x.dtype in LOW and meta.k > 1:
            self.applied = True
            return forward_with_cells_summed_in_dtype(meta, x, weight, bias)
        return textbook.GeneralTextbookOps.forward_with_operand(meta, x, weight, bias)

    def _grad_weight_of_operand(self, meta, grad_y, z_rows):
        return textbook.GeneralTextbookOps.grad_weight_of_operand(meta, grad_y, z_rows)

    def _doctored(self, meta: KNNMeta, how: Callable[[KNNMeta], KNNMeta | None]) -> KNNMeta:
        """``how(meta)`` (cached; the entry holds ``meta`` so its id is not reused), or
        ``meta`` itself where the mutation does not apply to this graph."""
        key = (id(meta), how.__name__)
        if key not in self._metas:
            self._metas[key] = (meta, how(meta))
        doctored = self._metas[key][1]
        if doctored is None:
            return meta
        self.applied = True
        return doctored

    # The graph-level bugs reach all three functions, so forward and backward agree with each
    # other (gradcheck cannot see them) and only the oracle can.
    def _graph(self, meta: KNNMeta) -> KNNMeta:
        graph_bugs = {
            "wrong_cell": wrong_cell,
            "dropped_past_k_9": past_slot_9,
        }
        how = graph_bugs.get(self.kind)
        return meta if how is None else self._doctored(meta, how)

    def forward(self, meta, x, weight, bias):
        if self.kind == "cells_summed_in_dtype" and x.dtype in LOW and meta.k > 1:
            self.applied = True
            y, _ = forward_with_cells_summed_in_dtype(meta, x, weight, bias)
            return y
        if self.kind == "noncontiguous_x" and not x.is_contiguous():
            self.applied = True  # reads x's storage as if it were [B, Cin, Nin] contiguous
            x = x.transpose(1, 2).contiguous().view(x.shape)
        if self.kind == "bias_none" and bias is None:
            self.applied = True  # a missing bias read as ones
            bias = weight.new_ones(weight.shape[0])
        if self.kind == "noncontiguous_weight" and not weight.is_contiguous():
            self.applied = True  # reads a transposed weight's storage as if contiguous
            weight = weight.t().contiguous().view(weight.shape)
        if self.kind == "noncontiguous_bias" and bias is not None and not bias.is_contiguous():
            self.applied = True  # reads a strided bias's storage as if contiguous
            bias = torch.as_strided(bias, bias.shape, (1,))
        if self.kind == "float32_output" and x.dtype in (torch.float16, torch.bfloat16):
            self.applied = True
            b = None if bias is None else bias.float()
            return self.inner.forward(meta, x.float(), weight.float(), b)
        if self.kind == "wrong_past_batch_3" and x.shape[0] > 3:
            self.applied = True  # samples past the third get the third's output
            y = self.inner.forward(meta, x, weight, bias).clone()
            y[3:] = y[2:3]
            return y
        if self.kind == "accumulate_in_dtype" and meta.k > 1:
            self.applied = True
            y = self.inner.forward(only_slot(meta, 0), x, weight, bias)
            for k in range(1, meta.k):  # each slot's partial result added in the storage dtype
                y = y + self.inner.forward(only_slot(meta, k), x, weight, None)
            return y
        if self.kind == "wrong_past_batch_4" and x.shape[0] > 4:
            self.applied = True  # samples past the fourth get the fourth's output
            y = self.inner.forward(meta, x, weight, bias).clone()
            y[4:] = y[3:4]
            return y
        y = self.inner.forward(self._graph(meta), x, weight, bias)
        wrong_here = {
            "off_past_64_nodes": meta.n_out > 64,
            "off_past_16_cells": meta.v > 16,
            "off_at_one_channel": meta.in_channels == 1,
            "plain_forward_wrong": True,
        }
        if wrong_here.get(self.kind):
            self.applied = True
            y = y * 1.01
        return y

    def grad_input(self, meta, grad_y, weight):
        grad_x = self.inner.grad_input(self._graph(meta), grad_y, weight)
        if self.kind == "last_input_grad_x_zeroed":
            self.applied = True
            grad_x = grad_x.clone()
            grad_x[:, :, -1] = 0
        readers = fan_out(meta)  # [Nin]
        if self.kind == "hub_grad_x_off" and bool((readers > HUB_READERS).any()):
            self.applied = True
            grad_x = grad_x * torch.where(readers > HUB_READERS, 1.01, 1.0).to(grad_x)
        many = (readers >= MANY_READERS) & (grad_y.dtype == torch.bfloat16)
        if self.kind in ("bf16_grad_x_zeroed", "bf16_grad_x_flipped") and bool(many.any()):
            self.applied = True
            factor = 0.0 if self.kind == "bf16_grad_x_zeroed" else -1.0
            grad_x = grad_x * torch.where(many, factor, 1.0).to(grad_x)
        return grad_x

    def grad_weight(self, meta, grad_y, x):
        if self.kind == "cells_summed_in_dtype" and x.dtype in LOW and meta.k > 1:
            self.applied = True
            z_rows = cells_summed_in_dtype(meta, x).float()  # [Nout*B, Cin*V]
            data = meta.derived(textbook.NAME, textbook.derive)
            return textbook.grad_weight_of_operand(meta, data, grad_y, z_rows)
        grad_w = self.inner.grad_weight(self._graph(meta), grad_y, x)
        off = {
            "grad_weight_off_past_batch_64": x.shape[0] > 64,
            "grad_weight_from_x_wrong": True,  # the compiled door's; the eager one's is right
        }
        if off.get(self.kind):
            self.applied = True
            grad_w = grad_w * 1.01
        return grad_w


MUTATIONS = {
    "wrong_cell": "one node reads a neighbour through the wrong cell",
    "accumulate_in_dtype": "y sums its K slots in the storage dtype",
    "noncontiguous_x": "a non-contiguous x is read as if contiguous",
    "bias_none": "bias=None is read as a bias of ones",
    "noncontiguous_weight": "a transposed weight is read as if contiguous",
    "noncontiguous_bias": "a strided bias is read as if contiguous",
    "float32_output": "y comes back float32 for float16/bfloat16 inputs",
    "wrong_past_batch_3": "samples past the third get the third's output",
    "wrong_past_batch_4": "samples past the fourth get the fourth's output (batch >= 5)",
    "off_past_64_nodes": "y off by 1% where Nout > 64",
    "off_at_one_channel": "y off by 1% where Cin == 1",
    "plain_forward_wrong": "the plain forward off by 1%, forward_with_operand right",
    "dropped_past_k_9": "neighbours k >= 9 dropped",
    "hub_grad_x_off": "grad_x off by 1% on inputs more than 16 outputs read",
    "last_input_grad_x_zeroed": "grad_x of the last input zeroed",
    "bf16_grad_x_zeroed": "bfloat16 grad_x zeroed on inputs 150 or more outputs read",
    "bf16_grad_x_flipped": "bfloat16 grad_x sign-flipped on inputs 150 or more outputs read",
    "off_past_16_cells": "y off by 1% where V > 16",
    "grad_weight_off_past_batch_64": "grad_weight off by 1% past batch 64",
    "grad_weight_from_x_wrong": "grad_weight from x off by 1% (the operand pair right)",
    "cells_summed_in_dtype": "16-bit cells summed in their dtype, a rounding per neighbour",
}


RETIRED = {
    "dropped_neighbour": (
        "fovi_ref.segment_sum.x_build_segment_sum_plan__mutmut_43",
        "the second term of every row is never added: each node loses a neighbour",
    ),
    "padding_reads_input_0": (
        "fovi_ref.knn_gather_gemm.x__gathered_rows__mutmut_21",
        "padding neighbours read ones instead of exact zeros",
    ),
    "bias_twice": (
        "fovi_ref.layout.x_linear_rows__mutmut_19",
        "a given bias is dropped: y is off by exactly the bias",
    ),
    "grad_x_rolled": (
        "fovi_ref.knn_gather_gemm.x__grad_y_columns__mutmut_10",
        "grad_y is read in another order: each input gets another output's gradient",
    ),
    "gradient_moved": (
        "fovi_ref.segment_sum.x_build_segment_sum_plan__mutmut_82",
        "a hub's later terms land in the previous hub's slots: their sum goes to another input",
    ),
}
"""The planted classes retired for a mutant of the record: ``class -> (mutant, what it does)``.
Each mutant is killed by the oracle with a wrong value, not an exception."""


# ------------------------------------------------------------------------------ checking
def _failing(report) -> set[tuple[str, str, str, str]]:
    return {(r.graph, r.dtype, r.check, r.quantity) for r in report.failures}


def run_properties(mutant: Mutant) -> tuple[set[str], int]:
    """Run tests/test_properties.py on the registered mutant: ``(failed test names, ran)``."""
    import pytest

    class Collect:
        def __init__(self):
            self.failed, self.ran = set(), 0

        def pytest_runtest_logreport(self, report):
            if report.when == "call":
                self.ran += 1
                if report.failed:
                    self.failed.add(report.nodeid.split("::")[1])  # test_name[params]

    collect = Collect()
    # The test module reads the registry when it is collected: import it afresh for each mutant.
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", "") or "").startswith(str(ROOT / "tests")):
            del sys.modules[name]
    args = [
        str(ROOT / "tests" / "test_properties.py"),
        "-q",
        "-k",
        mutant.name,
        "-p",
        "no:cacheprovider",
    ]
    args += ["--no-header", "-o", "addopts=", "--tb=no", "--capture=sys", "-W", "ignore"]
    with contextlib.redirect_stdout(io.StringIO()):  # the table below says what matters
        pytest.main(args, plugins=[collect])
    return collect.failed, collect.ran


def check_backend(backend: str, graphs, properties: bool) -> list[dict]:
    inner = get_ops(backend)
    clean = _failing(check_ops(inner, graphs=graphs))
    rows = []
    for kind, description in MUTATIONS.items():
        mutant = Mutant(inner, kind, description)
        failing = _failing(check_ops(mutant, graphs=graphs)) - clean
        by = sorted({f"{check}:{quantity}" for _, _, check, quantity in failing})
        dtypes = sorted({dtype for _, dtype, _, _ in failing})
        prop_failed, prop_ran = set(), 0
        if properties and mutant.applied:
            register_ops(mutant)
            try:
                prop_failed, prop_ran = run_properties(mutant)
            finally:
                unregister_ops(mutant.name)
        rows.append(
            dict(
                backend=backend,
                mutation=kind,
                description=description,
                applied=mutant.applied,
                caught=bool(failing) or bool(prop_failed),
                by=by,
                dtypes=dtypes,
                properties=sorted(prop_failed),
                properties_ran=prop_ran,
            )
        )
    return rows


def print_table(rows: list[dict]) -> None:
    """Mutation, caught, and which checks (and quantities, dtypes) caught it."""
    wide = max(map(len, MUTATIONS)) + 2  # the mutation column: its longest name and a gap
    print(f"{'backend':<16}{'mutation':<{wide}}{'caught':<8}by")
    for r in rows:
        caught = "n/a" if not r["applied"] else ("yes" if r["caught"] else "NO")
        checks = sorted({b.split(":")[0] for b in r["by"]}, key=CHECK_ORDER.index)
        quantities = sorted({b.split(":")[1] for b in r["by"]} - {"all"})
        lines = [f"check_ops: {', '.join(checks) or '-'}"]
        if quantities:
            lines.append(f"  on {', '.join(quantities)}")
        if r["dtypes"]:
            lines.append(f"  in {', '.join(r['dtypes'])}")
        if r["properties_ran"]:
            names = sorted({p.split("[")[0] for p in r["properties"]})
            lines.append(f"properties: {len(r['properties'])} of {r['properties_ran']} failed")
            lines += [f"  {name}" for name in names]
        print(f"{r['backend']:<16}{r['mutation']:<{wide}}{caught:<8}{lines[0]}")
        for line in lines[1:]:
            print(f"{'':<{16 + wide + 8}}{line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="general", help="a backend name, or 'all'")
    parser.add_argument("--graphs", nargs="*", default=list(DEFAULT), help="default: spanning")
    parser.add_argument("--no-properties", action="store_true", help="check_ops only")
    args = parser.parse_args(argv)
    backends = (
        ["general", "gather_gemm", "einsum_baseline"] if args.backend == "all" else [args.backend]
    )
    rows = []
    for backend in backends:
        rows += check_backend(backend, args.graphs, not args.no_properties)
    print()
    print_table(rows)
    missed = [r for r in rows if r["applied"] and not r["caught"]]
    print(
        f"\n{sum(r['caught'] for r in rows)} caught, {len(missed)} missed, "
        f"{sum(not r['applied'] for r in rows)} not applicable"
    )
    print("\nretired: the mutation record kills these classes (scripts/mutations/record.json)")
    for kind, (mutant, what) in RETIRED.items():
        print(f"  {kind:<{max(map(len, RETIRED)) + 2}}{mutant}: {what}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
