"""Closed forms and small simulations that say what spectral-power decay should do (SPEC 1.5, 2, 4, 5).

* Pure decay flow ``ds/dt = -lambda s^p`` and its inverse, the one-step shape map.
* The linear teacher: the analytic optimum of ``1/2 ||W - A||_F^2 + lambda/(p+1) sum s^(p+1)`` for any
  integer ``p >= 0``, and the exactly whitened finite-sample problem trained by gradient descent
  (the penalty gradient is :func:`spectral_ops.spectral_power`; ``p = 0`` takes the proximal step
  :func:`spectral_ops.svt`).
* The normalised-network feedback loop (SPEC 5): weight norm, effective lr and alignment under SGD with
  weight decay on a scale-invariant loss, a regime classifier over an ``(eta, lambda)`` grid and its
  boundary, and the loop's equilibrium norm ``n*`` with its linear stability (noisy and full batch).
* Width-transfer diagnostics (SPEC 4). The width rule itself, ``width_scaled_hyperparameters``, lives
  in :mod:`spectral_ops.optim` with ``width_transfer``, which applies it; it is importable from here too.

Everything computes in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from .linalg import matrix_with_spectrum, power_weights
from .ops import spectral_power, svt
from .optim import width_scaled_hyperparameters  # noqa: F401  (documented as analysis.width_scaled_hyperparameters)
from .progress import progress as progress_bar  # `progress` is these functions' flag


def _float64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Pure decay (SPEC 2) and the shape map (SPEC 1.5)
# ---------------------------------------------------------------------------------------------

def pure_decay(s0, lam, t, p: int) -> torch.Tensor:
    """Singular values after accumulated schedule time ``t`` of ``ds/dt = -lam s^p`` (SPEC 2).

    ``p = 0``: ``max(s0 - lam t, 0)``; ``p = 1``: ``s0 exp(-lam t)``; ``p > 1``:
    ``(s0^(1-p) + (p-1) lam t)^(-1/(p-1))``. Arguments broadcast; zero modes stay zero.
    """
    s0, lam, t = _float64(s0), _float64(lam), _float64(t)
    if p == 0:
        return (s0 - lam * t).clamp_min(0.0)
    if p == 1:
        return s0 * torch.exp(-lam * t)
    # s0^(1-p) is +inf for a zero mode, which the outer power maps back to exactly 0.
    return (s0 ** (1 - p) + (p - 1) * lam * t) ** (-1.0 / (p - 1))


def time_to_shrink(s0, factor, lam, p: int) -> torch.Tensor:
    """Accumulated time after which a mode of size ``s0`` has shrunk to ``factor * s0`` (inverse of :func:`pure_decay`).

    Used to compare powers at equal *effect* on the top mode: equal raw coefficients are not equal
    strengths, because ``S_p(cW) = c^p S_p(W)`` (SPEC 1.1).
    """
    s0, factor, lam = _float64(s0), _float64(factor), _float64(lam)
    if p == 0:
        return s0 * (1.0 - factor) / lam
    if p == 1:
        return -torch.log(factor) / lam
    return ((factor * s0) ** (1 - p) - s0 ** (1 - p)) / ((p - 1) * lam)


def frobenius_log_rate(s, lam, p: int) -> torch.Tensor:
    """``d/dt log ||W||_F = -lam sum s^(p+1) / sum s^2`` under the decay flow (SPEC 2)."""
    s = _float64(s)
    return -lam * (s ** (p + 1)).sum(-1) / (s**2).sum(-1)


def decay_matrix(W: torch.Tensor, lam, t, p: int) -> torch.Tensor:
    """``W`` after accumulated time ``t`` of the pure decay flow, mode by mode (float64).

    The flow never rotates singular vectors, so ``U diag(pure_decay(s)) V^T`` is its exact solution.
    """
    U, s, Vh = torch.linalg.svd(W.to(torch.float64), full_matrices=False)
    return (U * pure_decay(s, lam, t, p)[..., None, :]) @ Vh


def decay_checkpoint(checkpoint, lam, horizon, p: int):
    """Apply :func:`decay_matrix` with a fixed horizon to every matrix of a checkpoint.

    ``checkpoint`` is a state dict or a list of tensors. Every floating 2-D tensor is decayed
    (embeddings included); everything else (vectors, integer buffers) is copied unchanged. Results
    keep each tensor's dtype and device.
    """
    def decayed(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.is_floating_point():
            return decay_matrix(tensor, lam, horizon, p).to(tensor.dtype)
        return tensor.clone() if isinstance(tensor, torch.Tensor) else tensor

    if isinstance(checkpoint, dict):
        return {name: decayed(tensor) for name, tensor in checkpoint.items()}
    return [decayed(tensor) for tensor in checkpoint]


def shape_step(s, step, p: int) -> torch.Tensor:
    """Normalised spectrum ``r+ = (r - kappa r^p) / (1 - kappa)`` after one decay step (SPEC 1.5).

    ``s`` holds singular values (last dimension), ``step = eta * lambda_p``, ``kappa = step * s_1^(p-1)``.
    The map assumes that the step keeps the modes in order and positive, so that ``s_1`` stays the
    largest: for ``p >= 1`` that is ``p * kappa < 1`` (``s -> s - step s^p`` is increasing on
    ``[0, s_1]`` only while its slope at ``s_1``, ``1 - p kappa``, is positive: the order condition
    of :func:`spectral_ops.spectral_decay_`'s guard), and for ``p = 0`` that the smallest mode does not
    cross zero. Beyond either it raises instead of returning a shape with ``r > 1`` or ``r < 0``.
    """
    s = _float64(s)
    s1 = s.amax(-1, keepdim=True)
    r = s / s1
    kappa = _float64(step) * s1 ** (p - 1)
    order = p * kappa
    if bool((order >= 1).any()):
        raise ValueError(
            f"step={float(_float64(step).max()):.4g} with p={p} reorders the singular values: p * kappa = "
            f"p * step * s_1^(p-1) reaches {float(order.max()):.4g} >= 1 (kappa = {float(kappa.max()):.4g}), "
            "and the shape map needs p * kappa < 1"
        )
    shrunk = r - kappa * power_weights(r, p, r.shape[-1])
    if bool((shrunk < 0).any()):
        raise ValueError(
            f"step={float(_float64(step).max()):.4g} with p={p} pushes a singular value through zero "
            f"(kappa = step * s_1^(p-1) reaches {float(kappa.max()):.4g}); the shape map needs no crossing"
        )
    return shrunk / (1.0 - kappa)


# ---------------------------------------------------------------------------------------------
# Linear teacher (SPEC 2)
# ---------------------------------------------------------------------------------------------

def teacher_singular_values(a, lam, p: int, *, tolerance: float = 1e-15, max_iterations: int = 200) -> torch.Tensor:
    """Optimal singular values of ``1/2 ||W - A||_F^2 + lam/(p+1) sum s^(p+1)`` given ``A``'s ``a``.

    ``p = 0``: ``(a - lam)_+`` (soft-thresholding). ``p >= 1``: the unique root in ``[0, a]`` of
    ``f(s) = s + lam s^p - a``, by Newton's method safeguarded with bisection. ``f`` is increasing
    and convex on ``s >= 0`` with ``f(0) = -a <= 0 <= f(a)``, so Newton from ``s = a`` descends
    monotonically onto the root; the bracket only catches round-off.
    """
    a, lam = torch.broadcast_tensors(_float64(a), _float64(lam))
    if bool((a < 0).any()) or bool((lam < 0).any()):
        raise ValueError("teacher singular values and lam must be non-negative")
    if p == 0:
        return (a - lam).clamp_min(0.0)
    lo, hi = torch.zeros_like(a), a.clone()
    s = a.clone()
    for _ in range(max_iterations):
        f = s + lam * s**p - a
        lo = torch.where(f < 0, s, lo)
        hi = torch.where(f > 0, s, hi)
        newton = s - f / (1.0 + p * lam * s ** (p - 1))
        safeguarded = torch.where((newton > lo) & (newton < hi), newton, 0.5 * (lo + hi))
        updated = torch.where(f == 0, s, safeguarded)
        converged = bool(((updated - s).abs() <= tolerance * updated).all())
        s = updated
        if converged:
            break
    return s


# The SPEC 2 finite-sample problem.
TEACHER_SINGULAR_VALUES = (4.0, 2.0, 1.0, 0.4, 0.15, 0.05)
TEACHER_LAMBDA = 0.2
TEACHER_SAMPLES = 512


@dataclass(frozen=True)
class LinearTeacherProblem:
    """Whitened inputs ``X`` (``N x d``, ``X^T X / N = I``), teacher ``A`` and targets ``Y = X A^T``."""

    X: torch.Tensor
    A: torch.Tensor
    Y: torch.Tensor
    singular_values: torch.Tensor
    lam: float

    @property
    def samples(self) -> int:
        return self.X.shape[0]


def linear_teacher_problem(singular_values=TEACHER_SINGULAR_VALUES, lam: float = TEACHER_LAMBDA,
                           samples: int = TEACHER_SAMPLES, seed: int = 0) -> LinearTeacherProblem:
    """The exactly whitened finite-sample linear teacher of SPEC 2.

    Inputs come in ``+/-`` pairs, so every column is centred; a reduced QR then makes them exactly
    white: ``X = sqrt(N) Q`` gives ``X^T X / N = Q^T Q = I`` (and ``Q = [Z; -Z] R^-1`` keeps the pairs).
    With white inputs the data term ``||Y - X W^T||_F^2 / (2N)`` equals ``||W - A||_F^2 / 2``, so the
    trained solution must match :func:`teacher_singular_values`. The teacher has random
    (non-diagonal) singular vectors.
    """
    if samples % 2:
        raise ValueError(f"samples must be even (inputs come in +/- pairs), got {samples}")
    a = _float64(singular_values)
    d = a.numel()
    generator = torch.Generator().manual_seed(seed)
    half = torch.randn(samples // 2, d, generator=generator, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.cat([half, -half]), mode="reduced")
    X = math.sqrt(samples) * Q
    A = matrix_with_spectrum((d, d), a, seed=seed + 1)
    return LinearTeacherProblem(X=X, A=A, Y=X @ A.mT, singular_values=a, lam=float(lam))


def teacher_objective(problem: LinearTeacherProblem, W: torch.Tensor, p: int) -> float:
    """``||Y - X W^T||_F^2 / (2N) + lam/(p+1) sum s_i(W)^(p+1)``."""
    residual = problem.Y - problem.X @ W.mT
    s = torch.linalg.svdvals(W)
    return float((residual**2).sum() / (2 * problem.samples) + problem.lam / (p + 1) * (s ** (p + 1)).sum())


# svt's sign iteration sees |s^2 - t^2| relative to ||W^T W - t^2 I||_F. On the teacher the
# truncated modes sit ~5e-5 below the threshold on that scale, under the 1e-3 design bound of the
# default 8 Polar Express steps; 16 steps resolve them to round-off.
PROX_SIGN_STEPS = 16


@dataclass
class TeacherTrainingResult:
    W: torch.Tensor
    objective: list


@torch.no_grad()
def train_linear_teacher(problem: LinearTeacherProblem, p: int, steps: int = 2000, lr: float = 0.1,
                         progress: bool = True) -> TeacherTrainingResult:
    """Plain gradient descent from ``W = 0`` on the regularised objective (SPEC 2).

    ``p >= 1``: ``W <- W - lr (grad_data + lam S_p(W))``. ``p = 0``: the proximal step
    ``W <- svt(W - lr grad_data, lr lam)`` (the nuclear norm has no gradient at rank-deficient W).
    From ``W = 0`` every mode rises monotonically to its optimum while
    ``lr (1 + lam p s^(p-1)) < 1`` along the way; ``lr = 0.1`` satisfies it for the SPEC teacher
    and every ``p <= 4``, and contracts the error by at least ``1 - lr`` per step.
    """
    X, Y, N = problem.X, problem.Y, problem.samples
    W = torch.zeros_like(problem.A)
    objective = [teacher_objective(problem, W, p)]
    for _ in progress_bar(range(steps), desc=f"linear teacher p={p}", leave=False, disable=not progress):
        data_gradient = (W @ (X.mT @ X) - Y.mT @ X) / N
        if p == 0:
            W = svt(W - lr * data_gradient, lr * problem.lam, sign_steps=PROX_SIGN_STEPS)
        else:
            W = W - lr * (data_gradient + problem.lam * spectral_power(W, p))
        objective.append(teacher_objective(problem, W, p))
    return TeacherTrainingResult(W=W, objective=objective)


def covariance_identity_error(problem: LinearTeacherProblem, W: torch.Tensor) -> float:
    """``||Y_W^T Y_W / N - W W^T||_F / ||W W^T||_F`` for the student's outputs ``Y_W = X W^T``.

    Zero exactly when the inputs are white: then the output covariance eigenvalues are ``s_i^2``.
    """
    Y_W = problem.X @ W.mT
    expected = W @ W.mT
    error = torch.linalg.matrix_norm(Y_W.mT @ Y_W / problem.samples - expected)
    return float(error / torch.linalg.matrix_norm(expected))


# ---------------------------------------------------------------------------------------------
# The normalised-network feedback loop (SPEC 5)
# ---------------------------------------------------------------------------------------------

def constant_schedule(steps: int) -> np.ndarray:
    return np.ones(steps)


def cosine_schedule(steps: int, final: float = 0.0) -> np.ndarray:
    """Multipliers ``eta_t / eta_0`` decaying from 1 to ``final`` along half a cosine."""
    t = np.arange(steps) / max(steps - 1, 1)
    return final + (1.0 - final) * 0.5 * (1.0 + np.cos(np.pi * t))


@dataclass
class NormalisedTrajectory:
    """Per-step records, shape ``(steps, grid)``: one column per ``(eta, lam)`` pair."""

    nominal_lr: np.ndarray      # eta_t
    norm: np.ndarray            # ||w_t||, before step t
    effective_lr: np.ndarray    # eta_t / ||w_t||^2, the step the scale-invariant loss actually feels
    alignment: np.ndarray       # cos(w_t, w*): the loss is 1 - alignment
    gradient_norm: np.ndarray   # ||g_t||, noise included: ||w_t|| ||g_t|| is the c of equilibrium_norm
    final_norm: np.ndarray      # ||w_T||, after the last step

    def prefix(self, steps: int) -> NormalisedTrajectory:
        """The records of the first ``steps`` steps, ending at ``final_norm = norm[steps]``: exactly
        what a run of ``steps`` steps records (the noise is drawn step by step from one generator)."""
        if not 0 < steps <= len(self.norm):
            raise ValueError(f"a prefix needs 0 < steps <= {len(self.norm)}, got {steps}")
        if steps == len(self.norm):
            return self
        per_step = {field.name: getattr(self, field.name)[:steps]
                    for field in fields(self) if field.name != "final_norm"}
        return NormalisedTrajectory(**per_step, final_norm=self.norm[steps])


def simulate_normalised_network(eta, lam, schedule: np.ndarray, *, dim: int = 16, gradient_noise: float = 0.0,
                                seed: int = 0, progress: bool = True) -> NormalisedTrajectory:
    """SGD with weight decay on the scale-invariant loss ``1 - cos(w, w*)`` (SPEC 5).

    ``eta`` and ``lam`` broadcast to a grid of runs, simulated together from one unit-norm start.
    The gradient ``-(I - u u^T) w* / ||w||`` (``u = w/||w||``) is orthogonal to ``w`` and scales as
    ``1/||w||``, which is all that scale invariance implies; ``gradient_noise`` adds isotropic
    tangential noise of that scaling (a minibatch gradient). Hence exactly
    ``||w+||^2 = (1 - eta lam)^2 ||w||^2 + eta^2 ||g||^2``.
    """
    eta, lam = np.broadcast_arrays(np.atleast_1d(np.asarray(eta, float)), np.atleast_1d(np.asarray(lam, float)))
    eta, lam = eta.ravel(), lam.ravel()
    rng = np.random.default_rng(seed)
    target = np.zeros(dim)
    target[0] = 1.0
    start = rng.standard_normal(dim)
    w = np.tile(start / np.linalg.norm(start), (eta.size, 1))
    steps = len(schedule)
    records = {name: np.empty((steps, eta.size))
               for name in ("nominal_lr", "norm", "effective_lr", "alignment", "gradient_norm")}
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for t in progress_bar(range(steps), desc="normalised network", leave=False, disable=not progress):
            norm = np.linalg.norm(w, axis=1, keepdims=True)
            u = w / norm
            cosine = u @ target
            gradient = -(target - cosine[:, None] * u) / norm
            if gradient_noise:
                noise = rng.standard_normal(w.shape)
                noise -= (noise * u).sum(1, keepdims=True) * u
                gradient += gradient_noise * noise / (norm * math.sqrt(dim))
            lr = eta * schedule[t]
            records["nominal_lr"][t] = lr
            records["norm"][t] = norm[:, 0]
            records["effective_lr"][t] = lr / norm[:, 0] ** 2
            records["alignment"][t] = cosine
            records["gradient_norm"][t] = np.linalg.norm(gradient, axis=1)
            w = w - lr[:, None] * (gradient + lam[:, None] * w)
        final_norm = np.linalg.norm(w, axis=1)
    return NormalisedTrajectory(**records, final_norm=final_norm)


REGIMES = ("converge", "oscillate", "diverge")
# A norm that grows 1000x, or decay that multiplies w by 1 - eta lam <= -1 each step, has lost the loop.
DIVERGENCE_GROWTH = 1e3
# Swings of the log-norm, in nats, that count as oscillation: 0.05 is a 5% rise and fall of ||w||.
OSCILLATION_TOLERANCE = 0.05


def classify_regime(trajectory: NormalisedTrajectory, eta, lam, window: float = 0.25) -> np.ndarray:
    """``"converge"``, ``"oscillate"`` or ``"diverge"`` per run, from the last ``window`` of the run.

    * diverge: a non-finite or zero norm, growth beyond ``DIVERGENCE_GROWTH``, or ``eta lam >= 2``
      (the decay factor ``1 - eta lam`` then flips and does not shrink w);
    * oscillate: within the window the log-norm both falls by more than ``OSCILLATION_TOLERANCE``
      from an earlier peak and rises by more than that from an earlier trough (a monotone drift,
      however large, is not an oscillation; nor are small noise wiggles);
    * converge: otherwise. This is convergence *within the horizon*: in full batch, the norm of any
      run with ``lam > 0`` keeps shrinking once the direction is learned, so a long enough horizon
      eventually oscillates (SPEC 5).
    """
    eta, lam = np.broadcast_arrays(np.atleast_1d(np.asarray(eta, float)), np.atleast_1d(np.asarray(lam, float)))
    norm = np.vstack([trajectory.norm, trajectory.final_norm[None]])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_norm = np.log(norm[-max(2, int(window * len(norm))):])
        fall = (np.maximum.accumulate(log_norm) - log_norm).max(0)
        rise = (log_norm - np.minimum.accumulate(log_norm)).max(0)
        diverged = (~np.isfinite(norm).all(0) | (norm[-1] == 0) | (norm.max(0) > DIVERGENCE_GROWTH * norm[0])
                    | (eta.ravel() * lam.ravel() >= 2.0))
    oscillating = np.minimum(fall, rise) > OSCILLATION_TOLERANCE
    return np.where(diverged, "diverge", np.where(oscillating, "oscillate", "converge"))


def regime_map(etas, lams, steps: int, **simulation_options) -> np.ndarray:
    """Regime labels on the grid ``etas x lams`` (shape ``(len(etas), len(lams))``), constant schedule."""
    return regime_maps(etas, lams, (steps,), **simulation_options)[steps]


def regime_maps(etas, lams, horizons, **simulation_options) -> dict[int, np.ndarray]:
    """:func:`regime_map` at each of ``horizons`` (steps), from one simulation of the longest: a
    shorter run is the prefix of a longer one (:meth:`NormalisedTrajectory.prefix`)."""
    eta_grid, lam_grid = np.meshgrid(np.asarray(etas, float), np.asarray(lams, float), indexing="ij")
    trajectory = simulate_normalised_network(eta_grid.ravel(), lam_grid.ravel(), constant_schedule(max(horizons)),
                                             **simulation_options)
    return {steps: classify_regime(trajectory.prefix(steps), eta_grid.ravel(), lam_grid.ravel()).reshape(eta_grid.shape)
            for steps in horizons}


def _decay_product(eta, lam) -> np.ndarray:
    product = np.asarray(eta, float) * np.asarray(lam, float)
    if bool(((product <= 0) | (product >= 2)).any()):
        raise ValueError("the norm has an equilibrium only for 0 < eta lam < 2 (otherwise 1 - eta lam does "
                         f"not shrink w); got eta lam = {product}")
    return product


def equilibrium_norm(eta, lam, gradient_constant) -> np.ndarray:
    """Fixed point ``n*`` of ``||w+||^2 = (1 - eta lam)^2 ||w||^2 + eta^2 ||g||^2`` with ``||g|| = c / ||w||``.

    With ``x = ||w||^2`` the map is ``x+ = (1 - eta lam)^2 x + eta^2 c^2 / x``. At a fixed point
    ``x (1 - (1 - eta lam)^2) = eta^2 c^2 / x``, and ``1 - (1 - eta lam)^2 = eta lam (2 - eta lam)``, so::

        n*^4 = eta c^2 / (lam (2 - eta lam)),    n*^2 = c sqrt(eta / (lam (2 - eta lam))).

    ``sqrt(eta C / (lam (2 - eta lam)))`` is therefore ``n*^2`` when ``C = c^2 = ||w||^2 ||g||^2``
    (not ``n*``). Under gradient noise ``c`` varies; ``c = sqrt(mean ||w||^2 ||g||^2)`` from a run
    (:attr:`NormalisedTrajectory.gradient_norm`) gives its mean ``||w||^2`` to a fraction of a
    percent. Arguments broadcast; ``0 < eta lam < 2``.
    """
    product = _decay_product(eta, lam)
    return (product * np.asarray(gradient_constant, float) ** 2 / (np.asarray(lam, float) ** 2
                                                                  * (2.0 - product))) ** 0.25


def equilibrium_norm_slope(eta, lam) -> np.ndarray:
    """``F'(n*)`` for the norm map ``n+ = F(n) = sqrt((1 - eta lam)^2 n^2 + eta^2 c^2 / n^2)``:
    ``2 (1 - eta lam)^2 - 1``.

    With ``G(x) = a x + b / x`` (``a = (1 - eta lam)^2``, ``b = eta^2 c^2``), ``F(n) = sqrt(G(n^2))`` and
    ``F'(n) = G'(n^2) n / F(n)``; at the fixed point ``F(n*) = n*`` and ``b / x*^2 = 1 - a``, so
    ``F'(n*) = G'(x*) = a - (1 - a) = 2 a - 1``. It depends on ``eta lam`` alone (not on ``c``), and
    ``|F'(n*)| < 1`` for every ``0 < eta lam < 2`` except ``eta lam = 1`` (``F' = -1``: ``x+ = b / x``
    makes every orbit 2-periodic): with ``||g|| ||w||`` held at ``c``, as gradient noise does, the
    equilibrium is *stable*, relaxing like ``(1 - 4 eta lam)^t`` for small ``eta lam``.
    """
    return 2.0 * (1.0 - _decay_product(eta, lam)) ** 2 - 1.0


@dataclass(frozen=True)
class FullBatchEquilibrium:
    """The interior equilibrium of the full-batch loop: ``||w|| = norm`` and the direction flipping
    between ``+angle`` and ``-angle`` from ``w*`` every step. ``jacobian`` is that of the map
    ``(||w||^2, theta) -> (||w+||^2, -theta+)`` there."""

    norm: float
    angle: float
    jacobian: np.ndarray

    @property
    def spectral_radius(self) -> float:
        """Largest eigenvalue modulus: above 1, perturbations grow and the equilibrium is unstable."""
        return float(np.abs(np.linalg.eigvals(self.jacobian)).max())


def full_batch_equilibrium(eta: float, lam: float) -> FullBatchEquilibrium:
    """The full-batch equilibrium of SPEC 5 and its linearisation, for ``0 < eta lam < 1``.

    In full batch ``c = ||w|| ||g|| = sin theta`` is not a constant: ``theta`` is the angle between
    ``w`` and ``w*``, and the run stays in their plane. With ``x = ||w||^2`` and ``s = 1 - eta lam``::

        x+ = s^2 x + eta^2 sin^2 theta / x,    theta+ = theta - atan(eta sin theta / (s x)).

    Every step turns ``w`` towards ``w*``, so no fixed point has ``theta != 0``; the interior
    equilibrium is the 2-cycle ``theta+ = -theta``, ``x+ = x``. The norm balance gives
    ``eta sin theta / x = sqrt(1 - s^2)``, so ``tan(2 theta*) = sqrt(1 - s^2) / s``::

        2 theta* = arccos(1 - eta lam),    n*^2 = eta sin theta* / sin 2 theta* = eta / (2 cos theta*),

    (:func:`equilibrium_norm` with ``c = sin theta*``). The reflection ``theta -> -theta`` commutes
    with the map, so the cycle is stable iff ``(x, theta) -> (x+, -theta+)`` is, at its fixed point::

        J = [[2 s^2 - 1,          eta^2 sin 2 theta* / x*],
             [-s sin 2 theta* / x*,  s^2 + s - 1          ]],

    and with ``eta^2 / x*^2 = 4 cos^2 theta* = 2 (1 + s)``, ``det J = 1 + eta lam (1 - eta lam) > 1``:
    some eigenvalue has modulus above 1 (a complex pair of modulus ``sqrt(det J)`` at small
    ``eta lam``, an outward spiral). The full-batch equilibrium is *unstable* for every
    ``0 < eta lam < 1``; like :func:`equilibrium_norm_slope`, the eigenvalues depend on ``eta lam`` alone.
    """
    product = float(_decay_product(eta, lam))
    if product >= 1:  # s <= 0 flips w through the origin every step; the angle map above assumes s > 0
        raise ValueError(f"full_batch_equilibrium needs 0 < eta lam < 1, got {product}")
    s = 1.0 - product
    angle = 0.5 * math.acos(s)
    x = eta / (2.0 * math.cos(angle))
    sin_double = math.sin(2.0 * angle)
    jacobian = np.array([[2 * s**2 - 1, eta**2 * sin_double / x], [-s * sin_double / x, s**2 + s - 1]])
    return FullBatchEquilibrium(norm=math.sqrt(x), angle=angle, jacobian=jacobian)


@dataclass(frozen=True)
class RegimeBoundary:
    """Where runs stop converging, per ``lambda`` column of a regime map, and the log-log slope of
    that boundary: ``0`` if ``eta`` alone sets it, ``-1`` if ``eta lam`` does."""

    lambdas: np.ndarray
    etas: np.ndarray     # boundary eta per lambda (geometric mean of the two grid etas around it; nan if none)
    slope: float         # fit of log eta_boundary against log lambda over the columns that have one


def regime_boundary(etas, lams, labels) -> RegimeBoundary:
    """The converge / not-converge boundary of a :func:`regime_map` (``labels[i, j]`` at ``etas[i]``, ``lams[j]``).

    In column ``j`` it lies between the first ``eta`` (ascending) whose run does not converge and
    the ``eta`` below it; a column that converges everywhere, or nowhere, has none (nan).
    """
    etas, lams = np.asarray(etas, float), np.asarray(lams, float)
    order = np.argsort(etas)
    etas, unsettled = etas[order], np.asarray(labels)[order] != "converge"
    first = unsettled.argmax(0)  # per column, the first eta whose run does not converge (0 if none)
    found = unsettled.any(0) & (first > 0)
    boundary = np.where(found, np.sqrt(etas[np.maximum(first - 1, 0)] * etas[first]), np.nan)
    slope = float(np.polyfit(np.log(lams[found]), np.log(boundary[found]), 1)[0]) if found.sum() >= 2 else math.nan
    return RegimeBoundary(lambdas=lams, etas=boundary, slope=slope)


# ---------------------------------------------------------------------------------------------
# Width transfer (SPEC 4)
# ---------------------------------------------------------------------------------------------

def adamw_top_singular_value_scale(lr: float, weight_decay: float, width: int) -> float:
    """Steady-state ``s_1 ~ sqrt(lr / weight_decay) d^0.75`` under AdamW (SPEC 4), up to a constant.

    Matching top singular values across widths is the width-transfer diagnostic.
    """
    return math.sqrt(lr / weight_decay) * width**0.75


def spectral_balance_scale(lr: float, lam_p: float, p: int) -> float:
    """The heuristic balance ``s* ~ (lr / lam_p)^(1/(p+1))`` between a unit update and ``lam_p s^p`` decay.

    A hypothesis to check against trained weights (SPEC 4), not a fact; for ``p = 1`` it is the
    width-free part of :func:`adamw_top_singular_value_scale`.
    """
    return (lr / lam_p) ** (1.0 / (p + 1))
