"""The largest singular value of a stack of matrices by warm-started power iteration.

For a stack ``A`` of shape ``(B, m, n)`` and unit vectors ``v`` of shape ``(B, n)``, one iteration computes
``x = A^T (A v)`` (two matrix-vector products per matrix), the Rayleigh quotient ``v . x = ||A v||^2``, and
the next vector ``x / ||x||``. The estimate ``sqrt(v . x)`` never exceeds ``s_max`` (a Rayleigh quotient of
``A^T A`` is at most its largest eigenvalue; rounding aside), and from a start ``v_0`` at angle ``theta`` to
the top right singular vector its relative error after ``k`` iterations is at most about
``tan(theta)^2 (s_2 / s_1)^(2k) / 2``. The vectors are kept between calls (the warm start): weights move
little between two log steps, so the iterations of all calls add up.

Range: ``A^T A v`` is of size ``s_max^2``, so the estimate is finite while ``s_max^2`` fits the dtype
(fp32: ``s_max`` up to about 1.8e19); ``exact=True`` computes in fp64.

The work is ``4 B m n`` multiply-adds per iteration, ``O(mn)``, against the ``O(mn min(m, n))`` of an SVD.
"""

from __future__ import annotations

import torch


def initial_vectors(batch: int, n: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """Unit start vectors ``(batch, n)``, the same on every call and every rank (a seeded CPU generator):
    a random start has a nonzero component along the top singular vector with probability one."""
    generator = torch.Generator().manual_seed(seed)
    vectors = torch.randn(batch, n, generator=generator, dtype=torch.float64)
    return (vectors / torch.linalg.vector_norm(vectors, dim=-1, keepdim=True)).to(device=device, dtype=dtype)


def power_iterations(stack: torch.Tensor, vectors: torch.Tensor, iterations: int,
                     reduce_columns=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_max estimates (B,), next vectors (B, n))`` after ``iterations`` steps from ``vectors``.

    ``reduce_columns(x)`` sums ``x = A^T (A v)`` over the processes that each hold some rows of the stack
    (FSDP2's row shards: one all-reduce of ``B n`` numbers per iteration); None where ``stack`` is whole.
    A zero matrix gives 0 and keeps its vector."""
    estimate = torch.zeros(stack.shape[0], dtype=stack.dtype, device=stack.device)
    for _ in range(iterations):
        x = torch.bmm(stack.mT, torch.bmm(stack, vectors.unsqueeze(-1))).squeeze(-1)
        if reduce_columns is not None:
            x = reduce_columns(x)
        estimate = (vectors * x).sum(-1).clamp_min(0)
        # x is of size s_max^2: scaled by its largest entry first, its norm's squares cannot overflow.
        largest = x.abs().amax(-1, keepdim=True)
        x = x / largest.clamp_min(torch.finfo(x.dtype).tiny)
        vectors = torch.where(largest > 0, x / torch.linalg.vector_norm(x, dim=-1, keepdim=True), vectors)
    return estimate.sqrt(), vectors
