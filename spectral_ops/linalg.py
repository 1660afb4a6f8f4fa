"""Linear algebra that is not a backend: compute dtypes, the wide orientation, the SVD and eigh routes,
test spectra and the error measure.

Plain torch throughout. :mod:`spectral_ops.plan` builds on the orientation helpers here; the
routes here are the ones that need a factorisation, which no backend provides.
"""

from __future__ import annotations

import math

import torch


def compute_dtype(dtype: torch.dtype, precision: str | None = None) -> torch.dtype:
    """The dtype of the arithmetic around the products (the normalisation, the scales, the decay):
    float64 for float64 weights or ``precision="fp64"``; float32 for float32, float16 and bfloat16."""
    return torch.float64 if dtype == torch.float64 or precision == "fp64" else torch.float32


def is_tall(W: torch.Tensor) -> bool:
    """Square matrices count as tall: their Gram is ``W^T W`` and their projectors act on the right."""
    return W.shape[-2] >= W.shape[-1]


def wide(W: torch.Tensor) -> torch.Tensor:
    """The wide ``r x N`` view of ``W`` (``r = min(m, n)``): ``W^T`` for a tall weight, no copy.

    In the wide orientation the Gram ``X X^T`` is the small side and every spectral factor multiplies
    ``X`` from the left; ``S_p(W^T) = S_p(W)^T`` turns results back.
    """
    return W.mT if is_tall(W) else W


def largest_magnitudes(A: torch.Tensor) -> torch.Tensor:
    """``max |A|`` per matrix, ``(..., 1, 1)`` (NaN where a matrix holds one), in one pass where it can:
    ``aminmax`` over one matrix laid out as a block (or its transpose, the wide view of a tall weight)
    reads it once, where ``amax`` and ``amin`` over two dimensions read it twice."""
    if A.dim() == 2:
        block = A if A.is_contiguous() else A.mT if A.mT.is_contiguous() else None
        if block is not None:
            low, high = torch.aminmax(block.view(-1))
            return torch.maximum(high, -low).view(1, 1)
    dims = (-2, -1)
    return torch.maximum(A.amax(dim=dims, keepdim=True), -A.amin(dim=dims, keepdim=True))


def frobenius_normalized(A: torch.Tensor, in_place: bool = False):
    """``(A / ||A||_F, ln ||A||_F)`` per matrix, exact in range for every finite ``A``; ``in_place``
    divides ``A`` itself (the same numbers, without a full-size temporary).

    ``A`` is first divided by the power of two ``2^e`` just below its largest magnitude (as LAPACK's
    ``nrm2`` scales): the squares of the raw entries overflow from ~1e19 in float32 and underflow
    below ~1e-19, where ``||A||_F`` itself is fine. Dividing by a power of two is exact, so the
    result is the once-rounded ``A / ||A||_F`` wherever that exists. The log norm is float64
    (``(..., 1, 1)``), so that ``||A||_F^p`` never has to exist as a number; a zero matrix gives
    zeros and ``-inf``.
    """
    dims = (-2, -1)
    largest = largest_magnitudes(A)
    # frexp's exponent e puts the largest magnitude in [2^(e-1), 2^e); 2^(e-1) is representable for
    # every finite one (2^e is not at the top of the range).
    exponent = torch.frexp(largest).exponent - 1
    power = torch.exp2(exponent.to(A.dtype))
    normalized = A.div_(power) if in_place else A / power
    rest = torch.linalg.vector_norm(normalized, dim=dims, keepdim=True)
    normalized.div_(torch.where(rest > 0, rest, 1.0))
    return normalized, exponent.double() * math.log(2) + rest.double().log()


def normalized_wide(W: torch.Tensor, dtype: torch.dtype | None = None):
    """``(X, c, Xn)``: the wide ``X`` in ``dtype`` (default: the compute dtype), ``c = ||X||_F``
    (``(..., 1, 1)``, inf where it exceeds ``dtype``) and ``Xn = X / c`` (zero for a zero matrix,
    right whatever ``c``). Working at unit norm keeps every power of the Gram in range."""
    X = wide(W).to(dtype or compute_dtype(W.dtype))
    Xn, log_scale = frobenius_normalized(X)
    return X, log_scale.exp().to(X.dtype), Xn


def scaled_(D: torch.Tensor, log_factor: torch.Tensor) -> torch.Tensor:
    """``D * exp(log_factor)`` in place, for a ``D`` with entries of at most about 1 (a direction at unit
    norm). The factor (``||W||_F^p``) may overflow or underflow where the product does not, so the part
    of it beyond the dtype's range, exactly 1 when there is none, is applied in a second multiply."""
    info = torch.finfo(D.dtype)
    headroom = math.log(16.0)  # D's entries reach a little over 1 (a polar factor's overshoot)
    in_range = log_factor.clamp(math.log(info.tiny) + headroom, math.log(info.max) - headroom)
    return D.mul_(in_range.exp().to(D.dtype)).mul_((log_factor - in_range).exp().to(D.dtype))


def as_float64(value, device) -> torch.Tensor:
    """A Python number or tensor as a float64 tensor on ``device``; a number by a fill, which CUDA graph
    capture allows (a copy from the host it does not)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


def ratio(value, log_scale: torch.Tensor, most: float, dtype: torch.dtype) -> torch.Tensor:
    """``min(value / exp(log_scale), most)`` in ``dtype``, for a threshold ``value`` against a norm
    held as a log: the quotient of two in-range numbers can overflow (``1e30 / 1e-30`` in float32)."""
    log_value = as_float64(value, log_scale.device).log()
    return (log_value - log_scale).clamp(max=math.log(most)).exp().to(dtype)


def zero_mode_cutoff(size: int, dtype: torch.dtype) -> float:
    """Which modes count as exactly zero, defined once: those at or below this fraction of ``s_max``,
    ``size * eps`` of the dtype the modes are computed in (``size = max(m, n)``). That is the round-off
    level of an SVD in that dtype (numpy's ``matrix_rank`` rule): a rank-deficient matrix's zero modes
    come out of a factorisation (or an iteration) at a few ``eps s_max``, not at 0, so the ``eps`` is
    the factorisation's (float32 for a float32 SVD), never that of a dtype the values are cast to later."""
    return size * torch.finfo(dtype).eps


def power_weights(s: torch.Tensor, p: int, size: int) -> torch.Tensor:
    """``s^p`` per mode, where ``p = 0`` gives 1 on the non-zero modes only (:func:`zero_mode_cutoff`
    in ``s``'s dtype: pass the singular values as the factorisation returned them)."""
    if p > 0:
        return s**p
    cutoff = s.amax(dim=-1, keepdim=True) * zero_mode_cutoff(size, s.dtype)
    return (s > cutoff).to(s.dtype)


def relative_powers(s: torch.Tensor, p, size: int):
    """``(weights, ln s_max)``: each mode's ``s^p`` relative to the largest's, ``(s / s_max)^p`` (float64;
    ``p = 0``: :func:`power_weights`, 1 on the non-zero modes), and ``ln s_max`` (``(..., 1)``; ``-inf`` for
    a zero matrix, whose weights are 0), which gives the scale ``s_max^p``. ``s^p`` itself can leave the
    range where the result does not: a unit-norm matrix's ``s_max`` is down to ``r^(-1/2)``, and its
    ``s^p`` underflows float32 from ``p ~ 50`` at ``r = 64`` (float64 from ``p ~ 360``)."""
    top = s.double().amax(-1, keepdim=True)
    if p == 0:
        return power_weights(s, 0, size).double(), top.log()
    return (s.double() / top.clamp_min(torch.finfo(torch.float64).tiny)) ** p, top.log()


class SpectralFactors:
    """The singular values ``s`` (``(..., r)``) of a wide unit-norm ``Xn`` and its small side's singular
    vectors ``U``, from a thin SVD (``method="svd"``) or an eigendecomposition of the Gram
    ``Xn Xn^T = U diag(s^2) U^T`` (``"eigh"``).

    Any spectral form is then a function of ``s`` applied mode by mode (:meth:`modes`). ``eigh``
    squares the singular values, which halves the precision of the small ones: ``V^T = diag(1/s) U^T Xn``
    amplifies that for a weight that does not vanish with ``s`` (``p = 0``), so ``eigh`` is accurate
    for forms whose every mode's weight is at most about ``s`` (``p >= 1``).
    """

    def __init__(self, Xn: torch.Tensor, method: str):
        self.method, self.Xn = method, Xn
        if method == "svd":
            # Of the tall transpose: LAPACK takes 1.3-1.5x longer on the wide orientation (measured at
            # 256 x 128 to 1024 x 512, MKL, AVX-512).
            left, self.s, right = torch.linalg.svd(Xn.mT, full_matrices=False)
            self.vectors, self._Vh = right.mT, left.mT
        else:
            eigenvalues, self.vectors = torch.linalg.eigh(Xn @ Xn.mT)
            self.s = eigenvalues.clamp_min(0).sqrt()

    def modes(self, weights: torch.Tensor) -> torch.Tensor:
        """``U diag(weights) V^T`` (wide, ``Xn``'s dtype) for per-mode ``weights`` (``(..., r)``, any
        float dtype: float64 keeps a weight that the result's dtype holds only after the product)."""
        if self.method == "svd":
            return (self.vectors * weights.to(self.Xn.dtype)[..., None, :]) @ self._Vh
        s = self.s.to(weights.dtype)
        per_unit = (weights / torch.where(s > 0, s, 1.0)).to(self.Xn.dtype)
        return (self.vectors * per_unit[..., None, :]) @ (self.vectors.mT @ self.Xn)

    def projector(self, weights: torch.Tensor) -> torch.Tensor:
        """``U diag(weights) U^T`` on the small side (``Xn``'s dtype)."""
        return (self.vectors * weights.to(self.Xn.dtype)[..., None, :]) @ self.vectors.mT


def factorised_spectral_power(W: torch.Tensor, p: int, dtype: torch.dtype, method: str) -> torch.Tensor:
    """``S_p`` from :class:`SpectralFactors` of ``W`` in ``dtype`` (``"svd"`` or ``"eigh"``): ``s^p`` at
    unit norm, the scale ``||W||_F^p`` applied last (it can overflow where the result does not)."""
    Xn, log_scale = frobenius_normalized(wide(W).to(dtype))
    factors = SpectralFactors(Xn, method)
    weights, log_top = relative_powers(factors.s, p, max(W.shape[-2:]))
    log_factor = p * (log_scale + log_top[..., None]) if p else torch.zeros_like(log_scale)  # 0 * ln 0 is NaN
    direction = scaled_(factors.modes(weights), log_factor)
    return direction.mT if is_tall(W) else direction


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
