"""fovi_ref::knn_conv as a torch.library custom op: opcheck, torch.compile, torch.export,
derived data as program inputs, first-order gradients, determinism."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICES, random_meta, sample_inputs

from fovi_ref import (
    KNNConv,
    available_ops,
    derive_for,
    get_ops,
    knn_conv,
    prepare,
    register_ops,
    route,
    unregister_ops,
)
from fovi_ref.check.switches import forced_grad_input_path
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise
from fovi_ref.knn_autograd import _grad_input_op, _grad_weight_op, _knn_conv_op
from fovi_ref.knn_general import GeneralTextbookOps
from fovi_ref.layout import fovi_layout_empty, in_fovi_layout

# The K=1 graph runs once with each grad_input path of gather_gemm (dense S and index).
GRAPHS = [(1, 1, "dense"), (1, 1, "index"), (9, 9, None)]
GRAPH_IDS = ["k1-dense_S", "k1-index", "k9"]


def op_graph_args(meta, backend):
    derived = derive_for(meta, backend)
    return (meta.knn, meta.rf_index, list(derived.values()), ",".join(derived), meta.n_in, meta.v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("k,v,path", GRAPHS, ids=GRAPH_IDS)
def test_opcheck(k, v, path, bias, dtype, device):
    """Schema, fake tensor (shapes and strides), autograd registration and AOT dispatch, checked
    by torch itself, for the op and its two backward ops. The K=9 graph has padding and shared
    cells (see random_meta)."""
    meta = random_meta(k, v, device=device)
    assert meta.has_padding
    x, w, b = sample_inputs(meta, dtype=dtype, bias=bias)
    graph = (*op_graph_args(meta, route(meta)), route(meta))
    grad_y = torch.randn(x.shape[0], w.shape[0], meta.n_out, device=device, dtype=dtype)
    with forced_grad_input_path(path or "index", meta.device.type):
        torch.library.opcheck(_knn_conv_op, (x, w, b, *graph))
        torch.library.opcheck(_grad_input_op, (grad_y, w.detach(), *graph))
        torch.library.opcheck(_grad_weight_op, (grad_y, x.detach(), *graph))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("k,v", [(1, 1), (9, 9)], ids=["k1", "k9"])
def test_the_compiled_door_gives_each_input_asked_for_its_gradient(k, v, bias):
    """A frozen input (a first layer's image, a frozen weight or bias) gets no gradient, and
    every input that requires one gets the one it gets when all do: the backward rule reads
    which inputs need a gradient, position by position."""
    meta = random_meta(k, v)
    x, w, b = sample_inputs(meta, bias=bias)
    graph = (*op_graph_args(meta, route(meta)), route(meta))
    grad_y = torch.randn(x.shape[0], w.shape[0], meta.n_out, dtype=x.dtype)
    leaves = [x, w] if b is None else [x, w, b]
    everything = torch.autograd.grad(_knn_conv_op(x, w, b, *graph), leaves, grad_y)
    for asked in range(len(leaves)):
        inputs = [t.detach().requires_grad_(i == asked) for i, t in enumerate(leaves)]
        x_, w_, b_ = inputs if b is not None else [*inputs, None]
        (got,) = torch.autograd.grad(_knn_conv_op(x_, w_, b_, *graph), inputs[asked], grad_y)
        assert torch.equal(got, everything[asked]), asked


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


def count_derivations(monkeypatch) -> list[str]:
    """Record every call of a backend's ``derive`` from now on."""
    calls: list[str] = []
    for name in available_ops():
        ops = get_ops(name)
        original = ops.derive

        def spy(meta, original=original, name=name):
            calls.append(name)
            return original(meta)

        monkeypatch.setattr(ops, "derive", spy)
    return calls


@pytest.mark.parametrize("path", ["dense", "index"], ids=["dense_S", "index"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_matches_eager_and_derives_nothing(dynamic, path, monkeypatch):
    torch._dynamo.reset()
    model = two_layer_model()
    derivations = count_derivations(monkeypatch)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)  # fullgraph: no breaks
    with forced_grad_input_path(path):
        for batch in (4, 3, 5) if dynamic else (4, 4):
            x = torch.randn(batch, 3, 40, dtype=torch.float64, requires_grad=True)
            model.double()
            got, expected = forward_and_grads(compiled, x), forward_and_grads(model, x)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
            assert got[0].stride() == expected[0].stride()  # fovi's layout, as the fake says
    assert derivations == []  # the layers' derived buffers were used; nothing was rebuilt


def test_export_carries_derived_data_as_buffers_and_matches_eager(monkeypatch):
    model = two_layer_model()
    x = torch.randn(4, 3, 40)
    derivations = count_derivations(monkeypatch)
    program = torch.export.export(model, (x,))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "fovi_ref.knn_conv.default" in ops
    buffers = {spec.target for spec in program.graph_signature.input_specs if spec.target}
    assert {"0.derived_bin_first", "2.derived_index", "2.knn"} <= buffers
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)
    assert derivations == []


@pytest.mark.parametrize("door", ["fullgraph", "graph breaks allowed", "export"])
def test_compiling_an_unprepared_meta_says_what_to_do_first(door):
    """The first line of the error names the call that fixes it (Dynamo once reported its own
    "Observed exception" there, with two hints that did not apply, and ours in a debug line);
    with graph breaks allowed it is an error too, not a silent fall back to eager mode."""
    torch._dynamo.reset()
    meta = random_meta(4, 4, seed=5)
    x, w, b = (t.detach() for t in sample_inputs(meta, dtype=torch.float32))

    def run(x):
        return knn_conv(x, w, b, meta)

    class Run(torch.nn.Module):
        def forward(self, x):
            return run(x)

    with pytest.raises(RuntimeError) as err:
        if door == "export":
            torch.export.export(Run(), (x,))
        else:
            torch.compile(run, fullgraph=door == "fullgraph")(x)
    first = str(err.value).splitlines()[0]
    assert re.match(r"(RuntimeError: )?call fovi_ref\.prepare\(meta, 'general'\) ", first), first
    torch._dynamo.reset()
    prepare(meta)
    torch.testing.assert_close(torch.compile(run, fullgraph=True)(x), run(x))


def test_the_hint_costs_import_fovi_ref_nothing():
    """The function that raises the hint carries the mark ``torch.compiler.assume_constant_result``
    would give it (the decorator itself imports torch._dynamo: seconds on every import)."""
    from fovi_ref import meta as meta_module

    def marked():
        return None

    marks = set(vars(torch.compiler.assume_constant_result(marked)).items())
    assert marks and marks <= set(vars(meta_module._not_derived_while_compiling).items())
    code = "import sys, fovi_ref; print('torch._dynamo' in sys.modules)"
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=here)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_are_first_order_only(compiled):
    torch._dynamo.reset()
    meta = prepare(random_meta(4, 4))
    x, w, b = sample_inputs(meta)

    def run(x, w, b):
        return knn_conv(x, w, b, meta)

    fn = torch.compile(run, fullgraph=True) if compiled else run
    y = fn(x, w, b)
    (grad_x,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    # Compiled programs refuse double backward themselves (aot_autograd), in so many words.
    message = "does not currently support double backward" if compiled else "first-order only"
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(grad_x.sum(), w)


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
    runs = []
    for _ in range(2):
        x, w, b = sample_inputs(meta, out_channels=32, batch=8, dtype=torch.float32)
        y = knn_conv(x, w, b, meta, backend=backend)
        runs.append([y, *torch.autograd.grad(y, (x, w, b), torch.ones_like(y))])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_eager_and_op_doors_agree_bitwise():
    """The autograd.Function (eager) and the custom op (compiled) run the same backend code."""
    for k, v in ((1, 1), (9, 9)):
        meta = random_meta(k, v)
        x, w, b = sample_inputs(meta, dtype=torch.float32)
        graph = (*op_graph_args(meta, route(meta)), route(meta))
        eager = knn_conv(x, w, b, meta)
        via_op = _knn_conv_op(x, w, b, *graph)
        assert torch.equal(eager, via_op) and eager.stride() == via_op.stride()
        grad_y = torch.ones_like(eager)  # y is judged; the gradients' oracle is not used
        expected = expected_quantities(x, w, b, meta, grad_y)["y"]
        verdict = judge_elementwise(eager, expected)
        assert verdict.ok, str(verdict)


class ContiguousY(GeneralTextbookOps):
    """general_textbook with ``y`` contiguous ``[B, Cout, Nout]``, not fovi's layout."""

    name = "contiguous_y"

    @staticmethod
    def forward(meta, x, weight, bias):
        return GeneralTextbookOps.forward(meta, x, weight, bias).contiguous()  # [B, Cout, Nout]


class StridedGradients(GeneralTextbookOps):
    """general_textbook with both gradients strided: ``grad_x [B, Cin, Nin]`` on
    ``[B, Nin, Cin]`` storage, ``grad_w [Cout, Cin*V]`` on ``[Cin*V, Cout]`` storage."""

    name = "strided_gradients"

    @staticmethod
    def grad_input(meta, grad_y, weight):
        grad_x = GeneralTextbookOps.grad_input(meta, grad_y, weight)  # [B, Cin, Nin]
        return grad_x.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Cin, Nin]

    @staticmethod
    def grad_weight(meta, grad_y, x):
        grad_w = GeneralTextbookOps.grad_weight(meta, grad_y, x)  # [Cout, Cin*V]
        return grad_w.t().contiguous().t()  # [Cout, Cin*V]


@pytest.mark.parametrize("ops", [ContiguousY, StridedGradients], ids=lambda ops: ops.name)
def test_compiled_code_gets_the_layout_the_fake_promises_whatever_the_backend_returns(ops):
    """A backend may return any layout (the eager door keeps it); compiled code reads the op's
    results by the strides its fakes promise, pointwise ops fused before and after, so the op
    hands them over in that layout: the compiled forward and gradients equal the eager ones."""
    torch._dynamo.reset()
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    grad_y = torch.randn(x.shape[0], w.shape[0], meta.n_out, dtype=x.dtype)

    def run(x, w, b):
        return torch.relu(knn_conv(torch.sin(x), w * 2, b, meta, backend=ops.name)) * 2

    register_ops(ops)
    try:
        prepare(meta, ops.name)
        results = []
        for fn in (torch.compile(run, fullgraph=True), run):
            y = fn(x, w, b)
            results.append([y, *torch.autograd.grad(y, (x, w, b), grad_y)])
    finally:
        unregister_ops(ops.name)
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", available_ops())
def test_in_fovi_layout_copies_no_y_of_fovi_refs_own_backends(backend):
    """fovi_ref's backends return fovi's layout already: the compiled door copies none."""
    k, v = (1, 1) if backend == "gather_gemm" else (4, 4)
    meta = random_meta(k, v)
    x, w, b = (t.detach() for t in sample_inputs(meta))
    y = get_ops(backend).forward(meta, x, w, b)
    assert in_fovi_layout(y) is y


@pytest.mark.parametrize(
    "shape,copied", [((2, 4, 20), True), ((2, 1, 20), False), ((2, 4, 1), False)], ids=str
)
def test_in_fovi_layout_copies_only_a_y_whose_strides_differ(shape, copied):
    """A contiguous ``y [B, Cout, Nout]`` is copied into fovi's layout, unless the two differ
    only in a size-1 dim's stride (one channel, one node), which no kernel reads; one in fovi's
    layout is returned itself."""
    y = torch.randn(shape)  # [B, Cout, Nout], contiguous
    fovi = fovi_layout_empty(*shape, y).copy_(y)  # [B, Cout, Nout], fovi's layout
    assert in_fovi_layout(fovi) is fovi
    laid_out = in_fovi_layout(y)
    assert torch.equal(laid_out, y)
    assert (laid_out is not y) == copied
    assert laid_out.stride() == (fovi.stride() if copied else y.stride())
