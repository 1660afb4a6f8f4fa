"""SpectralMuon against torch.optim.Muon, head-wise vs full updates, the internal AdamW."""

import importlib.util
from pathlib import Path

import pytest
import torch
from test_backends_torch import copied_bytes

import spectral_ops as so
from spectral_ops.coefficients import without_normalization_margin
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.optim import SpectralMuon

from optim_models import assert_same_trajectory, batch, tiny_model, train


def torch_style_newton_schulz(G, coefficients, steps, dtype=torch.float64):
    """torch.optim.Muon's iteration (normalise by ||G||_F, then the quintic), in ``dtype``."""
    X = G.to(dtype)
    transposed = X.shape[0] > X.shape[1]
    X = X.T if transposed else X
    X = X / X.norm()
    a, b, c = coefficients
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transposed else X


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20)])
def test_muon_quintic_through_polar_is_torch_muons_iteration(shape):
    G = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape), 100), torch.float64, seed=1)
    coefficients = without_normalization_margin((so.MUON_QUINTIC,) * 5)
    ours = so.polar(G, coefficients=coefficients)
    assert relative_error(ours, torch_style_newton_schulz(G, so.MUON_QUINTIC, 5)) < 1e-12


def test_p1_with_torch_coefficients_tracks_torch_muon_in_bf16():
    model_a, model_b = tiny_model(bias=False), tiny_model(bias=False)
    options = dict(lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="original")
    ours = SpectralMuon(model_a.parameters(), ns_coefficients=so.MUON_QUINTIC, p=1, **options)
    assert ours.param_groups[0]["precision"] == "bf16"  # torch.optim.Muon's operands, by default
    theirs = torch.optim.Muon(model_b.parameters(), ns_coefficients=so.MUON_QUINTIC, **options)
    # Both run the quintic on bf16 operands (unit roundoff u = 2^-8) but round at different places
    # (torch normalises in bf16, spectral_ops in fp32), so each step's directions differ by up to
    # two independent round-offs times the quintic's gain (< 4 on its range): per step
    # |delta W| <~ adjusted lr (<= 2e-2 * sqrt(2)) * 2 * 4 * 2^-8 ~ 8.8e-4, <~ 1.3e-2 after 15 steps
    # (measured: 2.2e-3). The decay halves (identical math) agree to fp32 round-off.
    assert_same_trajectory(train(model_a, ours, 15), train(model_b, theirs, 15), atol=1.3e-2)


def test_fp32_orthogonalisation_matches_a_float32_newton_schulz():
    G = matrix_with_spectrum((24, 16), log_spaced_spectrum(16, 100), torch.float32, seed=3)
    weight = torch.nn.Parameter(torch.zeros(24, 16))
    weight.grad = G.clone()
    SpectralMuon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, ns_coefficients=so.MUON_QUINTIC,
                 ns_steps=5, adjust_lr_fn=lambda lr, shape: lr, precision="fp32").step()
    expected = torch_style_newton_schulz(G, so.MUON_QUINTIC, 5, dtype=torch.float32)
    assert relative_error(-weight.detach(), expected) < 1e-5


def test_match_rms_adamw_scale():
    weight = torch.nn.Parameter(torch.zeros(32, 8))
    weight.grad = matrix_with_spectrum((32, 8), torch.ones(8), torch.float32, seed=2)
    SpectralMuon([weight], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, precision="fp32").step()
    # One step from zero momentum: the update is -lr * 0.2 sqrt(32) * polar(G) and polar(G) = G here.
    expected = -0.1 * 0.2 * 32**0.5 * weight.grad
    assert relative_error(weight.detach(), expected) < 1e-5


def one_step(param_values, **options):
    """One float64 step; the orthogonalisation follows the dtype (fp64), so results are exact to ~1e-12."""
    options.setdefault("precision", None)
    weight = torch.nn.Parameter(param_values.clone())
    weight.grad = matrix_with_spectrum(param_values.shape, log_spaced_spectrum(min(param_values.shape), 10),
                                       torch.float64, seed=7)
    SpectralMuon([weight], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, **options).step()
    return weight.detach(), weight.grad


def test_one_head_equals_full_matrix():
    W = torch.zeros(16, 12, dtype=torch.float64)
    headwise, _ = one_step(W, heads=1)
    full, _ = one_step(W)
    assert torch.equal(headwise, full)


def test_head_wise_update_orthogonalises_each_head_with_the_full_projection_scale():
    W = torch.zeros(16, 12, dtype=torch.float64)
    result, G = one_step(W, heads=4)
    scale = 0.1 * 0.2 * 16**0.5  # the full 16 x 12 projection's match_rms_adamw scale
    expected = torch.cat([so.reference.polar_svd(block) for block in G.split(4)]) * -scale
    assert relative_error(result, expected) < 1e-12


def test_fused_qkv_with_recipe_equals_separate_projections():
    d, heads = 8, 2
    grads = [matrix_with_spectrum((d, 12), log_spaced_spectrum(d, 10), torch.float64, seed=s) for s in (1, 2, 3)]
    fused = torch.nn.Parameter(torch.zeros(3 * d, 12, dtype=torch.float64))
    fused.grad = torch.cat(grads)
    SpectralMuon([{"params": [fused], "splits": (d, d, d), "recipe": "HHF", "heads": heads}], lr=0.1,
                 weight_decay=0.0, momentum=0.0, nesterov=False).step()
    separate = [torch.nn.Parameter(torch.zeros(d, 12, dtype=torch.float64)) for _ in range(3)]
    for param, grad in zip(separate, grads):
        param.grad = grad.clone()
    SpectralMuon([{"params": separate[:2], "heads": heads}, {"params": separate[2:]}], lr=0.1,
                 weight_decay=0.0, momentum=0.0, nesterov=False).step()
    assert relative_error(fused.detach(), torch.cat([p.detach() for p in separate])) < 1e-12


def test_spectral_decay_in_muon_uses_pre_update_weights_and_the_unadjusted_lr():
    W0 = matrix_with_spectrum((16, 12), log_spaced_spectrum(12, 10), torch.float64, seed=5)
    decayed, G = one_step(W0, p=2, spectral_weight_decay=0.3)
    plain, _ = one_step(W0)
    assert relative_error(decayed, plain - 0.1 * 0.3 * so.reference.spectral_power_svd(W0, 2)) < 1e-12


def test_adamw_groups_inside_muon_match_torch_adamw():
    model_a, model_b = tiny_model(), tiny_model()
    matrices_a = [p for p in model_a.parameters() if p.ndim == 2]
    vectors_a = [p for p in model_a.parameters() if p.ndim < 2]
    ours = SpectralMuon([{"params": matrices_a}, {"params": vectors_a, "algorithm": "adamw", "lr": 3e-3,
                                                  "weight_decay": 0.01, "betas": (0.9, 0.999)}], lr=2e-2)
    trajectory = train(model_a, ours, 10)
    vectors_b = [p for p in model_b.parameters() if p.ndim < 2]
    matrices_b = [p for p in model_b.parameters() if p.ndim == 2]
    reference_adamw = torch.optim.AdamW(vectors_b, lr=3e-3, weight_decay=0.01, foreach=False)
    reference_muon = SpectralMuon(matrices_b, lr=2e-2)
    for step, params in enumerate(trajectory):
        inputs, targets = batch(step)
        reference_adamw.zero_grad()
        reference_muon.zero_grad()
        torch.nn.functional.mse_loss(model_b(inputs), targets).backward()
        reference_adamw.step()
        reference_muon.step()
        for ours_param, their_param in zip(params, model_b.parameters()):
            torch.testing.assert_close(ours_param, their_param.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("group, match", [
    ({"params": [torch.nn.Parameter(torch.zeros(4))]}, "algorithm='adamw'"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "splits": (4, 4)}, "sum to the 12 rows"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "splits": (4, 4, 4), "recipe": "HH"}, "one letter"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "recipe": "H"}, "heads is not set"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "heads": 5}, "does not split into 5 heads"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "momentum": 1.0}, "momentum"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "adjust_lr_fn": "sqrt"}, "adjust_lr_fn"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "ns_coefficients": (1.0, 2.0)}, "coefficients"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "algorithm": "lion"}, "algorithm"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "update_power": 0.5,
      "ns_coefficients": so.MUON_QUINTIC}, "converged polar factor"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "update_power": float("nan")}, "finite real"),
    ({"params": [torch.nn.Parameter(torch.zeros(12, 4))], "update_power": -0.25, "update_eps": 0.0}, "update_eps"),
])
def test_bad_groups_raise_at_construction(group, match):
    with pytest.raises(ValueError, match=match):
        SpectralMuon([group])


@pytest.mark.parametrize("shape", [(32, 8), (8, 32)])
def test_spectral_scale_is_the_modular_dual_scale(shape):
    """SPEC 6: a linear layer's natural norm is sqrt(fan_in/fan_out) ||W||_2, so the dual step is the polar
    factor times sqrt(fan_out/fan_in); fan_out = rows, fan_in = cols of a torch weight."""
    rows, cols = shape
    weight = torch.nn.Parameter(torch.zeros(shape))
    weight.grad = matrix_with_spectrum(shape, torch.ones(min(shape)), torch.float32, seed=2)
    SpectralMuon([weight], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, adjust_lr_fn="spectral",
                 precision="fp32").step()
    # One step from zero momentum, and polar(G) = G (unit singular values): the update is -lr sqrt(rows/cols) G.
    # fp32 round-off of the polar iteration bounds the error (as in the match_rms_adamw test).
    expected = -0.1 * (rows / cols) ** 0.5 * weight.grad
    assert relative_error(weight.detach(), expected) < 1e-5


def test_spectral_scale_is_accepted_per_group_and_by_add_param_group():
    optimizer = SpectralMuon([{"params": [torch.nn.Parameter(torch.zeros(12, 4))], "adjust_lr_fn": "spectral"}])
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 12))], "adjust_lr_fn": "spectral"})
    assert [group["adjust_lr_fn"] for group in optimizer.param_groups] == ["spectral", "spectral"]


# ----- Copies per step: at most torch.optim.Muon's at equal settings (issue [portable])

MUON_SETTINGS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
# Per iteration: SpectralMuon's options, and the steps torch.optim.Muon runs for the same products. Every
# step's two epilogues copy their added term in both, so Polar Express (8 steps) is held to torch's
# quintic run for 8 steps.
ITERATIONS = {"NS5": (dict(ns_coefficients=so.MUON_QUINTIC, ns_steps=5), 5), "Polar Express": ({}, 8)}


def muon_pair(heads, shape, iteration, precision):
    """Ours on one matrix of ``heads`` heads of ``shape``; torch's on one parameter per head."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(heads * shape[0], shape[1], generator=generator)
    ours = torch.nn.Parameter(torch.zeros_like(gradient))
    ours.grad = gradient.clone()
    theirs = [torch.nn.Parameter(torch.zeros(shape)) for _ in range(heads)]
    for param, grad in zip(theirs, gradient.split(shape[0])):
        param.grad = grad.clone()
    options, torch_steps = ITERATIONS[iteration]
    head_options = {"heads": heads} if heads > 1 else {}
    return (SpectralMuon([ours], **MUON_SETTINGS, **options, **head_options, precision=precision),
            torch.optim.Muon(theirs, **MUON_SETTINGS, ns_steps=torch_steps))


class _TorchWithFloat32ForBfloat16:
    """The torch module as torch.optim.Muon sees it, with ``torch.bfloat16`` meaning ``torch.float32``."""

    bfloat16 = torch.float32

    def __getattr__(self, name):
        return getattr(torch, name)


def iterate_torch_muon_in_fp32(monkeypatch):
    """torch.optim.Muon always iterates in bf16; against an fp32 iteration it runs with its cast to bf16
    made one to fp32, however its release spells the cast: ``grad.bfloat16()`` up to torch 2.14,
    ``grad.to(dtype=torch.bfloat16, copy=True)`` from 2.15."""
    monkeypatch.setattr(torch.Tensor, "bfloat16", torch.Tensor.float)
    monkeypatch.setattr(torch.optim._muon, "torch", _TorchWithFloat32ForBfloat16())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("iteration", list(ITERATIONS))
@pytest.mark.parametrize("heads, shape", [(1, (128, 64)), (1, (64, 128)), (1, (96, 96)), (2, (64, 64)), (4, (16, 64))],
                         ids=["tall", "wide", "square", "2 square heads", "4 wide heads"])
def test_a_step_copies_no_more_than_torch_muon(monkeypatch, heads, shape, iteration, precision):
    """Bytes copied in a step with a momentum (``copied_bytes``'s unprofiled first step makes it): the
    epilogues' copies of their added term, the casts to and from the iteration's dtype, nothing else.
    torch.optim.Muon always iterates in bf16; against an fp32 iteration it runs with its bf16 cast made
    an fp32 one (``iterate_torch_muon_in_fp32``). All of these fail on the code before [portable] (its
    batch-of-one products, the gather and scatter of a lone matrix and the momentum's copy each copied
    more)."""
    ours, theirs = muon_pair(heads, shape, iteration, precision)
    ours_bytes = copied_bytes(ours.step)
    if precision == "fp32":
        iterate_torch_muon_in_fp32(monkeypatch)
    theirs_bytes = copied_bytes(theirs.step)
    assert ours_bytes <= theirs_bytes


_spec = importlib.util.spec_from_file_location("decay_memory", Path(__file__).parents[1] / "bench" / "decay_memory.py")
decay_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decay_memory)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("iteration", list(ITERATIONS))
@pytest.mark.parametrize("heads, shape", [(1, (128, 64)), (1, (64, 128)), (1, (96, 96)), (4, (16, 64))],
                         ids=["tall", "wide", "square", "4 wide heads"])
def test_a_step_holds_no_more_than_torch_muon(monkeypatch, heads, shape, iteration, precision):
    """The peak of the tensors a step allocates (net of frees, torch.profiler's allocation events, after a
    step that makes the momentum): at most torch.optim.Muon's, one full-size temporary in the weight's
    dtype (the update) and the iteration's operands. A larger one makes the allocator grow and trim its
    heap every step, and a step on a CPU then spends milliseconds in page faults (3,000 a step at
    2048x512, against torch's ~0). Library scratch inside the products is left out: both run the same
    products. Head-wise updates are one batched call, held to torch's on the whole matrix (torch's own
    way to head-wise updates, a parameter per head, holds one head's temporaries at a time). Fails on the
    code before this test: the new momentum, the fp32 normalisation, the fp32 copy of the direction and
    the operand and Gram held through the iteration each held one more temporary."""
    ours, theirs = muon_pair(heads, shape, iteration, precision)
    if heads > 1:
        whole = torch.nn.Parameter(torch.zeros(heads * shape[0], shape[1]))
        whole.grad = ours.param_groups[0]["params"][0].grad.clone()
        theirs = torch.optim.Muon([whole], **MUON_SETTINGS, ns_steps=ITERATIONS[iteration][1])
    ours_peak = decay_memory.peak(ours.step).tensors
    if precision == "fp32":
        iterate_torch_muon_in_fp32(monkeypatch)
    theirs_peak = decay_memory.peak(theirs.step).tensors
    assert ours_peak <= theirs_peak + SLACK


# 0-d tensors (norms, scales, the finiteness flags): a few bytes each, whatever the matrix size.
SLACK = 1024


@pytest.mark.parametrize("q", [0, 0.0, lambda step: 0])
def test_update_power_zero_is_muon_bit_for_bit(q):
    models = tiny_model(), tiny_model()
    plain = train(models[0], SpectralMuon([p for p in models[0].parameters() if p.ndim == 2], lr=2e-2), 4)
    power = train(models[1], SpectralMuon([p for p in models[1].parameters() if p.ndim == 2], lr=2e-2,
                                          update_power=q), 4)
    assert_same_trajectory(plain, power, atol=0)


@pytest.mark.parametrize("q", [-0.25, 0.1155, 0.5])
@pytest.mark.parametrize("heads", [None, 2])
def test_update_power_is_the_floored_power_of_each_head(q, heads):
    # fp64 operands: the construction's own error (designed for 1e-13) is what the 1e-9 bound checks.
    W = torch.zeros(16, 12, dtype=torch.float64)
    result, G = one_step(W, heads=heads, update_power=q)
    blocks = G.reshape(heads or 1, -1, 12)
    expected = so.reference.power_update_svd(blocks, q, 1e-2).reshape(16, 12) * -(0.1 * 0.2 * 16**0.5)
    assert relative_error(result, expected) < 1e-9


def test_a_callable_update_power_is_followed_step_by_step():
    schedule = [0.25, -0.2, 0.0, 0.1155]
    seen = []

    def q(step):
        seen.append(step)
        return schedule[step]

    weight = torch.nn.Parameter(torch.zeros(24, 16, dtype=torch.float64))
    optimizer = SpectralMuon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, precision=None,
                             adjust_lr_fn=lambda lr, shape: lr, update_power=q)
    for step, power in enumerate(schedule):
        weight.grad = matrix_with_spectrum((24, 16), log_spaced_spectrum(16, 100), torch.float64, seed=step)
        before = weight.detach().clone()
        optimizer.step()
        assert relative_error(before - weight.detach(), so.reference.power_update_svd(weight.grad, power, 1e-2)) < 1e-9
    assert seen == [0, 1, 2, 3] and optimizer.state[weight]["step"] == 4


def test_a_bad_scheduled_power_raises_before_any_weight_changes():
    weight = torch.nn.Parameter(torch.ones(8, 4))
    weight.grad = torch.randn(8, 4)
    optimizer = SpectralMuon([weight], update_power=lambda step: float("inf"))
    with pytest.raises(ValueError, match="update_power must be a finite real number"):
        optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(8, 4))


def test_a_tensor_update_power_stays_on_the_device_in_a_capturable_step():
    from test_optim_capturable import host_reads_forbidden

    G = matrix_with_spectrum((24, 16), log_spaced_spectrum(16, 100), torch.float32, seed=3)
    q = torch.tensor(-0.2)
    results = []
    for power, capturable in ((q, True), (-0.2, False)):
        weight = torch.nn.Parameter(torch.zeros(24, 16))
        optimizer = SpectralMuon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False,
                                 precision="fp32", adjust_lr_fn=lambda lr, shape: lr, update_power=power,
                                 capturable=capturable)
        weight.grad = G.clone()
        optimizer.step()  # the first step creates the state
        if capturable:
            with host_reads_forbidden():
                optimizer.step()
        else:
            optimizer.step()
        results.append(weight.detach() / -2)
    # fp32 products; the tensor's polynomials are designed for the whole span |q| <= 1, the number's for -0.2.
    assert relative_error(results[0], so.reference.power_update_svd(G, -0.2, 1e-2)) < 2e-5
    assert relative_error(results[0], results[1].double()) < 2e-5


def test_a_state_saved_without_a_step_count_loads():
    weight = torch.nn.Parameter(torch.zeros(8, 4))
    weight.grad = torch.randn(8, 4)
    optimizer = SpectralMuon([weight], update_power=lambda step: 0.25 if step else 0.5)
    optimizer.step()
    state = optimizer.state_dict()
    del state["state"][0]["step"]  # as saved by a release without update_power
    optimizer.load_state_dict(state)
    assert optimizer.state[weight]["step"] == 0
    optimizer.step()
