"""Reference experiments (SPEC 7.1-7.3, the SPEC 5 feedback loop, the SPEC 4 width transfer, the
rectangle vs Gram-space iteration study, the decay of bf16 weights by rounding and mantissa, real and
floored powers with Muon-family updates against DynMuon's construction, and the stable lr range of
spectral decay, qk_cap_, QK-Clip and cautious decay).

``python -m spectral_ops.experiments NAME --out DIR [--quick]`` writes ``NAME.md`` (the table, also
printed), ``NAME.json`` (the data) and ``NAME.png`` (the figure) into ``DIR``. ``--quick`` runs
reduced settings in seconds (used by the tests); ``pure-decay --checkpoint PATH`` decays the matrix
weights of a training checkpoint (or its run folder, or a saved state dict) instead of the synthetic
one, with ``--horizon`` and ``--coefficients``; ``stability`` takes ``--preset``, ``--device``, ``--workers``
and ``--methods``. Each experiment is a module with
``run(out_dir, quick=False, **options) -> markdown``.

The top layer (README, "Architecture"): an experiment may use the training loop, never the other way
round; what both need (writing a report) is :mod:`spectral_ops.reporting`.
"""

from __future__ import annotations

import importlib

EXPERIMENTS = {
    "polar-accuracy": "polar_accuracy",
    "linear-teacher": "linear_teacher",
    "pure-decay": "pure_decay",
    "feedback-loop": "feedback_loop",
    "schedules": "schedules",
    "width-transfer": "width_transfer",
    "bf16-decay": "bf16_decay",
    "real-powers": "real_powers",
    "stability": "stability",
}


def run(name: str, out_dir, quick: bool = False, **options) -> str:
    """Run one experiment, write its files into ``out_dir`` and return its markdown report."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    # Imported on demand: matplotlib is only needed by the experiment that runs.
    module = importlib.import_module(f".{EXPERIMENTS[name]}", __name__)
    return module.run(out_dir, quick=quick, **options)
