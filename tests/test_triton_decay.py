"""The decay write W <- keep W + step D, in place whatever W's strides."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)
from triton_env import DTYPES, SMALL_TILES, randn, relative, small_integers

import pytest
import torch

from spectral_ops.triton_kernels.decay import decay_epilogue_


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_write_with_per_matrix_scales(dtype):
    W, D = randn((3, 21, 50), dtype), randn((3, 21, 50), seed=1)
    keep, step = torch.tensor([0.9, 1.0, 0.99]), torch.tensor([-0.1, -0.2, 0.0])
    expected = keep[:, None, None] * W.double() + step[:, None, None] * D.double()
    assert decay_epilogue_(W, D, keep=keep, step=step, cfg=SMALL_TILES) is W
    assert relative(W, expected) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_small_integers_and_power_of_two_scales_are_bit_exact():
    W, D = small_integers((2, 40, 24)), small_integers((2, 40, 24), seed=1)
    expected = 0.75 * W - 0.125 * D
    decay_epilogue_(W, D, keep=0.75, step=-0.125, cfg=SMALL_TILES)
    assert torch.equal(W, expected)


def test_weights_without_a_single_batch_stride_are_written_back():
    base = randn((20, 3, 2, 30))
    W = base.permute(1, 2, 0, 3)  # (3, 2, 20, 30): the two batch dims cannot be merged into one
    D = randn((3, 2, 20, 30), seed=1)
    expected = W.double() - 0.25 * D.double()
    decay_epilogue_(W, D, step=-0.25, cfg=SMALL_TILES)
    assert relative(base.permute(1, 2, 0, 3), expected) < 1e-6


def test_keep_alone_scales_the_weights():
    W = randn((2, 17, 33))
    expected = W * 0.5
    decay_epilogue_(W, None, keep=0.5, cfg=SMALL_TILES)
    assert torch.equal(W, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_stochastic_rounding_matches_the_torch_reference_bit_for_bit(dtype, strided):
    # The same fp32 values and the same random bits: the kernel's rounding rule and the torch
    # provider's (the reference, tested for bias in test_backends_torch.py) agree on every element,
    # whatever W's layout (a transposed W goes through the workspace, whose order is W's row-major one).
    from spectral_ops.backends.torch_backend import TorchBackend

    shape = (2, 20, 33)
    base = (randn(shape[:-2] + shape[-1:] + shape[-2:-1]).mT if strided else randn(shape)).to(dtype)
    D = randn(shape, seed=1) * 1e-3  # steps of a few units of the weights' rounding, and below one
    noise = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=torch.Generator().manual_seed(2))
    W, expected = base.clone(), base.clone()
    decay_epilogue_(W, D, keep=0.999, step=-0.5, noise=noise, cfg=SMALL_TILES)
    TorchBackend().decay_epilogue_(expected, D, 0.999, -0.5, noise=noise)
    assert torch.equal(W, expected)
    nearest = base.clone()
    decay_epilogue_(nearest, D, keep=0.999, step=-0.5, cfg=SMALL_TILES)
    assert not torch.equal(W, nearest), "the noise changed nothing"
