"""The Python side of the ``spectral_ops._C`` ABI.

``_C`` does not link libtorch, so that one wheel serves every torch version: a tensor crosses as
``(data pointer, shape, strides in elements, dtype code, device index)`` and the stream as an
integer ``cudaStream_t``. ``_C`` validates shapes, dtypes, strides, alignment and devices itself,
before any CUDA call; this module checks only what it cannot see (autograd, tensor kinds, scalars).
"""

from __future__ import annotations

import functools
import importlib
import json
import numbers
from pathlib import Path
from types import ModuleType

import torch

from .build_config import BUILD_INFO_FILENAME

# spectral_ops::DType in csrc/common.h. The codes are ABI: append only.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def build_info() -> dict | None:
    """The record the build wrote (``_build_info.json``), or None when there is none."""
    try:
        return json.loads(Path(__file__).with_name(BUILD_INFO_FILENAME).read_text())
    except FileNotFoundError:
        return None


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
            return None, f"the CUDA extension is not built here (no {BUILD_INFO_FILENAME}; import says: {exc})"
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


def decay_epilogue_(
    w: torch.Tensor,
    d: torch.Tensor,
    alpha: float,
    beta: float,
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> torch.Tensor:
    """``w <- alpha * w + beta * d`` in place on the current stream; returns ``w``.

    ``w``: float32/float16/bfloat16/float64, any non-overlapping strides. ``d``: contiguous, same
    shape, float32 or ``w``'s dtype. Stochastic rounding (float16/bfloat16 ``w`` only) is a
    deterministic function of ``(seed, offset + row-major element index)``: advance ``offset`` by
    ``w.numel()`` per call for fresh bits under one seed. See csrc/ops.h.
    """
    module = _require_extension()
    for name, value in (("alpha", alpha), ("beta", beta)):
        # float() of a CUDA tensor would synchronise and break CUDA graph capture.
        if not isinstance(value, numbers.Real):
            raise TypeError(f"decay_epilogue_: {name} must be a Python number, not {type(value).__name__}")
    if w.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("decay_epilogue_: w requires grad; update it under torch.no_grad()")
    stream = current_stream_handle(w.device) if w.is_cuda else 0
    module.decay_epilogue_(
        tensor_descriptor(w),
        tensor_descriptor(d),
        float(alpha),
        float(beta),
        bool(stochastic_rounding),
        seed,
        offset,
        stream,
    )
    # The write bypassed torch, so tell autograd that w changed, as an in-place torch op would
    # (inference tensors have no version counter).
    if not w.is_inference():
        torch.autograd.graph.increment_version(w)
    return w
