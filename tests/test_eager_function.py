"""The eager door's Function under ordinary autograd use: in-place ops on its output, saving only
what the requested gradients read, and a backend that breaks the operand pair named at the call.
Each test here failed before this Function (issue 19), except the compiled-door check, whose
door already took in-place ops."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import random_meta, sample_inputs

from fovi_ref import available_ops, get_ops, knn_conv, prepare
from fovi_ref.check.protocol import policed
from fovi_ref.reference import knn_conv_reference

GRAPHS = {
    "general": (9, 9),
    "general_textbook": (9, 9),
    "gather_gemm": (1, 1),
    "einsum_baseline": (4, 4),
}
IN_PLACE = {
    "y += r": lambda y, r: y.add_(r),
    "y.relu_()": lambda y, r: y.relu_(),
    "y.mul_(2)": lambda y, r: y.mul_(2),
    "y[:, 0] = 0": lambda y, r: y[:, 0].zero_(),
}


def operands(backend):
    meta = random_meta(*GRAPHS[backend])
    x, w, b = (t.detach().requires_grad_() for t in sample_inputs(meta))
    return meta, x, w, b


@pytest.mark.parametrize("backend", available_ops())
@pytest.mark.parametrize("op", IN_PLACE)
def test_in_place_ops_on_the_eager_output_give_the_oracles_gradients(backend, op):
    meta, x, w, b = operands(backend)
    r = torch.randn(x.shape[0], w.shape[0], meta.n_out, dtype=x.dtype)

    def run(f):
        y = f(x, w, b, meta)
        IN_PLACE[op](y, r)
        grad_y = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
        return y.detach(), torch.autograd.grad(y, (x, w, b), grad_y)

    y, grads = run(lambda *a: knn_conv(*a, backend=backend))
    y_ref, grads_ref = run(knn_conv_reference)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", available_ops())
def test_in_place_ops_pass_gradcheck(backend):
    meta, x, w, b = operands(backend)

    def f(x, w, b):
        y = knn_conv(x, w, b, meta, backend=backend)
        y.mul_(2)
        return y.add_(1).tanh_()

    assert torch.autograd.gradcheck(f, (x, w, b))


def test_in_place_output_keeps_fovis_layout_and_costs_no_copy():
    meta, x, w, b = operands("gather_gemm")
    y = knn_conv(x, w, b, meta)
    assert y.stride() == (meta.n_out * w.shape[0], 1, w.shape[0])  # fovi's layout, not a copy
    y.relu_()
    assert not y._is_view()


@pytest.mark.parametrize("backend", available_ops())
def test_inference_mode_x_with_only_the_bias_trainable(backend):
    meta, _, w, b = operands(backend)
    with torch.inference_mode():
        x = torch.randn(2, meta.in_channels, meta.n_in, dtype=w.dtype)
    w = w.detach()  # frozen; only the bias trains
    (grad_b,) = torch.autograd.grad(knn_conv(x, w, b, meta, backend=backend).sum(), b)
    torch.testing.assert_close(grad_b, torch.full_like(b, 2.0 * meta.n_out))


def test_only_what_the_requested_gradients_read_is_saved():
    meta, x, w, b = operands("general")
    for x_grad, w_grad, saved in [(True, False, 1), (False, True, 1), (False, False, 0)]:
        y = knn_conv(x.detach().requires_grad_(x_grad), w.detach().requires_grad_(w_grad), b, meta)
        kept = [t for t in y.grad_fn.saved_tensors if t is not None]
        assert len(kept) == saved


def broken_pair(result):
    general = get_ops("general")
    return types.SimpleNamespace(
        name="broken_pair",
        forward=general.forward,
        grad_input=general.grad_input,
        grad_weight=general.grad_weight,
        forward_with_operand=lambda meta, x, weight, bias: result(
            general.forward(meta, x, weight, bias)
        ),
        grad_weight_of_operand=general.grad_weight,
    )


@pytest.mark.parametrize(
    "result",
    [lambda y: (y, None), lambda y: y, lambda y: (y,)],
    ids=["y_None", "y_alone", "one_tuple"],
)
def test_a_backend_breaking_the_operand_pair_is_named_in_eager_mode(result):
    meta, x, w, b = operands("general")
    with pytest.raises(TypeError, match="'broken_pair': forward_with_operand must return"):
        knn_conv(x, w, b, meta, backend=broken_pair(result))


def test_in_place_ops_work_in_the_compiled_door_too():
    meta, x, w, b = operands("general")
    prepare(meta)  # compiled code finds the derived data ready

    def f(x, w, b):
        y = knn_conv(x, w, b, meta)
        y += 1
        return y.relu_()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # the custom op's door
    grad_y = torch.randn(x.shape[0], w.shape[0], meta.n_out, dtype=x.dtype)
    y, y_ref = compiled(x, w, b), f(x, w, b)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(y, (x, w, b), grad_y)
    for got, want in zip(grads, torch.autograd.grad(y_ref, (x, w, b), grad_y), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_policed_backend_refuses_a_none_operand_too():
    meta, x, w, b = operands("general")
    with pytest.raises(TypeError, match=r"'broken_pair'.*got \['Tensor', 'NoneType'\]"):
        policed(broken_pair(lambda y: (y, None))).forward_with_operand(meta, x, w, b)
