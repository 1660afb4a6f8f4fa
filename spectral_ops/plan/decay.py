"""The decay: the whole step of one stack of same-shape matrices, guard, direction and write.

:func:`decay_` is a decay (SPEC 1.5): the ``p = 1`` shortcut, the stability guard
(:func:`stability_clamp`, its ``s_max`` bound from the plan's own Gram and squares), the clamp, the
direction as :func:`~.routing.route` says (once) and the write ``W <- keep W + step D``, the scale
``c^p`` folded into the step.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field

import torch

from .._checks import user_stacklevel
from ..linalg import as_float64, wide
from .gram import GramPlan
from .iterations import polar_coefficients
from .routing import plan_for, routed
from .thresholds import Band, Scale, spectral_terms, weighs_its_bands


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


STABILITY_POLICIES = ("raise", "warn", "clamp", "ignore")
# "clamp" scales a violating matrix's spectral coefficient down to p * kappa = CLAMP_ORDER (see stability_clamp).
CLAMP_ORDER = 0.5

logger = logging.getLogger("spectral_ops.decay")


class SpectralStabilityError(ValueError):
    """A p > 1 decay step would reorder the singular values, or push the largest through zero (SPEC 1.5)."""


def is_zero(value) -> bool:
    """A Python zero (a tensor is never read on the host, so it counts as non-zero)."""
    return not isinstance(value, torch.Tensor) and value == 0


def is_prox(p, p0_mode: str, band: Band | None) -> bool:
    """Whether a decay's spectral part is the exact soft-threshold (``p = 0``, ``p0_mode="prox"``, no band)."""
    return p == 0 and p0_mode == "prox" and band is None


def decay_polar_coefficients(steps: int | None, coefficients, p, band: Band | None, p0_mode: str):
    """A decay's polar coefficients (:func:`~.iterations.polar_coefficients`), from its checked ``steps`` and
    ``coefficients``: a band or prox decay splits the modes at a threshold, for which its polar factor is
    designed."""
    powers = (p,) if band is None else (p, band.p_bot)
    return polar_coefficients(steps, coefficients, powers, thresholded=band is not None or is_prox(p, p0_mode, band))


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
    prox = is_prox(p, request.p0_mode, band)
    # A soft-threshold at 0 (lr = 0) is W itself, which the plain multiply keeps exactly (rebuilt from its
    # factors it would carry their rounding: 1e-6 in fp32).
    if not needs_direction(p, request.spectral_weight_decay, band) or \
            prox and is_zero(request.scale * request.spectral_weight_decay):
        kernels.decay_epilogue_(wide(W), None, plain_factor(request.scale, request.spectral_weight_decay,
                                                            request.ordinary_weight_decay, request.increment), 0.0,
                                noise=rounding_noise(wide(W), request))
        return DecayOutcome(None, {})
    chosen = routed(kernels, W, p, request.precision, request.method, request.polar_coefficients,
                    iteration=request.iteration, band=band is not None or prox)
    plan = plan_for(W, kernels, request.precision, chosen.method, request.capturable, request.threshold_ratio)
    clamp, clamped = stability_clamp(plan, request)
    # two_band weights each band by its own coefficient inside the direction.
    weighed = weighs_its_bands(band)
    spectral = request.scale if weighed else request.scale * request.spectral_weight_decay
    if clamp is not None:
        spectral = spectral * clamp[..., None, None]
    ordinary = request.scale * request.ordinary_weight_decay
    if prox:
        # The spectral part is the soft-threshold itself: W <- prox - ordinary W.
        keep, step = (-1.0 if request.increment else 0.0) - ordinary, 1.0
        if isinstance(spectral, torch.Tensor):
            # A threshold held in a tensor may be 0 (lr = 0): there W is kept as it is, not rebuilt (as a Python
            # zero is, above), decided on the device: a capturable step reads nothing back.
            keep = as_float64(keep, W.device)
            keep, step = torch.where(spectral == 0, keep + 1.0, keep), (spectral != 0).to(torch.float64)
        direction, log_factor = plan.thresholds.svt(spectral, request.polar_coefficients, request.sign_coefficients)
    else:
        keep, step = (0.0 if request.increment else 1.0) - ordinary, -spectral
        if band is not None:
            top = request.spectral_weight_decay if weighed else 1.0
            direction = plan.thresholds.band(p, band, request.polar_coefficients, request.sign_coefficients, top)
            log_factor = torch.zeros_like(plan.log_scale)
        else:
            direction, log_factor = plan.scaled_direction(p, request.polar_coefficients, chosen)
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
    """``(power, coefficient, capped_at_tau)`` for each spectral part that can overshoot (power > 1): the
    powers :data:`~.thresholds.BAND_SIDES` puts on each side (below ``tau`` capped at it), each weighted
    by the decay's coefficient but a two-band's bottom, by the band's own."""
    if band is None:
        terms = [(p, spectral_weight_decay, False)]
    else:
        terms = [(band.p_bot if term.what == "bottom power" else p,
                  band.spectral_weight_decay_bot if term.weight == "bottom" else spectral_weight_decay, below)
                 for term, below in spectral_terms(band)]
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

    keep = max(request.p, *(power for power, _, _ in terms)) // 2  # the largest power's G^k
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
