"""DDP step time of the fovi-resnet18 trunk with and without the graphs in DDP's per-step
broadcast, interleaved in one run: two gloo processes on this CPU.

    .venv/bin/python scripts/ddp_bench.py [--batch 4] [--rounds 15] [--threads 1]

Each process holds two copies of the trunk (same weights and graphs): one wrapped by plain
``DistributedDataParallel`` (its default broadcasts every buffer before each forward), one by
DDP after :func:`fovi_ref.interop.ddp.exclude_graphs`. Each round times one SGD step (forward,
backward with the gradient all-reduce, optimizer step) of each, in alternating order, after a
barrier, and then a broadcast of as many bytes as the default sends per step, alone (what the
bytes cost over gloo here); rank 0 prints the medians, their spread (half the interquartile
range) and the median of the per-round ratio, with the bytes each variant broadcasts per step.

Measured where this repository is developed (a 2-core AMD EPYC; two gloo processes, one thread
each, batch 4 per rank, 25 rounds, nothing else running; medians ± half the IQR): a default DDP
step 197 ± 9 ms, with ``exclude_graphs`` 129 ± 8 ms, default / excluded per round 1.52 ± 0.16;
the 52.6 MB the default broadcasts per step (the graphs and what the backends derive from them)
take 15 ± 3 ms alone, and ``exclude_graphs`` leaves 0.06 MB (BatchNorm's running statistics and
the trunk's max-pool graph). Run it to measure on your machine.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fovi_ref.check.network import ResNet18Trunk
from fovi_ref.interop.ddp import exclude_graphs

VARIANTS = ("default", "graphs excluded")


def spread(values: list[float]) -> float:
    """Half the interquartile range."""
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 2


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=300),
    )
    torch.manual_seed(0)
    base = ResNet18Trunk()
    models = {name: ResNet18Trunk() for name in VARIANTS}
    for model in models.values():
        model.load_state_dict(base.state_dict())
    ddps = {
        "default": nn.parallel.DistributedDataParallel(models["default"]),
        "graphs excluded": nn.parallel.DistributedDataParallel(
            exclude_graphs(models["graphs excluded"])
        ),
    }
    opts = {name: torch.optim.SGD(ddp.parameters(), lr=0.01) for name, ddp in ddps.items()}
    sent = {
        name: sum(b.numel() * b.element_size() for b in ddp.modules_buffers) / 1e6
        for name, ddp in ddps.items()
    }
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, base.conv1.meta.n_in, generator=g)
    payload = torch.zeros(int(sent["default"] * 1e6) // 8, dtype=torch.int64)  # the same bytes
    times = {name: [] for name in (*VARIANTS, "broadcast")}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in VARIANTS if r % 2 else VARIANTS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            opts[name].zero_grad()
            ddps[name](x).square().mean().backward()
            opts[name].step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest
            if r:
                times[name].append(float(elapsed) * 1e3)
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(payload, src=0)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if r:
            times["broadcast"].append(float(elapsed) * 1e3)
    if rank == 0:
        params = sum(p.numel() * p.element_size() for p in base.parameters()) / 1e6
        print(
            f"fovi-resnet18 trunk, 2 gloo processes x {args.threads} thread(s), batch "
            f"{args.batch} per rank, {args.rounds} interleaved rounds; parameters {params:.1f} "
            "MB"
        )
        for name in VARIANTS:
            ms = times[name]
            print(
                f"  {name:16} step {statistics.median(ms):7.1f} +- {spread(ms):5.1f} ms   "
                f"buffers broadcast per step {sent[name]:6.2f} MB"
            )
        ratios = [a / b for a, b in zip(*(times[n] for n in VARIANTS), strict=True)]
        print(
            f"  default / graphs excluded, per round: {statistics.median(ratios):.3f} +- "
            f"{spread(ratios):.3f}"
        )
        ms = times["broadcast"]
        print(
            f"  one broadcast of {sent['default']:.2f} MB alone: {statistics.median(ms):.1f} +- "
            f"{spread(ms):.1f} ms"
        )
    dist.barrier()  # tear down together (as in tests/test_ddp.py: a lone teardown can abort)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="samples per rank (default 4)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
