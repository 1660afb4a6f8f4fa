"""The iterations and their coefficients: every polynomial iteration of the plan, on ``kernels``.

Polar Express on the rectangle (:func:`polar_iterations`) and in Gram space (:func:`coupled_inverse_root`,
restarted in blocks of :func:`restart_blocks`), the matrix sign (:func:`matrix_sign`), ``G^k`` by
repeated squaring, and the real powers' inverse root and polynomials (docs/real-powers.md). Each
takes ``kernels`` (one method per primitive of :mod:`spectral_ops.backends.base`) and a precision
(:mod:`spectral_ops.precision`). Which coefficients a polar factor iterates is chosen here too
(:func:`polar_coefficients`, :func:`orthogonalization_coefficients`).
"""

from __future__ import annotations

import math

import torch

from ..coefficients import (
    floor_polynomial,
    interpolated_coefficients,
    polar_express_coefficients,
    power_polynomial,
    resolve_polar_coefficients,
    without_normalization_margin,
)
from ..linalg import frobenius_normalized
from ..precision import OPERAND_DTYPES

# How an even power's polar factor is iterated: Polar Express on the r x N rectangle; or a coupled
# "auto" chooses.
ITERATIONS = ("rectangle", "gram_space", "auto")
# Gram space works on G, whose condition number is the square of W's. With restarts it is as accurate as
# the rectangle in fp32/fp64, but in bf16/fp16 a few times less (docs/results/schedules.md), so "auto"
# keeps those on the rectangle.
GRAM_SPACE_PRECISIONS = ("fp32", "fp64")
GRAM_SPACE_SAVING = 0.25
# The longest run of Gram-space steps between two restarts. Without restarts the iterate Z (which tends
# to G^(-1/2)) amplifies G's rounding by up to 1/s_min (in bf16 to NaN); blocks of at most 3 steps keep
# fp32 at the rectangle's accuracy at every kappa (docs/results/schedules.md, gram_space_no_restarts).
GRAM_SPACE_BLOCK = 3


def restart_blocks(steps: int, longest: int = GRAM_SPACE_BLOCK) -> list[int]:
    """Steps per Gram-space block: as even as blocks of at most ``longest`` steps allow, the shorter
    first (8 steps: 2, 3, 3). The first steps lift the small modes most (their Z grows
    fastest), so restarting soonest after them helps most."""
    if steps <= 0:
        return []
    blocks = -(-steps // longest)
    short, longer = divmod(steps, blocks)
    return [short] * (blocks - longer) + [short + 1] * longer


def repeated_squaring(k: int, square, multiply):
    """``G^k`` as the product of the squares ``square(2^j) = G^(2^j)`` its binary digits select.

    ``square`` caches the squares (each computed at most once); ``multiply`` is the product of two
    commuting symmetric factors.
    """
    if not isinstance(k, int) or k < 0:
        # A negative k never reaches 0 by k >>= 1: the loop would never end.
        raise ValueError(f"repeated_squaring computes G^k for an integer k >= 0, got {k!r}")
    result, exponent = None, 1
    while k:
        if k & 1:
            factor = square(exponent)
            result = factor if result is None else multiply(result, factor)
        k >>= 1
        exponent <<= 1
    return result


def polar_iterations(kernels, X: torch.Tensor, coefficients, precision: str,
                     first_gram: torch.Tensor | None = None, scale: float = 1.0):
    """Apply ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` for each ``(a, b, c)``, from ``scale X``.

    ``first_gram`` lets a caller that already holds ``X X^T`` skip the first product. ``scale`` is
    folded into the first step's coefficients (``A = s^2 X X^T`` and ``a s X + s (P X)``), not applied
    as a pass over ``X`` and its Gram.
    """
    for step, (a, b, c) in enumerate(coefficients):
        A = first_gram if step == 0 and first_gram is not None else kernels.symmetric(X, X.mT, precision)
        first_gram = None  # the first step's A only: not held through the loop
        s = scale if step == 0 else 1.0
        P = kernels.poly_step(A, b * s**2, c * s**4, precision)
        del A
        X = kernels.product(P, X, precision, alpha=s, Y=X, beta=a * s)
    return X


def coupled_inverse_root(kernels, G: torch.Tensor, coefficients, precision: str, identity: torch.Tensor):
    """``Z``, the polynomial in ``G = X X^T`` with ``Z X`` what Polar Express's steps make of ``X``.

    Polar Express multiplies ``X`` by ``T = a I + b M + c M^2`` with ``M = X X^T``. Writing ``X = Z X0``
    (``Z`` a polynomial in ``G``) and ``Y = Z G`` gives ``M = Z Y`` and the updates ``Y <- Y T``,
    ``Z <- T Z``: products of commuting symmetric matrices, with ``Z -> G^(-1/2)``. ``Y`` and ``Z`` are
    iterated together (coupled) because ``Z`` alone (``M = Z G Z``) amplifies the Gram's rounding by
    ``1 / s_min^2`` and diverges.

    ``Z Y``, ``Y T`` and ``T Z`` are full products, not symmetric ones: a product that keeps one
    triangle (the kernels' symmetric primitive) makes ``Y`` and ``Z`` stop commuting, and that error
    grows several-fold per step, to far beyond the rectangle's error after 8."""
    Y, Z, identity = G, None, identity.to(G.dtype)  # every iterate is in G's (the operand) dtype
    for step, (a, b, c) in enumerate(coefficients):
        M = Y if Z is None else kernels.product(Z, Y, precision)
        T = kernels.poly_step(M, b, c, precision) + a * identity
        del M
        if step < len(coefficients) - 1:  # the last Y is not needed
            Y = kernels.product(Y, T, precision)
        Z = T if Z is None else kernels.product(T, Z, precision)
    return Z


# Real powers: the order n of the inverse root Z = A^(-1/n) a polynomial of which gives A^f. n = 8 was
# the cheapest (docs/real-powers.md): a few steps of 6 products, and Z's eigenvalues within
# ROOT_LOWER^(-1/8) = 2.4 of each other, where a polynomial of degree ~10 suffices. A larger n for a
# lower bound is no cure: its first steps overshoot, M's top grows like (1 + delta)^n, and the rounding
# relative to it swamps the small modes (NaN in fp32 from n = 32).
ROOT_ORDER = 8
# The root's design bound, relative to b ~ s_max. 1e-4 resolved more modes, but its first steps' larger
# coefficients cost fp32 accuracy (kappa 1e3: 5.6e-6 against 3.9e-6; kappa 1e6, whose modes below the
# bound are lifted to about it either way: 4e-3 against 2.6e-3), and a step more.
ROOT_LOWER = 1e-3
# The relative accuracy the root's steps and the polynomial are designed for, per precision: below the
# products' own rounding, so that the construction adds nothing measurable to it.
REAL_POWER_TOLERANCE = {"fp64": 1e-13, "fp32": 1e-7, "tf32": 1e-4, "bf16": 1e-3, "fp16": 1e-4}
# The least eigenvalue a real power's A = |Xn| / b resolves, relative to its top, per precision: the
# operands' rounding (unit u) moves A's eigenvalues by about u, and one that rounding makes negative
# diverges in the inverse root (m <- T^8 m grows for m < 0). A is shifted by this much, which moves a
# mode x by a relative shift / x: those below it were the rounding's already. fp32 and fp64 resolve
# below the design bound and are not shifted.
RESOLUTION = {"fp64": 0.0, "fp32": 0.0, "tf32": 2.0**-9, "bf16": 2.0**-6, "fp16": 2.0**-9}
# A power held in a 0-d tensor (capturable: the host cannot read it) is floored, and designed for
# |p| <= this (DynMuon's schedule spans +-0.25); a larger one gives NaN.
TENSOR_POWER_BOUND = 1.0
# Its polynomials' coefficients come from values at fixed nodes on the device, a sum that cancels about
# 2^degree ulps (fp64: the degree for 1e-13 would lose 1e-8 to it): designed for no finer than this.
DEVICE_DESIGN_TOLERANCE = 1e-10


def design_widening(tolerance: float) -> float:
    """The factor a real power's polynomials widen their interval by, for the root's residual (its
    design ``tolerance``) and the rounding."""
    return 1.0 + max(1e-3, 10 * tolerance)


def inverse_root(kernels, A: torch.Tensor, n: int, coefficients, precision: str,
                 identity: torch.Tensor) -> torch.Tensor:
    """``Z -> A^(-1/n)`` for a symmetric ``A`` with eigenvalues in the design interval of
    ``coefficients`` (:func:`~spectral_ops.coefficients.inverse_root_coefficients`): ``T = a I + b M +
    c M^2``, ``Z <- Z T``, ``M <- T^(n/2) M T^(n/2)`` from ``M = A``, ``Z = I``, so that ``M = Z^n A`` and
    ``M -> I``.

    ``M`` is iterated with ``Z`` (coupled) rather than formed as ``Z^n A``, which would amplify ``A``'s
    rounding by its condition number. The sandwich keeps ``M`` symmetric to rounding, as ``T^n M`` did
    not: that product's asymmetric error reached ``Z`` as errors between its top and bottom modes, which
    the real power raises to ``8 f`` (fp32, kappa 1e3: 1.5e-5 to 2.4e-5 against 2.2e-6 to 3.9e-6 now),
    for the same products (``T^(n/2)`` by one squaring fewer, one product more). ``Z T`` is a full
    product (commuting symmetric factors, as in :func:`coupled_inverse_root`)."""
    M, Z, identity = A, None, identity.to(A.dtype)
    for step, (a, b, c) in enumerate(coefficients):
        T = kernels.poly_step(M, b, c, precision) + a * identity
        Z = T if Z is None else kernels.product(Z, T, precision)
        if step < len(coefficients) - 1:  # the last M is not needed
            half = T
            for _ in range(n.bit_length() - 2):
                half = kernels.symmetric(half, half, precision)
            M = kernels.product(kernels.product(half, M, precision), half, precision)
    return Z


def symmetric_polynomial(kernels, U: torch.Tensor, coefficients, precision: str,
                         identity: torch.Tensor) -> torch.Tensor:
    """``sum_i coefficients[i] U^i`` for a symmetric ``U`` (Paterson-Stockmeyer): the powers up to
    ``U^s`` with ``s ~ sqrt(degree)``, then Horner's rule in ``U^s`` over blocks of ``s`` coefficients,
    about ``2 sqrt(degree)`` products instead of ``degree``."""
    degree = len(coefficients) - 1
    size = max(1, math.isqrt(degree + 1))
    powers = [identity.to(U.dtype).expand_as(U), U]  # a block of the constant term alone is a stack too
    while len(powers) <= size:
        powers.append(kernels.symmetric(powers[-1], U, precision))

    def block(start):
        total = 0
        for i, c in enumerate(coefficients[start:start + size]):
            total = total + c * powers[i]
        return total

    starts = list(range(0, degree + 1, size))
    result = block(starts[-1])
    for start in reversed(starts[:-1]):
        result = kernels.product(result, powers[size], precision) + block(start)
    return result


def root_squarings(largest: float, tolerance: float) -> tuple[int, float]:
    """``(j, tolerance')`` for a power of exponent up to ``largest`` in magnitude, taken as a polynomial of
    its ``2^j``-th root and ``j`` squarings: ``j`` the least that brings the exponent to at most 1 (a steep
    power needs a high degree, its root a low one), and the polynomial's design tolerance, so that the
    squarings, each doubling its relative error, keep the power within ``tolerance``."""
    squarings = max(0, math.ceil(math.log2(largest))) if largest else 0
    # No finer than float64 resolves on the grid the design is checked on.
    return squarings, max(tolerance / 2**squarings, 1e-14)


# The functions a real power evaluates by a polynomial, as (exponent, lo, hi, tolerance) -> the
# design of coefficients.power_polynomial: z^exponent on [lo, hi], and (1 - w)^exponent on [0, hi].
POLYNOMIALS = {"power": power_polynomial,
               "floor": lambda exponent, lo, hi, tolerance: floor_polynomial(exponent, hi, tolerance)}


def function_polynomial(kernels, M: torch.Tensor, function: str, exponent, lo: float, hi: float, tolerance: float,
                        precision: str, identity: torch.Tensor, bound: float = 1.0) -> torch.Tensor:
    """:data:`POLYNOMIALS` ``[function]`` of a symmetric ``M`` with eigenvalues in ``[lo, hi]``, by one
    polynomial (Paterson-Stockmeyer). An ``exponent`` held in a 0-d tensor (a capturable step's power),
    of magnitude at most ``bound``, has its coefficients computed on its device
    (:func:`~spectral_ops.coefficients.interpolated_coefficients`)."""
    if torch.is_tensor(exponent):
        coefficients = interpolated_coefficients(function, exponent, lo, hi, max(tolerance, DEVICE_DESIGN_TOLERANCE),
                                                 (-bound, bound))
    else:
        coefficients, lo, hi = POLYNOMIALS[function](exponent, lo, hi, tolerance)
    U = (2.0 / (hi - lo)) * M - ((hi + lo) / (hi - lo)) * identity.to(M.dtype)
    return symmetric_polynomial(kernels, U, coefficients, precision, identity)


def matrix_power_of_root(kernels, Z: torch.Tensor, gamma: float, lo: float, hi: float, tolerance: float,
                         precision: str, identity: torch.Tensor) -> torch.Tensor:
    """``Z^gamma`` for a symmetric ``Z`` with eigenvalues in ``[lo, hi]``: ``z^(gamma / 2^j)`` by a
    polynomial (:func:`~spectral_ops.coefficients.power_polynomial`), then ``j`` squarings
    (:func:`root_squarings`). A power held in a tensor is floored, and takes :meth:`GramPlan._floored_power`."""
    squarings, tolerance = root_squarings(abs(gamma), tolerance)
    F = function_polynomial(kernels, Z, "power", gamma / 2**squarings, lo, hi, tolerance, precision, identity)
    for _ in range(squarings):
        F = kernels.symmetric(F, F, precision)
    return F


def matrix_sign(kernels, A: torch.Tensor, coefficients, precision: str, symmetrized: bool = False) -> torch.Tensor:
    """``msign`` of a symmetric ``A`` (SPEC 1.4): normalise by ``||A||_F``, then one sign step per triple.

    ``A`` is in the compute dtype; the result is in the operand dtype of ``precision``. A fused chain
    normalises again, harmlessly: it gets the unit-norm ``A``, whose square cannot leave fp32's range.
    ``symmetrized``: each step's result is symmetrised (no fused chain): a sign step takes ``Z Z^T`` for
    ``Z^2``, so it iterates the polar factor, whose value on eigenvalues within a few hundred units of
    rounding of 0 (the zero cutoff's, :data:`~.thresholds.CUTOFF_RESOLUTION`) turns with the products'
    asymmetric rounding.
    """
    Z = frobenius_normalized(A)[0]
    chained = None if symmetrized else kernels.small_chain(Z, 0, coefficients, precision, sign=True)
    if chained is not None:
        return chained.to(OPERAND_DTYPES[precision])
    Z = Z.to(OPERAND_DTYPES[precision])
    for coefficient in coefficients:
        Z = kernels.sign_step(Z, coefficient, precision)
        if symmetrized:
            Z = (Z + Z.mT) * 0.5
    return Z


# ----- which coefficients a polar factor iterates, chosen here for every op, decay and optimizer

def floor_lifts(p, floored: bool) -> bool:
    """Whether the power ``p`` with a floor (``floored``) lifts its small modes: ``(s^2 + (eps s_max)^2)^(p/2)``
    weighs every non-zero mode, however small, by at least the floor's weight (``eps^p`` of the top's for
    ``p > 0``, the most for ``p < 0``), so it needs the polar factor on every non-zero mode and none on the
    zero ones, as the clip's ``min=`` does (:func:`~.thresholds.lift_design`). A number ``p = 0`` is the polar
    factor itself, floored or not (its design bound is its own documented limit); a power in a tensor may be
    anything."""
    return floored and (torch.is_tensor(p) or p != 0)


def polar_coefficients(steps: int | None, coefficients=None, powers=(), *, floored: bool = False,
                       thresholded: bool = False):
    """The polar coefficients of an op's (or a decay's) directions of ``powers``, from the caller's checked
    ``steps`` and ``coefficients``: None where neither is given and the plan designs them: for a
    ``thresholded`` form whose every power is an integer (for its threshold,
    :func:`~.thresholds.threshold_design`) and for a power whose floor lifts (:func:`floor_lifts`: down to
    the zero cutoff, :func:`~.thresholds.lift_design`, where its precision resolves it); else
    :func:`~spectral_ops.coefficients.resolve_polar_coefficients`'s, a real power's (not an integer, or any
    power but 0 with a floor: ``floored``) designed further down
    (:data:`~spectral_ops.coefficients.REAL_POWER_LOWER`)."""
    given = steps is not None or coefficients is not None
    if not given and any(floor_lifts(q, floored) for q in powers):
        return None
    # A power held in a tensor is not an int: real, without reading it on the host.
    real_power = any(not isinstance(q, int) or (floored and q != 0) for q in powers)
    if thresholded and not given and not real_power:
        return None
    return resolve_polar_coefficients(steps, coefficients, real_power=real_power)


def update_coefficients(steps: int | None, coefficients, power):
    """A Muon-family update's polar coefficients (:func:`~.routing.power_update`): Muon's (Polar Express, 8
    steps) or the given ones, as :func:`polar` takes them; None (the plan's design) for a power whose floor
    lifts (every update's but ``q = 0``'s) where nothing is given."""
    if steps is None and coefficients is None and floor_lifts(power, True):
        return None
    return resolve_polar_coefficients(steps, coefficients)


def orthogonalization_coefficients(steps: int | None, ns_coefficients=None) -> tuple:
    """A Muon step's polar iteration: Polar Express (8 steps), or the given quintics (5 steps by default)
    normalised by ``||G||_F`` alone, as torch.optim.Muon does (the margin taken out of the first step)."""
    if ns_coefficients is None:
        return polar_express_coefficients(steps or 8)
    return without_normalization_margin(resolve_polar_coefficients(5 if steps is None else steps, ns_coefficients))
