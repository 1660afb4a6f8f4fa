"""The CUDA backend on a machine without a GPU: it reports itself unavailable with the reason, dispatch
falls through, and ``supports`` routes shapes as documented in spectral_ops/backends/cuda_backend.py.

Routing is tested on meta tensors (shapes only) with the per-path self-checks stubbed; the kernels
themselves run in tests/test_cuda_emulation.py.
"""

import warnings

import pytest
import torch

import spectral_ops as so
from spectral_ops import _extension, dispatch
from spectral_ops.backends import cuda_backend
from spectral_ops.backends.base import OPS
from spectral_ops.backends.cuda_backend import KERNELS, TILED_MIN_SIDE, CudaBackend

ext, reason = _extension.load_extension()
needs_extension = pytest.mark.skipif(ext is None, reason=f"spectral_ops._C is unavailable: {reason}")


def test_kernels_cover_every_op_in_fp32_fp16_bf16():
    assert set(KERNELS) == set(OPS)
    for dtypes in KERNELS.values():
        assert set(dtypes) == {torch.float32, torch.float16, torch.bfloat16}


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


@pytest.fixture
def routed(monkeypatch):
    """A backend whose per-path self-checks pass (recorded) on a device with ``shared`` bytes per block."""
    if ext is None:
        pytest.skip(f"spectral_ops._C is unavailable: {reason}")
    backend = CudaBackend()
    backend.checked = []

    def verified(op, dtype, device, path):
        backend.checked.append((op, path))
        return True

    monkeypatch.setattr(backend, "_path_verified", verified)
    backend.shared = 227 * 1024
    monkeypatch.setattr(cuda_backend, "_shared_memory_optin", lambda device: backend.shared)
    return backend


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    "op, shape, path",
    [
        ("polar", (8, 64, 256), "chain"),  # heads with little work each: the whole chain in one block
        ("spectral_power", (64, 32, 1024), "chain"),
        ("decay_", (12, 128, 128), "chain"),  # r^2 n = 2^21, the largest the chain takes
        ("polar", (4, 200, 64), "chain"),  # tall: the small side is 64
        ("polar", (96, 128, 768), None),  # too much work per block: falls through
        ("polar", (3, 129, 140), None),  # r > 128
        ("polar", (1024, 1024), None),  # between the two paths
        ("polar", (2 * TILED_MIN_SIDE, TILED_MIN_SIDE), "tiled"),
        ("spectral_power", (TILED_MIN_SIDE, 3 * TILED_MIN_SIDE), "tiled"),
        ("msign", (TILED_MIN_SIDE, TILED_MIN_SIDE), "tiled"),
        ("msign", (8, 64, 64), None),  # only polar, spectral_power and decay_ have a chain
        ("band_direction", (8, 64, 256), None),
        ("svt", (TILED_MIN_SIDE, TILED_MIN_SIDE), "tiled"),
    ],
)
def test_supports_routes_by_shape(routed, op, shape, path):
    W = meta(*shape)
    assert routed.supports(op, W) == (path is not None)
    assert routed._path(op, W) == path


def test_float64_is_never_claimed(routed):
    for op in OPS:
        assert not routed.supports(op, meta(8, 64, 256, dtype=torch.float64))
    assert routed.checked == []


def test_a_decay_on_the_chain_verifies_the_tiled_path_too(routed):
    # Band and prox decays of a chain-sized weight run tiled.
    assert routed.supports("decay_", meta(8, 64, 256))
    assert routed.checked == [("decay_", "chain"), ("decay_", "tiled")]
    routed.checked.clear()
    assert routed.supports("polar", meta(8, 64, 256))
    assert routed.checked == [("polar", "chain")]


def test_a_device_without_the_shared_memory_gets_no_chain(routed):
    routed.shared = 99 * 1024  # sm_86 / sm_89: two 128 x 128 fp32 buffers do not fit
    assert not routed.supports("polar", meta(8, 128, 128))
    assert routed.supports("polar", meta(8, 64, 256))


@needs_extension
def test_a_path_that_fails_its_self_check_is_refused_with_a_warning(monkeypatch):
    backend = CudaBackend()
    monkeypatch.setattr(cuda_backend, "_shared_memory_optin", lambda device: 227 * 1024)
    monkeypatch.setattr(dispatch, "self_check_error", lambda *args: float("inf"))
    with pytest.warns(RuntimeWarning, match="the cuda backend's chain polar path disagrees"):
        assert not backend.supports("polar", meta(8, 64, 256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second check, no second warning
        assert not backend.supports("polar", meta(8, 64, 256))
