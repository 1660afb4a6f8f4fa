"""One run, from the parsed flags to the exit status.

``--compile-only``: :func:`compile_only.compile_only`. ``--cuda-child START``: the CUDA cases from
``START`` on (:mod:`cuda_child`). Otherwise, in order (:mod:`schedule` estimates each stage):

1. setup: build ``_C`` where it is missing (a thread running cmake) while the Triton variants the
   cases launch are recorded on the GPU and compiled in a process pool into Triton's cache;
2. the headline cases, each checked then timed; 3. breadth: the other checks, then the other timings;
4. the CUDA extension's cases in a child process.

The report is rewritten after every case. ``--dry-run`` prints the planned GPU run against the budget
first, then runs the same order on the CPU under the Triton interpreter (tiny shapes, no CUDA).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from spectral_ops.__main__ import routing_report
from spectral_ops.backends.cuda_backend import CudaBackend
from spectral_ops.environment import CACHE_DIR

from . import cuda_child
from .build import build_extension_if_needed, toolchain_line
from .cases import REGISTRY, selected
from .compile_only import compile_only, compile_workers, warm_triton_cache
from .model_columns import mark_fastest
from .report import environment, markdown, report_paths, summarise
from .runner import case_tasks, headline_group, in_run_order, run_tasks
from .schedule import GPU_HOST_CORES, format_plan, plan_stages
from .special_cases import special_tasks


def all_tasks(args, device, cuda_reason):
    tasks = case_tasks([case for case in REGISTRY if selected(case.name, args.only)], device, args.dry_run, cuda_reason)
    tasks += [task for task in special_tasks(device, args.dry_run) if selected(task.case, args.only)]
    return in_run_order(tasks)


def planned_gpu_run(args) -> tuple[list, list[str]]:
    """The stages of a GPU run with these flags (full shapes, every CUDA case) from a bare checkout
    (``_C`` to build, the compile pool on the GPU host's cores), and its headline tasks, labelled."""
    gpu_args = type(args)(**{**vars(args), "dry_run": False})
    tasks = all_tasks(gpu_args, torch.device("cuda"), cuda_reason=None)
    headline = [f"{headline_group(task)}: {task.kind} {task.case} [{task.backend}, {task.dtype}, "
                f"{'x'.join(map(str, task.shape))}]" for task in tasks if task.phase == "headline"]
    return plan_stages(tasks, build_needed=True, workers=args.workers or GPU_HOST_CORES), headline


def setup(args, device, started: float) -> dict:
    """Build ``_C`` (a thread: cmake waits on nvcc) while the Triton variants compile in a pool."""
    outcome = {}
    builder = threading.Thread(target=lambda: outcome.update(build=build_extension_if_needed(device)))
    builder.start()
    triton_cases = [case for case in REGISTRY if case.backend == "triton" and selected(case.name, args.only)]
    try:
        outcome["triton"] = warm_triton_cache(triton_cases, device, args.workers or compile_workers())
    except Exception as error:  # the checks compile what the pool did not: slower, never wrong
        outcome["triton"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    builder.join()
    outcome["setup_s"] = round(time.monotonic() - started, 1)
    return outcome


def child_main(args) -> int:
    """``--cuda-child START``: the CUDA cases from START on, rows to ``--json``; stops with
    :data:`cuda_child.CONTEXT_LOST` once a failed case leaves the CUDA context unusable."""
    device = torch.device("cuda")
    started = time.monotonic()
    cuda_reason = CudaBackend().unavailable_reason(device)
    tasks = [task for task in all_tasks(args, device, cuda_reason) if task.phase == "cuda"][args.cuda_child:]
    lost = []

    def stop_if(row) -> bool:
        if row["status"] == "failed" and not cuda_child.context_usable(device):
            lost.append(row)
        return bool(lost)

    run_tasks(tasks, device, started, args.budget_s, lambda rows: cuda_child.write_rows(args.json, rows), stop_if)
    return cuda_child.CONTEXT_LOST if lost else 0


def main(args) -> int:
    if args.compile_only:
        return compile_only(args)
    if args.cuda_child is not None:
        return child_main(args)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter smoke test", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.out is not None:
        # The routing this run measures (and reuses) is kept with its results.
        os.environ[CACHE_DIR] = str(args.out / "routing")
    if args.dry_run:
        stages, headline = planned_gpu_run(args)
        print(format_plan(stages, args.budget_s, headline), "\n", flush=True)
        prepared = {"build": "dry run: no build", "setup_s": 0.0, "plan": [vars(stage) for stage in stages]}
    else:
        prepared = setup(args, device, started)
    cuda_reason = CudaBackend().unavailable_reason(device)
    tasks = all_tasks(args, device, cuda_reason)
    report = {"toolchain": "dry run: no GPU" if args.dry_run else toolchain_line(),
              "environment": environment(device, cuda_reason), "budget_s": args.budget_s, "setup": prepared,
              "build_s": prepared["setup_s"], "results": []}
    json_path, markdown_path = report_paths(args, "gpu_check")

    def save(rows):
        report["results"] = rows
        report["routing"] = routing_report()
        mark_fastest(rows)
        summarise(report)
        json_path.write_text(json.dumps(report, indent=1, default=str))
        if markdown_path is not None:
            markdown_path.write_text(markdown(report))

    in_process = [task for task in tasks if task.phase != "cuda" or cuda_reason is not None]
    rows = run_tasks(in_process, device, started, args.budget_s, save)
    children = [task for task in tasks if task.phase == "cuda" and cuda_reason is None]
    if children:
        print(f"{time.monotonic() - started:6.1f} s  cuda     {len(children)} cases in a child process", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            def command(start, rows_path, seconds_left):
                return cuda_child.child_command(cuda_child.script_path(), args.only, start, rows_path, seconds_left)

            rows += cuda_child.run_in_children(children, command, folder=Path(folder),
                                               end=started + args.budget_s, save=lambda more: save(rows + more))
    save(rows)
    print()
    print(markdown(report))
    print(f"wrote {json_path}" + (f" and {markdown_path}" if markdown_path is not None else ""))
    # Skipped and timed-out cases are no verdict: they do not fail the run, the summary counts them.
    return 1 if report["summary"]["failed"] else 0
