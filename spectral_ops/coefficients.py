"""Polynomial coefficients for the polar factor and the matrix sign (SPEC 1.3, 1.4).

Polar Express coefficients are *computed* here, never tabulated: each step is the odd
quintic ``p(x) = a x + b x^3 + c x^5`` that best approximates 1 (minimax) on the interval the
previous steps leave the singular values in. Designing each step for the interval that is
actually left is what makes the composition converge in 8 steps instead of Newton-Schulz's ~20.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ._checks import check_steps
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

# A design interval this narrow has collapsed to a point: no minimax problem is left to solve.
_COLLAPSE_TOLERANCE = 5e-6
# Up to this width Remez's 4 x 4 system (points within it of each other) can be too ill-conditioned in
# float64 to keep the critical points (a design from 4e-7 to 1e-13 meets one 8e-6 wide): where it loses
# them there, the collapsed step, within about width^3 of the optimum, is taken instead of failing.
_REMEZ_RESOLUTION = 1e-4


def odd_quintic(coefficients, x):
    """Evaluate ``a x + b x^3 + c x^5`` (works for floats and numpy arrays)."""
    return root_step(coefficients, x, 2)


def root_step(coefficients, t, n: int = 2):
    """Evaluate ``g(t) = t (a + b t^n + c t^(2n))``: one step of an inverse ``n``-th root iteration on
    ``t = m^(1/n)`` (``m`` an eigenvalue of the iterated ``M``), of which ``n = 2`` is the polar factor's
    odd quintic (``m = x^2``)."""
    a, b, c = coefficients
    y = t**n
    return t * (a + y * (b + c * y))


def minimax_quintic(lo: float, hi: float, *, max_iterations: int = 100):
    """Odd quintic minimising ``max |1 - p(x)|`` on ``[lo, hi]``: :func:`minimax_root_step` with ``n = 2``."""
    return minimax_root_step(lo, hi, 2, max_iterations=max_iterations)


def minimax_root_step(lo: float, hi: float, n: int = 2, *, max_iterations: int = 100):
    """``g(t) = t (a + b t^n + c t^(2n))`` minimising ``max |1 - g(t)|`` on ``[lo, hi]`` by Remez exchange.

    Returns ``((a, b, c), E, alternation_points)``. ``t, t^(n+1), t^(2n+1)`` is a Chebyshev system on
    ``t > 0``, so the optimum equioscillates at four points ``lo < q < r < hi`` with ``g = 1-E, 1+E,
    1-E, 1+E``; the interior points are the critical points of ``g``, the roots of
    ``a + (n+1) b y + (2n+1) c y^2`` in ``y = t^n``, to which each exchange moves ``q, r``.
    """
    if not 0.0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    if lo / hi > 1.0 - _COLLAPSE_TOLERANCE:
        return _collapsed_interval_design(lo, hi, n)

    q, r = (3.0 * lo + hi) / 4.0, (lo + 3.0 * hi) / 4.0
    previous_error = math.inf
    for _ in range(max_iterations):
        points = np.array([lo, q, r, hi])
        signs = np.array([1.0, -1.0, 1.0, -1.0])  # g(t_i) = 1 - signs_i * E
        system = np.column_stack([points, points ** (n + 1), points ** (2 * n + 1), signs])
        a, b, c, error = np.linalg.solve(system, np.ones(4))
        # In the order of the products that the quintic's (n = 2) coefficients were always computed in.
        discriminant = (n + 1) ** 2 * b * b - 4.0 * (2 * n + 1) * a * c
        lost = c == 0.0 or discriminant < 0.0
        roots = None if lost else sorted((-(n + 1) * b + s * math.sqrt(discriminant)) / (2.0 * (2 * n + 1) * c)
                                         for s in (-1.0, 1.0))
        if lost or roots[0] <= 0.0:
            if lo / hi > 1.0 - _REMEZ_RESOLUTION:
                return _collapsed_interval_design(lo, hi, n)
            raise ArithmeticError(f"Remez exchange lost its critical points on [{lo}, {hi}]")
        q, r = (math.sqrt(y) if n == 2 else y ** (1.0 / n) for y in roots)
        if abs(error - previous_error) <= 1e-15 * max(1.0, abs(error)):
            break
        previous_error = error
    return (float(a), float(b), float(c)), abs(float(error)), (lo, q, r, hi)


def _collapsed_interval_design(lo: float, hi: float, n: int):
    """:func:`minimax_root_step`'s result for a (nearly) collapsed ``[lo, hi]``: the collapsed step at ``hi``."""
    a, b, c = _collapsed_interval_step(n)
    return (a / hi, b / hi ** (n + 1), c / hi ** (2 * n + 1)), 0.0, (lo, lo, hi, hi)


def _collapsed_interval_step(n: int):
    """The step with ``g(1) = 1``, ``g'(1) = g''(1) = 0``, used where a design interval has collapsed to a
    point: ``(a, b, c) = ((2n+1)(n+1), -2(2n+1), n+1) / (2 n^2)`` (for ``n = 2`` the classical quintic
    ``(15, -10, 3) / 8``)."""
    denominator = 2.0 * n * n
    return ((2 * n + 1) * (n + 1) / denominator, -2.0 * (2 * n + 1) / denominator, (n + 1) / denominator)


def polar_express_coefficients(steps: int = 8, lower: float = 1e-3, safety: float = 1.01):
    """Per-step ``(a, b, c)`` float64 triples of the Polar Express iteration (SPEC 1.3).

    Greedy construction: each step is the minimax quintic on the cushioned interval, re-centred
    on 1 over the true interval; then every step but the last is evaluated at ``x / safety`` so
    that round-off cannot push a singular value past where the next polynomial was designed.
    Results are cached; the returned tuple is immutable.
    """
    steps = _checked_steps(steps)
    if not (isinstance(lower, (int, float)) and 0.0 < lower < 1.0):
        raise ValueError(f"lower must be a float in (0, 1), got {lower!r}")
    if not (isinstance(safety, (int, float)) and safety >= 1.0):
        raise ValueError(f"safety must be a float >= 1, got {safety!r}")
    return _greedy_coefficients(int(steps), float(lower), float(safety))


def polar_express_design(lower: float, tolerance: float, safety: float = 1.01):
    """Polar Express for ``[lower, 1]`` with the fewest steps whose design takes the interval to within
    ``tolerance`` of 1: the same triples as :func:`polar_express_coefficients` for that count (the greedy
    construction does not depend on how many steps follow)."""
    if not (isinstance(lower, (int, float)) and 0.0 < lower < 1.0):
        raise ValueError(f"lower must be a float in (0, 1), got {lower!r}")
    if not (isinstance(tolerance, (int, float)) and 0.0 < tolerance < 1.0):
        raise ValueError(f"tolerance must be a float in (0, 1), got {tolerance!r}")
    return _greedy_coefficients(None, float(lower), float(safety), 2, float(tolerance))


_designed: dict[tuple, tuple] = {}


# A pure function of its arguments, computed with numpy and remembered: torch.compile takes its
# result as a constant instead of tracing the minimax solves (which branch on their results).
@constant_when_traced
def _greedy_coefficients(steps: int | None, lower: float, safety: float, n: int = 2, tolerance: float = 0.0):
    key = (steps, lower, safety, n, tolerance)
    if key not in _designed:
        _designed[key] = _greedy_design(steps, lower, safety, n, tolerance)
    return _designed[key]


# A design that has not reached its tolerance after this many steps has a lower bound it cannot serve.
_MAX_DESIGNED_STEPS = 40


def _greedy_design(steps: int | None, lower: float, safety: float, n: int = 2, tolerance: float = 0.0):
    """``steps`` greedy steps of :func:`root_step` from ``[lower, 1]`` in ``t``, or (``steps`` None) as
    many as take the interval to within ``tolerance`` of 1."""
    lo, hi = lower, 1.0
    designed = []
    while len(designed) < (steps or _MAX_DESIGNED_STEPS):
        design_lo = max(lo, CUSHION * hi)
        coefficients, _, _ = minimax_root_step(design_lo, hi, n)
        if design_lo > lo:
            scale = 2.0 / (root_step(coefficients, lo, n) + root_step(coefficients, hi, n))
            coefficients = tuple(scale * k for k in coefficients)
        designed.append(coefficients)
        lo = root_step(coefficients, lo, n)
        hi = 2.0 - lo
        if steps is None and 1.0 - lo <= tolerance:
            break
    else:
        if steps is None:
            raise ValueError(f"no design of up to {_MAX_DESIGNED_STEPS} steps reaches {tolerance} from {lower}")

    with_safety = [
        (a / safety, b / safety ** (n + 1), c / safety ** (2 * n + 1)) for a, b, c in designed[:-1]
    ] + [designed[-1]]
    return tuple(tuple(float(k) for k in step) for step in with_safety)


def inverse_root_coefficients(n: int, lower: float, tolerance: float, safety: float = 1.01):
    """Per-step ``(a, b, c)`` of the coupled inverse ``n``-th root iteration of a symmetric ``A`` whose
    eigenvalues are in ``[lower, 1]``: ``T = a I + b M + c M^2``, ``M <- T^n M``, ``Z <- Z T`` from
    ``M = A``, ``Z = I``, so that ``M = Z^n A`` throughout and ``Z -> A^(-1/n)``.

    On ``t = m^(1/n)`` a step is :func:`root_step`, ``t <- t (a + b t^n + c t^(2n))``; each is the
    minimax one for the interval the previous steps leave (as Polar Express designs its quintics,
    which are the case ``n = 2``), and there are as many as take ``[lower^(1/n), 1]`` to within
    ``tolerance`` of 1. A larger ``n`` narrows the interval in ``t`` (``lower^(1/n)``) and costs
    ``log2 n`` squarings of ``T`` per step. ``safety`` is Polar Express's margin on ``x``, i.e.
    ``safety^2`` on the eigenvalue ``m``: ``safety^(2/n)`` on ``t``.
    """
    if n < 2 or n & (n - 1):
        raise ValueError(f"n must be a power of two >= 2, got {n!r}")
    if not 0.0 < lower < 1.0 or not 0.0 < tolerance < 1.0:
        raise ValueError(f"need 0 < lower < 1 and 0 < tolerance < 1, got {lower!r}, {tolerance!r}")
    return _greedy_coefficients(None, float(lower) ** (1.0 / n), float(safety) ** (2.0 / n), int(n), float(tolerance))


def power_polynomial(gamma: float, lo: float, hi: float, tolerance: float):
    """A polynomial ``F`` with ``|F(z) / z^gamma - 1| <= tolerance`` on ``[lo, hi]`` (``0 < lo < hi``), as
    ``(coefficients, lo, hi)``: ``F(z) = sum_i coefficients[i] u^i`` in ``u = (2 z - hi - lo) / (hi - lo)``.

    The Chebyshev interpolant of the lowest degree that meets ``tolerance`` (checked on a fine grid),
    converted to powers of ``u``. ``z^gamma`` is analytic inside the ellipse through 0 with foci
    ``lo, hi``, so the degree grows like ``ln(1/tolerance) / ln(rho)``, ``rho`` the ellipse's
    parameter; for ``rho`` above ``1 + sqrt(2)`` the powers' coefficients decay, and evaluating them
    loses no accuracy to cancellation.
    """
    return _chebyshev_polynomial("power", float(gamma), float(lo), float(hi), float(tolerance))


def floor_polynomial(exponent: float, hi: float, tolerance: float):
    """A polynomial ``F`` with ``|F(w) / (1 - w)^exponent - 1| <= tolerance`` on ``[0, hi]`` (``hi < 1``), as
    :func:`power_polynomial` returns it (``u = (2 w - hi) / hi``).

    It is a floored power's second factor: ``x^2 + e^2 = (x + e)^2 (1 - w)`` with ``w = 2 v (1 - v)`` and
    ``v = e / (x + e)``, so ``(x^2 + e^2)^(p/2) = (x + e)^p F(w)`` for ``exponent = p / 2``, and ``w`` is in
    ``[0, 1/2]`` for ``x >= 0``. The singularity at ``w = 1`` is far from that interval (``rho = 5.8``):
    degree 9 for 1e-7, and the powers of ``u`` cancel little."""
    if not 0.0 < hi < 1.0:
        raise ValueError(f"need 0 < hi < 1, got {hi!r}")
    return _chebyshev_polynomial("floor", float(exponent), 0.0, float(hi), float(tolerance))


_FUNCTIONS = {
    "power": lambda gamma, z: z**gamma,
    "floor": lambda exponent, w: (1.0 - w) ** exponent,
}


_interpolants: dict[tuple, tuple] = {}


# Cached by hand, as _greedy_coefficients is: torch.compile skips an lru_cache wrapper and would trace
# the design (a search over degrees) instead of taking its result as a constant.
@constant_when_traced
def _chebyshev_polynomial(function: str, parameter: float, lo: float, hi: float, tolerance: float):
    key = (function, parameter, lo, hi, tolerance)
    if key not in _interpolants:
        _interpolants[key] = _designed_polynomial(*key)
    return _interpolants[key]


def _designed_polynomial(function: str, parameter: float, lo: float, hi: float, tolerance: float):
    if not 0.0 <= lo < hi or (function == "power" and lo == 0.0):
        raise ValueError(f"need 0 < lo < hi, got {lo!r}, {hi!r}")
    f = functools.partial(_FUNCTIONS[function], parameter)
    z = np.linspace(lo, hi, 4001)
    target = f(z)
    for degree in range(1, 61):
        series = np.polynomial.Chebyshev.interpolate(f, degree, domain=[lo, hi])
        if np.abs(series(z) / target - 1.0).max() <= tolerance:
            return tuple(float(k) for k in np.polynomial.chebyshev.cheb2poly(series.coef)), lo, hi
    raise ValueError(f"no polynomial of degree <= 60 approximates the {function} function ({parameter}) on "
                     f"[{lo}, {hi}] to {tolerance}")


def interpolated_coefficients(function: str, parameter, lo: float, hi: float, tolerance: float, span: tuple):
    """The coefficients :func:`power_polynomial` (``function="power"``) or :func:`floor_polynomial`
    (``"floor"``) give, for a ``parameter`` held in a 0-d tensor (a capturable step's power, which the
    host cannot read): a tensor on its device. The Chebyshev interpolant at fixed nodes is linear in
    the function's values there: its Chebyshev coefficients (a well-conditioned map), then their
    powers of ``u`` (a matrix with entries up to ``2^degree``: the result is good to about 1e-8,
    below fp32's resolution). The degree is the least that meets ``tolerance`` over the parameter's
    whole ``span`` (checked on 33 values of it)."""
    nodes, interpolation, to_powers = _interpolation(function, float(lo), float(hi), float(tolerance),
                                                     tuple(map(float, span)))
    parameter = parameter.double()
    device = parameter.device
    values = _FUNCTIONS[function](parameter, torch.tensor(nodes, dtype=torch.float64, device=device))
    chebyshev = torch.tensor(interpolation, dtype=torch.float64, device=device) @ values
    return torch.tensor(to_powers, dtype=torch.float64, device=device) @ chebyshev


@constant_when_traced
def _interpolation(function: str, lo: float, hi: float, tolerance: float, span: tuple):
    key = ("interpolation", function, lo, hi, tolerance, span)
    if key not in _interpolants:
        _interpolants[key] = _designed_interpolation(function, lo, hi, tolerance, span)
    return _interpolants[key]


def _designed_interpolation(function: str, lo: float, hi: float, tolerance: float, span: tuple):
    degree = max(len(_chebyshev_polynomial(function, float(q), lo, hi, tolerance)[0]) - 1
                 for q in np.linspace(*span, 33))
    x = np.polynomial.chebyshev.chebpts1(degree + 1)
    interpolation = np.polynomial.chebyshev.chebfit(x, np.eye(degree + 1), degree)  # column k: node k's
    to_powers = np.zeros((degree + 1, degree + 1))
    for k in range(degree + 1):  # column k: T_k in powers of u
        to_powers[:k + 1, k] = np.polynomial.chebyshev.cheb2poly(np.eye(degree + 1)[k])[:k + 1]
    # Tuples: a constant torch.compile can bake into a graph.
    return (tuple(float(v) for v in lo + (hi - lo) * (x + 1) / 2), tuple(map(tuple, interpolation.tolist())),
            tuple(map(tuple, to_powers.tolist())))


# A real (non-integer) power's polar factor is designed down to this fraction of ||W||_F, one step more
# than the default's (9 steps: 2.5e-9 from 1e-4 up): its modes at 1e-3 of s_max (the inverse root's
# design bound, plan.ROOT_LOWER) sit below 1e-3 of ||W||_F, and the 8-step design missed them (5e-5).
REAL_POWER_LOWER = 1e-4
REAL_POWER_POLAR_STEPS = 9


def resolve_polar_coefficients(steps: int | None, coefficients, real_power: bool = False):
    """The coefficient list a polar call uses: explicit ones, or Polar Express for ``steps``.

    ``steps`` defaults to 8. ``coefficients`` may be one ``(a, b, c)`` triple, repeated ``steps``
    times (e.g. :data:`MUON_QUINTIC`), or a sequence of triples, whose length then fixes the
    number of steps (``steps`` must be None or agree). ``real_power``: the polar factor of a real power,
    designed by default for :data:`REAL_POWER_LOWER` (:data:`REAL_POWER_POLAR_STEPS` steps).
    """
    if coefficients is None and real_power:
        return polar_express_coefficients(REAL_POWER_POLAR_STEPS if steps is None else _checked_steps(steps),
                                          lower=REAL_POWER_LOWER)
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
    if steps is None:
        raise ValueError("steps must be an integer >= 1, got None")
    return check_steps(steps)


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
