import pytest
import torch

from spectral_ops import dispatch, gpu_model


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Each test starts with no forced backend and no remembered self-check results."""
    monkeypatch.delenv("SPECTRAL_OPS_BACKEND", raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


# Unit round-off of the dtype a computation accumulates in.
ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}


# A GPU of the cost model, standing for the CPU the tests run on (rates in FLOP/s and B/s).
FAKE_GPU = gpu_model.Arch("Fake GPU", "sm90", 1, 1e11, {"fp64": 1e12, "fp32": 1e12, "tf32": 1e13, "bf16": 2e13,
                                                        "fp16": 2e13})


@pytest.fixture
def modelled_gpu(monkeypatch):
    """CPU tensors routed as on a GPU the cost model knows (nothing measured on it unless a test says)."""
    monkeypatch.setattr(dispatch, "_arch_of", lambda device: FAKE_GPU)
    return FAKE_GPU
