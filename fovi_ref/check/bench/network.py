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

A third trunk gives the floor those targets sit above: every convolution replaced by
:class:`GemmFloorOps`, which runs only its three GEMMs (and zero-fills the input gradient), so
``floor / einsum`` is the ratio the routed trunk would reach if its convolutions cost nothing but
their GEMMs, with BatchNorm, ReLU, the pool, the adds and autograd as they are.
"""

from __future__ import annotations

import torch

from fovi_ref import KNNMeta, available_ops, dtype_name, register_ops, unregister_ops
from fovi_ref.check.arithmetic import arithmetic_settings, describe
from fovi_ref.check.bench import targets, timing
from fovi_ref.check.bench.contenders import Contender
from fovi_ref.check.bench.timing import peak_memory_bytes
from fovi_ref.check.network import ResNet18Trunk
from fovi_ref.layout import linear_rows, y_from_rows

__all__ = ["GemmFloorOps", "network_rows", "run", "trunk_step"]

CAP_S = 90.0
"""Seconds one batch size may take before it stops adding rounds (a step takes up to ~1 s)."""


class GemmFloorOps:
    """A stand-in backend for the trunk's floors: each convolution runs the three GEMMs of its
    sizes and nothing else, on cell features ``z [B*Nout, Cin*V]`` (standard normal) made once
    per size, as the per-layer GEMM floor's are:

    - forward: ``y_rows = z @ W^T (+ bias)`` ``[B*Nout, Cout]``, returned in fovi's layout;
    - input gradient: ``grad_y_rows @ W`` ``[B*Nout, Cin*V]``, then a zero ``grad_x``;
    - weight gradient: ``grad_y_rows^T @ z`` ``[Cout, Cin*V]``.

    With ``write_cells``, the forward first copies ``z`` into fresh memory: the one write of the
    cell features that any implementation forming them before its GEMM pays (``general``'s
    binning, fovi's gather), and nothing of how they are formed. Its values are not a
    convolution's (the trunk needs only their shapes, and finite values for BatchNorm).
    Registered only while :func:`network_rows` measures."""

    def __init__(self, write_cells: bool = False) -> None:
        self.write_cells = write_cells
        self.name = "gemm floor + cells (bench)" if write_cells else "gemm floor (bench)"
        self._features: dict[tuple, torch.Tensor] = {}

    def _z(self, meta: KNNMeta, batch: int, like: torch.Tensor) -> torch.Tensor:
        shape = (batch * meta.n_out, meta.in_channels * meta.v)
        key = (shape, like.dtype, like.device)  # one per size: the floor needs only the sizes
        if key not in self._features:
            self._features[key] = torch.randn(shape, device=like.device).to(like.dtype)
        return self._features[key]

    def forward(self, meta, x, weight, bias):
        z = self._z(meta, x.shape[0], x)  # [B*Nout, Cin*V]
        if self.write_cells:
            z = z.clone()
        y_rows = linear_rows(z, weight, bias)  # [B*Nout, Cout]
        return y_from_rows(y_rows, x.shape[0], meta.n_out)  # [B, Cout, Nout]

    @staticmethod
    def _grad_y_rows(grad_y: torch.Tensor) -> torch.Tensor:  # [B*Nout, Cout], a view if it can
        return grad_y.transpose(1, 2).reshape(-1, grad_y.shape[1])

    def grad_input(self, meta, grad_y, weight):
        self._grad_y_rows(grad_y) @ weight  # [B*Nout, Cin*V], the GEMM's cost only
        return grad_y.new_zeros(grad_y.shape[0], meta.in_channels, meta.n_in)

    def grad_weight(self, meta, grad_y, x):
        return self._grad_y_rows(grad_y).t() @ self._z(meta, x.shape[0], x)  # [Cout, Cin*V]


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
    floors = {"floor": GemmFloorOps(), "floor+cells": GemmFloorOps(write_cells=True)}
    trunks = {"routed": routed, "einsum": einsum}
    try:
        for key, ops in floors.items():
            register_ops(ops)
            trunks[key] = ResNet18Trunk(backend=ops.name).to(device=device, dtype=dtype)
            trunks[key].load_state_dict(routed.state_dict())
        return [_row(batch, trunks, repeats, device, dtype) for batch in batches]
    finally:
        for ops in floors.values():
            if ops.name in available_ops():
                unregister_ops(ops.name)


RATIOS = {"time": "routed", "floor": "floor", "floor+cells": "floor+cells"}
"""The ratios of a row, each a trunk's step time / the all-einsum trunk's."""


def _row(batch: int, trunks: dict, repeats: int, device, dtype) -> dict:
    """One batch size's row of :func:`network_rows`."""
    held = targets.NETWORK.get(batch)
    x = torch.randn(batch, 3, trunks["routed"].conv1.meta.n_in, device=device, dtype=dtype)
    steps = {name: trunk_step(model, x) for name, model in trunks.items()}
    pairs = [(trunk, "einsum") for trunk in RATIOS.values()]
    timed = timing.measure(steps, ratios=pairs, repeats=repeats, warmup=1, cap_s=CAP_S)
    memory = {name: peak_memory_bytes(steps[name], device) for name in ("routed", "einsum")}
    ratios = {name: timed.ratio(trunk, "einsum") for name, trunk in RATIOS.items()}
    return {
        "batch": batch,
        "ms": {k: 1e3 * v for k, v in timed.medians().items()},
        "MiB": {k: v / 2**20 for k, v in memory.items()},
        "time ratio": ratios["time"].median,
        "spread": [ratios["time"].low, ratios["time"].high],
        "floors": {name: [r.median, r.low, r.high] for name, r in ratios.items() if name != "time"},
        "rounds": timed.rounds,
        "stopped": timed.stop_note(),
        "memory ratio": memory["routed"] / memory["einsum"],
        "target": held.at_most if held and dtype == torch.float32 else None,
    }


def run(batches=(16, 64), repeats: int = 5, device: str = "cpu", dtype=torch.float32) -> list:
    """Print the table of :func:`network_rows` and return its rows."""
    rows = network_rows(batches, repeats, device, dtype)
    print(f"fovi-resnet18 trunk, forward + backward, {device} {dtype_name(dtype)}: routed / einsum")
    print(describe(arithmetic_settings(device)))
    print("time: median ± half the IQR of the per-round ratios; verdict: met (the IQR at or below")
    print("the target), MISSED '!' (above), unsure '?' (it straddles the target); floor: the")
    print("trunk whose convolutions run only their three GEMMs / einsum; floor+cells: the same,")
    print("each forward also writing its cell features once (GemmFloorOps)")
    print(
        f"{'batch':>6}{'routed ms':>11}{'einsum ms':>11}{'floor ms':>10}{'time':>12}"
        f"{'target':>8}{'floor':>12}{'floor+cells':>13}{'memory':>8}{'verdict':>9}"
    )
    for r in rows:
        ratio = timing.Ratio(r["time ratio"], *r["spread"], r["rounds"])
        target = "-" if r["target"] is None else f"{r['target']:.2f}"
        verdict = "-" if r["target"] is None else timing.verdict(ratio, r["target"])
        floor, cells = (timing.Ratio(*r["floors"][k], r["rounds"]).text() for k in r["floors"])
        print(
            f"{r['batch']:>6}{r['ms']['routed']:>11.1f}{r['ms']['einsum']:>11.1f}"
            f"{r['ms']['floor']:>10.1f}{ratio.text(timing.mark_of(verdict)):>12}{target:>8}"
            f"{floor:>12}{cells:>13}{r['memory ratio']:>8.2f}{verdict:>9}"
        )
        print(f"{'':>6}  {r['stopped']}")
    return rows
