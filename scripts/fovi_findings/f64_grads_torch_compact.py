"""fovi 2.4.0: the torch_compact backend computes float64 gradients in float32.

What: a float64 KNNConvLayer run with kernel_backend="torch_compact" (or FOVI_KNN_BACKEND)
returns grad_x and grad_weight in float64 that hold float32 numbers: errors of float32 size
(about 1e-7 relative) where float64 arithmetic gives about 1e-16.
Where: fovi/arch/knn_autograd.py, CompactTorchOps.grad_input and CompactTorchOps.grad_weight:
each accumulates into a buffer made with torch.zeros(..., dtype=torch.float32) and casts each
bmm result with .to(torch.float32); KNNConvFunction.backward then casts the float32 result to
float64.
Expected: float64 gradients accumulated in float64, as fovi's baseline gives them.
Measured: the lines this prints (the worst element; the error against the error bound of a
float64 sum, n u sum|terms|, with n at least the length of every sum).
Suggested fix: accumulate in torch.promote_types(grad_y.dtype, torch.float32), keeping float32
for float16/bfloat16 only.
Run: python f64_grads_torch_compact.py (exits 1 while the defect is present, 0 once fixed).
"""

import sys
import warnings

import torch
import torch.nn.functional as F
from fovi.arch.knn import KNNConvLayer, get_in_out_coords

warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own, at construction
torch.manual_seed(0)  # the layer's initial weight
inputs, outputs, _ = get_in_out_coords(4, 16, 0.5, 1, auto_match_cart_resources=0, device="cpu")
layer = KNNConvLayer(2, 3, 9, inputs, outputs, device="cpu", kernel_backend="torch_compact")
layer = layer.double()  # 16 nodes -> 16 nodes, 9 neighbours each, 9 cells
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 2, 16, dtype=torch.float64, generator=g)
grad_y = torch.randn(2, 3, 16, dtype=torch.float64, generator=g)
w = layer.weight.detach()


def formula(x, w):  # y[b,o,n] = sum_{c,k} x[b,c,knn[k,n]] w[o,c*V+cell[n,k]], written out
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    cells = layer.local_rf.double()  # [Nout, K, V] one-hot; the pad token Nin reads 0 below
    f = torch.einsum("bckn,nkv->bncv", F.pad(x, (0, 1))[:, :, layer.knn_indices_pad_token], cells)
    return (f.flatten(2) @ w.t()).transpose(1, 2), x, w


x.requires_grad_()
actual = torch.autograd.grad(layer(x), (x, layer.weight), grad_y)
y, *leaves = formula(x.detach(), w)
expected = torch.autograd.grad(y, leaves, grad_y)
y, *leaves = formula(x.detach().abs(), w.abs())
sizes = torch.autograd.grad(y, leaves, grad_y.abs())  # each gradient's sum of |terms|
failed = False
for name, a, e, s in zip(("grad_x", "grad_weight"), actual, expected, sizes, strict=True):
    err, tol = (a - e).abs(), 2 * 9 * 16 * 2.0**-53 * s  # n = B K Nout >= any sum's length
    i = int((err / tol).argmax())
    print(
        f"{name}: expected {e.flatten()[i]:.17g} actual {a.flatten()[i]:.17g} "
        f"error {err.flatten()[i]:.1e} tolerance {tol.flatten()[i]:.1e}"
    )
    failed |= bool((err > tol).any())
sys.exit(int(failed))
