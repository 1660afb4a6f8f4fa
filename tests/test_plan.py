"""spectral_ops.plan: the one definition of precision=None, and the operand dtype each precision implies."""

import pytest
import torch

import spectral_ops as so
from spectral_ops import plan


@pytest.fixture
def float32_matmul_precision():
    """Set torch's float32 matmul precision for one test, and restore it afterwards."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype, expected", [
    (torch.float64, "fp64"), (torch.bfloat16, "bf16"), (torch.float16, "fp16"),
])
def test_none_follows_the_weight_dtype_whatever_torch_says(float32_matmul_precision, dtype, expected):
    for setting in ("highest", "high", "medium"):
        float32_matmul_precision(setting)
        assert plan.resolve_precision(None, dtype) == expected


@pytest.mark.parametrize("setting, expected", [("highest", "fp32"), ("high", "tf32"), ("medium", "bf16")])
def test_none_follows_torch_float32_matmul_precision_for_float32(float32_matmul_precision, setting, expected):
    float32_matmul_precision(setting)
    assert plan.resolve_precision(None, torch.float32) == expected


def test_an_explicit_precision_wins():
    for precision in plan.PRECISIONS:
        assert plan.resolve_precision(precision, torch.float32) == precision


def test_medium_runs_a_float32_weight_in_bf16(float32_matmul_precision):
    W = torch.randn(24, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    float32_matmul_precision("medium")
    medium = so.spectral_power(W, 2, method="gram")
    float32_matmul_precision("highest")
    assert torch.equal(medium, so.spectral_power(W, 2, method="gram", precision="bf16"))
    assert not torch.equal(medium, so.spectral_power(W, 2, method="gram"))


def test_the_math_dtype_is_fp64_only_for_fp64():
    assert plan.math_dtype(torch.bfloat16, "bf16") == torch.float32
    assert plan.math_dtype(torch.float32, "fp64") == torch.float64
    assert plan.math_dtype(torch.float64, "bf16") == torch.float64


def test_an_unknown_precision_is_refused_before_anything_is_written():
    W = torch.randn(8, 6)
    before = W.clone()
    with pytest.raises(ValueError, match=r"precision must be one of \[.bf16., .fp16., .fp32., .fp64., .tf32.\], got .int8."):
        so.spectral_decay_(W, 2, 0.1, 0.1, precision="int8")
    assert torch.equal(W, before)
