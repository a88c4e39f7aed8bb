"""fovi 2.4.0: a layer's KNN graph depends on the machine that builds it.

What: KNNConvLayer computes its neighbours and kernel cells when it is constructed, from float32
distances, and keeps them out of the state_dict. Many nodes of fovi-resnet18 have near-ties
among their candidate neighbours, and the float32 rounding of the distances decides them; that
rounding depends on the CPU, the MKL/ATen code path and the thread count. Built on another
machine, the same model and checkpoint run a different graph, so a different network. This
script stands in for another machine on this one: it builds fovi-resnet18's stem (KNNResNet's
conv1: 7 x 7 kernel, 5977 -> 1469 nodes) in two fresh interpreters, as is and under
ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE, and compares the (neighbour, cell) pairs of
every node, then the float64 output of the two layers for the same weights and input.
Where: fovi/arch/knn.py, KNNConvLayer.__init__ -> _compute_knns ->
_compute_euclidean_distances_batched (torch.cdist in float32, then topk) and compute_local_rf.
Expected: the same graph on every machine (0 nodes differ).
Measured: the line this prints. (If neither setting changes this machine's arithmetic, nothing
differs and it exits 0: then run it on a second machine, or compare saved graphs.)
Suggested fix: save knn_indices and local_rf in the state_dict (buffers), so a checkpoint
carries its graph; and build graphs from float64 distances with an explicit tie-break (lower
index first), flagging decisions within the rounding bound.
Run: python graphs_depend_on_machine.py (exits 1 while the defect shows here, 0 once fixed).
"""

import os
import subprocess
import sys
import tempfile
import warnings

import torch

if len(sys.argv) == 3:  # the child: build the stem, save its graph and its float64 output
    from fovi.arch.knn import KNNConvLayer, get_in_out_coords

    warnings.filterwarnings("ignore", message="torch.meshgrid")  # fovi's own
    i, o, _ = get_in_out_coords(
        64, 16, 0.5, 2, auto_match_cart_resources=0, in_cart_res=64, device="cpu"
    )  # KNNResNet's defaults for its stem
    stem = KNNConvLayer(3, 64, 49, i, o, device="cpu").double()
    x, w = torch.load(os.path.join(sys.argv[1], "in.pt"))  # the same input and weights for both
    with torch.no_grad():
        stem.weight.copy_(w)
    v = stem.local_rf.shape[2]  # each (neighbour, cell) pair as one number, sorted per node
    pairs = (stem.knn_indices_pad_token.t() * v + stem.local_rf.argmax(2)).sort(1).values
    torch.save((pairs, stem(x).detach()), os.path.join(sys.argv[1], f"{sys.argv[2]}.pt"))
    sys.exit(0)
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 3, 5977, dtype=torch.float64, generator=g)
w = torch.randn(64, 3 * 49, dtype=torch.float64, generator=g) / 12  # a kaiming-like scale
settings = [{}, {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}]
with tempfile.TemporaryDirectory() as tmp:
    torch.save((x, w), os.path.join(tmp, "in.pt"))
    for n, extra in enumerate(settings):
        env = {**os.environ, **extra}
        subprocess.run([sys.executable, __file__, tmp, str(n)], env=env, check=True)
    (pairs_a, y_a), (pairs_b, y_b) = (torch.load(os.path.join(tmp, f"{n}.pt")) for n in (0, 1))
flipped = int((pairs_a != pairs_b).any(1).sum())  # nodes whose (neighbour, cell) pairs differ
difference = float((y_a - y_b).abs().max() / y_a.abs().max())
print(
    f"stem graph, nodes that differ: expected 0 actual {flipped} of {pairs_a.shape[0]} "
    f"(tolerance 0); same weights and input, float64 outputs differ by {difference:.1e} "
    "of their scale"
)
sys.exit(int(flipped > 0))
