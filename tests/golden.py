"""Pinned results: recorded once, then compared bit for bit where that is meaningful.

Bitwise equality is only meaningful on the same torch build and CPU kernels: matmul results depend
on the instruction set torch's BLAS picks, which the CPU model and the ISA caps (``MKL_ENABLE_INSTRUCTIONS``,
``ONEDNN_MAX_CPU_ISA``) choose, not only torch's CPU capability. Elsewhere the comparison falls back to
a few units of roundoff of the result's compute dtype, times the op's conditioning where it amplifies
them (a matrix sign near a zero eigenvalue), which still catches any change of the algorithm (those are
O(1) or at least O(sqrt(eps)) off), though not a change of summation order.
"""

from __future__ import annotations

import torch

from spectral_ops.provenance import machine


def environment() -> dict:
    facts = machine()
    return {"torch": facts["torch"], "cpu": facts["torch_cpu_capability"], "model": facts["cpu"],
            "isa_flags": facts["isa_flags"], "isa_caps": facts["isa_caps"]}


def assert_matches(got: torch.Tensor, expected: torch.Tensor, recorded_in: dict, conditioning: float = 1.0) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if recorded_in == environment():
        assert torch.equal(got, expected)
        return
    # A few units of roundoff of the compute dtype, relative to the result's largest entry, plus a few
    # per unit of the op's conditioning (measured: up to 2.4 eps per unit between two CPUs).
    eps = torch.finfo(torch.float64 if expected.dtype == torch.float64 else torch.float32).eps
    rounding = 0.0 if expected.dtype in (torch.float64, torch.float32) else torch.finfo(expected.dtype).eps
    scale = expected.double().abs().max().clamp_min(1e-30)
    tolerance = (64 + 8 * conditioning) * eps + rounding
    assert (got.double() - expected.double()).abs().max() <= tolerance * scale
