"""Issue #15: accuracy of the rectangle and Gram-space iterations of ``S_p`` against the FP64 SVD,
over precision x p x condition number x aspect ratio, and what ``iteration="auto"`` makes of it.

Gram space also runs without its restarts (one block of every step), to show what they buy."""

from __future__ import annotations

from collections import defaultdict

import torch

from .. import dispatch, plan, reference
from ..coefficients import resolve_polar_coefficients
from ..linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error, scaled_
from ..ops import spectral_power
from ..progress import progress
from ..reporting import format_number, markdown_table, plt, write_outputs
from .report import command_line

SCHEDULES = ("rectangle", "gram_space", "gram_space_no_restarts")
PRECISIONS = ("fp64", "fp32", "bf16")
POWERS = (0, 2, 4)
CONDITION_NUMBERS = (10.0, 1e3, 1e6)
ASPECTS = (1, 4, 16)
SEEDS = (42, 43, 44)
RANK, QUICK_RANK = 64, 16
# What a schedule must meet to be usable at a precision. fp32: about ten fp32 roundoffs, above the
# rectangle's ~2e-6 with room for seeds (the result of an FP32 input is rounded to FP32 whatever the
# precision, so fp64 cannot do better). bf16: the README measures 1.0e-2 - 1.3e-2 for p >= 2 on the
# rectangle (a few bf16 unit roundoffs); 2e-2 keeps that margin.
BOUNDS = {"fp64": 2e-5, "fp32": 2e-5, "bf16": 2e-2}
STYLES = {"rectangle": "-", "gram_space": "--", "gram_space_no_restarts": ":"}
MARKERS = {1: "o", 4: "s", 16: "^"}
# Non-finite results are drawn at this height, above every finite error, so they are seen, not lost.
NON_FINITE_Y = 10.0


def compute(W: torch.Tensor, p: int, schedule: str, precision: str, coefficients) -> torch.Tensor:
    """``S_p(W)`` by ``schedule``, with no overflow check, so that a breakdown shows as NaN/Inf."""
    if schedule != "gram_space_no_restarts":
        return spectral_power(W, p, method="gram", precision=precision, iteration=schedule, capturable=True)
    gram_plan = plan.GramPlan(W, dispatch.kernels_for("spectral_power", W), precision,
                              restart_every=len(coefficients))
    direction, log_factor = gram_plan.scaled_power(p, coefficients, "gram_space")
    return gram_plan.oriented(scaled_(direction, log_factor)).to(W.dtype)


def measure(W, p, schedule, precision, exact, coefficients) -> dict:
    """``ok`` with its error, or ``nan``/``inf`` where the iteration broke down."""
    result = compute(W, p, schedule, precision, coefficients)
    nan, inf = int(result.isnan().sum()), int(result.isinf().sum())
    if nan or inf:
        return {"outcome": "nan" if nan else "inf", "error": None, "nan_entries": nan, "inf_entries": inf}
    return {"outcome": "ok", "error": relative_error(result, exact)}


def worst(outcomes: list[dict]) -> dict:
    """Seeds combined: a breakdown in any seed wins over a finite error (it is the one that matters)."""
    for kind in ("nan", "inf"):
        broken = [o for o in outcomes if o["outcome"] == kind]
        if broken:
            return {"outcome": kind, "error": None, "seeds_affected": len(broken)}
    return {"outcome": "ok", "error": max(o["error"] for o in outcomes)}


def cell(summary: dict) -> str:
    return format_number(summary["error"]) if summary["outcome"] == "ok" else summary["outcome"].upper()


def within(summary: dict, precision: str) -> bool:
    return summary["outcome"] == "ok" and summary["error"] <= BOUNDS[precision]


def run(out_dir, quick: bool = False) -> str:
    r = QUICK_RANK if quick else RANK
    seeds = SEEDS[:1] if quick else SEEDS
    coefficients = resolve_polar_coefficients(None, None)
    steps = len(coefficients)
    cases = [(kappa, aspect, seed) for kappa in CONDITION_NUMBERS for aspect in ASPECTS for seed in seeds]
    records = []
    for kappa, aspect, seed in progress(cases, desc="schedules", unit="matrix"):
        shape = (aspect * r, r)  # a wide matrix runs as its transpose: the plan iterates on the small side
        W = matrix_with_spectrum(shape, log_spaced_spectrum(r, kappa), torch.float32, seed=seed)
        exact = {p: reference.spectral_power_svd(W.double(), p) for p in POWERS}
        for schedule in SCHEDULES:
            for precision in PRECISIONS:
                for p in POWERS:
                    records.append({"schedule": schedule, "precision": precision, "p": p, "kappa": kappa,
                                    "aspect": aspect, "shape": list(shape), "seed": seed,
                                    **measure(W, p, schedule, precision, exact[p], coefficients)})

    by_case = defaultdict(list)  # the seeds of each (schedule, precision, p, kappa, aspect)
    for c in records:
        by_case[c["schedule"], c["precision"], c["p"], c["kappa"], c["aspect"]].append(c)
    grid = {key: worst(outcomes) for key, outcomes in by_case.items()}

    rows = [[schedule, precision, p, f"{aspect}:1", *[cell(grid[schedule, precision, p, k, aspect])
                                                       for k in CONDITION_NUMBERS]]
            for precision in PRECISIONS for p in POWERS for aspect in ASPECTS for schedule in SCHEDULES]
    table = markdown_table(["schedule", "precision", "p", "aspect", *[f"kappa={k:g}" for k in CONDITION_NUMBERS]],
                           rows)

    # Where each schedule is usable: the kappas at which every aspect ratio meets the bound.
    usable, usable_rows = {}, []
    for schedule in SCHEDULES:
        for precision in PRECISIONS:
            cells = []
            for p in POWERS:
                kappas = [k for k in CONDITION_NUMBERS
                          if all(within(grid[schedule, precision, p, k, a], precision) for a in ASPECTS)]
                usable[f"{schedule}/{precision}/p{p}"] = kappas
                cells.append(", ".join(f"{k:g}" for k in kappas) or "none")
            usable_rows.append([schedule, precision, f"{BOUNDS[precision]:g}", *cells])
    usable_table = markdown_table(["schedule", "precision", "bound", *[f"p={p}" for p in POWERS]], usable_rows)

    # What "auto" (the default) picks at the shape the plan sees, and whether that is within the bound,
    # next to the rectangle, so that a miss of the rectangle's own is not blamed on the choice.
    auto, auto_rows = [], []
    for precision in PRECISIONS:
        for p in POWERS:
            for aspect in ASPECTS:
                choice = plan.route((r, aspect * r), torch.float32, "cuda", p, precision, steps=steps).iteration
                marks = []
                for kappa in CONDITION_NUMBERS:
                    chosen, rectangle = (grid[s, precision, p, kappa, aspect] for s in (choice, "rectangle"))
                    ok, rectangle_ok = within(chosen, precision), within(rectangle, precision)
                    auto.append({"precision": precision, "p": p, "aspect": aspect, "kappa": kappa,
                                 "choice": choice, **chosen, "within_bound": ok,
                                 "rectangle_within_bound": rectangle_ok})
                    marks.append(f"{'yes' if ok else 'no'} ({cell(chosen)})"
                                 + (", REGRESSION: the rectangle meets it" if rectangle_ok and not ok else ""))
                auto_rows.append([precision, p, f"{aspect}:1", choice, *marks])
    auto_table = markdown_table(["precision", "p", "aspect", "auto picks",
                                 *[f"within bound, kappa={k:g}" for k in CONDITION_NUMBERS]], auto_rows)
    regressions = [a for a in auto if a["rectangle_within_bound"] and not a["within_bound"]]
    gram_picks = [a for a in auto if a["choice"] == "gram_space"]
    if regressions:
        verdict = ("`\"auto\"` leaves the bound where the rectangle meets it in " + "; ".join(
            f"{a['precision']} p={a['p']} {a['aspect']}:1 kappa={a['kappa']:g} ({cell(a)})" for a in regressions)
            + ".")
    else:
        settings = len({(a["precision"], a["p"], a["aspect"]) for a in gram_picks})
        verdict = (f"`\"auto\"` picks Gram space in {settings} of the {len(PRECISIONS) * len(POWERS) * len(ASPECTS)}"
                   " (precision, p, aspect) settings, and is within the bound wherever the rectangle is.")
    worst_gram = max((a["error"] for a in gram_picks if a["outcome"] == "ok" and a["rectangle_within_bound"]),
                     default=None)

    command = command_line("schedules", out_dir, quick)
    markdown = f"""# Rectangle vs Gram-space iteration: accuracy (issue #15)

`{command}`

Maximum relative Frobenius error of `spectral_power(W, p, method="gram", precision=..., iteration=...)`
against the FP64 SVD of the same FP32 input `W` (r = {r}; aspect ratios {", ".join(f"{a}:1" for a in ASPECTS)},
i.e. {", ".join(f"{a * r}x{r}" for a in ASPECTS)}; singular values log-spaced from 1 to 1/kappa; seeds
{", ".join(map(str, seeds))}, the worst shown; the default {steps} Polar Express steps).
`gram_space` iterates on `r x r` Grams in blocks of {", ".join(map(str, plan.restart_blocks(steps)))} steps,
each block restarting from the rectangle (`X <- Z X` and its new Gram); `gram_space_no_restarts`
is the same iteration in one block of {steps}. NaN/Inf marks a breakdown (run with no overflow check,
so that what the result held is recorded).

{table}

## Where each schedule meets its bound

The kappas at which every aspect ratio is within the bound (fp32/fp64: {BOUNDS['fp32']:g}, the output
being FP32; bf16: {BOUNDS['bf16']:g}, the README's measured ~1e-2 on the rectangle plus margin).
p = 0 misses at kappa >= 1e3 on every schedule by design: its smallest modes are below the Polar
Express design bound (see polar-accuracy).

{usable_table}

## What `iteration="auto"` (the default) picks

`spectral_ops.plan.route(({r}, aspect*{r}), torch.float32, "cuda", p, precision, steps={steps}).iteration`, and
whether its choice is within the bound at each kappa (REGRESSION marks a miss where the rectangle meets it).

{auto_table}

{verdict} Largest error of a Gram-space pick where the rectangle is within the bound:
{format_number(worst_gram) if worst_gram is not None else "-"}.
"""

    figure, axes = plt.subplots(1, len(PRECISIONS), figsize=(5 * len(PRECISIONS), 4), sharex=True)
    for ax, precision in zip(axes, PRECISIONS):
        for schedule in SCHEDULES:
            for color, p in enumerate(POWERS):
                for aspect in ASPECTS:
                    outcomes = [grid[schedule, precision, p, k, aspect] for k in CONDITION_NUMBERS]
                    y = [o["error"] if o["outcome"] == "ok" else NON_FINITE_Y for o in outcomes]
                    ax.loglog(CONDITION_NUMBERS, y, STYLES[schedule], marker=MARKERS[aspect], color=f"C{color}",
                              alpha=0.8, label=f"{schedule} p={p}" if aspect == ASPECTS[0] else None)
        ax.axhline(BOUNDS[precision], color="gray", ls="-.", label=f"bound {BOUNDS[precision]:g}")
        ax.axhline(NON_FINITE_Y, color="k", lw=0.5)
        ax.text(CONDITION_NUMBERS[0], NON_FINITE_Y * 1.3, "NaN/Inf", fontsize=8)
        ax.set(xlabel="kappa", title=precision, ylim=(1e-9, NON_FINITE_Y * 5))
    axes[0].set_ylabel("max relative Frobenius error vs FP64 SVD")
    aspect_handles = [plt.Line2D([], [], color="k", ls="", marker=MARKERS[a], label=f"{a}:1") for a in ASPECTS]
    handles, labels = axes[-1].get_legend_handles_labels()
    axes[-1].legend(handles + aspect_handles, labels + [h.get_label() for h in aspect_handles],
                    fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))

    data = {"protocol": {"rank": r, "aspects": ASPECTS, "shapes": [[a * r, r] for a in ASPECTS], "seeds": seeds,
                         "kappas": CONDITION_NUMBERS, "powers": POWERS, "schedules": SCHEDULES,
                         "precisions": PRECISIONS, "bounds": BOUNDS, "steps": steps,
                         "restart_blocks": plan.restart_blocks(steps), "input_dtype": "float32"},
            "summary": [{"schedule": s, "precision": prec, "p": p, "kappa": k, "aspect": a, **grid[s, prec, p, k, a],
                         "within_bound": within(grid[s, prec, p, k, a], prec)}
                        for (s, prec, p, k, a) in grid],
            "usable_kappas": usable, "auto": auto, "auto_regressions": len(regressions), "cases": records}
    write_outputs(out_dir, "schedules", markdown, data, figure)
    return markdown
