"""The dense-``S`` budget of ``gather_gemm``'s input gradient, derived from a measured sweep.

``grad_input`` of the K = V = 1 backend reaches ``grad_x`` by one of two paths with the same
result (:mod:`fovi_ref.knn_gather_gemm`): a GEMM with the dense one-hot scatter matrix ``S
[Nout, Nin]`` ("dense"), or a zero-fill and ``index_add_`` ("index"). ``DENSE_S_BUDGET[device]``
picks the dense path for graphs with ``Nout*Nin <= budget``. Notebook 03
(notebooks/03_scatter_matrix_budget.ipynb) times both paths with :func:`fastest_times` over
graphs of growing ``Nout*Nin``, and times the index path a second time: the two index timings run
the same code, so their ratio (an *A/A* ratio) shows how far the machine's noise alone moves a
ratio. This module turns such a sweep into a budget:

1. **Noise band** (:func:`noise_band`): the largest A/A deviation ``|log(t_index_again /
   t_index)|`` of the sweep after a 3-point running median over neighbouring sizes (one outlier
   does not widen it), and never below :data:`MIN_BAND` (5%).
2. **Verdict per size** (:func:`verdicts`): the dense/index ratio, smoothed the same way, is
   ``"dense"`` when the dense path is faster by more than the band (ratio below ``1/(1+band)``),
   ``"index"`` when it is slower by more than the band (ratio above ``1+band``), else ``"tie"``.
3. **Budget** (:func:`derive_budget`): the largest swept ``Nout*Nin`` up to which every verdict
   is ``"dense"``; 0 when the smallest graph already is not. Ties go to the index path: it keeps
   no ``S`` and does no extra arithmetic, so the dense path must earn its place.
4. **Agreement** (:func:`disagreements`): a budget agrees with a sweep when it sends every size
   with a ``"dense"`` verdict to the dense path and every ``"index"`` size to the index path; a
   tie may go either way. ``tests/test_notebook_claims.py`` holds ``DENSE_S_BUDGET["cpu"]`` to
   the sweep stored in notebook 03.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fovi_ref import knn_gather_gemm

__all__ = [
    "MIN_BAND",
    "PathTimes",
    "derive_budget",
    "disagreements",
    "fastest_times",
    "faster_of",
    "forced_grad_input_path",
    "from_record",
    "noise_band",
    "running_median",
    "to_record",
    "verdicts",
]

MIN_BAND = 0.05
"""The narrowest noise band used, whatever the A/A ratios say: 5%."""


@dataclass(frozen=True)
class PathTimes:
    """Median seconds of the two paths on one graph of ``size = Nout*Nin`` elements of ``S``,
    and of the index path timed a second time in the same rounds (the A/A control)."""

    size: int
    dense: float
    index: float
    index_again: float

    @property
    def ratio(self) -> float:
        """``t_dense / t_index``: below 1 the dense path is faster."""
        return self.dense / self.index

    @property
    def aa_ratio(self) -> float:
        """``t_index_again / t_index``: 1 on a quiet machine."""
        return self.index_again / self.index


def fastest_times(
    contenders: dict[str, Callable[[], object]], *, rounds: int, warmup: int = 3
) -> dict[str, float]:
    """The fastest of ``rounds`` calls of each contender, in seconds, timed in interleaved rounds
    (every round runs every contender once, the order rotated by one each round).

    The fastest call, not the median: on a machine shared with other work, noise only ever adds
    time (a descheduled thread, another process's cache traffic), often for seconds at a stretch,
    so the median of a size can be all noise while the fastest of many calls is still the
    uncontended cost. (:func:`fovi_ref.check.bench.time_contenders` reports medians, which suit the
    larger, steadier contenders of the bench.)
    """
    names = list(contenders)
    cuda = torch.cuda.is_available()
    best = dict.fromkeys(names, math.inf)
    for r in range(warmup + rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            contenders[name]()
            if cuda:
                torch.cuda.synchronize()
            if r >= warmup:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def running_median(values: list[float]) -> list[float]:
    """3-point running median; each end is the median of itself, its neighbour and itself."""
    if len(values) < 3:
        return list(values)
    padded = [values[0], *values, values[-1]]
    return [sorted(padded[j : j + 3])[1] for j in range(len(values))]


def noise_band(points: list[PathTimes], smooth: bool = True) -> float:
    """The band within which a ratio counts as a tie, as a fraction (0.1 = 10%).

    ``max(MIN_BAND, exp(max_j |log aa_j|) - 1)`` over the (running-median smoothed, when
    ``smooth``) A/A deviations ``|log aa_j|``.
    """
    deviations = [abs(math.log(p.aa_ratio)) for p in points]
    if smooth:
        deviations = running_median(deviations)
    return max(MIN_BAND, math.exp(max(deviations, default=0.0)) - 1)


def verdicts(points: list[PathTimes], band: float, smooth: bool = True) -> list[str]:
    """Per point: ``"dense"``, ``"index"`` or ``"tie"`` (see the module docstring). ``smooth``
    for a sweep over neighbouring sizes; off for unrelated graphs (the res18 layers)."""
    ratios = [p.ratio for p in points]
    if smooth:
        ratios = running_median(ratios)
    return [faster_of(r, band) for r in ratios]


def faster_of(ratio: float, band: float, names: tuple[str, str] = ("dense", "index")) -> str:
    """Which side of a ratio ``a / b`` is faster beyond the noise ``band``: ``names[0]`` (``a``,
    the ratio below ``1 / (1 + band)``), ``names[1]`` (``b``, above ``1 + band``) or ``"tie"``."""
    if ratio < 1 / (1 + band):
        return names[0]
    if ratio > 1 + band:
        return names[1]
    return "tie"


def derive_budget(points: list[PathTimes], band: float) -> int:
    """The largest swept ``Nout*Nin`` up to which the dense path is faster beyond the band at
    every size; 0 when it is not at the smallest. ``points`` in increasing ``size``."""
    budget = 0
    for p, verdict in zip(points, verdicts(points, band), strict=True):
        if verdict != "dense":
            break
        budget = p.size
    return budget


def disagreements(
    budget: int, points: list[PathTimes], band: float, smooth: bool = True
) -> list[tuple[PathTimes, str]]:
    """``(point, verdict)`` for every point where ``budget`` picks the path the measurement
    found slower beyond the noise band; empty when the budget agrees with the sweep."""
    wrong = []
    for p, verdict in zip(points, verdicts(points, band, smooth), strict=True):
        dense = p.size <= budget
        if (verdict == "dense" and not dense) or (verdict == "index" and dense):
            wrong.append((p, verdict))
    return wrong


def to_record(sweep: list[PathTimes], layers: dict[str, PathTimes], **about) -> dict:
    """A JSON-ready record of a sweep, the res18 layers' points and anything in ``about``
    (device, threads, torch version, ...)."""

    def row(p: PathTimes) -> list:
        return [p.size, p.dense, p.index, p.index_again]

    return {
        "kind": "fovi_ref dense-S sweep",
        **about,
        "columns": ["Nout*Nin", "dense s", "index s", "index again s"],
        "sweep": [row(p) for p in sweep],
        "layers": {name: row(p) for name, p in layers.items()},
    }


def from_record(record: dict) -> tuple[list[PathTimes], dict[str, PathTimes]]:
    """The inverse of :func:`to_record`: ``(sweep points, {layer: point})``."""

    def point(row: list) -> PathTimes:
        return PathTimes(int(row[0]), float(row[1]), float(row[2]), float(row[3]))

    sweep = [point(r) for r in record["sweep"]]
    return sweep, {name: point(r) for name, r in record["layers"].items()}


@contextmanager
def forced_grad_input_path(path: str, device_type: str = "cpu") -> Iterator[None]:
    """Within the block, ``gather_gemm``'s ``grad_input`` on ``device_type`` takes ``path``
    ("dense" S GEMM or "index" scatter) wherever an ``S`` exists; the budget is restored on exit.
    A measuring and testing knob: it edits the op's ``DENSE_S_BUDGET``, so not for threads."""
    if path not in ("dense", "index"):
        raise ValueError(f"path must be 'dense' or 'index', got {path!r}")
    saved = knn_gather_gemm.DENSE_S_BUDGET.get(device_type)
    knn_gather_gemm.DENSE_S_BUDGET[device_type] = (
        knn_gather_gemm.S_MAX_ELEMENTS if path == "dense" else -1
    )
    try:
        yield
    finally:
        if saved is None:
            del knn_gather_gemm.DENSE_S_BUDGET[device_type]
        else:
            knn_gather_gemm.DENSE_S_BUDGET[device_type] = saved
