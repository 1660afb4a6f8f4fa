"""Validate and time every GPU kernel and op against the PyTorch reference, in one command.

    timeout 540 python bench/gpu_check.py --out docs/results/gpu/$(date +%F)   # GPU: 8 minutes at most
    python bench/gpu_check.py --only syrk,decay    # cases whose name contains one of these
    python bench/gpu_check.py --dry-run            # CPU: Triton interpreter, tiny shapes (what the tests run)
    python bench/gpu_check.py --compile-only sm80,sm90   # no GPU: registers, spills, shared memory per kernel

It starts from a bare checkout (no install, no registry): it imports the package from the checkout and,
where ``spectral_ops._C`` is not built, builds it with CMake for the GPU's architecture first.

Order. A GPU may be lent for as little as 15 minutes, so the run is ordered by what matters most
should it be cut short:

1. check: every case -- the Triton and CUDA kernels, the plan's ops on each backend -- at each of its
   shapes (batched, odd, tall, wide, model-sized) and dtypes, against its reference (relative
   Frobenius error within the dtype's tolerance), untimed. CUDA cases come first: their kernels were
   compiled at build time, while each Triton specialisation JIT-compiles at its first launch (~120 of
   them, about a second each). This phase therefore holds all compile and warm-up time.
2. headline timings: the p = 2 decay at 4096x4096, 16384x4096 and 96 heads of 128x768, in bf16 and
   fp32, on Triton, on CUDA and wherever dispatch sends it; SYRK at 4096; a 4096^3 matmul as the
   yardstick; ``SpectralMuon`` against ``torch.optim.Muon`` (both orthogonalise in bf16); and a
   capturable ``SpectralAdamW`` step captured in a CUDA graph, replayed and compared with eager steps
   from the same start (last: a failed capture must not disturb the timings before it).
3. every other timing.

A timing is the median of CUDA-event-timed runs after one warm-up run (3 to 20 runs, about 200 ms of
them), against its baseline -- the torch call it replaces -- and only for a case whose check passed.
Timings are measurements of this machine, never assertions.

Time limits. ``--budget-s`` (default 420 s, build included) bounds the run: no check starts after 55%
of it, no headline timing after 80%, nothing after 100%; a case not started is reported as skipped.
Each case runs under its own limit (120 s for a check, 30 s for a timing, 90 s for the optimizer
cases; less if less of the budget is left): ``SIGALRM`` raises :class:`CaseTimeout` in the next Python
bytecode, the case is reported as timed out, and the run moves on. Timing loops also stop sampling
before the limit, so a slow case reports fewer runs rather than none. A signal cannot interrupt a
blocking call, though: a hung kernel, or a synchronisation waiting for one, hangs the run. The report
is rewritten after every case, so run the check under ``timeout``: the files keep everything before
the hang, and the last progress line without an ending names the hung case.

Expected on one H200 (an estimate: nothing has run on one yet): under a minute to build ``_C``, about
three for the checks, one or two for the headline timings, the rest of the budget for the other
timings. The budget caps it: 420 s plus Python's start-up and the report, about 8 minutes at most,
unless a kernel hangs (hence ``timeout 540`` above).

Every row has a ``status`` -- ok, failed, skipped (with the reason) or timed out (with the limit) --
and ``ok``: true, false, or null for skipped and timed out, which are no verdict. The markdown table
(``--out DIR``: ``DIR/gpu_check.md``) and the JSON (``--json``, default ``bench/gpu_check.json``, or
``DIR/gpu_check.json``) hold one row per case, shape and dtype in each phase, the time each phase
took and the counts per status. The exit status is 1 if any case failed, else 0 (the summary line
still counts the timed-out and skipped ones).

``--compile-only`` needs no GPU: it runs the Triton cases on CPU tensors with Triton's launcher
replaced by a recorder, compiles each distinct kernel specialisation it saw for the named targets
to a cubin (with Triton's bundled ``ptxas``, 12.8 in triton 3.7, which handles sm80 and sm90;
``TRITON_PTXAS_PATH`` names another), and reads each cubin's registers, stack frame, local and
shared memory with ``cuobjdump -res-usage`` (``bench/sass.py``); register spills show as a stack
frame. The same for every kernel of the built ``_C`` (its code for the target, as built: a target
it was not built for is reported as skipped). It exits 1 if a variant fails to compile or needs
more shared memory than the target has. ``--out DIR`` writes ``DIR/compile_only.md`` and ``.json``.
It relies on Triton's launcher internals (``JITFunction.run``, checked against triton 3.7).

Cases live in ``REGISTRY`` (:class:`Case`: a function, its reference, inputs, shapes, dtypes and
which shapes are headline timings); the CUDA extension's cases (``bench/cuda_cases.py``) are
registered like the Triton ones below. The optimizer cases and the yardstick are
:func:`special_tasks`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                        help="CPU tensors under TRITON_INTERPRET=1, tiny shapes, fp32/fp16, one timing run; "
                             "cases that need CUDA are reported as skipped")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"),
                        help="where to write the JSON results when --out is not given (default: bench/gpu_check.json)")
    parser.add_argument("--out", type=Path, help="write gpu_check.md and gpu_check.json (compile_only.md and .json "
                                                 "with --compile-only) into this folder, e.g. docs/results/gpu/DATE; "
                                                 "the routing cache goes to its routing/ folder; overrides --json")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names to run "
                                                   "(the optimizer cases and the yardstick included)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="the whole run's time limit in seconds, build included: checks start before 55%% "
                             "of it, headline timings before 80%%, and a running case is stopped at 100%% "
                             "(the default fits the run in 8 minutes)")
    parser.add_argument("--compile-only", metavar="ARCHS", default="",
                        help="no GPU: compile every Triton kernel variant the cases launch for these targets "
                             "(comma-separated: sm80, sm90) and report its registers, stack (spills) and shared "
                             "memory from cuobjdump, and those of the built _C's kernels, instead of running")
    return parser.parse_args(argv)


ROOT = Path(__file__).resolve().parents[1]


def use_this_checkout() -> None:
    """Import ``spectral_ops`` from this checkout even where the package is not installed (a bare GPU
    machine has torch and triton but no registry): the checkout goes on ``sys.path``, and
    ``spectral_ops.triton_kernels``, which an install maps to the top-level ``triton_kernels/``, is
    mapped to that folder."""
    if str(ROOT) not in sys.path and importlib.util.find_spec("spectral_ops") is None:
        sys.path.insert(0, str(ROOT))
    import spectral_ops

    if importlib.util.find_spec("spectral_ops.triton_kernels") is None:
        folder = ROOT / "triton_kernels"
        spec = importlib.util.spec_from_file_location("spectral_ops.triton_kernels", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        spectral_ops.triton_kernels = module


if __name__ == "__main__":
    # triton.jit reads this when the kernels are imported, just below; an importer sets it itself.
    _mode = parse(sys.argv[1:])
    if _mode.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    elif _mode.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    use_this_checkout()

import torch  # noqa: E402

import spectral_ops as so  # noqa: E402
from spectral_ops.backends.base import BandSpec, DecayRequest  # noqa: E402
from spectral_ops import plan  # noqa: E402
from spectral_ops.backends.cuda_backend import CudaBackend  # noqa: E402
from spectral_ops.backends.torch_backend import TorchBackend  # noqa: E402
from spectral_ops.backends.triton_backend import TritonBackend  # noqa: E402
from spectral_ops.coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients  # noqa: E402
from spectral_ops.dispatch import SELF_CHECK_TOLERANCE, TF32_SELF_CHECK_TOLERANCE, PinnedKernels  # noqa: E402
from spectral_ops.__main__ import routing_report  # noqa: E402
from spectral_ops.tuning import ENV_CACHE_DIR  # noqa: E402
from spectral_ops.linalg import relative_error  # noqa: E402
from spectral_ops.optim import SpectralAdamW, SpectralMuon  # noqa: E402
from spectral_ops.triton_kernels import decay, poly_step, sign_step, small, syrk, update  # noqa: E402

ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One fp32-accumulated product of exactly representable inputs, checked against fp32 math.
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}
# Results rounded to the input dtype once (decay written into the weight, ops' outputs).
ROUNDED_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
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


REGISTRY: list[Case] = []


def register(case: Case) -> Case:
    REGISTRY.append(case)
    return case


# ----- inputs -----

def _generator(device):
    return torch.Generator(device=device).manual_seed(0)


def weight(shape, dtype, device):
    """``(3 I + G / sqrt(max(m, n))) / 5`` for Gaussian ``G``: singular values within about [0.2, 1].

    Bounded away from zero, so every mode lies inside Polar Express's design range and two
    correct implementations differ only by round-off (a plain Gaussian square matrix has modes far
    below it, where the iteration amplifies round-off by up to ~6e3 by design).
    """
    m, n = shape[-2:]
    G = torch.randn(shape, generator=_generator(device), device=device) / math.sqrt(max(m, n))
    return {"W": ((3 * torch.eye(m, n, device=device) + G) / 5).to(dtype)}


def wide_and_factor(shape, dtype, device):
    """``X (..., r, n)`` and a symmetric ``M (..., r, r)`` with norm about 1, as in the iterations."""
    *batch, r, n = shape
    X = torch.randn(shape, generator=_generator(device), device=device) / math.sqrt(n)
    M = torch.randn((*batch, r, r), generator=_generator(device), device=device) / math.sqrt(4 * r)
    return {"X": X.to(dtype), "M": (M + M.mT).to(dtype)}


def symmetric(shape, dtype, device):
    A = torch.randn(shape, generator=_generator(device), device=device) / math.sqrt(2 * shape[-1])
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
    inputs=wide_and_factor,
    shapes=[(4096, 4096), (4096, 8192), (8, 1000, 3000)], tiny_shapes=[(2, 37, 50)], headline=[(4096, 4096)],
))
register(Case(
    "syrk X^T X (tall, no copy)", "triton",
    fn=lambda d: syrk.syrk(d["W"], trans=True, input_precision=PRECISION),
    reference=lambda d: f32(d["W"]).mT @ f32(d["W"]),
    baseline=lambda d: d["W"].mT @ d["W"], baseline_name="torch.bmm",
    inputs=weight,
    shapes=[(16384, 4096), (4, 3000, 1000)], tiny_shapes=[(50, 37)],
))
register(Case(
    "poly_step b A + c A A", "triton",
    fn=lambda d: poly_step.poly_step(d["A"], -4.775, 2.0315, input_precision=PRECISION),
    reference=lambda d: -4.775 * f32(d["A"]) + 2.0315 * f32(d["A"]) @ f32(d["A"]),
    baseline=lambda d: torch.baddbmm(d["A"], d["A"], d["A"], beta=-4.775, alpha=2.0315)
    if d["A"].dim() == 3 else torch.addmm(d["A"], d["A"], d["A"], beta=-4.775, alpha=2.0315),
    inputs=symmetric,
    shapes=[(4096, 4096), (8, 1000, 1000)], tiny_shapes=[(2, 37, 37)],
))
register(Case(
    "update a X + B X", "triton",
    fn=lambda d: update.polar_update(d["X"], d["M"], 3.4445, input_precision=PRECISION),
    reference=lambda d: 3.4445 * f32(d["X"]) + f32(d["M"]) @ f32(d["X"]),
    baseline=lambda d: torch.baddbmm(d["X"], d["M"], d["X"], beta=3.4445)
    if d["X"].dim() == 3 else torch.addmm(d["X"], d["M"], d["X"], beta=3.4445),
    inputs=wide_and_factor,
    shapes=[(4096, 4096), (4096, 16384), (8, 1000, 3000)], tiny_shapes=[(2, 37, 50)],
))


def _decay_right(d):
    """``W <- W - 0.1 W P`` for a tall weight: the operand is the weight itself (a workspace)."""
    return decay.decay_product_(d["W"], d["P"], alpha=1.0, beta=-0.1, side="right",
                                input_precision=PRECISION)


def _weight_and_projector(shape, dtype, device):
    d = weight(shape, dtype, device)
    P = symmetric((*shape[:-2], shape[-1], shape[-1]), torch.float32, device)["A"]
    return {**d, "P": P, "P_low": P.to(dtype)}


register(Case(
    "decay W <- W - s W P (in place)", "triton",
    fn=_decay_right,
    reference=lambda d: f32(d["W"]) - 0.1 * f32(d["W"]) @ d["P"],
    baseline=lambda d: d["W"].sub_(0.1 * (d["W"] @ d["P_low"])),
    inputs=_weight_and_projector, tolerance=ROUNDED_TOLERANCE,
    shapes=[(16384, 4096), (4, 3000, 1000)], tiny_shapes=[(2, 50, 37)],
))
register(Case(
    "sign step Z (3I - 16/5 Z^2 + 6/5 Z^4)", "triton",
    fn=lambda d: sign_step.sign_step(d["A"], input_precision=PRECISION),
    reference=lambda d: TORCH.sign_step(f32(d["A"]), NEWTON_SCHULZ_SIGN),
    baseline=lambda d: TORCH.sign_step(d["A"], NEWTON_SCHULZ_SIGN),
    inputs=symmetric,
    shapes=[(4096, 4096), (8, 1000, 1000)], tiny_shapes=[(2, 37, 37)],
))
register(Case(
    "small path S_2 (one program per matrix)", "triton",
    fn=lambda d: small.small_spectral(d["W"], 2, POLAR, input_precision=PRECISION),
    reference=lambda d: plan.spectral_power(TORCH, d["W"], 2, POLAR),
    inputs=weight, tolerance=SELF_CHECK_TOLERANCE,
    shapes=[(96, 128, 768), (512, 64, 64), (12, 100, 300)], tiny_shapes=[(3, 21, 45)],
))
register(Case(
    "small path msign", "triton",
    fn=lambda d: small.small_sign(d["A"], POLAR, input_precision=PRECISION),
    reference=lambda d: plan.msign(TORCH, d["A"], POLAR),
    inputs=symmetric, tolerance=SELF_CHECK_TOLERANCE,
    shapes=[(96, 128, 128), (12, 100, 100)], tiny_shapes=[(3, 27, 27)],
))


# ----- the plan's ops end to end (on Triton, on CUDA, as dispatch routes them), against the torch backend -----

def _op_case(name, call, shapes, tiny_shapes, dtypes=ALL_DTYPES, backend=TRITON, label="triton",
             tolerance=SELF_CHECK_TOLERANCE, headline=()):
    kernels = PinnedKernels(backend)
    register(Case(f"op {name}", label, fn=lambda d: call(kernels, d), reference=lambda d: call(TORCH, d),
                  inputs=weight, tolerance=tolerance, dtypes=dtypes, shapes=shapes, tiny_shapes=tiny_shapes,
                  baseline_name="torch backend", headline=list(headline)))


def _decay(p, band=None, precision=None, iteration="auto"):
    request = DecayRequest(p, 0.1, 0.01, band, "explicit", POLAR, POLAR, precision, iteration)
    return lambda b, d: plan.decay_(b, d["W"], request)


BIG = [(4096, 4096), (16384, 4096)]
HEADS = [(96, 128, 768)]  # a stacked per-head weight: 96 heads of 128 x 768
ODD = [(3, 1000, 700), (700, 1500)]
TINY = [(2, 40, 24)]  # batched and tall; wide inputs are covered by the kernel cases and the tests
_op_case("polar", lambda b, d: plan.polar(b, d["W"], POLAR), BIG + ODD, TINY)
_op_case("spectral_power p=2", lambda b, d: plan.spectral_power(b, d["W"], 2, POLAR), BIG + ODD, TINY)
_op_case("spectral_power p=3", lambda b, d: plan.spectral_power(b, d["W"], 3, POLAR), ODD, TINY)
# tau = 0.6 splits the inputs' spectrum (about [0.2, 1]) so that both projectors are far from zero.
_op_case("band_projectors", lambda b, d: plan.band_projectors(b, d["W"], 0.6, POLAR)[0], ODD, TINY)
_op_case("band_direction top", lambda b, d: plan.band_direction(b, d["W"], 2, BandSpec(0.6, "top"), POLAR, POLAR), ODD, TINY)
_op_case("svt", lambda b, d: plan.svt(b, d["W"], 0.5, POLAR, POLAR), ODD, TINY)
_op_case("msign", lambda b, d: plan.msign(b, d["W"] @ d["W"].mT - torch.eye(d["W"].shape[-2], device=d["W"].device,
                                                                      dtype=d["W"].dtype), POLAR), ODD[:1], TINY[:1])
_op_case("decay_ p=0", _decay(0), BIG + HEADS, TINY)
_op_case("decay_ p=2", _decay(2), BIG + HEADS + ODD, TINY, headline=BIG + HEADS)
# The same decay on the CUDA kernels (the plan composes them where the fused chain does not apply)...
_op_case("decay_ p=2", _decay(2), BIG + HEADS, [], backend=CudaBackend(), label="cuda", headline=BIG + HEADS)
# ... and as a user calls it: spectral_decay_ routed by dispatch (its checks and guard included).
register(Case(
    "op decay_ p=2", "auto",
    fn=lambda d: so.spectral_decay_(d["W"], 2, 1.0, 0.1, ordinary_weight_decay=0.01),
    reference=functools.partial(_decay(2), TORCH),
    inputs=weight, tolerance=SELF_CHECK_TOLERANCE, shapes=BIG + HEADS, tiny_shapes=TINY,
    baseline_name="torch backend", headline=BIG + HEADS, ran_on=lambda: so.last_backend("decay_"),
))
_op_case("decay_ p=2 band top", _decay(2, BandSpec(0.6, "top")), ODD, TINY)
# The iteration "auto" (the default) picks for fp32 16384x4096 is Gram space (#15); bf16 stays on the
# rectangle. This row is the rectangle at fp32, to compare with the "decay_ p=2" fp32 rows above (the
# FLOP model, symmetric products at half: 112 r^3 against 76, so Gram space about 1.47x faster).
_op_case("decay_ p=2 rectangle", _decay(2, iteration="rectangle"), BIG, TINY, dtypes=(torch.float32,))
# Every case runs at its dtype's default precision (bf16 weights: bf16 operands), against the torch
# backend at the same precision. The fp32 headline again with one TF32 pass per product (~1e-3 each).
_op_case("decay_ p=2 (tf32)", _decay(2, precision="tf32"), BIG + HEADS, [], dtypes=(torch.float32,),
         tolerance={torch.float32: TF32_SELF_CHECK_TOLERANCE})


# ----- the CUDA extension's kernels and ops (bench/cuda_cases.py), as cases of this registry -----

# The CUDA timing cases among the headline timings: SYRK with a side of 4096.
CUDA_HEADLINE = {"time/syrk/bf16/4096x16384", "time/syrk/fp32/4096x16384"}


def _bench_module(name: str):
    """A sibling module of this script (bench/ is no package, and this script may run from a bare checkout)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _register_cuda_cases() -> None:
    """Each CUDA case checks one kernel or op at one shape and dtype; the timing cases are also timed
    against the torch call they replace. They need a GPU: no tiny interpreter shapes."""
    cuda_cases = _bench_module("cuda_cases")
    for spec, timed in [(s, False) for s in cuda_cases.cases()] + [(s, True) for s in cuda_cases.timing_cases()]:
        register(Case(
            spec["name"], "cuda",
            fn=lambda d, spec=spec: spec["run"](*d["args"]),
            reference=lambda d, spec=spec: spec["reference"](*d["args"]),
            inputs=lambda shape, dtype, device, spec=spec: {"args": spec["make_inputs"](device)},
            shapes=[spec["shape"]], tiny_shapes=[], tolerance={spec["dtype"]: spec["tolerance"]},
            dtypes=(spec["dtype"],), timed=timed, headline=[spec["shape"]] if spec["name"] in CUDA_HEADLINE else [],
        ))


_register_cuda_cases()


# ----- measuring -----

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, dry_run, stop_at=math.inf) -> tuple[float, int]:
    """Median milliseconds of ``fn()`` and the number of runs: CUDA events after one warm-up run, as
    many runs as fill about 200 ms (3 to 20), fewer once ``stop_at`` (a ``time.monotonic()`` value)
    has passed; one wall-clock run when dry."""
    if dry_run:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, 1
    fn()
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    while True:
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
        if len(samples) >= max(3, min(20, int(200 / max(samples[0], 1e-3)))) or time.monotonic() > stop_at:
            return statistics.median(samples), len(samples)


def timings(fn, baseline, device, dry_run, stop_at=math.inf) -> dict:
    """``fn`` against ``baseline``, each sampled for at most half of the time left before ``stop_at``."""
    halfway = time.monotonic() + (stop_at - time.monotonic()) / 2
    ms, runs = time_ms(fn, device, dry_run, halfway)
    baseline_ms, baseline_runs = time_ms(baseline, device, dry_run, stop_at)
    return {"ms": ms, "baseline_ms": baseline_ms, "speedup": baseline_ms / ms, "runs": runs,
            "baseline_runs": baseline_runs}


def _clone(d):
    return {k: tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone() for k, v in d.items()}


def check_case(case: Case, shape, dtype, device, stop_at) -> dict:
    inputs = case.inputs(shape, dtype, device)
    error = relative_error(case.fn(_clone(inputs)), case.reference(_clone(inputs)))
    result = {"error": error, "tolerance": case.tolerance[dtype], "ok": error <= case.tolerance[dtype]}
    if case.ran_on is not None:
        result["note"] = f"ran on {case.ran_on()}"
    return result


def time_case(case: Case, shape, dtype, device, dry_run, stop_at) -> dict:
    inputs = case.inputs(shape, dtype, device)
    baseline = case.baseline or case.reference
    return {"ok": True, **timings(lambda: case.fn(inputs), lambda: baseline(inputs), device, dry_run, stop_at)}


# ----- the optimizer cases and the yardstick -----

MUON_SETTINGS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
MUON_VARIANTS = {"torch NS5": dict(ns_coefficients=so.MUON_QUINTIC, ns_steps=5), "Polar Express": {}}
MUON_SHAPES = [(1, 4096, 4096), (1, 16384, 4096), (96, 128, 768)]  # (heads, rows, cols): the decay's headline
# One step of SpectralMuon with torch's quintic against torch.optim.Muon's, both bf16 iterations that
# do not converge (the quintic oscillates): ~2e-2 apart on a CPU. A wrong one is off by O(1).
MUON_TOLERANCE = 5e-2
GRAPH_SHAPE = (1024, 4096)
# Replayed against eager steps, relative to how far the eager steps moved the parameters: the same
# kernels agree to round-off, while a value frozen at capture (a host-side step count) is off by %.
GRAPH_TOLERANCE = 1e-3


def muon_against_torch(heads, rows, cols, variant, device, dry_run, stop_at=math.inf) -> dict:
    """One SpectralMuon step and one torch.optim.Muon step at equal settings from the same start (zero
    weights, the same gradient), compared, then both timed. Ours updates the ``(heads * rows) x cols``
    matrix (head-wise when ``heads > 1``), torch's one parameter per head: how a user gets head-wise
    updates from it. Only torch's own iteration on one matrix is compared: Polar Express converges
    where the quintic does not, and head-wise SpectralMuon scales the lr by the whole block's shape,
    torch by each head's."""
    gradient = torch.randn(heads * rows, cols, generator=_generator(device), device=device)
    ours = torch.nn.Parameter(torch.zeros_like(gradient))
    ours.grad = gradient.clone()
    theirs = [torch.nn.Parameter(torch.zeros(rows, cols, device=device)) for _ in range(heads)]
    for param, grad in zip(theirs, gradient.split(rows)):
        param.grad = grad.clone()
    head_options = {"heads": heads} if heads > 1 else {}
    ours_step = SpectralMuon([ours], **MUON_SETTINGS, **MUON_VARIANTS[variant], **head_options).step
    theirs_step = torch.optim.Muon(theirs, **MUON_SETTINGS).step
    ours_step()
    theirs_step()
    result = {"ok": True}
    if variant == "torch NS5" and heads == 1:
        error = relative_error(ours.detach(), theirs[0].detach())
        result.update(error=error, tolerance=MUON_TOLERANCE, ok=error <= MUON_TOLERANCE)
    else:
        result["note"] = "timed only: a different iteration" if heads == 1 else "timed only: per-head lr scales differ"
    return {**result, **timings(ours_step, theirs_step, device, dry_run, stop_at)}


def _capturable_adamw(shape, device):
    """A capturable SpectralAdamW with the p = 2 decay on one weight and one bias, fixed gradients:
    every call starts from the same state."""
    W = torch.nn.Parameter(weight(shape, torch.float32, device)["W"])
    b = torch.nn.Parameter(torch.zeros(shape[-2], device=device))
    generator = _generator(device)
    for param in (W, b):
        param.grad = torch.randn(param.shape, generator=generator, device=device)
    optimizer = SpectralAdamW([W, b], lr=1e-3, weight_decay=0.01, p=2, spectral_weight_decay=0.1, stability="clamp",
                              capturable=True)
    return optimizer, [W, b]


@contextlib.contextmanager
def _side_stream(device):
    """CUDA-graph capture wants the steps before it off the default stream (torch's recipe)."""
    if device.type != "cuda":
        yield
        return
    current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


def cuda_graph(step):
    """``step`` captured in a CUDA graph (its launches recorded, not run), returned as the replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graph_against_eager(shape, device, dry_run, stop_at=math.inf, capture=cuda_graph, warmup=3, steps=5) -> dict:
    """A SpectralAdamW step, warmed up, captured by ``capture`` (the tests pass the step itself) and
    replayed ``steps`` times, against as many eager steps of a twin from the same state; then one
    replay timed against one eager step. A step that synchronises with the host cannot be captured:
    the capture raises, and the case fails with its message."""
    graphed, graphed_params = _capturable_adamw(shape, device)
    eager, eager_params = _capturable_adamw(shape, device)
    with _side_stream(device):
        for _ in range(warmup):
            graphed.step()
            eager.step()
    start = [param.detach().clone() for param in eager_params]
    replay = capture(graphed.step)
    for _ in range(steps):
        replay()
        eager.step()
    moved = max(float((param.detach() - first).abs().max()) for param, first in zip(eager_params, start))
    difference = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(graphed_params, eager_params))
    error = difference / moved
    return {"error": error, "tolerance": GRAPH_TOLERANCE, "ok": error <= GRAPH_TOLERANCE,
            "max_abs_diff": difference, "note": f"max abs difference {difference:.1e} after {steps} replays",
            **timings(replay, eager.step, device, dry_run, stop_at)}


def yardstick(n, dtype, device, dry_run, stop_at=math.inf) -> dict:
    """An ``n^3`` matmul: stacked per-head decay should be comparable to a 4096^3 GEMM."""
    A = torch.randn(n, n, generator=_generator(device), device=device).to(dtype)
    ms, runs = time_ms(lambda: A @ A, device, dry_run, stop_at)
    return {"ok": True, "ms": ms, "runs": runs, "note": f"{2 * n**3 / ms / 1e9:.1f} TFLOP/s"}


# ----- building the extension on a bare GPU machine -----

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


# ----- the run: tasks in order, each under a time limit -----

PHASES = ("check", "headline", "rest")
# No task of a phase starts after this fraction of the budget: a cut falls on the rest timings first.
PHASE_SHARE = {"check": 0.55, "headline": 0.8, "rest": 1.0}
HEADLINE_DTYPES = (torch.bfloat16, torch.float32)
CHECK_TIMEOUT_S = 120.0  # a check includes the JIT compile of every Triton specialisation it launches
TIMING_TIMEOUT_S = 30.0
OPTIMIZER_TIMEOUT_S = 90.0  # dispatch's first-use self-checks and compiles, then the steps
# Timing loops stop at this fraction of their limit: a slow case then reports fewer runs, not none.
SOFT_STOP = 0.8


class Skipped(Exception):
    """A task that cannot run here; the message says why."""


class CaseTimeout(BaseException):
    """A task ran past its limit. A BaseException, like KeyboardInterrupt, so that the code under test
    cannot swallow it: dispatch's self-check catches ``Exception`` from a kernel and disables it."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CaseTimeout` after ``seconds``, in the main thread at its next bytecode: never
    inside a blocking call (a launch, a synchronisation, a compile in C++), only once it returns."""
    def expire(signum, frame):
        raise CaseTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Task:
    """One row of the report. ``run(stop_at)`` returns its results, ``"ok"`` included, ends any timing
    loop by ``stop_at`` (a ``time.monotonic()`` value), and raises :class:`Skipped` if it cannot run
    here. ``needs``: the key of the check a timing waits on."""

    phase: str
    case: str
    backend: str
    dtype: str
    shape: tuple
    run: Callable[[float], dict]
    timeout_s: float
    baseline: str = ""
    needs: tuple | None = None

    @property
    def key(self) -> tuple:
        return self.case, self.backend, self.dtype, tuple(self.shape)

    def row(self, **results) -> dict:
        return {"phase": self.phase, "case": self.case, "backend": self.backend, "dtype": self.dtype,
                "shape": list(self.shape), "baseline": self.baseline, **results}


def _skipping(reason: str):
    def run(stop_at):
        raise Skipped(reason)
    return run


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _wanted(name: str, only: str) -> bool:
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    return not wanted or any(w in name for w in wanted)


def case_tasks(cases, device, dry_run, cuda_reason) -> list[Task]:
    """A check of every case at each of its shapes and dtypes, then the timings: headline, then rest."""
    checks, headline, rest = [], [], []
    # CUDA first: its kernels were compiled at build time, Triton's compile at their first launch.
    for case in sorted(cases, key=lambda case: case.backend != "cuda"):
        cannot = cuda_reason if case.backend == "cuda" else None
        if cannot is None and dry_run and not case.tiny_shapes:
            cannot = "GPU only: no interpreter-sized shape"
        if cannot is not None:  # one row for the whole case
            checks.append(Task("check", case.name, case.backend, _dtype_name(case.dtypes[0]), case.shapes[0],
                               _skipping(cannot), CHECK_TIMEOUT_S))
            continue
        dtypes = [d for d in case.dtypes if not (dry_run and d == torch.bfloat16)]
        for dtype in dtypes:
            for shape in case.tiny_shapes if dry_run else case.shapes:
                check = Task("check", case.name, case.backend, _dtype_name(dtype), shape,
                             functools.partial(check_case, case, shape, dtype, device),
                             case.timeout_s or CHECK_TIMEOUT_S)
                checks.append(check)
                if not case.timed:
                    continue
                is_headline = dtype in HEADLINE_DTYPES and bool(case.headline) and (dry_run or shape in case.headline)
                (headline if is_headline else rest).append(Task(
                    "headline" if is_headline else "rest", case.name, case.backend, _dtype_name(dtype), shape,
                    functools.partial(time_case, case, shape, dtype, device, dry_run),
                    case.timeout_s or TIMING_TIMEOUT_S, baseline=case.baseline_name, needs=check.key))
    return checks + headline + rest


def special_tasks(device, dry_run) -> list[Task]:
    """The headline cases that are not kernels: the yardstick, SpectralMuon against torch's, and the
    CUDA-graph replay, last, so that a failed capture cannot disturb the timings before it."""
    needs_cuda = None if device.type == "cuda" else "needs a CUDA device"
    n = 64 if dry_run else 4096
    tasks = [Task("headline", "torch matmul (yardstick)", "torch", _dtype_name(dtype), (n, n, n),
                  functools.partial(yardstick, n, dtype, device, dry_run), TIMING_TIMEOUT_S)
             for dtype in HEADLINE_DTYPES if not (dry_run and dtype == torch.bfloat16)]
    no_muon = needs_cuda or (None if hasattr(torch.optim, "Muon")
                             else f"torch {torch.__version__} has no torch.optim.Muon")
    for variant in MUON_VARIANTS:
        for heads, rows, cols in MUON_SHAPES:
            run = functools.partial(muon_against_torch, heads, rows, cols, variant, device, dry_run)
            tasks.append(Task("headline", f"SpectralMuon ({variant}, bf16) vs torch.optim.Muon", "auto", "float32",
                              (heads, rows, cols), _skipping(no_muon) if no_muon else run, OPTIMIZER_TIMEOUT_S,
                              baseline="torch.optim.Muon"))
    run = functools.partial(graph_against_eager, GRAPH_SHAPE, device, dry_run)
    tasks.append(Task("headline", "SpectralAdamW step in a CUDA graph", "auto", "float32", GRAPH_SHAPE,
                      _skipping(needs_cuda) if needs_cuda else run, OPTIMIZER_TIMEOUT_S, baseline="eager step"))
    return tasks


def run_task(task: Task, device, end: float) -> dict:
    """``task`` under its limit (or what is left before ``end``); every outcome is a row."""
    limit = min(task.timeout_s, end - time.monotonic())
    started = time.monotonic()
    try:
        with time_limit(limit):
            results = task.run(started + SOFT_STOP * limit)
            _sync(device)  # its kernels' errors and time belong to it
        row = task.row(**results, status="ok" if results["ok"] else "failed")
    except Skipped as skip:
        row = task.row(ok=None, status="skipped", reason=str(skip))
    except CaseTimeout:
        cause = "its limit" if limit == task.timeout_s else "the end of the time budget"
        row = task.row(ok=None, status="timed out", reason=f"stopped after {limit:.1f} s ({cause})")
        # What it queued must not run into the next task's timing; a hung kernel hangs here. A CUDA
        # error raised by the wait is not this task's verdict: it will fail the next task, with its message.
        with contextlib.suppress(Exception):
            _sync(device)
    except Exception as error:  # a crashing kernel is a failed case, reported with the rest
        row = task.row(ok=False, status="failed", reason=f"{type(error).__name__}: {error}"[:300])
    row["wall_s"] = round(time.monotonic() - started, 3)
    return row


NEEDED = {"failed": "its check failed", "timed out": "its check timed out", "skipped": "its check was skipped"}


def run_tasks(tasks, device, started: float, budget_s: float, save) -> list[dict]:
    """Every task in order, ``save(rows)`` after each: a run cut short (or hung) keeps what it did."""
    rows, status = [], {}
    for task in tasks:
        now = time.monotonic()
        print(f"{now - started:6.1f} s  {task.phase:<8} {task.case} [{task.backend}, {task.dtype}, "
              f"{'x'.join(map(str, task.shape))}] ...", end="", flush=True)
        phase_end = PHASE_SHARE[task.phase] * budget_s
        if task.needs is not None and status[task.needs] != "ok":
            row = task.row(ok=None, status="skipped", reason=NEEDED[status[task.needs]])
        elif now - started >= phase_end:
            row = task.row(ok=None, status="skipped", reason=f"time budget: no {task.phase} task starts after "
                                                             f"{phase_end:.0f} s")
        else:
            row = run_task(task, device, started + budget_s)
        status[task.key] = row["status"]
        rows.append(row)
        save(rows)
        print(f" {_status(row)}" + (f" ({row['wall_s']:.1f} s)" if "wall_s" in row else ""), flush=True)
    return rows


# ----- the report -----

def environment(device, cuda_reason) -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "input_precision": TRITON.input_precision, "cuda_extension": cuda_reason or "loaded",
    }


def summarise(report: dict) -> None:
    """Per phase, the seconds its tasks took (the check phase's include every JIT compile and first-use
    warm-up); per status, how many rows have it."""
    rows = report["results"]
    report["phase_s"] = {"build": report["build_s"], **{
        phase: round(sum(r.get("wall_s", 0.0) for r in rows if r["phase"] == phase), 1) for phase in PHASES}}
    report["summary"] = {status: sum(r["status"] == status for r in rows)
                         for status in ("ok", "failed", "timed out", "skipped")}


def _status(row) -> str:
    label = "**FAILED**" if row["status"] == "failed" else row["status"]
    return f"{label}: {row['reason']}" if row.get("reason") else label


def _number(key, spec):
    return lambda row: format(row[key], spec) if row.get(key) is not None else ""


_COMMON_COLUMNS = [("case", lambda r: r["case"]), ("backend", lambda r: r["backend"]), ("dtype", lambda r: r["dtype"]),
                   ("shape", lambda r: "x".join(map(str, r["shape"]))), ("status", _status)]
_CHECK_COLUMNS = _COMMON_COLUMNS + [("rel. error", _number("error", ".2e")), ("tol", _number("tolerance", ".0e")),
                                    ("note", lambda r: r.get("note", "")), ("s", _number("wall_s", ".1f"))]
_TIMING_COLUMNS = _COMMON_COLUMNS + [
    ("ms", _number("ms", ".3f")), ("baseline", lambda r: r["baseline"]), ("baseline ms", _number("baseline_ms", ".3f")),
    ("speedup", lambda r: f"{r['speedup']:.2f}x" if "speedup" in r else ""), ("runs", _number("runs", "d")),
    ("rel. error", _number("error", ".2e")), ("tol", _number("tolerance", ".0e")),
    ("note", lambda r: r.get("note", "")), ("s", _number("wall_s", ".1f"))]
_SECTIONS = {"check": ("1. Checks", _CHECK_COLUMNS), "headline": ("2. Headline timings", _TIMING_COLUMNS),
             "rest": ("3. Other timings", _TIMING_COLUMNS)}


def table(rows, columns) -> str:
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(value(row)) for _, value in columns) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    env, phase_s = report["environment"], report["phase_s"]
    lines = [f"# gpu_check on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}; CUDA extension: "
             f"{env['cuda_extension']}; budget {report['budget_s']:.0f} s.", "",
             f"Seconds: build {phase_s['build']:.0f}, checks {phase_s['check']:.0f} (every JIT compile and warm-up), "
             f"headline timings {phase_s['headline']:.0f}, other timings {phase_s['rest']:.0f}.", "",
             "Cases: " + ", ".join(f"{count} {status}" for status, count in report["summary"].items()) + "."]
    for phase, (title, columns) in _SECTIONS.items():
        rows = [row for row in report["results"] if row["phase"] == phase]
        lines += ["", f"## {title}", "", table(rows, columns) if rows else "(none)"]
    lines += ["", "## 4. Measured routing", "", "What dispatch measured and chose during this run (the cases "
              "routed \"auto\" use it).", "", report.get("routing", "(not yet)")]
    return "\n".join(lines) + "\n"


def _report_paths(args, stem: str) -> tuple[Path, Path | None]:
    """``--out DIR``: ``DIR/<stem>.json`` and ``DIR/<stem>.md``; else ``--json`` and no markdown file."""
    if args.out is None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        return args.json, None
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out / f"{stem}.json", args.out / f"{stem}.md"


# ----- compiling without a GPU -----

SASS = _bench_module("sass")  # resource usage and SASS read with cuobjdump

# Shared memory a block may use (opt-in maximum), per target.
SHARED_MEMORY_LIMIT = {"sm80": 166912, "sm90": 232448}
STATIC_SHARED_LIMIT = 48 * 1024  # static __shared__ arrays; beyond it a kernel must use dynamic shared memory


def record_launches(args, arch: str) -> dict:
    """Every distinct kernel specialisation the selected cases launch with ``arch``'s configs.

    The cases run on CPU tensors; each launch is bound and specialised exactly as Triton's
    launcher would for that target, then recorded instead of compiled and run (outputs stay
    uninitialised, which no host-side decision depends on).
    """
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from spectral_ops.triton_kernels import common

    target = GPUTarget("cuda", int(arch[2:]), 32)
    backend = make_backend(target)
    launches = {}

    def record(kernel, *args, grid, warmup, **kwargs):
        kwargs.update(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        key = (kernel.fn.__name__, str(signature), str(sorted(constexprs.items())), str(attrs), str(options))
        launches.setdefault(key, (kernel, signature, constexprs, attrs, options))

    real_run, real_arch = JITFunction.run, common.arch
    JITFunction.run, common.arch = record, (lambda device: arch)
    try:
        for case in (case for case in REGISTRY if case.backend == "triton" and _wanted(case.name, args.only)):
            for dtype in case.dtypes:
                for shape in case.tiny_shapes if args.dry_run else case.shapes:
                    case.fn(case.inputs(shape, dtype, torch.device("cpu")))
    finally:
        JITFunction.run, common.arch = real_run, real_arch
    return launches


def _resources(usage: dict) -> dict:
    """One kernel's ``cuobjdump -res-usage`` fields, as the report names them. Register spills and
    local arrays show as a stack frame (or local memory)."""
    return {"registers": usage["registers"], "stack": usage.get("stack", 0), "local": usage.get("local", 0),
            "static_shared": usage.get("shared", 0)}


def compile_launches(launches: dict, arch: str) -> list[dict]:
    """Each recorded specialisation compiled for ``arch`` by Triton (its bundled ``ptxas``, or the one
    ``TRITON_PTXAS_PATH`` names), its cubin read back with cuobjdump: what the GPU would load."""
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", int(arch[2:]), 32)
    ptxas = knobs.nvidia.ptxas
    rows = []
    for kernel, signature, constexprs, attrs, options in launches.values():
        flags = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()
                 if kernel.arg_names[path[0]].isupper()}
        pointers = sorted({kind for kind in signature.values() if kind.startswith("*")})
        row = {"source": "triton", "kernel": kernel.fn.__name__, "arch": arch, "operands": " ".join(pointers),
               "num_warps": options.num_warps, "num_stages": options.num_stages, "constexprs": flags,
               "ptxas": f"{ptxas.version} ({ptxas.path})"}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        except Exception as error:
            rows.append({**row, "ok": False, "status": "failed", "reason": f"{type(error).__name__}: {error}"[:500]})
            continue
        with tempfile.TemporaryDirectory() as folder:
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            row.update(_resources(SASS.resource_usage(cubin)[compiled.metadata.name]))
        # Triton asks for its shared memory at launch (dynamic); static arrays come on top.
        row["shared"] = compiled.metadata.shared + row["static_shared"]
        row["ok"] = row["shared"] <= SHARED_MEMORY_LIMIT[arch]
        row["status"] = "ok" if row["ok"] else "failed"
        if not row["ok"]:
            row["reason"] = f"needs {row['shared']} B of shared memory, {arch} has {SHARED_MEMORY_LIMIT[arch]}"
        rows.append(row)
    return rows


def extension_resources(arch: str) -> list[dict]:
    """Every kernel of the built ``spectral_ops._C`` for ``arch``, read from its SASS with cuobjdump
    (no GPU, no rebuild: it says what that build holds). cuobjdump sees static shared memory only;
    the fused chain sizes its dynamic shared memory at launch, from the matrix size."""
    found = importlib.util.find_spec("spectral_ops._C")
    head = {"source": "_C", "kernel": "spectral_ops._C", "arch": arch}
    if found is None:
        return [{**head, "ok": None, "status": "skipped", "reason": "not built (python -m spectral_ops says why)"}]
    gpu = f"sm_{arch[2:]}"
    usage = SASS.resource_usage(found.origin, arch=gpu)
    if not usage:
        return [{**head, "ok": None, "status": "skipped", "reason": f"the build holds no {gpu} code (python -m "
                 "spectral_ops lists what it holds): set SPECTRAL_OPS_CUDA_ARCHS and rebuild"}]
    names = SASS.demangle(usage)
    rows = []
    for name in sorted(usage, key=names.get):
        row = {**head, "kernel": names[name], **_resources(usage[name])}
        row["ok"] = row["static_shared"] <= STATIC_SHARED_LIMIT
        row["status"] = "ok" if row["ok"] else "failed"
        rows.append(row)
    return rows


_RESOURCE_COLUMNS = [("registers", _number("registers", "d")), ("stack B", _number("stack", "d")),
                     ("local B", _number("local", "d"))]
_TRITON_COLUMNS = [("kernel", lambda r: r["kernel"]), ("arch", lambda r: r["arch"]),
                   ("operands", lambda r: r["operands"]), ("warps", lambda r: r["num_warps"]),
                   ("stages", lambda r: r["num_stages"]), *_RESOURCE_COLUMNS,
                   ("shared KiB", lambda r: f"{r['shared'] / 1024:.1f}" if "shared" in r else ""),
                   ("status", _status), ("constexprs", lambda r: r["constexprs"])]
_EXTENSION_COLUMNS = [("kernel", lambda r: r["kernel"]), ("arch", lambda r: r["arch"]), *_RESOURCE_COLUMNS,
                      ("static shared KiB", lambda r: f"{r['static_shared'] / 1024:.1f}" if "static_shared" in r
                       else ""), ("status", _status)]


def compile_only(args) -> int:
    import triton.runtime.interpreter
    from triton import knobs

    from spectral_ops.triton_kernels import syrk as any_kernel_module

    if isinstance(any_kernel_module.symmetric_kernel, triton.runtime.interpreter.InterpretedFunction):
        print("--compile-only needs compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    archs = [a.strip() for a in args.compile_only.split(",") if a.strip()]
    unknown = [arch for arch in archs if arch not in SHARED_MEMORY_LIMIT]
    if unknown:
        print(f"unknown target(s) {unknown}; known: {', '.join(SHARED_MEMORY_LIMIT)}", file=sys.stderr)
        return 2
    rows = []
    for arch in archs:
        rows += compile_launches(record_launches(args, arch), arch)
        rows += extension_resources(arch)
    text = "\n".join([
        f"# Kernel resources for {', '.join(archs)} (cuobjdump {SASS.find_cuobjdump()}; Triton's ptxas "
        f"{knobs.nvidia.ptxas.version})", "",
        "## Triton kernels (one row per specialisation the cases launch)", "",
        table([r for r in rows if r["source"] == "triton"], _TRITON_COLUMNS), "",
        "## spectral_ops._C (static shared memory only; dynamic is set at launch)", "",
        table([r for r in rows if r["source"] == "_C"], _EXTENSION_COLUMNS), ""])
    print(text)
    json_path, markdown_path = _report_paths(args, "compile_only")
    json_path.write_text(json.dumps({"compile_only": rows}, indent=1, default=str))
    if markdown_path is not None:
        markdown_path.write_text(text)
    print(f"wrote {json_path}" + (f" and {markdown_path}" if markdown_path is not None else ""))
    return 1 if any(r["ok"] is False for r in rows) else 0


def main(args) -> int:
    if args.compile_only:
        return compile_only(args)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter smoke test", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.out is not None:
        # The routing this run measures (and reuses) is kept with its results.
        os.environ[ENV_CACHE_DIR] = str(args.out / "routing")
    if not args.dry_run:
        build_extension_if_needed(device)
    cuda_reason = CudaBackend().unavailable_reason(device)
    tasks = case_tasks([case for case in REGISTRY if _wanted(case.name, args.only)], device, args.dry_run, cuda_reason)
    tasks += [task for task in special_tasks(device, args.dry_run) if _wanted(task.case, args.only)]
    tasks.sort(key=lambda task: PHASES.index(task.phase))  # stable: the order within each phase stays
    report = {"environment": environment(device, cuda_reason), "budget_s": args.budget_s,
              "build_s": round(time.monotonic() - started, 1), "results": []}
    json_path, markdown_path = _report_paths(args, "gpu_check")

    def save(rows):
        report["results"] = rows
        report["routing"] = routing_report()
        summarise(report)
        json_path.write_text(json.dumps(report, indent=1))
        if markdown_path is not None:
            markdown_path.write_text(markdown(report))

    save(run_tasks(tasks, device, started, args.budget_s, save))
    print()
    print(markdown(report))
    print(f"wrote {json_path}" + (f" and {markdown_path}" if markdown_path is not None else ""))
    # Skipped and timed-out cases are no verdict: they do not fail the run, the summary counts them.
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(parse(sys.argv[1:])))
