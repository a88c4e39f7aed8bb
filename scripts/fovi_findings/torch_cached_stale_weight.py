"""fovi 2.4.0: torch_cached keeps using the old weight after load_conv2d_weights.

What: the inference backend torch_cached caches the node-expanded weight, keyed on each
parameter's data_ptr() and _version. A write through weight.data bumps neither, and fovi's own
KNNConvLayer.load_conv2d_weights writes exactly that way (self.weight.data.copy_), so every
later no_grad forward keeps using the weight from before the load. fovi's dispatcher picks
torch_cached by itself on CPU whenever gradients are off for a layer with at most 4 input
channels and at least 256 output nodes: fovi-resnet18's stem, in eval under torch.no_grad().
Where: fovi/arch/knn_optimization.py, _effective_weight and _parameter_signature (the cache
key); fovi/arch/knn.py, KNNConvLayer._load_conv_2d_weight (the .data writes).
Expected: y from the loaded weight, the formula written out in float64; error at most
n u32 sum|terms| for float32.
Measured: the line this prints (the worst element).
Suggested fix: write parameters in place without .data (under torch.no_grad(), which bumps
_version), and/or key the cache on the weight's values or clear it in load_*_weights
(clear_optimized_cache exists).
Run: python torch_cached_stale_weight.py (exits 1 while the defect is present, 0 once fixed).
"""

import sys
import warnings

import torch
import torch.nn.functional as F
from fovi.arch.knn import KNNConvLayer, get_in_out_coords

warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own, at construction
torch.manual_seed(0)
inputs, outputs, _ = get_in_out_coords(4, 16, 0.5, 1, auto_match_cart_resources=0, device="cpu")
layer = KNNConvLayer(3, 8, 9, inputs, outputs, device="cpu", kernel_backend="torch_cached")
x = torch.randn(2, 3, 16)  # 16 nodes -> 16 nodes, 9 neighbours, a 3 x 3 kernel grid
with torch.no_grad():
    layer(x)  # fills the cache with the initial weight
    layer.load_conv2d_weights(torch.nn.Conv2d(3, 8, 3, bias=False))
    actual = layer(x)
w = layer.weight.detach().double()  # the weight now loaded
# y[b,o,n] = sum_{c,k} x[b,c,knn[k,n]] w[o,c*V+cell[n,k]], written out in float64
gathered = F.pad(x.double(), (0, 1))[:, :, layer.knn_indices_pad_token]  # pad token reads 0
f, f_abs = (
    torch.einsum("bckn,nkv->bncv", g, layer.local_rf.double()).flatten(2)
    for g in (gathered, gathered.abs())
)
expected, size = (f @ w.t()).transpose(1, 2), (f_abs @ w.abs().t()).transpose(1, 2)
err, tol = (actual - expected).abs(), 3 * 9 * 2.0**-24 * size  # n = Cin K terms per sum
i = int((err / tol).argmax())
print(
    f"y: expected {expected.flatten()[i]:.9g} actual {actual.flatten()[i]:.9g} "
    f"error {err.flatten()[i]:.1e} tolerance {tol.flatten()[i]:.1e}"
)
sys.exit(int(bool((err > tol).any())))
