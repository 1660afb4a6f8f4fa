"""Every environment variable the package reads at run time, read here and nowhere else.

Each is read when it is needed (not at import), so that a test or a launcher can set it first.
The build reads its own (``SPECTRAL_OPS_NO_CUDA`` and friends) in :mod:`spectral_ops.build_config`.

==================================  ===========================================================
``SPECTRAL_OPS_BACKEND``            force one backend (``cuda``, ``triton``, ``torch``) for every
                                    primitive (:mod:`spectral_ops.dispatch`)
``SPECTRAL_OPS_CUDA_PRECISION``     the CUDA kernels' fp32 mode (``ieee``, ``tf32x3``, ``tf32``)
``SPECTRAL_OPS_TRITON_PRECISION``   the Triton kernels' fp32 ``input_precision``
``SPECTRAL_OPS_AUTOTUNE``           ``0``/``false``/``off``/``no``: the fixed backend order, no timing
``SPECTRAL_OPS_CACHE_DIR``          the cache: measured routing, and the training corpora under
                                    ``corpora/`` (else ``$XDG_CACHE_HOME`` or ``~/.cache``, under
                                    ``spectral_ops``)
``TRITON_INTERPRET``                ``1``: Triton's CPU interpreter (read by Triton itself too)
==================================  ===========================================================
"""

from __future__ import annotations

import os
from pathlib import Path

BACKEND = "SPECTRAL_OPS_BACKEND"
CUDA_PRECISION = "SPECTRAL_OPS_CUDA_PRECISION"
TRITON_PRECISION = "SPECTRAL_OPS_TRITON_PRECISION"
AUTOTUNE = "SPECTRAL_OPS_AUTOTUNE"
CACHE_DIR = "SPECTRAL_OPS_CACHE_DIR"
TRITON_INTERPRET = "TRITON_INTERPRET"


def setting(name: str) -> str:
    """The variable's value, stripped and lower-cased; empty when unset."""
    return os.environ.get(name, "").strip().lower()


def triton_interpreted() -> bool:
    return os.environ.get(TRITON_INTERPRET, "") == "1"


def autotune_enabled() -> bool:
    return setting(AUTOTUNE) not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spectral_ops"
