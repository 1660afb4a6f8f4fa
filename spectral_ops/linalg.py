"""Linear algebra that is not a backend: compute dtypes, the wide orientation, the SVD and eigh routes,
spectral norm bounds, test spectra and the error measure.

Plain torch throughout. :mod:`spectral_ops.plan` builds on the orientation helpers here; the
routes here are the ones that need a factorisation, which no backend provides.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 computes in float64; float32, float16 and bfloat16 compute in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tiny(dtype: torch.dtype) -> float:
    """The smallest normal number of ``dtype``: added to norms so that a zero matrix divides to zero."""
    return torch.finfo(dtype).tiny


def is_tall(W: torch.Tensor) -> bool:
    """Square matrices count as tall: their Gram is ``W^T W`` and their projectors act on the right."""
    return W.shape[-2] >= W.shape[-1]


def wide(W: torch.Tensor) -> torch.Tensor:
    """The wide ``r x N`` view of ``W`` (``r = min(m, n)``): ``W^T`` for a tall weight, no copy.

    In the wide orientation the Gram ``X X^T`` is the small side and every spectral factor multiplies
    ``X`` from the left; ``S_p(W^T) = S_p(W)^T`` turns results back.
    """
    return W.mT if is_tall(W) else W


def normalized_wide(W: torch.Tensor, dtype: torch.dtype | None = None):
    """``(X, c, Xn)``: the wide ``X`` in ``dtype`` (default: the compute dtype), ``c = ||X||_F``
    (``(..., 1, 1)``) and ``Xn = X / c`` (zero for a zero matrix). Working at unit norm keeps every
    power of the Gram in range."""
    X = wide(W).to(dtype or compute_dtype(W.dtype))
    scale = torch.linalg.matrix_norm(X)[..., None, None]
    return X, scale, X / (scale + tiny(X.dtype))


def power_weights(s: torch.Tensor, p: int, size: int) -> torch.Tensor:
    """``s^p`` per mode, where ``p = 0`` gives 1 on the non-zero modes only.

    A mode counts as zero below ``size * eps * s_max``, the round-off level of an SVD.
    """
    if p > 0:
        return s**p
    cutoff = s.amax(dim=-1, keepdim=True) * size * torch.finfo(s.dtype).eps
    return (s > cutoff).to(s.dtype)


def eigh_spectral_power(W: torch.Tensor, p: int, dtype: torch.dtype) -> torch.Tensor:
    """``S_p`` through an eigendecomposition of the small Gram ``G = V diag(s^2) V^T`` in ``dtype``.

    ``S_p = V diag(s^(p-1)) V^T X`` (wide orientation). Squaring the singular values halves the
    precision of the small ones, which ``s^(p-1)`` weights down for ``p >= 1`` but ``1/s`` blows up
    for ``p = 0``: the route is accurate for ``p >= 1`` only (``"auto"`` never picks it for 0).
    """
    _, scale, Xn = normalized_wide(W.to(dtype))
    eigenvalues, V = torch.linalg.eigh(Xn @ Xn.mT)
    s = eigenvalues.clamp_min(0).sqrt()
    if p == 0:
        keep = power_weights(s, 0, max(W.shape[-2:]))
        weights = keep / torch.where(keep > 0, s, 1.0)
    else:
        weights = s ** (p - 1)
    direction = (V * weights[..., None, :]) @ (V.mT @ Xn)
    direction = direction * scale**p
    return direction.mT if is_tall(W) else direction


def svd_spectral_power(W: torch.Tensor, p: int, dtype: torch.dtype) -> torch.Tensor:
    """``S_p`` through a thin SVD computed in ``dtype``."""
    U, s, Vh = torch.linalg.svd(W.to(dtype), full_matrices=False)
    return (U * power_weights(s, p, max(W.shape[-2:]))[..., None, :]) @ Vh


def spectral_norm_bounds(W: torch.Tensor, squarings: int = 3):
    """Cheap per-matrix bounds ``lower <= s_max <= upper``, each of shape ``W.shape[:-2]``.

    ``||G^(2^j)||_F^(1 / 2^(j+1))`` bounds ``s_max`` from above and exceeds it by at most the factor
    ``r^(1 / 2^(j+2))`` (1.3x for r = 4096 after 3 squarings), which gives the lower bound.
    Each square is renormalised so that no power over- or underflows.
    """
    _, scale, Xn = normalized_wide(W)
    M = Xn @ Xn.mT
    log_norm = torch.log(torch.linalg.matrix_norm(M))
    M = M / torch.linalg.matrix_norm(M)[..., None, None].clamp_min(tiny(M.dtype))
    for _ in range(squarings):
        M = M @ M
        norm = torch.linalg.matrix_norm(M)
        log_norm = 2 * log_norm + torch.log(norm)
        M = M / norm[..., None, None].clamp_min(tiny(M.dtype))
    exponent = 1.0 / 2 ** (squarings + 1)
    upper = scale[..., 0, 0] * torch.exp(log_norm * exponent)
    upper = torch.nan_to_num(upper, nan=0.0)
    r = Xn.shape[-2]
    lower = upper / r ** (exponent / 2)
    return lower, upper


def matrix_with_spectrum(shape, singular_values, dtype=torch.float64, device="cpu", seed=0):
    """A ``(..., m, n)`` matrix ``U diag(s) V^T`` with random orthonormal ``U, V``.

    ``singular_values`` has ``min(m, n)`` entries (broadcast over the batch); the matrix is built
    in float64 and rounded to ``dtype`` once. Used by the self-checks, the experiments and the tests.
    """
    generator = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*batch, m, r, generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*batch, n, r, generator=generator, dtype=torch.float64))
    s = torch.as_tensor(singular_values, dtype=torch.float64)
    return ((U * s[..., None, :]) @ V.mT).to(dtype).to(device)


def log_spaced_spectrum(r: int, condition: float) -> torch.Tensor:
    """``r`` singular values log-spaced from 1 down to ``1 / condition``."""
    return torch.logspace(0, -torch.log10(torch.tensor(float(condition))).item(), r, dtype=torch.float64)


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """``||result - reference||_F / ||reference||_F`` in float64 (0 when both are zero)."""
    result, reference = result.double().cpu(), reference.double().cpu()
    scale = torch.linalg.vector_norm(reference)
    difference = torch.linalg.vector_norm(result - reference)
    if scale == 0:
        return float(difference)
    return float(difference / scale)
