"""Timing and memory, side by side, with spreads and verdicts that cannot mislead.

Everything here measures *ratios within one run*. A machine's absolute speed changes from run to
run (other processes, clock boost, page faults), but contenders timed in interleaved rounds in
one process see the same conditions, so their ratios hold. Nothing here is used by tests as a
pass/fail timing. A *contender* is a zero-argument callable
(:mod:`fovi_ref.check.bench.contenders`).

**Spreads.** A ratio ``a / b`` is taken per round (``a`` and ``b`` ran back to back) and reported
as the median and interquartile range (IQR) of those per-round ratios (:class:`Ratio`), as pyperf
and asv report spreads. :func:`measure` adds rounds until every ratio it watches has an IQR within
:data:`BAND` of its median, or a time cap is reached, and says which (``Timing.stopped``).

**Verdicts** (:func:`verdict`): a ratio held to ``<= at_most`` is ``met`` when its whole IQR is
at or below the target, ``MISSED`` when all of it is above, ``unsure`` when the IQR straddles it.
A ratio whose median lies below its *floor* (a time no implementation can beat, e.g. anything /
the GEMM floor below :data:`FLOOR_VALID`) is ``invalid``: :func:`measure` measures again, and a
table prints ``invalid``, never the number.

**torch.utils.benchmark.** Its clock (``benchmark.timer``, CUDA-synchronised where CUDA runs),
its thread control (``set_torch_threads``) and its statistics (``Measurement``: median, IQR and
its high-spread warning) are used as they are. Its timing loops are not: ``Timer.timeit`` runs two
warm-up calls per measurement and ``blocked_autorange`` times one contender for a whole block of
its own choosing, while the ratios here need every contender timed once per round, in a rotated
order, so that a slow phase of a shared machine falls on all of them alike. That interleaving is
the one loop written here.
"""

from __future__ import annotations

import os
import platform as py_platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.benchmark import Measurement, TaskSpec, set_torch_threads
from torch.utils.benchmark import timer as clock

from fovi_ref.precision import platform

__all__ = [
    "BAND",
    "CAP_S",
    "FLOOR_VALID",
    "MachineLoad",
    "Ratio",
    "Timing",
    "cpu_model",
    "describe_platform",
    "machine_load",
    "measure",
    "overall",
    "paired_ratio",
    "peak_memory_bytes",
    "platform_fields",
    "sync",
    "time_contenders",
    "verdict",
]

BAND = 0.10
"""Rounds are added until every watched ratio's IQR is at most this fraction of its median."""
CAP_S = 30.0
"""Seconds one measurement may take before it stops adding rounds (and says so)."""
FLOOR_VALID = 0.9
"""A time / the GEMM floor below this is no result: the floor's GEMMs are part of the time."""
VERDICTS = ("met", "unsure", "MISSED", "invalid")
"""Verdicts, mildest first: a row's verdict is its worst ratio's (:func:`overall`)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------- ratios, verdicts
@dataclass(frozen=True)
class Ratio:
    """A ratio from paired rounds: the median and quartiles (``low``, ``high``) of the per-round
    ratios; ``valid`` is False when the median fell below the floor the ratio is held above."""

    median: float
    low: float
    high: float
    rounds: int
    valid: bool = True

    @property
    def spread(self) -> float:
        """The IQR as a fraction of the median."""
        return (self.high - self.low) / self.median if self.median else float("inf")

    def text(self, mark: str = "") -> str:
        """``"0.72±0.03"`` (median ± half the IQR) followed by ``mark``; ``"invalid"``."""
        if not self.valid:
            return "invalid"
        return f"{self.median:.2f}±{(self.high - self.low) / 2:.2f}{mark}"


def paired_ratio(num: Sequence[float], den: Sequence[float], floor: float | None = None) -> Ratio:
    """:class:`Ratio` of the per-round ratios ``num[i] / den[i]`` (``num``, ``den``: seconds of
    two contenders in the same rounds); invalid when its median is below ``floor``."""
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    if len(ratios) == 1:
        low = median = high = ratios[0]
    else:
        low, median, high = statistics.quantiles(ratios, n=4, method="inclusive")
    valid = floor is None or median >= floor
    return Ratio(median, low, high, len(ratios), valid)


def verdict(ratio: Ratio, at_most: float) -> str:
    """``met`` (the IQR at or below ``at_most``), ``MISSED`` (all above), ``unsure`` (it
    straddles the target) or ``invalid`` (below its floor: no result)."""
    if not ratio.valid:
        return "invalid"
    if ratio.high <= at_most:
        return "met"
    return "MISSED" if ratio.low > at_most else "unsure"


def overall(verdicts: Sequence[str]) -> str:
    """The worst of ``verdicts`` (``invalid`` > ``MISSED`` > ``unsure`` > ``met``); ``-`` for
    none."""
    return max(verdicts, key=VERDICTS.index) if verdicts else "-"


def mark_of(v: str) -> str:
    """The mark a table puts after a ratio: ``!`` MISSED, ``?`` unsure, nothing otherwise."""
    return {"MISSED": "!", "unsure": "?"}.get(v, "")


# ------------------------------------------------------------------------------ measuring
@dataclass
class Timing:
    """What :func:`measure` saw: every contender's seconds per round (``samples``), the rounds,
    why it stopped (``"band"``: every watched ratio within :data:`BAND`; ``"cap"``: the time cap
    or the round limit came first; ``"rounds"``: nothing watched, the minimum was run), and how
    many times it measured (``attempts`` > 1 when a ratio fell below its floor)."""

    samples: dict[str, list[float]]
    rounds: int
    stopped: str
    attempts: int = 1
    floors: dict[tuple[str, str], float] = field(default_factory=dict)

    def median(self, name: str) -> float:
        """``name``'s median seconds (:meth:`measurement`'s)."""
        return self.measurement(name).median

    def medians(self) -> dict[str, float]:
        return {name: self.median(name) for name in self.samples}

    def ratio(self, num: str, den: str) -> Ratio:
        """``num / den`` from the paired rounds, invalid below a floor :func:`measure` knew."""
        return paired_ratio(self.samples[num], self.samples[den], self.floors.get((num, den)))

    def measurement(self, name: str) -> Measurement:
        """``name``'s samples as a ``torch.utils.benchmark.Measurement`` (median, IQR, and its
        warning when the IQR is large)."""
        spec = TaskSpec(stmt=name, setup="", num_threads=torch.get_num_threads())
        return Measurement(1, list(self.samples[name]), spec)

    def stop_note(self) -> str:
        """One line: rounds, and whether the spread met the band or the cap stopped it."""
        why = {
            "band": f"every ratio's IQR within {BAND:.0%} of its median",
            "cap": f"time cap or round limit reached before the {BAND:.0%} band",
            "rounds": "fixed rounds",
        }[self.stopped]
        again = f", measured {self.attempts} times (a ratio fell below its floor)"
        return f"{self.rounds} rounds, {why}" + (again if self.attempts > 1 else "")


def _interleaved(contenders, samples, rounds: int, start: int) -> None:
    """Run ``rounds`` more rounds: every contender once, in an order rotated each round."""
    names = list(contenders)
    for r in range(start, start + rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            begin = clock()
            contenders[name]()
            samples[name].append(clock() - begin)


def measure(
    contenders: dict[str, Callable[[], object]],
    *,
    ratios: Sequence[tuple[str, str]] = (),
    floors: dict[tuple[str, str], float] | None = None,
    repeats: int = 10,
    warmup: int = 2,
    band: float = BAND,
    cap_s: float = CAP_S,
    max_rounds: int | None = None,
    attempts: int = 3,
) -> Timing:
    """Time ``contenders`` in interleaved rounds: ``warmup`` untimed rounds, then at least
    ``repeats`` rounds, adding rounds until every ratio in ``ratios`` (``(num, den)`` names) has
    an IQR within ``band`` of its median, or ``cap_s`` seconds or ``max_rounds`` (default
    ``10 * repeats``) are reached. A ratio in ``floors`` whose median falls below its floor
    discards the measurement and measures again, up to ``attempts`` times in all."""
    floors = dict(floors or {})
    max_rounds = max(repeats, 10 * repeats if max_rounds is None else max_rounds)
    with set_torch_threads(torch.get_num_threads()):
        for attempt in range(1, attempts + 1):
            samples: dict[str, list[float]] = {name: [] for name in contenders}
            _interleaved(contenders, {n: [] for n in contenders}, warmup, 0)
            start = time.perf_counter()
            _interleaved(contenders, samples, repeats, warmup)
            stopped = "rounds" if not ratios else "cap"
            while ratios:
                timing = Timing(samples, len(samples[ratios[0][0]]), stopped, attempt, floors)
                if all(timing.ratio(*pair).spread <= band for pair in ratios):
                    stopped = "band"
                    break
                if time.perf_counter() - start > cap_s or timing.rounds >= max_rounds:
                    break
                _interleaved(contenders, samples, 1, warmup + timing.rounds)
            timing = Timing(samples, len(next(iter(samples.values()))), stopped, attempt, floors)
            if all(timing.ratio(*pair).valid for pair in floors):
                break
    return timing


@dataclass(frozen=True)
class MachineLoad:
    """How busy the machine is while a bench runs: the 1-minute load average, the cores, and
    the spread (IQR / median) of a reference GEMM timed :data:`REFERENCE_ROUNDS` times."""

    load: float
    cores: int
    reference_spread: float

    @property
    def busy(self) -> bool:
        """More runnable work than this process can bring (its threads on every core, plus one),
        or a reference timing spread beyond twice :data:`BAND`: other work shares the machine."""
        return self.load > self.cores + 1 or self.reference_spread > 2 * BAND

    def line(self) -> str:
        """One line for a report, and a second one warning when :attr:`busy`."""
        load = f"machine: load average {self.load:.1f} on {self.cores} cores"
        text = f"{load}, a reference GEMM's spread {self.reference_spread:.0%}"
        if self.busy:
            text += "\n  BUSY: other work shares this machine; do not trust this run's verdicts"
        return text


REFERENCE_ROUNDS = 21
"""How many times :func:`machine_load` times its reference GEMM."""


def machine_load() -> MachineLoad:
    """The load average now and the spread of a reference GEMM (a 256 x 256 float32 matmul,
    :data:`REFERENCE_ROUNDS` times): on a quiet machine its IQR stays within a few percent."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    seconds = []
    for _ in range(REFERENCE_ROUNDS):
        begin = clock()
        a @ a
        seconds.append(clock() - begin)
    low, median, high = statistics.quantiles(seconds, n=4, method="inclusive")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return MachineLoad(load, os.cpu_count() or 1, (high - low) / median)


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return py_platform.processor() or py_platform.machine() or "unknown"


def platform_fields(device: torch.device | str = "cpu") -> dict:
    """What every stored timing names its machine by: ``precision.platform`` (the key of the
    GEMM table), the device, the CPU model and ATen's capability (AVX2, AVX512, ...), the CPU
    threads and the torch version (a JSON-ready dict; :func:`describe_platform` prints it)."""
    device = torch.device(device)
    return {
        "platform": platform(device),
        "device": str(device),
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def describe_platform(fields: dict) -> str:
    """``platform cpu_bf16 (Intel(R) Xeon(R) ..., AVX512), 2 threads, torch 2.13.0+cpu``."""
    machine = f"{fields.get('cpu_model') or 'CPU model unrecorded'}, {fields['cpu_capability']}"
    threads = fields.get("threads")
    threads = f"{threads} threads" if threads else "threads unrecorded"
    return f"platform {fields['platform']} ({machine}), {threads}, torch {fields['torch']}"


def time_contenders(
    contenders: dict[str, Callable[[], object]], *, repeats: int = 10, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each contender, timed in ``repeats`` interleaved rounds (every
    round runs every contender once, in an order rotated by one each round). Returns
    ``{name: median seconds}``; :func:`measure` gives the spreads."""
    return measure(contenders, repeats=repeats, warmup=warmup).medians()


def peak_memory_bytes(contender: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated *during* one call, above what was live before it.

    CUDA: the caching allocator's peak counter. CPU: the profiler's allocation records replayed
    in time order (each operator's net allocation at its start, each free when it happens); this
    sees every tensor torch allocates, at operator granularity. kineto, the profiler's engine,
    prints "profiler_start/stop" lines at its default log level: ``KINETO_LOG_LEVEL=6`` (unless
    already set) before the first profile, when kineto reads it, keeps the bench's output clean.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
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
