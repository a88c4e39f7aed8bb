"""Timing and memory, side by side.

Everything here measures *ratios within one run*. A machine's absolute speed changes from run to
run (other processes, clock boost, page faults), but contenders timed in interleaved rounds in
one process see the same conditions, so their ratios hold. Nothing here is used by tests as a
pass/fail timing. A *contender* is a zero-argument callable
(:mod:`fovi_ref.check.bench.contenders`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["peak_memory_bytes", "sync", "time_contenders"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ measuring
def time_contenders(
    contenders: dict[str, Callable[[], object]], *, repeats: int = 10, warmup: int = 2
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
            sync(device)
            start = time.perf_counter()
            contenders[name]()
            sync(device)
            if r >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples[name]) for name in names}


def _device_of_contenders() -> torch.device:
    # Contenders hide their tensors; synchronising the current CUDA device covers them all.
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def peak_memory_bytes(contender: Callable[[], object], device: torch.device | str = "cpu") -> int:
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
