"""The training monitor: per-family weight metrics and the SPEC 3/7.5 V activation metrics.

Tolerances: weight metrics are float64 SVDs of the same float32 weights, the run's SpectralMonitor's with
``exact=True`` and by hand (1e-12 relative). The V
activations come out of a float32 forward pass and are measured in float64; the hand computation
multiplies the captured float32 inputs in float64, so the two differ by float32 rounding of the
outputs (~1e-7 relative), which moves an eRank of a 32-wide matrix by far less than 1e-5.
"""

import math

import torch

from spectral_ops import metrics
from spectral_ops.train import Transformer, monitor
from spectral_ops.train.model import ModelConfig


def _model(seed=0, n_layers=2):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(n_layers=n_layers, d_model=32, n_heads=2, max_seq_len=32))


def test_weight_metrics_keep_each_mlp_projection_apart():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = monitor.weight_metrics(model, optimizer)
    assert not any(key.startswith("mlp_expand") or key.startswith("mlp_project") for key in record)
    for kind, projection in (("mlp_gate", "gate_proj"), ("mlp_up", "up_proj"), ("mlp_down", "down_proj")):
        weights = [getattr(layer.mlp, projection).weight.detach() for layer in model.layers]
        for key, by_hand in (("stable_rank", metrics.stable_rank), ("effective_rank", metrics.effective_rank),
                             ("spectral_norm", metrics.spectral_norm),
                             ("effective_lr", lambda W: 0.1 / metrics.frobenius_norm(W))):
            expected = sum(float(by_hand(W)) for W in weights) / len(weights)
            assert math.isclose(record[f"{kind}/{key}"], expected, rel_tol=1e-12), (kind, key)
    heads = [(layer.attention.q_proj.weight.detach().view(2, 16, 32), layer.attention.k_proj.weight.detach().view(
        2, 16, 32)) for layer in model.layers]
    bound = max(float(metrics.spectral_norm(q[h]) * metrics.spectral_norm(k[h])) for q, k in heads for h in range(2))
    assert math.isclose(record["qk/logit_bound"], bound, rel_tol=1e-12)


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
