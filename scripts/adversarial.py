"""Throw unusual-but-valid and invalid inputs at the public API and judge every finite result.

    python scripts/adversarial.py [--graphs N] [--seed S] [--only CATEGORY ...]

Each case calls ``knn_conv``, ``KNNConv`` or the harness as a user would, then judges ``y`` and
the gradients that were asked for against the float64 oracle with the repository's elementwise
rule (:mod:`fovi_ref.check.tolerances`), and checks dtype, shape and which gradients exist.
Invalid inputs must raise ``TypeError``/``ValueError``/``RuntimeError`` before a kernel runs.

A *silent* finding is a result that comes back without an error and is wrong (outside the rule,
wrong dtype or shape, a missing or extra gradient, or an accepted invalid input); a *loud* one is
an error where the input was valid, or an error of an unexpected type. The script prints one line
per category (cases tried, findings) and every finding, and exits 1 if any finding is silent.
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import pickle
import random
import sys
import traceback
from collections import Counter
from collections.abc import Callable

import torch

import fovi_ref
from fovi_ref import KNNConv, KNNMeta, knn_conv
from fovi_ref.check.tolerances import UNIT_ROUNDOFF, expected_quantities, judge_elementwise

torch.set_num_threads(1)

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
TRIED: Counter = Counter()
FINDINGS: list[dict] = []


def finding(category: str, case: str, result: str, silent: bool) -> None:
    FINDINGS.append(dict(category=category, case=case, result=result, silent=silent))


# ------------------------------------------------------------------------------ graphs
def make_meta(
    rng: random.Random, *, k=None, v=None, n_in=None, n_out=None, c_in=None, pad=None, dup=False
) -> KNNMeta:
    k = k or rng.choice([1, 1, 2, 3, 5])
    v = v or rng.choice([1, 1, 2, 3, 7])
    n_in = n_in or rng.choice([1, 2, 3, 7, 11])
    n_out = n_out or rng.choice([1, 2, 5, 9])
    c_in = c_in or rng.choice([1, 2, 3])
    pad = rng.choice([0.0, 0.0, 0.3, 1.0]) if pad is None else pad
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    knn = torch.randint(0, n_in, (k, n_out), generator=g)
    if dup:  # every slot of a node reads one input
        knn = knn[:1].expand(k, n_out).clone()
    rf = torch.randint(0, v, (n_out, k), generator=g)
    knn[torch.rand(k, n_out, generator=g) < pad] = n_in
    return KNNMeta.from_knn(knn, rf, n_in=n_in, in_channels=c_in, v=v)


def operands(meta: KNNMeta, c_out: int, batch: int, dtype, rng: random.Random, scale=1.0):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    f64 = torch.float64
    x = torch.randn(batch, meta.in_channels, meta.n_in, generator=g, dtype=f64) * scale
    w = torch.randn(c_out, meta.in_channels * meta.v, generator=g, dtype=f64)
    w = w * (2 / (meta.in_channels * meta.v)) ** 0.5
    b = 0.1 * torch.randn(c_out, generator=g, dtype=f64)
    gy = torch.randn(batch, c_out, meta.n_out, generator=g, dtype=f64)
    return tuple(t.to(dtype) for t in (x, w, b, gy))


def relayout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another memory layout (what a caller may hand over)."""
    if how == "contiguous" or t.dim() == 0:
        return t.contiguous()
    if how == "transposed":  # storage of the last two dims swapped (fovi's y layout for 3-D)
        return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t
    if how == "strided":  # every other element of a bigger buffer
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if how == "flipped":  # flip twice: same values, through a copy (torch has no negative strides)
        return t.flip(-1).flip(-1)
    if how == "batch_first_perm" and t.dim() == 3:  # [Cin, B, Nin] storage
        return t.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    if how == "stride0" and t.dim() == 3 and t.shape[0] >= 1:
        return t  # handled by the caller (needs equal samples)
    return t


# ------------------------------------------------------------------------------ judging
def judge(category, case, x, w, b, meta, gy, got, want, *, dtype, all_padding="bias") -> bool:
    """Judge ``got = (y, gx, gw, gb)`` (``None`` where not asked); ``want`` the asked flags."""
    y = got[0]
    if y.dtype != dtype:
        finding(category, case, f"y dtype {y.dtype}, expected {dtype}", True)
        return False
    shape = (x.shape[0], w.shape[0], meta.n_out)
    if tuple(y.shape) != shape:
        finding(category, case, f"y shape {tuple(y.shape)}, expected {shape}", True)
        return False
    exp = expected_quantities(
        x.detach(), w.detach(), None if b is None else b.detach(), meta, gy, all_padding=all_padding
    )
    ok = True
    for name, value, asked in zip(
        ("y", "grad_x", "grad_weight", "grad_bias"), got, (True, *want), strict=True
    ):
        if name == "grad_bias" and b is None:
            continue
        if not asked:
            if value is not None:
                finding(category, case, f"{name} computed though not asked", True)
                ok = False
            continue
        if value is None:
            finding(category, case, f"{name} missing", True)
            ok = False
            continue
        verdict = judge_elementwise(value, exp[name], dtype=dtype)
        if not verdict.ok:  # inf or nan where the oracle is finite is wrong but visible
            visible = verdict.ratio <= 1 and verdict.nonfinite_mismatches > 0
            finding(category, case, str(verdict), not visible)
            ok = False
    return ok


def run_op(call: Callable, x, w, b, gy, want):
    """``(y, gx, gw, gb)`` of ``call(x, w, b)``, gradients of the leaves asked for."""
    leaves = []
    for t, asked in zip((x, w, b), want, strict=True):
        if t is not None and asked:
            t.requires_grad_(True)
            leaves.append(t)
    y = call(x, w, b)
    grads = [None, None, None]
    if leaves:
        got = torch.autograd.grad(y, leaves, gy.to(y.dtype), allow_unused=True)
        it = iter(got)
        for i, (t, asked) in enumerate(zip((x, w, b), want, strict=True)):
            if t is not None and asked:
                grads[i] = next(it)
    return (y.detach(), *grads)


def attempt(category: str, case: str, fn: Callable, *, valid: bool) -> object:
    """Run ``fn``; for a valid input an exception is a loud finding, for an invalid one no
    exception (or an unexpected type) is a finding."""
    TRIED[category] += 1
    try:
        out = fn()
    except (
        TypeError,
        ValueError,
        LookupError,
        RuntimeError,
        NotImplementedError,
        AttributeError,
    ) as e:
        if valid:
            finding(category, case, f"raised {type(e).__name__}: {str(e)[:160]}", False)
        return e
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc().strip().splitlines()[-1]
        finding(category, case, f"unexpected {type(e).__name__}: {tb[:160]}", False)
        return e
    if not valid:
        finding(category, case, f"accepted (returned {type(out).__name__})", True)
    return out


def conv_case(category, case, meta, backend, x, w, b, gy, *, dtype, want=(True, True, True)):
    """``knn_conv`` on copies of the operands, forward and the gradients asked for, judged."""

    def call(x_, w_, b_):
        return knn_conv(x_, w_, b_, meta, backend=backend)

    copies = (x.clone(), w.clone(), None if b is None else b.clone())
    got = attempt(category, case, lambda: run_op(call, *copies, gy, want), valid=True)
    if isinstance(got, tuple):
        judge(category, case, x, w, b, meta, gy, got, want, dtype=dtype)


# ------------------------------------------------------------------------------ categories
def fuzz(n_graphs: int, seed: int, start: int = 0) -> None:
    """Random small graphs x dtype x layout x bias x backend x requires_grad x path."""
    for i in range(start, start + n_graphs):
        fuzz_one(i, seed)


def fuzz_one(i: int, seed: int) -> None:
    """Random graph number ``i`` of ``seed``: the same case every time."""
    cat = "random graphs"
    rng = random.Random(seed * 1_000_003 + i)
    meta = make_meta(rng, dup=rng.random() < 0.1)
    dtype = rng.choice(DTYPES)
    c_out = rng.choice([1, 2, 4])
    batch = rng.choice([0, 1, 2, 3, 5])
    x, w, b, gy = operands(meta, c_out, batch, torch.float64, rng)
    values = rng.choice(["normal", "normal", "mixed", "cancel", "integers"])
    if values == "mixed":  # every element its own power of ten (of the dtype's range)
        span = {torch.float16: 4, torch.bfloat16: 30, torch.float32: 30}.get(dtype, 200)
        g = torch.Generator().manual_seed(i)
        x = x * 10.0 ** torch.randint(-span, span + 1, x.shape, generator=g, dtype=torch.float64)
        w = w * 10.0 ** torch.randint(-span, span + 1, w.shape, generator=g, dtype=torch.float64)
    elif values == "cancel" and meta.n_in >= 2:  # inputs in +-pairs, y sums to ~bias
        x[..., 1::2] = -x[..., : meta.n_in // 2 * 2 : 2]
    elif values == "integers":  # exact in every dtype: any rounding shows
        x, w, b, gy = (t.round() for t in (x * 4, w * 4, b * 4, gy))
    x, w, b, gy = (t.to(dtype) for t in (x, w, b, gy))
    if rng.random() < 0.3:
        b = None
    elif rng.random() < 0.3:
        b = relayout(b, "strided")
    how = rng.choice(
        ["contiguous", "transposed", "strided", "flipped", "batch_first_perm", "stride0"]
    )
    stride0 = how == "stride0" and batch >= 1
    x = x[:1].expand(batch, -1, -1) if stride0 else relayout(x, how)
    w = relayout(w, rng.choice(["contiguous", "transposed", "strided"]))
    gy_how = rng.choice(["contiguous", "transposed", "strided", "expanded"])
    gy = gy[:1, :1, :1].expand_as(gy) if gy_how == "expanded" and gy.numel() else gy
    gy = relayout(gy, gy_how)
    backends = [None, "general", "einsum_baseline"]
    if meta.k == 1 and meta.v == 1:
        backends.append("gather_gemm")
    backend = rng.choice(backends)
    want = tuple(rng.random() < 0.7 for _ in range(3))
    path = rng.choice(["knn_conv", "knn_conv", "layer"])
    case = (
        f"#{i} K={meta.k} V={meta.v} Nin={meta.n_in} Nout={meta.n_out} "
        f"Cin={meta.in_channels} Cout={c_out} B={batch} pad={int(meta.pad_mask.sum())} "
        f"{dtype} {values} x:{how} gy:{gy_how} bias={b is not None} backend={backend} "
        f"want={want} {path}"
    )
    xx, ww = x.detach().clone(), w.detach().clone()  # values for the oracle
    bb = None if b is None else b.detach().clone()
    if path == "knn_conv":
        x_in = x.detach()
        if how == "stride0" and batch >= 1:
            x_in = x.detach()[:1].expand_as(x)  # keep stride 0 (a leaf of that view)
            x_in = x_in.clone() if want[0] else x_in
        w_in, b_in = w.detach(), None if b is None else b.detach()

        def call(x_, w_, b_, backend=backend, meta=meta):
            return knn_conv(x_, w_, b_, meta, backend=backend)

        got = attempt(cat, case, lambda: run_op(call, x_in, w_in, b_in, gy, want), valid=True)
    else:
        layer = KNNConv(meta.in_channels, c_out, meta, bias=b is not None, backend=backend)
        layer = layer.to(dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
            if b is not None:
                layer.bias.copy_(b)
        layer.weight.requires_grad_(want[1])
        if b is not None:
            layer.bias.requires_grad_(want[2])
        x_in = x.detach().clone().requires_grad_(want[0]) if want[0] else x.detach()

        def lcall(layer=layer, x_in=x_in):
            y = layer(x_in)
            leaves = [
                t
                for t, a in ((x_in, want[0]), (layer.weight, want[1]), (layer.bias, want[2]))
                if t is not None and a
            ]
            out = [y.detach(), None, None, None]
            if leaves:
                gs = iter(torch.autograd.grad(y, leaves, gy.to(y.dtype)))
                for j, (t, a) in enumerate(
                    ((x_in, want[0]), (layer.weight, want[1]), (layer.bias, want[2]))
                ):
                    if t is not None and a:
                        out[j + 1] = next(gs)
            return tuple(out)

        got = attempt(cat, case, lcall, valid=True)
    if isinstance(got, tuple):
        judge(cat, case, xx, ww, bb, meta, gy, got, want, dtype=dtype)


def magnitudes(seed: int) -> None:
    """Huge, tiny, subnormal, inf and nan values in x, per dtype."""
    cat = "magnitudes"
    rng = random.Random(seed)
    for dtype in DTYPES:
        fi = torch.finfo(dtype)
        scales = {
            "tiny": fi.tiny,
            "subnormal": fi.tiny * fi.eps * 4,
            "1e-30": 1e-30,
            "sqrt max": math.sqrt(fi.max),
            "max/64": fi.max / 64,
            "max/4": fi.max / 4,
        }
        for name, scale in scales.items():
            for trial in range(6):
                meta = make_meta(rng, k=rng.choice([1, 3]), v=rng.choice([1, 2]))
                x, w, b, gy = operands(meta, 2, 2, torch.float64, rng)
                x = (x * scale).to(dtype)
                w = (w if name in ("tiny", "subnormal", "1e-30") else w * 0.01).to(dtype)
                b, gy = b.to(dtype), gy.to(dtype)
                for backend in (None, "einsum_baseline"):
                    case = f"{dtype} x*{name} trial {trial} {meta} backend={backend}"
                    conv_case(cat, case, meta, backend, x, w, b, gy, dtype=dtype)
        for bad in (math.inf, -math.inf, math.nan):
            for trial in range(4):
                meta = make_meta(rng, pad=0.3)
                x, w, b, gy = operands(meta, 2, 2, dtype, rng)
                x[rng.randrange(2), rng.randrange(meta.in_channels), rng.randrange(meta.n_in)] = bad
                for backend in (None, "general", "gather_gemm"):
                    if backend == "gather_gemm" and (meta.k, meta.v) != (1, 1):
                        continue
                    case = f"{dtype} x has {bad} trial {trial} {meta} backend={backend}"
                    conv_case(cat, case, meta, backend, x, w, b, gy, dtype=dtype)


def edge_shapes(seed: int) -> None:
    """Cin/Cout 1, K/V 1 and large, n_out 1, n_in 1, all padding, duplicated neighbours."""
    cat = "edge shapes"
    rng = random.Random(seed)
    shapes = [
        dict(k=1, v=1, n_in=1, n_out=1, c_in=1),
        dict(k=9, v=9, n_in=1, n_out=1, c_in=1),
        dict(k=1, v=40, n_in=3, n_out=4, c_in=1),
        dict(k=40, v=1, n_in=2, n_out=3, c_in=2),
        dict(k=33, v=17, n_in=50, n_out=2, c_in=2),
        dict(k=2, v=2, n_in=1, n_out=30),
        dict(k=3, v=3, n_in=4, n_out=4, pad=1.0),
        dict(k=1, v=1, n_in=5, n_out=5, pad=1.0),
        dict(k=6, v=2, n_in=3, n_out=4, dup=True),
        dict(k=6, v=1, n_in=1, n_out=1, dup=True),
        dict(k=1, v=1, n_in=3000, n_out=2000, c_in=1, pad=0.1),
        dict(k=1, v=1, n_in=2, n_out=3000, c_in=1, pad=0.1),
        dict(k=4, v=3, n_in=2, n_out=500, c_in=2, pad=0.1),
    ]
    for shape in shapes:
        for dtype in DTYPES:
            for batch in (0, 1, 4, 257):
                for c_out in (1, 3):
                    meta = make_meta(rng, **shape)
                    x, w, b, gy = operands(meta, c_out, batch, dtype, rng)
                    for backend in (None, "einsum_baseline"):
                        case = f"{shape} {dtype} B={batch} Cout={c_out} backend={backend}"

                        conv_case(cat, case, meta, backend, x, w, b, gy, dtype=dtype)


def modes(seed: int) -> None:
    """no_grad, inference_mode, autocast, inference tensors, deepcopy/pickle, compile."""
    cat = "modes"
    rng = random.Random(seed)
    meta = make_meta(rng, k=3, v=2, n_in=7, n_out=5, c_in=2, pad=0.3)
    meta1 = make_meta(rng, k=1, v=1, n_in=7, n_out=5, c_in=2, pad=0.3)
    for m in (meta, meta1):
        for dtype in DTYPES:
            x, w, b, gy = operands(m, 3, 2, dtype, rng)
            for mode in ("no_grad", "inference_mode"):
                ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
                case = f"{mode} {dtype} K={m.k}"

                def f(ctx=ctx, x=x, w=w, b=b, m=m):
                    with ctx:
                        return knn_conv(x.requires_grad_(), w, b, m)

                y = attempt(cat, case, f, valid=True)
                x.requires_grad_(False)
                if isinstance(y, torch.Tensor):
                    if y.requires_grad:
                        finding(cat, case, "y requires grad under no_grad", True)
                    judge(
                        cat, case, x, w, b, m, gy, (y, None, None, None), (False,) * 3, dtype=dtype
                    )
            # inference tensors as inputs, then a gradient of weight only
            with torch.inference_mode():
                xi = x.clone()
            case = f"inference-tensor x, grad of weight, {dtype} K={m.k}"
            got = attempt(
                cat,
                case,
                lambda x=x, w=w, b=b, m=m, xi=xi, gy=gy: run_op(
                    lambda a, c, d: knn_conv(a, c, d, m),
                    xi,
                    w.clone(),
                    b.clone(),
                    gy,
                    (False, True, True),
                ),
                valid=True,
            )
            if isinstance(got, tuple):
                judge(cat, case, x, w, b, m, gy, got, (False, True, True), dtype=dtype)
            # autocast: float32 operands under autocast to each 16-bit dtype
            for to in (torch.bfloat16, torch.float16):
                case = f"autocast cpu {to} with {dtype} operands K={m.k}"

                def f(x=x, w=w, b=b, m=m, to=to, gy=gy):
                    with torch.autocast("cpu", dtype=to):
                        return run_op(
                            lambda a, c, d: knn_conv(a, c, d, m),
                            x.clone(),
                            w.clone(),
                            b.clone(),
                            gy,
                            (True, True, True),
                        )

                got = attempt(cat, case, f, valid=True)
                if isinstance(got, tuple):
                    cast = to if dtype in (torch.float32, torch.float16, torch.bfloat16) else dtype
                    xc, wc, bc = (t.to(cast) for t in (x, w, b))
                    y, gx, gw, gb = got
                    if y.dtype != cast:
                        finding(cat, case, f"y {y.dtype}, expected {cast}", True)
                    else:  # the gradients come back in the inputs' dtype: judge in the coarser
                        coarse = dtype if UNIT_ROUNDOFF[dtype] > UNIT_ROUNDOFF[cast] else cast
                        judge(
                            cat,
                            case,
                            xc,
                            wc,
                            bc,
                            m,
                            gy.to(cast),
                            (y, None, None, None),
                            (False,) * 3,
                            dtype=cast,
                        )
                        judge(
                            cat,
                            case + " (gradients)",
                            xc,
                            wc,
                            bc,
                            m,
                            gy.to(cast),
                            (y.to(coarse), gx.to(coarse), gw.to(coarse), gb.to(coarse)),
                            (True,) * 3,
                            dtype=coarse,
                        )
                        for t, g in ((x, gx), (w, gw), (b, gb)):
                            if g.dtype != t.dtype:
                                finding(
                                    cat, case, f"grad dtype {g.dtype} for input {t.dtype}", True
                                )
    # deepcopy / pickle of metas and layers, then the same outputs
    for m in (meta, meta1):
        layer = KNNConv(2, 3, m)
        x = torch.randn(2, 2, m.n_in)
        y0 = layer(x)
        for how, clone in (
            ("deepcopy", copy.deepcopy),
            ("pickle", lambda o: pickle.loads(pickle.dumps(o))),
            ("torch.save", _torch_save_load),
        ):
            case = f"{how} layer K={m.k}"
            other = attempt(cat, case, lambda clone=clone, layer=layer: clone(layer), valid=True)
            if isinstance(other, KNNConv):
                y1 = other(x)
                if not torch.equal(y0, y1):
                    finding(cat, case, "copy gives another y", True)
            case = f"{how} meta K={m.k}"
            mc = attempt(cat, case, lambda clone=clone, m=m: clone(m), valid=True)
            if isinstance(mc, KNNMeta):
                w = torch.randn(3, 2 * m.v)
                if not torch.equal(knn_conv(x, w, None, m), knn_conv(x, w, None, mc)):
                    finding(cat, case, "copied meta gives another y", True)


def _torch_save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def compiled(seed: int) -> None:
    """torch.compile on a layer (two cases; slow)."""
    cat = "torch.compile"
    rng = random.Random(seed)
    for k, v in ((1, 1), (3, 2)):
        meta = make_meta(rng, k=k, v=v, n_in=7, n_out=5, c_in=2, pad=0.3)
        layer = KNNConv(2, 3, meta)
        x, w, b, gy = operands(meta, 3, 2, torch.float32, rng)
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.bias.copy_(b)
        f = torch.compile(layer, fullgraph=True)
        case = f"compile KNNConv K={k} V={v}"

        def run(f=f, x=x, gy=gy, layer=layer):
            xx = x.clone().requires_grad_()
            y = f(xx)
            gx, gw, gb = torch.autograd.grad(y, (xx, layer.weight, layer.bias), gy)
            return y.detach(), gx, gw, gb

        got = attempt(cat, case, run, valid=True)
        if isinstance(got, tuple):
            judge(cat, case, x, w, b, meta, gy, got, (True,) * 3, dtype=torch.float32)


def invalid(seed: int) -> None:
    """Invalid inputs to KNNMeta, knn_conv, KNNConv, grid metas and the harness: must raise."""
    cat = "invalid inputs"
    rng = random.Random(seed)
    meta = make_meta(rng, k=2, v=3, n_in=5, n_out=4, c_in=2, pad=0.3)
    x, w, b, _ = operands(meta, 3, 2, torch.float32, rng)
    knn, rf = meta.knn, meta.rf_index
    bad_metas = {
        "knn negative": lambda: KNNMeta.from_knn(knn - 10, rf, n_in=5, in_channels=2, v=3),
        "knn > n_in": lambda: KNNMeta.from_knn(knn + 10, rf, n_in=5, in_channels=2, v=3),
        "rf >= v": lambda: KNNMeta.from_knn(knn, rf + 3, n_in=5, in_channels=2, v=3),
        "rf negative": lambda: KNNMeta.from_knn(knn, rf - 5, n_in=5, in_channels=2, v=3),
        "rf transposed": lambda: KNNMeta.from_knn(knn, rf.t(), n_in=5, in_channels=2, v=3),
        "float knn": lambda: KNNMeta.from_knn(knn.float(), rf, n_in=5, in_channels=2, v=3),
        "bool rf": lambda: KNNMeta.from_knn(knn, rf.bool(), n_in=5, in_channels=2, v=3),
        "n_in 0": lambda: KNNMeta.from_knn(knn * 0, rf, n_in=0, in_channels=2, v=3),
        "n_in float": lambda: KNNMeta.from_knn(knn, rf, n_in=5.0, in_channels=2, v=3),
        "n_in bool": lambda: KNNMeta.from_knn(knn.clamp(max=1), rf, n_in=True, in_channels=2, v=3),
        "v 0": lambda: KNNMeta.from_knn(knn, rf * 0, n_in=5, in_channels=2, v=0),
        "in_channels 0": lambda: KNNMeta.from_knn(knn, rf, n_in=5, in_channels=0, v=3),
        "in_channels numpy float": lambda: KNNMeta.from_knn(
            knn, rf, n_in=5, in_channels=_np_float(2), v=3
        ),
        "K=0": lambda: KNNMeta.from_knn(knn[:0], rf[:, :0], n_in=5, in_channels=2, v=3),
        "Nout=0": lambda: KNNMeta.from_knn(knn[:, :0], rf[:0], n_in=5, in_channels=2, v=3),
        "knn 1-D": lambda: KNNMeta.from_knn(knn[0], rf[:, 0], n_in=5, in_channels=2, v=3),
        "knn 3-D": lambda: KNNMeta.from_knn(knn[None], rf[None], n_in=5, in_channels=2, v=3),
        "knn list": lambda: KNNMeta.from_knn(knn.tolist(), rf, n_in=5, in_channels=2, v=3),
        "uint8 knn wrap": lambda: KNNMeta.from_knn(
            torch.full((1, 2), 255, dtype=torch.uint8),
            torch.zeros(2, 1, dtype=torch.int64),
            n_in=4,
            in_channels=1,
            v=1,
        ),
        "local_rf two ones": lambda: KNNMeta.from_local_rf(
            knn, torch.ones(4, 2, 3), n_in=5, in_channels=2
        ),
        "local_rf 0.5": lambda: KNNMeta.from_local_rf(
            knn, torch.full((4, 2, 3), 0.5), n_in=5, in_channels=2
        ),
        "local_rf nan": lambda: KNNMeta.from_local_rf(
            knn, meta.local_rf().masked_fill(meta.local_rf() == 0, math.nan), n_in=5, in_channels=2
        ),
        "local_rf shape mismatch": lambda: KNNMeta.from_local_rf(
            knn, meta.local_rf()[:3], n_in=5, in_channels=2
        ),
        "grid kernel > image": lambda: fovi_ref.grid.conv2d_grid_meta(
            2, 2, kernel_size=3, in_channels=1
        ),
        "grid stride 0": lambda: fovi_ref.grid.conv2d_grid_meta(
            4, 4, kernel_size=1, stride=0, in_channels=1
        ),
        "grid negative padding": lambda: fovi_ref.grid.conv2d_grid_meta(
            4, 4, kernel_size=3, padding=-1, in_channels=1
        ),
        "grid in_channels 0": lambda: fovi_ref.grid.conv2d_grid_meta(
            4, 4, kernel_size=3, in_channels=0
        ),
        "grid float height": lambda: fovi_ref.grid.conv2d_grid_meta(
            4.0, 4, kernel_size=1, in_channels=1
        ),
    }
    for name, fn in bad_metas.items():
        attempt(cat, f"KNNMeta: {name}", fn, valid=False)
    bad_calls = {
        "x int": lambda: knn_conv(x.long(), w, b, meta),
        "x complex": lambda: knn_conv(x.to(torch.complex64), w.to(torch.complex64), None, meta),
        "x 2-D": lambda: knn_conv(x[0], w, b, meta),
        "x 4-D": lambda: knn_conv(x[None], w, b, meta),
        "x wrong Cin": lambda: knn_conv(x[:, :1], w, b, meta),
        "x wrong Nin": lambda: knn_conv(x[:, :, :4], w, b, meta),
        "x Nin+1": lambda: knn_conv(torch.cat([x, x[:, :, :1]], 2), w, b, meta),
        "w transposed shape": lambda: knn_conv(x, w.t(), b, meta),
        "w 1-D": lambda: knn_conv(x, w[0], b, meta),
        "w 3-D": lambda: knn_conv(x, w.reshape(3, 2, 3), b, meta),
        "w 0 rows": lambda: knn_conv(x, w[:0], None, meta),
        "bias wrong length": lambda: knn_conv(x, w, b[:2], meta),
        "bias 2-D": lambda: knn_conv(x, w, b[None], meta),
        "bias 0-D": lambda: knn_conv(x, w, b[0], meta),
        "bias float": lambda: knn_conv(x, w, 0.5, meta),
        "w float64 x float32": lambda: knn_conv(x, w.double(), b, meta),
        "bias float16": lambda: knn_conv(x, w, b.half(), meta),
        "meta None": lambda: knn_conv(x, w, b, None),
        "meta a layer": lambda: knn_conv(x, w, b, KNNConv(2, 3, meta)),
        "backend unknown": lambda: knn_conv(x, w, b, meta, backend="nope"),
        "backend gather_gemm on K=2": lambda: knn_conv(x, w, b, meta, backend="gather_gemm"),
        "backend int": lambda: knn_conv(x, w, b, meta, backend=3),
        "x meta device": lambda: knn_conv(x.to("meta"), w.to("meta"), b.to("meta"), meta),
        "x sparse": lambda: knn_conv(x.to_sparse(), w, b, meta),
        "x numpy": lambda: knn_conv(x.numpy(), w, b, meta),
        "positional backend": lambda: knn_conv(x, w, b, meta, "general"),
    }
    for name, fn in bad_calls.items():
        attempt(cat, f"knn_conv: {name}", fn, valid=False)
    bad_layers = {
        "in_channels mismatch": lambda: KNNConv(3, 3, meta),
        "out_channels 0": lambda: KNNConv(2, 0, meta),
        "out_channels float": lambda: KNNConv(2, 3.0, meta),
        "bias='yes'": lambda: KNNConv(2, 3, meta, bias="yes"),
        "backend unknown": lambda: KNNConv(2, 3, meta, backend="nope"),
        "x wrong dtype for layer": lambda: KNNConv(2, 3, meta)(x.double()),
        "x wrong Nin": lambda: KNNConv(2, 3, meta)(x[:, :, :3]),
        "layer.half() then float x": lambda: KNNConv(2, 3, meta).half()(x),
        "meta with other n_in": lambda: setattr(
            KNNConv(2, 3, meta), "meta", make_meta(rng, k=2, v=3, n_in=6, c_in=2)
        ),
        "weight replaced by wrong shape": lambda: _replace_weight(meta, x),
    }
    for name, fn in bad_layers.items():
        attempt(cat, f"KNNConv: {name}", fn, valid=False)
    from fovi_ref.check.check_ops import check_ops

    bad_harness = {
        "check_ops unknown backend": lambda: check_ops("nope", graphs=["random"]),
        "check_ops unknown check": lambda: check_ops(
            "general", graphs=["random"], checks=("oracle", "bogus")
        ),
        "check_ops graph name bogus": lambda: check_ops("general", graphs=["bogus"]),
        "check_ops dtype int64": lambda: check_ops(
            "general", graphs=["random"], dtypes=(torch.int64,), checks=("oracle",)
        ),
        "check_ops batch -1": lambda: check_ops("general", graphs=["random"], batch=-1),
        "check_ops all_padding bogus": lambda: check_ops(
            "general", graphs=["random"], all_padding="nope", checks=("oracle",)
        ),
        "check_ops dtypes a dtype": lambda: check_ops(
            "general", graphs=["random"], dtypes=torch.float64, checks=("oracle",)
        ),
        "check_ops checks a str": lambda: check_ops(
            "general", graphs=["random"], checks="oracle", dtypes=(torch.float64,)
        ),
        "check_ops batch 2.5": lambda: check_ops(
            "general", graphs=["random"], batch=2.5, checks=("oracle",), dtypes=(torch.float64,)
        ),
    }
    for name, fn in bad_harness.items():
        attempt(cat, f"harness: {name}", fn, valid=False)
    one = dict(checks=("oracle",), dtypes=(torch.float64,))
    report = attempt(
        cat,
        "harness: check_ops graphs='random' (one name)",
        lambda: check_ops("general", graphs="random", **one),
        valid=True,
    )
    if hasattr(report, "rows") and not (report.ok and report.rows):
        finding(cat, "harness: check_ops graphs='random'", "no rows or not ok", True)


def _np_float(v):
    import numpy as np

    return np.float64(v)


def _replace_weight(meta, x):
    layer = KNNConv(2, 3, meta)
    layer.weight = torch.nn.Parameter(torch.randn(3, 5))
    return layer(x)


def verify_api(seed: int) -> None:
    """fovi_ref.check.verify.verify_meta on odd graphs, and the CLI's argument edges."""
    from fovi_ref.check.cli import main
    from fovi_ref.check.verify import verify_meta

    cat = "verify"
    rng = random.Random(seed)
    for shape in (
        dict(k=1, v=1, n_in=1, n_out=1, c_in=1),
        dict(k=3, v=2, pad=1.0),
        dict(k=4, v=1, dup=True),
    ):
        meta = make_meta(rng, **shape)
        case = f"verify_meta {shape}"
        checks = attempt(
            cat, case, lambda meta=meta: verify_meta("odd", meta, 2, batch=2), valid=True
        )
        if isinstance(checks, list):
            bad = [str(c.verdict) for c in checks if not c.verdict.ok]
            if bad:
                finding(cat, case, f"FAIL: {bad[0][:160]}", False)
            if not checks:
                finding(cat, case, "no checks", True)
    cat = "CLI"
    one = ["--layers", "res18_ds2", "--out", "/tmp/fovi_ref_adversarial"]
    argv_bad = [
        ["verify", "--layers"],
        ["verify", "--layers", "nope"],
        ["verify", "--batch", "0"],
        ["verify", "--batch", "x"],
        ["verify", "--dtypes", "int8"],
        ["verify", "--dtypes"],
        ["verify", *one, "--repeats", "3"],
        ["verify", *one, "--bogus"],
        ["nope"],
        ["verify", *one, "--device", "cuda:7"],
        ["verify", *one, "--device", "meta"],
        ["verify", *one, "--batch", "1e3"],
        ["verify", *one, "--batch", "-0"],
        ["verify", "--layers", "res18_ds2", "--out", "/dev/null/x"],
        ["verify", *one, "--fovi-model", "nosuchmodule:f"],
        ["verify", *one, "--fovi-model", "os:getcwd"],
    ]
    for argv in argv_bad:
        TRIED[cat] += 1
        err, out = io.StringIO(), io.StringIO()
        code = None
        try:
            with _redirect(out, err):
                code = main(argv)
        except SystemExit as e:
            code = e.code
        except Exception as e:  # noqa: BLE001
            finding(cat, " ".join(argv), f"traceback {type(e).__name__}: {str(e)[:120]}", False)
            continue
        if code in (0, None):
            finding(cat, " ".join(argv), f"exit {code}: accepted; {out.getvalue()[-200:]!r}", True)


class _redirect:
    def __init__(self, out, err):
        self.out, self.err = out, err

    def __enter__(self):
        self.saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self.out, self.err

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self.saved


CATEGORIES = {
    "invalid": invalid,
    "edge": edge_shapes,
    "magnitudes": magnitudes,
    "modes": modes,
    "compile": compiled,
    "verify": verify_api,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=2000, help="random graphs to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first random graph (to rerun one)")
    parser.add_argument(
        "--only", nargs="*", default=None, help=f"categories: random {' '.join(CATEGORIES)}"
    )
    args = parser.parse_args(argv)
    only = set(args.only) if args.only else {"random", *CATEGORIES}
    for name, fn in CATEGORIES.items():
        if name in only:
            fn(args.seed)
    if "random" in only:
        fuzz(args.graphs, args.seed, args.start)
    per = Counter(f["category"] for f in FINDINGS)
    silent = Counter(f["category"] for f in FINDINGS if f["silent"])
    print(f"{'category':<18}{'tried':>7}{'findings':>10}{'silent':>8}")
    for cat in TRIED:
        print(f"{cat:<18}{TRIED[cat]:>7}{per[cat]:>10}{silent[cat]:>8}")
    for f in FINDINGS:
        kind = "SILENT" if f["silent"] else "loud"
        print(f"[{kind}] {f['category']}: {f['case']}\n    -> {f['result']}")
    return 1 if any(f["silent"] for f in FINDINGS) else 0


if __name__ == "__main__":
    sys.exit(main())
