"""Thresholds and band modes: where a band form splits the spectrum, and what it puts on each side.

A threshold ``tau`` is resolved by a sign iteration whose steps are designed for it
(:func:`threshold_design`, docs/real-powers.md, "Thresholds at any depth"). The six band modes of
:class:`Band` are one table, :data:`BAND_SIDES`: what each puts above ``tau`` and below it. The Gram
route's forms (:class:`GramThresholds`: one rectangular product by the projector ``P_top``), the
factorised route's (:class:`FactorisedThresholds`: weights mode by mode) and the decay's stability
terms (:func:`~.decay.stability_terms`) all read it.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from dataclasses import fields as dataclasses_fields
from typing import Union

import torch

from ..coefficients import NORMALIZATION_MARGIN, polar_express_coefficients, polar_express_design
from ..deprecations import renamed_argument
from ..linalg import as_float64, power_weights, ratio, zero_mode_cutoff
from .iterations import matrix_sign

Scale = Union[float, torch.Tensor]  # a Python number, a 0-d tensor, or one value per matrix (..., 1, 1)

# Where the band ops' sign iteration
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
# :meth:`GramThresholds.final_product`), whatever the operands' precision.
THRESHOLD_TOLERANCE = {torch.float32: 1e-7, torch.float64: 1e-13}
# The Gram's smallest gap (relative, as below) at which its rounding still leaves the projector within
# the fp32 (2e-5) and fp64 (1e-11) bounds, per precision: measured on CPUs, the error is at most about
# max(5e-6, 1e-10 / gap) in fp32 and 1e-18 / gap in fp64 (r = 64 and 256, N up to 16 r, modes placed 1%
# from tau: tests/test_thresholds.py); 5e-5 leaves 4x for the GPU kernels' 3xTF32 (2^-22). bf16, fp16 and
# tf32 operands round the Gram too coarsely for any 1% gap: they keep it only where the default design does.
GRAM_RESOLVES = {"fp32": 5e-5, "fp64": 1e-6}
# A lift (spectral_clip's min=, a band form with p = 0 below tau, a floored power) maps every mode below tau to
# O(1), however small: its polar factor must resolve each non-zero mode, down to the zero cutoff
# (linalg.zero_mode_cutoff, N eps s_max), where the threshold's design stops at tau (and the default one at
# 1e-3 ||W||_F: 0.31 min at s = 1e-4 ||W||_F before). A factor designed that deep also amplifies the
# round-off of a rank-deficient matrix's zero modes (an eps in step j grows by the later steps' linear
# coefficients, ~1 / lower in all): measured 0.2 of min on the zero modes of a 64 x 128 of rank 8. So the lift
# takes Q on the modes above the cutoff only, P_top(c) Q, with a sign iteration on |Xn| - t I (where the
# zero modes sit at -t, away from the sign's unstable 0, and |Xn| = Xn Q^T is 0 on them whatever Q's
# round-off there). The polar factor is designed down to the cutoff at its smallest relative to ||X||_F
# (s_max >= ||X||_F / sqrt(r)). Only fp32 and fp64 operands resolve it (GRAM_RESOLVES): bf16, fp16 and tf32
# ones lift as the threshold's design does (the clip and the floored powers compute in fp32 unless told
# otherwise).
#
# The cutoff is a promise (docs/guarantees.md): a mode at or below it stays 0, on every route. The sign's
# threshold t therefore sits above the cutoff, t = c / (1 - CUTOFF_RESOLUTION), so that the modes at or below
# c are CUTOFF_RESOLUTION (relatively) from it and resolved to 0; the modes from c (1 + rho) / (1 - rho) up
# are lifted, those in between partly. |Xn| holds the modes near c to about 4e-4 of c in fp32 (its rounding
# is relative to s_max, and c is N eps s_max: measured 1e-4 to 4e-4 at 128 x 64 to 512 x 128), so rho = 1% is
# resolvable, but not by an fp32 sign iteration, whose rounding (eps of ||A||_F) is as large as that gap:
# an fp32 plan takes the cutoff's sign in float64 (r x r products only). An fp64 plan has no finer dtype:
# its rho is 1/2 (modes from 3 c lifted), as wide as its rounding at the cutoff allows (the design this
# replaced resolved a factor 2 around c: modes from c / 2 lifted partly, against the promise).
CUTOFF_RESOLUTION = {torch.float32: 0.01, torch.float64: 0.5}
# s_max sets the cutoff; its Rayleigh estimate (GramPlan.spectral_norm_estimate) is from below, within about
# 0.13% of s_max: widened by this much, the cutoff is never placed below c (at most 0.5% above it).
CUTOFF_ESTIMATE_MARGIN = 0.005
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
    restricts the polar factor to the non-zero modes (:meth:`GramThresholds.lifting_polar`), or None."""

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
    the zero cutoff as well, and ``cutoff`` for its projector (:func:`lift_design`)."""
    if t is None:
        t = CAPTURABLE_DEPTH / math.sqrt(r)
    near, tolerance, floor = THRESHOLD_RESOLUTION, THRESHOLD_TOLERANCE[dtype], torch.finfo(dtype).eps

    def designed(lower):
        return _designed(lower, tolerance, floor)

    lift = None if polar_coefficients is not None or sign_coefficients is not None or lift_size is None \
        else lift_design(r, lift_size, dtype, precision)
    if polar_coefficients is None:
        lower = (1 - near) * t
        # A threshold below the cutoff (no mode between them to lift) keeps its own design.
        polar_coefficients = lift.polar if lift is not None and lower >= lift.depth else \
            designed(lower / NORMALIZATION_MARGIN)
    if sign_coefficients is not None:
        return ThresholdDesign(False, sign_coefficients, polar_coefficients)
    cutoff_sign = None if lift is None else lift.cutoff
    gram_gap = (1 - (1 - near) ** 2) * t * t / math.sqrt(max(1 - 2 * t * t + r * t**4, floor))
    if gram_gap >= DEFAULT_LOWER or (not holds_polar and gram_gap >= GRAM_RESOLVES.get(precision, math.inf)):
        return ThresholdDesign(False, designed(gram_gap), polar_coefficients, cutoff_sign)
    gap = near * t / math.sqrt(max(1 - 2 * t + r * t * t, floor))
    return ThresholdDesign(True, designed(gap), polar_coefficients, cutoff_sign)


def _designed(lower: float, tolerance: float, floor: float) -> tuple:
    """Polar Express resolving ``[lower, 1]`` to ``tolerance`` (``lower`` no deeper than ``floor``, the dtype's
    epsilon), and the default steps where those reach it."""
    return polar_express_design(max(lower, floor), tolerance) if lower < DEFAULT_LOWER else \
        polar_express_coefficients(DEFAULT_STEPS)


@dataclass(frozen=True)
class LiftDesign:
    """How a lift resolves every non-zero mode (:data:`CUTOFF_RESOLUTION`): ``polar``, the polar factor's
    coefficients down to the zero cutoff; ``cutoff``, the float64 sign coefficients of ``P_top`` at the
    cutoff (:meth:`GramThresholds.lifting_polar`); ``depth``: the cutoff they are designed for, relative to
    ``||X||_F``."""

    polar: tuple
    cutoff: tuple
    depth: float


def lift_design(r: int, size: int, dtype: torch.dtype, precision: str) -> LiftDesign | None:
    """The design of a lift on ``r x size`` matrices in the compute ``dtype`` with ``precision``'s operands, or
    None where they do not resolve the zero cutoff (bf16, fp16, tf32: :data:`GRAM_RESOLVES`). It does not
    depend on the weight (the cutoff at its smallest against ``||X||_F``, ``N eps / sqrt(r)``), so a
    capturable call takes it as it is.

    The polar factor is designed for the cutoff within :data:`CUTOFF_TOLERANCE_UNITS` of the dtype's
    rounding; the cutoff's sign (float64) for a gap of :data:`CUTOFF_RESOLUTION` of it, to the rounding of
    the dtype its projector is rounded to."""
    if precision not in GRAM_RESOLVES:
        return None
    cutoff = zero_mode_cutoff(size, dtype) / math.sqrt(r)
    floor = torch.finfo(dtype).eps
    tolerance = min(THRESHOLD_TOLERANCE[dtype], CUTOFF_TOLERANCE_UNITS * floor)
    sign_floor = torch.finfo(torch.float64).eps
    return LiftDesign(_designed(cutoff / NORMALIZATION_MARGIN, tolerance, floor),
                      _designed(CUTOFF_RESOLUTION[dtype] * cutoff, tolerance, sign_floor), cutoff)


@dataclass(frozen=True)
class Band:
    """Band-selective decay (SPEC 1.4), split at singular value ``tau``.

    ``mode`` is ``"top"`` (the spectral rule above ``tau``, ordinary decay below), ``"bot"``,
    ``"top_only"``, ``"bot_only"``, ``"two_band"`` or ``"clip"``: ``U (s - tau)_+ V^T``, each singular
    value's excess over ``tau`` (with ``p = 1``), so that a decay by it is the clipped decay
    ``s -> s - c (s - tau)_+`` (``c`` = the step's ``lr lambda``; ``c = 1`` caps at ``tau``). In ``"two_band"``
    the call's ``p`` and ``spectral_weight_decay`` act on the top band and ``p_bot``/``spectral_weight_decay_bot`` on
    the bottom one. ``sign_steps``/``sign_method`` configure the sign iteration of the projector (by default
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


# ----- the band modes (SPEC 1.4), once: what each puts on the modes above tau and on those below

@dataclass(frozen=True)
class Term:
    """One term of a band form's side: ``what`` is ``"power"`` (``S_p``, the call's power), ``"bottom
    power"`` (``S_{p_bot}``, the band's), ``"identity"`` (``X`` itself, ``S_1``) or ``"threshold"`` (``tau
    Q``: ``tau`` times the polar factor, ``S_0``); ``weight`` None (1), ``"top"`` (the call's top weight, a
    decay's spectral coefficient) or ``"bottom"`` (the band's ``spectral_weight_decay_bot``);
    ``subtracted``: taken off the side's sum."""

    what: str
    weight: str | None = None
    subtracted: bool = False


# (above tau, below tau); an empty side is 0. The clip's top is U (s - tau) V^T, the excess over tau.
BAND_SIDES = {
    "top": ((Term("power"),), (Term("identity"),)),
    "bot": ((Term("identity"),), (Term("power"),)),
    "top_only": ((Term("power"),), ()),
    "bot_only": ((), (Term("power"),)),
    "two_band": ((Term("power", "top"),), (Term("bottom power", "bottom"),)),
    "clip": ((Term("identity"), Term("threshold", subtracted=True)), ()),
}
BAND_MODES = tuple(BAND_SIDES)


def term_power(term: Term, p, band: Band):
    """The power ``q`` of a term's ``S_q``."""
    return {"power": p, "bottom power": band.p_bot, "identity": 1, "threshold": 0}[term.what]


def spectral_terms(band: Band):
    """``(term, below)`` for each term of ``band``'s sides that is a power of the call (the parts of a
    decay its coefficients weight), ``below`` whether it lies below ``tau``."""
    return [(term, position == 1) for position, side in enumerate(BAND_SIDES[band.mode]) for term in side
            if term.what in ("power", "bottom power")]


def weighs_its_bands(band: Band | None) -> bool:
    """Whether a band form weights its sides itself (``"two_band"``), so that a decay's step does not
    multiply it by the spectral coefficient again."""
    return band is not None and any(term.weight is not None for side in BAND_SIDES[band.mode] for term in side)


def _sum(values):
    """The sum of a side's ``(value, subtracted)`` pairs, in order, from the first value."""
    (total, _), *rest = values
    for value, subtracted in rest:
        total = total - value if subtracted else total + value
    return total


class GramThresholds:
    """The Gram route's thresholded forms of one :class:`~.gram.GramPlan`: the projectors, the band
    directions, soft-thresholding and the clip, each with one rectangular product by ``P_top`` (on the
    plan's own Gram or ``|Xn|``), ``|Xn|`` and a lift's polar factor formed once."""

    def __init__(self, plan):
        self.plan = plan
        self._absolute_value = None  # |Xn| from the plan's polar factor, for the sign iterations on it
        self._lifting_polar = None
        self._nonzero_projector = None

    def threshold_ratio(self, tau) -> float | None:
        """The smallest ``tau / c`` of the stack on the host (one read), or None where the plan may not
        read (capturable, or traced by torch.compile) or cannot (a non-finite weight)."""
        plan = self.plan
        if plan.known_threshold_ratio is not None:
            return plan.known_threshold_ratio
        if plan.capturable or torch.compiler.is_compiling():
            return None
        t = float(ratio(tau, plan.log_scale, math.sqrt(2.0), torch.float64).min())
        return t if math.isfinite(t) and t > 0 else None

    def design(self, tau, polar_coefficients, sign_coefficients, holds_polar: bool = True,
               lifts: bool = False) -> ThresholdDesign:
        """:func:`threshold_design` for ``tau`` on this stack; ``lifts``: the form lifts its bottom band."""
        plan = self.plan
        return threshold_design(self.threshold_ratio(tau), plan.shape[-2], plan.dtype, plan.precision,
                                polar_coefficients, sign_coefficients, holds_polar,
                                plan.shape[-1] if lifts else None)

    def projector(self, tau, design: ThresholdDesign) -> torch.Tensor:
        """``P_top = (I + msign(Gn - (tau / c)^2 I)) / 2``, or ``(I + msign(|Xn| - (tau / c) I)) / 2`` as
        ``design`` says, on the small side (compute dtype).

        The eigenvalues of ``Gn`` and ``|Xn|`` are in [0, 1], so a shift above 2 gives ``P_top = 0`` as surely
        as the exact one (which can exceed the dtype: ``tau / c = 1e60`` for ``tau = 1e30``, ``c = 1e-30``)."""
        plan = self.plan
        t = ratio(tau, plan.log_scale, math.sqrt(2.0), plan.dtype)
        if design.absolute:
            shifted = self.absolute_value(design) - t * plan.identity()
        else:
            shifted = plan.gram.to(plan.dtype) - t * t * plan.identity()
        return self._top(shifted, design.sign)

    def _top(self, shifted: torch.Tensor, sign_coefficients, symmetrized: bool = False) -> torch.Tensor:
        """``(I + msign(shifted)) / 2`` (compute dtype)."""
        plan = self.plan
        J = matrix_sign(plan.kernels, shifted, sign_coefficients, plan.precision, symmetrized).to(plan.dtype)
        return (J + plan.identity()) * 0.5

    def absolute_value(self, design: ThresholdDesign | LiftDesign) -> torch.Tensor:
        """``|Xn|`` (compute dtype) from the plan's polar factor (``design``'s where it is the first to ask),
        formed once for every sign iteration on it."""
        if self._absolute_value is None:
            plan = self.plan
            self._absolute_value = plan.absolute(plan.polar(design.polar)).to(plan.dtype)
        return self._absolute_value

    def lifting_polar(self, design: ThresholdDesign | LiftDesign) -> torch.Tensor:
        """The polar factor a lift multiplies (operand dtype): ``Q``, and with ``design.cutoff``
        ``P_top(c) Q`` (:meth:`nonzero_projector`), ``Q`` on the modes above the zero cutoff only."""
        plan = self.plan
        Q = plan.polar(design.polar)
        if design.cutoff is None:
            return Q
        if self._lifting_polar is None:
            self._lifting_polar = plan.product(self.nonzero_projector(design).to(Q.dtype), Q)
        return self._lifting_polar

    def nonzero_projector(self, design: ThresholdDesign | LiftDesign) -> torch.Tensor:
        """``P_top(c)`` (compute dtype, small side) at the zero cutoff ``c = N eps s_max``, by a float64 sign
        iteration with ``design.cutoff``: 0 on the modes at or below ``c``, 1 on those from ``c (1 + rho) / (1 -
        rho)`` up (:data:`CUTOFF_RESOLUTION`). ``s_max`` is the Rayleigh estimate (three squarings of the Gram
        and matrix-vector products, which the cost model counts), widened by :data:`CUTOFF_ESTIMATE_MARGIN` so
        that the cutoff is never read low. Formed once."""
        if self._nonzero_projector is None:
            plan, exact = self.plan, torch.float64
            s_max = plan.spectral_norm_estimate().to(exact) * (1.0 + CUTOFF_ESTIMATE_MARGIN)
            threshold = zero_mode_cutoff(plan.shape[-1], plan.dtype) * s_max / (1.0 - CUTOFF_RESOLUTION[plan.dtype])
            # Xn Q^T is symmetric only up to Q's error, s_i times its round-off between a zero mode's left
            # vector and a non-zero one's right vector (1e-6 in fp32): as large as the cutoff's gap.
            P = self.absolute_value(design).to(exact)
            identity = torch.eye(plan.shape[-2], dtype=exact, device=P.device)
            J = matrix_sign(plan.kernels, (P + P.mT) * 0.5 - threshold * identity, design.cutoff, "fp64",
                            symmetrized=True)
            self._nonzero_projector = ((J + identity) * 0.5).to(plan.dtype)
        return self._nonzero_projector

    def top_projector(self, tau, polar_coefficients, sign_coefficients) -> torch.Tensor:
        """:meth:`projector` alone, with the design for ``tau`` (None coefficients: designed for it)."""
        return self.projector(tau, self.design(tau, polar_coefficients, sign_coefficients, holds_polar=False))

    def band(self, p: int, band: Band, polar_coefficients, sign_coefficients, top: Scale = 1.0) -> torch.Tensor:
        """A band-selective direction (SPEC 1.4) with one rectangular product by ``P_top``: with ``T`` and
        ``B`` the sums :data:`BAND_SIDES` puts above and below ``tau``, ``P_top T + P_bot B = B + P_top (T - B)``
        (``P_bot = I - P_top``, and ``P_top`` commutes with every ``S_p``). ``"two_band"`` weights its sides
        by ``top`` and ``band.spectral_weight_decay_bot``. ``S_p`` is formed unscaled, so a band form is
        finite only where ``S_p(W)`` itself fits the compute dtype.
        """
        above, below = BAND_SIDES[band.mode]
        # Odd integer powers are X G^k: only the other powers (and the clip's tau Q) form the polar factor.
        holds_polar = not all(isinstance(q, int) and q % 2 for q in (term_power(t, p, band) for t in above + below))
        # p = 0 below tau lifts the bottom band: Q there, on every non-zero mode (CUTOFF_RESOLUTION).
        lifts = any(term_power(term, p, band) == 0 for term in below)
        design = self.design(band.tau, polar_coefficients, sign_coefficients, holds_polar, lifts)
        P_top = self.projector(band.tau, design)
        T, B = (self._side(side, p, band, design, top) for side in (above, below))
        if B is None:
            return self.final_product(P_top, T)
        if T is None:
            return self.final_product(P_top, B, alpha=-1.0, Y=B)
        return self.final_product(P_top, T - B, Y=B)

    def _side(self, terms, p, band: Band, design: ThresholdDesign, top: Scale):
        """The sum of a side's terms (compute dtype), or None for an empty side."""
        plan = self.plan
        values = []
        for term in terms:
            if term.what == "identity":
                value = plan.X
            elif term.what == "threshold":  # the clip's tau Q, unscaled
                tau = as_float64(band.tau, plan.X.device).to(plan.dtype)
                value = tau * plan.polar(design.polar).to(plan.dtype)
            else:
                value = self._band_power(term_power(term, p, band), design)
            if term.weight is not None:
                value = value * (top if term.weight == "top" else band.spectral_weight_decay_bot)
            values.append((value, term.subtracted))
        return _sum(values) if values else None

    def _band_power(self, p: int, design: ThresholdDesign) -> torch.Tensor:
        """:meth:`~.gram.GramPlan.power` with ``design``'s polar factor, and ``p = 0``'s from :meth:`lifting_polar`."""
        return self.lifting_polar(design).to(self.plan.dtype) if p == 0 else self.plan.power(p, design.polar)

    def svt(self, t, polar_coefficients, sign_coefficients):
        """``prox_{t ||.||_*}(W) = c P_top(t) (Xn - (t / c) Q)`` (SPEC 1.4), scaled: ``(D, ln c)``.

        Every singular value is at most ``c``, so a ``t / c`` above 1 gives zero as surely as the exact
        one, and is capped there (it can exceed the dtype)."""
        plan = self.plan
        design = self.design(t, polar_coefficients, sign_coefficients)
        P_top = self.projector(t, design)
        shift = ratio(t, plan.log_scale, 1.0, plan.dtype)
        return self.final_product(P_top, plan.Xn - shift * plan.polar(design.polar).to(plan.dtype)), \
            plan.log_scale

    def clip(self, low, high, polar_coefficients, sign_coefficients, hard_cap: bool = False):
        """``U diag(clamp(s, low, high)) V^T``, scaled: ``(D, ln c)``; a bound that is None is not applied.
        Each bound is a number, a 0-d tensor or one per matrix (``(..., 1, 1)``); the design is for the
        smallest ratio of the stack (:meth:`threshold_ratio`), which resolves every shallower one too.

        ``X - P_top(high) (X - high Q)`` caps the modes above ``high`` (the soft-threshold at ``high``
        taken off), and ``+ P_bot(low) (low Q - X)`` lifts those below ``low``: two rectangular products
        by the projectors, which commute with ``Q`` and ``X``'s spectrum. A mode with ``s = 0`` has no
        singular vectors (``Q`` is 0 there) and stays 0. ``high / c`` above 1 caps nothing, as surely as
        the exact one; ``low / c`` is not capped (a floor above ``s_max`` lifts every mode to it). The
        polar factor is designed for the lower bound, a lift: down to the zero cutoff, and only on the
        modes above it (:meth:`lifting_polar`).

        ``hard_cap``: ``high`` is a bound that no mode may exceed (:func:`~.routing.qk_cap`'s). A mode
        within :data:`THRESHOLD_RESOLUTION` of a projector's threshold is partly projected, so one just
        above ``high`` would keep part of its excess; the projector is therefore placed that far below
        ``high``, where every mode at or above ``high`` is resolved and capped at ``high``, and those
        within about 2% below it may move up towards ``high``, never beyond it."""
        plan = self.plan
        top = high * (1.0 - THRESHOLD_RESOLUTION) if hard_cap and high is not None else high  # the projector's
        high_design = None if high is None else self.design(top, polar_coefficients, sign_coefficients)
        low_design = None if low is None else self.design(low, polar_coefficients, sign_coefficients, lifts=True)
        Q = self.lifting_polar(low_design or high_design).to(plan.dtype)
        clipped = plan.Xn
        if high is not None:
            shift = ratio(high, plan.log_scale, 1.0, plan.dtype)
            clipped = self.final_product(self.projector(top, high_design), clipped - shift * Q,
                                         alpha=-1.0, Y=clipped)
        if low is not None:
            below = ratio(low, plan.log_scale, math.inf, plan.dtype) * Q - plan.Xn
            clipped = self.final_product(self.projector(low, low_design), below, alpha=-1.0,
                                         Y=clipped + below)
        return clipped, plan.log_scale

    def final_product(self, M, Z, **epilogue):
        """The one rectangular product of a band form, on unscaled weights: in the compute dtype, whose
        range the scale ``c^p`` needs, at fp32 accuracy (fp64 for fp64)."""
        exact = "fp64" if self.plan.dtype == torch.float64 else "fp32"
        return self.plan.kernels.product(M, Z, exact, **epilogue)


class FactorisedThresholds:
    """The same forms on a :class:`~.factorised.FactorisedPlan`: each mode's weight, 1 above ``tau`` and 0
    below (1/2 at it), times what :data:`BAND_SIDES` puts there, exact up to the factorisation's rounding
    at every threshold. The coefficient arguments are not read."""

    def __init__(self, plan):
        self.plan = plan

    def _above(self, tau) -> torch.Tensor:
        """Each mode's share of ``P_top``: 1 above ``tau``, 0 below, 1/2 at it (``(1 + sign) / 2``, as the
        iteration's ``msign(G - tau^2 I)`` is), float64."""
        plan = self.plan
        threshold = ratio(tau, plan.log_scale, math.sqrt(2.0), torch.float64)[..., 0]
        return (torch.sign(plan.factors.s.double() - threshold) + 1) / 2

    def top_projector(self, tau, polar_coefficients, sign_coefficients) -> torch.Tensor:
        return self.plan.factors.projector(self._above(tau))

    def band(self, p: int, band: Band, polar_coefficients, sign_coefficients, top: Scale = 1.0) -> torch.Tensor:
        plan = self.plan
        above = self._above(band.tau)
        below = 1 - above
        weights = []
        for share, side in zip((above, below), BAND_SIDES[band.mode]):
            for term in side:
                if term.what == "threshold":
                    value = per_mode(band.tau, plan.log_scale)
                else:
                    value = plan.mode_powers(term_power(term, p, band))
                if term.weight is not None:
                    weight = top if term.weight == "top" else band.spectral_weight_decay_bot
                    value = per_mode(weight, plan.log_scale) * value
                weights.append((share * value, term.subtracted))
        return plan.factors.modes(_sum(weights))

    def svt(self, t, polar_coefficients, sign_coefficients):
        plan = self.plan
        shift = ratio(t, plan.log_scale, 1.0, torch.float64)[..., 0]
        return plan.factors.modes((plan.factors.s.double() - shift).clamp_min(0)), plan.log_scale

    def clip(self, low, high, polar_coefficients, sign_coefficients, hard_cap: bool = False):
        """Exact at every bound (``hard_cap`` needs nothing more here)."""
        plan = self.plan
        s = plan.factors.s.double()
        clipped = s
        if high is not None:
            clipped = torch.minimum(clipped, ratio(high, plan.log_scale, 1.0, torch.float64)[..., 0])
        if low is not None:
            floor = ratio(low, plan.log_scale, math.inf, torch.float64)[..., 0]
            # Modes with s = 0 have no singular vectors to lift, as the iterations' Q is 0 there. Which are
            # zero is decided on the factorisation's own values (float32 for a float32 SVD): its round-off
            # modes are at a few float32 eps of s_max, far above float64's cutoff.
            nonzero = power_weights(plan.factors.s, 0, plan.shape[-1]) > 0
            clipped = torch.where(nonzero, torch.maximum(clipped, floor), clipped)
        return plan.factors.modes(clipped), plan.log_scale


def per_mode(value: Scale, like: torch.Tensor) -> torch.Tensor:
    """A coefficient (a number, a 0-d tensor or one per matrix, ``(..., 1, 1)``) as float64 that
    broadcasts over a batch's modes, ``(..., 1)``."""
    value = as_float64(value, like.device)
    return value[..., 0] if value.dim() >= 2 else value
