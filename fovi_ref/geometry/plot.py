"""Pictures of a layer's graph: its samplings, and one node's neighbourhood on the grid.

matplotlib is imported when a function is called, so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fovi_ref.geometry.graph import LayerGraph

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_neighbourhood", "plot_sampling"]


def _axes(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 6))[1]


def plot_sampling(layer: LayerGraph, ax: Axes | None = None) -> Axes:
    """Scatter a layer's input points, output points and pad coordinates in the visual field.

    The dashed unit circle is the field-of-view edge; pad coordinates lie outside it.
    """
    import matplotlib.patches as mpatches

    ax = _axes(ax)
    x_in, x_out, x_pad = layer.in_coords, layer.out_coords, layer.in_pad_coords
    ax.scatter(x_in[:, 0], x_in[:, 1], s=4, c="0.55", label=f"inputs ({layer.n_in})")
    ax.scatter(
        x_out[:, 0],
        x_out[:, 1],
        s=22,
        facecolors="none",
        edgecolors="tab:red",
        linewidths=0.8,
        label=f"outputs ({layer.n_out})",
    )
    ax.scatter(
        x_pad[:, 0], x_pad[:, 1], s=10, marker="x", c="tab:blue", label=f"pad ({len(x_pad)})"
    )
    ax.add_patch(mpatches.Circle((0, 0), 1, fill=False, ls="--", lw=0.8, color="k"))
    ax.set_aspect("equal")
    ax.set_xlabel("x (field-of-view radii)")
    ax.set_ylabel("y")
    ax.set_title(f"{layer.name}: K={layer.k}, V={layer.v}")
    ax.legend(loc="upper right", fontsize="small")
    return ax


def plot_neighbourhood(layer: LayerGraph, node: int, ax: Axes | None = None) -> Axes:
    """Show output ``node``'s neighbours in its normalised frame, coloured by reference cell.

    Cell centres are drawn as squares (in their cell's colour) with the cell boundaries (the
    Voronoi lines halfway between centres); each neighbour is a dot labelled with its rank ``k``
    (0 = nearest), or a cross if it is a padding neighbour.
    """
    import matplotlib.pyplot as plt

    if not 0 <= node < layer.n_out:
        raise IndexError(f"node must be in [0, {layer.n_out}), got {node}")
    ax = _axes(ax)
    grid = layer.ref_grid  # [V, 2]
    v = layer.v
    colours = plt.get_cmap("turbo")(torch.linspace(0.05, 0.95, v).numpy())  # [V, 4]

    side = int(round(v**0.5))
    g = torch.linspace(-1, 1, side)
    for edge in ((g[1:] + g[:-1]) / 2).tolist():  # cell boundaries
        ax.axvline(edge, color="0.8", lw=0.8)
        ax.axhline(edge, color="0.8", lw=0.8)
    ax.scatter(grid[:, 0], grid[:, 1], s=90, marker="s", c=colours, alpha=0.35, label="cells")

    pos = layer.frame[:, node]  # [K, 2]
    cells = layer.meta.rf_index[node]  # [K]
    pad = layer.meta.pad_mask[:, node]  # [K]
    for k in range(layer.k):
        colour = colours[int(cells[k])]
        marker = "x" if bool(pad[k]) else "o"
        ax.scatter(pos[k, 0], pos[k, 1], s=40, marker=marker, color=colour)
        ax.annotate(str(k), pos[k].tolist(), textcoords="offset points", xytext=(4, 4))
    ax.scatter([], [], marker="o", c="k", label="neighbour")
    ax.scatter([], [], marker="x", c="k", label="padding neighbour")

    ax.set_xlim(-1.3, 1.3)
    ax.set_ylim(-1.3, 1.3)
    ax.set_aspect("equal")
    ax.set_xlabel("frame axis 0 (visual x direction)")
    ax.set_ylabel("frame axis 1 (visual y direction)")
    ax.set_title(f"{layer.name}, node {node}: {int(pad.sum())} padding of K={layer.k}")
    ax.legend(loc="upper right", fontsize="small")
    return ax
