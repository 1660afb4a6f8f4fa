"""The new spectral_ops._C entry points on a machine without a GPU: every argument is validated before
the device is touched, so each error is testable here; valid arguments reach the no-device error.

Descriptors point at a fake, aligned address (test_extension.desc); no test lets a launch happen.
"""

import pytest
import torch
from test_extension import ADDRESS, NO_DEVICE, C, desc, no_gpu  # noqa: F401, F811 (C and no_gpu are fixtures)

from spectral_ops import _extension

F32, F16, BF16, F64 = 0, 1, 2, 3


def matmul(C, op, a, b, out, y=None, *, alpha=1.0, alpha_pm=None, beta=0.0, beta_pm=None, precision=1):
    getattr(C, op)(a, b, out, y, alpha, alpha_pm, beta, beta_pm, precision, 0)


def at(offset_bytes):
    """A second buffer, far enough from ADDRESS not to overlap the first."""
    return ADDRESS + offset_bytes


OTHER = at(1 << 30)
THIRD = at(2 << 30)
FOURTH = at(3 << 30)


# --- gemm / syrk ------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["gemm", "syrk"])
@pytest.mark.parametrize(
    "a, b, out, y, extra",
    [
        (desc([4, 3]), desc([3, 4], address=OTHER), desc([4, 4], address=THIRD), None, {}),
        # a transposed view, batched, bf16 operands into a float32 out
        (desc([2, 4, 3], strides=[12, 1, 4], dtype=BF16), desc([2, 3, 4], dtype=BF16, address=OTHER),
         desc([2, 4, 4], address=THIRD), None, {}),
        # mixed operand dtypes, a Y term that is out itself, per-matrix scales
        (desc([2, 4, 3], dtype=F16), desc([2, 3, 4], address=OTHER), desc([2, 4, 4], dtype=BF16, address=THIRD),
         desc([2, 4, 4], dtype=BF16, address=THIRD),
         {"alpha_pm": desc([2], address=FOURTH), "beta_pm": desc([2], address=FOURTH + 64)}),
        # an empty reduction (out = beta * y) and an empty batch
        (desc([4, 0]), desc([0, 4], address=OTHER), desc([4, 4], address=THIRD), desc([4, 4], address=FOURTH), {}),
        (desc([0, 4, 3]), desc([0, 3, 4], address=OTHER), desc([0, 4, 4], address=THIRD), None, {}),
        # size-1 batch dims do not count towards the batch
        (desc([1, 1, 1, 1, 1, 1, 1, 4, 3]), desc([1, 1, 1, 1, 1, 1, 1, 3, 4], address=OTHER),
         desc([1, 1, 1, 1, 1, 1, 1, 4, 4], address=THIRD), None, {}),
    ],
)
def test_valid_matmuls_reach_the_device_check(no_gpu, op, a, b, out, y, extra):
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        matmul(no_gpu, op, a, b, out, y, **extra)


@pytest.mark.parametrize("precision", [0, 1])
def test_both_precisions_are_accepted(no_gpu, precision):
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        matmul(no_gpu, "gemm", desc([4, 3]), desc([3, 5], address=OTHER), desc([4, 5], address=THIRD),
               precision=precision)


A, B, OUT = desc([2, 4, 3]), desc([2, 3, 5], address=OTHER), desc([2, 4, 5], address=THIRD)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((desc([4, 3], dtype=F64), desc([3, 5], dtype=F64, address=OTHER), desc([4, 5], dtype=F64, address=THIRD)),
         {}, TypeError, r"a: dtype float64 is not supported; .*left to torch/cuBLAS"),
        ((A, desc([2, 4, 5], address=OTHER), OUT), {}, ValueError,
         r"inner dims differ in a @ b: shapes \[2, 4, 3\] and \[2, 4, 5\]"),
        ((A, B, desc([2, 5, 4], address=THIRD)), {}, ValueError, r"out has shape \[2, 5, 4\] but a @ b is 4 x 5"),
        ((A, B, OUT, desc([2, 4, 4], address=FOURTH)), {}, ValueError, r"y has shape \[2, 4, 4\]"),
        ((A, desc([3, 3, 5], address=OTHER), OUT), {}, ValueError, "batch shape mismatch: out has shape"),
        ((desc([4]), B, OUT), {}, ValueError, r"a: expected a \(\.\.\., rows, cols\) tensor"),
        ((A, desc([2, 3, 5], address=OTHER, device=1), OUT), {}, ValueError,
         "device mismatch: out is on cuda:0 but b is on cuda:1"),
        ((A, B, desc([2, 4, 5], address=ADDRESS)), {}, ValueError, "out overlaps a in memory"),
        ((A, B, desc([2, 4, 5], strides=[0, 5, 1], address=THIRD)), {}, ValueError, "elements overlap in memory"),
        ((A, B, OUT, desc([2, 4, 5], strides=[20, 1, 4], address=THIRD)), {}, ValueError, "out overlaps y"),
        ((A, B, OUT), {"alpha_pm": desc([2], dtype=F16, address=FOURTH)}, TypeError,
         "alpha_per_matrix: dtype float16 is not supported; per-matrix scales are float32"),
        ((A, B, OUT), {"beta_pm": desc([3], address=FOURTH)}, ValueError,
         r"beta_per_matrix .*: must be contiguous with one value per matrix \(2\)"),
        ((A, B, OUT), {"alpha_pm": desc([2], strides=[2], address=FOURTH)}, ValueError, "one value per matrix"),
        ((A, B, OUT), {"alpha_pm": desc([2], address=FOURTH, device=1)}, ValueError,
         "device mismatch: out is on cuda:0 but alpha_per_matrix is on cuda:1"),
        ((A, B, OUT), {"alpha": 1e39}, ValueError, "alpha = .* is not a finite float32 number"),
        ((A, B, OUT), {"beta": float("nan")}, ValueError, "beta = nan is not a finite float32 number"),
        ((A, B, OUT), {"precision": 3}, ValueError, r"unknown precision code 3 \(0=ieee, 1=tf32x3, 2=tf32\)"),
        ((desc([2] * 7 + [4, 3]), desc([2] * 7 + [3, 5], address=OTHER), desc([2] * 7 + [4, 5], address=THIRD)),
         {}, ValueError, "7 leading dims of size > 1; at most 6 are supported"),
        ((A, B, desc([2, 4, 5], device=-1, address=THIRD)), {}, ValueError, r"out: not a CUDA tensor"),
        ((desc([2, 4, 3], address=ADDRESS + 2), B, OUT), {}, ValueError, "a: data pointer .* is not aligned"),
    ],
)
def test_gemm_validation_comes_before_the_device(C, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        matmul(C, "gemm", *args, **kwargs)


def test_syrk_needs_a_square_product(C):
    with pytest.raises(ValueError, match="a symmetric product must be square, but a @ b is 4 x 5"):
        matmul(C, "syrk", A, B, OUT)


def test_matmul_argument_types(C):
    with pytest.raises(TypeError):
        C.gemm(A, B, OUT, None, "1", None, 0.0, None, 1, 0)
    with pytest.raises(TypeError):
        C.gemm(A, B, OUT, None, 1.0, None, 0.0, None, 1.5, 0)


# --- poly_step / sign_step --------------------------------------------------------------------

S = desc([2, 6, 6])


def test_valid_poly_and_sign_steps_reach_the_device_check(no_gpu):
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        no_gpu.poly_step(S, desc([2, 6, 6], address=OTHER), 0.5, -0.25, 1, 0)
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        no_gpu.sign_step(S, desc([2, 6, 6], address=OTHER), desc([2, 6, 6], address=THIRD),
                         desc([2, 6, 6], address=FOURTH), 3.0, -3.2, 1.2, 0, 0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda C: C.poly_step(desc([2, 6, 5]), desc([2, 6, 6], address=OTHER), 1.0, 1.0, 1, 0),
         r"a \(float32, shape \[2, 6, 5\].*must be square"),
        (lambda C: C.poly_step(S, S, 1.0, 1.0, 1, 0), "out overlaps a"),
        (lambda C: C.poly_step(S, desc([2, 6, 6], address=OTHER), float("inf"), 1.0, 1, 0), "beta = inf"),
        (lambda C: C.sign_step(S, desc([2, 6, 6], address=OTHER), desc([2, 6, 6], address=THIRD),
                               desc([2, 6, 6], address=ADDRESS), 3.0, -3.2, 1.2, 0, 0),
         "poly_workspace overlaps z"),
        (lambda C: C.sign_step(S, desc([2, 6, 6], address=OTHER), desc([2, 5, 5], address=THIRD),
                               desc([2, 6, 6], address=FOURTH), 3.0, -3.2, 1.2, 0, 0),
         r"square_workspace has shape \[2, 5, 5\] but z @ z is 6 x 6"),
        (lambda C: C.sign_step(S, desc([2, 6, 6], address=OTHER), desc([2, 6, 6], address=THIRD),
                               desc([2, 6, 6], address=FOURTH, dtype=F64), 3.0, -3.2, 1.2, 0, 0),
         "poly_workspace: dtype float64"),
    ],
)
def test_poly_and_sign_step_validation(C, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(C)


def test_sign_step_validates_every_launch_before_the_first(C):
    # The last launch's out overlaps z: refused although the first two launches alone are fine.
    with pytest.raises(ValueError, match="out overlaps z"):
        C.sign_step(S, desc([2, 6, 6], address=ADDRESS + 4), desc([2, 6, 6], address=THIRD),
                    desc([2, 6, 6], address=FOURTH), 3.0, -3.2, 1.2, 0, 0)


# --- small_chain ------------------------------------------------------------------------------

STEPS = [(3.0, -3.2, 1.2)] * 8
W = desc([3, 24, 40])
X_WS = desc([3, 24, 40], address=OTHER)
G_WS = desc([3, 24, 24], address=THIRD)


def chain(C, w=W, out=None, x=X_WS, g=G_WS, p=2, steps=STEPS, *, shrink=1 / 1.01):
    out = desc([3, 24, 40], address=FOURTH) if out is None else out
    C.small_chain(w, out, x, g, p, steps, shrink, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"out": W},  # in place
        {"p": 0, "g": None},  # p = 0 keeps no Gram
        {"p": 3, "x": None, "g": None, "steps": []},  # odd p runs no Polar Express
        {"w": desc([3, 40, 24], strides=[960, 1, 40]), "out": desc([3, 40, 24], strides=[960, 1, 40], address=FOURTH),
         "x": desc([3, 40, 24], address=OTHER), "g": desc([3, 40, 40], address=THIRD)},  # a transposed view
        {"w": desc([3, 24, 40], dtype=BF16), "out": desc([3, 24, 40], dtype=BF16, address=FOURTH)},
        {"w": desc([3, 128, 40]), "out": desc([3, 128, 40], address=FOURTH), "x": desc([3, 128, 40], address=OTHER),
         "g": desc([3, 128, 128], address=THIRD), "p": 6},
    ],
)
def test_valid_chains_reach_the_device_check(no_gpu, kwargs):
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        chain(no_gpu, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"w": desc([3, 129, 200]), "out": desc([3, 129, 200], address=FOURTH)}, ValueError,
         r"the small side .* is 129; the chain takes at most 128"),
        ({"w": desc([3, 24, 40], dtype=F64)}, TypeError, "w: dtype float64 is not supported; .*left to torch"),
        ({"out": desc([3, 40, 24], address=FOURTH)}, ValueError, r"shape mismatch: w has shape \[3, 24, 40\]"),
        ({"p": -1}, ValueError, "p must be a non-negative integer, got -1"),
        ({"steps": []}, ValueError, r"1 to 64 Polar Express steps \(an even p needs at least one\), got 0"),
        ({"steps": STEPS * 9}, ValueError, "got 72"),
        ({"steps": [(3.0, float("nan"), 1.0)]}, ValueError, "coefficient nan of step 0 is not a finite"),
        ({"shrink": 1.5}, ValueError, r"shrink must be in \(0, 1\]"),
        ({"x": None}, ValueError, r"x_workspace is required for this p \(a float32 tensor of shape \[3, 24, 40\]\)"),
        ({"g": None}, ValueError, r"gram_workspace is required .*\[3, 24, 24\]"),
        ({"x": desc([3, 24, 40], dtype=F16, address=OTHER)}, TypeError, "x_workspace: dtype float16"),
        ({"g": desc([3, 24, 40], address=THIRD)}, ValueError, r"gram_workspace .*: expected shape \[3, 24, 24\]"),
        ({"x": desc([3, 24, 40], strides=[960, 1, 24], address=OTHER)}, ValueError, "x_workspace .*must be contiguous"),
        ({"x": desc([3, 24, 40], address=ADDRESS + 64)}, ValueError, "x_workspace overlaps w"),
        ({"g": desc([3, 24, 24], address=OTHER + 64)}, ValueError, "gram_workspace overlaps x_workspace"),
        ({"out": desc([3, 24, 40], address=ADDRESS + 4)}, ValueError, "out overlaps w"),
        ({"out": desc([3, 24, 40], strides=[0, 40, 1], address=FOURTH)}, ValueError, "elements overlap in memory"),
        ({"x": desc([3, 24, 40], address=OTHER, device=1)}, ValueError, "device mismatch"),
    ],
)
def test_chain_validation_comes_before_the_device(C, kwargs, error, match):
    with pytest.raises(error, match=match):
        chain(C, **kwargs)


def test_chain_limits_and_shared_memory(C):
    assert C.small_chain_max_side == 128
    assert C.small_chain_max_steps == 64
    # One R x R buffer, or two when p // 2 has two bits set (p = 6, 7), plus the chunk and a scalar.
    assert C.small_chain_shared_bytes(128, 4) == (128 * 128 + 128 * 34 + 1) * 4
    assert C.small_chain_shared_bytes(128, 6) == (2 * 128 * 128 + 128 * 34 + 1) * 4
    assert C.small_chain_shared_bytes(20, 2) == (32 * 32 + 32 * 36 + 1) * 4
    # What the A100 (163 KiB) and H100 (227 KiB) allow per block.
    assert C.small_chain_shared_bytes(128, 6) <= 163 * 1024


# --- decay_epilogue_ per-matrix scales --------------------------------------------------------


def test_decay_with_per_matrix_scales_reaches_the_device_check(no_gpu):
    with pytest.raises(RuntimeError, match=NO_DEVICE):
        no_gpu.decay_epilogue_(desc([3, 4, 5]), desc([3, 4, 5], address=OTHER), 1.0, -0.1, 0,
                               desc([3], address=THIRD), desc([3], address=FOURTH))


@pytest.mark.parametrize(
    "w, keep_pm, error, match",
    [
        (desc([4]), desc([1], address=THIRD), ValueError, r"per-matrix scales need a \(\.\.\., rows, cols\) tensor"),
        (desc([3, 4, 5]), desc([4], address=THIRD), ValueError, r"one value per matrix \(3\)"),
        (desc([3, 4, 5]), desc([3], dtype=F64, address=THIRD), TypeError, "per-matrix scales are float32"),
    ],
)
def test_decay_per_matrix_validation(C, w, keep_pm, error, match):
    with pytest.raises(error, match=match):
        C.decay_epilogue_(w, desc(w[1], address=OTHER), 1.0, -0.1, 0, keep_pm, None)


# --- the Python wrappers ----------------------------------------------------------------------


def test_wrappers_refuse_cpu_tensors_before_the_device(C):
    x = torch.zeros(2, 4, 4)
    for call in (
        lambda: _extension.gemm(x, x.clone(), torch.zeros(2, 4, 4)),
        lambda: _extension.syrk(x, x.mT, torch.zeros(2, 4, 4)),
        lambda: _extension.poly_step(x, torch.zeros(2, 4, 4), 1.0, 1.0),
        lambda: _extension.sign_step(x, torch.zeros(2, 4, 4), (3.0, -3.2, 1.2)),
        lambda: _extension.small_chain(x, torch.zeros(2, 4, 4), 2, STEPS),
        lambda: _extension.decay_epilogue_(x, x.clone(), 1.0, 0.0, keep_per_matrix=torch.ones(2)),
    ):
        with pytest.raises(ValueError, match="not a CUDA tensor"):
            call()


def test_wrappers_check_what_the_module_cannot_see(C):
    x = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="precision must be one of ieee, tf32x3, tf32, got 'bf16'"):
        _extension.gemm(x, x, torch.zeros(4, 4), precision="bf16")
    with pytest.raises(TypeError, match="gemm: alpha must be a Python number, not Tensor"):
        _extension.gemm(x, x, torch.zeros(4, 4), alpha=torch.tensor(1.0))
    with pytest.raises(TypeError, match="small_chain: p must be an int"):
        _extension.small_chain(x, torch.zeros(4, 4), 2.0, STEPS)
    with pytest.raises(RuntimeError, match="out requires grad"):
        _extension.gemm(x, x, torch.zeros(4, 4, requires_grad=True))
