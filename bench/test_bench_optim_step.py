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


def readme_model():
    """The README's optimizer example: a 256 -> 1024 -> 256 MLP."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(DEVICE)


def one_matrix():
    torch.manual_seed(0)
    return torch.nn.Linear(1024, 1024, bias=False).to(DEVICE)


COMPILE_MODELS = {"README model": readme_model, "1024x1024": one_matrix}


@pytest.mark.parametrize("case", list(COMPILE_MODELS))
def test_compiled_default_step_against_eager(benchmark, case):
    """The default (``capturable=False``) SpectralAdamW step with the ``p = 2`` decay on the matrices,
    compiled by ``torch.compile`` (which traces it as capturable, see docs/optimizers.md) against the
    same step run eagerly, on the same gradients; goal: the compiled step is not slower."""
    models = {name: COMPILE_MODELS[case]() for name in ("compiled", "eager")}
    steps = {}
    for name, network in models.items():
        for param in network.parameters():
            param.grad = torch.randn_like(param) * 1e-3
        matrices = [p for p in network.parameters() if p.ndim == 2]
        others = [p for p in network.parameters() if p.ndim < 2]
        groups = [{"params": matrices, "p": 2, "spectral_weight_decay": 0.1}]
        groups += [{"params": others, "weight_decay": 0.0}] if others else []
        optimizer = SpectralAdamW(groups, lr=3e-4)
        steps[name] = torch.compile(optimizer.step) if name == "compiled" else optimizer.step
    steps["compiled"]()  # compiles: not timed
    medians = interleaved_medians(benchmark, steps, rounds=1 if benchmark.disabled else ROUNDS,
                                  warmup_rounds=0 if benchmark.disabled else 2)
    ratio = medians["compiled"] / medians["eager"]
    benchmark.extra_info.update(op="compiled_step_vs_eager", implementation="SpectralAdamW p=2 default", case=case,
                                shape=[sum(p.numel() for p in models["eager"].parameters())], dtype="float32",
                                precision="fp32", device=DEVICE.type, ours_median_s=medians["compiled"],
                                torch_median_s=medians["eager"], ratio=ratio)
