"""Benchmark fixtures: the measured dense-matmul peak; the machine, in every results file."""

from __future__ import annotations

import pytest
import torch

from spectral_ops.provenance import machine

from settings import DEVICE, DTYPES


def pytest_benchmark_update_machine_info(config, machine_info):
    """The facts a CPU result depends on (:func:`spectral_ops.provenance.machine`: the ISA flags, threads,
    torch, the BLAS and oneDNN, an ``ONEDNN_MAX_CPU_ISA`` cap), taken where the benchmarks run:
    ``bench/report.py`` names the machine from them, not from the one that renders the report."""
    machine_info["spectral_ops"] = machine()


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
