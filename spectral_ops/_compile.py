"""What torch.compile needs to know about this package, declared without importing ``torch._dynamo``.

Importing Dynamo imports Inductor and Triton, which would make ``import spectral_ops`` slow and fix
Triton's mode before a test can choose the interpreter (``TRITON_INTERPRET``).
"""

from __future__ import annotations


def constant_when_traced(fn):
    """``torch.compiler.assume_constant_result``: torch.compile calls ``fn`` while tracing and uses
    its result as a constant. That decorator only sets this attribute, which Dynamo reads when it
    traces (``tests/test_compile.py`` checks that they agree)."""
    fn._dynamo_marked_constant = True
    return fn
