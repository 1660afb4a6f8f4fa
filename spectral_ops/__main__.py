"""``python -m spectral_ops``: versions, the compiled CUDA architectures, the GPU, which backends are
available (or why not) and what the routing cache holds.

``python -m spectral_ops tune --shapes 4096x4096,32x128x768`` measures the routing of the ops on
those shapes ahead of time (on a GPU), so that training runs start with a filled cache.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

import torch

from . import __version__, compat, dispatch, environment, gpu_model, step_tuning, tuning
from ._extension import load_extension
from .plan import PRECISIONS


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
        f"| supported | torch {compat.supported_range(compat.TORCH_RANGE)}, "
        f"triton {compat.supported_range(compat.TRITON_RANGE)} |",
        f"| CUDA runtime | {_cuda_runtime(extension)} |",
        f"| compiled architectures | {', '.join(extension.compiled_archs()) if extension else why_not} |",
        f"| GPU | {gpu} |",
        "",
        f"| backend | on {device.type} tensors |",
        "|---|---|",
    ]
    for name, reason in dispatch.backend_status(device):
        lines.append(f"| {name} | {'available' if reason is None else 'unavailable: ' + reason} |")
    return "\n".join(lines + ["", model_report(gpu), "", routing_report()])


def model_report(gpu: str) -> str:
    """Which providers the cost model may choose where nothing is measured on this machine (dispatch)."""
    arch = gpu_model.arch_for(gpu)
    if arch is None:
        return f"Unmeasured calls: torch (the cost model has no entry for the GPU {gpu!r})"
    measured = sorted(provider for (name, provider) in gpu_model.MEASURED_EFFICIENCY if name == arch.name)
    if not measured:
        return (f"Unmeasured calls: torch (cuBLAS); no GPU check has measured another provider on an {arch.name} "
                "(spectral_ops.gpu_model.MEASURED_EFFICIENCY)")
    return f"Unmeasured calls: the cost model's fastest of torch and {', '.join(measured)} (measured on an {arch.name})"


def routing_report(directory=None) -> str:
    """What the routing cache holds: per environment (GPU and builds), the measured choice and the
    median milliseconds of each backend per primitive, dtype, precision and shape bucket."""
    directory = environment.cache_dir() if directory is None else directory
    autotune = "on" if environment.autotune_enabled() else f"off ({environment.AUTOTUNE}=0)"
    lines = [f"Measured routing: {autotune}; cache {directory}"]
    files = tuning.cached_files(directory)
    if not files:
        return lines[0] + ": empty (filled on first use on a GPU, or by `python -m spectral_ops tune`)"
    for found in files:
        machine = found["environment"]
        if machine is None:
            lines += ["", f"{found['path'].name}: unreadable, ignored"]
            continue
        lines += ["", ", ".join(f"{k} {v}" for k, v in machine.items()) + f" ({found['path'].name})", "",
                  "| primitive | dtype | precision | bucket (batch x rows x cols) | choice | ms per call |",
                  "|---|---|---|---|---|---|"]
        for key, entry in found["choices"].items():
            primitive, dtype, precision, bucket, *steps = key.split("|")
            timings = ", ".join(f"{name} {ms:.3g}" for name, ms in sorted(entry["ms"].items(), key=lambda i: i[1]))
            lines.append(f"| {primitive} {' '.join(steps)} | {dtype} | {precision} | {bucket} | "
                         f"{entry['choice']} | {timings} |")
    return "\n".join(lines)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) < 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"a shape is [batch x] rows x cols, e.g. 4096x4096 or 32x128x768, not {text!r}")
    return shape


def _names(choices):
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}, got {text!r}")
        return names
    return parse


def tune(shapes, dtypes, ops, precision=None, device="cuda") -> str:
    """Run ``ops`` once on random weights of each shape and dtype (a 3-D shape: a stack) so that every
    primitive they call is routed by measurement and cached; returns the cache report."""
    step_tuning.tune([torch.empty(shape, dtype=DTYPES[dtype], device=device) for shape in shapes for dtype in dtypes],
                ops=ops, precision=precision)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return routing_report()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectral_ops", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="{tune}")
    tuner = commands.add_parser("tune", help="measure the routing for given shapes now (needs a GPU)",
                                description="Fill the routing cache by running the ops on random weights.")
    tuner.add_argument("--shapes", type=lambda t: [_shape(s) for s in t.split(",")], required=True,
                       help="comma-separated [batch x] rows x cols, e.g. 4096x4096,16384x4096,32x128x768")
    tuner.add_argument("--dtypes", type=_names(DTYPES), default=["bf16", "fp32"],
                       help=f"comma-separated weight dtypes from {', '.join(DTYPES)} (default: bf16,fp32)")
    tuner.add_argument("--ops", type=_names(step_tuning.TUNE_OPS), default=list(step_tuning.TUNE_OPS),
                       help=f"comma-separated ops to run from {', '.join(step_tuning.TUNE_OPS)} at p = 2 "
                            "(default: all)")
    tuner.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="matmul precision of the ops (default: each dtype's default, see the README)")
    args = parser.parse_args(argv)
    if args.command is None:
        print(report())
        return 0
    if not torch.cuda.is_available():
        print("spectral_ops tune: no CUDA GPU is visible to torch; routing is measured only on GPUs", file=sys.stderr)
        return 2
    if not environment.autotune_enabled():
        print(f"spectral_ops tune: {environment.AUTOTUNE}=0 turns measured routing off; unset it to tune",
              file=sys.stderr)
        return 2
    print(tune(args.shapes, args.dtypes, args.ops, args.precision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
