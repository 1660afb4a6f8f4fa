"""One step of the matrix-sign iteration for symmetric ``Z``: ``Z (a I + b Z^2 + c Z^4)``.

With Newton-Schulz's ``(3, -16/5, 6/5)`` this is ``Z (3I - 16/5 Z^2 + 6/5 Z^4)``; the Polar Express
quintics work the same way. Every factor is symmetric and commutes with ``Z``, so the step is three
symmetric products, each computing only the lower tiles:

    C = Z Z^T = Z^2                  (SYRK)
    B = b C + c C C                  (the fused polynomial step)
    Z' = a Z + B Z                   (B and Z commute: B Z = Z B = (B Z)^T)

and ``Z'`` is stored exactly symmetric, so the next step's premise holds bit for bit.
"""

from __future__ import annotations

import torch

from ..coefficients import NEWTON_SCHULZ_SIGN
from .poly_step import poly_step
from .syrk import symmetric_product, syrk


def sign_step(Z: torch.Tensor, coefficients=NEWTON_SCHULZ_SIGN, *, out: torch.Tensor | None = None,
              workspace: tuple[torch.Tensor, torch.Tensor] | None = None, input_precision: str = "ieee",
              cfg=None) -> torch.Tensor:
    """``a Z + (b Z^2 + c Z^4) Z`` for symmetric ``(..., r, r)`` ``Z`` (normalise ``Z`` first).

    ``workspace`` is two fp32 ``(..., r, r)`` buffers for ``Z^2`` and the polynomial, reused across
    steps; ``out`` must be a buffer other than ``Z``.
    """
    a, b, c = coefficients
    square, poly = workspace if workspace is not None else (None, None)
    square = syrk(Z, out=square, input_precision=input_precision, cfg=cfg)
    poly = poly_step(square, b, c, out=poly, input_precision=input_precision, cfg=cfg)
    return symmetric_product(poly, Z, alpha=1.0, beta=a, C=Z, out=out, input_precision=input_precision, cfg=cfg)
