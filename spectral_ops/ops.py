"""The public spectral functions (SPEC 1.2-1.4): validation here, the algorithm in :mod:`spectral_ops.plan`.

Every function takes a matrix, or a tensor of more than two dimensions read as its ``matrix_view`` says
(:mod:`spectral_ops.matrix_views`: ``"batch"``, a stack ``(..., m, n)``, what a 3-D tensor of matrices is read
as unsaid; ``"flatten"``, one matrix of dim 0's rows; a stack of vectors and four or more dimensions need it
said), on CPU or CUDA, in float64, float32, float16 or bfloat16, with any strides. It runs without autograd
(the result never requires grad) and without an enclosing autocast (its precision is its own:
:func:`~spectral_ops.precision.outside_autocast`), and returns a new tensor of the input's dtype.
"""

from __future__ import annotations

import dataclasses

import torch

from . import dispatch, plan
from ._checks import (
    check_choice,
    check_coefficient,
    check_dtype,
    check_finite,
    check_matrix,
    check_power,
    check_steps,
    overlaps_itself,
)
from .coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients
from .deprecations import renamed_argument
from .linalg import compute_dtype
from .matrix_views import matrices_of, resolve_matrix_view
from .precision import outside_autocast

dispatch.composes_small_chains_by(plan.composed_chain)  # dispatch times the plan's composition, never imports it

SIGN_METHODS = ("newton_schulz", "polar_express")
# Newton-Schulz's quintic converges only linearly near 1 (p'(1) = -3/5): 30 steps take a mode at
# 1e-3 of ||A||_F to within ~1e-5 of its sign. Polar Express needs 8 for the same range.
DEFAULT_SIGN_STEPS = {"newton_schulz": 30, "polar_express": 8}
BAND_MODES = plan.BAND_MODES


def _validated(W, name: str = "W", capturable: bool = False, matrix_view=None) -> torch.Tensor:
    """``W``'s matrices, as its ``matrix_view`` reads them (:func:`~spectral_ops.matrix_views.resolve_matrix_view`:
    a tensor of three or more dimensions needs it said). ``capturable``: no host synchronisation, so the
    finiteness check is skipped (every op takes ``capturable=``; a NaN/Inf input then gives a non-finite
    result instead of an error)."""
    check_matrix(W, name)
    view = resolve_matrix_view(W.shape, matrix_view, name)
    if W.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: it has no values to compute with")
    if not capturable:
        check_finite([W], name)
    return matrices_of(W, view)


def _shaped_as(result: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """A result computed on ``W``'s matrices, in ``W``'s shape (a flattened filter's shape again)."""
    return result if result.shape == W.shape else result.reshape(W.shape)


def check_method(method: str, capturable: bool = False, iteration: str = "auto") -> str:
    """How an op computes (:data:`spectral_ops.plan.METHODS`): ``"gram"`` iterates with matrix products
    (SPEC 1.2-1.4); ``"svd"`` and ``"eigh"`` factorise: a thin SVD, or an eigendecomposition of the small
    Gram, which sees ``s^2`` (accurate for powers ``p >= 1``, not for ``p = 0``, nor for a band's
    threshold far below ``s_max``); ``"auto"`` takes the fastest accurate one
    (:func:`spectral_ops.plan.route`: the Gram route on GPUs; on CPUs a factorisation where it is
    faster, the SVD for every band form). An explicit factorisation refuses ``capturable=True``; "auto"
    factorises under it on a CPU only, which has no graph to capture."""
    check_choice(method, "method", plan.METHODS)
    if iteration == "gram_space" and method in plan.FACTORISATIONS:
        raise ValueError(f"iteration={iteration!r} is an iteration of method='gram', not of {method!r}")
    if capturable and method in plan.FACTORISATIONS:
        raise ValueError(f"method={method!r} synchronises with the host (LAPACK/cuSOLVER report to it); "
                         "capturable=True needs method='gram' or 'auto'")
    return method


def check_precision(precision):
    """``precision`` is the dtype of the iteration's operands: ``"fp64"``; ``"fp32"`` (IEEE on CPU,
    3xTF32 on the GPU kernels: about fp32 accuracy); ``"tf32"``; ``"bf16"`` or ``"fp16"`` (operands in that
    dtype, fp32 accumulation, as torch.optim.Muon); or None: follow the weight's dtype, and for float32
    weights ``torch.get_float32_matmul_precision()``. The normalisation, scales and the decay
    arithmetic stay in fp32 (fp64 for fp64), and the result is rounded to the weight's dtype once."""
    if precision is not None:
        check_choice(precision, "precision", plan.PRECISIONS)
    return precision


def sign_coefficients(steps=None, method: str = "newton_schulz") -> tuple:
    """The per-step quintics of the matrix-sign iteration for ``method`` (SPEC 1.4)."""
    check_choice(method, "method", SIGN_METHODS)
    steps = check_steps(steps) or DEFAULT_SIGN_STEPS[method]
    if method == "polar_express":
        return polar_express_coefficients(steps)
    return (NEWTON_SCHULZ_SIGN,) * steps


def threshold_sign_coefficients(steps=None, method: str = "polar_express"):
    """A band op's sign iteration: None (designed for the threshold by the plan,
    :func:`spectral_ops.plan.threshold_design`) for Polar Express at no given count; else the user's
    count (or Newton-Schulz), which runs as given."""
    check_choice(method, "sign_method", SIGN_METHODS)
    if check_steps(steps) is None and method == "polar_express":
        return None
    return sign_coefficients(steps, method)


def _check_iterate_options(M, precision, dtype, overwrite_input) -> bool:
    """The options of an op that returns Polar Express's iterate (:func:`polar`, :func:`power_update`) on the
    matrices ``M``; returns whether the plan may overwrite them: not where their elements share memory (an
    expanded view, overlapping strides), whose normalisation in place would write a location once per
    element (0.78 off). They are normalised in a copy then, as without the option, which changes no result."""
    check_precision(precision)
    check_dtype(dtype)
    if not isinstance(overwrite_input, bool):
        raise TypeError(f"overwrite_input must be True or False, got {overwrite_input!r}")
    return overwrite_input and not overlaps_itself(M)


@outside_autocast
@torch.no_grad()
def polar(W: torch.Tensor, steps: int | None = None, coefficients=None, *, precision: str | None = None,
          capturable: bool = False, dtype: torch.dtype | None = None, overwrite_input: bool = False,
          matrix_view: str | None = None) -> torch.Tensor:
    """Polar Express approximation of ``U V^T`` (SPEC 1.3).

    ``W`` is Frobenius-normalised (with margin 1.01) and iterated in its wide orientation.
    ``steps`` defaults to 8. ``coefficients`` replaces Polar Express: one ``(a, b, c)`` triple
    repeated ``steps`` times (e.g. ``coefficients.MUON_QUINTIC``) or a list of triples.
    Singular values below ``1e-3 * ||W||_F`` are only partly lifted towards 1 (the design bound).
    ``precision`` (every op takes it): the operands of the iteration, see :func:`check_precision`.
    ``capturable=True`` (every op takes it): no host synchronisation, and so no check that ``W`` is finite.
    ``dtype``: the result's dtype, ``W``'s by default. The operand dtype of ``precision``
    (``torch.bfloat16`` for ``"bf16"``) returns the last iterate as it is, as torch.optim.Muon uses it:
    no rounding and no full-size copy in ``W``'s dtype. ``overwrite_input=True`` (as SciPy's
    ``overwrite_a``): ``W`` is a temporary of the caller's, which the normalisation may overwrite (its
    values are then unspecified) instead of allocating a full-size copy (one whose elements share memory
    is copied all the same); it changes no result.
    ``matrix_view`` (every op takes it but :func:`msign`): the matrices of a tensor of three or more
    dimensions, ``"batch"`` (a 3-D stack of matrices' unsaid) or ``"flatten"`` (a Conv1d filter
    ``(out, in, k)`` needs it said); a 3-D stack of vectors ``(out, in, 1)`` and four or more dimensions
    must say it (:mod:`spectral_ops.matrix_views`).
    """
    M = _validated(W, capturable=capturable, matrix_view=matrix_view)
    polar_c = plan.polar_coefficients(check_steps(steps), coefficients)
    overwrite_input = _check_iterate_options(M, precision, dtype, overwrite_input)
    if W.numel() == 0:
        return W.to(dtype or W.dtype, copy=True)
    return _shaped_as(plan.polar(dispatch.kernels_for("polar", M), M, polar_c, precision, dtype=dtype,
                                 overwrite_input=overwrite_input), W)


@outside_autocast
@torch.no_grad()
def msign(A: torch.Tensor, steps: int | None = None, method: str = "newton_schulz", *,
          precision: str | None = None, capturable: bool = False) -> torch.Tensor:
    """Matrix sign ``Z diag(sign(xi)) Z^T`` of a symmetric ``A`` without an eigendecomposition.

    ``method="newton_schulz"`` iterates ``Z (3I - 16/5 Z^2 + 6/5 Z^4)`` (default 30 steps);
    ``"polar_express"`` uses the Polar Express quintics (default 8). Eigenvalues closer to zero
    than ``~1e-3 ||A||_F`` are not fully resolved with the default steps. ``capturable=True`` also
    skips the symmetry check. ``A`` of three or more dimensions is a stack of symmetric ``(r, r)``
    matrices: flattened, none would be square, so msign takes no ``matrix_view``.
    """
    _validated(A, "A", capturable, matrix_view="batch")
    if A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A must be square (..., r, r), got shape {tuple(A.shape)}")
    coefficients = sign_coefficients(steps, method)
    check_precision(precision)
    if A.numel() == 0:
        return A.clone()
    if not capturable:
        _check_symmetric(A)
    return plan.msign(dispatch.kernels_for("msign", A), A, coefficients, precision)


def _check_symmetric(A: torch.Tensor) -> None:
    work = A.to(compute_dtype(A.dtype))
    asymmetry = (work - work.mT).abs().amax()
    allowed = 64 * torch.finfo(A.dtype).eps * work.abs().amax()
    if asymmetry > allowed:
        raise ValueError(
            f"A must be symmetric: max |A - A^T| = {float(asymmetry):.3g} exceeds {float(allowed):.3g}"
        )


@outside_autocast
@torch.no_grad()
def spectral_power(W: torch.Tensor, p, method: str = "auto", *, steps: int | None = None,
                   coefficients=None, precision: str | None = None, capturable: bool = False,
                   iteration: str = "auto", eps: float | None = None, matrix_view: str | None = None) -> torch.Tensor:
    """``S_p(W) = U diag(s^p) V^T`` for a real ``p >= 0`` (SPEC 1.1-1.2), or, with the floor ``eps``
    (relative to ``s_max``; required for ``p < 0``), ``U diag((s^2 + (eps s_max)^2)^(p/2)) V^T``.

    ``method="gram"``: the SVD-free route (odd ``p``: ``W G^k``; even: ``Q G^k``; ``G`` the
    smaller Gram, powers by repeated squaring, ``G`` shared with the first Polar Express step; a
    real ``p``: a polynomial in an inverse root of ``|W|``, docs/real-powers.md).
    ``"svd"``: a thin SVD in the compute dtype. ``"eigh"``: an eigendecomposition of the Gram
    (accurate for ``p >= 1``; for ``p = 0`` it loses the modes below ``sqrt(eps) s_max``).
    ``"auto"``: the fastest accurate one for the device, dtype and shape (:func:`check_method`).
    ``steps``/``coefficients`` configure the polar factor as in :func:`polar` (a real power's
    default is Polar Express designed down to 1e-4, 9 steps). ``capturable=True`` needs ``"gram"``
    (``"auto"`` means it then): the factorisations report errors to the host. There ``p`` may be a 0-d
    tensor (a schedule's, on the device), floored by ``eps`` and at most 1 in magnitude (NaN beyond).

    ``iteration`` (``"gram"`` only; ``"gram_space"`` makes ``method="auto"`` mean ``"gram"``): how an
    even ``p`` iterates, see :func:`check_iteration`. ``matrix_view``: as in :func:`polar`.
    """
    M = _validated(W, capturable=capturable, matrix_view=matrix_view)
    p = check_power(p, eps=eps, capturable=capturable)
    check_method(method, capturable, check_iteration(iteration))
    polar_c = plan.polar_coefficients(check_steps(steps), coefficients, (p,), floored=eps is not None)
    check_precision(precision)
    if W.numel() == 0:
        return W.clone()
    return _shaped_as(plan.spectral_power(dispatch.kernels_for("spectral_power", M), M, p, polar_c, precision,
                                          sync=not capturable, iteration=iteration, method=method, eps=eps), W)


@outside_autocast
@torch.no_grad()
def power_update(X: torch.Tensor, q=0, *, eps: float = plan.UPDATE_FLOOR, steps: int | None = None, coefficients=None,
                 precision: str | None = None, capturable: bool = False, dtype: torch.dtype | None = None,
                 overwrite_input: bool = False, scale: str = "polar", matrix_view: str | None = None) -> torch.Tensor:
    """A Muon-family update with update power ``q``: ``U diag((s^2 + (eps s_max)^2)^(q/2)) V^T`` of the
    momentum ``X = U diag(s) V^T``, renormalised to the polar factor's Frobenius norm
    ``sqrt(min(m, n))`` per matrix, so that a learning rate means what it means for Muon (a zero ``X``
    gives 0); ``q = 0`` (a number) is the polar factor :func:`polar` gives, as Muon iterates it, bit for
    bit. DynMuon's schedule (+0.25 to -0.25) and the Schatten-p steepest descents take fractional and
    negative ``q``. ``scale="raw"`` leaves the power as it is, DynMuon's update (its norm follows
    ``||X||^q``): ``power_update(X, q, eps=1e-6, scale="raw", precision="fp32")`` is DynMuon's form
    (docs/real-powers.md, "Porting from DynMuon").

    On the Gram route (docs/real-powers.md): Polar Express (``steps``/``coefficients`` as in
    :func:`polar`), then a polynomial in an inverse root of ``|X|``. A ``q != 0`` lifts the small modes to
    the floor's weight: with nothing given (``steps``, ``coefficients``, ``precision``) it computes in fp32
    (bf16/fp16 momenta too), its polar factor resolved down to the zero cutoff and kept off the zero modes
    (a rank-1 bf16 momentum's update erred 1.4 in bf16 operands), 2.3x to 4.6x the FLOPs of the polar
    factor. With Muon's 8 steps given, about 1.4x; in bf16 (``python -m spectral_ops.experiments real-powers``):
    1e-2 from the FP64 SVD on Gaussian momenta; on low-rank momenta over noise 1.4e-2 where the noise
    reaches 1e-1 of ``s_max``, 5e-2 at 1e-2, 0.35 at 1e-3, where the noise modes are below Polar
    Express's design bound (Muon's own polar factor errs as much there: fp32 takes the error to 1e-2).
    ``eps`` (relative to ``s_max``): the floor, at least the iterate's resolution (``plan.RESOLUTION``:
    2^-6 in bf16). ``capturable=True``: ``q`` may be a 0-d tensor on the device, with ``|q| <= 1`` (NaN
    beyond). ``dtype``, ``overwrite_input``: as in :func:`polar`. :class:`~spectral_ops.optim.SpectralMuon`
    takes it as ``update_power`` (and ``scale`` as ``update_scale``). ``matrix_view``: as in :func:`polar`
    (a conv filter's momentum is one matrix: ``"flatten"``, as Muon reads it).
    """
    M = _validated(X, "X", capturable=capturable, matrix_view=matrix_view)
    q = check_power(q, "q", eps=eps, capturable=capturable)
    polar_c = plan.update_coefficients(check_steps(steps), coefficients, q)
    overwrite_input = _check_iterate_options(M, precision, dtype, overwrite_input)
    check_choice(scale, "scale", plan.UPDATE_SCALES)
    if X.numel() == 0:
        return X.to(dtype or X.dtype, copy=True)
    return _shaped_as(plan.power_update(dispatch.kernels_for("power_update", M), M, q, polar_c, precision, eps,
                                        dtype, overwrite_input, scale), X)


def check_iteration(iteration) -> str:
    """How an even power's polar factor is iterated: ``"rectangle"`` (Polar Express on the ``r x N``
    matrix, then ``G^k Q``), ``"gram_space"`` (the same steps on ``r x r`` Grams, restarted from the
    rectangle every 3 steps, then ``(G^k Z) W``: fewer FLOPs for a tall or wide matrix, as accurate as
    the rectangle in fp32/fp64, a few times less in bf16/fp16) or ``"auto"`` (the default: Gram space
    at fp32/fp64 where it saves a quarter of the FLOPs, an aspect ratio of about 3.5 or more). Odd
    powers need no iteration, so the choice does not change them. :func:`polar` always runs on the
    rectangle. ``python -m spectral_ops.experiments schedules`` measures both."""
    check_choice(iteration, "iteration", plan.ITERATIONS)
    return iteration


def _check_tau(tau, name: str = "tau", sync: bool = True):
    return check_coefficient(tau, name, positive=True, sync=sync)


@outside_autocast
@torch.no_grad()
def band_projectors(W: torch.Tensor, tau, sign_steps: int | None = None, sign_method: str | None = None, *,
                    precision: str | None = None, capturable: bool = False, method: str = "auto", steps=None,
                    matrix_view: str | None = None):
    """``(P_top, P_bot)``: projectors onto the singular directions with ``s > tau`` / ``s < tau``.

    They live on the small side: ``n x n`` right projectors (``W @ P``) for ``m >= n``, ``m x m``
    left projectors (``P @ W``) for ``m < n``. ``method="gram"`` builds them from ``msign(G - tau^2 I)``,
    or below Polar Express's design bound ``msign(|W| - tau I)``, with the sign steps designed for
    ``tau`` (every mode at least 1% from it resolved, down to ``s_max / 1000`` and beyond:
    docs/real-powers.md, "Thresholds at any depth"); ``sign_steps`` sign iterations of ``sign_method``
    (``"polar_express"`` or ``"newton_schulz"``) instead run on ``G`` as given, whose accuracy then
    depends on the gap of ``s^2`` around ``tau^2``; ``"eigh"``/``"svd"`` from the singular vectors
    themselves; ``"auto"`` as :func:`check_method` says. ``steps`` is ``sign_steps``' deprecated name,
    and a sign method given as ``method`` (its old name here) is taken as ``sign_method`` of the Gram
    route, with a warning. ``matrix_view``: as in :func:`polar` (the projectors are those of each matrix
    it reads: one pair for a flattened filter).
    """
    sign_steps = renamed_argument("band_projectors", "sign_steps", sign_steps, "steps", steps)
    if method in SIGN_METHODS:
        sign_method = renamed_argument("band_projectors", "sign_method", sign_method, "method", method)
        method = "gram"  # the sign iteration it named, as before the rename
    sign_method = sign_method or "polar_express"
    check_method(method, capturable)
    M = _validated(W, capturable=capturable, matrix_view=matrix_view)
    _check_tau(tau, sync=not capturable)
    coefficients = threshold_sign_coefficients(sign_steps, sign_method)
    check_precision(precision)
    if M.numel() == 0:
        r = min(M.shape[-2:])
        empty = M.new_zeros(*M.shape[:-2], r, r)
        return empty, empty.clone()
    return plan.band_projectors(dispatch.kernels_for("band_projectors", M), M, tau, coefficients, precision,
                                method=method, sync=not capturable)


def check_band(band: plan.Band, p: int, sync: bool = True,
               bottom_name: str = "band.spectral_weight_decay_bot") -> plan.Band:
    """Validate a band rule for the power ``p`` (shared by :func:`band_direction` and
    :func:`spectral_decay_`); ``sync`` as in :func:`~spectral_ops._checks.check_coefficient`;
    ``bottom_name``: what the caller calls the bottom band's coefficient."""
    _check_tau(band.tau, sync=sync)
    check_choice(band.mode, "mode", BAND_MODES)
    if band.mode == "clip" and p != 1:
        raise ValueError(f"mode='clip' pulls each singular value above tau towards it by its excess (s - tau), "
                         f"whatever the power: pass p=1, not p={p}")
    check_coefficient(band.spectral_weight_decay_bot, bottom_name, sync=sync)
    # An integral float p_bot is the integer, as p is (the plan takes a float for a real power).
    return dataclasses.replace(band, p_bot=check_power(band.p_bot, "p_bot", decay=True))


def _thresholded_coefficients(steps, sign_steps, sign_method: str, precision, powers=()) -> tuple:
    """A thresholded op's polar and sign coefficients (None: designed for its thresholds), with its
    ``precision`` checked."""
    check_precision(precision)
    polar_c = plan.polar_coefficients(check_steps(steps), None, powers, thresholded=True)
    return polar_c, threshold_sign_coefficients(sign_steps, sign_method)


@outside_autocast
@torch.no_grad()
def band_direction(W: torch.Tensor, tau, p: int, mode: str = "top", *, p_bot: int = 1,
                   lambda_top=1.0, lambda_bot=1.0, steps: int | None = None,
                   sign_steps: int | None = None, sign_method: str = "polar_express",
                   precision: str | None = None, capturable: bool = False, method: str = "auto",
                   matrix_view: str | None = None) -> torch.Tensor:
    """A band-selective decay direction (SPEC 1.4), with ``P_top``/``P_bot`` split at ``tau``;
    ``method`` as in :func:`check_method`, ``matrix_view`` as in :func:`polar`.

    ========== ================================================
    ``top``      ``S_p(W) P_top + W P_bot``
    ``bot``      ``W P_top + S_p(W) P_bot``
    ``top_only`` ``S_p(W) P_top``
    ``bot_only`` ``S_p(W) P_bot``
    ``two_band`` ``lambda_top S_p(W) P_top + lambda_bot S_{p_bot}(W) P_bot``
    ``clip``     ``(W - tau Q) P_top = U (s - tau)_+ V^T`` (``p = 1``: the soft-threshold)
    ========== ================================================

    ``p = 0`` below ``tau`` (``bot``, ``bot_only``, ``two_band`` with ``p_bot=0``) takes every non-zero mode
    there to 1, however small: on the Gram route its polar factor is resolved down to the zero cutoff and
    kept off the zero modes, as :func:`spectral_clip`'s ``min=`` is.
    """
    M = _validated(W, capturable=capturable, matrix_view=matrix_view)
    p = check_power(p, decay=True)
    check_coefficient(lambda_top, "lambda_top", sync=not capturable)
    band = check_band(plan.Band(tau, mode, p_bot=p_bot, spectral_weight_decay_bot=lambda_bot), p, sync=not capturable,
                      bottom_name="lambda_bot")
    polar_c, sign_c = _thresholded_coefficients(steps, sign_steps, sign_method, precision, (p, band.p_bot))
    if W.numel() == 0:
        return W.clone()
    return _shaped_as(plan.band_direction(dispatch.kernels_for("band_direction", M), M, p, band, polar_c, sign_c,
                                          precision, sync=not capturable, top=lambda_top,
                                          method=check_method(method, capturable)), W)


@outside_autocast
@torch.no_grad()
def svt(W: torch.Tensor, t, *, steps: int | None = None, sign_steps: int | None = None,
        sign_method: str = "polar_express", precision: str | None = None,
        capturable: bool = False, method: str = "auto", matrix_view: str | None = None) -> torch.Tensor:
    """Singular-value soft-thresholding ``U (S - t)_+ V^T = (W - t Q) P_top(t)``.

    ``method="gram"`` (no SVD): exact in exact arithmetic; the sign and polar steps are designed for
    ``t`` (unless ``sign_steps``/``steps`` are given), so that every mode at least 1% from ``t`` is
    resolved (as for :func:`band_projectors`): a mode the sign steps do not resolve comes out as
    ``pi (s - t)`` with ``pi`` in [0, 1], an error of at most ``|s - t|``. ``"svd"``/``"eigh"``: mode by
    mode; ``"auto"``: see :func:`check_method`. ``matrix_view``: as in :func:`polar`.
    """
    M = _validated(W, capturable=capturable, matrix_view=matrix_view)
    check_coefficient(t, "t", positive=True, sync=not capturable)
    polar_c, sign_c = _thresholded_coefficients(steps, sign_steps, sign_method, precision)
    if W.numel() == 0:
        return W.clone()
    return _shaped_as(plan.svt(dispatch.kernels_for("svt", M), M, t, polar_c, sign_c, precision, sync=not capturable,
                               method=check_method(method, capturable)), W)


@outside_autocast
@torch.no_grad()
def spectral_clip(W: torch.Tensor, min=None, max=None, *, steps: int | None = None, sign_steps: int | None = None,
                  sign_method: str = "polar_express", precision: str | None = None, capturable: bool = False,
                  method: str = "auto", matrix_view: str | None = None) -> torch.Tensor:
    """``U diag(clamp(s, min, max)) V^T``: the singular values clamped, as ``torch.clamp`` clamps
    entries. ``max=`` alone is the spectral hard cap (``s -> min(s, max)``); ``min=`` lifts the small
    modes, every one however small; the zero modes (``s <= max(m, n) eps s_max``, ``eps`` of the dtype the
    modes are computed in: :func:`spectral_ops.linalg.zero_mode_cutoff`) have no singular vectors and stay
    0. Each bound is a number or a 0-d tensor, positive, ``min <= max``.

    ``method`` as in :func:`check_method`. ``"gram"`` (a GPU's) is ``W - P_top(max) (W - max Q) + P_bot(min)
    (min Q - W)``, with ``Q`` resolved on every non-zero mode (to within a factor 2 of the zero cutoff) and the
    projectors designed for each bound: at any bound from ``s_max`` down to ``s_max / 1000`` and below, every
    mode at least 1% from a bound comes out as accurate as an fp32 SVD makes it (the lift of a mode ``s``
    to ``min`` multiplies ``W``'s rounding by ``min / s``, on both routes), except that the hard cap's top
    modes are the difference of two ``s_max``-sized ones: it errs by fp32's rounding of ``s_max``
    (3.4e-4 of a cap at ``s_max / 1000`` on docs/api.md's matrix, the SVD 7.5e-6). A mode within 1% of a
    bound is partly projected: off by at most its distance to the bound. ``"auto"`` takes the SVD on a
    CPU, the Gram route on a GPU. The table per route, dtype and depth: docs/api.md, "Thresholded ops".

    ``precision=None`` computes in fp32 (fp64 for float64 weights), also for bf16/fp16 weights and under
    ``torch.set_float32_matmul_precision("high")``: the result is then the bf16 rounding of an fp32 clip
    (about 2^-9, where bf16 operands erred 0.27 at ``max = s_max / 100``), at about twice bf16's time on a
    GPU. An explicit ``precision="bf16"`` (or ``"fp16"``, ``"tf32"``) takes those operands and their
    accuracy: the cap 1.6e-2 at ``s_max / 5`` to 2.9 at ``s_max / 1000``, ``min=`` 0.12 at ``s_max / 5`` (its
    polar factor stops at the default design, 1e-3 of ``||W||_F``). ``matrix_view``: as in :func:`polar`."""
    M = _validated(W, capturable=capturable, matrix_view=matrix_view)
    if min is None and max is None:
        raise ValueError("spectral_clip needs min= or max= (or both): without them it would return W itself")
    for bound, name in ((min, "min"), (max, "max")):
        if bound is not None:
            check_coefficient(bound, name, positive=True, sync=not capturable)
    if min is not None and max is not None and not capturable and float(min) > float(max):
        raise ValueError(f"spectral_clip needs min <= max, got min={float(min)} > max={float(max)}")
    polar_c, sign_c = _thresholded_coefficients(steps, sign_steps, sign_method, precision)
    if W.numel() == 0:
        return W.clone()
    return _shaped_as(plan.spectral_clip(dispatch.kernels_for("spectral_clip", M), M, min, max, polar_c, sign_c,
                                         precision, sync=not capturable, method=check_method(method, capturable)), W)


@outside_autocast
@torch.no_grad()
def spectral_norm_bounds(W: torch.Tensor, squarings: int = 3, *, capturable: bool = False,
                         matrix_view: str | None = None):
    """Per-matrix ``(lower, upper)`` bounds on the largest singular value, without an SVD.

    From ``||G^(2^j)||_F`` after ``squarings`` squarings of the Gram (products in fp32, fp64 for fp64
    weights; see :meth:`spectral_ops.plan.GramPlan.log_spectral_norm_bounds`); ``upper / lower`` is at
    most ``r^(1 / 2^(squarings + 2))`` (1.3 for ``r = 4096`` with the default 3), and a little more
    for the rounding. In the compute dtype: beyond its range the upper bound is inf and the lower one
    its largest number, still bounds. ``matrix_view``: as in :func:`polar` (the bounds have the shape of
    the stack it reads: ``()`` for a flattened filter).
    """
    M = _validated(W, capturable=capturable, matrix_view=matrix_view)
    if isinstance(squarings, bool) or not isinstance(squarings, int) or squarings < 0:
        raise ValueError(f"squarings must be an integer >= 0, got {squarings!r}")
    if M.numel() == 0:
        zeros = M.new_zeros(M.shape[:-2], dtype=compute_dtype(M.dtype))
        return zeros, zeros.clone()
    return plan.spectral_norm_bounds(dispatch.kernels_for("spectral_norm_bounds", M), M, squarings)
