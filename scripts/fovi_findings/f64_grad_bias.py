"""fovi 2.4.0: KNNConvFunction sums the float64 bias gradient in float32.

What: a float64 KNNConvLayer with a bias, run by any backend of fovi's ops registry
(torch_compact, gather_gemm; cuda and warp_train on a GPU), returns a float64 grad_bias that
holds a float32 number: errors of float32 size (about 1e-7 relative) where float64 arithmetic
gives about 1e-16.
Where: fovi/arch/knn_autograd.py, KNNConvFunction.backward:
grad_y.sum(dim=(0, 2), dtype=torch.float32).to(dtype=b_dtype).
Expected: grad_bias[o] = sum_{b,n} grad_y[b,o,n] summed in float64, as fovi's baseline does.
Measured: the line this prints (the worst element; the error against the error bound of a
float64 sum, n u sum|terms|, with n the length of the sum).
Suggested fix: sum in torch.promote_types(grad_y.dtype, torch.float32).
Run: python f64_grad_bias.py (exits 1 while the defect is present, 0 once fixed).
"""

import sys
import warnings

import torch
from fovi.arch.knn import KNNConvLayer, get_in_out_coords

warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own, at construction
inputs, outputs, _ = get_in_out_coords(4, 16, 0.5, 1, auto_match_cart_resources=0, device="cpu")
layer = KNNConvLayer(
    2, 3, 9, inputs, outputs, device="cpu", bias=True, kernel_backend="torch_compact"
).double()  # 16 nodes -> 16 nodes
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 2, 16, dtype=torch.float64, generator=g)
grad_y = torch.randn(2, 3, 16, dtype=torch.float64, generator=g)
(actual,) = torch.autograd.grad(layer(x), layer.bias, grad_y)
expected = grad_y.sum(dim=(0, 2))  # the same sum, in float64
err, tol = (actual - expected).abs(), 2 * 16 * 2.0**-53 * grad_y.abs().sum(dim=(0, 2))
i = int((err / tol).argmax())
print(
    f"grad_bias: expected {expected[i]:.17g} actual {actual[i]:.17g} "
    f"error {err[i]:.1e} tolerance {tol[i]:.1e}"
)
sys.exit(int(bool((err > tol).any())))
