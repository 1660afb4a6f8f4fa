"""The algorithm, written once: every op as a sequence of primitive calls.

Each function takes ``kernels``, the object dispatch hands out for one op call
(:func:`spectral_ops.dispatch.kernels_for`): it has one method per primitive of
:mod:`spectral_ops.backends.base` and routes every call to a backend. The plan never chooses a
backend and never imports dispatch; it only asks whether a fused small chain is available
(``kernels.small_chain`` returns None when none is).

The shape of the computation (SPEC 1.2-1.4):

* Everything runs in the *wide* orientation ``X`` (``r x N``, ``r = min(m, n)``; a tall weight is
  transposed as a view), so the Gram ``X X^T`` is the small side and every spectral factor multiplies
  ``X`` from the left.
* ``X`` is scaled to unit Frobenius norm once (``Xn = X / c``): the Gram ``Gn = Xn Xn^T`` and its powers
  stay in range, and the scale ``c^p`` is applied once at the end. ``Gn`` doubles as the first Polar
  Express step's ``A`` (up to the constant margin).
* ``S_p = c^p Gn^k Q`` for ``p = 2k`` and ``c^p Gn^k Xn`` for ``p = 2k + 1``, with ``Gn^k`` by repeated
  squaring; every product of polynomials in ``Gn`` is symmetric. Band forms need one rectangular product
  by ``P_top``. A decay computes its direction ``D`` and writes ``W <- keep W + step D`` once.
* Small matrices take a backend's fused chain where one exists: the whole op in one launch per matrix.

**Precision** (:func:`resolve_precision`) decides the dtype of the iteration's operands: every
product takes them in that dtype, accumulates in fp32 (fp64 for ``"fp64"``) and rounds its result to
it, as torch.optim.Muon's bf16 iteration does. The normalisation, the scale ``c^p``, the band
thresholds and the decay arithmetic stay in the math dtype (fp64 for fp64 weights or ``"fp64"``,
fp32 otherwise), and the result is rounded to the weight's dtype once.
"""

from __future__ import annotations

import torch

from ._compile import constant_when_traced
from .backends.base import BandSpec, DecayRequest
from .coefficients import NORMALIZATION_MARGIN
from .linalg import is_tall, normalized_wide, tiny, wide

OPS = ("polar", "msign", "spectral_power", "band_projectors", "band_direction", "svt", "decay_")
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")
OPERAND_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                  "fp16": torch.float16}
# torch.set_float32_matmul_precision's settings, read as precisions for float32 weights.
FLOAT32_MATMUL_PRECISIONS = {"highest": "fp32", "high": "tf32", "medium": "bf16"}


def resolve_precision(precision: str | None, dtype: torch.dtype) -> str:
    """``precision=None``, defined once: follow the weight's dtype, and for float32 weights torch's own
    ``torch.get_float32_matmul_precision()`` (``"highest"``: fp32, ``"high"``: tf32, ``"medium"``: bf16)."""
    if precision is not None:
        return precision
    if dtype == torch.float64:
        return "fp64"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return _float32_precision()


@constant_when_traced
def _float32_precision() -> str:
    """torch's float32 matmul setting as a precision. Under torch.compile it is read once, when a
    graph is traced (as Inductor reads it), since reading it is not traceable."""
    try:
        return FLOAT32_MATMUL_PRECISIONS[torch.get_float32_matmul_precision()]
    except RuntimeError:  # the per-backend API (torch.backends.cuda.matmul.fp32_precision) is in use
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"


def math_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    """The dtype of the normalisation, the scales and the decay arithmetic."""
    return torch.float64 if dtype == torch.float64 or precision == "fp64" else torch.float32


def repeated_squaring(k: int, square, multiply):
    """``G^k`` as the product of the squares ``square(2^j) = G^(2^j)`` its binary digits select.

    ``square`` caches the squares (each computed at most once); ``multiply`` is the product of two
    commuting symmetric factors.
    """
    result, exponent = None, 1
    while k:
        if k & 1:
            factor = square(exponent)
            result = factor if result is None else multiply(result, factor)
        k >>= 1
        exponent <<= 1
    return result


def polar_iterations(kernels, X: torch.Tensor, coefficients, precision: str,
                     first_gram: torch.Tensor | None = None):
    """Apply ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` for each ``(a, b, c)``.

    ``first_gram`` lets a caller that already holds ``X X^T`` skip the first product.
    """
    for step, (a, b, c) in enumerate(coefficients):
        A = first_gram if step == 0 and first_gram is not None else kernels.symmetric(X, X.mT, precision)
        X = kernels.product(kernels.poly_step(A, b, c, precision), X, precision, Y=X, alpha=a)
    return X


def matrix_sign(kernels, A: torch.Tensor, coefficients, precision: str) -> torch.Tensor:
    """``msign`` of a symmetric ``A`` (SPEC 1.4): normalise by ``||A||_F``, then one sign step per triple.

    ``A`` is in the math dtype; the result is in the operand dtype of ``precision``.
    """
    chained = kernels.small_chain(A, 0, coefficients, precision, sign=True)
    if chained is not None:
        return chained.to(OPERAND_DTYPES[precision])
    norm = torch.linalg.matrix_norm(A)[..., None, None]
    Z = (A / (norm + tiny(A.dtype))).to(OPERAND_DTYPES[precision])
    for coefficient in coefficients:
        Z = kernels.sign_step(Z, coefficient, precision)
    return Z


class GramPlan:
    """The intermediate results of one (batch of) matrix, each computed lazily and at most once:
    ``X``, ``c = ||X||_F``, ``Xn`` (math dtype), the operand ``Xo`` (``Xn`` in the operand dtype), the
    Gram ``Gn`` and its squares, and the polar factor ``Q`` (operand dtype)."""

    def __init__(self, W: torch.Tensor, kernels, precision: str):
        self.kernels = kernels
        self.precision = precision
        self.transposed = is_tall(W)
        self.X, self.scale, self.Xn = normalized_wide(W, math_dtype(W.dtype, precision))
        self.Xo = self.Xn.to(OPERAND_DTYPES[precision])
        self._gram_squares: dict[int, torch.Tensor] = {}
        self._polar = None

    def symmetric(self, L, R):
        return self.kernels.symmetric(L, R, self.precision)

    def product(self, M, Z, **epilogue):
        return self.kernels.product(M, Z, self.precision, **epilogue)

    @property
    def gram(self) -> torch.Tensor:
        if 1 not in self._gram_squares:
            self._gram_squares[1] = self.symmetric(self.Xo, self.Xo.mT)
        return self._gram_squares[1]

    def identity(self) -> torch.Tensor:
        r = self.Xn.shape[-2]
        return torch.eye(r, dtype=self.Xn.dtype, device=self.Xn.device)

    def _gram_square(self, exponent: int) -> torch.Tensor:
        """``Gn^exponent`` for a power of two."""
        if exponent == 1:
            return self.gram
        if exponent not in self._gram_squares:
            half = self._gram_square(exponent // 2)
            self._gram_squares[exponent] = self.symmetric(half, half)
        return self._gram_squares[exponent]

    def gram_power(self, k: int) -> torch.Tensor:
        return repeated_squaring(k, self._gram_square, self.symmetric)

    def polar(self, coefficients) -> torch.Tensor:
        """Polar Express ``Q = U V^T`` (wide), from ``X0 = Xn / 1.01``, sharing the Gram with step one."""
        if self._polar is None:
            shrink = 1.0 / NORMALIZATION_MARGIN
            self._polar = polar_iterations(self.kernels, self.Xo * shrink, coefficients, self.precision,
                                           self.gram * shrink**2)
        return self._polar

    def power(self, p: int, coefficients) -> torch.Tensor:
        """``S_p`` (wide, math dtype): ``c^p Gn^k Q`` for ``p = 2k``, ``c^p Gn^k Xn`` for ``2k + 1``."""
        if p == 1:
            return self.X
        base = self.polar(coefficients) if p % 2 == 0 else self.Xo
        k = p // 2
        direction = (base if k == 0 else self.product(self.gram_power(k), base)).to(self.Xn.dtype)
        return direction if p == 0 else direction * self.scale**p

    def top_projector(self, tau, sign_coefficients) -> torch.Tensor:
        """``P_top = (I + msign(Gn - (tau / c)^2 I)) / 2`` on the small side (math dtype)."""
        nonzero = self.scale > 0
        ratio_sq = torch.where(nonzero, (tau / torch.where(nonzero, self.scale, 1.0)) ** 2, 1.0)
        shifted = self.gram.to(self.Xn.dtype) - ratio_sq * self.identity()
        J = matrix_sign(self.kernels, shifted, sign_coefficients, self.precision).to(self.Xn.dtype)
        return (J + self.identity()) * 0.5

    def band(self, p: int, band: BandSpec, polar_coefficients, sign_coefficients) -> torch.Tensor:
        """A band-selective direction (SPEC 1.4) with one rectangular product by ``P_top``.

        ``P_bot = I - P_top`` and ``P_top`` commutes with every ``S_p``, so e.g.
        ``P_top S_p + P_bot X = X + P_top (S_p - X)``.
        """
        P_top = self.top_projector(band.tau, sign_coefficients)
        S_top = self.power(p, polar_coefficients)
        product, X = self._final_product, self.X
        if band.mode == "top":
            return product(P_top, S_top - X, Y=X)
        if band.mode == "bot":
            return product(P_top, X - S_top, Y=S_top)
        if band.mode == "top_only":
            return product(P_top, S_top)
        if band.mode == "bot_only":
            return product(P_top, S_top, beta=-1.0, Y=S_top)
        S_bot = self.power(band.p_bot, polar_coefficients) * band.lambda_bot
        return product(P_top, S_top * band.lambda_top - S_bot, Y=S_bot)

    def svt(self, t, polar_coefficients, sign_coefficients) -> torch.Tensor:
        """``prox_{t ||.||_*}(W) = P_top(t) (X - t Q)`` (SPEC 1.4)."""
        P_top = self.top_projector(t, sign_coefficients)
        return self._final_product(P_top, self.X - t * self.polar(polar_coefficients).to(self.Xn.dtype))

    def _final_product(self, M, Z, **epilogue):
        """The one rectangular product of a band form, on unscaled weights: in the math dtype, whose
        range the scale ``c^p`` needs, at fp32 accuracy (fp64 for fp64)."""
        exact = "fp64" if self.Xn.dtype == torch.float64 else "fp32"
        return self.kernels.product(M, Z, exact, **epilogue)

    def oriented(self, S: torch.Tensor) -> torch.Tensor:
        return S.mT if self.transposed else S


def _unwide(W: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    return S.mT if is_tall(W) else S


# ----- the ops: (validated) inputs in, a new tensor of the input's dtype out; precision None resolves here


def spectral_power(kernels, W: torch.Tensor, p: int, polar_coefficients, precision: str | None = None):
    if p == 1:
        return W.clone()  # S_1(W) = W, and the result must never alias the input
    precision = resolve_precision(precision, W.dtype)
    chained = kernels.small_chain(wide(W), p, polar_coefficients, precision)
    if chained is not None:
        return _unwide(W, chained).to(W.dtype)
    plan = GramPlan(W, kernels, precision)
    return plan.oriented(plan.power(p, polar_coefficients)).to(W.dtype)


def polar(kernels, W: torch.Tensor, polar_coefficients, precision: str | None = None) -> torch.Tensor:
    return spectral_power(kernels, W, 0, polar_coefficients, precision)


def msign(kernels, A: torch.Tensor, sign_coefficients, precision: str | None = None) -> torch.Tensor:
    precision = resolve_precision(precision, A.dtype)
    return matrix_sign(kernels, A.to(math_dtype(A.dtype, precision)), sign_coefficients, precision).to(A.dtype)


def band_projectors(kernels, W: torch.Tensor, tau, sign_coefficients, precision: str | None = None):
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype))
    P_top = plan.top_projector(tau, sign_coefficients)
    return P_top.to(W.dtype), (plan.identity() - P_top).to(W.dtype)


def band_direction(kernels, W: torch.Tensor, p: int, band: BandSpec, polar_coefficients, sign_coefficients,
                   precision: str | None = None):
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype))
    return plan.oriented(plan.band(p, band, polar_coefficients, sign_coefficients)).to(W.dtype)


def svt(kernels, W: torch.Tensor, t, polar_coefficients, sign_coefficients, precision: str | None = None):
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype))
    return plan.oriented(plan.svt(t, polar_coefficients, sign_coefficients)).to(W.dtype)


def decay_(kernels, W: torch.Tensor, request: DecayRequest) -> torch.Tensor:
    """Write the decayed weights into ``W`` (any layout) once, after the whole direction is computed."""
    spectral, ordinary = request.spectral_scale, request.ordinary_scale
    target = wide(W)
    prox = request.p == 0 and request.p0_mode == "prox" and request.band is None
    if request.p == 1 and request.band is None:
        kernels.decay_epilogue_(target, None, 1.0 - ordinary - spectral, 0.0)
        return W
    precision = resolve_precision(request.precision, W.dtype)
    if prox:  # the spectral part is the soft-threshold itself: W <- prox - ordinary W
        direction, keep, step = GramPlan(W, kernels, precision).svt(
            spectral, request.polar_coefficients, request.sign_coefficients), -ordinary, 1.0
    else:
        keep, step = 1.0 - ordinary, -spectral
        direction = None if request.band is not None else kernels.small_chain(
            target, request.p, request.polar_coefficients, precision)
        if direction is None:
            plan = GramPlan(W, kernels, precision)
            if request.band is not None:
                direction = plan.band(request.p, request.band, request.polar_coefficients, request.sign_coefficients)
            else:
                direction = plan.power(request.p, request.polar_coefficients)
    kernels.decay_epilogue_(target, direction, keep, step)
    return W
