"""Other machines, simulated: fovi_ref's graphs under other arithmetic settings.

Another CPU, MKL code path or thread count rounds float32 GEMMs and vectorised functions
differently. These tests stand in for such machines by starting fresh interpreters under
settings that change which kernels run (:data:`OTHER_ARITHMETIC`; each changes some of fovi's
graphs on an AVX-512 Xeon), and check the two promises of ``fovi_ref.geometry``: fovi's graphs
change only on nodes the tie certificate calls ties, and the exact construction does not change
at all. CI also runs the unit tests, and the notebooks, under such settings (``.ci/run``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import node_pairs

from fovi_ref import KNNMeta
from fovi_ref.geometry import LayerGraph, resnet18_layers, tie_certificate

OTHER_ARITHMETIC = {
    "sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"},
}
"""Environment settings that stand in for other machines."""

_DUMP_FOVI_GRAPHS = """
import sys, torch
from fovi_ref.geometry import resnet18_layers
layers = resnet18_layers()
torch.save({n: (g.meta.knn, g.meta.rf_index) for n, g in layers.items()}, sys.argv[1])
"""

_EXACT_DIGEST = """
import hashlib
from fovi_ref.geometry import resnet18_layers
h = hashlib.sha256()
for field_geometry in ("planar", "legacy"):
    for g in resnet18_layers(arithmetic="exact", field_geometry=field_geometry).values():
        h.update(g.meta.knn.numpy().tobytes())
        h.update(g.meta.rf_index.numpy().tobytes())
print(h.hexdigest())
"""


def run_under(env_extra: dict[str, str], code: str, *args: str) -> str:
    """Run ``code`` in a fresh interpreter with extra environment variables; its stdout."""
    env = {**os.environ, **env_extra}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def layers() -> dict[str, LayerGraph]:
    return resnet18_layers()


@pytest.fixture(scope="module")
def certificates(layers) -> dict:
    return {name: tie_certificate(g) for name, g in layers.items()}


@pytest.mark.parametrize("arithmetic", list(OTHER_ARITHMETIC))
def test_every_flip_under_another_arithmetic_is_a_tie(arithmetic, layers, certificates, tmp_path):
    """Rebuilt under another arithmetic setting, fovi's graphs change only on nodes this
    machine's certificate calls ties."""
    path = tmp_path / "graphs.pt"
    run_under(OTHER_ARITHMETIC[arithmetic], _DUMP_FOVI_GRAPHS, str(path))
    other = torch.load(path)
    for name, certificate in certificates.items():
        knn, rf_index = other[name]
        g = layers[name]
        moved = KNNMeta.from_knn(knn, rf_index, n_in=g.n_in, in_channels=1, v=g.v)
        for node in certificate.determined.nonzero().flatten().tolist():
            assert node_pairs(moved, node) == node_pairs(g.meta, node), (name, node)


@pytest.mark.sets_its_own_arithmetic
def test_exact_graphs_are_bitwise_the_same_under_every_arithmetic():
    """arithmetic="exact" builds the same tensors, bit for bit, here and under every setting that
    changes fovi's own graphs (and one thread with MKL's AVX2 kernels)."""
    here = run_under({}, _EXACT_DIGEST)
    settings = [
        *OTHER_ARITHMETIC.values(),
        {"OMP_NUM_THREADS": "1", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    ]
    for extra in settings:
        assert run_under(extra, _EXACT_DIGEST) == here, extra
