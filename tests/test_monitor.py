"""SpectralMonitor in one process, against the FP64 SVD: the power iteration's estimate and its proven
bound, the exact metrics (Frobenius, stable rank, effective lr), the per-head QK logit bound (GQA), stacks,
conv filters and tied weights, low precision, the decay counts, its cost in FLOPs, and bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from spectral_ops.linalg import matrix_with_spectrum
from spectral_ops.monitor import SpectralMonitor, decay_counts, power_iterations
from spectral_ops.monitor.power import initial_vectors
from spectral_ops.optim import SpectralAdamW, SpectralDecay

from integration_recipes import assert_bitwise_equal
from optim_models import batch, tiny_model


def svd_s(W: torch.Tensor) -> torch.Tensor:
    """The oracle: singular values of ``W``'s values in FP64, largest first."""
    return torch.linalg.svdvals(W.detach().to(torch.float64))


def power_bound(W: torch.Tensor, start: torch.Tensor, iterations: int) -> float:
    """The relative error the estimate may have after ``iterations`` from ``start`` (power.py's docstring).

    The estimate is the Rayleigh quotient of ``A^T A`` at ``v_{k-1}``, whose components along the right
    singular vectors are ``c_i s_i^(2(k-1))``; so ``s_1^2 - R <= s_1^2 tan(theta)^2 (s_2/s_1)^(4(k-1))``, and
    ``1 - sqrt(R)/s_1`` is at most that relative gap."""
    _, s, Vh = torch.linalg.svd(W.detach().to(torch.float64))
    c = Vh @ start.to(torch.float64)
    tan2 = float((c[1:] ** 2).sum() / c[0] ** 2)
    return tan2 * float(s[1] / s[0]) ** (4 * (iterations - 1))


def bounds(monitor: SpectralMonitor, stack, matrices: torch.Tensor) -> list[float]:
    """:func:`power_bound` of each of ``stack``'s matrices after the monitor's first call."""
    starts = initial_vectors(matrices.shape[0], matrices.shape[-1], torch.float64, "cpu", stack.seed)
    return [power_bound(W, start, monitor.first_iterations) for W, start in zip(matrices, starts)]


# fp32 power iteration on these sizes: products of <= 64 terms rounded at 2^-24 each, over 60 iterations that
# renormalise every time (errors do not compound): 1e-5 relative holds with a wide margin.
FP32_ROUNDING = 1e-5


@pytest.mark.parametrize("iterations", [1, 3, 8])
def test_the_estimate_is_a_lower_bound_within_its_proven_error(iterations):
    s = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.1, 0.01])
    W = matrix_with_spectrum((6, 9), s, dtype=torch.float64, seed=1)
    start = initial_vectors(1, 9, torch.float64, "cpu", seed=3)
    estimate, _ = power_iterations(W[None], start, iterations)
    error = 1 - float(estimate[0]) / float(s[0])
    # FP64 rounding: a few ulps of the products, far below the smallest bound here (~1e-9 at 8 iterations).
    assert -1e-14 <= error <= power_bound(W, start[0], iterations) + 1e-14


def test_a_warm_start_adds_the_iterations_of_every_call():
    """Three calls on a fixed matrix are the power iteration run for all their iterations at once."""
    s = torch.tensor([2.0, 1.9, 1.0, 0.5])  # a small gap: each iteration gains (1.9/2)^4 = 0.81
    model = torch.nn.Linear(4, 4, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(matrix_with_spectrum((4, 4), s, seed=2))
    monitor = SpectralMonitor(model, first_iterations=3, iterations=2, tolerance=0)  # no rounds past these
    values = [monitor.compute()["spectral.s_max/weight"] for _ in range(3)]
    start = initial_vectors(1, 4, torch.float64, "cpu", seed=monitor.stacks[0].seed)[0]
    for calls, value in enumerate(values, start=1):
        # One vector update per iteration, the estimate taken before the last: 3 + 2 (calls - 1) iterations.
        bound = power_bound(model.weight, start, 3 + 2 * (calls - 1))
        assert 0 <= 1 - value / 2.0 <= bound + 1e-14
    assert values[0] < values[1] < values[2]


def test_metrics_of_a_model_match_the_fp64_svd():
    """On a random model (fp32): Frobenius and the effective lr exact up to fp32 rounding; s_max a lower
    bound within the power iteration's proven error (computed from the oracle's spectrum and the start)."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = SpectralMonitor(model, optimizer, first_iterations=60)
    values = monitor.compute()
    stacks = {stack.name: stack for stack in monitor.stacks}
    assert stacks and {k.split("/", 1)[1] for k in values if k.startswith("spectral.s_max/")} == set(stacks)
    for name, stack in stacks.items():
        W = stack.param.detach()
        s = svd_s(W)
        frobenius = float(torch.linalg.vector_norm(s))
        error = 1 - values[f"spectral.s_max/{name}"] / float(s[0])
        [bound] = bounds(monitor, stack, W[None])
        assert -FP32_ROUNDING <= error <= bound + FP32_ROUNDING
        assert values[f"spectral.frobenius/{name}"] == pytest.approx(frobenius, rel=FP32_ROUNDING)
        # ||W||_F^2 / s^2: the estimate's error twice, and no more.
        ratio = values[f"spectral.stable_rank/{name}"] / (frobenius**2 / float(s[0]) ** 2)
        assert 1 - 4 * FP32_ROUNDING <= ratio <= (1 - bound) ** -2 + 4 * FP32_ROUNDING
        assert values[f"spectral.effective_lr/{name}"] == pytest.approx(3e-3 / frobenius, rel=FP32_ROUNDING)


def test_exact_takes_the_svd():
    model = tiny_model()
    values = SpectralMonitor(model, exact=True).compute()
    for name, W in model.named_parameters():
        if W.ndim == 2:
            assert values[f"spectral.s_max/{name.removesuffix('.weight')}"] == pytest.approx(float(svd_s(W)[0]),
                                                                                              rel=1e-12)


def llama(heads=4, kv_heads=2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=16, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_the_qk_bound_is_each_heads_product_of_spectral_norms(heads, kv_heads):
    """SPEC 11's bound per q head h: s_max(W_q^h) s_max(W_k^g), g = h // (heads / kv_heads), each from the
    FP64 SVD of the head's rows; the module's scalar is its worst head."""
    model = llama(heads, kv_heads)
    monitor = SpectralMonitor(model, per_head=True, first_iterations=60)
    values = monitor.compute()
    for layer in range(2):
        path = f"model.layers.{layer}.self_attn"
        q_stack, k_stack, _, _ = monitor.attention[path]
        d = 32 // heads
        q = q_stack.param.detach().view(heads, d, 32)
        k = k_stack.param.detach().view(kv_heads, d, 32)
        q_bounds, k_bounds = bounds(monitor, q_stack, q), bounds(monitor, k_stack, k)
        for h in range(heads):
            g = h // (heads // kv_heads)
            expected = float(svd_s(q[h])[0] * svd_s(k[g])[0])
            # Each factor is low by at most its bound: the product by at most their sum.
            error = 1 - values[f"spectral.qk_bound/{path}.h{h}"] / expected
            assert -2 * FP32_ROUNDING <= error <= q_bounds[h] + k_bounds[g] + 2 * FP32_ROUNDING
        assert values[f"spectral.qk_bound/{path}"] == max(values[f"spectral.qk_bound/{path}.h{h}"]
                                                          for h in range(heads))


def test_a_tied_embedding_is_reported_once_and_the_model_is_not_written():
    model = llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    values = SpectralMonitor(model).compute()
    assert "spectral.s_max/model.embed_tokens" in values and "spectral.s_max/lm_head" not in values
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.Parameter(matrix_with_spectrum((3, 5, 4), torch.tensor([[3.0, 1, 0.5, 0.1]] * 3)
                                                               * torch.tensor([[1.0], [2.0], [3.0]]),
                                                               dtype=torch.float32))
        self.conv = torch.nn.Conv2d(2, 3, 2, bias=False)


def test_a_stack_reports_each_matrix_and_a_conv_filter_its_flattened_matrix():
    model = Experts()
    values = SpectralMonitor(model, first_iterations=60).compute()
    for i in range(3):
        assert values[f"spectral.s_max/experts.{i}"] == pytest.approx(3.0 * (i + 1), rel=1e-5)
    conv = svd_s(model.conv.weight.reshape(3, -1))
    assert values["spectral.s_max/conv"] == pytest.approx(float(conv[0]), rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_are_read_in_fp32(dtype):
    """A bf16/fp16 weight's values are exact in fp32: the metrics are those of its values, to fp32 rounding."""
    monitor = SpectralMonitor(tiny_model().to(dtype), first_iterations=60)
    values = monitor.compute()
    for stack in monitor.stacks:
        W = stack.param.detach()
        s = svd_s(W)
        [bound] = bounds(monitor, stack, W[None])
        assert -FP32_ROUNDING <= 1 - values[f"spectral.s_max/{stack.name}"] / float(s[0]) <= bound + FP32_ROUNDING
        assert values[f"spectral.frobenius/{stack.name}"] == pytest.approx(float(torch.linalg.vector_norm(s)),
                                                                          rel=FP32_ROUNDING)


def test_a_compiled_model_reports_its_modules_by_their_own_names():
    model = llama()
    assert SpectralMonitor(torch.compile(model)).compute() == SpectralMonitor(model).compute()


def test_an_enclosing_autocast_changes_nothing():
    """A host may call it inside its autocast (a callback of a mixed-precision loop): the values are the
    ones outside, bit for bit, not bf16 products."""
    model = tiny_model()
    outside = SpectralMonitor(model).compute()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = SpectralMonitor(model).compute()
    assert inside == outside


def test_a_zero_matrix_reports_zeros_not_nan():
    model = torch.nn.Linear(3, 4, bias=False)
    torch.nn.init.zeros_(model.weight)
    values = SpectralMonitor(model, torch.optim.SGD(model.parameters(), lr=0.1)).compute()
    assert values["spectral.s_max/weight"] == 0 and values["spectral.stable_rank/weight"] == 0
    assert values["spectral.effective_lr/weight"] == float("inf")  # no scale to turn: metrics.effective_lr's rule


def test_a_non_finite_weight_reports_non_finite_metrics_not_zeros():
    model = torch.nn.Linear(3, 4, bias=False)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    values = SpectralMonitor(model).compute()
    assert all(math.isnan(values[f"spectral.{metric}/weight"]) for metric in ("s_max", "frobenius", "stable_rank"))


def test_the_range_fp32_iterates_in():
    """The iteration forms ``A^T A v``, of size ``s_max^2``: fp32 holds it while s_max is below ~1.8e19 (here
    1e15: s_max^2 = 1e30), power.py's documented range; beyond it, ``exact=True`` computes in fp64."""
    for scale, options in ((1e15, {}), (1e30, {"exact": True})):
        model = torch.nn.Linear(3, 4, bias=False)
        with torch.no_grad():
            model.weight.copy_(matrix_with_spectrum((4, 3), torch.tensor([1.0, 0.5, 0.25]), seed=5) * scale)
        s = svd_s(model.weight)
        values = SpectralMonitor(model, **options).compute()
        # s_2/s_1 = 0.5: 30 iterations leave ~0.5^116 of the error; fp32 rounding remains.
        assert values["spectral.s_max/weight"] == pytest.approx(float(s[0]), rel=FP32_ROUNDING)
        assert values["spectral.frobenius/weight"] == pytest.approx(float(torch.linalg.vector_norm(s)),
                                                                   rel=FP32_ROUNDING)


def test_complex_and_meta_parameters_are_refused_when_it_is_built():
    with pytest.raises(TypeError, match="complex64: the monitor reads real matrices; leave it out with include="):
        SpectralMonitor(torch.nn.Linear(3, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="on the meta device: build the monitor after"):
        SpectralMonitor(torch.nn.Linear(3, 4, device="meta"))
    model = torch.nn.Linear(3, 4, dtype=torch.complex64)
    assert SpectralMonitor(model, include=lambda name, param: not param.is_complex()).compute() == {}


def step(model, optimizer, index, nan=False):
    inputs, targets = batch(index)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    if nan:
        next(model.parameters()).grad.fill_(float("nan"))
    optimizer.step()


def test_the_decay_counts_of_a_family_optimizer_and_of_an_attached_decay():
    model = tiny_model()
    family = SpectralAdamW(model.parameters(), lr=1.0, p=2, spectral_weight_decay=1e3)  # clamped by the guard
    host = torch.optim.AdamW(tiny_model().parameters(), lr=1e-3)
    SpectralDecay([p for group in host.param_groups for p in group["params"] if p.ndim == 2], p=2,
                  spectral_weight_decay=0.1).attach(host)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = SpectralMonitor(model, {"family": family, "host": host, "plain": plain})
    with pytest.warns(RuntimeWarning, match="skipped"):
        step(model, family, 0, nan=True)
    step(model, family, 1)
    state = copy.deepcopy(family.state_dict())
    values = monitor.compute()
    assert_bitwise_equal(family.state_dict(), state)  # the monitor only reads
    assert values["spectral.decay/family.skipped"] == 1
    assert values["spectral.decay/family.decays"] == 2
    clamped = sum(int(record.count) for record in family.clamped.values())
    assert clamped > 0 and values["spectral.decay/family.clamped"] == clamped
    assert values["spectral.decay/family.smallest_clamp_factor"] == pytest.approx(
        min(float(record.smallest_factor) for record in family.clamped.values()))
    assert values["spectral.decay/host.decays"] == 0 and values["spectral.decay/host.skipped"] == 0
    assert not any(key.startswith("spectral.decay/plain") for key in values)
    assert decay_counts(plain) == {}
    monitor.close()
    step(model, family, 2)
    assert monitor.compute()["spectral.decay/family.decays"] == 2  # no longer counted


def test_a_call_costs_two_matrix_vector_products_per_matrix_and_iteration():
    """The cost is O(mn) per matrix: each iteration is A v and A^T u, 2 m n FLOPs each (torch counts a
    multiply-add as 2); the QK bound runs the same on the q and k head stacks. No O(mn min(m, n)) work."""
    model = llama()
    monitor = SpectralMonitor(model, iterations=2, first_iterations=2, tolerance=0)
    with FlopCounterMode(display=False) as counter:
        monitor.compute()
    matrices = [p for name, p in model.named_parameters() if p.ndim == 2]
    attention = [p for layer in model.model.layers for p in (layer.self_attn.q_proj.weight,
                                                              layer.self_attn.k_proj.weight)]
    products = sum(p.numel() for p in matrices) + sum(p.numel() for p in attention)
    assert counter.get_total_flops() == 2 * 2 * 2 * products


def test_more_rounds_follow_a_top_direction_that_turned_since_the_last_call():
    """Between two calls the top right singular vector turns by 60 degrees (s_2/s_1 = 0.9): two warm
    iterations leave the estimate far below; rounds until it settles (tolerance 1e-5 per round of 2, where a
    round shrinks the error by (0.9)^8 = 0.43: it stops within ~1e-5 of the top) meet the SVD, at no more than
    max_iterations. The FLOPs say how many were run."""
    s = torch.tensor([1.0, 0.9, 0.5, 0.2])
    before = matrix_with_spectrum((4, 6), s, seed=4)
    U, _, Vh = torch.linalg.svd(before, full_matrices=False)
    angle = torch.tensor(torch.pi / 3, dtype=torch.float64)
    turned = Vh.clone()
    turned[0], turned[1] = torch.cos(angle) * Vh[0] + torch.sin(angle) * Vh[1], \
        -torch.sin(angle) * Vh[0] + torch.cos(angle) * Vh[1]
    after = (U * s.double()) @ turned
    errors, flops = {}, {}
    for tolerance in (0, 1e-5):
        model = torch.nn.Linear(6, 4, bias=False).double()
        monitor = SpectralMonitor(model, tolerance=tolerance, max_iterations=60)
        with torch.no_grad():
            model.weight.copy_(before)
            monitor.compute()
            model.weight.copy_(after)
        with FlopCounterMode(display=False) as counter:
            errors[tolerance] = 1 - monitor.compute()["spectral.s_max/weight"] / float(svd_s(after)[0])
        flops[tolerance] = counter.get_total_flops() // (2 * 2 * 24)  # iterations run
    assert errors[0] > 1e-2 and flops[0] == 2
    assert 0 <= errors[1e-5] <= 1e-4 and 2 < flops[1e-5] <= 60


def test_due_and_metrics_at():
    monitor = SpectralMonitor(tiny_model(), every=50)
    assert [step for step in range(0, 151) if monitor.due(step)] == [0, 50, 100, 150]
    assert monitor.metrics_at(7) is None and monitor.metrics_at(50)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"every": 0}, ValueError, "every must be an integer >= 1"),
    ({"every": 2.5}, ValueError, "every must be an integer >= 1"),
    ({"iterations": 0}, ValueError, "iterations must be an integer >= 1"),
    ({"max_iterations": 0}, ValueError, "max_iterations must be an integer >= 1"),
    ({"tolerance": 1.0}, ValueError, r"tolerance must be a number in \[0, 1\)"),
    ({"tolerance": float("nan")}, ValueError, "tolerance must be"),
    ({"optimizers": [object()]}, TypeError, "must be a torch.optim.Optimizer"),
    ({"attention": "all"}, TypeError, "attention must be"),
])
def test_bad_options_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        SpectralMonitor(tiny_model(), **kwargs)


def test_a_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        SpectralMonitor([torch.zeros(2, 2)])
