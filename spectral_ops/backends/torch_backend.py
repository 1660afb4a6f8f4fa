"""PyTorch backend: the primitives as plain torch ops, on any device and float dtype.

It is the CPU backend, the fallback on GPUs, and the reference the Triton and CUDA primitives are
checked against. Each primitive is written exactly as the arithmetic it defines (the order of every
multiply and add is part of the reference), and it has no fused small chain.
"""

from __future__ import annotations

import torch

from ..linalg import compute_dtype


class TorchBackend:
    name = "torch"
    needs_self_check = False

    def unavailable_reason(self, device: torch.device | None = None, forced: bool = False) -> str | None:
        return None

    def supports(self, primitive: str, device, dtype, shape, steps: int = 0) -> bool:
        return primitive != "small_chain"

    def symmetric(self, L, R):
        return L @ R

    def product(self, M, Z, *, beta=1.0, Y=None, alpha=1.0):
        MZ = M @ Z
        if Y is None:
            return MZ if beta == 1.0 else MZ * beta
        if alpha == 1.0:
            return torch.add(Y, MZ, alpha=beta)
        if beta == 1.0:
            return torch.add(MZ, Y, alpha=alpha)
        return torch.add(Y * alpha, MZ, alpha=beta)

    def poly_step(self, A, b, c):
        return (A @ A).mul_(c).add_(A, alpha=b)

    def sign_step(self, Z, coefficient):
        # For symmetric Z, Z Z^T = Z^2: the sign step is one Polar Express update.
        a, b, c = coefficient
        return self.product(self.poly_step(self.symmetric(Z, Z.mT), b, c), Z, Y=Z, alpha=a)

    def decay_epilogue_(self, W, D, keep, step):
        X = W.to(compute_dtype(W.dtype))
        W.copy_(X * keep if D is None else X * keep + step * D)
        return W
