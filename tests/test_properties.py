"""Property tests: every backend, every dtype, random graphs and cancellation-prone values.

Hypothesis draws the graph (K, V, sizes, every neighbour index with padding anywhere, every
cell, all-padding rows), the operand *style* (plain normal values, wide dynamic range, values
near float16's subnormals, small integers that cancel exactly) and the cancellations (a bias
that cancels ``W x`` at one node, upstream gradients that cancel in pairs of nodes); a drawn
seed fills in the values. Every result is judged elementwise against the float64 oracle by the
rule of fovi_ref.check.tolerances.

The default profile runs a few examples per test (tests/conftest.py); ``make properties`` runs
the long one (``HYPOTHESIS_PROFILE=long``).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import FUSED_BIAS_BACKENDS, force_cells
from hypothesis import given
from hypothesis import strategies as st

from fovi_ref import KNNMeta, available_ops, dtype_name, get_ops
from fovi_ref.check.bench.hub import hub_meta
from fovi_ref.check.operands import forward_and_grads, sample_operands
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise
from fovi_ref.reference import knn_conv_reference
from fovi_ref.segment_sum import HUB
from fovi_ref.strategies import derive

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
STYLES = ("normal", "wide", "tiny", "integers")


pytestmark = pytest.mark.usefixtures("one_thread")


def _k1_v1_only(backend: str) -> bool:
    """gather_gemm serves K = V = 1 graphs only (its supports())."""
    supports = getattr(get_ops(backend), "supports", None)
    index = torch.zeros(1, 1, dtype=torch.int64)
    probe = KNNMeta.from_knn(index, index, n_in=1, in_channels=1, v=2)  # K = 1, V = 2
    return supports is not None and not supports(probe)


@st.composite
def graphs(draw, k1_v1: bool = False, hub: bool = False) -> KNNMeta:
    """A graph with padding anywhere (all-padding rows included), repeated neighbours, shared
    cells and unused inputs wherever the draw puts them. ``hub``: more outputs than
    ``segment_sum.HUB``, every one reading one drawn input first (a hub, summed in a tree)."""
    k = 1 if k1_v1 else draw(st.integers(1, 4))
    v = 1 if k1_v1 else draw(st.integers(1, 4))
    n_in = draw(st.integers(1, 6))
    n_out = draw(st.integers(HUB + 1, 4 * HUB)) if hub else draw(st.integers(1, 6))
    c_in = draw(st.integers(1, 3))
    padding = st.integers(0, n_in)  # n_in is padding
    knn = draw(st.lists(padding, min_size=k * n_out, max_size=k * n_out))
    empty_rows = draw(st.lists(st.booleans(), min_size=n_out, max_size=n_out))
    cells = draw(st.lists(st.integers(0, v - 1), min_size=k * n_out, max_size=k * n_out))
    knn = torch.tensor(knn, dtype=torch.int64).reshape(k, n_out)  # [K, Nout]
    knn[:, torch.tensor(empty_rows)] = n_in  # whole rows of padding
    if hub:
        knn[0] = draw(st.integers(0, n_in - 1))  # every output reads the hub first
    rf_index = torch.tensor(cells, dtype=torch.int64).reshape(n_out, k)  # [Nout, K]
    return KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=c_in, v=v)


def _values(shape, style: str, g: torch.Generator) -> torch.Tensor:
    if style == "integers":  # exact sums: any error at all is a bug
        return torch.randint(-3, 4, shape, generator=g).double()
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    if style == "wide":  # 2^-10 .. 2^2: terms of very different sizes (no float16 overflow)
        values = values * 2.0 ** torch.randint(-10, 3, shape, generator=g).double()
    if style == "tiny":  # float16 subnormals (< 6.1e-5) appear in products and results
        values = values * 1e-3
    return values


@st.composite
def cases(draw, dtype: torch.dtype, k1_v1: bool = False, hub: bool = False):
    """``(meta, x, weight, bias, grad_y)`` rounded to ``dtype``."""
    meta = draw(graphs(k1_v1, hub))
    c_out = draw(st.integers(1, 3))
    batch = draw(st.integers(0, 2))
    style = draw(st.sampled_from(STYLES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = _values((batch, meta.in_channels, meta.n_in), style, g)
    w = _values((c_out, meta.in_channels * meta.v), style, g)
    b = _values((c_out,), style, g) if draw(st.booleans()) else None
    gy = _values((batch, c_out, meta.n_out), style, g)
    x, w, gy = (t.to(dtype) for t in (x, w, gy))
    if b is not None and batch and draw(st.booleans()):  # bias cancels W x at one node
        node = draw(st.integers(0, meta.n_out - 1))
        b = -knn_conv_reference(x, w, None, meta)[0, :, node]
    b = None if b is None else b.to(dtype)
    if meta.n_out >= 2 and draw(st.booleans()):  # upstream gradients cancel in pairs of nodes
        wobble = 1 + 2.0**-9 * torch.randn(gy[:, :, 0].shape, generator=g, dtype=torch.float64)
        gy = gy.clone()
        gy[:, :, 1] = (-gy[:, :, 0].double() * wobble).to(dtype)
    return meta, x, w, b, gy


def _judge_all(got, expected, dtype, skip=()):
    for quantity, value in zip(("y", "grad_x", "grad_weight", "grad_bias"), got, strict=True):
        if value is None or quantity in skip:
            continue
        verdict = judge_elementwise(value, expected[quantity], dtype=dtype)
        assert verdict.ok, str(verdict)


def _backend_cases(backends=None):
    return [
        pytest.param(backend, dtype, id=f"{backend}-{dtype_name(dtype)}")
        for backend in (backends or available_ops())
        for dtype in DTYPES
    ]


@pytest.mark.parametrize("backend,dtype", _backend_cases())
def test_matches_oracle(backend, dtype):
    """y and the three gradients agree with the oracle by the elementwise rule."""

    @given(case=cases(dtype, k1_v1=_k1_v1_only(backend)))
    def check(case):
        meta, x, w, b, gy = case
        got = forward_and_grads(x, w, b, meta, gy, backend)
        _judge_all(got, expected_quantities(x, w, b, meta, gy), dtype)

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("hub", [False, True], ids=["graphs", "hub graphs"])
def test_general_over_cells_matches_oracle(dtype, hub, monkeypatch):
    """general with its GEMMs forced per occupied cell (its estimate picks them on few of these
    small graphs) agrees with the oracle too, hubs and empty rows included."""
    force_cells(monkeypatch, True)

    @given(case=cases(dtype, hub=hub))
    def check(case):
        meta, x, w, b, gy = case
        got = forward_and_grads(x, w, b, meta, gy, "general")
        _judge_all(got, expected_quantities(x, w, b, meta, gy), dtype)

    check()


@pytest.mark.parametrize("backend,dtype", _backend_cases(["general", "einsum_baseline"]))
def test_hub_graphs_match_oracle(backend, dtype):
    """Graphs with a hub input (more than HUB readers: general sums its row in a tree) agree
    with the oracle by the elementwise rule."""

    @given(case=cases(dtype, hub=True))
    def check(case):
        meta, x, w, b, gy = case
        got = forward_and_grads(x, w, b, meta, gy, backend)
        _judge_all(got, expected_quantities(x, w, b, meta, gy), dtype)

    check()


def _derive_seconds(meta) -> float:
    """The fastest of three ``derive`` runs (the machine may be shared)."""
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        derive(meta)
        best = min(best, time.perf_counter() - start)
    return best


def test_derive_grows_near_linearly_on_a_hub():
    """16 times the fan-out costs far less than 16**2 times the time to plan (one round per
    term made it quadratic: 8k readers took 46 s). A ratio, not an absolute time."""
    small = _derive_seconds(hub_meta(1024, in_channels=2))
    large = _derive_seconds(hub_meta(16384, in_channels=2))
    assert large / small < 64, f"{large:.3f} s against {small:.3f} s"


def test_large_hub_is_correct_and_bitwise_deterministic():
    """A 4096-reader hub through general: float32 results meet the rule against the float64
    oracle, and a second run gives the same bits."""
    meta = hub_meta(4096, in_channels=3, n_in=32)
    x, w, b, gy = sample_operands(meta, 5, batch=2, seed=4, dtype=torch.float32)
    got = forward_and_grads(x, w, b, meta, gy, "general")
    _judge_all(got, expected_quantities(x, w, b, meta, gy), torch.float32)
    again = forward_and_grads(x, w, b, meta, gy, "general")
    assert all(torch.equal(a, c) for a, c in zip(got, again, strict=True))


LOW_PRECISION_CASES = [
    p for p in _backend_cases(FUSED_BIAS_BACKENDS) if p.values[1] in (torch.float16, torch.bfloat16)
]


@pytest.mark.parametrize("backend,dtype", LOW_PRECISION_CASES)
def test_bias_rounded_once(backend, dtype):
    """The target of the core rewrite: y rounds ``W x + b`` once (fails while the backends add
    the bias after their GEMM)."""

    @given(case=cases(dtype, k1_v1=_k1_v1_only(backend)))
    def check(case):
        meta, x, w, b, gy = case
        y = forward_and_grads(x, w, b, meta, gy, backend)[0]
        expected = expected_quantities(x, w, b, meta, gy, bias_rounding="fused")["y"]
        verdict = judge_elementwise(y, expected, dtype=dtype)
        assert verdict.ok, str(verdict)

    check()


@pytest.mark.parametrize("backend", available_ops())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_padding_is_no_term(backend, dtype):
    """With inf in every input no real neighbour reads, all-padding nodes output exactly the
    bias and unread inputs get exactly zero gradient; everything else still meets the rule."""

    @given(case=cases(dtype, k1_v1=_k1_v1_only(backend)))
    def check(case):
        meta, x, w, b, gy = case
        unread = torch.ones(meta.n_in, dtype=torch.bool)
        unread[meta.knn[~meta.pad_mask]] = False
        x = x.clone()
        x[:, :, unread] = math.inf
        got = forward_and_grads(x, w, b, meta, gy, backend)
        empty = meta.pad_mask.all(dim=0)
        y_empty = got[0][:, :, empty]
        want = torch.zeros_like(y_empty) if b is None else b[:, None].expand_as(y_empty)
        assert torch.equal(y_empty, want)
        assert bool((got[1][:, :, unread] == 0).all())
        _judge_all(got, expected_quantities(x, w, b, meta, gy), dtype)

    check()


@pytest.mark.parametrize("backend", available_ops())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_nonfinite_inputs_reach_exactly_their_readers(backend, dtype):
    """An inf and a nan in x reach exactly the outputs and weight gradients the oracle says.
    einsum_baseline's grad_weight is left out: fovi's one-hot product turns the inf into nan in
    every other cell of its channel (tests/test_testing_check_ops.py pins that down)."""

    @given(case=cases(dtype, k1_v1=_k1_v1_only(backend)), data=st.data())
    def check(case, data):
        meta, x, w, b, gy = case
        if x.numel():
            x = x.clone()
            flat = x.view(-1)
            flat[data.draw(st.integers(0, flat.numel() - 1))] = math.inf
            flat[data.draw(st.integers(0, flat.numel() - 1))] = math.nan
        got = forward_and_grads(x, w, b, meta, gy, backend)
        skip = ("grad_weight",) if backend == "einsum_baseline" else ()
        _judge_all(got, expected_quantities(x, w, b, meta, gy), dtype, skip)

    check()
