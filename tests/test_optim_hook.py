"""SpectralDecay bolted onto other optimizers."""

import copy
from collections import OrderedDict

import pytest
import torch

import spectral_ops as so
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.optim import SpectralAdamW, SpectralDecay

from optim_models import assert_same_trajectory, batch, tiny_model, train


def matrices(model):
    return [p for p in model.parameters() if p.ndim == 2]


@pytest.mark.parametrize("convention", ["decoupled", "independent"])
def test_attached_to_torch_adamw_equals_spectral_adamw(convention):
    model_a, model_b = tiny_model(), tiny_model()
    host = torch.optim.AdamW(model_a.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    SpectralDecay(matrices(model_a), p=2, spectral_weight_decay=0.05, convention=convention).attach(host)
    reference = SpectralAdamW(
        [{"params": matrices(model_b), "p": 2, "spectral_weight_decay": 0.05},
         {"params": [p for p in model_b.parameters() if p.ndim < 2]}],
        lr=1e-2, weight_decay=0.0, convention=convention,
    )
    # Both follow the lr of a decaying schedule; the decay runs before each host step.
    host_schedule = torch.optim.lr_scheduler.StepLR(host, step_size=3, gamma=0.5)
    reference_schedule = torch.optim.lr_scheduler.StepLR(reference, step_size=3, gamma=0.5)
    assert_same_trajectory(train(model_a, host, 12, scheduler=host_schedule),
                           train(model_b, reference, 12, scheduler=reference_schedule), 1e-6)


def test_standalone_step_and_detach():
    W0 = matrix_with_spectrum((16, 8), log_spaced_spectrum(8, 10), torch.float64, seed=1)
    param = torch.nn.Parameter(W0.clone())
    param.grad = torch.zeros_like(W0)
    decay = SpectralDecay([param], p=4, spectral_weight_decay=0.2, lr=0.1)
    decay.step()
    assert relative_error(param.detach(), so.reference.spectral_decay_svd(W0, 4, 0.1, 0.2)) < 1e-12
    host = torch.optim.SGD([param], lr=0.0)
    decay.attach(host)
    with pytest.raises(RuntimeError, match="already attached"):
        decay.attach(host)
    decay.detach()
    before = param.detach().clone()
    host.step()
    assert torch.equal(param.detach(), before)


def test_standalone_step_needs_an_lr():
    param = torch.nn.Parameter(torch.ones(4, 4))
    param.grad = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="lr="):
        SpectralDecay([param], p=2, spectral_weight_decay=0.1).step()


def test_parameters_unknown_to_the_host_are_reported():
    a, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4, 4))
    a.grad, b.grad = torch.zeros(4, 4), torch.zeros(4, 4)
    host = torch.optim.SGD([a], lr=0.1)
    SpectralDecay([a, b], p=2, spectral_weight_decay=0.1).attach(host)
    with pytest.raises(ValueError, match="does not optimise"):
        host.step()


def test_state_dict_round_trip_of_the_groups():
    decay = SpectralDecay(tiny_model().parameters(), p=2, spectral_weight_decay=0.1, band={"tau": 1.0, "mode": "top"})
    state = decay.state_dict()
    other = SpectralDecay(tiny_model().parameters(), p=1)
    other.load_state_dict(state)
    assert other.param_groups[0]["p"] == 2 and other.param_groups[0]["band"] == {"tau": 1.0, "mode": "top"}


# --- weight_decay, the deprecated name of the spectral coefficient --------------------------------


def one_step(build):
    """The weights after one standalone step of ``build(param)``, and before it."""
    W0 = matrix_with_spectrum((16, 8), log_spaced_spectrum(8, 10), torch.float64, seed=2)
    param = torch.nn.Parameter(W0.clone())
    param.grad = torch.zeros_like(W0)
    decay = build(param)
    decay.step()
    assert "weight_decay" not in decay.param_groups[0]
    return param.detach(), W0


DEPRECATED = "pass the spectral coefficient lambda_p as spectral_weight_decay"


def test_spectral_weight_decay_is_lambda_p_and_the_third_positional_argument():
    decayed, W0 = one_step(lambda param: SpectralDecay([param], 2, 0.3, lr=0.1, ordinary_weight_decay=0.05))
    expected = so.reference.spectral_decay_svd(W0, 2, 0.1, 0.3, ordinary_weight_decay=0.05)
    assert relative_error(decayed, expected) < 1e-12


@pytest.mark.parametrize("build", [
    lambda param: SpectralDecay([param], p=2, weight_decay=0.3, lr=0.1),
    lambda param: SpectralDecay([{"params": [param], "weight_decay": 0.3}], p=2, lr=0.1),
], ids=["argument", "group-key"])
def test_weight_decay_is_a_deprecated_alias(build):
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as record:
        decayed, W0 = one_step(build)
    # The warning points at the caller's line, so that Python's default filters show it in a script.
    assert record[0].filename == __file__
    assert relative_error(decayed, so.reference.spectral_decay_svd(W0, 2, 0.1, 0.3)) < 1e-12


def test_weight_decay_in_an_added_group_is_a_deprecated_alias():
    decay = SpectralDecay([torch.nn.Parameter(torch.ones(4, 4))], p=2, spectral_weight_decay=0.1, lr=0.1)
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as record:
        decay.add_param_group({"params": [torch.nn.Parameter(torch.ones(3, 3))], "weight_decay": 0.3})
    assert record[0].filename == __file__
    assert decay.param_groups[1]["spectral_weight_decay"] == 0.3 and "weight_decay" not in decay.param_groups[1]


def test_both_names_at_once_are_refused():
    param = torch.nn.Parameter(torch.ones(4, 4))
    with pytest.raises(TypeError, match="both spectral_weight_decay and weight_decay"):
        SpectralDecay([param], p=2, spectral_weight_decay=0.1, weight_decay=0.1)
    with pytest.raises(TypeError, match="both spectral_weight_decay and weight_decay"):
        SpectralDecay([{"params": [param], "spectral_weight_decay": 0.1, "weight_decay": 0.1}], p=2)
    decay = SpectralDecay([param], p=2, spectral_weight_decay=0.1)
    with pytest.raises(TypeError, match="both spectral_weight_decay and weight_decay"):
        decay.add_param_group({"params": [torch.nn.Parameter(torch.ones(3, 3))], "spectral_weight_decay": 0.1,
                               "weight_decay": 0.1})


def test_a_state_dict_saved_under_the_old_name_loads():
    state = SpectralDecay(tiny_model().parameters(), p=2, spectral_weight_decay=0.1).state_dict()
    for group in state["param_groups"]:
        group["weight_decay"] = group.pop("spectral_weight_decay")
    other = SpectralDecay(tiny_model().parameters(), p=1)
    with pytest.warns(DeprecationWarning, match=DEPRECATED):
        other.load_state_dict(state)
    assert other.param_groups[0]["spectral_weight_decay"] == 0.1 and "weight_decay" not in other.param_groups[0]


def test_the_independent_peak_survives_the_host_state_dict():
    # lr set by hand each step (no scheduler, so no initial_lr): the peak must come back with the host.
    def run(model, host, steps, start):
        for step in range(start, start + steps):
            for group in host.param_groups:
                group["lr"] = 1e-2 * 0.5 ** step
            train(model, host, 1, start=step)

    def fresh():
        model = tiny_model()
        host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
        SpectralDecay([p for p in model.parameters() if p.ndim == 2], p=2, spectral_weight_decay=0.2,
                      convention="independent").attach(host)
        return model, host

    model, host = fresh()
    run(model, host, 5, 0)
    resumed_model, resumed_host = fresh()
    run(resumed_model, resumed_host, 2, 0)
    saved_model, saved_host = copy.deepcopy(resumed_model.state_dict()), copy.deepcopy(resumed_host.state_dict())
    resumed_model, resumed_host = fresh()
    for group in resumed_host.param_groups:
        group["lr"] = 123.0  # whatever the new process starts with is not the peak
    resumed_model.load_state_dict(saved_model)
    resumed_host.load_state_dict(saved_host)
    run(resumed_model, resumed_host, 3, 2)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


# ----- a hook that cannot be misused silently (#31)

def test_a_spectral_power_without_its_coefficient_is_refused():
    param = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError, match="needs spectral_weight_decay"):
        SpectralDecay([param], p=2)
    with pytest.raises(TypeError, match="needs spectral_weight_decay"):
        SpectralDecay([param], band=so.Band(0.5))
    decay = SpectralDecay([param], p=1, ordinary_weight_decay=0.1)  # the ordinary decay alone needs none
    assert decay.param_groups[0]["spectral_weight_decay"] == 0.0
    with pytest.raises(TypeError, match="needs spectral_weight_decay"):
        decay.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "p": 0})


def test_the_standalone_step_decays_a_parameter_without_a_gradient():
    W0 = matrix_with_spectrum((12, 6), log_spaced_spectrum(6, 10), torch.float64, seed=2)
    param = torch.nn.Parameter(W0.clone())
    assert param.grad is None
    SpectralDecay([param], p=2, spectral_weight_decay=0.2, lr=0.1).step()
    assert relative_error(param.detach(), so.reference.spectral_decay_svd(W0, 2, 0.1, 0.2, 0.0)) < 1e-10


def test_a_parameter_cannot_take_two_spectral_decays():
    model = tiny_model()
    host = torch.optim.AdamW(model.parameters(), lr=1e-2)
    SpectralDecay(matrices(model)[:1], p=2, spectral_weight_decay=0.1).attach(host)
    with pytest.raises(ValueError, match="another SpectralDecay"):
        SpectralDecay(matrices(model), p=0, spectral_weight_decay=0.1).attach(host)
    SpectralDecay(matrices(model)[1:], p=0, spectral_weight_decay=0.1).attach(host)  # disjoint: fine
    spectral_host = SpectralAdamW(matrices(model), lr=1e-2, p=2, spectral_weight_decay=0.1)
    with pytest.raises(ValueError, match="SpectralAdamW already decays"):
        SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.1).attach(spectral_host)
    ordinary_host = SpectralAdamW(matrices(model), lr=1e-2)  # p = 1: only lambda_1, which stacks
    SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.1).attach(ordinary_host)


def test_two_standalone_decays_cannot_decay_a_parameter_twice_in_one_step():
    """Two live standalone SpectralDecays over one parameter, stepped in the same round (no write to it
    in between), would decay it twice: the second is refused, before it writes anything. Stepping one
    of them after the optimizer's update, or a new one replacing an old one, is a single decay."""
    W = torch.nn.Parameter(torch.randn(16, 8))
    first = SpectralDecay([W], p=2, spectral_weight_decay=0.1, lr=1e-2)
    second = SpectralDecay([W], p=2, spectral_weight_decay=0.1, lr=1e-2)
    first.step()
    decayed_once = W.detach().clone()
    with pytest.raises(ValueError, match="two standalone SpectralDecays over the same parameters"):
        second.step()
    assert torch.equal(W.detach(), decayed_once) and not second.state
    first.step()  # one decay stepped again: a pure-decay run
    W.grad = torch.ones_like(W)
    torch.optim.SGD([W], lr=0.1).step()
    second.step()  # after an update: each round decays once
    second = SpectralDecay([W], p=2, spectral_weight_decay=0.1, lr=1e-2)  # made again: the old one is gone
    second.step()


def test_a_host_that_is_not_a_torch_optimizer_is_refused_and_the_recipe_does_what_attach_does():
    """attach needs torch's step hooks; another optimizer class computes the decay's increment at the
    start of its own step and adds it at the end (the recipe in docs/optimizers.md), which is what attach
    does for torch's SGD, bit for bit."""
    class PlainSGD:  # an optimizer that is not a torch.optim.Optimizer
        def __init__(self, params, lr):
            self.params, self.lr = list(params), lr
            self.matrices = [p for p in self.params if p.ndim == 2]

        @torch.no_grad()
        def step(self):
            increments = so.spectral_decay(self.matrices, p=2, lr=self.lr, spectral_weight_decay=0.05,
                                           stability="clamp", increment=True)
            for param in self.params:
                param.add_(param.grad, alpha=-self.lr)
            torch._foreach_add_(self.matrices, increments)

    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer .* got PlainSGD.*spectral_decay_"):
        SpectralDecay([torch.nn.Parameter(torch.randn(4, 4))], p=2, spectral_weight_decay=0.05).attach(
            PlainSGD([], lr=0.1))
    models = [tiny_model(), tiny_model()]
    custom = PlainSGD(models[0].parameters(), lr=0.1)
    host = torch.optim.SGD(models[1].parameters(), lr=0.1)
    SpectralDecay(matrices(models[1]), p=2, spectral_weight_decay=0.05).attach(host)
    for step in range(3):
        for model, optimizer in zip(models, (custom, host)):
            inputs, targets = batch(step)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


@pytest.mark.parametrize("passed", ["keyword", "positional"])
def test_a_closure_step_decays_the_parameters_its_closure_gives_a_gradient(passed):
    """A host stepped with a closure (Lightning's automatic optimization calls ``step(closure=...)``,
    whose closure zeroes the gradients and runs the backward) gets its gradients inside its step: the
    decay takes the parameters that have one once the closure has run, so the first step is decayed
    (no gradient existed before it) and a closure that skips the backward decays nothing (a gradient
    of the last step existed before it), each from the weights before the step, as a step without a
    closure after the same backward."""
    W0 = matrix_with_spectrum((12, 6), log_spaced_spectrum(6, 10), torch.float64, seed=3)
    W = torch.nn.Parameter(W0.clone())
    host = torch.optim.SGD([W], lr=0.1)
    SpectralDecay([W], p=2, spectral_weight_decay=0.2).attach(host)

    def closure(backward=True):
        W.grad = torch.zeros_like(W) if backward else None  # a zero gradient: the step is the decay alone
        return torch.zeros(())

    def step(closure):
        return host.step(closure=closure) if passed == "keyword" else host.step(closure)

    step(closure)
    once = so.reference.spectral_decay_svd(W0, 2, 0.1, 0.2)
    assert relative_error(W.detach(), once) < 1e-10
    step(lambda: closure(backward=False))
    assert relative_error(W.detach(), once) < 1e-10  # no gradient: neither SGD nor the decay stepped it
    step(closure)
    assert relative_error(W.detach(), so.reference.spectral_decay_svd(once, 2, 0.1, 0.2)) < 1e-10


def test_a_host_without_step_hooks_is_refused_naming_the_optimizer_it_wraps():
    """A wrapper with no step hooks (a torch.optim.Optimizer subclass that never ran Optimizer.__init__,
    as pytorch-optimizer's SafeFP16Optimizer; or another class, as its CPUOffloadOptimizer) gets a
    TypeError instead of an AttributeError from inside attach, naming the torch optimizer it wraps."""
    class HooklessWrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):  # Optimizer.__init__ never runs: no step hooks, no param_groups
            self.optimizer = optimizer

    class PlainWrapper:
        def __init__(self, optimizer):
            self.base = optimizer

    W = torch.nn.Parameter(torch.randn(4, 4))
    decay = SpectralDecay([W], p=2, spectral_weight_decay=0.05)
    with pytest.raises(TypeError, match=r"HooklessWrapper is a torch.optim.Optimizer without step hooks .*It wraps "
                                        r"an optimizer in \.optimizer \(SGD\): attach to that one.*spectral_decay_"):
        decay.attach(HooklessWrapper(torch.optim.SGD([W], lr=0.1)))
    with pytest.raises(TypeError, match=r"needs a torch.optim.Optimizer .* got PlainWrapper\. It wraps an optimizer in "
                                        r"\.base \(SGD\): attach to that one"):
        decay.attach(PlainWrapper(torch.optim.SGD([W], lr=0.1)))
    assert not decay._attached
    decay.attach(torch.optim.SGD([W], lr=0.1))  # the fix the error names


def test_a_wrapper_and_the_optimizer_it_wraps_take_one_decay_between_them():
    """A wrapper whose groups are the wrapped optimizer's (pytorch-optimizer's Lookahead, OrthoGrad)
    steps the wrapped one inside its own step: a SpectralDecay attached to each would decay the same
    parameters twice per step. The second attach is refused, in either order, until the first detaches."""
    class Wrapper(torch.optim.Optimizer):  # as Lookahead: its own step hooks, the wrapped optimizer's groups
        def __init__(self, optimizer):
            self.optimizer = optimizer
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
            self._patch_step_function()

        @property
        def param_groups(self):
            return self.optimizer.param_groups

        def step(self, closure=None):
            return self.optimizer.step(closure)

    model = tiny_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = Wrapper(inner)
    first = SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.05).attach(inner)
    with pytest.raises(ValueError, match="attached to the SGD already decays.*this Wrapper share their param_groups"):
        SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.05).attach(wrapper)
    first.detach()
    on_wrapper = SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.05).attach(wrapper)
    with pytest.raises(ValueError, match="attached to the Wrapper already decays.*this SGD share their param_groups"):
        SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.05).attach(inner)
    SpectralDecay(matrices(model), p=1, ordinary_weight_decay=0.01).attach(inner)  # no spectral decay: no conflict
    inputs, targets = batch(0)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    wrapper.step()  # the wrapper's hooks run: the decay once
    assert on_wrapper._attached


# --- a container of optimizers (torchtitan's OptimizersContainer, heavyball's SplitOpt) --------------


class Container(torch.optim.Optimizer):
    """As torchtitan's OptimizersContainer: a torch.optim.Optimizer (step hooks) whose single group holds
    every parameter and no lr, and whose step steps the optimizers it holds in ``.optimizers``."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        super().__init__([p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]],
                         {})

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def two_optimizers(model):
    """The first layer in an AdamW at lr 1e-2, the second in an SGD at lr 0.05: a decay at the wrong one's lr
    (or at none) shows."""
    first, second = list(model[0].parameters()), list(model[2].parameters())
    return [torch.optim.AdamW(first, lr=1e-2, weight_decay=0.0), torch.optim.SGD(second, lr=0.05)]


def test_attached_to_a_container_each_parameter_decays_at_the_lr_of_the_optimizer_that_steps_it():
    """attach(container) reads each parameter's lr in the group of the optimizer it holds that steps it
    (the container's own group has none, where it raised KeyError: 'lr'), through a schedule, and saves
    the peak lr in those groups: the run equals, bit for bit, one decay attached to each optimizer."""
    by_container, by_optimizer = tiny_model(), tiny_model()
    container = Container(two_optimizers(by_container))
    SpectralDecay(matrices(by_container), p=2, spectral_weight_decay=0.1).attach(container)
    each = two_optimizers(by_optimizer)
    for optimizer in each:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.ndim == 2]
        SpectralDecay(params, p=2, spectral_weight_decay=0.1).attach(optimizer)
    container_schedule = torch.optim.lr_scheduler.StepLR(container.optimizers[0], step_size=2, gamma=0.5)
    each_schedule = torch.optim.lr_scheduler.StepLR(each[0], step_size=2, gamma=0.5)
    history = []
    for optimizer, schedule, model in ((container, container_schedule, by_container),
                                       (Container(each), each_schedule, by_optimizer)):
        history.append(train(model, optimizer, 5, scheduler=schedule))
    assert_same_trajectory(*history, atol=0)
    assert [group["spectral_decay_peak_lr"] for optimizer in container.optimizers
            for group in optimizer.param_groups] == [1e-2, 0.05]
    without_decay = tiny_model()
    train(without_decay, Container(two_optimizers(without_decay)), 5)
    assert not torch.equal(without_decay[2].weight, by_container[2].weight)  # the decay is there to see


def test_a_container_and_an_optimizer_it_holds_take_one_decay_between_them():
    model = tiny_model()
    container = Container(two_optimizers(model))
    first = SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.1).attach(container)
    with pytest.raises(ValueError, match="attached to the Container already decays.*this AdamW are one inside the "
                                         "other.*Attach once"):
        SpectralDecay([model[0].weight], p=2, spectral_weight_decay=0.1).attach(container.optimizers[0])
    first.detach()
    SpectralDecay([model[0].weight], p=2, spectral_weight_decay=0.1).attach(container.optimizers[0])
    with pytest.raises(ValueError, match="attached to the AdamW already decays.*this Container are one inside"):
        SpectralDecay(matrices(model), p=2, spectral_weight_decay=0.1).attach(container)
    held = SpectralAdamW([model[2].weight], lr=1e-2, p=2, spectral_weight_decay=0.1)
    with pytest.raises(ValueError, match="SpectralAdamW already decays"):
        SpectralDecay([model[2].weight], p=2, spectral_weight_decay=0.1).attach(Container([held]))


def test_a_host_whose_groups_hold_no_lr_and_no_optimizer_is_refused_naming_the_fix():
    """A host whose group holds no lr and that holds no optimizer stepping the parameter: a precise
    error at attach, naming the fix, not KeyError: 'lr'; nothing is registered."""
    class NoLr(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            pass

    W = torch.nn.Parameter(torch.randn(4, 4))
    host = NoLr([W])
    decay = SpectralDecay([W], p=2, spectral_weight_decay=0.1)
    with pytest.raises(ValueError, match=r"NoLr's param_groups hold no 'lr' for 1 of these parameters.*Attach to the "
                                         "optimizer whose param_groups hold their lr"):
        decay.attach(host)
    assert not decay._attached and not host._optimizer_step_pre_hooks
