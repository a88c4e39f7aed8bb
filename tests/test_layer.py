"""KNNConv: parameters, buffers, devices, state dicts, and the fovi-compatible attributes."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, random_meta

from fovi_ref import KNNConv, KNNMeta, knn_conv, route_layer
from fovi_ref.reference import knn_conv_reference


def test_parameters_and_init():
    torch.manual_seed(0)
    meta = random_meta(9, 9, in_channels=16)
    layer = KNNConv(16, 32, meta)
    assert layer.weight.shape == (32, 16 * 9)
    assert torch.equal(layer.bias, torch.zeros(32))
    # kaiming-normal (fan_in mode, gain sqrt(2)): std = sqrt(2 / fan_in), fan_in = Cin*V.
    expected_std = (2 / (16 * 9)) ** 0.5
    assert abs(layer.weight.std().item() / expected_std - 1) < 0.1
    assert KNNConv(16, 32, meta, bias=False).bias is None


def test_fovi_attributes():
    meta = random_meta(9, 4)
    layer = KNNConv(3, 5, meta)
    assert layer._k == 9
    assert torch.equal(layer.local_rf, meta.local_rf())
    assert route_layer(layer) == "general"


def test_forward_matches_oracle_and_knn_conv():
    meta = random_meta(4, 4)
    layer = KNNConv(3, 5, meta).double()
    x = torch.randn(2, 3, meta.n_in, dtype=torch.float64)
    y = layer(x)
    torch.testing.assert_close(y, knn_conv_reference(x, layer.weight, layer.bias, meta))
    torch.testing.assert_close(y, knn_conv(x, layer.weight, layer.bias, meta))


def test_state_dict_carries_the_graph():
    meta_a, meta_b = random_meta(4, 4, seed=1), random_meta(4, 4, seed=2)
    a, b = KNNConv(3, 5, meta_a), KNNConv(3, 5, meta_b)
    assert {"weight", "bias", "knn", "rf_index"} <= set(a.state_dict())
    b.load_state_dict(a.state_dict())
    assert b.meta.same_graph(meta_a)
    assert b.meta.knn is b.knn  # the buffers are the meta's tensors
    assert meta_b.same_graph(random_meta(4, 4, seed=2))  # the old meta was not edited in place
    x = torch.randn(2, 3, meta_a.n_in)
    torch.testing.assert_close(b(x), a(x))


def test_loading_a_bad_graph_is_rejected():
    layer = KNNConv(3, 5, random_meta(4, 4))
    state = layer.state_dict()
    state["knn"] = state["knn"].clone()
    state["knn"][0, 0] = 999
    with pytest.raises(ValueError, match="knn entries must lie in"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_moves_the_meta(device):
    layer = KNNConv(3, 5, random_meta(1, 1)).to(device)
    assert layer.meta.device.type == device and layer.knn.device.type == device
    y = layer(torch.randn(2, 3, layer.meta.n_in, device=device))
    assert y.device.type == device


def test_forced_backend_and_bad_arguments():
    meta = random_meta(1, 1)
    layer = KNNConv(3, 5, meta, backend="einsum_baseline")
    assert "backend=einsum_baseline" in repr(layer)
    x = torch.randn(2, 3, meta.n_in)
    torch.testing.assert_close(layer(x), knn_conv(x, layer.weight, layer.bias, meta))
    with pytest.raises(ValueError, match="in_channels=4 differs from meta.in_channels=3"):
        KNNConv(4, 5, meta)
    with pytest.raises(ValueError, match="out_channels must be >= 1"):
        KNNConv(3, 0, meta)
    with pytest.raises(TypeError, match="in_channels must be an int, got float 2.0"):
        KNNConv(2.0, 4, meta)
    with pytest.raises(TypeError, match="bias must be a bool"):
        KNNConv(3, 4, meta, bias="yes")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        KNNConv(3, 4, meta, backend="nope")
    with pytest.raises(TypeError, match="meta must be a fovi_ref.KNNMeta"):
        KNNConv(3, 5, meta.knn)
    assert isinstance(layer.meta, KNNMeta)


def test_layer_owns_a_private_copy_of_the_graph():
    meta = random_meta(1, 1)
    layer = KNNConv(3, 5, meta)
    assert layer.knn.data_ptr() != meta.knn.data_ptr()


def test_buffers_replaced_with_garbage_are_never_used():
    """Values that replace the graph's (to_empty's uninitialised memory, say) are no graph."""
    layer = KNNConv(3, 5, random_meta(4, 4))
    layer._apply(lambda t: torch.full_like(t, 10**6) if t.dtype == torch.int64 else t)
    with pytest.raises(RuntimeError, match="graph .*load_state_dict"):
        layer(torch.randn(2, 3, 30))


def test_derived_data_are_non_persistent_buffers():
    layer = KNNConv(3, 5, random_meta(9, 9))
    buffers = dict(layer.named_buffers())
    derived = {name for name in buffers if name.startswith("derived_")}
    assert derived and "derived_bin_first" in derived  # general's segment-sum plans
    assert set(layer.state_dict()) == {"weight", "bias", "knn", "rf_index", "_extra_state"}
    layer.backend = "einsum_baseline"  # another backend: its own derived data replace them
    assert {n for n, _ in layer.named_buffers() if n.startswith("derived_")} == {"derived_local_rf"}


def test_assigning_a_graph_works_or_raises():
    meta_a, meta_b = random_meta(4, 4, seed=1), random_meta(4, 4, seed=2)
    layer = KNNConv(3, 5, meta_a)
    x = torch.randn(2, 3, meta_a.n_in)
    layer.meta = meta_b  # validated, derived, used by forward, saved
    assert layer.meta.same_graph(meta_b)
    torch.testing.assert_close(layer(x), knn_conv(x, layer.weight, layer.bias, meta_b))
    assert torch.equal(layer.state_dict()["knn"], meta_b.knn)
    with pytest.raises(AttributeError, match="assign a new graph with layer.meta"):
        layer.knn = meta_a.knn
    with pytest.raises(AttributeError, match="assign a new graph with layer.meta"):
        layer.rf_index = meta_a.rf_index
    with pytest.raises(ValueError, match="must keep"):
        layer.meta = random_meta(4, 2)  # another V: the weight would not fit
    assert layer.meta.same_graph(meta_b)


def snapshot(layer):
    """The state dict, tensors cloned (the extra state ``{"n_in", "v"}`` is a dict)."""
    return {
        name: t.clone() if isinstance(t, torch.Tensor) else dict(t)
        for name, t in layer.state_dict().items()
    }


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize(
    "edit,error,message",
    [
        (lambda s: s["knn"].__setitem__((0, 0), 999), ValueError, "knn entries must lie in"),
        (lambda s: s.__setitem__("knn", s["knn"].float()), TypeError, "integer dtype"),
        (lambda s: s.__setitem__("rf_index", s["rf_index"][:3]), ValueError, "rf_index must be"),
        (lambda s: s.__setitem__("weight", s["weight"][:, :3]), ValueError, "weight in the state"),
    ],
    ids=["knn_out_of_range", "float_knn", "rf_index_shape", "weight_shape"],
)
def test_a_refused_load_leaves_the_layer_exactly_as_it_was(edit, error, message):
    layer = KNNConv(3, 5, random_meta(4, 4))
    before = snapshot(layer)
    state = snapshot(KNNConv(3, 5, random_meta(4, 4, seed=7)))  # other weights, other graph
    edit(state)
    with pytest.raises(error, match=message):
        layer.load_state_dict(state)
    after = snapshot(layer)
    assert all(same(after[k], before[k]) for k in before)


def test_loading_another_graph_rederives_and_keys_are_strict():
    a, b = KNNConv(3, 5, random_meta(4, 4, seed=1)), KNNConv(3, 5, random_meta(4, 4, seed=2))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, a.meta.n_in)
    assert torch.equal(b(x), a(x))
    state = a.state_dict()
    del state["knn"]
    result = b.load_state_dict(state, strict=False)
    assert result.missing_keys == ["knn"]


# -------------------------------------------------- state that never disagrees with itself
def _snapshot(layer):
    return snapshot(layer), layer.backend, layer.meta


def _unchanged(layer, before):
    state, backend, meta = before
    now = layer.state_dict()
    assert state.keys() == now.keys() and all(same(state[k], now[k]) for k in state)
    assert layer.backend == backend and layer.meta.same_graph(meta)


def test_a_refused_backend_changes_nothing():
    layer = KNNConv(3, 4, random_meta(2, 4))
    before = _snapshot(layer)
    with pytest.raises(ValueError):
        layer.backend = "gather_gemm"  # K = 2: gather_gemm does not apply
    _unchanged(layer, before)
    layer.load_state_dict(layer.state_dict())  # still works
    layer.meta = layer.meta
    x = torch.randn(2, 3, layer.meta.n_in)
    torch.testing.assert_close(layer(x), knn_conv(x, layer.weight, layer.bias, layer.meta))


@pytest.mark.parametrize("change", ["unexpected", "missing"])
def test_a_strict_load_refused_for_a_key_changes_nothing(change):
    """A layer loaded by itself judges the keys before loading (torch judges them after the
    whole load). Inside a container torch decides; load into a copy first there
    (help(fovi_ref), State)."""
    layer = KNNConv(3, 4, random_meta(2, 4))
    other = KNNConv(3, 4, random_meta(2, 4, seed=1))
    state = other.state_dict()
    if change == "unexpected":
        state["extra"] = torch.zeros(1)
    else:
        del state["bias"]
    weight, knn = layer.weight.clone(), layer.knn.clone()
    with pytest.raises(RuntimeError, match="nothing was loaded"):
        layer.load_state_dict(state)
    assert torch.equal(layer.weight, weight) and torch.equal(layer.knn, knn)


def test_a_non_strict_load_loads_what_it_brings():
    """It loaded nothing at all, silently, when a key was missing."""
    layer = KNNConv(3, 4, random_meta(2, 4))
    other = KNNConv(3, 4, random_meta(2, 4, seed=1))
    result = layer.load_state_dict({"weight": other.weight}, strict=False)
    assert torch.equal(layer.weight, other.weight)
    assert sorted(result.missing_keys) == ["bias", "knn", "rf_index"]
    knn = layer.knn.clone()
    result = layer.load_state_dict({"rf_index": other.rf_index}, strict=False)
    assert torch.equal(layer.rf_index, other.rf_index) and torch.equal(layer.knn, knn)


def test_register_buffer_cannot_replace_the_graph():
    layer = KNNConv(3, 4, random_meta(2, 4))
    before = _snapshot(layer)
    with pytest.raises(AttributeError, match="layer.meta = KNNMeta"):
        layer.register_buffer("knn", torch.full_like(layer.knn, 99))
    _unchanged(layer, before)


class _CollidingDerive:
    name = "colliding_derive"

    @staticmethod
    def derive(meta):
        return {"s.a": torch.zeros(1), "s_a": torch.ones(1)}

    @staticmethod
    def forward(meta, x, weight, bias):
        scale = meta.derived("colliding_derive", _CollidingDerive.derive)["s_a"]
        return knn_conv(x, weight * scale, bias, meta)

    grad_input = grad_weight = None


def test_derived_keys_that_collide_as_buffer_names_are_refused():
    from fovi_ref import register_ops, unregister_ops

    register_ops(_CollidingDerive)
    try:
        layer = KNNConv(3, 4, random_meta(2, 4))
        before = _snapshot(layer)
        with pytest.raises(ValueError, match="'colliding_derive'.*collide"):
            layer.backend = "colliding_derive"
        _unchanged(layer, before)
    finally:
        unregister_ops("colliding_derive")


def test_a_builtin_overridden_without_derive_and_restored_still_runs():
    from fovi_ref import get_ops, register_ops, unregister_ops

    general = get_ops("general")

    class NoDerive:
        name = "general"
        grad_input = grad_weight = None

        @staticmethod
        def forward(meta, x, w, b):
            return knn_conv(x, w, b, meta, backend="einsum_baseline")

    layer = KNNConv(3, 4, random_meta(2, 4))
    x = torch.randn(2, 3, layer.meta.n_in)
    expected = layer(x)
    unregister_ops("general")
    register_ops(NoDerive)
    try:
        layer.meta = layer.meta  # derived afresh by the override: nothing
        torch.testing.assert_close(layer(x), expected)
    finally:
        unregister_ops("general")
        register_ops(general)
    torch.testing.assert_close(layer(x), expected)


# ---------------------------------------- issue 19: refused naming the argument, or working
def test_a_state_dict_value_that_is_not_a_tensor_is_refused():
    layer = KNNConv(3, 4, random_meta(2, 4))
    before = _snapshot(layer)
    for name in ("weight", "bias", "knn"):
        state = layer.state_dict()
        state[name] = state[name].tolist()
        with pytest.raises(TypeError, match=f"{name} .*must be a torch.Tensor, got list"):
            layer.load_state_dict(state)
        _unchanged(layer, before)


@pytest.mark.parametrize("name", ["knn", "rf_index", "derived_bin_first"])
def test_the_graph_and_its_derived_data_cannot_be_deleted_or_replaced(name):
    layer = KNNConv(3, 4, random_meta(2, 4))
    before = _snapshot(layer)
    with pytest.raises(AttributeError, match="layer.meta = KNNMeta"):
        delattr(layer, name)
    with pytest.raises(AttributeError, match="layer.meta = KNNMeta"):
        setattr(layer, name, torch.zeros_like(getattr(layer, name)))
    _unchanged(layer, before)
    x = torch.randn(2, 3, layer.meta.n_in)
    torch.testing.assert_close(layer(x), knn_conv(x, layer.weight, layer.bias, layer.meta))


def _grads(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(torch.ones_like(y))
    grads = (x.grad, layer.weight.grad, layer.bias.grad)
    layer.zero_grad()
    return y, *grads


@pytest.mark.parametrize("k,v", [(1, 1), (4, 4)])  # gather_gemm and general
def test_build_on_meta_then_to_empty_then_load(k, v):
    source = KNNConv(3, 5, random_meta(k, v, seed=3))
    source.bias.data.normal_()
    meta = random_meta(k, v)  # a KNNMeta needs values: built outside
    with torch.device("meta"):
        layer = KNNConv(3, 5, meta)
    layer.to_empty(device="cpu")
    x = torch.randn(2, 3, source.meta.n_in)
    with pytest.raises(RuntimeError, match="graph .*load_state_dict"):
        layer(x)
    layer.load_state_dict(source.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_grads(layer, x), _grads(source, x), strict=True))


@pytest.mark.parametrize("how", ["to_empty", "meta, to_empty", "meta, assign"])
def test_a_layer_moved_without_its_values_loads_them_again(how):
    """to_empty on a real layer, or .to("meta"): the graph is lost until a state dict brings it."""
    layer = KNNConv(3, 5, random_meta(4, 4))
    state, x = snapshot(layer), torch.randn(2, 3, 30)
    expected = _grads(layer, x)
    layer.to("meta") if how.startswith("meta") else layer.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="graph .*load_state_dict"):
        layer(x)
    with pytest.raises(RuntimeError, match="graph .*load_state_dict"):
        layer.backend = "einsum_baseline"
    half = {key: value for key, value in state.items() if key != "rf_index"}
    with pytest.raises(RuntimeError, match="graph .*load_state_dict"):
        layer.load_state_dict(half, strict=False)  # half a graph cannot complete a lost one
    if how == "meta, to_empty":
        layer.to_empty(device="cpu")
    layer.load_state_dict(state, assign=how == "meta, assign")
    assert all(torch.equal(a, b) for a, b in zip(_grads(layer, x), expected, strict=True))


def test_a_refused_move_changes_nothing():
    layer = KNNConv(3, 5, random_meta(4, 4))
    before = _snapshot(layer)
    with pytest.raises(TypeError, match="knn must stay int64"):
        layer.type(torch.float16)  # would cast the graph's indices too
    _unchanged(layer, before)
    assert layer.weight.dtype == torch.float32
    layer.half()  # casts floating tensors only: the graph and its derived data are kept
    assert layer.weight.dtype == torch.float16 and layer.meta.same_graph(before[2])


def test_a_models_state_dict_is_validated_by_loading_it_into_a_copy():
    """The workaround in help(fovi_ref), State: torch loads module by module, so a load
    refused at the second layer has already changed the first; loading into a copy first leaves
    the model as it was."""
    import copy

    def model_of(seed):
        metas = (random_meta(2, 4, n_out=30, seed=seed + i) for i in range(2))
        return torch.nn.Sequential(*(KNNConv(3, 3, meta) for meta in metas))

    model, other = model_of(0), model_of(2)
    good = other.state_dict()
    bad = {**good, "1.knn": torch.full_like(good["1.knn"], 999)}
    before = snapshot(model)
    with pytest.raises(ValueError, match="knn entries must lie in"):
        copy.deepcopy(model).load_state_dict(bad)
    assert all(same(t, before[key]) for key, t in model.state_dict().items())
    with pytest.raises(ValueError, match="knn entries must lie in"):
        model.load_state_dict(bad)  # what the workaround avoids: layer 0 was loaded
    assert torch.equal(model[0].weight, other[0].weight)
    trial = copy.deepcopy(model)
    trial.load_state_dict(good)  # accepted by the copy: load it for real
    model.load_state_dict(good)
    x = torch.randn(2, 3, 30)
    assert torch.equal(model(x), other(x))


# --------------------------------------------------------- the layer computes only its own graph
def test_functional_call_with_a_graph_or_derived_buffer_is_refused():
    """Before: functional_call with another layer's knn computed the layer's old graph under
    general (and the new one under einsum_baseline); a swapped derived buffer gave a wrong y."""
    layer, other = KNNConv(3, 4, random_meta(2, 4)), KNNConv(3, 4, random_meta(2, 4, seed=1))
    x = torch.randn(8, 3, layer.meta.n_in)
    swaps = [
        {"knn": other.knn},
        {"derived_bin_first": torch.zeros_like(layer.derived_bin_first)},
    ]
    for buffers in swaps:
        with pytest.raises(ValueError, match=r"swapped .*layer\.meta = KNNMeta"):
            torch.func.functional_call(layer, buffers, (x,))
    weight = {"weight": 2 * layer.weight}  # parameters swap freely
    y = torch.func.functional_call(layer, weight, (x,))
    torch.testing.assert_close(y, knn_conv(x, 2 * layer.weight, layer.bias, layer.meta))
    assert torch.equal(layer(x), knn_conv(x, layer.weight, layer.bias, layer.meta))


def test_an_ensemble_with_vmapped_graph_buffers_is_refused_by_name():
    layers = [KNNConv(3, 4, random_meta(2, 4)) for _ in range(2)]  # one graph, two weights
    params, buffers = torch.func.stack_module_state(layers)

    def run(p, b, x):
        return torch.func.functional_call(layers[0], (p, b), (x,))

    with pytest.raises(ValueError, match="buffer 'knn' was swapped"):
        torch.func.vmap(run, in_dims=(0, 0, None))(params, buffers, torch.randn(2, 3, 30))


@pytest.mark.parametrize(
    "edit,error,message",
    [
        (
            lambda s: s.update(weight=torch.empty_like(s["weight"], device="meta")),
            ValueError,
            "'meta' device",
        ),
        (lambda s: s.update(bias=None), TypeError, "bias in the state dict must be a torch"),
        (lambda s: s.update(weight=s["weight"].to_sparse()), TypeError, "dense tensor"),
        (lambda s: s.update(_extra_state={"n_in": 12, "v": 4}), ValueError, "n_in = 12"),
        (lambda s: s.update(_extra_state={"n_in": 30, "v": 2}), ValueError, "v = 2"),
    ],
    ids=["meta_weight", "bias_none", "sparse_weight", "other_n_in", "other_v"],
)
def test_a_refused_load_changes_nothing_even_where_torch_collects_the_error(edit, error, message):
    """Before: the graph (and for bias=None the weight) were replaced, then torch raised."""
    layer, other = KNNConv(3, 5, random_meta(2, 4)), KNNConv(3, 5, random_meta(2, 4, seed=1))
    state = other.state_dict()
    edit(state)
    before = _snapshot(layer)
    with pytest.raises(error, match=message):
        layer.load_state_dict(state)
    _unchanged(layer, before)
    model = torch.nn.Sequential(layer)  # inside a container: torch's route
    with pytest.raises(error, match=message):
        model.load_state_dict({f"0.{key}": value for key, value in state.items()})
    _unchanged(layer, before)


def test_a_forced_backend_that_refuses_the_new_graph_leaves_the_weight_alone():
    """Before: a gather_gemm layer loading a K = 2 graph raised in derive after its weight was
    overwritten."""
    layer = KNNConv(3, 5, random_meta(1, 1), backend="gather_gemm")
    state = KNNConv(3, 5, random_meta(2, 1, seed=3)).state_dict()
    before = _snapshot(layer)
    with pytest.raises(ValueError):
        layer.load_state_dict(state)
    _unchanged(layer, before)


def test_the_state_dict_carries_n_in_and_v_and_old_checkpoints_still_load():
    """Before: a state dict over n_in = 9 loaded into a layer of n_in = 12, "All keys matched",
    and its padding (index 9) became a real input."""
    small, large = KNNConv(3, 4, random_meta(2, 4, n_in=9)), KNNConv(3, 4, random_meta(2, 4))
    assert small.state_dict()["_extra_state"] == {"n_in": 9, "v": 4}
    with pytest.raises(ValueError, match="n_in = 9, this layer's 30"):
        large.load_state_dict(small.state_dict())
    old = {k: v for k, v in large.state_dict().items() if k != "_extra_state"}
    again = KNNConv(3, 4, random_meta(2, 4, seed=5))
    again.load_state_dict(old)  # written before the extra state: loads
    assert again.meta.same_graph(large.meta)
