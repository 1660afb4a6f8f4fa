"""One run, from the parsed flags to the exit status: ``--compile-only``, or build ``_C`` where needed,
every selected task in order under the budget, the report rewritten after each.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from spectral_ops.backends.cuda_backend import CudaBackend
from spectral_ops.__main__ import routing_report
from spectral_ops.environment import CACHE_DIR

from .build import build_extension_if_needed
from .cases import REGISTRY, selected
from .compile_only import compile_only
from .report import environment, markdown, report_paths, summarise
from .runner import PHASES, case_tasks, run_tasks
from .special_cases import special_tasks


def main(args) -> int:
    if args.compile_only:
        return compile_only(args)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter smoke test", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.out is not None:
        # The routing this run measures (and reuses) is kept with its results.
        os.environ[CACHE_DIR] = str(args.out / "routing")
    if not args.dry_run:
        build_extension_if_needed(device)
    cuda_reason = CudaBackend().unavailable_reason(device)
    tasks = case_tasks([case for case in REGISTRY if selected(case.name, args.only)], device, args.dry_run, cuda_reason)
    tasks += [task for task in special_tasks(device, args.dry_run) if selected(task.case, args.only)]
    tasks.sort(key=lambda task: PHASES.index(task.phase))  # stable: the order within each phase stays
    report = {"environment": environment(device, cuda_reason), "budget_s": args.budget_s,
              "build_s": round(time.monotonic() - started, 1), "results": []}
    json_path, markdown_path = report_paths(args, "gpu_check")

    def save(rows):
        report["results"] = rows
        report["routing"] = routing_report()
        summarise(report)
        json_path.write_text(json.dumps(report, indent=1))
        if markdown_path is not None:
            markdown_path.write_text(markdown(report))

    save(run_tasks(tasks, device, started, args.budget_s, save))
    print()
    print(markdown(report))
    print(f"wrote {json_path}" + (f" and {markdown_path}" if markdown_path is not None else ""))
    # Skipped and timed-out cases are no verdict: they do not fail the run, the summary counts them.
    return 1 if report["summary"]["failed"] else 0
