"""Benchmark fixtures: the measured dense-matmul peak."""

from __future__ import annotations

import pytest
import torch

from settings import DEVICE, DTYPES


@pytest.fixture(scope="session")
def dense_peak_flops():
    """The device's achievable dense-matmul rate per dtype, measured now: the "percent of peak"
    denominator (a datasheet number would not match this machine, clocks or CPU)."""
    from torch.utils.benchmark import Timer

    peaks = {}
    n = 4096 if DEVICE.type == "cuda" else 512
    for dtype in DTYPES:
        a = torch.randn(n, n, device=DEVICE, dtype=dtype)
        seconds = Timer("a @ a", globals={"a": a}).blocked_autorange(min_run_time=0.2).median
        peaks[str(dtype)] = 2 * n**3 / seconds
    return peaks
