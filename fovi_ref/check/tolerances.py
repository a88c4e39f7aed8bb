r"""What "close enough to the float64 oracle" means, element by element, and why.

Every check compares a result against the float64 oracle (:mod:`fovi_ref.reference`) run on the
*same*, already rounded, inputs, so input rounding is not counted: what is left is the
implementation's own arithmetic. The rule bounds the error of **every element**::

    |value - ref| <= bound(element)

from the standard error analysis of a sum of products, in four steps.

**Step 0: the model of one rounding.** A floating-point operation returns
``fl(a op b) = (a op b)(1 + d) + e`` with ``|d| <= u`` (the unit roundoff: ``2^-53``, ``2^-24``,
``2^-11``, ``2^-8`` for float64, float32, float16, bfloat16) and ``|e| <= eta`` (half the
smallest subnormal, nonzero only when the result underflows). Write
``gamma_n(u) = n u / (1 - n u)``: ``n`` roundings ``(1 + d_1)...(1 + d_n)`` of one quantity stay
within ``1 +- gamma_n(u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
Lemma 3.1).

**Step 1: a sum of products in one precision (float32, float64).** Every quantity is a sum of
``N`` products, ``s = sum_i t_i`` (``t_i = a_i b_i``; the bias is a term with factor 1). However
an implementation orders or groups the additions (a tree of partial sums, a blocked GEMM, cells
binned first, ``w (x_1 + x_2)`` instead of ``w x_1 + w x_2``), each term meets one rounding in
its product and at most ``N - 1`` in the additions above it, so it arrives as
``t_i (1 + theta_i)`` with ``|theta_i| <= gamma_N(u)``. Exact operations (multiplying by the 0 or
1 of a one-hot matrix, adding an exact zero, copying) do not count. Hence (Higham eq. 3.5)::

    |s_computed - s| <= gamma_N(u) * M,        M = sum_i |t_i|   (the *magnitude*)

``M`` is the float64 oracle run on absolute values
(:func:`~fovi_ref.check.magnitude.knn_conv_magnitude`). Under cancellation ``|s| << M``: the error
may be large relative to the sum but never relative to its terms. That is the float32/float64 rule::

    bound = gamma_N(u) * M + N * eta

(``N * eta``: one underflow per rounding; it needs products below 1e-38 in float32 and never binds
for ordinary data, but it costs nothing to be right).

**Step 2: float16 and bfloat16.** Products of two float16 (bfloat16) numbers are exact in float32
(11 + 11 <= 24 and 8 + 8 <= 24 significant bits), and the kernels we rely on (GEMM, einsum/bmm,
``sum``, ``F.linear``, and on CPU ``scatter_add_`` and ``index_add_``) accumulate in float32 and
round the result once to the storage dtype (tests/test_tolerances.py checks this for the
installed torch; a 1-D ``index_add_`` on CPU is an exception, it adds in the storage dtype). The
kinds of error:

(a) *the float32 accumulation*: ``gamma_N(u32) * M``, as in step 1;

(b) *the final store of the output*, ``fl(s_computed) = s_computed (1 + d) + e``: at most
    ``u |s_computed| <= u |ref| + u |s_computed - ref|``. This rounding is relative to the
    **result**, not to ``M``: a correct implementation rounds its output once, so where the sum
    cancels its error must shrink with it. Any further rounding is an intermediate store, (c)
    and (d), and must be paid for relative to the magnitude of what was stored;

(c) *intermediates stored in the working dtype*. A two-step implementation stores a partial sum
    and reads it back; each store costs ``u`` times the stored value, at most ``u`` times the
    magnitude of its terms. Which stores are legitimate is a fact about the operator, not about
    one backend:

    - ``y`` and ``grad_weight``: the binned cell features
      ``z[b, c, v, n] = sum_{k in cell v} x[b, c, knn[k, n]]`` (fovi's one-hot einsum stores them,
      so does a narrow ``general``, :mod:`fovi_ref.precision`), each stored **once**, after its
      sum was accumulated in float32. That store is off by at most ``u |z|``, relative to the
      cell's own value (its float32 error is already in (a)), and reaches ``y`` multiplied by
      ``|w|`` and ``grad_weight`` by ``|grad_y|``. A neighbour alone in its cell is copied
      exactly, so only cells holding two or more real neighbours count
      (:func:`~fovi_ref.check.magnitude.shared_cell_meta`):
      ``M_s = sum_{c, v shared} |w[o, c*V+v]| |z[b, c, v, n]|`` for ``y`` and
      ``sum_{b, n} |grad_y[b, o, n]| |z[b, c, v, n]|`` for ``grad_weight``
      (:func:`~fovi_ref.check.magnitude.binned_cells`), ``h = 1`` store. A cell summed in the
      working dtype, one rounding per added neighbour, is off relative to its *partial* sums,
      which may be far larger than ``z`` (``A + s - A``): that is not allowed, and check_ops'
      ``rounding`` check builds such cells;
    - ``grad_x``: ``grad_z = W^T grad_y`` per (channel, cell, node) is stored before it is scattered
      onto the inputs (by every narrow backend here), off by at most ``u |grad_z|``. A store is a
      rounding only where the value fits: a float16 ``grad_z`` past 65504 (upstream gradients of
      a gradient scaler's size) is inf, no rounding at all, and where two readers carry it with
      opposite signs ``grad_x`` is nan although the exact value is small. That is not allowed
      (see "Non-finite values"; check ``rounding`` builds such gradients), and fovi_ref's narrow
      path keeps such a ``grad_z`` in float32 (:func:`fovi_ref.precision.stored_product`), which
      rounds nothing. The scatter itself may add in the storage dtype:
      CUDA's ``index_add_``/``scatter_add_`` on float16/bfloat16 add atomically, one rounding per
      collision. With ``F(i)`` real entries reading input ``i`` (its *fan-out*) a term meets at
      most ``h = F(i)`` roundings: ``M_s = M``;
    - ``grad_bias``: none (one reduction of ``grad_y``).

    A term meeting ``h`` such roundings is off by at most ``gamma_h(u) |t|``: together
    ``gamma_h(u) * M_s``.

    *Where that allowance is vacuous.* For ``grad_x`` at a high fan-out, ``gamma_F(u) M_s``
    reaches the magnitude ``M`` itself (``gamma_F(u) >= 1`` from ``F u >= 1/2``: 128 readers in
    bfloat16, 1,024 in float16; ``gamma`` is infinite from ``F u >= 1``, 256 and 2,048), and
    then any value within ``M`` of ``ref`` passes, a zeroed or sign-flipped gradient included.
    Such an element is judged
    instead by the rule every fovi_ref backend keeps on every device (the deterministic
    segment sum accumulates in float32 and rounds once): ``grad_z`` stored once in the
    working dtype, its scatter accumulated in float32, the result rounded once, i.e. the same
    bound with ``h = 1``. A backend that adds 16-bit atomics one reader at a time (CUDA's
    ``index_add_``) fails there, and rightly: such a sum can lose every reader's contribution
    but the first few. It shows where the terms have one sign: random signs make its extra
    roundings cancel (a ``u |t| sqrt(F)`` walk that stays near ``u M``), while terms of one sign
    pile them up, each rounding relative to a partial sum that grows to ``|ref| = M``, and once
    a term falls below half a unit of that sum it is lost. Check ``rounding`` therefore runs the
    hubs, and every graph where many terms meet, with operands of one sign. The row says how
    many elements this rule judged;

(d) *the bias, added after the GEMM* (``bias_rounding="separate"``). An implementation may
    store the GEMM's result and add the bias in a second pass, ``fl(fl(W x) + b)``: one more
    store of every term but the bias (``h`` grows by one, ``M_s`` covers all of them).
    ``F.linear`` adds the bias inside its float32 GEMM for a 2-D or a contiguous 3-D input, but
    for any other input it runs ``matmul`` and then ``add_``. Every fovi_ref backend adds the bias
    inside its GEMM (``torch.addmm``; ``einsum_baseline`` hands ``F.linear`` contiguous features,
    as fovi 2.4.0 does), so the default, ``bias_rounding="fused"``, demands one rounding of
    ``W x + b``; ``"separate"`` is the allowance for judging an implementation that rounds twice
    (measured on res18's layer2.0.downsample.0, batch 4, seed 0: double rounding uses 3.3 times
    the fused bound in float16 and 33 times in bfloat16);

(e) *underflow in a store*: ``|e| <= eta`` each. A sum of float16 (bfloat16) numbers that lands in
    the subnormal range is exact (all are multiples of the smallest subnormal), so only stored
    values that contain a product can underflow: the output, once, and for ``grad_x`` the
    ``P = F(i)`` stored ``grad_z`` values (and for ``y`` the bias-free sum, ``P = 1``, under (d)).

(f) *bfloat16 GEMMs that flush to zero*. A CPU with native bfloat16 GEMMs (AVX512-BF16, AMX;
    :func:`fovi_ref.precision.platform` says ``cpu_bf16``) runs them in oneDNN kernels that read
    a subnormal operand as zero and flush a product or partial sum below the smallest normal,
    ``2^-126`` (bfloat16 and float32 share it), to zero: a ``[16, 64] @ [64, 16]`` GEMM of
    ``2^-130`` and ones gives 0 where the sum is ``2^-124``. Neither step is a rounding of step
    0 (``eta`` is ``2^-150`` in float32), and the backends cannot avoid it without running every
    bfloat16 GEMM wide, so the rule allows it in bfloat16, on every device (a judge does not
    know which GEMM ran). With ``tau = 2^-126``: reading an operand ``a`` as ``a + d``,
    ``|d| < tau``, changes a term ``a b`` by less than ``tau (|a| + |b| + tau)`` where both may
    flush, and each product and addition loses less than ``tau`` flushed. A GEMM's operand is an
    input or a sum of inputs stored once (a cell ``z``, of at most as many neighbours as its
    terms), and a term passes at most two GEMMs, two products and two additions (``grad_x``
    through ``gather_gemm``'s dense one-hot ``S``, whose second operand, ``grad_z`` read as
    ``grad_z + d``, loses less than ``tau`` more), so over the ``N`` terms of one element::

        flush = tau * N * (A + B + 5 + tau),   A, B: the largest |value| of the two operands

    (``x`` and ``weight``, the bias counted with ``x``, for ``y``; ``weight`` and ``grad_y``
    for ``grad_x``; ``grad_y`` and ``x`` for ``grad_weight``; :attr:`Expected.factor_max`).
    It is about ``1e-37 N`` for operands of order one: it decides nothing on ordinary data, and
    below ``1e-37`` it lets a bfloat16 result be zero. float16 keeps its subnormals (its GEMMs
    on a CPU run in float32; cuBLAS keeps them), so no such term there, and a float16 subnormal
    lost fails. ``tests/test_tolerances_flush.py`` holds both on a machine that flushes.

Adding (a)-(f), with the cross terms of small factors kept so the bound is rigorous::

    bound = u |ref| + eta (1 + P)
            + (1 + u) [gamma_h(u) M_s + (1 + gamma_h(u)) gamma_N(u32) M + N eta32 + flush]

(``flush`` in bfloat16 alone; like every error before the last store, the result's rounding
may scale it by ``1 + u``).

**What fovi_ref's own 16-bit paths use of it** (:mod:`fovi_ref.precision`). *Wide* (float32
GEMMs) stores nothing before the result: its error is (a) and (b) alone,
``u |ref| + gamma_N(u32) M``, one rounding of a float32 sum. *Narrow* (16-bit GEMMs accumulating
in float32) stores each shared cell ``z`` once and ``grad_z`` once: for ``y``, in one line,

    |y - ref| <= u |ref| + (1 + u) [u sum_{c, v shared} |w| |z| + (1 + u) gamma_N(u32) M + N eta32]

(+ the oracle's term below), and the same with ``|grad_y| |z|`` for ``grad_weight`` and with
``h = 1`` for ``grad_x``. A value past float16's range is never stored (its operand stays
float32, :mod:`fovi_ref.precision`), so each store is the bounded rounding counted here, and a
kept operand rounds less. The price of narrow is the middle term: at most one unit roundoff of
every stored cell, never of a partial sum, which ``check_ops``' ``rounding`` check builds cells
to expose. Both paths are judged by the same rule, which allows at least what each needs.

**The oracle rounds too.** ``ref`` is itself a float64 sum of the same ``N`` terms, off from the
exact sum by at most ``gamma_N(u64) * M + N * eta64`` (step 1 in float64), so every bound above
gets that term added: ``|value - ref|`` is at most the implementation's error plus the oracle's.
It is negligible below float64; in float64 it doubles the bound. Without it a correct float64
implementation that sums in another order (cells binned first, say) failed by up to 1.35 times
(found by ``scripts/adversarial.py``; ``tests/test_tolerances.py`` holds the three values).

**Step 3: N for each quantity**, the exact number of terms of each element
(:func:`~fovi_ref.check.magnitude.knn_conv_term_counts`):

===============  ===========================================  ================================
quantity         terms ``N`` of one element                   bound on ``N``
===============  ===========================================  ================================
``y``            ``Cin * (real neighbours of n) + 1`` (bias)  ``Cin * K + 1``
``grad_x``       ``Cout * F(i)``                              ``Cout * K * Nout``
``grad_weight``  ``B * (real entries in cell v)``             ``B * Nout * K`` (``B * Nout``
                                                              when cells hold one neighbour)
``grad_bias``    ``B * Nout``                                 ``B * Nout``
===============  ===========================================  ================================

**Step 4: what still fails.** A wrong cell, a dropped neighbour, padding read as an input, a bias
added twice, a gradient sent to the wrong input: each changes some element by about a whole term
``|t|`` (or a whole element), while the bound is ``~ gamma_N M ~ N^2 u |t|`` for typical terms.
In float64 (``u = 1.1e-16``) that catches any such bug up to ``N ~ 1e7`` terms per element; in
float32 up to ``N ~ 4000`` (res18's longest ``y`` sum has 2305 terms). In float16/bfloat16 the
bound is ``~ (u + N u32) M``: single-term errors are caught on small graphs only, and what this
rule guards there is *precision* (accumulating in the storage dtype; under
``bias_rounding="fused"``, rounding the bias twice), while indexing is judged in float64.
:class:`Verdict` reports the worst element's ``error / bound`` so one can see how much room a
check left.

**Non-finite values.** An inf or nan in the inputs must reach exactly the outputs the oracle says,
and a finite ``ref`` may come back non-finite only where a correct implementation can make it so.
Element by element:

- ``ref`` finite, the value ``+inf`` (``-inf``): allowed where the result itself rounds past
  the largest finite value, ``ref + r >= T`` (``ref - r <= -T``), ``T`` the dtype's overflow
  threshold (:func:`overflow_threshold`: the largest finite value plus half its ulp, which
  round-to-nearest takes to inf) and ``r`` the error of the sum that is rounded last: the
  accumulator's and the oracle's, ``gamma_N(u_acc) M + N eta_acc`` plus the oracle's term
  (:func:`accumulated_error`). The allowances for stored intermediates ((c), (d)) never open
  this door: a stored value past the range is inf, no rounding, so a cell, a ``grad_z`` or a
  partial sum of 16-bit atomics that overflows where the result does not fails, however large
  ``M`` or the fan-out (with ``h = F`` stores, ``gamma_F(u) M_s`` passes 65504 at an input of
  40 readers under a gradient scaler's upstream gradients, while the exact ``grad_x`` is
  small). The price: a narrow result within ``u M_s`` of ``T`` whose once-stored cells carry
  it past ``T`` fails, where wide rounds it to the largest finite value. The sign is judged:
  an inf of the other sign than ``ref`` is no overflow of ``ref``, and a ReLU after it would
  turn an overflow into 0;
- ``ref`` finite, the value ``nan``: a correct sum of finite numbers that rounds can overflow
  to ``+-inf``, never to nan, unless two partial sums overflow with opposite signs, which
  needs ``M`` at the accumulator's overflow threshold (float32's for the 16-bit dtypes: below
  it ``M`` bounds every partial sum). So nan (or an inf of either sign) is allowed exactly where
  ``M >= T_acc``, and under a non-finite weight (below);
- ``ref = +-inf`` (an inf input times finite weights): the same inf, or nan. A nan makes no
  claim about the sign; a matrix that multiplies the inf by an exact zero gives it (fovi's
  one-hot einsum multiplies every cell of the inf's channel by it: ``0 * inf``), and no
  accumulator turns ``+inf`` into ``-inf`` (adding ``-inf`` to it gives nan). The other inf
  fails;
- ``ref = nan`` (``inf - inf`` or ``0 * inf`` among the terms, in every order of the sum): nan.

Non-finite *weights* are inside this promise, with the allowance the operator needs: a
non-finite ``weight[o, c*V + v]`` may make every ``y[:, o, :]`` and every ``grad_x[:, c, :]``
non-finite, also at nodes whose neighbours never fill cell ``c*V + v`` and at inputs no node
reads (the oracle, a loop over neighbours, leaves those finite). The operator is one GEMM over
all ``Cin*V`` weight columns, which multiplies each column by every node's cell, the empty ones
as zeros, and ``0 * inf`` is nan; fovi's ``F.linear`` over its one-hot features does the same.
Backward, ``grad_z = weight^T grad_y`` carries the inf into channel ``c`` of every node, and a
backward that sums it back with a matrix (``gather_gemm``'s dense ``S`` on CUDA, fovi's one-hot
einsum) multiplies it by the zeros of the inputs and cells no neighbour reads. ``grad_weight``
must follow the oracle: it reads no weight.
Non-finite *upstream gradients* stay outside the promise: the GEMMs multiply them by the zeros
of empty cells too (``0 * inf``), in ``grad_weight`` as well, which the formula has no term for.
For an inf in ``x`` the zeros of fovi's one-hot einsum (``einsum_baseline``) do the same: the
inf turns every other cell of its channel into nan, so that backend's ``grad_weight`` fails
this check where ``V > 1``. That path also stores each cell, and ``grad_z``, in the working
dtype, so a float16 cell or ``grad_z`` past 65504 is inf where ``y``, ``grad_weight`` and
``grad_x`` are finite (check ``rounding``; fovi's finding
``scripts/fovi_findings/f16_cell_sum_overflow.py``): ``einsum_baseline`` fails those rows too.
On a CPU with native bfloat16 GEMMs its ``F.linear`` reads past the end of each row of its
features (where ``Cin*V`` is not a multiple of 32) and turns an inf of one node into nan at the
node before (:mod:`fovi_ref.layout`): it fails ``nonfinite`` ``y`` in bfloat16 there.

**The baseline**, ``einsum_baseline`` (fovi's path) run in the same dtype, is judged by the same
rule and its worst ratio is *reported* beside the backend's, not used for pass/fail: it shows
how much of the bound a known-correct implementation uses, but one lucky baseline cannot make the
rule stricter, nor an unlucky one looser.

**CUDA math settings.** Steps 1 and 2 assume that a float32 GEMM multiplies float32 numbers and
that a 16-bit GEMM accumulates in float32 and rounds its result once. On a CPU that is what
PyTorch does. Under PyTorch's *default* CUDA settings it is not promised:

- ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction`` and
  ``allow_bf16_reduced_precision_reduction`` are on by default. They let cuBLAS run a 16-bit GEMM
  split-K: the ``N`` terms are cut into ``s`` chunks, each chunk's float32 sum ``p_j`` is stored
  in the 16-bit output dtype, and the ``s`` stored values are added. Each store costs up to
  ``u |p_j|``, and ``|p_j|`` is bounded only by its chunk's magnitude, not by ``|ref|``. A term
  then meets up to ``s`` roundings of ``u`` relative to ``M``: the error can reach
  ``gamma_s(u) M``, where the rule allows ``u |ref| + gamma_N(u32) M``. Under cancellation
  (``|ref| << M``) the first exceeds the second by about ``s u / (N u32)``: for bfloat16, ``s =
  2`` and ``N = 1000`` terms, 128 times. So the rule does **not** hold for a GEMM under the
  default settings. Widening it would need ``s``, which cuBLAS picks by shape and does not
  document; the only bound that holds for every ``s <= N`` is ``gamma_N(u) M``, which for
  bfloat16 is vacuous from ``N = 128`` (``gamma >= 1``, as in step 2 (c)) and would pass a
  kernel that accumulates in 16 bits, the very defect the 16-bit rule exists to catch.
- ``torch.get_float32_matmul_precision()`` is ``"highest"`` by default, but it is one global
  setting, and ``"high"`` lets float32 GEMMs round their inputs to TF32 (``u = 2^-11``, an error of
  about ``2^-10 |t|`` per product) or use bfloat16 pieces. That alone exceeds the float32 rule's
  ``gamma_N(2^-24) M`` for every ``N`` below ``2^14`` (res18's longest ``y`` sum has 2,305
  terms). ``torch.backends.cudnn.allow_tf32`` (on by default) does the same to
  cuDNN's convolutions, and ``allow_fp16_accumulation`` (off by default) to float16 GEMMs'
  accumulators (``gamma_N(2^-11) M``).

Hence the harness does not widen the rule: it **judges under settings it sets and reports**.
``check_ops``, ``verify`` and ``verify --fovi`` run inside
:func:`fovi_ref.check.arithmetic.verdict_arithmetic`, which sets float32 matmul precision
``"highest"``, cuDNN TF32 off, both reduced-precision reductions off and float16 accumulation off,
and restores the previous values on exit; every report stores
:func:`~fovi_ref.check.arithmetic.arithmetic_settings` (and prints
:func:`~fovi_ref.check.arithmetic.describe`'s lines), so a verdict says what arithmetic it was
reached under. A backend judged PASS this way is correct in that arithmetic; a user who turns the
switches on gets faster GEMMs whose 16-bit results may be off by the ``gamma_s(u) M`` above.
Deterministic algorithms change the order of additions, not the bound, and are only recorded.
Whether fovi_ref's own 16-bit GEMMs meet the rule under cuBLAS's defaults as well (whether cuBLAS
picks split-K at res18's shapes) is a measurement, not a derivation: ``scripts/gpu_check.sh``
runs the CUDA tests and ``verify --device cuda`` under the settings above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from fovi_ref import KNNMeta, dtype_name
from fovi_ref.check.magnitude import (
    binned_cells,
    fan_out,
    knn_conv_magnitude,
    knn_conv_term_counts,
    oracle_quantities,
    shared_cell_meta,
)
from fovi_ref.check.operands import QUANTITIES
from fovi_ref.reference import AllPadding, check_shapes

__all__ = [
    "ACCUMULATION",
    "FLUSHED_BELOW",
    "HALF_SUBNORMAL",
    "QUANTITIES",
    "UNIT_ROUNDOFF",
    "Expected",
    "Verdict",
    "accumulated_error",
    "error_bound",
    "expected_quantities",
    "gamma",
    "judge_elementwise",
    "nonfinite_stands",
    "overflow_threshold",
    "relative_error",
    "vacuous_stores",
]

BiasRounding = Literal["separate", "fused"]

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
# eta of step 0: half the smallest subnormal; for float64 the smallest itself, since half of it
# is 0.0 as a float64 (the allowance would vanish and a subnormal one unit off would fail).
HALF_SUBNORMAL: dict[torch.dtype, float] = {
    torch.float64: 2.0**-1074,
    torch.float32: 2.0**-150,
    torch.float16: 2.0**-25,
    torch.bfloat16: 2.0**-134,
}
# tau of step 2 (f): below it a bfloat16 GEMM may read an operand, or keep a product or a partial
# sum, as zero (the smallest normal bfloat16 and float32). No other dtype flushes.
FLUSHED_BELOW: dict[torch.dtype, float] = {torch.bfloat16: 2.0**-126}
# The precision sums are accumulated in (step 2): float32 for the 16-bit dtypes.
ACCUMULATION: dict[torch.dtype, torch.dtype] = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
}


def gamma(n: torch.Tensor | float, u: float) -> torch.Tensor:
    """``gamma_n(u) = n u / (1 - n u)`` elementwise (inf where ``n u >= 1``), float64."""
    nu = torch.as_tensor(n, dtype=torch.float64) * u
    return torch.where(nu < 1, nu / (1 - nu).clamp(min=1e-300), math.inf)


# ------------------------------------------------------------------------ expected quantities
@dataclass(frozen=True)
class Expected:
    """The oracle's value of one quantity and the sizes its error bound needs, elementwise.

    Attributes (float64 tensors of the quantity's shape, or broadcastable to it):
        name: ``"y"``, ``"grad_x"``, ``"grad_weight"`` or ``"grad_bias"``.
        value: the float64 oracle, ``ref``.
        magnitude: ``M``, the sum of the magnitudes of the terms.
        terms: ``N``, the number of terms.
        stored: ``M_s``, the magnitude of the terms that pass through a stored intermediate.
        stores: ``h``, how many roundings in the working dtype such a term may meet.
        product_stores: ``P``, stored values that hold a product (may underflow).
        nonfinite_allowed: bool, broadcastable: elements whose finite ``ref`` may come back
            non-finite (``y[:, o, :]`` where row ``o`` of the weight holds an inf or nan, and
            ``grad_x[:, c, :]`` where a column of input channel ``c`` does; module docstring,
            "Non-finite values"); ``None``: nowhere.
        factor_max: ``A + B``, the largest finite ``|value|`` of each of the two operands whose
            products the quantity sums (step 2 (f): what a bfloat16 GEMM's flush to zero may
            lose per term); ``None``: no flush allowed.
    """

    name: str
    value: torch.Tensor
    magnitude: torch.Tensor
    terms: torch.Tensor
    stored: torch.Tensor
    stores: torch.Tensor
    product_stores: torch.Tensor
    nonfinite_allowed: torch.Tensor | None = None
    factor_max: torch.Tensor | None = None


def _largest(*operands: torch.Tensor | None) -> torch.Tensor:
    """The largest finite ``|value|`` among ``operands`` (float64 scalar; 0 where none)."""
    found = [
        t.detach().double().abs().nan_to_num(nan=0.0, posinf=0.0)
        for t in operands
        if t is not None and t.numel()
    ]
    if not found:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([t.max() for t in found]).max()


def expected_quantities(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    grad_y: torch.Tensor,
    *,
    all_padding: AllPadding = "bias",
    bias_rounding: BiasRounding = "fused",
) -> dict[str, Expected]:
    """:class:`Expected` for ``y`` and the three gradients (no ``grad_bias`` without a bias).

    ``x [B, Cin, Nin]``, ``weight [Cout, Cin*V]``, ``bias [Cout]`` and ``grad_y [B, Cout, Nout]``
    are the values the implementation under test received (already rounded to its dtype); every
    size is computed from them in float64 (four runs of the oracle: values, magnitudes, term
    counts, magnitudes over shared cells). ``all_padding`` goes to the oracle;
    ``bias_rounding`` says whether ``y`` may round ``W x`` before adding the bias ((d) above).
    """
    if bias_rounding not in ("separate", "fused"):
        raise ValueError(f"bias_rounding must be 'separate' or 'fused', got {bias_rounding!r}")
    check_shapes(x, weight, bias, meta, grad_y)
    batch, c_out = x.shape[0], weight.shape[0]
    ref = oracle_quantities(x, weight, bias, meta, grad_y, all_padding=all_padding)
    mag = knn_conv_magnitude(x, weight, bias, meta, grad_y, all_padding=all_padding)
    counts = knn_conv_term_counts(
        meta, c_out, batch, bias=bias is not None, all_padding=all_padding
    )
    shared_meta = shared_cell_meta(meta)
    if bool(shared_meta.pad_mask.all()):  # no cell holds two neighbours: nothing is binned
        shared_y = shared_w = torch.zeros((), dtype=torch.float64, device=x.device)
    else:  # only the binned features of cells holding two or more neighbours are rounded,
        # each relative to its own value |z|: sum_{c,v} |w| |z| and sum_{b,n} |grad_y| |z|
        z_abs = binned_cells(x.detach(), shared_meta).flatten(1, 2).abs()  # [B, Cin*V, Nout]
        # A non-finite weight makes y non-finite wherever a node reads it (no bound needed there);
        # elsewhere its empty cells hold no term, so it counts 0 (the einsum would give 0*inf).
        w_abs = weight.detach().double().abs().nan_to_num(nan=0.0, posinf=0.0)
        shared_y = torch.einsum("oj,bjn->bon", w_abs, z_abs)
        shared_w = torch.einsum("bon,bjn->oj", grad_y.detach().double().abs(), z_abs)
    readers = fan_out(meta).to(torch.float64)[None, None, :]  # [1, 1, Nin] F(i)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    one = torch.ones((), dtype=torch.float64, device=x.device)
    y_stored, y_stores, y_products = shared_y, one, zero  # (c): the binned features
    if bias is not None and bias_rounding == "separate":  # (d): W x stored before the bias
        y_stored = (mag.y - bias.double().abs()[None, :, None]).clamp(min=0)  # all but the bias
        y_stores, y_products = 1 + (shared_y > 0).double(), one
    # step 2 (f): the largest |value| of each GEMM's two operands (y's GEMM adds the bias too)
    largest_w, largest_gy = _largest(weight), _largest(grad_y)
    y_factors = _largest(x, bias) + largest_w
    grad_x_factors = largest_w + largest_gy
    grad_weight_factors = largest_gy + _largest(x)
    finite_w = torch.isfinite(weight.detach())  # [Cout, Cin*V]
    poisoned_y = ~finite_w.all(dim=1)[None, :, None]  # [1, Cout, 1]
    finite_c = finite_w.view(c_out, -1, meta.v).all(dim=2).all(dim=0)  # [Cin]
    poisoned_x = ~finite_c[None, :, None]  # [1, Cin, 1]
    out = {
        "y": Expected(
            "y",
            ref.y,
            mag.y,
            counts.y,
            stored=y_stored,
            stores=y_stores,
            product_stores=y_products,
            nonfinite_allowed=poisoned_y,
            factor_max=y_factors,
        ),
        "grad_x": Expected(
            "grad_x",
            ref.grad_x,
            mag.grad_x,
            counts.grad_x,
            stored=mag.grad_x,
            stores=readers,
            product_stores=readers,
            nonfinite_allowed=poisoned_x,
            factor_max=grad_x_factors,
        ),
        "grad_weight": Expected(
            "grad_weight",
            ref.grad_weight,
            mag.grad_weight,
            counts.grad_weight,
            stored=shared_w,
            stores=one,
            product_stores=zero,
            factor_max=grad_weight_factors,
        ),
    }
    if bias is not None:  # a sum of grad_y: no GEMM, no flush
        out["grad_bias"] = Expected(
            "grad_bias", ref.grad_bias, mag.grad_bias, counts.grad_bias, zero, zero, zero
        )
    return out


def vacuous_stores(expected: Expected, dtype: torch.dtype) -> torch.Tensor:
    """Elements (bool, broadcast to the quantity's shape) where more than one stored rounding
    allows an error as large as the magnitude of the terms, ``gamma_h(u) M_s >= M``: judged with
    ``h = 1`` (step 2 (c), "Where that allowance is vacuous"). None in float32 and float64."""
    shape = expected.value.shape
    if ACCUMULATION[dtype] == dtype:
        return torch.zeros(shape, dtype=torch.bool, device=expected.value.device)
    g_store = gamma(expected.stores, UNIT_ROUNDOFF[dtype])
    vacuous = (expected.stores > 1) & (g_store * expected.stored >= expected.magnitude)
    return vacuous.expand(shape)


def accumulated_error(expected: Expected, dtype: torch.dtype) -> torch.Tensor:
    """How far the sum a correct implementation rounds last may lie from ``ref``: the error of
    the accumulation (steps 1 and 2 (a), ``gamma_N(u_acc) M + N eta_acc``) plus the oracle's,
    and nothing stored on the way. In float32 and float64 it is the whole bound; in 16 bits it
    decides where the result itself may round to inf (module docstring, "Non-finite values")."""
    n, m = expected.terms, expected.magnitude
    acc = ACCUMULATION[dtype]
    return gamma(n, UNIT_ROUNDOFF[acc]) * m + n * HALF_SUBNORMAL[acc] + _oracle_error(expected)


def _oracle_error(expected: Expected) -> torch.Tensor:
    """The oracle is a float64 sum of the same ``N`` terms: it may be off by as much on its side
    (module docstring, "The oracle rounds too")."""
    n, m = expected.terms, expected.magnitude
    return gamma(n, UNIT_ROUNDOFF[torch.float64]) * m + n * HALF_SUBNORMAL[torch.float64]


def error_bound(expected: Expected, dtype: torch.dtype) -> torch.Tensor:
    """The elementwise bound of the module docstring for a result computed in ``dtype``."""
    if ACCUMULATION[dtype] == dtype:  # step 1: one precision throughout
        return accumulated_error(expected, dtype)
    u, eta = UNIT_ROUNDOFF[dtype], HALF_SUBNORMAL[dtype]
    n, m = expected.terms, expected.magnitude
    u_acc, eta_acc = UNIT_ROUNDOFF[ACCUMULATION[dtype]], HALF_SUBNORMAL[ACCUMULATION[dtype]]
    stores = torch.where(vacuous_stores(expected, dtype), 1.0, expected.stores)
    g_store = gamma(stores, u)
    inner = g_store * expected.stored + (1 + g_store) * gamma(n, u_acc) * m + n * eta_acc
    tau = FLUSHED_BELOW.get(dtype)
    if tau is not None and expected.factor_max is not None:  # step 2 (f), before the last store
        inner = inner + tau * n * (expected.factor_max + 5 + tau)
    bound = u * expected.value.abs() + eta * (1 + expected.product_stores) + (1 + u) * inner
    return bound + _oracle_error(expected)


# ------------------------------------------------------------------------------------ verdicts
@dataclass(frozen=True)
class Verdict:
    """The outcome of judging one result with :func:`judge_elementwise`.

    Attributes:
        quantity: what was judged (``"y"``, ``"grad_x"``, ...).
        dtype: the dtype whose rule applied (the inputs' dtype).
        ratio: the worst finite element's ``|value - ref| / bound`` (pass: ``<= 1``; inf where an
            element with bound 0 is off at all).
        max_abs_error: ``max |value - ref|`` over finite elements.
        worst_index: where ``ratio`` was found (``None`` if nothing was compared).
        worst_error, worst_bound, worst_ref, worst_magnitude, worst_value: that element's
            figures (``worst_value`` the result's own).
        nonfinite_mismatches: non-finite elements (of the value or the oracle) that the other does
            not match as :func:`nonfinite_stands` says.
        baseline_ratio, baseline_max_abs_error: the same figures for the baseline (reported,
            not judged), or ``None``.
        notes: anything else a reader should know (a dtype or shape the result should not have).
        ok: ``ratio <= 1``, no non-finite mismatch, and the right shape and dtype.
    """

    quantity: str
    dtype: torch.dtype
    ratio: float
    max_abs_error: float
    worst_index: tuple[int, ...] | None
    worst_error: float
    worst_bound: float
    worst_ref: float
    worst_magnitude: float
    nonfinite_mismatches: int
    baseline_ratio: float | None = None
    baseline_max_abs_error: float | None = None
    notes: tuple[str, ...] = ()
    ok: bool = field(default=False)
    worst_value: float | None = None

    def __str__(self) -> str:
        where = "" if self.worst_index is None else f" at {list(self.worst_index)}"
        text = (
            f"{'PASS' if self.ok else 'FAIL'} {self.quantity} {dtype_name(self.dtype)}: "
            f"worst err/bound {self.ratio:.2f} ({self.worst_error:.1e} <= {self.worst_bound:.1e}"
            f"{where}), max |err| {self.max_abs_error:.1e}"
        )
        if self.nonfinite_mismatches:
            text += f", {self.nonfinite_mismatches} non-finite mismatches"
        if self.baseline_ratio is not None:
            text += f"; baseline err/bound {self.baseline_ratio:.2f}"
        return text + "".join(f"; {n}" for n in self.notes)


def overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that round-to-nearest takes to inf in ``dtype``: the largest finite
    value plus half an ulp of it, ``2^emax u`` (float16: 65504 + 16)."""
    biggest = torch.finfo(dtype).max
    return biggest + math.ldexp(UNIT_ROUNDOFF[dtype], math.frexp(biggest)[1] - 1)


def nonfinite_stands(value: torch.Tensor, expected: Expected, dtype: torch.dtype) -> torch.Tensor:
    """Elements (bool, the quantity's shape) where a non-finite ``value`` (float64) may stand for
    the oracle's ``ref`` (module docstring, "Non-finite values"): an inf of ``ref``'s side where
    the sum rounded last may reach the overflow threshold, a nan or an inf where ``M`` reaches the
    accumulator's, the same inf or a nan for an infinite ``ref``, a nan for a nan, anything under
    a non-finite weight. False wherever ``value`` is finite."""
    ref = expected.value
    reach = accumulated_error(expected, dtype).expand_as(ref)
    threshold = overflow_threshold(dtype)
    is_nan = torch.isnan(value)
    up = (value == math.inf) & (ref + reach >= threshold)  # nan ref: False
    down = (value == -math.inf) & (ref - reach <= -threshold)
    sums = expected.magnitude.expand_as(ref) >= overflow_threshold(ACCUMULATION[dtype])
    from_finite = torch.isfinite(ref) & (up | down | (sums & ~torch.isfinite(value)))
    from_inf = torch.isinf(ref) & ((value == ref) | is_nan)
    stands = from_finite | from_inf | (torch.isnan(ref) & is_nan)
    if expected.nonfinite_allowed is not None:
        stands |= expected.nonfinite_allowed.expand_as(ref) & ~torch.isfinite(value)
    return stands


def _ratios(value: torch.Tensor, expected: Expected, dtype: torch.dtype):
    """``(ratio, error, bound, mismatched)``: elementwise ratio on finite elements (0 elsewhere),
    and where a non-finite value or ``ref`` is not matched as :func:`nonfinite_stands` says."""
    ref = expected.value
    v = value.detach().to(device=ref.device, dtype=torch.float64)
    bound = error_bound(expected, dtype).expand_as(ref)
    finite_ref, finite_v = torch.isfinite(ref), torch.isfinite(v)
    mismatched = torch.where(finite_v, ~finite_ref, ~nonfinite_stands(v, expected, dtype))
    both = finite_ref & finite_v
    error = torch.where(both, (v - ref).abs(), 0.0)
    safe = torch.where(bound > 0, bound, 1.0)
    ratio = torch.where(bound > 0, error / safe, torch.where(error > 0, math.inf, 0.0))
    return ratio, error, bound, mismatched


def judge_elementwise(
    value: torch.Tensor,
    expected: Expected,
    *,
    dtype: torch.dtype | None = None,
    baseline: torch.Tensor | None = None,
    any_dtype: bool = False,
) -> Verdict:
    """Judge ``value`` against ``expected`` by the rule of the module docstring.

    Args:
        value: the result under test, any float dtype (it is compared in float64).
        expected: from :func:`expected_quantities` on the inputs ``value`` was computed from.
        dtype: whose rule applies: the dtype of the inputs (default ``value.dtype``). A result
            returned in another dtype is judged by this rule, noted (``"returned float32"``)
            and fails, unless ``any_dtype`` (a diagnosis asking which rule a value meets).
        baseline: the same quantity from a baseline implementation in the same dtype; its worst
            ratio is reported, not judged.
    """
    dtype = value.dtype if dtype is None else dtype
    notes = []
    if value.dtype != dtype:
        notes.append(f"returned {dtype_name(value.dtype)}")
    if tuple(value.shape) != tuple(expected.value.shape):
        notes.append(f"shape {tuple(value.shape)}, expected {tuple(expected.value.shape)}")
        return Verdict(
            expected.name,
            dtype,
            math.inf,
            math.inf,
            None,
            math.inf,
            0.0,
            0.0,
            0.0,
            0,
            notes=tuple(notes),
            ok=False,
        )
    ratio, error, bound, mismatched = _ratios(value, expected, dtype)
    mismatches = int(mismatched.sum())
    worst_value = None
    if ratio.numel() == 0:
        worst, worst_ratio, max_abs = None, 0.0, 0.0
        figures = (0.0, 0.0, 0.0, 0.0)
    else:
        if mismatches and bool(ratio.max() <= 1):  # what fails is a non-finite mismatch
            flat = int(mismatched.flatten().nonzero()[0])
        elif bool(ratio.max() > 0):
            flat = int(torch.argmax(ratio))
        else:
            flat = int(torch.argmax(bound))
        worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
        worst_ratio, max_abs = float(ratio.max()), float(error.max())
        magnitude = expected.magnitude.expand_as(expected.value)
        figures = tuple(float(t.detach()[worst]) for t in (error, bound, expected.value, magnitude))
        worst_value = float(value.detach()[worst])
        vacuous = int(vacuous_stores(expected, dtype).sum())
        if vacuous:
            notes.append(f"{vacuous} elements judged with h = 1 (the h-store bound reaches M)")
    base_ratio = base_abs = None
    if baseline is not None and tuple(baseline.shape) == tuple(expected.value.shape):
        b_ratio, b_error, _, _ = _ratios(baseline, expected, dtype)
        base_ratio = float(b_ratio.max()) if b_ratio.numel() else 0.0
        base_abs = float(b_error.max()) if b_error.numel() else 0.0
    ok = worst_ratio <= 1 and mismatches == 0 and (any_dtype or value.dtype == dtype)
    return Verdict(
        expected.name,
        dtype,
        worst_ratio,
        max_abs,
        worst,
        *figures,
        mismatches,
        base_ratio,
        base_abs,
        tuple(notes),
        ok,
        worst_value,
    )


# ------------------------------------------------------------------------- a plain figure
def relative_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |value - ref| / max |ref|`` in float64 (``max |value - ref|`` if ``ref`` is all 0)."""
    diff = (value.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff
