"""What the adversarial pass (scripts/adversarial.py) found in files its author could not change.

Each test states the promise and is marked ``xfail(strict=True)`` until the owner of the file
fixes it: then it passes, strict xfail turns that into a failure, and the mark comes off.
"""

from __future__ import annotations

import pytest
import torch

from fovi_ref import KNNMeta, knn_conv
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise


@pytest.mark.xfail(
    strict=True,
    reason="general bins the neighbours of a cell (sum of x) before the weight applies; in "
    "float32, float64 and bfloat16 (binned in float32) that sum overflows to inf where y and "
    "every term x*w are far below the largest finite value (fovi_ref/knn_general.py)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_general_does_not_overflow_where_no_term_and_no_result_does(dtype):
    """Two neighbours in one cell, each x at 0.6 of the largest finite value, weight 0.01:
    ``y = 0.012 max`` is finite and so is every term, but ``x0 + x1 = 1.2 max`` is not. The rule
    accepts a non-finite result only where the terms' magnitude reaches overflow."""
    meta = KNNMeta.from_knn(torch.tensor([[0], [1]]), torch.zeros(1, 2, dtype=torch.int64),
                            n_in=2, in_channels=1, v=1)  # fmt: skip
    big = 0.6 * torch.finfo(dtype).max
    x = torch.tensor([[[big, big]]], dtype=torch.float64).to(dtype)
    w = torch.tensor([[0.01]], dtype=dtype)
    gy = torch.ones(1, 1, 1, dtype=dtype)
    expected = expected_quantities(x, w, None, meta, gy)
    y = knn_conv(x, w, None, meta, backend="general")
    assert torch.isfinite(expected["y"].value).all()
    assert judge_elementwise(y, expected["y"]).ok
