"""The SVD-free ops against the FP64 SVD oracle (SPEC 1.2-1.4).

Tolerances: the Gram route is a chain of at most ~30 matmuls (8 Polar Express steps of three
products, the Gram powers, the last product), each adding ~sqrt(k) * u relative error for inner
size k <= 128, and the Polar Express map itself is within 1e-14 of 1 on its design range. That
gives ~30 * 11 * u: about 4e-14 in float64 and 4e-5 in float32, rounded up to 1e-12 and 5e-5.
"""

import math
import warnings

import numpy as np
import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.coefficients import odd_quintic, polar_express_coefficients
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error

from op_calls import OPS

TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-5}
SHAPES = [(24, 24), (40, 16), (16, 40), (3, 20, 12), (2, 2, 12, 20)]


def polar_express_map(x):
    """The scalar map the 8 default Polar Express steps apply to a normalised singular value."""
    for step in polar_express_coefficients():
        x = odd_quintic(step, x)
    return x


def predicted_spectral_power(W, p):
    """What the Gram route computes in exact arithmetic: ``U diag(s^p phi(s / 1.01||W||_F)) V^T``.

    ``phi`` is the Polar Express map for even ``p`` and 1 for odd ``p`` (no polar factor involved).
    """
    U, s, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    x = (s / (1.01 * torch.linalg.vector_norm(W.double(), dim=(-2, -1), keepdim=True)[..., 0])).numpy()
    factor = torch.from_numpy(polar_express_map(x) / np.where(x > 0, x, 1.0) * x if p % 2 == 0 else np.ones_like(x))
    weights = s**p * factor if p > 0 else factor
    return (U * weights[..., None, :]) @ Vh


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", range(7))
def test_spectral_power_matches_svd_within_design_range(p, shape, dtype):
    # Condition 100 keeps every mode above the design bound (s_min / (1.01 ||W||_F) > 1e-3).
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), 100), dtype, seed=p)
    result = so.spectral_power(W, p, method="gram", matrix_view="batch")
    assert result.dtype == dtype and result.shape == W.shape
    assert relative_error(result, reference.spectral_power_svd(W, p)) < TOLERANCE[dtype]


@pytest.mark.parametrize("condition", [10.0, 1e3, 1e5])
@pytest.mark.parametrize("p", [0, 2, 4])
def test_gram_route_is_the_polar_express_map_at_any_condition(p, condition):
    """Even at condition 1e5 the result is exactly the scalar map applied mode by mode."""
    W = matrix_with_spectrum((48, 32), log_spaced_spectrum(32, condition), torch.float64, seed=7)
    assert relative_error(so.spectral_power(W, p, method="gram"), predicted_spectral_power(W, p)) < 1e-12


def test_polar_lifts_modes_below_the_design_bound_only_partly():
    """The documented limit: modes far below 1e-3 ||W||_F are only partly lifted towards 1."""
    s = log_spaced_spectrum(32, 1e6)
    W = matrix_with_spectrum((48, 32), s, torch.float64, seed=3)
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    per_mode = torch.diagonal(U.mT @ so.polar(W) @ Vh.mT)
    x = s / (1.01 * torch.linalg.matrix_norm(W))
    assert (per_mode[x < 1e-4] < 0.9).all()
    assert torch.allclose(per_mode[x >= 1e-3], torch.ones(int((x >= 1e-3).sum()), dtype=torch.float64), atol=1e-10)


@pytest.mark.parametrize("p", [0, 2, 4])
def test_error_below_the_design_bound_is_bounded_by_the_share_of_those_modes(p):
    # Weighted by s^p, the damage shrinks fast with p: the SVD error stays below the s^p share
    # of the modes under the bound, each of which is off by at most 1.
    s = log_spaced_spectrum(32, 1e6)
    W = matrix_with_spectrum((48, 32), s, torch.float64, seed=3)
    below = s / (1.01 * torch.linalg.matrix_norm(W)) < 1e-3
    share = float(torch.linalg.vector_norm(s[below] ** p) / torch.linalg.vector_norm(s**p))
    error = relative_error(so.spectral_power(W, p, method="gram"), reference.spectral_power_svd(W, p))
    assert error <= share + 1e-12
    assert (error > 1e-3) == (p == 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p", [0, 1, 2, 3])
def test_rank_deficient_zero_modes_contribute_nothing(p, dtype):
    rank = 5
    generator = torch.Generator().manual_seed(p)
    W = (torch.randn(30, rank, generator=generator, dtype=torch.float64)
         @ torch.randn(rank, 20, generator=generator, dtype=torch.float64)).to(dtype)
    result = so.spectral_power(W, p, method="gram").double()
    U, s, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    # Rounding W to the dtype leaves "zero" modes of size ~u ||W||. Polar Express multiplies such
    # a mode by at most the product of the 8 linear coefficients (~6.4e3) when p = 0; for p > 0
    # it is weighted by s^p instead, i.e. vanishes.
    growth = float(np.prod([a for a, _, _ in polar_express_coefficients()]))
    allowed = 10 * growth * torch.finfo(dtype).eps
    assert float((result @ Vh[rank:].mT).norm() / result.norm()) < allowed
    expected = (U[:, :rank] * reference.power_weights(s[:rank], p, 30)) @ Vh[:rank]
    assert relative_error(result, expected) < allowed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0, 1, 2, 3])
def test_low_precision_weights_at_fp32_precision_round_once(p, dtype):
    # fp32 math, then one rounding of the output: error ~ the dtype's half-ulp.
    W = matrix_with_spectrum((2, 24, 16), log_spaced_spectrum(16, 10), dtype, seed=11)
    result = so.spectral_power(W, p, method="gram", precision="fp32")
    assert result.dtype == dtype
    assert relative_error(result, reference.spectral_power_svd(W, p)) < torch.finfo(dtype).eps


@pytest.mark.parametrize("method", ["svd", "auto", "eigh"])
@pytest.mark.parametrize("p", [0, 2, 5])
def test_other_methods(method, p):
    """fp32, kappa = 100. The SVD and Gram routes' error is first order in eps * kappa: 4 eps kappa =
    4.8e-5 (measured: at most 1.1e-6). ``eigh`` at ``p = 0`` reads the smallest mode's weight ``1 / s``
    off the Gram's eigenvalue ``s^2``, which a rounding of ``G`` (``~eps ||G|| = eps s_1^2``) moves by a
    relative ``eps kappa^2``: half that in ``1 / s``, in one of the result's ``rank`` modes of equal
    weight, is ``eps kappa^2 / (2 sqrt(rank))`` = 1.7e-4 of the result (measured: 4.7e-5 on MKL's AVX-512
    path and 5.2e-5 on its AVX2 one, so no fixed 5e-5 holds on both)."""
    kappa, rank = 100.0, 12
    W = matrix_with_spectrum((20, rank), log_spaced_spectrum(rank, kappa), torch.float32, seed=1)
    eps = torch.finfo(torch.float32).eps
    allowed = eps * kappa**2 / (2 * math.sqrt(rank)) if (method, p) == ("eigh", 0) else 4 * eps * kappa
    assert relative_error(so.spectral_power(W, p, method=method), reference.spectral_power_svd(W, p)) < allowed


def test_eigh_route_loses_small_modes_at_p0():
    """The documented limit of method="eigh": the Gram squares s, so at p = 0 (weights 1/s) modes
    near sqrt(eps) s_max come back wrong, while p >= 1 weights them down."""
    W = matrix_with_spectrum((48, 32), log_spaced_spectrum(32, 1e4), torch.float32, seed=6)
    assert relative_error(so.spectral_power(W, 0, method="eigh"), reference.spectral_power_svd(W, 0)) > 1e-2
    assert relative_error(so.spectral_power(W, 2, method="eigh"), reference.spectral_power_svd(W, 2)) < 5e-5


def test_non_contiguous_inputs():
    base = matrix_with_spectrum((32, 20), log_spaced_spectrum(20, 10), torch.float64, seed=5)
    transposed = base.mT  # a view: 20 x 32, strides (1, 20)
    assert relative_error(so.spectral_power(transposed, 2, method="gram"),
                          reference.spectral_power_svd(transposed, 2)) < 1e-12
    sliced = base[::2]
    assert relative_error(so.polar(sliced), reference.polar_svd(sliced)) < 1e-12


def overlapping_weight(seed=0) -> torch.Tensor:
    """A 64 x 32 fp32 weight overlapping itself: element (i, j) is the (i + j)-th of 95 values."""
    return torch.randn(95, generator=torch.Generator().manual_seed(seed)).as_strided((64, 32), (1, 1))


@pytest.mark.parametrize("op", OPS)
def test_a_weight_whose_elements_share_memory_is_read_as_its_values(op):
    """Read, a weight overlapping itself is the matrix of its values: each op gives what it gives on a
    contiguous copy, which is held to the FP64 SVD as any matrix is (spectral_power here, at the module's
    fp32 tolerance). The in-place decay refuses it (test_checks.py); the out-of-place one decays a copy."""
    W = overlapping_weight()
    assert torch.equal(OPS[op](W), OPS[op](W.contiguous()))
    if op == "spectral_power":
        assert relative_error(OPS[op](W), reference.spectral_power_svd(W, 2)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("op", ["polar", "power_update"])
def test_an_op_allowed_to_overwrite_a_weight_whose_elements_share_memory_copies_it(op):
    """overwrite_input=True normalised such a W in place, a location once per element: 0.78 off. It changes
    no result, so the op takes a copy there, as without it."""
    assert torch.equal(OPS[op](overlapping_weight(), overwrite_input=True), OPS[op](overlapping_weight().contiguous()))


def test_zero_and_empty_matrices():
    for p in range(4):
        zero = torch.zeros(3, 5, 4)
        assert torch.equal(so.spectral_power(zero, p, method="gram"), zero)
    empty = torch.zeros(0, 5, 4)
    assert so.spectral_power(empty, 2).shape == empty.shape
    assert so.polar(torch.zeros(5, 0)).shape == (5, 0)


def test_polar_is_orthogonal_and_matches_svd():
    W = matrix_with_spectrum((3, 50, 20), log_spaced_spectrum(20, 100), torch.float32, seed=2)
    Q = so.polar(W)
    identity = torch.eye(20).expand(3, 20, 20)
    assert torch.allclose(Q.mT @ Q, identity, atol=1e-5)
    assert relative_error(Q, reference.polar_svd(W)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                              ("fp32", torch.float32), ("bf16", torch.float64)])
@pytest.mark.parametrize("shape", [(40, 16), (16, 40), (20, 20), (3, 12, 20)], ids=str)
def test_polar_in_a_dtype_of_choice_is_the_default_result_rounded_once(shape, precision, dtype):
    """``dtype=`` rounds the last iterate once, to that dtype: in the operand dtype it is the iterate
    itself (exactly what the float32 result holds), in a wider one the same numbers widened."""
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), 100), torch.float32, seed=4)
    default = so.polar(W, precision=precision)
    chosen = so.polar(W, precision=precision, dtype=dtype)
    assert chosen.dtype == dtype and chosen.shape == W.shape
    assert torch.equal(chosen, default.to(dtype))
    if dtype in (torch.bfloat16, torch.float16) and so.plan.OPERAND_DTYPES[precision] == dtype:
        assert torch.equal(chosen.float(), default)  # nothing was rounded on the way to float32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 16), (16, 40), (20, 20), (3, 12, 20)], ids=str)
def test_polar_overwriting_its_input_gives_the_same_result(shape, dtype):
    """``overwrite_input=True`` lets the normalisation work in ``W``'s storage (a tall ``W`` through its
    transposed view); the result is bitwise the one that leaves ``W`` alone."""
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), 100), dtype, seed=6)
    expected = so.polar(W, precision="bf16")
    scratch = W.clone()
    assert torch.equal(so.polar(scratch, precision="bf16", overwrite_input=True), expected)
    if dtype != torch.bfloat16:  # W is in the compute dtype: the normalisation ran in its storage
        assert not torch.equal(scratch, W)


def test_polar_refuses_a_result_dtype_it_does_not_support():
    W = torch.randn(6, 4)
    with pytest.raises(TypeError, match="dtype must be None or one of"):
        so.polar(W, dtype=torch.int32)
    for matrix in (W, torch.zeros(5, 0)):  # refused before anything is computed, an empty W included
        with pytest.raises(TypeError, match="overwrite_input must be True or False"):
            so.polar(matrix, overwrite_input=1)
    assert so.polar(torch.zeros(5, 0), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_polar_with_muon_coefficients_stays_coarse():
    W = matrix_with_spectrum((40, 40), log_spaced_spectrum(40, 100), torch.float64, seed=2)
    coarse = so.polar(W, steps=5, coefficients=so.MUON_QUINTIC)
    singular_values = torch.linalg.svdvals(coarse)
    assert (singular_values - 1).abs().max() > 0.05  # Muon's quintic never converges to 1


def eigen_gapped_symmetric(r, gap, seed):
    """Symmetric matrix whose eigenvalues avoid (-gap, gap) relative to its Frobenius norm."""
    generator = torch.Generator().manual_seed(seed)
    Z, _ = torch.linalg.qr(torch.randn(r, r, generator=generator, dtype=torch.float64))
    magnitudes = torch.logspace(0, np.log10(gap), r, dtype=torch.float64)
    signs = torch.where(torch.arange(r) % 3 == 0, -1.0, 1.0).double()
    xi = magnitudes * signs
    A = (Z * xi) @ Z.mT
    return A / torch.linalg.matrix_norm(A)


def sign_residual(coefficients, magnitudes):
    """Worst ``|1 - f(x)|`` of the composed scalar sign map over the eigenvalue magnitudes."""
    x = np.asarray(magnitudes, dtype=np.float64)
    for step in coefficients:
        x = odd_quintic(step, x)
    return float(np.abs(1.0 - x).max())


@pytest.mark.parametrize("method, steps", [("newton_schulz", None), ("polar_express", None), ("polar_express", 10)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_msign_against_eigh(method, steps, dtype):
    # Eigenvalues down to 1e-2 ||A||_F. The iteration's own residual there is the scalar map's
    # (Newton-Schulz converges only linearly, 0.6 per step, so it is ~1e-7 after 30 steps);
    # round-off adds ~30 steps x 3 products x u.
    A = eigen_gapped_symmetric(24, 1e-2, seed=4).to(dtype)
    result = so.msign(A, steps=steps, method=method)
    coefficients = so.ops.sign_coefficients(steps, method)
    magnitudes = torch.linalg.eigvalsh(A.double()).abs() / torch.linalg.matrix_norm(A.double())
    allowed = sign_residual(coefficients, magnitudes.numpy()) + 1000 * torch.finfo(dtype).eps
    assert relative_error(result, reference.msign_eigh(A)) < allowed


def test_msign_rejects_non_square_and_non_symmetric():
    with pytest.raises(ValueError, match="square"):
        so.msign(torch.randn(4, 5))
    with pytest.raises(ValueError, match="symmetric"):
        so.msign(torch.randn(5, 5))


def gapped_matrix(shape, tau, dtype=torch.float64, seed=0):
    """Singular values split into two clusters, [0.3, 0.7] tau and [1.4, 3] tau."""
    r = min(shape[-2:])
    low = torch.linspace(0.3, 0.7, r // 2, dtype=torch.float64)
    high = torch.linspace(1.4, 3.0, r - r // 2, dtype=torch.float64)
    return matrix_with_spectrum(shape, torch.cat([high, low]) * tau, dtype, seed=seed)


BAND_METHODS = ["gram", "svd", "eigh"]  # "auto" is "svd" on a CPU: test_plan.py, the route


@pytest.mark.parametrize("method", BAND_METHODS)
@pytest.mark.parametrize("shape", [(30, 12), (12, 30), (2, 16, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_band_projectors(shape, dtype, method):
    tau = 1.5
    W = gapped_matrix(shape, tau, dtype)
    P_top, P_bot = so.band_projectors(W, tau, method=method)
    r = min(shape[-2:])
    assert P_top.shape == (*shape[:-2], r, r)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    expected_top, expected_bot = reference.band_projectors_svd(W, tau)
    assert relative_error(P_top, expected_top) < tolerance
    assert relative_error(P_bot, expected_bot) < tolerance
    identity = torch.eye(r, dtype=dtype)
    assert torch.allclose(P_top + P_bot, identity.expand_as(P_top), atol=10 * torch.finfo(dtype).eps)
    for P in (P_top, P_bot):
        assert relative_error(P @ P, P) < tolerance  # near-idempotent


@pytest.mark.parametrize("method", BAND_METHODS)
@pytest.mark.parametrize("mode", ["top", "bot", "top_only", "bot_only", "two_band"])
@pytest.mark.parametrize("shape", [(30, 12), (12, 30)], ids=str)
def test_band_direction(mode, shape, method):
    # float64, and the gapped spectrum's modes within 1e3 of s_max: eigh's 1/s (p_bot = 0) is accurate here.
    tau = 0.8
    W = gapped_matrix(shape, tau, seed=1)
    result = so.band_direction(W, tau, 2, mode, p_bot=0, lambda_top=0.5, lambda_bot=2.0, method=method)
    expected = reference.band_direction_svd(W, tau, 2, mode, p_bot=0, lambda_top=0.5, lambda_bot=2.0)
    assert relative_error(result, expected) < 1e-10


@pytest.mark.parametrize("method", BAND_METHODS)
def test_the_clip_band_is_the_soft_threshold(method):
    # mode="clip" takes each singular value's excess over tau, with p = 1 (the power plays no part).
    W = gapped_matrix((30, 12), 0.8, seed=2)
    result = so.band_direction(W, 0.8, 1, "clip", method=method)
    assert relative_error(result, reference.svt_svd(W, 0.8)) < 1e-10
    assert relative_error(result, reference.band_direction_svd(W, 0.8, 1, "clip")) < 1e-10
    with pytest.raises(ValueError, match="pass p=1, not p=2"):
        so.band_direction(W, 0.8, 2, "clip")


def test_two_band_with_p_one_and_equal_coefficients_is_ordinary_decay():
    W = gapped_matrix((20, 14), 1.0, seed=2)
    result = so.band_direction(W, 1.0, 1, "two_band", p_bot=1, lambda_top=0.3, lambda_bot=0.3)
    assert relative_error(result, 0.3 * W) < 1e-12


@pytest.mark.parametrize("method", BAND_METHODS)
@pytest.mark.parametrize("shape", [(30, 12), (12, 30), (3, 16, 16)], ids=str)
def test_svt_equals_svd_soft_threshold(shape, method):
    t = 1.0
    W = gapped_matrix(shape, t, seed=3)
    assert relative_error(so.svt(W, t, method=method), reference.svt_svd(W, t)) < 1e-10


@pytest.mark.parametrize("method", ["auto", "gram"])
@pytest.mark.parametrize("threshold", [2.0, 0.5, 0.12, 0.035])
def test_the_band_ops_hold_at_any_threshold(threshold, method):
    """Spectral hard-capping ``W - svt(W, beta)`` of a 128 x 64 with ``s`` log-spaced over [1e-2, 10], in
    fp32 (no mode within 1% of a threshold): "auto" (the SVD on a CPU) resolves ``s`` itself, and the
    Gram route resolves ``s - beta`` on ``|W|`` where ``s^2 - beta^2`` would be too deep
    (docs/real-powers.md, "Thresholds at any depth"), both to fp32's rounding of ``s_max``. Relative to
    the cap, which is small (about ``beta`` times the root of the count of modes above it), that is
    ``eps s_max / ||cap||``: within 64 of it."""
    W = matrix_with_spectrum((128, 64), torch.logspace(1, -2, 64, dtype=torch.float64), torch.float32, seed=0)
    expected = W.double() - reference.svt_svd(W.double(), threshold)
    scale = torch.finfo(torch.float32).eps * 10 / torch.linalg.matrix_norm(expected).item()
    assert relative_error(W - so.svt(W, threshold, method=method), expected) < 64 * scale
    expected_top = reference.band_projectors_svd(W.double(), threshold)[0]
    assert relative_error(so.band_projectors(W, threshold, method=method)[0], expected_top) < 1e-4
    expected_band = reference.band_direction_svd(W.double(), threshold, 2, "top")
    assert relative_error(so.band_direction(W, threshold, 2, "top", method=method), expected_band) < 1e-5


@pytest.mark.parametrize("method", BAND_METHODS)
@pytest.mark.parametrize("shape", [(30, 12), (12, 30), (3, 16, 16)], ids=str)
@pytest.mark.parametrize("low, high", [(None, 1.0), (1.0, None), (0.5, 2.0)])
def test_spectral_clip_equals_the_svd_clamp(shape, method, low, high):
    # Singular values in [0.3, 0.7] and [1.4, 3]: every bound has a gap around it, which the Gram
    # route's sign iteration resolves to fp64's rounding.
    W = gapped_matrix(shape, 1.0, seed=4)
    expected = reference.spectral_clip_svd(W, low, high)
    assert relative_error(so.spectral_clip(W, low, high, method=method), expected) < 1e-10
    assert relative_error(so.spectral_clip(W.mT, low, high, method=method), expected.mT) < 1e-10


def test_a_clip_to_one_value_is_that_value_times_the_polar_factor():
    W = gapped_matrix((20, 12), 1.0, seed=5)
    assert relative_error(so.spectral_clip(W, 1.0, 1.0, method="gram"), so.polar(W, steps=12)) < 1e-10


@pytest.mark.parametrize("method", ["auto", "gram"])
@pytest.mark.parametrize("low, high", [(None, 2.0), (None, 0.1), (0.5, None), (0.035, 0.5)])
def test_spectral_clip_holds_at_any_threshold(low, high, method):
    """The issue's hard-cap case: a 128 x 64 with ``s`` log-spaced over [1e-2, 10], fp32. "auto" (the SVD
    on a CPU) clamps ``s`` to fp32's rounding at any bound; the Gram route, whose sign iteration moves to
    ``|W|`` for a deep bound, as well, up to the cancellation in ``W - P_top (W - max Q)``: fp32's
    rounding of ``s_max`` (10) in each of the 64 modes, relative to the clipped matrix (as for the hard
    cap above). A mode at a bound (0.1 is one) is clipped to itself whichever way it is projected. A floor
    lifts every mode below it to ``low Q``, whose modes below Polar Express's design bound (``s < 1e-3 *
    1.01 ||W||_F``, here the smallest few) come out at ``low phi(s / (1.01 ||W||_F))`` instead (the
    polar factor's limit, which no threshold design moves: the modes are not near the bound)."""
    W = matrix_with_spectrum((128, 64), torch.logspace(1, -2, 64, dtype=torch.float64), torch.float32, seed=0)
    expected = reference.spectral_clip_svd(W.double(), low, high)
    scale = torch.finfo(torch.float32).eps * 10 / torch.linalg.matrix_norm(expected).item()
    tolerance = 64 * scale
    if method == "gram" and low is not None:
        s = torch.linalg.svdvals(W.double())
        unlifted = low * (1 - polar_express_map((s / (1.01 * torch.linalg.matrix_norm(W.double()))).numpy()))
        tolerance += np.linalg.norm(unlifted[s.numpy() < low]) / torch.linalg.matrix_norm(expected).item()
    assert relative_error(so.spectral_clip(W, low, high, method=method), expected) < tolerance


def test_spectral_clip_refuses_what_it_cannot_mean():
    W = gapped_matrix((12, 8), 1.0)
    with pytest.raises(ValueError, match="needs min= or max="):
        so.spectral_clip(W)
    with pytest.raises(ValueError, match="min <= max"):
        so.spectral_clip(W, 2.0, 1.0)
    with pytest.raises(ValueError, match="max must be > 0"):
        so.spectral_clip(W, max=0.0)


def test_spectral_norm_bounds_bracket_the_largest_singular_value():
    W = matrix_with_spectrum((4, 64, 48), log_spaced_spectrum(48, 30) * 3.0, torch.float64, seed=9)
    lower, upper = so.spectral_norm_bounds(W)
    s_max = torch.linalg.matrix_norm(W, 2)
    assert (lower <= s_max * (1 + 1e-12)).all() and (s_max <= upper * (1 + 1e-12)).all()
    assert (upper / lower <= 48 ** (1 / 32) * (1 + 1e-12)).all()


def test_svt_error_on_unresolved_modes_is_bounded_by_their_distance_to_the_threshold():
    """The sign iteration's limit (method="gram"; a factorisation resolves these modes)."""
    t = 1.0
    s = torch.tensor([3.0, 2.0, 1.0 + 1e-6, 1.0 - 1e-6, 0.5, 0.2], dtype=torch.float64)
    W = matrix_with_spectrum((10, 6), s, torch.float64, seed=8)
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    per_mode = torch.diagonal(U.mT @ so.svt(W, t, method="gram") @ Vh.mT)
    exact = (s - t).clamp_min(0)
    assert ((per_mode - exact).abs() <= (s - t).abs() + 1e-12).all()
    assert torch.allclose(per_mode[[0, 1, 4, 5]], exact[[0, 1, 4, 5]], atol=1e-10)  # resolved modes are exact


UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8, "fp16": 2.0**-11}


@pytest.mark.parametrize("precision", sorted(UNIT_ROUNDOFF))
@pytest.mark.parametrize("p", [0, 2, 3, 4])
def test_each_precision_against_the_svd_within_its_unit_roundoff(precision, p):
    # Every product rounds its result to the operand dtype (unit roundoff u). Polar Express rounds
    # three products per step, but the map contracts strongly near 1, so only the last steps' roundings
    # survive; S_p adds the Gram, its squarings and one product. About a dozen roundings of a few u
    # each: 48 u bounds them (measured: up to 25 u in fp32, 8 u in bf16 and fp16). The float32 result
    # is rounded once more (u of float32). On CPU, tf32 computes in fp32: its bound is only looser.
    W = matrix_with_spectrum((2, 24, 16), log_spaced_spectrum(16, 10), torch.float32, seed=12)
    result = so.spectral_power(W, p, method="gram", precision=precision)
    assert result.dtype == torch.float32
    tolerance = 48 * UNIT_ROUNDOFF[precision] + 2 * UNIT_ROUNDOFF["fp32"]
    assert relative_error(result, reference.spectral_power_svd(W, p)) < tolerance


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_powers_stay_accurate_at_high_condition_numbers(precision):
    # Modes below about u * ||W||_F drown in the rounding of the iterate, so the polar factor of an
    # ill-conditioned matrix is coarse in bf16 (README: 0.09 at condition 1e3); p >= 2 weights those
    # modes down by s^p and keeps the bound of the well-conditioned case.
    W = matrix_with_spectrum((48, 48), log_spaced_spectrum(48, 1e3), torch.float32, seed=13)
    error = relative_error(so.spectral_power(W, 2, method="gram", precision=precision),
                           reference.spectral_power_svd(W, 2))
    assert error < 48 * UNIT_ROUNDOFF[precision]


@pytest.mark.parametrize("precision", [None, "fp64", "fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_p1_decay_is_bitwise_the_ordinary_multiply_in_every_precision(precision, dtype):
    W = matrix_with_spectrum((20, 12), log_spaced_spectrum(12, 10), dtype, seed=14)
    expected = W.clone().mul_(1 - 1e-3 * 0.1)
    so.spectral_decay_(W, 1, 1e-3, 0.1, precision=precision)
    assert torch.equal(W, expected)


def test_band_projectors_names_the_sign_iteration_as_the_other_band_ops_do():
    """``sign_steps``/``sign_method``, as band_direction and svt; ``steps`` and a sign method passed as
    ``method`` still work, with a DeprecationWarning, and both names at once are refused. ``method``
    is now the route, as in every op: the two sets of values do not meet."""
    W = matrix_with_spectrum((12, 8), log_spaced_spectrum(8, 10.0), torch.float64, seed=3)
    expected = so.band_projectors(W, 0.5, sign_steps=12, sign_method="newton_schulz", method="gram")
    with pytest.warns(DeprecationWarning, match="sign_steps"), pytest.warns(DeprecationWarning, match="sign_method"):
        old = so.band_projectors(W, 0.5, steps=12, method="newton_schulz")
    assert all(torch.equal(a, b) for a, b in zip(old, expected))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routed = so.band_projectors(W, 0.5, method="svd")
    assert relative_error(routed[0], reference.band_projectors_svd(W, 0.5)[0]) < 1e-12
    with pytest.raises(TypeError, match="both sign_method and method"):
        so.band_projectors(W, 0.5, sign_method="newton_schulz", method="newton_schulz")


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20), (3, 12, 20)])
def test_power_update(shape):
    W = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # q = 0 (a number) is the polar factor as Muon iterates it, bit for bit: a square one as laid out.
    expected = so.polar(W) if shape[-2] != shape[-1] else so.polar(W.mT).mT
    assert torch.equal(so.power_update(W, 0), expected)
    for q in (-0.25, 0.5):
        # fp64: the construction's own error, designed for 1e-13.
        assert relative_error(so.power_update(W, q), reference.power_update_svd(W, q, 0.01)) < 1e-9


# --- the autograd contract: no op carries a graph -----------------------------------------------------------------


@pytest.mark.parametrize("op", sorted(set(OPS) - {"spectral_decay_"}) + ["msign"])
def test_no_op_result_carries_a_graph_even_from_a_parameter_under_grad_mode(op):
    # Issue #43: spectral_decay's result carried CloneBackward0, an identity Jacobian (0.32 off the true
    # one) that backward would have followed silently. Every op is autograd-free: its result never
    # requires grad, so a backward through it fails loudly instead.
    W = torch.nn.Parameter(matrix_with_spectrum((24, 16), log_spaced_spectrum(16, 10.0), torch.float32, seed=0))
    with torch.enable_grad():
        result = so.msign(W.mT @ W) if op == "msign" else OPS[op](W)
    assert not result.requires_grad and result.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        result.sum().backward()
    assert W.grad is None


def test_an_in_place_decay_of_a_parameter_leaves_its_graph_alone():
    # The in-place op writes a leaf under no_grad, as torch's optimizers do: the parameter stays a leaf.
    W = torch.nn.Parameter(matrix_with_spectrum((24, 16), log_spaced_spectrum(16, 10.0), torch.float32, seed=0))
    so.spectral_decay_(W, 2, 0.02, 0.5)
    assert W.is_leaf and W.grad_fn is None and W.requires_grad
