"""``KNNConv``: an ``nn.Module`` holding a KNN convolution's parameters and graph.

It mirrors fovi's ``KNNConvLayer`` where a reader or :func:`fovi_ref.route_layer` looks
(``weight [Cout, Cin*V]``, ``bias``, ``in_channels``, ``out_channels``, ``_k``, ``local_rf``) and
runs every forward through :func:`fovi_ref.knn_conv`.

**The layer owns its graph as buffers**: ``knn`` and ``rf_index`` persistent, the backend's
derived data non-persistent (computed once per graph), so ``.to()``, ``deepcopy``, ``pickle``,
``torch.save`` and compiled programs carry it; :attr:`KNNConv.meta` is a view. Change the graph
with ``layer.meta = new_meta`` or a state dict, both validated before anything changes;
assigning, deleting or registering ``layer.knn`` raises; editing the index buffers in place is not
supported (no per-call check could see it). ``to_empty`` and the ``'meta'`` device take the
graph's values: the layer refuses to run until a state dict (or ``layer.meta =``) brings a graph.
"""

from __future__ import annotations

import torch
from torch import nn

from fovi_ref.knn_autograd import derive_for, knn_conv, route
from fovi_ref.meta import KNNMeta, check_int
from fovi_ref.registry import get_ops

__all__ = ["KNNConv"]

_GRAPH = ("knn", "rf_index")


class KNNConv(nn.Module):
    """``y = knn_conv(x, weight, bias, meta)``: ``x [B, Cin, Nin]`` -> ``y [B, Cout, Nout]``.

    ``in_channels`` must equal ``meta.in_channels`` (the layer keeps its own copy of ``meta``);
    the weight is kaiming-normal and the bias zero, as in fovi; ``backend`` forces one by name
    (``None``: the dispatcher routes).
    """

    _graph_lost = False  # True once to_empty or the 'meta' device took the graph's values

    def __init__(self, in_channels: int, out_channels: int, meta: KNNMeta, *, bias: bool = True,
                 backend: str | None = None) -> None:  # fmt: skip
        super().__init__()
        in_channels = check_int("in_channels", in_channels, low=1)
        out_channels = check_int("out_channels", out_channels, low=1)
        if not isinstance(meta, KNNMeta):
            raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
        if in_channels != meta.in_channels:
            raise ValueError(f"in_channels={in_channels} differs from meta.in_channels="
                             f"{meta.in_channels}")  # fmt: skip
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__} {bias!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self._n_in, self._v = meta.n_in, meta.v
        self._derived_names: dict[str, str] = {}  # derived key -> buffer name
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels * meta.v))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        forced = None if backend is None else get_ops(backend).name
        self._set_graph(meta.knn.clone(), meta.rf_index.clone(), forced)  # a private copy
        nn.init.kaiming_normal_(self.weight)

    # ------------------------------------------------------------------------------- the graph
    @property
    def backend(self) -> str | None:
        """The forced backend, or ``None`` (routed). Setting it re-derives the graph's data."""
        return self._backend

    @backend.setter
    def backend(self, name: str | None) -> None:
        self._set_graph(*self._graph(), None if name is None else get_ops(name).name)

    @property
    def meta(self) -> KNNMeta:
        """The graph as a :class:`KNNMeta` over this layer's buffers (a view, built per call)."""
        derived = {key: self._buffers[name] for key, name in self._derived_names.items()}
        graph = (*self._graph(), self._n_in, self.in_channels, self._v)
        return KNNMeta.trusted(*graph, {self._derived_backend: derived} if derived else {})

    def _graph(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(knn, rf_index)``, or ``RuntimeError`` once their values were taken."""
        if self._graph_lost:
            raise RuntimeError("this KNNConv's graph lost its values (to_empty, 'meta' device): "
                               "load_state_dict or layer.meta = ... brings one")  # fmt: skip
        return self._buffers["knn"], self._buffers["rf_index"]

    @meta.setter
    def meta(self, meta: KNNMeta) -> None:
        if not isinstance(meta, KNNMeta):
            raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
        mine, new = (self._n_in, self.in_channels, self._v), (meta.n_in, meta.in_channels, meta.v)
        if new != mine:  # the weight's shape depends on them
            raise ValueError(f"a new graph must keep (n_in, in_channels, v) = {mine}; got {new} "
                             "(build a new KNNConv instead)")  # fmt: skip
        self._set_graph(*(t.to(self.knn.device) for t in (meta.knn, meta.rf_index)), self._backend)

    def _set_graph(self, knn: torch.Tensor, rf_index: torch.Tensor, forced: str | None) -> None:
        """Validate ``(knn, rf_index)`` and derive the data of ``forced`` (``None``: the routed
        backend) first; then replace graph, derived buffers and forced backend together."""
        meta = KNNMeta(knn, rf_index, self._n_in, self.in_channels, self._v)
        backend = forced or route(meta)
        derived = derive_for(meta, backend)
        names = {key: "derived_" + key.replace(".", "_") for key in derived}
        if len(set(names.values())) < len(names):
            raise ValueError(f"backend {backend!r}: derive() keys {sorted(names)} collide as "
                             "buffer names (a '.' reads as '_')")  # fmt: skip
        for name in self._derived_names.values():
            del self._buffers[name]
        for key, name in names.items():
            self.register_buffer(name, derived[key], persistent=False)
        self._derived_names, self._derived_backend, self._backend = names, backend, forced
        self._graph_lost = False
        self._buffers["knn"], self._buffers["rf_index"] = meta.knn, meta.rf_index

    def __setattr__(self, name, value):
        _refuse_graph_buffer(self, name)
        super().__setattr__(name, value)

    def __delattr__(self, name):
        _refuse_graph_buffer(self, name)
        super().__delattr__(name)

    def register_buffer(self, name, tensor, persistent=True):
        _refuse_graph_buffer(self, name)
        super().register_buffer(name, tensor, persistent)

    # ------------------------------------------------------------------- nn.Module integration
    def _apply(self, fn, recurse=True):
        for name in _GRAPH:  # refused before anything changes: fn tried on an empty slice
            if (dtype := fn(self._buffers[name][:0]).dtype) != torch.int64:
                raise TypeError(f"{name} must stay int64, not {dtype}; the layer is unchanged")
        names = (*_GRAPH, *self._derived_names.values())
        old = None if self._graph_lost else [self._buffers[name] for name in names]
        super()._apply(fn, recurse)
        new = [self._buffers[name] for name in names]
        # Values kept (a move, a cast): still the graph and its derived data. Values gone
        # (to_empty's memory, the 'meta' device): the graph is lost until a state dict brings one.
        kept = old is not None and not new[0].is_meta
        same = kept and all(torch.equal(a, b.to(a)) for a, b in zip(new, old, strict=True))
        self._graph_lost = not same
        return self

    def load_state_dict(self, state_dict, strict=True, assign=False):
        # torch judges the keys after loading; a strict load of this layer judges them first, so
        # that it changes nothing when refused (inside a container torch decides: see README).
        keys, own = set(state_dict), set(self.state_dict(keep_vars=True))
        if strict and keys != own:
            raise RuntimeError(f"Error(s) in loading state_dict for KNNConv: missing keys "
                               f"{sorted(own - keys)}, unexpected keys {sorted(keys - own)}; "
                               "nothing was loaded")  # fmt: skip
        return super().load_state_dict(state_dict, strict, assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, errors):  # fmt: skip
        # Validate everything taken from the state dict first: a refused load changes nothing.
        # (Keys are torch's: ``strict`` is always True here, torch judges them after the load.)
        keys = {name: prefix + name for name in _GRAPH}
        new_graph = None
        if any(key in state_dict for key in keys.values()):
            own = (None, None) if all(k in state_dict for k in keys.values()) else self._graph()
            graph = (state_dict.get(keys[name], t) for name, t in zip(_GRAPH, own, strict=True))
            new_graph = KNNMeta(*graph, self._n_in, self.in_channels, self._v)
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            value = state_dict.get(prefix + name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{prefix}{name} in the state dict must be a torch.Tensor, got "
                                f"{type(value).__name__}")  # fmt: skip
            if param is not None and value is not None and value.shape != param.shape:
                shapes = f"{tuple(value.shape)}, this layer's is {tuple(param.shape)}"
                raise ValueError(f"{prefix}{name} in the state dict has shape {shapes}")
        rest = {key: value for key, value in state_dict.items() if key not in keys.values()}
        super()._load_from_state_dict(
            rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        for key in keys.values():  # held back from torch above, not missing
            if key in state_dict and key in missing_keys:
                missing_keys.remove(key)
        if new_graph is not None:  # on this layer's device, or the state dict's with assign=True
            if not local_metadata.get("assign_to_params_buffers"):
                new_graph = new_graph.to(self.knn.device)
            self._set_graph(new_graph.knn, new_graph.rf_index, self._backend)

    # ---------------------------------------------------------------------------- forward etc.
    @property
    def _k(self) -> int:  # fovi's name for K
        return self.knn.shape[0]

    @property
    def local_rf(self) -> torch.Tensor:  # fovi's one-hot cells [Nout, K, V], built on demand
        return self.meta.local_rf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, Cin, Nin]`` -> ``y [B, Cout, Nout]`` (fovi's layout)."""
        return knn_conv(x, self.weight, self.bias, self.meta, backend=self._derived_backend)

    def __prepare_scriptable__(self):  # torch.jit.script calls it on every submodule
        raise RuntimeError("TorchScript cannot compile KNNConv (knn_conv is a Python "
                           "autograd.Function): use torch.export or torch.compile")  # fmt: skip

    def extra_repr(self) -> str:
        k, n_out = self.knn.shape
        sizes = f"{self.in_channels}, {self.out_channels}, k={k}, v={self._v}, n_in={self._n_in}"
        backend = self._backend or "auto"
        return f"{sizes}, n_out={n_out}, bias={self.bias is not None}, backend={backend}"


def _refuse_graph_buffer(layer: KNNConv, name: str) -> None:
    graph = (*_GRAPH, *layer.__dict__.get("_derived_names", {}).values())
    if name in graph and name in layer.__dict__.get("_buffers", {}):
        raise AttributeError(f"assign a new graph with layer.meta = KNNMeta(...), not layer.{name}:"
                             " knn, rf_index and the derived data change together")  # fmt: skip
