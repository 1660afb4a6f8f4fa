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


# ----- Gram-space iteration (even p >= 2)

from spectral_ops import reference  # noqa: E402
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error  # noqa: E402

# Gram space iterates on G, whose condition number is kappa^2. In fp32 at kappa = 1e3 its rounding
# costs about 4x the rectangle's (measured 8e-6 on 2048x512 against 2e-6; the bound is 1e-5,
# with 2x margin for these small shapes). In fp64 the error is the iteration's own, the same as the
# rectangle's: modes below Polar Express's design bound (1e-3 ||W||_F) are not fully converged, which
# costs 1.2e-11 on the square 40x40 at p = 2 on both.
GRAM_SPACE_TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [2, 4, 6])
@pytest.mark.parametrize("shape", [(96, 24), (24, 96), (40, 40), (3, 64, 16), (17, 5)],
                         ids=["tall", "wide", "square", "batched", "odd"])
def test_gram_space_powers_match_the_svd(shape, p, dtype):
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), 1e3), dtype, seed=p)
    result = so.spectral_power(W, p, iteration="gram_space")
    assert relative_error(result, reference.spectral_power_svd(W.double(), p)) < GRAM_SPACE_TOLERANCE[dtype]


def test_gram_space_decay_matches_the_svd():
    W = matrix_with_spectrum((96, 24), log_spaced_spectrum(24, 1e3), torch.float32)
    expected = reference.spectral_decay_svd(W.double(), 2, 0.05, 0.2)
    so.spectral_decay_(W, 2, 0.05, 0.2, iteration="gram_space")
    assert relative_error(W, expected) < GRAM_SPACE_TOLERANCE[torch.float32]


def test_gram_space_s2_of_a_4_to_1_weight_costs_76_r_cubed_as_torch_counts():
    """torch counts every product in full: the Gram 2 r^2 N = 8 r^3, four r x r products per step
    (Z Y, M^2, Y T, T Z: 8 r^3) but two in the first (Z = I: 4 r^3), the final Y X 8 r^3:
    8 + 7 * 8 + 4 + 8 = 76 r^3, against about 152 r^3 on the rectangle (the issue's goal: <= 100)."""
    # Imported here: it imports triton, which must not happen before the Triton tests set the
    # interpreter up (tests/triton_env.py), and pytest collects this module first.
    from torch.utils.flop_counter import FlopCounterMode

    r = 64
    W = torch.randn(4 * r, r)
    with FlopCounterMode(display=False) as gram_space:
        so.spectral_power(W, 2, iteration="gram_space", precision="fp32")
    with FlopCounterMode(display=False) as rectangle:
        so.spectral_power(W, 2, method="gram", precision="fp32")
    assert gram_space.get_total_flops() == 76 * r**3
    assert rectangle.get_total_flops() > 150 * r**3


def test_the_flop_model_counts_gram_space_with_symmetric_products_at_half():
    """bench/flops.py against the count above: the Gram and the 8 M^2 at half cost (4 + 8 r^3), the
    22 coupled r x r products (44 r^3) and the final product in full (8 r^3)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("flops", Path(__file__).parents[1] / "bench" / "flops.py")
    flops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flops)
    r = 64
    assert flops.spectral_power_flops(r, 4 * r, 2, iteration="gram_space") == (4 + 8 + 44 + 8) * r**3
    # The rectangle: the Gram 4, then 7 A (4 each), 8 A^2 (1), 8 B X (8), the final product 8: 112 r^3.
    assert flops.spectral_power_flops(r, 4 * r, 2) == 112 * r**3


@pytest.mark.parametrize("p, shape, precision, expected", [
    (2, (2048, 512), "fp32", "gram_space"),
    (4, (512, 2048), "fp64", "gram_space"),
    (2, (512, 512), "fp32", "rectangle"),   # square: the rectangle's steps cost less
    (2, (1024, 512), "fp32", "rectangle"),  # 2:1: they cost about the same
    (2, (2048, 512), "bf16", "rectangle"),  # NaN in Gram space at kappa >= 1e3
    (0, (2048, 512), "fp32", "rectangle"),  # the polar factor needs the small modes
    (3, (2048, 512), "fp32", "rectangle"),  # odd: no iteration
])
def test_auto_takes_gram_space_where_it_is_cheaper_and_accurate(p, shape, precision, expected):
    assert plan.resolve_iteration("auto", p, shape, precision, 8) == expected


def test_the_gram_space_polar_factor_loses_the_small_modes():
    """p = 0 in Gram space is G^(-1/2) W: fine at kappa = 10, but at kappa = 1e3 the squared condition
    number costs about 20x the rectangle's error (measured 1.5e-3 against 6e-5 on 256x64), which is
    why "auto" never takes it."""
    def errors(kappa):
        W = matrix_with_spectrum((256, 64), log_spaced_spectrum(64, kappa), torch.float32)
        expected = reference.spectral_power_svd(W.double(), 0)
        return [relative_error(so.spectral_power(W, 0, iteration=iteration, precision="fp32"), expected)
                for iteration in ("gram_space", "rectangle")]

    assert max(errors(10.0)) < GRAM_SPACE_TOLERANCE[torch.float32]
    gram_space, rectangle = errors(1e3)
    assert gram_space > 10 * rectangle and gram_space > 1e-4
    with pytest.raises(ValueError, match="iteration must be one of"):
        so.spectral_decay_(torch.randn(8, 4), 2, 0.1, 0.1, iteration="gram")
