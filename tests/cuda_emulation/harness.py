"""Route spectral_ops._extension (and so the CUDA backend) to the emulated module, on CPU tensors."""

from __future__ import annotations

import contextlib
import ctypes

from spectral_ops import _extension


def install(monkeypatch, module) -> None:
    """Within a test: the extension is ``module``, and CPU tensors are described as if on cuda:0."""
    describe = _extension.tensor_descriptor
    monkeypatch.setattr(_extension, "load_extension", lambda: (module, ""))
    monkeypatch.setattr(_extension, "tensor_descriptor", lambda t: (*describe(t)[:4], 0))


def byte_span(t) -> tuple[int, int]:
    """[first byte, one past the last byte) that the view ``t`` can reach."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@contextlib.contextmanager
def bounds_checked(module, *spans):
    """Within: every global load, store and cp.async of the emulated kernels must lie inside one of
    ``spans`` ((begin, end) byte pairs, e.g. byte_span of each tensor of the call), or the launch
    fails with "global access outside every tensor of the launch"."""
    library = ctypes.CDLL(module.__file__)
    for begin, end in spans:
        library.spectral_ops_emulation_allow(ctypes.c_size_t(begin), ctypes.c_size_t(end))
    try:
        yield
    finally:
        library.spectral_ops_emulation_allow_none()
