"""Backend selection, forcing, fallback and the first-use self-check."""

import logging
import warnings

import pytest
import torch

import spectral_ops as so
from spectral_ops import dispatch
from spectral_ops.backends.base import OPS
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.testing import log_spaced_spectrum, matrix_with_spectrum, relative_error


class FakeGpuBackend(TorchBackend):
    """A backend that claims CPU tensors and needs a self-check, like a GPU backend would.

    ``corrupt`` scales every result of the named op, the way a wrong kernel would.
    """

    needs_self_check = True

    def __init__(self, name="cuda", corrupt=None):
        self.name = name
        self.corrupt = corrupt
        self.calls = []

    def _maybe_wrong(self, op, result):
        self.calls.append(op)
        if op != self.corrupt:
            return result
        if isinstance(result, tuple):
            return tuple(r * 1.5 for r in result)
        return result.mul_(1.5) if op == "decay_" else result * 1.5

    def polar(self, *args):
        return self._maybe_wrong("polar", super().polar(*args))

    def spectral_power(self, *args):
        return self._maybe_wrong("spectral_power", super().spectral_power(*args))

    def band_projectors(self, *args):
        return self._maybe_wrong("band_projectors", super().band_projectors(*args))

    def decay_(self, W, request):
        return self._maybe_wrong("decay_", super().decay_(W, request))


def sample(dtype=torch.float32):
    return matrix_with_spectrum((20, 12), log_spaced_spectrum(12, 10), dtype, seed=1)


def test_default_on_cpu_is_torch_and_is_recorded():
    W = sample()
    assert so.backend_for("polar", W) == "torch"
    so.polar(W)
    assert so.last_backend("polar") == "torch"


def test_a_correct_gpu_backend_is_preferred_after_its_self_check():
    fake = FakeGpuBackend()
    dispatch.register_backend(fake)
    W = sample()
    result = so.spectral_power(W, 2, method="gram")
    assert so.last_backend("spectral_power") == "cuda"
    assert "spectral_power" in fake.calls
    assert relative_error(result, so.reference.spectral_power_svd(W, 2)) < 5e-5


@pytest.mark.parametrize("op, call", [
    ("polar", lambda W: so.polar(W)),
    ("spectral_power", lambda W: so.spectral_power(W, 2, method="gram")),
    ("band_projectors", lambda W: so.band_projectors(W, 0.5)),
    ("decay_", lambda W: so.spectral_decay_(W, 2, 0.1, 0.1)),
])
def test_a_wrong_backend_is_disabled_with_a_warning_naming_the_op(op, call):
    dispatch.register_backend(FakeGpuBackend(corrupt=op))
    W = sample()
    with pytest.warns(RuntimeWarning, match=f"cuda backend's {op} disagrees"):
        call(W.clone())
    assert so.last_backend(op) == "torch"
    # Disabled for the process: no second check, no second warning, correct results.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = call(W.clone())
    assert so.last_backend(op) == "torch"
    if op == "decay_":
        assert relative_error(result, so.reference.spectral_decay_svd(W, 2, 0.1, 0.1)) < 5e-5


def test_a_crashing_backend_fails_its_self_check():
    class Crashing(FakeGpuBackend):
        def polar(self, *args):
            raise RuntimeError("illegal memory access")

    dispatch.register_backend(Crashing())
    with pytest.warns(RuntimeWarning, match="polar disagrees"):
        so.polar(sample())
    assert so.last_backend("polar") == "torch"


def test_forcing_torch_with_the_context_manager_and_the_environment(monkeypatch):
    dispatch.register_backend(FakeGpuBackend())
    W = sample()
    with so.use_backend("torch"):
        so.polar(W)
    assert so.last_backend("polar") == "torch"
    monkeypatch.setenv("SPECTRAL_OPS_BACKEND", "torch")
    so.polar(W)
    assert so.last_backend("polar") == "torch"
    # The context manager wins over the environment.
    with so.use_backend("cuda"):
        so.polar(W)
    assert so.last_backend("polar") == "cuda"


def test_forcing_an_unavailable_backend_raises_with_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with so.use_backend("triton"), pytest.raises(so.BackendUnavailableError, match="TRITON_INTERPRET"):
        so.polar(sample())
    monkeypatch.setenv("SPECTRAL_OPS_BACKEND", "cuda")
    with pytest.raises(so.BackendUnavailableError, match="'cuda' was forced for spectral_power"):
        so.spectral_power(sample(), 2, method="gram")


def test_forcing_a_backend_that_failed_its_self_check_raises():
    dispatch.register_backend(FakeGpuBackend(corrupt="polar"))
    with so.use_backend("cuda"), pytest.warns(RuntimeWarning), pytest.raises(
        so.BackendUnavailableError, match="failed its polar self-check"
    ):
        so.polar(sample())


def test_invalid_backend_names(monkeypatch):
    with pytest.raises(ValueError, match="cuda, triton, torch"):
        with so.use_backend("numpy"):
            pass
    monkeypatch.setenv("SPECTRAL_OPS_BACKEND", "numpy")
    with pytest.raises(ValueError, match="SPECTRAL_OPS_BACKEND"):
        so.polar(sample())


def test_the_choice_is_logged_once_at_debug_level(caplog):
    W = sample()
    with caplog.at_level(logging.DEBUG, logger="spectral_ops"):
        so.polar(W)
        so.polar(W)
    messages = [r.getMessage() for r in caplog.records if "runs on the torch backend" in r.getMessage()]
    assert messages == ["spectral_ops: polar on cpu torch.float32 runs on the torch backend"]


def test_backend_status_reports_every_backend_with_a_reason():
    status = dict(so.backend_status(torch.device("cpu")))
    assert set(status) == {"cuda", "triton", "torch"}
    assert status["torch"] is None
    assert status["cuda"]  # no GPU here: a reason, never silence


def test_every_op_has_a_self_check_that_the_reference_passes():
    reference = dispatch.get_backend("torch")
    for op in OPS:
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            assert dispatch.self_check_error(reference, op, dtype, "cpu") == 0.0
