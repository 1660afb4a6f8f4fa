"""Real and floored negative powers on the Gram route (plan.GramPlan.scaled_real_power), against the
FP64 SVD. Tolerances: fp64 runs show the construction's own error (its stages are designed for 1e-13
relative, so 1e-9 leaves room for the products' rounding); fp32 ones are the issue's goals, with the
measurements beside them (the inverse root's rounding, about sqrt(r) eps per product, is raised to the
power 8 f by the polynomial: docs/real-powers.md)."""

import math

import pytest
import torch

import spectral_ops as so
from spectral_ops import plan


def matrix(m, n, kappa, seed=0, batch=()):
    generator = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U = torch.linalg.qr(torch.randn(*batch, m, r, dtype=torch.float64, generator=generator))[0]
    V = torch.linalg.qr(torch.randn(*batch, n, r, dtype=torch.float64, generator=generator))[0]
    s = torch.logspace(0, -math.log10(kappa), r, dtype=torch.float64)
    return (U * s) @ V.mT, U, s, V


def reference(U, s, V, p, eps=None):
    weights = s**p if eps is None else (s**2 + (eps * s.amax(-1, keepdim=True)) ** 2) ** (p / 2)
    return (U * weights.unsqueeze(-2)) @ V.mT


def relative_error(result, expected):
    return float((result.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("p", [0.5, 1.5, 2.5, 0.1155, 0.25])
@pytest.mark.parametrize("kappa", [10, 1e3])
def test_the_construction_is_exact_in_fp64(p, kappa):
    W, U, s, V = matrix(96, 48, kappa)
    assert relative_error(so.spectral_power(W, p, method="gram"), reference(U, s, V, p)) < 1e-9


@pytest.mark.parametrize("shape", [(128, 64), (64, 128)])
@pytest.mark.parametrize("p, kappa, bound", [
    # The goals: 2e-5 for p in {0.5, 1.5, 2.5}, 1e-4 for {0.1155, 0.25}, at kappa 10 and 1e3
    # (measured: 4e-6 at most).
    (0.5, 10, 2e-5), (1.5, 10, 2e-5), (2.5, 10, 2e-5), (0.1155, 10, 1e-4), (0.25, 10, 1e-4),
    (0.1155, 1e3, 1e-4), (0.25, 1e3, 1e-4), (0.5, 1e3, 2e-5), (1.5, 1e3, 2e-5), (2.5, 1e3, 2e-5),
])
def test_fp32_accuracy(shape, p, kappa, bound):
    W, U, s, V = matrix(*shape, kappa)
    result = so.spectral_power(W.float(), p, method="gram", precision="fp32")
    assert relative_error(result, reference(U, s, V, p)) < bound


def test_modes_below_the_design_bound_stay_bounded():
    # kappa 1e6: the modes under 1e-3 s_max (plan.ROOT_LOWER) are outside the design; the polynomial takes
    # them to about the bound's value instead of extrapolating (errors of 5e3 before it covered their lift).
    W, U, s, V = matrix(128, 64, 1e6)
    for p in (0.5, 0.1155, 1.5):
        result = so.spectral_power(W.float(), p, method="gram")
        assert torch.isfinite(result).all()
        assert relative_error(result, reference(U, s, V, p)) < 0.5


def test_powers_compose():
    # S_p S_q^T S_r = S_(p+q+r) on a full-rank matrix: U s^p V^T V s^q U^T U s^r V^T.
    W, U, s, V = matrix(80, 40, 100)
    S = {p: so.spectral_power(W, p, method="gram") for p in (0.5, 0.25, 1.25)}
    assert relative_error(S[0.5] @ S[0.25].mT @ S[1.25], reference(U, s, V, 2)) < 1e-9


def test_batches_and_transposes():
    W, U, s, V = matrix(48, 24, 50, batch=(3,))
    stacked = so.spectral_power(W, 0.75, method="gram")
    for i in range(3):
        single = so.spectral_power(W[i], 0.75, method="gram")
        assert relative_error(stacked[i], single.double()) < 1e-12
    assert relative_error(so.spectral_power(W.mT, 0.75, method="gram").mT, reference(U, s, V, 0.75)) < 1e-9


def test_integral_floats_are_the_integer_powers():
    W = matrix(48, 24, 10)[0].float()
    assert torch.equal(so.spectral_power(W, 2.0, method="gram"), so.spectral_power(W, 2, method="gram"))
    # A band's bottom power too (it took the real route, a polynomial of exponent 0, before).
    assert torch.equal(so.band_direction(W, 0.5, 2, "two_band", p_bot=2.0, method="gram"),
                       so.band_direction(W, 0.5, 2, "two_band", p_bot=2, method="gram"))
    with pytest.raises(ValueError, match="p_bot=-1 < 0 cannot be a decay"):
        so.band_direction(W, 0.5, 2, "two_band", p_bot=-1)


@pytest.mark.parametrize("eps", [1e-1, 1e-2, 1e-3])
@pytest.mark.parametrize("kappa", [10, 1e3])
def test_floored_negative_power(eps, kappa):
    W, U, s, V = matrix(96, 48, kappa)
    expected = reference(U, s, V, -0.25, eps)
    assert relative_error(so.spectral_power(W, -0.25, method="gram", eps=eps), expected) < 1e-9
    assert relative_error(so.spectral_power(W, -0.25, method="svd", eps=eps), expected) < 1e-12


def test_zero_and_rank_deficient_matrices():
    assert torch.equal(so.spectral_power(torch.zeros(16, 8), 0.5, method="gram"), torch.zeros(16, 8))
    W, U, s, V = matrix(32, 16, 10)
    s[8:] = 0  # the zero modes have no singular vectors: they stay 0, as the SVD's s^p does
    W = (U * s) @ V.mT
    result = so.spectral_power(W, 0.5, method="gram")
    assert relative_error(result, reference(U, s, V, 0.5)) < 1e-9
    assert torch.isfinite(so.spectral_power(W, -0.5, method="gram", eps=1e-2)).all()


@pytest.mark.parametrize("p, eps", [(0.5, None), (2.5, None), (-0.25, 1e-2)])
def test_a_capturable_real_power_reads_nothing_back(p, eps):
    from test_optim_capturable import host_reads_forbidden

    W = matrix(64, 32, 10, batch=(2,))[0].float()
    with host_reads_forbidden():
        captured = so.spectral_power(W, p, method="gram", capturable=True, eps=eps)
    assert torch.equal(captured, so.spectral_power(W, p, method="gram", eps=eps))


@pytest.mark.parametrize("mode", ["top", "bot", "two_band"])
def test_band_directions_take_real_powers(mode):
    # The band forms multiply the real power by the projector; p_bot may be real too.
    W, U, s, V = matrix(60, 30, 10)
    tau = float(s[10] + s[11]) / 2  # between two modes, 4% from each
    result = so.band_direction(W, tau, 0.5, mode, p_bot=1.5, lambda_bot=0.3, method="gram", sign_steps=12)
    expected = so.reference.band_direction_svd(W, tau, 0.5, mode, p_bot=1.5, lambda_bot=0.3)
    assert relative_error(result, expected.double()) < 1e-9


@pytest.mark.parametrize("shape", [(128, 64), (1024, 4096), (768, 128)])
def test_flops_within_two_and_a_half_times_s2(shape):
    # The budget, from the FLOPs the plan runs (Polar Express's 9 steps for the real power).
    s2 = plan.cost("spectral_power", shape, p=2, iteration="auto")
    for p in (0.5, 0.1155, 1.5, 2.5):
        assert plan.cost("spectral_power", shape, p=p, iteration="auto", steps=9) <= 2.5 * s2


def test_real_power_decay_matches_the_svd():
    W, U, s, V = matrix(64, 32, 100)
    for p in (0.5, 1.5):
        for method in ("gram", "svd"):
            X = W.clone()
            so.spectral_decay_(X, p, 0.1, 0.01, method=method)
            expected = W - 0.001 * reference(U, s, V, p)
            assert relative_error(X - W, expected - W) < 1e-9


@pytest.mark.parametrize("p", [-1.5, -0.25, 0.5, 1, 2, 2.5])
@pytest.mark.parametrize("eps", [1e-1, 1e-3])
def test_a_floor_takes_a_power_of_either_sign(p, eps):
    # (s^2 + (eps s_max)^2)^(p/2) for any p: exact in fp64 on both routes (the Gram route's floor is set by an
    # estimate of s_max that misses it by 0.3% at most, which moves these modes by far less than 1e-9).
    W, U, s, V = matrix(96, 48, 1e3)
    expected = reference(U, s, V, p, eps)
    assert relative_error(so.spectral_power(W, p, method="gram", eps=eps), expected) < 1e-9
    assert relative_error(so.spectral_power(W, p, method="svd", eps=eps), expected) < 1e-12
    # The oracle the optimizer and experiment tests use, against the matrix's own factors.
    assert relative_error(so.reference.spectral_power_svd(W, p, eps=eps), expected) < 1e-12


@pytest.mark.parametrize("eps", [1e-5, 1e-8])
def test_a_floor_below_the_design_bound_stays_finite_and_accurate(eps):
    # A floor far below the design bound (1e-4 of s_max) gave NaN when the floored power was a root of
    # P^2 + e^2 (a root order of 32 for 1e-5); on |W| + e the design interval is only clamped at the bound.
    # kappa 1e3 keeps every mode above the bound, where the measured error is 1.4e-5 (the fp32 limit above).
    W, U, s, V = matrix(128, 64, 1e3)
    result = so.spectral_power(W.float(), -0.25, method="gram", eps=eps)
    assert torch.isfinite(result).all()
    assert relative_error(result, reference(U, s, V, -0.25, eps)) < 5e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("p, eps", [(0.25, None), (1.5, None), (-0.25, 1e-5)])
def test_low_precision_never_turns_a_finite_matrix_non_finite(precision, p, eps):
    # bf16 rounds |W|'s small eigenvalues by about 2^-8 of the top, some to below zero, which the inverse
    # root amplified to 1e24 or NaN (kappa 1e6). The shift by plan.RESOLUTION keeps them positive: the modes
    # below it are the rounding's and come out wrong, but bounded.
    W, U, s, V = matrix(64, 128, 1e6)
    result = so.spectral_power(W.float(), p, method="gram", precision=precision, eps=eps)
    assert torch.isfinite(result).all()
    expected = reference(U, s, V, p, eps)
    assert result.double().norm() < 2 * expected.norm()


@pytest.mark.parametrize("q", [-0.25, 0.1155])
def test_bf16_powers_of_a_gaussian_matrix(q):
    # Muon's regime (a Gaussian momentum, kappa ~3): 2e-2 is the bound for bf16 updates; the
    # polar factor alone errs by 7e-3 in bf16 here, and the power by 1e-2 at most (measured).
    W = torch.randn(2, 128, 768, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    result = so.spectral_power(W.float(), q, method="gram", precision="bf16", eps=1e-2)
    assert relative_error(result, reference(U, s, Vh.mT, q, 1e-2)) < 2e-2


def low_rank(shape, rank, dtype, seed=1):
    """A product of small integer matrices: exact in every dtype, so its zero modes are exactly zero and the FP64
    SVD's oracle (which counts as zero what float64 does) is every dtype's."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.randint(-3, 4, (shape[0], rank), generator=generator, dtype=torch.float64)
    right = torch.randint(-3, 4, (rank, shape[1]), generator=generator, dtype=torch.float64)
    return (left @ right).to(dtype)


FLOORED_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def floored_bound(expected: torch.Tensor, dtype: torch.dtype) -> float:
    """What a floored power (or update) in ``dtype`` can reach against its FP64 result ``expected``: fp64 the
    construction's 1e-9 (above), fp32 the real powers' 2e-5. A bf16 or fp16 weight's floored power computes in
    fp32 and is rounded to the weight's dtype once: fp32's 2e-5 plus that rounding, which no computation beats,
    measured on ``expected`` itself (an fp16 result of entries near 1e-5 is subnormal, where the rounding is
    coarser than the unit roundoff); twice it, since the computed result's rounding is another draw of it."""
    if dtype in (torch.float64, torch.float32):
        return 1e-9 if dtype == torch.float64 else 2e-5
    return 2e-5 + 2 * relative_error(expected.to(dtype), expected)


@pytest.mark.parametrize("dtype", FLOORED_DTYPES)
@pytest.mark.parametrize("rank", [1, 2, 8])
@pytest.mark.parametrize("p, eps", [(-1.5, 1e-4), (-1.0, 1e-2), (-0.25, 1e-2), (0.5, 1e-2)])
def test_a_floored_power_of_a_rank_deficient_matrix_meets_its_dtypes_bound(p, eps, rank, dtype):
    """Issue #52, item 9: the Gram route's floored power of a rank-1 matrix at p < 0 erred 13 to 2e4
    (relative) in fp32, fp16 and bf16 (and 3.6e-4 at p = 0.5 in fp32): the floor weighs every mode by at least
    ``(eps s_max)^p``, so the polar factor's round-off on the zero modes came out at ``eps^p`` times the top's
    weight (1e6 at p = -1.5, eps = 1e-4), and bf16/fp16 operands rounded the matrix's zero modes to 2^-9 of
    ``s_max``. A floored power is now a lift (plan.floor_lifts): its polar factor resolves every mode above the
    zero cutoff and none below (plan.lift_design), it computes in fp32 for bf16/fp16 weights, and the zero modes
    sit where the power weighs them least: :func:`floored_bound`. ``"auto"`` (the SVD on a CPU) meets it too."""
    W = low_rank((64, 32), rank, dtype)
    expected = so.reference.spectral_power_svd(W, p, eps=eps)
    for method in ("gram", "auto"):
        result = so.spectral_power(W, p, method=method, eps=eps)
        assert result.dtype == dtype
        assert relative_error(result, expected) < floored_bound(expected, dtype), method


@pytest.mark.parametrize("dtype", FLOORED_DTYPES)
@pytest.mark.parametrize("q", [-1.0, -0.25, 0.25])
def test_an_update_of_a_rank_one_momentum_meets_its_dtypes_bound(q, dtype):
    """Issue #52, item 9: ``power_update`` of a rank-1 bf16 momentum at ``q < 0`` erred 1.4 (fp16 1.4, and 0.34
    at ``q = 0.25``): its bf16 operands rounded the zero modes to 2^-9 of ``s_max``, which the floor (raised to
    2^-6 in bf16) weighs most. ``precision=None`` now computes a floored update in fp32 and lifts it as
    :func:`spectral_power` does, to :func:`floored_bound`. An explicit ``precision="bf16"`` (SpectralMuon's
    default) keeps bf16 operands and their documented limit."""
    X = low_rank((64, 128), 1, dtype)
    update = so.power_update(X, q)
    assert update.dtype == dtype
    expected = so.reference.power_update_svd(X, q, 1e-2)
    assert relative_error(update, expected) < floored_bound(expected, dtype)
    assert torch.isfinite(so.power_update(X, q, precision="bf16")).all()


@pytest.mark.parametrize("p", [-1.0, -0.25, 0.0, 0.5, 1.0])
def test_a_power_held_in_a_tensor(p):
    # A capturable call may take p on the device: floored either way, with coefficients computed there
    # from fixed nodes (designed for 1e-10 at finest, plan.DEVICE_DESIGN_TOLERANCE; fp64 measured 1e-8 at
    # worst), and it agrees with the number's result in fp32 to the products' rounding.
    from test_optim_capturable import host_reads_forbidden

    W, U, s, V = matrix(96, 48, 1e3)
    with host_reads_forbidden():
        result = so.spectral_power(W, torch.tensor(p), method="gram", eps=1e-2, capturable=True)
        single = so.spectral_power(W.float(), torch.tensor(p), method="gram", eps=1e-2, capturable=True)
    assert relative_error(result, reference(U, s, V, p, 1e-2)) < 1e-7
    number = so.spectral_power(W.float(), p, method="gram", eps=1e-2)
    assert relative_error(single, number.double()) < 2e-5


def test_a_tensor_power_out_of_its_design_is_nan_and_needs_a_floor():
    """A capturable call cannot read its power to refuse it: a power held in a tensor beyond its design
    (|p| <= 1) makes the whole result NaN, never a finite wrong one (SpectralMuon skips and counts that
    step); outside a capturable call it is read, as a number is taken, and computed."""
    W = matrix(32, 16, 10)[0]
    assert torch.isnan(so.spectral_power(W, torch.tensor(1.5), method="gram", eps=1e-2, capturable=True)).all()
    for q in (1.5, -3.0):
        assert torch.isnan(so.power_update(W, torch.tensor(q), capturable=True)).all()
        assert torch.equal(so.power_update(W, torch.tensor(q)), so.power_update(W, q))
    with pytest.raises(ValueError, match="floored either way"):
        so.spectral_power(W, torch.tensor(0.5), method="gram", capturable=True)
    # Outside a capturable call it is read, as a number is taken.
    assert torch.equal(so.spectral_power(W, torch.tensor(0.5), method="gram"), so.spectral_power(W, 0.5, method="gram"))


# ----- extreme powers (issue #43): every power returns, on every route, and is right up to the bound

@pytest.mark.parametrize("p", [-2, -4, -30, -2.0, -30.0])
@pytest.mark.parametrize("method", ["gram", "svd", "eigh", "auto"])
def test_negative_even_powers_return_on_every_route(p, method):
    """A floored negative even power never returned, on any route: route() costed the integer route's G^k
    with k = p / 2 < 0, and repeated squaring's ``while k: k >>= 1`` never ends for k < 0. Against the FP64
    SVD with the floor. fp64: the Gram route's stages are designed for 1e-13 (measured 8e-13 at -30), the
    factorisations are exact to their rounding (1e-14); fp32: the real powers' goal 2e-5, and beyond
    |p| = 20 the power's condition |p| times a few fp32 roundings (measured 1.9e-5 at -30). eigh sees
    s^2: its smallest eigenvalue carries the rounding of the Gram's largest, 2^-24 kappa^2 relative to it,
    summed over the n = 24 terms of each entry (sqrt(n), as a random walk: the order of the sums differs between
    machines and kernels), then raised to |p| / 2 (measured 1.2e-5, 2.2e-5 and 1.2e-4 at -2, -4 and -30 on one
    machine, 8.8e-5 at -30 on another: the former bound, 1e-5 max(2, |p| / 2), was a reading, and failed)."""
    from test_extremes import returns_within

    W, U, s, V = matrix(48, 24, 10)
    expected = so.reference.spectral_power_svd(W, p, eps=1e-2)
    with returns_within():
        result = so.spectral_power(W, p, method, eps=1e-2)
        single = so.spectral_power(W.float(), p, method, eps=1e-2)
    assert relative_error(result, expected) < (1e-9 if method == "gram" else 1e-12)
    eigh_bound = 2.0**-24 * s.max().item() ** 2 / s.min().item() ** 2 * W.shape[1] ** 0.5 * max(1, abs(p) / 2)
    bound = eigh_bound if method == "eigh" else 1e-6 * max(20, abs(p))
    assert relative_error(single, expected) < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_negative_even_update_powers_return_in_the_op_and_the_optimizer(dtype):
    from test_extremes import returns_within

    W = matrix(48, 24, 10)[0].to(dtype)
    tolerance = 1e-9 if dtype == torch.float64 else 2e-5
    with returns_within():
        for q in (-2, -4.0):
            assert relative_error(so.power_update(W, q), so.reference.power_update_svd(W, q, 1e-2)) < tolerance
        weight = torch.nn.Parameter(torch.zeros_like(W))
        optimizer = so.optim.SpectralMuon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False,
                                          precision=None, adjust_lr_fn=lambda lr, shape: lr, update_power=-2)
        weight.grad = W
        optimizer.step()
    assert relative_error(-weight.detach(), so.reference.power_update_svd(W, -2, 1e-2)) < tolerance


@pytest.mark.parametrize("p, eps", [(1000, None), (999.5, None), (256, 1e-2), (-256, 0.5), (1000, 0.5), (-1000, 0.5),
                                    (-30.5, 1e-2)])
def test_powers_up_to_the_bound_are_right(p, eps):
    """Up to |p| = 1000 (_checks.POWER_BOUND) on both routes, in fp64, against the matrix's own factors (s_max
    = 1, and floors whose powers fit float64). A floored power's two factors, A^p and (1 - W)^(p/2), once
    needed a polynomial of (1 - w)^(p/2) (none of degree 60 exists from |p| ~ 30) and each left fp32 from
    |p| ~ 20: both are taken at p / 2^j, multiplied, divided by their peak and squared j times. The SVD route
    took s^p at unit norm, which underflowed to 0. Tolerance: the power multiplies its stages' rounding by
    |p| (1e-12 per unit on the Gram route, whose stages are designed for 1e-13: 8.7e-11 measured at 1000;
    1e-14 on the SVD's)."""
    from test_extremes import returns_within

    W, U, s, V = matrix(48, 24, 10)
    expected = reference(U, s, V, p, eps)
    scale = expected.abs().max()  # compared at unit scale: the norm of a 1e291 result would overflow

    def error(result):
        return relative_error(result / scale, expected / scale)

    with returns_within():
        assert error(so.spectral_power(W, p, "gram", eps=eps)) < abs(p) * 1e-12
        assert error(so.spectral_power(W, p, "svd", eps=eps)) < abs(p) * 1e-14
        assert error(so.reference.spectral_power_svd(W, p, eps=eps)) < abs(p) * 1e-14


@pytest.mark.parametrize("method", ["auto", "svd", "eigh"])
def test_a_large_power_on_a_factorised_route_is_not_zero(method):
    # CPU auto (eigh for p >= 2) took s^p of the unit-norm matrix: (1/8)^60 underflows fp32 on this flat
    # 64 x 64 spectrum (s_max = 1), and S_60 came out 0, silently. Tolerance: fp32's rounding of the factors
    # (1e-6), which the power multiplies by |p| (measured 1.4e-5).
    W = so.linalg.matrix_with_spectrum((64, 64), so.linalg.log_spaced_spectrum(64, 1.5), torch.float32)
    result = so.spectral_power(W, 60, method)
    assert relative_error(result, so.reference.spectral_power_svd(W.double(), 60)) < 60 * 1e-6


@pytest.mark.parametrize("q", [-0.25, 0.5, 1])
def test_power_update_scales_against_the_svd(q):
    """``scale="polar"`` (the default) renormalises to the polar factor's norm; ``"raw"`` is the floored
    power as it is, DynMuon's update. fp64: the construction's 1e-9 (above); fp32: the real powers' 2e-5."""
    W, U, s, V = matrix(64, 32, 100)
    raw = so.reference.spectral_power_svd(W, q, eps=1e-2)
    for X, tolerance in ((W, 1e-9), (W.float(), 2e-5)):
        assert relative_error(so.power_update(X, q, scale="raw"), raw) < tolerance
        polar = so.power_update(X, q)
        assert relative_error(polar, so.reference.power_update_svd(X.double(), q, 1e-2)) < tolerance
        assert math.isclose(float(polar.double().norm()), math.sqrt(32), rel_tol=tolerance)
    # q = 0 is the polar factor either way, bit for bit.
    assert torch.equal(so.power_update(W, 0, scale="raw"), so.power_update(W, 0))
    with pytest.raises(ValueError, match="scale must be one of"):
        so.power_update(W, q, scale="dynmuon")


def test_dynmuons_update_is_the_raw_power_with_its_floor():
    """docs/real-powers.md's porting table: DynMuon's update U diag(s^q) V^T with a floor of 1e-6 is
    power_update(X, q, eps=1e-6, scale="raw") in fp32 (bf16 operands raise a floor to 2^-6). A Gaussian
    momentum (kappa ~3) has every mode inside the design: fp32's 2e-5."""
    X = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    for q in (-0.25, 0.25):
        ours = so.power_update(X, q, eps=1e-6, scale="raw", precision="fp32")
        assert relative_error(ours, so.reference.spectral_power_svd(X.double(), q, eps=1e-6)) < 2e-5


def test_muon_takes_the_raw_update_scale():
    from spectral_ops.optim import SpectralMuon

    G = matrix(24, 16, 100)[0]
    weight = torch.nn.Parameter(torch.zeros_like(G))
    optimizer = SpectralMuon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, precision=None,
                             adjust_lr_fn=lambda lr, shape: lr, update_power=-0.25, update_scale="raw")
    weight.grad = G
    optimizer.step()
    assert relative_error(-weight.detach(), so.reference.spectral_power_svd(G, -0.25, eps=1e-2)) < 1e-9
    with pytest.raises(ValueError, match="update_scale must be one of"):
        SpectralMuon([torch.nn.Parameter(G)], update_power=-0.25, update_scale="norm")
