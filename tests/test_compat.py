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
    assert major == newest_major and newest - oldest + 1 >= 4


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
    reason = compat.torch_too_old("2.10.0+cpu")
    assert "torch 2.10.0+cpu" in reason and "torch>=2.12" in reason and "2.12 to 2.15" in reason
    assert compat.torch_too_old("2.12.0") is None and compat.torch_too_old("2.16.0") is None


def test_the_import_time_check_warns_under_an_older_torch_only(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.warns(RuntimeWarning, match="supports torch 2.12 to 2.15; this is torch 2.10.0"):
        compat.warn_if_unsupported()
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_unsupported()


def test_an_older_triton_makes_the_triton_backend_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setattr(compat, "installed_triton", lambda: "3.6.0")
    monkeypatch.setattr("spectral_ops.backends.triton_backend.triton_installed", lambda: True)
    reason = TritonBackend().unavailable_reason(torch.device("cpu"), forced=True)
    assert reason == compat.triton_too_old("3.6.0") and "triton 3.6.0 is older than 3.7" in reason
    assert compat.triton_too_old("3.7.0") is None
