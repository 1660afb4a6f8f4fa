"""The Polar Express construction (SPEC 1.3) is tested by its defining properties, not by values."""

import math

import numpy as np
import pytest
import torch

from spectral_ops.coefficients import (
    CUSHION,
    MUON_QUINTIC,
    floor_polynomial,
    interpolated_coefficients,
    inverse_root_coefficients,
    minimax_quintic,
    minimax_root_step,
    odd_quintic,
    polar_express_coefficients,
    power_polynomial,
    resolve_polar_coefficients,
    root_step,
)


def composed(coefficients, x):
    for step in coefficients:
        x = odd_quintic(step, x)
    return x


def unsafe_steps(steps=8, lower=1e-3):
    """The designed polynomials before the safety rescaling (safety = 1 leaves them untouched)."""
    return polar_express_coefficients(steps, lower, safety=1.0)


def design_intervals(steps=8, lower=1e-3):
    """The ``[l, u]`` each greedy step was designed for, replayed from the construction rule."""
    lo, hi, intervals = lower, 1.0, []
    for step in unsafe_steps(steps, lower):
        intervals.append((lo, hi))
        lo = odd_quintic(step, lo)
        hi = 2.0 - lo
    return intervals


@pytest.mark.parametrize("lo, hi", [(1e-3, 1.0), (0.05, 1.0), (0.3, 0.9), (0.7, 1.3)])
def test_minimax_quintic_equioscillates(lo, hi):
    (a, b, c), error, points = minimax_quintic(lo, hi)
    values = odd_quintic((a, b, c), np.array(points))
    # p = 1-E, 1+E, 1-E, 1+E at the four alternation points ...
    np.testing.assert_allclose(values - 1.0, [-error, error, -error, error], atol=1e-13)
    # ... the interior ones are critical points ...
    derivative = a + 3 * b * np.array(points[1:3]) ** 2 + 5 * c * np.array(points[1:3]) ** 4
    np.testing.assert_allclose(derivative, 0.0, atol=1e-10)
    # ... and no point of the interval deviates more (the equioscillation theorem's optimum).
    grid = np.linspace(lo, hi, 100_001)
    assert np.abs(1.0 - odd_quintic((a, b, c), grid)).max() <= error * (1 + 1e-9)


def test_each_greedy_step_is_minimax_on_its_cushioned_interval():
    for (lo, hi), step in zip(design_intervals(), unsafe_steps()):
        design_lo = max(lo, CUSHION * hi)
        optimum, error, _ = minimax_quintic(design_lo, hi)
        if design_lo > lo:  # re-centred: a rescaled optimum with p(l) + p(u) = 2
            scale = step[0] / optimum[0]
            np.testing.assert_allclose(step, [scale * k for k in optimum], rtol=1e-12)
            assert odd_quintic(step, lo) + odd_quintic(step, hi) == pytest.approx(2.0, abs=1e-12)
        elif error > 0:
            np.testing.assert_allclose(step, optimum, rtol=1e-12)


def test_default_steps_map_design_range_to_one():
    x = np.geomspace(1e-3, 1.0, 200_001)
    assert np.abs(composed(polar_express_coefficients(), x) - 1.0).max() < 1e-12


def test_safety_applies_to_all_steps_but_the_last():
    safe, unsafe = polar_express_coefficients(), unsafe_steps()
    for (a, b, c), (ua, ub, uc) in zip(safe[:-1], unsafe[:-1]):
        np.testing.assert_allclose([a, b, c], [ua / 1.01, ub / 1.01**3, uc / 1.01**5], rtol=1e-15)
    assert safe[-1] == unsafe[-1]


def test_modes_below_the_design_bound_are_only_partly_lifted():
    lifted = composed(polar_express_coefficients(), np.array([1e-5, 1e-4]))
    assert np.all(lifted < 0.9), "below the design bound the polar factor is inaccurate by design"


def test_collapsed_interval_uses_the_rescaled_classical_quintic():
    u = 1.2
    (a, b, c), error, _ = minimax_quintic(u * (1 - 1e-7), u)
    assert error == 0.0
    np.testing.assert_allclose([a * u, b * u**3, c * u**5], [15 / 8, -10 / 8, 3 / 8])
    assert odd_quintic((a, b, c), u) == pytest.approx(1.0)
    # Enough steps collapse the interval, so the construction reaches that branch by itself.
    last = polar_express_coefficients(12)[-1]
    assert last[0] * 8 / 15 == pytest.approx(last[2] * 8 / 3, rel=1e-6)


def test_muon_quintic_does_not_converge():
    x = np.geomspace(1e-3, 1.0, 1001)
    y = composed([MUON_QUINTIC] * 10, x)
    assert np.abs(y - 1.0).max() > 0.1


def test_coefficients_are_cached_and_immutable():
    assert polar_express_coefficients() is polar_express_coefficients(8, 1e-3, 1.01)
    assert isinstance(polar_express_coefficients()[0], tuple)


@pytest.mark.parametrize(
    "kwargs", [dict(steps=0), dict(steps=2.5), dict(lower=0.0), dict(lower=1.5), dict(safety=0.9)]
)
def test_bad_construction_arguments(kwargs):
    with pytest.raises(ValueError):
        polar_express_coefficients(**kwargs)


def test_resolve_coefficients():
    assert resolve_polar_coefficients(None, None) == polar_express_coefficients(8)
    assert resolve_polar_coefficients(5, MUON_QUINTIC) == (MUON_QUINTIC,) * 5
    explicit = [(2.0, -1.5, 0.5)] * 3
    assert len(resolve_polar_coefficients(None, explicit)) == 3
    with pytest.raises(ValueError, match="does not match"):
        resolve_polar_coefficients(4, explicit)
    with pytest.raises(ValueError, match="triple"):
        resolve_polar_coefficients(None, [(1.0, 2.0)])
    with pytest.raises(ValueError, match="finite"):
        resolve_polar_coefficients(None, (math.nan, 1.0, 1.0))


@pytest.mark.parametrize("n", [2, 8, 16])
@pytest.mark.parametrize("lo", [0.05, 0.3, 0.7])
def test_minimax_root_step_equioscillates(n, lo):
    # The defining property of the minimax step: |1 - g| peaks at E, alternating, at its four points.
    (a, b, c), error, points = minimax_root_step(lo, 1.0, n)
    values = np.array([root_step((a, b, c), t, n) for t in points])
    assert np.allclose(values, 1.0 - error * np.array([1, -1, 1, -1]), atol=1e-10)
    t = np.linspace(lo, 1.0, 20001)
    assert np.abs(root_step((a, b, c), t, n) - 1.0).max() <= error * (1 + 1e-8)


def test_the_root_step_of_order_two_is_the_odd_quintic():
    assert minimax_root_step(0.1, 1.0, 2)[0] == minimax_quintic(0.1, 1.0)[0]


@pytest.mark.parametrize("n, lower", [(8, 1e-4), (8, 1e-3), (16, 1e-7)])
def test_inverse_root_design_reaches_its_tolerance(n, lower):
    # Every eigenvalue m in [lower, 1] ends within the tolerance of 1 (t = m^(1/n) within it / n), the
    # safety margin included (it costs a little of the last step's accuracy).
    tolerance = 1e-7
    t = np.geomspace(lower, 1.0, 20001) ** (1.0 / n)
    for step in inverse_root_coefficients(n, lower, tolerance / n):
        t = root_step(step, t, n)
    assert np.abs(t**n - 1.0).max() <= 10 * tolerance


@pytest.mark.parametrize("gamma", [-8.0, -0.924, 1.0, 2.0])
def test_power_polynomial_meets_its_tolerance(gamma):
    coefficients, lo, hi = power_polynomial(gamma, 1.0, 3.2, 1e-7)
    z = np.linspace(lo, hi, 10007)
    u = (2 * z - hi - lo) / (hi - lo)
    assert np.abs(np.polynomial.polynomial.polyval(u, coefficients) / z**gamma - 1).max() <= 1e-7


@pytest.mark.parametrize("gamma", [-1.0, -0.924, -0.5, 0.5, 1.0])
@pytest.mark.parametrize("hi", [3.2, 4.7])
def test_power_polynomials_as_used_cancel_little(gamma, hi):
    # plan.matrix_power_of_root asks for exponents in [-1, 1] on spreads up to the root's lift (4.7 for the
    # design bound 1e-4): there the terms' magnitudes sum to a few times the value at any |u| <= 1, so
    # rounding each term costs at most 8 units of the result (4.8 at most measured), not a cancellation.
    coefficients, lo, hi = power_polynomial(gamma, 1.0, hi, 1e-7)
    assert sum(abs(k) for k in coefficients) <= 8 * min(lo**gamma, hi**gamma)


@pytest.mark.parametrize("exponent", [-0.75, -0.125, 0.25, 1.25])
def test_floor_polynomial_meets_its_tolerance(exponent):
    coefficients, lo, hi = floor_polynomial(exponent, 0.5005, 1e-7)
    w = np.linspace(lo, hi, 10007)
    u = (2 * w - hi - lo) / (hi - lo)
    assert np.abs(np.polynomial.polynomial.polyval(u, coefficients) / (1 - w) ** exponent - 1).max() <= 1e-7
    with pytest.raises(ValueError, match="need 0 < hi < 1"):
        floor_polynomial(exponent, 1.0, 1e-7)


@pytest.mark.parametrize("gamma", [-1.0, -0.31, 0.0, 0.77, 1.0])
def test_interpolated_coefficients_meet_the_tolerance_across_their_span(gamma):
    # One degree for the whole span (16 here), coefficients from the function's values on the device. The
    # change to powers of u multiplies rounding by up to 2^16 (numpy's recurrence loses less): 1.4e-8
    # measured at worst, below fp32's resolution, which is where a capturable step's power runs.
    coefficients = interpolated_coefficients("power", torch.tensor(gamma), 1.0, 3.2, 1e-9, (-1.0, 1.0))
    z = np.linspace(1.0, 3.2, 10007)
    u = (2 * z - 4.2) / 2.2
    assert np.abs(np.polynomial.polynomial.polyval(u, coefficients.numpy()) / z**gamma - 1).max() <= 5e-8
