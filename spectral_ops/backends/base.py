"""What every backend implements: the primitives of :mod:`spectral_ops.plan`, as typed protocols.

A backend provides primitives, never an algorithm. Three protocols say who offers what:

* :class:`Primitives`: the six primitives (table below). Every backend implements them, and so does
  every object the plan calls them on.
* :class:`Backend`: a provider, the primitives plus what dispatch asks before it routes to one.
* :class:`Kernels`: what the plan calls its primitives on, one op call's worth: the primitives plus
  ``provider_of``. "Kernels" means this across the package: dispatch's routed
  :class:`~spectral_ops.dispatch.RoutedKernels`, its :class:`~spectral_ops.dispatch.PinnedKernels` (one
  backend, for tests and benchmarks) and :class:`~spectral_ops.backends.counting.CountingKernels` (the cost).

The primitives:

=======================================  ================================================================
``symmetric(L, R)``                      ``L @ R``, known to be symmetric (``X X^T``, ``A A``, commuting
                                         polynomials in one Gram): half the tiles suffice
``product(M, Z, *, alpha, Y, beta)``     ``alpha * (M @ Z) + beta * Y`` (BLAS order) for ``r x r`` ``M``
                                         and ``r x N`` ``Z``; ``Y`` may be ``Z`` itself (``a X + B X``)
``poly_step(A, b, c)``                   ``b A + c A @ A`` for symmetric ``A``
``sign_step(Z, (a, b, c))``              ``a Z + (b Z^2 + c Z^4) Z`` for symmetric ``Z``
``small_chain(X, p, coefficients,``      optional: the whole ``S_p`` of a wide ``X`` in one launch per
``sign=False)``                          matrix (Polar Express from ``X / (1.01 ||X||_F)`` for even ``p``);
                                         with ``sign``, ``msign`` of a symmetric ``X`` (``p = 0``, normalised
                                         by ``||X||_F``); None where no fused chain serves ``X``
``decay_epilogue_(W, D, keep, step,``    ``W <- keep * W + step * D`` in place, ``D`` None for ``keep * W``;
``noise=None)``                          with ``noise`` (int16, ``W``'s shape, row-major) a bf16/fp16 ``W``
                                         is rounded stochastically, as
                                         :func:`~spectral_ops.backends.torch_backend.round_stochastic`
                                         does, bit for bit
=======================================  ================================================================

Every primitive takes the op's ``precision`` (:data:`spectral_ops.plan.PRECISIONS`), and its operands
in that precision's operand dtype (bf16/fp16 for ``"bf16"``/``"fp16"``, else the compute dtype:
float32, or float64), except ``small_chain``'s ``X`` and the epilogue's ``W`` and ``D``, which may be
of any float dtype and strides. Products accumulate in fp32 (fp64 for ``"fp64"``) and return a new
tensor in their operands' dtype. ``alpha``/``beta`` are Python numbers; ``keep``/``step`` may also be
0-d or per-matrix ``(..., 1, 1)`` tensors. The torch backend is the reference for every primitive.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

Tensor = torch.Tensor
Scale = float | Tensor


@runtime_checkable
class Primitives(Protocol):
    """The six primitives (see the module docstring for what each computes)."""

    def symmetric(self, L: Tensor, R: Tensor, precision: str) -> Tensor: ...

    def product(self, M: Tensor, Z: Tensor, precision: str, *, alpha: float = 1.0, Y: Tensor | None = None,
                beta: float = 1.0) -> Tensor: ...

    def poly_step(self, A: Tensor, b: float, c: float, precision: str) -> Tensor: ...

    def sign_step(self, Z: Tensor, coefficient: tuple[float, float, float], precision: str) -> Tensor: ...

    def small_chain(self, X: Tensor, p: int, coefficients: Sequence, precision: str,
                    sign: bool = False) -> Tensor | None: ...

    def decay_epilogue_(self, W: Tensor, D: Tensor | None, keep: Scale, step: Scale,
                        noise: Tensor | None = None) -> None: ...


@runtime_checkable
class Backend(Primitives, Protocol):
    """A provider of the primitives. ``needs_self_check`` is True for anything but the reference;
    ``self_check_in_child`` (optional) is True where a faulty kernel could poison the device context:
    dispatch then runs the first-use self-check in a child process, and the class must be
    constructible without arguments."""

    name: str
    needs_self_check: bool

    def unavailable_reason(self, device, forced: bool = False) -> str | None:
        """None when it can run on ``device`` at all, else why not. ``forced``: the user forced this
        backend (the Triton interpreter serves CPU tensors only then)."""

    def supports(self, primitive: str, device, dtype: torch.dtype, shape: tuple, steps: int = 0) -> bool:
        """Whether it can run ``primitive`` correctly on an operand of that dtype and shape (``steps``:
        the length of a small chain). Whether it *should* is dispatch's decision."""


@runtime_checkable
class Kernels(Primitives, Protocol):
    """What the plan calls its primitives on, for one op call."""

    def provider_of(self, primitive: str, dtype: torch.dtype, shape, precision: str | None = None) -> str | None:
        """The name of the backend that would run ``primitive`` on ``dtype`` operands of ``shape`` (None:
        none can): the plan's question before it weighs a factorisation against the composed products."""


# In the order the protocol declares them.
PRIMITIVES = tuple(name for name, member in vars(Primitives).items() if not name.startswith("_") and callable(member))


def number_and_per_matrix(value, batch_shape, device) -> tuple[float, torch.Tensor | None]:
    """A scale as the kernels take it: ``(number, None)``, or ``(1.0, one fp32 value per matrix)`` for a
    0-d or ``(..., 1, 1)`` tensor, contiguous in the matrices' row-major order. A tensor stays on the
    device: reading it on the host would synchronise."""
    if not isinstance(value, torch.Tensor):
        return float(value), None
    value = value.to(device=device, dtype=torch.float32)
    return 1.0, torch.broadcast_to(value, (*batch_shape, 1, 1)).reshape(-1).contiguous()
