"""Closed forms against numerical integration and the package's own decay, the teacher solver against
its optimality equation, the trained teacher against the analytic optimum, and the SPEC 5 loop."""

import dataclasses
import math

import numpy as np
import pytest
import torch

import spectral_ops as so
from spectral_ops import analysis
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum
from spectral_ops.metrics import singular_values

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
    with pytest.raises(ValueError, match=r"p \* kappa .* reaches 3 >= 1 \(kappa = 1\)"):
        analysis.shape_step(S0, 1.0 / 9.0, 3)  # kappa = s_1^2 / 9 = 1
    with pytest.raises(ValueError, match="through zero"):
        analysis.shape_step(S0, 0.1, 0)  # the 0.05 mode would go below zero


def test_shape_step_refuses_a_step_that_reorders_the_modes():
    """kappa = 0.8 < 1 but p * kappa = 1.6: s -> s - 0.8 s^2 sends (1, 0.7) to (0.2, 0.308), so the
    second mode overtakes the first and its r would be 1.54 > 1. Just below, p * kappa = 0.99, the
    shape stays a shape (r <= 1, the top mode still on top)."""
    s = torch.tensor([1.0, 0.7, 0.3, 0.1], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"p \* kappa = p \* step \* s_1\^\(p-1\) reaches 1.6 >= 1 \(kappa = 0.8\)"):
        analysis.shape_step(s, 0.8, 2)
    with pytest.raises(ValueError, match=r"reaches 1 >= 1"):
        analysis.shape_step(s, 0.5, 2)  # exactly on the condition: the slope at s_1 is 0
    with pytest.raises(ValueError, match=r"reaches 1.2 >= 1 \(kappa = 0.3\)"):
        analysis.shape_step(s, 0.3, 4)
    r_plus = analysis.shape_step(s, 0.495, 2)
    # float64 arithmetic on numbers of order 1: the exact map to ~1e-16.
    mapped = s - 0.495 * s**2
    assert torch.allclose(r_plus, mapped / mapped[0], rtol=0, atol=1e-15)
    assert r_plus[0] == 1 and bool((r_plus[1:] < 1).all())


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
                                         gradient_norm=ones, final_norm=norms[-1])


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


def test_regime_maps_classify_prefixes_of_one_run():
    etas, lams, noisy = np.array([0.05, 1.0, 4.0]), np.array([0.01, 0.1, 1.0]), dict(gradient_noise=0.3, progress=False)
    # One generator drawn step by step and the same arithmetic per step: the prefix of a long run is
    # the short run bit for bit.
    long, short = (analysis.simulate_normalised_network(etas, lams[:, None], analysis.constant_schedule(steps), **noisy)
                   for steps in (300, 60))
    prefix = long.prefix(60)
    assert all(np.array_equal(getattr(prefix, field.name), getattr(short, field.name))
               for field in dataclasses.fields(short))
    maps = analysis.regime_maps(etas, lams, (300, 60), **noisy)
    assert all((maps[steps] == analysis.regime_map(etas, lams, steps, **noisy)).all() for steps in (300, 60))
    assert (maps[300] != maps[60]).any()  # the horizons do differ here: not one map under two keys
    with pytest.raises(ValueError, match="prefix"):
        long.prefix(301)


def _noisy_equilibrium_runs(steps=10_000):
    """Second halves of noisy runs (noise 0.3, as in the feedback-loop experiment): x = ||w||^2, c^2."""
    eta, lam = np.array([0.1, 1.0, 0.01]), np.array([0.02, 0.05, 0.5])
    trajectory = analysis.simulate_normalised_network(eta, lam, analysis.constant_schedule(steps),
                                                      gradient_noise=0.3, progress=False)
    x = trajectory.norm[steps // 2:] ** 2
    return eta, lam, x, (x * trajectory.gradient_norm[steps // 2:] ** 2).mean(0)


def test_equilibrium_norm_is_the_fixed_point_and_matches_the_noisy_simulator():
    eta, lam, x, c_sq = _noisy_equilibrium_runs()
    n_star = analysis.equilibrium_norm(eta, lam, np.sqrt(c_sq))
    # The closed form is the fixed point of the recursion (round-off) ...
    fixed = (1 - eta * lam) ** 2 * n_star**2 + eta**2 * c_sq / n_star**2
    assert np.allclose(fixed, n_star**2, rtol=1e-13)
    # ... and the sqrt(eta C / (lam (2 - eta lam))) is n*^2 with C = c^2, not n*.
    assert np.allclose(np.sqrt(eta * c_sq / (lam * (2 - eta * lam))), n_star**2, rtol=1e-13)
    # The noisy runs hover around it: mean(c^2 / x) is not c^2 / mean(x) (fluctuations of a few % in x,
    # second order) and ~40+ relaxation times are averaged, so 1% (measured: <= 0.3%).
    assert np.allclose(x.mean(0), n_star**2, rtol=0.01)
    with pytest.raises(ValueError, match="eta lam"):
        analysis.equilibrium_norm(1.0, 2.0, 1.0)


def test_equilibrium_norm_slope_linearises_the_map_and_the_noisy_equilibrium_is_stable():
    eta, lam, c = 0.3, 0.2, 0.7
    n_star = float(analysis.equilibrium_norm(eta, lam, c))
    F = lambda n: math.sqrt((1 - eta * lam) ** 2 * n**2 + eta**2 * c**2 / n**2)  # noqa: E731
    h = 1e-5 * n_star  # central difference: truncation ~ h^2, round-off ~ 1e-16 / h
    assert math.isclose((F(n_star + h) - F(n_star - h)) / (2 * h), analysis.equilibrium_norm_slope(eta, lam),
                        rel_tol=1e-8)
    slopes = analysis.equilibrium_norm_slope(np.linspace(0.01, 1.99, 199), 1.0)
    assert (np.abs(slopes) <= 1).all() and math.isclose(analysis.equilibrium_norm_slope(1.0, 1.0), -1.0)
    # Under noise the deviations of x = ||w||^2 follow x+ - x* ~ F'(n*) (x - x*) + noise, an AR(1)
    # process whose lag-1 autocorrelation is F'. ~5000 correlated samples: std ~ 0.01, so 0.03.
    eta, lam, x, _ = _noisy_equilibrium_runs()
    deviation = x - x.mean(0)
    lag1 = (deviation[1:] * deviation[:-1]).mean(0) / (deviation**2).mean(0)
    assert np.allclose(lag1, analysis.equilibrium_norm_slope(eta, lam), atol=0.03)


def _full_batch_step(norm_sq, angle, eta, lam):
    """One SGD step on 1 - cos(w, w*) in the plane, from the vectors (not the angle formulas)."""
    w = math.sqrt(norm_sq) * np.array([math.cos(angle), math.sin(angle)])
    target = np.array([1.0, 0.0])
    u = w / np.linalg.norm(w)
    gradient = -(target - (u @ target) * u) / np.linalg.norm(w)
    w = w - eta * (gradient + lam * w)
    return np.array([w @ w, -math.atan2(w[1], w[0])])  # reflected: the 2-cycle is a fixed point


@pytest.mark.parametrize("eta, lam", [(0.1, 0.02), (1.0, 0.05), (0.5, 0.5), (2.0, 0.4)])
def test_full_batch_equilibrium_is_an_unstable_two_cycle(eta, lam):
    equilibrium = analysis.full_batch_equilibrium(eta, lam)
    start = np.array([equilibrium.norm**2, equilibrium.angle])
    assert np.allclose(_full_batch_step(*start, eta, lam), start, rtol=1e-12)
    # Its norm is equilibrium_norm with c = ||w|| ||g|| = sin(angle).
    assert math.isclose(equilibrium.norm, analysis.equilibrium_norm(eta, lam, math.sin(equilibrium.angle)),
                        rel_tol=1e-12)
    # Central differences of the vector update, relative step 1e-6: truncation ~ 1e-12, round-off
    # ~ 1e-16 / 1e-6 = 1e-10 relative to the entries; 1e-6 leaves room for both.
    numeric = np.column_stack([
        (_full_batch_step(*(start + dz), eta, lam) - _full_batch_step(*(start - dz), eta, lam)) / (2 * dz[i])
        for i, dz in enumerate(np.diag(1e-6 * start))])
    assert np.allclose(numeric, equilibrium.jacobian, rtol=1e-6, atol=1e-6 * np.abs(equilibrium.jacobian).max())
    product = eta * lam
    assert math.isclose(np.linalg.det(equilibrium.jacobian), 1 + product * (1 - product), rel_tol=1e-12)
    assert equilibrium.spectral_radius > 1  # unstable, for every 0 < eta lam < 1
    # Rescaling w maps (eta, lam) to (eta / k, lam k): the eigenvalues see eta lam only.
    rescaled = analysis.full_batch_equilibrium(eta / 7.0, lam * 7.0)
    assert np.allclose(np.sort_complex(np.linalg.eigvals(rescaled.jacobian)),
                       np.sort_complex(np.linalg.eigvals(equilibrium.jacobian)), rtol=1e-12)
    with pytest.raises(ValueError, match="eta lam < 1"):
        analysis.full_batch_equilibrium(1.0, 1.5)


def test_regime_boundary_slope():
    etas, lams = np.logspace(-2, 1, 13), np.logspace(-3, 0, 13)
    eta_grid, lam_grid = np.meshgrid(etas, lams, indexing="ij")
    by_product = np.where(eta_grid * lam_grid > 3e-3, "oscillate", "converge")
    by_eta = np.where(eta_grid > 0.3, "oscillate", "converge")
    # Both axes step by 1/4 decade, so an eta lam = const boundary has a slope of exactly -1.
    assert math.isclose(analysis.regime_boundary(etas, lams, by_product).slope, -1.0, abs_tol=1e-9)
    assert abs(analysis.regime_boundary(etas, lams, by_eta).slope) < 1e-9
    # The boundary sits between the last converging eta (10^-0.75) and the first that does not
    # (10^-0.5 > 0.3), at their geometric mean; the order of the rows does not matter.
    shuffled = np.random.default_rng(0).permutation(len(etas))
    boundary = analysis.regime_boundary(etas[shuffled], lams, by_eta[shuffled])
    assert np.allclose(boundary.etas, 10**-0.625, rtol=1e-12)
    # A column that converges everywhere, or nowhere, has no boundary.
    by_eta[:, 0], by_eta[:, 1] = "converge", "diverge"
    assert np.isnan(analysis.regime_boundary(etas, lams, by_eta).etas[:2]).all()
    assert np.isnan(analysis.regime_boundary(etas, lams, np.full(eta_grid.shape, "converge")).etas).all()


def test_width_rules():
    # The rule lives in optim (tests/test_optim_groups.py); the README documents it here too.
    assert analysis.width_scaled_hyperparameters is so.optim.width_scaled_hyperparameters
    assert math.isclose(analysis.adamw_top_singular_value_scale(1e-3, 0.1, 16), 0.1 * 8)
    for p in (0, 1, 2, 4):
        s = analysis.spectral_balance_scale(3e-3, 0.2, p)
        assert math.isclose(0.2 * s ** (p + 1), 3e-3)  # the balance lam_p s^(p+1) = eta
    assert math.isclose(analysis.spectral_balance_scale(1e-3, 0.1, 1), math.sqrt(1e-2))
