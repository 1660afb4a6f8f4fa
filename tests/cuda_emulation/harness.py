"""Route spectral_ops._extension (and so the CUDA backend) to the emulated module, on CPU tensors."""

from __future__ import annotations

from spectral_ops import _extension


def install(monkeypatch, module) -> None:
    """Within a test: the extension is ``module``, and CPU tensors are described as if on cuda:0."""
    describe = _extension.tensor_descriptor
    monkeypatch.setattr(_extension, "load_extension", lambda: (module, ""))
    monkeypatch.setattr(_extension, "tensor_descriptor", lambda t: (*describe(t)[:4], 0))
