"""Small batches: ``python -m fovi_ref bench --batch-scaling``.

Notebooks, visualisation and single-image checks run at batch 1 to 16, where fixed costs per call
and layout pathologies show (a strided view that makes row gathers 30x slower once cost general 4x
more at batch 2 than at batch 1). For every distinct res18 graph, forward + backward of the routed
backend through ``knn_conv`` against fovi's einsum path (plain autograd), side by side, at each
batch size: the table gives the ratio with its spread (median ± half the IQR of the per-round
ratios, :func:`fovi_ref.check.bench.timing.measure`), whose target is
:data:`fovi_ref.check.bench.targets.SCALING` at every batch, and a cell's verdict mark (``!``
MISSED, ``?`` unsure); the rows also keep milliseconds per sample of the routed backend.
"""

from __future__ import annotations

import torch

from fovi_ref import dtype_name, route
from fovi_ref.check.arithmetic import arithmetic_settings, describe
from fovi_ref.check.bench import targets, timing
from fovi_ref.check.bench.contenders import fovi_einsum, knn_backend, make_inputs
from fovi_ref.check.jobs import layer_names, progress, shared_graph_groups
from fovi_ref.geometry import get_layer

__all__ = ["BATCHES", "run", "scaling_rows"]

BATCHES = (1, 2, 4, 8, 16)
"""The batch sizes timed per graph."""
CAP_S = 8.0
"""Seconds one cell may take before it stops adding rounds (55 cells)."""


def scaling_rows(
    names: list[str] | None = None,
    batches=BATCHES,
    repeats: int = 7,
    device: str = "cpu",
    dtype=torch.float32,
) -> list[dict]:
    """One row per distinct graph: ``{"layers", "backend", "ms per sample": {B: ms},
    "ratio": {B: routed / einsum, a Ratio}, "stopped": {B: how its measurement ended}}``."""
    names = layer_names(names)
    groups = shared_graph_groups(names, {name: get_layer(name) for name in names})
    rows = []
    for i, members in enumerate(groups, 1):
        layer = get_layer(members[0])
        meta, backend = layer.meta.to(device), route(layer.meta)
        progress(i, len(groups), f"batch scaling {members[0]}")
        per_sample, ratio, stopped = {}, {}, {}
        for batch in batches:
            inputs = make_inputs(meta, layer.out_channels, batch, dtype)
            timed = timing.measure(
                {"routed": knn_backend(inputs, backend), "einsum": fovi_einsum(inputs)},
                ratios=[("routed", "einsum")],
                repeats=repeats,
                cap_s=CAP_S,
            )
            per_sample[batch] = 1e3 * timed.median("routed") / batch
            ratio[batch], stopped[batch] = timed.ratio("routed", "einsum"), timed.stopped
        rows.append(
            {
                "layers": members,
                "backend": backend,
                "ms per sample": per_sample,
                "ratio": ratio,
                "stopped": stopped,
            }
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
    print(describe(arithmetic_settings(device)))
    print(f"cell: routed / einsum, median ± half the IQR over the rounds ({held});")
    print("'!' MISSED (the IQR above the target), '?' unsure (it straddles the target)")
    print(f"{'layer':<22}{'backend':<12}" + "".join(f"{'B=' + str(b):>13}" for b in BATCHES))
    verdicts = {}
    for r in rows:
        for b in BATCHES:
            verdicts[r["layers"][0], b] = timing.verdict(r["ratio"][b], target) if target else "-"
        cells = "".join(
            f"{r['ratio'][b].text(timing.mark_of(verdicts[r['layers'][0], b])):>12} "
            for b in BATCHES
        )
        first = r["layers"][0] + (f" +{len(r['layers']) - 1}" if len(r["layers"]) > 1 else "")
        print(f"{first[:21]:<22}{r['backend']:<12}{cells}")
    capped = sum(s == "cap" for r in rows for s in r["stopped"].values())
    cells = len(rows) * len(BATCHES)
    print(f"{cells - capped} of {cells} cells reached the {timing.BAND:.0%} band, {capped} the cap")
    if target is not None:
        met = [k for k, v in verdicts.items() if v == "met"]
        print(
            f"verdict: {timing.overall(list(verdicts.values()))}, {len(met)} of {cells} cells "
            "meet the target"
        )
        for kind in ("MISSED", "unsure"):
            listed = [f"{layer} B={b}" for (layer, b), v in verdicts.items() if v == kind]
            for i in range(0, len(listed), 3):  # within 100 columns: 'layer4.0.downsample.0 B=16'
                print(f"  {kind}: " + ", ".join(listed[i : i + 3]))
    return rows
