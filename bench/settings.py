"""Where and at what sizes the benchmarks run: small shapes on CPU (CI runs them once each),
model-sized ones on a GPU."""

from __future__ import annotations

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
