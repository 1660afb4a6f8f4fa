"""FLOP and byte model of every benchmarked op, per matrix (SPEC 8).

A product whose result is known to be symmetric (``X X^T``, ``A A``, products of commuting
polynomials in the Gram) counts at half cost: that is the work a SYRK-style kernel does, and the
ceiling the fused kernels aim at. The same count is used for every implementation of an op, so
TFLOP/s compare implementations on useful work, not on what each one happens to compute.
"""

from __future__ import annotations

import math

from spectral_ops.coefficients import polar_express_coefficients
# The per-matrix model lives in the plan, which the distributed optimizers balance their work with.
from spectral_ops.plan import (  # noqa: F401  (re-exported: this file is the benchmarks' one FLOP model)
    gram_flops,
    gram_power_products,
    msign_flops,
    polar_flops,
    polar_step_flops,
    resolve_iteration,
    spectral_power_flops,
)


def _dims(shape):
    *batch, m, n = shape
    return math.prod(batch), min(m, n), max(m, n)


def op_flops(op: str, shape, steps: int = 8, precision: str = "fp32") -> float:
    """FLOPs of ``op`` on ``shape``, an even power's iteration counted as the one the op runs at
    ``precision`` (``iteration="auto"``: Gram space where it saves work; see ``plan.resolve_iteration``)."""
    batch, r, big = _dims(shape)

    def power(p):
        return spectral_power_flops(r, big, p, steps, resolve_iteration("auto", p, shape[-2:], precision, steps))

    per_matrix = {
        "gram": lambda: gram_flops(r, big),
        "polar_step": lambda: polar_step_flops(r, big),
        "polar": lambda: polar_flops(r, big, steps),
        "spectral_power_p0": lambda: power(0),
        "spectral_power_p2": lambda: power(2),
        "spectral_power_p4": lambda: power(4),
        "msign": lambda: msign_flops(r, 30),
        "decay_p2": lambda: power(2),
        "muon_step": lambda: polar_flops(r, big, steps),
    }[op]
    return batch * per_matrix()


def op_bytes(op: str, shape, element_size: int) -> float:
    """Minimum traffic: read the input once and write the output once (in-place ops: both on W).

    ``gram`` and ``msign`` write ``r x r``; the others an output the size of the input.
    """
    batch, r, big = _dims(shape)
    if op == "gram":
        return batch * element_size * (r * big + r * r)
    if op == "msign":
        return batch * element_size * 2 * r * r
    return batch * element_size * 2 * r * big


DEFAULT_STEPS = len(polar_express_coefficients())
