"""docs/integrations.md's heavyball section, run against the real heavyball: the decay attached to its
Muon and AdamW, eager (``heavyball.utils.compile_mode = None``) and with heavyball's default compiled
updates. Each checks the decay of a zero-gradient step against the FP64 SVD, a resume through the
state dicts against an uninterrupted run (bit for bit), and one decay per step (bit for bit the run
that adds the op's increment by hand around each step); the compiled one also Dynamo's graphs and
graph breaks against heavyball without the decay."""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.optim import SpectralDecay

from integration_recipes import framework, run_recipe

heavyball = framework("heavyball")

SECTION = "heavyball"
P, SPECTRAL_WEIGHT_DECAY = 2, 0.1  # the recipe's decay
MATRIX_LR = {"AdamW": 1e-3, "Muon": 0.02}  # the recipe's default lr is Muon's; AdamW takes an Adam-sized one
# fp32 weights: the decayed weight rounds once (eps/2 of it), and the decay's step lr * lambda * S_2(W),
# under 1% of W here, is computed in fp32 from the Gram's factorisation, good to a few hundred eps of
# itself: a few eps of W in all (2.6e-8 = 0.2 eps measured). 16 eps leaves room for another CPU's products.
TOLERANCE = 16 * torch.finfo(torch.float32).eps
HEAVYBALL_COMPILE_MODE = heavyball.utils.compile_mode  # its default: "max-autotune-no-cudagraphs"


@pytest.fixture
def recipe(monkeypatch):
    """The section's namespace, heavyball eager; heavyball's global compile mode restored afterwards."""
    monkeypatch.setattr(heavyball.utils, "compile_mode", heavyball.utils.compile_mode)
    return run_recipe(SECTION)


def make_model(bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=bias), torch.nn.GELU(), torch.nn.Linear(64, 16, bias=bias))


def batches(start, count):
    generator = torch.Generator().manual_seed(1000 + start)
    return [(torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)) for _ in range(count)]


def matrices_of(model):
    return [param for param in model.parameters() if param.ndim == 2]


def hand_decayed_train(model, optimizers, data, lr):
    """heavyball's step without the hooks, with the decay added by hand, once per step, as attach adds it:
    its increment computed from the pre-step weights, added after the step (docs/optimizers.md)."""
    matrices = matrices_of(model)
    for inputs, targets in data:
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        increments = so.spectral_decay(matrices, P, lr, SPECTRAL_WEIGHT_DECAY, stability="clamp", increment=True)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            torch._foreach_add_(matrices, increments)


def plain_optimizers(model, name, lr):
    """The recipe's optimizers without the decay."""
    others = [param for param in model.parameters() if param.ndim < 2]
    optimizers = [getattr(heavyball, name)(matrices_of(model), lr=lr, weight_decay=0.0)]
    return optimizers + ([heavyball.AdamW(others, lr=1e-3, weight_decay=0.0)] if others else [])


def assert_same_weights(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_a_zero_gradient_step_from_empty_state_is_the_fp64_svd_decay(recipe, name):
    """From empty state a zero gradient makes heavyball's update zero (Adam: 0 / eps; Muon: the
    orthogonalised zero momentum), so the step is the decay alone, at the optimizer's lr."""
    model, lr = make_model(), MATRIX_LR[name]
    recipe["train"](model, recipe["build_optimizers"](model, getattr(heavyball, name), lr=lr), batches(0, 3))
    fresh = recipe["build_optimizers"](model, getattr(heavyball, name), lr=lr)
    before = [param.detach().clone() for param in matrices_of(model)]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    for optimizer in fresh:
        optimizer.step()
    for W, param in zip(before, matrices_of(model)):
        expected = reference.spectral_decay_svd(W, P, lr, SPECTRAL_WEIGHT_DECAY)
        assert so.linalg.relative_error(param.detach(), expected) < TOLERANCE


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_a_resume_through_the_state_dicts_continues_bit_for_bit(recipe, name, tmp_path):
    """Save after 3 steps; a new model, new optimizers and a new SpectralDecay load the checkpoint and
    take 3 more: the weights equal 6 uninterrupted steps bit for bit. The checkpoint holds torch's
    generator, which heavyball's Muon draws from (the new model's initialisation moves it)."""
    build, train, lr = recipe["build_optimizers"], recipe["train"], MATRIX_LR[name]
    uninterrupted = make_model()
    train(uninterrupted, build(uninterrupted, getattr(heavyball, name), lr=lr), batches(0, 3) + batches(3, 3))

    first = make_model()
    optimizers = build(first, getattr(heavyball, name), lr=lr)
    train(first, optimizers, batches(0, 3))
    recipe["save"](tmp_path / "checkpoint.pt", first, optimizers)
    resumed = make_model()
    optimizers = build(resumed, getattr(heavyball, name), lr=lr)
    recipe["resume"](tmp_path / "checkpoint.pt", resumed, optimizers)
    train(resumed, optimizers, batches(3, 3))
    assert_same_weights(resumed, uninterrupted)


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_the_attached_run_decays_once_per_step(recipe, name):
    """The recipe's run equals, bit for bit, heavyball without the hooks plus one decay per step added
    by hand; a decay run twice, or skipped, would change the weights."""
    lr = MATRIX_LR[name]
    attached = make_model()  # each run starts from the same global generator: heavyball's Muon draws from it
    recipe["train"](attached, recipe["build_optimizers"](attached, getattr(heavyball, name), lr=lr), batches(0, 4))
    by_hand = make_model()
    hand_decayed_train(by_hand, plain_optimizers(by_hand, name, lr), batches(0, 4), lr)
    assert_same_weights(attached, by_hand)
    without_decay = make_model()  # and the decay changes the run
    recipe["train"](without_decay, plain_optimizers(without_decay, name, lr), batches(0, 4))
    assert not torch.equal(attached[0].weight, without_decay[0].weight)


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_compiled_the_decay_adds_no_graph_and_no_break_to_heavyballs(recipe, monkeypatch, name):
    """heavyball's default mode compiles its fused updates (fullgraph); the hooks run in step(), outside
    them. A run without the decay (which the test adds by hand, outside any compiled frame) compiles
    heavyball's graphs; the recipe's run then adds no graph, no recompile and no break, and ends on
    the same bits. One matrix, so that heavyball compiles few graphs (a cold compile costs seconds)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(heavyball.utils, "compile_mode", HEAVYBALL_COMPILE_MODE)
    torch._dynamo.reset()
    counters.clear()

    def one_matrix():
        torch.manual_seed(0)  # each run from the same generator: a compiled Muon draws its bits from it too
        return torch.nn.Linear(32, 16, bias=False)

    lr = MATRIX_LR[name]
    by_hand = one_matrix()
    hand_decayed_train(by_hand, plain_optimizers(by_hand, name, lr), batches(0, 3), lr)
    without_decay = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    attached = one_matrix()
    recipe["train"](attached, recipe["build_optimizers"](attached, getattr(heavyball, name), lr=lr), batches(0, 3))
    with_decay = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    assert with_decay == without_decay == ({"AdamW": 1, "Muon": 3}[name], 0)
    assert_same_weights(attached, by_hand)


def test_warmup_steps_is_refused_at_attach_and_at_a_step_naming_the_fix(recipe):
    """heavyball's warmup_steps scales the lr inside its step (heavyball steps at 0.002, 0.004, ... with
    lr=0.01 and warmup_steps=4), where the decay, which reads the group's lr before the step, cannot
    follow it: attach refuses it, and a step refuses it set after attach, before anything is written."""
    W = torch.nn.Parameter(torch.randn(16, 8))
    decay = SpectralDecay([W], p=P, spectral_weight_decay=SPECTRAL_WEIGHT_DECAY)
    warming = heavyball.AdamW([W], lr=0.01, warmup_steps=4)
    fix = r"heavyball.AdamW with warmup_steps=4 .* pass warmup_steps=0 and warm the lr up with a torch LR scheduler"
    with pytest.raises(ValueError, match=fix):
        decay.attach(warming)
    assert not decay._attached and not warming._optimizer_step_pre_hooks
    optimizer = heavyball.AdamW([W], lr=0.01)
    decay.attach(optimizer)
    optimizer.param_groups[0]["warmup_steps"] = 4
    W.grad = torch.randn_like(W)
    before = W.detach().clone()
    with pytest.raises(ValueError, match=fix):
        optimizer.step()
    assert torch.equal(W.detach(), before) and not optimizer.state  # neither heavyball nor the decay wrote


# heavyball warns once that a changed lr is experimental: the schedule here is the point.
@pytest.mark.filterwarnings("ignore:Learning rate changed between steps")
def test_a_torch_lr_scheduler_warms_heavyball_and_the_decay_alike(recipe, monkeypatch):
    """The fix the error names: warmup_steps=0 and torch's LinearLR on heavyball's optimizer. heavyball
    then steps at the scheduled lr (it takes a changed lr), and so does the decay: its step sizes are
    0.002, 0.004, 0.006, 0.008, where heavyball's own warm-up would have left it at 0.01."""
    import spectral_ops.plan

    scales, decay_ = [], spectral_ops.plan.decay_
    monkeypatch.setattr(spectral_ops.plan, "decay_",
                        lambda kernels, W, request: scales.append(float(request.scale)) or decay_(kernels, W, request))
    model = make_model(bias=False)
    optimizers = recipe["build_optimizers"](model, heavyball.AdamW, lr=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizers[0], start_factor=0.2, total_iters=4)
    stepped = []
    for inputs, targets in batches(0, 4):
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizers[0].step()
        stepped.append(float(optimizers[0].param_groups[0]["prev_lr"]))  # the lr heavyball's step used
        optimizers[0].zero_grad()
        scheduler.step()
    # heavyball computes the lr it steps with as a float32 tensor: its rounding, 6e-8 relative.
    assert stepped == pytest.approx([0.002, 0.004, 0.006, 0.008], rel=1e-6)
    # Each step decays the model's two matrices, each at the step's lr.
    expected = [lr for lr in (0.002, 0.004, 0.006, 0.008) for _ in range(2)]
    assert scales == pytest.approx(expected, rel=1e-12)


def split_run(attach_to_split: bool, warmup_steps=0):
    """heavyball's SplitOpt over the model's matrices (an AdamW) and its bias (another), the decay attached
    to the SplitOpt itself or to the AdamW it holds that steps the matrices; the weights after 3 steps."""
    model = make_model(bias=False)
    split = heavyball.SplitOpt([
        {"params": [model[0].weight], "optimizer": heavyball.AdamW, "lr": 1e-2, "weight_decay": 0.0},
        {"params": [model[2].weight], "optimizer": heavyball.AdamW, "lr": 1e-3, "warmup_steps": warmup_steps}])
    hosts = [(split, matrices_of(model))] if attach_to_split else \
        [(optimizer, optimizer.param_groups[0]["params"]) for optimizer in split.optimizers]
    for host, params in hosts:
        SpectralDecay(params, p=P, spectral_weight_decay=SPECTRAL_WEIGHT_DECAY).attach(host)
    for inputs, targets in batches(0, 3):
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        split.step()
        split.zero_grad()
    return list(model.parameters())


def test_attached_to_a_split_opt_each_matrix_decays_at_the_lr_of_the_optimizer_inside_it(recipe):
    """SplitOpt's own group holds no lr: attach(split) reads each matrix's lr in the group of the
    optimizer it holds that steps it, as one decay attached to each inner optimizer does, bit for bit;
    an inner optimizer's warm-up is refused as it is on its own."""
    assert all(torch.equal(a, b) for a, b in zip(split_run(True), split_run(False)))
    with pytest.raises(ValueError, match="heavyball.AdamW with warmup_steps=2"):
        split_run(True, warmup_steps=2)
