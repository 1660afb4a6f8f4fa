"""The small-matrix path: the whole S_p / sign computation in one program per matrix."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)
from triton_env import DTYPES, randn, relative, symmetric

import pytest
import torch

from spectral_ops import plan
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients
from spectral_ops.dispatch import PinnedKernels
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum
from spectral_ops.triton_kernels.small import MAX_SIDE, small_sign, small_spectral

POLAR = polar_express_coefficients()
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# The reference: the same plan with every product a plain torch matmul.
TORCH = PinnedKernels(TorchBackend())


def wide(shape, dtype, seed=0):
    return matrix_with_spectrum(shape, log_spaced_spectrum(shape[-2], 30), dtype, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0, 2, 3, 4, 5, 6])
def test_spectral_power_matches_the_torch_backend(p, dtype):
    X = wide((3, 21, 45), dtype, seed=p)
    result = small_spectral(X, p, POLAR)
    assert result.dtype == dtype
    assert relative(result, plan.spectral_power(TORCH, X, p, POLAR)) < TOLERANCE[dtype]


def test_the_largest_small_side_and_a_ragged_last_chunk():
    X = wide((MAX_SIDE, 150), torch.float32)
    assert relative(small_spectral(X, 2, POLAR), plan.spectral_power(TORCH, X, 2, POLAR)) < 1e-5


@pytest.mark.parametrize("p", [0, 2, 3])
def test_out_may_be_the_input(p):
    W = wide((2, 2, 17, 40), torch.float32, seed=p)
    expected = plan.spectral_power(TORCH, W, p, POLAR)
    assert small_spectral(W, p, POLAR, out=W) is W
    assert relative(W, expected) < 1e-5


def test_odd_powers_of_a_power_of_two_norm_sign_matrix_are_bit_exact():
    # +-1 entries, 16 x 64: ||X||_F = 32, so the normalisation and every product are exact.
    generator = torch.Generator().manual_seed(0)
    X = (torch.randint(0, 2, (2, 16, 64), generator=generator) * 2 - 1).float()
    for p in (3, 5):
        assert torch.equal(small_spectral(X, p, POLAR), plan.spectral_power(TORCH, X, p, POLAR))


def test_a_zero_matrix_gives_zero():
    assert torch.equal(small_spectral(torch.zeros(2, 8, 20), 2, POLAR), torch.zeros(2, 8, 20))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("coefficients", [(NEWTON_SCHULZ_SIGN,) * 12, POLAR], ids=["newton_schulz", "polar_express"])
def test_sign_chain_matches_the_torch_reference(coefficients, dtype):
    A = symmetric((3, 27, 27), dtype)
    result = small_sign(A, coefficients)
    assert result.dtype == dtype
    assert relative(result, plan.matrix_sign(TORCH, A.float(), coefficients, "fp32")) < TOLERANCE[dtype]


def test_shape_errors():
    with pytest.raises(ValueError, match="wide"):
        small_spectral(randn((40, 20)), 2, POLAR)
    with pytest.raises(ValueError, match="p = 1"):
        small_spectral(randn((20, 40)), 1, POLAR)
    with pytest.raises(ValueError, match="square"):
        small_sign(randn((20, 21)), POLAR)


@pytest.mark.parametrize("arch, shape, routed", [
    ("sm80", (512, 64, 64), True),      # R = 64: no stack frame on sm80
    ("sm80", (96, 128, 768), False),    # R = 128 spills on sm80 (compile-only, docs/backends.md)
    ("sm80", (12, 100, 100), False),
    ("sm90", (96, 128, 768), True),     # aligned rows: no stack frame on sm90
    ("sm90", (96, 768, 128), True),     # either orientation
    ("sm90", (12, 100, 300), False),    # rows of 300 elements: spills on sm90
    ("sm90", (4, 144, 144), False),     # past the small path's largest side
    ("interpreter", (3, 21, 45), True),
])
def test_the_backend_routes_the_chain_only_where_it_compiles_without_spilling(monkeypatch, arch, shape, routed):
    from spectral_ops.backends.triton_backend import TritonBackend
    from spectral_ops.triton_kernels import common, small

    assert small.spill_free(arch, shape) is routed
    monkeypatch.setattr(common, "arch", lambda device: arch)
    assert TritonBackend().supports("small_chain", torch.device("cpu"), torch.float32, shape) is routed
