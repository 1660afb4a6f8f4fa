"""The per-step cost of an optimizer of the family against torch's multi-tensor AdamW, on a model.

The ``small`` preset's Transformer has 30 matrices and a few dozen vectors; with ``p = 1`` the
spectral term is ordinary weight decay, so the two optimizers do the same arithmetic and the ratio
measures what our step adds: Python per parameter group, grouping, validation, routing. Each round
times one step of each, back to back, on the same gradients; the ratio of the medians goes into
``extra_info["ratio"]`` (goal: within 1.3x of ``torch.optim.AdamW(foreach=True)`` on CPU).
"""

from __future__ import annotations

import pytest
import torch

from spectral_ops.optim import SpectralAdamW
from spectral_ops.train.config import preset
from spectral_ops.train.model import Transformer

from settings import DEVICE, interleaved_medians

ROUNDS = 20
VARIANTS = {
    "SpectralAdamW p=1": dict(p=1, weight_decay=0.1),
    "SpectralAdamW p=1 capturable": dict(p=1, weight_decay=0.1, capturable=True),
}


def model():
    torch.manual_seed(0)
    network = Transformer(preset("small").model_config()).to(DEVICE)
    for param in network.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    return network


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_optimizer_step_against_torch_adamw(benchmark, variant):
    ours_model, theirs_model = model(), model()
    ours = SpectralAdamW(ours_model.parameters(), lr=1e-3, **VARIANTS[variant])
    theirs = torch.optim.AdamW(theirs_model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    medians = interleaved_medians(benchmark, {"ours": ours.step, "theirs": theirs.step},
                                  rounds=1 if benchmark.disabled else ROUNDS,
                                  warmup_rounds=0 if benchmark.disabled else 2)
    matrices = sum(p.ndim >= 2 for p in ours_model.parameters())
    ratio = medians["ours"] / medians["theirs"]
    benchmark.extra_info.update(op="optimizer_step_vs_adamw", implementation=variant, case=f"small preset, "
                                f"{matrices} matrices", shape=[matrices], dtype="float32", precision="fp32",
                                device=DEVICE.type, ours_median_s=medians["ours"], torch_median_s=medians["theirs"],
                                ratio=ratio)
