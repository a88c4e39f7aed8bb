"""Shared test fixtures: devices, and random graphs with every awkward feature of real ones."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from fovi_ref import KNNMeta, get_ops
from fovi_ref.strategies import occupied_cells

# Hypothesis profiles for tests/test_properties.py: by default a few derandomized examples per
# test (fast, the same every run); HYPOTHESIS_PROFILE=long (make properties): many random ones.
_PROFILE = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fovi_ref", max_examples=15, derandomize=True, **_PROFILE)
settings.register_profile("long", max_examples=400, **_PROFILE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fovi_ref"))

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str):
    """The repository's script at ``path`` (``scripts/...``) as a module, for tests of its parts."""
    spec = importlib.util.spec_from_file_location(f"script_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fixed_global_seed():
    """Tests that draw from the global generator see the same numbers whatever runs first."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: a second thread only adds overhead (on a busy 2-core machine,
    check_ops on the random graphs took 10 s of CPU with two threads against 0.9 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def force_cells(monkeypatch, on: bool) -> None:
    """Make general run its GEMMs per occupied cell (``on``) or dense, whatever its estimate
    (``occupied_cells.estimate``) would choose, so that both paths are judged on any graph. Set
    it before the graph's plans are derived: they hold the cell plans only where cells apply."""
    monkeypatch.setattr(occupied_cells, "CELLS_AT_MOST", math.inf if on else -math.inf)


# Every backend adds the bias inside its GEMM (fovi_ref.layout; einsum_baseline hands F.linear
# contiguous features), so each must round W x + b once: fovi_ref.check.tolerances, step 2 (d).
FUSED_BIAS_BACKENDS = ("general", "gather_gemm", "einsum_baseline")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
LOW_PRECISION = [torch.float32, torch.float16, torch.bfloat16]


def random_meta(
    k: int,
    v: int,
    *,
    n_in: int = 30,
    n_out: int = 20,
    in_channels: int = 3,
    seed: int = 0,
    padding: bool = True,
    device: str = "cpu",
) -> KNNMeta:
    """A random graph with the features real fovi graphs have.

    - padding neighbours in the middle of some lists, not only at the end (if ``padding``);
    - several neighbours of one node in the same cell (when K >= 2);
    - inputs that no output selects (the last three);
    - one input selected by several outputs (outputs 0 and 1 share neighbour 0).
    """
    g = torch.Generator().manual_seed(seed)
    knn = torch.randint(0, n_in - 3, (k, n_out), generator=g)  # [K, Nout]; last 3 inputs unused
    knn[0, 1] = knn[0, 0]  # a collision: two outputs read one input
    rf_index = torch.randint(0, v, (n_out, k), generator=g)  # [Nout, K]
    if k >= 2:
        rf_index[0, 1] = rf_index[0, 0]  # node 0: two neighbours share a cell
    if padding:
        pad = torch.rand(k, n_out, generator=g) < 0.2
        pad[k // 2, 2] = True  # a padding neighbour in the middle of node 2's list
        if k == 1:
            pad[0, :2] = False  # keep the collision of nodes 0 and 1 real
        knn[pad] = n_in
    meta = KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=in_channels, v=v)
    return meta.to(device)


def sample_inputs(
    meta: KNNMeta,
    *,
    out_channels: int = 4,
    batch: int = 2,
    dtype: torch.dtype = torch.float64,
    bias: bool = True,
    seed: int = 0,
):
    """``(x [B, Cin, Nin], weight [Cout, Cin*V], bias [Cout] or None)`` on the meta's device, in
    ``dtype``, requiring grad; values drawn in float64 then rounded, the weight scaled by
    ``1/sqrt(Cin*K)`` so outputs stay of order one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, meta.in_channels, meta.n_in, generator=g, dtype=torch.float64)
    fan_in = meta.in_channels * meta.k
    w = torch.randn(out_channels, meta.in_channels * meta.v, generator=g, dtype=torch.float64)
    w = w / fan_in**0.5
    b = torch.randn(out_channels, generator=g, dtype=torch.float64) if bias else None
    out = [t.to(device=meta.device, dtype=dtype).requires_grad_() for t in (x, w)]
    out.append(None if b is None else b.to(device=meta.device, dtype=dtype).requires_grad_())
    return tuple(out)


def node_pairs(meta: KNNMeta, node: int) -> list[tuple[int, int]]:
    """A node's (neighbour, cell) pairs, sorted: what the convolution reads, order aside."""
    return sorted(zip(meta.knn[:, node].tolist(), meta.rf_index[node].tolist(), strict=True))


class ForeignOps:
    """An ops object outside the registry, delegating to general."""

    name = "foreign"

    @staticmethod
    def forward(meta, x, weight, bias):
        return get_ops("general").forward(meta, x, weight, bias)

    @staticmethod
    def grad_input(meta, grad_y, weight):
        return get_ops("general").grad_input(meta, grad_y, weight)

    @staticmethod
    def grad_weight(meta, grad_y, x):
        return get_ops("general").grad_weight(meta, grad_y, x)
