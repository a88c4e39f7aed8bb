"""fovi models on fovi_ref's op: the adapter a fovi user calls.

A fovi model (``KNNResNet`` and any other ``nn.Module`` built from fovi's ``KNNConvLayer``) keeps
its own code, parameters and graphs; the adapter swaps what each KNN convolution computes::

    from fovi_ref.interop.fovi import to_fovi, to_fovi_ref

    metas = to_fovi_ref(model)      # every KNNConvLayer now runs fovi_ref.knn_conv
    ...                             # train, evaluate, compile, save the state_dict
    to_fovi(model)                  # fovi's own forward again

    with fovi_ref_convs(model):     # the same, for the length of a block
        ...

**What changes, and what does not.** Each layer's ``forward`` is replaced on the instance by
``knn_conv(x, layer.weight, layer.bias, meta, backend=backend)``, ``meta`` read once from the
layer (:meth:`fovi_ref.KNNMeta.from_layer`: its neighbour indices, padding and ``local_rf``).
The parameters, buffers, ``state_dict``, hooks and any optimizer are the model's own, untouched;
``backend=None`` runs fovi_ref's routed dispatcher (``gather_gemm`` where ``K = V = 1``,
``general`` elsewhere) in every dtype and on every device, under ``torch.compile`` (the op is a
custom op with its fake) and under ``torch.autocast`` (the conv runs in the autocast dtype, as
fovi's does). fovi_ref follows the formula: a node whose neighbours are all padding gives
``bias`` where fovi's layer gives 0 (no such node in fovi-resnet18).

**Checkpoints and machines.** A fovi layer's graph is built when the model is built, from float32
distances, and is no part of its ``state_dict`` (fovi keeps it as plain attributes). A checkpoint
therefore carries weights only: loaded into a model built on another CPU, whose float32
arithmetic may break a near-tie the other way (fovi_ref's notebook 06, finding 7: a few hundred
of fovi-resnet18's 23,058 nodes can read a different neighbour), it runs on that model's graphs,
converted or not. The adapter reads the graphs of the model it is given, at conversion; it
neither saves nor compares them. (``fovi_ref.KNNConv`` keeps its graph in its ``state_dict``.)

**Refusals** leave the model as it was, checked before anything changes: an object that is not
an ``nn.Module`` or holds no ``KNNConvLayer`` (``ValueError``), a model some layer of which is
already converted (``RuntimeError``), a layer of a kind the adapter cannot run, a subclass of
``KNNConvLayer`` with a computation of its own such as a depthwise one (``TypeError``), or a
layer whose graph cannot be read (``TypeError`` or ``ValueError`` from ``from_layer``).

fovi is not a dependency of fovi_ref: this module imports it when called, and names the install
command where it is missing. It was written against fovi 2.4.0, which fovi_ref's harness
verifies (``python -m fovi_ref verify --fovi``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fovi_ref import KNNMeta, knn_conv

__all__ = ["INSTALL_HINT", "fovi_ref_convs", "knn_conv_layers", "to_fovi", "to_fovi_ref"]

INSTALL_HINT = (
    "pip install fovi==2.4.0 (its KNN layers alone on a CPU, from a fovi_ref checkout: "
    "pip install --no-deps -r scripts/fovi-requirements.txt)"
)


def _knn_conv_layer_class() -> type[nn.Module]:
    """fovi's ``KNNConvLayer``, imported now (ImportError naming :data:`INSTALL_HINT`)."""
    try:
        from fovi.arch.knn import KNNConvLayer
    except ImportError as err:
        raise ImportError(
            f"the fovi adapter needs fovi ({err}); install it: {INSTALL_HINT}"
        ) from err
    return KNNConvLayer


def knn_conv_layers(model: nn.Module, *, subclasses: bool = False) -> dict[str, nn.Module]:
    """``{module name: layer}`` of every fovi ``KNNConvLayer`` of ``model``, in module order:
    exactly that class, or with ``subclasses`` every instance of it."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    conv_layer = _knn_conv_layer_class()
    if subclasses:
        return {n: m for n, m in model.named_modules() if isinstance(m, conv_layer)}
    return {n: m for n, m in model.named_modules() if type(m) is conv_layer}


def to_fovi_ref(model: nn.Module, *, backend: str | None = None) -> dict[str, KNNMeta]:
    """Convert ``model`` in place: every ``KNNConvLayer`` runs ``fovi_ref.knn_conv`` with
    ``backend`` (``None``: the routed dispatcher) until :func:`to_fovi`. Returns ``{module name:
    meta}`` of the layers converted. Refuses, with the model unchanged, what the module
    docstring lists."""
    found = knn_conv_layers(model, subclasses=True)
    if not found:
        raise ValueError(f"{type(model).__name__} holds no fovi KNNConvLayer: not a fovi model")
    conv_layer = _knn_conv_layer_class()
    other_kinds = {n: type(m).__name__ for n, m in found.items() if type(m) is not conv_layer}
    if other_kinds:
        raise TypeError(
            f"layers of a kind fovi_ref does not run (subclasses of KNNConvLayer with their own "
            f"computation): {other_kinds}; the model is unchanged"
        )
    converted = [name for name, layer in found.items() if "forward" in vars(layer)]
    if converted:
        raise RuntimeError(
            f"already converted (or another forward set on the instance): {converted}; "
            "call to_fovi(model) first; the model is unchanged"
        )
    metas = {name: KNNMeta.from_layer(layer) for name, layer in found.items()}  # may raise
    for name, layer in found.items():
        layer.forward = _fovi_ref_forward(layer, metas[name], backend)
    return metas


def to_fovi(model: nn.Module) -> None:
    """Undo :func:`to_fovi_ref`: every converted layer of ``model`` runs fovi's forward again.
    Raises ``ValueError`` (changing nothing) where no layer is converted."""
    converted = [m for m in knn_conv_layers(model).values() if "forward" in vars(m)]
    if not converted:
        raise ValueError(f"no KNNConvLayer of this {type(model).__name__} is converted")
    for layer in converted:
        del layer.forward


@contextmanager
def fovi_ref_convs(model: nn.Module, *, backend: str | None = None) -> Iterator[dict[str, KNNMeta]]:
    """:func:`to_fovi_ref` for the length of the block (yields its metas); leaving the block,
    normally or by an exception, runs :func:`to_fovi`."""
    metas = to_fovi_ref(model, backend=backend)
    try:
        yield metas
    finally:
        to_fovi(model)


def _fovi_ref_forward(layer: nn.Module, meta: KNNMeta, backend: str | None) -> Callable:
    """``layer``'s forward on fovi_ref's op. It holds the layer weakly: a strong reference from
    the layer's own attribute back to the layer would be a cycle."""
    layer_ref = weakref.ref(layer)

    def forward(x: torch.Tensor) -> torch.Tensor:
        owner = layer_ref()
        return knn_conv(x, owner.weight, owner.bias, meta.to(x.device), backend=backend)

    return forward
