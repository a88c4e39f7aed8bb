"""fovi_ref: a readable reference for fovi's KNN convolution (the op); :mod:`fovi_ref.check` is
the harness that judges and times it.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

The graph (:mod:`~fovi_ref.meta`), the float64 oracle (:mod:`~fovi_ref.reference`), the backends
(:mod:`~fovi_ref.knn_general`, :mod:`~fovi_ref.knn_gather_gemm`,
:mod:`~fovi_ref.knn_einsum_baseline`), their registry, the op (:mod:`~fovi_ref.knn_autograd`),
the layer, regular-grid metas (:mod:`~fovi_ref.grid`), fovi-resnet18's graphs
(:mod:`~fovi_ref.geometry`).
"""

from fovi_ref.knn_autograd import derive_for, knn_conv, prepare, route, route_layer
from fovi_ref.layer import KNNConv
from fovi_ref.meta import DTYPES, KNNMeta, dtype_name
from fovi_ref.registry import available_ops, get_ops, register_ops, unregister_ops

__all__ = ["DTYPES", "KNNConv", "KNNMeta", "available_ops", "derive_for", "dtype_name",
           "get_ops", "knn_conv", "prepare", "register_ops", "route", "route_layer",
           "unregister_ops"]  # fmt: skip
