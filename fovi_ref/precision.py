"""The dtype the GEMMs of a 16-bit call run in: the one precision choice every backend follows.

float32 and float64 inputs run every GEMM in their own dtype. For float16 and bfloat16 inputs a
backend has two ways to run the GEMMs of the operator; in both the products of two 16-bit values
are exact and their sum is accumulated in float32:

- **wide**: the operands widened to float32, a float32 GEMM. The binned cells ``z`` (summed in
  float32) are never stored in 16 bits, and ``y`` and every gradient are rounded once, at the end.
- **narrow**: a 16-bit GEMM, which accumulates in float32 and rounds its result once. The binned
  cells are summed in float32 and *stored once* in 16 bits before the GEMM reads them (fovi's
  einsum stores them too), and so is ``grad_z = weight^T grad_y`` before it is summed back onto
  the inputs (:func:`stored_product`). Each store is one rounding, at most ``u`` times the stored
  value, because a value is stored in 16 bits only where it fits (below). These two stores are
  the only roundings besides the result's, and the tolerance rule allows them
  (``fovi_ref.check.tolerances``, step 2 (c)); a store past the dtype's range, which is no
  bounded rounding, it does not.

Narrow costs one rounding of each stored value ``s``, at most ``u |s|`` (``u = 2^-8`` in bfloat16),
and buys the 16-bit GEMM, where the hardware has one: tensor cores on a GPU, AVX512-BF16 or AMX on
a CPU. Where it has none, a 16-bit GEMM is emulated and far slower than a float32 one, and wide is
both faster and more accurate. So the choice is a fact about the hardware, kept as data:
:data:`GEMM_DTYPES`, keyed by :func:`platform` and the input dtype. ``python -m fovi_ref bench
--gemm-dtypes`` times a GEMM of each dtype on this machine and writes a record, and the harness
says where each entry comes from, measured or derived
(``fovi_ref.check.bench.gemm_dtypes.GEMM_DTYPE_SOURCES``); ``tests/test_precision.py`` holds
every measured entry to its record.

**What torch gives** (checked in ``tests/test_precision.py`` and ``tests/test_tolerances.py``):
on a CPU, ``mm``, ``addmm``, ``matmul``, ``bmm``, ``F.linear`` and ``einsum`` of 16-bit operands
accumulate in float32 and return 16 bits, and none returns its float32 accumulator
(``torch.mm(..., out_dtype=torch.float32)`` is refused there; it exists for CUDA). So a 16-bit
product is rounded once as it is returned, and a narrow path must not add such products up
further: :mod:`fovi_ref.strategies.occupied_cells` runs wide for that reason.

**float16 values past 65504.** A cell sum that float16 cannot hold would be stored as inf, making
``y`` inf where the exact answer is finite (a small weight can bring it back into range); a
``grad_z`` past 65504 (upstream gradients under a gradient scaler, which starts at ``2^16``) would
be inf, and two readers of one input carrying it with opposite signs would give
``inf - inf = nan`` where the exact ``grad_x`` is small. So a narrow float16 call stores either
operand in 16 bits only where every value fits, and otherwise keeps that operand in float32 and
runs that one GEMM (or unbinning) wide (:func:`store_operand`, the one guard). Its price, paid by
narrow float16 calls only: for ``grad_z`` the GEMM writes its float32 sum (twice the 16-bit
bytes, beside the 16-bit copy), and the guard reads it once more for its largest magnitude (on a
GPU the host waits for that); for the cells, which are summed in float32 anyway, only that read.
bfloat16 has float32's range: no such case.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "GEMM_DTYPES",
    "SIXTEEN_BIT",
    "gemm_dtype",
    "platform",
    "store_operand",
    "stored_product",
]

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
"""The input dtypes whose GEMMs may run wide or narrow."""

GEMM_DTYPES: dict[tuple[str, torch.dtype], torch.dtype] = {
    ("cpu", torch.bfloat16): torch.float32,
    ("cpu", torch.float16): torch.float32,
    ("cpu_bf16", torch.bfloat16): torch.bfloat16,
    ("cpu_bf16", torch.float16): torch.float32,
    ("cuda", torch.bfloat16): torch.bfloat16,
    ("cuda", torch.float16): torch.float16,
}
"""The dtype of the GEMMs of a 16-bit call, by ``(platform, input dtype)``: float32 is wide, the
input's own dtype narrow. A platform missing here runs wide."""


@functools.cache
def _cpu_has_bf16_gemm() -> bool:
    """Whether this CPU runs bfloat16 GEMMs natively (AVX512-BF16 or AMX). torch answers through
    private functions of ``torch.cpu`` (present in torch 2.1 to 2.13); without them, no."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def platform(device: torch.device | str) -> str:
    """The key of :data:`GEMM_DTYPES` for ``device``: ``"cuda"``; ``"cpu_bf16"`` for a CPU with a
    native bfloat16 GEMM, else ``"cpu"``; any other device type as it is (it runs wide)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu_bf16" if _cpu_has_bf16_gemm() else "cpu"
    return device.type


def gemm_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the GEMMs of a ``dtype`` call on ``device`` run in: ``dtype`` itself unless it is
    16-bit, then :data:`GEMM_DTYPES`' entry (float32 where there is none)."""
    if dtype not in SIXTEEN_BIT:
        return dtype
    return GEMM_DTYPES.get((platform(device), dtype), torch.float32)


def store_operand(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 sum of a 16-bit call (the binned cells ``z``, or ``grad_z``) as the next step of a
    ``dtype`` call reads it: stored once in :func:`gemm_dtype`, or kept as it is where that is its
    dtype or where float16 could not hold it (the module docstring). The check reads every value
    (on a GPU it waits for them); only a narrow float16 call pays it."""
    target = gemm_dtype(z.device, dtype)
    if target == z.dtype:
        return z
    fits = target != torch.float16 or not z.numel()
    if not fits and not bool(z.abs().amax() <= torch.finfo(torch.float16).max):
        return z  # a value past 65504 (or non-finite): this operand stays wide
    return z.to(target)


def stored_product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [K, N]``, a GEMM of a ``dtype`` call whose result is stored before it is
    summed further (``grad_z = weight^T grad_y``), run in :func:`gemm_dtype`. A narrow float16
    call takes the GEMM's float32 sum and stores it with :func:`store_operand`, so a value past
    65504 keeps the product in float32 instead of becoming inf: on CUDA ``mm``'s ``out_dtype``
    returns that sum; a CPU has no such form, so there the widened operands (whose products are
    exact in float32, as inside a 16-bit GEMM) run a float32 GEMM. Every other call runs its one
    GEMM as it is: float32 and float64 (wide), bfloat16 (narrow; float32's range, so its one
    rounding is bounded)."""
    target = gemm_dtype(a.device, dtype)
    a, b = a.to(target), b.to(target)
    if target != torch.float16:
        return a @ b
    if a.is_cuda:  # [M, N] the 16-bit GEMM's float32 sum
        return store_operand(torch.mm(a, b, out_dtype=torch.float32), dtype)
    return store_operand(a.float() @ b.float(), dtype)  # the same products, summed in float32
