"""PyTorch backend: the primitives as plain torch ops, on any device and float dtype.

It is the CPU backend, the fallback on GPUs, and the reference the Triton and CUDA primitives are
checked against. Each product with an added term is one BLAS call with that epilogue (``addmm``/``baddbmm``, as
torch.optim.Muon), and it has no fused small chain.

Every product goes to ``mm``/``addmm`` (a single matrix, or a batch of one) or ``bmm``/``baddbmm`` (a batch),
never through ``@``: those hand a transposed operand (``X.mT``, or the wide view of a tall weight) to
BLAS as it is, where ``@`` on a batch of one, and oneDNN on a batch dimension of size one whose stride
is not the matrix size, copy it into a contiguous tensor first. The one copy left is the epilogue's:
BLAS accumulates into its output, so ``Y`` is copied there first (as in torch.optim.Muon's ``addmm``).

Precision is carried by the operands: bf16/fp16 operands are real bf16/fp16 matmuls (fp32
accumulation, the result rounded to the operand dtype, as torch.optim.Muon's iteration), also on CPU.
fp32 products follow torch's own matmul settings: whether ``"fp32"`` and ``"tf32"`` differ on a GPU is
torch's global choice (``torch.set_float32_matmul_precision``), which this backend does not override.
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

    def symmetric(self, L, R, precision=None):
        return _mm(L, R)

    def product(self, M, Z, precision=None, *, alpha=1.0, Y=None, beta=1.0):
        if Y is None:
            MZ = _mm(M, Z)
            return MZ if alpha == 1.0 else MZ * alpha
        return _addmm(Y, M, Z, beta=beta, alpha=alpha)

    def poly_step(self, A, b, c, precision=None):
        return _addmm(A, A, A, beta=b, alpha=c)

    def sign_step(self, Z, coefficient, precision=None):
        # For symmetric Z, Z Z^T = Z^2: the sign step is one Polar Express update.
        a, b, c = coefficient
        return self.product(self.poly_step(self.symmetric(Z, Z.mT), b, c), Z, Y=Z, beta=a)

    def decay_epilogue_(self, W, D, keep, step):
        X = W.to(compute_dtype(W.dtype))
        if D is None:
            W.copy_(X * keep)
            return W
        # keep X + step D with each product rounded once, as one expression would, in one temporary
        # (two with a keep): the sum commutes, and a keep of 1 would multiply X by 1 exactly.
        new = D * step
        if isinstance(keep, (int, float)) and keep == 1.0:
            new += X
        else:
            new += X.mul_(keep) if X is not W else X * keep
        W.copy_(new)
        return W


def _matrices(t: torch.Tensor) -> torch.Tensor:
    """A batch ``t`` as one matrix (a batch of one) or a 3-D batch, as a view where its strides allow one."""
    if t.shape[:-2].numel() == 1:
        return t.view(t.shape[-2:])
    return t.reshape(-1, *t.shape[-2:])


def _mm(M, Z):
    """``M @ Z`` for operands of one batch shape."""
    if M.dim() == 2:
        return torch.mm(M, Z)
    left, right = _matrices(M), _matrices(Z)
    product = torch.mm(left, right) if left.dim() == 2 else torch.bmm(left, right)
    return product.view(*M.shape[:-2], *product.shape[-2:])


def _addmm(Y, M, Z, *, beta, alpha):
    """``beta * Y + alpha * (M @ Z)`` as one BLAS call with its epilogue (one rounding of the result),
    as torch.optim.Muon computes its iteration."""
    if M.dim() == 2:
        return torch.addmm(Y, M, Z, beta=beta, alpha=alpha)
    added, left, right = _matrices(Y), _matrices(M), _matrices(Z)
    add = torch.addmm if left.dim() == 2 else torch.baddbmm
    return add(added, left, right, beta=beta, alpha=alpha).view(Y.shape)
