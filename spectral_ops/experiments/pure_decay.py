"""SPEC 7.3: pure-decay spectra, analytically.

Part 1: one heavy-tailed spectrum under the decay flow for p in {0, 1, 2}, at several accumulated
decay amounts. Part 2: the fixed-horizon decay (``--horizon``, ``--coefficients``) applied to the
matrix weights of a checkpoint for p in {0, 1, 2, 4}: a training checkpoint of
``python -m spectral_ops.train`` or a state dict saved with ``torch.save`` (``--checkpoint``), or, as
in the committed run since no trained checkpoint exists in this repository yet, a synthetic one with
heavy-tailed spectra.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..analysis import decay_checkpoint, pure_decay, time_to_shrink
from ..linalg import matrix_with_spectrum
from ..metrics import default_rank_tolerance, matrix_metrics, shape_distance, singular_values, spectrum_metrics
from ..optim.groups import NON_MATRIX_ROLES, parameter_role
from ..reporting import markdown_table, plt, write_outputs
from .report import command_line

# Part 1
SPECTRUM_MODES = 256
SPECTRUM_EXPONENT = 0.5               # s_i = i^-0.5: a power-law tail, s_1 = 1
FLOW_POWERS = (0, 1, 2)
# Decay amounts, as the fraction of the top mode left. Chosen so that for p = 0 no mode of i^-0.5
# sits exactly on the threshold 1 - factor (which would leave a round-off residue instead of a zero).
TOP_MODE_FACTORS = (1.0, 0.85, 0.7, 0.55, 0.4)
# Part 2
CHECKPOINT_POWERS = (0, 1, 2, 4)
HORIZON = 1.0
COEFFICIENTS = (0.1, 0.3, 1.0)
INDEX_GRID = np.linspace(0.0, 1.0, 101)


def power_law_spectrum(modes: int, exponent: float, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.arange(1, modes + 1, dtype=torch.float64) ** -exponent


def synthetic_checkpoint(layers: int = 4, width: int = 128, seed: int = 0) -> dict:
    """A stand-in state dict: per layer an attention-like square and an MLP-like 4:1 matrix with
    power-law spectra (exponents 0.3-0.9, top singular values 1-3) and random singular vectors, plus a
    norm gain vector (which decay must leave alone)."""
    generator = np.random.default_rng(seed)
    state = {}
    for layer in range(layers):
        for kind, shape in (("attn", (width, width)), ("mlp", (4 * width, width))):
            spectrum = power_law_spectrum(width, generator.uniform(0.3, 0.9), generator.uniform(1.0, 3.0))
            state[f"layers.{layer}.{kind}.weight"] = matrix_with_spectrum(
                shape, spectrum, torch.float32, seed=int(generator.integers(2**31)))
        state[f"layers.{layer}.norm.weight"] = torch.ones(width)
    return state


def _spectrum_row(s: torch.Tensor, start: torch.Tensor) -> dict:
    metrics = spectrum_metrics(s)
    return {"stable_rank": float(metrics["stable_rank"]), "effective_rank": float(metrics["effective_rank"]),
            "surviving_modes": int(metrics["algebraic_rank"]), "shape_distance_to_start": shape_distance([s], [start])}


def _mean(key: str, metrics: list) -> float:
    return float(np.mean([float(m[key]) for m in metrics]))


def _normalised_curve(W: torch.Tensor) -> np.ndarray:
    """``s_i / s_1`` against the normalised index ``(i-1)/(r-1)``, resampled on a common grid.

    Modes below the rank tolerance are set to 0: they are the round-off of the float32 cast, not spectrum.
    """
    s = singular_values(W)
    r = (s / s[0]).numpy()
    r[r <= default_rank_tolerance(W.shape, W.dtype)] = 0.0
    return np.interp(INDEX_GRID, np.linspace(0.0, 1.0, len(r)), r)


def load_checkpoint(path) -> tuple[dict, int | None]:
    """The model tensors of a checkpoint, and its training step (None for a plain state dict).

    ``path`` is a training checkpoint written by :func:`spectral_ops.train.loop.save_checkpoint`
    (``{"model": state_dict, "optimizer": ..., "step": ...}``), the run folder that holds one, or a
    state dict saved with ``torch.save``. Loaded on the CPU with ``weights_only`` (no code runs).
    """
    from ..train.loop import CHECKPOINT  # the training package is only needed here

    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    state = torch.load(path, map_location="cpu", weights_only=True)
    step = None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state, step = state["model"], state.get("step")
    if not isinstance(state, dict) or not any(isinstance(value, torch.Tensor) for value in state.values()):
        raise ValueError(f"{path} holds neither a training checkpoint (a dict with a 'model' state dict) nor a "
                         f"state dict of tensors (got {type(state).__name__})")
    return {name: tensor for name, tensor in state.items() if isinstance(tensor, torch.Tensor)}, step


def matrix_weights(state: dict) -> dict:
    """The floating 2-D tensors that spectral decay applies to: by :func:`spectral_ops.optim.parameter_role`,
    not embeddings, output heads or vectors (the optimizers leave those without spectral decay)."""
    return {name: tensor for name, tensor in state.items()
            if tensor.dim() == 2 and tensor.is_floating_point()
            and parameter_role(name, tensor) not in NON_MATRIX_ROLES}


def run(out_dir, quick: bool = False, checkpoint=None, horizon: float = HORIZON,
        coefficients=COEFFICIENTS) -> str:
    """``checkpoint``: a training checkpoint, its run folder or a saved state dict (see
    :func:`load_checkpoint`); default a synthetic one (smaller with ``quick``). Its matrix weights
    decay for ``horizon`` at each of ``coefficients``."""
    coefficients = tuple(float(lam) for lam in coefficients)
    if horizon <= 0 or not coefficients or min(coefficients) <= 0:
        raise ValueError(f"need horizon > 0 and positive coefficients, got {horizon} and {coefficients}")
    # The figure shows the middle coefficient (0.3 of the defaults).
    figure_coefficient = sorted(coefficients)[len(coefficients) // 2]
    start = power_law_spectrum(SPECTRUM_MODES, SPECTRUM_EXPONENT)
    flow = {}
    flow_rows = []
    for p in FLOW_POWERS:
        flow[p] = []
        for factor in TOP_MODE_FACTORS:
            amount = float(time_to_shrink(start[0], factor, 1.0, p))  # lambda t, with lambda = 1
            s = pure_decay(start, 1.0, amount, p)
            row = {"top_mode_left": factor, "lambda_t": amount, **_spectrum_row(s, start)}
            flow[p].append((row, s.numpy()))
            flow_rows.append([p, factor, amount, row["stable_rank"], row["effective_rank"], row["surviving_modes"],
                              row["shape_distance_to_start"]])

    source, step = checkpoint, None
    if source is None:
        checkpoint = synthetic_checkpoint(layers=2, width=32) if quick else synthetic_checkpoint()
    else:
        checkpoint, step = load_checkpoint(source)
    matrices = matrix_weights(checkpoint)
    if not matrices:
        raise ValueError(f"checkpoint {source} holds no floating-point matrix weight")
    names = list(matrices)
    before = list(matrices.values())
    before_metrics = [matrix_metrics(W) for W in before]
    checkpoint_results, checkpoint_rows, curves = [], [], {}
    for p in CHECKPOINT_POWERS:
        for lam in coefficients:
            decayed = decay_checkpoint(matrices, lam, horizon, p)
            after = [decayed[name] for name in names]
            after_metrics = [matrix_metrics(W) for W in after]
            result = {
                "p": p, "lambda": lam, "horizon": horizon,
                "stable_rank": _mean("stable_rank", after_metrics),
                "stable_rank_change": _mean("stable_rank", after_metrics) - _mean("stable_rank", before_metrics),
                "effective_rank": _mean("effective_rank", after_metrics),
                "frobenius_ratio": float(np.mean([float(a["frobenius_norm"] / b["frobenius_norm"])
                                                  for a, b in zip(after_metrics, before_metrics)])),
                "surviving_mode_fraction": float(np.mean([float(a["algebraic_rank"]) / min(W.shape)
                                                          for a, W in zip(after_metrics, after)])),
                "shape_distance": shape_distance(after, before),
            }
            checkpoint_results.append(result)
            checkpoint_rows.append([result[key] for key in ("p", "lambda", "stable_rank", "stable_rank_change",
                                                            "effective_rank", "frobenius_ratio",
                                                            "surviving_mode_fraction", "shape_distance")])
            if lam == figure_coefficient:
                curves[p] = np.stack([_normalised_curve(W) for W in after])
    curves["before"] = np.stack([_normalised_curve(W) for W in before])

    flow_table = markdown_table(["p", "top mode left", "lambda t", "stable rank", "eRank", "non-zero modes",
                                 "D_shape to start"], flow_rows)
    checkpoint_table = markdown_table(["p", "lambda", "stable rank", "Δ stable rank", "eRank",
                                       "‖W_T‖_F/‖W_0‖_F", "non-zero mode fraction", "D_shape to start"],
                                      checkpoint_rows)
    start_metrics = _spectrum_row(start, start)
    shapes = ", ".join(sorted({"x".join(map(str, checkpoint[name].shape)) for name in names}))
    if source is None:
        checkpoint_description = (
            "No trained checkpoint exists in this repository yet: this run uses a **synthetic** checkpoint of "
            f"{len(names)} float32 matrices ({shapes}) with power-law spectra (exponents 0.3-0.9, top singular "
            "values 1-3) and random singular vectors.")
    else:
        kind = "state dict" if step is None else f"training checkpoint at step {step}"
        checkpoint_description = (f"Checkpoint `{source}` ({kind}): its {len(names)} matrix weights ({shapes}); "
                                  "embeddings, output head and vectors are left out, as the optimizers' "
                                  "spectral decay leaves them.")
    defaults = horizon == HORIZON and coefficients == COEFFICIENTS
    markdown = f"""# Pure-decay spectra (SPEC 2, 7.3)

`{command_line("pure-decay", out_dir, quick, checkpoint=source, horizon=None if defaults else horizon,
                coefficients=None if defaults else " ".join(f"{lam:g}" for lam in coefficients))}`

## The decay flow on one spectrum

ds/dt = -lambda s^p solved in closed form, from s_i = i^-{SPECTRUM_EXPONENT} (i = 1..{SPECTRUM_MODES}; stable rank
{start_metrics['stable_rank']:.4g}, eRank {start_metrics['effective_rank']:.4g}). Raw amounts lambda t mean different
things for different p (S_p(cW) = c^p S_p(W)), so the amounts are chosen by what is left of the top
mode. p = 0 removes the same amount from every mode (the tail dies first: the shape sharpens), p = 1
keeps the shape, p = 2 shrinks large modes harder (the shape flattens).

{flow_table}

D_shape only compares modes that are non-zero in both spectra, so for p = 0 read it together with the
number of modes left: the decay first sharpens the surviving head, then kills it down to one mode.

## Fixed-horizon decay of a checkpoint

{checkpoint_description}
`analysis.decay_checkpoint(state_dict, lam, T, p)` applies the exact flow to every 2-D tensor of a
state dict, here to the matrix weights for T = {horizon:g} (`--horizon`) and lambda in
{{{", ".join(f"{lam:g}" for lam in coefficients)}}} (`--coefficients`). Values are means over the
matrices; D_shape compares each decayed matrix with its start.

{checkpoint_table}
"""
    figure, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, p in zip(axes.flat, FLOW_POWERS):
        for (row, s), shade in zip(flow[p], np.linspace(0.0, 0.8, len(flow[p]))):
            index = np.arange(1, len(s) + 1) / len(s)
            ax.loglog(index[s > 0], s[s > 0] / s[0], color=str(shade), label=f"top mode x{row['top_mode_left']}")
        ax.set(xlabel="normalised index i / r", ylabel="s_i / s_1", title=f"decay flow, p = {p}")
        ax.legend(fontsize=7)
    ax = axes[1, 1]
    for i, key in enumerate([*CHECKPOINT_POWERS, "before"]):
        lo, median, hi = np.percentile(curves[key], [25, 50, 75], axis=0)
        before = key == "before"
        color = "k" if before else f"C{i}"
        ax.semilogy(INDEX_GRID, median, color=color, ls="--" if before else "-",
                    label="before decay" if before else f"p={key}")
        ax.fill_between(INDEX_GRID, lo, hi, color=color, alpha=0.15)
    ax.set(xlabel="normalised index", ylabel="s_i / s_1 (median, 25-75% over matrices)", ylim=(1e-3, 1.5),
           title=f"{'synthetic checkpoint' if source is None else 'checkpoint'}, "
                 f"lambda={figure_coefficient:g}, T={horizon:g}")
    ax.legend(fontsize=7)
    figure.tight_layout()
    data = {"flow": {"start": {"exponent": SPECTRUM_EXPONENT, "modes": SPECTRUM_MODES, **start_metrics},
                     "results": {str(p): [row for row, _ in rows] for p, rows in flow.items()}},
            "checkpoint": {"source": "synthetic" if source is None else str(source), "step": step, "matrices": names,
                           "horizon": horizon, "coefficients": list(coefficients), "results": checkpoint_results}}
    write_outputs(out_dir, "pure-decay", markdown, data, figure)
    return markdown
