"""Checking and timing one case, and the run: every task in order, each under a time limit.

Order. A GPU may be lent for as little as 15 minutes, so the run is ordered by what matters most
should it be cut short (:func:`case_tasks`, :func:`in_run_order`):

1. headline: the matmul yardstick, the Gram (SYRK), the product, the p = 2 decay (4096x4096 and
   16384x4096, on Triton and as dispatch routes it), Polar Express and the Muon step, then the
   per-head stack (96 heads of 128x768: the decay, the small path, Muon's heads), in bf16 and fp32
   (and TF32 for the Gram and the product); each case checked, then timed at once.
2. breadth: every other check (batched, odd, tall, wide shapes in fp32, bf16 and fp16), then every
   other timing, the compiled and graph-captured optimizer steps last.
3. cuda: the CUDA extension's cases, checked then timed, in a child process (:mod:`cuda_child`).

A check is the relative Frobenius error against the case's reference, within its dtype's tolerance. A
timing is the median of CUDA-event-timed runs after one warm-up run (3 to 20 runs, about 200 ms of
them), against its baseline -- the torch call it replaces, at the same precision: torch's float32
matmul precision is set for the row (``"highest"`` for fp32, ``"high"`` for tf32) and restored -- and
only for a case whose check passed. Each timing row also carries the cost model's columns
(:mod:`model_columns`). Timings are measurements of this machine, never assertions.

Time limits. ``--budget-s`` (default: ``timeout 540`` less start-up and the report, :mod:`schedule`)
bounds the run: no headline task starts after 240 s less start-up, no breadth task after 80% of it;
the CUDA cases' child is stopped at 100%; a case not started is reported as skipped. Each case runs
under its own limit (120 s for a check, 30 s for a timing, 90 s for the optimizer cases; less if less
of the budget is left): ``SIGALRM`` raises :class:`CaseTimeout` in the next Python bytecode, the case
is reported as timed out, and the run moves on. Timing loops also stop sampling before the limit, so a
slow case reports fewer runs rather than none. A signal cannot interrupt a blocking call, though: in
this process a hung kernel hangs the run (the CUDA cases' parent kills a hung child instead). The
report is rewritten after every case, so run the check under ``timeout``: the files keep everything
before the hang, and the last progress line without an ending names the hung case.
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

from . import model_columns
from .cases import Case
from .schedule import DEFAULT_BUDGET_S, HEADLINE_DEADLINE_S, STARTUP_S
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


# torch.set_float32_matmul_precision per row precision: fp32 rows against exact fp32 cuBLAS, tf32
# rows against cuBLAS with TF32 allowed (16-bit rows do not read it).
MATMUL_PRECISION = {"tf32": "high", "fp32": "highest"}


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """torch's float32 matmul precision for ``precision`` (a row's: ``"tf32"``, ``"fp32"``, ...), restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(MATMUL_PRECISION.get(precision, previous))
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def row_precision(case: Case, dtype) -> str:
    """``"bf16"``, ``"fp16"``, ``"fp32"`` or the case's own (``"tf32"``): what both sides of its timing run at."""
    return case.precision or {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def check_case(case: Case, shape, dtype, device, stop_at) -> dict:
    inputs = case.inputs(shape, dtype, device)
    output = case.fn(_clone(inputs))
    with float32_matmul_precision("fp32"):  # the reference is exact at its dtype, whatever the row's precision
        reference = case.reference(_clone(inputs))
    error = relative_error(output, reference)
    result = {"error": error, "tolerance": case.tolerance[dtype], "ok": error <= case.tolerance[dtype]}
    if case.ran_on is not None:
        result["note"] = f"ran on {case.ran_on()}"
    return result


def time_case(case: Case, shape, dtype, device, dry_run, stop_at) -> dict:
    inputs = case.inputs(shape, dtype, device)
    baseline = case.baseline or case.reference
    precision = row_precision(case, dtype)
    with float32_matmul_precision(precision):
        measured = timings(lambda: case.fn(inputs), lambda: baseline(inputs), device, dry_run, stop_at)
        model = model_columns.columns(case, shape, dtype, device, precision, measured["ms"], measured["baseline_ms"])
    return {"ok": True, "precision": precision, **measured, **model}


# ----- the run: tasks in order, each under a time limit -----

PHASES = ("headline", "breadth", "cuda")
# No task of a phase starts after this fraction of the budget: a cut falls on the breadth first, and
# the CUDA cases keep the end of the budget (their child process starts after the breadth).
PHASE_SHARE = {"headline": (HEADLINE_DEADLINE_S - STARTUP_S) / DEFAULT_BUDGET_S, "breadth": 0.8, "cuda": 1.0}
HEADLINE_DTYPES = (torch.bfloat16, torch.float32)
CHECK_TIMEOUT_S = 120.0  # a check includes the JIT compile of every Triton specialisation the pool missed
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
    kind: str  # "check" or "timing"
    case: str
    backend: str
    dtype: str
    shape: tuple
    run: Callable[[float], dict]
    timeout_s: float
    baseline: str = ""
    needs: tuple | None = None
    cost: str | None = None  # its kind of work for the plan's estimate (schedule.ESTIMATE_S), if not ``kind``

    @property
    def estimate_kind(self) -> str:
        return self.cost or self.kind

    @property
    def key(self) -> tuple:
        return self.kind, self.case, self.backend, self.dtype, tuple(self.shape)

    def row(self, **results) -> dict:
        return {"phase": self.phase, "kind": self.kind, "case": self.case, "backend": self.backend, "dtype": self.dtype,
                "shape": list(self.shape), "baseline": self.baseline, **results}


def skipping(reason: str):
    def run(stop_at):
        raise Skipped(reason)
    return run


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def case_tasks(cases, device, dry_run, cuda_reason) -> list[Task]:
    """Every case's checks and timings, in run order.

    1. headline: each headline case at its headline shapes in bf16 and fp32, checked then timed at
       once (in the dry run, the tiny shapes in fp32 stand in);
    2. breadth: every other check, then every other timing;
    3. cuda: the CUDA extension's cases, checked then timed (run in a child process: :mod:`cuda_child`).
    """
    headline, checks, timings_, cuda = [], [], [], []
    for case in cases:
        cannot = cuda_reason if case.backend == "cuda" else None
        if cannot is None and dry_run and not case.tiny_shapes:
            cannot = "GPU only: no interpreter-sized shape"
        phase = "cuda" if case.backend == "cuda" else "breadth"
        if cannot is not None:  # one row for the whole case
            (cuda if phase == "cuda" else checks).append(Task(
                phase, "check", case.name, case.backend, dtype_name(case.dtypes[0]), case.shapes[0],
                skipping(cannot), CHECK_TIMEOUT_S))
            continue
        dtypes = [d for d in case.dtypes if not (dry_run and d == torch.bfloat16)]
        for dtype in dtypes:
            for shape in case.tiny_shapes if dry_run else case.shapes:
                is_headline = (phase != "cuda" and dtype in HEADLINE_DTYPES and bool(case.headline)
                               and (dry_run or shape in case.headline))
                task_phase = "headline" if is_headline else phase
                check = Task(task_phase, "check", case.name, case.backend, dtype_name(dtype), shape,
                             functools.partial(check_case, case, shape, dtype, device),
                             case.timeout_s or CHECK_TIMEOUT_S)
                timing = Task(task_phase, "timing", case.name, case.backend, dtype_name(dtype), shape,
                              functools.partial(time_case, case, shape, dtype, device, dry_run),
                              case.timeout_s or TIMING_TIMEOUT_S, baseline=case.baseline_name, needs=check.key)
                if is_headline or phase == "cuda":
                    (headline if is_headline else cuda).extend([check, timing] if case.timed else [check])
                else:
                    checks.append(check)
                    if case.timed:
                        timings_.append(timing)
    return headline + checks + timings_ + cuda


# The headline in the order; a 96-head stack of 128 x 768 (the per-head decay, the small path,
# Muon's heads) is the last group whichever op it is.
HEADLINE_GROUPS = (("yardstick", ("yardstick",)), ("Gram", ("syrk",)), ("product", ("update",)),
                   ("S_2 decay", ("decay_",)), ("Polar Express / Muon", ("polar", "Muon")), ("heads", ()))


def headline_group(task: Task) -> str:
    if len(task.shape) == 3 and task.shape[0] == 96:
        return "heads"
    return next((group for group, words in HEADLINE_GROUPS if any(word in task.case for word in words)), "heads")


def in_run_order(tasks: list[Task]) -> list[Task]:
    """By phase, the headline by group, each check just before its timing (a stable sort keeps both)."""
    groups = [group for group, _ in HEADLINE_GROUPS]
    return sorted(tasks, key=lambda task: (PHASES.index(task.phase),
                                           groups.index(headline_group(task)) if task.phase == "headline" else 0))


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


def run_tasks(tasks, device, started: float, budget_s: float, save, stop_if=lambda row: False) -> list[dict]:
    """Every task in order, ``save(rows)`` after each: a run cut short (or hung) keeps what it did.
    ``stop_if(row)`` true ends the run after that row."""
    rows, status = [], {}
    for task in tasks:
        now = time.monotonic()
        print(f"{now - started:6.1f} s  {task.phase:<8} {task.kind:<6} {task.case} [{task.backend}, {task.dtype}, "
              f"{'x'.join(map(str, task.shape))}] ...", end="", flush=True)
        phase_end = PHASE_SHARE[task.phase] * budget_s
        # A check missing from this run's rows ran in a CUDA child that died in it (cuda_child).
        if task.needs is not None and status.get(task.needs, "failed") != "ok":
            row = task.row(ok=None, status="skipped", reason=NEEDED[status.get(task.needs, "failed")])
        elif now - started >= phase_end:
            row = task.row(ok=None, status="skipped", reason=f"time budget: no {task.phase} task starts after "
                                                             f"{phase_end:.0f} s")
        else:
            row = run_task(task, device, started + budget_s)
        status[task.key] = row["status"]
        rows.append(row)
        save(rows)
        print(f" {row_status(row)}" + (f" ({row['wall_s']:.1f} s)" if "wall_s" in row else ""), flush=True)
        if stop_if(row):
            break
    return rows
