"""The in-place decay step (SPEC 1.5) against its out-of-place definition and the SVD oracle."""

import math
import warnings

import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD
from spectral_ops.precision import outside_autocast

from op_calls import OPS

# Same budget as test_ops: a chain of ~30 products of inner size <= 64, plus one subtraction.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-5}


def weights(shape=(24, 16), dtype=torch.float64, seed=0, condition=10.0, scale=1.0):
    return matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), condition) * scale, dtype, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p", range(5))
def test_decay_equals_out_of_place_update_and_svd(p, dtype):
    W = weights(dtype=dtype, seed=p)
    lr, wd, ordinary = 0.05, 0.2, 0.1
    expected = W - lr * wd * so.spectral_power(W, p, method="gram") - lr * ordinary * W
    so.spectral_decay_(W_new := W.clone(), p, lr, wd, ordinary_weight_decay=ordinary)
    assert relative_error(W_new, expected) < TOLERANCE[dtype]
    oracle = reference.spectral_decay_svd(W, p, lr, wd, ordinary)
    assert relative_error(W_new, oracle) < TOLERANCE[dtype]


def _stepped(optimizer, **options):
    """An entry that steps two weights (a same-shape pair: a stacked decay) twice with seeded gradients, through
    ``optimizer(params)``: the weights after."""
    def step(W):
        params = [torch.nn.Parameter(W.clone()), torch.nn.Parameter(W * 0.5)]
        stepper = optimizer(params, **options)
        for seed in range(2):
            generator = torch.Generator().manual_seed(seed)
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            stepper.step()
        return [param.detach() for param in params]
    return step


def _attached(params, **options):
    host = torch.optim.SGD(params, lr=1e-2)
    SpectralDecay(params, **options).attach(host)
    return host


DECAY = {"p": 2, "spectral_weight_decay": 0.1}
# Every public entry that computes: the ops (tests/op_calls.py's table), msign, the p = 0 decay's other mode,
# and each optimizer's step, SpectralMuon's AdamW group and an attached decay included.
ENTRIES = {
    **OPS,
    "msign": lambda W: so.msign(W[..., :3, :3] + W[..., :3, :3].mT),
    "spectral_decay_ prox": lambda W: so.spectral_decay_(W.clone(), 0, 0.02, 0.5, p0_mode="prox"),
    "adamw": _stepped(SpectralAdamW, lr=1e-2, **DECAY),
    "sgd": _stepped(SpectralSGD, lr=1e-2, momentum=0.9, **DECAY),
    "muon": _stepped(SpectralMuon, lr=1e-2, **DECAY),
    "muon-adamw": _stepped(lambda params, **o: SpectralMuon([{"params": params, "algorithm": "adamw"}], **o),
                           lr=1e-2, **DECAY),
    "decay": _stepped(SpectralDecay, lr=1e-2, **DECAY),
    "attached": _stepped(_attached, **DECAY),
}


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("entry", ENTRIES)
def test_an_enclosing_autocast_changes_nothing(entry, dtype, autocast):
    """A step inside a forward's autocast (Lightning's manual optimization steps in its training_step under
    precision="bf16-mixed"; a loop's ``with torch.autocast(...)`` around the whole step): every op, decay and
    optimizer step gives, bit for bit, what it gives outside, for every weight dtype under either autocast
    dtype. Autocast ran the fp32 weights' products in bf16 (a decay 1e-4 off), and refused a weight of the
    other half dtype with torch's own error ("Unexpected floating ScalarType in at::autocast::prioritize", a
    bf16 weight under an fp16 autocast). A 3-D stack and a matrix, as the entries batch either."""
    W = weights((2, 8, 6) if entry in OPS else (8, 6), torch.float64, seed=5).to(dtype)
    outside = ENTRIES[entry](W)
    with torch.autocast("cpu", dtype=autocast):
        inside = ENTRIES[entry](W)
    assert all(torch.equal(a, b) for a, b in zip(_as_list(inside), _as_list(outside)))


def _as_list(result):
    return result if isinstance(result, list) else [result]


def test_no_autocast_reaches_inside_an_entry():
    """The switch covers every device type the package computes on: CUDA's autocast state too (set here
    without a GPU, as torch.autocast("cuda") would on one)."""
    states = outside_autocast(lambda: [torch.is_autocast_enabled(device) for device in ("cpu", "cuda")])
    for device in ("cpu", "cuda"):
        torch.set_autocast_enabled(device, True)
    try:
        assert states() == [False, False]
        assert torch.is_autocast_enabled("cpu") and torch.is_autocast_enabled("cuda")  # restored after the call
    finally:
        for device in ("cpu", "cuda"):
            torch.set_autocast_enabled(device, False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_p_one_is_bitwise_ordinary_weight_decay(dtype):
    W = weights(dtype=dtype)
    expected = W.clone().mul_(1 - 0.01 * 0.3)
    so.spectral_decay_(W, 1, 0.01, 0.3)
    assert torch.equal(W, expected)


def test_conventions():
    W = weights()
    peak_lr, schedule = 0.1, 0.5
    lr = peak_lr * schedule
    coupled = so.spectral_decay_(W.clone(), 2, lr, 0.3)
    independent = so.spectral_decay_(W.clone(), 2, lr, 0.3, convention="independent", schedule=schedule)
    assert relative_error(coupled, reference.spectral_decay_svd(W, 2, lr, 0.3)) < 1e-12
    assert relative_error(independent, reference.spectral_decay_svd(W, 2, schedule, 0.3)) < 1e-12
    # The ordinary term follows the same convention.
    both = so.spectral_decay_(W.clone(), 2, lr, 0.3, ordinary_weight_decay=0.2, convention="independent",
                              schedule=schedule)
    assert relative_error(both, reference.spectral_decay_svd(W, 2, schedule, 0.3, 0.2)) < 1e-12
    with pytest.raises(ValueError, match="schedule"):
        so.spectral_decay_(W.clone(), 2, lr, 0.3, convention="independent")


def test_list_of_weights_is_batched_and_written_in_place():
    shapes = [(12, 8), (12, 8), (8, 12), (2, 12, 8)]
    tensors = [weights(s, seed=i) for i, s in enumerate(shapes)]
    originals = [t.clone() for t in tensors]
    returned = so.spectral_decay_(tensors, 2, 0.1, 0.2)
    assert returned is tensors
    for t, original in zip(tensors, originals):
        assert relative_error(t, reference.spectral_decay_svd(original, 2, 0.1, 0.2)) < 1e-12


def test_non_contiguous_weights_are_written_in_place():
    base = weights((16, 24), seed=3)
    view = base.mT  # 24 x 16 transposed view
    expected = reference.spectral_decay_svd(view, 2, 0.1, 0.2)
    so.spectral_decay_(view, 2, 0.1, 0.2)
    assert relative_error(base.mT, expected) < 1e-12
    stacked = torch.stack([weights(seed=1), weights(seed=2)], dim=-1)  # (24, 16, 2)
    slice_ = stacked[..., 1]
    expected = reference.spectral_decay_svd(slice_, 3, 0.1, 0.2)
    so.spectral_decay_(slice_, 3, 0.1, 0.2)
    assert relative_error(stacked[..., 1], expected) < 1e-12


def test_zero_coefficients_and_empty_weights():
    W = weights()
    original = W.clone()
    so.spectral_decay_(W, 2, 0.0, 0.5)
    assert relative_error(W, original) == 0.0
    empty = torch.zeros(0, 4)
    assert so.spectral_decay_(empty, 2, 0.1, 0.1) is empty
    zero = torch.zeros(3, 6, 4)
    so.spectral_decay_(zero, 0, 0.1, 0.1)
    assert torch.equal(zero, torch.zeros(3, 6, 4))


ZERO_LR_FORMS = {"explicit": {}, "prox": {"p0_mode": "prox"}, "band": {"band": so.Band(0.5)},
                 "two_band": {"band": so.Band(0.5, "two_band", p_bot=1)}, "clip": {"band": so.Band(0.5, "clip")}}


@pytest.mark.parametrize("lr", ["number", "tensor", "capturable"])
@pytest.mark.parametrize("p, form", [(p, form) for p in range(5) for form in ZERO_LR_FORMS
                                     if form not in ("prox", "clip") or p == (form == "clip")])
def test_an_lr_of_zero_leaves_the_weights_bit_for_bit_in_every_form(p, form, lr):
    """guarantees.md: lr = 0 writes nothing that changes a bit. The prox decay rebuilt W from its factors
    at a zero threshold, 1.2e-6 off in fp32 (1.9e-6 here); now a zero threshold keeps W itself: by the
    multiply for a Python zero, on the device for a tensor one (no host read: capturable). Every power,
    both p = 0 modes and the band forms; in place, out of place, and the increment (0)."""
    options = dict(ZERO_LR_FORMS[form])  # prox is a p = 0 mode, clip a p = 1 one
    if lr == "capturable":
        options.update(capturable=True, method="gram", stability="clamp")
    zero = 0.0 if lr == "number" else torch.tensor(0.0)
    W = weights(dtype=torch.float32, seed=p)
    decayed = W.clone()
    so.spectral_decay_(decayed, p, zero, 0.5, ordinary_weight_decay=0.1, **options)
    assert torch.equal(decayed, W)
    assert torch.equal(so.spectral_decay(W, p, zero, 0.5, ordinary_weight_decay=0.1, **options), W)
    if form != "prox":  # the prox decay refuses increment=True (it rebuilds W)
        increment = so.spectral_decay(W, p, zero, 0.5, ordinary_weight_decay=0.1, increment=True, **options)
        assert torch.equal(increment, torch.zeros_like(W))


def test_tensor_coefficients():
    W = weights()
    lr, wd = torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)
    result = so.spectral_decay_(W.clone(), 2, lr, wd)
    assert relative_error(result, reference.spectral_decay_svd(W, 2, 0.1, 0.2)) < 1e-12


def test_prox_mode_soft_thresholds():
    W = matrix_with_spectrum((20, 12), torch.cat([torch.linspace(2, 3, 6), torch.linspace(0.1, 0.5, 6)]), seed=4)
    result = so.spectral_decay_(W.clone(), 0, 0.5, 2.0, p0_mode="prox")
    assert relative_error(result, reference.svt_svd(W, 1.0)) < 1e-10
    # The explicit p = 0 step instead reflects the modes it overshoots: s -> |s - 1|.
    explicit = so.spectral_decay_(W.clone(), 0, 0.5, 2.0)
    assert relative_error(torch.linalg.svdvals(explicit).sort().values,
                          (torch.linalg.svdvals(W) - 1).abs().sort().values) < 1e-10


def test_band_decay():
    tau = 1.0
    W = matrix_with_spectrum((20, 12), torch.cat([torch.linspace(1.5, 3, 6), torch.linspace(0.2, 0.6, 6)]), seed=5)
    top = so.spectral_decay_(W.clone(), 2, 0.1, 0.5, band=so.Band(tau, "top"))
    expected = W - 0.1 * 0.5 * reference.band_direction_svd(W, tau, 2, "top")
    assert relative_error(top, expected) < 1e-10
    two = so.spectral_decay_(W.clone(), 2, 0.1, 0.5, band={"tau": tau, "mode": "two_band", "p_bot": 0,
                                                            "spectral_weight_decay_bot": 0.3})
    expected = W - 0.1 * reference.band_direction_svd(W, tau, 2, "two_band", p_bot=0, lambda_top=0.5, lambda_bot=0.3)
    assert relative_error(two, expected) < 1e-10
    with pytest.raises(ValueError, match="unknown band options"):
        so.spectral_decay_(W.clone(), 2, 0.1, 0.5, band={"tau": 1.0, "p_top": 2})
    with pytest.raises(ValueError, match="prox"):
        so.spectral_decay_(W.clone(), 0, 0.1, 0.5, band=so.Band(1.0), p0_mode="prox")


def _top_mode_order(W, lr, coefficient, p):
    """``p * kappa`` at the exact ``s_max`` (SVD): what the guard bounds from above."""
    return p * lr * coefficient * float(torch.linalg.matrix_norm(W, 2)) ** (p - 1)


def test_stability_guard():
    W = weights(scale=10.0)  # s_max = 10: kappa = lr * wd * s_max = 2, p * kappa = 4 for p = 2
    original = W.clone()
    # The guard bounds s_max from above: exactly 4 on a CPU's factorised route (its own s_max), 4.001
    # on the Gram route (its squarings' bound is 2e-4 above); kappa 2 (to 4 digits).
    with pytest.raises(so.SpectralStabilityError, match=r"unstable .* p \* kappa .* reaches 4(\.00\d*)? >= 1 "
                                                        r"\(kappa = 2[.\d]*\).*through zero"):
        so.spectral_decay_(W, 2, 0.1, 2.0)
    assert torch.equal(W, original)
    with pytest.warns(RuntimeWarning, match=r"p \* kappa < 1"):
        so.spectral_decay_(W.clone(), 2, 0.1, 2.0, stability="warn")
    # Below the threshold nothing is reported; the Frobenius shortcut covers the common case.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        so.spectral_decay_(W.clone(), 2, 0.001, 2.0)


@pytest.mark.parametrize("method", ["gram", "auto"])
def test_clamp_keeps_the_order_with_margin_and_logs_its_factor(caplog, method):
    W = weights(scale=10.0)
    factors = []
    with caplog.at_level("WARNING", logger="spectral_ops.decay"):
        clamped = so.spectral_decay_(W.clone(), 2, 0.1, 2.0, stability="clamp", clamp_factors=factors, method=method)
    (factor,) = factors
    # The guard's s_max is an upper bound: on the Gram route above the true one by at most r^(1/32) (3
    # Gram squarings of r = 16 modes; its rounding widening, ~1e-15, aside), on a CPU's factorised
    # route ("auto": eigh) the factorisation's own, widened by r units of rounding (~4e-15). p * kappa
    # lands on 1/2 or below, never above.
    order = _top_mode_order(W, 0.1, 2.0 * float(factor), 2)
    assert 0.5 / ((16 ** (1 / 32) if method == "gram" else 1.0) * (1 + 1e-12)) <= order <= 0.5
    # The clamp is a smaller coefficient, nothing else: the exact decay with wd * factor.
    assert relative_error(clamped, reference.spectral_decay_svd(W, 2, 0.1, 2.0 * float(factor))) < 1e-12
    (record,) = caplog.records
    assert f"W (24, 16) by a factor {float(factor):.4g}" in record.getMessage()
    assert f"p * kappa was {'4.00' if method == 'gram' else '4 '}" in record.getMessage()
    assert "and is 0.5" in record.getMessage()


def test_stability_guard_applies_per_matrix_in_a_batch(caplog):
    small, large = weights(seed=1), weights(seed=2, scale=10.0)
    batch = torch.stack([small, large])
    factors = []
    with caplog.at_level("WARNING", logger="spectral_ops.decay"):
        so.spectral_decay_([small.clone(), batch], 2, 0.1, 2.0, stability="clamp", clamp_factors=factors)
    assert relative_error(batch[0], reference.spectral_decay_svd(small, 2, 0.1, 2.0)) < 1e-12
    assert relative_error(batch[1], reference.spectral_decay_svd(large, 2, 0.1, 2.0)) > 1e-3
    assert float(factors[0]) == 1.0 and factors[1].shape == (2,) and float(factors[1][0]) == 1.0
    assert [r.getMessage().split(" by ")[0] for r in caplog.records] == [
        "stability='clamp' reduced the spectral coefficient of W[1][1] (24, 16)"]


ORDER_FLIP = torch.tensor([1.0, 0.7, 0.3, 0.1], dtype=torch.float64)


def test_the_guard_checks_the_order_condition_not_only_positivity():
    """kappa = 0.8 < 1 (the old guard's condition) but p * kappa = 1.6 >= 1: every mode stays positive
    yet the top one falls to third place. f(s) = s - 0.8 s^2 maps (1, 0.7, 0.3, 0.1) to
    (0.2, 0.308, 0.228, 0.092)."""
    W = matrix_with_spectrum((6, 4), ORDER_FLIP, seed=5)
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    flipped = so.spectral_decay_(W.clone(), 2, 1.0, 0.8, stability="ignore")
    mapped = ORDER_FLIP - 0.8 * ORDER_FLIP**2
    # float64 decay against the exact per-mode map: ~1e-13 (as the SVD oracle tests above).
    assert torch.allclose(U.mT @ flipped @ Vh.mT, torch.diag(mapped), atol=1e-12)
    assert torch.allclose(torch.linalg.svdvals(flipped), mapped.sort(descending=True).values, atol=1e-12)
    assert float(U[:, 0] @ flipped @ Vh[0]) < float(torch.linalg.svdvals(flipped)[2]) + 1e-12  # third place
    with pytest.raises(so.SpectralStabilityError, match=r"reaches 1.6 >= 1 \(kappa = 0.8\)"):
        so.spectral_decay_(W.clone(), 2, 1.0, 0.8)
    # Just below the condition (p * kappa = 0.99) the guard accepts, and the order is kept.
    kept = so.spectral_decay_(W.clone(), 2, 1.0, 0.495)
    assert torch.allclose(U.mT @ kept @ Vh.mT, torch.diag(ORDER_FLIP - 0.495 * ORDER_FLIP**2), atol=1e-12)
    # At p = 4 the order condition is four times stricter than positivity: kappa = 0.3, p * kappa = 1.2.
    with pytest.raises(so.SpectralStabilityError, match=r"reaches 1.2 >= 1 \(kappa = 0.3\)"):
        so.spectral_decay_(W.clone(), 4, 1.0, 0.3)
    so.spectral_decay_(W.clone(), 4, 1.0, 0.2475)  # p * kappa = 0.99


def test_a_capturable_clamp_gives_the_eager_factors_without_a_host_read(caplog):
    from test_optim_capturable import host_reads_forbidden

    # p * kappa = 3 * 0.01 * 0.5 * s_max^2: 0.015 (kept), 1.5 (clamped), and a batched weight with one of each.
    tensors = [weights(seed=1), weights(seed=2, scale=10.0),
               torch.stack([weights((12, 8), seed=3), weights((12, 8), seed=4, scale=10.0)])]
    eager, capturable = [], []
    eager_result = so.spectral_decay_([t.clone() for t in tensors], 3, 0.01, 0.5, stability="clamp",
                                      clamp_factors=eager)
    caplog.clear()
    with caplog.at_level("WARNING", logger="spectral_ops.decay"), host_reads_forbidden():
        # float64 coefficients: the eager call's Python floats, exactly.
        lr, coefficient = torch.tensor(0.01, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
        captured = so.spectral_decay_([t.clone() for t in tensors], 3, lr, coefficient, stability="clamp",
                                      capturable=True, clamp_factors=capturable)
    assert not caplog.records  # nothing can be logged without reading the factors on the host
    # The same float64 arithmetic on the same bounds: equal factors.
    assert len(eager) == len(capturable) == len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(eager, capturable))
    assert [(f < 1).tolist() for f in eager] == [False, True, [False, True]]
    assert all(relative_error(a, b) < 1e-12 for a, b in zip(eager_result, captured))


def test_weight_decay_is_a_deprecated_alias_of_spectral_weight_decay():
    W = matrix_with_spectrum((20, 12), log_spaced_spectrum(12, 10), torch.float64, seed=3)
    expected = so.spectral_decay_(W.clone(), 2, 0.1, spectral_weight_decay=0.2)
    with pytest.warns(DeprecationWarning, match="pass the spectral coefficient lambda_p as spectral_weight_decay"):
        aliased = so.spectral_decay_(W.clone(), 2, 0.1, weight_decay=0.2)
    assert torch.equal(aliased, expected)
    with pytest.raises(TypeError, match="both spectral_weight_decay and weight_decay"):
        so.spectral_decay_(W.clone(), 2, 0.1, 0.2, weight_decay=0.2)
    with pytest.raises(TypeError, match="needs spectral_weight_decay"):
        so.spectral_decay_(W.clone(), 2, 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_multiply_rounds_each_product_once(dtype):
    # An in-place multi-tensor multiply would round 0.97 to 0.96875 in bf16 first.
    from spectral_ops.decay import multiply_

    tensors = [torch.full((5,), 0.1172, dtype=dtype), torch.randn(3, 4).to(dtype)]
    expected = [(t.float() * 0.97).to(dtype) for t in tensors]
    multiply_(tensors, 0.97)
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want)


def test_a_schedule_under_the_decoupled_convention_is_refused_not_ignored():
    W = torch.randn(6, 4)
    before = W.clone()
    with pytest.raises(ValueError, match="schedule= is used only with convention='independent'"):
        so.spectral_decay_(W, 2, 0.1, 0.1, schedule=0.5)
    assert torch.equal(W, before)


# ----- property: any layout, any list, all or nothing

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LAYOUTS = ("contiguous", "transposed", "row_slice", "strided", "batch_slice", "interleaved", "overlapping")


def _laid_out(layout: str, shape, dtype, seed: int):
    """A ``shape`` weight (a well-conditioned spectrum) stored in ``layout``, and the base tensor that
    owns its memory (whose other elements the decay must not touch)."""
    m, n = shape
    W = weights((m, n), dtype, seed=seed)
    if layout == "contiguous":
        return W, W
    if layout == "transposed":
        base = W.mT.contiguous()
        return base.mT, base
    if layout == "row_slice":  # rows in the middle of a taller matrix
        base = torch.randn(m + 3, n, dtype=dtype)
        base[1:m + 1] = W
        return base[1:m + 1], base
    if layout == "strided":  # every other column
        base = torch.randn(m, 2 * n, dtype=dtype)
        base[:, ::2] = W
        return base[:, ::2], base
    if layout == "batch_slice":  # one matrix of a batch
        base = torch.randn(3, m, n, dtype=dtype)
        base[1] = W
        return base[1], base
    if layout == "interleaved":  # as_strided's: strides (n + 1, m + 1) share nothing, and their dims do not nest
        strides = (n + 1, m + 1) if math.gcd(n + 1, m + 1) == 1 else (n + 2, m + 1) if math.gcd(n + 2, m + 1) == 1 \
            else (n + 1, m + 2)
        base = torch.randn((m - 1) * strides[0] + (n - 1) * strides[1] + 1, dtype=dtype)
        base.as_strided((m, n), strides).copy_(W)
        return base.as_strided((m, n), strides), base
    base = torch.randn(m + n - 1, dtype=dtype)  # overlapping: element (i, j) is base[i + j]
    return base.as_strided((m, n), (1, 1)), base


@settings(max_examples=60, deadline=None, derandomize=True)
@given(layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=3),
       shape=st.tuples(st.integers(2, 9), st.integers(2, 9)),
       p=st.integers(0, 4),
       dtype=st.sampled_from([torch.float64, torch.float32]),
       share_base=st.booleans())
def test_any_layout_and_list_is_decayed_exactly_or_refused_untouched(layouts, shape, p, dtype, share_base):
    """Each weight of a list, in any layout, gets the SVD oracle's decay (to the dtype's tolerance of
    this module) and nothing around it changes; a list whose weights overlap in memory, or with a weight
    whose elements share memory, is refused with every weight and its base bitwise unchanged."""
    laid = [_laid_out(layout, shape, dtype, seed) for seed, layout in enumerate(layouts)]
    if share_base and len(laid) > 1:  # the same weight twice: overlapping memory
        laid.append(laid[0])
    tensors = [W for W, _ in laid]
    bases = [base.clone() for _, base in laid]
    expected = [reference.spectral_decay_svd(W, p, 0.05, 0.2, 0.1) for W in tensors]
    if "overlapping" in layouts or share_base and len(laid) > 1:
        with pytest.raises(ValueError, match="share memory" if "overlapping" in layouts else "overlap in memory"):
            so.spectral_decay_(tensors, p, 0.05, 0.2, ordinary_weight_decay=0.1)
        assert all(torch.equal(base, before) for (_, base), before in zip(laid, bases))
        return
    so.spectral_decay_(tensors, p, 0.05, 0.2, ordinary_weight_decay=0.1)
    for (W, base), before, want in zip(laid, bases, expected):
        assert relative_error(W, want) < TOLERANCE[dtype]
        outside = torch.ones_like(base, dtype=torch.bool)
        outside.view(-1)[_offsets(W, base)] = False
        assert torch.equal(base[outside], before[outside])


def _offsets(W: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The flat positions in ``base`` of ``W``'s elements (``W`` is a view of the contiguous ``base``)."""
    index = torch.arange(base.numel()).view(base.shape)
    return torch.as_strided(index, W.shape, W.stride(), W.storage_offset() - base.storage_offset())


# ----- the decay costs its direction's FLOPs (issue #28): the guard reads the plan's own Gram

FLOP_SHAPES = [(96, 32), (32, 96), (48, 48), (3, 64, 24)]  # tall, wide, square, batched


def _flops(call) -> int:
    from torch.utils.flop_counter import FlopCounterMode  # imports triton: not at collection time

    with FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", FLOP_SHAPES)
@pytest.mark.parametrize("p", range(5))
@pytest.mark.parametrize("mode", ["raise", "clamp", "capturable"])
def test_a_decay_costs_its_direction_and_at_most_three_squarings(mode, p, shape):
    """The guard's s_max bound comes from the plan's own Gram and at most three squarings of it
    (6 r^3 per matrix, counted in full as torch counts them): never a second Gram. Where ||W||_F
    settles the guard (a small lr) an eager decay costs exactly its direction; where it does not
    (a lr for which ||W||_F says p kappa >= 1 but s_max does not: a flat spectrum, ||W||_F ~ sqrt(r)
    s_max) the bound is formed. A capturable step forms it always."""
    *batch, m, n = shape
    r, matrices = min(m, n), max(1, torch.Size(batch).numel())
    W = weights(shape, torch.float32, condition=2.0)
    direction = _flops(lambda: so.spectral_power(W, p, method="gram"))
    stability = "clamp" if mode == "capturable" else mode
    capturable = mode == "capturable"
    # s_max = 1 and ||W||_F >= sqrt(r) / 2 (the spectrum spans [1/2, 1]): lr = 0.5 / p makes p kappa
    # 0.5 at s_max, and >= 0.5 (sqrt(r) / 2)^(p - 1) >= 1.2 by the Frobenius bound for p >= 2, r >= 24.
    for lr, settled in ((1e-6, True), (0.5 / max(p, 1), p < 2)):
        decayed = W.clone()
        flops = _flops(lambda: so.spectral_decay_(decayed, p, lr, 1.0, stability=stability, capturable=capturable,
                                                  method="gram"))
        extra = flops - direction
        if p < 2 or (settled and not capturable):
            assert extra == 0
        else:  # the Gram (the direction's own) may settle it; else up to three squares of it
            assert 0 <= extra <= 6 * r**3 * matrices
            if capturable:  # every square up to G^8 but those the direction's G^(p // 2) forms itself
                assert extra == 2 * r**3 * matrices * (3 - ((p // 2).bit_length() - 1))


def test_a_bands_former_coefficient_name_still_works_with_a_deprecation_warning():
    """Checkpoints and configs written before the rename hold ``weight_decay_bot``: it still means the
    bottom band's lambda, with a warning that names the new field; both at once is refused."""
    with pytest.warns(DeprecationWarning, match="spectral_weight_decay_bot"):
        old = so.Band(1.0, "two_band", weight_decay_bot=0.3)
    with pytest.warns(DeprecationWarning):
        from_dict = so.Band.coerce({"tau": 1.0, "mode": "two_band", "weight_decay_bot": 0.3})
    assert old == from_dict == so.Band(1.0, "two_band", spectral_weight_decay_bot=0.3)
    with pytest.raises(TypeError, match="both"):
        so.Band(1.0, spectral_weight_decay_bot=0.1, weight_decay_bot=0.3)


# ----- the routes: a decay computes its direction as plan.route says, by iteration or factorisation

DECAY_FORMS = {
    "p0": dict(p=0), "p2": dict(p=2), "p3": dict(p=3), "prox": dict(p=0, p0_mode="prox"),
    "band-top": dict(p=2, band=so.Band(0.6)),
    "two-band": dict(p=2, band=so.Band(0.6, "two_band", p_bot=0, spectral_weight_decay_bot=0.05)),
    "clip": dict(p=1, band=so.Band(0.6, "clip")),
}


def decay_increment_oracle(W, form, lr, wd, ordinary):
    """The FP64 SVD's step of every form, each term formed as such: ``-lr (wd D + ordinary W)`` with ``D``
    the form's direction (two_band weights its bands itself; prox: the soft-threshold less ``W``, which
    is ``-U diag(min(s, lr wd)) V^T``)."""
    band, W64 = form.get("band"), W.double()
    if form.get("p0_mode") == "prox":
        U, s, Vh = torch.linalg.svd(W64, full_matrices=False)
        spectral = (U * s.clamp_max(lr * wd)[..., None, :]) @ Vh
    elif band is None:
        spectral = lr * wd * reference.spectral_power_svd(W64, form["p"])
    elif band.mode == "two_band":
        spectral = lr * reference.band_direction_svd(W64, band.tau, form["p"], "two_band", p_bot=band.p_bot,
                                                     lambda_top=wd, lambda_bot=band.spectral_weight_decay_bot)
    else:
        spectral = lr * wd * reference.band_direction_svd(W64, band.tau, form["p"], band.mode)
    return -spectral - lr * ordinary * W64


def decay_oracle(W, form, lr, wd, ordinary):
    """The FP64 SVD's decay of every form: ``W`` plus :func:`decay_increment_oracle`."""
    return W.double() + decay_increment_oracle(W, form, lr, wd, ordinary)


@pytest.mark.parametrize("method", ["auto", "gram", "svd", "eigh"])
@pytest.mark.parametrize("form", list(DECAY_FORMS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_route_decays_to_the_svd_oracle(dtype, form, method):
    """Every form on every route against the FP64 SVD (kappa 10, where eigh's ``1 / s`` at ``p = 0`` is
    accurate to ``eps kappa^2``, within the budget): the tolerance of the iterations' chain bounds the
    factorisations, which round once per product of a backward-stable decomposition."""
    W = weights(dtype=dtype, seed=5)
    lr, wd, ordinary = 0.05, 0.2, 0.1
    decayed = W.clone()
    so.spectral_decay_(decayed, lr=lr, spectral_weight_decay=wd, ordinary_weight_decay=ordinary, method=method,
                       **DECAY_FORMS[form])
    assert relative_error(decayed, decay_oracle(W, DECAY_FORMS[form], lr, wd, ordinary)) < TOLERANCE[dtype]


@pytest.mark.parametrize("form, factorisation", [("p2", "eigh"), ("p3", "gram"), ("p0", "svd"), ("prox", "svd"),
                                                 ("band-top", "svd"), ("two-band", "svd")])
def test_on_a_cpu_auto_factorises_where_that_is_faster(form, factorisation):
    """plan.route's CPU choice for a decay (docs/backends.md): eigh for S_p with an even p >= 2 and the Gram
    route for p = 3 (X G, products alone: fewer than eigh's) (p = 0 at 24 x 16
    is below Polar Express's winning sides: the SVD), the SVD for every thresholded form. Bit for bit:
    "auto" is that route, not a similar one."""
    W = weights(dtype=torch.float32, seed=6)
    auto, chosen = W.clone(), W.clone()
    so.spectral_decay_(auto, lr=0.05, spectral_weight_decay=0.2, **DECAY_FORMS[form])
    so.spectral_decay_(chosen, lr=0.05, spectral_weight_decay=0.2, method=factorisation, **DECAY_FORMS[form])
    assert torch.equal(auto, chosen)


def test_a_factorised_decay_clamps_by_its_own_s_max():
    """A factorised route bounds s_max by the factorisation's own (widened by r units of fp32 rounding),
    so its clamp lands on p * kappa = 1/2 of the true s_max, eager or capturable ("auto" factorises
    under capturable on a CPU); the Gram route's bound, from Gram squarings, is never below it, so it
    clamps at least as much."""
    W = weights((3, 24, 16), torch.float32, seed=7, scale=4.0)
    lr, wd, p = 1.0, 0.5, 2
    exact = 0.5 / (p * lr * wd * torch.linalg.matrix_norm(W.double(), 2) ** (p - 1))

    def clamp(**options):
        factors = []
        so.spectral_decay_(W.clone(), p, lr, wd, stability="clamp", clamp_factors=factors, **options)
        return factors[0]

    for options in ({"method": "eigh"}, {"method": "svd"}, {"capturable": True}):
        assert torch.allclose(clamp(**options), exact, rtol=1e-5)
    assert (clamp(method="gram") <= exact * (1 + 1e-5)).all() and (clamp(method="gram") < 1).all()


def test_a_factorisation_is_refused_where_the_host_may_not_be_read():
    W = weights(dtype=torch.float32)
    for method in ("svd", "eigh"):
        with pytest.raises(ValueError, match="capturable=True needs method='gram' or 'auto'"):
            so.spectral_decay_(W, 2, 0.1, 0.1, stability="clamp", capturable=True, method=method)
    with pytest.raises(ValueError, match="method must be one of"):
        so.spectral_decay_(W, 2, 0.1, 0.1, method="qr")


@pytest.mark.parametrize("form", ["p2", "prox", "band-top"])
def test_the_out_of_place_decay_is_the_in_place_one_on_a_copy(form):
    """spectral_decay returns what spectral_decay_ writes, bit for bit, for a tensor and a list, with
    the same clamp factors, and leaves its input alone; a refused call refuses the same way."""
    W = weights((2, 24, 16), torch.float32, seed=9, scale=4.0)
    lone = weights((16, 24), torch.float32, seed=10)
    options = dict(lr=0.3, spectral_weight_decay=0.5, stability="clamp", **DECAY_FORMS[form])
    before, lone_before = W.clone(), lone.clone()
    factors, in_place_factors = [], []
    result = so.spectral_decay(W, clamp_factors=factors, **options)
    expected = W.clone()
    so.spectral_decay_(expected, clamp_factors=in_place_factors, **options)
    assert torch.equal(result, expected) and torch.equal(W, before)
    assert all(torch.equal(a, b) for a, b in zip(factors, in_place_factors))
    results = so.spectral_decay([W, lone], **options)
    expected = [W.clone(), lone.clone()]
    so.spectral_decay_(expected, **options)
    assert all(torch.equal(a, b) for a, b in zip(results, expected))
    assert torch.equal(W, before) and torch.equal(lone, lone_before)
    with pytest.raises(so.SpectralStabilityError):
        so.spectral_decay(W, p=2, lr=1.0, spectral_weight_decay=5.0)


@pytest.mark.parametrize("form", ["p1", "p0", "p2", "p3", "band-top", "two-band"])
def test_the_increment_is_the_step_without_cancellation(form):
    """W + increment is the decayed value to a rounding of it; and at an lr far below fp32's rounding of
    W (1e-12), where the decayed value equals W and their difference is 0, the increment is the exact
    step (the FP64 SVD's) to fp32 accuracy, because each of its terms is formed as such."""
    options = dict(DECAY_FORMS.get(form, {"p": 1}), spectral_weight_decay=0.2, ordinary_weight_decay=0.1)
    W = weights(dtype=torch.float32, seed=11)
    step = so.spectral_decay(W, lr=0.05, increment=True, **options)
    decayed = so.spectral_decay(W, lr=0.05, **options)
    eps = torch.finfo(torch.float32).eps
    assert (W + step - decayed).abs().max() <= 4 * eps * decayed.abs().max()
    lr = 1e-12
    tiny = so.spectral_decay(W, lr=lr, increment=True, **options)
    assert torch.equal(so.spectral_decay(W, lr=lr, **options), W)  # the new value itself rounds back to W
    form = {key: value for key, value in options.items() if key in ("p", "band", "p0_mode")}
    assert relative_error(tiny, decay_increment_oracle(W, form, lr, 0.2, 0.1)) < TOLERANCE[torch.float32]


def test_a_soft_thresholds_increment_is_refused():
    with pytest.raises(ValueError, match="not available with p0_mode='prox'"):
        so.spectral_decay(weights(), 0, 0.1, 0.1, p0_mode="prox", increment=True)


# --- which matrices a tensor holds (SPEC 1.8) -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 24, 16), (2, 2, 24, 16)])
def test_batch_decays_each_matrix_of_a_stack_and_flatten_one_matrix(shape):
    # fp32 weights: the tolerance of a float32 decay (see TOLERANCE), against the FP64 SVD of each
    # reading. The two readings differ by far more than that, so the test tells them apart.
    W = weights(shape, torch.float32)
    batched = so.spectral_decay_(W.clone(), 2, 0.05, 0.2, matrix_view="batch")
    flattened = so.spectral_decay_(W.clone(), 2, 0.05, 0.2, matrix_view="flatten")
    if len(shape) == 3:  # a 3-D tensor is a stack unsaid, as in torch.linalg
        assert torch.equal(batched, so.spectral_decay_(W.clone(), 2, 0.05, 0.2))
    assert relative_error(batched, reference.spectral_decay_svd(W, 2, 0.05, 0.2)) < TOLERANCE[torch.float32]
    as_one = reference.spectral_decay_svd(W.reshape(shape[0], -1), 2, 0.05, 0.2).reshape(shape)
    assert relative_error(flattened, as_one) < TOLERANCE[torch.float32]
    assert relative_error(batched, flattened) > 1e-2


def test_a_conv_filter_flattened_is_decayed_as_its_output_by_input_matrix():
    W = weights((16, 48), torch.float32).reshape(16, 3, 4, 4)  # (out, in, kh, kw)
    so.spectral_decay_(decayed := W.clone(), 0, 0.05, 0.2, matrix_view="flatten")
    expected = reference.spectral_decay_svd(W.reshape(16, 48), 0, 0.05, 0.2).reshape(W.shape)
    assert relative_error(decayed, expected) < TOLERANCE[torch.float32]


def test_matrix_view_is_checked_before_anything_is_written():
    W = weights((4, 24, 16))
    original = W.clone()
    with pytest.raises(ValueError, match="matrix_view must be one of"):
        so.spectral_decay_(W, 2, 0.05, 0.2, matrix_view="experts")
    assert torch.equal(W, original)


# Issue #43: a conv filter was decayed per 3x3 kernel position, 0.74 off its (out, in * kh * kw) reading.
FILTER = (16, 8, 3, 3)


@pytest.mark.parametrize("call", [
    lambda W: so.spectral_decay_(W, 2, 0.02, 0.5),
    lambda W: so.spectral_decay(W, 2, 0.02, 0.5),
    lambda W: so.spectral_decay_([weights((16, 72), torch.float32), W], 2, 0.02, 0.5),
], ids=["in-place", "out-of-place", "in-a-list"])
def test_a_filter_of_four_dims_is_refused_unless_its_matrix_view_is_said(call):
    W = weights((16, 72), torch.float32).reshape(FILTER)
    original = W.clone()
    with pytest.raises(ValueError, match=r"\(16, 8, 3, 3\): say which matrices it holds with matrix_view="):
        call(W)
    assert torch.equal(W, original)


def test_a_flattened_filter_is_the_decay_of_its_matrix_against_the_svd():
    W = weights((16, 72), torch.float32).reshape(FILTER)
    expected = reference.spectral_decay_svd(W.reshape(16, 72), 2, 0.02, 0.5).reshape(FILTER)
    decayed = so.spectral_decay_(W.clone(), 2, 0.02, 0.5, matrix_view="flatten")
    assert relative_error(decayed, expected) < TOLERANCE[torch.float32]
    # The step the silent reading took instead, per 3 x 3 kernel position, is another step altogether.
    per_kernel = so.spectral_decay_(W.clone(), 2, 0.02, 0.5, matrix_view="batch")
    assert relative_error(per_kernel - W, expected - W) > 0.5


@pytest.mark.parametrize("p", [0, 2])
def test_a_channels_last_filter_is_decayed_through_a_copy_as_its_contiguous_twin(p):
    # The flatten reading of a channels-last filter is no view of it: the decay runs in a contiguous copy
    # and writes it back, with the same arithmetic, so the result is the contiguous twin's bit for bit.
    W = weights((16, 72), torch.float32).reshape(FILTER)
    twin = so.spectral_decay_(W.clone(), p, 0.02, 0.5, matrix_view="flatten")
    channels_last = W.to(memory_format=torch.channels_last)
    storage = channels_last.data_ptr()
    so.spectral_decay_(channels_last, p, 0.02, 0.5, matrix_view="flatten")
    assert channels_last.data_ptr() == storage and channels_last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(channels_last, twin)
    assert torch.equal(so.spectral_decay(W.to(memory_format=torch.channels_last), p, 0.02, 0.5,
                                         matrix_view="flatten"), twin)


def test_a_failed_channels_last_decay_writes_nothing():
    # The guard refuses the step after the copy is made: the filter keeps its bits.
    W = weights((16, 72), torch.float32, condition=1e3, scale=100.0).reshape(FILTER)
    channels_last = W.to(memory_format=torch.channels_last)
    with pytest.raises(so.SpectralStabilityError):
        so.spectral_decay_(channels_last, 3, 1.0, 1.0, matrix_view="flatten", stability="raise")
    assert torch.equal(channels_last, W)


def test_a_one_by_one_convolution_is_its_matrix_without_matrix_view():
    # Read as a stack, its matrices would be 1 x 1, whose spectral power is element-wise: only the
    # (out, in) reading is a spectral decay, so none is asked for.
    W = weights((16, 8), torch.float32)
    decayed = so.spectral_decay_(W.clone().reshape(16, 8, 1, 1), 2, 0.02, 0.5)
    assert torch.equal(decayed.reshape(16, 8), so.spectral_decay_(W.clone(), 2, 0.02, 0.5))


# --- stochastic rounding ----------------------------------------------------------------------------------------


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The gap between ``x`` (bf16/fp16) and its neighbour away from zero, in float64."""
    away = (x.view(torch.int16) + 1).view(x.dtype)  # magnitude + 1 unit, same sign
    return (away.double() - x.double()).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased_over_many_draws(dtype):
    # A step of a tenth of the weights' unit: rounding to nearest loses all of it, stochastic rounding
    # keeps it on average. The exact value is the fp32 decay of the same weights (precision="fp32":
    # the same arithmetic as for the bf16/fp16 weights up to the final rounding, which the test then
    # isolates). Each draw is within one unit of it, so the mean of N draws is within 5 sigma =
    # 5 ulp / (2 sqrt(N)) of it, element by element (2,048 elements: a 5-sigma miss has odds ~1e-3).
    W = weights((64, 32), torch.float32).to(dtype)
    lr = 0.1 * float(_ulp(W).min()) / float(W.double().abs().max()) / 0.2
    exact = so.spectral_decay(W.float(), 2, lr, 0.2, precision="fp32").double()
    draws = 400
    generator = torch.Generator().manual_seed(0)
    total = torch.zeros_like(exact)
    for _ in range(draws):
        rounded = so.spectral_decay(W, 2, lr, 0.2, precision="fp32", rounding="stochastic", generator=generator)
        assert ((rounded.double() - exact).abs() <= _ulp(W)).all()
        total += rounded.double()
    bound = 5 * _ulp(W) / (2 * draws**0.5)
    assert ((total / draws - exact).abs() <= bound).all()
    nearest = so.spectral_decay(W, 2, lr, 0.2, precision="fp32")
    assert torch.equal(nearest, W), "the step was meant to be below half a unit"


def test_stochastic_rounding_is_reproducible_per_seed_and_the_same_captured():
    W = weights((4, 24, 16), torch.float32).bfloat16()

    def decayed(seed, **options):
        generator = torch.Generator().manual_seed(seed)
        return so.spectral_decay(W, 2, 1e-3, 0.1, rounding="stochastic", generator=generator, **options)

    assert torch.equal(decayed(3), decayed(3))
    assert not torch.equal(decayed(3), decayed(4))
    # capturable: no host read, the same bits from the same generator state (a CPU has no graph to
    # capture; a CUDA generator advances its offset on the device, which torch's graphs replay).
    assert torch.equal(decayed(3, capturable=True, stability="clamp"), decayed(3))
    torch.manual_seed(5)
    default = so.spectral_decay(W, 2, 1e-3, 0.1, rounding="stochastic")
    torch.manual_seed(5)
    assert torch.equal(default, so.spectral_decay(W, 2, 1e-3, 0.1, rounding="stochastic"))


def test_stochastic_rounding_leaves_wider_weights_as_computed_and_reaches_the_plain_decay():
    W = weights((24, 16), torch.float32)
    assert torch.equal(so.spectral_decay(W, 2, 1e-3, 0.1, rounding="stochastic"), so.spectral_decay(W, 2, 1e-3, 0.1))
    # p = 1 needs no direction, but a bf16 weight still rounds stochastically: a shrink by 1e-3, below
    # half of bf16's relative unit (2^-9 to 2^-8), which rounding to nearest loses, moves a weight
    # down with odds of 1/8 to 1/4 per draw: after 64 draws, all but a few weights have moved.
    bf16 = W.bfloat16()
    ordinary = torch.stack([so.spectral_decay(bf16, 1, 1e-2, 0.1, rounding="stochastic",
                                              generator=torch.Generator().manual_seed(seed)) for seed in range(64)])
    assert torch.equal(so.spectral_decay(bf16, 1, 1e-2, 0.1), bf16)
    assert (ordinary.double().mean(0).abs() < bf16.double().abs()).float().mean() > 0.9


def test_the_rounding_and_its_generator_are_checked_first():
    W = weights((24, 16), torch.float32).bfloat16()
    original = W.clone()
    with pytest.raises(ValueError, match="rounding must be one of"):
        so.spectral_decay_(W, 2, 1e-3, 0.1, rounding="truncate")
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        so.spectral_decay_(W, 2, 1e-3, 0.1, rounding="stochastic", generator=5)
    assert torch.equal(W, original)


# --- bf16 weights with their mantissa ---------------------------------------------------------------------------


def _pair(shape, seed=0):
    """A bf16 weight and its uint16 mantissa holding an fp32 value (modded-nanogpt's layout), and that value."""
    from spectral_ops.decay import split_mantissa_

    value = weights(shape, torch.float32, seed=seed)
    W, mantissa = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.uint16)
    split_mantissa_(value, W, mantissa)
    return W, mantissa, value


@pytest.mark.parametrize("shape, matrix_view", [((24, 16), "batch"), ((4, 24, 16), "batch"), ((4, 24, 16), "flatten")])
def test_a_decayed_pair_is_the_decayed_fp32_value_split_bit_for_bit(shape, matrix_view):
    from spectral_ops.decay import split_mantissa_, with_mantissa

    W, mantissa, value = _pair(shape)
    assert torch.equal(with_mantissa(W, mantissa), value)  # the round trip is exact
    assert torch.equal(W, value.to(torch.bfloat16, copy=True).view(torch.int16).sub(
        (value.bfloat16().float().abs() > value.abs()).to(torch.int16)).view(torch.bfloat16))  # W: truncated value
    so.spectral_decay_(W, 2, 1e-3, 0.1, mantissa=mantissa, matrix_view=matrix_view)
    expected = so.spectral_decay_(value.clone(), 2, 1e-3, 0.1, matrix_view=matrix_view)
    expected_W, expected_mantissa = torch.empty_like(W), torch.empty_like(mantissa)
    split_mantissa_(expected, expected_W, expected_mantissa)
    assert torch.equal(W, expected_W) and torch.equal(mantissa, expected_mantissa)


def test_a_list_of_pairs_and_the_mantissas_checks():
    pairs = [_pair((24, 16), seed) for seed in range(3)]
    weights_, mantissas = [W for W, _, _ in pairs], [m for _, m, _ in pairs]
    originals = [(W.clone(), m.clone()) for W, m in zip(weights_, mantissas)]
    for bad, error, match in [
        (dict(mantissa=mantissas[:2]), ValueError, "one tensor per weight"),
        (dict(mantissa=[m.float() for m in mantissas]), TypeError, "must be uint16 or int16"),
        (dict(mantissa=[m[:, :8] for m in mantissas]), ValueError, "must match its weight"),
        (dict(mantissa=mantissas, rounding="stochastic"), ValueError, "nothing to round"),
        (dict(mantissa=mantissas, lr=100.0, stability="raise", p=4), so.SpectralStabilityError, None),
    ]:
        options = {"p": 2, "lr": 1e-3, **bad}
        with pytest.raises(error, match=match):
            so.spectral_decay_(weights_, options.pop("p"), options.pop("lr"), 1.0, **options)
        assert all(torch.equal(W, a) and torch.equal(m, b) for W, m, (a, b) in zip(weights_, mantissas, originals))
    with pytest.raises(TypeError, match="bf16 weights"):
        so.spectral_decay_([W.float() for W in weights_], 2, 1e-3, 0.1, mantissa=mantissas)
    with pytest.raises(ValueError, match="does not take mantissa"):
        so.spectral_decay(weights_, 2, 1e-3, 0.1, mantissa=mantissas)
    so.spectral_decay_(weights_, 2, 1e-3, 0.1, mantissa=[m.view(torch.int16) for m in mantissas])  # int16 works too
    assert not torch.equal(mantissas[0], originals[0][1])


def test_the_clipped_decay_pulls_each_mode_above_the_threshold_by_its_excess():
    # s -> s - c (s - beta)_+ with c = lr lambda (Emerging-Optimizers' spectral_clipped_weight_decay);
    # c = 1 is the hard cap at beta, spectral_clip(max=beta).
    W = weights((24, 16), seed=6, scale=3.0)
    beta = 1.0
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    for lr, wd in ((0.1, 0.5), (1.0, 1.0)):
        c = lr * wd
        expected = (U * (s - c * (s - beta).clamp_min(0))[..., None, :]) @ Vh
        decayed = so.spectral_decay(W, 1, lr, wd, band={"tau": beta, "mode": "clip"})
        assert relative_error(decayed, expected) < TOLERANCE[torch.float64]
    assert relative_error(decayed, so.spectral_clip(W, max=beta)) < TOLERANCE[torch.float64]
    with pytest.raises(ValueError, match="pass p=1"):
        so.spectral_decay_(W.clone(), 2, 0.1, 0.5, band={"tau": beta, "mode": "clip"})
