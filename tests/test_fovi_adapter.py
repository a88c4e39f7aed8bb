"""The fovi adapter (fovi_ref.interop.fovi): a fovi model converted to fovi_ref's op and back
keeps its parameters and state, computes what the oracle computes, compiles and autocasts, and
every refusal leaves the model as it was.

Small fovi models here are fovi's own ``KNNConvLayer`` on fovi_ref's test graphs
(``fovi_layer_from_meta``); one test converts the whole fovi-resnet18.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("fovi", reason="the adapter converts fovi models: pip install fovi")

from fovi_ref.check.fovi import build_fovi_resnet18, fovi_layer_from_meta  # noqa: E402
from fovi_ref.check.graphs import random_meta  # noqa: E402
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise  # noqa: E402
from fovi_ref.interop.fovi import (  # noqa: E402
    INSTALL_HINT,
    fovi_ref_convs,
    knn_conv_layers,
    to_fovi,
    to_fovi_ref,
)

META = random_meta(4, 2, n_in=16, n_out=12, in_channels=3)  # padding, shared cells: general


def small_model() -> nn.Sequential:
    """Two of fovi's KNN convs, 3 -> 6 -> 3 channels over 16 -> 12 -> 8 nodes, a ReLU between."""
    torch.manual_seed(0)
    second = random_meta(2, 4, n_in=12, n_out=8, in_channels=6, seed=1)
    return nn.Sequential(
        fovi_layer_from_meta(META, 6, bias=True), nn.ReLU(), fovi_layer_from_meta(second, 3)
    )


def single_layer(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return fovi_layer_from_meta(META, 5, bias=bias)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def converted(model: nn.Module) -> list[str]:
    return [name for name, layer in knn_conv_layers(model).items() if "forward" in vars(layer)]


def test_a_converted_layer_is_judged_against_the_oracle_by_the_rule():
    """The routed backend through the adapter, forward and both gradients, in float32."""
    layer = single_layer()
    x = torch.randn(3, META.in_channels, META.n_in, requires_grad=True)
    metas = to_fovi_ref(layer)
    assert set(metas) == {""} and metas[""].same_graph(META) and "forward" in vars(layer)
    y = layer(x)
    grad_y = torch.randn_like(y)
    grad_x, grad_w, _ = torch.autograd.grad(y, (x, layer.weight, layer.bias), grad_y)
    expected = expected_quantities(x, layer.weight, layer.bias, META, grad_y)
    for quantity, value in {"y": y, "grad_x": grad_x, "grad_weight": grad_w}.items():
        verdict = judge_elementwise(value, expected[quantity])
        assert verdict.ok, (quantity, verdict)


def test_converting_and_back_keeps_parameters_state_and_fovis_output():
    model = single_layer(bias=False)  # fovi gives 0, not the bias, at an all-padding node
    x = torch.randn(2, META.in_channels, META.n_in)
    fovi_y, before = model(x), state(model)
    params = [id(p) for p in model.parameters()]
    to_fovi_ref(model, backend="einsum_baseline")  # fovi's arithmetic rebuilt: bit for bit
    assert [id(p) for p in model.parameters()] == params
    assert torch.equal(model(x), fovi_y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    to_fovi(model)
    assert converted(model) == [] and torch.equal(model(x), fovi_y)


def test_a_converted_model_trains_and_its_state_dict_loads_into_fovis():
    """Parameters are the model's own: an optimizer steps them, and the state_dict a converted
    model saves loads into an unconverted one."""
    model = small_model()
    to_fovi_ref(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, META.in_channels, META.n_in)
    before = state(model)
    model(x).square().mean().backward()
    optimizer.step()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    fovi_model = small_model()
    fovi_model.load_state_dict(model.state_dict())
    torch.testing.assert_close(fovi_model[2](x := torch.randn(2, 6, 12)), model[2](x))


def test_the_block_restores_fovis_forward_even_after_an_error():
    model = small_model()
    with pytest.raises(KeyError), fovi_ref_convs(model) as metas:
        assert len(metas) == 2 and converted(model) == ["0", "2"]
        raise KeyError("an error inside the block")
    assert converted(model) == []


def test_compiled_and_autocast_runs_of_a_converted_model():
    """``torch.compile`` of the whole converted model gives the eager values; under CPU
    autocast in bfloat16 the convs run in bfloat16 and gradients reach the float32 weights."""
    model = small_model()
    to_fovi_ref(model)
    x = torch.randn(2, META.in_channels, META.n_in)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.dtype == torch.float32


def test_every_refusal_leaves_the_model_as_it_was():
    model = small_model()
    before = state(model)
    with pytest.raises(ValueError, match="must be a torch.nn.Module"):
        to_fovi_ref(object())
    with pytest.raises(ValueError, match="not a fovi model"):
        to_fovi_ref(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="is converted"):
        to_fovi(model)
    to_fovi_ref(model)
    forwards = [vars(layer)["forward"] for layer in knn_conv_layers(model).values()]
    with pytest.raises(RuntimeError, match="already converted"):
        to_fovi_ref(model)
    assert [vars(layer)["forward"] for layer in knn_conv_layers(model).values()] == forwards
    to_fovi(model)

    class Depthwise(type(model[0])):  # a kind with a computation of its own
        def forward(self, x):
            return x

    odd = copy.deepcopy(model)
    odd[2].__class__ = Depthwise
    with pytest.raises(TypeError, match="Depthwise"):
        to_fovi_ref(odd)
    broken = copy.deepcopy(model)
    del broken[2].local_rf  # a graph the adapter cannot read
    with pytest.raises(TypeError, match="local_rf"):
        to_fovi_ref(broken)
    for unchanged in (model, odd, broken):
        assert converted(unchanged) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_fovi_the_adapter_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "fovi.arch.knn", None)  # import fails as if missing
    with pytest.raises(ImportError, match="install it") as raised:
        to_fovi_ref(nn.Linear(2, 2))
    assert INSTALL_HINT in str(raised.value)


def test_fovi_resnet18_converts_all_twenty_convs_bit_for_bit_with_fovis_arithmetic():
    """The whole model, with ``einsum_baseline`` (fovi's algorithm rebuilt) so that every value
    can be compared exactly; the routed backends are judged layer by layer above."""
    model = build_fovi_resnet18(dtype=torch.float64)
    conv = model.layer4[0].conv2  # K=2, V=4, 2 nodes: cheap
    x = torch.randn(2, 512, 2, dtype=torch.float64)
    fovi_y = conv(x)
    with fovi_ref_convs(model, backend="einsum_baseline") as metas:
        assert len(metas) == 20 and "layer4.0.conv2" in metas
        assert torch.equal(conv(x), fovi_y)
    assert converted(model) == []
