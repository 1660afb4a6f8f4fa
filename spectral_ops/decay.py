"""The in-place decoupled decay step (SPEC 1.5): ``W <- W - scale * (lambda_p S_p(W) + lambda_1 W)``.

Every check (arguments, NaN/Inf, devices, the p > 1 stability guard) runs before the first write,
and each weight is written once, from a fully computed result, so a failure never leaves a weight
half-updated.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import dispatch, plan
from ._checks import (
    check_coefficient,
    check_finite,
    check_matrix,
    check_same_device,
    finite_limit,
    overlaps_itself,
    shared_memory_error,
)
from .backends.torch_backend import round_stochastic
from .decay_options import checked_decay_options
from .deprecations import renamed_argument
from .matrix_views import as_matrices, resolve_matrix_view
from .ops import check_band, check_method, threshold_sign_coefficients
from .plan import (  # noqa: F401  (SpectralStabilityError: the decay's public name)
    STOCHASTICALLY_ROUNDED,
    Band,
    DecayRequest,
    SpectralStabilityError,
    log_clamp,
    needs_direction,
    plain_factor,
    rounding_noise,
    stability_terms,
)
from .precision import outside_autocast


def row_block(matrices: torch.Tensor, rows) -> torch.Tensor:
    """The rows ``(start, stop)`` of every matrix of ``matrices`` (None: all of them), a view."""
    return matrices if rows is None else matrices[..., rows[0]:rows[1], :]


def matrix_index(batch_shape, position: int) -> tuple | None:
    """The index in a stack of batch shape ``batch_shape`` of its matrix at flat ``position`` (None
    for one matrix)."""
    if not batch_shape:
        return None
    return tuple(int(k) for k in torch.unravel_index(torch.tensor(position), tuple(batch_shape)))


def _as_list(W):
    if isinstance(W, torch.Tensor):
        return [W]
    if isinstance(W, (list, tuple)):
        return list(W)
    raise TypeError(f"W must be a tensor or a list of tensors, got {type(W).__name__}")


def multiply_(tensors: list[torch.Tensor], factor) -> None:
    """``t <- factor * t`` in place for every tensor, each product rounded once.

    In place, torch's multi-tensor multiply rounds a Python ``factor`` to a bf16/fp16 tensor's dtype
    first (0.97 becomes 0.96875 in bf16: a decay 4% too strong), so those take ``Tensor.mul_`` one by
    one (and a tensor factor, which a capturable step passes, multiplies out of place and copies
    back). ``factor``: one number or 0-d tensor, or a list with one per tensor."""
    if not tensors:
        return
    if all(t.dtype in (torch.float32, torch.float64) for t in tensors):
        torch._foreach_mul_(tensors, factor)
        return
    factors = factor if isinstance(factor, (list, tuple)) else [factor] * len(tensors)
    if all(isinstance(f, (int, float)) for f in factors):
        # Tensor.mul_ keeps a Python factor in fp32 (opmath) and rounds each product once: the
        # W.mul_ the README promises, in place, with no copy of the weights.
        for t, f in zip(tensors, factors):
            t.mul_(f)
    else:
        torch._foreach_copy_(tensors, torch._foreach_mul(tensors, factor))


def _extent(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage, first byte, one past the last byte)`` that ``t`` can touch."""
    start = t.storage_offset() * t.element_size()
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().data_ptr(), start, start + span * t.element_size()


def _check_writable(tensors, names: list[str]) -> None:
    """Every weight can be written in place, once, before any is: a failure found half-way through a
    list would leave the first weights decayed and the rest not. ``names``: each weight's, for the
    messages."""
    extents = []
    for i, t in enumerate(tensors):
        if not t.numel():
            continue
        if t.device.type == "meta":
            raise ValueError(f"{names[i]} is a meta tensor: it has no values to decay")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{names[i]} is an inference tensor, which cannot be written outside "
                               "torch.inference_mode()")
        if overlaps_itself(t):
            raise shared_memory_error(t, names[i], f"Decay a copy with memory of its own ({names[i]}.contiguous()), "
                                      "or take the decayed value out of place (spectral_decay)")
        storage, start, end = _extent(t)
        for j, (other_storage, other_start, other_end) in extents:
            if storage == other_storage and start < other_end and other_start < end:
                raise ValueError(f"{names[j]} and {names[i]} overlap in memory; each weight may appear once")
        extents.append((i, (storage, start, end)))


@dataclass(frozen=True)
class DecayOptions:
    """The validated, tensor-independent part of a decay call: :data:`~spectral_ops.decay_options.DECAY_OPTIONS`
    as the plan takes them (``steps`` and a band's sign options made coefficients)."""

    p: int
    band: Band | None
    polar_coefficients: tuple | None  # None: designed for the threshold (a band or prox decay's)
    sign_coefficients: tuple | None
    precision: str | None
    p0_mode: str
    stability: str
    iteration: str
    method: str
    rounding: str

    def request(self, **step) -> DecayRequest:
        """The plan's request of a decay with these options (every field of which is one of the request's) and
        the ``step``'s fields: the scale, the coefficients, ``capturable``, ..."""
        return DecayRequest(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **step)


def check_decay_options(p, spectral_weight_decay, *, ordinary_weight_decay=0.0, coefficients=None, capturable=False,
                        sync=True, names=("spectral_weight_decay", "ordinary_weight_decay"), **options) -> DecayOptions:
    """Validate every decay hyper-parameter (optimizers call this at construction time): each option of
    :data:`~spectral_ops.decay_options.DECAY_OPTIONS`, by the op's keyword (``steps``, ``precision``,
    ``iteration``, ``method``, ...; one not given takes the optimizers' default), then what they say together.

    ``capturable``: the decay must not synchronise with the host, so the stability policies that
    report to the host (``"raise"``, ``"warn"``) are refused wherever the guard can act.
    ``sync=False``: 0-d tensor coefficients are not read (see :func:`check_coefficient`). ``names``:
    what the caller calls the two coefficients, for the messages (``weight_decay`` in an optimizer).
    """
    values = checked_decay_options({"p": p, "spectral_weight_decay": spectral_weight_decay, **options}, sync=sync,
                                   names={"spectral_weight_decay": names[0]})
    p, band, p0_mode, stability = values["p"], values["band"], values["p0_mode"], values["stability"]
    check_method(values["method"], capturable, values["iteration"])
    check_coefficient(ordinary_weight_decay, names[1], sync=sync)
    if capturable and stability in ("raise", "warn") and stability_terms(p, spectral_weight_decay, band):
        raise ValueError(f"stability={stability!r} needs the host to read the stability guard, which "
                         "capturable=True forbids; pass stability='clamp' (the training default) or 'ignore'")
    if band is not None:
        if p == 0 and p0_mode == "prox":
            raise ValueError("p0_mode='prox' soft-thresholds the whole spectrum; it cannot be combined with band")
        band = check_band(band, p, sync=sync)
    return DecayOptions(
        p=p,
        band=band,
        polar_coefficients=plan.decay_polar_coefficients(values["steps"], coefficients, p, band, p0_mode),
        sign_coefficients=threshold_sign_coefficients(band.sign_steps if band else None,
                                                      band.sign_method if band else "polar_express"),
        precision=values["precision"],
        p0_mode=p0_mode,
        stability=stability,
        iteration=values["iteration"],
        method=values["method"],
        rounding=values["rounding"],
    )


def check_generator(generator, tensors: list[torch.Tensor]) -> None:
    """A stochastic rounding's ``generator`` (None: the device's default) is a ``torch.Generator`` on
    the weights' device: torch would refuse another device's only once the decay is computed."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    devices = {t.device for t in tensors}
    if any(device.type != generator.device.type for device in devices):
        raise ValueError(f"generator is on {generator.device} but the weights are on "
                         f"{', '.join(sorted(map(str, devices)))}: give a generator of their device, e.g. "
                         "torch.Generator(device=W.device).manual_seed(seed)")


@outside_autocast
@torch.no_grad()
def spectral_decay_(
    W,
    p: int,
    lr,
    spectral_weight_decay=None,
    *,
    ordinary_weight_decay=0.0,
    convention: str = "decoupled",
    schedule=None,
    band=None,
    p0_mode: str = "explicit",
    steps: int | None = None,
    coefficients=None,
    stability: str = "raise",
    precision: str | None = None,
    capturable: bool = False,
    iteration: str = "auto",
    method: str = "auto",
    matrix_view: str | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    mantissa=None,
    clamp_factors: list | None = None,
    weight_decay=None,
    _increment: bool = False,
):
    """Decay ``W`` in place: ``W <- W - s * (spectral_weight_decay * S_p(W) + ordinary_weight_decay * W)``.

    ``s`` is ``lr`` under ``convention="decoupled"`` (the decay follows the current learning rate,
    as torch's AdamW) and ``schedule`` (``eta_t``, the lr divided by the peak lr) under
    ``"independent"``. The direction comes from the weights before the update.

    ``W`` is one tensor or a list of them; same-shape tensors of a list are decayed as one batch.
    Returns ``W``. ``matrix_view`` says which matrices a tensor of more than two dimensions holds
    (SPEC 1.8, :mod:`spectral_ops.matrix_views`): ``"batch"`` (the ``torch.linalg`` convention:
    ``(..., m, n)``, leading dims index independent matrices, as MoE experts, heads or banks; a 3-D stack of
    matrices' reading unsaid) or ``"flatten"`` (one matrix, dim 0's rows by the product of the other
    sizes: a conv filter ``(out, in, kh, kw)``, as Muon reads it; a channels-last filter is decayed in a
    contiguous copy and written back). Four or more dimensions must say it (a conv filter is never
    decayed per kernel position unasked), except a 1 x 1 convolution ``(out, in, 1, 1)``, read as the
    ``(out, in)`` matrix; a Conv1d filter ``(out, in, k)`` must say ``"flatten"``, and a 3-D stack of vectors
    (``(out, in, 1)``: a kernel-size-1 Conv1d filter's shape) must say either. ``band`` (a
    :class:`Band` or dict) makes the decay band-selective; ``p0_mode="prox"`` replaces the explicit ``p = 0``
    step by exact soft-thresholding. For ``p > 1``, ``stability`` decides what happens if the step would reorder
    the singular values (``p * kappa >= 1``, ``kappa = scale * spectral_weight_decay * s_max^(p-1)``):
    ``"raise"`` (:class:`SpectralStabilityError`, nothing written), ``"warn"``, ``"clamp"`` (scale
    those matrices' coefficient down to ``p * kappa = 1/2``, logging each one with its factor on the
    ``spectral_ops.decay`` logger) or ``"ignore"``.
    ``precision``: the operands of the iteration (see :func:`spectral_ops.polar`); the decay
    arithmetic itself is fp32 (fp64 for fp64 weights) whatever it is.

    ``capturable=True`` makes the call free of host synchronisation (for CUDA graphs and
    torch.compile). It then does **not** check that ``W`` is finite (a NaN/Inf weight stays
    non-finite instead of being refused), nor the values of 0-d tensor coefficients (their shape
    and dtype still), and ``stability`` must be ``"clamp"`` or ``"ignore"`` where the guard applies;
    the clamp is computed on the device, with the same factors, and not logged.

    ``clamp_factors``: a list, to which the call appends one float64 tensor per weight of ``W``, of
    its batch shape ``shape[:-2]`` (0-d for a matrix) and on its device: the factor by which the clamp
    multiplied each matrix's spectral coefficient (1 where it did not). Under ``capturable`` this is
    how a caller reads the clamps later, without a host sync.

    ``iteration``: how an even ``p >= 2`` iterates (see :func:`spectral_ops.ops.check_iteration`).
    ``method``: how the direction is computed, as in :func:`spectral_ops.spectral_power` (``"auto"``:
    the Gram route on GPUs, a factorisation on CPUs where that is faster; the guard's ``s_max`` is then
    the factorisation's, exact to its rounding, where the Gram route bounds it from its squares).

    ``rounding``: how the result, computed in fp32, is rounded into bf16 and fp16 weights:
    ``"nearest"``, or ``"stochastic"`` (unbiased: up or down with probabilities that make the expected
    weight the exact one, so that a step below half a unit of the weight, which rounding to nearest
    loses every time, is kept on average), with random bits from ``generator`` (a ``torch.Generator``
    on the weights' device; None: the device's default one, which ``torch.manual_seed`` seeds). A seed
    gives the same bits on every provider, bit for bit, and a captured graph draws fresh ones at each
    replay. Wider weights are written as computed.

    ``mantissa``: the low 16 bits of fp32 weights kept as a bf16 ``W`` plus a ``uint16`` (or
    ``int16``) tensor of its shape (modded-nanogpt's layout: the fp32 value's bits are
    ``(W's bits << 16) | mantissa``), or a list of them, one per weight. The pair is decayed as that
    fp32 value and written back as a pair, so no step is lost to bf16's rounding.

    ``weight_decay`` is a deprecated alias of ``spectral_weight_decay`` (the name of ``lambda_1`` in
    every optimizer of the family).
    """
    spectral_weight_decay = renamed_argument("spectral_decay_", "spectral_weight_decay", spectral_weight_decay,
                                             "weight_decay", weight_decay)
    if spectral_weight_decay is None:
        raise TypeError("spectral_decay_ needs spectral_weight_decay (the spectral coefficient lambda_p)")
    tensors = _as_list(W)
    names = ["W"] if isinstance(W, torch.Tensor) else [f"W[{i}]" for i in range(len(tensors))]
    for t, name in zip(tensors, names):
        check_matrix(t, name)
    views = [resolve_matrix_view(t.shape, matrix_view, name) for t, name in zip(tensors, names)]
    check_same_device(tensors)
    mantissas = None if mantissa is None else _checked_mantissas(tensors, mantissa, rounding, _increment)
    _check_writable(tensors + (mantissas or []), names + [f"mantissa[{i}]" for i in range(len(mantissas or []))])
    sync = not capturable
    check_coefficient(lr, "lr", sync=sync)
    options = check_decay_options(
        p, spectral_weight_decay, ordinary_weight_decay=ordinary_weight_decay, convention=convention, band=band,
        p0_mode=p0_mode, steps=steps, coefficients=coefficients, stability=stability, precision=precision,
        capturable=capturable, sync=sync, iteration=iteration, method=method, matrix_view=matrix_view,
        rounding=rounding,
    )
    if rounding == "stochastic":
        check_generator(generator, tensors)
    if convention == "independent":
        if schedule is None:
            raise ValueError("convention='independent' needs schedule= (eta_t: the current lr / the peak lr)")
        scale = check_coefficient(schedule, "schedule", sync=sync)
    elif schedule is not None:
        raise ValueError("schedule= is used only with convention='independent'; the decoupled convention "
                         "scales the decay by lr")
    else:
        scale = lr
    # What is decayed: each weight itself, where its matrices are a view of it; else a copy, written back
    # by the commit (a mantissa pair, as the fp32 value it holds; a channels-last filter read with
    # matrix_view='flatten', whose matrix is no view of it).
    if mantissas is not None:
        values = [with_mantissa(w, m) for w, m in zip(tensors, mantissas)]
    else:
        values = [t.contiguous() if t.ndim > 2 and view == "flatten" else t for t, view in zip(tensors, views)]
    weights, tensors = tensors, [as_matrices(value, view) for value, view in zip(values, views)]
    if sync:
        check_finite(tensors, "W")
    pending = prepare_decay(tensors, options, scale=scale, spectral_weight_decay=spectral_weight_decay,
                            ordinary_weight_decay=ordinary_weight_decay, capturable=capturable, increment=_increment,
                            generator=generator)
    pending.copies = [(i, weight, value, None if mantissas is None else mantissas[i])
                      for i, (value, weight) in enumerate(zip(values, weights)) if value is not weight]
    if sync and pending.decayed:
        # A finite weight never becomes non-finite: the decayed values are checked before any is written.
        check_finite(pending.new_values(), "W", reason="would not be finite after this decay (its exact value "
                     "exceeds the weights' dtype); nothing was written", error=OverflowError)
    pending.commit()
    for i, position, factor, order in pending.clamped:
        index = matrix_index(tensors[i].shape[:-2], position)
        log_clamp(f"{names[i]}{list(index) if index else ''} {tuple(tensors[i].shape[-2:])}", factor, order)
    if clamp_factors is not None:
        clamp_factors.extend(pending.clamp_factors.get(i, torch.ones(t.shape[:-2], dtype=torch.float64,
                                                                     device=t.device)) for i, t in enumerate(tensors))
    return W


@torch.no_grad()
def spectral_decay(W, p: int, lr, spectral_weight_decay=None, *, increment: bool = False, **options):
    """:func:`spectral_decay_` out of place (torch's naming): the decayed value of ``W`` (a new tensor,
    or a list of them for a list), computed as the in-place call computes it, with the same arguments,
    guard, conventions, clamp factors and checks; ``W`` itself is not written. Like every op of the
    package it is autograd-free: the result never requires grad, whatever ``W`` does (a graph through
    the copy of ``W`` alone would give an identity Jacobian, which is not the decay's).

    ``increment=True`` returns the step itself, ``-s (lambda_p S_p(W) + lambda_1 W)``, each term formed
    as such: ``W + increment`` is the decayed value to one rounding, and a step far below ``W``'s
    rounding (a small lr, bf16 weights) is not lost to cancellation, as the decayed value less ``W``
    would lose it. For clients that add it to their own update or to a higher-precision copy of the
    weights. ``p0_mode="prox"`` refuses it: the soft-threshold is a new matrix, not ``W`` plus a term,
    so its increment would carry ``W``'s reconstruction rounding."""
    if increment and options.get("p0_mode") == "prox" and p == 0:
        raise ValueError("increment=True is not available with p0_mode='prox': the soft-threshold rebuilds W, so "
                         "its increment would carry W's rounding; take the decayed value (increment=False), or "
                         "p0_mode='explicit', whose increment is -s * lambda_0 * Q")
    if options.get("mantissa") is not None:
        raise ValueError("spectral_decay (out of place) does not take mantissa=: the pair is one fp32 value, so decay "
                         "it in place with spectral_decay_(W, ..., mantissa=mantissa), or decay "
                         "spectral_ops.decay.with_mantissa(W, mantissa), the fp32 value, out of place")
    # Cloned under no_grad: the copies carry no graph (the in-place call checks what is not a tensor).
    copies = W.clone() if isinstance(W, torch.Tensor) else [
        t.clone() if isinstance(t, torch.Tensor) else t for t in _as_list(W)]
    return spectral_decay_(copies, p, lr, spectral_weight_decay, _increment=increment, **options)


MANTISSA_DTYPES = (torch.uint16, torch.int16)


def with_mantissa(W: torch.Tensor, mantissa: torch.Tensor) -> torch.Tensor:
    """The fp32 value a bf16 ``W`` and its ``mantissa`` (its low 16 bits, uint16 or int16) hold: a new
    tensor, whose bits are ``(W's bits << 16) | mantissa`` (modded-nanogpt's layout)."""
    high = W.view(torch.int16).to(torch.int32) << 16
    return (high | (mantissa.view(torch.int16).to(torch.int32) & 0xFFFF)).view(torch.float32)


def split_mantissa_(value: torch.Tensor, W: torch.Tensor, mantissa: torch.Tensor) -> None:
    """Write the fp32 ``value`` into the pair: its high 16 bits into ``W`` (bf16, so ``W`` alone is the
    value truncated towards zero), its low 16 into ``mantissa``. Exact: ``with_mantissa`` reads it back."""
    bits = value.view(torch.int32)
    W.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    mantissa.view(torch.int16).copy_((bits & 0xFFFF).to(torch.int16))


def _checked_mantissas(weights: list, mantissa, rounding: str, increment: bool) -> list:
    """``mantissa`` (a tensor or a list) as one low-bits tensor per bf16 weight, checked."""
    if rounding != "nearest":
        raise ValueError("mantissa= keeps the weights' fp32 value exactly, so there is nothing to round: leave "
                         "rounding='nearest' (stochastic rounding is for bf16 weights without a mantissa)")
    if increment:
        raise ValueError("mantissa= writes the decayed pair in place; for the increment, decay "
                         "spectral_ops.decay.with_mantissa(W, mantissa) with spectral_decay(..., increment=True)")
    mantissas = _as_list(mantissa)
    if len(weights) != len(mantissas):
        raise ValueError(f"mantissa= needs one tensor per weight: {len(mantissas)} for {len(weights)} weights")
    for i, (w, m) in enumerate(zip(weights, mantissas)):
        where = "" if len(weights) == 1 else f"[{i}]"
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"mantissa{where} must be a tensor, got {type(m).__name__}")
        if w.dtype != torch.bfloat16:
            raise TypeError(f"mantissa= holds the low bits of bf16 weights, but W{where} is {w.dtype}")
        if m.dtype not in MANTISSA_DTYPES:
            raise TypeError(f"mantissa{where} must be uint16 or int16 (the fp32 value's low 16 bits), got {m.dtype}")
        if m.shape != w.shape or m.device != w.device:
            raise ValueError(f"mantissa{where} is {tuple(m.shape)} on {m.device}, W{where} {tuple(w.shape)} on "
                             f"{w.device}: each must match its weight")
    return mantissas


@dataclass
class PendingWrite:
    """What a decay or an optimizer step will write, and where: every value computed and checked,
    nothing written yet. The one record of a pending write in the package, and :meth:`commit` the one
    function that writes it (whatever else writes into a weight is the update it calls, see ``update``).

    The targets are ``tensors[i]``: weights, the matrices or the row blocks of them a decay takes
    (``rows[i]``: ``(start, stop)``, None for all rows), or this rank's part of those. Each belongs to
    the parameter ``owners[i]``, whose decision ``keep[owners[i]]`` the commit follows: ``True`` (or
    None) writes it, ``False`` leaves it unchanged, a 0-d bool tensor decides on the device (a
    capturable step's skip, written as masked writes: no host read).

    What is written: ``factors[i]``, a target multiplied in place by one number (one multi-tensor
    multiply per factor, as torch's AdamW decays); ``decayed[i]``, its new value, copied in, or with
    ``increments`` its increment, added to the target as it is then (a decay attached to another
    optimizer, written after that one's step; ``stochastic``: that addition rounds stochastically);
    ``copies``, ``(owner, destination, source, mantissa)``: a target that is no view of its weight (a
    channels-last filter's matrix, a bf16 weight's fp32 value), copied back into it (split into the pair
    where ``mantissa`` is its low bits); ``update``, the optimizer's own element-wise update of the
    parameters (``update(keep)`` allocates what it needs and returns the :class:`UpdateWrite` that writes).

    ``cautious`` (SPEC 11): each increment is kept only where it agrees with the step's own update ``u``
    (:func:`cautious_`), and added after that update is written: ``u`` is the one ``update`` writes (its
    :attr:`UpdateWrite.directions`), or, attached to another optimizer, that one's step, read as
    ``W_before - W_after`` from ``before[i]``, a copy of target ``i`` (of its weight, for a target that is
    no view of it) taken before that step (:meth:`keep_before`). ``views`` take a parameter-shaped ``u``
    to each target's.

    What is checked (:meth:`checks`, before any write): ``checks`` are ``(owner, tensor, limit)``
    triples known when the step is prepared (the gradients); every decayed value, ``checked[owner]``
    (Muon's directions) and the tensor ``coefficients`` (lr, decay coefficients: ``owner`` None, every
    parameter) are checked once computed, finite (see :func:`spectral_ops._checks.finite_limit`).

    An optimizer's record also holds its ``group`` and ``params`` (the parameters ``keep`` decides for).
    """

    tensors: list = field(default_factory=list)
    owners: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    factors: dict = field(default_factory=dict)
    decayed: dict = field(default_factory=dict)
    increments: bool = False
    stochastic: bool = False
    cautious: bool = False
    before: dict = field(default_factory=dict)
    # Target index -> the function that takes a tensor laid out as the target's parameter (this rank's
    # part) to the view of it the target is of the parameter (its matrices, their rows); none where
    # the target is the parameter, or no view of it (a copy, whose increment goes through to it).
    views: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)
    update: object = None
    checks: list = field(default_factory=list)
    checked: list = field(default_factory=list)
    coefficients: list = field(default_factory=list)
    group: dict | None = None
    params: list = field(default_factory=list)
    # Target index -> the factors (float64, shape target.shape[:-2], on its device) by which the
    # stability clamp multiplied its matrices' spectral coefficient, for each target of a batch the
    # clamp could act on (1 where it did not).
    clamp_factors: dict = field(default_factory=dict)
    # Eager only: (target index, flat position of the matrix in the target's batch, factor, p * kappa)
    # of each matrix the clamp reduced, for the log.
    clamped: list = field(default_factory=list)

    def __post_init__(self):
        self.owners = self.owners or list(range(len(self.tensors)))
        self.rows = self.rows or [None] * len(self.tensors)

    def include(self, part: "PendingWrite", owners, rows=None) -> None:
        """Take in the writes of ``part`` (a decay computed on its own, its targets its own owners),
        its ``i``-th target belonging to the parameter ``owners[i]`` with the rows ``rows[i]``."""
        offset = len(self.tensors)
        self.tensors += part.tensors
        self.owners += [owners[i] for i in part.owners]
        self.rows += list(rows) if rows is not None else [None] * len(part.tensors)
        self.factors.update((offset + i, factor) for i, factor in part.factors.items())
        self.decayed.update((offset + i, value) for i, value in part.decayed.items())
        self.clamp_factors.update((offset + i, factor) for i, factor in part.clamp_factors.items())
        self.clamped += [(offset + i, *report) for i, *report in part.clamped]

    def new_values(self) -> list[torch.Tensor]:
        """Each target's value after the commit where it is computed already, else the target itself
        (a plain multiply is computed at commit)."""
        return [self.decayed.get(i, t) for i, t in enumerate(self.tensors)]

    def as_increments(self) -> None:
        """Turn the multiplies into increments, ``target * factor`` (the factor an increment's): the
        targets change before an attached decay is written."""
        self.decayed.update((i, self.tensors[i] * factor) for i, factor in self.factors.items())
        self.factors, self.increments = {}, True

    def all_checks(self) -> list:
        """Every check, ``(owner, tensor, limit)``; ``owner`` None: a check of every parameter."""
        return (self.checks + [(i, d, finite_limit(d)) for i, d in enumerate(self.checked)]
                + [(self.owners[i], value, finite_limit(value)) for i, value in self.decayed.items()]
                + [(None, value, finite_limit(value)) for value in self.coefficients])

    def destination(self, i: int, through: dict | None = None) -> torch.Tensor:
        """What target ``i``'s increment is added to: the target, or the weight it is a copy of
        (``through``: :meth:`_through`, where the caller has it)."""
        through = self._through() if through is None else through
        return through.get(id(self.tensors[i]), self.tensors[i])

    def _through(self) -> dict:
        return {id(source): destination for _, destination, source, _ in self.copies}

    def keep_before(self) -> None:
        """Copy, for a cautious record attached to another optimizer, what each increment is added to,
        before that optimizer's step writes it: :meth:`commit` reads that step's ``u`` from it, and
        computes its mask in it (the copy is the mask's only memory)."""
        through = self._through()
        self.before = {i: self.destination(i, through).clone() for i in self.decayed}

    def commit(self, keep=None) -> None:
        """Write the record, following ``keep`` (one decision per owner; None: write everything)."""
        keep = [True] * (max(self.owners, default=-1) + 1) if keep is None else keep
        write_update = None if self.update is None else self.update(keep)  # it allocates before the first write
        kept = [keep[owner] for owner in self.owners]
        if self.cautious:
            mask = self._cautious_mask(kept, write_update)  # it allocates before the first write too
            if write_update is not None:
                write_update()
                write_update = None
            mask()
        if self.increments:
            self._add_increments(kept)
        else:
            self._write_values(kept)
            for owner, destination, source, mantissa in self.copies:
                if keep[owner] is False:  # a skipped one's copy holds its old value
                    continue
                if mantissa is None:
                    destination.copy_(source.view(destination.shape))
                else:
                    split_mantissa_(source, destination, mantissa)
        if write_update is not None:
            write_update()

    def _write_values(self, kept: list) -> None:
        by_factor = []  # (factor, targets): one multiply per factor, in the order the decay met them
        for i, factor in self.factors.items():
            if kept[i] is False:
                continue
            # Grouped by identity with `is`, not id(): Dynamo before torch 2.13 cannot take the id of a
            # tensor made in the traced step, and breaks the graph there.
            indices = next((indices for known, indices in by_factor if known is factor), None)
            if indices is None:
                by_factor.append((factor, indices := []))
            indices.append(i)
        for factor, indices in by_factor:
            if all(kept[i] is True for i in indices):
                multiply_([self.tensors[i] for i in indices], factor)
            else:
                multiply_([self.tensors[i] for i in indices], [torch.where(kept[i], factor, 1.0) for i in indices])
        for i, value in self.decayed.items():
            if kept[i] is True:
                self.tensors[i].copy_(value)
            elif kept[i] is not False:
                self.tensors[i].copy_(torch.where(kept[i], value, self.tensors[i]))

    def _cautious_mask(self, kept: list, update):
        """Allocate what the mask of a cautious record needs (nothing where it reads ``u`` from
        :attr:`before`, which it overwrites), and return the function that masks every increment
        (:func:`cautious_`) once the step's update is written: ``u`` from ``update``'s directions,
        read through each target's :attr:`views` (a direction laid out otherwise than its weight is
        copied into the weight's layout first, once written), or from the copies taken before
        another optimizer's step."""
        through = self._through()
        directions = None if update is None else update.directions()
        copies, jobs = [], []
        laid_out = {}  # owner -> its direction laid out as its weight is
        for i, increment in self.decayed.items():
            if kept[i] is False:
                continue
            destination = self.destination(i, through)
            increment = increment.view(destination.shape)
            if i in self.before:
                jobs.append((increment, destination, self.before[i], None))
                continue
            owner = self.owners[i]
            if owner not in laid_out:
                weight, direction = directions[owner]
                if direction.stride() != weight.stride():  # read through the weight's views: laid out as it
                    copy = torch.empty_strided(weight.shape, weight.stride(), dtype=direction.dtype,
                                               device=weight.device)
                    copies.append((copy, direction))
                    direction = copy
                laid_out[owner] = direction
            view = self.views.get(i)
            direction = laid_out[owner] if view is None else view(laid_out[owner])
            jobs.append((increment, None, direction.view(destination.shape), torch.empty_like(increment)))

        def mask():
            for copy, direction in copies:
                copy.copy_(direction)
            for increment, destination, update_signs, scratch in jobs:
                if destination is not None:  # u is the other optimizer's step: before - after
                    update_signs = scratch = update_signs.sub_(destination)
                cautious_(increment, update_signs, scratch)
        return mask

    def _add_increments(self, kept: list) -> None:
        # A device decision masks its increment in place first: the additions then allocate nothing
        # but a stochastic rounding's bits, and a skipped target adds exact zeros. A target that is no
        # view of its weight takes the increment through to the weight.
        added = []
        through = self._through()
        for i, increment in self.decayed.items():
            if kept[i] is False:
                continue
            if kept[i] is not True:
                torch.where(kept[i], increment, increment.new_zeros(()), out=increment)
            target = self.destination(i, through)
            added.append((target, increment.view(target.shape)))
        for target, increment in added:
            if self.stochastic and target.dtype in STOCHASTICALLY_ROUNDED:
                noise = rounding_noise(target, STOCHASTIC_WRITE)
                target.copy_(round_stochastic(target.float() + increment, target.dtype, noise))
            else:
                target.add_(increment)


@dataclass
class UpdateWrite:
    """What an optimizer record's ``update(keep)`` returns (see :class:`PendingWrite`), everything it
    needs allocated: calling it writes the update. ``directions()`` (for a cautious decay, SPEC 11), per
    parameter of the record, ``(weight, direction)``: the tensor the parameter's targets are views of (its
    local part), and a tensor of its shape whose values, once the update is written, have the signs of
    the update ``u`` it adds (``W <- W - lr u``): Adam's first moment, SGD's momentum, Muon's polar
    factor; None for a parameter it does not write."""

    write: Callable[[], None]
    directions: Callable[[], list]

    def __call__(self) -> None:
        self.write()


def cautious_(increment: torch.Tensor, update: torch.Tensor, scratch: torch.Tensor) -> None:
    """SPEC 11's mask of a decay term, in place: ``increment`` is ``-s lambda T`` (the term ``T``,
    ``S_p(W)`` or ``W``, times ``s lambda >= 0``), kept where ``u * T >= 0`` (``u * increment <= 0``) and
    zero elsewhere: the decay acts only where it does not oppose the step's update ``u``, and wherever
    ``u`` is 0. ``update``: ``u``, or any tensor with its signs; ``scratch``: a tensor of
    ``increment``'s shape and dtype (``update`` itself where that may be overwritten). No host read and
    no allocation: ``sign(u) * increment`` is exact (a product by -1, 0 or 1), so the test of its sign
    is the test of ``u * increment``'s, which a product in the weights' dtype could underflow to 0."""
    torch.sign(update, out=scratch)
    scratch.mul_(increment)
    scratch.le_(0)  # 1 where kept, 0 where the decay opposes u
    increment.mul_(scratch)


# The request whose random bits an attached decay's stochastic write draws (rounding_noise reads
# only the rounding and the generator: the device's default one).
STOCHASTIC_WRITE = DecayRequest(p=1, scale=0.0, spectral_weight_decay=0.0, rounding="stochastic")


def prepare_decay(tensors: list[torch.Tensor], options: DecayOptions, *, scale, spectral_weight_decay,
                  ordinary_weight_decay, capturable: bool, increment: bool = False, generator=None) -> PendingWrite:
    """The decay of :func:`spectral_decay_` on validated arguments (optimizers validate theirs once),
    computed but not written: distinct matrices on one device, ``options`` from
    :func:`check_decay_options`, ``scale`` the lr or the schedule. Same-shape weights are decayed as
    one stack, by :func:`spectral_ops.plan.decay_` (the guard, the direction and the write).
    ``increment``: the step's increment instead of the new value (see :func:`spectral_decay`).
    ``generator``: a stochastic rounding's random bits (None: the device's default generator). Its callers
    run it outside any autocast (:func:`spectral_decay_`, an optimizer's step: ``outside_autocast``)."""
    nonempty = [i for i, t in enumerate(tensors) if t.numel()]
    rounds_stochastically = options.rounding == "stochastic" and any(
        tensors[i].dtype in STOCHASTICALLY_ROUNDED for i in nonempty)
    if not needs_direction(options.p, spectral_weight_decay, options.band) and not rounds_stochastically:
        # One multi-tensor scaling at commit, as torch's AdamW decays.
        factor = plain_factor(scale, spectral_weight_decay, ordinary_weight_decay, increment)
        return PendingWrite(tensors, factors=dict.fromkeys(nonempty, factor))
    request = options.request(scale=scale, spectral_weight_decay=spectral_weight_decay,
                              ordinary_weight_decay=ordinary_weight_decay, capturable=capturable, increment=increment,
                              generator=generator)
    groups = defaultdict(list)
    for i in nonempty:
        groups[(tuple(tensors[i].shape), tensors[i].dtype)].append(i)
    pending = PendingWrite(tensors)
    for indices in groups.values():
        # The decay is computed in a copy: a stack of a same-shape batch, or a clone of a lone weight.
        stack = torch.stack([tensors[i] for i in indices]) if len(indices) > 1 else tensors[indices[0]].clone()
        outcome = plan.decay_(dispatch.kernels_for("decay_", stack), stack, request)
        pending.decayed.update(zip(indices, stack.unbind(0) if len(indices) > 1 else [stack]))
        if outcome.clamp_factor is not None:
            clamp = outcome.clamp_factor
            pending.clamp_factors.update(zip(indices, clamp.unbind(0) if len(indices) > 1 else [clamp]))
            per_weight = tensors[indices[0]].shape[:-2].numel()
            pending.clamped.extend((indices[position // per_weight], position % per_weight, *report)
                                   for position, report in outcome.clamped.items())
    return pending
