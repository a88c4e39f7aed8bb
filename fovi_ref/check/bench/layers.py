"""The per-layer benchmark of ``python -m fovi_ref bench``: what is timed, the targets, tables.

Every contender runs forward + backward (gradients of ``x``, ``weight``, ``bias``), timed in
interleaved rounds in one process (:func:`fovi_ref.check.bench.timing.measure`, which adds rounds
until the ratios' spread is within its band or a time cap); the tables report ratios with their
spread (median ± half the IQR of the per-round ratios), which hold on a noisy machine where
absolute times do not.

- K = 1 layers (``res18_ds2/3/4``): ``gather_gemm`` against fovi's einsum, ``general`` and the
  two floors (Conv2d 1x1 stride 2; the three GEMMs plus zero-filling the input gradient). A
  time / the GEMM floor below :data:`~fovi_ref.check.bench.timing.FLOOR_VALID` is measured
  again, and printed ``invalid`` if it stays there.
- K > 1 layers: ``general`` against fovi's einsum, time and peak memory, with the GEMM floor (each
  product dense or per occupied cell, the faster) and the floor of dense GEMMs alone.

:data:`fovi_ref.check.bench.targets.LAYERS` holds the targets and says which rows each holds; a
``!`` after a ratio marks a missed target, a ``?`` an unsure one (its IQR straddles the target),
and every row ends with its verdict (:func:`fovi_ref.check.bench.timing.verdict`). Targets hold
float32 and bfloat16 rows; float16 rows are reported beside them without targets (see
:data:`fovi_ref.check.bench.targets.LOW_PRECISION`). With every layer in the run, the layers'
times are also added up per dtype and held to :data:`fovi_ref.check.bench.targets.TRUNK`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from fovi_ref import DTYPES, KNNMeta, route
from fovi_ref.check.arithmetic import arithmetic_settings, describe
from fovi_ref.check.bench import contenders, profile, targets, timing
from fovi_ref.check.jobs import layer_names, progress, shared_graph_groups
from fovi_ref.geometry import RES18_DOWNSAMPLES, get_layer
from fovi_ref.strategies import occupied_cells, strategy_for


def ratio_of(row: dict, name: str) -> timing.Ratio:
    """The :class:`~fovi_ref.check.bench.timing.Ratio` ``name`` of ``row`` (its median is
    ``row[name]``, its quartiles ``row["iqr"][name]``)."""
    low, high = row["iqr"].get(name, (row[name], row[name]))
    return timing.Ratio(row[name], low, high, row["rounds"], name not in row["invalid"])


def add_ratios(row: dict, timed: timing.Timing, pairs: dict[str, tuple[str, str]]) -> dict:
    """``row`` with every ratio of ``pairs`` (``{name: (num, den)}``): its median as
    ``row[name]``, its quartiles in ``row["iqr"]``, invalid ones listed in ``row["invalid"]``."""
    row.setdefault("iqr", {})
    row.setdefault("invalid", [])
    for name, pair in pairs.items():
        ratio = timed.ratio(*pair)
        row[name], row["iqr"][name] = ratio.median, (ratio.low, ratio.high)
        if not ratio.valid:
            row["invalid"].append(name)
    row |= {"rounds": timed.rounds, "stopped": timed.stop_note()}
    row["ms iqr"] = {k: 1e3 * timed.measurement(k).iqr for k in timed.samples}
    return row


def verdicts(row: dict) -> dict[str, str]:
    """``{target name: met / MISSED / unsure / invalid}`` for the targets that hold ``row``."""
    return {t.name: timing.verdict(ratio_of(row, t.ratio), t.at_most) for t in targets.holding(row)}


def mark(row: dict, ratio: str) -> str:
    """``ratio``'s value and spread in ``row``, then ``!`` (a missed target) or ``?`` (unsure);
    ``invalid`` for a time below its floor."""
    held = [row["verdicts"][t.name] for t in targets.holding(row) if t.ratio == ratio]
    mark = timing.mark_of(timing.overall(held))
    if ratio not in row["iqr"] and ratio not in row["invalid"]:  # counted (memory): no spread
        return f"{row[ratio]:.2f}{mark}"
    if row["invalid"] and ratio not in row["invalid"]:  # a timed ratio of an invalid row
        return "-"
    return ratio_of(row, ratio).text(mark)


def verdict(row: dict) -> str:
    """The worst verdict of the row's targets (``-`` where none holds it)."""
    return timing.overall(list(row["verdicts"].values()))


def bench_downsamples(args, device, dtype_name, names) -> list[dict]:
    """K = 1 layers: gather_gemm against fovi's einsum, general, and the two floors."""
    dtype = DTYPES[dtype_name]
    rows = []
    jobs = [(n, b) for n in names for b in args.batch]
    for i, (name, batch) in enumerate(jobs, 1):
        progress(i, len(jobs), f"bench {name} batch {batch} {dtype_name}")
        layer = get_layer(name)
        inputs = contenders.make_inputs(layer.meta.to(device), layer.out_channels, batch, dtype)
        timed = timing.measure(
            {
                "gather_gemm": contenders.knn_backend(inputs, "gather_gemm"),
                "gather_gemm direct": contenders.knn_backend_direct(inputs, "gather_gemm"),
                "general": contenders.knn_backend(inputs, "general"),
                "einsum (fovi)": contenders.fovi_einsum(inputs),
                "conv2d floor": contenders.conv2d_floor(inputs),
                "gemm floor": contenders.gemm_floor(inputs),
            },
            ratios=[K1_RATIOS[t.ratio] for t in targets.LAYERS if t.ratio in K1_RATIOS],
            floors={K1_RATIOS["gather_gemm / gemm floor"]: timing.FLOOR_VALID},
            repeats=args.repeats,
        )
        times = timed.medians()
        kernels = {}
        if device.type == "cuda":  # launches per forward+backward, from the profiler
            for label, fn in (
                ("gather_gemm", contenders.knn_backend(inputs, "gather_gemm")),
                ("conv2d floor", contenders.conv2d_floor(inputs)),
            ):
                counts = profile.op_counts(profile.profile_contender(fn, device))
                kernels[label] = counts.get("cuda kernels", 0)
        row = {
            "layer": name,
            "batch": batch,
            "dtype": dtype_name,
            "cuda kernels": kernels,
            "ms": {k: 1e3 * v for k, v in times.items()},
        }
        rows.append(add_ratios(row, timed, K1_RATIOS))
    return rows


K1_RATIOS = {
    "gather_gemm / einsum (fovi)": ("gather_gemm", "einsum (fovi)"),
    "gather_gemm / conv2d floor": ("gather_gemm", "conv2d floor"),
    "gather_gemm / gemm floor": ("gather_gemm", "gemm floor"),
    "gather_gemm / general": ("gather_gemm", "general"),
    "custom op / direct": ("gather_gemm", "gather_gemm direct"),
}
"""The ratios of a K = 1 row, ``{name: (numerator, denominator)}``, from the paired rounds."""
GENERAL_RATIOS = {
    "general / einsum time": ("general", "einsum (fovi)"),
    "gemm floor / einsum time": ("gemm floor", "einsum (fovi)"),
    "general / gemm floor": ("general", "gemm floor"),
    "general / dense gemm floor": ("general", "dense gemm floor"),
}
"""The timed ratios of a K > 1 row."""


def empty_cell_share(meta: KNNMeta) -> float:
    """The share of ``(node, cell)`` pairs that no real neighbour falls in: zero columns of the
    cell features ``[B*Nout, Cin*V]`` that every dense GEMM multiplies."""
    occupied = len(occupied_cells.pairs(meta)["cell_node"])  # T pairs
    return 1.0 - occupied / (meta.n_out * meta.v)


def bench_general(args, device, dtype_name, names) -> list[dict]:
    """K > 1 layers: general against fovi's einsum, time and peak memory; one row per distinct
    graph and channel count (layers that share both are measured once and listed together)."""
    dtype = DTYPES[dtype_name]
    groups = shared_graph_groups(names, {name: get_layer(name) for name in names})
    rows = []
    for i, members in enumerate(groups, 1):
        layer = get_layer(members[0])
        batch = 16 if members[0] == "conv1" else args.batch_general
        progress(i, len(groups), f"bench {members[0]} batch {batch} {dtype_name}")
        inputs = contenders.make_inputs(layer.meta.to(device), layer.out_channels, batch, dtype)
        timed = {
            "general": contenders.knn_backend(inputs, "general"),
            "einsum (fovi)": contenders.fovi_einsum(inputs),
        }
        measured = timing.measure(
            {
                **timed,
                "gemm floor": contenders.gemm_floor(inputs, cells=True),
                "dense gemm floor": contenders.gemm_floor(inputs),  # the floor of dense GEMMs
            },
            ratios=[
                GENERAL_RATIOS["general / einsum time"],
                GENERAL_RATIOS["general / gemm floor"],
            ],
            floors={GENERAL_RATIOS["general / gemm floor"]: timing.FLOOR_VALID},
            repeats=args.repeats,
        )
        memory = {k: timing.peak_memory_bytes(f, device) for k, f in timed.items()}
        row = {
            "layer": ", ".join(members),
            "batch": batch,
            "dtype": dtype_name,
            "K": layer.meta.k,
            "empty cells": empty_cell_share(layer.meta),
            "strategy": strategy_for(layer.meta, batch, device, dtype).strategy,
            "ms": {k: 1e3 * v for k, v in measured.medians().items()},
            "MiB": {k: v / 2**20 for k, v in memory.items()},
            # Peak bytes are counted, not timed: no spread.
            "general / einsum peak memory": memory["general"] / memory["einsum (fovi)"],
        }
        # "gemm floor / einsum time": the best any implementation running these GEMMs could reach.
        rows.append(add_ratios(row, measured, GENERAL_RATIOS))
    return rows


def _with_verdicts(rows: list[dict]) -> list[dict]:
    for row in rows:
        row["verdicts"] = verdicts(row)
    return rows


def alias_of(layer: str) -> str:
    """``res18_ds2`` for ``layer2.0.downsample.0``; other names unchanged."""
    return {path: alias for alias, path in RES18_DOWNSAMPLES.items()}.get(layer, layer)


def row_name(row: dict) -> str:
    """A row's first layer, whole, and ``(+n)`` for the n others that share its graph and
    channels (timed once; the general table lists them below)."""
    first, *others = row["layer"].split(", ")
    return alias_of(first) + (f" (+{len(others)})" if others else "")


def timed(row: dict, text: str) -> str:
    """``text``, or ``-`` in a row with an invalid ratio: its times are no result, so the row
    prints no number (the invalid ratio itself reads ``invalid``)."""
    return "-" if row["invalid"] else text


def run(args) -> None:
    """The per-layer bench: tables on stdout, ``bench.json``, ``bench.csv``, ``bench.png``
    in ``args.out``. ``args`` carries ``device``, ``dtype`` (a list of dtype names), ``layers``,
    ``batch``, ``batch_general``, ``repeats`` and ``out`` (see ``python -m fovi_ref bench --help``).
    """
    device = torch.device(args.device)
    torch.manual_seed(0)
    names = layer_names(args.layers)
    k1 = [n for n in names if route(get_layer(n).meta) == "gather_gemm"]
    general = [n for n in names if n not in k1]
    start = time.perf_counter()
    loads = [timing.machine_load()]
    ds_rows, gen_rows = [], []
    for dtype_name in args.dtype:
        ds_rows += _with_verdicts(bench_downsamples(args, device, dtype_name, k1) if k1 else [])
        gen_rows += _with_verdicts(
            bench_general(args, device, dtype_name, general) if general else []
        )
    loads.append(timing.machine_load())
    arithmetic = arithmetic_settings(device)  # as in force: the bench times what users get
    print(f"\nbench on {device}, at least {args.repeats} interleaved rounds per row, more until")
    print(f"every target ratio's IQR is within {timing.BAND:.0%} of its median (or a time cap)")
    print("cell: median ratio ± half its IQR over the rounds; < 1: the first is faster")
    print("verdict: met (IQR at or below the target), MISSED '!' (above), unsure '?' (straddles),")
    print("invalid (a time below the GEMM floor: no result); targets hold float32 and bfloat16:")
    print(targets.LOW_PRECISION)
    print(describe(arithmetic))
    for when, load in zip(("before", "after"), loads, strict=True):
        print(f"{when}: {load.line()}")
    if ds_rows:
        print_downsample_table(ds_rows)
    if gen_rows:
        print_general_table(gen_rows)
    trunk = trunk_sums(ds_rows, gen_rows, args.batch_general, len(layer_names(None)))
    if trunk:
        print_trunk(trunk, args.batch_general)
    print_summary(ds_rows + gen_rows)
    print(f"\nbench took {time.perf_counter() - start:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "dtypes": list(args.dtype),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "arithmetic": arithmetic,
        "machine": [dataclasses.asdict(load) | {"busy": load.busy} for load in loads],
    }
    record = {"run": meta, "k1": ds_rows, "general": gen_rows, "trunk": trunk}
    record = json.dumps(record, indent=1)
    write_set(
        out,
        {
            "bench.png": lambda path: plot_bench(path, ds_rows, gen_rows, meta),
            "bench.csv": lambda path: write_csv(path, ds_rows + gen_rows),
            "bench.json": lambda path: path.write_text(record),
        },
    )
    print(f"results in {out}/bench.json, bench.csv, bench.png")


def trunk_sums(ds_rows: list[dict], gen_rows: list[dict], batch: int, layers: int) -> dict:
    """``{dtype: {"routed": ms, "einsum": ms}}``: each layer's median time added up over all
    ``layers`` (a row timed once for several layers counts once per layer; K = 1 layers at
    ``batch``), and each :data:`~fovi_ref.check.bench.targets.TRUNK` target's ratio and verdict
    under ``"targets"``. Empty unless every layer has a row in every dtype."""
    sums: dict = {}
    for r in gen_rows:
        members = len(r["layer"].split(", "))
        add = {"routed": members * r["ms"]["general"], "einsum": members * r["ms"]["einsum (fovi)"]}
        _add_to(sums, r["dtype"], add, members)
    for r in ds_rows:
        if r["batch"] == batch:
            add = {"routed": r["ms"]["gather_gemm"], "einsum": r["ms"]["einsum (fovi)"]}
            _add_to(sums, r["dtype"], add, 1)
    if not sums or any(s.pop("layers") != layers for s in sums.values()):
        return {}
    held = []
    for t in targets.TRUNK:
        if t.dtype not in sums:
            continue
        if t.ratio.startswith("routed / einsum"):
            ratio = sums[t.dtype]["routed"] / sums[t.dtype]["einsum"]
        elif "float32" in sums:  # the routed bfloat16 time over the routed float32 time
            ratio = sums[t.dtype]["routed"] / sums["float32"]["routed"]
        else:
            continue
        verdict = "met" if ratio <= t.at_most else "MISSED"  # sums of medians: no spread
        held.append({"target": t.name, "ratio": ratio, "at_most": t.at_most, "verdict": verdict})
    return sums | {"targets": held}


def _add_to(sums: dict, dtype: str, times: dict, layers: int) -> None:
    into = sums.setdefault(dtype, {"routed": 0.0, "einsum": 0.0, "layers": 0})
    into["routed"] += times["routed"]
    into["einsum"] += times["einsum"]
    into["layers"] += layers


def print_trunk(trunk: dict, batch: int) -> None:
    """The layers' times added up per dtype, and the :data:`~fovi_ref.check.bench.targets.TRUNK`
    targets (a sum of medians: no spread, so met or MISSED)."""
    where = f"K > 1 at batch {batch}, conv1 at 16, K = 1 at batch {batch}"
    print(f"\nevery layer's median time added up ({where}):")
    for dtype in (d for d in trunk if d != "targets"):
        routed, einsum = trunk[dtype]["routed"], trunk[dtype]["einsum"]
        print(f"  {dtype:<9} routed {routed:9.1f} ms  fovi einsum {einsum:9.1f} ms")
    for t in trunk["targets"]:
        print(f"  {t['target']:<58} {t['ratio']:5.2f} <= {t['at_most']}  {t['verdict']}")


def write_set(out: Path, writers: dict) -> None:
    """Write one run's files as one set: each ``writers[name](path)`` into a temporary folder
    in ``out``, then the old set removed and the new one moved in, the last name last (the
    record: where it exists, the files beside it are from its run). Interrupted while writing,
    ``out`` keeps the old set; the temporary folder is removed either way."""
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".partial-"))
    try:
        for name, write in writers.items():
            write(staging / name)
        for name in reversed(writers):
            (out / name).unlink(missing_ok=True)
        for name in writers:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def print_summary(rows: list[dict]) -> None:
    """Counts of the row verdicts, and every row the band did not settle."""
    counts = {v: [verdict(r) for r in rows].count(v) for v in timing.VERDICTS}
    print("\nverdicts: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    for r in rows:
        if "cap" in r["stopped"] or "floor" in r["stopped"]:
            print(f"  {row_name(r)} {r['dtype']} B={r['batch']}: {r['stopped']}")


def print_downsample_table(rows: list[dict]) -> None:
    conv2d = targets.limit("gather_gemm / conv2d floor")
    small = targets.limit("gather_gemm / gemm floor, batch < 256")
    big = targets.limit("gather_gemm / gemm floor, batch >= 256")
    einsum = targets.limit("gather_gemm / einsum (fovi), bfloat16")
    print(f"\nK = 1 layers (float32 targets: /conv2d <= {conv2d}, /gemm floor <= {small} below")
    print(f"batch 256, else {big}; bfloat16: /einsum <= {einsum})")
    print(
        f"{'layer':<11}{'dtype':<9}{'batch':>6}{'gg ms':>8}{'/einsum':>11}{'/conv2d':>11}"
        f"{'/gemm fl':>11}{'/general':>11}{'op/direct':>11}{'verdict':>9}"
    )
    for r in rows:
        kernels = r["cuda kernels"]
        print(
            f"{alias_of(r['layer']):<11}{r['dtype']:<9}{r['batch']:>6}"
            f"{timed(r, format(r['ms']['gather_gemm'], '.2f')):>8}"
            f"{mark(r, 'gather_gemm / einsum (fovi)'):>11}"
            f"{mark(r, 'gather_gemm / conv2d floor'):>11}{mark(r, 'gather_gemm / gemm floor'):>11}"
            f"{mark(r, 'gather_gemm / general'):>11}{mark(r, 'custom op / direct'):>11}"
            f"{verdict(r):>9}"
            + (
                f"  kernels {kernels['gather_gemm']} vs conv2d {kernels['conv2d floor']}"
                if kernels
                else ""
            )
        )


def print_general_table(rows: list[dict]) -> None:
    time = targets.limit("general / einsum time, other K > 1 layers")
    floor = targets.limit(f"general / gemm floor, {', '.join(targets.FLOOR_HELD)}")
    memory = targets.limit("general / einsum peak memory")
    time_16 = targets.limit("general / einsum time, bfloat16")
    held = ", ".join(targets.FLOOR_HELD)
    print(f"\nK > 1 layers (float32 targets: {held} /floor <= {floor}; others time <= {time};")
    print(f"memory <= {memory} everywhere; bfloat16: time <= {time_16})")
    print("time = general / einsum; floor = the three GEMMs of the layer alone / einsum, each")
    print("the faster of dense and one GEMM per occupied cell (no implementation that runs those")
    print("products can have a time below it); /floor = time / floor; /dense = time / the floor")
    print("of dense GEMMs alone (no target); strategy = what general ran (fovi_ref.strategies)")
    print(
        f"{'layers':<24}{'K':>3}{'dtype':>9}{'batch':>6}{'strategy':>15}{'gen ms':>8}{'time':>11}"
        f"{'floor':>11}{'/floor':>11}{'/dense':>11}{'memory':>7}{'verdict':>9}"
    )
    for r in rows:
        print(
            f"{row_name(r):<24}{r['K']:>3}{r['dtype']:>9}{r['batch']:>6}"
            f"{r['strategy']:>15}"
            f"{timed(r, format(r['ms']['general'], '.2f')):>8}"
            f"{mark(r, 'general / einsum time'):>11}"
            f"{mark(r, 'gemm floor / einsum time'):>11}{mark(r, 'general / gemm floor'):>11}"
            f"{mark(r, 'general / dense gemm floor'):>11}"
            f"{mark(r, 'general / einsum peak memory'):>7}{verdict(r):>9}"
        )
    shared = [f"{row_name(r)}: {r['layer']}" for r in rows if ", " in r["layer"]]
    if shared:
        print("(+n): layers that share one graph and channel counts, timed once:")
        text = "; ".join(dict.fromkeys(shared))
        print(textwrap.fill(text, 98, initial_indent="  ", subsequent_indent="  "))
    shares = [f"{r['layer'].split(', ')[0]} {r['empty cells']:.0%}" for r in rows]
    print("empty cells, whose zero features dense GEMMs multiply (the per-cell GEMMs skip them;")
    print("general runs per cell where fovi_ref.strategies.choose_strategy says it pays):")
    print(
        textwrap.fill(
            ", ".join(dict.fromkeys(shares)), 98, initial_indent="  ", subsequent_indent="  "
        )
    )


def write_csv(path: Path, rows: list[dict]) -> None:
    """One line per row and target that holds it: the ratio, its quartiles, the target and the
    verdict."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        head = ["layer", "batch", "dtype", "target", "ratio", "q1", "q3", "limit", "verdict"]
        writer.writerow(head)
        for r in rows:
            for t in targets.holding(r):
                ratio = ratio_of(r, t.ratio)
                cells = [f"{v:.3f}" for v in (ratio.median, ratio.low, ratio.high)]
                writer.writerow(
                    [
                        r["layer"],
                        r["batch"],
                        r["dtype"],
                        t.name,
                        *cells,
                        t.at_most,
                        r["verdicts"][t.name],
                    ]
                )


def _row_target(row: dict, ratio: str) -> float | None:
    """The target that holds ``row``'s ``ratio``, if one does."""
    held = [t for t in targets.holding(row) if t.ratio == ratio]
    return held[0].at_most if held else None


def plot_bench(path: Path, ds_rows: list[dict], gen_rows: list[dict], meta: dict) -> None:
    """Bars of the float32 ratios, one group per row; a black tick over a bar is its target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=[3, 2])
    panels = [
        (
            axes[0],
            [r for r in ds_rows if r["dtype"] == "float32"],
            [
                "gather_gemm / einsum (fovi)",
                "gather_gemm / conv2d floor",
                "gather_gemm / gemm floor",
            ],
            "K = 1 downsamples: gather_gemm",
        ),
        (
            axes[1],
            [r for r in gen_rows if r["dtype"] == "float32"],
            ["general / einsum time", "general / gemm floor", "general / einsum peak memory"],
            "K > 1 layers: general",
        ),
    ]
    for ax, rows, measures, title in panels:
        labels = []
        for r in rows:
            first, *others = r["layer"].split(", ")  # layers sharing one graph were timed once
            shared = f" (+{len(others)})" if others else ""
            labels.append(f"{alias_of(first)}{shared} B={r['batch']}")
        width = 0.8 / len(measures)
        for j, ratio_name in enumerate(measures):
            xs = [i + j * width for i in range(len(rows))]
            ax.bar(xs, [r[ratio_name] for r in rows], width, label=ratio_name, color=f"C{j}")
            for x, r in zip(xs, rows, strict=True):
                target = _row_target(r, ratio_name)
                if target is not None:
                    ax.hlines(target, x - width / 2, x + width / 2, colors="black", linewidth=2)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_xticks(
            [i + width * (len(measures) - 1) / 2 for i in range(len(rows))],
            labels,
            fontsize=7,
            rotation=30,
            ha="right",
        )
        ax.set_ylabel("ratio (black tick = its target)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"fovi_ref bench: {meta['device']}, float32, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
