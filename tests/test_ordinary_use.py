"""KNNConv under ordinary PyTorch use: copies, saving, threads, autocast, many graphs, and fovi's
output layout downstream. Every test here failed on the design that kept per-graph data in
module-level caches keyed by identity."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import force_cells, random_meta
from torch import nn

from fovi_ref import KNNConv, available_ops, get_ops, route
from fovi_ref.check.operands import QUANTITIES, forward_and_grads, sample_operands
from fovi_ref.check.tolerances import expected_quantities, judge_elementwise


def small_model(seed=0, depth=3):
    """``depth`` KNN convs (general and gather_gemm alternating) with BatchNorm and ReLU."""
    torch.manual_seed(seed)
    layers, channels = [], 3
    for i in range(depth):
        k, v = (1, 1) if i % 2 else (4, 4)
        meta = random_meta(k, v, n_in=30, n_out=30, in_channels=channels, seed=seed * 100 + i)
        layers += [KNNConv(channels, 6, meta), nn.BatchNorm1d(6), nn.ReLU()]
        channels = 6
    return nn.Sequential(*layers)


def outputs_and_grads(model, x):
    model.zero_grad()
    y = model(x)
    y.square().sum().backward()
    return [y.detach(), *(p.grad.clone() for p in model.parameters())]


def assert_all_equal(a, b):
    assert len(a) == len(b)
    for s, t in zip(a, b, strict=True):
        assert torch.equal(s, t)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save", "state_dict"])
def test_copies_run_and_give_identical_results(how):
    model = small_model()
    x = torch.randn(4, 3, 30)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    elif how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    else:
        twin = small_model(seed=1)  # other weights and other graphs of the same sizes
        twin.load_state_dict(model.state_dict())
    assert_all_equal(outputs_and_grads(twin, x), outputs_and_grads(model, x))
    conv = twin[0]
    assert conv.meta.same_graph(model[0].meta)
    assert conv.knn.data_ptr() != model[0].knn.data_ptr()  # the copy owns its graph


def train(model, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 3, 30, generator=g)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


def run_threads(target, n=4):
    errors, threads = [], []

    def guarded(i):
        try:
            target(i)
        except Exception as err:  # collected and re-raised in the main thread
            errors.append(err)

    for i in range(n):
        threads.append(threading.Thread(target=guarded, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_training_their_own_models_match_a_serial_run():
    # Built here, not in the threads: initialisation draws from torch's one global generator.
    models = [small_model(seed=i, depth=6) for i in range(4)]
    twins = [copy.deepcopy(m) for m in models]
    serial = [train(m, seed=i) for i, m in enumerate(models)]
    threaded = [None] * 4

    def work(i):
        threaded[i] = train(twins[i], seed=i)

    run_threads(work)
    for (losses, params), (t_losses, t_params) in zip(serial, threaded, strict=True):
        assert_all_equal(losses, t_losses)
        assert_all_equal(params, t_params)


def test_threads_sharing_one_model_under_no_grad_match_a_serial_run():
    model = small_model(depth=6).eval()
    inputs = [torch.randn(4, 3, 30, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        serial = [model(x) for x in inputs]
    threaded = [None] * 4

    def work(i):
        with torch.no_grad():
            for _ in range(5):
                threaded[i] = model(inputs[i])

    run_threads(work)
    assert_all_equal(serial, threaded)


# ------------------------------------------------------------------------------------ autocast
@pytest.mark.parametrize("backend", available_ops())
def test_autocast_forward_inside_backward_outside(backend):
    k, v = (1, 1) if backend == "gather_gemm" else (4, 4)
    conv = KNNConv(3, 5, random_meta(k, v), backend=backend)
    x = torch.randn(2, 3, 30, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()  # outside the block
    assert x.grad.dtype == conv.weight.grad.dtype == torch.float32
    assert torch.isfinite(conv.weight.grad).all()


def test_autocast_eager_and_compiled_agree_on_dtype():
    torch._dynamo.reset()
    model = small_model()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    conv = torch.compile(model[0], fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 3, 30)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv(x).dtype == model[0](x).dtype == torch.bfloat16
        assert compiled(x).dtype == model(x).dtype


def test_autocast_leaves_float64_alone_as_for_f_linear_eager_and_compiled():
    """Autocast casts float32/float16 tensors and leaves float64 ones alone (F.linear's rule)."""
    torch._dynamo.reset()
    conv = KNNConv(3, 5, random_meta(4, 4)).double()
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 30, dtype=torch.float64)
    plain = conv(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(x[0].t(), torch.randn(5, 3, dtype=torch.float64)).dtype == torch.float64
        assert torch.equal(conv(x), plain) and torch.equal(compiled(x), plain)


def test_a_mixed_model_trains_under_bfloat16_autocast():
    torch.manual_seed(0)
    meta = random_meta(4, 4, n_in=30, n_out=20, in_channels=8)
    model = nn.Sequential(nn.Conv1d(3, 8, 1), KNNConv(8, 6, meta), nn.BatchNorm1d(6), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3, 30)
    target = torch.randn(8, 6, 20)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert losses[-1] < losses[0]


# ----------------------------------------------------------------------------- many graphs
def hundred_layer_model():
    torch.manual_seed(0)
    layers = []
    for i in range(100):
        k, v = (1, 1) if i % 3 == 0 else (4, 4)
        layers.append(KNNConv(4, 4, random_meta(k, v, n_in=20, n_out=20, in_channels=4, seed=i)))
    return nn.Sequential(*layers)


def count_derivations(monkeypatch):
    calls = []
    for name in available_ops():
        ops, original = get_ops(name), get_ops(name).derive
        monkeypatch.setattr(ops, "derive", lambda m, o=original: calls.append(1) or o(m))
    return calls


@pytest.mark.parametrize("form", ["eager", "compiled", "exported"])
def test_a_hundred_distinct_graphs_are_never_rederived(form, monkeypatch):
    model = hundred_layer_model()
    assert len({route(m.meta) for m in model}) == 2
    derivations = count_derivations(monkeypatch)
    x = torch.randn(2, 4, 20, requires_grad=True)
    if form == "compiled":
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True, backend="aot_eager")
    elif form == "exported":
        run = torch.export.export(model, (x.detach(),)).module()
    else:
        run = model
    for _ in range(3):
        y = run(x)
        torch.autograd.grad(y.sum(), x)
    assert derivations == []


# ------------------------------------------------------------------------- fovi's layout
def fovi_way(x, conv):
    """What fovi's KNNConvLayer computes: pad, gather, one-hot einsum, F.linear, transpose."""
    meta = conv.meta
    batch, c_in, _ = x.shape
    padded = torch.cat([x, x.new_zeros(batch, c_in, 1)], dim=2)  # [B, Cin, Nin+1]
    index = meta.knn.reshape(1, 1, -1).expand(batch, c_in, -1)
    gathered = torch.gather(padded, 2, index).reshape(batch, c_in, meta.k, meta.n_out)
    gathered = gathered.permute(0, 1, 3, 2).reshape(batch * c_in, meta.n_out, meta.k)
    cells = torch.einsum("ank,nkv->anv", gathered, meta.local_rf(x.dtype))  # [B*Cin, Nout, V]
    cells = cells.reshape(batch, c_in, meta.n_out, meta.v).permute(0, 2, 1, 3)
    features = cells.reshape(batch, meta.n_out, c_in * meta.v).contiguous()
    return F.linear(features, conv.weight, conv.bias).transpose(1, 2)  # [B, Cout, Nout]


def test_einsum_baseline_chain_is_bit_identical_to_fovis_way_in_float64():
    torch.manual_seed(0)
    first = KNNConv(3, 6, random_meta(4, 4, in_channels=3), backend="einsum_baseline")
    second = KNNConv(6, 5, random_meta(9, 9, n_in=20, in_channels=6), backend="einsum_baseline")
    norm = nn.BatchNorm1d(6)
    chain = nn.Sequential(first, norm, nn.ReLU(), second).double()
    x = torch.randn(4, 3, 30, dtype=torch.float64)
    ours = chain(x)
    theirs = fovi_way(torch.relu(norm(fovi_way(x, first))), second)
    assert first(x).stride() == fovi_way(x, first).stride()  # the same transposed view
    assert torch.equal(ours, theirs)


def _thread_case(backend: str, dtype: torch.dtype, batch: int):
    """``(meta, x, weight, bias, grad_y)``: a graph the backend accepts, operands at ``batch``."""
    k, v = (1, 1) if backend == "gather_gemm" else (9, 9)
    meta = random_meta(k, v, n_in=300, n_out=200, in_channels=32, seed=3)
    return (meta, *sample_operands(meta, 64, batch=batch, dtype=dtype))


# general sums over node rows at batch 2 and over channel rows at batch 16 (knn_general), and
# runs its GEMMs dense or (forced here) per occupied cell.
THREAD_BATCHES = pytest.mark.parametrize(
    "batch,cells", [(2, False), (16, False), (16, True)], ids=["2", "16", "16 cells"]
)


def _run_with_threads(n: int, backend: str, meta, x, w, b, grad_y) -> tuple[torch.Tensor, ...]:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return forward_and_grads(x, w, b, meta, grad_y, backend)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", available_ops())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@THREAD_BATCHES
def test_results_repeat_bitwise_at_a_fixed_thread_count(backend, dtype, batch, cells, monkeypatch):
    """help(fovi_ref) promises bitwise repeatable results run to run at a fixed thread count."""
    force_cells(monkeypatch, cells)
    case = _thread_case(backend, dtype, batch)
    for n in (1, 2):
        assert_all_equal(_run_with_threads(n, backend, *case), _run_with_threads(n, backend, *case))


@pytest.mark.parametrize("backend", available_ops())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@THREAD_BATCHES
def test_results_under_another_thread_count_stay_within_the_rule(
    backend, dtype, batch, cells, monkeypatch
):
    """1 and 2 threads may round differently (MKL blocks its GEMMs by thread count, on some
    machines even gather_gemm's): both runs pass the elementwise tolerance rule."""
    force_cells(monkeypatch, cells)
    meta, x, w, b, grad_y = case = _thread_case(backend, dtype, batch)
    expected = expected_quantities(x, w, b, meta, grad_y)
    for n in (1, 2):
        for name, value in zip(QUANTITIES, _run_with_threads(n, backend, *case), strict=True):
            verdict = judge_elementwise(value, expected[name])
            assert verdict.ok, (backend, n, verdict)
