"""fovi 2.4.0: in float16, baseline and torch_scatter give inf where the answer is 800.

What: fovi's baseline (what its dispatcher runs on CPU, and on CUDA below its work threshold)
and torch_scatter first sum the inputs that fall in the same kernel cell, storing that cell sum
in float16, and only then multiply by the weight. Two neighbours of 40000 in one cell with
weight 0.01 give a cell sum of 80000, past float16's largest finite value (65504), so the cell
sum becomes inf and so does y, although y = 0.01 * 80000 = 800 is an ordinary float16 number.
A float16 GEMM (multiplying in float32 and rounding once) gives 800.
Where: fovi/arch/knn.py, KNNConvLayer._apply_local_rf (the one-hot einsum 'ank,nkv->anv' in the
input dtype, before F.linear in forward); fovi/arch/knn_autograd.py, scatter_forward (`binned`
allocated in the input dtype and filled by scatter_add).
Expected: y finite, within one float16 rounding: error at most u16 |y| + n u32 sum|terms|.
Measured: one line per backend that runs this graph on CPU.
Suggested fix: bin in float32 (einsum / scatter_add on float32 features) and round once after
the GEMM; or multiply by the weight per neighbour, as torch_compact does.
Run: python f16_cell_sum_overflow.py (exits 1 while the defect is present, 0 once fixed).
"""

import os
import sys
import warnings

import torch
from fovi.arch.knn import KNNConvLayer, get_in_out_coords

warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own, at construction
inputs, outputs, _ = get_in_out_coords(4, 16, 0.5, 2, auto_match_cart_resources=0, device="cpu")
layer = KNNConvLayer(1, 1, 4, inputs, outputs, device="cpu").half()  # 16 -> 2 nodes, 4 cells
cells = layer.local_rf.argmax(2)[0].tolist()  # output node 0: the cell of each neighbour
shared = next(c for c in cells if cells.count(c) > 1)  # a cell two neighbours fall in
x = torch.zeros(1, 1, 16, dtype=torch.float16)
for k, cell in enumerate(cells):
    if cell == shared:
        x[0, 0, layer.knn_indices_pad_token[k, 0]] = 40000.0
with torch.no_grad():
    layer.weight.zero_()[0, shared] = 0.01
w = float(layer.weight.detach()[0, shared])  # 0.01 in float16
expected, size = 2 * 40000.0 * w, 2 * 40000.0 * w  # two terms, both positive
tol = 2.0**-11 * abs(expected) + 2 * 2.0**-24 * size  # one float16 rounding + float32 sums
failed = False
for backend in ("baseline", "torch_scatter", "torch_compact", "torch_cached"):
    os.environ["FOVI_KNN_BACKEND"] = backend  # fovi's own override of the layer's backend
    with torch.no_grad():
        actual = float(layer(x)[0, 0, 0])
    err = abs(actual - expected)
    print(
        f"{backend}: expected {expected:.9g} actual {actual:.9g} error {err:.1e} "
        f"tolerance {tol:.1e}"
    )
    failed |= not err <= tol
sys.exit(int(failed))
