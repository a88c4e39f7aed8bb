"""``DistributedDataParallel`` without sending the graphs every step.

A :class:`~fovi_ref.KNNConv` keeps its graph as buffers: ``knn``, ``rf_index`` and its backend's
derived data (fovi-resnet18's trunk: 44 MB of int64, more than its 29 MB of parameters). DDP's
default (``broadcast_buffers``, in torch 2.13 ``forward_sync_buffers=True``) broadcasts rank 0's
buffers before every forward, so the graphs travel every step although they never change. DDP
skips the buffers its *root* module names in ``_ddp_params_and_buffers_to_ignore`` (fully
qualified names; torch 2.13 reads no such list on a submodule), in the per-step broadcast and in
its one-time sync at construction alike. :func:`exclude_graphs` sets that list on the root, after
:func:`sync_graphs` has done what the skipped construction-time sync would have done: every rank
holds rank 0's graphs. Everything else (BatchNorm's running statistics) is broadcast as before::

    model = exclude_graphs(model)                                # every rank, before DDP
    ddp = torch.nn.parallel.DistributedDataParallel(model)      # graphs: no traffic per step

Graphs can differ between ranks: fovi's float32 construction depends on the machine (README,
"Graphs that depend on the machine"). :func:`sync_graphs` compares a fingerprint per layer in
one ``all_reduce`` (a few bytes a layer) and sends only the graphs that differ, once.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from fovi_ref import KNNConv, KNNMeta

__all__ = ["exclude_graphs", "graph_buffer_names", "sync_graphs"]

_IGNORE = "_ddp_params_and_buffers_to_ignore"  # the list DDP reads on the root module


def _convs(model: nn.Module) -> list[tuple[str, KNNConv]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, KNNConv)]


def graph_buffer_names(model: nn.Module) -> list[str]:
    """The fully qualified names of every ``KNNConv``'s buffers in ``model``: its graph and the
    data derived from it (a ``KNNConv`` holds no other buffer)."""
    return [f"{name}.{buffer}" if name else buffer  # a root KNNConv's are unprefixed
            for name, conv in _convs(model)
            for buffer, _ in conv.named_buffers(recurse=False)]  # fmt: skip


def _fingerprint(conv: KNNConv) -> list[int]:
    """``[hash, K, Nout]`` of a layer's graph: 63 bits of SHA-256 over ``knn`` and ``rf_index``."""
    digest = hashlib.sha256()
    for t in (conv.knn, conv.rf_index):
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return [int.from_bytes(digest.digest()[:8], "little") >> 1, *conv.knn.shape]


def sync_graphs(model: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """Give every rank of ``group`` rank 0's graphs (what DDP's construction-time sync would do
    for them), sending only the graphs that differ. Call it on every rank. Returns the names of
    the ``KNNConv`` layers that differed (the same list on every rank); a differing layer gets rank
    0's graph through ``layer.meta = ...``, validated and re-derived. Raises ``ValueError`` if a
    layer's ``[K, Nout]`` differs between ranks (a model built with other settings)."""
    convs = _convs(model)
    if not convs:
        return []
    device = convs[0][1].knn.device
    mine = torch.tensor([_fingerprint(conv) for _, conv in convs], device=device)  # [L, 3]
    both = torch.cat([mine, -mine])  # [2L, 3]: one MAX gives the largest and the smallest
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = both[: len(convs)], -both[len(convs) :]
    shape = (largest[:, 1:] != smallest[:, 1:]).any(dim=1)  # [L]
    if bool(shape.any()):
        names = [convs[i][0] for i in shape.nonzero().flatten().tolist()]
        raise ValueError(f"the graphs of {names} have another [K, Nout] on some rank: build the "
                         "model with the same settings on every rank")  # fmt: skip
    differ = (largest[:, 0] != smallest[:, 0]).nonzero().flatten().tolist()
    for i in differ:
        conv = convs[i][1]
        knn, rf_index = conv.knn.clone(), conv.rf_index.clone()
        dist.broadcast(knn, group=group, group_src=0)
        dist.broadcast(rf_index, group=group, group_src=0)
        meta = conv.meta
        conv.meta = KNNMeta(knn, rf_index, meta.n_in, meta.in_channels, meta.v)
    return [convs[i][0] for i in differ]


def exclude_graphs(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Prepare the root ``model`` for ``DistributedDataParallel(model, process_group=group)``:
    :func:`sync_graphs`, then add :func:`graph_buffer_names` to the list of buffers DDP ignores,
    so that no graph is broadcast, at construction or per step. Call it on every rank, with the
    model on its device (NCCL reduces CUDA tensors), after the graphs and forced backends are
    final (another backend's derived data has other names); returns ``model``."""
    sync_graphs(model, group)
    ignored = list(getattr(model, _IGNORE, []))
    setattr(model, _IGNORE, ignored + [n for n in graph_buffer_names(model) if n not in ignored])
    return model
