"""The in-place decay step (SPEC 1.5) against its out-of-place definition and the SVD oracle."""

import warnings

import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error

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
                                                            "weight_decay_bot": 0.3})
    expected = W - 0.1 * reference.band_direction_svd(W, tau, 2, "two_band", p_bot=0, lambda_top=0.5, lambda_bot=0.3)
    assert relative_error(two, expected) < 1e-10
    with pytest.raises(ValueError, match="unknown band options"):
        so.spectral_decay_(W.clone(), 2, 0.1, 0.5, band={"tau": 1.0, "p_top": 2})
    with pytest.raises(ValueError, match="prox"):
        so.spectral_decay_(W.clone(), 0, 0.1, 0.5, band=so.Band(1.0), p0_mode="prox")


def test_stability_guard():
    W = weights(scale=10.0)  # s_max = 10: lr * wd * s_max = 2 > 1 for p = 2
    original = W.clone()
    with pytest.raises(so.SpectralStabilityError, match="unstable"):
        so.spectral_decay_(W, 2, 0.1, 2.0)
    assert torch.equal(W, original)
    with pytest.warns(RuntimeWarning, match="unstable"):
        so.spectral_decay_(W.clone(), 2, 0.1, 2.0, stability="warn")
    clamped = so.spectral_decay_(W.clone(), 2, 0.1, 2.0, stability="clamp")
    s_before, s_after = torch.linalg.svdvals(original), torch.linalg.svdvals(clamped)
    assert (s_after > 0).all() and (s_after <= s_before).all()
    assert s_after[0] >= 0.5 * s_before[0] * (1 - 1e-12), "clamp shrinks the top mode by at most half"
    # Below the threshold nothing is reported; the Frobenius shortcut covers the common case.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        so.spectral_decay_(W.clone(), 2, 0.001, 2.0)


def test_stability_guard_applies_per_matrix_in_a_batch():
    small, large = weights(seed=1), weights(seed=2, scale=10.0)
    batch = torch.stack([small, large])
    so.spectral_decay_(batch, 2, 0.1, 2.0, stability="clamp")
    assert relative_error(batch[0], reference.spectral_decay_svd(small, 2, 0.1, 2.0)) < 1e-12
    assert relative_error(batch[1], reference.spectral_decay_svd(large, 2, 0.1, 2.0)) > 1e-3


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

LAYOUTS = ("contiguous", "transposed", "row_slice", "strided", "batch_slice")


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
    base = torch.randn(3, m, n, dtype=dtype)  # one matrix of a batch
    base[1] = W
    return base[1], base


@settings(max_examples=60, deadline=None, derandomize=True)
@given(layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=3),
       shape=st.tuples(st.integers(2, 9), st.integers(2, 9)),
       p=st.integers(0, 4),
       dtype=st.sampled_from([torch.float64, torch.float32]),
       share_base=st.booleans())
def test_any_layout_and_list_is_decayed_exactly_or_refused_untouched(layouts, shape, p, dtype, share_base):
    """Each weight of a list, in any layout, gets the SVD oracle's decay (to the dtype's tolerance of
    this module) and nothing around it changes; a list whose weights overlap in memory is refused
    with every weight and its base bitwise unchanged."""
    laid = [_laid_out(layout, shape, dtype, seed) for seed, layout in enumerate(layouts)]
    if share_base and len(laid) > 1:  # the same weight twice: overlapping memory
        laid.append(laid[0])
    tensors = [W for W, _ in laid]
    bases = [base.clone() for _, base in laid]
    expected = [reference.spectral_decay_svd(W, p, 0.05, 0.2, 0.1) for W in tensors]
    if share_base and len(laid) > 1:
        with pytest.raises(ValueError, match="overlap in memory"):
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
