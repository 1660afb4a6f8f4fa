"""The hand-written CUDA extension (``spectral_ops._C``, built from ``csrc/``).

Every op is the algorithm of :class:`~spectral_ops.backends.torch_backend.GramPlan` (wide
orientation, unit-Frobenius Gram shared with the first Polar Express step, powers by repeated
squaring, band forms with one rectangular product by ``P_top``), on two paths:

* **chain** (``small_chain.cu``): ``polar``, ``spectral_power`` and the plain ``decay_`` of stacks of
  small matrices (small side ``r <= 128``, ``r^2 n <= CHAIN_MAX_WORK``), one thread block per matrix,
  the Gram in shared memory, the decay written in place;
* **tiled**: every ``r x r`` product on the symmetric kernel (``syrk.cu``: lower-triangle tiles,
  mirrored), ``b A + c A^2`` and the sign step as its epilogues (``poly_step.cu``), every ``r x n``
  product on ``gemm.cu`` with the ``a X`` term fused, and a decay written back by
  ``decay_epilogue.cu`` from an fp32 direction, once.

float32, float16 and bfloat16 compute in float32 (products accumulate in fp32; the weight's own
16-bit values go to the tensor cores as they are, fp32 intermediates as 3xTF32 by default, or with
FMA under ``SPECTRAL_OPS_CUDA_PRECISION=ieee``). float64 is left to cuBLAS through torch.

``supports`` claims only the shapes where these kernels are meant to beat what follows in the
dispatch order (see ``_path``); everything else falls through to Triton and torch.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import _extension as ext
from ..coefficients import NORMALIZATION_MARGIN
from .base import OPS, BandSpec, DecayRequest, repeated_squaring
from .torch_backend import TorchBackend

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Ops with a CUDA kernel behind them, and the dtypes each kernel takes.
KERNELS: dict[str, tuple[torch.dtype, ...]] = {op: KERNEL_DTYPES for op in OPS}

PRECISION_VAR = "SPECTRAL_OPS_CUDA_PRECISION"
DEFAULT_PRECISION = "tf32x3"
CHAIN_OPS = ("polar", "spectral_power", "decay_")
# The tiled path pays off from this small side up. A 128 x 128-tile symmetric product halves the work
# of a dense one, but below about 1-2k cuBLAS (behind torch) is faster per tile than these kernels
# and the saving does not make up for it (SPEC 8: 1.6-2x over cuBLAS from 2048, a loss below 1024).
TILED_MIN_SIDE = 2048
# The chain gives each matrix one SM for its whole iteration, ~16 r^2 n fp32 FMAs for 8 Polar Express
# steps, against ~45 launches of batched products for the composed chain (~0.3-0.5 ms of launch latency
# before any math). One SM does ~1e11 FMA/s, so up to r^2 n of about 2M (128 x 128, 64 x 512,
# 32 x 2048) a matrix is done within that latency and the chain wins at any stack size; it also never
# writes an intermediate to memory. Beyond it the composed chain's many SMs per matrix win: 96 heads of
# 128 x 768 (r^2 n = 12.6M) are estimated at ~2 ms on the chain against ~1.5 ms composed on an H100,
# so they fall through (to Triton's one-program-per-matrix path, which uses the tensor cores, or to
# torch). An estimate from peak rates, not a measurement: bench/cuda_cases.py times both sides.
CHAIN_MAX_WORK = 1 << 21
# The chain's worst case for shared memory: p = 6 keeps two r x r buffers (csrc/small_chain.cu).
CHAIN_WORST_POWER = 6
_TINY = torch.finfo(torch.float32).tiny


def _wide(W: torch.Tensor) -> torch.Tensor:
    """The wide ``r x n`` view of ``W`` (``W^T`` for a tall weight; no copy)."""
    return W.mT if W.shape[-2] >= W.shape[-1] else W


def _vector(t: torch.Tensor) -> torch.Tensor:
    """A per-matrix fp32 tensor (batch shape) as the extension takes it: contiguous, one value per matrix."""
    return t.to(torch.float32).reshape(-1).contiguous()


def _scale(value, batch_shape, device) -> dict:
    """A decay scale (float, 0-d or ``(..., 1, 1)`` tensor) as ``(number, per-matrix vector)``."""
    if not isinstance(value, torch.Tensor):
        return {"value": float(value), "per_matrix": None}
    value = value.to(device=device, dtype=torch.float32)
    return {"value": 1.0, "per_matrix": torch.broadcast_to(value, (*batch_shape, 1, 1)).reshape(-1).contiguous()}


@functools.cache
def _shared_memory_optin(device: torch.device) -> int:
    """Shared memory one block may opt into on ``device``."""
    if device.type != "cuda":
        return 1 << 30
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 * 1024)


class _Plan:
    """:class:`GramPlan` on the tiled kernels: the same lazily computed quantities, in fp32.

    ``X`` stays a view of the weight in its own dtype (the kernels read any strides and dtype); the
    normalisation is folded into per-matrix kernel scales, so the unit-norm ``Xn`` is never formed.
    """

    def __init__(self, W: torch.Tensor, precision: str):
        self.X = _wide(W)
        self.batch = W.shape[:-2]
        self.r, self.n = self.X.shape[-2:]
        self.precision = precision
        self.scale = torch.linalg.vector_norm(self.X, dim=(-2, -1), dtype=torch.float32)
        self.inv = 1.0 / (self.scale + _TINY)
        self._squares: dict[int, torch.Tensor] = {}
        self._polar = None

    def empty(self, cols: int | None = None) -> torch.Tensor:
        return torch.empty((*self.batch, self.r, self.n if cols is None else cols), dtype=torch.float32,
                           device=self.X.device)

    def identity(self) -> torch.Tensor:
        return torch.eye(self.r, dtype=torch.float32, device=self.X.device)

    def symmetric(self, L: torch.Tensor, R: torch.Tensor, **scales) -> torch.Tensor:
        return ext.syrk(L, R, self.empty(self.r), precision=self.precision, **scales)

    @property
    def gram(self) -> torch.Tensor:
        """``Gn = X X^T / ||X||^2`` (``||X||^2 + tiny``: a zero matrix gives 0, as GramPlan does)."""
        if 1 not in self._squares:
            self._squares[1] = self.symmetric(self.X, self.X.mT,
                                              alpha_per_matrix=_vector(1.0 / (self.scale**2 + _TINY)))
        return self._squares[1]

    def _gram_square(self, exponent: int) -> torch.Tensor:
        if exponent == 1:
            return self.gram
        if exponent not in self._squares:
            half = self._gram_square(exponent // 2)
            self._squares[exponent] = self.symmetric(half, half)
        return self._squares[exponent]

    def gram_power(self, k: int) -> torch.Tensor:
        """``Gn^k``; the squares commute, so every product is symmetric and computes half the tiles."""
        return repeated_squaring(k, self._gram_square, self.symmetric)

    def polar(self, coefficients, out: torch.Tensor | None = None) -> torch.Tensor:
        """``Q`` (fp32, cached), or with ``out`` the last step written straight into ``out``.

        Step one reuses the Gram (``A0 = Gn / 1.01^2``, folded into its coefficients) and reads ``X``
        itself with the per-matrix scale ``1 / (1.01 ||X||)`` in the product's epilogue.
        """
        if self._polar is not None:
            return self._polar if out is None else out.copy_(self._polar)
        shrink = 1.0 / NORMALIZATION_MARGIN
        first = _vector(self.inv * shrink)
        A, B = self.empty(self.r), self.empty(self.r)
        buffers = (self.empty(), self.empty())
        current, last = self.X, len(coefficients) - 1
        for step, (a, b, c) in enumerate(coefficients):
            if step == 0:
                ext.poly_step(self.gram, B, b * shrink**2, c * shrink**4, precision=self.precision)
                scales = {"alpha_per_matrix": first, "beta_per_matrix": first}
            else:
                ext.syrk(current, current.mT, A, precision=self.precision)
                ext.poly_step(A, B, b, c, precision=self.precision)
                scales = {}
            target = out if out is not None and step == last else buffers[step % 2]
            current = ext.gemm(B, current, target, y=current, beta=a, precision=self.precision, **scales)
        if out is None:
            self._polar = current
        return current

    def direction_into(self, p: int, coefficients, out: torch.Tensor) -> torch.Tensor:
        """``out = S_p`` (wide): ``||X||^p Gn^k Q`` for ``p = 2k``, ``||X||^p Gn^k Xn`` for ``2k + 1``."""
        if p == 0:
            return self.polar(coefficients, out=out)
        if p == 1:
            return out.copy_(self.X)
        if p % 2 == 0:
            base, factor = self.polar(coefficients), self.scale**p
        else:
            base, factor = self.X, self.scale**p * self.inv
        return ext.gemm(self.gram_power(p // 2), base, out, alpha_per_matrix=_vector(factor),
                        precision=self.precision)

    def power(self, p: int, coefficients) -> torch.Tensor:
        """``S_p`` (wide) in fp32."""
        return self.X.to(torch.float32) if p == 1 else self.direction_into(p, coefficients, self.empty())

    def top_projector(self, tau, sign_coefficients) -> torch.Tensor:
        """``P_top = (I + msign(Gn - (tau / ||X||)^2 I)) / 2`` on the small side."""
        scale = self.scale[..., None, None]
        nonzero = scale > 0
        ratio_sq = torch.where(nonzero, (tau / torch.where(nonzero, scale, 1.0)) ** 2, 1.0)
        J = sign_chain(self.gram - ratio_sq * self.identity(), sign_coefficients, self.precision)
        return (J + self.identity()) * 0.5

    def band_into(self, p: int, band: BandSpec, polar_coefficients, sign_coefficients, out: torch.Tensor):
        """:func:`~spectral_ops.backends.torch_backend.band_combination`, with the one product by
        ``P_top`` on ``gemm`` and its added term in the epilogue."""
        P = self.top_projector(band.tau, sign_coefficients)
        S = self.power(p, polar_coefficients)
        X = self.X
        if band.mode == "top":  # X + P (S - X)
            return ext.gemm(P, S - X, out, y=X, beta=1.0, precision=self.precision)
        if band.mode == "bot":  # S + P (X - S)
            return ext.gemm(P, X - S, out, y=S, beta=1.0, precision=self.precision)
        if band.mode == "top_only":
            return ext.gemm(P, S, out, precision=self.precision)
        if band.mode == "bot_only":  # S - P S
            return ext.gemm(P, S, out, alpha=-1.0, y=S, beta=1.0, precision=self.precision)
        S_bot = self.power(band.p_bot, polar_coefficients) * band.lambda_bot
        return ext.gemm(P, S * band.lambda_top - S_bot, out, y=S_bot, beta=1.0, precision=self.precision)

    def svt_into(self, t, polar_coefficients, sign_coefficients, out: torch.Tensor) -> torch.Tensor:
        """``prox_{t ||.||_*}(W) = P_top(t) (X - t Q)`` (wide, SPEC 1.4)."""
        P = self.top_projector(t, sign_coefficients)
        return ext.gemm(P, self.X - t * self.polar(polar_coefficients), out, precision=self.precision)


def sign_chain(A: torch.Tensor, coefficients, precision: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``msign(A)`` of symmetric ``A``: normalise by ``||A||_F`` in fp32, then one sign step per
    coefficient triple, alternating between two fp32 buffers; the last step writes ``out`` if given."""
    norm = torch.linalg.vector_norm(A, dim=(-2, -1), dtype=torch.float32)[..., None, None]
    Z = A.to(torch.float32) / (norm + _TINY)
    buffers = (Z, torch.empty_like(Z))
    workspace = (torch.empty_like(Z), torch.empty_like(Z))
    last = len(coefficients) - 1
    for step, coefficient in enumerate(coefficients):
        target = out if out is not None and step == last else buffers[(step + 1) % 2]
        Z = ext.sign_step(Z, target, coefficient, workspace=workspace, precision=precision)
    return Z


class CudaBackend:
    name = "cuda"
    needs_self_check = True

    def __init__(self, *, path: str | None = None, precision: str | None = None):
        self.module, self._load_error = ext.load_extension()
        from_env = os.environ.get(PRECISION_VAR, "").strip().lower()
        self.precision = precision or from_env or DEFAULT_PRECISION
        if self.precision not in ext.PRECISION_CODES:
            raise ValueError(f"{PRECISION_VAR} must be one of {', '.join(ext.PRECISION_CODES)}, got {self.precision!r}")
        self._pinned_path = path
        self._verified: dict[tuple, bool] = {}
        self._reference = TorchBackend()

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        if self.module is None:
            return self._load_error
        count, message = self.module.device_status()
        if count == 0:
            return f"the extension is built but sees no CUDA device ({message})"
        if device is not None and device.type != "cuda":
            return f"it runs on CUDA tensors only, not on {device.type} tensors"
        if device is not None and torch.cuda.get_device_capability(device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(device)
            return f"the kernels use sm_80 tensor-core instructions (bf16/tf32 WMMA); this GPU is sm_{major}{minor}"
        return None

    def supports(self, op: str, W: torch.Tensor) -> bool:
        if W.dtype not in KERNELS.get(op, ()) or self._path(op, W) is None:
            return False
        return all(self._path_verified(op, W.dtype, W.device, path) for path in self._paths(op, W))

    # ----- routing -----

    def _path(self, op: str, W: torch.Tensor) -> str | None:
        """``"chain"``, ``"tiled"``, or None where neither is meant to win (see the constants above)."""
        if self._pinned_path is not None:
            return self._pinned_path
        r, n = sorted(W.shape[-2:])
        if op in CHAIN_OPS and r * r * n <= CHAIN_MAX_WORK and self._chain_fits(W, r):
            return "chain"
        return "tiled" if r >= TILED_MIN_SIDE else None

    def _chain_fits(self, W: torch.Tensor, r: int) -> bool:
        if r > self.module.small_chain_max_side:
            return False
        return self.module.small_chain_shared_bytes(r, CHAIN_WORST_POWER) <= _shared_memory_optin(W.device)

    def _paths(self, op: str, W: torch.Tensor) -> tuple[str, ...]:
        # Band and prox decays have no chain form: a decay_ routed to the chain may also run tiled.
        path = self._path(op, W)
        return ("chain", "tiled") if path == "chain" and op == "decay_" else (path,)

    def _on_chain(self, op: str, W: torch.Tensor, p: int, coefficients) -> bool:
        # A chain call carries its Polar Express steps in the launch (at most small_chain_max_steps).
        steps_fit = p % 2 == 1 or len(coefficients) <= self.module.small_chain_max_steps
        return op in CHAIN_OPS and steps_fit and self._path(op, W) == "chain"

    # The dispatcher's self-check runs one small input, which takes one path; a weight routed to the
    # other one is checked first on the same input forced down that path.
    def _path_verified(self, op: str, dtype: torch.dtype, device: torch.device, path: str) -> bool:
        from .. import dispatch

        return dispatch.verify_pinned_path(self.name, path, lambda: CudaBackend(path=path, precision=self.precision), op, dtype, device, self._verified)

    # ----- ops -----

    def polar(self, W, coefficients):
        return self.spectral_power(W, 0, coefficients)

    def msign(self, A, coefficients):
        out = torch.empty_like(A)
        sign_chain(A, coefficients, self.precision, out=out)
        return out

    def spectral_power(self, W, p, coefficients):
        if p == 1:
            return W.clone()
        out = torch.empty_like(W)
        if self._on_chain("spectral_power", W, p, coefficients):
            ext.small_chain(_wide(W), _wide(out), p, coefficients if p % 2 == 0 else ())
        else:
            _Plan(W, self.precision).direction_into(p, coefficients, _wide(out))
        return out

    def band_projectors(self, W, tau, sign_coefficients):
        plan = _Plan(W, self.precision)
        P_top = plan.top_projector(tau, sign_coefficients)
        return P_top.to(W.dtype), (plan.identity() - P_top).to(W.dtype)

    def band_direction(self, W, p, band: BandSpec, polar_coefficients, sign_coefficients):
        out = torch.empty_like(W)
        _Plan(W, self.precision).band_into(p, band, polar_coefficients, sign_coefficients, _wide(out))
        return out

    def svt(self, W, t, polar_coefficients, sign_coefficients):
        out = torch.empty_like(W)
        _Plan(W, self.precision).svt_into(t, polar_coefficients, sign_coefficients, _wide(out))
        return out

    def decay_(self, W, request: DecayRequest):
        """Decay ``W`` in place: on the chain directly, else an fp32 direction written back once by the
        decay epilogue (``W`` is both an operand and the output of the last product)."""
        prox = request.p == 0 and request.p0_mode == "prox" and request.band is None
        plain = request.band is None and not prox
        if plain and request.p == 1:
            return self._reference.decay_(W, request)  # elementwise: no spectral math to run
        batch, device = W.shape[:-2], W.device
        keep = _scale(-request.ordinary_scale if prox else 1.0 - request.ordinary_scale, batch, device)
        step = _scale(1.0 if prox else -request.spectral_scale, batch, device)
        if plain and self._on_chain("decay_", W, request.p, request.polar_coefficients):
            X = _wide(W)
            steps = request.polar_coefficients if request.p % 2 == 0 else ()
            ext.small_chain(X, X, request.p, steps, alpha=keep["value"],
                            alpha_per_matrix=keep["per_matrix"], beta=step["value"], beta_per_matrix=step["per_matrix"])
            return W
        plan = _Plan(W, self.precision)
        D = torch.empty(W.shape, dtype=torch.float32, device=device)
        if prox:
            plan.svt_into(request.spectral_scale, request.polar_coefficients, request.sign_coefficients, _wide(D))
        elif request.band is not None:
            plan.band_into(request.p, request.band, request.polar_coefficients, request.sign_coefficients, _wide(D))
        else:
            plan.direction_into(request.p, request.polar_coefficients, _wide(D))
        ext.decay_epilogue_(W, D, keep["value"], step["value"], alpha_per_matrix=keep["per_matrix"],
                            beta_per_matrix=step["per_matrix"])
        return W
