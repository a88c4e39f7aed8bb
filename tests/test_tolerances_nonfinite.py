"""The tolerance rule's non-finite allowances (fovi_ref.check.tolerances, "Non-finite values"):
an overflow is allowed where a correct implementation may overflow, a stored 16-bit value past
its range is no rounding, and a non-finite weight may make its output channel of ``y`` and its
input channel of ``grad_x`` non-finite, nothing else."""

from __future__ import annotations

import math

import pytest
import torch

from fovi_ref import KNNMeta, get_ops
from fovi_ref.check.operands import forward_and_grads
from fovi_ref.check.tolerances import (
    expected_quantities,
    judge_elementwise,
    overflow_threshold,
)

F16, BF16 = torch.float16, torch.bfloat16


def test_the_overflow_threshold_is_the_largest_value_plus_half_an_ulp():
    assert overflow_threshold(F16) == 65504 + 16
    assert overflow_threshold(BF16) == torch.finfo(BF16).max + 2.0**119
    assert overflow_threshold(torch.float32) == torch.finfo(torch.float32).max + 2.0**103


def _shared_input() -> KNNMeta:
    """Nodes 0 and 1 read input 0 in cell 0; node 0 also reads input 1, node 1 input 2."""
    knn = torch.tensor([[0, 0], [1, 2]])  # [K, Nout]
    return KNNMeta.from_knn(knn, torch.tensor([[0, 1], [0, 1]]), n_in=3, in_channels=1, v=2)


def test_a_float16_value_stored_past_65504_is_no_rounding():
    """grad_z is +160,000 at node 0 and -159,744 at node 1: the exact grad_x of input 0 is 256,
    while every magnitude M is past 65504. A nan there fails (a store past the range is no
    rounding); inputs 1 and 2, whose exact value is past 65504, may come back inf."""
    meta = _shared_input()
    x = torch.ones(1, 1, 3, dtype=F16)
    w = torch.full((2, 2), 2.0, dtype=F16)
    gy = torch.tensor([[[40000.0, -39936.0]] * 2], dtype=F16)  # [B=1, Cout=2, Nout=2]
    expected = expected_quantities(x, w, None, meta, gy)["grad_x"]
    assert float(expected.value[0, 0, 0]) == 256.0 and bool((expected.magnitude >= 65520).all())
    right = expected.value.to(F16)  # input 0 exact, inputs 1 and 2 rounded to inf
    assert right[0, 0, 1].isinf() and judge_elementwise(right, expected).ok
    stored = right.clone()
    stored[0, 0, 0] = math.nan  # +inf + -inf: what a float16 grad_z gives
    verdict = judge_elementwise(stored, expected)
    assert not verdict.ok and verdict.nonfinite_mismatches == 1 and verdict.worst_index == (0, 0, 0)
    got = forward_and_grads(x, w, None, meta, gy, "general")[1]
    assert judge_elementwise(got, expected).ok and float(got[0, 0, 0]) == 256.0


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_non_finite_weight_may_poison_its_y_channel_and_its_grad_x_channel_and_nothing_else(bad):
    """weight[0, cell 1 of input channel 0] is non-finite; node 0 reads cell 1 (through input 1),
    and node 1 reads cell 0 alone, so y[:, 0, 1] is finite for the oracle, nan for a GEMM over
    every cell column. That is allowed, and so is a non-finite grad_x in input channel 0 (a
    backward that sums grad_z with a matrix multiplies its inf by zeros); a nan in output
    channel 1 of y, or in input channel 1 of grad_x, is not."""
    knn = torch.tensor([[0, 0], [1, 2]])
    meta = KNNMeta.from_knn(knn, torch.tensor([[0, 1], [0, 0]]), n_in=3, in_channels=2, v=2)
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(2, 2, 3, generator=g), torch.randn(2, 2, 2, generator=g)
    w = torch.randn(2, 4, generator=g)  # [Cout, Cin*V]
    w[0, 1] = bad
    expected = expected_quantities(x, w, None, meta, gy)
    assert bool(expected["y"].value[:, 0, 1].isfinite().all())  # node 1 never fills cell 1
    y, grad_x, grad_weight, _ = forward_and_grads(x, w, None, meta, gy, "general")
    assert not bool(y[:, 0, 1].isfinite().any())  # the GEMM: 0 * inf or 0 * nan
    for quantity, value in (("y", y), ("grad_x", grad_x), ("grad_weight", grad_weight)):
        assert judge_elementwise(value, expected[quantity]).ok, quantity
    other_channel = y.clone()
    other_channel[0, 1, 1] = math.nan
    assert judge_elementwise(other_channel, expected["y"]).nonfinite_mismatches == 1
    poisoned = grad_x.clone()
    poisoned[:, 0, :] = math.nan  # the weight's input channel: allowed
    assert judge_elementwise(poisoned, expected["grad_x"]).ok
    poisoned[:, 1, 0] = math.nan  # the other input channel: not
    assert not judge_elementwise(poisoned, expected["grad_x"]).ok
    baseline = forward_and_grads(x, w, None, meta, gy, get_ops("einsum_baseline"))[1]
    assert judge_elementwise(baseline, expected["grad_x"]).ok  # its one-hot zeros: 0 * inf
