"""How tight the tolerance rule is: legal computations that use as much of the bound as they can.

A bound may be too loose (it passes real bugs: ``tests/test_tolerance_rule.py`` holds it to
numbers derived by hand) or too tight: it then fails a correct kernel on another machine or in
another summation order. Each function here builds one computation that a correct kernel may
do, judges it by :func:`~fovi_ref.check.tolerances.judge_elementwise` and returns its
:class:`Legal` rows, ``ratio = |error| / bound`` of its worst element. Every row must pass;
the closer its ratio to 1, the less room the rule leaves. The rows that come nearest the bound
(a tie, one product, two terms) have exact inputs and one rounding that matters, whoever
computes them, and the elementwise sums of :func:`summation_order` are IEEE operations written
out: those ratios are the same on every machine. A backend's row on a long sum follows the
order its reduction or GEMM adds in, which another CPU or BLAS path may change.

- **16 bits** (:func:`tie_rounding`, :func:`stored_cell_tie`): a sum exact in float32 that
  lands just below a rounding tie and is rounded once, wide and narrow alike; on the narrow
  path a cell stored just below a tie as well. The stores' ``u |ref|`` and ``u |w| |z|`` are
  most of the bound as long as ``N u32`` is below ``u`` (``N`` up to thousands), and one
  store's rounding reaches them. :func:`large_partial_sums` is a cell whose float32 partial
  sums are far larger than the cell (``gamma_N(u32) M`` pays for them).
- **float32** (:func:`float32_product_tie`): one product (``N = 1``) whose rounding is a tie.
- **Summation order** (:func:`summation_order`, float32 and float64): one cell of ``N``
  neighbours that the oracle adds term by term, ``sum_k w x_k``, computed as
  ``w (x_0 + ... + x_{N-1})``, the order of a binning implementation; the worst of a seeded
  search. In float64 this is the only way to differ from the oracle, which rounds like any
  float64 implementation: one product (``N = 1``) is exact against it.

float32 and float64 get near their bound only for a few terms: ``gamma_N(u) M`` assumes each
of the ``N`` roundings errs by ``u`` of the whole magnitude ``M``, in one direction, while a real
sum's partial sums are smaller than ``M`` and its errors of either sign, so the worst ratio of
:func:`summation_order` falls as ``N`` grows. ``python -m fovi_ref.check.tightness`` prints
every row and the worst ratio per dtype.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from fovi_ref import KNNMeta, dtype_name, knn_conv
from fovi_ref.check.switches import forced
from fovi_ref.check.tolerances import UNIT_ROUNDOFF, expected_quantities, judge_elementwise
from fovi_ref.check.verify import backends_for
from fovi_ref.precision import SIXTEEN_BIT

__all__ = [
    "ORDER_TERMS",
    "Legal",
    "float32_product_tie",
    "large_partial_sums",
    "measure",
    "stored_cell_tie",
    "summation_order",
    "tie_rounding",
    "worst_per_dtype",
]

BACKENDS = ("general", "gather_gemm", "einsum_baseline")
"""fovi_ref's backends, each judged on every computation it takes."""
ORDER_TERMS = (2, 8, 64, 512)
"""The cell sizes ``N`` :func:`measure` searches another summation order at."""


@dataclass(frozen=True)
class Legal:
    """One legal computation judged by the rule: what it is, in which dtype, who computed it
    (a backend and its GEMM path, or the elementwise arithmetic written out), the worst
    ``|error| / bound`` and whether the rule passed it."""

    case: str
    dtype: str
    by: str
    ratio: float
    ok: bool


def one_node(cells: list[int]) -> KNNMeta:
    """One node reading inputs ``0..K-1`` (one channel), neighbour ``k`` in cell ``cells[k]``."""
    k = len(cells)
    knn = torch.arange(k)[:, None]  # [K, 1]
    return KNNMeta.from_knn(knn, torch.tensor([cells]), n_in=k, in_channels=1, v=max(cells) + 1)


def just_below_a_tie(dtype: torch.dtype) -> float:
    """``t = u - 2 u^2``: ``1 + t`` is exact in float32 and rounds down to 1 in ``dtype``, an
    error of ``t``, just below the tie at ``u`` (``t`` itself is exact in ``dtype``)."""
    u = UNIT_ROUNDOFF[dtype]
    return u - 2 * u * u


def _judged_y(
    case: str, meta: KNNMeta, x: torch.Tensor, w: torch.Tensor, paths: tuple[str, ...]
) -> list[Legal]:
    """``y = knn_conv(x [1, 1, K], w [1, V])`` (no bias) of every backend taking ``meta``, its
    16-bit GEMMs forced each of ``paths`` (``"wide"``, ``"narrow"``), judged by the rule."""
    gy = torch.ones(1, 1, meta.n_out, dtype=x.dtype)
    expected = expected_quantities(x, w, None, meta, gy)["y"]
    rows = []
    for backend in [b for b in backends_for(meta) if b in BACKENDS]:  # gather_gemm: K = V = 1
        for gemms in paths:
            with forced(gemms):
                y = knn_conv(x, w, None, meta, backend=backend)
            verdict = judge_elementwise(y, expected)
            by = backend + (f" {gemms}" if x.dtype in SIXTEEN_BIT else "")
            rows.append(Legal(case, dtype_name(x.dtype), by, verdict.ratio, verdict.ok))
    return rows


def tie_rounding(dtype: torch.dtype) -> list[Legal]:
    """16 bits: two neighbours in two cells, ``y = 1 + t`` (:func:`just_below_a_tie`), summed
    exactly in float32 and rounded once, wide and narrow: error ``t``, bound
    ``u |ref| + gamma_2(u32) M``."""
    t = just_below_a_tie(dtype)
    x = torch.tensor([[[1.0, t]]], dtype=dtype)
    w = torch.ones(1, 2, dtype=dtype)
    return _judged_y("1 + t rounded once", one_node([0, 1]), x, w, ("wide", "narrow"))


def stored_cell_tie(dtype: torch.dtype) -> list[Legal]:
    """16 bits, narrow: inputs 0 and 1 share cell 0, ``z = 1 + t`` stored once (to 1, an error
    of ``t``); input 2 alone in cell 1 adds ``t``, and ``1 + t`` is rounded once more, to 1.
    The error ``2 t`` is both stores' (``u |ref| + u |w| |z|``). gather_gemm does not take the
    graph (``V = 2``). Wide, ``general`` sums in float32 and rounds once (a far smaller error),
    while ``einsum_baseline``, fovi's path, stores its cells in 16 bits on either path."""
    t = just_below_a_tie(dtype)
    x = torch.tensor([[[1.0, t, t]]], dtype=dtype)
    w = torch.ones(1, 2, dtype=dtype)
    return _judged_y("cell 1 + t stored, then 1 + t", one_node([0, 0, 1]), x, w, ("narrow", "wide"))


def large_partial_sums() -> list[Legal]:
    """16 bits: one cell ``A + s - A`` whose float32 partial sum ``A + s`` rounds (``s`` below
    half an ulp of ``A`` in float32), stored once: the partial sums are far larger than the
    cell, which the rule pays for with ``gamma_3(u32) M`` (``M = 2 A + s``), not with
    ``u |z|``. Every backend, both paths, whichever order it adds the three in."""
    rows = []
    for dtype, big, small in ((torch.float16, 2.0**15, 2.0**-10), (torch.bfloat16, 2.0**26, 0.75)):
        x = torch.tensor([[[big, small, -big]]], dtype=dtype)
        w = torch.ones(1, 1, dtype=dtype)
        rows += _judged_y("A + s - A in one cell", one_node([0, 0, 0]), x, w, ("wide", "narrow"))
    return rows


def float32_product_tie() -> list[Legal]:
    """float32, ``N = 1``: ``y = x w`` with ``x = w = 1 + 2^-12``, whose exact product
    ``p = 1 + 2^-11 + 2^-24`` is a tie, rounded to even: an error of ``u = 2^-24`` against a
    bound of about ``gamma_1(u) p``, a ratio of about ``(1 - u) / p``."""
    x = torch.tensor([[[1 + 2.0**-12]]], dtype=torch.float32)
    w = torch.tensor([[1 + 2.0**-12]], dtype=torch.float32)
    return _judged_y("one product at a tie", one_node([0]), x, w, ("wide",))


def summation_order(
    dtype: torch.dtype, terms: int, draws: int = 2**14, seed: int = 0
) -> list[Legal]:
    """float32 or float64: one cell of ``terms`` neighbours computed as ``w (x_0 + ... +
    x_{N-1})``, the sum left to right in ``dtype`` (elementwise IEEE operations, the same on
    every machine), for ``draws`` seeded normal draws; the draw with the largest error relative
    to ``|w| sum |x_k|`` is judged against the oracle's ``sum_k w x_k``, and every backend is
    judged on that draw too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(terms, draws, generator=g, dtype=torch.float64).to(dtype)  # [N, draws]
    w = torch.randn(draws, generator=g, dtype=torch.float64).to(dtype)  # [draws]
    total = x[0]
    for k in range(1, terms):  # left to right, one rounding per addition
        total = total + x[k]
    binned = w * total  # [draws]
    exact = (w.double() * x.double()).sum(0)  # [draws], within float64's own rounding
    relative = (binned.double() - exact).abs() / (w.double().abs() * x.double().abs().sum(0))
    worst = int(relative.argmax())
    meta = one_node([0] * terms)
    xs, ws = x[:, worst].reshape(1, 1, terms), w[worst].reshape(1, 1)
    expected = expected_quantities(xs, ws, None, meta, torch.ones(1, 1, 1, dtype=dtype))["y"]
    verdict = judge_elementwise(binned[worst].reshape(1, 1, 1), expected)
    case = f"another order, N = {terms}"
    rows = [Legal(case, dtype_name(dtype), "w (x_0 + ... + x_N-1)", verdict.ratio, verdict.ok)]
    return rows + _judged_y(case, meta, xs, ws, ("wide",))


def measure() -> list[Legal]:
    """Every computation of this module: :func:`summation_order` at each of
    :data:`ORDER_TERMS`, in float32 and float64."""
    rows = [r for dtype in SIXTEEN_BIT for r in tie_rounding(dtype) + stored_cell_tie(dtype)]
    rows += large_partial_sums() + float32_product_tie()
    for dtype in (torch.float32, torch.float64):
        for terms in ORDER_TERMS:
            rows += summation_order(dtype, terms)
    return rows


def worst_per_dtype(rows: list[Legal]) -> dict[str, float]:
    """The largest ratio of ``rows`` per dtype: how much of its bound a legal computation uses."""
    worst: dict[str, float] = {}
    for row in rows:
        worst[row.dtype] = max(worst.get(row.dtype, 0.0), row.ratio)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds overhead
    rows = measure()
    print("| case | dtype | computed by | ratio | passes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.case} | {r.dtype} | {r.by} | {r.ratio:.4f} | {'yes' if r.ok else 'NO'} |")
    print(
        "\nworst ratio per dtype: "
        + ", ".join(f"{dtype} {ratio:.4f}" for dtype, ratio in worst_per_dtype(rows).items())
    )
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
