"""fovi 2.4.0, the release users install, run through its own code and judged by fovi_ref.

fovi computes the same operator as fovi_ref::

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

in a ``KNNConvLayer`` whose ``forward`` asks a dispatcher (``select_backend`` in
``fovi/arch/knn_optimization.py``) for one of nine backends. This module runs fovi's code
unchanged, at three depths:

- ``"layer"``: ``KNNConvLayer.forward``, what a user's model runs: dispatcher, backend and the
  all-padding mask. The backend is forced through fovi's own override, the environment variable
  ``FOVI_KNN_BACKEND`` (:func:`fovi_backend`), which beats every layer's ``kernel_backend``.
  ``baseline`` (gather + one-hot einsum + ``F.linear``, autograd backward) and ``torch_scatter``
  exist only at this depth.
- ``"function"``: fovi's ``KNNConvFunction`` (its ``torch.autograd.Function``) on a registry
  backend (``torch_compact``, ``gather_gemm``, and on CUDA ``cuda``, ``warp_train``), with its
  dtype policy: gradients cast back to the operands' dtypes, ``grad_bias`` summed in float32.
- ``"direct"``: the registry object's ``forward`` / ``grad_input`` / ``grad_weight`` called on
  fovi's ``TrainingMeta`` (:func:`to_fovi_meta`), exactly as ``KNNConvFunction`` calls them.

:class:`FoviOps` wraps any of them in fovi_ref's ops protocol (functions of a :class:`KNNMeta`),
so :func:`fovi_ref.check.check_ops.check_ops` can judge fovi like any fovi_ref backend
(:func:`check_fovi_ops`); :func:`verify_fovi` judges the layer path on fovi's own fovi-resnet18
layers by the elementwise rule (:mod:`fovi_ref.check.tolerances`), against the float64 oracle.

Where fovi 2.4.0 differs from the formula or from itself (each one tested in
``tests/test_fovi_upstream.py``):

1. **All-padding outputs are zeroed.** ``KNNConvLayer.forward`` sets to 0 every output node whose
   neighbours are all padding, where the formula gives ``bias[o]``; such nodes pass no gradient
   to the bias. Only the layer does it: fovi's ops (direct or through ``KNNConvFunction``) follow
   the formula. No fovi-resnet18 graph has such a node, and fovi's layers have no bias by default.
2. **Float32 gradients under float64.** ``torch_compact`` accumulates ``grad_input`` and
   ``grad_weight`` in float32 buffers; ``gather_gemm``'s ``grad_weight`` returns float32 whatever
   the dtype; ``KNNConvFunction`` sums ``grad_bias`` in float32. In float64 those gradients carry
   float32 rounding (relative errors near 1e-7 instead of 1e-16).
3. **A stale inference cache.** The inference backend ``torch_cached`` (and ``warp_cached`` on a
   GPU) caches the node-expanded weight keyed on each parameter's ``data_ptr`` and ``_version``.
   Writes through ``weight.data`` bump neither, and fovi's own ``load_conv2d_weights`` writes
   that way, so inference keeps using the old weight. On CPU the dispatcher picks
   ``torch_cached`` for fovi-resnet18's stem (``conv1``, Cin = 3) whenever gradients are off.
4. **Backends disagree on the output layout.** ``baseline`` and ``torch_scatter`` return
   ``[B, Cout, Nout]`` as a transposed view of ``[B, Nout, Cout]`` storage; ``torch_compact``,
   ``gather_gemm`` (and ``torch_cached``, a permuted ``[Nout, B, Cout]``) return other strides.
   Values agree, but layers downstream (BatchNorm) may round differently on other strides, so a
   network's bits change with the backend the dispatcher picks.
5. **gather_gemm reads input node 0 for padding.** A padding neighbour gathers node 0 and is
   multiplied by 0, so a non-finite value at node 0 (read by no real neighbour) makes the padded
   outputs NaN (the layer then zeroes them, being all-padding) and the whole weight gradient NaN,
   where the formula gives finite values. No fovi-resnet18 K = 1 graph has padding.
6. **Dispatcher.** On CPU with gradients on, ``auto`` is ``baseline`` for every layer, before
   the K = V = 1 rule that picks ``gather_gemm`` (which applies on CUDA only). An explicitly
   requested inference-only backend falls back to ``baseline`` under autograd. A backend set in
   ``FOVI_KNN_BACKEND`` applies to every layer of every model: ``gather_gemm`` there raises on
   the first layer with K > 1, and ``cuda`` / ``warp_train`` raise on CPU tensors.
7. **Graphs depend on the machine.** fovi builds its graphs in float32 when a model is
   constructed and keeps them out of the ``state_dict``; another CPU, MKL code path or thread
   count settles near-ties of its distances the other way
   (:mod:`fovi_ref.geometry.certificate`), so a checkpoint runs a slightly different network on
   another machine (:mod:`~fovi_ref.check.fovi.machines` measures how different).

fovi is imported lazily: the rest of fovi_ref works without it, and every function here raises
:class:`FoviUnavailable` (an ``ImportError``) naming the install command when it is absent. Install
what this module needs with ``pip install --no-deps -r scripts/fovi-requirements.txt``.

The modules:

- :mod:`~fovi_ref.check.fovi.load`: importing fovi, its resnet18 and its layers.
- :mod:`~fovi_ref.check.fovi.backends`: its backends at three depths, its dispatcher,
  :class:`FoviOps` (fovi in fovi_ref's ops protocol), and its bench contenders.
- :mod:`~fovi_ref.check.fovi.models`: fovi models with fovi_ref layers swapped in, compared.
- :mod:`~fovi_ref.check.fovi.verify`: verdicts, diagnoses, the table (``verify --fovi``).
- :mod:`~fovi_ref.check.fovi.machines`: its graphs built under other arithmetic settings: flips,
  ties, and the effect on a network.

Everything is re-exported here: ``from fovi_ref.check import fovi as upstream``.

Verifying fovi 2.4.0
--------------------
fovi's dependency list includes CUDA-only packages (``cupy-cuda12x``, ``warp-lang``) and a
``torchvision`` that does not load against the CPU torch; ``scripts/fovi-requirements.txt`` pins
fovi and what fovi_ref's use of it needs, and says why each left-out requirement is left out.
Install it after fovi_ref, without dependency resolution::

    .venv/bin/pip install --no-deps -r scripts/fovi-requirements.txt
    .venv/bin/python -m fovi_ref verify --fovi     # fovi backend x layer x dtype verdicts
    .venv/bin/python -m fovi_ref bench --fovi      # fovi's backends beside fovi_ref's routed one

``verify --fovi`` prints one row per layer and fovi backend (every one that runs here), a cell
per dtype (float64 included) as in the ``verify`` table, and fovi's dispatcher choice beside
fovi_ref's route. A FAIL is a finding about fovi: under the table each group of failures says
which side is wrong and why, diagnosed from the relaxed rule the value passes. After the table it
reports how fovi's graphs depend on the machine (below). ``python -m fovi_ref verify --help``
gives its exit codes. ``bench --fovi`` times fovi's dispatcher choice and each training backend
beside fovi_ref's routed backend on every layer. ``notebooks/06_verifying_fovi.ipynb`` walks
through all of it and asserts each finding.

Checking your own fovi model
----------------------------
For any other fovi network (a ``KNNResNet`` with another ``in_res`` or ``fov``, or a model of
your own), give a factory that builds it; every ``KNNConvLayer`` in it gets the same table::

    .venv/bin/python -m fovi_ref verify --fovi-model mymodels:small_net   # def small_net(): ...

or from Python (``tests/test_readme.py`` runs this block as written)::

    import torch, fovi_ref
    from fovi_ref.check.fovi import format_fovi_table, load_knnresnet, verify_fovi_model

    model = load_knnresnet().KNNResNet(in_res=32, fov=20, layers=[1, 1, 1, 1], device="cpu")
    layer = model.layer2[0].downsample[0]  # one of your model's KNNConvLayers
    meta = fovi_ref.KNNMeta.from_layer(layer)  # its graph (fovi_ref never imports fovi)
    conv = fovi_ref.KNNConv(meta.in_channels, layer.out_channels, meta)  # the same op in fovi_ref
    y = conv(torch.randn(1, meta.in_channels, meta.n_in))
    checks = verify_fovi_model(model, layers=["layer2.0.downsample.0"], batch=1)  # omit: all
    backends = len({c.backend for c in checks})  # fovi backends judged
    print(fovi_ref.route(meta), tuple(y.shape), backends)  # gather_gemm (1, 128, 15) 5
    print(format_fovi_table(checks))  # the table and findings, as the CLI prints

:func:`load_knnresnet` imports fovi's ``KNNResNet`` without the packages of ``fovi[models]``;
build the model on the device you check it on (fovi's graphs do not move with ``.to()``). The
command prints the table this call prints (same dtypes, :data:`MODEL_DTYPES`, in the same column
order; pass ``--batch 2`` for the same operands) and exits with :func:`exit_status`: 0 when every
FAIL is a known finding about fovi, 1 on a new one, 1 on any with ``--strict``.

Graphs that depend on the machine
---------------------------------
fovi builds a model's graphs when the model is constructed, in float32, and does not save them in
the ``state_dict``. Its neighbour search ranks ``torch.cdist`` distances, which expand
``|p|^2 + |q|^2 - 2 p.q`` with a float32 GEMM, and another CPU, MKL code path or thread count
rounds that GEMM (and the vectorised ``cos``/``exp`` that place the points) differently, so
near-ties go the other way: **a checkpoint trained on one machine runs a slightly different
network on another.** ``resnet18_layers()`` reproduces fovi *on the machine at hand* (element for
element: a test builds fovi's model and compares), and three tools make that honest:

- ``fovi_ref.geometry.tie_certificate(graph)``: per node, the margin of its neighbour choice and
  of each cell choice, against a bound on fovi's float32 rounding derived in
  :mod:`fovi_ref.geometry.certificate`. Nodes above it are *determined* (every machine builds
  them alike; the tests compare them exactly with fovi 2.4.0's graphs as pinned on an Intel Xeon
  and on an AMD EPYC), the rest are *ties*, most of them in the stem, whose frame distances have
  the least float32 precision. The two pinning machines disagree on 22 nodes, all ties.
- ``resnet18_layers(arithmetic="exact")``: float64 points and distances computed directly, ties
  broken by index, every decision checked to be far from the tie tolerance. Bitwise the same
  under every arithmetic setting; 80 of 3398 nodes differ from fovi's float32 graphs at the
  defaults. The construction we would propose to fovi.
- :func:`~fovi_ref.check.fovi.machines.machine_finding` (run by ``verify --fovi`` and notebook
  05): fovi's model built in fresh interpreters under two settings with the same weights; the
  flipped nodes (all ties), and the float64 logits and SGD losses of the two networks.

The tie count ``verify --fovi`` and notebook 06 print ("N nodes of KNNResNet-18 are ties here")
is this machine's certificate over every KNN graph of fovi's model: the 20 convolutions *and*
fovi's two pools (the 3x3 max-pool after the stem and the global average pool, both KNN graphs in
fovi); notebook 06's table gives it per layer, pools included. A ``KNNConv`` keeps its graph as
buffers in its ``state_dict``, so a fovi_ref checkpoint carries the graph it was trained on.
"""

from fovi_ref.check.fovi.backends import (
    DispatchRecord,
    FoviOps,
    backend_accepts,
    check_fovi_ops,
    dispatch_table,
    fovi_backend,
    fovi_backends,
    fovi_contenders,
    fovi_dispatch,
    fovi_forward_and_grads,
    fovi_ops,
    to_fovi_meta,
)
from fovi_ref.check.fovi.load import (
    BACKEND_ENV,
    FINDINGS_DIR,
    FOVI_VERSION,
    INFERENCE_ONLY,
    INSTALL_HINT,
    LAYER_ONLY,
    PATHS,
    REGISTRY_MODULES,
    FoviLayer,
    FoviUnavailable,
    FoviVersionError,
    build_fovi_resnet18,
    fovi_arch,
    fovi_conv_layers,
    fovi_layer_from_meta,
    fovi_resnet18_layers,
    load_knnresnet,
    require_fovi,
)
from fovi_ref.check.fovi.machines import (
    ARITHMETIC_SETTINGS,
    MachineFinding,
    MachineRun,
    finding_record,
    machine_finding,
    run_under,
)
from fovi_ref.check.fovi.models import (
    ModelComparison,
    TrainingComparison,
    compare_model,
    compare_training,
    random_batches,
)
from fovi_ref.check.fovi.verify import (
    MODEL_DTYPES,
    FoviCheck,
    FoviFinding,
    OverflowFinding,
    exit_status,
    finding_scripts,
    format_fovi_table,
    fovi_findings,
    fovi_record,
    fovi_rows,
    gate_summary,
    load_model_factory,
    model_layers,
    new_failures,
    overflow_finding,
    run_fovi,
    verify_fovi,
    verify_fovi_model,
)

__all__ = [
    "DispatchRecord",
    "FoviOps",
    "backend_accepts",
    "check_fovi_ops",
    "dispatch_table",
    "fovi_backend",
    "fovi_backends",
    "fovi_contenders",
    "fovi_dispatch",
    "fovi_forward_and_grads",
    "fovi_ops",
    "to_fovi_meta",
    "BACKEND_ENV",
    "FINDINGS_DIR",
    "FOVI_VERSION",
    "INFERENCE_ONLY",
    "INSTALL_HINT",
    "LAYER_ONLY",
    "PATHS",
    "REGISTRY_MODULES",
    "FoviLayer",
    "FoviUnavailable",
    "FoviVersionError",
    "build_fovi_resnet18",
    "fovi_arch",
    "fovi_conv_layers",
    "fovi_layer_from_meta",
    "fovi_resnet18_layers",
    "load_knnresnet",
    "require_fovi",
    "ARITHMETIC_SETTINGS",
    "MachineFinding",
    "MachineRun",
    "finding_record",
    "machine_finding",
    "run_under",
    "ModelComparison",
    "TrainingComparison",
    "compare_model",
    "compare_training",
    "random_batches",
    "FoviCheck",
    "FoviFinding",
    "format_fovi_table",
    "finding_scripts",
    "fovi_findings",
    "fovi_record",
    "fovi_rows",
    "OverflowFinding",
    "overflow_finding",
    "run_fovi",
    "verify_fovi",
    "verify_fovi_model",
    "load_model_factory",
    "MODEL_DTYPES",
    "exit_status",
    "gate_summary",
    "model_layers",
    "new_failures",
]
