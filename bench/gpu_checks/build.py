"""Building ``spectral_ops._C`` on a bare GPU machine, before the checks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .checkout import ROOT


def build_extension_if_needed(device) -> None:
    """On a GPU machine with nvcc but no built ``spectral_ops._C``, build it into the checkout with
    CMake (no pip, no network: cmake, ninja and pybind11 are enough), for this GPU's architecture.
    If the machine's compiler warns where this project's does not, the build is retried without
    ``-Werror``. The outcome is printed, never hidden."""
    import shutil
    import subprocess

    from spectral_ops._extension import load_extension

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if load_extension()[0] is not None or nvcc is None or shutil.which("cmake") is None:
        return
    import pybind11

    major, minor = torch.cuda.get_device_capability(device)
    build = ROOT / "build" / "gpu-check"
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={major}{minor}",
                 f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={ROOT / 'spectral_ops'}", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for werror in ("ON", "OFF"):
        print(f"building spectral_ops._C for sm_{major}{minor} (SPECTRAL_OPS_WERROR={werror}) ...", flush=True)
        shutil.rmtree(build, ignore_errors=True)
        try:
            for command in (configure + [f"-DSPECTRAL_OPS_WERROR={werror}"], ["cmake", "--build", str(build), "-j"]):
                result = subprocess.run(command, capture_output=True, text=True, timeout=240)
                if result.returncode:
                    print((result.stdout + result.stderr)[-4000:], flush=True)
                    break
            else:
                print("built", flush=True)
                break
        except subprocess.TimeoutExpired:
            print("the build ran past 240 s", flush=True)
    load_extension.cache_clear()
