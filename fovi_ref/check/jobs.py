"""What the jobs of ``python -m fovi_ref`` share: the default dtypes, the res18 layers a
``--layers`` list names, layers grouped by shared graph, and a progress line."""

from __future__ import annotations

import sys

from fovi_ref.geometry import get_layer, resnet18_layers

__all__ = ["LOW_AND_SINGLE", "layer_names", "progress", "shared_graph_groups"]

LOW_AND_SINGLE = ("float32", "float16", "bfloat16")
"""The dtypes (names in :data:`fovi_ref.DTYPES`) verify and bench run in unless told otherwise."""


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
