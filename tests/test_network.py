"""The fovi-resnet18 trunk built from KNNConv layers, and the whole-network bench."""

from __future__ import annotations

import pytest
import torch

from fovi_ref import available_ops, route
from fovi_ref.check.bench import network as network_bench
from fovi_ref.check.network import KNNMaxPool, ResNet18Trunk


@pytest.fixture(scope="module")
def trunks():
    torch.manual_seed(0)
    routed = ResNet18Trunk().double()
    einsum = ResNet18Trunk(backend="einsum_baseline").double()
    einsum.load_state_dict(routed.state_dict())
    return routed, einsum


def test_trunk_has_fovis_twenty_convs_without_bias(trunks):
    routed, _ = trunks
    convs = routed.convs()
    assert len(convs) == 20 and all(c.bias is None for c in convs)
    assert [route(c.meta) for c in convs].count("gather_gemm") == 3  # the downsamples


def test_routed_trunk_matches_the_einsum_trunk(trunks):
    routed, einsum = trunks
    x = torch.randn(2, 3, routed.conv1.meta.n_in, dtype=torch.float64)
    y = routed(x)
    assert y.shape == (2, 512, 2)
    torch.testing.assert_close(y, einsum(x), rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(y.square().sum(), list(routed.parameters()))
    expected = torch.autograd.grad(einsum(x).square().sum(), list(einsum.parameters()))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


def test_max_pool_ignores_padding():
    from conftest import random_meta

    meta = random_meta(3, 1, n_in=6, n_out=4)
    pool = KNNMaxPool(meta)
    x = -torch.rand(1, 2, 6) - 1  # all negative: a padding zero would win if it leaked
    y = pool(x)
    for n in range(4):
        real = [int(i) for i in meta.knn[:, n] if i < meta.n_in]
        expected = x[0, :, real].amax(dim=1) if real else torch.full((2,), -torch.inf)
        assert torch.equal(y[0, :, n], expected)


def test_network_bench_reports_ratios():
    (row,) = network_bench.network_rows(batches=(1,), repeats=1)
    assert row["batch"] == 1 and row["time ratio"] > 0 and row["memory ratio"] > 0
    assert set(row["ms"]) == {"routed", "einsum", "floor", "floor+cells"}
    assert all(ratio > 0 for ratio, *_ in row["floors"].values())
    assert not [name for name in available_ops() if "bench" in name]  # only while measuring
