"""K nearest neighbours in cortical space, with pad coordinates taking part.

For output node ``n`` (cortical position ``q_n``) the candidates are the ``Nin`` input sampling
points ``p_0 .. p_{Nin-1}`` followed by the input sampling's ``P`` pad coordinates
``p_{Nin} .. p_{Nin+P-1}``. The neighbours are the ``K`` candidates nearest to ``q_n`` (Euclidean
distance in 3-D cortical coordinates), nearest first::

    raw[:, n] = argsort_k |p_i - q_n|         raw [K, Nout], entries in [0, Nin + P)
    knn = where(raw >= Nin, Nin, raw)         knn [K, Nout], entries in [0, Nin]

so a pad coordinate among the neighbours becomes the padding index ``Nin`` *in its sorted place*
(padding is interleaved with real neighbours by distance, not appended). ``K`` is capped at ``Nin``
(not ``Nin + P``): a layer never asks for more neighbours than it has inputs.

Distances are computed with :func:`torch.cdist`, exactly as fovi does: for more than 25 points it
uses the expansion ``|p|^2 + |q|^2 - 2 p.q``, whose float32 rounding differs from a direct
difference; reproducing it keeps near-ties (common on these symmetric rings) resolved as in fovi.
Like fovi 2.4.0, large layers are processed in batches of output nodes, so that no distance
matrix holds more than about ``5e8`` entries (:func:`output_batch_size`). The batches are part of
the arithmetic: ``cdist``'s matrix product rounds differently for a different number of columns,
which can resolve a near-tie the other way, so the batches are fovi's, not merely its formula.
With ``fov=16, cmf_a=0.5`` the resnet18 stem is the first layer to be split, from ``in_res=166``.
"""

from __future__ import annotations

import torch

from fovi_ref.geometry.sampling import FoveatedSampling

__all__ = ["capped_k", "nearest_neighbours", "output_batch_size"]

_MAX_DISTANCES = 500_000_000  # fovi's bound on the entries of one batch's distance matrix


def capped_k(k: int, n_in: int) -> int:
    """The neighbour count actually used: ``min(k, n_in)``."""
    return min(k, n_in)


def output_batch_size(n_candidates: int, n_out: int) -> int:
    """Output nodes per distance batch: ``n_out / max(1e-4, n_candidates n_out / 5e8)``, capped.

    The same rule and float64 arithmetic as fovi 2.4.0 (truncated to an int, at most ``n_out``).
    """
    pairs = n_candidates * n_out
    return int(min(n_out / max(0.0001, pairs / _MAX_DISTANCES), n_out))


def nearest_neighbours(
    inputs: FoveatedSampling, outputs: FoveatedSampling, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``K = min(k, Nin)`` cortical nearest neighbours of every output node.

    Args:
        inputs: the layer's input sampling (its points and its pad coordinates are candidates).
        outputs: the layer's output sampling.
        k: requested neighbour count.

    Returns:
        ``(raw, knn)``, both ``[K, Nout]`` int64, nearest first. ``raw`` indexes the candidates
        (``i >= Nin`` is pad coordinate ``i - Nin``); ``knn`` has every pad coordinate replaced by
        the padding index ``Nin``.
    """
    n_in = inputs.n
    k = capped_k(k, n_in)
    candidates = torch.cat([inputs.cortical, inputs.pad_cortical], dim=0)  # [Nin+P, 3]
    batch = output_batch_size(candidates.shape[0], outputs.n)
    raw = torch.cat(
        [
            torch.topk(
                torch.cdist(candidates, outputs.cortical[start : start + batch]),  # [Nin+P, B]
                k,
                dim=0,
                largest=False,
            ).indices  # [K, B]
            for start in range(0, outputs.n, batch)
        ],
        dim=1,
    )  # [K, Nout]
    knn = raw.clamp(max=n_in)  # [K, Nout]: every pad coordinate -> padding index Nin
    return raw, knn
