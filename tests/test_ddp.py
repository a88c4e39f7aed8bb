"""DDP on two gloo processes (CPU): fovi_ref.interop.ddp keeps the graphs out of DDP's per-step
broadcast, every rank gets rank 0's graphs, and the losses equal one process doing the same
per-rank work, bitwise."""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import random_meta
from torch import nn

import fovi_ref
from fovi_ref.interop.ddp import exclude_graphs, graph_buffer_names, sync_graphs

WORLD, STEPS, BATCH, LR = 2, 3, 4, 0.1


def small_model(graph_seed: int = 0) -> nn.Module:
    """Two KNNConv layers (routed to general and to gather_gemm) with a BatchNorm between."""
    torch.manual_seed(0)  # the same weights on every rank, as DDP's construction would make them
    first = random_meta(5, 3, n_in=30, n_out=20, in_channels=3, seed=graph_seed)
    second = random_meta(1, 1, n_in=20, n_out=12, in_channels=8, seed=1)
    return nn.Sequential(
        fovi_ref.KNNConv(3, 8, first), nn.BatchNorm1d(8), nn.ReLU(), fovi_ref.KNNConv(8, 4, second)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 3, 30, generator=g), torch.randn(BATCH, 4, generator=g)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, target = batch(step, rank)
    return (model(x).mean(dim=2) - target).square().mean()


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    model = small_model(graph_seed=rank)  # the first layer's graph differs between the ranks
    adopted = sync_graphs(model)
    ddp = nn.parallel.DistributedDataParallel(exclude_graphs(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(ddp, step, rank)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    broadcast = sorted(ddp.named_module_buffers)  # what DDP sends before each forward
    result = {"losses": losses, "adopted": adopted, "broadcast": broadcast, "knn": model[0].knn}
    torch.save(result | {"state": model.state_dict()}, f"{out}/rank{rank}.pt")
    # Both ranks reach the teardown together, and DDP's reducer goes first: a rank that tore its
    # gloo group down while the other still used it once died in C++ ("terminate called without
    # an active exception", SIGABRT), failing a CI run whose results were all correct.
    dist.barrier()
    del ddp, opt
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(out: str, timeout: float = 240) -> None:
    context = mp.start_processes(
        worker, args=(free_port(), out), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.terminate()
            raise TimeoutError(f"the {WORLD} DDP processes did not finish in {timeout} s")


def test_ddp_keeps_graphs_local_and_matches_one_process(tmp_path):
    run_two_ranks(str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    # Rank 1 had another graph in layer 0 and adopted rank 0's; no graph buffer is broadcast per
    # step, BatchNorm's running statistics still are.
    assert [r["adopted"] for r in ranks] == [["0"], ["0"]]
    assert torch.equal(ranks[0]["knn"], ranks[1]["knn"])
    reference = small_model(graph_seed=0)
    graphs = set(graph_buffer_names(reference))
    assert graphs and not graphs & set(ranks[0]["broadcast"])
    batch_norm = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert batch_norm <= set(ranks[0]["broadcast"])
    # One process doing each rank's work: the gradient averaged as DDP averages it, one SGD step.
    torch.set_num_threads(1)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    params = list(reference.parameters())
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD):
            loss = loss_of(reference, step, rank)
            grads.append(torch.autograd.grad(loss, params))
            assert torch.equal(loss.detach(), ranks[rank]["losses"][step]), (step, rank)
        for p, *gs in zip(params, *grads, strict=True):
            p.grad = sum(g / WORLD for g in gs)  # DDP divides, then all-reduces a sum
        opt.step()
    for name, value in reference.state_dict().items():
        if name.endswith(("weight", "bias")):
            assert torch.equal(value, ranks[0]["state"][name]), name


def test_a_checkpoint_carries_the_graph():
    """rank 0's state dict holds the graph it trained on; loading it on a machine that built
    another graph replaces that graph (validated, re-derived)."""
    trained, elsewhere = small_model(graph_seed=0), small_model(graph_seed=1)
    assert not torch.equal(trained[0].knn, elsewhere[0].knn)
    elsewhere.load_state_dict(trained.state_dict())
    assert torch.equal(trained[0].knn, elsewhere[0].knn)
    x, _ = batch(0, 0)
    assert torch.equal(trained.eval()(x), elsewhere.eval()(x))


def _one_thread() -> None:
    torch.set_num_threads(1)


def _matmul(seed: int) -> float:
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(seed))
    return float((a @ a).sum())


def test_a_fork_pool_runs_torch_with_one_thread_per_worker():
    """The recipe of help(fovi_ref.interop.ddp): a fork-context Pool started after torch's intra-op
    pool runs torch ops when its initializer sets one thread (without it, the workers can hang:
    torch's OpenMP pool does not survive fork)."""
    torch.randn(2000, 2000).sum()  # torch's intra-op pool has started
    with mp.get_context("fork").Pool(2, initializer=_one_thread) as pool:
        assert len(pool.map_async(_matmul, range(4)).get(timeout=60)) == 4
