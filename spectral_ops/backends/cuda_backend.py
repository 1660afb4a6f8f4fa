"""The hand-written CUDA extension (``spectral_ops._C``, built from ``csrc/``) as a backend.

The primitives map onto the extension's kernels (custom ops ``spectral_ops::cuda_*``, see
:mod:`spectral_ops._extension`):

* ``symmetric``: ``syrk.cu``, lower-triangle tiles only, mirrored on store;
* ``product``: ``gemm.cu`` with the ``alpha Y`` term in the epilogue;
* ``poly_step`` and ``sign_step``: ``poly_step.cu``, epilogues of the symmetric kernel;
* ``small_chain``: ``small_chain.cu``, one thread block per matrix with the Gram in shared memory
  (small side ``r <= small_chain_max_side``, as far as the block's shared memory allows);
* ``decay_epilogue_``: ``decay_epilogue.cu``, the weight read and written once.

Every product accumulates in fp32 and rounds its result to the operands' dtype. bf16 and fp16 operands
go to the tensor cores as they are; fp32 operands as one TF32 pass for ``precision="tf32"``, else as
3xTF32 (about fp32 accuracy), or fp32 FMA under ``SPECTRAL_OPS_CUDA_PRECISION=ieee``. float64 is left
to cuBLAS through the torch backend. The fused chain computes in fp32 whatever the precision.
"""

from __future__ import annotations

import functools

import torch

from .. import _extension as ext
from .. import environment
from ..coefficients import NORMALIZATION_MARGIN
from .base import number_and_per_matrix
from .torch_backend import TorchBackend

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_PRECISION = "tf32x3"
FP32_MODES = ("ieee", "tf32x3")  # how "fp32" products run; "tf32" asks for one pass explicitly
# The chain's worst case for shared memory: p = 6 keeps two r x r buffers (csrc/small_chain.cu).
CHAIN_WORST_POWER = 6


@functools.cache
def _shared_memory_optin(device: torch.device) -> int:
    """Shared memory one block may opt into on ``device``."""
    if device.type != "cuda":
        return 1 << 30
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 * 1024)


class CudaBackend:
    name = "cuda"
    needs_self_check = True
    # A memory fault in a kernel is sticky: it would end the process that checks it.
    self_check_in_child = True

    def __init__(self, *, precision: str | None = None):
        self.module, self._load_error = ext.load_extension()
        from_env = environment.setting(environment.CUDA_PRECISION)
        self.precision = precision or from_env or DEFAULT_PRECISION
        if self.precision not in FP32_MODES:
            raise ValueError(f"{environment.CUDA_PRECISION} must be one of {', '.join(FP32_MODES)}, "
                             f"got {self.precision!r}")

    def unavailable_reason(self, device: torch.device | None = None, forced: bool = False) -> str | None:
        if self.module is None:
            return self._load_error
        count, message = self._device_status
        if count == 0:
            return f"the extension is built but sees no CUDA device ({message})"
        if device is not None and device.type != "cuda":
            return f"it runs on CUDA tensors only, not on {device.type} tensors"
        if device is not None and torch.cuda.get_device_capability(device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(device)
            return f"the kernels use sm_80 tensor-core instructions (bf16/tf32 WMMA); this GPU is sm_{major}{minor}"
        return None

    @functools.cached_property
    def _device_status(self) -> tuple[int, str]:
        # The CUDA runtime fixes the visible devices when it initialises: asking once per process is enough.
        return self.module.device_status()

    def supports(self, primitive: str, device, dtype, shape, steps: int = 0) -> bool:
        if dtype not in KERNEL_DTYPES:
            return False
        if primitive != "small_chain":
            return True
        r = min(shape[-2:])
        return (r <= self.module.small_chain_max_side and steps <= self.module.small_chain_max_steps
                and self.module.small_chain_shared_bytes(r, CHAIN_WORST_POWER) <= _shared_memory_optin(device))

    def _empty(self, like: torch.Tensor, cols: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = (*like.shape[:-1], like.shape[-1] if cols is None else cols)
        return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)

    def _mode(self, precision) -> str:
        return "tf32" if precision == "tf32" else self.precision

    def symmetric(self, L, R, precision=None):
        return ext.syrk(L, R, self._empty(L, L.shape[-2]), precision=self._mode(precision))

    def product(self, M, Z, precision=None, *, alpha=1.0, Y=None, beta=1.0):
        return ext.gemm(M, Z, self._empty(Z), alpha=alpha, y=Y, beta=beta if Y is not None else 0.0,
                        precision=self._mode(precision))

    def poly_step(self, A, b, c, precision=None):
        return ext.poly_step(A, self._empty(A), b, c, precision=self._mode(precision))

    def sign_step(self, Z, coefficient, precision=None):
        return ext.sign_step(Z, self._empty(Z), coefficient, precision=self._mode(precision))

    def small_chain(self, X, p, coefficients, precision=None, sign=False):
        shrink = 1.0 if sign else 1.0 / NORMALIZATION_MARGIN
        return ext.small_chain(X, self._empty(X, dtype=torch.float32), p, coefficients if p % 2 == 0 else (),
                               shrink=shrink)

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        if D is None:  # no direction: a scaling is one element-wise pass in torch already
            return W.mul_(keep) if noise is None else TorchBackend().decay_epilogue_(W, None, keep, 0.0, noise=noise)
        (keep, keep_per_matrix), (step, step_per_matrix) = (
            number_and_per_matrix(value, W.shape[:-2], W.device) for value in (keep, step))
        return ext.decay_epilogue_(W, D.contiguous(), keep, step, keep_per_matrix=keep_per_matrix,
                                   step_per_matrix=step_per_matrix, noise=noise)
