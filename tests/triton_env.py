"""Shared by the ``test_triton_*`` modules, which import it before anything else.

The Triton tests run the kernels on CPU tensors under Triton's interpreter. ``triton.jit`` picks
compiled or interpreted when a kernel is *decorated*, i.e. when ``spectral_ops.triton_kernels`` is
first imported, so ``TRITON_INTERPRET=1`` must be set before that, and before anything imports triton
itself: ``tests/conftest.py`` sets it before pytest collects a module (a framework imported at collection
imports triton), and this module sets it too, for its users run outside the suite. ``setdefault`` lets a
GPU machine run the same tests compiled with ``TRITON_INTERPRET=0``. This module keeps the Triton imports
out of the suite's conftest.

The variable then stays set for the whole session. That is harmless for the other modules: on CPU
tensors the triton backend is only used when it is forced, so unforced calls still go to torch.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from spectral_ops.triton_kernels import interpreter  # noqa: E402
from spectral_ops.triton_kernels.common import Config  # noqa: E402

interpreter.speed_up()  # its bookkeeping, not the kernels' arithmetic (the module's docstring)


# 16 x 16 tiles, 16-deep steps: shapes up to 64 then span several tiles (and a ragged last one),
# so the tile maps, masks and mirrored stores are exercised at interpreter-friendly sizes.
SMALL_TILES = Config(16, 16, 16, 1, 1)
DTYPES = [torch.float32, torch.float16]
# Relative error of one fp32-accumulated product against float64 (inner sizes <= 64); fp16 adds
# the input rounding of the operands it is compared on (none: the reference sees the same values).
PRODUCT_TOLERANCE = 1e-6


def randn(shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def small_integers(shape, dtype=torch.float32, seed=0, bound=3):
    """Integers in [-bound, bound]: every product and sum below is exact in fp16 inputs / fp32 sums."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-bound, bound + 1, shape, generator=generator).to(dtype)


def symmetric(shape, dtype=torch.float32, seed=0, integers=False, bound=3):
    A = small_integers(shape, torch.float64, seed, bound) if integers else randn(shape, torch.float64, seed)
    return (A + A.mT).to(dtype)


def relative(result, reference) -> float:
    result, reference = result.double(), reference.double()
    return float(torch.linalg.vector_norm(result - reference) / torch.linalg.vector_norm(reference))


def max_asymmetry(D) -> float:
    return float((D - D.mT).abs().max())

