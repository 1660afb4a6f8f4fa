"""Polynomial coefficients for the polar factor and the matrix sign (SPEC 1.3, 1.4).

Polar Express coefficients are *computed* here, never tabulated: each step is the odd
quintic ``p(x) = a x + b x^3 + c x^5`` that best approximates 1 (minimax) on the interval the
previous steps leave the singular values in. Designing each step for the interval that is
actually left is what makes the composition converge in 8 steps instead of Newton-Schulz's ~20.
"""

from __future__ import annotations

import math

import numpy as np

from ._compile import constant_when_traced

# polar() starts from X_0 = W / (1.01 ||W||_F), so every singular value is in (0, 1/1.01]: inside the
# design interval even after round-off.
NORMALIZATION_MARGIN = 1.01

# Clamp the low end of each design interval at this fraction of its top. Without it the first
# steps would be designed for a huge dynamic range and lift nothing well (SPEC 1.3).
CUSHION = 0.02407327424182761

# Quintic for the symmetric matrix sign (SPEC 1.4): p(1) = 1 and p(x) ~ 3x near 0.
NEWTON_SCHULZ_SIGN = (3.0, -16.0 / 5.0, 6.0 / 5.0)

# torch.optim.Muon's fixed quintic. It keeps singular values spread around 1 (it never converges),
# which suits Muon's update but not a decay direction, so it is only ever used on request.
MUON_QUINTIC = (3.4445, -4.7750, 2.0315)

# The classical quintic with p(1) = 1, p'(1) = p''(1) = 0, used when a design interval has
# collapsed to a point and no minimax problem is left to solve.
_COLLAPSED_INTERVAL_QUINTIC = (15.0 / 8.0, -10.0 / 8.0, 3.0 / 8.0)
_COLLAPSE_TOLERANCE = 5e-6


def odd_quintic(coefficients, x):
    """Evaluate ``a x + b x^3 + c x^5`` (works for floats and numpy arrays)."""
    a, b, c = coefficients
    x2 = x * x
    return x * (a + x2 * (b + c * x2))


def minimax_quintic(lo: float, hi: float, *, max_iterations: int = 100):
    """Odd quintic minimising ``max |1 - p(x)|`` on ``[lo, hi]`` by Remez exchange.

    Returns ``((a, b, c), E, alternation_points)``. The optimum equioscillates at four points
    ``lo < q < r < hi`` with ``p = 1-E, 1+E, 1-E, 1+E``; the interior points are the critical
    points of ``p``, so each exchange moves ``q, r`` to the roots of ``p'``.
    """
    if not 0.0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    if lo / hi > 1.0 - _COLLAPSE_TOLERANCE:
        a, b, c = _COLLAPSED_INTERVAL_QUINTIC
        return (a / hi, b / hi**3, c / hi**5), 0.0, (lo, lo, hi, hi)

    q, r = (3.0 * lo + hi) / 4.0, (lo + 3.0 * hi) / 4.0
    previous_error = math.inf
    for _ in range(max_iterations):
        points = np.array([lo, q, r, hi])
        signs = np.array([1.0, -1.0, 1.0, -1.0])  # p(x_i) = 1 - signs_i * E
        system = np.column_stack([points, points**3, points**5, signs])
        a, b, c, error = np.linalg.solve(system, np.ones(4))
        # Critical points of p: 5c y^2 + 3b y + a = 0 with y = x^2.
        discriminant = 9.0 * b * b - 20.0 * a * c
        if c == 0.0 or discriminant < 0.0:
            raise ArithmeticError(f"Remez exchange lost its critical points on [{lo}, {hi}]")
        roots = sorted((-3.0 * b + s * math.sqrt(discriminant)) / (10.0 * c) for s in (-1.0, 1.0))
        q, r = math.sqrt(roots[0]), math.sqrt(roots[1])
        if abs(error - previous_error) <= 1e-15 * max(1.0, abs(error)):
            break
        previous_error = error
    return (float(a), float(b), float(c)), abs(float(error)), (lo, q, r, hi)


def polar_express_coefficients(steps: int = 8, lower: float = 1e-3, safety: float = 1.01):
    """Per-step ``(a, b, c)`` float64 triples of the Polar Express iteration (SPEC 1.3).

    Greedy construction: each step is the minimax quintic on the cushioned interval, re-centred
    on 1 over the true interval; then every step but the last is evaluated at ``x / safety`` so
    that round-off cannot push a singular value past where the next polynomial was designed.
    Results are cached; the returned tuple is immutable.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not (isinstance(lower, (int, float)) and 0.0 < lower < 1.0):
        raise ValueError(f"lower must be a float in (0, 1), got {lower!r}")
    if not (isinstance(safety, (int, float)) and safety >= 1.0):
        raise ValueError(f"safety must be a float >= 1, got {safety!r}")
    return _greedy_coefficients(int(steps), float(lower), float(safety))


_designed: dict[tuple, tuple] = {}


# A pure function of its arguments, computed with numpy and remembered: torch.compile takes its
# result as a constant instead of tracing the minimax solves (which branch on their results).
@constant_when_traced
def _greedy_coefficients(steps: int, lower: float, safety: float):
    key = (steps, lower, safety)
    if key not in _designed:
        _designed[key] = _greedy_design(steps, lower, safety)
    return _designed[key]


def _greedy_design(steps: int, lower: float, safety: float):
    lo, hi = lower, 1.0
    designed = []
    for _ in range(steps):
        design_lo = max(lo, CUSHION * hi)
        coefficients, _, _ = minimax_quintic(design_lo, hi)
        if design_lo > lo:
            scale = 2.0 / (odd_quintic(coefficients, lo) + odd_quintic(coefficients, hi))
            coefficients = tuple(scale * k for k in coefficients)
        designed.append(coefficients)
        lo = odd_quintic(coefficients, lo)
        hi = 2.0 - lo

    with_safety = [
        (a / safety, b / safety**3, c / safety**5) for a, b, c in designed[:-1]
    ] + [designed[-1]]
    return tuple(tuple(float(k) for k in step) for step in with_safety)


def resolve_polar_coefficients(steps: int | None, coefficients):
    """The coefficient list a polar call uses: explicit ones, or Polar Express for ``steps``.

    ``steps`` defaults to 8. ``coefficients`` may be one ``(a, b, c)`` triple, repeated ``steps``
    times (e.g. :data:`MUON_QUINTIC`), or a sequence of triples, whose length then fixes the
    number of steps (``steps`` must be None or agree).
    """
    if coefficients is None:
        return polar_express_coefficients(8 if steps is None else _checked_steps(steps))
    triples = _as_triples(coefficients)
    if _is_single_triple(coefficients):
        return triples * (8 if steps is None else _checked_steps(steps))
    if steps is not None and _checked_steps(steps) != len(triples):
        raise ValueError(f"steps={steps} does not match the {len(triples)} coefficient triples given")
    return triples


def without_normalization_margin(coefficients):
    """Coefficients that act on ``W / ||W||_F`` as ``coefficients`` would, inside :func:`polar`.

    polar() feeds the first step ``x / 1.01``; evaluating that step at ``1.01 x`` instead
    (``a k, b k^3, c k^5`` with ``k = 1.01``) cancels the margin. Muon-style quintics were tuned for
    plain Frobenius normalisation, as in ``torch.optim.Muon``.
    """
    (a, b, c), *rest = coefficients
    k = NORMALIZATION_MARGIN
    return ((a * k, b * k**3, c * k**5), *rest)


def _checked_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return steps


def _is_single_triple(coefficients) -> bool:
    try:
        return len(coefficients) == 3 and all(not hasattr(k, "__len__") for k in coefficients)
    except TypeError:
        return False


def _as_triples(coefficients):
    try:
        if _is_single_triple(coefficients):
            triples = [tuple(float(k) for k in coefficients)]
        else:
            triples = [tuple(float(k) for k in step) for step in coefficients]
    except (TypeError, ValueError):
        triples = []
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(
            "coefficients must be an (a, b, c) triple or a sequence of (a, b, c) triples, "
            f"got {coefficients!r}"
        )
    if not all(math.isfinite(k) for t in triples for k in t):
        raise ValueError(f"coefficients must be finite, got {coefficients!r}")
    return tuple(triples)
