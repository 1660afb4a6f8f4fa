"""Linear warm-up, then cosine decay to a floor (SPEC 7.5: 256 warm-up steps, cosine to 0.1x)."""

import math


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, floor: float) -> float:
    """``eta_t`` for 0-based ``step``: ``(step + 1) / warmup`` first, then cosine from 1 to ``floor``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps - 1)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
