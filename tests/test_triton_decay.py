"""The decay epilogue W <- alpha W + gamma Z + beta P Z (or Z P), written into W whatever aliases it."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import pytest
import torch
from triton_env import DTYPES, SMALL_TILES, randn, relative, small_integers, symmetric

from spectral_ops.triton_kernels.decay import decay_product_


@pytest.mark.parametrize("dtype", DTYPES)
def test_right_multiplied_decay_of_a_tall_weight_with_itself_as_operand(dtype):
    # W <- W - s W P: Z is W, read across row tiles while W is written (odd p, or W P_top).
    W = randn((2, 45, 30), dtype)
    P = symmetric((2, 30, 30), seed=1)
    expected = W.double() - 0.1 * (W.double() @ P.double())
    assert decay_product_(W, P, alpha=1.0, beta=-0.1, side="right", cfg=SMALL_TILES) is W
    assert relative(W, expected) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_left_multiplied_decay_with_a_separate_operand_and_per_matrix_scales():
    W, Q = randn((3, 21, 50)), randn((3, 21, 50), seed=1)
    M = symmetric((3, 21, 21), seed=2)
    alpha, beta = torch.tensor([0.9, 1.0, 0.99]), torch.tensor([-0.1, -0.2, 0.0])
    expected = alpha[:, None, None] * W.double() + 0.5 * Q.double() + beta[:, None, None] * (M.double() @ Q.double())
    decay_product_(W, M, Q, alpha=alpha, beta=beta, gamma=0.5, cfg=SMALL_TILES)
    assert relative(W, expected) < 1e-6


def test_small_integers_and_power_of_two_scales_are_bit_exact():
    W, P = small_integers((2, 40, 24)), symmetric((2, 24, 24), integers=True)
    expected = 0.75 * W - 0.125 * (W @ P)
    decay_product_(W, P, alpha=0.75, beta=-0.125, side="right", cfg=SMALL_TILES)
    assert torch.equal(W, expected)


def test_weights_without_a_single_batch_stride_are_written_back():
    base = randn((20, 3, 2, 30))
    W = base.permute(1, 2, 0, 3)  # (3, 2, 20, 30): the two batch dims cannot be merged into one
    P = symmetric((3, 2, 20, 20), seed=1)
    expected = W.double() - 0.25 * (P.double() @ W.double())
    decay_product_(W, P, beta=-0.25, cfg=SMALL_TILES)
    assert relative(base.permute(1, 2, 0, 3), expected) < 1e-6


def test_elementwise_decay_and_side_check():
    W = randn((2, 17, 33))
    expected = W * 0.5
    decay_product_(W, None, alpha=0.5, cfg=SMALL_TILES)
    assert torch.equal(W, expected)
    with pytest.raises(ValueError, match="side"):
        decay_product_(W, None, side="top")
