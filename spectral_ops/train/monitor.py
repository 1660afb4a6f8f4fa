"""What a run logs besides its losses, computed with ``spectral_ops.metrics``.

Weight metrics per matrix family (MLP gate, up and down, Q, K, V, O; one matrix per layer each, gate
and up kept apart), averaged over layers: stable rank, effective rank, spectral and Frobenius norms,
the effective-lr proxy ``lr / ||W||_F``. Then the QK-product stable rank, and on a fixed probe batch:
normalised attention entropy, mean maximum attention probability, and the V activation metrics of
SPEC 3/7.5 (eRank of the whole V projection's centred output and mean cross-head linear CKA, on
``metrics.V_SAMPLE_TOKENS`` sampled tokens per layer, averaged over layers).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from .. import metrics
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


def _lr_of(optimizer) -> dict[int, float]:
    return {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}


@torch.no_grad()
def weight_metrics(model, optimizer) -> dict[str, float]:
    """The weight metrics of the module docstring (under FSDP a collective: each weight is gathered,
    one at a time, on every rank)."""
    lr_of = _lr_of(optimizer)
    record = {}
    for kind in MODULE_TYPES:
        weights = family_weights(model, kind)
        gathered = [whole(w) for w in weights]
        summary = metrics.matrix_metrics(torch.stack(gathered))
        for name in ("stable_rank", "effective_rank", "spectral_norm", "frobenius_norm"):
            record[f"{kind}/{name}"] = float(summary[name].mean())
        proxies = [metrics.effective_lr(w, lr_of[id(p)]).proxy for p, w in zip(weights, gathered)]
        record[f"{kind}/effective_lr"] = float(torch.stack(proxies).mean())
    qk = [metrics.qk_stable_rank(whole(layer.attention.q_proj.weight), whole(layer.attention.k_proj.weight),
                                 layer.attention.n_heads).mean() for layer in model.layers]
    record["qk/stable_rank"] = float(torch.stack(qk).mean())
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
