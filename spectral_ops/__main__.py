"""``python -m spectral_ops``: versions, the compiled CUDA architectures, the GPU, and which
backends are available (or why not)."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from . import __version__, dispatch
from ._extension import load_extension


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cuda_runtime(extension) -> str:
    if extension is None:
        return "extension not built"
    version = extension.cuda_runtime_version()
    return f"{version // 1000}.{version % 1000 // 10} (static, in the extension)"


def report() -> str:
    extension, why_not = load_extension()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible to torch"
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    lines = [
        f"spectral-ops {__version__}",
        "",
        "| component | version |",
        "|---|---|",
        f"| python | {platform.python_version()} |",
        f"| torch | {torch.__version__} |",
        f"| torch CUDA | {torch.version.cuda or 'CPU build'} |",
        f"| triton | {_version_of('triton')} |",
        f"| CUDA runtime | {_cuda_runtime(extension)} |",
        f"| compiled architectures | {', '.join(extension.compiled_archs()) if extension else why_not} |",
        f"| GPU | {gpu} |",
        "",
        f"| backend | on {device.type} tensors |",
        "|---|---|",
    ]
    for name, reason in dispatch.backend_status(device):
        lines.append(f"| {name} | {'available' if reason is None else 'unavailable: ' + reason} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
