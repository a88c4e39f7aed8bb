"""Fingerprints of a KNN graph, to pin it in a file and compare it with fovi's without fovi.

Two levels, both computed from ``knn [K, Nout]`` (padding = ``Nin``) and
``rf_index [Nout, K]``, in the layout of :class:`~fovi_ref.meta.KNNMeta` (fovi's
``knn_indices_pad_token`` and ``local_rf.argmax(-1)``):

- :func:`tensor_sha256`: sha256 of a tensor's little-endian int64 bytes. Equal digests of ``knn``
  and of ``rf_index`` mean element-wise identical tensors, neighbour order included.
- :func:`node_digits`: one hex digit per output node, the first digit of
  ``sha256(repr(sorted((knn[k, n], rf_index[n, k]) for k)))``. It ignores the order of a node's
  neighbours (which the convolution ignores too) and says *which* nodes differ when the tensors
  do; two different nodes collide with probability 1/16.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["node_agreement", "node_digits", "tensor_sha256"]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 (hex) of ``t``'s values as contiguous little-endian int64, row-major."""
    values = t.detach().cpu().to(torch.int64).contiguous().numpy().astype("<i8", copy=False)
    return hashlib.sha256(values.tobytes()).hexdigest()


def node_digits(knn: torch.Tensor, rf_index: torch.Tensor) -> str:
    """One hex digit per output node for the set of its (neighbour, cell) pairs.

    Args:
        knn: ``[K, Nout]`` neighbour indices. rf_index: ``[Nout, K]`` cell of each neighbour.

    Returns:
        A string of ``Nout`` hex digits.
    """
    neighbours = knn.detach().cpu().t().tolist()  # [Nout][K] python ints
    cells = rf_index.detach().cpu().tolist()  # [Nout][K]
    digits = []
    for node_neighbours, node_cells in zip(neighbours, cells, strict=True):
        pairs = sorted(zip(node_neighbours, node_cells, strict=True))
        digits.append(hashlib.sha256(repr(pairs).encode()).hexdigest()[0])
    return "".join(digits)


def node_agreement(got: str, expected: str) -> int:
    """How many nodes carry the same digit in two :func:`node_digits` strings of equal length."""
    if len(got) != len(expected):
        raise ValueError(f"digit strings of different lengths: {len(got)} != {len(expected)}")
    return sum(a == b for a, b in zip(got, expected, strict=True))
