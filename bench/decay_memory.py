"""``python bench/decay_memory.py [--shapes 256x256 1024x256 ...] [--out-md FILE.md] [--out-json FILE.json]``

The workspace of one decay step against the size of the matrix it decays, on CPU: the peak of the
bytes allocated (net of frees) while ``spectral_ops.spectral_decay_`` runs, from torch.profiler's
allocation events (``profile_memory=True``) taken in time order, so a temporary freed before the
next one is allocated is not counted twice, as the profiler's per-op totals would count it.

What it sees is what goes through torch's CPU allocator: every tensor, not the BLAS libraries'
private scratch buffers (a few small blocks per thread, independent of the matrix count).

Rows: spectral_decay_ for each shape, dtype and power; optionally a band decay (``Band(tau, "top")``,
p = 2) and one SpectralAdamW step (p = 1 and p = 2, measured on its second step, when the Adam
moments exist), next to torch.optim.AdamW's step as the baseline of the Adam half. "x W" is the
peak in units of the weight's own bytes; "x fp32 W" in units of a float32 copy of it (the plan's
math dtype), the unit the temporaries of p >= 2 come in.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import spectral_ops
from spectral_ops import Band
from spectral_ops.optim import SpectralAdamW

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
LR, COEFFICIENT = 0.01, 0.1  # lr * coefficient * s_max^(p-1) stays far below 1: no stability clamp fires


def parse_shape(text: str) -> tuple[int, tuple[int, int]]:
    """``"256x256"`` -> (1, (256, 256)); ``"4@256x256"`` -> a list of 4 such matrices."""
    count, _, shape = text.rpartition("@")
    m, n = (int(side) for side in shape.lower().split("x"))
    return int(count or 1), (m, n)


def allocation_events(run) -> list[tuple[int, int]]:
    """``(time in ns, bytes)`` of every CPU allocation (positive) and free (negative) while ``run`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    return sorted(events, key=lambda event: event[0])  # stable: same-time events keep their order


def peak_bytes(run, repeats: int = 2) -> int:
    """The highest running sum of the allocations over the start (0: nothing outlived a free), the
    worst of ``repeats`` profiled calls after one unprofiled warm-up call (routing caches, lazy
    initialisation and first-call allocations are not the step's workspace)."""
    run()
    peaks = []
    for _ in range(repeats):
        running = peak = 0
        for _, nbytes in allocation_events(run):
            running += nbytes
            peak = max(peak, running)
        peaks.append(peak)
    return max(peaks)


def weights(count: int, shape, dtype, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Unit-scale entries over sqrt(n): singular values of order 1, as trained weights have.
    return [(torch.randn(shape, generator=generator) / math.sqrt(shape[1])).to(dtype) for _ in range(count)]


def decay_call(tensors, p: int, band=None):
    argument = tensors[0] if len(tensors) == 1 else tensors
    return lambda: spectral_ops.spectral_decay_(argument, p, LR, COEFFICIENT, band=band)


def optimizer_step(tensors, p: int | None):
    """One step of SpectralAdamW (or, for ``p=None``, torch.optim.AdamW's foreach step)."""
    parameters = [torch.nn.Parameter(t) for t in tensors]
    if p is None:
        optimizer = torch.optim.AdamW(parameters, lr=LR, weight_decay=COEFFICIENT, foreach=True)
    else:
        optimizer = SpectralAdamW(parameters, lr=LR, weight_decay=0.0, p=p, spectral_weight_decay=COEFFICIENT)
    generator = torch.Generator().manual_seed(1)
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
    optimizer.step()  # the first step allocates the moments: the state, not the step's workspace
    return optimizer.step


def row(case: str, count: int, shape, dtype_name: str, p, peak: int) -> dict:
    numel = count * shape[0] * shape[1]
    matrix_bytes = numel * DTYPES[dtype_name].itemsize
    return {"case": case, "shape": f"{count}@{shape[0]}x{shape[1]}" if count > 1 else f"{shape[0]}x{shape[1]}",
            "dtype": dtype_name, "p": p, "matrix_bytes": matrix_bytes, "peak_bytes": peak,
            "x_matrix": peak / matrix_bytes, "x_fp32_matrix": peak / (4 * numel)}


def measure(shapes, dtype_names, powers, band: bool, optimizer: bool, repeats: int) -> list[dict]:
    rows = []
    for text in shapes:
        count, shape = parse_shape(text)
        for dtype_name in dtype_names:
            dtype = DTYPES[dtype_name]
            for p in powers:
                peak = peak_bytes(decay_call(weights(count, shape, dtype), p), repeats)
                rows.append(row("spectral_decay_", count, shape, dtype_name, p, peak))
            if band:
                tensors = weights(count, shape, dtype)
                # tau between the modes (singular values of a random matrix spread over about (0, 2)).
                peak = peak_bytes(decay_call(tensors, 2, Band(tau=1.0, mode="top")), repeats)
                rows.append(row("band top, tau 1", count, shape, dtype_name, 2, peak))
            if optimizer:
                for p in (None, 1, 2):
                    peak = peak_bytes(optimizer_step(weights(count, shape, dtype), p), repeats)
                    name = "torch AdamW step" if p is None else "SpectralAdamW step"
                    rows.append(row(name, count, shape, dtype_name, "-" if p is None else p, peak))
    return rows


def markdown(rows: list[dict], title: bool = True) -> str:
    lines = []
    if title:
        lines += ["# Workspace of one decay step (CPU)", "",
                  f"`python bench/decay_memory.py` (torch {torch.__version__}, {torch.get_num_threads()} threads). "
                  "Peak of the bytes allocated, net of frees, while one call runs, from torch.profiler's "
                  "allocation events in time order, after a warm-up call; lr 0.01, coefficient 0.1, "
                  "`precision=None` (bf16 weights: bf16 products, fp32 decay arithmetic). "
                  "x W: in units of the weights' bytes; x fp32 W: in units of a float32 copy of them "
                  "(the math dtype, the unit of the plan's temporaries). The optimizer rows are the "
                  "second step (the moments exist), the whole step: decay and Adam.", ""]
    lines += ["| case | shape | dtype | p | W bytes | peak extra bytes | x W | x fp32 W |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['shape']} | {r['dtype']} | {r['p']} | {r['matrix_bytes']:,} | "
                     f"{r['peak_bytes']:,} | {r['x_matrix']:.2f} | {r['x_fp32_matrix']:.2f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(description="The workspace of one decay step against the matrix size, on CPU: "
                                               "the peak net allocation from torch.profiler's allocation events.")
    main.add_argument("--shapes", nargs="+", default=["256x256", "1024x256", "256x1024", "4@256x256"],
                      help="MxN for one matrix, K@MxN for a list of K same-shape matrices "
                           "(default: 256x256 1024x256 256x1024 4@256x256)")
    main.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"],
                      help="weight dtypes (default: fp32 bf16)")
    main.add_argument("--powers", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                      help="spectral powers p (default: 0 1 2 3 4)")
    main.add_argument("--no-band", dest="band", action="store_false",
                      help="skip the band decay rows (Band(tau=1, mode='top'), p = 2)")
    main.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                      help="skip the optimizer rows (torch AdamW; SpectralAdamW with p = 1 and 2)")
    main.add_argument("--repeats", type=int, default=2,
                      help="profiled calls per row after one warm-up call; the worst is kept (default: 2)")
    main.add_argument("--out-md", type=Path, default=None,
                      help="write the markdown table here (default: print it only)")
    main.add_argument("--out-json", type=Path, default=None, help="write the rows as JSON here")
    return main


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    rows = measure(args.shapes, args.dtypes, args.powers, args.band, args.optimizer, args.repeats)
    print(markdown(rows, title=False), end="")
    if args.out_md:
        args.out_md.write_text(markdown(rows))
    if args.out_json:
        args.out_json.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                             "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
