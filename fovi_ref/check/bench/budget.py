"""The dense-``S`` budget of ``gather_gemm``'s input gradient, derived from a measured sweep.

``grad_input`` of the K = V = 1 backend reaches ``grad_x`` by one of two paths with the same
result (:mod:`fovi_ref.knn_gather_gemm`): a GEMM with the dense one-hot scatter matrix ``S
[Nout, Nin]`` ("dense"), or a zero-fill and ``index_add_`` ("index"). ``DENSE_S_BUDGET[device]``
picks the dense path for graphs with ``Nout*Nin <= budget``. Notebook 04
(notebooks/04_scatter_matrix_budget.ipynb) times both paths with :func:`fastest_times` over
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
   the sweep stored in notebook 04.

**Derived until measured** (:func:`model_budget`). No GPU has run the sweep yet, so the CUDA
budget comes from a model of the two paths, evaluated at the sweep's sizes and shape
(:data:`SWEEP_BATCH`, :data:`SWEEP_CHANNELS`, :data:`SWEEP_RHO`, float32). With ``s`` bytes per
element, a GEMM rate ``Phi``, a memory bandwidth ``beta`` and a fixed cost ``L`` per kernel
launch, each kernel takes ``L + max(F / Phi, Q / beta)`` (a roofline: a GPU overlaps arithmetic
with memory traffic)::

    dense:  L + max(2 B Cin Nout Nin / Phi,  s (B Cin (Nout + Nin) + Nout Nin) / beta)
            (+ L + 6 Nout Nin / beta in 16 bits: S converted from float32 on every call)
    index:  2 L + s B Cin (Nin + 3 Nout) / beta     (zero-fill, then index_add_)

(the GEMM both paths share, ``W^T grad_y``, cancels). The budget is the largest swept size up to
which the dense path's time is at most the index path's, as :func:`derive_budget` would read a
measurement that agreed with the model. The ceilings are a datasheet's (:data:`H200`), not a
measurement: a stored CUDA sweep (:data:`CUDA_RECORD`, written by ``scripts/gpu_check.sh`` from
notebook 04 executed on a GPU) replaces the model, and ``tests/test_notebook_claims.py`` holds
``DENSE_S_BUDGET["cuda"]`` to the model while no such record exists, and to the record once it
does.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fovi_ref.knn_gather_gemm import S_MAX_ELEMENTS

__all__ = [
    "CUDA_RECORD",
    "DENSE_S_BUDGET_SOURCE",
    "H200",
    "MIN_BAND",
    "SWEEP_BATCH",
    "SWEEP_CHANNELS",
    "SWEEP_RHO",
    "PathTimes",
    "Roofline",
    "derive_budget",
    "disagreements",
    "fastest_times",
    "faster_of",
    "from_record",
    "model_budget",
    "model_seconds",
    "notebook_record",
    "noise_band",
    "running_median",
    "sweep_sizes",
    "to_record",
    "verdicts",
]

DENSE_S_BUDGET_SOURCE: dict[str, str] = {
    "cpu": "measured: notebook 04 sweep",
    "cuda": "derived: notebook 04 model, unmeasured",
}
"""Where each value of :data:`fovi_ref.knn_gather_gemm.DENSE_S_BUDGET` comes from: the sweep
notebook 04 stores (``measured``), or :func:`model_budget` where no device has run it
(``derived``); ``tests/test_notebook_claims.py`` holds each value to its source."""

MIN_BAND = 0.05
"""The narrowest noise band used, whatever the A/A ratios say: 5%."""

SWEEP_BATCH, SWEEP_CHANNELS, SWEEP_RHO = 32, 64, 4
"""The sweep's shape: batch, ``Cin = Cout``, and ``Nin / Nout`` (res18_ds2's aspect ratio)."""

CUDA_RECORD = Path(__file__).with_name("dense_s_sweep_cuda.json")
"""Where a CUDA sweep, once measured, is stored (absent until then)."""


def sweep_sizes(rho: int = SWEEP_RHO, largest: int = S_MAX_ELEMENTS) -> list[tuple[int, int]]:
    """``(Nout, Nin)`` of the sweep: ``Nin = rho Nout``, four sizes to a decade of ``Nout*Nin``
    from ``10^2`` up to ``largest`` (above ``S_MAX_ELEMENTS`` no ``S`` exists to time)."""
    sizes = []
    for i in range(40):
        n_out = max(1, round(math.sqrt(10 ** (2 + i / 4) / rho)))
        if n_out * rho * n_out > largest:
            break
        sizes.append((n_out, rho * n_out))
    return sizes


@dataclass(frozen=True)
class Roofline:
    """A device's ceilings for :func:`model_budget`: memory ``bandwidth`` (byte/s), GEMM
    ``rates`` per dtype (FLOP/s) and ``launch``, the fixed cost of one kernel (s)."""

    name: str
    bandwidth: float
    rates: dict[torch.dtype, float]
    launch: float


H200 = Roofline(
    name="NVIDIA H200 SXM, datasheet",
    bandwidth=4.8e12,  # HBM3e
    rates={
        torch.float32: 67e12,  # CUDA cores (the sweep's float32 runs without TF32)
        torch.bfloat16: 989e12,  # dense tensor cores
        torch.float16: 989e12,
    },
    launch=5e-6,  # one eager PyTorch op: dispatch and CUDA launch, a few microseconds
)
"""The lent GPU's datasheet figures, the ceilings of the CUDA model."""


def model_seconds(
    n_out: int, n_in: int, *, batch: int, c_in: int, dtype: torch.dtype, device: Roofline
) -> PathTimes:
    """The model's times of the two paths on one graph (the module docstring's formulas); the
    model's A/A control equals its index time."""
    s = torch.empty((), dtype=dtype).element_size()
    flops, beta, launch = device.rates[dtype], device.bandwidth, device.launch
    dense = launch + max(
        2 * batch * c_in * n_out * n_in / flops,  # d_sel @ S
        s * (batch * c_in * (n_out + n_in) + n_out * n_in) / beta,  # read d_sel and S, write
    )
    if s != 4:  # S is kept in float32 and converted for every 16-bit call
        dense += launch + (4 + s) * n_out * n_in / beta
    index = 2 * launch + s * batch * c_in * (n_in + 3 * n_out) / beta  # zero-fill, index_add_
    return PathTimes(n_out * n_in, dense, index, index)


def model_budget(device: Roofline = H200, dtype: torch.dtype = torch.float32) -> int:
    """The budget the model predicts at the sweep's sizes and shape: the largest swept
    ``Nout*Nin`` up to which the dense path is not slower; 0 when it is at the smallest."""
    budget = 0
    for n_out, n_in in sweep_sizes():
        shape = {"batch": SWEEP_BATCH, "c_in": SWEEP_CHANNELS, "dtype": dtype}
        t = model_seconds(n_out, n_in, **shape, device=device)
        if t.dense > t.index:
            break
        budget = t.size
    return budget


def notebook_record(path: Path, kind: str = "fovi_ref dense-S sweep") -> dict:
    """The ``application/json`` output whose ``kind`` is ``kind`` in a stored (executed)
    notebook: how the sweep of notebook 04 leaves it."""
    for cell in json.loads(Path(path).read_text())["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {}).get("application/json")
            if isinstance(data, dict) and data.get("kind") == kind:
                return data
    raise ValueError(f"{Path(path).name} stores no {kind!r} record: execute it")


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
