"""Argument validation shared by the public API, and the finiteness checks of tensors (the ops' and the
optimizers').

Every check runs before any tensor is written, so a rejected call leaves weights bitwise intact.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections import defaultdict
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
    """Raise ``error`` if any tensor holds NaN or Inf (one host read per device), naming the first
    one by its position in ``tensors``."""
    tensors = list(tensors)
    finite = within_limits([(i, t, finite_limit(t)) for i, t in enumerate(tensors)], [True] * len(tensors))
    if not all(finite):
        where = f"{name}[{finite.index(False)}]" if len(tensors) > 1 else name
        raise error(f"{where} {reason}")


def finite_limit(tensor: torch.Tensor) -> float:
    """The largest finite magnitude of ``tensor``'s dtype: the limit of a check for NaN and Inf."""
    return torch.finfo(tensor.dtype).max


def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as two real ones, as torch's Adam treats it: the moments are those of the real
    and the imaginary parts, never ``g * g`` of the complex values."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def largest_magnitude_each(tensors) -> list:
    """The largest magnitude of each tensor (NaN when it holds one), as 0-d tensors on its device."""
    if tensors[0].device.type == "cpu":
        # torch's multi-tensor infinity norm is not vectorised on a CPU: aminmax is ~10x faster.
        pairs = [torch.aminmax(real_view(tensor)) for tensor in tensors]
        return [torch.maximum(high, -low) for low, high in pairs]
    return list(torch._foreach_norm(tensors, float("inf")))


def within_limits(checks, on_host: list) -> list:
    """Whether the tensor of each ``(_, tensor, limit)`` check is at most its limit in magnitude (NaN
    never is): a Python bool where ``on_host`` says so (one read per device for all of them), else a
    0-d bool tensor on its device, computed without copying a host value to the device (a captured
    graph could not replay that)."""
    results = [True] * len(checks)
    by_device = defaultdict(list)
    for position, (_, tensor, _) in enumerate(checks):
        if tensor.numel():
            by_device[tensor.device].append(position)
    for device, positions in by_device.items():
        if device.type == "cpu" and all(on_host[i] for i in positions):
            # Read on the host anyway: each tensor's extremes in one copy (aminmax, then one stack),
            # compared in Python, a third of the small ops of the device-side comparison.
            extremes = torch.stack([x for i in positions for x in torch.aminmax(real_view(checks[i][1]))]).tolist()
            for k, i in enumerate(positions):
                low, high = extremes[2 * k:2 * k + 2]
                results[i] = high <= checks[i][2] and -low <= checks[i][2]  # False for NaN
            continue
        largest = largest_magnitude_each([checks[i][1] for i in positions])
        within = torch.stack(torch._foreach_div(largest, [checks[i][2] for i in positions])) <= 1
        values = within.tolist() if any(on_host[i] for i in positions) else None
        for index, (position, flag) in enumerate(zip(positions, within.unbind(0))):
            results[position] = values[index] if on_host[position] else flag
    return results


def conjunction(flags: list):
    """The conjunction of Python bools and 0-d bool tensors (True when there is nothing to check)."""
    result = True
    for flag in flags:
        if flag is False:
            return False
        if flag is not True:
            result = flag if result is True else result & flag
    return result


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` share a memory location: an expanded view (a stride 0 over a size
    above 1), or strides that overlap (``base.as_strided((64, 32), (1, 1))``, ``unfold``'s windows). An in-place
    write through it writes such a location once per element, the last one winning, so no in-place result
    means anything there. From the sizes and strides alone, nothing read: taken in order of stride, each dim
    that steps past the reach of those below it (every layout slicing, transposing or permuting makes) adds
    no repeat; else the offsets are counted (a layout only ``as_strided`` makes)."""
    if tensor.is_contiguous():
        return False
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    reach = 1  # one past the largest offset of the dims so far
    for stride, size in dims:
        if stride == 0:
            return True
        if stride < reach:  # not evident either way: count the distinct offsets
            offsets = torch.zeros((), dtype=torch.int64)
            for dim_size, dim_stride in zip(tensor.shape, tensor.stride()):
                offsets = offsets.unsqueeze(-1) + torch.arange(dim_size) * dim_stride
            return offsets.unique().numel() < tensor.numel()
        reach += (size - 1) * stride
    return False


def shared_memory_error(tensor: torch.Tensor, name: str, fix: str) -> ValueError:
    """The error of a ``tensor`` to be written in place whose elements share memory (:func:`overlaps_itself`);
    ``fix`` names the way to a copy of its own, for the caller's use."""
    return ValueError(f"{name} has elements that share memory (shape {tuple(tensor.shape)}, strides "
                      f"{tuple(tensor.stride())}: an expanded view or overlapping strides), so an in-place write would "
                      f"write some locations once per element; nothing was written. {fix}")


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


# The largest |p| (and floor eps, relative to s_max) the ops take. s^p moves by p times a relative change
# of s, so at |p| = 1000 float32's own rounding of W (6e-8) already moves S_p by 6e-5, and every mode
# below 0.5 s_max is weighed 2^-1000 of the top (below float64's range). A floor above EPS_BOUND
# dominates every mode to float64's rounding: (s^2 + (eps s_max)^2)^(p/2) is (eps s_max)^p (1 + p s^2 /
# (2 eps^2 s_max^2)), the polar factor scaled, to within |p| 5e-17.
POWER_BOUND = 1000
EPS_BOUND = 1e8


def check_power(p, name: str = "p", *, eps=None, decay: bool = False, capturable: bool = False,
                eps_name: str = "eps"):
    """A real power as the ops take it: an int where it is integral (``2.0`` is 2), else a float, with
    ``|p| <=`` :data:`POWER_BOUND`; ``eps_name``: what the caller calls the floor.

    ``eps`` floors the spectrum, ``U diag((s^2 + (eps s_max)^2)^(p/2)) V^T``; ``p < 0`` needs one (without
    it the small singular values blow up) and is refused for a ``decay``, which it would turn into growth
    of the small modes. A 0-d tensor is read, unless ``capturable``: it then stays on its device and
    needs ``eps``, as its sign is not known on the host (a value beyond ``plan.TENSOR_POWER_BOUND``
    gives NaN).
    """
    if isinstance(p, torch.Tensor) and capturable and not decay:
        if p.dim() != 0 or not p.is_floating_point():
            raise ValueError(f"{name} must be a real number or a 0-d floating tensor, got {p.dim()}-d {p.dtype}")
        if eps is None:
            raise ValueError(f"{name} held in a tensor is floored either way (its sign is not read on the host): "
                             "pass eps > 0 (relative to s_max)")
        check_eps(eps, eps_name)
        return p
    if isinstance(p, torch.Tensor) and p.dim() == 0:
        p = p.item()
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not math.isfinite(p):
        raise ValueError(f"{name} must be a finite real number, got {p!r}")
    if abs(p) > POWER_BOUND:
        raise ValueError(f"{name}={p:g} is beyond the powers the ops take (|{name}| <= {POWER_BOUND}): a power moves "
                         f"by |{name}| times a relative change of a singular value, so the input's own rounding would "
                         f"decide the result, and every mode below half the largest would weigh under 2^-{POWER_BOUND} "
                         "of it; pass a power in that range")
    if p < 0 and decay:
        raise ValueError(f"{name}={p} < 0 cannot be a decay: s -> s - c s^p would shrink the small singular values "
                         "most and, as s -> 0, without bound (and grow them with c < 0); use p >= 0")
    if p < 0 and eps is None:
        raise ValueError(f"{name}={p} < 0 needs a floor: pass eps > 0 (relative to s_max) for "
                         "U diag((s^2 + (eps s_max)^2)^(p/2)) V^T; without one the small singular values blow up")
    if eps is not None:
        check_eps(eps, eps_name)
    return int(p) if float(p).is_integer() else float(p)


def check_eps(eps, name: str = "eps") -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < math.inf:
        raise ValueError(f"{name} must be a finite number > 0 (relative to s_max), got {eps!r}")
    if eps > EPS_BOUND:
        raise ValueError(f"{name}={eps:g} is beyond the floors the ops take ({name} <= {EPS_BOUND:g}, relative to "
                         "s_max): above it the floor outweighs every singular value to float64's rounding, so the "
                         f"result is (eps s_max)^p times the polar factor; pass a smaller {name}, or scale the polar "
                         "factor")


# The most steps an iteration takes: Polar Express converges from 1e-3 in 8 and from fp32's epsilon in
# about 12, Newton-Schulz's sign in about 30; a count in the thousands is a mistake (a training run's
# steps?), whose design and iteration would run for minutes.
STEPS_BOUND = 1000


def check_count(value, name: str) -> int:
    """``value`` as a count: an integer >= 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_steps(steps, name: str = "steps"):
    if steps is None:
        return None
    check_count(steps, name)
    if steps > STEPS_BOUND:
        raise ValueError(f"{name}={steps} is beyond the iterations' steps, at most {STEPS_BOUND}: Polar Express "
                         "converges in about 12 and Newton-Schulz's sign in about 30")
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


# torch's decorators (torch.no_grad's frame) between a user's call and the package's function.
DECORATOR_MODULES = ("torch.utils._contextlib",)


def user_stacklevel() -> int:
    """The ``warnings.warn`` stack level of the first caller outside spectral_ops, counted from the
    function that calls this one: a warning then names the user's line, however deep the package's
    own calls are."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_globals.get("__name__", "").startswith("spectral_ops")
                                 or frame.f_globals.get("__name__") in DECORATOR_MODULES):
        frame, level = frame.f_back, level + 1
    return level
