"""Build-time decisions for the optional CUDA extension ``spectral_ops._C``.

``setup.py`` loads this file by path, before the package is installed and possibly in a build
environment without torch, so it must only use the standard library and must not import its package.
The tests load it the same way.

Environment variables:

* ``SPECTRAL_OPS_NO_CUDA=1``: build the pure-Python package only.
* ``SPECTRAL_OPS_REQUIRE_CUDA=1``: a missing nvcc or a failed CUDA build is an error (for wheel builders).
* ``SPECTRAL_OPS_CUDA_ARCHS``: target architectures, e.g. ``80;90``, ``80,90``, ``sm_80 sm_90a``.
  Plain entries get SASS and the newest one also gets PTX, so the module JIT-compiles on GPUs newer
  than the build. Once any entry is explicit (``90+PTX``, ``90-real``, ``90-virtual``, ``compute_90``)
  the whole list is taken literally.
* ``TORCH_CUDA_ARCH_LIST``: used when the variable above is unset, with PyTorch's meaning
  (``8.0;9.0+PTX``, ``8.0 9.0``): SASS for each entry, PTX only where ``+PTX`` says so.
* ``SPECTRAL_OPS_PTXAS_VERBOSE=1``: print register and spill counts of every kernel (``-Xptxas -v``).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

ENV_NO_CUDA = "SPECTRAL_OPS_NO_CUDA"
ENV_REQUIRE_CUDA = "SPECTRAL_OPS_REQUIRE_CUDA"
ENV_CUDA_ARCHS = "SPECTRAL_OPS_CUDA_ARCHS"
ENV_TORCH_ARCHS = "TORCH_CUDA_ARCH_LIST"
ENV_PTXAS_VERBOSE = "SPECTRAL_OPS_PTXAS_VERBOSE"

BUILD_INFO_FILENAME = "_build_info.json"

# The oldest architecture CUDA 13 can target; older numbers are typos, not wishes.
MIN_CUDA_ARCH = 75


class BuildConfigError(ValueError):
    """A build setting that cannot be honoured; the build stops with this message."""


class CudaArch(NamedTuple):
    """One target: ``name`` as nvcc spells it after ``sm_`` (``"90"``, ``"90a"``), and what to embed."""

    name: str
    sass: bool
    ptx: bool

    @property
    def number(self) -> int:
        return int(self.name.rstrip("af"))


DEFAULT_CUDA_ARCHS = (CudaArch("80", sass=True, ptx=False), CudaArch("90", sass=True, ptx=True))

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

_ARCH_ENTRY = re.compile(
    r"(?P<prefix>sm_|compute_)?"
    r"(?:(?P<major>\d{1,2})\.(?P<minor>\d)|(?P<plain>\d{2,3}))"
    r"(?P<variant>[af]?)"
    r"(?P<suffix>\+PTX|-real|-virtual)?",
    re.IGNORECASE,
)


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """A boolean environment variable; a value that is neither clearly on nor off is an error."""
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise BuildConfigError(f"{name}={env[name]!r} is not a boolean (use 1 or 0)")


def parse_cuda_arch_list(text: str, *, source: str, ptx_for_newest: bool) -> list[CudaArch]:
    """Parse one architecture list; ``source`` names the variable in error messages."""
    entries = [token for token in re.split(r"[;,\s]+", text.strip()) if token]
    if not entries:
        raise BuildConfigError(f"{source}={text!r} lists no CUDA architecture")
    merged: dict[str, CudaArch] = {}
    explicit = False
    for token in entries:
        arch, token_explicit = _parse_arch_entry(token, source)
        explicit = explicit or token_explicit
        seen = merged.get(arch.name)
        merged[arch.name] = arch if seen is None else CudaArch(arch.name, seen.sass or arch.sass, seen.ptx or arch.ptx)
    archs = sorted(merged.values(), key=lambda a: (a.number, a.name))
    if ptx_for_newest and not explicit:
        archs[-1] = archs[-1]._replace(ptx=True)
    return archs


def _parse_arch_entry(token: str, source: str) -> tuple[CudaArch, bool]:
    match = _ARCH_ENTRY.fullmatch(token)
    if match is None:
        raise BuildConfigError(
            f"{source}: cannot read {token!r} as a CUDA architecture; "
            "write e.g. 80, sm_90a, 8.0, 9.0+PTX, 90-real or 90-virtual"
        )
    prefix = (match["prefix"] or "").lower()
    suffix = (match["suffix"] or "").lower()
    digits = match["plain"] or f"{match['major']}{match['minor']}"
    name = digits + match["variant"].lower()
    if int(digits) < MIN_CUDA_ARCH:
        raise BuildConfigError(
            f"{source}: {token!r} is older than sm_{MIN_CUDA_ARCH}, the oldest target CUDA 13 supports"
        )
    if prefix == "compute_":
        if suffix:
            raise BuildConfigError(f"{source}: {token!r} mixes compute_ (PTX only) with the suffix {suffix!r}")
        return CudaArch(name, sass=False, ptx=True), True
    if prefix == "sm_" and suffix == "-virtual":
        raise BuildConfigError(f"{source}: {token!r} asks for SASS (sm_) and for PTX only (-virtual)")
    if suffix == "-virtual":
        return CudaArch(name, sass=False, ptx=True), True
    return CudaArch(name, sass=True, ptx=suffix == "+ptx"), bool(suffix)


def cuda_archs_source(env: Mapping[str, str]) -> str:
    """The variable the architectures come from, or ``"default"``."""
    for name in (ENV_CUDA_ARCHS, ENV_TORCH_ARCHS):
        if env.get(name, "").strip():
            return name
    return "default"


def parse_cuda_archs(env: Mapping[str, str]) -> list[CudaArch]:
    """The architectures to build for: SPECTRAL_OPS_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST, else the default."""
    source = cuda_archs_source(env)
    if source == "default":
        return list(DEFAULT_CUDA_ARCHS)
    return parse_cuda_arch_list(env[source], source=source, ptx_for_newest=source == ENV_CUDA_ARCHS)


def cmake_arch_string(archs: list[CudaArch]) -> str:
    """CMAKE_CUDA_ARCHITECTURES form: ``80-real`` is SASS only, ``90-virtual`` PTX only, ``90`` both."""
    parts = []
    for arch in archs:
        if arch.sass and arch.ptx:
            parts.append(arch.name)
        elif arch.sass:
            parts.append(f"{arch.name}-real")
        else:
            parts.append(f"{arch.name}-virtual")
    return ";".join(parts)


def arch_names(archs: list[CudaArch]) -> list[str]:
    """What the module embeds, spelled as ``spectral_ops._C.compiled_archs()`` reports it:
    ``sm_90`` for SASS, ``compute_90`` for PTX."""
    names = []
    for arch in archs:
        if arch.sass:
            names.append(f"sm_{arch.name}")
        if arch.ptx:
            names.append(f"compute_{arch.name}")
    return names


def find_nvcc(env: Mapping[str, str], default_roots: tuple[str, ...] = ("/usr/local/cuda",)) -> str | None:
    """nvcc from CUDACXX (which CMake would honour anyway), else PATH, else <root>/bin for CUDA_HOME,
    CUDA_PATH and the default install location, as torch.utils.cpp_extension searches."""
    path = env.get("PATH", os.defpath)
    if env.get("CUDACXX"):
        return shutil.which(env["CUDACXX"], path=path)
    found = shutil.which("nvcc", path=path)
    if found:
        return found
    roots = [env[var] for var in ("CUDA_HOME", "CUDA_PATH") if env.get(var)] + list(default_roots)
    for root in roots:
        candidate = shutil.which(os.path.join(root, "bin", "nvcc"))
        if candidate:
            return candidate
    return None


def cuda_build_decision(env: Mapping[str, str], nvcc_path: str | None) -> tuple[bool, str]:
    """Whether to build the CUDA extension, and why (the reason is user-facing when the answer is no).

    Raises BuildConfigError when SPECTRAL_OPS_REQUIRE_CUDA=1 cannot be honoured.
    """
    no_cuda = env_flag(env, ENV_NO_CUDA)
    require_cuda = env_flag(env, ENV_REQUIRE_CUDA)
    if no_cuda and require_cuda:
        raise BuildConfigError(f"{ENV_NO_CUDA}=1 and {ENV_REQUIRE_CUDA}=1 contradict each other")
    if no_cuda:
        return False, f"{ENV_NO_CUDA}=1"
    if nvcc_path is None:
        if env.get("CUDACXX"):
            reason = f"CUDACXX={env['CUDACXX']} is not an executable"
        else:
            reason = "no nvcc found (looked in CUDACXX, PATH, CUDA_HOME/bin, CUDA_PATH/bin, /usr/local/cuda/bin)"
        if require_cuda:
            raise BuildConfigError(f"{ENV_REQUIRE_CUDA}=1 but {reason}")
        return False, reason
    return True, f"nvcc found at {nvcc_path}"


def skip_message(reason: str) -> str:
    """The one line a build prints when it leaves the CUDA extension out."""
    return f"spectral-ops: building without the CUDA extension: {reason}"


def parse_nvcc_version(text: str) -> str | None:
    """``13.0.88`` from the output of ``nvcc --version``."""
    match = re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", text)
    return match.group(1) if match else None


def hash_sources(csrc: Path) -> str:
    """The SHA-256 of the CUDA sources: every file of ``csrc`` (the checkout's ``csrc/``), by name and content.
    The build record keeps it, so a reader of the built module's code (tests/test_cuda_sass.py) can tell
    a module compiled from the checkout's sources from a stale one."""
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def build_info(
    *,
    cuda_built: bool,
    reason: str,
    sources_sha256: str,
    archs: list[CudaArch],
    archs_source: str,
    nvcc_path: str | None,
    nvcc_version: str | None,
    env: Mapping[str, str],
) -> dict:
    """The record written to ``spectral_ops/_build_info.json``."""
    # SOURCE_DATE_EPOCH keeps reproducible-build tooling working.
    epoch = env.get("SOURCE_DATE_EPOCH")
    when = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
        if epoch
        else datetime.datetime.now(datetime.timezone.utc)
    )
    return {
        "cuda_built": cuda_built,
        "reason": reason,
        "archs": arch_names(archs) if cuda_built else [],
        "cmake_cuda_architectures": cmake_arch_string(archs) if cuda_built else "",
        "archs_source": archs_source if cuda_built else "",
        "nvcc": nvcc_path,
        "nvcc_version": nvcc_version,
        "sources_sha256": sources_sha256,
        "built_at": when.isoformat(timespec="seconds"),
    }
