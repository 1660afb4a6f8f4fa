"""Where a result came from: the machine, its instruction sets and the libraries that computed it.

Every file written into ``docs/results/`` quotes :func:`machine_line` (and its JSON :func:`machine`),
since CPU numbers differ between machines: a bf16 product on a CPU with native bf16 (AVX512_BF16,
AMX) runs a different oneDNN kernel, with another workspace and summation order, than on an AVX2 CPU
that emulates it, and is about 100x faster. ``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS`` cap
the libraries' choices (see docs/testing.md), so they are recorded too.
"""

from __future__ import annotations

import os
import platform
import re

import torch

# The flags that change which kernels torch, MKL and oneDNN run on a CPU (as /proc/cpuinfo names them).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
# The environment variables that cap the instruction sets oneDNN and MKL choose from.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def _cpuinfo() -> tuple[str, list[str]]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", []
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    present = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else platform.machine()), [f for f in ISA_FLAGS if f in present]


def _libraries() -> dict:
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    onednn = re.search(r"MKL-DNN v([\d.]+)", config)
    return {"blas": blas.group(1) if blas else "unknown", "onednn": onednn.group(1) if onednn else None}


def machine() -> dict:
    """The facts a CPU result depends on, as JSON-ready values."""
    model, flags = _cpuinfo()
    return {
        "cpu": model,
        "isa_flags": flags,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": str(torch.__version__),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **_libraries(),
        "isa_caps": {name: os.environ[name] for name in ISA_CAPS if name in os.environ},
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine_line(facts: dict | None = None) -> str:
    """One markdown sentence naming the machine, e.g. ``Intel Xeon (avx2, avx512f, avx512_bf16), 2 threads,
    torch 2.13.0, BLAS mkl, oneDNN 3.12.0``."""
    facts = facts or machine()
    flags = ", ".join(facts["isa_flags"]) or "no AVX2"
    cap = "".join(f", {name}={value}" for name, value in facts.get("isa_caps", {}).items())
    gpu = f", GPU {facts['gpu']}" if facts.get("gpu") else ""
    onednn = f", oneDNN {facts['onednn']}" if facts.get("onednn") else ""
    return (f"{facts['cpu']} ({flags}{cap}), {facts['threads']} threads, torch {facts['torch']} "
            f"(CPU capability {facts['torch_cpu_capability']}), BLAS {facts['blas']}{onednn}{gpu}")
