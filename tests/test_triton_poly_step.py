"""The fused polynomial step B = b A + c A A for symmetric A (half the tiles)."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)
from triton_env import DTYPES, PRODUCT_TOLERANCE, SMALL_TILES, max_asymmetry, relative, symmetric

import pytest
import torch

from spectral_ops.triton_kernels.poly_step import poly_step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 37), (3, 29, 29), (2, 2, 18, 18)], ids=str)
def test_matches_torch_and_is_exactly_symmetric(shape, dtype):
    A = symmetric(shape, dtype)
    b, c = -4.775, 2.0315
    B = poly_step(A, b, c, cfg=SMALL_TILES)
    A64 = A.double()
    assert B.dtype == torch.float32
    assert relative(B, b * A64 + c * A64 @ A64) < PRODUCT_TOLERANCE
    assert max_asymmetry(B) == 0


def test_small_integers_and_power_of_two_coefficients_are_bit_exact():
    A = symmetric((3, 37, 37), integers=True)
    assert torch.equal(poly_step(A, 0.5, -0.125, cfg=SMALL_TILES), 0.5 * A - 0.125 * (A @ A))


def test_per_matrix_coefficients_and_an_output_that_is_the_input():
    A = symmetric((2, 33, 33))
    b, c = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])
    A64 = A.double()
    expected = b[:, None, None] * A64 + c[:, None, None] * (A64 @ A64)
    poly_step(A, b, c, out=A, cfg=SMALL_TILES)  # A is read across tiles: a workspace is used
    assert relative(A, expected) < PRODUCT_TOLERANCE
