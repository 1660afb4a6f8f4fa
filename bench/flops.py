"""FLOP and byte model of every benchmarked op, per matrix (SPEC 8).

A product whose result is known to be symmetric (``X X^T``, ``A A``, products of commuting
polynomials in the Gram) counts at half cost: that is the work a SYRK-style kernel does, and the
ceiling the fused kernels aim at. The same count is used for every implementation of an op, so
TFLOP/s compare implementations on useful work, not on what each one happens to compute.
"""

from __future__ import annotations

import math

from spectral_ops.coefficients import polar_express_coefficients
from spectral_ops.plan import iteration_flops


def _dims(shape):
    *batch, m, n = shape
    return math.prod(batch), min(m, n), max(m, n)


def gram_flops(r: int, big: int) -> float:
    return r * r * big  # 2 r^2 big, halved: symmetric


def polar_step_flops(r: int, big: int) -> float:
    """``A = X X^T`` (symmetric), ``A A`` (symmetric), ``B X`` (dense)."""
    return gram_flops(r, big) + r**3 + 2 * r * r * big


def polar_flops(r: int, big: int, steps: int = 8) -> float:
    return steps * polar_step_flops(r, big)


def gram_power_products(k: int) -> int:
    """Symmetric ``r x r`` products repeated squaring needs for ``G^k``."""
    if k <= 1:
        return 0
    squarings = k.bit_length() - 1
    return squarings + bin(k).count("1") - 1


def spectral_power_flops(r: int, big: int, p: int, steps: int = 8, iteration: str = "rectangle") -> float:
    """SPEC 1.2: the Gram (shared with the first polar step), its powers, one last product.

    ``iteration="gram_space"`` (even ``p``): the polar factor from restarted ``r x r`` blocks, as
    :func:`spectral_ops.plan.iteration_flops` counts them (one model, in the plan)."""
    if p == 1:
        return 0.0
    final = 2 * r * r * big if p % 2 else iteration_flops(iteration, p, r, big, steps)
    return gram_flops(r, big) + gram_power_products(p // 2) * r**3 + final


def msign_flops(r: int, steps: int) -> float:
    """Per step ``Z^2``, ``C^2`` and ``B Z``: all symmetric (they commute with Z)."""
    return steps * 3 * r**3


def op_flops(op: str, shape, steps: int = 8) -> float:
    batch, r, big = _dims(shape)
    per_matrix = {
        "gram": lambda: gram_flops(r, big),
        "polar_step": lambda: polar_step_flops(r, big),
        "polar": lambda: polar_flops(r, big, steps),
        "spectral_power_p0": lambda: spectral_power_flops(r, big, 0, steps),
        "spectral_power_p2": lambda: spectral_power_flops(r, big, 2, steps),
        "spectral_power_p4": lambda: spectral_power_flops(r, big, 4, steps),
        "msign": lambda: msign_flops(r, 30),
        "decay_p2": lambda: spectral_power_flops(r, big, 2, steps),
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
