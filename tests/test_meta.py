"""KNNMeta: construction, the input_linear layout, validation, devices, fovi layers."""

from __future__ import annotations

import copy
import pickle
import threading
import types
import warnings

import pytest
import torch
from conftest import DEVICES, random_meta

from fovi_ref import KNNMeta


def small_graph():
    knn = torch.tensor([[0, 2, 4], [1, 4, 3]])  # [K=2, Nout=3]; 4 = n_in = padding
    rf_index = torch.tensor([[0, 1], [2, 2], [1, 0]])  # [Nout, K]
    return knn, rf_index


def test_attributes():
    knn, rf_index = small_graph()
    meta = KNNMeta.from_knn(knn, rf_index, n_in=4, in_channels=2, v=3)
    assert (meta.k, meta.v, meta.n_in, meta.n_out, meta.in_channels) == (2, 3, 4, 3, 2)
    assert meta.device == torch.device("cpu")
    assert meta.pad_mask.tolist() == [[False, False, True], [False, True, False]]
    assert meta.has_padding
    assert meta.knn.dtype == meta.rf_index.dtype == torch.int64


def test_input_linear_layout():
    """Column c*K + k of row n holds c*n_in + knn[k, n], or Cin*n_in for padding."""
    knn, rf_index = small_graph()
    meta = KNNMeta.from_knn(knn, rf_index, n_in=4, in_channels=2, v=3)
    pad = 2 * 4
    expected = [
        [0, 1, 4 + 0, 4 + 1],  # node 0: neighbours 0, 1
        [2, pad, 4 + 2, pad],  # node 1: neighbour 2, then padding
        [pad, 3, pad, 4 + 3],  # node 2: padding, then neighbour 3
    ]
    assert meta.input_linear.tolist() == expected
    # It indexes the flattened input: x.reshape(B, Cin*Nin) with one zero appended.
    x = torch.randn(2, 2, 4)
    flat = torch.cat([x.reshape(2, 8), torch.zeros(2, 1)], dim=1)
    gathered = flat[:, meta.input_linear]  # [B, Nout, Cin*K]
    assert torch.equal(gathered[:, 0, 3], x[:, 1, 1])
    assert torch.equal(gathered[:, 1, 1], torch.zeros(2))


def test_local_rf_round_trip():
    meta = random_meta(9, 9)
    local_rf = meta.local_rf()
    assert local_rf.shape == (meta.n_out, 9, 9)
    assert torch.equal(local_rf.sum(2), torch.ones(meta.n_out, 9))
    again = KNNMeta.from_local_rf(meta.knn, local_rf, n_in=meta.n_in, in_channels=3)
    assert again.same_graph(meta)
    assert KNNMeta.from_local_rf(
        meta.knn, local_rf.bool(), n_in=meta.n_in, in_channels=3
    ).same_graph(meta)


def test_meta_owns_its_indices():
    knn, rf_index = small_graph()
    meta = KNNMeta.from_knn(knn, rf_index, n_in=4, in_channels=2, v=3)
    knn[0, 0] = 3
    assert meta.knn[0, 0] == 0


def test_same_graph_and_identity_equality():
    a = random_meta(4, 4, seed=1)
    b = random_meta(4, 4, seed=1)
    c = random_meta(4, 4, seed=2)
    assert a.same_graph(b) and not a.same_graph(c)
    assert a != b and a == a  # equality is identity


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"knn": torch.tensor([[0, 5]])}, ValueError, r"knn\[0, 1\] = 5"),
        ({"knn": torch.tensor([[0, -1]])}, ValueError, r"knn\[0, 1\] = -1"),
        ({"knn": torch.tensor([[0.0, 1.0]])}, TypeError, "knn must have an integer dtype"),
        ({"knn": torch.tensor([[True, False]])}, TypeError, "knn must have an integer dtype"),
        ({"knn": [[0, 1]]}, TypeError, "knn must be a torch.Tensor"),
        ({"knn": torch.tensor([0, 1])}, ValueError, "knn must have 2 dimensions"),
        ({"rf_index": torch.tensor([[0], [3]])}, ValueError, r"rf_index\[1, 0\] = 3"),
        ({"rf_index": torch.tensor([[0], [-2]])}, ValueError, r"rf_index\[1, 0\] = -2"),
        (
            {"rf_index": torch.tensor([[0, 1]])},
            ValueError,
            r"rf_index must be \[Nout, K\] = \[2, 1\]",
        ),
        ({"n_in": 0}, ValueError, "n_in must be >= 1"),
        ({"n_in": 4.0}, TypeError, "n_in must be an int"),
        ({"in_channels": 2.9}, TypeError, "in_channels must be an int"),
        ({"in_channels": "2"}, TypeError, "in_channels must be an int"),
        ({"v": True}, TypeError, "v must be an int"),
        ({"knn": torch.tensor([[0, 1]], device="meta")}, ValueError, "knn is on the 'meta' device"),
        ({"knn": torch.tensor([[0, 1]]).to_sparse()}, TypeError, "knn must be a dense"),
        (
            {"knn": torch.tensor([[0, 2**64 - 5]], dtype=torch.uint64)},
            ValueError,
            r"knn\[0, 1\] = 18446744073709551611 does not fit in int64",
        ),
        ({"in_channels": 0}, ValueError, "in_channels must be >= 1"),
        ({"v": 0}, ValueError, "v must be >= 1"),
        (
            {
                "knn": torch.zeros(1, 0, dtype=torch.long),
                "rf_index": torch.zeros(0, 1, dtype=torch.long),
            },
            ValueError,
            "K, Nout >= 1",
        ),
    ],
)
def test_from_knn_rejects_bad_input(kwargs, error, message):
    args = {
        "knn": torch.tensor([[0, 4]]),
        "rf_index": torch.tensor([[0], [2]]),
        "n_in": 4,
        "in_channels": 2,
        "v": 3,
    }
    args.update(kwargs)
    knn, rf_index = args.pop("knn"), args.pop("rf_index")
    with pytest.raises(error, match=message):
        KNNMeta.from_knn(knn, rf_index, **args)


def test_int32_indices_are_accepted_as_int64():
    meta = KNNMeta.from_knn(
        torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([[0], [0]], dtype=torch.int32),
        n_in=2,
        in_channels=1,
        v=1,
    )
    assert meta.knn.dtype == torch.int64


@pytest.mark.parametrize(
    "local_rf,message",
    [
        (torch.tensor([[[1.0, 1.0]]]), r"local_rf\[0, 0, :\] has 2 ones"),
        (torch.tensor([[[0.0, 0.0]]]), r"local_rf\[0, 0, :\] has 0 ones"),
        (torch.tensor([[[0.5, 0.5]]]), "entries 0 or 1"),
        (torch.tensor([[1.0, 0.0]]), r"local_rf must be \[Nout, K, V\]"),
    ],
)
def test_from_local_rf_rejects_non_one_hot(local_rf, message):
    with pytest.raises(ValueError, match=message):
        KNNMeta.from_local_rf(torch.tensor([[0]]), local_rf, n_in=1, in_channels=1)


def test_sparse_and_nested_graphs_are_named():
    meta = random_meta(4, 4)
    local_rf = meta.local_rf().to_sparse()
    with pytest.raises(TypeError, match="local_rf must be a dense .* torch.sparse_coo"):
        KNNMeta.from_local_rf(meta.knn, local_rf, n_in=meta.n_in, in_channels=3)
    with warnings.catch_warnings():  # the strided layout is "in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        knn = torch.nested.nested_tensor(list(meta.knn))
    with pytest.raises(TypeError, match="knn must be a dense .* nested tensor"):
        KNNMeta(knn, meta.rf_index, meta.n_in, 3, meta.v)


def fovi_like_layer(meta: KNNMeta, *, pad_token: bool):
    """A stand-in with the attributes of fovi's KNNConvLayer (no fovi import)."""
    layer = types.SimpleNamespace(
        in_channels=meta.in_channels,
        in_coords=torch.zeros(meta.n_in, 2),
        local_rf=meta.local_rf(),
        _k=meta.k,
    )
    if pad_token:
        layer.knn_indices_pad_token = meta.knn
    else:
        # fovi numbers pad coordinates n_in, n_in + 1, ...: all of them mean padding.
        knn = meta.knn.clone()
        knn[meta.pad_mask] += torch.arange(int(meta.pad_mask.sum()))
        layer.knn_indices = knn
    return layer


@pytest.mark.parametrize("pad_token", [True, False])
def test_from_layer(pad_token):
    meta = random_meta(9, 9)
    layer = fovi_like_layer(meta, pad_token=pad_token)
    assert KNNMeta.from_layer(layer).same_graph(meta)
    other = KNNMeta.from_layer(layer, in_channels=7)
    assert other.in_channels == 7


@pytest.mark.parametrize(
    "attribute,value,error,message",
    [
        ("knn_indices_pad_token", [[0, 1]], TypeError, "layer.knn_indices_pad_token must be a"),
        ("local_rf", "numpy", TypeError, "layer.local_rf must be a torch.Tensor"),
        ("in_coords", [[0.0, 0.0]], TypeError, "layer.in_coords must have a shape"),
        ("in_channels", 2.9, TypeError, "layer.in_channels must be an int"),
        ("in_channels", "2", TypeError, "layer.in_channels must be an int"),
    ],
)
def test_from_layer_rejects_bad_attributes(attribute, value, error, message):
    layer = fovi_like_layer(random_meta(2, 4), pad_token=True)
    if value == "numpy":
        value = layer.local_rf.numpy()
    setattr(layer, attribute, value)
    with pytest.raises(error, match=message):
        KNNMeta.from_layer(layer)


def test_from_layer_rejects_a_float_pad_token_count():
    layer = fovi_like_layer(random_meta(2, 4), pad_token=True)
    del layer.in_coords
    layer.knn_pad_token_val = 5.7
    with pytest.raises(TypeError, match="layer.knn_pad_token_val must be an int"):
        KNNMeta.from_layer(layer)


def test_from_layer_missing_attributes():
    with pytest.raises(TypeError, match="input node count"):
        KNNMeta.from_layer(types.SimpleNamespace())
    layer = fovi_like_layer(random_meta(2, 4), pad_token=True)
    del layer.local_rf
    with pytest.raises(TypeError, match="no local_rf"):
        KNNMeta.from_layer(layer)


@pytest.mark.parametrize("device", DEVICES)
def test_to_device(device):
    meta = random_meta(4, 4)
    moved = meta.to(device)
    assert moved.device.type == device
    assert moved.same_graph(meta)
    assert moved.to(device) is moved


def test_the_constructor_validates_too():
    with pytest.raises(ValueError, match=r"knn\[0, 2\] = 7"):
        KNNMeta(torch.tensor([[0, 5, 7, 2]]), torch.zeros(4, 1, dtype=torch.long), 5, 1, 1)


def test_meta_is_immutable():
    meta = random_meta(4, 4)
    with pytest.raises(AttributeError, match="KNNMeta is immutable"):
        meta.n_in = 3


def derive_twice_the_knn(meta):
    return {"twice": 2 * meta.knn}


def test_derived_data_is_computed_once_and_owned_by_the_meta():
    meta = random_meta(4, 4)
    calls = []

    def derive(m):
        calls.append(m)
        return derive_twice_the_knn(m)

    first = meta.derived("mine", derive)
    assert meta.derived("mine", derive) is first and calls == [meta]
    assert random_meta(4, 4).derived("mine", derive) is not first  # another meta: its own data
    assert len(calls) == 2


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_carry_graph_and_derived_data(how):
    meta = random_meta(4, 4)
    meta.derived("mine", derive_twice_the_knn)
    copied = copy.deepcopy(meta) if how == "deepcopy" else pickle.loads(pickle.dumps(meta))
    assert copied is not meta and copied.same_graph(meta)
    data = copied.derived("mine", lambda m: pytest.fail("a copy derives again"))
    assert torch.equal(data["twice"], 2 * meta.knn)
    assert copied.knn.data_ptr() != meta.knn.data_ptr()  # its own tensors


def test_threads_deriving_at_once_agree():
    meta = random_meta(9, 9, n_in=300, n_out=200)
    results = []

    def work():
        results.append(meta.derived("mine", derive_twice_the_knn)["twice"])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(torch.equal(r, results[0]) for r in results)


# ------------------------------------------------- issue 19: refused with the argument named
def test_same_graph_refuses_what_is_not_a_meta():
    with pytest.raises(TypeError, match="other must be a fovi_ref.KNNMeta, got str"):
        random_meta(4, 4).same_graph("x")


def test_a_meta_is_not_moved_to_the_meta_device():
    meta = random_meta(4, 4)
    with pytest.raises(ValueError, match="'meta' device"):
        meta.to("meta")
    assert meta.device.type == "cpu" and meta.same_graph(random_meta(4, 4))


@pytest.mark.parametrize(
    "sizes,message",
    [
        ({"n_in": 2**40}, r"in_channels \* \(n_in \+ 1\)"),
        ({"n_in": 2**62}, r"in_channels \* \(n_in \+ 1\)"),
        ({"in_channels": 2**40}, r"in_channels \* \(n_in \+ 1\)"),
        ({"v": 2**40}, r"in_channels \* v \* n_out"),
        ({"in_channels": 2**27, "n_in": 4}, r"in_channels \* k \* n_out"),
    ],
)
def test_sizes_no_index_can_address_are_refused(sizes, message):
    """n_in = 2**40 was accepted, and a layer on it then asked for 32 TiB."""
    knn = torch.zeros(20, 1, dtype=torch.long)  # [K, Nout]: K * Nout = 20
    args = {"n_in": 4, "in_channels": 2, "v": 3, **sizes}
    with pytest.raises(ValueError, match=message + r" = \d+ exceeds 2\*\*31"):
        KNNMeta(knn, torch.zeros(1, 20, dtype=torch.long), *args.values())


def test_sizes_at_the_bound_are_accepted():
    knn = torch.zeros(1, 1, dtype=torch.long)
    meta = KNNMeta(knn, knn, 2**30 - 1, 2, 1)  # in_channels * (n_in + 1) = 2**31
    assert meta.n_in == 2**30 - 1


class _ListDerive:
    name = "list_derive"
    grad_input = grad_weight = None

    @staticmethod
    def derive(meta):
        return [meta.knn]

    @staticmethod
    def forward(meta, x, weight, bias):
        raise AssertionError("not reached")


@pytest.mark.parametrize("result", [[torch.zeros(1)], {"a": [1]}, {1: torch.zeros(1)}])
def test_a_derive_that_returns_no_dict_of_tensors_names_the_backend(result):
    from fovi_ref import prepare

    meta = random_meta(4, 4)
    with pytest.raises(TypeError, match="backend 'mine': derive.* must return a dict"):
        meta.derived("mine", lambda m: result)
    assert "mine" not in meta._derived  # nothing kept
    from fovi_ref import register_ops, unregister_ops

    register_ops(_ListDerive)
    try:
        with pytest.raises(TypeError, match="backend 'list_derive': derive"):
            prepare(meta, "list_derive")
    finally:
        unregister_ops("list_derive")


def test_from_layer_names_a_transposed_pad_token():
    """Before: a [Nout, K] knn_indices_pad_token was blamed on rf_index."""
    meta = random_meta(3, 4)
    layer = fovi_like_layer(meta, pad_token=True)
    layer.knn_indices_pad_token = meta.knn.t()
    with pytest.raises(
        ValueError, match=r"knn_indices_pad_token has shape \(20, 3\) \(transposed\?\)"
    ):
        KNNMeta.from_layer(layer)
