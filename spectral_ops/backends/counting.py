"""Kernels that compute nothing and count: the plan's cost, read off the plan itself.

It implements every primitive of :mod:`spectral_ops.backends.base` on meta tensors (shapes only),
adding each product's matrix FLOPs as it goes, so :func:`spectral_ops.plan.cost` runs the very code
a call runs and the cost can never drift from the algorithm. ``symmetric_at_half`` counts the products
known to be symmetric (the Gram, ``A A``, the sign steps) at half, as the GPU kernels compute one
triangle of them; at full cost the count is what ``torch.utils.flop_counter.FlopCounterMode`` sees of
the torch backend. It has no fused chain (the plan composes).

Besides the FLOPs it counts each primitive's memory traffic (every operand read once, the result
written once, in the operands' dtype) and its products, one kernel launch each: what
:mod:`spectral_ops.gpu_model` needs to predict a time. The epilogue costs no matrix FLOPs, only its
traffic. Element-wise work between primitives is not counted; a matrix product the plan forms outside
the primitives (a matrix-vector product, which no backend's kernel is for) is, by :class:`UnroutedProducts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Work:
    """What a call costs: matrix FLOPs, bytes moved to and from memory, and kernel launches."""

    flops: float = 0.0
    bytes: float = 0.0
    launches: int = 0


class CountingKernels:
    """:class:`~spectral_ops.backends.base.Kernels` that count what the plan runs on meta tensors."""

    def __init__(self, symmetric_at_half: bool = False):
        self.symmetric_share = 0.5 if symmetric_at_half else 1.0
        self.flops = 0.0
        self.bytes = 0.0
        self.launches = 0

    @property
    def work(self) -> Work:
        return Work(self.flops, self.bytes, self.launches)

    def _count(self, L: torch.Tensor, R: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """``L @ R``'s shape, after adding its ``2 m k n`` FLOPs per matrix (times ``share``), its
        operands' and result's bytes and one launch."""
        *batch, m, k = L.shape
        n = R.shape[-1]
        matrices = torch.Size(batch).numel()
        self.flops += share * 2.0 * m * k * n * matrices
        self.bytes += L.element_size() * (m * k + k * n + m * n) * matrices
        self.launches += 1
        return torch.empty(*batch, m, n, dtype=L.dtype, device="meta")

    def symmetric(self, L, R, precision=None):
        return self._count(L, R, self.symmetric_share)

    def product(self, M, Z, precision=None, *, alpha=1.0, Y=None, beta=1.0):
        if Y is not None and Y is not Z:  # a Y that is Z is read once, as Z
            self.bytes += Y.numel() * Y.element_size()
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
        self.bytes += 2 * W.numel() * W.element_size() + (0 if D is None else D.numel() * D.element_size())
        self.launches += 1
        return W


# The aten products a matrix product outside the primitives comes to (``@`` decomposes into mm or bmm);
# the last two operands are the factors.
MATRIX_PRODUCTS = ("mm", "bmm", "addmm", "baddbmm")


class UnroutedProducts(TorchDispatchMode):
    """Counts into ``counting`` (a :class:`CountingKernels`) the matrix products computed outside its
    primitives while the mode is active, at full cost as ``FlopCounterMode`` counts them, with their
    traffic and one launch each. The primitives themselves compute nothing, so no product is counted
    twice; a counted product is not passed on either, so that a mode around the cost model (a caller's
    ``FlopCounterMode``) never sees the model's meta products."""

    def __init__(self, counting: CountingKernels):
        super().__init__()
        self.counting = counting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATRIX_PRODUCTS:
            return self.counting._count(*args[-2:])
        return func(*args, **(kwargs or {}))


def placeholder_coefficients(count: int | None):
    """``count`` steps of placeholder coefficients (their values do not change a count), or None: the
    op's own design, as a call without them takes."""
    return None if count is None else ((1.0, 0.0, 0.0),) * count


def counted(run, shape: tuple, dtype: torch.dtype = torch.float32, symmetric_at_half: bool = False) -> Work:
    """The :class:`Work` of ``run(kernels, W)`` on a meta ``W`` of ``shape`` and ``dtype``: :class:`CountingKernels`
    counts each primitive (a symmetric product at half with ``symmetric_at_half``, as the GPU kernels compute
    it) and :class:`UnroutedProducts` the products computed outside them."""
    kernels = CountingKernels(symmetric_at_half)
    W = torch.empty(shape, dtype=dtype, device="meta")
    with UnroutedProducts(kernels):
        run(kernels, W)
    return kernels.work
