"""The bench: timing, contenders, the profiler, the targets, and one module per job.

- :mod:`~fovi_ref.check.bench.timing`: side-by-side timing in interleaved rounds, peak memory.
- :mod:`~fovi_ref.check.bench.contenders`: what is timed (backends, fovi's einsum, the floors).
- :mod:`~fovi_ref.check.bench.profile`: operator counts and timelines from ``torch.profiler``.
- :mod:`~fovi_ref.check.bench.targets`: every target, as data.
- jobs: :mod:`~fovi_ref.check.bench.layers` (``bench``), :mod:`~fovi_ref.check.bench.boundary`
  (``bench --boundary``), :mod:`~fovi_ref.check.bench.network` (``bench --network``),
  :mod:`~fovi_ref.check.bench.scaling` (``bench --batch-scaling``),
  :mod:`~fovi_ref.check.bench.fovi` (``bench --fovi``), and
  :mod:`~fovi_ref.check.bench.budget` (the dense-``S`` budget of notebook 03).

The measuring tools are re-exported here: ``from fovi_ref.check import bench``.
"""

from fovi_ref.check.bench.contenders import (
    Contender,
    Inputs,
    conv2d_floor,
    fovi_einsum,
    gemm_floor,
    knn_backend,
    knn_backend_direct,
    make_inputs,
    through,
)
from fovi_ref.check.bench.profile import (
    KERNEL_OPS,
    op_counts,
    op_sequence,
    plot_timeline,
    profile_contender,
    timeline,
)
from fovi_ref.check.bench.timing import peak_memory_bytes, time_contenders

__all__ = [
    "KERNEL_OPS",
    "Contender",
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
    "through",
    "time_contenders",
    "timeline",
]
