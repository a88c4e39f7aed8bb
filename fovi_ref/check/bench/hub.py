"""The slow corner: ``python -m fovi_ref bench --hub``.

A *hub* graph has one input that many outputs read: ``knn[0, n] = 0`` for every output ``n``
(fan-out ``F = Nout``), the other neighbours drawn at random. Foveated graphs have such inputs
near the fovea and the pads. ``general``'s backward sums, for the hub's row, ``F`` terms per
channel: a plan with one round per term costs ``O(F)`` index operations per call and ``O(F*E)``
to build; :mod:`fovi_ref.segment_sum` sums rows with more than ``HUB`` terms in a pairwise tree
instead, and builds plans from sorts.

For each fan-out: the time to derive ``general``'s plans, and forward + backward of ``general``
against fovi's einsum (:func:`fovi_ref.check.bench.contenders.fovi_einsum`), in interleaved rounds
with spreads and a verdict against :data:`fovi_ref.check.bench.targets.HUB`.
"""

from __future__ import annotations

import time

import torch

from fovi_ref import KNNMeta, dtype_name
from fovi_ref.check.arithmetic import arithmetic_settings, describe
from fovi_ref.check.bench import targets, timing
from fovi_ref.check.bench.contenders import fovi_einsum, knn_backend, make_inputs
from fovi_ref.check.jobs import progress
from fovi_ref.strategies import derive

__all__ = ["FAN_OUTS", "hub_meta", "hub_rows", "run"]

FAN_OUTS = (1024, 4096, 16384, 32768)
"""The fan-outs the bench times."""


def hub_meta(
    fan_out: int,
    *,
    k: int = 4,
    v: int = 4,
    n_in: int = 256,
    in_channels: int = 16,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> KNNMeta:
    """A graph of ``fan_out`` outputs that all read input 0 (their first neighbour), the other
    ``k - 1`` neighbours and every cell drawn at random from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    knn = torch.randint(0, n_in, (k, fan_out), generator=g)  # [K, Nout]
    knn[0] = 0  # the hub
    rf_index = torch.randint(0, v, (fan_out, k), generator=g)  # [Nout, K]
    meta = KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=in_channels, v=v)
    return meta.to(device)


def hub_rows(
    fan_outs=FAN_OUTS,
    *,
    batch: int = 8,
    out_channels: int = 16,
    repeats: int = 7,
    device: str = "cpu",
    dtype=torch.float32,
) -> list[dict]:
    """One row per fan-out: ``derive s`` (seconds to build ``general``'s plans), ``ms`` (median
    of each contender), ``ratio`` (general / einsum, a :class:`~fovi_ref.check.bench.timing.Ratio`)
    and ``stopped`` (how the measurement ended)."""
    rows = []
    for i, fan_out in enumerate(fan_outs, 1):
        progress(i, len(fan_outs), f"hub fan-out {fan_out}")
        meta = hub_meta(fan_out, device=device)
        start = time.perf_counter()
        meta.derived("general", derive)
        derive_s = time.perf_counter() - start
        inputs = make_inputs(meta, out_channels, batch, dtype)
        pair = ("general", "einsum")
        timed = timing.measure(
            {"general": knn_backend(inputs, "general"), "einsum": fovi_einsum(inputs)},
            ratios=[pair],
            repeats=repeats,
        )
        rows.append(
            {
                "fan-out": fan_out,
                "derive s": derive_s,
                "ms": {k: 1e3 * v for k, v in timed.medians().items()},
                "ratio": timed.ratio(*pair),
                "stopped": timed.stop_note(),
            }
        )
    return rows


def run(repeats: int = 7, device: str = "cpu", dtype=torch.float32, batch: int = 8) -> list[dict]:
    """Print the table of :func:`hub_rows` and return its rows."""
    rows = hub_rows(repeats=repeats, device=device, dtype=dtype, batch=batch)
    target = targets.HUB.at_most if dtype == torch.float32 else None
    print(f"\nhub graphs, {device} {dtype_name(dtype)}, batch {batch}: general / fovi's einsum")
    print(describe(arithmetic_settings(device)))
    print("(K = 4, V = 4, 256 inputs, 16 channels; every output reads input 0)")
    held = f"target <= {target}" if target else "no target (float32 only)"
    print(f"ratio: median ± half the IQR of the per-round ratios ({held})")
    head = f"{'fan-out':>8}{'derive s':>10}{'general ms':>12}{'einsum ms':>11}{'ratio':>12}"
    print(head + f"{'verdict':>9}  rounds")
    verdicts = []
    for r in rows:
        v = timing.verdict(r["ratio"], target) if target else "-"
        verdicts.append(v)
        print(
            f"{r['fan-out']:>8}{r['derive s']:>10.2f}{r['ms']['general']:>12.2f}"
            f"{r['ms']['einsum']:>11.2f}{r['ratio'].text(timing.mark_of(v)):>12}{v:>9}"
            f"  {r['ratio'].rounds}"
        )
    if target:
        print(f"verdict: {timing.overall(verdicts)}")
    return rows
