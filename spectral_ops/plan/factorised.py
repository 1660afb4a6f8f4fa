"""The factorised forms: the same forms as the Gram plan's, from an SVD or an eigendecomposition.

:func:`~.routing.route` takes them where a factorisation is faster and as accurate (a CPU's
``"auto"``): each form is its definition, a function of the singular values applied mode by mode.
"""

from __future__ import annotations

import math

import torch

from ..linalg import SpectralFactors, compute_dtype, power_weights, relative_powers
from .gram import ESTIMATE_SQUARINGS, GUARD_SQUARINGS, GramPlan
from .thresholds import FactorisedThresholds


class FactorisedPlan(GramPlan):
    """The same forms from a factorisation (:func:`~.routing.route`'s ``"svd"`` and ``"eigh"``) instead of
    iterations: each is its definition (SPEC 1.1-1.4), a function of the singular values applied mode by
    mode (:class:`~spectral_ops.linalg.SpectralFactors`), exact up to the factorisation's rounding at
    every threshold. The coefficient arguments are not read. The factorisations report their errors to
    the host: a GPU's capturable step never takes this plan (a CPU's may: it has no graph to break).
    The guard's bound on ``s_max`` is ``||X||_F`` (free) and then the factorisation's own ``s_max``
    (:meth:`spectral_norm_levels`): no Gram squarings.
    """

    threshold_forms = FactorisedThresholds

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

    def spectral_norm_estimate(self, squarings: int = ESTIMATE_SQUARINGS) -> torch.Tensor:
        """``s_max(Xn)`` from the factorisation (compute dtype, ``(..., 1, 1)``), exact to its rounding: no
        squarings (``squarings`` is the Gram route's, not read)."""
        return self.factors.s.amax(-1)[..., None, None].to(self.dtype)

    def mode_powers(self, q: int) -> torch.Tensor:
        """The unscaled ``s^q`` of each mode (float64, ``(..., r)``; ``q = 0``: 1 on the non-zero modes)."""
        s = self.factors.s
        if q == 0:
            return power_weights(s, 0, self.shape[-1]).double()
        return torch.exp(q * (s.double().log() + self.log_scale[..., 0]))

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

    def scaled_direction(self, p, polar_coefficients, chosen, eps=None):
        return self.scaled_power(p, eps=eps)
