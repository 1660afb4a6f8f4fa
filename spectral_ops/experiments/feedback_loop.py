"""SPEC 5: the hidden feedback loop of weight decay on a scale-invariant loss.

Norm and effective lr ``eta_t / ||w||^2`` against the nominal schedule, for a constant and a cosine
schedule, and the converge / oscillate / diverge regime map over ``(eta, lambda)``, in full batch and
with tangential gradient noise.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap

from ..analysis import REGIMES, constant_schedule, cosine_schedule, regime_map, simulate_normalised_network
from .report import command_line, markdown_table, plt, write_outputs

ETA, LAMBDA = 0.1, 0.02
STEPS, QUICK_STEPS = 4000, 800
CHECKPOINTS = (0.0, 0.25, 0.5, 0.75, 0.95)  # fractions of training reported in the table
GRID_ETAS = np.logspace(-2, 1, 25)
GRID_LAMBDAS = np.logspace(-3, 0.5, 25)
QUICK_GRID = 8
MAP_STEPS, QUICK_MAP_STEPS = 3000, 400
NOISE = 0.3


def run(out_dir, quick: bool = False) -> str:
    steps = QUICK_STEPS if quick else STEPS
    schedules = {"constant": constant_schedule(steps), "cosine": cosine_schedule(steps)}
    trajectories = {name: simulate_normalised_network(ETA, LAMBDA, schedule) for name, schedule in schedules.items()}

    rows, trajectory_data = [], {}
    for name, trajectory in trajectories.items():
        nominal, norm, effective = trajectory.nominal_lr[:, 0], trajectory.norm[:, 0], trajectory.effective_lr[:, 0]
        for fraction in CHECKPOINTS:
            t = min(int(fraction * steps), steps - 1)
            rows.append([name, t, nominal[t] / nominal[0], norm[t] / norm[0], effective[t] / effective[0],
                         1.0 - trajectory.alignment[t, 0]])
        trajectory_data[name] = {
            "peak_effective_lr_over_initial": float(effective.max() / effective[0]),
            "peak_step": int(effective.argmax()),
            "log_norm_range_last_quarter": float(np.ptp(np.log(norm[-steps // 4:]))),
        }

    etas = GRID_ETAS[:: len(GRID_ETAS) // QUICK_GRID] if quick else GRID_ETAS
    lams = GRID_LAMBDAS[:: len(GRID_LAMBDAS) // QUICK_GRID] if quick else GRID_LAMBDAS
    map_steps = QUICK_MAP_STEPS if quick else MAP_STEPS
    maps = {"full batch": regime_map(etas, lams, map_steps),
            f"gradient noise {NOISE}": regime_map(etas, lams, map_steps, gradient_noise=NOISE)}
    count_rows = [[name, *[int((labels == regime).sum()) for regime in REGIMES]] for name, labels in maps.items()]

    headers = ["schedule", "step", "eta_t/eta_0", "‖w_t‖/‖w_0‖", "eff. lr / initial", "1 − cos(w, w*)"]
    table = markdown_table(headers, rows)
    counts = markdown_table(["gradient", *REGIMES], count_rows)
    constant, cosine = trajectory_data["constant"], trajectory_data["cosine"]
    late = min(int(0.75 * steps), steps - 1)
    cosine_run = trajectories["cosine"]
    late_nominal = cosine_run.nominal_lr[late, 0] / cosine_run.nominal_lr[0, 0]
    late_effective = cosine_run.effective_lr[late, 0] / cosine_run.effective_lr[0, 0]
    markdown = f"""# The normalised-network feedback loop (SPEC 5)

`{command_line("feedback-loop", out_dir, quick)}`

SGD with weight decay on the scale-invariant loss 1 − cos(w, w*) in 16 dimensions, eta = {ETA},
lambda = {LAMBDA}, {steps} steps, full batch. The gradient is orthogonal to w and scales as 1/‖w‖, so
‖w+‖² = (1 − eta lambda)² ‖w‖² + eta² ‖g‖² and the loss feels the effective lr eta_t / ‖w‖².

{table}

Once the direction is learned the gradient vanishes and decay shrinks the norm, so the effective lr
grows until the angle overshoots; the kick regrows the norm, and the cycle repeats.
Constant lr: the effective lr peaks at {constant['peak_effective_lr_over_initial']:.3g}x its initial value
(step {constant['peak_step']}) and the log-norm still swings by {constant['log_norm_range_last_quarter']:.3g} nats over
the last quarter. Cosine: the effective lr peaks at {cosine['peak_effective_lr_over_initial']:.3g}x
(step {cosine['peak_step']}); at 75% of training the nominal lr is {late_nominal:.3g}x its initial value
and the effective lr {late_effective:.3g}x.

## Regime map

Constant schedule, {map_steps} steps, {len(etas)} x {len(lams)} grid, eta in [{etas[0]:.3g}, {etas[-1]:.3g}],
lambda in [{lams[0]:.3g}, {lams[-1]:.3g}] (log-spaced). Over the last quarter of the run:
*diverge* = non-finite or exploding norm, or eta lambda ≥ 2 (the decay factor 1 − eta lambda ≤ −1);
*oscillate* = the log-norm both falls and rises by more than 0.05 (from an earlier peak / trough);
*converge* = otherwise, i.e. within this horizon. In full batch the boundary follows eta·lambda·steps:
every lambda > 0 oscillates eventually. Tangential gradient noise (a minibatch
gradient, std {NOISE}/‖w‖) keeps ‖g‖ from vanishing, which gives the norm an equilibrium for small eta·lambda.

{counts}
"""
    figure, axes = plt.subplot_mosaic("AABBCC;DDDEEE", figsize=(12, 7.5))
    for i, (name, trajectory) in enumerate(trajectories.items()):
        axes["A"].semilogy(trajectory.norm[:, 0], color=f"C{i}", label=name)
        axes["B"].semilogy(trajectory.effective_lr[:, 0] / trajectory.effective_lr[0, 0], color=f"C{i}",
                           label=f"{name}: eta_t/‖w‖² (rel.)")
        axes["B"].semilogy(trajectory.nominal_lr[:, 0] / trajectory.nominal_lr[0, 0], color=f"C{i}", ls="--",
                           label=f"{name}: nominal eta_t (rel.)")
        axes["C"].semilogy(np.maximum(1.0 - trajectory.alignment[:, 0], 1e-16), color=f"C{i}", label=name)
    axes["A"].set(xlabel="step", ylabel="‖w_t‖", title="weight norm")
    axes["B"].set(xlabel="step", ylabel="relative to step 0", title="effective vs nominal lr", ylim=(1e-3, None))
    axes["C"].set(xlabel="step", ylabel="1 − cos(w, w*)", title="alignment (loss)")
    for key in "ABC":
        axes[key].legend(fontsize=7)
    colors = ListedColormap(["#4c9a2a", "#f2a541", "#c0392b"])
    for key, (name, labels) in zip("DE", maps.items()):
        codes = np.vectorize(REGIMES.index)(labels)
        axes[key].pcolormesh(lams, etas, codes, cmap=colors, vmin=-0.5, vmax=2.5, shading="nearest")
        axes[key].set(xscale="log", yscale="log", xlabel="lambda", ylabel="eta", title=f"regimes, {name}")
        product = np.geomspace(lams[0], lams[-1])
        axes[key].plot(product, 2.0 / product, "k:", lw=1)  # eta lambda = 2
        axes[key].set_ylim(etas[0], etas[-1])
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i)) for i in range(len(REGIMES))]
    axes["E"].legend(handles, REGIMES, fontsize=7, loc="lower left")
    figure.tight_layout()
    data = {"protocol": {"eta": ETA, "lambda": LAMBDA, "steps": steps, "dim": 16, "map_steps": map_steps,
                         "noise": NOISE, "etas": etas.tolist(), "lambdas": lams.tolist()},
            "trajectories": trajectory_data,
            "checkpoints": [dict(zip(["schedule", "step", "nominal", "norm", "effective_lr", "loss"], row))
                            for row in rows],
            "regime_maps": {name: labels.tolist() for name, labels in maps.items()}}
    write_outputs(out_dir, "feedback-loop", markdown, data, figure)
    return markdown
