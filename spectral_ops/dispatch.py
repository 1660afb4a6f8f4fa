"""The single point that decides which backend runs an op: CUDA extension, then Triton, then PyTorch.

The choice is made per call from the tensor's device, dtype and shape and from what is available.
``SPECTRAL_OPS_BACKEND=cuda|triton|torch`` or :func:`use_backend` force one; forcing a backend that
cannot run the call raises :class:`BackendUnavailableError` with the reason.

A GPU backend checks itself against the PyTorch reference the first time it is used for an
(op, dtype), on a small input. If they disagree it is disabled for the process with a warning
naming the op, so a wrong kernel never reaches a user's weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import warnings

import torch

from .backends.cuda_backend import CudaBackend
from .backends.torch_backend import TorchBackend
from .backends.triton_backend import TritonBackend
from .selfcheck import self_check_cases
from .testing import relative_error

logger = logging.getLogger("spectral_ops")

ENV_VAR = "SPECTRAL_OPS_BACKEND"
BACKEND_NAMES = ("cuda", "triton", "torch")

# Relative Frobenius error allowed between a backend and the reference on the self-check input.
# That input is well conditioned (singular values in [0.5, 1]), so the only differences are
# summation order and the final rounding to the dtype; a wrong kernel is off by O(1).
SELF_CHECK_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run the call; the message says why."""


_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("spectral_ops_backend", default=None)
_backends: dict[str, object] = {}
_self_check_passed: dict[tuple[str, str, torch.dtype], bool] = {}
_logged_choices: set[tuple] = set()
_last_choice: dict[str, str] = {}


def _check_name(name: str, source: str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"{source} must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Force a backend inside a ``with`` block (takes precedence over the environment)."""
    token = _forced.set(_check_name(name, "use_backend(name)"))
    try:
        yield
    finally:
        _forced.reset(token)


def forced_backend() -> str | None:
    name = _forced.get()
    if name is not None:
        return name
    env = os.environ.get(ENV_VAR, "").strip().lower()
    return _check_name(env, ENV_VAR) if env else None


def get_backend(name: str):
    """The backend instance for ``name`` (created on first use)."""
    if name not in _backends:
        factory = {"cuda": CudaBackend, "triton": TritonBackend, "torch": TorchBackend}[_check_name(name, "name")]
        _backends[name] = factory()
    return _backends[name]


def register_backend(backend) -> None:
    """Replace the backend called ``backend.name`` (for tests and out-of-tree backends)."""
    _backends[_check_name(backend.name, "backend.name")] = backend
    for key in [k for k in _self_check_passed if k[0] == backend.name]:
        del _self_check_passed[key]


def reset() -> None:
    """Forget backend instances, self-check results and recorded choices."""
    _backends.clear()
    _self_check_passed.clear()
    _logged_choices.clear()
    _last_choice.clear()


def backend_status(device: torch.device | None = None) -> list[tuple[str, str | None]]:
    """``(name, None if available else the reason)`` for each backend, in dispatch order."""
    return [(name, get_backend(name).unavailable_reason(device)) for name in BACKEND_NAMES]


def _why_not(backend, op: str, W: torch.Tensor) -> str | None:
    reason = backend.unavailable_reason(W.device)
    if reason is not None:
        return reason
    if not backend.supports(op, W):
        return f"the {backend.name} backend has no {op} kernel for {W.dtype} tensors of shape {tuple(W.shape)} on {W.device}"
    if not _passes_self_check(backend, op, W):
        return f"the {backend.name} backend failed its {op} self-check for {W.dtype} and is disabled"
    return None


def select(op: str, W: torch.Tensor):
    """The backend that runs ``op`` on ``W`` (also records the choice for :func:`last_backend`)."""
    forced = forced_backend()
    if forced is not None:
        backend = get_backend(forced)
        reason = _why_not(backend, op, W)
        if reason is not None:
            raise BackendUnavailableError(f"backend {forced!r} was forced for {op}, but {reason}")
    else:
        backend = next(b for b in map(get_backend, BACKEND_NAMES) if _why_not(b, op, W) is None)
    _record(op, backend, W)
    return backend


def backend_for(op: str, W: torch.Tensor) -> str:
    """The name of the backend that would run ``op`` on ``W`` now."""
    return select(op, W).name


def last_backend(op: str) -> str | None:
    """The backend the most recent call of ``op`` ran on, or None if it has not run."""
    return _last_choice.get(op)


def _record(op: str, backend, W: torch.Tensor) -> None:
    _last_choice[op] = backend.name
    key = (op, backend.name, W.device.type, W.dtype)
    if key not in _logged_choices:
        _logged_choices.add(key)
        logger.debug("spectral_ops: %s on %s %s runs on the %s backend", op, W.device.type, W.dtype, backend.name)


def _passes_self_check(backend, op: str, W: torch.Tensor) -> bool:
    if not backend.needs_self_check:
        return True
    key = (backend.name, op, W.dtype)
    if key not in _self_check_passed:
        error = self_check_error(backend, op, W.dtype, W.device)
        tolerance = SELF_CHECK_TOLERANCE[W.dtype]
        _self_check_passed[key] = error <= tolerance
        if not _self_check_passed[key]:
            warnings.warn(
                f"spectral_ops: the {backend.name} backend's {op} disagrees with the PyTorch reference "
                f"for {W.dtype} (relative error {error:.3g} > {tolerance:.1g}); it is disabled for "
                "this process and the next backend is used instead",
                RuntimeWarning,
                stacklevel=4,
            )
    return _self_check_passed[key]


def self_check_error(backend, op: str, dtype: torch.dtype, device) -> float:
    """Largest relative error of ``backend``'s ``op`` against the reference on a fixed input."""

    reference = get_backend("torch")
    worst = 0.0
    for run in self_check_cases(op, dtype, device):
        try:
            got, expected = run(backend), run(reference)
        except Exception as error:  # a crashing kernel fails its check like a wrong one
            logger.debug("spectral_ops: %s self-check of %s raised %r", backend.name, op, error)
            return float("inf")
        for g, e in zip(got, expected):
            error = relative_error(g, e)
            worst = max(worst, error if error == error else float("inf"))
    return worst


def verify_pinned_path(name: str, path: str, make_pinned, op: str, dtype: torch.dtype, device, cache: dict) -> bool:
    """Self-check one internal path of a backend (e.g. its small-matrix or tiled kernels) once.

    The first-use check runs one small input, which takes one path; before a call takes another,
    ``make_pinned()`` (the backend forced down ``path``) is checked on the same input. Results are
    kept in the backend's ``cache``; a failing path warns, and those calls go to the next backend.
    """
    key = (op, dtype, torch.device(device).type, path)
    if key not in cache:
        error = self_check_error(make_pinned(), op, dtype, device)
        tolerance = SELF_CHECK_TOLERANCE[dtype]
        cache[key] = error <= tolerance
        if not cache[key]:
            warnings.warn(
                f"spectral_ops: the {name} backend's {path} {op} path disagrees with the PyTorch reference "
                f"for {dtype} (relative error {error:.3g} > {tolerance:.1g}); those calls use the next backend",
                RuntimeWarning,
                stacklevel=6,
            )
    return cache[key]
