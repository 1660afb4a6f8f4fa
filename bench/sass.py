"""What nvcc (or Triton) made of a kernel: resource usage and SASS opcodes read with ``cuobjdump``.

Works on anything cuobjdump reads: a cubin, a fatbin, an object file or a shared library with
embedded device code (``spectral_ops/_C*.so``). No GPU is needed.

API (stable: ``bench/gpu_checks/compile_only.py`` and ``tests/test_cuda_sass.py`` use it):

``find_cuobjdump(env=None) -> str | None``
    ``$CUOBJDUMP``, then ``cuobjdump`` on ``PATH``, next to ``nvcc`` (``$NVCC``, ``PATH``,
    ``/usr/local/cuda/bin``), then the copy Triton ships (``triton/backends/nvidia/bin``).
``tool_label(path, version=None) -> str``
    How a report names a CUDA binary tool: ``"cuobjdump 12.8 (bundled with triton 3.7.0)"`` or
    ``"... (CUDA toolkit)"``, its version from ``--version`` unless given; never the path it ran from.
``resource_usage(path, *, arch=None, cuobjdump=None) -> {kernel: {"registers", "stack", "shared",
"local", "constant", ...}}``
    From ``cuobjdump -res-usage``: one dict per kernel (its mangled name), the values ints (bytes,
    apart from ``registers``). Every ``KEY:VALUE`` field of the line is kept, lower-cased, with
    ``REG`` renamed ``registers`` and ``CONSTANT[0]`` ``constant``.
``sass_listing(path, *, arch=None, cuobjdump=None) -> {kernel: [(address, predicated, opcode, operands), ...]}``
    From ``cuobjdump -sass``: each kernel's instructions in order, the full opcode with its modifiers
    and without the predicate (``"LDSM.16.MT88.4"``, ``"HMMA.16816.F32.BF16"``), whether a predicate
    guards it, and its operands (a branch's target last: ``"0x1c30"``).
``sass_instructions(path, *, arch=None, cuobjdump=None) -> {kernel: [opcode, ...]}``
    The opcodes of ``sass_listing``.
``module_kernels(path, arch, *, cuobjdump=None) -> {demangled kernel: {"usage": {...}, "listing": [...]}}``
    ``resource_usage`` and ``sass_listing`` of one arch of a built module, cached by the module's
    SHA-256 under the package's cache directory (``sass/``): disassembling ``spectral_ops/_C*.so`` takes
    seconds per arch, and its readers (``tests/test_cuda_sass.py``, the GPU check's ``--compile-only``)
    share one disassembly per build.
``base_opcode(opcode) -> str``
    ``"LDSM.16.MT88.4" -> "LDSM"``.
``opcode_counts(opcodes) -> collections.Counter``
    How often each base opcode occurs.
``features(opcodes) -> {"HGMMA": n, "HMMA": n, "TMA": n, "LDGSTS": n, "LDL/STL": n}``
    How many instructions of each kind that decides a kernel's speed: Hopper's warpgroup MMA
    (wgmma), Ampere's warp MMA (mma.sync), the tensor-memory-accelerator copies (``UTMALDG``,
    ``UTMASTG``, ... and the bulk copy ``UBLKCP``), cp.async (``LDGSTS``) and local-memory accesses.
``demangle(names) -> {mangled: demangled}``
    Through ``c++filt`` when it exists; names it cannot demangle map to themselves.
``matching(table, *substrings) -> {kernel: value}``
    The entries of a table above whose demangled (or raw) name contains every substring.
``spill_report(usage, instructions) -> {kernel: reason}``
    Kernels with a stack frame or any local-memory access (``LDL``/``STL``), the
    usual sign of register spills; the reason says which.

``arch`` (``"sm_90"``) selects one architecture of a fat binary (``cuobjdump -arch``). Without it a
file that holds the same kernel for several architectures raises ``ValueError``: a merged table
would silently mix them.

Run as a script, it prints one line per kernel: ``python bench/sass.py FILE [--arch sm_90]``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Mapping

# "Fatbin elf code:" sections of -res-usage name their arch on an "arch = sm_90" line; -sass output
# has "code for sm_90" (a bare cubin has only the latter).
_ARCH = re.compile(r"^\s*(?:arch = |code for )(sm_\w+)")
_USAGE_FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
_USAGE_FIELD = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")
_SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
# "/*0a40*/   @!P0 BRA 0x1c30 ;" -> address, predicate, opcode, operands
_SASS_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_FIELD_NAMES = {"REG": "registers", "CONSTANT[0]": "constant"}
# Local-memory opcodes: spilled registers and stack-allocated arrays both live there.
_LOCAL_OPCODES = {"LDL", "STL"}
# sm90's tensor memory accelerator: tiled loads, stores, prefetches and reductions, and bulk copies.
TMA_OPCODES = {"UTMALDG", "UTMASTG", "UTMAPF", "UTMAREDG", "UTMACCTL", "UBLKCP", "UBLKRED", "UBLKPF"}


def find_cuobjdump(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    if env.get("CUOBJDUMP"):
        return env["CUOBJDUMP"]
    search = env.get("PATH", os.defpath)
    found = shutil.which("cuobjdump", path=search)
    if found:
        return found
    nvcc_dirs = [Path(p).resolve().parent for p in (env.get("NVCC"), shutil.which("nvcc", path=search)) if p]
    for directory in [*nvcc_dirs, Path("/usr/local/cuda/bin")]:
        candidate = directory / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    # Triton bundles the CUDA binary tools; find_spec locates it without importing triton.
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidate = Path(root) / "backends" / "nvidia" / "bin" / "cuobjdump"
            if candidate.is_file():
                return str(candidate)
    return None


def tool_label(path: str | os.PathLike, version: str | None = None) -> str:
    """``"NAME VERSION (ORIGIN)"`` for a CUDA binary tool at ``path``: a report says which tool made it and
    which release, not where the writer's machine keeps it (a path names a local venv or home folder)."""
    path = Path(path)
    if version is None:
        try:
            text = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60).stdout
        except OSError:
            text = ""
        found = re.search(r"release (\d+\.\d+)", text)
        version = found.group(1) if found else "(version unknown)"
    if "triton" in path.parts:
        origin = f"bundled with triton {importlib.metadata.version('triton')}"
    else:
        origin = "CUDA toolkit"
    return f"{path.name} {version} ({origin})"


def _run(kind: str, path: str | os.PathLike, arch: str | None, cuobjdump: str | None) -> str:
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump was not found (set $CUOBJDUMP, or put the CUDA toolkit on PATH)")
    command = [tool, kind, *(["-arch", arch] if arch else []), str(path)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _store(table: dict, seen_arch: dict, name: str, arch: str | None, value) -> None:
    if name in table and seen_arch.get(name) != arch:
        raise ValueError(f"{name} is in the file for {seen_arch.get(name)} and {arch}: pass arch=")
    table[name] = value
    seen_arch[name] = arch


def resource_usage(path: str | os.PathLike, *, arch: str | None = None,
                   cuobjdump: str | None = None) -> dict[str, dict[str, int]]:
    usage: dict[str, dict[str, int]] = {}
    seen_arch: dict[str, str | None] = {}
    current_arch = None
    pending = None  # the function whose field line comes next
    for line in _run("-res-usage", path, arch, cuobjdump).splitlines():
        if m := _ARCH.match(line):
            current_arch = m.group(1)
        elif m := _USAGE_FUNCTION.match(line):
            pending = m.group(1)
        elif pending is not None and (fields := _USAGE_FIELD.findall(line)):
            record = {_FIELD_NAMES.get(key, key.lower()): int(value) for key, value in fields}
            _store(usage, seen_arch, pending, current_arch, record)
            pending = None
    return usage


def sass_listing(path: str | os.PathLike, *, arch: str | None = None,
                 cuobjdump: str | None = None) -> dict[str, list[tuple[int, bool, str, str]]]:
    code: dict[str, list[tuple[int, bool, str, str]]] = {}
    seen_arch: dict[str, str | None] = {}
    current_arch = None
    current: list | None = None
    for line in _run("-sass", path, arch, cuobjdump).splitlines():
        if m := _ARCH.match(line):
            current_arch, current = m.group(1), None
        elif m := _SASS_FUNCTION.match(line):
            current = []
            _store(code, seen_arch, m.group(1), current_arch, current)
        elif current is not None and (m := _SASS_INSTRUCTION.match(line)):
            address, predicate, opcode, operands = m.groups()
            current.append((int(address, 16), predicate is not None, opcode, operands.strip()))
    return code


def sass_instructions(path: str | os.PathLike, *, arch: str | None = None,
                      cuobjdump: str | None = None) -> dict[str, list[str]]:
    return {name: [opcode for _, _, opcode, _ in listing]
            for name, listing in sass_listing(path, arch=arch, cuobjdump=cuobjdump).items()}


def module_kernels(path: str | os.PathLike, arch: str, *, cuobjdump: str | None = None) -> dict[str, dict]:
    from spectral_ops import environment

    path = Path(path)
    # "-kernels": the tables cached before this function (opcodes and hot loops, by the test) were "{arch}.json".
    folder = environment.cache_dir() / "sass" / hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    cached = folder / f"{arch}-kernels.json"
    if not cached.exists():
        usage = resource_usage(path, arch=arch, cuobjdump=cuobjdump)
        listing = sass_listing(path, arch=arch, cuobjdump=cuobjdump)
        names = demangle(usage)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")  # two readers (suites, workers) may write at once
        partial.write_text(json.dumps({names[name]: {"usage": usage[name], "listing": listing.get(name, [])}
                                       for name in usage}))
        partial.replace(cached)
    return json.loads(cached.read_text())


def base_opcode(opcode: str) -> str:
    return opcode.split(".", 1)[0]


def opcode_counts(opcodes: Iterable[str]) -> collections.Counter:
    return collections.Counter(base_opcode(op) for op in opcodes)


def features(opcodes: Iterable[str]) -> dict[str, int]:
    counts = opcode_counts(opcodes)
    return {"HGMMA": counts["HGMMA"], "HMMA": counts["HMMA"], "TMA": sum(counts[op] for op in TMA_OPCODES),
            "LDGSTS": counts["LDGSTS"], "LDL/STL": sum(counts[op] for op in _LOCAL_OPCODES)}


def demangle(names: Iterable[str]) -> dict[str, str]:
    names = list(names)
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {name: name for name in names}
    result = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True)
    lines = result.stdout.splitlines()
    if result.returncode != 0 or len(lines) != len(names):
        return {name: name for name in names}
    return dict(zip(names, lines))


def matching(table: Mapping[str, object], *substrings: str) -> dict:
    readable = demangle(table)
    return {name: value for name, value in table.items()
            if all(s in readable[name] or s in name for s in substrings)}


def spill_report(usage: Mapping[str, Mapping[str, int]],
                 instructions: Mapping[str, list[str]]) -> dict[str, str]:
    report = {}
    for name in sorted(set(usage) | set(instructions)):
        reasons = []
        stack = usage.get(name, {}).get("stack", 0)
        if stack:
            reasons.append(f"{stack}-byte stack frame")
        local = {op: n for op, n in sorted(opcode_counts(instructions.get(name, [])).items()) if op in _LOCAL_OPCODES}
        if local:
            reasons.append("local memory: " + ", ".join(f"{n} {op}" for op, n in local.items()))
        if reasons:
            report[name] = "; ".join(reasons)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--arch", help="one architecture of a fat binary, e.g. sm_90")
    args = parser.parse_args(argv)
    usage = resource_usage(args.file, arch=args.arch)
    code = sass_instructions(args.file, arch=args.arch)
    spills = spill_report(usage, code)
    names = demangle(usage)
    for name in sorted(usage, key=names.get):
        u = usage[name]
        counts = opcode_counts(code.get(name, []))
        print(f"{names[name]}: {u['registers']} regs, {u.get('stack', 0)} B stack, {u.get('shared', 0)} B static "
              f"shared, {counts['LDSM']} LDSM, {counts['LDGSTS']} LDGSTS, {counts['HMMA']} HMMA"
              + (f"  SPILLS ({spills[name]})" if name in spills else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
