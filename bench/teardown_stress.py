"""``python bench/teardown_stress.py [--runs 32] [--load 2] [--optimizers ...] [--teardowns ...] [--output F]``

How often a finished multi-process run fails at exit. Each launch starts ``--world-size`` processes on
the CPU (Gloo, as torchrun would: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), which train a
small MLP for a few steps, sharded by FSDP2's ``fully_shard`` or replicated as under DDP, print a marker
when their work is done, and either call ``destroy_process_group()`` or leave the group to the
interpreter's exit. ``--load`` busy loops keep the cores contended, the condition under which torch's
Gloo teardown sometimes aborts (``terminate called without an active exception``, exit code -6).

A launch is clean when every process printed its marker and exited 0. Printed per variant, a launch
counted by its worst process: clean, aborted after done (SIGABRT after the marker: the teardown
abort), failed after done (another nonzero exit after it), failed before done (a real failure of the
run, whose stderr is passed on).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OPTIMIZERS = ("spectral-adamw", "spectral-muon", "adamw")
TEARDOWNS = ("none", "destroy")
PARALLELS = ("fsdp", "ddp")
DONE = "teardown-stress: done"
# A worker's model and optimizer live until its interpreter exits, as a training script's globals do:
# whatever they hold is released during the interpreter's teardown, the moment this tool is about.
_ALIVE = []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _optimizer(name: str, model, process_group):
    import torch

    from spectral_ops.optim import SpectralAdamW, SpectralMuon

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if name == "spectral-adamw":
        return SpectralAdamW(model.parameters(), lr=1e-2, p=2, spectral_weight_decay=0.5,
                             process_group=process_group)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return SpectralMuon([{"params": matrices}, {"params": vectors, "algorithm": "adamw"}], lr=1e-2, p=2,
                        spectral_weight_decay=0.5, precision="fp32", process_group=process_group)


def worker(optimizer_name: str, teardown: str, parallel: str, steps: int) -> None:
    """One process of a launch: its place in it comes from the environment, as under torchrun."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 41), torch.nn.ReLU(), torch.nn.Linear(41, 8))
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        network = fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        process_group = None
    else:
        network = torch.nn.parallel.DistributedDataParallel(model)
        process_group = dist.group.WORLD
    optimizer = _optimizer(optimizer_name, model, process_group)
    inputs = torch.randn(6, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        network(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    _ALIVE.extend((network, optimizer))
    print(DONE, flush=True)
    if teardown == "destroy":
        dist.destroy_process_group()


# A launch's outcomes, worst first: the one of its worst process is the launch's.
OUTCOMES = ("failed before done", "failed after done", "aborted after done", "clean")


def launch(optimizer_name: str, teardown: str, parallel: str, steps: int, world_size: int) -> str:
    """One launch's outcome (one of OUTCOMES); the stderr of a process that failed before its marker is
    passed on, as the cause is then not the teardown."""
    port = _free_port()
    command = [sys.executable, __file__, "--as-worker", "--optimizers", optimizer_name, "--teardowns", teardown,
               "--parallels", parallel, "--steps", str(steps)]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "OMP_NUM_THREADS": "1"})
                 for rank in range(world_size)]
    outcomes = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        outcomes.append(outcome(out, process.returncode))
        if outcomes[-1] == "failed before done":
            sys.stderr.write(err[-2000:])
    return min(outcomes, key=OUTCOMES.index)


def outcome(stdout: str, returncode: int) -> str:
    """One process's ending (one of OUTCOMES), from what it printed and its exit code."""
    if DONE not in stdout:
        return "failed before done"
    if returncode == -signal.SIGABRT:
        return "aborted after done"
    return "failed after done" if returncode else "clean"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=32, help="launches per variant (default 32)")
    parser.add_argument("--load", type=int, default=2,
                        help="busy-loop processes contending for the cores during the launches (default 2)")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                        help="optimizers to train with (default: all; torch's adamw is the control)")
    parser.add_argument("--teardowns", nargs="+", choices=TEARDOWNS, default=list(TEARDOWNS),
                        help="'destroy': call destroy_process_group() after the work; 'none': leave the group "
                             "to the interpreter's exit (default: both)")
    parser.add_argument("--parallels", nargs="+", choices=PARALLELS, default=["fsdp"],
                        help="fsdp: fully_shard's Shard(0) parameters; ddp: DistributedDataParallel's "
                             "replicated ones (default: fsdp)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per launch (default 3)")
    parser.add_argument("--world-size", type=int, default=2, help="processes per launch (default 2)")
    parser.add_argument("--concurrent", type=int, default=1,
                        help="launches running at once: more contention, as a CI running tests in parallel "
                             "(default 1)")
    parser.add_argument("--output", default=None,
                        help="also write the table to OUTPUT.md and the counts to OUTPUT.json, with the machine "
                             "(e.g. docs/results/teardown-stress)")
    parser.add_argument("--as-worker", action="store_true",
                        help="internal: be one process of a launch (the launcher passes it, with one "
                             "optimizer, teardown and parallel)")
    args = parser.parse_args(argv)
    if args.as_worker:
        worker(args.optimizers[0], args.teardowns[0], args.parallels[0], args.steps)
        return {}
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    counts = {}
    try:
        for variant in itertools.product(args.parallels, args.optimizers, args.teardowns):
            parallel, optimizer_name, teardown = variant
            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrent) as pool:
                outcomes = list(pool.map(lambda _: launch(optimizer_name, teardown, parallel, args.steps,
                                                          args.world_size), range(args.runs)))
            counts[variant] = {outcome: outcomes.count(outcome) for outcome in reversed(OUTCOMES)}
            print(f"{parallel:5} {optimizer_name:15} teardown={teardown:8} " +
                  ", ".join(f"{name} {count}/{args.runs}" for name, count in counts[variant].items()) +
                  f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        for process in load:
            process.kill()
            process.wait()
    if args.output:
        write_report(args.output, counts, vars(args))
    return counts


def write_report(output: str, counts: dict, settings: dict) -> None:
    """``output.md``: one row per variant; ``output.json``: the counts and settings; both name the machine."""
    from spectral_ops.provenance import machine, machine_line

    runs = settings["runs"]
    rows = [f"| {parallel} | {name} | {teardown} | " + " | ".join(f"{counts[(parallel, name, teardown)][o]}/{runs}"
                                                                   for o in reversed(OUTCOMES)) + " |"
            for parallel, name, teardown in counts]
    flags = " ".join(f"--{key.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
                     for key, value in settings.items() if key not in ("as_worker", "output"))
    Path(f"{output}.md").write_text(
        "# Exit of finished multi-process runs under load\n\n"
        f"`python bench/teardown_stress.py {flags}`: {settings['world_size']} Gloo processes per launch, "
        f"{settings['steps']} steps, {settings['load']} busy loops contending for the cores.\n\n"
        "| parallel | optimizer | teardown | " + " | ".join(reversed(OUTCOMES)) + " |\n"
        "|---|---|---|" + "---|" * len(OUTCOMES) + "\n" + "\n".join(rows) + f"\n\nOn {machine_line()}.\n")
    Path(f"{output}.json").write_text(json.dumps(
        {"settings": {k: v for k, v in settings.items() if k not in ("as_worker", "output")},
         "counts": [{"parallel": p, "optimizer": o, "teardown": t, **c} for (p, o, t), c in counts.items()],
         "machine": machine()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
