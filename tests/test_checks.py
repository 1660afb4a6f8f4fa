"""Bad input raises a precise error before anything is computed or written."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spectral_ops as so
from spectral_ops._checks import overlaps_itself


def good(seed=0):
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))


PUBLIC_OPS = {
    "polar": lambda W: so.polar(W),
    "spectral_power": lambda W: so.spectral_power(W, 2),
    "power_update": lambda W: so.power_update(W, 0.5),
    "band_projectors": lambda W: so.band_projectors(W, 1.0),
    "band_direction": lambda W: so.band_direction(W, 1.0, 2),
    "svt": lambda W: so.svt(W, 1.0),
    "spectral_clip": lambda W: so.spectral_clip(W, max=1.0),
    "spectral_decay_": lambda W: so.spectral_decay_(W, 2, 0.1, 0.1),
    "spectral_norm_bounds": lambda W: so.spectral_norm_bounds(W),
}


@pytest.mark.parametrize("op", PUBLIC_OPS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.complex64, torch.bool])
def test_integer_and_complex_dtypes(op, dtype):
    with pytest.raises(TypeError, match="dtype"):
        PUBLIC_OPS[op](torch.ones(4, 3, dtype=dtype))


@pytest.mark.parametrize("op", PUBLIC_OPS)
def test_fewer_than_two_dimensions(op):
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        PUBLIC_OPS[op](torch.ones(5))


@pytest.mark.parametrize("op", PUBLIC_OPS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf(op, bad):
    W = good()
    W[3, 2] = bad
    original = W.clone()
    with pytest.raises(ValueError, match="NaN or Inf"):
        PUBLIC_OPS[op](W)
    assert torch.equal(W.isnan(), original.isnan()) and torch.equal(W.nan_to_num(), original.nan_to_num())


def test_not_a_tensor():
    with pytest.raises(TypeError, match="torch.Tensor"):
        so.polar([[1.0, 2.0], [3.0, 4.0]])


@pytest.mark.parametrize("p, match", [(float("inf"), "finite real"), (float("nan"), "finite real"),
                                      (True, "real number, got True"), ("2", "real number, got '2'")])
def test_invalid_power(p, match):
    W = good()
    for call in (lambda: so.spectral_power(W, p), lambda: so.spectral_decay_(W, p, 0.1, 0.1)):
        with pytest.raises(ValueError, match=match):
            call()
    assert torch.equal(W, good())


def test_a_negative_power_needs_its_floor_and_is_never_a_decay():
    W = good()
    with pytest.raises(ValueError, match="needs a floor: pass eps"):
        so.spectral_power(W, -0.25)
    for p in (-0.25, 0.5):  # a floor is optional for p >= 0, and checked where given
        for eps in (0.0, -1e-3, float("inf"), True):
            with pytest.raises(ValueError, match="eps must be a finite number > 0"):
                so.spectral_power(W, p, eps=eps)
    with pytest.raises(ValueError, match="cannot be a decay"):
        so.spectral_decay_(W, -0.25, 0.1, 0.1)
    assert torch.equal(W, good())


@pytest.mark.parametrize("p", [0, 2, 3])
def test_an_integral_float_power_is_that_integer(p):
    # Schedules and configs give p as a float; 2.0 is the integer 2, bit for bit.
    assert torch.equal(so.spectral_power(good(), float(p)), so.spectral_power(good(), p))
    assert torch.equal(so.spectral_decay(good(), float(p), 0.1, 0.1), so.spectral_decay(good(), p, 0.1, 0.1))


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_invalid_steps(steps):
    with pytest.raises(ValueError, match="steps"):
        so.polar(good(), steps=steps)
    with pytest.raises(ValueError, match="steps"):
        so.msign(torch.eye(3), steps=steps)
    with pytest.raises(ValueError, match="steps"):
        so.spectral_decay_(good(), 2, 0.1, 0.1, steps=steps)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-0.1), "lr"),
        (dict(spectral_weight_decay=-1.0), "spectral_weight_decay"),
        (dict(ordinary_weight_decay=-0.1), "ordinary_weight_decay"),
        (dict(lr=math.nan), "lr"),
        (dict(lr=torch.tensor([0.1, 0.2])), "lr"),
        (dict(convention="coupled"), "convention"),
        (dict(p0_mode="implicit"), "p0_mode"),
        (dict(stability="maybe"), "stability"),
        (dict(convention="independent", schedule=-1.0), "schedule"),
        (dict(band={"tau": -1.0}), "tau"),
        (dict(band={"tau": 1.0, "mode": "middle"}), "mode"),
        (dict(band={"tau": 1.0, "mode": "two_band", "weight_decay_bot": -1.0}), "weight_decay_bot"),
        (dict(coefficients=[(1.0, 2.0)]), "coefficients"),
    ],
)
def test_bad_decay_arguments_leave_weights_bitwise_unchanged(kwargs, match):
    W = good()
    original = W.clone()
    arguments = dict(p=2, lr=0.1, spectral_weight_decay=0.1)
    arguments.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        so.spectral_decay_(W, **arguments)
    assert torch.equal(W, original)


def test_a_bad_tensor_in_a_list_leaves_every_weight_unchanged():
    tensors = [good(0), good(1), good(2)]
    tensors[2][0, 0] = math.nan
    originals = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=r"W\[2\] contains NaN or Inf"):
        so.spectral_decay_(tensors, 2, 0.1, 0.1)
    for t, original in zip(tensors[:2], originals):
        assert torch.equal(t, original)


def test_tensors_on_different_devices():
    with pytest.raises(ValueError, match="one device"):
        so.spectral_decay_([good(), torch.zeros(8, 6, device="meta")], 2, 0.1, 0.1)


def test_the_same_weight_twice():
    W = good()
    with pytest.raises(ValueError, match="overlap in memory"):
        so.spectral_decay_([W, W], 2, 0.1, 0.1)


def _unwritable_lists():
    base = torch.randn(10, 3)
    yield "overlap in memory", [base[0:5], base[3:8]]  # partly overlapping views
    yield "expanded view", [torch.randn(5, 3), torch.randn(3).expand(5, 3)]
    # One weight overlapping itself: (64, 32) over 95 elements. Decayed, it was 0.20 off (25.7 at p = 1).
    yield r"share memory \(shape \(64, 32\), strides \(1, 1\).*W\[1\]\.contiguous\(\)", [
        torch.randn(5, 3), torch.randn(95).as_strided((64, 32), (1, 1))]
    with torch.inference_mode():
        frozen = torch.randn(5, 3)
    yield "inference tensor", [torch.randn(5, 3), frozen]
    yield "meta tensor", [torch.empty(5, 3, device="meta")]


@pytest.mark.parametrize("message, tensors", list(_unwritable_lists()), ids=["overlap", "expanded", "self-overlap",
                                                                              "inference", "meta"])
def test_a_list_that_cannot_all_be_written_is_refused_before_any_is(message, tensors):
    before = [t.clone() if t.device.type != "meta" else None for t in tensors]
    with pytest.raises((ValueError, RuntimeError), match=message):
        so.spectral_decay_(tensors, 2, 0.1, 0.1)
    for t, saved in zip(tensors, before):
        assert saved is None or torch.equal(t, saved)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(layout=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 7)), min_size=1, max_size=3))
def test_a_tensor_overlaps_itself_exactly_where_two_elements_share_an_offset(layout):
    """overlaps_itself, against counting the offsets of every layout of up to three dims: the strides of
    slices, transposes and permutes, expanded dims (stride 0), and the as_strided layouts whose dims do not
    nest (strides (3, 2) over (3, 3) share nothing; (1, 1) over (64, 32) shares)."""
    shape, strides = zip(*layout)
    tensor = torch.empty(sum((size - 1) * stride for size, stride in layout) + 1).as_strided(shape, strides)
    offsets = {sum(i * stride for i, stride in zip(index, strides)) for index in itertools.product(*map(range, shape))}
    assert overlaps_itself(tensor) == (len(offsets) < tensor.numel())


def test_a_single_weight_is_named_w_and_a_lists_weights_w_i():
    with torch.inference_mode():
        frozen = torch.randn(5, 3)
    with pytest.raises(RuntimeError, match=r"^W is an inference tensor"):
        so.spectral_decay_(frozen, 2, 0.1, 0.1)
    with pytest.raises(ValueError, match=r"^W is a meta tensor"):
        so.spectral_decay_(torch.empty(5, 3, device="meta"), 2, 0.1, 0.1)
    with pytest.raises(RuntimeError, match=r"^W\[1\] is an inference tensor"):
        so.spectral_decay_([torch.randn(5, 3), frozen], 2, 0.1, 0.1)


def test_a_non_finite_weight_is_named_by_its_place_in_the_list_past_empty_ones():
    bad = good().clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^W\[2\] contains NaN or Inf"):
        so.spectral_decay_([torch.empty(0, 3), good(), bad], 2, 0.1, 0.1)


def test_disjoint_views_of_one_tensor_are_decayed_each():
    base = torch.randn(10, 3, dtype=torch.float64)
    expected = torch.cat([so.reference.spectral_decay_svd(base[:5], 2, 0.1, 0.1),
                          so.reference.spectral_decay_svd(base[5:], 2, 0.1, 0.1)])
    so.spectral_decay_([base[:5], base[5:]], 2, 0.1, 0.1)
    # fp64, well-conditioned 5x3 blocks: Polar Express converges to ~1e-13; 1e-10 is slack.
    assert torch.allclose(base, expected, atol=1e-10)


@pytest.mark.parametrize("tau", [0.0, -1.0, math.inf])
def test_invalid_threshold(tau):
    with pytest.raises(ValueError, match="tau"):
        so.band_projectors(good(), tau)
    with pytest.raises(ValueError, match="t "):
        so.svt(good(), tau)


def test_invalid_method_names():
    with pytest.raises(ValueError, match="method"):
        so.spectral_power(good(), 2, method="eig")
    with pytest.raises(ValueError, match="method"):
        so.msign(torch.eye(3), method="halley")
    with pytest.raises(ValueError, match="mode"):
        so.band_direction(good(), 1.0, 2, mode="middle")


@pytest.mark.parametrize("op", [lambda W: so.polar(W), lambda W: so.spectral_power(W, 2), lambda W: so.svt(W, 0.1)],
                         ids=["polar", "spectral_power", "svt"])
def test_a_meta_tensor_is_refused_with_a_clear_message(op):
    with pytest.raises(ValueError, match="meta tensor"):
        op(torch.empty(6, 4, device="meta"))
