"""The float64 oracle: the KNN convolution written straight from its formula.

    y[b, o, n] = bias[o] + sum_{c, k} x[b, c, knn[k, n]] * weight[o, c*V + rf_index[n, k]]

A loop over the neighbour slot ``k`` in float64, sharing no code with any backend, so it can judge
them all; it builds every node's own weight matrix, which no fast backend may do.

**What the formula means at its edges** (every backend is judged by these readings):

- *Padding.* The sum runs over the terms that exist: one per (channel, *real* neighbour).
  A padding neighbour (``knn[k, n] == n_in``) has no term at all, not a term ``0 * weight``:
  it adds an exact zero even where the weight of its cell is inf or nan, and sends no gradient
  anywhere.
- *Non-finite values* follow IEEE arithmetic on the terms that exist: an inf in ``x`` reaches
  exactly the outputs of the nodes that read it (``inf * 0`` is nan there, since a real
  neighbour times a zero weight *is* a term); nothing else sees it.
- *All-padding nodes* (every neighbour is padding) have an empty sum, so ``y`` there is the bias:
  ``all_padding="bias"``, the default. fovi 2.4.0's ``KNNConvLayer.forward`` instead zeroes those
  outputs (``_mask_invalid_outputs``); ``all_padding="zero"`` follows it: ``y`` is exactly 0
  there whatever the bias, and the bias gradient leaves those nodes out.
"""

from __future__ import annotations

from typing import Literal

import torch

from fovi_ref.meta import KNNMeta

__all__ = ["AllPadding", "check_shapes", "knn_conv_reference"]

AllPadding = Literal["bias", "zero"]


def check_shapes(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    grad_y: torch.Tensor | None = None,
) -> None:
    """``TypeError``/``ValueError`` naming the operand whose shape does not fit ``meta``:
    ``x [B, Cin, Nin]``, ``weight [Cout, Cin*V]``, ``bias [Cout]``, ``grad_y [B, Cout, Nout]``."""
    if not isinstance(meta, KNNMeta):
        raise TypeError(f"meta must be a fovi_ref.KNNMeta, got {type(meta).__name__}")
    named = {"x": x, "weight": weight, "bias": bias, "grad_y": grad_y}
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    batch = x.shape[0] if x.dim() == 3 else None
    c_out = weight.shape[0] if weight.dim() == 2 else None
    want = {
        "x": (batch, meta.in_channels, meta.n_in),
        "weight": (c_out, meta.in_channels * meta.v),
        "bias": (c_out,),
        "grad_y": (batch, c_out, meta.n_out),
    }
    labels = {
        "x": "[B, Cin, Nin]",
        "weight": "[Cout, Cin*V]",
        "bias": "[Cout]",
        "grad_y": "[B, Cout, Nout]",
    }
    for name, t in named.items():
        if t is not None and tuple(t.shape) != want[name]:
            sizes = ", ".join("B" if s is None else str(s) for s in want[name])
            raise ValueError(
                f"{name} must be {labels[name]} = [{sizes}] for this meta and "
                f"these operands, got {tuple(t.shape)}"
            )


def knn_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: KNNMeta,
    *,
    all_padding: AllPadding = "bias",
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Naive KNN convolution ``y [B, Cout, Nout]`` of ``x [B, Cin, Nin]``, ``weight
    [Cout, Cin*V]`` (column ``c*V + cell``) and ``bias [Cout]`` or ``None``, on ``x``'s device.

    ``all_padding``: what an all-padding node outputs, ``"bias"`` (the formula's empty sum) or
    ``"zero"`` (fovi 2.4.0's layer). ``compute_dtype``: float64 is the oracle; float32 makes the
    same loop an ordinary float32 implementation (for the tests of the tolerance rule). Autograd
    through it gives the reference gradients, with the same readings of padding and non-finite
    values (no term, so no gradient, for a padding neighbour).
    """
    if all_padding not in ("bias", "zero"):
        raise ValueError(f"all_padding must be 'bias' or 'zero', got {all_padding!r}")
    if compute_dtype not in (torch.float64, torch.float32):
        raise ValueError(f"compute_dtype must be float64 or float32, got {compute_dtype}")
    check_shapes(x, weight, bias, meta)
    x = x.to(compute_dtype)
    weight = weight.to(compute_dtype)
    batch, c_in, _ = x.shape
    c_out = weight.shape[0]
    w = weight.reshape(c_out, c_in, meta.v)  # [Cout, Cin, V]: w[o, c, cell] = weight[o, c*V + cell]
    y = torch.zeros(batch, c_out, meta.n_out, dtype=compute_dtype, device=x.device)
    # One neighbour slot k at a time, all output nodes n at once: the sum over k in the formula.
    for k in range(meta.k):
        real = meta.knn[k] != meta.n_in  # [Nout] False for padding neighbours
        neighbour = meta.knn[k].clamp(max=meta.n_in - 1)  # [Nout] any valid index; masked below
        # Padding is masked on both sides of the product: the gathered feature (so no gradient
        # reaches the clamped input) and the product (so an inf weight meets no padding).
        x_k = x.index_select(2, neighbour)  # [B, Cin, Nout] x[b, c, knn[k, n]]
        x_k = torch.where(real, x_k, 0.0)
        w_k = w.index_select(2, meta.rf_index[:, k])  # [Cout, Cin, Nout] w[o, c, rf_index[n, k]]
        y_k = torch.einsum("bcn,ocn->bon", x_k, w_k)  # [B, Cout, Nout] sum over c
        y = y + torch.where(real, y_k, 0.0)
    if bias is not None:
        y = y + bias.to(compute_dtype)[None, :, None]
    if all_padding == "zero":
        empty = meta.pad_mask.all(dim=0)  # [Nout] nodes whose neighbours are all padding
        y = torch.where(empty, 0.0, y)  # exactly 0, and no gradient to the bias from there
    return y
