"""The Python side of the ``spectral_ops._C`` ABI.

``_C`` does not link libtorch, so that one wheel serves every torch version: a tensor crosses as
``(data pointer, shape, strides in elements, dtype code, device index)`` and the stream as an
integer ``cudaStream_t``. ``_C`` validates shapes, dtypes, strides, alignment and devices itself,
before any CUDA call; this module checks only what it cannot see (autograd, tensor kinds, scalars).

Every op runs on the caller's current stream and writes the tensors it is given (``out``, or ``w``
in place); scalars are Python numbers, and per-matrix factors held on the device are passed as
float32 tensors (``*_per_matrix``), so no call synchronises with the host.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import json
import numbers
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from .build_config import BUILD_INFO_FILENAME
from .coefficients import NORMALIZATION_MARGIN

# spectral_ops::DType in csrc/common.h. The codes are ABI: append only.
# int16: only a stochastic rounding's random bits (decay_epilogue_'s noise); the kernels refuse it elsewhere.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int16: 4}
# spectral_ops::Precision in csrc/matmul.h: how float32 operands of gemm/syrk use the tensor cores.
PRECISION_CODES = {"ieee": 0, "tf32x3": 1, "tf32": 2}


# Files an installer unpacks together get its clock's times in any order: only a module built this
# much later than the record is taken to be another build's.
_STALE_RECORD_MARGIN_NS = 2_000_000_000


def _module_beside(folder: Path) -> Path | None:
    """The ``_C`` extension module in ``folder``, under any file name this interpreter imports."""
    return next((folder / f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
                 if (folder / f"_C{suffix}").exists()), None)


def build_info(folder: Path = Path(__file__).parent) -> dict | None:
    """The record the build wrote (``_build_info.json`` in the package's ``folder``), or None when there
    is none or it does not describe the ``_C`` module beside it.

    A build writes its record after its module, so a module newer than the record is another build's:
    e.g. ``cuda_built: false`` left by a CPU-only editable install, then ``_C`` built in the tree by
    CMake (``bench/gpu_check.py`` on a bare GPU machine). That record says nothing about this module."""
    path = folder / BUILD_INFO_FILENAME
    try:
        info = json.loads(path.read_text())
        recorded_ns = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    module = _module_beside(folder)
    if module is not None and module.stat().st_mtime_ns > recorded_ns + _STALE_RECORD_MARGIN_NS:
        return None
    return info


@functools.cache
def load_extension() -> tuple[ModuleType | None, str]:
    """``(module, "")``, or ``(None, why it is unavailable)``."""
    info = build_info()
    # Trust the record over the file system: a module left from an earlier build is stale.
    if info is not None and not info["cuda_built"]:
        return None, f"the CUDA extension was not built: {info['reason']}"
    try:
        return importlib.import_module("spectral_ops._C"), ""
    except ImportError as exc:
        if info is None:
            return None, (f"the CUDA extension is not built here (no {BUILD_INFO_FILENAME} describes it; "
                          f"import says: {exc})")
        return None, f"the CUDA extension was built but does not import: {exc}"


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise TypeError(f"spectral_ops._C takes {supported} tensors, not {dtype}") from None


def tensor_descriptor(t: torch.Tensor) -> tuple:
    """The arguments that describe one tensor to ``_C``."""
    if t.layout != torch.strided:
        raise TypeError(f"spectral_ops._C takes strided (dense) tensors, not {t.layout}")
    return (t.data_ptr(), list(t.shape), list(t.stride()), dtype_code(t.dtype), t.get_device())


def current_stream_handle(device: torch.device) -> int:
    """The caller's current stream on ``device`` as an integer ``cudaStream_t``."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def _require_extension() -> ModuleType:
    module, reason = load_extension()
    if module is None:
        raise RuntimeError(f"spectral_ops._C is unavailable: {reason}")
    return module


def _number(op: str, name: str, value) -> float:
    # float() of a CUDA tensor would synchronise and break CUDA graph capture: tensors go through
    # the *_per_matrix arguments, as device pointers.
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a Python number, not {type(value).__name__}")
    return float(value)


def _optional_descriptor(t: torch.Tensor | None):
    return None if t is None else tensor_descriptor(t)


def _writable(op: str, name: str, t: torch.Tensor) -> None:
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{op}: {name} requires grad; write it under torch.no_grad()")


def _stream(t: torch.Tensor) -> int:
    return current_stream_handle(t.device) if t.is_cuda else 0


def _precision(op: str, precision: str) -> int:
    try:
        return PRECISION_CODES[precision]
    except KeyError:
        raise ValueError(f"{op}: precision must be one of {', '.join(PRECISION_CODES)}, got {precision!r}") from None


# ----- the ABI as torch.library custom ops ----------------------------------------------------------------
# Registered as opaque ops in the spectral_ops namespace: torch.compile traces through their fake
# (meta) implementations without a graph break, and torch bumps the autograd version counter of what
# they write (mutates_args). Every op writes tensors it is given, so the fakes only return None.


def _custom_op(name: str, mutates: tuple[str, ...]):
    def register(implementation):
        op = torch.library.custom_op(f"spectral_ops::{name}", implementation, mutates_args=mutates)
        op.register_fake(lambda *args, **kwargs: None)
        return op

    return register


@_custom_op("cuda_decay_epilogue", mutates=("w",))
def _decay_epilogue_op(w: torch.Tensor, d: torch.Tensor, keep: float, step: float,
                       keep_per_matrix: Optional[torch.Tensor], step_per_matrix: Optional[torch.Tensor],
                       noise: Optional[torch.Tensor]) -> None:
    _require_extension().decay_epilogue_(
        w=tensor_descriptor(w), d=tensor_descriptor(d), keep=keep, step=step, stream=_stream(w),
        keep_per_matrix=_optional_descriptor(keep_per_matrix), step_per_matrix=_optional_descriptor(step_per_matrix),
        noise=_optional_descriptor(noise),
    )


def _matmul_op(name: str):
    @_custom_op(f"cuda_{name}", mutates=("out",))
    def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, y: Optional[torch.Tensor], alpha: float,
               alpha_per_matrix: Optional[torch.Tensor], beta: float, beta_per_matrix: Optional[torch.Tensor],
               precision: int) -> None:
        getattr(_require_extension(), name)(
            a=tensor_descriptor(a), b=tensor_descriptor(b), out=tensor_descriptor(out), y=_optional_descriptor(y),
            alpha=alpha, alpha_per_matrix=_optional_descriptor(alpha_per_matrix), beta=beta,
            beta_per_matrix=_optional_descriptor(beta_per_matrix), precision=precision, stream=_stream(out),
        )

    return matmul


_gemm_op, _syrk_op = _matmul_op("gemm"), _matmul_op("syrk")


@_custom_op("cuda_poly_step", mutates=("out",))
def _poly_step_op(a: torch.Tensor, out: torch.Tensor, b: float, c: float, precision: int) -> None:
    _require_extension().poly_step(a=tensor_descriptor(a), out=tensor_descriptor(out), b=b, c=c, precision=precision,
                                   stream=_stream(out))


@_custom_op("cuda_sign_step", mutates=("out", "square_workspace", "poly_workspace"))
def _sign_step_op(z: torch.Tensor, out: torch.Tensor, square_workspace: torch.Tensor, poly_workspace: torch.Tensor,
                  a: float, b: float, c: float, precision: int) -> None:
    _require_extension().sign_step(
        z=tensor_descriptor(z), out=tensor_descriptor(out), square_workspace=tensor_descriptor(square_workspace),
        poly_workspace=tensor_descriptor(poly_workspace), a=a, b=b, c=c, precision=precision, stream=_stream(out),
    )


@_custom_op("cuda_small_chain", mutates=("out", "x_workspace", "gram_workspace"))
def _small_chain_op(w: torch.Tensor, out: torch.Tensor, x_workspace: Optional[torch.Tensor],
                    gram_workspace: Optional[torch.Tensor], p: int, coefficients: list[float], shrink: float) -> None:
    _require_extension().small_chain(
        w=tensor_descriptor(w), out=tensor_descriptor(out), x_workspace=_optional_descriptor(x_workspace),
        gram_workspace=_optional_descriptor(gram_workspace), p=p,
        coefficients=[tuple(coefficients[i:i + 3]) for i in range(0, len(coefficients), 3)], shrink=shrink,
        stream=_stream(out),
    )


# ----- the Python API over them -------------------------------------------------------------------------


def decay_epilogue_(
    w: torch.Tensor,
    d: torch.Tensor,
    keep: float,
    step: float,
    *,
    keep_per_matrix: torch.Tensor | None = None,
    step_per_matrix: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w <- keep * w + step * d`` in place on the current stream; returns ``w``.

    ``w``: float32/float16/bfloat16/float64, any non-overlapping strides. ``d``: contiguous, same
    shape, float32 or ``w``'s dtype. ``keep_per_matrix``/``step_per_matrix``: optional float32
    tensors with one factor per matrix of ``w``'s leading dims (row-major), multiplying ``keep``/``step``.
    ``noise``: int16 random bits of ``w``'s shape (contiguous), with which a float16/bfloat16 ``w`` is
    rounded stochastically, element ``i`` (row-major) by ``noise``'s element ``i``, by the rule of
    :func:`spectral_ops.backends.torch_backend.round_stochastic`. See csrc/ops.h.
    """
    _require_extension()
    keep, step = _number("decay_epilogue_", "keep", keep), _number("decay_epilogue_", "step", step)
    _writable("decay_epilogue_", "w", w)
    _decay_epilogue_op(w, d, keep, step, keep_per_matrix, step_per_matrix, noise)
    return w


def _matmul(op, name: str, a, b, out, alpha, beta, y, alpha_per_matrix, beta_per_matrix, precision) -> torch.Tensor:
    _require_extension()
    alpha, beta = _number(name, "alpha", alpha), _number(name, "beta", beta)
    _writable(name, "out", out)
    op(a, b, out, y, alpha, alpha_per_matrix, beta, beta_per_matrix, _precision(name, precision))
    return out


def gemm(a, b, out, *, alpha=1.0, beta=0.0, y=None, alpha_per_matrix=None, beta_per_matrix=None,
         precision: str = "tf32x3") -> torch.Tensor:
    """``out = alpha * (a @ b) + beta * y`` on the current stream; returns ``out``.

    ``a (..., m, k)``, ``b (..., k, n)``, ``out`` and ``y (..., m, n)``: float32, float16 or bfloat16,
    equal leading dims, any strides; ``y`` may be ``out`` itself, ``out`` must not overlap ``a`` or
    ``b``. Products accumulate in fp32 and ``out`` is rounded once. ``precision`` decides how float32
    operands use the tensor cores: ``"ieee"`` (fp32 FMA) or ``"tf32x3"`` (about fp32 accuracy);
    float16 and bfloat16 pairs always use them. ``*_per_matrix``: optional float32 tensors with one
    factor per matrix, multiplying ``alpha``/``beta``.
    """
    return _matmul(_gemm_op, "gemm", a, b, out, alpha, beta, y, alpha_per_matrix, beta_per_matrix, precision)


def syrk(a, b, out, *, alpha=1.0, beta=0.0, y=None, alpha_per_matrix=None, beta_per_matrix=None,
         precision: str = "tf32x3") -> torch.Tensor:
    """:func:`gemm` for a symmetric ``a @ b`` (``x @ x.mT``, ``A @ A`` for symmetric ``A``, commuting
    symmetric factors): only the lower-triangle tiles are computed, and stored mirrored. ``y`` is read
    on its lower triangle only."""
    return _matmul(_syrk_op, "syrk", a, b, out, alpha, beta, y, alpha_per_matrix, beta_per_matrix, precision)


def poly_step(a: torch.Tensor, out: torch.Tensor, b: float, c: float, *, precision: str = "tf32x3") -> torch.Tensor:
    """``out = b * a + c * a @ a`` for symmetric ``a (..., r, r)``, one symmetric-product launch."""
    _require_extension()
    _writable("poly_step", "out", out)
    _poly_step_op(a, out, _number("poly_step", "b", b), _number("poly_step", "c", c),
                  _precision("poly_step", precision))
    return out


def sign_step(z: torch.Tensor, out: torch.Tensor, coefficients, *, workspace=None,
              precision: str = "tf32x3") -> torch.Tensor:
    """One matrix-sign step ``out = z (a I + b z^2 + c z^4)`` for symmetric ``z`` and
    ``coefficients = (a, b, c)``, e.g. ``(3, -16/5, 6/5)``. ``workspace``: two float32 tensors shaped
    like ``z`` (allocated when omitted)."""
    _require_extension()
    a, b, c = (_number("sign_step", name, v) for name, v in zip("abc", coefficients))
    if workspace is None:
        workspace = tuple(torch.empty(z.shape, dtype=torch.float32, device=z.device) for _ in range(2))
    _writable("sign_step", "out", out)
    _sign_step_op(z, out, *workspace, a, b, c, _precision("sign_step", precision))
    return out


def small_chain(w: torch.Tensor, out: torch.Tensor, p: int, coefficients=(), *, workspace=None,
                shrink: float = 1.0 / NORMALIZATION_MARGIN) -> torch.Tensor:
    """``out = S_p(w)`` for wide ``w (..., r, n)`` with ``r <= 128``, one thread block per matrix, fp32
    math; ``out`` may be ``w`` itself.

    Even ``p`` runs Polar Express with ``coefficients`` (one ``(a, b, c)`` per step) from
    ``w * shrink / ||w||_F``. ``workspace``: ``(x, gram)``, float32 contiguous tensors of shapes
    ``w.shape`` and ``(..., r, r)`` (allocated when omitted; odd ``p`` needs neither, ``p = 0`` no gram).
    """
    _require_extension()
    if isinstance(p, bool) or not isinstance(p, numbers.Integral):
        raise TypeError(f"small_chain: p must be an int, not {type(p).__name__}")
    steps = [_number("small_chain", "coefficient", v) for step in coefficients for v in step]
    if workspace is None:
        x = gram = None
        if p % 2 == 0:
            x = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        if p % 2 == 0 and p >= 2:
            r = w.shape[-2]
            gram = torch.empty((*w.shape[:-2], r, r), dtype=torch.float32, device=w.device)
    else:
        x, gram = workspace
    _writable("small_chain", "out", out)
    _small_chain_op(w, out, x, gram, int(p), steps, _number("small_chain", "shrink", shrink))
    return out
