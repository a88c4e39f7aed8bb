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

**The layer computes only the graph it holds.** ``torch.func.functional_call`` (or any other
stateless call) that swaps in graph or derived buffers is refused when the layer runs: the
derived data belongs to one graph, so a swapped ``knn`` would run with another graph's plans.
Parameters may be swapped freely (ensembles, ``torch.func.grad``).

**State dicts** carry ``n_in`` and ``V`` as the layer's extra state, so a load over another
input count or cell count is refused by name (checkpoints written before carry none, and still
load). A refused load changes nothing: the graph (and its derived data), the extra state, the
weight and the bias are all validated first, before torch copies anything.
"""

from __future__ import annotations

import torch
from torch import nn

from fovi_ref.knn_autograd import derive_for, knn_conv, route
from fovi_ref.meta import KNNMeta, check_int
from fovi_ref.registry import get_ops

__all__ = ["KNNConv"]

_GRAPH = ("knn", "rf_index")
_EXTRA = "_extra_state"  # torch's key for get_extra_state()


class KNNConv(nn.Module):
    """``y = knn_conv(x, weight, bias, meta)``: ``x [B, Cin, Nin]`` -> ``y [B, Cout, Nout]``.

    ``in_channels`` must equal ``meta.in_channels`` (the layer keeps its own copy of ``meta``);
    the weight is kaiming-normal and the bias zero, as in fovi; ``backend`` forces one by name
    (``None``: the dispatcher routes).
    """

    _graph_lost = False  # True once to_empty or the 'meta' device took the graph's values

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
        in_channels = check_int("in_channels", in_channels, low=1)
        out_channels = check_int("out_channels", out_channels, low=1)
        if not isinstance(meta, KNNMeta):
            raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
        if in_channels != meta.in_channels:
            raise ValueError(
                f"in_channels={in_channels} differs from meta.in_channels={meta.in_channels}"
            )
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
            raise RuntimeError(
                "this KNNConv's graph lost its values (to_empty, 'meta' device): "
                "load_state_dict or layer.meta = ... brings one"
            )
        return self._buffers["knn"], self._buffers["rf_index"]

    @meta.setter
    def meta(self, meta: KNNMeta) -> None:
        if not isinstance(meta, KNNMeta):
            raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
        mine = (self._n_in, self.in_channels, self._v)
        new = (meta.n_in, meta.in_channels, meta.v)
        if new != mine:  # the weight's shape depends on them
            raise ValueError(
                f"a new graph must keep (n_in, in_channels, v) = {mine}; got {new} "
                "(build a new KNNConv instead)"
            )
        self._set_graph(*(t.to(self.knn.device) for t in (meta.knn, meta.rf_index)), self._backend)

    def _set_graph(self, knn: torch.Tensor, rf_index: torch.Tensor, forced: str | None) -> None:
        """Validate ``(knn, rf_index)`` and derive the data of ``forced`` (``None``: the routed
        backend) first; then replace graph, derived buffers and forced backend together."""
        self._install_graph(*self._prepare_graph(knn, rf_index, forced), forced)

    def _prepare_graph(self, knn: torch.Tensor, rf_index: torch.Tensor, forced: str | None):
        """``(meta, backend, derived, names)`` for a new graph: everything that can refuse it."""
        meta = KNNMeta(knn, rf_index, self._n_in, self.in_channels, self._v)
        backend = forced or route(meta)
        derived = derive_for(meta, backend)
        names = {key: "derived_" + key.replace(".", "_") for key in derived}
        if len(set(names.values())) < len(names):
            raise ValueError(
                f"backend {backend!r}: derive() keys {sorted(names)} collide as "
                "buffer names (a '.' reads as '_')"
            )
        return meta, backend, derived, names

    def _install_graph(self, meta: KNNMeta, backend: str, derived, names, forced) -> None:
        """Replace graph, derived buffers and backend together (nothing here can fail)."""
        for name in self._derived_names.values():
            del self._buffers[name]
        for key, name in names.items():
            self.register_buffer(name, derived[key], persistent=False)
        self._derived_names, self._derived_backend, self._backend = names, backend, forced
        self._graph_lost = False
        self._buffers["knn"], self._buffers["rf_index"] = meta.knn, meta.rf_index
        self._remember_graph()

    def _remember_graph(self) -> None:
        """Note which tensors are this layer's graph, so that a swapped one is seen."""
        names = (*_GRAPH, *self._derived_names.values())
        self.__dict__["_own_graph"] = {name: self._buffers[name] for name in names}

    def _check_own_graph(self) -> None:
        """``ValueError`` if a graph or derived buffer is not the one this layer set."""
        for name, tensor in self.__dict__.get("_own_graph", {}).items():
            if self._buffers.get(name) is not tensor:
                raise ValueError(
                    f"KNNConv computes only the graph it holds, but its buffer {name!r} was "
                    "swapped (torch.func.functional_call or another stateless call): its derived "
                    "data belongs to its own graph. Pass parameters only, and give the layer "
                    "another graph with layer.meta = KNNMeta(...) (one layer per graph)."
                )

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
        self._remember_graph()
        return self

    def get_extra_state(self) -> dict[str, int]:
        """``{"n_in", "v"}``: what the graph's indices and the weight's columns mean."""
        return {"n_in": self._n_in, "v": self._v}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self._check_extra_state(state, "")  # validated before the load; again for direct calls

    def _check_extra_state(self, state: object, prefix: str) -> None:
        if not isinstance(state, dict) or set(state) != {"n_in", "v"}:
            raise ValueError(
                f"{prefix}{_EXTRA} in the state dict must be a dict with keys "
                f"'n_in' and 'v', got {state!r}"
            )
        for name, mine in (("n_in", self._n_in), ("v", self._v)):
            if state[name] != mine:
                raise ValueError(
                    f"the state dict's graph has {name} = {state[name]}, this "
                    f"layer's {mine}: build a KNNConv for it instead"
                )

    def load_state_dict(self, state_dict, strict=True, assign=False):
        # torch judges the keys after loading; a strict load of this layer judges them first, so
        # that it changes nothing when refused (inside a container torch decides: "State" in
        # help(fovi_ref)).
        # A state dict written before the layer had extra state lacks it, and still loads.
        keys = set(state_dict)
        own = set(self.state_dict(keep_vars=True))
        if strict and keys != own and keys != own - {_EXTRA}:
            raise RuntimeError(
                f"Error(s) in loading state_dict for KNNConv: missing keys "
                f"{sorted(own - keys)}, unexpected keys {sorted(keys - own)}; "
                "nothing was loaded"
            )
        return super().load_state_dict(state_dict, strict, assign)

    def _check_loaded_tensor(self, key: str, value: object, param, assign: bool) -> None:
        """A weight or bias from a state dict that ``copy_`` (or ``assign``) takes as it is."""
        if param is None:
            return  # no such parameter: torch reports the key as unexpected
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{key} in the state dict must be a torch.Tensor, got {type(value).__name__}"
            )
        if value.layout != torch.strided:
            raise TypeError(f"{key} in the state dict must be a dense tensor, got {value.layout}")
        if value.is_meta and not assign:
            raise ValueError(
                f"{key} in the state dict is on the 'meta' device: it holds no "
                "values to copy (load with assign=True to take it as it is)"
            )
        if value.shape != param.shape:
            shapes = f"{tuple(value.shape)}, this layer's is {tuple(param.shape)}"
            raise ValueError(f"{key} in the state dict has shape {shapes}")
        if value.is_complex() or not (value.is_floating_point() or assign):
            raise TypeError(f"{key} in the state dict must be a floating tensor, got {value.dtype}")

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        # Validate everything taken from the state dict first, the new graph's derived data
        # included: a refused load changes nothing. (Keys are torch's: ``strict`` is always True
        # here, torch judges them after the load.)
        assign = bool(local_metadata.get("assign_to_params_buffers"))
        if prefix + _EXTRA in state_dict:
            self._check_extra_state(state_dict[prefix + _EXTRA], prefix)
        keys = {name: prefix + name for name in _GRAPH}
        new_graph = None
        if any(key in state_dict for key in keys.values()):
            own = (None, None) if all(k in state_dict for k in keys.values()) else self._graph()
            graph = [state_dict.get(keys[name], t) for name, t in zip(_GRAPH, own, strict=True)]
            meta = KNNMeta(*graph, self._n_in, self.in_channels, self._v)
            if not assign:  # on this layer's device, or the state dict's with assign=True
                meta = meta.to(self.knn.device)
            new_graph = self._prepare_graph(meta.knn, meta.rf_index, self._backend)
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            if prefix + name in state_dict:
                self._check_loaded_tensor(prefix + name, state_dict[prefix + name], param, assign)
        rest = {key: value for key, value in state_dict.items() if key not in keys.values()}
        super()._load_from_state_dict(
            rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        for key in (*keys.values(), prefix + _EXTRA):  # held back above, or an old checkpoint
            if key in missing_keys and (key in state_dict or key == prefix + _EXTRA):
                missing_keys.remove(key)
        if new_graph is not None:
            self._install_graph(*new_graph, self._backend)

    # ---------------------------------------------------------------------------- forward etc.
    @property
    def _k(self) -> int:  # fovi's name for K
        return self.knn.shape[0]

    @property
    def local_rf(self) -> torch.Tensor:  # fovi's one-hot cells [Nout, K, V], built on demand
        return self.meta.local_rf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, Cin, Nin]`` -> ``y [B, Cout, Nout]`` (fovi's layout)."""
        if not torch.compiler.is_compiling():  # tracing swaps in stand-ins of the same buffers
            self._check_own_graph()
        return knn_conv(x, self.weight, self.bias, self.meta, backend=self._derived_backend)

    def __prepare_scriptable__(self):  # torch.jit.script calls it on every submodule
        raise RuntimeError(
            "TorchScript cannot compile KNNConv (knn_conv is a Python "
            "autograd.Function): use torch.export or torch.compile"
        )

    def extra_repr(self) -> str:
        k, n_out = self.knn.shape
        sizes = f"{self.in_channels}, {self.out_channels}, k={k}, v={self._v}, n_in={self._n_in}"
        backend = self._backend or "auto"
        return f"{sizes}, n_out={n_out}, bias={self.bias is not None}, backend={backend}"


def _refuse_graph_buffer(layer: KNNConv, name: str) -> None:
    graph = (*_GRAPH, *layer.__dict__.get("_derived_names", {}).values())
    if name in graph and name in layer.__dict__.get("_buffers", {}):
        raise AttributeError(
            f"assign a new graph with layer.meta = KNNMeta(...), not layer.{name}:"
            " knn, rf_index and the derived data change together"
        )
