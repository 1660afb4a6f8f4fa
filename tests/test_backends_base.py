"""The primitive contract: every backend and every kind of kernels the plan runs on satisfies the
protocols of ``spectral_ops.backends.base`` by name and by signature, so a primitive added to the
protocol and missed in one implementation fails here, not on a GPU."""

from __future__ import annotations

import inspect

import pytest
import torch

from spectral_ops import dispatch
from spectral_ops.backends.base import PRIMITIVES, Backend, Kernels, Primitives
from spectral_ops.backends.counting import CountingKernels
from spectral_ops.backends.cuda_backend import CudaBackend
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.backends.triton_backend import TritonBackend

BACKENDS = [TorchBackend(), TritonBackend(), CudaBackend()]
KERNELS = [dispatch.kernels_for("polar", torch.zeros(2, 3)), dispatch.PinnedKernels(TorchBackend()),
           CountingKernels()]


def _members(protocol) -> list[str]:
    return [name for name, member in vars(protocol).items() if not name.startswith("_") and callable(member)]


def _accepts(implementation, declared) -> bool:
    """Whether the bound ``implementation`` can be called every way the protocol's ``declared`` method
    allows: the same positional parameters in order, every keyword, and a default wherever the protocol
    has one."""
    got = inspect.signature(implementation).parameters
    wanted = list(inspect.signature(declared).parameters.values())[1:]  # past self
    for parameter in wanted:
        if parameter.name not in got:
            return False
        if parameter.default is not inspect.Parameter.empty and got[parameter.name].default is inspect.Parameter.empty:
            return False
    positional = [q.name for q in wanted if q.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    accepted = [n for n, q in got.items() if q.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    return accepted[:len(positional)] == positional


def test_the_primitives_are_the_protocols_methods():
    assert PRIMITIVES == ("symmetric", "product", "poly_step", "sign_step", "small_chain", "decay_epilogue_")


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_every_backend_is_a_backend(backend):
    assert isinstance(backend, Backend)
    for name in _members(Primitives) + _members(Backend):
        assert _accepts(getattr(backend, name), getattr(Backend, name)), name


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: type(k).__name__)
def test_every_kind_of_kernels_is_kernels(kernels):
    assert isinstance(kernels, Kernels)
    for name in _members(Primitives) + _members(Kernels):
        assert _accepts(getattr(kernels, name), getattr(Kernels, name)), name


def test_a_missing_primitive_fails_the_contract():
    class NoEpilogue(TorchBackend):
        decay_epilogue_ = None

    assert not isinstance(NoEpilogue(), Backend)
