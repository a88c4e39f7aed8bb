"""Benchmarks: measuring tools, the per-layer bench, and the boundary and many-graphs ratios.

- :mod:`fovi_ref.check.bench.contenders`: side-by-side timing, floors, peak memory, profiler helpers
  (re-exported here: ``from fovi_ref.check import bench; bench.time_contenders(...)``).
- :mod:`fovi_ref.check.bench.layers`: ``python -m fovi_ref bench``, the res18 layers, targets, tables.
- :mod:`fovi_ref.check.bench.boundary`: ``python -m fovi_ref bench --boundary``, the fixed cost of the
  op boundary and of having many distinct graphs.
- :mod:`fovi_ref.check.bench.network`: ``python -m fovi_ref bench --network resnet18``, the whole trunk.
- :mod:`fovi_ref.check.bench.budget`: the dense-``S`` budget derived from a measured sweep.
- :mod:`fovi_ref.check.bench.scaling`: ``python -m fovi_ref bench --batch-scaling``, batches 1 to 16.
"""

from fovi_ref.check.bench.contenders import (
    KERNEL_OPS,
    Contender,
    Inputs,
    conv2d_floor,
    fovi_einsum,
    gemm_floor,
    knn_backend,
    knn_backend_direct,
    make_inputs,
    op_counts,
    op_sequence,
    peak_memory_bytes,
    plot_timeline,
    profile_contender,
    time_contenders,
    timeline,
)

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
    "time_contenders",
    "timeline",
]
