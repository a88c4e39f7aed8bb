"""The tolerance rule held to numbers it did not compute: a loosened bound fails here, and so
does a tightened one.

A planted error computed from ``error_bound()`` itself moves with a mutated bound and catches
nothing. So the bound of every element of a small graph is derived here a second time, from
the formula of :mod:`fovi_ref.check.tolerances` in exact rational arithmetic
(:class:`fractions.Fraction`) over plain loops of the operator's definition (no oracle, no
magnitude module), for every dtype and every quantity, with the cells a narrow path stores and
without; errors planted just inside and just outside that number pass and fail, and the failing
verdict names the element.

**Tightness.** A bound may also be too tight: it then fails a correct kernel on another machine
or in another summation order. :mod:`fovi_ref.check.tightness` builds the legal computations
that use as much of it as they can (16-bit sums rounded, and cells stored, just below a tie;
float32's one product at a tie; another summation order, ``N`` from 2 to 512); the tests below
hold every backend, wide and narrow, to pass each, each to use the share of the bound it
claims, and the README to the worst ratio per dtype they reach.
"""

from __future__ import annotations

import itertools
import math
import struct
from fractions import Fraction

import pytest
import torch
from conftest import ForeignOps

from fovi_ref import KNNMeta, dtype_name
from fovi_ref.check import tightness
from fovi_ref.check.check_ops import _first_offender, _unread_inputs
from fovi_ref.check.tolerances import (
    QUANTITIES,
    Expected,
    accumulated_error,
    error_bound,
    expected_quantities,
    gamma,
    judge_elementwise,
    vacuous_stores,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# Step 0's constants, written out again: unit roundoff and eta (half the smallest subnormal;
# float64's smallest subnormal itself) as exact rationals.
U = {
    torch.float64: Fraction(1, 2**53),
    torch.float32: Fraction(1, 2**24),
    torch.float16: Fraction(1, 2**11),
    torch.bfloat16: Fraction(1, 2**8),
}
ETA = {
    torch.float64: Fraction(1, 2**1074),
    torch.float32: Fraction(1, 2**150),
    torch.float16: Fraction(1, 2**25),
    torch.bfloat16: Fraction(1, 2**134),
}
SIXTEEN = (torch.float16, torch.bfloat16)

# The small graph: Nin = 4, Nout = 3, K = 3, V = 2; input 4 is padding.
# node 0 reads inputs 0, 1 (cell 0, shared) and 2 (cell 1); node 1 reads 1, 3 (cell 1, shared);
# node 2 reads input 2 alone (cell 0). Fan-out: input 0 once, 1 twice, 2 twice, 3 once.
KNN = [[0, 1, 2], [1, 3, 4], [2, 4, 4]]  # [K, Nout]
RF = [[0, 0, 1], [1, 1, 0], [0, 1, 1]]  # [Nout, K]
N_IN, V, CIN, COUT, B = 4, 2, 2, 2, 2


def small_meta() -> KNNMeta:
    return KNNMeta.from_knn(torch.tensor(KNN), torch.tensor(RF), n_in=N_IN, in_channels=CIN, v=V)


def filled(shape: tuple[int, ...], entry) -> torch.Tensor:
    """A float64 tensor of ``shape`` whose element at ``index`` is ``entry(*index)``."""
    values = [entry(*index) for index in itertools.product(*map(range, shape))]
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


def small_operands(dtype: torch.dtype, zero_x: bool = False):
    """Quarter-integers in [-1, 1] (exact in every dtype), signs mixed so that sums cancel."""
    x = filled((B, CIN, N_IN), lambda b, c, i: ((3 * b + 5 * c + 7 * i) % 9 - 4) / 4)
    w = filled((COUT, CIN * V), lambda o, j: ((2 * o + 3 * j) % 7 - 3) / 4)
    bias = torch.tensor([0.75, -0.5], dtype=torch.float64)
    gy = filled((B, COUT, 3), lambda b, o, n: ((b + 2 * o + 5 * n) % 5 - 2) / 2)
    if zero_x:
        x = torch.zeros_like(x)
    return [t.to(dtype) for t in (x, w, bias, gy)]


# ------------------------------------------------------------ the bound, derived a second time
def real_neighbours(n: int):
    """``(k, input, cell)`` of node ``n``'s real neighbours."""
    return [(k, KNN[k][n], RF[n][k]) for k in range(len(KNN)) if KNN[k][n] < N_IN]


def shared(n: int, v: int) -> bool:
    """Whether cell ``v`` of node ``n`` holds two or more real neighbours (a narrow path stores
    it; one alone is copied exactly)."""
    return sum(cell == v for _, _, cell in real_neighbours(n)) >= 2


def exact_sizes(x, w, bias, gy, separate: bool = False) -> dict[str, dict]:
    """Per quantity, ``{index: (ref, M, N, M_s, h, P, A + B)}`` as Fractions, straight from the
    operator's definition and the rule's list of stores (tolerances step 2 (c)-(e)); ``A + B``:
    the largest ``|value|`` of each of the two operands the quantity multiplies (step 2 (f))."""
    f = [[[Fraction(float(v)) for v in row] for row in mat] for mat in x.double().tolist()]
    wf = [[Fraction(float(v)) for v in row] for row in w.double().tolist()]
    bf = [Fraction(float(v)) for v in bias.double().tolist()]
    gf = [[[Fraction(float(v)) for v in row] for row in mat] for mat in gy.double().tolist()]
    x_max = max(abs(v) for mat in f for row in mat for v in row)
    w_max = max(abs(v) for row in wf for v in row)
    g_max = max(abs(v) for mat in gf for row in mat for v in row)
    factors = {
        "y": max(x_max, *map(abs, bf)) + w_max,  # the bias is added by y's GEMM
        "grad_x": w_max + g_max,
        "grad_weight": g_max + x_max,
    }
    z = {
        (b, c, v, n): sum(
            (f[b][c][i] for _, i, cell in real_neighbours(n) if cell == v), Fraction(0)
        )
        for b in range(B)
        for c in range(CIN)
        for v in range(V)
        for n in range(3)
    }
    fan_out = [sum(i == j for n in range(3) for _, j, _ in real_neighbours(n)) for i in range(N_IN)]
    out = {q: {} for q in QUANTITIES}
    for b in range(B):
        for o in range(COUT):
            for n in range(3):
                terms = [bf[o]] + [
                    f[b][c][i] * wf[o][c * V + v]
                    for c in range(CIN)
                    for _, i, v in real_neighbours(n)
                ]
                m = sum(abs(t) for t in terms)
                m_s = sum(
                    abs(wf[o][c * V + v]) * abs(z[b, c, v, n])
                    for c in range(CIN)
                    for v in range(V)
                    if shared(n, v)
                )
                h, p = 1, 0
                if separate:  # (d): W x stored before the bias is added
                    m_s, h, p = m - abs(bf[o]), 1 + (m_s > 0), 1
                out["y"][b, o, n] = (sum(terms), m, len(terms), m_s, h, p, factors["y"])
        for c in range(CIN):
            for i in range(N_IN):
                terms = [
                    gf[b][o][n] * wf[o][c * V + v]
                    for o in range(COUT)
                    for n in range(3)
                    for _, j, v in real_neighbours(n)
                    if j == i
                ]
                m = sum(abs(t) for t in terms)
                out["grad_x"][b, c, i] = (
                    sum(terms),
                    m,
                    len(terms),
                    m,
                    fan_out[i],
                    fan_out[i],
                    factors["grad_x"],
                )
    for o in range(COUT):
        for c in range(CIN):
            for v in range(V):
                terms = [
                    gf[b][o][n] * f[b][c][i]
                    for b in range(B)
                    for n in range(3)
                    for _, i, cell in real_neighbours(n)
                    if cell == v
                ]
                m_s = sum(
                    abs(gf[b][o][n]) * abs(z[b, c, v, n])
                    for b in range(B)
                    for n in range(3)
                    if shared(n, v)
                )
                m = sum(abs(t) for t in terms)
                out["grad_weight"][o, c * V + v] = (
                    sum(terms),
                    m,
                    len(terms),
                    m_s,
                    1,
                    0,
                    factors["grad_weight"],
                )
        terms = [gf[b][o][n] for b in range(B) for n in range(3)]
        m = sum(abs(t) for t in terms)
        out["grad_bias"][(o,)] = (sum(terms), m, len(terms), 0, 0, 0, None)  # a sum: no GEMM
    return out


def exact_gamma(n: int, u: Fraction) -> Fraction:
    return n * u / (1 - n * u)


def exact_bound(sizes: tuple, dtype: torch.dtype) -> Fraction:
    """The rule's bound of one element, in exact arithmetic::

        one precision:  gamma_N(u) M + N eta
        16-bit:         u |ref| + eta (1 + P)
                        + (1 + u) [gamma_h(u) M_s + (1 + gamma_h(u)) gamma_N(u32) M + N eta32
                                   + flush]

    each plus the oracle's own ``gamma_N(u64) M + N eta64``; ``h = 1`` where ``h > 1`` stores
    would allow ``gamma_h(u) M_s >= M``; in bfloat16 (not for ``grad_bias``, a sum and no GEMM)
    plus the flush to zero, ``tau N (A + B + 5 + tau)`` with ``tau = 2^-126``."""
    ref, m, n, m_s, h, p, factors = sizes
    u, eta = U[dtype], ETA[dtype]
    oracle = exact_gamma(n, U[torch.float64]) * m + n * ETA[torch.float64]
    if dtype not in SIXTEEN:
        return exact_gamma(n, u) * m + n * eta + oracle
    if h > 1 and exact_gamma(h, u) * m_s >= m:
        h = 1
    g_h = exact_gamma(h, u)
    u32, eta32 = U[torch.float32], ETA[torch.float32]
    inner = g_h * m_s + (1 + g_h) * exact_gamma(n, u32) * m + n * eta32
    if dtype == torch.bfloat16 and factors is not None:
        tau = Fraction(1, 2**126)
        inner += tau * n * (factors + 5 + tau)
    return u * abs(ref) + eta * (1 + p) + (1 + u) * inner + oracle


def close(got: float, want: Fraction) -> bool:
    """``got`` (a float64 evaluation of a handful of operations) within ``2^-45`` of ``want``,
    relatively: loose for rounding, tight for any changed factor, term or constant."""
    return abs(Fraction(got) - want) <= abs(want) / 2**45


# --------------------------------------------------------------------------------- gamma
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_gamma_is_n_u_over_one_minus_n_u(dtype):
    u = U[dtype]
    for n in (0, 1, 2, 3, 7, 100):
        assert close(float(gamma(n, float(u))), exact_gamma(n, u)), n
    counts = torch.tensor([[1.0, 5.0], [0.0, 64.0]])  # elementwise, float64 out
    got = gamma(counts, float(u))
    assert got.dtype == torch.float64 and got.shape == (2, 2)
    for n, value in zip(counts.flatten().tolist(), got.flatten().tolist(), strict=True):
        assert close(value, exact_gamma(int(n), u))


def test_gamma_by_hand_at_its_edge():
    """``gamma_n(u)`` reaches 1 at ``n u = 1/2`` and is infinite from ``n u = 1`` on."""
    assert float(gamma(1, 2.0**-24)) == 2.0**-24 / (1 - 2.0**-24)
    assert float(gamma(128, 2.0**-8)) == 1.0
    assert float(gamma(1024, 2.0**-11)) == 1.0
    assert float(gamma(255, 2.0**-8)) == 255.0  # (255/256) / (1/256)
    assert float(gamma(2047, 2.0**-11)) == 2047.0
    for n, u in ((256, 2.0**-8), (257, 2.0**-8), (2048, 2.0**-11), (2**24, 2.0**-24)):
        assert math.isinf(float(gamma(n, u))), n


# ------------------------------------------------------------------------ the bound itself
@pytest.mark.parametrize("separate", [False, True], ids=["fused", "separate"])
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_error_bound_is_the_formula_in_exact_arithmetic(dtype, separate):
    """Every element of every quantity, with shared cells (what narrow stores) and without."""
    meta = small_meta()
    x, w, bias, gy = small_operands(dtype)
    rounding = "separate" if separate else "fused"
    expected = expected_quantities(x, w, bias, meta, gy, bias_rounding=rounding)
    sizes = exact_sizes(x, w, bias, gy, separate=separate)
    assert set(expected) == set(QUANTITIES)
    for quantity in QUANTITIES:
        sizes_of = expected[quantity]
        fields = (sizes_of.value, sizes_of.magnitude, sizes_of.terms, sizes_of.stored)
        assert all(t.dtype == torch.float64 for t in (*fields, sizes_of.stores))
        assert sizes_of.product_stores.dtype == torch.float64, quantity
        bound = error_bound(expected[quantity], dtype).expand_as(expected[quantity].value)
        assert bound.dtype == torch.float64
        assert len(sizes[quantity]) == bound.numel()
        for index, element in sizes[quantity].items():
            assert close(float(bound[index]), exact_bound(element, dtype)), (quantity, index)
            assert close(float(expected[quantity].value[index]), element[0]), (quantity, index)


def test_the_small_graph_has_both_kinds_of_cell():
    """The graph above tests narrow's allowance and its absence: some elements of ``y`` and
    ``grad_weight`` have shared cells (``M_s > 0``) and some have none, and ``grad_x`` has
    inputs read once and twice."""
    sizes = exact_sizes(*small_operands(torch.float32))
    for quantity in ("y", "grad_weight"):
        stored = [element[3] for element in sizes[quantity].values()]
        assert any(s > 0 for s in stored) and any(s == 0 for s in stored), quantity
    assert {element[4] for element in sizes["grad_x"].values()} == {1, 2}


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_the_bound_where_every_term_is_zero_is_the_underflow_allowance(dtype):
    """``x = 0``: ``y`` and ``grad_weight`` have ``M = 0``, and only eta's terms are left."""
    meta = small_meta()
    x, w, bias, gy = small_operands(dtype, zero_x=True)
    bias = torch.zeros_like(bias)
    expected = expected_quantities(x, w, bias, meta, gy)
    sizes = exact_sizes(x, w, bias, gy)
    for quantity in ("y", "grad_weight"):
        bound = error_bound(expected[quantity], dtype).expand_as(expected[quantity].value)
        for index, element in sizes[quantity].items():
            assert element[1] == 0
            assert close(float(bound[index]), exact_bound(element, dtype)), (quantity, index)


# ------------------------------------------------------- planted errors, just inside and out
def planted(expected, index: tuple, error: Fraction) -> torch.Tensor:
    """The oracle's float64 values with ``error`` added at ``index`` (rounded to float64)."""
    value = expected.value.clone()
    value[index] = float(Fraction(float(value[index])) + error)
    return value


def plant_site(sizes: dict, dtype: torch.dtype):
    """Where to plant: an element with ``M > 0``, one whose ``ref`` is 0 in float64 (whose
    bound, about ``2^-50 M``, is finer than the spacing of float64 numbers near a nonzero
    ``ref``: there a planted error is exact), else the element of the largest ``M``."""
    candidates = [(i, e) for i, e in sizes.items() if e[1] > 0]
    if dtype == torch.float64:
        candidates = [(i, e) for i, e in candidates if e[0] == 0]
    return max(candidates, key=lambda item: item[1][1], default=(None, None))


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_errors_just_inside_the_derived_bound_pass_and_just_outside_fail(dtype):
    """Each quantity: ``(1 - 2^-20)`` of the exact bound passes, ``(1 + 2^-20)`` fails, on
    either side of ``ref``, and the failing verdict names the element. (float64's grad_x and
    grad_bias have no element with ``ref = 0`` here: their bound is held by the exact
    comparison above.)"""
    meta = small_meta()
    x, w, bias, gy = small_operands(dtype)
    expected = expected_quantities(x, w, bias, meta, gy)
    sizes = exact_sizes(x, w, bias, gy)
    planted_in = 0
    for quantity in QUANTITIES:
        index, element = plant_site(sizes[quantity], dtype)
        if index is None:
            assert dtype == torch.float64 and quantity in ("grad_x", "grad_bias")
            continue
        bound = exact_bound(element, dtype)
        for sign in (1, -1):
            inside = planted(expected[quantity], index, sign * bound * (1 - Fraction(1, 2**20)))
            outside = planted(expected[quantity], index, sign * bound * (1 + Fraction(1, 2**20)))
            passed = judge_elementwise(inside, expected[quantity], dtype=dtype, any_dtype=True)
            failed = judge_elementwise(outside, expected[quantity], dtype=dtype, any_dtype=True)
            assert passed.ok and 1 - 2**-19 < passed.ratio <= 1, (quantity, sign, passed)
            assert not failed.ok and 1 < failed.ratio < 1 + 2**-19, (quantity, sign, failed)
            assert failed.worst_index == index, (quantity, failed)
            assert f"at {list(index)}" in str(failed) and str(failed).startswith("FAIL")
            assert failed.worst_error == pytest.approx(float(bound), rel=2**-18)
            assert failed.worst_bound == pytest.approx(float(bound), rel=2**-40)
            planted_in += 1
    assert planted_in == (4 if dtype == torch.float64 else 8)


def test_an_error_exactly_at_the_bound_passes():
    """``error <= bound`` passes with equality: an element of ``y`` with ``ref = 0`` moved by
    exactly its bound (the library's own, the one comparison here that needs it)."""
    meta = small_meta()
    x, w, bias, gy = small_operands(torch.float32)
    expected = expected_quantities(x, w, bias, meta, gy)["y"]
    index = (0, 0, 2)  # ref 0, M = 3/2
    assert float(expected.value[index]) == 0.0
    value = expected.value.clone()
    value[index] = error_bound(expected, torch.float32).expand_as(value)[index]
    verdict = judge_elementwise(value, expected, dtype=torch.float32, any_dtype=True)
    assert verdict.ok and verdict.ratio == 1.0 and verdict.worst_index == index


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_an_element_with_no_term(dtype):
    """An all-padding node without a bias has no term (``N = 0``, ``ref = 0``). In float32 and
    float64 its bound is 0: one off by the smallest subnormal fails with an infinite ratio and
    is named, exact it passes with ratio 0. In 16 bits the output's store may still underflow:
    its bound is ``eta``."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0, 2]]), torch.zeros(2, 1, dtype=torch.int64), n_in=2, in_channels=1, v=1
    )
    x = torch.tensor([[[1.0, 0.5]]], dtype=dtype)
    w = torch.ones(1, 1, dtype=dtype)
    expected = expected_quantities(x, w, None, meta, torch.ones(1, 1, 2, dtype=dtype))["y"]
    bound = error_bound(expected, dtype).expand_as(expected.value)
    exact = judge_elementwise(expected.value.clone(), expected, dtype=dtype, any_dtype=True)
    assert exact.ok and exact.ratio == 0.0
    if dtype in SIXTEEN:
        assert float(bound[0, 0, 1]) == float(ETA[dtype])
        return
    assert float(bound[0, 0, 1]) == 0.0
    value = expected.value.clone()
    value[0, 0, 1] = 2.0**-1074
    verdict = judge_elementwise(value, expected, dtype=dtype, any_dtype=True)
    assert not verdict.ok and math.isinf(verdict.ratio) and verdict.worst_index == (0, 0, 1)


# -------------------------------------------------- tightness: legal computations must pass
def passing(rows: list[tightness.Legal]) -> dict[str, float]:
    """``{"dtype computed-by": ratio}`` of ``rows``, each of which must pass."""
    assert rows and all(r.ok for r in rows), rows
    ratios = {f"{r.dtype} {r.by}": r.ratio for r in rows}
    assert len(ratios) == len(rows), rows  # one row per dtype and computation
    return ratios


@pytest.mark.parametrize("dtype", SIXTEEN, ids=str)
def test_16_bit_results_rounded_just_below_a_tie_use_the_whole_bound(dtype):
    """``1 + t`` rounded once (:func:`~fovi_ref.check.tightness.tie_rounding`): every backend
    on either path uses ``0.98`` of the bound. A rule without ``u |ref|``, or with ``u`` of a
    shorter dtype, fails them."""
    ratios = passing(tightness.tie_rounding(dtype))
    assert len(ratios) == 4 and min(ratios.values()) > 0.98, ratios


@pytest.mark.parametrize("dtype", SIXTEEN, ids=str)
def test_16_bit_narrow_cells_stored_just_below_a_tie_use_the_whole_bound(dtype):
    """A cell stored just below a tie, then the sum rounded
    (:func:`~fovi_ref.check.tightness.stored_cell_tie`): narrow uses ``0.98`` of the bound, and
    a rule without the allowance for a stored cell fails it."""
    ratios = passing(tightness.stored_cell_tie(dtype))
    name = dtype_name(dtype)
    narrow = [ratios[f"{name} general narrow"], ratios[f"{name} einsum_baseline narrow"]]
    assert min(narrow) > 0.98, ratios


def test_16_bit_cells_with_large_partial_sums_pass():
    """``A + s - A`` in one cell (:func:`~fovi_ref.check.tightness.large_partial_sums`): a rule
    that pays for the partial sums with ``u |z|`` alone fails it."""
    assert len(passing(tightness.large_partial_sums())) == 8  # 2 dtypes, 2 backends, 2 paths


def test_float32_one_product_rounded_at_a_tie_uses_the_whole_bound():
    """``N = 1`` at a tie (:func:`~fovi_ref.check.tightness.float32_product_tie`): ``0.9995``
    of the bound, float32's worst case where ``N`` is small; a rule with ``gamma_{N-1}`` or
    ``u / 2`` fails it."""
    ratios = passing(tightness.float32_product_tie())
    assert len(ratios) == 3 and min(ratios.values()) > 0.999, ratios


ELEMENTWISE = "w (x_0 + ... + x_N-1)"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_another_summation_order_passes(dtype):
    """``w (x_0 + x_1)`` against the oracle's ``w x_0 + w x_1``
    (:func:`~fovi_ref.check.tightness.summation_order`, ``N = 2``): the worst of the seeded
    search uses more than half the bound, the oracle's own ``gamma_N(u64) M`` included. A
    float64 rule without the oracle's term fails it; the backends pass it."""
    ratios = passing(tightness.summation_order(dtype, 2))
    assert ratios[f"{dtype_name(dtype)} {ELEMENTWISE}"] > 0.5, ratios


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_long_sums_in_another_order_use_a_falling_share_of_the_bound(dtype):
    """The module's claim that float32 and float64 get near their bound only for a few terms:
    the worst ratio of the search falls at every step of ``N`` (2, 8, 64, 512), to below 0.01
    at 512, and every backend passes the worst draw."""
    key = f"{dtype_name(dtype)} {ELEMENTWISE}"
    worst = [passing(tightness.summation_order(dtype, n))[key] for n in tightness.ORDER_TERMS]
    falls = all(more > less for more, less in itertools.pairwise(worst))
    assert falls and worst[-1] < 0.01, worst


# ------------------------------------------------------------- where h stores are vacuous
@pytest.mark.parametrize("dtype,edge", [(torch.bfloat16, 128), (torch.float16, 1024)], ids=str)
def test_grad_x_of_a_hub_at_the_edge_of_vacuous_stores(dtype, edge):
    """One input read by ``F`` nodes: ``gamma_F(u) M >= M`` from ``F u = 1/2`` on, exactly
    ``F = edge``. Below it the bound allows ``F`` stores, from it on one; both by hand."""
    for readers in (edge - 1, edge):
        meta = KNNMeta.from_knn(
            torch.zeros(1, readers, dtype=torch.int64),
            torch.zeros(readers, 1, dtype=torch.int64),
            n_in=1,
            in_channels=1,
            v=1,
        )
        x = torch.ones(1, 1, 1, dtype=dtype)
        w = torch.full((1, 1), 0.5, dtype=dtype)
        gy = torch.ones(1, 1, readers, dtype=dtype)
        expected = expected_quantities(x, w, None, meta, gy)["grad_x"]
        m = Fraction(readers, 2)
        # ref = M_s = M, h = P = F; A + B = max |w| + max |grad_y| = 1/2 + 1
        sizes = (m, m, readers, m, readers, readers, Fraction(3, 2))
        assert bool(vacuous_stores(expected, dtype).all()) == (readers == edge)
        one_precision = vacuous_stores(expected, torch.float32)
        assert one_precision.dtype == torch.bool and not one_precision.any()
        assert close(float(error_bound(expected, dtype)), exact_bound(sizes, dtype)), readers
        if readers == edge:  # h = 1: a bound far below M, and a zeroed gradient fails
            assert float(error_bound(expected, dtype)) < float(m) / 64
            verdict = judge_elementwise(torch.zeros(1, 1, 1, dtype=dtype), expected)  # error M
            assert not verdict.ok
            assert verdict.notes == ("1 elements judged with h = 1 (the h-store bound reaches M)",)


# --------------------------------------------------------------- what a verdict reports
def test_the_first_offender_is_named_by_its_full_index():
    """check_ops' exact checks name the first offending element, the last axis mapped back to
    the node or input it stands for."""
    bad = torch.zeros(2, 3, 4, dtype=torch.bool)
    bad[1, 2, 3] = True
    bad[1, 0, 2] = True  # first in row-major order
    assert _first_offender(bad, torch.tensor([5, 7, 9, 11])) == (1, 0, 9)
    only = torch.zeros(1, 1, 2, dtype=torch.bool)
    only[0, 0, 0] = True
    assert _first_offender(only, torch.tensor([3, 4])) == (0, 0, 3)


def test_a_verdict_of_the_wrong_shape_fails_and_says_so():
    meta = small_meta()
    x, w, bias, gy = small_operands(torch.float32)
    expected = expected_quantities(x, w, bias, meta, gy)["y"]
    verdict = judge_elementwise(torch.zeros(2, 2, 2), expected)
    assert verdict.ok is False and math.isinf(verdict.ratio) and verdict.worst_index is None
    assert verdict.notes == ("shape (2, 2, 2), expected (2, 2, 3)",)
    assert math.isinf(verdict.max_abs_error) and math.isinf(verdict.worst_error)
    figures = (verdict.worst_bound, verdict.worst_ref, verdict.worst_magnitude)
    assert figures == (0.0, 0.0, 0.0) and verdict.nonfinite_mismatches == 0
    assert verdict.worst_value is None and verdict.quantity == "y"
    assert verdict.dtype == torch.float32


def test_a_verdict_names_the_worst_element_and_its_figures():
    """Two planted errors: the verdict names the larger ratio's element with its error, bound,
    ref, magnitude and value; the baseline's figures are reported beside it."""
    meta = small_meta()
    x, w, bias, gy = small_operands(torch.bfloat16)
    expected = expected_quantities(x, w, bias, meta, gy)["grad_weight"]
    sizes = exact_sizes(x, w, bias, gy)["grad_weight"]
    value = expected.value.clone()
    value[0, 1] += float(exact_bound(sizes[0, 1], torch.bfloat16)) * 0.5
    value[1, 2] -= float(exact_bound(sizes[1, 2], torch.bfloat16)) * 3
    baseline = expected.value.clone()
    baseline[0, 0] += float(exact_bound(sizes[0, 0], torch.bfloat16)) * 0.25
    verdict = judge_elementwise(
        value, expected, dtype=torch.bfloat16, any_dtype=True, baseline=baseline
    )
    ref, m = sizes[1, 2][:2]
    assert not verdict.ok and verdict.worst_index == (1, 2)
    assert verdict.ratio == pytest.approx(3, rel=1e-9)
    assert verdict.worst_ref == float(ref) and verdict.worst_magnitude == float(m)
    assert verdict.worst_value == float(value[1, 2])
    assert verdict.worst_bound == pytest.approx(float(exact_bound(sizes[1, 2], torch.bfloat16)))
    assert verdict.worst_error == pytest.approx(3 * verdict.worst_bound)
    assert verdict.max_abs_error == pytest.approx(verdict.worst_error)
    assert verdict.baseline_ratio == pytest.approx(0.25, rel=1e-9)
    assert verdict.baseline_max_abs_error == pytest.approx(
        float(exact_bound(sizes[0, 0], torch.bfloat16)) * 0.25
    )
    assert verdict.quantity == "grad_weight" and verdict.dtype == torch.bfloat16
    assert verdict.nonfinite_mismatches == 0 and verdict.notes == ("returned float64",)
    exact = judge_elementwise(expected.value.to(torch.bfloat16), expected)
    assert exact.ok and exact.ratio == 0.0 and exact.max_abs_error == 0.0
    assert exact.worst_index == tuple(
        int(i) for i in torch.unravel_index(error_bound(expected, torch.bfloat16).argmax(), (2, 4))
    )  # nothing off: the element of the largest bound


def test_a_nonfinite_mismatch_is_named_where_every_ratio_passes():
    meta = small_meta()
    x, w, bias, gy = small_operands(torch.float32)
    expected = expected_quantities(x, w, bias, meta, gy)["y"]
    value = expected.value.clone()
    value[1, 0, 1] = math.nan
    value[1, 1, 2] = math.inf
    verdict = judge_elementwise(value, expected, dtype=torch.float32, any_dtype=True)
    assert not verdict.ok and verdict.nonfinite_mismatches == 2
    assert verdict.worst_index == (1, 0, 1) and verdict.ratio == 0.0
    assert "2 non-finite mismatches" in str(verdict)
    at_bound = (0, 0, 2)  # ref 0: moved by exactly its bound, ratio 1, still a pass
    value[at_bound] = error_bound(expected, torch.float32).expand_as(value)[at_bound]
    verdict = judge_elementwise(value, expected, dtype=torch.float32, any_dtype=True)
    assert verdict.ratio == 1.0 and verdict.worst_index == (1, 0, 1)  # the mismatch is named
    value[at_bound] *= 1.5  # now a ratio fails too: the verdict names the worst ratio
    verdict = judge_elementwise(value, expected, dtype=torch.float32, any_dtype=True)
    assert verdict.ratio == 1.5 and verdict.worst_index == at_bound
    wrong_shape = judge_elementwise(
        value, expected, dtype=torch.float32, any_dtype=True, baseline=value[:1]
    )
    assert wrong_shape.baseline_ratio is None and wrong_shape.baseline_max_abs_error is None


def test_an_empty_quantity_passes_with_nothing_to_name():
    meta = small_meta()
    x, w, bias, gy = small_operands(torch.float32)
    x, gy = x[:0], gy[:0]  # batch 0
    expected = expected_quantities(x, w, bias, meta, gy)["y"]
    verdict = judge_elementwise(expected.value.float(), expected, baseline=expected.value.float())
    assert verdict.ok and verdict.worst_index is None and verdict.ratio == 0.0
    figures = (verdict.worst_error, verdict.worst_bound, verdict.worst_ref, verdict.worst_magnitude)
    assert figures == (0.0, 0.0, 0.0, 0.0) and verdict.max_abs_error == 0.0
    assert (verdict.baseline_ratio, verdict.baseline_max_abs_error) == (0.0, 0.0)
    assert verdict.worst_value is None


# ---------------------------------------------------- check_ops' exact padding comparisons
class GradientToUnread(ForeignOps):
    """Sends a gradient of 2^-30 to the inputs no neighbour reads."""

    name = "gradient_to_unread"

    @staticmethod
    def grad_input(meta, grad_y, weight):
        grad_x = ForeignOps.grad_input(meta, grad_y, weight).clone()
        unread = torch.ones(meta.n_in, dtype=torch.bool)
        unread[meta.knn[~meta.pad_mask]] = False
        grad_x[:, :, unread] += 2.0**-30
        return grad_x


class BiasOffAtEmptyNodes(ForeignOps):
    """Outputs of all-padding nodes one part in 2^20 off their bias."""

    name = "bias_off_at_empty_nodes"

    @staticmethod
    def forward(meta, x, weight, bias):
        y = ForeignOps.forward(meta, x, weight, bias)
        return torch.where(meta.pad_mask.all(dim=0), y * (1 + 2.0**-20), y)


def padding_rows(ops, knn: list[list[int]], n_in: int, check: str = "padding"):
    """check_ops' ``padding`` rows (or ``check``'s) for ``ops`` on a one-cell graph, in
    float32."""
    from fovi_ref.check.check_ops import check_ops
    from fovi_ref.check.graphs import TestGraph

    knn = torch.tensor(knn)  # [K, Nout]
    meta = KNNMeta.from_knn(
        knn,
        torch.zeros(knn.shape[1], knn.shape[0], dtype=torch.int64),
        n_in=n_in,
        in_channels=2,
        v=1,
    )
    graph = TestGraph("padding_case", meta, 2)
    report = check_ops(ops, graphs=[graph], dtypes=[torch.float32], checks=[check])
    return report.rows


def test_the_padding_check_runs_where_an_input_is_unread_and_no_node_is_empty():
    """Input 2 is read by nobody, every node reads something: a gradient sent to input 2, far
    within any bound, fails by the exact rule and names the element; ``general`` passes."""
    knn = [[0, 1]]  # node 0 reads input 0, node 1 input 1; input 2 unread
    assert all(r.ok and r.note != "nothing to test" for r in padding_rows("general", knn, 3))
    failed = [r for r in padding_rows(GradientToUnread, knn, 3) if not r.ok]
    assert [(r.check, r.quantity) for r in failed] == [("padding", "grad_x")]
    assert failed[0].ok is False and failed[0].index == (0, 0, 2)
    assert math.isinf(failed[0].ratio) and failed[0].bound == 0
    assert failed[0].value == 2.0**-30 and failed[0].oracle == 0.0
    assert failed[0].note.startswith("unread inputs get a gradient")


class DoubledAndNanToUnread(ForeignOps):
    """Two faults in one ``grad_x``: every read input's gradient doubled, and nan at the
    inputs no neighbour reads (an unwritten buffer)."""

    name = "doubled_and_nan_to_unread"

    @staticmethod
    def grad_input(meta, grad_y, weight):
        grad_x = 2 * ForeignOps.grad_input(meta, grad_y, weight)
        grad_x[:, :, _unread_inputs(meta)] = math.nan
        return grad_x


def test_a_padding_failure_points_at_its_own_element_and_keeps_the_judges_note():
    """The judge's worst element is a doubled read input (its worst ratio; the nan at input 2
    it counts as non-finite mismatches, 6: check_ops' batch of 3, 2 channels). The exact rule's
    row points at input 2 instead, says what the graph makes of it, and puts its own words
    before the judge's note."""
    knn = [[0, 1]]  # node 0 reads input 0, node 1 input 1; input 2 unread
    judged = padding_rows(DoubledAndNanToUnread, knn, 3, check="oracle")
    (judges,) = [r for r in judged if r.quantity == "grad_x"]
    assert judges.index[2] in (0, 1)  # the judge's own worst element is a read input
    (failed,) = [r for r in padding_rows(DoubledAndNanToUnread, knn, 3) if not r.ok]
    assert (failed.quantity, failed.index) == ("grad_x", (0, 0, 2))
    assert failed.where == "input 2 of 3, read by 0 entries"
    assert failed.note == "unread inputs get a gradient; 6 non-finite mismatches"
    assert math.isnan(failed.value) and failed.oracle == 0.0


def test_the_padding_check_runs_where_a_node_is_empty_and_every_input_is_read():
    """Node 2 reads only padding, inputs 0 and 1 are read: its output must be exactly the
    bias; one part in 2^20 off fails by the exact rule and names the element."""
    knn = [[0, 1, 2]]  # input 2 is padding here (n_in = 2): node 2 is all padding
    assert all(r.ok and r.note != "nothing to test" for r in padding_rows("general", knn, 2))
    failed = [r for r in padding_rows(BiasOffAtEmptyNodes, knn, 2) if not r.ok]
    assert [(r.check, r.quantity) for r in failed] == [("padding", "y")]
    assert failed[0].index == (0, 0, 2) and math.isinf(failed[0].ratio) and failed[0].bound == 0
    assert failed[0].value != failed[0].oracle
    assert failed[0].note.startswith("all-padding outputs are not exactly the bias")


def test_the_padding_check_has_nothing_to_test_where_nothing_is_padding():
    (row,) = padding_rows(GradientToUnread, [[0, 1]], 2)
    assert (row.check, row.ok, row.note) == ("padding", True, "nothing to test")


class RaisesInForward(ForeignOps):
    name = "raises_in_forward"

    @staticmethod
    def forward(meta, x, weight, bias):
        raise RuntimeError("no forward")


def test_a_backend_that_raises_in_the_padding_check_fails_one_row_that_says_so():
    (row,) = padding_rows(RaisesInForward, [[0, 1]], 3)
    assert (row.check, row.quantity, row.ok) == ("padding", "all", False)
    assert row.note == "raised RuntimeError: no forward"


FLOAT32_OVERFLOW = (2 - 2.0**-23) * 2.0**127 + 2.0**103  # largest finite + half its ulp
FLOAT16_OVERFLOW = 65504.0 + 16  # largest finite + half its ulp (32)


def one_y(ref: float, magnitude: float, stored: float = 0.0, stores: float = 0.0) -> Expected:
    """One element of ``y``: the oracle's ``ref``, two terms of magnitude ``M``, and ``M_s``
    stored ``h`` times (none by default)."""
    one = torch.ones(1, 1, 1, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    return Expected("y", one * ref, one * magnitude, one * 2, one * stored, one * stores, zero)


def _judged(value: float, dtype: torch.dtype, expected: Expected) -> bool:
    """Whether ``value`` (an inf or a nan) passes for the one element of ``expected``."""
    return judge_elementwise(torch.full((1, 1, 1), value, dtype=dtype), expected).ok


def _inf_judged(dtype: torch.dtype, ref: float, magnitude: float) -> bool:
    """Whether an inf passes where the oracle says ``ref`` with terms of magnitude ``M``."""
    return _judged(math.inf, dtype, one_y(ref, magnitude))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_any_non_finite_value_is_allowed_where_the_magnitude_reaches_the_accumulators_overflow(
    dtype, bad
):
    """A finite ``ref`` may come back inf of either sign, or nan (two partial sums overflowed
    with opposite signs), where ``M`` reaches the largest float32 plus half its ulp (the
    accumulator both dtypes sum in: from there a partial sum may round to inf); by hand, and a
    float64 step below, where no value but the result's own rounding may be non-finite."""
    assert _judged(bad, dtype, one_y(1.0, FLOAT32_OVERFLOW))
    assert not _judged(bad, dtype, one_y(1.0, math.nextafter(FLOAT32_OVERFLOW, 0)))


@pytest.mark.parametrize(
    "dtype,threshold",
    [
        (torch.float16, FLOAT16_OVERFLOW),
        (torch.bfloat16, (2 - 2.0**-7) * 2.0**127 + 2.0**119),
    ],
    ids=str,
)
def test_a_16_bit_inf_is_allowed_where_the_result_rounds_past_its_range_only(dtype, threshold):
    """In 16 bits a large ``M`` alone allows no inf: a stored value past the range is no
    rounding. The result itself may round to inf once ``|ref|`` plus the error of its sum
    reaches the dtype's largest finite value plus half its ulp; ``ref`` at that threshold
    passes, and ``ref = 1`` with ``M`` there fails. The inf must be on ``ref``'s side, and a
    rounding never gives nan."""
    assert _inf_judged(dtype, threshold, threshold)
    assert not _inf_judged(dtype, 1.0, threshold)
    assert _judged(-math.inf, dtype, one_y(-threshold, threshold))
    assert not _judged(-math.inf, dtype, one_y(threshold, threshold))
    assert not _judged(math.inf, dtype, one_y(-threshold, threshold))
    assert not _judged(math.nan, dtype, one_y(threshold, threshold))


def test_the_overflow_door_is_the_accumulated_error_by_hand():
    """``r``, the error of the sum rounded last (:func:`accumulated_error`), is the float32
    accumulation's and the oracle's, ``gamma_N(u32) M + N eta32 + gamma_N(u64) M + N eta64``,
    and no stored value's: the same with ``M_s = M`` stored 40 times."""
    for expected in (one_y(1.0, 3.0), one_y(1.0, 3.0, stored=3.0, stores=40.0)):
        want = sum(
            (exact_gamma(2, U[d]) * 3 + 2 * ETA[d] for d in (torch.float32, torch.float64)),
            Fraction(0),
        )
        for dtype in SIXTEEN:
            assert close(float(accumulated_error(expected, dtype)), want)
    assert close(
        float(accumulated_error(one_y(1.0, 3.0), torch.float32)),
        exact_bound((1, 3, 2, 0, 0, 0, None), torch.float32),  # float32: the whole bound
    )


def test_a_16_bit_inf_is_allowed_where_ref_plus_its_accumulated_error_is_the_threshold_exactly():
    """The edge itself: a value at the largest finite float16 plus half its ulp rounds to inf
    (the tie goes to the even side, inf), so an inf passes where ``ref + r`` equals it exactly,
    and fails a float64 step below. The ``ref`` that reaches it exactly is found by bisection
    over float64 values with the rule's own ``r`` (elementwise float64, the same on every
    machine): this test is about where the comparison starts, not about ``r``."""

    def reach(ref: float) -> float:  # ref + r, as the rule adds them (float64)
        return float(ref + accumulated_error(one_y(ref, ref), torch.float16))

    def as_float(bits: int) -> float:
        return struct.unpack("<d", struct.pack("<q", bits))[0]

    below, above = (struct.unpack("<q", struct.pack("<d", v))[0] for v in (1.0, FLOAT16_OVERFLOW))
    while above - below > 1:  # reach(below) < threshold <= reach(above)
        middle = (below + above) // 2
        below, above = (
            (below, middle) if reach(as_float(middle)) >= FLOAT16_OVERFLOW else (middle, above)
        )
    assert reach(as_float(above)) == FLOAT16_OVERFLOW  # reached exactly, not jumped over
    assert _inf_judged(torch.float16, as_float(above), as_float(above))
    assert not _inf_judged(torch.float16, as_float(below), as_float(below))
    # the mirror: -inf where ref - r is -T exactly, and not a float64 step above
    assert _judged(-math.inf, torch.float16, one_y(-as_float(above), as_float(above)))
    assert not _judged(-math.inf, torch.float16, one_y(-as_float(below), as_float(below)))


def hub(readers: int) -> KNNMeta:
    """One input read by ``readers`` nodes, each in its one cell."""
    return KNNMeta.from_knn(
        torch.zeros(1, readers, dtype=torch.int64),
        torch.zeros(readers, 1, dtype=torch.int64),
        n_in=1,
        in_channels=1,
        v=1,
    )


@pytest.mark.parametrize(
    "readers,weight,pair",
    [
        (2, 2.0, (40000.0, -39936.0)),
        (40, 2.0, (40000.0, -39936.0)),
        (64, 2.0, (40000.0, -39936.0)),
        (512, 2.0, (40000.0, -39936.0)),
        (2, 1024.0, (40000.0, -39968.0)),
    ],
    ids=["F2", "F40", "F64", "F512", "F2-w1024"],
)
def test_stored_intermediates_never_let_a_non_finite_value_stand_for_a_small_gradient(
    readers, weight, pair
):
    """float16, one input read by ``F`` nodes, upstream gradients of a gradient scaler's size
    with alternating signs: each ``grad_z = w grad_y`` is past 65504, the exact ``grad_x`` is
    ``w (40000 - 39936) F / 2 = 64 F`` (2,560 at 40 readers; 32,768 for two readers and a
    weight of 1,024, ``1024 * 32``), and fits. From 40 readers the ``h = F`` store allowance
    alone carries ``ref`` past the overflow threshold, yet neither nan (a float16 ``grad_z``:
    ``inf - inf``) nor inf stands for it, and the row names the input; the exact value,
    rounded, passes."""
    x = torch.ones(1, 1, 1, dtype=torch.float16)
    w = torch.full((1, 1), weight, dtype=torch.float16)
    gy = torch.tensor(pair * (readers // 2), dtype=torch.float16).view(1, 1, readers)
    expected = expected_quantities(x, w, None, hub(readers), gy)["grad_x"]
    exact = weight * (pair[0] + pair[1]) * readers / 2
    assert float(expected.value) == exact < 65504
    store_door = float(expected.value + error_bound(expected, torch.float16))
    assert (store_door >= FLOAT16_OVERFLOW) == (readers >= 40 or weight > 2)
    for bad in (math.nan, math.inf, -math.inf):
        verdict = judge_elementwise(torch.full((1, 1, 1), bad, dtype=torch.float16), expected)
        assert not verdict.ok and verdict.nonfinite_mismatches == 1, bad
        assert verdict.worst_index == (0, 0, 0) and verdict.worst_ref == exact
    assert judge_elementwise(expected.value.to(torch.float16), expected).ok


def test_an_infinite_oracle_takes_the_same_inf_or_a_nan_and_a_nan_oracle_a_nan():
    """``ref = +inf`` (an inf input times a positive weight): ``+inf`` passes, so does nan (no
    sign claimed: a one-hot einsum's ``0 * inf``), ``-inf`` and any finite value fail; the
    mirror for ``-inf``; ``ref = nan`` takes nan alone. In every dtype."""
    one = torch.ones(3, dtype=torch.float64)
    value = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)
    expected = Expected("y", value, one * math.inf, one * 2, one * 0, one * 0, one * 0)
    inf, nan = math.inf, math.nan
    cases = {
        (inf, -inf, nan): True,
        (nan, nan, nan): True,
        (-inf, -inf, nan): False,
        (inf, inf, nan): False,
        (inf, -inf, inf): False,
        (inf, -inf, -inf): False,
        (inf, -inf, 1.0): False,
        (1.0, -inf, nan): False,
    }
    for dtype in ALL:
        for got, ok in cases.items():
            verdict = judge_elementwise(torch.tensor(got, dtype=dtype), expected)
            assert verdict.ok == ok, (dtype, got)
            assert verdict.nonfinite_mismatches == (0 if ok else 1), (dtype, got)


def test_a_bias_of_the_wrong_shape_is_refused():
    x, w, bias, gy = small_operands(torch.float32)
    with pytest.raises(ValueError, match="bias"):
        expected_quantities(x, w, bias[:1], small_meta(), gy)


def test_under_all_padding_zero_an_empty_node_adds_nothing_to_grad_bias():
    """fovi 2.4.0's reading: an all-padding node outputs 0 and sends no gradient to the bias.
    ``grad_bias`` then has one term (node 0's), ``M = |grad_y[0]| = 1``, so its float32 bound
    is ``gamma_1(u) + gamma_1(u64)``; node 1's ``grad_y`` of 1000 is no term of it."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0, 1]]), torch.zeros(2, 1, dtype=torch.int64), n_in=1, in_channels=1, v=1
    )
    x = torch.ones(1, 1, 1)
    w = torch.ones(1, 1)
    gy = torch.tensor([[[1.0, 1000.0]]])
    expected = expected_quantities(x, w, torch.ones(1), meta, gy, all_padding="zero")
    grad_bias = expected["grad_bias"]
    assert float(grad_bias.value) == 1.0 and float(grad_bias.magnitude) == 1.0
    bound = exact_gamma(1, U[torch.float32]) + exact_gamma(1, U[torch.float64])
    assert close(float(error_bound(grad_bias, torch.float32)), bound)


@pytest.mark.parametrize("dtype", SIXTEEN, ids=str)
def test_elements_without_magnitude_count_as_judged_with_one_store_only_where_h_exceeds_1(dtype):
    """``grad_y = 0``: every gradient of ``x`` has ``M = 0``, so ``gamma_h(u) M_s >= M`` holds
    with equality; the verdict counts the elements whose ``h`` (fan-out) is above 1, inputs 1 and
    2 in each batch and channel (8), and no element of ``y`` (``h = 1``)."""
    x, w, bias, gy = small_operands(dtype)
    expected = expected_quantities(x, w, bias, small_meta(), torch.zeros_like(gy))
    grad_x = judge_elementwise(expected["grad_x"].value.to(dtype), expected["grad_x"])
    assert grad_x.notes == ("8 elements judged with h = 1 (the h-store bound reaches M)",)
    x0 = expected_quantities(torch.zeros_like(x), w, None, small_meta(), gy)["y"]
    assert judge_elementwise(x0.value.to(dtype), x0).notes == ()


def test_the_oracle_check_reports_the_baselines_ratio_and_a_check_without_note_has_none():
    """check_ops judges each quantity beside ``einsum_baseline`` run on the same operands (its
    ratio reported, not judged); a row of a check that adds no note has an empty one."""
    from fovi_ref.check.check_ops import check_ops
    from fovi_ref.check.graphs import TestGraph

    graph = TestGraph("small", small_meta(), COUT)
    report = check_ops(
        "general", graphs=[graph], dtypes=[torch.float32], checks=["oracle", "nonfinite"]
    )
    oracle = [r for r in report.rows if r.check == "oracle"]
    assert {r.quantity for r in oracle} == {"y", "grad_x", "grad_weight"}
    assert all(r.ok and r.baseline_ratio is not None and r.baseline_ratio <= 1 for r in oracle)
    nonfinite = [r for r in report.rows if r.check == "nonfinite"]
    assert nonfinite and all(r.ok and r.note == "" for r in nonfinite)


class OneUlpAtEmptyNodes(ForeignOps):
    """Outputs of all-padding nodes one float64 ulp above their bias: within the bound (at most
    ``2 gamma_1(u64) |b|``), but not the bias."""

    name = "one_ulp_at_empty_nodes"

    @staticmethod
    def forward(meta, x, weight, bias):
        y = ForeignOps.forward(meta, x, weight, bias)
        return torch.where(meta.pad_mask.all(dim=0), torch.nextafter(y, y + 1), y)


def test_an_empty_nodes_output_within_the_bound_but_not_the_bias_fails_by_the_exact_rule():
    from fovi_ref.check.check_ops import _where, check_ops
    from fovi_ref.check.graphs import TestGraph

    meta = KNNMeta.from_knn(
        torch.tensor([[0, 1, 2]]), torch.zeros(3, 1, dtype=torch.int64), n_in=2, in_channels=2, v=1
    )
    graph = TestGraph("padding_case", meta, 2)
    report = check_ops(
        OneUlpAtEmptyNodes, graphs=[graph], dtypes=[torch.float64], checks=["padding"]
    )
    (failed,) = [r for r in report.rows if not r.ok]
    assert failed.ok is False and math.isinf(failed.ratio) and failed.bound == 0.0
    assert failed.index[2] == 2 and failed.where == _where(meta, "y", failed.index)
    assert failed.value == math.nextafter(failed.oracle, math.inf)


class WrongWithoutGrad(ForeignOps):
    """Right under autograd, a whole bias off in a forward under ``no_grad``."""

    name = "wrong_without_grad"

    @staticmethod
    def forward(meta, x, weight, bias):
        y = ForeignOps.forward(meta, x, weight, bias)
        return y if torch.is_grad_enabled() else y + 1


def test_the_doors_check_runs_the_plain_forward_of_the_ops_under_test():
    from fovi_ref.check.check_ops import check_ops
    from fovi_ref.check.graphs import TestGraph

    graph = TestGraph("small", small_meta(), COUT)
    report = check_ops(WrongWithoutGrad, graphs=[graph], dtypes=[torch.float32], checks=["doors"])
    failed = [(r.quantity, r.note) for r in report.rows if not r.ok]
    assert ("y", "plain forward (no_grad)") in failed  # (the custom op's forward runs so too)
