"""Validate and time every GPU kernel and op against the PyTorch reference, in one command.

    python bench/gpu_check.py                      # GPU: full sizes, fp32/bf16/fp16 (< 8 min on one H200)
    python bench/gpu_check.py --only syrk,decay    # cases whose name contains one of these
    python bench/gpu_check.py --dry-run            # CPU: Triton interpreter, tiny shapes (what the tests run)
    python bench/gpu_check.py --compile-only sm80,sm90   # no GPU: compile every variant for those targets

Each case runs the kernel (or backend op) on batched, odd, tall and wide inputs, checks it against
its reference (relative Frobenius error within the dtype's tolerance), then times it and its
baseline -- the torch call it replaces -- with CUDA events (median of several runs). It prints a
markdown table, writes JSON (``--json``, default ``bench/gpu_check.json``) and exits 1 if any
case fails its check. Timings are measurements of this machine, never assertions.

``--compile-only`` needs no GPU: it runs every case on CPU tensors with Triton's launcher replaced
by a recorder, then compiles each distinct kernel specialisation it saw for the named targets and
reports shared memory, registers and spill bytes (from the bundled ``ptxas``). It exits 1 if a
variant fails to compile or needs more shared memory than the target has. It relies on Triton's
launcher internals (``JITFunction.run``, checked against triton 3.7).

Cases live in ``REGISTRY``: ``(name, backend, fn, reference)`` plus inputs, shapes and, optionally,
a separate timing baseline. The CUDA extension's kernels are added with :func:`register` like the
Triton ones below.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                        help="CPU tensors under TRITON_INTERPRET=1, tiny shapes, fp32/fp16, one timing run")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"), help="where to write results")
    parser.add_argument("--out", type=Path, help="write gpu_check.md and gpu_check.json into this folder "
                                                 "(overrides --json)")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names to run")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="stop starting new cases after this many seconds (the run must fit in 8 minutes)")
    parser.add_argument("--compile-only", metavar="ARCHS", default="",
                        help="no GPU: compile every kernel variant the cases launch for these targets "
                             "(comma-separated: sm80, sm90) and report resources instead of running")
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

from spectral_ops.backends.base import BandSpec, DecayRequest  # noqa: E402
from spectral_ops import plan  # noqa: E402
from spectral_ops.backends.torch_backend import TorchBackend  # noqa: E402
from spectral_ops.backends.triton_backend import TritonBackend  # noqa: E402
from spectral_ops.coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients  # noqa: E402
from spectral_ops.dispatch import SELF_CHECK_TOLERANCE, TF32_SELF_CHECK_TOLERANCE, PinnedKernels  # noqa: E402
from spectral_ops.linalg import relative_error  # noqa: E402
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
    clones of the inputs for its check, so in-place kernels can be validated.
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
    shapes=[(4096, 4096), (4096, 8192), (8, 1000, 3000)], tiny_shapes=[(2, 37, 50)],
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


# ----- the plan's ops on the Triton kernels, end to end, against the torch backend -----

def _op_case(name, call, shapes, tiny_shapes, dtypes=ALL_DTYPES, backend=TRITON, label="triton",
             tolerance=SELF_CHECK_TOLERANCE):
    kernels = PinnedKernels(backend)
    register(Case(f"op {name}", label, fn=lambda d: call(kernels, d), reference=lambda d: call(TORCH, d),
                  inputs=weight, tolerance=tolerance, dtypes=dtypes,
                  shapes=shapes, tiny_shapes=tiny_shapes, baseline_name="torch backend"))


def _decay(p, band=None, precision=None):
    request = DecayRequest(p, 0.1, 0.01, band, "explicit", POLAR, POLAR, precision)
    return lambda b, d: plan.decay_(b, d["W"], request)


BIG = [(4096, 4096), (16384, 4096)]
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
_op_case("decay_ p=0", _decay(0), BIG + [(96, 128, 768)], TINY)
_op_case("decay_ p=2", _decay(2), BIG + [(96, 128, 768)] + ODD, TINY)
_op_case("decay_ p=2 band top", _decay(2, BandSpec(0.6, "top")), ODD, TINY)
# Every case runs at its dtype's default precision (bf16 weights: bf16 operands), against the torch
# backend at the same precision. The fp32 headline again with one TF32 pass per product (~1e-3 each).
_op_case("decay_ p=2 (tf32)", _decay(2, precision="tf32"), BIG + [(96, 128, 768)], [], dtypes=(torch.float32,),
         tolerance={torch.float32: TF32_SELF_CHECK_TOLERANCE})


# ----- running -----

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, dry_run) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU; one wall-clock run when dry)."""
    if dry_run:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    fn()
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    _sync(device)
    once = max(start.elapsed_time(end), 1e-3)
    samples = []
    for _ in range(max(3, min(20, int(200 / once)))):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _clone(d):
    return {k: tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone() for k, v in d.items()}


# ----- the CUDA extension's kernels and ops (bench/cuda_cases.py), as cases of this registry -----

def _register_cuda_cases() -> None:
    """Each CUDA case checks one kernel or op at one shape and dtype; the timing cases are
    timed against the torch call they replace. They need a GPU: no tiny interpreter shapes."""
    spec = importlib.util.spec_from_file_location("cuda_cases", Path(__file__).with_name("cuda_cases.py"))
    cuda_cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_cases)

    for spec in cuda_cases.cases() + cuda_cases.timing_cases():
        register(Case(
            spec["name"], "cuda",
            fn=lambda d, spec=spec: spec["run"](*d["args"]),
            reference=lambda d, spec=spec: spec["reference"](*d["args"]),
            inputs=lambda shape, dtype, device, spec=spec: {"args": spec["make_inputs"](device)},
            shapes=[spec["shape"]], tiny_shapes=[], tolerance={spec["dtype"]: spec["tolerance"]},
            dtypes=(spec["dtype"],),
        ))


_register_cuda_cases()


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


def cuda_unavailable_reason(device) -> str | None:
    from spectral_ops.backends.cuda_backend import CudaBackend

    return CudaBackend().unavailable_reason(device)


def run_case(case: Case, shape, dtype, device, dry_run) -> dict:
    row = {"case": case.name, "backend": case.backend, "dtype": str(dtype).replace("torch.", ""),
           "shape": list(shape), "baseline": case.baseline_name}
    try:
        inputs = case.inputs(shape, dtype, device)
        got = case.fn(_clone(inputs))
        expected = case.reference(_clone(inputs))
        row["error"] = relative_error(got, expected)
        row["tolerance"] = case.tolerance[dtype]
        row["ok"] = row["error"] <= row["tolerance"]
        del got, expected
        baseline = case.baseline or case.reference
        row["ms"] = time_ms(lambda: case.fn(inputs), device, dry_run)
        row["baseline_ms"] = time_ms(lambda: baseline(inputs), device, dry_run)
        row["speedup"] = row["baseline_ms"] / row["ms"]
    except Exception as error:  # a crashing kernel is a failed check, reported with the rest
        row.update(ok=False, failure=f"{type(error).__name__}: {error}"[:300])
    return row


def environment(device) -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "input_precision": TRITON.input_precision,
    }


def context_timings(device, dry_run) -> dict:
    """Yardsticks for the goals: a 4096^3 GEMM, which stacked per-head decay should be comparable to."""
    n = 64 if dry_run else 4096
    dtype = torch.float32 if dry_run else torch.bfloat16
    A = torch.randn(n, n, device=device).to(dtype)
    return {f"gemm {n}x{n}x{n} {str(dtype).replace('torch.', '')} ms": time_ms(lambda: A @ A, device, dry_run)}


def markdown(rows) -> str:
    lines = ["| case | backend | dtype | shape | rel. error | tol | ok | ms | baseline | baseline ms | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failure" in r or "skipped" in r:
            note = r.get("failure") or r["skipped"]
            lines.append(f"| {r['case']} | {r['backend']} | {r['dtype']} | {r['shape']} | {note} | | "
                         f"{'skipped' if 'skipped' in r else 'FAIL'} | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['backend']} | {r['dtype']} | {'x'.join(map(str, r['shape']))} | {r['error']:.2e} | "
            f"{r['tolerance']:.0e} | {'yes' if r['ok'] else 'FAIL'} | {r['ms']:.3f} | {r['baseline']} | "
            f"{r['baseline_ms']:.3f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


# ----- compiling without a GPU -----

# Shared memory a block may use (opt-in maximum), per target.
SHARED_MEMORY_LIMIT = {"sm80": 166912, "sm90": 232448}


def _selected(args):
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    return [case for case in REGISTRY if not wanted or any(w in case.name for w in wanted)]


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
        for case in _selected(args):
            for dtype in case.dtypes:
                for shape in case.tiny_shapes if args.dry_run else case.shapes:
                    case.fn(case.inputs(shape, dtype, torch.device("cpu")))
    finally:
        JITFunction.run, common.arch = real_run, real_arch
    return launches


def compile_launches(launches: dict, arch: str) -> list[dict]:
    import re
    import subprocess
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", int(arch[2:]), 32)
    rows = []
    for kernel, signature, constexprs, attrs, options in launches.values():
        flags = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()
                 if kernel.arg_names[path[0]].isupper()}
        pointers = sorted({kind for kind in signature.values() if kind.startswith("*")})
        row = {"kernel": kernel.fn.__name__, "arch": arch, "operands": " ".join(pointers),
               "num_warps": options.num_warps, "num_stages": options.num_stages, "constexprs": flags}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        except Exception as error:
            rows.append({**row, "ok": False, "failure": f"{type(error).__name__}: {error}"[:500]})
            continue
        row["shared"] = compiled.metadata.shared
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            gpu = f"sm_{arch[2:]}a" if arch == "sm90" else f"sm_{arch[2:]}"
            verbose = subprocess.run([knobs.nvidia.ptxas.path, "-v", f"--gpu-name={gpu}", ptx.name, "-o", os.devnull],
                                     capture_output=True, text=True).stderr
        registers = re.search(r"Used (\d+) registers", verbose)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
        row["registers"] = int(registers.group(1)) if registers else None
        row["spill_stores"] = int(spills.group(1)) if spills else None
        row["ok"] = compiled.metadata.shared <= SHARED_MEMORY_LIMIT[arch]
        rows.append(row)
    return rows


def compile_only(args) -> int:
    import triton.runtime.interpreter

    from spectral_ops.triton_kernels import syrk as any_kernel_module

    if isinstance(any_kernel_module.symmetric_kernel, triton.runtime.interpreter.InterpretedFunction):
        print("--compile-only needs compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    rows = []
    for arch in [a.strip() for a in args.compile_only.split(",") if a.strip()]:
        if arch not in SHARED_MEMORY_LIMIT:
            print(f"unknown target {arch!r}; known: {', '.join(SHARED_MEMORY_LIMIT)}", file=sys.stderr)
            return 2
        rows += compile_launches(record_launches(args, arch), arch)
    lines = ["| kernel | arch | operands | warps | stages | shared KiB | registers | spill bytes | ok | constexprs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['kernel']} | {r['arch']} | {r['operands']} | {r['num_warps']} | {r['num_stages']} | "
        if "failure" in r:
            lines.append(f"{head} | | | FAIL: {r['failure']} | {r['constexprs']} |")
        else:
            lines.append(f"{head}"
                         f"{r['shared'] / 1024:.0f} | {r['registers']} | {r['spill_stores']} | "
                         f"{'yes' if r['ok'] else 'OVER'} | {r['constexprs']} |")
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"compile_only": rows}, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in rows) else 1


def main(args) -> int:
    if args.compile_only:
        return compile_only(args)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter smoke test", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    rows = []
    if not args.dry_run:
        build_extension_if_needed(device)
    cuda_reason = cuda_unavailable_reason(device)
    for case in _selected(args):
        if case.backend == "cuda" and cuda_reason and case.shapes:
            if not args.dry_run:
                rows.append({"case": case.name, "backend": "cuda", "dtype": str(case.dtypes[0]).replace("torch.", ""),
                             "shape": list(case.shapes[0]), "skipped": f"CUDA extension unavailable: {cuda_reason}",
                             "ok": False})
            continue
        dtypes = [d for d in case.dtypes if not (args.dry_run and d == torch.bfloat16)]
        for dtype in dtypes:
            for shape in case.tiny_shapes if args.dry_run else case.shapes:
                if time.monotonic() > deadline:
                    rows.append({"case": case.name, "backend": case.backend, "dtype": str(dtype).replace("torch.", ""),
                                 "shape": list(shape), "skipped": "time budget spent", "ok": None})
                    continue
                rows.append(run_case(case, shape, dtype, device, args.dry_run))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    report = {"environment": environment(device), "context": context_timings(device, args.dry_run), "results": rows}
    print()
    print(markdown(rows))
    print()
    for name, value in report["context"].items():
        print(f"{name}: {value:.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.md").write_text(markdown(rows) + "\n")
        args.json = args.out / "gpu_check.json"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    # A case cut by the time budget is reported as skipped (ok: null), neither passed nor failed.
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(parse(sys.argv[1:])))
