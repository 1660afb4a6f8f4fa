"""Backend selection per primitive, forcing, fallback and the first-use self-check."""

import ast
import logging
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch

import spectral_ops as so
from spectral_ops import dispatch, gpu_model, selfcheck
from spectral_ops.backends.base import PRIMITIVES
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum, relative_error


class ToyBackend(TorchBackend):
    """A backend that claims CPU tensors and needs a self-check, like a GPU backend would (named triton).

    Its primitives are the torch ones, plus (with ``chain``) a small chain composed from them;
    ``corrupt`` names one primitive whose results it scales by 1.5, the way a wrong kernel would.
    """

    needs_self_check = True

    def __init__(self, name="triton", corrupt=None, chain=True):
        self.name = name
        self.corrupt = corrupt
        self.chain = chain
        self.calls = []

    def supports(self, primitive, device, dtype, shape, steps=0):
        return self.chain or primitive != "small_chain"

    def _maybe_wrong(self, primitive, result):
        self.calls.append(primitive)
        return result * 1.5 if primitive == self.corrupt else result

    def symmetric(self, L, R, precision=None):
        return self._maybe_wrong("symmetric", super().symmetric(L, R))

    def product(self, M, Z, precision=None, **epilogue):
        return self._maybe_wrong("product", super().product(M, Z, **epilogue))

    def poly_step(self, A, b, c, precision=None):
        return self._maybe_wrong("poly_step", super().poly_step(A, b, c))

    def sign_step(self, Z, coefficient, precision=None):
        # The reference's own sign step, not one composed of this backend's (maybe corrupted) primitives.
        return self._maybe_wrong("sign_step", TorchBackend().sign_step(Z, coefficient))

    def small_chain(self, X, p, coefficients, precision=None, sign=False):
        from spectral_ops import plan

        reference = dispatch.PinnedKernels(TorchBackend())
        result = (plan.matrix_sign(reference, X.float(), coefficients, "fp32") if sign
                  else plan.spectral_power(reference, X.float(), p, coefficients, "fp32"))
        return self._maybe_wrong("small_chain", result)

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        super().decay_epilogue_(W, D, keep, step, noise=noise)
        if self.corrupt == "decay_epilogue_":
            W.mul_(1.5)
        self.calls.append("decay_epilogue_")
        return W


@pytest.fixture
def toy_measured_faster(modelled_gpu, monkeypatch):
    """...on which a GPU check measured the toy (named triton) at a higher efficiency than cuBLAS's: the
    model then predicts it faster for every primitive (a fused chain: one launch instead of dozens)."""
    monkeypatch.setitem(gpu_model.MEASURED_EFFICIENCY, (modelled_gpu.name, "triton"), 0.9)


def sample(dtype=torch.float32):
    return matrix_with_spectrum((20, 12), log_spaced_spectrum(12, 10), dtype, seed=1)


OP_CALLS = {
    "spectral_power": lambda W: so.spectral_power(W, 2, method="gram"),
    "band_projectors": lambda W: so.band_projectors(W, 0.5)[0],
    "band_direction": lambda W: so.band_direction(W, 0.5, 2),
    "decay_": lambda W: so.spectral_decay_(W, 2, 0.1, 0.1),
}
ORACLES = {
    "spectral_power": lambda W: so.reference.spectral_power_svd(W, 2),
    "band_projectors": lambda W: so.reference.band_projectors_svd(W, 0.5)[0],
    "band_direction": lambda W: so.reference.band_direction_svd(W, 0.5, 2),
    "decay_": lambda W: so.reference.spectral_decay_svd(W, 2, 0.1, 0.1),
}


def test_default_on_cpu_is_torch_and_is_recorded():
    W = sample()
    assert so.backend_for("polar", W) == "torch"
    so.polar(W)
    assert so.last_backend("polar") == "torch"


def test_a_correct_gpu_backend_is_preferred_after_its_self_check(toy_measured_faster):
    toy = ToyBackend()
    dispatch.register_backend(toy)
    W = sample()
    result = so.spectral_power(W, 2, method="gram")
    assert so.last_backend("spectral_power") == "triton"
    assert "small_chain" in toy.calls
    assert relative_error(result, so.reference.spectral_power_svd(W, 2)) < 5e-5


@pytest.mark.parametrize("corrupt", PRIMITIVES)
def test_the_self_check_refuses_exactly_the_corrupted_primitive(corrupt, toy_measured_faster):
    # Without a chain the plan composes every other primitive, so each of them is exercised.
    toy = ToyBackend(corrupt=corrupt, chain=corrupt in ("small_chain", "decay_epilogue_"))
    dispatch.register_backend(toy)
    W = sample()
    with pytest.warns(RuntimeWarning) as warned:
        for call in OP_CALLS.values():
            call(W.clone())
    assert [str(w.message).split(" disagrees")[0] for w in warned] == [
        f"spectral_ops: the triton backend's {corrupt}"]
    # Disabled for the process: no second check, no second warning, and every other primitive still
    # runs on the toy backend. Corrupted results never reach the user.
    toy.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = {op: call(W.clone()) for op, call in OP_CALLS.items()}
    assert corrupt not in toy.calls and toy.calls
    for op, result in results.items():
        assert relative_error(result, ORACLES[op](W)) < 5e-5, op


def test_a_disabled_primitive_leaves_the_op_to_the_next_backend(toy_measured_faster):
    dispatch.register_backend(ToyBackend(corrupt="decay_epilogue_"))
    W = sample()
    with pytest.warns(RuntimeWarning, match="decay_epilogue_ disagrees"):
        so.spectral_decay_(W, 2, 0.1, 0.1)
    assert so.last_backend("decay_") == "triton+torch"  # the chain on the toy, the write on torch


def test_a_crashing_backend_fails_its_self_check(toy_measured_faster):
    class Crashing(ToyBackend):
        def poly_step(self, *args):
            raise RuntimeError("illegal memory access")

    dispatch.register_backend(Crashing())
    with pytest.warns(RuntimeWarning, match="poly_step disagrees"):
        so.band_direction(sample(), 0.5, 2)
    assert so.last_backend("band_direction") == "triton+torch"


def test_forcing_torch_with_the_context_manager_and_the_environment(monkeypatch):
    dispatch.register_backend(ToyBackend())
    W = sample()
    with so.use_backend("torch"):
        so.polar(W)
    assert so.last_backend("polar") == "torch"
    monkeypatch.setenv("SPECTRAL_OPS_BACKEND", "torch")
    so.polar(W)
    assert so.last_backend("polar") == "torch"
    # The context manager wins over the environment.
    with so.use_backend("triton"):
        so.polar(W)
    assert so.last_backend("polar") == "triton"


def test_forcing_an_unavailable_backend_raises_with_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with so.use_backend("triton"), pytest.raises(so.BackendUnavailableError, match="TRITON_INTERPRET"):
        so.polar(sample())
    monkeypatch.setenv("SPECTRAL_OPS_BACKEND", "cuda")
    with pytest.raises(so.BackendUnavailableError, match="'cuda' was forced for spectral_power"):
        so.spectral_power(sample(), 2, method="gram")


def test_forcing_a_backend_that_failed_its_self_check_raises():
    dispatch.register_backend(ToyBackend(corrupt="product"))
    with so.use_backend("triton"), pytest.warns(RuntimeWarning), pytest.raises(
        so.BackendUnavailableError, match="failed its product self-check"
    ):
        so.band_direction(sample(), 0.5, 2)


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


def test_every_primitive_has_a_self_check_that_the_reference_passes():
    reference = dispatch.get_backend("torch")
    for primitive in PRIMITIVES:
        if primitive == "small_chain":
            continue  # the reference has none; its check compares with the SVD (test below)
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            assert selfcheck.self_check_error(reference, primitive, dtype, "cpu") == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_small_chain_check_passes_a_correct_chain(dtype):
    error = selfcheck.self_check_error(ToyBackend(), "small_chain", dtype, "cpu")
    assert error <= selfcheck.SELF_CHECK_TOLERANCE[torch.float32]


def test_no_backend_imports_dispatch():
    """Backends implement primitives; only dispatch chooses, so nothing below it may import it."""
    backends = Path(so.__file__).parent / "backends"
    for module in backends.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(name.split(".")[-1] == "dispatch" for name in names), f"{module.name} imports dispatch"


class CheckedInChild(ToyBackend):
    """The toy as a backend whose kernels could fault the device: its self-check runs in a child
    process (which rebuilds it from this module, found through the parent's sys.path)."""

    self_check_in_child = True


class FaultingInChild(CheckedInChild):
    """Its product ends the process that runs it, as a sticky CUDA memory fault does."""

    def product(self, M, Z, precision=None, **epilogue):
        os.kill(os.getpid(), signal.SIGSEGV)


def test_a_backend_checked_in_a_child_process_is_chosen_when_the_child_passes_it(toy_measured_faster):
    dispatch.register_backend(CheckedInChild())
    W = sample()
    result = so.spectral_power(W, 2, method="gram")
    assert so.last_backend("spectral_power") == "triton"
    assert relative_error(result, so.reference.spectral_power_svd(W, 2)) < 5e-5


def test_a_fault_in_the_self_check_child_disables_the_backend_and_the_caller_goes_on(toy_measured_faster):
    dispatch.register_backend(FaultingInChild())
    W = sample()
    with pytest.warns(RuntimeWarning, match=r"child process died \(killed by SIGSEGV") as warned:
        result = so.spectral_power(W, 2, method="gram")
    # One child checked everything: every primitive of the backend is disabled, each with the reason.
    assert len({str(w.message) for w in warned}) == len(warned)
    assert so.last_backend("spectral_power") == "torch"
    assert relative_error(result, so.reference.spectral_power_svd(W, 2)) < 5e-5
    with so.use_backend("triton"), pytest.raises(so.BackendUnavailableError, match="killed by SIGSEGV"):
        so.spectral_power(W, 2, method="gram")


def test_the_cuda_products_are_never_routed_to_on_hopper(monkeypatch):
    """mma.sync cannot reach Hopper's rate: from sm90 on only the chain and the epilogue may be measured."""
    gpu = torch.device("cuda")
    for capability, routed in (((8, 0), True), ((9, 0), False), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        for primitive in PRIMITIVES:
            unrouted = dispatch._unrouted("cuda", primitive, gpu)
            expected = routed or primitive not in dispatch.CUDA_MMA_SYNC_PRODUCTS
            assert (unrouted is None) == expected, (capability, primitive)
            assert dispatch._unrouted("triton", primitive, gpu) is None


def test_the_model_routes_to_a_measured_kernel_only_where_it_predicts_it_faster(modelled_gpu, monkeypatch):
    dispatch.register_backend(ToyBackend(chain=False))
    shape = (256, 1024)
    monkeypatch.setitem(gpu_model.MEASURED_EFFICIENCY, (modelled_gpu.name, "triton"), 0.05)
    assert dispatch.provider_for("product", "cpu", torch.float32, shape, "fp32") == "torch"  # measured slow
    monkeypatch.setitem(gpu_model.MEASURED_EFFICIENCY, (modelled_gpu.name, "triton"), 0.9)
    assert dispatch.provider_for("product", "cpu", torch.float32, shape, "fp32") == "triton"
    monkeypatch.delitem(gpu_model.MEASURED_EFFICIENCY, (modelled_gpu.name, "triton"))
    assert dispatch.provider_for("product", "cpu", torch.float32, shape, "fp32") == "torch"  # never measured
