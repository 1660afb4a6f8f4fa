"""``python bench/monitoring_figure.py --out docs/results/monitoring [--steps 200] [--every 5] [--seed 0]``

The figure of docs/monitoring.md, from a real run: the plain-loop recipe's loop (SpectralAdamW with the
``S_2`` decay on every matrix, a ``SpectralMonitor`` with its defaults, a ``MetricsWriter``) on the reference
Transformer at the ``tiny`` preset's size, trained on the standard-library corpus at the preset's lr
(constant), then ``python -m spectral_ops.monitor plot`` on its event file. Two more monitors of the same
weights at the same steps, one with ``exact=True`` (FP64 SVD) and one with ``tolerance=0`` (two warm
iterations per call and no more rounds), give the accuracy of ``s_max`` along the run and what the rounds
until it settles buy (``accuracy.md``). Writes into ``--out``: the event file, ``metrics.csv``,
``monitoring.png`` and ``accuracy.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from spectral_ops.monitor import MetricsWriter, SpectralMonitor
from spectral_ops.monitor.__main__ import main as monitor_command
from spectral_ops.optim import SpectralAdamW
from spectral_ops.provenance import machine_line
from spectral_ops.train.config import PRESETS
from spectral_ops.train.data import load_corpus, train_batch
from spectral_ops.train.model import ModelConfig, Transformer

TINY = PRESETS["tiny"]
P, SPECTRAL_WEIGHT_DECAY = 2, 0.1  # the recipe's


def record(out: Path, steps: int, every: int, seed: int) -> dict[int, dict[str, float]]:
    """The run: its event file and metrics.csv in ``out``. Returns, per log step, the largest relative error
    of ``s_max`` over the matrices against the FP64 SVD, with the default iterations and with more."""
    corpus = load_corpus()
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=corpus.vocab_size, n_layers=TINY["n_layers"], d_model=TINY["d_model"],
                                    n_heads=TINY["n_heads"], max_seq_len=TINY["seq_len"]))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    optimizer = SpectralAdamW([{"params": matrices, "p": P, "spectral_weight_decay": SPECTRAL_WEIGHT_DECAY},
                               {"params": others}], lr=TINY["lr"], weight_decay=0.0)
    monitor = SpectralMonitor(model, optimizer, every=every)
    # They only read the weights, so the logged monitor sees the same run; their s_max are compared.
    exact, fixed = SpectralMonitor(model, exact=True), SpectralMonitor(model, tolerance=0)
    errors = {}

    def log(step, metrics):
        writer.write(step, metrics)
        truth, two = exact.compute(), fixed.compute()
        # Signed: (estimate - truth) / truth, negative below the SVD's value.
        errors[step] = {label: [values[name] / truth[name] - 1 for name in truth if ".s_max/" in name]
                        for label, values in (("default", metrics), ("fixed", two))}

    with MetricsWriter(out) as writer:
        log(0, monitor.compute())
        for step in range(1, steps + 1):
            inputs, targets = train_batch(corpus, step, TINY["batch_size"], TINY["seq_len"], seed)
            loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            metrics = monitor.metrics_at(step)
            if metrics is not None:
                log(step, metrics)
                print(f"step {step}: loss {loss.item():.3f}, s_max error {min(errors[step]['default']):.2e}")
    monitor.close()
    return errors


def accuracy_report(errors: dict[int, dict[str, list[float]]], steps: int, command: str) -> str:
    """The largest error of s_max over the matrices, at each log step of the first 20, then over spans."""
    logged = sorted(errors)
    bounds = [20, steps // 4, steps // 2, steps]
    spans = [[step] for step in logged if step <= bounds[0]]
    spans += [part for low, high in zip(bounds, bounds[1:]) if (part := [s for s in logged if low < s <= high])]

    def worst(span, label):
        return max(-min(errors[s][label]) for s in span)

    rows = [f"| {span[0]}{'' if len(span) == 1 else f'-{span[-1]}'} | {worst(span, 'default'):.2e} | "
            f"{worst(span, 'fixed'):.2e} |" for span in spans]
    above = max(error for step in logged for label in ("default", "fixed") for error in errors[step][label])
    return "\n".join([
        "# Accuracy of the monitor's s_max along a run",
        "",
        f"`{command}`: the largest relative error of `s_max` over the run's matrices against their FP64 SVD "
        f"(`exact=True`), at each log step, below the SVD's value: with the defaults (30 iterations at the first "
        f"call, then rounds of 2 from the last call's vectors until no estimate rises by more than 1e-5 in one, "
        f"at most 100) and with `tolerance=0` (2 warm iterations per call, no more). The largest estimate above it, "
        f"at any step: {above:.1e} (fp32 rounding: the estimate is a lower bound).",
        "",
        "| steps | defaults | tolerance=0 (2 per call) |",
        "|---|---|---|",
        *rows,
        "",
        f"Computed on {machine_line()}.",
        "",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", required=True, type=Path, help="the folder to write into (must hold no run yet)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--every", type=int, default=5, help="log every this many steps (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="the model's and the batches' seed (default 0)")
    args = parser.parse_args(argv)
    if any(args.out.glob("events.out.tfevents.*")):
        parser.error(f"{args.out} holds a run already: the figure would show both")
    errors = record(args.out, args.steps, args.every, args.seed)
    command = f"python bench/monitoring_figure.py --out {args.out} --steps {args.steps} --every {args.every} " \
              f"--seed {args.seed}"
    (args.out / "accuracy.md").write_text(accuracy_report(errors, args.steps, command))
    monitor_command(["plot", str(args.out), "--out", str(args.out / "monitoring.png")])


if __name__ == "__main__":
    main()
