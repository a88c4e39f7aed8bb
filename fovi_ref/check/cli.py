"""``python -m fovi_ref``: verify every backend on every fovi-resnet18 layer, then measure them.

    python -m fovi_ref                 # verify, then a short bench
    python -m fovi_ref verify [--device cuda] [--layers res18_ds2 layer1.0.conv1 ...]
    python -m fovi_ref verify --fovi   # fovi 2.4.0's own backends, judged by the same rule
    python -m fovi_ref bench  [--device cuda] [--dtype bfloat16] [--batch 64 256] [--repeats 15]

``verify`` exits non-zero if any check fails. Results go to ``results/`` (git-ignored):
``verify.json``, ``bench.json``, ``bench.csv`` and ``bench.png``.
"""

from __future__ import annotations

import argparse
import sys

from fovi_ref import verify
from fovi_ref.check.bench import boundary, fovi, layers, network, scaling
from fovi_ref.check.jobs import DTYPES


# -------------------------------------------------------------------------------------- CLI
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every option's default (lists space-separated, as typed; none for flags and for
    options whose help says what their absence means), and keeps the line breaks of
    descriptions and epilogs."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


DESCRIPTION = """\
Verify every backend of the KNN convolution on every fovi-resnet18 layer against a float64
oracle, then measure them.

Without a subcommand: verify (all layers, float32/float16/bfloat16, batch 4), and if every
check passes, a short bench (float32, batch 64, 5 rounds). Results go to the --out folder."""

VERIFY_DESCRIPTION = """\
Run forward and the gradients of x, weight and bias through every backend that accepts each
layer's graph, in each dtype, and compare them with the float64 oracle run on the same rounded
inputs (fovi_ref.reference), element by element: |value - ref| <= bound, the bound of the
error analysis of a sum of products (fovi_ref/check/tolerances.py), which holds under cancellation.

Table: one row per layer and backend; per dtype a cell "PASS 0.35" gives the verdict of the
worst of the four quantities and its worst element's error as a fraction of its bound (at most
1 passes).
Writes OUT/verify.json. Exits 1 if any check fails, else 0.

With --fovi: the same for fovi 2.4.0, the release users install from PyPI: every fovi backend
that runs here, through fovi's own fovi-resnet18 layers (its dispatcher, its all-padding mask),
in float64 too, with fovi's dispatcher choice beside fovi_ref's route. A FAIL is a finding
about fovi; the lines under the table say which side is wrong and why. Writes
OUT/verify_fovi.json; exits 1 on a FAIL, 2 if fovi is not installed."""


def _bench_epilog() -> str:
    lines = [
        "targets (float32 ratios, measured side by side; a '!' in the tables marks a miss;",
        "'floor' = the GEMM floor / fovi's einsum):",
    ]
    lines += [f"  {name:<40} <= {target}" for name, target in layers.TARGETS.items()]
    lines += [
        "with --network resnet18 (routed / all-einsum step time, per batch):",
        *(f"  {'batch ' + str(b):<40} <= {t}" for b, t in network.TARGETS.items()),
    ]
    lines += [
        "with --boundary:",
        f"  {'knn_conv / plain torch, K = 1':<40} <= {boundary.BOUNDARY_TARGET}",
        f"  {'100 distinct / shared graphs':<40} <= {boundary.SCALE_TARGET}",
        "with --fovi:",
        f"  {'fovi_ref / best fovi':<40} <= {fovi.TARGET}",
        "with --batch-scaling (every batch 1 to 16):",
        f"  {'routed / fovi einsum':<40} <= {scaling.TARGET}",
        "Definitions: fovi_ref/check/bench/layers.py, boundary.py, fovi.py and scaling.py.",
    ]
    return "\n".join(lines)


BENCH_DESCRIPTION = """\
Time forward + backward (gradients of x, weight, bias) of each contender, interleaved in rounds
in one process, and report ratios (they hold on a noisy machine where absolute times do not).
K = 1 layers (res18_ds2/3/4): gather_gemm against fovi's einsum, general, the Conv2d floor
(F.conv2d 1x1 stride 2 with as many outputs) and the GEMM floor (the layer's three GEMMs plus
zero-filling grad_x). K > 1 layers: general against fovi's einsum, time and peak memory.
Writes OUT/bench.json, bench.csv and bench.png."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fovi_ref", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    p.add_argument("--out", default="results", help="folder the result files are written to")
    p.add_argument("--device", default="cpu", help="torch device to run on: cpu or cuda")
    sub = p.add_subparsers(dest="command", title="subcommands", metavar="{verify,bench}")
    v = sub.add_parser(
        "verify",
        help="every backend on every layer vs the float64 oracle",
        description=VERIFY_DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    v.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(verify.ALL_DTYPES),
        help="dtypes to check in; if omitted: float32 float16 bfloat16, and float64 too with "
        "--fovi",
    )
    v.add_argument("--batch", type=int, default=4, help="batch size of the random inputs")
    v.add_argument(
        "--fovi",
        action="store_true",
        help="instead: fovi 2.4.0's own backends through fovi's own layers, judged by the same "
        "rule (needs: pip install --no-deps -r scripts/fovi-requirements.txt; exits 2 without "
        "it); writes OUT/verify_fovi.json",
    )
    v.add_argument(
        "--layers",
        nargs="+",
        help="module paths (layer2.0.conv1) or res18_ds2/3/4 aliases; all 20 layers if omitted",
    )
    b = sub.add_parser(
        "bench",
        help="forward+backward timings and memory, side by side",
        description=BENCH_DESCRIPTION,
        epilog=_bench_epilog(),
        formatter_class=_HelpFormatter,
    )
    b.add_argument(
        "--dtype",
        nargs="+",
        default=list(DTYPES),
        choices=list(DTYPES),
        help="dtypes of the inputs, one set of rows each (targets hold float32)",
    )
    b.add_argument(
        "--batch", type=int, nargs="+", default=[64, 256], help="batch sizes for the K = 1 layers"
    )
    b.add_argument(
        "--batch-general",
        type=int,
        default=64,
        help="batch for the K > 1 layers (the stem, conv1, always uses 16)",
    )
    b.add_argument(
        "--repeats", type=int, default=15, help="timed rounds per layer (the median is kept)"
    )
    b.add_argument(
        "--layers",
        nargs="+",
        help="module paths (layer2.0.conv1) or res18_ds2/3/4 aliases; all 20 layers if omitted",
    )
    b.add_argument(
        "--boundary",
        action="store_true",
        help="instead of the layers: the op boundary's fixed cost on tiny graphs, and 100 "
        "distinct graphs against one shared graph (eager, compiled, exported)",
    )
    b.add_argument(
        "--fovi",
        action="store_true",
        help="instead: fovi 2.4.0's own backends (its dispatcher's choice and each training "
        "backend) beside fovi_ref's routed one on every layer at --batch-general (stem 16); "
        f"target fovi_ref / best fovi <= {fovi.TARGET}; writes OUT/bench_fovi.json",
    )
    b.add_argument(
        "--batch-scaling",
        action="store_true",
        help="instead: every distinct res18 graph at batch 1, 2, 4, 8 and 16, routed backend "
        "against fovi's einsum (ms per sample and ratio)",
    )
    b.add_argument(
        "--network",
        choices=["resnet18"],
        help="instead: the whole fovi-resnet18 trunk, routed backends against every conv on "
        "einsum_baseline, at batch 16 and 64 (time and peak memory)",
    )
    for sp in (v, b):
        sp.add_argument(
            "--out", default=argparse.SUPPRESS, help="as the top-level --out (default: results)"
        )
        sp.add_argument(
            "--device", default=argparse.SUPPRESS, help="as the top-level --device (default: cpu)"
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in (None, "verify"):
        defaults = parser().parse_args(["verify"])
        for key, value in vars(defaults).items():
            args.__dict__.setdefault(key, value)
        if args.dtypes is None:
            args.dtypes = (["float64"] if args.fovi else []) + list(DTYPES)
        if args.fovi:
            return verify.run_fovi(args)
        ok = verify.run(args)
        if args.command == "verify" or not ok:
            return 0 if ok else 1
        # The bare command: a short bench after a passing verify.
        args.batch, args.batch_general, args.repeats, args.layers = [64], 64, 5, None
        args.dtype = ["float32"]
    if getattr(args, "fovi", False):
        return fovi.run(args)
    if getattr(args, "boundary", False):
        boundary.run()
    elif getattr(args, "batch_scaling", False):
        for dtype in args.dtype:
            scaling.run(args.layers, repeats=args.repeats, device=args.device, dtype=DTYPES[dtype])
    elif getattr(args, "network", None):
        for dtype in args.dtype:
            network.run(device=args.device, dtype=DTYPES[dtype], repeats=args.repeats)
    else:
        layers.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
