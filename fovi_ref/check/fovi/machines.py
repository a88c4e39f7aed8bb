"""fovi 2.4.0's graphs depend on the machine: ties, measured flips, and what they do to a network.

fovi builds a model's KNN graphs when the model is constructed, in float32, and does not save them
in the ``state_dict``. Another CPU, MKL code path or thread count rounds its distance GEMMs
differently and settles some near-ties the other way (:mod:`fovi_ref.geometry.certificate`), so
a checkpoint trained on one machine runs a slightly different network on another. This module
measures that, on one machine, by standing in for other machines with arithmetic settings
(:data:`ARITHMETIC_SETTINGS`): for each setting a fresh interpreter builds fovi's KNNResNet-18
(fixed seed, so the same weights), reads its graphs, runs a fixed input through it in float64 and
takes a few SGD steps. Comparing two settings gives the flipped nodes (every one must be a tie of
this machine's certificate) and the network-level effect, with float64 arithmetic so that what
differs is the graph, not the rounding.

fovi_ref's answers: a :class:`~fovi_ref.KNNConv` keeps its graph in its ``state_dict`` (a
checkpoint carries the graph it was trained on), and ``resnet18_layers(arithmetic="exact")``
builds graphs that are the same on every machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from fovi_ref.check.fovi.load import FINDINGS_DIR, require_fovi
from fovi_ref.geometry import (
    LayerGraph,
    layer_graph,
    resnet18_layers,
    resnet18_plan,
    tie_certificate,
)

__all__ = [
    "ARITHMETIC_SETTINGS",
    "MachineFinding",
    "MachineRun",
    "finding_record",
    "machine_finding",
    "run_under",
]

ARITHMETIC_SETTINGS = {
    "as is": {},
    "MKL SSE4.2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "ATen default": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL compatible": {"MKL_CBWR": "COMPATIBLE"},
}
"""Environment settings that stand in for other machines (each changes which float32 GEMM or
vector kernel runs); ``"as is"`` is the machine at hand."""

_STEPS = 3

_PROBE = """
import json, sys, torch, torch.nn.functional as F
from fovi_ref.check.fovi.load import build_fovi_resnet18, fovi_conv_layers
from fovi_ref.check.fovi.models import random_batches
model = build_fovi_resnet18(dtype=torch.float64, seed=0)
graphs = {n: (r.meta.knn, r.meta.rf_index) for n, r in fovi_conv_layers(model).items()}
for name in ("maxpool", "avgpool"):  # fovi's KNN pooling layers: a neighbour set, no cells
    knn = getattr(model, name).knn_indices_pad_token
    graphs[name] = (knn, torch.zeros_like(knn.t()))
x = torch.randn(2, 3, 5977, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
model.eval()
with torch.no_grad():
    logits = model(x)
model.train()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
losses = []
for xb, yb in random_batches(model, STEPS, batch=2, seed=2):
    loss = F.cross_entropy(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.save({"graphs": graphs, "logits": logits, "losses": losses}, sys.argv[1])
"""


@dataclass(frozen=True)
class MachineRun:
    """What fovi's KNNResNet-18 (seed 0, float64) gave under one arithmetic setting.

    Attributes:
        setting: a key of :data:`ARITHMETIC_SETTINGS`.
        graphs: ``{layer: (knn [K, Nout], rf_index [Nout, K])}`` as fovi built them, for the 20
            convolutions and the two KNN pooling layers (``maxpool``, ``avgpool``: no cells,
            ``rf_index`` all zero).
        logits: ``[2, 10]`` float64, eval mode, a fixed input.
        losses: the loss of each SGD step (3 unless told; lr 0.01, batch 2, fixed batches).
    """

    setting: str
    graphs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor
    losses: list[float]


def run_under(setting: str, steps: int = _STEPS) -> MachineRun:
    """Build and run fovi's model in a fresh interpreter under one arithmetic setting, then take
    ``steps`` SGD steps."""
    env = {**os.environ, **ARITHMETIC_SETTINGS[setting]}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.pt"
        code = _PROBE.replace("STEPS", str(steps))
        done = subprocess.run(
            [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"fovi's model under {setting!r} failed:\n{done.stderr[-2000:]}")
        data = torch.load(out)
    return MachineRun(setting, data["graphs"], data["logits"], data["losses"])


def _knn_graphs() -> dict[str, LayerGraph]:
    """fovi_ref's rebuild of every KNN graph of fovi's KNNResNet-18 (defaults), pools included."""
    graphs = resnet18_layers()
    plan = {spec.name: spec for spec in resnet18_plan()}
    last = plan["layer4.1.conv2"]
    pools = {  # (k, in_res, out_res): fovi's 3x3 max-pool after the stem, global average pool
        "maxpool": (9, plan["conv1"].out_res, plan["layer1.0.conv1"].in_res),
        "avgpool": (last.k, last.out_res, last.out_res),
    }
    for name, (k, in_res, out_res) in pools.items():
        graphs[name] = layer_graph(
            name,
            in_channels=1,
            out_channels=1,
            k=k,
            in_res=in_res,
            out_res=out_res,
            fov=16,
            cmf_a=0.5,
        )
    return graphs


def _pairs(knn: torch.Tensor, rf_index: torch.Tensor, node: int) -> list[tuple[int, int]]:
    return sorted(zip(knn[:, node].tolist(), rf_index[node].tolist(), strict=True))


@dataclass(frozen=True)
class MachineFinding:
    """Two arithmetic settings compared on fovi's KNNResNet-18 (fovi's defaults).

    Attributes:
        runs: the two :class:`MachineRun`.
        ties: ``{layer: nodes}`` this machine's certificate calls ties.
        flips: ``{layer: [nodes]}`` whose (neighbour, cell) pairs differ between the two runs.
        flips_outside_ties: flipped nodes the certificate called determined (must be none).
        output_difference: ``max |logits_a - logits_b| / max |logits_a|``.
    """

    runs: tuple[MachineRun, MachineRun]
    ties: dict[str, int]
    flips: dict[str, list[int]]
    flips_outside_ties: int
    output_difference: float

    @property
    def n_flips(self) -> int:
        return sum(len(nodes) for nodes in self.flips.values())

    def summary(self) -> str:
        a, b = self.runs
        nodes = sum(len(n) for n in self.flips.values())
        layers = sum(bool(n) for n in self.flips.values())
        ties = sum(self.ties.values())
        lines = [  # each within 100 columns, for notebooks
            f"fovi 2.4.0's graphs depend on the machine: {ties} nodes of KNNResNet-18 are "
            "ties here.",
            f"Built under '{a.setting}' and '{b.setting}': {nodes} nodes in {layers} layers "
            f"differ, {self.flips_outside_ties} of them not ties.",
            f"Same weights and input, float64: the logits differ by {self.output_difference:.1e} "
            "of their scale;",
            f"SGD loss after {len(a.losses)} step(s): {a.losses[-1]:.4f} vs {b.losses[-1]:.4f}.",
            "fovi_ref: KNNConv keeps its graph in its state_dict, and",
            "resnet18_layers(arithmetic='exact') builds the same graph on every machine.",
            f"reproducer (torch and fovi only): {FINDINGS_DIR}/graphs_depend_on_machine.py",
        ]
        return "\n".join(lines)


def machine_finding(
    a: str = "as is", b: str = "MKL SSE4.2", *, steps: int = _STEPS
) -> MachineFinding:
    """Compare fovi's model built under arithmetic settings ``a`` and ``b`` (two subprocesses,
    run at once), each taking ``steps`` SGD steps after its forward pass.

    Raises ``KeyError`` for a setting not in :data:`ARITHMETIC_SETTINGS`; needs fovi 2.4.0.
    """
    for name in (a, b):
        if name not in ARITHMETIC_SETTINGS:
            raise KeyError(f"unknown setting {name!r}; known: {', '.join(ARITHMETIC_SETTINGS)}")
    require_fovi()  # raises FoviUnavailable naming the install command
    # The two interpreters are independent: they run side by side, and this one computes the
    # certificates meanwhile (each waits mostly on its own build, not on the other's).
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(run_under, setting, steps) for setting in (a, b)]
        certificates = {n: tie_certificate(g) for n, g in _knn_graphs().items()}
        run_a, run_b = (run.result() for run in runs)
    flips, outside = {}, 0
    for name, certificate in certificates.items():
        (knn_a, rf_a), (knn_b, rf_b) = run_a.graphs[name], run_b.graphs[name]
        moved = [
            node
            for node in range(knn_a.shape[1])
            if _pairs(knn_a, rf_a, node) != _pairs(knn_b, rf_b, node)
        ]
        flips[name] = moved
        outside += sum(bool(certificate.determined[node]) for node in moved)
    scale = run_a.logits.abs().max()
    difference = float((run_a.logits - run_b.logits).abs().max() / scale)
    ties = {n: len(c.ties) for n, c in certificates.items()}
    return MachineFinding((run_a, run_b), ties, flips, outside, difference)


def finding_record(finding: MachineFinding) -> dict:
    """JSON-ready summary (for ``verify_fovi.json``)."""
    a, b = finding.runs
    return {
        "settings": [a.setting, b.setting],
        "ties_per_layer": finding.ties,
        "flips_per_layer": {n: len(v) for n, v in finding.flips.items()},
        "flips_outside_ties": finding.flips_outside_ties,
        "output_difference": finding.output_difference,
        "losses": [a.losses, b.losses],
    }
