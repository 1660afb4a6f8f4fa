"""Multi-process tests judged by what their processes wrote, not by how they exited.

torch's Gloo teardown can abort a process after its work is done ("terminate called without an active
exception", SIGABRT: exit code -6): in ``destroy_process_group()``, and at the interpreter's exit when
a Gloo worker thread lets go of a collective's tensor only then (freeing its Python object takes the
GIL, and a thread asking for it once the interpreter is exiting is ended). A test's processes leave
the group to the exit (nothing after their results needs it destroyed), and each one's last act is
writing its result: whole or not at all (written aside, then renamed). The test reads every rank's:

* A process without a result failed, whatever its exit code: it raised, crashed (SIGABRT included) or
  hung before its work was done.
* A process that wrote its result and exited 0 passed. One aborted (SIGABRT) after writing it met
  torch's teardown abort: tolerated, with a warning, since nothing it was asked to do is missing. Any
  other ending after the result (another signal, a nonzero exit, a hang) fails.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

TIMEOUT = 600  # seconds for a whole launch; a healthy 4-process one takes ~2 minutes on 2 loaded cores


def _rank_main(worker, rank: int, world_size: int, results: str, args: tuple) -> None:
    torch.set_num_threads(1)  # world_size processes share the cores
    # The ranks meet in a file of the launch's own folder, not on a port picked in advance: another launch
    # at the same time (a second pytest-xdist worker, another checkout's suite) could take the port first.
    # A worker that fails on one rank alone leaves the others waiting in a collective: without a bound
    # (Gloo's default is 30 minutes) that is a 30-minute hang of the suite; the launch's TIMEOUT counts too.
    dist.init_process_group("gloo", init_method=Path(results, "rendezvous").as_uri(), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=180))
    result = worker(rank, world_size, *args)
    path = Path(results) / f"{rank}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    os.replace(partial, path)


def judge(exit_codes: list, results: Path) -> list:
    """Each rank's result, from the folder the ranks wrote and their exit codes (None: still running
    when the launch timed out); raises AssertionError naming every rank that failed."""
    outcomes, failures = [], []
    for rank, code in enumerate(exit_codes):
        path = results / f"{rank}.json"
        outcome = json.loads(path.read_text()) if path.exists() else None
        outcomes.append(outcome)
        if outcome is None:
            ending = "was still running at the timeout" if code is None else f"exited with code {code}"
            failures.append(f"rank {rank} {ending} before writing its result")
        elif code == -signal.SIGABRT:
            warnings.warn(f"rank {rank} wrote its result, then was aborted (SIGABRT) at exit: torch's Gloo teardown "
                          "abort, tolerated", RuntimeWarning, stacklevel=2)
        elif code is None:
            failures.append(f"rank {rank} wrote its result, then did not exit by the timeout")
        elif code != 0:
            failures.append(f"rank {rank} wrote its result, then exited with code {code}")
    assert not failures, "; ".join(failures)
    return outcomes


# What every rank imports, imported once by the fork server that the ranks of run_ranks fork from (a fresh
# interpreter importing them takes about 4 s of CPU, most of a short launch).
RANK_IMPORTS = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
                "torch.distributed.checkpoint", "spectral_ops", "spectral_ops.optim")


def run_ranks(worker, world_size: int, *args, timeout: float = TIMEOUT, interpreter_exit: bool = False) -> list:
    """``worker(rank, world_size, *args)`` in each of ``world_size`` processes, a Gloo process group over them
    started first; each rank's return value (JSON), judged by :func:`judge`. ``worker`` must be importable by
    name (a module-level function), as the processes import it.

    The processes fork from multiprocessing's fork server, which imported :data:`RANK_IMPORTS` (and the
    first launch's worker module) once, and end as a forked process does, without the interpreter's exit
    (``os._exit``: no atexit handler, no teardown of torch's). ``interpreter_exit``: each a fresh
    interpreter (spawn) that ends as a program does, for what happens at that exit."""
    if interpreter_exit:
        context = multiprocessing.get_context("spawn")
    else:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([*RANK_IMPORTS, worker.__module__])  # read when the server starts
    with tempfile.TemporaryDirectory() as results:
        processes = [context.Process(target=_rank_main, args=(worker, rank, world_size, results, args))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        try:
            for process in processes:
                process.join(max(0.0, deadline - time.monotonic()))
        finally:  # a hung rank must not stay behind
            exit_codes = [process.exitcode for process in processes]
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        return judge(exit_codes, Path(results))
