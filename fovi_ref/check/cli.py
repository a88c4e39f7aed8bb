"""``python -m fovi_ref``: verify every backend on every fovi-resnet18 layer, then measure them.

    python -m fovi_ref                 # verify, then a short bench
    python -m fovi_ref verify [--device cuda] [--layers res18_ds2 layer1.0.conv1 ...]
    python -m fovi_ref verify --fovi   # fovi 2.4.0's own backends, judged by the same rule
    python -m fovi_ref verify --fovi-model mymodels:small_net   # the same on your own fovi model
    python -m fovi_ref bench  [--device cuda] [--dtypes bfloat16] [--batch 64 256] [--repeats 15]
    python -m fovi_ref check my_backend.py:MyOps [--full] [--device cuda]   # your own backend

``verify`` exits non-zero if any check fails; ``verify --fovi`` and ``--fovi-model`` exit 0
when every failure is a known finding about fovi, 1 on a new one (on any with ``--strict``).
Results go to ``results/`` (git-ignored): ``verify.json``, ``bench.json``, ``bench.csv`` and
``bench.png``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from fovi_ref import DTYPES, dtype_name
from fovi_ref.check import check_command, verify
from fovi_ref.check.bench import (
    boundary,
    fovi,
    gemm_dtypes,
    hub,
    layers,
    network,
    scaling,
    strategies,
    targets,
)
from fovi_ref.check.fovi import verify as fovi_verify
from fovi_ref.check.jobs import DEVICE_HELP, LOW_AND_SINGLE, device_argument, layer_names


def _positive(text: str) -> int:
    """A size of at least 1 (a batch of 0 or 0 repeats would give verdicts on nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _check_before_running(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before anything runs, layers that do not exist and an --out folder that cannot
    be written."""
    try:  # --fovi-model's --layers name its model's modules: run_fovi checks those
        if getattr(args, "layers", None) and not getattr(args, "fovi_model", None):
            layer_names(args.layers)
    except (KeyError, ValueError) as err:
        p.error(f"--layers: {err}")
    out = Path(getattr(args, "out", None) or "results")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as err:
        p.error(f"--out {out}: cannot write there ({err.strerror or err})")


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
The header names the device and the arithmetic the verdicts were reached under: TF32 and
cuBLAS's 16-bit reduced-precision reductions are turned off while judging and restored after
(why: fovi_ref/check/tolerances.py, "CUDA math settings"); verify.json records the same.
Writes OUT/verify.json. Exits 1 if any check fails, else 0.

With --fovi: the same for fovi 2.4.0, the release users install from PyPI: every fovi backend
that runs here, through fovi's own fovi-resnet18 layers (its dispatcher, its all-padding mask),
in float64 too, with fovi's dispatcher choice beside fovi_ref's route. A FAIL is a finding
about fovi; the lines under the table say which side is wrong and why. Writes
OUT/verify_fovi.json.

With --fovi-model MODULE:FACTORY: the same on every KNNConvLayer of your own fovi model, in
float32 and float64 unless --dtypes says otherwise (the table verify_fovi_model prints in Python,
column for column). Writes OUT/verify_fovi_model.json.

Exit status of --fovi and --fovi-model, for gating CI: 0 when every check passes or every
failure is a known finding about fovi (diagnosed on fovi's side and reproduced by a script in
scripts/fovi_findings/, such as torch_compact's float64 gradients accumulated in float32);
1 on a new failure (the lines under the table name each one); with --strict, 1 on any failure;
2 if fovi is not installed, MODULE:FACTORY gives no model, or --layers names a layer it lacks."""


def _bench_epilog() -> str:
    lines = [
        "targets (ratios measured side by side, float32 unless they say bfloat16; a '!' in",
        "the tables marks a miss; 'floor' = the GEMM floor / fovi's einsum):",
    ]
    lines += [f"  {t.name:<40} <= {t.at_most}" for t in targets.LAYERS]
    lines += ["with every layer (times added up over the layers, per dtype):"]
    lines += [f"  {t.name:<40} <= {t.at_most}" for t in targets.TRUNK]
    lines += ["with --network resnet18:"]
    lines += [f"  {t.name:<40} <= {t.at_most}" for t in targets.NETWORK.values()]
    modes = (
        ("--boundary", (targets.BOUNDARY, targets.SCALE)),
        ("--fovi", (targets.FOVI,)),
        ("--batch-scaling", (targets.SCALING,)),
        ("--hub", (targets.HUB,)),
    )
    for flag, held in modes:
        lines += [f"with {flag}:", *(f"  {t.name:<40} <= {t.at_most}" for t in held)]
    lines += ["Definitions: fovi_ref/check/bench/targets.py."]
    return "\n".join(lines)


BENCH_DESCRIPTION = """\
Time forward + backward (gradients of x, weight, bias) of each contender, interleaved in rounds
in one process, and report ratios (they hold on a noisy machine where absolute times do not).
K = 1 layers (res18_ds2/3/4): gather_gemm against fovi's einsum, general, the Conv2d floor
(F.conv2d 1x1 stride 2 with as many outputs) and the GEMM floor (the layer's three GEMMs plus
zero-filling grad_x). K > 1 layers: general against fovi's einsum, time and peak memory.
Writes OUT/bench.json, bench.csv and bench.png.

Each ratio prints as median ± half its interquartile range over the rounds; rounds are added
until every target ratio's IQR is within 10% of its median or a time cap is reached (the tables
say which). Verdicts: met (the IQR at or below the target), MISSED '!' (above), unsure '?' (it
straddles the target), invalid (a time below the GEMM floor: measured again, never printed).
The header and bench.json name the device and the math settings in force (matmul precision,
TF32, cuBLAS's 16-bit reductions): the bench times what a user gets and changes none of them."""


# The jobs, and the options each one honours; an option given to a job that does not honour it
# is an error, not silently ignored. Defaults are filled in after that check.
DEFAULTS = {
    "out": "results",
    "device": "cpu",
    "dtypes": None,
    "dtype": list(LOW_AND_SINGLE),
    "batch": None,
    "batch_general": 64,
    "repeats": 15,
    "layers": None,
    "fovi_model": None,
    "strict": None,
    "machine_finding": None,
}
FOVI_OPTIONS = ("fovi_model", "strict", "machine_finding")
"""The options only ``verify --fovi`` (and ``--fovi-model``) honours."""
JOBS = {
    ("verify", "oracle"): ("out", "device", "dtypes", "batch", "layers"),
    ("verify", "fovi"): ("out", "device", "dtypes", "batch", "layers", *FOVI_OPTIONS),
    ("bench", "layers"): ("out", "device", "dtype", "batch", "batch_general", "repeats", "layers"),
    ("bench", "boundary"): (),
    ("bench", "fovi"): ("out", "device", "dtype", "batch_general", "repeats", "layers"),
    ("bench", "batch_scaling"): ("device", "dtype", "repeats", "layers"),
    ("bench", "network"): ("device", "dtype", "repeats"),
    ("bench", "hub"): ("device", "dtype", "repeats"),
    ("bench", "strategies"): ("out", "repeats"),
    ("bench", "gemm_dtypes"): ("out", "device"),
}
BENCH_MODES = ("boundary", "fovi", "batch_scaling", "network", "hub", "strategies", "gemm_dtypes")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fovi_ref", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    p.add_argument("--out", help="folder the result files are written to (default: results)")
    p.add_argument("--device", type=device_argument, help=f"{DEVICE_HELP} (default: cpu)")
    sub = p.add_subparsers(dest="command", title="subcommands", metavar="{verify,bench,check}")
    v = sub.add_parser(
        "verify",
        help="every backend on every layer vs the float64 oracle",
        description=VERIFY_DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    v.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(DTYPES),
        help="dtypes to check in, one table column each; if omitted: float32 float16 bfloat16, "
        "float64 too with --fovi, and float32 float64 with --fovi-model",
    )
    v.add_argument("--batch", type=_positive, help="batch size of the random inputs (default: 4)")
    v.add_argument(
        "--fovi",
        action="store_true",
        help="instead: fovi 2.4.0's own backends through fovi's own layers, judged by the same "
        "rule (needs: pip install --no-deps -r scripts/fovi-requirements.txt; exits 2 without "
        "it); writes OUT/verify_fovi.json",
    )
    v.add_argument(
        "--fovi-model",
        metavar="MODULE:FACTORY",
        help="check your own fovi model: as --fovi, on every KNNConvLayer of the model that "
        "FACTORY() in MODULE (importable from here) returns; --layers then names its module "
        "paths; writes OUT/verify_fovi_model.json",
    )
    v.add_argument(
        "--strict",
        action="store_true",
        default=None,
        help="with --fovi or --fovi-model: exit 1 on any FAIL, known findings about fovi "
        "included (without it they exit 0)",
    )
    v.add_argument(
        "--no-machine-finding",
        dest="machine_finding",
        action="store_false",
        default=None,
        help="with --fovi: skip comparing fovi's graphs built under two CPU arithmetic settings "
        "(a fact about the CPU, not the device: minutes on 2 cores; scripts/gpu_check.sh skips it)",
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
        "--dtypes",
        dest="dtype",
        nargs="+",
        choices=list(DTYPES),
        help="dtypes of the inputs, one set of rows each (targets hold float32 and bfloat16) "
        f"(default: {' '.join(LOW_AND_SINGLE)})",
    )
    b.add_argument(
        "--batch",
        type=_positive,
        nargs="+",
        help="batch sizes for the K = 1 layers (default: 64 256)",
    )
    b.add_argument(
        "--batch-general",
        type=_positive,
        help="batch for the K > 1 layers (the stem, conv1, always uses 16) (default: 64)",
    )
    b.add_argument(
        "--repeats",
        type=_positive,
        help="timed rounds per layer (the median is kept) (default: 15)",
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
        "distinct graphs against one shared graph (eager, compiled, exported); takes no other "
        "option",
    )
    b.add_argument(
        "--fovi",
        action="store_true",
        help="instead: fovi 2.4.0's own backends (its dispatcher's choice and each training "
        "backend) beside fovi_ref's routed one on every layer at --batch-general (stem 16); "
        f"target fovi_ref / best fovi <= {targets.FOVI.at_most}; writes OUT/bench_fovi.json",
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
    b.add_argument(
        "--hub",
        action="store_true",
        help="instead: hub graphs (every output reads one input, fan-out 1k to 32k): the time "
        "to derive general's plans, and general against fovi's einsum",
    )
    b.add_argument(
        "--strategies",
        action="store_true",
        help="instead: the routed general backend's choice on res18, and each tuned constant's "
        "path timed forced on and off on both sides of it (CPU, float32; --repeats sets the "
        f"rounds, default {strategies.ROUNDS}); says whether each constant agrees; writes "
        "OUT/bench_strategies.json",
    )
    b.add_argument(
        "--gemm-dtypes",
        action="store_true",
        help="instead: a 16-bit GEMM against a float32 one on four res18 layers' forward GEMM, "
        "per 16-bit dtype, and the choice fovi_ref.precision.GEMM_DTYPES should hold for this "
        "machine (narrow: 16-bit GEMMs; wide: float32); writes OUT/<platform>.json",
    )
    check_command.add_parser(sub, _HelpFormatter)
    for sp in (v, b):
        sp.add_argument(
            "--out", default=argparse.SUPPRESS, help="as the top-level --out (default: results)"
        )
        sp.add_argument(
            "--device",
            type=device_argument,
            default=argparse.SUPPRESS,
            help=f"{DEVICE_HELP} (default: cpu)",
        )
    return p


def _subparser(p: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of ``command`` (``p`` itself without one): its errors print its usage."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return p


FLAGS = {"dtype": "--dtypes", "machine_finding": "--no-machine-finding"}
"""Options whose flag is not their key spelled with dashes (one spelling across subcommands)."""


def _job(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, str]:
    """The job ``args`` ask for, after refusing options that job does not honour."""
    p = _subparser(p, args.command)
    if args.command == "verify":
        job = ("verify", "fovi" if args.fovi or args.fovi_model else "oracle")
    else:
        modes = [m for m in BENCH_MODES if getattr(args, m)]
        if len(modes) > 1:
            flags = ", ".join(f"--{m.replace('_', '-')}" for m in BENCH_MODES)
            p.error(f"bench takes one of {flags}")
        job = ("bench", modes[0] if modes else "layers")
    given = [k for k in DEFAULTS if getattr(args, k, None) is not None]
    unused = [FLAGS.get(k, f"--{k.replace('_', '-')}") for k in given if k not in JOBS[job]]
    if unused:
        flag = "" if job[1] in ("oracle", "layers") else f" --{job[1].replace('_', '-')}"
        p.error(f"{job[0]}{flag} does not use {', '.join(unused)}")
    return job


MAIN_JOB = """\
fovi_ref main job: verify every backend on every fovi-resnet18 layer against the float64 oracle
(20 layers; float32, float16, bfloat16), then, if all pass, a short bench (float32 and bfloat16
side by side, batch 64, 5 rounds). About {minutes} minutes on 2 quiet CPU cores; much longer
on a busy machine. Progress on stderr; the tables here; files in {out}/."""
MAIN_JOB_MINUTES = 6
"""The main job's duration on a quiet 2-core machine, as announced: 5.8 min measured when issue
37 added bfloat16 to its bench (fovi's einsum in bfloat16 takes most of it on a CPU whose 16-bit
GEMMs are emulated); every run prints its own time last, which is the figure to trust."""


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:  # refused with the usage of the subcommand it was given to
        _subparser(p, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "check":  # its --out is a file, and it takes no other job's options
        return check_command.run(args)
    _check_before_running(_subparser(p, args.command), args)
    if args.command is None:  # the bare command: verify, then a short bench if it passed
        start = time.perf_counter()
        args.command, args.fovi = "verify", False
        filled = _filled(args, ("verify", "oracle"))
        print(MAIN_JOB.format(minutes=MAIN_JOB_MINUTES, out=filled.out), flush=True)
        passed = verify.run(filled)
        if passed:
            dtypes = ["float32", "bfloat16"]
            short = argparse.Namespace(**vars(args), dtype=dtypes, batch=[64], repeats=5)
            layers.run(_filled(short, ("bench", "layers")))
        print(f"\nmain job took {time.perf_counter() - start:.0f} s")
        return 0 if passed else 1
    job = _job(p, args)
    rounds_given = args.repeats if args.command == "bench" else None  # before the defaults
    args = _filled(args, job)
    if job == ("verify", "oracle"):
        return 0 if verify.run(args) else 1
    if job == ("verify", "fovi"):
        return fovi_verify.run_fovi(args)
    if job == ("bench", "boundary"):
        boundary.run()
    elif job == ("bench", "fovi"):
        return fovi.run(args)
    elif job == ("bench", "batch_scaling"):
        for dtype in args.dtype:
            scaling.run(args.layers, repeats=args.repeats, device=args.device, dtype=DTYPES[dtype])
    elif job == ("bench", "hub"):
        for dtype in args.dtype:
            hub.run(repeats=args.repeats, device=args.device, dtype=DTYPES[dtype])
    elif job == ("bench", "strategies"):
        strategies.run(out=args.out, rounds=rounds_given or strategies.ROUNDS)
    elif job == ("bench", "gemm_dtypes"):
        gemm_dtypes.run(out=args.out, device=args.device)
    elif job == ("bench", "network"):
        for dtype in args.dtype:
            network.run(device=args.device, dtype=DTYPES[dtype], repeats=args.repeats)
    else:
        layers.run(args)
    return 0


def _filled(args: argparse.Namespace, job: tuple[str, str]) -> argparse.Namespace:
    """``args`` with every option the job honours set (the job's defaults where not given)."""
    filled = dict(vars(args))
    for key, default in DEFAULTS.items():
        if filled.get(key) is None:
            filled[key] = default
    if job[0] == "verify":
        filled["batch"] = filled["batch"] or 4
        if filled["dtypes"] is None and filled["fovi_model"]:  # as verify_fovi_model's table
            filled["dtypes"] = [dtype_name(d) for d in fovi_verify.MODEL_DTYPES]
        elif filled["dtypes"] is None:
            filled["dtypes"] = (["float64"] if job[1] == "fovi" else []) + list(LOW_AND_SINGLE)
    else:
        filled["batch"] = filled["batch"] or [64, 256]
    return argparse.Namespace(**filled)
