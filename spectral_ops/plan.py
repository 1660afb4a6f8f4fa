"""The algorithm, written once: every op as a sequence of primitive calls.

Each function takes ``kernels``, the object dispatch hands out for one op call
(:func:`spectral_ops.dispatch.kernels_for`): it has one method per primitive of
:mod:`spectral_ops.backends.base` and routes every call to a backend. The plan never chooses a
backend and never imports dispatch; it only asks whether a fused small chain is available
(``kernels.small_chain`` returns None when none is). What it computes is chosen here, in one place:
:func:`route` (the method, an even power's iteration, chain or composed), weighing :func:`cost`, the
FLOPs read off this very plan on meta tensors. A decay (:func:`decay_`) is the whole step of a stack
of matrices: the ``p = 1`` shortcut, the stability guard (:func:`stability_clamp`, its ``s_max``
bound from the plan's own Gram and squares), the clamp, the direction and the write.

The shape of the computation (SPEC 1.2-1.4):

* Everything runs in the *wide* orientation ``X`` (``r x N``, ``r = min(m, n)``; a tall weight is
  transposed as a view), so the Gram ``X X^T`` is the small side and every spectral factor multiplies
  ``X`` from the left.
* ``X`` is scaled to unit Frobenius norm once (``Xn = X / c``, through a power of two so that no square
  leaves the range): the Gram ``Gn = Xn Xn^T`` and its powers stay in range, and the scale ``c^p`` is
  applied once at the end, from its log (it can overflow where ``S_p`` does not), or folded into the
  decay's step. A result beyond the dtype raises OverflowError before anything is written (except
  on the capturable path, which cannot read a flag back: there it comes out as Inf). ``Gn`` doubles as the first Polar
  Express step's ``A`` (up to the constant margin).
* ``S_p = c^p Gn^k Q`` for ``p = 2k`` and ``c^p Gn^k Xn`` for ``p = 2k + 1``, with ``Gn^k`` by repeated
  squaring; every product of polynomials in ``Gn`` is symmetric. Band forms need one rectangular product
  by ``P_top``. A decay computes its direction ``D`` and writes ``W <- keep W + step D`` once.
* Small matrices take a backend's fused chain where one exists: the whole op in one launch per matrix.

**Precision** (:func:`resolve_precision`) decides the dtype of the iteration's operands: every
product takes them in that dtype, accumulates in fp32 (fp64 for ``"fp64"``) and rounds its result to
it, as torch.optim.Muon's bf16 iteration does. The normalisation, the scale ``c^p``, the band
thresholds and the decay arithmetic stay in the compute dtype (fp64 for fp64 weights or ``"fp64"``,
fp32 otherwise), and the result is rounded to the weight's dtype once.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from dataclasses import InitVar, dataclass, field
from dataclasses import fields as dataclasses_fields
from typing import Union

import torch

from ._checks import check_power, renamed_argument, user_stacklevel
from ._compile import constant_when_traced
from .coefficients import (NORMALIZATION_MARGIN, floor_polynomial, interpolated_coefficients,
                           inverse_root_coefficients, polar_express_coefficients, polar_express_design,
                           power_polynomial)
from .linalg import (SpectralFactors, as_float64, compute_dtype, frobenius_normalized, is_tall, power_weights, ratio,
                     relative_powers, scaled_, wide, zero_mode_cutoff)

Scale = Union[float, torch.Tensor]  # a Python number, a 0-d tensor, or one value per matrix (..., 1, 1)


@dataclass(frozen=True)
class Band:
    """Band-selective decay (SPEC 1.4), split at singular value ``tau``.

    ``mode`` is ``"top"`` (the spectral rule above ``tau``, ordinary decay below), ``"bot"``,
    ``"top_only"``, ``"bot_only"``, ``"two_band"`` or ``"clip"``: ``U (s - tau)_+ V^T``, each singular
    value's excess over ``tau`` (with ``p = 1``), so that a decay by it is the clipped decay
    ``s -> s - c (s - tau)_+`` (``c`` = the step's ``lr lambda``; ``c = 1`` caps at ``tau``). In ``"two_band"`` the call's ``p`` and
    ``spectral_weight_decay`` act on the top band and ``p_bot``/``spectral_weight_decay_bot`` on the
    bottom one. ``sign_steps``/``sign_method`` configure the sign iteration of the projector (by default
    designed for ``tau``: :func:`threshold_design`).
    ``weight_decay_bot`` is the deprecated name of ``spectral_weight_decay_bot``.
    """

    tau: Scale
    mode: str = "top"
    p_bot: int = 1
    spectral_weight_decay_bot: Scale | None = None  # None: 0
    sign_steps: int | None = None
    sign_method: str = "polar_express"
    weight_decay_bot: InitVar[Scale | None] = None

    def __post_init__(self, weight_decay_bot):
        coefficient = renamed_argument("Band", "spectral_weight_decay_bot", self.spectral_weight_decay_bot,
                                       "weight_decay_bot", weight_decay_bot)
        object.__setattr__(self, "spectral_weight_decay_bot", 0.0 if coefficient is None else coefficient)

    @classmethod
    def coerce(cls, band) -> "Band | None":
        """Accept a :class:`Band`, a dict of its fields (as stored in param groups) or None."""
        if band is None or isinstance(band, Band):
            return band
        if isinstance(band, dict):
            unknown = set(band) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown band options {sorted(unknown)}; known: {sorted(cls.fields())}")
            return cls(**band)
        raise TypeError(f"band must be a Band, a dict or None, got {type(band).__name__}")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses_fields(cls))


@dataclass(frozen=True)
class DecayRequest:
    """One validated decay step of a stack of matrices (:func:`decay_`):
    ``W <- (1 - scale lambda_1) W - scale lambda_p S_p(W)``, the guard and the clamp included.

    ``scale`` is the lr (decoupled) or the schedule multiplier (independent). With ``p = 0`` and
    ``p0_mode = "prox"`` the spectral part is the exact soft-threshold at ``scale lambda_p``. With a
    ``"two_band"`` band, ``spectral_weight_decay`` and the band's ``spectral_weight_decay_bot`` weight
    the two bands. ``stability``: what the guard does with a step that would reorder the singular
    values (:data:`STABILITY_POLICIES`); ``capturable``: no host synchronisation. ``method``: how the
    direction is computed (:func:`route`). ``increment``: write the step's increment (the new value less
    ``W``, each term formed as such: no cancellation) instead of the new value. ``rounding``: how the
    fp32 result is rounded to bf16/fp16 weights (:data:`ROUNDINGS`), ``"stochastic"`` drawing its bits
    from ``generator`` (None: the device's default generator). Coefficients None: designed for the
    band's threshold (:func:`threshold_design`), at ``threshold_ratio = tau / ||W||_F`` where that is
    known (the cost model's meta stacks) or read from ``W`` (eager).
    """

    p: float  # an int where integral (a real power, SPEC 1.1)
    scale: Scale
    spectral_weight_decay: Scale
    ordinary_weight_decay: Scale = 0.0
    band: Band | None = None
    p0_mode: str = "explicit"
    polar_coefficients: tuple = ()
    sign_coefficients: tuple = ()
    precision: str | None = None
    iteration: str = "auto"
    stability: str = "ignore"
    capturable: bool = False
    method: str = "gram"
    increment: bool = False
    rounding: str = "nearest"
    generator: torch.Generator | None = None
    threshold_ratio: float | None = None


# How the decay rounds its fp32 result into bf16/fp16 weights: to the nearest value, or stochastically
# (unbiased: a step below half a unit of the weight survives on average instead of vanishing).
ROUNDINGS = ("nearest", "stochastic")
# The dtypes stochastic rounding acts on: the decay's arithmetic is in fp32, so wider weights keep it.
STOCHASTICALLY_ROUNDED = (torch.bfloat16, torch.float16)


def rounding_noise(W: torch.Tensor, request: DecayRequest) -> torch.Tensor | None:
    """The random bits of a stochastically rounded decay of ``W``: 16 per element, as an int16 tensor
    of ``W``'s shape (the epilogue primitives read element ``i`` of ``W`` in row-major order with
    element ``i`` of it), drawn from the request's generator, on the device without a host read (a
    CUDA generator advances its offset on the device, so a captured graph draws afresh at each
    replay). None where nothing rounds stochastically."""
    if request.rounding != "stochastic" or W.dtype not in STOCHASTICALLY_ROUNDED:
        return None
    # Drawn as 32-bit words, two entries' bits each: half the generator calls of 16-bit draws.
    words = torch.randint(-2**31, 2**31, ((W.numel() + 1) // 2,), dtype=torch.int32, device=W.device,
                          generator=request.generator)
    return words.view(torch.int16)[:W.numel()].view(W.shape)


OPS = ("polar", "msign", "spectral_power", "power_update", "band_projectors", "band_direction", "svt",
       "spectral_clip", "spectral_norm_bounds", "decay_")
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")
OPERAND_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                  "fp16": torch.float16}
# torch.set_float32_matmul_precision's settings, read as precisions for float32 weights.
FLOAT32_MATMUL_PRECISIONS = {"highest": "fp32", "high": "tf32", "medium": "bf16"}


def resolve_precision(precision: str | None, dtype: torch.dtype) -> str:
    """``precision=None``, defined once: follow the weight's dtype, and for float32 weights torch's own
    ``torch.get_float32_matmul_precision()`` (``"highest"``: fp32, ``"high"``: tf32, ``"medium"``: bf16)."""
    if precision is not None:
        return precision
    if dtype == torch.float64:
        return "fp64"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return _float32_precision()


def clip_precision(precision: str | None, dtype: torch.dtype) -> str:
    """``spectral_clip``'s ``precision=None``: fp32 operands (fp64 for float64 weights), whatever the weight's
    dtype or torch's float32 matmul setting. Its result is a difference of ``s_max``-sized terms,
    ``W - P_top(max) (W - max Q)``, so an operand's rounding lands on the clipped modes magnified by
    ``s_max / max`` (bf16 operands: 0.22 at ``max = s_max / 100`` on a Gaussian 256 x 512, fp32 ones 1.7e-3,
    the bf16 result's own rounding), and its lift needs the polar factor down to the zero cutoff, which
    no bf16, fp16 or tf32 iteration resolves. On a GPU fp32 operands take about twice the time of bf16
    ones; ``precision="bf16"`` (or another) still asks for those operands, with their accuracy."""
    if precision is not None:
        return precision
    return "fp64" if dtype == torch.float64 else "fp32"


@constant_when_traced
def _float32_precision() -> str:
    """torch's float32 matmul setting as a precision. Under torch.compile it is read once, when a
    graph is traced (as Inductor reads it), since reading it is not traceable."""
    try:
        return FLOAT32_MATMUL_PRECISIONS[torch.get_float32_matmul_precision()]
    except RuntimeError:  # the per-backend API (torch.backends.cuda.matmul.fp32_precision) is in use
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"


# How an even power's polar factor is iterated: Polar Express on the r x N rectangle; or a coupled
# iteration on the r x r Gram, restarted from the rectangle every few steps (GramPlan.gram_polar);
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


# The guard's s_max bound: the squarings of the Gram it may add to the direction's (SPEC 1.5).
GUARD_SQUARINGS = 3
# The rounding of a product at each precision, as unit roundoffs: (the operand's own, at unit norm; a
# product's result and re-rounded operands, relative; the accumulation, per term of the inner
# dimension). fp32 allows for the GPU kernels' 3xTF32 and tensor-core accumulators (2^-22, not 2^-24).
ROUNDING = {
    "fp64": (0.0, 2.0**-52, 2.0**-52),
    "fp32": (0.0, 2.0**-22, 2.0**-22),
    "tf32": (2.0**-11, 2.0**-10, 2.0**-22),
    "bf16": (2.0**-8, 2.0**-8, 2.0**-22),
    "fp16": (2.0**-11, 2.0**-11, 2.0**-22),
}
RELATIVE_ROUNDING_CAP = 1e10
# ||X||_F's relative rounding, in units of the compute dtype's eps (a reduction's error grows with log2 of
# its length; 64 covers 2^64 terms).
NORM_ROUNDING = 64


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


# ----- thresholds (docs/real-powers.md, "Thresholds at any depth"): where the band ops' sign iteration
# runs and with how many steps, so that every mode at least THRESHOLD_RESOLUTION (relatively) from the
# threshold is resolved, from tau = s_max down to s_max / 1000 and below.

THRESHOLD_RESOLUTION = 0.01
# Polar Express's default design bound (8 steps), which the polar factor and the Gram's sign keep where
# the threshold needs no more: there the band ops are what they were, bit for bit.
DEFAULT_LOWER = 1e-3
DEFAULT_STEPS = 8
# A capturable call cannot read ||W||_F: its fixed design covers tau >= s_max / 1000, whatever the
# spectrum (s_max >= ||W||_F / sqrt(r), so tau / ||W||_F >= CAPTURABLE_DEPTH / sqrt(r)).
CAPTURABLE_DEPTH = 1e-3
# The design error of the designed steps: below the rounding of the band's final product (fp32 or fp64,
# :meth:`GramPlan._final_product`), whatever the operands' precision.
THRESHOLD_TOLERANCE = {torch.float32: 1e-7, torch.float64: 1e-13}
# The Gram's smallest gap (relative, as below) at which its rounding still leaves the projector within
# the fp32 (2e-5) and fp64 (1e-11) bounds, per precision: measured on CPUs, the error is at most about
# max(5e-6, 1e-10 / gap) in fp32 and 1e-18 / gap in fp64 (r = 64 and 256, N up to 16 r, modes placed 1%
# from tau: tests/test_thresholds.py); 5e-5 leaves 4x for the GPU kernels' 3xTF32 (2^-22). bf16, fp16 and
# tf32 operands round the Gram too coarsely for any 1% gap: they keep it only where the default design does.
GRAM_RESOLVES = {"fp32": 5e-5, "fp64": 1e-6}
# A lift (spectral_clip's min=, a band form with p = 0 below tau) maps every mode below tau to O(1),
# however small: its polar factor must resolve each non-zero mode, down to the zero cutoff
# (linalg.zero_mode_cutoff, N eps s_max), where the threshold's design stops at tau (and the default one at
# 1e-3 ||W||_F: 0.31 min at s = 1e-4 ||W||_F before). A factor designed that deep also amplifies the
# round-off of a rank-deficient matrix's zero modes (an eps in step j grows by the later steps' linear
# coefficients, ~1 / lower in all): measured 0.2 of min on the zero modes of a 64 x 128 of rank 8. So the lift
# takes Q on the modes above the cutoff only, P_top(c) Q, with a sign iteration on |Xn| - c I (where the
# zero modes sit at -c, away from the sign's unstable 0, and |Xn| = Xn Q^T is 0 on them whatever Q's
# round-off there). Both are designed for the cutoff at its smallest relative to ||X||_F (s_max >= ||X||_F /
# sqrt(r)): the polar factor down to c, the sign for the modes at c / 2 and 2 c. Modes within that factor of 2
# of the cutoff come out partly lifted. Only fp32 and fp64 operands resolve it (GRAM_RESOLVES): bf16, fp16
# and tf32 ones lift as the threshold's design does (the clip computes in fp32 unless told otherwise).
CUTOFF_BAND = 2.0
# A design this deep amplifies each step's rounding in its middle steps (the cushion's polynomials are steeper
# than 1 at the top modes: up to 1e10 over fp64's 27 steps) and its last steps contract that quadratically,
# so it must end a contraction step later than THRESHOLD_TOLERANCE does: within this many units of the
# dtype's rounding of 1 (fp64: Q's error 5e-11 -> 3e-15 on resolved modes; fp32's design ends there already).
CUTOFF_TOLERANCE_UNITS = 8


@dataclass(frozen=True)
class ThresholdDesign:
    """How a band op resolves one threshold: ``absolute``: the sign iteration runs on ``|Xn| - t I``
    (else on ``Gn - t^2 I``); ``sign``/``polar``: the coefficients of the sign iteration and of the
    polar factor; ``cutoff``: for a lift, the sign coefficients of ``P_top`` at the zero cutoff that
    restricts the polar factor to the non-zero modes (:meth:`GramPlan.lifting_polar`), or None."""

    absolute: bool
    sign: tuple
    polar: tuple
    cutoff: tuple | None = None


def threshold_design(t: float | None, r: int, dtype: torch.dtype, precision: str, polar_coefficients=None,
                     sign_coefficients=None, holds_polar: bool = True, lift_size: int | None = None) -> ThresholdDesign:
    """The design for the smallest ``t = tau / ||X||_F`` of a stack of ``r``-side matrices (None: not
    known on the host, the capturable design), in the compute ``dtype`` with ``precision``'s operands.
    Given coefficients (a user's count, Newton-Schulz) are kept as they are, on the Gram; None ones are
    designed here. ``holds_polar``: the op forms the polar factor anyway (svt, the clip, even powers).

    ``msign`` normalises by the Frobenius norm, and a mode ``1%`` from ``t`` has a relative gap of
    ``0.0199 t^2 / ||Gn - t^2 I||_F`` on the Gram but ``0.01 t / || |Xn| - t I ||_F`` on ``|Xn|``, with
    ``||Gn - t^2 I||_F^2 = 1 - 2 t^2 + r t^4`` (``tr Gn = 1``) and ``|| |Xn| - t I ||_F^2 <= 1 - 2 t + r t^2``
    (``tr |Xn| >= 1``). The Gram is kept while its gap is within :data:`DEFAULT_LOWER` (the default steps
    resolve it: the construction before); an op without a polar factor of its own keeps it, with steps
    designed for its gap, while its rounding resolves that (:data:`GRAM_RESOLVES`), as the polar factor
    would cost it more than the extra steps. Otherwise ``|Xn|`` (one product from the polar factor,
    whose fewer sign steps pay for that product where the factor is formed anyway) with Polar Express
    designed for its gap. The polar factor must resolve the modes down to the threshold, ``0.99 t / 1.01`` after
    :func:`polar`'s margin. No gap is designed for below the compute dtype's epsilon, which no
    iteration in it resolves.

    ``lift_size``: the long side ``N`` of a form that lifts its bottom band (the clip's ``min=``, ``p = 0``
    below ``tau``): where nothing is given and the operands resolve it, the polar factor is designed down to
    the zero cutoff as well, and ``cutoff`` for its projector (:data:`CUTOFF_BAND`)."""
    if t is None:
        t = CAPTURABLE_DEPTH / math.sqrt(r)
    near, tolerance, floor = THRESHOLD_RESOLUTION, THRESHOLD_TOLERANCE[dtype], torch.finfo(dtype).eps

    def designed(lower, tolerance=tolerance):
        return polar_express_design(max(lower, floor), tolerance) if lower < DEFAULT_LOWER else \
            polar_express_coefficients(DEFAULT_STEPS)

    lifts = lift_size is not None and polar_coefficients is None and sign_coefficients is None \
        and precision in GRAM_RESOLVES
    cutoff = zero_mode_cutoff(lift_size, dtype) / math.sqrt(r) if lifts else math.inf
    cutoff_tolerance = min(tolerance, CUTOFF_TOLERANCE_UNITS * floor)
    if polar_coefficients is None:
        lower = (1 - near) * t
        polar_coefficients = designed(lower / NORMALIZATION_MARGIN) if lower < cutoff else \
            designed(cutoff / NORMALIZATION_MARGIN, cutoff_tolerance)
    if sign_coefficients is not None:
        return ThresholdDesign(False, sign_coefficients, polar_coefficients)
    cutoff_sign = designed(cutoff / CUTOFF_BAND, cutoff_tolerance) if lifts else None
    gram_gap = (1 - (1 - near) ** 2) * t * t / math.sqrt(max(1 - 2 * t * t + r * t**4, floor))
    if gram_gap >= DEFAULT_LOWER or (not holds_polar and gram_gap >= GRAM_RESOLVES.get(precision, math.inf)):
        return ThresholdDesign(False, designed(gram_gap), polar_coefficients, cutoff_sign)
    gap = near * t / math.sqrt(max(1 - 2 * t + r * t * t, floor))
    return ThresholdDesign(True, designed(gap), polar_coefficients, cutoff_sign)


def matrix_sign(kernels, A: torch.Tensor, coefficients, precision: str, symmetrized: bool = False) -> torch.Tensor:
    """``msign`` of a symmetric ``A`` (SPEC 1.4): normalise by ``||A||_F``, then one sign step per triple.

    ``A`` is in the compute dtype; the result is in the operand dtype of ``precision``. A fused chain
    normalises again, harmlessly: it gets the unit-norm ``A``, whose square cannot leave fp32's range.
    ``symmetrized``: each step's result is symmetrised (no fused chain): a sign step takes ``Z Z^T`` for
    ``Z^2``, so it iterates the polar factor, whose value on eigenvalues within a few hundred units of
    rounding of 0 (the zero cutoff's, :data:`CUTOFF_BAND`) turns with the products' asymmetric rounding.
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


def renormalized(M: torch.Tensor, log_scale: torch.Tensor):
    """``(M / 2^e, log_scale + e ln 2, ||M / 2^e||_F)`` with ``2^e`` the power of two nearest above
    ``||M||_F``: an exact rescaling, so a chain of products of ``Gn``'s squares (whose norms shrink
    geometrically, to zero in fp16 for ``Gn^4`` of a 4096-side Gram) keeps every mantissa it would have
    had in range. The norm (compute dtype, per matrix) comes with it: the guard's bounds read it."""
    norm = torch.linalg.vector_norm(M, dim=(-2, -1), keepdim=True, dtype=compute_dtype(M.dtype))
    exponent = torch.frexp(norm).exponent
    scale = torch.exp2(-exponent.to(norm.dtype))
    return M * scale.to(M.dtype), log_scale + exponent.double() * math.log(2), (norm * scale)[..., 0, 0]


def checked_finite(result: torch.Tensor, op: str) -> torch.Tensor:
    """``result``, or OverflowError when a value of it overflowed its dtype (one host sync)."""
    if not bool(torch.isfinite(result).all()):
        raise OverflowError(
            f"{op}: the result does not fit in {result.dtype} (a value of it exceeds "
            f"{torch.finfo(result.dtype).max:.3g}); compute in float64 or rescale W")
    return result


class GramPlan:
    """The intermediate results of one (batch of) matrix, each computed lazily and at most once:
    ``X``, ``ln c`` with ``c = ||X||_F`` (float64), ``Xn`` (compute dtype), the operand ``Xo`` (``Xn`` in
    the operand dtype, and the only one of the two held where they differ), the Gram ``Gn``, its
    renormalised squares, and the polar factor ``Q`` (operand dtype).

    ``c`` is held as a log: at the dtype's extremes it and its powers need not exist as numbers.
    Results scaled by ``c^p`` come as a *scaled* pair ``(D, ln f)`` with ``S = f D``, ``D`` of norm
    about 1; the caller applies ``f`` where it cannot overflow alone (:func:`~.linalg.scaled_`, or the
    decay's step).
    """

    def __init__(self, W: torch.Tensor, kernels, precision: str, restart_every: int = GRAM_SPACE_BLOCK,
                 overwrite_input: bool = False, polar_only: bool = False, capturable: bool = False,
                 threshold_ratio: float | None = None):
        """``overwrite_input``: ``W`` is the caller's temporary, normalised in place (``X`` is then
        ``Xn``, and the plan has no ``X`` of its own). ``polar_only``: the plan is asked for the polar
        factor and nothing else, so :meth:`polar` hands its operand to the iteration instead of holding
        it (and its Gram) through every step, as torch.optim.Muon's iteration holds neither.
        ``capturable``: no host reads, so a threshold takes the fixed design (:func:`threshold_design`);
        ``threshold_ratio``: ``tau / ||W||_F`` where the caller knows it (the cost model's meta tensors)."""
        self.kernels = kernels
        self.capturable = capturable
        self.known_threshold_ratio = threshold_ratio
        self.polar_only = polar_only
        self.restart_every = restart_every
        self.precision = precision
        self.transposed = is_tall(W)
        self.dtype = compute_dtype(W.dtype, precision)
        X = wide(W).to(self.dtype)
        self.shape = X.shape  # the wide orientation's
        Xn, self.log_scale = frobenius_normalized(X, in_place=overwrite_input)
        self.X = None if overwrite_input else X
        self.Xo = Xn.to(OPERAND_DTYPES[precision])
        # Xn itself is read only by svt: where the operands are of another dtype it is not held through
        # the iteration (a full-size math-dtype temporary), but formed again if asked for.
        self._normalized = Xn if self.Xo is Xn or overwrite_input else None
        # exponent -> (M, ln f, ||M||_F or None): see _gram_square and _square_norm.
        self._gram_squares: dict[int, tuple] = {}
        self._polar = None
        self._gram_polar = None
        self._absolute_value = None  # |Xn| from self._polar, for the sign iterations on it
        self._lifting_polar = None

    @property
    def Xn(self) -> torch.Tensor:
        """``X / c`` in the compute dtype (the same numbers as the ``Xn`` that ``Xo`` was rounded from)."""
        if self._normalized is None:
            self._normalized = frobenius_normalized(self.X)[0]
        return self._normalized

    def symmetric(self, L, R):
        return self.kernels.symmetric(L, R, self.precision)

    def product(self, M, Z, **epilogue):
        return self.kernels.product(M, Z, self.precision, **epilogue)

    @property
    def gram(self) -> torch.Tensor:
        return self._gram_square(1)[0]

    def identity(self) -> torch.Tensor:
        return torch.eye(self.shape[-2], dtype=self.dtype, device=self.log_scale.device)

    def _gram_square(self, exponent: int):
        """``Gn^exponent`` for a power of two, scaled: ``(M, ln f)`` with ``Gn^exponent = f M``."""
        if exponent not in self._gram_squares:
            if exponent == 1:
                # Its norm is formed only if the guard asks (the squares' come with their renormalisation).
                self._gram_squares[1] = (self.symmetric(self.Xo, self.Xo.mT), torch.zeros_like(self.log_scale), None)
            else:
                half, log_half = self._gram_square(exponent // 2)
                self._gram_squares[exponent] = renormalized(self.symmetric(half, half), 2 * log_half)
        return self._gram_squares[exponent][:2]

    def _square_norm(self, exponent: int) -> torch.Tensor:
        """``||M||_F`` of :meth:`_gram_square` ``(exponent)``, per matrix in the compute dtype, formed once."""
        M, log_factor, norm = self._gram_squares[exponent]
        if norm is None:
            norm = torch.linalg.vector_norm(M, dim=(-2, -1), dtype=compute_dtype(M.dtype))
            self._gram_squares[exponent] = (M, log_factor, norm)
        return norm

    def gram_power(self, k: int):
        """``Gn^k`` scaled, ``(M, ln f)``, by repeated squaring."""
        def multiply(left, right):
            return renormalized(self.symmetric(left[0], right[0]), left[1] + right[1])[:2]
        return repeated_squaring(k, self._gram_square, multiply)

    @property
    def log_norm_rounding(self) -> float:
        """``ln (1 + the relative rounding of ||X||_F)``: ``||X||_F`` times it bounds ``s_max`` from above."""
        return math.log1p(NORM_ROUNDING * torch.finfo(self.dtype).eps)

    def log_spectral_norm_bounds(self, squarings: int = GUARD_SQUARINGS, keep: int | None = None):
        """``(ln lower, ln upper)`` with ``lower <= s_max(X) <= upper`` per matrix (float64, the batch
        shape; ``-inf`` for a zero matrix), from the plan's own Gram and its first ``squarings``
        squares: the last of :meth:`spectral_norm_levels`."""
        for bounds in self.spectral_norm_levels(squarings, keep):
            pass
        return bounds

    def spectral_norm_levels(self, squarings: int = GUARD_SQUARINGS, keep: int | None = None):
        """The bounds of :meth:`log_spectral_norm_bounds` after ``||X||_F`` and each square of the Gram in
        turn (a generator: a caller that is settled early stops the squaring there).

        ``s_max^(2^(j+1)) <= ||Gn^(2^j)||_F <= sqrt(r) s_max^(2^(j+1))`` for the unit-norm ``Gn``, and the
        best level so far (with ``||X||_F`` itself) is taken; level ``j`` is within ``r^(1/2^(j+2))``
        (1.3x for ``r = 4096`` after 3 squarings). The squares are the plan's (shared with the
        direction's ``G^k``, in its precision); those above ``Gn^keep`` are dropped once squared
        (None: all kept). The rounding of every product is a relative widening of its level
        (:data:`ROUNDING`: the inner dimension times the accumulation's unit roundoff, plus the
        result's and a re-rounded operand's), and the operand's own rounding (``Xo``, the unit-norm
        ``X`` in the operand dtype: ``||Xo - Xn||_2 <= ||Xo - Xn||_F <= u``) an absolute one at unit
        norm. A bf16/fp16 plan's bound is therefore a little wider than an fp32 one's (about 0.4% +
        0.4% sqrt(stable rank) for bf16), never on the wrong side.
        """
        r, inner = self.shape[-2:]
        operand, product, accumulation = ROUNDING[self.precision]
        info = torch.finfo(OPERAND_DTYPES[self.precision])
        # The subnormals' absolute rounding (fp16's range is narrow), per entry at most half their spacing.
        subnormal = info.smallest_normal * info.eps / 2
        operand_error = operand + torch.finfo(self.dtype).eps / 2 + math.sqrt(r * inner) * subnormal
        norm_rounding = NORM_ROUNDING * torch.finfo(compute_dtype(OPERAND_DTYPES[self.precision])).eps
        log_scale = self.log_scale[..., 0, 0]
        # At unit norm: ||Xn||_F = 1 bounds s_max(Xn) from above, and 1 / sqrt(r) from below.
        frobenius = self.log_norm_rounding
        log_upper = torch.full_like(log_scale, frobenius)
        log_lower = torch.full_like(log_scale, -0.5 * math.log(r) - frobenius)
        yield log_scale + log_lower, log_scale + log_upper
        relative = 0.0
        try:
            for level in range(squarings + 1):
                _, log_factor = self._gram_square(2**level)
                norm = self._square_norm(2**level)
                if level >= 2 and keep is not None and 2 ** (level - 1) > keep:
                    del self._gram_squares[2 ** (level - 1)]  # squared: the direction does not read it
                norm = norm.double()
                relative = (1 + relative) ** 2 * (1 + (inner if level == 0 else r) * accumulation + product) - 1
                # Capped where a level says nothing (a zero matrix's): the next square would overflow it.
                relative = (relative + norm_rounding + r * subnormal / norm).clamp_max(RELATIVE_ROUNDING_CAP)
                exponent = 1.0 / 2 ** (level + 1)
                log_level = (log_factor[..., 0, 0] + norm.log()) * exponent
                widening = torch.log1p(relative) * exponent
                # A bound on s_max(Xo), the operand; Xn's singular values are within ||Xo - Xn||_2 of
                # Xo's (Weyl).
                level_upper = torch.log((log_level + widening).exp() + operand_error)
                level_lower = torch.log(((log_level - widening - exponent / 2 * math.log(r)).exp()
                                         - operand_error).clamp_min(0))
                log_upper, log_lower = torch.minimum(log_upper, level_upper), torch.maximum(log_lower, level_lower)
                yield log_scale + log_lower, log_scale + log_upper
        finally:
            if keep is not None:
                for exponent in [e for e in self._gram_squares if e > max(keep, 1)]:
                    del self._gram_squares[exponent]

    def polar(self, coefficients) -> torch.Tensor:
        """Polar Express ``Q = U V^T`` (wide), from ``X0 = Xn / 1.01``, sharing the Gram with step one."""
        if self._polar is not None:
            return self._polar
        if self.polar_only:
            # Popped into the call, not bound here: the iteration holds the only reference, and drops it
            # (and the Gram it forms) after the first step.
            self._polar = polar_iterations(self.kernels, self.__dict__.pop("Xo"), coefficients, self.precision,
                                           scale=1.0 / NORMALIZATION_MARGIN)
        else:
            self._polar = polar_iterations(self.kernels, self.Xo, coefficients, self.precision, self.gram,
                                           scale=1.0 / NORMALIZATION_MARGIN)
        return self._polar

    def gram_polar(self, coefficients):
        """The polar factor of ``X0 = Xn / 1.01`` as a pair ``(Z, Xj)`` with ``Q = Z Xj``, iterated on
        ``r x r`` Grams: each block of :func:`restart_blocks` (at most ``restart_every`` steps) runs
        :func:`coupled_inverse_root` on the Gram of ``Xj``, and the next block restarts from
        ``Xj <- Z Xj`` and its new Gram.

        A restart must recompute the Gram from the rectangle: ``Z G Z``, which carries the first Gram's
        rounding, is no better than no restart (docs/results/schedules.md, gram_space_no_restarts).
        """
        if self._gram_polar is None:
            shrink = 1.0 / NORMALIZATION_MARGIN
            X, G, identity, done = self.Xo * shrink, self.gram * shrink**2, self.identity(), 0
            for number, steps in enumerate(restart_blocks(len(coefficients), self.restart_every)):
                if number:
                    X = self.product(Z, X)
                    G = self.symmetric(X, X.mT)
                Z = coupled_inverse_root(self.kernels, G, coefficients[done:done + steps], self.precision,
                                         identity)
                done += steps
            self._gram_polar = (Z, X)
        return self._gram_polar

    def scaled_power(self, p, coefficients, iteration: str = "rectangle", eps=None):
        """``S_p`` (wide, compute dtype) scaled, ``(D, ln f)``: ``D = M Q`` for ``p = 2k`` and ``M Xn`` for
        ``2k + 1``, with ``Gn^k = g M`` and ``f = c^p g``; ``(X, 0)`` for ``p = 1``. With
        ``iteration="gram_space"`` the polar factor of an even ``p`` comes from :meth:`gram_polar` as
        ``Q = Z Xj``, and ``D = (M Z) Xj``: one product by the rectangle instead of two. A ``p`` that is
        not an int (a real power), or a floored one (``eps``), is :meth:`scaled_real_power`'s.

        ``p = 0``'s ``D``, the polar factor itself, stays in the operand dtype: its caller rounds it
        once, to where it goes (a Muon step adds the bf16 iterate to its weights as torch.optim.Muon
        does, without a full-size fp32 copy of it)."""
        if not isinstance(p, int) or eps is not None:
            return self.scaled_real_power(p, coefficients, iteration, eps)
        if p == 1:
            return self.X, torch.zeros_like(self.log_scale)
        if iteration == "gram_space" and p % 2 == 0:
            Z, X = self.gram_polar(coefficients)
            if p == 0:
                return self.product(Z, X), torch.zeros_like(self.log_scale)
            M, log_gram = self.gram_power(p // 2)
            return self.product(self.product(M, Z), X).to(self.dtype), p * self.log_scale + log_gram
        base = self.polar(coefficients) if p % 2 == 0 else self.Xo
        if p == 0:
            return base, torch.zeros_like(self.log_scale)
        M, log_gram = self.gram_power(p // 2)
        return self.product(M, base).to(self.dtype), p * self.log_scale + log_gram

    def scaled_real_power(self, p: float, coefficients, iteration: str = "rectangle", eps=None):
        """``S_p`` scaled, ``(D, ln f)``, for a real ``p >= 0`` that is not an integer, or any ``p`` floored:
        ``U diag((s^2 + (eps s_max)^2)^(p/2)) V^T`` (docs/real-powers.md).

        ``P = |Xn| = Xn Q^T = U diag(s) U^T`` (one product from the polar factor: its spectrum is ``s``,
        not the Gram's ``s^2``, whose rounding would cost the small modes twice the digits) is scaled
        into ``[0, 1]`` by ``b = 1.01 ||Gn||_F^(1/2)`` (``s_max <= b <= 1.01 r^(1/4) s_max``; with a floor or
        a :data:`RESOLUTION` shift, 1.01 times the Rayleigh estimate of ``s_max``). Its inverse root
        ``Z = A^(-1/8)`` (:func:`inverse_root`) has eigenvalues within ``1e-3^(-1/8) = 2.4`` of each other
        over the design interval, where ``A^f = Z^(-8 f)`` is a low-degree polynomial
        (:func:`matrix_power_of_root`). Then ``S_p = c^p b^f A^f S_k`` with ``k = floor(p)``, ``f = p - k``
        and ``S_k`` the integer power (``Q`` for ``k = 0``); a floored power is :meth:`_floored_power`'s.
        Modes below :data:`ROOT_LOWER` of ``b`` are outside the design
        (as Polar Express's below its bound): the polynomial takes them to about the bound's value."""
        precision, identity = self.precision, self.identity()
        operand = OPERAND_DTYPES[precision]
        Q = self.scaled_power(0, coefficients, iteration)[0].to(operand)
        P = self.absolute(Q)
        shift, tiny = RESOLUTION[precision], torch.finfo(self.dtype).tiny
        if eps is not None or shift:
            # A floor's scale, and a shift's: with the free bound below, a flat spectrum's modes would sit at
            # r^(-1/4) of the top, as close to the shift.
            b = (NORMALIZATION_MARGIN * self.spectral_norm_estimate()).clamp_min(tiny)
        else:
            self._gram_square(1)
            b = (self._square_norm(1)[..., None, None].sqrt() * NORMALIZATION_MARGIN).clamp_min(tiny)
        if eps is not None:
            return self._floored_power(p, P, Q, b, eps)
        whole, fraction = math.floor(p), p - math.floor(p)
        if whole == 0:
            base, log_base = Q, torch.zeros_like(self.log_scale)
        elif whole == 1:
            base, log_base = self.Xo, self.log_scale
        else:
            base, log_base = self.scaled_power(whole, coefficients, iteration)
        A = (P * b.reciprocal().to(operand) + shift * identity.to(operand)) * (1.0 / (1.0 + shift))
        log_factor = log_base + fraction * (self.log_scale + (b * (1.0 + shift)).double().log())
        Z, lo, hi = self._inverse_root(A, max(shift / (1.0 + shift), ROOT_LOWER))
        F = matrix_power_of_root(self.kernels, Z, -ROOT_ORDER * fraction, lo, hi, REAL_POWER_TOLERANCE[precision],
                                 precision, identity)
        return self.product(F, base.to(operand)).to(self.dtype), log_factor

    def _inverse_root(self, A, lower: float):
        """``(Z, lo, hi)``: ``Z = A^(-1/8)`` (:func:`inverse_root`) for ``A``'s eigenvalues in ``[lower, 1]``,
        and an interval that holds ``Z``'s eigenvalues, where a polynomial in ``Z`` is designed."""
        precision, n = self.precision, ROOT_ORDER
        tolerance = REAL_POWER_TOLERANCE[precision]
        root = inverse_root_coefficients(n, lower, tolerance / n)
        Z = inverse_root(self.kernels, A, n, root, precision, self.identity())
        # Z's eigenvalues: from 1 (A's top) to lower^(-1/n) at the design bound, and at most the product of
        # the steps' a (the lift of a mode below it, which the polynomial then takes to about the
        # bound's value, bounded, instead of extrapolating), widened for the residual and rounding.
        widening = design_widening(tolerance)
        largest = max(math.prod([a for a, _, _ in root]), lower ** (-1.0 / n))
        return Z, 1.0 / widening, largest * widening

    def _floored_power(self, p, P, Q, b, eps: float):
        """``U diag((s^2 + e^2)^(p/2)) V^T``, ``e = eps s_max``, scaled, from ``P = |Xn|`` and ``b``, a bound on
        ``s_max(Xn)``.

        With ``x = s / b`` and ``d = e / b``: ``(x^2 + d^2)^(p/2) = (x + d)^p (1 - w)^(p/2)``,
        ``w = 2 v (1 - v)``, ``v = d / (x + d)``. ``A = (P / b + d I) / (1 + d)`` has eigenvalues in
        ``[d / (1 + d), 1]``: the floor only narrows the design interval, where ``P^2 + e^2`` would square
        it (and its rounding, which then swamps a floor below ``sqrt(u)`` of the top). ``A^p`` comes from
        its inverse root ``Z``, ``V = d / (1 + d) Z^8 = d (P / b + d I)^(-1)`` (three squarings), and
        ``(1 - w)^(p/2)`` is a polynomial of degree ~9 in ``W = 2 (V - V^2)``
        (:func:`~spectral_ops.coefficients.floor_polynomial`); ``Q`` is 0 on a zero mode, which has no
        singular vectors: it stays 0. A floor below the precision's :data:`RESOLUTION` is raised to it, and
        one below the design bound (:data:`ROOT_LOWER` of ``b``) leaves the modes below the bound as the positive
        powers leave them: about the bound's value.

        Both factors are polynomials at the exponent ``p / 2^j`` (:func:`root_squarings` for the root's
        ``8 p``), and their product is squared ``j`` times: ``A^p`` and ``(1 - W)^(p/2)`` each span up to
        ``(d / (1 + d))^p`` and ``2^(|p|/2)``, beyond fp32 from ``|p| ~ 20`` and ``250``, where their product
        does not. The product's ``2^j``-th root is at most ``(d / (1 + d))^(p / 2^j)`` (at ``s = 0``) for
        ``p < 0`` and 1 otherwise: divided by that, its squares stay in range for every ``|p|`` up to
        :data:`~spectral_ops._checks.POWER_BOUND`, the division going into the scale."""
        precision, n = self.precision, ROOT_ORDER
        operand, identity = OPERAND_DTYPES[precision], self.identity().to(OPERAND_DTYPES[precision])
        # b is 1.01 of the estimate of s_max that sets the floor: d = e / b is the same for every matrix.
        d = max(eps / NORMALIZATION_MARGIN, RESOLUTION[precision])
        A = (P * b.reciprocal().to(operand) + d * identity) * (1.0 / (1.0 + d))
        Z, lo, hi = self._inverse_root(A, max(d / (1.0 + d), ROOT_LOWER))
        V = Z
        for _ in range(n.bit_length() - 1):
            V = self.symmetric(V, V)
        V = V * (d / (1.0 + d))
        W = 2 * (V - self.symmetric(V, V))
        largest = n * (TENSOR_POWER_BOUND if torch.is_tensor(p) else abs(p))
        squarings, tolerance = root_squarings(largest, REAL_POWER_TOLERANCE[precision])
        exponent, bound = p / 2**squarings, largest / 2**squarings
        F = function_polynomial(self.kernels, Z, "power", -n * exponent, lo, hi, tolerance, precision, identity, bound)
        G = function_polynomial(self.kernels, W, "floor", exponent / 2, 0.0, 0.5 * design_widening(tolerance),
                                tolerance, precision, identity, bound / (2 * n))
        log_peak = (p.clamp(max=0).double() if torch.is_tensor(p) else min(p, 0)) * math.log(d / (1.0 + d))
        root_peak = -log_peak / 2**squarings
        H = self.symmetric(F, G) * (root_peak.exp().to(operand) if torch.is_tensor(p) else math.exp(root_peak))
        for _ in range(squarings):
            H = self.symmetric(H, H)
        log_factor = p * (self.log_scale + (b * (1.0 + d)).double().log()) + log_peak
        return self.product(H, Q).to(self.dtype), log_factor

    def absolute(self, Q: torch.Tensor) -> torch.Tensor:
        """``|Xn| = Xn Q^T = U diag(s) U^T`` from the polar factor ``Q`` (operand dtype): one product."""
        return self.symmetric(self.Xo, Q.mT)

    def spectral_norm_estimate(self, sweeps: int = 8) -> torch.Tensor:
        """``s_max(Xn)`` per matrix (compute dtype, ``(..., 1, 1)``), from below: the Rayleigh quotient of
        ``Gn`` at ``v = Gn^(8 (sweeps + 1)) e_j``, from the column ``j`` of ``Gn^8`` (three squarings) of
        largest norm and ``sweeps`` matrix-vector products by it. ``v`` weighs mode ``i`` by
        ``(s_i / s_max)^(16 (sweeps + 1))``, so the quotient misses ``s_max^2`` by at most about
        ``1 / (16 e (sweeps + 1))`` of it (0.3% with 8 sweeps; the modes that weigh most are those that
        miss least). It sets a floor's scale (``eps s_max``)."""
        M, _ = self._gram_square(8)
        M = M.to(self.dtype)
        column = torch.linalg.vector_norm(M, dim=-2).argmax(-1)
        v = torch.take_along_dim(M, column[..., None, None], dim=-1)
        tiny = torch.finfo(self.dtype).tiny
        for _ in range(sweeps):
            v = M @ (v / torch.linalg.vector_norm(v, dim=-2, keepdim=True).clamp_min(tiny))
        quotient = (v * (self.gram.to(self.dtype) @ v)).sum((-2, -1), keepdim=True)
        return (quotient / (v * v).sum((-2, -1), keepdim=True).clamp_min(tiny)).sqrt()

    def power(self, p: int, coefficients) -> torch.Tensor:
        """``S_p`` (wide, compute dtype), non-finite only where it overflows the compute dtype."""
        if p in (0, 1):  # unscaled already
            return self.scaled_power(p, coefficients)[0].to(self.dtype)
        return scaled_(*self.scaled_power(p, coefficients))

    def threshold_ratio(self, tau) -> float | None:
        """The smallest ``tau / c`` of the stack on the host (one read), or None where the plan may not
        read (capturable, or traced by torch.compile) or cannot (a non-finite weight)."""
        if self.known_threshold_ratio is not None:
            return self.known_threshold_ratio
        if self.capturable or torch.compiler.is_compiling():
            return None
        t = float(ratio(tau, self.log_scale, math.sqrt(2.0), torch.float64).min())
        return t if math.isfinite(t) and t > 0 else None

    def design(self, tau, polar_coefficients, sign_coefficients, holds_polar: bool = True,
               lifts: bool = False) -> ThresholdDesign:
        """:func:`threshold_design` for ``tau`` on this stack; ``lifts``: the form lifts its bottom band."""
        return threshold_design(self.threshold_ratio(tau), self.shape[-2], self.dtype, self.precision,
                                polar_coefficients, sign_coefficients, holds_polar,
                                self.shape[-1] if lifts else None)

    def projector(self, tau, design: ThresholdDesign) -> torch.Tensor:
        """``P_top = (I + msign(Gn - (tau / c)^2 I)) / 2``, or ``(I + msign(|Xn| - (tau / c) I)) / 2`` as
        ``design`` says, on the small side (compute dtype).

        The eigenvalues of ``Gn`` and ``|Xn|`` are in [0, 1], so a shift above 2 gives ``P_top = 0`` as surely
        as the exact one (which can exceed the dtype: ``tau / c = 1e60`` for ``tau = 1e30``, ``c = 1e-30``)."""
        t = ratio(tau, self.log_scale, math.sqrt(2.0), self.dtype)
        if design.absolute:
            shifted = self.absolute_value(design) - t * self.identity()
        else:
            shifted = self.gram.to(self.dtype) - t * t * self.identity()
        return self._top(shifted, design.sign)

    def _top(self, shifted: torch.Tensor, sign_coefficients, symmetrized: bool = False) -> torch.Tensor:
        """``(I + msign(shifted)) / 2`` (compute dtype)."""
        J = matrix_sign(self.kernels, shifted, sign_coefficients, self.precision, symmetrized).to(self.dtype)
        return (J + self.identity()) * 0.5

    def absolute_value(self, design: ThresholdDesign) -> torch.Tensor:
        """``|Xn|`` (compute dtype) from the plan's polar factor (``design``'s where it is the first to ask),
        formed once for every sign iteration on it."""
        if self._absolute_value is None:
            self._absolute_value = self.absolute(self.polar(design.polar)).to(self.dtype)
        return self._absolute_value

    def lifting_polar(self, design: ThresholdDesign) -> torch.Tensor:
        """The polar factor a lift multiplies (operand dtype): ``Q``, and with ``design.cutoff``
        ``P_top(c) Q``, ``Q`` on the modes above the zero cutoff ``c = N eps s_max`` only
        (:data:`CUTOFF_BAND`; ``s_max`` from below by the guard's bound, within ``r^(1/32)`` of it: three
        squarings of the Gram, products the cost model counts)."""
        Q = self.polar(design.polar)
        if design.cutoff is None:
            return Q
        if self._lifting_polar is None:
            log_lower, _ = self.log_spectral_norm_bounds()
            # Of Xn: 0 for a zero matrix (whose log scale is -inf), which has no mode to lift.
            s_max = (log_lower - self.log_scale[..., 0, 0]).exp().nan_to_num(0.0)[..., None, None]
            c = zero_mode_cutoff(self.shape[-1], self.dtype) * s_max.to(self.dtype)
            # Xn Q^T is symmetric only up to Q's error, s_i times its round-off between a zero mode's left
            # vector and a non-zero one's right vector (1e-6 in fp32): as large as the cutoff's gap.
            P = self.absolute_value(design)
            nonzero = self._top((P + P.mT) * 0.5 - c * self.identity(), design.cutoff, symmetrized=True)
            self._lifting_polar = self.product(nonzero.to(Q.dtype), Q)
        return self._lifting_polar

    def top_projector(self, tau, polar_coefficients, sign_coefficients) -> torch.Tensor:
        """:meth:`projector` alone, with the design for ``tau`` (None coefficients: designed for it)."""
        return self.projector(tau, self.design(tau, polar_coefficients, sign_coefficients, holds_polar=False))

    def band(self, p: int, band: Band, polar_coefficients, sign_coefficients, top: Scale = 1.0) -> torch.Tensor:
        """A band-selective direction (SPEC 1.4) with one rectangular product by ``P_top``; ``"two_band"``
        weights its bands by ``top`` and ``band.spectral_weight_decay_bot``.

        ``P_bot = I - P_top`` and ``P_top`` commutes with every ``S_p``, so e.g.
        ``P_top S_p + P_bot X = X + P_top (S_p - X)``. ``S_p`` is formed unscaled, so a band form is
        finite only where ``S_p(W)`` itself fits the compute dtype.
        """
        # Odd integer powers are X G^k: only the clip and the other powers form the polar factor.
        powers = (p, band.p_bot) if band.mode == "two_band" else (p,)
        holds_polar = band.mode == "clip" or not all(isinstance(q, int) and q % 2 for q in powers)
        # p = 0 below tau lifts the bottom band: Q there, on every non-zero mode (CUTOFF_BAND).
        lifts = band.mode in ("bot", "bot_only", "two_band") and powers[-1] == 0
        design = self.design(band.tau, polar_coefficients, sign_coefficients, holds_polar, lifts)
        polar_coefficients = design.polar
        P_top = self.projector(band.tau, design)
        S_top = self._band_power(p, design)
        product, X = self._final_product, self.X
        if band.mode == "top":
            return product(P_top, S_top - X, Y=X)
        if band.mode == "bot":
            return product(P_top, X - S_top, Y=S_top)
        if band.mode == "top_only":
            return product(P_top, S_top)
        if band.mode == "bot_only":
            return product(P_top, S_top, alpha=-1.0, Y=S_top)
        if band.mode == "clip":  # S_top is X (p = 1): the soft-threshold at tau, unscaled
            tau = as_float64(band.tau, X.device).to(self.dtype)
            return product(P_top, X - tau * self.polar(polar_coefficients).to(self.dtype))
        S_bot = self._band_power(band.p_bot, design) * band.spectral_weight_decay_bot
        return product(P_top, S_top * top - S_bot, Y=S_bot)

    def _band_power(self, p: int, design: ThresholdDesign) -> torch.Tensor:
        """:meth:`power` with ``design``'s polar factor, and ``p = 0``'s from :meth:`lifting_polar`."""
        return self.lifting_polar(design).to(self.dtype) if p == 0 else self.power(p, design.polar)

    def scaled_svt(self, t, polar_coefficients, sign_coefficients):
        """``prox_{t ||.||_*}(W) = c P_top(t) (Xn - (t / c) Q)`` (SPEC 1.4), scaled: ``(D, ln c)``.

        Every singular value is at most ``c``, so a ``t / c`` above 1 gives zero as surely as the exact
        one, and is capped there (it can exceed the dtype)."""
        design = self.design(t, polar_coefficients, sign_coefficients)
        P_top = self.projector(t, design)
        shift = ratio(t, self.log_scale, 1.0, self.dtype)
        return self._final_product(P_top, self.Xn - shift * self.polar(design.polar).to(self.dtype)), \
            self.log_scale

    def scaled_clip(self, low, high, polar_coefficients, sign_coefficients):
        """``U diag(clamp(s, low, high)) V^T``, scaled: ``(D, ln c)``; a bound that is None is not applied.

        ``X - P_top(high) (X - high Q)`` caps the modes above ``high`` (the soft-threshold at ``high``
        taken off), and ``+ P_bot(low) (low Q - X)`` lifts those below ``low``: two rectangular products
        by the projectors, which commute with ``Q`` and ``X``'s spectrum. A mode with ``s = 0`` has no
        singular vectors (``Q`` is 0 there) and stays 0. ``high / c`` above 1 caps nothing, as surely as
        the exact one; ``low / c`` is not capped (a floor above ``s_max`` lifts every mode to it). The
        polar factor is designed for the lower bound, a lift: down to the zero cutoff, and only on the
        modes above it (:meth:`lifting_polar`)."""
        high_design = None if high is None else self.design(high, polar_coefficients, sign_coefficients)
        low_design = None if low is None else self.design(low, polar_coefficients, sign_coefficients, lifts=True)
        Q = self.lifting_polar(low_design or high_design).to(self.dtype)
        clipped = self.Xn
        if high is not None:
            shift = ratio(high, self.log_scale, 1.0, self.dtype)
            clipped = self._final_product(self.projector(high, high_design), clipped - shift * Q,
                                          alpha=-1.0, Y=clipped)
        if low is not None:
            below = ratio(low, self.log_scale, math.inf, self.dtype) * Q - self.Xn
            clipped = self._final_product(self.projector(low, low_design), below, alpha=-1.0,
                                          Y=clipped + below)
        return clipped, self.log_scale

    def _final_product(self, M, Z, **epilogue):
        """The one rectangular product of a band form, on unscaled weights: in the compute dtype, whose
        range the scale ``c^p`` needs, at fp32 accuracy (fp64 for fp64)."""
        exact = "fp64" if self.dtype == torch.float64 else "fp32"
        return self.kernels.product(M, Z, exact, **epilogue)

    def scaled_direction(self, p, polar_coefficients, iteration: str, eps=None):
        """``S_p`` scaled, ``(D, ln f)``, as :func:`route` says: a backend's fused chain first where it may
        run, else the plan's iteration."""
        chosen = route(self.shape, self.dtype, self.log_scale.device.type, p, self.precision, method="gram",
                       iteration=iteration, steps=len(polar_coefficients), floored=eps is not None)
        if chosen.chain:
            chained = chained_power(self.kernels, self, p, polar_coefficients)
            if chained is not None:
                return chained
        return self.scaled_power(p, polar_coefficients, chosen.iteration, eps)

    def oriented(self, S: torch.Tensor) -> torch.Tensor:
        return S.mT if self.transposed else S

    def result(self, D: torch.Tensor, log_factor: torch.Tensor) -> torch.Tensor:
        """An op's result ``f D`` from its scaled pair ``(D, ln f)`` (:func:`~.linalg.scaled_`), oriented as
        the input: 0 for a zero matrix, as every spectral form of it is, where its ``ln c = -inf`` would
        make ``0 * inf`` (``c^p`` for ``p < 0``, a floor's ``tau / c``)."""
        return self.oriented(torch.where(self.log_scale == -math.inf, 0.0, scaled_(D, log_factor)))


class FactorisedPlan(GramPlan):
    """The same forms from a factorisation (:func:`route`'s ``"svd"`` and ``"eigh"``) instead of
    iterations: each is its definition (SPEC 1.1-1.4), a function of the singular values applied mode by
    mode (:class:`~spectral_ops.linalg.SpectralFactors`), exact up to the factorisation's rounding at
    every threshold. The coefficient arguments are not read. The factorisations report their errors to
    the host: a GPU's capturable step never takes this plan (a CPU's may: it has no graph to break).
    The guard's bound on ``s_max`` is ``||X||_F`` (free) and then the factorisation's own ``s_max``
    (:meth:`spectral_norm_levels`): no Gram squarings.
    """

    def __init__(self, W: torch.Tensor, kernels, method: str, precision: str | None = None):
        """Factorised in the compute dtype (:func:`~.linalg.compute_dtype`: float64 for ``"fp64"``)."""
        super().__init__(W, kernels, "fp64" if compute_dtype(W.dtype, precision) == torch.float64 else "fp32")
        self.method = method
        self._factors = None

    @property
    def factors(self) -> SpectralFactors:
        if self._factors is None:
            # A NaN or Inf weight (an optimizer's step skips it once its new value is checked) would make
            # LAPACK raise for the whole stack: that matrix is factorised as zeros instead (without a
            # host read, which a compiled step would break its graph at).
            unusable = torch.isnan(self.log_scale) | (self.log_scale == math.inf)
            self._factors = SpectralFactors(torch.where(unusable, 0.0, self.Xn), self.method)
        return self._factors

    def spectral_norm_levels(self, squarings: int = GUARD_SQUARINGS, keep: int | None = None):
        """``||X||_F`` (free), then ``s_max`` from the factorisation, widened by its rounding (a relative
        ``r`` units of the compute dtype, far above LAPACK's): the guard settles most steps at the
        first level, and the factorisation it may need is the direction's own."""
        levels = super().spectral_norm_levels(0)
        yield next(levels)
        levels.close()
        log_s_max = self.log_scale[..., 0, 0] + self.factors.s.amax(-1).double().log()
        widening = math.log1p(self.shape[-2] * torch.finfo(self.dtype).eps)
        yield log_s_max - widening, log_s_max + widening

    def _mode_powers(self, q: int) -> torch.Tensor:
        """The unscaled ``s^q`` of each mode (float64, ``(..., r)``; ``q = 0``: 1 on the non-zero modes)."""
        s = self.factors.s
        if q == 0:
            return power_weights(s, 0, self.shape[-1]).double()
        return torch.exp(q * (s.double().log() + self.log_scale[..., 0]))

    def _above(self, tau) -> torch.Tensor:
        """Each mode's share of ``P_top``: 1 above ``tau``, 0 below, 1/2 at it (``(1 + sign) / 2``, as the
        iteration's ``msign(G - tau^2 I)`` is), float64."""
        threshold = ratio(tau, self.log_scale, math.sqrt(2.0), torch.float64)[..., 0]
        return (torch.sign(self.factors.s.double() - threshold) + 1) / 2

    def scaled_power(self, p, coefficients=(), iteration: str = "rectangle", eps=None):
        """Each mode's weight relative to the largest (:func:`~.linalg.relative_powers`; floored:
        ``(x^2 + eps^2)^(p/2)`` of ``x = s / s_max`` over its largest, at ``x = 1`` for ``p > 0`` and ``x = 0``
        for ``p < 0``, from its log), and ``s_max^p`` (with that largest) in the scale."""
        if eps is None and p == 1:
            return super().scaled_power(p, coefficients)
        s, size = self.factors.s, self.shape[-1]
        weights, log_top = relative_powers(s, p, size)
        log_factor = p * (self.log_scale + log_top[..., None]) if p else torch.zeros_like(self.log_scale)
        if eps is None:
            return self.factors.modes(weights), log_factor
        x = relative_powers(s, 1, size)[0]
        log_peak = max(p / 2 * math.log1p(eps * eps), p * math.log(eps))
        log_floored = torch.logaddexp(2 * x.log(), torch.full_like(x, 2 * math.log(eps))) * (p / 2)
        # The modes that are not zero, at the factorisation's own round-off (its dtype's).
        return self.factors.modes(power_weights(s, 0, size) * (log_floored - log_peak).exp()), log_factor + log_peak

    def scaled_direction(self, p, polar_coefficients, iteration: str, eps=None):
        return self.scaled_power(p, eps=eps)

    def top_projector(self, tau, polar_coefficients, sign_coefficients) -> torch.Tensor:
        return self.factors.projector(self._above(tau))

    def band(self, p: int, band: Band, polar_coefficients, sign_coefficients, top: Scale = 1.0) -> torch.Tensor:
        above = self._above(band.tau)
        below = 1 - above
        if band.mode == "top":
            weights = above * self._mode_powers(p) + below * self._mode_powers(1)
        elif band.mode == "bot":
            weights = above * self._mode_powers(1) + below * self._mode_powers(p)
        elif band.mode == "top_only":
            weights = above * self._mode_powers(p)
        elif band.mode == "bot_only":
            weights = below * self._mode_powers(p)
        elif band.mode == "clip":
            weights = above * (self._mode_powers(1) - per_mode(band.tau, self.log_scale))
        else:
            weights = (above * per_mode(top, self.log_scale) * self._mode_powers(p)
                       + below * per_mode(band.spectral_weight_decay_bot, self.log_scale)
                       * self._mode_powers(band.p_bot))
        return self.factors.modes(weights)

    def scaled_svt(self, t, polar_coefficients, sign_coefficients):
        shift = ratio(t, self.log_scale, 1.0, torch.float64)[..., 0]
        return self.factors.modes((self.factors.s.double() - shift).clamp_min(0)), self.log_scale

    def scaled_clip(self, low, high, polar_coefficients, sign_coefficients):
        s = self.factors.s.double()
        clipped = s
        if high is not None:
            clipped = torch.minimum(clipped, ratio(high, self.log_scale, 1.0, torch.float64)[..., 0])
        if low is not None:
            floor = ratio(low, self.log_scale, math.inf, torch.float64)[..., 0]
            # Modes with s = 0 have no singular vectors to lift, as the iterations' Q is 0 there. Which are
            # zero is decided on the factorisation's own values (float32 for a float32 SVD): its round-off
            # modes are at a few float32 eps of s_max, far above float64's cutoff.
            nonzero = power_weights(self.factors.s, 0, self.shape[-1]) > 0
            clipped = torch.where(nonzero, torch.maximum(clipped, floor), clipped)
        return self.factors.modes(clipped), self.log_scale


def per_mode(value: Scale, like: torch.Tensor) -> torch.Tensor:
    """A coefficient (a number, a 0-d tensor or one per matrix, ``(..., 1, 1)``) as float64 that
    broadcasts over a batch's modes, ``(..., 1)``."""
    value = as_float64(value, like.device)
    return value[..., 0] if value.dim() >= 2 else value


def plan_for(W: torch.Tensor, kernels, precision: str | None, method: str, capturable: bool = False,
             threshold_ratio: float | None = None) -> GramPlan:
    """The plan of a routed ``method``: the iterations (``"gram"``) or a factorisation; ``capturable``
    and ``threshold_ratio`` as in :class:`GramPlan`."""
    if method in FACTORISATIONS:
        return FactorisedPlan(W, kernels, method, precision)
    return GramPlan(W, kernels, resolve_precision(precision, W.dtype), capturable=capturable,
                    threshold_ratio=threshold_ratio)


# ----- the ops: (validated) inputs in, a new tensor of the input's dtype out; precision None resolves here


def chained_power(kernels, plan: GramPlan, p: int, polar_coefficients):
    """``S_p`` scaled, ``(D, ln c^p)``, by a backend's fused chain where one runs it, else None.

    The chain gets the unit-norm operand ``Xo``, not the weight: it forms the raw Gram and
    ``||X||^p`` in fp32, which leave the range at ``||W||_F ~ 1e19`` (or ``1e-19``), and for large
    ``p`` even at unit norm (:func:`route` leaves those out).
    """
    chained = kernels.small_chain(plan.Xo, p, polar_coefficients, plan.precision)
    if chained is None:
        return None
    return chained.to(plan.dtype), p * plan.log_scale


def spectral_power(kernels, W: torch.Tensor, p, polar_coefficients, precision: str | None = None,
                   sync: bool = True, iteration: str = "auto", method: str = "gram", eps=None):
    """``sync``: check the result for overflow (OverflowError); the capturable path passes False and
    gets Inf where the result exceeds the dtype. ``iteration``: one of :data:`ITERATIONS`; ``method``:
    :func:`route`'s (``"auto"`` routes here). ``p``: an int or a real ``p > 0``, or any ``p`` with a floor
    ``eps`` (:meth:`GramPlan.scaled_real_power`; ``p = 0`` is the polar factor, floored or not)."""
    if eps is None and p == 1:
        return W.clone()  # S_1(W) = W, and the result must never alias the input
    method = routed(kernels, W, p, precision, method, iteration=iteration, floored=eps is not None)
    if method == "gram" and not torch.is_tensor(p) and p == 0:
        return polar_factor(kernels, W, polar_coefficients, precision, iteration)
    plan = plan_for(W, kernels, precision, method)
    result = plan.result(*plan.scaled_direction(p, polar_coefficients, iteration, eps)).to(W.dtype)
    result = beyond_tensor_power_nan(result, p)
    return checked_finite(result, "spectral_power") if sync else result


def beyond_tensor_power_nan(result: torch.Tensor, p) -> torch.Tensor:
    """``result``, NaN where ``p`` is held in a tensor beyond :data:`TENSOR_POWER_BOUND` (its design)."""
    return torch.where(p.abs() <= TENSOR_POWER_BOUND, result, torch.nan) if torch.is_tensor(p) else result


def polar_factor(kernels, W: torch.Tensor, polar_coefficients, precision: str | None = None,
                 iteration: str = "auto", dtype: torch.dtype | None = None, overwrite_input: bool = False):
    """``S_0(W)`` by the iteration, in ``dtype`` (``W``'s by default); ``overwrite_input``: see :class:`GramPlan`."""
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype), overwrite_input=overwrite_input,
                    polar_only=True)
    direction, _ = plan.scaled_direction(0, polar_coefficients, iteration)
    return plan.oriented(direction).to(dtype or W.dtype)


def polar(kernels, W: torch.Tensor, polar_coefficients, precision: str | None = None,
          dtype: torch.dtype | None = None, overwrite_input: bool = False) -> torch.Tensor:
    """Always on the rectangle: this is Muon's orthogonalisation, which must be the iteration
    torch.optim.Muon runs (``spectral_power(W, 0)`` follows ``iteration`` instead)."""
    return polar_factor(kernels, W, polar_coefficients, precision, "rectangle", dtype, overwrite_input)


# A Muon-family update's default floor (relative to s_max): in bf16, below the iterate's resolution anyway
# (RESOLUTION); a negative power lifts the small modes, mostly the momentum's noise, to at most 100^|q|
# times the top's weight.
UPDATE_FLOOR = 1e-2
# How a Muon-family update is scaled: "polar", to the polar factor's Frobenius norm per matrix (a learning
# rate means what it means for Muon); "raw", not at all: U diag((s^2 + (eps s_max)^2)^(q/2)) V^T as it is,
# DynMuon's update (its norm follows ||X||^q).
UPDATE_SCALES = ("polar", "raw")


def power_update(kernels, X: torch.Tensor, power, polar_coefficients, precision: str | None, eps: float,
                 dtype: torch.dtype | None = None, overwrite_input: bool = False, scale: str = "polar") -> torch.Tensor:
    """A Muon-family update with update power ``power`` (capturable): for a number 0, ``X``'s polar
    factor on the rectangle, as torch.optim.Muon iterates it (a square ``X`` as laid out: :func:`polar`
    counts it as tall and would iterate on its transpose, a strided view whose result comes out
    strided); else ``U diag((s^2 + (eps s_max)^2)^(power/2)) V^T`` (:meth:`GramPlan.scaled_real_power`),
    scaled as ``scale`` says (:data:`UPDATE_SCALES`): by default renormalised to the polar factor's
    Frobenius norm ``sqrt(min(m, n))`` per matrix, so that a learning rate means what it means for Muon
    (0 for a zero ``X``); ``"raw"``: as it is (Inf where that overflows: nothing is read back).

    The renormalisation takes the direction at unit scale as it is: the scale ``c^power`` cancels in it,
    and applied first it can leave the range (``||.||_F`` of a power 1 of a 1e-30 ``X`` underflows fp32)."""
    if not torch.is_tensor(power) and power == 0:
        if X.shape[-2] != X.shape[-1]:
            return polar(kernels, X, polar_coefficients, precision, dtype, overwrite_input)
        return polar(kernels, X.mT, polar_coefficients, precision, dtype, overwrite_input).mT
    plan = GramPlan(X, kernels, resolve_precision(precision, X.dtype))
    D, log_factor = plan.scaled_direction(power, polar_coefficients, "auto", eps)
    if scale == "raw":
        result = plan.result(D, log_factor)
    else:
        norm = torch.linalg.vector_norm(D, dim=(-2, -1), keepdim=True, dtype=compute_dtype(D.dtype))
        # A zero X's direction is 0 (its norm too): 0, not 0/0. A non-finite one stays non-finite.
        factor = torch.where(norm == 0, 0.0, math.sqrt(min(X.shape[-2:])) / norm)
        result = plan.oriented(D.mul_(factor.to(D.dtype)))  # D is the plan's own: scaled in place
    return beyond_tensor_power_nan(result.to(dtype or X.dtype), power)


def msign(kernels, A: torch.Tensor, sign_coefficients, precision: str | None = None) -> torch.Tensor:
    precision = resolve_precision(precision, A.dtype)
    return matrix_sign(kernels, A.to(compute_dtype(A.dtype, precision)), sign_coefficients, precision).to(A.dtype)


# The band ops: None coefficients are designed for the threshold (threshold_design); ``sync=False`` (the
# capturable path) neither checks the result nor reads the threshold's ratio on the host;
# ``threshold_ratio``: a known tau / ||W||_F (the cost model's).

def band_projectors(kernels, W: torch.Tensor, tau, sign_coefficients, precision: str | None = None,
                    method: str = "gram", sync: bool = True, threshold_ratio: float | None = None):
    method = routed(kernels, W, 1, precision, method, band=True)
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    P_top = plan.top_projector(tau, None, sign_coefficients)
    return P_top.to(W.dtype), (plan.identity() - P_top).to(W.dtype)


def band_direction(kernels, W: torch.Tensor, p: int, band: Band, polar_coefficients, sign_coefficients,
                   precision: str | None = None, sync: bool = True, top: Scale = 1.0, method: str = "gram",
                   threshold_ratio: float | None = None):
    method = routed(kernels, W, p, precision, method, band=True)
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    result = plan.oriented(plan.band(p, band, polar_coefficients, sign_coefficients, top)).to(W.dtype)
    return checked_finite(result, "band_direction") if sync else result


def svt(kernels, W: torch.Tensor, t, polar_coefficients, sign_coefficients, precision: str | None = None,
        sync: bool = True, method: str = "gram", threshold_ratio: float | None = None):
    method = routed(kernels, W, 0, precision, method, band=True)
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    result = plan.result(*plan.scaled_svt(t, polar_coefficients, sign_coefficients)).to(W.dtype)
    return checked_finite(result, "svt") if sync else result


def spectral_clip(kernels, W: torch.Tensor, low, high, polar_coefficients, sign_coefficients,
                  precision: str | None = None, sync: bool = True, method: str = "gram",
                  threshold_ratio: float | None = None):
    """``U diag(clamp(s, low, high)) V^T`` (``low``/``high`` None: that side unbounded); precision None:
    :func:`clip_precision`."""
    precision = clip_precision(precision, W.dtype)
    method = routed(kernels, W, 0, precision, method, band=True)
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    clipped = plan.scaled_clip(low, high, polar_coefficients, sign_coefficients)
    result = plan.result(*clipped).to(W.dtype)
    return checked_finite(result, "spectral_clip") if sync else result


# Beyond this many squarings every level of the bound is s_max to float64's rounding (level j is within
# r^(1/2^(j+2)) and its rounding's widening, at most 1e10, within 1e10^(1/2^(j+1))): more would repeat it.
USEFUL_SQUARINGS = 64


def spectral_norm_bounds(kernels, W: torch.Tensor, squarings: int):
    """``(lower, upper)`` on ``s_max`` per matrix, in the compute dtype (products at its accuracy), from at
    most :data:`USEFUL_SQUARINGS` squarings."""
    dtype = compute_dtype(W.dtype)
    plan = GramPlan(W, kernels, "fp64" if dtype == torch.float64 else "fp32")
    log_lower, log_upper = plan.log_spectral_norm_bounds(min(squarings, USEFUL_SQUARINGS))
    return log_lower.exp().clamp(max=torch.finfo(dtype).max).to(dtype), log_upper.exp().to(dtype)


# ----- the choices of algorithm, made here and nowhere else: route() and the cost it weighs

# The CPU's fastest accurate method for S_p, from the crossovers measured with
# bench/test_bench_ops.py::test_method_selection (docs/backends.md, "Choosing a method on a CPU"):
# for p >= 2 the Gram's eigendecomposition won at every measured shape. For p = 0 (where eigh is
# inaccurate) Polar Express beat LAPACK's SVD by up to 1.55x at some sides, but only on spectra inside
# its design bound (1e-3 of ||W||_F): at kappa 1e3 it erred 1.3e-3 (128 x 128) to 3e-2 (512 x 512)
# against the SVD's 1e-5 in fp32, so the SVD is taken at every side.
# The routes that factorise (spectral_ops.linalg.SpectralFactors) instead of iterating.
FACTORISATIONS = ("svd", "eigh")
METHODS = ("auto", "gram") + FACTORISATIONS


@dataclass(frozen=True)
class Route:
    """How one op runs: ``method`` (``"gram"``: this plan; ``"svd"``/``"eigh"``: a factorisation,
    :mod:`spectral_ops.linalg`), ``iteration`` (an even power's, :data:`ITERATIONS` but ``"auto"``)
    and ``chain`` (whether a backend's fused chain may run the whole direction; dispatch says whether
    one is there)."""

    method: str
    iteration: str
    chain: bool


def route(shape, dtype: torch.dtype, device_type: str, p: int, precision: str, *, method: str = "auto",
          iteration: str = "auto", steps: int = 8, band: bool = False, provider: str = "torch",
          floored: bool = False) -> Route:
    """Every choice of algorithm, from the shape, dtype, device, power and precision (dispatch
    chooses providers, this chooses what they compute).

    * ``method="auto"``: the Gram route on a GPU (the factorisations report to the host, which a
      capturable step may not read: on a CPU, which has no graphs to capture, a capturable or
      compiled step factorises as an eager one does, without a graph break), for
      ``iteration="gram_space"``, and where the products would run on a ``provider`` other than
      torch's (a forced backend: the measurements weighed LAPACK against torch's composed products,
      and forcing a backend asks for its kernels). On a CPU the faster accurate one of the
      measurements (docs/backends.md): for ``S_p``, the Gram route for ``p = 1``, ``eigh`` for
      ``p > 1``, and the SVD for ``p = 0`` (Polar Express, up to 1.55x faster at some sides, resolves
      only the modes above its design bound), for a real ``p < 1`` and for a ``floored`` power (with
      ``eps``: its small modes' weights do not vanish with ``s``, which ``eigh`` would amplify). A ``band`` form
      (the band ops, soft-thresholding, a band or prox decay) splits the modes at a threshold: the SVD,
      which resolves one anywhere above its rounding (``eps s_max``), where the Gram route's sign
      iteration and ``eigh`` both see ``s^2`` (a threshold ``tau`` loses modes once ``tau^2 / s_max^2``
      nears their resolution: the design bound 1e-3, or eigh's rounding over the gap). It was also
      1.1-2.2x faster than the Gram route for ``band_direction`` and ``svt`` at every measured shape,
      and up to 2.2x slower for ``band_projectors`` (no polar factor on the Gram route): accuracy first.
    * A ``floored`` power, a negative one or a power in a tensor is a real power (the Gram route's
      :meth:`GramPlan.scaled_real_power`): its iteration is its polar factor's, never ``G^k``'s.
    * ``iteration="auto"``: Gram space for an even ``p`` at a precision where it is as accurate as the
      rectangle (:data:`GRAM_SPACE_PRECISIONS`) and where :func:`cost` says it saves at least
      :data:`GRAM_SPACE_SAVING` of the op's FLOPs (an aspect ratio of about 3.5 or more; on a square
      matrix it costs more); the rectangle otherwise.
    * ``chain``: a fused chain runs the rectangle's steps in one kernel per matrix, where launches,
      not FLOPs, bound the time, so it is taken first under ``"auto"`` and ``"rectangle"``; not where
      ``Gn^k`` could leave fp32's normal range (:data:`CHAIN_POWER_RANGE_BITS`: the chain does not
      renormalise it).
    """
    *_, m, n = shape
    r, side = min(m, n), max(m, n)
    # The integer route (G^k by repeated squaring) takes a number p >= 0 without a floor; every other
    # power, a negative one included, is a real one.
    integer = isinstance(p, int) and p >= 0 and not floored
    if method == "auto":
        if iteration == "gram_space" or device_type != "cpu" or provider != "torch":
            method = "gram"
        elif band or floored or torch.is_tensor(p):  # a power on the device is floored, of either sign
            method = "svd"
        elif p == 1:
            method = "gram"
        elif p > 1:
            method = "eigh"
        else:  # p = 0 and the real powers below 1: the SVD resolves every mode
            method = "svd"
    chain = iteration != "gram_space" and integer and p // 2 * math.log2(max(r, 2)) <= CHAIN_POWER_RANGE_BITS
    if iteration == "auto":
        iteration = "rectangle"
        # An even power and a real one (p = 0's polar factor is its base) iterate a polar factor.
        if (not integer or p % 2 == 0) and precision in GRAM_SPACE_PRECISIONS:
            # A real power's iteration is its polar factor's: the rest costs the same either way.
            p_iterated = p if integer else 0
            flops = {it: cost("spectral_power", (r, side), p=p_iterated, iteration=it, steps=steps,
                              symmetric_at_half=True)
                     for it in ("gram_space", "rectangle")}
            if flops["gram_space"] <= (1 - GRAM_SPACE_SAVING) * flops["rectangle"]:
                iteration = "gram_space"
    return Route(method, iteration, chain)


# Gn^k at unit norm stays above 2^-CHAIN_POWER_RANGE_BITS, well inside fp32's normal range (2^-126).
CHAIN_POWER_RANGE_BITS = 100


def routed(kernels, W: torch.Tensor, p: int, precision: str | None, method: str, *, iteration: str = "auto",
           band: bool = False, floored: bool = False) -> str:
    """:func:`route`'s method for a call on ``W`` with ``kernels``."""
    precision = resolve_precision(precision, W.dtype)
    # Asked only where it can decide: it routes (and may self-check) a provider.
    asks = method == "auto" and W.device.type == "cpu"
    provider = kernels.provider_of("product", OPERAND_DTYPES[precision], W.shape, precision) if asks else "torch"
    return route(W.shape, W.dtype, W.device.type, p, precision, method=method, iteration=iteration, band=band,
                 provider=provider, floored=floored).method


@constant_when_traced  # read off the plan on meta tensors, not traced (nor its cache, which Dynamo would skip)
def cost(op: str, shape: tuple, **options) -> float:
    """The matrix FLOPs of one call of ``op`` (one of :data:`OPS`) on a float32 tensor of ``shape``
    (a batch counts each matrix): :func:`work`'s FLOPs, with the same options."""
    return work(op, shape, **options).flops


@constant_when_traced
def work(op: str, shape: tuple, *, p=0, precision: str = "fp32", iteration: str = "rectangle",
         steps: int | None = 8, sign_steps: int | None = 8, band_mode: str | None = None, p_bot: int = 1,
         guard: bool = False, symmetric_at_half: bool = False, eps: float | None = None,
         threshold: float | None = None, dtype: torch.dtype = torch.float32):
    """The :class:`~spectral_ops.backends.counting.Work` of one call of ``op`` (one of :data:`OPS`) on a
    ``dtype`` tensor of ``shape`` (a batch counts each matrix): its matrix FLOPs, its primitives' bytes
    and launches, read off the plan: it runs on meta tensors with
    :class:`~spectral_ops.backends.counting.CountingKernels`, which counts each primitive.

    At full cost this is what ``FlopCounterMode`` counts of the torch backend; ``symmetric_at_half``
    gives the GPU kernels' count, each symmetric product (the Gram, ``A A``, the sign steps) at half.
    ``p``, ``iteration`` (``"auto"`` routes as a call would), ``steps``, ``sign_steps``, ``band_mode``
    and ``p_bot`` configure the op (``eps``: a floor, see :func:`spectral_power`); ``guard``: a decay's
    stability bound is formed (a capturable step's clamp, every step; an eager one forms it only where
    ``||W||_F`` does not settle the guard). The fused chains are not counted: their products are the
    composed plan's.

    A band op's ``steps``/``sign_steps`` None are designed for its thresholds (:func:`threshold_design`),
    as a call without them is: at ``threshold`` (each threshold's ``tau / ||W||_F``), or where that is
    None at the capturable design, which cannot read it.
    """
    if threshold is not None and not (isinstance(threshold, (int, float)) and threshold > 0):
        raise ValueError(f"threshold is tau / ||W||_F, a number > 0 (or None), got {threshold!r}")
    # A power_update without eps takes its default floor, as the op does.
    p = check_power(p, eps=UPDATE_FLOOR if op == "power_update" and eps is None else eps, decay=op == "decay_")
    return _counted(op, tuple(shape), p, precision, iteration, steps, sign_steps, band_mode, p_bot, guard,
                    symmetric_at_half, eps, threshold, dtype)


@functools.lru_cache(maxsize=4096)
def _counted(op, shape, p, precision, iteration, steps, sign_steps, band_mode, p_bot, guard, symmetric_at_half, eps,
             threshold, dtype):
    from .backends.counting import CountingKernels

    kernels = CountingKernels(symmetric_at_half)
    W = torch.empty(shape, dtype=dtype, device="meta")
    polar_coefficients, sign_coefficients = (None if count is None else ((1.0, 0.0, 0.0),) * count
                                             for count in (steps, sign_steps))
    band = Band(1.0, band_mode, p_bot) if band_mode else None
    # Meta tensors have no values to read (sync=False): a threshold's ratio is the given one, or (None)
    # the capturable design's.
    calls = {
        "polar": lambda: polar(kernels, W, polar_coefficients, precision),
        "power_update": lambda: power_update(kernels, W, p, polar_coefficients, precision,
                                             UPDATE_FLOOR if eps is None else eps),
        "msign": lambda: msign(kernels, W, sign_coefficients, precision),
        "spectral_power": lambda: spectral_power(kernels, W, p, polar_coefficients, precision, False, iteration,
                                                 eps=eps),
        "band_projectors": lambda: band_projectors(kernels, W, 1.0, sign_coefficients, precision, sync=False,
                                                   threshold_ratio=threshold),
        "band_direction": lambda: band_direction(kernels, W, p, band, polar_coefficients, sign_coefficients,
                                                 precision, sync=False, threshold_ratio=threshold),
        "svt": lambda: svt(kernels, W, 1.0, polar_coefficients, sign_coefficients, precision, sync=False,
                           threshold_ratio=threshold),
        "spectral_clip": lambda: spectral_clip(kernels, W, 0.5, 1.0, polar_coefficients, sign_coefficients, precision,
                                               sync=False, threshold_ratio=threshold),
        "spectral_norm_bounds": lambda: spectral_norm_bounds(kernels, W, GUARD_SQUARINGS),
        "decay_": lambda: decay_(kernels, W, DecayRequest(
            p, 1.0, 1.0, band=band, polar_coefficients=polar_coefficients, sign_coefficients=sign_coefficients,
            precision=precision, iteration=iteration, stability="clamp" if guard else "ignore",
            capturable=guard or threshold is None, method="gram", threshold_ratio=threshold)),
    }
    calls[op]()
    return kernels.work


# ----- the decay: the guard, the direction and the write, for one stack of same-shape matrices

STABILITY_POLICIES = ("raise", "warn", "clamp", "ignore")
# "clamp" scales a violating matrix's spectral coefficient down to p * kappa = CLAMP_ORDER (see stability_clamp).
CLAMP_ORDER = 0.5

logger = logging.getLogger("spectral_ops.decay")


class SpectralStabilityError(ValueError):
    """A p > 1 decay step would reorder the singular values, or push the largest through zero (SPEC 1.5)."""


def is_zero(value) -> bool:
    """A Python zero (a tensor is never read on the host, so it counts as non-zero)."""
    return not isinstance(value, torch.Tensor) and value == 0


def needs_direction(p: int, spectral_weight_decay, band: Band | None) -> bool:
    """Whether a decay computes a spectral direction, which needs each whole matrix: not for ``p = 1``
    (``S_1(W) = W``) or a zero ``lambda_p`` without a band, which decay by one multiply."""
    return band is not None or (p != 1 and not is_zero(spectral_weight_decay))


def plain_factor(scale, spectral_weight_decay, ordinary_weight_decay, increment: bool = False):
    """The one multiply a decay without a direction is: ``W <- (1 - scale (lambda_1 + lambda_p)) W``;
    ``increment``: the factor of the increment, ``-scale (lambda_1 + lambda_p)``, formed without the 1
    (``1 - x`` then ``- 1`` would cancel)."""
    return (0.0 if increment else 1.0) - scale * ordinary_weight_decay - scale * spectral_weight_decay


@dataclass
class DecayOutcome:
    """What :func:`decay_` tells its caller besides the new weights.

    ``clamp_factor``: the factor (float64, the stack's batch shape) by which the stability clamp
    multiplied each matrix's spectral coefficient (1 where it did not), or None where the guard
    cannot act (no power above 1, or ``"ignore"``). ``clamped``: eager only, the flat batch position
    of each matrix the clamp reduced, with ``(factor, p * kappa)``, for the log."""

    clamp_factor: torch.Tensor | None = None
    clamped: dict = field(default_factory=dict)


def decay_(kernels, W: torch.Tensor, request: DecayRequest) -> DecayOutcome:
    """Decay the stack ``W`` (any layout) in place, once, after the guard and the whole direction.

    The guard (:func:`stability_clamp`) runs first and raises before any work where asked to; its
    ``s_max`` bound comes from this plan's own Gram and squares. The direction's scale ``c^p`` goes
    into the step (a per-matrix factor), never into a number of its own. ``W`` is the caller's copy
    of the weights (:func:`spectral_ops.decay.prepare_decay`), which checks the new values before
    any weight takes them: a value beyond the dtype comes out as Inf here.
    """
    p, band = request.p, request.band
    if not needs_direction(p, request.spectral_weight_decay, band):
        kernels.decay_epilogue_(wide(W), None, plain_factor(request.scale, request.spectral_weight_decay,
                                                            request.ordinary_weight_decay, request.increment), 0.0,
                                noise=rounding_noise(wide(W), request))
        return DecayOutcome(None, {})
    prox = p == 0 and request.p0_mode == "prox" and band is None
    method = routed(kernels, W, p, request.precision, request.method, iteration=request.iteration,
                    band=band is not None or prox)
    plan = plan_for(W, kernels, request.precision, method, request.capturable, request.threshold_ratio)
    clamp, clamped = stability_clamp(plan, request)
    two_band = band is not None and band.mode == "two_band"
    # two_band weights each band by its own coefficient inside the direction.
    spectral = request.scale if two_band else request.scale * request.spectral_weight_decay
    if clamp is not None:
        spectral = spectral * clamp[..., None, None]
    ordinary = request.scale * request.ordinary_weight_decay
    if prox:
        # The spectral part is the soft-threshold itself: W <- prox - ordinary W.
        keep, step = (-1.0 if request.increment else 0.0) - ordinary, 1.0
        direction, log_factor = plan.scaled_svt(spectral, request.polar_coefficients, request.sign_coefficients)
    else:
        keep, step = (0.0 if request.increment else 1.0) - ordinary, -spectral
        if band is not None:
            top = request.spectral_weight_decay if two_band else 1.0
            direction = plan.band(p, band, request.polar_coefficients, request.sign_coefficients, top)
            log_factor = torch.zeros_like(plan.log_scale)
        else:
            direction, log_factor = plan.scaled_direction(p, request.polar_coefficients, request.iteration)
            direction = direction.to(plan.dtype)  # p = 0's polar factor comes in the operand dtype
    step = scaled_step(step, log_factor).to(plan.dtype)
    del plan  # Xn, Q and the Gram squares: the epilogue needs only the direction
    kernels.decay_epilogue_(wide(W), direction, keep, step, noise=rounding_noise(wide(W), request))
    return DecayOutcome(clamp, clamped)


def scaled_step(step, log_factor: torch.Tensor) -> torch.Tensor:
    """``step * exp(log_factor)`` per matrix (float64 ``(..., 1, 1)``), summed as logs: the factor alone
    (``c^p``) can overflow where ``step`` brings the product back (``1e-40 * (1e10)^4``)."""
    if not isinstance(step, torch.Tensor):  # a Python step: its sign and log on the host
        return (log_factor + math.log(abs(step))).exp() * math.copysign(1.0, step) if step else \
            torch.zeros_like(log_factor)
    step = as_float64(step, log_factor.device)
    return torch.sign(step) * (step.abs().log() + log_factor).exp()


def stability_terms(p: int, spectral_weight_decay, band: Band | None):
    """``(power, coefficient, capped_at_tau)`` for each spectral part that can overshoot (power > 1)."""
    if band is None:
        terms = [(p, spectral_weight_decay, False)]
    elif band.mode == "two_band":
        terms = [(p, spectral_weight_decay, False), (band.p_bot, band.spectral_weight_decay_bot, True)]
    else:
        terms = [(p, spectral_weight_decay, band.mode in ("bot", "bot_only"))]
    return [(power, coefficient, capped) for power, coefficient, capped in terms if power > 1]


def stability_kappa(scale, coefficient, log_s_max: torch.Tensor, power: int, cap=None) -> torch.Tensor:
    """``kappa = scale * coefficient * s_max^(power - 1)`` (SPEC 1.5) from ``ln s_max``, in float64 logs:
    ``s_max^(power-1)`` alone overflows float32 from ``s_max ~ 1e13`` at ``power = 4``, where a small
    coefficient keeps ``kappa`` below 1. ``cap`` (a band's ``tau``) limits ``s_max``. Inf where
    ``kappa`` exceeds float64, 0 for a zero matrix or coefficient."""
    def log(value):
        return as_float64(value, log_s_max.device).log()

    if cap is not None:
        log_s_max = torch.minimum(log_s_max, log(cap))
    # A zero matrix has ln s_max = -inf, and power - 1 >= 1 keeps that -inf (never 0 * -inf).
    return (log(scale) + log(coefficient) + (power - 1) * log_s_max).exp()


def stability_clamp(plan: GramPlan, request: DecayRequest):
    """The stability guard (SPEC 1.5) of a plan's stack, before any write: ``(factor, clamped)`` as in
    :class:`DecayOutcome`.

    The per-mode step is ``f(s) = s - k s^p`` with ``k = scale * coefficient``, so
    ``f'(s) = 1 - p k s^(p-1)``, which for ``p > 1`` falls as ``s`` grows. ``f`` is therefore
    increasing on ``[0, s_max]``, and keeps the order of the modes, exactly while
    ``f'(s_max) = 1 - p * kappa > 0``, i.e. ``p * kappa < 1`` with ``kappa = k s_max^(p-1)``. That
    also keeps every mode positive (``f(s) > f(0) = 0``), the weaker ``kappa < 1``: between the two
    (``1/p <= kappa < 1``) ``f`` rises then falls, and a mode just below ``s_max`` ends above it.

    ``s_max`` is bounded from above level by level (:meth:`GramPlan.spectral_norm_levels`): by
    ``||W||_F`` for free (the plan's scale), then from the plan's own Gram (the direction's too), then
    from each of at most three squarings of it (shared with the direction's ``G^k``), stopping at the
    first level that settles the condition. The guard therefore never misses a violation and can only
    be conservative by the bounds' ratio. A factorised plan's second level is its own ``s_max``
    (:meth:`FactorisedPlan.spectral_norm_levels`).

    ``"clamp"`` scales a violating matrix's coefficient to ``p * kappa = CLAMP_ORDER = 1/2`` rather
    than to the boundary: ``f' >= 1/2`` on ``[0, s_max]`` then, so no gap between two modes more than
    halves in the step (at the boundary the top two would merge), the top mode loses at most
    ``1/(2p)`` of itself, and the next steps (``s_max`` no larger, a warm-up lr up to twice as large)
    stay inside the condition instead of being clamped again. A matrix that satisfies the condition
    is left exactly as asked, as ``"raise"`` would.

    ``capturable``: ``"clamp"`` is applied on the device, with the plan's whole bound always computed
    (no host decision to skip it): the same factors as the eager path, and no log. Validation refuses
    the host-side policies there, except in a step torch.compile traces (Dynamo marks every traced
    step capturable), where they read the whole bound once, at one graph break.
    """
    band = request.band
    terms = stability_terms(request.p, request.spectral_weight_decay, band)
    if not terms or request.stability == "ignore":
        return None, {}

    def kappas(log_s_max):
        # In logs: s_max^(p-1) alone leaves float32 at the extremes, where kappa may not.
        return torch.stack([stability_kappa(request.scale, coefficient, log_s_max, power,
                                            cap=band.tau if capped else None)
                            for power, coefficient, capped in terms])

    def order(kappa):
        """``p * kappa`` of the term nearest its order condition (two-band terms have their own p), by
        Python multiples: a tensor of the powers would be a copy from the host, which capture refuses."""
        return torch.stack([power * term for (power, _, _), term in zip(terms, kappa)]).amax(0)

    def clamp_factor(worst):
        return torch.where(worst >= 1, CLAMP_ORDER / worst, torch.ones_like(worst))

    keep = max(request.p, band.p_bot if band is not None and band.mode == "two_band" else 0) // 2
    if request.capturable and request.stability == "clamp":
        return clamp_factor(order(kappas(plan.log_spectral_norm_bounds(keep=keep)[1]))), {}
    if not request.capturable and not torch.compiler.is_compiling() and settled_by_the_norm(plan, request, terms):
        return None, {}
    # Eager: from the free bound (||X||_F) up, each square only while the bound so far does not settle it.
    # "raise"/"warn" in a capturable request (a step torch.compile traces: validation refuses them where
    # the step is to be captured): the whole bound, then one host read, at one graph break.
    levels = [plan.log_spectral_norm_bounds(keep=keep)] if request.capturable else plan.spectral_norm_levels(keep=keep)
    for _, log_upper in levels:
        kappa = kappas(log_upper)
        worst = order(kappa)
        if bool((worst < 1).all()):
            return None, {}
    violating = worst >= 1
    if not bool(violating.any()):  # unsettled only by a NaN (a non-finite weight, which its caller skips)
        return None, {}
    if request.stability in ("raise", "warn"):  # the message's three host reads only where it is shown
        largest_kappa = float(kappa.max())
        message = (
            f"spectral decay with p={request.p} is unstable for {int(violating.sum())} of {violating.numel()} "
            f"matrices: p * kappa = p * lr * coefficient * s_max^(p-1) reaches {float(worst.max()):.4g} >= 1 "
            f"(kappa = {largest_kappa:.4g}), and the per-mode step s -> s - lr * coefficient * s^p keeps the "
            "order of the singular values only while p * kappa < 1: a smaller mode would overtake a larger one"
            + (", and the largest would go through zero and flip sign (kappa >= 1)" if largest_kappa >= 1 else "")
            + ". Lower the learning rate or coefficient, or pass stability='clamp'."
        )
        if request.stability == "raise":
            raise SpectralStabilityError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
        return None, {}
    factor = clamp_factor(worst)
    factors, orders = torch.stack([factor, worst]).reshape(2, -1).tolist()
    return factor, {i: (factors[i], order) for i, order in enumerate(orders) if order >= 1}


def settled_by_the_norm(plan: GramPlan, request: DecayRequest, terms) -> bool:
    """Whether ``||X||_F``, the guard's free bound on ``s_max``, settles every matrix of an eager stack:
    in Python numbers, at one host read, where the coefficients are numbers (the same test in float64
    tensors is a dozen small ops, a sixth of a 128 x 64 decay's time). False where it cannot tell, or
    does not settle it (a NaN weight included): the tensor levels then decide."""
    values = [request.scale, *(coefficient for _, coefficient, _ in terms)]
    if request.band is not None:
        values.append(request.band.tau)
    if any(isinstance(value, torch.Tensor) for value in values):
        return False
    log_upper = float(plan.log_scale.max()) + plan.log_norm_rounding
    for power, coefficient, capped in terms:
        k = request.scale * coefficient
        log_s_max = min(log_upper, math.log(request.band.tau)) if capped else log_upper
        if k != 0 and not math.log(power * k) + (power - 1) * log_s_max < 0:
            return False
    return True


def log_clamp(name: str, factor: float, order: float, level: int = logging.WARNING, remark: str = "") -> None:
    """Report one eager clamp: which matrix, and by what factor its spectral coefficient was reduced
    (at ``level``, with ``remark`` appended)."""
    logger.log(level, "stability='clamp' reduced the spectral coefficient of %s by a factor %.4g: p * kappa was %.4g "
               ">= 1 (the step would reorder its singular values) and is %.4g%s", name, factor, order, factor * order,
               remark)
