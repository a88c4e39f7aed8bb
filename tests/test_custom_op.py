"""fovi_ref::knn_conv as a torch.library custom op: opcheck, torch.compile, torch.export,
determinism."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import DEVICES, random_meta, sample_inputs

from fovi_ref import KNNConv, available_ops, get_ops, knn_conv, knn_gather_gemm, route
from fovi_ref.knn_autograd import _KNOWN_METAS, _knn_conv_op, _meta_for
from fovi_ref.knn_gather_gemm import forced_grad_input_path
from fovi_ref.tolerances import judge

# The K=1 graph runs once with each grad_input path of gather_gemm (dense S and index).
GRAPHS = [(1, 1, "dense"), (1, 1, "index"), (9, 9, None)]
GRAPH_IDS = ["k1-dense_S", "k1-index", "k9"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("k,v,path", GRAPHS, ids=GRAPH_IDS)
def test_opcheck(k, v, path, bias, dtype, device):
    """Schema, fake tensor, autograd registration and AOT dispatch, checked by torch itself.
    The K=9 graph has padding and shared cells (see random_meta)."""
    meta = random_meta(k, v, device=device)
    assert meta.has_padding
    x, w, b = sample_inputs(meta, dtype=dtype, bias=bias)
    args = (x, w, b, meta.knn, meta.rf_index, meta.n_in, meta.v, route(meta))
    with forced_grad_input_path(path or "index", meta.device.type):
        torch.library.opcheck(_knn_conv_op, args)


def two_layer_model(device="cpu"):
    """One general layer (K=9 with padding and shared cells) feeding one gather_gemm layer."""
    torch.manual_seed(0)
    first = KNNConv(3, 8, random_meta(9, 9, n_in=40, n_out=30, in_channels=3, device=device))
    second = KNNConv(8, 5, random_meta(1, 1, n_in=30, n_out=12, in_channels=8, device=device))
    assert route(first.meta) == "general" and route(second.meta) == "gather_gemm"
    return torch.nn.Sequential(first, torch.nn.ReLU(), second).to(device)


def forward_and_grads(model, x):
    y = model(x)
    grads = torch.autograd.grad(y, [x, *model.parameters()], torch.ones_like(y))
    return [y, *grads]


def assert_float32_close(got, expected):
    for g, e in zip(got, expected, strict=True):
        verdict = judge(g, e.double())
        assert verdict.ok, verdict


@pytest.mark.parametrize("path", ["dense", "index"], ids=["dense_S", "index"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_matches_eager(dynamic, path):
    torch._dynamo.reset()
    model = two_layer_model()
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)  # fullgraph: no breaks
    with forced_grad_input_path(path):
        for batch in (4, 3) if dynamic else (4,):
            x = torch.randn(batch, 3, 40, requires_grad=True)
            assert_float32_close(forward_and_grads(compiled, x), forward_and_grads(model, x))
        # The dense scatter matrix of the gather_gemm layer is built once, then served from the
        # cache to compiled calls too.
        builds = knn_gather_gemm._scatter_cache.builds
        forward_and_grads(compiled, torch.randn(3, 3, 40, requires_grad=True))
        assert knn_gather_gemm._scatter_cache.builds == builds
        if path == "dense":
            assert any(
                entry[0]() is model[2].meta
                for entry in knn_gather_gemm._scatter_cache._entries.values()
            )


def test_export_runs_and_matches_eager():
    model = two_layer_model()
    x = torch.randn(4, 3, 40)
    program = torch.export.export(model, (x,))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "fovi_ref.knn_conv.default" in ops
    assert_float32_close([program.module()(x)], [model(x)])


def test_meta_is_recovered_from_copied_index_tensors():
    """An exported or compiled program may hand the op copies of the index tensors: the op
    finds the meta by content (so per-meta caches keep working) or builds a validated one."""

    meta = random_meta(1, 1)
    knn_conv(*sample_inputs(meta), meta)  # remembers meta
    found = _meta_for(meta.knn.clone(), meta.rf_index.clone(), meta.n_in, meta.in_channels, 1)
    assert found is meta
    other = random_meta(1, 1, seed=99)
    built = _meta_for(other.knn.clone(), other.rf_index.clone(), other.n_in, 3, 1)
    assert built.same_graph(other)
    bad = other.knn.clone()
    bad[0, 0] = other.n_in + 1
    with pytest.raises(ValueError, match="knn entries must lie in"):
        _meta_for(bad, other.rf_index, other.n_in, 3, 1)


@pytest.fixture
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", available_ops())
def test_deterministic_mode_bitwise_identical(backend, device, deterministic):
    k, v = (1, 1) if backend == "gather_gemm" else (9, 9)
    meta = random_meta(k, v, n_in=200, n_out=150, in_channels=16, device=device)
    assert get_ops(backend)
    runs = []
    for _ in range(2):
        x, w, b = sample_inputs(meta, out_channels=32, batch=8, dtype=torch.float32)
        y = knn_conv(x, w, b, meta, backend=backend)
        runs.append([y, *torch.autograd.grad(y, (x, w, b), torch.ones_like(y))])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_known_metas_hold_user_metas_weakly():

    meta = random_meta(4, 4, seed=123)
    knn_conv(*sample_inputs(meta), meta)
    ref = weakref.ref(meta)
    del meta
    gc.collect()
    assert ref() is None  # remembered for the op, but not kept alive by it
    assert len(_KNOWN_METAS) <= 64
