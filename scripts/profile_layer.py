"""Where one layer's forward + backward spends its time: the routed backend beside fovi's einsum.

    .venv/bin/python scripts/profile_layer.py layer3.0.conv2 --batch 1 4
    .venv/bin/python scripts/profile_layer.py res18_ds2 --batch 64 --calls 10
    .venv/bin/python scripts/profile_layer.py layer4.0.conv1 --batch 32 --dtype bfloat16

For each batch, every contender (the routed backend through ``knn_conv``, fovi's einsum path, and
the layer's GEMM floor) runs ``--calls`` times under ``torch.profiler`` in ``--dtype``; the table
gives each operator's self CPU time per call and its share of the contender's total, so the GEMMs'
share and what is left beside them can be read off. The first line names the machine (the platform
decides whether 16-bit GEMMs run narrow: :mod:`fovi_ref.precision`). The profiler adds its own cost
to every operator: these are shares, not timings (``python -m fovi_ref bench --batch-scaling``
gives the ratios).
"""

from __future__ import annotations

import argparse

import torch

from fovi_ref import DTYPES, dtype_name, route
from fovi_ref.check.bench.contenders import fovi_einsum, gemm_floor, knn_backend, make_inputs
from fovi_ref.check.bench.profile import profile_contender
from fovi_ref.check.bench.timing import describe_platform, platform_fields
from fovi_ref.geometry import UnknownLayerError, get_layer

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")
TOP = 8  # operators listed per contender


def profile_table(name: str, batch: int, calls: int, dtype: torch.dtype) -> None:
    layer = get_layer(name)
    inputs = make_inputs(layer.meta, layer.out_channels, batch, dtype)
    contenders = {
        f"routed ({route(layer.meta)})": knn_backend(inputs, route(layer.meta)),
        "fovi einsum": fovi_einsum(inputs),
        "GEMM floor": gemm_floor(inputs),
    }
    print(f"\n{name}, batch {batch}, {dtype_name(dtype)}, {calls} calls each: self CPU us per call")
    for label, run in contenders.items():
        prof = profile_contender(lambda run=run: [run() for _ in range(calls)], warmup=3)
        ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in ops) / calls
        gemm = sum(e.self_cpu_time_total for e in ops if e.key in GEMMS) / calls
        print(f"  {label}: {total:.0f} us, GEMMs {gemm / total:.0%}, {len(ops)} operator kinds")
        for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:TOP]:
            per_call = e.self_cpu_time_total / calls
            print(
                f"    {e.key.removeprefix('aten::'):34s}{e.count // calls:>5} calls"
                f"{per_call:>10.1f} us{per_call / total:>6.0%}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layer", help="a module path (layer2.0.conv1) or res18_ds2/3/4")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--calls", type=int, default=30, help="calls profiled per contender")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    if min(args.batch) < 1 or args.calls < 1:
        parser.error("--batch and --calls take positive integers")
    try:
        get_layer(args.layer)
    except UnknownLayerError as err:
        parser.error(err.args[0])
    torch.manual_seed(0)
    print(describe_platform(platform_fields("cpu")))
    for batch in args.batch:
        profile_table(args.layer, batch, args.calls, DTYPES[args.dtype])


if __name__ == "__main__":
    main()
