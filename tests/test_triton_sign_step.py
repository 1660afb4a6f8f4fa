"""The symmetric sign step Z (a I + b Z^2 + c Z^4) from three half-tile symmetric products."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)
from triton_env import DTYPES, SMALL_TILES, max_asymmetry, relative, symmetric

import pytest
import torch

from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.coefficients import NEWTON_SCHULZ_SIGN
from spectral_ops.triton_kernels.sign_step import sign_step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 37), (3, 21, 21)], ids=str)
def test_newton_schulz_step_matches_torch_and_is_exactly_symmetric(shape, dtype):
    A = symmetric(shape, torch.float64)
    Z = (A / torch.linalg.matrix_norm(A)[..., None, None]).to(dtype)
    result = sign_step(Z, cfg=SMALL_TILES)
    Z64 = Z.double()
    assert relative(result, TorchBackend().sign_step(Z64, NEWTON_SCHULZ_SIGN)) < 1e-6
    assert max_asymmetry(result) == 0


def test_small_integers_and_power_of_two_coefficients_are_bit_exact():
    Z = symmetric((2, 35, 35), integers=True, bound=1)  # |Z^4 Z| stays below 2^24: every sum is exact
    coefficients = (2.0, -0.25, 0.0625)
    workspace = (torch.empty(2, 35, 35), torch.empty(2, 35, 35))
    result = sign_step(Z, coefficients, workspace=workspace, cfg=SMALL_TILES)
    assert torch.equal(result, TorchBackend().sign_step(Z, coefficients))
