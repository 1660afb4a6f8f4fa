"""Triton kernels (``spectral_ops.triton_kernels``, from the top-level ``triton_kernels/`` folder) as a backend.

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter, used by the
tests) when the backend is forced. The primitives map onto the kernels, each registered as a
``spectral_ops::triton_*`` custom op so that ``torch.compile`` sees one opaque call:

* ``symmetric``, ``poly_step``: :mod:`~spectral_ops.triton_kernels.syrk` (lower tiles, mirrored);
* ``product``: :mod:`~spectral_ops.triton_kernels.update`, the ``alpha Y`` term fused (as the
  accumulator's start value when ``Y`` is ``Z``);
* ``sign_step``: :mod:`~spectral_ops.triton_kernels.sign_step`;
* ``small_chain``: :mod:`~spectral_ops.triton_kernels.small`, one program per matrix (``r <= 128``,
  in the shape classes that compile without spilling: :func:`~spectral_ops.triton_kernels.small.spill_free`);
* ``decay_epilogue_``: the elementwise form of :mod:`~spectral_ops.triton_kernels.decay`.

float32, float16 and bfloat16 are computed in float32 (products accumulate in fp32; fp32 operands are
multiplied with ``input_precision``, ``tf32x3`` by default, which keeps fp32 accuracy on the tensor
cores). float64 is left to the torch backend, and so is bfloat16 under the interpreter, which cannot
compute in it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Optional

import torch

from .. import environment
from ..compat import triton_too_old
from .base import number_and_per_matrix

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_PRECISION = "tf32x3"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None  # a file-system search: once per process


class _KernelModules:
    """The kernel modules, imported on first use: ``triton.jit`` reads TRITON_INTERPRET then."""

    def __getattr__(self, module: str):
        loaded = importlib.import_module(f"..triton_kernels.{module}", __package__)
        setattr(self, module, loaded)
        return loaded


modules = _KernelModules()


def _fresh(like: torch.Tensor, rows: int, cols: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A result in the operands' dtype (fp32 for the chain, which computes in fp32 whatever it reads)."""
    return like.new_empty((*like.shape[:-2], rows, cols), dtype=dtype or like.dtype)


def _scale(value: float, per_matrix: Optional[torch.Tensor]):
    return value if per_matrix is None else per_matrix


# ----- the kernels as custom ops (schemas take numbers and optional per-matrix tensors separately) --------


@torch.library.custom_op("spectral_ops::triton_symmetric", mutates_args=())
def _symmetric(L: torch.Tensor, R: torch.Tensor, precision: str) -> torch.Tensor:
    return modules.syrk.symmetric_product(L, R.mT, out=_fresh(L, L.shape[-2], L.shape[-2]), input_precision=precision)


@_symmetric.register_fake
def _(L, R, precision):
    return _fresh(L, L.shape[-2], L.shape[-2])


@torch.library.custom_op("spectral_ops::triton_product", mutates_args=())
def _product(M: torch.Tensor, Z: torch.Tensor, Y: Optional[torch.Tensor], alpha: float, beta: float,
             precision: str) -> torch.Tensor:
    out = _fresh(Z, *Z.shape[-2:])
    if Y is not None and modules.common.same_view(Y, Z):  # a X + B X: the accumulator starts at a X
        return modules.update.product(M, Z, alpha=alpha, gamma=beta, out=out, input_precision=precision)
    return modules.update.product(M, Z, alpha=alpha, Y=Y, beta=beta if Y is not None else 0.0, out=out,
                                  input_precision=precision)


@_product.register_fake
def _(M, Z, Y, alpha, beta, precision):
    return _fresh(Z, *Z.shape[-2:])


@torch.library.custom_op("spectral_ops::triton_poly_step", mutates_args=())
def _poly_step(A: torch.Tensor, b: float, c: float, precision: str) -> torch.Tensor:
    return modules.poly_step.poly_step(A, b, c, out=_fresh(A, *A.shape[-2:]), input_precision=precision)


@_poly_step.register_fake
def _(A, b, c, precision):
    return _fresh(A, *A.shape[-2:])


@torch.library.custom_op("spectral_ops::triton_sign_step", mutates_args=())
def _sign_step(Z: torch.Tensor, a: float, b: float, c: float, precision: str) -> torch.Tensor:
    return modules.sign_step.sign_step(Z, (a, b, c), out=_fresh(Z, *Z.shape[-2:]), input_precision=precision)


@_sign_step.register_fake
def _(Z, a, b, c, precision):
    return _fresh(Z, *Z.shape[-2:])


@torch.library.custom_op("spectral_ops::triton_small_chain", mutates_args=())
def _small_chain(X: torch.Tensor, p: int, coefficients: list[float], sign: bool, precision: str) -> torch.Tensor:
    triples = [coefficients[i:i + 3] for i in range(0, len(coefficients), 3)]
    out = _fresh(X, *X.shape[-2:], torch.float32)
    if sign:
        return modules.small.small_sign(X, triples, out=out, input_precision=precision)
    return modules.small.small_spectral(X, p, triples, out=out, input_precision=precision)


@_small_chain.register_fake
def _(X, p, coefficients, sign, precision):
    return _fresh(X, *X.shape[-2:], torch.float32)


@torch.library.custom_op("spectral_ops::triton_decay_epilogue", mutates_args=("W",))
def _decay_epilogue(W: torch.Tensor, D: Optional[torch.Tensor], keep: float, keep_per_matrix: Optional[torch.Tensor],
                    step: float, step_per_matrix: Optional[torch.Tensor], precision: str,
                    noise: Optional[torch.Tensor]) -> None:
    modules.decay.decay_epilogue_(W, D, keep=_scale(keep, keep_per_matrix), step=_scale(step, step_per_matrix),
                                  input_precision=precision, noise=noise)


@_decay_epilogue.register_fake
def _(W, D, keep, keep_per_matrix, step, step_per_matrix, precision, noise):
    return None


class TritonBackend:
    name = "triton"
    needs_self_check = True

    def __init__(self, *, input_precision: str | None = None):
        from_env = environment.setting(environment.TRITON_PRECISION)
        self.input_precision = input_precision or from_env or DEFAULT_PRECISION

    def unavailable_reason(self, device: torch.device | None = None, forced: bool = False) -> str | None:
        if not triton_installed():
            return "triton is not installed (pip install triton)"
        too_old = triton_too_old()
        if too_old is not None:
            return too_old
        on_cpu = device is not None and device.type == "cpu"
        if on_cpu and not environment.triton_interpreted():
            return "Triton runs on CUDA tensors; CPU tensors need TRITON_INTERPRET=1 (the interpreter)"
        if on_cpu and not forced:
            return ("CPU tensors run on the Triton interpreter only when the triton backend is forced "
                    "(SPECTRAL_OPS_BACKEND=triton or use_backend('triton')): it is a testing aid, "
                    "far slower than torch")
        if device is None and not torch.cuda.is_available() and not environment.triton_interpreted():
            return "no CUDA device is visible to torch (and TRITON_INTERPRET=1 is not set)"
        if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(device)
            return f"the Triton kernels are configured for sm80 and newer, this GPU is sm_{major}{minor}"
        return None

    def supports(self, primitive: str, device, dtype, shape, steps: int = 0) -> bool:
        if dtype not in KERNEL_DTYPES:
            return False
        if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
            return False  # the interpreter has no bfloat16 arithmetic
        if primitive == "small_chain":  # only where its registers suffice: a spilling chain is no fast path
            return modules.small.spill_free(modules.common.arch(torch.device(device)), shape)
        return True

    def _dot_precision(self, precision) -> str:
        """How ``tl.dot`` multiplies fp32 operands: one TF32 pass for ``"tf32"``, else the configured
        fp32-accurate mode (``tf32x3``, or ``ieee``). bf16/fp16 operands run on the tensor cores as they are."""
        return "tf32" if precision == "tf32" else self.input_precision

    def symmetric(self, L, R, precision=None):
        return _symmetric(L, R, self._dot_precision(precision))

    def product(self, M, Z, precision=None, *, alpha=1.0, Y=None, beta=1.0):
        return _product(M, Z, Y, float(alpha), float(beta), self._dot_precision(precision))

    def poly_step(self, A, b, c, precision=None):
        return _poly_step(A, float(b), float(c), self._dot_precision(precision))

    def sign_step(self, Z, coefficient, precision=None):
        return _sign_step(Z, *map(float, coefficient), self._dot_precision(precision))

    def small_chain(self, X, p, coefficients, precision=None, sign=False):
        flat = [float(v) for triple in coefficients for v in triple]
        return _small_chain(X, p, flat, sign, self._dot_precision(precision))

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        batch = W.shape[:-2]
        _decay_epilogue(W, D, *number_and_per_matrix(keep, batch, W.device),
                        *number_and_per_matrix(step, batch, W.device),
                        self.input_precision, noise)
        return W
