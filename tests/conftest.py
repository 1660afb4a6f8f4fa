import os
from pathlib import Path

import pytest
import torch

from spectral_ops import dispatch, gpu_model

# Triton's interpreter for the test_triton_* modules (tests/triton_env.py says why), set here, before pytest
# collects any test module: a framework that another module imports at collection (heavyball, Lightning)
# imports triton, and kernels decorated after that no longer see a variable set later (their launches then
# fail: "Cannot call @triton.jit'd outside of the scope of a kernel"). setdefault: a GPU machine may set 0.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's C++ kernels use the best vector ISA that /proc/cpuinfo lists and that passes a probe: a kernel built
# for it and loaded in a child Python, per ISA and per process. torch 2.12's child imports torch for it (about 2 s
# each, 9 s of every process that compiles at the oldest torch: the test subset of `make test` there spent a
# sixth of its time on it); a new machine also builds the probes (about 9 s). The suite takes the CPU's flags as
# they are (TORCHINDUCTOR_VEC_ISA_OK=1: the same choice wherever they are true; it tests none of Inductor's own
# ISA detection); its processes inherit it. A value already set wins.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# Modules whose tests share a costly module- or session-scoped fixture (a build kept under build/, every
# experiment run once, a multi-process launch, the dry run of the GPU check), or that load the cores on purpose
# (test_dist_exit's launches beside a busy loop). Under pytest-xdist (`make test` runs `-n auto`) each runs on one
# worker, so its fixture is made once, not once per worker, no two workers write the same build folder, and one
# busy loop at a time contends for the cores; every other test goes to whichever worker is free.
ONE_WORKER_MODULES = ("test_cuda_emulation", "test_cuda_sass", "test_dist_exit", "test_experiments",
                      "test_integrations_torchtitan", "test_optim_distributed",
                      "test_train_distributed", "test_triton_gpu_check")


# The modules that keep a worker longest, longest first: the one-worker modules above by their length, then those
# with the longest single tests (compiled steps, launches, the Triton interpreter's composed paths). Run first,
# they leave the short tests to fill both workers at the end: started late, one of them runs alone while the
# other worker idles (the dry run of the GPU check alone takes 1 to 3 minutes).
LONGEST_FIRST = ("test_triton_gpu_check", "test_cuda_emulation", "test_train_distributed", "test_optim_distributed",
                 "test_experiments", "test_cuda_sass", "test_dist_exit", "test_integrations_torchtitan",
                 "test_optim_compile", "test_readme", "test_triton_backend", "test_train", "test_optim_capturable",
                 "test_dispatch", "test_monitor_distributed")


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's modules first, in its order; every other module after them, in collection order. Whole
    modules move, so a module's fixtures are still made once."""
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_configure(config):
    """Each xdist worker takes its share of the cores for torch's threads (and hands it on to the processes
    its tests start): with more threads than cores, OpenMP threads wait on one another at every product
    (a 64 x 32 one then takes milliseconds instead of microseconds). An OMP_NUM_THREADS already set wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's default distribution (`-n` alone), with the tests of each of ONE_WORKER_MODULES as one unit
    of work, handed out in the order of the collection (LONGEST_FIRST), not reordered by their number of tests.
    (`--dist loadgroup` would do it from marks, but xdist 3.8 puts the group into item._nodeid, which pytest 9's
    node ids no longer read.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if Path(module).stem in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Each test starts with no forced backend and no remembered self-check results."""
    monkeypatch.delenv("SPECTRAL_OPS_BACKEND", raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


# Unit round-off of the dtype a computation accumulates in.
ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}


# A GPU of the cost model, standing for the CPU the tests run on (rates in FLOP/s and B/s).
FAKE_GPU = gpu_model.Arch("Fake GPU", "sm90", 1, 1e11, {"fp64": 1e12, "fp32": 1e12, "tf32": 1e13, "bf16": 2e13,
                                                        "fp16": 2e13})


@pytest.fixture
def modelled_gpu(monkeypatch):
    """CPU tensors routed as on a GPU the cost model knows (nothing measured on it unless a test says)."""
    monkeypatch.setattr(dispatch, "_arch_of", lambda device: FAKE_GPU)
    return FAKE_GPU


@pytest.fixture
def clock():
    """The fake clock of tests/timed_backends.py's backends."""
    from timed_backends import FakeClock

    return FakeClock()


@pytest.fixture
def tuner(monkeypatch, tmp_path, clock):
    """An autotuner measuring CPU tensors with the fake ``clock``, caching under tmp_path."""
    from timed_backends import fake_autotuner

    return fake_autotuner(monkeypatch, tmp_path, clock)
