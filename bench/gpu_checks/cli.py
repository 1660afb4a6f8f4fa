"""Validate and time every GPU kernel and op against the PyTorch reference, in one command.

The command line of ``bench/gpu_check.py``: its flags and their ``--help``, whose description is the
line above. The standard library only: the script reads the flags before anything imports torch or
the kernels, to set Triton's mode.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .checkout import BENCH
from .schedule import DEFAULT_BUDGET_S, HEADLINE_DEADLINE_S, TIMEOUT_S


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                        help="first the planned GPU run: its stages in order, each one's estimated seconds against "
                             "the budget; then CPU tensors under TRITON_INTERPRET=1, tiny shapes, fp32/fp16, one "
                             "timing run; cases that need CUDA are reported as skipped")
    parser.add_argument("--json", type=Path, default=BENCH / "gpu_check.json",
                        help="where to write the JSON results when --out is not given (default: bench/gpu_check.json)")
    parser.add_argument("--out", type=Path, help="write gpu_check.md and gpu_check.json (compile_only.md and .json "
                                                 "with --compile-only) into this folder, e.g. docs/results/gpu/DATE; "
                                                 "the routing cache goes to its routing/ folder; overrides --json")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names to run "
                                                   "(the optimizer cases and the yardstick included)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"the whole run's time limit in seconds, build included: no headline task starts after "
                             f"{HEADLINE_DEADLINE_S:.0f} s (scaled with the budget), no breadth task after 80%%, and "
                             f"the CUDA cases' child is stopped at 100%% (the default: `timeout {TIMEOUT_S:.0f}` less "
                             f"Python's start-up and the report)")
    parser.add_argument("--compile-only", metavar="ARCHS", default="",
                        help="no GPU: compile every Triton kernel variant the cases launch for these targets "
                             "(comma-separated: sm80, sm90) and report its registers, stack (spills), shared "
                             "memory and HGMMA/HMMA/TMA/cp.async counts from cuobjdump, and those of the built _C's "
                             "kernels, instead of running")
    parser.add_argument("--cuda-child", type=int, default=None, metavar="START", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0,
                        help="processes that compile Triton variants (--compile-only, and on a GPU while _C builds); "
                             "default: one per core, at most 16")
    return parser.parse_args(argv)
