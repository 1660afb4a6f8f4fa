"""FP64 SVD oracles for every public op: the ground truth the tests compare against.

Each function takes the same arguments as its SVD-free counterpart, computes in float64 from a
thin SVD (or ``eigh`` for symmetric matrices) and returns float64. Zero singular values
(below ``max(m, n) * eps * s_max``) contribute nothing, also for ``p = 0``.
"""

from __future__ import annotations

import torch

from .linalg import factorised_spectral_power, power_weights


def _svd(W):
    return torch.linalg.svd(W.to(torch.float64), full_matrices=False)


def spectral_power_svd(W: torch.Tensor, p, eps=None) -> torch.Tensor:
    """``U diag(s^p) V^T``; with the floor ``eps`` (relative to ``s_max``, per matrix),
    ``U diag((s^2 + (eps s_max)^2)^(p/2)) V^T`` over the non-zero modes."""
    if eps is None:
        return factorised_spectral_power(W, p, torch.float64, "svd")
    size = max(W.shape[-2:])
    return _per_mode(W, lambda s: power_weights(s, 0, size) * (s**2 + (eps * s.amax(-1, keepdim=True)) ** 2) ** (p / 2))


def power_update_svd(X: torch.Tensor, q, eps) -> torch.Tensor:
    """The Muon-family update ``power_update(X, q, eps=eps)``: the polar factor for ``q = 0``, else
    ``spectral_power_svd(X, q, eps)`` scaled to the Frobenius norm ``sqrt(min(m, n))`` per matrix."""
    if q == 0:
        return polar_svd(X)
    D = spectral_power_svd(X, q, eps)
    return D * min(X.shape[-2:]) ** 0.5 / torch.linalg.vector_norm(D, dim=(-2, -1), keepdim=True)


def polar_svd(W: torch.Tensor) -> torch.Tensor:
    """``U V^T`` over the non-zero modes."""
    return spectral_power_svd(W, 0)


def msign_eigh(A: torch.Tensor) -> torch.Tensor:
    """``Z diag(sign(xi)) Z^T`` of a symmetric matrix."""
    xi, Z = torch.linalg.eigh(A.to(torch.float64))
    return (Z * torch.sign(xi)[..., None, :]) @ Z.mT


def _small_side_vectors(W):
    """Singular values and the small side's singular vectors (V for m >= n, U for m < n)."""
    U, s, Vh = _svd(W)
    tall = W.shape[-2] >= W.shape[-1]
    return s, (Vh.mT if tall else U)


def band_projectors_svd(W: torch.Tensor, tau):
    """``(P_top, P_bot)`` on the small side, from the singular vectors with ``s > tau`` / ``s <= tau``."""
    s, vectors = _small_side_vectors(W)
    top = (s > tau).to(torch.float64)
    P_top = (vectors * top[..., None, :]) @ vectors.mT
    identity = torch.eye(vectors.shape[-1], dtype=torch.float64, device=W.device)
    return P_top, identity - P_top


def _per_mode(W, weights_from_s):
    U, s, Vh = _svd(W)
    return (U * weights_from_s(s)[..., None, :]) @ Vh


def band_direction_svd(W, tau, p, mode="top", *, p_bot=1, lambda_top=1.0, lambda_bot=1.0):
    """The band-selective direction of SPEC 1.4, mode by mode."""

    def powered(s, q):
        return power_weights(s, q, max(W.shape[-2:]))

    def weights(s):
        top = (s > tau).double()
        bot = 1.0 - top
        rules = {
            "top": powered(s, p) * top + s * bot,
            "bot": s * top + powered(s, p) * bot,
            "top_only": powered(s, p) * top,
            "bot_only": powered(s, p) * bot,
            "two_band": lambda_top * powered(s, p) * top + lambda_bot * powered(s, p_bot) * bot,
            "clip": (s - tau).clamp_min(0),
        }
        return rules[mode]

    return _per_mode(W, weights)


def svt_svd(W: torch.Tensor, t) -> torch.Tensor:
    """``U (S - t)_+ V^T``."""
    return _per_mode(W, lambda s: (s - t).clamp_min(0))


def spectral_clip_svd(W: torch.Tensor, low=None, high=None) -> torch.Tensor:
    """``U diag(clamp(s, low, high)) V^T``, modes with ``s = 0`` (below an SVD's round-off) left at 0."""
    def clipped(s):
        nonzero = power_weights(s, 0, max(W.shape[-2:])) > 0
        return torch.where(nonzero, s.clamp(min=low, max=high), s)
    return _per_mode(W, clipped)


def spectral_decay_svd(W, p, scale, weight_decay, ordinary_weight_decay=0.0, p0_mode="explicit"):
    """The out-of-place decay step ``W - scale * (wd * S_p(W) + wd_1 * W)`` (prox: SVT at scale * wd)."""
    W64 = W.to(torch.float64)
    if p == 0 and p0_mode == "prox":
        spectral = svt_svd(W64, scale * weight_decay)
    else:
        spectral = W64 - scale * weight_decay * spectral_power_svd(W64, p)
    return spectral - scale * ordinary_weight_decay * W64
