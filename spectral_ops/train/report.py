"""``python -m spectral_ops.train report RUN_DIRS... --out DIR``: what the runs did to the spectra.

Figures (PNG) and a table (markdown + JSON) from the runs' final checkpoints and logs:

* ``spectra.png``: normalised spectra ``s_i / s_1`` of the MLP and attention matrices against the
  normalised index, median and 25-75% band across layers, one curve per run;
* ``histograms.png``: ``log10 s`` and ``log10 s / s_1`` over all MLP and attention matrices;
* ``validation.png``: validation bits per byte against the step;
* ``coefficients.png``: final metrics against the spectral coefficient, one line per ``p``;
* ``pure_decay.png``: the analytic decay of SPEC 7.3 applied to the first run's checkpoint for
  ``p`` in {0, 1, 2, 4} at several horizons (the control: what decay alone would do).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import analysis, metrics
from ..experiments.report import markdown_table, plt, write_outputs
from .loop import CHECKPOINT
from .monitor import MODULE_TYPES
from .sweep import SUMMARY_COLUMNS

FAMILIES = {"MLP": ("mlp_expand", "mlp_project"), "attention": ("q", "k", "v", "o")}
CONTROL_POWERS = (0, 1, 2, 4)
CONTROL_HORIZONS = (0.1, 0.3, 1.0)


def load_run(run_dir: Path) -> dict:
    state = torch.load(Path(run_dir) / CHECKPOINT, map_location="cpu", weights_only=False)
    return {"name": Path(run_dir).name, "state": state["model"], "history": state["history"], "config": state["config"]}


def family_matrices(state: dict, family: str) -> list[torch.Tensor]:
    suffixes = [s for kind in FAMILIES[family] for s in MODULE_TYPES[kind]]
    return [tensor for name, tensor in state.items() if any(name.endswith(f"{s}.weight") for s in suffixes)]


def normalised_band(matrices):
    """Median and 25/75% quantiles across matrices of ``s_i / s_1``, on a common normalised index."""
    curves = []
    for W in matrices:
        s = metrics.singular_values(W)
        relative = s / s[0]
        # Modes at round-off level are zero modes: left out of the curve rather than drawn at 1e-8.
        relative[relative < metrics.default_rank_tolerance(W.shape, W.dtype)] = float("nan")
        curves.append(torch.nn.functional.interpolate(relative[None, None], size=128, mode="linear")[0, 0])
    stacked = torch.stack(curves)
    return torch.linspace(0, 1, 128), stacked.nanquantile(torch.tensor([0.25, 0.5, 0.75], dtype=stacked.dtype), dim=0)


def _spectra_panel(axes, runs):
    for axis, family in zip(axes, FAMILIES):
        for run in runs:
            index, (low, median, high) = normalised_band(family_matrices(run["state"], family))
            (line,) = axis.semilogy(index, median, label=run["name"])
            axis.fill_between(index, low, high, alpha=0.2, color=line.get_color())
        axis.set(title=f"{family} matrices", xlabel="normalised index i / r", ylabel="s_i / s_1 (median, 25-75%)")
        axis.legend(fontsize=7)


def _histograms(axes, runs):
    for run in runs:
        spectra = [metrics.singular_values(W) for family in FAMILIES for W in family_matrices(run["state"], family)]
        s, relative = torch.cat(spectra), torch.cat([v / v[0] for v in spectra])
        axes[0].hist(torch.log10(s.clamp_min(1e-12)).numpy(), bins=60, histtype="step", label=run["name"])
        axes[1].hist(torch.log10(relative.clamp_min(1e-12)).numpy(), bins=60, histtype="step", label=run["name"])
    axes[0].set(title="log10 s", xlabel="log10 s", ylabel="modes")
    axes[1].set(title="log10 s / s_1", xlabel="log10 s / s_1", ylabel="modes")
    axes[0].legend(fontsize=7)


def _validation(axis, runs):
    for run in runs:
        axis.plot([r["step"] for r in run["history"]], [r["val_bpb"] for r in run["history"]], marker="o", label=run["name"])
    axis.set(title="validation", xlabel="step", ylabel="bits per byte")
    axis.legend(fontsize=7)


def _coefficient_panels(axes, runs):
    by_power = {}
    for run in runs:
        by_power.setdefault(run["config"]["p"], []).append(run)
    for axis, key in zip(axes, ("val_bpb", "mlp_expand/stable_rank", "qk/stable_rank", "attention/entropy")):
        for p, group in sorted(by_power.items()):
            group = sorted(group, key=lambda r: r["config"]["spectral_weight_decay"])
            axis.plot([r["config"]["spectral_weight_decay"] for r in group], [r["history"][-1][key] for r in group],
                      marker="o", label=f"p={p}")
        axis.set(title=SUMMARY_COLUMNS[key], xlabel="spectral coefficient lambda_p")
        axis.legend(fontsize=7)


def _pure_decay_control(axes, run):
    """SPEC 7.3 on a trained checkpoint: ``ds/dt = -lambda s^p`` to horizon ``T``, analytically."""
    matrices = family_matrices(run["state"], "MLP")
    rows = []
    for axis, p in zip(axes, CONTROL_POWERS):
        for horizon in (0.0, *CONTROL_HORIZONS):
            decayed = analysis.decay_checkpoint(matrices, 1.0, horizon, p) if horizon else matrices
            nonzero = [W for W in decayed if metrics.spectral_norm(W) > 0]
            if nonzero:  # p = 0 can remove every mode of every matrix
                index, (_, median, _) = normalised_band(nonzero)
                axis.semilogy(index, median, label=f"lambda T={horizon:g}")
            rows.append([p, horizon, float(torch.stack([metrics.stable_rank(W) for W in decayed]).mean()),
                         metrics.shape_distance(matrices, decayed)])
        axis.set(title=f"pure decay, p={p} ({run['name']})", xlabel="normalised index", ylabel="s_i / s_1 (median)")
        axis.legend(fontsize=7)
    return rows


def report(run_dirs, out: Path) -> str:
    runs = [load_run(d) for d in run_dirs]
    out = Path(out)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    _spectra_panel(axes, runs)
    summary_rows = [[r["name"], r["config"]["p"], r["config"]["spectral_weight_decay"],
                     *(r["history"][-1][k] for k in SUMMARY_COLUMNS)] for r in runs]
    headers = ["run", "p", "lambda_p", *SUMMARY_COLUMNS.values()]
    first, last = runs[0], runs[-1]
    distance = metrics.shape_distance(family_matrices(first["state"], "MLP"), family_matrices(last["state"], "MLP"))
    text = (f"# Training report\n\n{markdown_table(headers, summary_rows)}\n\n"
            f"D_shape between the MLP spectra of {first['name']} and {last['name']}: {distance:.4f}\n")
    data = {"runs": [dict(zip(headers, row)) for row in summary_rows], "mlp_shape_distance_first_last": distance}
    write_outputs(out, "spectra", text, data, figure)

    for name, draw, shape in (("histograms", _histograms, (1, 2)), ("validation", _validation, (1, 1)),
                              ("coefficients", _coefficient_panels, (1, 4))):
        figure, axes = plt.subplots(*shape, figsize=(5.5 * shape[1], 4))
        draw(axes, runs)
        figure.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
        plt.close(figure)

    figure, axes = plt.subplots(1, len(CONTROL_POWERS), figsize=(5 * len(CONTROL_POWERS), 4))
    control = _pure_decay_control(axes, first)
    figure.savefig(out / "pure_decay.png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    control_table = markdown_table(["p", "lambda T", "mean MLP stable rank", "D_shape to trained"], control)
    (out / "pure_decay.md").write_text(f"# Pure-decay control on {first['name']}\n\n{control_table}\n")
    (out / "pure_decay.json").write_text(json.dumps(
        [dict(zip(["p", "lambda_T", "stable_rank", "shape_distance"], row)) for row in control], indent=2) + "\n")
    return text
