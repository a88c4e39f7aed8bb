"""What the op boundary and model size cost: ``python -m fovi_ref bench --boundary``.

**The boundary.** On a tiny graph the arithmetic takes microseconds, so whatever ``knn_conv`` adds
per call (argument checks, the autograd node, the dispatch to a backend) shows. Two ratios, each
forward + backward (gradients of ``x``, ``weight``, ``bias``) timed side by side:

- ``gather_gemm``, K = V = 1 (B=2, Cin=Cout=8, Nin=8, Nout=4), against the same arithmetic as
  plain torch ops with plain autograd: ``x[:, :, idx]``, then ``F.linear``. Target: <= 1.5.
- ``general``, K = V = 9 (B=2, Cin=Cout=8, Nin=Nout=16), against fovi's own plain-torch path
  (pad, gather, one-hot einsum, ``F.linear``) with plain autograd. Reported, no target.

**Many graphs.** One training step (forward + backward) of a stack of 100 small KNN convs whose
graphs are all distinct, against the same stack with one graph shared by every layer, in eager,
compiled and exported form. Derived data lives with each layer, so distinct graphs cost nothing
per step: target <= 1.2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fovi_ref import knn_conv
from fovi_ref.check.bench import targets
from fovi_ref.check.bench.contenders import Contender, fovi_einsum, make_inputs
from fovi_ref.check.bench.timing import time_contenders
from fovi_ref.layer import KNNConv
from fovi_ref.meta import KNNMeta

__all__ = ["boundary_ratios", "run", "scale_ratios"]


def _tiny_meta(k: int, n_in: int, n_out: int, seed: int) -> KNNMeta:
    g = torch.Generator().manual_seed(seed)
    knn = torch.randint(0, n_in, (k, n_out), generator=g)  # [K, Nout]
    rf_index = torch.arange(k).expand(n_out, k)  # [Nout, K]: one cell per neighbour
    return KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=8, v=k)


def _plain_k1(x, weight, bias, index, grad_y) -> Contender:
    """The K = V = 1 arithmetic in plain torch: a gather, ``F.linear``, autograd."""

    def run():
        y = F.linear(x[:, :, index].transpose(1, 2), weight, bias).transpose(1, 2)
        return torch.autograd.grad(y, (x, weight, bias), grad_y)

    return run


def _through_knn_conv(inputs, backend: str) -> Contender:
    def run():
        y = knn_conv(inputs.x, inputs.weight, inputs.bias, inputs.meta, backend=backend)
        return torch.autograd.grad(y, (inputs.x, inputs.weight, inputs.bias), inputs.grad_y)

    return run


def boundary_ratios(repeats: int = 2000) -> dict[str, float]:
    """``{"gather_gemm K=1": ratio, "general K=9": ratio}``: knn_conv / plain torch, forward +
    backward, medians of interleaved rounds of ``repeats // 100`` calls each."""
    ratios = {}
    for label, k, n_in, n_out in (("gather_gemm K=1", 1, 8, 4), ("general K=9", 9, 16, 16)):
        meta = _tiny_meta(k, n_in, n_out, seed=k)
        inputs = make_inputs(meta, out_channels=8, batch=2, dtype=torch.float32)
        backend = "gather_gemm" if k == 1 else "general"
        if k == 1:
            plain = _plain_k1(inputs.x, inputs.weight, inputs.bias, meta.knn[0], inputs.grad_y)
        else:
            plain = fovi_einsum(inputs)
        ours = _through_knn_conv(inputs, backend)
        calls = max(repeats // 100, 1)
        times = time_contenders(
            {"knn_conv": _repeat(ours, calls), "plain": _repeat(plain, calls)},
            repeats=100,
            warmup=5,
        )
        ratios[label] = times["knn_conv"] / times["plain"]
    return ratios


def _repeat(fn: Contender, calls: int) -> Contender:
    def run():
        for _ in range(calls):
            fn()

    return run


def _stack(distinct: bool, layers: int = 100, channels: int = 16, nodes: int = 64) -> nn.Module:
    """``layers`` KNN convs (every third K = 1, the others K = 9), each with its own random
    graph when ``distinct``, else all on one graph per K."""
    stack = []
    for i in range(layers):
        k = 1 if i % 3 == 0 else 9
        seed = i if distinct else k
        g = torch.Generator().manual_seed(seed)
        knn = torch.randint(0, nodes, (k, nodes), generator=g)
        rf_index = torch.randint(0, k, (nodes, k), generator=g)
        meta = KNNMeta.from_knn(knn, rf_index, n_in=nodes, in_channels=channels, v=k)
        stack.append(KNNConv(channels, channels, meta))
    return nn.Sequential(*stack)


def scale_ratios(repeats: int = 10, forms=("eager", "compiled", "exported")) -> dict[str, float]:
    """Step time of 100 layers on distinct graphs / on shared graphs, per form."""
    torch.manual_seed(0)
    models = {name: _stack(distinct=name == "distinct") for name in ("distinct", "shared")}
    x = torch.randn(8, 16, 64, requires_grad=True)
    ratios = {}
    for form in forms:
        contenders = {}
        for name, model in models.items():
            if form == "compiled":
                run = torch.compile(model, fullgraph=True)
            elif form == "exported":
                run = torch.export.export(model, (x.detach(),)).module()
            else:
                run = model
            contenders[name] = _step(run, model, x)
        times = time_contenders(contenders, repeats=repeats, warmup=2)
        ratios[form] = times["distinct"] / times["shared"]
    return ratios


def _step(run, model: nn.Module, x: torch.Tensor) -> Contender:
    params = list(model.parameters())

    def step():
        y = run(x)
        return torch.autograd.grad(y.square().mean(), [x, *params])

    return step


def run(scale: bool = True) -> dict[str, float]:
    """Print the boundary ratios (and the 100-layer ratios when ``scale``); return them all."""
    print("boundary: forward + backward through knn_conv / the same arithmetic in plain torch")
    results = {}
    for label, ratio in boundary_ratios().items():
        target = (
            f"target <= {targets.BOUNDARY.at_most}"
            if label.startswith("gather_gemm")
            else "no target"
        )
        verdict = (
            ""
            if "no target" in target
            else ("  met" if ratio <= targets.BOUNDARY.at_most else "  MISSED")
        )
        print(f"  {label:<18}{ratio:6.2f}   ({target}){verdict}")
        results[f"boundary {label}"] = ratio
    if scale:
        limit = targets.SCALE.at_most
        print(f"100 layers, distinct graphs / one shared graph, step time (target <= {limit})")
        for form, ratio in scale_ratios().items():
            verdict = "met" if ratio <= targets.SCALE.at_most else "MISSED"
            print(f"  {form:<18}{ratio:6.2f}   {verdict}")
            results[f"100 layers {form}"] = ratio
    return results
