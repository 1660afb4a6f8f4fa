"""The last product of a decay step, with the decay in its epilogue, written into the weight.

Every decay direction ends in one rectangular product by a small symmetric factor ``P`` (a
polynomial in the Gram matrix, or the band projector), so the step

    W <- alpha W + gamma Z + beta (P Z)        (left:  P is m x m)
    W <- alpha W + gamma Z + beta (Z P)        (right: P is n x n, a tall weight)

is one launch of :func:`.update.product` with ``Y = W`` and ``out = W``. For ``S_p``, ``P`` is a
power of the Gram matrix, ``Z`` is ``Q`` (even ``p``) or ``W`` (odd ``p``), ``alpha = 1 - lr * wd_1``
and ``beta = -lr * wd * ||W||^p``. For the band forms ``P`` is ``P_top`` and ``Z`` an operand such
as ``S_p - W``, with the other terms in ``alpha`` and ``gamma``; for ``p = 0`` the last Polar Express
update is itself the final product (``P = B``, ``Z = X``, ``gamma = -lr * wd * a``).

Aliasing. A program reads ``W`` (as ``Y``) only at the tile it writes, so that is safe in place.
``Z``'s column panels, however, are read by every row tile, so when ``Z`` is (or overlaps) ``W`` --
odd ``p``, ``W - s W P`` -- the tiles are written to a workspace and copied into ``W`` once all
programs are done. Any other overlap between ``W`` and ``P`` or ``Z`` takes the same route, and so
does a ``W`` whose batch dimensions have no single stride. The right-multiplied form runs on the
transposed views (``Z P = (P Z^T)^T`` for symmetric ``P``), so a tall weight is never copied.
"""

from __future__ import annotations

import torch

from .update import product


def decay_product_(W: torch.Tensor, P: torch.Tensor | None, Z: torch.Tensor | None = None, *, alpha=1.0,
                   beta=-1.0, gamma=0.0, side: str = "left", input_precision: str = "ieee", cfg=None) -> torch.Tensor:
    """``W <- alpha W + gamma Z + beta (P Z)`` (``side="left"``) or ``... + beta (Z P)`` (``"right"``), in place.

    ``Z`` defaults to ``W`` itself (``W <- alpha W - s W P``). ``P`` must be symmetric for
    ``side="right"``; ``P=None`` leaves only the elementwise terms. Returns ``W``.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    Z = W if Z is None else Z
    if side == "right":
        W_, Z_ = W.mT, Z.mT
    else:
        W_, Z_ = W, Z
    product(P, Z_, beta=beta, gamma=gamma, Y=W_, alpha=alpha, out=W_, input_precision=input_precision, cfg=cfg)
    return W
