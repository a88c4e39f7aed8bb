"""fovi_ref: a readable reference for fovi's KNN convolution, and the checks that keep it true.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

Where each idea lives:

- :mod:`fovi_ref.meta`: :class:`KNNMeta`, the graph (``knn``, ``rf_index``, ``input_linear``).
- :mod:`fovi_ref.reference`: the float64 oracle, straight from the formula.
- :mod:`fovi_ref.knn_general`, :mod:`fovi_ref.knn_gather_gemm`,
  :mod:`fovi_ref.knn_einsum_baseline`: the three backends.
- :mod:`fovi_ref.layout`: fovi's output layout and the one GEMM that writes it.
- :mod:`fovi_ref.knn_autograd`: registry, dispatcher, checks, autograd and custom op,
  :func:`knn_conv`.
- :mod:`fovi_ref.layer`: :class:`KNNConv`.
- :mod:`fovi_ref.grid`: regular-grid metas on which ``F.conv2d`` is an oracle.
- :mod:`fovi_ref.geometry`: the real fovi-resnet18 graphs.
- :mod:`fovi_ref.check.tolerances`: what "close enough" means per dtype, and why.
"""

from fovi_ref.knn_autograd import derive_for, knn_conv, prepare, route, route_layer
from fovi_ref.layer import KNNConv
from fovi_ref.meta import DTYPES, KNNMeta, dtype_name
from fovi_ref.registry import available_ops, get_ops, register_ops, unregister_ops

__all__ = [
    "DTYPES",
    "KNNConv",
    "KNNMeta",
    "available_ops",
    "derive_for",
    "get_ops",
    "knn_conv",
    "prepare",
    "register_ops",
    "route",
    "route_layer",
    "dtype_name",
    "unregister_ops",
]
