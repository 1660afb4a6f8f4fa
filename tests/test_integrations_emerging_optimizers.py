"""docs/integrations.md's NVIDIA Emerging-Optimizers section, run against the real package: its Muon
with SpectralDecay attached (the decay of a zero-gradient step against the FP64 SVD; a run resumed
through Muon's state_dict against the uninterrupted run, bit for bit; one decay per step, against a
twin run that adds the decay by hand), and its three spectral clipping functions next to ours, each
against the FP64 SVD inside its design range, and its hard cap outside it, where it computes what its
iteration's scalar map predicts.

Emerging-Optimizers needs Python >= 3.12: ``make test`` runs this module in a Debian chroot
(docs/testing.md); elsewhere it skips with the reason."""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops import reference
from spectral_ops.linalg import matrix_with_spectrum, relative_error

from integration_recipes import framework, run_recipe

framework("emerging_optimizers")
orthogonalized = framework("emerging_optimizers.orthogonalized_optimizers")  # needs typing.override (3.12)
clipping = orthogonalized.spectral_clipping_utils
newton_schulz = orthogonalized.muon_utils.newton_schulz

SECTION = "NVIDIA Emerging-Optimizers"
LR, P, SPECTRAL_WEIGHT_DECAY = 0.02, 2, 0.1  # the recipe's Muon lr and decay
UNIT_ROUNDOFF = 2.0**-24  # float32's
# The package's fp32 bound on a spectral result against the FP64 SVD (ten fp32 roundoffs of a chain of
# about 20 products, tests/test_thresholds.py): the SVD route, and Polar Express inside its design range,
# where its scalar map is within 1e-15 of the exact sign, so that only fp32 rounding remains.
FP32_BOUND = 2e-5
# Polar Express's design range (arXiv:2505.16932, the coefficients Emerging-Optimizers iterates with):
# the singular values of the Frobenius-normalised operand in [1e-3, 1] are mapped to 1.
DESIGN_LOWER = 1e-3


def make_model(seed=0):
    """A 808-parameter MLP: two matrices (32 x 16, 8 x 32) for Muon, two biases for AdamW."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def make_batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 8, generator=generator)) for _ in range(count)]


# The user's weight for the clipping block: singular values log-spaced from 10 to 0.01, every one more
# than 7% from the block's bounds 0.1 and 1.0.
CLIP_SPECTRUM = torch.logspace(1, -2, 32, dtype=torch.float64)


def recipe(model, batches):
    """The section's blocks, run as written on the user's model, batches and weight; and that weight as given
    (the last block decays it in place)."""
    W = matrix_with_spectrum((32, 48), CLIP_SPECTRUM, torch.float32, seed=2)
    given = W.clone()
    return run_recipe(SECTION, model=model, batches=batches, W=W), given


def matrices(model):
    return [p for p in model.parameters() if p.ndim == 2]


def test_a_zero_gradient_step_is_the_decay_of_the_fp64_svd():
    namespace, _ = recipe(make_model(), make_batches(3))
    muon = namespace["muon"]
    muon.state.clear()  # empty momentum: with a zero gradient Muon's update is exactly 0
    weights = matrices(namespace["model"])
    before = [w.detach().clone() for w in weights]
    for w in weights:
        w.grad = torch.zeros_like(w)
    muon.step()
    for w, old in zip(weights, before):
        expected = reference.spectral_decay_svd(old, P, LR, SPECTRAL_WEIGHT_DECAY)
        # The stored fp32 sum rounds once (a relative UNIT_ROUNDOFF of the result); the decay's own step
        # errs by at most the fp32 bound of its direction, a fraction step/||W|| of the result.
        step = torch.linalg.vector_norm(expected - old.double()) / torch.linalg.vector_norm(expected)
        assert relative_error(w.detach(), expected) <= UNIT_ROUNDOFF + FP32_BOUND * step.item()
        assert not torch.equal(w.detach(), old)


def test_a_run_resumed_through_muons_state_dict_is_the_uninterrupted_run_bit_for_bit(tmp_path):
    batches = make_batches(6)
    model = make_model()
    namespace, _ = recipe(model, batches[:3])
    train_step, muon, adamw = namespace["train_step"], namespace["muon"], namespace["adamw"]
    path = tmp_path / "checkpoint.pt"
    namespace["save_checkpoint"](path, model, muon, adamw)
    for inputs, targets in batches[3:]:
        train_step(model, muon, adamw, inputs, targets)

    resumed = make_model(seed=3)  # other weights: the checkpoint must bring them
    resumed_muon, resumed_adamw = namespace["load_checkpoint"](path, resumed)
    for inputs, targets in batches[3:]:
        train_step(resumed, resumed_muon, resumed_adamw, inputs, targets)

    for (name, param), resumed_param in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(param, resumed_param), name
    for param, resumed_param in zip(matrices(model), matrices(resumed)):
        assert torch.equal(muon.state[param]["momentum_buffer"], resumed_muon.state[resumed_param]["momentum_buffer"])


def test_the_decay_runs_once_per_muon_step_and_not_for_a_matrix_muon_skips():
    """A twin model, stepped by the same Muon without the decay, gets the decay by hand: its increment
    from the pre-step weights, added after Muon's step (what attach does, bit for bit, docs/optimizers.md),
    once per step and only for the matrices with a gradient. A decay run twice, per forward, or on a
    matrix Muon skipped would break the bitwise match."""
    batches = make_batches(4)
    model, twin = make_model(), make_model()
    namespace, _ = recipe(model, [])
    muon, adamw = namespace["muon"], namespace["adamw"]
    twin_muon = orthogonalized.Muon(matrices(twin), lr=LR, weight_decay=0.0)
    twin_adamw = torch.optim.AdamW([p for p in twin.parameters() if p.ndim != 2], lr=1e-3, weight_decay=0.0)

    def gradients(net, inputs, targets, skip_last_matrix):
        """Forward and backward; the last matrix gets no gradient when asked."""
        torch.nn.functional.mse_loss(net(inputs), targets).backward()
        if skip_last_matrix:
            matrices(net)[-1].grad = None

    for index, (inputs, targets) in enumerate(batches):
        skip = index == 2  # Muon steps only what has a gradient: the decay must skip it too
        muon.zero_grad(), adamw.zero_grad()
        gradients(model, inputs, targets, skip)
        muon.step(), adamw.step()

        twin_muon.zero_grad(), twin_adamw.zero_grad()
        gradients(twin, inputs, targets, skip)
        stepped = [w for w in matrices(twin) if w.grad is not None]
        with torch.no_grad():
            increments = so.spectral_decay(stepped, P, LR, SPECTRAL_WEIGHT_DECAY, stability="clamp", increment=True)
            twin_muon.step(), twin_adamw.step()
            torch._foreach_add_(stepped, increments)
        for (name, param), twin_param in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(param, twin_param), (index, name)


def test_the_recipes_clipping_block_is_the_fp64_svd():
    namespace, W = recipe(make_model(), [])
    assert relative_error(namespace["capped"], reference.spectral_clip_svd(W, high=1.0)) < FP32_BOUND
    assert relative_error(namespace["clipped"], reference.spectral_clip_svd(W, 0.1, 1.0)) < FP32_BOUND
    clipped_decay = reference._per_mode(W.double(), lambda s: s - 0.5 * (s - 1.0).clamp_min(0))
    assert relative_error(namespace["decayed"], clipped_decay) < FP32_BOUND
    assert torch.equal(namespace["W"], namespace["decayed"])  # the in-place decay: the same bits


def between(spectrum, index):
    """A bound halfway (geometrically) between two neighbouring singular values, the farthest from both."""
    return (spectrum[index] * spectrum[index + 1]).sqrt().item()


def sign_gaps(singular_values, bound):
    """What Polar Express resolves for the sign of ``bound I - |W|`` (the clip's sign iteration): each
    mode's ``|bound - s|``, Frobenius-normalised."""
    gaps = (bound - singular_values).abs()
    return gaps / torch.linalg.vector_norm(gaps)


@pytest.mark.parametrize("shape", [(64, 128), (128, 64)])
def test_inside_its_design_range_each_clip_is_the_fp64_svds_to_fp32(shape):
    """Singular values log-spaced over kappa = 100 (the smallest 3.7e-3 of ||W||_F), bounds halfway between
    two modes: every Frobenius-normalised value its iterations see is in the design range, so its three
    functions and ours meet the same fp32 bound (measured: theirs 1.4e-6 to 2.9e-6, ours 0.4e-6 to 1.2e-6)."""
    spectrum = torch.logspace(0, -2, 64, dtype=torch.float64)
    W = matrix_with_spectrum(shape, spectrum, torch.float32, seed=0)
    singular_values = torch.linalg.svdvals(W.double())
    low, high = between(spectrum, 42), between(spectrum, 21)
    assert (singular_values / torch.linalg.vector_norm(singular_values)).min() >= DESIGN_LOWER
    assert all(sign_gaps(singular_values, bound).min() >= DESIGN_LOWER / 2 for bound in (low, high))
    # (1e-3 / 2: there its map is 1 - 1e-4 at worst, the nearest mode is 2.6 times that, and fp32 rounding
    # resolves it; measured 6.4e-4 for the lower bound.)

    cap = reference.spectral_clip_svd(W, high=high)
    assert relative_error(orthogonalized.spectral_hardcap(W, high), cap) < FP32_BOUND
    assert relative_error(so.spectral_clip(W, max=high), cap) < FP32_BOUND

    clip = reference.spectral_clip_svd(W, low, high)
    assert relative_error(orthogonalized.spectral_clip(W, low, high), clip) < FP32_BOUND
    assert relative_error(so.spectral_clip(W, min=low, max=high), clip) < FP32_BOUND

    c = 0.5
    clipped_decay = reference._per_mode(W.double(), lambda s: s - c * (s - high).clamp_min(0))
    assert relative_error(clipping.spectral_clipped_weight_decay(W, high, c), clipped_decay) < FP32_BOUND
    assert relative_error(so.spectral_decay(W, 1, c, 1.0, band=so.Band(high, mode="clip")), clipped_decay) < FP32_BOUND


def scalar_map(values):
    """Emerging-Optimizers' Polar Express applied to each value, read through its own ``newton_schulz`` on
    the diagonal matrix of them (normalised by their Frobenius norm, as a matrix with those singular
    values is): a diagonal's products are exact but for one rounding per entry."""
    return torch.diagonal(newton_schulz(torch.diag(values.float()), steps=8, coefficient_type="polar_express")).double()


def test_below_its_design_range_its_hard_cap_is_its_scalar_map_and_ours_is_the_svds():
    """Singular values log-spaced over kappa = 1e4: the smallest are 4.5e-5 of ||W||_F, below the design range,
    where its polar factor maps a mode ``s`` to ``pi < 1``. Its hard cap ``(beta Q + W - A polar(A)^T Q) / 2``,
    ``A = beta Q - W``, then takes a mode below ``beta`` to ``(beta pi + s - pi |beta pi - s|) / 2`` instead of
    ``s``: it is what that prediction says, mode by mode, and 7e-2 off the cap. Ours factorises on a CPU and
    has no such range."""
    spectrum = torch.logspace(0, -4, 64, dtype=torch.float64)
    W = matrix_with_spectrum((64, 128), spectrum, torch.float32, seed=0)
    U, singular_values, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    beta = between(spectrum, 21)
    assert (singular_values / torch.linalg.vector_norm(singular_values)).min() < DESIGN_LOWER / 10

    pi = scalar_map(singular_values)
    sign = scalar_map(beta * pi - singular_values)
    predicted = torch.diag((beta * pi + singular_values - (beta * pi - singular_values) * sign * pi) / 2)
    theirs = orthogonalized.spectral_hardcap(W, beta)
    # On the modes it does not resolve, the iteration's fp32 rounding (UNIT_ROUNDOFF of the normalised
    # iterate) is amplified by the map's slope, at most its slope at 0, the product of its linear
    # coefficients (6.4e3), and scaled by beta: so every entry in the SVD basis is within that of the
    # prediction (measured: 8.4e-7, against 1.6e-5).
    slope_at_zero = scalar_map(torch.tensor([1e-30, 1.0], dtype=torch.float64))[0].item() / 1e-30
    in_basis = U.mT @ theirs.double() @ Vh.mT
    assert (in_basis - predicted).abs().max() < beta * slope_at_zero * UNIT_ROUNDOFF
    assert pi.min() < 0.5  # the smallest modes are far from resolved...
    cap = reference.spectral_clip_svd(W, high=beta)
    assert relative_error(theirs, cap) > 0.05  # ...and its cap is 7e-2 off
    assert relative_error(so.spectral_clip(W, max=beta), cap) < FP32_BOUND
