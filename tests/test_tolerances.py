"""The elementwise tolerance rule: it passes every correct implementation under cancellation,
fails errors the size of one term, and rests on premises checked here (float32 accumulation)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FUSED_BIAS_BACKENDS

from fovi_ref import KNNMeta, get_ops, knn_conv
from fovi_ref.check.check_ops import random_meta
from fovi_ref.check.magnitude import (
    binned_cells,
    knn_conv_magnitude,
    knn_conv_term_counts,
    oracle_quantities,
    shared_cell_meta,
)
from fovi_ref.check.tolerances import (
    QUANTITIES,
    UNIT_ROUNDOFF,
    error_bound,
    expected_quantities,
    gamma,
    judge_elementwise,
    relative_error,
)
from fovi_ref.reference import knn_conv_reference

LOW = [torch.float16, torch.bfloat16]
ALL = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ("einsum_baseline", "general", "gather_gemm")


pytestmark = pytest.mark.usefixtures("one_thread")


def scale_rule_ok(value: torch.Tensor, ref: torch.Tensor) -> bool:
    """The rule relative to ``max |ref|`` that the elementwise rule replaced, kept here only as
    the contrast these tests draw: ``max |value - ref| / max |ref|`` within an absolute ceiling
    per dtype (1e-12, 1e-5, then 8 unit roundoffs in float16/bfloat16)."""
    ceiling = {torch.float64: 1e-12, torch.float32: 1e-5}.get(value.dtype)
    return relative_error(value, ref) <= (ceiling or 8 * UNIT_ROUNDOFF[value.dtype])


def one_to_one_meta(n: int = 1) -> KNNMeta:
    """K = V = 1, Cin = 1: output j reads input j."""
    knn = torch.arange(n)[None]  # [1, n]
    return KNNMeta.from_knn(knn, torch.zeros(n, 1, dtype=torch.int64), n_in=n, in_channels=1, v=1)


def low_precision_oracle(x, w, b, meta, grad_y, dtype):
    """The oracle's loop in float32, each result rounded once to ``dtype``: a correct
    low-precision implementation under the model of fovi_ref.check.tolerances (step 2)."""
    got = oracle_quantities(x, w, b, meta, grad_y, compute_dtype=torch.float32)
    return {q: t.to(dtype) for q, t in zip(QUANTITIES, got, strict=True) if t is not None}


# --------------------------------------------------------------------------------- premises
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_torch_kernels_accumulate_in_float32(dtype):
    """Step 2's premise: on this torch, GEMM, einsum, sum, F.linear, scatter_add_ and a
    2-D index_add_ in float16/bfloat16 keep a 4096-term sum within the bound of a float32
    accumulation rounded once, which summing in the storage dtype misses by far. (A 1-D
    index_add_ on CPU does add in the storage dtype, as CUDA's atomics do: grad_x's bound allows
    one rounding per collision for that reason.)"""
    g = torch.Generator().manual_seed(0)
    n = 4096
    values = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)  # [n]
    exact = values.double().sum()
    u = UNIT_ROUNDOFF[dtype]
    bound = u * exact + (1 + u) * float(gamma(n, UNIT_ROUNDOFF[torch.float32])) * exact
    zero_index = torch.zeros(n, dtype=torch.int64)
    ones = torch.ones(n, 1, dtype=dtype)
    results = {
        "mm": values[None] @ ones,
        "einsum": torch.einsum("an,nb->ab", values[None], ones),
        "sum": values.sum(),
        "index_add_": torch.zeros(1, 1, dtype=dtype).index_add_(1, zero_index, values[None]),
        "scatter_add_": torch.zeros(1, dtype=dtype).scatter_add_(0, zero_index, values),
        "linear": F.linear(values[None], ones[None, :, 0], torch.zeros(1, dtype=dtype)),
    }
    for name, got in results.items():
        assert abs(float(got.double().sum()) - float(exact)) <= bound, name
    chain = torch.zeros((), dtype=dtype)
    for value in values:  # what a kernel adding in the storage dtype would do
        chain = chain + value
    assert abs(float(chain) - float(exact)) > bound


def test_gamma():
    assert float(gamma(10, 2.0**-24)) == pytest.approx(10 * 2.0**-24, rel=1e-6)
    assert math.isinf(float(gamma(2**30, 2.0**-24)))
    assert float(gamma(0, 2.0**-11)) == 0.0


# ------------------------------------------------------------------ magnitudes and term counts
@pytest.mark.parametrize("k,v", [(1, 1), (4, 2), (3, 9)])
def test_term_counts_follow_the_formula(k, v):
    meta = random_meta(k, v, seed=k)
    batch, c_out = 2, 3
    counts = knn_conv_term_counts(meta, c_out, batch)
    real = ~meta.pad_mask  # [K, Nout]
    per_node = real.sum(dim=0).double()  # [Nout]
    fan_out = torch.bincount(meta.knn[real], minlength=meta.n_in).double()  # [Nin]
    per_cell = torch.bincount(meta.rf_index.t()[real], minlength=v).double()  # [V]
    expect_y = meta.in_channels * per_node + 1
    torch.testing.assert_close(counts.y, expect_y.expand(batch, c_out, -1))
    torch.testing.assert_close(counts.grad_x, (c_out * fan_out).expand(batch, meta.in_channels, -1))
    torch.testing.assert_close(
        counts.grad_weight, (batch * per_cell).repeat(meta.in_channels).expand(c_out, -1)
    )
    torch.testing.assert_close(
        counts.grad_bias, torch.full((c_out,), batch * meta.n_out, dtype=torch.float64)
    )
    zero = knn_conv_term_counts(meta, c_out, batch, all_padding="zero")
    assert bool((zero.y[:, :, meta.pad_mask.all(0)] == 0).all())


def test_magnitude_is_the_oracle_on_absolute_values():
    meta = random_meta(4, 2, seed=5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, meta.n_in, generator=g, dtype=torch.float64)
    w = torch.randn(4, 3 * 2, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    gy = torch.randn(2, 4, meta.n_out, generator=g, dtype=torch.float64)
    mag = knn_conv_magnitude(x, w, b, meta, gy)
    ref = oracle_quantities(x, w, b, meta, gy)
    for m, r in zip(mag, ref, strict=True):
        assert bool((m >= r.abs() - 1e-12).all())  # |sum| <= sum of |terms|
    torch.testing.assert_close(mag.grad_bias, gy.abs().sum(dim=(0, 2)))


def test_shared_cell_meta_keeps_exactly_the_neighbours_that_share_a_cell():
    knn = torch.tensor([[0, 1], [2, 3], [4, 4]])  # [K=3, Nout=2]; input 4 = padding
    rf_index = torch.tensor([[0, 0, 1], [1, 0, 1]])  # node 0: k0, k1 share cell 0
    meta = KNNMeta.from_knn(knn, rf_index, n_in=4, in_channels=1, v=2)
    shared = shared_cell_meta(meta)
    assert shared.knn.tolist() == [[0, 4], [2, 4], [4, 4]]  # node 1's cells hold one each


# ------------------------------------------------------------------ the oracle's readings
def test_padding_has_no_term_even_next_to_inf():
    """A padding neighbour adds nothing, even where its cell's weight is inf, and no gradient
    reaches the input the oracle's safe index clamps to."""
    knn = torch.tensor([[0, 1], [2, 2]])  # node 0 and 1: second neighbour is padding (n_in=2)
    rf_index = torch.tensor([[0, 1], [0, 1]])
    meta = KNNMeta.from_knn(knn, rf_index, n_in=2, in_channels=1, v=2)
    x = torch.tensor([[[1.0, math.inf]]], dtype=torch.float64)  # input 1 = inf, read by node 1
    w = torch.tensor([[2.0, math.inf]], dtype=torch.float64)  # cell 1 (padding only) holds inf
    got = oracle_quantities(x, w, None, meta, torch.ones(1, 1, 2, dtype=torch.float64))
    assert got.y[0, 0, 0] == 2.0  # node 0: x0 * w0 only; its padding (cell 1) adds nothing
    assert math.isinf(got.y[0, 0, 1])  # node 1 reads the inf input
    assert got.grad_x.tolist() == [[[2.0, 2.0]]]  # gradients from cell 0; none via padding
    assert math.isinf(got.grad_weight[0, 0]) and got.grad_weight[0, 1] == 0.0


def test_inf_reaches_exactly_the_nodes_that_read_it():
    meta = random_meta(3, 4, seed=2)
    x = torch.randn(2, 3, meta.n_in, dtype=torch.float64)
    w = torch.randn(2, 12, dtype=torch.float64)
    x[1, 2, 0] = math.inf
    y = knn_conv_reference(x, w, None, meta)
    readers = ((meta.knn == 0) & ~meta.pad_mask).any(dim=0)  # [Nout]
    assert bool((~torch.isfinite(y[1][:, readers])).all())
    assert bool(torch.isfinite(y[1][:, ~readers]).all()) and bool(torch.isfinite(y[0]).all())


def test_all_padding_bias_or_zero():
    meta = random_meta(2, 4, seed=3)
    empty = meta.pad_mask.all(dim=0)
    x = torch.randn(2, 3, meta.n_in, dtype=torch.float64)
    w, b = torch.randn(2, 12, dtype=torch.float64), torch.tensor([0.5, -2.0], dtype=torch.float64)
    gy = torch.ones(2, 2, meta.n_out, dtype=torch.float64)
    as_formula = oracle_quantities(x, w, b, meta, gy)
    as_fovi = oracle_quantities(x, w, b, meta, gy, all_padding="zero")
    assert bool((as_formula.y[:, :, empty] == b[:, None]).all())
    assert bool((as_fovi.y[:, :, empty] == 0).all())
    torch.testing.assert_close(as_fovi.y[:, :, ~empty], as_formula.y[:, :, ~empty])
    assert as_fovi.grad_bias.tolist() == [2.0 * int((~empty).sum())] * 2


# ------------------------------------------- the rule passes correct code under cancellation
CANCEL_X, CANCEL_W, CANCEL_B = 0.3923, -0.2235, 0.07141  # y = x w + b = -0.0163 from terms ~0.09


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_k1_v1_bias_cancellation(dtype):
    """One input, one weight, a bias that cancels most of ``x w``. The rule accepts one
    rounding of ``x w + b`` (einsum_baseline, the low-precision oracle), and a rounding of
    ``x w`` before the bias only where ``bias_rounding="separate"`` allows it; the earlier
    rule, without a baseline, cannot tell the two apart."""
    meta = one_to_one_meta()
    x, w, b = (
        torch.tensor(v, dtype=dtype).reshape(s)
        for v, s in ((CANCEL_X, (1, 1, 1)), (CANCEL_W, (1, 1)), (CANCEL_B, (1,)))
    )
    gy = torch.ones(1, 1, 1, dtype=dtype)
    fused = expected_quantities(x, w, b, meta, gy, bias_rounding="fused")["y"]
    separate = expected_quantities(x, w, b, meta, gy, bias_rounding="separate")["y"]
    once = fused.value.to(dtype)  # exact x w + b, rounded once
    twice = x * w + b[:, None]  # x w rounded, then the bias added and rounded again
    einsum = get_ops("einsum_baseline").forward(meta, x, w, b)
    oracle = low_precision_oracle(x, w, b, meta, gy, dtype)["y"]
    for value in (once, einsum, oracle):
        assert judge_elementwise(value, fused).ok
    assert not judge_elementwise(twice, fused).ok
    assert judge_elementwise(twice, separate).ok
    assert scale_rule_ok(twice, fused.value)  # the earlier rule sees nothing wrong


@pytest.mark.parametrize("backend", FUSED_BIAS_BACKENDS)
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_backends_round_a_cancelling_bias_once(backend, dtype):
    """The target of the core rewrite: the bias is added inside the GEMM, one rounding."""
    meta = one_to_one_meta()
    x, w, b = (
        torch.tensor(v, dtype=dtype).reshape(s)
        for v, s in ((CANCEL_X, (1, 1, 1)), (CANCEL_W, (1, 1)), (CANCEL_B, (1,)))
    )
    gy = torch.ones(1, 1, 1, dtype=dtype)
    expected = expected_quantities(x, w, b, meta, gy, bias_rounding="fused")["y"]
    verdict = judge_elementwise(get_ops(backend).forward(meta, x, w, b), expected)
    assert verdict.ok, verdict


def gradient_cancelling_case(seed: int, dtype: torch.dtype):
    """Two outputs read one input; their upstream gradients nearly cancel on it."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0, 0]]), torch.zeros(2, 1, dtype=torch.int64), n_in=1, in_channels=1, v=1
    )
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, 1, generator=g, dtype=torch.float64)
    w = torch.randn(2, 1, generator=g, dtype=torch.float64)
    b = torch.randn(2, generator=g, dtype=torch.float64)
    gy0 = torch.randn(1, 2, 1, generator=g, dtype=torch.float64)
    wobble = 1 + 0.01 * torch.randn(1, 2, 1, generator=g, dtype=torch.float64)
    gy = torch.cat([gy0, -gy0 * wobble], dim=2)  # [1, 2, 2]: node 1 ~ -node 0
    return meta, *(t.to(dtype) for t in (x, w, b, gy))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_gradients_cancelling_on_a_shared_input(dtype):
    """Where the earlier rule fails einsum_baseline in most seeds, the new one passes every
    implementation (the three backends and the low-precision oracle) in all of them."""
    old_failures = 0
    for seed in range(200):
        meta, x, w, b, gy = gradient_cancelling_case(seed, dtype)
        expected = expected_quantities(x, w, b, meta, gy)["grad_x"]
        candidates = {name: get_ops(name).grad_input(meta, gy, w) for name in BACKENDS}
        candidates["oracle"] = low_precision_oracle(x, w, b, meta, gy, dtype)["grad_x"]
        for name, value in candidates.items():
            verdict = judge_elementwise(value, expected)
            assert verdict.ok, f"seed {seed} {name}: {verdict}"
        old_failures += not scale_rule_ok(candidates["einsum_baseline"], expected.value)
    assert old_failures > 100


def cancelling_everywhere(dtype: torch.dtype):
    """Every node reads two inputs in two cells with equal weights, and the second input is
    minus the first up to 2^-10: every y is ~1e-3 of its terms, with no bias to help."""
    n = 8
    knn = torch.stack([torch.arange(0, 2 * n, 2), torch.arange(1, 2 * n, 2)])  # [2, n]
    rf_index = torch.tensor([[0, 1]]).expand(n, 2)  # [n, 2]
    meta = KNNMeta.from_knn(knn, rf_index, n_in=2 * n, in_channels=2, v=2)
    g = torch.Generator().manual_seed(0)
    first = torch.randn(2, 2, n, generator=g, dtype=torch.float64)
    x = torch.stack([first, -first * (1 + 2.0**-10)], dim=3).reshape(2, 2, 2 * n)
    w = torch.randn(3, 2, 1, generator=g, dtype=torch.float64).expand(3, 2, 2).reshape(3, 4)
    gy = torch.randn(2, 3, n, generator=g, dtype=torch.float64)
    return meta, x.to(dtype), w.to(dtype), gy.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_oracle_in_lower_precision_passes_where_everything_cancels(dtype):
    meta, x, w, gy = cancelling_everywhere(dtype)
    expected = expected_quantities(x, w, None, meta, gy)["y"]
    oracle = low_precision_oracle(x, w, None, meta, gy, dtype)["y"]
    assert judge_elementwise(oracle, expected).ok
    for name in BACKENDS[:2]:
        verdict = judge_elementwise(get_ops(name).forward(meta, x, w, None), expected)
        assert verdict.ok, f"{name}: {verdict}"
    if dtype == torch.float32:  # every sum cancels to 1e-3 of its terms: the old rule gives up
        assert not scale_rule_ok(oracle, expected.value)


# ---------------------------------------------------- the rule fails errors of one term's size
def mutated_reference(kind: str, meta: KNNMeta, x, w, b, gy):
    """The oracle's y and grad_x with one bug of ``kind`` (independent of every backend)."""
    knn, rf_index = meta.knn.clone(), meta.rf_index.clone()
    node = int((~meta.pad_mask).sum(dim=0).argmax())  # the node with the most real neighbours
    if kind == "wrong_cell":
        rf_index[node, 0] = (rf_index[node, 0] + 1) % meta.v
    elif kind == "dropped_neighbour":
        knn[0, node] = meta.n_in
    elif kind == "padding_reads_input_0":
        knn[meta.pad_mask] = 0
    bad = KNNMeta.from_knn(knn, rf_index, n_in=meta.n_in, in_channels=meta.in_channels, v=meta.v)
    got = oracle_quantities(x, w, b, bad, gy)
    y, grad_x = got.y, got.grad_x
    if kind == "bias_twice":
        y = y + b.double()[None, :, None]
    if kind == "grad_x_rolled":
        grad_x = grad_x.roll(1, dims=2)
    return y, grad_x


MUTATIONS = [
    "wrong_cell",
    "dropped_neighbour",
    "padding_reads_input_0",
    "bias_twice",
    "grad_x_rolled",
]


@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("kind", MUTATIONS)
def test_rule_fails_errors_the_size_of_a_term(kind, dtype):
    """Each graph-level bug class (planted by scripts/mutations/planted_bugs.py or, for the retired
    ones, made by a mutant of the mutation record), made in the oracle and rounded to the
    dtype, fails the rule (on a small graph, where float16's bound is below one term)."""
    meta = random_meta(3, 4, seed=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, meta.n_in, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(4, 12, generator=g, dtype=torch.float64) / 3).to(dtype)
    b = torch.randn(4, generator=g, dtype=torch.float64).to(dtype)
    gy = torch.randn(2, 4, meta.n_out, generator=g, dtype=torch.float64).to(dtype)
    expected = expected_quantities(x, w, b, meta, gy)
    y, grad_x = (t.to(dtype) for t in mutated_reference(kind, meta, x, w, b, gy))
    caught = not judge_elementwise(y, expected["y"]).ok
    caught |= not judge_elementwise(grad_x, expected["grad_x"]).ok
    assert caught


# ----------------------------------------------------------------- non-finite values, verdicts
def test_nonfinite_masks_must_match():
    meta = random_meta(2, 4, seed=6)
    x = torch.randn(1, 3, meta.n_in, dtype=torch.float64)
    w = torch.randn(2, 12, dtype=torch.float64)
    x[0, 1, int(meta.knn[0, 0])] = math.inf
    gy = torch.ones(1, 2, meta.n_out, dtype=torch.float64)
    expected = expected_quantities(x, w, None, meta, gy)["y"]
    assert judge_elementwise(expected.value.clone(), expected).ok
    extra = expected.value.clone()
    extra[0, 0, -2] = math.nan  # a node that does not read the inf
    assert judge_elementwise(extra, expected).nonfinite_mismatches == 1
    missing = torch.nan_to_num(expected.value, posinf=0.0, neginf=0.0, nan=0.0)
    assert not judge_elementwise(missing, expected).ok


def test_overflow_to_inf_is_accepted_only_past_the_threshold():
    meta = one_to_one_meta(2)
    x = torch.tensor([[[300.0, 3.0]]], dtype=torch.float16)
    w = torch.tensor([[300.0]], dtype=torch.float16)
    expected = expected_quantities(x, w, None, meta, torch.ones(1, 1, 2, dtype=torch.float16))
    y = x * w  # 90000 overflows float16 to inf; 900 does not
    assert torch.isinf(y[0, 0, 0]) and judge_elementwise(y, expected["y"]).ok
    y[0, 0, 1] = math.inf
    assert not judge_elementwise(y, expected["y"]).ok


def test_verdict_reports_the_returned_dtype_and_the_baseline():
    meta = random_meta(2, 4, seed=7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, meta.n_in, generator=g, dtype=torch.float64)
    w = torch.randn(2, 12, generator=g, dtype=torch.float64)
    gy = torch.randn(2, 2, meta.n_out, generator=g, dtype=torch.float64)
    expected = expected_quantities(x, w, None, meta, gy)["y"]
    base = get_ops("einsum_baseline").forward(meta, x, w, None)
    verdict = judge_elementwise(
        expected.value.float(), expected, dtype=torch.float64, baseline=base
    )
    assert not verdict.ok and "returned float32" in verdict.notes
    assert verdict.baseline_ratio is not None and verdict.baseline_ratio <= 1
    assert "FAIL y float64" in str(verdict) and "returned float32" in str(verdict)
    bound = error_bound(expected, torch.float64).expand_as(expected.value)
    assert bool((bound[expected.terms > 0] > 0).all())  # zero only where there is no term
    assert bool((bound[expected.terms == 0] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_sum_just_above_the_largest_finite_value_may_round_to_inf(dtype):
    """max + half an ulp is finite in float64 but rounds to inf in ``dtype`` (a tie, to even):
    the correct result is inf and the rule accepts it; half an ulp less stays finite."""
    biggest = torch.finfo(dtype).max
    half_ulp = math.ldexp(UNIT_ROUNDOFF[dtype], math.frexp(biggest)[1] - 1)
    # Two neighbours in two cells: nothing is binned, y = x0 + x1 in one GEMM.
    meta = KNNMeta.from_knn(
        torch.tensor([[0], [1]]), torch.tensor([[0, 1]]), n_in=2, in_channels=1, v=2
    )
    w = torch.ones(1, 2, dtype=dtype)
    for small, finite in ((half_ulp, False), (half_ulp / 2, True)):
        x = torch.tensor([[[biggest, small]]], dtype=dtype)
        expected = expected_quantities(x, w, None, meta, torch.ones(1, 1, 1, dtype=dtype))["y"]
        y = knn_conv(x, w, None, meta, backend="general")
        assert bool(y.isfinite().all()) == finite and math.isfinite(float(expected.value))
        assert judge_elementwise(y, expected).ok


def test_float64_rule_leaves_room_for_the_oracles_own_rounding():
    """The float64 oracle rounds too: a float64 implementation that bins the neighbours before
    the weight (``w (x0 + x1 + x2)``, as ``general`` does) may sit gamma_N u M from the exact
    sum on one side while the oracle (``w x0 + w x1 + w x2``) sits as far on the other. Found by
    the adversarial pass (K=33, V=17, batch 257: grad_x of both general and einsum_baseline
    failed the float64 rule by 3%); these three values give 1.35 times the one-sided bound."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0], [1], [2]]),
        torch.zeros(1, 3, dtype=torch.int64),
        n_in=3,
        in_channels=1,
        v=1,
    )
    x = torch.tensor(
        [[[-1.2613456148668056, -0.8004403003033853, -0.2012609597799584]]], dtype=torch.float64
    )
    w = torch.tensor([[1.3061133856375562]], dtype=torch.float64)
    expected = expected_quantities(x, w, None, meta, torch.ones(1, 1, 1, dtype=torch.float64))
    binned = ((x[0, 0, 0] + x[0, 0, 1]) + x[0, 0, 2]) * w[0, 0]  # 3 roundings per term: legal
    oracle_side = float(gamma(3, UNIT_ROUNDOFF[torch.float64]) * expected["y"].magnitude.max())
    assert abs(float(binned) - float(expected["y"].value)) > oracle_side  # one side is not enough
    assert judge_elementwise(binned.reshape(1, 1, 1), expected["y"]).ok


def test_float64_subnormal_rounding_is_allowed():
    """Half the smallest float64 subnormal, 2**-1075, is 0.0 as a Python float, so the rule's
    underflow allowance vanished in float64 and a subnormal result one unit off failed with
    bound 0 (found by the adversarial pass: x of a few subnormal units times ordinary weights,
    grad_weight of every backend). The allowance is now one subnormal unit per rounding."""
    meta = KNNMeta.from_knn(
        torch.tensor([[0, 0]]), torch.zeros(2, 1, dtype=torch.int64), n_in=1, in_channels=1, v=1
    )
    unit = 2.0**-1074
    x = torch.tensor([[[3 * unit]]], dtype=torch.float64)
    gy = torch.tensor([[[0.7, 0.7]]], dtype=torch.float64)  # products of 2.1 units each
    w = torch.ones(1, 1, dtype=torch.float64)
    expected = expected_quantities(x, w, None, meta, gy)["grad_weight"]  # two terms
    assert float(expected.value) == 4 * unit  # each product rounded to 2 units
    one_off = torch.tensor([[5 * unit]], dtype=torch.float64)  # exact 4.2 units, one rounding up
    assert judge_elementwise(one_off, expected).ok
    assert not judge_elementwise(torch.tensor([[10 * unit]], dtype=torch.float64), expected).ok


@pytest.mark.parametrize("dtype,readers", [(torch.bfloat16, 128), (torch.float16, 1024)])
def test_the_store_allowance_is_replaced_by_h_1_exactly_where_it_reaches_the_magnitude(
    dtype, readers
):
    """gamma_F(u) >= 1 from F u >= 1/2: there the h-store allowance would pass any value within
    M of ref (a zeroed grad_x included); those elements, and no others, are judged with h = 1."""
    from fovi_ref.check.graphs import spanning_graph
    from fovi_ref.check.operands import sample_operands
    from fovi_ref.check.tolerances import vacuous_stores

    meta = spanning_graph("hub_1100").meta
    x, w, b, gy = sample_operands(meta, 2, batch=2, dtype=dtype)
    expected = expected_quantities(x, w, b, meta, gy)["grad_x"]
    fan_out = torch.bincount(meta.knn[~meta.pad_mask], minlength=meta.n_in)  # [Nin]
    want = (fan_out >= readers).expand(2, meta.in_channels, -1)
    assert want.any() and not want.all()
    assert torch.equal(vacuous_stores(expected, dtype), want)
    assert not vacuous_stores(expected, torch.float32).any()


# --------------------------------------------------------------- one store, relative to |z|
def test_binned_cells_follow_their_definition():
    meta = random_meta(5, 3, n_in=12, n_out=7, in_channels=2, seed=3)
    x = torch.randn(2, 2, 12, dtype=torch.float64)
    z = binned_cells(x, meta)  # [B, Cin, V, Nout]
    want = torch.zeros_like(z)
    for n in range(meta.n_out):
        for k in range(meta.k):
            if not meta.pad_mask[k, n]:
                want[:, :, meta.rf_index[n, k], n] += x[:, :, meta.knn[k, n]]
    assert torch.allclose(z, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_the_store_of_a_cell_is_allowed_relative_to_the_cell_not_its_terms(dtype):
    """One node, one cell of three neighbours holding A, s and -A: the one store the rule
    allows is u |s| (the cell's value), not u (2A + s) (its terms). A cell summed in the working
    dtype loses s entirely and fails; summed in float32 and stored once, it passes."""
    u = UNIT_ROUNDOFF[dtype]
    knn = torch.tensor([[0], [1], [2]])  # node 0 reads inputs 0, 1, 2, all in cell 0
    meta = KNNMeta.from_knn(knn, torch.zeros(1, 3, dtype=torch.int64), n_in=3, in_channels=1, v=1)
    big, s = 2 / u, 0.75
    x = torch.tensor([[[big, s, -big]]], dtype=dtype)
    w = torch.ones(1, 1, dtype=dtype)
    gy = torch.ones(1, 1, 1, dtype=dtype)
    expected = expected_quantities(x, w, None, meta, gy)
    assert float(expected["y"].stored) == s
    assert float(expected["grad_weight"].stored) == s
    in_dtype = (x[0, 0, 0] + x[0, 0, 1] + x[0, 0, 2]).reshape(1, 1, 1)  # one rounding per add
    once = x.float().sum(dim=2, keepdim=True).to(dtype)  # float32 sum, stored once
    assert float(in_dtype) == 0.0
    assert not judge_elementwise(in_dtype, expected["y"]).ok
    assert judge_elementwise(once, expected["y"]).ok
