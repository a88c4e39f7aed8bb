"""Every backend against the float64 oracle, gradcheck, and F.conv2d on regular grids."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, LOW_PRECISION, force_cells, random_meta, sample_inputs

from fovi_ref import KNNMeta, knn_conv
from fovi_ref.check.operands import forward_and_grads
from fovi_ref.check.tolerances import QUANTITIES, expected_quantities, judge_elementwise
from fovi_ref.check.verify import BASELINE, backends_for
from fovi_ref.grid import conv2d_grid_meta, to_grid, to_nodes
from fovi_ref.strategies.node_rows import FEW_SAMPLES, applies

KS = [1, 2, 4, 9, 49]
VS = [1, 4, 9, 49]
GRAPHS = [(k, v) for k in KS for v in VS]
# general sums over node rows up to FEW_SAMPLES samples, over channel rows beyond, and runs its
# GEMMs dense or per occupied cell (forced either way here): all four are judged. Each strategy
# is also held to the textbook alone: tests/test_strategies.py.
BATCHES = pytest.mark.parametrize(
    "batch,cells",
    [(2, False), (FEW_SAMPLES + 3, False), (2, True), (FEW_SAMPLES + 3, True)],
    ids=["node rows", "channel rows", "cells, few samples", "cells"],
)


def test_the_batches_take_both_layouts():
    assert applies(2) and not applies(FEW_SAMPLES + 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,v", GRAPHS)
@BATCHES
def test_float64_matches_oracle(k, v, batch, cells, device, monkeypatch):
    force_cells(monkeypatch, cells)
    meta = random_meta(k, v, seed=k * 100 + v, device=device)
    x, w, b = sample_inputs(meta, batch=batch)
    grad_y = torch.randn(batch, 4, meta.n_out, dtype=torch.float64, device=device)
    expected = expected_quantities(x, w, b, meta, grad_y)
    for backend in backends_for(meta):
        got = forward_and_grads(x, w, b, meta, grad_y, backend)
        for what, g in zip(QUANTITIES, got, strict=True):
            verdict = judge_elementwise(g, expected[what])
            assert verdict.ok, f"{backend}: {verdict}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("k,v", [(1, 1), (2, 4), (9, 9), (49, 49)])
@BATCHES
def test_low_precision_within_error_bound(k, v, batch, cells, dtype, device, monkeypatch):
    """Every element of every result in float32/16/bf16 stays within its bound (the rule of
    fovi_ref.check.tolerances); einsum_baseline's worst ratio rides along in the message."""
    force_cells(monkeypatch, cells)
    meta = random_meta(k, v, n_in=60, n_out=40, in_channels=16, seed=7, device=device)
    x, w, b = sample_inputs(meta, out_channels=32, batch=batch, dtype=dtype)
    grad_y = torch.randn(batch, 32, meta.n_out, device=device).to(dtype)
    # The oracle sees the same rounded inputs, so only the backends' own arithmetic is judged.
    expected = expected_quantities(x, w, b, meta, grad_y)
    baseline = forward_and_grads(x, w, b, meta, grad_y, BASELINE)
    for backend in backends_for(meta):
        got = forward_and_grads(x, w, b, meta, grad_y, backend)
        for what, g, base in zip(QUANTITIES, got, baseline, strict=True):
            assert g.dtype == dtype
            verdict = judge_elementwise(g, expected[what], baseline=base)
            assert verdict.ok, f"{backend}: {verdict}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,v", [(1, 1), (2, 4), (9, 9), (4, 1)])
@BATCHES
def test_gradcheck(k, v, batch, cells, device, monkeypatch):
    force_cells(monkeypatch, cells)
    meta = random_meta(k, v, n_in=12, n_out=8, in_channels=2, seed=3, device=device)
    x, w, b = sample_inputs(meta, out_channels=3, batch=batch)
    for backend in backends_for(meta):

        def fn(x, w, b, backend=backend):
            return knn_conv(x, w, b, meta, backend=backend)

        # fovi's backward (the baseline) sums its gather with scatter_add_, which CUDA adds by
        # atomics in no fixed order: two runs differ by rounding, which gradcheck's reentrancy
        # test would call a wrong gradient
        nondet_tol = 1e-12 if backend == BASELINE and meta.device.type == "cuda" else 0.0
        assert torch.autograd.gradcheck(fn, (x, w, b), nondet_tol=nondet_tol), backend


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_gather_gemm_equals_general_on_k1_v1(seed, device):
    meta = random_meta(1, 1, n_in=50, n_out=40, in_channels=5, seed=seed, device=device)
    x, w, b = sample_inputs(meta, out_channels=6, batch=3)
    grad_y = torch.randn(3, 6, meta.n_out, dtype=torch.float64, device=device)
    general = forward_and_grads(x, w, b, meta, grad_y, "general")
    gather = forward_and_grads(x, w, b, meta, grad_y, "gather_gemm")
    for g, e in zip(gather, general, strict=True):
        # The same sums in another order: in float64 that is ~1e-16 apart; any indexing
        # difference would be of order 1.
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "height,width,kernel,stride,padding",
    [(12, 12, 1, 2, 0), (13, 9, 1, 2, 0), (10, 10, 3, 1, 1), (9, 7, 3, 1, 1), (11, 11, 3, 2, 1)],
)
def test_grid_meta_equals_conv2d(height, width, kernel, stride, padding, device):
    """On a regular grid the KNN graph is a convolution: F.conv2d is the oracle."""
    c_in, c_out = 3, 5
    meta = conv2d_grid_meta(
        height,
        width,
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        in_channels=c_in,
        device=device,
    )
    g = torch.Generator().manual_seed(0)
    image = torch.randn(2, c_in, height, width, generator=g, dtype=torch.float64).to(device)
    conv_w = torch.randn(c_out, c_in, kernel, kernel, generator=g, dtype=torch.float64).to(device)
    bias = torch.randn(c_out, generator=g, dtype=torch.float64).to(device)
    image.requires_grad_(), conv_w.requires_grad_(), bias.requires_grad_()
    expected = F.conv2d(image, conv_w, bias, stride=stride, padding=padding)
    grad_y = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (image, conv_w, bias), grad_y)
    for backend in backends_for(meta):
        y = knn_conv(to_nodes(image), conv_w.reshape(c_out, -1), bias, meta, backend=backend)
        y = to_grid(y, *expected.shape[2:])
        grads = torch.autograd.grad(y, (image, conv_w, bias), grad_y)
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,v", [(1, 1), (9, 9), (4, 1)])
def test_padding_contributes_exact_zero_and_gets_no_gradient(k, v, device):
    """Outputs whose neighbours are all padding equal the bias exactly, and inputs that no real
    neighbour entry reads get exactly zero gradient (a padding entry must not leak a gradient
    into any input; the oracle tests catch a leak into an input that is also read)."""
    meta = random_meta(k, v, seed=11, device=device)
    knn = meta.knn.clone()
    knn[:, 3] = meta.n_in  # node 3: padding only
    meta = KNNMeta.from_knn(knn, meta.rf_index, n_in=meta.n_in, in_channels=3, v=v)
    x, w, b = sample_inputs(meta, dtype=torch.float32)
    for backend in backends_for(meta):
        y = knn_conv(x, w, b, meta, backend=backend)
        assert torch.equal(y[:, :, 3], b.detach().expand(2, -1)), backend
        (grad_x,) = torch.autograd.grad(y, x, torch.ones_like(y))
        unused = torch.ones(meta.n_in, dtype=torch.bool, device=device)
        unused[knn[knn < meta.n_in]] = False
        assert unused.any()
        assert torch.equal(grad_x[:, :, unused], torch.zeros_like(grad_x[:, :, unused])), backend


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,v", [(1, 1), (9, 9), (4, 1)])
@pytest.mark.parametrize("cells", [False, True], ids=["dense", "cells"])
def test_batch_sizes_zero_and_one(k, v, cells, device, monkeypatch):
    force_cells(monkeypatch, cells)
    meta = random_meta(k, v, device=device)
    for batch in (0, 1):
        x, w, b = sample_inputs(meta, batch=batch)
        grad_y = torch.randn(batch, 4, meta.n_out, dtype=torch.float64, device=device)
        expected = forward_and_grads(x, w, b, meta, grad_y, None)
        for backend in backends_for(meta):
            got = forward_and_grads(x, w, b, meta, grad_y, backend)
            assert got[0].shape == (batch, 4, meta.n_out)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def _x_in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of ``x [B, Cin, Nin]`` in another memory layout (never contiguous)."""
    if layout == "node-major":  # fovi's: storage [B, Nin, Cin]
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "batch-minor":  # storage [Cin, Nin, B]
        return x.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    wide = torch.zeros(*x.shape[:2], 2 * x.shape[2], dtype=x.dtype, device=x.device)
    wide[:, :, ::2] = x
    return wide[:, :, ::2]  # every other node of a wider tensor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,v", [(1, 1), (9, 9)])
@pytest.mark.parametrize("layout", ["node-major", "batch-minor", "strided nodes"])
@pytest.mark.parametrize("cells", [False, True], ids=["dense", "cells"])
def test_non_contiguous_operands(k, v, layout, cells, device, monkeypatch):
    """x in other layouts, a transposed weight and grad_y give the same results as contiguous
    ones."""
    force_cells(monkeypatch, cells)
    meta = random_meta(k, v, device=device)
    x, w, b = sample_inputs(meta, batch=3)
    grad_y = torch.randn(3, 4, meta.n_out, dtype=torch.float64, device=device)
    x_t = _x_in_layout(x.detach(), layout)  # [B, Cin, Nin], strided
    w_t = w.detach().t().contiguous().t()  # [Cout, Cin*V], column-major
    g_t = grad_y.transpose(0, 2).contiguous().transpose(0, 2)
    assert not (x_t.is_contiguous() or w_t.is_contiguous() or g_t.is_contiguous())
    assert torch.equal(x_t, x.detach())
    for backend in backends_for(meta):
        got = forward_and_grads(x_t, w_t, b, meta, g_t, backend)
        expected = forward_and_grads(x, w, b, meta, grad_y, backend)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_float16_sums_that_overflow_float16_but_not_the_result_stay_finite():
    """Two neighbours of 40000 in one cell, weight 0.01: the exact y is 800 (F.linear gives it).
    ``general`` accumulates as a float16 GEMM does (float32, one rounding at the end);
    ``einsum_baseline`` stores the cell sum in float16, as fovi 2.4.0's einsum does: inf."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0], [1]]), torch.tensor([[0, 0]]), n_in=2, in_channels=1, v=1
    )
    x = torch.full((1, 1, 2), 40000.0, dtype=torch.float16)
    w = torch.full((1, 1), 0.01, dtype=torch.float16)
    exact = float(F.linear(x[0].double(), w.double().expand(1, 2)))
    y, grad_x, _, _ = forward_and_grads(x, w, None, meta, torch.ones(1, 1, 1), "general")
    assert abs(float(y) - exact) <= 2**-11 * exact and grad_x.isfinite().all()
    assert float(knn_conv(x, w, None, meta, backend=BASELINE)) == float("inf")
