"""fovi 2.4.0: four backends round W x to float16/bfloat16 before adding the bias.

What: in float16 (or bfloat16), torch_compact, gather_gemm, torch_cached and torch_scatter
round the product W x to 16 bits and then add the bias in 16 bits, a second rounding; fovi's
baseline (one addmm) rounds W x + b once. Where W x nearly cancels the bias, the first rounding
is the whole error: here W x = 1 + 3 * 2^-12 rounds to 1 + 2^-10, and y = W x - 1 comes out
2^-10 instead of 3 * 2^-12 (33% off).
Where: fovi/arch/knn_autograd.py, CompactTorchOps.forward (y += bias after the bmm);
fovi/arch/knn_gather_gemm.py, GatherGemmOps.forward (output += bias after the matmul);
fovi/arch/knn_optimization.py, _torch_cached_forward (output + bias after the bmm);
fovi/arch/knn_autograd.py, scatter_forward (F.linear on the non-contiguous view `binned`, which
torch computes as matmul, then bias add, where a contiguous input gets one addmm).
Expected: y accumulated in float32 and rounded once, error at most u16 |y| + n u32 sum|terms|.
Measured: one line per backend (fovi's baseline first, for comparison).
Suggested fix: add the bias inside the GEMM (torch.baddbmm / torch.addmm with the bias as the
added term), or accumulate W x in float32 and add the bias before the one rounding; give
F.linear a contiguous input in scatter_forward.
Run: python half_bias_double_rounding.py (exits 1 while the defect is present, 0 once fixed).
"""

import os
import sys
import warnings

import torch
from fovi.arch.knn import KNNConvLayer, get_in_out_coords

warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own, at construction
inputs, outputs, _ = get_in_out_coords(4, 16, 0.5, 2, auto_match_cart_resources=0, device="cpu")
layer = KNNConvLayer(2, 1, 1, inputs, outputs, device="cpu", bias=True).half()  # K = V = 1
with torch.no_grad():
    layer.weight.copy_(torch.tensor([[1.0, 3 * 2.0**-12]]))  # [Cout, Cin]
    layer.bias.fill_(-1.0)
x = torch.zeros(1, 2, 16, dtype=torch.float16)
x[0, :, layer.knn_indices_pad_token[0, 0]] = 1.0  # output node 0 reads [1, 1]
terms = [1.0, 3 * 2.0**-12, -1.0]  # w[0,0] x[0] + w[0,1] x[1] + b: each exact in float16
expected, size = sum(terms), sum(abs(t) for t in terms)
tol = 2.0**-11 * abs(expected) + 3 * 2.0**-24 * size  # one float16 rounding + float32 sums
failed = False
for backend in ("baseline", "torch_compact", "gather_gemm", "torch_cached", "torch_scatter"):
    os.environ["FOVI_KNN_BACKEND"] = backend  # fovi's own override of the layer's backend
    with torch.no_grad():
        actual = float(layer(x)[0, 0, 0])
    err = abs(actual - expected)
    print(
        f"{backend}: expected {expected:.9g} actual {actual:.9g} error {err:.1e} "
        f"tolerance {tol:.1e}"
    )
    failed |= err > tol
sys.exit(int(failed))
