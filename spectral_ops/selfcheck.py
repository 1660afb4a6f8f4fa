"""Fixed small inputs on which a GPU backend must agree with the PyTorch reference (see dispatch)."""

from __future__ import annotations

import torch

from .backends.base import BandSpec, DecayRequest
from .coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients
from .testing import matrix_with_spectrum

# Singular values sit in two clusters around TAU, so the band projectors converge well inside
# the default number of sign steps and the check compares converged outputs.
TAU = 0.75


def self_check_cases(op: str, dtype: torch.dtype, device):
    """Callables ``case(backend) -> tuple of tensors`` exercising ``op`` (batched, tall, odd sizes)."""
    r = 24
    spectrum = torch.cat([torch.linspace(0.5, 0.65, r // 2), torch.linspace(0.85, 1.0, r - r // 2)])
    W = matrix_with_spectrum((2, 40, r), spectrum, dtype, device, seed=1234)
    polar_c = polar_express_coefficients()
    sign_c = polar_express_coefficients()
    if op == "polar":
        return [lambda b: (b.polar(W, polar_c),)]
    if op == "msign":
        A = W.mT @ W - TAU**2 * torch.eye(r, dtype=dtype, device=device)
        return [lambda b: (b.msign(A, (NEWTON_SCHULZ_SIGN,) * 30),)]
    if op == "spectral_power":
        return [lambda b, p=p: (b.spectral_power(W, p, polar_c),) for p in (0, 2, 3)]
    if op == "band_projectors":
        return [lambda b: b.band_projectors(W, TAU, sign_c)]
    if op == "band_direction":
        bands = [BandSpec(TAU, "top"), BandSpec(TAU, "two_band", p_bot=0, lambda_top=0.5, lambda_bot=2.0)]
        return [lambda b, band=band: (b.band_direction(W, 2, band, polar_c, sign_c),) for band in bands]
    if op == "svt":
        return [lambda b: (b.svt(W, TAU, polar_c, sign_c),)]
    if op == "decay_":
        request = DecayRequest(2, 0.1, 0.01, None, "explicit", polar_c, sign_c)
        return [lambda b: (b.decay_(W.clone(), request),)]
    raise ValueError(f"no self-check for op {op!r}")
