"""Every op x implementation x shape x dtype, timed with pytest-benchmark (``make bench``).

Implementations: ``spectral_ops[<backend>]`` for each backend that runs on this device (the torch
backend is the same algorithm composed from plain torch matmuls), and the baselines a user would
otherwise reach for (``baselines.py``). ``extra_info`` carries the FLOP model, the bytes moved, the
measured dense-matmul peak and (on CUDA) the peak memory; ``report.py`` turns the JSON into a table.
"""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops import dispatch
from spectral_ops.coefficients import polar_express_coefficients
from spectral_ops.linalg import compute_dtype, log_spaced_spectrum, matrix_with_spectrum
from spectral_ops.optim import SpectralMuon
from spectral_ops.plan import resolve_precision

from baselines import (
    eigh_route,
    has_torch_muon,
    svd_route,
    textbook_polar_express,
    textbook_spectral_power,
    torch_muon_newton_schulz,
)
from flops import op_bytes, op_flops
from settings import ALL_SHAPES, DEVICE, DTYPES, interleaved_medians, synchronize

DECAY_LR, DECAY_WD = 1e-3, 0.1  # small enough that repeated timing rounds stay stable


def weight(shape, dtype):
    return matrix_with_spectrum(shape, log_spaced_spectrum(min(shape[-2:]), 100), dtype, device=DEVICE, seed=0)


def symmetric(shape, dtype):
    W = weight(shape, torch.float64)
    r = min(shape[-2:])
    A = (W.mT @ W if shape[-2] >= shape[-1] else W @ W.mT) - 0.3 * torch.eye(r, dtype=torch.float64, device=DEVICE)
    return A.to(dtype)


def ours(op):
    one_step = polar_express_coefficients()[:1]
    return {
        "polar_step": lambda W: so.polar(W, coefficients=one_step),
        "polar": so.polar,
        "spectral_power_p0": lambda W: so.spectral_power(W, 0, method="gram"),
        "spectral_power_p2": lambda W: so.spectral_power(W, 2, method="gram"),
        "spectral_power_p4": lambda W: so.spectral_power(W, 4, method="gram"),
        "msign": so.msign,
        "decay_p2": lambda W: so.spectral_decay_(W, 2, DECAY_LR, DECAY_WD),
    }[op]


def baselines(op, shape):
    power = {"spectral_power_p0": 0, "spectral_power_p2": 2, "spectral_power_p4": 4, "polar": 0}.get(op)
    if op == "gram":
        return {"torch.matmul": lambda W: W.mT @ W if W.shape[-2] >= W.shape[-1] else W @ W.mT}
    if op == "polar_step":
        return {"textbook": lambda W: textbook_polar_express(W, polar_express_coefficients()[:1])}
    if op == "msign":
        def eigh_sign(A):
            xi, Z = torch.linalg.eigh(A.float() if A.dtype != torch.float64 else A)
            return ((Z * torch.sign(xi)[..., None, :]) @ Z.mT).to(A.dtype)
        return {"eigh": eigh_sign}
    if op == "decay_p2":
        return {"svd32": lambda W: W.sub_(DECAY_LR * DECAY_WD * svd_route(W, 2, torch.float32))}
    if op == "muon_step":
        return {"torch.optim.Muon": None} if has_torch_muon() and len(shape) == 2 else {}
    routes = {
        "textbook": ((lambda W: textbook_polar_express(W)) if power == 0
                     else (lambda W: textbook_spectral_power(W, power))),
        "svd32": lambda W: svd_route(W, power, torch.float32),
        "svd64": lambda W: svd_route(W, power, torch.float64),
    }
    if power >= 2:
        routes["eigh"] = lambda W: eigh_route(W, power)
    if op == "polar" and has_torch_muon():
        routes["torch_muon_ns"] = torch_muon_newton_schulz
    return routes


def spectral_ops_backends(op, shape, dtype):
    """The backends that can run ``op``'s plan here when forced: its products in the compute dtype, and
    the write into a weight of ``dtype``."""
    if op == "gram":
        return []
    names = []
    for name, reason in dispatch.backend_status(DEVICE):
        backend = dispatch.get_backend(name)
        if reason is None and backend.supports("product", DEVICE, compute_dtype(dtype), shape) and backend.supports(
                "decay_epilogue_", DEVICE, dtype, shape):
            names.append(name)
    return names


OPS = ["gram", "polar_step", "polar", "spectral_power_p0", "spectral_power_p2", "spectral_power_p4",
       "msign", "decay_p2", "muon_step"]


def cases():
    for op in OPS:
        for shape in ALL_SHAPES:
            if op == "muon_step" and len(shape) != 2:
                continue  # Muon updates single matrices; stacks are flattened, not batched
            for dtype in DTYPES:
                implementations = [f"spectral_ops[{b}]" for b in spectral_ops_backends(op, shape, dtype)]
                implementations += list(baselines(op, shape))
                for implementation in implementations:
                    yield pytest.param(op, implementation, shape, dtype,
                                       id=f"{op}-{implementation}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}")


def muon_step(implementation, shape, dtype):
    param = torch.nn.Parameter(weight(shape, dtype))
    param.grad = weight(shape, dtype)
    if implementation == "torch.optim.Muon":
        optimizer = torch.optim.Muon([param], lr=1e-3, adjust_lr_fn="match_rms_adamw")
    else:
        optimizer = SpectralMuon([param], lr=1e-3)
    return optimizer.step, ()


@pytest.mark.parametrize("op, implementation, shape, dtype", list(cases()))
def test_op(benchmark, op, implementation, shape, dtype, dense_peak_flops):
    element_size = torch.tensor([], dtype=dtype).element_size()
    benchmark.extra_info.update(
        op=op, implementation=implementation, shape=list(shape), dtype=str(dtype)[6:], device=DEVICE.type,
        flops=op_flops(op, shape, precision=resolve_precision(None, dtype)), bytes=op_bytes(op, shape, element_size),
        peak_flops=dense_peak_flops[str(dtype)], precision=resolve_precision(None, dtype),
    )
    if op == "muon_step":
        function, args = muon_step(implementation, shape, dtype)
    else:
        tensor = symmetric(shape, dtype) if op == "msign" else weight(shape, dtype)
        args = (tensor,)
        if implementation.startswith("spectral_ops["):
            backend = implementation[len("spectral_ops["):-1]
            base = ours(op)

            def function(*a, base=base, backend=backend):
                with so.use_backend(backend):
                    return base(*a)
        else:
            function = baselines(op, shape)[implementation]

    def timed():
        result = function(*args)
        synchronize()
        return result

    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = benchmark(timed)
    if DEVICE.type == "cuda":
        benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    if isinstance(result, torch.Tensor):
        assert torch.isfinite(result).all(), f"{implementation} produced NaN/Inf on {op}"


# CPU method selection: where does LAPACK's SVD or eigh beat the Gram route? (README table)
SELECTION_SHAPES = [(32, 32), (64, 64), (128, 128), (256, 256), (512, 512), (1024, 1024),
                    (128, 32), (256, 64), (512, 128), (1024, 256), (2048, 512)]


def selection_cases():
    for p in (0, 2):
        for shape in SELECTION_SHAPES:
            for dtype in (torch.float32, torch.float64):
                for method in ("gram", "svd", "eigh", "auto"):
                    if method == "eigh" and p == 0:
                        continue  # inaccurate for p = 0 (1/s amplifies the squared-away small modes)
                    yield pytest.param(p, shape, dtype, method,
                                       id=f"p{p}-{method}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the crossover table is a CPU measurement")
@pytest.mark.parametrize("p, shape, dtype, method", list(selection_cases()))
def test_method_selection(benchmark, p, shape, dtype, method):
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape), 100), dtype, seed=0)
    benchmark.extra_info.update(op=f"select_p{p}", implementation=method, shape=list(shape),
                                dtype=str(dtype)[6:], device="cpu", flops=op_flops(f"spectral_power_p{p}", shape,
                                                                      precision=resolve_precision(None, dtype)))
    benchmark(so.spectral_power, W, p, method)


# CPU method selection for the thresholded forms (plan.route's band rule): each form's Gram route
# adds a sign iteration; the factorisations compute it mode by mode.
BAND_SELECTION_SHAPES = [(128, 64), (256, 128), (512, 256), (1024, 512), (1024, 1024)]
BAND_FORMS = {
    "band_direction": lambda W, method: so.band_direction(W, 1.0, 2, "top", method=method),
    "svt": lambda W, method: so.svt(W, 1.0, method=method),
    "band_projectors": lambda W, method: so.band_projectors(W, 1.0, method=method),
}


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the crossover table is a CPU measurement")
@pytest.mark.parametrize("method", ["gram", "svd", "eigh", "auto"])
@pytest.mark.parametrize("shape", BAND_SELECTION_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("form", list(BAND_FORMS))
def test_band_method_selection(benchmark, form, shape, method):
    # Singular values over [1e-2, 10], the threshold 1 inside them (the iterations' cost does not depend on it).
    W = matrix_with_spectrum(shape, torch.logspace(1, -2, min(shape), dtype=torch.float64), torch.float32, seed=0)
    benchmark.extra_info.update(op=f"select_{form}", implementation=method, shape=list(shape), dtype="float32",
                                device="cpu")
    benchmark(BAND_FORMS[form], W, method)


@pytest.mark.parametrize("p", [0, 2])
@pytest.mark.parametrize("shape", [(128, 64), (512, 256)], ids=lambda shape: "x".join(map(str, shape)))
def test_decay_against_spectral_power(benchmark, p, shape):
    """``spectral_decay_`` is ``spectral_power``'s direction plus the guard, the checks of its input and
    of the new values, and the write: its time over ``spectral_power``'s, both with ``method="auto"``,
    timed in the same interleaved rounds. Goal (issue [compile]): at most 1.2x at 128 x 64 on a CPU."""
    W = weight(shape, torch.float32)
    decayed = W.clone()
    steps = {"ours": lambda: so.spectral_decay_(decayed, p, DECAY_LR, DECAY_WD),
             "theirs": lambda: so.spectral_power(W, p)}
    rounds = 1 if benchmark.disabled else (400 if max(shape) <= 128 else 100)
    medians = interleaved_medians(benchmark, steps, rounds, warmup_rounds=0 if benchmark.disabled else 20)
    benchmark.extra_info.update(op="decay_vs_spectral_power", implementation=f"spectral_decay_ p={p}",
                                case="x".join(map(str, shape)), shape=list(shape), dtype="float32",
                                precision="fp32", device=DEVICE.type, ours_median_s=medians["ours"],
                                torch_median_s=medians["theirs"], ratio=medians["ours"] / medians["theirs"])


@pytest.mark.parametrize("shape", [(512, 256), (8, 128, 64)], ids=lambda shape: "x".join(map(str, shape)))
def test_stochastic_rounding_against_nearest(benchmark, shape):
    """The decay of a bf16 weight rounded stochastically over the same decay rounded to nearest: the
    cost of drawing 16 random bits per entry and rounding with them, timed in the same interleaved
    rounds (fp32 operands for both, so that a CPU without native bf16 times the rounding, not its
    emulated bf16 products)."""
    nearest, rounded = weight(shape, torch.bfloat16), weight(shape, torch.bfloat16)
    options = dict(precision="fp32", stability="clamp")
    steps = {"ours": lambda: so.spectral_decay_(rounded, 2, DECAY_LR, DECAY_WD, rounding="stochastic", **options),
             "theirs": lambda: so.spectral_decay_(nearest, 2, DECAY_LR, DECAY_WD, **options)}
    rounds = 1 if benchmark.disabled else 100
    medians = interleaved_medians(benchmark, steps, rounds, warmup_rounds=0 if benchmark.disabled else 10)
    benchmark.extra_info.update(op="stochastic_vs_nearest_rounding", implementation="spectral_decay_ p=2",
                                case="x".join(map(str, shape)), shape=list(shape), dtype="bfloat16",
                                precision="fp32", device=DEVICE.type, ours_median_s=medians["ours"],
                                torch_median_s=medians["theirs"], ratio=medians["ours"] / medians["theirs"])
