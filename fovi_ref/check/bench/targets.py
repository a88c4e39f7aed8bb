"""Every target of the bench, as data: which ratio, at most how much, and which rows it holds.

A ratio is measured side by side (time or memory of one contender / another's, interleaved in one
process); a target holds the rows of one dtype (float32 unless it says bfloat16; float16 rows are
reported beside them, see :data:`LOW_PRECISION`).
``floor`` is the GEMM floor / fovi's einsum: the best any implementation that runs the layer's
three GEMMs can reach. On :data:`FLOOR_HELD`, where fovi's einsum is already close to that floor,
``general`` is held to the floor instead of to the einsum. The set is fixed by name, not by the
measured floor, so that noise never changes which target a row answers to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "ALL",
    "BOUNDARY",
    "FOVI",
    "HUB",
    "LAYERS",
    "LOW_PRECISION",
    "NETWORK",
    "SCALE",
    "SCALING",
    "TRUNK",
    "Target",
    "holding",
    "limit",
]


def _k1(row: dict) -> bool:
    return "gather_gemm / einsum (fovi)" in row  # a K = 1 row (gather_gemm's table)


FLOOR_HELD = ("layer3.0.conv1", "layer4.0.conv1")
"""The K > 1 layers held to the GEMM floor (their einsum took 1.4 to 2 times the floor)."""


def _floor_held(row: dict) -> bool:  # a K > 1 row of FLOOR_HELD (K = 1 rows are gather_gemm's)
    return not _k1(row) and any(name in FLOOR_HELD for name in row["layer"].split(", "))


def _einsum_held(row: dict) -> bool:  # any other K > 1 row
    return not _k1(row) and not _floor_held(row)


@dataclass(frozen=True)
class Target:
    """``ratio <= at_most`` on the rows of ``dtype`` that ``holds(row)`` selects; ``where`` says
    which, in words."""

    ratio: str
    at_most: float
    where: str = ""
    holds: Callable[[dict], bool] = field(default=lambda row: True, repr=False, compare=False)
    dtype: str = "float32"

    @property
    def name(self) -> str:
        """``ratio`` and ``where``, as the tables, ``bench.json`` and ``bench --help`` name it."""
        return f"{self.ratio}, {self.where}" if self.where else self.ratio


def _general(row: dict) -> bool:  # any K > 1 row
    return not _k1(row)


LAYERS = (
    Target("gather_gemm / conv2d floor", 1.0, holds=_k1),
    Target("gather_gemm / gemm floor", 2.0, "batch < 256", lambda r: _k1(r) and r["batch"] < 256),
    Target("gather_gemm / gemm floor", 1.6, "batch >= 256", lambda r: _k1(r) and r["batch"] >= 256),
    Target("general / einsum time", 0.7, "other K > 1 layers", _einsum_held),
    Target("general / gemm floor", 1.3, "layer3.0.conv1, layer4.0.conv1", _floor_held),
    Target("general / einsum peak memory", 1.0, holds=_general),
    Target("gather_gemm / einsum (fovi)", 0.8, "bfloat16", _k1, "bfloat16"),
    Target("general / einsum time", 0.8, "bfloat16", _general, "bfloat16"),
)
"""``python -m fovi_ref bench``: the res18 layers (:mod:`fovi_ref.check.bench.layers`). K = 1
against fovi's einsum in float32 has no target: both are one gather and one GEMM, and the ratio
crossed any target worth setting from run to run on the same code; the Conv2d floor is the K = 1
target, as the design note claims."""

TRUNK = (
    Target("routed / einsum (fovi), summed over the layers", 0.45),
    Target("routed / einsum (fovi), summed over the layers", 0.5, "bfloat16", dtype="bfloat16"),
    Target("routed bfloat16 / routed float32, summed over the layers", 0.5, dtype="bfloat16"),
)
"""``python -m fovi_ref bench`` with every layer: the layers' median times added up (K > 1
layers at ``--batch-general``, K = 1 layers at the same batch), fovi_ref's routed backends
against fovi's einsum, and fovi_ref's own bfloat16 time against its float32 time."""

BOUNDARY = Target("knn_conv / plain torch", 1.5, "K = 1 tiny graph")
"""``bench --boundary``: forward + backward through knn_conv / the same arithmetic in torch."""
SCALE = Target("100 distinct graphs / one shared graph", 1.2, "step time")
"""``bench --boundary``: a stack of 100 layers on distinct graphs / on one shared graph."""
NETWORK = {
    batch: Target("routed / all-einsum trunk", at_most, f"batch {batch}")
    for batch, at_most in ((16, 0.5), (64, 0.4))
}
"""``bench --network resnet18``: the whole trunk's step time, per batch."""
SCALING = Target("routed / fovi einsum", 1.0, "every graph, batch 1 to 16")
"""``bench --batch-scaling``."""
FOVI = Target("fovi_ref / fastest fovi 2.4.0 backend", 0.8, "every layer")
"""``bench --fovi``: fovi_ref's routed backend / the fastest fovi contender."""
HUB = Target("general / fovi einsum", 1.3, "hub graphs, every fan-out")
"""``bench --hub``: ``general`` on graphs where many outputs read one input (fan-out ``F``)."""

ALL = (*LAYERS, *TRUNK, BOUNDARY, SCALE, *NETWORK.values(), SCALING, FOVI, HUB)
"""Every target, in the order ``bench --help`` lists them."""


LOW_PRECISION = """\
bfloat16 rows are held to their own targets (/einsum <= 0.8 on every layer, and summed over the
layers); float16 rows to none: on a CPU without a native float16 GEMM both fovi_ref (which then
runs float32 GEMMs, fovi_ref.precision) and fovi's einsum (emulated float16 GEMMs) are timed
mostly in conversions and emulation, not in what the backends do."""
"""Printed under every table that has 16-bit rows: which targets hold them and why."""


def limit(name: str) -> float:
    """``at_most`` of the target named ``name`` (:attr:`Target.name`)."""
    (target,) = [t for t in (*LAYERS, *TRUNK) if t.name == name]
    return target.at_most


def holding(row: dict) -> list[Target]:
    """The :data:`LAYERS` targets that hold ``row``: of its dtype, and selecting it."""
    return [t for t in LAYERS if t.dtype == row["dtype"] and t.holds(row)]
