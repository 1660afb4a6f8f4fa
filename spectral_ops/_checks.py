"""Argument validation shared by the public API.

Every check runs before any tensor is written, so a rejected call leaves weights bitwise intact.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def check_matrix(W, name: str = "W") -> None:
    """A floating tensor of shape (..., m, n)."""
    if not isinstance(W, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(W).__name__}")
    if W.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {W.dtype}; spectral_ops supports float64, float32, float16 and bfloat16"
        )
    if W.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., m, n), got shape {tuple(W.shape)}")


def check_finite(tensors: Iterable[torch.Tensor], name: str = "W",
                 reason: str = "contains NaN or Inf; refusing to compute a spectral direction from it",
                 error: type[Exception] = ValueError) -> None:
    """Raise ``error`` if any tensor holds NaN or Inf, with one host sync for the whole list."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    # The largest magnitude of each tensor is finite exactly when the tensor is (NaN propagates):
    # one multi-tensor reduction, one read back.
    flags = torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf"))))
    bad = (~flags).nonzero().flatten().tolist()
    if bad:
        where = f"{name}[{bad[0]}]" if len(tensors) > 1 else name
        raise error(f"{where} {reason}")


def check_dtype(dtype, name: str = "dtype"):
    """None (the input's dtype) or one of the supported floating dtypes."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be None or one of torch.float64, torch.float32, torch.float16 and "
                        f"torch.bfloat16, got {dtype!r}")
    return dtype


def check_same_device(tensors: Iterable[torch.Tensor], name: str = "W") -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors in {name} must be on one device, got {sorted(map(str, devices))}")


def check_power(p, name: str = "p") -> int:
    """A non-negative integer power (bools and floats with a fraction are rejected)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Integral):
        if isinstance(p, numbers.Real) and not isinstance(p, bool) and float(p).is_integer():
            raise TypeError(f"{name} must be an int, got the float {p!r}; pass {int(p)}")
        raise ValueError(f"{name} must be a non-negative integer, got {p!r}")
    if p < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {p}")
    return int(p)


def check_steps(steps, name: str = "steps"):
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {steps!r}")
    return int(steps)


def check_coefficient(value, name: str, *, positive: bool = False, sync: bool = True):
    """A finite scalar >= 0 (or > 0): a Python number or a 0-d tensor, returned unchanged.

    0-d tensors stay tensors so that a step can be captured in a CUDA graph. Checking their value
    costs one host sync; ``sync=False`` (capturable steps) checks only their shape and dtype, and
    leaves the value to the check made when the optimizer was built.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a scalar or a 0-d tensor, got shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got dtype {value.dtype}")
        if not sync:
            return value
        number = float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{name} must be a real number or a 0-d tensor, got {type(value).__name__}")
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    if number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be {bound}, got {number}")
    return value


def check_choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value
