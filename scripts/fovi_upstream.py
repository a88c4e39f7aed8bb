"""Check fovi 2.4.0, the release users install, against fovi_ref; print what was measured.

    .venv/bin/python scripts/fovi_upstream.py                 # everything, CPU (a few minutes)
    .venv/bin/python scripts/fovi_upstream.py --layers layer4.0.conv2 --skip-network --skip-bench

Needs ``pip install --no-deps -r scripts/fovi-requirements.txt``. Prints, in order:

1. the table of :func:`fovi_ref.upstream.verify_fovi`: every fovi backend that runs here on
   fovi-resnet18's layers (fovi's own ``KNNConvLayer`` modules) in four dtypes, errors against
   the float64 oracle, with fovi's dispatcher choice beside fovi_ref's route;
2. fovi's dispatcher over layers, dtypes, batches and grad mode (where it differs from
   ``baseline``);
3. the whole network: fovi's KNNResNet-18 in float64 through fovi's baseline and with every
   conv swapped to fovi_ref's ``einsum_baseline``: logits, conv outputs, parameter gradients,
   and the losses of 20 SGD steps;
4. timings (medians, interleaved) of fovi's contenders beside fovi_ref's backends.

Exit status 0 whatever the verdicts: this reports; the tests judge.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from fovi_ref import bench, route, upstream

DTYPES = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _section(title: str) -> None:
    print(f"\n== {title}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="*", help="module paths (default: all 20)")
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="SGD steps of the network check")
    parser.add_argument("--skip-network", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args(argv)

    fovi = upstream.require_fovi()
    print(f"fovi {fovi.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = upstream.fovi_resnet18_layers(device)
    if args.layers:
        layers = {name: layers[name] for name in args.layers}

    _section(f"fovi backends on fovi's layers vs the float64 oracle ({device}, batch {args.batch})")
    checks = upstream.verify_fovi(
        layers, dtypes=tuple(DTYPES[d] for d in args.dtypes), batch=args.batch, device=device
    )
    print(upstream.format_fovi_table(checks))

    _section("fovi's dispatcher (FOVI_KNN_BACKEND unset); every other cell is baseline")
    rows = upstream.dispatch_table(layers, batches=(1, 64))
    print(Counter((r.device, r.grad, r.fovi) for r in rows))
    for r in rows:
        if r.fovi != "baseline":
            mode = "grad" if r.grad else "no_grad"
            print(f"  {r.layer:<22}{r.device:<5}{mode:<8}{str(r.dtype):<15}B={r.batch:<3} {r.fovi}")
    print(f"  fovi_ref routes: {Counter(route(rec.meta) for rec in layers.values())}")

    if not args.skip_network:
        _section(
            "whole network: fovi's KNNResNet-18, float64, batch 2, baseline vs einsum_baseline"
        )
        model = upstream.build_fovi_resnet18(dtype=torch.float64, device=device)
        batches = upstream.random_batches(model, args.steps)
        result = upstream.compare_model(model, *batches[0])
        print(result.summary())
        differ = [n for n, same in result.layer_identical.items() if not same]
        print(f"  conv outputs that differ: {', '.join(differ) or 'none'}")
        strides = result.layer_strides["conv1"]
        print(f"  conv1 output strides: fovi {strides[0]}, fovi_ref {strides[1]}")
        training = upstream.compare_training(model, batches)
        print(
            f"  {args.steps} SGD steps: losses identical {training.identical}, max difference "
            f"{training.max_difference:.1e}; first {training.fovi_losses[0]:.6f}, "
            f"last {training.fovi_losses[-1]:.6f} (fovi) / {training.fovi_ref_losses[-1]:.6f}"
        )

    if not args.skip_bench:
        _section(f"timing (median ms, forward + backward, batch {args.batch}, float32)")
        for name, rec in layers.items():
            inputs = bench.make_inputs(rec.meta, rec.out_channels, args.batch, torch.float32)
            contenders = upstream.fovi_contenders(inputs)
            for backend in (route(rec.meta), "einsum_baseline"):
                contenders[f"fovi_ref {backend}"] = bench.knn_backend(inputs, backend)
            times = bench.time_contenders(contenders, repeats=5, warmup=1)
            cells = "  ".join(f"{n.removeprefix('fovi ')} {1e3 * t:.2f}" for n, t in times.items())
            print(f"{name:<22}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
