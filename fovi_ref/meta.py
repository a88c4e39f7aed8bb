"""The graph of one KNN convolution layer: which inputs each output reads, and in which cell.

A KNN convolution maps node features ``x [B, Cin, Nin]`` to ``y [B, Cout, Nout]``::

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

Everything in that formula except ``x``, ``weight`` and ``bias`` is fixed when the layer is
built, and :class:`KNNMeta` holds exactly that part:

- ``knn [K, Nout]`` (int64): the ``K`` input neighbours of every output node. The value ``n_in``
  (one past the last input) marks a *padding* neighbour, a sample point outside the field of view:
  it contributes an exact zero forward and receives no gradient.
- ``rf_index [Nout, K]`` (int64, in ``[0, V)``): the reference-grid cell each neighbour falls in.
  fovi stores the same thing one-hot, as ``local_rf [Nout, K, V]``.
- ``n_in``, ``in_channels`` and ``V``: sizes the index tensors cannot tell by themselves.

A meta is validated once, when it is built; backends then trust it. It is immutable: the index
tensors are private copies, so later edits to the caller's tensors cannot change a built meta,
and per-meta caches (the dense scatter matrix of the ``gather_gemm`` backend, say) stay valid.

This module also holds :class:`PerMetaCache`, the one bounded cache that every backend uses for
what it derives from a meta.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

__all__ = ["KNNMeta", "PerMetaCache"]


def _check_index_tensor(name: str, t: Any, ndim: int) -> torch.Tensor:
    """Return ``t`` as an int64 tensor, or raise naming ``name`` if it is not an integer tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _check_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Raise if any entry of ``t`` lies outside ``[low, high]``, naming the first offender."""
    bad = (t < low) | (t > high)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} entries must lie in [{low}, {high}] ({what}); "
            f"{name}[{', '.join(map(str, pos))}] = {int(t[pos])}"
        )


@dataclass(frozen=True, eq=False)
class KNNMeta:
    """Immutable description of one KNN-convolution graph (see the module docstring).

    Build it with :meth:`from_knn`, :meth:`from_local_rf` or :meth:`from_layer` (the constructor
    takes the same arguments as :meth:`from_knn`). Every construction validates and takes private
    int64 copies of the index tensors. Equality is identity (two metas built from the same
    tensors are different objects); compare graphs with :meth:`same_graph`.

    Attributes:
        knn: ``[K, Nout]`` int64, entries in ``[0, n_in]``; ``n_in`` marks padding.
        rf_index: ``[Nout, K]`` int64, entries in ``[0, v)``.
        n_in: number of input nodes ``Nin``.
        in_channels: ``Cin``; fixes the layout of :attr:`input_linear`.
        v: number of reference-grid cells ``V``.
    """

    knn: torch.Tensor
    rf_index: torch.Tensor
    n_in: int
    in_channels: int
    v: int

    def __post_init__(self) -> None:
        n_in = _check_positive_int("n_in", self.n_in)
        _check_positive_int("in_channels", self.in_channels)
        v = _check_positive_int("v", self.v)
        knn = _check_index_tensor("knn", self.knn, 2)
        rf_index = _check_index_tensor("rf_index", self.rf_index, 2)
        k, n_out = knn.shape
        if k < 1 or n_out < 1:
            raise ValueError(f"knn must be [K, Nout] with K, Nout >= 1, got {tuple(knn.shape)}")
        if tuple(rf_index.shape) != (n_out, k):
            raise ValueError(
                f"rf_index must be [Nout, K] = [{n_out}, {k}] to match knn {tuple(knn.shape)}, "
                f"got {tuple(rf_index.shape)}"
            )
        if rf_index.device != knn.device:
            raise ValueError(
                f"knn and rf_index must be on one device, got {knn.device} and {rf_index.device}"
            )
        _check_range("knn", knn, 0, n_in, f"n_in = {n_in} marks padding")
        _check_range("rf_index", rf_index, 0, v - 1, f"v = {v} cells")
        # Private contiguous copies: the meta must not change if the caller edits its tensors.
        # (object.__setattr__ because the dataclass is frozen.)
        knn, rf_index = knn.clone().contiguous(), rf_index.clone().contiguous()
        object.__setattr__(self, "knn", knn)
        object.__setattr__(self, "rf_index", rf_index)
        object.__setattr__(self, "_versions", (knn._version, rf_index._version))

    def check_unmodified(self) -> None:
        """Raise if the index tensors were edited in place after the meta was built (through a
        layer's ``knn``/``rf_index`` buffers, say): caches derived from the meta would be stale."""
        if (self.knn._version, self.rf_index._version) != self._versions:
            raise ValueError(
                "this meta's knn/rf_index were modified in place after it was built; build a new "
                "KNNMeta (or load a state dict into the layer) instead"
            )

    # ----------------------------------------------------------------------------- builders
    @classmethod
    def from_knn(
        cls,
        knn: torch.Tensor,
        rf_index: torch.Tensor,
        *,
        n_in: int,
        in_channels: int,
        v: int,
    ) -> KNNMeta:
        """Validate and build a meta from neighbour indices and cell indices.

        Args:
            knn: ``[K, Nout]`` integer tensor, entries in ``[0, n_in]`` (``n_in`` = padding).
            rf_index: ``[Nout, K]`` integer tensor, entries in ``[0, v)``, same device as ``knn``.
            n_in: number of input nodes. in_channels: ``Cin``. v: number of cells ``V``.
        """
        return cls(knn, rf_index, n_in, in_channels, v)

    @classmethod
    def from_local_rf(
        cls, knn: torch.Tensor, local_rf: torch.Tensor, *, n_in: int, in_channels: int
    ) -> KNNMeta:
        """Build a meta from fovi's one-hot ``local_rf [Nout, K, V]`` (any real or bool dtype).

        Every ``local_rf[n, k, :]`` must be exactly one-hot: entries in {0, 1}, one 1.
        """
        if not isinstance(local_rf, torch.Tensor):
            raise TypeError(f"local_rf must be a torch.Tensor, got {type(local_rf).__name__}")
        if local_rf.dim() != 3:
            raise ValueError(f"local_rf must be [Nout, K, V], got shape {tuple(local_rf.shape)}")
        if local_rf.is_complex():
            raise TypeError(f"local_rf must be real, got {local_rf.dtype}")
        ones = local_rf == 1
        not_binary = ~(ones | (local_rf == 0))
        if bool(not_binary.any()):
            pos = tuple(int(i) for i in not_binary.nonzero()[0])
            raise ValueError(
                f"local_rf must be one-hot (entries 0 or 1); local_rf{list(pos)} = "
                f"{local_rf[pos].item()}"
            )
        per_row = ones.sum(dim=2)  # [Nout, K]
        if bool((per_row != 1).any()):
            n, k = (int(i) for i in (per_row != 1).nonzero()[0])
            raise ValueError(
                f"local_rf must be one-hot along its last axis; local_rf[{n}, {k}, :] has "
                f"{int(per_row[n, k])} ones"
            )
        rf_index = ones.to(torch.uint8).argmax(dim=2)  # [Nout, K]
        return cls.from_knn(
            knn, rf_index, n_in=n_in, in_channels=in_channels, v=int(local_rf.shape[2])
        )

    @classmethod
    def from_layer(cls, layer: Any, in_channels: int | None = None) -> KNNMeta:
        """Build a meta from a fovi ``KNNConvLayer`` without importing fovi.

        Reads ``layer.knn_indices_pad_token`` (or ``layer.knn_indices``, where every index at or
        past the input count names a pad coordinate and becomes padding), ``layer.local_rf``,
        ``layer.in_channels`` (unless ``in_channels`` is given) and the input node count from
        ``layer.in_coords.shape[0]`` (or ``layer.knn_pad_token_val``).
        """
        if hasattr(layer, "in_coords"):
            n_in = int(layer.in_coords.shape[0])
        elif hasattr(layer, "knn_pad_token_val"):
            n_in = int(layer.knn_pad_token_val)
        else:
            raise TypeError(
                f"layer ({type(layer).__name__}) has neither in_coords nor knn_pad_token_val; "
                "cannot tell its input node count"
            )
        if hasattr(layer, "knn_indices_pad_token"):
            knn = layer.knn_indices_pad_token
        elif hasattr(layer, "knn_indices"):
            knn = _check_index_tensor("layer.knn_indices", layer.knn_indices, 2)
            knn = knn.clamp(max=n_in)  # fovi numbers pad coordinates n_in, n_in+1, ...
        else:
            raise TypeError(
                f"layer ({type(layer).__name__}) has neither knn_indices_pad_token nor knn_indices"
            )
        if not hasattr(layer, "local_rf"):
            raise TypeError(f"layer ({type(layer).__name__}) has no local_rf")
        if in_channels is None:
            if not hasattr(layer, "in_channels"):
                raise TypeError(
                    f"layer ({type(layer).__name__}) has no in_channels; pass in_channels="
                )
            in_channels = int(layer.in_channels)
        return cls.from_local_rf(
            knn.detach(), layer.local_rf.detach(), n_in=n_in, in_channels=in_channels
        )

    # --------------------------------------------------------------------------- derived
    @property
    def k(self) -> int:
        """Neighbours per output node, ``K``."""
        return int(self.knn.shape[0])

    @property
    def n_out(self) -> int:
        """Output node count, ``Nout``."""
        return int(self.knn.shape[1])

    @property
    def device(self) -> torch.device:
        return self.knn.device

    @cached_property
    def pad_mask(self) -> torch.Tensor:
        """``[K, Nout]`` bool: True where ``knn[k, n]`` is a padding neighbour."""
        return self.knn == self.n_in

    @cached_property
    def has_padding(self) -> bool:
        return bool(self.pad_mask.any())

    @cached_property
    def input_linear(self) -> torch.Tensor:
        """``[Nout, Cin*K]`` int64 index into ``x.reshape(B, Cin*Nin)``.

        Column ``c*K + k`` of row ``n`` holds ``c*n_in + knn[k, n]``, or ``Cin*n_in`` (one past
        the end of the flattened input) where ``knn[k, n]`` is padding.
        """
        channel_offset = torch.arange(self.in_channels, device=self.device) * self.n_in  # [Cin]
        flat = channel_offset[:, None, None] + self.knn[None]  # [Cin, K, Nout]
        flat = flat.masked_fill(self.pad_mask[None], self.in_channels * self.n_in)
        return flat.reshape(self.in_channels * self.k, self.n_out).t().contiguous()  # [Nout, Cin*K]

    def local_rf(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """fovi's dense one-hot form, ``[Nout, K, V]`` in ``dtype``: 1 at ``rf_index[n, k]``."""
        one_hot = torch.zeros(self.n_out, self.k, self.v, dtype=dtype, device=self.device)
        return one_hot.scatter_(2, self.rf_index.unsqueeze(2), 1)  # [Nout, K, V]

    def to(self, device: torch.device | str) -> KNNMeta:
        """The same graph with its index tensors on ``device`` (``self`` if already there)."""
        device = torch.device(device)
        if device.type == self.device.type and (device.index is None or device == self.device):
            return self
        return KNNMeta(
            self.knn.to(device), self.rf_index.to(device), self.n_in, self.in_channels, self.v
        )

    def same_graph(self, other: KNNMeta) -> bool:
        """True when ``other`` describes the same graph (sizes and index tensors equal)."""
        return (
            (self.n_in, self.in_channels, self.v) == (other.n_in, other.in_channels, other.v)
            and self.knn.shape == other.knn.shape
            and torch.equal(self.knn.cpu(), other.knn.cpu())
            and torch.equal(self.rf_index.cpu(), other.rf_index.cpu())
        )

    def __repr__(self) -> str:
        return (
            f"KNNMeta(k={self.k}, v={self.v}, n_in={self.n_in}, n_out={self.n_out}, "
            f"in_channels={self.in_channels}, padding={int(self.pad_mask.sum())}, "
            f"device={self.device})"
        )


class PerMetaCache:
    """A bounded LRU cache of values derived from a :class:`KNNMeta` (plus an extra key).

    Entries are keyed by the meta's identity and hold only a weak reference to it, so a cached
    value is never served for another meta that happens to reuse a dead meta's ``id``, the cache
    never keeps a meta alive, and it never holds more than ``maxsize`` values.
    """

    def __init__(self, maxsize: int = 32) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple, tuple[weakref.ref, Any]] = OrderedDict()
        self.builds = 0  # how many values were computed (tests read it)

    def get(self, meta: KNNMeta, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value for ``(meta, key)``, calling ``build()`` on a miss."""
        full_key = (id(meta), key)
        entry = self._entries.get(full_key)
        if entry is not None and entry[0]() is meta:
            self._entries.move_to_end(full_key)
            return entry[1]
        value = build()
        self.builds += 1
        self._entries[full_key] = (weakref.ref(meta), value)
        self._entries.move_to_end(full_key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
