"""Building ``spectral_ops._C`` on a bare GPU machine, before the checks, and what the report says about it.

A bare machine may lack any of the build's tools: each one missing is a printed reason, never a silent
skip, and the run goes on without ``_C`` (its rows are skipped with that reason). The in-tree build
writes ``spectral_ops/_build_info.json`` as ``setup.py`` does, so the record beside the module
describes it (a stale record from a CPU-only install would otherwise make ``load_extension`` refuse it).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from .checkout import ROOT

BUILD_TIMEOUT_S = 240


def find_tools() -> tuple[dict, str | None]:
    """``({"nvcc": path, "cmake": path, "pybind11": cmake dir}, None)``, or ``(what was found, why the
    build cannot run)``: the first tool missing, named."""
    from spectral_ops.build_config import find_nvcc

    tools = {"nvcc": find_nvcc(os.environ), "cmake": shutil.which("cmake")}
    if tools["nvcc"] is None:
        return tools, "no nvcc (looked in CUDACXX, PATH, CUDA_HOME/bin, CUDA_PATH/bin, /usr/local/cuda/bin)"
    if tools["cmake"] is None:
        return tools, "no cmake on PATH (pip install cmake, or the system package)"
    try:
        import pybind11
    except ImportError:
        return tools, "no pybind11 for this Python (pip install pybind11)"
    tools["pybind11"] = pybind11.get_cmake_dir()
    return tools, None


def _nvcc_version(nvcc: str) -> str | None:
    from spectral_ops.build_config import parse_nvcc_version

    try:
        return parse_nvcc_version(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout)
    except OSError:
        return None


def write_build_record(archs, nvcc: str | None, cuda_built: bool, reason: str) -> None:
    """``spectral_ops/_build_info.json`` for the in-tree build, as ``setup.py`` writes it for its own."""
    from spectral_ops.build_config import BUILD_INFO_FILENAME, build_info, hash_sources

    info = build_info(cuda_built=cuda_built, reason=reason,
                      sources_sha256=hash_sources(ROOT / "csrc") if cuda_built else "", archs=archs,
                      archs_source="bench/gpu_check.py (this GPU)", nvcc_path=nvcc,
                      nvcc_version=_nvcc_version(nvcc) if nvcc else None, env=os.environ)
    (ROOT / "spectral_ops" / BUILD_INFO_FILENAME).write_text(json.dumps(info, indent=2) + "\n")


def build_extension_if_needed(device) -> str:
    """On a GPU machine without a loadable ``spectral_ops._C``, build it into the checkout with CMake
    (no pip, no network: nvcc, cmake and pybind11 are enough; ninja if present) for this GPU's
    architecture, and record the build. If the machine's compiler warns where this project's does not,
    the build is retried without ``-Werror``. Returns the one line the report shows; progress is printed."""
    from spectral_ops._extension import load_extension
    from spectral_ops.build_config import cmake_arch_string, parse_cuda_arch_list

    if load_extension()[0] is not None:
        return "spectral_ops._C already built"
    tools, missing = find_tools()
    if missing is not None:
        line = f"spectral_ops._C not built: {missing}; every CUDA row is skipped"
        print(line, flush=True)
        return line
    major, minor = torch.cuda.get_device_capability(device)
    archs = parse_cuda_arch_list(f"{major}{minor}", source="the GPU's capability", ptx_for_newest=True)
    build = ROOT / "build" / "gpu-check"
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_CUDA_COMPILER={tools['nvcc']}", f"-DCMAKE_CUDA_ARCHITECTURES={cmake_arch_string(archs)}",
                 f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={ROOT / 'spectral_ops'}", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-Dpybind11_DIR={tools['pybind11']}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    started, failure = time.monotonic(), "not attempted"
    for werror in ("ON", "OFF"):
        print(f"building spectral_ops._C for sm_{major}{minor} (SPECTRAL_OPS_WERROR={werror}) ...", flush=True)
        shutil.rmtree(build, ignore_errors=True)
        try:
            for command in (configure + [f"-DSPECTRAL_OPS_WERROR={werror}"], ["cmake", "--build", str(build), "-j"]):
                result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
                if result.returncode:
                    output = result.stdout + result.stderr
                    print(output[-4000:], flush=True)
                    failure = f"{command[0]} {command[1]} exited {result.returncode}: {output.strip()[-200:]}"
                    break
            else:
                failure = None
                break
        except subprocess.TimeoutExpired:
            failure = f"the build ran past {BUILD_TIMEOUT_S} s"
            print(failure, flush=True)
    write_build_record(archs, tools["nvcc"], failure is None, failure or "")
    load_extension.cache_clear()
    seconds = time.monotonic() - started
    line = (f"spectral_ops._C built for sm_{major}{minor} in {seconds:.0f} s" if failure is None
            else f"spectral_ops._C build failed after {seconds:.0f} s: {failure}")
    print(line, flush=True)
    return line


def driver_cuda_version() -> int | None:
    """The newest CUDA version the installed driver supports (``cuDriverGetVersion``: 12040 for 12.4),
    or None where no driver library loads. It needs no GPU context."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    return version.value if driver.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_mismatch(runtime: int | None, driver: int | None) -> str | None:
    """One line when ``_C``'s CUDA runtime (``13000`` for 13.0) needs a newer driver than ``driver``
    supports: CUDA's minor-version compatibility runs a 13.x build on any 13.y driver, never on a 12.y one."""
    if runtime is None or driver is None or runtime // 1000 <= driver // 1000:
        return None
    return (f"driver/toolkit mismatch: spectral_ops._C was built with CUDA {_version_text(runtime)}, and this "
            f"driver supports CUDA {_version_text(driver)} at most: every CUDA row is skipped (build _C with a "
            f"CUDA {driver // 1000}.x toolkit, or install a CUDA {runtime // 1000} driver)")


def extension_runtime_version() -> int | None:
    """The CUDA runtime ``_C`` was built against: the module's own answer, else its build record's nvcc."""
    from spectral_ops._extension import build_info, load_extension

    module, _ = load_extension()
    if module is not None:
        return module.cuda_runtime_version()
    version = (build_info() or {}).get("nvcc_version")
    if not version:
        return None
    major, minor, *_ = version.split(".")
    return int(major) * 1000 + int(minor) * 10


def toolchain_line() -> str:
    """The report's first line about CUDA: the mismatch when there is one, else both versions."""
    runtime, driver = extension_runtime_version(), driver_cuda_version()
    mismatch = driver_mismatch(runtime, driver)
    if mismatch is not None:
        return mismatch
    return (f"CUDA driver {_version_text(driver) if driver else 'not found'}; spectral_ops._C built with CUDA "
            f"{_version_text(runtime) if runtime else '(none)'}; torch built with CUDA {torch.version.cuda}")
