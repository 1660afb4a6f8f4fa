"""The recipes of docs/integrations.md (and of docs/monitoring.md) as the tests run them, and the frameworks
they run in.

A section's ```python blocks run in order in one namespace, seeded with what the section says the
user brings (a model, a dataset): the test then checks what they built."""

from __future__ import annotations

import importlib
import os
import platform
import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"
INTEGRATIONS = DOCS / "integrations.md"
MONITORING = DOCS / "monitoring.md"

# Set by `make test`: on the pinned torch, where requirements-integrations.txt is installed, a framework
# that cannot be imported fails its tests instead of skipping them.
REQUIRED = os.environ.get("SPECTRAL_OPS_REQUIRE_INTEGRATIONS") == "1"


def sections(document: Path = INTEGRATIONS) -> dict[str, list[str]]:
    """Each ``## `` section of ``document``: its ```python blocks (none outside a section)."""
    text = document.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    blocks = {title.strip(): re.findall(r"^```python\n(.*?)^```", body, flags=re.DOTALL | re.MULTILINE)
              for title, body in zip(parts[1::2], parts[2::2])}
    return {"": re.findall(r"^```python\n(.*?)^```", parts[0], flags=re.DOTALL | re.MULTILINE), **blocks}


def run_recipe(section: str, *, document: Path = INTEGRATIONS, **given) -> dict:
    """Run the section's blocks of ``document``, as written, in one namespace holding ``given``; return the
    namespace."""
    blocks = sections(document)[section]
    assert blocks, f"{document.name}'s section {section!r} has no python block"
    namespace = {"__name__": "recipe", **given}
    for block in blocks:
        # dont_inherit: a block is compiled as a user's module is, without this file's __future__ imports (under
        # postponed annotations a dataclass defined in a block cannot resolve its fields' types).
        exec(compile(block, f"{document}:{section}", "exec", dont_inherit=True), namespace)
    return namespace


def framework(module: str):
    """Import a framework's module, or skip the calling test module with the reason (printed by
    ``-rs``): the framework cannot import on the running Python or torch. Where ``make test`` requires the
    frameworks, the failure to import fails instead."""
    try:
        return importlib.import_module(module)
    except Exception as error:  # a framework's import can fail in its own ways on an unsupported torch
        reason = (f"{module} cannot be imported on Python {platform.python_version()} with torch {torch.__version__}: "
                  f"{type(error).__name__}: {error}")
        if REQUIRED:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason, allow_module_level=True)


def assert_bitwise_equal(a, b, where="state"):
    """Nested state (dicts, lists, tensors, numbers) equal bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where
