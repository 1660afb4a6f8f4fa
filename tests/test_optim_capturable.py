"""``capturable=True``: after one warm-up step, an optimizer step never synchronises with the host.

On CPU there is no device to wait for, so a synchronisation is detected where it would happen: every
tensor method that reads a value back to Python (``item``, ``tolist``, ``bool``, ``float``,
``int``, ``nonzero``) is replaced by one that raises.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import spectral_ops as so
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD

from optim_models import batch, tiny_model

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")


@contextlib.contextmanager
def host_reads_forbidden():
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def forbidden(name):
        def read(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} synchronises with the host in a capturable step")
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, forbidden(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def gradients(model, step):
    inputs, targets = batch(step)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def _muon(model, capturable=True, **options):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return SpectralMuon([{"params": matrices}, {"params": vectors, "algorithm": "adamw", "weight_decay": 0.0}],
                        capturable=capturable, **options)


def _attached(model, capturable=True, **options):
    host = torch.optim.SGD(model.parameters(), lr=options.pop("lr"))
    SpectralDecay([p for p in model.parameters() if p.ndim == 2], capturable=capturable, **options).attach(host)
    return host


# Each optimizer capturable (capturable=False: the same optimizer eager).
FAMILY = {
    "adamw": lambda m, capturable=True, **o: SpectralAdamW(m.parameters(), capturable=capturable, weight_decay=0.1,
                                                           **o),
    "sgd": lambda m, capturable=True, **o: SpectralSGD(m.parameters(), capturable=capturable, momentum=0.9,
                                                       weight_decay=0.1, **o),
    "muon": _muon,
    "muon-heads": lambda m, **o: _muon(m, heads=2, **o),
    "decay": lambda m, capturable=True, **o: SpectralDecay(m.parameters(), capturable=capturable, **o),
    "decay-attached": _attached,
}
OPTIONS = {
    "p0": {"p": 0, "spectral_weight_decay": 0.5},
    "p2": {"p": 2, "spectral_weight_decay": 0.5, "stability": "clamp"},
    "band": {"p": 2, "spectral_weight_decay": 0.5, "stability": "clamp", "band": so.Band(0.5)},
    "independent": {"p": 2, "spectral_weight_decay": 0.5, "stability": "ignore", "convention": "independent"},
}


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("options", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("name", FAMILY)
def test_a_capturable_step_reads_nothing_back(name, options, tensor_lr):
    model = tiny_model()
    lr = torch.tensor(1e-2) if tensor_lr else 1e-2
    optimizer = FAMILY[name](model, lr=lr, **OPTIONS[options])
    gradients(model, 0)
    optimizer.step()  # the first step may validate, allocate state and self-check
    before = [p.detach().clone() for p in model.parameters()]
    gradients(model, 1)
    with host_reads_forbidden():
        optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["adamw", "muon", "decay"])
def test_a_capturable_stochastically_rounded_step_reads_nothing_back(name):
    # bf16 weights, so that the decay draws its random bits (fp32 ones round nothing).
    model = tiny_model().bfloat16()
    optimizer = FAMILY[name](model, lr=1e-2, p=2, spectral_weight_decay=0.5, stability="clamp", rounding="stochastic")
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator).bfloat16()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    with host_reads_forbidden():
        optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("read", [lambda t: t.item(), lambda t: bool(t), lambda t: float(t), lambda t: int(t),
                                  lambda t: t.tolist(), lambda t: t.nonzero()])
def test_the_detector_catches_every_host_read(read):
    with host_reads_forbidden(), pytest.raises(AssertionError, match="synchronises"):
        read(torch.tensor(1.0))


def test_the_detector_catches_an_eager_step():
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    gradients(model, 0)
    optimizer.step()
    gradients(model, 1)
    with host_reads_forbidden(), pytest.raises(AssertionError, match="synchronises"):
        optimizer.step()


@pytest.mark.parametrize("make", [
    lambda params: SpectralAdamW(params, capturable=True, p=2, spectral_weight_decay=0.5, stability="raise"),
    lambda params: SpectralSGD(params, capturable=True, p=3, spectral_weight_decay=0.5, stability="warn"),
    lambda params: SpectralMuon(params, capturable=True, p=2, spectral_weight_decay=0.5, stability="raise"),
    lambda params: SpectralDecay(params, capturable=True, p=2, spectral_weight_decay=0.5, stability="raise"),
], ids=["adamw", "sgd", "muon", "decay"])
def test_host_side_stability_policies_are_refused_at_construction(make):
    with pytest.raises(ValueError, match="capturable=True forbids; pass stability='clamp'"):
        make([torch.nn.Parameter(torch.randn(4, 4))])


def test_the_guard_is_irrelevant_without_a_power_above_one():
    SpectralAdamW([torch.nn.Parameter(torch.randn(4, 4))], capturable=True, p=1, weight_decay=0.1)
    SpectralAdamW([torch.nn.Parameter(torch.randn(4, 4))], capturable=True, p=0, spectral_weight_decay=0.1)


def test_a_tensor_coefficient_must_live_on_the_parameters_device():
    meta = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match="lr is a tensor on cpu but the parameters are on meta"):
        SpectralAdamW([meta], capturable=True, lr=torch.tensor(1e-2))


@pytest.mark.parametrize("name", [name for name in FAMILY if name != "decay-attached"])  # no groups of its own
def test_capturable_steps_match_eager_ones(name):
    # Same arithmetic in another order (device bias corrections, a clamp factor of exactly 1.0): fp32
    # roundoff per step, ~1e-7 relative on weights of size ~1 after 3 steps of size ~lr.
    options = {"p": 2, "spectral_weight_decay": 0.5, "stability": "clamp"}
    eager_model, capturable_model = tiny_model(), tiny_model()
    eager = FAMILY[name](eager_model, lr=1e-2, **options)
    for group in eager.param_groups:
        group["capturable"] = False
    capturable = FAMILY[name](capturable_model, lr=1e-2, **options)
    for step in range(3):
        for model, optimizer in ((eager_model, eager), (capturable_model, capturable)):
            gradients(model, step)
            optimizer.step()
    for a, b in zip(eager_model.parameters(), capturable_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("capturable", [False, True])
def test_a_tensor_lr_changed_in_place_takes_effect(capturable):
    W = torch.nn.Parameter(torch.eye(3))
    lr = torch.tensor(0.1)
    optimizer = SpectralSGD([W], lr=lr, momentum=0.0, capturable=capturable)
    W.grad = torch.ones(3, 3)
    optimizer.step()
    lr.fill_(0.5)  # what a scheduler does to a tensor lr
    optimizer.step()
    torch.testing.assert_close(W.detach(), torch.eye(3) - 0.6, rtol=0, atol=1e-7)


def _attached_to_adamw(model):
    host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    SpectralDecay([p for p in model.parameters() if p.ndim == 2], p=2, spectral_weight_decay=0.5, stability="clamp",
                  capturable=True).attach(host)
    return host


COMPILED = {
    "adamw": lambda m: SpectralAdamW(m.parameters(), lr=torch.tensor(1e-2), p=2, spectral_weight_decay=0.5,
                                     stability="clamp", capturable=True),
    "muon": lambda m: _muon(m, lr=torch.tensor(1e-2), p=2, spectral_weight_decay=0.5, stability="clamp",
                            precision="fp32"),
    "sgd": lambda m: SpectralSGD(m.parameters(), lr=torch.tensor(1e-2), momentum=0.9, p=0, spectral_weight_decay=0.5,
                                 capturable=True),
    # Cautious (SPEC 11): the decay's increments masked by Adam's first moment once the update is written.
    "adamw-cautious": lambda m: SpectralAdamW(m.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, p=2,
                                              spectral_weight_decay=0.5, stability="clamp", capturable=True,
                                              cautious=True),
    "decay-attached": _attached_to_adamw,
}


def graph_breaks(step) -> int:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step()
    return sum(counters["graph_break"].values())


def set_lr(optimizer, lr: float) -> None:
    """What a scheduler does: a tensor lr is changed in place, a Python one replaced."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@pytest.mark.parametrize("name", COMPILED)
def test_a_compiled_step_has_no_graph_break_and_matches_eager(name):
    eager_model, compiled_model = tiny_model(), tiny_model()
    eager, compiled = COMPILED[name](eager_model), COMPILED[name](compiled_model)
    step = torch.compile(compiled.step)
    for index, lr in enumerate([1e-2, 1e-2, 5e-3]):
        set_lr(eager, lr)
        set_lr(compiled, lr)
        gradients(eager_model, index)
        eager.step()
        gradients(compiled_model, index)
        if index == 0:
            compiled.step()  # the eager first step: state, self-checks, routing
        elif index == 1:
            breaks = graph_breaks(step)
        else:
            step()  # with the new lr
    # Inductor fuses and reorders fp32 element-wise work: a few ulps per step on weights of ~0.3.
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # torch.optim.AdamW's own step graph-breaks on purpose (torch/optim/optimizer.py, _use_grad):
    # what the attached decay must add is none. Dynamo counts the breaks before a backend sees a graph:
    # torch's are counted on the eager backend, without compiling its step's code.
    expected = graph_breaks(torch.compile(torch.optim.AdamW(tiny_model().parameters()).step, backend="eager")) \
        if name == "decay-attached" else 0
    assert breaks == expected


def test_options_are_validated_at_construction_and_again_only_when_changed(monkeypatch):
    import spectral_ops.optim._decay as family

    calls = []
    validate = family.check_decay_options
    monkeypatch.setattr(family, "check_decay_options", lambda *a, **k: calls.append(a) or validate(*a, **k))
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=torch.tensor(1e-2), p=2, spectral_weight_decay=0.5,
                              stability="clamp", capturable=True)
    assert len(calls) == 1
    for step in range(3):
        gradients(model, step)
        optimizer.step()
    optimizer.param_groups[0]["lr"].fill_(5e-3)  # a tensor changed in place is not an option change
    optimizer.step()
    assert len(calls) == 1
    optimizer.param_groups[0]["p"] = 3
    optimizer.step()
    assert len(calls) == 2 and calls[-1][0] == 3
    optimizer.param_groups[0]["p"] = -1
    with pytest.raises(ValueError, match="p=-1 < 0 cannot be a decay"):
        optimizer.step()


# ----- lr = 0 and a NaN lr write nothing non-finite (#43)


def _sparse_gradients(model, step):
    """Gradients in which an input feature is always zero: the second moment of its column stays 0."""
    gradients(model, step)
    model[0].weight.grad[:, 0] = 0.0


def _at_lr(name, lr, steps=2, tensor_lr=False, **decay):
    """SpectralAdamW ``name`` ("eager", "capturable" or "compiled") with the ``p = 2`` decay (or ``decay``)
    after a first step at lr 1e-2 (the state exists) and ``steps`` more at ``lr``: the weights before and
    after those, and the skips."""
    torch._dynamo.reset()
    model = tiny_model()
    capturable = name == "capturable"
    optimizer = SpectralAdamW(model.parameters(), lr=torch.tensor(1e-2) if tensor_lr else 1e-2,
                              capturable=capturable, **(decay or {"p": 2, "spectral_weight_decay": 0.5}))
    _sparse_gradients(model, 0)
    optimizer.step()
    set_lr(optimizer, lr)
    step = torch.compile(optimizer.step) if name == "compiled" else optimizer.step
    before = [p.detach().clone() for p in model.parameters()]
    for index in range(steps):
        _sparse_gradients(model, 1 + index)
        step()
    return before, [p.detach().clone() for p in model.parameters()], sum(int(c) for c in optimizer.skipped.values())


@pytest.mark.parametrize("decay", [{}, {"p": 0, "spectral_weight_decay": 0.5, "p0_mode": "prox"}], ids=["p2", "prox"])
@pytest.mark.parametrize("name", ["eager", "capturable", "compiled"])
def test_an_lr_of_zero_leaves_every_weight_bit_for_bit(name, decay):
    """A warm-up from 0, a cosine to 0. The capturable (and so the compiled) Adam folded its step size into
    each term of the denominator, so a second moment of exactly 0 made 0/0, NaN, written with no skip;
    now the denominator is divided by the step size last (infinite: the update is exactly 0), as eager
    leaves every weight as it was. The prox decay rebuilt W at a zero threshold (1.2e-6 off)."""
    before, after, skipped = _at_lr(name, 0.0, tensor_lr=name == "capturable", **decay)
    assert skipped == 0
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("lr", ["eager", "float-lr", "tensor-lr"])
@pytest.mark.parametrize("options", ["prox", *OPTIONS])
@pytest.mark.parametrize("name", FAMILY)
def test_an_lr_of_zero_leaves_every_weight_bit_for_bit_in_every_optimizer_and_decay(name, options, lr):
    """Every optimizer, eager and capturable (a Python and a tensor lr), under each decay: the prox decay
    moved weights by up to 1.2e-6 at lr = 0 (its soft-threshold at 0 rebuilt W from its factors)."""
    model = tiny_model()
    decay = {"p": 0, "spectral_weight_decay": 0.5, "p0_mode": "prox"} if options == "prox" else OPTIONS[options]
    optimizer = FAMILY[name](model, capturable=lr != "eager", lr=torch.tensor(1e-2) if lr == "tensor-lr" else 1e-2,
                             **decay)
    gradients(model, 0)
    optimizer.step()
    set_lr(optimizer, 0.0)
    gradients(model, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_nan_lr_raises_in_an_eager_step_before_any_write():
    """Set on a group after construction, a NaN lr reached the vectors' ordinary decay (NaN biases)."""
    model = tiny_model()
    optimizer = SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5)
    gradients(model, 0)
    optimizer.step()
    optimizer.param_groups[0]["lr"] = float("nan")
    gradients(model, 1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="lr must be finite, got nan"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name", ["capturable", "compiled"])
def test_an_nan_lr_skips_a_device_step_and_writes_nothing(name):
    """A device step cannot raise on the lr's value: it skips every parameter of the group, counted, and
    the masked update adds exact zeros (it computed 0 / NaN before). A tensor lr, as a scheduler's on the
    device (a Python NaN is a constant Inductor cannot compile)."""
    before, after, skipped = _at_lr(name, float("nan"), steps=1, tensor_lr=True)
    assert skipped == len(before)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("name", ["sgd", "muon"])
def test_an_nan_lr_skips_every_capturable_optimizer_and_writes_nothing(name):
    """SGD and Muon add ``lr * direction``, and a masked direction of zeros times a NaN lr is NaN: a
    skipped parameter's lr is taken as 0."""
    model = tiny_model()
    optimizer = FAMILY[name](model, lr=torch.tensor(1e-2), p=2, spectral_weight_decay=0.5, stability="clamp")
    gradients(model, 0)
    optimizer.step()
    set_lr(optimizer, float("nan"))
    gradients(model, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sum(int(count) for count in optimizer.skipped.values()) == len(before)
