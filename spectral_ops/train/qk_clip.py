"""QK-Clip, as Kimi K2 defines it (SPEC 11; Megatron-LM's ``--qk-clip``): after each optimizer step, every
attention head whose largest logit in that step's forward, ``m_h``, exceeds the threshold ``tau`` has its
query rows ``W_q^h`` and its key rows ``W_k^h`` scaled by ``sqrt(tau / m_h)`` each. The logit is bilinear
in the two, so on the same input the head's largest logit becomes ``tau`` exactly; the other heads are
left bit for bit.

It needs the logits the forward saw, which the attention kernel (SDPA, FlashAttention) does not report:
the reference model observes them on the side (:class:`~spectral_ops.train.model.AttentionObservation`),
so it lives here, with the model, in the training layer. :func:`spectral_ops.qk_cap_` bounds the same
logits from the weights alone.
"""

from __future__ import annotations

import math

import torch

from .model import AttentionObservation, Transformer


def checked_threshold(tau) -> float:
    """``tau`` as a float, refused unless a positive finite logit."""
    if isinstance(tau, bool) or not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"QK-Clip's threshold tau must be a positive finite logit, got {tau!r} "
                         "(Kimi K2 uses 100; --qk-clip 0 turns the clip off)")
    return float(tau)


class QKClip:
    """Kimi K2's QK-Clip on ``model``'s attention heads with threshold ``tau`` (a logit, after the
    ``1/sqrt(d_h)`` scale). Constructing it turns on the heads' observation of the training forwards; call
    :meth:`step` after each optimizer step. ``clipped`` counts the head clips so far."""

    def __init__(self, model: Transformer, tau: float):
        self.tau = checked_threshold(tau)
        self.attentions = [layer.attention for layer in model.layers]
        for attention in self.attentions:
            attention.observe_logits = True
        self.clipped = 0

    @torch.no_grad()
    def step(self, observations: list[AttentionObservation] | None = None) -> torch.Tensor:
        """Clip every head whose largest logit in the step's forward exceeds ``tau``: ``observations``, one per
        layer, or by default those the model's attention modules made since the last call (taken, so
        forgotten there). Returns the factor each head's logits were scaled by, ``min(1, tau / m_h)``,
        ``(layers, heads)``. Every observation is checked before any weight is written."""
        if observations is None:
            observations = [attention.take_observation() for attention in self.attentions]
        if len(observations) != len(self.attentions):
            raise ValueError(f"QK-Clip takes one observation per layer ({len(self.attentions)}), got "
                             f"{len(observations)}")
        if any(observation is None for observation in observations):
            raise RuntimeError("QK-Clip observed no training forward since its last step: call step() once after "
                               "each optimizer step, whose forward ran with the model in training mode")
        max_logits = torch.stack([observation.max_logit for observation in observations])
        if not torch.isfinite(max_logits).all():
            raise FloatingPointError(f"QK-Clip observed non-finite attention logits ({max_logits.tolist()}); no "
                                     "weight was scaled (lower the lr?)")
        # m_h <= tau, a negative m_h included, leaves the head as it is (a factor of exactly 1).
        factors = torch.where(max_logits > self.tau, self.tau / max_logits, torch.ones_like(max_logits))
        for attention, factor in zip(self.attentions, factors):
            if bool((factor < 1).any()):
                # Each head's rows of W_q and W_k: the logit q_i . k_j / sqrt(d_h) scales by factor.
                scale = factor.sqrt().repeat_interleave(attention.head_dim)[:, None]
                for weight in (attention.q_proj.weight, attention.k_proj.weight):
                    weight.mul_(scale.to(weight.dtype))
        self.clipped += int((factors < 1).sum())
        return factors
