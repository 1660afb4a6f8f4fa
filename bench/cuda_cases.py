"""GPU cases for the CUDA kernels (csrc/), for bench/gpu_check.py.

``cases()`` checks every CUDA entry point (spectral_ops._extension) and every op of the plan on the CUDA
kernels, with and without the fused chain, against the torch reference, in float32, bfloat16 and float16, on
batched, odd-sized, tall and wide shapes. ``timing_cases()`` pairs each CUDA op with what torch would run
instead, at the sizes the routing in spectral_ops/dispatch.py is about (both sides of its CUDA thresholds).

Each case is a plain dict:

    name         unique, e.g. "gemm/tf32x3/bf16/3x257x130@130x511"
    op           the CUDA op: an _extension function or "backend.<op>[<path>]", path "chain" or "composed"
    dtype        the input dtype
    shape        the main input's shape
    make_inputs  callable(device) -> tuple of tensors (deterministic)
    run          callable(*inputs) -> Tensor: the CUDA kernel(s); never modifies the inputs
    reference    callable(*inputs) -> Tensor: torch (float64 for single products, else the torch backend)
    tolerance    the largest allowed ||run - reference||_F / ||reference||_F
    baseline     callable(*inputs) -> Tensor: what a timing case is timed against, at the case's precision
                 (bf16 operands: a bf16 torch call, not an fp32 one); the reference where that already is
    op_options   the op's options for the cost model (``{"p": 2}``), empty for a single kernel
    precision    None (the dtype's own: fp32 rows are the kernels' 3xTF32 against exact fp32 cuBLAS), or
                 ``"tf32"``: one TF32 pass, timed against cuBLAS with TF32 allowed

The whole set runs in well under a minute of GPU time on one H200 (``python bench/cuda_cases.py``
checks every case and times the timing cases without gpu_check.py).
"""

from __future__ import annotations

import re

import torch

from spectral_ops import _extension as ext
from spectral_ops import plan
from spectral_ops.backends.cuda_backend import CudaBackend
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.coefficients import NEWTON_SCHULZ_SIGN, polar_express_coefficients
from spectral_ops.dispatch import PinnedKernels
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum
from spectral_ops.plan import Band, DecayRequest

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A kernel that computes in fp32 and rounds once differs from the reference by a few units of the
# output dtype's rounding; a wrong kernel is off by O(1). fp32 allows for 3xTF32 and reordered sums.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# One TF32 pass: each operand rounded to TF32 (unit round-off 2^-11, about 4.9e-4) gives a relative
# error of about 1e-3; 4e-3 leaves a margin of ~4.
TF32_TOLERANCE = 4e-3
# Chains of ~30 products amplify per-product differences a little.
CHAIN_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
POLAR = polar_express_coefficients()
SIGN_NS = (NEWTON_SCHULZ_SIGN,) * 30
TAU = 0.75
TORCH = PinnedKernels(TorchBackend())


def _cuda(path: str) -> PinnedKernels:
    """Every primitive on the CUDA kernels; ``"composed"`` leaves out the fused chain."""
    return PinnedKernels(CudaBackend(), small_chain=path == "chain")


def _random(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _weight(shape, dtype, device, seed=0, two_clusters=False):
    """Singular values in (0, 1]: log-spaced (condition 10), or two clusters around TAU for band ops."""
    r = min(shape[-2:])
    if two_clusters:
        spectrum = torch.cat([torch.linspace(0.45, 0.6, r // 2), torch.linspace(0.9, 1.0, r - r // 2)])
    else:
        spectrum = log_spaced_spectrum(r, 10)
    return matrix_with_spectrum(shape, spectrum, dtype, device, seed=seed)


def _symmetric(shape, dtype, device, seed=0):
    A = _random(shape, torch.float64, device, seed)
    return ((A + A.mT) / (2 * shape[-1] ** 0.5)).to(dtype)


def _f64_product(a, b, y=None, alpha=1.0, beta=0.0):
    out = alpha * (a.double() @ b.double())
    return out if y is None else out + beta * y.double()


def _case(name, op, dtype, shape, make_inputs, run, reference, tolerance, baseline=None, op_options=None,
          precision=None):
    return {"name": name, "op": op, "dtype": dtype, "shape": tuple(shape), "make_inputs": make_inputs, "run": run,
            "reference": reference, "tolerance": tolerance, "baseline": baseline or reference,
            "op_options": op_options or {}, "precision": precision}


def _dims(shape):
    return "x".join(map(str, shape))


# ----- entry points of the extension ----------------------------------------------------------


def _gemm_cases():
    # (a shape, b shape, transpose a's storage): batched odd sizes, a tall product, a wide one, views.
    layouts = [((3, 257, 130), (3, 130, 511), False), ((1500, 64), (64, 1100), False),
               ((2, 96, 2000), (2, 2000, 300), True)]
    for tag, dtype in DTYPES.items():
        for precision in ("ieee", "tf32x3"):
            if dtype != torch.float32 and precision == "ieee":
                continue  # 16-bit pairs always take the tensor cores
            for a_shape, b_shape, transposed in layouts:
                def make(device, a_shape=a_shape, b_shape=b_shape, transposed=transposed, dtype=dtype):
                    a = _random(a_shape, dtype, device, 1)
                    if transposed:
                        a = a.mT.contiguous().mT
                    y = _random((*a_shape[:-1], b_shape[-1]), dtype, device, 3)
                    return a, _random(b_shape, dtype, device, 2), y

                def run(a, b, y, precision=precision):
                    out = torch.empty_like(y)
                    return ext.gemm(a, b, out, alpha=0.5, beta=-1.0, y=y, precision=precision)

                yield _case(f"gemm/{precision}/{tag}/{_dims(a_shape)}@{_dims(b_shape)}", "gemm", dtype, a_shape, make,
                            run, lambda a, b, y: _f64_product(a, b, y, 0.5, -1.0), TOLERANCE[dtype])


def _syrk_cases():
    # The Gram of a wide weight, of a tall one through its transposed view, batched with a partial tile.
    for tag, dtype in DTYPES.items():
        for shape, tall in (((3, 300, 777), False), ((4096, 1000), True), ((2, 1200, 1300), False)):
            def make(device, shape=shape, dtype=dtype):
                return (_random(shape, dtype, device, 4),)

            def run(W, tall=tall):
                X = W.mT if tall else W
                return ext.syrk(X, X.mT, torch.empty((*X.shape[:-1], X.shape[-2]), device=W.device), alpha=0.5)

            def reference(W, tall=tall):
                X = W.mT if tall else W
                return _f64_product(X, X.mT, alpha=0.5)

            yield _case(f"syrk/{tag}/{_dims(shape)}{'/tall' if tall else ''}", "syrk", dtype, shape, make, run,
                        reference, TOLERANCE[torch.float32])


def _poly_sign_cases():
    for precision in ("ieee", "tf32x3"):
        shape = (3, 257, 257)

        def make(device, shape=shape):
            return (_symmetric(shape, torch.float32, device, 5),)

        yield _case(f"poly_step/{precision}/{_dims(shape)}", "poly_step", torch.float32, shape, make,
                    lambda A, precision=precision: ext.poly_step(A, torch.empty_like(A), 0.3, -0.2,
                                                                 precision=precision),
                    lambda A: 0.3 * A.double() - 0.2 * A.double() @ A.double(), TOLERANCE[torch.float32])
        shape = (2, 300, 300)

        def make_z(device, shape=shape):
            A = _symmetric(shape, torch.float32, device, 6)
            return (A / torch.linalg.matrix_norm(A)[..., None, None],)

        def sign_reference(Z):
            Z = Z.double()
            C = Z @ Z
            return Z @ (3 * torch.eye(Z.shape[-1], dtype=Z.dtype, device=Z.device) - 16 / 5 * C + 6 / 5 * C @ C)

        yield _case(f"sign_step/{precision}/{_dims(shape)}", "sign_step", torch.float32, shape, make_z,
                    lambda Z, precision=precision: ext.sign_step(Z, torch.empty_like(Z), NEWTON_SCHULZ_SIGN,
                                                                 precision=precision),
                    sign_reference, TOLERANCE[torch.float32])


def _wide(W):
    return W.mT if W.shape[-2] >= W.shape[-1] else W


def _chain_cases():
    # Heads (wide), the transposed view of tall heads, odd small sides (R = 32, 64, 128 tiles).
    for tag, dtype in DTYPES.items():
        for shape in ((96, 128, 768), (12, 64, 256), (7, 40, 24), (5, 300, 100)):
            for p in (0, 2, 3, 6):
                def make(device, shape=shape, dtype=dtype):
                    return (_weight(shape, dtype, device, 7),)

                def run(W, p=p):
                    out = torch.empty_like(W)
                    ext.small_chain(_wide(W), _wide(out), p, POLAR if p % 2 == 0 else ())
                    return out

                yield _case(f"small_chain/p{p}/{tag}/{_dims(shape)}", "small_chain", dtype, shape, make, run,
                            lambda W, p=p: plan.spectral_power(TORCH, W, p, POLAR), CHAIN_TOLERANCE[dtype])


def _decay_epilogue_cases():
    for tag, dtype in DTYPES.items():
        shape = (4, 256, 513)

        def make(device, shape=shape, dtype=dtype):
            g = torch.Generator().manual_seed(8)
            keep = torch.rand(shape[0], generator=g).to(device)
            return _random(shape, dtype, device, 9), _random(shape, torch.float32, device, 10), keep

        def run(w, d, keep):
            return ext.decay_epilogue_(w.clone(), d, 0.9, -0.1, keep_per_matrix=keep)

        def reference(w, d, keep):
            return (0.9 * keep[:, None, None] * w.float() - 0.1 * d).to(w.dtype)

        yield _case(f"decay_epilogue_/{tag}/{_dims(shape)}", "decay_epilogue_", dtype, shape, make, run, reference,
                    TOLERANCE[dtype])


# ----- the backend, on both paths -------------------------------------------------------------


def decayed(kernels, W, request):
    """A decayed copy of ``W``: ``plan.decay_`` writes in place."""
    W = W.clone()
    plan.decay_(kernels, W, request)
    return W


def _backend_runs(band_weight):
    """(label, backend op, run(backend, X), reference(X)) for every backend op; X is the op's input."""
    band = Band(TAU, "two_band", p_bot=0, spectral_weight_decay_bot=2.0)
    request = DecayRequest(2, 1.0, 0.1, 0.01, None, "explicit", POLAR, POLAR)
    band_request = DecayRequest(2, 1.0, 0.1, 0.01, Band(TAU, "top"), "explicit", POLAR, POLAR)
    prox_request = DecayRequest(0, 1.0, 0.05, 0.0, None, "prox", POLAR, POLAR)
    yield "polar", "polar", lambda b, W: plan.polar(b, W, POLAR), lambda W: plan.polar(TORCH, W, POLAR)
    for p in (2, 3, 6):
        yield f"spectral_power_p{p}", "spectral_power", lambda b, W, p=p: plan.spectral_power(b, W, p, POLAR), \
            lambda W, p=p: plan.spectral_power(TORCH, W, p, POLAR)
    yield "decay_p2", "decay_", lambda b, W: decayed(b, W, request), lambda W: decayed(TORCH, W, request)
    if not band_weight:
        return
    # A negative update power: the real-power construction (inverse root, polynomials, the floor's; no
    # fused chain runs it).
    yield "power_update", "power_update", \
        lambda b, W: plan.power_update(b, W, -0.25, POLAR, None, plan.UPDATE_FLOOR), \
        lambda W: plan.power_update(TORCH, W, -0.25, POLAR, None, plan.UPDATE_FLOOR)
    yield "msign", "msign", lambda b, W: plan.msign(b, _gram_minus_tau(W), SIGN_NS), \
        lambda W: plan.msign(TORCH, _gram_minus_tau(W), SIGN_NS)
    yield "band_projectors", "band_projectors", lambda b, W: torch.stack(plan.band_projectors(b, W, TAU, POLAR)), \
        lambda W: torch.stack(plan.band_projectors(TORCH, W, TAU, POLAR))
    yield "band_direction", "band_direction", lambda b, W: plan.band_direction(b, W, 2, band, POLAR, POLAR, top=0.5), \
        lambda W: plan.band_direction(TORCH, W, 2, band, POLAR, POLAR, top=0.5)
    yield "svt", "svt", lambda b, W: plan.svt(b, W, TAU, POLAR, POLAR), lambda W: plan.svt(TORCH, W, TAU, POLAR, POLAR)
    # Both bounds at the gap: each branch of the clip runs (the result is TAU Q).
    yield "spectral_clip", "spectral_clip", lambda b, W: plan.spectral_clip(b, W, TAU, TAU, POLAR, POLAR), \
        lambda W: plan.spectral_clip(TORCH, W, TAU, TAU, POLAR, POLAR)
    yield "spectral_norm_bounds", "spectral_norm_bounds", \
        lambda b, W: torch.stack(plan.spectral_norm_bounds(b, W, plan.GUARD_SQUARINGS)), \
        lambda W: torch.stack(plan.spectral_norm_bounds(TORCH, W, plan.GUARD_SQUARINGS))
    yield "decay_band", "decay_", lambda b, W: decayed(b, W, band_request), \
        lambda W: decayed(TORCH, W, band_request)
    yield "decay_prox", "decay_", lambda b, W: decayed(b, W, prox_request), \
        lambda W: decayed(TORCH, W, prox_request)


def _gram_minus_tau(W):
    X = _wide(W).to(torch.float32)
    return (X @ X.mT - TAU**2 * torch.eye(X.shape[-2], device=W.device)).to(W.dtype)


def _backend_cases():
    shapes = {"chain": [(16, 64, 256), (6, 300, 90)], "composed": [(2, 1100, 1500), (2304, 2048)]}
    for path, path_shapes in shapes.items():
        for tag, dtype in DTYPES.items():
            for shape in path_shapes:
                for label, op, run, reference in _backend_runs(band_weight=path == "composed"):
                    def make(device, shape=shape, dtype=dtype, clusters=path == "composed"):
                        return (_weight(shape, dtype, device, 11, two_clusters=clusters),)

                    yield _case(f"backend.{label}[{path}]/{tag}/{_dims(shape)}", f"backend.{op}[{path}]", dtype, shape,
                                make, lambda W, run=run, path=path: run(_cuda(path), W), reference,
                                CHAIN_TOLERANCE[dtype])


def cases() -> list[dict]:
    """Correctness: every CUDA op against the torch reference."""
    return [*_gemm_cases(), *_syrk_cases(), *_poly_sign_cases(), *_chain_cases(), *_decay_epilogue_cases(),
            *_backend_cases()]


# ----- timing ---------------------------------------------------------------------------------


def timing_cases() -> list[dict]:
    """Each CUDA op against what torch runs instead, on both sides of the routing thresholds."""
    out = []
    shape = (4096, 4096)

    def make_pair(device, shape=shape):
        return _random(shape, torch.float32, device, 13), _random(shape, torch.float32, device, 14)

    def make_symmetric(device, shape=shape):
        return (_symmetric(shape, torch.float32, device, 15),)

    out.append(_case(f"time/gemm/fp32/{_dims(shape)}", "gemm", torch.float32, shape, make_pair,
                     lambda a, b: ext.gemm(a, b, torch.empty_like(a), y=b, beta=1.5),
                     lambda a, b: a @ b + 1.5 * b, TOLERANCE[torch.float32]))
    # The same product with one TF32 pass, against cuBLAS with TF32 allowed (the timing sets it).
    out.append(_case(f"time/gemm/tf32/{_dims(shape)}", "gemm", torch.float32, shape, make_pair,
                     lambda a, b: ext.gemm(a, b, torch.empty_like(a), y=b, beta=1.5, precision="tf32"),
                     lambda a, b: a @ b + 1.5 * b, TF32_TOLERANCE, precision="tf32"))
    out.append(_case(f"time/poly_step/fp32/{_dims(shape)}", "poly_step", torch.float32, shape, make_symmetric,
                     lambda A: ext.poly_step(A, torch.empty_like(A), 0.3, -0.2),
                     lambda A: 0.3 * A - 0.2 * A @ A, TOLERANCE[torch.float32]))

    def unit(A):
        return A / torch.linalg.matrix_norm(A)

    out.append(_case(f"time/sign_step/fp32/{_dims(shape)}", "sign_step", torch.float32, shape, make_symmetric,
                     lambda A: ext.sign_step(unit(A), torch.empty_like(A), NEWTON_SCHULZ_SIGN),
                     lambda A: plan.msign(TORCH, A, (NEWTON_SCHULZ_SIGN,)), TOLERANCE[torch.float32]))
    shape = (2048, 2048)

    def make_gram(device, shape=shape):
        return (_gram_minus_tau(_weight(shape, torch.float32, device, 17, two_clusters=True)),)

    out.append(_case(f"time/backend.msign[composed]/fp32/{_dims(shape)}", "backend.msign[composed]", torch.float32,
                     shape, make_gram, lambda A: _cuda("composed").msign(A, SIGN_NS),
                     lambda A: plan.msign(TORCH, A, SIGN_NS),
                     CHAIN_TOLERANCE[torch.float32]))
    shape = (64, 1024, 1024)

    def make_decay(device, shape=shape):
        return _random(shape, torch.bfloat16, device, 18), _random(shape, torch.float32, device, 19)

    out.append(_case(f"time/decay_epilogue_/bf16/{_dims(shape)}", "decay_epilogue_", torch.bfloat16, shape,
                     make_decay, lambda w, d: ext.decay_epilogue_(w.clone(), d, 0.9, -0.1),
                     lambda w, d: w.clone().copy_(0.9 * w.float() - 0.1 * d), TOLERANCE[torch.bfloat16]))
    for tag, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for shape in ((4096, 16384), (8192, 8192)):
            def make(device, shape=shape, dtype=dtype):
                return (_random(shape, dtype, device, 12),)

            # Checked against the exact fp32 Gram, timed against torch's Gram of the same operands.
            out.append(_case(f"time/syrk/{tag}/{_dims(shape)}", "syrk", dtype, shape, make,
                             lambda X: ext.syrk(X, X.mT, torch.empty(X.shape[0], X.shape[0], device=X.device)),
                             lambda X: X.float() @ X.float().mT, TOLERANCE[torch.float32],
                             baseline=lambda X: X @ X.mT))
            if dtype == torch.float32:
                out.append(_case(f"time/syrk/tf32/{_dims(shape)}", "syrk", dtype, shape, make,
                                 lambda X: ext.syrk(X, X.mT, torch.empty(X.shape[0], X.shape[0], device=X.device),
                                                    precision="tf32"),
                                 lambda X: X @ X.mT, TF32_TOLERANCE, precision="tf32"))
        # The fused chain and the composed path, at sizes on both sides of where a measured routing may switch.
        for path, label, shape in (("chain", "polar", (64, 64, 256)), ("chain", "decay_p2", (96, 32, 1024)),
                                   ("chain", "polar", (96, 128, 768)), ("composed", "polar", (2048, 2048)),
                                   ("composed", "polar", (4096, 4096)),
                                   ("composed", "spectral_power_p2", (4096, 16384)),
                                   ("composed", "decay_p2", (4096, 4096))):
            op, run, reference = next((o, r, ref) for name, o, r, ref in _backend_runs(False) if name == label)

            def make_w(device, shape=shape, dtype=dtype):
                return (_weight(shape, dtype, device, 16),)

            power = re.search(r"_p(\d+)$", label)
            out.append(_case(f"time/backend.{label}[{path}]/{tag}/{_dims(shape)}", f"backend.{op}[{path}]", dtype,
                             shape, make_w, lambda W, run=run, path=path: run(_cuda(path), W), reference,
                             CHAIN_TOLERANCE[dtype], op_options={"p": int(power.group(1))} if power else None))
    return out


def main() -> None:
    """Check every case, then time the timing cases: a stand-in until gpu_check.py runs them."""
    import time

    from spectral_ops.linalg import relative_error

    device = torch.device("cuda")

    def best_of(fn, inputs, repeats=5):
        fn(*inputs)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*inputs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    failures = 0
    print("| case | error | tolerance | ok |\n|---|---|---|---|")
    for case in cases():
        inputs = case["make_inputs"](device)
        try:
            error = relative_error(case["run"](*inputs), case["reference"](*inputs))
        except Exception as exc:  # a crash is a failure, reported like one
            error = float("inf")
            print(f"<!-- {case['name']}: {exc!r} -->")
        ok = error <= case["tolerance"]
        failures += not ok
        print(f"| {case['name']} | {error:.2e} | {case['tolerance']:.0e} | {'yes' if ok else '**NO**'} |")
    print("\n| timing case | cuda ms | torch ms | speed-up |\n|---|---|---|---|")
    for case in timing_cases():
        inputs = case["make_inputs"](device)
        ours, theirs = best_of(case["run"], inputs), best_of(case["reference"], inputs)
        print(f"| {case['name']} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} | {theirs / ours:.2f}x |")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
