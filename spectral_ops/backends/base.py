"""What every backend implements: the primitives of :mod:`spectral_ops.plan`.

A backend provides primitives, never an algorithm. It is an object with

* ``name`` and ``needs_self_check`` (True for anything but the reference); optionally
  ``self_check_in_child`` (True where a faulty kernel could poison the device context: dispatch then
  runs the first-use self-check in a child process, and the class must be constructible without arguments);
* ``unavailable_reason(device, forced=False)``: None when it can run on ``device`` at all, else why not.
  ``forced`` says the user forced this backend (the Triton interpreter serves CPU tensors only then);
* ``supports(primitive, device, dtype, shape, steps=0)``: whether it can run ``primitive`` correctly on
  an operand of that dtype and shape (``steps``: the length of a small chain). Whether it *should* is
  dispatch's decision;
* one method per primitive it supports:

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
                                         by ``||X||_F``)
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

import torch

PRIMITIVES = ("symmetric", "product", "poly_step", "sign_step", "small_chain", "decay_epilogue_")


def number_and_per_matrix(value, batch_shape, device) -> tuple[float, torch.Tensor | None]:
    """A scale as the kernels take it: ``(number, None)``, or ``(1.0, one fp32 value per matrix)`` for a
    0-d or ``(..., 1, 1)`` tensor, contiguous in the matrices' row-major order. A tensor stays on the
    device: reading it on the host would synchronise."""
    if not isinstance(value, torch.Tensor):
        return float(value), None
    value = value.to(device=device, dtype=torch.float32)
    return 1.0, torch.broadcast_to(value, (*batch_shape, 1, 1)).reshape(-1).contiguous()
