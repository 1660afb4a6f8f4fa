"""The decay half of every optimizer (spectral_ops/optim/_decay.py): which matrices a parameter of more
than two dimensions holds (SPEC 1.8), read as the op reads them, and the rounding of bf16 weights.

Tolerance: fp32 weights; an optimizer's decay is the op's, batched with whatever else its group holds,
which may change the blocking of the batched products: a few fp32 ulps of values of order 1, hence
``rtol=1e-5, atol=1e-6`` against the op, and the op's own tolerance (5e-5, tests/test_decay.py) against
the FP64 SVD.
"""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.matrix_views import unambiguous_view
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD, param_groups_by_module

AGAINST_OP = dict(rtol=1e-5, atol=1e-6)
AGAINST_SVD = 5e-5
LR, SPECTRAL = 0.05, 0.2

OPTIMIZERS = {
    "adamw": lambda params, **o: SpectralAdamW(params, lr=LR, weight_decay=0.0, p=2, spectral_weight_decay=SPECTRAL,
                                               **o),
    "sgd": lambda params, **o: SpectralSGD(params, lr=LR, p=2, spectral_weight_decay=SPECTRAL, **o),
    "muon": lambda params, **o: SpectralMuon(params, lr=LR, weight_decay=0.0, p=2, spectral_weight_decay=SPECTRAL,
                                             **o),
    "decay": lambda params, **o: SpectralDecay(params, p=2, spectral_weight_decay=SPECTRAL, lr=LR, **o),
}


def stack(shape, seed=0):
    """Matrices of singular values from 1 down to 0.1, stacked in ``shape``."""
    return matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), 10), torch.float32, seed=seed)


def decayed_by(name, W, **options):
    """``W`` after one step of optimizer ``name`` with a zero gradient: the decay alone (Adam's and SGD's
    updates of a zero gradient are zero, and so is Muon's polar factor of a zero momentum)."""
    param = torch.nn.Parameter(W.clone())
    param.grad = torch.zeros_like(param)
    OPTIMIZERS[name]([param], **options).step()
    return param.detach()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("shape", [(4, 64, 32), (2, 2, 64, 32)])
@pytest.mark.parametrize("matrix_view", ["batch", "flatten"])
def test_every_optimizer_reads_a_stack_as_the_op_does(name, shape, matrix_view):
    W = stack(shape)
    expected = so.spectral_decay(W, 2, LR, SPECTRAL, matrix_view=matrix_view, stability="clamp")
    torch.testing.assert_close(decayed_by(name, W, matrix_view=matrix_view), expected, **AGAINST_OP)
    matrices = W if matrix_view == "batch" else W.reshape(shape[0], -1)
    oracle = reference.spectral_decay_svd(matrices, 2, LR, SPECTRAL).reshape(shape)
    assert relative_error(expected, oracle) < AGAINST_SVD


def test_a_conv_filter_flattened_by_an_optimizer_is_its_output_by_input_matrix():
    W = stack((16, 48)).reshape(16, 3, 4, 4)
    oracle = reference.spectral_decay_svd(W.reshape(16, 48), 2, LR, SPECTRAL).reshape(W.shape)
    assert relative_error(decayed_by("adamw", W, matrix_view="flatten"), oracle) < AGAINST_SVD


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_stack_whose_group_does_not_say_how_to_read_it_is_refused_at_construction(name):
    experts = torch.nn.Parameter(torch.randn(4, 16, 8))
    with pytest.raises(ValueError, match=r"'experts.w1' has shape \(4, 16, 8\).*matrix_view: 'batch'.*'flatten'"):
        OPTIMIZERS[name]([{"params": [experts], "param_names": ["experts.w1"]}])
    with pytest.raises(ValueError, match="matrix_view must be one of"):
        OPTIMIZERS[name]([experts], matrix_view="experts")


@pytest.mark.parametrize("shape, view", [
    ((16, 8), "flatten"), ((8,), "flatten"), ((1, 1, 24), "flatten"), ((1, 1, 1), "flatten"),  # one reading
    ((16, 8, 1, 1), "flatten"), ((16, 8, 1, 1, 1), "flatten"), ((16, 1, 1), "flatten"),  # 1x1 convolutions
    ((16, 8, 1), None), ((1, 24, 1), None), ((4, 16, 8), None), ((16, 8, 3, 3), None), ((2, 4, 8, 1, 1), None),
])
def test_the_evident_reading_of_a_shape(shape, view):
    """What needs no matrix_view: one reading, or a batch reading whose matrices would be 1x1 (scalars).
    (16, 8, 1) is a stack of 16 columns read as a batch, a (16, 8) matrix read flattened: both mean
    something. A bank of 1x1 convolutions (2, 4, 8, 1, 1) is not evident: flattened, it is one (2, 32)
    matrix, not its banks' (4, 8) ones."""
    assert unambiguous_view(shape) == view


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_1x1_convolution_is_its_output_by_input_matrix_without_matrix_view(name):
    """torch's generic optimizer tests build a (2, 4, 1, 1) Conv2d weight, which was refused without
    matrix_view. Its batch reading would decay 1x1 matrices, scalars, one by one (sign(w) |w|^p): the
    (out, in) matrix is its one reading that is a matrix, taken without a word."""
    W = stack((16, 8)).reshape(16, 8, 1, 1)
    oracle = reference.spectral_decay_svd(W.reshape(16, 8), 2, LR, SPECTRAL).reshape(W.shape)
    assert relative_error(decayed_by(name, W), oracle) < AGAINST_SVD
    with pytest.raises(ValueError, match=r"\(16, 8, 1\).*matrix_view"):
        OPTIMIZERS[name]([torch.nn.Parameter(torch.randn(16, 8, 1))])


def _attached(params, **options):
    host = torch.optim.SGD(params, lr=LR)
    SpectralDecay(params, p=2, spectral_weight_decay=SPECTRAL, **options).attach(host)
    return host


@pytest.mark.parametrize("layout", ["overlapping", "expanded"])
@pytest.mark.parametrize("name", [*OPTIMIZERS, "attached"])
def test_a_parameter_whose_elements_share_memory_is_refused_before_any_write(name, layout):
    """A parameter overlapping itself (64 x 32 over 95 elements) was stepped: its decay 0.20 off (25.7 at
    p = 1), each location written once per element. An expanded one raised torch's own error from the
    write. Both are refused, named, with the fix, before any parameter or state is written."""
    shared = torch.randn(95).as_strided((64, 32), (1, 1)) if layout == "overlapping" else torch.randn(32).expand(64, 32)
    params = [torch.nn.Parameter(stack((16, 8))), torch.nn.Parameter(shared)]
    optimizer = (_attached if name == "attached" else OPTIMIZERS[name])(params)
    for param in params:
        param.grad = torch.randn(param.shape)
    before = [param.detach().clone() for param in params]
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] \(64, 32\) has elements that share memory.*"
                                         r"param\.data = param\.data\.contiguous\(\)"):
        optimizer.step()
    assert all(torch.equal(param, saved) for param, saved in zip(params, before))
    assert not any(optimizer.state.values())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_filter_that_turned_channels_last_after_construction_steps_as_a_contiguous_one(name):
    """model.to(memory_format=torch.channels_last) after the optimizer was built: the "flatten" matrix of
    the filter is no view of it. Muon raised in its commit after other parameters, their momentum and the
    step count were written; the decay raised before. Now the matrix is read through a copy and written
    back (Muon adds its update in the filter's shape): the same bits as a contiguous filter's step, and
    the filter keeps its layout."""
    def step(channels_last):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 16, 4, bias=False)
        optimizer = OPTIMIZERS[name]([conv.weight], matrix_view="flatten")
        if channels_last:
            conv.to(memory_format=torch.channels_last)
        for index in range(2):
            conv.weight.grad = torch.randn(conv.weight.shape, generator=torch.Generator().manual_seed(index))
            optimizer.step()
        return conv.weight.detach()

    contiguous, channels_last = step(False), step(True)
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(channels_last, contiguous)


def test_a_stack_needs_no_reading_where_its_decay_is_element_wise():
    # SpectralAdamW as a drop-in AdamW (the ordinary decay only) takes conv filters as they are, and
    # refuses them once a group asks for a spectral decay of them.
    conv = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
    optimizer = SpectralAdamW([conv], lr=1e-3, weight_decay=0.1)
    conv.grad = torch.zeros_like(conv)
    optimizer.step()
    optimizer.param_groups[0].update(p=2, spectral_weight_decay=0.1)
    with pytest.raises(ValueError, match="matrix_view"):
        optimizer.step()


def test_muon_splits_every_matrix_of_a_stack_into_its_heads_and_blocks_for_the_decay_and_the_update():
    # A stack of 3 fused QKV projections (rows q | k | v), head-wise Q and K, full-matrix V: each head of
    # Q and K and the whole V of each matrix is decayed and orthogonalised as a matrix of its own, as
    # separate parameters would be.
    d, heads = 16, 2
    W = stack((3, 3 * d, 24))
    grad = torch.randn(W.shape, generator=torch.Generator().manual_seed(1))
    options = dict(lr=LR, weight_decay=0.0, p=2, spectral_weight_decay=SPECTRAL, precision="fp32")
    fused = torch.nn.Parameter(W.clone())
    fused.grad = grad.clone()
    SpectralMuon([{"params": [fused], "splits": (d, d, d), "recipe": "HHF", "heads": heads,
                   "matrix_view": "batch"}], **options).step()
    # The same blocks as parameters of their own: Q and K per head (the decay on the whole block).
    for index in range(3):
        for block, recipe in zip(range(3), "HHF"):
            rows = slice(block * d, (block + 1) * d)
            alone = torch.nn.Parameter(W[index, rows].clone())
            alone.grad = grad[index, rows].clone()
            # adjust_lr_fn sees each block's shape in both runs; heads split the update and the decay.
            SpectralMuon([{"params": [alone], "heads": heads if recipe == "H" else None}], **options).step()
            torch.testing.assert_close(fused.detach()[index, rows], alone.detach(), **AGAINST_OP)


def test_module_groups_read_conv_filters_flattened_and_other_stacks_batched():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(4, 16, 8))

    model = torch.nn.ModuleDict({"conv": torch.nn.Conv2d(3, 8, 3), "experts": Experts(), "proj": torch.nn.Linear(8, 8)})
    groups = param_groups_by_module(model, non_matrix={"weight_decay": 0.0})
    view_of = {name: group.get("matrix_view") for group in groups for name in group["param_names"]}
    assert view_of == {"conv.weight": "flatten", "experts.w1": "batch", "proj.weight": None,
                       "conv.bias": None, "proj.bias": None}
    optimizer = SpectralAdamW(groups, lr=LR, weight_decay=0.0, p=2, spectral_weight_decay=SPECTRAL)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer.step()
    for name, view in (("conv.weight", "flatten"), ("experts.w1", "batch")):
        expected = so.spectral_decay(before[name], 2, LR, SPECTRAL, matrix_view=view, stability="clamp")
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), expected, **AGAINST_OP)
    assert torch.equal(model["conv"].bias.detach(), before["conv.bias"])  # vectors: the ordinary decay, 0 here


def test_muon_decays_each_head_of_a_head_wise_block():
    # The decay of one head-wise Q, against the op on each head: p = 0 (the polar factor of each head,
    # not of the whole Q, whose heads it would mix). A zero gradient leaves the decay alone.
    W = stack((4 * 8, 24))
    param = torch.nn.Parameter(W.clone())
    param.grad = torch.zeros_like(param)
    SpectralMuon([param], lr=LR, weight_decay=0.0, p=0, spectral_weight_decay=SPECTRAL, heads=4).step()
    per_head = so.spectral_decay(W.reshape(4, 8, 24), 0, LR, SPECTRAL).reshape(W.shape)
    torch.testing.assert_close(param.detach(), per_head, **AGAINST_OP)
    assert relative_error(so.spectral_decay(W, 0, LR, SPECTRAL), per_head) > 1e-3  # the whole Q differs


def test_clamps_of_a_stack_are_counted_and_named_per_matrix(caplog):
    W = stack((4, 24, 16)) * torch.tensor([1.0, 30.0, 1.0, 30.0]).reshape(4, 1, 1)  # two matrices overshoot
    param = torch.nn.Parameter(W)
    param.grad = torch.zeros_like(param)
    # p kappa = 2 lr s_max: 3 for the two matrices of s_max 30, 0.1 for the others.
    optimizer = SpectralDecay([{"params": [param], "param_names": ["experts"]}], p=2, spectral_weight_decay=1.0,
                              lr=0.05, matrix_view="batch")
    with caplog.at_level("WARNING", logger="spectral_ops.decay"):
        optimizer.step()
    record = optimizer.clamped["experts (4, 24, 16)"]
    assert int(record.count) == 2 and float(record.smallest_factor) < 1
    assert "experts (4, 24, 16) matrix [1]" in caplog.text and "matrix [3]" in caplog.text


def _attached_to_sgd(params, **options):
    """The decay attached to torch's SGD: added after the host's step (a zero gradient's: no change)."""
    host = torch.optim.SGD(params, lr=1e-3)
    SpectralDecay(params, p=1, ordinary_weight_decay=1.0, **options).attach(host)
    return host


ORDINARY_ONLY = {
    "adamw": lambda params, **o: SpectralAdamW(params, lr=1e-3, weight_decay=1.0, **o),
    "decay": lambda params, **o: SpectralDecay(params, p=1, ordinary_weight_decay=1.0, lr=1e-3, **o),
    # Its increment is rounded to nearest, then added to the weight with the group's rounding.
    "decay-attached": _attached_to_sgd,
}


@pytest.mark.parametrize("name", list(ORDINARY_ONLY))
@pytest.mark.parametrize("shape", [(24, 16), (384,)])
def test_a_bf16_weight_keeps_a_decay_below_its_rounding_with_stochastic_rounding(name, shape):
    # A shrink by 1e-3, below half of bf16's relative unit (2^-9 to 2^-8): rounding to nearest loses it
    # at every step, of matrices and vectors alike; with rounding="stochastic" the mean weight over 256
    # seeds follows the exact shrink (the rounding's bias is tested in tests/test_decay.py; here, that
    # the group key reaches it). A weight moves down one unit with odds p of 1/8 to 1/4, so the mean's
    # error is about sqrt(p (1 - p) / 256) <= 1/37 of a unit, ~0.2 of the shrink, against 1 unrounded.
    W = stack((24, 16)).reshape(shape).bfloat16()
    exact = W.double() * (1 - 1e-3)

    def step(rounding, seed=0):
        torch.manual_seed(seed)
        param = torch.nn.Parameter(W.clone())
        param.grad = torch.zeros_like(param)
        ORDINARY_ONLY[name]([param], rounding=rounding).step()
        return param.detach()

    assert torch.equal(step("nearest"), W)
    mean = torch.stack([step("stochastic", seed).double() for seed in range(256)]).mean(0)
    assert relative_error(mean, exact) < relative_error(W.double(), exact) / 3
    with pytest.raises(ValueError, match="rounding must be one of"):
        ORDINARY_ONLY[name]([torch.nn.Parameter(W.clone())], rounding="up")
