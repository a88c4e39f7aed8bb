"""The profiler: which operators a contender runs, in what order, for how long.

kineto, the profiler's engine, prints "profiler_start/stop" lines at its default log level;
:func:`profile_contender` sets ``KINETO_LOG_LEVEL=6`` (unless already set) before the first
profile, which is when kineto reads it.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from fovi_ref.check.bench.timing import sync

__all__ = [
    "KERNEL_OPS",
    "op_counts",
    "op_sequence",
    "plot_timeline",
    "profile_contender",
    "timeline",
]


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


def profile_contender(contender, device: torch.device | str = "cpu", warmup: int = 1):
    """Run ``contender`` under ``torch.profiler`` (CPU, plus CUDA when on a GPU); return it."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    device = torch.device(device)
    for _ in range(warmup):
        contender()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities, record_shapes=False) as prof:
        contender()
        sync(device)
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
