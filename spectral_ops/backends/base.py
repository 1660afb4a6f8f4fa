"""What every backend implements, and the small request records the API hands to them.

A backend is an object with ``name``, ``needs_self_check``, ``unavailable_reason(device)``
(None when it can run on that device), ``supports(op, W)`` and one method per op:

==================  ==============================================================
``polar``           ``(W, polar_coefficients) -> Q``
``msign``           ``(A, sign_coefficients) -> msign(A)``
``spectral_power``  ``(W, p, polar_coefficients) -> S_p(W)``
``band_projectors`` ``(W, tau, sign_coefficients) -> (P_top, P_bot)``
``band_direction``  ``(W, p, BandSpec, polar_coefficients, sign_coefficients) -> D``
``svt``             ``(W, t, polar_coefficients, sign_coefficients) -> prox``
``decay_``          ``(W, DecayRequest) -> W``, written in place
==================  ==============================================================

Inputs arrive validated (float dtype, ``(..., m, n)``, finite, non-empty). Outputs have the
input's dtype. :class:`~spectral_ops.backends.torch_backend.TorchBackend` is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

OPS = ("polar", "msign", "spectral_power", "band_projectors", "band_direction", "svt", "decay_")

Scale = Union[float, torch.Tensor]  # a Python number, a 0-d tensor, or one value per matrix (..., 1, 1)


@dataclass(frozen=True)
class BandSpec:
    """A validated band rule (SPEC 1.4); ``lambda_*`` weight the two bands in ``"two_band"``."""

    tau: Scale
    mode: str
    p_bot: int = 1
    lambda_top: Scale = 1.0
    lambda_bot: Scale = 1.0


@dataclass(frozen=True)
class DecayRequest:
    """One decay step: ``W <- (1 - ordinary_scale) W - spectral_scale * direction``.

    The scales already include the learning rate or schedule multiplier. With ``p = 0`` and
    ``p0_mode = "prox"`` the spectral part is the exact soft-threshold at ``spectral_scale``.
    """

    p: int
    spectral_scale: Scale
    ordinary_scale: Scale
    band: BandSpec | None
    p0_mode: str
    polar_coefficients: tuple
    sign_coefficients: tuple


def repeated_squaring(k: int, square, multiply):
    """``G^k`` as the product of the squares ``square(2^j) = G^(2^j)`` its binary digits select.

    ``square`` caches the squares (each computed at most once); ``multiply`` is the backend's product
    of two commuting symmetric factors. Shared by every backend's Gram plan.
    """
    result, exponent = None, 1
    while k:
        if k & 1:
            factor = square(exponent)
            result = factor if result is None else multiply(result, factor)
        k >>= 1
        exponent <<= 1
    return result
