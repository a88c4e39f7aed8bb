"""fovi's memory layout for a KNN convolution's output, and the one GEMM that writes it.

fovi's ``KNNConvLayer`` ends with ``F.linear(features [B, Nout, F], weight, bias)`` and returns
the result ``.transpose(1, 2)``: ``y [B, Cout, Nout]`` is a *view* whose storage is node-major,
``[B, Nout, Cout]`` contiguous (strides ``(Nout*Cout, 1, Cout)``). Every fovi_ref backend returns
that layout: a model swapped from fovi to fovi_ref hands the next layer (a BatchNorm) the same
strides, so results stay bit-identical, and a GEMM whose rows are the ``(b, n)`` pairs writes
``[B*Nout, Cout]``, which *is* that storage. The bias goes inside the GEMM (``torch.addmm``, or on
CUDA in 16 bits the float32 accumulator below), as in ``F.linear``, so ``bias + features @ W^T``
is rounded once (adding it after would round twice, which shows in float16 and bfloat16 when the
bias cancels the product). Shapes: ``rows [B*Nout, F]`` (row ``b*Nout + n``), ``weight
[Cout, F]``, ``bias [Cout]``.

**16 bits on CUDA.** There ``addmm`` of 16-bit operands does not always round once: for some
shapes and bias layouts its result is further from the exact sum than one rounding allows, as
if the product were rounded before the bias is added. It shows where the bias cancels the
product, in every backend that ends with ``addmm`` or ``F.linear``, and where the bias is a
strided slice. So on CUDA a 16-bit call takes the GEMM's float32 accumulator (``torch.mm(...,
out_dtype=torch.float32)``, which exists for CUDA only), adds the bias in float32 and rounds
once, by construction. It costs a float32 ``[M, Cout]`` (twice the output's bytes) and two more
passes over it (the bias, the rounding); and ``mm``'s ``out_dtype`` form has no derivative, so
this is a forward's GEMM, run with gradients off (the autograd Function's forward and the
custom ops call it). The battery's ``rounding`` check holds the promise on CUDA
(``python -m fovi_ref check ... --device cuda``).

**bfloat16 on a CPU with native bfloat16 GEMMs** (oneDNN on AVX512-BF16 or AMX). Its kernel
reads each row of a row-major ``rows`` in blocks of :data:`ROW_BLOCK` values and multiplies what
lies past the row's end by zeros. Where a row's length ``F`` is not a multiple of the block, it
reads the first values of the next row there, and an inf among them gives ``0 * inf = nan`` in
the row before: ``y`` of a node that reads no inf (or, in ``gather_gemm``'s dense ``S``, the
``grad_x`` of another channel). So such rows are copied, once, into a buffer
whose rows are padded with zeros to a multiple of the block, and the GEMM reads that buffer's
rows (stride ``F`` rounded up) and their own zeros. fovi-resnet18's layers other than the stem
have ``F = Cin*V`` a multiple of 64 and pay nothing; ``tests/test_precision.py`` holds it where
the GEMM over-reads.
"""

from __future__ import annotations

import torch

from .precision import SIXTEEN_BIT

__all__ = [
    "ROW_BLOCK",
    "fovi_layout_empty",
    "in_fovi_layout",
    "linear_rows",
    "padded_rows",
    "y_from_rows",
]


ROW_BLOCK = 32
"""The block, in values, in which a CPU's bfloat16 GEMM reads a row (64 bytes)."""


def padded_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows [M, F]`` as a view of a copy whose rows are padded with zeros to a multiple of
    :data:`ROW_BLOCK` values (strides ``(F', 1)``, ``F'`` >= ``F``), or ``rows`` itself where a
    CPU's bfloat16 GEMM reads nothing past a row (another dtype or device, a column-major view,
    ``F`` a multiple of the block): the module docstring."""
    f = rows.shape[1]
    if rows.dtype != torch.bfloat16 or rows.is_cuda or rows.stride(1) != 1 or not f % ROW_BLOCK:
        return rows
    padded = rows.new_zeros(rows.shape[0], -(-f // ROW_BLOCK) * ROW_BLOCK)  # [M, F']
    return padded[:, :f].copy_(rows)  # [M, F], its zeros past each row


def linear_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``bias + rows @ weight^T``: ``[M, F] -> [M, Cout]`` in ONE GEMM, the bias added before
    its one rounding."""
    weight = weight.to(rows.dtype)  # float16 rows come as float32: the GEMM's inputs, widened
    rows = padded_rows(rows)  # a CPU's bfloat16 GEMM reads nothing of the next row
    if rows.is_cuda and rows.dtype in SIXTEEN_BIT:
        y = torch.mm(rows, weight.t(), out_dtype=torch.float32)  # [M, Cout] the accumulator
        if bias is not None:
            y += bias.to(rows.dtype).float()  # the 16-bit bias, exact in float32
        return y.to(rows.dtype)  # the one rounding
    if bias is None:
        return rows @ weight.t()  # [M, Cout]
    return torch.addmm(bias.to(rows.dtype), rows, weight.t())  # [M, Cout]


def y_from_rows(y_rows: torch.Tensor, batch: int, n_out: int) -> torch.Tensor:
    """``[B*Nout, Cout]`` (rows ordered ``b``, then ``n``) -> ``y [B, Cout, Nout]``, a view."""
    return y_rows.view(batch, n_out, y_rows.shape[1]).transpose(1, 2)  # [B, Cout, Nout]


def fovi_layout_empty(batch: int, c_out: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised ``[B, Cout, Nout]`` in fovi's layout, dtype and device of ``like``."""
    return like.new_empty(batch, n_out, c_out).transpose(1, 2)  # [B, Cout, Nout]


def in_fovi_layout(y: torch.Tensor) -> torch.Tensor:
    """``y [B, Cout, Nout]`` in fovi's layout (strides ``(Nout*Cout, 1, Cout)``, a size-1 dim's
    stride aside): ``y`` itself where it is laid out so already, else a copy into
    :func:`fovi_layout_empty`.

    The custom op's fake promises this layout, and compiled code trusts the fake: the kernels
    fused after the op read ``y`` by the promised strides. The eager door returns whatever the
    backend returns (fovi's own backends differ in layout); the compiled door hands ``y`` over
    through this function, which copies only for a backend whose layout is not fovi's."""
    batch, c_out, n_out = y.shape
    fovi = (n_out * c_out, 1, c_out)  # [B, Nout, Cout] storage, seen as [B, Cout, Nout]
    if all(n == 1 or s == f for n, s, f in zip(y.shape, y.stride(), fovi, strict=True)):
        return y
    return fovi_layout_empty(batch, c_out, n_out, y).copy_(y)  # [B, Cout, Nout]
