"""check_ops on fovi_ref's own backends, and on ops that differ in the ways a foreign
implementation can (outside the registry or the protocol, another output dtype, exceptions,
fovi 2.4.0's zeroed all-padding outputs)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ForeignOps

from fovi_ref import get_ops, knn_autograd
from fovi_ref.check.check_ops import CHECKS, F16_PAST_MAX_NOTE, GRAD_Z_PAST_MAX_NOTE, check_ops

FAST = ("random", "layer4.0.downsample.0", "layer4.1.conv1")
LOW = (torch.float16, torch.bfloat16)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reports():
    return {name: check_ops(name, graphs=FAST) for name in ("general", "gather_gemm")}


@pytest.mark.parametrize("name", ["general", "gather_gemm"])
def test_fovi_ref_backends_pass(reports, name):
    report = reports[name]
    assert report.ok, report.table(report.failures)
    checks = {r.check for r in report.rows}
    # every check ran at least once; rounding needs a cell of three neighbours, which K = 1 lacks
    assert set(CHECKS) - ({"rounding"} if name == "gather_gemm" else set()) <= checks
    assert {r.dtype for r in report.rows} >= {"float64", "float32", "float16", "bfloat16"}


def test_gather_gemm_graphs_it_does_not_support_are_skipped(reports):
    skipped = [r for r in reports["gather_gemm"].rows if r.check == "supports"]
    assert {r.graph for r in skipped} == {
        "random_k4_v2",
        "random_k3_v9",
        "crowded_k2_v4",
        "layer4.1.conv1",
    }
    assert all(r.ok and "skipped" in r.note for r in skipped)


def test_einsum_baseline_differs_only_where_fovis_path_makes_inf_or_nan():
    """fovi's path multiplies every neighbour by its one-hot row, so an inf input becomes nan in
    every *other* cell of its channel (inf * 0): grad_weight is nan where the formula has finite
    values. It also stores float16 cells and float16
    ``grad_z``, so a cell past 65504 makes a finite y inf (and the grad_weight that reads it
    non-finite), and a ``grad_z`` past 65504 a finite grad_x nan. Nothing else differs; with
    one cell (V = 1) and one neighbour (K = 1) only the stored ``grad_z`` does."""
    report = check_ops("einsum_baseline", graphs=FAST)
    failures = report.failures
    assert failures, "the known differences went away: update this test and the docs"
    found = {(r.check, r.dtype, r.quantity) for r in failures}
    assert {(c, q) for c, _, q in found} == {
        ("nonfinite", "grad_weight"),
        ("rounding", "y"),
        ("rounding", "grad_weight"),
        ("rounding", "grad_x"),
    }
    assert {d for c, d, _ in found if c == "rounding"} == {"float16"}
    assert {r.note.split("; ")[-1] for r in failures if r.graph == "random_k1_v1"} == {
        GRAD_Z_PAST_MAX_NOTE
    }
    assert all("non-finite mismatches" in r.note for r in failures)
    past_max = {
        "y": F16_PAST_MAX_NOTE,
        "grad_weight": F16_PAST_MAX_NOTE,
        "grad_x": GRAD_Z_PAST_MAX_NOTE,
    }
    assert all(r.note.endswith(past_max[r.quantity]) for r in failures if r.check == "rounding")


def test_an_unregistered_ops_object_is_judged_on_what_a_backend_computes():
    report = check_ops(ForeignOps, graphs=["random"], dtypes=LOW)
    assert report.ok, report.table(report.failures)
    assert {r.quantity for r in report.rows if r.check == "oracle"} == {
        "y",
        "grad_x",
        "grad_weight",
    }  # grad_bias is the op's sum, not the backend's


def test_an_object_outside_the_protocol_is_refused_before_anything_runs():
    with pytest.raises(TypeError, match="grad_input must be callable"):
        check_ops(
            type(
                "NoGradInput",
                (),
                {
                    "name": "half",
                    "forward": ForeignOps.forward,
                    "grad_weight": ForeignOps.grad_weight,
                },
            )
        )


class Float32Gradients(ForeignOps):
    """Returns grad_weight in float32 whatever the inputs' dtype."""

    name = "float32_gradients"

    @staticmethod
    def grad_weight(meta, grad_y, x):
        return ForeignOps.grad_weight(meta, grad_y, x).float()


def test_a_gradient_in_the_wrong_dtype_is_reported_as_what_it_is():
    report = check_ops(
        Float32Gradients,
        graphs=["random"],
        dtypes=(torch.float64, torch.float32),
        checks=("oracle",),
    )
    f64 = [r for r in report.rows if r.dtype == "float64"]
    assert f64 and all(not r.ok and "torch.float32 from grad_weight" in r.note for r in f64)
    assert all(r.ok and not r.note for r in report.rows if r.dtype == "float32")


class Raises(ForeignOps):
    name = "raises"

    @staticmethod
    def grad_input(meta, grad_y, weight):
        raise RuntimeError("not implemented")


def test_an_exception_is_a_failed_row_not_a_crash():
    report = check_ops(
        Raises, graphs=["random"], dtypes=(torch.float32,), checks=("oracle", "gradcheck")
    )
    assert not report.ok
    assert all("RuntimeError: not implemented" in r.note for r in report.failures)


def test_gradcheck_budget_counts_the_outputs_it_back_propagates():
    """nout_65 holds 144 input and 520 output numbers (664), nout_127 144 and 1016 (1160):
    the default budget of 700 gradchecks the first alone, a budget of 1160 both."""
    graphs = ["nout_65", "nout_127"]
    kwargs = dict(graphs=graphs, dtypes=(torch.float64,), checks=("gradcheck",))
    default = check_ops("general", **kwargs)
    wider = check_ops("general", gradcheck_max_numbers=1160, **kwargs)
    assert default.ok and wider.ok
    assert [r.graph for r in default.rows if r.check == "gradcheck"] == ["nout_65"]
    assert [r.graph for r in wider.rows if r.check == "gradcheck"] == graphs


def test_the_custom_op_door_is_judged_on_its_bias_gradient_too():
    """The compiled door sums grad_y into grad_bias itself (knn_autograd's backward rule), so
    the doors check judges that gradient beside the backend's three quantities."""
    report = check_ops("general", graphs=["base"], dtypes=(torch.float64,), checks=("doors",))
    custom = [r.quantity for r in report.rows if r.note == "custom op (the compiled door)"]
    assert report.ok and custom == ["y", "grad_x", "grad_weight", "grad_bias"]


def test_the_custom_op_door_is_judged_with_one_gradient_asked_for_at_a_time():
    """A frozen weight or input: each gradient asked for alone (grad_x and grad_weight without
    a bias), on the calling-convention graph only. A backward that computes grad_x only when
    the weight wants a gradient fails the row of grad_x alone."""
    report = check_ops("general", graphs=["base"], dtypes=(torch.float64,), checks=("doors",))
    alone = [r.quantity for r in report.rows if r.note.endswith("alone asked for")]
    assert report.ok and alone == ["grad_x", "grad_weight", "grad_bias"]
    sizes = check_ops("general", graphs=["nout_65"], dtypes=(torch.float64,), checks=("doors",))
    assert not [r for r in sizes.rows if r.note.endswith("alone asked for")]


def doors_with_backward(backward) -> list:
    """check_ops' ``doors`` rows of ``general`` on the calling-convention graph, in float64,
    with the custom op's backward rule replaced by ``backward`` (a planted bug) for the run."""
    op, setup = knn_autograd._knn_conv_op, knn_autograd._setup_context
    op.register_autograd(backward, setup_context=setup)
    try:
        report = check_ops("general", graphs=["base"], dtypes=(torch.float64,), checks=("doors",))
    finally:
        op.register_autograd(knn_autograd._backward, setup_context=setup)
    return report.rows


def test_a_door_that_drops_a_gradient_asked_for_alone_fails():
    """The custom op's backward rule with one planted bug: grad_x only where the weight wants a
    gradient too (mutmut wrote it: knn_autograd's needs_input_grad[0] read as [1])."""

    def drops_grad_x_with_a_frozen_weight(ctx, grad_y):
        grad_x, *rest = knn_autograd._backward(ctx, grad_y)
        return (grad_x if ctx.needs_input_grad[1] else None, *rest)

    (failed,) = [r for r in doors_with_backward(drops_grad_x_with_a_frozen_weight) if not r.ok]
    assert failed.quantity == "grad_x" and "(custom op, grad_x alone asked for)" in failed.note


def test_a_door_that_drops_grad_x_in_a_bias_free_layer_fails():
    """grad_x and grad_weight alone are asked of a layer without a bias: a backward rule that
    returns grad_x only where the layer has a bias fails the row of grad_x alone (and no other:
    with every gradient asked for, the layer has its bias)."""

    def grad_x_only_with_a_bias(ctx, grad_y):
        grad_x, *rest = knn_autograd._backward(ctx, grad_y)
        return (grad_x if ctx.has_bias else None, *rest)

    (failed,) = [r for r in doors_with_backward(grad_x_only_with_a_bias) if not r.ok]
    assert failed.quantity == "grad_x" and "(custom op, grad_x alone asked for)" in failed.note


def test_a_door_that_raises_for_one_gradient_alone_still_has_the_others_judged():
    """A backward rule that raises where the weight is frozen fails the rows of grad_x alone
    and grad_bias alone, each with the error; grad_weight alone, between them, is still judged
    (and passes)."""

    def raises_with_a_frozen_weight(ctx, grad_y):
        if not ctx.needs_input_grad[1]:
            raise RuntimeError("the weight is frozen")
        return knn_autograd._backward(ctx, grad_y)

    rows = doors_with_backward(raises_with_a_frozen_weight)
    alone = [(r.quantity, r.ok) for r in rows if "alone asked for" in r.note]
    assert alone == [("grad_x", False), ("grad_weight", True), ("grad_bias", False)]
    assert [r.note for r in rows if not r.ok] == [
        f"raised RuntimeError: the weight is frozen (custom op, {q} alone asked for)"
        for q in ("grad_x", "grad_bias")
    ]


class ZeroesEmptyNodes(ForeignOps):
    """fovi 2.4.0's layer: outputs of all-padding nodes are zero."""

    name = "zeroes_empty_nodes"

    @staticmethod
    def forward(meta, x, weight, bias):
        y = ForeignOps.forward(meta, x, weight, bias)
        return y.masked_fill(meta.pad_mask.all(dim=0), 0.0)


def test_all_padding_zero_follows_fovi_2_4():
    kwargs = dict(graphs=["random"], dtypes=LOW, checks=("oracle", "padding"))
    assert check_ops(ZeroesEmptyNodes, all_padding="zero", **kwargs).ok
    formula = check_ops(ZeroesEmptyNodes, **kwargs)
    assert {(r.check, r.quantity) for r in formula.failures} == {("oracle", "y"), ("padding", "y")}


def test_report_reads_as_a_table_and_as_json(reports):
    report = reports["gather_gemm"]
    text = str(report)
    assert text.startswith("check_ops(gather_gemm): ")
    for line in text.splitlines()[1:]:  # fixed columns in 80 characters, then the note
        assert len(line) <= 100 or line[80:82] == "  "
    data = json.loads(report.to_json())
    assert data["ok"] is True and len(data["rows"]) == len(report.rows)


@pytest.mark.parametrize("name", ["general", "gather_gemm"])
def test_backends_round_the_bias_once(name):
    """The target of the core rewrite (bias added inside the GEMM): fails while the backends
    add the bias after the GEMM, in float16/bfloat16, where the bias cancels W x."""
    report = check_ops(
        name, graphs=FAST, dtypes=LOW, bias_rounding="fused", checks=("oracle", "cancellation")
    )
    assert report.ok, report.table(report.failures)


class CallingConventionBug:
    """``general`` with one planted bug that only a caller's unusual operands reveal."""

    def __init__(self, kind):
        self.name, self.kind, self.inner = f"planted_{kind}", kind, get_ops("general")

    def forward(self, meta, x, weight, bias):
        if self.kind == "noncontiguous_x" and not x.is_contiguous():
            x = x.transpose(1, 2).contiguous().view(x.shape)  # storage read as contiguous
        if self.kind == "bias_none" and bias is None:
            bias = weight.new_ones(weight.shape[0])
        if self.kind == "noncontiguous_weight" and not weight.is_contiguous():
            weight = weight.t().contiguous().view(weight.shape)  # storage read as contiguous
        if self.kind == "one_output_channel" and weight.shape[0] == 1:
            bias = None  # a [1] bias squeezed to a scalar and dropped
        if self.kind == "noncontiguous_bias" and bias is not None and not bias.is_contiguous():
            bias = torch.as_strided(bias, bias.shape, (1,))  # storage read as contiguous
        y = self.inner.forward(meta, x, weight, bias)
        if self.kind == "past_batch_3" and x.shape[0] > 3:
            y = y.clone()
            y[3:] = y[2:3]
        return y

    def grad_input(self, meta, grad_y, weight):
        if self.kind == "noncontiguous_grad_y" and not grad_y.is_contiguous():
            grad_y = grad_y.contiguous().transpose(1, 2).reshape(grad_y.shape)
        return self.inner.grad_input(meta, grad_y, weight)

    def grad_weight(self, meta, grad_y, x):
        return self.inner.grad_weight(meta, grad_y, x)


@pytest.mark.parametrize(
    "kind",
    [
        "noncontiguous_x",
        "bias_none",
        "past_batch_3",
        "noncontiguous_grad_y",
        "noncontiguous_weight",
        "noncontiguous_bias",
        "one_output_channel",
    ],
)
def test_the_battery_catches_bugs_of_layout_bias_none_and_batch(kind):
    report = check_ops(
        CallingConventionBug(kind),
        graphs=["random"],
        dtypes=(torch.float32,),
        checks=("oracle", "variants"),
    )
    assert not report.ok
    assert {r.check for r in report.failures} == {"variants"}


def test_a_result_in_another_dtype_fails_the_rule():
    from fovi_ref.check.check_ops import random_meta
    from fovi_ref.check.operands import forward_and_grads, sample_operands
    from fovi_ref.check.tolerances import expected_quantities, judge_elementwise

    meta = random_meta(2, 4)
    x, w, b, gy = sample_operands(meta, 3, batch=2, dtype=torch.float16)
    y = forward_and_grads(x.float(), w.float(), b.float(), meta, None, "general")[0]
    expected = expected_quantities(x, w, b, meta, gy)["y"]
    verdict = judge_elementwise(y, expected, dtype=torch.float16)
    assert not verdict.ok and "returned float32" in verdict.notes
    assert judge_elementwise(y, expected, dtype=torch.float16, any_dtype=True).ok


@pytest.mark.parametrize("empty", [dict(dtypes=()), dict(graphs=[]), dict(checks=())])
def test_an_empty_battery_raises(empty):
    with pytest.raises(ValueError, match="empty battery"):
        check_ops("general", **{"graphs": ["random"], **empty})


def test_one_graph_name_as_a_string_is_that_graph():
    """``graphs="random"`` used to be read letter by letter ("unknown layer 'r'")."""
    report = check_ops("general", graphs="random", dtypes=(torch.float64,), checks=("oracle",))
    assert report.ok and {r.graph for r in report.rows} >= {"random_k1_v1", "crowded_k2_v4"}


@pytest.mark.parametrize(
    "bad",
    [
        dict(batch=2.5),
        dict(batch=True),
        dict(dtypes=(torch.int64,)),
        dict(dtypes=torch.float64),
        dict(checks="oracle"),
    ],
    ids=["batch 2.5", "batch True", "dtype int64", "dtypes a dtype", "checks a str"],
)
def test_arguments_that_are_not_what_they_say_are_refused_by_name(bad):
    """batch=2.5 ran batch 2, an int64 dtype gave a table of exceptions, a bare dtype or check
    name failed deep inside: each is refused up front, naming the argument."""
    args = {"graphs": ["random"], "dtypes": (torch.float64,), "checks": ("oracle",), **bad}
    with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
        check_ops("general", **args)


# ------------------------------------------------------------------ argument errors, by name
@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(graphs=["random"], seed=2**64), ValueError, r"seed must be in \[0, "),
        (dict(graphs=["random"], seed=1.5), TypeError, "seed must be an int"),
        (dict(graphs=["random"], gradcheck_max_numbers="a"), TypeError, "gradcheck_max_numbers"),
        (dict(graphs=["random"], all_padding="none"), ValueError, "all_padding"),
    ],
)
def test_check_ops_names_the_argument_it_refuses(kwargs, error, message):
    with pytest.raises(error, match=message):
        check_ops("general", **kwargs)


def test_a_graph_item_without_a_name_or_with_a_bad_channel_count_is_refused_by_name():
    from fovi_ref.check.graphs import TestGraph, random_meta

    meta = random_meta(2, 4)
    with pytest.raises(TypeError, match="graphs: a bare KNNMeta .* TestGraph"):
        check_ops("general", graphs=[meta])
    with pytest.raises(ValueError, match="out_channels must be an int >= 1, got -2"):
        check_ops("general", graphs=[TestGraph("mine", meta, -2)])


def test_the_oracle_and_the_tolerance_rule_name_a_mismatched_operand():
    from fovi_ref.check.graphs import random_meta
    from fovi_ref.check.operands import sample_operands
    from fovi_ref.check.tolerances import expected_quantities
    from fovi_ref.check.verify import verify_meta
    from fovi_ref.reference import knn_conv_reference

    meta = random_meta(2, 4)
    x, w, b, gy = sample_operands(meta, 3, batch=2)
    with pytest.raises(ValueError, match=r"x must be \[B, Cin, Nin\] = \[2, 3, 16\]"):
        knn_conv_reference(x[:, :, :5], w, b, meta)
    with pytest.raises(ValueError, match=r"weight must be \[Cout, Cin\*V\]"):
        knn_conv_reference(x, w[:, :5], b, meta)
    with pytest.raises(ValueError, match=r"grad_y must be \[B, Cout, Nout\] = \[2, 3, 12\]"):
        expected_quantities(x, w, b, meta, gy[:, :, :4])
    with pytest.raises(ValueError, match=r"bias must be \[Cout\]"):
        expected_quantities(x, w, b[:2], meta, gy)
    with pytest.raises(TypeError, match="meta must be a fovi_ref.KNNMeta, got NoneType"):
        verify_meta("mine", None, 3)
    with pytest.raises(ValueError, match="out_channels must be >= 1, got -2"):
        verify_meta("mine", meta, -2)


def test_an_unknown_graph_name_or_device_is_refused_by_name():
    with pytest.raises(ValueError, match="graphs: unknown graph 'no_such_graph'; an item is"):
        check_ops("general", graphs=["no_such_graph"])
    with pytest.raises(ValueError, match="device: "):
        check_ops("general", graphs=["base"], device="gpu7")
