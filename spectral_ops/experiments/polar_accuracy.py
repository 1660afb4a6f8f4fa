"""SPEC 7.1: accuracy of the SVD-free ``S_p`` (Polar Express) against the FP64 SVD of the same input."""

from __future__ import annotations

import numpy as np
import torch

from .. import reference
from ..coefficients import NORMALIZATION_MARGIN, odd_quintic, polar_express_coefficients
from ..decay import spectral_decay_
from ..linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from ..ops import spectral_power
from ..progress import progress
from ..reporting import markdown_table, plt, write_outputs
from .report import command_line

SHAPES = ((64, 64), (128, 64), (64, 128))
SEEDS = (42, 43, 44)
CONDITION_NUMBERS = (10.0, 1e3, 1e6)
POWERS = (0, 2, 4)  # p = 1 needs no polar factor and is exact up to round-off
STEPS, LOWER, SAFETY = 8, 1e-3, 1.01
# The precision axis: operands of the iteration (tf32 is fp32 on a CPU, so it is left out here).
PRECISIONS = ("fp64", "fp32", "bf16", "fp16")
PRECISION_POWERS = (0, 1, 2, 4)
# One decay step W <- W - lr * lambda * S_p(W) with lr * lambda = 1e-3, on the FP32 weight.
STEP = 1e-3


def polar_express_map(x, coefficients):
    """The scalar map the iteration applies to each normalised singular value."""
    for step in coefficients:
        x = odd_quintic(step, x)
    return x


def decay_step_errors(W: torch.Tensor, p: int, precision: str) -> tuple[float, float]:
    """``(error, floor)`` of one decay step's change ``W_new - W`` against the exact step.

    The floor is the error of the exact step itself once ``W_new`` is rounded to ``W``'s dtype: what
    any direction, however accurate, would show.
    """
    exact = -STEP * reference.spectral_power_svd(W, p)
    decayed = W.clone()
    spectral_decay_(decayed, p, STEP, 1.0, precision=precision, stability="ignore")
    rounded = (W.double() + exact).to(W.dtype)
    return (relative_error(decayed.double() - W.double(), exact),
            relative_error(rounded.double() - W.double(), exact))


def run(out_dir, quick: bool = False) -> str:
    seeds = SEEDS[:1] if quick else SEEDS
    coefficients = polar_express_coefficients(STEPS, LOWER, SAFETY)
    cases = [(kappa, shape, seed) for kappa in CONDITION_NUMBERS for shape in SHAPES for seed in seeds]
    records = []
    for kappa, shape, seed in progress(cases, desc="polar-accuracy", unit="case"):
        W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape), kappa), torch.float32, seed=seed)
        s = torch.linalg.svdvals(W.double())
        record = {"kappa": kappa, "shape": list(shape), "seed": seed,
                  "smallest_normalised_singular_value": float(s[-1] / (NORMALIZATION_MARGIN * s.norm()))}
        for p in POWERS:
            result = spectral_power(W, p, method="gram", coefficients=coefficients, precision="fp32")
            record[f"p{p}"] = relative_error(result, reference.spectral_power_svd(W, p))
        for precision in PRECISIONS:
            for p in PRECISION_POWERS:
                result = spectral_power(W, p, method="gram", coefficients=coefficients, precision=precision)
                record[f"{precision}/p{p}"] = relative_error(result, reference.spectral_power_svd(W, p))
                if p != 1:
                    record[f"{precision}/step/p{p}"], record[f"step floor/p{p}"] = decay_step_errors(W, p, precision)
        for p in PRECISION_POWERS[2:]:  # the same step on the weight rounded to bf16, at its default precision
            record[f"bf16 weight/step/p{p}"], record[f"bf16 weight floor/p{p}"] = decay_step_errors(
                W.bfloat16(), p, None)
        records.append(record)

    rows, summary = [], []
    for kappa in CONDITION_NUMBERS:
        of_kappa = [r for r in records if r["kappa"] == kappa]
        x_min = min(r["smallest_normalised_singular_value"] for r in of_kappa)
        worst = {p: max(r[f"p{p}"] for r in of_kappa) for p in POWERS}
        lifted = float(polar_express_map(x_min, coefficients))
        rows.append([f"{kappa:g}", *[worst[p] for p in POWERS], x_min, lifted])
        summary.append({"kappa": kappa, "max_relative_error": {str(p): worst[p] for p in POWERS},
                        "smallest_normalised_singular_value": x_min, "polar_express_map_at_smallest": lifted})

    by_precision = []
    precision_rows, step_rows = [], []
    for precision in PRECISIONS:
        for kappa in CONDITION_NUMBERS:
            of_kappa = [r for r in records if r["kappa"] == kappa]
            worst = {p: max(r[f"{precision}/p{p}"] for r in of_kappa) for p in PRECISION_POWERS}
            steps = {p: max(r[f"{precision}/step/p{p}"] for r in of_kappa) for p in PRECISION_POWERS if p != 1}
            floors = {p: max(r[f"step floor/p{p}"] for r in of_kappa) for p in steps}
            by_precision.append({"precision": precision, "kappa": kappa,
                                 "max_relative_error": {str(p): e for p, e in worst.items()},
                                 "max_decay_step_error": {str(p): e for p, e in steps.items()},
                                 "decay_step_rounding_floor": {str(p): e for p, e in floors.items()}})
            precision_rows.append([precision, f"{kappa:g}", *[worst[p] for p in PRECISION_POWERS]])
            step_rows.append([precision, f"{kappa:g}", *[value for p in steps for value in (steps[p], floors[p])]])
    bf16_rows = []
    for kappa in CONDITION_NUMBERS:
        of_kappa = [r for r in records if r["kappa"] == kappa]
        cells = [max(r[f"bf16 weight{kind}/p{p}"] for r in of_kappa)
                 for p in PRECISION_POWERS[2:] for kind in ("/step", " floor")]
        bf16_rows.append([f"{kappa:g}", *cells])
        by_precision.append({"precision": "bf16", "weight_dtype": "bfloat16", "kappa": kappa,
                             "max_decay_step_error": {str(p): cells[2 * i] for i, p in enumerate(PRECISION_POWERS[2:])},
                             "decay_step_rounding_floor": {str(p): cells[2 * i + 1]
                                                           for i, p in enumerate(PRECISION_POWERS[2:])}})

    headers = ["kappa", *[f"p={p}" for p in POWERS], "min s/(1.01‖W‖_F)", "PE map there"]
    table = markdown_table(headers, rows)
    precision_table = markdown_table(["precision", "kappa", *[f"p={p}" for p in PRECISION_POWERS]], precision_rows)
    step_powers = [p for p in PRECISION_POWERS if p != 1]
    step_table = markdown_table(["precision", "kappa", *[f"{name} p={p}" for p in step_powers
                                                          for name in ("step", "floor")]], step_rows)
    bf16_table = markdown_table(["kappa", *[f"{name} p={p}" for p in PRECISION_POWERS[2:]
                                            for name in ("step", "floor")]], bf16_rows)
    command = command_line("polar-accuracy", out_dir, quick)
    markdown = f"""# Polar Express vs SVD accuracy (SPEC 7.1)

`{command}`

Maximum relative Frobenius error of `spectral_power(W, p, method="gram")` against the FP64 SVD of the
same FP32 input, over the {len(SHAPES) * len(seeds)} cases {', '.join('x'.join(map(str, s)) for s in SHAPES)} x
seeds {', '.join(map(str, seeds))}; singular values log-spaced from 1 to 1/kappa; {STEPS} Polar Express
steps designed for l = {LOWER:g}, safety {SAFETY}; `precision="fp32"`.

{table}

The last two columns explain the errors: the smallest singular value after the Frobenius
normalisation, and what the {STEPS}-step scalar map makes of it (exact polar: 1). Modes below the
design bound l = {LOWER:g} are only partly lifted, by design (SPEC 1.3); for `p >= 2` the error on them
is multiplied by `s^p` and all but vanishes.

## By precision

The same cases with the iteration's operands in each precision (`precision=`; tf32 is fp32 on a
CPU). The FP32 result is rounded once at the end, so fp64's floor is fp32's rounding.

{precision_table}

## One decay step

What a decay moves: the relative error of `W_new - W` for one step `W <- W - {STEP:g} S_p(W)` on the
FP32 weight, against the exact step, next to its floor: the error of the exact step itself once
`W_new` is rounded to FP32. A direction's error matters only where it exceeds that floor.

{step_table}

The same step on the weight rounded to bf16, at its default precision (bf16 operands): the floor is
about 1, since a step of {STEP:g} of the weight is below half a bf16 unit of most entries and is
mostly not written at all; the bf16 direction's error does not show beside it.

{bf16_table}
"""
    figure, (ax_error, ax_map) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p in POWERS:
        ax_error.loglog(CONDITION_NUMBERS, [row["max_relative_error"][str(p)] for row in summary], "o-", label=f"p={p}")
    ax_error.set(xlabel="kappa", ylabel="max relative Frobenius error", title="S_p (FP32, Gram route) vs FP64 SVD")
    ax_error.legend()
    x = np.logspace(-8, 0, 400)
    ax_map.loglog(x, np.abs(1.0 - polar_express_map(x, coefficients)) + 1e-17, color="k")
    ax_map.axvline(LOWER, ls="--", color="gray", label=f"design bound l={LOWER:g}")
    for i, row in enumerate(summary):
        ax_map.axvline(row["smallest_normalised_singular_value"], ls=":", color="C3",
                       label="smallest x, per kappa" if i == 0 else None)
    ax_map.set(xlabel="normalised singular value x", ylabel="|1 - map(x)|", title=f"{STEPS}-step Polar Express map")
    ax_map.legend(loc="lower left")
    data = {"protocol": {"shapes": SHAPES, "seeds": seeds, "kappas": CONDITION_NUMBERS, "powers": POWERS,
                         "steps": STEPS, "lower": LOWER, "safety": SAFETY, "input_dtype": "float32",
                         "precisions": PRECISIONS, "decay_step": STEP},
            "summary": summary, "by_precision": by_precision, "cases": records}
    write_outputs(out_dir, "polar-accuracy", markdown, data, figure)
    return markdown
