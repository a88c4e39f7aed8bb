"""``fovi_ref::knn_conv`` in ONNX: Gather, one-hot MatMul, one Gemm (``pip install -e ".[onnx]"``).

torch's ONNX exporter (``torch.onnx.export(..., dynamo=True)``) exports through
``torch.export``, where ``knn_conv`` is the custom op ``fovi_ref::knn_conv``; it has no ONNX
function of its own, so :func:`export_onnx` hands the exporter :func:`knn_conv_onnx`::

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

1. pad ``x`` with one zero node, so the padding index ``Nin`` reads an exact zero, and gather
   the neighbours: ``g[b, c, k, n] = x_pad[b, c, knn[k, n]]``;
2. bin them into cells, ``z[n, b, c, v] = sum_k g[b, c, k, n] * onehot[n, k, v]`` (one batched
   MatMul with the one-hot ``rf_index``; a sum over ``k`` when ``V == 1``);
3. ONE Gemm with ``weight [Cout, Cin*V]`` over every (node, sample) row, bias inside, then the
   transpose to ``[B, Cout, Nout]``.

It is fovi's einsum path in ONNX: the cell sums round once more than ``general``'s GEMM-only
path would in 16-bit, and in float32 both stay within the elementwise rule of
:mod:`fovi_ref.check.tolerances` (``tests/test_onnx.py`` judges every layer of the exported
fovi-resnet18 trunk by it). The graph tensors become initializers; the backend's derived data is
not read, and the exporter drops it.

**Why it is needed.** ``torch.onnx.export(model, (x,), dynamo=True)`` alone fails on a model with
``KNNConv`` layers ("No ONNX function found for fovi_ref.knn_conv"). Use it as::

    from fovi_ref.interop.onnx import export_onnx

    model.eval()  # BatchNorm with its running statistics
    export_onnx(model, x, "model.onnx")  # any batch size, not only x's (dynamic_batch=True)
    # or, by hand: torch.onnx.export(model, (x,), "model.onnx", dynamo=True,
    #     custom_translation_table=fovi_ref.interop.onnx.TRANSLATIONS)

**What is checked.** ``tests/test_onnx.py`` exports one layer (batch 1 and 5 from a batch-2
export) and the fovi-resnet18 trunk, runs both in onnxruntime on the CPU, and judges each
convolution's output by the float32 elementwise rule, fed the input onnxruntime fed it (the
trunk's 11 distinct graph and channel combinations of its 20 convolutions), and the trunk's output
no further from the float64 trunk than eager float32's. Inference only: the gradients' custom ops
have no translation. The exporter turns ``knn`` and ``rf_index`` into initializers (with the
one-hot cells folded in where small) and drops the backend's derived data: the trunk's ``.onnx``
is about its weights' size plus its graphs'. One onnxruntime limitation met on the way: a
``KNNConv`` output that is both a graph output and the input of a BatchNorm makes onnxruntime's
graph optimizer fail at session creation (``Failed to find node output ... knn_conv``); the test
taps such outputs with the optimizer off.
"""

from __future__ import annotations

import os

import torch
from onnxscript import opset18 as op

import fovi_ref  # noqa: F401  (registers the custom op torch.ops.fovi_ref.knn_conv)

__all__ = ["OPSET", "TRANSLATIONS", "export_onnx", "knn_conv_onnx"]

OPSET = 18  # the ONNX opset of `op` above; the exported model is written in it


def knn_conv_onnx(
    x, weight, bias, knn, rf_index, derived, names: str, n_in: int, v: int, backend: str
):
    """ONNX for ``fovi_ref::knn_conv(x, weight, bias, knn, rf_index, derived, names, n_in, v,
    backend)``: ``x [B, Cin, Nin]``, ``weight [Cout, Cin*V]``, ``bias [Cout]`` or ``None``,
    ``knn [K, Nout]``, ``rf_index [Nout, K]`` -> ``y [B, Cout, Nout]``. ``derived``, ``names``
    and ``backend`` describe how torch computes it and are not needed here."""
    k, n_out = knn.shape
    c_out, cols = weight.shape  # cols = Cin*V
    padded = op.Pad(x, op.Constant(value_ints=[0, 0, 0, 0, 0, 1]))  # [B, Cin, Nin+1], zero last
    g = op.Gather(padded, knn, axis=2)  # [B, Cin, K, Nout]
    g = op.Transpose(g, perm=[3, 0, 1, 2])  # [Nout, B, Cin, K]
    if v == 1:  # one cell: the bin is the sum over k
        z = op.ReduceSum(g, op.Constant(value_ints=[3]), keepdims=0)  # [Nout, B, Cin]
    else:
        cells = op.CastLike(op.Constant(value_floats=[0.0, 1.0]), x)  # (off, on)
        one_hot = op.OneHot(rf_index, op.Constant(value_int=v), cells, axis=-1)  # [Nout, K, V]
        g = op.Reshape(g, op.Constant(value_ints=[n_out, -1, k]))  # [Nout, B*Cin, K]
        z = op.MatMul(g, one_hot)  # [Nout, B*Cin, V]
    z = op.Reshape(z, op.Constant(value_ints=[-1, cols]))  # [Nout*B, Cin*V], column c*V + v
    if bias is None:
        y = op.MatMul(z, op.Transpose(weight, perm=[1, 0]))  # [Nout*B, Cout]
    else:
        y = op.Gemm(z, weight, bias, transB=1)  # [Nout*B, Cout], bias inside
    y = op.Reshape(y, op.Constant(value_ints=[n_out, -1, c_out]))  # [Nout, B, Cout]
    return op.Transpose(y, perm=[1, 2, 0])  # [B, Cout, Nout]


TRANSLATIONS = {torch.ops.fovi_ref.knn_conv.default: knn_conv_onnx}
"""What ``torch.onnx.export``'s ``custom_translation_table`` needs for fovi_ref's op."""


def export_onnx(
    model: torch.nn.Module,
    x: torch.Tensor,
    path: str | os.PathLike | None = None,
    *,
    dynamic_batch: bool = True,
    **kwargs,
) -> torch.onnx.ONNXProgram:
    """Export ``model(x)`` (``x [B, ...]``, one tensor) to ONNX with :data:`TRANSLATIONS`,
    written to ``path`` if given, and return torch's ``ONNXProgram``. ``dynamic_batch``: the
    batch size is an input dimension (any ``B >= 1``), not the example's. Put the model in
    ``eval()`` first if it has BatchNorm; ``kwargs`` go to ``torch.onnx.export``."""
    dynamic = ({0: torch.export.Dim("batch")},) if dynamic_batch else None
    options = dict(opset_version=OPSET, dynamic_shapes=dynamic, verbose=False) | kwargs
    return torch.onnx.export(
        model, (x,), path, dynamo=True, custom_translation_table=TRANSLATIONS, **options
    )
