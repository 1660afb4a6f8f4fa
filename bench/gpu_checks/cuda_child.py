"""The CUDA extension's cases in child processes: a fault stays in the child that met it.

A memory fault in a ``_C`` kernel no GPU has run is sticky: it poisons the CUDA context, so every later
CUDA call of that process fails, or the process dies. The parent therefore runs the CUDA cases (the
``cuda`` phase, last) in a child, ``gpu_check.py --cuda-child START``, which runs them from task
``START`` on and rewrites its rows to a file after each. When a child dies (a signal, an abort), hangs
(its case runs past its limit plus a margin: the parent kills it) or stops itself because a failed case
left its CUDA context unusable (exit status :data:`CONTEXT_LOST`), the case it was in is reported with
that reason and a fresh child goes on from the next case.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .checkout import BENCH

CONTEXT_LOST = 3  # the child wrote the failed case's row, then stopped: its CUDA context is unusable
HANG_MARGIN_S = 10.0  # a case is killed this long after its own limit (which a hung kernel ignores)
POLL_S = 0.2


def write_rows(path: Path, rows: list[dict]) -> None:
    """The child's rows so far, replaced whole (the parent may read at any moment)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(rows, default=str))
    os.replace(partial, path)


def read_rows(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return []


def context_usable(device) -> bool:
    """Whether this process can still run CUDA work after a failed case (a sticky error fails this too)."""
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False


def child_command(script: Path, only: str, start: int, rows_path: Path, budget_s: float) -> list[str]:
    return [sys.executable, str(script), "--cuda-child", str(start), "--only", only, "--json", str(rows_path),
            "--budget-s", f"{budget_s:.1f}"]


def _ended(status: int | None) -> str:
    if status is not None and status < 0:
        return f"died of {signal.Signals(-status).name}"
    return f"exited with status {status}"


def run_in_children(tasks, command: Callable[[int, Path, float], list[str]], folder: Path, end: float,
                    save: Callable[[list[dict]], None], hang_margin_s: float = HANG_MARGIN_S) -> list[dict]:
    """``tasks`` (the cuda phase, in order) in as many children as it takes, ``command(start, rows_path,
    seconds_left)`` starting one; ``end``: the budget's end (``time.monotonic()``); a case running
    ``hang_margin_s`` past its limit is taken as hung. Returns every task's row."""
    rows: list[dict] = []
    children = 0
    while len(rows) < len(tasks):
        left = end - time.monotonic()
        if left <= 0:
            rows += [task.row(ok=None, status="skipped", reason="time budget: the CUDA cases ran out of it")
                     for task in tasks[len(rows):]]
            break
        start, children = len(rows), children + 1
        rows_path = folder / f"cuda_child_{children}.json"
        child = subprocess.Popen(command(start, rows_path, left))
        current, current_since = start, time.monotonic()
        status, killed = None, None
        while status is None:
            time.sleep(POLL_S)
            status = child.poll()
            done = read_rows(rows_path)
            if start + len(done) != current:
                current, current_since = start + len(done), time.monotonic()
                save(rows + done)
            running_for = time.monotonic() - current_since
            if status is None and current < len(tasks) and (
                    running_for > tasks[current].timeout_s + hang_margin_s or time.monotonic() > end):
                killed = running_for
                child.kill()
                status = child.wait()
        done = read_rows(rows_path)
        rows += done
        if len(rows) >= len(tasks):
            break
        if killed is not None:
            reason = f"hung: the child was killed after {killed:.0f} s in this case"
            rows.append(tasks[len(rows)].row(ok=None, status="timed out", reason=reason))
        elif status != CONTEXT_LOST:
            # The child died in the case after its last row; CONTEXT_LOST wrote that case's row itself.
            reason = f"the child process {_ended(status)} in this case; a fresh child goes on from the next"
            rows.append(tasks[len(rows)].row(ok=False, status="failed", reason=reason))
        save(rows)
    return rows


def script_path() -> Path:
    return BENCH / "gpu_check.py"
