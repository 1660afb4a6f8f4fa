"""SpectralMuon against torch.optim.Muon at equal settings, interleaved in one run.

Each round times one step of each optimizer back to back, on the same gradients, so both see the
same machine state; the ratio of the medians goes into ``extra_info["ratio"]`` and
``bench/report.py`` tabulates it. Both orthogonalise in bf16 (torch.optim.Muon always does,
SpectralMuon by default). ``"torch NS5"`` gives SpectralMuon torch's quintic and 5 steps, the like for
like comparison; ``"Polar Express"`` is SpectralMuon's default, 8 converging steps.

Next to the times, the bytes each step copies (``aten::copy_`` under torch.profiler): unlike the
times, they do not depend on the machine.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import spectral_ops as so
from spectral_ops.optim import SpectralMuon

from settings import DEVICE, interleaved_medians

SHAPES = {"1024x1024": (1, 1024, 1024), "2048x512": (1, 2048, 512), "512x2048": (1, 512, 2048),
          "8 heads of 128x1024": (8, 128, 1024)}
VARIANTS = {"torch NS5": dict(ns_coefficients=so.MUON_QUINTIC, ns_steps=5), "Polar Express": {}}
SETTINGS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
# The rounds fill about ROUND_BUDGET_S, within [ROUNDS, MAX_ROUNDS]: on a CPU without native bf16 (AVX2)
# one bf16 step at 1024x1024 takes ~20 s, for both optimizers, and a few rounds suffice for a median;
# with native bf16 it takes milliseconds, and the noise of a shared machine needs many. The untimed
# smoke run (CI) uses a small matrix.
ROUNDS, MAX_ROUNDS, ROUND_BUDGET_S = 3, 40, 20.0
SMOKE_SHAPE = (2, 32, 64)
# torch.profiler's names of the dtypes a copy can write.
ITEMSIZES = {"double": 8, "float": 4, "c10::BFloat16": 2, "c10::Half": 2}


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


def copied_bytes(step) -> int:
    """Bytes ``aten::copy_`` writes in one step, after one unprofiled step (which makes the momentum).
    Copies of one number per matrix (0-d or ``(..., 1, 1)``: Python numbers, norms) move no data."""
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return sum(math.prod(event.input_shapes[0]) * ITEMSIZES[event.input_dtypes[0]]
               for event in prof.events() if event.name == "aten::copy_" and math.prod(event.input_shapes[0][-2:]) > 1)


def rounds_for(steps) -> int:
    """How many interleaved rounds fit :data:`ROUND_BUDGET_S`, from one round timed now."""
    start = time.perf_counter()
    for step in steps:
        step()
    return max(ROUNDS, min(MAX_ROUNDS, int(ROUND_BUDGET_S / (time.perf_counter() - start))))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(SHAPES))
def test_spectral_muon_against_torch_muon(benchmark, case, variant):
    ours, theirs = optimizers(*(SMOKE_SHAPE if benchmark.disabled else SHAPES[case]), variant)
    copies = {"ours": copied_bytes(ours.step), "theirs": copied_bytes(theirs.step)}
    rounds = ROUNDS if benchmark.disabled else rounds_for([ours.step, theirs.step])
    medians = interleaved_medians(benchmark, {"ours": ours.step, "theirs": theirs.step}, rounds, warmup_rounds=1)
    ratio = medians["ours"] / medians["theirs"]
    benchmark.extra_info.update(op="muon_vs_torch", implementation=f"SpectralMuon ({variant})", case=case,
                                shape=list(SHAPES[case]), dtype="bfloat16", precision="bf16", device=DEVICE.type,
                                ours_median_s=medians["ours"], torch_median_s=medians["theirs"], ratio=ratio,
                                rounds=rounds, ours_copied_bytes=copies["ours"], torch_copied_bytes=copies["theirs"])
