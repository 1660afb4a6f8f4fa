"""Closed forms against numerical integration and the package's own decay, the teacher solver against
its optimality equation, the trained teacher against the analytic optimum, and the SPEC 5 loop."""

import math

import numpy as np
import pytest
import torch

import spectral_ops as so
from spectral_ops import analysis
from spectral_ops.metrics import singular_values
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum

S0 = torch.tensor([3.0, 1.0, 0.4, 0.05], dtype=torch.float64)


def rk4(s0, lam, t, p, steps):
    """Classical RK4 for ds/dt = -lam s^p (p >= 1, where the right-hand side is smooth)."""
    s, h = s0.clone(), t / steps
    rate = lambda x: -lam * x**p  # noqa: E731
    for _ in range(steps):
        k1 = rate(s)
        k2 = rate(s + h / 2 * k1)
        k3 = rate(s + h / 2 * k2)
        k4 = rate(s + h * k3)
        s = s + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return s


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_pure_decay_matches_rk4(p):
    # RK4's global error is O(h^4): with h = 1e-3 and |d^5 s/dt^5| = O(1e2) here, ~1e-10 at most.
    lam, t = 0.5, 2.0
    closed = analysis.pure_decay(S0, lam, t, p)
    assert torch.allclose(closed, rk4(S0, lam, t, p, 2000), rtol=1e-9, atol=0)


def test_pure_decay_p0_removes_the_same_amount_until_zero():
    # ds/dt = -lam while s > 0: the exact solution is linear, and a mode stays at 0 once it gets there.
    lam, t = 0.5, 1.0
    assert torch.equal(analysis.pure_decay(S0, lam, t, 0), torch.tensor([2.5, 0.5, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(analysis.pure_decay(torch.zeros(3), lam, t, 2), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("p", [0, 2])
def test_pure_decay_is_the_limit_of_the_package_decay_steps(p):
    """Many small in-place steps of spectral_decay_ integrate the same flow.

    Explicit Euler has global error ~ t h max|s''| / 2 = 2e-3 * 1 * O(1) for p = 2; p = 0's flow is
    linear, so its steps are exact (up to the polar factor's round-off) until a mode hits zero.
    """
    lam, t, steps = 0.5, 1.0, 500
    W = matrix_with_spectrum((12, 4), S0)
    for _ in range(steps):
        so.spectral_decay_(W, p, lr=t / steps, spectral_weight_decay=lam, p0_mode="prox")
    expected = analysis.pure_decay(S0, lam, t, p)
    assert torch.allclose(singular_values(W), expected, atol=5e-3 if p == 2 else 1e-8)


@pytest.mark.parametrize("p", [0, 1, 2, 4])
def test_time_to_shrink_inverts_pure_decay(p):
    times = analysis.time_to_shrink(S0, 0.3, 0.7, p)
    assert torch.allclose(analysis.pure_decay(S0, 0.7, times, p), 0.3 * S0, rtol=1e-13)


@pytest.mark.parametrize("p", [0, 1, 2, 4])
def test_frobenius_log_rate_is_the_derivative_of_the_norm(p):
    # Central difference: truncation h^2 |f'''| / 6 <~ 1e-9 (|f'''| ~ 1e4 for p = 4 here) and
    # round-off ~ eps / h ~ 1e-10, both well under the 1e-8 asserted.
    lam, h = 0.3, 1e-6
    log_norm = lambda t: torch.log(torch.linalg.vector_norm(analysis.pure_decay(S0, lam, t, p)))  # noqa: E731
    numerical = (log_norm(h) - log_norm(-h)) / (2 * h)
    assert math.isclose(float(analysis.frobenius_log_rate(S0, lam, p)), float(numerical), rel_tol=1e-8)


def test_decay_matrix_and_checkpoint():
    W = matrix_with_spectrum((10, 4), S0, dtype=torch.float32, seed=1)
    # p = 1 is plain exponential shrinkage of the whole matrix.
    assert torch.allclose(analysis.decay_matrix(W, 0.5, 2.0, 1), math.exp(-1.0) * W.double(), atol=1e-12)
    decayed = analysis.decay_matrix(W, 0.5, 2.0, 2)
    assert torch.allclose(singular_values(decayed), analysis.pure_decay(singular_values(W), 0.5, 2.0, 2), atol=1e-12)
    state = {"layer.weight": W, "layer.bias": torch.ones(10), "steps": torch.tensor(3)}
    result = analysis.decay_checkpoint(state, 0.5, 2.0, 2)
    assert result["layer.weight"].dtype == torch.float32
    assert torch.allclose(result["layer.weight"].double(), decayed, atol=1e-6)  # float32 rounding of the result
    assert torch.equal(result["layer.bias"], state["layer.bias"]) and torch.equal(result["steps"], state["steps"])
    assert torch.equal(analysis.decay_checkpoint([W], 0.5, 2.0, 2)[0], result["layer.weight"])


@pytest.mark.parametrize("p", [0, 1, 2, 4])
def test_shape_step_matches_one_package_decay_step(p):
    # Both sides are float64 SVD-level computations: agreement to ~1e-13.
    s = log_spaced_spectrum(6, 20.0)
    W = matrix_with_spectrum((9, 6), s, seed=2)
    step = 0.02  # below the smallest mode (0.05), so p = 0 crosses nothing either
    so.spectral_decay_(W, p, lr=1.0, spectral_weight_decay=step)
    after = singular_values(W)
    r_plus = analysis.shape_step(s, step, p)
    assert torch.allclose(r_plus, after / after[0], atol=1e-12)
    r = s / s[0]
    if p == 1:
        assert torch.allclose(r_plus, r, atol=1e-15)
    elif p > 1:
        assert bool((r_plus >= r - 1e-15).all())  # flattens
    else:
        assert bool((r_plus <= r + 1e-15).all())  # sharpens


def test_shape_step_refuses_a_crossing():
    with pytest.raises(ValueError, match="through zero"):
        analysis.shape_step(S0, 1.0 / 9.0, 3)  # kappa = s_1^2 / 9 = 1
    with pytest.raises(ValueError, match="through zero"):
        analysis.shape_step(S0, 0.1, 0)  # the 0.05 mode would go below zero


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("lam", [0.0, 0.2, 5.0])
def test_teacher_singular_values_solve_the_optimality_equation(p, lam):
    a = torch.tensor([0.0, 1e-6, 0.05, 0.4, 1.0, 4.0, 100.0], dtype=torch.float64)
    s = analysis.teacher_singular_values(a, lam, p)
    assert bool((s >= 0).all()) and bool((s <= a).all())
    # Newton converges to round-off: the residual is a few ulps of a.
    assert torch.allclose(s + lam * s**p, a, rtol=1e-14, atol=1e-300)
    assert bool((torch.diff(s) >= 0).all())  # the root is increasing in a


def test_teacher_closed_forms():
    a = torch.tensor(analysis.TEACHER_SINGULAR_VALUES, dtype=torch.float64)
    lam = analysis.TEACHER_LAMBDA
    assert torch.equal(analysis.teacher_singular_values(a, lam, 0), (a - lam).clamp_min(0))
    assert torch.allclose(analysis.teacher_singular_values(a, lam, 1), a / (1 + lam), rtol=1e-15)
    p2 = (torch.sqrt(1 + 4 * lam * a) - 1) / (2 * lam)
    assert torch.allclose(analysis.teacher_singular_values(a, lam, 2), p2, rtol=1e-14)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_teacher_optimum_is_a_stationary_point_of_the_matrix_objective(p):
    # grad of 1/2||W - A||^2 + lam/(p+1) sum s^(p+1) is W - A + lam S_p(W); float64 SVD accuracy.
    problem = analysis.linear_teacher_problem()
    U, a, Vh = torch.linalg.svd(problem.A)
    W = (U * analysis.teacher_singular_values(a, problem.lam, p)) @ Vh
    gradient = W - problem.A + problem.lam * so.spectral_power(W, p, method="svd")
    assert float(torch.linalg.matrix_norm(gradient)) < 1e-13


def test_linear_teacher_problem_is_exactly_white():
    problem = analysis.linear_teacher_problem()
    N, d = problem.X.shape
    assert (N, d) == (analysis.TEACHER_SAMPLES, len(analysis.TEACHER_SINGULAR_VALUES))
    # QR is backward stable: orthonormality holds to ~d * eps.
    assert torch.allclose(problem.X.mT @ problem.X / N, torch.eye(d, dtype=torch.float64), atol=1e-14)
    assert float(problem.X.mean(0).abs().max()) < 1e-14  # +/- pairs centre every column
    assert torch.allclose(singular_values(problem.A), problem.singular_values, rtol=1e-14)
    U, _, _ = torch.linalg.svd(problem.A)
    assert float((U - torch.diag(torch.diagonal(U))).abs().max()) > 0.1  # singular vectors are not the axes


@pytest.mark.parametrize("p", [0, 1, 2, 4])
def test_trained_teacher_matches_the_analytic_optimum(p):
    """300 steps contract the error by (1 - lr)^300 ~ 2e-14 relative; round-off adds ~1e-15.

    For p = 0 the proximal step is svt without an SVD; its accuracy is what this checks.
    """
    problem = analysis.linear_teacher_problem()
    trained = analysis.train_linear_teacher(problem, p, steps=300, progress=False)
    U, a, Vh = torch.linalg.svd(problem.A)
    s_star = analysis.teacher_singular_values(a, problem.lam, p)
    assert torch.allclose(singular_values(trained.W), s_star, atol=1e-12)
    assert torch.allclose(trained.W, (U * s_star) @ Vh, atol=1e-12)
    assert analysis.covariance_identity_error(problem, trained.W) < 1e-14
    assert all(b <= a + 1e-14 for a, b in zip(trained.objective, trained.objective[1:]))  # descent


def _norm_recursion_residual(trajectory, eta, lam, schedule):
    """``||w+||^2 - (1 - eta_t lam)^2 ||w||^2 - eta_t^2 ||g||^2`` with ``||g|| = sin(angle) / ||w||``."""
    norm = np.vstack([trajectory.norm, trajectory.final_norm[None]])
    lr = eta * schedule[:, None]
    gradient_sq = (1 - trajectory.alignment**2) / trajectory.norm**2
    predicted = (1 - lr * lam) ** 2 * trajectory.norm**2 + lr**2 * gradient_sq
    return np.abs(norm[1:] ** 2 - predicted) / norm[1:] ** 2


@pytest.mark.parametrize("schedule", [analysis.constant_schedule(300), analysis.cosine_schedule(300, final=0.1)])
def test_normalised_network_follows_the_norm_recursion(schedule):
    # The gradient is exactly orthogonal to w, so the SPEC 5 recursion holds to round-off.
    eta, lam = np.array([0.05, 0.3]), np.array([0.1, 0.01])
    trajectory = analysis.simulate_normalised_network(eta, lam, schedule, progress=False)
    assert _norm_recursion_residual(trajectory, eta, lam, schedule).max() < 1e-12
    assert np.allclose(trajectory.effective_lr, trajectory.nominal_lr / trajectory.norm**2, rtol=1e-15)
    assert np.allclose(trajectory.nominal_lr, eta * schedule[:, None], rtol=1e-15)


def test_schedules():
    cosine = analysis.cosine_schedule(101, final=0.1)
    assert cosine[0] == 1.0 and math.isclose(cosine[-1], 0.1) and bool((np.diff(cosine) <= 0).all())
    assert bool((analysis.constant_schedule(5) == 1).all())


def _trajectory(norms):
    norms = np.asarray(norms, float)[:, None]
    ones = np.ones((len(norms) - 1, 1))
    return analysis.NormalisedTrajectory(nominal_lr=ones, norm=norms[:-1], effective_lr=ones, alignment=ones,
                                         final_norm=norms[-1])


def test_classify_regime_on_known_trajectories():
    t = np.arange(400)
    assert analysis.classify_regime(_trajectory(np.exp(-0.01 * t)), 0.1, 0.1)[0] == "converge"  # monotone drift
    assert analysis.classify_regime(_trajectory(1 + 0.01 * np.sin(t)), 0.1, 0.1)[0] == "converge"  # 1% wiggle
    sawtooth = np.exp(-0.01 * (t % 50))
    assert analysis.classify_regime(_trajectory(sawtooth), 0.1, 0.1)[0] == "oscillate"
    assert analysis.classify_regime(_trajectory(np.exp(0.05 * t)), 0.1, 0.1)[0] == "diverge"
    assert analysis.classify_regime(_trajectory(np.ones(400)), 3.0, 1.0)[0] == "diverge"  # 1 - eta lam = -2


def test_regime_map_facts():
    etas, lams = np.array([0.05, 0.1, 4.0]), np.array([0.0, 0.1, 1.0])
    regimes = analysis.regime_map(etas, lams, 1500, progress=False)
    assert (regimes[:, 0] == "converge").all()  # no decay: the norm only grows, ||g|| -> 0
    assert regimes[2, 2] == "diverge"  # 1 - eta lam = -3
    # SPEC 5: a constant lr with decay does not settle, once eta lam t is large enough.
    assert regimes[1, 1] == "oscillate"


def test_width_rules():
    # The rule lives in optim (tests/test_optim_groups.py); the README documents it here too.
    assert analysis.width_scaled_hyperparameters is so.optim.width_scaled_hyperparameters
    assert math.isclose(analysis.adamw_top_singular_value_scale(1e-3, 0.1, 16), 0.1 * 8)
    for p in (0, 1, 2, 4):
        s = analysis.spectral_balance_scale(3e-3, 0.2, p)
        assert math.isclose(0.2 * s ** (p + 1), 3e-3)  # the balance lam_p s^(p+1) = eta
    assert math.isclose(analysis.spectral_balance_scale(1e-3, 0.1, 1), math.sqrt(1e-2))
