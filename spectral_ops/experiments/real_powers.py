"""Real and floored powers without an SVD (issue #30, docs/real-powers.md), against the FP64 SVD.

* fp32 ``S_p`` for fractional ``p`` at kappa 10, 1e3 and 1e6 (the goals: 2e-5 for p in {0.5, 1.5,
  2.5}, 1e-4 for {0.1155, 0.25}), and its matmul FLOPs against ``S_2``'s on the same shape (goal 2.5x);
* floored powers ``(s^2 + (eps s_max)^2)^(p/2)`` for negative ``p`` and floors down to 1e-8;
* bf16 Muon-family updates ``power_update(X, q)`` on Gaussian momenta against DynMuon's Taylor
  construction (``bench/baselines.py``), with their FLOPs per Polar Express Muon step (goals: 2e-2,
  10x the Taylor construction's accuracy, 1.5x the step);
* the same updates (bf16 and fp32) on low-rank momenta over a noise floor, at three noise levels.

The Taylor baseline lives in the repository's ``bench/``: this experiment runs from a checkout.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from .. import plan, reference
from ..coefficients import REAL_POWER_POLAR_STEPS
from ..linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from ..ops import power_update, spectral_power
from ..progress import progress
from ..reporting import markdown_table, plt, write_outputs
from .report import command_line

POWERS = (0.5, 1.5, 2.5, 0.1155, 0.25)
GOALS = {0.5: 2e-5, 1.5: 2e-5, 2.5: 2e-5, 0.1155: 1e-4, 0.25: 1e-4}
KAPPAS = (10.0, 1e3, 1e6)
GOAL_KAPPAS = (10.0, 1e3)
SHAPES, QUICK_SHAPES = ((128, 64), (64, 128), (256, 256)), ((64, 32),)
COST_SHAPES = ((128, 64), (768, 128), (1024, 1024), (1024, 4096))
FLOOR_POWERS, FLOORS = (-0.25, -1.5), (1e-1, 1e-2, 1e-3, 1e-5, 1e-8)
# DynMuon's schedule runs from +0.25 to -0.25; q = 0 is Muon.
UPDATE_POWERS = (-0.25, -0.1155, 0.0, 0.1155, 0.25)
MOMENTA, QUICK_MOMENTA = ((1024, 4096), (4096, 1024), (8, 128, 768)), ((128, 512), (512, 128), (2, 64, 384))
UPDATE_GOAL, TAYLOR_FACTOR, UPDATE_COST = 2e-2, 10.0, 1.5
# Low-rank momenta over a noise floor (a gradient's few strong directions and its noise): rank r/16, singular
# values log-spaced from 1 to 0.1, plus Gaussian noise whose largest singular value is NOISE_LEVELS of the top:
# above the update's floor (1e-2), at it, and at 1e-3, where the noise modes sit below Polar Express's design
# bound (1e-3 of ||X||_F) and below bf16's resolution of |X| (plan.RESOLUTION, 2^-6).
LOW_RANK_FRACTION, NOISE_LEVELS, LOW_RANK_POWERS = 1 / 16, (1e-1, 1e-2, 1e-3), (-0.25, 0.0, 0.25)


def taylor_baseline():
    """``taylor_power_update`` from the repository's bench/baselines.py."""
    path = Path(__file__).resolve().parents[2] / "bench" / "baselines.py"
    if not path.exists():
        raise FileNotFoundError(f"the real-powers experiment compares with bench/baselines.py, which is not at {path}: "
                                "run it from a checkout of the repository")
    spec = importlib.util.spec_from_file_location("spectral_ops_bench_baselines", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.taylor_power_update


def renormalised(D: torch.Tensor) -> torch.Tensor:
    """``D`` at the polar factor's Frobenius norm per matrix: the Taylor construction's scale is not an
    update's (``power_update`` sets it itself)."""
    D = D.double()
    return D * math.sqrt(min(D.shape[-2:])) / torch.linalg.vector_norm(D, dim=(-2, -1), keepdim=True)


def flops(call) -> tuple[torch.Tensor, float]:
    with FlopCounterMode(display=False) as counter:
        result = call()
    return result, counter.get_total_flops()


def fp32_accuracy(shapes):
    rows, records = [], []
    for kappa in progress(KAPPAS, desc="real-powers fp32", unit="kappa"):
        worst = {}
        for p in POWERS:
            errors = []
            for shape in shapes:
                W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape), kappa), torch.float64, seed=0)
                result = spectral_power(W.float(), p, method="gram", precision="fp32")
                errors.append(relative_error(result, reference.spectral_power_svd(W, p)))
            worst[p] = max(errors)
        records.append({"kappa": kappa, "max_relative_error": {str(p): e for p, e in worst.items()}})
        rows.append([f"{kappa:g}", *[worst[p] for p in POWERS]])
    goal_rows = [["goal", *[GOALS[p] for p in POWERS]],
                 ["met at kappa 10 and 1e3", *["yes" if all(r["max_relative_error"][str(p)] <= GOALS[p]
                                                           for r in records if r["kappa"] in GOAL_KAPPAS)
                                               else "no" for p in POWERS]]]
    table = markdown_table(["kappa", *[f"p={p}" for p in POWERS]], rows + goal_rows)
    cost_rows, costs = [], []
    for shape in COST_SHAPES:
        s2 = plan.cost("spectral_power", shape, p=2, iteration="auto")
        ratios = [plan.cost("spectral_power", shape, p=p, iteration="auto", steps=REAL_POWER_POLAR_STEPS) / s2
                  for p in POWERS]
        floored = plan.cost("spectral_power", shape, p=-0.25, iteration="auto", steps=REAL_POWER_POLAR_STEPS,
                            eps=1e-2) / s2
        costs.append({"shape": list(shape), "per_s2": {str(p): r for p, r in zip(POWERS, ratios)},
                      "floored_-0.25_per_s2": floored})
        cost_rows.append(["x".join(map(str, shape)), *ratios, floored])
    cost_table = markdown_table(["shape", *[f"p={p}" for p in POWERS], "p=-0.25, eps=1e-2"], cost_rows)
    return records, table, costs, cost_table


def floored_accuracy(shape):
    rows, records = [], []
    for kappa in GOAL_KAPPAS:
        W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape), kappa), torch.float64, seed=1)
        for p in FLOOR_POWERS:
            errors = [relative_error(spectral_power(W.float(), p, method="gram", eps=eps),
                                     reference.spectral_power_svd(W, p, eps)) for eps in FLOORS]
            records.append({"kappa": kappa, "p": p, "relative_error": dict(zip(map(str, FLOORS), errors))})
            rows.append([f"{kappa:g}", p, *errors])
    return records, markdown_table(["kappa", "p", *[f"eps={eps:g}" for eps in FLOORS]], rows)


def update_accuracy(shapes):
    taylor = taylor_baseline()
    rows, records = [], []
    for shape in progress(shapes, desc="real-powers updates", unit="shape"):
        X = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        _, step_flops = flops(lambda: power_update(X, 0, precision="bf16", dtype=torch.bfloat16))
        for q in UPDATE_POWERS:
            expected = reference.power_update_svd(X, q, plan.UPDATE_FLOOR)
            ours, ours_flops = flops(lambda: power_update(X, q, precision="bf16", dtype=torch.bfloat16))
            theirs, their_flops = flops(lambda: taylor(X, q))
            record = {"shape": list(shape), "q": q,
                      "ours": relative_error(ours, expected),
                      "taylor": relative_error(renormalised(theirs), expected),
                      "ours_flops_per_muon_step": ours_flops / step_flops,
                      "taylor_flops_per_muon_step": their_flops / step_flops}
            records.append(record)
            rows.append(["x".join(map(str, shape)), q, record["ours"], record["taylor"],
                         record["taylor"] / record["ours"], record["ours_flops_per_muon_step"],
                         record["taylor_flops_per_muon_step"]])
    table = markdown_table(["momentum", "q", "ours (bf16)", "Taylor (bf16)", "Taylor / ours",
                            "ours FLOPs / Muon step", "Taylor FLOPs / Muon step"], rows)
    return records, table


def low_rank_plus_noise(shape, noise: float, seed: int = 3) -> torch.Tensor:
    """A float32 momentum of ``shape``: rank ``r / 16`` with singular values log-spaced from 1 to 0.1, plus
    Gaussian noise scaled so that its largest singular value, about ``sqrt(m) + sqrt(n)`` times its
    entries' deviation, is ``noise``."""
    *_, m, n = shape
    r = min(m, n)
    rank = max(1, int(r * LOW_RANK_FRACTION))
    spectrum = torch.cat([torch.logspace(0, -1, rank, dtype=torch.float64), torch.zeros(r - rank, dtype=torch.float64)])
    signal = matrix_with_spectrum(shape, spectrum, torch.float64, seed=seed)
    gaussian = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return (signal + gaussian * (noise / (math.sqrt(m) + math.sqrt(n)))).float()


def low_rank_accuracy(shapes):
    rows, records = [], []
    for shape in progress(shapes, desc="real-powers low rank", unit="shape"):
        for noise in NOISE_LEVELS:
            X = low_rank_plus_noise(shape, noise)
            for q in LOW_RANK_POWERS:
                expected = reference.power_update_svd(X, q, plan.UPDATE_FLOOR)
                record = {"shape": list(shape), "noise": noise, "q": q}
                for precision in ("bf16", "fp32"):
                    result = power_update(X, q, precision=precision, dtype=plan.OPERAND_DTYPES[precision])
                    record[precision] = relative_error(result, expected)
                records.append(record)
                rows.append(["x".join(map(str, shape)), noise, q, record["bf16"], record["fp32"]])
    return records, markdown_table(["momentum", "noise / s_max", "q", "ours (bf16)", "ours (fp32)"], rows)


def run(out_dir, quick: bool = False) -> str:
    records, table, costs, cost_table = fp32_accuracy(QUICK_SHAPES if quick else SHAPES)
    floored, floored_table = floored_accuracy(QUICK_SHAPES[0] if quick else SHAPES[0])
    momenta = QUICK_MOMENTA if quick else MOMENTA
    updates, update_table = update_accuracy(momenta)
    low_rank, low_rank_table = low_rank_accuracy(momenta)
    worst_low_rank = {noise: max(r["bf16"] for r in low_rank if r["noise"] == noise) for noise in NOISE_LEVELS}
    fractional = [u for u in updates if u["q"] != 0]
    worst_update = max(u["ours"] for u in updates)
    worst_ratio = min(u["taylor"] / u["ours"] for u in fractional)
    worst_cost = max(u["ours_flops_per_muon_step"] for u in updates)
    command = command_line("real-powers", out_dir, quick)
    markdown = f"""# Real and floored powers without an SVD

`{command}`

Relative Frobenius error against the FP64 SVD of the same input (docs/real-powers.md explains the
construction and its limits).

## fp32 `S_p` for fractional p

`spectral_power(W, p, method="gram", precision="fp32")`, singular values log-spaced from 1 to
1/kappa, worst over {', '.join('x'.join(map(str, s)) for s in (QUICK_SHAPES if quick else SHAPES))};
Polar Express designed down to 1e-4 ({REAL_POWER_POLAR_STEPS} steps). Modes below 1e-4 of the top (kappa
1e6) are outside the design.

{table}

Matmul FLOPs per `S_2` on the same shape (`plan.cost`; goal 2.5x):

{cost_table}

## Floored powers

`spectral_power(W, p, method="gram", eps=eps)` in fp32 on a
{'x'.join(map(str, QUICK_SHAPES[0] if quick else SHAPES[0]))} matrix against
`U diag((s^2 + (eps s_max)^2)^(p/2)) V^T`:

{floored_table}

## bf16 Muon-family updates

`power_update(X, q, precision="bf16")` (what `SpectralMuon(update_power=q)` runs: Muon's 8-step Polar
Express, floor `eps = {plan.UPDATE_FLOOR:g}`) and DynMuon's construction (`bench/baselines.py`: the
second-order Taylor expansion of `(X X^T)^(q/2)` around `I` times 12 Newton-Schulz steps of Muon's
quintic, bf16; its scale is arbitrary, so it is renormalised to the polar factor's Frobenius norm, as
ours is by construction), against `reference.power_update_svd` (FP64 SVD), on Gaussian momenta. FLOPs per
Polar Express Muon step (`q = 0`) on the same momentum.

{update_table}

Worst error {worst_update:.2g} (goal {UPDATE_GOAL:g}); the Taylor construction is at least
{worst_ratio:.1f}x less accurate at q != 0 (goal {TAYLOR_FACTOR:g}x); worst cost {worst_cost:.2f}x a Muon
step (goal {UPDATE_COST:g}x).

## bf16 updates on low-rank momenta over noise

The same `power_update(X, q)` (and in fp32, to tell the operands' rounding from the iteration's design) on
momenta of rank r/{round(1 / LOW_RANK_FRACTION)} (singular values log-spaced from 1 to 0.1) plus Gaussian noise
whose largest singular value is the given fraction of the top: above the floor `eps = {plan.UPDATE_FLOOR:g}`, at
it, and at 1e-3, below Polar Express's design bound (1e-3 of `||X||_F`) and bf16's resolution of `|X|`
(`2^-6` of the top, `plan.RESOLUTION`), against `reference.power_update_svd` (the polar factor at `q = 0`
weighs every noise mode 1).

{low_rank_table}

Worst bf16 error by noise level: {", ".join(f"{noise:g}: {worst_low_rank[noise]:.2g}" for noise in NOISE_LEVELS)}.
"""
    figure, (ax_fp32, ax_bf16) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p in POWERS:
        ax_fp32.loglog(KAPPAS, [r["max_relative_error"][str(p)] for r in records], "o-", label=f"p={p}")
    ax_fp32.axhline(2e-5, ls="--", color="gray", label="goal 2e-5")
    ax_fp32.set(xlabel="kappa", ylabel="relative error", title="fp32 S_p, Gram route vs FP64 SVD")
    ax_fp32.legend(fontsize=7)
    for index, shape in enumerate(momenta):
        of_shape = [u for u in updates if u["shape"] == list(shape)]
        label = "x".join(map(str, shape))
        ax_bf16.semilogy([u["q"] for u in of_shape], [u["ours"] for u in of_shape], "o-", color=f"C{index}",
                         label=f"ours {label}")
        ax_bf16.semilogy([u["q"] for u in of_shape], [u["taylor"] for u in of_shape], "x--", color=f"C{index}",
                         label=f"Taylor {label}")
    ax_bf16.axhline(UPDATE_GOAL, ls=":", color="gray", label=f"goal {UPDATE_GOAL:g}")
    ax_bf16.set(xlabel="q", ylabel="relative error", title="bf16 updates U S^q V^T vs FP64 SVD")
    ax_bf16.legend(fontsize=6)
    data = {"protocol": {"powers": POWERS, "kappas": KAPPAS, "shapes": QUICK_SHAPES if quick else SHAPES,
                         "floors": FLOORS, "update_powers": UPDATE_POWERS, "momenta": momenta,
                         "update_floor": plan.UPDATE_FLOOR, "low_rank_fraction": LOW_RANK_FRACTION,
                         "noise_levels": NOISE_LEVELS, "low_rank_powers": LOW_RANK_POWERS},
            "fp32": records, "flops_per_s2": costs, "floored": floored, "updates": updates, "low_rank": low_rank,
            "summary": {"worst_update_error": worst_update, "least_taylor_ratio": worst_ratio,
                        "worst_update_cost": worst_cost,
                        "worst_low_rank_error": {str(noise): e for noise, e in worst_low_rank.items()}}}
    write_outputs(out_dir, "real-powers", markdown, data, figure)
    return markdown
