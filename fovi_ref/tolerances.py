"""What "close enough to the float64 oracle" means for each dtype, and why.

Every check compares a result against :func:`fovi_ref.reference.knn_conv_reference` run in
float64 on the *same* (already rounded) inputs, so input rounding is not counted: what is left is
the backend's own arithmetic. Errors are measured relative to the result's scale::

    err(value) = max |value - ref| / max |ref|

A result in ``dtype`` passes when both hold:

1. ``err(op) <= 2 * err(baseline) + FLOOR[dtype]``: no more than twice the error of
   ``einsum_baseline`` (what fovi runs today) computed in the same dtype on the same inputs. This
   is the test that means something: the backend loses no accuracy that the existing
   implementation keeps. The floor covers a baseline that is luckier than rounding allows one to
   expect. In float16/bfloat16 every backend accumulates in float32 and rounds once at the end, so
   the error is that last rounding, at most ``u`` (the unit roundoff) of the scale: floor ``u``.
   In float32 the error is the accumulation order of an ``n``-term sum, which differs between
   two correct GEMM kernels by ``~sqrt(n) u`` (a random walk of roundings). The sums over
   channels and neighbours have up to ``Cin*K = 2304`` (y) and ``Cout*K = 4608`` (grad_x) terms
   in fovi-resnet18, so the floor is ``sqrt(4096) u = 64u`` (3.8e-6). ``grad_weight`` and
   ``grad_bias`` sum ``B*Nout`` terms, which grows with the batch (5876 for the stem at batch 4);
   there the baseline sums the same terms, so its own error grows alike and the factor 2 covers
   the difference. Seen here: in ``python -m fovi_ref verify`` (batch 4)
   ``general``'s forward on layer4.1.conv1, one ``[512, 2048] @ [2048, 8]`` GEMM, has error 20u
   where ``einsum_baseline``'s differently shaped GEMM gets 4u; both are correct float32 sums.
   (In float64 the same floor never binds.)
2. ``err(op) <= ABSOLUTE[dtype]``: a ceiling that holds whatever the baseline does, so two
   backends cannot drift together. In float16/bfloat16 the error is dominated by rounding the
   output and the intermediate (cell-summed or gathered) features, about ``u`` each, so the
   ceiling is ``8u``. In float32 it is dominated by accumulating up to ``Cin*K`` or ``B*Nout``
   (~1e4) products, ``~sqrt(n) u`` for random signs, so the ceiling is ``1e-5`` (~170u). In
   float64 ``1e-12`` is ~9000u: far above rounding, far below any indexing mistake (which shows
   as an error of order 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ABSOLUTE",
    "BASELINE_FACTOR",
    "FLOOR",
    "UNIT_ROUNDOFF",
    "Verdict",
    "judge",
    "relative_error",
]

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
BASELINE_FACTOR = 2.0
FLOOR: dict[torch.dtype, float] = {
    torch.float64: 64 * UNIT_ROUNDOFF[torch.float64],
    torch.float32: 64 * UNIT_ROUNDOFF[torch.float32],
    torch.float16: UNIT_ROUNDOFF[torch.float16],
    torch.bfloat16: UNIT_ROUNDOFF[torch.bfloat16],
}
ABSOLUTE: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 8 * UNIT_ROUNDOFF[torch.float16],
    torch.bfloat16: 8 * UNIT_ROUNDOFF[torch.bfloat16],
}


def relative_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |value - ref| / max |ref|`` in float64 (``max |value - ref|`` if ``ref`` is all 0)."""
    diff = (value.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class Verdict:
    """The outcome of one comparison; ``str()`` gives a one-line summary."""

    dtype: torch.dtype
    error: float
    baseline_error: float | None
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    def __str__(self) -> str:
        base = "" if self.baseline_error is None else f" baseline {self.baseline_error:.1e}"
        return f"{'PASS' if self.ok else 'FAIL'} err {self.error:.1e} <= {self.bound:.1e}{base}"


def judge(value: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor | None = None) -> Verdict:
    """Apply the two rules above to ``value`` (in its own dtype) against float64 ``ref``.

    ``baseline`` is the same quantity from ``einsum_baseline`` in the same dtype; without it only
    the absolute ceiling applies (used to check the baseline itself, and in float64).
    """
    dtype = value.dtype
    error = relative_error(value, ref)
    bound = ABSOLUTE[dtype]
    baseline_error = None
    if baseline is not None:
        baseline_error = relative_error(baseline, ref)
        bound = min(bound, BASELINE_FACTOR * baseline_error + FLOOR[dtype])
    return Verdict(dtype, error, baseline_error, bound)
