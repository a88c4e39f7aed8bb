"""The domain limit the adversarial pass (scripts/adversarial.py) found, pinned as a contract.

``general`` and ``einsum_baseline`` add a cell's inputs before the weight applies (as fovi's einsum
path does). Where that sum passes the accumulation dtype's largest value, ``y`` is not finite
although every term ``x * w`` and the exact ``y`` are. help(fovi_ref) states this domain; these
tests hold the two promises that make it safe: the result is then non-finite (never a wrong finite
number), and one binary order of magnitude inside the domain the same inputs pass the rule.
"""

from __future__ import annotations

import pytest
import torch

from fovi_ref import KNNMeta, knn_conv
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise


def _two_neighbours_in_one_cell(dtype, fraction):
    """Inputs of ``fraction * max`` at two neighbours in one cell, weight 0.01."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0], [1]]), torch.zeros(1, 2, dtype=torch.int64), n_in=2, in_channels=1, v=1
    )
    big = fraction * torch.finfo(dtype).max
    x = torch.tensor([[[big, big]]], dtype=torch.float64).to(dtype)
    return meta, x, torch.tensor([[0.01]], dtype=dtype)


@pytest.mark.parametrize("backend", ["general", "einsum_baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_a_cell_sum_past_the_largest_value_gives_no_finite_answer(dtype, backend):
    meta, x, w = _two_neighbours_in_one_cell(dtype, 0.6)  # x0 + x1 = 1.2 max
    exact = expected_quantities(x, w, None, meta, torch.ones(1, 1, 1, dtype=dtype))["y"].value
    assert torch.isfinite(exact).all()  # F.linear's order would have stayed finite
    y = knn_conv(x, w, None, meta, backend=backend)
    assert not torch.isfinite(y).any()


@pytest.mark.parametrize("backend", ["general", "einsum_baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_inside_the_domain_the_same_inputs_pass_the_rule(dtype, backend):
    meta, x, w = _two_neighbours_in_one_cell(dtype, 0.3)  # x0 + x1 = 0.6 max
    expected = expected_quantities(x, w, None, meta, torch.ones(1, 1, 1, dtype=dtype))
    assert judge_elementwise(knn_conv(x, w, None, meta, backend=backend), expected["y"]).ok
