"""What a run logs besides its losses, computed with ``spectral_ops.metrics``.

Weight metrics per module type (MLP expand and project, Q, K, V, O), averaged over layers: stable
rank, effective rank, spectral and Frobenius norms, the effective-lr proxy ``lr / ||W||_F``. Then the
QK-product stable rank, and on a fixed probe batch: normalised attention entropy, mean maximum
attention probability, V-activation effective rank and mean cross-head linear CKA.
"""

from __future__ import annotations

import torch

from .. import metrics

MODULE_TYPES = {
    "mlp_expand": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp_project": ("mlp.down_proj",),
    "q": ("attention.q_proj",),
    "k": ("attention.k_proj",),
    "v": ("attention.v_proj",),
    "o": ("attention.o_proj",),
}


def _lr_of(optimizer) -> dict[int, float]:
    return {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}


@torch.no_grad()
def weight_metrics(model, optimizer) -> dict[str, float]:
    lr_of = _lr_of(optimizer)
    record = {}
    for kind, suffixes in MODULE_TYPES.items():
        weights = [layer.get_submodule(s).weight for layer in model.layers for s in suffixes]
        stacked = torch.stack([w.detach() for w in weights])
        summary = metrics.matrix_metrics(stacked)
        for name in ("stable_rank", "effective_rank", "spectral_norm", "frobenius_norm"):
            record[f"{kind}/{name}"] = float(summary[name].mean())
        proxies = [metrics.effective_lr(w.detach(), lr_of[id(w)]).proxy for w in weights]
        record[f"{kind}/effective_lr"] = float(torch.stack(proxies).mean())
    qk = [metrics.qk_stable_rank(layer.attention.q_proj.weight, layer.attention.k_proj.weight,
                                 layer.attention.n_heads).mean() for layer in model.layers]
    record["qk/stable_rank"] = float(torch.stack(qk).mean())
    return record


@torch.no_grad()
def activation_metrics(model, probe_tokens) -> dict[str, float]:
    """One forward pass on ``probe_tokens`` with attention maps kept and V outputs captured."""
    attentions = [layer.attention for layer in model.layers]
    names = [f"layers.{i}.attention.v_proj" for i in range(len(attentions))]
    was_training = model.training
    model.eval()
    for attention in attentions:
        attention.keep_probabilities = True
    try:
        captured = metrics.capture(model, names, probe_tokens)
        probabilities = [attention.probabilities for attention in attentions]
    finally:
        for attention in attentions:
            attention.keep_probabilities, attention.probabilities = False, None
        model.train(was_training)
    heads = attentions[0].n_heads
    v_outputs = [captured[name].output for name in names]
    return {
        "attention/entropy": float(torch.stack([metrics.attention_entropy(p, causal=True).mean() for p in probabilities]).mean()),
        "attention/max_probability": float(torch.stack([metrics.mean_max_attention(p, causal=True).mean() for p in probabilities]).mean()),
        "v/activation_effective_rank": float(torch.stack([metrics.v_activation_effective_rank(v, heads).mean() for v in v_outputs]).mean()),
        "v/cross_head_cka": sum(metrics.mean_cross_head_cka(v, heads) for v in v_outputs) / len(v_outputs) if heads > 1 else float("nan"),
    }
