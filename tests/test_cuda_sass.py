"""What nvcc makes of the CUDA kernels for sm_90, read from the SASS: the only performance check that
runs without a GPU, so it is strict.

Every csrc/*.cu is compiled to an sm_90 cubin as the CMake build compiles it (-O3; gemm.cu and
syrk.cu instantiate every tiled variant: 5 math modes x 2 grids x 4 operand layouts), cached under
build/sass/ by the hash of the sources, flags and nvcc version (the first, uncached run takes about
40 s on 2 cores, later ones well under a second), and read with cuobjdump through bench/sass.py. Checked:
  * no kernel spills (stack frame 0, no LDL/STL) but those in SPILL_EXCEPTIONS, each with its reason;
  * the tiled kernels fit their launch bounds: registers * kThreads * kMinBlocks <= 65536;
  * the tensor-core mainloops: fp16 and bf16 read every fragment with ldmatrix (LDSM), tf32 with
    ldmatrix wherever an operand is k-contiguous, and all of them fill shared memory with cp.async
    (LDGSTS); the FMA mode uses neither.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from spectral_ops.build_config import ENV_REQUIRE_CUDA, env_flag, find_nvcc

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
CACHE = ROOT / "build" / "sass"
ARCH = "sm_90"
FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", f"-arch={ARCH}", "-cubin", f"-I{CSRC}"]
REGISTERS_PER_SM = 65536

_spec = importlib.util.spec_from_file_location("sass", ROOT / "bench" / "sass.py")
sass = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sass
_spec.loader.exec_module(sass)

# Demangled-name substring -> why the kernel may keep a stack frame. Not register pressure, else the
# kernel would need fixing instead.
SPILL_EXCEPTIONS = {}

NVCC = find_nvcc(dict(os.environ))
CUOBJDUMP = sass.find_cuobjdump()


def source_constant(name: str) -> int:
    """A `constexpr int` of csrc/tiled_matmul.cuh, read from the source so the test cannot drift from it."""
    match = re.search(rf"constexpr int {name} = (\d+);", (CSRC / "tiled_matmul.cuh").read_text())
    assert match, f"{name} not found in csrc/tiled_matmul.cuh"
    return int(match.group(1))


def math_modes() -> list[str]:
    """MathMode's enumerators in order (csrc/matmul.h): a kernel's template argument is their index."""
    body = re.search(r"enum class MathMode : int \{(.*?)\};", (CSRC / "matmul.h").read_text(), re.S).group(1)
    return re.findall(r"^\s*(k\w+),", body, re.M)


def compile_cubin(source: Path) -> Path:
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(" ".join([version, *FLAGS]).encode())
    for path in sorted(CSRC.glob("*")):
        digest.update(path.name.encode() + path.read_bytes())
    target = CACHE / digest.hexdigest()[:16] / f"{source.stem}.cubin"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        result = subprocess.run([NVCC, *FLAGS, str(source), "-o", str(partial)], capture_output=True, text=True)
        assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr}"
        partial.replace(target)
    return target


def read_cubin(source: Path) -> dict:
    """{demangled kernel name: [resource usage, opcodes]} of one source's cubin, cached beside it
    (disassembling the tiled kernels takes seconds)."""
    cubin = compile_cubin(source)
    cached = cubin.with_suffix(".json")
    if not cached.exists():
        usage = sass.resource_usage(cubin, cuobjdump=CUOBJDUMP)
        code = sass.sass_instructions(cubin, cuobjdump=CUOBJDUMP)
        names = sass.demangle(usage)
        partial = cached.with_suffix(".partial.json")
        partial.write_text(json.dumps({names[name]: [usage[name], code[name]] for name in usage}))
        partial.replace(cached)
    return json.loads(cached.read_text())


@pytest.fixture(scope="module")
def kernels():
    """{demangled kernel name: (resource usage, opcodes)} over every csrc/*.cu."""
    if NVCC is None:
        pytest.skip("nvcc not found: no SASS to check (CI has it)")
    if CUOBJDUMP is None:
        message = "cuobjdump not found (CUDA toolkit or Triton's copy; see bench/sass.py find_cuobjdump)"
        if env_flag(os.environ, ENV_REQUIRE_CUDA):
            pytest.fail(f"{ENV_REQUIRE_CUDA}=1 and nvcc is here, but {message}")
        pytest.skip(message)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        tables = list(pool.map(read_cubin, sorted(CSRC.glob("*.cu"))))
    return {name: tuple(entry) for table in tables for name, entry in table.items()}


def tiled(kernels):
    """{(mode name, triangular, a k-contiguous, b k-contiguous): (usage, opcodes)} of matmul_kernel."""
    modes = math_modes()
    pattern = re.compile(r"matmul_kernel<\(spectral_ops::MathMode\)(\d+), (true|false), (true|false), (true|false)>")
    variants = {}
    for name, entry in kernels.items():
        if match := pattern.search(name):
            mode, *flags = match.groups()
            variants[(modes[int(mode)], *(flag == "true" for flag in flags))] = entry
    return variants


def test_every_tiled_variant_is_compiled(kernels):
    assert len(tiled(kernels)) == len(math_modes()) * 2 * 2 * 2


def test_no_kernel_spills(kernels):
    spills = sass.spill_report({name: usage for name, (usage, _) in kernels.items()},
                               {name: code for name, (_, code) in kernels.items()})
    unexpected = {name: why for name, why in spills.items() if not any(key in name for key in SPILL_EXCEPTIONS)}
    assert not unexpected, "kernels that spill:\n" + "\n".join(f"{n}: {why}" for n, why in unexpected.items())
    stale = [key for key in SPILL_EXCEPTIONS if not any(key in name for name in spills)]
    assert not stale, f"no longer spill, remove them from SPILL_EXCEPTIONS: {stale}"


def test_tiled_kernels_fit_their_launch_bounds(kernels):
    threads, min_blocks = source_constant("kThreads"), source_constant("kMinBlocks")
    assert min_blocks >= 2, "two blocks per SM: one leaves the SM idle at each block's barriers and epilogue"
    over = {variant: usage["registers"] for variant, (usage, _) in tiled(kernels).items()
            if usage["registers"] * threads * min_blocks > REGISTERS_PER_SM}
    assert not over, f"more registers than {min_blocks} blocks of {threads} threads leave: {over}"


def test_tensor_core_mainloops_use_ldmatrix_and_cp_async(kernels):
    for (mode, triangular, a_k, b_k), (_, code) in tiled(kernels).items():
        counts = sass.opcode_counts(code)
        variant = f"{mode} triangular={triangular} a_k={a_k} b_k={b_k}"
        if mode == "kFma":
            assert counts["LDSM"] == counts["LDGSTS"] == counts["HMMA"] == 0, variant
            continue
        assert counts["LDGSTS"] > 0, f"{variant}: no cp.async"
        assert counts["HMMA"] > 0, f"{variant}: no tensor-core MMA"
        # Per k step a warp loads 4 A and 2 B fragment blocks for 16 MMA tiles (each 3 MMAs in
        # 3xTF32). 16-bit blocks always come by ldmatrix; tf32 ones where their slab is k-contiguous.
        sixteen_bit = mode in ("kHalf", "kBf16")
        blocks = 6 if sixteen_bit else 4 * a_k + 2 * b_k
        mmas = 16 * (3 if mode == "kTf32x3" else 1)
        assert counts["LDSM"] * mmas >= counts["HMMA"] * blocks, f"{variant}: fragments not from ldmatrix"
        if blocks == 0:
            assert counts["LDSM"] == 0, f"{variant}: ldmatrix on an fp32 [k][128] slab"


def test_features_count_hopper_and_ampere_mma_tma_and_local_memory():
    """bench/gpu_check.py --compile-only's SASS columns, from opcodes as cuobjdump prints them."""
    opcodes = ["HGMMA.64x128x16.F32.BF16", "HGMMA.64x128x16.F32.BF16", "UTMALDG.2D", "UBLKCP.S.G", "LDGSTS.E.128",
               "HMMA.16816.F32.BF16", "STL.64", "LDL.64", "LDL", "FFMA"]
    assert sass.features(opcodes) == {"HGMMA": 2, "HMMA": 1, "TMA": 2, "LDGSTS": 1, "LDL/STL": 3}
