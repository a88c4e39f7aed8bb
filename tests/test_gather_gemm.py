"""The gather_gemm backend's internals: its derived data (index, padding, S) and the S budget."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, random_meta, sample_inputs
from torch.profiler import ProfilerActivity, profile

from fovi_ref import KNNMeta, knn_conv, prepare
from fovi_ref import knn_gather_gemm as gg
from fovi_ref.check.switches import forced, forced_grad_input_path
from fovi_ref.knn_gather_gemm import GatherGemmOps, derive
from fovi_ref.precision import platform


def test_derived_index_without_padding_is_the_knn_row():
    meta = random_meta(1, 1, padding=False)
    data = derive(meta)
    assert torch.equal(data["index"], meta.knn[0])
    assert data["padding"].numel() == 0


def test_derived_index_with_padding():
    knn = torch.tensor([[2, 5, 0, 5]])  # n_in = 5: nodes 1 and 3 are padding
    meta = KNNMeta.from_knn(knn, torch.zeros(4, 1, dtype=torch.long), n_in=5, in_channels=3, v=1)
    data = derive(meta)
    assert data["padding"].tolist() == [1, 3]
    assert data["index"].tolist() == [2, 0, 0, 0]  # padding replaced by a safe index, zeroed later


def test_scatter_matrix_is_one_hot_with_zero_padding_rows():
    knn = torch.tensor([[2, 5, 2, 4]])  # nodes 0 and 2 collide on input 2; node 1 is padding
    meta = KNNMeta.from_knn(knn, torch.zeros(4, 1, dtype=torch.long), n_in=5, in_channels=1, v=1)
    expected = torch.zeros(4, 5)
    expected[0, 2] = expected[2, 2] = expected[3, 4] = 1
    assert torch.equal(derive(meta)["scatter"], expected)


def test_scatter_matrix_is_kept_only_for_small_graphs(monkeypatch):
    monkeypatch.setattr(gg, "S_MAX_ELEMENTS", 100)
    assert derive(random_meta(1, 1, n_in=10, n_out=10))["scatter"].shape == (10, 10)
    assert derive(random_meta(1, 1, n_in=11, n_out=10))["scatter"].shape == (0, 11)


@pytest.mark.parametrize("device", DEVICES)
def test_derived_data_lives_on_the_meta_and_moves_with_it(device):
    a = random_meta(1, 1, seed=1)
    b = random_meta(1, 1, seed=1)  # same graph, another meta: nothing shared
    first = a.derived("gather_gemm", derive)
    assert a.derived("gather_gemm", lambda m: pytest.fail("derived twice")) is first
    assert b.derived("gather_gemm", derive) is not first
    moved = a.to(device)
    assert moved.derived("gather_gemm", lambda m: pytest.fail("moved data is derived again"))
    assert moved.derived("gather_gemm", derive)["scatter"].device.type == device


def test_derive_refuses_other_graphs():
    with pytest.raises(ValueError, match="K == 1 and V == 1"):
        derive(random_meta(9, 9))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_dense_and_index_paths_agree(device, dtype):
    """Above the budget grad_input scatters by index instead of multiplying by S: same result."""
    meta = random_meta(1, 1, n_in=40, n_out=30, seed=4, device=device)  # has collisions, padding
    _, w, _ = sample_inputs(meta, dtype=dtype)
    grad_y = torch.randn(2, 4, meta.n_out, device=device).to(dtype)
    with forced_grad_input_path("dense", meta.device.type):
        assert gg.uses_dense_scatter(meta, meta.device)
        dense = GatherGemmOps.grad_input(meta, grad_y, w.detach())
    with forced_grad_input_path("index", meta.device.type):
        assert not gg.uses_dense_scatter(meta, meta.device)
        index = GatherGemmOps.grad_input(meta, grad_y, w.detach())
    # Both add the same one or two terms per input (at most one collision here) in float32 or
    # wider accumulators, so they agree to the last bit or within one rounding of the dtype.
    torch.testing.assert_close(index, dense, rtol=2 * torch.finfo(dtype).eps, atol=0)
    assert dense.is_contiguous() and index.is_contiguous()
    assert torch.equal(dense[:, :, -3:], torch.zeros_like(dense[:, :, -3:]))  # unused inputs


def test_budget_is_a_size_threshold_and_forcing_restores_it(monkeypatch):
    small = random_meta(1, 1, n_in=4, n_out=3)  # Nout*Nin = 12
    large = random_meta(1, 1, n_in=400, n_out=300)
    cpu = torch.device("cpu")
    # A threshold between the two sizes: the measured CPU value may be 0 (index path everywhere).
    monkeypatch.setitem(gg.DENSE_S_BUDGET, "cpu", 100)
    assert gg.uses_dense_scatter(small, cpu) and not gg.uses_dense_scatter(large, cpu)
    before = dict(gg.DENSE_S_BUDGET)
    with forced_grad_input_path("dense"):
        assert gg.uses_dense_scatter(large, cpu)
    assert before == gg.DENSE_S_BUDGET
    with (
        pytest.raises(ValueError, match="path must be 'dense' or 'index'"),
        forced_grad_input_path("sparse"),
    ):
        pass


def test_forward_is_one_gather_and_one_gemm():
    """Operator count of gather_gemm's forward, from the profiler (CPU)."""

    meta = random_meta(1, 1, padding=False)
    x, w, b = (t.detach() for t in sample_inputs(meta, bias=True, dtype=torch.float32))
    prepare(meta, "gather_gemm")  # derive now, so that the profile holds the forward alone
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        GatherGemmOps.forward(meta, x, w, None)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::index") == 1, counts  # the gather, writing the GEMM's rows
    assert "aten::copy_" not in counts, counts  # so there is no fold
    gemm_ops = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
    assert sum(counts.get(op, 0) for op in gemm_ops) == 1, counts
    y = knn_conv(x, w, b, meta)
    assert y.shape == (2, 4, meta.n_out)
    assert y.transpose(1, 2).is_contiguous()  # fovi's layout, written by the GEMM directly


def test_eager_backward_reads_the_rows_the_forward_gathered():
    """Through knn_conv (eager) x is gathered once: the weight gradient reads the kept rows
    and equals, bit for bit, the backend's grad_weight that gathers again; with a frozen weight
    nothing is kept and x is not gathered for a weight gradient at all."""
    meta = prepare(random_meta(1, 1, n_in=40, n_out=30, padding=True), "gather_gemm")
    x, w, b = (t.detach() for t in sample_inputs(meta, bias=True, dtype=torch.float32))
    grad_y = torch.randn(x.shape[0], w.shape[0], meta.n_out)
    for weight_needs_grad in (True, False):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_(weight_needs_grad)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = knn_conv(xr, wr, b, meta)
            grads = torch.autograd.grad(y, [xr, wr] if weight_needs_grad else [xr], grad_y)
        gathers = sum(e.count for e in prof.key_averages() if e.key == "aten::index")
        assert gathers == 1
    laid_out = GatherGemmOps.grad_y_layout(grad_y)
    assert torch.equal(grads[0], GatherGemmOps.grad_input(meta, laid_out, w))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    kept = torch.autograd.grad(knn_conv(xr, wr, b, meta), wr, grad_y)[0]
    assert torch.equal(kept, GatherGemmOps.grad_weight(meta, laid_out, x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gemms", ["wide", "narrow"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_index_scatter_adds_collisions_in_float32_and_rounds_once(device, gemms, dtype):
    """Three outputs read input 0 with gradients +A, 1 and -A (A = 2/u): the sum is 1 when the
    scatter adds in float32, and 0 when each addition is rounded to the 16-bit dtype. On the CPU
    torch's ``index_add_`` adds 16-bit values in float32 itself (the mutation job found widening
    ``d_sel`` unseen there: scripts/mutations/equivalents.toml); on CUDA the widening is what
    keeps this sum right."""
    big = 2 / torch.finfo(dtype).eps
    knn = torch.tensor([[0, 0, 0]])  # [K=1, Nout=3]
    zeros = torch.zeros(3, 1, dtype=torch.long)
    meta = KNNMeta.from_knn(knn, zeros, n_in=2, in_channels=1, v=1).to(device)
    weight = torch.ones(1, 1, dtype=dtype, device=device)  # [Cout, Cin]: d = grad_y exactly
    grad_y = torch.tensor([[[big, 1.0, -big]]], dtype=dtype, device=device)  # [B, Cout, Nout]
    with forced(gemms, platform(device)), forced_grad_input_path("index", meta.device.type):
        grad_x = GatherGemmOps.grad_input(meta, grad_y, weight)
    assert grad_x.dtype == dtype and grad_x[0, 0].tolist() == [1.0, 0.0]
