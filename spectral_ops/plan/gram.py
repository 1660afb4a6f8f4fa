"""The Gram forms: one stack's ``X``, its Gram and squares, the polar factor and the powers ``S_p``.

The shape of the computation (SPEC 1.2-1.4):

* Everything runs in the *wide* orientation ``X`` (``r x N``, ``r = min(m, n)``; a tall weight is
  transposed as a view), so the Gram ``X X^T`` is the small side and every spectral factor multiplies
  ``X`` from the left.
* ``X`` is scaled to unit Frobenius norm once (``Xn = X / c``, through a power of two so that no square
  leaves the range): the Gram ``Gn = Xn Xn^T`` and its powers stay in range, and the scale ``c^p`` is
  applied once at the end, from its log (it can overflow where ``S_p`` does not), or folded into the
  decay's step. A result beyond the dtype raises OverflowError before anything is written (except
  on the capturable path, which cannot read a flag back: there it comes out as Inf). ``Gn`` doubles as
  the first Polar Express step's ``A`` (up to the constant margin).
* ``S_p = c^p Gn^k Q`` for ``p = 2k`` and ``c^p Gn^k Xn`` for ``p = 2k + 1``, with ``Gn^k`` by repeated
  squaring; every product of polynomials in ``Gn`` is symmetric. Band forms need one rectangular product
  by ``P_top`` (:mod:`.thresholds`).
* Small matrices take a backend's fused chain where one exists: the whole op in one launch per matrix.

The same Gram and squares bound ``s_max`` for the decay's stability guard
(:meth:`GramPlan.spectral_norm_levels`).
"""

from __future__ import annotations

import math

import torch

from ..coefficients import NORMALIZATION_MARGIN, inverse_root_coefficients
from ..linalg import compute_dtype, frobenius_normalized, is_tall, scaled_, wide
from ..precision import OPERAND_DTYPES
from .iterations import (
    GRAM_SPACE_BLOCK,
    REAL_POWER_TOLERANCE,
    RESOLUTION,
    ROOT_LOWER,
    ROOT_ORDER,
    TENSOR_POWER_BOUND,
    coupled_inverse_root,
    design_widening,
    function_polynomial,
    inverse_root,
    matrix_power_of_root,
    polar_iterations,
    repeated_squaring,
    restart_blocks,
    root_squarings,
)
from .thresholds import GramThresholds, lift_design

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
# The matrix-vector products of GramPlan.spectral_norm_estimate: with its default three squarings its Rayleigh
# quotient misses s_max^2 by at most about 1 / (16 e (RAYLEIGH_SWEEPS + 1)) of it (0.3%).
RAYLEIGH_SWEEPS = 8
# The squarings of GramPlan.spectral_norm_estimate by default: Gn^8, which the decay's guard forms anyway.
ESTIMATE_SQUARINGS = 3
# ||X||_F's relative rounding, in units of the compute dtype's eps (a reduction's error grows with log2 of
# its length; 64 covers 2^64 terms).
NORM_ROUNDING = 64


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

    threshold_forms = GramThresholds

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
        self._spectral_norm_estimates: dict[int, torch.Tensor] = {}  # squarings -> estimate

    @property
    def thresholds(self) -> GramThresholds:
        """The thresholded forms on this plan (projectors, band directions, svt, the clip). Not held by the
        plan, so that a caller's ``del plan`` frees the plan's tensors at once (a held one would make a
        reference cycle): each op asks for one form."""
        return self.threshold_forms(self)

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
        *_, last = self.spectral_norm_levels(squarings, keep)
        return last

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
            X, G, identity, Z, done = self.Xo * shrink, self.gram * shrink**2, self.identity(), None, 0
            for steps in restart_blocks(len(coefficients), self.restart_every):
                if Z is not None:  # a restart
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
        (as Polar Express's below its bound): the polynomial takes them to about the bound's value.
        ``coefficients`` None with a floor: the floor lifts (:func:`~.iterations.floor_lifts`), and ``Q`` is the
        lift's (:func:`~.thresholds.lift_design`), resolved down to the zero cutoff and 0 below it."""
        precision, identity = self.precision, self.identity()
        operand = OPERAND_DTYPES[precision]
        zero_modes = None
        if eps is not None and coefficients is None:
            # A floor's lift (the op's router leaves the coefficients to it where the precision resolves it):
            # Q on every non-zero mode and on none of the zero ones, whose weight the floor would set.
            forms, lift = self.thresholds, lift_design(*self.shape[-2:], self.dtype, precision)
            Q, P = forms.lifting_polar(lift), forms.absolute_value(lift).to(operand)
            zero_modes = (identity - forms.nonzero_projector(lift)).to(operand)
        else:
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
            return self._floored_power(p, P, Q, b, eps, zero_modes)
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

    def _floored_power(self, p, P, Q, b, eps: float, zero_modes=None):
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
        powers leave them: about the bound's value. ``zero_modes`` (a lift's ``I - P_top(c)``, with ``Q`` 0 there)
        are moved to the top of ``A``'s interval, where the power weighs them least (``p < 0``) or as the top
        mode (``p > 0``): at the floor's weight (``eps^p`` of the top's) any rounding of ``Q`` left on them would
        be amplified by it (0.4 relative at ``p = -1.5``, ``eps = 1e-4`` in fp32, where that weight is 1e6).

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
        if zero_modes is not None:
            A = A + zero_modes * (1.0 / (1.0 + d))
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

    def spectral_norm_estimate(self, squarings: int = ESTIMATE_SQUARINGS) -> torch.Tensor:
        """``s_max(Xn)`` per matrix (compute dtype, ``(..., 1, 1)``), from below: the Rayleigh quotient of
        ``Gn`` at ``v = Gn^(N) e_j``, ``N = 2^squarings (k + 1)``, from the column ``j`` of ``M = Gn^(2^squarings)``
        (repeated squaring) of largest norm and ``k =`` :data:`RAYLEIGH_SWEEPS` matrix-vector products by ``M``.
        ``v`` weighs mode ``i`` by ``(s_i / s_max)^(2 N)``, so the quotient misses ``s_max^2`` by at most about
        ``1 / (2 e N)`` of it where one mode competes with the top (the modes that weigh most are those that miss
        least), and about ``(1 + ln R) / (2 N)`` where ``R`` is the weight of many at one depth against the top's.

        The default three squarings (``Gn^8``, 0.3%) set a floor's scale (``eps s_max``) and a lift's zero
        cutoff, formed once for both. :func:`~.routing.qk_cap` takes 16 (:data:`~.routing.QK_CAP_SQUARINGS`,
        ``N = 9 * 2^16``: 16 more ``r x r`` products per matrix): measured within 4e-7 of ``s_max`` (fp32 and
        fp64) on spectra whose gaps below the top run from 1e-7 to 1e-1, within fp32's rounding (1.3e-7, either
        side) on Gaussian matrices, and to float64's (1e-15) there in fp64. Each estimate is formed once."""
        if squarings in self._spectral_norm_estimates:
            return self._spectral_norm_estimates[squarings]
        formed = set(self._gram_squares)
        M, _ = self._gram_square(2**squarings)
        # The squares beyond Gn^8 formed here only lead to M: dropped, not held (16 squarings, 13 r x r each).
        for exponent in set(self._gram_squares) - formed:
            if exponent > 2**ESTIMATE_SQUARINGS:
                del self._gram_squares[exponent]
        M = M.to(self.dtype)
        column = torch.linalg.vector_norm(M, dim=-2).argmax(-1)
        v = torch.take_along_dim(M, column[..., None, None], dim=-1)
        tiny = torch.finfo(self.dtype).tiny
        for _ in range(RAYLEIGH_SWEEPS):
            v = M @ (v / torch.linalg.vector_norm(v, dim=-2, keepdim=True).clamp_min(tiny))
        quotient = (v * (self.gram.to(self.dtype) @ v)).sum((-2, -1), keepdim=True)
        estimate = (quotient / (v * v).sum((-2, -1), keepdim=True).clamp_min(tiny)).sqrt()
        self._spectral_norm_estimates[squarings] = estimate
        return estimate

    def power(self, p: int, coefficients) -> torch.Tensor:
        """``S_p`` (wide, compute dtype), non-finite only where it overflows the compute dtype."""
        if p in (0, 1):  # unscaled already
            return self.scaled_power(p, coefficients)[0].to(self.dtype)
        return scaled_(*self.scaled_power(p, coefficients))

    def scaled_direction(self, p, polar_coefficients, chosen, eps=None):
        """``S_p`` scaled, ``(D, ln f)``, as the op's :class:`~.routing.Route` ``chosen`` says: a backend's
        fused chain first where it may run, else the plan's iteration."""
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
