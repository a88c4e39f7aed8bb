"""The bench: timing, contenders, the profiler, the targets, and one module per job.

- :mod:`~fovi_ref.check.bench.timing`: side-by-side timing in interleaved rounds, peak memory.
- :mod:`~fovi_ref.check.bench.contenders`: what is timed (backends, fovi's einsum, the floors).
- :mod:`~fovi_ref.check.bench.profile`: operator counts and timelines from ``torch.profiler``.
- :mod:`~fovi_ref.check.bench.targets`: every target, as data.
- jobs: :mod:`~fovi_ref.check.bench.layers` (``bench``), :mod:`~fovi_ref.check.bench.boundary`
  (``bench --boundary``), :mod:`~fovi_ref.check.bench.network` (``bench --network``),
  :mod:`~fovi_ref.check.bench.scaling` (``bench --batch-scaling``),
  :mod:`~fovi_ref.check.bench.fovi` (``bench --fovi``),
  :mod:`~fovi_ref.check.bench.strategies` (``bench --strategies``: the routed ``general``'s
  constants, each timed on both sides and held to a stored record),
  :mod:`~fovi_ref.check.bench.gemm_dtypes` (``bench --gemm-dtypes``: 16-bit GEMMs against
  float32 ones, the record ``fovi_ref.precision.GEMM_DTYPES`` is held to), and
  :mod:`~fovi_ref.check.bench.budget` (the dense-``S`` budget of notebook 04).

The measuring tools are re-exported here: ``from fovi_ref.check import bench``.

The jobs (``python -m fovi_ref bench --help`` lists every option and target)::

    python -m fovi_ref bench                       # three dtypes, K = 1 layers at batch 64 and 256
    python -m fovi_ref bench --layers res18_ds2 --batch 256 --repeats 30
    python -m fovi_ref bench --boundary            # op boundary and 100 distinct graphs
    python -m fovi_ref bench --network resnet18    # the whole trunk: routed, all-einsum, GEMM floor
    python -m fovi_ref bench --batch-scaling       # batch 1..16 per graph vs fovi's einsum
    python -m fovi_ref bench --fovi                # fovi 2.4.0's backends beside fovi_ref's
    python -m fovi_ref bench --strategies          # each tuned constant timed on both sides
    python -m fovi_ref bench --gemm-dtypes         # narrow or wide 16-bit GEMMs on this machine
    python -m fovi_ref --device cuda bench --dtypes bfloat16 --batch 256
    python scripts/profile_layer.py layer4.0.conv1 --batch 1 16   # where one layer's time goes
    bash scripts/gpu_check.sh                      # on a CUDA machine: tests, verify, bench

**Reading the tables.** Every contender runs one forward and the backward for ``x``, ``weight``
and ``bias``; contenders are timed in interleaved rounds in one process, and the tables print
*ratios*, which hold on a noisy machine where absolute times do not. Below 1 the first-named
contender is faster. Each dtype gives its own rows; the targets hold the float32 and bfloat16
rows, and float16 rows are reported beside them without targets. A run over every layer also
adds the layers' times up per dtype (``targets.TRUNK``), fovi_ref's own bfloat16 time against its
float32 time included. Which GEMMs a 16-bit row runs: ``bench --gemm-dtypes`` and
:mod:`fovi_ref.precision`.

A cell ``0.72±0.03`` is the median of the per-round ratios ± half their interquartile range. A
row gets at least ``--repeats`` rounds, and more until every target ratio's IQR is within
:data:`~fovi_ref.check.bench.timing.BAND` of its median or a time cap is reached. A verdict reads
``met`` when the whole IQR is at or below the target, ``MISSED`` (``!``) when all of it is above,
``unsure`` (``?``) when it straddles the target, and ``invalid`` when a time came out below the
GEMM floor, which no implementation can beat: that row is measured again, and if it stays there
its timed ratios print ``invalid``, never a number. A row's verdict is its worst target's; ``-``
where no target holds the row. Before its tables the bench prints how busy the machine was (the
load average against the cores, and the spread of a reference timing taken before and after): on
a busy machine the verdicts of that run are not to be trusted.

K = 1 layers (``res18_ds2/3/4``, routed to ``gather_gemm``): ``gg ms`` is ``gather_gemm``'s
median time through ``knn_conv``; ``/einsum`` is it over fovi's own path (the einsum baseline
with plain autograd); ``/conv2d`` over the *Conv2d floor* (``F.conv2d`` 1x1 stride 2, same
channels, on the smallest square grid with at least ``Nout`` outputs: what a dense CNN pays for
the shortcut); ``/gemm fl`` over the *GEMM floor* (the layer's three GEMMs, each in the operand
orientation that runs fastest here, plus zero-filling ``grad_x``); ``/general`` over the
``general`` backend on the same graph; ``op/direct`` over the same three backend functions called
directly (the op boundary's cost: above 1 it costs time).

K > 1 layers (routed to ``general``; layers sharing a graph and channel count are timed once):
``gemms`` says how ``general`` ran its GEMMs (``dense``, or ``per cell`` over the occupied
pairs), ``gen ms`` is its median time, ``time`` is ``general`` / fovi's einsum, ``floor`` is the
GEMM floor / fovi's einsum, ``/floor`` is ``general`` / the GEMM floor, ``/dense`` is ``general`` /
the floor of dense GEMMs alone, and ``memory`` is ``general``'s peak memory / fovi's einsum's. A
line under the table gives each graph's *empty cells*: the share of (node, cell) pairs no real
neighbour falls in (28% on layer1, 62% on layer4.0.conv2). Their features are zeros that a dense
GEMM multiplies all the same, so for K > 1 the floor takes each of the three products in the
faster of two forms: dense or one GEMM per occupied cell. No implementation running those
products can have a ``time`` below it. Where the floor is at most 0.5 the target holds ``time``;
where it is higher (the products alone take most of the einsum's time) it holds ``/floor``.

``--network resnet18`` times three trunks side by side: routed, all-einsum, and a *floor* trunk
whose twenty convolutions run only their three GEMMs on ready-made features, with BatchNorm,
ReLU, the pool and the adds as they are. Its ``floor`` column (floor trunk / all-einsum) is the
ratio the routed trunk would reach if its convolutions cost nothing beyond their GEMMs.

**Targets** are data (:mod:`~fovi_ref.check.bench.targets`; ``bench --help`` lists them). They
were set from figures on a 2-core Intel Xeon, and a verdict holds for the CPU it was measured on:
on a 2-core AMD EPYC fovi's einsum and ``torch_scatter`` run closer to the GEMM floor, so the
ratios against the einsum read higher there and those against the floor lower. The ``floor``
columns say how much room a target leaves on your machine. ``scripts/profile_layer.py`` profiles
any layer at any batch beside fovi's einsum and the GEMM floor. No GPU was available where this
repository is developed, so the CUDA aims (``scripts/gpu_check.sh``) are unmeasured.
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
