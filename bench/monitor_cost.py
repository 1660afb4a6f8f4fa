"""``python bench/monitor_cost.py [--presets tiny small] [--threads 1 2] [--every 50] [--rounds 3] [--out-md FILE]``

What :class:`spectral_ops.monitor.SpectralMonitor` costs against the training it watches (issue #55: goal
at most 2% of the training time when it runs every 50 steps), on the reference loop's ``tiny`` and
``small`` presets, on a CPU.

The training step is the reference loop's (``spectral_ops/train/loop.py``): the preset's model and
optimizer as ``build_optimizer`` makes them (its default: ``SpectralAdamW`` at ``p = 1`` without decay
unless the preset sets one), a forward pass on one batch of the preset's shape, the cross-entropy loss, the
backward pass, the loss read on the host, the gradient clipping of ``grad_clip``, the optimizer step and
``zero_grad``. The tokens are random (a corpus changes no cost). The monitor watches that model and
optimizer with its defaults (every matrix, the attention pairs' logit bound, the decay counts).

Timing: ``--warmup`` training steps first (the optimizer state, the allocator), then ``--rounds`` rounds in
which each of these runs, in the same order (interleaved: a slow spell of a shared machine hits each
alike): ``every`` training steps, each timed; ``compute()`` of the run's monitor, warm (after its first call,
which runs before the rounds), so ``every`` steps after its last call, as a run monitoring every ``every``
steps calls it (the weights move between two calls, and the rounds until the estimates settle follow
them); the first ``compute()`` of a new monitor on the same model (``first_iterations`` from its seeded
start, then its rounds; the monitor is closed after it); and ``compute()`` of an ``exact=True`` monitor,
which takes each ``s_max`` from an FP64 SVD, the cost the power iteration saves. Each time is the median of
its rounds (of all steps, for the step), and the cost of monitoring is ``compute / (every * step)``.

FLOPs, the same on every machine: one training step and one call of the monitor, warm and first, counted
by ``torch.utils.flop_counter.FlopCounterMode`` (products only: the elementwise work of the optimizer, the
norms and the Rayleigh quotients are not counted; the CPU's fused attention, which torch's counter does not
know, is counted with torch's own formulas for the fused attention kernels, the masked half of the causal
scores included, as torch counts them on a GPU).
"""

from __future__ import annotations

import argparse
import inspect
import json
import shlex
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from spectral_ops.monitor import SpectralMonitor
from spectral_ops.provenance import machine, machine_line
from spectral_ops.train.config import PRESETS, TrainConfig, preset
from spectral_ops.train.loop import clip_gradients
from spectral_ops.train.model import Transformer
from spectral_ops.train.optimizers import build_optimizer

GOAL = 0.02  # issue #55: monitoring every 50 steps costs at most 2% of the training time
# The fused attention a CPU runs under F.scaled_dot_product_attention, counted as torch counts the GPU's
# (FlopCounterMode hands each formula the shapes of the op's tensor arguments).
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda query, key, value, *args, out_shape=None, **kwargs: sdpa_flop_count(query, key, value),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad_out, query, key, value, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(
            grad_out, query, key, value),
}


class Run:
    """A preset's model, optimizer and one batch, and the run's monitor (built after the optimizer: it
    registers step hooks on it)."""

    def __init__(self, config: TrainConfig, seed: int = 0):
        self.config = config
        torch.manual_seed(seed)
        self.model = Transformer(config.model_config())
        self.optimizer = build_optimizer(self.model, config)
        tokens = torch.randint(0, self.model.config.vocab_size, (config.batch_size, config.seq_len + 1),
                               generator=torch.Generator().manual_seed(seed))
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.monitor = SpectralMonitor(self.model, self.optimizer)

    def step(self) -> None:
        """One training step of the reference loop (module docstring)."""
        logits = self.model(self.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), self.targets.flatten())
        loss.backward()
        loss.item()
        if self.config.grad_clip:
            clip_gradients(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def first_call(self) -> None:
        """The first ``compute()`` of a new monitor of the same model and optimizer."""
        monitor = SpectralMonitor(self.model, self.optimizer)
        try:
            monitor.compute()
        finally:
            monitor.close()


def flops(call) -> int:
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        call()
    return counter.get_total_flops()


def counted(run: Run, every: int) -> dict:
    """The FLOPs of one training step and of one monitor call (warm and first), and their ratio at ``every``.
    The monitor's are counted without the rounds until it settles (``tolerance=0``): their number depends on
    the weights, each costs what an iteration does, and the FLOPs stay those of the shapes alone."""
    fixed = SpectralMonitor(run.model, tolerance=0)
    try:
        first = flops(fixed.compute)
        warm = flops(fixed.compute)
    finally:
        fixed.close()
    step = flops(run.step)
    return {"step": step, "monitor": warm, "first_call": first, "monitor_over_every_steps": warm / (every * step),
            "first_call_over_step": first / step}


def timed(run: Run, rounds: int, warmup: int, every: int) -> dict:
    """Median seconds of each call over ``rounds`` interleaved rounds of ``every`` steps and the monitor calls,
    after ``warmup`` training steps and the run's monitor's first call."""
    for _ in range(warmup):
        run.step()
    run.monitor.compute()  # its first call: after it the monitor is warm
    exact = SpectralMonitor(run.model, run.optimizer, exact=True)
    calls = {"step": run.step, "compute": run.monitor.compute, "first_call": run.first_call, "exact": exact.compute}
    seconds = {name: [] for name in calls}
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                for _ in range(every if name == "step" else 1):
                    start = time.perf_counter()
                    call()
                    seconds[name].append(time.perf_counter() - start)
    finally:
        exact.close()
    return {name: statistics.median(values) for name, values in seconds.items()}


def measure(name: str, overrides: dict, thread_counts: list[int], every: int, rounds: int, warmup: int) -> dict:
    """One preset: its shapes and FLOPs, and a timing row per thread count."""
    config = preset(name, **overrides)
    run = Run(config)
    scalars = len(run.monitor.compute())  # the first call: the FLOPs below count a warm one
    result = {"preset": name, "config": {key: getattr(config, key) for key in MODEL_FIELDS},
              "parameters": sum(p.numel() for p in run.model.parameters()),
              "matrices": sum(1 for p in run.model.parameters() if p.ndim >= 2),
              "attention_modules": len(run.monitor.attention), "scalars": scalars, "flops": counted(run, every),
              "rows": []}
    default_threads = torch.get_num_threads()
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            median = timed(Run(config), rounds, warmup, every)
            result["rows"].append({
                "threads": threads, "step_s": median["step"], "compute_s": median["compute"],
                "first_call_s": median["first_call"], "exact_s": median["exact"],
                "ratio": median["compute"] / (every * median["step"]),
                "first_call_over_step": median["first_call"] / median["step"],
                "exact_ratio": median["exact"] / (every * median["step"]),
                "within_goal": median["compute"] / (every * median["step"]) <= GOAL})
    finally:
        torch.set_num_threads(default_threads)
    return result


# The fields a preset's cost depends on, quoted in the results.
MODEL_FIELDS = ("n_layers", "d_model", "n_heads", "mlp_hidden", "seq_len", "batch_size", "optimizer", "p",
                "spectral_weight_decay", "weight_decay", "grad_clip")


def markdown(report: dict) -> str:
    every = report["settings"]["every"]
    lines = [
        "# What the spectral monitor costs (CPU)",
        "",
        f"`{report['command']}` on {machine_line(report['machine'])}. "
        f"The reference loop's training step (forward, backward, gradient clipping, the preset's default "
        f"optimizer step) against one `SpectralMonitor.compute()` on the same model (every matrix, the attention "
        f"pairs' logit bound, the decay counts; the default iterations: {report['settings']['first_iterations']} "
        f"at a first call, {report['settings']['iterations']} at a warm one, then rounds of "
        f"{report['settings']['iterations']} until no estimate rises by more than the tolerance, at most "
        f"{report['settings']['max_iterations']} in all), timed interleaved over "
        f"{report['settings']['rounds']} rounds (medians), after {report['settings']['warmup']} warm-up steps. "
        f"**Cost** is `compute / ({every} steps)`: monitoring every {every} steps; goal at most "
        f"{GOAL:.0%}. A warm call comes {every} training steps after the last, as in a run that monitors every "
        f"{every} steps. The first call (a new monitor: its vectors start at random, and a random init's close "
        f"singular values take the most rounds) is shown against one step. "
        f"`exact=True` takes every `s_max` from an FP64 SVD instead, the cost the power iteration saves.",
        "",
        f"| preset | threads | step (ms) | compute, warm (ms) | cost at every={every} | within {GOAL:.0%} | "
        f"first call (ms) | first call / step | exact=True (ms) | exact cost at every={every} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in report["presets"]:
        for row in result["rows"]:
            lines.append(f"| {result['preset']} | {row['threads']} | {row['step_s'] * 1e3:.1f} | "
                         f"{row['compute_s'] * 1e3:.2f} | {row['ratio']:.3%} | "
                         f"{'yes' if row['within_goal'] else '**no**'} | {row['first_call_s'] * 1e3:.1f} | "
                         f"{row['first_call_over_step']:.2f} | {row['exact_s'] * 1e3:.1f} | {row['exact_ratio']:.3%} |")
    lines += [
        "",
        f"A first call (made once per monitor), were it made every {every} steps: " + ", ".join(
            f"{result['preset']} ({row['threads']} threads) {row['first_call_over_step'] / every:.2%}"
            for result in report["presets"] for row in result["rows"]) + ".",
        "",
        "FLOPs (products, `torch.utils.flop_counter`; the same on every machine): one training step, one warm "
        "call and one first call of the monitor, without the rounds until it settles (`tolerance=0`: their number "
        "depends on the weights; each round costs what its iterations do).",
        "",
        f"| preset | shape | parameters | matrices | attention modules | scalars | step FLOPs | monitor FLOPs, "
        f"warm | first call FLOPs | warm / ({every} steps) | first call / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in report["presets"]:
        config, counts = result["config"], result["flops"]
        shape = (f"{config['n_layers']} layers, width {config['d_model']}, {config['n_heads']} heads, "
                 f"{config['batch_size']} x {config['seq_len']} tokens")
        lines.append(f"| {result['preset']} | {shape} | {result['parameters']:,} | {result['matrices']} | "
                     f"{result['attention_modules']} | {result['scalars']} | {counts['step']:.3e} | "
                     f"{counts['monitor']:.3e} | {counts['first_call']:.3e} | "
                     f"{counts['monitor_over_every_steps']:.2e} | {counts['first_call_over_step']:.2e} |")
    return "\n".join(lines) + "\n"


def parse_override(text: str) -> tuple[str, object]:
    """``FIELD=VALUE`` with VALUE read as JSON (``n_layers=1``, ``optimizer="muon"``)."""
    name, equals, value = text.partition("=")
    known = {f.name for f in fields(TrainConfig)} - {"preset"}
    if not equals or name not in known:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with FIELD one of the TrainConfig fields "
                                         f"({', '.join(sorted(known))}), got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: VALUE must be JSON (a number, true/false, or a quoted "
                                         "string)") from None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], prog="bench/monitor_cost.py")
    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["tiny", "small"],
                        help="the training presets to measure (default: tiny small)")
    parser.add_argument("--threads", nargs="+", type=int, default=None,
                        help="torch thread counts to time each preset at (default: 1 and torch's default here)")
    parser.add_argument("--every", type=int, default=50,
                        help="steps between two monitor calls: the cost is compute / (every * step) (default: 50)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of --every timed steps and the timed monitor calls; each time is "
                             "the median (default: 3)")
    parser.add_argument("--warmup", type=int, default=3, help="training steps before the timing (default: 3)")
    parser.add_argument("--set", dest="overrides", action="append", type=parse_override, default=[],
                        metavar="FIELD=VALUE",
                        help="override a TrainConfig field in every preset, VALUE as JSON, e.g. --set n_layers=1 "
                             "(repeatable; the tests run it on small shapes this way)")
    parser.add_argument("--out-md", type=Path, default=None, help="markdown report (default: printed)")
    parser.add_argument("--out-json", type=Path, default=None, help="the same results as JSON (default: none)")
    return parser


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    arguments = parser()
    args = arguments.parse_args(argv)
    for name, value in (("--every", args.every), ("--rounds", args.rounds), *(("--threads", n) for n in args.threads
                                                                              or ())):
        if value < 1:
            arguments.error(f"{name} must be at least 1, got {value}")
    if args.warmup < 0:
        arguments.error(f"--warmup must be at least 0, got {args.warmup}")
    overrides = dict(args.overrides)
    report = {"command": shlex.join(["python", "bench/monitor_cost.py", *argv]), "machine": machine(),
              "settings": {"every": args.every, "rounds": args.rounds, "warmup": args.warmup, "goal": GOAL,
                           "overrides": overrides,
                           **{name: inspect.signature(SpectralMonitor).parameters[name].default
                              for name in ("iterations", "first_iterations", "tolerance", "max_iterations")}}}
    threads = args.threads or sorted({1, torch.get_num_threads()})
    report["presets"] = [measure(name, overrides, threads, args.every, args.rounds, args.warmup)
                         for name in args.presets]
    text = markdown(report)
    if args.out_md:
        args.out_md.write_text(text)
    else:
        print(text, end="")
    if args.out_json:
        args.out_json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
