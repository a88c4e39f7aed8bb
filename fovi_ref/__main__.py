"""``python -m fovi_ref``: verify every backend on every fovi-resnet18 layer, then measure them.

    python -m fovi_ref                 # verify, then a short bench
    python -m fovi_ref verify [--device cuda] [--layers res18_ds2 layer1.0.conv1 ...]
    python -m fovi_ref bench  [--device cuda] [--dtype bfloat16] [--batch 64 256] [--repeats 15]

``verify`` exits non-zero if any check fails. Results go to ``results/`` (git-ignored):
``verify.json``, ``bench.json``, ``bench.csv`` and ``bench.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fovi_ref.bench import boundary, layers, network
from fovi_ref.bench.layers import DTYPES, layer_names, progress
from fovi_ref.geometry import get_layer
from fovi_ref.knn_autograd import route
from fovi_ref.verify import verify_meta


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
    b.add_argument(
        "--boundary",
        action="store_true",
        help="instead: the op boundary's fixed cost on tiny graphs, and 100 distinct graphs "
        "against one shared graph (eager, compiled, exported)",
    )
    b.add_argument(
        "--network",
        choices=["resnet18"],
        help="instead: the whole fovi-resnet18 trunk, routed backends against every conv on "
        "einsum_baseline, at batch 16 and 64 (time and peak memory)",
    )
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
    if getattr(args, "boundary", False):
        boundary.run()
    elif getattr(args, "network", None):
        network.run(device=args.device, dtype=DTYPES[args.dtype], repeats=args.repeats)
    else:
        layers.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
