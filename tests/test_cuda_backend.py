"""The CUDA backend on a machine without a GPU: it reports itself unavailable with the reason, dispatch
falls through, and ``supports`` states what the kernels can run (where dispatch routes them:
tests/test_dispatch.py and tests/test_tuning.py).

The kernels themselves run in tests/test_cuda_emulation.py.
"""

import pytest
import torch

import spectral_ops as so
from spectral_ops import _extension, dispatch
from spectral_ops.backends import cuda_backend
from spectral_ops.backends.base import PRIMITIVES
from spectral_ops.backends.cuda_backend import CudaBackend

ext, reason = _extension.load_extension()
needs_extension = pytest.mark.skipif(ext is None, reason=f"spectral_ops._C is unavailable: {reason}")
CUDA = torch.device("cuda")


@needs_extension
def test_every_primitive_runs_in_fp32_fp16_bf16_never_fp64(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_shared_memory_optin", lambda device: 227 * 1024)
    backend = CudaBackend()
    for primitive in PRIMITIVES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert backend.supports(primitive, CUDA, dtype, (8, 64, 256), steps=8), (primitive, dtype)
        assert not backend.supports(primitive, CUDA, torch.float64, (8, 64, 256), steps=8)


@needs_extension
def test_unavailable_here_with_the_reason():
    if ext.device_status()[0]:
        pytest.skip("a CUDA device is visible")
    why = CudaBackend().unavailable_reason(torch.device("cpu"))
    assert why.startswith("the extension is built but sees no CUDA device (no CUDA device available")
    assert dict(dispatch.backend_status())["cuda"] == why


def test_dispatch_falls_through_on_cpu():
    W = torch.randn(40, 24)
    assert so.backend_for("polar", W) == "torch"
    with so.use_backend("cuda"), pytest.raises(so.BackendUnavailableError, match="backend 'cuda' was forced"):
        so.polar(W)


def test_a_bad_precision_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("SPECTRAL_OPS_CUDA_PRECISION", "tf32")
    with pytest.raises(ValueError, match="SPECTRAL_OPS_CUDA_PRECISION must be one of ieee, tf32x3"):
        CudaBackend()
    monkeypatch.setenv("SPECTRAL_OPS_CUDA_PRECISION", "IEEE")
    assert CudaBackend().precision == "ieee"


@needs_extension
def test_the_chain_needs_its_side_steps_and_shared_memory(monkeypatch):
    backend = CudaBackend()
    monkeypatch.setattr(cuda_backend, "_shared_memory_optin", lambda device: 227 * 1024)
    assert backend.supports("small_chain", CUDA, torch.float32, (8, 128, 128), steps=8)
    assert not backend.supports("small_chain", CUDA, torch.float32, (3, 129, 140), steps=8)  # r > 128
    assert not backend.supports("small_chain", CUDA, torch.float32, (8, 64, 256),
                                steps=ext.small_chain_max_steps + 1)
    monkeypatch.setattr(cuda_backend, "_shared_memory_optin", lambda device: 99 * 1024)
    # sm_86 / sm_89: two 128 x 128 fp32 buffers do not fit
    assert not backend.supports("small_chain", CUDA, torch.float32, (8, 128, 128), steps=8)
    assert backend.supports("small_chain", CUDA, torch.float32, (8, 64, 256), steps=8)
