"""The deterministic segment sum (fovi_ref.segment_sum) against its loops and its naive twin."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from conftest import DEVICES, random_meta

from fovi_ref.check.bench.hub import hub_meta
from fovi_ref.knn_general import bin_entries, derive
from fovi_ref.segment_sum import (
    HUB,
    SegmentSumPlan,
    build_segment_sum_plan,
    segment_sum,
    segment_sum_naive,
)


def order_sensitive_rows(rows: int, batch: int, device) -> torch.Tensor:
    """float32 values spread over 2**-12 .. 2**12 with random signs: adding them in another
    order changes the rounded sum, so a test comparing bits can see the order."""
    g = torch.Generator().manual_seed(3)
    scale = 2.0 ** torch.randint(-12, 13, (rows, batch), generator=g)
    return (torch.randn(rows, batch, generator=g) * scale).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["bin", "unbin"])
def test_segment_sums_add_in_listed_order_bit_for_bit(direction, device):
    """The textbook's sums run in a fixed order: every row adds its terms one at a time, in
    increasing k (bin: the neighbours in a cell; unbin: the (k, n) pairs reading an input),
    except a hub row (more than HUB terms), which adds them pairwise: term j to term j + W/2,
    W the next power of two (zeros beyond the terms), until one is left. Checked bitwise against
    those orders written as loops over the entries; on CUDA this is what index_add_ (atomics)
    would not give. The reversed loop differs, so the data can tell orders apart."""
    meta = random_meta(9, 3, n_in=25, n_out=40, in_channels=2, seed=11, device=device)
    z_row, x_row = bin_entries(meta)
    dst, src = (z_row, x_row) if direction == "bin" else (x_row, z_row)
    if direction == "bin":
        size = meta.in_channels * meta.v * meta.n_out
    else:
        size = meta.in_channels * meta.n_in
    values = order_sensitive_rows(int(src.max()) + 1, 3, device)
    plan = SegmentSumPlan.from_derived(derive(meta), direction)
    got = segment_sum(values, plan)
    hubs = torch.bincount(dst, minlength=size) > HUB
    assert bool(hubs.any()) == (direction == "unbin")  # both orders are exercised

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
    absolute = segment_sum_naive(values.abs(), dst, src, size)
    bound = n_terms * torch.finfo(torch.float32).eps * absolute
    assert bool(((naive - got).abs() <= bound).all())


def test_trees_of_several_widths_and_rows_without_terms():
    """Hubs of 17, 40 and 300 terms (widths 32, 64, 512: three groups of trees), rows with no
    term (exact zeros), and a row of one term, against the loop over the entries in float64
    with integer values (every order exact: the plan's bookkeeping is what is tested)."""
    counts = {0: 17, 2: 40, 3: 300, 5: 1, 6: 3}  # rows 1, 4 and 7 have no term
    dst = torch.cat([torch.full((n,), d) for d, n in counts.items()])
    src = torch.randperm(dst.numel(), generator=torch.Generator().manual_seed(1))
    plan = build_segment_sum_plan(dst, src, 8)
    assert plan.tree_shapes.tolist() == [[1, 32], [1, 64], [1, 512]]
    values = torch.randint(-5, 6, (dst.numel(), 4), dtype=torch.float64)
    expected = torch.zeros(8, 4, dtype=torch.float64)
    expected.index_add_(0, dst, values[src])
    assert torch.equal(segment_sum(values, plan), expected)
    assert torch.equal(segment_sum_naive(values, dst, src, 8), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_terms_at_all_give_exact_zeros(dtype):
    """No entries over no values (the pairs of a graph of padding only, summed back to its
    inputs): every row is an exact zero of the values' dtype, as the naive loop gives."""
    none = torch.zeros(0, dtype=torch.int64)
    plan = build_segment_sum_plan(none, none, 5)
    values = torch.zeros(0, 6, dtype=dtype)
    out = segment_sum(values, plan)
    assert out.dtype == dtype and torch.equal(out, torch.zeros(5, 6, dtype=dtype))
    assert torch.equal(segment_sum_naive(values, none, none, 5), out)


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_is_nine_tensors_that_round_trip_through_derived_data(device):
    """Plans are stored as tensors under fixed names (no per-round keys), every one an int64
    index on the graph's device (a plan without trees too), and read back whole."""
    meta = hub_meta(64, device=device)
    data = derive(meta)
    assert all(t.dtype == torch.int64 and t.device == meta.device for t in data.values())
    assert SegmentSumPlan.from_derived(data, "bin").tree_dst.numel() == 0  # no tree: empty parts
    assert sorted(data) == sorted(
        f"{prefix}.{field}"
        for prefix in ("bin", "unbin")
        for field in (
            "first",
            "empty",
            "round_dst",
            "round_src",
            "round_sizes",
            "tree_dst",
            "tree_src",
            "tree_pad",
            "tree_shapes",
        )
    )
    plan = SegmentSumPlan.from_derived(data, "unbin")
    assert plan.tree_dst.numel() > 0  # the hub's row, in a tree
    again = SegmentSumPlan.from_derived(plan.as_derived("p"), "p")
    for field in fields(SegmentSumPlan):
        assert torch.equal(getattr(plan, field.name), getattr(again, field.name)), field.name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_sums_accumulate_in_float32_and_round_once(dtype, device):
    """Two terms of 40000 in float16 overflow (65504 is the largest) where float32 does not; the
    sum is rounded once at the end, so it is the float32 sum rounded, bit for bit, in both forms
    (the naive twin too, which no backend calls: this test is what holds it)."""
    values = torch.tensor([[40000.0], [40000.0], [-30000.0]], dtype=dtype, device=device)
    dst = torch.tensor([0, 0, 0], device=device)
    src = torch.tensor([0, 1, 2], device=device)
    plan = build_segment_sum_plan(dst, src, 1)
    expected = (values.float()[0] + values.float()[1] + values.float()[2]).to(dtype)
    for got in (segment_sum(values, plan), segment_sum_naive(values, dst, src, 1)):
        assert got.dtype == dtype
        assert torch.equal(got, expected[None])
