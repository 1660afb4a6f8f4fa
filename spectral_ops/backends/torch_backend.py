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

    def small_chain(self, X, p, coefficients, precision=None, sign=False):
        return None  # no fused chain: the plan composes the other primitives

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        X = W.to(compute_dtype(W.dtype))
        if D is None:
            new = X * keep
        else:
            # keep X + step D with each product rounded once, as one expression would, in one temporary
            # (two with a keep): the sum commutes, and a keep of 1 would multiply X by 1 exactly.
            new = D * step
            if isinstance(keep, (int, float)) and keep == 1.0:
                new += X
            else:
                new += X.mul_(keep) if X is not W else X * keep
        W.copy_(new if noise is None else round_stochastic(new, W.dtype, noise))
        return W


def round_stochastic(value: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``value`` rounded to bf16/fp16 ``dtype`` away from zero with probability (distance to the
    neighbour towards zero) / (the gap between the two), so that the rounded value is unbiased; each
    element decides with its 16 ``noise`` bits (an int16 tensor of ``value``'s shape, read as
    unsigned), as the Triton and CUDA epilogues do, bit for bit. Wider dtypes do not round."""
    if dtype not in (torch.bfloat16, torch.float16):
        return value
    uniform = noise.to(torch.int32) & 0xFFFF
    if dtype == torch.bfloat16:
        # bf16 is fp32 less its low 16 bits: add 16 random bits there, let the carry decide, truncate
        # (exact). An Inf or NaN takes no noise, which could turn one into the other.
        bits = value.view(torch.int32)
        finite = (bits & 0x7F800000) != 0x7F800000
        truncated = ((bits + uniform) & -0x10000).view(torch.float32).to(dtype)
        return torch.where(finite, truncated, value.to(dtype))
    # fp16: the neighbour towards zero is the nearest value, or the one before it where that rounded up.
    nearest = value.to(dtype)
    bits = nearest.view(torch.int16).to(torch.int32) - (nearest.float().abs() > value.abs()).to(torch.int32)
    toward_zero, away = (b.to(torch.int16).view(dtype) for b in (bits, bits + 1))
    low = toward_zero.float()
    residual, gap = (value - low).abs(), (away.float() - low).abs()
    rounded = torch.where(uniform.float() * 2.0**-16 * gap < residual, away, toward_zero)
    # Beyond the largest half (and for Inf/NaN) round-to-nearest decides whether to overflow.
    return torch.where(value.abs() <= torch.finfo(dtype).max, rounded, nearest)


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
