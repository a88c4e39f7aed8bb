"""The backends ``knn_conv`` can run, by name: the four built-in ones, registered on import, and
any other following the protocol of :mod:`fovi_ref.knn_autograd` (:func:`register_ops`)."""

from __future__ import annotations

from typing import Any

from fovi_ref.knn_einsum_baseline import EinsumBaselineOps
from fovi_ref.knn_gather_gemm import GatherGemmOps
from fovi_ref.knn_general import GeneralTextbookOps
from fovi_ref.strategies import GeneralOps

__all__ = ["available_ops", "get_ops", "register_ops", "unregister_ops"]

_REGISTRY: dict[str, Any] = {}


def register_ops(ops: Any) -> None:
    """Add a backend under ``ops.name`` (``TypeError`` without a name, ``ValueError`` if taken).
    Validate it first with :func:`fovi_ref.check.protocol.check_protocol`."""
    name = getattr(ops, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"ops must have a non-empty str attribute 'name', got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"an ops backend named {name!r} is already registered")
    _REGISTRY[name] = ops


def unregister_ops(name: str) -> None:
    """Remove a backend added with :func:`register_ops` (built-ins included)."""
    if name not in _REGISTRY:
        raise ValueError(f"no ops backend named {name!r}; available: {available_ops()}")
    del _REGISTRY[name]


def get_ops(name: str) -> Any:
    """The backend registered as ``name``; ``ValueError`` listing the choices otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__} {name!r}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {available_ops()}")
    return _REGISTRY[name]


def available_ops() -> list[str]:
    """Names of the registered backends, sorted."""
    return sorted(_REGISTRY)


for _builtin in (GeneralOps, GeneralTextbookOps, GatherGemmOps, EinsumBaselineOps):
    register_ops(_builtin)
