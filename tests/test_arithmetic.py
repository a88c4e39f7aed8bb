"""The arithmetic a verdict is reached under: read in one place, set for judging, restored."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

from fovi_ref.check.arithmetic import arithmetic_settings, describe, verdict_arithmetic

CUBLAS = torch.backends.cuda.matmul


@pytest.mark.parametrize("device", DEVICES)
def test_settings_name_the_device_and_every_switch(device):
    settings = arithmetic_settings(device)
    assert settings["device"] == device and settings["torch"] == torch.__version__
    assert settings["matmul_precision"] == torch.get_float32_matmul_precision()
    assert (
        settings["bf16_reduced_precision_reduction"]
        == CUBLAS.allow_bf16_reduced_precision_reduction
    )
    assert settings["deterministic"] == torch.are_deterministic_algorithms_enabled()
    if device == "cuda":
        assert settings["device_name"] == torch.cuda.get_device_name()
    line = describe(settings)
    assert line.startswith(f"arithmetic: {device} (") and "matmul precision" in line
    assert all(len(part) <= 100 for part in line.splitlines())  # as every printed table


def test_verdict_arithmetic_turns_off_what_breaks_the_rule_and_restores_it():
    saved = arithmetic_settings()
    torch.set_float32_matmul_precision("high")  # TF32 allowed: what the rule cannot judge
    CUBLAS.allow_fp16_reduced_precision_reduction = True
    try:
        with verdict_arithmetic():
            inside = arithmetic_settings()
            assert inside["matmul_precision"] == "highest"
            assert inside["cudnn_allow_tf32"] is False
            assert inside["fp16_reduced_precision_reduction"] is False
            assert inside["bf16_reduced_precision_reduction"] is False
        assert torch.get_float32_matmul_precision() == "high"
        assert CUBLAS.allow_fp16_reduced_precision_reduction is True
        with pytest.raises(RuntimeError), verdict_arithmetic():  # restored on an error too
            raise RuntimeError("a failing battery")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(saved["matmul_precision"])
        CUBLAS.allow_fp16_reduced_precision_reduction = saved["fp16_reduced_precision_reduction"]
    assert arithmetic_settings() == saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_cuda_16bit_gemm_meets_the_rule_under_verdict_arithmetic(dtype):
    """A long, cancelling 16-bit GEMM on the GPU: one rounding of the float32-accumulated
    result, as tolerances.py's step 2 assumes, once the split-K reductions are off."""
    from fovi_ref.check.tolerances import UNIT_ROUNDOFF, gamma

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 8192, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(8192, 64, generator=g, dtype=torch.float64).to(dtype)
    ref = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + gamma(8192, UNIT_ROUNDOFF[torch.float32]) * magnitude
    with verdict_arithmetic():
        got = (a.cuda() @ b.cuda()).double().cpu()
    assert bool(((got - ref).abs() <= bound * (1 + 1e-6)).all())
