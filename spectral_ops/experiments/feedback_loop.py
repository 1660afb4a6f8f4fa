"""SPEC 5: the hidden feedback loop of weight decay on a scale-invariant loss.

Norm and effective lr ``eta_t / ||w||^2`` against the nominal schedule, for a constant and a cosine
schedule; the equilibrium norm ``n*`` (closed form against noisy simulations) and its stability, by
linearisation, with gradient noise and in full batch; the converge / oscillate / diverge regime map
over ``(eta, lambda)``, in full batch and with tangential gradient noise, and whether its boundary
follows ``eta`` or ``eta * lambda``.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap

from ..analysis import (
    REGIMES,
    constant_schedule,
    cosine_schedule,
    equilibrium_norm,
    equilibrium_norm_slope,
    full_batch_equilibrium,
    regime_boundary,
    regime_maps,
    simulate_normalised_network,
)
from ..reporting import markdown_table, plt, write_outputs
from .report import command_line

ETA, LAMBDA = 0.1, 0.02
STEPS, QUICK_STEPS = 4000, 800
CHECKPOINTS = (0.0, 0.25, 0.5, 0.75, 0.95)  # fractions of training reported in the table
GRID_ETAS = np.logspace(-2, 1, 25)
GRID_LAMBDAS = np.logspace(-3, 0.5, 25)
QUICK_GRID = 8
MAP_STEPS, QUICK_MAP_STEPS = 3000, 400
NOISE = 0.3
# (eta, lambda) pairs for the equilibrium table: eta lambda from 0.002 to 0.8, and eta from 0.01 to 2.
EQUILIBRIUM_POINTS = ((0.1, 0.02), (0.01, 0.5), (1.0, 0.05), (0.3, 0.2), (2.0, 0.4))
EQUILIBRIUM_STEPS, QUICK_EQUILIBRIUM_STEPS = 20000, 4000  # statistics over the second half
# The closed form treats c as a constant: it needs the norm to average c over many steps, i.e. a
# relaxation time 1 / (1 - F'(n*)) ~ 1 / (4 eta lambda) of a few steps or more.
SLOW_RELAXATION = 0.1  # eta lambda at or below which a row counts as slowly relaxing


def noisy_equilibria(steps: int) -> list[dict]:
    """``n*`` in closed form (``c^2 = mean ||w||^2 ||g||^2`` measured) against the mean ``||w||^2`` of
    noisy constant-lr runs, and the two linearisations: the norm map's ``F'(n*)`` against the lag-1
    autocorrelation of ``||w||^2`` (its AR(1) coefficient), and the full-batch 2-cycle's spectral radius."""
    eta, lam = (np.array(values) for values in zip(*EQUILIBRIUM_POINTS))
    trajectory = simulate_normalised_network(eta, lam, constant_schedule(steps), gradient_noise=NOISE)
    x = trajectory.norm[steps // 2:] ** 2
    c_squared = (x * trajectory.gradient_norm[steps // 2:] ** 2).mean(0)
    deviation = x - x.mean(0)
    lag1 = (deviation[1:] * deviation[:-1]).mean(0) / (deviation**2).mean(0)
    closed_form, slope = equilibrium_norm(eta, lam, np.sqrt(c_squared)), equilibrium_norm_slope(eta, lam)
    rows = []
    for i, (e, lam_i) in enumerate(EQUILIBRIUM_POINTS):
        full_batch = full_batch_equilibrium(e, lam_i)
        rows.append({"eta": e, "lambda": lam_i, "eta_lambda": e * lam_i, "c_squared": float(c_squared[i]),
                     "n_star": float(closed_form[i]), "n_star_simulated": float(np.sqrt(x[:, i].mean())),
                     "relative_error_n_star_squared": float(x[:, i].mean() / closed_form[i]**2 - 1),
                     "norm_map_slope": float(slope[i]), "lag1_autocorrelation": float(lag1[i]),
                     "log_norm_std": float(np.log(x[:, i]).std() / 2),
                     "full_batch_angle": full_batch.angle, "full_batch_n_star": full_batch.norm,
                     "full_batch_spectral_radius": full_batch.spectral_radius})
    return rows


def boundary_summary(etas, lams, labels) -> dict:
    """The converge boundary's slope and how much ``eta`` and ``eta lambda`` vary along it."""
    boundary = regime_boundary(etas, lams, labels)
    found = np.isfinite(boundary.etas)
    along_eta, along_product = boundary.etas[found], boundary.etas[found] * boundary.lambdas[found]
    spread = (lambda values: float(values.max() / values.min()) if values.size else float("nan"))  # noqa: E731
    return {"lambdas": boundary.lambdas.tolist(), "boundary_etas": boundary.etas.tolist(), "slope": boundary.slope,
            "columns": int(found.sum()), "eta_spread": spread(along_eta), "eta_lambda_spread": spread(along_product),
            "median_eta_lambda": float(np.median(along_product)) if along_product.size else float("nan")}


def _follows(slope: float) -> str:
    if not np.isfinite(slope):
        return "no boundary inside the grid"
    return "eta·lambda" if abs(slope + 1.0) < abs(slope) else "eta"


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
    # The same maps over a third of the horizon too: a boundary set by an equilibrium does not move with it.
    short_steps = map_steps // 3
    regimes = (("full batch", {}), (f"gradient noise {NOISE}", {"gradient_noise": NOISE}))
    maps_by_horizon = {name: regime_maps(etas, lams, (map_steps, short_steps), **options) for name, options in regimes}
    maps = {name: by_horizon[map_steps] for name, by_horizon in maps_by_horizon.items()}
    count_rows = [[name, *[int((labels == regime).sum()) for regime in REGIMES]] for name, labels in maps.items()]
    boundaries = {(name, horizon): boundary_summary(etas, lams, by_horizon[horizon])
                  for horizon in (map_steps, short_steps) for name, by_horizon in maps_by_horizon.items()}
    boundary_rows = [[name, horizon, b["columns"], b["slope"], _follows(b["slope"]), b["eta_spread"],
                      b["eta_lambda_spread"], b["median_eta_lambda"]] for (name, horizon), b in boundaries.items()]

    equilibrium_steps = QUICK_EQUILIBRIUM_STEPS if quick else EQUILIBRIUM_STEPS
    equilibria = noisy_equilibria(equilibrium_steps)
    equilibrium_rows = [[e["eta"], e["lambda"], e["eta_lambda"], e["c_squared"], e["n_star"], e["n_star_simulated"],
                         e["relative_error_n_star_squared"], e["norm_map_slope"], e["lag1_autocorrelation"],
                         e["log_norm_std"],
                         e["full_batch_angle"], e["full_batch_n_star"], e["full_batch_spectral_radius"]]
                        for e in equilibria]
    largest_slope = max(abs(e["norm_map_slope"]) for e in equilibria)
    smallest_radius = min(e["full_batch_spectral_radius"] for e in equilibria)
    slow = [e for e in equilibria if e["eta_lambda"] <= SLOW_RELAXATION]
    fast = [e for e in equilibria if e["eta_lambda"] > SLOW_RELAXATION]
    worst_error = max(abs(e["relative_error_n_star_squared"]) for e in slow)
    worst_lag1 = max(abs(e["lag1_autocorrelation"] - e["norm_map_slope"]) for e in slow)
    fast_rows = "; ".join(f"at eta lambda = {e['eta_lambda']:.3g} the mean ‖w‖² is off by "
                          f"{e['relative_error_n_star_squared']:+.1%} and the lag-1 autocorrelation is "
                          f"{e['lag1_autocorrelation']:.3g} against F' = {e['norm_map_slope']:.3g}" for e in fast)

    headers = ["schedule", "step", "eta_t/eta_0", "‖w_t‖/‖w_0‖", "eff. lr / initial", "1 − cos(w, w*)"]
    table = markdown_table(headers, rows)
    counts = markdown_table(["gradient", *REGIMES], count_rows)
    equilibrium_table = markdown_table(
        ["eta", "lambda", "eta·lambda", "c² (measured)", "n* closed form", "n* simulated", "rel. error of n*²",
         "F'(n*)", "lag-1 autocorr. of ‖w‖²", "std of log ‖w‖", "full batch θ*", "full batch n*", "full batch ρ(J)"],
        equilibrium_rows)
    boundary_table = markdown_table(
        ["gradient", "steps", "columns with a boundary", "slope d log eta_b / d log lambda", "follows",
         "eta_b max/min", "eta_b·lambda max/min", "median eta_b·lambda"], boundary_rows)
    long_boundaries = [boundaries[(name, map_steps)] for name in maps]
    shorter_horizon_ratio = [boundaries[(name, short_steps)]["median_eta_lambda"] / whole["median_eta_lambda"]
                             for name, whole in zip(maps, long_boundaries)]
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
*converge* = otherwise, i.e. within this horizon. In full batch the interior equilibrium is unstable
(below), so every lambda > 0 oscillates eventually. Tangential gradient noise (a minibatch
gradient, std {NOISE}/‖w‖) keeps ‖g‖ from vanishing, which gives the norm a stable equilibrium (below).

{counts}

## The equilibrium n* and its stability

With ‖g‖ = c/‖w‖, x = ‖w‖² follows x+ = (1 − eta lambda)² x + eta² c²/x, whose fixed point is
n*⁴ = eta c² / (lambda (2 − eta lambda)), i.e. **n*² = c sqrt(eta / (lambda (2 − eta lambda)))**
(`analysis.equilibrium_norm`). The expression sqrt(eta c / (lambda (2 − eta lambda))) is therefore n*²
when its c stands for c² = ‖w‖²‖g‖², not n*. Noisy runs (gradient noise {NOISE}, {equilibrium_steps}
steps, statistics over the second half, c² measured as mean ‖w‖²‖g‖²) test it. For
eta lambda ≤ {SLOW_RELAXATION}, where the norm relaxes over 1/(4 eta lambda) ≥ 2.5 steps and so averages the
noisy c, the mean ‖w‖² is within {worst_error:.2%} of n*². The closed form treats c as a constant, and
fails where the norm forgets its past within a step: {fast_rows or "(no such row)"}
(x+ ≈ eta² c_t²/x_t follows the latest draw of c, and the mean of c²/x is not mean c² / mean x).

Linearising the norm map n+ = F(n) = sqrt((1 − eta lambda)² n² + eta² c²/n²) at n* gives
**F'(n*) = 2 (1 − eta lambda)² − 1** (`analysis.equilibrium_norm_slope`): |F'(n*)| < 1 for every
0 < eta lambda < 2 except eta lambda = 1, where it is −1. Here |F'(n*)| ≤ {largest_slope:.4g}:
{"with c held up by gradient noise the equilibrium is **stable**" if largest_slope < 1 else "NOT stable"}.
For eta lambda ≤ {SLOW_RELAXATION} the noisy runs confirm the linearisation: the lag-1 autocorrelation of ‖w‖²
(an AR(1) process x+ − x* ≈ F'(n*)(x − x*) + noise) matches F'(n*) to {worst_lag1:.3g}.

In full batch c = ‖w‖‖g‖ = sin θ is not constant (θ is the angle to w*). Every step turns w towards w*,
so the interior equilibrium is a 2-cycle: the direction flips between ±θ*, 2θ* = arccos(1 − eta lambda),
at the norm n*² = eta / (2 cos θ*) (`analysis.full_batch_equilibrium`). The Jacobian of
(‖w‖², θ) → (‖w+‖², −θ+) there has det J = 1 + eta lambda (1 − eta lambda) > 1, so its spectral radius
ρ(J) exceeds 1 (here ρ(J) ≥ {smallest_radius:.6g}): the full-batch equilibrium is
**{"unstable" if smallest_radius > 1 else "stable"}**, an outward spiral, which is the oscillation of SPEC 5.
So both statements hold, for different systems: the write-up's "unstable equilibrium" is the
full-batch loop; the noisy simulator's settling at n* (the issue's 0.3% match) is the stable
equilibrium of a loop whose ‖w‖‖g‖ the noise keeps away from 0.

{equilibrium_table}

## What sets the boundary: eta or eta·lambda?

Rescaling w by k maps a run with (eta, lambda) to one with (eta/k², lambda k²) from a k-times smaller
start: eta lambda is the only scale-free combination, so once the start is forgotten the regime can
depend on eta lambda alone (n*, F'(n*) and ρ(J) above do), and eta alone enters only through the
start's effective lr eta/‖w_0‖². Test on the maps: in each lambda column, the boundary eta_b lies
between the last converging eta and the first that does not; a line fitted to log eta_b against
log lambda has slope 0 if eta sets the boundary and −1 if eta·lambda does (`analysis.regime_boundary`).
The maps of a third of the horizon ({short_steps} steps) show whether the boundary is an equilibrium
property or a horizon effect.

{boundary_table}

Over {map_steps} steps the boundary follows **{_follows(long_boundaries[0]["slope"])}** in full batch
(slope {long_boundaries[0]["slope"]:.3g}) and **{_follows(long_boundaries[1]["slope"])}** with gradient noise (slope
{long_boundaries[1]["slope"]:.3g}). Neither is a fixed eta·lambda: over a third of the horizon the median
eta_b·lambda is {shorter_horizon_ratio[0]:.3g}x (full batch) and {shorter_horizon_ratio[1]:.3g}x (noise) larger. In
full batch that is the time the norm takes to decay until the learned direction
turns unstable; with noise the *oscillate* label near the boundary marks the stationary
fluctuations of the log-norm around the stable n* (std of log ‖w‖ in the table above, growing with
eta·lambda) crossing the classifier's 0.05-nat threshold, not an instability.
"""
    figure, axes = plt.subplot_mosaic("AABBCC;DDEEFF", figsize=(13, 7.5))
    for i, (name, trajectory) in enumerate(trajectories.items()):
        axes["A"].semilogy(trajectory.norm[:, 0], color=f"C{i}", label=name)
        axes["B"].semilogy(trajectory.effective_lr[:, 0] / trajectory.effective_lr[0, 0], color=f"C{i}",
                           label=f"{name}: eta_t/‖w‖² (rel.)")
        axes["B"].semilogy(trajectory.nominal_lr[:, 0] / trajectory.nominal_lr[0, 0], color=f"C{i}", ls="--",
                           label=f"{name}: nominal eta_t (rel.)")
        axes["C"].semilogy(np.maximum(1.0 - trajectory.alignment[:, 0], 1e-16), color=f"C{i}", label=name)
    n_star = full_batch_equilibrium(ETA, LAMBDA).norm
    axes["A"].axhline(n_star, color="k", ls=":", lw=1, label=f"full-batch n* = {n_star:.3g} (unstable)")
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
        boundary = boundaries[(name, map_steps)]
        axes[key].plot(lams, boundary["boundary_etas"], "kx", ms=4)
        axes[key].set_ylim(etas[0], etas[-1])
        axes["F"].loglog(lams, boundary["boundary_etas"], "o" if key == "D" else "s", color=f"C{3 + 'DE'.index(key)}",
                         label=f"{name}: slope {boundary['slope']:.2f}", ms=4)
    # Reference lines through the full-batch boundary's geometric centre.
    anchor_lams, anchor_etas = (np.array(values) for values in zip(*[
        (lam, eta) for lam, eta in zip(lams, long_boundaries[0]["boundary_etas"]) if np.isfinite(eta)]))
    centre_lam, centre_eta = np.exp(np.log(anchor_lams).mean()), np.exp(np.log(anchor_etas).mean())
    axes["F"].loglog(lams, centre_eta * centre_lam / lams, "k-", lw=0.8, label="eta·lambda = const (slope −1)")
    axes["F"].loglog(lams, np.full(len(lams), centre_eta), "k--", lw=0.8, label="eta = const (slope 0)")
    axes["F"].set(xlabel="lambda", ylabel="boundary eta_b", title=f"converge boundary ({map_steps} steps)",
                  ylim=(etas[0], etas[-1]))
    axes["F"].legend(fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i)) for i in range(len(REGIMES))]
    axes["E"].legend(handles, REGIMES, fontsize=7, loc="lower left")
    figure.tight_layout()
    data = {"protocol": {"eta": ETA, "lambda": LAMBDA, "steps": steps, "dim": 16, "map_steps": map_steps,
                         "noise": NOISE, "etas": etas.tolist(), "lambdas": lams.tolist(),
                         "equilibrium_steps": equilibrium_steps},
            "trajectories": trajectory_data,
            "checkpoints": [dict(zip(["schedule", "step", "nominal", "norm", "effective_lr", "loss"], row))
                            for row in rows],
            "regime_maps": {name: labels.tolist() for name, labels in maps.items()},
            "equilibria": equilibria,
            "boundaries": [{"gradient": name, "steps": horizon, **b} for (name, horizon), b in boundaries.items()]}
    write_outputs(out_dir, "feedback-loop", markdown, data, figure)
    return markdown
