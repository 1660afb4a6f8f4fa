"""The decay write ``W <- keep W + step D``, in place, whatever ``W``'s strides.

It is :func:`.update.product` without a product (``Y = W``, ``Z = D``, ``out = W``): each program
reads ``W`` and ``D`` only at the tile it writes, so the write is safe in place; a ``W`` whose batch
dimensions have no single stride goes through a workspace (:class:`.common.Output`). ``keep`` and
``step`` are numbers or one value per matrix, and the arithmetic is fp32 with one rounding into
``W``'s dtype: to nearest, or stochastically with the caller's random bits.
"""

from __future__ import annotations

import torch

from .update import product


def decay_epilogue_(W: torch.Tensor, D: torch.Tensor | None, *, keep=1.0, step=0.0, input_precision: str = "ieee",
                    noise: torch.Tensor | None = None, cfg=None) -> torch.Tensor:
    """``W <- keep W + step D`` in place (``D=None``: ``keep W``); returns ``W``. ``noise``: int16 bits of
    ``W``'s shape that round a bf16/fp16 ``W`` stochastically."""
    product(None, W if D is None else D, gamma=0.0 if D is None else step, Y=W, beta=keep, out=W,
            input_precision=input_precision, noise=noise, cfg=cfg)
    return W
