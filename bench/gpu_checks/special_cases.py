"""The headline cases that are not kernels: a matmul as the yardstick, ``SpectralMuon`` against
``torch.optim.Muon``, and a ``SpectralAdamW`` step compiled (the default one) or replayed from a CUDA
graph (the capturable one) against eager steps; and their tasks (:func:`special_tasks`).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

import spectral_ops as so
from spectral_ops.linalg import relative_error
from spectral_ops.optim import SpectralAdamW, SpectralMuon

from .cases import seeded_generator, weight
from .runner import HEADLINE_DTYPES, OPTIMIZER_TIMEOUT_S, TIMING_TIMEOUT_S, Task, dtype_name, skipping, time_ms, timings

MUON_SETTINGS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
MUON_VARIANTS = {"torch NS5": dict(ns_coefficients=so.MUON_QUINTIC, ns_steps=5), "Polar Express": {}}
MUON_SHAPES = [(1, 4096, 4096), (1, 16384, 4096), (96, 128, 768)]  # (heads, rows, cols): the decay's headline
# One step of SpectralMuon with torch's quintic against torch.optim.Muon's, both bf16 iterations that
# do not converge (the quintic oscillates): ~2e-2 apart on a CPU. A wrong one is off by O(1).
MUON_TOLERANCE = 5e-2
GRAPH_SHAPE = (1024, 4096)
# Replayed against eager steps, relative to how far the eager steps moved the parameters: the same
# kernels agree to round-off, while a value frozen at capture (a host-side step count) is off by %.
GRAPH_TOLERANCE = 1e-3


def muon_against_torch(heads, rows, cols, variant, device, dry_run, stop_at=math.inf) -> dict:
    """One SpectralMuon step and one torch.optim.Muon step at equal settings from the same start (zero
    weights, the same gradient), compared, then both timed. Ours updates the ``(heads * rows) x cols``
    matrix (head-wise when ``heads > 1``), torch's one parameter per head: how a user gets head-wise
    updates from it. Only torch's own iteration on one matrix is compared: Polar Express converges
    where the quintic does not, and head-wise SpectralMuon scales the lr by the whole block's shape,
    torch by each head's."""
    gradient = torch.randn(heads * rows, cols, generator=seeded_generator(device), device=device)
    ours = torch.nn.Parameter(torch.zeros_like(gradient))
    ours.grad = gradient.clone()
    theirs = [torch.nn.Parameter(torch.zeros(rows, cols, device=device)) for _ in range(heads)]
    for param, grad in zip(theirs, gradient.split(rows)):
        param.grad = grad.clone()
    head_options = {"heads": heads} if heads > 1 else {}
    ours_step = SpectralMuon([ours], **MUON_SETTINGS, **MUON_VARIANTS[variant], **head_options).step
    theirs_step = torch.optim.Muon(theirs, **MUON_SETTINGS).step
    ours_step()
    theirs_step()
    result = {"ok": True}
    if variant == "torch NS5" and heads == 1:
        error = relative_error(ours.detach(), theirs[0].detach())
        result.update(error=error, tolerance=MUON_TOLERANCE, ok=error <= MUON_TOLERANCE)
    else:
        result["note"] = "timed only: a different iteration" if heads == 1 else "timed only: per-head lr scales differ"
    return {**result, **timings(ours_step, theirs_step, device, dry_run, stop_at)}


def _adamw(shape, device, capturable=True):
    """A SpectralAdamW (capturable, or the default) with the p = 2 decay on one weight and one bias,
    fixed gradients: every call starts from the same state."""
    W = torch.nn.Parameter(weight(shape, torch.float32, device)["W"])
    b = torch.nn.Parameter(torch.zeros(shape[-2], device=device))
    generator = seeded_generator(device)
    for param in (W, b):
        param.grad = torch.randn(param.shape, generator=generator, device=device)
    optimizer = SpectralAdamW([W, b], lr=1e-3, weight_decay=0.01, p=2, spectral_weight_decay=0.1, stability="clamp",
                              capturable=capturable)
    return optimizer, [W, b]


@contextlib.contextmanager
def _side_stream(device):
    """CUDA-graph capture wants the steps before it off the default stream (torch's recipe)."""
    if device.type != "cuda":
        yield
        return
    current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


def cuda_graph(step):
    """``step`` captured in a CUDA graph (its launches recorded, not run), returned as the replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def compiled(mode=None):
    """``torch.compile`` as a capture: the default step compiled whole (``mode="reduce-overhead"``:
    replayed from CUDA graphs)."""
    return lambda step: torch.compile(step, mode=mode)


def graph_against_eager(shape, device, dry_run, stop_at=math.inf, capture=cuda_graph, warmup=3, steps=5,
                        capturable=True) -> dict:
    """A SpectralAdamW step (``capturable`` or the default), warmed up, captured by ``capture`` (a
    CUDA graph, or :func:`compiled`; the tests pass the step itself) and replayed ``steps`` times,
    against as many eager steps of a twin from the same state; then one replay timed against one
    eager step. A step that synchronises with the host cannot be captured: the capture raises, and
    the case fails with its message."""
    graphed, graphed_params = _adamw(shape, device, capturable)
    eager, eager_params = _adamw(shape, device, capturable)
    with _side_stream(device):
        for _ in range(warmup):
            graphed.step()
            eager.step()
    start = [param.detach().clone() for param in eager_params]
    replay = capture(graphed.step)
    for _ in range(steps):
        replay()
        eager.step()
    moved = max(float((param.detach() - first).abs().max()) for param, first in zip(eager_params, start))
    difference = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(graphed_params, eager_params))
    error = difference / moved
    return {"error": error, "tolerance": GRAPH_TOLERANCE, "ok": error <= GRAPH_TOLERANCE,
            "max_abs_diff": difference, "note": f"max abs difference {difference:.1e} after {steps} replays",
            **timings(replay, eager.step, device, dry_run, stop_at)}


def yardstick(n, dtype, device, dry_run, stop_at=math.inf) -> dict:
    """An ``n^3`` matmul: stacked per-head decay should be comparable to a 4096^3 GEMM."""
    A = torch.randn(n, n, generator=seeded_generator(device), device=device).to(dtype)
    ms, runs = time_ms(lambda: A @ A, device, dry_run, stop_at)
    return {"ok": True, "ms": ms, "runs": runs, "note": f"{2 * n**3 / ms / 1e9:.1f} TFLOP/s"}


def special_tasks(device, dry_run) -> list[Task]:
    """The cases that are not kernels: the yardstick and SpectralMuon against torch's (headline), and
    the compiled steps and the CUDA-graph replay (breadth, last, so that a failed capture cannot disturb
    the timings before them)."""
    needs_cuda = None if device.type == "cuda" else "needs a CUDA device"
    n = 64 if dry_run else 4096
    tasks = [Task("headline", "timing", "torch matmul (yardstick)", "torch", dtype_name(dtype), (n, n, n),
                  functools.partial(yardstick, n, dtype, device, dry_run), TIMING_TIMEOUT_S)
             for dtype in HEADLINE_DTYPES if not (dry_run and dtype == torch.bfloat16)]
    no_muon = needs_cuda or (None if hasattr(torch.optim, "Muon")
                             else f"torch {torch.__version__} has no torch.optim.Muon")
    for variant in MUON_VARIANTS:
        for heads, rows, cols in MUON_SHAPES:
            run = functools.partial(muon_against_torch, heads, rows, cols, variant, device, dry_run)
            tasks.append(Task("headline", "timing", f"SpectralMuon ({variant}, bf16) vs torch.optim.Muon", "auto",
                              "float32", (heads, rows, cols), skipping(no_muon) if no_muon else run,
                              OPTIMIZER_TIMEOUT_S, baseline="torch.optim.Muon", cost="optimizer"))
    captures = {"SpectralAdamW default step, torch.compile": dict(capture=compiled(), capturable=False),
                "SpectralAdamW default step, torch.compile reduce-overhead":
                    dict(capture=compiled("reduce-overhead"), capturable=False),
                "SpectralAdamW step in a CUDA graph": {}}
    for name, options in captures.items():
        run = functools.partial(graph_against_eager, GRAPH_SHAPE, device, dry_run, **options)
        tasks.append(Task("breadth", "timing", name, "auto", "float32", GRAPH_SHAPE,
                          skipping(needs_cuda) if needs_cuda else run, OPTIMIZER_TIMEOUT_S, baseline="eager step",
                          cost="compiled step" if "compile" in name else "optimizer"))
    return tasks
