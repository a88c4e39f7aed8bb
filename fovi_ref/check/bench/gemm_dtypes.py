"""``bench --gemm-dtypes``: which dtype the GEMMs of a 16-bit call should run in on this machine.

:data:`fovi_ref.precision.GEMM_DTYPES` says, per platform and 16-bit input dtype, whether a
backend's GEMMs run *narrow* (16-bit operands, float32 accumulation) or *wide* (float32). This job
measures the choice for the machine it runs on: the forward GEMM of four res18 layers
(``[B*Nout, Cin*V] @ [Cin*V, Cout]`` at batch :data:`BATCH`), once with 16-bit operands and once
with float32 ones, timed in interleaved rounds in one process. The 16-bit GEMM is chosen where it
is the faster on all four layers; the ratio of each layer is recorded beside the choice.

The records (:data:`RECORDS`, one per platform, each written by ``bench --gemm-dtypes --out DIR``
and copied there by hand) name the machine they were measured on (the platform, the CPU model and
capability, the threads, torch, the load before and after); ``tests/test_precision.py`` holds every
entry of each recorded platform in ``GEMM_DTYPES`` to its record.
:func:`fovi_ref.check.switches.forced` sets the table for one platform within a block: the switch
that lets a CPU without a fast 16-bit GEMM run narrow.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from fovi_ref import dtype_name
from fovi_ref.check.bench.timing import (
    describe_platform,
    machine_load,
    measure,
    platform_fields,
)
from fovi_ref.geometry import get_layer
from fovi_ref.precision import SIXTEEN_BIT

__all__ = [
    "BATCH",
    "GEMM_DTYPE_SOURCES",
    "LAYERS",
    "RECORDS",
    "choose",
    "load_records",
    "measured",
    "measure_gemms",
    "run",
]

LAYERS = ("layer1.0.conv1", "layer2.0.conv1", "layer3.0.conv2", "layer4.0.conv1")
"""The layers whose forward GEMM is timed: one per stage of res18."""
BATCH = 8
"""Samples per GEMM (rows ``B*Nout``): small, since an emulated 16-bit GEMM is slow."""
RECORDS = Path(__file__).with_name("gemm_records")
"""The stored measurements ``GEMM_DTYPES`` is held to, one per platform: ``<platform>.json``."""


def measured(platform_key: str) -> str:
    """The source of an entry measured on ``platform_key``: its stored record."""
    record = f"fovi_ref/check/bench/gemm_records/{platform_key}.json"
    return f"measured: bench --gemm-dtypes, record {record}"


GEMM_DTYPE_SOURCES: dict[tuple[str, torch.dtype], str] = {
    ("cpu", torch.bfloat16): measured("cpu"),
    ("cpu", torch.float16): measured("cpu"),
    ("cpu_bf16", torch.bfloat16): measured("cpu_bf16"),
    ("cpu_bf16", torch.float16): measured("cpu_bf16"),
    ("cuda", torch.bfloat16): "derived, unmeasured: tensor cores outrun float32 units many times",
    ("cuda", torch.float16): "derived, unmeasured: tensor cores outrun float32 units many times",
}
"""Where each entry of :data:`fovi_ref.precision.GEMM_DTYPES` comes from: ``measured`` (the
platform's stored record, which ``tests/test_precision.py`` holds it to) or ``derived,
unmeasured`` (and why)."""


def _operands(layer: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(z_rows [B*Nout, Cin*V], weight^T [Cin*V, Cout])`` of ``layer``'s forward GEMM."""
    info = get_layer(layer)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(BATCH * info.meta.n_out, info.in_channels * info.meta.v, generator=g)
    weight_t = torch.randn(info.in_channels * info.meta.v, info.out_channels, generator=g)
    return rows.to(device, dtype), weight_t.to(device, dtype)


def measure_gemms(dtype: torch.dtype, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """``{layer: time of the 16-bit GEMM / time of the float32 GEMM}``, the median of paired
    rounds, for ``dtype`` on ``device``."""
    ratios = {}
    for layer in LAYERS:
        narrow = _operands(layer, dtype, device)
        wide = _operands(layer, torch.float32, device)
        contenders = {"narrow": lambda a=narrow: a[0] @ a[1], "wide": lambda a=wide: a[0] @ a[1]}
        timing = measure(contenders, ratios=[("narrow", "wide")], repeats=repeats, warmup=1)
        ratios[layer] = timing.ratio("narrow", "wide").median
    return ratios


def choose(ratios: dict[str, float]) -> str:
    """``"narrow"`` where the 16-bit GEMM is faster on every layer, else ``"wide"`` (a mixed
    result keeps the float32 GEMMs, the more accurate ones)."""
    return "narrow" if all(r < 1 for r in ratios.values()) else "wide"


def load_records() -> dict[str, dict]:
    """The stored records by platform: ``{platform: {"platform", "device", "cpu_model", ...,
    "ratios": {dtype: {layer: ratio}}, "choice": {dtype: "narrow" | "wide"}, "load": ...}}``."""
    records = (json.loads(path.read_text()) for path in sorted(RECORDS.glob("*.json")))
    return {record["platform"]: record for record in records}


def run(out: str = "results", device: str | torch.device = "cpu", repeats: int = 3) -> dict:
    """Measure, print a table and the choice per 16-bit dtype, and write
    ``OUT/<platform>.json`` (copy it into :data:`RECORDS` to make it the stored one), with the
    machine's fields (:func:`~fovi_ref.check.bench.timing.platform_fields`) and its load before
    and after."""
    device = torch.device(device)
    fields = platform_fields(device)
    start = machine_load()
    print(f"bench --gemm-dtypes on {describe_platform(fields)}; {start.line()}")
    print("16-bit GEMM time / float32 GEMM time, forward GEMM of each layer at batch", BATCH)
    record = {**fields, "batch": BATCH, "ratios": {}, "choice": {}}
    for dtype in SIXTEEN_BIT:
        ratios = measure_gemms(dtype, device, repeats)
        record["ratios"][dtype_name(dtype)] = {k: round(v, 3) for k, v in ratios.items()}
        record["choice"][dtype_name(dtype)] = choose(ratios)
    end = machine_load()
    record["load"] = {"start": asdict(start), "end": asdict(end)}
    names = [dtype_name(d) for d in SIXTEEN_BIT]
    print(f"  {'layer':<16}" + "".join(f"{n:>10}" for n in names))
    for layer in LAYERS:
        print(f"  {layer:<16}" + "".join(f"{record['ratios'][n][layer]:>10.2f}" for n in names))
    print(f"  {'choice':<16}" + "".join(f"{record['choice'][n]:>10}" for n in names))
    print(f"after: {end.line()}")
    path = Path(out) / f"{fields['platform']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record in {path}; the stored ones are in {RECORDS}")
    return record
