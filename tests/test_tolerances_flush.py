"""bfloat16 GEMMs that flush subnormals to zero (:mod:`fovi_ref.check.tolerances`, step 2 (f)).

On a CPU with native bfloat16 GEMMs (AVX512-BF16, AMX) oneDNN reads a subnormal operand as zero
and flushes a product or partial sum below ``tau = 2^-126`` to zero. The rule allows
``tau N (A + B + 5 + tau)`` for it in bfloat16 alone: derived by hand here, held on a machine
that flushes (skipped, with the reason, where the GEMM keeps subnormals), and refused in
float16, whose subnormals every GEMM keeps.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch

from fovi_ref.check.graphs import spanning_graph
from fovi_ref.check.operands import forward_and_grads, sample_operands
from fovi_ref.check.tolerances import Expected, error_bound, expected_quantities, judge_elementwise

TAU = 2.0**-126


def bfloat16_gemm_flushes() -> bool:
    """Whether this CPU's bfloat16 GEMM gives 0 for ``2^-130`` times ones over 64 terms (the
    exact sum is ``2^-124``); small GEMMs take another kernel, so the shape is 16 x 64 x 16."""
    a = torch.full((16, 64), 2.0**-130, dtype=torch.bfloat16)
    return float((a @ torch.ones(64, 16, dtype=torch.bfloat16))[0, 0]) == 0.0


FLUSHES = pytest.mark.skipif(
    not bfloat16_gemm_flushes(),
    reason="this CPU's bfloat16 GEMMs keep subnormals (no native bfloat16 GEMM: no AVX512-BF16 "
    "or AMX), so nothing flushes",
)


def one_element(factors: float | None) -> Expected:
    """``ref = M = 0`` over ``N = 64`` terms, nothing stored, operands whose largest values add
    to ``factors``."""
    one = torch.ones(1, 1, 1, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    factor_max = None if factors is None else one * factors
    return Expected("y", one * 0, one * 0, one * 64, zero, zero, zero, None, factor_max)


def test_the_flush_allowance_by_hand():
    """With ``M = 0`` only the underflow terms are left: in bfloat16
    ``eta + (1 + u) (64 eta32 + tau 64 (A + B + 5 + tau)) + 64 eta64`` with ``A + B = 3/2``; in
    float16 and float32 no flush term, and none where the quantity multiplies no operands."""
    u, eta, eta32, eta64 = (Fraction(1, 2**e) for e in (8, 134, 150, 1074))
    tau = Fraction(1, 2**126)
    want = eta + (1 + u) * (64 * eta32 + tau * 64 * (Fraction(3, 2) + 5 + tau)) + 64 * eta64
    got = Fraction(float(error_bound(one_element(1.5), torch.bfloat16)))
    assert abs(got - want) <= want / 2**45
    assert float(error_bound(one_element(None), torch.bfloat16)) < float(want) / 2**15
    for dtype in (torch.float16, torch.float32):
        assert float(error_bound(one_element(1.5), dtype)) == float(
            error_bound(one_element(None), dtype)
        )


def test_the_largest_operands_are_read_per_quantity():
    """``A + B``: ``x`` (or the bias, the larger) and the weight for ``y``; the weight and
    ``grad_y`` for ``grad_x``; ``grad_y`` and ``x`` for ``grad_weight``; none for
    ``grad_bias``."""
    meta = spanning_graph("base").meta
    x, w, b, gy = sample_operands(meta, 2, batch=2, seed=0, dtype=torch.bfloat16)
    x, w, b, gy = x.clamp(-1, 1), w.clamp(-2, 2), b.clamp(-3, 3), gy.clamp(-4, 4)
    x[0, 0, 0], w[0, 0], gy[0, 0, 0] = 1.0, 2.0, 4.0
    b[0] = 3.0
    expected = expected_quantities(x, w, b, meta, gy)
    factors = {
        q: float(e.factor_max) if e.factor_max is not None else None for q, e in expected.items()
    }
    assert factors == {"y": 3 + 2, "grad_x": 2 + 4, "grad_weight": 4 + 1, "grad_bias": None}
    x[0, 0, 1] = 5.0  # now x is the larger of x and the bias
    expected = expected_quantities(x, w, b, meta, gy)
    assert float(expected["y"].factor_max) == 5 + 2
    assert float(expected["grad_weight"].factor_max) == 4 + 5


@FLUSHES
@pytest.mark.parametrize("graph", ["cin_33", "cin_129"])
def test_general_on_subnormal_inputs_passes_by_the_flush_term_alone(graph):
    """``x`` scaled by ``2^-130`` (bfloat16 subnormals), general's results: the bfloat16 GEMM
    of ``grad_weight`` flushes, and without the flush term its error is about a hundred times
    the bound; with it every quantity passes."""
    g = spanning_graph(graph)
    x, w, b, gy = sample_operands(g.meta, g.out_channels, batch=3, seed=0, dtype=torch.bfloat16)
    x = (x.double() * 2.0**-130).to(torch.bfloat16)
    results = forward_and_grads(x, w, b, g.meta, gy, "general")[:3]  # y, grad_x, grad_weight
    got = dict(zip(("y", "grad_x", "grad_weight"), results, strict=True))
    expected = expected_quantities(x, w, b, g.meta, gy)
    for quantity, value in got.items():
        assert judge_elementwise(value, expected[quantity]).ok, quantity
    unflushed = dataclasses.replace(expected["grad_weight"], factor_max=None)
    assert judge_elementwise(got["grad_weight"], unflushed).ratio > 10


def test_a_float16_subnormal_lost_fails():
    """float16 keeps its subnormals: ``64 * 2^-20`` (a sum of subnormals, ``2^-14``) returned
    as 0 fails, where the same loss in bfloat16 terms (``64 * 2^-130``) passes."""
    for dtype, tiny in ((torch.float16, 2.0**-20), (torch.bfloat16, 2.0**-130)):
        one = torch.ones(1, 1, 1, dtype=torch.float64)
        zero = torch.zeros((), dtype=torch.float64)
        expected = Expected(
            "y",
            one * 64 * tiny,
            one * 64 * tiny,
            one * 64,
            zero,
            zero,
            zero,
            None,
            one * (1 + tiny),
        )
        verdict = judge_elementwise(torch.zeros(1, 1, 1, dtype=dtype), expected)
        assert verdict.ok == (dtype == torch.bfloat16), dtype


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_a_non_finite_operand_does_not_widen_the_flush_allowance(bad):
    """``A`` and ``B`` are the largest *finite* values: an inf or a nan in ``x`` (which the
    ``nonfinite`` check plants) leaves every other element's bfloat16 bound as it was without
    it. Where ``M = 0`` the flush term is most of the bound, so a changed ``A`` shows."""
    meta = spanning_graph("base").meta
    x, w, b, gy = sample_operands(meta, 2, batch=2, seed=0, dtype=torch.bfloat16)
    x, w = torch.zeros_like(x), w.clamp(-0.25, 0.25)
    planted = x.clone()
    planted[0, 0, 0] = bad
    clean = expected_quantities(x, w, None, meta, gy)
    dirty = expected_quantities(planted, w, None, meta, gy)
    for quantity in ("y", "grad_weight"):
        assert torch.equal(dirty[quantity].factor_max, clean[quantity].factor_max), quantity
    reads = (meta.knn == 0).any(dim=0)  # [Nout] nodes that read input 0
    kept = error_bound(dirty["y"], torch.bfloat16)[:, :, ~reads]
    assert torch.equal(kept, error_bound(clean["y"], torch.bfloat16)[:, :, ~reads])
