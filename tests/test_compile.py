"""``spectral_ops._compile``: what torch.compile is told, without importing Dynamo at import time."""

import subprocess
import sys

import torch

from spectral_ops._compile import constant_when_traced


def test_constant_when_traced_marks_a_function_as_torch_compiler_does():
    def ours():
        return 1

    def theirs():
        return 1

    torch.compiler.assume_constant_result(theirs)
    constant_when_traced(ours)
    marks = {name for name in vars(theirs)}
    assert marks and marks == set(vars(ours)) and all(getattr(ours, m) == getattr(theirs, m) for m in marks)


def test_importing_the_package_imports_neither_dynamo_nor_triton():
    # Importing either would fix Triton's mode before a test (or a user) could choose the interpreter.
    code = "import sys, spectral_ops; print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"
