"""The training monitor: per-family weight metrics and the SPEC 3/7.5 V activation metrics.

Tolerances: the spectral norm, stable rank and logit bound are the run's SpectralMonitor's (its power
iteration: tests/test_monitor.py holds its accuracy against the FP64 SVD), so they are checked against the
monitor's own per-matrix values (the same computation: equal to 1e-12, the mean's rounding) and, on the side
that holds for any start, against the SVD: a Rayleigh quotient never exceeds ``s_max``, so the stable rank
never falls below the exact one, up to the fp32 rounding of the norms (1e-6 relative for these 32-wide
matrices). The effective-lr proxy is ``lr / ||W||_F`` in float64 of the same float32 weights (1e-12). The V
activations come out of a float32 forward pass and are measured in float64; the hand computation
multiplies the captured float32 inputs in float64, so the two differ by float32 rounding of the
outputs (~1e-7 relative), which moves an eRank of a 32-wide matrix by far less than 1e-5.
"""

import math

import torch

from spectral_ops import metrics
from spectral_ops.monitor import SpectralMonitor
from spectral_ops.train import Transformer, monitor
from spectral_ops.train.model import ModelConfig


def _model(seed=0, n_layers=2):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(n_layers=n_layers, d_model=32, n_heads=2, max_seq_len=32))


def test_weight_metrics_keep_each_mlp_projection_apart():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = monitor.weight_metrics(model, optimizer)
    values = SpectralMonitor(model, prefix="").compute()  # the same seeded starts: the same estimates
    assert not any(key.startswith("mlp_expand") or key.startswith("mlp_project") for key in record)
    for kind, projection in (("mlp_gate", "gate_proj"), ("mlp_up", "up_proj"), ("mlp_down", "down_proj")):
        weights = [getattr(layer.mlp, projection).weight.detach() for layer in model.layers]
        names = [f"layers.{i}.mlp.{projection}" for i in range(len(weights))]
        for key, metric in (("stable_rank", "stable_rank"), ("spectral_norm", "s_max")):
            by_monitor = sum(values[f"{metric}/{name}"] for name in names) / len(names)
            assert math.isclose(record[f"{kind}/{key}"], by_monitor, rel_tol=1e-12)
        exact = sum(float(metrics.stable_rank(W)) for W in weights) / len(weights)
        assert record[f"{kind}/stable_rank"] >= exact * (1 - 1e-6)
        assert math.isclose(record[f"{kind}/effective_rank"], sum(float(metrics.effective_rank(W)) for W in weights)
                            / len(weights), rel_tol=1e-12)
        proxy = sum(0.1 / float(metrics.frobenius_norm(W)) for W in weights) / len(weights)
        assert math.isclose(record[f"{kind}/effective_lr"], proxy, rel_tol=1e-12)
    assert record["qk/logit_bound"] == max(values[f"qk_bound/layers.{i}.attention"] for i in range(2))


def test_probe_tokens_hold_the_sampled_tokens():
    validation = [(torch.full((4, 32), i), torch.zeros(4, 32)) for i in range(10)]
    probe = monitor.probe_tokens(validation)
    assert probe.shape == (metrics.V_SAMPLE_TOKENS // 32, 32)  # 1024 tokens: 32 sequences over 8 batches
    assert probe[:, 0].tolist() == [i for i in range(8) for _ in range(4)]
    assert monitor.probe_tokens(validation[:1]).shape == (4, 32)  # fewer there: all of them
    assert monitor.probe_tokens([(torch.zeros(16, 512), None)]).shape == (monitor.PROBE_SEQUENCES, 512)


def _v_inputs(model, tokens):
    """What each layer's V projection receives, captured with plain forward hooks."""
    inputs = []
    handles = [layer.attention.v_proj.register_forward_hook(lambda module, args, output: inputs.append(args[0]))
               for layer in model.layers]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return inputs


def test_activation_metrics_are_the_centred_whole_projection_erank_averaged_over_layers():
    model = _model()
    tokens = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(1))
    record = monitor.activation_metrics(model, tokens)
    ranks = []
    for layer, x in zip(model.layers, _v_inputs(model.eval(), tokens)):  # SPEC 3 by hand
        Z = x.reshape(-1, 32).double() @ layer.attention.v_proj.weight.detach().double().T
        s = torch.linalg.svdvals(Z - Z.mean(0))
        q = s / s.sum()
        ranks.append(math.exp(-float((q * q.log()).sum())))
    assert math.isclose(record["v/activation_effective_rank"], sum(ranks) / len(ranks), rel_tol=1e-5)
    assert 0 < record["v/cross_head_cka"] <= 1


def test_activation_metrics_leave_the_model_as_they_found_it():
    model = _model()
    monitor.activation_metrics(model, torch.zeros(4, 32, dtype=torch.long))
    assert model.training
    assert all(not layer.attention.keep_probabilities and layer.attention.probabilities is None
               for layer in model.layers)
