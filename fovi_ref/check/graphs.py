"""The graphs :func:`fovi_ref.check.check_ops.check_ops` judges on, by name.

A wrong kernel is usually right on small inputs. It goes wrong at a tile or warp boundary
(32, 64, 128), at the last index, with one channel, past a batch threshold, or where many
outputs read one input. So the battery's graphs span those axes *by design*, one axis large at
a time from a small base, so that every graph stays cheap:

=============  ===========================================================================
axis           values (all other sizes at the base: K=3, V=4, Nin=16, Nout=12, Cin=3,
               Cout=4, batch 3)
=============  ===========================================================================
``Nout``       1, 31, 32, 33, 63, 64, 65, 127, 128, 129               (``nout_<n>``)
``Nin``        1, 31, 32, 33, 63, 64, 65, 127, 128, 129               (``nin_<n>``)
``Cin``        1, 31, 32, 33, 63, 64, 65, 127, 128, 129               (``cin_<n>``)
``Cout``       1, 31, 32, 33, 63, 64, 65, 127, 128, 129               (``cout_<n>``)
batch          1, 4, 5, 31, 32, 33, 63, 64, 65, 127, 128, 129         (``batch_<n>``)
``K``          1, 9, 10, 17, 40                                       (``k_<n>``)
``V``          1, 16, 17, 33                                          (``v_<n>``)
fan-out        one input read by 40 (past twice fovi_ref's ``HUB``), 150 and 1,100
               outputs                                                (``hub_<n>``)
downsample     ``K`` 1 and ``V`` 1 (fovi-resnet18's downsample convs, the only graphs
               ``gather_gemm`` takes): at the base sizes (``downsample``), and with
               ``Nin`` 129, ``Nout`` 65, ``Cin`` 33, ``Cout`` 31, batch 5
               (``downsample_wide``), with one input (``downsample_nin_1``), and with
               one input read by 150 outputs (``downsample_hub_150``); the last two come
               last in the battery's order
occupied       ``K`` 2, ``V`` 16, ``Cin`` 64, ``Nout`` 64, batch 8: few of the cells
cells          occupied, where a CPU backend may run one GEMM per occupied cell
channel        ``Cin`` 13, ``V`` 16, ``K`` 16, ``Nout`` 130, batch 311: a ``grad_z`` of
blocks         more than 32 MiB, where a CPU backend may work in blocks of channels (a
               prime ``Cin``: general's blocks hold 7 channels and then 6; float64 and
               float32, oracle and doors only: its oracle takes seconds)
=============  ===========================================================================

Every spanning graph reads its first and its last input (``x[:, :, 0]`` and
``x[:, :, Nin - 1]``), holds padding in the middle of a neighbour list and, from two nodes on,
an all-padding node and a collision (two outputs reading one input in one cell). ``base`` is the
one graph with inputs nobody reads (the padding check needs them). Seeds come from the graph's
name (:func:`graph_seed`), so a case replays from its name alone, whatever else the battery ran.

:func:`random_graphs` (four graphs with every awkward feature forced, the battery of earlier
rounds) and the fovi-resnet18 layers (:func:`res18_graphs`) complete the ``--full`` battery.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fovi_ref import KNNMeta

__all__ = [
    "BOUNDARIES",
    "RES18_SUBSET",
    "TestGraph",
    "graph_seed",
    "random_graphs",
    "random_meta",
    "res18_graphs",
    "spanning_graph",
    "spanning_graphs",
    "spanning_meta",
]

BOUNDARIES = (1, 31, 32, 33, 63, 64, 65, 127, 128, 129)
"""One, and each side of the tile sizes 32, 64 and 128."""

# The smallest res18 layers of each kind: K=1 downsample, K=2/V=4, K=9/V=9.
RES18_SUBSET = ("layer4.0.downsample.0", "layer4.1.conv1", "layer3.0.conv1")

BASE = dict(k=3, v=4, n_in=16, n_out=12, in_channels=3, out_channels=4, batch=3)


@dataclass(frozen=True)
class TestGraph:
    """A graph to check on: a name, the meta, the output channel count and, where the graph
    needs them, its own batch size, dtypes and checks (``None``: the battery's; a graph's
    dtypes and checks narrow the battery's, they never add to them)."""

    __test__ = False  # not a pytest test class, whatever its name

    name: str
    meta: KNNMeta
    out_channels: int
    batch: int | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    checks: tuple[str, ...] | None = None


def graph_seed(name: str, seed: int = 0) -> int:
    """The seed of graph ``name``'s structure and operands in a battery run with ``seed``: the
    same for the same name, wherever the graph stands in the list."""
    return seed + zlib.crc32(name.encode()) % 2**20


# ------------------------------------------------------------------------------ spanning graphs
def spanning_meta(
    k: int, v: int, *, n_in: int, n_out: int, in_channels: int, seed: int, hub: int = 0
) -> KNNMeta:
    """A random graph that reads its first and last input, with padding in the middle of a
    list, an all-padding node and a collision (from two nodes on), and, with ``hub > 0``, input
    0 read by the first neighbour of the first ``hub`` nodes (fan-out ``hub`` or more)."""
    g = torch.Generator().manual_seed(seed)
    knn = torch.randint(0, n_in, (k, n_out), generator=g)  # [K, Nout]
    rf_index = torch.randint(0, v, (n_out, k), generator=g)  # [Nout, K]
    pad = torch.rand(k, n_out, generator=g) < 0.2  # [K, Nout] padding anywhere
    pad[k // 2, n_out // 2] = True  # padding in the middle of a list
    if hub:
        knn[0, :hub] = 0
        pad[0, :hub] = False
    knn[0, 0] = 0  # the first input is read ...
    knn[k - 1, 0] = n_in - 1  # ... and so is the last
    pad[[0, k - 1], 0] = False
    if n_out >= 2:
        pad[:, n_out - 1] = True  # an all-padding node
        knn[0, 0] = knn[0, 1] = 0  # a collision: nodes 0 and 1 read input 0 in one cell
        rf_index[1, 0] = rf_index[0, 0]
        pad[0, 1] = False
    if k == 1 and n_out >= 3:  # node 0's one neighbour is input 0: node 2 reads the last
        knn[0, 2] = n_in - 1
        pad[0, 2] = False
    knn[pad] = n_in
    return KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=in_channels, v=v)


def _spanning_shapes() -> dict[str, dict[str, int]]:
    """Every spanning graph's sizes by name: the base with one axis changed."""
    axes = {
        "nout": ("n_out", BOUNDARIES),
        "nin": ("n_in", BOUNDARIES),
        "cin": ("in_channels", BOUNDARIES),
        "cout": ("out_channels", BOUNDARIES),
        "batch": ("batch", (1, 4, 5, *BOUNDARIES[1:])),
        "k": ("k", (1, 9, 10, 17, 40)),
        "v": ("v", (1, 16, 17, 33)),
    }
    shapes = {"base": dict(BASE)}
    for prefix, (size, values) in axes.items():
        shapes |= {f"{prefix}_{value}": {**BASE, size: value} for value in values}
    for fan_out, n_in in ((40, 8), (150, 8), (1100, 16)):  # Cin 1, Cout 2: cheap where wide
        shapes[f"hub_{fan_out}"] = {
            **BASE,
            "k": 2,
            "n_in": n_in,
            "n_out": fan_out,
            "in_channels": 1,
            "out_channels": 2,
            "hub": fan_out,
        }
    for name, sizes in (  # K = V = 1: fovi-resnet18's downsample convs (gather_gemm's class)
        ("downsample", {}),
        ("downsample_wide", dict(n_in=129, n_out=65, in_channels=33, out_channels=31, batch=5)),
    ):
        shapes[name] = {**BASE, "k": 1, "v": 1, **sizes}
    shapes["occupied_cells"] = dict(  # 2 of 16 cells occupied, 64 channels: a CPU backend
        k=2,
        v=16,
        n_in=32,
        n_out=64,
        in_channels=64,
        out_channels=4,
        batch=8,  # may skip the rest
    )
    shapes["channel_blocks"] = dict(
        k=16, v=16, n_in=40, n_out=130, in_channels=13, out_channels=1, batch=311
    )
    # Appended, so that every earlier graph keeps its place and a recorded first failure its
    # graph (scripts/mutations/record.json): one input (a padding index past it fails) and one
    # input read by 150 outputs, whose gradient sums 150 terms, in the K = V = 1 class.
    shapes["downsample_nin_1"] = {**BASE, "k": 1, "v": 1, "n_in": 1}
    shapes["downsample_hub_150"] = {
        **BASE,
        "k": 1,
        "v": 1,
        "n_in": 8,
        "n_out": 150,
        "in_channels": 1,
        "out_channels": 2,
        "hub": 150,
    }
    return shapes


SPANNING = tuple(_spanning_shapes())
"""The names of the spanning graphs, the default battery's."""


def spanning_graph(name: str, *, seed: int = 0, device: torch.device | str = "cpu") -> TestGraph:
    """The spanning graph ``name`` (one of :data:`SPANNING`)."""
    shapes = _spanning_shapes()
    if name not in shapes:
        raise ValueError(f"unknown spanning graph {name!r}; choose from {list(shapes)}")
    s = shapes[name]
    sizes = {key: s[key] for key in ("n_in", "n_out", "in_channels")}
    seeded = graph_seed(name, seed)
    if name == "base":  # the padding check needs inputs nobody reads
        meta = random_meta(s["k"], s["v"], **sizes, seed=seeded)
    else:
        meta = spanning_meta(s["k"], s["v"], **sizes, seed=seeded, hub=s.get("hub", 0))
    if name == "channel_blocks":  # its oracle costs seconds: the dtypes that block, two checks
        return TestGraph(
            name,
            meta.to(device),
            s["out_channels"],
            s["batch"],
            (torch.float64, torch.float32),
            ("oracle", "doors"),
        )
    return TestGraph(name, meta.to(device), s["out_channels"], s["batch"])


def spanning_graphs(*, seed: int = 0, device: torch.device | str = "cpu") -> list[TestGraph]:
    """All of :data:`SPANNING`."""
    return [spanning_graph(name, seed=seed, device=device) for name in SPANNING]


# -------------------------------------------------------------------------------- random graphs
def random_meta(
    k: int,
    v: int,
    *,
    n_in: int = 16,
    n_out: int = 12,
    in_channels: int = 3,
    seed: int = 0,
    padding: float = 0.2,
    device: torch.device | str = "cpu",
) -> KNNMeta:
    """A random graph with every awkward feature real graphs have, each one forced:

    - padding anywhere in a list (``padding`` of the entries, one in the middle of node 2's);
    - an all-padding node (the last one);
    - a collision: nodes 0 and 1 read one input through their first neighbour, in one cell;
    - a repeated neighbour: node 3 lists one input twice (K >= 2);
    - a shared cell: node 0's first two neighbours fall in one cell (K >= 2);
    - unused inputs: the last three inputs are read by nobody.
    """
    if n_in < 5 or n_out < 5:
        raise ValueError("random_meta needs n_in >= 5 and n_out >= 5 for its forced features")
    g = torch.Generator().manual_seed(seed)
    knn = torch.randint(0, n_in - 3, (k, n_out), generator=g)  # [K, Nout]; last 3 inputs unused
    rf_index = torch.randint(0, v, (n_out, k), generator=g)  # [Nout, K]
    pad = torch.rand(k, n_out, generator=g) < padding  # [K, Nout]
    pad[k // 2, 2] = True  # padding in the middle of node 2's list
    pad[:, n_out - 1] = True  # an all-padding node
    pad[0, :2] = False  # the collision below stays real
    knn[0, 1] = knn[0, 0]  # collision: nodes 0 and 1 read one input ...
    rf_index[1, 0] = rf_index[0, 0]  # ... in the same cell, so their gradients can cancel
    if k >= 2:
        rf_index[0, 1] = rf_index[0, 0]  # node 0: two neighbours share a cell
        pad[1, 0] = False
        knn[1, 3] = knn[0, 3]  # node 3: one input listed twice
        pad[:2, 3] = False
    knn[pad] = n_in
    meta = KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=in_channels, v=v)
    return meta.to(device)


def random_graphs(*, seed: int = 0, device: torch.device | str = "cpu") -> list[TestGraph]:
    """The random graphs of earlier rounds: the K=V=1 class, more neighbours than cells (shared
    cells), more cells than neighbours, and a crowded graph (many outputs on few inputs)."""
    shapes = [  # name, K, V, n_in, n_out, Cin, Cout
        ("random_k1_v1", 1, 1, 16, 12, 3, 4),
        ("random_k4_v2", 4, 2, 16, 12, 3, 4),
        ("random_k3_v9", 3, 9, 16, 12, 2, 3),
        ("crowded_k2_v4", 2, 4, 8, 20, 2, 3),
    ]
    graphs = []
    for i, (name, k, v, n_in, n_out, c_in, c_out) in enumerate(shapes):  # structure: seed + i
        meta = random_meta(k, v, n_in=n_in, n_out=n_out, in_channels=c_in, seed=seed + i)
        graphs.append(TestGraph(name, meta.to(device), c_out))
    return graphs


def res18_graphs(
    names: Sequence[str] | None = RES18_SUBSET, *, device: torch.device | str = "cpu"
) -> list[TestGraph]:
    """fovi-resnet18 graphs from :func:`fovi_ref.geometry.resnet18_layers` (``None``: all 20)."""
    from fovi_ref.geometry import get_layer, resnet18_layers  # the geometry is slow to import

    layers = list(resnet18_layers().values()) if names is None else map(get_layer, names)
    return [TestGraph(r.name, r.meta.to(device), r.out_channels) for r in layers]
