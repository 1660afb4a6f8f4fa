"""Builds spectral_ops._C from csrc/ as plain C++ for the CPU emulation (prelude.h), cached by content.

The result is a module with _C's exact bindings whose kernels run on the CPU: the tests hand it CPU
tensors described as if they lived on cuda:0 (harness.py).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
CACHE = ROOT / "build" / "cuda-emulation"

# A kernel whose dynamic shared memory lives in its unnamed namespace is compiled through a wrapper
# that defines that memory in the same translation unit.
WRAPPERS = {"small_chain": HERE / "chain_tu.cpp"}
# One translation unit per csrc/*.cu, as the real build globs them, so a new kernel needs no entry here.
UNITS = {
    "runtime": HERE / "runtime.cpp",
    **{source.stem: WRAPPERS.get(source.stem, source) for source in sorted(CSRC.glob("*.cu"))},
    "bindings": CSRC / "bindings.cpp",
}


class EmulationUnavailable(RuntimeError):
    """No C++ compiler, CUDA headers or pybind11 here."""


def cuda_include_dir() -> Path:
    from spectral_ops.build_config import find_nvcc

    nvcc = find_nvcc(dict(os.environ))
    candidates = [Path(nvcc).resolve().parent.parent / "include"] if nvcc else []
    candidates.append(Path("/usr/local/cuda/include"))
    for candidate in candidates:
        if (candidate / "cuda_runtime.h").exists():
            return candidate
    raise EmulationUnavailable("the CUDA headers (cuda_runtime.h) were not found")


def _flags() -> list[str]:
    try:
        import pybind11
    except ImportError as exc:
        raise EmulationUnavailable("pybind11 is not installed") from exc
    return [
        # -U_FORTIFY_SOURCE: the fibers switch stacks with _longjmp (runtime.cpp), which the fortified
        # longjmp would take for a jump into a dead frame. -O1: the build is on every new checkout's path
        # (23 s of CPU against -O2's 36 s, 2 cores), and the emulated tests run as fast (-O0: three times
        # slower). Neither option contracts or reorders floating point (no FMA below -march, ISO C++), so
        # the results are -O2's bit for bit.
        "-std=c++17", "-O1", "-fPIC", "-w", "-U_FORTIFY_SOURCE",
        "-include", str(HERE / "prelude.h"),
        f"-I{HERE / 'include'}", f"-I{CSRC}", f"-I{cuda_include_dir()}",
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
    ]


# -Bsymbolic: the module's calls of the CUDA runtime bind to the emulation's own definitions, also in a
# process where a CUDA build of torch has loaded the real libcudart with global symbols (which would
# otherwise take them: "no CUDA device available", on a machine without a GPU).
LINK_FLAGS = ["-shared", "-Wl,-Bsymbolic"]


def _digest(flags: list[str]) -> str:
    h = hashlib.sha256(" ".join(flags + LINK_FLAGS).encode())
    for path in sorted([*CSRC.glob("*"), *HERE.glob("*.h"), *HERE.glob("*.cpp"), *(HERE / "include").glob("*")]):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise EmulationUnavailable("no C++ compiler (g++ or $CXX)")
    return compiler


def build_selftest() -> Path:
    """The emulation's own checks (selftest.cpp with runtime.cpp) as an executable, compiled if the
    sources changed since the last build."""
    compiler, flags = _compiler(), _flags()
    target = CACHE / _digest(flags) / "selftest"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([compiler, *flags, str(HERE / "selftest.cpp"), str(HERE / "runtime.cpp"), "-o", str(target)],
                       check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"the emulation self-test build failed:\n{exc.stderr}") from exc
    return target


def build() -> Path:
    """The emulated module's path, compiling it if the sources changed since the last build."""
    compiler, flags = _compiler(), _flags()
    out_dir = CACHE / _digest(flags)
    target = out_dir / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spectral_ops_build_config.h").write_text(
        '#pragma once\n#define SPECTRAL_OPS_COMPILED_ARCHS "emulation"\n')

    def compile_unit(item):
        name, source = item
        obj = out_dir / f"{name}.o"
        language = ["-x", "c++"] if source.suffix == ".cu" else []
        subprocess.run([compiler, *flags, f"-I{out_dir}", *language, "-c", str(source), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        return obj

    try:
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_unit, UNITS.items()))
        subprocess.run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(target)], check=True,
                       capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"the emulation build failed:\n{exc.stderr}") from exc
    return target


def load():
    """Import the emulated module (building it first if needed)."""
    path = build()
    spec = importlib.util.spec_from_file_location("spectral_ops_emulation._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    print(build())
