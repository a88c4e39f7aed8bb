"""The graph of one KNN convolution layer: which inputs each output reads, and in which cell.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

:class:`KNNMeta` holds what is fixed when the layer is built: ``knn [K, Nout]`` (int64; the value
``n_in`` marks a *padding* neighbour, outside the field of view, which adds an exact zero and
receives no gradient), ``rf_index [Nout, K]`` (int64 cells in ``[0, V)``; fovi stores it one-hot
as ``local_rf [Nout, K, V]``), and ``n_in``, ``in_channels``, ``V``. Every public construction
validates the index tensors once and keeps private int64 copies; backends then trust the meta.

**Sizes.** Backends index ``Cin*(Nin+1)`` rows of ``x`` (padding included), ``Cin*V*Nout`` cells
and ``Cin*K*Nout`` entries; a meta refuses a count past ``2**31``. A policy, not int64's limit:
every index then fits in int32 too, and a backend's int64 plans (a few arrays of such a count)
stay within tens of GiB; ``n_in = 2**40`` made ``general`` ask for 32 TiB when a layer was built.

**Derived data lives on the meta.** What a backend precomputes (a gather index, segment-sum
plans, a scatter matrix) is a pure function of the meta, kept on it by :meth:`KNNMeta.derived`,
carried by ``deepcopy``, ``pickle`` and :meth:`KNNMeta.to`; no module-level cache.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DTYPES", "Derived", "KNNMeta", "check_dense", "check_int", "dtype_name"]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""The float dtypes ``knn_conv`` computes in, by name: the one table of dtypes."""


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: the name :data:`DTYPES` knows it by."""
    return str(dtype).removeprefix("torch.")


Derived = dict[str, torch.Tensor]
"""A backend's derived data: named tensors, all computed from one meta by a pure function."""


def check_int(name: str, value: Any, *, low: int) -> int:
    """``value`` as an int ``>= low``; ``TypeError`` for a non-integer (bool, 2.0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_dense(name: str, t: torch.Tensor) -> None:
    """Raise naming ``name`` unless ``t`` is dense: strided, neither sparse nor nested."""
    if t.layout != torch.strided or t.is_nested:
        got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"{name} must be a dense (strided) tensor, got {got}")


def _check_index_tensor(name: str, t: Any, ndim: int) -> torch.Tensor:
    """``t`` as an int64 tensor, or raise naming ``name`` if it is not a real integer tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(f"{name} is on the 'meta' device: a KNNMeta needs the index values")
    check_dense(name, t)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    as_int64 = t.to(torch.int64)
    if t.dtype == torch.uint64 and bool((as_int64 < 0).any()):
        # Values of 2**63 and above wrap to negative int64; report the value that was given.
        pos = tuple(int(i) for i in (as_int64 < 0).nonzero()[0])
        raise ValueError(f"{name}{list(pos)} = {t[pos].tolist()} does not fit in int64")
    return as_int64


def _check_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Raise if any entry of ``t`` lies outside ``[low, high]``, naming the first offender."""
    bad = (t < low) | (t > high)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} entries must lie in [{low}, {high}] ({what}); "
            f"{name}[{', '.join(map(str, pos))}] = {int(t[pos])}"
        )


def _not_derived_while_compiling(backend: str) -> None:
    """Raise the error that names :func:`fovi_ref.prepare`, first.

    Dynamo interprets a ``raise`` in traced code and reports it as its own "Observed exception",
    with hints about eager errors and tracing rules, and this text only in a debug line. A
    function marked ``assume_constant_result`` is instead called while tracing, with the real
    (constant) ``backend``, so its error leaves ``torch.compile`` with this message at the top:
    ``RuntimeError: call fovi_ref.prepare(meta, ...)`` (Dynamo re-wraps it as its
    ``InternalTorchDynamoError``, whose first line this is). Under ``torch.export``'s default
    non-strict tracing, and eagerly, it is a plain function."""
    raise RuntimeError(
        f"call fovi_ref.prepare(meta, {backend!r}) in eager mode before torch.compile or "
        f"torch.export: the {backend!r} data of this KNNMeta is not derived yet, and it cannot "
        "be derived while compiling (KNNConv layers prepare their own)"
    )


# The mark torch.compiler.assume_constant_result puts on a function, set here directly: calling
# that decorator imports torch._dynamo, which would add seconds to `import fovi_ref`.
# tests/test_custom_op.py holds the two to the same attribute and checks the error's first line.
_not_derived_while_compiling._dynamo_marked_constant = True  # type: ignore[attr-defined]


class KNNMeta:
    """Immutable graph: ``knn [K, Nout]`` (entries in ``[0, n_in]``, ``n_in`` = padding),
    ``rf_index [Nout, K]`` (entries in ``[0, v)``), ``n_in``, ``in_channels`` and ``v``.

    Build it with :meth:`from_knn` (or the constructor, same arguments), :meth:`from_local_rf`
    or :meth:`from_layer`. Equality is identity; compare graphs with :meth:`same_graph`.
    """

    __slots__ = ("knn", "rf_index", "n_in", "in_channels", "v", "_derived", "__weakref__")

    def __init__(
        self, knn: torch.Tensor, rf_index: torch.Tensor, n_in: int, in_channels: int, v: int
    ) -> None:
        n_in = check_int("n_in", n_in, low=1)
        in_channels = check_int("in_channels", in_channels, low=1)
        v = check_int("v", v, low=1)
        knn = _check_index_tensor("knn", knn, 2)
        rf_index = _check_index_tensor("rf_index", rf_index, 2)
        k, n_out = knn.shape
        if k < 1 or n_out < 1:
            raise ValueError(f"knn must be [K, Nout] with K, Nout >= 1, got {tuple(knn.shape)}")
        if tuple(rf_index.shape) != (n_out, k):
            raise ValueError(
                f"rf_index must be [Nout, K] = [{n_out}, {k}] to match knn "
                f"{tuple(knn.shape)}, got {tuple(rf_index.shape)}"
            )
        if rf_index.device != knn.device:
            raise ValueError(
                f"knn and rf_index must be on one device, got {knn.device} and {rf_index.device}"
            )
        rows = {"(n_in + 1)": n_in + 1, "v * n_out": v * n_out, "k * n_out": knn.numel()}
        for what, count in rows.items():  # see "Sizes" above
            if in_channels * count > 2**31:
                raise ValueError(f"in_channels * {what} = {in_channels * count} exceeds 2**31")
        _check_range("knn", knn, 0, n_in, f"n_in = {n_in} marks padding")
        _check_range("rf_index", rf_index, 0, v - 1, f"v = {v} cells")
        # Private contiguous copies: the meta must not change if the caller edits its tensors.
        self._init(knn.clone().contiguous(), rf_index.clone().contiguous(), n_in, in_channels, v)

    def _init(self, knn, rf_index, n_in, in_channels, v, derived=None) -> KNNMeta:
        # object.__setattr__ because __setattr__ below refuses every assignment.
        values = (knn, rf_index, n_in, in_channels, v, {} if derived is None else derived)
        for name, value in zip(self.__slots__[:6], values, strict=True):
            object.__setattr__(self, name, value)
        return self

    @classmethod
    def trusted(
        cls,
        knn: torch.Tensor,
        rf_index: torch.Tensor,
        n_in: int,
        in_channels: int,
        v: int,
        derived: dict[str, Derived] | None = None,
    ) -> KNNMeta:
        """A meta over tensors validated before, *not* validated or copied again: for a
        ``KNNConv`` building its meta from its buffers, the custom op, unpickling. ``derived``
        maps a backend name to its derived data (see :meth:`derived`)."""
        return object.__new__(cls)._init(knn, rf_index, n_in, in_channels, v, derived)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"KNNMeta is immutable; build a new one instead of setting {name!r}")

    def __reduce__(self):  # deepcopy and pickle: through `trusted`, with the derived data
        sizes = (self.n_in, self.in_channels, self.v)
        return KNNMeta.trusted, (self.knn, self.rf_index, *sizes, dict(self._derived))

    # ----------------------------------------------------------------------------- builders
    @classmethod
    def from_knn(
        cls, knn: torch.Tensor, rf_index: torch.Tensor, *, n_in: int, in_channels: int, v: int
    ) -> KNNMeta:
        """Validate and build a meta from ``knn [K, Nout]`` (entries in ``[0, n_in]``, ``n_in``
        = padding) and ``rf_index [Nout, K]`` (entries in ``[0, v)``, on ``knn``'s device)."""
        return cls(knn, rf_index, n_in, in_channels, v)

    @classmethod
    def from_local_rf(
        cls, knn: torch.Tensor, local_rf: torch.Tensor, *, n_in: int, in_channels: int
    ) -> KNNMeta:
        """Build a meta from fovi's one-hot ``local_rf [Nout, K, V]`` (any real or bool dtype):
        every ``local_rf[n, k, :]`` must hold exactly one 1, and 0 elsewhere."""
        if not isinstance(local_rf, torch.Tensor) or local_rf.is_complex():
            got = local_rf.dtype if isinstance(local_rf, torch.Tensor) else type(local_rf).__name__
            raise TypeError(f"local_rf must be a real torch.Tensor, got {got}")
        if local_rf.is_meta:
            raise ValueError("local_rf is on the 'meta' device: a KNNMeta needs its values")
        check_dense("local_rf", local_rf)
        if local_rf.dim() != 3:
            raise ValueError(f"local_rf must be [Nout, K, V], got shape {tuple(local_rf.shape)}")
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
                f"local_rf must be one-hot along its last axis; local_rf[{n}, {k}, :] "
                f"has {int(per_row[n, k])} ones"
            )
        rf_index = ones.to(torch.uint8).argmax(dim=2)  # [Nout, K]
        return cls(knn, rf_index, n_in, in_channels, int(local_rf.shape[2]))

    @classmethod
    def from_layer(cls, layer: Any, in_channels: int | None = None) -> KNNMeta:
        """Build a meta from a fovi ``KNNConvLayer`` without importing fovi: its
        ``knn_indices_pad_token`` (or ``knn_indices``, every index past the inputs a padding),
        ``local_rf``, ``in_channels`` (unless given) and its input count (``in_coords.shape[0]``
        or ``knn_pad_token_val``); a missing or mistyped attribute raises ``TypeError``."""
        what = type(layer).__name__
        if hasattr(layer, "in_coords"):
            shape = getattr(layer.in_coords, "shape", None)  # a tensor, or fovi's SamplingCoords
            if shape is None or len(shape) < 1:
                got = type(layer.in_coords).__name__
                raise TypeError(f"layer.in_coords must have a shape, got {got}")
            n_in = check_int("layer.in_coords.shape[0]", shape[0], low=1)
        elif hasattr(layer, "knn_pad_token_val"):
            n_in = check_int("layer.knn_pad_token_val", layer.knn_pad_token_val, low=1)
        else:
            raise TypeError(
                f"layer ({what}) has neither in_coords nor knn_pad_token_val; cannot "
                "tell its input node count"
            )
        if hasattr(layer, "knn_indices_pad_token"):
            knn = _check_index_tensor("layer.knn_indices_pad_token", layer.knn_indices_pad_token, 2)
        elif hasattr(layer, "knn_indices"):
            knn = _check_index_tensor("layer.knn_indices", layer.knn_indices, 2)
            knn = knn.clamp(max=n_in)  # fovi numbers pad coordinates n_in, n_in+1, ...
        else:
            raise TypeError(f"layer ({what}) has neither knn_indices_pad_token nor knn_indices")
        if not isinstance(local_rf := getattr(layer, "local_rf", None), torch.Tensor):
            got = "no local_rf" if local_rf is None else type(local_rf).__name__
            raise TypeError(f"layer.local_rf must be a torch.Tensor, got {got} ({what})")
        want = tuple(local_rf.shape[1::-1]) if local_rf.dim() == 3 else None  # (K, Nout)
        if want is not None and tuple(knn.shape) != want:
            name = (
                "knn_indices_pad_token"
                if hasattr(layer, "knn_indices_pad_token")
                else "knn_indices"
            )
            transposed = " (transposed?)" if tuple(knn.shape) == want[::-1] else ""
            raise ValueError(
                f"layer.{name} has shape {tuple(knn.shape)}{transposed}; local_rf "
                f"{tuple(local_rf.shape)} = [Nout, K, V] asks for [K, Nout] = {want}"
            )
        if in_channels is None:
            if not hasattr(layer, "in_channels"):
                raise TypeError(f"layer ({what}) has no in_channels; pass in_channels=")
            in_channels = check_int("layer.in_channels", layer.in_channels, low=1)
        return cls.from_local_rf(
            knn.detach(), local_rf.detach(), n_in=n_in, in_channels=in_channels
        )

    # --------------------------------------------------------------------------- derived
    @property
    def k(self) -> int:
        """Neighbours per output node, ``K``."""
        return self.knn.shape[0]

    @property
    def n_out(self) -> int:
        """Output node count, ``Nout``."""
        return self.knn.shape[1]

    @property
    def device(self) -> torch.device:
        return self.knn.device

    @property
    def pad_mask(self) -> torch.Tensor:
        """``[K, Nout]`` bool: True where ``knn[k, n]`` is a padding neighbour."""
        return self.knn == self.n_in

    @property
    def has_padding(self) -> bool:
        return bool(self.pad_mask.any())

    @property
    def input_linear(self) -> torch.Tensor:
        """``[Nout, Cin*K]`` int64 index into ``x.reshape(B, Cin*Nin)`` (fovi's form): column
        ``c*K + k`` of row ``n`` is ``c*n_in + knn[k, n]``, or ``Cin*n_in`` for padding."""
        channel_offset = torch.arange(self.in_channels, device=self.device) * self.n_in  # [Cin]
        flat = channel_offset[:, None, None] + self.knn[None]  # [Cin, K, Nout]
        flat = flat.masked_fill(self.pad_mask[None], self.in_channels * self.n_in)
        return flat.reshape(self.in_channels * self.k, self.n_out).t().contiguous()  # [Nout, Cin*K]

    def local_rf(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """fovi's dense one-hot form, ``[Nout, K, V]`` in ``dtype``: 1 at ``rf_index[n, k]``."""
        one_hot = torch.zeros(self.n_out, self.k, self.v, dtype=dtype, device=self.device)
        return one_hot.scatter_(2, self.rf_index.unsqueeze(2), 1)  # [Nout, K, V]

    def derived(self, backend: str, derive: Callable[[KNNMeta], Derived]) -> Derived:
        """The data ``backend`` derives from this graph: ``derive(self)``, computed once and kept
        on this meta. Two threads asking at once may both compute it; ``setdefault`` keeps one,
        equal to the other (``derive`` is pure). Inside ``torch.compile`` the data must exist
        already (deriving reads index values): :func:`fovi_ref.prepare` it in eager mode first."""
        found = self._derived.get(backend)
        if found is not None:
            return found
        if torch.compiler.is_compiling():
            _not_derived_while_compiling(backend)
        data = derive(self)
        if not isinstance(data, dict) or not all(
            isinstance(key, str) and isinstance(t, torch.Tensor) for key, t in data.items()
        ):
            raise TypeError(
                f"backend {backend!r}: derive(meta) must return a dict of str -> "
                f"torch.Tensor, got {data!r:.80}"
            )
        return self._derived.setdefault(backend, data)

    def to(self, device: torch.device | str) -> KNNMeta:
        """The graph and its derived data on ``device`` (``self`` if already there)."""
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("device: a KNNMeta cannot move to the 'meta' device (no values)")
        if device.type == self.device.type and (device.index is None or device == self.device):
            return self
        derived = {
            name: {key: t.to(device) for key, t in data.items()}
            for name, data in self._derived.items()
        }
        sizes = (self.n_in, self.in_channels, self.v)
        return KNNMeta.trusted(self.knn.to(device), self.rf_index.to(device), *sizes, derived)

    def same_graph(self, other: KNNMeta) -> bool:
        """True when ``other`` describes the same graph (sizes and index tensors equal)."""
        if not isinstance(other, KNNMeta):
            raise TypeError(f"other must be a fovi_ref.KNNMeta, got {type(other).__name__}")
        sizes = (self.n_in, self.in_channels, self.v) == (other.n_in, other.in_channels, other.v)
        same = self.knn.shape == other.knn.shape and torch.equal(self.knn.cpu(), other.knn.cpu())
        return sizes and same and torch.equal(self.rf_index.cpu(), other.rf_index.cpu())

    def __repr__(self) -> str:
        return (
            f"KNNMeta(k={self.k}, v={self.v}, n_in={self.n_in}, n_out={self.n_out}, "
            f"in_channels={self.in_channels}, padding={int(self.pad_mask.sum())}, "
            f"device={self.device})"
        )
