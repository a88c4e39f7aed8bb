"""verify_meta: every backend judged elementwise, with the baseline's figure reported."""

from __future__ import annotations

import pytest
import torch
from conftest import ForeignOps

from fovi_ref import get_ops, register_ops, unregister_ops
from fovi_ref.check.verify import BASELINE, verify_meta
from fovi_ref.geometry import get_layer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_verify_meta_judges_every_backend_and_reports_the_baseline():
    layer = get_layer("layer4.0.downsample.0")
    checks = verify_meta(layer.name, layer.meta, layer.out_channels, batch=2)
    assert {c.backend for c in checks} == {
        "general",
        "general_textbook",
        "gather_gemm",
        "einsum_baseline",
    }
    assert {c.quantity for c in checks} == {"y", "grad_x", "grad_weight", "grad_bias"}
    assert all(c.verdict.ok for c in checks), [str(c.verdict) for c in checks if not c.verdict.ok]
    for c in checks:
        assert c.verdict.baseline_ratio is not None  # the second, reported figure
        assert c.verdict.ratio <= 1 and c.verdict.worst_error <= c.verdict.worst_bound
        if c.backend == BASELINE:
            assert c.verdict.baseline_ratio == c.verdict.ratio


class BiasTwice(ForeignOps):
    """general with the bias added twice."""

    name = "bias_twice"

    @staticmethod
    def forward(meta, x, weight, bias):
        return get_ops("general").forward(meta, x, weight, bias) + bias[:, None]


def test_verify_meta_fails_a_wrong_backend_in_every_dtype():
    layer = get_layer("layer4.1.conv1")
    register_ops(BiasTwice)
    try:
        checks = verify_meta(layer.name, layer.meta, layer.out_channels, batch=2)
    finally:
        unregister_ops("bias_twice")
    bad = {
        (str(c.dtype), c.quantity) for c in checks if c.backend == "bias_twice" and not c.verdict.ok
    }
    assert bad == {(str(d), "y") for d in (torch.float32, torch.float16, torch.bfloat16)}


@pytest.mark.parametrize(
    "bad",
    [dict(batch=0), dict(batch=-1), dict(batch=2.5), dict(dtypes=()), dict(dtypes=(torch.int32,))],
    ids=["batch 0", "batch -1", "batch 2.5", "no dtype", "int32"],
)
def test_verify_meta_refuses_a_battery_that_judges_nothing(bad):
    """batch=0 gave 24 PASS verdicts on empty tensors and dtypes=() an empty list, both read as
    'all passed' (found by the adversarial pass); the others failed deep inside torch."""
    from fovi_ref.check.check_ops import random_meta

    with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
        verify_meta("random", random_meta(2, 3), 2, **bad)
