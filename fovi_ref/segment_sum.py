"""The deterministic segment sum: every output row adds up the input rows listed for it.

    out[d] = sum over the entries (d, s) of values[s]        values [L, P] -> out [D, P]

The ``general`` backend bins neighbours into cells with one (entries ``(cell row, input row)``)
and sums the input gradient with the same entries swapped: :mod:`fovi_ref.knn_general`.

**The usual form** is one ``index_add_`` over the entries: :func:`segment_sum_naive`. Its
summation order is the kernel's; on CUDA it adds with atomics, so two runs may round differently.

**The form used**, :func:`segment_sum`, fixes the order. Entries are split into *rounds*: round 0
copies every row's first term, and round ``r`` adds every row's ``r``-th term, so no row appears
twice in a round (a row gather, an add, and an ``index_copy_`` that nothing collides in). Every
row then adds its terms in the order they were listed, on every device. A *hub* row, one with
more than :data:`HUB` terms (an input that many outputs read), would take one round per term;
it adds its terms as a *tree* instead: its ``F`` terms padded with zeros to ``W = 2^j`` slots,
then halves added to halves ``j`` times, a fixed order again.

**The plan** (:class:`SegmentSumPlan`) is built once per graph from sorts, ``O(E log E)`` for
``E`` entries, and stored as nine tensors (:meth:`SegmentSumPlan.as_derived`), which move with
the graph between devices. ``tests/test_backends.py`` holds :func:`segment_sum` against
:func:`segment_sum_naive` and its rounds against a loop over the terms, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from fovi_ref.meta import Derived

__all__ = [
    "HUB",
    "SegmentSumPlan",
    "accumulation_dtype",
    "build_segment_sum_plan",
    "segment_sum",
    "segment_sum_naive",
]

HUB = 15
"""Most terms a row adds in rounds (terms): more go in a tree. Set by ``bench --strategies``
(rounds and trees tie from about 13 to 15 terms); res18's rows have at most 15 terms, so none of
its layers has a tree (``tests/test_strategies.py``). ``bench --hub`` times the trees against
fovi."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums run in: float32 for 16-bit values (as a GEMM kernel accumulates), else
    ``dtype``. A float16 sum then cannot overflow where its result would not."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def segment_sum_naive(
    values: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, size: int
) -> torch.Tensor:
    """``out [size, P]``, ``out[dst[e]] += values[src[e]]`` for every entry ``e``: one
    ``index_add_``, in the kernel's order. The readable twin of :func:`segment_sum`."""
    acc = accumulation_dtype(values.dtype)
    out = values.new_zeros(size, values.shape[1], dtype=acc)  # [D, P]
    terms = values.index_select(0, src).to(acc)  # [E, P]
    return out.index_add_(0, dst, terms).to(values.dtype)


@dataclass(frozen=True)
class SegmentSumPlan:
    """The entries of one segment sum, arranged in rounds and trees. ``D`` rows, ``E`` entries.

    - ``first [D]``: every row's first source, copied in round 0 (0 for a row without terms);
    - ``empty [Z]``: the rows without terms, zeroed after round 0;
    - ``round_dst [E']``, ``round_src [E']``: the later terms of rows with at most :data:`HUB`,
      round-major; ``round_sizes [R]``: how many entries each round ``1 .. R`` holds;
    - ``tree_dst [H]``: the hub rows, grouped by width; ``tree_src [S]``: their sources, ``W``
      slots per hub; ``tree_pad``: the slots past a hub's terms (zeroed); ``tree_shapes [G, 2]``:
      ``(hubs, W)`` of each group.
    """

    first: torch.Tensor
    empty: torch.Tensor
    round_dst: torch.Tensor
    round_src: torch.Tensor
    round_sizes: torch.Tensor
    tree_dst: torch.Tensor
    tree_src: torch.Tensor
    tree_pad: torch.Tensor
    tree_shapes: torch.Tensor

    @property
    def size(self) -> int:
        """``D``, the rows the sum writes."""
        return self.first.shape[0]

    def as_derived(self, prefix: str) -> Derived:
        """The plan as derived data: ``{"prefix.first": first, ...}``, one tensor per field."""
        return {f"{prefix}.{field.name}": getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_derived(cls, data: Derived, prefix: str) -> SegmentSumPlan:
        """The plan :meth:`as_derived` stored under ``prefix``."""
        return cls(**{field.name: data[f"{prefix}.{field.name}"] for field in fields(cls)})


def build_segment_sum_plan(dst: torch.Tensor, src: torch.Tensor, size: int) -> SegmentSumPlan:
    """The plan of ``out[dst[e]] += values[src[e]]`` into ``size`` rows; a row adds its terms in
    the order the entries list them. Sorts only: ``O(E log E)`` for ``E`` entries."""
    order = torch.argsort(dst, stable=True)
    dst = dst[order]  # [E] grouped by row, the listed order kept within a row
    src = src[order]  # [E]
    count = torch.bincount(dst, minlength=size)  # [D] terms per row
    start = torch.cumsum(count, 0) - count  # [D] where each row's group starts
    rank = torch.arange(dst.numel(), device=dst.device) - start[dst]  # [E] a term's place
    hub = count[dst] > HUB  # [E] the entries of hub rows

    first = dst.new_zeros(size)  # [D]
    leading = (rank == 0) & ~hub
    first[dst[leading]] = src[leading]
    empty = (count == 0).nonzero().flatten()  # [Z]

    later = ((rank > 0) & ~hub).nonzero().flatten()  # [E'] terms of rounds 1, 2, ...
    later = later[torch.argsort(rank[later], stable=True)]  # [E'] round-major
    round_sizes = torch.bincount(rank[later])[1:]  # [R] entries per round

    width = 2 ** torch.log2(count.clamp(min=1).double()).ceil().long()  # [D] W of each row
    tree_dst = []  # per group of trees: its hub rows [H]
    tree_src = []  # their slots' sources [H*W]
    tree_pad = []  # their padding slots, numbered across groups
    tree_shapes = []  # (H, W)
    slots_before = 0
    for w in width[dst[hub]].unique().tolist():  # one group of trees per width W
        of_w = hub & (width[dst] == w)  # [E] the group's entries
        hubs = dst[of_w & (rank == 0)]  # [H] its rows, sorted
        slot = dst.new_full((hubs.numel() * w,), -1)  # [H*W] source of each slot, -1 = none
        slot[torch.searchsorted(hubs, dst[of_w]) * w + rank[of_w]] = src[of_w]
        tree_dst.append(hubs)
        tree_src.append(slot.clamp(min=0))
        tree_pad.append((slot < 0).nonzero().flatten() + slots_before)
        tree_shapes.append((hubs.numel(), w))
        slots_before += slot.numel()

    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else dst.new_zeros(0)

    return SegmentSumPlan(
        first=first,
        empty=empty,
        round_dst=dst[later],
        round_src=src[later],
        round_sizes=round_sizes,
        tree_dst=joined(tree_dst),
        tree_src=joined(tree_src),
        tree_pad=joined(tree_pad),
        tree_shapes=torch.tensor(tree_shapes, dtype=torch.int64, device=dst.device).reshape(-1, 2),
    )


def segment_sum(values: torch.Tensor, plan: SegmentSumPlan) -> torch.Tensor:
    """``values [L, P] -> out [D, P]``, ``out[d]`` the sum of the plan's terms of row ``d`` in
    their listed order (hubs: a fixed tree): the same result on every device and every run."""
    if not values.shape[0]:  # no terms at all (a graph of padding only): no row to read
        return values.new_zeros(plan.first.numel(), values.shape[1])
    acc = accumulation_dtype(values.dtype)
    out = values.index_select(0, plan.first).to(acc)  # [D, P] round 0: every row's first term
    if plan.empty.numel():
        out.index_fill_(0, plan.empty, 0)  # rows without terms: exactly zero

    # Round r adds every row's r-th term. The add is in place: a fresh temporary per round made a
    # round of res18's layer1 three times slower (its memory faulted in on every call).
    sizes = plan.round_sizes.tolist()  # R small ints: the rounds' boundaries
    for dst, src in zip(plan.round_dst.split(sizes), plan.round_src.split(sizes), strict=True):
        picked = out.index_select(0, dst)  # [D_r, P] rows distinct within a round
        picked.add_(values.index_select(0, src))
        out.index_copy_(0, dst, picked)

    # Hubs: gather the W slots of every hub (padding slots zeroed), then add halves to halves.
    if plan.tree_dst.numel():
        slots = values.index_select(0, plan.tree_src).to(acc)  # [S, P]
        slots.index_fill_(0, plan.tree_pad, 0)
        shapes = plan.tree_shapes.tolist()  # [(H, W), ...] per group
        hubs_done = 0
        slots_done = 0
        for hubs, width in shapes:
            group = slots[slots_done : slots_done + hubs * width].view(hubs, width, -1)
            while group.shape[1] > 1:  # [H, W, P] -> [H, W/2, P]
                half = group.shape[1] // 2
                group = group[:, :half].add_(group[:, half:])
            rows = plan.tree_dst[hubs_done : hubs_done + hubs]  # [H]
            out.index_copy_(0, rows, group[:, 0])
            hubs_done += hubs
            slots_done += hubs * width
    return out.to(values.dtype)
