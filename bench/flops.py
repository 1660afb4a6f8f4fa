"""FLOP and byte model of every benchmarked op, per matrix (SPEC 8).

A product whose result is known to be symmetric (``X X^T``, ``A A``, products of commuting
polynomials in the Gram) counts at half cost: that is the work a SYRK-style kernel does, and the
ceiling the fused kernels aim at. The same count is used for every implementation of an op, so
TFLOP/s compare implementations on useful work, not on what each one happens to compute.
"""

from __future__ import annotations

import math

import torch

from spectral_ops.backends.counting import CountingKernels
from spectral_ops.coefficients import polar_express_coefficients
from spectral_ops.plan import cost


def _dims(shape):
    *batch, m, n = shape
    return math.prod(batch), min(m, n), max(m, n)


def op_flops(op: str, shape, steps: int = 8, precision: str = "fp32") -> float:
    """FLOPs of ``op`` on ``shape``, read off the plan (:func:`spectral_ops.plan.cost`, symmetric
    products at half), an even power's iteration the one the op runs at ``precision``
    (``iteration="auto"``: Gram space where it saves work)."""
    batch, r, big = _dims(shape)
    matrix = (r, big)

    def plan_cost(name, **options):
        return cost(name, matrix, precision=precision, steps=steps, symmetric_at_half=True, **options)

    def gram():
        kernels = CountingKernels(symmetric_at_half=True)
        X = torch.empty(matrix, device="meta")
        kernels.symmetric(X, X.mT)
        return kernels.flops

    per_matrix = {
        "gram": gram,
        "polar_step": lambda: cost("polar", matrix, steps=1, symmetric_at_half=True),
        "polar": lambda: plan_cost("polar"),
        "spectral_power_p0": lambda: plan_cost("spectral_power", p=0, iteration="auto"),
        "spectral_power_p2": lambda: plan_cost("spectral_power", p=2, iteration="auto"),
        "spectral_power_p4": lambda: plan_cost("spectral_power", p=4, iteration="auto"),
        "msign": lambda: cost("msign", (r, r), sign_steps=30, symmetric_at_half=True),
        "decay_p2": lambda: plan_cost("decay_", p=2, iteration="auto"),
        "muon_step": lambda: plan_cost("polar"),
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
