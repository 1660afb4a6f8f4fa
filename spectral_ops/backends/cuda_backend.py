"""The hand-written CUDA extension (``spectral_ops._C``, built from ``csrc/``).

It is preferred on CUDA tensors for the ops it has kernels for; ``KERNELS`` lists them and grows as
``csrc/`` does. Every kernel is self-checked by the dispatcher before its first use.
"""

from __future__ import annotations

import torch

from .._extension import load_extension

# Ops with a CUDA kernel behind them, and the dtypes each kernel takes.
KERNELS: dict[str, tuple[torch.dtype, ...]] = {}


class CudaBackend:
    name = "cuda"
    needs_self_check = True

    def __init__(self):
        self.module, self._load_error = load_extension()

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        if self.module is None:
            return self._load_error
        count, message = self.module.device_status()
        if count == 0:
            return f"the extension is built but sees no CUDA device ({message})"
        if device is not None and device.type != "cuda":
            return f"it runs on CUDA tensors only, not on {device.type} tensors"
        return None

    def supports(self, op: str, W: torch.Tensor) -> bool:
        return W.dtype in KERNELS.get(op, ())
