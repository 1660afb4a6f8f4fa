"""Where and at what sizes the benchmarks run: small shapes on CPU (CI runs them once each),
model-sized ones on a GPU."""

from __future__ import annotations

import statistics
import time

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if DEVICE.type == "cuda":
    DTYPES = [torch.bfloat16, torch.float32]
    SHAPES = {
        "square": [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192)],
        "mlp": [(4 * 1024, 1024), (1024, 4 * 1024), (16384, 4096), (4096, 16384)],
        "heads": [(96, 128, 768), (32, 128, 4096)],
        "moe": [(64, 2048, 1024)],
    }
else:
    DTYPES = [torch.float32, torch.bfloat16]
    SHAPES = {
        "square": [(64, 64), (256, 256)],
        "mlp": [(4 * 64, 64), (64, 4 * 64)],
        "heads": [(8, 32, 128)],
        "moe": [(4, 128, 64)],
    }
ALL_SHAPES = [shape for family in SHAPES.values() for shape in family]


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(benchmark, steps: dict, rounds: int, warmup_rounds: int) -> dict:
    """Median seconds of each of ``steps`` (name -> a call), timed back to back in each round so that
    every call sees the same machine state; pytest-benchmark times the rounds themselves."""
    times = {name: [] for name in steps}

    def interleaved_round():
        for name, step in steps.items():
            synchronize()
            start = time.perf_counter()
            step()
            synchronize()
            times[name].append(time.perf_counter() - start)

    benchmark.pedantic(interleaved_round, rounds=rounds, iterations=1, warmup_rounds=warmup_rounds)
    return {name: statistics.median(seconds) for name, seconds in times.items()}
