"""fovi_ref: a readable reference for fovi's KNN convolution (the op); :mod:`fovi_ref.check` is
the harness that judges and times it.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

The graph (:mod:`~fovi_ref.meta`), the float64 oracle (:mod:`~fovi_ref.reference`), the backends
(:mod:`~fovi_ref.knn_general`, :mod:`~fovi_ref.knn_gather_gemm`,
:mod:`~fovi_ref.knn_einsum_baseline`), their registry, the op (:mod:`~fovi_ref.knn_autograd`),
the layer, regular-grid metas (:mod:`~fovi_ref.grid`), fovi-resnet18's graphs
(:mod:`~fovi_ref.geometry`).

Promises
--------
**Two doors to one computation.** In eager mode ``knn_conv`` calls the routed backend through a
``torch.autograd.Function`` handed the ``KNNMeta`` itself: a few Python checks per call, nothing
looked up. While ``torch.compile`` or ``torch.export`` trace, it calls the custom op
``fovi_ref::knn_conv`` instead, whose fake implementation gives ``y``'s shape and strides and
whose autograd formula calls two more custom ops for the gradients. A custom op takes tensors and
plain values only, so the graph travels into it as its index tensors, the backend's derived
tensors and a few ints, from which the op rebuilds a trusted meta.

The derived data must therefore exist before tracing. A ``KNNConv`` derives it when its graph is
set and keeps it as non-persistent buffers, so compiled and exported programs carry it; a raw
``KNNMeta`` passed to ``knn_conv`` in compiled code needs ``fovi_ref.prepare(meta)`` in eager mode
first (compiling or exporting without it raises an error whose first line names that call, with
graph breaks allowed too)::

    model = torch.nn.Sequential(
        fovi_ref.KNNConv(64, 128, meta_a), torch.nn.ReLU(), fovi_ref.KNNConv(128, 128, meta_b)
    )
    compiled = torch.compile(model, fullgraph=True)  # no graph breaks; dynamic=True works too
    program = torch.export.export(model, (torch.randn(4, 64, meta_a.n_in),))

    fovi_ref.prepare(meta_a)  # a raw meta, before compiling
    f = torch.compile(lambda x, w, b: fovi_ref.knn_conv(x, w, b, meta_a), fullgraph=True)

``tests/test_custom_op.py`` runs ``torch.library.opcheck``, compiles with ``fullgraph=True``
(static and dynamic batch), exports, and checks determinism.

**Loading an exported program.** A saved program names the op ``fovi_ref::knn_conv``, which
exists only once ``fovi_ref`` is imported: in a fresh process, ``import fovi_ref`` before
``torch.export.load``, or the load fails with torch's ``SerializeError ... Please import the
custom op``. TorchScript cannot compile a ``KNNConv`` (``torch.jit.script`` raises, saying so):
use ``torch.export`` or ``torch.compile``. ``tests/test_export_load.py`` checks all three.

**torch.func.** ``grad``, ``vjp``, ``vmap`` (over inputs, a batch of weights, an ensemble stacked
with ``stack_module_state``), per-sample gradients ``vmap(grad(...))``, ``jvp``, ``jacrev``,
``jacfwd`` and ``functional_call`` (of parameters: a swapped graph or derived buffer is refused,
see State) work on ``knn_conv`` and ``KNNConv`` in eager mode; the rules
live in :mod:`~fovi_ref.knn_transforms` (the op is linear in ``x`` and in ``weight``).
``tests/test_torch_func.py`` compares each with the same transform of the float64 oracle.

**Gradients.** First-order only: a gradient of a gradient (``hessian``, ``grad(grad(...))``)
raises "knn_conv is first-order only" (nothing is computed silently). In-place ops on ``y`` work
in both doors, with the right gradients. The eager door saves only what the requested gradients
read, so an ``x`` made under ``torch.inference_mode()`` trains the bias of a frozen layer.

**Determinism.** With ``torch.use_deterministic_algorithms(True)`` every backend runs and repeats
bitwise. Without it: ``general`` is deterministic anyway (segment sums in collision-free rounds
with a fixed order); ``gather_gemm``'s dense-``S`` path is a GEMM; its index path and
``einsum_baseline``'s backward add with atomics on CUDA, so their rounding may differ between runs
where several outputs share an input. On CPU all paths repeat bitwise.

**Threads.** At a fixed thread count every backend repeats its ``y`` and gradients bitwise, run
to run. Under another thread count the results stay within the elementwise tolerance rule, and
nothing stronger is promised: MKL blocks its GEMMs by thread count, so on some CPUs 1 and 2
threads differ in the last bits of float32 and float64 sums, ``gather_gemm`` included.
``tests/test_ordinary_use.py`` checks exactly the two promises.

**Autocast.** Inside ``torch.autocast(device, dtype)`` ``knn_conv`` follows autocast's rule for
``F.linear`` (float32 and float16 operands cast to the autocast dtype, float64 left alone), in
eager and compiled code alike; the backward may run outside the block.

**float16 and bfloat16** sums are accumulated in float32, and the GEMMs run in the dtype
:func:`fovi_ref.precision.gemm_dtype` names for the device: *wide* (float32 GEMMs; ``y`` and every
gradient rounded once, at the end) where the hardware has no fast 16-bit GEMM, *narrow* (16-bit
GEMMs accumulating in float32) where it has one (tensor cores, AVX512-BF16, AMX). Narrow stores each
binned cell and ``grad_z = W^T grad_y`` once in 16 bits, as fovi's einsum stores its cells, where
every value fits; nothing else is rounded before the result. The table is data, held to a
measurement (``python -m fovi_ref bench --gemm-dtypes``), and the rule that judges both paths is
:mod:`fovi_ref.check.tolerances`. A float16 cell sum past 65504 stays finite on both paths (a narrow
call keeps such cells in float32) where ``einsum_baseline`` (storing cell sums in float16 as fovi
2.4.0 does) gives inf; ``verify --fovi`` reports it as a finding about fovi. Likewise a float16
``grad_z`` past 65504 (a gradient scaler's upstream gradients make one) stays float32 on a narrow
call, never inf, where ``einsum_baseline`` gives nan when two such values cancel (check
``rounding``). One level up, ``general`` and ``einsum_baseline`` add a cell's inputs before the
weight applies, so where that sum passes the largest value of the accumulation dtype ``y`` is inf or
nan although ``F.linear`` would stay finite: the result is then non-finite, never a wrong finite
number (``tests/test_adversarial.py``); ``gather_gemm`` is exempt.

**Non-finite values.** An inf or nan in ``x`` or in the weight reaches the elements the float64
oracle says, with one allowance: a non-finite ``weight[o, c*V + v]`` may make every
``y[:, o, :]`` and every ``grad_x[:, c, :]`` non-finite, also at nodes that never fill that cell
and at inputs no node reads (the oracle leaves those finite). The operator is one GEMM over all
``Cin*V`` weight columns, and an empty cell enters it as a zero (``0 * inf`` is nan), as in
fovi's ``F.linear``; backward, ``W^T grad_y`` carries the inf to every node, and a backward that
sums it with a matrix (``gather_gemm``'s dense ``S``, fovi's one-hot einsum) meets the same
zeros. Keeping those elements finite would mean masking every GEMM. ``grad_weight`` follows the
oracle exactly. Non-finite upstream gradients are not promised (the GEMMs meet the same zeros).
An infinite result keeps its sign (an inf input times finite weights may also come back nan, as
a one-hot einsum's ``0 * inf`` gives, never as the other inf), and a finite answer comes back
non-finite only where the result itself rounds past the dtype's range: a stored intermediate
never overflows into it (:mod:`fovi_ref.check.tolerances`, "Non-finite values"). ``check_ops``'
``nonfinite`` check judges this. On a CPU with native bfloat16 GEMMs (oneDNN on AVX512-BF16)
a bfloat16 GEMM over rows not a multiple of 32 values long reads past each row's end, where an
inf of the next row gives ``0 * inf = nan`` in the row before; fovi_ref pads such rows
(:mod:`fovi_ref.layout`), and fovi's ``F.linear`` over its one-hot features (``einsum_baseline``)
does not.

**Subnormals.** The same bfloat16 GEMMs read a subnormal operand (below ``2^-126``) as zero and
flush a product or partial sum below it to zero, so a bfloat16 result whose terms are that small
may come back zero; the tolerance rule allows exactly that (step 2 (f)). float16 keeps its
subnormals.

**State.** A ``KNNConv`` keeps its graph (``knn``, ``rf_index``) as persistent buffers and what
its backend derives as non-persistent buffers, so ``.to()``, ``copy.deepcopy``, ``pickle``,
``torch.save(model)`` and state-dict round trips give working layers with identical outputs.
``layer.meta = new_meta`` changes the graph (validated, re-derived); assigning ``layer.knn`` or a
derived buffer raises, and so does running the layer with one swapped in by
``torch.func.functional_call``: it computes only the graph it holds. The state dict carries
``n_in`` and ``V`` (extra state), so a load over another input or cell count is refused by name;
state dicts written without them still load. A refused load, backend or conversion changes
nothing, whether the load is refused for the graph, the extra state, a weight or bias torch
could not copy (the meta device, sparse, ``None``) or the forced backend's derive. Inside a
container torch judges the keys after the whole load, so a strict load refused for a key has
loaded the rest: to change nothing there, load into ``copy.deepcopy(model)`` first. Building on
the meta device works as in torch (``to_empty``, then ``load_state_dict``); a layer without graph
values refuses to run. Editing the index buffers in place is not supported (and not detected).

**Output layout.** ``y [B, Cout, Nout]`` is returned as fovi returns it, a transposed view of
``[B, Nout, Cout]`` storage, so a model swapped from fovi to fovi_ref hands the next layer the
same strides. A registered backend may return another layout: eager code gets it as returned,
compiled code gets fovi's (the custom op copies ``y`` into it, as its fake promises).
"""

from fovi_ref.knn_autograd import derive_for, knn_conv, prepare, route, route_layer
from fovi_ref.layer import KNNConv
from fovi_ref.meta import DTYPES, KNNMeta, dtype_name
from fovi_ref.registry import available_ops, get_ops, register_ops, unregister_ops

__all__ = [
    "DTYPES",
    "KNNConv",
    "KNNMeta",
    "available_ops",
    "derive_for",
    "dtype_name",
    "get_ops",
    "knn_conv",
    "prepare",
    "register_ops",
    "route",
    "route_layer",
    "unregister_ops",
]
