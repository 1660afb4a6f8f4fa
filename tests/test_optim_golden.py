"""The optimizers' eager (``capturable=False``) results are pinned: making the step capturable,
multi-tensor and compile-friendly must not change one bit of them.

``tests/data/optim_golden.pt`` was recorded with the optimizers as they were before [capturable], and
again when [portable] folded the polar iteration's normalisation margin into its first step, and when
[compile] let a CPU's ``decay_method="auto"`` factorise (the earlier cases pin ``"gram"`` and kept
every bit; the ``-auto`` cases were added);
``python tests/test_optim_golden.py`` records it again after a deliberate change. How results are
compared: ``tests/golden.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spectral_ops as so
from spectral_ops.optim import SpectralAdamW, SpectralDecay, SpectralMuon, SpectralSGD

from golden import assert_matches, environment
from optim_models import tiny_model, train

GOLDEN = Path(__file__).with_name("data") / "optim_golden.pt"
STEPS = 3


def _muon(model, **options):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return SpectralMuon([{"params": matrices}, {"params": vectors, "algorithm": "adamw", "weight_decay": 0.0}],
                        lr=2e-2, **options)


def _attached(model, **options):
    host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    SpectralDecay([p for p in model.parameters() if p.ndim == 2], **options).attach(host)
    return host


GRAM = {"decay_method": "gram"}  # the iterations' arithmetic; "auto" factorises on a CPU (the -auto cases)

OPTIMIZERS = {
    "adamw-p1": lambda m: SpectralAdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "adamw-p2": lambda m: SpectralAdamW(m.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5, **GRAM),
    "adamw-p0-tensor-lr": lambda m: SpectralAdamW(m.parameters(), lr=torch.tensor(1e-2), p=0,
                                                  spectral_weight_decay=0.5, **GRAM),
    "adamw-band": lambda m: SpectralAdamW(m.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5,
                                          band=so.Band(0.5), **GRAM),
    # p * kappa = 2.8: the golden pins the arithmetic of a step that reorders the top modes, which the
    # guard (p * kappa < 1) now refuses unless told to ignore it.
    "adamw-independent": lambda m: SpectralAdamW(m.parameters(), lr=1e-2, p=3, spectral_weight_decay=0.5,
                                                 convention="independent", stability="ignore", **GRAM),
    "sgd-nesterov": lambda m: SpectralSGD(m.parameters(), lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.1,
                                          p=2, spectral_weight_decay=0.5, **GRAM),
    "sgd-tensor-lr": lambda m: SpectralSGD(m.parameters(), lr=torch.tensor(5e-2), p=0, spectral_weight_decay=0.5,
                                           **GRAM),
    "muon-p2": lambda m: _muon(m, p=2, spectral_weight_decay=0.5, precision="fp32", **GRAM),
    "muon-heads": lambda m: _muon(m, heads=2, precision="fp32"),
    "muon-quintic": lambda m: _muon(m, ns_coefficients=so.MUON_QUINTIC, precision="fp32"),
    "decay-attached": lambda m: _attached(m, p=2, spectral_weight_decay=0.5, **GRAM),
    "adamw-p2-auto": lambda m: SpectralAdamW(m.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5),
    "adamw-band-auto": lambda m: SpectralAdamW(m.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5,
                                               band=so.Band(0.5)),
}


def run(name: str) -> list[torch.Tensor]:
    model = tiny_model()
    return train(model, OPTIMIZERS[name](model), STEPS)[-1]


def record() -> None:
    with so.use_backend("torch"):
        results = {name: run(name) for name in OPTIMIZERS}
    GOLDEN.parent.mkdir(exist_ok=True)
    torch.save({"environment": environment(), "results": results}, GOLDEN)


@pytest.fixture(scope="module")
def golden():
    return torch.load(GOLDEN, weights_only=True)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_eager_optimizer_results_are_unchanged(golden, name):
    with so.use_backend("torch"):
        got = run(name)
    for parameter, expected in zip(got, golden["results"][name], strict=True):
        assert_matches(parameter, expected, golden["environment"])


if __name__ == "__main__":
    record()
    print(f"recorded {GOLDEN}")
