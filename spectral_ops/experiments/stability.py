"""Does spectral shaping widen the stable learning-rate range? (SPEC 11, issue #54.)

The reference Transformer (``spectral_ops.train``, the ``tiny`` preset: 2 layers, width 128, 4 heads of 32,
bytes of the Python standard library) trains for 150 steps (10 warm-up, then the preset's cosine to 0.1x,
gradient clipping at 1) under each method of :data:`METHODS`, at every lr of the grid and every seed. Every
method runs the same data, initial weights and schedule; only the decay, or the cap or clip on top of it,
differs. Each run records, per step, its training loss and, from the attention's side observation of the
training forward (:class:`~spectral_ops.train.model.AttentionObservation`), each head's largest logit and
entropy, with the spectral norms of each head's query and key rows; at the end its validation bits per
byte, the attention entropy on fixed validation sequences, the round-to-nearest per-channel int8 and int4
weight error and bits per byte (SPEC 11, S^2D), and the activations' outlier ratio at the linear inputs.

**Matched decay.** The baseline is AdamW with the ordinary decay ``lambda_1 = 0.1`` (lr-coupled, torch's
AdamW), on every matrix of the blocks. ``p = 2`` and ``p = 4`` replace it by ``lambda_p S_p(W)`` with
``lambda_p s0^p = lambda_1 s0``: the same decay of the top mode at ``s0``, the initial weights' mean
spectral norm of the matrix family (attention: Q, K, V, O; MLP: gate, up, down), so that the powers start
equal at the top and differ by how they treat modes that grow above (more decay) or sit below it (less).
The top band is ``p = 4`` above ``s0`` and the baseline below (``Band(mode="two_band")``, continuous at
``s0``). Cautious decay (Chen et al. 2025) applies each decay only where it agrees in sign with the update.

**Unstable** (#54's first look: no run turned non-finite, but the attention entropy collapsed as the bits
per byte rose: 0.065 and 3.80 at lr 1e-2, against 0.28 and 3.44 for the same run at 3e-3, measured for this
experiment, within 0.02 of the best lr's): a run is *unstable* when it
diverged (a non-finite loss or weight, or a final loss above its first), when its final mean attention
entropy on the validation probe is below :data:`~.stability_measures.ENTROPY_FLOOR`, or when its final loss is
more than :data:`~.stability_measures.LOSS_MARGIN` above its own best (both smoothed over
:data:`~.stability_measures.LOSS_WINDOW` steps): :mod:`~.stability_measures` defines each.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import metrics
from ..optim import QKCap, SpectralAdamW
from ..optim.groups import ATTENTION_ROLES, MLP_ROLES
from ..progress import progress
from ..reporting import FIGURE_DPI, markdown_table, plt, write_outputs
from ..train import loop
from ..train.config import TrainConfig
from ..train.config import preset as preset_config
from ..train.data import load_corpus, train_batch, validation_batches
from ..train.model import Transformer
from ..train.monitor import probe_tokens
from ..train.optimizers import build_optimizer, param_groups
from ..train.qk_clip import QKClip
from ..train.schedule import lr_multiplier
from .report import command_line
from .stability_measures import (
    ENTROPY_FLOOR,
    LOSS_MARGIN,
    LOSS_WINDOW,
    SPIKE_FACTOR,
    block_linears,
    instability,
    loss_spikes,
    outlier_ratio,
    quantization,
    worst_loss_ratio,
)

# The baseline's ordinary decay: the common AdamW default for language models.
LAMBDA_1 = 0.1
# QK-Clip's threshold: Kimi K2's tau = 100. qk_cap_'s cap on s_max(W_q^h) s_max(W_k^h) is the one whose
# data-free bound is the same tau at unit RMSNorm gains (cap_for). Neither touches a healthy run here: at lr
# 3e-3 the baseline's largest logit stays below 36, its largest product below 3.0 (cap_for: 4.4 on tiny).
QK_CLIP_TAU = 100.0
# Stable is not good: the largest lr whose every seed stays within this of the method's best mean val bpb
# (bits per byte) is reported beside the stable range.
GOOD_MARGIN = 0.1
# The per-step series kept in the JSON: every this many steps, to 4 significant digits (the losses: every
# step, to 1e-5 nats), about 4 kB per run.
SERIES_EVERY = 5
LOSS_DECIMALS = 5
TIMING_REPEATS = 20  # forwards timed with and without the side observation

# The study: 150 steps with 10 warm-up steps (the first look's), three seeds, and lrs by factors of 2 from
# the baseline's best (2e-3 to 4e-3) to 0.128, well above where the first look's baseline collapsed (1e-2),
# where Muon collapses too (seed 0, measured for this experiment).
SETTINGS = dict(steps=150, warmup_steps=10)
LRS = (2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2, 1.28e-1)
SEEDS = (0, 1, 2)
# --quick: a smaller model for a few steps, four methods (QK-Clip, qk_cap_ and cautious decay besides the
# baseline), two lrs, one seed, in seconds; its QK-Clip threshold (and so the cap) is low enough to act
# within those steps.
QUICK_SETTINGS = dict(n_layers=1, d_model=64, n_heads=2, seq_len=32, batch_size=4, steps=12, warmup_steps=2,
                      val_batches=2)
QUICK_LRS, QUICK_SEEDS = (1e-3, 6.4e-2), (0,)
QUICK_METHODS = ("adamw-p1", "adamw-qk-clip", "adamw-qk-cap", "adamw-cautious-p2")
QUICK_TAU = 0.5


@dataclass(frozen=True)
class Method:
    """One arm of the study: the optimizer, its decay's power (matched to ``LAMBDA_1``, see the module
    docstring), whether cautious (AdamW), a top band, ``qk_cap_`` or QK-Clip on top."""

    label: str
    optimizer: str = "adamw"
    p: int = 1
    cautious: bool = False
    band: bool = False
    qk_cap: bool = False
    qk_clip: bool = False


METHODS = {
    "adamw-p1": Method("AdamW, p = 1 (baseline)"),
    "adamw-p2": Method("AdamW, p = 2 (matched)", p=2),
    "adamw-p4": Method("AdamW, p = 4 (matched)", p=4),
    "adamw-band": Method("AdamW, top band: p = 4 above s0", p=4, band=True),
    "adamw-qk-cap": Method("AdamW, p = 1 + qk_cap_", qk_cap=True),
    "adamw-qk-clip": Method("AdamW, p = 1 + QK-Clip", qk_clip=True),
    "adamw-cautious-p1": Method("AdamW, cautious p = 1 (CWD)", cautious=True),
    "adamw-cautious-p2": Method("AdamW, cautious p = 2 (matched)", p=2, cautious=True),
    "muon-p1": Method("Muon, p = 1", optimizer="muon"),
}


def check_available(names) -> None:
    """Refuse, before any run, a method the study does not know."""
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise ValueError(f"unknown stability methods {unknown}; choose from {', '.join(METHODS)}")


# ----- one run

@dataclass(frozen=True)
class Run:
    method: str
    lr: float
    seed: int
    preset: str = "tiny"
    settings: tuple = tuple(SETTINGS.items())
    device: str = "cpu"
    tau: float = QK_CLIP_TAU


def cap_for(tau: float, config: TrainConfig) -> float:
    """The cap on ``s_max(W_q^h) s_max(W_k^h)`` that bounds every logit by ``tau`` where the attention's input
    rows have unit RMS (RMSNorm at unit gains: ``||x|| = sqrt(D)``): SPEC 11's bound
    ``||x_i|| ||x_j|| s_max(W_q^h) s_max(W_k^h) / sqrt(d_h) = D cap / sqrt(d_h)``."""
    return tau * math.sqrt(config.d_model // config.n_heads) / config.d_model


@lru_cache(maxsize=1)
def corpus():
    return load_corpus(None)


def family_spectral_norms(model) -> dict[str, float]:
    """The mean spectral norm of the attention matrices (Q, K, V, O) and of the MLP's (gate, up, down)."""
    return {family: float(np.mean([float(metrics.spectral_norm(linear.weight.detach()))
                                   for name, linear in block_linears(model).items()
                                   if (".attention." in name) == (family == "attention")]))
            for family in ("attention", "mlp")}


def matched_config(config: TrainConfig, method: Method, s0: dict) -> TrainConfig:
    """``config`` with ``method``'s decay: ``LAMBDA_1`` at p = 1, else ``lambda_p = LAMBDA_1 s0^(1 - p)`` per
    family and no ordinary decay."""
    if method.p == 1:
        return dataclasses.replace(config, weight_decay=LAMBDA_1)
    return dataclasses.replace(config, weight_decay=0.0, p=method.p,
                               lambda_attention=LAMBDA_1 * s0["attention"] ** (1 - method.p),
                               lambda_mlp=LAMBDA_1 * s0["mlp"] ** (1 - method.p))


def build(model, config: TrainConfig, method: Method, s0: dict, run: Run):
    """The optimizer of ``method`` (with ``qk_cap_`` attached), and its QK-Clip (or None)."""
    if method.cautious:  # build_optimizer's AdamW, cautious
        optimizer = SpectralAdamW(param_groups(model, config), lr=config.lr, cautious=True)
    else:
        optimizer = build_optimizer(model, config)
    if method.band:
        for group in optimizer.param_groups:
            if group.get("role") in ATTENTION_ROLES + MLP_ROLES:
                tau = s0["attention" if group["role"] in ATTENTION_ROLES else "mlp"]
                group["band"] = {"tau": tau, "mode": "two_band", "p_bot": 1, "spectral_weight_decay_bot": LAMBDA_1}
    if method.qk_cap:
        QKCap(model=model, cap=cap_for(run.tau, config)).attach(optimizer)
    return optimizer, (QKClip(model, run.tau) if method.qk_clip else None)


@torch.no_grad()
def head_spectral_norms(model) -> torch.Tensor:
    """``(layers, 2, heads)``: the spectral norm of each head's query rows and key rows (fp64)."""
    norms = []
    for layer in model.layers:
        attention = layer.attention
        heads = (attention.n_heads, attention.head_dim, -1)
        norms.append(torch.stack([torch.linalg.matrix_norm(linear.weight.detach().double().view(heads), ord=2)
                                  for linear in (attention.q_proj, attention.k_proj)]))
    return torch.stack(norms)


def train_run(run: Run) -> dict:
    """Train one run; return its record (the per-step series and the final measures). The stability guard's
    clamps are counted in the record, not logged."""
    decay_log = logging.getLogger("spectral_ops.decay")
    level = decay_log.level
    decay_log.setLevel(logging.ERROR)
    try:
        return _train_run(run)
    finally:
        decay_log.setLevel(level)


def _train_run(run: Run) -> dict:
    method = METHODS[run.method]
    config = preset_config(run.preset, lr=run.lr, seed=run.seed, device=run.device, optimizer=method.optimizer,
                    **dict(run.settings))
    processes = loop.Processes(loop.pick_device(config.device))
    device, data = processes.device, corpus()
    torch.manual_seed(config.seed)
    model = Transformer(config.model_config(data.vocab_size)).to(device)
    s0 = family_spectral_norms(model)
    config = matched_config(config, method, s0)
    optimizer, qk_clip = build(model, config, method, s0, run)
    attentions = [layer.attention for layer in model.layers]
    for attention in attentions:
        attention.observe_logits = True
    head_dim = attentions[0].head_dim
    losses, series, clipped = [], [], 0
    timing = {"forward_backward": 0.0, "optimizer_step": 0.0, "qk_clip": 0.0}
    started = time.perf_counter()
    for step in range(config.steps):
        multiplier = lr_multiplier(step, config.steps, config.warmup_steps, config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * multiplier
        norms = head_spectral_norms(model)  # of the weights this step's forward uses
        inputs, targets = train_batch(data, step, config.batch_size, config.seq_len, config.seed)
        tick = time.perf_counter()
        with loop.autocast(device):
            logits = model(inputs.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
        loss.backward()
        if config.grad_clip:
            loop.clip_gradients(model.parameters(), config.grad_clip)
        tock = time.perf_counter()
        timing["forward_backward"] += tock - tick
        losses.append(round(loss.item(), LOSS_DECIMALS))  # as the JSON keeps them, for every definition
        observations = [attention.take_observation() for attention in attentions]
        if not math.isfinite(losses[-1]):
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timing["optimizer_step"] += time.perf_counter() - tock
        if qk_clip:
            tick = time.perf_counter()
            factors = qk_clip.step(observations)
            timing["qk_clip"] += time.perf_counter() - tick
            clipped += int((factors < 1).sum())
        max_logits = torch.stack([o.max_logit for o in observations])
        product = norms[:, 0] * norms[:, 1]
        input_norms = torch.stack([o.max_input_norm for o in observations]).double()
        series.append({"max_logit": max_logits.tolist(), "qk_product": product.tolist(),
                       "s_q": norms[:, 0].tolist(), "s_k": norms[:, 1].tolist(),
                       "entropy": torch.stack([o.entropy for o in observations]).tolist(),
                       # SPEC 11's bound on every logit: ||x_i|| ||x_j|| s_max(W_q^h) s_max(W_k^h) / sqrt(d_h)
                       "logit_bound": (product * input_norms[:, None] ** 2 / math.sqrt(head_dim)).tolist()})
    wall = time.perf_counter() - started
    finite = math.isfinite(losses[-1]) and all(torch.isfinite(p).all() for p in model.parameters())
    record = {"method": run.method, "lr": run.lr, "seed": run.seed, "s0": s0, "losses": losses,
              "steps_run": len(losses), "finite": finite, "wall_s": wall, "timing_s": timing,
              "qk_clipped_heads": clipped, "clamped_updates": loop.clamped_updates(optimizer),
              "skipped_updates": loop.skipped_updates(optimizer)}
    record.update(summarised_series(series, len(losses) == config.steps))
    if finite:
        record.update(final_measures(model, config, processes))
    else:
        record.update(val_bpb=math.nan, final_mean_entropy=math.nan)
    record["unstable_because"] = instability(losses, finite, record["final_mean_entropy"])
    record["unstable"] = bool(record["unstable_because"])
    record["diverged"] = record["unstable_because"] == ["diverged"]
    record["spikes"] = loss_spikes(losses)
    record["worst_loss_ratio"] = worst_loss_ratio(losses)
    return record


def final_measures(model, config: TrainConfig, processes: loop.Processes) -> dict:
    """The trained model's attention entropy per head on the validation probe (the first look's measure, the
    mean over layers and heads), validation bits per byte, quantization and activation outliers."""
    data = corpus()
    validation = validation_batches(data, config.val_batches, config.batch_size, config.seq_len)
    probe = probe_tokens(validation).to(processes.device)
    attentions = [layer.attention for layer in model.layers]
    # Observed as a training forward is (the model has no dropout: both modes compute the same); the
    # last training step's observation was taken, and nothing after this one is observed.
    with torch.no_grad():
        model.train()(probe)
    entropy = torch.stack([attention.take_observation().entropy for attention in attentions])
    for attention in attentions:
        attention.observe_logits = False
    _, from_nats = loop.VALIDATION_KEYS[data.unit]
    return {"final_entropy": entropy.tolist(), "final_mean_entropy": float(entropy.mean()),
            "val_bpb": loop.validation_nats(model, validation, processes) * from_nats,
            "quantization": quantization(model, validation, processes, from_nats),
            "outlier_ratio": outlier_ratio(model, probe)}


def summarised_series(series: list[dict], complete: bool) -> dict:
    """Per run: the largest logit, the cap's bound and ``s_max(W_q^h) s_max(W_k^h)`` over training, each
    head's lowest entropy, and the series every ``SERIES_EVERY`` steps, the last step included, of the largest
    logit, the lowest head entropy, the largest product and its factors, and the bound."""
    if not series:
        return {}
    stacked = {key: np.array([entry[key] for entry in series]) for key in series[0]}  # (steps, layers, heads)
    kept = sorted({*range(0, len(series), SERIES_EVERY), len(series) - 1})
    return {"max_logit": float(np.nanmax(stacked["max_logit"])),
            "max_logit_bound": float(np.nanmax(stacked["logit_bound"])),
            "max_qk_product": float(np.nanmax(stacked["qk_product"])),
            "head_min_entropy": np.nanmin(stacked["entropy"], axis=0).tolist(),
            "min_head_entropy": float(np.nanmin(stacked["entropy"])),
            "bound_holds": bool(np.all(stacked["max_logit"] <= stacked["logit_bound"] * (1 + 1e-4))),
            "series": {"step": [k + 1 for k in kept],
                       **{name: [float(f"{value:.4g}") for value in reduce(stacked[key], axis=(1, 2))[kept]]
                          for name, key, reduce in (("max_logit", "max_logit", np.max),
                                                    ("min_entropy", "entropy", np.min),
                                                    ("max_qk_product", "qk_product", np.max),
                                                    ("max_s_q", "s_q", np.max), ("max_s_k", "s_k", np.max),
                                                    ("max_logit_bound", "logit_bound", np.max))}},
            "completed": complete}


def _worker_start() -> None:
    torch.set_num_threads(1)  # one core per run: tiny matrices do not share two threads well


def run_all(runs: list[Run], workers: int) -> list[dict]:
    """Every run, in ``workers`` processes of one thread each (1: here, in this process); each run is
    seeded on its own, so the records do not depend on the workers."""
    if workers <= 1:
        return [train_run(run) for run in progress(runs, desc="stability", unit="run")]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_worker_start) as pool:
        futures = {pool.submit(train_run, run): index for index, run in enumerate(runs)}
        records = [None] * len(runs)
        for future in progress(as_completed(futures), desc="stability", total=len(runs), unit="run"):
            records[futures[future]] = future.result()
    return records


@torch.no_grad()
def observation_cost(config: TrainConfig, device: str) -> dict:
    """Seconds per training forward of the model with and without the side observation (QK-Clip's
    cost where the attention kernel does not report the logits), the mean of ``TIMING_REPEATS``."""
    data = corpus()
    torch.manual_seed(0)
    model = Transformer(config.model_config(data.vocab_size)).to(device)
    inputs, _ = train_batch(data, 0, config.batch_size, config.seq_len, 0)
    inputs = inputs.to(device)
    seconds = {}
    for observed in (False, True, False, True):  # interleaved, the second pair kept: warm
        for layer in model.layers:
            layer.attention.observe_logits = observed
        tick = time.perf_counter()
        for _ in range(TIMING_REPEATS):
            model(inputs)
            for layer in model.layers:
                layer.attention.take_observation()
        seconds["observed" if observed else "plain"] = (time.perf_counter() - tick) / TIMING_REPEATS
    return seconds


# ----- the study and its report

def cells(records: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """The records by (method, lr), each list in seed order."""
    grouped: dict[tuple[str, float], list[dict]] = {}
    for record in sorted(records, key=lambda r: r["seed"]):
        grouped.setdefault((record["method"], record["lr"]), []).append(record)
    return grouped


def largest_stable_lr(grouped, method: str, lrs) -> float | None:
    """The largest lr at which no seed of ``method`` is unstable (None: there is none)."""
    return max((lr for lr in lrs if not any(r["unstable"] for r in grouped[method, lr])), default=None)


def first_unstable_lrs(grouped, method: str, lrs) -> list[float | None]:
    """Per seed, the smallest lr at which ``method`` is unstable (None: at none of the grid's)."""
    seeds = [r["seed"] for r in grouped[method, lrs[0]]]
    return [min((lr for lr in lrs if next(r for r in grouped[method, lr] if r["seed"] == seed)["unstable"]),
                default=None) for seed in seeds]


def spread(values) -> str:
    """``mean [min, max]`` over seeds (a single value alone; n/a where any is missing)."""
    values = [v for v in values if v is not None]
    if not values or not np.all(np.isfinite(values)):
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{np.mean(values):.4g} [{min(values):.4g}, {max(values):.4g}]"


def lr_text(lr) -> str:
    return "none" if lr is None else f"{lr:g}"


def summary(grouped, methods, lrs) -> dict:
    """Per method: the largest stable lr, the first unstable lr per seed, the best mean bits per byte and its lr,
    and the largest lr whose every seed is within ``GOOD_MARGIN`` of that best."""
    result = {}
    for method in methods:
        means = {lr: np.mean([r["val_bpb"] for r in grouped[method, lr]]) for lr in lrs}
        finite = {lr: mean for lr, mean in means.items() if np.isfinite(mean)}
        best_lr = min(finite, key=finite.get) if finite else None
        good = [lr for lr in lrs if finite and all(r["val_bpb"] <= finite[best_lr] + GOOD_MARGIN
                                                   for r in grouped[method, lr])]
        result[method] = {"largest_stable_lr": largest_stable_lr(grouped, method, lrs),
                          "largest_good_lr": max(good, default=None),
                          "first_unstable_lr_per_seed": first_unstable_lrs(grouped, method, lrs),
                          "best_lr": best_lr, "best_val_bpb": finite.get(best_lr, math.nan),
                          "best_val_bpb_per_seed": [r["val_bpb"] for r in grouped[method, best_lr]] if finite else []}
    return result


def common_stable_lr(grouped, methods, lrs) -> float | None:
    """The largest lr at which no seed of any method is unstable."""
    return max((lr for lr in lrs if not any(r["unstable"] for m in methods for r in grouped[m, lr])), default=None)


def tables(grouped, methods, lrs, summaries, common) -> dict[str, str]:
    labels = {method: METHODS[method].label for method in methods}
    stable = markdown_table(
        ["method", "largest stable lr", "first unstable lr, per seed", "best val bpb [seeds]", "at lr",
         f"largest lr within {GOOD_MARGIN:g} bpb of the best"],
        [[labels[m], lr_text(s["largest_stable_lr"]), ", ".join(map(lr_text, s["first_unstable_lr_per_seed"])),
          spread(s["best_val_bpb_per_seed"]), lr_text(s["best_lr"]), lr_text(s["largest_good_lr"])]
         for m, s in summaries.items()])

    def cell(method, lr):
        runs = grouped[method, lr]
        unstable = sum(r["unstable"] for r in runs)
        return f"{spread([r['val_bpb'] for r in runs]).split(' ')[0]} ({unstable}/{len(runs)})"

    grid = markdown_table(["method", *[f"lr {lr:g}" for lr in lrs]],
                          [[labels[m], *[cell(m, lr) for lr in lrs]] for m in methods])
    at_common = "No lr of the grid is stable for every method." if common is None else markdown_table(
        ["method", "val bpb", "spikes", "worst loss / lowest so far", "max logit", "its bound (SPEC 11)",
         "max s_q s_k", "min head entropy", "final entropy"],
        [[labels[m], *[spread([r.get(key, math.nan) for r in grouped[m, common]]) for key in
                       ("val_bpb", "spikes", "worst_loss_ratio", "max_logit", "max_logit_bound", "max_qk_product",
                        "min_head_entropy", "final_mean_entropy")]] for m in methods])

    def quantized_at(method, lr, bits, key):
        return [r["quantization"][f"int{bits}"][key] if "quantization" in r else math.nan for r in grouped[method, lr]]

    quant_rows = []
    for m in methods:
        lr = common if common is not None else summaries[m]["best_lr"]
        if lr is None:
            continue
        quant_rows.append([labels[m], f"{lr:g}", spread([r["val_bpb"] for r in grouped[m, lr]]),
                           spread(quantized_at(m, lr, 8, "mean_error")), spread(quantized_at(m, lr, 4, "mean_error")),
                           spread(quantized_at(m, lr, 8, "val_bpb")), spread(quantized_at(m, lr, 4, "val_bpb")),
                           spread([r["outlier_ratio"]["max"] if "outlier_ratio" in r else math.nan
                                   for r in grouped[m, lr]])])
    quant = markdown_table(["method", "lr", "val bpb", "int8 error", "int4 error", "int8 bpb", "int4 bpb",
                            "outlier ratio (max over linears)"], quant_rows)

    def per_step_ms(runs, key):
        return 1e3 * np.mean([r["timing_s"][key] / r["steps_run"] for r in runs])

    baseline = [r for lr in lrs for r in grouped.get(("adamw-p1", lr), [])]
    cost_rows = []
    for m in methods:
        runs = [r for lr in lrs for r in grouped[m, lr]]
        extra = per_step_ms(runs, "optimizer_step") + per_step_ms(runs, "qk_clip")
        cost_rows.append([labels[m], per_step_ms(runs, "forward_backward"), per_step_ms(runs, "optimizer_step"),
                          per_step_ms(runs, "qk_clip"),
                          extra - per_step_ms(baseline, "optimizer_step") if baseline else "n/a",
                          np.mean([r["wall_s"] for r in runs]), sum(r["clamped_updates"] for r in runs),
                          sum(r["qk_clipped_heads"] for r in runs)])
    cost = markdown_table(["method", "forward + backward (ms/step)", "optimizer step (ms/step)", "QK-Clip (ms/step)",
                           "extra over the baseline's step (ms/step)", "run (s)", "stability clamps (all runs)",
                           "QK-Clip head clips (all runs)"], cost_rows)
    return {"stable": stable, "grid": grid, "at_common": at_common, "quantization": quant, "cost": cost}


def _mean_series(runs, key):
    """The seeds' mean of a per-step series (over the steps every seed ran)."""
    series = [r["series"][key] for r in runs if "series" in r]
    if not series:
        return [], []
    length = min(map(len, series))
    steps = next(r["series"]["step"] for r in runs if "series" in r)[:length]
    return steps, np.mean([s[:length] for s in series], axis=0)


def draw(axis, question: str, grouped, methods, lrs, lr=None, tau=None) -> None:
    """One panel: ``"bpb"``, ``"entropy"`` or ``"int4"`` (the int4 model's bits per byte over the model's)
    against the lr (mean over seeds, the bar their range; an open marker where a seed is unstable), or
    ``"max_logit"`` (with QK-Clip's ``tau``) or ``"max_qk_product"`` against the step at ``lr``."""
    for index, method in enumerate(methods):
        style = dict(color=f"C{index % 10}", label=METHODS[method].label)
        if question in ("bpb", "entropy", "int4"):
            def value(r):
                if question == "int4":
                    return r["quantization"]["int4"]["val_bpb"] - r["val_bpb"] if "quantization" in r else math.nan
                return r["val_bpb" if question == "bpb" else "final_mean_entropy"]
            values = np.array([[value(r) for r in grouped[method, x]] for x in lrs])
            mean = values.mean(axis=1)
            axis.errorbar(lrs, mean, yerr=[mean - values.min(axis=1), values.max(axis=1) - mean], marker="o",
                          capsize=2, ms=4, **style)
            unstable = [x for x in lrs if any(r["unstable"] for r in grouped[method, x])]
            axis.plot(unstable, [mean[lrs.index(x)] for x in unstable], "o", mfc="white", color=style["color"], ms=7)
            axis.set_xscale("log")
        else:
            steps, mean = _mean_series(grouped[method, lr], question)
            axis.semilogy(steps, mean, **style)
    if question == "entropy":
        axis.axhline(ENTROPY_FLOOR, ls=":", color="gray", label=f"collapse threshold {ENTROPY_FLOOR:g}")
    if question == "max_logit" and tau is not None:
        axis.axhline(tau, ls=":", color="gray", label=f"QK-Clip's tau {tau:g}")
    labels = {"bpb": ("final val bits/byte", "final val bpb (open: a seed unstable)"),
              "entropy": ("final attention entropy (probe, mean)", "attention entropy"),
              "int4": ("int4 val bpb - val bpb", "int4 round-to-nearest per channel: the cost"),
              "max_logit": ("max attention logit (seeds' mean)", "max logit"),
              "max_qk_product": ("max_h s_max(W_q^h) s_max(W_k^h)", "QK factors")}
    ylabel, title = labels[question]
    axis.set(xlabel="step" if lr else "lr", ylabel=ylabel, title=f"{title} at lr {lr:g}" if lr else title)
    axis.legend(fontsize=6)


# One figure per question, by its file's suffix: the stable range (stability.png), the logits and their
# factors over training, the cost of int4 weights.
FIGURES = {"": (("bpb", "lr"), ("entropy", "lr")),
           "-max-logit": (("max_logit", "common"), ("max_logit", "largest"), ("max_qk_product", "largest")),
           "-quantized": (("int4", "lr"),)}


def figures(grouped, methods, lrs, common, tau) -> dict:
    """The figure of each question in :data:`FIGURES`: the step series at the largest lr every method survives
    (else the smallest) and at the grid's largest."""
    at = {"lr": None, "common": common if common is not None else lrs[0], "largest": lrs[-1]}
    drawn = {}
    for suffix, panels in FIGURES.items():
        figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
        for axis, (question, where) in zip(axes.flat, panels):
            draw(axis, question, grouped, methods, lrs, at[where], tau)
        figure.tight_layout()
        drawn[suffix] = figure
    return drawn


def run(out_dir, quick: bool = False, preset: str = "tiny", device: str = "cpu", workers: int = 1,
        methods=None) -> str:
    methods = tuple(methods or (QUICK_METHODS if quick else METHODS))
    check_available(methods)
    settings, lrs, seeds = (QUICK_SETTINGS, QUICK_LRS, QUICK_SEEDS) if quick else (SETTINGS, LRS, SEEDS)
    tau = QUICK_TAU if quick else QK_CLIP_TAU
    runs = [Run(method, lr, seed, preset, tuple(settings.items()), device, tau)
            for method in methods for lr in lrs for seed in seeds]
    started = time.perf_counter()
    records = run_all(runs, workers)
    wall = time.perf_counter() - started
    config = preset_config(preset, device=device, **settings)
    observation = observation_cost(config, device)
    grouped = cells(records)
    summaries = summary(grouped, methods, lrs)
    common = common_stable_lr(grouped, methods, lrs)
    text = tables(grouped, methods, lrs, summaries, common)
    options = dict(preset=None if preset == "tiny" else preset, device=None if device == "cpu" else device,
                   workers=None if workers == 1 else workers,
                   methods=None if methods == tuple(QUICK_METHODS if quick else METHODS) else ",".join(methods))
    command = command_line("stability", out_dir, quick, **options)
    model_line = (f"{config.n_layers} layers, width {config.d_model}, {config.n_heads} heads of "
                  f"{config.d_model // config.n_heads}, sequences of {config.seq_len}, batches of {config.batch_size}")
    cap = cap_for(tau, config)
    markdown = f"""# Stability: does spectral shaping widen the stable lr range?

`{command}`

The `{preset}` preset ({model_line}) for {settings['steps']} steps ({settings['warmup_steps']} warm-up, then
cosine to {config.min_lr_ratio:g}x, gradient clipping at {config.grad_clip:g}), seeds
{', '.join(map(str, seeds))}, at lr {', '.join(f'{lr:g}' for lr in lrs)}.

**Methods.** The baseline decays every block matrix by lambda_1 = {LAMBDA_1:g} (lr-coupled, torch's AdamW).
p = 2 and p = 4 use lambda_p = lambda_1 s0^(1 - p) and no ordinary decay: the same decay of the top mode at
s0, the initial weights' mean spectral norm per family (attention, MLP). The top band is p = 4 above s0 and
the baseline below. QK-Clip (Kimi K2): tau = {tau:g} on the observed logits, after the 1/sqrt(d_h) scale.
qk_cap_: a cap of {cap:.4g} on s_max(W_q^h) s_max(W_k^h), whose bound on every logit is tau at unit RMSNorm
gains. Cautious decay applies each decay only where it agrees in sign with the update.

**Definitions.** *Unstable*: diverged (a non-finite loss or weight, or a final loss above the first), or a
final mean attention entropy on the validation probe below {ENTROPY_FLOOR:g}, or a final loss more than
{LOSS_MARGIN:.0%} above the run's own best (both smoothed over {LOSS_WINDOW} steps). The entropy threshold comes
from the first look of #54: 0.065 at lr 1e-2, 0.4 bits per byte worse than the same run at 3e-3, whose 0.28
was within 0.02 bits of the best. Below 0.1 a query spreads over about 64^0.1 = 1.5 keys of a typical 64. A
*spike* is a step
whose training loss exceeds {SPIKE_FACTOR:g}x the lowest loss before it (consecutive ones count once).
Spreads are the mean [min, max] over seeds.

## Stable lr range

{text['stable']}

Final val bpb by lr (mean over seeds; in brackets the seeds that were unstable):

{text['grid']}

## At the largest lr every method is stable ({lr_text(common)})

{text['at_common']}

## Quantization

Round-to-nearest per output channel of every block matrix, at that lr (else at each method's best lr); the
outlier ratio is max|a| / rms(a) of each block linear's input on the probe.

{text['quantization']}

## Cost

{text['cost']}

The side observation of the logits and entropies runs in every method's training forward here; it is QK-Clip's
own cost where the attention kernel does not report them: {1e3 * observation['plain']:.3g} ms per forward
without it, {1e3 * observation['observed']:.3g} ms with it. {len(runs)} runs took {wall:.0f} s ({wall / 60:.1f} min) in
{workers} worker process{'es' if workers > 1 else ''} of one thread each.

The same study on the `small` preset or a GPU:
`{command_line('stability', out_dir, False, preset='small', device='cuda')}`
"""
    data = {"protocol": {"preset": preset, "settings": settings, "lrs": list(lrs), "seeds": list(seeds),
                         "methods": {m: dataclasses.asdict(METHODS[m]) for m in methods}, "lambda_1": LAMBDA_1,
                         "qk_clip_tau": tau, "qk_cap": cap, "entropy_floor": ENTROPY_FLOOR,
                         "loss_margin": LOSS_MARGIN, "loss_window": LOSS_WINDOW, "spike_factor": SPIKE_FACTOR,
                         "device": device, "workers": workers},
            "summary": summaries, "largest_common_stable_lr": common, "observation_cost_s": observation,
            "wall_s": wall, "runs": records}
    drawn = figures(grouped, methods, lrs, common, tau)
    write_outputs(out_dir, "stability", markdown, data, drawn.pop(""))
    for suffix, figure in drawn.items():
        figure.savefig(Path(out_dir) / f"stability{suffix}.png", dpi=FIGURE_DPI, bbox_inches="tight")
        plt.close(figure)
    return markdown
