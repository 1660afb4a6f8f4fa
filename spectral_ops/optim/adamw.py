"""AdamW with spectral-power decay: ``W <- W - lr * (Adam(g) + lambda_1 W + lambda_p S_p(W))``."""

from __future__ import annotations

import torch

from .._checks import check_coefficient
from ._decay import DECAY_DEFAULTS, SpectralOptimizer, scalar


@torch.no_grad()
def adam_update_(params, group: dict, state) -> None:
    """One Adam step (no weight decay), operation for operation as torch's single-tensor AdamW."""
    beta1, beta2 = group["betas"]
    lr, eps = scalar(group["lr"]), group["eps"]
    for param in params:
        grad = param.grad
        param_state = state[param]
        if not param_state:
            param_state["step"] = torch.tensor(0.0)
            param_state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            param_state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        param_state["step"] += 1
        exp_avg, exp_avg_sq = param_state["exp_avg"], param_state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = param_state["step"].item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def check_adam_options(group: dict) -> None:
    beta1, beta2 = group["betas"]
    for name, beta in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= scalar(beta) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    check_coefficient(group["eps"], "eps")


class SpectralAdamW(SpectralOptimizer):
    """AdamW plus the spectral term of SPEC 1.5.

    ``weight_decay`` is the ordinary coefficient ``lambda_1`` and ``spectral_weight_decay`` is
    ``lambda_p``; they stack. Both act on the weights before the Adam update, scaled by the current
    lr (``convention="decoupled"``, torch AdamW's convention) or by ``eta_t = lr / peak_lr``
    (``"independent"``; ``peak_lr`` is a group key, by default the lr the group starts with, and an LR
    scheduler's ``initial_lr`` takes precedence over it).
    With ``p = 1`` it is torch's AdamW. Every option can be set per parameter group.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, p=1,
                 spectral_weight_decay=0.0, convention="decoupled", band=None, p0_mode="explicit",
                 stability="raise", polar_steps=None, decay_precision=None):
        defaults = dict(DECAY_DEFAULTS, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, p=p,
                        spectral_weight_decay=spectral_weight_decay, convention=convention, band=band,
                        p0_mode=p0_mode, stability=stability, polar_steps=polar_steps,
                        decay_precision=decay_precision)
        super().__init__(params, defaults)

    def check_group(self, group: dict) -> None:
        super().check_group(group)
        check_adam_options(group)

    def step_group(self, params, group: dict) -> None:
        self.decay_group(params, group)
        adam_update_(params, group, self.state)
