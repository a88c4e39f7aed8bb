"""``python -m fovi_ref``: verify every backend on every fovi-resnet18 layer, then measure them.

    python -m fovi_ref                 # verify, then a short bench
    python -m fovi_ref verify [--device cuda] [--layers res18_ds2 layer1.0.conv1 ...]
    python -m fovi_ref bench  [--device cuda] [--dtype bfloat16] [--batch 64 256] [--repeats 15]

``verify`` exits non-zero if any check fails. Results go to ``results/`` (git-ignored):
``verify.json``, ``bench.json``, ``bench.csv`` and ``bench.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

from fovi_ref import bench
from fovi_ref.geometry import RES18_DOWNSAMPLES, get_layer, resnet18_layers
from fovi_ref.knn_autograd import route
from fovi_ref.verify import verify_meta

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Targets of the bench, as ratios measured side by side (issue "Main job and benchmarks").
TARGETS = {
    "gather_gemm / einsum (fovi)": 0.8,
    "gather_gemm / conv2d floor": 1.0,
    "gather_gemm / gemm floor": 2.0,
    "general / einsum time": 0.6,
    "general / einsum peak memory": 1.0,
}


def progress(step: int, total: int, what: str) -> None:
    """One overwriting status line on stderr."""
    print(f"\r[{step}/{total}] {what:<60}", end="" if step < total else "\n", file=sys.stderr)


def layer_names(requested: list[str] | None) -> list[str]:
    """Module paths for ``--layers`` (paths or res18 aliases); all 20 when none are given."""
    if not requested:
        return list(resnet18_layers())
    return [get_layer(name).name for name in requested]


# ----------------------------------------------------------------------------------- verify
def run_verify(args: argparse.Namespace) -> bool:
    device = torch.device(args.device)
    dtypes = tuple(DTYPES[d] for d in args.dtypes)
    names = layer_names(args.layers)
    rows, failures = [], 0
    for i, name in enumerate(names, 1):
        progress(i, len(names), f"verify {name}")
        layer = get_layer(name)
        checks = verify_meta(
            name, layer.meta.to(device), layer.out_channels, dtypes=dtypes, batch=args.batch
        )
        for backend in dict.fromkeys(c.backend for c in checks):
            row = {"layer": name, "route": route(layer.meta), "backend": backend}
            for dtype in dtypes:
                mine = [c for c in checks if c.backend == backend and c.dtype == dtype]
                worst = max(mine, key=lambda c: c.verdict.error / c.verdict.bound)
                ok = all(c.verdict.ok for c in mine)
                failures += not ok
                row[str(dtype)[6:]] = {
                    "ok": ok,
                    "worst": worst.quantity,
                    "error": worst.verdict.error,
                    "bound": worst.verdict.bound,
                }
            rows.append(row)
    print(f"\nverify on {device}, batch {args.batch}: forward and grad x/weight/bias vs float64")
    print("cell: PASS/FAIL, then the worst quantity's error as a fraction of its bound\n")
    header = f"{'layer':<24}{'route':<13}{'backend':<17}" + "".join(f"{d:<16}" for d in args.dtypes)
    print(header)
    for row in rows:
        cells = ""
        for d in args.dtypes:
            r = row[d]
            cells += f"{'PASS' if r['ok'] else 'FAIL'} {r['error'] / r['bound']:<11.2f}"
        print(f"{row['layer']:<24}{row['route']:<13}{row['backend']:<17}{cells}")
    total = len(rows) * len(dtypes)
    print(f"\n{total - failures} passed, {failures} failed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify.json").write_text(json.dumps(rows, indent=1))
    return failures == 0


# ------------------------------------------------------------------------------------ bench
def bench_downsamples(args, device, dtype, names) -> list[dict]:
    """K = 1 layers: gather_gemm against fovi's einsum, general, and the two floors."""
    rows = []
    jobs = [(n, b) for n in names for b in args.batch]
    for i, (name, batch) in enumerate(jobs, 1):
        progress(i, len(jobs), f"bench {name} batch {batch}")
        layer = get_layer(name)
        inputs = bench.make_inputs(layer.meta.to(device), layer.out_channels, batch, dtype)
        times = bench.time_contenders(
            {
                "gather_gemm": bench.knn_backend(inputs, "gather_gemm"),
                "gather_gemm direct": bench.knn_backend_direct(inputs, "gather_gemm"),
                "general": bench.knn_backend(inputs, "general"),
                "einsum (fovi)": bench.fovi_einsum(inputs),
                "conv2d floor": bench.conv2d_floor(inputs),
                "gemm floor": bench.gemm_floor(inputs),
            },
            repeats=args.repeats,
        )
        gg = times["gather_gemm"]
        kernels = {}
        if device.type == "cuda":  # launches per forward+backward, from the profiler
            for label, fn in (
                ("gather_gemm", bench.knn_backend(inputs, "gather_gemm")),
                ("conv2d floor", bench.conv2d_floor(inputs)),
            ):
                counts = bench.op_counts(bench.profile_contender(fn, device))
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
    groups: list[list[str]] = []
    for name in names:
        layer = get_layer(name)
        for members in groups:
            first = get_layer(members[0])
            if first.out_channels == layer.out_channels and first.meta.same_graph(layer.meta):
                members.append(name)
                break
        else:
            groups.append([name])
    rows = []
    for i, members in enumerate(groups, 1):
        layer = get_layer(members[0])
        batch = 16 if members[0] == "conv1" else args.batch_general
        progress(i, len(groups), f"bench {members[0]} batch {batch}")
        inputs = bench.make_inputs(layer.meta.to(device), layer.out_channels, batch, dtype)
        contenders = {
            "general": bench.knn_backend(inputs, "general"),
            "einsum (fovi)": bench.fovi_einsum(inputs),
        }
        times = bench.time_contenders(
            {**contenders, "gemm floor": bench.gemm_floor(inputs)}, repeats=args.repeats
        )
        memory = {k: bench.peak_memory_bytes(f, device) for k, f in contenders.items()}
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


def run_bench(args: argparse.Namespace) -> None:
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
                for measure, target in TARGETS.items():
                    if measure in r:
                        ok = r[measure] <= target
                        writer.writerow(
                            [r["layer"], r["batch"], measure, f"{r[measure]:.3f}", target, ok]
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
        for j, measure in enumerate(measures):
            xs = [i + j * width for i in range(len(rows))]
            ax.bar(xs, [r[measure] for r in rows], width, label=measure, color=f"C{j}")
            ax.hlines(TARGETS[measure], -0.4, len(rows), colors=f"C{j}", linestyles="--")
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


# -------------------------------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fovi_ref", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results", help="folder for results (default: results)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    sub = p.add_subparsers(dest="command")
    v = sub.add_parser("verify", help="every backend on every layer vs the float64 oracle")
    v.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    v.add_argument("--batch", type=int, default=4)
    v.add_argument("--layers", nargs="+", help="module paths or res18_ds* aliases (default: all)")
    b = sub.add_parser("bench", help="forward+backward timings and memory, side by side")
    b.add_argument("--dtype", default="float32", choices=list(DTYPES))
    b.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[64, 256],
        help="batch sizes for the K = 1 layers (default: 64 256)",
    )
    b.add_argument(
        "--batch-general",
        type=int,
        default=64,
        help="batch for K > 1 layers; the stem always uses 16 (default: 64)",
    )
    b.add_argument("--repeats", type=int, default=15)
    b.add_argument("--layers", nargs="+", help="module paths or res18_ds* aliases (default: all)")
    for sp in (v, b):
        sp.add_argument("--out", default=argparse.SUPPRESS)
        sp.add_argument("--device", default=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in (None, "verify"):
        defaults = parser().parse_args(["verify"])
        for key, value in vars(defaults).items():
            args.__dict__.setdefault(key, value)
        ok = run_verify(args)
        if args.command == "verify" or not ok:
            return 0 if ok else 1
        # The bare command: a short bench after a passing verify.
        args.batch, args.batch_general, args.repeats, args.layers = [64], 64, 5, None
        args.dtype = "float32"
    run_bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
