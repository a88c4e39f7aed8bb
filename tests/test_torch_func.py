"""knn_conv under torch.func: grad, vmap (a batch of weights, a stacked ensemble of KNNConv
layers), per-sample gradients, jacrev and jacfwd, each compared with the same transform of the
float64 oracle (plain torch, which torch.func transforms natively); second orders refuse, naming
knn_conv."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_meta, sample_inputs
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, stack_module_state, vmap

from fovi_ref import KNNConv, available_ops, knn_conv
from fovi_ref.reference import knn_conv_reference

# K = V = 1 routes to gather_gemm (which keeps an operand in plain autograd), K = 9 to general.
GRAPHS = [(1, 1), (9, 9)]


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.fixture(params=GRAPHS, ids=lambda kv: f"k{kv[0]}v{kv[1]}")
def case(request):
    meta = random_meta(*request.param)
    x, w, b = (t.detach() for t in sample_inputs(meta, batch=3))
    return meta, x, w, b


def both(meta, backend=None):
    """``f(x, w, b)`` for knn_conv and for the float64 oracle."""
    return (
        lambda x, w, b: knn_conv(x, w, b, meta, backend=backend),
        lambda x, w, b: knn_conv_reference(x, w, b, meta),
    )


@pytest.mark.parametrize("backend", [None, *available_ops()])
def test_grad_of_every_operand(case, backend):
    meta, x, w, b = case
    if backend == "gather_gemm" and meta.k != 1:
        pytest.skip("gather_gemm takes K = V = 1 graphs only")
    op, oracle = both(meta, backend)
    grads = grad(lambda x, w, b: op(x, w, b).square().sum(), argnums=(0, 1, 2))(x, w, b)
    expected = grad(lambda x, w, b: oracle(x, w, b).square().sum(), argnums=(0, 1, 2))(x, w, b)
    for got, want in zip(grads, expected, strict=True):
        close(got, want)


def test_vmap_over_a_batch_of_weights(case):
    meta, x, w, b = case
    ws = torch.randn(5, *w.shape, dtype=w.dtype)  # [N, Cout, Cin*V]
    bs = torch.randn(5, *b.shape, dtype=b.dtype)
    op, oracle = both(meta)
    ys = vmap(op, in_dims=(None, 0, 0))(x, ws, bs)  # [N, B, Cout, Nout]
    close(ys, torch.stack([oracle(x, wi, bi) for wi, bi in zip(ws, bs, strict=True)]))
    # x and weight both vmapped (one call per slice), and x alone (folded into the batch)
    xs = torch.randn(5, *x.shape, dtype=x.dtype)
    close(vmap(op)(xs, ws, bs), vmap(oracle)(xs, ws, bs))
    close(vmap(op, in_dims=(1, None, None), out_dims=1)(x[:, None], w, b)[:, 0], oracle(x, w, b))


def test_ensemble_of_layers_with_stack_module_state():
    meta = random_meta(9, 9)
    layers = [KNNConv(meta.in_channels, 4, meta).double() for _ in range(3)]
    params, _ = stack_module_state(layers)  # weights stacked: [3, Cout, Cin*V], bias [3, Cout]
    base = copy.deepcopy(layers[0])  # the graph buffers are one for all: not vmapped
    x = torch.randn(2, meta.in_channels, meta.n_in, dtype=torch.float64)

    def run(params, x):
        return functional_call(base, params, (x,))

    ys = vmap(run, in_dims=(0, None))(params, x)  # [3, B, Cout, Nout]
    for y, layer in zip(ys, layers, strict=True):
        close(y, knn_conv_reference(x, layer.weight, layer.bias, meta))


def test_per_sample_gradients(case):
    meta, x, w, b = case
    op, oracle = both(meta)

    def loss(f):
        return lambda w, b, xi: f(xi[None], w, b).square().sum()

    per_sample = vmap(grad(loss(op), argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x)
    for i in range(x.shape[0]):  # one sample at a time, by the oracle
        want = grad(loss(oracle), argnums=(0, 1))(w, b, x[i])
        close(per_sample[0][i], want[0])
        close(per_sample[1][i], want[1])
    assert not torch.allclose(per_sample[0][0], per_sample[0][1])  # per sample, not summed


@pytest.mark.parametrize("jac", [jacrev, jacfwd])
def test_jacobians(case, jac):
    meta, x, w, b = case
    x = x[:1]
    op, oracle = both(meta)
    for argnum in range(3):
        close(jac(op, argnums=argnum)(x, w, b), jac(oracle, argnums=argnum)(x, w, b))


def test_jvp_matches_the_oracle(case):
    meta, x, w, b = case
    op, oracle = both(meta)
    tangents = tuple(torch.randn_like(t) for t in (x, w, b))
    y, dy = jvp(op, (x, w, b), tangents)
    y_ref, dy_ref = jvp(oracle, (x, w, b), tangents)
    close(y, y_ref)
    close(dy, dy_ref)


@pytest.mark.parametrize("transform", ["hessian", "jacfwd(jacrev)", "grad(grad)"])
def test_second_order_transforms_refuse_naming_knn_conv(transform):
    meta = random_meta(4, 4)
    x, w, b = (t.detach() for t in sample_inputs(meta, batch=1))

    def loss(w):
        return knn_conv(x, w, b, meta).square().sum()

    run = {
        "hessian": torch.func.hessian(loss),
        "jacfwd(jacrev)": jacfwd(jacrev(loss)),
        "grad(grad)": grad(lambda w: grad(loss)(w).sum()),
    }[transform]
    with pytest.raises(RuntimeError, match="knn_conv is first-order only"):
        run(w)
