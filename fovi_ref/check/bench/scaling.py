"""Small batches: ``python -m fovi_ref bench --batch-scaling``.

Notebooks, visualisation and single-image checks run at batch 1 to 16, where fixed costs per call
and layout pathologies show (a strided view that makes row gathers 30x slower once cost general 4x
more at batch 2 than at batch 1). For every distinct res18 graph, forward + backward of the routed
backend through ``knn_conv`` against fovi's einsum path (plain autograd), side by side, at each
batch size: the table gives milliseconds per sample of the routed backend and the ratio, whose
target is :data:`fovi_ref.check.bench.targets.SCALING` at every batch.
"""

from __future__ import annotations

import torch

from fovi_ref import dtype_name, route
from fovi_ref.check.bench import targets
from fovi_ref.check.bench.contenders import fovi_einsum, knn_backend, make_inputs
from fovi_ref.check.bench.timing import time_contenders
from fovi_ref.check.jobs import layer_names, progress, shared_graph_groups
from fovi_ref.geometry import get_layer

__all__ = ["BATCHES", "run", "scaling_rows"]

BATCHES = (1, 2, 4, 8, 16)
"""The batch sizes timed per graph."""


def scaling_rows(
    names: list[str] | None = None,
    batches=BATCHES,
    repeats: int = 7,
    device: str = "cpu",
    dtype=torch.float32,
) -> list[dict]:
    """One row per distinct graph: ``{"layers", "backend", "ms per sample": {B: ms},
    "ratio": {B: routed / einsum}}``."""
    names = layer_names(names)
    groups = shared_graph_groups(names, {name: get_layer(name) for name in names})
    rows = []
    for i, members in enumerate(groups, 1):
        layer = get_layer(members[0])
        meta, backend = layer.meta.to(device), route(layer.meta)
        progress(i, len(groups), f"batch scaling {members[0]}")
        per_sample, ratio = {}, {}
        for batch in batches:
            inputs = make_inputs(meta, layer.out_channels, batch, dtype)
            times = time_contenders(
                {"routed": knn_backend(inputs, backend), "einsum": fovi_einsum(inputs)},
                repeats=repeats,
            )
            per_sample[batch] = 1e3 * times["routed"] / batch
            ratio[batch] = times["routed"] / times["einsum"]
        rows.append(
            {"layers": members, "backend": backend, "ms per sample": per_sample, "ratio": ratio}
        )
    return rows


def run(names=None, repeats: int = 7, device: str = "cpu", dtype=torch.float32) -> list[dict]:
    """Print the table of :func:`scaling_rows` (within 100 columns) and return its rows."""
    rows = scaling_rows(names, repeats=repeats, device=device, dtype=dtype)
    target = targets.SCALING.at_most if dtype == torch.float32 else None
    print(
        f"\nbatch scaling, {device} {dtype_name(dtype)}: routed backend / fovi's einsum, fwd + bwd"
    )
    held = (
        f"target <= {targets.SCALING.at_most}"
        if target
        else f"no target: <= {targets.SCALING.at_most} holds float32"
    )
    print(f"cell: ms per sample of the routed backend, then the ratio ({held})")
    header = f"{'layer':<22}{'backend':<12}" + "".join(f"{'B=' + str(b):>13}" for b in BATCHES)
    print(header)
    for r in rows:
        cells = "".join(
            f"{r['ms per sample'][b]:>7.2f} {r['ratio'][b]:4.2f}"
            + ("!" if target is not None and r["ratio"][b] > target else " ")
            for b in BATCHES
        )
        first = r["layers"][0] + (f" +{len(r['layers']) - 1}" if len(r["layers"]) > 1 else "")
        print(f"{first[:21]:<22}{r['backend']:<12}{cells}")
    if target is not None:
        missed = [
            f"{r['layers'][0]} B={b}" for r in rows for b in BATCHES if r["ratio"][b] > target
        ]
        cells = len(rows) * len(BATCHES)
        verdict = "met" if not missed else "MISSED"
        print(f"verdict: {verdict}, {cells - len(missed)} of {cells} cells meet the target")
        for i in range(0, len(missed), 4):
            print("  missed: " + ", ".join(missed[i : i + 4]))
    return rows
