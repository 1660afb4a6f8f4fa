"""A GPU cost model: each provider's predicted time for a primitive call or an op, from the plan's work.

The plan says what a call costs (:func:`spectral_ops.plan.work`: matrix FLOPs, bytes, launches, read
off the plan itself on meta tensors; :func:`primitive_work` counts one primitive call the same way). This
module, below the plan, turns a :class:`Work` into milliseconds on a known GPU:

    time = max(FLOPs / peak, bytes / bandwidth) / efficiency + launches * LAUNCH_S

* ``peak`` and ``bandwidth`` come from :data:`ARCHS`, the vendors' published dense (no sparsity)
  tensor-core rates and memory bandwidths of the SXM parts. A provider's peak depends on how it runs
  a precision: fp32 products are 3xTF32 passes (``tf32x3``) on the Triton and CUDA kernels, plain fp32
  FMA on cuBLAS (torch's default ``highest`` matmul precision).
* ``efficiency`` is one number per (GPU, provider): the fraction of that roofline a provider's kernels
  reach. For the hand-written providers it is **measured or absent**: :data:`MEASURED_EFFICIENCY` is
  filled from GPU-check results (:func:`calibrate` reads a ``gpu_check.json``), never from papers, and
  a provider without an entry gets no prediction, so the router never picks it by the model. torch
  (cuBLAS) is the baseline: where it is not measured it gets :data:`ASSUMED_CUBLAS_EFFICIENCY`.
* ``LAUNCH_S``: an assumed launch latency per kernel; the GPU check prints predicted against
  measured per row, which is how the first GPU run checks every number here.

:mod:`spectral_ops.dispatch` reads :func:`predict_ms` to choose a provider where nothing was measured
on the machine itself (no routing-cache entry); the GPU check prints it next to each timing.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .backends.counting import CountingKernels, Work, counted, placeholder_coefficients

__all__ = ["ARCHS", "Arch", "Work", "arch_for", "primitive_work", "composed_chain_work", "halves_symmetric_products",
           "predict_ms", "achieved", "efficiency", "calibrate", "MEASURED_EFFICIENCY"]


@dataclass(frozen=True)
class Arch:
    """One GPU model: its name as torch reports it contains ``name``; peaks in FLOP/s, bandwidth in B/s."""

    name: str
    sm: str
    sms: int
    bandwidth: float
    peaks: dict = field(hash=False)

    def peak(self, precision: str) -> float:
        """Dense FLOP/s of one pass at ``precision`` (``"fp32"``: CUDA-core FMA)."""
        return self.peaks[precision]


_TERA = 1e12
# Dense tensor-core rates (bf16/fp16/tf32), CUDA-core fp32 FMA, fp64 tensor-core; HBM bandwidth.
# From the vendors' datasheets for the SXM modules. Order matters: "H100" must not match an "H200".
ARCHS: dict[str, Arch] = {
    "H200": Arch("H200", "sm90", 132, 4.8e12, {"bf16": 989.4 * _TERA, "fp16": 989.4 * _TERA, "tf32": 494.7 * _TERA,
                                               "fp32": 66.9 * _TERA, "fp64": 66.9 * _TERA}),
    "H100": Arch("H100", "sm90", 132, 3.35e12, {"bf16": 989.4 * _TERA, "fp16": 989.4 * _TERA, "tf32": 494.7 * _TERA,
                                                "fp32": 66.9 * _TERA, "fp64": 66.9 * _TERA}),
    "A100": Arch("A100", "sm80", 108, 2.039e12, {"bf16": 312 * _TERA, "fp16": 312 * _TERA, "tf32": 156 * _TERA,
                                                 "fp32": 19.5 * _TERA, "fp64": 19.5 * _TERA}),
}

# An assumption, not a measurement: cuBLAS on large products reaches well over half the roofline.
# It is the baseline every other provider must beat by measurement, so its value never makes a
# hand-written kernel the default; the GPU check reports the measured value.
ASSUMED_CUBLAS_EFFICIENCY = 0.6
LAUNCH_S = 5e-6  # an assumed kernel launch latency (the first GPU run measures it: predicted vs measured)

# Measured fractions of the roofline per GPU and provider, from GPU-check results only
# (``calibrate(docs/results/gpu/DATE/gpu_check.json)`` prints the entries). Empty: no GPU has timed
# this package yet, so the hand-written kernels get no prediction and are never a default.
MEASURED_EFFICIENCY: dict[tuple[str, str], float] = {}

# How each provider runs fp32 products: cuBLAS in fp32 FMA, the kernels as three TF32 passes.
_FP32_PASSES = {"torch": ("fp32", 1), "triton": ("tf32", 3), "cuda": ("tf32", 3)}


def arch_for(device_name: str) -> Arch | None:
    """The :data:`ARCHS` entry whose name ``device_name`` (``torch.cuda.get_device_name``) contains."""
    return next((arch for name, arch in ARCHS.items() if name in device_name), None)


def efficiency(arch: Arch, provider: str) -> float | None:
    """The measured fraction of the roofline of ``provider`` on ``arch``; torch's assumed one where
    unmeasured; None for a hand-written provider no GPU check has timed on that GPU."""
    measured = MEASURED_EFFICIENCY.get((arch.name, provider))
    if measured is not None:
        return measured
    return ASSUMED_CUBLAS_EFFICIENCY if provider == "torch" else None


def provider_peak(arch: Arch, provider: str, precision: str) -> float:
    """FLOP/s of ``provider``'s products at ``precision`` on ``arch``."""
    if precision == "fp32":
        pass_precision, passes = _FP32_PASSES.get(provider, ("fp32", 1))
        return arch.peak(pass_precision) / passes
    return arch.peak(precision)


def halves_symmetric_products(provider: str) -> bool:
    """Whether ``provider`` computes one triangle of a symmetric product (the GPU kernels) or all of it (torch)."""
    return provider != "torch"


def primitive_work(primitive: str, shape, dtype: torch.dtype, precision: str, provider: str, *,
                   compose=None, steps: int = 8) -> Work:
    """The work of one call of ``primitive`` with operands of ``dtype`` and ``shape`` as the plan passes
    them: ``symmetric`` and ``small_chain`` a wide ``(..., r, n)`` ``L`` / ``X``, ``product`` its
    ``(..., r, N)`` ``Z`` (``M`` is ``r x r``), ``poly_step``/``sign_step`` the ``(..., r, r)`` operand,
    ``decay_epilogue_`` the weight. A fused chain does the products of its composition (``compose``, the
    plan's, :func:`composed_chain_work`, of ``steps`` steps) in one launch."""
    if primitive == "small_chain":
        composed = composed_chain_work(compose, tuple(shape), dtype, precision, provider, steps)
        return Work(composed.flops, 2 * math.prod(shape) * dtype.itemsize, 1)
    counter = CountingKernels(halves_symmetric_products(provider))
    X = torch.empty(tuple(shape), dtype=dtype, device="meta")
    square = torch.empty((*X.shape[:-1], X.shape[-2]), dtype=dtype, device="meta")
    calls = {
        "symmetric": lambda: counter.symmetric(X, X.mT, precision),
        "product": lambda: counter.product(square, X, precision),
        "poly_step": lambda: counter.poly_step(X, 1.0, 1.0, precision),
        "sign_step": lambda: counter.sign_step(X, (1.0, 1.0, 1.0), precision),
        "decay_epilogue_": lambda: counter.decay_epilogue_(X, X, 1.0, 1.0),
    }
    calls[primitive]()
    return counter.work


@functools.lru_cache(maxsize=1024)  # routing asks at every unmeasured call; the count runs a whole chain on meta
def composed_chain_work(compose, shape: tuple, dtype: torch.dtype, precision: str, provider: str, steps: int) -> Work:
    """The work of a small chain on an ``X`` of ``shape`` as ``compose`` (the plan's composition of one,
    ``compose(kernels, X, p, coefficients, precision)``, which dispatch is handed) runs it on ``provider``'s
    primitives: the polar factor's ``steps`` steps, counted on meta tensors."""
    if compose is None:
        raise ValueError("a small chain's work is its composition's: pass compose=, the plan's "
                         "(spectral_ops.plan.composed_chain)")
    return counted(lambda kernels, X: compose(kernels, X, 0, placeholder_coefficients(steps), precision),
                   tuple(shape), dtype, halves_symmetric_products(provider))


def predict_ms(arch: Arch, provider: str, work: Work, precision: str) -> float | None:
    """Predicted milliseconds of ``work`` on ``provider`` at ``precision``, or None where ``provider`` has
    no measured efficiency on ``arch`` (:func:`efficiency`)."""
    fraction = efficiency(arch, provider)
    if fraction is None:
        return None
    roofline = max(work.flops / provider_peak(arch, provider, precision), work.bytes / arch.bandwidth)
    return 1e3 * (roofline / fraction + work.launches * LAUNCH_S)


def achieved(arch: Arch, work: Work, ms: float, precision: str) -> tuple[float, float]:
    """``(TFLOP/s, percent of the peak)`` of ``work`` done in ``ms`` at ``precision`` (fp32 against the
    CUDA-core fp32 peak, the rate an exact fp32 product is owed)."""
    flops_per_s = work.flops / (ms * 1e-3)
    return flops_per_s / _TERA, 100.0 * flops_per_s / arch.peak(precision)


def calibrate(gpu_check_json: str | Path) -> dict[tuple[str, str], float]:
    """Measured efficiencies per (GPU, provider) from a GPU check's results: for every timed row that
    carries its ``work``, ``precision``, ``backend`` and ``ms``, the roofline time over the measured time;
    the median per provider. Paste the result into :data:`MEASURED_EFFICIENCY`."""
    report = json.loads(Path(gpu_check_json).read_text())
    arch = arch_for(report["environment"].get("gpu", ""))
    if arch is None:
        raise ValueError(f"{gpu_check_json}: the GPU {report['environment'].get('gpu')!r} is not in gpu_model.ARCHS")
    ratios: dict[str, list[float]] = {}
    for row in report["results"]:
        if row.get("status") != "ok" or not row.get("ms") or "work" not in row or "precision" not in row:
            continue
        work = Work(**row["work"])
        roofline = max(work.flops / provider_peak(arch, row["backend"], row["precision"]),
                       work.bytes / arch.bandwidth)
        busy_s = row["ms"] * 1e-3 - work.launches * LAUNCH_S
        if busy_s > 0:
            ratios.setdefault(row["backend"], []).append(roofline / busy_s)
    return {(arch.name, provider): round(statistics.median(values), 3) for provider, values in ratios.items()}
