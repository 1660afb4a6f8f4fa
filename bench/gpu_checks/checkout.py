"""Running from a bare checkout: a GPU machine may have torch and triton, but neither this package
installed nor a package registry. The standard library only: the script calls
:func:`use_this_checkout` before anything imports ``spectral_ops``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent


def use_this_checkout() -> None:
    """Import ``spectral_ops`` from this checkout even where the package is not installed (a bare GPU
    machine has torch and triton but no registry): the checkout goes on ``sys.path``, and
    ``spectral_ops.triton_kernels``, which an install maps to the top-level ``triton_kernels/``, is
    mapped to that folder."""
    if str(ROOT) not in sys.path and importlib.util.find_spec("spectral_ops") is None:
        sys.path.insert(0, str(ROOT))
    import spectral_ops

    if importlib.util.find_spec("spectral_ops.triton_kernels") is None:
        folder = ROOT / "triton_kernels"
        spec = importlib.util.spec_from_file_location("spectral_ops.triton_kernels", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        spectral_ops.triton_kernels = module


def bench_module(name: str):
    """A module of bench/, beside the script (bench/ is no package, and the script may run from a bare checkout)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
