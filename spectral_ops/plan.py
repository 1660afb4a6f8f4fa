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
* ``X`` is scaled to unit Frobenius norm once (``Xn = X / c``, through a power of two so that no square
  leaves the range): the Gram ``Gn = Xn Xn^T`` and its powers stay in range, and the scale ``c^p`` is
  applied once at the end, from its log (it can overflow where ``S_p`` does not), or folded into the
  decay's step. A result beyond the dtype raises OverflowError before anything is written (except
  on the capturable path, which cannot read a flag back: there it comes out as Inf). ``Gn`` doubles as the first Polar
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

import math

import torch

from ._compile import constant_when_traced
from .backends.base import BandSpec, DecayRequest
from .coefficients import NORMALIZATION_MARGIN
from .linalg import as_float64, compute_dtype, frobenius_normalized, is_tall, ratio, scaled_, wide

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


# How an even power's polar factor is iterated: Polar Express on the r x N rectangle; or a coupled
# iteration on the r x r Gram, restarted from the rectangle every few steps (GramPlan.gram_polar);
# "auto" chooses.
ITERATIONS = ("rectangle", "gram_space", "auto")
# Gram space works on G, whose condition number is the square of W's. With restarts it is as accurate as
# the rectangle in fp32/fp64 (docs/results/schedules.md), but in bf16/fp16 a few times less (4e-2-6.5e-2
# against 1e-2 at p = 2), so "auto" keeps those on the rectangle.
GRAM_SPACE_PRECISIONS = ("fp32", "fp64")
GRAM_SPACE_SAVING = 0.25
# The longest run of Gram-space steps between two restarts. Without restarts the iterate Z (which tends
# to G^(-1/2)) amplifies G's rounding by up to 1/s_min: 1.5e-4 at kappa = 1e6 in fp32, NaN in bf16 at
# kappa >= 1e3. Blocks of at most 3 steps keep fp32 within 5e-6 at every kappa (docs/results/schedules.md).
GRAM_SPACE_BLOCK = 3


def restart_blocks(steps: int, longest: int = GRAM_SPACE_BLOCK) -> list[int]:
    """Steps per Gram-space block: as even as blocks of at most ``longest`` steps allow, the shorter
    first (8 steps: 2, 3, 3). The first steps lift the small modes most (their Z grows
    fastest), so restarting soonest after them helps most."""
    if steps <= 0:
        return []
    blocks = -(-steps // longest)
    short, longer = divmod(steps, blocks)
    return [short] * (blocks - longer) + [short + 1] * longer


def block_flops(steps: int, r: int) -> float:
    """``r x r`` FLOPs of one coupled block (see :func:`coupled_inverse_root`), ``M^2`` at half cost: per
    step ``M^2``, and ``Z Y``, ``T Z`` but in the first (``Z = I``), ``Y T`` but in the last."""
    return sum(r**3 + (4 * r**3 if step else 0) + (2 * r**3 if step < steps - 1 else 0) for step in range(steps))


def iteration_flops(iteration: str, p: int, r: int, big: int, steps: int) -> float:
    """Matrix FLOPs of an even power's iteration on an ``r x big`` matrix after its Gram, up to and
    including the product by the polar factor (``M Q``; for ``p = 0``, none on the rectangle), without
    ``G^k`` itself (the same for both). Symmetric products count at half cost, as in the
    rest of this FLOP model (``bench/flops.py`` uses it per op).

    Rectangle: per step ``A = X X^T`` (the first is the Gram), ``A^2``, ``B X``. Gram space: the
    blocks; per restart a Gram of the rectangle and ``Z X``; at the end ``Z X`` (``p = 0``) or
    ``(M Z) X``."""
    if iteration == "rectangle":
        return polar_flops(r, big, steps) - gram_flops(r, big) + (2 * r * r * big if p else 0)
    blocks = restart_blocks(steps)
    restarts = (len(blocks) - 1) * (2 * r * r * big + gram_flops(r, big))
    final = 2 * r * r * big + (2 * r**3 if p else 0)
    return sum(block_flops(b, r) for b in blocks) + restarts + final


def gram_flops(r: int, big: int) -> float:
    return r * r * big  # 2 r^2 big, halved: symmetric


def polar_step_flops(r: int, big: int) -> float:
    """``A = X X^T`` (symmetric), ``A A`` (symmetric), ``B X`` (dense)."""
    return gram_flops(r, big) + r**3 + 2 * r * r * big


def polar_flops(r: int, big: int, steps: int = 8) -> float:
    return steps * polar_step_flops(r, big)


def gram_power_products(k: int) -> int:
    """Symmetric ``r x r`` products repeated squaring needs for ``G^k``."""
    if k <= 1:
        return 0
    squarings = k.bit_length() - 1
    return squarings + bin(k).count("1") - 1


def spectral_power_flops(r: int, big: int, p: int, steps: int = 8, iteration: str = "rectangle") -> float:
    """SPEC 1.2: the Gram (shared with the first polar step), its powers, one last product.

    ``iteration="gram_space"`` (even ``p``): the polar factor from restarted ``r x r`` blocks, as
    :func:`spectral_ops.plan.iteration_flops` counts them (one model, in the plan)."""
    if p == 1:
        return 0.0
    final = 2 * r * r * big if p % 2 else iteration_flops(iteration, p, r, big, steps)
    return gram_flops(r, big) + gram_power_products(p // 2) * r**3 + final


def msign_flops(r: int, steps: int) -> float:
    """Per step ``Z^2``, ``C^2`` and ``B Z``: all symmetric (they commute with Z)."""
    return steps * 3 * r**3


def resolve_iteration(iteration: str, p: int, shape, precision: str, steps: int) -> str:
    """``"auto"``: Gram space for an even ``p`` at a precision where it is as accurate as the rectangle,
    where it saves at least :data:`GRAM_SPACE_SAVING` of the iteration's FLOPs (an aspect ratio of
    about 3.5 or more; on a square matrix it costs more); the rectangle otherwise."""
    if iteration != "auto":
        return iteration
    if p % 2 or precision not in GRAM_SPACE_PRECISIONS:
        return "rectangle"
    r, big = min(shape[-2:]), max(shape[-2:])
    cheaper = iteration_flops("gram_space", p, r, big, steps) <= (1 - GRAM_SPACE_SAVING) * iteration_flops(
        "rectangle", p, r, big, steps)
    return "gram_space" if cheaper else "rectangle"


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
                     first_gram: torch.Tensor | None = None, scale: float = 1.0):
    """Apply ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` for each ``(a, b, c)``, from ``scale X``.

    ``first_gram`` lets a caller that already holds ``X X^T`` skip the first product. ``scale`` is
    folded into the first step's coefficients (``A = s^2 X X^T`` and ``a s X + s (P X)``), not applied
    as a pass over ``X`` and its Gram.
    """
    for step, (a, b, c) in enumerate(coefficients):
        A = first_gram if step == 0 and first_gram is not None else kernels.symmetric(X, X.mT, precision)
        first_gram = None  # the first step's A only: not held through the loop
        s = scale if step == 0 else 1.0
        P = kernels.poly_step(A, b * s**2, c * s**4, precision)
        del A
        X = kernels.product(P, X, precision, Y=X, alpha=a * s, beta=s)
    return X


def coupled_inverse_root(kernels, G: torch.Tensor, coefficients, precision: str, identity: torch.Tensor):
    """``Z``, the polynomial in ``G = X X^T`` with ``Z X`` what Polar Express's steps make of ``X``.

    Polar Express multiplies ``X`` by ``T = a I + b M + c M^2`` with ``M = X X^T``. Writing ``X = Z X0``
    (``Z`` a polynomial in ``G``) and ``Y = Z G`` gives ``M = Z Y`` and the updates ``Y <- Y T``,
    ``Z <- T Z``: products of commuting symmetric matrices, with ``Z -> G^(-1/2)``. ``Y`` and ``Z`` are
    iterated together (coupled) because ``Z`` alone (``M = Z G Z``) amplifies the Gram's rounding by
    ``1 / s_min^2`` and diverges.

    ``Z Y``, ``Y T`` and ``T Z`` are full products, not symmetric ones: a product that keeps one
    triangle (the kernels' symmetric primitive) makes ``Y`` and ``Z`` stop commuting, and that error
    grows about 8x per step (2e-3 in fp32 after 8 steps, measured)."""
    Y, Z, identity = G, None, identity.to(G.dtype)  # every iterate is in G's (the operand) dtype
    for step, (a, b, c) in enumerate(coefficients):
        M = Y if Z is None else kernels.product(Z, Y, precision)
        T = kernels.poly_step(M, b, c, precision) + a * identity
        del M
        if step < len(coefficients) - 1:  # the last Y is not needed
            Y = kernels.product(Y, T, precision)
        Z = T if Z is None else kernels.product(T, Z, precision)
    return Z


def matrix_sign(kernels, A: torch.Tensor, coefficients, precision: str) -> torch.Tensor:
    """``msign`` of a symmetric ``A`` (SPEC 1.4): normalise by ``||A||_F``, then one sign step per triple.

    ``A`` is in the math dtype; the result is in the operand dtype of ``precision``. A fused chain
    normalises again, harmlessly: it gets the unit-norm ``A``, whose square cannot leave fp32's range.
    """
    Z = frobenius_normalized(A)[0]
    chained = kernels.small_chain(Z, 0, coefficients, precision, sign=True)
    if chained is not None:
        return chained.to(OPERAND_DTYPES[precision])
    Z = Z.to(OPERAND_DTYPES[precision])
    for coefficient in coefficients:
        Z = kernels.sign_step(Z, coefficient, precision)
    return Z


def renormalized(M: torch.Tensor, log_scale: torch.Tensor):
    """``(M / 2^e, log_scale + e ln 2)`` with ``2^e`` the power of two nearest above ``||M||_F``: an exact
    rescaling, so a chain of products of ``Gn``'s squares (whose norms shrink geometrically, to zero
    in fp16 for ``Gn^4`` of a 4096-side Gram) keeps every mantissa it would have had in range."""
    norm = torch.linalg.vector_norm(M, dim=(-2, -1), keepdim=True, dtype=compute_dtype(M.dtype))
    exponent = torch.frexp(norm).exponent
    return M * torch.exp2(-exponent.to(M.dtype)), log_scale + exponent.double() * math.log(2)


def checked_finite(result: torch.Tensor, op: str) -> torch.Tensor:
    """``result``, or OverflowError when a value of it overflowed its dtype (one host sync)."""
    if not bool(torch.isfinite(result).all()):
        raise OverflowError(
            f"{op}: the result does not fit in {result.dtype} (a value of it exceeds "
            f"{torch.finfo(result.dtype).max:.3g}); compute in float64 or rescale W")
    return result


class GramPlan:
    """The intermediate results of one (batch of) matrix, each computed lazily and at most once:
    ``X``, ``ln c`` with ``c = ||X||_F`` (float64), ``Xn`` (math dtype), the operand ``Xo`` (``Xn`` in
    the operand dtype, and the only one of the two held where they differ), the Gram ``Gn``, its
    renormalised squares, and the polar factor ``Q`` (operand dtype).

    ``c`` is held as a log: at the dtype's extremes it and its powers need not exist as numbers.
    Results scaled by ``c^p`` come as a *scaled* pair ``(D, ln f)`` with ``S = f D``, ``D`` of norm
    about 1; the caller applies ``f`` where it cannot overflow alone (:func:`~.linalg.scaled_`, or the
    decay's step).
    """

    def __init__(self, W: torch.Tensor, kernels, precision: str, restart_every: int = GRAM_SPACE_BLOCK,
                 overwrite_input: bool = False, polar_only: bool = False):
        """``overwrite_input``: ``W`` is the caller's temporary, normalised in place (``X`` is then
        ``Xn``, and the plan has no ``X`` of its own). ``polar_only``: the plan is asked for the polar
        factor and nothing else, so :meth:`polar` hands its operand to the iteration instead of holding
        it (and its Gram) through every step, as torch.optim.Muon's iteration holds neither."""
        self.kernels = kernels
        self.polar_only = polar_only
        self.restart_every = restart_every
        self.precision = precision
        self.transposed = is_tall(W)
        self.dtype = math_dtype(W.dtype, precision)
        X = wide(W).to(self.dtype)
        self.shape = X.shape  # the wide orientation's
        Xn, self.log_scale = frobenius_normalized(X, in_place=overwrite_input)
        self.X = None if overwrite_input else X
        self.Xo = Xn.to(OPERAND_DTYPES[precision])
        # Xn itself is read only by svt: where the operands are of another dtype it is not held through
        # the iteration (a full-size math-dtype temporary), but formed again if asked for.
        self._normalized = Xn if self.Xo is Xn or overwrite_input else None
        self._gram_squares: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._polar = None
        self._gram_polar = None

    @property
    def Xn(self) -> torch.Tensor:
        """``X / c`` in the math dtype (the same numbers as the ``Xn`` that ``Xo`` was rounded from)."""
        if self._normalized is None:
            self._normalized = frobenius_normalized(self.X)[0]
        return self._normalized

    def symmetric(self, L, R):
        return self.kernels.symmetric(L, R, self.precision)

    def product(self, M, Z, **epilogue):
        return self.kernels.product(M, Z, self.precision, **epilogue)

    @property
    def gram(self) -> torch.Tensor:
        return self._gram_square(1)[0]

    def identity(self) -> torch.Tensor:
        return torch.eye(self.shape[-2], dtype=self.dtype, device=self.log_scale.device)

    def _gram_square(self, exponent: int):
        """``Gn^exponent`` for a power of two, scaled: ``(M, ln f)`` with ``Gn^exponent = f M``."""
        if exponent not in self._gram_squares:
            if exponent == 1:
                self._gram_squares[1] = (self.symmetric(self.Xo, self.Xo.mT), torch.zeros_like(self.log_scale))
            else:
                half, log_half = self._gram_square(exponent // 2)
                self._gram_squares[exponent] = renormalized(self.symmetric(half, half), 2 * log_half)
        return self._gram_squares[exponent]

    def gram_power(self, k: int):
        """``Gn^k`` scaled, ``(M, ln f)``, by repeated squaring."""
        def multiply(left, right):
            return renormalized(self.symmetric(left[0], right[0]), left[1] + right[1])
        return repeated_squaring(k, self._gram_square, multiply)

    def polar(self, coefficients) -> torch.Tensor:
        """Polar Express ``Q = U V^T`` (wide), from ``X0 = Xn / 1.01``, sharing the Gram with step one."""
        if self._polar is not None:
            return self._polar
        if self.polar_only:
            # Popped into the call, not bound here: the iteration holds the only reference, and drops it
            # (and the Gram it forms) after the first step.
            self._polar = polar_iterations(self.kernels, self.__dict__.pop("Xo"), coefficients, self.precision,
                                           scale=1.0 / NORMALIZATION_MARGIN)
        else:
            self._polar = polar_iterations(self.kernels, self.Xo, coefficients, self.precision, self.gram,
                                           scale=1.0 / NORMALIZATION_MARGIN)
        return self._polar

    def gram_polar(self, coefficients):
        """The polar factor of ``X0 = Xn / 1.01`` as a pair ``(Z, Xj)`` with ``Q = Z Xj``, iterated on
        ``r x r`` Grams: each block of :func:`restart_blocks` (at most ``restart_every`` steps) runs
        :func:`coupled_inverse_root` on the Gram of ``Xj``, and the next block restarts from
        ``Xj <- Z Xj`` and its new Gram.

        A restart must recompute the Gram from the rectangle: ``Z G Z``, which carries the first Gram's
        rounding, is no better than no restart (7.7e-5 at kappa = 1e6 in fp32, NaN in bf16, measured).
        """
        if self._gram_polar is None:
            shrink = 1.0 / NORMALIZATION_MARGIN
            X, G, identity, done = self.Xo * shrink, self.gram * shrink**2, self.identity(), 0
            for number, steps in enumerate(restart_blocks(len(coefficients), self.restart_every)):
                if number:
                    X = self.product(Z, X)
                    G = self.symmetric(X, X.mT)
                Z = coupled_inverse_root(self.kernels, G, coefficients[done:done + steps], self.precision,
                                         identity)
                done += steps
            self._gram_polar = (Z, X)
        return self._gram_polar

    def scaled_power(self, p: int, coefficients, iteration: str = "rectangle"):
        """``S_p`` (wide, math dtype) scaled, ``(D, ln f)``: ``D = M Q`` for ``p = 2k`` and ``M Xn`` for
        ``2k + 1``, with ``Gn^k = g M`` and ``f = c^p g``; ``(X, 0)`` for ``p = 1``. With
        ``iteration="gram_space"`` the polar factor of an even ``p`` comes from :meth:`gram_polar` as
        ``Q = Z Xj``, and ``D = (M Z) Xj``: one product by the rectangle instead of two.

        ``p = 0``'s ``D``, the polar factor itself, stays in the operand dtype: its caller rounds it
        once, to where it goes (a Muon step adds the bf16 iterate to its weights as torch.optim.Muon
        does, without a full-size fp32 copy of it)."""
        if p == 1:
            return self.X, torch.zeros_like(self.log_scale)
        if iteration == "gram_space" and p % 2 == 0:
            Z, X = self.gram_polar(coefficients)
            if p == 0:
                return self.product(Z, X), torch.zeros_like(self.log_scale)
            M, log_gram = self.gram_power(p // 2)
            return self.product(self.product(M, Z), X).to(self.dtype), p * self.log_scale + log_gram
        base = self.polar(coefficients) if p % 2 == 0 else self.Xo
        if p == 0:
            return base, torch.zeros_like(self.log_scale)
        M, log_gram = self.gram_power(p // 2)
        return self.product(M, base).to(self.dtype), p * self.log_scale + log_gram

    def power(self, p: int, coefficients) -> torch.Tensor:
        """``S_p`` (wide, math dtype), non-finite only where it overflows the math dtype."""
        if p <= 1:
            return self.scaled_power(p, coefficients)[0].to(self.dtype)
        return scaled_(*self.scaled_power(p, coefficients))

    def top_projector(self, tau, sign_coefficients) -> torch.Tensor:
        """``P_top = (I + msign(Gn - (tau / c)^2 I)) / 2`` on the small side (math dtype).

        ``Gn``'s eigenvalues are in [0, 1], so a shift above 2 gives ``P_top = 0`` as surely as the exact one
        (which can exceed the dtype: ``tau / c = 1e60`` for ``tau = 1e30``, ``c = 1e-30``)."""
        ratio_sq = ratio(tau, self.log_scale, math.sqrt(2.0), self.dtype) ** 2
        shifted = self.gram.to(self.dtype) - ratio_sq * self.identity()
        J = matrix_sign(self.kernels, shifted, sign_coefficients, self.precision).to(self.dtype)
        return (J + self.identity()) * 0.5

    def band(self, p: int, band: BandSpec, polar_coefficients, sign_coefficients) -> torch.Tensor:
        """A band-selective direction (SPEC 1.4) with one rectangular product by ``P_top``.

        ``P_bot = I - P_top`` and ``P_top`` commutes with every ``S_p``, so e.g.
        ``P_top S_p + P_bot X = X + P_top (S_p - X)``. ``S_p`` is formed unscaled, so a band form is
        finite only where ``S_p(W)`` itself fits the math dtype.
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

    def scaled_svt(self, t, polar_coefficients, sign_coefficients):
        """``prox_{t ||.||_*}(W) = c P_top(t) (Xn - (t / c) Q)`` (SPEC 1.4), scaled: ``(D, ln c)``.

        Every singular value is at most ``c``, so a ``t / c`` above 1 gives zero as surely as the exact
        one, and is capped there (it can exceed the dtype)."""
        P_top = self.top_projector(t, sign_coefficients)
        shift = ratio(t, self.log_scale, 1.0, self.dtype)
        return self._final_product(P_top, self.Xn - shift * self.polar(polar_coefficients).to(self.dtype)), \
            self.log_scale

    def _final_product(self, M, Z, **epilogue):
        """The one rectangular product of a band form, on unscaled weights: in the math dtype, whose
        range the scale ``c^p`` needs, at fp32 accuracy (fp64 for fp64)."""
        exact = "fp64" if self.dtype == torch.float64 else "fp32"
        return self.kernels.product(M, Z, exact, **epilogue)

    def oriented(self, S: torch.Tensor) -> torch.Tensor:
        return S.mT if self.transposed else S


def _unwide(W: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    return S.mT if is_tall(W) else S


# ----- the ops: (validated) inputs in, a new tensor of the input's dtype out; precision None resolves here


def chained_power(kernels, plan: GramPlan, p: int, polar_coefficients):
    """``S_p`` scaled, ``(D, ln c^p)``, by a backend's fused chain where one runs it, else None.

    The chain gets the unit-norm operand ``Xo``, not the weight: it forms the raw Gram and
    ``||X||^p`` in fp32, which leave the range at ``||W||_F ~ 1e19`` (or ``1e-19``), and for large
    ``p`` even at unit norm. It does not renormalise ``Gn^k``, whose norm is at least ``r^-k``: the
    chain is left out where that could fall below fp32's normal range.
    """
    r = plan.Xo.shape[-2]
    if p // 2 * math.log2(max(r, 2)) > CHAIN_POWER_RANGE_BITS:
        return None
    chained = kernels.small_chain(plan.Xo, p, polar_coefficients, plan.precision)
    if chained is None:
        return None
    return chained.to(plan.dtype), p * plan.log_scale


# Gn^k at unit norm stays above 2^-CHAIN_POWER_RANGE_BITS, well inside fp32's normal range (2^-126).
CHAIN_POWER_RANGE_BITS = 100


def power_direction(kernels, plan: GramPlan, p: int, polar_coefficients, iteration: str):
    """``S_p`` scaled, ``(D, ln f)``, by the iteration ``iteration`` resolves to. A backend's fused chain
    (the rectangle's steps in one kernel per matrix) comes first under ``"rectangle"`` and ``"auto"``:
    it runs where launches, not FLOPs, bound the time, so Gram space's saving would not show."""
    if iteration != "gram_space":
        chained = chained_power(kernels, plan, p, polar_coefficients)
        if chained is not None:
            return chained
    iteration = resolve_iteration(iteration, p, plan.shape, plan.precision, len(polar_coefficients))
    return plan.scaled_power(p, polar_coefficients, iteration)


def spectral_power(kernels, W: torch.Tensor, p: int, polar_coefficients, precision: str | None = None,
                   sync: bool = True, iteration: str = "auto"):
    """``sync``: check the result for overflow (OverflowError); the capturable path passes False and
    gets Inf where the result exceeds the dtype. ``iteration``: one of :data:`ITERATIONS`."""
    if p == 1:
        return W.clone()  # S_1(W) = W, and the result must never alias the input
    if p == 0:
        return polar_factor(kernels, W, polar_coefficients, precision, iteration)
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype))
    direction, log_factor = power_direction(kernels, plan, p, polar_coefficients, iteration)
    result = plan.oriented(scaled_(direction, log_factor)).to(W.dtype)
    return checked_finite(result, "spectral_power") if sync else result


def polar_factor(kernels, W: torch.Tensor, polar_coefficients, precision: str | None = None,
                 iteration: str = "auto", dtype: torch.dtype | None = None, overwrite_input: bool = False):
    """``S_0(W)``, in ``dtype`` (``W``'s by default); ``overwrite_input``: see :class:`GramPlan`."""
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype), overwrite_input=overwrite_input,
                    polar_only=True)
    direction, _ = power_direction(kernels, plan, 0, polar_coefficients, iteration)
    return plan.oriented(direction).to(dtype or W.dtype)


def polar(kernels, W: torch.Tensor, polar_coefficients, precision: str | None = None,
          dtype: torch.dtype | None = None, overwrite_input: bool = False) -> torch.Tensor:
    """Always on the rectangle: this is Muon's orthogonalisation, which must be the iteration
    torch.optim.Muon runs (``spectral_power(W, 0)`` follows ``iteration`` instead)."""
    return polar_factor(kernels, W, polar_coefficients, precision, "rectangle", dtype, overwrite_input)


def msign(kernels, A: torch.Tensor, sign_coefficients, precision: str | None = None) -> torch.Tensor:
    precision = resolve_precision(precision, A.dtype)
    return matrix_sign(kernels, A.to(math_dtype(A.dtype, precision)), sign_coefficients, precision).to(A.dtype)


def band_projectors(kernels, W: torch.Tensor, tau, sign_coefficients, precision: str | None = None):
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype))
    P_top = plan.top_projector(tau, sign_coefficients)
    return P_top.to(W.dtype), (plan.identity() - P_top).to(W.dtype)


def band_direction(kernels, W: torch.Tensor, p: int, band: BandSpec, polar_coefficients, sign_coefficients,
                   precision: str | None = None, sync: bool = True):
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype))
    result = plan.oriented(plan.band(p, band, polar_coefficients, sign_coefficients)).to(W.dtype)
    return checked_finite(result, "band_direction") if sync else result


def svt(kernels, W: torch.Tensor, t, polar_coefficients, sign_coefficients, precision: str | None = None,
        sync: bool = True):
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype))
    result = plan.oriented(scaled_(*plan.scaled_svt(t, polar_coefficients, sign_coefficients))).to(W.dtype)
    return checked_finite(result, "svt") if sync else result


def decay_(kernels, W: torch.Tensor, request: DecayRequest, sync: bool = True) -> torch.Tensor:
    """Write the decayed weights into ``W`` (any layout) once, after the whole direction is computed.

    The direction's scale ``c^p`` goes into the step (a per-matrix factor), never into a number of its
    own. ``sync``: before writing, check that the new weights fit ``W``'s dtype (OverflowError, nothing
    written; one host sync, and a pass over the direction); the capturable path passes False and then
    writes Inf where they do not.
    """
    spectral, ordinary = request.spectral_scale, request.ordinary_scale
    target = wide(W)
    prox = request.p == 0 and request.p0_mode == "prox" and request.band is None
    if request.p == 1 and request.band is None:
        kernels.decay_epilogue_(target, None, 1.0 - ordinary - spectral, 0.0)
        return W
    plan = GramPlan(W, kernels, resolve_precision(request.precision, W.dtype))
    if prox:  # the spectral part is the soft-threshold itself: W <- prox - ordinary W
        keep, step = -ordinary, 1.0
        direction, log_factor = plan.scaled_svt(spectral, request.polar_coefficients, request.sign_coefficients)
    else:
        keep, step = 1.0 - ordinary, -spectral
        if request.band is not None:
            direction = plan.band(request.p, request.band, request.polar_coefficients, request.sign_coefficients)
            log_factor = torch.zeros_like(plan.log_scale)
        else:
            direction, log_factor = power_direction(kernels, plan, request.p, request.polar_coefficients,
                                                    request.iteration)
            direction = direction.to(plan.dtype)  # p = 0's polar factor comes in the operand dtype
    step = scaled_step(step, log_factor).to(plan.dtype)
    if sync:
        check_update_fits(plan, keep, step, direction, W.dtype)
    del plan  # Xn, Q and the Gram squares: the epilogue needs only the direction
    kernels.decay_epilogue_(target, direction, keep, step)
    return W


def scaled_step(step, log_factor: torch.Tensor) -> torch.Tensor:
    """``step * exp(log_factor)`` per matrix (float64 ``(..., 1, 1)``), summed as logs: the factor alone
    (``c^p``) can overflow where ``step`` brings the product back (``1e-40 * (1e10)^4``)."""
    step = as_float64(step, log_factor.device)
    return torch.sign(step) * (step.abs().log() + log_factor).exp()


def check_update_fits(plan: GramPlan, keep, step: torch.Tensor, direction: torch.Tensor, dtype: torch.dtype):
    """Raise OverflowError unless every ``keep W + step D`` fits ``dtype``. ``|keep| ||W||_F + |step| ||D||_F``
    bounds each entry and settles it in one pass over ``D``; only where that bound exceeds the dtype are
    the new weights formed and checked."""
    keep = as_float64(keep, step.device)
    direction_norm = torch.linalg.vector_norm(direction, dim=(-2, -1), keepdim=True).double()
    bound = keep.abs() * plan.log_scale.exp() + step.abs() * direction_norm
    if bool((bound <= torch.finfo(dtype).max).all()):
        return
    candidate = (plan.X * keep.to(plan.dtype) + step * direction).to(dtype)
    if not bool(torch.isfinite(candidate).all()):
        raise OverflowError(
            f"spectral_decay_: the decayed weights do not fit in {dtype} (a value exceeds "
            f"{torch.finfo(dtype).max:.3g}); nothing was written")
