"""The interpreter's bookkeeping cut by ``spectral_ops.triton_kernels.interpreter``: kernels compute what
they computed, the language is restored after every launch, and the overflow checks switch."""

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

from spectral_ops.triton_kernels import interpreter

pytestmark = pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="the interpreter's own behaviour")


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _doubled_plus_index(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    for _ in range(2):  # the nested call runs twice per program
        x = _scaled(x, 2)
    tl.store(out_ptr + offsets, x + offsets)


@triton.jit
def _squared(x_ptr, out_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, x * x)


def test_a_kernel_with_nested_calls_computes_the_same_and_the_language_is_restored_after_the_launch():
    original = (tl.load, tl.arange, tl.core.tensor.__add__)
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty_like(x)
    _doubled_plus_index[(1,)](x, out, BLOCK=16)
    assert torch.equal(out, 4 * x + torch.arange(16))
    assert (tl.load, tl.arange, tl.core.tensor.__add__) == original
    with pytest.raises(InterpreterError, match="power of 2"):  # a failed launch restores too
        _doubled_plus_index[(1,)](x, out, BLOCK=15)  # not a power of 2
    assert (tl.load, tl.arange, tl.core.tensor.__add__) == original


def test_overflow_checks_raise_inside_the_block_only():
    x, out = torch.tensor([65536], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with interpreter.overflow_checks(), pytest.raises(InterpreterError, match="int32 overflow detected"):
        _squared[(1,)](x, out)
    _squared[(1,)](x, out)  # outside: no check, as in a compiled kernel
    assert int(out) == 0  # 2^32 wraps to 0 in int32
    with interpreter.overflow_checks():
        _squared[(1,)](torch.tensor([3], dtype=torch.int32), out)
    assert int(out) == 9
