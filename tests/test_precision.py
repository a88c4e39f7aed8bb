"""The 16-bit precision choice (fovi_ref.precision): the table held to its record, both paths
judged by the battery on every backend and strategy, float16 cells past 65504, autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CUDA
from torch.overrides import TorchFunctionMode

from fovi_ref import KNNConv, KNNMeta, dtype_name, get_ops, knn_conv, precision
from fovi_ref.check.bench import gemm_dtypes
from fovi_ref.check.bench.gemm_dtypes import GEMM_DTYPE_SOURCES
from fovi_ref.check.check_ops import check_ops
from fovi_ref.check.jobs import layer_names
from fovi_ref.check.switches import forced, forced_grad_input_path
from fovi_ref.geometry import get_layer
from fovi_ref.layout import linear_rows, padded_rows
from fovi_ref.precision import (
    GEMM_DTYPES,
    SIXTEEN_BIT,
    gemm_dtype,
    platform,
    store_operand,
    stored_product,
)
from fovi_ref.strategies import STRATEGIES, forced_ops, strategy_for

pytestmark = pytest.mark.usefixtures("one_thread")
F16, BF16 = torch.float16, torch.bfloat16


# ------------------------------------------------------------------------------ the table
def test_full_precision_inputs_run_their_own_gemms_and_unknown_platforms_run_wide():
    for device in ("cpu", "meta"):
        assert gemm_dtype(device, torch.float32) == torch.float32
        assert gemm_dtype(device, torch.float64) == torch.float64
    assert platform("meta") == "meta"
    assert all(gemm_dtype("meta", d) == torch.float32 for d in SIXTEEN_BIT)


@pytest.mark.parametrize("native", [True, False], ids=["bfloat16 GEMM", "no bfloat16 GEMM"])
def test_a_cpu_is_keyed_by_whether_it_has_a_bfloat16_gemm(monkeypatch, native):
    """Both kinds of CPU, whichever this one is: the probe answered each way."""
    monkeypatch.setattr(precision, "_cpu_has_bf16_gemm", lambda: native)
    want = "cpu_bf16" if native else "cpu"
    assert platform("cpu") == platform(torch.device("cpu")) == want
    assert gemm_dtype("cpu", torch.float16) == torch.float32  # no CPU has a native float16 GEMM
    assert gemm_dtype("cpu", torch.bfloat16) == (torch.bfloat16 if native else torch.float32)


def test_every_entry_is_wide_or_narrow_and_says_where_it_comes_from():
    assert set(GEMM_DTYPES) == set(GEMM_DTYPE_SOURCES)
    for (_, dtype), gemm in GEMM_DTYPES.items():
        assert dtype in SIXTEEN_BIT and gemm in (dtype, torch.float32)
    records = gemm_dtypes.load_records()
    for key, source in GEMM_DTYPE_SOURCES.items():
        if key[0] in records:
            assert source == gemm_dtypes.measured(key[0]), key
        else:
            assert source.startswith("derived, unmeasured"), key


RECORD_FIELDS = {"platform", "device", "cpu_model", "cpu_capability", "threads", "torch", "load"}


def test_every_recorded_platform_holds_its_recorded_choice():
    """bench --gemm-dtypes measured a 16-bit GEMM against a float32 one on each recorded
    platform; the table must say what its record chose (narrow: the 16-bit GEMM was faster on
    every layer). Every record names its machine in the same fields (the first one, from an
    AVX2 CPU, recorded no CPU model, threads or load: null)."""
    records = gemm_dtypes.load_records()
    assert "cpu" in records
    for plat, record in records.items():
        assert set(record) >= RECORD_FIELDS, plat
        for name, choice in record["choice"].items():
            dtype = getattr(torch, name)
            assert choice == gemm_dtypes.choose(record["ratios"][name])
            want = dtype if choice == "narrow" else torch.float32
            assert GEMM_DTYPES[(plat, dtype)] == want, (plat, name)


def test_forced_sets_and_restores_the_table():
    saved = dict(GEMM_DTYPES)
    with forced("narrow"):
        assert all(gemm_dtype("cpu", d) == d for d in SIXTEEN_BIT)
    with forced("wide"):
        assert all(gemm_dtype("cpu", d) == torch.float32 for d in SIXTEEN_BIT)
    assert saved == GEMM_DTYPES
    with pytest.raises(ValueError, match="narrow"), forced("half"):
        pass


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=dtype_name)
def test_store_operand_stores_once_and_keeps_float16_overflow_wide(dtype):
    z = torch.tensor([[1.0 + 2**-12, -3.0]])  # float32 cell sums
    with forced("wide"):
        assert store_operand(z, dtype) is z
    with forced("narrow"):
        assert torch.equal(store_operand(z, dtype), z.to(dtype))
        big = torch.tensor([[70000.0, 1.0]])
        assert store_operand(big, dtype).dtype == (torch.float32 if dtype == F16 else BF16)
    assert store_operand(z, torch.float32) is z


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=dtype_name)
def test_stored_product_stores_a_16_bit_product_once_where_it_fits(dtype):
    """grad_z = W^T grad_y: wide, the float32 GEMM as it was; narrow, stored once in 16 bits, or
    kept in float32 where a float16 value is past 65504 (bfloat16 has float32's range)."""
    a = torch.tensor([[1.0, 2.0], [3.0, -4.0]]).to(dtype)  # [2, 2]
    b = torch.tensor([[20000.0, 1.0 + 2**-7], [20000.0, 1.0]]).to(dtype)  # [2, 2]
    exact = a.float() @ b.float()  # [[60000, ...], [-20000, ...]]: fits float16
    with forced("wide"):
        assert torch.equal(stored_product(a, b, dtype), exact)
    with forced("narrow"):
        assert torch.equal(stored_product(a, b, dtype), exact.to(dtype))
        big = 2 * a  # [[120000, ...], ...] is past 65504
        past = stored_product(big, b, dtype)
        assert past.dtype == (torch.float32 if dtype == F16 else BF16)
        assert torch.equal(past, (big.float() @ b.float()).to(past.dtype))
    grad_z = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(stored_product(grad_z, grad_z.t(), torch.float64), grad_z @ grad_z.t())


# --------------------------------------------------------------- both paths, every backend
def _ops(name: str):
    return forced_ops(name[len("general[") : -1]) if name.startswith("general[") else name


BACKENDS = ["general", "gather_gemm"] + [f"general[{s}]" for s in STRATEGIES]


@pytest.mark.parametrize("gemms", ["narrow", "wide"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_both_paths_pass_the_battery_in_16_bits(backend, gemms):
    """Whatever this machine's table says, each path is judged here: the oracle through the
    eager door and the ``rounding`` check (cells whose partial sums dwarf their sum)."""
    with forced(gemms):
        report = check_ops(_ops(backend), dtypes=SIXTEEN_BIT, checks=("oracle", "rounding"))
    assert report.ok, report


class GemmDtypes(TorchFunctionMode):
    """Records the operand dtypes of every matrix product called while active."""

    PRODUCTS = {torch.mm, torch.addmm, torch.matmul, torch.Tensor.__matmul__, torch.Tensor.mm}

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS:
            self.seen |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def _graph(k: int, v: int) -> KNNMeta:
    g = torch.Generator().manual_seed(0)
    knn = torch.randint(0, 30, (k, 20), generator=g)
    rf_index = torch.randint(0, v, (20, k), generator=g)
    return KNNMeta.from_knn(knn, rf_index, n_in=30, in_channels=3, v=v)


@pytest.mark.parametrize("gemms", ["narrow", "wide"])
@pytest.mark.parametrize("backend", ["general", "gather_gemm"])
def test_a_bfloat16_autocast_training_step_runs_the_chosen_gemms(backend, gemms):
    """float32 master weights, bfloat16 activations: every GEMM of the step (forward and both
    gradients) runs in the table's dtype, and the gradients reach the float32 parameters."""
    meta = _graph(1, 1) if backend == "gather_gemm" else _graph(4, 4)
    conv = KNNConv(3, 5, meta, backend=backend)
    x = torch.randn(4, 3, 30, requires_grad=True)
    with forced(gemms), GemmDtypes() as mode:
        with torch.autocast("cpu", dtype=BF16):
            y = conv(x)
        F.mse_loss(y.float(), torch.zeros(y.shape)).backward()
    assert mode.seen == {BF16 if gemms == "narrow" else torch.float32}
    assert conv.weight.grad.dtype == conv.bias.grad.dtype == x.grad.dtype == torch.float32
    assert all(torch.isfinite(t).all() for t in (conv.weight.grad, conv.bias.grad, x.grad))


# ------------------------------------------------------------------ float16 past 65504
def _two_neighbours_in_one_cell() -> KNNMeta:
    knn = torch.tensor([[0], [1]])  # node 0 reads inputs 0 and 1, both in cell 0
    return KNNMeta.from_knn(knn, torch.zeros(1, 2, dtype=torch.int64), n_in=2, in_channels=1, v=1)


@pytest.mark.parametrize("gemms", ["narrow", "wide"])
@pytest.mark.parametrize("backend", ["general", "general_textbook"])
def test_float16_cells_past_65504_still_give_a_finite_y(backend, gemms):
    """A cell sum of 80,000 times a weight of 2^-10 is 78.125: the exact y is finite, so y must
    be, on both paths (fovi's einsum, which stores the cell in float16, gives inf)."""
    meta = _two_neighbours_in_one_cell()
    x = torch.full((1, 1, 2), 40000.0, dtype=F16)
    w = torch.full((1, 1), 2.0**-10, dtype=F16)
    with forced(gemms):
        y = knn_conv(x, w, None, meta, backend=backend)
    assert y.dtype == F16 and float(y) == 78.125
    assert torch.isinf(get_ops("einsum_baseline").forward(meta, x, w, None)).all()


# ------------------------------------------------------------------------------------ CUDA
@CUDA
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_runs_its_table_entry_and_passes_the_battery(backend):
    report = check_ops(_ops(backend), dtypes=SIXTEEN_BIT, device="cuda")
    assert report.ok, report


# ------------------------------------------------------------------------------ strategies
def test_bfloat16_takes_float32s_strategy_where_it_runs_wide_and_never_occupied_cells_narrow():
    """Wide, a 16-bit call runs float32 GEMMs and grad_z is float32: the same choice as float32
    on every res18 graph and batch. Narrow, occupied cells (which would round each cell's
    product) is never chosen."""
    metas = {get_layer(name).meta for name in layer_names(None)}
    chosen = set()
    for gemms in ("wide", "narrow"):
        with forced(gemms):
            for meta in metas:
                for batch in (1, 4, 16, 64, 256):
                    ours = strategy_for(meta, batch, "cpu", BF16).strategy
                    chosen.add((gemms, ours))
                    if gemms == "wide":
                        assert ours == strategy_for(meta, batch, "cpu").strategy
                    else:
                        assert ours != "occupied_cells"
    assert ("wide", "occupied_cells") in chosen  # so the narrow assertion means something


# ------------------------------------------------- which torch products give what, checked
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=dtype_name)
def test_cpu_products_of_16_bit_operands_return_16_bits_and_no_float32_result(dtype):
    """What the narrow path can rely on here: a 16-bit product returns 16 bits (its float32
    accumulation is checked in tests/test_tolerances.py), and no CPU product hands back its
    float32 accumulator: ``out_dtype=torch.float32`` is refused (it exists for CUDA). So a
    16-bit result that must be summed further (occupied cells' per-cell products) cannot stay
    in float32 on a narrow CPU path."""
    a = torch.randn(8, 16).to(dtype)
    b = torch.randn(16, 4).to(dtype)
    bias = torch.randn(4).to(dtype)
    products = {
        "mm": torch.mm(a, b),
        "addmm": torch.addmm(bias, a, b),
        "matmul": a @ b,
        "bmm": torch.bmm(a[None], b[None]),
        "linear": F.linear(a, b.t(), bias),
        "einsum": torch.einsum("ij,jk->ik", a, b),
    }
    assert {name: p.dtype for name, p in products.items()} == dict.fromkeys(products, dtype)
    with pytest.raises((NotImplementedError, RuntimeError, TypeError)):
        torch.mm(a, b, out_dtype=torch.float32)


@CUDA
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=dtype_name)
def test_cuda_mm_can_return_its_float32_accumulator(dtype):
    a = torch.randn(64, 4096, device="cuda").to(dtype)
    b = torch.ones(4096, 1, device="cuda", dtype=dtype)
    got = torch.mm(a, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    exact = a.double().sum(dim=1, keepdim=True)
    magnitude = float(a.double().abs().sum(dim=1).max())  # float32 accumulation: gamma_N(u32) M
    assert float((got.double() - exact).abs().max()) <= 4097 * 2.0**-24 * magnitude


# ------------------------------------------------- a CPU's bfloat16 GEMM reads past each row
def test_padded_rows_pads_only_a_row_major_bfloat16_operand_not_a_multiple_of_the_block():
    rows = torch.randn(5, 63).to(BF16)
    padded = padded_rows(rows)
    assert padded.stride() == (64, 1) and torch.equal(padded, rows)
    assert torch.equal(padded.as_strided((5, 64), (64, 1))[:, 63:], torch.zeros(5, 1, dtype=BF16))
    for kept in (rows.float(), rows.half(), torch.randn(5, 64).to(BF16), rows.t().contiguous().t()):
        assert padded_rows(kept) is kept


@pytest.mark.parametrize("backend", ["general", "general[node_rows]", "general[few_columns]"])
def test_an_inf_in_x_reaches_no_other_node_on_the_narrow_bfloat16_path(backend):
    """``y`` of a node that reads no inf stays finite where the rows are 63 and 129 values long
    (``Cin*V`` of ``cin_63`` and ``v_33``). Unpadded, a CPU whose bfloat16 GEMM over-reads
    (AVX512-BF16) gave nan there, at ``y`` of the node before (rows 4 and 5 below); elsewhere
    this holds trivially."""
    with forced("narrow"):
        report = check_ops(
            _ops(backend), graphs=["cin_63", "v_33"], dtypes=[BF16], checks=["nonfinite"]
        )
    assert report.ok, report
    rows = torch.ones(36, 63, dtype=BF16)
    rows[5, 0] = float("inf")
    y = linear_rows(rows, torch.ones(4, 63, dtype=BF16), torch.zeros(4, dtype=BF16))
    assert bool(y[4].isfinite().all()) and bool(y[5].isinf().all())


def test_an_inf_weight_reaches_no_other_channel_through_the_dense_scatter_in_bfloat16():
    """gather_gemm's dense ``S`` (CUDA's path, forced) multiplies rows of ``Nout`` values
    (``downsample_wide``: 65), one per (sample, channel): a non-finite weight's channel reaches no
    other channel's ``grad_x``. Unpadded, an over-reading CPU gave nan in the channel before."""
    with forced("narrow"), forced_grad_input_path("dense"):
        report = check_ops(
            "gather_gemm", graphs=["downsample_wide"], dtypes=[BF16], checks=["nonfinite"]
        )
    assert report.ok, report
