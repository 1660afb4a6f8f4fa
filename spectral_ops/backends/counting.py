"""A provider that computes nothing and counts: the plan's cost, read off the plan itself.

It implements every primitive of :mod:`spectral_ops.backends.base` on meta tensors (shapes only),
adding each product's matrix FLOPs as it goes, so :func:`spectral_ops.plan.cost` runs the very code
a call runs and the cost can never drift from the algorithm. ``symmetric_at_half`` counts the products
known to be symmetric (the Gram, ``A A``, the sign steps) at half, as the GPU kernels compute one
triangle of them; at full cost the count is what ``torch.utils.flop_counter.FlopCounterMode`` sees of
the torch backend. It has no fused chain (the plan composes), and the epilogue is element-wise (free).
"""

from __future__ import annotations

import torch


class CountingBackend:
    def __init__(self, symmetric_at_half: bool = False):
        self.symmetric_share = 0.5 if symmetric_at_half else 1.0
        self.flops = 0.0

    def _count(self, L: torch.Tensor, R: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """``L @ R``'s shape, after adding its ``2 m k n`` FLOPs per matrix (times ``share``)."""
        *batch, m, k = L.shape
        n = R.shape[-1]
        self.flops += share * 2.0 * m * k * n * torch.Size(batch).numel()
        return torch.empty(*batch, m, n, dtype=L.dtype, device="meta")

    def symmetric(self, L, R, precision=None):
        return self._count(L, R, self.symmetric_share)

    def product(self, M, Z, precision=None, *, alpha=1.0, Y=None, beta=1.0):
        return self._count(M, Z)

    def poly_step(self, A, b, c, precision=None):
        return self._count(A, A, self.symmetric_share)

    def sign_step(self, Z, coefficient, precision=None):
        # Z^2, the polynomial's square and its product with Z: commuting symmetric factors.
        for _ in range(3):
            result = self._count(Z, Z, self.symmetric_share)
        return result

    def small_chain(self, X, p, coefficients, precision=None, sign=False):
        return None

    def provider_of(self, primitive, dtype, shape, precision=None) -> str:
        return "counting"

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        return W
