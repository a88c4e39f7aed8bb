"""Registry, dispatcher and argument checks of knn_conv, and the backend protocol as the harness
checks it (fovi_ref.check.protocol: the op itself trusts its backends)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from conftest import random_meta, sample_inputs

import fovi_ref
from fovi_ref import (
    KNNConv,
    available_ops,
    get_ops,
    knn_conv,
    register_ops,
    route,
    route_layer,
    unregister_ops,
)
from fovi_ref.check.protocol import check_protocol, policed
from fovi_ref.knn_gather_gemm import GatherGemmOps


def test_builtin_backends_are_registered():
    assert available_ops() == ["einsum_baseline", "gather_gemm", "general", "general_textbook"]
    for name in available_ops():
        assert get_ops(name).name == name


class ScaledGeneral:
    """A valid custom backend: twice the general one."""

    name = "scaled_general"

    @staticmethod
    def forward(meta, x, weight, bias):
        return 2 * get_ops("general").forward(meta, x, weight, bias)

    @staticmethod
    def grad_input(meta, grad_y, weight):
        return 2 * get_ops("general").grad_input(meta, grad_y, weight)

    @staticmethod
    def grad_weight(meta, grad_y, x):
        return 2 * get_ops("general").grad_weight(meta, grad_y, x)


def test_register_use_and_unregister_a_backend():
    register_ops(ScaledGeneral)
    try:
        assert "scaled_general" in available_ops()
        meta = random_meta(4, 4)
        x, w, _ = sample_inputs(meta, bias=False)
        y = knn_conv(x, w, None, meta, backend="scaled_general")
        torch.testing.assert_close(y, 2 * knn_conv(x, w, None, meta, backend="general"))
        (grad_x,) = torch.autograd.grad(y.sum(), x)
        (expected,) = torch.autograd.grad(knn_conv(x, w, None, meta).sum(), x)
        torch.testing.assert_close(grad_x, 2 * expected)
        with pytest.raises(ValueError, match="already registered"):
            register_ops(ScaledGeneral)
    finally:
        unregister_ops("scaled_general")
    assert "scaled_general" not in available_ops()


@pytest.mark.parametrize(
    "ops,message",
    [
        (types.SimpleNamespace(), "non-empty str attribute 'name'"),
        (types.SimpleNamespace(name=""), "non-empty str attribute 'name'"),
        (
            types.SimpleNamespace(name="x", forward=lambda m, x, w, b: x),
            "grad_input must be callable",
        ),
        (
            types.SimpleNamespace(
                name="x",
                forward=lambda m, x: x,
                grad_input=lambda m, g, w: g,
                grad_weight=lambda m, g, x: g,
            ),
            "forward must accept",
        ),
        (
            types.SimpleNamespace(
                name="x",
                forward=lambda m, x, w, b: x,
                grad_input=lambda m, g, w: g,
                grad_weight=None,
            ),
            "grad_weight must be callable",
        ),
        (
            types.SimpleNamespace(
                name="x",
                forward=lambda m, x, w, b: x,
                grad_input=lambda m, g, w: g,
                grad_weight=lambda m, g, x: g,
                supports=True,
            ),
            "supports must be callable",
        ),
        (
            types.SimpleNamespace(
                name="x",
                forward=lambda m, x, w, b: x,
                grad_input=lambda m, g, w: g,
                grad_weight=lambda m, g, x: g,
                supports=lambda: True,
            ),
            "supports must accept",
        ),
        (
            types.SimpleNamespace(
                name="x",
                forward=lambda m, x, w, b: x,
                grad_input=lambda m, g, w: g,
                grad_weight=lambda m, g, x: g,
                derive=lambda: {},
            ),
            "derive must accept",
        ),
        (
            types.SimpleNamespace(
                name="x",
                forward=lambda m, x, w, b: x,
                grad_input=lambda m, g, w: g,
                grad_weight=lambda m, g, x: g,
                grad_y_layout=lambda: None,
            ),
            "grad_y_layout must accept",
        ),
    ],
)
def test_check_protocol_rejects_incomplete_ops(ops, message):
    with pytest.raises(TypeError, match=message):
        check_protocol(ops)


def test_unknown_backend_names():
    with pytest.raises(ValueError, match="unknown backend 'nope'; available"):
        get_ops("nope")
    with pytest.raises(ValueError, match="no ops backend named 'nope'"):
        unregister_ops("nope")
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        knn_conv(x, w, b, meta, backend="nope")
    with pytest.raises(TypeError, match="backend must be a str"):
        knn_conv(x, w, b, meta, backend=3)


@pytest.mark.parametrize(
    "k,v,expected", [(1, 1, "gather_gemm"), (1, 4, "general"), (4, 1, "general"), (9, 9, "general")]
)
def test_route_and_route_layer_agree(k, v, expected):
    meta = random_meta(k, v)
    assert route(meta) == expected
    assert route_layer(KNNConv(3, 4, meta)) == expected
    fovi_layer = types.SimpleNamespace(_k=k, local_rf=torch.zeros(meta.n_out, k, v))
    assert route_layer(fovi_layer) == expected


def test_route_rejects_what_is_not_a_graph():
    with pytest.raises(TypeError, match="meta must be a fovi_ref.KNNMeta, got NoneType"):
        route(None)
    with pytest.raises(TypeError, match="route_layer needs a KNN conv layer"):
        route_layer(object())


def test_a_backend_returning_the_wrong_shape_or_dtype_is_named():
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    general = get_ops("general")
    bad = [
        ("forward", lambda m, x, w, b: general.forward(m, x, w, b)[:, :, :-1], "from forward"),
        ("forward", lambda m, x, w, b: general.forward(m, x, w, b).float(), "from forward"),
        ("grad_input", lambda m, g, w: general.grad_input(m, g, w)[:1], "from grad_input"),
        ("grad_weight", lambda m, g, x: general.grad_weight(m, g, x).t(), "from grad_weight"),
    ]
    for method, fn, message in bad:
        ops = types.SimpleNamespace(
            name="broken",
            forward=general.forward,
            grad_input=general.grad_input,
            grad_weight=general.grad_weight,
        )
        setattr(ops, method, fn)
        with pytest.raises(TypeError, match=f"backend 'broken' returned .* {message}"):
            y = knn_conv(x, w, b, meta, backend=policed(ops))
            torch.autograd.grad(y, (x, w), torch.ones_like(y))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grad_y_layout_runs_once_and_both_gradients_read_its_result(compiled):
    """The backward lays grad_y out once (the backend's grad_y_layout) and hands that tensor to
    grad_input, grad_weight and the bias sum; the gradients equal those without the hook."""
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    grad_y = torch.randn(2, w.shape[0], meta.n_out, dtype=x.dtype)
    general = get_ops("general")
    calls, seen = [], []

    def unusual(g):  # a layout nobody else uses
        return g.permute(2, 1, 0).contiguous().permute(2, 1, 0)

    def lay_out(g):
        calls.append(tuple(g.shape))
        return unusual(g)

    def grad_input(m, g, w):
        seen.append(("grad_input", g.stride()))
        return general.grad_input(m, g, w)

    def grad_weight(m, g, x):
        seen.append(("grad_weight", g.stride()))
        return general.grad_weight(m, g, x)

    ops = types.SimpleNamespace(
        name="laid_out",
        derive=general.derive,
        forward=general.forward,
        grad_input=grad_input,
        grad_weight=grad_weight,
        grad_y_layout=lay_out,
    )
    register_ops(ops)
    try:
        fovi_ref.prepare(meta, "laid_out")
        fn = lambda x, w, b: knn_conv(x, w, b, meta, backend="laid_out")  # noqa: E731
        y = (torch.compile(fn, fullgraph=True) if compiled else fn)(x, w, b)
        got = torch.autograd.grad(y, (x, w, b), grad_y)
    finally:
        unregister_ops("laid_out")
    if not compiled:  # compiled, they run only while tracing, which a warm compile cache skips
        strides = unusual(grad_y).stride()
        assert calls == [tuple(grad_y.shape)]
        assert seen == [("grad_input", strides), ("grad_weight", strides)]
    y_ref = knn_conv(x, w, b, meta, backend="general")
    expected = torch.autograd.grad(y_ref, (x, w, b), grad_y)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_the_operand_pair_comes_whole_and_returns_a_pair():
    general = get_ops("general")
    half = types.SimpleNamespace(
        name="half_pair",
        forward=general.forward,
        grad_input=general.grad_input,
        grad_weight=general.grad_weight,
        forward_with_operand=lambda meta, x, weight, bias: (
            general.forward(meta, x, weight, bias),
            x,
        ),
    )
    with pytest.raises(TypeError, match="come as a pair"):
        check_protocol(half)
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    half.name = "not_a_pair"
    half.forward_with_operand = lambda meta, x, weight, bias: general.forward(meta, x, weight, bias)
    half.grad_weight_of_operand = lambda meta, grad_y, operand: general.grad_weight(
        meta, grad_y, operand
    )
    with pytest.raises(TypeError, match="'not_a_pair': forward_with_operand must return"):
        knn_conv(x, w, b, meta, backend=policed(half))


def test_grad_y_layout_must_keep_shape_and_dtype():
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    general = get_ops("general")
    ops = types.SimpleNamespace(
        name="bad_layout",
        forward=general.forward,
        grad_input=general.grad_input,
        grad_weight=general.grad_weight,
        grad_y_layout=lambda g: g[:1],
    )
    y = knn_conv(x, w, b, meta, backend=policed(ops))
    with pytest.raises(TypeError, match="backend 'bad_layout' returned .* from grad_y_layout"):
        torch.autograd.grad(y, (x, w), torch.ones_like(y))


def test_knn_conv_runs_an_unregistered_ops_object_in_eager_mode():
    """``backend=`` takes an ops object (how check_ops runs what it judges); compiled code
    needs a registered name."""
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    y = knn_conv(x, w, b, meta, backend=policed(get_ops("general")))
    torch.testing.assert_close(y, knn_conv(x, w, b, meta, backend="general"), rtol=0, atol=0)


def test_dispatcher_uses_the_routed_backend(monkeypatch):
    calls = []
    for name in ("general", "gather_gemm"):
        ops = get_ops(name)
        # (the eager door runs forward_with_operand when the weight needs a gradient)
        for method in ("forward", "forward_with_operand"):
            original = getattr(ops, method)

            def spy(meta, x, weight, bias, original=original, name=name):
                calls.append(name)
                return original(meta, x, weight, bias)

            monkeypatch.setattr(ops, method, staticmethod(spy))
    for k, v in ((1, 1), (9, 9)):
        meta = random_meta(k, v)
        knn_conv(*sample_inputs(meta), meta)
    assert calls == ["gather_gemm", "general"]


def test_gather_gemm_refuses_other_graphs():
    meta = random_meta(9, 9)
    with pytest.raises(ValueError, match="'gather_gemm' does not support this meta .K=9, V=9."):
        knn_conv(*sample_inputs(meta), meta, backend="gather_gemm")

    with pytest.raises(ValueError, match="K == 1 and V == 1"):
        GatherGemmOps.forward(random_meta(1, 4), *sample_inputs(random_meta(1, 4)))


def bad_calls():
    """(description, mutate(x, w, b, meta) -> args, error, message)."""
    meta = random_meta(4, 4)  # Cin=3, Nin=30, V=4
    x, w, b = sample_inputs(meta)
    d = x.detach()
    return [
        ("x not a tensor", (d.tolist(), w, b, meta), TypeError, "x must be a torch.Tensor"),
        ("x integer", (d.long(), w, b, meta), TypeError, "x must be float16, bfloat16"),
        ("x 2-D", (d[0], w, b, meta), ValueError, r"x must be \[B, Cin=3, Nin=30\].*\(3, 30\)"),
        ("x wrong Cin", (d[:, :2], w, b, meta), ValueError, r"got \(2, 2, 30\)"),
        ("x wrong Nin", (d[:, :, :29], w, b, meta), ValueError, r"got \(2, 3, 29\)"),
        (
            "weight columns",
            (x, w[:, :-1], b, meta),
            ValueError,
            r"Cin\*V = 3\*4 = 12\], got \(4, 11\)",
        ),
        ("weight 1-D", (x, w[0], b, meta), ValueError, "weight must be"),
        ("bias size", (x, w, b[:-1], meta), ValueError, r"bias must be \[Cout = 4\], got \(3,\)"),
        ("bias type", (x, w, 1.0, meta), TypeError, "bias must be a torch.Tensor or None"),
        ("weight dtype", (x, w.float(), b, meta), TypeError, "weight dtype torch.float32 differs"),
        ("bias dtype", (x, w, b.half(), meta), TypeError, "bias dtype torch.float16 differs"),
        ("meta type", (x, w, b, "meta"), TypeError, "meta must be a fovi_ref.KNNMeta"),
        ("x on meta", (d.to("meta"), w, b, meta), ValueError, "x is on the 'meta' device"),
        ("x nested", (nested(d), w, b, meta), TypeError, "x must be a dense .* nested tensor"),
        ("x jagged", (nested(d, torch.jagged), w, b, meta), TypeError, "x must be a dense"),
        ("weight nested", (d, nested(w.detach()), b, meta), TypeError, "weight must be a dense"),
        ("weight sparse", (d, w.detach().to_sparse(), b, meta), TypeError, "weight must be a"),
    ]


def nested(t: torch.Tensor, layout=torch.strided) -> torch.Tensor:
    with warnings.catch_warnings():  # the strided layout is "in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(list(t), layout=layout)


@pytest.mark.parametrize("case", bad_calls(), ids=lambda c: c[0])
def test_knn_conv_rejects_bad_arguments(case):
    _, args, error, message = case
    with pytest.raises(error, match=message):
        knn_conv(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mismatch_is_reported():
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    with pytest.raises(ValueError, match="weight is on cuda"):
        knn_conv(x, w.cuda(), b, meta)
    with pytest.raises(ValueError, match=r"meta is on cpu but x is on cuda.*meta.to"):
        knn_conv(x.cuda(), w.cuda(), b.cuda(), meta)


def test_device_mismatch_is_reported_without_a_gpu():
    """The same check, with the meta on the 'meta' device standing in for a second device."""
    meta = random_meta(4, 4)
    x, w, b = sample_inputs(meta)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        knn_conv(x, w.to("meta"), b, meta)


def test_public_api_names():
    for name in (
        "KNNMeta",
        "KNNConv",
        "knn_conv",
        "register_ops",
        "get_ops",
        "available_ops",
        "route",
        "route_layer",
    ):
        assert hasattr(fovi_ref, name)


def test_bad_operands_are_named_before_any_kernel_runs():
    meta = random_meta(1, 1)
    x, w, b = sample_inputs(meta)
    with pytest.raises(ValueError, match=r"weight must be \[Cout >= 1"):
        knn_conv(x, w[:0], None, meta)
    with pytest.raises(TypeError, match="x must be a dense"):
        knn_conv(x.detach().to_sparse(), w, b, meta)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor or None"):
        knn_conv(x, w, 1.0, meta)
