"""Pinned results: recorded once, then compared bit for bit where that is meaningful.

Bitwise equality is only meaningful on the same torch build and CPU kernels: matmul results depend
on the instruction set torch's BLAS picks. Elsewhere the comparison falls back to a few units of
roundoff of the result's compute dtype, which still catches any change of the algorithm (those are
O(1) or at least O(sqrt(eps)) off), though not a change of summation order.
"""

from __future__ import annotations

import torch


def environment() -> dict:
    return {"torch": str(torch.__version__), "cpu": torch.backends.cpu.get_cpu_capability()}


def assert_matches(got: torch.Tensor, expected: torch.Tensor, recorded_in: dict) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if recorded_in == environment():
        assert torch.equal(got, expected)
        return
    # A few units of roundoff of the compute dtype, relative to the result's largest entry.
    eps = torch.finfo(torch.float64 if expected.dtype == torch.float64 else torch.float32).eps
    rounding = 0.0 if expected.dtype in (torch.float64, torch.float32) else torch.finfo(expected.dtype).eps
    scale = expected.double().abs().max().clamp_min(1e-30)
    assert (got.double() - expected.double()).abs().max() <= (64 * eps + rounding) * scale
