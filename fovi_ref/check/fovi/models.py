"""fovi 2.4.0 models with fovi_ref layers swapped in by the user's adapter
(:func:`fovi_ref.interop.fovi.fovi_ref_convs`): whole-network and training comparisons against
fovi's own layers."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fovi_ref.check.fovi.backends import fovi_backend
from fovi_ref.check.fovi.load import fovi_conv_layers
from fovi_ref.check.tolerances import relative_error
from fovi_ref.interop.fovi import fovi_ref_convs

__all__ = [
    "ModelComparison",
    "TrainingComparison",
    "compare_model",
    "compare_training",
    "random_batches",
]


# --------------------------------------------------------------------- whole-network checks
@dataclass
class ModelComparison:
    """One forward and backward of a model both ways: fovi's path against fovi_ref's.

    ``*_errors`` are relative errors (``max |a - b| / max |b|``, fovi's value as ``b``);
    ``*_identical`` are bit-for-bit equalities; ``layer_strides`` holds each KNN conv's output
    strides ``(fovi's, fovi_ref's)``.
    """

    layer_errors: dict[str, float]
    layer_identical: dict[str, bool]
    layer_strides: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    logits_error: float
    logits_identical: bool
    grad_errors: dict[str, float]
    grads_identical: dict[str, bool]

    @property
    def identical(self) -> bool:
        """Logits and every parameter gradient equal bit for bit."""
        return self.logits_identical and all(self.grads_identical.values())

    def summary(self) -> str:
        worst_layer = max(self.layer_errors.values(), default=0.0)
        worst_grad = max(self.grad_errors.values(), default=0.0)
        logits = "identical" if self.logits_identical else "differ"
        layers, grads = self.layer_identical.values(), self.grads_identical.values()
        return (
            f"logits {logits} (err {self.logits_error:.1e}); KNN conv outputs identical "
            f"{sum(layers)}/{len(layers)} (worst err {worst_layer:.1e}); parameter grads "
            f"identical {sum(grads)}/{len(grads)} (worst err {worst_grad:.1e})"
        )


def _run_model(model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn: Callable):
    """Logits, parameter gradients and each KNN conv's output of one step (model in train mode)."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, rec in fovi_conv_layers(model).items():

        def save(module, args, out, name=name):
            outputs[name] = out.detach().clone(memory_format=torch.preserve_format)

        hooks.append(rec.layer.register_forward_hook(save))
    try:
        model.train()
        logits = model(x)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss_fn(logits, target), params, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return logits.detach(), dict(zip(names, grads, strict=True)), outputs


def _error_and_identity(ours: torch.Tensor | None, theirs: torch.Tensor | None):
    if ours is None or theirs is None:
        return (0.0, True) if ours is theirs else (float("inf"), False)
    return relative_error(ours, theirs), torch.equal(ours, theirs)


def compare_model(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    backend: str | None = "einsum_baseline",
    fovi_override: str | None = "baseline",
    loss_fn: Callable = F.cross_entropy,
) -> ModelComparison:
    """Run ``model`` (a fovi model) once through fovi (``FOVI_KNN_BACKEND=fovi_override``;
    ``None``: fovi's dispatcher) and once with every KNN conv swapped to fovi_ref's ``backend``
    (:func:`fovi_ref_convs`), each on its own deep copy (``model``, its BatchNorm statistics
    included, is left as it was), in train mode; compare outputs and gradients."""
    fovi_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    with fovi_backend(fovi_override):
        logits_f, grads_f, outs_f = _run_model(fovi_model, x, target, loss_fn)
    with fovi_ref_convs(ref_model, backend=backend):
        logits_r, grads_r, outs_r = _run_model(ref_model, x, target, loss_fn)
    layers = {n: _error_and_identity(outs_r[n], outs_f[n]) for n in outs_f}
    grads = {n: _error_and_identity(grads_r[n], grads_f[n]) for n in grads_f}
    logits_error, logits_identical = _error_and_identity(logits_r, logits_f)
    return ModelComparison(
        layer_errors={n: e for n, (e, _) in layers.items()},
        layer_identical={n: same for n, (_, same) in layers.items()},
        layer_strides={n: (outs_f[n].stride(), outs_r[n].stride()) for n in outs_f},
        logits_error=logits_error,
        logits_identical=logits_identical,
        grad_errors={n: e for n, (e, _) in grads.items()},
        grads_identical={n: same for n, (_, same) in grads.items()},
    )


@dataclass
class TrainingComparison:
    """Losses of the same SGD run through fovi and through fovi_ref."""

    fovi_losses: list[float] = field(default_factory=list)
    fovi_ref_losses: list[float] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.fovi_losses == self.fovi_ref_losses

    @property
    def max_difference(self) -> float:
        pairs = zip(self.fovi_losses, self.fovi_ref_losses, strict=True)
        return max((abs(a - b) for a, b in pairs), default=0.0)


def random_batches(
    model: nn.Module, steps: int, *, batch: int = 2, seed: int = 0, dtype: torch.dtype | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` random ``(x [B, Cin, Nin], labels [B])`` for a fovi classifier: the input size
    is read from its first KNN conv, the class count from its ``fc`` head."""
    first = next(iter(fovi_conv_layers(model).values()))
    dtype = first.layer.weight.dtype if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    shape = (batch, first.in_channels, first.meta.n_in)
    device = first.layer.weight.device
    return [
        (
            torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype),
            torch.randint(0, model.fc.out_features, (batch,), generator=g).to(device),
        )
        for _ in range(steps)
    ]


def compare_training(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 0.01,
    backend: str | None = "einsum_baseline",
    fovi_override: str | None = "baseline",
    loss_fn: Callable = F.cross_entropy,
) -> TrainingComparison:
    """One SGD step per batch on two deep copies of ``model``: one through fovi, one with its
    KNN convs swapped to fovi_ref's ``backend``; the loss of every step, both ways."""
    result = TrainingComparison()
    for losses, use_fovi_ref in ((result.fovi_losses, False), (result.fovi_ref_losses, True)):
        net = copy.deepcopy(model).train()
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        swap = fovi_ref_convs(net, backend=backend) if use_fovi_ref else _nothing()
        with swap, fovi_backend(fovi_override):
            for x, target in batches:
                loss = loss_fn(net(x), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    return result


@contextmanager
def _nothing() -> Iterator[None]:
    yield
