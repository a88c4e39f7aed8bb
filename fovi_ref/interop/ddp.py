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

Graphs can differ between ranks: fovi's float32 construction depends on the machine
(``help(fovi_ref.check.fovi)``, "Graphs that depend on the machine"). :func:`sync_graphs` compares
a fingerprint per layer in one ``all_reduce`` (SHA-256 of ``knn`` and ``rf_index``, 24 bytes a
layer), then broadcasts rank 0's graph to the layers that differ, once, and sets it through
``layer.meta =`` (validated, re-derived). A ``[K, Nout]`` that differs between ranks raises. Call
it after the graphs and forced backends are final.

**Why this design** (read from torch 2.13's ``distributed.py``):

- DDP collects the buffers to send from ``root.named_buffers()`` before every forward and skips
  only those its root lists. A layer cannot exclude its own buffers, nor hide them without ceasing
  to be buffers, which ``.to()``, ``state_dict`` and ``torch.export`` rely on. So plain
  ``DDP(model)`` cannot skip them; one call on the root is the closest to "by default".
- ``forward_sync_buffers=False`` (new in torch 2.13) also stops the per-step graph traffic, but
  BatchNorm's too, so each rank keeps its own running statistics; :func:`exclude_graphs` changes
  nothing but the graphs' traffic.
- Smaller index dtypes were not taken: the derived data indexes more rows than int16 holds (int32
  at best: half the bytes, still sent every step), and ``general`` runs ``index_copy_``, which
  torch 2.13 refuses with int32 indices.

**What is checked and measured.** ``tests/test_ddp.py`` runs two gloo processes on the CPU whose
first layer's graphs differ: rank 1 adopts rank 0's graph, no graph buffer is in DDP's per-step
broadcast list and BatchNorm's buffers are, and the losses of three SGD steps equal, bitwise, one
process doing each rank's work with the gradients averaged as DDP averages them.
``scripts/ddp_bench.py --batch 4`` times an SGD step of the trunk with and without the graphs in
the broadcast, interleaved in one run, and the broadcast of the same bytes alone; its docstring
gives what it measured where this repository is developed. On GPUs with NCCL both the step and
the broadcast are far shorter (not measured: no GPU where this is developed).

**BatchNorm on the CPU.** ``torch.nn.SyncBatchNorm`` refuses CPU tensors in torch 2.13. Keep
``nn.BatchNorm1d``: each rank normalizes with its own batch's statistics, and DDP keeps
broadcasting rank 0's running statistics.

**Checkpoints carry the graph.** Save ``ddp.module.state_dict()`` on rank 0: it holds every
layer's ``knn`` and ``rf_index`` (the derived data is derived again on load). Loading it into a
model built on another machine replaces that machine's graphs with the ones trained on
(validated first); ``tests/test_ddp.py`` checks it.

**A fork-context** ``multiprocessing.Pool`` **can hang** (a data-loading pool, say): once torch's
intra-op thread pool has run, workers forked from that process can hang in torch's parallel ops.
That is torch's behaviour, not fovi_ref's (which starts no processes); an initializer that calls
``torch.set_num_threads(1)`` avoids it (``tests/test_ddp.py`` runs it), and so does a ``spawn``
context.
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
    return [
        f"{name}.{buffer}" if name else buffer  # a root KNNConv's are unprefixed
        for name, conv in _convs(model)
        for buffer, _ in conv.named_buffers(recurse=False)
    ]


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
    largest = both[: len(convs)]
    smallest = -both[len(convs) :]
    shape = (largest[:, 1:] != smallest[:, 1:]).any(dim=1)  # [L]
    if bool(shape.any()):
        names = [convs[i][0] for i in shape.nonzero().flatten().tolist()]
        raise ValueError(
            f"the graphs of {names} have another [K, Nout] on some rank: build the "
            "model with the same settings on every rank"
        )
    differ = (largest[:, 0] != smallest[:, 0]).nonzero().flatten().tolist()
    for i in differ:
        conv = convs[i][1]
        knn = conv.knn.clone()
        rf_index = conv.rf_index.clone()
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
