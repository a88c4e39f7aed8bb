"""The fovi-resnet18 trunk assembled from :class:`fovi_ref.KNNConv` layers, wired as fovi wires it.

fovi's ``KNNResNet`` (``fovi/models/knnresnet.py``) runs::

    conv1 (K=49, stride 2) -> BatchNorm -> ReLU -> max pool (K=9, stride 2)
    -> layer1 .. layer4: two basic blocks each
         out = ReLU(BN(conv2(ReLU(BN(conv1(x))))) + shortcut(x))
         shortcut = BN(downsample.0(x)) in block 0 of a strided stage, else x

on the graphs of :func:`fovi_ref.geometry.resnet18_layers`; the max pool takes, for every output
node, the largest feature among its real neighbours (padding never wins). :class:`ResNet18Trunk`
builds exactly that, with every convolution routed by the dispatcher (``backend=None``) or forced
onto one backend (``backend="einsum_baseline"`` is fovi's own arithmetic): the whole-network
benchmark (``python -m fovi_ref bench --network resnet18``) times the two side by side.
"""

from __future__ import annotations

import torch
from torch import nn

from fovi_ref.geometry import layer_graph, resnet18_layers, resnet18_plan
from fovi_ref.layer import KNNConv
from fovi_ref.meta import KNNMeta

__all__ = ["BasicBlock", "KNNMaxPool", "ResNet18Trunk"]

_POOL_K = 9


class KNNMaxPool(nn.Module):
    """``y[b, c, n] = max over real neighbours k of x[b, c, knn[k, n]]``, ``[B, C, Nin] -> [B, C,
    Nout]``; a node whose neighbours are all padding gets ``-inf`` (none does in resnet18)."""

    def __init__(self, meta: KNNMeta) -> None:
        super().__init__()
        self.register_buffer("knn", meta.knn.clone())  # [K, Nout]; n_in marks padding
        self.n_in = meta.n_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, _ = x.shape
        padded = torch.cat([x, x.new_full((batch, channels, 1), -torch.inf)], dim=2)
        index = self.knn.reshape(1, 1, -1).expand(batch, channels, -1)  # [B, C, K*Nout]
        neighbours = torch.gather(padded, 2, index).view(batch, channels, *self.knn.shape)
        return neighbours.amax(dim=2)  # [B, C, Nout]


class BasicBlock(nn.Module):
    """``ReLU(BN(conv2(ReLU(BN(conv1(x))))) + shortcut(x))``, shortcut ``BN(downsample(x))``."""

    def __init__(self, graphs: dict, prefix: str, backend: str | None) -> None:
        super().__init__()

        def conv(name: str) -> KNNConv:
            g = graphs[f"{prefix}.{name}"]
            return KNNConv(g.in_channels, g.out_channels, g.meta, bias=False, backend=backend)

        self.conv1, self.conv2 = conv("conv1"), conv("conv2")
        self.bn1, self.bn2 = (
            nn.BatchNorm1d(self.conv1.out_channels),
            nn.BatchNorm1d(self.conv2.out_channels),
        )
        self.relu = nn.ReLU()
        self.downsample = None
        if f"{prefix}.downsample.0" in graphs:
            shortcut = conv("downsample.0")
            self.downsample = nn.Sequential(shortcut, nn.BatchNorm1d(shortcut.out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet18Trunk(nn.Module):
    """fovi-resnet18 without its classifier: ``x [B, 3, Nin] -> [B, 512, Nout]``.

    Args:
        backend: ``None`` routes every convolution (``gather_gemm`` for the K = 1 downsamples,
            ``general`` for the rest); a backend name forces it on all twenty.
        **geometry: passed to :func:`fovi_ref.geometry.resnet18_layers` (``in_res``, ...).
    """

    def __init__(self, backend: str | None = None, **geometry) -> None:
        super().__init__()
        graphs = resnet18_layers(**geometry)
        stem = graphs["conv1"]
        self.conv1 = KNNConv(3, stem.out_channels, stem.meta, bias=False, backend=backend)
        self.bn1 = nn.BatchNorm1d(stem.out_channels)
        self.relu = nn.ReLU()
        plan = {spec.name: spec for spec in resnet18_plan(geometry.get("in_res", 64))}
        pool_in, pool_out = plan["conv1"].out_res, plan["layer1.0.conv1"].in_res
        pool_kwargs = {k: v for k, v in geometry.items() if k != "in_res"}
        pool = layer_graph(
            "maxpool",
            in_channels=stem.out_channels,
            out_channels=stem.out_channels,
            k=_POOL_K,
            in_res=pool_in,
            out_res=pool_out,
            fov=pool_kwargs.pop("fov", 16),
            cmf_a=pool_kwargs.pop("cmf_a", 0.5),
            **pool_kwargs,
        )
        self.maxpool = KNNMaxPool(pool.meta)
        self.layers = nn.Sequential(
            *(
                BasicBlock(graphs, f"layer{stage}.{block}", backend)
                for stage in range(1, 5)
                for block in range(2)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layers(x)

    def convs(self) -> list[KNNConv]:
        """The twenty KNN convolutions, in module order."""
        return [m for m in self.modules() if isinstance(m, KNNConv)]
