"""The cost model: what one call of an op costs (:func:`cost`, :func:`work`), read off this very plan.

Each op runs on meta tensors through :func:`~spectral_ops.backends.counting.counted`, which counts its
primitives, so a cost follows the plan by itself: a cheaper iteration is cheaper here the moment the plan
runs it. It comes last in the plan's reading order because it counts every op, the decay (:mod:`.decay`)
included.
"""

from __future__ import annotations

import functools

import torch

from .._checks import check_power
from .._compile import constant_when_traced
from ..backends.counting import counted, placeholder_coefficients
from .decay import DecayRequest, decay_
from .gram import GUARD_SQUARINGS
from .routing import (
    UPDATE_FLOOR,
    band_direction,
    band_projectors,
    msign,
    polar,
    power_update,
    spectral_clip,
    spectral_norm_bounds,
    spectral_power,
    svt,
)
from .thresholds import Band


@constant_when_traced  # read off the plan on meta tensors, not traced (nor its cache, which Dynamo would skip)
def cost(op: str, shape: tuple, **options) -> float:
    """The matrix FLOPs of one call of ``op`` (one of :data:`~.routing.OPS`) on a float32 tensor of ``shape``
    (a batch counts each matrix): :func:`work`'s FLOPs, with the same options."""
    return work(op, shape, **options).flops


@constant_when_traced
def work(op: str, shape: tuple, *, p=0, precision: str = "fp32", iteration: str = "rectangle",
         steps: int | None = 8, sign_steps: int | None = 8, band_mode: str | None = None, p_bot: int = 1,
         guard: bool = False, symmetric_at_half: bool = False, eps: float | None = None,
         threshold: float | None = None, dtype: torch.dtype = torch.float32):
    """The :class:`~spectral_ops.backends.counting.Work` of one call of ``op`` (one of :data:`~.routing.OPS`) on a
    ``dtype`` tensor of ``shape`` (a batch counts each matrix): its matrix FLOPs, its primitives' bytes
    and launches, read off the plan: it runs on meta tensors through
    :func:`~spectral_ops.backends.counting.counted`, which counts each primitive and the products the plan
    forms outside them (the matrix-vector products of :meth:`~.gram.GramPlan.spectral_norm_estimate`).

    At full cost this is what ``FlopCounterMode`` counts of the torch backend; ``symmetric_at_half``
    gives the GPU kernels' count, each symmetric product (the Gram, ``A A``, the sign steps) at half.
    ``p``, ``iteration`` (``"auto"`` routes as a call would), ``steps``, ``sign_steps``, ``band_mode``
    and ``p_bot`` configure the op (``eps``: a floor, see :func:`~.routing.spectral_power`); ``guard``: a decay's
    stability bound is formed (a capturable step's clamp, every step; an eager one forms it only where
    ``||W||_F`` does not settle the guard). The fused chains are not counted: their products are the
    composed plan's.

    A band op's ``steps``/``sign_steps`` None are designed for its thresholds
    (:func:`~.thresholds.threshold_design`),
    as a call without them is: at ``threshold`` (each threshold's ``tau / ||W||_F``), or where that is
    None at the capturable design, which cannot read it.
    """
    if threshold is not None and not (isinstance(threshold, (int, float)) and threshold > 0):
        raise ValueError(f"threshold is tau / ||W||_F, a number > 0 (or None), got {threshold!r}")
    # A power_update without eps takes its default floor, as the op does.
    p = check_power(p, eps=UPDATE_FLOOR if op == "power_update" and eps is None else eps, decay=op == "decay_")
    return _counted(op, tuple(shape), p, precision, iteration, steps, sign_steps, band_mode, p_bot, guard,
                    symmetric_at_half, eps, threshold, dtype)


@functools.lru_cache(maxsize=4096)
def _counted(op, shape, p, precision, iteration, steps, sign_steps, band_mode, p_bot, guard, symmetric_at_half, eps,
             threshold, dtype):
    polar_coefficients, sign_coefficients = placeholder_coefficients(steps), placeholder_coefficients(sign_steps)
    band = Band(1.0, band_mode, p_bot) if band_mode else None
    # Meta tensors have no values to read (sync=False): a threshold's ratio is the given one, or (None)
    # the capturable design's.
    floor = UPDATE_FLOOR if eps is None else eps
    thresholded = {"sync": False, "threshold_ratio": threshold}
    calls = {
        "polar": lambda kernels, W: polar(kernels, W, polar_coefficients, precision),
        "power_update": lambda kernels, W: power_update(kernels, W, p, polar_coefficients, precision, floor),
        "msign": lambda kernels, W: msign(kernels, W, sign_coefficients, precision),
        "spectral_power": lambda kernels, W: spectral_power(kernels, W, p, polar_coefficients, precision, False,
                                                            iteration, eps=eps),
        "band_projectors": lambda kernels, W: band_projectors(kernels, W, 1.0, sign_coefficients, precision,
                                                              **thresholded),
        "band_direction": lambda kernels, W: band_direction(kernels, W, p, band, polar_coefficients,
                                                            sign_coefficients, precision, **thresholded),
        "svt": lambda kernels, W: svt(kernels, W, 1.0, polar_coefficients, sign_coefficients, precision,
                                      **thresholded),
        "spectral_clip": lambda kernels, W: spectral_clip(kernels, W, 0.5, 1.0, polar_coefficients,
                                                          sign_coefficients, precision, **thresholded),
        "spectral_norm_bounds": lambda kernels, W: spectral_norm_bounds(kernels, W, GUARD_SQUARINGS),
        "decay_": lambda kernels, W: decay_(kernels, W, DecayRequest(
            p, 1.0, 1.0, band=band, polar_coefficients=polar_coefficients, sign_coefficients=sign_coefficients,
            precision=precision, iteration=iteration, stability="clamp" if guard else "ignore",
            capturable=guard or threshold is None, method="gram", threshold_ratio=threshold)),
    }
    return counted(calls[op], shape, dtype, symmetric_at_half)
