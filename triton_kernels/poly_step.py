"""The fused polynomial step ``B = b A + c A A`` of Polar Express and of the sign iteration.

``A = X X^T`` is symmetric, so ``A A = A A^T`` is a symmetric (SYRK-shaped) product of ``A`` with
itself: the symmetric kernel computes half of its tiles, and its ``alpha * L R^T + beta * C``
epilogue with ``C = A`` adds ``b A`` while the tile is still in registers. ``B`` comes out exactly
symmetric, which the next step (``a X + B X``) relies on only for speed, never for correctness.
"""

from __future__ import annotations

import torch

from .syrk import symmetric_product


def poly_step(A: torch.Tensor, b, c, *, out: torch.Tensor | None = None, input_precision: str = "ieee",
              cfg=None) -> torch.Tensor:
    """``b A + c A^2`` for symmetric ``(..., r, r)`` ``A``; ``b``, ``c`` are numbers or per-matrix.

    ``out`` must be a different buffer from ``A`` (every program reads whole row blocks of ``A``);
    if it overlaps ``A`` the result goes through a workspace.
    """
    return symmetric_product(A, A, alpha=c, beta=b, C=A, out=out, input_precision=input_precision, cfg=cfg)
