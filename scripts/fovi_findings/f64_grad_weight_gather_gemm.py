"""fovi 2.4.0: the gather_gemm backend returns a float32 weight gradient for float64 weights.

What: a float64 K = 1 KNNConvLayer (fovi-resnet18's downsample convolutions) run with
kernel_backend="gather_gemm" (the choice of fovi's dispatcher for such layers on CUDA) returns
a float64 grad_weight holding float32 numbers: errors of float32 size (about 1e-7 relative)
where float64 arithmetic gives about 1e-16. Its grad_x is float64 throughout.
Where: fovi/arch/knn_gather_gemm.py, GatherGemmOps.grad_weight, which ends with
dw.to(torch.float32); then fovi/arch/knn_autograd.py, KNNConvFunction.backward casts the result
back to float64.
Expected: a float64 gradient, as fovi's baseline gives it.
Measured: the line this prints (the worst element; the error against the error bound of a
float64 sum, n u sum|terms|, with n at least the length of every sum).
Suggested fix: return dw in its compute dtype (the torch.mm result), or cast to
torch.promote_types(dw.dtype, torch.float32).
Run: python f64_grad_weight_gather_gemm.py (exits 1 while the defect is present, 0 once fixed).
"""

import sys
import warnings

import torch
from fovi.arch.knn import KNNConvLayer, get_in_out_coords

warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own, at construction
inputs, outputs, _ = get_in_out_coords(4, 16, 0.5, 2, auto_match_cart_resources=0, device="cpu")
layer = KNNConvLayer(2, 3, 1, inputs, outputs, device="cpu", kernel_backend="gather_gemm")
layer = layer.double()  # 16 nodes -> 2 nodes, one neighbour each, one cell
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 2, 16, dtype=torch.float64, generator=g)
grad_y = torch.randn(2, 3, 2, dtype=torch.float64, generator=g)
(actual,) = torch.autograd.grad(layer(x), layer.weight, grad_y)
knn = layer.knn_indices_pad_token[0]  # [Nout]: each output node's one neighbour (no padding)
# grad_weight[o, c] = sum_{b,n} grad_y[b,o,n] x[b,c,knn[n]], written out in float64
expected = torch.einsum("bon,bcn->oc", grad_y, x[:, :, knn])
size = torch.einsum("bon,bcn->oc", grad_y.abs(), x[:, :, knn].abs())  # sum of |terms|
err, tol = (actual - expected).abs(), 2 * 2 * 2.0**-53 * size  # n = B Nout, every sum's length
i = int((err / tol).argmax())
print(
    f"grad_weight: expected {expected.flatten()[i]:.17g} actual {actual.flatten()[i]:.17g} "
    f"error {err.flatten()[i]:.1e} tolerance {tol.flatten()[i]:.1e} (dtype {actual.dtype})"
)
sys.exit(int(bool((err > tol).any())))
