"""docs/integrations.md's pytorch-optimizer section, run against the real pytorch-optimizer: the decay
attached to its Lion (per-parameter state), to the optimizer inside its Lookahead wrapper (slow
weights), and to the optimizer inside its SafeFP16Optimizer (no step hooks, fp32 master weights, steps
skipped on overflow), and the op recipe for that one. Each checks the decay of a zero-gradient step
against the FP64 SVD, a resume through the optimizer's state dict against an uninterrupted run, and
one decay per step against a run that adds the op's increment by hand (Lookahead's interpolation
done by hand too)."""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.optim import SpectralDecay

from integration_recipes import framework, run_recipe

pytorch_optimizer = framework("pytorch_optimizer")

SECTION = "pytorch-optimizer"
P, SPECTRAL_WEIGHT_DECAY = 2, 0.1  # the recipe's decay
K, ALPHA = 3, 0.5  # the recipe's Lookahead
# fp32 weights (the fp16 model's fp32 masters too): the decayed weight rounds once (eps/2 of it), and the
# decay's step lr * lambda * S_2(W), 1.2e-3 of W at lr 0.02, is computed in fp32 from the Gram's
# factorisation, good to a few hundred eps of itself: a few eps of W in all. 16 eps leaves room.
TOLERANCE = 16 * torch.finfo(torch.float32).eps
OVERFLOWING_STEP = 2  # train_fp16's batches: this one's targets overflow the fp16 gradients


@pytest.fixture(scope="module")
def recipe():
    return run_recipe(SECTION)


def make_model(half=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    return model.half() if half else model


def batches(start, count, overflow_at=None):
    generator = torch.Generator().manual_seed(1000 + start)
    data = [(torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)) for _ in range(count)]
    return [(inputs, targets * (1e4 if start + index == overflow_at else 1))
            for index, (inputs, targets) in enumerate(data)]


def matrices_of(params):
    return [param for param in params if param.ndim == 2]


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# Each shape: its builder, how it trains, the parameters the decay acts on (a model's, or a SafeFP16Optimizer's
# fp32 masters), and whether the model is fp16.
SHAPES = {
    "lion": ("build_lion", "train", lambda model, optimizer: list(model.parameters()), False),
    "lookahead": ("build_lookahead", "train", lambda model, optimizer: list(model.parameters()), False),
    "fp16": ("build_fp16", "train_fp16", lambda model, optimizer: optimizer.fp32_params, True),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_a_zero_gradient_step_from_empty_state_is_the_fp64_svd_decay(recipe, shape):
    """From empty state a zero gradient makes the update zero (Lion: the sign of a zero momentum;
    AdaBelief: 0 over its eps), so the step is the decay alone, at the optimizer's lr (a fp16 model's
    master weights: the zero gradient copied to them)."""
    build, train, weights, half = SHAPES[shape]
    model = make_model(half)
    recipe[train](model, recipe[build](model), batches(0, 3))
    fresh = recipe[build](model, lr=0.02)
    before = [W.detach().clone() for W in matrices_of(weights(model, fresh))]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    fresh.step()
    for W, param in zip(before, matrices_of(weights(model, fresh))):
        expected = reference.spectral_decay_svd(W, P, 0.02, SPECTRAL_WEIGHT_DECAY)
        assert so.linalg.relative_error(param.detach(), expected) < TOLERANCE
        assert so.linalg.relative_error(W, expected) > 100 * TOLERANCE  # the decay (1.2e-3 of W) is far above it


@pytest.mark.parametrize("shape", SHAPES)
def test_a_resume_through_the_state_dict_continues_bit_for_bit(recipe, shape, tmp_path):
    """Save after 4 steps (inside Lookahead's second period); a new model, optimizer and SpectralDecay
    load it and take 3 more, across a Lookahead sync: 7 uninterrupted steps, bit for bit. (The fp16
    run's loss scale does not change in 7 steps, where its resume would stop being bitwise.)"""
    build, train, weights, half = SHAPES[shape]
    uninterrupted = make_model(half)
    recipe[train](uninterrupted, recipe[build](uninterrupted), batches(0, 4) + batches(4, 3))

    first = make_model(half)
    optimizer = recipe[build](first)
    recipe[train](first, optimizer, batches(0, 4))
    recipe["save"](tmp_path / "checkpoint.pt", first, optimizer)
    resumed = make_model(half)
    optimizer = recipe[build](resumed)
    recipe["resume"](tmp_path / "checkpoint.pt", resumed, optimizer)
    recipe[train](resumed, optimizer, batches(4, 3))
    assert_same(resumed.parameters(), uninterrupted.parameters())


def test_lion_decays_once_per_step(recipe):
    """The recipe's Lion run equals, bit for bit, Lion without the hooks plus one decay per step added
    by hand as attach adds it (the increment from the pre-step weights, added after the step)."""
    attached = make_model()
    recipe["train"](attached, recipe["build_lion"](attached), batches(0, 4))
    by_hand = make_model()
    lion, matrices = pytorch_optimizer.Lion(by_hand.parameters(), lr=1e-4, weight_decay=0.0), matrices_of(
        by_hand.parameters())
    for inputs, targets in batches(0, 4):
        step_with_the_decay_by_hand(by_hand, lion, matrices, 1e-4, inputs, targets)
    assert_same(attached.parameters(), by_hand.parameters())


def step_with_the_decay_by_hand(model, optimizer, matrices, lr, inputs, targets):
    """One step of ``optimizer`` with the decay added as attach adds it: the increment computed from the
    pre-step weights, added after the optimizer's own update."""
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    increments = so.spectral_decay(matrices, P, lr, SPECTRAL_WEIGHT_DECAY, stability="clamp", increment=True)
    optimizer.step()
    with torch.no_grad():
        torch._foreach_add_(matrices, increments)


def test_lookahead_decays_the_fast_weights_once_per_step_before_the_interpolation(recipe):
    """7 steps, syncs at 3 and 6: the recipe's run equals AdaBelief plus one decay per step by hand and
    Lookahead's interpolation by hand after it, bit for bit; a second decay on the wrapper is refused.
    Right after a sync the weights are the slow weights; attached to the wrapper instead, the sync
    step's decay lands after the interpolation, on the fast weights only."""
    attached = make_model()
    lookahead = recipe["build_lookahead"](attached)
    with pytest.raises(ValueError, match="attached to the AdaBelief already decays.*this Lookahead share"):
        SpectralDecay(matrices_of(attached.parameters()), p=P, spectral_weight_decay=SPECTRAL_WEIGHT_DECAY).attach(
            lookahead)  # a second decay, on the wrapper
    recipe["train"](attached, lookahead, batches(0, 7))

    by_hand = make_model()
    params, matrices = list(by_hand.parameters()), matrices_of(by_hand.parameters())
    fast = pytorch_optimizer.AdaBelief(params, lr=1e-3, weight_decay=0.0)
    slow = [param.detach().clone() for param in params]
    for step, (inputs, targets) in enumerate(batches(0, 7), start=1):
        step_with_the_decay_by_hand(by_hand, fast, matrices, 1e-3, inputs, targets)
        with torch.no_grad():
            if step % K == 0:
                torch._foreach_lerp_(params, slow, 1.0 - ALPHA)
                torch._foreach_copy_(slow, params)
    assert_same(attached.parameters(), by_hand.parameters())

    # After 6 steps (a sync), the recipe's weights are its slow weights; the wrapper-attached ones are not.
    for attach_to_wrapper in (False, True):
        model = make_model()
        inner = pytorch_optimizer.AdaBelief(model.parameters(), lr=1e-3, weight_decay=0.0)
        wrapper = pytorch_optimizer.Lookahead(inner, k=K, alpha=ALPHA)
        SpectralDecay(matrices_of(model.parameters()), p=P, spectral_weight_decay=SPECTRAL_WEIGHT_DECAY).attach(
            wrapper if attach_to_wrapper else inner)
        recipe["train"](model, wrapper, batches(0, 6))
        synced = [torch.equal(param, wrapper.state[param]["slow_params"]) for param in matrices_of(model.parameters())]
        assert synced == [not attach_to_wrapper] * 2


def test_safe_fp16_refuses_attach_and_decays_its_masters_once_per_step_none_on_a_skipped_step(recipe):
    """attach on the wrapper names the fix. The recipe's run (decay attached to the inner optimizer, on
    the masters) equals the op recipe's bit for bit over 4 steps, one of them skipped for an overflow,
    on which neither the masters nor the model change; and it differs from the run without the decay."""
    model = make_model(half=True)
    safe = recipe["build_fp16"](model)
    with pytest.raises(TypeError, match=r"SafeFP16Optimizer is a torch.optim.Optimizer without step hooks.*"
                                        r"It wraps an optimizer in \.optimizer \(Lion\): attach to that one"):
        SpectralDecay(matrices_of(model.parameters()), p=P, spectral_weight_decay=SPECTRAL_WEIGHT_DECAY).attach(safe)

    def run(build):
        model = make_model(half=True)
        safe = build(model)
        masters = []
        for batch in batches(0, 4, overflow_at=OVERFLOWING_STEP):
            recipe["train_fp16"](model, safe, [batch])
            masters.append([master.detach().clone() for master in safe.fp32_params])
        assert_same(masters[OVERFLOWING_STEP], masters[OVERFLOWING_STEP - 1])  # the skipped step changed nothing
        assert safe.scaler.loss_scale == 2.0**14  # halved once: the overflow happened
        return model, masters[-1]

    attached, attached_masters = run(recipe["build_fp16"])
    op, op_masters = run(lambda model: recipe["SpectralFP16Optimizer"](
        pytorch_optimizer.Lion(model.parameters(), lr=1e-4, weight_decay=0.0)))
    assert_same(attached_masters, op_masters)
    assert_same(attached.parameters(), op.parameters())
    _, plain_masters = run(lambda model: pytorch_optimizer.SafeFP16Optimizer(
        pytorch_optimizer.Lion(model.parameters(), lr=1e-4, weight_decay=0.0)))
    assert not torch.equal(attached_masters[0], plain_masters[0])


# Each of pytorch-optimizer's options under which it steps with an lr other than its group's (HOST_LR_OPTIONS),
# with the fix the error names: (the refused optimizer, the option's text in the error, the fixed one).
INTERNAL_LRS = {
    "ScheduleFreeAdamW": (lambda params: pytorch_optimizer.ScheduleFreeAdamW(params, lr=0.01, warmup_steps=2),
                          "warmup_steps=2", lambda params: pytorch_optimizer.ScheduleFreeAdamW(params, lr=0.01)),
    "ApolloDQN": (lambda params: pytorch_optimizer.ApolloDQN(params, lr=0.01), "warmup_steps=500",
                  lambda params: pytorch_optimizer.ApolloDQN(params, lr=0.01, warmup_steps=0)),
    "Ranger21": (lambda params: pytorch_optimizer.Ranger21(params, num_iterations=10, lr=0.01),
                 "disable_lr_scheduler=False",
                 lambda params: pytorch_optimizer.Ranger21(params, num_iterations=10, lr=0.01,
                                                          disable_lr_scheduler=True)),
    "AdaFactor": (lambda params: pytorch_optimizer.AdaFactor(params), "relative_step=True",
                  lambda params: pytorch_optimizer.AdaFactor(params, lr=0.01, relative_step=False,
                                                            scale_parameter=False)),
    "AdaFactor scaled": (lambda params: pytorch_optimizer.AdaFactor(params, lr=0.01, relative_step=False),
                         "scale_parameter=True", None),
    "Prodigy": (lambda params: pytorch_optimizer.Prodigy(params), "d=1e-06", None),
    "DAdaptAdam": (lambda params: pytorch_optimizer.DAdaptAdam(params), "d=1e-06", None),
}


@pytest.mark.parametrize("name", INTERNAL_LRS)
def test_an_optimizer_that_steps_with_an_lr_of_its_own_is_refused_naming_the_fix(name):
    """Warm-up inside the step, Adafactor's relative step and parameter scaling, a learning-rate-free
    estimate d: the host steps with an lr the decay cannot read before its step. attach refuses it,
    naming the option; the fixed optimizer (where there is one) takes the decay."""
    refused, option, fixed = INTERNAL_LRS[name]
    W = torch.nn.Parameter(torch.randn(16, 8))
    decay = SpectralDecay([W], p=P, spectral_weight_decay=SPECTRAL_WEIGHT_DECAY)
    with pytest.raises(ValueError, match=rf"{option} .*cannot follow that lr.*To decay at the lr the weights"):
        decay.attach(refused([W]))
    if fixed is not None:
        assert decay.attach(fixed([W]))._attached
