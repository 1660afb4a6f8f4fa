"""torch's optimizer contract, for every member of the family, checked the way torch's generic
optimizer tests and a user's training code exercise it: state_dict round trips keep every group key
and value, copy.deepcopy and pickle keep every public attribute and the counts, and a copy steps on
its own."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist

from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD

from optim_models import tiny_model, train

# Constructions that together set every kind of group key: a band (a dict), a capturable group (0-d
# tensor coefficients), Muon's blocks, the clamp (which fills the clamp counts).
FAMILY = {
    "adamw": lambda params: SpectralAdamW(params, lr=1e-2, p=2, spectral_weight_decay=0.1),
    "adamw-capturable": lambda params: SpectralAdamW(params, lr=torch.tensor(1e-2), p=2, capturable=True,
                                                     spectral_weight_decay=0.1, stability="clamp"),
    "adamw-band": lambda params: SpectralAdamW(params, lr=1e-2, p=2, spectral_weight_decay=0.1,
                                               band={"tau": 0.5, "mode": "top"}),
    "muon": lambda params: SpectralMuon(
        [{"params": [p for p in params if p.ndim == 2], "heads": 2},
         {"params": [p for p in params if p.ndim < 2], "algorithm": "adamw"}], lr=1e-2, p=2,
        spectral_weight_decay=0.1),
    "sgd": lambda params: SpectralSGD(params, lr=1e-2, p=3, spectral_weight_decay=0.1, nesterov=True),
    "decay": lambda params: SpectralDecay(params, p=2, spectral_weight_decay=0.1, lr=1e-2),
    # Coefficients large enough that every step clamps: the clamp counts exist.
    "adamw-clamped": lambda params: SpectralAdamW(params, lr=1.0, p=4, spectral_weight_decay=10.0,
                                                  stability="clamp"),
}


def trained(name, steps=3, scheduler=False):
    model = tiny_model()
    optimizer = FAMILY[name](list(model.parameters()))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step) if scheduler else None
    train(model, optimizer, steps, scheduler=schedule)
    if name == "adamw-clamped":
        assert optimizer.count_state()["clamped"], "the case meant to clamp did not"
    return model, optimizer


def assert_same_values(a, b, where=""):
    """Equal nested state: tensors bitwise (and of one dtype and device), the rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} differ"
        for key in a:
            assert_same_values(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_values(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def public(optimizer) -> dict:
    return {key: value for key, value in vars(optimizer).items() if not key.startswith("_")}


@pytest.mark.parametrize("scheduler", [False, True], ids=["", "scheduled"])
@pytest.mark.parametrize("name", list(FAMILY))
def test_a_state_dict_round_trip_keeps_every_group_key_and_value(name, scheduler):
    _, optimizer = trained(name, scheduler=scheduler)
    saved = optimizer.state_dict()
    fresh = FAMILY[name](list(tiny_model(seed=1).parameters()))
    if scheduler:  # the scheduler a resumed run builds before loading adds its initial_lr
        torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 0.9**step)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert_same_values(fresh.state_dict(), saved, "state_dict")
    # torch's group keys, as torch's own optimizers hold them (load_state_dict adds differentiable).
    reference = torch.optim.AdamW(tiny_model().parameters()).param_groups[0]
    for group in fresh.param_groups:
        assert group["differentiable"] is reference["differentiable"] is False
        assert "capturable" in group and "capturable" in reference


@pytest.mark.parametrize("name", list(FAMILY))
def test_deepcopy_keeps_every_public_attribute_and_steps_on_its_own(name):
    model, optimizer = trained(name)
    clone = copy.deepcopy(optimizer)
    assert set(public(clone)) == set(public(optimizer)) >= {"defaults", "state", "param_groups", "process_group"}
    assert_same_values(clone.state_dict(), optimizer.state_dict(), "state_dict")
    assert_same_values(clone.count_state(), optimizer.count_state(), "counts")
    # The copy holds copies of the parameters: stepping it leaves the original's weights and state alone.
    before = copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in model.parameters()]
    for param in (p for group in clone.param_groups for p in group["params"]):
        param.grad = torch.ones_like(param)
    clone.step()
    assert_same_values(optimizer.state_dict(), before[0], "original state")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[1]))


def test_deepcopy_keeps_the_same_process_group_handle():
    # A process group is a handle on the ranks: the copy must talk to the same ranks, not a copy of it.
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    for build in (SpectralAdamW, SpectralMuon, SpectralSGD, SpectralDecay):
        optimizer = build([torch.nn.Parameter(torch.ones(4, 4))], process_group=group)
        assert copy.deepcopy(optimizer).process_group is group


@pytest.mark.parametrize("name", ["adamw-clamped", "muon"])
def test_pickle_keeps_the_groups_the_state_and_the_counts(name):
    _, optimizer = trained(name)
    loaded = pickle.loads(pickle.dumps(optimizer))
    assert_same_values(loaded.state_dict(), optimizer.state_dict(), "state_dict")
    assert loaded.process_group is None  # pickle cannot carry a process group: documented


def test_a_copy_of_an_attached_decay_is_detached_and_can_attach_elsewhere():
    model = tiny_model()
    host = torch.optim.AdamW(model.parameters(), lr=1e-2)
    decay = SpectralDecay([p for p in model.parameters() if p.ndim == 2], p=2, spectral_weight_decay=0.1).attach(host)
    clone = copy.deepcopy(decay)
    clone.attach(torch.optim.SGD([p for group in clone.param_groups for p in group["params"]], lr=0.1))
    with pytest.raises(RuntimeError, match="already attached"):
        decay.attach(host)
    # load_state_dict goes through the same __setstate__: it must not forget the hook.
    decay.load_state_dict(decay.state_dict())
    with pytest.raises(RuntimeError, match="already attached"):
        decay.attach(host)


def test_differentiable_steps_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="leave differentiable=False"):
        SpectralAdamW([{"params": [torch.nn.Parameter(torch.ones(2, 2))], "differentiable": True}])


@pytest.mark.parametrize("optimizer", [SpectralAdamW, SpectralSGD, SpectralMuon, SpectralDecay])
def test_every_optimizer_gives_a_default_to_every_decay_key(optimizer):
    """The decay options' defaults come from their table, through each constructor's signature; the family's
    step flags are each constructor's own."""
    from spectral_ops.decay_options import DECAY_OPTIONS

    matrices = [torch.nn.Parameter(torch.randn(6, 4))]
    made = (optimizer(matrices, lr=1e-2, spectral_weight_decay=0.0) if optimizer is SpectralDecay
            else optimizer(matrices))
    assert {"capturable", "strict", "rollback"} <= set(made.defaults)
    shared = [option for option in DECAY_OPTIONS if option.key != "spectral_weight_decay"]  # SpectralDecay's: None
    assert {option.key: made.defaults[option.key] for option in shared} == \
        {option.key: option.default for option in shared}
    assert made.defaults["stability"] == "clamp"


def test_a_callable_option_is_left_out_of_the_state_and_kept_on_load():
    # A schedule is code, not state (as LambdaLR's lambdas): the state dict pickles, and loading keeps the
    # callable the optimizer was built with; one built without it refuses the state.
    import io

    def build(**options):
        weight = torch.nn.Parameter(torch.ones(8, 4))
        return weight, SpectralMuon([weight], lr=1e-2, **options)

    weight, optimizer = build(update_power=lambda step: 0.25 - 0.1 * step, adjust_lr_fn=lambda lr, shape: lr)
    weight.grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    schedule = lambda step: 0.25 - 0.1 * step  # noqa: E731
    _, resumed = build(update_power=schedule, adjust_lr_fn=lambda lr, shape: lr)
    resumed.load_state_dict(state)
    assert resumed.param_groups[0]["update_power"] is schedule
    assert int(next(iter(resumed.state.values()))["step"]) == 1
    with pytest.raises(ValueError, match="'update_power' was a callable"):
        build(adjust_lr_fn=lambda lr, shape: lr)[1].load_state_dict(state)


# SGD with dampening creates its momentum as the step runs (torch's first buffer is the undamped
# gradient), the others when the step starts; attached, the decay is SpectralDecay's and the state torch's.
CLEARED = [*FAMILY, "sgd-dampening", "attached"]


def _cleared_build(name, params):
    if name == "sgd-dampening":
        return SpectralSGD(params, lr=1e-2, momentum=0.9, dampening=0.5, p=2, spectral_weight_decay=0.1)
    if name == "attached":
        host = torch.optim.AdamW(params, lr=1e-2)
        SpectralDecay([p for p in params if p.ndim == 2], p=2, spectral_weight_decay=0.1).attach(host)
        return host
    return FAMILY[name](params)


@pytest.mark.parametrize("name", CLEARED)
def test_a_step_after_state_clear_is_a_fresh_optimizers_first_step(name):
    """``optimizer.state.clear()`` (how frameworks reset an optimizer) then a step raised KeyError 'step'
    (SpectralAdamW) or 'momentum_buffer' (SpectralMuon): the state is created again, lazily, as torch's
    optimizers create it, and the step is bit for bit the first step of a fresh optimizer."""
    model = tiny_model()
    optimizer = _cleared_build(name, list(model.parameters()))
    train(model, optimizer, 2)
    optimizer.state.clear()
    fresh_model = copy.deepcopy(model)
    fresh = _cleared_build(name, list(fresh_model.parameters()))
    after_clear = train(model, optimizer, 2, start=2)
    assert_same_values(after_clear, train(fresh_model, fresh, 2, start=2))


def test_stepping_after_a_load_leaves_the_loaded_counts_as_they_were():
    """The skip and clamp counts are updated in place by every step: loaded, they are copies, so a state dict
    kept by the caller (to load again, or to save elsewhere) keeps the counts it held."""
    model, optimizer = trained("adamw-clamped")
    saved = optimizer.state_dict()
    before = copy.deepcopy(saved)
    optimizer.load_state_dict(saved)
    train(model, optimizer, 2, start=3)
    assert int(optimizer.count_state()["clamped"][0][0]) > int(before["clamped"][0][0])
    assert_same_values(saved["clamped"], before["clamped"])
    assert_same_values(saved["skipped"], before["skipped"])
