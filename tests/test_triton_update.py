"""The fused rectangular product out = alpha M Z + beta Y + gamma Z (the Polar Express update)."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)
from triton_env import DTYPES, PRODUCT_TOLERANCE, SMALL_TILES, randn, relative, small_integers, symmetric

from dataclasses import replace

import pytest
import torch

from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.plan import polar_iterations
from spectral_ops.triton_kernels.common import batched, describe
from spectral_ops.triton_kernels.update import polar_update, product


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 50), (3, 21, 45), (2, 2, 17, 40)], ids=str)
def test_polar_update_matches_torch(shape, dtype):
    *batch, r, n = shape
    X = randn(shape, dtype)
    B = symmetric((*batch, r, r), seed=1)
    out = torch.full(shape, float("nan"))
    polar_update(X, B, 3.4445, out=out, cfg=SMALL_TILES)
    assert relative(out, 3.4445 * X.double() + B.double() @ X.double()) < PRODUCT_TOLERANCE


def test_one_polar_express_step_is_bit_exact_on_small_integers():
    X = small_integers((2, 19, 40))
    a, b, c = 2.0, -0.5, 0.125
    A = X @ X.mT
    B = b * A + c * (A @ A)
    assert torch.equal(polar_update(X, B, a, cfg=SMALL_TILES), polar_iterations(TorchBackend(), X, [(a, b, c)], "fp32"))


@pytest.mark.parametrize("alpha", [1.0, -0.75, "per-matrix"])
def test_full_epilogue_with_scalar_and_per_matrix_scales(alpha):
    M, Z, Y = symmetric((3, 30, 30)), randn((3, 30, 41), seed=1), randn((3, 30, 41), seed=2)
    alpha = torch.tensor([0.5, -1.0, 2.0]) if alpha == "per-matrix" else alpha
    gamma, beta = torch.tensor([1.0, 0.0, -3.0]), 0.25
    out = product(M, Z, alpha=alpha, gamma=gamma, Y=Y, beta=beta, cfg=SMALL_TILES)
    per = (lambda v: v[:, None, None].double()) if isinstance(alpha, torch.Tensor) else (lambda v: v)
    expected = beta * Y.double() + gamma[:, None, None] * Z.double() + per(alpha) * (M.double() @ Z.double())
    assert relative(out, expected) < PRODUCT_TOLERANCE


def test_mixed_operand_dtypes_and_a_low_precision_output():
    M, Z = symmetric((2, 20, 20)), randn((2, 20, 33), torch.float16)
    out = product(M, Z, gamma=1.0, out=torch.empty(2, 20, 33, dtype=torch.float16), cfg=SMALL_TILES)
    assert out.dtype == torch.float16
    assert relative(out, Z.double() + M.double() @ Z.double()) < 1e-3


def test_elementwise_form_in_place():
    Z, Y = randn((2, 30, 41)), randn((2, 30, 41), seed=1)
    expected = 0.5 * Z - 2.0 * Y
    product(None, Z, gamma=0.5, Y=Y, beta=-2.0, out=Z, cfg=SMALL_TILES)
    assert relative(Z, expected) < 1e-7


def test_out_may_be_Y_but_an_overlap_with_Z_uses_a_workspace():
    M, Z = symmetric((2, 25, 25)), randn((2, 25, 40), seed=1)
    Y = randn((2, 25, 40), seed=2)
    expected_y = Y.double() - M.double() @ Z.double()
    product(M, Z, alpha=-1.0, Y=Y, beta=1.0, out=Y, cfg=SMALL_TILES)
    assert relative(Y, expected_y) < PRODUCT_TOLERANCE
    expected_z = M.double() @ Z.double()
    product(M, Z, out=Z, cfg=SMALL_TILES)
    assert relative(Z, expected_z) < PRODUCT_TOLERANCE


def test_shape_errors():
    with pytest.raises(ValueError, match="M must be"):
        product(symmetric((5, 5)), randn((6, 8)))
    with pytest.raises(ValueError, match="Y must have"):
        product(None, randn((6, 8)), Y=randn((6, 9)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", [1.0, -0.75])
def test_tma_descriptor_path_with_ragged_edges_and_the_epilogue(dtype, alpha):
    # The sm90 path, run by the interpreter: M's rows (24 elements) and Z's (40) are 16-byte aligned
    # for both dtypes; 24 rows and 40 columns leave TMA to zero-fill the edge tiles. alpha = 1 starts
    # the accumulator at the epilogue terms, alpha != 1 adds them after the loop.
    M, Z, Y = symmetric((3, 24, 24), dtype), randn((3, 24, 40), dtype, seed=1), randn((3, 24, 40), seed=2)
    assert describe(batched(M), 16, 16) is not None and describe(batched(Z), 16, 16) is not None
    out = product(M, Z, alpha=alpha, gamma=0.5, Y=Y, beta=-1.0, cfg=replace(SMALL_TILES, descriptors=True))
    expected = alpha * (M.double() @ Z.double()) + 0.5 * Z.double() - Y.double()
    assert relative(out, expected) < PRODUCT_TOLERANCE
