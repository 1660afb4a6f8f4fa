"""What nvcc makes of the CUDA kernels for sm_90 and sm_80, read from the SASS: the only performance
check that runs without a GPU, so it is strict.

The code read is the built extension's own (spectral_ops/_C*.so: every csrc/*.cu compiled by the CMake
build, -O3, for sm_80 and sm_90), disassembled with cuobjdump through bench/sass.py: nothing is compiled
here. The build record (spectral_ops/_build_info.json) names the sources the module was built from, so a
module older than csrc/ is refused, not read (`make test` reinstalls whenever csrc/ changes). What is
read is cached under the package's cache directory (spectral_ops.environment.cache_dir(), in sass/) by
the module's hash (bench/sass.py's module_kernels, which the GPU check's --compile-only reads too):
disassembling it takes seconds per arch. Checked, on both archs:
  * no kernel spills (stack frame 0, no LDL/STL) but those in SPILL_EXCEPTIONS, each with its reason;
  * the tiled kernels (every variant: 5 math modes x 2 grids x 4 operand layouts) fit their launch
    bounds: registers * threads * kMinBlocks <= 65536;
  * the tensor-core mainloops: fp16 and bf16 read every fragment with ldmatrix (LDSM), tf32 with
    ldmatrix wherever an operand is k-contiguous, and all of them fill shared memory with cp.async
    (LDGSTS); the FMA mode uses neither;
  * the instruction mix of the hot loop (hot_loop below: the steady-state path of an interior tile
    through the main loop): its share of HMMA, ldmatrix per HMMA as 64 x 64 warp tiles need, and no
    fragment copies (MOV).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

import pytest

from spectral_ops import _extension
from spectral_ops.build_config import ENV_REQUIRE_CUDA, env_flag, hash_sources

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
ARCHS = ("sm_90", "sm_80")
REGISTERS_PER_SM = 65536

_spec = importlib.util.spec_from_file_location("sass", ROOT / "bench" / "sass.py")
sass = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sass
_spec.loader.exec_module(sass)

# Demangled-name substring -> why the kernel may keep a stack frame. Not register pressure, else the
# kernel would need fixing instead.
SPILL_EXCEPTIONS = {}

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


# A branch's target, its last operand: "0x1c30".
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


def basic_blocks(code):
    """[(first, end) instruction index] and the successor block indices of each."""
    index = {address: i for i, (address, *_) in enumerate(code)}
    leaders = {0}
    for i, (_, _, opcode, operands) in enumerate(code):
        if opcode.startswith(("BRA", "EXIT", "RET", "BRX", "CALL")):
            if opcode.startswith("BRA") and (target := _TARGET.search(operands)):
                leaders.add(index[int(target.group(1), 16)])
            leaders.add(i + 1)
    starts = sorted(leader for leader in leaders if leader < len(code))
    blocks = list(zip(starts, starts[1:] + [len(code)]))
    block_of = {first: b for b, (first, _) in enumerate(blocks)}
    successors = []
    for b, (_, end) in enumerate(blocks):
        _, predicated, opcode, operands = code[end - 1]
        conditional = predicated or "," in operands  # a uniform-predicate branch names it as an operand
        target = _TARGET.search(operands) if opcode.startswith("BRA") else None
        nexts = [block_of[index[int(target.group(1), 16)]]] if target else []
        if not (target or opcode.startswith(("EXIT", "RET"))) or conditional:
            nexts.append(b + 1)  # falls through (a CALL returns)
        successors.append([n for n in nexts if n < len(blocks)])
    return blocks, successors


def hot_loop(code) -> list[str]:
    """The opcodes a warp issues per iteration of the main loop in the steady state of an interior
    tile. The main loop is the innermost loop (a back edge latch -> header) around the HMMAs; through
    its blocks (a DAG without the back edge) the hot path is the one with the most HMMA, then the most
    LDGSTS (the iterations that issue a slab), then the fewest instructions (the interior path skips
    the checked one's edge tests and conversions)."""
    blocks, successors = basic_blocks(code)

    def count(b, prefix):
        return sum(code[i][2].startswith(prefix) for i in range(*blocks[b]))

    loops = [(header, latch) for latch in range(len(blocks)) for header in successors[latch]
             if header <= latch and any(count(b, "HMMA") for b in range(header, latch + 1))]
    if not loops:
        return []
    header, latch = min(loops, key=lambda loop: loop[1] - loop[0])
    best = {header: ((count(header, "HMMA"), count(header, "LDGSTS"), header - blocks[header][1]), [header])}
    for b in range(header, latch + 1):
        if b not in best:
            continue
        (hmma, ldgsts, negative_size), path = best[b]
        for n in successors[b]:
            if b < n <= latch:
                score = (hmma + count(n, "HMMA"), ldgsts + count(n, "LDGSTS"),
                         negative_size - (blocks[n][1] - blocks[n][0]))
                if n not in best or score > best[n][0]:
                    best[n] = (score, path + [n])
    return [code[i][2] for b in best[latch][1] for i in range(*blocks[b])]


def unavailable(why: str) -> NoReturn:
    """No SASS to read: a failure where the CUDA build is required (`make test` wherever nvcc is), else a skip."""
    if env_flag(os.environ, ENV_REQUIRE_CUDA):
        pytest.fail(f"{ENV_REQUIRE_CUDA}=1, but {why}")
    pytest.skip(why)


def built_module(arch: str) -> Path:
    """The extension module built from csrc/ as it is now, with code for ``arch``."""
    info, spec = _extension.build_info(), importlib.util.find_spec("spectral_ops._C")
    if info is None or not info["cuda_built"] or spec is None:
        unavailable("the CUDA extension is not built here: no SASS to read (CI builds it)")
    if info.get("sources_sha256") != hash_sources(CSRC):
        unavailable("the CUDA extension was built from other sources than csrc/ now: rebuild it "
                    "(pip install --no-build-isolation -e ., which `make test` runs when csrc/ changes)")
    if arch not in info["archs"]:
        unavailable(f"the CUDA extension was built for {info['archs']}, without {arch} (SPECTRAL_OPS_CUDA_ARCHS)")
    if CUOBJDUMP is None:
        unavailable("cuobjdump not found (CUDA toolkit or Triton's copy; see bench/sass.py find_cuobjdump)")
    return Path(spec.origin)


def read_module(module: Path, arch: str) -> dict:
    """{demangled kernel name: (resource usage, opcodes, hot-loop opcodes)} of the module's code for
    ``arch``, read through bench/sass.py's cache (one disassembly per build, which the GPU check's
    ``--compile-only`` reads too)."""
    return {name: (kernel["usage"], [opcode for _, _, opcode, _ in kernel["listing"]], hot_loop(kernel["listing"]))
            for name, kernel in sass.module_kernels(module, arch, cuobjdump=CUOBJDUMP).items()}


@pytest.fixture(scope="module", params=ARCHS)
def kernels(request):
    """{demangled kernel name: (resource usage, opcodes, hot-loop opcodes)}: every kernel of the built
    extension for the arch, sm_90 or sm_80 (the one the tiled kernels' main loop is written for)."""
    return read_module(built_module(request.param), request.param)


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
    spills = sass.spill_report({name: usage for name, (usage, *_) in kernels.items()},
                               {name: code for name, (_, code, _) in kernels.items()})
    unexpected = {name: why for name, why in spills.items() if not any(key in name for key in SPILL_EXCEPTIONS)}
    assert not unexpected, "kernels that spill:\n" + "\n".join(f"{n}: {why}" for n, why in unexpected.items())
    stale = [key for key in SPILL_EXCEPTIONS if not any(key in name for name in spills)]
    assert not stale, f"no longer spill, remove them from SPILL_EXCEPTIONS: {stale}"


def test_tiled_kernels_fit_their_launch_bounds(kernels):
    min_blocks = source_constant("kMinBlocks")
    assert min_blocks >= 2, "two blocks per SM: one leaves the SM idle at each block's barriers and epilogue"
    threads = {mode: source_constant("kFmaThreads" if mode == "kFma" else "kMmaThreads") for mode in math_modes()}
    over = {variant: usage["registers"] for variant, (usage, *_) in tiled(kernels).items()
            if usage["registers"] * threads[variant[0]] * min_blocks > REGISTERS_PER_SM}
    assert not over, f"more registers than {min_blocks} blocks per SM leave: {over}"


def fragment_blocks(mode, a_k, b_k):
    """Fragment blocks a warp loads with ldmatrix per k step of its 64 x 64 tile: 4 of A (16 rows each)
    and 4 of B (16 columns each) for 4 x 8 mma tiles. 16-bit blocks always come by ldmatrix; tf32 ones
    where their slab is k-contiguous (else by LDS.32)."""
    return 8 if mode in ("kHalf", "kBf16") else 4 * a_k + 4 * b_k


def mmas_per_tile(mode):
    return 3 if mode == "kTf32x3" else 1


def test_tensor_core_mainloops_use_ldmatrix_and_cp_async(kernels):
    for (mode, triangular, a_k, b_k), (_, code, _) in tiled(kernels).items():
        counts = sass.opcode_counts(code)
        variant = f"{mode} triangular={triangular} a_k={a_k} b_k={b_k}"
        if mode == "kFma":
            assert counts["LDSM"] == counts["LDGSTS"] == counts["HMMA"] == 0, variant
            continue
        assert counts["LDGSTS"] > 0, f"{variant}: no cp.async"
        assert counts["HMMA"] > 0, f"{variant}: no tensor-core MMA"
        blocks, mmas = fragment_blocks(mode, a_k, b_k), 32 * mmas_per_tile(mode)
        assert counts["LDSM"] * mmas >= counts["HMMA"] * blocks, f"{variant}: fragments not from ldmatrix"
        if blocks == 0:
            assert counts["LDSM"] == 0, f"{variant}: ldmatrix on an fp32 [k][128] slab"


# The least share of HMMA in the hot loop, per math mode. #44 measured the old loop (64 x 32 warp tiles,
# 64-bit addresses and edge checks per cp.async chunk, B fragments copied into register pairs) on
# sm_80 at 0.090-0.101 for the 16-bit modes, 0.064-0.078 for tf32 and 0.121-0.143 for 3xTF32; this
# loop gives 0.37-0.41, 0.12-0.22 and 0.20-0.25 on sm_80 and sm_90 (nvcc 13.0). Per slab of a 16-bit
# mode a warp issues 64 HMMA, 16 LDSM and 8 LDGSTS, and at most one integer instruction for each of
# their addresses (two for a 64-bit global one): 64 / (64 + 16 * 2 + 8 * 3) = 0.53 at best; the bound
# leaves room for the loop's control and barrier. tf32 rounds every operand register (and 3xTF32
# splits it) on the way, and reads an fp32 [k][128] slab with LDS.32, four to an ldmatrix's one.
LEAST_HMMA_SHARE = {"kHalf": 0.33, "kBf16": 0.33, "kTf32": 0.11, "kTf32x3": 0.18}
FRAGMENT_COPY_OPCODES = ("MOV", "IMAD.MOV", "UMOV")


def test_hot_loop_instruction_mix(kernels):
    for (mode, triangular, a_k, b_k), (usage, _, loop) in tiled(kernels).items():
        variant = f"{mode} triangular={triangular} a_k={a_k} b_k={b_k}"
        if mode == "kFma":
            assert not loop, f"{variant}: HMMA in the FMA kernel"
            continue
        counts = sass.opcode_counts(loop)
        hmma = counts["HMMA"]
        assert hmma == 2 * 32 * mmas_per_tile(mode), f"{variant}: not one 32-deep (16-bit) or 16-deep slab"
        share = hmma / len(loop)
        assert share >= LEAST_HMMA_SHARE[mode], f"{variant}: HMMA {share:.3f} of the hot loop"
        assert counts["LDSM"] * 32 * mmas_per_tile(mode) == hmma * fragment_blocks(mode, a_k, b_k), (
            f"{variant}: {counts['LDSM']} LDSM for {hmma} HMMA, not a 64 x 64 warp tile's")
        # A B fragment copied into a register pair costs a MOV per mma tile; the loop keeps a few
        # for its own pointers.
        copies = sum(op.startswith(FRAGMENT_COPY_OPCODES) for op in loop)
        assert copies * 8 <= hmma, f"{variant}: {copies} MOV in the hot loop for {hmma} HMMA"
        assert counts["LDGSTS"] == 8, f"{variant}: the hot loop issues no whole slab by cp.async"
        assert usage.get("stack", 0) == 0, variant


def test_features_count_hopper_and_ampere_mma_tma_and_local_memory():
    """bench/gpu_check.py --compile-only's SASS columns, from opcodes as cuobjdump prints them."""
    opcodes = ["HGMMA.64x128x16.F32.BF16", "HGMMA.64x128x16.F32.BF16", "UTMALDG.2D", "UBLKCP.S.G", "LDGSTS.E.128",
               "HMMA.16816.F32.BF16", "STL.64", "LDL.64", "LDL", "FFMA"]
    assert sass.features(opcodes) == {"HGMMA": 2, "HMMA": 1, "TMA": 2, "LDGSTS": 1, "LDL/STL": 3}
