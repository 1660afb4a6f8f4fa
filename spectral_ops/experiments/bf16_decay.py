"""bf16 weights that keep their decay: 1,000 steps of pure spectral decay on one weight, stored four ways.

* fp32: the reference trajectory;
* bf16, rounded to nearest: the baseline, which loses every step below half a bf16 unit of an entry;
* bf16, rounded stochastically (``rounding="stochastic"``), over several seeds: unbiased, so the mean
  trajectory follows fp32's;
* bf16 plus its 16-bit mantissa (``mantissa=``, modded-nanogpt's layout): the fp32 value itself.

Every run computes its direction with fp32 operands (``precision="fp32"``), so that only the storage
of the weight differs; ``s_max`` is the FP64 spectral norm of the stored weight.
"""

from __future__ import annotations

import numpy as np
import torch

from ..decay import spectral_decay_, split_mantissa_, with_mantissa
from ..linalg import log_spaced_spectrum, matrix_with_spectrum
from ..progress import progress
from ..reporting import markdown_table, plt, write_outputs
from .report import command_line

P, LR, SPECTRAL_WEIGHT_DECAY = 2, 1e-3, 0.1
SHAPE, QUICK_SHAPE = (256, 128), (64, 32)
STEPS, QUICK_STEPS = 1000, 200
SEEDS, QUICK_SEEDS = 8, 4
RECORD_EVERY = 10
# The targets: the mean of the stochastic runs within 1% of fp32, the pair within 1e-4 (relative s_max).
STOCHASTIC_TARGET, MANTISSA_TARGET = 1e-2, 1e-4


def s_max(W: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(W.double(), ord=2))


class Run:
    """One way of storing the weight: ``value()`` is its current value, ``step()`` decays it once."""

    def __init__(self, W: torch.Tensor, storage: str, seed: int = 0):
        self.storage = storage
        if storage == "mantissa":
            self.W, self.mantissa = torch.empty_like(W, dtype=torch.bfloat16), torch.empty_like(W, dtype=torch.uint16)
            split_mantissa_(W.clone(), self.W, self.mantissa)
        else:
            self.W = W.clone() if storage == "fp32" else W.bfloat16()
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        options = dict(precision="fp32", stability="clamp")
        if self.storage == "mantissa":
            options["mantissa"] = self.mantissa
        elif self.storage == "stochastic":
            options.update(rounding="stochastic", generator=self.generator)
        spectral_decay_(self.W, P, LR, SPECTRAL_WEIGHT_DECAY, **options)

    def value(self) -> torch.Tensor:
        return with_mantissa(self.W, self.mantissa) if self.storage == "mantissa" else self.W


def trajectories(shape, steps: int, seeds: int) -> dict:
    """``s_max`` every :data:`RECORD_EVERY` steps for each run (the stochastic ones per seed), and
    whether the pair's value stayed the fp32 run's, bit for bit."""
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape), 10), torch.float32, seed=0)
    runs = {"fp32": Run(W, "fp32"), "nearest": Run(W, "nearest"), "mantissa": Run(W, "mantissa"),
            **{f"stochastic/{seed}": Run(W, "stochastic", seed) for seed in range(seeds)}}
    recorded = {name: [s_max(run.value())] for name, run in runs.items()}
    pair_is_fp32 = True
    for step in progress(range(1, steps + 1), desc="bf16 decay", unit="step"):
        for run in runs.values():
            run.step()
        pair_is_fp32 &= torch.equal(runs["mantissa"].value(), runs["fp32"].W)
        if step % RECORD_EVERY == 0 or step == steps:
            for name, run in runs.items():
                recorded[name].append(s_max(run.value()))
    return {"steps": [0, *[s for s in range(1, steps + 1) if s % RECORD_EVERY == 0 or s == steps]],
            "s_max": recorded, "pair_is_fp32_bitwise": pair_is_fp32}


def run(out_dir, quick: bool = False) -> str:
    shape, steps, seeds = (QUICK_SHAPE, QUICK_STEPS, QUICK_SEEDS) if quick else (SHAPE, STEPS, SEEDS)
    result = trajectories(shape, steps, seeds)
    s = {name: np.array(values) for name, values in result["s_max"].items()}
    reference = s["fp32"]
    stochastic = np.stack([s[f"stochastic/{seed}"] for seed in range(seeds)])
    mean = stochastic.mean(0)

    def deviation(values):
        return float(abs(values[-1] / reference[-1] - 1))

    rows = [
        ["fp32 (reference)", reference[-1], 0.0, "", ""],
        ["bf16, nearest", s["nearest"][-1], deviation(s["nearest"]), "baseline", ""],
        [f"bf16, stochastic: mean of {seeds} seeds", mean[-1], deviation(mean), f"<= {STOCHASTIC_TARGET:g}",
         "yes" if deviation(mean) <= STOCHASTIC_TARGET else "no"],
        ["bf16, stochastic: worst seed", stochastic[:, -1][np.argmax(abs(stochastic[:, -1] / reference[-1] - 1))],
         max(deviation(row) for row in stochastic), "", ""],
        ["bf16 + mantissa", s["mantissa"][-1], deviation(s["mantissa"]), f"<= {MANTISSA_TARGET:g}",
         "yes" if deviation(s["mantissa"]) <= MANTISSA_TARGET else "no"],
    ]
    table = markdown_table(["storage", "final s_max", "relative error vs fp32", "target", "met"], rows)
    lost = 1 - (s["nearest"][0] - s["nearest"][-1]) / (reference[0] - reference[-1])
    command = command_line("bf16-decay", out_dir, quick)
    markdown = f"""# bf16 weights that keep their decay

`{command}`

{steps} steps of pure decay, `spectral_decay_(W, p={P}, lr={LR:g}, spectral_weight_decay={SPECTRAL_WEIGHT_DECAY:g})`,
on a {shape[0]}x{shape[1]} weight with singular values log-spaced from 1 to 0.1, stored in fp32 (the
reference), in bf16 rounded to nearest, in bf16 rounded stochastically (`rounding="stochastic"`, {seeds}
seeds), and in bf16 plus its 16-bit mantissa (`mantissa=`). Every run computes its direction with fp32
operands, so only the storage differs; `s_max` is the FP64 spectral norm of the stored value.

{table}

Each step shrinks `s_max` by `lr lambda s_max <= {LR * SPECTRAL_WEIGHT_DECAY:g}` of itself (s_max <= 1), below
half a bf16 unit (2^-9 to 2^-8 of an entry): rounded to nearest, bf16 loses {lost:.0%} of the fp32 run's decrease of
`s_max`. Stochastic rounding keeps each step on average; the mantissa keeps the fp32 value itself (bit for
bit at every step: {"yes" if result["pair_is_fp32_bitwise"] else "no"}).
"""
    figure, (ax_s, ax_error) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps_axis = result["steps"]
    ax_s.plot(steps_axis, reference, color="k", label="fp32")
    ax_s.plot(steps_axis, s["nearest"], color="C3", label="bf16, nearest")
    ax_s.plot(steps_axis, mean, color="C0", label=f"bf16, stochastic (mean of {seeds})")
    ax_s.plot(steps_axis, s["mantissa"], color="C2", ls="--", label="bf16 + mantissa")
    ax_s.set(xlabel="step", ylabel="s_max", title=f"Pure decay, p={P}, lr={LR:g}, lambda={SPECTRAL_WEIGHT_DECAY:g}")
    ax_s.legend()
    for seed, row in enumerate(stochastic):
        ax_error.plot(steps_axis, row / reference - 1, color="C0", alpha=0.25, lw=0.8,
                      label="stochastic, each seed" if seed == 0 else None)
    ax_error.plot(steps_axis, mean / reference - 1, color="C0", label="stochastic, mean")
    ax_error.plot(steps_axis, s["nearest"] / reference - 1, color="C3", label="nearest")
    ax_error.plot(steps_axis, s["mantissa"] / reference - 1, color="C2", ls="--", label="mantissa")
    ax_error.axhline(0, color="k", lw=0.5)
    ax_error.set(xlabel="step", ylabel="s_max / s_max(fp32) - 1", title="Deviation from fp32")
    ax_error.legend()
    data = {"protocol": {"p": P, "lr": LR, "spectral_weight_decay": SPECTRAL_WEIGHT_DECAY, "shape": list(shape),
                         "steps": steps, "seeds": seeds, "precision": "fp32",
                         "targets": {"stochastic_mean": STOCHASTIC_TARGET, "mantissa": MANTISSA_TARGET}},
            "final_relative_error": {"nearest": deviation(s["nearest"]), "stochastic_mean": deviation(mean),
                                     "stochastic_worst_seed": max(deviation(row) for row in stochastic),
                                     "mantissa": deviation(s["mantissa"])},
            "nearest_lost_share_of_decrease": float(lost), **result}
    write_outputs(out_dir, "bf16-decay", markdown, data, figure)
    return markdown
