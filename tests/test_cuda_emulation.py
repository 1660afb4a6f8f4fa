"""The CUDA kernels themselves, without a GPU: csrc/ compiled as C++ and run on the CPU's emulation of the
execution model (tests/cuda_emulation). Every thread of a block is a fiber, __syncthreads() a phase
barrier; ldmatrix and mma.sync follow the PTX ISA's fragment layouts exactly (TF32 operands truncated
as the tensor cores do), and a cp.async copy lands only at the wait that covers it. The host code is
the real one, validation and launch included.

What this verifies: indexing, tiling, the slab layouts and swizzles, the cp.async pipeline (a missing
or short wait reads stale shared memory), the triangular grid and mirrored stores, epilogues, strides
and batch offsets, the chain's algorithm, the backend's composition, and (running the same inputs with
the threads of each phase in shuffled orders) that no barrier is missing. What it cannot: timing,
memory coalescing, bank conflicts, register or shared-memory limits (tests/test_cuda_sass.py checks
what nvcc makes of the kernels), and the hardware's exact rounding inside an MMA (accumulation order),
which the tolerances below absorb.

The first run compiles the module (~40 s on 2 cores); it is cached in build/cuda-emulation/.
"""

import functools
import os
import subprocess

import pytest
import torch

from spectral_ops import _extension, plan, selfcheck
from spectral_ops.backends.base import PRIMITIVES
from spectral_ops.backends.cuda_backend import CudaBackend
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.build_config import ENV_REQUIRE_CUDA, env_flag
from spectral_ops.coefficients import polar_express_coefficients
from spectral_ops.dispatch import PinnedKernels
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error
from spectral_ops.plan import Band, DecayRequest

from cuda_emulation import build, harness

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative Frobenius error against an fp64/fp32 reference: the final rounding to the dtype dominates.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
COEFFICIENTS = polar_express_coefficients()
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def emulated_module():
    try:
        return build.load()
    except build.EmulationUnavailable as exc:
        if env_flag(os.environ, ENV_REQUIRE_CUDA):
            pytest.fail(f"{ENV_REQUIRE_CUDA}=1 but the CUDA emulation cannot be built: {exc}")
        pytest.skip(f"the CUDA emulation cannot be built here: {exc}")


@pytest.fixture(autouse=True)
def emulated(emulated_module, monkeypatch):
    monkeypatch.delenv("SPECTRAL_OPS_EMULATION_ORDER", raising=False)
    harness.install(monkeypatch, emulated_module)
    return emulated_module


# The reference: the same plan with every product a plain torch matmul.
TORCH = PinnedKernels(TorchBackend())


def on_cuda(plan_function, *args, path="chain", precision=None):
    """The plan with every primitive on the (emulated) CUDA kernels; ``path="composed"`` skips the chain."""
    kernels = PinnedKernels(CudaBackend(precision=precision), small_chain=path == "chain")
    return plan_function(kernels, *args)


def reference_product(a, b, y=None, alpha=1.0, beta=0.0):
    out = alpha * (a.double() @ b.double())
    return out if y is None else out + beta * y.double()


# --- gemm / syrk ------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
@pytest.mark.parametrize("dtype", DTYPES)
# (1157, 16, 300): 10 x 3 tiles, so the grouped tile order (8 tile rows per group) has a partial group.
@pytest.mark.parametrize("m, k, n", [(5, 7, 3), (130, 70, 129), (64, 300, 200), (1157, 16, 300)])
def test_gemm_matches_torch(precision, dtype, m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    a, b, y = (torch.randn(2, *shape, generator=g).to(dtype) for shape in ((m, k), (k, n), (m, n)))
    out = torch.empty(2, m, n, dtype=dtype)
    _extension.gemm(a, b, out, alpha=0.5, beta=-2.0, y=y, precision=precision)
    # One TF32 pass rounds each fp32 operand to a 10-bit mantissa (u = 2^-11): ~1e-3 per product.
    tolerance = 2e-3 if precision == "tf32" and dtype == torch.float32 else TOLERANCE[dtype]
    assert relative_error(out, reference_product(a, b, y, 0.5, -2.0)) < tolerance
    if precision == "tf32" and dtype == torch.float32:  # and it is not silently the 3-pass mode
        assert relative_error(out, reference_product(a, b, y, 0.5, -2.0)) > TOLERANCE[dtype]


def integers(shape, generator, dtype):
    return torch.randint(-16, 17, shape, generator=generator).to(dtype)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_integers_are_exact_in_every_math_mode(precision, dtype):
    # SPEC 8: small integers and power-of-two scales make every product and sum exact, so the result
    # is the reference bit for bit, whatever the math (FMA, 3xTF32, fp16 or bf16 MMA).
    g = torch.Generator().manual_seed(7)
    a, b, y = integers((3, 70, 150), g, dtype), integers((3, 150, 90), g, dtype), integers((3, 70, 90), g, dtype)
    out = torch.empty(3, 70, 90)
    _extension.gemm(a, b, out, alpha=0.25, beta=2.0, y=y, precision=precision)
    assert torch.equal(out, reference_product(a, b, y, 0.25, 2.0).float())
    G = torch.empty(3, 70, 70)
    _extension.syrk(a, a.mT, G, alpha=0.5, precision=precision)
    assert torch.equal(G, reference_product(a, a.mT, alpha=0.5).float())


def strided_integers(rows, cols, dtype, unit_dim, offset, generator):
    """A batch of two rows x cols views of small integers with unit stride along `unit_dim` (0 or 1),
    the leading and batch strides multiples of 8 elements, the data starting `offset` elements into
    its buffer: with offset 0 every view is aligned for 16-byte copies, with offset 1 none is."""
    inner, outer = (rows, cols) if unit_dim == 0 else (cols, rows)
    lead = (inner + 7) // 8 * 8
    batch_stride = outer * lead + 8
    buffer = integers((offset + 2 * batch_stride,), generator, dtype)
    strides = (batch_stride, 1, lead) if unit_dim == 0 else (batch_stride, lead, 1)
    return buffer.as_strided((2, rows, cols), strides, offset)


# A (130 x 70) and B (70 x 40): two tile rows, the second partial, and k ending inside a slab and
# inside a 16-byte vector. "kn" is A with k contiguous (k-contiguous slab, ldmatrix), B with n
# contiguous ([k][128] slab, ldmatrix.trans, or LDS.32 for tf32). Aligned views of the slab's dtype are
# copied with cp.async (short and zero-filled at the edge), the others loaded and converted by the
# threads.
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("a_unit, b_unit", [(1, 0), (1, 1), (0, 0), (0, 1)], ids=["kk", "kn", "mk", "mn"])
@pytest.mark.parametrize(
    "a_dtype, b_dtype, precision",
    [(torch.float16, torch.float16, "ieee"), (torch.bfloat16, torch.bfloat16, "ieee"),
     (torch.float32, torch.float32, "tf32x3"), (torch.float32, torch.float32, "tf32"),
     (torch.float32, torch.bfloat16, "tf32x3")],
    ids=["fp16", "bf16", "tf32x3", "tf32", "tf32x3-mixed"],
)
def test_tensor_core_operands_in_every_layout(a_dtype, b_dtype, precision, a_unit, b_unit, offset):
    g = torch.Generator().manual_seed(12)
    a = strided_integers(130, 70, a_dtype, a_unit, offset, g)
    b = strided_integers(70, 40, b_dtype, b_unit, offset, g)
    out = torch.empty(2, 130, 40)
    _extension.gemm(a, b, out, precision=precision)
    assert torch.equal(out, (a.double() @ b.double()).float())  # exact: small integers (SPEC 8)


# A 128 x 128 tile inside both matrices, with aligned views of the slab's dtype: its whole slabs take the
# interior path (one pointer per operand, constant steps, no edge checks) and the last, partial slab
# (k = 56 ends inside one) the checked path, in every operand layout.
@pytest.mark.parametrize("a_unit, b_unit", [(1, 0), (1, 1), (0, 0), (0, 1)], ids=["kk", "kn", "mk", "mn"])
@pytest.mark.parametrize("dtype, precision", [(torch.float16, "ieee"), (torch.bfloat16, "ieee"),
                                              (torch.float32, "tf32x3"), (torch.float32, "tf32")])
def test_interior_tiles_in_every_layout(dtype, precision, a_unit, b_unit):
    g = torch.Generator().manual_seed(13)
    a = strided_integers(128, 56, dtype, a_unit, 0, g)
    b = strided_integers(56, 128, dtype, b_unit, 0, g)
    out = torch.empty(2, 128, 128)
    _extension.gemm(a, b, out, precision=precision)
    assert torch.equal(out, (a.double() @ b.double()).float())  # exact: small integers (SPEC 8)


def edge_operands(case, dtype, generator):
    """(A, B, Y) of small integers as views that end exactly where their storage does, so that any
    access past a view is outside every tensor of the call."""
    def view(rows, cols, row_stride, col_stride, batch_stride, offset):
        size = offset + batch_stride + (rows - 1) * row_stride + (cols - 1) * col_stride + 1
        return integers((size,), generator, dtype).as_strided((2, rows, cols), (batch_stride, row_stride, col_stride),
                                                              offset)

    if case == "one row":  # a 1 x 131 row times 131 x 9: one partial tile, k ending inside a vector
        return view(1, 131, 131, 1, 131, 0), view(131, 9, 9, 1, 131 * 9, 0), view(1, 9, 9, 1, 9, 0)
    if case == "odd sides":  # 129 x 33 times 33 x 130: partial tiles on every side, k inside a slab
        return (view(129, 33, 33, 1, 129 * 33, 0), view(33, 130, 130, 1, 33 * 130, 0),
                view(129, 130, 130, 1, 129 * 130, 0))
    if case == "huge strides":  # rows 5000 elements apart, columns of a transposed view, batch offsets
        return (view(130, 40, 5000, 1, 130 * 5000 + 8, 3), view(40, 129, 1, 4000, 129 * 4000, 8),
                view(130, 129, 1, 3000, 129 * 3000, 0))
    # "interior": a full 128 x 128 tile of aligned views (the interior path), inside a larger storage
    return (view(128, 64, 72, 1, 128 * 72, 0), view(64, 128, 136, 1, 64 * 136, 0),
            view(128, 128, 128, 1, 128 * 128, 0))


# Every global load, store and cp.async of the tiled kernels stays inside the tensors of the call
# (harness.bounds_checked), in every math mode, for the shapes where an index is most likely to slip:
# one row, odd sides, strides far larger than the matrix, transposed views, batch offsets.
@pytest.mark.parametrize("case", ["one row", "odd sides", "huge strides", "interior"])
@pytest.mark.parametrize(
    "dtype, precision", [(torch.float16, "ieee"), (torch.bfloat16, "ieee"), (torch.float32, "tf32x3"),
                         (torch.float32, "tf32"), (torch.float32, "ieee")],
    ids=["fp16", "bf16", "tf32x3", "tf32", "ieee"])
def test_every_access_stays_inside_the_tensors(emulated, dtype, precision, case):
    g = torch.Generator().manual_seed(14)
    a, b, y = edge_operands(case, dtype, g)
    out = torch.empty(2, a.shape[1], b.shape[2], dtype=dtype)
    gram = torch.empty(2, a.shape[1], a.shape[1], dtype=dtype)
    with harness.bounds_checked(emulated, *map(harness.byte_span, (a, b, y, out, gram))):
        _extension.gemm(a, b, out, beta=0.5, y=y, precision=precision)
        _extension.syrk(a, a.mT, gram, precision=precision)
    # Small integers make every product and sum exact (SPEC 8): what is left is out's rounding to its dtype.
    assert relative_error(out, reference_product(a, b, y, 1.0, 0.5)) < TOLERANCE[dtype]
    assert relative_error(gram, reference_product(a, a.mT)) < TOLERANCE[dtype]


def test_a_reduction_dim_of_2_to_the_31_is_refused_before_any_launch(emulated):
    # The tiled kernel counts its slabs in int32. Zero-stride descriptors at fake aligned addresses:
    # (address, shape, strides, dtype code, device); nothing is allocated or launched.
    k = 2**31
    a, b = (1 << 20, [4, k], [0, 0], 0, 0), (1 << 40, [k, 5], [0, 0], 0, 0)
    out = (1 << 41, [4, 5], [5, 1], 0, 0)
    with pytest.raises(ValueError, match=r"reduction dim of a @ b is 2147483648; .* below 2\^31"):
        emulated.gemm(a, b, out, None, 1.0, None, 0.0, None, 1, 0)


def test_the_bounds_check_catches_an_access_past_a_tensor(emulated):
    # The same check with A's last element left out of the allowed spans: the kernel reads it.
    g = torch.Generator().manual_seed(15)
    a, b, y = edge_operands("odd sides", torch.float16, g)
    out = torch.empty(2, a.shape[1], b.shape[2], dtype=torch.float16)
    first, end = harness.byte_span(a)
    spans = [(first, end - a.element_size()), *map(harness.byte_span, (b, out))]
    with harness.bounds_checked(emulated, *spans), pytest.raises(RuntimeError, match="outside every tensor"):
        _extension.gemm(a, b, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tall", [False, True])
def test_syrk_of_views_is_exactly_symmetric(dtype, tall):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(2, 300, 150, generator=g).to(dtype)  # tall: the Gram of its wide view W^T
    X = W.mT if tall else W.mT.contiguous()
    G = torch.empty(2, 150, 150)
    _extension.syrk(X, X.mT, G, alpha=0.125)
    assert torch.equal(G, G.mT)
    assert relative_error(G, reference_product(X, X.mT, alpha=0.125)) < 2e-6


def test_syrk_over_a_large_triangle():
    # 1100 = 8 tiles and a partial one: 45 lower-triangle tiles, the row of each found from its index.
    g = torch.Generator().manual_seed(9)
    X = torch.randn(1100, 24, generator=g)
    G = torch.empty(1100, 1100)
    _extension.syrk(X, X.mT, G, precision="ieee")
    assert torch.equal(G, G.mT)
    assert relative_error(G, reference_product(X, X.mT)) < 1e-6


def test_gemm_writes_a_column_major_out_in_place():
    # The wide view of a tall weight is column-major: the product runs transposed to write it by rows.
    g = torch.Generator().manual_seed(4)
    M = torch.randn(3, 40, 40, generator=g)
    W = torch.randn(3, 150, 40, generator=g).to(torch.bfloat16)
    expected = (0.7 * (M.double() @ W.mT.double()) - 1.5 * W.mT.double()).to(torch.bfloat16)
    X = W.mT
    _extension.gemm(M, X.float().contiguous(), X, alpha=0.7, y=X, beta=-1.5)
    assert relative_error(W.mT, expected) < TOLERANCE[torch.bfloat16]


def test_per_matrix_scales_and_batch_views():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(4, 1, 3, 33, 17, generator=g)
    b = torch.randn(17, 9, generator=g).expand(4, 1, 3, 17, 9)  # a zero batch stride
    y = torch.randn(4, 1, 3, 33, 9, generator=g)
    alpha, beta = torch.rand(12, generator=g), torch.rand(12, generator=g)
    out = torch.empty(4, 1, 3, 33, 9)
    _extension.gemm(a, b, out, alpha=2.0, alpha_per_matrix=alpha, beta=0.5, beta_per_matrix=beta, y=y,
                    precision="ieee")
    expected = 2 * alpha.reshape(4, 1, 3, 1, 1) * (a @ b) + 0.5 * beta.reshape(4, 1, 3, 1, 1) * y
    assert relative_error(out, expected) < 1e-6


# --- poly_step / sign_step --------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_poly_and_sign_steps(precision):
    g = torch.Generator().manual_seed(6)
    S = torch.randn(2, 150, 150, generator=g)
    S = S + S.mT
    B = torch.empty_like(S)
    _extension.poly_step(S, B, 0.3, -0.2, precision=precision)
    assert relative_error(B, 0.3 * S.double() - 0.2 * S.double() @ S.double()) < 2e-6
    Z = (S / torch.linalg.matrix_norm(S)[..., None, None]).double()
    out = torch.empty_like(S)
    _extension.sign_step(Z.float(), out, (3.0, -16 / 5, 6 / 5), precision=precision)
    eye = torch.eye(150, dtype=torch.float64)
    assert relative_error(out, Z @ (3 * eye - 16 / 5 * Z @ Z + 6 / 5 * Z @ Z @ Z @ Z)) < 2e-6


# --- small_chain ------------------------------------------------------------------------------


def spectral_weight(shape, dtype, seed):
    return matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), 10), dtype, seed=seed)


def wide(W):
    return W.mT if W.shape[-2] >= W.shape[-1] else W


CHAIN_CASES = [(torch.float32, p) for p in (0, 1, 2, 3, 4, 6, 7)] + [(d, p) for d in DTYPES[1:] for p in (0, 3, 6)]


@pytest.mark.parametrize("dtype, p", CHAIN_CASES)
@pytest.mark.parametrize("shape", [(2, 40, 24), (3, 20, 300), (2, 128, 160), (1, 100, 70)])
def test_chain_matches_the_reference(dtype, shape, p):
    W = spectral_weight(shape, dtype, seed=p)
    out = torch.empty_like(W)
    _extension.small_chain(wide(W), wide(out), p, COEFFICIENTS if p % 2 == 0 else ())
    expected = plan.spectral_power(TORCH, W.double(), p, COEFFICIENTS)
    assert relative_error(out, expected) < 5 * TOLERANCE[dtype]


@pytest.mark.parametrize("p", [2, 3])
def test_chain_may_write_its_input(p):
    W = spectral_weight((3, 90, 60), torch.float32, seed=1)
    expected = plan.spectral_power(TORCH, W.double(), p, COEFFICIENTS)
    X = wide(W)
    _extension.small_chain(X, X, p, COEFFICIENTS if p % 2 == 0 else ())
    assert relative_error(W, expected) < 5 * TOLERANCE[torch.float32]


# --- decay_epilogue_ --------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
def test_decay_epilogue_per_matrix(transposed):
    g = torch.Generator().manual_seed(8)
    base = torch.randn(3, 40, 50, generator=g)
    w = base.mT.contiguous().mT if transposed else base.clone()  # the strided kernel, or the vector one
    d = torch.randn(3, 40, 50, generator=g)
    keep, step = torch.rand(3, generator=g), torch.rand(3, generator=g)
    _extension.decay_epilogue_(w, d, 0.5, -2.0, keep_per_matrix=keep, step_per_matrix=step)
    expected = 0.5 * keep.reshape(3, 1, 1) * base - 2.0 * step.reshape(3, 1, 1) * d
    assert relative_error(w, expected) < 1e-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_decay_epilogue_rounds_stochastically_as_the_torch_reference(dtype, transposed):
    # The same fp32 values and random bits: the kernel's rule (both kernels: vector and strided) is
    # the torch provider's, bit for bit. The values lie within a few units of the weights' rounding
    # of each other, so the rounding decides, and near 65504 for fp16's overflow rule.
    g = torch.Generator().manual_seed(9)
    base = (torch.randn(2, 30, 44, generator=g) * (3e4 if dtype == torch.float16 else 1.0)).to(dtype)
    w = base.mT.contiguous().mT if transposed else base.clone()
    d = torch.randn(2, 30, 44, generator=g) * 1e-2
    noise = torch.randint(-2**15, 2**15, (2, 30, 44), dtype=torch.int16, generator=g)
    _extension.decay_epilogue_(w, d, 0.999, -1.0, noise=noise)
    expected = base.clone()
    TORCH.decay_epilogue_(expected, d, 0.999, -1.0, noise=noise)
    assert torch.equal(w, expected)


# --- the backend, with and without its chain ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_backend_passes_the_dispatch_self_check(primitive, dtype):
    error = selfcheck.self_check_error(CudaBackend(), primitive, dtype, CPU)
    assert error <= selfcheck.SELF_CHECK_TOLERANCE[dtype]


@pytest.mark.parametrize("mode", ["top", "bot", "top_only", "bot_only", "two_band", "clip"])
def test_band_directions_over_several_tiles(mode):
    # r = 130: a 2 x 2 lower-triangle grid with partial tiles for every symmetric product.
    W = matrix_with_spectrum((2, 130, 140), torch.cat([torch.linspace(0.4, 0.6, 65), torch.linspace(0.9, 1.0, 65)]),
                             torch.float32, seed=2)
    band = Band(0.75, mode, p_bot=0, spectral_weight_decay_bot=2.0)
    sign = polar_express_coefficients()
    p = 1 if mode == "clip" else 2
    got = on_cuda(functools.partial(plan.band_direction, top=0.5), W, p, band, COEFFICIENTS, sign, precision="ieee")
    expected = plan.band_direction(TORCH, W, p, band, COEFFICIENTS, sign, top=0.5)
    assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("path", ["chain", "composed"])
@pytest.mark.parametrize(
    "p, p0_mode, band",
    [(2, "explicit", None), (3, "explicit", None), (0, "prox", None), (2, "explicit", Band(0.75, "top"))],
)
def test_decay_with_tensor_scales(path, p, p0_mode, band):
    W = matrix_with_spectrum((3, 60, 40), torch.linspace(0.5, 1.0, 40), torch.bfloat16, seed=3)
    request = DecayRequest(p, 1.0, torch.tensor([0.1, 0.2, 0.05]).reshape(3, 1, 1), torch.tensor(0.01), band, p0_mode,
                           COEFFICIENTS, polar_express_coefficients())
    expected, got = W.clone(), W.clone()
    plan.decay_(TORCH, expected, request)
    on_cuda(plan.decay_, got, request, path=path)
    assert relative_error(got, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("p", [0, 2, 4])
def test_gram_space_iteration_over_the_kernels(p):
    """The restarted Gram-space iteration (issue #15) composed from the CUDA gemm, syrk and poly_step
    kernels (a 4:1 batch, r = 40: partial tiles everywhere), against the same plan on torch matmuls."""
    W = spectral_weight((2, 160, 40), torch.float32, seed=5)
    gram_space = functools.partial(plan.spectral_power, iteration="gram_space")
    got = on_cuda(gram_space, W, p, COEFFICIENTS, path="composed", precision="ieee")
    expected = gram_space(TORCH, W, p, COEFFICIENTS)
    # Both fp32: only the kernels' summation order differs, compounded over the ~30 products of the
    # blocks and restarts (measured 1e-6 for p = 0, 2, 4), so 1e-5 as for band_direction above.
    assert relative_error(got, expected) < 1e-5


# --- no missing barrier -----------------------------------------------------------------------


def run_everything():
    W = spectral_weight((2, 100, 140), torch.float32, seed=4)
    X = W.to(torch.bfloat16)
    results = [on_cuda(plan.spectral_power, W, p, COEFFICIENTS) for p in (0, 3, 6)]
    results.append(on_cuda(plan.spectral_power, W, 6, COEFFICIENTS, path="composed", precision="tf32x3"))
    results.append(on_cuda(plan.msign, W @ W.mT - 0.5 * torch.eye(100), COEFFICIENTS, path="composed",
                           precision="ieee"))
    G = torch.empty(2, 140, 140)
    results.append(_extension.syrk(X.mT, X, G))
    # An aligned 136 x 64 operand: tile (0, 0) takes the interior path.
    Z = torch.randn(2, 136, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    results.append(_extension.syrk(Z, Z.mT, torch.empty(2, 136, 136)))
    d = torch.randn(2, 100, 140, generator=torch.Generator().manual_seed(0))
    noise = torch.randint(-2**15, 2**15, X.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(3))
    results.append(_extension.decay_epilogue_(X.clone(), d, 0.9, -0.1, noise=noise))
    return results


def test_the_emulation_keeps_the_ptx_semantics():
    # ldmatrix's documented fragment layout, cp.async copies that land at their wait and not at a
    # barrier, and the refusal of a block whose threads mix barriers and warp exchanges in one phase
    # (tests/cuda_emulation/selftest.cpp).
    result = subprocess.run([str(build.build_selftest())], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_results_do_not_depend_on_the_order_threads_run_in(monkeypatch):
    in_order = run_everything()
    for seed in ("1", "2"):
        monkeypatch.setenv("SPECTRAL_OPS_EMULATION_ORDER", seed)
        for a, b in zip(in_order, run_everything()):
            assert torch.equal(a, b)


# --- the entry points as torch.library custom ops -----------------------------------------------------


def test_the_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(11)
    a, b, y = (torch.randn(2, *shape, generator=g) for shape in ((20, 12), (12, 30), (20, 30)))
    S = a @ a.mT
    per_matrix = torch.tensor([0.5, 2.0])
    ops, precision = torch.ops.spectral_ops, _extension.PRECISION_CODES["ieee"]
    flat = [v for triple in COEFFICIENTS for v in triple]
    samples = [
        (ops.cuda_gemm, (a, b, torch.empty(2, 20, 30), y, 0.5, per_matrix, -1.0, None, precision)),
        (ops.cuda_syrk, (a, a.mT, torch.empty(2, 20, 20), None, 1.0, None, 0.0, None, precision)),
        (ops.cuda_poly_step, (S, torch.empty_like(S), 0.3, -0.2, precision)),
        (ops.cuda_sign_step, (S / 100, torch.empty_like(S), torch.empty_like(S), torch.empty_like(S), 3.0, -3.2, 1.2,
                              precision)),
        (ops.cuda_small_chain, (a.mT, torch.empty(2, 12, 20), torch.empty(2, 12, 20), torch.empty(2, 12, 12), 2, flat,
                                1 / 1.01)),
        (ops.cuda_decay_epilogue, (y.clone(), b.new_ones(2, 20, 30), 0.9, -0.1, per_matrix, None, None)),
        (ops.cuda_decay_epilogue, (y.bfloat16(), b.new_ones(2, 20, 30), 0.9, -0.1, None, None,
                                   torch.randint(-2**15, 2**15, (2, 20, 30), dtype=torch.int16, generator=g))),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_torch_bumps_the_version_of_what_a_kernel_writes():
    w, d = torch.randn(3, 8, 16), torch.randn(3, 8, 16)
    version = w._version
    _extension.decay_epilogue_(w, d, 0.9, -0.1)
    assert w._version > version
    with torch.inference_mode():  # inference tensors have no version counter, and need none
        w = torch.randn(3, 8, 16)
        _extension.decay_epilogue_(w, d, 0.9, -0.1)
