"""The measures of the stability study (SPEC 11): what makes a run unstable, its loss spikes, and its
weights' quantization friendliness (S^2D). Defined here, apart from the study that runs them
(:mod:`spectral_ops.experiments.stability`), so that each definition reads, and is tested, alone."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from .. import metrics
from ..train import loop
from ..train.monitor import MODULE_TYPES

# Collapse: a mean normalised entropy below 0.1 spreads a query over about 64^0.1 = 1.5 keys of a typical
# 64 (0.065, the first look's at lr 1e-2, over 1.3; 0.28, the same run's at 3e-3, over 3.2).
ENTROPY_FLOOR = 0.1
LOSS_MARGIN = 0.1  # relative: a final loss 10% above the run's own best
LOSS_WINDOW = 10
SPIKE_FACTOR = 1.5  # a spike: a step whose loss exceeds 1.5x the lowest loss before it


# ----- the definitions: spikes, divergence, instability

def loss_spikes(losses) -> int:
    """Loss spikes: the steps whose loss exceeds ``SPIKE_FACTOR`` times the lowest loss before them and whose
    previous step's does not (consecutive such steps are one spike)."""
    spikes, lowest, inside = 0, math.inf, False
    for loss in losses:
        spiking = loss > SPIKE_FACTOR * lowest
        spikes += spiking and not inside
        inside, lowest = spiking, min(lowest, loss)
    return spikes


def worst_loss_ratio(losses) -> float:
    """The largest ratio of a step's loss to the lowest loss up to it (1 for a loss that never rose)."""
    return float(np.max(np.divide(losses, np.minimum.accumulate(losses))))


def smoothed(losses) -> np.ndarray:
    """The mean of each ``LOSS_WINDOW`` consecutive losses."""
    return np.convolve(losses, np.ones(LOSS_WINDOW) / LOSS_WINDOW, mode="valid")


def diverged(losses, finite: bool) -> bool:
    """Non-finite (a loss, or the final weights), or a final loss above the first one."""
    return not finite or not np.isfinite(losses).all() or smoothed(losses)[-1] > losses[0]


def instability(losses, finite: bool, final_entropy: float) -> list[str]:
    """Why a run is unstable (empty: stable): ``"diverged"``, ``"entropy collapse"``, ``"loss above its best"``."""
    if diverged(losses, finite):
        return ["diverged"]
    reasons = ["entropy collapse"] if final_entropy < ENTROPY_FLOOR else []
    window = smoothed(losses)
    if window[-1] > (1 + LOSS_MARGIN) * window.min():
        reasons.append("loss above its best")
    return reasons


# ----- quantization (SPEC 11, S^2D)

def quantized(W: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric round-to-nearest per output channel (row): ``round(W / c) c`` with ``c = max|row| / (2^(b-1) - 1)``."""
    levels = 2 ** (bits - 1) - 1
    scale = W.abs().amax(dim=-1, keepdim=True) / levels
    return torch.where(scale > 0, torch.round(W / torch.where(scale > 0, scale, 1)) * scale, W)


def block_linears(model) -> dict[str, torch.nn.Linear]:
    """The matrices the decay acts on: every linear layer of the blocks, by name."""
    return {f"layers.{i}.{path}": layer.get_submodule(path) for i, layer in enumerate(model.layers)
            for path in MODULE_TYPES.values()}


@torch.no_grad()
def quantization(model, validation, processes, from_nats: float) -> dict:
    """The weight error ``||W - Q_b(W)||_F / ||W||_F`` (mean and largest over the block matrices) and the
    validation bits per byte with every block matrix replaced by ``Q_b(W)``, for int8 and int4."""
    record = {}
    for bits in (8, 4):
        copied = copy.deepcopy(model)
        errors = []
        for linear in block_linears(copied).values():
            W = linear.weight
            Q = quantized(W, bits)
            errors.append(float(torch.linalg.matrix_norm(W - Q) / torch.linalg.matrix_norm(W)))
            W.copy_(Q)
        record[f"int{bits}"] = {"mean_error": float(np.mean(errors)), "max_error": float(max(errors)),
                                "val_bpb": loop.validation_nats(copied, validation, processes) * from_nats}
    return record


@torch.no_grad()
def outlier_ratio(model, tokens) -> dict:
    """``max|a| / rms(a)`` of each block linear's input ``a`` on ``tokens`` (all its entries at once)."""
    names = list(block_linears(model))
    captured = metrics.capture(model, names, tokens)
    ratios = [float(a.abs().max() / a.pow(2).mean().sqrt()) for a in (captured[n].args[0].float() for n in names)]
    return {"max": max(ratios), "mean": float(np.mean(ratios))}
