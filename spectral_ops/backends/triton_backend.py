"""Triton kernels (``spectral_ops.triton_kernels``, from the top-level ``triton_kernels/`` folder).

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter, used by
the tests) when the backend is forced. ``KERNELS`` lists the ops that have kernels.

Every op is the algorithm of :class:`~spectral_ops.backends.torch_backend.GramPlan` (wide
orientation, unit-Frobenius Gram shared with the first Polar Express step, powers by repeated
squaring, band forms with one rectangular product by ``P_top``), with the products on the kernels:

* small side ``r <= 128`` (per-head weights): ``polar``, ``spectral_power`` and the plain
  ``decay_`` run as one program per matrix (:mod:`~spectral_ops.triton_kernels.small`);
* otherwise every ``r x r`` product is a symmetric kernel computing half the tiles
  (:mod:`~spectral_ops.triton_kernels.syrk`, ``poly_step``, ``sign_step``), every ``r x n`` one the
  fused product (:mod:`~spectral_ops.triton_kernels.update`), and a decay's last product writes
  the weight in its epilogue (:mod:`~spectral_ops.triton_kernels.decay`).

float32, float16 and bfloat16 are computed in float32 (products accumulate in fp32; fp32
intermediates are multiplied with ``input_precision``, ``tf32x3`` by default, which keeps fp32
accuracy on the tensor cores). float64 is left to the PyTorch backend, and so is bfloat16 under
the interpreter, which cannot compute in it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

from .base import OPS, BandSpec, DecayRequest, repeated_squaring
from .torch_backend import NORMALIZATION_MARGIN

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Ops with a Triton kernel behind them, and the dtypes each kernel takes.
KERNELS: dict[str, tuple[torch.dtype, ...]] = {op: KERNEL_DTYPES for op in OPS}

PRECISION_VAR = "SPECTRAL_OPS_TRITON_PRECISION"
DEFAULT_PRECISION = "tf32x3"
_TINY = torch.finfo(torch.float32).tiny


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


class _Kernels:
    """The kernel modules, imported on first use: ``triton.jit`` reads TRITON_INTERPRET then."""

    def __getattr__(self, module: str):
        loaded = importlib.import_module(f"..triton_kernels.{module}", __package__)
        setattr(self, module, loaded)
        return loaded


kernels = _Kernels()


def _per_matrix(value, batch_shape, device):
    """A float, or a ``(batch,)`` fp32 vector from a 0-d or ``(..., 1, 1)`` tensor."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    value = value.to(device=device, dtype=torch.float32)
    return torch.broadcast_to(value, (*batch_shape, 1, 1)).reshape(-1)


def _wide(W: torch.Tensor) -> torch.Tensor:
    """The wide ``r x n`` view of ``W`` (``W^T`` for a tall weight; no copy)."""
    return W.mT if W.shape[-2] >= W.shape[-1] else W


class _Plan:
    """:class:`GramPlan` on the Triton kernels: the same lazily computed quantities, in fp32.

    ``X`` stays a view of the weight in its own dtype (the kernels read it directly); the
    normalisation is folded into the kernels' scales (one fp32 value per matrix), so the
    unit-norm ``Xn`` is never materialised.
    """

    def __init__(self, W: torch.Tensor, precision: str, small_side_max: int):
        self.X = _wide(W)
        self.batch_shape = W.shape[:-2]
        self.r, self.n = self.X.shape[-2:]
        self.precision = precision
        self.small_side_max = small_side_max
        self.scale = torch.linalg.vector_norm(self.X, dim=(-2, -1), dtype=torch.float32).reshape(-1)
        self.inv = 1.0 / (self.scale + _TINY)
        self._squares: dict[int, torch.Tensor] = {}
        self._polar = None

    def empty(self, cols: int | None = None) -> torch.Tensor:
        return torch.empty(self.scale.shape[0], self.r, self.n if cols is None else cols,
                           dtype=torch.float32, device=self.X.device)

    def identity(self) -> torch.Tensor:
        return torch.eye(self.r, dtype=torch.float32, device=self.X.device)

    def per_matrix(self, value):
        return _per_matrix(value, self.batch_shape, self.X.device)

    def product(self, M, Z, *, out=None, Y=None, alpha=0.0, beta=1.0, gamma=0.0) -> torch.Tensor:
        """``alpha Y + gamma Z + beta M Z``; with ``Y is out`` it is the decay written into the weight."""
        if out is not None and Y is out:
            return kernels.decay.decay_product_(out, M, Z, alpha=alpha, beta=beta, gamma=gamma,
                                                input_precision=self.precision)
        return kernels.update.product(M, Z, out=out, Y=Y, alpha=alpha, beta=beta, gamma=gamma,
                                      input_precision=self.precision)

    def poly(self, A, b, c, out) -> torch.Tensor:
        return kernels.poly_step.poly_step(A, b, c, out=out, input_precision=self.precision)

    @property
    def gram(self) -> torch.Tensor:
        """``Gn = X X^T / ||X||^2``: the Gram of the weight as stored, normalised in the epilogue."""
        if 1 not in self._squares:
            self._squares[1] = kernels.syrk.syrk(self.X, alpha=1.0 / (self.scale * self.scale + _TINY),
                                                 input_precision=self.precision)
        return self._squares[1]

    def _gram_square(self, exponent: int) -> torch.Tensor:
        if exponent == 1:
            return self.gram
        if exponent not in self._squares:
            self._squares[exponent] = kernels.syrk.syrk(self._gram_square(exponent // 2),
                                                        input_precision=self.precision)
        return self._squares[exponent]

    def gram_power(self, k: int) -> torch.Tensor:
        """``Gn^k``; the squares commute, so each product is symmetric and computes half the tiles."""
        return repeated_squaring(k, self._gram_square, lambda a, b: kernels.syrk.symmetric_product(
            a, b, input_precision=self.precision))

    def polar(self, coefficients, *, out=None, Y=None, alpha=0.0, beta=1.0) -> torch.Tensor:
        """``alpha Y + beta Q``; ``Q`` alone (cached) when called without ``out``/``Y``/``beta``.

        Without a cached ``Q`` and with an ``out``, the combination is fused into the last
        update (``out = alpha Y + beta (a X + B X)``) and ``Q`` is not kept.
        """
        plain = out is None and Y is None and not isinstance(beta, torch.Tensor) and beta == 1.0
        if self._polar is None and not plain and out is not None:
            return self._polar_chain(coefficients, out=out, Y=Y, alpha=alpha, beta=beta)
        if self._polar is None:
            self._polar = self._polar_chain(coefficients)
        if plain:
            return self._polar
        return self.product(None, self._polar, gamma=beta, Y=Y, alpha=alpha, out=out)

    def _polar_chain(self, coefficients, *, out=None, Y=None, alpha=0.0, beta=1.0) -> torch.Tensor:
        """Polar Express from ``X0 = X / (1.01 ||X||)``; step one reuses the Gram and reads ``X``."""
        shrink = 1.0 / NORMALIZATION_MARGIN
        # Folded into one factor, a * inv / 1.01 would overflow for a zero matrix (inv = 1 / tiny).
        first = torch.where(self.scale > 0, self.inv * shrink, 0.0)
        buffers = (self.empty(), self.empty())
        A, B = self.empty(self.r), self.empty(self.r)
        current = self.X
        last = len(coefficients) - 1
        for step, (a, b, c) in enumerate(coefficients):
            if step == 0:
                B = self.poly(self.gram, b * shrink**2, c * shrink**4, out=B)
                gamma, scale = a * first, first
            else:
                A = kernels.syrk.syrk(current, out=A, input_precision=self.precision)
                B = self.poly(A, b, c, out=B)
                gamma, scale = a, 1.0
            if step == last and out is not None:
                return self.product(B, current, gamma=beta * gamma, beta=beta * scale, Y=Y, alpha=alpha,
                                    out=out)
            current = self.product(B, current, gamma=gamma, beta=scale, out=buffers[step % 2])
        return current

    def power(self, p: int, coefficients, *, out=None, Y=None, alpha=0.0, beta=1.0) -> torch.Tensor:
        """``alpha Y + beta S_p`` (wide): ``||X||^p Gn^k Q`` for ``p = 2k``, ``||X||^p Gn^k Xn`` for ``2k+1``."""
        if p == 0:
            return self.polar(coefficients, out=out, Y=Y, alpha=alpha, beta=beta)
        if p == 1:
            return self.product(None, self.X, gamma=beta, Y=Y, alpha=alpha, out=out)
        if p % 2 == 0:
            base, factor = self.polar(coefficients), self.scale**p
        else:
            base, factor = self.X, self.scale**p * self.inv
        return self.product(self.gram_power(p // 2), base, beta=beta * factor, Y=Y, alpha=alpha, out=out)

    def top_projector(self, tau, sign_coefficients) -> torch.Tensor:
        """``P_top = (I + msign(Gn - (tau/||X||)^2 I)) / 2`` on the small side."""
        tau = self.per_matrix(tau)
        nonzero = self.scale > 0
        ratio_sq = torch.where(nonzero, (tau / torch.where(nonzero, self.scale, 1.0)) ** 2, 1.0)
        shifted = self.gram - ratio_sq[:, None, None] * self.identity()
        J = sign_chain(shifted, sign_coefficients, self.precision, self.small_side_max)
        return (J + self.identity()) * 0.5


def sign_chain(A: torch.Tensor, coefficients, precision: str, small_side_max: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``msign(A)`` for symmetric ``A``: normalise by ``||A||_F`` in fp32, then sign steps.

    Small matrices run the whole chain in one program; larger ones alternate between two fp32
    buffers, and the last step writes ``out`` (any dtype) if given.
    """
    if A.shape[-1] <= small_side_max:
        return kernels.small.small_sign(A, coefficients, out=out, input_precision=precision)
    norm = torch.linalg.vector_norm(A, dim=(-2, -1), dtype=torch.float32)
    Z = A.to(torch.float32) / (norm[..., None, None] + _TINY)
    buffers = (Z, torch.empty_like(Z))
    workspace = (torch.empty_like(Z), torch.empty_like(Z))
    for step, coefficient in enumerate(coefficients):
        destination = out if step == len(coefficients) - 1 and out is not None else buffers[(step + 1) % 2]
        Z = kernels.sign_step.sign_step(Z, coefficient, out=destination, workspace=workspace,
                                        input_precision=precision)
    return Z


def _band_parts(plan: _Plan, p: int, band: BandSpec, polar_coefficients, sign_coefficients):
    """``(P, T, base, base_coef, t_coef, pt_coef)`` with ``direction = base_coef base + t_coef T + pt_coef P T``.

    The forms of :func:`~spectral_ops.backends.torch_backend.band_combination`, rearranged so
    that ``P_top`` multiplies one rectangular operand ``T`` and everything else is an epilogue term.
    """
    P = plan.top_projector(band.tau, sign_coefficients)
    X = plan.X
    if band.mode in ("top", "bot"):
        T = plan.power(p, polar_coefficients, out=plan.empty(), Y=X, alpha=-1.0)  # S_p - X
        return (P, T, X, 1.0, 0.0, 1.0) if band.mode == "top" else (P, T, X, 1.0, 1.0, -1.0)
    if band.mode in ("top_only", "bot_only"):
        T = plan.power(p, polar_coefficients, out=plan.empty())
        return (P, T, X, 0.0, 0.0, 1.0) if band.mode == "top_only" else (P, T, X, 0.0, 1.0, -1.0)
    lambda_top, lambda_bot = plan.per_matrix(band.lambda_top), plan.per_matrix(band.lambda_bot)
    if band.p_bot == p:  # lambda_bot S + P (lambda_top - lambda_bot) S
        S = plan.power(p, polar_coefficients, out=plan.empty())
        return P, S, X, 0.0, lambda_bot, lambda_top - lambda_bot
    if p % 2 == 0 and band.p_bot % 2 == 0:
        plan.polar(polar_coefficients)  # both powers need Q: compute it once, keep it
    U = plan.power(band.p_bot, polar_coefficients, out=plan.empty(), beta=lambda_bot)
    T = plan.power(p, polar_coefficients, out=plan.empty(), Y=U, alpha=-1.0, beta=lambda_top)
    return P, T, U, 1.0, 0.0, 1.0


class _Probed(Exception):
    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix


class _MatrixProbe:
    """Stands in for a backend to learn which matrix a self-check case passes; computes nothing."""

    def __getattr__(self, op: str):
        def record(matrix, *args):
            raise _Probed(matrix)

        return record


@functools.lru_cache(maxsize=None)
def _self_check_small_side(op: str, dtype: torch.dtype, device: torch.device) -> int:
    """The small side of the input the dispatcher checks ``op`` on (it decides that input's path)."""
    from ..selfcheck import self_check_cases

    try:
        self_check_cases(op, dtype, device)[0](_MatrixProbe())
    except _Probed as probed:
        return min(probed.matrix.shape[-2:])
    raise RuntimeError(f"the {op} self-check passed no matrix to the backend")


class TritonBackend:
    name = "triton"
    needs_self_check = True

    def __init__(self, *, small_side_max: int | None = None, input_precision: str | None = None):
        from_env = os.environ.get(PRECISION_VAR, "").strip().lower()
        self.input_precision = input_precision or from_env or DEFAULT_PRECISION
        self._small_side_max = small_side_max
        self._verified: dict[tuple, bool] = {}

    @property
    def small_side_max(self) -> int:
        if self._small_side_max is None:
            self._small_side_max = kernels.small.MAX_SIDE
        return self._small_side_max

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        on_cpu = device is not None and device.type == "cpu"
        if on_cpu and not interpreter_enabled():
            return "Triton runs on CUDA tensors; CPU tensors need TRITON_INTERPRET=1 (the interpreter)"
        if on_cpu and not self._forced():
            return ("CPU tensors run on the Triton interpreter only when the triton backend is forced "
                    "(SPECTRAL_OPS_BACKEND=triton or use_backend('triton')): it is a testing aid, "
                    "far slower than torch")
        if device is None and not torch.cuda.is_available() and not interpreter_enabled():
            return "no CUDA device is visible to torch (and TRITON_INTERPRET=1 is not set)"
        if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(device)
            return f"the Triton kernels are configured for sm80 and newer, this GPU is sm_{major}{minor}"
        return None

    @staticmethod
    def _forced() -> bool:
        from .. import dispatch

        return dispatch.forced_backend() == "triton"

    def supports(self, op: str, W: torch.Tensor) -> bool:
        if W.dtype not in KERNELS.get(op, ()):
            return False
        if W.device.type == "cpu" and W.dtype == torch.bfloat16:
            return False  # the interpreter has no bfloat16 arithmetic
        path = self._path(min(W.shape[-2:]))
        if path == self._path(_self_check_small_side(op, W.dtype, W.device)):
            return True  # the dispatcher's own self-check covers this path
        return self._path_verified(op, W.dtype, W.device, path)

    def _small(self, W: torch.Tensor) -> bool:
        return self._path(min(W.shape[-2:])) == "small"

    def _path(self, small_side: int) -> str:
        return "small" if small_side <= self.small_side_max else "tiled"

    # The dispatcher's self-check runs one small input, which takes one of the two paths (the
    # one-program-per-matrix kernels, or the tiled ones); before a weight takes the other path,
    # the same check runs here on a backend pinned to that path.
    def _path_verified(self, op: str, dtype: torch.dtype, device: torch.device, path: str) -> bool:
        from .. import dispatch

        return dispatch.verify_pinned_path(self.name, path, lambda: TritonBackend(small_side_max=kernels.small.MAX_SIDE if path == "small" else 0,
                                   input_precision=self.input_precision), op, dtype, device, self._verified)

    def _plan(self, W: torch.Tensor) -> _Plan:
        return _Plan(W, self.input_precision, self.small_side_max)

    def polar(self, W, coefficients):
        return self.spectral_power(W, 0, coefficients)

    def msign(self, A, coefficients):
        out = torch.empty_like(A)
        sign_chain(A, coefficients, self.input_precision, self.small_side_max, out=out)
        return out

    def spectral_power(self, W, p, coefficients):
        if p == 1:
            return W.clone()
        out = torch.empty_like(W)
        if self._small(W):
            kernels.small.small_spectral(_wide(W), p, coefficients, out=_wide(out),
                                         input_precision=self.input_precision)
        else:
            self._plan(W).power(p, coefficients, out=_wide(out))
        return out

    def band_projectors(self, W, tau, sign_coefficients):
        plan = self._plan(W)
        P_top = plan.top_projector(tau, sign_coefficients)
        shape = (*plan.batch_shape, plan.r, plan.r)
        return P_top.to(W.dtype).reshape(shape), (plan.identity() - P_top).to(W.dtype).reshape(shape)

    def band_direction(self, W, p, band: BandSpec, polar_coefficients, sign_coefficients):
        plan = self._plan(W)
        P, T, base, base_coef, t_coef, pt_coef = _band_parts(plan, p, band, polar_coefficients, sign_coefficients)
        out = torch.empty_like(W)
        plan.product(P, T, beta=pt_coef, gamma=t_coef, Y=base, alpha=base_coef, out=_wide(out))
        return out

    def svt(self, W, t, polar_coefficients, sign_coefficients):
        plan = self._plan(W)
        out = torch.empty_like(W)
        plan.product(plan.top_projector(t, sign_coefficients), self._svt_operand(plan, t, polar_coefficients),
                     out=_wide(out))
        return out

    @staticmethod
    def _svt_operand(plan: _Plan, t, polar_coefficients) -> torch.Tensor:
        """``X - t Q``, fused into the last Polar Express update; ``prox = P_top(t) (X - t Q)``."""
        return plan.polar(polar_coefficients, out=plan.empty(), Y=plan.X, alpha=1.0, beta=-plan.per_matrix(t))

    def decay_(self, W, request: DecayRequest):
        """Write the decayed weights into ``W``; the last product's epilogue is the write."""
        batch = W.shape[:-2]
        spectral = _per_matrix(request.spectral_scale, batch, W.device)
        ordinary = _per_matrix(request.ordinary_scale, batch, W.device)
        target = _wide(W)
        prox = request.p == 0 and request.p0_mode == "prox"
        if request.band is None and request.p == 1:
            kernels.decay.decay_product_(target, None, alpha=1.0 - ordinary - spectral,
                                         input_precision=self.input_precision)
        elif request.band is None and not prox and self._small(W):
            kernels.small.small_spectral(target, request.p, request.polar_coefficients, out=target,
                                         alpha=1.0 - ordinary, beta=-spectral, input_precision=self.input_precision)
        elif request.band is None and not prox:
            self._plan(W).power(request.p, request.polar_coefficients, out=target, Y=target, alpha=1.0 - ordinary,
                                beta=-spectral)
        elif request.band is None:
            plan = self._plan(W)
            P = plan.top_projector(request.spectral_scale, request.sign_coefficients)
            plan.product(P, self._svt_operand(plan, request.spectral_scale, request.polar_coefficients),
                         Y=target, alpha=-ordinary, out=target)
        else:
            plan = self._plan(W)
            P, T, base, base_coef, t_coef, pt_coef = _band_parts(
                plan, request.p, request.band, request.polar_coefficients, request.sign_coefficients)
            if base is plan.X:
                plan.product(P, T, beta=-spectral * pt_coef, gamma=-spectral * t_coef, Y=target,
                             alpha=1.0 - ordinary - spectral * base_coef, out=target)
            else:
                direction = plan.product(P, T, Y=base, alpha=base_coef)
                plan.product(None, direction, gamma=-spectral, Y=target, alpha=1.0 - ordinary, out=target)
        return W
