"""How a tensor of more than two dimensions holds matrices (SPEC 1.8), one rule for every entry point.

``"batch"``: its leading dims index independent matrices ``(..., m, n)`` (MoE experts, heads, parameter
banks: the ``torch.linalg`` convention). ``"flatten"``: it is one matrix of dim 0's rows by the product of
the other sizes (a conv filter ``(out, in, kh, kw)``, as Muon reads it). The two readings give different
maths, so a reading is taken unsaid only where it is the only one that means anything, or the one a
caller of an ``(..., m, n)`` function means:

* a 1 x 1 convolution's filter ``(out, in, 1, 1)`` (or ``(out, in, 1, 1, 1)``) is read ``"flatten"``, as
  the ``(out, in)`` matrix: its batch reading would hold 1 x 1 matrices, whose spectral power is
  element-wise, no spectral decay at all (:func:`unambiguous_view` has the rule);
* an op (:mod:`spectral_ops.ops`, :func:`~spectral_ops.spectral_decay_`) reads a 3-D tensor of matrices as a
  stack, as ``torch.linalg`` and every batched Newton-Schulz do: a 3-D tensor handed to a spectral op is a
  stack of experts, heads or a bank's matrices (modded-nanogpt's banks), or a batch of momenta. A Conv1d
  filter ``(out, in, k)`` has the same shape, and must say ``matrix_view="flatten"``;
* a 3-D tensor whose stack would hold vectors, ``(out, in, 1)`` or ``(out, 1, k)``, is refused unsaid by the
  ops as by the optimizers: it is as much a Conv1d filter of kernel size 1 (or one input channel), whose
  ``(out, in)`` matrix its caller means, as a stack of columns (rows), whose spectral power only scales
  each by a power of its norm;
* four or more dimensions are a conv filter or a nest of stacks: an op refuses them unsaid;
* an optimizer refuses any parameter of three or more dimensions unsaid: it is handed a model's
  parameters wholesale, Conv1d filters included (:func:`matrix_view_of` says the reading per module, as
  ``spectral_ops.optim.param_groups_by_module`` and ``spectral_ops.tune`` take it).
"""

from __future__ import annotations

import math

import torch

from ._checks import check_choice

MATRIX_VIEWS = ("batch", "flatten")


def check_matrix_view(matrix_view, optional: bool = False):
    """``matrix_view`` is one of :data:`MATRIX_VIEWS` (or None where ``optional``: not said)."""
    if optional and matrix_view is None:
        return None
    return check_choice(matrix_view, "matrix_view", MATRIX_VIEWS)


def matrix_view_of(module: torch.nn.Module, param: torch.Tensor) -> str | None:
    """How a parameter of ``module`` holds matrices (SPEC 1.8): None for a vector or a matrix (nothing to
    say), ``"flatten"`` for a convolution's filters (one matrix of output channels by the rest, as Muon
    reads them), ``"batch"`` for any other tensor of 3 or more dimensions (stacked experts, heads,
    parameter banks: leading dims index independent matrices)."""
    if param.ndim <= 2:
        return None
    return "flatten" if isinstance(module, torch.nn.modules.conv._ConvNd) else "batch"


def unambiguous_view(shape) -> str | None:
    """The reading of a tensor of ``shape`` that needs no ``matrix_view`` (the optimizers' rule), or None
    where the readings give different maths and the caller must say which.

    ``"flatten"`` (one matrix, dim 0's rows by the product of the other sizes) where

    * the tensor is a matrix or a vector (at most two dimensions): there is one reading;
    * every dim but the last has size 1: both readings are the same ``(1, n)`` matrix;
    * every dim after the first two has size 1 and so has ``shape[-2]`` (a 1x1 convolution's
      ``(out, in, 1, 1)``): the ``"batch"`` reading would be a stack of 1x1 matrices, scalars, whose
      ``S_p`` is ``sign(w) |w|^p`` element by element and whose polar factor is ``sign(w)``, which no
      spectral method means; the ``(out, in)`` matrix is the one reading that is a matrix.

    ``(out, in, 1)`` is not: its batch reading is ``out`` columns of ``in`` entries, vectors whose decay
    scales each by its norm, a different but meaningful maths from the ``(out, in)`` matrix's."""
    shape = tuple(shape)
    if len(shape) <= 2 or all(size == 1 for size in shape[:-1]):
        return "flatten"
    if all(size == 1 for size in shape[2:]) and shape[-2] == 1:
        return "flatten"
    return None


def op_view(shape) -> str | None:
    """The reading an op takes unsaid: a stack for a 3-D tensor of matrices, two dims of at least 2 (the
    ``torch.linalg`` convention, which an op's caller of ``(..., m, n)`` functions means), else
    :func:`unambiguous_view`'s, the optimizers' (None unless evident: the caller must say). A 3-D stack of
    vectors, ``(out, in, 1)``, is a Conv1d filter's shape too (kernel size 1), read as its ``(out, in)`` matrix
    0.4 away from the stack of columns: neither is guessed. A stack of 1 x 1 matrices is evident, as a 1 x 1
    convolution is: its ``(out, 1)`` column, scalars being no matrices."""
    shape = tuple(shape)
    if len(shape) == 3 and min(shape[1:]) > 1:
        return "batch"
    return unambiguous_view(shape)


def ambiguity_message(shape, what: str, how: str) -> str:
    """Why a ``shape`` tensor needs its matrix_view said, and how to say it: ``what`` names the tensor and
    what reads it, ``how`` the way to pass the option (an argument, a group key)."""
    return (f"{what} has shape {tuple(shape)}: say which matrices it holds with {how}: 'batch' (leading dims "
            "index independent (..., m, n) matrices: MoE experts, heads, parameter banks) or 'flatten' (one "
            "matrix, dim 0's rows by the product of the other sizes: conv filters, as Muon reads them). The two "
            "readings give different results, so neither is guessed")


def resolve_matrix_view(shape, matrix_view, name: str = "W") -> str:
    """The reading of a ``shape`` tensor that an op or a decay applies: ``matrix_view`` where said (checked),
    else :func:`op_view`'s, else a ValueError that names the fix."""
    if check_matrix_view(matrix_view, optional=True) is not None:
        return matrix_view
    view = op_view(shape)
    if view is None:
        raise ValueError(ambiguity_message(shape, name, "matrix_view="))
    return view


def batched(shape, matrix_view) -> bool:
    """Whether a tensor of ``shape`` is read as a stack of matrices (rather than one)."""
    return len(shape) > 2 and matrix_view == "batch"


def matrix_dims(shape, matrix_view) -> tuple[int, int]:
    """``(rows, columns)`` of each matrix a tensor of ``shape`` holds under ``matrix_view``."""
    if len(shape) <= 2 or batched(shape, matrix_view):
        return shape[-2], shape[-1]
    return shape[0], math.prod(shape[1:])


def as_matrices(tensor: torch.Tensor, matrix_view) -> torch.Tensor:
    """``tensor`` as the matrices it holds, a view of it (so that writing it writes ``tensor``):
    ``(rows, columns)`` for one matrix, ``(*batch, rows, columns)`` for a stack. A shard of a
    parameter (its rows of dim 0) reads the same way. Sizes are spelt out, not -1, which an empty
    shard (no rows on this rank) leaves ambiguous."""
    if tensor.ndim <= 2 or batched(tensor.shape, matrix_view):
        return tensor
    if not tensor.is_contiguous():
        raise ValueError(f"a {tuple(tensor.shape)} tensor read with matrix_view='flatten' must be contiguous: its "
                         "matrix is a view of it, which in-place writes go through")
    return tensor.view(matrix_dims(tensor.shape, matrix_view))


def matrices_of(tensor: torch.Tensor, matrix_view) -> torch.Tensor:
    """``tensor``'s matrices for an out-of-place op: :func:`as_matrices`, through a contiguous copy where a
    flatten reading cannot be a view (a channels-last conv filter)."""
    if tensor.ndim > 2 and not batched(tensor.shape, matrix_view):
        tensor = tensor.contiguous()
    return as_matrices(tensor, matrix_view)
