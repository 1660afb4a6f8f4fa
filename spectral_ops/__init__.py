"""spectral-ops: spectral-power weight decay ``S_p(W) = U diag(s^p) V^T`` without an SVD.

The public API is autograd-free and takes ``(..., m, n)`` tensors on CPU or CUDA in float64,
float32, float16 or bfloat16. ``spectral_ops.plan`` holds the algorithm, ``spectral_ops.dispatch``
routes each of its primitive calls to a backend (CUDA extension, then Triton, then PyTorch), and
``spectral_ops.reference`` holds the FP64 SVD oracles.

The package is seven layers (README, "Architecture"; ``tests/test_layering.py`` holds each module to its
own): training, metrics and experiments; optimizers; the API; the plan; dispatch; backends; foundations.
An import runs only downwards, inside functions too. This module is the facade on top: it re-exports
the public names and is imported by nothing of the package.
"""

# The version check comes first: on a torch older than supported, a later import may fail, and the
# warning names the fix before that error does.
from . import compat

compat.warn_if_unsupported()

# ruff: noqa: E402
from . import analysis, metrics, optim, reference
from ._version import __version__
from .coefficients import MUON_QUINTIC, NEWTON_SCHULZ_SIGN, polar_express_coefficients
from .decay import Band, SpectralStabilityError, spectral_decay, spectral_decay_
from .dispatch import BackendUnavailableError, backend_for, backend_status, last_backend, use_backend
from .ops import (
    band_direction,
    band_projectors,
    msign,
    polar,
    power_update,
    spectral_clip,
    spectral_norm_bounds,
    spectral_power,
    svt,
)
from .qk_cap import qk_cap_
from .step_tuning import tune

__all__ = [
    "__version__",
    "analysis",
    "compat",
    "metrics",
    "optim",
    "Band",
    "BackendUnavailableError",
    "MUON_QUINTIC",
    "NEWTON_SCHULZ_SIGN",
    "SpectralStabilityError",
    "backend_for",
    "backend_status",
    "band_direction",
    "band_projectors",
    "last_backend",
    "msign",
    "polar",
    "polar_express_coefficients",
    "power_update",
    "qk_cap_",
    "reference",
    "spectral_decay",
    "spectral_decay_",
    "spectral_clip",
    "spectral_norm_bounds",
    "spectral_power",
    "svt",
    "tune",
    "use_backend",
]
