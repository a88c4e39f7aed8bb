"""The arithmetic a verdict is reached under: the device, and the math settings that move results.

A float32 or 16-bit result depends on more than the code that computed it. PyTorch keeps global
switches that let a library trade accuracy for speed, and a verdict means something only beside
the switches it was reached under:

- ``matmul_precision`` (:func:`torch.get_float32_matmul_precision`): ``"highest"`` computes
  float32 GEMMs in float32; ``"high"`` and ``"medium"`` let them use TF32 or bfloat16 inputs
  (unit roundoff ``2^-11`` or ``2^-8`` per factor instead of ``2^-24``);
- ``cudnn_allow_tf32``: the same for cuDNN's convolutions (on by default);
- ``fp16_reduced_precision_reduction`` and ``bf16_reduced_precision_reduction``
  (``torch.backends.cuda.matmul.allow_*_reduced_precision_reduction``, on by default): cuBLAS
  may reduce split-K partial sums of a 16-bit GEMM in 16 bits;
- ``fp16_accumulation`` (``allow_fp16_accumulation``, off by default): float16 GEMMs may
  accumulate in float16;
- ``deterministic``: :func:`torch.are_deterministic_algorithms_enabled`.

:func:`arithmetic_settings` reads them all (with the device and its name); every report of the
harness (``check``, ``verify``, ``verify --fovi``, ``bench``) stores that dict and prints
:func:`describe`'s lines. :func:`verdict_arithmetic` is the context in which the harness *judges*:
it turns off every switch that breaks the error analysis of :mod:`fovi_ref.check.tolerances`
(its section "CUDA math settings" says why each one) and restores them on exit. The bench does
not use it: it times what a user gets, under whatever settings are in force, and records them.

A switch that the installed torch does not have reads as ``None`` and is left alone (the
``*_split_k`` parts of the reduction flags are newer than torch 2.11, for instance).
"""

from __future__ import annotations

import platform
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["arithmetic_settings", "describe", "verdict_arithmetic"]

_CUBLAS = torch.backends.cuda.matmul
# setting name -> attribute of torch.backends.cuda.matmul, and the value a verdict needs
_CUBLAS_SWITCHES = {
    "fp16_reduced_precision_reduction": ("allow_fp16_reduced_precision_reduction", False),
    "bf16_reduced_precision_reduction": ("allow_bf16_reduced_precision_reduction", False),
    "fp16_accumulation": ("allow_fp16_accumulation", False),
}


def _cublas(attribute: str) -> bool | None:
    """A cuBLAS switch, or ``None`` where this torch does not have it."""
    try:
        return bool(getattr(_CUBLAS, attribute))
    except (AttributeError, RuntimeError):
        return None


def _device_name(device: torch.device) -> str:
    """``NVIDIA H200`` for a GPU; the processor's architecture for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.machine() or "unknown"


def arithmetic_settings(device: torch.device | str = "cpu") -> dict:
    """The device, its name, the CPU threads, the torch version and every switch listed in the
    module docstring, as a JSON-ready dict (a switch this torch lacks is ``None``)."""
    device = torch.device(device)
    settings = {
        "device": str(device),
        "device_name": _device_name(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }
    for name, (attribute, _) in _CUBLAS_SWITCHES.items():
        settings[name] = _cublas(attribute)
    settings["deterministic"] = torch.are_deterministic_algorithms_enabled()
    return settings


def describe(settings: dict) -> str:
    """A report's header, ``arithmetic: cuda (NVIDIA H200, 16 CPU threads), torch ...; matmul
    precision highest, ...`` (the switches this torch lacks left out), wrapped within 100
    columns as every printed table is."""
    on_off = {True: "on", False: "off"}
    parts = [
        f"matmul precision {settings['matmul_precision']}",
        f"cuDNN TF32 {on_off[settings['cudnn_allow_tf32']]}",
    ]
    for name, label in (
        ("fp16_reduced_precision_reduction", "fp16 reduced-precision reduction"),
        ("bf16_reduced_precision_reduction", "bf16 reduced-precision reduction"),
        ("fp16_accumulation", "fp16 accumulation"),
    ):
        if settings[name] is not None:
            parts.append(f"{label} {on_off[settings[name]]}")
    parts.append(f"deterministic algorithms {on_off[settings['deterministic']]}")
    head = (
        f"arithmetic: {settings['device']} ({settings['device_name']}, "
        f"{settings['threads']} CPU threads), torch {settings['torch']}"
    )
    return textwrap.fill(head + "; " + ", ".join(parts), width=100, subsequent_indent="  ")


@contextmanager
def verdict_arithmetic() -> Iterator[None]:
    """Within the block: float32 matmul precision ``"highest"``, cuDNN TF32 off, and cuBLAS's
    16-bit reduced-precision reductions and float16 accumulation off; every switch restored on
    exit, also on an error. The settings are process-wide, so this is not for threads that run
    other work meanwhile. On a CPU they change nothing that fovi_ref's kernels use; they are set
    on every device all the same, so that a report's settings never depend on where it ran."""
    saved_precision = torch.get_float32_matmul_precision()
    saved_cudnn = torch.backends.cudnn.allow_tf32
    saved_cublas = {}
    for attribute, wanted in _CUBLAS_SWITCHES.values():
        if _cublas(attribute) is None:
            continue
        split_k = _cublas(f"{attribute}_split_k")  # None where this torch has no split-K part
        saved = _cublas(attribute) if split_k is None else (_cublas(attribute), split_k)
        saved_cublas[attribute] = saved
        setattr(_CUBLAS, attribute, wanted)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        torch.backends.cudnn.allow_tf32 = saved_cudnn
        for attribute, saved in saved_cublas.items():
            setattr(_CUBLAS, attribute, saved)
