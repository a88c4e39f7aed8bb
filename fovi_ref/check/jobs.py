"""What the jobs of ``python -m fovi_ref`` share: the default dtypes, the ``--device`` option,
the res18 layers a ``--layers`` list names, layers grouped by shared graph, and a progress
line."""

from __future__ import annotations

import argparse
import sys

import torch

from fovi_ref.geometry import get_layer, resnet18_layers

__all__ = [
    "DEVICE_HELP",
    "LOW_AND_SINGLE",
    "device_argument",
    "layer_names",
    "progress",
    "shared_graph_groups",
]

LOW_AND_SINGLE = ("float32", "float16", "bfloat16")
"""The dtypes (names in :data:`fovi_ref.DTYPES`) verify and bench run in unless told otherwise."""

DEVICE_HELP = "torch device to run on: cpu or cuda (cuda:1 for the second GPU)"
"""``--device``'s help, the same for ``check``, ``verify`` and ``bench``."""


def device_argument(text: str) -> str:
    """``--device``: a torch device this machine has (an ``argparse`` type)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is available here")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: choose cpu or cuda")
    return text


def progress(step: int, total: int, what: str) -> None:
    """One overwriting status line on stderr."""
    print(f"\r[{step}/{total}] {what:<60}", end="" if step < total else "\n", file=sys.stderr)


def layer_names(requested: list[str] | None) -> list[str]:
    """Module paths for ``--layers`` (paths or res18 aliases); all 20 when none are given."""
    if not requested:
        return list(resnet18_layers())
    return [get_layer(name).name for name in requested]


def shared_graph_groups(names: list[str], records: dict) -> list[list[str]]:
    """``names`` grouped so that the layers of a group share one graph and channel counts (a
    bench measures each group once); ``records[name]`` has ``.meta`` and ``.out_channels``."""
    groups: list[list[str]] = []
    for name in names:
        record = records[name]
        for members in groups:
            first = records[members[0]]
            if first.out_channels == record.out_channels and first.meta.same_graph(record.meta):
                members.append(name)
                break
        else:
            groups.append([name])
    return groups
