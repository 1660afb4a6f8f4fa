"""SPEC 4 width transfer: top singular values of AdamW-trained weights across widths, with and without the rule.

The package's reference Transformer (``spectral_ops.train``) trains at several widths ``d`` from the
same base hyperparameters. *Fixed* keeps them at every width; *rule* applies
:func:`spectral_ops.optim.width_transfer` (matrix lr ``~ 1/d``, decay ``~ sqrt(d)``, vector-like
parameters at the base lr without decay). SPEC 4's steady state ``s_1 ~ sqrt(eta/lambda) d^0.75`` says
the rule holds ``s_1`` across widths and the fixed arm does not. A third arm checks the rule's ``lambda_p``
heuristic on ``p = 3`` spectral decay (no ordinary decay), where the balance is
``s*^(p+1) ~ (eta/lambda_p) d^1.5``. (Odd ``p``: ``S_3(W) = W W^T W`` needs no polar factor, which keeps
the widest runs within a CPU budget; ``p = 2`` would spend most of their time in the polar iteration.)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.ticker import FormatStrFormatter

from ..analysis import spectral_balance_scale
from ..metrics import spectral_norm
from ..optim import SpectralAdamW, width_transfer
from ..optim.groups import MLP_ROLES
from ..progress import progress
from ..reporting import markdown_table, plt, write_outputs
from ..train.config import TrainConfig
from ..train.data import load_corpus, train_batch
from ..train.model import Transformer
from ..train.optimizers import param_groups
from ..train.schedule import lr_multiplier
from .report import command_line

WIDTHS, QUICK_WIDTHS = (32, 64, 128, 256), (16, 32, 64)
HEAD_DIM = 16  # heads = d / 16: attention scales with the width like the rest
MLP_RATIO = 3  # hidden = 3d at every width (SwiGLU's default rounding would change the aspect with d)
# Base hyperparameters, at the smallest width. A large decay, so that even the widest rule run
# (per-step shrink lr lambda (base/d)^1/2) passes several decay times within the run.
BASE_LR, BASE_WEIGHT_DECAY = 4e-3, 8.0
# p = 3: at the s ~ 0.5-1 the p = 1 runs reach, the per-mode coefficient lambda_3 s^2 is 4-16, around
# lambda_1 = 8; the stability guard (raise) needs p lr lambda_3 s_1^2 < 1 at the base width: s_1 < 2.3.
SPECTRAL_P, BASE_LAMBDA_P = 3, 16.0
# (arm, p, rule applied)
ARMS = (("fixed", 1, False), ("rule", 1, True), (f"rule, p = {SPECTRAL_P}", SPECTRAL_P, True))
SETTINGS = dict(n_layers=2, seq_len=32, batch_size=8, steps=300, warmup_steps=20)
QUICK_SETTINGS = dict(n_layers=1, seq_len=16, batch_size=4, steps=30, warmup_steps=3)
SEED = 0
LOSS_WINDOW = 20  # final training loss: the mean over this many last steps
# sigma_1 fluctuates around its steady state (at the base width the decay time is ~30 steps): it is
# averaged over this many evenly spaced samples in the last third of the run, the last at the end.
SIGMA_SAMPLES = 5


def balance_scale(lr: float, coefficient: float, p: int, width: int) -> float:
    """SPEC 4's steady-state ``s_1`` up to a constant: ``(lr / lambda_p d^1.5)^(1/(p+1))``, which for
    ``p = 1`` is ``sqrt(lr / lambda) d^0.75`` (``analysis.adamw_top_singular_value_scale``)."""
    return spectral_balance_scale(lr * width**1.5, coefficient, p)


def run_config(width: int, p: int, settings: dict) -> TrainConfig:
    """The reference model and data at ``width`` with the base hyperparameters, decoupled convention,
    constant lr after the warm-up (steady states are for a constant lr), no gradient clipping."""
    decay = dict(weight_decay=BASE_WEIGHT_DECAY) if p == 1 else dict(p=p, spectral_weight_decay=BASE_LAMBDA_P)
    return TrainConfig(d_model=width, n_heads=width // HEAD_DIM, mlp_hidden=MLP_RATIO * width, lr=BASE_LR,
                       min_lr_ratio=1.0, grad_clip=0.0, convention="decoupled", stability="raise", seed=SEED,
                       **decay, **settings)


def train_width(corpus, config: TrainConfig, base_width: int, rule: bool) -> dict:
    """Train one width; return the MLP matrices' mean top singular value (over the matrices and the last
    third of the run), the MLP group's hyperparameters and the final loss."""
    torch.manual_seed(config.seed)
    model = Transformer(config.model_config())
    groups = param_groups(model, config)
    if rule:
        groups = width_transfer(groups, base_width, config.d_model)
    optimizer = SpectralAdamW(groups, lr=config.lr)
    mlp = [param for group in optimizer.param_groups if group["role"] in MLP_ROLES for param in group["params"]]
    interval = config.steps // (3 * SIGMA_SAMPLES)
    losses, samples, sample_steps = [], [], []
    for step in range(config.steps):
        multiplier = lr_multiplier(step, config.steps, config.warmup_steps, config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * multiplier
        inputs, targets = train_batch(corpus, step, config.batch_size, config.seq_len, config.seed)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        remaining = config.steps - step - 1
        if remaining % interval == 0 and remaining < SIGMA_SAMPLES * interval:
            samples.append([float(spectral_norm(param.detach())) for param in mlp])
            sample_steps.append(step + 1)
    group = next(group for group in optimizer.param_groups if group["role"] in MLP_ROLES)
    coefficient = group["weight_decay"] if config.p == 1 else group["spectral_weight_decay"]
    return {"width": config.d_model, "p": config.p, "lr": group["peak_lr"], "coefficient": coefficient,
            "predicted_scale": balance_scale(group["peak_lr"], coefficient, config.p, config.d_model),
            "sigma_1": float(np.mean(samples)), "sigma_1_samples": samples,
            "sample_steps": sample_steps,
            "final_loss": float(np.mean(losses[-LOSS_WINDOW:]))}


def width_slope(records: list[dict]) -> float:
    """Least-squares slope of ``log sigma_1`` against ``log d``: 0 when ``sigma_1`` transfers."""
    return float(np.polyfit(np.log([r["width"] for r in records]), np.log([r["sigma_1"] for r in records]), 1)[0])


def run(out_dir, quick: bool = False) -> str:
    widths, settings = (QUICK_WIDTHS, QUICK_SETTINGS) if quick else (WIDTHS, SETTINGS)
    base_width = widths[0]
    corpus = load_corpus(None)
    cases = [(arm, p, rule, width) for arm, p, rule in ARMS for width in widths]
    by_arm: dict[str, list[dict]] = {arm: [] for arm, _, _ in ARMS}
    rule_of = {arm: rule for arm, _, rule in ARMS}
    for arm, p, rule, width in progress(cases, desc="width-transfer", unit="run"):
        by_arm[arm].append(train_width(corpus, run_config(width, p, settings), base_width, rule))

    rows = [[arm, r["width"], r["lr"], r["coefficient"], r["predicted_scale"], r["sigma_1"],
             r["sigma_1"] / records[0]["sigma_1"], r["final_loss"]]
            for arm, records in by_arm.items() for r in records]
    table = markdown_table(["arm", "d", "matrix lr", "lambda_1 or lambda_p", "predicted scale", "sigma_1 (MLP)",
                            "sigma_1 / smallest d", "final train loss"], rows)
    summary = {arm: {"slope": width_slope(records), "spread": records[-1]["sigma_1"] / records[0]["sigma_1"],
                     "predicted_slope": 0.0 if rule_of[arm] else 0.75}
               for arm, records in by_arm.items()}
    summary_rows = [[arm, s["predicted_slope"], s["slope"], s["spread"]] for arm, s in summary.items()]
    summary_table = markdown_table(["arm", "predicted slope", "measured slope", f"sigma_1({widths[-1]}) / "
                                    f"sigma_1({widths[0]})"], summary_rows)
    fixed, rule, spectral = summary["fixed"], summary["rule"], summary[ARMS[2][0]]
    widths_text = ", ".join(map(str, widths))
    after_base = {arm: records[-1]["sigma_1"] / records[1]["sigma_1"] for arm, records in by_arm.items()}
    markdown = f"""# Width transfer under AdamW (SPEC 4)

`{command_line("width-transfer", out_dir, quick)}`

The package's reference Transformer ({settings['n_layers']} layers, head size {HEAD_DIM}, SwiGLU hidden
{MLP_RATIO}d, bytes of the Python standard library) trained by `SpectralAdamW` at d = {widths_text}:
{settings['steps']} steps of {settings['batch_size']} x {settings['seq_len']} tokens, lr warm-up over
{settings['warmup_steps']} steps then constant, no clipping, decoupled convention, seed {SEED}.
Base hyperparameters at d = {base_width}: lr {BASE_LR:g}, lambda_1 = {BASE_WEIGHT_DECAY:g} (per-step
shrink {BASE_LR * BASE_WEIGHT_DECAY:g}), or for p = {SPECTRAL_P} no ordinary decay and
lambda_{SPECTRAL_P} = {BASE_LAMBDA_P:g}. *fixed* keeps them at every width; *rule* applies
`width_transfer(groups, {base_width}, d)`: matrix lr x {base_width}/d, decay coefficients x
sqrt(d/{base_width}) (lambda_{SPECTRAL_P} too), vector-like parameters at the base lr without decay.
sigma_1 is the top singular value averaged over the MLP matrices (gate, up, down of every layer)
and over {SIGMA_SAMPLES} samples evenly spaced in the last third of training. The predicted scale
is SPEC 4's steady state up to a constant: sqrt(eta/lambda) d^0.75 for p = 1, and
(eta/lambda_p d^1.5)^(1/(p+1)) for p = {SPECTRAL_P}.

{table}

Slope of log sigma_1 against log d (SPEC 4 predicts 0 under the rule, 0.75 for p = 1 without it):

{summary_table}

Without the rule sigma_1 grows {fixed['spread']:.3g}x from d = {widths[0]} to {widths[-1]} (slope
{fixed['slope']:.2f}); with it {rule['spread']:.3g}x (slope {rule['slope']:.2f}); from d = {widths[1]} to
{widths[-1]}, {after_base['fixed']:.3g}x and {after_base['rule']:.3g}x. The p = {SPECTRAL_P} arm, whose
lambda_{SPECTRAL_P} follows the same sqrt(d) as lambda_1, changes {spectral['spread']:.3g}x (slope
{spectral['slope']:.2f}). At d = {widths[-1]} the final training loss is
{by_arm['fixed'][-1]['final_loss']:.3f} nats/byte without the rule and {by_arm['rule'][-1]['final_loss']:.3f}
with it.

The figure plots sigma_1 against the predicted scale, with the line sigma_1 proportional to it
through the d = {widths[0]} point: the rule's points sit at one predicted scale, and collapse onto
one sigma_1 to the extent that the slope above is 0.
"""
    figure, (ax_collapse, ax_width, ax_loss) = plt.subplots(1, 3, figsize=(14, 4))
    fixed_records = by_arm["fixed"]
    scales = np.geomspace(min(r["predicted_scale"] for r in fixed_records),
                          max(r["predicted_scale"] for r in fixed_records))
    ax_collapse.loglog(scales, scales * fixed_records[0]["sigma_1"] / fixed_records[0]["predicted_scale"], "k:",
                       lw=1, label="sigma_1 proportional to the scale")
    for i, (arm, records) in enumerate(by_arm.items()):
        style = dict(color=f"C{i}", marker="o", label=arm)
        x, sigma = [r["predicted_scale"] for r in records], [r["sigma_1"] for r in records]
        ax_collapse.loglog(x, sigma, ls="none", **style)
        for r in records:
            ax_collapse.annotate(str(r["width"]), (r["predicted_scale"], r["sigma_1"]), fontsize=7,
                                 xytext=(3, 3), textcoords="offset points")
        ax_width.loglog(widths, sigma, **style)
        ax_loss.semilogx(widths, [r["final_loss"] for r in records], **style)
    ax_collapse.set(xlabel="predicted scale (eta/lambda_p d^1.5)^(1/(p+1)); p=1: sqrt(eta/lambda) d^0.75",
                    ylabel="sigma_1, mean over MLP matrices", title="sigma_1 against the SPEC 4 steady state")
    ax_width.set(xlabel="width d", ylabel="sigma_1, mean over MLP matrices", title="sigma_1 across widths")
    ax_loss.set(xlabel="width d", ylabel=f"train loss (nats/byte, last {LOSS_WINDOW} steps)", title="training loss")
    for axis in (ax_collapse, ax_width, ax_loss):
        axis.legend(fontsize=7)
        for ticks in (axis.xaxis, axis.yaxis):  # plain numbers rather than 3 x 10^-1 on short log axes
            ticks.set_major_formatter(FormatStrFormatter("%g"))
            ticks.set_minor_formatter(FormatStrFormatter("%g"))
    ax_collapse.tick_params(axis="x", which="both", labelsize=7)
    for axis in (ax_width, ax_loss):
        axis.set_xticks(widths, [str(width) for width in widths])
        axis.xaxis.set_minor_formatter(FormatStrFormatter(""))
    figure.tight_layout()
    data = {"protocol": {"widths": list(widths), "base_width": base_width, "head_dim": HEAD_DIM,
                         "mlp_ratio": MLP_RATIO, "base_lr": BASE_LR, "base_weight_decay": BASE_WEIGHT_DECAY,
                         "spectral_p": SPECTRAL_P, "base_lambda_p": BASE_LAMBDA_P, "sigma_samples": SIGMA_SAMPLES,
                         "seed": SEED, "convention": "decoupled", **settings},
            "runs": by_arm, "summary": summary}
    write_outputs(out_dir, "width-transfer", markdown, data, figure)
    return markdown
