"""Validate and time every GPU kernel and op against the PyTorch reference, in one command.

    timeout 540 python bench/gpu_check.py --out docs/results/gpu/$(date +%F)   # GPU: 8 minutes at most
    python bench/gpu_check.py --only syrk,decay    # cases whose name contains one of these
    python bench/gpu_check.py --dry-run            # CPU: Triton interpreter, tiny shapes (what the tests run)
    python bench/gpu_check.py --compile-only sm80,sm90   # no GPU: registers, spills, shared memory per kernel

It starts from a bare checkout (no install, no registry): it imports the package from the checkout and,
where ``spectral_ops._C`` is not built, builds it with CMake for the GPU's architecture first.

Order: setup (``_C`` built while a process pool compiles the Triton variants), the headline cases
(each checked, then timed), the breadth, then the CUDA extension's cases in a child process.
``--dry-run`` prints the planned GPU run's stages and estimates against the budget first. The budget
(default 510 s: ``timeout 540`` less Python's start-up and the report) caps it; the headline ends by
240 s by the plan's estimate.

The exit status is 1 if any case failed, else 0 (the summary line still counts the timed-out and
skipped ones).

This script reads the flags, sets Triton's mode from them (``--dry-run``: the interpreter) before
anything imports the kernels, and runs :func:`gpu_checks.main.main`. The code is the package
``bench/gpu_checks/``, one module per responsibility: its docstring lists them.
"""

import os
import sys

from gpu_checks.checkout import use_this_checkout  # this script's folder, bench/, is on sys.path
from gpu_checks.cli import parse

if __name__ == "__main__":
    # triton.jit reads this when the kernels are imported, just below; another importer sets it itself.
    args = parse(sys.argv[1:])
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    elif args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    use_this_checkout()
    from spectral_ops.triton_kernels import interpreter

    from gpu_checks.main import main

    interpreter.speed_up()  # a dry run's interpreter: its bookkeeping, not the kernels' arithmetic
    sys.exit(main(args))
