"""What a run logs besides its losses, computed with ``spectral_ops.monitor`` and ``spectral_ops.metrics``.

Weight metrics per matrix family (MLP gate, up and down, Q, K, V, O; one matrix per layer each, gate
and up kept apart), averaged over layers: the spectral norm, the Frobenius norm, the stable rank and the
effective-lr proxy ``lr / ||W||_F`` from the run's :class:`~spectral_ops.monitor.SpectralMonitor` (exact:
:func:`weight_monitor` says why), which also gives the SPEC 11 logit bound ``s_max(W_q^h) s_max(W_k^h)`` of
the worst head; the effective rank, which needs every singular value, from ``metrics.matrix_metrics``. Then
the QK-product stable rank, and on a fixed probe batch: normalised attention entropy, mean maximum attention
probability, and the V activation metrics of SPEC 3/7.5 (eRank of the whole V projection's centred output
and mean cross-head linear CKA, on ``metrics.V_SAMPLE_TOKENS`` sampled tokens per layer, averaged over
layers).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from .. import metrics
from ..monitor import SpectralMonitor
from ..optim.distributed import whole

# One family per projection: the SPEC 7.4 comparisons are per family (the 8 gate matrices of one
# run against those of another), so no family pools two projections.
MODULE_TYPES = {
    "mlp_gate": "mlp.gate_proj",
    "mlp_up": "mlp.up_proj",
    "mlp_down": "mlp.down_proj",
    "q": "attention.q_proj",
    "k": "attention.k_proj",
    "v": "attention.v_proj",
    "o": "attention.o_proj",
}
PROBE_SEQUENCES = 4  # at least this many sequences, for the attention maps


def family_weights(model, kind: str) -> list[torch.Tensor]:
    """The family's weight in each layer, in layer order."""
    return [layer.get_submodule(MODULE_TYPES[kind]).weight for layer in model.layers]


def v_projection_names(model) -> list[str]:
    return [f"layers.{i}.{MODULE_TYPES['v']}" for i in range(len(model.layers))]


def probe_tokens(validation, n_tokens: int = metrics.V_SAMPLE_TOKENS) -> torch.Tensor:
    """The probe batch: the first validation sequences, enough to hold ``n_tokens`` tokens (at least
    ``PROBE_SEQUENCES``, at most all of them). ``validation`` is a list of ``(inputs, targets)``."""
    inputs = torch.cat([batch_inputs for batch_inputs, _ in validation])
    return inputs[: max(PROBE_SEQUENCES, math.ceil(n_tokens / inputs.shape[1]))]


def weight_monitor(model, optimizer) -> SpectralMonitor:
    """The run's monitor of the family matrices and of each layer's attention pair, ``exact=True``: the log
    computes every family's SVD anyway (the effective rank needs every singular value), so the power
    iteration would buy no time here, and exact values depend on the weights alone, not on the steps logged
    before (a resumed run, or another ``--log-every``, logs the same numbers, and no state is checkpointed)."""
    families = {id(weight) for kind in MODULE_TYPES for weight in family_weights(model, kind)}
    return SpectralMonitor(model, optimizer, include=lambda name, param: id(param) in families, prefix="", exact=True)


@torch.no_grad()
def weight_metrics(model, optimizer, spectral: SpectralMonitor | None = None) -> dict[str, float]:
    """The weight metrics of the module docstring. ``spectral``: the run's monitor (:func:`weight_monitor`);
    None, a new one, whose first call this is. Under FSDP a collective: every rank calls it (the monitor's
    ``compute``, and the effective rank's SVD, which gathers each weight, one at a time, on every rank)."""
    monitor = spectral or weight_monitor(model, optimizer)
    try:
        values = monitor.compute()
    finally:
        if spectral is None:
            monitor.close()
    layers = range(len(model.layers))
    record = {}
    for kind, path in MODULE_TYPES.items():
        def mean(metric: str) -> float:
            return sum(values[f"{metric}/layers.{i}.{path}"] for i in layers) / len(layers)

        ranks = metrics.matrix_metrics(torch.stack([whole(w) for w in family_weights(model, kind)]))["effective_rank"]
        record.update({f"{kind}/stable_rank": mean("stable_rank"), f"{kind}/effective_rank": float(ranks.mean()),
                       f"{kind}/spectral_norm": mean("s_max"), f"{kind}/frobenius_norm": mean("frobenius"),
                       f"{kind}/effective_lr": mean("effective_lr")})
    qk = [metrics.qk_stable_rank(whole(layer.attention.q_proj.weight), whole(layer.attention.k_proj.weight),
                                 layer.attention.n_heads).mean() for layer in model.layers]
    record["qk/stable_rank"] = float(torch.stack(qk).mean())
    record["qk/logit_bound"] = max(values[f"qk_bound/layers.{i}.attention"] for i in layers)
    return record


def whole_heads(tensor: torch.Tensor, dim: int, tensor_parallel) -> torch.Tensor:
    """Every head's part of an activation whose ``dim`` this process holds only its heads of, under
    tensor parallelism over the mesh ``tensor_parallel`` (a collective on it); as it is without one."""
    if tensor_parallel is None:
        return tensor
    return DTensor.from_local(tensor, tensor_parallel, [Shard(dim)]).full_tensor()


@torch.no_grad()
def activation_metrics(model, tokens, tensor_parallel=None) -> dict[str, float]:
    """One forward pass on ``tokens`` (the probe batch, :func:`probe_tokens`) with attention maps kept
    and V outputs captured; under tensor parallelism over the mesh ``tensor_parallel`` (a collective),
    each process's heads of them are joined first."""
    attentions = [layer.attention for layer in model.layers]
    names = v_projection_names(model)
    was_training = model.training
    model.eval()
    for attention in attentions:
        attention.keep_probabilities = True
    try:
        captured = metrics.capture(model, names, tokens)
        # (batch, heads, seq, seq) maps; (batch, seq, heads * head_dim) V outputs
        probabilities = [whole_heads(attention.probabilities, 1, tensor_parallel) for attention in attentions]
        v_outputs = [whole_heads(captured[name].output, -1, tensor_parallel) for name in names]
    finally:
        for attention in attentions:
            attention.keep_probabilities, attention.probabilities = False, None
        model.train(was_training)
    v_metrics = metrics.v_activation_metrics(v_outputs, attentions[0].n_heads)
    return {
        "attention/entropy": float(torch.stack(
            [metrics.attention_entropy(p, causal=True).mean() for p in probabilities]).mean()),
        "attention/max_probability": float(torch.stack(
            [metrics.mean_max_attention(p, causal=True).mean() for p in probabilities]).mean()),
        **{f"v/{key}": value for key, value in v_metrics.items()},
    }
