"""Route: every choice of algorithm (:func:`route`), and the ops that follow it.

Each op takes ``kernels``, the object dispatch hands out for one op call
(:func:`spectral_ops.dispatch.kernels_for`): one method per primitive of
:mod:`spectral_ops.backends.base`, each call routed to a backend. The plan never chooses a backend and
never imports dispatch; it only asks whether a fused small chain is available (``kernels.small_chain``
returns None when none is). What it computes is chosen here, in one place and once per op call:
:func:`route` (the method, an even power's iteration, chain or composed), weighing the FLOPs read off this
very plan on meta tensors as the cost model counts them (:func:`~spectral_ops.backends.counting.counted`;
the cost model itself, :mod:`.costs`, comes after the decay, which it counts too); the op passes its
:class:`Route` down to the plan (:func:`plan_for`, :meth:`~.gram.GramPlan.scaled_direction`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .._compile import constant_when_traced
from ..backends.counting import Work, counted, placeholder_coefficients
from ..coefficients import resolve_polar_coefficients
from ..linalg import compute_dtype
from ..precision import OPERAND_DTYPES, clip_precision, resolve_precision
from .factorised import FactorisedPlan
from .gram import GramPlan, checked_finite
from .iterations import GRAM_SPACE_PRECISIONS, GRAM_SPACE_SAVING, TENSOR_POWER_BOUND, floor_lifts, matrix_sign
from .thresholds import GRAM_RESOLVES, Band, Scale

OPS = ("polar", "msign", "spectral_power", "power_update", "band_projectors", "band_direction", "svt",
       "spectral_clip", "spectral_norm_bounds", "decay_")

# The CPU's fastest accurate method for S_p, from the crossovers measured with
# bench/test_bench_ops.py::test_method_selection (docs/backends.md, "Choosing a method on a CPU"):
# for p = 2 the Gram's eigendecomposition won at every measured shape. For p = 0 (where eigh is
# inaccurate) Polar Express beat LAPACK's SVD by up to 1.55x at some sides, but only on spectra inside
# its design bound (1e-3 of ||W||_F): at kappa 1e3 it erred 1.3e-3 (128 x 128) to 3e-2 (512 x 512)
# against the SVD's 1e-5 in fp32, so the SVD is taken at every side.
# The routes that factorise (spectral_ops.linalg.SpectralFactors) instead of iterating.
FACTORISATIONS = ("svd", "eigh")
METHODS = ("auto", "gram") + FACTORISATIONS
# eigh's matrix products, in units of 2 r^2 N (one r x N by r x r product): the Gram, V^T = diag(1/s) U^T Xn
# and U diag(w) V^T (linalg.SpectralFactors), besides the decomposition itself.
EIGH_PRODUCTS = 3


@dataclass(frozen=True)
class Route:
    """How one op runs: ``method`` (``"gram"``: this plan; ``"svd"``/``"eigh"``: a factorisation,
    :mod:`spectral_ops.linalg`), ``iteration`` (an even power's, :data:`ITERATIONS` but ``"auto"``)
    and ``chain`` (whether a backend's fused chain may run the whole direction; dispatch says whether
    one is there)."""

    method: str
    iteration: str
    chain: bool


def route(shape, dtype: torch.dtype, device_type: str, p: int, precision: str, *, method: str = "auto",
          iteration: str = "auto", steps: int = 8, band: bool = False, provider: str = "torch",
          floored: bool = False) -> Route:
    """Every choice of algorithm, from the shape, dtype, device, power and precision (dispatch
    chooses providers, this chooses what they compute).

    * ``method="auto"``: the Gram route on a GPU (the factorisations report to the host, which a
      capturable step may not read: on a CPU, which has no graphs to capture, a capturable or
      compiled step factorises as an eager one does, without a graph break), for
      ``iteration="gram_space"``, and where the products would run on a ``provider`` other than
      torch's (a forced backend: the measurements weighed LAPACK against torch's composed products,
      and forcing a backend asks for its kernels). On a CPU the faster accurate one of the
      measurements (docs/backends.md): for ``S_p``, the Gram route for an odd ``p`` (``X G^k``, products
      alone) wherever its FLOPs (:func:`cost`) are no more than eigh's products (:data:`EIGH_PRODUCTS`, the
      decomposition aside: ``p = 1, 3, 5`` on a square matrix, up to ``p = 15`` at 4:1), ``eigh`` for
      the other ``p > 1``, and the SVD for ``p = 0`` (Polar Express, up to 1.55x faster at some sides, resolves
      only the modes above its design bound), for a real ``p < 1`` and for a ``floored`` power (with
      ``eps``: its small modes' weights do not vanish with ``s``, which ``eigh`` would amplify). A ``band`` form
      (the band ops, soft-thresholding, a band or prox decay) splits the modes at a threshold: the SVD,
      which resolves one anywhere above its rounding (``eps s_max``), where the Gram route's sign
      iteration and ``eigh`` both see ``s^2`` (a threshold ``tau`` loses modes once ``tau^2 / s_max^2``
      nears their resolution: the design bound 1e-3, or eigh's rounding over the gap). It was also
      1.1-2.2x faster than the Gram route for ``band_direction`` and ``svt`` at every measured shape,
      and up to 2.2x slower for ``band_projectors`` (no polar factor on the Gram route): accuracy first.
    * A ``floored`` power, a negative one or a power in a tensor is a real power (the Gram route's
      :meth:`~.gram.GramPlan.scaled_real_power`): its iteration is its polar factor's, never ``G^k``'s.
    * ``iteration="auto"``: Gram space for an even ``p`` at a precision where it is as accurate as the
      rectangle (:data:`GRAM_SPACE_PRECISIONS`) and where :func:`cost` says it saves at least
      :data:`GRAM_SPACE_SAVING` of the op's FLOPs (an aspect ratio of about 3.5 or more; on a square
      matrix it costs more); the rectangle otherwise.
    * ``chain``: a fused chain runs the rectangle's steps in one kernel per matrix, where launches,
      not FLOPs, bound the time, so it is taken first under ``"auto"`` and ``"rectangle"``; not where
      ``Gn^k`` could leave fp32's normal range (:data:`CHAIN_POWER_RANGE_BITS`: the chain does not
      renormalise it).
    """
    *_, m, n = shape
    r, side = min(m, n), max(m, n)
    # The integer route (G^k by repeated squaring) takes a number p >= 0 without a floor; every other
    # power, a negative one included, is a real one.
    integer = isinstance(p, int) and p >= 0 and not floored
    if method == "auto":
        if iteration == "gram_space" or device_type != "cpu" or provider != "torch":
            method = "gram"
        elif band or floored or torch.is_tensor(p):  # a power on the device is floored, of either sign
            method = "svd"
        elif integer and p % 2 and (_power_flops((r, side), p, "rectangle", 8, False)
                                    <= EIGH_PRODUCTS * 2 * r * r * side):
            method = "gram"
        elif p > 1:
            method = "eigh"
        else:  # p = 0 and the real powers below 1: the SVD resolves every mode
            method = "svd"
    chain = iteration != "gram_space" and integer and p // 2 * math.log2(max(r, 2)) <= CHAIN_POWER_RANGE_BITS
    if iteration == "auto":
        iteration = "rectangle"
        # An even power and a real one (p = 0's polar factor is its base) iterate a polar factor.
        if (not integer or p % 2 == 0) and precision in GRAM_SPACE_PRECISIONS:
            # A real power's iteration is its polar factor's: the rest costs the same either way.
            p_iterated = p if integer else 0
            flops = {it: _power_flops((r, side), p_iterated, it, steps, True) for it in ("gram_space", "rectangle")}
            if flops["gram_space"] <= (1 - GRAM_SPACE_SAVING) * flops["rectangle"]:
                iteration = "gram_space"
    return Route(method, iteration, chain)


# Gn^k at unit norm stays above 2^-CHAIN_POWER_RANGE_BITS, well inside fp32's normal range (2^-126).
CHAIN_POWER_RANGE_BITS = 100


def routed(kernels, W: torch.Tensor, p, precision: str | None, method: str, polar_coefficients=None, *,
           iteration: str = "auto", band: bool = False, floored: bool = False) -> Route:
    """:func:`route` for one op call on ``W`` with ``kernels``, once: the op passes it down. The iteration
    is weighed at ``polar_coefficients``' steps (None: a band form's, designed later for its threshold,
    which runs on the rectangle whatever the route says; weighed at 8)."""
    precision = resolve_precision(precision, W.dtype)
    # Asked only where it can decide: it routes (and may self-check) a provider.
    asks = method == "auto" and W.device.type == "cpu"
    provider = kernels.provider_of("product", OPERAND_DTYPES[precision], W.shape, precision) if asks else "torch"
    steps = 8 if polar_coefficients is None else len(polar_coefficients)
    return route(W.shape, W.dtype, W.device.type, p, precision, method=method, iteration=iteration, steps=steps,
                 band=band, provider=provider, floored=floored)


def plan_for(W: torch.Tensor, kernels, precision: str | None, method: str, capturable: bool = False,
             threshold_ratio: float | None = None) -> GramPlan:
    """The plan of a routed ``method``: the iterations (``"gram"``) or a factorisation; ``capturable``
    and ``threshold_ratio`` as in :class:`GramPlan`."""
    if method in FACTORISATIONS:
        return FactorisedPlan(W, kernels, method, precision)
    return GramPlan(W, kernels, resolve_precision(precision, W.dtype), capturable=capturable,
                    threshold_ratio=threshold_ratio)


# ----- the ops: (validated) inputs in, a new tensor of the input's dtype out; precision None resolves here

def spectral_power(kernels, W: torch.Tensor, p, polar_coefficients, precision: str | None = None,
                   sync: bool = True, iteration: str = "auto", method: str = "gram", eps=None):
    """``sync``: check the result for overflow (OverflowError); the capturable path passes False and
    gets Inf where the result exceeds the dtype. ``iteration``: one of :data:`ITERATIONS`; ``method``:
    :func:`route`'s (``"auto"`` routes here). ``p``: an int or a real ``p > 0``, or any ``p`` with a floor
    ``eps`` (:meth:`GramPlan.scaled_real_power`; ``p = 0`` is the polar factor, floored or not)."""
    if eps is None and p == 1:
        return W.clone()  # S_1(W) = W, and the result must never alias the input
    precision, polar_coefficients = lifting(W, p, eps, precision, polar_coefficients,
                                            resolve_polar_coefficients(None, None, real_power=True))
    chosen = routed(kernels, W, p, precision, method, polar_coefficients, iteration=iteration, floored=eps is not None)
    if chosen.method == "gram" and not torch.is_tensor(p) and p == 0:
        return polar_factor(kernels, W, polar_coefficients, precision, chosen)
    plan = plan_for(W, kernels, precision, chosen.method)
    result = plan.result(*plan.scaled_direction(p, polar_coefficients, chosen, eps)).to(W.dtype)
    result = beyond_tensor_power_nan(result, p)
    return checked_finite(result, "spectral_power") if sync else result


def lifting(W: torch.Tensor, p, eps, precision: str | None, polar_coefficients, fallback) -> tuple:
    """``(precision, polar coefficients)`` of a power ``p`` with the floor ``eps`` (None: none): where the floor
    lifts (:func:`~.iterations.floor_lifts`), ``precision=None`` computes in fp32 (fp64 for float64 weights,
    :func:`~spectral_ops.precision.clip_precision`): bf16, fp16 and tf32 operands resolve neither the small
    modes the floor weighs most (for ``p < 0``) nor the zero ones it must leave at 0 (a rank-1 bf16 update at
    ``q = -1`` erred 1.4); coefficients left to the plan (None) stay None where the precision resolves the
    lift (:func:`~.thresholds.lift_design`), and are ``fallback`` where it does not."""
    if not floor_lifts(p, eps is not None):
        return precision, polar_coefficients
    precision = clip_precision(precision, W.dtype)
    if polar_coefficients is None and precision not in GRAM_RESOLVES:
        return precision, fallback
    return precision, polar_coefficients


def beyond_tensor_power_nan(result: torch.Tensor, p) -> torch.Tensor:
    """``result``, NaN where ``p`` is held in a tensor beyond :data:`TENSOR_POWER_BOUND` (its design)."""
    return torch.where(p.abs() <= TENSOR_POWER_BOUND, result, torch.nan) if torch.is_tensor(p) else result


def polar_factor(kernels, W: torch.Tensor, polar_coefficients, precision: str | None, chosen: Route,
                 dtype: torch.dtype | None = None, overwrite_input: bool = False):
    """``S_0(W)`` by the iteration ``chosen`` routes, in ``dtype`` (``W``'s by default); ``overwrite_input``:
    see :class:`~.gram.GramPlan`."""
    plan = GramPlan(W, kernels, resolve_precision(precision, W.dtype), overwrite_input=overwrite_input,
                    polar_only=True)
    direction, _ = plan.scaled_direction(0, polar_coefficients, chosen)
    return plan.oriented(direction).to(dtype or W.dtype)


def polar(kernels, W: torch.Tensor, polar_coefficients, precision: str | None = None,
          dtype: torch.dtype | None = None, overwrite_input: bool = False) -> torch.Tensor:
    """Always on the rectangle: this is Muon's orthogonalisation, which must be the iteration
    torch.optim.Muon runs (``spectral_power(W, 0)`` follows ``iteration`` instead)."""
    chosen = routed(kernels, W, 0, precision, "gram", polar_coefficients, iteration="rectangle")
    return polar_factor(kernels, W, polar_coefficients, precision, chosen, dtype, overwrite_input)


# A Muon-family update's default floor (relative to s_max): in bf16, below the iterate's resolution anyway
# (RESOLUTION); a negative power lifts the small modes, mostly the momentum's noise, to at most 100^|q|
# times the top's weight.
UPDATE_FLOOR = 1e-2
# How a Muon-family update is scaled: "polar", to the polar factor's Frobenius norm per matrix (a learning
# rate means what it means for Muon); "raw", not at all: U diag((s^2 + (eps s_max)^2)^(q/2)) V^T as it is,
# DynMuon's update (its norm follows ||X||^q).
UPDATE_SCALES = ("polar", "raw")


def power_update(kernels, X: torch.Tensor, power, polar_coefficients, precision: str | None, eps: float,
                 dtype: torch.dtype | None = None, overwrite_input: bool = False, scale: str = "polar") -> torch.Tensor:
    """A Muon-family update with update power ``power`` (capturable): for a number 0, ``X``'s polar
    factor on the rectangle, as torch.optim.Muon iterates it (a square ``X`` as laid out: :func:`polar`
    counts it as tall and would iterate on its transpose, a strided view whose result comes out
    strided); else ``U diag((s^2 + (eps s_max)^2)^(power/2)) V^T`` (:meth:`GramPlan.scaled_real_power`),
    scaled as ``scale`` says (:data:`UPDATE_SCALES`): by default renormalised to the polar factor's
    Frobenius norm ``sqrt(min(m, n))`` per matrix, so that a learning rate means what it means for Muon
    (0 for a zero ``X``); ``"raw"``: as it is (Inf where that overflows: nothing is read back).

    The renormalisation takes the direction at unit scale as it is: the scale ``c^power`` cancels in it,
    and applied first it can leave the range (``||.||_F`` of a power 1 of a 1e-30 ``X`` underflows fp32)."""
    if not torch.is_tensor(power) and power == 0:
        if X.shape[-2] != X.shape[-1]:
            return polar(kernels, X, polar_coefficients, precision, dtype, overwrite_input)
        return polar(kernels, X.mT, polar_coefficients, precision, dtype, overwrite_input).mT
    precision, polar_coefficients = lifting(X, power, eps, precision, polar_coefficients,
                                            resolve_polar_coefficients(None, None))
    chosen = routed(kernels, X, power, precision, "gram", polar_coefficients, floored=True)
    plan = GramPlan(X, kernels, resolve_precision(precision, X.dtype))
    D, log_factor = plan.scaled_direction(power, polar_coefficients, chosen, eps)
    if scale == "raw":
        result = plan.result(D, log_factor)
    else:
        norm = torch.linalg.vector_norm(D, dim=(-2, -1), keepdim=True, dtype=compute_dtype(D.dtype))
        # A zero X's direction is 0 (its norm too): 0, not 0/0. A non-finite one stays non-finite.
        factor = torch.where(norm == 0, 0.0, math.sqrt(min(X.shape[-2:])) / norm)
        result = plan.oriented(D.mul_(factor.to(D.dtype)))  # D is the plan's own: scaled in place
    return beyond_tensor_power_nan(result.to(dtype or X.dtype), power)


def msign(kernels, A: torch.Tensor, sign_coefficients, precision: str | None = None) -> torch.Tensor:
    precision = resolve_precision(precision, A.dtype)
    return matrix_sign(kernels, A.to(compute_dtype(A.dtype, precision)), sign_coefficients, precision).to(A.dtype)


# The band ops: None coefficients are designed for the threshold (threshold_design); ``sync=False`` (the
# capturable path) neither checks the result nor reads the threshold's ratio on the host;
# ``threshold_ratio``: a known tau / ||W||_F (the cost model's).

def band_projectors(kernels, W: torch.Tensor, tau, sign_coefficients, precision: str | None = None,
                    method: str = "gram", sync: bool = True, threshold_ratio: float | None = None):
    method = routed(kernels, W, 1, precision, method, band=True).method
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    P_top = plan.thresholds.top_projector(tau, None, sign_coefficients)
    return P_top.to(W.dtype), (plan.identity() - P_top).to(W.dtype)


def band_direction(kernels, W: torch.Tensor, p: int, band: Band, polar_coefficients, sign_coefficients,
                   precision: str | None = None, sync: bool = True, top: Scale = 1.0, method: str = "gram",
                   threshold_ratio: float | None = None):
    method = routed(kernels, W, p, precision, method, band=True).method
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    result = plan.oriented(plan.thresholds.band(p, band, polar_coefficients, sign_coefficients, top)).to(W.dtype)
    return checked_finite(result, "band_direction") if sync else result


def svt(kernels, W: torch.Tensor, t, polar_coefficients, sign_coefficients, precision: str | None = None,
        sync: bool = True, method: str = "gram", threshold_ratio: float | None = None):
    method = routed(kernels, W, 0, precision, method, band=True).method
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    result = plan.result(*plan.thresholds.svt(t, polar_coefficients, sign_coefficients)).to(W.dtype)
    return checked_finite(result, "svt") if sync else result


def spectral_clip(kernels, W: torch.Tensor, low, high, polar_coefficients, sign_coefficients,
                  precision: str | None = None, sync: bool = True, method: str = "gram",
                  threshold_ratio: float | None = None):
    """``U diag(clamp(s, low, high)) V^T`` (``low``/``high`` None: that side unbounded); precision None:
    :func:`clip_precision`."""
    precision = clip_precision(precision, W.dtype)
    method = routed(kernels, W, 0, precision, method, band=True).method
    plan = plan_for(W, kernels, precision, method, not sync, threshold_ratio)
    clipped = plan.thresholds.clip(low, high, polar_coefficients, sign_coefficients)
    result = plan.result(*clipped).to(W.dtype)
    return checked_finite(result, "spectral_clip") if sync else result


# qk_cap's s_max estimates (GramPlan.spectral_norm_estimate): Gn^(2^16) before the Rayleigh quotient's sweeps,
# within 4e-7 of s_max, far inside the cap's promise (fp32: every pair within 1e-4 of the cap). They decide
# which pairs are over the cap, and a GQA group's q threshold, cap / s_max(W_k^g), follows the key's estimate.
QK_CAP_SQUARINGS = 16


@dataclass(frozen=True)
class QKCapOutcome:
    """What :func:`qk_cap` computed, nothing written: ``bounds``, each q head's ``s_max(W_q^h) s_max(W_k^g)``
    before the cap (``(H,)``, float64); the q heads over the cap (``q_heads``, indices into the stack) and
    their clipped values (``q_values``, ``(n, d_h, D)`` in the weights' dtype, None where no head is over);
    the k heads clipped and their values (with shared keys none: ``k_heads`` empty, ``k_values`` None)."""

    bounds: torch.Tensor
    q_heads: torch.Tensor
    q_values: torch.Tensor | None
    k_heads: torch.Tensor
    k_values: torch.Tensor | None


def qk_cap(kernels, Q: torch.Tensor, K: torch.Tensor, cap: float, polar_coefficients, sign_coefficients,
           precision: str | None = None, method: str = "gram") -> QKCapOutcome:
    """The spectral QK cap (SPEC 11) of the query heads ``Q`` (``(H, d_h, D)``) and the key heads ``K``
    (``(KV, d_h, D)``, ``H`` a multiple of ``KV``; q head ``h`` reads k head ``h // (H / KV)``): afterwards every
    pair has ``s_max(W_q^h) s_max(W_k^g) <= cap``, each changed factor clipped, ``U min(s, t) V^T``
    (:meth:`~.thresholds.GramThresholds.clip` with ``hard_cap``, one stack per side, a threshold per head).

    ``a = s_max(W_q^h)``, ``b = s_max(W_k^g)`` (:data:`QK_CAP_SQUARINGS`; the factorisation's own on its route).
    With a key per query head (``KV = H``) an over-cap pair's factors are clipped at ``t_q = sqrt(cap a / b)`` and
    ``t_k = sqrt(cap b / a)``: both shrink by ``sqrt(cap / (a b))``, so ``t_q t_k = cap`` whatever the estimates,
    and the pair keeps its balance (QK-Clip's square-root split). A shared key (``KV < H``: GQA, MQA) is never
    touched: each over-cap q head is clipped at ``t_q = cap / b`` (Kimi K2's rule for MLA's shared rotary key),
    so a pair within the cap keeps its q and k heads as they are even where another of its group is over.

    Precision None: :func:`~spectral_ops.precision.clip_precision` (fp32 operands, fp64 for float64). Which
    pairs are over is read on the host, and only those heads are clipped (no head: no clip at all)."""
    precision = clip_precision(precision, Q.dtype)
    method = routed(kernels, Q, 0, precision, method, band=True).method
    log_q, log_k = (_log_spectral_norms(plan_for(W, kernels, precision, method)) for W in (Q, K))
    shared = Q.shape[0] > K.shape[0]
    log_k_of_q = log_k.repeat_interleave(Q.shape[0] // K.shape[0])
    log_bounds, log_cap = log_q + log_k_of_q, math.log(cap)
    q_heads = (log_bounds > log_cap).nonzero()[:, 0]  # one host read: only these heads change
    if shared:
        k_heads, log_q_threshold, log_k_threshold = q_heads[:0], log_cap - log_k_of_q[q_heads], None
    else:
        shrink = 0.5 * (log_cap - log_bounds[q_heads])  # ln sqrt(cap / (a b)): t_q t_k = cap exactly
        k_heads, log_q_threshold, log_k_threshold = q_heads, log_q[q_heads] + shrink, log_k[q_heads] + shrink
    return QKCapOutcome(
        log_bounds.exp(), q_heads, _capped(kernels, Q, q_heads, log_q_threshold, polar_coefficients,
                                            sign_coefficients, precision, method),
        k_heads, _capped(kernels, K, k_heads, log_k_threshold, polar_coefficients, sign_coefficients, precision,
                         method))


def _log_spectral_norms(plan: GramPlan) -> torch.Tensor:
    """``ln s_max`` of each matrix of the plan's stack (float64, ``-inf`` for a zero one)."""
    estimate = plan.spectral_norm_estimate(QK_CAP_SQUARINGS)
    return plan.log_scale[..., 0, 0] + estimate[..., 0, 0].double().log()


def _capped(kernels, W: torch.Tensor, heads: torch.Tensor, log_threshold, polar_coefficients, sign_coefficients,
            precision: str, method: str) -> torch.Tensor | None:
    """The matrices ``heads`` of the stack ``W`` clipped at ``exp(log_threshold)`` (one per matrix), in ``W``'s
    dtype; None for no head."""
    if not len(heads):
        return None
    plan = plan_for(W.index_select(0, heads), kernels, precision, method)
    threshold = log_threshold.exp()[:, None, None]
    clipped = plan.thresholds.clip(None, threshold, polar_coefficients, sign_coefficients, hard_cap=True)
    return checked_finite(plan.result(*clipped).to(W.dtype), "qk_cap_")


def composed_chain(kernels, X: torch.Tensor, p, coefficients, precision: str, sign: bool = False) -> torch.Tensor:
    """A small chain (:meth:`~spectral_ops.backends.base` ``small_chain``) as the plan composes it where
    no backend fuses one, on ``kernels`` without a chain: the ``sign`` iteration, or ``S_p``. Dispatch
    times it against the fused chains."""
    if sign:
        return matrix_sign(kernels, X, coefficients, precision)
    return spectral_power(kernels, X, p, coefficients, precision, sync=False, method="gram")


# Beyond this many squarings every level of the bound is s_max to float64's rounding (level j is within
# r^(1/2^(j+2)) and its rounding's widening, at most 1e10, within 1e10^(1/2^(j+1))): more would repeat it.
USEFUL_SQUARINGS = 64


def spectral_norm_bounds(kernels, W: torch.Tensor, squarings: int):
    """``(lower, upper)`` on ``s_max`` per matrix, in the compute dtype (products at its accuracy), from at
    most :data:`USEFUL_SQUARINGS` squarings."""
    dtype = compute_dtype(W.dtype)
    plan = GramPlan(W, kernels, "fp64" if dtype == torch.float64 else "fp32")
    log_lower, log_upper = plan.log_spectral_norm_bounds(min(squarings, USEFUL_SQUARINGS))
    return log_lower.exp().clamp(max=torch.finfo(dtype).max).to(dtype), log_upper.exp().to(dtype)


# ----- what route weighs, counted on meta tensors as the cost model (plan.costs) counts


@constant_when_traced  # counted on meta tensors, not traced (nor its cache, which Dynamo would skip)
def _power_flops(shape: tuple, p: int, iteration: str, steps: int | None, symmetric_at_half: bool) -> float:
    """What :func:`route` weighs: the FLOPs of ``S_p`` of an fp32 ``shape`` through ``iteration``, as
    ``plan.cost("spectral_power", ...)`` counts them (counted here: the cost model runs the ops that route)."""
    return _counted_power(shape, p, iteration, steps, symmetric_at_half).flops


@functools.lru_cache(maxsize=1024)
def _counted_power(shape: tuple, p: int, iteration: str, steps: int | None, symmetric_at_half: bool) -> Work:
    coefficients = placeholder_coefficients(steps)
    return counted(lambda kernels, W: spectral_power(kernels, W, p, coefficients, "fp32", False, iteration),
                   shape, symmetric_at_half=symmetric_at_half)
