"""Triton kernels (``spectral_ops.triton_kernels``, from the top-level ``triton_kernels/`` folder).

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter, used by
the tests). ``KERNELS`` lists the ops that have kernels and grows as ``triton_kernels/`` does.
"""

from __future__ import annotations

import importlib.util
import os

import torch

# Ops with a Triton kernel behind them, and the dtypes each kernel takes.
KERNELS: dict[str, tuple[torch.dtype, ...]] = {}


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


class TritonBackend:
    name = "triton"
    needs_self_check = True

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        on_cpu = device is not None and device.type == "cpu"
        if on_cpu and not interpreter_enabled():
            return "Triton runs on CUDA tensors; CPU tensors need TRITON_INTERPRET=1 (the interpreter)"
        if device is None and not torch.cuda.is_available() and not interpreter_enabled():
            return "no CUDA device is visible to torch (and TRITON_INTERPRET=1 is not set)"
        return None

    def supports(self, op: str, W: torch.Tensor) -> bool:
        return W.dtype in KERNELS.get(op, ())
