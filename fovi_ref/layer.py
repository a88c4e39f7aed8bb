"""``KNNConv``: an ``nn.Module`` holding a KNN convolution's parameters and graph.

It mirrors fovi's ``KNNConvLayer`` where a reader or :func:`fovi_ref.route_layer` looks
(``weight [Cout, Cin*V]``, ``bias``, ``in_channels``, ``out_channels``, ``_k``, ``local_rf``) and
runs every forward through :func:`fovi_ref.knn_conv`, so the dispatcher picks the backend.
"""

from __future__ import annotations

import torch
from torch import nn

from fovi_ref.knn_autograd import knn_conv
from fovi_ref.meta import KNNMeta

__all__ = ["KNNConv"]


class KNNConv(nn.Module):
    """``y = knn_conv(x, weight, bias, meta)``: ``x [B, Cin, Nin]`` -> ``y [B, Cout, Nout]``.

    The layer keeps its own copy of the graph, registered as buffers (``knn``, ``rf_index``), so
    ``.to(device)`` and ``state_dict`` carry it; the layer rebuilds (and validates) its
    :attr:`meta` whenever they change through a move or ``load_state_dict``. Editing the buffers
    in place is refused at the next forward (the meta's caches would be stale).

    Args:
        in_channels: ``Cin``; must equal ``meta.in_channels``.
        out_channels: ``Cout``.
        meta: the graph.
        bias: learn a bias (initialised to zero). The weight is kaiming-normal, as in fovi.
        backend: force a backend by name; ``None`` lets the dispatcher route.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        meta: KNNMeta,
        *,
        bias: bool = True,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(meta, KNNMeta):
            raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
        if in_channels != meta.in_channels:
            raise ValueError(
                f"in_channels={in_channels} differs from meta.in_channels={meta.in_channels}"
            )
        if isinstance(out_channels, bool) or not isinstance(out_channels, int) or out_channels < 1:
            raise ValueError(f"out_channels must be a positive int, got {out_channels!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels * meta.v))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self._n_in, self._v = meta.n_in, meta.v
        self.register_buffer("knn", meta.knn)
        self.register_buffer("rf_index", meta.rf_index)
        self._use_buffers_as_meta()  # a private meta: editing it cannot touch the caller's
        nn.init.kaiming_normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def meta(self) -> KNNMeta:
        """The graph, on the layer's device."""
        return self._meta

    @property
    def _k(self) -> int:
        """fovi's name for K."""
        return self._meta.k

    @property
    def local_rf(self) -> torch.Tensor:
        """fovi's one-hot cell assignment, ``[Nout, K, V]`` (built on demand)."""
        return self._meta.local_rf()

    def _use_buffers_as_meta(self) -> None:
        """Build :attr:`meta` (validated, with its own copies) from the ``knn`` and ``rf_index``
        buffers, and make the buffers those copies, so buffers and meta share storage."""
        meta = KNNMeta(self.knn, self.rf_index, self._n_in, self.in_channels, self._v)
        self._meta = meta
        self.knn, self.rf_index = meta.knn, meta.rf_index

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.knn is not self._meta.knn or self.rf_index is not self._meta.rf_index:
            self._use_buffers_as_meta()  # moved (or emptied by to_empty: then validation fails)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Loading copies into the buffers in place; detach them from the current meta first so
        # that meta (and every cache keyed on it) never sees its indices change underneath it.
        self.knn, self.rf_index = self.knn.clone(), self.rf_index.clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._use_buffers_as_meta()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, Cin, Nin]`` -> ``y [B, Cout, Nout]``."""
        return knn_conv(x, self.weight, self.bias, self._meta, backend=self.backend)

    def extra_repr(self) -> str:
        m = self._meta
        return (
            f"{self.in_channels}, {self.out_channels}, k={m.k}, v={m.v}, n_in={m.n_in}, "
            f"n_out={m.n_out}, bias={self.bias is not None}, backend={self.backend or 'auto'}"
        )
