import pytest
import torch

from spectral_ops import dispatch


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Each test starts with no forced backend and no remembered self-check results."""
    monkeypatch.delenv("SPECTRAL_OPS_BACKEND", raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


# Unit round-off of the dtype a computation accumulates in.
ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}
