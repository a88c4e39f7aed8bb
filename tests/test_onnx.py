"""ONNX: fovi_ref::knn_conv exported with its translation, run in onnxruntime, judged by the
elementwise rule (fovi_ref.check.tolerances). Skips unless `pip install -e ".[onnx]"`."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import random_meta

import fovi_ref
from fovi_ref.check.network import ResNet18Trunk
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
onnx_interop = pytest.importorskip("fovi_ref.interop.onnx")
pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: the oracle runs 3x faster


def run_onnx(model, x: torch.Tensor, *, optimized: bool = True) -> list[torch.Tensor]:
    """Every output of an ONNX model (proto or bytes) for input ``x``, on onnxruntime's CPU."""
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x.numpy()}
    return [torch.from_numpy(out) for out in session.run(None, feed)]


def export(model, x) -> bytes:
    with warnings.catch_warnings():  # torch's exporter warns about its own internals
        warnings.simplefilter("ignore")
        program = onnx_interop.export_onnx(model.eval(), x)
    return program.model_proto


def judge_y(y: torch.Tensor, x: torch.Tensor, conv: fovi_ref.KNNConv):
    """The rule's verdict on ``y`` as ``conv`` applied to ``x`` (float32 in, float64 oracle)."""
    w = conv.weight.detach()
    b = None if conv.bias is None else conv.bias.detach()
    grad_y = torch.zeros(y.shape)  # only y is judged
    return judge_elementwise(y, expected_quantities(x, w, b, conv.meta, grad_y)["y"])


@pytest.mark.parametrize(("k", "v"), [(4, 1), (5, 3)])  # one cell (a sum over k); V cells
def test_one_layer_exports_with_a_dynamic_batch(k, v):
    """With a bias (the trunk's convolutions have none), padding, collisions and shared cells."""
    meta = random_meta(k, v, n_in=30, n_out=20, in_channels=3)
    conv = fovi_ref.KNNConv(3, 4, meta)
    torch.nn.init.normal_(conv.bias)
    model = export(conv, torch.randn(2, 3, meta.n_in)).SerializeToString()
    for batch in (1, 5):  # exported at batch 2
        x = torch.randn(batch, 3, meta.n_in)
        (y,) = run_onnx(model, x)
        assert y.shape == (batch, 4, meta.n_out)
        verdict = judge_y(y, x, conv)
        assert verdict.ok, str(verdict)


class Taps(torch.nn.Module):
    """``model(x)``, then every KNNConv's output and (but the first's, which is ``x``) input."""

    def __init__(self, model: ResNet18Trunk) -> None:
        super().__init__()
        self.model, self.seen = model, []
        for conv in model.convs():
            conv.register_forward_hook(lambda _, inputs, y: self.seen.append((inputs[0], y)))

    def forward(self, x):
        self.seen = []
        y = self.model(x)
        return y, *(y for _, y in self.seen), *(x for x, _ in self.seen[1:])


def test_resnet18_trunk_runs_in_onnxruntime_within_the_rule():
    """The exported trunk's convolutions within the float32 rule, fed what ONNX fed them (one of
    each graph and channel count: 11 of the 20, for time), and the trunk's output (onnxruntime
    fully optimized) no further from float64 than eager float32's."""
    torch.manual_seed(0)
    trunk = ResNet18Trunk().eval()
    convs = trunk.convs()
    proto = export(Taps(trunk), torch.randn(2, 3, trunk.conv1.meta.n_in))
    x = torch.randn(1, 3, trunk.conv1.meta.n_in)  # exported at batch 2
    outs = run_onnx(proto.SerializeToString(), x, optimized=False)  # onnxruntime drops tapped
    ys, xs = outs[1 : 1 + len(convs)], [x, *outs[1 + len(convs) :]]  # outputs when it optimizes
    ratios, kinds = [], set()
    for conv, x_in, y in zip(convs, xs, ys, strict=True):
        kind = (tuple(conv.knn.shape), conv.meta.n_in, conv.in_channels, conv.out_channels)
        if kind in kinds:
            continue
        kinds.add(kind)
        verdict = judge_y(y, x_in, conv)
        assert verdict.ok, str(verdict)
        ratios.append(verdict.ratio)
    del proto.graph.output[1:]  # the trunk alone, run as users run it
    (y_onnx,) = run_onnx(proto.SerializeToString(), x)
    with torch.no_grad():
        y_eager, y64 = trunk(x), trunk.double()(x.double())
    err_onnx = (y_onnx.double() - y64).abs().max().item()
    err_eager = (y_eager.double() - y64).abs().max().item()
    print(
        f"worst err/bound over {len(ratios)} convs {max(ratios):.3f}; trunk |err| onnx "
        f"{err_onnx:.1e}, eager float32 {err_eager:.1e}"
    )
    assert err_onnx <= 2 * err_eager
