"""Non-finite inputs: general and gather_gemm follow the formula (an inf or nan reaches exactly
the outputs and weight-gradient entries that read it); einsum_baseline keeps fovi's behaviour."""

from __future__ import annotations

import pytest
import torch
from conftest import random_meta, sample_inputs

from fovi_ref import knn_conv
from fovi_ref.reference import knn_conv_reference


def grads(fn, x, w, b):
    y = fn(x, w, b)
    gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    return y.detach(), gx, gw


def poisoned(meta, value):
    """Inputs with ``value`` at one input node that some output reads."""
    x, w, b = sample_inputs(meta)
    with torch.no_grad():
        x[0, 1, int(meta.knn[~meta.pad_mask][0])] = value
    return x, w, b


@pytest.mark.parametrize("value", [torch.inf, torch.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("k,v", [(1, 1), (4, 4), (9, 3)])
def test_general_and_gather_gemm_follow_the_oracle(k, v, value):
    meta = random_meta(k, v)
    x, w, b = poisoned(meta, value)
    expected = grads(lambda *a: knn_conv_reference(*a, meta), x, w, b)
    backends = ["general", "gather_gemm"] if (k, v) == (1, 1) else ["general"]
    for backend in backends:
        got = grads(lambda *a, be=backend: knn_conv(*a, meta, backend=be), x, w, b)
        for name, g, e in zip(("y", "grad_x", "grad_weight"), got, expected, strict=True):
            assert torch.equal(torch.isnan(g), torch.isnan(e)), (backend, name)
            assert torch.equal(torch.isinf(g), torch.isinf(e)), (backend, name)
            finite = torch.isfinite(e)
            torch.testing.assert_close(g[finite], e[finite].to(g.dtype), msg=(backend, name))
    y = expected[0]
    assert 0 < int((~torch.isfinite(y)).sum()) < y.numel()  # reached some outputs, not all


def test_einsum_baseline_keeps_fovis_inf_times_zero():
    """fovi's one-hot einsum multiplies every gathered feature by the other cells' zeros, so an
    inf becomes nan across the cells of the nodes that read it (the oracle keeps inf there)."""
    meta = random_meta(4, 4)
    x, w, b = poisoned(meta, torch.inf)
    y_ref = knn_conv_reference(x, w, b, meta)
    y = knn_conv(x, w, b, meta, backend="einsum_baseline")
    assert torch.isnan(y).sum() > torch.isnan(y_ref).sum()
    assert torch.equal(torch.isfinite(y), torch.isfinite(y_ref))  # the same outputs are hit
