"""Measuring: side-by-side timings, floors, peak memory, operator counts, profiler timelines.

Everything here measures *ratios within one run*. A machine's absolute speed changes from run to
run (other processes, clock boost, page faults), but contenders timed in interleaved rounds in
one process see the same conditions, so their ratios hold. Nothing here is used by tests as a
pass/fail timing.

A *contender* is a zero-argument callable that runs one forward and one backward (gradients of
``x``, ``weight`` and ``bias``). The builders below make contenders for the backends, for fovi's
own autograd path, and for the two floors:

- the **Conv2d floor**: ``F.conv2d`` 1x1 stride 2 with the same channels on the smallest square
  grid with at least ``Nout`` outputs (what a dense CNN pays for a downsample);
- the **GEMM floor**: the three GEMMs that every implementation which applies the shared weight
  to per-cell features runs (forward ``[B*Nout, Cin*V] @ [Cin*V, Cout]``, the input-gradient and
  the weight-gradient GEMMs of the same sizes, each in its fastest orientation) plus
  zero-filling the input gradient, nothing else. For K = V = 1 that is all a downsample needs;
  for K > 1 it bounds from below what any such implementation, fovi's einsum included, can
  reach.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fovi_ref.grid import square_grid_for
from fovi_ref.knn_autograd import get_ops, knn_conv
from fovi_ref.knn_einsum_baseline import EinsumBaselineOps
from fovi_ref.meta import KNNMeta

__all__ = [
    "KERNEL_OPS",
    "Inputs",
    "conv2d_floor",
    "fovi_einsum",
    "gemm_floor",
    "knn_backend",
    "knn_backend_direct",
    "make_inputs",
    "op_counts",
    "op_sequence",
    "peak_memory_bytes",
    "plot_timeline",
    "profile_contender",
    "time_contenders",
    "timeline",
]

# kineto, the profiler's engine, prints "profiler_start/stop" lines at its default log level; 6
# keeps it quiet. It reads the variable when the first profile starts, so setting it here works.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

Contender = Callable[[], object]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Inputs:
    """One layer's operands: ``x [B, Cin, Nin]``, ``weight [Cout, Cin*V]``, ``bias [Cout]``
    (all requiring grad) and a fixed upstream gradient ``grad_y [B, Cout, Nout]``."""

    meta: KNNMeta
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    grad_y: torch.Tensor


def make_inputs(
    meta: KNNMeta, out_channels: int, batch: int, dtype: torch.dtype, seed: int = 0
) -> Inputs:
    """Random operands on ``meta``'s device, weight scaled like fovi's kaiming init."""
    g = torch.Generator().manual_seed(seed)
    device = meta.device

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=g) * scale
        return t.to(device=device, dtype=dtype)

    x = randn(batch, meta.in_channels, meta.n_in).requires_grad_()
    weight = randn(
        out_channels, meta.in_channels * meta.v, scale=(2 / (meta.in_channels * meta.v)) ** 0.5
    )
    bias = randn(out_channels, scale=0.1).requires_grad_()
    grad_y = randn(batch, out_channels, meta.n_out)
    return Inputs(meta, x, weight.requires_grad_(), bias, grad_y)


# ------------------------------------------------------------------------------ contenders
def _grads(y: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(y, (inputs.x, inputs.weight, inputs.bias), inputs.grad_y)


def knn_backend(inputs: Inputs, backend: str) -> Contender:
    """Forward + backward through :func:`fovi_ref.knn_conv` (custom op, autograd) on ``backend``."""

    def run():
        return _grads(
            knn_conv(inputs.x, inputs.weight, inputs.bias, inputs.meta, backend=backend), inputs
        )

    return run


def knn_backend_direct(inputs: Inputs, backend: str) -> Contender:
    """The same arithmetic calling the backend's three functions directly: no custom op, no
    autograd. ``knn_backend / knn_backend_direct`` is the cost of the custom-op boundary."""
    ops, meta = get_ops(backend), inputs.meta
    x, w, b, grad_y = (t.detach() for t in (inputs.x, inputs.weight, inputs.bias, inputs.grad_y))

    def run():
        y = ops.forward(meta, x, w, b)  # kept alive through the backward, as autograd keeps it
        grads = (
            ops.grad_input(meta, grad_y, w),
            ops.grad_weight(meta, grad_y, x),
            grad_y.sum((0, 2)),
        )
        return y, grads

    return run


def fovi_einsum(inputs: Inputs) -> Contender:
    """fovi today: plain autograd through the einsum baseline's forward (no custom op), so its
    backward is what autograd derives, as in fovi's ``KNNConvLayer`` (see
    :mod:`fovi_ref.knn_einsum_baseline` for how closely it matches)."""

    def run():
        return _grads(
            EinsumBaselineOps.forward(inputs.meta, inputs.x, inputs.weight, inputs.bias), inputs
        )

    return run


def conv2d_floor(inputs: Inputs) -> Contender:
    """``F.conv2d`` 1x1 stride 2 on the smallest square grid with >= ``Nout`` outputs (K = 1)."""
    meta = inputs.meta
    side_in, side_out = square_grid_for(meta.n_out)
    like = inputs.x
    batch, c_out = inputs.grad_y.shape[:2]
    image = torch.randn(batch, meta.in_channels, side_in, side_in, device=like.device)
    image = image.to(like.dtype).requires_grad_()
    weight = inputs.weight.detach()[:, : meta.in_channels].reshape(c_out, meta.in_channels, 1, 1)
    weight = weight.clone().requires_grad_()
    bias = inputs.bias.detach().clone().requires_grad_()
    grad_y = torch.randn(batch, c_out, side_out, side_out, device=like.device).to(like.dtype)

    def run():
        y = F.conv2d(image, weight, bias, stride=2)
        return torch.autograd.grad(y, (image, weight, bias), grad_y)

    return run


def gemm_floor(inputs: Inputs, trials: int = 5) -> Contender:
    """The three GEMMs of this layer's sizes plus zero-filling ``grad_x``, nothing else.

    A GEMM's speed depends on the orientation of its operands (on a 2-core CPU, MKL runs
    ``[Cin, B*Nout] = W^T G`` up to 1.7x slower than the same product written as
    ``[B*Nout, Cin] = G^T W``), and an implementation may pick any. So for each of the three
    products this times every orientation ``trials`` times when the contender is built and keeps
    the fastest: the floor is the best any implementation running these GEMMs can do.
    """
    meta, like = inputs.meta, inputs.x
    batch, c_out = inputs.grad_y.shape[:2]
    features, rows = meta.in_channels * meta.v, batch * meta.n_out

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=like.device).to(like.dtype)

    w = inputs.weight.detach()  # [Cout, F]
    x_rows, g_rows = randn(rows, features), randn(rows, c_out)  # [B*Nout, F], [B*Nout, Cout]
    x_cols, g_cols = x_rows.t().contiguous(), g_rows.t().contiguous()  # [F, ...], [Cout, ...]
    orientations = {
        "forward": (lambda: x_rows @ w.t(), lambda: w @ x_cols),
        "input gradient": (lambda: g_rows @ w, lambda: g_cols.t() @ w, lambda: w.t() @ g_cols),
        "weight gradient": (
            lambda: g_rows.t() @ x_rows,
            lambda: g_cols @ x_rows,
            lambda: g_cols @ x_cols.t(),
        ),
    }
    fastest = []
    for candidates in orientations.values():
        times = time_contenders(dict(enumerate(candidates)), repeats=trials, warmup=1)
        fastest.append(candidates[min(times, key=times.get)])

    def run():
        grad_x = torch.zeros(
            batch, meta.in_channels, meta.n_in, device=like.device, dtype=like.dtype
        )
        return *(gemm() for gemm in fastest), grad_x

    return run


# ------------------------------------------------------------------------------ measuring
def time_contenders(
    contenders: dict[str, Contender], *, repeats: int = 10, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each contender, timed in interleaved rounds.

    Every round runs every contender once, in an order rotated by one each round, so slow
    phases of a noisy machine are shared out evenly. Returns ``{name: median seconds}``.
    """
    names = list(contenders)
    device = _device_of_contenders()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            _sync(device)
            start = time.perf_counter()
            contenders[name]()
            _sync(device)
            if r >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples[name]) for name in names}


def _device_of_contenders() -> torch.device:
    # Contenders hide their tensors; synchronising the current CUDA device covers them all.
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def peak_memory_bytes(contender: Contender, device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated *during* one call, above what was live before it.

    CUDA: the caching allocator's peak counter. CPU: the profiler's allocation records replayed
    in time order (each operator's net allocation at its start, each free when it happens); this
    sees every tensor torch allocates, at operator granularity.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        contender()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        contender()
    changes = sorted(
        (
            e.time_range.start,
            e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage,
        )
        for e in prof.events()
        if e.name == "[memory]" or e.self_cpu_memory_usage != 0
    )
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------------- profiler
# The operators that do the work (or move memory); wrappers such as aten::matmul or
# aten::reshape that only dispatch to these are not counted, so each unit of work counts once.
KERNEL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::gather",
    "aten::index_select",
    "aten::index",
    "aten::index_add_",
    "aten::index_copy_",
    "aten::index_fill_",
    "aten::scatter_add_",
    "aten::copy_",
    "aten::fill_",
    "aten::zero_",
    "aten::sum",
    "aten::add",
    "aten::mul",
    "aten::cat",
    "aten::masked_fill",
    "aten::masked_fill_",
)


def profile_contender(contender: Contender, device: torch.device | str = "cpu", warmup: int = 1):
    """Run ``contender`` under ``torch.profiler`` (CPU, plus CUDA when on a GPU); return it."""
    device = torch.device(device)
    for _ in range(warmup):
        contender()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _sync(device)
    with profile(activities=activities, record_shapes=False) as prof:
        contender()
        _sync(device)
    return prof


def _outermost_kernel_events(prof) -> list:
    """CPU events of :data:`KERNEL_OPS` not nested inside another one, in time order (an
    ``index_add_`` that runs a ``scatter_add_`` inside is one unit of work, not two)."""
    events = []
    for e in prof.events():
        if e.name not in KERNEL_OPS or e.device_type.name != "CPU":
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in KERNEL_OPS:
            parent = parent.cpu_parent
        if parent is None:
            events.append(e)
    return sorted(events, key=lambda e: e.time_range.start)


def op_counts(prof) -> dict[str, int]:
    """``{operator: calls}`` of the outermost :data:`KERNEL_OPS` in a profile, plus
    ``"cuda kernels"`` (GPU kernel launches) when the profile has CUDA activity."""
    counts = Counter(e.name for e in _outermost_kernel_events(prof))
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    if kernels:
        counts["cuda kernels"] = kernels
    return dict(sorted(counts.items()))


def op_sequence(prof) -> list[str]:
    """The outermost :data:`KERNEL_OPS` of a profile in time order, ``aten::`` dropped."""
    return [e.name.removeprefix("aten::") for e in _outermost_kernel_events(prof)]


def timeline(prof) -> list[tuple[str, float, float]]:
    """``(operator, start_us, duration_us)`` of the outermost :data:`KERNEL_OPS` of a profile,
    start relative to the first, in time order."""
    events = _outermost_kernel_events(prof)
    if not events:
        return []
    t0 = events[0].time_range.start
    return [(e.name, e.time_range.start - t0, e.time_range.elapsed_us()) for e in events]


def plot_timeline(rows: list[tuple[str, float, float]], ax, title: str = ""):
    """Draw :func:`timeline` rows as a Gantt chart, one lane per operator name."""
    lanes = sorted({name for name, _, _ in rows})
    colours = dict(zip(lanes, [f"C{i % 10}" for i in range(len(lanes))], strict=True))
    for name, start, duration in rows:
        ax.barh(lanes.index(name), max(duration, 0.5), left=start, color=colours[name])
    ax.set_yticks(range(len(lanes)), [lane.replace("aten::", "") for lane in lanes])
    ax.set_xlabel("time since first operator [µs]")
    ax.set_title(title)
    return ax
