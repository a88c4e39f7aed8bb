"""The per-layer benchmark of ``python -m fovi_ref bench``: what is timed, the targets, tables.

Every contender runs forward + backward (gradients of ``x``, ``weight``, ``bias``), timed in
interleaved rounds in one process (:func:`fovi_ref.bench.measure.time_contenders`); the tables
report ratios, which hold on a noisy machine where absolute times do not.

- K = 1 layers (``res18_ds2/3/4``): ``gather_gemm`` against fovi's einsum, ``general`` and the
  two floors (Conv2d 1x1 stride 2; the three GEMMs plus zero-filling the input gradient).
- K > 1 layers: ``general`` against fovi's einsum, time and peak memory, with the GEMM floor.

:data:`TARGETS` holds the targets each ratio is held to; a ``!`` after a ratio in the tables
marks a missed target.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import torch

from fovi_ref.bench import measure
from fovi_ref.geometry import RES18_DOWNSAMPLES, get_layer
from fovi_ref.jobs import DTYPES, layer_names, progress, shared_graph_groups
from fovi_ref.knn_autograd import route

# Targets of the bench, as ratios measured side by side (issue "Main job and benchmarks").
TARGETS = {
    "gather_gemm / einsum (fovi)": 0.8,
    "gather_gemm / conv2d floor": 1.0,
    "gather_gemm / gemm floor": 2.0,
    "general / einsum time": 0.6,
    "general / einsum peak memory": 1.0,
}


def bench_downsamples(args, device, dtype, names) -> list[dict]:
    """K = 1 layers: gather_gemm against fovi's einsum, general, and the two floors."""
    rows = []
    jobs = [(n, b) for n in names for b in args.batch]
    for i, (name, batch) in enumerate(jobs, 1):
        progress(i, len(jobs), f"bench {name} batch {batch}")
        layer = get_layer(name)
        inputs = measure.make_inputs(layer.meta.to(device), layer.out_channels, batch, dtype)
        times = measure.time_contenders(
            {
                "gather_gemm": measure.knn_backend(inputs, "gather_gemm"),
                "gather_gemm direct": measure.knn_backend_direct(inputs, "gather_gemm"),
                "general": measure.knn_backend(inputs, "general"),
                "einsum (fovi)": measure.fovi_einsum(inputs),
                "conv2d floor": measure.conv2d_floor(inputs),
                "gemm floor": measure.gemm_floor(inputs),
            },
            repeats=args.repeats,
        )
        gg = times["gather_gemm"]
        kernels = {}
        if device.type == "cuda":  # launches per forward+backward, from the profiler
            for label, fn in (
                ("gather_gemm", measure.knn_backend(inputs, "gather_gemm")),
                ("conv2d floor", measure.conv2d_floor(inputs)),
            ):
                counts = measure.op_counts(measure.profile_contender(fn, device))
                kernels[label] = counts.get("cuda kernels", 0)
        rows.append(
            {
                "layer": name,
                "batch": batch,
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


def bench_general(args, device, dtype, names) -> list[dict]:
    """K > 1 layers: general against fovi's einsum, time and peak memory; one row per distinct
    graph and channel count (layers that share both are measured once and listed together)."""
    groups = shared_graph_groups(names, {name: get_layer(name) for name in names})
    rows = []
    for i, members in enumerate(groups, 1):
        layer = get_layer(members[0])
        batch = 16 if members[0] == "conv1" else args.batch_general
        progress(i, len(groups), f"bench {members[0]} batch {batch}")
        inputs = measure.make_inputs(layer.meta.to(device), layer.out_channels, batch, dtype)
        contenders = {
            "general": measure.knn_backend(inputs, "general"),
            "einsum (fovi)": measure.fovi_einsum(inputs),
        }
        times = measure.time_contenders(
            {**contenders, "gemm floor": measure.gemm_floor(inputs)}, repeats=args.repeats
        )
        memory = {k: measure.peak_memory_bytes(f, device) for k, f in contenders.items()}
        rows.append(
            {
                "layer": ", ".join(members),
                "batch": batch,
                "K": layer.meta.k,
                "ms": {k: 1e3 * v for k, v in times.items()},
                "MiB": {k: v / 2**20 for k, v in memory.items()},
                "general / einsum time": times["general"] / times["einsum (fovi)"],
                # The best any implementation running these three GEMMs could reach.
                "gemm floor / einsum time": times["gemm floor"] / times["einsum (fovi)"],
                "general / einsum peak memory": memory["general"] / memory["einsum (fovi)"],
            }
        )
    return rows


def alias_of(layer: str) -> str:
    """``res18_ds2`` for ``layer2.0.downsample.0``; other names unchanged."""
    return {path: alias for alias, path in RES18_DOWNSAMPLES.items()}.get(layer, layer)


def mark(value: float, target: str) -> str:
    return f"{value:.2f}{'' if value <= TARGETS[target] else '!'}"


def run(args) -> None:
    """The per-layer bench: tables on stdout, ``bench.json``, ``bench.csv``, ``bench.png``
    in ``args.out``. ``args`` carries ``device``, ``dtype``, ``layers``, ``batch``,
    ``batch_general``, ``repeats`` and ``out`` (see ``python -m fovi_ref bench --help``)."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    names = layer_names(args.layers)
    k1 = [n for n in names if route(get_layer(n).meta) == "gather_gemm"]
    general = [n for n in names if n not in k1]
    start = time.perf_counter()
    ds_rows = bench_downsamples(args, device, dtype, k1) if k1 else []
    gen_rows = bench_general(args, device, dtype, general) if general else []
    print(f"\nbench on {device}, {args.dtype}, median of {args.repeats} interleaved rounds")
    print("ratios < 1 mean the first is faster; '!' marks a missed target")
    if ds_rows:
        print(
            f"\nK = 1 layers (targets: /einsum <= {TARGETS['gather_gemm / einsum (fovi)']}, "
            f"/conv2d <= {TARGETS['gather_gemm / conv2d floor']}, "
            f"/gemm floor <= {TARGETS['gather_gemm / gemm floor']})"
        )
        print(
            f"{'layer':<24}{'batch':>6}{'gg ms':>9}{'/einsum':>9}{'/conv2d':>9}{'/gemm fl':>9}"
            f"{'/general':>9}{'op/direct':>10}"
        )
        for r in ds_rows:
            print(
                f"{alias_of(r['layer']):<24}{r['batch']:>6}{r['ms']['gather_gemm']:>9.2f}"
                f"{mark(r['gather_gemm / einsum (fovi)'], 'gather_gemm / einsum (fovi)'):>9}"
                f"{mark(r['gather_gemm / conv2d floor'], 'gather_gemm / conv2d floor'):>9}"
                f"{mark(r['gather_gemm / gemm floor'], 'gather_gemm / gemm floor'):>9}"
                f"{r['gather_gemm / general']:>9.2f}{r['custom op / direct']:>10.2f}"
                + (
                    f"  kernels {r['cuda kernels']['gather_gemm']} vs conv2d "
                    f"{r['cuda kernels']['conv2d floor']}"
                    if r["cuda kernels"]
                    else ""
                )
            )
    if gen_rows:
        print(
            f"\nK > 1 layers (targets: time <= {TARGETS['general / einsum time']}, "
            f"peak memory <= {TARGETS['general / einsum peak memory']})"
        )
        print("'floor' = the three GEMMs of the layer alone / einsum: no implementation that runs")
        print("those GEMMs can have a time ratio below it")
        print(
            f"{'layers':<52}{'K':>3}{'batch':>6}{'gen ms':>9}{'time':>7}{'floor':>7}{'memory':>8}"
        )
        for r in gen_rows:
            print(
                f"{r['layer'][:51]:<52}{r['K']:>3}{r['batch']:>6}{r['ms']['general']:>9.2f}"
                f"{mark(r['general / einsum time'], 'general / einsum time'):>7}"
                f"{r['gemm floor / einsum time']:>7.2f}"
                f"{mark(r['general / einsum peak memory'], 'general / einsum peak memory'):>8}"
            )
    print(f"\nbench took {time.perf_counter() - start:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    (out / "bench.json").write_text(
        json.dumps({"run": meta, "k1": ds_rows, "general": gen_rows}, indent=1)
    )
    write_csv(out / "bench.csv", ds_rows, gen_rows)
    plot_bench(out / "bench.png", ds_rows, gen_rows, meta)
    print(f"results in {out}/bench.json, bench.csv, bench.png")


def write_csv(path: Path, ds_rows: list[dict], gen_rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "batch", "measure", "ratio", "target", "met"])
        for rows in (ds_rows, gen_rows):
            for r in rows:
                for ratio_name, target in TARGETS.items():
                    if ratio_name in r:
                        ok = r[ratio_name] <= target
                        writer.writerow(
                            [r["layer"], r["batch"], ratio_name, f"{r[ratio_name]:.3f}", target, ok]
                        )


def plot_bench(path: Path, ds_rows: list[dict], gen_rows: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=[3, 2])
    panels = [
        (
            axes[0],
            ds_rows,
            [
                "gather_gemm / einsum (fovi)",
                "gather_gemm / conv2d floor",
                "gather_gemm / gemm floor",
            ],
            "K = 1 downsamples: gather_gemm",
        ),
        (
            axes[1],
            gen_rows,
            ["general / einsum time", "general / einsum peak memory"],
            "K > 1 layers: general vs fovi's einsum",
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
            ax.hlines(TARGETS[ratio_name], -0.4, len(rows), colors=f"C{j}", linestyles="--")
        ax.set_xticks(
            [i + width * (len(measures) - 1) / 2 for i in range(len(rows))],
            labels,
            fontsize=7,
            rotation=30,
            ha="right",
        )
        ax.set_ylabel("time (or memory) ratio, dashed = target")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"fovi_ref bench: {meta['device']}, {meta['dtype']}, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
