"""The harness's switches: blocks within which the op takes a path this machine would not choose.

The op picks two paths from tables of measured data: the dtype of a 16-bit call's GEMMs
(:data:`fovi_ref.precision.GEMM_DTYPES`, by platform) and the way ``gather_gemm``'s
``grad_input`` reaches ``grad_x`` (:data:`fovi_ref.knn_gather_gemm.DENSE_S_BUDGET`, by device
type). The tests, the mutation judge and the benches force each path on any machine with these
switches, so that a path CUDA or another CPU takes is judged here too. Each edits the op's table
for the length of the block and restores it on exit: for one thread, never inside a model that
trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fovi_ref import knn_gather_gemm
from fovi_ref.precision import GEMM_DTYPES, SIXTEEN_BIT, platform

__all__ = ["forced", "forced_grad_input_path"]


@contextmanager
def forced(gemms: str, platform_key: str | None = None) -> Iterator[None]:
    """Within the block, every 16-bit call on ``platform_key`` (default: this CPU's) runs its
    GEMMs ``"narrow"`` (in the input's dtype) or ``"wide"`` (in float32)."""
    if gemms not in ("narrow", "wide"):
        raise ValueError(f"gemms must be 'narrow' or 'wide', got {gemms!r}")
    key = platform("cpu") if platform_key is None else platform_key
    saved = dict(GEMM_DTYPES)
    for dtype in SIXTEEN_BIT:
        GEMM_DTYPES[(key, dtype)] = dtype if gemms == "narrow" else torch.float32
    try:
        yield
    finally:
        GEMM_DTYPES.clear()
        GEMM_DTYPES.update(saved)


@contextmanager
def forced_grad_input_path(path: str, device_type: str = "cpu") -> Iterator[None]:
    """Within the block, ``gather_gemm``'s ``grad_input`` on ``device_type`` takes ``path``
    (``"dense"``: the GEMM with ``S``; ``"index"``: the scatter) wherever an ``S`` exists."""
    if path not in ("dense", "index"):
        raise ValueError(f"path must be 'dense' or 'index', got {path!r}")
    budgets = knn_gather_gemm.DENSE_S_BUDGET
    saved = budgets.get(device_type)
    budgets[device_type] = knn_gather_gemm.S_MAX_ELEMENTS if path == "dense" else -1
    try:
        yield
    finally:
        if saved is None:
            del budgets[device_type]
        else:
            budgets[device_type] = saved
