"""KNN graphs of a regular ``H x W`` grid that reproduce ``torch.nn.functional.conv2d`` exactly.

Number the pixels of an ``H x W`` image row-major (node ``r*W + col``). A ``kh x kw`` convolution
with stride ``s`` and zero padding ``p`` is then a KNN convolution with

- one output node per output pixel ``(ro, co)`` (``Hout x Wout`` of them, row-major),
- ``K = V = kh*kw`` neighbours, neighbour ``k = i*kw + j`` being input pixel
  ``(ro*s - p + i, co*s - p + j)``, or padding (``n_in``) where that falls outside the image,
- ``rf_index[n, k] = k``: every kernel tap is its own reference cell.

Then ``conv_weight.reshape(Cout, Cin*kh*kw)`` is the KNN weight, and ``F.conv2d`` an independent
oracle: a ``1x1`` stride-2 conv is a ``K = V = 1`` graph (fovi-resnet18's downsample class), a
``3x3`` conv with padding 1 a ``K = V = 9`` graph with padding along the border.
"""

from __future__ import annotations

import math

import torch

from fovi_ref.meta import KNNMeta

__all__ = ["conv2d_grid_meta", "square_grid_for", "to_grid", "to_nodes"]


def conv2d_grid_meta(
    height: int,
    width: int,
    *,
    kernel_size: int,
    stride: int = 1,
    padding: int = 0,
    in_channels: int,
    device: torch.device | str = "cpu",
) -> KNNMeta:
    """The KNN graph of ``F.conv2d(x, w, stride=stride, padding=padding)`` on an image
    ``[B, Cin, height, width]`` with a square ``kernel_size`` kernel (see the module docstring)."""
    sizes = {"height": height, "width": width, "kernel_size": kernel_size, "stride": stride}
    for name, value, low in [*((n, v, 1) for n, v in sizes.items()), ("padding", padding, 0)]:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    h_out, w_out = ((side + 2 * padding - kernel_size) // stride + 1 for side in (height, width))
    if h_out < 1 or w_out < 1:
        kernel = f"a {kernel_size}x{kernel_size} kernel with padding {padding}"
        raise ValueError(f"{kernel} does not fit a {height}x{width} grid")
    n_in = height * width
    taps = torch.arange(kernel_size)
    rows = torch.arange(h_out)[:, None] * stride - padding + taps[None, :]  # [Hout, kh]
    cols = torch.arange(w_out)[:, None] * stride - padding + taps[None, :]  # [Wout, kw]
    shape = (h_out, w_out, kernel_size, kernel_size)
    r = rows[:, None, :, None].expand(shape)  # [Hout, Wout, kh, kw] input row of each tap
    c = cols[None, :, None, :].expand(shape)  # [Hout, Wout, kh, kw] input column of each tap
    inside = (r >= 0) & (r < height) & (c >= 0) & (c < width)
    node = torch.where(inside, r * width + c, n_in)  # [Hout, Wout, kh, kw], n_in = padding
    k = kernel_size * kernel_size
    knn = node.reshape(h_out * w_out, k).t()  # [K, Nout]
    rf_index = torch.arange(k).expand(h_out * w_out, k)  # [Nout, K]: tap k is cell k
    return KNNMeta.from_knn(knn, rf_index, n_in=n_in, in_channels=in_channels, v=k).to(device)


def square_grid_for(n_out: int) -> tuple[int, int]:
    """``(input side, output side)`` of the smallest square grid whose ``1x1`` stride-2 conv has
    at least ``n_out`` outputs: output side ``ceil(sqrt(n_out))``, input side twice that."""
    side = math.isqrt(n_out - 1) + 1 if n_out > 1 else 1
    return 2 * side, side


def to_nodes(image: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, C, H*W]``, nodes numbered row-major."""
    return image.flatten(2)


def to_grid(nodes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[B, C, H*W]`` -> ``[B, C, H, W]``, the inverse of :func:`to_nodes`."""
    return nodes.unflatten(2, (height, width))
