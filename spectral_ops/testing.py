"""Test inputs with a known spectrum, and the error measure used against references.

Shared by the test suite, the dispatcher's self-check and ``bench/gpu_check.py``.
"""

from __future__ import annotations

import torch


def matrix_with_spectrum(shape, singular_values, dtype=torch.float64, device="cpu", seed=0):
    """A ``(..., m, n)`` matrix ``U diag(s) V^T`` with random orthonormal ``U, V``.

    ``singular_values`` has ``min(m, n)`` entries (broadcast over the batch); the matrix is built
    in float64 and rounded to ``dtype`` once.
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
