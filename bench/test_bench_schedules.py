"""The Gram-space iteration against the rectangle (issue #15), interleaved in one run.

An S_2 (and a p = 2 decay) of a 4:1 weight, both ways on the same backend: Polar Express on the
``r x N`` rectangle (the reference algorithm, composed of plain torch matmuls on a CPU)
and the same steps on ``r x r`` Grams, restarted from the rectangle every 3 steps (``"gram_space"``,
which ``"auto"``, the default, picks for these shapes). Each round runs one of each, back to
back; the ratio of the medians and both FLOP counts (``FlopCounterMode``, as torch counts them) go
into ``extra_info`` (goals: at most 0.75x the time, at most 100 r^3 FLOPs).
"""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops.linalg import log_spaced_spectrum, matrix_with_spectrum

from settings import DEVICE, interleaved_medians

ROUNDS = 7
CALLS = {
    "S_2": lambda W, iteration: so.spectral_power(W, 2, method="gram", precision="fp32", iteration=iteration),
    "p=2 decay": lambda W, iteration: so.spectral_decay_(W.clone(), 2, 1e-3, 0.1, iteration=iteration,
                                                         precision="fp32"),
}


def torch_flops(call) -> int:
    # Imported here: it imports triton, which must wait until the Triton tests have set up the
    # interpreter (tests/triton_env.py) when pytest collects tests and bench together.
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [(2048, 512), (512, 2048)], ids=str)
@pytest.mark.parametrize("name", list(CALLS))
def test_gram_space_against_the_rectangle(benchmark, name, shape):
    W = matrix_with_spectrum(shape, log_spaced_spectrum(min(shape), 1e3), torch.float32).to(DEVICE)
    calls = {iteration: (lambda iteration=iteration: CALLS[name](W, iteration))
             for iteration in ("gram_space", "rectangle")}
    medians = interleaved_medians(benchmark, calls, rounds=1 if benchmark.disabled else ROUNDS,
                                  warmup_rounds=0 if benchmark.disabled else 1)
    r = min(shape)
    benchmark.extra_info.update(
        op="schedule_vs_rectangle", implementation=f"gram_space {name}", case=f"{shape[0]}x{shape[1]}, kappa 1e3",
        shape=list(shape), dtype="float32", precision="fp32", device=DEVICE.type,
        ours_median_s=medians["gram_space"], torch_median_s=medians["rectangle"],
        ratio=medians["gram_space"] / medians["rectangle"],
        flops_r3=torch_flops(calls["gram_space"]) / r**3, rectangle_flops_r3=torch_flops(calls["rectangle"]) / r**3)
