"""The symmetric (SYRK) kernel: X X^T and X^T X, lower tiles only, mirrored, with its epilogue."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)
from triton_env import DTYPES, PRODUCT_TOLERANCE, SMALL_TILES, max_asymmetry, randn, relative, small_integers, symmetric

from dataclasses import replace

import pytest
import torch

from spectral_ops.triton_kernels.common import batched, describe
from spectral_ops.triton_kernels.syrk import symmetric_product, syrk

# Not multiples of 16; one matrix, a batch, two batch dimensions; wide and tall.
SHAPES = [(37, 50), (50, 37), (3, 21, 45), (2, 2, 17, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("trans", [False, True], ids=["XXt", "XtX"])
def test_gram_matches_torch_and_is_exactly_symmetric(shape, dtype, trans):
    X = randn(shape, dtype)
    G = syrk(X, trans=trans, cfg=SMALL_TILES)
    X64 = X.double()
    expected = X64.mT @ X64 if trans else X64 @ X64.mT
    assert G.dtype == torch.float32 and G.shape == expected.shape
    assert relative(G, expected) < PRODUCT_TOLERANCE
    assert max_asymmetry(G) == 0


def test_every_tile_is_written_once_through_the_triangular_grid():
    # 7 x 7 tiles -> 28 programs per matrix; NaN marks anything no program wrote.
    X = randn((2, 100, 20))
    out = torch.full((2, 100, 100), float("nan"))
    syrk(X, out=out, cfg=SMALL_TILES)
    assert not out.isnan().any()
    assert relative(out, X.double() @ X.double().mT) < PRODUCT_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_integers_and_power_of_two_scales_are_bit_exact(dtype):
    X = small_integers((3, 37, 45), dtype)
    C = symmetric((3, 37, 37), torch.float32, integers=True)
    G = syrk(X, alpha=0.5, beta=-0.25, C=C, cfg=SMALL_TILES)
    X32 = X.float()
    assert torch.equal(G, 0.5 * (X32 @ X32.mT) - 0.25 * C)


def test_per_matrix_alpha_beta_and_in_place_epilogue():
    X = randn((3, 30, 41))
    C = symmetric((3, 30, 30), seed=1)
    alpha, beta = torch.tensor([1.0, 0.5, -2.0]), torch.tensor([0.0, 1.0, 3.0])
    expected = alpha[:, None, None] * (X.double() @ X.double().mT) + beta[:, None, None] * C.double()
    syrk(X, alpha=alpha, beta=beta, C=C, out=C, cfg=SMALL_TILES)  # C is read only where it is written
    assert relative(C, expected) < PRODUCT_TOLERANCE
    assert max_asymmetry(C) == 0


def test_an_output_overlapping_the_operand_goes_through_a_workspace():
    A = symmetric((2, 33, 33))
    expected = A.double() @ A.double()
    symmetric_product(A, A, out=A, cfg=SMALL_TILES)
    assert relative(A, expected) < PRODUCT_TOLERANCE


def test_product_of_commuting_symmetric_matrices():
    G = symmetric((2, 35, 35))
    G2 = G @ G
    D = symmetric_product(G, G2, out=torch.empty(2, 35, 35, dtype=torch.float16), cfg=SMALL_TILES)
    assert D.dtype == torch.float16
    assert relative(D, G.double() @ G2.double()) < 1e-3
    assert max_asymmetry(D) == 0


def test_strided_operands_and_fp32_input_precisions():
    base = randn((4, 60, 70))
    X = base[::2, 5:40, ::3]  # batch, row and column strides, no copy
    for precision in ("ieee", "tf32", "tf32x3"):
        G = syrk(X, input_precision=precision, cfg=SMALL_TILES)
        assert relative(G, X.double() @ X.double().mT) < PRODUCT_TOLERANCE
    with pytest.raises(ValueError, match="input_precision"):
        syrk(X, input_precision="bf16")


@pytest.mark.parametrize("group", [3, 8])
def test_the_persistent_grouped_walk_writes_every_lower_tile(group):
    # 7 x 7 tiles (28, in bands of `group` rows, the last band ragged) over the interpreter's 3
    # programs, which walk them with a stride of 3; group 1 is SMALL_TILES' walk, tested above.
    X = randn((100, 20))
    out = torch.full((100, 100), float("nan"))
    syrk(X, out=out, cfg=replace(SMALL_TILES, group=group))
    assert not out.isnan().any()
    assert relative(out, X.double() @ X.double().mT) < PRODUCT_TOLERANCE
    assert max_asymmetry(out) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans", [False, True], ids=["XXt", "XtX"])
def test_tma_descriptor_path_with_ragged_edges_and_the_epilogue(dtype, trans):
    # The sm90 path, run by the interpreter: rows of 40 (XXt) or 24 (XtX, X described as stored,
    # by its columns' view) elements are 16-byte aligned for both dtypes, and sides of 36 and 24
    # (not multiples of 16) leave TMA to zero-fill the edge tiles.
    X = randn((3, 40, 24) if trans else (3, 36, 40), dtype)
    n = X.shape[-1] if trans else X.shape[-2]
    C = symmetric((3, n, n), seed=1)
    assert describe(batched(X), 16, 16) is not None
    G = syrk(X, trans=trans, alpha=0.5, beta=-2.0, C=C, cfg=replace(SMALL_TILES, group=2, descriptors=True))
    gram = X.double().mT @ X.double() if trans else X.double() @ X.double().mT
    expected = 0.5 * gram - 2.0 * C.double()
    assert relative(G, expected) < PRODUCT_TOLERANCE
    assert max_asymmetry(G) == 0


def test_operands_tma_cannot_address_fall_back_to_pointers():
    X = randn((3, 36, 37))  # rows 148 bytes apart: not 16-byte aligned
    assert describe(batched(X), 16, 16) is None
    G = syrk(X, cfg=replace(SMALL_TILES, descriptors=True))
    assert relative(G, X.double() @ X.double().mT) < PRODUCT_TOLERANCE


# Compiled, not interpreted, in a child process without TRITON_INTERPRET: the bf16 Gram's launch at
# rows of 1000 elements (not a multiple of 16) is recorded on CPU tensors as Triton's launcher would
# bind it for sm90 and for sm80, then compiled with Triton's bundled ptxas and read back with cuobjdump.
_COMPILE_GRAMS = r"""
import json, sys, tempfile
from pathlib import Path
import torch, triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature
from spectral_ops.triton_kernels import common, syrk
sys.path.insert(0, "bench")
import sass

def compiled_counts(arch):
    target = GPUTarget("cuda", int(arch[2:]), 32)
    launches = []

    def record(kernel, *args, grid, warmup, **kwargs):
        kwargs.update(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
        binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(target))
        bound, specialization, options = binder(*args, **kwargs)
        launches.append((kernel, *kernel._pack_args(make_backend(target), kwargs, bound, specialization, options)))

    JITFunction.run, common.arch = record, lambda device: arch
    syrk.syrk(torch.zeros(2, 200, 1000, dtype=torch.bfloat16))
    (kernel, options, signature, constexprs, attrs), = launches
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = sass.resource_usage(cubin)[compiled.metadata.name]
        counts = sass.opcode_counts(sass.sass_instructions(cubin)[compiled.metadata.name])
    return {"stack": usage.get("stack", 0), "registers": usage["registers"], "local": counts["LDL"] + counts["STL"],
            **{op: counts[op] for op in ("HGMMA", "UTMALDG", "HMMA", "LDGSTS")}}

print(json.dumps({arch: compiled_counts(arch) for arch in ("sm90", "sm80")}))
"""


def test_the_gram_compiles_to_tensor_cores_and_async_loads_without_spilling():
    """About 20-30 s on two cores with a cold Triton cache (a warm one skips the compiles): the suite's
    compile-only check, for the headline kernel; bench/gpu_check.py --compile-only covers every
    variant. sm90: wgmma fed by TMA. sm80: mma.sync fed by cp.async (LDGSTS), which rows of 1000
    elements only get from the stride hint (``known_multiple``); a wrong hint shows up here, not
    under the interpreter, which gets none."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_GRAMS], cwd=root, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["sm90"]["HGMMA"] > 0 and found["sm90"]["UTMALDG"] > 0, found
    assert found["sm80"]["HMMA"] > 0 and found["sm80"]["LDGSTS"] > 0, found
    assert all(counts["stack"] == 0 and counts["local"] == 0 for counts in found.values()), found
