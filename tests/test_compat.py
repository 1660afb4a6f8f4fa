"""The supported torch and triton range (spectral_ops/compat.py): declared once, held to the files
that install it, and said at run time where an installed release is outside it."""

import re
import warnings
from pathlib import Path

import pytest
import torch

from spectral_ops import compat
from spectral_ops.backends.triton_backend import TritonBackend

ROOT = Path(__file__).parents[1]


def pins(name: str) -> dict:
    """``{package: (major, minor)}`` of the ``==`` pins in a requirements file."""
    text = (ROOT / name).read_text()
    return {package: compat.release(version) for package, version in re.findall(r"^(\w+)==(\S+)", text, re.M)}


def test_the_range_is_the_last_four_torch_minors():
    (major, oldest), (newest_major, newest) = compat.TORCH_RANGE
    assert major == newest_major and newest - oldest + 1 == 4


def older(minor: tuple[int, int], by: int = 1) -> str:
    """A release ``by`` minors before ``minor``, spelled as pip spells one."""
    return f"{minor[0]}.{minor[1] - by}.0"


def test_the_oldest_and_newest_requirements_pin_the_ends_of_the_range():
    assert pins("requirements-torch-oldest.txt") == {"torch": compat.TORCH_RANGE[0], "triton": compat.TRITON_RANGE[0]}
    assert pins("requirements-torch-newest.txt") == {"torch": compat.TORCH_RANGE[1], "triton": compat.TRITON_RANGE[1]}
    default = pins("requirements-torch.txt")
    assert compat.TORCH_RANGE[0] <= default["torch"] <= compat.TORCH_RANGE[1]
    assert compat.TRITON_RANGE[0] <= default["triton"] <= compat.TRITON_RANGE[1]


def test_pyproject_declares_the_floors():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={compat.spelled(compat.TORCH_RANGE[0])}"' in text
    assert f'"triton>={compat.spelled(compat.TRITON_RANGE[0])}"' in text


def test_this_torch_is_supported():
    assert compat.torch_too_old() is None


@pytest.mark.parametrize("version, minor", [("2.12.0+cu130", (2, 12)), ("2.16.0.dev20261201+cpu", (2, 16)),
                                            ("3.7.0", (3, 7)), ("10.1", (10, 1))])
def test_release_reads_major_and_minor(version, minor):
    assert compat.release(version) == minor


def test_an_older_torch_is_named_with_the_fix():
    oldest, newest = compat.TORCH_RANGE
    too_old = older(oldest, 2) + "+cpu"
    reason = compat.torch_too_old(too_old)
    assert f"torch {too_old}" in reason and f"torch>={compat.spelled(oldest)}" in reason
    assert compat.supported_range(compat.TORCH_RANGE) in reason
    # The floor is supported, and a release newer than the range is not refused (only warned about).
    assert compat.torch_too_old(f"{compat.spelled(oldest)}.0") is None
    assert compat.torch_too_old(older(newest, -1)) is None


def test_the_import_time_check_warns_under_an_older_torch_only(monkeypatch):
    too_old = older(compat.TORCH_RANGE[0], 2)
    monkeypatch.setattr(torch, "__version__", too_old)
    with pytest.warns(RuntimeWarning, match=re.escape(f"supports torch {compat.supported_range(compat.TORCH_RANGE)}; "
                                                      f"this is torch {too_old}")):
        compat.warn_if_unsupported()
    monkeypatch.setattr(torch, "__version__", f"{compat.spelled(compat.TORCH_RANGE[0])}.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_unsupported()


def test_an_older_triton_makes_the_triton_backend_unavailable_with_the_reason(monkeypatch):
    oldest = compat.TRITON_RANGE[0]
    monkeypatch.setattr(compat, "installed_triton", lambda: older(oldest))
    monkeypatch.setattr("spectral_ops.backends.triton_backend.triton_installed", lambda: True)
    reason = TritonBackend().unavailable_reason(torch.device("cpu"), forced=True)
    assert reason == compat.triton_too_old(older(oldest))
    assert f"triton {older(oldest)} is older than {compat.spelled(oldest)}" in reason
    assert compat.triton_too_old(f"{compat.spelled(oldest)}.0") is None
