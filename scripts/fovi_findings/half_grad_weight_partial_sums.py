"""fovi 2.4.0: torch_compact rounds each node's weight-gradient partial sum to float16/bfloat16.

What: a float16 (or bfloat16) KNNConvLayer run with kernel_backend="torch_compact" computes
grad_weight as one batched product per output node in the 16-bit dtype, rounds each node's
partial sum to 16 bits, and only then adds the partial sums in float32. Where they cancel, the
roundings are all that is left: here two nodes give 1 + 2^-12 and -1; the first rounds to 1 and
the gradient comes out 0 instead of 2^-12.
Where: fovi/arch/knn_autograd.py, CompactTorchOps.grad_weight: dweff = torch.bmm(a_t, g) in the
input dtype, then dw_t.index_add_(0, wl, dweff.reshape(-1, cout).to(torch.float32)).
Expected: the sum accumulated in float32 and rounded to 16 bits once, as fovi's baseline does;
error at most u16 |grad| + n u32 sum|terms| (one 16-bit rounding, n float32 additions).
Measured: the line this prints.
Suggested fix: compute the per-node products in float32 (cast a_t and g to float32 before the
bmm), so that only the final gradient is rounded to 16 bits.
Run: python half_grad_weight_partial_sums.py (exits 1 while the defect is present, 0 once fixed).
"""

import sys
import warnings

import torch
from fovi.arch.knn import KNNConvLayer, get_in_out_coords

warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own, at construction
inputs, outputs, _ = get_in_out_coords(4, 16, 0.5, 2, auto_match_cart_resources=0, device="cpu")
layer = KNNConvLayer(1, 1, 1, inputs, outputs, device="cpu", kernel_backend="torch_compact")
layer = layer.half()  # 16 nodes -> 2 nodes, one neighbour each: both use weight[0, 0]
first, second = layer.knn_indices_pad_token[0].tolist()
x = torch.zeros(2, 1, 16, dtype=torch.float16)  # batch 2
x[:, 0, first] = torch.tensor([1.0, 2.0**-12])  # node 0's partial: 1 * 1 + 2^-12 * 1
x[:, 0, second] = torch.tensor([-1.0, 0.0])  # node 1's partial: -1 * 1 + 0 * 1
grad_y = torch.ones(2, 1, 2, dtype=torch.float16)
(actual,) = torch.autograd.grad(layer(x), layer.weight, grad_y)
# grad_weight[0, 0] = sum_{b,n} grad_y[b,0,n] x[b,0,knn[n]], in float64
terms = grad_y.double()[:, 0, :] * x.double()[:, 0, [first, second]]
expected, size = float(terms.sum()), float(terms.abs().sum())
tol = 2.0**-11 * abs(expected) + 4 * 2.0**-24 * size  # one float16 rounding + float32 sums
err = abs(float(actual) - expected)
print(
    f"grad_weight: expected {expected:.9g} actual {float(actual):.9g} error {err:.1e} "
    f"tolerance {tol:.1e}"
)
sys.exit(int(err > tol))
