"""``python -m fovi_ref check``: judge your own backend from a shell.

    python -m fovi_ref check my_backend.py:MyOps          # a file and the object in it
    python -m fovi_ref check mypackage.kernels:MyOps      # an importable module
    python -m fovi_ref check general --full               # a registered backend, everything
    python -m fovi_ref check my_backend.py:MyOps --device cuda   # a CUDA kernel, on the GPU

The object must follow the backend protocol of :mod:`fovi_ref.knn_autograd`; it is checked
first (:func:`fovi_ref.check.protocol.check_protocol`), then the battery of
:func:`fovi_ref.check.check_ops.check_ops` runs. The output is one line saying what will run,
the failing rows (each with its worst element and the ``check_ops`` call that replays it), a
count per check, the arithmetic the verdicts were reached under
(:func:`fovi_ref.check.arithmetic.describe`) and a verdict. Exit status: 0 when every row
passes, 1 on a FAIL or when the object does not follow the protocol, 2 when it cannot be
loaded.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from fovi_ref import DTYPES, available_ops, get_ops
from fovi_ref.check.arithmetic import describe
from fovi_ref.check.check_ops import CHECKS, DEFAULT, FULL, OpsReport, check_ops
from fovi_ref.check.jobs import DEVICE_HELP, device_argument
from fovi_ref.check.protocol import check_protocol

__all__ = ["DESCRIPTION", "add_parser", "load_object", "run"]

# What `make battery-times` (scripts/time_battery.py) last measured for a plain-PyTorch backend,
# `python -m fovi_ref check einsum_baseline` and `--full` on this project's 2-core machine:
# fovi_ref/check/battery_times.json, rounded (tests/test_check_command.py holds them to it).
# Every run prints its own time last.
DEFAULT_SECONDS = 30
FULL_SECONDS = 60

DESCRIPTION = f"""\
Judge an ops object (your own backend) against the float64 oracle: its protocol first, then
the conformance battery (oracle, the three doors, cancellation, padding, non-finite values,
calling-convention variants, gradcheck, determinism) in float64, float32, float16 and
bfloat16.

OBJECT is FILE.py:NAME, MODULE:NAME (importable from here) or a registered backend's name; a
class whose methods take self is instantiated with no arguments.

The default battery spans the sizes where kernels go wrong, one axis at a time (Nout, Nin,
Cin, Cout and batch at 1 and around 32, 64, 128; K up to 40; V past 16; inputs read by 40,
150 and 1,100 outputs; the first and last input; padding; one channel): about
{DEFAULT_SECONDS} s on 2 cores for a plain-PyTorch backend. --full adds the random graphs and
a fovi-resnet18 layer of each kind (K=1, K=2/V=4, K=9/V=9): about {FULL_SECONDS // 60} min.
--graphs res18 judges all 20 layers.

--device cuda puts the graphs, the operands and the float64 oracle on the GPU. Verdicts are
reached with TF32 and cuBLAS's 16-bit split-K reductions turned off (restored after; why:
fovi_ref/check/tolerances.py, "CUDA math settings"); the report names the device and every
such setting.

A failing row gives the worst element's index and what the graph makes of it, its value, the
oracle's and the bound, and a replay: the check_ops call that runs that case alone. Exits 0
when everything passes, 1 on a FAIL (or a protocol violation), 2 if OBJECT cannot be
loaded."""


def add_parser(sub: Any, formatter_class: type) -> argparse.ArgumentParser:
    """The ``check`` subcommand's parser, added to ``sub``."""
    c = sub.add_parser(
        "check",
        help="judge your own backend (an ops object) with the conformance battery",
        description=DESCRIPTION,
        formatter_class=formatter_class,
    )
    c.add_argument("object", metavar="OBJECT", help="FILE.py:NAME, MODULE:NAME or a backend name")
    c.add_argument(
        "--full",
        action="store_true",
        help=f"the full battery: spanning, random and res18_subset (~{FULL_SECONDS // 60} min "
        "on 2 cores)",
    )
    c.add_argument(
        "--graphs",
        nargs="+",
        help="instead of the default battery: graph names (base, nout_65, hub_1100, ...), "
        "'spanning', 'random', 'res18_subset', 'res18' or res18 layer names",
    )
    c.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(DTYPES),
        metavar="DTYPE",
        help=f"dtypes to judge in, among {', '.join(DTYPES)}; all four if omitted",
    )
    c.add_argument(
        "--checks",
        nargs="+",
        choices=list(CHECKS),
        metavar="CHECK",
        help=f"checks to run, among {', '.join(CHECKS)}; all if omitted",
    )
    c.add_argument(
        "--device",
        type=device_argument,
        default=argparse.SUPPRESS,
        help=f"{DEVICE_HELP} (default: cpu)",
    )
    c.add_argument("--seed", type=int, default=0, help="seeds the graphs and the operands")
    c.add_argument("--out", metavar="FILE", help="also write the report as JSON to FILE")
    c.add_argument("--verbose", action="store_true", help="print every row, not only failures")
    return c


def load_object(spec: str) -> Any:
    """The object ``spec`` names: ``FILE.py:NAME``, ``MODULE:NAME`` or a registered backend."""
    target, colon, name = spec.rpartition(":")
    if not colon:
        if spec in available_ops():
            return get_ops(spec)
        raise ValueError(
            f"{spec!r}: expected FILE.py:NAME or MODULE:NAME, or a registered "
            f"backend ({', '.join(available_ops())})"
        )
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{target}: no such file")
        module_spec = importlib.util.spec_from_file_location(f"_checked_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))  # its own imports, as when run there
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        if "" not in sys.path:
            sys.path.insert(0, "")  # modules in the current folder, as `python -m` finds them
        module = importlib.import_module(target)
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: {target} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def _instance_following_protocol(obj: Any) -> Any:
    """A class whose methods take ``self``: its instance (no arguments), if that follows the
    protocol; else ``None``."""
    if not isinstance(obj, type):
        return None
    try:
        return check_protocol(obj())
    except Exception:  # no instance, or one that does not follow the protocol either
        return None


def _per_check(report: OpsReport) -> str:
    passed, total = collections.Counter(), collections.Counter()
    for row in report.rows:
        total[row.check] += 1
        passed[row.check] += row.ok
    return ", ".join(f"{check} {passed[check]}/{total[check]}" for check in total)


def run(args: argparse.Namespace) -> int:
    """Load, check the protocol, run the battery, print; the exit status."""
    try:
        obj = load_object(args.object)
    except Exception as err:  # any import error of the user's file is theirs to read
        print(f"cannot load {args.object}: {type(err).__name__}: {err}")
        return 2
    try:
        check_protocol(obj)
    except TypeError as err:
        instance = _instance_following_protocol(obj)
        if instance is None:
            print(f"protocol: FAIL: {err}")
            return 1
        obj = instance
    graphs = FULL if args.full else (args.graphs or DEFAULT)
    dtypes = [DTYPES[d] for d in args.dtypes] if args.dtypes else list(DTYPES.values())
    device = getattr(args, "device", None) or "cpu"  # the subcommand's or the top-level option
    about = f"about {FULL_SECONDS // 60} min" if args.full else f"about {DEFAULT_SECONDS} s"
    if args.graphs and not args.full:
        about = "time depends on the graphs"
    print(
        f"check {obj.name!r}: protocol PASS; graphs {' '.join(graphs)}, dtypes "
        f"{' '.join(d for d in DTYPES if DTYPES[d] in dtypes)} on {device} "
        f"({about} on 2 CPU cores)"
    )
    started = time.perf_counter()
    try:
        report = check_ops(
            obj,
            graphs=graphs,
            dtypes=dtypes,
            checks=args.checks or CHECKS,
            seed=args.seed,
            device=device,
        )
    except (TypeError, ValueError) as err:
        print(f"check_ops refused the arguments: {err}")
        return 2
    if args.verbose or report.failures:
        print(report.table() if args.verbose else report.table(report.failures))
    print(_per_check(report))
    print(describe(report.arithmetic))
    took = time.perf_counter() - started
    print(f"{report.summary()}: {'PASS' if report.ok else 'FAIL'} in {took:.0f} s")
    if args.out:
        Path(args.out).write_text(report.to_json())
        print(f"wrote {args.out}")
    return 0 if report.ok else 1
