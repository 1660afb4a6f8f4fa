"""Fake backends for measured routing on CPU (tests/test_tuning.py, tests/test_step_tuning.py): each call
advances a fake clock by a fixed cost, so that which one is fastest is known exactly and nothing depends on
this machine's timing."""

import torch

import spectral_ops as so
from spectral_ops import dispatch, environment
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.tuning import Autotuner

PRIMITIVES_TIMED = ("symmetric", "product", "poly_step", "sign_step", "small_chain", "decay_epilogue_")
ENVIRONMENT = {"device": "Fake GPU", "spectral_ops": "test", "torch": "x", "triton": "y", "extension_built_at": "z"}


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.reads = 0  # each timed sample reads it twice

    def __call__(self):
        self.reads += 1
        return self.now


class TimedBackend(TorchBackend):
    """The torch primitives under another name, each call costing ``cost`` seconds of the fake clock.

    It records the tensors it was handed, to show that timing never touches the caller's."""

    needs_self_check = True

    def __init__(self, name, cost, clock, chain=False, fails=()):
        self.name = name
        self.cost = cost
        self.clock = clock
        self.chain = chain
        self.fails = fails
        self.seen = []

    def supports(self, primitive, device, dtype, shape, steps=0):
        return self.chain or primitive != "small_chain"

    def _tick(self, primitive, *operands):
        # The self-check's operands are batched: failing only on a single matrix fails in timing.
        if primitive in self.fails and operands[0].dim() == 2:
            raise RuntimeError(f"{self.name} cannot run {primitive} on one matrix")
        self.clock.now += self.cost
        self.seen.extend(t.data_ptr() for t in operands if isinstance(t, torch.Tensor))

    def symmetric(self, L, R, precision=None):
        self._tick("symmetric", L, R)
        return super().symmetric(L, R, precision)

    def product(self, M, Z, precision=None, **epilogue):
        self._tick("product", M, Z, epilogue.get("Y"))
        return super().product(M, Z, precision, **epilogue)

    def poly_step(self, A, b, c, precision=None):
        self._tick("poly_step", A)
        return super().poly_step(A, b, c, precision)

    def sign_step(self, Z, coefficient, precision=None):
        self._tick("sign_step", Z)
        return super().sign_step(Z, coefficient, precision)

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        self._tick("decay_epilogue_", W, D)
        return super().decay_epilogue_(W, D, keep, step, noise=noise)

    def small_chain(self, X, p, coefficients, precision=None, sign=False):
        """A fused chain costing one call: the plan's composition on the torch primitives."""
        self._tick("small_chain", X)
        reference = dispatch.PinnedKernels(TorchBackend())
        return (so.plan.matrix_sign(reference, X.float(), coefficients, "fp32") if sign
                else so.plan.spectral_power(reference, X.float(), p, coefficients, "fp32"))


class TimedReference(TimedBackend):
    needs_self_check = False


def fake_autotuner(monkeypatch, directory, clock) -> Autotuner:
    """An autotuner that measures CPU tensors with the fake ``clock``, caching under ``directory``, installed
    in dispatch for the test (the ``tuner`` fixture of tests/conftest.py)."""
    monkeypatch.delenv(environment.AUTOTUNE, raising=False)
    made = Autotuner(directory=directory, clock=clock, synchronize=lambda device: None,
                     environment=lambda device: ENVIRONMENT, device_types=("cpu",))
    monkeypatch.setattr(dispatch, "_autotuner", made)
    return made


def install(clock, costs, **options):
    backends = {name: (TimedReference if name == "torch" else TimedBackend)(name, cost, clock, **options.get(name, {}))
                for name, cost in costs.items()}
    for backend in backends.values():
        dispatch.register_backend(backend)
    return backends


def weight(shape=(24, 40)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))
