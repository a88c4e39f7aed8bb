"""The whole-network figure: ``python -m fovi_ref bench --network resnet18``.

Forward + backward (every parameter's gradient) of the fovi-resnet18 trunk
(:class:`fovi_ref.check.network.ResNet18Trunk`: 20 KNN convs with BatchNorm, ReLU, the max
pool and the residual adds, as fovi wires them), with every convolution routed by the
dispatcher, against the same trunk with every convolution on ``einsum_baseline`` (fovi's
arithmetic). Both start from one
state dict and see one input; time is the per-round ratio over interleaved rounds (median ± half
its IQR, rounds added until the IQR is within the band or a time cap:
:func:`fovi_ref.check.bench.timing.measure`), memory the peak bytes allocated during one step.
Targets (time, routed / einsum): :data:`fovi_ref.check.bench.targets.NETWORK`.
"""

from __future__ import annotations

import torch

from fovi_ref import dtype_name
from fovi_ref.check.bench import targets, timing
from fovi_ref.check.bench.contenders import Contender
from fovi_ref.check.bench.timing import peak_memory_bytes
from fovi_ref.check.network import ResNet18Trunk

__all__ = ["network_rows", "run", "trunk_step"]

CAP_S = 90.0
"""Seconds one batch size may take before it stops adding rounds (a step takes up to ~1 s)."""
"""Routed / all-einsum step time the trunk should reach in float32, per batch size."""


def trunk_step(model: torch.nn.Module, x: torch.Tensor) -> Contender:
    """One forward + backward of ``model`` on ``x`` (gradients of every parameter)."""
    params = list(model.parameters())

    def step():
        return torch.autograd.grad(model(x).square().mean(), params)

    return step


def network_rows(
    batches=(16, 64), repeats: int = 5, device: str = "cpu", dtype=torch.float32
) -> list[dict]:
    """One row per batch size: milliseconds and MiB of each trunk, and their ratios."""
    torch.manual_seed(0)
    routed = ResNet18Trunk().to(device=device, dtype=dtype)
    einsum = ResNet18Trunk(backend="einsum_baseline").to(device=device, dtype=dtype)
    einsum.load_state_dict(routed.state_dict())
    n_in = routed.conv1.meta.n_in
    rows = []
    for batch in batches:
        held = targets.NETWORK.get(batch)
        x = torch.randn(batch, 3, n_in, device=device, dtype=dtype)
        steps = {"routed": trunk_step(routed, x), "einsum": trunk_step(einsum, x)}
        timed = timing.measure(
            steps, ratios=[("routed", "einsum")], repeats=repeats, warmup=1, cap_s=CAP_S
        )
        times, ratio = timed.medians(), timed.ratio("routed", "einsum")
        memory = {name: peak_memory_bytes(step, device) for name, step in steps.items()}
        rows.append(
            {
                "batch": batch,
                "ms": {k: 1e3 * v for k, v in times.items()},
                "MiB": {k: v / 2**20 for k, v in memory.items()},
                "time ratio": ratio.median,
                "spread": [ratio.low, ratio.high],
                "rounds": timed.rounds,
                "stopped": timed.stop_note(),
                "memory ratio": memory["routed"] / memory["einsum"],
                "target": held.at_most if held and dtype == torch.float32 else None,
            }
        )
    return rows


def run(batches=(16, 64), repeats: int = 5, device: str = "cpu", dtype=torch.float32) -> list:
    """Print the table of :func:`network_rows` and return its rows."""
    rows = network_rows(batches, repeats, device, dtype)
    print(f"fovi-resnet18 trunk, forward + backward, {device} {dtype_name(dtype)}: routed / einsum")
    print("time: median ± half the IQR of the per-round ratios; verdict: met (the IQR at or below")
    print("the target), MISSED '!' (above), unsure '?' (it straddles the target)")
    print(
        f"{'batch':>6}{'routed ms':>11}{'einsum ms':>11}{'time':>12}{'target':>8}{'memory':>8}"
        f"{'verdict':>9}"
    )
    for r in rows:
        ratio = timing.Ratio(r["time ratio"], *r["spread"], r["rounds"])
        target = "-" if r["target"] is None else f"{r['target']:.2f}"
        verdict = "-" if r["target"] is None else timing.verdict(ratio, r["target"])
        print(
            f"{r['batch']:>6}{r['ms']['routed']:>11.1f}{r['ms']['einsum']:>11.1f}"
            f"{ratio.text(timing.mark_of(verdict)):>12}{target:>8}{r['memory ratio']:>8.2f}"
            f"{verdict:>9}"
        )
        print(f"{'':>6}  {r['stopped']}")
    return rows
