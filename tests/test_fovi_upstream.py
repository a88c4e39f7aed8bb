"""fovi 2.4.0, the release users install, run through its own code and checked against fovi_ref.

Needs fovi==2.4.0 (``pip install --no-deps -r scripts/fovi-requirements.txt``); skips only where
fovi is absent. Every check compares against the float64 oracle with explicit bounds, or pins a
documented difference of fovi's (see :mod:`fovi_ref.check.fovi`).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import CUDA, random_meta, sample_inputs

from fovi_ref import (
    KNNMeta,
    available_ops,
    knn_conv,
    register_ops,
    route,
    unregister_ops,
)
from fovi_ref.check import fovi as upstream
from fovi_ref.check.bench import make_inputs, time_contenders
from fovi_ref.check.operands import QUANTITIES
from fovi_ref.check.protocol import policed
from fovi_ref.check.tolerances import UNIT_ROUNDOFF, relative_error
from fovi_ref.geometry import resnet18_layers, resnet18_plan
from fovi_ref.reference import knn_conv_reference

pytest.importorskip(
    "fovi",
    reason="fovi 2.4.0 is not installed: pip install --no-deps -r scripts/fovi-requirements.txt",
)

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
# Small layers of fovi-resnet18 covering its three graph classes (K=9/V=9, K=V=1, K=2/V=4).
SMALL = ("layer4.0.conv1", "layer3.0.downsample.0", "layer4.0.conv2")


@pytest.fixture(scope="module")
def model64():
    """fovi's own KNNResNet-18 (10 classes) in float64; tests deep-copy it before changing it."""
    return upstream.build_fovi_resnet18(dtype=F64)


@pytest.fixture(scope="module")
def layers(model64):
    return upstream.fovi_conv_layers(model64)


def _grad_y(meta: KNNMeta, out_channels: int, dtype: torch.dtype, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, out_channels, meta.n_out, generator=g, dtype=F64).to(dtype)


def _oracle(x, w, b, gy, meta):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b) if t is not None]
    y = knn_conv_reference(*leaves[:2], leaves[2] if b is not None else None, meta)
    return (y.detach(), *torch.autograd.grad(y, leaves, gy.double()))


def _operands(rec: upstream.FoviLayer, dtype: torch.dtype):
    x, w, b = sample_inputs(rec.meta, out_channels=rec.out_channels, dtype=F64)
    x, w, b = (t.detach().to(dtype) for t in (x, w, b))
    return x, w, b, _grad_y(rec.meta, rec.out_channels, dtype)


# ----------------------------------------------------------------------- installing and loading
def test_the_pinned_release_is_installed():
    assert upstream.require_fovi().__version__ == upstream.FOVI_VERSION == "2.4.0"


def test_without_fovi_fovi_ref_imports_and_upstream_says_how_to_install():
    code = (
        "import sys; sys.modules['fovi'] = None\n"  # makes `import fovi` fail
        "import fovi_ref, fovi_ref.check.fovi as up\n"
        "try:\n    up.fovi_resnet18_layers()\n"
        "except up.FoviUnavailable as err:\n    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "fovi 2.4.0 is needed" in out and "scripts/fovi-requirements.txt" in out


# ------------------------------------------------------------------------ fovi's own layers
def test_fovi_resnet18_has_the_20_convolutions_of_the_plan(layers):
    assert list(layers) == [spec.name for spec in resnet18_plan()]
    for spec in resnet18_plan():
        rec = layers[spec.name]
        assert (rec.in_channels, rec.out_channels) == (spec.in_channels, spec.out_channels)
        assert rec.layer.bias is None  # fovi's default
        assert rec.meta.k == min(spec.k, rec.meta.n_in)
    assert layers["conv1"].meta.n_in == 5977
    assert {name for name, rec in layers.items() if rec.meta.k == rec.meta.v == 1} == {
        "layer2.0.downsample.0",
        "layer3.0.downsample.0",
        "layer4.0.downsample.0",
    }


def test_fovi_ref_geometry_builds_the_graphs_of_fovi_240(layers):
    """fovi_ref.geometry must rebuild the graphs fovi 2.4.0 builds on the machine at hand, layer
    for layer and element for element, whatever its arithmetic (CI runs this under several)."""
    ours = resnet18_layers()
    differ = {
        name: f"fovi_ref {ours[name].meta} vs fovi {rec.meta}"
        for name, rec in layers.items()
        if not ours[name].meta.same_graph(rec.meta)
    }
    assert differ == {}, "\n".join(f"{n}: {d}" for n, d in differ.items())


@pytest.mark.parametrize("name", SMALL + ("conv1",))
def test_meta_read_from_a_layer_is_fovis_graph(layers, name):
    """KNNMeta.from_layer reads what fovi computes with: fovi's own padded index tables."""
    rec = layers[name]
    fovi_meta = upstream.to_fovi_meta(rec.meta, rec.out_channels)
    own = upstream.fovi_arch().autograd.ensure_training_metadata(rec.layer, torch.device("cpu"))
    for field in ("cin", "cout", "nin", "nout", "k", "v", "p", "p64", "q"):
        assert getattr(fovi_meta, field) == getattr(own, field), field
    for field in ("input_linear", "weight_linear", "rev_rowptr", "rev_col"):
        assert torch.equal(getattr(fovi_meta, field), getattr(own, field)), field
    p = rec.meta.in_channels * rec.meta.k
    assert torch.equal(own.input_linear[:, :p].long(), rec.meta.input_linear)
    assert bool((own.input_linear[:, p:] == rec.meta.in_channels * rec.meta.n_in).all())


@pytest.mark.parametrize("name", SMALL)
def test_a_layer_built_from_a_meta_runs_exactly_as_fovis_own(layers, name):
    rec = layers[name]
    stand_in = upstream.fovi_layer_from_meta(rec.meta, rec.out_channels)
    x, w, b, gy = _operands(rec, F32)
    for backend in upstream.fovi_backends("cpu"):
        if backend == "gather_gemm" and rec.meta.k != 1:
            continue
        own = upstream.fovi_forward_and_grads(backend, x, w, b, gy, layer=rec.layer)
        built = upstream.fovi_forward_and_grads(backend, x, w, b, gy, layer=stand_in)
        for a, c in zip(own, built, strict=True):
            assert torch.equal(a, c), backend


# ----------------------------------------------------------------- fovi against the oracle
@pytest.mark.parametrize("name", SMALL)
def test_every_fovi_backend_matches_the_oracle_on_fovis_layers(layers, name):
    """The layer path, as users run it: y and the three gradients in four dtypes.

    float64: 1e-13 of scale, except the gradients fovi accumulates in float32 (documented), which
    carry float32 rounding: between 1e-9 and 1e-5. float32: 1e-5. float16/bfloat16: no more than
    twice fovi's own baseline's error in that dtype plus one rounding, and at most 8 roundings.
    """
    rec = layers[name]
    float32_grads = {
        "torch_compact": ("grad_x", "grad_weight", "grad_bias"),
        "gather_gemm": ("grad_weight", "grad_bias"),
    }
    for dtype in (F64, F32, F16, BF16):
        x, w, b, gy = _operands(rec, dtype)
        expected = _oracle(x, w, b, gy, rec.meta)
        run = upstream.fovi_forward_and_grads
        baseline = run("baseline", x, w, b, gy, layer=rec.layer)
        for backend in upstream.fovi_backends("cpu") + ["torch_cached"]:
            if backend == "gather_gemm" and rec.meta.k != 1:
                continue
            grad_y = None if backend == "torch_cached" else gy
            got = run(backend, x, w, b, grad_y, layer=rec.layer)
            for quantity, value, ref, base in zip(QUANTITIES, got, expected, baseline, strict=True):
                if value is None:
                    continue
                err, where = relative_error(value, ref), f"{backend} {dtype} {quantity}"
                assert value.dtype == dtype, where
                if dtype == F64 and quantity in float32_grads.get(backend, ()):
                    assert 1e-9 < err < 1e-5, f"{where}: {err:.1e} (float32 accumulation)"
                elif dtype == F64:
                    assert err < 1e-13, f"{where}: {err:.1e}"
                elif dtype == F32:
                    assert err < 1e-5, f"{where}: {err:.1e}"
                else:
                    u = UNIT_ROUNDOFF[dtype]
                    bound = min(2 * relative_error(base, ref) + u, 8 * u)
                    assert err <= bound, f"{where}: {err:.1e} > {bound:.1e}"


def test_verify_fovi_judges_by_the_elementwise_rule_and_says_which_side_fails(layers):
    """On a K = 1 layer: the float64 gradients fovi accumulates in float32 fail (and pass the
    float32 rule), the 16-bit outputs that round W x before adding the bias fail (and pass the
    two-rounding rule); fovi's baseline passes everything; every failure is diagnosed."""
    checks = upstream.verify_fovi({n: layers[n] for n in ("layer4.0.downsample.0",)})
    failed = {(c.backend, c.dtype, c.quantity) for c in checks if not c.verdict.ok}
    assert {(b, q) for b, d, q in failed if d == F64} == {
        ("torch_compact", "grad_x"),
        ("torch_compact", "grad_weight"),
        ("torch_compact", "grad_bias"),
        ("gather_gemm", "grad_weight"),
        ("gather_gemm", "grad_bias"),
    }
    assert not [f for f in failed if f[0] == "baseline" or f[1] == F32]
    assert all(c.side == "fovi" for c in checks if not c.verdict.ok)
    assert all("float32" in c.reason for c in checks if not c.verdict.ok and c.dtype == F64)
    assert {c.dispatch for c in checks} == {"baseline"}  # CPU with gradients
    assert {c.route for c in checks} == {"gather_gemm"}
    table = upstream.format_fovi_table(checks)
    assert "torch_cached" in table and "float64 gradient accumulated in float32" in table
    assert "reproducer: scripts/fovi_findings/f64_grads_torch_compact.py" in table
    assert "reproducer: scripts/fovi_findings/f64_grad_weight_gather_gemm.py" in table
    assert "reproducer: scripts/fovi_findings/f64_grad_bias.py" in table
    assert max(len(line) for line in table.splitlines()) <= 100
    record = upstream.fovi_record(checks)
    assert record["failed"] == len({(b, d) for b, d, _ in failed})
    assert {f["side"] for f in record["findings"]} == {"fovi"}


def test_verify_fovi_cli_exits_2_without_fovi(tmp_path):
    """Without fovi importable, ``verify --fovi`` exits 2 and names the install command."""
    code = (
        "import sys; sys.modules['fovi'] = None\n"
        "from fovi_ref.check.cli import main\n"
        f"sys.exit(main(['verify', '--fovi', '--out', {str(tmp_path)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "pip install --no-deps -r scripts/fovi-requirements.txt" in done.stderr


# ----------------------------------------------------------- fovi's three depths, and its dtypes
@pytest.mark.parametrize("backend", ["torch_compact", "gather_gemm"])
def test_layer_function_and_direct_paths_agree(layers, backend):
    rec = layers["layer3.0.downsample.0"]  # K = V = 1, no padding: every backend runs
    x, w, b, gy = _operands(rec, F32)
    by_path = {
        path: upstream.fovi_forward_and_grads(backend, x, w, b, gy, layer=rec.layer, path=path)
        for path in upstream.PATHS
    }
    for i in range(3):  # y, grad_x, grad_weight (direct has no grad_bias)
        assert torch.equal(by_path["layer"][i], by_path["function"][i])
        assert torch.equal(by_path["function"][i], by_path["direct"][i].to(F32))
    assert torch.equal(by_path["layer"][3], by_path["function"][3])


def test_fovi_gradients_under_float64_are_float32_numbers(layers):
    """Discrepancy 2: torch_compact's grad_x and grad_weight, gather_gemm's grad_weight and
    KNNConvFunction's grad_bias are float32 sums: direct calls return float32, and through
    fovi's autograd function the float64 results hold float32 values."""
    rec = layers["layer3.0.downsample.0"]
    x, w, b, gy = _operands(rec, F64)

    def float32_valued(t):
        return torch.equal(t.float().double(), t)

    run = upstream.fovi_forward_and_grads
    _, gx, gw, _ = run("torch_compact", x, w, b, gy, layer=rec.layer, path="direct")
    assert gx.dtype == gw.dtype == F32
    _, _, gw, _ = run("gather_gemm", x, w, b, gy, layer=rec.layer, path="direct")
    assert gw.dtype == F32
    _, gx, gw, gb = run("gather_gemm", x, w, b, gy, layer=rec.layer, path="function")
    assert gw.dtype == F64 and float32_valued(gw) and float32_valued(gb)
    assert not float32_valued(gx)  # gather_gemm's grad_input is a float64 GEMM
    _, gx, gw, gb = run("torch_compact", x, w, b, gy, layer=rec.layer)
    assert all(float32_valued(t) for t in (gx, gw, gb))
    _, gx, gw, gb = run("baseline", x, w, b, gy, layer=rec.layer)
    assert not any(float32_valued(t) for t in (gx, gw, gb))


def test_fovi_layer_zeroes_all_padding_outputs_and_its_ops_do_not():
    """Discrepancy 1: a node whose neighbours are all padding outputs 0 from fovi's layer (and
    passes the bias no gradient), but ``bias`` from fovi's ops, as the formula says."""
    base = random_meta(3, 4)
    knn = base.knn.clone()
    knn[:, 5] = base.n_in  # node 5: every neighbour is padding
    meta = KNNMeta.from_knn(knn, base.rf_index, n_in=base.n_in, in_channels=3, v=4)
    x, w, b = (t.detach() for t in sample_inputs(meta))
    gy = _grad_y(meta, 4, F64)
    y_ref, _, _, gb_ref = _oracle(x, w, b, gy, meta)
    assert torch.equal(y_ref[:, :, 5], b.expand(2, 4))
    for backend in ("baseline", "torch_scatter", "torch_compact"):
        y, _, _, gb = upstream.fovi_forward_and_grads(backend, x, w, b, gy, meta=meta)
        assert bool((y[:, :, 5] == 0).all()), backend
        assert relative_error(gb, gb_ref - gy[:, :, 5].sum(0)) < 1e-6, backend
        others = [n for n in range(meta.n_out) if n != 5]
        assert relative_error(y[:, :, others], y_ref[:, :, others]) < 1e-13
    ops_y = upstream.fovi_forward_and_grads("torch_compact", x, w, b, gy, meta=meta, path="direct")
    assert relative_error(ops_y[0], y_ref) < 1e-13
    assert upstream.FoviOps("torch_compact", "layer").all_padding == "zero"
    assert upstream.FoviOps("torch_compact", "direct").all_padding == "bias"


def test_fovi_inference_cache_goes_stale_after_fovis_own_weight_loading(layers):
    """Discrepancy 3: on CPU the stem runs ``torch_cached`` without gradients; after
    ``load_conv2d_weights`` (which writes through ``weight.data``) it keeps the old weight."""
    layer = copy.deepcopy(layers["conv1"].layer).float()
    assert upstream.fovi_dispatch(layer, batch=1, dtype=F32, grad=False) == "torch_cached"
    x = torch.randn(1, 3, 5977)
    with upstream.fovi_backend(None), torch.no_grad():
        before = layer(x)
        layer.load_conv2d_weights(torch.nn.Conv2d(3, 64, 7, bias=False))
        after = layer(x)
    assert layer._last_knn_backend == "torch_cached"
    assert torch.equal(after, before)  # stale
    with upstream.fovi_backend(None):
        fresh = layer(x)  # gradients on: baseline, with the loaded weight
    assert layer._last_knn_backend == "baseline"
    assert relative_error(after, fresh) > 0.1
    with upstream.fovi_backend(None), torch.no_grad():
        layer.weight.mul_(1)  # an in-place write on the parameter itself bumps its version
        assert relative_error(layer(x), fresh) < 1e-5


def test_gather_gemm_padding_reads_input_node_0():
    """Discrepancy 5: fovi's gather_gemm reads input node 0 for a padding neighbour and
    multiplies by 0, so a non-finite value there (read by nobody) makes the padded outputs NaN
    (the layer then zeroes them: they are all-padding) and the whole weight gradient NaN."""
    g = torch.Generator().manual_seed(0)
    n_in, n_out = 12, 8
    knn = torch.randint(1, n_in, (1, n_out), generator=g)  # node 0 is never read
    knn[0, 2] = n_in  # one padding neighbour
    meta = KNNMeta.from_knn(
        knn, torch.zeros(n_out, 1, dtype=torch.long), n_in=n_in, in_channels=3, v=1
    )
    x, w, b = (t.detach() for t in sample_inputs(meta))
    x[:, :, 0] = float("inf")
    gy = _grad_y(meta, 4, F64)
    expected = _oracle(x, w, b, gy, meta)
    assert all(bool(t.isfinite().all()) for t in expected)
    direct = upstream.fovi_forward_and_grads("gather_gemm", x, w, b, gy, meta=meta, path="direct")
    assert bool(direct[0][:, :, 2].isnan().all())
    assert bool(direct[0][:, :, [n for n in range(n_out) if n != 2]].isfinite().all())
    layer = upstream.fovi_forward_and_grads("gather_gemm", x, w, b, gy, meta=meta)
    assert bool((layer[0][:, :, 2] == 0).all()) and bool(layer[2].isnan().all())
    compact = upstream.fovi_forward_and_grads("torch_compact", x, w, b, gy, meta=meta)
    assert all(bool(t.isfinite().all()) for t in compact)


def test_einsum_baseline_is_fovis_baseline_bit_for_bit(layers):
    """fovi_ref's einsum_baseline against fovi 2.4.0's own baseline on all 20 layers, float64:
    the forward with and without a bias, with and without operands that require grad, and the
    gradients of x and weight. fovi 2.4.0 makes the cell features contiguous before F.linear,
    whose GEMM path otherwise depends on strides and on which operands require grad."""
    differ = []
    for name, rec in layers.items():
        x, w, b = (t.detach() for t in sample_inputs(rec.meta, out_channels=rec.out_channels))
        gy = _grad_y(rec.meta, rec.out_channels, F64)
        for bias in (None, b):
            fovi_y = upstream.fovi_forward_and_grads("baseline", x, w, bias, None, layer=rec.layer)[
                0
            ]
            if not torch.equal(knn_conv(x, w, bias, rec.meta, backend="einsum_baseline"), fovi_y):
                differ.append(f"{name} y, bias={bias is not None}, no grad")
        fovi = upstream.fovi_forward_and_grads("baseline", x, w, None, gy, layer=rec.layer)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = knn_conv(xr, wr, None, rec.meta, backend="einsum_baseline")
        ours = (y, *torch.autograd.grad(y, (xr, wr), gy))
        for quantity, a, c in zip(("y", "grad_x", "grad_weight"), ours, fovi, strict=False):
            if not torch.equal(a, c):
                differ.append(f"{name} {quantity}")
    assert differ == []


def test_fovi_backends_return_different_layouts(layers):
    """Discrepancy 4: same values, different strides, so downstream rounding may differ."""
    rec = layers["layer3.0.downsample.0"]
    x, w, b, _ = _operands(rec, F32)
    strides = {
        backend: upstream.fovi_forward_and_grads(backend, x, w, b, None, layer=rec.layer)[
            0
        ].stride()
        for backend in ("baseline", "torch_scatter", "torch_compact", "gather_gemm")
    }
    c_out, n_out = rec.out_channels, rec.meta.n_out
    transposed, contiguous = (n_out * c_out, 1, c_out), (c_out * n_out, n_out, 1)
    assert strides == {
        "baseline": transposed,
        "torch_scatter": transposed,
        "torch_compact": contiguous,
        "gather_gemm": contiguous,
    }


# ---------------------------------------------------------------------------- the dispatcher
def test_fovi_dispatcher_on_cpu(layers):
    """Discrepancy 6: on CPU, with gradients, fovi runs baseline everywhere (the K = V = 1 rule
    that fovi_ref's route follows applies on CUDA only); without gradients the stem (Cin = 3)
    takes the inference-only torch_cached."""
    rows = upstream.dispatch_table(layers, devices=["cpu"], batches=(1, 64))
    assert len(rows) == 20 * 4 * 2 * 2
    assert {r.fovi for r in rows if r.grad} == {"baseline"}
    no_grad = {(r.layer, r.fovi) for r in rows if not r.grad}
    assert {layer for layer, fovi in no_grad if fovi != "baseline"} == {"conv1"}
    assert {fovi for layer, fovi in no_grad if layer == "conv1"} == {"torch_cached"}
    assert {r.layer for r in rows if r.fovi_ref == "gather_gemm"} == {
        n for n in layers if "downsample" in n
    }
    assert all(r.fovi_ref == route(layers[r.layer].meta) for r in rows)


def test_fovi_override_beats_the_layer_and_can_break_a_model(layers):
    k9, k1 = layers["layer3.0.conv1"].layer, layers["layer3.0.downsample.0"].layer
    assert upstream.fovi_dispatch(k1, batch=2, dtype=F32, override="torch_compact") == (
        "torch_compact"
    )
    assert upstream.fovi_dispatch(k1, batch=2, dtype=F32, override="gather_gemm") == "gather_gemm"
    with pytest.raises(RuntimeError, match="K=1, V=1"):
        upstream.fovi_dispatch(k9, batch=2, dtype=F32, override="gather_gemm")
    with pytest.raises(RuntimeError, match="CUDA"):
        upstream.fovi_dispatch(k9, batch=2, dtype=F16, override="cuda")
    # An inference-only backend requested under autograd falls back to baseline.
    assert upstream.fovi_dispatch(k9, batch=2, dtype=F32, override="torch_cached") == "baseline"
    assert upstream.fovi_dispatch(k9, batch=2, dtype=F32, grad=False, override="torch_cached") == (
        "torch_cached"
    )
    before = os.environ.get(upstream.BACKEND_ENV)
    with upstream.fovi_backend("torch_scatter"):
        assert os.environ[upstream.BACKEND_ENV] == "torch_scatter"
    assert os.environ.get(upstream.BACKEND_ENV) == before


@CUDA
def test_fovi_dispatcher_on_cuda(layers):
    k1, stem = layers["layer3.0.downsample.0"].layer, layers["conv1"].layer
    assert upstream.fovi_dispatch(k1, batch=2, dtype=F32, device="cuda") == "gather_gemm"
    assert upstream.fovi_dispatch(stem, batch=2, dtype=F32, device="cuda") == "baseline"
    # Work volume B*Cin*K*Nout = 64*3*49*1469 is above fovi's 1e7 threshold.
    assert upstream.fovi_dispatch(stem, batch=64, dtype=F32, device="cuda") == "torch_compact"


# ----------------------------------------------------------------- fovi's ops in fovi_ref's form
def test_fovi_ops_run_under_fovi_refs_custom_op():
    meta = random_meta(3, 4)
    x, w, b = sample_inputs(meta)
    gy = _grad_y(meta, 4, F64)
    expected = _oracle(x, w, b, gy, meta)
    for path in ("direct", "function"):
        ops = upstream.FoviOps("torch_compact", path)
        register_ops(ops)
        try:
            assert ops.name in available_ops()
            y = knn_conv(x, w, b, meta, backend=ops.name)
            assert relative_error(y, expected[0]) < 1e-13
            if path == "direct":
                # Called directly, torch_compact hands back float32 gradients for float64
                # operands; the harness's policing refuses them, naming the backend.
                y = knn_conv(x, w, b, meta, backend=policed(ops))
                with pytest.raises(TypeError, match=f"{ops.name}' returned .* torch.float32"):
                    torch.autograd.grad(y, (x, w, b), gy)
                continue
            got = (y, *torch.autograd.grad(y, (x, w, b), gy))
        finally:
            unregister_ops(ops.name)
        for value, ref in zip(got[1:3], expected[1:3], strict=True):
            assert 1e-10 < relative_error(value, ref) < 1e-5  # float32 accumulation
        assert relative_error(got[3], expected[3]) < 1e-13  # fovi_ref's op sums grad_bias
    layer_ops = upstream.FoviOps("baseline")
    assert relative_error(layer_ops.grad_input(meta, gy, w.detach()), expected[1]) < 1e-13
    assert relative_error(layer_ops.grad_weight(meta, gy, x.detach()), expected[2]) < 1e-13
    gather = upstream.FoviOps("gather_gemm", "direct")
    assert gather.supports(random_meta(1, 1)) and not gather.supports(meta)
    with pytest.raises(ValueError, match="only with path='layer'"):
        upstream.FoviOps("torch_scatter", "direct")
    with pytest.raises(ValueError, match="inference-only"):
        upstream.FoviOps("torch_cached")


def test_check_fovi_ops_goes_through_check_ops():
    report = upstream.check_fovi_ops("torch_compact", path="direct", dtypes=(F32,))
    assert report.ops_name == "fovi_torch_compact_direct" and report.rows


@pytest.fixture(scope="module")
def comparison(model64):
    """One forward and backward of fovi's resnet18 (float64, batch 2) through fovi's baseline
    and with every conv swapped to fovi_ref's einsum_baseline."""
    (x, target), *_ = upstream.random_batches(model64, 1)
    return upstream.compare_model(model64, x, target)


def test_whole_network_through_fovi_ref_is_close_to_fovi(comparison):
    assert len(comparison.layer_errors) == 20 and len(comparison.grad_errors) == 62
    assert comparison.logits_error < 1e-12
    assert max(comparison.layer_errors.values()) < 1e-12
    assert max(comparison.grad_errors.values()) < 1e-10


def test_whole_network_through_fovi_ref_is_bit_identical_to_fovi(model64, comparison):
    """The strong form: logits, every parameter gradient and 20 SGD steps' losses identical.

    Needs knn_conv to hand back fovi's output layout (a transposed view of [B, Nout, Cout]) and
    einsum_baseline to feed F.linear the contiguous features fovi 2.4.0 feeds it.
    """
    assert comparison.identical, comparison.summary()
    training = upstream.compare_training(model64, upstream.random_batches(model64, 20))
    assert training.identical, f"max loss difference {training.max_difference:.1e}"


# ---------------------------------------------------------------------------------- timing
def test_fovi_contenders_run_forward_and_backward(layers):
    rec = layers["layer3.0.downsample.0"]
    inputs = make_inputs(rec.meta, rec.out_channels, batch=2, dtype=F32)
    contenders = upstream.fovi_contenders(inputs)
    assert list(contenders) == [
        "fovi auto (baseline)",
        "fovi baseline",
        "fovi torch_scatter",
        "fovi torch_compact",
        "fovi gather_gemm",
    ]
    results = {name: run() for name, run in contenders.items()}
    reference = results["fovi baseline"]
    for grads in results.values():
        assert len(grads) == 3
        for g, r in zip(grads, reference, strict=True):
            assert relative_error(g, r) < 1e-5
    times = time_contenders(contenders, repeats=1, warmup=0)
    assert set(times) == set(contenders)
    with upstream.fovi_backend("baseline"), pytest.raises(RuntimeError, match="override"):
        upstream.fovi_contenders(inputs)


# --------------------------------------------------------------- graphs depend on the machine
@pytest.fixture(scope="module")
def finding():
    return upstream.machine_finding("as is", "MKL SSE4.2")


@pytest.mark.sets_its_own_arithmetic
def test_fovis_graphs_built_under_another_arithmetic_differ_only_on_ties(finding):
    assert finding.flips_outside_ties == 0
    assert set(finding.flips) == set(finding.ties)  # 20 convolutions and the two pools
    for name, nodes in finding.flips.items():
        assert len(nodes) <= finding.ties[name], name
    a, b = finding.runs
    assert len(a.losses) == len(b.losses) == 3
    if finding.n_flips == 0:  # an arithmetic setting this machine ignores: nothing may differ
        assert finding.output_difference == 0 and a.losses == b.losses
    else:  # the same weights on another graph: a different network
        assert finding.output_difference > 1e-6
    summary = finding.summary()
    assert f"{finding.n_flips} nodes" in summary and "not ties" in summary
    assert "scripts/fovi_findings/graphs_depend_on_machine.py" in summary
    record = upstream.finding_record(finding)
    assert record["flips_outside_ties"] == 0 and record["settings"] == ["as is", "MKL SSE4.2"]


def test_machine_finding_refuses_an_unknown_setting():
    with pytest.raises(KeyError, match="known: as is"):
        upstream.machine_finding("as is", "nonsense")


def test_verify_fovi_reports_fovis_float16_overflow_where_the_answer_is_finite():
    """fovi 2.4.0's einsum paths store a cell's float16 sum (80000: inf) before the GEMM; the
    answer (800) is finite, and fovi_ref's ``general`` gives it."""
    finding = upstream.overflow_finding()
    assert {"baseline", "torch_scatter"} <= set(finding.overflowing)
    assert "fovi_ref general" not in finding.overflowing
    assert abs(finding.results["fovi_ref general"] - finding.exact) <= 2**-11 * finding.exact
    assert "inf where the answer is finite" in finding.summary()
    assert "reproducer: scripts/fovi_findings/f16_cell_sum_overflow.py" in finding.summary()
