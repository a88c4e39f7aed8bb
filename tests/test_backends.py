"""Every backend against the float64 oracle, gradcheck, and F.conv2d on regular grids."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, LOW_PRECISION, force_cells, random_meta, sample_inputs

from fovi_ref import KNNMeta, knn_conv, knn_general
from fovi_ref.check.operands import forward_and_grads
from fovi_ref.check.tolerances import QUANTITIES, expected_quantities, judge_elementwise
from fovi_ref.check.verify import BASELINE, backends_for
from fovi_ref.grid import conv2d_grid_meta, to_grid, to_nodes
from fovi_ref.knn_general import (
    FEW_SAMPLES,
    HUB,
    SegmentSumPlan,
    block_channels,
    cell_blocks,
    over_nodes,
    segment_sum,
    segment_sum_entries,
    segment_sum_naive,
)
from fovi_ref.knn_general import derive as general_derive

KS = [1, 2, 4, 9, 49]
VS = [1, 4, 9, 49]
GRAPHS = [(k, v) for k in KS for v in VS]
# general sums over node rows up to FEW_SAMPLES samples, over channel rows beyond, and runs its
# GEMMs dense or per occupied cell (forced either way here): all four are judged.
BATCHES = pytest.mark.parametrize(
    "batch,cells",
    [(2, False), (FEW_SAMPLES + 3, False), (2, True), (FEW_SAMPLES + 3, True)],
    ids=["node rows", "channel rows", "cells, few samples", "cells"],
)


def test_the_batches_take_both_layouts():
    assert over_nodes(2) and not over_nodes(FEW_SAMPLES + 3)


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

        assert torch.autograd.gradcheck(fn, (x, w, b)), backend


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


def order_sensitive_rows(rows: int, batch: int, device) -> torch.Tensor:
    """float32 values spread over 2**-12 .. 2**12 with random signs: adding them in another
    order changes the rounded sum, so a test comparing bits can see the order."""
    g = torch.Generator().manual_seed(3)
    scale = 2.0 ** torch.randint(-12, 13, (rows, batch), generator=g)
    return (torch.randn(rows, batch, generator=g) * scale).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_segment_sums_add_in_listed_order_bit_for_bit(direction, device):
    """general's sums run in a fixed order: every row adds its contributions one at a time, in
    increasing k (forward: the neighbours in a cell; backward: the (k, n) pairs reading an input),
    except a hub row (more than HUB terms), which adds them pairwise: term j to term j + W/2,
    W the next power of two (zeros beyond the terms), until one is left. Checked bitwise against
    those orders written as loops over the entries; on CUDA this is what index_add_ (atomics)
    would not give. The reversed loop differs, so the data can tell orders apart."""
    meta = random_meta(9, 3, n_in=25, n_out=40, in_channels=2, seed=11, device=device)
    z_row, x_row = segment_sum_entries(meta)
    dst, src = (z_row, x_row) if direction == "forward" else (x_row, z_row)
    size = (
        (meta.in_channels * meta.v * meta.n_out)
        if direction == "forward"
        else (meta.in_channels * meta.n_in)
    )
    values = order_sensitive_rows(int(src.max()) + 1, 3, device)
    plan = SegmentSumPlan.from_derived(general_derive(meta), direction)
    got = segment_sum(values, plan)
    hubs = torch.bincount(dst, minlength=size) > HUB
    assert bool(hubs.any()) == (direction == "backward")  # both orders are exercised

    def in_order(order):
        out = torch.zeros(size, 3, device=device)
        terms = {}
        for e in order:
            if hubs[dst[e]]:
                terms.setdefault(int(dst[e]), []).append(values[src[e]])
            else:
                out[dst[e]] += values[src[e]]
        for d, listed in terms.items():  # the tree, as a loop
            width = 1 << (len(listed) - 1).bit_length()
            listed += [torch.zeros(3, device=device)] * (width - len(listed))
            while len(listed) > 1:
                half = len(listed) // 2
                listed = [listed[j] + listed[j + half] for j in range(half)]
            out[d] = listed[0]
        return out

    entries = range(dst.numel())
    assert torch.equal(got, in_order(entries))
    assert not torch.equal(got, in_order(reversed(entries)))  # the test has power
    naive = segment_sum_naive(values, dst, src, size)  # the readable twin: same sums
    # ... up to the order of the roundings: n terms in any order err by n * eps * sum |terms|.
    n_terms = int(torch.bincount(dst, minlength=size).max())
    bound = (
        n_terms * torch.finfo(torch.float32).eps * segment_sum_naive(values.abs(), dst, src, size)
    )
    assert bool(((naive - got).abs() <= bound).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_node_rows_sum_like_channel_rows_bit_for_bit(direction, device):
    """The node plans (one channel's entries) applied to node rows ``[N, B*Cin]`` give the
    channel plans' sums on channel rows ``[Cin*N, B]`` bit for bit: same rows, same order, hub
    trees included (the backward of this graph has hubs)."""
    c_in, batch, n_out = 3, 2, 4 * HUB
    meta = random_meta(9, 9, n_in=25, n_out=n_out, in_channels=c_in, seed=5, device=device)
    derived = general_derive(meta)
    rows = meta.n_in if direction == "forward" else meta.v * n_out  # source rows per channel
    values = order_sensitive_rows(c_in * rows, batch, device)  # [Cin*rows, B], channel rows
    channel_sums = segment_sum(values, SegmentSumPlan.from_derived(derived, direction))
    nodes = values.view(c_in, rows, batch).permute(1, 2, 0).reshape(rows, batch * c_in)
    node_sums = segment_sum(nodes, SegmentSumPlan.from_derived(derived, f"{direction}_nodes"))
    as_channels = node_sums.view(-1, batch, c_in).permute(2, 0, 1).reshape(-1, batch)
    assert torch.equal(as_channels, channel_sums)


@pytest.mark.parametrize("device", DEVICES)
def test_pair_features_are_the_occupied_node_row_sums_bit_for_bit(device):
    """Over occupied cells, the forward sums land each (node, cell) pair in its own row: the
    rows the node plan writes for the occupied pairs, bit for bit (same terms, same order, the
    hub tree of this graph's backward included), and nothing for the empty ones."""
    meta = random_meta(9, 9, n_in=25, n_out=4 * HUB, in_channels=3, seed=5, device=device)
    derived, batch = general_derive(meta), 2
    nodes = order_sensitive_rows(meta.n_in, batch * meta.in_channels, device)  # [Nin, B*Cin]
    z_nodes = segment_sum(nodes, SegmentSumPlan.from_derived(derived, "forward_nodes"))
    z_pairs = segment_sum(nodes, SegmentSumPlan.from_derived(derived, "cells_forward"))
    cells, _ = segment_sum_entries(meta)
    occupied = torch.unique(cells[: cells.numel() // meta.in_channels])  # rows v*Nout + n
    assert occupied.numel() < meta.v * meta.n_out  # the graph has empty cells
    assert torch.equal(z_pairs, z_nodes[occupied])
    assert sum(cell_blocks(meta)) == occupied.numel()
    empty = torch.ones(meta.v * meta.n_out, dtype=torch.bool, device=device)
    empty[occupied] = False
    assert not z_nodes[empty].any()  # what the per-cell GEMMs skip is zero


@pytest.mark.parametrize("device", DEVICES)
def test_a_cell_nobody_occupies_gets_an_exactly_zero_weight_gradient(device, monkeypatch):
    """Cell 2 of 4 is empty at every node: over cells its block is never multiplied, and its
    weight columns (c*V + 2) get exact zeros, as the dense GEMM's zero features give them."""
    force_cells(monkeypatch, True)
    meta = random_meta(4, 4, seed=2, device=device)
    rf_index = meta.rf_index.clone()
    rf_index[rf_index == 2] = 3
    meta = KNNMeta.from_knn(meta.knn, rf_index, n_in=meta.n_in, in_channels=meta.in_channels, v=4)
    assert cell_blocks(meta)[2] == 0 and knn_general.over_cells(meta, 3)
    x, w, b = sample_inputs(meta, batch=3)
    grad_y = torch.randn(3, 4, meta.n_out, dtype=torch.float64, device=device)
    got = forward_and_grads(x, w, b, meta, grad_y, "general")
    expected = expected_quantities(x, w, b, meta, grad_y)
    for what, g in zip(QUANTITIES, got, strict=True):
        assert judge_elementwise(g, expected[what]).ok, what
    assert torch.equal(got[2][:, 2::4], torch.zeros_like(got[2][:, 2::4]))


def test_general_runs_per_cell_where_its_estimate_says_it_pays():
    """The choice is a function of the graph and the batch alone (so are the results): on res18,
    per cell for layer3/layer4 at large batches, where many products are of empty cells' zeros;
    dense for layer1 (many pairs per node, few channels), at few samples everywhere, and where
    the pair features outgrow WHOLE_BYTES."""
    from fovi_ref.geometry import get_layer

    def runs_per_cell(name, batch):
        return knn_general.over_cells(get_layer(name).meta, batch)

    assert runs_per_cell("layer3.0.conv2", 16) and runs_per_cell("layer4.0.conv2", 64)
    assert not runs_per_cell("layer4.0.conv2", 16)  # the weight's copies outweigh the savings
    assert not any(runs_per_cell("layer1.0.conv1", batch) for batch in (1, 16, 256))
    assert not any(runs_per_cell(name, FEW_SAMPLES) for name in ("layer3.0.conv2", "conv1"))
    assert not runs_per_cell("layer3.0.conv2", 0)
    assert runs_per_cell("layer2.0.conv2", 64) and not runs_per_cell("layer2.0.conv2", 256)  # 69 MB


def small_blocks(monkeypatch, rows: int) -> None:
    """Make general's input gradient run in channel blocks of at most ``rows`` grad_z rows, at
    every batch (the real sizes block only large ``grad_z``: res18's layer1 at batch 64)."""
    monkeypatch.setattr(knn_general, "BLOCK_ROWS", rows)
    monkeypatch.setattr(knn_general, "WHOLE_BYTES", 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hub", [False, True])
def test_channel_blocks_sum_like_the_whole_plan_bit_for_bit(hub, device, monkeypatch):
    """The block plan (the first cb channels' entries) applied to every block of channels gives
    the whole backward plan's sums bit for bit: same rows, same order, hub trees included."""
    n_out = 4 * HUB if hub else 20  # with hub: some input is read by more than HUB outputs
    small_blocks(monkeypatch, 2 * 9 * n_out)  # 2 of the 6 channels per block
    meta = random_meta(9, 9, n_in=25, n_out=n_out, in_channels=6, seed=5, device=device)
    cb, derived = block_channels(meta), general_derive(meta)
    assert cb == 2
    z_row, x_row = segment_sum_entries(meta)
    assert bool((torch.bincount(x_row) > HUB).any()) == hub
    values = order_sensitive_rows(meta.in_channels * meta.v * n_out, 3, device)
    whole = segment_sum(values, SegmentSumPlan.from_derived(derived, "backward"))
    block = SegmentSumPlan.from_derived(derived, "backward_block")
    rows_in, rows_out = cb * meta.v * n_out, cb * meta.n_in
    for c in range(0, meta.in_channels, cb):
        got = segment_sum(values[c // cb * rows_in : (c // cb + 1) * rows_in], block)
        assert torch.equal(got, whole[c // cb * rows_out : (c // cb + 1) * rows_out])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,v,in_channels", [(9, 9, 6), (4, 3, 5), (1, 1, 4)])
def test_channel_blocked_input_gradient_matches_oracle(k, v, in_channels, device, monkeypatch):
    """general's input gradient in channel blocks (forced on small graphs) meets the rule against
    the float64 oracle."""
    meta = random_meta(k, v, in_channels=in_channels, seed=7, device=device)
    x, w, b = sample_inputs(meta)
    grad_y = torch.randn(x.shape[0], 4, meta.n_out, dtype=torch.float64, device=device)
    small_blocks(monkeypatch, meta.v * meta.n_out)  # one channel per block
    blocked_meta = random_meta(k, v, in_channels=in_channels, seed=7, device=device)  # new derive
    assert block_channels(blocked_meta) == 1
    got = forward_and_grads(x, w, b, blocked_meta, grad_y, "general")
    expected = expected_quantities(x, w, b, meta, grad_y)
    for what, g in zip(QUANTITIES, got, strict=True):
        verdict = judge_elementwise(g, expected[what])
        assert verdict.ok, f"{what}: {verdict}"


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
    meta = KNNMeta.from_knn(torch.tensor([[0], [1]]), torch.tensor([[0, 0]]), n_in=2,
                            in_channels=1, v=1)  # fmt: skip
    x = torch.full((1, 1, 2), 40000.0, dtype=torch.float16)
    w = torch.full((1, 1), 0.01, dtype=torch.float16)
    exact = float(F.linear(x[0].double(), w.double().expand(1, 2)))
    y, grad_x, _, _ = forward_and_grads(x, w, None, meta, torch.ones(1, 1, 1), "general")
    assert abs(float(y) - exact) <= 2**-11 * exact and grad_x.isfinite().all()
    assert float(knn_conv(x, w, None, meta, backend=BASELINE)) == float("inf")
