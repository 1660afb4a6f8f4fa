"""The band ops at any threshold depth (docs/real-powers.md, "Thresholds at any depth"): the Gram route
against the FP64 SVD from ``tau = s_max`` down to ``s_max / 1000``, the design that makes it so
(:func:`spectral_ops.plan.threshold_design`), its cost, and its capturable form.

Measure: the error in the SVD basis on the modes at least 1% from the threshold (the sign iteration is
designed to resolve those; nearer ones come out partly projected, which costs svt and the clip at most
``|s - tau|``), relative to the exact result on them. The fp32 bound 2e-5 is the package's (ten fp32
roundoffs of the ~20 products of the chain, as for the powers); measured: at most 6e-6.
"""

import math

import numpy as np
import pytest
import torch
from test_optim_capturable import host_reads_forbidden

import spectral_ops as so
from spectral_ops import plan, reference
from spectral_ops.coefficients import odd_quintic, polar_express_coefficients, polar_express_design
from spectral_ops.linalg import matrix_with_spectrum, relative_error, zero_mode_cutoff

DEPTHS = [2, 5, 20, 100, 300, 1000]
FP32_BOUND = 2e-5
# fp64: the same chain at fp64's unit roundoff; the designed steps' error (1e-13) is above it.
FP64_BOUND = 1e-11
SPECTRUM = torch.logspace(1, -2, 64, dtype=torch.float64)  # s_max = 10, down to s_max / 1000


def issue_matrix(dtype, shape=(128, 64)):
    return matrix_with_spectrum(shape, SPECTRUM, dtype, seed=0)


def resolved_error(result, W, exact_weights, tau, small_side: bool = False) -> float:
    """``result``'s error in ``W``'s SVD basis on the modes at least 1% from ``tau`` (a threshold, or a tuple
    of them, None for one that is not there), relative to the exact ``U diag(exact_weights(s)) V^T`` on them;
    ``small_side``: ``result`` is a projector on the small (right, for a tall ``W``) side."""
    U, s, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    left = Vh if small_side else U.mT
    in_basis = left @ result.double() @ Vh.mT
    kept = torch.ones_like(s, dtype=torch.bool)
    for threshold in tau if isinstance(tau, tuple) else (tau,):
        if threshold is not None:
            kept &= (s - threshold).abs() >= 0.01 * threshold
    exact = torch.diag(exact_weights(s)[kept])
    return (torch.linalg.matrix_norm(in_basis[kept][:, kept] - exact) /
            torch.linalg.matrix_norm(exact).clamp_min(torch.finfo(torch.float64).tiny)).item()


@pytest.mark.parametrize("dtype, bound", [(torch.float32, FP32_BOUND), (torch.float64, FP64_BOUND)])
@pytest.mark.parametrize("depth", DEPTHS)
def test_svt_projectors_and_band_directions_hold_at_any_depth(depth, dtype, bound):
    W = issue_matrix(dtype)
    tau = SPECTRUM[0].item() / depth
    gram = {"method": "gram"}
    assert resolved_error(so.svt(W, tau, **gram), W, lambda s: (s - tau).clamp_min(0), tau) < bound
    assert resolved_error(so.band_projectors(W, tau, **gram)[0], W, lambda s: (s > tau).double(), tau,
                          small_side=True) < bound
    for p in (0, 2, 3):
        band = so.band_direction(W, tau, p, "top", **gram)
        assert resolved_error(band, W, lambda s: torch.where(s > tau, s**p, s), tau) < bound, p
    # The decay's step (lr 1e-3, coefficient 0.5: p * kappa = 0.1) on the top band only.
    decayed = W.clone()
    so.spectral_decay_(decayed, 2, 1e-3, 0.5, band=so.Band(tau, "top_only"), **gram)
    assert resolved_error(decayed, W, lambda s: s - 5e-4 * torch.where(s > tau, s**2, 0), tau) < bound


def test_a_threshold_at_s_max_leaves_nothing_above_it():
    """``tau = s_max``: the top mode is at the threshold (not resolved), every other one is below it."""
    W = issue_matrix(torch.float32)
    tau = SPECTRUM[0].item()
    U, _, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    in_basis = U.mT @ so.svt(W, tau, method="gram").double() @ Vh.mT
    assert in_basis[1:, 1:].abs().max() < FP32_BOUND * tau


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("depth", DEPTHS)
def test_the_hard_cap_holds_at_any_depth_to_the_rounding_of_s_max(depth, dtype):
    """``spectral_clip(W, max=tau)`` is ``W - P_top (W - tau Q)``: the top modes come out as the small
    difference of two ``s_max``-sized ones, so its error is the compute dtype's rounding of ``s_max``
    (in each of the 64 modes: 64 eps s_max), not of the cap; the SVD's is the same at this measure. (A
    floor, ``min=``, lifts every mode below it by the polar factor, whose accuracy at the smallest modes
    is its own design bound's, not the threshold's.)"""
    W = issue_matrix(dtype)
    s_max = SPECTRUM[0].item()
    tau = s_max / depth
    clipped = so.spectral_clip(W, max=tau, method="gram")
    error = resolved_error(clipped, W, lambda s: s.clamp(max=tau), tau)
    cap = torch.linalg.vector_norm(SPECTRUM.clamp(max=tau)).item()
    assert error < 64 * torch.finfo(dtype).eps * s_max / cap


def test_bf16_keeps_its_accuracy_and_gains_at_depth():
    """bf16 operands: as accurate as before at a shallow threshold (its own rounding, ~1e-2 on this
    measure), and the projectors resolve the deep ones (they were off by 0.3-0.5 from s_max / 100)."""
    W = issue_matrix(torch.bfloat16)
    for depth, bound in ((2, 3e-2), (100, 1e-1), (1000, 2e-1)):
        tau = SPECTRUM[0].item() / depth
        assert resolved_error(so.svt(W, tau, method="gram"), W, lambda s: (s - tau).clamp_min(0), tau) < 3e-2
        assert resolved_error(so.band_projectors(W, tau, method="gram")[0], W, lambda s: (s > tau).double(), tau,
                              small_side=True) < bound


def test_the_design_keeps_the_gram_where_it_suffices_and_moves_to_the_absolute_value_below():
    shallow = plan.threshold_design(0.5, 64, torch.float32, "fp32")
    assert not shallow.absolute
    assert shallow.sign == shallow.polar == polar_express_coefficients(8)  # the construction before, bit for bit
    steps = []
    for t in (0.1, 1e-2, 1e-3, 1e-4):
        design = plan.threshold_design(t, 64, torch.float32, "fp32")
        assert design.absolute
        steps.append(len(design.sign))
    assert steps == sorted(steps) and steps[-1] > 8
    # The sign's design reaches the tolerance from the gap: 0.01 t / || |Xn| - t I ||_F.
    t = 1e-3
    gap = 0.01 * t / math.sqrt(1 - 2 * t + 64 * t * t)
    assert plan.threshold_design(t, 64, torch.float32, "fp32").sign == polar_express_design(gap, 1e-7)
    assert plan.threshold_design(t, 64, torch.float32, "fp32").polar == polar_express_design(0.99 * t / 1.01, 1e-7)


def test_an_op_without_a_polar_factor_keeps_the_gram_while_its_rounding_resolves_the_gap():
    """The projectors (and odd band powers) would pay a whole polar factor for ``|Xn|``: they keep the
    Gram, with steps designed for its gap, down to :data:`plan.GRAM_RESOLVES` (fp32, fp64); bf16
    operands only where the default steps serve."""
    t = 0.051  # the Gram's gap: 0.0199 t^2 / sqrt(1 - 2 t^2 + 64 t^4) = 5.2e-5
    gram_gap = (1 - 0.99**2) * t * t / math.sqrt(1 - 2 * t * t + 64 * t**4)
    for precision, dtype, kept in (("fp32", torch.float32, True), ("fp64", torch.float64, True),
                                   ("bf16", torch.float32, False)):
        design = plan.threshold_design(t, 64, dtype, precision, holds_polar=False)
        assert design.absolute is not kept, precision
        if kept:
            assert design.sign == polar_express_design(gram_gap, plan.THRESHOLD_TOLERANCE[dtype])
        assert plan.threshold_design(t, 64, dtype, precision).absolute  # svt's: the polar factor is there
    assert plan.threshold_design(0.03, 64, torch.float32, "fp32", holds_polar=False).absolute  # gap 1.8e-5
    assert not plan.threshold_design(0.03, 64, torch.float64, "fp64", holds_polar=False).absolute


def placed(r, tau, dtype):
    """A ``2r x r`` with ``s`` log-spaced over [1e-2, 10] and two modes 1% from ``tau``, one on each side."""
    s = torch.logspace(1, -2, r, dtype=torch.float64)
    nearest = int((s - tau).abs().argmin())
    s[nearest], s[min(nearest + 1, r - 1)] = tau * 1.0101, tau * 0.99
    return matrix_with_spectrum((2 * r, r), s.sort(descending=True).values, dtype, seed=5)


@pytest.mark.parametrize("r", [64, 256])
@pytest.mark.parametrize("precision, dtype, bound", [("fp32", torch.float32, FP32_BOUND),
                                                     ("fp64", torch.float64, FP64_BOUND)])
def test_the_gram_meets_the_bound_at_its_resolution(r, precision, dtype, bound):
    """:data:`plan.GRAM_RESOLVES`, checked: the deepest threshold at which the projectors keep the Gram,
    with modes 1% from it on both sides."""
    low, high = 1e-3, 10.0  # bisect tau (log) to the Gram's gap just above the resolution
    for _ in range(40):
        tau = math.sqrt(low * high)
        W = placed(r, tau, dtype)
        t = tau / torch.linalg.matrix_norm(W.double()).item()
        gap = 0.0199 * t * t / math.sqrt(1 - 2 * t * t + r * t**4)
        low, high = (tau, high) if gap < 1.05 * plan.GRAM_RESOLVES[precision] else (low, tau)
    W = placed(r, high, dtype)
    assert not plan.threshold_design(high / torch.linalg.matrix_norm(W.double()).item(), r, dtype, precision,
                                     holds_polar=False).absolute
    top = so.band_projectors(W, high, method="gram")[0]
    assert resolved_error(top, W, lambda s: (s > high).double(), high, small_side=True) < bound


def test_a_users_sign_steps_and_newton_schulz_win():
    given = so.ops.sign_coefficients(12, "polar_express")
    design = plan.threshold_design(1e-3, 64, torch.float32, "fp32", sign_coefficients=given)
    assert design.sign == given and not design.absolute
    # The default count, given, runs on the Gram as before: at s_max / 100 it does not resolve the threshold.
    W = issue_matrix(torch.float32)
    tau = SPECTRUM[0].item() / 100
    given = so.band_projectors(W, tau, sign_steps=8, method="gram")[0]
    assert resolved_error(given, W, lambda s: (s > tau).double(), tau, small_side=True) > 1e-2
    assert so.ops.threshold_sign_coefficients(None, "polar_express") is None
    assert so.ops.threshold_sign_coefficients(None, "newton_schulz") == so.ops.sign_coefficients(None, "newton_schulz")
    with pytest.raises(ValueError, match="sign_method"):
        so.ops.threshold_sign_coefficients(None, "svd")


def test_polar_express_design_is_polar_express_for_its_count():
    for lower in (1e-3, 1e-5, 1e-8):
        for tolerance in (1e-7, 1e-13):
            designed = polar_express_design(lower, tolerance)
            assert designed == polar_express_coefficients(len(designed), lower)
    # A design that meets an 8e-6 wide interval on its way (Remez's system is too ill-conditioned there:
    # it failed before), from 1.4e-9: it takes the collapsed step and reaches the tolerance.
    designed = polar_express_design(1.3883760884664742e-09, 1e-7)
    x = np.geomspace(1.3883760884664742e-09, 1.0, 10001)
    for step in designed:
        x = odd_quintic(step, x)
    assert np.abs(1 - x).max() < 2e-7  # the safety factor's 1.01 on all but the last step
    with pytest.raises(ValueError, match="lower"):
        polar_express_design(0.0, 1e-7)
    with pytest.raises(ValueError, match="tolerance"):
        polar_express_design(1e-3, 1.5)


@pytest.mark.parametrize("depth", [1000, 5])
def test_capturable_band_ops_read_nothing_back_and_cover_a_thousandth_of_s_max(depth):
    """A capturable call cannot read ``||W||_F``: its fixed design covers ``tau >= s_max / 1000`` (to the
    same bound), whatever the depth, at the cost of the steps that depth needs."""
    W = issue_matrix(torch.float32)
    tau = SPECTRUM[0].item() / depth
    with host_reads_forbidden():
        result = so.svt(W, tau, method="gram", capturable=True)
        top = so.band_projectors(W, tau, method="gram", capturable=True)[0]
        so.band_direction(W, tau, 2, "top", method="gram", capturable=True)
        so.spectral_clip(W, max=tau, method="gram", capturable=True)
    assert resolved_error(result, W, lambda s: (s - tau).clamp_min(0), tau) < FP32_BOUND
    assert resolved_error(top, W, lambda s: (s > tau).double(), tau, small_side=True) < FP32_BOUND
    fixed = plan.threshold_design(None, 64, torch.float32, "fp32")
    assert fixed == plan.threshold_design(plan.CAPTURABLE_DEPTH / 8, 64, torch.float32, "fp32") and fixed.absolute


@pytest.mark.parametrize("op", ["svt", "band_projectors", "spectral_clip", "band_direction"])
@pytest.mark.parametrize("depth", [2, 100, 1000])
def test_the_cost_counts_the_designed_construction(op, depth):
    """plan.cost with the threshold's ``tau / ||W||_F`` counts what an eager call does (FlopCounterMode of
    the torch backend), the design's extra sign and polar steps and the product for ``|W|`` included."""
    from torch.utils.flop_counter import FlopCounterMode

    shape = (24, 96) if op == "band_projectors" else (96, 24)
    W = matrix_with_spectrum(shape, torch.logspace(1, -2, 24, dtype=torch.float64), torch.float32, seed=1)
    tau = torch.linalg.matrix_norm(W, 2).item() / depth
    ratio = tau / torch.linalg.matrix_norm(W).item()
    calls = {
        "svt": lambda: so.svt(W, tau, method="gram", precision="fp32"),
        "band_projectors": lambda: so.band_projectors(W, tau, method="gram", precision="fp32"),
        "spectral_clip": lambda: so.spectral_clip(W, tau, tau, method="gram", precision="fp32"),
        "band_direction": lambda: so.band_direction(W, tau, 2, "top", method="gram", precision="fp32"),
    }
    with so.use_backend("torch"), FlopCounterMode(display=False) as counter:
        calls[op]()
    options = {"p": 2, "band_mode": "top"} if op == "band_direction" else {}
    assert plan.cost(op, tuple(W.shape), precision="fp32", steps=None, sign_steps=None, threshold=ratio,
                     **options) == counter.get_total_flops()


def test_the_cost_refuses_a_threshold_that_is_not_a_ratio():
    for threshold in (0.0, -1.0, math.nan, "0.1"):
        with pytest.raises(ValueError, match="threshold is tau"):
            plan.cost("svt", (64, 32), steps=None, sign_steps=None, threshold=threshold)


# ----- the clip at any depth (#43): the lift of min= and the bottom band's p = 0, bf16 weights, zero modes

LIFT_SPECTRUM = torch.logspace(0, -4, 64, dtype=torch.float64)  # s_max = 1, s_min = s_max / 1e4
CLIP_DEPTHS = [5, 20, 100, 1000]
# The two-sided clip's floor sits a decade below its cap, down to s_min at s_max / 1000.
CLIP_FORMS = {"min": lambda tau: (tau, None), "max": lambda tau: (None, tau), "both": lambda tau: (tau / 10, tau)}
# 2^-9: bf16's unit roundoff, the most by which rounding each entry of the exact result moves it (relative), so
# also the most by which it moves the result in Frobenius norm: a bf16 result cannot be closer than that.
BF16_RESULT_ROUNDING = 2.0**-9


def lift_matrix(dtype, shape=(64, 128)):
    return matrix_with_spectrum(shape, LIFT_SPECTRUM, dtype, seed=0)


def fp32_rounding_bound(W, exact, lifted_value: float = 0.0) -> float:
    """What an fp32 computation of a clip or band form of ``W`` can reach against the FP64 SVD, relative to
    ``exact`` (its FP64 result): any fp32 method perturbs ``W`` by its rounding, ``eps s_max`` (an SVD's
    backward error), and that perturbation reaches the result (1) through the forms that subtract
    ``s_max``-sized terms (the cap ``W - P_top (W - max Q)``, a projector's rounding times ``W``: up to ``eps
    s_max`` in each of the ``r`` modes, as test_the_hard_cap_holds_at_any_depth_to_the_rounding_of_s_max
    says), and (2) through a lift, which takes a mode ``s`` to ``lifted_value`` (``min``, or 1 for ``p = 0``)
    and so multiplies a perturbation by ``lifted_value / s``: the polar factor's condition number on that
    mode, at most ``lifted_value / s_min``; measured, the SVD and the Gram route reach 0.2 to 0.4 of it, so
    twice it bounds both. Never below the package's fp32 bound."""
    s = torch.linalg.svdvals(W.double())
    eps = torch.finfo(torch.float32).eps
    s_min = s[s > zero_mode_cutoff(max(W.shape), torch.float32) * s[0]][-1].item()  # of the modes it lifts
    rounding = eps * s[0].item() * (s.numel() + 2 * lifted_value / s_min)
    return max(FP32_BOUND, rounding / torch.linalg.matrix_norm(exact).item())


@pytest.mark.parametrize("method", ["gram", "auto"])
@pytest.mark.parametrize("form", list(CLIP_FORMS))
@pytest.mark.parametrize("depth", CLIP_DEPTHS)
def test_the_clip_reaches_fp32_accuracy_at_any_depth(depth, form, method):
    """Issue #43, item 4: the Gram route's lift took a mode far below ``min`` only as far as the polar
    factor's default design lifts it (0.31 min at ``s = 1e-4 ||W||_F``), 12 to 15 modes wrong: errors of
    0.12, 3.7e-2, 7.4e-3, 5.1e-4 for ``min=`` at ``s_max / 5 .. / 1000``, 3.8e-2 for the two-sided clip at
    ``s_max / 5``. Now the lift's polar factor resolves every non-zero mode (plan.CUTOFF_RESOLUTION), and both
    routes meet :func:`fp32_rounding_bound`. Measure: as the docs' tables, the modes at least 1% from each
    bound (a mode nearer a bound is partly projected, an error of at most its distance to the bound)."""
    W = lift_matrix(torch.float32)
    low, high = CLIP_FORMS[form](LIFT_SPECTRUM[0].item() / depth)
    error = resolved_error(so.spectral_clip(W, low, high, method=method), W, lambda s: s.clamp(low, high), (low, high))
    bound = fp32_rounding_bound(W, reference.spectral_clip_svd(W, low, high), low or 0.0)
    assert error < bound, (error, bound)


def test_the_issues_floor_lifts_every_mode():
    """The reproduction of item 4: ``min=0.5`` on ``s = logspace(0, -4, 64)``, 64 x 128 fp32, the whole
    result: 0.175 on the Gram route before (13 modes wrong, the issue counted); now the fp32 SVD's accuracy
    (4.6e-5, the SVD route 4.7e-5: the clip's conditioning, a mode at 1e-4 lifted to 0.5), every mode within
    fp32's reach of 0.5."""
    W = lift_matrix(torch.float32)
    exact = reference.spectral_clip_svd(W, 0.5)
    clipped = so.spectral_clip(W, min=0.5, method="gram")
    assert relative_error(clipped, exact) < fp32_rounding_bound(W, exact, 0.5)
    singular_values = torch.linalg.svdvals(clipped.double())
    expected = torch.linalg.svdvals(exact)
    # A mode's value, lifted from s_min: 2 eps s_max (0.5 / s_min), the bound above without the sum over modes.
    assert (singular_values - expected).abs().max() < 2 * torch.finfo(torch.float32).eps * 0.5 / 1e-4


@pytest.mark.parametrize("method", ["gram", "auto"])
@pytest.mark.parametrize("form", list(CLIP_FORMS))
@pytest.mark.parametrize("depth", CLIP_DEPTHS)
def test_a_bf16_clip_is_as_accurate_as_its_result_can_be(depth, form, method):
    """Issue #43, item 5: the clip computes in fp32 for bf16 weights (plan.clip_precision), so its error is
    the bf16 result's own rounding (:data:`BF16_RESULT_ROUNDING`) plus fp32's, at every depth. With bf16
    operands (the default before) the hard cap erred 1.7e-2, 5.7e-2, 0.27, 2.9 at ``s_max / 5 .. / 1000``
    here (0.22 at ``s_max / 100`` on the issue's Gaussian 256 x 512), ``min=`` 0.21 at ``s_max / 5``."""
    W = lift_matrix(torch.bfloat16)
    low, high = CLIP_FORMS[form](LIFT_SPECTRUM[0].item() / depth)
    clipped = so.spectral_clip(W, low, high, method=method)
    assert clipped.dtype == torch.bfloat16
    exact = reference.spectral_clip_svd(W, low, high)
    assert relative_error(clipped, exact) < BF16_RESULT_ROUNDING + fp32_rounding_bound(W, exact, low or 0.0)


def test_a_bf16_clip_computes_in_fp32_unless_told_otherwise():
    """``precision=None`` is fp32 for the clip whatever the weight's dtype or torch's float32 matmul setting;
    an explicit ``precision="bf16"`` still takes bf16 operands, with their documented limit at depth."""
    assert plan.clip_precision(None, torch.bfloat16) == plan.clip_precision(None, torch.float16) == "fp32"
    assert plan.clip_precision(None, torch.float64) == "fp64"
    assert plan.clip_precision("bf16", torch.bfloat16) == "bf16"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # bf16 products for the other float32 ops
        assert plan.clip_precision(None, torch.float32) == "fp32"
    finally:
        torch.set_float32_matmul_precision(previous)
    W = lift_matrix(torch.bfloat16)
    tau = LIFT_SPECTRUM[0].item() / 100
    exact = reference.spectral_clip_svd(W, None, tau)
    # bf16 operands round s_max-sized terms at 2^-9 of s_max, on a cap 100 times smaller.
    bf16_operands = so.spectral_clip(W, max=tau, method="gram", precision="bf16")
    assert relative_error(bf16_operands, exact) > 10 * BF16_RESULT_ROUNDING


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("depth", CLIP_DEPTHS)
def test_a_bottom_band_at_p_0_is_lifted_at_any_depth(depth, dtype):
    """The same lift in the band forms: ``p = 0`` below ``tau`` (``bot``, ``bot_only``, ``two_band`` with
    ``p_bot = 0``) takes every mode below it to 1, which needs the polar factor on every non-zero mode:
    0.19 to 0.30 off before, at every depth, on this spectrum (s_min = s_max / 1e4)."""
    W = lift_matrix(dtype)
    tau = LIFT_SPECTRUM[0].item() / depth
    for mode, p, options, top in (("bot", 0, {}, lambda s: s), ("bot_only", 0, {}, lambda s: 0 * s),
                                  ("two_band", 2, {"p_bot": 0}, lambda s: s**2)):
        exact = reference.band_direction_svd(W, tau, p, mode, **options)
        band = so.band_direction(W, tau, p, mode, method="gram", **options)
        error = resolved_error(band, W, lambda s: torch.where(s > tau, top(s), 1.0), tau)
        bound = fp32_rounding_bound(W, exact, 1.0) if dtype == torch.float32 else FP64_BOUND
        assert error < bound, (mode, error, bound)


def rank_deficient(dtype, shape=(64, 128), rank=8):
    """A product of small integer matrices: exact in bf16, fp32 and fp64, so its zero modes are exactly zero
    and every dtype's oracle agrees (a rounded low-rank product has modes at ``eps s_max`` that the FP64 SVD
    sees as non-zero)."""
    generator = torch.Generator().manual_seed(3)
    left = torch.randint(-4, 5, (shape[0], rank), generator=generator, dtype=torch.float64)
    right = torch.randint(-4, 5, (rank, shape[1]), generator=generator, dtype=torch.float64)
    return (left @ right).to(dtype)


@pytest.mark.parametrize("method", ["gram", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_off_modes_are_not_lifted(dtype, method):
    """The "Round-off modes lifted" finding of #43: ``spectral_clip(W, min=0.5)`` on an exactly rank-1 fp32
    ``W`` (the CPU's SVD route) gave singular values [10.6, 0.5, 0.5, 0], the FP64 reference [10.6, 0, 0, 0]:
    the zero-mode cutoff took float64's eps on a float32 SVD. It is now ``linalg.zero_mode_cutoff`` in the
    factorisation's dtype. The Gram route's lift keeps the same modes at 0 (plan.CUTOFF_RESOLUTION): a polar factor
    designed down to the cutoff alone would lift their round-off to 0.2 min (64 x 128 of rank 8)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    eps = torch.finfo(compute).eps
    rank_one = (torch.ones(4, 4, dtype=torch.float64) * 2.65).to(dtype)
    s_max = torch.linalg.svdvals(rank_one.double())[0].item()
    lifted = torch.linalg.svdvals(so.spectral_clip(rank_one, min=0.5, method=method).double())
    assert lifted[0] == pytest.approx(s_max, rel=BF16_RESULT_ROUNDING if dtype == torch.bfloat16 else 1e-6)
    # The result's own rounding of its one mode: a few eps of s_max in its zero modes.
    assert lifted[1:].max() < 8 * eps * s_max
    W = rank_deficient(dtype)
    s = torch.linalg.svdvals(W.double())
    for low in (s[0].item() / 5, s[7].item() / 2):
        exact = reference.spectral_clip_svd(W, low)
        assert torch.linalg.matrix_rank(exact).item() == 8
        error = relative_error(so.spectral_clip(W, min=low, method=method), exact)
        fp32_bound = fp32_rounding_bound(W, exact, low)
        bound = {torch.float32: fp32_bound, torch.float64: FP64_BOUND,
                 torch.bfloat16: BF16_RESULT_ROUNDING + fp32_bound}[dtype]
        assert error < bound, (low, error, bound)


# Issue #52's matrix: 512 x 128 with s down to 1e-5 s_max, modes on both sides of the fp32 cutoff (6.1e-5 s_max);
# fp64's cutoff (1.1e-13 s_max) needs a spectrum reaching below it.
CUTOFF_SPECTRA = {torch.float32: torch.logspace(0, -5, 128, dtype=torch.float64),
                  torch.float64: torch.logspace(0, -14, 128, dtype=torch.float64)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_mode_at_or_below_the_zero_cutoff_is_never_lifted(dtype):
    """Issue #52, item 9: docs/guarantees.md promises that the modes at or below the zero cutoff
    (``max(m, n) eps s_max``) stay 0, but the Gram route's cutoff was soft a factor 2 around it (and read
    ``s_max`` from below within ``r^(1/32)``): ``spectral_clip(min=0.2, method="gram")`` lifted the modes at
    0.92 and 0.84 of the fp32 cutoff to 0.195 and 0.042. Now its sign at the cutoff sits above it
    (plan.CUTOFF_RESOLUTION: in fp32 every mode 2.6% above it is lifted, in fp64, whose rounding at its cutoff
    allows no finer, 3 times), so on both routes no mode at or below the cutoff is lifted (the SVD keeps it as
    it is, at most the cutoff; the Gram route takes it to 0); above the band every mode is lifted to ``min``,
    within what fp32 (fp64) can reach: the lift multiplies the rounding of ``W``, ``eps s_max``, by ``min / s``
    (twice that bounds each mode, as test_the_issues_floor_lifts_every_mode measures). The band forms'
    ``p = 0`` below ``tau`` is the same lift, to 1."""
    W = matrix_with_spectrum((512, 128), CUTOFF_SPECTRA[dtype], dtype, seed=0)
    U, s, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    cutoff = zero_mode_cutoff(512, dtype) * s[0].item()
    band = 1.03 if dtype == torch.float32 else 3.1  # the Gram route's partly lifted modes, above the cutoff
    # fp64's cutoff is a few hundred units of its rounding of s_max, where its polar factor errs by about 5e-11
    # (docs/api.md): over the gap to the cutoff's neighbours that mixes up to ~1e-9 of the lifted value into a
    # mode below it (measured 1.9e-9). fp32's leak (its projector computed in fp64) is far below its cutoff.
    leak = 1e-8 if dtype == torch.float64 else 0.0
    eps = torch.finfo(dtype).eps
    # (what a mode below the threshold is lifted to, the threshold, the form)
    for low, threshold, result in ((0.2, 0.2, lambda method: so.spectral_clip(W, min=0.2, method=method)),
                                   (1.0, 0.5, lambda method: so.band_direction(W, 0.5, 0, "bot_only", method=method))):
        below, lifted = s <= cutoff, (s >= band * cutoff) & (s < 0.99 * threshold)
        assert below.any() and lifted.any()
        reach = 2 * eps * s[0].item() * low / s[lifted].min().item()
        for method in ("gram", "svd"):
            modes = torch.diagonal(U.mT @ result(method).double() @ Vh.mT)
            assert modes[below].abs().max() <= cutoff + leak * low, (method, modes[below].abs().max() / cutoff)
            assert (modes[lifted] - low).abs().max() < reach, (method, (modes[lifted] - low).abs().max(), reach)


@pytest.mark.parametrize("seed", [1, 6])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_rounded_low_rank_half_precision_clip_lifts_what_its_cutoff_says(dtype, seed):
    """Issue #52, item 9: ``spectral_clip(min=)`` of a rank-2 product rounded to fp16/bf16, whose rounding gives it
    modes from about 2^-11 (2^-9) of ``s_max`` down, some near fp32's cutoff (the clip computes in fp32). The Gram
    route's soft cutoff lifted some of those below it, partly: 0.26 and 0.27 (fp16), 1.6e-2 (bf16, seed 1) off an
    oracle that counts zero modes as the package does (fp32's cutoff), where the SVD route erred 9e-3 and
    1.7e-3. Now the Gram route is within what fp32 reaches (:func:`fp32_rounding_bound`: the lift multiplies
    ``W``'s rounding by ``min / s``) plus the result's rounding (twice: the computed result's is another draw of
    the oracle's) and the modes below the cutoff, which the SVD leaves as they are and the Gram route takes to 0
    (at most ``c`` each). A mode within the Gram route's band above the cutoff is partly lifted (docs/api.md,
    "The zero modes"): these seeds have none there (fp16's rounding modes often do). The FP64 oracle (float64's
    cutoff) lifts the modes below fp32's cutoff too: ``precision="fp64"`` meets it to the result's rounding."""
    generator = torch.Generator().manual_seed(seed)
    W = (torch.randn(64, 2, generator=generator) @ torch.randn(2, 128, generator=generator)).to(dtype)
    U, s, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    cutoff = zero_mode_cutoff(128, torch.float32) * s[0].item()
    assert not ((s > cutoff) & (s < 1.03 * cutoff)).any()
    for low in (0.5 * s[0].item(), 0.05 * s[0].item()):
        exact = (U * torch.where(s > cutoff, s.clamp(min=low), s)) @ Vh
        rounding = relative_error(exact.to(dtype), exact)
        below = cutoff * math.sqrt(int((s <= cutoff).sum())) / torch.linalg.matrix_norm(exact).item()
        bound = 2 * rounding + fp32_rounding_bound(W, exact, low) + below
        error = relative_error(so.spectral_clip(W, min=low, method="gram"), exact)
        assert error < bound, (low, error, bound)
        oracle = reference.spectral_clip_svd(W, low)
        fp64 = so.spectral_clip(W, min=low, method="gram", precision="fp64")
        assert relative_error(fp64, oracle) < 2 * relative_error(oracle.to(dtype), oracle) + FP64_BOUND


def test_the_lifts_design_reaches_the_zero_cutoff_where_the_operands_resolve_it():
    """plan.threshold_design(lift_size=N): the polar factor designed down to the zero cutoff at its smallest
    against ``||X||_F`` (``N eps / sqrt(r)``), the cutoff's sign (float64) for its modes CUTOFF_RESOLUTION
    from it; nothing of the kind where the caller gave coefficients, nor for bf16/fp16/tf32 operands."""
    r, size, t = 64, 128, 0.1
    for dtype in (torch.float32, torch.float64):
        precision = "fp64" if dtype == torch.float64 else "fp32"
        cutoff = zero_mode_cutoff(size, dtype) / math.sqrt(r)
        tolerance = min(plan.THRESHOLD_TOLERANCE[dtype], plan.CUTOFF_TOLERANCE_UNITS * torch.finfo(dtype).eps)
        lifted = plan.threshold_design(t, r, dtype, precision, lift_size=size)
        assert lifted.polar == polar_express_design(cutoff / 1.01, tolerance)
        assert lifted.cutoff == polar_express_design(plan.CUTOFF_RESOLUTION[dtype] * cutoff, tolerance)
        plain = plan.threshold_design(t, r, dtype, precision)
        assert plain.cutoff is None and lifted.sign == plain.sign and len(lifted.polar) > len(plain.polar)
    for precision in ("bf16", "fp16", "tf32"):
        assert plan.threshold_design(t, r, torch.float32, precision, lift_size=size) == \
            plan.threshold_design(t, r, torch.float32, precision)
    given = polar_express_coefficients(8)
    assert plan.threshold_design(t, r, torch.float32, "fp32", polar_coefficients=given, lift_size=size).cutoff is None


def test_a_capturable_clip_lifts_without_reading_back():
    """The lift's design does not depend on the weight (the cutoff at its smallest) and its ``s_max`` comes
    from the Gram's squares on the device: a capturable ``min=`` reads nothing back, to the same accuracy."""
    W = lift_matrix(torch.float32)
    low, high = CLIP_FORMS["both"](LIFT_SPECTRUM[0].item() / 20)
    with host_reads_forbidden():
        clipped = so.spectral_clip(W, low, high, method="gram", capturable=True)
    error = resolved_error(clipped, W, lambda s: s.clamp(low, high), (low, high))
    assert error < fp32_rounding_bound(W, reference.spectral_clip_svd(W, low, high), low)
