"""Build script: the pure-Python package, plus the optional CUDA extension ``spectral_ops._C``.

The extension is built by CMake (Ninja generator) from csrc/. What to build, and for which GPU
architectures, is decided by spectral_ops/build_config.py from the environment; its docstring lists
the variables. Whatever the outcome, the build writes spectral_ops/_build_info.json, and a build
without the extension prints one line saying why (shown by ``pip install -v``).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent


def _load_build_config():
    # By path: the package is not installed yet, and importing it would import torch.
    path = ROOT / "spectral_ops" / "build_config.py"
    spec = importlib.util.spec_from_file_location("_spectral_ops_build_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bc = _load_build_config()
ENV = dict(os.environ)
try:
    NVCC = bc.find_nvcc(ENV)
    BUILD_CUDA, REASON = bc.cuda_build_decision(ENV, NVCC)
    ARCHS = bc.parse_cuda_archs(ENV) if BUILD_CUDA else []
except bc.BuildConfigError as exc:
    sys.exit(f"spectral-ops: {exc}")


def _nvcc_version():
    if NVCC is None:
        return None
    try:
        output = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return bc.parse_nvcc_version(output)


def _write_build_info(command, *, cuda_built, reason):
    info = bc.build_info(
        cuda_built=cuda_built,
        reason=reason,
        sources_sha256=bc.hash_sources(ROOT / "csrc") if cuda_built else "",
        archs=ARCHS,
        archs_source=bc.cuda_archs_source(ENV),
        nvcc_path=NVCC,
        nvcc_version=_nvcc_version(),
        env=ENV,
    )
    # Editable installs import the source tree, everything else what lands in build_lib.
    in_place = getattr(command, "editable_mode", False) or getattr(command, "inplace", False)
    package_dir = ROOT / "spectral_ops" if in_place else Path(command.build_lib) / "spectral_ops"
    package_dir.mkdir(parents=True, exist_ok=True)
    (package_dir / bc.BUILD_INFO_FILENAME).write_text(json.dumps(info, indent=2) + "\n")


def _find_tool(name):
    # The pip-installed cmake/ninja sit next to the interpreter, which is not always on PATH
    # (e.g. `.venv/bin/pip install --no-build-isolation`).
    scripts = sysconfig.get_path("scripts")
    return shutil.which(name, path=os.pathsep.join([scripts, os.environ.get("PATH", os.defpath)]))


def _discard_stale_cmake_cache(build_dir):
    # CMake keeps the compiler it detected first, and a configure that failed half-way leaves a cache
    # that breaks the next one: start over when either happened (build dirs persist in-tree).
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    compiler = next(
        (line.split("=", 1)[1] for line in cache.read_text().splitlines() if line.startswith("CMAKE_CUDA_COMPILER:")),
        None,
    )
    if compiler != NVCC or not (build_dir / "build.ninja").exists():
        shutil.rmtree(build_dir)


class BuildPy(build_py):
    """Records a build that leaves the extension out (build_ext does not run then)."""

    def run(self):
        super().run()
        if not BUILD_CUDA:
            print(bc.skip_message(REASON), flush=True)
            _write_build_info(self, cuda_built=False, reason=REASON)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class _CudaBuildFailed(Exception):
    pass


class CMakeBuild(build_ext):
    def run(self):
        # build_ext.run() clears `inplace` while it builds; remember it for the build record.
        in_place = self.inplace
        try:
            super().run()
        except _CudaBuildFailed as failure:
            if bc.env_flag(ENV, bc.ENV_REQUIRE_CUDA):
                raise CompileError(f"spectral-ops: {failure}, and {bc.ENV_REQUIRE_CUDA}=1") from failure
            # Nothing was built, so there is nothing to copy in place or to list as an output.
            self.extensions = []
            self.inplace = in_place
            print(bc.skip_message(str(failure)), flush=True)
            _write_build_info(self, cuda_built=False, reason=str(failure))
        else:
            _write_build_info(self, cuda_built=True, reason="")

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        # A module left over from an earlier build must not ship with a build that fell back.
        target.unlink(missing_ok=True)
        try:
            import pybind11
        except ImportError as exc:
            raise _CudaBuildFailed("pybind11 is not installed in the build environment") from exc
        cmake, ninja = _find_tool("cmake"), _find_tool("ninja")
        if cmake is None or ninja is None:
            raise _CudaBuildFailed(
                "cmake and ninja must be installed in the build environment (pip install cmake ninja)"
            )
        build_dir = self._cmake_build_dir()
        _discard_stale_cmake_cache(build_dir)
        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={NVCC}",
            f"-DCMAKE_CUDA_ARCHITECTURES={bc.cmake_arch_string(ARCHS)}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DSPECTRAL_OPS_PTXAS_VERBOSE={'ON' if bc.env_flag(ENV, bc.ENV_PTXAS_VERBOSE) else 'OFF'}",
        ]
        for step, command in (("configure", configure), ("build", [cmake, "--build", str(build_dir)])):
            try:
                subprocess.run(command, check=True)
            except subprocess.CalledProcessError as exc:
                raise _CudaBuildFailed(
                    f"the CUDA build failed: CMake {step} exited with status {exc.returncode} (its output is above)"
                ) from exc
            except OSError as exc:
                raise _CudaBuildFailed(f"the CUDA build failed: cannot run CMake {step} ({exc})") from exc
        if not target.exists():
            raise _CudaBuildFailed(f"the CUDA build did not produce {target}")

    def _cmake_build_dir(self):
        # Editable builds get a throw-away build_temp from setuptools; a fixed folder keeps
        # `pip install -e .` incremental while csrc/ is being worked on.
        if self.editable_mode:
            return ROOT / "build" / f"cmake-editable-{sys.implementation.cache_tag}"
        return Path(self.build_temp).resolve() / "cmake"


setup(
    # triton_kernels/ is a top-level folder in the repository but installs only as
    # spectral_ops.triton_kernels: other distributions own the top-level name `triton_kernels`.
    packages=find_packages(include=["spectral_ops", "spectral_ops.*"])
    + [f"spectral_ops.{name}" for name in find_packages(include=["triton_kernels", "triton_kernels.*"])],
    package_dir={"spectral_ops.triton_kernels": "triton_kernels"},
    ext_modules=[CMakeExtension("spectral_ops._C")] if BUILD_CUDA else [],
    cmdclass={"build_py": BuildPy, "build_ext": CMakeBuild},
)
