"""Bad arguments to the geometry builders raise errors that name the argument and its range, and
the tie certificate's self-check on an inconsistent graph is a ``ValueError`` even under -O."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fovi_ref.geometry import foveated_sampling, layer_graph, resnet18_layers, tie_certificate
from fovi_ref.geometry.sampling import CMF_A_RATIO_RANGE, FOV_RANGE, LEGACY_MAX_FOV, ring_radii
from fovi_ref.meta import KNNMeta

ROOT = Path(__file__).resolve().parents[1]

# A small layer (8 -> 4 rings, a few hundred points): fast to build and to certify.
SMALL = dict(in_channels=4, out_channels=4, in_res=8, out_res=4, fov=16, cmf_a=0.5)


# ------------------------------------------------------------------ resnet18_layers: fov, cmf_a
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        # used to be ZeroDivisionError (float32 rings collapse) and "cannot convert float NaN"
        (
            {"cmf_a": 1e6},
            ValueError,
            r"cmf_a .*must be in \[8e-12, 8e\+03\] for fov=16.*got 1000000\.0",
        ),
        ({"cmf_a": 1e300}, ValueError, r"cmf_a .*must be in \[8e-12, 8e\+03\].*1e\+300"),
        ({"cmf_a": 1e-300}, ValueError, r"cmf_a .*must be in \[8e-12, 8e\+03\]"),
        ({"cmf_a": 1e-30}, ValueError, r"cmf_a .*must be in"),  # was: blamed fov
        ({"cmf_a": float("nan")}, ValueError, r"cmf_a .*finite number > 0, got nan"),
        ({"cmf_a": float("inf")}, ValueError, r"cmf_a .*finite number > 0, got inf"),
        ({"cmf_a": "0.5"}, TypeError, r"cmf_a .*must be a real number, got str"),
        ({"cmf_a": True}, TypeError, r"cmf_a .*must be a real number, got bool"),
        ({"fov": 1e-10}, ValueError, r"fov .*must be in \[0\.001, 10000\], got 1e-10"),
        ({"fov": 1e6}, ValueError, r"fov .*must be in \[0\.001, 10000\], got 1000000"),
        ({"fov": 1e300}, ValueError, r"fov .*must be in \[0\.001, 10000\]"),
        ({"fov": float("nan")}, ValueError, r"fov .*finite number > 0, got nan"),
        ({"fov": float("-inf")}, ValueError, r"fov .*finite number > 0, got -inf"),
        ({"fov": None}, TypeError, r"fov .*must be a real number, got NoneType"),
        ({"fov": 200, "field_geometry": "legacy"}, ValueError, r"fov .*<= 180 on the 'legacy'"),
        ({"in_res": 64.0}, TypeError, r"in_res must be an int, got float"),
        ({"in_res": True}, TypeError, r"in_res must be an int, got bool"),
        ({"in_res": -1}, ValueError, r"in_res must be >= 1, got -1"),
    ],
)
def test_resnet18_layers_names_the_bad_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        resnet18_layers(**kwargs)


def test_the_cmf_a_range_scales_with_fov():
    lo, hi = CMF_A_RATIO_RANGE
    with pytest.raises(ValueError, match=r"cmf_a .*\[5e-11, 5e\+04\] for fov=100"):
        resnet18_layers(fov=100, cmf_a=hi * 50 * 1.01)
    with pytest.raises(ValueError, match=r"cmf_a .*for fov=100"):
        resnet18_layers(fov=100, cmf_a=lo * 50 * 0.99)


@pytest.mark.parametrize("fov", FOV_RANGE)
@pytest.mark.parametrize("ratio", CMF_A_RATIO_RANGE)
def test_the_corners_of_the_accepted_range_build(fov, ratio):
    """Every corner of the accepted (fov, cmf_a) box gives distinct, finite cortical points."""
    for res in (2, 64):
        s = foveated_sampling(res, fov, ratio * fov / 2)
        assert torch.isfinite(s.cortical).all() and torch.isfinite(s.pad_cortical).all()
        assert bool((s.radii[1:] > s.radii[:-1]).all())
        assert torch.unique(s.cortical, dim=0).shape[0] == s.n


def test_legacy_accepts_up_to_its_limit_then_names_fov():
    with pytest.raises(ValueError, match=rf"fov .*<= {LEGACY_MAX_FOV}"):
        foveated_sampling(4, LEGACY_MAX_FOV + 1, 0.5, "legacy")
    # inside the limit but with pads past where the legacy surface is real: names the surface
    with pytest.raises(ValueError, match=r"'legacy' cortical surface is undefined for fov=170"):
        foveated_sampling(4, 170, 0.5, "legacy")


def test_too_many_rings_for_float32_name_res_and_cmf_a():
    """Inside the cmf_a range, enough rings still collapse in float32 (was ZeroDivisionError or
    'step must be nonzero' from the pad rings)."""
    with pytest.raises(ValueError, match=r"res=4096 rings for fov=16, cmf_a=8000"):
        ring_radii(4096, 16, 8000.0)
    with pytest.raises(ValueError, match=r"cannot resolve res=4096 rings.*cmf_a=8000"):
        foveated_sampling(4096, 16, 8000.0)


@pytest.mark.parametrize(
    ("res", "error", "message"),
    [(1, ValueError, r"res \(number of rings\) must be >= 2"), (8.0, TypeError, r"res .*int")],
)
def test_foveated_sampling_names_res(res, error, message):
    with pytest.raises(error, match=message):
        foveated_sampling(res, 16, 0.5)


# ------------------------------------------------------------------------------- layer_graph
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"k": 0}, ValueError, r"k \(requested neighbours\) must be >= 1, got 0"),  # IndexError
        ({"k": -3}, ValueError, r"k \(requested neighbours\) must be >= 1, got -3"),
        ({"k": 2.5}, TypeError, r"k \(requested neighbours\) must be an int, got float"),  # topk
        ({"k": 9.0}, TypeError, r"k \(requested neighbours\) must be an int, got float"),
        ({"k": True}, TypeError, r"k \(requested neighbours\) must be an int, got bool"),
        ({"in_channels": 0}, ValueError, r"in_channels must be >= 1, got 0"),
        ({"out_channels": 2.0}, TypeError, r"out_channels must be an int"),
        ({"in_res": 1}, ValueError, r"in_res \(input rings\) must be >= 2, got 1"),
        ({"out_res": 4.0}, TypeError, r"out_res \(output rings\) must be an int"),
        ({"cmf_a": 1e6}, ValueError, r"cmf_a .*must be in"),
        ({"fov": 0}, ValueError, r"fov .*finite number > 0, got 0"),
    ],
)
def test_layer_graph_names_the_bad_argument(change, error, message):
    with pytest.raises(error, match=message):
        layer_graph("bad", **{"k": 9, **SMALL, **change})


def test_layer_graph_names_a_non_str_name():
    with pytest.raises(TypeError, match="name must be a str"):
        layer_graph(3, k=9, **SMALL)


def test_layer_graph_accepts_numpy_ints():
    import numpy as np

    g = layer_graph("np", **{**SMALL, "k": np.int64(9)})
    assert g.k == 9


# ------------------------------------------------------------------------ tie_certificate
def inconsistent_graph(kind: str):
    """A small fovi graph edited at one node the certificate calls determined: ``kind`` is
    ``"knn"`` (a K=1 layer given another neighbour) or ``"cell"`` (a K=9 layer given another
    cell)."""
    k = 1 if kind == "knn" else 9
    graph = layer_graph(f"hand-built {kind}", k=k, **SMALL)
    certificate = tie_certificate(graph)  # consistent: no error
    knn, rf_index = graph.meta.knn.clone(), graph.meta.rf_index.clone()
    if kind == "knn":
        node = int(certificate.neighbour_margin.argmax())
        knn[0, node] = (knn[0, node] + 1) % graph.n_in  # another real input
    else:
        margin = torch.where(
            certificate.neighbour_margin[:, None] > 1, certificate.cell_margin, -torch.inf
        )
        node, slot = divmod(int(margin.argmax()), graph.k)
        assert float(margin[node, slot]) > 1
        rf_index[node, slot] = (rf_index[node, slot] + 1) % graph.v
    meta = KNNMeta.from_knn(
        knn, rf_index, n_in=graph.n_in, in_channels=graph.in_channels, v=graph.v
    )
    return dataclasses.replace(graph, meta=meta), node


@pytest.mark.parametrize(("kind", "field"), [("knn", "knn"), ("cell", "rf_index")])
def test_the_certificate_rejects_an_inconsistent_graph(kind, field):
    graph, node = inconsistent_graph(kind)
    with pytest.raises(ValueError, match=rf"graph\.meta\.{field}.*float64") as raised:
        tie_certificate(graph)
    assert f"first: [{node}]" in str(raised.value)


def test_the_certificate_rejects_a_graph_with_the_wrong_k():
    graph = layer_graph("k9", k=9, **SMALL)
    other = layer_graph("k4", k=4, **SMALL)
    with pytest.raises(ValueError, match=r"meta.knn has shape \(4, .*raw_knn has \(9, "):
        tie_certificate(dataclasses.replace(graph, meta=other.meta))


_OPTIMISED = """
import sys
sys.path.insert(0, sys.argv[1])
assert False, "this line must be skipped under -O"
from test_geometry_errors import inconsistent_graph
from fovi_ref.geometry import tie_certificate
for kind in ("knn", "cell"):
    graph, node = inconsistent_graph(kind)
    try:
        tie_certificate(graph)
    except ValueError as error:
        print(kind, "ValueError", error)
    else:
        print(kind, "CERTIFIED")
print("optimize", sys.flags.optimize)
"""


def test_the_certificate_check_survives_python_O():
    """Under ``python -O`` an ``assert`` vanishes (the old check then certified the wrong cell as
    determined); the ``ValueError`` does not."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMISED, str(ROOT / "tests")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "optimize 1", done.stdout
    assert lines[0].startswith("knn ValueError") and "graph.meta.knn" in lines[0], done.stdout
    assert lines[1].startswith("cell ValueError") and "graph.meta.rf_index" in lines[1], done.stdout
