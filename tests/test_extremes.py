"""Numerics at the extremes of the dtypes (issue #17): a finite input whose exact result fits the dtype
gives a finite result at the usual accuracy; otherwise the call raises before writing anything; the
stability bound is a true upper bound at every norm.

Tolerances. Every op normalises ``W`` by a power of two and its Frobenius norm first, which is exact
(up to subnormal inputs, whose own precision is what it is), so after that the arithmetic is the
normal-range arithmetic: the tolerances are the ones the normal-range tests use for the Gram route on
a well-conditioned spectrum (condition 10, which Polar Express resolves fully): 5e-5 in float32
(a few dozen fp32 roundings through the iteration), 1e-11 in float64 (the scale ``c^p`` is applied
from its float64 log, ``|ln c^p| * 2^-53`` relative: up to ~1e-13 at 1e+-300), and 2e-2 in bfloat16
(the iteration's operands and the result are bf16, 2^-8 each).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spectral_ops as so
from spectral_ops import dispatch, plan, reference
from spectral_ops.decay import SpectralStabilityError
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error

# float16: as bfloat16, with 3 more bits (2^-11 per rounding), held to a quarter of bfloat16's.
TOLERANCE = {torch.float64: 1e-11, torch.float32: 5e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# Float32 and bfloat16 share this range; 1e-40 is subnormal in both.
SCALES_32 = (3e17, 1e30, 3e37, 1e-24, 1e-30, 1e-40)


def conditioned(shape, scale, dtype, seed=0, condition=10.0):
    """A matrix with singular values log-spaced from ``scale`` down to ``scale / condition``, built in
    float64 and rounded to ``dtype`` once (a float64 ``scale`` beyond ``dtype``'s range is the caller's
    business)."""
    r = min(shape[-2:])
    return matrix_with_spectrum(shape, log_spaced_spectrum(r, condition) * scale, dtype, seed=seed)


def symmetric_with_eigenvalues(r, scale, dtype, seed=0):
    """``Z diag(xi) Z^T`` with ``|xi|`` log-spaced over a decade below ``scale``, half of them negative."""
    Z, _ = torch.linalg.qr(torch.randn(r, r, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    xi = log_spaced_spectrum(r, 10.0) * scale * torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(r // 2)
    return ((Z * xi) @ Z.mT).to(dtype)


@contextlib.contextmanager
def returns_within(seconds: float = 60.0):
    """Fail rather than hang: a call that loops forever (a negative power's repeated squaring once did,
    ``while k: k >>= 1``) ends the test run after ``seconds``, with every thread's traceback, which names
    the loop (faulthandler: nothing under test can catch it). A healthy call here takes well under a
    second; the limit only has to end a hang."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def guard_bounds(W: torch.Tensor, precision: str | None = None):
    """The stability guard's ``(ln lower, ln upper)`` on ``s_max``, from a decay plan of ``W``."""
    precision = plan.resolve_precision(precision, W.dtype)
    return plan.GramPlan(W, dispatch.kernels_for("decay_", W), precision).log_spectral_norm_bounds()


def close(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Relative Frobenius error within the dtype's tolerance; results at the bottom of the range are held
    to the dtype's smallest normal number per entry, the most rounding to it can lose."""
    difference = float(torch.linalg.vector_norm(result.double() - expected.double()))
    slack = math.sqrt(expected.numel()) * torch.finfo(dtype).tiny
    return difference <= TOLERANCE[dtype] * float(torch.linalg.vector_norm(expected)) + slack


# ----- the reported cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES_32)
def test_the_bounds_bracket_the_largest_singular_value_at_every_norm(scale, dtype):
    W = (torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * scale).to(dtype)
    s_max = torch.linalg.matrix_norm(W.double(), ord=2)
    # The guard's bound, in the precision a decay of W iterates in (bf16's rounding widens it a little).
    log_lower, log_upper = guard_bounds(W)
    assert math.log(s_max) <= float(log_upper) <= math.log(s_max) + math.log(1.3)
    assert float(log_lower) <= math.log(s_max)
    lower, upper = so.spectral_norm_bounds(W)
    assert 0 < lower <= s_max <= upper


def test_the_bounds_are_tight_for_a_rank_one_matrix_and_still_above_it():
    # s_max = ||W||_F exactly: the only slack left is the rounding the bound is widened for.
    u = torch.randn(48, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for scale in (1e-40, 1e-20, 1.0, 1e20, 1e37):
        W = (u @ u.mT * scale).float()
        for precision in ("fp32", "bf16", "fp16", "tf32"):
            assert guard_bounds(W, precision)[1] >= math.log(torch.linalg.matrix_norm(W.double(), ord=2))


def test_the_bounds_hold_at_the_top_of_float32():
    W = torch.full((8, 8), torch.finfo(torch.float32).max)  # s_max = 8 * max: beyond float32 itself
    lower, upper = so.spectral_norm_bounds(W)
    assert math.isinf(upper) and lower == torch.finfo(torch.float32).max
    assert float(guard_bounds(W)[1]) >= math.log(8 * torch.finfo(torch.float32).max)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES_32)
def test_the_ops_are_right_at_every_norm(scale, dtype):
    W = conditioned((40, 24), scale, dtype)
    assert close(so.polar(W), reference.polar_svd(W), dtype)
    assert close(so.spectral_power(W, 0, method="gram"), reference.polar_svd(W), dtype)
    A = symmetric_with_eigenvalues(24, scale, dtype)
    assert close(so.msign(A), reference.msign_eigh(A), dtype)
    for p in (1, 3):
        expected = reference.spectral_power_svd(W, p)
        if expected.abs().max() < torch.finfo(dtype).max / 64:
            assert close(so.spectral_power(W, p, method="gram"), expected, dtype)
    tau = 0.5 * scale
    assert close(so.svt(W, tau), reference.svt_svd(W, tau), dtype)
    P_top, _ = so.band_projectors(W, tau)
    assert close(P_top, reference.band_projectors_svd(W, tau)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unstable_decay_of_a_huge_matrix_is_refused(dtype):
    # Reported: the fp32 norm overflowed, the bounds were (0, 0), the guard passed and W became NaN.
    W = (torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 3e17).to(dtype)
    before = W.clone()
    with pytest.raises(SpectralStabilityError):
        so.spectral_decay_(W, 2, 1e-3, 0.1)
    assert torch.equal(W, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [3e17, 1e-24, 1e-40])
def test_a_p0_decay_moves_the_weights_at_every_norm(scale, dtype):
    # Reported: at 3e17 p = 0 did nothing (the polar factor was zero), at 1e-24 it wrote NaN.
    W = conditioned((32, 32), scale, dtype)
    expected = reference.spectral_decay_svd(W, 0, 1e-3, 0.1)
    so.spectral_decay_(W, 0, 1e-3, 0.1)
    assert close(W, expected, dtype)


def test_a_large_power_whose_result_fits_is_finite():
    # Reported: ||W||_F^22 (~1e40) overflowed although the largest entry of S_22 is ~2e25.
    W = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    result = so.spectral_power(W, 22, method="gram")
    expected = reference.spectral_power_svd(W, 22)
    # A random square matrix is ill-conditioned at the bottom, but S_22 weights those modes by s^22:
    # the error is the top modes', amplified 22-fold by the exponent.
    assert relative_error(result, expected) < 22 * TOLERANCE[torch.float32]


def test_a_stable_decay_whose_direction_alone_overflows_is_written():
    # Reported: S_4 of a matrix at ||W||_F = 1e10 is ~1e40, out of float32, but lr * lambda * S_4 is tiny.
    W = conditioned((48, 48), 1e10, torch.float32)
    expected = reference.spectral_decay_svd(W, 4, 1e-3, 1e-40)
    so.spectral_decay_(W, 4, 1e-3, 1e-40)
    assert torch.isfinite(W).all() and close(W, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_result_beyond_the_dtype_raises(dtype):
    big = 1e30 if dtype != torch.float64 else 1e200
    W = conditioned((24, 16), big, dtype)
    for op in (lambda: so.spectral_power(W, 2, method="gram"), lambda: so.spectral_power(W, 2, method="svd"),
               lambda: so.spectral_power(W, 2, method="eigh"), lambda: so.band_direction(W, big / 2, 2, "top_only")):
        with pytest.raises(OverflowError, match="does not fit"):
            op()


def test_a_decay_whose_new_weights_overflow_writes_nothing():
    W = conditioned((16, 16), 1e20, torch.float32)
    before = W.clone()
    with pytest.raises(OverflowError, match="nothing was written"):
        so.spectral_decay_(W, 3, 1.0, 1.0, stability="ignore")
    assert torch.equal(W, before)


def test_powers_of_two_scale_the_results_exactly():
    # The normalisation divides by a power of two and ||W||_F: a power-of-two rescaled input gives the
    # same normalised matrix, bit for bit, and so the same polar factor.
    W = conditioned((20, 12), 1.0, torch.float32)
    for exponent in (-100, -60, 60, 120):  # the input stays normal: no precision is lost in it
        assert torch.equal(so.polar(W * 2.0**exponent), so.polar(W))


def test_a_zero_matrix_stays_zero():
    Z = torch.zeros(2, 8, 6)
    assert torch.equal(so.polar(Z), Z)
    assert torch.equal(so.spectral_power(Z, 3, method="gram"), Z)
    assert torch.equal(so.svt(Z, 1.0), Z)
    assert torch.equal(torch.stack(so.spectral_norm_bounds(Z)), torch.zeros(2, 2))


# Every op of a zero matrix, as (name, call): each gives 0, whatever the power, bound or method.
ZERO_CALLS = [
    *[(f"spectral_power p={p} eps={eps} {method}", lambda Z, p=p, eps=eps, method=method:
       so.spectral_power(Z, p, method, eps=eps))
      for p, eps in ((-2, 1e-2), (-0.5, 1e-2), (0, None), (0.5, None), (2, None), (3, None), (2, 1e-2))
      for method in ("gram", "svd", "auto")],
    *[(f"power_update q={q} {scale}", lambda Z, q=q, scale=scale: so.power_update(Z, q, scale=scale))
      for q in (-0.5, -0.25, 0, 0.25, 1) for scale in ("polar", "raw")],
    *[(f"spectral_clip {bounds} {method}", lambda Z, bounds=bounds, method=method:
       so.spectral_clip(Z, **bounds, method=method))
      for bounds in ({"min": 0.1}, {"max": 0.1}, {"min": 0.1, "max": 0.5}) for method in ("gram", "svd")],
    *[(f"band_direction {mode} {method}", lambda Z, mode=mode, method=method:
       so.band_direction(Z, 0.5, 1 if mode == "clip" else 2, mode, p_bot=0.5, method=method))
      for mode in ("top", "bot", "top_only", "bot_only", "two_band", "clip") for method in ("gram", "svd")],
    *[(f"svt {method}", lambda Z, method=method: so.svt(Z, 1.0, method=method)) for method in ("gram", "svd")],
    ("polar", lambda Z: so.polar(Z)),
    *[(f"spectral_decay p={p} {p0_mode}", lambda Z, p=p, p0_mode=p0_mode:
       so.spectral_decay(Z, p, 0.1, 0.5, ordinary_weight_decay=0.1, p0_mode=p0_mode))
      for p, p0_mode in ((0, "explicit"), (0, "prox"), (0.5, "explicit"), (2, "explicit"))],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_zero_matrix_gives_zero_for_every_op_and_power(dtype):
    """The docs' promise, for every op and power: a zero matrix has no singular vectors, so every spectral
    form of it is 0. Its ln ||W||_F = -inf made c^p = inf for p < 0 (0 * inf: NaN, reported as an
    OverflowError) and a floor's min / c inf (the Gram route's clip); power_update divided 0 by 0."""
    Z = torch.zeros(2, 6, 4, dtype=dtype)
    with warnings.catch_warnings(), returns_within():
        warnings.simplefilter("error")
        for name, call in ZERO_CALLS:
            result = call(Z)
            assert torch.equal(result, torch.zeros_like(result)), name
        A = torch.zeros(4, 4, dtype=dtype)
        assert torch.equal(so.msign(A), A)
        P_top, P_bot = so.band_projectors(Z, 0.5)
        assert torch.equal(P_top, torch.zeros_like(P_top))
        assert torch.equal(P_bot, torch.eye(4, dtype=dtype).expand(2, 4, 4))


@pytest.mark.parametrize("method", ["gram", "svd"])
def test_a_zero_matrix_inside_a_stack_is_zero_and_the_others_are_right(method):
    # One zero matrix in a stack: its 0 must not reach the others (one scale per matrix), nor theirs it.
    W = conditioned((3, 12, 8), 1.0, torch.float64)
    W[1] = 0
    cases = [(lambda X: so.spectral_power(X, -0.5, method, eps=1e-2),
              lambda X: reference.spectral_power_svd(X, -0.5, 1e-2)),
             (lambda X: so.power_update(X, -0.25), lambda X: reference.power_update_svd(X, -0.25, 1e-2)),
             (lambda X: so.spectral_clip(X, min=0.3, method=method), lambda X: reference.spectral_clip_svd(X, 0.3))]
    for ours, oracle in cases:
        result = ours(W)
        assert torch.equal(result[1], torch.zeros_like(result[1]))
        for i in (0, 2):
            # fp64 tolerance of the real-power construction (docs/real-powers.md: its stages are designed for
            # 1e-13, the products add their rounding); the clip's sign steps resolve modes 1% from the bound.
            assert relative_error(result[i], oracle(W[i])) < 1e-9


def test_muon_steps_an_exactly_zero_gradient_with_a_negative_power():
    """A zero gradient gives a zero update (it gave NaN: every step was skipped, and the weight decay
    with it): the decoupled decay W <- (1 - lr lambda_1) W runs and nothing is skipped."""
    W0 = conditioned((12, 8), 1.0, torch.float32)
    weight = torch.nn.Parameter(W0.clone())
    optimizer = so.optim.SpectralMuon([weight], lr=0.1, weight_decay=0.5, update_power=-0.25)
    for _ in range(2):
        weight.grad = torch.zeros_like(weight)
        optimizer.step()
    torch.testing.assert_close(weight.detach(), W0 * (1 - 0.1 * 0.5) ** 2)
    assert all(int(count) == 0 for count in optimizer.skipped.values())


UPDATE_POWERS = (-1, -0.5, 0, 0.25, 0.5, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("q", UPDATE_POWERS)
def test_power_update_is_scale_invariant(q, dtype):
    """power_update renormalises, so X and a X give the same update for every a > 0. It took the
    Frobenius norm of the unscaled power: at |q| = 1 that underflowed (1e-30 X) or overflowed (1e30 X)
    fp32, and the update came out 8.7e8 times too large, or 0. Against the FP64 SVD of each (rounded)
    input: fp32's tolerance above; fp64 the real-power construction's (stages designed for 1e-13)."""
    X = torch.randn(24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tolerance = 1e-9 if dtype == torch.float64 else TOLERANCE[torch.float32]
    with returns_within():
        for scale in (1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30):
            scaled = (X * scale).to(dtype)
            update = so.power_update(scaled, q)
            assert relative_error(update, reference.power_update_svd(scaled, q, 1e-2)) < tolerance, scale


def test_muon_takes_the_same_step_for_a_tiny_gradient():
    # The issue: update_power=1 on a 1e-25 gradient stepped by 1.7e11 (no skip); Muon's step is the same at any
    # gradient scale (fp32: the update's rounding).
    G = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    steps = []
    for scale in (1.0, 1e-25, 1e25):
        weight = torch.nn.Parameter(torch.zeros(24, 16))
        optimizer = so.optim.SpectralMuon([weight], lr=0.02, weight_decay=0.0, update_power=1.0, precision="fp32")
        weight.grad = G * scale
        optimizer.step()
        steps.append(weight.detach().clone())
    for step in steps[1:]:
        assert relative_error(step, steps[0]) < TOLERANCE[torch.float32]


def good_weight():
    return conditioned((12, 8), 1.0, torch.float32)


@pytest.mark.parametrize("call, match", [
    (lambda W: so.spectral_power(W, 1e30), r"p=1e\+30 is beyond the powers the ops take \(\|p\| <= 1000\)"),
    (lambda W: so.spectral_power(W, -1e30, eps=1e-2), r"p=-1e\+30 is beyond"),
    (lambda W: so.spectral_power(W, 1000.5), r"p=1000.5 is beyond"),
    (lambda W: so.power_update(W, 1e30), r"q=1e\+30 is beyond"),
    (lambda W: so.band_direction(W, 0.5, 2, "two_band", p_bot=1e30), r"p_bot=1e\+30 is beyond"),
    (lambda W: so.spectral_decay_(W, 1e30, 0.1, 0.1), r"p=1e\+30 is beyond"),
    (lambda W: so.spectral_power(W, 0.5, eps=1e30), r"eps=1e\+30 is beyond the floors the ops take \(eps <= 1e\+08"),
    # The Gram route once failed here deep in the design, with "need 0 < lower < 1" and no name.
    (lambda W: so.spectral_power(W, -0.5, "gram", eps=1e20), r"eps=1e\+20 is beyond"),
    (lambda W: so.power_update(W, -0.25, eps=1e30), r"eps=1e\+30 is beyond"),
    (lambda W: so.optim.SpectralMuon([torch.nn.Parameter(W)], update_power=1e30), r"update_power=1e\+30 is beyond"),
    (lambda W: so.optim.SpectralMuon([torch.nn.Parameter(W)], update_power=-0.25, update_eps=1e30),
     r"update_eps=1e\+30 is beyond"),
    (lambda W: so.optim.SpectralAdamW([torch.nn.Parameter(W)], p=1e30, spectral_weight_decay=0.1),
     r"p=1e\+30 is beyond"),
    (lambda W: plan.cost("spectral_power", tuple(W.shape), p=1e30), r"p=1e\+30 is beyond"),
])
def test_a_power_or_floor_beyond_its_bound_is_refused_by_name(call, match):
    """p or q = 1e30 raised "OverflowError: int too big to convert" from deep in the plan (the integer
    route's p * ln c); eps = 1e30 "need 0 < lower < 1". Now a ValueError names the argument and its
    bound, before anything is written."""
    W = good_weight()
    with returns_within(), pytest.raises(ValueError, match=match):
        call(W)
    assert torch.equal(W, good_weight())


def test_a_scheduled_power_beyond_the_bound_raises_before_the_step_writes():
    weight = torch.nn.Parameter(good_weight())
    optimizer = so.optim.SpectralMuon([weight], update_power=lambda step: 1e30)
    weight.grad = torch.ones(12, 8)
    with returns_within(), pytest.raises(ValueError, match=r"update_power=1e\+30 is beyond"):
        optimizer.step()
    assert torch.equal(weight.detach(), good_weight())


def test_powers_and_floors_at_their_bounds_are_taken():
    # s_max = 1: S_1000 is the top mode, in range; against the FP64 SVD at the real-power construction's
    # fp64 tolerance (as above), which the squarings' 1000-fold amplification of a relative error still meets.
    W = conditioned((12, 8), 1.0, torch.float64)
    with returns_within():
        assert relative_error(so.spectral_power(W, 1000, "gram"), reference.spectral_power_svd(W, 1000)) < 1e-9
        floored = so.spectral_power(W, -0.5, "gram", eps=1e8)
        assert relative_error(floored, reference.spectral_power_svd(W, -0.5, 1e8)) < 1e-9


def test_every_loop_over_a_callers_count_ends():
    """Step counts are bounded (Polar Express converges in about 12, Newton-Schulz's sign in about 30):
    10^9 steps would design and iterate for hours. The norm bounds' squarings stop being useful at 64
    (every level is then s_max to float64's rounding): more return the same bounds at once."""
    W = good_weight()
    with returns_within():
        for call in (lambda: so.polar(W, steps=10**9), lambda: so.coefficients.polar_express_coefficients(10**9),
                     lambda: so.msign(W.mT @ W, steps=10**9), lambda: so.svt(W, 0.5, sign_steps=10**9)):
            with pytest.raises(ValueError, match="at most 1000"):
                call()
        assert so.polar(W, steps=1000).shape == W.shape
        torch.testing.assert_close(so.spectral_norm_bounds(W, 10**9), so.spectral_norm_bounds(W, 64), rtol=0, atol=0)


def test_the_frobenius_bound_is_an_upper_bound_at_every_norm():
    for scale, dtype in ((1.0, torch.float32), (1e25, torch.float32), (1e-25, torch.float32), (1e-40, torch.float32),
                         (1e-200, torch.float64), (1e200, torch.float64)):
        W = conditioned((3, 16, 8), scale, dtype)
        # The guard's first level: ||W||_F, before any product.
        _, log_norm = next(plan.GramPlan(W, dispatch.kernels_for("decay_", W), "fp32").spectral_norm_levels())
        # The squares leave float64, so the reference norm is taken at unit scale; its log carries a
        # rounding of ~|ln scale| * 2^-53 (5e-14 at 1e200), allowed for.
        exact = torch.linalg.matrix_norm(W.double() / scale).log() + math.log(scale)
        assert (log_norm >= exact - 1e-12).all()
        assert torch.allclose(log_norm, exact, atol=1e-5)


def test_the_stability_kappa_is_computed_in_logs():
    log_s_max = torch.tensor([math.log(1e15), -math.inf, math.log(1e-30)], dtype=torch.float64)
    kappa = plan.stability_kappa(1e-3, 1e-50, log_s_max, 4)
    assert torch.allclose(kappa[0], torch.tensor(1e-8, dtype=torch.float64), rtol=1e-12)
    assert kappa[1] == 0 and math.isclose(kappa[2], 1e-143, rel_tol=1e-12)
    assert plan.stability_kappa(1e-3, 0.1, log_s_max, 4, cap=1e3)[0] == pytest.approx(1e-4 * 1e9, rel=1e-12)


# ----- the property: accurate where the result fits, a clean refusal where it does not


def _expected_outcome(expected: torch.Tensor, dtype: torch.dtype):
    """True: must fit; False: must raise; None: within a factor 64 of the largest number, either."""
    largest = float(expected.abs().max())
    if largest > torch.finfo(dtype).max:
        return False
    return True if largest < torch.finfo(dtype).max / 64 else None


# The decimal exponents of the largest singular value drawn per dtype: 1e-30..1e30 where the dtype holds
# them, float16's own range (subnormal 6e-8 to 65504) for float16.
LOG_SCALES = {torch.float16: (-7.0, 5.0)}


def scaled(case):
    """A case of ``cases`` with its norm's exponent drawn in its dtype's range (LOG_SCALES)."""
    batch, m, n, dtype, p, unit, seed = case
    low, high = LOG_SCALES.get(dtype, (-30.0, 30.0))
    return batch, m, n, dtype, p, low + unit * (high - low), seed


# A stack (2,) of m x n matrices, vectors (m or n = 1) included: read as said ("batch"), as an op reads no
# stack of vectors unsaid (tests/test_matrix_views.py).
matrices = st.tuples(
    st.sampled_from([(), (2,)]),
    st.integers(1, 24), st.integers(1, 24),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    st.integers(0, 4),
    st.floats(0, 1),
    st.integers(0, 2**16),
).map(scaled)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(matrices)
def test_spectral_power_is_accurate_or_refuses(case):
    batch, m, n, dtype, p, log_scale, seed = case
    W = conditioned((*batch, m, n), 10.0**log_scale, dtype, seed)
    before = W.clone()
    expected = reference.spectral_power_svd(W, p)
    fits = _expected_outcome(expected, dtype)
    try:
        result = so.spectral_power(W, p, method="gram", matrix_view="batch")
    except (ValueError, ArithmeticError):
        assert fits is not True
    else:
        assert fits is not False
        assert torch.isfinite(result).all() and close(result, expected, dtype)
    assert torch.equal(W, before)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(matrices)
def test_spectral_decay_never_makes_a_finite_weight_non_finite(case):
    batch, m, n, dtype, p, log_scale, seed = case
    W = conditioned((*batch, m, n), 10.0**log_scale, dtype, seed)
    before = W.clone()
    expected = reference.spectral_decay_svd(W, p, 1e-3, 0.1)
    try:
        so.spectral_decay_(W, p, 1e-3, 0.1, matrix_view="batch")
    except (ValueError, ArithmeticError):
        assert torch.equal(W, before)
    else:
        assert torch.isfinite(W).all() and close(W, expected, dtype)
