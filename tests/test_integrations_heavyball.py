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
