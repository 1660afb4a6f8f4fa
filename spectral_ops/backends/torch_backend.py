"""PyTorch backend: every op, on any device and float dtype, composed from plain matmuls.

It is the CPU backend, the fallback on GPUs, and the reference the Triton and CUDA kernels are
checked against. Precision policy: float64 computes in float64; float32, float16 and bfloat16
compute (accumulate and normalise) in float32 and are rounded to their own dtype once, at the end.

Everything works in the *wide* orientation ``X`` (``r x big``, ``r = min(m, n)``): a tall ``W`` is
transposed (a view, no copy), so the Gram ``X X^T`` is always the small ``r x r`` side and every
spectral factor multiplies ``X`` from the left. ``S_p(W^T) = S_p(W)^T`` turns results back.
"""

from __future__ import annotations

import torch

from ..coefficients import NORMALIZATION_MARGIN
from .base import BandSpec, DecayRequest, repeated_squaring


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tiny(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny


def polar_iterations(X: torch.Tensor, coefficients, first_gram: torch.Tensor | None = None):
    """Apply ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` for each ``(a, b, c)``.

    For a symmetric ``X`` this is the matrix-sign iteration too, since then ``X X^T = X^2``.
    ``first_gram`` lets a caller that already holds ``X X^T`` skip the first product.
    """
    for step, (a, b, c) in enumerate(coefficients):
        A = first_gram if step == 0 and first_gram is not None else X @ X.mT
        B = (A @ A).mul_(c).add_(A, alpha=b)
        X = torch.add(B @ X, X, alpha=a)
    return X


def sign_iterations(A: torch.Tensor, coefficients) -> torch.Tensor:
    """Matrix sign of symmetric ``A`` (SPEC 1.4): normalise by ``||A||_F``, then iterate."""
    norm = torch.linalg.matrix_norm(A)[..., None, None]
    return polar_iterations(A / (norm + _tiny(A.dtype)), coefficients)


class GramPlan:
    """Shared intermediate results for every spectral function of one (batch of) matrix.

    Holds the wide matrix ``X``, its unit-Frobenius copy ``Xn = X / c`` (``c = ||W||_F``), and computes lazily,
    once each: the Gram ``Gn = Xn Xn^T`` (also the first Polar Express step's ``A``, up to the
    constant margin), the polar factor ``Q`` and the powers ``Gn^k`` by repeated squaring.
    Working at unit norm keeps ``Gn^k`` in range; the scale ``c^p`` is applied once at the end.
    """

    def __init__(self, W: torch.Tensor):
        self.transposed = W.shape[-2] >= W.shape[-1]
        self.X = (W.mT if self.transposed else W).to(compute_dtype(W.dtype))
        self.scale = torch.linalg.matrix_norm(self.X)[..., None, None]
        self.Xn = self.X / (self.scale + _tiny(self.X.dtype))
        self._gram_squares: dict[int, torch.Tensor] = {}
        self._polar = None

    @property
    def gram(self) -> torch.Tensor:
        if 1 not in self._gram_squares:
            self._gram_squares[1] = self.Xn @ self.Xn.mT
        return self._gram_squares[1]

    def identity(self) -> torch.Tensor:
        r = self.Xn.shape[-2]
        return torch.eye(r, dtype=self.Xn.dtype, device=self.Xn.device)

    def _gram_square(self, exponent: int) -> torch.Tensor:
        """``Gn^exponent`` for a power of two, each square computed at most once."""
        if exponent == 1:
            return self.gram
        if exponent not in self._gram_squares:
            half = self._gram_square(exponent // 2)
            self._gram_squares[exponent] = half @ half
        return self._gram_squares[exponent]

    def gram_power(self, k: int) -> torch.Tensor:
        """``Gn^k`` by repeated squaring: the product of the squares its binary digits select."""
        return repeated_squaring(k, self._gram_square, torch.matmul)

    def polar(self, coefficients) -> torch.Tensor:
        """Polar Express ``Q = U V^T`` (wide orientation), sharing the Gram with step one."""
        if self._polar is None:
            shrink = 1.0 / NORMALIZATION_MARGIN
            self._polar = polar_iterations(self.Xn * shrink, coefficients, self.gram * shrink**2)
        return self._polar

    def power(self, p: int, coefficients) -> torch.Tensor:
        """``S_p`` (wide orientation, SPEC 1.2): ``Gn^k Q`` for ``p = 2k``, ``Gn^k Xn`` for ``2k+1``."""
        if p == 1:
            return self.X
        base = self.polar(coefficients) if p % 2 == 0 else self.Xn
        k = p // 2
        direction = base if k == 0 else self.gram_power(k) @ base
        return direction if p == 0 else direction * self.scale**p

    def top_projector(self, tau, sign_coefficients) -> torch.Tensor:
        """``P_top = (I + msign(G - tau^2 I)) / 2`` on the small side, in unit-norm units."""
        nonzero = self.scale > 0
        ratio_sq = torch.where(nonzero, (tau / torch.where(nonzero, self.scale, 1.0)) ** 2, 1.0)
        J = sign_iterations(self.gram - ratio_sq * self.identity(), sign_coefficients)
        return (J + self.identity()) * 0.5

    def oriented(self, S: torch.Tensor) -> torch.Tensor:
        return S.mT if self.transposed else S


def band_combination(plan: GramPlan, p: int, band: BandSpec, polar_coefficients, sign_coefficients):
    """A band-selective direction (SPEC 1.4) with one rectangular product by ``P_top``.

    ``P_bot = I - P_top`` and ``P_top`` commutes with every ``S_p``, so e.g.
    ``P_top S_p + P_bot X = X + P_top (S_p - X)``.
    """
    P_top = plan.top_projector(band.tau, sign_coefficients)
    S_top = plan.power(p, polar_coefficients)
    if band.mode == "top":
        X = plan.X
        return X + P_top @ (S_top - X)
    if band.mode == "bot":
        X = plan.X
        return S_top + P_top @ (X - S_top)
    if band.mode == "top_only":
        return P_top @ S_top
    if band.mode == "bot_only":
        return S_top - P_top @ S_top
    S_bot = plan.power(band.p_bot, polar_coefficients) * band.lambda_bot
    return S_bot + P_top @ (S_top * band.lambda_top - S_bot)


def spectral_norm_bounds(W: torch.Tensor, squarings: int = 3):
    """Cheap per-matrix bounds ``lower <= s_max <= upper``, each of shape ``W.shape[:-2]``.

    ``||G^(2^j)||_F^(1 / 2^(j+1))`` bounds ``s_max`` from above and exceeds it by at most the factor
    ``r^(1 / 2^(j+2))`` (1.3x for r = 4096 after 3 squarings), which gives the lower bound.
    Each square is renormalised so that no power over- or underflows.
    """
    plan = GramPlan(W)
    M = plan.gram
    log_norm = torch.log(torch.linalg.matrix_norm(M))
    M = M / torch.linalg.matrix_norm(M)[..., None, None].clamp_min(_tiny(M.dtype))
    for _ in range(squarings):
        M = M @ M
        norm = torch.linalg.matrix_norm(M)
        log_norm = 2 * log_norm + torch.log(norm)
        M = M / norm[..., None, None].clamp_min(_tiny(M.dtype))
    exponent = 1.0 / 2 ** (squarings + 1)
    upper = plan.scale[..., 0, 0] * torch.exp(log_norm * exponent)
    upper = torch.nan_to_num(upper, nan=0.0)
    r = plan.Xn.shape[-2]
    lower = upper / r ** (exponent / 2)
    return lower, upper


def _decayed(plan: GramPlan, request: DecayRequest) -> torch.Tensor:
    """The post-update weights (wide orientation) for a :class:`DecayRequest`."""
    X = plan.X
    spectral, ordinary = request.spectral_scale, request.ordinary_scale
    if request.p == 0 and request.p0_mode == "prox" and request.band is None:
        prox = svt_from_plan(plan, spectral, request.polar_coefficients, request.sign_coefficients)
        return prox - ordinary * X
    if request.p == 1 and request.band is None:
        return X * (1.0 - ordinary - spectral)
    if request.band is not None:
        direction = band_combination(
            plan, request.p, request.band, request.polar_coefficients, request.sign_coefficients
        )
    else:
        direction = plan.power(request.p, request.polar_coefficients)
    return X * (1.0 - ordinary) - spectral * direction


def svt_from_plan(plan: GramPlan, t, polar_coefficients, sign_coefficients) -> torch.Tensor:
    """``prox_{t ||.||_*}(W) = P_top(t) (X - t Q)`` in the wide orientation (SPEC 1.4)."""
    P_top = plan.top_projector(t, sign_coefficients)
    return P_top @ (plan.X - t * plan.polar(polar_coefficients))


class TorchBackend:
    """The reference implementation of every backend op."""

    name = "torch"
    needs_self_check = False

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        return None

    def supports(self, op: str, W: torch.Tensor) -> bool:
        return True

    def polar(self, W, coefficients):
        plan = GramPlan(W)
        return plan.oriented(plan.polar(coefficients)).to(W.dtype)

    def msign(self, A, coefficients):
        return sign_iterations(A.to(compute_dtype(A.dtype)), coefficients).to(A.dtype)

    def spectral_power(self, W, p, coefficients):
        if p == 1:
            return W.clone()  # S_1(W) = W, and the result must never alias the input
        plan = GramPlan(W)
        return plan.oriented(plan.power(p, coefficients)).to(W.dtype)

    def band_projectors(self, W, tau, sign_coefficients):
        plan = GramPlan(W)
        P_top = plan.top_projector(tau, sign_coefficients)
        return P_top.to(W.dtype), (plan.identity() - P_top).to(W.dtype)

    def band_direction(self, W, p, band: BandSpec, polar_coefficients, sign_coefficients):
        plan = GramPlan(W)
        direction = band_combination(plan, p, band, polar_coefficients, sign_coefficients)
        return plan.oriented(direction).to(W.dtype)

    def svt(self, W, t, polar_coefficients, sign_coefficients):
        plan = GramPlan(W)
        return plan.oriented(svt_from_plan(plan, t, polar_coefficients, sign_coefficients)).to(W.dtype)

    def decay_(self, W, request: DecayRequest):
        """Write the decayed weights into ``W`` (any layout) in one copy, after all the math."""
        plan = GramPlan(W)
        W.copy_(plan.oriented(_decayed(plan, request)))
        return W


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
    plan = GramPlan(W.to(dtype))
    eigenvalues, V = torch.linalg.eigh(plan.gram)
    s = eigenvalues.clamp_min(0).sqrt()
    if p == 0:
        keep = power_weights(s, 0, max(W.shape[-2:]))
        weights = keep / torch.where(keep > 0, s, 1.0)
    else:
        weights = s ** (p - 1)
    direction = (V * weights[..., None, :]) @ (V.mT @ plan.Xn)
    return plan.oriented(direction * plan.scale**p)


def svd_spectral_power(W: torch.Tensor, p: int, dtype: torch.dtype) -> torch.Tensor:
    """``S_p`` through a thin SVD computed in ``dtype``."""
    U, s, Vh = torch.linalg.svd(W.to(dtype), full_matrices=False)
    return (U * power_weights(s, p, max(W.shape[-2:]))[..., None, :]) @ Vh
