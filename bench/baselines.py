"""What a user would otherwise run, measured in the same session as spectral_ops' own ops."""

from __future__ import annotations

import torch

from spectral_ops.coefficients import polar_express_coefficients
from spectral_ops.linalg import compute_dtype, factorised_spectral_power


def svd_route(W: torch.Tensor, p: int, dtype: torch.dtype) -> torch.Tensor:
    """``S_p`` from ``torch.linalg.svd`` in ``dtype``, cast back."""
    return factorised_spectral_power(W, p, dtype, "svd").to(W.dtype)


def eigh_route(W: torch.Tensor, p: int) -> torch.Tensor:
    """``S_p`` from ``torch.linalg.eigh`` of the small Gram."""
    return factorised_spectral_power(W, p, compute_dtype(W.dtype), "eigh").to(W.dtype)


def textbook_polar_express(W: torch.Tensor, coefficients=None) -> torch.Tensor:
    """Polar Express as the paper's pseudo-code, on the full rectangle: no transpose to the wide
    side (a tall input iterates with an ``m x m`` ``X X^T``) and no Gram shared with anything."""
    coefficients = coefficients or polar_express_coefficients()
    X = W.to(compute_dtype(W.dtype))
    X = X / (1.01 * torch.linalg.matrix_norm(X)[..., None, None] + 1e-30)
    for a, b, c in coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.to(W.dtype)


def textbook_spectral_power(W: torch.Tensor, p: int) -> torch.Tensor:
    """``S_p`` from the textbook polar factor and plain matmuls: ``Q (W^T W)^k`` or ``W (W^T W)^k``."""
    X = W.to(compute_dtype(W.dtype))
    result = textbook_polar_express(X) if p % 2 == 0 else X
    gram = X.mT @ X
    for _ in range(p // 2):
        result = result @ gram
    return result.to(W.dtype)


def torch_muon_newton_schulz(W: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (5 bf16 steps of its quintic), matrix by matrix."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _zeropower_via_newtonschulz

    matrices = W.reshape(-1, *W.shape[-2:])
    results = [_zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS)
               for m in matrices]
    return torch.stack(results).reshape(W.shape).to(W.dtype)


def has_torch_muon() -> bool:
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz  # noqa: F401
    except ImportError:
        return False
    return True


TAYLOR_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # Muon's quintic, as DynMuon iterates it


def taylor_power_update(X: torch.Tensor, q: float, steps: int = 12, dtype: torch.dtype = torch.bfloat16):
    """DynMuon's ``U Sigma^q V^T`` (arXiv 2605.17109, as issue #30 describes it): ``(X X^T)^(q/2)`` by
    its second-order Taylor expansion around ``I``, times a ``steps``-step Newton-Schulz polar factor
    (Muon's quintic), on the small side, every product in ``dtype`` with fp32 accumulation.

    ``X`` is scaled to unit mean square singular value, so that ``X X^T``'s spectrum is centred on the
    expansion point (the reading most favourable to the construction; by the Frobenius norm, as the
    Newton-Schulz iteration is scaled, its eigenvalues would all be near 0). Per matrix of a stack."""
    wide = X.shape[-2] <= X.shape[-1]
    Y = (X if wide else X.mT).to(dtype)
    r = Y.shape[-2]
    norm = torch.linalg.vector_norm(Y.float(), dim=(-2, -1), keepdim=True).clamp_min(1e-30)
    identity = torch.eye(r, dtype=dtype)
    E = (Y * (r**0.5 / norm).to(dtype)) @ (Y * (r**0.5 / norm).to(dtype)).mT - identity
    h = q / 2
    taylor = identity + h * E + (h * (h - 1) / 2) * (E @ E)
    a, b, c = TAYLOR_NEWTON_SCHULZ
    polar = Y / (norm.to(dtype) + 1e-7)
    for _ in range(steps):
        A = polar @ polar.mT
        polar = a * polar + (b * A + c * (A @ A)) @ polar
    update = taylor @ polar
    return update if wide else update.mT
