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
    """Import ``spectral_ops`` from this checkout, whether or not a package is installed (a bare GPU
    machine has torch and triton but no registry; a developer's machine may have another checkout
    installed, which must not be checked instead): the checkout goes first on ``sys.path``, and
    ``spectral_ops.triton_kernels``, which an install maps to the top-level ``triton_kernels/``, is
    mapped to this checkout's folder unless it already resolves there."""
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    import spectral_ops

    folder = ROOT / "triton_kernels"
    found = importlib.util.find_spec("spectral_ops.triton_kernels")
    if found is None or folder.resolve() not in Path(found.origin).resolve().parents:
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
