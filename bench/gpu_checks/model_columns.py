"""A timing row's cost-model columns (``spectral_ops.gpu_model``): the work it timed, its TFLOP/s and
percentage of the GPU's peak on each side, the times the model predicts for both sides, the provider
the router would choose for that call (``dispatch.provider_for``), and -- across the rows of one call --
whether that choice was the fastest measured.

The work is the model's for the row's provider (the kernels compute one triangle of a symmetric
product, cuBLAS all of it), so TFLOP/s is the rate each side actually ran its own FLOPs at. A
prediction is blank where the model has no measured efficiency for that provider on this GPU (every
hand-written kernel until a GPU check calibrates it) or does not know the GPU.
"""

from __future__ import annotations

import torch

from spectral_ops import dispatch, plan

from .cases import POLAR, Case

try:
    from spectral_ops import gpu_model
except ImportError:  # a checkout from before the model: the columns stay blank, the reason is in the report
    gpu_model = None

# The model's name for the provider a row's side runs on.
_PROVIDERS = {"triton": "triton", "cuda": "cuda", "torch": "torch"}


def arch_of(device):
    if gpu_model is None or device.type != "cuda":
        return None
    return gpu_model.arch_for(torch.cuda.get_device_name(device))


def _wide(shape) -> tuple:
    *batch, m, n = shape
    return (*batch, min(m, n), max(m, n))


def route(case: Case, shape) -> tuple[str, tuple]:
    """The primitive and operand shape the router is asked about: the kernel's own, or for an op the
    rectangular products on the wide view of ``W`` (the bulk of its work, as ``dispatch.backend_for``)."""
    if case.primitive is not None:
        return case.primitive, (_wide(shape) if case.primitive == "symmetric" else tuple(shape))
    return "product", _wide(shape)


def work(case: Case, shape, dtype, precision: str, provider: str):
    """The model's work for one call of the row on ``provider``, or None (no model, or no model of it)."""
    if gpu_model is None:
        return None
    if case.primitive is not None:
        primitive, operand = route(case, shape)
        return gpu_model.primitive_work(primitive, operand, dtype, precision, provider, compose=plan.composed_chain,
                                        steps=len(POLAR))
    if case.op is not None:
        # The cases run with the ops' default iteration ("auto") and Polar Express's own step count.
        options = {"steps": len(POLAR), "sign_steps": len(POLAR), "iteration": "auto", **case.op_options}
        return plan.work(case.op, tuple(shape), precision=precision, dtype=dtype,
                         symmetric_at_half=gpu_model.halves_symmetric_products(provider), **options)
    return None


def router_choice(case: Case, shape, dtype, device, precision: str) -> str | None:
    primitive, operand = route(case, shape)
    return dispatch.provider_for(primitive, device, dtype, operand, precision="tf32" if precision == "tf32" else None)


def columns(case: Case, shape, dtype, device, precision: str, ms: float, baseline_ms: float) -> dict:
    """The model's columns of one timing row, ``ms`` the case's and ``baseline_ms`` torch's."""
    result = {"router": router_choice(case, shape, dtype, device, precision)}
    arch = arch_of(device)
    for side, provider, measured in (("", _PROVIDERS.get(case.backend), ms), ("baseline_", "torch", baseline_ms)):
        if provider is None:
            continue
        try:
            done = work(case, shape, dtype, precision, provider)
        except Exception as error:  # a model that cannot price a case leaves its columns blank, never the timing
            result["model_error"] = f"{type(error).__name__}: {error}"[:200]
            continue
        if done is None:
            continue
        result[f"{side}gflop"] = done.flops / 1e9
        result[f"{side}tflops"] = done.flops / (measured * 1e-3) / 1e12
        if arch is not None:
            result[f"{side}tflops"], result[f"{side}peak_pct"] = gpu_model.achieved(arch, done, measured, precision)
            result[f"{side}predicted_ms"] = gpu_model.predict_ms(arch, provider, done, precision)
    return result


def mark_fastest(rows: list[dict]) -> None:
    """For each call (case, dtype, shape) timed on one or more providers: which measured fastest, and
    whether the router's choice was it (``None`` where the router's provider was not timed there)."""
    calls: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row.get("kind") == "timing" and row["status"] == "ok" and "ms" in row and "baseline_ms" in row \
                and row["backend"] in _PROVIDERS:
            measured = calls.setdefault((row["case"], row["dtype"], tuple(row["shape"])), {})
            measured[row["backend"]] = row["ms"]
            measured.setdefault("torch", row["baseline_ms"])
    for row in rows:
        measured = calls.get((row["case"], row["dtype"], tuple(row["shape"])))
        if measured is None or row.get("kind") != "timing" or "router" not in row:
            continue
        row["fastest"] = min(measured, key=measured.get)
        row["router_fastest"] = None if row["router"] not in measured else row["router"] == row["fastest"]
