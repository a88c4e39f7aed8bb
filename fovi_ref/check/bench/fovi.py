"""``python -m fovi_ref bench --fovi``: fovi 2.4.0's own backends beside fovi_ref's routed one.

On each fovi-resnet18 layer (batch 64, the stem 16), forward + backward (gradients of ``x``,
``weight``, ``bias``) of:

- fovi's dispatcher (``KNNConvLayer`` with ``kernel_backend="auto"``; on CPU with gradients it
  picks ``baseline``) and each training-capable backend fovi has on this device that accepts the
  graph: ``baseline``, ``torch_scatter``, ``torch_compact``, and ``gather_gemm`` where
  K = V = 1 (:func:`fovi_ref.check.fovi.fovi_contenders`, fovi's code unchanged);
- fovi_ref's routed backend through :func:`fovi_ref.knn_conv`.

All of one layer's contenders are timed in interleaved rounds in one process
(:func:`fovi_ref.check.bench.timing.measure`, rounds added until every fovi_ref / fovi ratio's
IQR is within the band or a time cap), so the ratios hold on a noisy machine. The column
``fovi_ref / best fovi`` is the per-round ratio of fovi_ref to the fastest fovi contender (by
median), median ± half its IQR, with its verdict against
:data:`fovi_ref.check.bench.targets.FOVI`. Layers sharing a graph and channel count are timed
once.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fovi_ref import DTYPES, route
from fovi_ref.check import fovi as upstream
from fovi_ref.check.arithmetic import arithmetic_settings, describe
from fovi_ref.check.bench import contenders, targets, timing
from fovi_ref.check.jobs import layer_names, progress, shared_graph_groups

__all__ = ["bench_fovi", "format_table", "run"]
"""``fovi_ref / best fovi``: fovi_ref's routed backend against the fastest of fovi's own."""

# Column titles of fovi's contenders (the dispatcher's contender is named after its choice).
_SHORT = {
    "baseline": "base",
    "torch_scatter": "scatter",
    "torch_compact": "compact",
    "gather_gemm": "gg",
}


def _short(contender: str) -> str:
    """``"fovi torch_compact"`` -> ``"compact"``; ``"fovi auto (baseline)"`` -> ``"auto"``."""
    name = contender.removeprefix("fovi ")
    return "auto" if name.startswith("auto") else _SHORT.get(name, name)


def bench_fovi(
    names: Sequence[str] | None = None,
    *,
    batch: int = 64,
    stem_batch: int = 16,
    repeats: int = 5,
    warmup: int = 1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    on_layer: Callable[[int, int, str], None] | None = None,
) -> list[dict]:
    """One row per distinct graph and channel count among ``names`` (default: all 20 layers):
    ``layers``, ``batch``, ``route``, ``dispatch`` (fovi's choice), ``ms`` (median per
    contender: ``"fovi_ref <route>"`` and fovi's), ``best fovi`` and ``fovi_ref / best fovi``."""
    device = torch.device(device)
    every = upstream.fovi_resnet18_layers(device)
    groups = shared_graph_groups(layer_names(list(names) if names else None), every)
    rows = []
    for i, members in enumerate(groups, 1):
        rec = every[members[0]]
        size = stem_batch if members[0] == "conv1" else batch
        if on_layer is not None:
            on_layer(i, len(groups), f"{members[0]} batch {size}")
        inputs = contenders.make_inputs(rec.meta, rec.out_channels, size, dtype)
        ours = f"fovi_ref {route(rec.meta)}"
        timed = upstream.fovi_contenders(inputs)
        timed[ours] = contenders.knn_backend(inputs, route(rec.meta))
        measured = timing.measure(
            timed, ratios=[(ours, k) for k in timed if k != ours], repeats=repeats, warmup=warmup
        )
        times = measured.medians()
        fovi_times = {k: v for k, v in times.items() if k != ours}
        best = min(fovi_times, key=fovi_times.get)
        ratio = measured.ratio(ours, best)
        auto = next(k for k in fovi_times if k.startswith("fovi auto"))
        rows.append(
            {
                "layers": members,
                "batch": size,
                "route": route(rec.meta),
                "dispatch": auto.removeprefix("fovi auto (").removesuffix(")"),
                "ms": {k: 1e3 * v for k, v in times.items()},
                "best fovi": best,
                "fovi_ref / best fovi": ratio.median,
                "spread": [ratio.low, ratio.high],
                "rounds": measured.rounds,
                "stopped": measured.stopped,
            }
        )
    return rows


def row_ratio(row: dict) -> timing.Ratio:
    """A row's ``fovi_ref / best fovi`` with its quartiles, as a Ratio."""
    low, high = row.get("spread", [row["fovi_ref / best fovi"]] * 2)
    return timing.Ratio(row["fovi_ref / best fovi"], low, high, row.get("rounds", 1))


def format_table(rows: Sequence[dict], target: float | None = targets.FOVI.at_most) -> str:
    """Fixed-width table (within 100 characters): fovi_ref's median, then fovi_ref / each of
    fovi's contenders (``auto``: the dispatcher's choice), the fastest fovi contender and
    fovi_ref / it (``!``: over ``target``; ``None``: no target holds these rows)."""
    columns = ["auto", "base", "scatter", "compact", "gg"]
    head = f"{'layer':<21}{'route':<11}{'ref ms':>7}" + "".join(f"{c:>8}" for c in columns)
    head += f"{'best':>8}{'ref/best':>12}"
    lines = [head]
    for r in rows:
        ours = next(k for k in r["ms"] if k.startswith("fovi_ref"))
        ratios = {_short(k): r["ms"][ours] / v for k, v in r["ms"].items() if k != ours}
        layer = r["layers"][0] + (f" +{len(r['layers']) - 1}" if len(r["layers"]) > 1 else "")
        cells = "".join(f"{ratios[c]:>8.2f}" if c in ratios else f"{'-':>8}" for c in columns)
        ratio = row_ratio(r)
        mark = timing.mark_of(timing.verdict(ratio, target)) if target is not None else ""
        lines.append(
            f"{layer[:20]:<21}{r['route']:<11}{r['ms'][ours]:>7.1f}{cells}"
            f"{_short(r['best fovi']):>8}{ratio.text(mark):>12}"
        )
    return "\n".join(lines)


def run(args) -> int:
    """``python -m fovi_ref bench --fovi``: the table on stdout, ``bench_fovi.json`` in
    ``args.out``. ``args`` carries ``device``, ``dtype`` (a list of names), ``layers``,
    ``batch_general`` (the batch; the stem uses 16), ``repeats`` and ``out``. Returns the exit
    status: 0, or 2 when fovi is not installed."""
    try:
        fovi = upstream.require_fovi()
    except (upstream.FoviUnavailable, upstream.FoviVersionError) as err:
        print(f"bench --fovi: {err}", file=sys.stderr)
        return 2
    all_rows = []
    for dtype_name in args.dtype:
        rows = bench_fovi(
            args.layers,
            batch=args.batch_general,
            repeats=args.repeats,
            device=args.device,
            dtype=DTYPES[dtype_name],
            on_layer=lambda i, n, what, d=dtype_name: progress(i, n, f"bench fovi {what} {d}"),
        )
        print(
            f"\nfovi {fovi.__version__} vs fovi_ref on {args.device}, {dtype_name}, forward + "
            f"backward,\nbatch {args.batch_general} (stem 16), at least {args.repeats} "
            "interleaved rounds"
        )
        print(describe(arithmetic_settings(args.device)))
        print(
            "ref ms: fovi_ref's routed backend (median); auto..gg: fovi_ref / that fovi contender"
        )
        print(
            "(auto: fovi's dispatcher; below 1: fovi_ref faster); best: the fastest fovi contender;"
        )
        target = targets.FOVI.at_most if dtype_name == "float32" else None
        if target is None:
            limit = targets.FOVI.at_most
            print(
                f"ref/best: fovi_ref / best, median ± half its IQR (the target, <= {limit}, "
                "holds float32 only)\n"
            )
        else:
            print(
                f"ref/best: fovi_ref / best, median ± half its IQR, target <= "
                f"{targets.FOVI.at_most}:\n'!' MISSED (the IQR above it), '?' unsure (it straddles "
                "it)\n"
            )
        print(format_table(rows, target))
        if target is not None:
            verdicts = [timing.verdict(row_ratio(r), target) for r in rows]
            counts = ", ".join(f"{verdicts.count(v)} {v}" for v in ("met", "unsure", "MISSED"))
            capped = sum(r["stopped"] == "cap" for r in rows)
            print(f"\nverdict: {timing.overall(verdicts)}; rows: {counts} (of {len(rows)})")
            print(
                f"{capped} rows stopped at the time cap, the rest within the {timing.BAND:.0%} band"
            )
        all_rows += [{"dtype": dtype_name, **r} for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"fovi": fovi.__version__, "device": str(args.device), "dtypes": list(args.dtype)}
    record["arithmetic"] = arithmetic_settings(args.device)
    record |= {"repeats": args.repeats, "target": targets.FOVI.at_most, "rows": all_rows}
    (out / "bench_fovi.json").write_text(json.dumps(record, indent=1))
    return 0
