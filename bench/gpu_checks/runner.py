"""Checking and timing one case, and the run: every task in order, each under a time limit.

Order. A GPU may be lent for as little as 15 minutes, so the run is ordered by what matters most
should it be cut short:

1. check: every case -- the Triton and CUDA kernels, the plan's ops on each backend -- at each of its
   shapes (batched, odd, tall, wide, model-sized) and dtypes, against its reference (relative
   Frobenius error within the dtype's tolerance), untimed. CUDA cases come first: their kernels were
   compiled at build time, while each Triton specialisation JIT-compiles at its first launch (~120 of
   them, about a second each). This phase therefore holds all compile and warm-up time.
2. headline timings: the p = 2 decay at 4096x4096, 16384x4096 and 96 heads of 128x768, in bf16 and
   fp32, on Triton, on CUDA and wherever dispatch sends it; SYRK at 4096; a 4096^3 matmul as the
   yardstick; ``SpectralMuon`` against ``torch.optim.Muon`` (both orthogonalise in bf16); and a
   capturable ``SpectralAdamW`` step captured in a CUDA graph, replayed and compared with eager steps
   from the same start (last: a failed capture must not disturb the timings before it).
3. every other timing.

A timing is the median of CUDA-event-timed runs after one warm-up run (3 to 20 runs, about 200 ms of
them), against its baseline -- the torch call it replaces -- and only for a case whose check passed.
Timings are measurements of this machine, never assertions.

Time limits. ``--budget-s`` (default 420 s, build included) bounds the run: no check starts after 55%
of it, no headline timing after 80%, nothing after 100%; a case not started is reported as skipped.
Each case runs under its own limit (120 s for a check, 30 s for a timing, 90 s for the optimizer
cases; less if less of the budget is left): ``SIGALRM`` raises :class:`CaseTimeout` in the next Python
bytecode, the case is reported as timed out, and the run moves on. Timing loops also stop sampling
before the limit, so a slow case reports fewer runs rather than none. A signal cannot interrupt a
blocking call, though: a hung kernel, or a synchronisation waiting for one, hangs the run. The report
is rewritten after every case, so run the check under ``timeout``: the files keep everything before
the hang, and the last progress line without an ending names the hung case.
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from spectral_ops.linalg import relative_error

from .cases import Case
from .tables import row_status


# ----- measuring -----

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, dry_run, stop_at=math.inf) -> tuple[float, int]:
    """Median milliseconds of ``fn()`` and the number of runs: CUDA events after one warm-up run, as
    many runs as fill about 200 ms (3 to 20), fewer once ``stop_at`` (a ``time.monotonic()`` value)
    has passed; one wall-clock run when dry."""
    if dry_run:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, 1
    fn()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    while True:
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
        if len(samples) >= max(3, min(20, int(200 / max(samples[0], 1e-3)))) or time.monotonic() > stop_at:
            return statistics.median(samples), len(samples)


def timings(fn, baseline, device, dry_run, stop_at=math.inf) -> dict:
    """``fn`` against ``baseline``, each sampled for at most half of the time left before ``stop_at``."""
    halfway = time.monotonic() + (stop_at - time.monotonic()) / 2
    ms, runs = time_ms(fn, device, dry_run, halfway)
    baseline_ms, baseline_runs = time_ms(baseline, device, dry_run, stop_at)
    return {"ms": ms, "baseline_ms": baseline_ms, "speedup": baseline_ms / ms, "runs": runs,
            "baseline_runs": baseline_runs}


def _clone(d):
    return {k: tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone() for k, v in d.items()}


def check_case(case: Case, shape, dtype, device, stop_at) -> dict:
    inputs = case.inputs(shape, dtype, device)
    error = relative_error(case.fn(_clone(inputs)), case.reference(_clone(inputs)))
    result = {"error": error, "tolerance": case.tolerance[dtype], "ok": error <= case.tolerance[dtype]}
    if case.ran_on is not None:
        result["note"] = f"ran on {case.ran_on()}"
    return result


def time_case(case: Case, shape, dtype, device, dry_run, stop_at) -> dict:
    inputs = case.inputs(shape, dtype, device)
    baseline = case.baseline or case.reference
    return {"ok": True, **timings(lambda: case.fn(inputs), lambda: baseline(inputs), device, dry_run, stop_at)}


# ----- the run: tasks in order, each under a time limit -----

PHASES = ("check", "headline", "rest")
# No task of a phase starts after this fraction of the budget: a cut falls on the rest timings first.
PHASE_SHARE = {"check": 0.55, "headline": 0.8, "rest": 1.0}
HEADLINE_DTYPES = (torch.bfloat16, torch.float32)
CHECK_TIMEOUT_S = 120.0  # a check includes the JIT compile of every Triton specialisation it launches
TIMING_TIMEOUT_S = 30.0
OPTIMIZER_TIMEOUT_S = 90.0  # dispatch's first-use self-checks and compiles, then the steps
# Timing loops stop at this fraction of their limit: a slow case then reports fewer runs, not none.
SOFT_STOP = 0.8


class Skipped(Exception):
    """A task that cannot run here; the message says why."""


class CaseTimeout(BaseException):
    """A task ran past its limit. A BaseException, like KeyboardInterrupt, so that the code under test
    cannot swallow it: dispatch's self-check catches ``Exception`` from a kernel and disables it."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CaseTimeout` after ``seconds``, in the main thread at its next bytecode: never
    inside a blocking call (a launch, a synchronisation, a compile in C++), only once it returns."""
    def expire(signum, frame):
        raise CaseTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Task:
    """One row of the report. ``run(stop_at)`` returns its results, ``"ok"`` included, ends any timing
    loop by ``stop_at`` (a ``time.monotonic()`` value), and raises :class:`Skipped` if it cannot run
    here. ``needs``: the key of the check a timing waits on."""

    phase: str
    case: str
    backend: str
    dtype: str
    shape: tuple
    run: Callable[[float], dict]
    timeout_s: float
    baseline: str = ""
    needs: tuple | None = None

    @property
    def key(self) -> tuple:
        return self.case, self.backend, self.dtype, tuple(self.shape)

    def row(self, **results) -> dict:
        return {"phase": self.phase, "case": self.case, "backend": self.backend, "dtype": self.dtype,
                "shape": list(self.shape), "baseline": self.baseline, **results}


def skipping(reason: str):
    def run(stop_at):
        raise Skipped(reason)
    return run


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def case_tasks(cases, device, dry_run, cuda_reason) -> list[Task]:
    """A check of every case at each of its shapes and dtypes, then the timings: headline, then rest."""
    checks, headline, rest = [], [], []
    # CUDA first: its kernels were compiled at build time, Triton's compile at their first launch.
    for case in sorted(cases, key=lambda case: case.backend != "cuda"):
        cannot = cuda_reason if case.backend == "cuda" else None
        if cannot is None and dry_run and not case.tiny_shapes:
            cannot = "GPU only: no interpreter-sized shape"
        if cannot is not None:  # one row for the whole case
            checks.append(Task("check", case.name, case.backend, dtype_name(case.dtypes[0]), case.shapes[0],
                               skipping(cannot), CHECK_TIMEOUT_S))
            continue
        dtypes = [d for d in case.dtypes if not (dry_run and d == torch.bfloat16)]
        for dtype in dtypes:
            for shape in case.tiny_shapes if dry_run else case.shapes:
                check = Task("check", case.name, case.backend, dtype_name(dtype), shape,
                             functools.partial(check_case, case, shape, dtype, device),
                             case.timeout_s or CHECK_TIMEOUT_S)
                checks.append(check)
                if not case.timed:
                    continue
                is_headline = dtype in HEADLINE_DTYPES and bool(case.headline) and (dry_run or shape in case.headline)
                (headline if is_headline else rest).append(Task(
                    "headline" if is_headline else "rest", case.name, case.backend, dtype_name(dtype), shape,
                    functools.partial(time_case, case, shape, dtype, device, dry_run),
                    case.timeout_s or TIMING_TIMEOUT_S, baseline=case.baseline_name, needs=check.key))
    return checks + headline + rest


def run_task(task: Task, device, end: float) -> dict:
    """``task`` under its limit (or what is left before ``end``); every outcome is a row."""
    limit = min(task.timeout_s, end - time.monotonic())
    started = time.monotonic()
    try:
        with time_limit(limit):
            results = task.run(started + SOFT_STOP * limit)
            sync(device)  # its kernels' errors and time belong to it
        row = task.row(**results, status="ok" if results["ok"] else "failed")
    except Skipped as skip:
        row = task.row(ok=None, status="skipped", reason=str(skip))
    except CaseTimeout:
        cause = "its limit" if limit == task.timeout_s else "the end of the time budget"
        row = task.row(ok=None, status="timed out", reason=f"stopped after {limit:.1f} s ({cause})")
        # What it queued must not run into the next task's timing; a hung kernel hangs here. A CUDA
        # error raised by the wait is not this task's verdict: it will fail the next task, with its message.
        with contextlib.suppress(Exception):
            sync(device)
    except Exception as error:  # a crashing kernel is a failed case, reported with the rest
        row = task.row(ok=False, status="failed", reason=f"{type(error).__name__}: {error}"[:300])
    row["wall_s"] = round(time.monotonic() - started, 3)
    return row


NEEDED = {"failed": "its check failed", "timed out": "its check timed out", "skipped": "its check was skipped"}


def run_tasks(tasks, device, started: float, budget_s: float, save) -> list[dict]:
    """Every task in order, ``save(rows)`` after each: a run cut short (or hung) keeps what it did."""
    rows, status = [], {}
    for task in tasks:
        now = time.monotonic()
        print(f"{now - started:6.1f} s  {task.phase:<8} {task.case} [{task.backend}, {task.dtype}, "
              f"{'x'.join(map(str, task.shape))}] ...", end="", flush=True)
        phase_end = PHASE_SHARE[task.phase] * budget_s
        if task.needs is not None and status[task.needs] != "ok":
            row = task.row(ok=None, status="skipped", reason=NEEDED[status[task.needs]])
        elif now - started >= phase_end:
            row = task.row(ok=None, status="skipped", reason=f"time budget: no {task.phase} task starts after "
                                                             f"{phase_end:.0f} s")
        else:
            row = run_task(task, device, started + budget_s)
        status[task.key] = row["status"]
        rows.append(row)
        save(rows)
        print(f" {row_status(row)}" + (f" ({row['wall_s']:.1f} s)" if "wall_s" in row else ""), flush=True)
    return rows
