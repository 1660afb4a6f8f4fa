"""The case registry: every Triton kernel, every op of the plan (on Triton, on CUDA and as dispatch
routes it) and the CUDA extension's kernels and ops, each with its reference, inputs and shapes.

Cases live in ``REGISTRY`` (:class:`Case`: a function, its reference, inputs, shapes, dtypes and
which shapes are headline timings); the CUDA extension's cases (``bench/cuda_cases.py``) are
registered like the Triton ones below. The optimizer cases and the yardstick are
:func:`special_cases.special_tasks`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

import spectral_ops as so
from spectral_ops import plan
from spectral_ops.backends.cuda_backend import CudaBackend
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.backends.triton_backend import TritonBackend
from spectral_ops.coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients
from spectral_ops.dispatch import PinnedKernels
from spectral_ops.plan import Band, DecayRequest
from spectral_ops.selfcheck import SELF_CHECK_TOLERANCE, TF32_SELF_CHECK_TOLERANCE
from spectral_ops.triton_kernels import poly_step, sign_step, small, syrk, update

from .checkout import bench_module

ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One fp32-accumulated product of exactly representable inputs, checked against fp32 math.
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}
POLAR = polar_express_coefficients()


@dataclass
class Case:
    """One validated and timed kernel or op.

    ``inputs(shape, dtype, device)`` builds a dict; ``fn`` and ``reference`` take it and return a
    tensor; ``baseline`` (default: ``reference``) is what ``fn`` is timed against. ``fn`` gets fresh
    clones of the inputs for its check, so in-place kernels can be validated. ``headline``: the
    shapes timed among the headline timings (in bf16 and fp32; in the dry run, the tiny shapes
    stand in for them); ``timed=False`` cases are only checked. ``timeout_s`` replaces the default
    limits of both its check and its timing; ``ran_on()``, called after the check, says which
    backend(s) an automatically routed case ran on.
    """

    name: str
    backend: str
    fn: Callable[[dict], torch.Tensor]
    reference: Callable[[dict], torch.Tensor]
    inputs: Callable[[tuple, torch.dtype, torch.device], dict]
    shapes: list[tuple]
    tiny_shapes: list[tuple]
    tolerance: dict = field(default_factory=lambda: KERNEL_TOLERANCE)
    dtypes: tuple = ALL_DTYPES
    baseline: Callable[[dict], torch.Tensor] | None = None
    baseline_name: str = "torch"
    headline: list[tuple] = field(default_factory=list)
    timed: bool = True
    timeout_s: float | None = None
    ran_on: Callable[[], str | None] | None = None
    precision: str | None = None
    primitive: str | None = None
    op: str | None = None
    op_options: dict = field(default_factory=dict)


REGISTRY: list[Case] = []


def register(case: Case) -> Case:
    REGISTRY.append(case)
    return case


def selected(name: str, only: str) -> bool:
    """Whether ``--only`` (comma-separated substrings of names; empty: all) selects the case or task ``name``."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    return not wanted or any(w in name for w in wanted)


# ----- inputs -----

def seeded_generator(device):
    return torch.Generator(device=device).manual_seed(0)


def weight(shape, dtype, device):
    """``(3 I + G / sqrt(max(m, n))) / 5`` for Gaussian ``G``: singular values within about [0.2, 1].

    Bounded away from zero, so every mode lies inside Polar Express's design range and two
    correct implementations differ only by round-off (a plain Gaussian square matrix has modes far
    below it, where the iteration amplifies round-off by up to ~6e3 by design).
    """
    m, n = shape[-2:]
    G = torch.randn(shape, generator=seeded_generator(device), device=device) / math.sqrt(max(m, n))
    return {"W": ((3 * torch.eye(m, n, device=device) + G) / 5).to(dtype)}


def wide_and_factor(shape, dtype, device):
    """``X (..., r, n)`` and a symmetric ``M (..., r, r)`` with norm about 1, as in the iterations."""
    *batch, r, n = shape
    X = torch.randn(shape, generator=seeded_generator(device), device=device) / math.sqrt(n)
    M = torch.randn((*batch, r, r), generator=seeded_generator(device), device=device) / math.sqrt(4 * r)
    return {"X": X.to(dtype), "M": (M + M.mT).to(dtype)}


def symmetric(shape, dtype, device):
    A = torch.randn(shape, generator=seeded_generator(device), device=device) / math.sqrt(2 * shape[-1])
    A = A + A.mT
    return {"A": (A / torch.linalg.matrix_norm(A)[..., None, None]).to(dtype)}


def f32(t):
    return t.float()


# ----- the Triton kernels -----

TRITON = TritonBackend()
TORCH = PinnedKernels(TorchBackend())
PRECISION = TRITON.input_precision


register(Case(
    "syrk X X^T", "triton",
    fn=lambda d: syrk.syrk(d["X"], input_precision=PRECISION),
    reference=lambda d: f32(d["X"]) @ f32(d["X"]).mT,
    baseline=lambda d: d["X"] @ d["X"].mT, baseline_name="torch.bmm",
    inputs=wide_and_factor, primitive="symmetric",
    shapes=[(4096, 4096), (4096, 8192), (8, 1000, 3000)], tiny_shapes=[(2, 37, 50)], headline=[(4096, 4096)],
))
register(Case(
    "syrk X^T X (tall, no copy)", "triton",
    fn=lambda d: syrk.syrk(d["W"], trans=True, input_precision=PRECISION),
    reference=lambda d: f32(d["W"]).mT @ f32(d["W"]),
    baseline=lambda d: d["W"].mT @ d["W"], baseline_name="torch.bmm",
    inputs=weight, primitive="symmetric",
    shapes=[(16384, 4096), (4, 3000, 1000)], tiny_shapes=[(50, 37)],
))
register(Case(
    "poly_step b A + c A A", "triton",
    fn=lambda d: poly_step.poly_step(d["A"], -4.775, 2.0315, input_precision=PRECISION),
    reference=lambda d: -4.775 * f32(d["A"]) + 2.0315 * f32(d["A"]) @ f32(d["A"]),
    baseline=lambda d: torch.baddbmm(d["A"], d["A"], d["A"], beta=-4.775, alpha=2.0315)
    if d["A"].dim() == 3 else torch.addmm(d["A"], d["A"], d["A"], beta=-4.775, alpha=2.0315),
    inputs=symmetric, primitive="poly_step",
    shapes=[(4096, 4096), (8, 1000, 1000)], tiny_shapes=[(2, 37, 37)],
))
register(Case(
    "update a X + B X", "triton",
    fn=lambda d: update.polar_update(d["X"], d["M"], 3.4445, input_precision=PRECISION),
    reference=lambda d: 3.4445 * f32(d["X"]) + f32(d["M"]) @ f32(d["X"]),
    baseline=lambda d: torch.baddbmm(d["X"], d["M"], d["X"], beta=3.4445)
    if d["X"].dim() == 3 else torch.addmm(d["X"], d["M"], d["X"], beta=3.4445),
    inputs=wide_and_factor, primitive="product",
    shapes=[(4096, 4096), (4096, 16384), (8, 1000, 3000)], tiny_shapes=[(2, 37, 50)], headline=[(4096, 4096)],
))
# The Gram and the product with one TF32 pass, against cuBLAS with TF32 allowed: the fp32 rows above
# compare the kernels' default 3xTF32 with exact fp32 cuBLAS. Each operand rounded to TF32 (unit
# round-off 2^-11, about 4.9e-4) gives a relative error of about 1e-3; 4e-3 leaves a margin of ~4.
TF32_PRODUCT_TOLERANCE = {torch.float32: 4e-3}
register(Case(
    "syrk X X^T (tf32)", "triton",
    fn=lambda d: syrk.syrk(d["X"], input_precision="tf32"),
    reference=lambda d: d["X"] @ d["X"].mT, baseline_name="torch.bmm (tf32)",
    inputs=wide_and_factor, primitive="symmetric", precision="tf32", dtypes=(torch.float32,),
    tolerance=TF32_PRODUCT_TOLERANCE, shapes=[(4096, 4096)], tiny_shapes=[(2, 37, 50)], headline=[(4096, 4096)],
))
register(Case(
    "update a X + B X (tf32)", "triton",
    fn=lambda d: update.polar_update(d["X"], d["M"], 3.4445, input_precision="tf32"),
    reference=lambda d: torch.addmm(d["X"], d["M"], d["X"], beta=3.4445), baseline_name="torch.addmm (tf32)",
    inputs=wide_and_factor, primitive="product", precision="tf32", dtypes=(torch.float32,),
    tolerance=TF32_PRODUCT_TOLERANCE, shapes=[(4096, 4096)], tiny_shapes=[(37, 50)], headline=[(4096, 4096)],
))


register(Case(
    "sign step Z (3I - 16/5 Z^2 + 6/5 Z^4)", "triton",
    fn=lambda d: sign_step.sign_step(d["A"], input_precision=PRECISION),
    reference=lambda d: TORCH.sign_step(f32(d["A"]), NEWTON_SCHULZ_SIGN),
    baseline=lambda d: TORCH.sign_step(d["A"], NEWTON_SCHULZ_SIGN),
    inputs=symmetric, primitive="sign_step",
    shapes=[(4096, 4096), (8, 1000, 1000)], tiny_shapes=[(2, 37, 37)],
))
register(Case(
    "small path S_2 (one program per matrix)", "triton",
    fn=lambda d: small.small_spectral(d["W"], 2, POLAR, input_precision=PRECISION),
    reference=lambda d: plan.spectral_power(TORCH, d["W"], 2, POLAR),
    inputs=weight, tolerance=SELF_CHECK_TOLERANCE, primitive="small_chain",
    shapes=[(96, 128, 768), (512, 64, 64), (12, 100, 300)], tiny_shapes=[(3, 21, 45)], headline=[(96, 128, 768)],
))
register(Case(
    "small path msign", "triton",
    fn=lambda d: small.small_sign(d["A"], POLAR, input_precision=PRECISION),
    reference=lambda d: plan.msign(TORCH, d["A"], POLAR),
    inputs=symmetric, tolerance=SELF_CHECK_TOLERANCE, primitive="small_chain",
    shapes=[(96, 128, 128), (12, 100, 100)], tiny_shapes=[(3, 27, 27)],
))


# ----- the plan's ops end to end (on Triton, on CUDA, as dispatch routes them), against the torch backend -----

def _op_case(name, call, shapes, tiny_shapes, dtypes=ALL_DTYPES, backend=TRITON, label="triton",
             tolerance=SELF_CHECK_TOLERANCE, headline=(), precision=None, op=None, **op_options):
    kernels = PinnedKernels(backend)
    register(Case(f"op {name}", label, fn=lambda d: call(kernels, d), reference=lambda d: call(TORCH, d),
                  inputs=weight, tolerance=tolerance, dtypes=dtypes, shapes=shapes, tiny_shapes=tiny_shapes,
                  baseline_name="torch backend", headline=list(headline), precision=precision,
                  op=op or name.split()[0], op_options=op_options))


def _decay(p, band=None, precision=None, iteration="auto", rounding="nearest"):
    def decayed(kernels, d):
        # A generator seeded afresh per call: a stochastic rounding draws the same bits for the case and
        # its reference, so that they differ only as their directions do.
        generator = torch.Generator(d["W"].device).manual_seed(0)
        request = DecayRequest(p, 1.0, 0.1, 0.01, band, "explicit", POLAR, POLAR, precision, iteration,
                               rounding=rounding, generator=generator)
        plan.decay_(kernels, d["W"], request)  # in place, as the weights are
        return d["W"]
    return decayed


BIG = [(4096, 4096), (16384, 4096)]
HEADS = [(96, 128, 768)]  # a stacked per-head weight: 96 heads of 128 x 768
ODD = [(3, 1000, 700), (700, 1500)]
TINY = [(2, 40, 24)]  # batched and tall; wide inputs are covered by the kernel cases and the tests
_op_case("polar", lambda b, d: plan.polar(b, d["W"], POLAR), BIG + ODD, TINY, headline=BIG[:1])
_op_case("spectral_power p=2", lambda b, d: plan.spectral_power(b, d["W"], 2, POLAR), BIG + ODD, TINY, p=2)
_op_case("spectral_power p=3", lambda b, d: plan.spectral_power(b, d["W"], 3, POLAR), ODD, TINY, p=3)
# tau = 0.6 splits the inputs' spectrum (about [0.2, 1]) so that both projectors are far from zero.
_op_case("band_projectors", lambda b, d: plan.band_projectors(b, d["W"], 0.6, POLAR)[0], ODD, TINY)
_op_case("band_direction top", lambda b, d: plan.band_direction(b, d["W"], 2, Band(0.6, "top"), POLAR, POLAR),
         ODD, TINY, p=2, band_mode="top")
_op_case("svt", lambda b, d: plan.svt(b, d["W"], 0.5, POLAR, POLAR), ODD, TINY)
_op_case("msign", lambda b, d: plan.msign(b, d["W"] @ d["W"].mT - torch.eye(d["W"].shape[-2], device=d["W"].device,
                                                                      dtype=d["W"].dtype), POLAR), ODD[:1], TINY[:1])
_op_case("decay_ p=0", _decay(0), BIG + HEADS, TINY, p=0)
_op_case("decay_ p=2", _decay(2), BIG + HEADS + ODD, TINY, headline=BIG + HEADS, p=2)
# The same decay on the CUDA kernels (the plan composes them where the fused chain does not apply)...
_op_case("decay_ p=2", _decay(2), BIG + HEADS, [], backend=CudaBackend(), label="cuda", headline=BIG + HEADS, p=2)
# ... and as a user calls it: spectral_decay_ routed by dispatch (its checks and guard included).
register(Case(
    "op decay_ p=2", "auto",
    fn=lambda d: so.spectral_decay_(d["W"], 2, 1.0, 0.1, ordinary_weight_decay=0.01),
    reference=functools.partial(_decay(2), TORCH),
    inputs=weight, tolerance=SELF_CHECK_TOLERANCE, shapes=BIG + HEADS, tiny_shapes=TINY,
    baseline_name="torch backend", headline=BIG + HEADS, ran_on=lambda: so.last_backend("decay_"),
    op="decay_", op_options={"p": 2},
))
_op_case("decay_ p=2 band top", _decay(2, Band(0.6, "top")), ODD, TINY, p=2, band_mode="top")
# Stochastic rounding of 16-bit weights in the Triton and CUDA epilogues, from the same random bits.
_op_case("decay_ p=2 stochastic rounding", _decay(2, rounding="stochastic"), ODD, TINY,
         dtypes=(torch.bfloat16, torch.float16), p=2)
_op_case("decay_ p=2 stochastic rounding", _decay(2, rounding="stochastic"), ODD, [], backend=CudaBackend(),
         label="cuda", dtypes=(torch.bfloat16, torch.float16), p=2)
# The iteration "auto" (the default) picks for fp32 16384x4096 is Gram space (#15); bf16 stays on the
# rectangle. This row is the rectangle at fp32, to compare with the "decay_ p=2" fp32 rows above (the
# FLOP model, symmetric products at half: 112 r^3 against 76, so Gram space about 1.47x faster).
_op_case("decay_ p=2 rectangle", _decay(2, iteration="rectangle"), BIG, TINY, dtypes=(torch.float32,), p=2,
         iteration="rectangle")
# Every case runs at its dtype's default precision (bf16 weights: bf16 operands), against the torch
# backend at the same precision. The fp32 headline again with one TF32 pass per product (~1e-3 each).
_op_case("decay_ p=2 (tf32)", _decay(2, precision="tf32"), BIG + HEADS, [], dtypes=(torch.float32,),
         tolerance={torch.float32: TF32_SELF_CHECK_TOLERANCE}, precision="tf32", p=2)


# ----- the CUDA extension's kernels and ops (bench/cuda_cases.py), as cases of this registry -----

# The CUDA timing cases among the headline timings: SYRK with a side of 4096.
CUDA_HEADLINE = {"time/syrk/bf16/4096x16384", "time/syrk/fp32/4096x16384"}


# The extension's entry points as the cost model and the router name their primitives (small_chain's
# cases run one power each, which the model does not price on its own: no model columns).
CUDA_PRIMITIVES = {"gemm": "product", "syrk": "symmetric", "poly_step": "poly_step", "sign_step": "sign_step",
                   "decay_epilogue_": "decay_epilogue_"}


def _register_cuda_cases() -> None:
    """Each CUDA case checks one kernel or op at one shape and dtype; the timing cases are also timed
    against the torch call they replace. They need a GPU: no tiny interpreter shapes."""
    cuda_cases = bench_module("cuda_cases")
    for spec, timed in [(s, False) for s in cuda_cases.cases()] + [(s, True) for s in cuda_cases.timing_cases()]:
        op = spec["op"].removeprefix("backend.").split("[")[0]
        register(Case(
            spec["name"], "cuda",
            fn=lambda d, spec=spec: spec["run"](*d["args"]),
            reference=lambda d, spec=spec: spec["reference"](*d["args"]),
            baseline=lambda d, spec=spec: spec["baseline"](*d["args"]),
            inputs=lambda shape, dtype, device, spec=spec: {"args": spec["make_inputs"](device)},
            shapes=[spec["shape"]], tiny_shapes=[], tolerance={spec["dtype"]: spec["tolerance"]},
            dtypes=(spec["dtype"],), timed=timed, headline=[spec["shape"]] if spec["name"] in CUDA_HEADLINE else [],
            primitive=CUDA_PRIMITIVES.get(op), op=None if op in CUDA_PRIMITIVES or op == "small_chain" else op,
            op_options=spec["op_options"], precision=spec["precision"],
        ))


_register_cuda_cases()
