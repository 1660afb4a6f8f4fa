"""``python -m spectral_ops.train report RUN_DIRS... --out DIR``: what the runs did to the spectra.

Figures (PNG) and tables (markdown + JSON) from the runs' final checkpoints and logs:

* ``spectra.png``: normalised spectra ``s_i / s_1`` against the normalised index, median and 25-75%
  band across layers, one panel per matrix family (MLP gate, up, down, Q, K, V, O), one curve per
  run; ``spectra.md``/``.json``: the final metrics of each run, then
  - SPEC 7.4: ``D_shape`` and the mean stable-rank change (percent) of the MLP expand matrices
    (gate and up, each family on its own) between the sweep ends, the smallest and the largest
    coefficient at each ``p``;
  - SPEC 7.5: V weight eRank and stable rank, and the V activation eRank and cross-head CKA on
    sampled tokens of the first run's probe batch, both with each run's own activations and with
    fixed inputs (each run's V weights applied to the inputs the first run's V projections received);
* ``histograms.png``: probability mass (summing to 1 per run) of ``log10 s`` and ``log10 s / s_1``
  over all the matrices of the families above;
* ``validation.png``: the validation loss (bits per byte, or nats per token on token shards) against the step;
* ``coefficients.png``: final metrics against the spectral coefficient, one line per ``p``;
* ``pure_decay.png``: the analytic decay of SPEC 7.3 applied to the first run's MLP matrices for
  ``p`` in {0, 1, 2, 4} at several horizons (the control: what decay alone would do).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from .. import analysis, metrics
from ..reporting import markdown_table, plt, with_machine, write_outputs
from .config import TrainConfig
from .data import load_corpus, validation_batches
from .loop import CHECKPOINT, validation_key
from .model import Transformer
from .monitor import MODULE_TYPES, family_weights, probe_tokens, v_projection_names
from .sweep import COLUMN_NAMES

MLP_FAMILIES = ("mlp_gate", "mlp_up", "mlp_down")
EXPAND_FAMILIES = ("mlp_gate", "mlp_up")  # SPEC 7.4's "expand matrices", one family each
COEFFICIENT_PANELS = ("mlp_gate/stable_rank", "mlp_up/stable_rank", "qk/stable_rank", "attention/entropy")
CONTROL_POWERS = (0, 1, 2, 4)
CONTROL_HORIZONS = (0.1, 0.3, 1.0)
HISTOGRAM_BINS = 60
V_HEADERS = ["run", "V weight eRank", "V weight SR", "V act. eRank", "V act. eRank (fixed inputs)",
             "cross-head CKA", "cross-head CKA (fixed inputs)"]


def load_run(run_dir: Path) -> dict:
    state = torch.load(Path(run_dir) / CHECKPOINT, map_location="cpu", weights_only=False)
    return {"name": Path(run_dir).name, "state": state["model"], "history": state["history"], "config": state["config"]}


def run_config(run) -> TrainConfig:
    """The run's config; a field added since the run was saved takes its default."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{key: value for key, value in run["config"].items() if key in known})


def run_model(run) -> Transformer:
    model = Transformer(run_config(run).model_config(run["state"]["embed.weight"].shape[0]))
    model.load_state_dict(run["state"])
    return model.eval()


def family_matrices(state: dict, kind: str) -> list[torch.Tensor]:
    """The family's weight in each layer, in layer order (the state dict's order)."""
    suffix = f"{MODULE_TYPES[kind]}.weight"
    return [tensor for name, tensor in state.items() if name.endswith(suffix)]


def _final(run, key: str) -> float:
    """The last logged value; NaN for a key the run's version of the monitor did not log."""
    return run["history"][-1].get(key, math.nan)


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


def _spectra_panels(axes, runs):
    for axis, kind in zip(axes.flat, MODULE_TYPES):
        for run in runs:
            index, (low, median, high) = normalised_band(family_matrices(run["state"], kind))
            (line,) = axis.semilogy(index, median, label=run["name"])
            axis.fill_between(index, low, high, alpha=0.2, color=line.get_color())
        axis.set(title=MODULE_TYPES[kind], xlabel="normalised index i / r", ylabel="s_i / s_1 (median, 25-75%)")
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(MODULE_TYPES):]:
        axis.set_visible(False)


def probability_mass(values: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Share of ``values`` in each bin of ``edges`` (sums to 1 when the edges span the values)."""
    counts = torch.histogram(values.to(torch.float64), edges.to(torch.float64)).hist
    return counts / values.numel()


def _histograms(axes, runs):
    # One batched SVD per family: a family's matrices share their shape. Rows: layers, descending.
    spectra = {run["name"]: [metrics.singular_values(torch.stack(family_matrices(run["state"], kind)))
                             for kind in MODULE_TYPES] for run in runs}
    for axis, transform, label in ((axes[0], lambda s: s, "log10 s"),
                                   (axes[1], lambda s: s / s[:, :1], "log10 s / s_1")):
        values = {name: torch.log10(torch.cat([transform(s).flatten() for s in run_spectra]).clamp_min(1e-12))
                  for name, run_spectra in spectra.items()}
        pooled = torch.cat(list(values.values()))
        # Shared edges, so that the runs' bars line up.
        edges = torch.linspace(float(pooled.min()), float(pooled.max()), HISTOGRAM_BINS + 1, dtype=torch.float64)
        for name, run_values in values.items():
            axis.stairs(probability_mass(run_values, edges).numpy(), edges.numpy(), label=name)
        axis.set(title=label, xlabel=label, ylabel="probability mass per bin")
    axes[0].legend(fontsize=7)


def _validation(axis, runs):
    for run in runs:
        key = validation_key(run["history"][-1])
        axis.plot([r["step"] for r in run["history"]], [r[key] for r in run["history"]], marker="o", label=run["name"])
    axis.set(title="validation", xlabel="step", ylabel=" / ".join(sorted(
        {COLUMN_NAMES[validation_key(run["history"][-1])] for run in runs})))
    axis.legend(fontsize=7)


def runs_by_power(runs) -> dict[int, list[dict]]:
    """The runs grouped by ``p`` (ascending), each group in ascending coefficient order."""
    by_power = {}
    for run in sorted(runs, key=lambda r: r["config"]["spectral_weight_decay"]):
        by_power.setdefault(run["config"]["p"], []).append(run)
    return dict(sorted(by_power.items()))


def _coefficient_panels(axes, runs):
    by_power = runs_by_power(runs)
    for axis, key in zip(axes, (validation_key(runs[0]["history"][-1]), *COEFFICIENT_PANELS)):
        for p, group in by_power.items():
            axis.plot([r["config"]["spectral_weight_decay"] for r in group], [_final(r, key) for r in group],
                      marker="o", label=f"p={p}")
        axis.set(title=key, xlabel="spectral coefficient lambda_p")
        axis.legend(fontsize=7)


def sweep_end_pairs(runs) -> list[tuple[dict, dict]]:
    """At each ``p`` with at least two coefficients: the runs at the smallest and the largest one."""
    return [(group[0], group[-1]) for group in runs_by_power(runs).values()
            if group[0]["config"]["spectral_weight_decay"] != group[-1]["config"]["spectral_weight_decay"]]


def expand_comparison(state_a: dict, state_b: dict) -> dict[str, dict]:
    """SPEC 7.4 per expand family: ``D_shape`` between the per-layer matrices of ``a`` and ``b`` and
    the mean stable-rank change from ``a`` to ``b`` in percent."""
    comparison = {}
    for kind in EXPAND_FAMILIES:
        a, b = family_matrices(state_a, kind), family_matrices(state_b, kind)
        comparison[kind] = {"shape_distance": metrics.shape_distance(a, b),
                            "stable_rank_change_percent": metrics.stable_rank_change_percent(a, b)}
    return comparison


def reference_tokens(run) -> torch.Tensor:
    """The probe batch the run's monitor measures on (from the run's own validation data)."""
    config = run_config(run)
    corpus = load_corpus(config.data, vocab_size=config.vocab_size)
    return probe_tokens(validation_batches(corpus, config.val_batches, config.batch_size, config.seq_len))


def _v_inputs(model, tokens) -> list[torch.Tensor]:
    names = v_projection_names(model)
    captured = metrics.capture(model, names, tokens)
    return [captured[name].args[0] for name in names]


def v_activation_rows(runs, tokens) -> list[dict]:
    """SPEC 7.5 per run: V weight eRank and stable rank (mean over layers), and the V activation eRank
    and cross-head CKA on ``tokens``, with the run's own V inputs and with the first run's (fixed
    inputs). A run whose V weights do not fit the first run's inputs gets NaN for the latter."""
    rows, reference_inputs = [], None
    for run in runs:
        model = run_model(run)
        weights = [w.detach() for w in family_weights(model, "v")]
        n_heads = model.config.n_heads
        inputs = _v_inputs(model, tokens)
        reference_inputs = inputs if reference_inputs is None else reference_inputs
        own = metrics.fixed_input_v_metrics(inputs, weights, n_heads)
        fits = len(weights) == len(reference_inputs) and all(
            W.shape[1] == x.shape[-1] for W, x in zip(weights, reference_inputs))
        fixed = (metrics.fixed_input_v_metrics(reference_inputs, weights, n_heads) if fits
                 else dict.fromkeys(own, math.nan))
        weight_summary = metrics.matrix_metrics(torch.stack(weights))
        rows.append({"run": run["name"],
                     "v_weight_effective_rank": float(weight_summary["effective_rank"].mean()),
                     "v_weight_stable_rank": float(weight_summary["stable_rank"].mean()),
                     "v_activation_effective_rank": own["activation_effective_rank"],
                     "v_activation_effective_rank_fixed_inputs": fixed["activation_effective_rank"],
                     "cross_head_cka": own["cross_head_cka"],
                     "cross_head_cka_fixed_inputs": fixed["cross_head_cka"]})
    return rows


def _pure_decay_control(axes, run):
    """SPEC 7.3 on a trained checkpoint: ``ds/dt = -lambda s^p`` to horizon ``T``, analytically."""
    matrices = [W for kind in MLP_FAMILIES for W in family_matrices(run["state"], kind)]
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


def _expand_section(runs) -> tuple[str, list[dict]]:
    records = []
    for a, b in sweep_end_pairs(runs):
        for kind, values in expand_comparison(a["state"], b["state"]).items():
            records.append({"p": a["config"]["p"],
                            "from": a["name"], "lambda_from": a["config"]["spectral_weight_decay"],
                            "to": b["name"], "lambda_to": b["config"]["spectral_weight_decay"],
                            "family": kind, **values})
    title = "## MLP expand matrices between the sweep ends (SPEC 7.4)\n\n"
    if not records:
        return title + "No two runs share `p` with different coefficients: nothing to compare.\n", records
    headers = ["p", "from", "lambda", "to", "lambda", "family", "D_shape", "mean SR change %"]
    return title + markdown_table(headers, [list(r.values()) for r in records]) + "\n", records


def report(run_dirs, out: Path) -> str:
    runs = [load_run(d) for d in run_dirs]
    out = Path(out)
    figure, axes = plt.subplots(2, 4, figsize=(22, 8.5), layout="constrained")
    _spectra_panels(axes, runs)
    columns = [key for key in COLUMN_NAMES if any(key in run["history"][-1] for run in runs)]
    summary_rows = [[r["name"], r["config"]["p"], r["config"]["spectral_weight_decay"],
                     *(_final(r, k) for k in columns)] for r in runs]
    headers = ["run", "p", "lambda_p", *(COLUMN_NAMES[k] for k in columns)]
    expand_text, expand_records = _expand_section(runs)
    v_rows = v_activation_rows(runs, reference_tokens(runs[0]))
    text = (f"# Training report\n\n{markdown_table(headers, summary_rows)}\n\n{expand_text}\n"
            f"## V projections (SPEC 7.5)\n\nActivation metrics on {metrics.V_SAMPLE_TOKENS} sampled tokens per "
            f"layer of {runs[0]['name']}'s probe batch; fixed inputs: each run's V weights applied to the inputs "
            f"{runs[0]['name']}'s V projections received.\n\n"
            f"{markdown_table(V_HEADERS, [list(r.values()) for r in v_rows])}\n")
    data = {"runs": [dict(zip(headers, row)) for row in summary_rows], "expand_comparisons": expand_records,
            "v_projections": v_rows}
    write_outputs(out, "spectra", text, data, figure)

    for name, draw, shape in (("histograms", _histograms, (1, 2)), ("validation", _validation, (1, 1)),
                              ("coefficients", _coefficient_panels, (1, 1 + len(COEFFICIENT_PANELS)))):
        figure, axes = plt.subplots(*shape, figsize=(5.5 * shape[1], 4))
        draw(axes, runs)
        figure.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
        plt.close(figure)

    first = runs[0]
    figure, axes = plt.subplots(1, len(CONTROL_POWERS), figsize=(5 * len(CONTROL_POWERS), 4))
    control = _pure_decay_control(axes, first)
    figure.savefig(out / "pure_decay.png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    control_table = markdown_table(["p", "lambda T", "mean MLP stable rank", "D_shape to trained"], control)
    (out / "pure_decay.md").write_text(with_machine(f"# Pure-decay control on {first['name']}\n\n{control_table}"))
    (out / "pure_decay.json").write_text(json.dumps(
        [dict(zip(["p", "lambda_T", "stable_rank", "shape_distance"], row)) for row in control], indent=2) + "\n")
    return text
