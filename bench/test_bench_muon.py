"""SpectralMuon against torch.optim.Muon at equal settings, interleaved in one run.

Each round times one step of each optimizer back to back, on the same gradients, so both see the
same machine state; the ratio of the medians goes into ``extra_info["ratio"]`` and
``bench/report.py`` tabulates it. Both orthogonalise in bf16 (torch.optim.Muon always does,
SpectralMuon by default). ``"torch NS5"`` gives SpectralMuon torch's quintic and 5 steps, the like for
like comparison; ``"Polar Express"`` is SpectralMuon's default, 8 converging steps.
"""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops.optim import SpectralMuon

from settings import DEVICE, interleaved_medians

SHAPES = {"1024x1024": (1, 1024, 1024), "2048x512": (1, 2048, 512), "8 heads of 128x1024": (8, 128, 1024)}
VARIANTS = {"torch NS5": dict(ns_coefficients=so.MUON_QUINTIC, ns_steps=5), "Polar Express": {}}
SETTINGS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
# On a CPU without native bf16 (AVX2) one bf16 step at 1024x1024 takes ~20 s, for both optimizers: a
# few interleaved rounds suffice for a median, and the untimed smoke run (CI) uses a small matrix.
ROUNDS = 3
SMOKE_SHAPE = (2, 32, 64)


def optimizers(heads, rows, cols, variant):
    """Ours on one ``(heads * rows) x cols`` matrix (head-wise when ``heads > 1``); torch's on the same
    matrix, or on one parameter per head: how a user gets head-wise updates from torch.optim.Muon."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(heads * rows, cols, generator=generator).to(DEVICE)
    ours = torch.nn.Parameter(torch.zeros(heads * rows, cols, device=DEVICE))
    ours.grad = gradient.clone()
    theirs = [torch.nn.Parameter(torch.zeros(rows, cols, device=DEVICE)) for _ in range(heads)]
    for param, grad in zip(theirs, gradient.split(rows)):
        param.grad = grad.clone()
    head_options = {"heads": heads} if heads > 1 else {}
    return (SpectralMuon([ours], **SETTINGS, **VARIANTS[variant], **head_options),
            torch.optim.Muon(theirs, **SETTINGS))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(SHAPES))
def test_spectral_muon_against_torch_muon(benchmark, case, variant):
    ours, theirs = optimizers(*(SMOKE_SHAPE if benchmark.disabled else SHAPES[case]), variant)
    medians = interleaved_medians(benchmark, {"ours": ours.step, "theirs": theirs.step}, ROUNDS, warmup_rounds=1)
    ratio = medians["ours"] / medians["theirs"]
    benchmark.extra_info.update(op="muon_vs_torch", implementation=f"SpectralMuon ({variant})", case=case,
                                shape=list(SHAPES[case]), dtype="bfloat16", precision="bf16", device=DEVICE.type,
                                ours_median_s=medians["ours"], torch_median_s=medians["theirs"], ratio=ratio)
