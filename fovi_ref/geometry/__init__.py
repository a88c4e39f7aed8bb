"""The real KNN graphs of fovi's foveated ResNet-18, rebuilt from scratch.

fovi replaces a CNN's pixel grid by a *foveated* set of sample points, dense at fixation and
sparse in the periphery, and its convolutions by KNN convolutions over those points. Every such
layer is described by a graph (:class:`~fovi_ref.meta.KNNMeta`): which ``K`` inputs each output
node reads (``knn [K, Nout]``) and which of the ``V`` kernel cells each of them feeds
(``rf_index [Nout, K]``). This package builds those graphs the way fovi does, step by step:

1. **Sampling** (:mod:`.sampling`). ``res`` rings, evenly spaced in cortical radius
   ``log(r + cmf_a)``, each with as many points as keeps the spacing isotropic; the field of view
   (diameter ``fov`` degrees) is the unit disk. Outside it, a few *pad* rings continue the
   pattern.
2. **Cortical coordinates** (:mod:`.manifold`). Every point, pads included, is mapped to a 3-D
   model of cortex on which the magnification ``M(r) = k / (r + a)`` is built in, so Euclidean
   distance there is cortical distance.
3. **Strides** (:mod:`.resnet18`). A layer with stride ``s`` maps a ``res``-ring sampling to the
   ``res // s``-ring one; with stride 1 input and output points coincide.
4. **Nearest neighbours** (:mod:`.neighbours`). Each output node takes its ``K = min(k, Nin)``
   nearest candidates in cortical space among the inputs *and* the pad coordinates; a pad
   coordinate becomes the padding index ``Nin`` (a zero input), in its place by distance.
5. **Reference grid and local_rf** (:mod:`.cells`). Each neighbourhood is laid out in a local
   frame (cortical distance, visual direction), normalised to ``[-1, 1]^2`` over its ``K``
   neighbours (pads included), and each neighbour goes to the nearest cell of a
   ``ceil(sqrt K)``-square grid: fovi's one-hot ``local_rf``.

:mod:`.graph` chains these for one layer; :mod:`.resnet18` lists the 20 convolutions of the
network; :mod:`.stats` summarises a graph; :mod:`.plot` draws one; :mod:`.digest` fingerprints
one.

**Machines differ.** fovi builds in float32, and another CPU, MKL code path or thread count rounds
its distances differently, so a near-tie can go the other way: fovi's graphs depend on the
machine. :mod:`.certificate` says, per node, whether every machine builds it alike
(*determined*) or not (a *tie*); :mod:`.pinned` ships fovi 2.4.0's graphs as built on one
machine, for anything that must come out the same everywhere; and :mod:`.exact`
(``arithmetic="exact"``) builds graphs that are the same on every machine, the construction we
would propose to fovi.

**Which fovi.** By default the graphs are those of fovi 2.4.0, the release on PyPI:
``resnet18_layers()`` equals, tensor for tensor, the ``knn_indices_pad_token`` and
``local_rf.argmax(-1)`` of every ``KNNConvLayer`` of fovi 2.4.0's ``KNNResNet(device="cpu")``
(``in_res=64, fov=16, cmf_a=0.5``, isotropic sampling, ``field_geometry="planar"``). Other
``in_res``, ``fov``, ``cmf_a`` and ``field_geometry="legacy"`` follow 2.4.0 as well (four
settings are pinned in ``tests/data/fovi_2.4.0_graphs.json``). ``fovi_version="bf792c2"`` gives
instead the graphs of fovi's GitHub commit bf792c2, which this package first reproduced.

The two versions share the neighbour and cell code and differ in the samplings:

- the cortical surface. 2.4.0 defaults to a *planar* visual field, ``rho(r) = M(r) r`` with an
  exact closed-form ``z(r)``; bf792c2 only has what 2.4.0 calls ``"legacy"``,
  ``rho(r) = M(r) sin(r deg) 180/pi`` with ``z(r)`` read off a float64 table;
- the precision of the sample points. 2.4.0 computes the angles of a ring in float32
  (``arange(n) * (2 pi / n)``) and its points with torch's float32 cosine and sine, pad rings
  included, and maps float32 points to cortex in float32; bf792c2 took float64 NumPy angles and
  points.

Both change only which of two (nearly) equally distant candidates wins, but such ties are common
on these symmetric rings and float32 rounding decides them: the float dtypes and the order of
operations here follow fovi's, so the graphs are identical to those fovi builds on the same
machine, not merely similar.

Built records are cached (building all 20 takes about a second on one core); treat their tensors as
read-only, and call :func:`clear_caches` to force a rebuild.
"""

from __future__ import annotations

from fovi_ref.geometry.certificate import TieCertificate, tie_certificate
from fovi_ref.geometry.exact import AmbiguousGraphError
from fovi_ref.geometry.graph import LayerGraph, _graph_tensors, layer_graph
from fovi_ref.geometry.manifold import FIELD_GEOMETRIES, z_table
from fovi_ref.geometry.pinned import PINNED_SETTINGS, pinned_environment, pinned_graphs
from fovi_ref.geometry.plot import plot_neighbourhood, plot_sampling
from fovi_ref.geometry.resnet18 import (
    RES18_DOWNSAMPLES,
    ConvSpec,
    UnknownLayerError,
    _cached_layers,
    get_layer,
    resnet18_layers,
    resnet18_plan,
)
from fovi_ref.geometry.sampling import (
    ARITHMETICS,
    DEFAULT_FOVI_VERSION,
    FOVI_VERSIONS,
    FoveatedSampling,
    _cached_sampling,
    foveated_sampling,
)
from fovi_ref.geometry.stats import GraphStats, graph_stats

__all__ = [
    "ARITHMETICS",
    "DEFAULT_FOVI_VERSION",
    "FIELD_GEOMETRIES",
    "FOVI_VERSIONS",
    "PINNED_SETTINGS",
    "RES18_DOWNSAMPLES",
    "AmbiguousGraphError",
    "ConvSpec",
    "FoveatedSampling",
    "GraphStats",
    "LayerGraph",
    "TieCertificate",
    "UnknownLayerError",
    "clear_caches",
    "foveated_sampling",
    "get_layer",
    "graph_stats",
    "layer_graph",
    "pinned_environment",
    "pinned_graphs",
    "plot_neighbourhood",
    "plot_sampling",
    "resnet18_layers",
    "resnet18_plan",
    "tie_certificate",
]


def clear_caches() -> None:
    """Forget every cached sampling, cortical table, graph and layer record."""
    for cached in (z_table, _cached_sampling, _graph_tensors, _cached_layers):
        cached.cache_clear()
