"""KNNConv: parameters, buffers, devices, state dicts, and the fovi-compatible attributes."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, random_meta

from fovi_ref import KNNConv, KNNMeta, knn_conv, route_layer
from fovi_ref.reference import knn_conv_reference


def test_parameters_and_init():
    torch.manual_seed(0)
    meta = random_meta(9, 9, in_channels=16)
    layer = KNNConv(16, 32, meta)
    assert layer.weight.shape == (32, 16 * 9)
    assert torch.equal(layer.bias, torch.zeros(32))
    # kaiming-normal (fan_in mode, gain sqrt(2)): std = sqrt(2 / fan_in), fan_in = Cin*V.
    expected_std = (2 / (16 * 9)) ** 0.5
    assert abs(layer.weight.std().item() / expected_std - 1) < 0.1
    assert KNNConv(16, 32, meta, bias=False).bias is None


def test_fovi_attributes():
    meta = random_meta(9, 4)
    layer = KNNConv(3, 5, meta)
    assert layer._k == 9
    assert torch.equal(layer.local_rf, meta.local_rf())
    assert route_layer(layer) == "general"


def test_forward_matches_oracle_and_knn_conv():
    meta = random_meta(4, 4)
    layer = KNNConv(3, 5, meta).double()
    x = torch.randn(2, 3, meta.n_in, dtype=torch.float64)
    y = layer(x)
    torch.testing.assert_close(y, knn_conv_reference(x, layer.weight, layer.bias, meta))
    torch.testing.assert_close(y, knn_conv(x, layer.weight, layer.bias, meta))


def test_state_dict_carries_the_graph():
    meta_a, meta_b = random_meta(4, 4, seed=1), random_meta(4, 4, seed=2)
    a, b = KNNConv(3, 5, meta_a), KNNConv(3, 5, meta_b)
    assert {"weight", "bias", "knn", "rf_index"} <= set(a.state_dict())
    b.load_state_dict(a.state_dict())
    assert b.meta.same_graph(meta_a)
    assert b.meta.knn is b.knn  # the buffers are the meta's tensors
    assert meta_b.same_graph(random_meta(4, 4, seed=2))  # the old meta was not edited in place
    x = torch.randn(2, 3, meta_a.n_in)
    torch.testing.assert_close(b(x), a(x))


def test_loading_a_bad_graph_is_rejected():
    layer = KNNConv(3, 5, random_meta(4, 4))
    state = layer.state_dict()
    state["knn"] = state["knn"].clone()
    state["knn"][0, 0] = 999
    with pytest.raises(ValueError, match="knn entries must lie in"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_moves_the_meta(device):
    layer = KNNConv(3, 5, random_meta(1, 1)).to(device)
    assert layer.meta.device.type == device and layer.knn.device.type == device
    y = layer(torch.randn(2, 3, layer.meta.n_in, device=device))
    assert y.device.type == device


def test_forced_backend_and_bad_arguments():
    meta = random_meta(1, 1)
    layer = KNNConv(3, 5, meta, backend="einsum_baseline")
    assert "backend=einsum_baseline" in repr(layer)
    x = torch.randn(2, 3, meta.n_in)
    torch.testing.assert_close(layer(x), knn_conv(x, layer.weight, layer.bias, meta))
    with pytest.raises(ValueError, match="in_channels=4 differs from meta.in_channels=3"):
        KNNConv(4, 5, meta)
    with pytest.raises(ValueError, match="out_channels must be a positive int"):
        KNNConv(3, 0, meta)
    with pytest.raises(TypeError, match="meta must be a fovi_ref.KNNMeta"):
        KNNConv(3, 5, meta.knn)
    assert isinstance(layer.meta, KNNMeta)


def test_layer_owns_its_graph_and_refuses_in_place_edits():
    meta = random_meta(1, 1)
    layer = KNNConv(3, 5, meta)
    assert layer.knn is not meta.knn  # editing the layer cannot touch the caller's meta
    x = torch.randn(2, 3, meta.n_in)
    layer(x)
    with torch.no_grad():
        layer.knn[0, 5] = (layer.knn[0, 5] + 1) % meta.n_in
    with pytest.raises(ValueError, match="modified in place"):
        layer(x)
    assert meta.same_graph(random_meta(1, 1))


def test_buffers_replaced_with_garbage_are_refused():
    """Whatever replaces the buffers (to_empty's uninitialised memory, say) is validated."""
    layer = KNNConv(3, 5, random_meta(4, 4))

    def garbage(t):
        return torch.full_like(t, 10**6) if t.dtype == torch.int64 else t

    with pytest.raises(ValueError, match="knn entries must lie in"):
        layer._apply(garbage)
