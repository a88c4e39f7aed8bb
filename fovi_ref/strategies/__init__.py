"""The routed ``general`` backend: the textbook (:mod:`fovi_ref.knn_general`), or a faster
strategy for the same sums, chosen per call by :func:`choose_strategy`.

==================  =================================================  =======================
strategy            what changes                                       when (in words)
==================  =================================================  =======================
``textbook``        nothing: channel rows, one GEMM                    otherwise
``node_rows``       rows of one node ``[N, B*Cin]``, plans of one      few samples
                    channel (:mod:`~fovi_ref.strategies.node_rows`)
``few_columns``     the textbook's GEMMs arranged for few columns      few GEMM columns
                    ``Nout*B`` (:mod:`~fovi_ref.strategies.few_columns`) ``Nout*B`` (layer4)
``channel_blocks``  the input gradient a block of channels at a time   a CPU and a large
                    (:mod:`~fovi_ref.strategies.channel_blocks`)        ``grad_z``
``occupied_cells``  one GEMM per cell over the occupied (node, cell)   most cells empty, a
                    pairs (:mod:`~fovi_ref.strategies.occupied_cells`)  batch that pays, and
                                                                       GEMMs run wide
==================  =================================================  =======================

The choice is a pure function of the graph, the batch, the dtype and the device, and so is the
result: the same call always runs the same sums in the same order. Each strategy is held to the
textbook by ``tests/test_strategies.py``: bit for bit where its sums run in the same order (node
rows, channel blocks, few columns: their segment sums), by the elementwise error rule (every
quantity, every strategy). Every threshold is a named constant of its strategy's module, with
its unit; ``python -m fovi_ref bench --strategies`` times each strategy forced on and off on
both sides of its threshold, prints :func:`choose_strategy` for res18's layers, and writes a
record; ``tests/test_strategies.py`` fails when a constant disagrees with the stored one.

**16 bits.** Where a 16-bit call's GEMMs run wide (:mod:`fovi_ref.precision`), it runs the same
GEMMs on the same float32 ``grad_z`` as a float32 call, and gets float32's choice
(``tests/test_precision.py`` checks it on res18); the thresholds' record is float32's. Where they
run narrow, occupied cells is left out (its forward must run wide), and the other thresholds are
float32's, not yet measured on a machine with narrow GEMMs.

Derived data (:func:`derive`) holds the plans of the strategies a graph can reach, and no other.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

import fovi_ref.knn_general as textbook
from fovi_ref.meta import Derived, KNNMeta
from fovi_ref.precision import SIXTEEN_BIT, gemm_dtype
from fovi_ref.strategies import channel_blocks, few_columns, node_rows, occupied_cells

__all__ = [
    "STRATEGIES",
    "Choice",
    "GeneralOps",
    "choose_strategy",
    "derive",
    "forced_ops",
    "strategy_for",
]

NAME = "general"

STRATEGIES: dict[str, ModuleType] = {
    "textbook": textbook,
    "node_rows": node_rows,
    "few_columns": few_columns,
    "channel_blocks": channel_blocks,
    "occupied_cells": occupied_cells,
}
"""Every strategy by name. Each module has ``operand``, ``forward_with_operand``,
``grad_input`` and ``grad_weight_of_operand``, taking ``(meta, data, ...)`` with ``data`` the
graph's derived plans, and ``derive(meta)``, its own plans."""


@dataclass(frozen=True)
class Choice:
    """The strategy a call runs, and why."""

    strategy: str
    why: str


def choose_strategy(
    meta: KNNMeta,
    data: Derived,
    batch: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> Choice:
    """THE choice: the strategy ``batch`` samples of ``dtype`` over ``meta`` get on ``device``.
    ``data`` is the graph's derived data (:func:`derive`), for the pair count."""
    pairs = occupied_cells.pair_count(data)
    acc = gemm_dtype(device, dtype)  # the GEMMs' dtype, and so grad_z's
    wide = acc not in SIXTEEN_BIT  # float32 GEMMs (occupied cells' forward needs them)
    if wide and occupied_cells.applies(meta, data, batch):
        est = occupied_cells.estimate(meta, pairs, batch)
        why = f"estimate {est:.2f} <= CELLS_AT_MOST {occupied_cells.CELLS_AT_MOST}"
        return Choice("occupied_cells", why)
    if node_rows.applies(batch):
        return Choice("node_rows", f"batch {batch} <= FEW_SAMPLES {node_rows.FEW_SAMPLES}")
    if few_columns.applies(meta.n_out, batch):
        columns = meta.n_out * batch
        return Choice("few_columns", f"Nout*B {columns} <= FEW_COLUMNS {few_columns.FEW_COLUMNS}")
    if channel_blocks.applies(meta, batch, device, acc.itemsize):
        mib = meta.in_channels * meta.v * meta.n_out * batch * acc.itemsize / 2**20
        return Choice("channel_blocks", f"grad_z {mib:.1f} MiB > WHOLE_BYTES on a CPU")
    return Choice("textbook", "no strategy applies")


def strategy_for(
    meta: KNNMeta, batch: int, device: str | torch.device = "cpu", dtype=torch.float32
) -> Choice:
    """:func:`choose_strategy` for a graph alone (its data derived if new): what the routed
    backend runs for ``batch`` samples of ``dtype`` on ``device``."""
    data = meta.derived(NAME, derive)
    return choose_strategy(meta, data, batch, torch.device(device), dtype)


def derive(meta: KNNMeta) -> Derived:
    """The textbook's plans, node rows' (every graph has a batch of one), the occupied pairs,
    and the plans of channel blocks and occupied cells where the graph can reach them."""
    data = {**textbook.derive(meta), **node_rows.derive(meta), **occupied_cells.pairs(meta)}
    if occupied_cells.reachable(meta, data):
        data |= occupied_cells.derive(meta)
    if channel_blocks.reachable(meta):
        data |= channel_blocks.derive(meta)
    return data


class GeneralOps:
    """The routed ``general`` backend (the protocol of :mod:`fovi_ref.knn_autograd`): each call
    runs the strategy :func:`choose_strategy` names. Its forward and both gradients agree: the
    choice depends on the batch, the device and the dtype, which they share."""

    name = NAME
    derive = staticmethod(derive)
    forced: str | None = None  # set by forced_ops: one strategy whatever the choice

    @classmethod
    def _plan(cls, meta: KNNMeta, like: torch.Tensor) -> tuple[ModuleType, Derived]:
        data = meta.derived(cls.name, cls.derive)
        if cls.forced is not None:
            return STRATEGIES[cls.forced], data
        choice = choose_strategy(meta, data, like.shape[0], like.device, like.dtype)
        return STRATEGIES[choice.strategy], data

    @classmethod
    def grad_y_layout(cls, grad_y: torch.Tensor) -> torch.Tensor:
        """The textbook's ``[Cout, Nout, B]`` storage, or fovi's for node rows (which depends on
        the batch alone; occupied cells read either)."""
        if cls.forced is None:
            takes_node_rows = node_rows.applies(grad_y.shape[0])
        else:
            takes_node_rows = cls.forced == "node_rows"
        if takes_node_rows:
            return node_rows.grad_y_layout(grad_y)
        return textbook.grad_y_layout(grad_y)

    @classmethod
    def forward_with_operand(cls, meta, x, weight, bias):
        """``(y [B, Cout, Nout], operand)``: the chosen strategy's forward and what its weight
        gradient reads."""
        strategy, data = cls._plan(meta, x)
        return strategy.forward_with_operand(meta, data, x, weight, bias)

    @classmethod
    def forward(cls, meta, x, weight, bias):
        """``x [B, Cin, Nin] -> y [B, Cout, Nout]`` (fovi's layout)."""
        return cls.forward_with_operand(meta, x, weight, bias)[0]

    @classmethod
    def grad_input(cls, meta, grad_y, weight):
        """``grad_y [B, Cout, Nout] -> grad_x [B, Cin, Nin]``."""
        strategy, data = cls._plan(meta, grad_y)
        return strategy.grad_input(meta, data, grad_y, weight)

    @classmethod
    def grad_weight_of_operand(cls, meta, grad_y, operand):
        """``grad_weight [Cout, Cin*V]`` from the operand the forward kept."""
        strategy, data = cls._plan(meta, grad_y)
        return strategy.grad_weight_of_operand(meta, data, grad_y, operand)

    @classmethod
    def grad_weight(cls, meta, grad_y, x):
        """``grad_weight [Cout, Cin*V]`` from ``x [B, Cin, Nin]`` (the forward run again)."""
        strategy, data = cls._plan(meta, x)
        operand = strategy.operand(meta, data, x)
        return strategy.grad_weight_of_operand(meta, data, grad_y, operand)


def forced_ops(strategy: str) -> type[GeneralOps]:
    """``general`` with ``strategy`` forced on every call: a backend named
    ``general[strategy]``, for benches and for holding the strategy to the textbook."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")

    class Forced(GeneralOps):
        name = f"general[{strategy}]"
        forced = strategy

        @staticmethod
        def derive(meta: KNNMeta) -> Derived:
            """The textbook's plans, the occupied pairs, and the forced strategy's plans."""
            data = {**textbook.derive(meta), **occupied_cells.pairs(meta)}
            return data | STRATEGIES[strategy].derive(meta)

    return Forced
