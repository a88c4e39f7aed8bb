"""The per-layer benchmark of ``python -m fovi_ref bench``: what is timed, the targets, tables.

Every contender runs forward + backward (gradients of ``x``, ``weight``, ``bias``), timed in
interleaved rounds in one process (:func:`fovi_ref.check.bench.timing.time_contenders`); the tables
report ratios, which hold on a noisy machine where absolute times do not.

- K = 1 layers (``res18_ds2/3/4``): ``gather_gemm`` against fovi's einsum, ``general`` and the
  two floors (Conv2d 1x1 stride 2; the three GEMMs plus zero-filling the input gradient).
- K > 1 layers: ``general`` against fovi's einsum, time and peak memory, with the GEMM floor.

:data:`fovi_ref.check.bench.targets.LAYERS` holds the targets and says which rows each holds; a
``!`` after a ratio in the tables marks a missed target, and every row ends with its verdict.
Targets hold float32 rows; float16 and bfloat16 rows are reported beside them without targets.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from fovi_ref import DTYPES, route
from fovi_ref.check.bench import contenders, profile, targets, timing
from fovi_ref.check.jobs import layer_names, progress, shared_graph_groups
from fovi_ref.geometry import RES18_DOWNSAMPLES, get_layer


def verdicts(row: dict) -> dict[str, bool]:
    """``{target name: met}`` for the targets that hold ``row``."""
    return {t.name: row[t.ratio] <= t.at_most for t in targets.holding(row)}


def mark(row: dict, ratio: str) -> str:
    """``ratio``'s value in ``row``, followed by ``!`` if it misses a target that holds it."""
    held = [t for t in targets.holding(row) if t.ratio == ratio]
    missed = any(not row["verdicts"][t.name] for t in held)
    return f"{row[ratio]:.2f}{'!' if missed else ''}"


def verdict(row: dict) -> str:
    """``met``, ``MISSED`` (some target missed) or ``-`` (no target holds the row)."""
    if not row["verdicts"]:
        return "-"
    return "met" if all(row["verdicts"].values()) else "MISSED"


def bench_downsamples(args, device, dtype_name, names) -> list[dict]:
    """K = 1 layers: gather_gemm against fovi's einsum, general, and the two floors."""
    dtype = DTYPES[dtype_name]
    rows = []
    jobs = [(n, b) for n in names for b in args.batch]
    for i, (name, batch) in enumerate(jobs, 1):
        progress(i, len(jobs), f"bench {name} batch {batch} {dtype_name}")
        layer = get_layer(name)
        inputs = contenders.make_inputs(layer.meta.to(device), layer.out_channels, batch, dtype)
        times = timing.time_contenders(
            {
                "gather_gemm": contenders.knn_backend(inputs, "gather_gemm"),
                "gather_gemm direct": contenders.knn_backend_direct(inputs, "gather_gemm"),
                "general": contenders.knn_backend(inputs, "general"),
                "einsum (fovi)": contenders.fovi_einsum(inputs),
                "conv2d floor": contenders.conv2d_floor(inputs),
                "gemm floor": contenders.gemm_floor(inputs),
            },
            repeats=args.repeats,
        )
        gg = times["gather_gemm"]
        kernels = {}
        if device.type == "cuda":  # launches per forward+backward, from the profiler
            for label, fn in (
                ("gather_gemm", contenders.knn_backend(inputs, "gather_gemm")),
                ("conv2d floor", contenders.conv2d_floor(inputs)),
            ):
                counts = profile.op_counts(profile.profile_contender(fn, device))
                kernels[label] = counts.get("cuda kernels", 0)
        rows.append(
            {
                "layer": name,
                "batch": batch,
                "dtype": dtype_name,
                "cuda kernels": kernels,
                "ms": {k: 1e3 * v for k, v in times.items()},
                "gather_gemm / einsum (fovi)": gg / times["einsum (fovi)"],
                "gather_gemm / conv2d floor": gg / times["conv2d floor"],
                "gather_gemm / gemm floor": gg / times["gemm floor"],
                "gather_gemm / general": gg / times["general"],
                "custom op / direct": gg / times["gather_gemm direct"],
            }
        )
    return rows


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
        times = timing.time_contenders(
            {**timed, "gemm floor": contenders.gemm_floor(inputs)}, repeats=args.repeats
        )
        memory = {k: timing.peak_memory_bytes(f, device) for k, f in timed.items()}
        rows.append(
            {
                "layer": ", ".join(members),
                "batch": batch,
                "dtype": dtype_name,
                "K": layer.meta.k,
                "ms": {k: 1e3 * v for k, v in times.items()},
                "MiB": {k: v / 2**20 for k, v in memory.items()},
                "general / einsum time": times["general"] / times["einsum (fovi)"],
                # The best any implementation running these three GEMMs could reach.
                "gemm floor / einsum time": times["gemm floor"] / times["einsum (fovi)"],
                "general / gemm floor": times["general"] / times["gemm floor"],
                "general / einsum peak memory": memory["general"] / memory["einsum (fovi)"],
            }
        )
    return rows


def _with_verdicts(rows: list[dict]) -> list[dict]:
    for row in rows:
        row["verdicts"] = verdicts(row)
    return rows


def alias_of(layer: str) -> str:
    """``res18_ds2`` for ``layer2.0.downsample.0``; other names unchanged."""
    return {path: alias for alias, path in RES18_DOWNSAMPLES.items()}.get(layer, layer)


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
    ds_rows, gen_rows = [], []
    for dtype_name in args.dtype:
        ds_rows += _with_verdicts(bench_downsamples(args, device, dtype_name, k1) if k1 else [])
        gen_rows += _with_verdicts(
            bench_general(args, device, dtype_name, general) if general else []
        )
    print(f"\nbench on {device}, median of {args.repeats} interleaved rounds")
    print("ratios < 1 mean the first is faster; '!' marks a missed target; targets hold float32")
    if ds_rows:
        print_downsample_table(ds_rows)
    if gen_rows:
        print_general_table(gen_rows)
    print(f"\nbench took {time.perf_counter() - start:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "dtypes": list(args.dtype),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    record = json.dumps({"run": meta, "k1": ds_rows, "general": gen_rows}, indent=1)
    write_set(out, {
        "bench.png": lambda path: plot_bench(path, ds_rows, gen_rows, meta),
        "bench.csv": lambda path: write_csv(path, ds_rows + gen_rows),
        "bench.json": lambda path: path.write_text(record),
    })  # fmt: skip
    print(f"results in {out}/bench.json, bench.csv, bench.png")


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


def print_downsample_table(rows: list[dict]) -> None:
    einsum, conv2d, small, big = (t.at_most for t in targets.LAYERS[:4])
    print(f"\nK = 1 layers (float32 targets: /einsum <= {einsum}, /conv2d <= {conv2d}, "
          f"/gemm floor <= {small} below batch 256, else {big})")  # fmt: skip
    print(
        f"{'layer':<11}{'dtype':<10}{'batch':>6}{'gg ms':>9}{'/einsum':>9}{'/conv2d':>9}"
        f"{'/gemm fl':>9}{'/general':>9}{'op/direct':>10}{'verdict':>9}"
    )
    for r in rows:
        kernels = r["cuda kernels"]
        print(
            f"{alias_of(r['layer']):<11}{r['dtype']:<10}{r['batch']:>6}"
            f"{r['ms']['gather_gemm']:>9.2f}{mark(r, 'gather_gemm / einsum (fovi)'):>9}"
            f"{mark(r, 'gather_gemm / conv2d floor'):>9}{mark(r, 'gather_gemm / gemm floor'):>9}"
            f"{r['gather_gemm / general']:>9.2f}{r['custom op / direct']:>10.2f}{verdict(r):>9}"
            + (
                f"  kernels {kernels['gather_gemm']} vs conv2d {kernels['conv2d floor']}"
                if kernels
                else ""
            )
        )


def print_general_table(rows: list[dict]) -> None:
    time, floor, memory = (t.at_most for t in targets.LAYERS[4:])
    print(f"\nK > 1 layers (float32 targets: where floor <= 0.5, time <= {time}; elsewhere "
          f"/floor <= {floor}; memory <= {memory} everywhere)")  # fmt: skip
    print("time = general / einsum; floor = the three GEMMs of the layer alone / einsum (no")
    print("implementation that runs those GEMMs can have a time below it); /floor = time / floor")
    print(
        f"{'layers':<34}{'K':>3}{'dtype':>10}{'batch':>6}{'gen ms':>9}{'time':>7}{'floor':>7}"
        f"{'/floor':>8}{'memory':>8}{'verdict':>9}"
    )
    for r in rows:
        print(
            f"{r['layer'][:33]:<34}{r['K']:>3}{r['dtype']:>10}{r['batch']:>6}"
            f"{r['ms']['general']:>9.2f}{mark(r, 'general / einsum time'):>7}"
            f"{r['gemm floor / einsum time']:>7.2f}{mark(r, 'general / gemm floor'):>8}"
            f"{mark(r, 'general / einsum peak memory'):>8}{verdict(r):>9}"
        )


def write_csv(path: Path, rows: list[dict]) -> None:
    """One line per row and target that holds it: the ratio, the target, whether it is met."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "batch", "dtype", "target", "ratio", "limit", "met"])
        for r in rows:
            for t in targets.holding(r):
                met = r["verdicts"][t.name]
                ratio = f"{r[t.ratio]:.3f}"
                writer.writerow([r["layer"], r["batch"], r["dtype"], t.name, ratio, t.at_most, met])


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
