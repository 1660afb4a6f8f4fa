"""The torch and triton releases this package supports, declared once, and what it says at run time
when an installed one is outside them.

The range is the last four torch minors and the triton each of them pins: the oldest and the newest
are what ``make compat`` runs the whole suite against (``requirements-torch-oldest.txt``,
``requirements-torch-newest.txt``), and ``make test`` (CI) runs the core of it at the oldest.
pyproject.toml's floors and those files are held to this module by ``tests/test_compat.py``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import warnings

import torch

# (major, minor) of the oldest and the newest release the suite passes on.
TORCH_RANGE = ((2, 12), (2, 15))
TRITON_RANGE = ((3, 7), (3, 9))


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string: ``"2.12.0+cu130"``, ``"2.16.0.dev20261201"``, ``"3.7.0"``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return int(match[1]), int(match[2])


def spelled(minor: tuple[int, int]) -> str:
    return f"{minor[0]}.{minor[1]}"


def supported_range(span) -> str:
    return f"{spelled(span[0])} to {spelled(span[1])}"


def torch_too_old(version: str | None = None) -> str | None:
    """Why the running torch (or ``version``) is older than the oldest supported, or None."""
    version = version or torch.__version__
    if release(version) >= TORCH_RANGE[0]:
        return None
    return (f"spectral_ops supports torch {supported_range(TORCH_RANGE)}; this is torch {version}, on which "
            f"it is untested (older releases fail parts of its suite: graph breaks in compiled steps, missing "
            f"collectives, on 2.6 the import itself). Install torch>={spelled(TORCH_RANGE[0])}")


@functools.cache
def installed_triton() -> str | None:
    """The installed ``triton`` distribution's version (from its metadata: triton itself is not
    imported), or None. Whether triton can be imported at all is the backend's ``triton_installed``, a
    module search: a nightly's ``pytorch-triton`` distribution is imported as ``triton`` too."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def triton_too_old(version: str | None = None) -> str | None:
    """Why the installed triton (or ``version``) cannot run this package's kernels, or None. The
    interpreter and ``tl`` APIs of triton before 3.7 differ from those the kernels are written for."""
    version = version or installed_triton()
    if version is None or release(version) >= TRITON_RANGE[0]:
        return None
    return (f"triton {version} is older than {spelled(TRITON_RANGE[0])}, the oldest the Triton kernels support "
            f"({supported_range(TRITON_RANGE)}); upgrade it with torch, which pins its triton")


def warn_if_unsupported() -> None:
    """A warning, once per process (at import), where the running torch is older than supported."""
    reason = torch_too_old()
    if reason is not None:
        warnings.warn(reason, RuntimeWarning, stacklevel=2)
